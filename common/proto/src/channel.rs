//! [`Channel`]: one connection; sends and receives whole messages, optionally with one file
//! descriptor attached (SCM_RIGHTS).
//!
//! `SOCK_SEQPACKET` keeps message boundaries and `sendmsg` of one record is atomic, so several
//! threads may send on one channel concurrently. Sends use `MSG_NOSIGNAL` (a closed peer is
//! [`ProtoError::Closed`], never SIGPIPE); received descriptors get `MSG_CMSG_CLOEXEC`.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::{MAX_MESSAGE, ProtoError, Reply, Request};

/// Descriptors accepted in one message's control data before the kernel truncates it; more
/// than one is refused anyway, the room only lets us close the extras cleanly.
const MAX_FDS_RECEIVED: usize = 8;

/// Control-message buffer, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct CmsgBuf([u8; 128]);

const _: () = assert!(
    std::mem::size_of::<libc::cmsghdr>() + MAX_FDS_RECEIVED * std::mem::size_of::<libc::c_int>()
        <= 128
);

/// Whether a send may wait for room in the peer's queue.
#[derive(Clone, Copy)]
enum Blocking {
    Wait,
    Never,
}

/// One record as received, undecoded.
pub(crate) struct RawRecord {
    pub bytes: Vec<u8>,
    pub fd: Option<OwnedFd>,
}

/// One received message: its bytes and the descriptors that came with it.
struct Received {
    buf: [u8; MAX_MESSAGE],
    len: usize,
    fd: Option<OwnedFd>,
}

/// One connection between the plugin and an agent.
#[derive(Debug)]
pub struct Channel {
    fd: OwnedFd,
}

impl Channel {
    /// Wraps a connected `SOCK_SEQPACKET` socket.
    pub fn new(fd: OwnedFd) -> Self {
        Channel { fd }
    }

    /// A connected pair of channels (socketpair), e.g. for tests.
    pub fn pair() -> std::io::Result<(Channel, Channel)> {
        let (a, b) = crate::seqpacket_pair()?;
        Ok((Channel::new(a), Channel::new(b)))
    }

    /// The socket, given back (e.g. to close it at a chosen moment).
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// The socket.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Sends a request (of the type the peer serves: [`crate::AgentRequest`] to a job's agent,
    /// [`crate::KeeperRequest`] to a keeper), with `attach` passed as SCM_RIGHTS if given.
    /// EINTR is [`ProtoError::Interrupted`] (nothing was sent; the caller may retry).
    pub fn send_request<R: Request>(
        &self,
        r: &R,
        attach: Option<BorrowedFd<'_>>,
    ) -> Result<(), ProtoError> {
        let mut buf = [0u8; MAX_MESSAGE];
        let n = r.encode(&mut buf);
        self.send_raw(&buf[..n], attach)
    }

    /// Sends a reply. EINTR is [`ProtoError::Interrupted`] (nothing was sent).
    pub fn send_reply(&self, r: &Reply) -> Result<(), ProtoError> {
        #[cfg(feature = "hostile")]
        return crate::hostile::send(self, r, None);
        #[cfg(not(feature = "hostile"))]
        self.send_raw_reply(r, None)
    }

    /// Sends a reply with `attach` passed as SCM_RIGHTS (a hand-over's exported descriptor).
    pub fn send_reply_with(&self, r: &Reply, attach: BorrowedFd<'_>) -> Result<(), ProtoError> {
        #[cfg(feature = "hostile")]
        return crate::hostile::send(self, r, Some(attach));
        #[cfg(not(feature = "hostile"))]
        self.send_raw_reply(r, Some(attach))
    }

    /// Encodes and sends a reply as it is (the test build's hostile interposer calls this).
    pub(crate) fn send_raw_reply(
        &self,
        r: &Reply,
        attach: Option<BorrowedFd<'_>>,
    ) -> Result<(), ProtoError> {
        let mut buf = [0u8; MAX_MESSAGE];
        let n = r.encode(&mut buf);
        self.send_raw(&buf[..n], attach)
    }

    /// Waits at most `timeout` for a reply that may carry one descriptor (a hand-over's).
    pub fn recv_reply_with_fd(
        &self,
        timeout: Option<Duration>,
    ) -> Result<(Reply, Option<OwnedFd>), ProtoError> {
        let m = self.recv_wait(timeout)?;
        Ok((Reply::decode(&m.buf[..m.len])?, m.fd))
    }

