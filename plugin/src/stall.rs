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

use crate::ptrace::{RunningThread, thread_ids};
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
    pub fn sample(pid: i32) -> Option<Self> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        Some(Self {
            rss_kib: vm_rss_kib(&status)?,
            cpu_ticks: cpu_ticks(&stat)?,
        })
    }
}

/// `VmRSS:` of a `/proc/<pid>/status` text, in KiB.
fn vm_rss_kib(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A `/proc/.../stat` text from field 3 (the state) on. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted after its last `)`.
pub(crate) fn after_comm(stat: &str) -> Option<&str> {
    Some(&stat[stat.rfind(')')? + 1..])
}

/// The state letter (field 3) of a `/proc/.../stat` text.
pub(crate) fn state_of(stat: &str) -> Option<&str> {
    after_comm(stat)?.split_whitespace().next()
}

/// utime + stime (fields 14 and 15) of a `/proc/<pid>/stat` text.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let rest = after_comm(stat)?;
    let mut fields = rest.split_whitespace().skip(11); // field 3 is the first after ')'
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Watches one process's driver call from CRIU's main thread.
#[derive(Debug)]
pub struct Watch {
    pid: i32,
    last: Option<Progress>,
    since: Instant,
}

impl Watch {
    pub fn new(pid: i32) -> Self {
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
    pub threads: BTreeSet<i32>,
    pub children: BTreeSet<i32>,
}

impl Family {
    pub fn of(pid: i32) -> io::Result<Self> {
        let mut f = Self::default();
        for tid in thread_ids(pid)? {
            f.threads.insert(tid);
            // A thread may exit meanwhile; its children are then listed by no one, which the
            // comparison after the checkpoint catches as a change.
            if let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/children")) {
                f.children.extend(
                    text.split_whitespace()
                        .filter_map(|s| s.parse::<i32>().ok()),
                );
            }
        }
        Ok(f)
    }
}

/// `tid name state wchan` of every thread of `pid` that is not in a ptrace stop, for the log.
pub fn describe_running(pid: i32) -> String {
    let Ok(tids) = thread_ids(pid) else {
        return String::from("(cannot list threads)");
    };
    let mut out = Vec::new();
    for tid in tids {
        let read = |f: &str| {
            std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/{f}"))
                .map(|s| s.trim().to_owned())
                .unwrap_or_default()
        };
        let stat = read("stat");
        let state = state_of(&stat).unwrap_or("?").to_owned();
        if state == "t" {
            continue;
        }
        let mut line = format!("{tid} {} {state} {}", read("comm"), read("wchan"));
        if let Some(w) = parse_syscall(&read("syscall")) {
            line.push_str(&describe_wait(pid, &w));
        }
        out.push(line);
    }
    out.join("; ")
}

/// x86_64's futex system call number.
const SYS_FUTEX: u64 = 202;

/// What `/proc/<pid>/task/<tid>/syscall` says of a thread blocked in a system call.
#[derive(Debug, PartialEq, Eq)]
struct Blocked {
    nr: u64,
    arg0: u64,
    pc: u64,
}

/// `nr a0 a1 a2 a3 a4 a5 sp pc` (hex arguments); `running` or `-1 sp pc` give None.
fn parse_syscall(text: &str) -> Option<Blocked> {
    let f: Vec<&str> = text.split_whitespace().collect();
    if f.len() != 9 {
        return None;
    }
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    Some(Blocked {
        nr: f[0].parse().ok()?,
        arg0: hex(f[1])?,
        pc: hex(f[8])?,
    })
}

/// The mapping (file name, or `[anon]`) of `/proc/<pid>/maps` text that holds `addr`.
fn mapping_of(maps: &str, addr: u64) -> Option<String> {
    maps.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (lo, hi) = f.next()?.split_once('-')?;
        let (lo, hi) = (
            u64::from_str_radix(lo, 16).ok()?,
            u64::from_str_radix(hi, 16).ok()?,
        );
        if !(lo..hi).contains(&addr) {
            return None;
        }
        let name = f.nth(4).unwrap_or("[anon]");
        Some(name.rsplit('/').next().unwrap_or(name).to_owned())
    })
}

/// For the log of a stall: where a blocked thread's code is and, for a futex wait, which
/// mapping the futex is in and the word after it (a glibc mutex keeps its owner's tid there).
fn describe_wait(pid: i32, w: &Blocked) -> String {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let place = |a: u64| mapping_of(&maps, a).unwrap_or_else(|| "?".into());
    let mut s = format!(" syscall {} pc {:#x} in {}", w.nr, w.pc, place(w.pc));
    if w.nr == SYS_FUTEX {
        s.push_str(&format!(" futex {:#x} in {}", w.arg0, place(w.arg0)));
        if let Some(owner) = read_u32(pid, w.arg0.wrapping_add(8)) {
            s.push_str(&format!(" (word+8: {owner})"));
        }
    }
    s
}

/// Reads 4 bytes of `pid`'s memory (we trace it, so `/proc/<pid>/mem` is open to us).
fn read_u32(pid: i32, addr: u64) -> Option<u32> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(format!("/proc/{pid}/mem")).ok()?;
    let mut b = [0u8; 4];
    f.read_exact_at(&mut b, addr).ok()?;
    Some(u32::from_ne_bytes(b))
}

/// The other threads of a stalled process, let run until the driver call returns.
#[derive(Debug)]
pub struct Unfrozen {
    pid: i32,
    before: Family,
    threads: Vec<RunningThread>,
}

