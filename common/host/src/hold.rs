//! Holding a process's application threads so that they cannot run if CRIU (their tracer)
//! dies while their device memory is absent or partly loaded (`docs/design-notes.md`, "Fail
//! closed").
//!
//! ptrace alone holds them only while CRIU lives: when a tracer exits, the kernel detaches its
//! tracees and they run on. Two kernel mechanisms outlive the tracer:
//!
//! - **At dump** ([`Hold`]): a `SIGSTOP` queued to each application thread while it sits in
//!   CRIU's ptrace stop. Nothing happens while it is traced (a stopped tracee dequeues nothing).
//!   Should the tracer die, every thread leaves its ptrace stop into signal handling, dequeues
//!   the `SIGSTOP` before it returns to user space, and the whole process enters a group stop:
//!   held, with its state intact, until `gpusnap recover` reloads its memory and continues it.
//!   When the window closes normally, the tracer drains each queued `SIGSTOP` without letting
//!   the thread run ([`Hold::release`]), so CRIU never sees it (it would dump it as a pending
//!   signal otherwise).
//! - **At restore** ([`kill_if_criu_dies`]): `PTRACE_O_EXITKILL` on the process's threads: if
//!   the tracer dies, the kernel kills the tracee. A half-restored process dies; its image is
//!   intact and a new restore works. CRIU's own detach at the end of the restore drops the
//!   option.
//!
//! Both are set up by CRIU's main thread (the tracer) or, for queueing signals, any thread;
//! neither depends on the agent or on gpusnap winning a race against the application.

use crate::pid::{HostPid, HostTid};
use crate::procfs;
use crate::ptrace::{self, PtraceError};
use std::io;
use std::path::PathBuf;

/// Where a hold records which threads of its process are gpusnap's to run (the driver's restore
/// thread, the agent's). A dying CRIU leaves all threads in one group stop, where the driver
/// cannot answer `gpusnap recover` (its thread is stopped too) and nothing else tells the
/// threads apart. Root-only, in memory, gone at reboot with the processes it names.
pub const RECORD_DIR: &str = "/run/gpusnap";

fn record_path(pid: HostPid) -> PathBuf {
    PathBuf::from(RECORD_DIR).join(format!("held-{pid}"))
}

/// Writes `<start time> <tid>...` for `pid`.
fn write_record(pid: HostPid, running: &[HostTid]) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(RECORD_DIR)?;
    let (_, start) = procfs::state_and_start(pid)?;
    let tids: Vec<String> = running.iter().map(HostTid::to_string).collect();
    std::fs::write(record_path(pid), format!("{start} {}\n", tids.join(" ")))
}

/// The threads a hold of `pid` left to run, if a hold of this very process (same start time)
/// is recorded.
pub fn recorded_running(pid: HostPid) -> Option<Vec<HostTid>> {
    let text = std::fs::read_to_string(record_path(pid)).ok()?;
    let mut words = text.split_whitespace();
    let start: u64 = words.next()?.parse().ok()?;
    if procfs::state_and_start(pid).ok()?.1 != start {
        return None; // another process that got the pid
    }
    words.map(|w| w.parse().ok().map(HostTid)).collect()
}

/// Removes the records of processes that are gone (or whose pid another process now has):
/// nothing can recover them, and a record must not outlive its process. Returns how many went.
pub fn sweep_dead_records() -> usize {
    sweep_dead_records_in(std::path::Path::new(RECORD_DIR))
}

fn sweep_dead_records_in(dir: &std::path::Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("held-"))
            .and_then(|p| p.parse::<i32>().ok().map(HostPid))
        else {
            continue;
        };
        let start = std::fs::read_to_string(e.path())
            .ok()
            .and_then(|t| t.split_whitespace().next()?.parse::<u64>().ok());
        let alive = match (procfs::state_and_start(pid), start) {
            (Ok((state, now)), Some(then)) => now == then && !state.exited(),
            _ => false,
        };
        if !alive && std::fs::remove_file(e.path()).is_ok() {
            log::debug!("removed the hold record of pid {pid}, which is gone");
            removed += 1;
        }
    }
    removed
}

