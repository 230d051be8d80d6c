//! The dump side, per process: PAUSE (lock, choose the path), CHECKPOINT (move data, release,
//! driver checkpoint of control state) and the rollback that `exit` runs on `-R` or failure.

use crate::context::Ctx;
use crate::datapath::{self, DataError};
use crate::process::{DataPath, DriverStage, SplitState, Tracked};
use crate::ptrace::RunningThread;
use crate::staging::Staging;
use crate::stall::{self, DriverCall, Watched};
use gpusnap_config::Mode;
use gpusnap_cuda::agent::{self, AgentError};
use gpusnap_cuda::{DriverError, ProcessState};
use gpusnap_image::{AllocationRecord, CheckpointPath, Manifest};
use gpusnap_proto::{AllocKind, Channel, Reply, Request};
use std::os::fd::BorrowedFd;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error("{what}: {err}")]
    Driver {
        what: &'static str,
        err: DriverError,
    },
    #[error("{0}")]
    Agent(#[from] AgentError),
    #[error("split data path: {0}")]
    Data(#[from] DataError),
    #[error("ptrace on thread {tid} ({what}): {err}")]
    Ptrace {
        tid: i32,
        what: &'static str,
        err: std::io::Error,
    },
    #[error("{0}")]
    Other(String),
}

fn driver(what: &'static str) -> impl FnOnce(DriverError) -> DumpError {
    move |err| DumpError::Driver { what, err }
}

fn run_thread(tid: i32, what: &'static str) -> Result<RunningThread, DumpError> {
    RunningThread::resume(tid).map_err(|err| DumpError::Ptrace { tid, what, err })
}

/// PAUSE_DEVICES: the process still runs. `Ok(None)`: not a CUDA process.
pub fn pause(ctx: &Ctx, pid: i32) -> Result<Option<Tracked>, DumpError> {
    let Ok(restore_tid) = ctx.api.restore_thread_id(pid) else {
        return Ok(None);
    };
    let initial = ctx
        .api
        .process_state(pid)
        .map_err(driver("reading the driver state"))?;
    let nspid = agent::ns_pid(pid)?;
    let mut t = Tracked {
        pid,
        nspid,
        restore_tid,
        initial,
        driver: DriverStage::Running,
        path: DataPath::Transparent,
        agent: false,
        timings: Vec::new(),
    };
    // The agent is asked while the process runs; the connection is closed again before CRIU
    // seizes it (the process must hold no socket to CRIU when its files are dumped).
    let hello = match agent::connect(pid).and_then(|c| {
        c.map(|chan| agent::hello(pid, &chan, ctx.agent_timeout()))
            .transpose()
    }) {
        Ok(h) => h,
        Err(e) => {
            log::warn!(
                "pid {pid}: the gpusnap agent is there but unusable ({e}); using the driver path"
            );
            None
        }
    };
    t.agent = hello.is_some();
    if let Some(cause) = unsupported_state(pid, hello.as_ref()) {
        return Err(DumpError::Other(format!(
            "cannot be checkpointed: it uses {cause}, which the NVIDIA driver's checkpoint does not support. \
             Nothing was done; the process keeps running"
        )));
    }
    if initial == ProcessState::Running && ctx.cfg.mode == Mode::Auto {
        match hello.map(|h| split_candidate(pid, h)).transpose() {
            Ok(Some(Some(split))) => t.path = DataPath::Split(split),
            Ok(_) => {}
            Err(e) => log::warn!("pid {pid}: {e}; using the driver path"),
        }
    }
    if initial == ProcessState::Running {
        let t0 = Instant::now();
        if let Err(err) = ctx.api.lock(pid, ctx.lock_timeout_ms) {
            if crate::criu::alarm_timeouted() {
                log::error!("pid {pid}: CRIU's timeout fired while locking the GPU state");
            }
            // A lock that reported failure but took effect must not stay (the process still
            // runs here, so no thread needs resuming).
            if ctx.api.process_state(pid).ok() == Some(ProcessState::Locked)
                && let Err(e) = ctx.api.unlock(pid)
            {
                log::error!("pid {pid}: unlocking after the failed lock failed too: {e}");
            }
            return Err(DumpError::Other(format!(
                "locking the CUDA state of pid {pid} failed ({err}) within {} ms; the process keeps running unlocked. \
                 A long-running kernel or a blocking CUDA call prevents the lock: retry, or raise CRIU's --timeout \
                 or gpusnap's lock_timeout_ms",
                ctx.lock_timeout_ms
            )));
        }
        t.driver = DriverStage::Locked;
        t.time("lock", t0.elapsed().as_secs_f64());
    }
    let path = match &t.path {
        DataPath::Split(s) => format!(
            "split (the agent holds {} allocations, {:.2} GiB converted)",
            s.allocations_at_pause,
            gib(s.converted_bytes_at_pause)
        ),
        DataPath::Transparent => "transparent (driver checkpoint)".to_string(),
    };
    log::info!(
        "pid {pid} (nspid {nspid}): CUDA state found, restore thread {restore_tid}, driver state {initial}, path {path}; {}",
        t.timings_line()
    );
    Ok(Some(t))
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// State the driver cannot checkpoint, named, or `None`. The agent records managed memory,
/// CUDA IPC and peer access as they happen; an MPS daemon of the process's user makes its CUDA
/// processes MPS clients.
fn unsupported_state(pid: i32, hello: Option<&agent::AgentHello>) -> Option<String> {
    if let Some((daemon, daemon_pid)) = mps_daemon_of_user(pid) {
        return Some(format!(
            "CUDA MPS ({daemon}, pid {daemon_pid}, runs for its user)"
        ));
    }
    let causes = gpusnap_proto::hazard::describe(hello?.hazards);
    (!causes.is_empty()).then(|| causes.join(", and "))
}

/// A live MPS process (control daemon or server) with the uid of `pid`: its name and pid.
fn mps_daemon_of_user(pid: i32) -> Option<(String, i32)> {
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata(format!("/proc/{pid}")).ok()?.uid();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let p: i32 = e.file_name().to_str()?.parse().ok()?;
        if e.metadata().ok()?.uid() != uid {
            return None;
        }
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        if !is_live_mps_process(&stat) {
            return None;
        }
        // The command name in stat is cut at 15 characters; the full one is in cmdline.
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let argv0 = cmdline.split(|&b| b == 0).next().unwrap_or_default();
        let name = String::from_utf8_lossy(argv0.rsplit(|&b| b == b'/').next().unwrap_or_default());
        Some((
            if name.is_empty() {
                "nvidia-cuda-mps".into()
            } else {
                name.into_owned()
            },
            p,
        ))
    })
}

