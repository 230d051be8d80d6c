//! A driver call (checkpoint or restore) that stops making progress while CRIU holds the
//! application's threads.
//!
//! CRIU calls CHECKPOINT_DEVICES with every thread of the process seized; only the driver's
//! restore thread (and on the split path the agent's) is let run. On the H200 a transparent
//! checkpoint of a PyTorch training job (35 threads, expandable segments) hung there for
//! minutes: the restore thread slept in a futex wait, so the driver waited on something that a
//! stopped thread of the process held or had to do. CUDA calls stay blocked by the driver's
//! lock during the checkpoint, so letting the other threads run cannot change GPU state, and
//! it frees whatever they hold. The [`Watch`] therefore looks for progress (the process's
//! resident memory, which the checkpoint fills with device data, and its CPU time); after
//! [`STALL`] without any, the other threads are let run until the checkpoint returns, then
//! stopped again. A thread or child process born meanwhile would be missing from CRIU's view
//! of the process, so [`Unfrozen::stop`] fails the dump if the set of threads or children
//! changed.
//!
//! The same holds for the driver restore at `RESUME_DEVICES_LATE`: the restored threads are
//! held by CRIU, in the state they were dumped in, locks included. There the threads must be
//! stopped again *before* the worker goes on (unlock, data load), so a worker wraps the driver
//! call in [`DriverCall::run`], which waits until the watcher on CRIU's main thread ([`watch`])
//! has stopped them.

use gpusnap_host::pid::{HostPid, HostTid};
use gpusnap_host::procfs::{self, ProcState, Stat};
use gpusnap_host::ptrace::RunningThread;
use std::collections::BTreeSet;
use std::io;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a driver call may show no progress before the other threads are let run. A false
/// alarm costs a log line and a moment of the application's CPU-only work (threads that reach
/// CUDA meet the driver's lock); it fails the dump only if a thread or child is born meanwhile.
pub const STALL: Duration = Duration::from_secs(3);

/// What moves while a driver call works: resident memory and CPU time of the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    rss_kib: u64,
    cpu_ticks: u64,
}

impl Progress {
    pub fn sample(pid: HostPid) -> Option<Self> {
        let stat = procfs::stat_text(pid, None).ok()?;
        Some(Self {
            rss_kib: procfs::vm_rss_kib(pid).ok()?,
            cpu_ticks: Stat::parse(&stat)?.cpu_ticks()?,
        })
    }
}

/// What an `io::Error` was, kept as values that compare (`io::Error` does not, and
/// [`StallError`] is compared in tests): its kind and, for a failed system call, its errno.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OsError {
    pub kind: io::ErrorKind,
    pub errno: Option<i32>,
}

impl From<&io::Error> for OsError {
    fn from(e: &io::Error) -> Self {
        Self {
            kind: e.kind(),
            errno: e.raw_os_error(),
        }
    }
}

impl From<io::Error> for OsError {
    fn from(e: io::Error) -> Self {
        Self::from(&e)
    }
}

impl std::fmt::Display for OsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.errno {
            Some(n) => write!(f, "{}", io::Error::from_raw_os_error(n)),
            None => write!(f, "{}", self.kind),
        }
    }
}

impl std::error::Error for OsError {}

/// The other threads of a stalled process could not be let run, or stopped again as they were.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StallError {
    #[error("listing the threads of pid {pid}: {err}")]
    List { pid: HostPid, err: OsError },
    #[error("resuming thread {tid}: {err}")]
    Resume { tid: HostTid, err: OsError },
    #[error("stopping thread {tid} again: {err}")]
    Stop { tid: HostTid, err: OsError },
    #[error("releasing the hold on pid {pid}: ptrace on thread {tid} ({what}): {err}")]
    Release {
        pid: HostPid,
        tid: HostTid,
        what: &'static str,
        err: OsError,
    },
    #[error(
        "while its threads ran, pid {pid} changed: threads {threads_before:?} -> {threads_after:?}, \
         children {children_before:?} -> {children_after:?}; CRIU's view of it is stale, so this \
         dump is abandoned (run it again)"
    )]
    Changed {
        pid: HostPid,
        threads_before: BTreeSet<HostTid>,
        threads_after: BTreeSet<HostTid>,
        children_before: BTreeSet<HostPid>,
        children_after: BTreeSet<HostPid>,
    },
}

impl StallError {
    /// Maps the failure of releasing the hold on `pid`.
    fn release(pid: HostPid) -> impl FnOnce(gpusnap_host::ptrace::PtraceError) -> Self {
        move |e| Self::Release {
            pid,
            tid: e.tid,
            what: e.what,
            err: e.err.into(),
        }
    }
}

/// Watches one process's driver call from CRIU's main thread.
#[derive(Debug)]
pub struct Watch {
    pid: HostPid,
    last: Option<Progress>,
    since: Instant,
}

