//! `gpusnap recover PID`: brings a process back to running with its GPU data after a dump was
//! cut short (CRIU killed, the machine's operator pressed Ctrl-C twice, ...).
//!
//! Runs outside CRIU, as root. It seizes every thread itself, so the application cannot touch
//! device memory before the data is back, finds the process's [`Phase`] from the driver and the
//! agent, and runs the dump's own undo sequence ([`crate::dump::undo`]) on it.

use crate::agent::{self, AgentError, AgentSession};
use crate::context::{self, Ctx, ImageDir};
use crate::dump::{self, DumpError, Target};
use crate::process::{MovedData, Phase};
use crate::{DriverError, ProcessState};
use gpusnap_host::hold;
use gpusnap_host::pid::{HostPid, NsPid, NsTid};
use gpusnap_host::procfs;
use gpusnap_host::ptrace::{self, PtraceError, SeizedProcess};
use gpusnap_image::ImageError;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error(transparent)]
    JobBusy(#[from] gpusnap_host::joblock::JobLockError),
    #[error(transparent)]
    Driver(#[from] DriverError),
    #[error("configuration: {0}")]
    Config(#[from] gpusnap_config::ConfigError),
    #[error("cannot seize pid {pid} ({err}); is another tracer (CRIU?) still attached?")]
    Seize { pid: HostPid, err: std::io::Error },
    #[error(transparent)]
    Ptrace(#[from] PtraceError),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("the agent's thread exists but its socket does not answer")]
    AgentSilent,
    #[error(
        "the agent's memory was released: give the image directory of the interrupted dump (--images DIR)"
    )]
    NeedImages,
    #[error("{}: {err}", dir.display())]
    ImageDir { dir: PathBuf, err: std::io::Error },
    #[error("{err}; without an intact manifest for nspid {nspid} the data cannot be reloaded")]
    Manifest { nspid: NsPid, err: ImageError },
    #[error(transparent)]
    Undo(#[from] DumpError),
    #[error(
        "pid {pid} maps {unmapped} CUDA IPC shares of other processes' memory that the dump unmapped, and they could not be mapped again ({why}): it is held locked by the driver (its CUDA calls wait). Recover the exporting process first and run recover again, or restore the process tree from its image (criu restore), or kill it"
    )]
    ImportsUnmapped {
        pid: HostPid,
        unmapped: usize,
        why: String,
    },
    #[error(
        "pid {pid} maps {unmapped} CUDA IPC shares of other processes' memory that the dump unmapped, and they could not be mapped again ({why}); the driver lock failed too ({lock}), so it is left stopped (SIGSTOP): do not continue it. Recover the exporting process first and run recover again, or restore the process tree from its image (criu restore), or kill it"
    )]
    ImportsUnmappedStopped {
        pid: HostPid,
        unmapped: usize,
        why: String,
        lock: String,
    },
    #[error(
        "pid {pid} is stopped with its GPU memory released (its agent says so), and the record of gpusnap's hold in {} is lost, so its threads cannot be told apart: it is left stopped. Do not continue it (it would run without its GPU memory). The interrupted dump left no usable image: restore an earlier complete checkpoint of the job if there is one (criu restore), or kill it",
        hold::RECORD_DIR
    )]
    StoppedReleased { pid: HostPid },
    #[error(
        "pid {pid} runs with its GPU memory released and unlocked: it ran on after its memory went away, so an image of before would be reloaded under a job that moved on; its results since are not to be trusted: restore it from its image (criu restore), or kill it"
    )]
    MovedOn { pid: HostPid },
    #[error("ending the group stop of pid {pid} (SIGCONT) failed: {err}")]
    Continue { pid: HostPid, err: std::io::Error },
}