/// Whether a `/proc/<pid>/stat` text is an MPS process (`nvidia-cuda-mps-control` or
/// `-server`, cut to 15 characters) that still runs: an exited one its parent has not reaped
/// yet (state Z or X) serves no client.
fn is_live_mps_process(stat: &str) -> bool {
    let comm = stat
        .find('(')
        .zip(stat.rfind(')'))
        .and_then(|(open, close)| stat.get(open + 1..close));
    let state = crate::stall::state_of(stat);
    comm.is_some_and(|c| c.starts_with("nvidia-cuda-mps"))
        && state.is_some_and(|s| s != "Z" && s != "X")
}

/// Whether the agent's answer makes the process a split-path candidate.
fn split_candidate(pid: i32, hello: agent::AgentHello) -> Result<Option<SplitState>, DumpError> {
    if hello.released {
        return Err(DumpError::Other(
            "the agent reports its memory as released (an earlier dump did not finish?)".into(),
        ));
    }
    if hello.converted_bytes == 0 {
        log::debug!("pid {pid}: agent holds no converted allocations; driver path");
        return Ok(None);
    }
    Ok(Some(SplitState {
        agent_ns_tid: hello.ns_tid,
        allocations_at_pause: hello.allocations,
        converted_bytes_at_pause: hello.converted_bytes,
        ..SplitState::default()
    }))
}

