//! Abstract-namespace `SOCK_SEQPACKET` unix sockets: the agent's name, listening, connecting,
//! accepting, and the peer's credentials.
//!
//! Abstract names live in the network namespace of the socket's creator, carry no file-system
//! permissions (so the peer check, [`peer_cred`], is what guards the agent), and CRIU dumps and
//! restores a listening one together with its process.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Prefix of the agent's socket name (after the leading NUL).
pub const AGENT_SOCKET_PREFIX: &str = "gpusnap-agent-";
/// Backlog of the agent's listener.
pub const LISTEN_BACKLOG: i32 = 8;

/// `"\0gpusnap-agent-<nspid>"`: the agent's abstract socket name, `nspid` being the agent's pid
/// in its own pid namespace.
pub fn agent_socket_name(nspid: i32) -> Vec<u8> {
    let mut name = vec![0u8];
    name.extend_from_slice(AGENT_SOCKET_PREFIX.as_bytes());
    name.extend_from_slice(nspid.to_string().as_bytes());
    name
}

/// Binds and listens on the agent's socket (`SOCK_CLOEXEC`, backlog [`LISTEN_BACKLOG`]).
pub fn bind_agent_listener(nspid: i32) -> io::Result<OwnedFd> {
    bind_abstract_listener(&agent_socket_name(nspid))
}

/// Connects to the agent of `nspid`, in the caller's current network namespace.
pub fn connect_agent(nspid: i32) -> io::Result<OwnedFd> {
    connect_abstract(&agent_socket_name(nspid))
}

/// `sockaddr_un` for an abstract name (which must start with a NUL byte).
fn abstract_addr(name: &[u8]) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if name.first() != Some(&0) || name.len() < 2 || name.len() > addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "abstract socket name must start with NUL and fit sun_path",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path.iter_mut().zip(name) {
        *dst = *src as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + name.len();
    Ok((addr, len as libc::socklen_t))
}

fn seqpacket_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked before it is owned.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a freshly created descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Binds a listening `SOCK_SEQPACKET` socket to an abstract `name` (leading NUL included).
pub fn bind_abstract_listener(name: &[u8]) -> io::Result<OwnedFd> {
    let (addr, len) = abstract_addr(name)?;
    let fd = seqpacket_socket()?;
    // SAFETY: addr is a valid sockaddr_un of `len` bytes; fd is an open socket.
    let rc = unsafe { libc::bind(fd.as_raw_fd(), (&raw const addr).cast(), len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a bound socket.
    if unsafe { libc::listen(fd.as_raw_fd(), LISTEN_BACKLOG) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Connects a `SOCK_SEQPACKET` socket to an abstract `name` (leading NUL included).
pub fn connect_abstract(name: &[u8]) -> io::Result<OwnedFd> {
    let (addr, len) = abstract_addr(name)?;
    let fd = seqpacket_socket()?;
    loop {
        // SAFETY: addr is a valid sockaddr_un of `len` bytes; fd is an open socket.
        let rc = unsafe { libc::connect(fd.as_raw_fd(), (&raw const addr).cast(), len) };
        if rc == 0 {
            return Ok(fd);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Accepts one connection (`accept4` with `SOCK_CLOEXEC`), retrying on EINTR.
pub fn accept_connection(listener: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    loop {
        // SAFETY: listener is an open listening socket; we do not want the peer address.
        let fd = unsafe {
            libc::accept4(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if fd >= 0 {
            // SAFETY: accept4 returned a new descriptor that nothing else owns.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            // The connection died before we took it: try the next one.
            Some(libc::EINTR) | Some(libc::ECONNABORTED) => continue,
            _ => return Err(e),
        }
    }
}

/// The connected peer's pid, uid and gid as of connect time (`SO_PEERCRED`), pid as seen in the
/// caller's pid namespace.
pub fn peer_cred(fd: BorrowedFd<'_>) -> io::Result<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred is a writable ucred and len holds its size.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "SO_PEERCRED returned a short ucred",
        ));
    }
    Ok(cred)
}

/// A connected pair of `SOCK_SEQPACKET` sockets (`SOCK_CLOEXEC`), e.g. for tests.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: fds has room for the two descriptors socketpair writes.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}