    /// Waits at most `timeout` (None = forever) for a request of the type this end serves
    /// (another type's is [`ProtoError::UnknownKind`]). EINTR returns
    /// [`ProtoError::Interrupted`]; a closed peer [`ProtoError::Closed`]. Returns the attached
    /// descriptor, if any (at most one is accepted).
    pub fn recv_request<R: Request>(
        &self,
        timeout: Option<Duration>,
    ) -> Result<(R, Option<OwnedFd>), ProtoError> {
        let m = self.recv_wait(timeout)?;
        Ok((R::decode(&m.buf[..m.len])?, m.fd))
    }

    /// Waits at most `timeout` (None = forever) for a reply; as [`Channel::recv_request`], and a
    /// descriptor attached to a reply is an error.
    pub fn recv_reply(&self, timeout: Option<Duration>) -> Result<Reply, ProtoError> {
        let m = self.recv_wait(timeout)?;
        Self::reply_of(m)
    }

    /// A request if one is queued now (`MSG_DONTWAIT`), as [`Channel::recv_request`].
    pub fn try_recv_request<R: Request>(&self) -> Result<Option<(R, Option<OwnedFd>)>, ProtoError> {
        match self.recv_once(libc::MSG_DONTWAIT)? {
            None => Ok(None),
            Some(m) => Ok(Some((R::decode(&m.buf[..m.len])?, m.fd))),
        }
    }

    /// A reply if one is queued now (`MSG_DONTWAIT`).
    pub fn try_recv_reply(&self) -> Result<Option<Reply>, ProtoError> {
        match self.recv_once(libc::MSG_DONTWAIT)? {
            None => Ok(None),
            Some(m) => Self::reply_of(m).map(Some),
        }
    }

    fn reply_of(m: Received) -> Result<Reply, ProtoError> {
        if m.fd.is_some() {
            return Err(ProtoError::UnexpectedFd);
        }
        Reply::decode(&m.buf[..m.len])
    }

    fn send_raw(&self, bytes: &[u8], attach: Option<BorrowedFd<'_>>) -> Result<(), ProtoError> {
        self.send_raw_with(bytes, attach, Blocking::Wait)
    }

    /// Sends one record without waiting for room (`MSG_DONTWAIT`): a full queue is an `EAGAIN`
    /// I/O error. For the agent's door, whose other end may belong to a busy agent.
    pub(crate) fn send_raw_now(
        &self,
        bytes: &[u8],
        attach: Option<BorrowedFd<'_>>,
    ) -> Result<(), ProtoError> {
        self.send_raw_with(bytes, attach, Blocking::Never)
    }

    /// The bytes and descriptor of one record if one is queued now (`MSG_DONTWAIT`), without
    /// decoding it: for the agent's door, whose records are not protocol messages.
    pub(crate) fn try_recv_raw(&self) -> Result<Option<RawRecord>, ProtoError> {
        Ok(self.recv_once(libc::MSG_DONTWAIT)?.map(|m| RawRecord {
            bytes: m.buf[..m.len].to_vec(),
            fd: m.fd,
        }))
    }