/// CHECKPOINT_DEVICES for every tracked process at once (CRIU calls the hook per pid, but all
/// PAUSEs come first, so the whole set is known). ptrace requests must come from CRIU's main
/// thread, so: threads are resumed here, the driver and data work of each process runs on a
/// worker of its own, in parallel, and the threads are stopped here again.
pub fn checkpoint_all(ctx: &Ctx, procs: &mut [Tracked]) -> Vec<(i32, Result<(), DumpError>)> {
    let t0 = Instant::now();
    if let Some(warning) = ipc_blind_spot(procs) {
        log::warn!("{warning}");
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
    let watched: Vec<Watched<'_>> = work
        .iter()
        .zip(&calls)
        .map(|((t, th), call)| Watched {
            pid: t.pid,
            running: th.iter().map(RunningThread::tid).collect(),
            call,
        })
        .collect();
    let (outcomes, leftovers) = std::thread::scope(|s| {
        let handles: Vec<_> = work
            .iter_mut()
            .zip(&calls)
            .map(|((t, _), call)| {
                s.spawn(move || {
                    datapath::block_signals();
                    let r = checkpoint_one(ctx, t, call);
                    (t.pid, r)
                })
            })
            .collect();
        let leftovers = stall::watch(|| handles.iter().all(|h| h.is_finished()), &watched);
        let outcomes: Vec<(i32, Result<(), DumpError>)> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| (0, Err(DumpError::Other("worker panicked".into()))))
            })
            .collect();
        (outcomes, leftovers)
    });
    for (((t, threads), (pid, r)), leftover) in work.into_iter().zip(outcomes).zip(leftovers) {
        let others_stopped = leftover.map_err(DumpError::Other);
        let stopped = stop_all(threads, "stopping a thread after the checkpoint");
        if r.is_ok() {
            log::info!("pid {}: dump phases: {}", t.pid, t.timings_line());
        }
        results.push((pid, r.and(stopped).and(others_stopped)));
    }
    if n > 1 {
        log::info!(
            "{n} GPU processes checkpointed in parallel in {:.3} s",
            t0.elapsed().as_secs_f64()
        );
    }
    results
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
             between them cannot be detected. If they share device memory through CUDA IPC, the \
             driver (before r610) checkpoints them but their restore fails: preload the agent \
             (it refuses such a dump) or use criu dump -R",
            procs.len(),
            blind.join(", ")
        )
    })
}

/// Stops threads resumed for a checkpoint or restore again; the first failure is reported.
pub fn stop_all(threads: Vec<RunningThread>, what: &'static str) -> Result<(), DumpError> {
    threads.into_iter().try_for_each(|th| {
        let tid = th.tid();
        th.stop()
            .map_err(|err| DumpError::Ptrace { tid, what, err })
    })
}

/// Resumes the driver's restore thread and, on the split path, the agent thread.
fn run_threads(t: &mut Tracked) -> Result<Vec<RunningThread>, DumpError> {
    let mut threads = vec![run_thread(t.restore_tid, "driver restore thread")?];
    if let DataPath::Split(split) = &t.path {
        match agent::host_tid(t.pid, split.agent_ns_tid)
            .map_err(DumpError::from)
            .and_then(|tid| run_thread(tid, "agent thread"))
        {
            Ok(th) => threads.push(th),
            Err(e) => {
                log::warn!(
                    "pid {}: cannot run the agent thread ({e}); driver path",
                    t.pid
                );
                t.path = DataPath::Transparent;
            }
        }
    }
    Ok(threads)
}

/// The driver and data work of one process; its restore (and agent) thread runs. The driver
/// checkpoint runs through `call`, which CRIU's main thread watches ([`stall::watch`]).
fn checkpoint_one(ctx: &Ctx, t: &mut Tracked, call: &DriverCall) -> Result<(), DumpError> {
    if t.is_split() {
        match move_data_out(ctx, t) {
            Ok(()) => {}
            Err(e) if !t.released() => {
                log::warn!(
                    "pid {}: split path failed before any memory was released ({e}); \
                     falling back to the driver checkpoint of all device memory",
                    t.pid
                );
                remove_partial_files(ctx, t);
                t.path = DataPath::Transparent;
                if t.driver == DriverStage::Running {
                    relock(ctx, t)?;
                }
            }
            Err(e) => return Err(e),
        }
    }
    let t0 = Instant::now();
    t.driver = DriverStage::Checkpointed; // set first: a failed checkpoint is rolled back too
    let (checkpointed, refrozen) = call.run(|| ctx.api.checkpoint(t.pid));
    checkpointed.map_err(driver(
            "driver checkpoint (it fails on state it cannot take: managed memory, CUDA IPC, MPS, GPU peer access)",
        ))?;
    refrozen.map_err(DumpError::Other)?;
    let phase = if t.is_split() {
        "control"
    } else {
        "checkpoint"
    };
    t.time(phase, t0.elapsed().as_secs_f64());
    Ok(())
}

