//! The stand-in KFD of the tests, as seen from its callers (the plugin and the stand-in AMD
//! process), and its wire protocol. The daemon that plays the kernel is `fake-kfd/`.
//!
//! A stand-in KFD lives in one directory:
//! - `kfd` and `renderD<minor>`: character-device nodes made with `mknod` of a device CRIU does
//!   not handle itself (the tests use the FUSE misc device, 10:229), so that a process holding
//!   them reaches CRIU's plugin hooks (`DUMP_EXT_FILE`, `RESTORE_EXT_FILE`) exactly as a real
//!   `/dev/kfd` and `/dev/dri/renderD*` do;
//! - `topology/`: a KFD topology tree in the kernel's layout;
//! - `kfd.sock`: the daemon's `SOCK_SEQPACKET` socket.
//!
//! An ioctl becomes one request on a fresh connection: the ioctl number, the argument
//! structure's bytes (the C layout, [`super::sys::wire`]) and, by `SCM_RIGHTS`, the file the
//! ioctl is made on. The daemon finds the KFD process by that file (as the kernel does: CRIU ops
//! act on the process that opened it), reads and writes the caller's memory at the structure's
//! user pointers with `process_vm_readv`/`writev` (as `copy_from_user`/`copy_to_user`), and
//! returns the dma-buf fds of CHECKPOINT and RESTORE by `SCM_RIGHTS`, which this side puts into
//! the BO buckets in place of the indexes the daemon wrote there. Opening the `kfd` node is
//! followed by an `Open` request, since no kernel sees the open.
//!
//! It is test-only: the plugin uses it only when `GPUSNAP_TEST_STANDIN_KFD` names a directory.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use super::device::{DeviceFile, KfdDevice, open_device};
use super::sys::{
    self, KFD_INVALID_FD, KfdCriuBoBucket, KfdCriuOp, KfdIoctlCriuArgs, KfdIoctlGetVersionArgs,
    wire,
};
use super::{KfdError, KfdVersion};

/// The environment variable that names a stand-in KFD directory (tests only).
pub const STANDIN_ENV: &str = "GPUSNAP_TEST_STANDIN_KFD";
pub const SOCKET_NAME: &str = "kfd.sock";
pub const KFD_NODE: &str = "kfd";
pub const TOPOLOGY: &str = "topology";

/// Largest message either way.
pub const MAX_MESSAGE: usize = 1 << 20;
/// Most fds in one message (the kernel's `SCM_MAX_FD`).
pub const MAX_FDS: usize = 253;

/// `renderD<minor>`
pub fn render_node_name(minor: u32) -> String {
    format!("renderD{minor}")
}

/// Request kinds (first u32 of a request).
pub mod request {
    /// The caller opened the `kfd` node; fds: [that file].
    pub const OPEN: u32 = 1;
    /// An ioctl; word 2: its number; payload: the argument bytes; fds: [the file].
    pub const IOCTL: u32 = 2;
    /// Stand-in process API (what ROCr would do through other KFD ioctls): bind a GPU.
    /// payload: gpu_id u32; fds: [kfd, render node].
    pub const ACQUIRE_VM: u32 = 3;
    /// Allocate a buffer object. payload: gpu_id u32, flags u32, va u64, size u64; fds: `[kfd]`.
    /// Reply payload: mmap offset u64.
    pub const ALLOC: u32 = 4;
    /// Start the process's queue: a "kernel" that fills BO `va` with a pattern of `seed` once,
    /// then counts ticks into the first 8 bytes of BO `counter_va` while the queue runs.
    /// payload: va u64, seed u64, counter_va u64; fds: `[kfd]`.
    pub const START: u32 = 5;
    /// Tests: the state of the KFD process of `pid`, as JSON. payload: pid u32.
    pub const STATUS: u32 = 6;
    /// Tests: make the next `count` CRIU ops `op` fail with `errno`.
    /// payload: op u32, errno i32, count u32.
    pub const INJECT: u32 = 7;
    /// Tests: dma-bufs handed out from now on cannot be mapped. payload: on u32.
    pub const UNMAPPABLE_DMABUFS: u32 = 8;
}

/// A stand-in KFD at a directory.
#[derive(Debug, Clone)]
pub struct StandinKfd {
    dir: PathBuf,
}

impl StandinKfd {
    pub fn new(dir: impl Into<PathBuf>) -> StandinKfd {
        StandinKfd { dir: dir.into() }
    }