/// A stopped process without a hold record: asks its agent (the one thread found by name)
/// whether its memory is released. Released: every thread is stopped again (it stays as it was
/// found) and the answer is [`RecoverError::StoppedReleased`]. In place (or no agent, so
/// gpusnap never released it): the group stop ends and the process is let go, `Ok`.
fn stopped_without_record(pid: HostPid) -> Result<(), RecoverError> {
    let cfg = gpusnap_config::load()?;
    let s = SeizedProcess::seize(pid).map_err(|err| RecoverError::Seize { pid, err })?;
    s.end_group_stop()
        .map_err(|err| RecoverError::Continue { pid, err })?;
    let asked = match agent::agent_thread(pid) {
        Some(tid) => ptrace::resume(tid, "agent thread")
            .map_err(RecoverError::from)
            .and_then(|agent| {
                let hello = AgentSession::connect(pid, cfg.agent_timeout())?
                    .ok_or(RecoverError::AgentSilent)?
                    .hello();
                drop(agent);
                Ok(hello?.released)
            }),
        None => Ok(false),
    };
    // Anything but a clear "in place" keeps it stopped.
    if !matches!(asked, Ok(false)) {
        if let Err(e) = hold::stop_again(pid) {
            log::error!("pid {pid}: stopping it again failed ({e}); it must not run: kill it");
        }
        drop(s);
        return Err(asked.err().unwrap_or(RecoverError::StoppedReleased { pid }));
    }
    drop(s);
    Ok(())
}

