//! What the process did that the driver's checkpoint cannot take (managed memory, CUDA IPC,
//! peer access between GPUs). Recorded by pass-through hooks, reported in `Hello`, so the plugin
//! refuses the dump with the cause named, before the process is touched.

use std::sync::atomic::{AtomicU32, Ordering};

static SEEN: AtomicU32 = AtomicU32::new(0);

/// Records `bits` (see `gpusnap_proto::hazard`).
pub fn record(bits: u32) {
    SEEN.fetch_or(bits, Ordering::Relaxed);
}

pub fn get() -> u32 {
    SEEN.load(Ordering::Relaxed)
}

/// A forked child has none of its parent's GPU state.
pub fn forget_in_child() {
    SEEN.store(0, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    #[test]
    fn bits_accumulate() {
        super::record(1);
        super::record(4);
        assert_eq!(super::get() & 5, 5);
    }
}
