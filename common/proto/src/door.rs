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
//! A knock queued in the door carries a descriptor whose peer lives in the client, which CRIU
//! cannot dump (`External socket is used`, `Unix socket ... not found`); so does a connection
//! the agent holds. Three things keep any from being there when CRIU dumps the process's
//! descriptors, whoever knocks and however often:
//! - The agent serves a connection only once it has sent a well-formed request, and closes at
//!   once one that sends anything else; idle ones wait beside newer knocks, a few at most, and
//!   never hold the door. From a dump's `DumpBegin` or `LendBegin` until the door is opened
//!   again (below) it takes only the dumper's knocks: it reads each queued knock's sender first
//!   (`SO_PASSCRED`, `MSG_PEEK`, [`take_knock_from`]) and drops another's without its
//!   descriptor ever entering the process ([`Knock::Refused`]).
//! - [`seal_door`]: once a dump has stopped the agent's thread for the last time, the plugin
//!   shuts the door down (`shutdown(SHUT_RDWR)` of the agent's end, which makes every copy of
//!   the client end fail with `EPIPE`, copied before or after) and takes out whatever was
//!   queued. Nothing can be queued afterwards until the agent's thread runs again and opens a
//!   new door ([`renew_door`]: a new pair at the same numbers, the label unchanged), which also
//!   cuts off every client that copied the old client end. [`Door::open`] waits a little for that
//!   when it finds the door sealed.
//! - [`Door::withdraw`] empties the door when the agent did not take a client's knock (hung or
//!   busy), its own knock and any other client's.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::channel::RawRecord;
use crate::pid::{HostPid, NsPid};
use crate::{Channel, ForeignFd, ProtoError};

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

/// How long [`Door::open`] waits for an agent to open a sealed door again ([`seal_door`]): the
/// agent does it within milliseconds of its thread running, and every client of the plugin lets
/// that thread run before it connects.
const RENEWAL_WAIT: Duration = Duration::from_secs(2);

/// Creates the door's pair and its label (all `CLOEXEC`); the agent's end says who sent each
/// record (`SO_PASSCRED`, for [`take_knock_from`]).
pub fn install_door() -> io::Result<DoorInside> {
    let (agent_end, client_end) = crate::seqpacket_pair()?;
    set_passcred(agent_end.as_fd())?;
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
    /// A record from a sender [`take_knock_from`] was told not to take: dropped without its
    /// descriptor ever entering this process. The sender as the kernel names it in the
    /// agent's (the job's) pid namespace (pid 0: not visible there).
    Refused { pid: NsPid, uid: u32 },
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

/// Takes one knock from the agent's end, without waiting, if `accept` takes its sender (pid
/// and uid as `SCM_CREDENTIALS` give them); another sender's record is dropped without its
/// descriptor entering this process ([`Knock::Refused`]). A record queued before `SO_PASSCRED`
/// was set says pid 0, uid `u32::MAX`. `Err(Closed)`: the door is shut and empty.
pub fn take_knock_from(
    agent_end: &Channel,
    accept: impl FnOnce(NsPid, u32) -> bool,
) -> Result<Knock, ProtoError> {
    let Some((pid, uid)) = recv_sender(agent_end.fd(), libc::MSG_PEEK)? else {
        return Ok(Knock::Nothing);
    };
    if accept(pid, uid) {
        return take_knock(agent_end);
    }
    // The same record (only this thread reads the agent's end while the agent runs), taken
    // with room for the credentials alone: the kernel closes its descriptors.
    Ok(match recv_sender(agent_end.fd(), 0)? {
        Some((pid, uid)) => Knock::Refused { pid, uid },
        None => Knock::Nothing,
    })
}

/// One `recvmsg` of the agent's end (`MSG_DONTWAIT`, plus `flags`) with room for the sender's
/// credentials and no descriptor: any descriptor attached is closed by the kernel, never
/// installed here (`MSG_CTRUNC`). The sender's (pid, uid); `None` when nothing is queued;
/// `Err(Closed)` when the end is shut down and empty.
fn recv_sender(fd: BorrowedFd<'_>, flags: libc::c_int) -> Result<Option<(NsPid, u32)>, ProtoError> {
    /// Exactly one `SCM_CREDENTIALS` header and its `ucred`, aligned for `cmsghdr`.
    #[repr(C, align(8))]
    struct CredBuf([u8; 32]);
    const UCRED: u32 = std::mem::size_of::<libc::ucred>() as u32;
    // SAFETY: CMSG_SPACE is pure arithmetic.
    let space = unsafe { libc::CMSG_SPACE(UCRED) } as usize;
    const _: () = assert!(std::mem::size_of::<CredBuf>() >= 32);
    let mut cbuf = CredBuf([0; 32]);
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: byte.len(),
    };
    // SAFETY: msghdr is plain old data; all-zero is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr().cast();
    msg.msg_controllen = space.min(cbuf.0.len()) as _;
    // SAFETY: msg describes live, writable buffers (byte, cbuf) of the given lengths.
    let n = unsafe {
        libc::recvmsg(
            fd.as_raw_fd(),
            &mut msg,
            flags | libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN) => Ok(None),
            _ => Err(ProtoError::from_io(e)),
        };
    }
    let mut sender = None;
    // SAFETY: CMSG_LEN is pure arithmetic.
    let cred_len = unsafe { libc::CMSG_LEN(UCRED) } as usize;
    // SAFETY: msg was filled by recvmsg; the CMSG_* walk stays within msg_controllen.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: cmsg is a header inside the control buffer (CMSG_FIRSTHDR/NXTHDR checked it).
        let (level, ty, len) = unsafe {
            (
                (*cmsg).cmsg_level,
                (*cmsg).cmsg_type,
                (*cmsg).cmsg_len as usize,
            )
        };
        if level == libc::SOL_SOCKET && ty == libc::SCM_CREDENTIALS && len >= cred_len {
            // SAFETY: the data area of this header holds one ucred written by the kernel.
            let c: libc::ucred =
                unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::ucred>()) };
            // The kernel's pid_t: never negative (0 for a sender it cannot name here).
            sender = Some((NsPid(c.pid as u32), c.uid));
        }
        // SAFETY: msg and cmsg are valid as above.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    match sender {
        Some(s) => Ok(Some(s)),
        // A record without credentials (sent before SO_PASSCRED was set) is still a record.
        None if n > 0 || msg.msg_flags & libc::MSG_CTRUNC != 0 => Ok(Some((NsPid(0), u32::MAX))),
        None => Err(ProtoError::Closed),
    }
}

