//! The dump side, per process: PAUSE (lock, choose the path), CHECKPOINT (move data, release,
//! driver checkpoint of control state) and the rollback that `exit` runs on `-R` or failure,
//! which `gpusnap recover` shares. Each step moves the process's [`Phase`] on; the rollback
//! undoes one phase after the other.

use crate::agent::{self, AgentError, AgentHello, AgentSession, KeeperSession};
use crate::context::Ctx;
use crate::datapath::{self, DataError};
use crate::process::{ImpossibleMove, MovedData, Phase, Route, SplitPlan, Tracked};
use crate::staging::{RingShape, Staging};
use crate::stall::{self, DriverCall, StallError, Watched};
use crate::{DriverError, ProcessState};
use gpusnap_config::Mode;
use gpusnap_host::hold::Hold;
use gpusnap_host::pid::{HostPid, HostTid, NsPid, NsTid};
use gpusnap_host::procfs::{self, Stat};
use gpusnap_host::ptrace::{self, PtraceError, RunningThread};
use gpusnap_image::{AllocationRecord, CheckpointPath, ImageError, IoOp, Manifest};
use gpusnap_proto::hazard;
use std::os::fd::BorrowedFd;
use std::sync::Mutex;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error("{what}: {err}")]
    Driver {
        what: &'static str,
        err: DriverError,
    },
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("split data path: {0}")]
    Data(#[from] DataError),
    #[error(transparent)]
    Ptrace(#[from] PtraceError),
    #[error(
        "cannot be checkpointed: it uses {cause}, which the NVIDIA driver's checkpoint does not support. \
         Nothing was done; the process keeps running"
    )]
    Unsupported { cause: String },
    #[error(
        "locking the CUDA state of pid {pid} failed ({err}) within {timeout_ms} ms; the process keeps running unlocked. \
         A long-running kernel or a blocking CUDA call prevents the lock: retry, or raise CRIU's --timeout \
         or gpusnap's lock_timeout_ms"
    )]
    Lock {
        pid: HostPid,
        err: DriverError,
        timeout_ms: u32,
    },
    #[error("the other threads of the process: {0}")]
    Stall(#[from] StallError),
    #[error("writing the manifest: {0}")]
    Manifest(ImageError),
    /// The fsync of the image directory failed (`durable = true`); shared by every process.
    #[error("durable = true: {0}; the dump is refused, as gpusnap's files may not be on the disk")]
    Durable(std::sync::Arc<ImageError>),
    #[error("the worker thread of pid {pid} panicked")]
    WorkerPanicked { pid: HostPid },
    #[error("internal: {0}")]
    Phase(#[from] ImpossibleMove),
    #[error(
        "pid {pid} was left by an interrupted dump: its GPU memory is released (it is held, not running) and lives only in that dump's image. \
         Nothing was done; bring it back with `gpusnap recover {pid} --images <that dump's image dir>`, then dump it again"
    )]
    Interrupted { pid: HostPid },
    #[error(transparent)]
    Busy(#[from] gpusnap_host::joblock::JobLockError),
    #[error("pid {pid}: {why}")]
    NoSpace { pid: HostPid, why: String },
    #[error(
        "pid {pid} has {open} descriptors open and its soft RLIMIT_NOFILE (open files) is {limit}: a GPU checkpoint of a process with the gpusnap agent needs {needed} free there (the agent's connection, the staging ring, a reload); nothing was moved. Start the job with a higher limit (ulimit -n, or the container's nofile) and dump again"
    )]
    DescriptorLimit {
        pid: HostPid,
        open: u64,
        limit: u64,
        needed: u64,
    },
    #[error(
        "pid {pid} is stopped (state T, e.g. by SIGSTOP or a debugger): the driver cannot lock the GPU state of a stopped process; continue it (`kill -CONT {pid}`) and dump again"
    )]
    Stopped { pid: HostPid },
    #[error(transparent)]
    Frozen(#[from] gpusnap_host::freezer::PauseRefused),
    #[error("holding the threads of pid {pid} before its memory is released: {err}")]
    Hold { pid: HostPid, err: std::io::Error },
    #[error("hand-over: {0}")]
    HandOver(#[from] crate::handover::HandOverError),
    #[error("CUDA IPC shares: {0}")]
    Sharing(#[from] crate::sharing::SharingError),
    #[error("CRIU gave no image directory")]
    NoImageDir,
    #[error("the drain of pid {pid} into the image failed: {err}")]
    Drain { pid: HostPid, err: DataError },
    #[error("starting the drain thread of pid {pid}: {err}")]
    DrainStart { pid: HostPid, err: std::io::Error },
    #[error(
        "pid {pid}: its lent memory is mapped back, but what was copied out first is still released and no manifest of that part is at hand (give the dump's image directory: --images DIR); it stays held"
    )]
    CopyFirstPartMissing { pid: HostPid },
}

impl DumpError {
    /// A failed fsync (of a data file or the directory with `durable = true`, or of a manifest):
    /// the disk may have lost writes, so the dump fails instead of trying another path on it.
    /// So does a disk without room for the GPU data: every other path writes the same bytes.
    fn is_durability(&self) -> bool {
        matches!(
            self,
            DumpError::Durable(_)
                | DumpError::NoSpace { .. }
                | DumpError::Data(DataError::Sync(_))
                | DumpError::Manifest(ImageError::Io {
                    op: IoOp::Fsync,
                    ..
                })
        )
    }
}

fn driver(what: &'static str) -> impl FnOnce(DriverError) -> DumpError {
    move |err| DumpError::Driver { what, err }
}

/// Free descriptors a job with the agent must have under its soft `RLIMIT_NOFILE` for a
/// dump: the plugin's connection, the staging ring, the descriptors a rollback's reload and a
/// hand-over's reclaim open, with room to spare.
pub const AGENT_DESCRIPTORS_NEEDED: u64 = 8;

/// PAUSE_DEVICES: the process still runs. `Ok(None)`: not a CUDA process.
pub fn pause(ctx: &Ctx, pid: HostPid) -> Result<Option<Tracked>, DumpError> {
    let stopped =
        procfs::state_and_start(pid).is_ok_and(|(state, _)| state == procfs::ProcState::Stopped);
    // Before any driver call: a process held by an interrupted dump is stopped, driver thread
    // included, and its memory is only in that dump's files.
    if stopped && gpusnap_host::hold::recorded_running(pid).is_some() {
        return Err(DumpError::Interrupted { pid });
    }
    let Ok(restore_tid) = ctx.api.restore_thread_id(pid) else {
        return Ok(None);
    };
    // Frozen by its container engine, under a CRIU that thaws it only after this hook.
    gpusnap_host::freezer::refuse_frozen(pid)?;
    // One dump, recover or pre-copy at a time per job, taken before any call that changes
    // the driver state: a second CRIU is refused here, touching nothing.
    let job_lock = gpusnap_host::joblock::JobLock::take(pid)?;
    // Stopped by a signal (not by an interrupted dump: that has a hold record, above): the
    // driver's lock would wait for CRIU's timeout, so say what it is now.
    if stopped {
        return Err(DumpError::Stopped { pid });
    }
    let initial = ctx
        .api
        .process_state(pid)
        .map_err(driver("reading the driver state"))?;
    let nspid = procfs::ns_pid(pid).map_err(|err| AgentError::Proc { pid, err })?;
    let mut t = Tracked {
        pid,
        nspid,
        restore_tid,
        initial,
        phase: Phase::Untouched,
        route: Route::Transparent,
        agent: false,
        hold: None,
        timings: Vec::new(),
        shares: Vec::new(),
        job_lock: Some(job_lock),
    };
    // The agent is asked while the process runs; the connection is closed again before CRIU
    // seizes it (the process must hold no socket to CRIU when its files are dumped).
    let unusable = |e: AgentError| {
        log::warn!(
            "pid {pid}: the gpusnap agent is there but unusable ({e}); using the driver path"
        );
    };
    let session = AgentSession::connect(pid, ctx.agent_timeout())
        .map_err(unusable)
        .ok()
        .flatten();
    let hello = session
        .as_ref()
        .and_then(|s| s.hello().map_err(unusable).ok());
    t.agent = hello.is_some();
    if let Some(cause) = unsupported_state(pid, hello.as_ref()) {
        return Err(DumpError::Unsupported { cause });
    }
    // Shares of the agent's CUDA IPC are carried when the dump holds every side of them
    // (checked once every process is paused, in `checkpoint_all`).
    if let (Some(s), Some(h)) = (&session, &hello)
        && h.hazards & hazard::SHARING != 0
    {
        t.shares = s.list_sharing().map_err(|e| DumpError::Unsupported {
            cause: format!("CUDA IPC shares that the agent could not list ({e})"),
        })?;
    }
    // Memory an interrupted dump released is only in that dump's files: a dump now, whatever
    // the driver state, would save the process without it.
    if hello.as_ref().is_some_and(|h| h.released) {
        return Err(DumpError::Interrupted { pid });
    }
    // The agent's way back (its connection, the staging ring, the reload) needs descriptors in
    // the job; at its limit a rollback would fail after the memory moved. Refused now, before
    // anything moves (raising the job's limit would be visible to the program).
    if hello.is_some()
        && let Ok((open, Some(limit))) = procfs::descriptors(pid)
        && open.saturating_add(AGENT_DESCRIPTORS_NEEDED) > limit
    {
        return Err(DumpError::DescriptorLimit {
            pid,
            open,
            limit,
            needed: AGENT_DESCRIPTORS_NEEDED,
        });
    }
    if initial == ProcessState::Running && ctx.cfg.mode == Mode::Auto {
        match hello.map(|h| split_candidate(pid, h)).transpose() {
            Ok(Some(Some(mut split))) => {
                let listed = session.as_ref().and_then(|s| {
                    s.list_kinds()
                        .map_err(|e| log::debug!("pid {pid}: no listing at PAUSE: {e}"))
                        .ok()
                });
                let listed = listed.unwrap_or_default();
                split.early_ring = early_ring(ctx, pid, &listed);
                let early_space = early_space(ctx, pid, &listed, split.early_ring.as_ref());
                // A keeper only for a process with something to lend; each allocation's route
                // and its reason are logged once, here.
                let unavailable = if listed.iter().any(|(_, k)| k.lendable()) {
                    match keeper_for(ctx, pid, &lending_gpus(&ctx.gpus, &listed)) {
                        Ok(k) => {
                            split.keeper = Some(k);
                            None
                        }
                        Err(why) => Some(why),
                    }
                } else {
                    None
                };
                split.routes = crate::route::Routes::decide(&listed, unavailable);
                // No keeper, no drain: the space goes back (stopped, if not all held yet).
                split.early_space = early_space.filter(|_| split.keeper.is_some());
                log::info!("pid {pid}: {}", split.routes.summary());
                t.route = Route::Split(split);
            }
            Ok(_) => {}
            Err(e) => log::warn!("pid {pid}: {e}; using the driver path"),
        }
    }
    drop(session);
    if initial == ProcessState::Running {
        let t0 = Instant::now();
        if let Err(err) = ctx.api.lock(pid, ctx.lock_timeout_ms) {
            if gpusnap_host::criu::alarm_timeouted() {
                log::error!("pid {pid}: CRIU's timeout fired while locking the GPU state");
            }
            // A lock that reported failure but took effect must not stay (the process still
            // runs here, so no thread needs resuming).
            if ctx.api.process_state(pid).ok() == Some(ProcessState::Locked)
                && let Err(e) = ctx.api.unlock(pid)
            {
                log::error!("pid {pid}: unlocking after the failed lock failed too: {e}");
            }
            return Err(DumpError::Lock {
                pid,
                err,
                timeout_ms: ctx.lock_timeout_ms,
            });
        }
        t.phase.locked()?;
        t.time("lock", t0.elapsed().as_secs_f64());
        gpusnap_host::fault::kill_criu_at("dump-locked");
    }
    let path = match &t.route {
        Route::Split(s) => format!(
            "split (the agent holds {} allocations, {:.2} GiB converted)",
            s.allocations_at_pause,
            gib(s.converted_bytes_at_pause)
        ),
        Route::Transparent => "transparent (driver checkpoint)".to_string(),
    };
    log::info!(
        "pid {pid} (nspid {nspid}): CUDA state found, restore thread {restore_tid}, driver state {initial}, path {path}; {}",
        t.timings_line()
    );
    Ok(Some(t))
}

/// State the driver cannot checkpoint, named, or `None`. The agent records managed memory,
/// CUDA IPC and peer access as they happen; an MPS daemon of the process's user makes its CUDA
/// processes MPS clients.
fn unsupported_state(pid: HostPid, hello: Option<&AgentHello>) -> Option<String> {
    if let Some((daemon, daemon_pid)) = mps_daemon_of_user(pid) {
        return Some(format!(
            "CUDA MPS ({daemon}, pid {daemon_pid}, runs for its user)"
        ));
    }
    let hello = hello?;
    // Access of its own set on imported memory: the driver's path cannot take the import, and
    // the split path would map it again with the default access.
    let refusing = if hello.hazards & hazard::IMPORTING != 0 {
        hazard::REFUSING | hazard::ACCESS_SET
    } else {
        hazard::REFUSING
    };
    let causes = hazard::describe(hello.hazards & refusing);
    (!causes.is_empty()).then(|| causes.join(", and "))
}