impl Unfrozen {
    /// Resumes every thread of `pid` but those in `running` (already resumed by us).
    pub fn start(pid: i32, running: &[i32]) -> io::Result<Self> {
        let before = Family::of(pid)?;
        let mut threads = Vec::new();
        for &tid in &before.threads {
            if running.contains(&tid) {
                continue;
            }
            match RunningThread::resume(tid) {
                Ok(th) => threads.push(th),
                // Dropping `threads` stops the ones already resumed.
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("resuming thread {tid}: {e}"),
                    ));
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
    pub fn stop(self) -> Result<(), String> {
        let Self {
            pid,
            before,
            threads,
        } = self;
        for th in threads {
            let tid = th.tid();
            th.stop()
                .map_err(|e| format!("stopping thread {tid} again: {e}"))?;
        }
        let after = Family::of(pid).map_err(|e| format!("listing pid {pid}'s threads: {e}"))?;
        if after != before {
            return Err(format!(
                "while its threads ran, pid {pid} changed: threads {:?} -> {:?}, children {:?} -> {:?}; \
                 CRIU's view of it is stale, so this dump is abandoned (run it again)",
                before.threads, after.threads, before.children, after.children
            ));
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
    Stopped(Result<(), String>),
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
    pub fn run<T>(&self, f: impl FnOnce() -> T) -> (T, Result<(), String>) {
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
/// (restore thread, agent thread) and the call.
pub struct Watched<'a> {
    pub pid: i32,
    pub running: Vec<i32>,
    pub call: &'a DriverCall,
}

/// Runs on CRIU's main thread (the tracer) until `done()`: a process whose driver call shows no
/// progress for [`STALL`] gets its other threads resumed; they are stopped again when the call
/// returns. Returns, per process, an error for threads that could not be stopped again after
/// their worker ended without waiting (it panicked).
pub fn watch(done: impl Fn() -> bool, procs: &[Watched<'_>]) -> Vec<Result<(), String>> {
    let mut watches: Vec<Option<Watch>> = procs.iter().map(|_| None).collect();
    let mut unfrozen: Vec<Option<Unfrozen>> = procs.iter().map(|_| None).collect();
    while !done() {
        std::thread::sleep(Duration::from_millis(100));
        for (i, p) in procs.iter().enumerate() {
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
    unfrozen
        .into_iter()
        .map(|u| u.map_or(Ok(()), Unfrozen::stop))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_is_read_from_status() {
        let s = "Name:\tpython3\nVmPeak:\t  100 kB\nVmRSS:\t  123456 kB\nThreads:\t35\n";
        assert_eq!(vm_rss_kib(s), Some(123456));
        assert_eq!(vm_rss_kib("Name:\tx\n"), None);
    }

    #[test]
    fn cpu_time_skips_a_command_name_with_spaces_and_parens() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
        let s = "42 (a b) c)) S 1 42 42 0 -1 4194560 10 0 0 0 700 55 0 0 20 0";
        assert_eq!(cpu_ticks(s), Some(755));
        assert_eq!(cpu_ticks("42 (x) S 1"), None);
    }

    #[test]
    fn own_process_makes_progress_samples() {
        let me = std::process::id() as i32;
        let p = Progress::sample(me).expect("own /proc");
        assert!(p.rss_kib > 0);
        let f = Family::of(me).unwrap();
        assert!(f.threads.contains(&me));
    }

    #[test]
    fn a_blocked_thread_is_located() {
        let w = parse_syscall("202 0x7f00000010a0 0x80 0x2 0x0 0x0 0x0 0x7ffd0 0x7f0000401234")
            .unwrap();
        assert_eq!(
            w,
            Blocked {
                nr: 202,
                arg0: 0x7f00000010a0,
                pc: 0x7f0000401234
            }
        );
        assert_eq!(parse_syscall("running"), None);
        assert_eq!(parse_syscall("-1 0x7ffd0 0x401000"), None);
        let maps = "7f0000000000-7f0000002000 rw-p 00000000 00:00 0 \n\
                    7f0000400000-7f0000500000 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libcuda.so.1\n";
        assert_eq!(
            mapping_of(maps, 0x7f0000401234).as_deref(),
            Some("libcuda.so.1")
        );
        assert_eq!(mapping_of(maps, 0x7f00000010a0).as_deref(), Some("[anon]"));
        assert_eq!(mapping_of(maps, 0x1000), None);
    }

    #[test]
    fn own_blocked_thread_is_described() {
        // A thread of ours sleeping in a futex wait (a condvar) is found in its syscall file.
        let me = std::process::id() as i32;
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
                    *st = CallState::Stopped(Err("thread 9 gone".into()));
                    call.changed.notify_all();
                    break;
                }
                drop(st);
                std::thread::sleep(Duration::from_millis(5));
            }
            let ((), refrozen) = worker.join().unwrap();
            assert_eq!(refrozen, Err("thread 9 gone".to_owned()));
        });
    }

    #[test]
    fn a_quiet_process_is_stalled_only_after_the_grace_period() {
        // A sleeping child: no RSS or CPU change.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        std::thread::sleep(Duration::from_millis(100));
        let mut w = Watch::new(pid);
        assert!(!w.stalled());
        w.since -= STALL;
        assert!(w.stalled(), "no progress for STALL must count as a stall");
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
