//! Letting one seized thread run while CRIU keeps the others stopped.
//!
//! CRIU's main thread is the tracer of every seized task, so only it may issue these requests
//! (all hooks run there). A thread is resumed with every signal but SIGTRAP blocked (so nothing
//! of the application's runs in it but what it was doing) and stopped again with
//! `PTRACE_INTERRUPT`. [`RunningThread`] re-stops on drop, so no error path leaves it running.

use crate::pid::{HostPid, HostTid};
use std::io;

/// A ptrace request on one of the process's threads failed.
#[derive(Debug, thiserror::Error)]
#[error("ptrace on thread {tid} ({what}): {err}")]
pub struct PtraceError {
    pub tid: HostTid,
    pub what: &'static str,
    pub err: io::Error,
}

impl PtraceError {
    /// Maps an `io::Error` of a request on `tid` (doing `what`).
    pub fn on(tid: HostTid, what: &'static str) -> impl FnOnce(io::Error) -> Self {
        move |err| Self { tid, what, err }
    }
}

/// Resumes `tid` (doing `what`, for the error).
pub fn resume(tid: HostTid, what: &'static str) -> Result<RunningThread, PtraceError> {
    RunningThread::resume(tid).map_err(PtraceError::on(tid, what))
}

/// Stops threads resumed for a driver call or a data transfer again; the first failure is
/// reported (the others are still stopped: a dropped [`RunningThread`] stops itself).
pub fn stop_all(threads: Vec<RunningThread>, what: &'static str) -> Result<(), PtraceError> {
    threads.into_iter().try_for_each(|th| {
        let tid = th.tid();
        th.stop().map_err(PtraceError::on(tid, what))
    })
}

const PTRACE_GETSIGMASK: libc::c_uint = 0x420a;
const PTRACE_SETSIGMASK: libc::c_uint = 0x420b;
/// What CRIU sets on seized tasks.
const CRIU_OPTIONS: libc::c_long =
    (libc::PTRACE_O_SUSPEND_SECCOMP | libc::PTRACE_O_TRACESYSGOOD) as _;