/// A live MPS process (control daemon or server) with the uid of `pid`: its name and pid.
fn mps_daemon_of_user(pid: HostPid) -> Option<(String, HostPid)> {
    let uid = procfs::uid_of(pid).ok()?;
    procfs::processes().ok()?.into_iter().find_map(|p| {
        if procfs::uid_of(p).ok()? != uid {
            return None;
        }
        if !is_live_mps_process(&procfs::stat_text(p, None).ok()?) {
            return None;
        }
        // The command name in stat is cut at 15 characters; the full one is in cmdline.
        let name = procfs::argv0(p).unwrap_or_default();
        Some((
            if name.is_empty() {
                "nvidia-cuda-mps".into()
            } else {
                name
            },
            p,
        ))
    })
}

/// Whether a `/proc/<pid>/stat` text is an MPS process (`nvidia-cuda-mps-control` or
/// `-server`, cut to 15 characters) that still runs: an exited one its parent has not reaped
/// yet (state Z or X) serves no client.
fn is_live_mps_process(stat: &str) -> bool {
    Stat::parse(stat).is_some_and(|s| {
        s.comm.starts_with("nvidia-cuda-mps") && s.state().is_some() && !s.exited()
    })
}

/// The UUIDs of the GPUs that hold memory the job will lend: the keeper makes its contexts
/// there as soon as it starts, so that the lend on the job's pause is only the imports (on the
/// H200 the context made at the first `Adopt` was most of the lend's 0.14 s at 16 GiB).
fn lending_gpus(
    gpus: &[crate::driver::GpuInfo],
    listed: &[(AllocationRecord, gpusnap_proto::AllocKind)],
) -> Vec<[u8; 16]> {
    gpus.iter()
        .filter(|g| {
            listed
                .iter()
                .any(|(a, k)| k.lendable() && a.device == g.ordinal)
        })
        .map(|g| g.uuid.to_bytes())
        .collect()
}

/// The keeper for a hand-over of `pid`'s memory, started now while the job still runs (its
/// `cuInit`, and its contexts on `gpus`, then cost the job no pause); `None`, with the reason
/// in the log, when the data is to be copied out first instead.
fn keeper_for(
    ctx: &Ctx,
    pid: HostPid,
    gpus: &[[u8; 16]],
) -> Result<crate::keeper::Keeper, crate::route::CopyFirst> {
    if !ctx.cfg.handover {
        log::info!(
            "pid {pid}: handover = false: the device data is copied out before the driver checkpoint"
        );
        return Err(crate::route::CopyFirst::HandoverOff);
    }
    // The test hook (root's environment) names the keeper's library outright (a missing one:
    // a keeper that cannot start CUDA). Otherwise only the host's, and only if it is the file
    // the job has mapped: never a library the job chose.
    let libcuda = match crate::preload::keeper_libcuda_override() {
        Some(named) => named,
        None => match crate::keeper::host_library_for(pid, &crate::driver::libcuda_path()) {
            Ok(host) => host,
            Err(e) => {
                log::warn!(
                    "pid {pid}: no hand-over ({e}): the device data is copied out before the driver checkpoint"
                );
                return Err(crate::route::CopyFirst::DriverLibrary);
            }
        },
    };
    match crate::keeper::Keeper::spawn(
        &ctx.cfg.keeper,
        Some(libcuda.as_path()),
        gpus,
        crate::keeper::JobPid::Host(pid),
        ctx.agent_timeout(),
    ) {
        Ok(k) => {
            // Before the lock: the keeper's CUDA start (0.1-0.3 s on the H200, which the
            // lend's first adoption used to wait for) then runs while the job still does.
            let ready_s = match k.wait_ready() {
                Ok(s) => s,
                Err(e) => {
                    log::warn!(
                        "pid {pid}: no hand-over ({e}): the device data is copied out before the driver checkpoint"
                    );
                    k.kill();
                    return Err(crate::route::CopyFirst::NoKeeper);
                }
            };
            log::info!(
                "pid {pid}: hand-over planned: keeper pid {} ({}) holds the device memory across the driver checkpoint and drains it beside CRIU's dump; ready (CUDA started) in {ready_s:.3} s, before the lock",
                k.pid(),
                libcuda.display()
            );
            Ok(k)
        }
        Err(e) => {
            log::warn!(
                "pid {pid}: no hand-over ({e}): the device data is copied out before the driver checkpoint"
            );
            Err(crate::route::CopyFirst::NoKeeper)
        }
    }
}

/// Whether the agent's answer makes the process a split-path candidate.
fn split_candidate(pid: HostPid, hello: AgentHello) -> Result<Option<SplitPlan>, DumpError> {
    if hello.released {
        return Err(AgentError::AlreadyReleased { pid }.into());
    }
    // An importer of the agent's CUDA IPC takes the split path even with no memory of its own:
    // its release unmaps the imports, which the driver's checkpoint must not hold.
    if hello.converted_bytes == 0 && hello.hazards & hazard::IMPORTING == 0 {
        log::debug!("pid {pid}: agent holds no converted allocations; driver path");
        return Ok(None);
    }
    // The split path makes memory again with read-write access for its own GPU only; the
    // driver's checkpoint keeps whatever access the program set.
    if hello.hazards & hazard::ACCESS_SET != 0 {
        log::info!(
            "pid {pid}: {}: the driver's path, which keeps that access",
            hazard::describe(hazard::ACCESS_SET).join(", ")
        );
        return Ok(None);
    }
    Ok(Some(SplitPlan {
        agent_ns_tid: hello.ns_tid,
        allocations_at_pause: hello.allocations,
        converted_bytes_at_pause: hello.converted_bytes,
        early_ring: None,
        early_space: None,
        keeper: None,
        routes: Default::default(),
    }))
}

/// The staging ring for the dump of `allocations`.
fn ring_shape(ctx: &Ctx, allocations: &[AllocationRecord]) -> RingShape {
    RingShape::for_dump(
        ctx.slot_size(),
        ctx.cfg.staging_slots as usize,
        allocations.iter().filter(|a| a.moved).map(|a| a.size),
    )
}

/// The ring made at PAUSE, while the process still runs, for the allocations the agent holds
/// now: populating it (0.1 s for 512 MiB on the H200 VM) then costs the job no pause. `None`
/// (the checkpoint makes one) if the agent cannot list them or the memory cannot be had.
fn early_ring(
    ctx: &Ctx,
    pid: HostPid,
    listed: &[(AllocationRecord, gpusnap_proto::AllocKind)],
) -> Option<(RingShape, Staging)> {
    if listed.is_empty() {
        return None;
    }
    let allocations: Vec<AllocationRecord> = listed.iter().map(|(a, _)| a.clone()).collect();
    let shape = ring_shape(ctx, &allocations);
    let staging = Staging::new(shape.slot_size, shape.slots)
        .map_err(|e| log::debug!("pid {pid}: no early ring: {e}"))
        .ok()?;
    Some((shape, staging))
}

/// The drain's space for what the agent lists now, held from now on beside the rest of the
/// dump's work ([`crate::space`]): the keeper's start, the lock, CRIU's seizing and the lend
/// then cover it, instead of the job's pause. `None` without a hand-over to plan or anything
/// to lend.
fn early_space(
    ctx: &Ctx,
    pid: HostPid,
    listed: &[(AllocationRecord, gpusnap_proto::AllocKind)],
    ring: Option<&(RingShape, Staging)>,
) -> Option<Box<crate::space::EarlySpace>> {
    if !ctx.cfg.handover || !listed.iter().any(|(_, k)| k.lendable()) {
        return None;
    }
    let slot = match ring {
        Some((shape, _)) => shape.slot_size,
        None => {
            let allocations: Vec<AllocationRecord> =
                listed.iter().map(|(a, _)| a.clone()).collect();
            ring_shape(ctx, &allocations).slot_size
        }
    };
    let writers = ctx.cfg.effective_writer_threads();
    let bytes = drain_reservation(
        &crate::route::Routes::decide(listed, None),
        slot as u64,
        writers,
    );
    crate::space::EarlySpace::start(pid, ctx.criu_image_dir()?, bytes, writers)
}

/// CHECKPOINT_DEVICES for every tracked process at once (CRIU calls the hook per pid, but all
/// PAUSEs come first, so the whole set is known). ptrace requests must come from CRIU's main
/// thread, so: threads are resumed here, the driver and data work of each process runs on a
/// worker of its own, in parallel, and the threads are stopped here again.
pub fn checkpoint_all(
    ctx: &Ctx,
    procs: &mut [Tracked],
    others: &[HostPid],
) -> Vec<(HostPid, Result<(), DumpError>)> {
    let t0 = Instant::now();
    if let Some(warning) = ipc_blind_spot(procs) {
        log::warn!("{warning}");
    }
    if let Err(e) = shareable_resolved(ctx, procs, others).and_then(|()| shares_are_whole(procs)) {
        // Refused before anything is released: each process is only locked (undone at exit).
        log::error!("{e}; the dump is refused and the processes run on");
        let cause = e.to_string();
        return procs
            .iter()
            .map(|t| {
                (
                    t.pid,
                    Err(DumpError::Unsupported {
                        cause: cause.clone(),
                    }),
                )
            })
            .collect();
    }
    let mut results = Vec::new();
    let mut work: Vec<(&mut Tracked, Vec<RunningThread>)> = Vec::new();
    for t in procs.iter_mut() {
        if t.initial == ProcessState::Checkpointed {
            log::info!(
                "pid {}: already checkpointed before the dump; left as is",
                t.pid
            );
            results.push((t.pid, Ok(())));
            continue;
        }
        match run_threads(t) {
            Ok(threads) => work.push((t, threads)),
            Err(e) => results.push((t.pid, Err(e))),
        }
    }
    let n = work.len();
    let calls: Vec<DriverCall> = work.iter().map(|_| DriverCall::default()).collect();
    let releases: Vec<Mutex<Option<Hold>>> = work.iter().map(|_| Mutex::new(None)).collect();
    let watched: Vec<Watched<'_>> = work
        .iter()
        .zip(&calls)
        .zip(&releases)
        .map(|(((t, th), call), release)| Watched {
            pid: t.pid,
            running: th.iter().map(RunningThread::tid).collect(),
            call,
            release,
        })
        .collect();
    let (outcomes, leftovers) = std::thread::scope(|s| {
        let handles: Vec<_> = work
            .iter_mut()
            .zip(&calls)
            .zip(&releases)
            .map(|(((t, _), call), release)| {
                let pid = t.pid;
                let h = s.spawn(move || {
                    gpusnap_host::signals::block_all();
                    checkpoint_one(ctx, t, call, release)
                });
                (pid, h)
            })
            .collect();
        let leftovers = stall::watch(|| handles.iter().all(|(_, h)| h.is_finished()), &watched);
        let outcomes: Vec<(HostPid, Result<(), DumpError>)> = handles
            .into_iter()
            .map(|(pid, h)| {
                (
                    pid,
                    h.join().unwrap_or(Err(DumpError::WorkerPanicked { pid })),
                )
            })
            .collect();
        (outcomes, leftovers)
    });
    for (((t, threads), (pid, r)), leftover) in work.into_iter().zip(outcomes).zip(leftovers) {
        let stopped = ptrace::stop_all(threads, "stopping a thread after the checkpoint");
        if r.is_ok() {
            log::info!("pid {}: dump phases: {}", t.pid, t.timings_line());
        }
        results.push((
            pid,
            r.and(stopped.map_err(DumpError::from))
                .and(leftover.map_err(DumpError::from)),
        ));
    }
    commit_manifests(ctx, procs, &mut results);
    if n > 1 {
        log::info!(
            "{n} GPU processes checkpointed in parallel in {:.3} s",
            t0.elapsed().as_secs_f64()
        );
    }
    results
}

