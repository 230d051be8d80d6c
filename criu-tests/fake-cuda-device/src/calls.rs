//! Calls in flight, so that the checkpoint lock waits for them as the real driver's does.
//!
//! `cuCheckpointProcessLock` returns only once no CUDA call of the process is running: the
//! calls that started before it finish, later ones wait at the driver's gate. Without that the
//! stand-in let a thread pass the lock check, be seized by CRIU inside the call while holding
//! this library's table lock, and the agent's own calls (resumed by the plugin at
//! `CHECKPOINT_DEVICES`) waited on that lock forever: a hang no GPU has (seen once in CI).
//!
//! Each working call of a thread takes a slot in [`CALLS`] with the thread's id before it reads
//! the lock state, and gives it back when it returns (or backs off to wait). The checkpoint side
//! (`fake-cuda`, in CRIU) writes the state first and then reads the slots through
//! `/proc/<pid>/mem`, waiting while a slot names a thread that runs: either it sees the call, or
//! the call sees the lock (the slot is taken with a locked instruction before the state is read).
//! A slot whose thread is stopped (ptrace or job control) or gone does not hold the lock up: a
//! stopped thread cannot finish its call, and one stopped at the gate's edge (after taking its
//! slot, before reading the state) holds nothing; after the lock of `PAUSE`, taken while the
//! threads run, that is the only place CRIU can find one. (Slots copied into a forked child
//! name its parent's threads, which the child does not have.)
//!
//! The checkpoint side finds the slots by the address this side writes into
//! `$FAKECUDA_DIR/<pid>.calls` (hex) at its first call; they start with a magic word, so a stale
//! file (a pid used again) pointing at other memory is ignored. A call made from inside another
//! (this library calling its own entry points) is not gated again: only the outermost call of a
//! thread takes a slot and checks the lock. Not published with the state page (containers),
//! whose pid in the file name would not be the host's.

use std::cell::Cell;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

/// `FKCALLS2`, native byte order: the first word of [`Calls`].
pub const MAGIC: u64 = u64::from_ne_bytes(*b"FKCALLS2");
/// Threads in calls at once that get a slot; more are counted in `overflow`.
pub const SLOTS: usize = 64;

/// What the checkpoint side reads: the magic word, the calls without a slot, then one thread id
/// per slot (0: free).
#[repr(C)]
pub struct Calls {
    magic: AtomicU64,
    overflow: AtomicU64,
    tids: [AtomicU32; SLOTS],
}

/// The slots; their address is published. Static, so CRIU restores them at the same address.
pub static CALLS: Calls = Calls {
    magic: AtomicU64::new(MAGIC),
    overflow: AtomicU64::new(0),
    tids: [const { AtomicU32::new(0) }; SLOTS],
};

/// The pid the slots' file was written for (0: none yet); a forked child writes its own.
static PUBLISHED_FOR: AtomicI32 = AtomicI32::new(0);

thread_local! {
    /// How deep this thread is in calls.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Where a call of this thread is counted.
enum Held {
    /// Inside another call of this thread: counted there.
    Nested,
    Slot(usize),
    Overflow,
}

/// One call in flight; gives its slot back when dropped (also when the body panics).
pub struct InFlight {
    held: Held,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        match self.held {
            Held::Nested => {}
            Held::Slot(i) => CALLS.tids[i].store(0, Ordering::SeqCst),
            Held::Overflow => {
                let _ = CALLS
                    .overflow
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            }
        }
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

impl InFlight {
    /// Whether this is the thread's outermost call (the one that checks the lock).
    pub fn outermost(&self) -> bool {
        !matches!(self.held, Held::Nested)
    }
}

/// Whether this thread is inside a call already (a nested call is not gated again).
pub fn nested() -> bool {
    DEPTH.with(|d| d.get() > 0)
}

/// Counts a call of this thread (the outermost one takes a slot).
pub fn enter() -> InFlight {
    let depth = DEPTH.with(|d| {
        let v = d.get();
        d.set(v + 1);
        v
    });
    if depth > 0 {
        return InFlight { held: Held::Nested };
    }
    publish();
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() } as u32;
    let free = CALLS.tids.iter().position(|t| {
        t.compare_exchange(0, tid, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    });
    let held = match free {
        Some(i) => Held::Slot(i),
        None => {
            CALLS.overflow.fetch_add(1, Ordering::SeqCst);
            Held::Overflow
        }
    };
    InFlight { held }
}

/// Writes `$FAKECUDA_DIR/<pid>.calls` once per process.
fn publish() {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    if PUBLISHED_FOR.load(Ordering::Acquire) == pid || crate::state_page::state().is_some() {
        return;
    }
    // Two threads of a new process may both write it: the same address, renamed into place.
    PUBLISHED_FOR.store(pid, Ordering::Release);
    let Some(path) = crate::lock::pid_file("calls") else {
        return;
    };
    // SAFETY: gettid has no preconditions.
    let tmp = path.with_extension(format!("calls.{}.tmp", unsafe { libc::gettid() }));
    let addr = std::ptr::from_ref(&CALLS) as usize;
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
        assert_eq!(std::mem::size_of::<Calls>(), 16 + 4 * SLOTS);
        assert_eq!(std::mem::offset_of!(Calls, magic), 0);
        assert_eq!(std::mem::offset_of!(Calls, overflow), 8);
        assert_eq!(std::mem::offset_of!(Calls, tids), 16);
    }

    #[test]
    fn the_outermost_call_holds_a_slot_with_its_thread_id() {
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() } as u32;
        let held = || CALLS.tids.iter().any(|t| t.load(Ordering::SeqCst) == me);
        let outer = enter();
        assert!(outer.outermost());
        assert!(held(), "a slot names this thread");
        let inner = enter();
        assert!(!inner.outermost());
        assert!(nested());
        drop(inner);
        assert!(held(), "still in the outer call");
        drop(outer);
        assert!(!held(), "the slot is free again");
        assert!(!nested());
    }
}
