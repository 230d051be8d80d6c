//! The agent thread: listens on `\0gpusnap-agent-<pid>`, accepts one connection at a time from
//! root or the process's own user, and serves requests until the peer closes or an operation
//! ends (after `Released`, `Restored`, `Aborted` or an operation's error the connection is
//! closed: the agent must hold no connection when CRIU dumps the process's descriptors).
//!
//! The thread is started once (first conversion, or at load with `GPUSNAP_AGENT_EAGER=1`),
//! named `gpusnap-agent`, with every signal blocked.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use gpusnap_proto::{
    AGENT_SOCKET_PREFIX, AllocKind, Channel, ErrorCode, PROTOCOL_VERSION, ProtoError, Reply,
    Request, accept_connection, bind_agent_listener, peer_cred,
};

use crate::gpu::Gpu;
use crate::log::debug;
use crate::session::{Ring, busy_reply};
use crate::table::{self, AGENT_LOCK_WAIT};
use crate::{dump, restore};

static STARTED: AtomicBool = AtomicBool::new(false);

/// Name of the agent thread (`/proc/<pid>/task/*/comm`).
pub const THREAD_NAME: &str = "gpusnap-agent";

/// Starts the agent thread unless it runs already.
pub fn ensure_started() {
    if STARTED.load(Ordering::Acquire) || STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    crate::install_quiet_panic_hook();
    // The new thread inherits the creator's mask: block everything around the spawn so no
    // signal meant for the application is ever delivered to the agent thread.
    let old = block_all_signals();
    let spawned = std::thread::Builder::new()
        .name(THREAD_NAME.into())
        .spawn(agent_main);
    if let Some(old) = old {
        // SAFETY: old is the mask this thread had; restoring it.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    }
    if let Err(e) = spawned {
        debug!("could not start the agent thread: {e}");
        STARTED.store(false, Ordering::Release);
    }
}

/// Blocks every signal in the calling thread; returns the previous mask.
fn block_all_signals() -> Option<libc::sigset_t> {
    // SAFETY: sigset_t is plain data; sigfillset initializes it; pthread_sigmask writes old.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        (libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old) == 0).then_some(old)
    }
}

/// In a forked child: no agent thread exists; let a child that uses CUDA start its own, and
/// close the parent agent's listener and connection, which the child inherited. They are found
/// by their bound name (an accepted unix socket carries its listener's name), not by recorded
/// numbers: a fork may land between the agent thread's `socket`/`accept4` and any bookkeeping.
pub fn forget_in_child() {
    if STARTED.swap(false, Ordering::AcqRel) {
        close_agent_sockets();
    }
}

fn close_agent_sockets() {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    for fd in fds.into_iter().filter(|&fd| is_agent_socket(fd)) {
        // SAFETY: fd is an inherited copy of the parent agent's socket; nothing in the child
        // uses it (the thread that owned it does not exist here).
        unsafe { libc::close(fd) };
    }
}

/// Whether `fd` is a unix socket bound to (or accepted on) an agent name.
fn is_agent_socket(fd: i32) -> bool {
    // SAFETY: sockaddr_un is plain data; getsockname writes at most `len` bytes into it.
    let (rc, addr, len) = unsafe {
        let mut addr: libc::sockaddr_un = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
        let rc = libc::getsockname(fd, (&raw mut addr).cast(), &mut len);
        (rc, addr, len)
    };
    let off = std::mem::offset_of!(libc::sockaddr_un, sun_path);
    if rc != 0 || addr.sun_family != libc::AF_UNIX as libc::sa_family_t || (len as usize) <= off {
        return false;
    }
    let n = (len as usize - off).min(addr.sun_path.len());
    let name: Vec<u8> = addr.sun_path[..n].iter().map(|&c| c as u8).collect();
    name.first() == Some(&0) && name[1..].starts_with(AGENT_SOCKET_PREFIX.as_bytes())
}