/// The end of CHECKPOINT_DEVICES: every process checkpointed gets its manifest (the split
/// path's again, with the timings so far; the transparent path's for the first time), so the
/// image is whole for gpusnap before CRIU writes its own images and, last, its inventory. With
/// `durable`, the image directory is then fsynced (each data file was at its finish, each
/// manifest before its rename); a failure fails every process. `exit` rewrites the manifests
/// with the final timings; should that not finish, these stand.
fn commit_manifests(
    ctx: &Ctx,
    procs: &[Tracked],
    results: &mut [(HostPid, Result<(), DumpError>)],
) {
    let t0 = Instant::now();
    let mut written = 0;
    for (pid, r) in results.iter_mut().filter(|(_, r)| r.is_ok()) {
        let Some(t) = procs.iter().find(|t| t.pid == *pid) else {
            continue;
        };
        if t.phase.moved().is_some_and(MovedData::is_lent) {
            // Written by `exit` once the drain has finished: never before the data is in.
            continue;
        }
        match gpusnap_image::write_manifest(ctx.image_dir(), &manifest_for(ctx, t)) {
            Ok(()) => written += 1,
            Err(e) => *r = Err(DumpError::Manifest(e)),
        }
    }
    if written == 0 || !ctx.cfg.durable {
        return;
    }
    match gpusnap_host::fault::sync_dir(ctx.image_dir()) {
        Ok(()) => log::info!(
            "durable: {written} manifest(s) written and the image directory fsynced in {:.3} s",
            t0.elapsed().as_secs_f64()
        ),
        Err(e) => {
            let e = std::sync::Arc::new(e);
            for (_, r) in results.iter_mut().filter(|(_, r)| r.is_ok()) {
                *r = Err(DumpError::Durable(e.clone()));
            }
        }
    }
}

/// The shareable-handle shares the agents listed at PAUSE, resolved (`kcmp`) to their
/// exporters and told to the importers' agents, before anything is released
/// ([`crate::sharing::resolve_shareable`]). `others`: the dumped processes without CUDA.
fn shareable_resolved(
    ctx: &Ctx,
    procs: &mut [Tracked],
    others: &[HostPid],
) -> Result<(), crate::sharing::SharingError> {
    if !procs
        .iter()
        .any(|t| t.shares.iter().any(|s| s.is_shareable()))
    {
        return Ok(());
    }
    let inside: Vec<HostPid> = procs
        .iter()
        .map(|t| t.pid)
        .chain(others.iter().copied())
        .collect();
    let mut members: Vec<crate::sharing::Sharer<'_>> = procs
        .iter_mut()
        .map(|t| crate::sharing::Sharer {
            pid: t.pid,
            nspid: t.nspid,
            shares: &mut t.shares,
        })
        .collect();
    let resolved = crate::sharing::resolve_shareable(&mut members, others, |pid, fd| {
        crate::sharing::holder_outside(&inside, pid, fd)
    })?;
    crate::sharing::announce(&resolved, ctx.agent_timeout())?;
    if !resolved.is_empty() {
        log::info!(
            "{} imports of shareable handles resolved to their exporters in this dump",
            resolved.len()
        );
    }
    Ok(())
}

/// Every side of every CUDA IPC share the agents listed at PAUSE is in this dump, on the split
/// path. An importer outside the dump that has exited holds nothing (same pid namespace only:
/// elsewhere its pid cannot be looked up here, and it counts as alive).
fn shares_are_whole(procs: &[Tracked]) -> Result<(), crate::sharing::SharingError> {
    let members: Vec<crate::sharing::Member<'_>> = procs
        .iter()
        .map(|t| crate::sharing::Member {
            pid: t.pid,
            nspid: t.nspid,
            split: t.is_split(),
            shares: &t.shares,
        })
        .collect();
    // Namespace pids are host pids: the job's pid namespace is ours.
    let same_ns = procs.iter().all(|t| t.nspid.get() as i32 == t.pid.get());
    crate::sharing::check(&members, |pid| {
        same_ns && !std::path::Path::new(&format!("/proc/{pid}")).exists()
    })?;
    let n: usize = procs.iter().map(|t| t.shares.len()).sum();
    if n > 0 {
        log::info!(
            "{n} CUDA IPC shares, every side in this dump: the memory is saved once, by its exporter"
        );
    }
    Ok(())
}

/// A warning for a dump of several GPU processes of which some run without the agent: CUDA IPC
/// between them cannot be seen (it leaves no fd and no mapping), and driver 580 checkpoints an
/// IPC importer whose restore then fails (found on the H200).
fn ipc_blind_spot(procs: &[Tracked]) -> Option<String> {
    let blind: Vec<String> = procs
        .iter()
        .filter(|t| !t.agent)
        .map(|t| t.pid.to_string())
        .collect();
    (procs.len() > 1 && !blind.is_empty()).then(|| {
        format!(
            "{} GPU processes in this dump; pid(s) {} run without the gpusnap agent, so CUDA IPC \
             between them cannot be detected. If one opened another's device memory through \
             CUDA IPC, the driver (before r610) checkpoints it but cannot restore it: not at a \
             restore, not when this dump rolls back (a failure, or criu dump -R), not with \
             gpusnap recover: it is left checkpointed by the driver. Start such a tree with the \
             gpusnap agent preloaded in every process (it carries or refuses the share)",
            procs.len(),
            blind.join(", ")
        )
    })
}

/// Resumes the driver's restore thread and, on the split path, the agent thread.
fn run_threads(t: &mut Tracked) -> Result<Vec<RunningThread>, DumpError> {
    let mut threads = vec![ptrace::resume(t.restore_tid, "driver restore thread")?];
    if let Route::Split(split) = &t.route {
        match agent::host_tid(t.pid, split.agent_ns_tid)
            .map_err(DumpError::from)
            .and_then(|tid| Ok(ptrace::resume(tid, "agent thread")?))
        {
            Ok(th) => threads.push(th),
            Err(e) => {
                log::warn!(
                    "pid {}: cannot run the agent thread ({e}); driver path",
                    t.pid
                );
                t.route = Route::Transparent;
            }
        }
    }
    Ok(threads)
}

/// The driver and data work of one process; its restore (and agent) thread runs. The driver
/// checkpoint runs through `call`, which CRIU's main thread watches ([`stall::watch`]).
fn checkpoint_one(
    ctx: &Ctx,
    t: &mut Tracked,
    call: &DriverCall,
    release: &Mutex<Option<Hold>>,
) -> Result<(), DumpError> {
    if t.is_split() && planned_keeper(t).is_some() {
        match hand_over(ctx, t, release) {
            Ok(()) => {}
            Err(e) if !t.phase.memory_released() && !e.is_durability() => {
                log::warn!(
                    "pid {}: hand-over failed before any memory was released ({e}); copying the data out first instead",
                    t.pid
                );
                // A copy-first part may have written files already.
                remove_partial_files(ctx, t);
                if let Route::Split(plan) = &mut t.route {
                    // The drain's space goes back before the copy-first route writes.
                    plan.early_space = None;
                    plan.routes = plan
                        .routes
                        .all_copy_first(crate::route::CopyFirst::HandOverFailed);
                    log::info!("pid {}: {}", t.pid, plan.routes.summary());
                }
                if matches!(t.phase, Phase::DataOut) {
                    lock(ctx, t, "relock")?;
                }
            }
            Err(e) => return Err(e),
        }
    }
    if t.is_split() && !t.phase.memory_released() {
        match move_data_out(ctx, t, release) {
            Ok(()) => {}
            Err(e) if !t.phase.memory_released() && !e.is_durability() => {
                log::warn!(
                    "pid {}: split path failed before any memory was released ({e}); \
                     falling back to the driver checkpoint of all device memory",
                    t.pid
                );
                remove_partial_files(ctx, t);
                t.route = Route::Transparent;
                if matches!(t.phase, Phase::DataOut) {
                    lock(ctx, t, "relock")?;
                }
            }
            Err(e) => return Err(e),
        }
    }
    let t0 = Instant::now();
    // A failed checkpoint leaves the phase as it was; the rollback asks the driver what it did.
    let (checkpointed, refrozen) = call.run(|| ctx.api.checkpoint(t.pid));
    checkpointed.map_err(driver(
            "driver checkpoint (it fails on state it cannot take: managed memory, CUDA IPC, MPS, GPU peer access)",
        ))?;
    t.phase.checkpointed()?;
    refrozen?;
    gpusnap_host::fault::kill_criu_at("dump-checkpointed");
    let phase = if t.is_split() {
        "control"
    } else {
        "checkpoint"
    };
    t.time(phase, t0.elapsed().as_secs_f64());
    Ok(())
}

/// The unlock that lets the agent's thread use the GPU while the application's are held (both
/// split routes begin so), timed as `unlock`.
fn unlock_for_agent(ctx: &Ctx, t: &mut Tracked) -> Result<(), DumpError> {
    let t0 = Instant::now();
    ctx.api
        .unlock(t.pid)
        .map_err(driver("unlocking for the agent"))?;
    t.phase.unlocked_for_data()?;
    t.time("unlock", t0.elapsed().as_secs_f64());
    Ok(())
}

/// The keeper a hand-over was planned with, if any.
fn planned_keeper(t: &mut Tracked) -> Option<&mut crate::keeper::Keeper> {
    match &mut t.route {
        Route::Split(plan) => plan.keeper.as_mut(),
        Route::Transparent => None,
    }
}

/// The hand-over (`crate::handover`), with the application stopped and only the agent thread
/// (and the driver's) running: unlock, lend every allocation whose route is `Lend` to the
/// keeper, copy the others out first (on the same connection, into data files of their own,
/// with their manifest written before anything is released), hold, release all of them (the
/// job keeps the exported descriptors), start the drain ([`crate::handover::Drain`]) of the
/// lent ones, lock again. A failure before the release changes nothing of the job.
fn hand_over(ctx: &Ctx, t: &mut Tracked, release: &Mutex<Option<Hold>>) -> Result<(), DumpError> {
    use crate::handover::HandOverError;
    let pid = t.pid;
    unlock_for_agent(ctx, t)?;
    let (mut keeper, planned) = match &mut t.route {
        Route::Split(plan) => (plan.keeper.take(), std::mem::take(&mut plan.routes)),
        Route::Transparent => (None, Default::default()),
    };
    let mut keeper = keeper
        .take()
        .ok_or(DumpError::HandOver(HandOverError::NoKeeper))?;

    let session = AgentSession::connect_expected(pid, ctx.agent_timeout())?;
    let t0 = Instant::now();
    session.hello_intact()?;
    let listed = session.list_kinds()?;
    let routes = crate::route::Routes::decide(&listed, None);
    if !routes.same_as(&planned) {
        log::info!(
            "pid {pid}: the allocations changed since PAUSE; {}",
            routes.summary()
        );
    }
    if let Route::Split(plan) = &mut t.route {
        plan.routes = routes.clone();
    }
    if routes.lent() == 0 {
        return Err(HandOverError::NothingToLend.into());
    }
    let allocations: Vec<AllocationRecord> = listed.into_iter().map(|(a, _)| a).collect();
    let staging = take_ring(ctx, t, &allocations)?;
    let (lent, times) = crate::handover::lend_to_keeper(&session, &keeper, &routes)?;
    // Adopted: from here the session serves the drain; the keeper stays for the reaping.
    let drain_session = keeper
        .take_session()
        .ok_or(DumpError::HandOver(HandOverError::NoKeeper))?;
    t.time("lend", t0.elapsed().as_secs_f64());
    log::info!(
        "pid {pid}: {lent} allocations ({:.2} GiB) lent to keeper pid {}: exports and adoptions pipelined in {:.3} s (at most {} in flight; one keeper round trip {:.6} s; waited {:.3} s for the keeper's answers)",
        gib(routes.moved_bytes(true)),
        keeper.pid(),
        times.total_s,
        times.most_in_flight,
        times.round_trip_s,
        times.adopt_wait_s,
    );
    gpusnap_host::fault::kill_criu_at("dump-lent");
    let snapshot = asynchronous(ctx, t, &drain_session, &routes)?;

    let dir = ctx.image_dir();
    let (codec, why) = crate::context::codec_for(&ctx.cfg, dir);
    if ctx.cfg.compress == gpusnap_config::Compress::Auto {
        log::info!("pid {pid}: chunks stored as {codec:?}: {why}");
    }
    let copy_first = copy_first_part(ctx, t, &session, &staging, &allocations, &routes, codec)?;

    let (reserved, snapshot_reserved) =
        hold_drain_space(ctx, t, &routes, &staging, snapshot.as_ref())?;
    let agent_tid = session_agent_tid(t)?;
    t.hold = Some(
        gpusnap_host::hold::Hold::place(pid, &[t.restore_tid, agent_tid])
            .map_err(|err| DumpError::Hold { pid, err })?,
    );
    let job = crate::handover::DrainJob {
        staging,
        dir: ctx.criu_image_dir().ok_or(DumpError::NoImageDir)?,
        pid,
        nspid: t.nspid,
        writers: ctx.cfg.effective_writer_threads(),
        readers: ctx.cfg.effective_reader_threads(),
        codec,
        allocations: allocations.clone(),
        incremental: ctx.cfg.incremental,
        limits: ctx.limits(),
        durable: ctx.cfg.durable,
        // The copy-first part's writers took the numbers below.
        first_file: if copy_first.is_some() {
            u32::try_from(ctx.cfg.effective_writer_threads()).unwrap_or(u32::MAX / 2)
        } else {
            0
        },
        reserved,
    };
    // Until the drain has finished, the job's own descriptors are where the lent memory lives:
    // the manifest in hand lists the copy-first part only (that part's, written above, or one
    // without data).
    let (provisional, copied) = match copy_first {
        Some((m, data)) => (m, Some(Box::new(data))),
        None => (
            new_manifest(
                ctx,
                t,
                CheckpointPath::Split,
                routes.copy_first_records(),
                &datapath::DumpData::default(),
            ),
            None,
        ),
    };
    let since = Instant::now();
    let has_copy_first = copied.is_some();
    t.phase.released(MovedData {
        manifest: Box::new(provisional.clone()),
        stats: None,
        lent: Some(Box::new(crate::handover::Lent {
            keeper: Some(keeper),
            drain: None,
            since,
            routes,
            copy_first: has_copy_first.then(|| Box::new(provisional)),
            copied,
            background: None,
            deferred: None,
        })),
    })?;
    let t0 = Instant::now();
    let (n, bytes) = session.release()?;
    t.time("release", t0.elapsed().as_secs_f64());
    log::debug!("pid {pid}: agent released {n} allocations ({bytes} bytes), descriptors kept");
    gpusnap_host::fault::kill_criu_at("dump-released");
    start_drain(t, drain_session, job, snapshot, snapshot_reserved, since)?;
    lock(ctx, t, "relock")?;
    *release.lock().unwrap_or_else(|e| e.into_inner()) = t.hold.take();
    gpusnap_host::fault::kill_criu_at("dump-relocked");
    Ok(())
}

