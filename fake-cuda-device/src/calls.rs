//! Calls in flight, so that the checkpoint lock waits for them as the real driver's does.
//!
//! `cuCheckpointProcessLock` returns only once no CUDA call of the process is running: the
//! calls that started before it finish, later ones wait. Without that the stand-in let a thread
//! pass the lock check, be seized by CRIU inside the call while holding this library's table
//! lock, and the agent's own calls (resumed by the plugin at `CHECKPOINT_DEVICES`) wait on that
//! lock forever: a hang no GPU has (seen once in CI).
//!
//! Each working call counts itself in [`COUNTER`] before it reads the lock state, and uncounts
//! itself when it returns (or backs off to wait). The checkpoint side (`fake-cuda`, in CRIU)
//! sets the state first and then reads the counter through `/proc/<pid>/mem` until it is zero;
//! it finds the counter by the address this side writes into `$FAKECUDA_DIR/<pid>.calls` (hex)
//! at its first call. The counter starts with a magic word, so a stale file (a pid used again)
//! pointing at other memory is ignored. Either the checkpoint side sees the count, or the call
//! sees the lock: the count is raised (a locked instruction) before the state is read.
//!
//! A call made from inside another (this library calling its own entry points) is counted once:
//! only the outermost call of a thread counts and checks the lock. Not used with the state page
//! (containers), whose pid in the file name would not be the host's.

use std::cell::Cell;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

/// `FKCALLS1`, native byte order, then the count: what the checkpoint side reads.
pub const MAGIC: u64 = u64::from_ne_bytes(*b"FKCALLS1");

#[repr(C)]
pub struct Counter {
    magic: AtomicU64,
    in_flight: AtomicU64,
}

/// The counter; its address is published. Static, so CRIU restores it at the same address.
pub static COUNTER: Counter = Counter {
    magic: AtomicU64::new(MAGIC),
    in_flight: AtomicU64::new(0),
};

/// The pid the counter's file was written for (0: none yet); a forked child writes its own.
static PUBLISHED_FOR: AtomicI32 = AtomicI32::new(0);

thread_local! {
    /// How deep this thread is in counted calls.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// One counted call; uncounts itself when dropped (also when the body panics).
pub struct InFlight {
    counted: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.counted {
            COUNTER.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

impl InFlight {
    /// Whether this is the thread's outermost call (the one that checks the lock).
    pub fn outermost(&self) -> bool {
        self.counted
    }
}

/// Counts a call of this thread (only the outermost one).
pub fn enter() -> InFlight {
    let depth = DEPTH.with(|d| {
        let v = d.get();
        d.set(v + 1);
        v
    });
    if depth > 0 {
        return InFlight { counted: false };
    }
    publish();
    COUNTER.in_flight.fetch_add(1, Ordering::SeqCst);
    InFlight { counted: true }
}

/// Writes `$FAKECUDA_DIR/<pid>.calls` once per process (a forked child starts its count anew:
/// the threads its parent had in calls do not exist in it).
fn publish() {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    if PUBLISHED_FOR.load(Ordering::Acquire) == pid || crate::state_page::state().is_some() {
        return;
    }
    match PUBLISHED_FOR.swap(pid, Ordering::AcqRel) {
        p if p == pid => return,
        0 => {}
        // A forked child, whose one thread is this one: its parent's other threads' counts
        // were copied with the memory but are no calls of the child's.
        _ => COUNTER.in_flight.store(0, Ordering::SeqCst),
    }
    let Some(path) = crate::lock::pid_file("calls") else {
        return;
    };
    let tmp = path.with_extension(format!("calls.{pid}.tmp"));
    let addr = std::ptr::from_ref(&COUNTER) as usize;
    // Best effort: without the file the lock does not wait, as before.
    if std::fs::write(&tmp, format!("{addr:x}\n")).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_the_checkpoint_side_reads() {
        assert_eq!(std::mem::size_of::<Counter>(), 16);
        assert_eq!(std::mem::offset_of!(Counter, magic), 0);
        assert_eq!(std::mem::offset_of!(Counter, in_flight), 8);
    }

    #[test]
    fn only_the_outermost_call_is_counted() {
        let outer = enter();
        assert!(outer.outermost());
        assert!(COUNTER.in_flight.load(Ordering::SeqCst) >= 1);
        let inner = enter();
        assert!(!inner.outermost());
        drop(inner);
        drop(outer);
        assert!(enter().outermost(), "the depth went back to zero");
    }
}
