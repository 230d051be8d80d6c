//! Fault injection for the tests: `$FAKECUDA_DIR/<pid>.dev-inject`, read by every working call,
//! one directive a line:
//!
//! - `fail <call>`: `<call>` (its exported name, e.g. `cuMemCreate`) fails with
//!   `CUDA_ERROR_UNKNOWN`;
//! - `hang <call>`: `<call>` never returns (the thread sleeps in 100 ms steps), as a driver
//!   call stuck on a wedged GPU.
//!
//! A file, not the environment, so a test can arm it while the process runs (its allocations
//! made), between a dump and a restore, and so on. Without `FAKECUDA_DIR` nothing is read.

use std::time::Duration;

use crate::call::{CuResult, debug};
use crate::codes::UNKNOWN;

/// What the file says about `call`: fail, hang, or nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Directive {
    Fail,
    Hang,
}

/// Parses the file's contents for `call`.
pub fn parse(contents: &str, call: &str) -> Option<Directive> {
    contents.lines().find_map(|l| {
        let mut w = l.split_ascii_whitespace();
        let d = match w.next()? {
            "fail" => Directive::Fail,
            "hang" => Directive::Hang,
            _ => return None,
        };
        (w.next()? == call).then_some(d)
    })
}

/// Applies a directive for `call`, if any.
pub fn apply(call: &str) -> CuResult {
    let Some(path) = crate::lock::pid_file("dev-inject") else {
        return Ok(());
    };
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    match parse(&text, call) {
        None => Ok(()),
        Some(Directive::Fail) => {
            debug(format_args!("{call}: failing as injected"));
            Err(UNKNOWN)
        }
        Some(Directive::Hang) => {
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
        let f = "fail cuMemCreate\nhang cuMemcpyDtoHAsync_v2\nbogus x\n";
        assert_eq!(parse(f, "cuMemCreate"), Some(Directive::Fail));
        assert_eq!(parse(f, "cuMemcpyDtoHAsync_v2"), Some(Directive::Hang));
        assert_eq!(parse(f, "cuMemMap"), None);
        assert_eq!(parse("", "cuMemMap"), None);
    }
}