fn relock(ctx: &Ctx, t: &mut Tracked) -> Result<(), DumpError> {
    let t0 = Instant::now();
    ctx.api
        .lock(t.pid, ctx.lock_timeout_ms)
        .map_err(driver("re-locking after the data was moved"))?;
    t.driver = DriverStage::Locked;
    t.time("relock", t0.elapsed().as_secs_f64());
    Ok(())
}

/// The split protocol, with the application stopped and only the agent thread (and the
/// driver's) running: unlock, copy out, release, lock again.
fn move_data_out(ctx: &Ctx, t: &mut Tracked) -> Result<(), DumpError> {
    let pid = t.pid;
    let t0 = Instant::now();
    ctx.api
        .unlock(pid)
        .map_err(driver("unlocking for the agent"))?;
    t.driver = DriverStage::Running;
    t.time("unlock", t0.elapsed().as_secs_f64());

    let chan = agent::connect(pid)?.ok_or_else(|| {
        DumpError::Other("the agent's socket disappeared between PAUSE and CHECKPOINT".into())
    })?;
    let t0 = Instant::now();
    let allocations = list_allocations(ctx, pid, &chan)?;
    let chunks: u64 = allocations
        .iter()
        .filter(|a| a.moved)
        .map(|a| a.size.div_ceil(ctx.slot_size() as u64))
        .sum();
    let staging = Staging::new(ctx.slot_size(), ring_slots(ctx, chunks))
        .map_err(|e| DumpError::Other(format!("creating the staging ring: {e}")))?;
    t.time("prepare", t0.elapsed().as_secs_f64());

    let dir = ctx.image_dir();
    let parent = dedup_parent(ctx, t, &allocations);
    let data = datapath::copy_out(
        &chan,
        &staging,
        dir,
        t.nspid as u32,
        ctx.cfg.effective_writer_threads(),
        ctx.codec(),
        parent.as_ref(),
        ctx.limits(),
    )?;
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
    let per_gpu = bytes_per_device(&allocations, &data.chunks);
    if per_gpu.len() > 1 {
        for (device, bytes) in &per_gpu {
            log::info!(
                "pid {pid}: GPU {device}: {:.2} GiB, {:.1} GiB/s over the data phase",
                gib(*bytes),
                gib(*bytes) / data.seconds.max(1e-9)
            );
        }
    }
    t.time("data", data.seconds);
    if let DataPath::Split(split) = &mut t.path {
        split.allocations = allocations;
        split.data = Some(data);
    }
    // A manifest now, before memory is released: should CRIU die from here on, `gpusnap
    // recover` finds the data. `exit` rewrites it with the final timings.
    gpusnap_image::write_manifest(dir, &manifest_for(ctx, t))
        .map_err(|e| DumpError::Other(format!("writing the manifest: {e}")))?;

    // From the moment Release is sent, some memory may be gone even if the agent then fails
    // part-way: count it as released, so a failure keeps the files and rolls back by reloading.
    if let DataPath::Split(split) = &mut t.path {
        split.released = true;
    }
    let t0 = Instant::now();
    let (n, bytes) = datapath::release(&chan, ctx.agent_timeout())?;
    t.time("release", t0.elapsed().as_secs_f64());
    log::debug!("pid {pid}: agent released {n} allocations ({bytes} bytes)");
    drop(chan);
    relock(ctx, t)
}

/// For an incremental dump: the parent image's chunks this process may reference, if the image
/// directory has a usable `parent` link and `incremental` is on. Anything else is a full dump,
/// with the reason in the log.
fn dedup_parent(
    ctx: &Ctx,
    t: &Tracked,
    allocations: &[AllocationRecord],
) -> Option<gpusnap_image::DedupIndex> {
    use gpusnap_image::ParentImage;
    let found = gpusnap_image::parent_for_dedup(ctx.image_dir(), t.nspid as u32, allocations);
    match found {
        ParentImage::None => None,
        _ if !ctx.cfg.incremental => {
            log::info!(
                "pid {}: the image directory has a parent link, but incremental = false: full dump",
                t.pid
            );
            None
        }
        ParentImage::Unusable(why) => {
            log::info!("pid {}: full dump, parent image not used: {why}", t.pid);
            None
        }
        ParentImage::Usable(index) => {
            log::info!(
                "pid {}: incremental dump against the parent image ({} chunks to compare{})",
                t.pid,
                index.len(),
                if index.too_deep > 0 {
                    format!(
                        ", {} already {} links deep are stored again",
                        index.too_deep,
                        gpusnap_image::MAX_CHAIN_DEPTH
                    )
                } else {
                    String::new()
                }
            );
            Some(index)
        }
    }
}

