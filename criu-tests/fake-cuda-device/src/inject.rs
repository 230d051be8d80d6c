//! Fault injection for the tests: `$FAKECUDA_DIR/<pid>.dev-inject`, read by every working call,
//! one directive a line:
//!
//! - `fail <call> [after <n>]`: `<call>` (its exported name, e.g. `cuMemCreate`) fails with
//!   `CUDA_ERROR_UNKNOWN`;
//! - `hang <call> [after <n>]`: `<call>` never returns (the thread sleeps in 100 ms steps), as a
//!   driver call stuck on a wedged GPU (before the call is in flight: the lock does not wait);
//! - `slow <call> [after <n>]`: `<call>` takes [`SLOW`] longer, in flight (a checkpoint lock
//!   taken meanwhile waits for it).
//!
//! With `after <n>`, the first `n` calls of `<call>` made while the directive is in the file go
//! through and the ones after them fail or hang (e.g. the second `cuMemUnmap` of a release).
//!
//! A file, not the environment, so a test can arm it while the process runs (its allocations
//! made), between a dump and a restore, and so on. Without `FAKECUDA_DIR` nothing is read.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::call::debug;
use crate::codes::UNKNOWN;

/// What to do to a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Fail,
    Hang,
    Slow,
}

/// How much longer a `slow` call takes.
pub const SLOW: Duration = Duration::from_millis(500);

/// A directive for one call: the action, and how many calls go through first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Directive {
    pub action: Action,
    pub after: u64,
}

/// Parses the file's contents for `call`.
pub fn parse(contents: &str, call: &str) -> Option<Directive> {
    contents.lines().find_map(|l| {
        let w: Vec<&str> = l.split_ascii_whitespace().collect();
        let action = match *w.first()? {
            "fail" => Action::Fail,
            "hang" => Action::Hang,
            "slow" => Action::Slow,
            _ => return None,
        };
        if *w.get(1)? != call {
            return None;
        }
        let after = match w.get(2..) {
            Some([]) | None => 0,
            Some(["after", n]) => n.parse().ok()?,
            Some(_) => return None,
        };
        Some(Directive { action, after })
    })
}

/// Calls seen per call name while a directive for it was armed.
static SEEN: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);

/// Counts this call; true once more than `after` have been seen.
fn due(call: &str, after: u64) -> bool {
    let mut g = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    let n = g
        .get_or_insert_with(HashMap::new)
        .entry(call.to_owned())
        .or_insert(0);
    *n += 1;
    *n > after
}

/// Applies a directive for `call`, if any; `Ok(true)`: the call is to be slow (the caller
/// sleeps [`SLOW`] once it is in flight).
pub fn apply(call: &str) -> Result<bool, crate::codes::CUresult> {
    let Some(path) = crate::lock::pid_file("dev-inject") else {
        return Ok(false);
    };
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(false);
    };
    let Some(d) = parse(&text, call) else {
        return Ok(false);
    };
    if !due(call, d.after) {
        return Ok(false);
    }
    match d.action {
        Action::Fail => {
            debug(format_args!("{call}: failing as injected"));
            Err(UNKNOWN)
        }
        Action::Slow => {
            debug(format_args!("{call}: slow as injected"));
            Ok(true)
        }
        Action::Hang => {
            debug(format_args!("{call}: hanging as injected"));
            loop {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives() {
        let f = "fail cuMemCreate\nhang cuMemcpyDtoHAsync_v2\nfail cuMemUnmap after 1\nbogus x\n";
        let d = |action, after| Some(Directive { action, after });
        assert_eq!(parse(f, "cuMemCreate"), d(Action::Fail, 0));
        assert_eq!(parse(f, "cuMemcpyDtoHAsync_v2"), d(Action::Hang, 0));
        assert_eq!(parse(f, "cuMemUnmap"), d(Action::Fail, 1));
        assert_eq!(parse(f, "cuMemMap"), None);
        assert_eq!(parse("", "cuMemMap"), None);
        assert_eq!(parse("fail cuMemMap later 3", "cuMemMap"), None);
    }

    #[test]
    fn counts_calls_before_acting() {
        assert!(!due("test-call", 2));
        assert!(!due("test-call", 2));
        assert!(due("test-call", 2));
        assert!(due("test-call", 2));
    }
}
