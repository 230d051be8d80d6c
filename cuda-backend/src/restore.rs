//! The restore side: images are validated at `init` (before any process or GPU is touched),
//! then each process gets its control state back from the driver and its data from the agent.
//! [`RestoreRun`] is one `criu restore` as gpusnap sees it; per process, [`resume_one`] walks
//! the [`RestorePhase`]s in order, and a process that does not reach the end is killed.

use crate::agent::{self, AgentError};
use crate::context::{Ctx, CtxError};
use crate::datapath::{self, DataError};
use crate::gpumap;
use crate::preload::Preload;
use crate::staging::RingMaker;
use crate::stall::{self, DriverCall, StallError, Watched};
use crate::{DriverError, GpuUuid, ParseGpuUuidError};
use gpusnap_config::{Config, Mode, Verify};
use gpusnap_host::pid::{HostPid, NsPid};
use gpusnap_host::procfs;
use gpusnap_host::ptrace::{self, PtraceError, RunningThread};
use gpusnap_image::{CheckpointPath, ImageError, Manifest};
use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("CUDA IPC shares: {0}")]
    Sharing(#[from] crate::sharing::SharingError),
    #[error("{step}: {err}")]
    Driver { step: DriverStep, err: DriverError },
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("split data path: {0}")]
    Data(#[from] DataError),
    #[error(transparent)]
    Ptrace(#[from] PtraceError),
    #[error("the other threads of the process: {0}")]
    Stall(#[from] StallError),
    #[error("no gpusnap-agent thread in /proc/{pid}/task")]
    NoAgentThread { pid: HostPid },
    #[error("{}{err}", nspid.map(|n| format!("nspid {n}: ")).unwrap_or_default())]
    GpuPlan {
        nspid: Option<NsPid>,
        err: gpumap::PlanError,
    },
    #[error("cannot restore onto the planned GPUs: {0}")]
    GpuUuid(#[from] ParseGpuUuidError),
    #[error("image: {0}")]
    Image(#[from] ImageError),
    #[error("hand-over: {0}")]
    Preload(#[from] crate::preload::PreloadError),
    #[error(transparent)]
    Ctx(#[from] CtxError),
    #[error("the worker thread of pid {pid} panicked")]
    WorkerPanicked { pid: HostPid },
    #[error("the checksum pass panicked")]
    VerifyPanicked,
    #[error("the image failed its checksum pass; no GPU was touched")]
    DamagedImage,
    #[error(
        "the image does not match the process: its manifest (nspid {nspid}) lists {image}, but the restored agent of pid {pid} reports {agent}. \
         The manifest was changed after the dump or belongs to another dump; refused before anything was restored"
    )]
    ImageAgentMismatch {
        pid: HostPid,
        nspid: NsPid,
        image: &'static str,
        agent: &'static str,
    },
}

/// The driver call a [`RestoreError::Driver`] is about (callers match on it; shown as its
/// name in messages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverStep {
    /// Finding the thread that runs the driver's restore.
    FindRestoreThread,
    /// `cuCheckpointProcessRestore`.
    Restore,
    /// `cuCheckpointProcessUnlock`.
    Unlock,
}

impl std::fmt::Display for DriverStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DriverStep::FindRestoreThread => "finding the driver restore thread",
            DriverStep::Restore => "driver restore",
            DriverStep::Unlock => "driver unlock",
        })
    }
}

/// What the log adds to a process's failed restore, told by the failed step.
fn failure_hint(e: &RestoreError, several: bool) -> &'static str {
    match e {
        // Found on the H200: driver 580 checkpoints a CUDA IPC importer, then cannot restore it.
        RestoreError::Driver {
            step: DriverStep::Restore,
            ..
        } if several => {
            " A known cause with several GPU processes: one had opened another's memory through CUDA IPC, which the driver (before r610) checkpoints but cannot restore; such an image cannot be restored."
        }
        _ => "",
    }
}

/// Where one restored GPU process stands. A process that fails anywhere before `Running` is
/// killed: its image is unchanged, and a new restore can be tried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestorePhase {
    /// Restored by CRIU and held stopped; the driver holds its checkpointed control state.
    Stopped,
    /// The driver restored its control state (locked).
    ControlRestored,
    /// The driver unlocked it; on the split path its memory is not back yet.
    Unlocked,
    /// Every byte of its device data is back (nothing to load on the transparent path).
    Whole,
}

/// One restored process's timings, for the log and `gpusnap-stats.json`.
#[derive(Debug)]
pub struct RestoredProcess {
    pub nspid: NsPid,
    pub path: CheckpointPath,
    pub gpu_pairs: Vec<gpumap::Pair>,
    pub control_s: f64,
    pub unlock_s: f64,
    pub data: Option<datapath::LoadStats>,
    /// The data was loaded by the keeper beside CRIU's restore and handed over: the hand-over's
    /// own time (export, the job's maps, release).
    pub handover_s: Option<f64>,
    /// The keeper's load before the hand-over, phase by phase.
    pub keeper: Option<crate::preload::KeeperPhases>,
    /// Its agent maps another process's memory through CUDA IPC (its `Hello` before the
    /// restore said so): its shares are mapped again once the exporters' memory is back.
    pub ipc_imports: bool,
    /// It exported memory with `cuMemExportToShareableHandle`: its agent puts the new memory
    /// under the program's descriptors before any thread runs.
    pub shareable_exports: bool,
    pub total_s: f64,
}

impl RestoredProcess {
    pub fn to_json(&self) -> serde_json::Value {
        let mut timings = serde_json::json!({ "control": self.control_s, "unlock": self.unlock_s });
        if let Some(d) = &self.data {
            timings["data"] = serde_json::json!(d.seconds);
        }
        if let Some(h) = self.handover_s {
            timings["handover"] = serde_json::json!(h);
        }
        if let Some(k) = &self.keeper {
            timings["keeper_ready"] = serde_json::json!(k.ready_s);
            timings["keeper_expect"] = serde_json::json!(k.expect_s);
            timings["keeper_load"] = serde_json::json!(k.load_s);
        }
        timings["total"] = serde_json::json!(self.total_s);
        let mut v = serde_json::json!({
            "nspid": self.nspid.get(),
            "path": if self.path == CheckpointPath::Split { "split" } else { "transparent" },
            "gpu_pairs": self.gpu_pairs.iter().map(|p| format!("{}={}", p.old, p.new)).collect::<Vec<_>>(),
            "timings_s": timings,
        });
        if let Some(d) = &self.data {
            v["data_path"] = serde_json::json!(if self.handover_s.is_some() {
                "handoff"
            } else {
                "copy"
            });
            v["data"] = serde_json::json!({
                "device_bytes_loaded": d.bytes,
                "chunks_zero": d.zero_chunks,
                "bytes_zero": d.zero_bytes,
                "chunks_checked_on_device": d.verified_on_device,
            });
        }
        v
    }
}

/// The outcome per host pid.
pub type Restored = Vec<(HostPid, Result<RestoredProcess, RestoreError>)>;

/// Reads and checks every gpusnap manifest of the image dir: structure, sizes, headers, names;
/// gpusnap files of a process without a manifest (a dump that did not finish) refuse them all.
/// Runs in `init`, so a truncated or foreign image fails the restore before anything is created.
pub fn read_manifests(dir: BorrowedFd<'_>) -> Result<HashMap<NsPid, Manifest>, ImageError> {
    // AMD (kfd-path) processes are restored by the ROCm backend.
    Ok(gpusnap_image::read_manifests(dir)?
        .into_iter()
        .filter(|(_, m)| m.path != CheckpointPath::Kfd)
        .collect())
}

/// The full checksum pass over every data chunk on a thread of its own. On CRIU 4.2+ it starts
/// in POST_FORKING, once CRIU has forked every task (CRIU forks with a raw `clone`, so no thread
/// of ours may be alive before that), overlaps the rest of CRIU's restore, and is joined before
/// any GPU is touched (first RESUME_DEVICES_LATE) or in `exit`. The thread blocks every signal
/// (CRIU's SIGCHLD handler stays on its main thread) and does not log.
pub struct Verification {
    handle: Option<std::thread::JoinHandle<Result<(u64, f64), ImageError>>>,
    /// Whether CRIU's restore went on while the pass ran (POST_FORKING) or waited for it (`init`).
    overlapped: bool,
}

