//! `gpusnap recover PID`: brings a process back to running with its GPU data after a dump was
//! cut short (CRIU killed, the machine's operator pressed Ctrl-C twice, ...).
//!
//! Runs outside CRIU, as root. It seizes every thread itself, so the application cannot touch
//! device memory before the data is back, then undoes whatever the dump had done: driver
//! checkpoint → restore, lock → unlock, released memory → reloaded from the image files.

use crate::context::{self, Ctx};
use crate::dump::load_through_agent;
use crate::ptrace::{RunningThread, SeizedProcess};
use gpusnap_cuda::ProcessState;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Returns what was done, or what went wrong and what to do about it.
pub fn recover(pid: i32, images: Option<&Path>) -> Result<String, String> {
    let api = gpusnap_cuda::driver::api().map_err(|e| e.to_string())?;
    api.init().map_err(|e| e.to_string())?;
    let Ok(restore_tid) = api.restore_thread_id(pid) else {
        return Ok(format!("pid {pid} has no CUDA state: nothing to recover"));
    };
    let state = api.process_state(pid).map_err(|e| e.to_string())?;
    let agent_tid = gpusnap_cuda::agent::agent_thread(pid);
    let seized = SeizedProcess::seize(pid).map_err(|e| {
        format!("cannot seize pid {pid} ({e}); is another tracer (CRIU?) still attached?")
    })?;
    let mut done = Vec::new();
    let rt = RunningThread::resume(restore_tid).map_err(|e| e.to_string())?;
    if state == ProcessState::Checkpointed {
        api.restore(pid, &[]).map_err(|e| e.to_string())?;
        done.push("driver restore");
    }
    if matches!(state, ProcessState::Checkpointed | ProcessState::Locked) {
        api.unlock(pid).map_err(|e| e.to_string())?;
        done.push("unlock");
    }
    if let Some(tid) = agent_tid {
        let released = {
            let chan = gpusnap_cuda::agent::connect(pid)
                .map_err(|e| e.to_string())?
                .ok_or("the agent's thread exists but its socket does not answer")?;
            let _agent = RunningThread::resume(tid).map_err(|e| e.to_string())?;
            let cfg = gpusnap_config::load().map_err(|e| e.to_string())?;
            gpusnap_cuda::agent::hello(pid, &chan, cfg.agent_timeout())
                .map_err(|e| e.to_string())?
                .released
        };
        if released {
            let dir = images.ok_or(
                "the agent's memory was released: give the image directory of the interrupted dump (--images DIR)",
            )?;
            reload(pid, tid, dir, api)?;
            done.push("device data reloaded");
        }
    }
    rt.stop().map_err(|e| e.to_string())?;
    drop(seized);
    Ok(if done.is_empty() {
        format!("pid {pid} was {state} with its data in place: nothing to recover")
    } else {
        format!("pid {pid} recovered ({}); it runs again", done.join(", "))
    })
}

fn reload(
    pid: i32,
    agent_tid: i32,
    images: &Path,
    api: &'static gpusnap_cuda::CheckpointApi,
) -> Result<(), String> {
    let dir = std::fs::File::open(images).map_err(|e| format!("{}: {e}", images.display()))?;
    let nspid = gpusnap_cuda::agent::ns_pid(pid).map_err(|e| e.to_string())?;
    let cfg = gpusnap_config::load().map_err(|e| e.to_string())?;
    let ctx = Ctx {
        api,
        lock_timeout_ms: context::lock_timeout_ms(cfg.lock_timeout_ms, None),
        cfg,
        image_dir_fd: dir.as_raw_fd(),
        driver_version: api.driver_version().unwrap_or(0),
        gpus: Vec::new(),
    };
    let m = gpusnap_image::read_manifest(ctx.image_dir(), nspid as u32).map_err(|e| {
        format!("{e}; without an intact manifest for nspid {nspid} the data cannot be reloaded")
    })?;
    load_through_agent(&ctx, pid, agent_tid, ctx.image_dir(), &m)
        .map(|_| ())
        .map_err(|e| e.to_string())
}