fn agent_main() {
    block_all_signals();
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    // fork's prepare handler takes the table lock: holding it from socket() to bind() means no
    // child ever inherits the listener before it has the name close_agent_sockets() looks for.
    // Bounded, like every table lock the agent thread takes; on timeout go on unfenced.
    let fence = table::try_lock_for(AGENT_LOCK_WAIT);
    let bound = bind_agent_listener(pid);
    drop(fence);
    let listener = match bound {
        Ok(l) => l,
        Err(e) => {
            debug!("agent socket gpusnap-agent-{pid} unavailable, agent stays idle: {e}");
            return;
        }
    };
    debug!("agent listening on @gpusnap-agent-{pid}");
    let mut agent = Agent { gpu: Gpu::new() };
    loop {
        let conn = match accept_connection(listener.as_fd()) {
            Ok(c) => c,
            Err(e) => {
                debug!("accept: {e}");
                match e.raw_os_error() {
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                        std::thread::sleep(std::time::Duration::from_millis(100));
                        continue;
                    }
                    _ => return,
                }
            }
        };
        if !peer_allowed(&conn) {
            continue;
        }
        let ch = Channel::new(conn);
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| agent.serve(&ch))).is_err() {
            debug!("agent: panic while serving a connection; closing it");
        }
        drop(ch);
    }
}

/// Root, or the user the process runs as.
fn peer_allowed(conn: &OwnedFd) -> bool {
    match peer_cred(conn.as_fd()) {
        // SAFETY: geteuid has no preconditions.
        Ok(c) if c.uid == 0 || c.uid == unsafe { libc::geteuid() } => true,
        Ok(c) => {
            debug!("refusing a connection from pid {} uid {}", c.pid, c.uid);
            false
        }
        Err(e) => {
            debug!("SO_PEERCRED: {e}");
            false
        }
    }
}

/// How long a connection may wait between requests outside an operation. The plugin sends its
/// next request within milliseconds (its longest gap, building the staging ring, is well under
/// a second for the largest ring).
const IDLE_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a connection may last before it begins an operation (`DumpBegin`, `RestoreBegin`);
/// an operation then has its own limits ([`crate::session::PEER_WAIT`]).
const SESSION_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// State kept by the agent thread across connections.
struct Agent {
    gpu: Gpu,
}

impl Agent {
    /// Serves one connection until the peer closes, an operation ends, or the peer idles: the
    /// agent serves one connection at a time, and a client that holds one without using it
    /// (or keeps it with requests outside an operation) would otherwise keep the plugin's
    /// connection queued on the listener, which makes CRIU's dump fail on an in-flight socket.
    fn serve(&mut self, ch: &Channel) {
        let deadline = std::time::Instant::now() + SESSION_LIMIT;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                debug!("closing a connection that used {SESSION_LIMIT:?} without an operation");
                return;
            }
            let (req, fd) = match ch.recv_request(Some(left.min(IDLE_LIMIT))) {
                Ok(m) => m,
                Err(ProtoError::Closed | ProtoError::Io(_)) => return,
                Err(ProtoError::Timeout) => {
                    debug!("closing a connection idle for {IDLE_LIMIT:?}");
                    return;
                }
                Err(ProtoError::Interrupted) => continue,
                Err(e @ ProtoError::VersionMismatch { .. }) => {
                    reply(ch, ErrorCode::VersionMismatch, e.to_string());
                    continue;
                }
                Err(e) => {
                    reply(ch, ErrorCode::BadRequest, e.to_string());
                    continue;
                }
            };
            debug!("request {req:?}");
            match (req, fd) {
                (
                    Request::DumpBegin {
                        slot_size,
                        slots,
                        streams,
                    },
                    Some(memfd),
                ) => {
                    return dump::run(
                        &mut self.gpu,
                        ch,
                        Ring {
                            slot_size,
                            slots,
                            streams,
                        },
                        memfd,
                    );
                }
                (
                    Request::RestoreBegin {
                        slot_size,
                        slots,
                        streams,
                    },
                    Some(memfd),
                ) => {
                    return restore::run(
                        &mut self.gpu,
                        ch,
                        Ring {
                            slot_size,
                            slots,
                            streams,
                        },
                        memfd,
                    );
                }
                (r @ (Request::DumpBegin { .. } | Request::RestoreBegin { .. }), None) => {
                    reply(
                        ch,
                        ErrorCode::BadRequest,
                        format!("{r:?} needs the staging memfd attached"),
                    );
                }
                (r, Some(_)) => reply(
                    ch,
                    ErrorCode::BadRequest,
                    format!("{r:?} carries no file descriptor"),
                ),
                (r, None) => {
                    if !self.simple(ch, r) {
                        return;
                    }
                }
            }
        }
    }

    /// Requests answered outside an operation; false when the connection is to be closed.
    fn simple(&mut self, ch: &Channel, req: Request) -> bool {
        let sent = match req {
            Request::Hello { version } if version != PROTOCOL_VERSION => {
                ch.send_reply(&Reply::Error {
                    code: ErrorCode::VersionMismatch,
                    message: format!("agent speaks protocol {PROTOCOL_VERSION}, plugin {version}"),
                })
            }
            Request::Hello { .. } => ch.send_reply(&hello()),
            Request::ListAllocations => list(ch),
            Request::Abort => ch.send_reply(&Reply::Aborted),
            other => ch.send_reply(&Reply::Error {
                code: ErrorCode::BadState,
                message: format!("{other:?} without a DumpBegin or RestoreBegin in progress"),
            }),
        };
        sent.is_ok()
    }
}

