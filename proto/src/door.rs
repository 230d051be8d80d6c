//! The agent's door: how a client reaches the agent of a process without any socket name.
//!
//! The agent holds a connected `SOCK_SEQPACKET` pair (its own end and the *client end*) and a
//! label: an empty memfd named `gpusnap-agent-door:<client end>:<agent end>`, which
//! `/proc/<pid>/fd` shows. A client finds the label, copies the client end out of the process
//! with `pidfd_getfd(2)` and *knocks*: it sends one end of a fresh pair of its own (one
//! [`KNOCK`] record with the descriptor attached), which becomes the connection.
//!
//! Why no listening socket: an abstract name is visible to every user of the network namespace,
//! and a listener is dumped by CRIU with its name, so any user could bind that name after a dump
//! and make the restore fail (`EADDRINUSE`). The door has no name to take. Reaching it needs
//! `pidfd_getfd`, which needs ptrace rights over the process (root, or its own user where the
//! kernel's ptrace policy allows), and the agent still checks the connection's `SO_PEERCRED`.
//! CRIU dumps and restores the pair and the label with the process, at the same numbers.
//!
//! A knock the agent never takes (agent hung or busy) would stay queued with a descriptor whose
//! peer lives in the client, which CRIU cannot dump (`External socket is used`):
//! [`Door::withdraw`] empties the door, its own knock and any other client's. The agent, for its
//! part, lets a connection that has sent nothing give way to the next knock, so idle knocks
//! cannot make the plugin's wait.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use crate::channel::RawRecord;
use crate::{Channel, ProtoError};

/// Name prefix of the door's label memfd (as `memfd_create` is given it).
pub const DOOR_LABEL_PREFIX: &str = "gpusnap-agent-door:";
/// The one record a knock is; a descriptor is attached.
pub const KNOCK: &[u8] = b"GSNP knock";

/// The agent's side: both ends of the door and the label. The agent keeps all three open for
/// the life of the process (the client end only so that clients can copy it).
#[derive(Debug)]
pub struct DoorInside {
    pub agent_end: OwnedFd,
    pub client_end: OwnedFd,
    pub label: OwnedFd,
}

/// Creates the door's pair and its label (all `CLOEXEC`).
pub fn install_door() -> io::Result<DoorInside> {
    let (agent_end, client_end) = crate::seqpacket_pair()?;
    let name = format!(
        "{DOOR_LABEL_PREFIX}{}:{}",
        client_end.as_raw_fd(),
        agent_end.as_raw_fd()
    );
    let cname = std::ffi::CString::new(name).map_err(io::Error::other)?;
    // SAFETY: cname is a valid NUL-terminated string; the result is checked before it is owned.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor that nothing else owns.
    let label = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(DoorInside {
        agent_end,
        client_end,
        label,
    })
}