/// Queues a `SIGSTOP` to every thread of `pid` again, without a record: the threads (in our
/// ptrace stops) go back to a group stop once detached. For a process whose memory is released
/// but that `gpusnap recover` cannot bring back: it stays as it was found.
pub fn stop_again(pid: HostPid) -> io::Result<()> {
    for tid in procfs::thread_ids(pid)? {
        // SAFETY: tgkill takes no pointers; it queues SIGSTOP to thread `tid` of `pid` only.
        if unsafe { libc::syscall(libc::SYS_tgkill, pid.get(), tid.get(), libc::SIGSTOP) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e);
            }
        }
    }
    Ok(())
}

fn remove_record(pid: HostPid) {
    if let Err(e) = std::fs::remove_file(record_path(pid))
        && e.kind() != io::ErrorKind::NotFound
    {
        log::warn!("pid {pid}: removing its hold record: {e}");
    }
}

/// Application threads of one process with a `SIGSTOP` queued by us.
#[derive(Debug)]
#[must_use = "a hold is released by the tracer, or kept on purpose with Hold::keep"]
pub struct Hold {
    pid: HostPid,
    tids: Vec<HostTid>,
}

impl Hold {
    /// Queues a `SIGSTOP` to every thread of `pid` except `running` (the threads gpusnap lets
    /// run: the driver's restore thread, the agent's). The threads must be in a ptrace stop.
    pub fn place(pid: HostPid, running: &[HostTid]) -> io::Result<Self> {
        let mut hold = Self {
            pid,
            tids: Vec::new(),
        };
        sweep_dead_records();
        if let Err(e) = write_record(pid, running) {
            log::warn!(
                "pid {pid}: cannot record its hold in {RECORD_DIR} ({e}); should CRIU die, `gpusnap recover` cannot tell its threads apart"
            );
        }
        for tid in procfs::thread_ids(pid)? {
            if running.contains(&tid) {
                continue;
            }
            // SAFETY: tgkill takes no pointers; it queues SIGSTOP to thread `tid` of `pid`
            // only (a tid reused by another process meanwhile is refused by the tgid check).
            if unsafe { libc::syscall(libc::SYS_tgkill, pid.get(), tid.get(), libc::SIGSTOP) } != 0
            {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ESRCH) {
                    continue; // exited meanwhile
                }
                // The threads already held stay held: fail closed.
                hold.keep();
                return Err(io::Error::new(
                    e.kind(),
                    format!("queueing SIGSTOP to thread {tid}: {e}"),
                ));
            }
            hold.tids.push(tid);
        }
        log::debug!(
            "pid {pid}: {} application threads held should CRIU die",
            hold.tids.len()
        );
        Ok(hold)
    }

    /// Drains the queued `SIGSTOP` of every held thread without letting it run; only the
    /// tracer may call this. On failure the remaining threads stay held (and the error says
    /// which one failed).
    pub fn release(mut self) -> Result<(), PtraceError> {
        while let Some(&tid) = self.tids.last() {
            if sigstop_pending(self.pid, tid) {
                ptrace::drain_sigstop(tid)?;
            }
            self.tids.pop();
        }
        remove_record(self.pid);
        Ok(())
    }

    /// Leaves the threads held: the process stays stopped (once untraced) until `gpusnap
    /// recover` continues it.
    pub fn keep(mut self) {
        if !self.tids.is_empty() {
            log::warn!(
                "pid {}: its {} application threads stay held (SIGSTOP queued): once CRIU lets go of it, it is stopped until `gpusnap recover {}` brings it back",
                self.pid,
                self.tids.len(),
                self.pid
            );
        }
        self.tids.clear();
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        // Dropped without a decision (an early return): the threads stay held, which is the
        // safe side; say so.
        if !self.tids.is_empty() {
            log::warn!(
                "pid {}: {} application threads left held (SIGSTOP queued)",
                self.pid,
                self.tids.len()
            );
        }
    }
}