impl Verification {
    pub fn start(
        dir: BorrowedFd<'static>,
        manifests: Vec<Manifest>,
        threads: usize,
        overlapped: bool,
    ) -> Self {
        let handle = std::thread::Builder::new()
            .name("gpusnap-verify".into())
            .spawn(move || {
                gpusnap_host::signals::block_all();
                let t0 = Instant::now();
                let mut bytes = 0;
                for m in manifests.iter().filter(|m| !m.chunks.is_empty()) {
                    bytes += gpusnap_image::verify_image(dir, m, threads)?.bytes;
                }
                Ok((bytes, t0.elapsed().as_secs_f64()))
            })
            .ok();
        Self { handle, overlapped }
    }

    /// Waits for the pass; `Err` names the damage. Returns the seconds it took.
    pub fn finish(&mut self) -> Result<f64, RestoreError> {
        let Some(h) = self.handle.take() else {
            return Ok(0.0);
        };
        let (bytes, secs) = h.join().map_err(|_| RestoreError::VerifyPanicked)??;
        log::info!(
            "image data verified: {:.2} GiB in {secs:.3} s ({})",
            bytes as f64 / (1u64 << 30) as f64,
            if self.overlapped {
                "overlapped with CRIU's restore"
            } else {
                "before CRIU's restore, which waited for it"
            }
        );
        Ok(secs)
    }
}

/// The checksum pass of a restore, through its life.
enum Checksums {
    /// `verify_before_restore = off`.
    Skipped,
    /// Every chunk of every manifest carries a device hash: no host pass; each chunk is
    /// checked as it is read (its stored checksum) and on the GPU after the load, before any
    /// application thread runs (a mismatch kills the process; the image is untouched).
    OnDevice,
    /// To start in POST_FORKING (CRIU 4.2+).
    AfterFork(BorrowedFd<'static>),
    /// Running beside CRIU's restore.
    Running(Verification),
    /// Passed, in this many seconds.
    Passed(f64),
}

/// One `criu restore` of an image with GPU state.
pub struct RestoreRun {
    cfg: Config,
    dir: BorrowedFd<'static>,
    manifests: HashMap<NsPid, Manifest>,
    checksums: Checksums,
    /// `cuInit` started in POST_FORKING (4.2+) so that it overlaps the rest of CRIU's restore;
    /// joined before the first driver call needs it, or in `exit`.
    driver_warmup: Option<std::thread::JoinHandle<()>>,
    ctx: Option<Ctx>,
    /// Processes whose data the keeper loads beside CRIU's restore, by nspid
    /// ([`crate::preload`]); taken by the first RESUME_DEVICES_LATE.
    preloads: HashMap<NsPid, Preload>,
    /// The GPU plan `init` made from the kernel driver's listing, by nspid (what the keepers
    /// load onto; checked against the final plan before any hand-over).
    early_plan: HashMap<NsPid, Vec<gpumap::Pair>>,
    /// Where each recorded per-GPU device node is opened (made with the early plan), until the
    /// backend takes it for `RESTORE_EXT_FILE`.
    device_nodes: crate::devfile::NodePlan,
    /// Filled by the first RESUME_DEVICES_LATE, which restores every process.
    restored: Option<Restored>,
}

/// Why `init(RESTORE)` leaves a restore alone, or refuses it.
pub enum RestoreInit {
    /// gpusnap has nothing to do in this restore (the reason, for the log).
    NothingToDo(String),
    Run(Box<RestoreRun>),
    /// The restore must fail; already logged.
    Refused,
}

impl RestoreRun {
    /// `init(RESTORE)`: checks every manifest and the GPUs, before CRIU restores any process.
    pub fn init(cfg: Config, dir: Option<BorrowedFd<'static>>) -> RestoreInit {
        // `None`: CRIU 4.0 keeps no plugin list; go by our manifests alone.
        if gpusnap_host::criu::check_and_remove_inventory_plugin(gpusnap_host::criu::PLUGIN_NAME)
            == Some(false)
        {
            log::debug!("the image holds no GPU state; nothing to do");
            return RestoreInit::NothingToDo("no GPU state in this image".into());
        }
        let Some(dir) = dir else {
            log::error!("CRIU gave no image directory; cannot restore GPU state");
            return RestoreInit::Refused;
        };
        let manifests = match read_manifests(dir) {
            Ok(m) => m,
            Err(e) => {
                log::error!("restore refused: {e}; nothing was restored and no GPU was touched");
                return RestoreInit::Refused;
            }
        };
        if manifests.is_empty() {
            return RestoreInit::NothingToDo("no gpusnap manifests".into());
        }
        log::info!("images checked: {} GPU processes", manifests.len());
        for m in manifests.values() {
            let refs = m.chunks.iter().filter(|c| c.is_reference());
            let (n, bytes) = refs.fold((0u64, 0u64), |(n, b), c| (n + 1, b + c.len));
            if n > 0 {
                let depth = m.chunks.iter().map(|c| c.parent_depth).max().unwrap_or(0);
                log::info!(
                    "nspid {}: incremental image: {bytes} bytes in {n} chunks come from parent images (up to {depth} parent links up, checked)",
                    m.nspid
                );
            }
        }
        let mut run = RestoreRun {
            checksums: if cfg.verify_before_restore == Verify::Off {
                Checksums::Skipped
            } else if cfg.verify_before_restore == Verify::Auto
                && manifests.values().any(|m| !m.chunks.is_empty())
                && manifests.values().all(every_chunk_device_hashed)
            {
                log::info!(
                    "every chunk has a device hash: no host checksum pass; each chunk is checked on the GPU after loading, before the processes run (if the GPU cannot check them all, the host checks the image before they run)"
                );
                Checksums::OnDevice
            } else {
                Checksums::AfterFork(dir)
            },
            cfg,
            dir,
            manifests,
            driver_warmup: None,
            ctx: None,
            preloads: HashMap::new(),
            early_plan: HashMap::new(),
            device_nodes: Default::default(),
            restored: None,
        };
        if run.cfg.mode == Mode::Off {
            log::error!(
                "the image holds GPU state of {} processes but gpusnap is disabled (mode = off): they would run without it; enable gpusnap to restore",
                run.manifests.len()
            );
            return RestoreInit::Refused;
        }
        if let Some(why) = crate::context::driver_absent_reason() {
            // The restore fails either way; first say whether the image itself is damaged.
            if run.cfg.verify_before_restore != Verify::Off
                && let Err(e) = run.verify_now()
            {
                log::error!("restore refused: {e}; nothing was restored and no GPU was touched");
            }
            log::error!(
                "the image holds GPU state of {} processes but this host has no usable NVIDIA driver ({why}); restore on a host with driver r570 or newer",
                run.manifests.len()
            );
            return RestoreInit::Refused;
        }
        match node_check(dir, &run.manifests, &run.cfg) {
            Ok((plan, nodes)) => {
                run.early_plan = plan;
                run.device_nodes = nodes;
            }
            Err(e) => {
                log::error!(
                    "restore refused: {e} (checked against /proc/driver/nvidia and the driver library before CRIU restored any process); nothing was restored and no GPU was touched"
                );
                return RestoreInit::Refused;
            }
        }
        run.start_keepers();
        // No thread may live while CRIU forks the process tree: on CRIU 4.2+ the checksum pass
        // starts in POST_FORKING (after the forks) and overlaps the rest of CRIU's restore; on
        // older CRIU it runs here.
        if matches!(run.checksums, Checksums::AfterFork(_))
            && !gpusnap_host::criu::has_post_forking()
        {
            match run.verify_now() {
                Ok(secs) => run.checksums = Checksums::Passed(secs),
                Err(e) => {
                    log::error!(
                        "restore refused: {e}; nothing was restored and no GPU was touched"
                    );
                    return RestoreInit::Refused;
                }
            }
        }
        RestoreInit::Run(Box::new(run))
    }

    /// Where the recorded per-GPU device nodes are opened (`RESTORE_EXT_FILE`), made at `init`.
    pub fn take_device_nodes(&mut self) -> crate::devfile::NodePlan {
        std::mem::take(&mut self.device_nodes)
    }

    /// The full checksum pass, on this thread (its reader threads are joined before it returns).
    fn verify_now(&self) -> Result<f64, RestoreError> {
        Verification::start(
            self.dir,
            self.to_verify(),
            self.cfg.effective_reader_threads(),
            false,
        )
        .finish()
    }

    /// The manifests the checksum pass reads: a process the keeper loads has each chunk
    /// checked as it is read (and on the GPU), before its memory is handed over.
    fn to_verify(&self) -> Vec<Manifest> {
        self.manifests
            .values()
            .filter(|m| !self.preloads.contains_key(&m.nspid))
            .cloned()
            .collect()
    }