/// What [`take_knock`] found on the agent's end.
#[derive(Debug)]
pub enum Knock {
    /// A well-formed knock: the connection to serve.
    Connection(OwnedFd),
    /// Nothing queued.
    Nothing,
    /// A record that is not a knock (its descriptors, if any, are closed).
    Malformed(&'static str),
}

/// Takes one knock from the agent's end, without waiting.
pub fn take_knock(agent_end: &Channel) -> Result<Knock, ProtoError> {
    match agent_end.try_recv_raw() {
        Ok(None) => Ok(Knock::Nothing),
        Ok(Some(RawRecord { bytes, fd })) => Ok(match (bytes == KNOCK, fd) {
            (true, Some(fd)) if is_seqpacket(fd.as_fd()) => Knock::Connection(fd),
            (true, Some(_)) => Knock::Malformed("the knock's descriptor is not a SEQPACKET socket"),
            (true, None) => Knock::Malformed("a knock without a descriptor"),
            (false, _) => Knock::Malformed("a record that is not a knock"),
        }),
        Err(ProtoError::TooLong) => Ok(Knock::Malformed("an overlong record")),
        Err(ProtoError::TooManyFds(_)) => Ok(Knock::Malformed("more than one descriptor")),
        Err(e) => Err(e),
    }
}

/// The client's side: the client end of a process's door, copied out of it.
#[derive(Debug)]
pub struct Door {
    pid: i32,
    pidfd: OwnedFd,
    client: Channel,
    agent_end: RawFd,
    /// Inode of the socket this door's last knock carried (0: none), so that [`Door::withdraw`]
    /// takes back its own knock and leaves other clients' queued.
    knocked: std::sync::atomic::AtomicU64,
}

impl Door {
    /// Finds the door of host pid `pid` and copies its client end. `Ok(None)`: the process has
    /// no door (it runs no agent). Errors: the process is gone, `/proc/<pid>/fd` is not ours to
    /// read, or `pidfd_getfd` is refused (no ptrace rights, or a kernel older than 5.6).
    pub fn open(pid: i32) -> io::Result<Option<Door>> {
        // The pidfd first: a pid reused after this point makes pidfd_getfd fail (ESRCH) rather
        // than copy another process's descriptor.
        let pidfd = pidfd_open(pid)?;
        let Some((client_fd, agent_end)) = find_label(pid)? else {
            return Ok(None);
        };
        let client = pidfd_getfd(pidfd.as_fd(), client_fd)?;
        if !is_seqpacket(client.as_fd()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "pid {pid}: descriptor {client_fd} named by the agent's door label is not a SEQPACKET unix socket"
                ),
            ));
        }
        Ok(Some(Door {
            pid,
            pidfd,
            client: Channel::new(client),
            agent_end,
            knocked: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    /// Knocks: sends one end of a fresh pair through the door, returns the other, which is
    /// connected to the agent once it takes the knock. Fails at once (`WouldBlock`) if the
    /// door's queue is full.
    pub fn knock(&self) -> io::Result<OwnedFd> {
        let (ours, theirs) = crate::seqpacket_pair()?;
        self.knocked
            .store(inode(theirs.as_fd())?, std::sync::atomic::Ordering::Relaxed);
        self.client
            .send_raw_now(KNOCK, Some(theirs.as_fd()))
            .map_err(|e| match e {
                ProtoError::Io(e) => e,
                other => io::Error::other(other.to_string()),
            })?;
        Ok(ours)
    }

    /// Empties the door when the agent is not taking knocks (hung or busy): this door's last
    /// knock and every other client's are taken out and closed (their clients see the
    /// connection end, as if the agent had refused it), and records that are not knocks are
    /// dropped, so that CRIU finds no descriptor in flight in the process. Queuing the others
    /// again would leave them there for the dump that follows. Returns how many of ours were
    /// taken (0 or 1).
    pub fn withdraw(&self) -> io::Result<usize> {
        let mine = self.knocked.load(std::sync::atomic::Ordering::Relaxed);
        let agent_end = Channel::new(pidfd_getfd(self.pidfd.as_fd(), self.agent_end)?);
        let mut ours = 0;
        loop {
            match take_knock(&agent_end) {
                Ok(Knock::Nothing) | Err(ProtoError::Closed) => break,
                Ok(Knock::Connection(fd)) if inode(fd.as_fd()).ok() == Some(mine) => ours += 1,
                // Closed as it drops: its client sees the connection end.
                Ok(Knock::Connection(_)) | Ok(Knock::Malformed(_)) => {}
                Err(ProtoError::Interrupted) => continue,
                Err(e) => return Err(io::Error::other(format!("pid {}: {e}", self.pid))),
            }
        }
        Ok(ours)
    }
}

/// Opens the door of `pid` and knocks once: a connection to its agent. `NotFound` when the
/// process has no door.
pub fn connect_agent(pid: i32) -> io::Result<OwnedFd> {
    match Door::open(pid)? {
        Some(d) => d.knock(),
        None => Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("pid {pid} has no gpusnap agent door in /proc/{pid}/fd"),
        )),
    }
}

/// The two numbers of a label's readlink text (`/memfd:gpusnap-agent-door:<c>:<a> (deleted)`).
pub fn parse_label(link: &str) -> Option<(RawFd, RawFd)> {
    let rest = link
        .strip_prefix("/memfd:")?
        .strip_prefix(DOOR_LABEL_PREFIX)?;
    let rest = rest.strip_suffix(" (deleted)").unwrap_or(rest);
    let (c, a) = rest.split_once(':')?;
    let num = |s: &str| -> Option<RawFd> {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    Some((num(c)?, num(a)?))
}

/// The door label of `pid`, if it has exactly one; two labels (which the agent never makes)
/// are refused rather than guessed between.
fn find_label(pid: i32) -> io::Result<Option<(RawFd, RawFd)>> {
    let mut found = None;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(link) = std::fs::read_link(entry?.path()) else {
            continue; // closed while we looked
        };
        if let Some(ends) = link.to_str().and_then(parse_label)
            && found.replace(ends).is_some()
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("pid {pid} holds more than one gpusnap agent door label"),
            ));
        }
    }
    Ok(found)
}

/// `pidfd_open(2)`: a descriptor that names process `pid` for good (a reused pid is another).
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `pidfd_getfd(2)`: a copy (close-on-exec) of descriptor `target_fd` of the process
/// `pidfd` names; needs ptrace rights over it.
pub fn pidfd_getfd(pidfd: BorrowedFd<'_>, target_fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: pidfd is an open pidfd; the call copies a descriptor of that process into ours
    // (CLOEXEC) or returns -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target_fd, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// The inode of `fd` (for a socket: what `/proc/<pid>/fd` shows as `socket:[inode]`).
fn inode(fd: BorrowedFd<'_>) -> io::Result<u64> {
    // SAFETY: stat is plain data; fstat fills it or fails.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is an open descriptor; st is writable.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.st_ino)
}

/// Whether `fd` is a unix `SOCK_SEQPACKET` socket.
fn is_seqpacket(fd: BorrowedFd<'_>) -> bool {
    let get = |opt| {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: v is a writable int and len holds its size.
        let rc = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&raw mut v).cast(),
                &mut len,
            )
        };
        (rc == 0).then_some(v)
    };
    get(libc::SO_DOMAIN) == Some(libc::AF_UNIX) && get(libc::SO_TYPE) == Some(libc::SOCK_SEQPACKET)
}