fn reply(ch: &Channel, code: ErrorCode, message: String) {
    debug!("error reply {code:?}: {message}");
    let _ = ch.send_reply(&Reply::Error { code, message });
}

fn hello() -> Reply {
    let Some(t) = table::try_lock_for(AGENT_LOCK_WAIT) else {
        return busy_reply();
    };
    let s = t.summary();
    drop(t);
    // SAFETY: getpid and gettid have no preconditions.
    let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
    Reply::Hello {
        version: PROTOCOL_VERSION,
        pid,
        tid,
        allocations: s.entries,
        converted_bytes: s.converted_bytes,
        devices: s.devices,
        released: s.released,
        hazards: crate::hazards::get(),
    }
}

fn list(ch: &Channel) -> Result<(), ProtoError> {
    let Some(t) = table::try_lock_for(AGENT_LOCK_WAIT) else {
        return ch.send_reply(&busy_reply());
    };
    let entries = t.listing();
    drop(t);
    for e in &entries {
        ch.send_reply(&Reply::Allocation {
            id: e.id,
            device: u32::try_from(e.device).unwrap_or(u32::MAX),
            addr: e.addr,
            size: e.size,
            kind: if e.converted {
                AllocKind::Converted
            } else {
                AllocKind::AppVmm
            },
        })?;
    }
    ch.send_reply(&Reply::AllocationsEnd {
        count: u32::try_from(entries.len()).unwrap_or(u32::MAX),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn agent_sockets_are_recognised_by_name() {
        let name = gpusnap_proto::agent_socket_name(-(std::process::id() as i32) - 7);
        let listener = gpusnap_proto::bind_abstract_listener(&name).unwrap();
        assert!(is_agent_socket(listener.as_raw_fd()));
        let client = gpusnap_proto::connect_abstract(&name).unwrap();
        let accepted = accept_connection(listener.as_fd()).unwrap();
        assert!(
            is_agent_socket(accepted.as_raw_fd()),
            "accepted sockets carry the name"
        );
        assert!(
            !is_agent_socket(client.as_raw_fd()),
            "the client end is unnamed"
        );
        let other = gpusnap_proto::bind_abstract_listener(b"\0gpusnap-something-else").unwrap();
        assert!(!is_agent_socket(other.as_raw_fd()));
        let (a, _b) = gpusnap_proto::seqpacket_pair().unwrap();
        assert!(!is_agent_socket(a.as_raw_fd()));
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert!(!is_agent_socket(f.as_raw_fd()));
        assert!(!is_agent_socket(-1));
    }
}