    /// `init`: a keeper for each process whose image can be handed over (only processes are
    /// started here: no thread may live while CRIU forks).
    fn start_keepers(&mut self) {
        let mut nspids: Vec<NsPid> = self.manifests.keys().copied().collect();
        nspids.sort_unstable();
        for nspid in nspids {
            let m = &self.manifests[&nspid];
            if let Some(why) = crate::preload::eligible(&self.cfg, m) {
                if has_data(m) {
                    log::info!(
                        "nspid {nspid}: the restored process's agent loads its data ({why})"
                    );
                }
                continue;
            }
            // The plan is known: the keeper makes its contexts there before its load begins.
            let plan = self.early_plan.get(&nspid).cloned().unwrap_or_default();
            let gpus: Vec<[u8; 16]> = crate::preload::targets(m, &plan)
                .map(|t| t.into_values().collect())
                .unwrap_or_default();
            match Preload::start(&self.cfg, m, &gpus) {
                Ok(p) => {
                    if let Preload::Started(k) = &p {
                        log::info!(
                            "nspid {nspid}: restore hand-over planned: keeper pid {} loads {:.2} GiB beside CRIU's restore",
                            k.pid(),
                            m.allocations
                                .iter()
                                .filter(|a| a.moved)
                                .map(|a| a.size)
                                .sum::<u64>() as f64
                                / (1u64 << 30) as f64
                        );
                    }
                    self.preloads.insert(nspid, p);
                }
                Err(e) => log::warn!(
                    "nspid {nspid}: no keeper for the restore ({e}); the restored process's agent loads its data"
                ),
            }
        }
    }

    /// Starts every keeper's load still waiting (POST_FORKING, or the first
    /// RESUME_DEVICES_LATE on CRIU without that hook).
    fn start_loads(&mut self) {
        let checks = self.read_checks();
        for (nspid, p) in std::mem::take(&mut self.preloads) {
            let p = match p {
                Preload::Started(_) => {
                    let m = self.manifests[&nspid].clone();
                    let plan = self.early_plan.get(&nspid).cloned().unwrap_or_default();
                    match crate::preload::targets(&m, &plan) {
                        Ok(targets) => p.load(crate::preload::LoadJob {
                            dir: self.dir,
                            manifest: m,
                            targets,
                            slots: self.cfg.staging_slots as usize,
                            readers: self.cfg.effective_reader_threads(),
                            limits: crate::context::limits_of(&self.cfg),
                            checks,
                        }),
                        Err(e) => Preload::NotStarted(e),
                    }
                }
                other => other,
            };
            self.preloads.insert(nspid, p);
        }
    }

    /// How a load checks what it reads (the checksum pass decides).
    fn read_checks(&self) -> datapath::ReadChecks {
        // With no host pass, the GPU's check after loading is the check: the readers do not
        // hash what it will hash, and a chunk it could not check fails the load.
        match self.checksums {
            Checksums::OnDevice => datapath::ReadChecks::GpuWhereHashed,
            _ => datapath::ReadChecks::Host,
        }
    }

    /// POST_FORKING (CRIU 4.2+): every task is forked; the checksum pass and `cuInit` start
    /// now, beside the rest of CRIU's restore.
    pub fn post_forking(&mut self) {
        // The keepers' loads first: they are the longest part left.
        self.start_loads();
        if let Checksums::AfterFork(dir) = self.checksums {
            self.checksums = Checksums::Running(Verification::start(
                dir,
                self.to_verify(),
                self.cfg.effective_reader_threads(),
                true,
            ));
        }
        if self.ctx.is_none() {
            // cuInit takes ~0.2 s on the H200; CRIU restores memory meanwhile. The driver is
            // loaded already (init checked it), and no process is forked after this hook.
            self.driver_warmup = std::thread::Builder::new()
                .name("gpusnap-cuinit".into())
                .spawn(|| {
                    gpusnap_host::signals::block_all();
                    if let Ok(api) = crate::driver::api()
                        && let Err(e) = api.init()
                    {
                        // Said again, with context, when the restore needs the driver.
                        log::debug!("cuInit beside CRIU's restore failed: {e}");
                    }
                })
                .ok();
        }
    }

    /// Joins the checksum pass (started in POST_FORKING, or now if that hook never came).
    fn checksums_passed(&mut self) -> Result<(), RestoreError> {
        let secs = match std::mem::replace(&mut self.checksums, Checksums::Skipped) {
            Checksums::Running(mut v) => v.finish()?,
            Checksums::AfterFork(_) => self.verify_now()?,
            Checksums::Passed(s) => s,
            c @ (Checksums::Skipped | Checksums::OnDevice) => {
                self.checksums = c;
                return Ok(());
            }
        };
        self.checksums = Checksums::Passed(secs);
        Ok(())
    }

    fn ctx(&mut self) -> Result<&Ctx, CtxError> {
        if self.ctx.is_none() {
            if let Some(h) = self.driver_warmup.take() {
                let _ = h.join();
                log::info!("cuInit ran beside CRIU's restore (started in POST_FORKING)");
            }
            self.ctx = Some(Ctx::open(&self.cfg, Some(self.dir))?);
        }
        Ok(self.ctx.as_ref().expect("set above"))
    }

    /// RESUME_DEVICES_LATE: the first call restores every GPU process of the image, in
    /// parallel; every call answers for its pid. `None`: not one of ours.
    pub fn resume_devices_late(&mut self, pid: HostPid) -> Option<bool> {
        if self.restored.is_none() {
            self.restored = Some(self.restore_all(pid));
            // Now, while CRIU's image directory is open (CRIU closes it before `exit`).
            self.write_stats();
        }
        self.restored
            .as_ref()?
            .iter()
            .find(|(p, _)| *p == pid)
            .map(|(_, r)| r.is_ok())
    }

    fn restore_all(&mut self, any_pid: HostPid) -> Restored {
        // CRIU without POST_FORKING: the keepers' loads begin now, beside the control restores.
        self.start_loads();
        // Still before any GPU is touched.
        if let Err(e) = self.checksums_passed() {
            log::error!(
                "restore refused: {e}; no GPU was touched. The restored processes are killed rather than left without their GPU state"
            );
            self.drop_preloads();
            let nspids: Vec<NsPid> = self.manifests.keys().copied().collect();
            let found = find_restored(any_pid, &nspids);
            for (nspid, host) in &found {
                kill(*host, *nspid);
            }
            // Answer -1 for every restored process of ours (and the pid asked about).
            let mut out: Restored = found
                .into_values()
                .map(|p| (p, Err(RestoreError::DamagedImage)))
                .collect();
            if !out.iter().any(|(p, _)| *p == any_pid) {
                out.push((any_pid, Err(e)));
            }
            return out;
        }
        if let Err(e) = self.ctx() {
            log::error!("cannot use the NVIDIA driver: {e}");
            self.drop_preloads();
            return vec![(any_pid, Err(e.into()))];
        }
        let nspids: Vec<NsPid> = self.manifests.keys().copied().collect();
        let found = find_restored(any_pid, &nspids);
        let mut items = Vec::new();
        for (nspid, m) in &self.manifests {
            match found.get(nspid) {
                Some(&host) => items.push((host, m.clone())),
                None => log::error!(
                    "no restored process has nspid {nspid}; its GPU state is not restored"
                ),
            }
        }
        let checks = self.read_checks();
        let mut items: Vec<RestoreItem> = items
            .into_iter()
            .map(|(pid, manifest)| RestoreItem {
                pid,
                preload: self.preloads.remove(&manifest.nspid),
                early: self
                    .early_plan
                    .get(&manifest.nspid)
                    .cloned()
                    .unwrap_or_default(),
                manifest,
            })
            .collect();
        // A keeper whose process was not found goes now (from here its exit is harmless, and
        // CRIU waits for every child once the restore is over).
        for (nspid, p) in std::mem::take(&mut self.preloads) {
            log::debug!("nspid {nspid}: keeper {p:?} dropped: no such restored process");
            p.abandon();
        }
        let ctx = self.ctx.as_ref().expect("opened above");
        let restored = resume_all(ctx, &mut items, checks);
        let several = restored.len() > 1;
        for (p, r) in &restored {
            if let Err(e) = r {
                let hint = failure_hint(e, several);
                log::error!(
                    "pid {p}: GPU restore failed: {e}. The process is killed rather than left running without its GPU state; the image is unchanged: fix the cause and restore again.{hint}"
                );
                kill(*p, procfs::ns_pid(*p).unwrap_or(NsPid(0)));
            }
        }
        restored
    }

