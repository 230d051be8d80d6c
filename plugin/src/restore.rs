//! The restore side: images are validated at `init` (before any process or GPU is touched),
//! then each process gets its control state back from the driver and its data from the agent.

use crate::context::Ctx;
use crate::dump::{DumpError, load_through_agent};
use crate::ptrace::RunningThread;
use gpusnap_config::Config;
use gpusnap_image::{CheckpointPath, Manifest};
use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::time::Instant;

/// Reads and checks every gpusnap manifest of the image dir, and (if configured) every data
/// checksum. Any damage refuses the whole restore.
pub fn validate_images(
    dir: BorrowedFd<'_>,
    cfg: &Config,
) -> Result<HashMap<u32, Manifest>, String> {
    let t0 = Instant::now();
    let nspids = gpusnap_image::list_manifests(dir).map_err(|e| e.to_string())?;
    let mut out = HashMap::new();
    let mut bytes = 0u64;
    for nspid in nspids {
        let m = gpusnap_image::read_manifest(dir, nspid).map_err(|e| e.to_string())?;
        if cfg.verify_before_restore && !m.chunks.is_empty() {
            let r = gpusnap_image::verify_image(dir, &m, cfg.effective_reader_threads())
                .map_err(|e| e.to_string())?;
            bytes += r.bytes;
        }
        out.insert(nspid, m);
    }
    log::info!(
        "images checked: {} processes, {:.2} GiB of data verified in {:.3} s",
        out.len(),
        bytes as f64 / (1u64 << 30) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(out)
}

fn moved_bytes_on(m: &Manifest, device: u32) -> u64 {
    m.allocations
        .iter()
        .filter(|a| a.moved && a.device == device)
        .map(|a| a.size)
        .sum()
}

/// Refuses when a GPU lacks room for the data the agent will re-create on it.
fn check_free_memory(m: &Manifest) -> Result<(), String> {
    for g in &m.gpus {
        let need = moved_bytes_on(m, g.ordinal);
        if need == 0 {
            continue;
        }
        match gpusnap_cuda::nvml::free_memory(&g.uuid) {
            Some(free) if free < need => {
                return Err(format!(
                    "GPU {} ({}, {}) has {:.2} GiB free but the image needs {:.2} GiB: free {:.2} GiB on it and restore again",
                    g.ordinal,
                    g.name,
                    g.uuid,
                    free as f64 / (1u64 << 30) as f64,
                    need as f64 / (1u64 << 30) as f64,
                    (need - free) as f64 / (1u64 << 30) as f64
                ));
            }
            Some(_) => {}
            None => log::warn!(
                "cannot read free memory of GPU {} (NVML unavailable)",
                g.uuid
            ),
        }
    }
    Ok(())
}

/// Host tid of the agent's thread (named `gpusnap-agent`).
fn agent_thread(pid: i32) -> Result<i32, String> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/task")).map_err(|e| e.to_string())?;
    for e in dir.flatten() {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if comm.trim_end() == "gpusnap-agent"
            && let Some(tid) = e.file_name().to_str().and_then(|s| s.parse().ok())
        {
            return Ok(tid);
        }
    }
    Err(format!("no gpusnap-agent thread in /proc/{pid}/task"))
}

fn device_pairs(cfg: &Config) -> Vec<([u8; 16], [u8; 16])> {
    cfg.device_map
        .iter()
        .filter_map(|(a, b)| {
            Some((
                gpusnap_cuda::driver::parse_uuid(a)?,
                gpusnap_cuda::driver::parse_uuid(b)?,
            ))
        })
        .collect()
}

/// RESUME_DEVICES_LATE for one process: every thread is stopped by CRIU.
pub fn resume(ctx: &Ctx, pid: i32, m: &Manifest) -> Result<(), DumpError> {
    let t0 = Instant::now();
    check_free_memory(m).map_err(DumpError::Other)?;
    let restore_tid = ctx
        .api
        .restore_thread_id(pid)
        .map_err(|err| DumpError::Driver {
            what: "finding the driver restore thread",
            err,
        })?;
    let restore_thread = RunningThread::resume(restore_tid).map_err(|err| DumpError::Ptrace {
        tid: restore_tid,
        what: "driver restore thread",
        err,
    })?;
    let t1 = Instant::now();
    ctx.api
        .restore(pid, &device_pairs(&ctx.cfg))
        .map_err(|err| DumpError::Driver {
            what: "driver restore",
            err,
        })?;
    let control_s = t1.elapsed().as_secs_f64();
    let t2 = Instant::now();
    ctx.api.unlock(pid).map_err(|err| DumpError::Driver {
        what: "driver unlock",
        err,
    })?;
    let unlock_s = t2.elapsed().as_secs_f64();
    let mut data = String::new();
    if m.path == CheckpointPath::Split && !m.chunks.is_empty() {
        let tid = agent_thread(pid).map_err(DumpError::Other)?;
        let stats = load_through_agent(ctx, pid, tid, ctx.image_dir(), m)?;
        data = format!(
            ", data {:.3} s ({:.2} GiB, {:.1} GiB/s)",
            stats.seconds,
            stats.bytes as f64 / (1u64 << 30) as f64,
            stats.bytes as f64 / (1u64 << 30) as f64 / stats.seconds.max(1e-9)
        );
    }
    restore_thread.stop().map_err(|err| DumpError::Ptrace {
        tid: restore_tid,
        what: "stopping the driver restore thread",
        err,
    })?;
    log::info!(
        "pid {pid} (nspid {}): restored ({:?} path): control {control_s:.3} s, unlock {unlock_s:.3} s{data}; total {:.3} s",
        m.nspid,
        m.path,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