impl Watch {
    pub fn new(pid: HostPid) -> Self {
        Self {
            pid,
            last: Progress::sample(pid),
            since: Instant::now(),
        }
    }

    /// Samples once; true when nothing moved for `STALL`.
    pub fn stalled(&mut self) -> bool {
        let now = Progress::sample(self.pid);
        if now != self.last {
            self.last = now;
            self.since = Instant::now();
            return false;
        }
        self.since.elapsed() >= STALL
    }

    pub fn quiet_for(&self) -> Duration {
        self.since.elapsed()
    }
}

/// Threads and child processes of a process, as `/proc` lists them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Family {
    pub threads: BTreeSet<HostTid>,
    pub children: BTreeSet<HostPid>,
}

impl Family {
    pub fn of(pid: HostPid) -> io::Result<Self> {
        let mut f = Self::default();
        for tid in procfs::thread_ids(pid)? {
            f.threads.insert(tid);
            // A thread may exit meanwhile; its children are then listed by no one, which the
            // comparison after the checkpoint catches as a change.
            if let Ok(children) = procfs::children(pid, tid) {
                f.children.extend(children);
            }
        }
        Ok(f)
    }
}

/// `tid name state wchan` of every thread of `pid` that is not in a ptrace stop, for the log.
pub fn describe_running(pid: HostPid) -> String {
    let Ok(tids) = procfs::thread_ids(pid) else {
        return String::from("(cannot list threads)");
    };
    let mut out = Vec::new();
    for tid in tids {
        let read = |f: &str| procfs::task_file(pid, tid, f).unwrap_or_default();
        let stat = read("stat");
        let state = Stat::parse(&stat).and_then(|s| s.state());
        if state == Some(ProcState::TracingStop) {
            continue;
        }
        let state = state.map_or('?', ProcState::letter);
        let mut line = format!("{tid} {} {state} {}", read("comm"), read("wchan"));
        if let Some(w) = procfs::parse_syscall(&read("syscall")) {
            line.push_str(&describe_wait(pid, &w));
        }
        out.push(line);
    }
    out.join("; ")
}

/// x86_64's futex system call number.
const SYS_FUTEX: u64 = 202;

/// For the log of a stall: where a blocked thread's code is and, for a futex wait, which
/// mapping the futex is in and the word after it (a glibc mutex keeps its owner's tid there).
fn describe_wait(pid: HostPid, w: &procfs::BlockedSyscall) -> String {
    let maps = procfs::maps(pid).unwrap_or_default();
    let place = |a: u64| procfs::mapping_of(&maps, a).unwrap_or_else(|| "?".into());
    let mut s = format!(" syscall {} pc {:#x} in {}", w.nr, w.pc, place(w.pc));
    if w.nr == SYS_FUTEX {
        s.push_str(&format!(" futex {:#x} in {}", w.arg0, place(w.arg0)));
        if let Ok(owner) = procfs::read_u32(pid, w.arg0.wrapping_add(8)) {
            s.push_str(&format!(" (word+8: {owner})"));
        }
    }
    s
}

/// The other threads of a stalled process, let run until the driver call returns.
#[derive(Debug)]
pub struct Unfrozen {
    pid: HostPid,
    before: Family,
    threads: Vec<RunningThread>,
}

impl Unfrozen {
    /// Resumes every thread of `pid` but those in `running` (already resumed by us).
    pub fn start(pid: HostPid, running: &[HostTid]) -> Result<Self, StallError> {
        let before = Family::of(pid).map_err(|e| StallError::List { pid, err: e.into() })?;
        let mut threads = Vec::new();
        for &tid in &before.threads {
            // A thread held for a released memory (a queued SIGSTOP) is not let run: it would
            // stop on the signal, and its tracer would have to drain it first.
            if running.contains(&tid) || gpusnap_host::hold::is_held(pid, tid) {
                continue;
            }
            match RunningThread::resume(tid) {
                Ok(th) => threads.push(th),
                // Dropping `threads` stops the ones already resumed.
                Err(e) => {
                    return Err(StallError::Resume { tid, err: e.into() });
                }
            }
        }
        Ok(Self {
            pid,
            before,
            threads,
        })
    }

    pub fn count(&self) -> usize {
        self.threads.len()
    }

    /// Stops the threads again; an error if the process gained or lost a thread or child
    /// meanwhile (CRIU's list of what to dump would then be wrong).
    pub fn stop(self) -> Result<(), StallError> {
        let Self {
            pid,
            before,
            threads,
        } = self;
        for th in threads {
            let tid = th.tid();
            th.stop()
                .map_err(|e| StallError::Stop { tid, err: e.into() })?;
        }
        let after = Family::of(pid).map_err(|e| StallError::List { pid, err: e.into() })?;
        if after != before {
            return Err(StallError::Changed {
                pid,
                threads_before: before.threads,
                threads_after: after.threads,
                children_before: before.children,
                children_after: after.children,
            });
        }
        Ok(())
    }
}