/// What a hand-over cannot lend is copied out first, through the job's agent on this
/// connection, as the copy-first route does, before anything is released; its manifest is
/// written now, so that `gpusnap recover` finds that part should CRIU die from here on.
fn copy_first_part(
    ctx: &Ctx,
    t: &mut Tracked,
    session: &AgentSession,
    staging: &Staging,
    allocations: &[AllocationRecord],
    routes: &crate::route::Routes,
    codec: gpusnap_image::Codec,
) -> Result<Option<(Manifest, datapath::DumpData)>, DumpError> {
    if routes.copied_first() == 0 {
        return Ok(None);
    }
    let pid = t.pid;
    let t0 = Instant::now();
    let data = copy_out_paused(ctx, t, session, staging, allocations, codec)?;
    log::info!(
        "pid {pid}: {} allocations ({:.2} GiB) copied out first, before the driver checkpoint, in {:.3} s",
        routes.copied_first(),
        gib(routes.moved_bytes(false)),
        t0.elapsed().as_secs_f64()
    );
    log_data(pid, allocations, &data);
    t.time("data", data.seconds);
    let manifest = new_manifest(
        ctx,
        t,
        CheckpointPath::Split,
        routes.copy_first_records(),
        &data,
    );
    gpusnap_image::write_manifest(ctx.image_dir(), &manifest).map_err(DumpError::Manifest)?;
    Ok(Some((manifest, data)))
}

/// The space the drain will write, held by now (taken from PAUSE on), while a full disk can
/// still fail the dump: the drain writes after CRIU has decided its part succeeded. Split in
/// two where part of the memory is in an asynchronous snapshot (drained after CRIU returns).
/// `(None, None)` where the file system cannot hold space this way.
fn hold_drain_space(
    ctx: &Ctx,
    t: &mut Tracked,
    routes: &crate::route::Routes,
    staging: &Staging,
    snapshot: Option<&crate::route::SnapshotPlan>,
) -> Result<
    (
        Option<gpusnap_image::Reservation>,
        Option<gpusnap_image::Reservation>,
    ),
    DumpError,
> {
    let pid = t.pid;
    let early = match &mut t.route {
        Route::Split(plan) => plan.early_space.take(),
        Route::Transparent => None,
    };
    match crate::space::hold(
        pid,
        ctx.image_dir(),
        early,
        drain_reservation(
            routes,
            staging.slot_size() as u64,
            ctx.cfg.effective_writer_threads(),
        ),
        ctx.cfg.effective_writer_threads(),
    )
    .and_then(|r| split_for_snapshot(pid, r, snapshot, routes, staging, ctx))
    {
        Ok((pause, snap)) => Ok((Some(pause), snap)),
        Err(gpusnap_image::ReserveError::Unsupported(e)) => {
            log::info!(
                "pid {pid}: no space held for the drain (the file system cannot: {e}); a disk that fills up during it leaves the image marked NOT-A-CHECKPOINT"
            );
            Ok((None, None))
        }
        Err(e) => {
            gpusnap_host::logger::tell_user(&format!(
                "pid {pid}: {e}; the dump fails, nothing was released"
            ));
            Err(DumpError::NoSpace {
                pid,
                why: e.to_string(),
            })
        }
    }
}

