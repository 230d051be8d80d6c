//! The hand-over at a restore: the keeper loads the image into fresh exportable memory beside
//! CRIU's own restore, and the restored job maps that memory at its recorded addresses
//! (`docs/design-notes.md`, "Hand-over").
//!
//! - `init(RESTORE)`: [`Preload::start`] starts a keeper for each process whose image allows
//!   it ([`eligible`]: the dump lent every moved allocation, so the agent had made them
//!   exportable). Only a process is started: no thread of ours may live while CRIU forks.
//! - POST_FORKING (CRIU 4.2+; on 4.1.1 the first RESUME_DEVICES_LATE): [`Preload::load`] runs on
//!   a thread of its own: `Expect` per allocation, then the plugin's readers feed the keeper's
//!   copy-in, which is the agent's own load with its GPU check.
//! - RESUME_DEVICES_LATE, once the driver restored and unlocked the job: [`Preload::finish`]:
//!   the keeper exports the memory (`LendBegin`), the job maps each allocation (`Take` ..
//!   `TakeEnd`), the keeper lets go (`Release`) and is reaped.
//!
//! Fail closed: the job runs only after `TakeEnd` found all its memory mapped; a failure before
//! that kills it, as any failed restore does, and its image is untouched. A load that failed
//! (the keeper could not start, allocate, or read) or planned other GPUs than the restore's
//! final plan does not fail the restore: the keeper goes first, then the job's agent loads
//! the image itself. The keeper must not exit while CRIU restores (CRIU takes a child's exit
//! then for a failure of its own); it is reaped only from RESUME_DEVICES_LATE on, or in `exit`.

use crate::GpuUuid;
use crate::agent::{AgentError, AgentSession, LentAllocation};
use crate::datapath::{self, DataError, LoadStats};
use crate::gpumap;
use crate::keeper::{Keeper, KeeperError, KeeperKiller};
use crate::staging::Staging;
use gpusnap_config::Config;
use gpusnap_host::pid::HostPid;
use gpusnap_image::{CheckpointPath, Manifest};
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum PreloadError {
    #[error(transparent)]
    Keeper(#[from] KeeperError),
    #[error("the keeper: {0}")]
    Session(AgentError),
    #[error("loading into the keeper: {0}")]
    Data(#[from] DataError),
    #[error("the image has no GPU record for device {device}")]
    NoGpu { device: u32 },
    #[error("GPU UUID `{uuid}` of the plan does not parse")]
    BadUuid { uuid: String },
    #[error("the keeper loaded onto other GPUs than the restore's plan")]
    OtherGpus,
    #[error("the keeper is gone")]
    NoKeeper,
    #[error("the load thread could not start: {0}")]
    Thread(std::io::Error),
    #[error("a handle to end the keeper early could not be made: {0}")]
    Killer(std::io::Error),
    #[error("the load thread panicked")]
    Panicked,
    #[error(
        "the keeper exported allocations {lent:?}, the image lists {listed:?}: refusing a partial hand-over"
    )]
    Incomplete {
        lent: BTreeSet<u64>,
        listed: BTreeSet<u64>,
    },
    #[error("the restored process's agent: {0}")]
    Job(AgentError),
}

/// Why the image of `m` cannot be handed over at this restore (`None`: it can).
pub fn eligible(cfg: &Config, m: &Manifest) -> Option<&'static str> {
    if !cfg.handover {
        return Some("handover = false");
    }
    if m.path != CheckpointPath::Split || m.chunks.is_empty() {
        return Some("no device data in gpusnap's files");
    }
    if m.allocations.iter().any(|a| a.moved && !a.lent) {
        return Some(
            "its dump copied the data out first for some or all allocations (not every allocation was lent): the job's agent loads all of it",
        );
    }
    if gpumap::planned_by_the_driver(&m.gpus, &cfg.device_map) {
        // The plan is then the driver's to make, after CRIU's restore.
        return Some("device_map or MIG instances: the GPUs are planned only after CRIU's restore");
    }
    None
}