    /// The stand-in named by [`STANDIN_ENV`], if set.
    pub fn from_env() -> Option<StandinKfd> {
        let dir = std::env::var_os(STANDIN_ENV)?;
        Some(StandinKfd::new(dir))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn kfd_path(&self) -> PathBuf {
        self.dir.join(KFD_NODE)
    }

    /// One request and its reply: `Ok((payload, fds))` or the errno the daemon answered.
    pub fn call(
        &self,
        kind: u32,
        word: u32,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
        let sock = connect_seqpacket(&self.dir.join(SOCKET_NAME))?;
        let mut msg = Vec::with_capacity(8 + payload.len());
        msg.extend_from_slice(&kind.to_le_bytes());
        msg.extend_from_slice(&word.to_le_bytes());
        msg.extend_from_slice(payload);
        send_with_fds(sock.as_fd_borrowed(), &msg, fds)?;
        let (reply, fds) = recv_with_fds(sock.as_fd_borrowed())?;
        if reply.len() < 4 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "stand-in KFD closed the connection without an answer",
            ));
        }
        let errno = i32::from_le_bytes(reply[..4].try_into().expect("4 bytes"));
        if errno != 0 {
            return Err(io::Error::from_raw_os_error(errno));
        }
        Ok((reply[4..].to_vec(), fds))
    }
}

impl KfdDevice for StandinKfd {
    fn describe(&self) -> String {
        format!("stand-in KFD at {}", self.dir.display())
    }

    fn topology_dir(&self) -> PathBuf {
        self.dir.join(TOPOLOGY)
    }

    fn render_path(&self, minor: u32) -> PathBuf {
        self.dir.join(render_node_name(minor))
    }

    fn block_nodes(&self) -> bool {
        true
    }

    fn classify(&self, path: &Path, _rdev: u64) -> Option<DeviceFile> {
        if path.parent() != Some(self.dir.as_path()) {
            return None;
        }
        let name = path.file_name()?.to_str()?;
        if name == KFD_NODE {
            return Some(DeviceFile::Kfd);
        }
        let minor = name.strip_prefix("renderD")?.parse().ok()?;
        Some(DeviceFile::Render { minor })
    }

    fn open_kfd(&self) -> Result<OwnedFd, KfdError> {
        let fd = open_device(&self.kfd_path())?;
        let borrowed = fd.as_fd_borrowed();
        self.call(request::OPEN, 0, &[], &[borrowed])
            .map_err(|source| KfdError::Ioctl { op: "open", source })?;
        Ok(fd)
    }

    fn version(&self, fd: BorrowedFd<'_>) -> Result<KfdVersion, KfdError> {
        let args = KfdIoctlGetVersionArgs::default();
        let (reply, _) = self
            .call(
                request::IOCTL,
                sys::AMDKFD_IOC_GET_VERSION,
                &args.to_bytes(),
                &[fd],
            )
            .map_err(|source| KfdError::Ioctl {
                op: "GET_VERSION",
                source,
            })?;
        let args = KfdIoctlGetVersionArgs::from_bytes(&reply).ok_or_else(|| KfdError::Ioctl {
            op: "GET_VERSION",
            source: io::Error::new(io::ErrorKind::InvalidData, "short reply"),
        })?;
        Ok(KfdVersion {
            major: args.major_version,
            minor: args.minor_version,
        })
    }

    unsafe fn criu_op(&self, fd: BorrowedFd<'_>, args: &mut KfdIoctlCriuArgs) -> io::Result<()> {
        let (reply, fds) = self.call(
            request::IOCTL,
            sys::AMDKFD_IOC_CRIU_OP,
            &args.to_bytes(),
            &[fd],
        )?;
        *args = KfdIoctlCriuArgs::from_bytes(&reply)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "short CRIU_OP reply"))?;
        let op = args.op;
        if (op == KfdCriuOp::Checkpoint as u32 || op == KfdCriuOp::Restore as u32) && args.bos != 0
        {
            let mut fds: Vec<Option<OwnedFd>> = fds.into_iter().map(Some).collect();
            for i in 0..args.num_bos as usize {
                let at =
                    (args.bos as usize + i * size_of::<KfdCriuBoBucket>()) as *mut KfdCriuBoBucket;
                // SAFETY: the caller guarantees `args.bos` points at `num_bos` buckets valid
                // for reads and writes; the daemon does not change `bos` or `num_bos`.
                let bucket = unsafe { &mut *at };
                if bucket.dmabuf_fd == KFD_INVALID_FD {
                    continue;
                }
                let fd = fds
                    .get_mut(bucket.dmabuf_fd as usize)
                    .and_then(Option::take)
                    .ok_or_else(|| {
                        io::Error::new(io::ErrorKind::InvalidData, "dma-buf index out of range")
                    })?;
                bucket.dmabuf_fd = fd.into_raw_fd() as u32;
            }
        }
        Ok(())
    }
}

/// The bytes of a `wire` structure must fit a message.
const _: () = assert!(wire::CRIU_ARGS_LEN + 8 < MAX_MESSAGE);