/// After the release: the keeper drains what it holds, beside the driver's control checkpoint
/// and CRIU's own dump (joined in `exit`), or, where all of it is in an asynchronous snapshot,
/// once CRIU is done, in a process of its own while the job runs on its own memory.
fn start_drain(
    t: &mut Tracked,
    drain_session: KeeperSession,
    job: crate::handover::DrainJob,
    snapshot: Option<crate::route::SnapshotPlan>,
    snapshot_reserved: Option<gpusnap_image::Reservation>,
    since: Instant,
) -> Result<(), DumpError> {
    let pid = t.pid;
    match snapshot {
        Some(plan) if plan.whole() => {
            // The keeper holds a snapshot of all of it: the drain runs once CRIU is done, in a
            // process of its own (`exit`), while the job runs on its own memory.
            if let Some(lent) = t.phase.moved_mut().and_then(|m| m.lent.as_deref_mut()) {
                lent.background = Some(Box::new(crate::handover::Background {
                    session: drain_session,
                    job,
                }));
            }
        }
        snapshot => {
            // The job no longer maps the memory; the keeper drains it from here on (what it
            // still imports, where part is in a snapshot set aside), beside the driver's
            // control checkpoint and CRIU's own dump (joined in `exit`).
            let drain = crate::handover::Drain::start(drain_session, job)
                .map_err(|err| DumpError::DrainStart { pid, err })?;
            let part = snapshot.map(|plan| {
                Box::new(crate::handover::Deferred {
                    ids: plan.snapshot,
                    reserved: snapshot_reserved,
                })
            });
            let after = match &part {
                Some(p) => format!(
                    "; the snapshot's {} allocations are drained after CRIU returns",
                    p.ids.len()
                ),
                None => String::new(),
            };
            if let Some(lent) = t.phase.moved_mut().and_then(|m| m.lent.as_deref_mut()) {
                lent.drain = Some(drain);
                lent.deferred = part;
            }
            log::info!(
                "pid {pid}: drain started {:.3} s after the hand-over; CRIU dumps the host side meanwhile{after}",
                since.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

/// Why an asynchronous `-R` is not taken, if it is not: the key, `-R`, CRIU as a service.
fn async_refused(cfg: &gpusnap_config::Config) -> Option<&'static str> {
    if !cfg.async_leave_running {
        return Some("async_leave_running is off");
    }
    if !gpusnap_host::criu::leave_running() {
        return Some("not `criu dump -R`");
    }
    if gpusnap_host::logger::rpc_mode() {
        return Some(
            "CRIU runs as a service (a container runtime archives the directory as soon as CRIU returns)",
        );
    }
    None
}

/// The asynchronous `-R` (`async_leave_running`): chooses per lent allocation whether the
/// keeper's snapshot takes it ([`crate::route::SnapshotPlan`]: largest first, within
/// `async_snapshot_share` percent of each GPU's free memory, as the keeper measures it) or
/// the pause drains it, logs the choice, and asks the keeper for a device-to-device snapshot of
/// the chosen ones. `Some(plan)` when the keeper holds that snapshot (the PENDING marker is
/// then written, before CRIU can return); `None` when everything is drained on the pause as
/// without the key (nothing fits, or the keeper refused: the reason logged).
fn asynchronous(
    ctx: &Ctx,
    t: &Tracked,
    keeper: &KeeperSession,
    routes: &crate::route::Routes,
) -> Result<Option<crate::route::SnapshotPlan>, DumpError> {
    use crate::route::{SnapshotPlan, size_words};
    let pid = t.pid;
    let keeper_failed = |e| DumpError::HandOver(crate::handover::HandOverError::KeeperSession(e));
    if let Some(why) = async_refused(&ctx.cfg) {
        if ctx.cfg.async_leave_running {
            let lent: Vec<String> = routes
                .0
                .iter()
                .filter(|(a, r)| a.moved && *r == crate::route::AllocRoute::Lend)
                .map(|(a, _)| format!("#{} ({} bytes)", a.id, a.size))
                .collect();
            log::info!(
                "pid {pid}: asynchronous -R not taken ({why}): {} drained on the pause",
                lent.join(", ")
            );
        }
        return Ok(None);
    }
    let share = ctx.cfg.async_snapshot_share;
    let mut room = std::collections::BTreeMap::new();
    for device in SnapshotPlan::devices(routes) {
        room.insert(
            device,
            keeper.snapshot_room(device, share).map_err(keeper_failed)?,
        );
    }
    let plan = SnapshotPlan::choose(routes, &room);
    log::info!("pid {pid}: {}", plan.summary(share));
    if plan.snapshot.is_empty() {
        log::info!(
            "pid {pid}: asynchronous -R not taken: no lent allocation fits async_snapshot_share = {share}% of its GPU's free memory: all drained on the pause"
        );
        return Ok(None);
    }
    let t0 = Instant::now();
    let made = keeper
        .snapshot(share, &plan.snapshot)
        .map_err(keeper_failed)?;
    match made {
        Ok((n, bytes)) => {
            let words = format!(
                "The GPU data of pid {pid} is still being written into this directory after an asynchronous `criu dump -R`; it is not a checkpoint until this file is gone (`gpusnap wait DIR`)."
            );
            crate::handover::write_pending(ctx.image_dir(), t.nspid, &words).map_err(|e| {
                DumpError::HandOver(crate::handover::HandOverError::Pending(e.to_string()))
            })?;
            let (paused, paused_bytes) = plan.part(false);
            log::info!(
                "pid {pid}: asynchronous -R: {n} allocations ({}) copied device to device into the keeper's snapshot in {:.3} s, drained after CRIU returns; {}",
                size_words(bytes),
                t0.elapsed().as_secs_f64(),
                if paused == 0 {
                    "nothing drained on the pause".to_owned()
                } else {
                    format!(
                        "{paused} allocations ({}) drained on the pause first",
                        size_words(paused_bytes)
                    )
                }
            );
            gpusnap_host::fault::kill_criu_at("dump-snapshot-copied");
            Ok(Some(plan))
        }
        Err((needed, allowed, device)) => {
            log::info!(
                "pid {pid}: asynchronous -R not taken: the snapshot needs {} on GPU {device}, async_snapshot_share = {share}% of its free memory allows {} now (less than when it was asked): all drained on the pause",
                size_words(needed),
                size_words(allowed),
            );
            Ok(None)
        }
    }
}

/// Where an asynchronous `-R`'s snapshot took part of the lent memory: the space held for the
/// drain, split in two, the pause's part and the snapshot's (its drain runs after the pause's,
/// in another process). Otherwise all of it for the one drain.
fn split_for_snapshot(
    pid: impl std::fmt::Display,
    mut held: gpusnap_image::Reservation,
    snapshot: Option<&crate::route::SnapshotPlan>,
    routes: &crate::route::Routes,
    staging: &Staging,
    ctx: &Ctx,
) -> Result<
    (
        gpusnap_image::Reservation,
        Option<gpusnap_image::Reservation>,
    ),
    gpusnap_image::ReserveError,
> {
    match snapshot {
        Some(plan) if !plan.whole() => {
            let bytes = drain_reservation_of(
                routes,
                staging.slot_size() as u64,
                ctx.cfg.effective_writer_threads(),
                |id| plan.snapshot.contains(&id),
            );
            let snap = held.split_off(bytes)?;
            log::info!(
                "pid {pid}: of the space held, {} for the drain on the pause, {} for the snapshot's after CRIU returns",
                crate::route::size_words(held.bytes()),
                crate::route::size_words(snap.bytes()),
            );
            Ok((held, Some(snap)))
        }
        _ => Ok((held, None)),
    }
}

/// The bytes a drain of the lent allocations writes at most: their data, and for each chunk
/// (one staging slot at most) and each data file a page of headers and rounding
/// ([`gpusnap_image::CHUNK_OVERHEAD`]).
fn drain_reservation(routes: &crate::route::Routes, slot: u64, writers: usize) -> u64 {
    drain_reservation_of(routes, slot, writers, |_| true)
}

/// [`drain_reservation`] of the lent allocations whose id `part` takes.
fn drain_reservation_of(
    routes: &crate::route::Routes,
    slot: u64,
    writers: usize,
    part: impl Fn(u64) -> bool,
) -> u64 {
    let overhead = gpusnap_image::CHUNK_OVERHEAD;
    let lent = routes
        .0
        .iter()
        .filter(|(a, r)| a.moved && *r == crate::route::AllocRoute::Lend && part(a.id))
        .map(|(a, _)| {
            a.size
                .saturating_add(a.size.div_ceil(slot.max(1)).saturating_mul(overhead))
        })
        .fold(0u64, u64::saturating_add);
    lent.saturating_add((writers as u64).saturating_mul(overhead))
}

/// The staging ring for `allocations`: the one made at PAUSE if it fits, else a new one.
fn take_ring(
    ctx: &Ctx,
    t: &mut Tracked,
    allocations: &[AllocationRecord],
) -> Result<Staging, DumpError> {
    let ring = ring_shape(ctx, allocations);
    let early = match &mut t.route {
        Route::Split(plan) => plan.early_ring.take(),
        Route::Transparent => None,
    };
    match early {
        Some((shape, staging)) if shape == ring => {
            log::debug!(
                "pid {}: staging ring made while the process ran: {shape:?}",
                t.pid
            );
            Ok(staging)
        }
        other => {
            // The allocations changed since PAUSE: let that ring go before making another.
            drop(other);
            Ok(Staging::new(ring.slot_size, ring.slots).map_err(DataError::Ring)?)
        }
    }
}

/// The driver lock, timed as `what`.
fn lock(ctx: &Ctx, t: &mut Tracked, what: &'static str) -> Result<(), DumpError> {
    let t0 = Instant::now();
    ctx.api
        .lock(t.pid, ctx.lock_timeout_ms)
        .map_err(driver("re-locking after the data was moved"))?;
    t.phase.locked()?;
    t.time(what, t0.elapsed().as_secs_f64());
    Ok(())
}

/// The copy-first data path through the job's agent on `session` (its threads held): the
/// parent image of an incremental dump read back and checked, then every allocation the agent
/// copies into the ring written into the image's files.
fn copy_out_paused(
    ctx: &Ctx,
    t: &Tracked,
    session: &AgentSession,
    staging: &crate::staging::Staging,
    allocations: &[AllocationRecord],
    codec: gpusnap_image::Codec,
) -> Result<datapath::DumpData, DumpError> {
    let dir = ctx.image_dir();
    let parent = crate::parent::parent_index(
        dir,
        t.pid,
        t.nspid,
        allocations,
        ctx.cfg.incremental,
        ctx.cfg.effective_reader_threads(),
    );
    Ok(datapath::copy_out(
        session,
        staging,
        dir,
        t.nspid,
        ctx.cfg.effective_writer_threads(),
        codec,
        parent.as_ref(),
        ctx.limits(),
        ctx.cfg.durable,
        datapath::Round::Paused,
    )?)
}

/// The split protocol, with the application stopped and only the agent thread (and the
/// driver's) running: unlock, copy out, hold, release, lock again, and hand the hold to
/// CRIU's main thread to release (the driver lock holds the process from here).
fn move_data_out(
    ctx: &Ctx,
    t: &mut Tracked,
    release: &Mutex<Option<Hold>>,
) -> Result<(), DumpError> {
    let pid = t.pid;
    unlock_for_agent(ctx, t)?;

    let session = AgentSession::connect_expected(pid, ctx.agent_timeout())?;
    let t0 = Instant::now();
    session.hello_intact()?;
    let allocations = session.list()?;
    let staging = take_ring(ctx, t, &allocations)?;
    t.time("prepare", t0.elapsed().as_secs_f64());

    let dir = ctx.image_dir();
    let (codec, why) = crate::context::codec_for(&ctx.cfg, dir);
    if ctx.cfg.compress == gpusnap_config::Compress::Auto {
        log::info!("pid {pid}: chunks stored as {codec:?}: {why}");
    }
    let data = copy_out_paused(ctx, t, &session, &staging, &allocations, codec)?;
    log_data(pid, &allocations, &data);
    t.time("data", data.seconds);
    // A manifest now, before memory is released: should CRIU die from here on, `gpusnap
    // recover` finds the data. `exit` rewrites it with the final timings.
    let manifest = new_manifest(ctx, t, CheckpointPath::Split, allocations, &data);
    gpusnap_image::write_manifest(dir, &manifest).map_err(DumpError::Manifest)?;

    // Should CRIU die from here until the driver lock holds the process again, its threads
    // must not run: hold them first (the driver's restore thread and the agent's run on).
    let agent_tid = session_agent_tid(t)?;
    t.hold = Some(
        gpusnap_host::hold::Hold::place(pid, &[t.restore_tid, agent_tid])
            .map_err(|err| DumpError::Hold { pid, err })?,
    );
    // From the moment Release is sent, some memory may be gone even if the agent then fails
    // part-way: the phase says released, so a failure keeps the files and rolls back by
    // reloading.
    t.phase.released(MovedData {
        manifest: Box::new(manifest),
        stats: Some(Box::new(data)),
        lent: None,
    })?;
    let t0 = Instant::now();
    let (n, bytes) = session.release()?;
    t.time("release", t0.elapsed().as_secs_f64());
    log::debug!("pid {pid}: agent released {n} allocations ({bytes} bytes)");
    gpusnap_host::fault::kill_criu_at("dump-released");
    lock(ctx, t, "relock")?;
    *release.lock().unwrap_or_else(|e| e.into_inner()) = t.hold.take();
    gpusnap_host::fault::kill_criu_at("dump-relocked");
    Ok(())
}

/// What a data phase moved, for the log: bytes and rate, chunks hashed on the GPU and found
/// zero, the writers' time, and per GPU where there are several.
fn log_data(pid: HostPid, allocations: &[AllocationRecord], data: &datapath::DumpData) {
    log::info!(
        "pid {pid}: data {:.2} GiB in {:.3} s ({:.1} GiB/s) into {} files, {} chunks, written {} bytes ({:.2} GiB), referenced {} bytes unchanged in {} chunks",
        gib(data.bytes),
        data.seconds,
        gib(data.bytes) / data.seconds.max(1e-9),
        data.files.len(),
        data.chunks.len(),
        data.stored_bytes,
        gib(data.stored_bytes),
        data.referenced_bytes,
        data.referenced_chunks,
    );
    log::info!(
        "pid {pid}: {} of {} chunks hashed on the GPU; {} all zero ({:.2} GiB, not copied)",
        data.device_hashed,
        data.chunks.len(),
        data.zero_chunks,
        gib(data.zero_bytes),
    );
    let w = &data.writers;
    log::info!(
        "pid {pid}: {} writer threads, summed: hashing {:.3} s, writing {:.3} s, waiting for data {:.3} s",
        w.threads,
        w.hash_s,
        w.write_s,
        w.wait_s
    );
    let per_gpu = bytes_per_device(allocations, &data.chunks);
    if per_gpu.len() > 1 {
        for (device, bytes) in &per_gpu {
            log::info!(
                "pid {pid}: GPU {device}: {:.2} GiB, {:.1} GiB/s over the data phase",
                gib(*bytes),
                gib(*bytes) / data.seconds.max(1e-9)
            );
        }
    }
}

/// The host tid of the agent thread of a split-path process.
fn session_agent_tid(t: &Tracked) -> Result<HostTid, DumpError> {
    match &t.route {
        Route::Split(s) => Ok(agent::host_tid(t.pid, s.agent_ns_tid)?),
        Route::Transparent => Err(AgentError::NoThread {
            pid: t.pid,
            ns_tid: NsTid(-1),
        }
        .into()),
    }
}

/// Removes this process's gpusnap files (a split attempt that was abandoned, or a failed dump).
pub fn remove_partial_files(ctx: &Ctx, t: &Tracked) {
    if let Err(e) = gpusnap_image::remove_process_files(ctx.image_dir(), t.nspid) {
        log::warn!("pid {}: removing partial image files: {e}", t.pid);
    }
}

/// Puts the process back as it was before the dump (`-R`, or a failed dump). Tasks are still
/// seized by CRIU here; the driver's restore thread is let run for the driver calls. An
/// importer of CUDA IPC shares maps them again from its exporters (among `dumped`, rolled
/// back before it) before its threads may run.
pub fn rollback(
    ctx: &Ctx,
    t: &mut Tracked,
    dumped: &[crate::sharing::Process],
) -> Result<(), DumpError> {
    let pid = t.pid;
    if matches!(t.phase, Phase::Untouched | Phase::DataOut) {
        // Nothing to undo: the driver state is as found (DataOut: our lock is undone already),
        // and the memory is in place.
        t.phase = Phase::Untouched;
        return Ok(());
    }
    let t0 = Instant::now();
    let restore_thread = match ptrace::resume(t.restore_tid, "driver restore thread") {
        Ok(th) => Some(th),
        // Only locked, and the thread is not ours to resume (CRIU never seized the process,
        // e.g. another CRIU had it): it runs, so the unlock needs no resume. The lock must
        // not stay because ptrace said no.
        Err(e) if matches!(t.phase, Phase::Locked) && e.err.raw_os_error() == Some(libc::ESRCH) => {
            log::warn!(
                "pid {pid}: its driver thread is not traced by this CRIU ({e}); unlocking it as it runs"
            );
            None
        }
        Err(e) => return Err(e.into()),
    };
    // The driver knows best: a call that failed may or may not have changed the state (a
    // checkpoint that failed leaves the process locked, and a restore would then be refused).
    match ctx.api.process_state(pid) {
        Ok(driver) => {
            t.phase =
                std::mem::replace(&mut t.phase, Phase::Untouched).reconciled(t.initial, driver)
        }
        Err(e) => log::warn!("pid {pid}: cannot read the driver state during rollback: {e}"),
    }
    let agent_ns_tid = match &t.route {
        Route::Split(s) => Some(s.agent_ns_tid),
        Route::Transparent => None,
    };
    let me = crate::sharing::Process {
        pid,
        nspid: t.nspid,
    };
    let imports = t.shares.iter().any(|s| s.import);
    // The program's own descriptors of its shareable exports (and the agent's) name the
    // memory brought back.
    let repoint = t.shares.iter().any(|s| s.is_shareable() && !s.import);
    let target = Target {
        pid,
        restore_tid: t.restore_tid,
        initial: t.initial,
        agent_tid: &|| match agent_ns_tid {
            Some(ns_tid) => agent::host_tid(pid, ns_tid),
            None => Err(AgentError::NoThread {
                pid,
                ns_tid: NsTid(-1),
            }),
        },
        before_running: &|| {
            if repoint {
                crate::sharing::repoint(me, ctx.agent_timeout(), Some("rollback-repoint"))?;
            }
            if imports {
                let fetch = crate::sharing::from_traced(dumped, ctx.agent_timeout());
                crate::sharing::reimport(
                    me,
                    &fetch,
                    ctx.agent_timeout(),
                    Some("rollback-reimport"),
                )?;
            }
            Ok(())
        },
    };
    undo(ctx, &target, &mut t.phase, &mut t.hold)?;
    if let Some(th) = restore_thread {
        th.stop().map_err(PtraceError::on(
            t.restore_tid,
            "stopping the driver restore thread",
        ))?;
    }
    log::info!(
        "pid {pid}: rolled back to {} in {:.3} s",
        t.initial,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The process a rollback works on.
pub struct Target<'a> {
    pub pid: HostPid,
    /// The driver's restore thread (it runs for the driver calls; a hold leaves it out).
    pub restore_tid: HostTid,
    /// The driver state to return it to.
    pub initial: ProcessState,
    /// Finds the agent's thread (for a reload).
    pub agent_tid: &'a dyn Fn() -> Result<HostTid, AgentError>,
    /// What must be whole too, once the memory is back, before the threads may run (an
    /// importer's CUDA IPC shares, mapped again).
    pub before_running: &'a dyn Fn() -> Result<(), DumpError>,
}

/// Undoes `phase` one step at a time until nothing gpusnap did is left: checkpointed →
/// (driver restore) → locked → (unlock) → released → (reload) → untouched. The driver's restore
/// thread must be able to run, and the caller must be the tracer of every thread. From the
/// unlock until the reload is complete the application threads are held (`hold`, placed here
/// if the dump did not leave one), so a tracer that dies meanwhile leaves the process stopped,
/// not running on absent memory. A reload that fails leaves the process held by the driver
/// lock as well (its CUDA calls wait). Returns the steps taken.
pub fn undo(
    ctx: &Ctx,
    target: &Target<'_>,
    phase: &mut Phase,
    hold: &mut Option<gpusnap_host::hold::Hold>,
) -> Result<Vec<&'static str>, DumpError> {
    let pid = target.pid;
    let mut steps = Vec::new();
    if phase.memory_released() && hold.is_none() {
        let agent = (target.agent_tid)().ok();
        let running: Vec<HostTid> = std::iter::once(target.restore_tid).chain(agent).collect();
        *hold = Some(
            gpusnap_host::hold::Hold::place(pid, &running)
                .map_err(|err| DumpError::Hold { pid, err })?,
        );
    }
    loop {
        *phase = match std::mem::replace(phase, Phase::Untouched) {
            Phase::Untouched | Phase::DataOut => return Ok(steps),
            Phase::Checkpointed(moved) => {
                if let Err(e) = ctx.api.restore(pid, &[]) {
                    *phase = Phase::Checkpointed(moved);
                    return Err(driver("rollback: driver restore")(e));
                }
                steps.push("driver restore");
                gpusnap_host::fault::kill_criu_at("rollback-restored");
                match moved {
                    Some(d) => Phase::Relocked(d),
                    // Locked by someone else before the dump: it stays locked.
                    None if target.initial == ProcessState::Locked => Phase::Untouched,
                    None => Phase::Locked,
                }
            }
            Phase::Locked => {
                if let Err(e) = ctx.api.unlock(pid) {
                    *phase = Phase::Locked;
                    return Err(driver("rollback: unlock")(e));
                }
                steps.push("unlock");
                Phase::Untouched
            }
            Phase::Relocked(d) => {
                if let Err(e) = ctx.api.unlock(pid) {
                    *phase = Phase::Relocked(d);
                    return Err(driver("rollback: unlock")(e));
                }
                steps.push("unlock");
                Phase::Released(d)
            }
            Phase::Released(mut d) => match bring_back(ctx, target, &mut d)
                .and_then(|how| (target.before_running)().map(|()| how))
            {
                Ok(how) => {
                    steps.push(how);
                    // Whole again: the application threads may run when their tracer lets go.
                    if let Some(h) = hold.take() {
                        h.release()?;
                    }
                    Phase::Untouched
                }
                Err(e) => {
                    // Hold the process with the driver lock: its threads must not run on
                    // memory that is not back. `gpusnap recover` reloads it from the files.
                    *phase = match ctx.api.lock(pid, ctx.lock_timeout_ms) {
                        Ok(()) => Phase::Relocked(d),
                        Err(le) => {
                            log::error!("pid {pid}: cannot hold the process with the lock: {le}");
                            Phase::Released(d)
                        }
                    };
                    return Err(e);
                }
            },
        };
    }
}

/// Brings released memory back: lent memory is mapped again from the descriptors the job kept
/// (a drain still running is stopped first: the dump is being undone), other memory is
/// reloaded from the image files. Returns the step taken.
fn bring_back(
    ctx: &Ctx,
    target: &Target<'_>,
    moved: &mut MovedData,
) -> Result<&'static str, DumpError> {
    let Some(lent) = moved.lent.as_deref_mut() else {
        reload(ctx, target, moved)?;
        return Ok("device data reloaded");
    };
    if lent.drain.as_ref().is_some_and(|d| !d.is_finished()) {
        log::warn!(
            "pid {}: stopping the drain: the dump is being undone",
            target.pid
        );
    }
    crate::handover::abandon(lent);
    let tid = (target.agent_tid)()?;
    let t0 = Instant::now();
    let agent_thread = ptrace::resume(tid, "agent thread")?;
    let reclaimed = AgentSession::connect_expected(target.pid, ctx.agent_timeout())
        .and_then(AgentSession::reclaim)
        .and_then(|r| {
            // What was copied out first is still released: the agent says so.
            let still = AgentSession::connect_expected(target.pid, ctx.agent_timeout())?
                .hello()?
                .released;
            Ok((r, still))
        });
    agent_thread
        .stop()
        .map_err(PtraceError::on(tid, "stopping the agent thread"))?;
    let ((n, bytes), still_released) = reclaimed?;
    gpusnap_host::fault::kill_criu_at("rollback-reclaimed");
    log::info!(
        "pid {}: device memory mapped back from the descriptors it kept ({n} allocations, {:.2} GiB) in {:.3} s, no file read",
        target.pid,
        gib(bytes),
        t0.elapsed().as_secs_f64()
    );
    if !still_released {
        return Ok("device memory mapped back");
    }
    // The copy-first part: reloaded from its files, the process still held.
    let Some(part) = lent.copy_first.as_deref() else {
        return Err(DumpError::CopyFirstPartMissing { pid: target.pid });
    };
    let stats = load_through_agent(
        ctx,
        target.pid,
        tid,
        ctx.image_dir(),
        part,
        "rollback-reload",
    )?;
    log::info!(
        "pid {}: device data reloaded ({:.2} GiB in {:.3} s): the allocations copied out first",
        target.pid,
        gib(stats.bytes),
        stats.seconds
    );
    Ok("device memory mapped back, the copied part reloaded")
}

/// Reloads released memory from the files of `moved` through the agent.
fn reload(ctx: &Ctx, target: &Target<'_>, moved: &MovedData) -> Result<(), DumpError> {
    if !moved.manifest.allocations.iter().any(|a| a.moved) {
        // Nothing of its own was released (a process that only maps others' CUDA IPC memory):
        // nothing to load; its imports are mapped again once the memory is back.
        return Ok(());
    }
    let tid = (target.agent_tid)()?;
    let stats = load_through_agent(
        ctx,
        target.pid,
        tid,
        ctx.image_dir(),
        &moved.manifest,
        "rollback-reload",
    )?;
    log::info!(
        "pid {}: device data reloaded ({:.2} GiB in {:.3} s)",
        target.pid,
        gib(stats.bytes),
        stats.seconds
    );
    Ok(())
}

/// Runs only the agent thread and streams `manifest`'s data into re-created memory.
pub fn load_through_agent(
    ctx: &Ctx,
    pid: HostPid,
    agent_tid: HostTid,
    dir: BorrowedFd<'_>,
    manifest: &Manifest,
    fault_point: &'static str,
) -> Result<datapath::LoadStats, DumpError> {
    let agent_thread = ptrace::resume(agent_tid, "agent thread")?;
    // A rollback's reload checks every chunk on the host as it reads it.
    let checks = datapath::ReadChecks::Host;
    let stats =
        crate::load::with_agent_running(ctx, pid, dir, manifest, fault_point, checks, None)?;
    agent_thread
        .stop()
        .map_err(PtraceError::on(agent_tid, "stopping the agent thread"))?;
    Ok(stats)
}

/// Bytes moved per device (the agent copies every device's allocations on that device's own
/// streams, in parallel), in device order.
fn bytes_per_device(
    allocations: &[AllocationRecord],
    chunks: &[gpusnap_image::ChunkEntry],
) -> Vec<(u32, u64)> {
    let mut out: std::collections::BTreeMap<u32, u64> = Default::default();
    for c in chunks {
        if let Some(a) = allocations
            .iter()
            .find(|a| c.addr >= a.addr && c.addr - a.addr < a.size)
        {
            *out.entry(a.device).or_default() += c.len;
        }
    }
    out.into_iter().collect()
}

/// A manifest of one dumped process, from what its data phase wrote (nothing on the
/// transparent path).
fn new_manifest(
    ctx: &Ctx,
    t: &Tracked,
    path: CheckpointPath,
    allocations: Vec<AllocationRecord>,
    data: &datapath::DumpData,
) -> Manifest {
    let requires = crate::driver::stack::requirements(t.pid, &allocations);
    Manifest {
        timings_s: t.timings.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        requires: Some(requires),
        ..manifest_of(
            t.nspid,
            path,
            (ctx.driver_version, &ctx.gpus),
            allocations,
            data,
        )
    }
}

/// A manifest of process `nspid` from what a data phase wrote, on this host's driver and GPUs
/// (`driver`: the driver's version and its GPUs); no timings.
pub fn manifest_of(
    nspid: NsPid,
    path: CheckpointPath,
    driver: (i32, &[crate::driver::GpuInfo]),
    allocations: Vec<AllocationRecord>,
    data: &datapath::DumpData,
) -> Manifest {
    let (driver_version, gpus) = driver;
    Manifest {
        format_version: gpusnap_image::FORMAT_VERSION,
        nspid,
        path,
        created_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        gpusnap_version: gpusnap_image::BUILD.to_owned(),
        driver_version,
        gpus: gpus
            .iter()
            .map(|g| gpusnap_image::GpuRecord {
                ordinal: g.ordinal,
                uuid: g.uuid.to_string(),
                name: g.name.clone(),
                total_mem: g.total_mem,
            })
            .collect(),
        allocations,
        files: data.files.clone(),
        chunks: data.chunks.clone(),
        timings_s: Default::default(),
        requires: None,
    }
}

/// The final manifest of one dumped process (written by `exit` once CRIU has succeeded): the
/// one written before the release, with every timing, or a transparent one.
pub fn manifest_for(ctx: &Ctx, t: &Tracked) -> Manifest {
    match t.phase.moved() {
        Some(moved) => Manifest {
            timings_s: t.timings.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            ..(*moved.manifest).clone()
        },
        None => new_manifest(
            ctx,
            t,
            CheckpointPath::Transparent,
            Vec::new(),
            &datapath::DumpData::default(),
        ),
    }
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// One `criu dump` with gpusnap active: every GPU process CRIU paused, and the outcome of
/// their (single, parallel) checkpoint.
pub struct DumpRun {
    cfg: gpusnap_config::Config,
    /// CRIU's image directory, fetched once at init.
    dir: Option<BorrowedFd<'static>>,
    ctx: Option<Ctx>,
    tracked: Vec<Tracked>,
    /// The dumped processes without CUDA (their descriptors are looked at for exported memory).
    others: Vec<HostPid>,
    checkpointed: Option<Vec<(HostPid, Result<(), DumpError>)>>,
}

impl DumpRun {
    pub fn new(cfg: gpusnap_config::Config, dir: Option<BorrowedFd<'static>>) -> Self {
        Self {
            cfg,
            dir,
            ctx: None,
            tracked: Vec::new(),
            others: Vec::new(),
            checkpointed: None,
        }
    }

    /// PAUSE_DEVICES: `Some(true)` when `pid` is a CUDA process gpusnap now tracks (locked),
    /// `None` when it is not a CUDA process, `Some(false)` when the dump must fail.
    pub fn pause_devices(&mut self, pid: HostPid) -> Option<bool> {
        if self.ctx.is_none() {
            match Ctx::open(&self.cfg, self.dir) {
                Ok(c) => self.ctx = Some(c),
                Err(e) => {
                    log::error!("cannot use the NVIDIA driver: {e}");
                    return Some(false);
                }
            }
        }
        let ctx = self.ctx.as_ref().expect("opened above");
        match pause(ctx, pid) {
            Ok(Some(t)) => {
                self.tracked.push(t);
                Some(true)
            }
            Ok(None) => {
                self.others.push(pid);
                None
            }
            Err(e) => {
                log::error!("pid {pid}: {e}");
                Some(false)
            }
        }
    }

    /// CHECKPOINT_DEVICES: the first call checkpoints every tracked process, in parallel; every
    /// call answers for its pid. `None`: not one of ours.
    pub fn checkpoint_devices(&mut self, pid: HostPid) -> Option<bool> {
        let ctx = self.ctx.as_ref()?;
        if !self.tracked.iter().any(|t| t.pid == pid) {
            return None;
        }
        let outcome = self
            .checkpointed
            .get_or_insert_with(|| checkpoint_all(ctx, &mut self.tracked, &self.others));
        match outcome.iter().find(|(p, _)| *p == pid)? {
            (_, Ok(())) => Some(true),
            (_, Err(e)) => {
                log::error!(
                    "pid {pid}: checkpoint failed: {e}; the dump is aborted and the process rolled back"
                );
                Some(false)
            }
        }
    }

    /// `exit(DUMP, ret)`: on success the final manifests and `gpusnap-stats.json`; on `-R` or
    /// failure every process is rolled back (a failed dump's files are removed).
    pub fn exit(&mut self, ret: i32) {
        gpusnap_host::fault::criu_part_over();
        let Some(ctx) = self.ctx.as_ref() else { return };
        let mut leave_running = gpusnap_host::criu::leave_running();
        // Drains ran beside CRIU's dump: join them before anything is decided.
        let drained: Vec<Result<(), DumpError>> = self
            .tracked
            .iter_mut()
            .map(|t| finish_drain(ctx, t, ret))
            .collect();
        gpusnap_host::logger::print_deferred();
        let drain_failed = drained.iter().any(Result::is_err);
        if ret == 0 && drain_failed {
            // CRIU's part succeeded and it would now kill the job, whose data is not in the
            // image: it must go on running (its memory is its own, lent descriptors kept).
            let kept = leave_running || gpusnap_host::criu::keep_tasks_alive();
            // CRIU reports success whatever this hook does: one fixed line on CRIU's stderr
            // that a script can match, and a marker in the directory that every tool refuses.
            gpusnap_host::logger::tell_user(&format!(
                "{NOT_A_CHECKPOINT}: the GPU data of this dump could not be written into the image, although CRIU reports success; {}",
                if kept {
                    "the job runs on (rolled back); the image directory is marked NOT-A-CHECKPOINT and no restore takes it"
                } else {
                    "CRIU could not be told to leave the job running; the image directory is marked NOT-A-CHECKPOINT and no restore takes it"
                }
            ));
            leave_running = kept;
        }
        let mut stats = Vec::new();
        let dumped: Vec<crate::sharing::Process> = self
            .tracked
            .iter()
            .map(|t| crate::sharing::Process {
                pid: t.pid,
                nspid: t.nspid,
            })
            .collect();
        // Exporters are rolled back before importers, which map their memory again.
        let mut order: Vec<(usize, Result<(), DumpError>)> =
            drained.into_iter().enumerate().collect();
        order.sort_by_key(|(i, _)| self.tracked[*i].shares.iter().any(|s| s.import));
        for (i, drained) in order {
            let t = &mut self.tracked[i];
            let mut failed = drained.is_err();
            let mut cause = drained.as_ref().err().map(ToString::to_string);
            let background = ret == 0 && !failed && has_background(t);
            if background {
                // Before the rollback, which takes the job's memory back: the drainer reads
                // only the keeper's snapshot, and the job runs on while it writes.
                match spawn_drainer(ctx, t) {
                    Ok(drainer) => log::info!(
                        "pid {}: CRIU returns now; drainer pid {drainer} writes the image from the keeper's snapshot, then the manifest, then removes {}",
                        t.pid,
                        gpusnap_image::pending_marker_name(t.nspid)
                    ),
                    Err(e) => {
                        failed = true;
                        cause = Some(e.to_string());
                    }
                }
            }
            if let Some(e) = &cause {
                log::error!(
                    "pid {}: {e}; this process's image is incomplete and its gpusnap files are removed: restore will refuse it",
                    t.pid
                );
            }
            if ret == 0 && !failed && !background {
                let m = manifest_for(ctx, t);
                if let Err(e) = gpusnap_image::write_manifest(ctx.image_dir(), &m) {
                    log::error!(
                        "pid {}: rewriting the manifest with the final timings failed: {e}; the one written at the checkpoint stands",
                        t.pid
                    );
                }
                stats.push(stats_of(t));
            }
            if ret != 0 || leave_running || failed {
                match rollback(ctx, t, &dumped) {
                    // A failed dump's files are no use to anyone.
                    Ok(()) if ret != 0 || failed => {
                        remove_partial_files(ctx, t);
                        if let (0, Some(cause)) = (ret, &cause) {
                            mark_not_a_checkpoint(ctx, t, cause);
                        }
                    }
                    Ok(()) => {}
                    Err(e) => {
                        let held = match &t.phase {
                            Phase::Locked | Phase::Relocked(_) => {
                                "it is held locked by the driver (its CUDA calls wait), so it does not run without its GPU memory"
                            }
                            Phase::Checkpointed(_) => {
                                "it is left checkpointed by the driver (its CUDA calls wait)"
                            }
                            Phase::Released(_) => "it may run without all of its GPU memory",
                            Phase::Untouched | Phase::DataOut => "its GPU memory is in place",
                        };
                        // On CRIU's stderr too: CRIU reports the dump itself a success.
                        gpusnap_host::logger::tell_user(&format!(
                            "pid {}: ROLLBACK FAILED: {e}. {held}. CRIU's own dump succeeded, but the job does not run: bring it back with `gpusnap recover {} --images <this image dir>`",
                            t.pid, t.pid
                        ));
                    }
                }
            }
        }
        if ret == 0 && !stats.is_empty() {
            let doc = serde_json::json!({ "stage": "dump", "processes": stats });
            if let Err(e) = gpusnap_image::write_stats(ctx.image_dir(), &doc) {
                log::warn!("writing gpusnap-stats.json failed: {e}");
            }
        }
    }
}

/// The one line a dump whose GPU data was lost after CRIU's part prints on CRIU's stderr
/// (CRIU itself then exits 0) starts `gpusnap: NOT A CHECKPOINT:`; scripts match it.
pub const NOT_A_CHECKPOINT: &str = "NOT A CHECKPOINT";

/// Leaves `gpusnap-<nspid>-NOT-A-CHECKPOINT.txt` (the cause, in words) where this process's
/// gpusnap files were: `criu restore`, `gpusnap verify` and `inspect` then refuse the
/// directory as an unfinished dump, naming that file.
fn mark_not_a_checkpoint(ctx: &Ctx, t: &Tracked, cause: &str) {
    let name = gpusnap_image::failed_marker_name(t.nspid);
    let text = format!(
        "This directory is NOT a usable checkpoint: the GPU data of pid {} (namespace pid {}) could not be written after CRIU's own part had succeeded, so CRIU reported success.\nCause: {cause}\nDump the job again.\n",
        t.pid, t.nspid
    );
    let written = crate::handover::write_new_marker(ctx.image_dir(), &name, &text);
    if let Err(e) = written {
        log::error!("pid {}: writing {name}: {e}", t.pid);
    }
}

/// Whether the process's drain waits for a drainer (an asynchronous `-R`).
fn has_background(t: &mut Tracked) -> bool {
    t.phase
        .moved_mut()
        .and_then(|m| m.lent.as_deref_mut())
        .is_some_and(|l| l.background.is_some())
}

/// Starts the drainer of an asynchronous `-R`: a process that outlives CRIU (forked from it
/// twice, in its own session, so that it is not CRIU's child) and drains the keeper's snapshot
/// into the image, writes the manifest, then removes the PENDING marker; or, failing,
/// leaves the NOT-A-CHECKPOINT marker with the cause. The keeper goes with it: this process
/// forgets both (the rollback that follows must not kill the keeper). Returns the drainer's
/// pid.
fn spawn_drainer(ctx: &Ctx, t: &mut Tracked) -> Result<i32, DumpError> {
    let pid = t.pid;
    let lent = t
        .phase
        .moved_mut()
        .and_then(|m| m.lent.as_deref_mut())
        .ok_or(DumpError::HandOver(
            crate::handover::HandOverError::NoKeeper,
        ))?;
    let (Some(background), Some(keeper)) = (lent.background.take(), lent.keeper.take()) else {
        return Err(DumpError::HandOver(
            crate::handover::HandOverError::NoKeeper,
        ));
    };
    let allocations = lent.routes.records();
    let copied = lent.copied.take();
    // A pipe tells the grandchild's pid (the drainer's) to this process.
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two descriptors of a valid array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(DumpError::DrainStart {
            pid,
            err: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: fork from CRIU's main thread in `exit`: no thread of ours holds a lock (the
    // drain threads of this dump have not started), and the child only forks again; the
    // grandchild runs the drain with threads of its own (glibc's allocator is fork-safe).
    let child = unsafe { libc::fork() };
    if child < 0 {
        let err = std::io::Error::last_os_error();
        // SAFETY: closing the pipe made above.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        keeper.kill();
        return Err(DumpError::DrainStart { pid, err });
    }
    if child == 0 {
        // SAFETY: setsid and fork in the child of a fork; _exit ends the intermediate at once.
        unsafe {
            libc::close(fds[0]);
            libc::setsid();
            let grandchild = libc::fork();
            if grandchild != 0 {
                libc::_exit(i32::from(grandchild < 0));
            }
        }
        // The drainer.
        let me = std::process::id() as i32;
        // SAFETY: writing 4 bytes of a local to the pipe's write end.
        unsafe {
            libc::write(fds[1], (&me as *const i32).cast(), 4);
            libc::close(fds[1]);
        }
        let status = run_drainer(ctx, t, *background, keeper, allocations, copied);
        gpusnap_host::logger::print_deferred();
        // SAFETY: _exit: no destructor of CRIU's copied state may run here.
        unsafe { libc::_exit(status) };
    }
    // SAFETY: closing our copy of the write end; reaping the intermediate child.
    unsafe {
        libc::close(fds[1]);
        let mut st = 0;
        libc::waitpid(child, &mut st, 0);
    }
    let mut drainer = 0i32;
    // SAFETY: reading 4 bytes into a local from the pipe's read end, then closing it.
    let n = unsafe {
        let n = libc::read(fds[0], (&mut drainer as *mut i32).cast(), 4);
        libc::close(fds[0]);
        n
    };
    // The keeper and its session are the drainer's now: neither is killed nor closed-and-
    // waited-for here (dropping the session only closes this process's copy of it).
    drop(background);
    std::mem::forget(keeper);
    if n != 4 {
        return Err(DumpError::DrainStart {
            pid,
            err: std::io::Error::other("the drainer did not start"),
        });
    }
    Ok(drainer)
}

/// The drainer's whole life (in the grandchild of [`spawn_drainer`]). Returns its exit status.
fn run_drainer(
    ctx: &Ctx,
    t: &mut Tracked,
    background: crate::handover::Background,
    keeper: crate::keeper::Keeper,
    allocations: Vec<AllocationRecord>,
    copied: Option<Box<datapath::DumpData>>,
) -> i32 {
    detach_stdio();
    let pid = t.pid;
    let nspid = t.nspid;
    let dir = ctx.image_dir();
    let pending = gpusnap_image::pending_marker_name(nspid);
    let words = format!(
        "The GPU data of pid {pid} is being written into this directory after an asynchronous `criu dump -R`; it is not a checkpoint until this file is gone (`gpusnap wait DIR`)."
    );
    if let Err(e) = crate::handover::write_pending(dir, nspid, &words) {
        log::warn!("pid {pid}: drainer: {pending} not taken over: {e}");
    }
    let t0 = Instant::now();
    let crate::handover::Background { session, job } = background;
    let outcome = crate::handover::Drain::start(session, job)
        .map_err(|err| DumpError::DrainStart { pid, err })
        .and_then(|drain| {
            if gpusnap_host::fault::armed_at("async-drain-started") {
                gpusnap_host::logger::print_now(
                    "test fault async-drain-started: killing the keeper",
                );
                keeper.kill();
            }
            let mut done = drain.join();
            drop(done.session.take());
            done.data.map_err(|err| DumpError::Drain { pid, err })
        });
    drop(keeper);
    let written = outcome.and_then(|data| {
        log_data(pid, &allocations, &data);
        let data = match copied {
            Some(c) => c.merged(data),
            None => data,
        };
        let manifest = new_manifest(ctx, t, CheckpointPath::Split, allocations, &data);
        if gpusnap_host::fault::armed_at("async-before-manifest") {
            gpusnap_host::logger::print_now(
                "test fault async-before-manifest: killing the drainer",
            );
            // SAFETY: kill(2) of this very process.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        gpusnap_image::write_manifest(dir, &manifest).map_err(DumpError::Manifest)?;
        if ctx.cfg.durable {
            gpusnap_host::fault::sync_dir(dir).map_err(DumpError::Manifest)?;
        }
        Ok(())
    });
    match written {
        Ok(()) => {
            if let Err(e) = crate::handover::unlink_at(dir, &pending) {
                log::error!("pid {pid}: drainer: removing {pending}: {e}");
                return 1;
            }
            if ctx.cfg.durable {
                let _ = gpusnap_host::fault::sync_dir(dir);
            }
            log::info!(
                "pid {pid}: asynchronous -R: the image is complete {:.3} s after CRIU returned ({pending} removed)",
                t0.elapsed().as_secs_f64()
            );
            0
        }
        Err(e) => {
            let cause = e.to_string();
            log::error!(
                "pid {pid}: asynchronous -R failed after CRIU returned: {cause}; the job runs on, the image is marked NOT-A-CHECKPOINT"
            );
            // The marker first, then what the drain wrote (manifest first), PENDING last: a
            // reader never sees the process without one of the two markers.
            mark_not_a_checkpoint(ctx, t, &cause);
            if let Ok(files) = gpusnap_image::list_image_files(dir) {
                for (kind, name) in files {
                    let drop_it = kind.nspid() == Some(nspid)
                        && !matches!(
                            kind,
                            gpusnap_image::ImageFileKind::Failed { .. }
                                | gpusnap_image::ImageFileKind::Pending { .. }
                        );
                    if drop_it && let Err(e) = crate::handover::unlink_at(dir, &name) {
                        log::warn!("pid {pid}: drainer: removing {name}: {e}");
                    }
                }
            }
            let _ = crate::handover::unlink_at(dir, &pending);
            2
        }
    }
}

/// The drainer's standard streams go to `/dev/null`, and every pipe it inherited from CRIU is
/// closed: whoever waits for CRIU's output to end (a shell, a test) must not wait for the
/// drainer. Sockets (the keeper's connection) and files stay.
fn detach_stdio() {
    // SAFETY: open, dup2, fstat and close on descriptor numbers of this process only.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        if null >= 0 {
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
            libc::close(null);
        }
        libc::signal(libc::SIGCHLD, libc::SIG_DFL);
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd > 2)
        .collect();
    for fd in fds {
        // SAFETY: a zeroed stat that fstat fills; close of a pipe this process inherited.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) == 0 && (st.st_mode & libc::S_IFMT) == libc::S_IFIFO {
                libc::close(fd);
            }
        }
    }
}

/// Joins the drain of a process whose memory is lent; with its data, the manifest to write.
/// A failed dump (`ret != 0`) stops the drain instead.
fn finish_drain(ctx: &Ctx, t: &mut Tracked, ret: i32) -> Result<(), DumpError> {
    let pid = t.pid;
    let Some(lent) = t.phase.moved_mut().and_then(|m| m.lent.as_deref_mut()) else {
        return Ok(());
    };
    if ret != 0 {
        crate::handover::abandon(lent);
        return Ok(());
    }
    if lent.background.is_some() {
        // An asynchronous -R: the drainer takes it (`spawn_drainer`, in `exit`'s loop).
        return Ok(());
    }
    let Some(drain) = lent.drain.take() else {
        // The checkpoint failed between the release and the driver checkpoint: CRIU's ret
        // says so too; the rollback maps the memory back.
        return Err(DumpError::HandOver(
            crate::handover::HandOverError::NoKeeper,
        ));
    };
    let since = lent.since.elapsed().as_secs_f64();
    // Each allocation as it went: lent (a restore may hand it over), or copied out first.
    let allocations = lent.routes.records();
    let copied = lent.copied.take();
    let mut done = drain.join();
    // An asynchronous -R's snapshot of the rest: its drain takes the keeper's session and the
    // ring over from this one.
    let deferred = lent
        .deferred
        .take()
        .filter(|_| done.data.is_ok())
        .map(|part| (part, done.session.take(), done.job.take()));
    if deferred.is_none() {
        // The keeper has released its imports (or died): let it go and reap it.
        drop(done.session.take());
        lent.keeper.take();
    }
    log::info!(
        "pid {pid}: the drain ran {:.3} s beside CRIU's dump; at CRIU's end ({since:.3} s after the hand-over) it waited {:.3} s more for it",
        done.ran_s,
        done.waited_s,
    );
    t.time("drain", done.ran_s);
    t.time("drain_wait", done.waited_s);
    let data = done.data.map_err(|err| DumpError::Drain { pid, err })?;
    log_data(pid, &allocations, &data);
    let data = match copied {
        Some(c) => c.merged(data),
        None => data,
    };
    if let Some((part, session, job)) = deferred {
        return defer_snapshot(t, *part, data, session.zip(job));
    }
    log::info!(
        "pid {pid}: the image holds {} lent and {} copied-first allocations",
        allocations.iter().filter(|a| a.lent).count(),
        allocations.iter().filter(|a| a.moved && !a.lent).count()
    );
    let manifest = new_manifest(ctx, t, CheckpointPath::Split, allocations, &data);
    if let Some(m) = t.phase.moved_mut() {
        *m.manifest = manifest;
        m.stats = Some(Box::new(data));
    }
    gpusnap_host::fault::kill_criu_at("dump-before-manifest");
    Ok(())
}

/// An asynchronous `-R` whose snapshot took part of the lent memory, at CRIU's end: the part
/// drained on the pause is written (`data`, merged with a copy-first part's); the snapshot's
/// drain ([`crate::handover::Background`], the drainer's) takes over the keeper, and the
/// session and the job (its ring) the pause's drain `handed` back, and writes the manifest, of
/// both parts, once it has drained the snapshot. Nothing is written here.
fn defer_snapshot(
    t: &mut Tracked,
    part: crate::handover::Deferred,
    data: datapath::DumpData,
    handed: Option<(KeeperSession, crate::handover::DrainJob)>,
) -> Result<(), DumpError> {
    let pid = t.pid;
    let no_keeper = || DumpError::HandOver(crate::handover::HandOverError::NoKeeper);
    let lent = t
        .phase
        .moved_mut()
        .and_then(|m| m.lent.as_deref_mut())
        .ok_or_else(no_keeper)?;
    let (session, mut job) = handed.ok_or_else(no_keeper)?;
    // The snapshot's files are numbered after every file of this process so far.
    job.first_file = next_data_file(&data.files).max(
        job.first_file
            .saturating_add(u32::try_from(job.writers).unwrap_or(u32::MAX / 2)),
    );
    job.reserved = part.reserved;
    log::info!(
        "pid {pid}: {} allocations drained on the pause are written ({} data files); the keeper's snapshot of {} allocations is drained after CRIU returns, into data files from {} on",
        lent.routes.lent() - part.ids.len(),
        data.files.len(),
        part.ids.len(),
        job.first_file,
    );
    lent.copied = Some(Box::new(data));
    lent.background = Some(Box::new(crate::handover::Background { session, job }));
    Ok(())
}

/// The number after the highest data file number in `files` (0 without any).
fn next_data_file(files: &[gpusnap_image::FileEntry]) -> u32 {
    files
        .iter()
        .filter_map(|f| match gpusnap_image::parse_file_name(&f.name) {
            Some(gpusnap_image::ImageFileKind::Data { index, .. }) => Some(index),
            _ => None,
        })
        .max()
        .map_or(0, |n| n.saturating_add(1))
}

/// One process's entry in `gpusnap-stats.json`.
fn stats_of(t: &Tracked) -> serde_json::Value {
    let timings: serde_json::Map<String, serde_json::Value> = t
        .timings
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
        .collect();
    let mut v = serde_json::json!({
        "nspid": t.nspid.get(),
        "path": if t.is_split() { "split" } else { "transparent" },
        "timings_s": timings,
    });
    if let Some(d) = t.phase.moved().and_then(|m| m.stats.as_ref()) {
        // What this dump stored, against what it referenced unchanged in its parent images.
        v["data"] = serde_json::json!({
            "chunks": d.chunks.len(),
            "device_bytes": d.bytes,
            "bytes_written": d.stored_bytes,
            "chunks_referenced": d.referenced_chunks,
            "bytes_referenced": d.referenced_bytes,
            "chunks_zero": d.zero_chunks,
            "bytes_zero": d.zero_bytes,
            "chunks_device_hashed": d.device_hashed,
            "bytes_copied_off_device": d.copied_bytes,
            "incremental": d.referenced_chunks > 0,
            // Summed over the writer threads: where the host side of the data phase went.
            "writers": {
                "threads": d.writers.threads,
                "hash_s": d.writers.hash_s,
                "write_s": d.writers.write_s,
                "wait_s": d.writers.wait_s,
            },
        });
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpusnap_host::pid::{NsPid, NsTid};
    use gpusnap_image::{ChunkEntry, Codec};

    /// Access set by the program is the driver's path's to keep, unless the process imports
    /// memory (which that path cannot take): then the dump is refused, naming it.
    #[test]
    fn access_set_by_the_program_refuses_only_an_importer() {
        let me = std::process::id() as i32;
        let hello = |hazards| AgentHello {
            ns_pid: NsPid(me as u32),
            ns_tid: NsTid(me),
            allocations: 1,
            converted_bytes: 2 << 20,
            devices: 1,
            released: false,
            hazards,
            kept: 0,
        };
        assert_eq!(
            unsupported_state(HostPid(me), Some(&hello(hazard::ACCESS_SET))),
            None
        );
        let refused = unsupported_state(
            HostPid(me),
            Some(&hello(hazard::ACCESS_SET | hazard::SHAREABLE_IMPORT)),
        )
        .expect("an importer with access of its own is refused");
        assert!(refused.contains("cuMemSetAccess"), "{refused}");
        assert!(matches!(
            split_candidate(HostPid(me), hello(hazard::ACCESS_SET)),
            Ok(None)
        ));
        assert!(matches!(
            split_candidate(HostPid(me), hello(0)),
            Ok(Some(_))
        ));
    }

    #[test]
    fn the_keeper_prepares_only_the_gpus_of_memory_it_will_be_lent() {
        use crate::driver::GpuInfo;
        use gpusnap_proto::AllocKind;
        let gpu = |ordinal: u32, byte: u8| GpuInfo {
            ordinal,
            uuid: crate::GpuUuid::from_bytes([byte; 16]),
            name: "NVIDIA H200".into(),
            total_mem: 1 << 30,
        };
        let alloc = |id: u64, device: u32| AllocationRecord {
            id,
            device,
            addr: id << 21,
            size: 1 << 21,
            moved: true,
            lent: false,
            rdma_capable: false,
        };
        let gpus = [gpu(0, 0xa0), gpu(1, 0xb1), gpu(2, 0xc2)];
        let listed = [
            (alloc(1, 1), AllocKind::Converted),
            (alloc(2, 2), AllocKind::ConvertedNoExport),
            (alloc(3, 1), AllocKind::AppHandleLendable),
        ];
        assert_eq!(lending_gpus(&gpus, &listed), vec![[0xb1; 16]]);
        assert!(lending_gpus(&gpus, &listed[1..2]).is_empty());
    }

    #[test]
    fn several_processes_without_the_agent_get_the_ipc_warning() {
        let tracked = |pid: i32, agent| Tracked {
            pid: HostPid(pid),
            nspid: NsPid(pid as u32),
            restore_tid: HostTid(pid + 1),
            initial: ProcessState::Running,
            phase: Phase::Untouched,
            route: Route::Transparent,
            agent,
            hold: None,
            timings: Vec::new(),
            shares: Vec::new(),
            job_lock: None,
        };
        assert_eq!(ipc_blind_spot(&[tracked(10, false)]), None, "one process");
        assert_eq!(
            ipc_blind_spot(&[tracked(10, true), tracked(20, true)]),
            None,
            "the agent sees IPC"
        );
        let w = ipc_blind_spot(&[tracked(10, true), tracked(20, false), tracked(30, false)])
            .expect("a warning");
        assert!(
            w.starts_with("3 GPU processes") && w.contains("pid(s) 20, 30 run without"),
            "{w}"
        );
    }

    #[test]
    fn only_live_mps_processes_count() {
        let stat = |comm: &str, state: &str| format!("1313 ({comm}) {state} 1 1313 1313 0 -1");
        assert!(is_live_mps_process(&stat("nvidia-cuda-mps", "S")));
        assert!(is_live_mps_process(&stat("nvidia-cuda-mps", "R")));
        // quit but not yet reaped by its parent (found on the H200: a later dump named it)
        assert!(!is_live_mps_process(&stat("nvidia-cuda-mps", "Z")));
        assert!(!is_live_mps_process(&stat("nvidia-cuda-mps", "X")));
        assert!(!is_live_mps_process(&stat("python3", "S")));
        assert!(!is_live_mps_process(&stat("my nvidia-cuda-mps", "S")));
        assert!(!is_live_mps_process("garbage"));
    }

    #[test]
    fn failed_fsyncs_are_never_a_reason_to_fall_back() {
        let fsync = |file: &str| ImageError::Io {
            file: file.to_owned(),
            op: IoOp::Fsync,
            source: std::io::Error::from_raw_os_error(libc::EIO),
        };
        let data = DumpError::Data(DataError::Sync(fsync("gpusnap-7-data-0.img")));
        assert!(data.is_durability());
        assert!(
            data.to_string()
                .contains("gpusnap-7-data-0.img: fsync failed: Input/output error"),
            "{data}"
        );
        let dir = DumpError::Durable(std::sync::Arc::new(fsync(gpusnap_image::IMAGE_DIR)));
        assert!(dir.is_durability());
        assert!(
            dir.to_string()
                .starts_with("durable = true: image directory: fsync failed"),
            "{dir}"
        );
        assert!(DumpError::Manifest(fsync("gpusnap-7-manifest.img.tmp")).is_durability());
        // A write that failed (disk full, say) still falls back to the driver path.
        let full = || std::io::Error::from_raw_os_error(libc::ENOSPC);
        let write = |file: &str| ImageError::Io {
            file: file.into(),
            op: IoOp::Write,
            source: full(),
        };
        assert!(!DumpError::Data(DataError::Image(write("gpusnap-7-data-0.img"))).is_durability());
        assert!(!DumpError::Manifest(write("gpusnap-7-manifest.img.tmp")).is_durability());
    }

    #[test]
    fn bytes_are_counted_per_device() {
        let alloc = |id, device, addr, size| AllocationRecord {
            id,
            device,
            addr,
            size,
            moved: true,
            lent: false,
            rdma_capable: false,
        };
        let chunk = |addr, len| ChunkEntry {
            file: 0,
            file_offset: 64,
            addr,
            len,
            stored_len: len,
            codec: Codec::Raw,
            checksum: 0,
            content_xxh128: None,
            parent_depth: 0,
            device_hash: None,
        };
        let allocs = [
            alloc(1, 0, 0x1000_0000, 0x400),
            alloc(2, 1, 0x2000_0000, 0x200),
        ];
        let chunks = [
            chunk(0x1000_0000, 0x200),
            chunk(0x1000_0200, 0x200),
            chunk(0x2000_0000, 0x200),
        ];
        assert_eq!(
            bytes_per_device(&allocs, &chunks),
            vec![(0, 0x400), (1, 0x200)]
        );
    }
}
