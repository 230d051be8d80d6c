//! Killing a process that must not run, and reaping what this process may reap of it.
//!
//! CRIU traces every thread of a process it dumps or restores, so a thread killed while traced
//! stays a zombie until its tracer (CRIU's main thread, where the plugin runs) reaps it. When
//! the process is PID 1 of a pid namespace (a container's GPU process), its exit waits for
//! those zombies while CRIU's clean-up waits for it: the run would hang for ever (seen under
//! Podman). [`kill_and_reap`] is the one way the plugin kills a process: SIGKILL, then every
//! thread reaped that is ours to reap.

use crate::pid::{HostPid, HostTid};
use std::io;
use std::time::{Duration, Instant};

/// How long [`kill_and_reap`] waits for the killed threads to die.
pub const REAP_WITHIN: Duration = Duration::from_secs(5);

/// The SIGKILL itself was refused (the process is not ours to kill, or gone).
#[derive(Debug, thiserror::Error)]
#[error("killing pid {pid} failed: {source}")]
pub struct KillFailed {
    pub pid: HostPid,
    #[source]
    pub source: io::Error,
}

/// What [`kill_and_reap`] did: the process is killed; `left` are the threads still not dead
/// after [`REAP_WITHIN`] (empty when every thread that was ours to reap is reaped).
#[derive(Debug, PartialEq, Eq)]
pub struct Killed {
    pub left: Vec<HostTid>,
}

/// SIGKILL to `pid`, then reaps its threads that this process traces (or its own child).
/// Threads that are not ours to wait for (CRIU's own handler reaped them, say) count as reaped.
pub fn kill_and_reap(pid: HostPid) -> Result<Killed, KillFailed> {
    let tids = crate::procfs::thread_ids(pid).unwrap_or_else(|_| vec![pid.into()]);
    // SAFETY: kill(2) takes no pointers; `pid` is a process the caller found must not run.
    if unsafe { libc::kill(pid.get(), libc::SIGKILL) } != 0 {
        return Err(KillFailed {
            pid,
            source: io::Error::last_os_error(),
        });
    }
    let left = reap(&tids, REAP_WITHIN);
    if !left.is_empty() {
        log::warn!("pid {pid}: threads {left:?} not reaped after SIGKILL");
    }
    Ok(Killed { left })
}

/// Reaps the threads `tids` once they have died; returns those still alive at `within`.
fn reap(tids: &[HostTid], within: Duration) -> Vec<HostTid> {
    let deadline = Instant::now() + within;
    let mut left: Vec<HostTid> = tids.to_vec();
    while !left.is_empty() && Instant::now() < deadline {
        left.retain(|&tid| {
            let mut status = 0;
            // SAFETY: waitpid with a valid status pointer; WNOHANG never blocks.
            let r = unsafe { libc::waitpid(tid.get(), &mut status, libc::__WALL | libc::WNOHANG) };
            match r {
                0 => true,
                // Not (or no longer) ours to wait for.
                r if r < 0 => false,
                _ => !(libc::WIFEXITED(status) || libc::WIFSIGNALED(status)),
            }
        });
        if !left.is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    left
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A killed child of ours leaves no zombie: the helper reaped it (a bare SIGKILL leaves
    /// one, which is what hung a container's PID 1).
    #[test]
    fn a_killed_child_is_reaped() {
        let child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let k = kill_and_reap(HostPid(pid)).unwrap();
        assert_eq!(k.left, Vec::<HostTid>::new());
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "pid {pid} is left as a zombie: {:?}",
            crate::procfs::state_and_start(HostPid(pid))
        );
        // Nothing is left to wait for.
        let mut status = 0;
        // SAFETY: waitpid with a valid status pointer; WNOHANG never blocks.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        assert_eq!(r, -1);
        drop(child);
    }

    #[test]
    fn a_refused_kill_says_which_pid() {
        let e = kill_and_reap(HostPid(i32::MAX)).unwrap_err();
        assert_eq!(e.pid.get(), i32::MAX);
        assert!(e.to_string().contains(&i32::MAX.to_string()), "{e}");
    }
}