/// Returns what was done, or what went wrong and what to do about it.
pub fn recover(pid: HostPid, images: Option<&Path>) -> Result<String, RecoverError> {
    // Never beside a dump or pre-copy of the same job (gpusnap_host::joblock): a live dump's
    // rollback and this recovery would undo the same phases twice.
    let _job_lock = gpusnap_host::joblock::JobLock::take(pid)?;
    let api = crate::driver::api()?;
    api.init()?;
    // A hold of a dump whose CRIU died leaves the process in a group stop, where the driver
    // cannot answer (its own thread in the process is stopped too): take the process over
    // first, end the stop with every thread kept in our ptrace stops, and let the threads the
    // hold recorded as gpusnap's run for the driver's questions.
    hold::sweep_dead_records();
    let stopped = procfs::state_and_start(pid)
        .map_err(|err| AgentError::Proc { pid, err })?
        .0
        == procfs::ProcState::Stopped;
    let mut seized = None;
    let mut for_questions = Vec::new();
    if stopped {
        let Some(running) = hold::recorded_running(pid) else {
            // No record: ask the job itself. Released memory keeps it stopped; memory in
            // place lets it go (the driver lock, if any, still holds its GPU calls) and
            // recovers it as a job that runs.
            stopped_without_record(pid)?;
            return recover(pid, images);
        };
        let s = SeizedProcess::seize(pid).map_err(|err| RecoverError::Seize { pid, err })?;
        s.end_group_stop()
            .map_err(|err| RecoverError::Continue { pid, err })?;
        for tid in running {
            for_questions.push(ptrace::resume(tid, "a thread of gpusnap's hold")?);
        }
        seized = Some(s);
    }
    let Ok(restore_tid) = api.restore_thread_id(pid) else {
        return Ok(format!("pid {pid} has no CUDA state: nothing to recover"));
    };
    let state = api.process_state(pid)?;
    ptrace::stop_all(
        for_questions,
        "stopping a thread after the driver's answers",
    )?;
    let agent_tid = agent::agent_thread(pid);
    let cfg = gpusnap_config::load()?;
    let seized = match seized {
        Some(s) => s,
        None => SeizedProcess::seize(pid).map_err(|err| RecoverError::Seize { pid, err })?,
    };
    let restore_thread = ptrace::resume(restore_tid, "driver restore thread")?;
    let (released, kept) = match agent_tid {
        Some(tid) => {
            let _agent = ptrace::resume(tid, "agent thread")?;
            let h = AgentSession::connect(pid, cfg.agent_timeout())?
                .ok_or(RecoverError::AgentSilent)?
                .hello()?;
            (h.released, h.kept > 0)
        }
        None => (false, false),
    };
    if released && !stopped && state == ProcessState::Running {
        return Err(RecoverError::MovedOn { pid });
    }
    // Memory lent at a hand-over is still the job's (it kept the descriptors): it is mapped
    // back without any file.
    if released && !kept && images.is_none() {
        return Err(RecoverError::NeedImages);
    }
    // Only a reload reads the image directory (memory lent is mapped back without it, but a
    // process may have copied a part out first); without one, the root stands in.
    let dir = images.unwrap_or(Path::new("/"));
    let fd = std::fs::File::open(dir).map_err(|err| RecoverError::ImageDir {
        dir: dir.to_owned(),
        err,
    })?;
    let ctx = Ctx {
        api,
        lock_timeout_ms: context::lock_timeout_ms(cfg.lock_timeout_ms, None),
        cfg,
        image_dir: ImageDir::Opened(fd.into()),
        driver_version: api.driver_version().unwrap_or(0),
        gpus: Vec::new(),
    };
    let nspid = || procfs::ns_pid(pid).map_err(|err| AgentError::Proc { pid, err });
    let moved = if released && kept {
        Some(MovedData {
            manifest: Box::new(dump::manifest_of(
                nspid()?,
                gpusnap_image::CheckpointPath::Split,
                (0, &[]),
                Vec::new(),
                &crate::datapath::DumpData::default(),
            )),
            stats: None,
            // The part copied out first, if the dump had one and the image has its manifest:
            // reloaded once the lent memory is mapped back.
            lent: Some(Box::new(crate::handover::Lent::found_kept(
                images
                    .and_then(|_| gpusnap_image::read_manifest(ctx.image_dir(), nspid().ok()?).ok())
                    .filter(|m| m.allocations.iter().any(|a| a.moved)),
            ))),
        })
    } else if released {
        let nspid = nspid()?;
        let manifest = gpusnap_image::read_manifest(ctx.image_dir(), nspid)
            .map_err(|err| RecoverError::Manifest { nspid, err })?;
        Some(MovedData {
            manifest: Box::new(manifest),
            stats: None,
            lent: None,
        })
    } else {
        None
    };
    let mut phase = Phase::found(state, moved);
    let target = Target {
        pid,
        restore_tid,
        // Whatever it was before the dump, it ran: it runs again.
        initial: ProcessState::Running,
        agent_tid: &|| {
            agent_tid.ok_or(AgentError::NoThread {
                pid,
                ns_tid: NsTid(-1),
            })
        },
        before_running: &|| Ok(()),
    };
    let mut hold = None;
    let done = dump::undo(&ctx, &target, &mut phase, &mut hold)?;
    // The program's own descriptors of memory it exported with cuMemExportToShareableHandle
    // name its memory as it is now (new, if it was brought back).
    let me = crate::sharing::Process {
        pid,
        nspid: nspid()?,
    };
    crate::sharing::repoint(me, ctx.agent_timeout(), None).map_err(DumpError::from)?;
    // Its own memory is back; shares of other processes' memory that the dump unmapped are
    // mapped again from their exporters, which must run with their memory (recovered first).
    // Where that fails its CUDA calls are held by the lock.
    let unmapped =
        crate::sharing::unmapped_imports(pid, ctx.agent_timeout()).map_err(DumpError::from)?;
    let mut done = done;
    if unmapped > 0 {
        // Its namespace pid is its host pid: its pid namespace is ours.
        let same_ns = me.nspid.get() as i32 == pid.get();
        let fetch = crate::sharing::from_running(same_ns, ctx.agent_timeout());
        match crate::sharing::reimport(me, &fetch, ctx.agent_timeout(), None) {
            Ok(_) => done.push("CUDA IPC shares mapped again"),
            Err(e) => {
                // Held by the lock, its CUDA calls wait; without it, it stays stopped when we
                // let go, never running on the unmapped imports.
                if let Err(lock) = api.lock(pid, ctx.lock_timeout_ms) {
                    gpusnap_host::hold::stop_again(pid).map_err(PtraceError::on(
                        pid.into(),
                        "stopping the process again (SIGSTOP)",
                    ))?;
                    return Err(RecoverError::ImportsUnmappedStopped {
                        pid,
                        unmapped,
                        why: e.to_string(),
                        lock: lock.to_string(),
                    });
                }
                return Err(RecoverError::ImportsUnmapped {
                    pid,
                    unmapped,
                    why: e.to_string(),
                });
            }
        }
    }
    restore_thread.stop().map_err(PtraceError::on(
        restore_tid,
        "stopping the driver restore thread",
    ))?;
    drop(seized);
    Ok(if done.is_empty() {
        format!("pid {pid} was {state} with its data in place: nothing to recover")
    } else {
        format!("pid {pid} recovered ({}); it runs again", done.join(", "))
    })
}

#[cfg(test)]
mod tests {
    use super::RecoverError;

    /// An interrupted dump has no usable image: the advice for a job whose hold record is lost
    /// must not send the user to it (it once said "restore it from its image").
    #[test]
    fn a_lost_hold_record_does_not_point_at_the_interrupted_dumps_image() {
        let text = RecoverError::StoppedReleased {
            pid: gpusnap_host::pid::HostPid(7),
        }
        .to_string();
        assert!(!text.contains("restore it from its image"), "{text}");
        assert!(text.contains("no usable image"), "{text}");
        assert!(text.contains("Do not continue it"), "{text}");
    }
}
