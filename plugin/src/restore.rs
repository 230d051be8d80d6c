//! The restore side: images are validated at `init` (before any process or GPU is touched),
//! then each process gets its control state back from the driver and its data from the agent.

use crate::context::Ctx;
use crate::dump::{DumpError, load_with_agent_running, stop_all};
use crate::gpumap;
use crate::ptrace::RunningThread;
use crate::stall::{self, DriverCall, Watched};
use gpusnap_image::{CheckpointPath, Manifest};
use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::time::Instant;

/// Reads and checks every gpusnap manifest of the image dir: structure, sizes, headers, names.
/// Runs in `init`, so a truncated or foreign image fails the restore before anything is created.
pub fn read_manifests(dir: BorrowedFd<'_>) -> Result<HashMap<u32, Manifest>, String> {
    let mut out = HashMap::new();
    for nspid in gpusnap_image::list_manifests(dir).map_err(|e| e.to_string())? {
        let m = gpusnap_image::read_manifest(dir, nspid).map_err(|e| e.to_string())?;
        out.insert(nspid, m);
    }
    Ok(out)
}

/// The full checksum pass over every data chunk on a thread of its own. On CRIU 4.2+ it starts
/// in POST_FORKING, once CRIU has forked every task (CRIU forks with a raw `clone`, so no thread
/// of ours may be alive before that), overlaps the rest of CRIU's restore, and is joined before
/// any GPU is touched (first RESUME_DEVICES_LATE) or in `exit`. The thread blocks every signal
/// (CRIU's SIGCHLD handler stays on its main thread) and does not log.
pub struct Verification {
    handle: Option<std::thread::JoinHandle<Result<(u64, f64), String>>>,
    /// Whether CRIU's restore went on while the pass ran (POST_FORKING) or waited for it (`init`).
    overlapped: bool,
}

impl Verification {
    pub fn start(dir_fd: i32, manifests: Vec<Manifest>, threads: usize, overlapped: bool) -> Self {
        let handle = std::thread::Builder::new()
            .name("gpusnap-verify".into())
            .spawn(move || {
                crate::datapath::block_signals();
                let t0 = Instant::now();
                // SAFETY: CRIU's image-dir service fd stays open until after `exit`, which joins
                // this thread.
                let dir = unsafe { BorrowedFd::borrow_raw(dir_fd) };
                let mut bytes = 0;
                for m in manifests.iter().filter(|m| !m.chunks.is_empty()) {
                    bytes += gpusnap_image::verify_image(dir, m, threads)
                        .map_err(|e| e.to_string())?
                        .bytes;
                }
                Ok((bytes, t0.elapsed().as_secs_f64()))
            })
            .ok();
        Self { handle, overlapped }
    }

