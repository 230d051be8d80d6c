//! The one error type of the protocol crate: what can go wrong decoding a message or using a socket.

use crate::MAX_MESSAGE;

/// Errors of message decoding and of the socket layer.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// A socket call failed (errno preserved).
    #[error("socket I/O failed: {0}")]
    Io(std::io::Error),
    /// A blocking call was interrupted by a signal (EINTR); nothing was sent or received.
    #[error("interrupted by a signal")]
    Interrupted,
    /// No message arrived within the given timeout.
    #[error("timed out waiting for a message")]
    Timeout,
    /// The peer closed the connection.
    #[error("peer closed the connection")]
    Closed,
    /// The message has the right kind but its body is wrong (length, enum value, UTF-8, ...).
    #[error("malformed message: {0}")]
    Malformed(&'static str),
    /// The header names a message kind this side does not know.
    #[error("unknown message kind {0:#06x}")]
    UnknownKind(u16),
    /// The first four bytes are not the gpusnap magic.
    #[error("bad magic: not a gpusnap message")]
    BadMagic,
    /// The header carries another protocol version.
    #[error("protocol version mismatch: ours {ours}, theirs {theirs}")]
    VersionMismatch {
        /// [`crate::PROTOCOL_VERSION`].
        ours: u16,
        /// The version in the received header.
        theirs: u16,
    },
    /// The kernel cut the control data: the attached descriptors could not all be received,
    /// because the receiver is at its descriptor limit or more were sent than fit.
    #[error(
        "a descriptor sent with the message was dropped by the kernel (control data cut): the receiving process is at its RLIMIT_NOFILE descriptor limit, or more descriptors were sent than one message may carry"
    )]
    DescriptorsDropped,
    /// More than one file descriptor was attached (all of them were closed).
    #[error("message carried {0} file descriptors, at most 1 is allowed")]
    TooManyFds(usize),
    /// A file descriptor came with a message that never carries one (it was closed).
    #[error("message carried a file descriptor where none is expected")]
    UnexpectedFd,
    /// The message was longer than [`MAX_MESSAGE`] bytes (the rest was discarded).
    #[error("message longer than {MAX_MESSAGE} bytes")]
    TooLong,
}

impl ProtoError {
    /// Maps an OS error to the typed variants (EINTR, peer gone) or wraps it.
    pub(crate) fn from_io(e: std::io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::EINTR) => ProtoError::Interrupted,
            Some(libc::EPIPE) | Some(libc::ECONNRESET) | Some(libc::ENOTCONN) => ProtoError::Closed,
            _ => ProtoError::Io(e),
        }
    }
}