/// The UUID of the GPU each of the job's device ordinals goes on under `pairs` (a GPU without
/// a pair stays on itself).
pub fn targets(
    m: &Manifest,
    pairs: &[gpumap::Pair],
) -> Result<BTreeMap<u32, [u8; 16]>, PreloadError> {
    m.gpus
        .iter()
        .map(|g| {
            let uuid = pairs
                .iter()
                .find(|p| p.old == g.uuid)
                .map_or(g.uuid.as_str(), |p| p.new.as_str());
            let parsed: GpuUuid = uuid.parse().map_err(|_| PreloadError::BadUuid {
                uuid: uuid.to_owned(),
            })?;
            Ok((g.ordinal, parsed.to_bytes()))
        })
        .collect()
}

/// What a load needs besides the keeper.
pub struct LoadJob {
    pub dir: BorrowedFd<'static>,
    pub manifest: Manifest,
    /// Where each device ordinal of the job goes ([`targets`]).
    pub targets: BTreeMap<u32, [u8; 16]>,
    pub slots: usize,
    pub readers: usize,
    pub limits: datapath::Limits,
    pub checks: datapath::ReadChecks,
}

/// Where a keeper's load spent its time before the data moved (the log's breakdown).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeeperPhases {
    /// From the load's start until the keeper answered (its `cuInit`, begun at `init`).
    pub ready_s: f64,
    /// Its context on each target GPU and the reservations at the job's addresses.
    pub expect_s: f64,
    /// The image into its memory: memory made, ring registered, every chunk in and checked.
    pub load_s: f64,
}

/// A finished load: the keeper, and what it did.
pub struct Loaded {
    keeper: Keeper,
    result: Result<(LoadStats, KeeperPhases), PreloadError>,
    targets: BTreeMap<u32, [u8; 16]>,
    started: Instant,
    ended: Instant,
}

/// One process's hand-over at a restore, through its life.
pub enum Preload {
    /// The keeper runs (started in `init`); its load has not begun.
    Started(Keeper),
    /// The load runs on a thread of its own (which owns the keeper); a way to end it early.
    Loading {
        handle: std::thread::JoinHandle<Loaded>,
        killer: KeeperKiller,
    },
    /// The load thread could not be started (the keeper is gone with it).
    NotStarted(PreloadError),
}

/// How a hand-over ended.
pub enum Handed {
    /// The job maps the keeper's memory: every byte is in, checked.
    Done {
        stats: LoadStats,
        phases: KeeperPhases,
        /// The load's time span, and how long the hand-over waited for it.
        ran_s: f64,
        waited_s: f64,
        /// Export, the job's maps, and the keeper's release.
        take_s: f64,
        allocations: u32,
    },
    /// The keeper's load is not usable (why); the keeper is gone, and the job's agent must
    /// load the image itself.
    Fallback(PreloadError),
}

/// Test hook: the driver library a restore's keeper loads (and, when set, a dump's, which
/// otherwise loads the job's own). With a real driver the job's library and the plugin's are one
/// (`libcuda.so.1`, or `GPUSNAP_LIBCUDA`); the stand-ins are two (the checkpoint API's for the
/// plugin, the device's for the job), and the keeper needs the job's.
pub const KEEPER_LIBCUDA_ENV: &str = "GPUSNAP_TEST_KEEPER_LIBCUDA";

/// The library [`KEEPER_LIBCUDA_ENV`] names, if it is set and not empty.
pub fn keeper_libcuda_override() -> Option<std::path::PathBuf> {
    std::env::var_os(KEEPER_LIBCUDA_ENV)
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
}

impl Preload {
    /// Starts a keeper for the process of `m` (`init(RESTORE)`); it makes its contexts on
    /// `gpus` (the plan's) while CRIU forks the tree.
    pub fn start(cfg: &Config, m: &Manifest, gpus: &[[u8; 16]]) -> Result<Preload, KeeperError> {
        let libcuda =
            keeper_libcuda_override().unwrap_or_else(|| crate::driver::libcuda_path().into());
        let keeper = Keeper::spawn(
            &cfg.keeper,
            Some(libcuda.as_path()),
            gpus,
            crate::keeper::JobPid::Namespace(m.nspid),
            Duration::from_millis(cfg.agent_timeout_ms),
        )?;
        Ok(Preload::Started(keeper))
    }