/// `SO_PASSCRED` on `fd`: each record received says who sent it.
fn set_passcred(fd: BorrowedFd<'_>) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: on is a valid int of the size given.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PASSCRED,
            (&raw const on).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether the door end `fd` is shut down ([`seal_door`] shut it, or the other end is gone):
/// `POLLHUP` or `POLLRDHUP`.
pub fn door_sealed(fd: BorrowedFd<'_>) -> bool {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: pfd is one valid pollfd; a zero timeout never blocks.
    let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
    rc > 0 && pfd.revents & (libc::POLLHUP | libc::POLLRDHUP) != 0
}

/// The agent's side, when it finds its door sealed ([`door_sealed`]): a new pair is put at the
/// very numbers of the old one (`dup3`, which closes the old ends), so the label still names
/// the door; every client that copied the old client end is cut off for good (`EPIPE`).
/// `agent_end` and `client_end` are the agent's own descriptors of the door.
pub fn renew_door(agent_end: BorrowedFd<'_>, client_end: BorrowedFd<'_>) -> io::Result<()> {
    let (agent_new, client_new) = crate::seqpacket_pair()?;
    set_passcred(agent_new.as_fd())?;
    // The agent's end first: until the client end is replaced too, a client copies the old,
    // shut one and waits ([`Door::open`]); never a client end whose peer is not the agent's.
    for (new, old) in [(&agent_new, agent_end), (&client_new, client_end)] {
        // SAFETY: dup3 atomically makes `old`'s number name `new`'s socket (closing the old
        // socket); both numbers are the agent's own door descriptors, which nothing else in
        // the process uses, and `new` is closed again when it drops below.
        if unsafe { libc::dup3(new.as_raw_fd(), old.as_raw_fd(), libc::O_CLOEXEC) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The client's side: the client end of a process's door, copied out of it.
#[derive(Debug)]
pub struct Door {
    pid: HostPid,
    pidfd: OwnedFd,
    client: Channel,
    /// The agent's end of the door, as the target numbers it.
    agent_end: ForeignFd,
    /// Inode of the socket this door's last knock carried (0: none), so that [`Door::withdraw`]
    /// takes back its own knock and leaves other clients' queued.
    knocked: std::sync::atomic::AtomicU64,
}

impl Door {
    /// Finds the door of host pid `pid` and copies its client end. `Ok(None)`: the process has
    /// no door (it runs no agent). Errors: the process is gone, `/proc/<pid>/fd` is not ours to
    /// read, or `pidfd_getfd` is refused (no ptrace rights, or a kernel older than 5.6).
    pub fn open(pid: HostPid) -> io::Result<Option<Door>> {
        // The pidfd first: a pid reused after this point makes pidfd_getfd fail (ESRCH) rather
        // than copy another process's descriptor.
        let pidfd = pidfd_open(pid)?;
        let deadline = Instant::now() + RENEWAL_WAIT;
        loop {
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
            // A door sealed by a dump: the agent opens a new one once its thread runs.
            if door_sealed(client.as_fd()) {
                if Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    format!(
                        "pid {pid}: the agent's door is sealed (a dump closed it; the agent opens a new one when its thread runs) and stayed so for {RENEWAL_WAIT:?}"
                    ),
                ));
            }
            return Ok(Some(Door {
                pid,
                pidfd,
                client: Channel::new(client),
                agent_end,
                knocked: std::sync::atomic::AtomicU64::new(0),
            }));
        }
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
    /// taken (0 or 1). Knocks that come later are [`seal_door`]'s.
    pub fn withdraw(&self) -> io::Result<usize> {
        let mine = self.knocked.load(std::sync::atomic::Ordering::Relaxed);
        let agent_end = Channel::new(pidfd_getfd(self.pidfd.as_fd(), self.agent_end)?);
        drain(&agent_end, mine)
            .map(|(_, ours)| ours)
            .map_err(|e| io::Error::other(format!("pid {}: {e}", self.pid)))
    }
}

/// Takes every record out of a door's agent end and closes it: (all taken, those whose socket
/// has inode `mine`).
fn drain(agent_end: &Channel, mine: u64) -> Result<(usize, usize), ProtoError> {
    let (mut all, mut ours) = (0, 0);
    loop {
        match take_knock(agent_end) {
            Ok(Knock::Nothing) | Err(ProtoError::Closed) => return Ok((all, ours)),
            Ok(Knock::Connection(fd)) => {
                all += 1;
                if mine != 0 && inode(fd.as_fd()).ok() == Some(mine) {
                    ours += 1;
                }
                // Closed as it drops: its client sees the connection end.
            }
            Ok(Knock::Malformed(_) | Knock::Refused { .. }) => all += 1,
            Err(ProtoError::Interrupted) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Seals the door of host pid `pid` for the rest of a dump (the plugin, once the agent's thread
/// is stopped until CRIU has dumped the process's descriptors): the agent's end is shut down,
/// so that every knock from now on fails (`EPIPE`), whoever sends it and whenever they copied
/// the client end, and every knock queued is taken out and closed. CRIU then finds nothing in
/// flight in the process. The agent opens a new door when its thread runs again
/// ([`renew_door`]; a rollback, a restore and `gpusnap recover` let it run before they
/// connect). `Ok(None)`: the process has no door; else how many records were taken out.
pub fn seal_door(pid: HostPid) -> io::Result<Option<usize>> {
    let pidfd = pidfd_open(pid)?;
    let Some((_, agent_fd)) = find_label(pid)? else {
        return Ok(None);
    };
    let agent_end = pidfd_getfd(pidfd.as_fd(), agent_fd)?;
    if !is_seqpacket(agent_end.as_fd()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "pid {pid}: descriptor {agent_fd} named by the agent's door label is not a SEQPACKET unix socket"
            ),
        ));
    }
    // SAFETY: shutdown on a socket descriptor we own (a copy of the agent's end).
    if unsafe { libc::shutdown(agent_end.as_raw_fd(), libc::SHUT_RDWR) } != 0 {
        return Err(io::Error::last_os_error());
    }
    drain(&Channel::new(agent_end), 0)
        .map(|(all, _)| Some(all))
        .map_err(|e| io::Error::other(format!("pid {pid}: {e}")))
}

/// Opens the door of `pid` and knocks once: a connection to its agent. `NotFound` when the
/// process has no door.
pub fn connect_agent(pid: HostPid) -> io::Result<OwnedFd> {
    match Door::open(pid)? {
        Some(d) => d.knock(),
        None => Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("pid {pid} has no gpusnap agent door in /proc/{pid}/fd"),
        )),
    }
}

/// The two numbers of a label's readlink text (`/memfd:gpusnap-agent-door:<c>:<a> (deleted)`):
/// the client end's and the agent end's descriptor numbers in the process that holds the label
/// (its numbering, not ours: its door is found as [`ForeignFd`]s).
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

/// The door label of `pid`, if it has exactly one: the numbers of its client end and agent end
/// in `pid`. Two labels (which the agent never makes) are refused rather than guessed between.
fn find_label(pid: HostPid) -> io::Result<Option<(ForeignFd, ForeignFd)>> {
    let mut found = None;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(link) = std::fs::read_link(entry?.path()) else {
            continue; // closed while we looked
        };
        let ends = link.to_str().and_then(parse_label);
        if let Some(ends) = ends.and_then(|(c, a)| Some((ForeignFd::new(c)?, ForeignFd::new(a)?)))
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
pub fn pidfd_open(pid: HostPid) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.get(), 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `pidfd_getfd(2)`: a copy (close-on-exec) of descriptor `target_fd` of the process
/// `pidfd` names; needs ptrace rights over it.
pub fn pidfd_getfd(pidfd: BorrowedFd<'_>, target_fd: ForeignFd) -> io::Result<OwnedFd> {
    // SAFETY: pidfd is an open pidfd; the call copies a descriptor of that process into ours
    // (CLOEXEC) or returns -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target_fd.get(), 0) };
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

#[cfg(test)]
mod tests {
    //! The building blocks on a plain pair (a label would make a second door in this process,
    //! beside `tests.rs`'s).
    use super::*;

    /// Knocks; returns the knocker's end and the inode of the socket the knock carried.
    fn knock_on(client: &Channel) -> (OwnedFd, u64) {
        let (ours, theirs) = crate::seqpacket_pair().unwrap();
        client.send_raw_now(KNOCK, Some(theirs.as_fd())).unwrap();
        (ours, inode(theirs.as_fd()).unwrap())
    }

    /// Whether a descriptor of this process is the socket of inode `ino`.
    fn installed(ino: u64) -> bool {
        let name = format!("socket:[{ino}]");
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy() == name))
    }

    /// A knock `take_knock_from` refuses is taken out without its descriptor entering this
    /// process (the knocker sees its connection end); one it accepts is a connection. A sealed
    /// door refuses every knock, from any copy of its client end, and says so; renewed at the
    /// same numbers, it takes knocks again and every old copy stays cut off.
    #[test]
    fn refused_knocks_never_enter_and_a_sealed_door_is_renewed() {
        let (agent_end, client_end) = crate::seqpacket_pair().unwrap();
        set_passcred(agent_end.as_fd()).unwrap();
        let agent = Channel::new(agent_end);
        let client = Channel::new(client_end);
        let me = NsPid(std::process::id());

        let (refused, ino) = knock_on(&client);
        let mut seen = None;
        let k = take_knock_from(&agent, |pid, uid| {
            seen = Some((pid, uid));
            false
        })
        .unwrap();
        assert!(
            matches!(k, Knock::Refused { pid, .. } if pid == me),
            "{k:?}"
        );
        // SAFETY: getuid has no preconditions.
        assert_eq!(seen, Some((me, unsafe { libc::getuid() })));
        assert!(!installed(ino), "the refused knock's socket was installed");
        let refused = Channel::new(refused);
        assert!(matches!(
            refused.recv_reply(Some(Duration::from_secs(5))),
            Err(ProtoError::Closed)
        ));
        assert!(matches!(
            take_knock_from(&agent, |_, _| true),
            Ok(Knock::Nothing)
        ));

        let _accepted = knock_on(&client);
        assert!(matches!(
            take_knock_from(&agent, |pid, _| pid == me),
            Ok(Knock::Connection(_))
        ));

        // Sealed: a knock queued before is still taken out, none gets in after.
        let old_copy = Channel::new(client.fd().try_clone_to_owned().unwrap());
        let _queued = knock_on(&client);
        assert!(!door_sealed(agent.fd()));
        // SAFETY: shutdown of a socket we own.
        let rc = unsafe { libc::shutdown(agent.fd().as_raw_fd(), libc::SHUT_RDWR) };
        assert_eq!(rc, 0);
        assert!(door_sealed(agent.fd()) && door_sealed(client.fd()));
        assert_eq!(drain(&agent, 0).unwrap(), (1, 0));
        let (_ours, theirs) = crate::seqpacket_pair().unwrap();
        assert!(client.send_raw_now(KNOCK, Some(theirs.as_fd())).is_err());
        assert!(matches!(
            take_knock_from(&agent, |_, _| true),
            Err(ProtoError::Closed)
        ));

        // Renewed at the same numbers: knocks get in again, the old copy does not.
        let numbers = (agent.fd().as_raw_fd(), client.fd().as_raw_fd());
        renew_door(agent.fd(), client.fd()).unwrap();
        assert_eq!(numbers, (agent.fd().as_raw_fd(), client.fd().as_raw_fd()));
        assert!(!door_sealed(agent.fd()) && !door_sealed(client.fd()));
        assert!(old_copy.send_raw_now(KNOCK, Some(theirs.as_fd())).is_err());
        let _again = knock_on(&client);
        assert!(matches!(
            take_knock_from(&agent, |pid, _| pid == me),
            Ok(Knock::Connection(_))
        ));
    }
}
