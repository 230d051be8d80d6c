//! Test-only fault injection: `GPUSNAP_TEST_KILL_CRIU_AT=<point>` makes the plugin kill its own
//! CRIU (SIGKILL to the `criu` process it runs in) at one named point of a dump, rollback or
//! restore, so that tests can check what a CRIU that dies there leaves behind. CRIU's own test
//! suite injects faults the same way. Never set it outside tests: the dump or restore it hits
//! is lost (by design, the job is held or killed, and its image stays intact).
//!
//! `GPUSNAP_TEST_FAIL_SYNC=1` makes the fsync of the image directory that `durable = true` adds
//! fail (EIO) without trying it, so that tests can see a failed fsync fail the dump.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

pub const ENV: &str = "GPUSNAP_TEST_KILL_CRIU_AT";
pub const FAIL_SYNC_ENV: &str = "GPUSNAP_TEST_FAIL_SYNC";

/// Every point, in the order a dump (then its rollback) or a restore reaches them.
pub const POINTS: &[&str] = &[
    // dump: CHECKPOINT_DEVICES
    "dump-locked",       // PAUSE done: driver locked, nothing moved
    "dump-data-out",     // split: unlocked, the first chunk written
    "dump-lent",         // hand-over: the keeper holds the memory, the job's not yet released
    "dump-released",     // split: memory released, not yet locked again
    "dump-relocked",     // split: locked again, control state not yet checkpointed
    "dump-checkpointed", // driver checkpoint done; CRIU's own dump follows
    // hand-over: beside CRIU's dump, and in `exit`
    "dump-drained", // the drain wrote every chunk; the keeper not yet released (fired
    // once CRIU's own part is over: see `kill_criu_beside_at`)
    "dump-before-manifest", // `exit` joined the drain; the manifest not yet written
    // rollback (`-R`, or a failed dump), in `exit`
    "rollback-restored", // driver restore of the rollback done, memory not yet back
    "rollback-reload",   // split: the first chunk reloaded
    "rollback-reclaimed", // hand-over: the memory mapped back from the kept descriptors
    // restore hand-over: the keeper's load beside CRIU's restore, then RESUME_DEVICES_LATE
    "restore-keeper-load", // the keeper's first chunk is in (on the load thread)
    "restore-keeper-loaded", // job unlocked, the keeper's load done: nothing handed over yet
    "restore-handing-over", // the job mapped its first handed-over allocation, not the rest
    // restore: RESUME_DEVICES_LATE
    "restore-control",    // driver restore done (locked)
    "restore-unlocked",   // unlocked, device data not yet loaded
    "restore-data",       // split: the first chunk loaded
    "restore-host-check", // split: all loaded, the GPU checked too few: the host check begins
];

/// The AMD side's points (the kfd path, `crate::amd`), in the order a dump, its undo in
/// `exit`, and a restore reach them. Each sits just after a phase boundary of
/// `amd::phase::{DumpPhase, RestorePhase}`.
pub const AMD_POINTS: &[&str] = &[
    "amd-dump-paused",       // PROCESS_INFO done: queues paused, nothing written
    "amd-dump-checkpointed", // CHECKPOINT done and the image whole; queues still paused
    "amd-rollback",          // exit after `-R` or a failed dump, before the UNPAUSE
    // In the restored task, which runs CRIU's restore code: this kills that task (CRIU's side
    // of it), as CRIU dying there would.
    "amd-restore-state", // RESTORE done in the task, contents not yet written back
    "amd-restore-resume", // RESUME_DEVICES_LATE: the process dies with CRIU, not yet resumed
];

/// The points of a process tree sharing memory through the agent's CUDA IPC or through
/// shareable handles (`crate::sharing`), reached only with such a tree: an importer's shares are
/// unmapped, its exporters' memory is back, and it is about to map them again; or a shareable
/// exporter's memory is back and the descriptors its program holds of it still name the old.
pub const IPC_POINTS: &[&str] = &[
    "rollback-reimport", // a rollback: the exporters are rolled back, the importer still held
    "restore-reimport",  // a restore: every process's own memory back, no thread has run
    "rollback-repoint",  // a rollback: a shareable exporter's memory is back, its program's fds
                         // not yet made to name it (its threads held)
];

/// The points of an incremental hand-over dump whose parent image is found damaged after the
/// drain compared against it (reached only with such a parent: `criu-tests/tests/precopy.rs`
/// kills CRIU there).
pub const PARENT_POINTS: &[&str] = &[
    "dump-parent-damaged", // the drain's copy referenced the parent, the check found it
                           // damaged: the full copy again from the keeper's memory not yet begun
];

