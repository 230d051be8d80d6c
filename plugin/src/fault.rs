//! Test-only fault injection: `GPUSNAP_TEST_KILL_CRIU_AT=<point>` makes the plugin kill its own
//! CRIU (SIGKILL to the `criu` process it runs in) at one named point of a dump, rollback or
//! restore, so that tests can check what a CRIU that dies there leaves behind. CRIU's own test
//! suite injects faults the same way. Never set it outside tests: the dump or restore it hits
//! is lost (by design, the job is held or killed, and its image stays intact).

use std::sync::OnceLock;

pub const ENV: &str = "GPUSNAP_TEST_KILL_CRIU_AT";

/// Every point, in the order a dump (then its rollback) or a restore reaches them.
pub const POINTS: &[&str] = &[
    // dump: CHECKPOINT_DEVICES
    "dump-locked",       // PAUSE done: driver locked, nothing moved
    "dump-data-out",     // split: unlocked, the first chunk written
    "dump-released",     // split: memory released, not yet locked again
    "dump-relocked",     // split: locked again, control state not yet checkpointed
    "dump-checkpointed", // driver checkpoint done; CRIU's own dump follows
    // rollback (`-R`, or a failed dump), in `exit`
    "rollback-restored", // driver restore of the rollback done, memory not yet back
    "rollback-reload",   // split: the first chunk reloaded
    // restore: RESUME_DEVICES_LATE
    "restore-control",  // driver restore done (locked)
    "restore-unlocked", // unlocked, device data not yet loaded
    "restore-data",     // split: the first chunk loaded
];

fn armed() -> Option<&'static str> {
    static ARMED: OnceLock<Option<&'static str>> = OnceLock::new();
    *ARMED.get_or_init(|| {
        let v = std::env::var(ENV).ok()?;
        POINTS.iter().copied().find(|p| *p == v)
    })
}

/// The setting names no fault point.
#[derive(Debug, thiserror::Error)]
#[error("{ENV}={value:?} names no fault point (known: {})", POINTS.join(", "))]
pub struct UnknownPoint {
    pub value: String,
}

/// Checks the setting: `Err` names an unknown point.
pub fn check() -> Result<(), UnknownPoint> {
    match std::env::var(ENV) {
        Ok(value) if !POINTS.contains(&value.as_str()) => Err(UnknownPoint { value }),
        _ => Ok(()),
    }
}

/// Kills this CRIU if `point` is armed.
pub fn kill_criu_at(point: &'static str) {
    debug_assert!(POINTS.contains(&point), "unknown fault point {point}");
    if armed() == Some(point) {
        log::warn!("test fault {ENV}={point}: killing CRIU now");
        // SAFETY: kill(2) takes no pointers; SIGKILL to our own process is the point.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}
