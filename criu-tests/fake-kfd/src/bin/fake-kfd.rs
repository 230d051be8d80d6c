//! The stand-in KFD daemon: plays the kernel's `/dev/kfd` for the stand-in AMD process and for
//! gpusnap's plugin, over `<dir>/kfd.sock` (protocol: `gpusnap_rocm::kfd::standin`).
//!
//! Usage: `fake-kfd --dir DIR [--version MAJOR.MINOR]`
//!
//! What it keeps per KFD process (one per opened `kfd` file, as the kernel keeps one per
//! process that opened `/dev/kfd`): its devices (GPUs bound with a render node), its buffer
//! objects (each VRAM/GTT one backed by a memfd: host memory plays VRAM), one queue, and a state:
//!
//! ```text
//!   New --(ACQUIRE_VM/ALLOC/START)--> Running --PROCESS_INFO--> Paused --CHECKPOINT--> Checkpointed
//!   Running <--UNPAUSE-- Paused | Checkpointed
//!   New --RESTORE--> Restored --RESUME--> Running
//! ```
//!
//! While Running, its queue runs a "kernel" that adds 1 to the u64 at the start of its counter BO
//! every 5 ms; in every other state the queue is stopped, so a checkpoint sees still memory. CRIU
//! ops follow the kernel's rules as far as the stand-in can: the op acts on the process whose file
//! was passed (found with `kcmp`), the caller must be that process, or that process must be ptraced
//! (else `EBADF`, the kernel's rule), counts must match PROCESS_INFO's (`EINVAL`), ops out of order
//! are `EINVAL`, RESUME of an unknown pid is `ESRCH`, a RESTORE device's `drm_fd` must be the
//! caller's render node of that GPU. User pointers are read and written in the caller with
//! `process_vm_readv`/`writev`. Failures can be injected per op.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpusnap_rocm::kfd::standin::{self, request};
use gpusnap_rocm::kfd::sys::{
    self, KFD_INVALID_FD, KFD_IOC_ALLOC_MEM_FLAGS_GTT, KFD_IOC_ALLOC_MEM_FLAGS_VRAM,
    KfdCriuBoBucket, KfdCriuDeviceBucket, KfdCriuOp, KfdIoctlCriuArgs, KfdIoctlGetVersionArgs,
    wire,
};
use gpusnap_rocm::topology::{self, Gpu};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    New,
    Running,
    Paused,
    Checkpointed,
    Restored,
}

#[derive(Debug)]
struct Bo {
    addr: u64,
    size: u64,
    offset: u64,
    gpu_id: u32,
    flags: u32,
    /// Host memory playing VRAM/GTT (content BOs only).
    mem: Option<OwnedFd>,
}

#[derive(Debug, Clone, Copy)]
struct Queue {
    counter_va: u64,
    seed: u64,
}

#[derive(Debug)]
struct Process {
    id: u64,
    pid: i32,
    /// Tells when the process has exited (the kernel frees a KFD process with its mm).
    pidfd: OwnedFd,
    /// The opened `kfd` file (a reference, as the kernel's `struct file`).
    file: OwnedFd,
    devices: Vec<u32>,
    bos: Vec<Bo>,
    queue: Option<Queue>,
    state: State,
    next_offset: u64,
}

#[derive(Debug, Default)]
struct Inject {
    errno: i32,
    count: u32,
}

struct Daemon {
    dir: PathBuf,
    version: (u32, u32),
    gpus: Vec<Gpu>,
    processes: Vec<Process>,
    next_id: u64,
    inject: HashMap<u32, Inject>,
    unmappable: bool,
}

