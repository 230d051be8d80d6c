//! The driver's checkpoint lock, as seen from inside the process.
//!
//! The real driver blocks every CUDA call of a process while it is locked or checkpointed
//! (`cuCheckpointProcessLock` .. `Unlock`). The checkpoint side of the stand-in driver
//! (`fake-cuda`, loaded by the plugin inside CRIU) keeps that state in `$FAKECUDA_DIR/<pid>.state`
//! (`running`, `locked`, `checkpointed`, `failed`; no file = running), replaced atomically. When
//! this process has `FAKECUDA_DIR` in its environment, every working call reads that file first
//! and waits while it says `locked` or `checkpointed`, as the real driver would; `failed` makes
//! calls fail with `CUDA_ERROR_UNKNOWN`. So a plugin or agent that made driver calls in the wrong
//! phase would hang or fail here as it would on a GPU, instead of passing unnoticed.
//!
//! A workload started with `FAKECUDADEV_STATE_PAGE=1` keeps that state in its own memory instead
//! ([`crate::state_page`]), where the checkpoint side finds it under any pid.
//!
//! Nothing is locked while waiting: the thread sleeps in 1 ms steps (a ptrace stop there is
//! harmless).

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::call::{CuResult, debug};
use crate::codes::UNKNOWN;

/// The directory the checkpoint side keeps its state in (shared with `fake-cuda`).
pub const DIR_ENV: &str = "FAKECUDA_DIR";

/// After this long a waiting call says so on stderr (with `FAKECUDADEV_DEBUG=1`).
const REPORT_AFTER: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(1);

/// `$FAKECUDA_DIR`, read once (None: not set, the lock and injections are not looked at).
pub fn dir() -> Option<&'static PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        std::env::var_os(DIR_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
    })
    .as_ref()
}

/// What the state file says about this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lock {
    Free,
    Held,
    Failed,
}

/// Parses a state file's contents (`None`: no file).
pub fn parse(contents: Option<&str>) -> Lock {
    match contents.map(str::trim) {
        Some("locked" | "checkpointed") => Lock::Held,
        Some("failed") => Lock::Failed,
        _ => Lock::Free,
    }
}

/// `$FAKECUDA_DIR/<this pid>.<suffix>`, when `FAKECUDA_DIR` is set.
pub fn pid_file(suffix: &str) -> Option<PathBuf> {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    dir().map(|d| d.join(format!("{pid}.{suffix}")))
}

fn current() -> Lock {
    // A process with its state page (containers, see `state_page`) is read there: its file
    // name would be its pid in its own namespace, which the checkpoint side does not know.
    if let Some(raw) = crate::state_page::state() {
        return match raw {
            1 | 2 => Lock::Held,
            3 => Lock::Failed,
            _ => Lock::Free,
        };
    }
    let Some(path) = pid_file("state") else {
        return Lock::Free;
    };
    parse(std::fs::read_to_string(path).ok().as_deref())
}

/// Counts a call in flight ([`crate::calls`]) once the process is not locked; `Err` if the
/// driver state is `failed`. The count is raised before the state is read, and dropped again
/// while the call waits, so a lock either sees the call or the call sees the lock.
pub fn enter_unlocked(call: &str) -> Result<crate::calls::InFlight, crate::codes::CUresult> {
    loop {
        let counted = crate::calls::enter();
        if !counted.outermost() {
            // Inside a call of this thread's that already passed the lock.
            return Ok(counted);
        }
        match current() {
            Lock::Free => return Ok(counted),
            Lock::Failed => {
                debug(format_args!("{call}: the driver state is `failed`"));
                return Err(UNKNOWN);
            }
            Lock::Held => {}
        }
        drop(counted);
        wait_until_unlocked(call)?;
    }
}

/// Returns once the process is not locked; `Err` if the driver state is `failed`.
pub fn wait_until_unlocked(call: &str) -> CuResult {
    let start = Instant::now();
    let mut reported = false;
    loop {
        match current() {
            Lock::Free => {
                if reported {
                    debug(format_args!(
                        "{call}: the checkpoint lock was released after {:.3} s",
                        start.elapsed().as_secs_f64()
                    ));
                }
                return Ok(());
            }
            Lock::Failed => {
                debug(format_args!("{call}: the driver state is `failed`"));
                return Err(UNKNOWN);
            }
            Lock::Held => {}
        }
        if !reported && start.elapsed() >= REPORT_AFTER {
            debug(format_args!(
                "{call}: waiting for the checkpoint lock for {} s",
                REPORT_AFTER.as_secs()
            ));
            reported = true;
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_file_contents() {
        assert_eq!(parse(None), Lock::Free);
        assert_eq!(parse(Some("running\n")), Lock::Free);
        assert_eq!(parse(Some("locked\n")), Lock::Held);
        assert_eq!(parse(Some("checkpointed")), Lock::Held);
        assert_eq!(parse(Some("failed\n")), Lock::Failed);
        assert_eq!(parse(Some("")), Lock::Free);
    }
}
