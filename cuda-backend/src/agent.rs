//! The plugin's side of the in-process agent: find it, check who answers, greet it.
//!
//! The agent listens on an abstract unix socket named after its pid *in its own pid namespace*,
//! inside its own network namespace. Hooks get host pids, so the plugin translates: the
//! namespace pid from `/proc/<pid>/status`, and (for containers) connects from a short-lived
//! thread that has joined the target's network namespace. The peer is checked with SO_PEERCRED:
//! the listening socket must belong to the target process.

use gpusnap_proto::{Channel, PROTOCOL_VERSION, ProtoError, Reply, Request};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot read /proc/{pid}/{what}: {err}")]
    Proc {
        pid: i32,
        what: &'static str,
        err: io::Error,
    },
    #[error("cannot join the network namespace of pid {pid}: {err}")]
    Netns { pid: i32, err: io::Error },
    #[error("connecting to the agent of pid {pid}: {err}")]
    Connect { pid: i32, err: io::Error },
    #[error(
        "the socket of the agent of pid {pid} belongs to pid {owner}, not to the target: refusing to talk to it"
    )]
    Impostor { pid: i32, owner: i32 },
    #[error("agent of pid {pid}: {err}")]
    Proto { pid: i32, err: ProtoError },
    #[error("agent of pid {pid} answered {got:?} where {expected} was expected")]
    Unexpected {
        pid: i32,
        expected: &'static str,
        got: Box<Reply>,
    },
    #[error("agent of pid {pid} reports: {message}")]
    Refused { pid: i32, message: String },
    #[error("agent thread (namespace tid {ns_tid}) of pid {pid} not found in /proc/{pid}/task")]
    NoThread { pid: i32, ns_tid: i32 },
}

/// What the agent said about itself.
#[derive(Clone, Debug)]
pub struct AgentHello {
    pub ns_pid: i32,
    pub ns_tid: i32,
    pub allocations: u32,
    pub converted_bytes: u64,
    pub devices: u32,
    pub released: bool,
    /// `gpusnap_proto::hazard` bits: state the driver checkpoint cannot take.
    pub hazards: u32,
}

/// The last pid of the `NSpid:` line: the pid as the process itself sees it.
pub fn ns_pid(pid: i32) -> Result<i32, AgentError> {
    ns_id_of(&format!("/proc/{pid}/status")).map_err(|err| AgentError::Proc {
        pid,
        what: "status",
        err,
    })
}

fn ns_id_of(status_path: &str) -> io::Result<i32> {
    let s = std::fs::read_to_string(status_path)?;
    s.lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no NSpid line"))
}

/// Host tid of the thread of `pid` whose tid in the process's own namespace is `ns_tid`.
pub fn host_tid(pid: i32, ns_tid: i32) -> Result<i32, AgentError> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/task")).map_err(|err| AgentError::Proc {
        pid,
        what: "task",
        err,
    })?;
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if ns_id_of(&format!("/proc/{pid}/task/{tid}/status")).ok() == Some(ns_tid) {
            return Ok(tid);
        }
    }
    Err(AgentError::NoThread { pid, ns_tid })
}

/// The agent's thread names itself so (the restored process's threads can be found without
/// asking the agent, whose thread is stopped then).
pub const AGENT_THREAD_COMM: &str = "gpusnap-agent";

/// Host tid of the agent's thread of `pid`, found by its name, if there is one.
pub fn agent_thread(pid: i32) -> Option<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
        .find(|e| {
            std::fs::read_to_string(e.path().join("comm"))
                .is_ok_and(|c| c.trim_end() == AGENT_THREAD_COMM)
        })
        .and_then(|e| e.file_name().to_str()?.parse().ok())
}