fn log(msg: &str) {
    eprintln!("fake-kfd: {msg}");
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(dir) = test_workload::arg(&args, "--dir") else {
        eprintln!("usage: fake-kfd --dir DIR [--version MAJOR.MINOR]");
        std::process::exit(2);
    };
    let version = test_workload::arg(&args, "--version")
        .and_then(|v| {
            let (a, b) = v.split_once('.')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .unwrap_or((1, 16));
    let dir = PathBuf::from(dir);
    let gpus = match topology::read_gpus(&dir.join(standin::TOPOLOGY)) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("fake-kfd: {e}");
            std::process::exit(1);
        }
    };
    let daemon = Arc::new(Mutex::new(Daemon {
        dir: dir.clone(),
        version,
        gpus,
        processes: Vec::new(),
        next_id: 1,
        inject: HashMap::new(),
        unmappable: false,
    }));
    let listener = match listen(&dir.join(standin::SOCKET_NAME)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("fake-kfd: listen: {e}");
            std::process::exit(1);
        }
    };
    {
        let d = daemon.clone();
        std::thread::spawn(move || queue_engine(&d));
    }
    log(&format!(
        "serving {} (KFD ioctl {}.{})",
        dir.display(),
        version.0,
        version.1
    ));
    loop {
        // SAFETY: accept4 on our listening socket.
        let raw = unsafe {
            libc::accept4(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if raw < 0 {
            continue;
        }
        // SAFETY: a fresh fd from accept4.
        let conn = unsafe { OwnedFd::from_raw_fd(raw) };
        let d = daemon.clone();
        std::thread::spawn(move || serve(&d, conn));
    }
}

fn listen(path: &Path) -> io::Result<OwnedFd> {
    let _ = std::fs::remove_file(path);
    // SAFETY: plain socket(2).
    let raw = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    let addr = standin::unix_addr(path)?;
    // SAFETY: a valid sockaddr_un and its size.
    if unsafe {
        libc::bind(
            sock.as_raw_fd(),
            std::ptr::from_ref(&addr).cast(),
            size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: listen on our socket.
    if unsafe { libc::listen(sock.as_raw_fd(), 64) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
}

fn peer_pid(conn: BorrowedFd<'_>) -> io::Result<i32> {
    // SAFETY: an all-zero ucred is valid.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED into a ucred of the given length.
    if unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::from_mut(&mut cred).cast(),
            &mut len,
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.pid)
}

fn serve(daemon: &Mutex<Daemon>, conn: OwnedFd) {
    let Ok((msg, fds)) = standin::recv_with_fds(conn.as_fd()) else {
        return;
    };
    let Ok(pid) = peer_pid(conn.as_fd()) else {
        return;
    };
    let result = if msg.len() < 8 {
        Err(errno(libc::EINVAL))
    } else {
        let kind = u32::from_le_bytes(msg[0..4].try_into().expect("4"));
        let word = u32::from_le_bytes(msg[4..8].try_into().expect("4"));
        let mut d = daemon.lock().unwrap_or_else(|e| e.into_inner());
        d.reap();
        d.handle(pid, kind, word, &msg[8..], fds)
    };
    let (reply, out_fds) = match result {
        Ok(r) => {
            let mut b = 0i32.to_le_bytes().to_vec();
            b.extend_from_slice(&r.0);
            (b, r.1)
        }
        Err(e) => (
            e.raw_os_error().unwrap_or(libc::EIO).to_le_bytes().to_vec(),
            vec![],
        ),
    };
    let borrowed: Vec<BorrowedFd<'_>> = out_fds.iter().map(AsFd::as_fd).collect();
    if let Err(e) = standin::send_with_fds(conn.as_fd(), &reply, &borrowed) {
        log(&format!("reply to pid {pid}: {e}"));
    }
}

type Reply = (Vec<u8>, Vec<OwnedFd>);

fn u32_at(b: &[u8], at: usize) -> io::Result<u32> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes(s.try_into().expect("4")))
        .ok_or_else(|| errno(libc::EINVAL))
}

fn u64_at(b: &[u8], at: usize) -> io::Result<u64> {
    b.get(at..at + 8)
        .map(|s| u64::from_le_bytes(s.try_into().expect("8")))
        .ok_or_else(|| errno(libc::EINVAL))
}

fn same_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> bool {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    // SAFETY: kcmp(KCMP_FILE) of two of our own fds; no memory is passed.
    unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            me,
            me,
            0, // KCMP_FILE
            a.as_raw_fd() as libc::c_ulong,
            b.as_raw_fd() as libc::c_ulong,
        ) == 0
    }
}