/// Where a worker is with its driver call, shared with the watcher.
#[derive(Debug, Default)]
enum CallState {
    #[default]
    Outside,
    Inside,
    /// Inside, and the watcher let the other threads run.
    InsideUnfrozen,
    /// The call returned; the worker waits for the watcher to stop the threads again.
    WaitingForStop,
    /// The watcher stopped them (or failed to: the reason).
    Stopped(Result<(), StallError>),
}

/// One process's driver call, watched from CRIU's main thread.
#[derive(Debug, Default)]
pub struct DriverCall {
    state: Mutex<CallState>,
    changed: Condvar,
}

impl DriverCall {
    fn lock(&self) -> MutexGuard<'_, CallState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs the driver call `f` on a worker. If the watcher let the process's other threads run
    /// meanwhile, waits until it has stopped them again, so nothing after the call runs beside
    /// them. The second value is an error if they could not be stopped as they were.
    pub fn run<T>(&self, f: impl FnOnce() -> T) -> (T, Result<(), StallError>) {
        *self.lock() = CallState::Inside;
        let r = f();
        let mut st = self.lock();
        if matches!(*st, CallState::InsideUnfrozen) {
            *st = CallState::WaitingForStop;
            self.changed.notify_all();
            st = self
                .changed
                .wait_while(st, |s| matches!(s, CallState::WaitingForStop))
                .unwrap_or_else(|e| e.into_inner());
        }
        let refrozen = match std::mem::take(&mut *st) {
            CallState::Stopped(r) => r,
            _ => Ok(()),
        };
        (r, refrozen)
    }
}

/// A process whose driver call the watcher looks after: its pid, the threads we already let run
/// (restore thread, agent thread) and the call. A worker hands over in `release` a hold it no
/// longer needs (ptrace work only the watcher, the tracer, may do).
pub struct Watched<'a> {
    pub pid: HostPid,
    pub running: Vec<HostTid>,
    pub call: &'a DriverCall,
    pub release: &'a Mutex<Option<gpusnap_host::hold::Hold>>,
}