/// The points of an asynchronous `criu dump -R` (`async_leave_running`), reached only with it
/// (`criu-tests/tests/async_leave_running.rs` kills there). The first kills CRIU; the others
/// fire in the drainer, the process gpusnap leaves behind after CRIU returns: one kills the
/// keeper under it mid-drain, the other the drainer itself before the manifest.
pub const ASYNC_POINTS: &[&str] = &[
    "dump-snapshot-copied", // the keeper holds a snapshot of the lent memory, the job not yet
    // released; CRIU has not returned
    "async-drain-started", // in the drainer, after CRIU returned: the keeper is killed
    "async-before-manifest", // in the drainer: every chunk written, the drainer is killed
                           // before the manifest
];

fn known(v: &str) -> Option<&'static str> {
    POINTS
        .iter()
        .chain(AMD_POINTS)
        .chain(IPC_POINTS)
        .chain(PARENT_POINTS)
        .chain(ASYNC_POINTS)
        .copied()
        .find(|p| *p == v)
}

fn armed() -> Option<&'static str> {
    static ARMED: OnceLock<Option<&'static str>> = OnceLock::new();
    *ARMED.get_or_init(|| known(&std::env::var(ENV).ok()?))
}

/// A test setting is not one of its values.
#[derive(Debug, thiserror::Error)]
pub enum UnknownPoint {
    #[error(
        "{ENV}={value:?} names no fault point (known: {}, {}, {}, {}, {})",
        POINTS.join(", "),
        AMD_POINTS.join(", "),
        IPC_POINTS.join(", "),
        PARENT_POINTS.join(", "),
        ASYNC_POINTS.join(", ")
    )]
    Point { value: String },
    #[error("{FAIL_SYNC_ENV}={value:?}: only 1 is a setting")]
    FailSync { value: String },
}

/// Checks the settings: `Err` names an unknown point, or a [`FAIL_SYNC_ENV`] other than `1`.
pub fn check() -> Result<(), UnknownPoint> {
    if let Ok(value) = std::env::var(FAIL_SYNC_ENV)
        && value != "1"
    {
        return Err(UnknownPoint::FailSync { value });
    }
    match std::env::var(ENV) {
        Ok(value) if known(&value).is_none() => Err(UnknownPoint::Point { value }),
        _ => Ok(()),
    }
}

/// Set at `exit`: CRIU's own part of the dump is over (no parasite in any task any more).
static CRIU_PART_OVER: AtomicBool = AtomicBool::new(false);

/// `exit` has begun: CRIU's own part of the dump is over.
pub fn criu_part_over() {
    CRIU_PART_OVER.store(true, Ordering::SeqCst);
}

/// For a point on a thread of ours that runs beside CRIU's own work (the drain): kills CRIU
/// there, but only once CRIU's own part is over. CRIU killed while its parasite is inside a task
/// can lose that task whatever gpusnap does (a flaky CI cell showed it: the drain of a small job
/// ended during CRIU's parasite work); the cell is about gpusnap's window, which lasts until
/// the keeper is released, so the kill waits for `exit` (at most 30 s).
pub fn kill_criu_beside_at(point: &'static str) {
    if armed() != Some(point) {
        return;
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !CRIU_PART_OVER.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    kill_criu_at(point);
}

/// Whether `point` is the armed one (for points whose fault is not CRIU's death: the
/// asynchronous drainer kills its keeper or itself).
pub fn armed_at(point: &'static str) -> bool {
    debug_assert!(known(point).is_some(), "unknown fault point {point}");
    armed() == Some(point)
}

/// Kills this CRIU if `point` is armed.
pub fn kill_criu_at(point: &'static str) {
    debug_assert!(known(point).is_some(), "unknown fault point {point}");
    if armed() == Some(point) {
        crate::logger::print_now(&format!("test fault {ENV}={point}: killing CRIU now"));
        // SAFETY: kill(2) takes no pointers; SIGKILL to our own process is the point.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

/// [`gpusnap_image::sync_dir`], or its failure when [`FAIL_SYNC_ENV`] is `1`.
pub fn sync_dir(dir: std::os::fd::BorrowedFd<'_>) -> Result<(), gpusnap_image::ImageError> {
    if std::env::var(FAIL_SYNC_ENV).is_ok_and(|v| v == "1") {
        log::warn!("test fault {FAIL_SYNC_ENV}=1: the fsync of the image directory fails");
        return Err(gpusnap_image::ImageError::Io {
            file: gpusnap_image::IMAGE_DIR.to_owned(),
            op: gpusnap_image::IoOp::Fsync,
            source: std::io::Error::from_raw_os_error(libc::EIO),
        });
    }
    gpusnap_image::sync_dir(dir)
}