fn tracer_of(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .and_then(|v| v.trim().parse().ok())
}

fn read_user(pid: i32, addr: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    if len == 0 {
        return Ok(buf);
    }
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: process_vm_readv into our own buffer of `len` bytes; the remote side is checked
    // by the kernel (EFAULT), as copy_from_user would.
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    if n != len as isize {
        return Err(errno(libc::EFAULT));
    }
    Ok(buf)
}

fn write_user(pid: i32, addr: u64, data: &[u8]) -> io::Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    let local = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: process_vm_writev from our own buffer; the kernel checks the remote range.
    let n = unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) };
    if n != data.len() as isize {
        return Err(errno(libc::EFAULT));
    }
    Ok(())
}

fn memfd(size: u64) -> io::Result<OwnedFd> {
    // SAFETY: memfd_create with a static name.
    let raw = unsafe { libc::memfd_create(c"fake-vram".as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: ftruncate on our memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

fn dup(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    fd.try_clone_to_owned()
}

/// A pipe's read end: an fd that `mmap` refuses, to stand for a dma-buf that cannot be mapped.
fn unmappable_fd() -> io::Result<OwnedFd> {
    let mut p = [0; 2];
    // SAFETY: pipe2 into a local array.
    if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fds; the write end is closed right away.
    unsafe {
        libc::close(p[1]);
        Ok(OwnedFd::from_raw_fd(p[0]))
    }
}

fn pread_u64(fd: BorrowedFd<'_>) -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: pread into a local 8-byte buffer.
    unsafe { libc::pread(fd.as_raw_fd(), b.as_mut_ptr().cast(), 8, 0) };
    u64::from_le_bytes(b)
}

fn pwrite_all(fd: BorrowedFd<'_>, data: &[u8], at: u64) {
    // SAFETY: pwrite from a live buffer.
    unsafe {
        libc::pwrite(
            fd.as_raw_fd(),
            data.as_ptr().cast(),
            data.len(),
            at as libc::off_t,
        )
    };
}

/// The pattern the queue writes into a data BO.
fn pattern(seed: u64, index: usize, size: u64) -> Vec<u8> {
    let mut x = seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::with_capacity(size as usize);
    while (out.len() as u64) < size {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(size as usize);
    out
}

fn bo_hash(fd: BorrowedFd<'_>, size: u64) -> u64 {
    let mut buf = vec![0u8; size as usize];
    // SAFETY: pread into a buffer of `size` bytes.
    unsafe { libc::pread(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    xxhash_rust::xxh3::xxh3_64(&buf)
}

const PRIV_MAGIC: &[u8; 8] = b"SKFDPRV1";

/// The stand-in's private data: what the kernel keeps opaque (its queue), and what it checks
/// on RESTORE (the BOs it was made with), sealed with a checksum.
fn encode_priv(p: &Process) -> Vec<u8> {
    let mut b = PRIV_MAGIC.to_vec();
    b.extend_from_slice(&(p.bos.len() as u32).to_le_bytes());
    let q = p.queue.unwrap_or(Queue {
        counter_va: 0,
        seed: 0,
    });
    b.extend_from_slice(&u32::from(p.queue.is_some()).to_le_bytes());
    b.extend_from_slice(&q.counter_va.to_le_bytes());
    b.extend_from_slice(&q.seed.to_le_bytes());
    for bo in &p.bos {
        b.extend_from_slice(&bo.addr.to_le_bytes());
        b.extend_from_slice(&bo.size.to_le_bytes());
    }
    let sum = xxhash_rust::xxh3::xxh3_64(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    b
}

/// Checks private data against the BO buckets of a RESTORE; the queue it describes.
fn decode_priv(b: &[u8], bos: &[KfdCriuBoBucket]) -> io::Result<Option<Queue>> {
    let bad = || errno(libc::EINVAL);
    if b.len() < 8 + 4 + 4 + 16 + 8 || &b[..8] != PRIV_MAGIC {
        return Err(bad());
    }
    let (body, sum) = b.split_at(b.len() - 8);
    if xxhash_rust::xxh3::xxh3_64(body) != u64::from_le_bytes(sum.try_into().expect("8")) {
        return Err(bad());
    }
    let n = u32_at(body, 8)? as usize;
    if n != bos.len() || body.len() != 32 + n * 16 {
        return Err(bad());
    }
    for (i, bo) in bos.iter().enumerate() {
        if u64_at(body, 32 + i * 16)? != bo.addr || u64_at(body, 40 + i * 16)? != bo.size {
            return Err(bad());
        }
    }
    Ok((u32_at(body, 12)? == 1).then_some(Queue {
        counter_va: u64_at(body, 16)?,
        seed: u64_at(body, 24)?,
    }))
}

fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open(pid, 0) has no memory arguments.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd.
    Ok(unsafe { OwnedFd::from_raw_fd(raw as i32) })
}

fn exited(pidfd: BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll on one pollfd with no timeout.
    unsafe { libc::poll(&mut p, 1, 0) == 1 }
}

fn state_name(s: State) -> &'static str {
    match s {
        State::New => "new",
        State::Running => "running",
        State::Paused => "paused",
        State::Checkpointed => "checkpointed",
        State::Restored => "restored",
    }
}

/// What the daemon writes at a BO's mmap offset of the node it is mapped through.
pub const MAP_TAG: &[u8; 8] = b"SKFDMAP1";
/// What it writes at a restored BO's old offset.
pub const STALE_TAG: &[u8; 8] = b"STALEMAP";

impl Daemon {
    /// The node a BO of these flags on `gpu_id` is mapped through (`None`: not device-mapped).
    fn node_of(&self, flags: u32, gpu_id: u32) -> Option<PathBuf> {
        let through_kfd = gpusnap_rocm::kfd::vma::mapped_through_kfd(flags)?;
        if through_kfd {
            return Some(self.dir.join(standin::KFD_NODE));
        }
        let minor = self
            .gpus
            .iter()
            .find(|g| g.gpu_id == gpu_id)?
            .drm_render_minor?;
        Some(self.dir.join(standin::render_node_name(minor)))
    }

    /// Writes `tag` + `addr` at `offset` of the node a BO is mapped through (the CPU view of
    /// the BO there). Errors are logged: the tests read the tags and say what is missing.
    fn write_tag(&self, flags: u32, gpu_id: u32, offset: u64, tag: &[u8; 8], addr: u64) {
        let Some(node) = self.node_of(flags, gpu_id) else {
            return;
        };
        let mut b = tag.to_vec();
        b.extend_from_slice(&addr.to_le_bytes());
        match std::fs::OpenOptions::new().write(true).open(&node) {
            Ok(f) => pwrite_all(f.as_fd(), &b, offset),
            Err(e) => log(&format!("tag at {offset:#x} of {}: {e}", node.display())),
        }
    }

    /// Forgets processes that have exited.
    fn reap(&mut self) {
        self.processes.retain(|p| {
            let gone = exited(p.pidfd.as_fd());
            if gone {
                log(&format!(
                    "KFD process {} (pid {}) exited in state {}; freed",
                    p.id,
                    p.pid,
                    state_name(p.state)
                ));
            }
            !gone
        });
    }

    fn find_by_file(&self, f: BorrowedFd<'_>) -> Option<usize> {
        self.processes
            .iter()
            .position(|p| same_file(p.file.as_fd(), f))
    }

    fn handle(
        &mut self,
        peer: i32,
        kind: u32,
        word: u32,
        payload: &[u8],
        fds: Vec<OwnedFd>,
    ) -> io::Result<Reply> {
        match kind {
            request::OPEN => {
                let file = fds.into_iter().next().ok_or_else(|| errno(libc::EBADF))?;
                let id = self.next_id;
                self.next_id += 1;
                self.processes.push(Process {
                    id,
                    pid: peer,
                    pidfd: pidfd_open(peer)?,
                    file,
                    devices: vec![],
                    bos: vec![],
                    queue: None,
                    state: State::New,
                    next_offset: 0x1_0000_0000 * id,
                });
                log(&format!("pid {peer} opened kfd: KFD process {id}"));
                Ok((vec![], vec![]))
            }
            request::IOCTL => {
                let file = fds.first().ok_or_else(|| errno(libc::EBADF))?;
                match word {
                    sys::AMDKFD_IOC_GET_VERSION => {
                        self.find_by_file(file.as_fd())
                            .ok_or_else(|| errno(libc::EBADF))?;
                        let v = KfdIoctlGetVersionArgs {
                            major_version: self.version.0,
                            minor_version: self.version.1,
                        };
                        Ok((v.to_bytes().to_vec(), vec![]))
                    }
                    sys::AMDKFD_IOC_CRIU_OP => {
                        let mut args = KfdIoctlCriuArgs::from_bytes(payload)
                            .ok_or_else(|| errno(libc::EINVAL))?;
                        let fds = self.criu_op(peer, file.as_fd(), &mut args)?;
                        Ok((args.to_bytes().to_vec(), fds))
                    }
                    _ => Err(errno(libc::ENOTTY)),
                }
            }
            request::ACQUIRE_VM => {
                let gpu_id = u32_at(payload, 0)?;
                let (Some(kfd), Some(render)) = (fds.first(), fds.get(1)) else {
                    return Err(errno(libc::EBADF));
                };
                let minor = self
                    .gpus
                    .iter()
                    .find(|g| g.gpu_id == gpu_id)
                    .and_then(|g| g.drm_render_minor)
                    .ok_or_else(|| errno(libc::EINVAL))?;
                let want = self.dir.join(standin::render_node_name(minor));
                let got = std::fs::read_link(format!("/proc/self/fd/{}", render.as_raw_fd()))?;
                if got != want {
                    return Err(errno(libc::EINVAL));
                }
                let i = self
                    .find_by_file(kfd.as_fd())
                    .ok_or_else(|| errno(libc::EBADF))?;
                let p = &mut self.processes[i];
                if !p.devices.contains(&gpu_id) {
                    p.devices.push(gpu_id);
                }
                Ok((vec![], vec![]))
            }
            request::ALLOC => {
                let (gpu_id, flags) = (u32_at(payload, 0)?, u32_at(payload, 4)?);
                let (va, size) = (u64_at(payload, 8)?, u64_at(payload, 16)?);
                let kfd = fds.first().ok_or_else(|| errno(libc::EBADF))?;
                let i = self
                    .find_by_file(kfd.as_fd())
                    .ok_or_else(|| errno(libc::EBADF))?;
                let p = &mut self.processes[i];
                if !p.devices.contains(&gpu_id) || size == 0 {
                    return Err(errno(libc::EINVAL));
                }
                let mem =
                    if flags & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT) != 0 {
                        Some(memfd(size)?)
                    } else {
                        None
                    };
                let offset = p.next_offset;
                p.next_offset += size.next_multiple_of(4096);
                p.bos.push(Bo {
                    addr: va,
                    size,
                    offset,
                    gpu_id,
                    flags,
                    mem,
                });
                self.write_tag(flags, gpu_id, offset, MAP_TAG, va);
                Ok((offset.to_le_bytes().to_vec(), vec![]))
            }
            request::START => {
                let (counter_va, seed) = (u64_at(payload, 0)?, u64_at(payload, 8)?);
                let kfd = fds.first().ok_or_else(|| errno(libc::EBADF))?;
                let i = self
                    .find_by_file(kfd.as_fd())
                    .ok_or_else(|| errno(libc::EBADF))?;
                let p = &mut self.processes[i];
                if p.state != State::New
                    || !p
                        .bos
                        .iter()
                        .any(|b| b.addr == counter_va && b.mem.is_some())
                {
                    return Err(errno(libc::EINVAL));
                }
                for (k, bo) in p.bos.iter().enumerate() {
                    if bo.addr != counter_va
                        && let Some(m) = &bo.mem
                    {
                        pwrite_all(m.as_fd(), &pattern(seed, k, bo.size), 0);
                    }
                }
                p.queue = Some(Queue { counter_va, seed });
                p.state = State::Running;
                log(&format!("KFD process {} (pid {}) running", p.id, p.pid));
                Ok((vec![], vec![]))
            }
            request::STATUS => {
                let pid = u32_at(payload, 0)? as i32;
                let list: Vec<serde_json::Value> = self
                    .processes
                    .iter()
                    .filter(|p| pid == 0 || p.pid == pid)
                    .map(|p| {
                        let counter = p.queue.and_then(|q| {
                            p.bos.iter().find(|b| b.addr == q.counter_va)?.mem.as_ref().map(|m| pread_u64(m.as_fd()))
                        });
                        serde_json::json!({
                            "id": p.id,
                            "pid": p.pid,
                            "state": state_name(p.state),
                            "devices": p.devices,
                            "counter": counter,
                            "bos": p.bos.iter().map(|b| serde_json::json!({
                                "addr": b.addr,
                                "size": b.size,
                                "offset": b.offset,
                                "gpu_id": b.gpu_id,
                                "flags": b.flags,
                                "xxh3": b.mem.as_ref().filter(|_| p.queue.is_none_or(|q| q.counter_va != b.addr)).map(|m| bo_hash(m.as_fd(), b.size)),
                            })).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                let v = serde_json::json!({ "processes": list });
                Ok((serde_json::to_vec(&v).expect("json"), vec![]))
            }
            request::INJECT => {
                let (op, e, count) = (
                    u32_at(payload, 0)?,
                    u32_at(payload, 4)? as i32,
                    u32_at(payload, 8)?,
                );
                self.inject.insert(op, Inject { errno: e, count });
                log(&format!(
                    "the next {count} CRIU op {op} will fail with errno {e}"
                ));
                Ok((vec![], vec![]))
            }
            request::UNMAPPABLE_DMABUFS => {
                self.unmappable = u32_at(payload, 0)? != 0;
                Ok((vec![], vec![]))
            }
            _ => Err(errno(libc::EINVAL)),
        }
    }

    /// The dma-buf handed out for a BO.
    fn export(&self, bo: &Bo) -> io::Result<OwnedFd> {
        if self.unmappable {
            return unmappable_fd();
        }
        dup(bo.mem.as_ref().ok_or_else(|| errno(libc::EINVAL))?.as_fd())
    }

    fn criu_op(
        &mut self,
        peer: i32,
        file: BorrowedFd<'_>,
        args: &mut KfdIoctlCriuArgs,
    ) -> io::Result<Vec<OwnedFd>> {
        if let Some(inj) = self.inject.get_mut(&args.op)
            && inj.count > 0
        {
            inj.count -= 1;
            log(&format!(
                "CRIU op {} from pid {peer}: injected errno {}",
                args.op, inj.errno
            ));
            return Err(errno(inj.errno));
        }
        if args.op == KfdCriuOp::Resume as u32 {
            // RESUME names its process by pid; the file may be any KFD file.
            self.find_by_file(file).ok_or_else(|| errno(libc::EBADF))?;
            let p = self
                .processes
                .iter_mut()
                .rev()
                .find(|p| p.pid == args.pid as i32 && p.state != State::New)
                .ok_or_else(|| errno(libc::ESRCH))?;
            if p.state != State::Restored {
                return Err(errno(libc::EINVAL));
            }
            p.state = State::Running;
            log(&format!(
                "RESUME: KFD process {} (pid {}) running",
                p.id, p.pid
            ));
            return Ok(vec![]);
        }
        let i = self.find_by_file(file).ok_or_else(|| errno(libc::EBADF))?;
        let target = self.processes[i].pid;
        // The kernel's rule (kfd_ioctl): a file of another process may be used only while that
        // process is ptraced (`ptrace_parent(lead_thread)`), as CRIU's seized tasks are.
        if peer != target && tracer_of(target).unwrap_or(0) == 0 {
            log(&format!(
                "CRIU op {} from pid {peer} on pid {target}'s file: that process is not traced (EBADF)",
                args.op
            ));
            return Err(errno(libc::EBADF));
        }
        let op = args.op;
        if op == KfdCriuOp::ProcessInfo as u32 {
            let p = &mut self.processes[i];
            if p.state != State::Running {
                return Err(errno(libc::EINVAL));
            }
            p.state = State::Paused;
            args.num_devices = p.devices.len() as u32;
            args.num_bos = p.bos.len() as u32;
            args.num_objects = u32::from(p.queue.is_some());
            args.priv_data_size = encode_priv(p).len() as u64;
            args.pid = p.pid as u32;
            log(&format!(
                "PROCESS_INFO: KFD process {} (pid {}) paused",
                p.id, p.pid
            ));
            Ok(vec![])
        } else if op == KfdCriuOp::Checkpoint as u32 {
            let p = &self.processes[i];
            if p.state != State::Paused {
                return Err(errno(libc::EINVAL));
            }
            let priv_data = encode_priv(p);
            if args.num_devices as usize != p.devices.len()
                || args.num_bos as usize != p.bos.len()
                || args.num_objects != u32::from(p.queue.is_some())
                || args.priv_data_size != priv_data.len() as u64
            {
                return Err(errno(libc::EINVAL));
            }
            let mut devs = Vec::new();
            for g in &p.devices {
                devs.extend_from_slice(
                    &KfdCriuDeviceBucket {
                        user_gpu_id: *g,
                        actual_gpu_id: 0,
                        drm_fd: 0,
                        pad: 0,
                    }
                    .to_bytes(),
                );
            }
            let mut bos = Vec::new();
            let mut fds = Vec::new();
            for bo in &p.bos {
                let dmabuf_fd = if bo.mem.is_some() {
                    fds.push(self.export(bo)?);
                    (fds.len() - 1) as u32
                } else {
                    KFD_INVALID_FD
                };
                bos.extend_from_slice(
                    &KfdCriuBoBucket {
                        addr: bo.addr,
                        size: bo.size,
                        offset: bo.offset,
                        restored_offset: 0,
                        gpu_id: bo.gpu_id,
                        alloc_flags: bo.flags,
                        dmabuf_fd,
                        pad: 0,
                    }
                    .to_bytes(),
                );
            }
            write_user(peer, args.devices, &devs)?;
            write_user(peer, args.bos, &bos)?;
            write_user(peer, args.priv_data, &priv_data)?;
            let p = &mut self.processes[i];
            p.state = State::Checkpointed;
            log(&format!(
                "CHECKPOINT: KFD process {} (pid {}): {} devices, {} BOs, {} dma-bufs",
                p.id,
                p.pid,
                p.devices.len(),
                p.bos.len(),
                fds.len()
            ));
            Ok(fds)
        } else if op == KfdCriuOp::Unpause as u32 {
            let p = &mut self.processes[i];
            if !matches!(p.state, State::Paused | State::Checkpointed) {
                return Err(errno(libc::EINVAL));
            }
            p.state = State::Running;
            log(&format!(
                "UNPAUSE: KFD process {} (pid {}) running",
                p.id, p.pid
            ));
            Ok(vec![])
        } else if op == KfdCriuOp::Restore as u32 {
            self.restore(peer, i, args)
        } else {
            Err(errno(libc::EINVAL))
        }
    }

    fn restore(
        &mut self,
        peer: i32,
        i: usize,
        args: &mut KfdIoctlCriuArgs,
    ) -> io::Result<Vec<OwnedFd>> {
        if self.processes[i].pid != peer || self.processes[i].state != State::New {
            return Err(errno(libc::EINVAL));
        }
        let n_dev = args.num_devices as usize;
        let n_bo = args.num_bos as usize;
        if n_dev > 64 || n_bo > 4096 || args.priv_data_size > 1 << 20 {
            return Err(errno(libc::EINVAL));
        }
        let devs = read_user(peer, args.devices, n_dev * wire::DEVICE_BUCKET_LEN)?;
        let bos_b = read_user(peer, args.bos, n_bo * wire::BO_BUCKET_LEN)?;
        let priv_data = read_user(peer, args.priv_data, args.priv_data_size as usize)?;
        let devs: Vec<KfdCriuDeviceBucket> = devs
            .chunks(wire::DEVICE_BUCKET_LEN)
            .filter_map(KfdCriuDeviceBucket::from_bytes)
            .collect();
        let mut bos: Vec<KfdCriuBoBucket> = bos_b
            .chunks(wire::BO_BUCKET_LEN)
            .filter_map(KfdCriuBoBucket::from_bytes)
            .collect();
        // Devices: each actual GPU exists here and drm_fd is the caller's render node of it.
        let mut map = HashMap::new();
        for d in &devs {
            let g = self
                .gpus
                .iter()
                .find(|g| g.gpu_id == d.actual_gpu_id)
                .ok_or_else(|| errno(libc::ENODEV))?;
            let want = self
                .dir
                .join(standin::render_node_name(g.drm_render_minor.unwrap_or(0)));
            let got = std::fs::read_link(format!("/proc/{peer}/fd/{}", d.drm_fd))
                .map_err(|_| errno(libc::EBADF))?;
            if got != want {
                log(&format!(
                    "RESTORE: drm_fd {} is {} but gpu_id {} is {}",
                    d.drm_fd,
                    got.display(),
                    d.actual_gpu_id,
                    want.display()
                ));
                return Err(errno(libc::EINVAL));
            }
            map.insert(d.user_gpu_id, d.actual_gpu_id);
        }
        if bos.iter().any(|b| !map.contains_key(&b.gpu_id)) {
            return Err(errno(libc::EINVAL));
        }
        let queue = decode_priv(&priv_data, &bos)?;
        if args.num_objects != u32::from(queue.is_some()) {
            return Err(errno(libc::EINVAL));
        }
        let mut new_bos = Vec::with_capacity(bos.len());
        let mut fds = Vec::new();
        let p = &mut self.processes[i];
        for b in &mut bos {
            let mem = if b.alloc_flags
                & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT)
                != 0
            {
                Some(memfd(b.size)?)
            } else {
                None
            };
            let offset = p.next_offset;
            p.next_offset += b.size.next_multiple_of(4096);
            b.restored_offset = offset;
            new_bos.push(Bo {
                addr: b.addr,
                size: b.size,
                offset,
                gpu_id: b.gpu_id,
                flags: b.alloc_flags,
                mem,
            });
        }
        for (b, nb) in bos.iter_mut().zip(&new_bos) {
            b.dmabuf_fd = if let Some(mem) = &nb.mem {
                fds.push(if self.unmappable {
                    unmappable_fd()?
                } else {
                    dup(mem.as_fd())?
                });
                (fds.len() - 1) as u32
            } else {
                KFD_INVALID_FD
            };
        }
        let out: Vec<u8> = bos.iter().flat_map(|b| b.to_bytes()).collect();
        write_user(peer, args.bos, &out)?;
        for b in &bos {
            let actual = map.get(&b.gpu_id).copied().unwrap_or(b.gpu_id);
            self.write_tag(b.alloc_flags, b.gpu_id, b.offset, STALE_TAG, b.addr);
            self.write_tag(b.alloc_flags, actual, b.restored_offset, MAP_TAG, b.addr);
        }
        let p = &mut self.processes[i];
        p.devices = devs.iter().map(|d| d.user_gpu_id).collect();
        p.bos = new_bos;
        p.queue = queue;
        p.state = State::Restored;
        log(&format!(
            "RESTORE: KFD process {} (pid {}): {} devices (gpu_ids {:?}), {} BOs; queues wait for RESUME",
            p.id,
            p.pid,
            devs.len(),
            map,
            p.bos.len()
        ));
        Ok(fds)
    }
}

/// The GPU's work: while a process runs, its counter goes up every 5 ms.
fn queue_engine(daemon: &Mutex<Daemon>) {
    loop {
        std::thread::sleep(Duration::from_millis(5));
        let mut d = daemon.lock().unwrap_or_else(|e| e.into_inner());
        d.reap();
        for p in d.processes.iter().filter(|p| p.state == State::Running) {
            let Some(q) = p.queue else { continue };
            if let Some(m) = p
                .bos
                .iter()
                .find(|b| b.addr == q.counter_va)
                .and_then(|b| b.mem.as_ref())
            {
                let v = pread_u64(m.as_fd()).wrapping_add(1);
                pwrite_all(m.as_fd(), &v.to_le_bytes(), 0);
            }
        }
    }
}
