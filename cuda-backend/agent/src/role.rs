//! What this process is: an application the agent was preloaded into (the default), or a keeper
//! (`gpusnap-keeper`, see [`crate::keeper`]), which runs no application and loads the driver
//! library its job uses. Set once by the keeper's `main`, read by the layers below it (the
//! driver loader, the tracer check), which therefore never import the keeper.

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