    /// Starts the load on a thread of its own (once CRIU has forked every task).
    pub fn load(self, job: LoadJob) -> Preload {
        let Preload::Started(keeper) = self else {
            return self;
        };
        let killer = match keeper.killer() {
            Ok(k) => k,
            Err(e) => return Preload::NotStarted(PreloadError::Killer(e)),
        };
        let spawned = std::thread::Builder::new()
            .name("gpusnap-preload".into())
            .spawn(move || {
                gpusnap_host::signals::block_all();
                // CRIU's main thread logs meanwhile, through one unlocked buffer.
                gpusnap_host::logger::defer_this_thread();
                let started = Instant::now();
                let result = load_into(&keeper, &job);
                Loaded {
                    keeper,
                    result,
                    targets: job.targets,
                    started,
                    ended: Instant::now(),
                }
            });
        match spawned {
            Ok(handle) => Preload::Loading { handle, killer },
            Err(e) => Preload::NotStarted(PreloadError::Thread(e)),
        }
    }

    /// Ends this hand-over unused (the restore failed, or the process is not there): the keeper
    /// is killed, so that a load in progress fails at once, and the thread joined; the keeper
    /// is reaped with it.
    pub fn abandon(self) {
        if let Preload::Loading { handle, killer } = self {
            killer.kill();
            drop(handle.join());
        }
    }

    /// RESUME_DEVICES_LATE, the job `pid` restored and unlocked by the driver, held: waits for
    /// the load and hands the memory over if it is usable under the final plan `targets`.
    /// `Err`: the hand-over began and failed; the job must be killed.
    pub fn finish(
        self,
        pid: HostPid,
        m: &Manifest,
        targets: &BTreeMap<u32, [u8; 16]>,
        timeout: Duration,
    ) -> Result<Handed, PreloadError> {
        let t0 = Instant::now();
        let loaded = match self {
            Preload::Loading { handle, .. } => handle.join().map_err(|_| PreloadError::Panicked),
            Preload::Started(_) => return Ok(Handed::Fallback(PreloadError::NoKeeper)),
            Preload::NotStarted(e) => return Ok(Handed::Fallback(e)),
        };
        let loaded = match loaded {
            Ok(l) => l,
            Err(e) => return Ok(Handed::Fallback(e)),
        };
        let waited_s = t0.elapsed().as_secs_f64();
        let ran_s = loaded.ended.duration_since(loaded.started).as_secs_f64();
        let Loaded {
            keeper,
            result,
            targets: loaded_on,
            ..
        } = loaded;
        let (stats, phases) = match result {
            // Dropping the keeper frees its memory before the agent loads.
            Ok(_) if loaded_on != *targets => return Ok(Handed::Fallback(PreloadError::OtherGpus)),
            Ok(done) => done,
            Err(e) => return Ok(Handed::Fallback(e)),
        };
        gpusnap_host::fault::kill_criu_at("restore-keeper-loaded");
        let t1 = Instant::now();
        let allocations = hand_over(&keeper, pid, m, timeout)?;
        // `keeper` is dropped here: it exits (harmless from RESUME_DEVICES_LATE on) and is
        // reaped; the job holds the memory.
        drop(keeper);
        Ok(Handed::Done {
            stats,
            phases,
            ran_s,
            waited_s,
            take_s: t1.elapsed().as_secs_f64(),
            allocations,
        })
    }
}

/// The load on the preload thread: where each allocation goes, then the image's chunks.
fn load_into(keeper: &Keeper, job: &LoadJob) -> Result<(LoadStats, KeeperPhases), PreloadError> {
    let t0 = Instant::now();
    let s = keeper.session().ok_or(PreloadError::NoKeeper)?;
    s.hello().map_err(PreloadError::Session)?;
    let ready_s = t0.elapsed().as_secs_f64();
    for a in job.manifest.allocations.iter().filter(|a| a.moved) {
        let gpu = job
            .targets
            .get(&a.device)
            .ok_or(PreloadError::NoGpu { device: a.device })?;
        s.expect(a, *gpu).map_err(PreloadError::Session)?;
    }
    let expect_s = t0.elapsed().as_secs_f64() - ready_s;
    let shape = crate::load::ring_shape(job.slots, &job.manifest);
    let staging = Staging::new(shape.slot_size, shape.slots).map_err(DataError::Ring)?;
    let t1 = Instant::now();
    let stats = datapath::copy_in(
        s,
        &staging,
        job.dir,
        &job.manifest,
        job.readers,
        job.limits,
        "restore-keeper-load",
        job.checks,
    )?;
    let phases = KeeperPhases {
        ready_s,
        expect_s,
        load_s: t1.elapsed().as_secs_f64(),
    };
    Ok((stats, phases))
}