fn list_allocations(
    ctx: &Ctx,
    pid: i32,
    chan: &Channel,
) -> Result<Vec<AllocationRecord>, DumpError> {
    let hello = agent::hello(pid, chan, ctx.agent_timeout())?;
    if hello.released {
        return Err(DumpError::Other("agent memory already released".into()));
    }
    chan.send_request(&Request::ListAllocations, None)
        .map_err(DataError::from)?;
    let mut out = Vec::new();
    loop {
        match chan
            .recv_reply(Some(ctx.agent_timeout()))
            .map_err(DataError::from)?
        {
            Reply::Allocation {
                id,
                device,
                addr,
                size,
                kind,
            } => out.push(AllocationRecord {
                id,
                device,
                addr,
                size,
                moved: kind == AllocKind::Converted,
            }),
            Reply::AllocationsEnd { .. } => return Ok(out),
            Reply::Error { message, .. } => return Err(DataError::Agent(message).into()),
            other => {
                return Err(DataError::Unexpected(format!("{other:?}"), "Allocation").into());
            }
        }
    }
}

/// Removes this process's gpusnap files (a split attempt that was abandoned, or a failed dump).
pub fn remove_partial_files(ctx: &Ctx, t: &Tracked) {
    if let Err(e) = gpusnap_image::remove_process_files(ctx.image_dir(), t.nspid as u32) {
        log::warn!("pid {}: removing partial image files: {e}", t.pid);
    }
}