    /// Ends every keeper not handed over yet (joining its load).
    fn drop_preloads(&mut self) {
        for (_, p) in std::mem::take(&mut self.preloads) {
            p.abandon();
        }
    }

    /// `exit(RESTORE)`: joins what still runs (CRIU unloads the plugin next).
    pub fn exit(&mut self) {
        // A restore that failed before RESUME_DEVICES_LATE: the keepers go with it.
        self.drop_preloads();
        if let Checksums::Running(mut v) =
            std::mem::replace(&mut self.checksums, Checksums::Skipped)
        {
            let _ = v.finish();
        }
        if let Some(h) = self.driver_warmup.take() {
            let _ = h.join();
        }
    }

    /// Adds the restore's timings to `gpusnap-stats.json` (best effort: the image directory may
    /// be read-only at restore).
    fn write_stats(&self) {
        let processes: Vec<serde_json::Value> = self
            .restored
            .iter()
            .flatten()
            .filter_map(|(_, r)| r.as_ref().ok().map(RestoredProcess::to_json))
            .collect();
        if processes.is_empty() {
            return;
        }
        let mut doc = gpusnap_image::read_stats(self.dir)
            .ok()
            .flatten()
            .filter(|v| v.is_object())
            .unwrap_or_else(|| serde_json::json!({}));
        let (verify_s, checksums) = match self.checksums {
            Checksums::Passed(s) => (Some(s), "host pass"),
            Checksums::OnDevice => (None, "on the GPU after loading"),
            _ => (None, "as read only"),
        };
        doc["restore"] = serde_json::json!({
            "verify_s": verify_s,
            "checksums": checksums,
            "processes": processes,
        });
        if let Err(e) = gpusnap_image::write_stats(self.dir, &doc) {
            log::debug!("restore timings not added to gpusnap-stats.json: {e}");
        }
    }
}

/// Whether every chunk of `m` carries a hash computed on the GPU (a manifest without chunks
/// counts: there is nothing to check).
fn every_chunk_device_hashed(m: &Manifest) -> bool {
    m.chunks.iter().all(|c| c.device_hash.is_some())
}

/// Kills a restored process whose GPU state cannot be brought back (CRIU holds it stopped),
/// and reaps its threads ([`gpusnap_host::reap`] says why: a container's PID 1 would hang CRIU).
fn kill(pid: HostPid, nspid: NsPid) {
    if let Err(e) = gpusnap_host::reap::kill_and_reap(pid) {
        log::error!("pid {pid} (nspid {nspid}): {e}; it must not run: kill it by hand");
    }
}

fn moved_bytes_on(m: &Manifest, device: u32) -> u64 {
    m.allocations
        .iter()
        .filter(|a| a.moved && a.device == device)
        .map(|a| a.size)
        .sum()
}

/// Why this node cannot take the image: every mismatch found, in one message.
#[derive(Debug, thiserror::Error)]
#[error("this node cannot take the image: {}", numbered(.0))]
pub struct NodeRefusal(pub Vec<NodeMismatch>);

/// One reason of a [`NodeRefusal`].
#[derive(Debug, thiserror::Error)]
pub enum NodeMismatch {
    #[error(transparent)]
    DriverStack(#[from] crate::driver::stack::Mismatch),
    #[error(transparent)]
    Gpus(#[from] RestoreError),
    #[error(transparent)]
    DeviceFile(#[from] crate::devfile::NodeError),
}

fn numbered(v: &[NodeMismatch]) -> String {
    if let [one] = v {
        return one.to_string();
    }
    v.iter()
        .enumerate()
        .map(|(i, m)| format!("({}) {m}", i + 1))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Everything `init` checks of this node before CRIU creates any process, every mismatch at
/// once: the driver stack ([`crate::driver::stack::check_node`]: kernel driver version, driver
/// library), the GPUs ([`early_gpu_check`]: models, UUIDs, `device_map`) and the per-GPU device
/// nodes the image's processes held ([`crate::devfile::plan_at_init`]). On success, the early
/// GPU plan and where each device node is opened.
pub fn node_check(
    dir: BorrowedFd<'_>,
    manifests: &HashMap<NsPid, Manifest>,
    cfg: &Config,
) -> Result<(HashMap<NsPid, Vec<gpumap::Pair>>, crate::devfile::NodePlan), NodeRefusal> {
    let mut ms: Vec<&Manifest> = manifests.values().collect();
    ms.sort_by_key(|m| m.nspid);
    let node_kernel = crate::driver::stack::kernel_driver_version();
    let mut problems: Vec<NodeMismatch> = crate::driver::stack::check_node(
        ms.iter().copied(),
        node_kernel.as_deref(),
        cfg.allow_other_kernel_driver,
    )
    .into_iter()
    .map(NodeMismatch::from)
    .collect();
    let plan = early_gpu_check_with(
        &crate::host_gpus::proc_dir(),
        manifests,
        &cfg.device_map,
        &free_at_init,
    );
    let planned: Vec<gpumap::Pair> = ms
        .iter()
        .filter_map(|m| plan.as_ref().ok()?.get(&m.nspid))
        .flatten()
        .cloned()
        .collect();
    let mig = manifests
        .values()
        .any(|m| gpumap::planned_by_the_driver(&m.gpus, &[]));
    let nodes = crate::devfile::plan_at_init(dir, &cfg.device_map, &planned, mig);
    let plan = match plan {
        Ok(p) => Some(p),
        Err(gpu) => {
            problems.extend(gpu.into_iter().map(NodeMismatch::from));
            None
        }
    };
    let nodes = match nodes {
        Ok(n) => Some(n),
        Err(n) => {
            problems.extend(n.into_iter().map(NodeMismatch::from));
            None
        }
    };
    match (plan, nodes) {
        (Some(plan), Some(nodes)) if problems.is_empty() => Ok((plan, nodes)),
        _ => Err(NodeRefusal(problems)),
    }
}

/// The GPU plan of every process against the GPUs the kernel driver lists (model and UUID, and
/// free memory where NVML tells it: `free_at_init`; [`gpu_plan`] checks it again once the
/// driver is loaded), in `init`, before CRIU restores any process. Where
/// the list cannot be read, or cannot speak for the image's GPUs, the check is left to
/// [`gpu_plan`] and `Ok` is returned: MIG instances (CUDA names them `... MIG ...` and gives them
/// their own UUIDs, while the list holds the physical GPUs), and a `device_map` target the list
/// lacks on a host that has MIG instances or cannot tell ([`crate::host_gpus::mig_instances`]).
/// On a host without MIG instances such a target is refused here, naming the host's GPUs.
/// Every process's problem is returned (one per process; one per unlisted target).
pub fn early_gpu_check(
    manifests: &HashMap<NsPid, Manifest>,
    device_map: &[(String, String)],
) -> Result<HashMap<NsPid, Vec<gpumap::Pair>>, Vec<RestoreError>> {
    early_gpu_check_with(
        &crate::host_gpus::proc_dir(),
        manifests,
        device_map,
        &free_at_init,
    )
}

/// How long `init` waits for NVML's answer on free memory before it leaves the check to
/// RESUME_DEVICES_LATE (NVML may bring up each GPU without persistence mode: seconds).
const FREE_AT_INIT_WITHIN: std::time::Duration = std::time::Duration::from_secs(15);

/// Free memory of the listed GPUs `uuids` at `init`, asked of NVML in a child process
/// ([`crate::nvml::free_memory_apart`]); what NVML cannot tell is absent, and not judged.
fn free_at_init(uuids: &[String]) -> HashMap<String, u64> {
    let t0 = Instant::now();
    match crate::nvml::free_memory_apart(uuids, FREE_AT_INIT_WITHIN) {
        Ok(free) => {
            log::info!(
                "free memory of {} of {} GPUs known before CRIU's restore (NVML, asked in a child process, {:.3} s)",
                free.len(),
                uuids.len(),
                t0.elapsed().as_secs_f64()
            );
            free
        }
        Err(e) => {
            log::info!(
                "free memory not known before CRIU's restore (the NVML query: {e}); it is checked once the driver is loaded"
            );
            HashMap::new()
        }
    }
}

/// Device memory the image's process `m` needs on its GPU `ordinal`: what its tracked
/// allocations took there (`requires.gpu_mem_used`), else (images before it) what gpusnap
/// re-creates there.
fn need_on(m: &Manifest, ordinal: u32) -> u64 {
    m.requires
        .as_ref()
        .and_then(|r| r.gpu_mem_used.get(&ordinal).copied())
        .unwrap_or_else(|| moved_bytes_on(m, ordinal))
}

/// [`early_gpu_check`] against the listing in `dir`, with `free_of` for the free memory of the
/// listed GPUs (asked only when some GPU of the image needs memory).
fn early_gpu_check_with(
    dir: &std::path::Path,
    manifests: &HashMap<NsPid, Manifest>,
    device_map: &[(String, String)],
    free_of: &dyn Fn(&[String]) -> HashMap<String, u64>,
) -> Result<HashMap<NsPid, Vec<gpumap::Pair>>, Vec<RestoreError>> {
    let none = HashMap::new();
    if manifests
        .values()
        .any(|m| gpumap::planned_by_the_driver(&m.gpus, &[]))
    {
        log::debug!("GPU plan left to the driver (MIG instances)");
        return Ok(none);
    }
    let host = match crate::host_gpus::list(dir) {
        Ok(h) if !h.is_empty() => h,
        Ok(_) => return Ok(none),
        Err(e) => {
            log::debug!("GPU plan left to the driver: {e}");
            return Ok(none);
        }
    };
    // A device_map whose targets are all physical GPUs of the kernel's listing is checked now
    // (models included), before CRIU creates any process. A target the listing lacks is a MIG
    // instance (the driver's to plan, after CRIU's restore) or no GPU of this host: refused now
    // where the host has no MIG instance it could be.
    let unlisted: Vec<&str> = device_map
        .iter()
        .map(|(_, new)| new.as_str())
        .filter(|new| !host.iter().any(|h| h.uuid == *new))
        .collect();
    if !unlisted.is_empty() {
        let named = unlisted
            .iter()
            .map(|u| gpumap::dashed(u))
            .collect::<Vec<_>>()
            .join(", ");
        match crate::host_gpus::mig_instances(dir) {
            crate::host_gpus::MigInstances::Absent => {
                let host_gpus = host
                    .iter()
                    .map(|h| format!("{} ({})", gpumap::dashed(&h.uuid), h.name))
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(unlisted
                    .iter()
                    .map(|new| RestoreError::GpuPlan {
                        nspid: None,
                        err: gpumap::PlanError::MapTargetUnknown {
                            new: gpumap::dashed(new),
                            host_gpus: host_gpus.clone(),
                        },
                    })
                    .collect());
            }
            crate::host_gpus::MigInstances::Present(gi) => log::info!(
                "GPU plan left to the driver: device_map names {named}, which the kernel does not list as a GPU, and this host has MIG instances ({}) it may be",
                gi.display()
            ),
            crate::host_gpus::MigInstances::Unknown(e) => log::info!(
                "GPU plan left to the driver: device_map names {named}, which the kernel does not list as a GPU, and whether this host has MIG instances it may be cannot be told ({e})"
            ),
        }
        return Ok(none);
    }
    let mut ms: Vec<&Manifest> = manifests.values().filter(|m| !m.gpus.is_empty()).collect();
    ms.sort_by_key(|m| m.nspid);
    let needs: HashMap<NsPid, Vec<u64>> = ms
        .iter()
        .map(|m| {
            (
                m.nspid,
                m.gpus.iter().map(|g| need_on(m, g.ordinal)).collect(),
            )
        })
        .collect();
    let host = if needs.values().flatten().any(|&n| n > 0) {
        let uuids: Vec<String> = host.iter().map(|h| h.uuid.clone()).collect();
        let free = free_of(&uuids);
        host.into_iter()
            .map(|h| gpumap::HostGpu {
                free: free.get(&h.uuid).copied(),
                ..h
            })
            .collect()
    } else {
        host
    };
    let mut plan = HashMap::new();
    let mut problems = Vec::new();
    for m in &ms {
        match plan_against_listing(m, &host, device_map, &needs[&m.nspid]) {
            Ok(pairs) => {
                plan.insert(m.nspid, pairs);
            }
            Err(err) => problems.push(RestoreError::GpuPlan {
                nspid: Some(m.nspid),
                err,
            }),
        }
    }
    if problems.is_empty() {
        problems.extend(shared_shortfalls(&ms, &plan, &needs, &host));
    }
    if problems.is_empty() {
        Ok(plan)
    } else {
        Err(problems)
    }
}

/// Each GPU of this host that several processes are planned onto and that has less free memory
/// than they need together (each alone fits: [`gpumap::plan`] checked it).
fn shared_shortfalls(
    ms: &[&Manifest],
    plan: &HashMap<NsPid, Vec<gpumap::Pair>>,
    needs: &HashMap<NsPid, Vec<u64>>,
    host: &[gpumap::HostGpu],
) -> Vec<RestoreError> {
    let mut on: std::collections::BTreeMap<&str, (u64, usize)> = Default::default();
    for m in ms {
        let pairs = plan.get(&m.nspid).map_or(&[][..], Vec::as_slice);
        for (g, need) in m.gpus.iter().zip(&needs[&m.nspid]) {
            let target = pairs
                .iter()
                .find(|p| p.old == g.uuid)
                .map_or(g.uuid.as_str(), |p| p.new.as_str());
            let e = on.entry(target).or_default();
            e.0 += need;
            e.1 += 1;
        }
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    on.into_iter()
        .filter(|(_, (_, n))| *n > 1)
        .filter_map(|(target, (need, _))| {
            let h = host.iter().find(|h| h.uuid == target)?;
            let free = h.free.filter(|&f| f < need)?;
            Some(RestoreError::GpuPlan {
                nspid: None,
                err: gpumap::PlanError::NotEnoughFree {
                    target: target.to_owned(),
                    target_name: h.name.clone(),
                    free_gib: gib(free),
                    need_gib: gib(need),
                    short_gib: gib(need - free),
                },
            })
        })
        .collect()
}

/// [`gpumap::plan`] against the kernel driver's listing. A listed GPU with a UUID of the image is
/// the same physical GPU: it takes the image's model name, so that a difference in how the two
/// sources spell a model can never refuse a restore onto the very GPUs of the dump.
fn plan_against_listing(
    m: &Manifest,
    listed: &[gpumap::HostGpu],
    device_map: &[(String, String)],
    need: &[u64],
) -> Result<Vec<gpumap::Pair>, gpumap::PlanError> {
    let host: Vec<gpumap::HostGpu> = listed
        .iter()
        .map(|h| match m.gpus.iter().find(|g| g.uuid == h.uuid) {
            Some(g) => gpumap::HostGpu {
                name: g.name.clone(),
                ..h.clone()
            },
            None => h.clone(),
        })
        .collect();
    gpumap::plan(&m.gpus, need, &host, device_map)
}

/// Where each GPU of the image goes, checked for model and free memory before anything is
/// touched. A process whose keeper holds its memory keeps `init`'s plan (`early`: the GPUs the
/// keeper loaded onto, chosen with their free memory), checked again: its memory is there
/// already, so another GPU of the model is no better place (with no need counted, the first of
/// the model would be taken, and the hand-over dropped).
pub fn gpu_plan(
    ctx: &Ctx,
    m: &Manifest,
    held_by_keeper: bool,
    early: &[gpumap::Pair],
) -> Result<Vec<gpumap::Pair>, gpumap::PlanError> {
    let need: Vec<u64> = m
        .gpus
        .iter()
        .map(|g| {
            if held_by_keeper {
                0
            } else {
                moved_bytes_on(m, g.ordinal)
            }
        })
        .collect();
    let host: Vec<gpumap::HostGpu> = ctx
        .gpus
        .iter()
        .map(|g| gpumap::HostGpu {
            uuid: g.uuid.to_string(),
            name: g.name.clone(),
            free: crate::nvml::free_memory(&g.uuid),
        })
        .collect();
    // A keeper is started only without a device_map (`preload::eligible`), so init's pairs
    // stand alone here.
    let kept: Vec<(String, String)>;
    let configured = if held_by_keeper && !early.is_empty() && ctx.cfg.device_map.is_empty() {
        kept = early
            .iter()
            .map(|p| (p.old.clone(), p.new.clone()))
            .collect();
        &kept
    } else {
        &ctx.cfg.device_map
    };
    let pairs = gpumap::plan(&m.gpus, &need, &host, configured)?;
    for p in &pairs {
        log::info!(
            "nspid {}: GPU {} is restored onto GPU {}",
            m.nspid,
            p.old,
            p.new
        );
    }
    Ok(pairs)
}

/// The planned pairs as the driver takes them. A UUID that does not parse is refused, naming
/// it: dropping its pair would leave the driver a GPU set other than the plan.
fn uuid_pairs(pairs: &[gpumap::Pair]) -> Result<Vec<(GpuUuid, GpuUuid)>, ParseGpuUuidError> {
    pairs
        .iter()
        .map(|p| Ok((p.old.parse()?, p.new.parse()?)))
        .collect()
}

/// Host pids of the restored processes our manifests describe. All restored tasks live in the
/// pid namespace of `any_pid` (a pid CRIU handed us) and are stopped at this point.
pub fn find_restored(any_pid: HostPid, nspids: &[NsPid]) -> HashMap<NsPid, HostPid> {
    let want_ns = procfs::namespace(any_pid, "pid").ok();
    let mut out = HashMap::new();
    let Ok(pids) = procfs::processes() else {
        return out;
    };
    for pid in pids {
        if procfs::namespace(pid, "pid").ok() != want_ns {
            continue;
        }
        if let Ok(nspid) = procfs::ns_pid(pid)
            && nspids.contains(&nspid)
        {
            out.insert(nspid, pid);
        }
    }
    out
}

/// One restored GPU process: its host pid, its manifest, and its hand-over if the keeper
/// loads its data.
pub struct RestoreItem {
    pub pid: HostPid,
    pub manifest: Manifest,
    pub preload: Option<Preload>,
    /// `init`'s plan for it (what its keeper loaded onto).
    pub early: Vec<gpumap::Pair>,
}

/// RESUME_DEVICES_LATE for every GPU process of the image at once: threads are resumed here
/// (CRIU's main thread, the tracer), the driver and data work of each process runs on a worker
/// of its own, and the threads are stopped here again.
pub fn resume_all(ctx: &Ctx, items: &mut [RestoreItem], checks: datapath::ReadChecks) -> Restored {
    let t0 = Instant::now();
    let mut results = Vec::new();
    let mut work = Vec::new();
    for item in items.iter_mut() {
        let (pid, m) = (item.pid, &item.manifest);
        // Memory a keeper holds already needs no more room on the GPU.
        let planned = gpu_plan(ctx, m, item.preload.is_some(), &item.early).map_err(|err| {
            RestoreError::GpuPlan {
                nspid: Some(m.nspid),
                err,
            }
        });
        match planned.and_then(|pairs| prepare(ctx, pid, m).map(|t| (pairs, t))) {
            Ok((pairs, threads)) => work.push((pid, m, pairs, threads, item.preload.take())),
            Err(e) => {
                if let Some(p) = item.preload.take() {
                    p.abandon();
                }
                results.push((pid, Err(e)));
            }
        }
    }
    let calls: Vec<DriverCall> = work.iter().map(|_| DriverCall::default()).collect();
    // A restore places no hold (a dying CRIU kills the process instead).
    let no_hold = std::sync::Mutex::new(None);
    let watched: Vec<Watched<'_>> = work
        .iter()
        .zip(&calls)
        .map(|((pid, _, _, threads, _), call)| Watched {
            pid: *pid,
            running: threads.iter().map(RunningThread::tid).collect(),
            call,
            release: &no_hold,
        })
        .collect();
    let preloads: Vec<Option<Preload>> = work.iter_mut().map(|w| w.4.take()).collect();
    let (outcomes, leftovers) = std::thread::scope(|s| {
        let handles: Vec<_> = work
            .iter()
            .zip(&calls)
            .zip(preloads)
            .map(|(((pid, m, pairs, _, _), call), preload)| {
                let (pid, m) = (*pid, *m);
                s.spawn(move || {
                    gpusnap_host::signals::block_all();
                    resume_one(ctx, pid, m, pairs, call, checks, preload)
                })
            })
            .collect();
        let leftovers = stall::watch(|| handles.iter().all(|h| h.is_finished()), &watched);
        let outcomes: Vec<_> = handles
            .into_iter()
            .zip(&work)
            .map(|(h, (pid, ..))| {
                h.join()
                    .unwrap_or(Err(RestoreError::WorkerPanicked { pid: *pid }))
            })
            .collect();
        (outcomes, leftovers)
    });
    let n = work.len();
    let mut split = Vec::new();
    let mut importers = Vec::new();
    let mut exporters = Vec::new();
    for (((pid, m, _, threads, _), r), leftover) in work.into_iter().zip(outcomes).zip(leftovers) {
        let stopped = ptrace::stop_all(threads, "stopping a thread after the restore");
        if let Ok(p) = r.as_ref()
            && p.path == CheckpointPath::Split
        {
            let me = crate::sharing::Process {
                pid,
                nspid: m.nspid,
            };
            split.push(me);
            if p.ipc_imports {
                importers.push(me);
            }
            if p.shareable_exports {
                exporters.push(me);
            }
        }
        results.push((
            pid,
            stopped
                .map_err(RestoreError::from)
                .and(leftover.map_err(RestoreError::from))
                .and(r),
        ));
    }
    // Every exporter's memory is back: the descriptors an exporter's program holds of its
    // shareable exports are made to name it (a placeholder CRIU restored must never reach a
    // running program), and importers map their CUDA IPC shares again, before any of their
    // threads runs. One that cannot is not restored (it is killed with the others that failed).
    for p in &exporters {
        if let Err(e) = crate::sharing::repoint(*p, ctx.agent_timeout(), None)
            && let Some((_, r)) = results.iter_mut().find(|(pid, _)| *pid == p.pid)
        {
            *r = Err(e.into());
        }
    }
    let fetch = crate::sharing::from_traced(&split, ctx.agent_timeout());
    for p in &importers {
        if let Err(e) =
            crate::sharing::reimport(*p, &fetch, ctx.agent_timeout(), Some("restore-reimport"))
            && let Some((_, r)) = results.iter_mut().find(|(pid, _)| *pid == p.pid)
        {
            *r = Err(e.into());
        }
    }
    if n > 1 {
        log::info!(
            "{n} GPU processes restored in parallel in {:.3} s",
            t0.elapsed().as_secs_f64()
        );
    }
    results
}

/// Whether the process has device data for the agent to load.
fn has_data(m: &Manifest) -> bool {
    m.path == CheckpointPath::Split && !m.chunks.is_empty()
}

/// Resumes the driver's restore thread (and the agent's).
fn prepare(ctx: &Ctx, pid: HostPid, m: &Manifest) -> Result<Vec<RunningThread>, RestoreError> {
    let restore_tid = ctx
        .api
        .restore_thread_id(pid)
        .map_err(|err| RestoreError::Driver {
            step: DriverStep::FindRestoreThread,
            err,
        })?;
    // From here until the restore is complete, a CRIU that dies takes the process with it
    // (its image is intact): it must never run half-restored.
    gpusnap_host::hold::kill_if_criu_dies(pid, &[])?;
    let mut threads = vec![ptrace::resume(restore_tid, "driver restore thread")?];
    // The agent runs whenever the process has one: it loads the data, and before anything is
    // restored it says whether the memory is released (`image_matches_agent`).
    match agent::agent_thread(pid) {
        Some(tid) => threads.push(ptrace::resume(tid, "agent thread")?),
        None if has_data(m) => return Err(RestoreError::NoAgentThread { pid }),
        None => {}
    }
    Ok(threads)
}

/// What the image claims against what the restored agent says, before anything is restored.
/// Checksums make an image intact, not authentic: a manifest rewritten and sealed again to list
/// no data would let a process whose dump released its memory run without it. The agent, part
/// of the restored process, knows whether its memory was released. Returns the agent's
/// sharing hazard bits (`hazard::SHARING`, from the same `Hello`).
fn image_matches_agent(ctx: &Ctx, pid: HostPid, m: &Manifest) -> Result<u32, RestoreError> {
    // An image without data may come from a dump whose agent hung (it fell back to the driver
    // path), and such an agent may hang still: ask briefly.
    let wait = if has_data(m) {
        ctx.agent_timeout()
    } else {
        ctx.agent_timeout().min(std::time::Duration::from_secs(3))
    };
    // A connection that fails counts as an agent that does not answer (its door still sealed
    // by the dump: an agent that hung then has not run since).
    let Some(session) = agent::AgentSession::connect(pid, wait).transpose() else {
        // No agent listens: nothing was moved by one (`prepare` refused an image that says so).
        return Ok(0);
    };
    let (released, sharing) = match session.and_then(|s| s.hello()) {
        Ok(h) => (h.released, h.hazards & gpusnap_proto::hazard::SHARING),
        Err(e) if !has_data(m) => {
            log::warn!(
                "pid {pid}: its agent does not answer ({e}); the image lists no device data for it, so the driver's checkpoint holds all of it: restoring without the cross-check"
            );
            return Ok(0);
        }
        Err(e) => return Err(e.into()),
    };
    if released == has_data(m) {
        return Ok(sharing);
    }
    Err(RestoreError::ImageAgentMismatch {
        pid,
        nspid: m.nspid,
        image: if has_data(m) {
            "device data for the agent to load"
        } else {
            "no device data for the agent to load"
        },
        agent: if released {
            "its memory released"
        } else {
            "its memory in place"
        },
    })
}

/// Control state back from the driver, then the data through the agent: one process through
/// its [`RestorePhase`]s. The driver restore runs through `call`, which CRIU's main thread
/// watches ([`stall::watch`]); any thread it let run is stopped again before the unlock.
fn resume_one(
    ctx: &Ctx,
    pid: HostPid,
    m: &Manifest,
    pairs: &[gpumap::Pair],
    call: &DriverCall,
    checks: datapath::ReadChecks,
    mut preload: Option<Preload>,
) -> Result<RestoredProcess, RestoreError> {
    let t0 = Instant::now();
    let driver = |step| move |err| RestoreError::Driver { step, err };
    // The ring is made while the driver restores the control state (a keeper has its own).
    let mut ring = (has_data(m) && preload.is_none())
        .then(|| RingMaker::start(crate::load::ring_shape(ctx.cfg.staging_slots as usize, m)));
    let mut phase = RestorePhase::Stopped;
    let mut out = RestoredProcess {
        nspid: m.nspid,
        path: m.path.clone(),
        gpu_pairs: pairs.to_vec(),
        control_s: 0.0,
        unlock_s: 0.0,
        data: None,
        handover_s: None,
        keeper: None,
        ipc_imports: false,
        shareable_exports: false,
        total_s: 0.0,
    };
    let uuids = uuid_pairs(pairs)?;
    // The keeper's load must be on the very GPUs of this plan.
    let targets = preload
        .as_ref()
        .map(|_| crate::preload::targets(m, pairs))
        .transpose()?;
    let sharing = image_matches_agent(ctx, pid, m)?;
    out.ipc_imports = sharing & gpusnap_proto::hazard::IMPORTING != 0;
    out.shareable_exports = sharing & gpusnap_proto::hazard::SHAREABLE_EXPORT != 0;
    while phase != RestorePhase::Whole {
        phase = match phase {
            RestorePhase::Stopped => {
                let (restored, refrozen) = call.run(|| ctx.api.restore(pid, &uuids));
                restored.map_err(driver(DriverStep::Restore))?;
                refrozen?;
                out.control_s = t0.elapsed().as_secs_f64();
                gpusnap_host::fault::kill_criu_at("restore-control");
                RestorePhase::ControlRestored
            }
            RestorePhase::ControlRestored => {
                let t1 = Instant::now();
                ctx.api.unlock(pid).map_err(driver(DriverStep::Unlock))?;
                out.unlock_s = t1.elapsed().as_secs_f64();
                gpusnap_host::fault::kill_criu_at("restore-unlocked");
                RestorePhase::Unlocked
            }
            RestorePhase::Unlocked => {
                let handed = match (preload.take(), &targets) {
                    (Some(p), Some(t)) => Some(p.finish(pid, m, t, ctx.agent_timeout())?),
                    _ => None,
                };
                match handed {
                    Some(crate::preload::Handed::Done {
                        stats,
                        phases,
                        ran_s,
                        waited_s,
                        take_s,
                        allocations,
                    }) => {
                        log::info!(
                            "pid {pid} (nspid {}): the keeper's load ran {ran_s:.3} s beside CRIU's restore (keeper ready after {:.3} s, GPU contexts and reservations {:.3} s, data {:.3} s); the hand-over waited {waited_s:.3} s for it, then mapped {allocations} allocations in {take_s:.3} s",
                            m.nspid,
                            phases.ready_s,
                            phases.expect_s,
                            phases.load_s
                        );
                        out.data = Some(stats);
                        out.handover_s = Some(take_s);
                        out.keeper = Some(phases);
                    }
                    Some(crate::preload::Handed::Fallback(e)) => {
                        log::warn!(
                            "pid {pid} (nspid {}): the keeper's load is not usable ({e}); the keeper is gone and the process's agent loads the image itself",
                            m.nspid
                        );
                    }
                    None => {}
                }
                if has_data(m) && out.data.is_none() {
                    out.data = Some(crate::load::with_agent_running(
                        ctx,
                        pid,
                        ctx.image_dir(),
                        m,
                        "restore-data",
                        checks,
                        ring.take(),
                    )?);
                }
                RestorePhase::Whole
            }
            RestorePhase::Whole => unreachable!("the loop ends there"),
        };
    }
    out.total_s = t0.elapsed().as_secs_f64();
    // (With `GpuWhereHashed` the load checked the image on the host instead, and said so.)
    if let Some(d) = out
        .data
        .as_ref()
        .filter(|d| checks == datapath::ReadChecks::Host && d.verified_on_device < d.device_hashed)
    {
        // The agent could not run its kernel (the reason is in its own log); every chunk was
        // still checked against its stored checksum as it was read.
        log::warn!(
            "pid {pid} (nspid {}): the GPU checked only {} of the {} chunks with device hashes after loading; the others were checked only as they were read (stored checksums), not on the device",
            m.nspid,
            d.verified_on_device,
            d.device_hashed
        );
    }
    let data = out.data.as_ref().map_or(String::new(), |d| {
        let gib = d.bytes as f64 / (1u64 << 30) as f64;
        format!(
            ", data {:.3} s ({gib:.2} GiB, {:.1} GiB/s; {} zero chunks filled on the GPU, {} chunks checked there)",
            d.seconds,
            gib / d.seconds.max(1e-9),
            d.zero_chunks,
            d.verified_on_device
        )
    });
    log::info!(
        "pid {pid} (nspid {}): restored ({:?} path): control {:.3} s, unlock {:.3} s{data}; total {:.3} s",
        m.nspid,
        m.path,
        out.control_s,
        out.unlock_s,
        out.total_s
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpusnap_image::GpuRecord;

    #[test]
    fn the_ipc_hint_follows_the_failed_driver_step_not_its_text() {
        let failed = |step| RestoreError::Driver {
            step,
            err: DriverError::Cuda {
                call: "cuCheckpointProcessRestore",
                code: 999,
                name: "CUDA_ERROR_UNKNOWN".into(),
            },
        };
        assert!(failure_hint(&failed(DriverStep::Restore), true).contains("CUDA IPC"));
        assert_eq!(failure_hint(&failed(DriverStep::Restore), false), "");
        assert_eq!(failure_hint(&failed(DriverStep::Unlock), true), "");
        assert_eq!(failure_hint(&RestoreError::DamagedImage, true), "");
        assert_eq!(
            failed(DriverStep::Restore).to_string(),
            "driver restore: cuCheckpointProcessRestore failed: CUDA_ERROR_UNKNOWN (999)"
        );
    }

    fn manifest(gpus: Vec<GpuRecord>) -> Manifest {
        Manifest {
            nspid: NsPid(7),
            gpus,
            ..crate::test_manifest()
        }
    }

    fn gpu(uuid: &str, name: &str) -> GpuRecord {
        GpuRecord {
            ordinal: 0,
            uuid: uuid.into(),
            name: name.into(),
            total_mem: 1 << 30,
        }
    }

    fn listed(uuid: &str, name: &str) -> gpumap::HostGpu {
        gpumap::HostGpu {
            uuid: uuid.into(),
            name: name.into(),
            free: None,
        }
    }

    /// [`early_gpu_check_with`] where NVML tells nothing.
    fn early_gpu_check_in(
        dir: &std::path::Path,
        manifests: &HashMap<NsPid, Manifest>,
        device_map: &[(String, String)],
    ) -> Result<HashMap<NsPid, Vec<gpumap::Pair>>, Vec<RestoreError>> {
        early_gpu_check_with(dir, manifests, device_map, &|_| HashMap::new())
    }

    /// A process of nspid `nspid` that used `gib` GiB on GPU `uuid` (an H200).
    fn using(nspid: u32, uuid: &str, gib: u64) -> Manifest {
        Manifest {
            nspid: NsPid(nspid),
            gpus: vec![gpu(uuid, "NVIDIA H200")],
            requires: Some(gpusnap_image::Requirements {
                kernel_driver: None,
                driver_library: None,
                gpu_mem_used: std::collections::BTreeMap::from([(0, gib << 30)]),
            }),
            ..crate::test_manifest()
        }
    }

    #[test]
    fn free_memory_is_checked_at_init_where_nvml_tells_it() {
        let root = std::env::temp_dir().join(format!("gpusnap-early-free-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.join("gpus");
        let (a, b, c) = ("a".repeat(32), "b".repeat(32), "c".repeat(32));
        for (bus, uuid) in [("0000:10:00.0", &b), ("0000:20:00.0", &c)] {
            std::fs::create_dir_all(dir.join(bus)).unwrap();
            std::fs::write(
                dir.join(bus).join("information"),
                format!("Model: NVIDIA H200\nGPU UUID: {}\n", gpumap::dashed(uuid)),
            )
            .unwrap();
        }
        // b has 10 GiB free, c 40 GiB; the image's GPU a is not here.
        let free = |uuids: &[String]| -> HashMap<String, u64> {
            assert_eq!(uuids.len(), 2);
            HashMap::from([("b".repeat(32), 10 << 30), ("c".repeat(32), 40 << 30)])
        };
        let one = |gib| HashMap::from([(NsPid(7), using(7, &a, gib))]);
        // 30 GiB: the replacement is the GPU with room, not the first of the model.
        let plan = early_gpu_check_with(&dir, &one(30), &[], &free).unwrap();
        assert_eq!(plan[&NsPid(7)][0].new, c);
        // 50 GiB: no GPU of the model has room, refused naming the need.
        let e = early_gpu_check_with(&dir, &one(50), &[], &free).unwrap_err();
        let e = e[0].to_string();
        assert!(e.contains("no free NVIDIA H200 with 50.00 GiB free"), "{e}");
        // device_map onto b, which lacks room: refused naming the shortfall.
        let map = [(a.clone(), b.clone())];
        let e = early_gpu_check_with(&dir, &one(30), &map, &free).unwrap_err();
        let e = e[0].to_string();
        assert!(
            e.contains("has 10.00 GiB free but the image needs 30.00 GiB on it"),
            "{e}"
        );
        // Two processes on one GPU: each fits alone, not both together.
        let two = HashMap::from([(NsPid(7), using(7, &c, 25)), (NsPid(8), using(8, &c, 25))]);
        let e = early_gpu_check_with(&dir, &two, &[], &free).unwrap_err();
        assert_eq!(e.len(), 1, "{e:?}");
        let e = e[0].to_string();
        assert!(
            e.contains("has 40.00 GiB free but the image needs 50.00 GiB on it: free 10.00 GiB"),
            "{e}"
        );
        // NVML cannot tell: nothing judged now (RESUME_DEVICES_LATE checks it).
        assert!(early_gpu_check_in(&dir, &one(50), &[]).is_ok());
        // Nothing needed: NVML is not asked.
        let never = |_: &[String]| -> HashMap<String, u64> { panic!("asked") };
        let none = HashMap::from([(NsPid(7), manifest(vec![gpu(&c, "NVIDIA H200")]))]);
        assert!(early_gpu_check_with(&dir, &none, &[], &never).is_ok());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn mig_instances_are_left_to_the_driver_and_device_maps_checked_first() {
        // A listing with one other GPU of another model: a plain image is refused against it,
        // an image of MIG instances is not judged by it; a device_map onto that listed GPU is
        // checked now (another model: refused before CRIU creates a process), one onto a GPU
        // the kernel does not list is refused too where the host has no MIG instance it could
        // be, and left to the driver where it has one.
        // Laid out like /proc/driver/nvidia: the listing, and the capability tree beside it as
        // the driver makes it with MIG off (gpu0/mig/ with no GPU instance in it).
        let root = std::env::temp_dir().join(format!("gpusnap-early-check-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.join("gpus");
        let mig = root.join("capabilities/gpu0/mig");
        std::fs::create_dir_all(&mig).unwrap();
        let bus = dir.join("0000:10:00.0");
        std::fs::create_dir_all(&bus).unwrap();
        std::fs::write(
            bus.join("information"),
            "Model: NVIDIA A100\nGPU UUID: GPU-00000000-0000-0000-0000-0000000000bb\n",
        )
        .unwrap();
        let one =
            |name: &str| HashMap::from([(NsPid(7), manifest(vec![gpu(&"a".repeat(32), name)]))]);
        let e = early_gpu_check_in(&dir, &one("NVIDIA H200"), &[]).unwrap_err()[0].to_string();
        assert!(e.contains("is not on this host"), "{e}");
        assert!(early_gpu_check_in(&dir, &one("NVIDIA H100 80GB HBM3 MIG 1g.10gb"), &[]).is_ok());
        let map = [("a".repeat(32), "0".repeat(30) + "bb")];
        let e = early_gpu_check_in(&dir, &one("NVIDIA H200"), &map).unwrap_err()[0].to_string();
        assert!(e.contains("the GPU model must be the same"), "{e}");
        let same =
            |name: &str| HashMap::from([(NsPid(7), manifest(vec![gpu(&"a".repeat(32), name)]))]);
        assert!(early_gpu_check_in(&dir, &same("NVIDIA A100"), &map).is_ok());
        let unlisted = [("a".repeat(32), "c".repeat(32))];
        // No MIG instance on this host: the unlisted target is no GPU of it, refused now, named
        // as nvidia-smi writes it, with the GPUs the host has.
        let e = early_gpu_check_in(&dir, &one("NVIDIA H200"), &unlisted).unwrap_err();
        assert_eq!(e.len(), 1, "{e:?}");
        let e = e[0].to_string();
        assert!(
            e.contains(
                "device_map target GPU-cccccccc-cccc-cccc-cccc-cccccccccccc is not on this host"
            ),
            "{e}"
        );
        assert!(
            e.contains("GPU-00000000-0000-0000-0000-0000000000bb (NVIDIA A100)"),
            "{e}"
        );
        assert!(e.contains("Fix device_map"), "{e}");
        // With a GPU instance it may be one: left to the driver, as when the tree is hidden.
        std::fs::create_dir_all(mig.join("gi1/ci0")).unwrap();
        std::fs::write(mig.join("gi1/access"), "DeviceFileMinor: 12\n").unwrap();
        assert!(early_gpu_check_in(&dir, &one("NVIDIA H200"), &unlisted).is_ok());
        std::fs::remove_dir_all(root.join("capabilities")).unwrap();
        assert!(early_gpu_check_in(&dir, &one("NVIDIA H200"), &unlisted).is_ok());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_dumped_gpu_is_never_refused_for_how_the_listing_spells_its_model() {
        let m = manifest(vec![gpu("aa", "NVIDIA H200")]);
        let pairs = plan_against_listing(&m, &[listed("aa", "H200 (as /proc says)")], &[], &[])
            .expect("same GPU");
        assert!(pairs.is_empty(), "{pairs:?}");
    }

    #[test]
    fn another_model_in_the_listing_is_refused_naming_the_gpu() {
        let m = manifest(vec![gpu("aa", "NVIDIA H200")]);
        let e = plan_against_listing(&m, &[listed("bb", "NVIDIA A100")], &[], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("GPU aa (NVIDIA H200)"), "{e}");
        let ok =
            plan_against_listing(&m, &[listed("bb", "NVIDIA H200")], &[], &[]).expect("same model");
        assert_eq!(ok.len(), 1);
        assert_eq!((ok[0].old.as_str(), ok[0].new.as_str()), ("aa", "bb"));
    }

    #[test]
    fn uuid_pairs_refuse_a_bad_uuid_naming_it() {
        use crate::GpuUuid;
        let pair = |old: &str, new: &str| gpumap::Pair {
            old: old.into(),
            new: new.into(),
        };
        let (a, b) = ("a".repeat(32), "GPU-0000000b-0000-0000-0000-00000000000b");
        let ok = uuid_pairs(&[pair(&a, b), pair(b, &a)]).expect("both parse");
        let (ua, ub) = (a.parse::<GpuUuid>().unwrap(), b.parse::<GpuUuid>().unwrap());
        assert_eq!(ok, vec![(ua, ub), (ub, ua)]);
        assert_eq!(uuid_pairs(&[]), Ok(vec![]));
        let e = uuid_pairs(&[pair(&a, b), pair("GPU-12", &a)]).unwrap_err();
        assert!(e.to_string().contains("`GPU-12`"), "{e}");
        let e = uuid_pairs(&[pair(&a, "not-a-uuid")]).unwrap_err();
        assert!(e.to_string().contains("`not-a-uuid`"), "{e}");
    }
}