/// Export from the keeper, `Take` in the job, release in the keeper. Returns the allocations
/// handed over.
fn hand_over(
    keeper: &Keeper,
    pid: HostPid,
    m: &Manifest,
    timeout: Duration,
) -> Result<u32, PreloadError> {
    let ks = keeper.session().ok_or(PreloadError::NoKeeper)?;
    let lent: Vec<LentAllocation> = ks.lend().map_err(PreloadError::Session)?;
    let got: BTreeSet<u64> = lent.iter().map(|l| l.id).collect();
    let listed: BTreeSet<u64> = m
        .allocations
        .iter()
        .filter(|a| a.moved)
        .map(|a| a.id)
        .collect();
    if got != listed || got.len() != lent.len() {
        ks.abort();
        return Err(PreloadError::Incomplete { lent: got, listed });
    }
    let job = AgentSession::connect_expected(pid, timeout).map_err(PreloadError::Job)?;
    for (i, l) in lent.iter().enumerate() {
        job.take(l).map_err(PreloadError::Job)?;
        if i == 0 {
            gpusnap_host::fault::kill_criu_at("restore-handing-over");
        }
    }
    let (allocations, bytes, micros) = job.take_end().map_err(PreloadError::Job)?;
    log::debug!(
        "pid {pid}: mapped {allocations} handed-over allocations ({bytes} bytes) in {micros} us"
    );
    // The job holds the memory: the keeper's handles go (a keeper that cannot answer ends
    // with its connection all the same).
    if let Err(e) = ks.release_keeper() {
        log::debug!("pid {pid}: the keeper's release: {e} (it exits anyway)");
    }
    Ok(allocations)
}

impl std::fmt::Debug for Preload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Preload::Started(k) => write!(f, "Started({k:?})"),
            Preload::Loading { killer, .. } => write!(f, "Loading(keeper pid {})", killer.pid()),
            Preload::NotStarted(e) => write!(f, "NotStarted({e})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpusnap_image::{AllocationRecord, GpuRecord};

    fn manifest() -> Manifest {
        Manifest {
            nspid: gpusnap_host::pid::NsPid(7),
            path: CheckpointPath::Split,
            gpus: vec![GpuRecord {
                ordinal: 0,
                uuid: "a".repeat(32),
                name: "NVIDIA H200".into(),
                total_mem: 1 << 30,
            }],
            allocations: vec![AllocationRecord {
                id: 1,
                device: 0,
                addr: 0x7000_0000_0000,
                size: 2 << 20,
                moved: true,
                lent: true,
                rdma_capable: false,
            }],
            chunks: vec![gpusnap_image::ChunkEntry::zero(
                0x7000_0000_0000,
                2 << 20,
                0,
            )],
            ..crate::test_manifest()
        }
    }

    #[test]
    fn only_images_whose_every_moved_allocation_was_lent_are_handed_over() {
        let cfg = Config::default();
        let m = manifest();
        assert_eq!(eligible(&cfg, &m), None);
        let mut copied = m.clone();
        copied.allocations[0].lent = false;
        assert!(
            eligible(&cfg, &copied)
                .unwrap()
                .contains("copied the data out first")
        );
        let off = Config {
            handover: false,
            ..Config::default()
        };
        assert_eq!(eligible(&off, &m), Some("handover = false"));
        let mapped = Config {
            device_map: vec![("a".into(), "b".into())],
            ..Config::default()
        };
        assert!(eligible(&mapped, &m).unwrap().contains("device_map"));
        let empty = Manifest {
            chunks: vec![],
            ..m
        };
        assert!(eligible(&cfg, &empty).is_some());
    }

    #[test]
    fn targets_follow_the_plan_and_refuse_a_bad_uuid() {
        let m = manifest();
        let same = targets(&m, &[]).unwrap();
        assert_eq!(same[&0], [0xaa; 16]);
        let pair = |new: &str| gpumap::Pair {
            old: "a".repeat(32),
            new: new.into(),
        };
        let moved = targets(&m, &[pair(&"b".repeat(32))]).unwrap();
        assert_eq!(moved[&0], [0xbb; 16]);
        assert_ne!(same, moved, "another plan is told apart");
        let e = targets(&m, &[pair("GPU-12")]).err().unwrap();
        assert!(e.to_string().contains("`GPU-12`"), "{e}");
    }
}
