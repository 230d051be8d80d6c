//! The panic guard of every entry point that C calls (the hooks, `pthread_atfork` handlers, the
//! load-time constructor): no panic may unwind into C.

use std::panic::AssertUnwindSafe;

/// Runs `f`; a panic becomes `on_panic` (never unwinds into C).
pub(crate) fn guard<T>(on_panic: T, f: impl FnOnce() -> T) -> T {
    std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or(on_panic)
}