/// Whether thread `tid` of `pid` is held (a `SIGSTOP` is queued to it).
pub fn is_held(pid: HostPid, tid: HostTid) -> bool {
    sigstop_pending(pid, tid)
}

/// Whether `SIGSTOP` is queued to thread `tid` of `pid` (its `SigPnd` mask).
fn sigstop_pending(pid: HostPid, tid: HostTid) -> bool {
    procfs::pending_signals(pid, tid).is_ok_and(|mask| mask & (1 << (libc::SIGSTOP - 1)) != 0)
}

/// Makes the kernel kill `pid` should CRIU (the tracer of its threads) die: `PTRACE_O_EXITKILL`
/// on each of its threads but `running` (threads that gpusnap resumes get their options reset;
/// one tracee killed takes the whole process with it). Only the tracer may call this.
pub fn kill_if_criu_dies(pid: HostPid, running: &[HostTid]) -> Result<(), PtraceError> {
    let tids = procfs::thread_ids(pid).map_err(PtraceError::on(pid.into(), "listing threads"))?;
    for tid in tids.into_iter().filter(|t| !running.contains(t)) {
        ptrace::set_exit_kill(tid)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record of a process that is gone is removed; a record of a live one (same start
    /// time) stays; one whose pid a newer process has is removed.
    #[test]
    fn records_of_dead_jobs_are_swept() {
        let dir = std::env::temp_dir().join(format!("gpusnap-hold-sweep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = HostPid(child.id() as i32);
        child.wait().unwrap();
        let me = HostPid(std::process::id() as i32);
        let (_, start) = procfs::state_and_start(me).unwrap();
        std::fs::write(dir.join(format!("held-{dead}")), "12345 1 2\n").unwrap();
        std::fs::write(dir.join(format!("held-{me}")), format!("{start} 1\n")).unwrap();
        let parent = HostPid(std::os::unix::process::parent_id() as i32);
        std::fs::write(dir.join(format!("held-{parent}")), "1 1\n").unwrap();
        std::fs::write(dir.join("unrelated"), "x").unwrap();
        assert_eq!(sweep_dead_records_in(&dir), 2);
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, vec![format!("held-{me}"), "unrelated".to_owned()]);
        let _ = std::fs::remove_dir_all(&dir);
    }
    use crate::procfs::ProcState;
    use crate::ptrace::SeizedProcess;
    use std::time::{Duration, Instant};

    fn state(pid: HostPid) -> Option<ProcState> {
        let text = procfs::stat_text(pid, None).unwrap_or_default();
        procfs::Stat::parse(&text).and_then(|s| s.state())
    }

    /// Waits until `pid` is in `want` (a stat state letter), or a second passes.
    fn settles_in(pid: HostPid, want: ProcState) -> bool {
        let deadline = Instant::now() + Duration::from_secs(1);
        while Instant::now() < deadline {
            if state(pid) == Some(want) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    fn sleeper() -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep")
    }

    /// Seizes `pid` on a thread of its own, runs `f` there and lets the thread (the tracer) end
    /// without detaching, as a dying CRIU would.
    fn tracer_dies_after(pid: HostPid, f: impl FnOnce() + Send) {
        std::thread::scope(|s| {
            s.spawn(|| {
                let seized = SeizedProcess::seize(pid).expect("seize (root or parent)");
                f();
                std::mem::forget(seized);
            });
        });
    }

    #[test]
    fn a_held_process_stays_stopped_when_its_tracer_dies() {
        let mut child = sleeper();
        let pid = HostPid(child.id() as i32);
        tracer_dies_after(pid, || {
            Hold::place(pid, &[HostTid(4242)]).expect("hold").keep()
        });
        let stopped = settles_in(pid, ProcState::Stopped);
        let seen = state(pid);
        assert_eq!(
            recorded_running(pid),
            Some(vec![HostTid(4242)]),
            "the hold's record"
        );
        remove_record(pid);
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            stopped,
            "held process is in state {seen:?} after its tracer died"
        );
    }

    #[test]
    fn without_a_hold_the_tracers_death_lets_it_run() {
        // The control: what a dying CRIU does today to a process it holds.
        let mut child = sleeper();
        let pid = HostPid(child.id() as i32);
        tracer_dies_after(pid, || {});
        let runs = settles_in(pid, ProcState::Sleeping);
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(runs, "an untraced, unheld sleeper should sleep on");
    }

    #[test]
    fn a_released_hold_leaves_nothing_behind() {
        let mut child = sleeper();
        let pid = HostPid(child.id() as i32);
        tracer_dies_after(pid, || {
            let hold = Hold::place(pid, &[]).expect("hold");
            assert!(sigstop_pending(pid, pid.into()), "SIGSTOP queued");
            assert_eq!(recorded_running(pid), Some(vec![]));
            hold.release().expect("drain the SIGSTOP");
            assert!(!sigstop_pending(pid, pid.into()), "SIGSTOP taken back");
            assert_eq!(recorded_running(pid), None, "record removed");
            assert_eq!(
                state(pid),
                Some(ProcState::TracingStop),
                "still in a ptrace stop after the drain"
            );
        });
        let runs = settles_in(pid, ProcState::Sleeping);
        let seen = state(pid);
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            runs,
            "released process is in state {seen:?}, not sleeping on"
        );
    }

    #[test]
    fn a_stopped_hold_is_taken_over_and_continued_without_running_early() {
        // What `gpusnap recover` does with a process a dying CRIU left held: seize it (still
        // stopped), end the group stop with every thread kept in a ptrace stop, let one thread
        // run, stop it again, and let go: it runs on.
        let mut child = sleeper();
        let pid = HostPid(child.id() as i32);
        tracer_dies_after(pid, || Hold::place(pid, &[]).expect("hold").keep());
        assert!(settles_in(pid, ProcState::Stopped), "held");
        remove_record(pid);
        let outcome = std::thread::scope(|s| {
            s.spawn(|| {
                let seized = SeizedProcess::seize(pid).map_err(|e| format!("seize: {e}"))?;
                seized
                    .end_group_stop()
                    .map_err(|e| format!("end group stop: {e}"))?;
                if state(pid) != Some(ProcState::TracingStop) {
                    return Err(format!(
                        "in state {:?} after SIGCONT, not traced",
                        state(pid)
                    ));
                }
                let th =
                    crate::ptrace::RunningThread::resume(pid.into()).map_err(|e| e.to_string())?;
                let ran = settles_in(pid, ProcState::Sleeping);
                th.stop().map_err(|e| e.to_string())?;
                if !ran {
                    return Err(format!(
                        "resumed thread in state {:?}, not running",
                        state(pid)
                    ));
                }
                drop(seized);
                Ok(())
            })
            .join()
            .expect("tracer thread")
        });
        let runs = settles_in(pid, ProcState::Sleeping);
        let seen = state(pid);
        child.kill().unwrap();
        child.wait().unwrap();
        outcome.unwrap();
        assert!(
            runs,
            "continued process is in state {seen:?}, not sleeping on"
        );
    }

    #[test]
    fn exit_kill_takes_the_process_with_its_tracer() {
        let mut child = sleeper();
        let pid = HostPid(child.id() as i32);
        tracer_dies_after(pid, || kill_if_criu_dies(pid, &[]).expect("set EXITKILL"));
        let deadline = Instant::now() + Duration::from_secs(2);
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break Some(st);
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        if status.is_none() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.and_then(|s| s.signal()),
            Some(libc::SIGKILL),
            "the process should die with its tracer"
        );
    }
}
