//! `cuInit` and the driver's restore thread.
//!
//! The real driver starts helper threads at `cuInit`; one of them, the "restore thread", is what
//! `cuCheckpointProcessGetRestoreThreadId` names and what does the work of the checkpoint calls.
//! The checkpoint side of the stand-in driver (`fake-cuda`) recognises a process with CUDA state
//! by a thread named [`RESTORE_THREAD_COMM`], so `cuInit` starts one: it blocks every signal and
//! sleeps. A forked child has no such thread; it starts its own at its first `cuInit`.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::call::{self, CuResult, debug};
use crate::codes::{CUresult, NOT_INITIALIZED};

/// The restore thread's name (`/proc/<pid>/task/<tid>/comm`), as `fake-cuda` expects it.
pub const RESTORE_THREAD_COMM: &str = "fakecuda-rt";

static INITIALISED: AtomicBool = AtomicBool::new(false);
static THREAD_STARTED: AtomicBool = AtomicBool::new(false);

/// `CUDA_ERROR_NOT_INITIALIZED` until `cuInit(0)` has succeeded in this process.
pub fn need_init() -> CuResult {
    if INITIALISED.load(Ordering::Acquire) {
        Ok(())
    } else {
        Err(NOT_INITIALIZED)
    }
}

/// `cuInit(flags)`.
pub unsafe extern "C" fn init(flags: u32) -> CUresult {
    call::run("cuInit", || {
        if flags != 0 {
            return call::invalid("cuInit", format_args!("flags {flags:#x} (must be 0)"));
        }
        register_fork_handler();
        match crate::state_page::wanted() {
            Ok(false) => {}
            Ok(true) => crate::state_page::create().map_err(|e| {
                debug(format_args!("cuInit: {e}"));
                crate::codes::OPERATING_SYSTEM
            })?,
            Err(e) => return call::invalid("cuInit", format_args!("{e}")),
        }
        start_restore_thread()?;
        INITIALISED.store(true, Ordering::Release);
        Ok(())
    })
}

fn start_restore_thread() -> CuResult {
    if THREAD_STARTED.swap(true, Ordering::AcqRel) {
        return Ok(());
    }
    // The new thread inherits the creator's signal mask: block everything around the spawn so
    // no signal meant for the application is delivered to it, from its first instruction on.
    let old = block_all_signals();
    let spawned = std::thread::Builder::new()
        .name(RESTORE_THREAD_COMM.into())
        .stack_size(64 << 10)
        .spawn(restore_thread_main);
    if let Some(old) = old {
        // SAFETY: restoring the mask this thread had.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    }
    match spawned {
        Ok(_) => Ok(()),
        Err(e) => {
            THREAD_STARTED.store(false, Ordering::Release);
            debug(format_args!("cuInit: cannot start the restore thread: {e}"));
            Err(crate::codes::OPERATING_SYSTEM)
        }
    }
}

fn restore_thread_main() {
    block_all_signals();
    // std names the thread already; set it explicitly too, it is what the checkpoint side reads.
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"fakecuda-rt".as_ptr()) };
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Blocks every signal in the calling thread; returns the previous mask.
fn block_all_signals() -> Option<libc::sigset_t> {
    // SAFETY: sigset_t is plain data; sigfillset initialises it; pthread_sigmask writes `old`.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        (libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old) == 0).then_some(old)
    }
}

extern "C" fn in_child() {
    THREAD_STARTED.store(false, Ordering::Release);
}

fn register_fork_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: in_child is a plain function that only stores to an atomic; it stays valid
        // while this library is loaded (glibc drops the handler when the library is unloaded).
        unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    });
}