/// Runs on CRIU's main thread (the tracer) until `done()`: a process whose driver call shows no
/// progress for [`STALL`] gets its other threads resumed; they are stopped again when the call
/// returns. Returns, per process, an error for threads that could not be stopped again after
/// their worker ended without waiting (it panicked).
pub fn watch(done: impl Fn() -> bool, procs: &[Watched<'_>]) -> Vec<Result<(), StallError>> {
    let mut watches: Vec<Option<Watch>> = procs.iter().map(|_| None).collect();
    let mut unfrozen: Vec<Option<Unfrozen>> = procs.iter().map(|_| None).collect();
    let mut released: Vec<Result<(), StallError>> = procs.iter().map(|_| Ok(())).collect();
    while !done() {
        std::thread::sleep(Duration::from_millis(20));
        for (i, p) in procs.iter().enumerate() {
            if let Some(h) = p.release.lock().unwrap_or_else(|e| e.into_inner()).take() {
                released[i] = h.release().map_err(StallError::release(p.pid));
            }
            let mut st = p.call.lock();
            match *st {
                CallState::Inside => {
                    let w = watches[i].get_or_insert_with(|| Watch::new(p.pid));
                    if !w.stalled() {
                        continue;
                    }
                    log::warn!(
                        "pid {}: the driver call shows no progress for {:.1} s (resident memory \
                         and CPU time unchanged); threads not stopped: {}",
                        p.pid,
                        w.quiet_for().as_secs_f64(),
                        describe_running(p.pid)
                    );
                    match Unfrozen::start(p.pid, &p.running) {
                        Ok(u) => {
                            log::warn!(
                                "pid {}: let its other {} threads run until the driver call \
                                 returns, in case it waits on one of them (CUDA calls stay \
                                 blocked by the lock)",
                                p.pid,
                                u.count()
                            );
                            unfrozen[i] = Some(u);
                            *st = CallState::InsideUnfrozen;
                        }
                        Err(e) => {
                            log::error!("pid {}: cannot resume its other threads: {e}", p.pid);
                            // Do not try again for this call.
                            *st = CallState::InsideUnfrozen;
                        }
                    }
                }
                CallState::WaitingForStop => {
                    let r = unfrozen[i].take().map_or(Ok(()), Unfrozen::stop);
                    *st = CallState::Stopped(r);
                    watches[i] = None;
                    p.call.changed.notify_all();
                }
                CallState::Outside => watches[i] = None,
                CallState::InsideUnfrozen | CallState::Stopped(_) => {}
            }
        }
    }
    // A hold handed over as the last worker ended.
    for (p, r) in procs.iter().zip(&mut released) {
        if let Some(h) = p.release.lock().unwrap_or_else(|e| e.into_inner()).take() {
            *r = h.release().map_err(StallError::release(p.pid));
        }
    }
    unfrozen
        .into_iter()
        .zip(released)
        .map(|(u, r)| u.map_or(Ok(()), Unfrozen::stop).and(r))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stall_error_keeps_the_os_error_as_values() {
        let gone = io::Error::from_raw_os_error(libc::ESRCH);
        let e = StallError::Stop {
            tid: HostTid(9),
            err: (&gone).into(),
        };
        assert_eq!(
            e,
            StallError::Stop {
                tid: HostTid(9),
                err: OsError {
                    kind: gone.kind(),
                    errno: Some(libc::ESRCH)
                }
            }
        );
        assert_eq!(e.to_string(), format!("stopping thread 9 again: {gone}"));
        // An error of our own (no errno) says its kind.
        let listed = StallError::List {
            pid: HostPid(4),
            err: io::Error::new(io::ErrorKind::NotFound, "/proc/4/task: gone").into(),
        };
        assert_eq!(
            listed.to_string(),
            format!("listing the threads of pid 4: {}", io::ErrorKind::NotFound)
        );
        let released = StallError::release(HostPid(4))(gpusnap_host::ptrace::PtraceError {
            tid: HostTid(5),
            what: "draining the SIGSTOP",
            err: io::Error::from_raw_os_error(libc::ESRCH),
        });
        assert_eq!(
            released.to_string(),
            format!(
                "releasing the hold on pid 4: ptrace on thread 5 (draining the SIGSTOP): {gone}"
            )
        );
    }

    #[test]
    fn own_process_makes_progress_samples() {
        let me = HostPid(std::process::id() as i32);
        let p = Progress::sample(me).expect("own /proc");
        assert!(p.rss_kib > 0);
        let f = Family::of(me).unwrap();
        assert!(f.threads.contains(&me.into()));
    }

    #[test]
    fn own_blocked_thread_is_described() {
        // A thread of ours sleeping in a futex wait (a condvar) is found in its syscall file.
        let me = HostPid(std::process::id() as i32);
        let pair = std::sync::Arc::new((Mutex::new(false), Condvar::new()));
        let p2 = pair.clone();
        let th = std::thread::spawn(move || {
            let (m, c) = &*p2;
            let g = c.wait_while(m.lock().unwrap(), |done| !*done).unwrap();
            drop(g);
        });
        std::thread::sleep(Duration::from_millis(100));
        let text = describe_running(me);
        let (m, c) = &*pair;
        *m.lock().unwrap() = true;
        c.notify_all();
        th.join().unwrap();
        assert!(text.contains("syscall 202"), "{text}");
        assert!(text.contains(" futex 0x"), "{text}");
    }

    #[test]
    fn a_call_without_a_stall_passes_its_result_through() {
        let call = DriverCall::default();
        let (r, refrozen) = call.run(|| 7);
        assert_eq!(r, 7);
        assert_eq!(refrozen, Ok(()));
        assert!(matches!(*call.lock(), CallState::Outside));
    }

    #[test]
    fn a_worker_waits_until_the_watcher_has_stopped_the_threads() {
        let call = DriverCall::default();
        std::thread::scope(|s| {
            let worker = s.spawn(|| {
                call.run(|| {
                    // The watcher let the threads run while we were inside.
                    *call.lock() = CallState::InsideUnfrozen;
                })
            });
            // Play the watcher: wait for the worker to ask, then answer.
            loop {
                let mut st = call.lock();
                if matches!(*st, CallState::WaitingForStop) {
                    assert!(!worker.is_finished());
                    *st = CallState::Stopped(Err(StallError::Stop {
                        tid: HostTid(9),
                        err: io::Error::from_raw_os_error(libc::ESRCH).into(),
                    }));
                    call.changed.notify_all();
                    break;
                }
                drop(st);
                std::thread::sleep(Duration::from_millis(5));
            }
            let ((), refrozen) = worker.join().unwrap();
            assert!(
                matches!(
                    refrozen,
                    Err(StallError::Stop {
                        tid: HostTid(9),
                        ..
                    })
                ),
                "{refrozen:?}"
            );
        });
    }

    #[test]
    fn a_quiet_process_is_stalled_only_after_the_grace_period() {
        // A sleeping child: no RSS or CPU change.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = HostPid(child.id() as i32);
        std::thread::sleep(Duration::from_millis(100));
        let mut w = Watch::new(pid);
        assert!(!w.stalled());
        w.since -= STALL;
        assert!(w.stalled(), "no progress for STALL must count as a stall");
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