    /// Waits for the pass; `Err` names the damage. Returns the seconds it took.
    pub fn finish(&mut self) -> Result<f64, String> {
        let Some(h) = self.handle.take() else {
            return Ok(0.0);
        };
        let (bytes, secs) = h
            .join()
            .map_err(|_| "the verification thread panicked".to_string())??;
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

fn moved_bytes_on(m: &Manifest, device: u32) -> u64 {
    m.allocations
        .iter()
        .filter(|a| a.moved && a.device == device)
        .map(|a| a.size)
        .sum()
}

/// The GPU plan of every process against the GPUs the kernel driver lists (model and UUID; free
/// memory is checked later, by [`gpu_plan`]), in `init`, before CRIU restores any process. Where
/// the list cannot be read, or cannot speak for the image's GPUs, the check is left to
/// [`gpu_plan`] and `Ok` is returned: MIG instances (CUDA names them `... MIG ...` and gives them
/// their own UUIDs, while the list holds the physical GPUs) and a configured `device_map` (whose
/// targets may be such instances).
pub fn early_gpu_check(
    manifests: &HashMap<u32, Manifest>,
    device_map: &[(String, String)],
) -> Result<(), String> {
    early_gpu_check_in(&crate::host_gpus::proc_dir(), manifests, device_map)
}

/// [`early_gpu_check`] against the listing in `dir`.
fn early_gpu_check_in(
    dir: &std::path::Path,
    manifests: &HashMap<u32, Manifest>,
    device_map: &[(String, String)],
) -> Result<(), String> {
    let mig = manifests
        .values()
        .flat_map(|m| &m.gpus)
        .any(|g| g.name.contains("MIG"));
    if mig || !device_map.is_empty() {
        log::debug!("GPU plan left to the driver (MIG instances or device_map)");
        return Ok(());
    }
    let host = match crate::host_gpus::list(dir) {
        Ok(h) if !h.is_empty() => h,
        Ok(_) => return Ok(()),
        Err(e) => {
            log::debug!("GPU plan left to the driver: {e}");
            return Ok(());
        }
    };
    let mut ms: Vec<&Manifest> = manifests.values().filter(|m| !m.gpus.is_empty()).collect();
    ms.sort_by_key(|m| m.nspid);
    for m in ms {
        plan_against_listing(m, &host, device_map)
            .map_err(|e| format!("nspid {}: {e}", m.nspid))?;
    }
    Ok(())
}

/// [`gpumap::plan`] against the kernel driver's listing. A listed GPU with a UUID of the image is
/// the same physical GPU: it takes the image's model name, so that a difference in how the two
/// sources spell a model can never refuse a restore onto the very GPUs of the dump.
fn plan_against_listing(
    m: &Manifest,
    listed: &[gpumap::HostGpu],
    device_map: &[(String, String)],
) -> Result<Vec<gpumap::Pair>, String> {
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
    gpumap::plan(&m.gpus, &[], &host, device_map)
}

/// Where each GPU of the image goes, checked for model and free memory before anything is
/// touched.
pub fn gpu_plan(ctx: &Ctx, m: &Manifest) -> Result<Vec<gpumap::Pair>, String> {
    let need: Vec<u64> = m
        .gpus
        .iter()
        .map(|g| moved_bytes_on(m, g.ordinal))
        .collect();
    let host: Vec<gpumap::HostGpu> = ctx
        .gpus
        .iter()
        .map(|g| gpumap::HostGpu {
            uuid: g.uuid.clone(),
            name: g.name.clone(),
            free: gpusnap_cuda::nvml::free_memory(&g.uuid),
        })
        .collect();
    let pairs = gpumap::plan(&m.gpus, &need, &host, &ctx.cfg.device_map)?;
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
fn uuid_pairs(
    pairs: &[gpumap::Pair],
) -> Result<Vec<(gpusnap_cuda::GpuUuid, gpusnap_cuda::GpuUuid)>, String> {
    let parse = |text: &str| {
        text.parse::<gpusnap_cuda::GpuUuid>()
            .map_err(|e| format!("cannot restore onto the planned GPUs: {e}"))
    };
    pairs
        .iter()
        .map(|p| Ok((parse(&p.old)?, parse(&p.new)?)))
        .collect()
}

/// Host pids of the restored processes our manifests describe. All restored tasks live in the
/// pid namespace of `any_pid` (a pid CRIU handed us) and are stopped at this point.
pub fn find_restored(any_pid: i32, nspids: &[u32]) -> HashMap<u32, i32> {
    use std::os::unix::fs::MetadataExt;
    let ns_of = |pid: i32| {
        std::fs::metadata(format!("/proc/{pid}/ns/pid"))
            .ok()
            .map(|m| m.ino())
    };
    let want_ns = ns_of(any_pid);
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if ns_of(pid) != want_ns {
            continue;
        }
        if let Ok(nspid) = gpusnap_cuda::agent::ns_pid(pid)
            && nspids.contains(&(nspid as u32))
        {
            out.insert(nspid as u32, pid);
        }
    }
    out
}

/// RESUME_DEVICES_LATE for every GPU process of the image at once: threads are resumed here
/// (CRIU's main thread, the tracer), the driver and data work of each process runs on a worker
/// of its own, and the threads are stopped here again.
pub type Restored = Vec<(i32, Result<serde_json::Value, DumpError>)>;

pub fn resume_all(ctx: &Ctx, items: &[(i32, Manifest)]) -> Restored {
    let t0 = Instant::now();
    let mut results = Vec::new();
    let mut work = Vec::new();
    for (pid, m) in items {
        let planned = gpu_plan(ctx, m).map_err(DumpError::Other);
        match planned.and_then(|pairs| prepare(ctx, *pid, m).map(|t| (pairs, t))) {
            Ok((pairs, threads)) => work.push((*pid, m, pairs, threads)),
            Err(e) => results.push((*pid, Err(e))),
        }
    }
    let calls: Vec<DriverCall> = work.iter().map(|_| DriverCall::default()).collect();
    let watched: Vec<Watched<'_>> = work
        .iter()
        .zip(&calls)
        .map(|((pid, _, _, threads), call)| Watched {
            pid: *pid,
            running: threads.iter().map(RunningThread::tid).collect(),
            call,
        })
        .collect();
    let (outcomes, leftovers) = std::thread::scope(|s| {
        let handles: Vec<_> = work
            .iter()
            .zip(&calls)
            .map(|((pid, m, pairs, _), call)| {
                s.spawn(move || {
                    crate::datapath::block_signals();
                    resume_one(ctx, *pid, m, pairs, call)
                })
            })
            .collect();
        let leftovers = stall::watch(|| handles.iter().all(|h| h.is_finished()), &watched);
        let outcomes: Vec<Result<serde_json::Value, DumpError>> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(DumpError::Other("worker panicked".into())))
            })
            .collect();
        (outcomes, leftovers)
    });
    let n = work.len();
    for (((pid, _, _, threads), r), leftover) in work.into_iter().zip(outcomes).zip(leftovers) {
        let others_stopped = leftover.map_err(DumpError::Other);
        let stopped = stop_all(threads, "stopping a thread after the restore");
        results.push((pid, stopped.and(others_stopped).and(r)));
    }
    if n > 1 {
        log::info!(
            "{n} GPU processes restored in parallel in {:.3} s",
            t0.elapsed().as_secs_f64()
        );
    }
    results
}

