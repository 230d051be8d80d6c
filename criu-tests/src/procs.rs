//! Process plumbing: spawning workloads in their own session, reaping, and waiting until a
//! dumped pid is free again so that CRIU can restore it.
//!
//! CRIU restores a task with its original pid, and fails with "Can't fork for PID: File
//! exists" while any task still uses that number as pid, pgid or sid (zombies included). The
//! test process therefore makes itself a child subreaper: every workload it spawns, every
//! grandchild orphaned by a dump, and every task restored with `--restore-detached` (whose
//! parent, criu, exits) ends up as its child, and it reaps them itself instead of relying on
//! the host's init.

use std::fs;
use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

const POLL: Duration = Duration::from_millis(10);

/// Fields of `/proc/<pid>/stat` that matter here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub pid: i32,
    /// One-letter state (`R`, `S`, `T`, `t`, `Z`, ...).
    pub state: char,
    pub ppid: i32,
    pub pgrp: i32,
    pub session: i32,
}

/// Reads `/proc/<pid>/stat`; `None` if there is no such task.
pub fn stat(pid: i32) -> Option<Stat> {
    parse_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

fn parse_stat(s: &str) -> Option<Stat> {
    let pid = s.split_whitespace().next()?.parse().ok()?;
    // The command name is in parentheses and may contain spaces or ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    let pgrp = f.next()?.parse().ok()?;
    let session = f.next()?.parse().ok()?;
    Some(Stat {
        pid,
        state,
        ppid,
        pgrp,
        session,
    })
}

/// True if `pid` exists and is not a zombie.
pub fn is_alive(pid: i32) -> bool {
    stat(pid).is_some_and(|s| s.state != 'Z' && s.state != 'X')
}

/// Makes the calling process a child subreaper (see the module documentation).
pub fn become_subreaper() -> io::Result<()> {
    // SAFETY: PR_SET_CHILD_SUBREAPER takes one integer argument and touches no memory.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Spawns `cmd` as the leader of a new session (so pid = pgid = sid and no controlling tty),
/// with stdin from /dev/null.
pub fn spawn_in_new_session(cmd: &mut Command) -> io::Result<Child> {
    cmd.stdin(Stdio::null());
    // SAFETY: the closure runs in the forked child before exec and only calls setsid(2),
    // which is async-signal-safe; it allocates nothing and takes no locks.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Sends `sig` to `pid`; errors (no such process) are ignored.
pub fn signal(pid: i32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// Reaps `pid` if it is (or becomes) our child and waits until it has disappeared from
/// /proc. Returns an error if it is still there after `timeout`.
pub fn reap(pid: i32, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes only to `status`, a valid local; WNOHANG never blocks.
        unsafe {
            libc::waitpid(pid, &mut status, libc::WNOHANG | libc::__WALL);
        }
        match stat(pid) {
            None => return Ok(()),
            Some(s) if Instant::now() >= deadline => {
                return Err(format!("pid {pid} still present after {timeout:?}: {s:?}"));
            }
            Some(_) => sleep(POLL),
        }
    }
}

/// SIGKILLs every pid and reaps them; never panics (used from `Drop`).
pub fn kill_and_reap(pids: &[i32]) {
    for &pid in pids {
        signal(pid, libc::SIGKILL);
    }
    for &pid in pids {
        if let Err(e) = reap(pid, Duration::from_secs(5)) {
            eprintln!("criu-tests: warning: {e}");
        }
    }
}

/// Waits until no task uses `pid` as its pid, process group or session, which is what
/// CRIU needs to restore a task with that pid.
pub fn wait_pid_free(pid: i32, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        let users = pid_users(pid);
        if users.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "pid {pid} is still in use after {timeout:?} (as pid, pgid or sid) by: {users:?}"
            ));
        }
        sleep(POLL);
    }
}

/// Tasks that use `pid` as pid, pgid or sid.
pub fn pid_users(pid: i32) -> Vec<Stat> {
    let mut users: Vec<Stat> = stat(pid).into_iter().collect();
    if let Ok(dir) = fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            if p == pid {
                continue;
            }
            if let Some(s) = stat(p)
                && (s.pgrp == pid || s.session == pid)
            {
                users.push(s);
            }
        }
    }
    users
}

/// Tids of `pid`'s threads, sorted (none if it is gone).
pub fn tids(pid: i32) -> Vec<i32> {
    let mut v: Vec<i32> = fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    v.sort_unstable();
    v
}

/// Children of `pid` (all threads), from `/proc/<pid>/task/*/children`.
pub fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|c| c.parse::<i32>().ok()));
            }
        }
    }
    out.sort_unstable();
    out
}

/// True if `/proc/<pid>/maps` mentions `needle` (e.g. a preloaded library's file name).
pub fn maps_contain(pid: i32, needle: &str) -> bool {
    fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|m| m.contains(needle))
}

/// The `TracerPid:` of `/proc/<pid>/status` (0: not traced); `None` if there is no such task.
pub fn tracer_pid(pid: i32) -> Option<i32> {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// How many of `pid`'s file descriptors are sockets.
pub fn socket_fds(pid: i32) -> usize {
    fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| {
        d.flatten()
            .filter(|e| {
                fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().starts_with("socket:"))
            })
            .count()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_comm() {
        let s = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 0 0";
        let st = parse_stat(s).unwrap();
        assert_eq!(
            st,
            Stat {
                pid: 4242,
                state: 'S',
                ppid: 1,
                pgrp: 4242,
                session: 4242
            }
        );
    }

    #[test]
    fn own_process_is_alive() {
        let me = std::process::id() as i32;
        assert!(is_alive(me));
        assert!(!pid_users(me).is_empty());
        assert_eq!(tracer_pid(me), Some(0));
        assert_eq!(tracer_pid(-1), None);
    }
}
