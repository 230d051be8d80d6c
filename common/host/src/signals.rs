//! Signals and gpusnap's own threads: CRIU's signals (its SIGALRM timeout above all) are for
//! its main thread, so every thread gpusnap starts blocks them all first.

/// Blocks every signal in the calling (helper) thread.
pub fn block_all() {
    // SAFETY: sigfillset on a local set, then pthread_sigmask for this thread only.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}