fn same_netns(pid: i32) -> Result<bool, AgentError> {
    use std::os::unix::fs::MetadataExt;
    let theirs =
        std::fs::metadata(format!("/proc/{pid}/ns/net")).map_err(|err| AgentError::Proc {
            pid,
            what: "ns/net",
            err,
        })?;
    let ours = std::fs::metadata("/proc/self/ns/net").map_err(|err| AgentError::Proc {
        pid,
        what: "ns/net (self)",
        err,
    })?;
    Ok(theirs.ino() == ours.ino() && theirs.dev() == ours.dev())
}

/// Connects to the agent of `pid`. `Ok(None)`: no agent listens there (the process goes the
/// driver path). The peer is checked before anything is sent.
pub fn connect(pid: i32) -> Result<Option<Channel>, AgentError> {
    let nspid = ns_pid(pid)?;
    let fd = if same_netns(pid)? {
        gpusnap_proto::connect_agent(nspid)
    } else {
        connect_in_netns(pid, nspid)?
    };
    let fd = match fd {
        Ok(fd) => fd,
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ECONNREFUSED) | Some(libc::ENOENT)
            ) =>
        {
            return Ok(None);
        }
        Err(err) => return Err(AgentError::Connect { pid, err }),
    };
    let cred = gpusnap_proto::peer_cred(std::os::fd::AsFd::as_fd(&fd))
        .map_err(|err| AgentError::Connect { pid, err })?;
    let owner = cred.pid;
    if owner != pid && thread_group_of(owner) != Some(pid) {
        return Err(AgentError::Impostor { pid, owner });
    }
    Ok(Some(Channel::new(fd)))
}

fn thread_group_of(tid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Connects from a short-lived thread that joins the target's network namespace: abstract unix
/// sockets are per network namespace, and the socket keeps its namespace after the thread exits.
fn connect_in_netns(pid: i32, nspid: i32) -> Result<io::Result<OwnedFd>, AgentError> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))
        .map_err(|err| AgentError::Netns { pid, err })?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns on this thread only (CLONE_NEWNET affects the calling thread); `ns`
            // is an open namespace fd that lives for the whole call.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(AgentError::Netns {
                    pid,
                    err: io::Error::last_os_error(),
                });
            }
            Ok(gpusnap_proto::connect_agent(nspid))
        })
        .join()
        .unwrap_or_else(|_| {
            Err(AgentError::Netns {
                pid,
                err: io::Error::other("helper thread panicked"),
            })
        })
    })
}

/// Sends `Hello` and checks the answer.
pub fn hello(pid: i32, chan: &Channel, timeout: Duration) -> Result<AgentHello, AgentError> {
    chan.send_request(
        &Request::Hello {
            version: PROTOCOL_VERSION,
        },
        None,
    )
    .map_err(|err| AgentError::Proto { pid, err })?;
    match chan
        .recv_reply(Some(timeout))
        .map_err(|err| AgentError::Proto { pid, err })?
    {
        Reply::Hello {
            version: _,
            pid: ns_pid,
            tid,
            allocations,
            converted_bytes,
            devices,
            released,
            hazards,
        } => Ok(AgentHello {
            ns_pid,
            ns_tid: tid,
            hazards,
            allocations,
            converted_bytes,
            devices,
            released,
        }),
        Reply::Error { message, .. } => Err(AgentError::Refused { pid, message }),
        got => Err(AgentError::Unexpected {
            pid,
            expected: "Hello",
            got: Box::new(got),
        }),
    }
}

/// Duplicates an fd (used to hand the staging memfd to `send_request` while keeping ours).
pub fn dup(fd: &OwnedFd) -> io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC on a valid fd returns a new fd that we own.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `n` is a fresh fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_ns_pid_and_tid_resolve() {
        let me = std::process::id() as i32;
        assert_eq!(ns_pid(me).unwrap(), me);
        assert_eq!(host_tid(me, me).unwrap(), me);
        assert!(matches!(host_tid(me, -5), Err(AgentError::NoThread { .. })));
        assert!(same_netns(me).unwrap());
    }

    #[test]
    fn no_agent_means_none() {
        // Our own test process runs no agent.
        let me = std::process::id() as i32;
        assert!(connect(me).unwrap().is_none());
    }
}