/// A request whose `addr` and `data` are plain numbers (no pointer is passed to the kernel).
fn ptrace(req: libc::c_uint, tid: HostTid, addr: usize, data: usize) -> io::Result<libc::c_long> {
    debug_assert!(req != PTRACE_GETSIGMASK && req != PTRACE_SETSIGMASK);
    // SAFETY: for the requests passed here (SEIZE, INTERRUPT, CONT, DETACH, SETOPTIONS)
    // `addr` and `data` are numbers, not pointers; the kernel checks that we trace `tid`.
    let r = unsafe {
        libc::ptrace(
            req,
            tid.get(),
            addr as *mut libc::c_void,
            data as *mut libc::c_void,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// `PTRACE_GETSIGMASK` / `PTRACE_SETSIGMASK`: the kernel reads or writes the 8-byte `mask`.
fn sigmask(req: libc::c_uint, tid: HostTid, mask: &mut u64) -> io::Result<()> {
    debug_assert!(req == PTRACE_GETSIGMASK || req == PTRACE_SETSIGMASK);
    // SAFETY: `mask` is a live, writable u64 and its size is passed as `addr`, as both requests
    // expect; the kernel checks that we trace `tid`.
    let r = unsafe {
        libc::ptrace(
            req,
            tid.get(),
            std::mem::size_of::<u64>() as *mut libc::c_void,
            (mask as *mut u64).cast::<libc::c_void>(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A seized thread that we let run. Dropping it stops it again.
#[derive(Debug)]
pub struct RunningThread {
    tid: HostTid,
    saved_mask: u64,
    stopped: bool,
}

impl RunningThread {
    /// Resumes `tid`, which must be in a ptrace stop of ours.
    pub fn resume(tid: HostTid) -> io::Result<Self> {
        let mut saved: u64 = 0;
        sigmask(PTRACE_GETSIGMASK, tid, &mut saved)?;
        let mut only_trap: u64 = !(1u64 << (libc::SIGTRAP - 1));
        sigmask(PTRACE_SETSIGMASK, tid, &mut only_trap)?;
        ptrace(libc::PTRACE_SETOPTIONS, tid, 0, 0)?;
        if let Err(e) = ptrace(libc::PTRACE_CONT, tid, 0, 0) {
            if let Err(undo) = ptrace(libc::PTRACE_SETOPTIONS, tid, 0, CRIU_OPTIONS as usize)
                .and_then(|_| sigmask(PTRACE_SETSIGMASK, tid, &mut saved))
            {
                log::error!(
                    "thread {tid}: putting back its ptrace options and signal mask: {undo}"
                );
            }
            return Err(e);
        }
        Ok(Self {
            tid,
            saved_mask: saved,
            stopped: false,
        })
    }

    pub fn tid(&self) -> HostTid {
        self.tid
    }

    /// Stops the thread again and puts back what [`Self::resume`] changed.
    pub fn stop(mut self) -> io::Result<()> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> io::Result<()> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        ptrace(libc::PTRACE_INTERRUPT, self.tid, 0, 0)?;
        wait_for_interrupt_stop(self.tid)?;
        ptrace(libc::PTRACE_SETOPTIONS, self.tid, 0, CRIU_OPTIONS as usize)?;
        let mut mask = self.saved_mask;
        sigmask(PTRACE_SETSIGMASK, self.tid, &mut mask)
    }
}

impl Drop for RunningThread {
    fn drop(&mut self) {
        if let Err(e) = self.stop_inner() {
            log::error!("could not stop thread {} again: {e}", self.tid);
        }
    }
}

/// Makes the kernel kill `tid` (and so its process) should its tracer exit, keeping CRIU's
/// options. Only the tracer may call this.
pub fn set_exit_kill(tid: HostTid) -> Result<(), PtraceError> {
    let options = CRIU_OPTIONS | libc::PTRACE_O_EXITKILL as libc::c_long;
    ptrace(libc::PTRACE_SETOPTIONS, tid, 0, options as usize)
        .map(|_| ())
        .map_err(PtraceError::on(tid, "setting PTRACE_O_EXITKILL"))
}

/// Takes a `SIGSTOP` queued to `tid` (a [`crate::hold::Hold`]) out of its queue without letting
/// it run: with every other signal blocked, the thread is continued into the signal's delivery
/// stop, the signal is dropped, and a pending interrupt traps it again before it returns to
/// user space. `tid` must be in a ptrace stop of ours with `SIGSTOP` pending.
pub fn drain_sigstop(tid: HostTid) -> Result<(), PtraceError> {
    let err = PtraceError::on(tid, "taking back a queued SIGSTOP");
    let mut saved: u64 = 0;
    sigmask(PTRACE_GETSIGMASK, tid, &mut saved).map_err(err)?;
    let mut all: u64 = !0;
    sigmask(PTRACE_SETSIGMASK, tid, &mut all).map_err(PtraceError::on(tid, "blocking signals"))?;
    let drained = (|| {
        ptrace(libc::PTRACE_CONT, tid, 0, 0)?;
        wait_for_signal_stop(tid, libc::SIGSTOP)?;
        ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0)?;
        // Continuing with signal 0 drops the SIGSTOP; the interrupt stops the thread again.
        ptrace(libc::PTRACE_CONT, tid, 0, 0)?;
        wait_for_interrupt_stop(tid)
    })();
    let restored = sigmask(PTRACE_SETSIGMASK, tid, &mut saved);
    drained.map_err(PtraceError::on(tid, "taking back a queued SIGSTOP"))?;
    restored.map_err(PtraceError::on(tid, "restoring the signal mask"))
}

/// Waits for the delivery stop of `sig`; an interrupt stop on the way (a trap that was
/// pending) is continued.
fn wait_for_signal_stop(tid: HostTid, sig: i32) -> io::Result<()> {
    for _ in 0..16 {
        let status = wait_stopped(tid)?;
        if status >> 16 == 0 && libc::WSTOPSIG(status) == sig {
            return Ok(());
        }
        ptrace(libc::PTRACE_CONT, tid, 0, 0)?;
    }
    Err(io::Error::other(format!(
        "thread {tid} did not take its signal {sig}"
    )))
}

/// The status of the next stop of traced thread `tid` (EINTR retried).
fn wait_stopped(tid: HostTid) -> io::Result<i32> {
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid on a traced thread with a valid status pointer.
        let r = unsafe { libc::waitpid(tid.get(), &mut status, libc::__WALL) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            return Err(io::Error::other(format!(
                "thread {tid} exited while it was running for gpusnap"
            )));
        }
        if libc::WIFSTOPPED(status) {
            return Ok(status);
        }
    }
}

/// Waits for the `PTRACE_EVENT_STOP` our interrupt causes. A signal-delivery stop on the way
/// (only SIGTRAP can arrive: everything else is blocked) is passed on, and we keep waiting.
fn wait_for_interrupt_stop(tid: HostTid) -> io::Result<()> {
    loop {
        let status = wait_stopped(tid)?;
        if status >> 16 == libc::PTRACE_EVENT_STOP {
            return Ok(());
        }
        let sig = libc::WSTOPSIG(status);
        let pass = if sig == libc::SIGTRAP || sig == (libc::SIGTRAP | 0x80) {
            0
        } else {
            sig
        };
        ptrace(libc::PTRACE_CONT, tid, 0, pass as usize)?;
    }
}

/// Every thread of a process held in a ptrace stop by us (for `gpusnap recover`, which runs
/// outside CRIU). Dropping it detaches, and the threads run on.
pub struct SeizedProcess {
    pid: HostPid,
    tids: Vec<HostTid>,
}

impl SeizedProcess {
    pub fn seize(pid: HostPid) -> io::Result<Self> {
        let mut me = Self {
            pid,
            tids: Vec::new(),
        };
        // Threads may be born while we seize: repeat until a pass finds none new.
        loop {
            let mut new = 0;
            for tid in crate::procfs::thread_ids(pid)? {
                if me.tids.contains(&tid) {
                    continue;
                }
                ptrace(libc::PTRACE_SEIZE, tid, 0, 0)?;
                me.tids.push(tid);
                ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0)?;
                wait_for_interrupt_stop(tid)?;
                new += 1;
            }
            if new == 0 {
                return Ok(me);
            }
        }
    }

    /// Ends a group stop of the process (a [`crate::hold::Hold`] that took effect when its
    /// tracer died) while every thread stays in our ptrace stop: `SIGCONT`, then each thread
    /// takes the trap the kernel queues for a seized tracee on `SIGCONT`, with every signal
    /// blocked, so none runs user code. Afterwards a resumed thread runs as usual.
    pub fn end_group_stop(&self) -> io::Result<()> {
        // SAFETY: kill(2) takes no pointers.
        if unsafe { libc::kill(self.pid.get(), libc::SIGCONT) } != 0 {
            return Err(io::Error::last_os_error());
        }
        for &tid in &self.tids {
            let mut saved: u64 = 0;
            sigmask(PTRACE_GETSIGMASK, tid, &mut saved)?;
            let mut all: u64 = !0;
            sigmask(PTRACE_SETSIGMASK, tid, &mut all)?;
            let settled = ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0)
                .and_then(|_| ptrace(libc::PTRACE_CONT, tid, 0, 0))
                .and_then(|_| wait_for_interrupt_stop(tid));
            let restored = sigmask(PTRACE_SETSIGMASK, tid, &mut saved);
            settled.and(restored)?;
        }
        Ok(())
    }
}

impl Drop for SeizedProcess {
    fn drop(&mut self) {
        for &tid in &self.tids {
            // A thread that exited meanwhile cannot be detached; nothing else can fail here.
            if let Err(e) = ptrace(libc::PTRACE_DETACH, tid, 0, 0)
                && e.raw_os_error() != Some(libc::ESRCH)
            {
                log::error!("detaching thread {tid}: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resuming_an_untraced_thread_fails_cleanly() {
        // We trace nothing; the kernel refuses with ESRCH.
        let me = HostTid(std::process::id() as i32);
        let e = RunningThread::resume(me).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESRCH));
    }
}