/// Puts the process back as it was before the dump (`-R`, or a failed dump). Tasks are still
/// seized by CRIU here.
pub fn rollback(ctx: &Ctx, t: &mut Tracked) -> Result<(), DumpError> {
    let pid = t.pid;
    if t.driver == DriverStage::Running && !t.released() {
        return Ok(());
    }
    let t0 = Instant::now();
    let restore_thread = run_thread(t.restore_tid, "driver restore thread")?;
    // The driver knows best: a call that failed may or may not have changed the state (a
    // checkpoint that failed leaves the process locked, and a restore would then be refused).
    match ctx.api.process_state(pid) {
        Ok(ProcessState::Running) => t.driver = DriverStage::Running,
        Ok(ProcessState::Locked) => t.driver = DriverStage::Locked,
        Ok(ProcessState::Checkpointed) => t.driver = DriverStage::Checkpointed,
        Ok(other) => log::warn!("pid {pid}: the driver reports state {other} during rollback"),
        Err(e) => log::warn!("pid {pid}: cannot read the driver state during rollback: {e}"),
    }
    if t.driver == DriverStage::Checkpointed {
        ctx.api
            .restore(pid, &[])
            .map_err(driver("rollback: driver restore"))?;
        t.driver = DriverStage::Locked;
    }
    if t.released() {
        if t.driver == DriverStage::Locked {
            ctx.api.unlock(pid).map_err(driver("rollback: unlock"))?;
            t.driver = DriverStage::Running;
        }
        if let Err(e) = reload(ctx, t) {
            // Hold the process with the driver lock: its threads must not run on memory that
            // is not back. `gpusnap recover` reloads it from the files later.
            match ctx.api.lock(pid, ctx.lock_timeout_ms) {
                Ok(()) => t.driver = DriverStage::Locked,
                Err(le) => log::error!("pid {pid}: cannot hold the process with the lock: {le}"),
            }
            return Err(e);
        }
    }
    if t.driver == DriverStage::Locked && t.initial == ProcessState::Running {
        ctx.api.unlock(pid).map_err(driver("rollback: unlock"))?;
        t.driver = DriverStage::Running;
    }
    restore_thread.stop().map_err(|err| DumpError::Ptrace {
        tid: t.restore_tid,
        what: "stopping the driver restore thread",
        err,
    })?;
    log::info!(
        "pid {pid}: rolled back to {} in {:.3} s",
        t.initial,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Reloads released memory from the files just written.
fn reload(ctx: &Ctx, t: &mut Tracked) -> Result<(), DumpError> {
    let manifest = manifest_for(ctx, t);
    let DataPath::Split(split) = &t.path else {
        return Ok(());
    };
    let tid = agent::host_tid(t.pid, split.agent_ns_tid)?;
    let stats = load_through_agent(ctx, t.pid, tid, ctx.image_dir(), &manifest)?;
    if let DataPath::Split(s) = &mut t.path {
        s.released = false;
    }
    log::info!(
        "pid {}: device data reloaded ({:.2} GiB in {:.3} s)",
        t.pid,
        gib(stats.bytes),
        stats.seconds
    );
    Ok(())
}

/// Runs only the agent thread and streams `manifest`'s data into re-created memory.
pub fn load_through_agent(
    ctx: &Ctx,
    pid: i32,
    agent_tid: i32,
    dir: BorrowedFd<'_>,
    manifest: &Manifest,
) -> Result<datapath::LoadStats, DumpError> {
    let agent_thread = run_thread(agent_tid, "agent thread")?;
    let stats = load_with_agent_running(ctx, pid, dir, manifest)?;
    agent_thread.stop().map_err(|err| DumpError::Ptrace {
        tid: agent_tid,
        what: "stopping the agent thread",
        err,
    })?;
    Ok(stats)
}

/// Streams `manifest`'s data into re-created memory; the agent thread already runs.
pub fn load_with_agent_running(
    ctx: &Ctx,
    pid: i32,
    dir: BorrowedFd<'_>,
    manifest: &Manifest,
) -> Result<datapath::LoadStats, DumpError> {
    let chan = agent::connect(pid)?
        .ok_or_else(|| DumpError::Other("the agent's socket is gone".into()))?;
    let biggest = manifest.chunks.iter().map(|c| c.len).max().unwrap_or(0) as usize;
    let slot = ctx.slot_size().max(biggest.next_multiple_of(4096));
    let staging = Staging::new(slot, ring_slots(ctx, manifest.chunks.len() as u64))
        .map_err(|e| DumpError::Other(format!("creating the staging ring: {e}")))?;
    let hello = agent::hello(pid, &chan, ctx.agent_timeout())?;
    log::debug!("pid {pid}: agent tid {} ready to load", hello.ns_tid);
    Ok(datapath::copy_in(
        &chan,
        &staging,
        dir,
        manifest,
        ctx.cfg.effective_reader_threads(),
        ctx.limits(),
    )?)
}

/// Ring slots for a transfer of `chunks` chunks: the configured number, but no more than there
/// are chunks (populating and pinning an unused slot costs time for nothing; small processes
/// would otherwise pay for a 512 MiB ring).
fn ring_slots(ctx: &Ctx, chunks: u64) -> usize {
    (ctx.cfg.staging_slots as u64).min(chunks).max(1) as usize
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

/// The manifest of one dumped process (written by `exit` once CRIU has succeeded).
pub fn manifest_for(ctx: &Ctx, t: &Tracked) -> Manifest {
    let (path, allocations, files, chunks) = match &t.path {
        DataPath::Split(s) => {
            let (files, chunks) = s
                .data
                .as_ref()
                .map(|d| (d.files.clone(), d.chunks.clone()))
                .unwrap_or_default();
            (CheckpointPath::Split, s.allocations.clone(), files, chunks)
        }
        DataPath::Transparent => (CheckpointPath::Transparent, vec![], vec![], vec![]),
    };
    Manifest {
        format_version: gpusnap_image::FORMAT_VERSION,
        nspid: t.nspid as u32,
        path,
        created_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        gpusnap_version: gpusnap_image::BUILD.to_owned(),
        driver_version: ctx.driver_version,
        gpus: ctx
            .gpus
            .iter()
            .map(|g| gpusnap_image::GpuRecord {
                ordinal: g.ordinal,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                total_mem: g.total_mem,
            })
            .collect(),
        allocations,
        files,
        chunks,
        timings_s: t.timings.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpusnap_image::{ChunkEntry, Codec};

    #[test]
    fn several_processes_without_the_agent_get_the_ipc_warning() {
        let tracked = |pid, agent| Tracked {
            pid,
            nspid: pid,
            restore_tid: pid + 1,
            initial: ProcessState::Running,
            driver: crate::process::DriverStage::Running,
            path: DataPath::Transparent,
            agent,
            timings: Vec::new(),
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
    fn bytes_are_counted_per_device() {
        let alloc = |id, device, addr, size| AllocationRecord {
            id,
            device,
            addr,
            size,
            moved: true,
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
