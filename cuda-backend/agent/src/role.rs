//! What this process is: an application the agent was preloaded into (the default), or a keeper
//! (`gpusnap-keeper`), which runs no application and loads the driver library its job uses. Set
//! once by the keeper's `main` (its crate links this one as a library), read by what the two
//! share here: the driver loader (which library), the tracer check (no application's threads
//! to hold), the dump (a keeper's drain may copy again) and the restore (a keeper makes the
//! memory as the job's record says). The keeper's own logic is in its crate, not here.

use std::ffi::{CStr, CString};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

static KEEPER: AtomicBool = AtomicBool::new(false);
static LIBCUDA: OnceLock<CString> = OnceLock::new();

/// Marks this process as a keeper, with `libcuda` the driver library to load (the job's own),
/// if its plugin named one. Called before the driver is loaded.
pub fn become_keeper(libcuda: Option<CString>) {
    KEEPER.store(true, Ordering::Release);
    if let Some(c) = libcuda {
        let _ = LIBCUDA.set(c);
    }
}

/// Whether this process is a keeper: it runs no application, so the checks that an
/// application's threads are held do not apply.
pub fn keeper() -> bool {
    KEEPER.load(Ordering::Acquire)
}

/// The driver library a keeper loads, if its plugin named one (the job's own).
pub fn libcuda() -> Option<&'static CStr> {
    LIBCUDA.get().map(|c| c.as_c_str())
}