/// A borrowed view of an owned fd, without importing `AsFd` everywhere.
trait AsFdBorrowed {
    fn as_fd_borrowed(&self) -> BorrowedFd<'_>;
}

impl AsFdBorrowed for OwnedFd {
    fn as_fd_borrowed(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.as_fd()
    }
}

/// A connected `SOCK_SEQPACKET` unix socket to `path`, close-on-exec.
pub fn connect_seqpacket(path: &Path) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2).
    let raw = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new fd that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    let addr = unix_addr(path)?;
    loop {
        // SAFETY: `addr` is a valid sockaddr_un of the given length.
        let rc = unsafe {
            libc::connect(
                sock.as_raw_fd(),
                std::ptr::from_ref(&addr).cast(),
                size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            return Ok(sock);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A `sockaddr_un` for `path` (refused when too long).
pub fn unix_addr(path: &Path) -> io::Result<libc::sockaddr_un> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: an all-zero sockaddr_un is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket path {} is too long", path.display()),
        ));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Ok(addr)
}

/// Sends one message with `fds` attached.
pub fn send_with_fds(sock: BorrowedFd<'_>, msg: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS || msg.len() > MAX_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "message too large",
        ));
    }
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE((raw.len() * size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u8; space.max(1)];
    let mut iov = libc::iovec {
        iov_base: msg.as_ptr() as *mut libc::c_void,
        iov_len: msg.len(),
    };
    // SAFETY: an all-zero msghdr is valid; its pointers are filled in below.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    if !raw.is_empty() {
        hdr.msg_control = control.as_mut_ptr().cast();
        hdr.msg_controllen = space as _;
        // SAFETY: `control` is CMSG_SPACE bytes for `raw.len()` fds, so the first header and
        // its data fit; CMSG_FIRSTHDR/CMSG_DATA point inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&hdr);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN((raw.len() * size_of::<RawFd>()) as u32) as _;
            std::ptr::copy_nonoverlapping(
                raw.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(c),
                raw.len() * size_of::<RawFd>(),
            );
        }
    }
    loop {
        // SAFETY: `hdr` points at live buffers (`iov`, `msg`, `control`) for the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &hdr, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives one message and the fds attached to it (close-on-exec). An empty message means
/// the peer closed the connection.
pub fn recv_with_fds(sock: BorrowedFd<'_>) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid; its pointers are filled in below.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    hdr.msg_control = control.as_mut_ptr().cast();
    hdr.msg_controllen = space as _;
    let n = loop {
        // SAFETY: `hdr` points at live buffers for the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut hdr, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control messages recvmsg filled in, with the libc macros, inside
    // `control`; each SCM_RIGHTS payload is an array of fds the kernel installed for us, which
    // we take ownership of exactly once.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&hdr);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for k in 0..len / size_of::<RawFd>() {
                    let fd =
                        std::ptr::read_unaligned(data.add(k * size_of::<RawFd>()).cast::<RawFd>());
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&hdr, c);
        }
    }
    if hdr.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "message truncated",
        ));
    }
    buf.truncate(n);
    Ok((buf, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_names_in_the_directory_only() {
        let k = StandinKfd::new("/tmp/standin");
        assert_eq!(
            k.classify(Path::new("/tmp/standin/kfd"), 0),
            Some(DeviceFile::Kfd)
        );
        assert_eq!(
            k.classify(Path::new("/tmp/standin/renderD130"), 0),
            Some(DeviceFile::Render { minor: 130 })
        );
        assert_eq!(k.classify(Path::new("/tmp/other/kfd"), 0), None);
        assert_eq!(k.classify(Path::new("/tmp/standin/card0"), 0), None);
        assert_eq!(k.classify(Path::new("/dev/kfd"), 0), None);
    }

    #[test]
    fn fds_travel_with_messages() {
        let mut sv = [0; 2];
        // SAFETY: socketpair into a local array.
        let rc = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
                0,
                sv.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0);
        // SAFETY: fresh fds from socketpair.
        let (a, b) = unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) };
        let f = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsFd;
        send_with_fds(a.as_fd(), b"hello", &[f.as_fd(), f.as_fd()]).unwrap();
        let (msg, fds) = recv_with_fds(b.as_fd()).unwrap();
        assert_eq!(msg, b"hello");
        assert_eq!(fds.len(), 2);
        let p = std::fs::read_link(format!("/proc/self/fd/{}", fds[1].as_raw_fd())).unwrap();
        assert_eq!(p, PathBuf::from("/dev/null"));
    }

    #[test]
    fn a_missing_daemon_is_an_error() {
        let k = StandinKfd::new("/nonexistent/standin");
        let err = k.call(request::STATUS, 0, &[], &[]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
