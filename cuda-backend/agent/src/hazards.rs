//! What the process did that the driver's checkpoint cannot take (managed memory, CUDA IPC,
//! peer access between GPUs). Recorded by pass-through hooks, reported in `Hello`, so the plugin
//! refuses the dump with the cause named, before the process is touched.
//!
//! Most bits stay set once seen. [`hazard::IPC_EVENT_IMPORT`] is a state, not a history: it is
//! reported only while an event opened with `cuIpcOpenEventHandle` is not destroyed yet (PyTorch
//! opens the producer's event while it rebuilds a received tensor and destroys it right after).
//! The destroy hook runs for every event of the process, so it checks one atomic count first.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use gpusnap_proto::hazard;

static SEEN: AtomicU32 = AtomicU32::new(0);

/// How many entries [`OPEN_EVENTS`] holds, read without its lock.
static OPEN_EVENT_COUNT: AtomicUsize = AtomicUsize::new(0);
/// The `CUevent` values `cuIpcOpenEventHandle` returned and not destroyed yet (one entry per
/// open: a value the driver hands out again after a destroy is counted again).
static OPEN_EVENTS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

fn open_events() -> std::sync::MutexGuard<'static, Vec<usize>> {
    OPEN_EVENTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// `cuIpcOpenEventHandle` returned `event`.
pub fn ipc_event_opened(event: usize) {
    let mut open = open_events();
    open.push(event);
    OPEN_EVENT_COUNT.store(open.len(), Ordering::Release);
}

/// `cuEventDestroy` of `event` succeeded. Cheap when no opened event is live (one atomic load).
pub fn event_destroyed(event: usize) {
    if OPEN_EVENT_COUNT.load(Ordering::Acquire) == 0 {
        return;
    }
    let mut open = open_events();
    if let Some(i) = open.iter().position(|&e| e == event) {
        open.swap_remove(i);
        OPEN_EVENT_COUNT.store(open.len(), Ordering::Release);
    }
}

/// Records `bits` (see `gpusnap_proto::hazard`).
pub fn record(bits: u32) {
    SEEN.fetch_or(bits, Ordering::Relaxed);
}

/// The bits to report now: every one seen, and [`hazard::IPC_EVENT_IMPORT`] while an opened
/// interprocess event is live.
pub fn get() -> u32 {
    let live = if OPEN_EVENT_COUNT.load(Ordering::Acquire) > 0 {
        hazard::IPC_EVENT_IMPORT
    } else {
        0
    };
    SEEN.load(Ordering::Relaxed) | live
}

/// The opened-event list held locked around `fork` (taken in the prepare handler), so the child
/// never inherits it locked by a thread it does not have.
pub struct ForkHold(std::sync::MutexGuard<'static, Vec<usize>>);

impl ForkHold {
    pub fn take() -> Self {
        ForkHold(open_events())
    }
}

/// A forked child has none of its parent's GPU state; `hold` is the list locked before `fork`.
pub fn forget_in_child(hold: Option<ForkHold>) {
    SEEN.store(0, Ordering::Relaxed);
    if let Some(mut h) = hold {
        h.0.clear();
    }
    OPEN_EVENT_COUNT.store(0, Ordering::Release);
}

#[cfg(test)]
mod tests {
    #[test]
    fn bits_accumulate() {
        super::record(1);
        super::record(4);
        assert_eq!(super::get() & 5, 5);
    }

    /// The only test that opens events here (the state is process-wide).
    #[test]
    fn an_opened_ipc_event_is_reported_until_destroyed() {
        use super::*;
        assert_eq!(get() & hazard::IPC_EVENT_IMPORT, 0);
        event_destroyed(0x10); // an event of the process's own: nothing to do
        ipc_event_opened(0x10);
        ipc_event_opened(0x20);
        assert_ne!(get() & hazard::IPC_EVENT_IMPORT, 0);
        event_destroyed(0x30);
        event_destroyed(0x10);
        assert_ne!(get() & hazard::IPC_EVENT_IMPORT, 0, "0x20 is still open");
        // The driver may hand a destroyed value out again: counted once per open.
        ipc_event_opened(0x20);
        event_destroyed(0x20);
        assert_ne!(get() & hazard::IPC_EVENT_IMPORT, 0);
        event_destroyed(0x20);
        assert_eq!(get() & hazard::IPC_EVENT_IMPORT, 0);
        assert_eq!(
            hazard::IPC_EVENT_IMPORT & hazard::REFUSING,
            hazard::IPC_EVENT_IMPORT
        );
    }
}