    fn send_raw_with(
        &self,
        bytes: &[u8],
        attach: Option<BorrowedFd<'_>>,
        blocking: Blocking,
    ) -> Result<(), ProtoError> {
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: bytes.len(),
        };
        let mut cbuf = CmsgBuf([0; 128]);
        // SAFETY: msghdr is plain old data; all-zero is valid (no name, no control).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(fd) = attach {
            let raw = fd.as_raw_fd();
            let fd_len = std::mem::size_of::<libc::c_int>() as u32;
            // SAFETY: CMSG_SPACE is pure arithmetic.
            let space = unsafe { libc::CMSG_SPACE(fd_len) } as usize;
            msg.msg_control = cbuf.0.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            // SAFETY: msg_control points at `space` (<= 128) aligned bytes, so the first header fits.
            let cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
            if cmsg.is_null() {
                return Err(ProtoError::Malformed("no room for the control message"));
            }
            // SAFETY: cmsg points into cbuf with room for a header and one int (CMSG_SPACE above).
            unsafe {
                (*cmsg).cmsg_level = libc::SOL_SOCKET;
                (*cmsg).cmsg_type = libc::SCM_RIGHTS;
                (*cmsg).cmsg_len = libc::CMSG_LEN(fd_len) as _;
                std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), raw);
            }
        }
        loop {
            let flags = match blocking {
                Blocking::Wait => libc::MSG_NOSIGNAL,
                Blocking::Never => libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            };
            // SAFETY: msg points at a live iovec over `bytes` and, if set, at the control buffer.
            let n = unsafe { libc::sendmsg(self.fd.as_raw_fd(), &msg, flags) };
            if n >= 0 {
                if n as usize != bytes.len() {
                    return Err(ProtoError::Io(std::io::Error::other(
                        "short send of a SEQPACKET record",
                    )));
                }
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EAGAIN) && matches!(blocking, Blocking::Wait) {
                // Only on a socket someone made non-blocking: wait until it drains.
                self.poll(libc::POLLOUT, -1)?;
                continue;
            }
            return Err(ProtoError::from_io(e));
        }
    }

    /// poll(2) on the socket; Ok(false) on timeout.
    fn poll(&self, events: libc::c_short, timeout_ms: libc::c_int) -> Result<bool, ProtoError> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events,
            revents: 0,
        };
        // SAFETY: pfd is one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if rc < 0 {
            return Err(ProtoError::from_io(std::io::Error::last_os_error()));
        }
        Ok(rc > 0)
    }

    fn recv_wait(&self, timeout: Option<Duration>) -> Result<Received, ProtoError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let wait_ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    // Round up so we never spin with a zero timeout before the deadline.
                    let ms = left.as_nanos().div_ceil(1_000_000);
                    libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
                }
            };
            if !self.poll(libc::POLLIN, wait_ms)? {
                return Err(ProtoError::Timeout);
            }
            if let Some(m) = self.recv_once(libc::MSG_DONTWAIT)? {
                return Ok(m);
            }
            // Woken but nothing to read (another reader took it): wait again.
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(ProtoError::Timeout);
            }
        }
    }

    /// One recvmsg; Ok(None) when nothing is queued (EAGAIN with MSG_DONTWAIT).
    fn recv_once(&self, flags: libc::c_int) -> Result<Option<Received>, ProtoError> {
        let mut buf = [0u8; MAX_MESSAGE];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut cbuf = CmsgBuf([0; 128]);
        // SAFETY: msghdr is plain old data; all-zero is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.0.as_mut_ptr().cast();
        msg.msg_controllen = cbuf.0.len() as _;
        // SAFETY: msg describes live, writable buffers (buf, cbuf) of the given lengths.
        let n = unsafe {
            libc::recvmsg(
                self.fd.as_raw_fd(),
                &mut msg,
                flags | libc::MSG_CMSG_CLOEXEC,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) => Ok(None),
                _ => Err(ProtoError::from_io(e)),
            };
        }
        // Take ownership of every received descriptor first, so each is closed whatever happens.
        let fds = Self::take_fds(&msg);
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(ProtoError::DescriptorsDropped);
        }
        if n == 0 && fds.is_empty() {
            return Err(ProtoError::Closed);
        }
        if msg.msg_flags & libc::MSG_TRUNC != 0 {
            return Err(ProtoError::TooLong);
        }
        if fds.len() > 1 {
            return Err(ProtoError::TooManyFds(fds.len()));
        }
        Ok(Some(Received {
            buf,
            len: n as usize,
            fd: fds.into_iter().next(),
        }))
    }

    fn take_fds(msg: &libc::msghdr) -> Vec<OwnedFd> {
        let mut fds = Vec::new();
        // SAFETY: msg was filled by recvmsg; the CMSG_* walk stays within msg_controllen.
        let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(msg) };
        while !cmsg.is_null() {
            // SAFETY: cmsg is a header inside the control buffer (CMSG_FIRSTHDR/NXTHDR checked it).
            let (level, ty, len) = unsafe {
                (
                    (*cmsg).cmsg_level,
                    (*cmsg).cmsg_type,
                    (*cmsg).cmsg_len as usize,
                )
            };
            if level == libc::SOL_SOCKET && ty == libc::SCM_RIGHTS {
                // SAFETY: CMSG_LEN is pure arithmetic.
                let header = unsafe { libc::CMSG_LEN(0) } as usize;
                let count = len.saturating_sub(header) / std::mem::size_of::<libc::c_int>();
                // SAFETY: the data area of this header holds `count` ints written by the kernel.
                let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<libc::c_int>();
                for i in 0..count {
                    // SAFETY: i < count, within the data area; the value is a descriptor the
                    // kernel just installed in this process, owned by nobody else.
                    let raw = unsafe { std::ptr::read_unaligned(data.add(i)) };
                    if raw >= 0 {
                        // SAFETY: see above.
                        fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
                    }
                }
            }
            // SAFETY: msg and cmsg are valid as above.
            cmsg = unsafe { libc::CMSG_NXTHDR(msg, cmsg) };
        }
        fds
    }
}
