//! How every entry point runs: catch panics (none may unwind into C), wait while the checkpoint
//! lock holds the process (see [`crate::lock`]), apply an injected fault ([`crate::inject`]), run
//! the body, and with `FAKECUDADEV_DEBUG=1` report failures on stderr.

use std::panic::AssertUnwindSafe;
use std::sync::OnceLock;

use crate::codes::{self, CUresult, INVALID_VALUE, SUCCESS, UNKNOWN};

/// A body's outcome: `Err(code)` is returned to the caller as is.
pub type CuResult = Result<(), CUresult>;

/// Environment variable: `1` logs every failing call (and lock waits) on stderr.
pub const DEBUG_ENV: &str = "FAKECUDADEV_DEBUG";

pub fn debug_enabled() -> bool {
    static DEBUG: OnceLock<bool> = OnceLock::new();
    *DEBUG.get_or_init(|| std::env::var(DEBUG_ENV).is_ok_and(|v| v == "1"))
}

/// One line on stderr, prefixed with the library's name and the thread id.
pub fn debug(msg: std::fmt::Arguments<'_>) {
    if debug_enabled() {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        eprintln!("fakecudadev[{tid}]: {msg}");
    }
}

/// A driver call that does work: waits for the checkpoint lock first.
pub fn run(call: &str, body: impl FnOnce() -> CuResult) -> CUresult {
    run_inner(call, true, body)
}

/// A call the checkpoint lock does not hold up (error names, version, symbol lookup).
pub fn run_unlocked(call: &str, body: impl FnOnce() -> CuResult) -> CUresult {
    run_inner(call, false, body)
}

fn run_inner(call: &str, gated: bool, body: impl FnOnce() -> CuResult) -> CUresult {
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
        // In flight while its body runs, so that the checkpoint lock waits for it (`calls`).
        // An injected hang is not: the tests that hang a call expect the lock to work. A call
        // from inside another of this thread's passed the gate with it.
        let _in_flight = match gated {
            false => None,
            true if crate::calls::nested() => Some(crate::calls::enter()),
            true => {
                crate::lock::wait_until_unlocked(call)?;
                let slow = crate::inject::apply(call)?;
                let in_flight = crate::lock::enter_unlocked(call)?;
                if slow {
                    std::thread::sleep(crate::inject::SLOW);
                }
                Some(in_flight)
            }
        };
        body()
    }));
    match outcome {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => {
            debug(format_args!("{call} failed: {}", codes::name(code)));
            code
        }
        Err(_) => {
            debug(format_args!("{call} panicked"));
            UNKNOWN
        }
    }
}

/// Fails with `CUDA_ERROR_INVALID_VALUE` and a debug line saying why.
pub fn invalid(call: &str, why: std::fmt::Arguments<'_>) -> CuResult {
    debug(format_args!("{call}: {why}"));
    Err(INVALID_VALUE)
}

/// Writes `v` through the caller's out pointer.
///
/// # Safety
/// `p` must be null (reported as `CUDA_ERROR_INVALID_VALUE`) or valid for a write of `T`.
pub unsafe fn put<T>(p: *mut T, v: T) -> CuResult {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: non-null and valid per the caller; write_unaligned needs no alignment.
    unsafe { p.write_unaligned(v) };
    Ok(())
}