/// Resumes the driver's restore thread (and the agent's).
fn prepare(ctx: &Ctx, pid: i32, m: &Manifest) -> Result<Vec<RunningThread>, DumpError> {
    let restore_tid = ctx
        .api
        .restore_thread_id(pid)
        .map_err(|err| DumpError::Driver {
            what: "finding the driver restore thread",
            err,
        })?;
    let run = |tid: i32, what: &'static str| {
        RunningThread::resume(tid).map_err(|err| DumpError::Ptrace { tid, what, err })
    };
    let mut threads = vec![run(restore_tid, "driver restore thread")?];
    if m.path == CheckpointPath::Split && !m.chunks.is_empty() {
        let tid = gpusnap_cuda::agent::agent_thread(pid).ok_or_else(|| {
            DumpError::Other(format!("no gpusnap-agent thread in /proc/{pid}/task"))
        })?;
        threads.push(run(tid, "agent thread")?);
    }
    Ok(threads)
}

/// What a failed `cuCheckpointProcessRestore` is called in a [`DumpError::Driver`].
pub const DRIVER_RESTORE: &str = "driver restore";

/// Control state back from the driver, then the data through the agent. The driver restore
/// runs through `call`, which CRIU's main thread watches ([`stall::watch`]); any thread it let
/// run is stopped again before the unlock. Returns the process's restore timings (for
/// `gpusnap-stats.json`).
fn resume_one(
    ctx: &Ctx,
    pid: i32,
    m: &Manifest,
    pairs: &[gpumap::Pair],
    call: &DriverCall,
) -> Result<serde_json::Value, DumpError> {
    let t0 = Instant::now();
    let driver_pairs = uuid_pairs(pairs).map_err(DumpError::Other)?;
    let (restored, refrozen) = call.run(|| ctx.api.restore(pid, &driver_pairs));
    restored.map_err(|err| DumpError::Driver {
        what: DRIVER_RESTORE,
        err,
    })?;
    refrozen.map_err(DumpError::Other)?;
    let control_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    ctx.api.unlock(pid).map_err(|err| DumpError::Driver {
        what: "driver unlock",
        err,
    })?;
    let unlock_s = t1.elapsed().as_secs_f64();
    let mut data = String::new();
    let mut timings = serde_json::json!({ "control": control_s, "unlock": unlock_s });
    if m.path == CheckpointPath::Split && !m.chunks.is_empty() {
        let stats = load_with_agent_running(ctx, pid, ctx.image_dir(), m)?;
        timings["data"] = serde_json::json!(stats.seconds);
        data = format!(
            ", data {:.3} s ({:.2} GiB, {:.1} GiB/s)",
            stats.seconds,
            stats.bytes as f64 / (1u64 << 30) as f64,
            stats.bytes as f64 / (1u64 << 30) as f64 / stats.seconds.max(1e-9)
        );
    }
    log::info!(
        "pid {pid} (nspid {}): restored ({:?} path): control {control_s:.3} s, unlock {unlock_s:.3} s{data}; total {:.3} s",
        m.nspid,
        m.path,
        t0.elapsed().as_secs_f64()
    );
    timings["total"] = serde_json::json!(t0.elapsed().as_secs_f64());
    Ok(serde_json::json!({
        "nspid": m.nspid,
        "path": if m.path == CheckpointPath::Split { "split" } else { "transparent" },
        "gpu_pairs": pairs.iter().map(|p| format!("{}={}", p.old, p.new)).collect::<Vec<_>>(),
        "timings_s": timings,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpusnap_image::GpuRecord;

    fn manifest(gpus: Vec<GpuRecord>) -> Manifest {
        Manifest {
            format_version: 1,
            nspid: 7,
            path: CheckpointPath::Split,
            created_unix_s: 0,
            gpusnap_version: String::new(),
            driver_version: 0,
            gpus,
            allocations: vec![],
            files: vec![],
            chunks: vec![],
            timings_s: Default::default(),
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

    #[test]
    fn mig_instances_and_device_maps_are_left_to_the_driver() {
        // A listing with one other GPU of another model: a plain image is refused against it,
        // an image of MIG instances or one restored with a device_map is not judged by it.
        let dir = std::env::temp_dir().join(format!("gpusnap-early-check-{}", std::process::id()));
        let bus = dir.join("0000:10:00.0");
        std::fs::create_dir_all(&bus).unwrap();
        std::fs::write(
            bus.join("information"),
            "Model: NVIDIA A100\nGPU UUID: GPU-00000000-0000-0000-0000-0000000000bb\n",
        )
        .unwrap();
        let one = |name: &str| HashMap::from([(7, manifest(vec![gpu(&"a".repeat(32), name)]))]);
        let e = early_gpu_check_in(&dir, &one("NVIDIA H200"), &[]).unwrap_err();
        assert!(e.contains("is not on this host"), "{e}");
        assert!(early_gpu_check_in(&dir, &one("NVIDIA H100 80GB HBM3 MIG 1g.10gb"), &[]).is_ok());
        let map = [("a".repeat(32), "0".repeat(30) + "bb")];
        assert!(early_gpu_check_in(&dir, &one("NVIDIA H200"), &map).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_dumped_gpu_is_never_refused_for_how_the_listing_spells_its_model() {
        let m = manifest(vec![gpu("aa", "NVIDIA H200")]);
        let pairs = plan_against_listing(&m, &[listed("aa", "H200 (as /proc says)")], &[])
            .expect("same GPU");
        assert!(pairs.is_empty(), "{pairs:?}");
    }

    #[test]
    fn another_model_in_the_listing_is_refused_naming_the_gpu() {
        let m = manifest(vec![gpu("aa", "NVIDIA H200")]);
        let e = plan_against_listing(&m, &[listed("bb", "NVIDIA A100")], &[]).unwrap_err();
        assert!(e.contains("GPU aa (NVIDIA H200)"), "{e}");
        let ok = plan_against_listing(&m, &[listed("bb", "NVIDIA H200")], &[]).expect("same model");
        assert_eq!(ok.len(), 1);
        assert_eq!((ok[0].old.as_str(), ok[0].new.as_str()), ("aa", "bb"));
    }

    #[test]
    fn uuid_pairs_refuse_a_bad_uuid_naming_it() {
        use gpusnap_cuda::GpuUuid;
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
        assert!(e.contains("`GPU-12`"), "{e}");
        let e = uuid_pairs(&[pair(&a, "not-a-uuid")]).unwrap_err();
        assert!(e.contains("`not-a-uuid`"), "{e}");
    }
}
