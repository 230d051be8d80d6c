//! Legacy CUDA IPC for the allocations the agent converted.
//!
//! The driver's `cuIpcGetMemHandle` refuses VMM memory, and a converted `cuMemAlloc` is VMM
//! memory: without this module a program that shares device memory with another process
//! (PyTorch's `torch.multiprocessing`) would fail only because the agent is loaded. The 64 bytes
//! of a `CUipcMemHandle` are opaque to programs, so the agent puts its own [`Token`] there and
//! serves the handle itself:
//!
//! - Exporter (`cuIpcGetMemHandle` of a pointer in a converted, exportable allocation): the
//!   allocation's physical memory is exported as a POSIX fd (once per allocation, on the
//!   application's thread, kept until `cuMemFree`), and the token names this process, its
//!   random key and the allocation, and the service's name. The first export binds the service:
//!   a `SOCK_SEQPACKET` listener on the abstract name `gpusnap-ipc:<pid>:<name>`, where `<name>`
//!   is 128 random bits of its own, not the key (so nobody can bind the name first, and the name,
//!   which `/proc/net/unix` shows every user, tells nothing of the key), and the thread
//!   `gpusnap-ipc` that serves it (all signals blocked; it makes no CUDA call, it only hands out
//!   the fds kept).
//! - Importer (`cuIpcOpenMemHandle_v2` of a token): one short connection to the exporter's
//!   name (connect, check the peer, ask, receive the fd with `SCM_RIGHTS`, close), then
//!   `cuMemImportFromShareableHandle` + reserve + map + set access on the current context's
//!   device; the base address is returned, as the driver returns the allocation's base.
//!   Opening it again in this process returns the same address and counts;
//!   `cuIpcCloseMemHandle` of the address drops one count, the last unmaps.
//! - Who may: the exporter serves only its own user or root (`SO_PEERCRED` of the
//!   connection); the importer takes memory only from the process the token names (peer pid)
//!   running as its own user or root. The name is not a secret (`/proc/net/unix` lists it); it
//!   only cannot be taken before the exporter has it, and it holds no key. Nothing waits without a bound: the
//!   importer's socket times out ([`CLIENT_TIMEOUT`]), the server's connections too
//!   ([`SERVE_TIMEOUT`]), and the server's lock waits are bounded.
//! - Handles that are not tokens go to the driver untouched. Anything that fails returns the
//!   driver's own answer for memory it cannot share or a handle it cannot open
//!   (`CUDA_ERROR_INVALID_VALUE`), never other memory; the cause is in the debug log.
//!
//! Both sides record their hazard (`SERVED_IPC_EXPORT`, `SERVED_IPC_IMPORT`). The split path
//! carries such shares when every process of them is in the dump (`docs/ipc.md`): a release
//! unmaps this process's imports too ([`release_imports`], reservations kept), the exporter
//! hands the plugin a descriptor of each exported allocation's current memory ([`share_fds`]),
//! and the importer maps it again at the same address ([`reimport`]) before any thread runs.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, MutexGuard, Once, TryLockError};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUdeviceptr;
use gpusnap_proto::pid::NsPid;
use gpusnap_proto::{Share, ShareKind, hazard};

use crate::cu::CuError;
use crate::log::debug;
use crate::real::{
    CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_VALUE, CUDA_SUCCESS, CuRes, Driver,
};
use crate::table::{self, Backing};

/// Bytes of a `CUipcMemHandle`.
pub const HANDLE_BYTES: usize = 64;
const _: () = assert!(std::mem::size_of::<cudarc::driver::sys::CUipcMemHandle>() == HANDLE_BYTES);

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: the one flag `cuIpcOpenMemHandle` takes.
pub const LAZY_ENABLE_PEER_ACCESS: u32 = 1;

/// How long an importer's application thread may wait for the exporter's agent, in all.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the server gives one connection to send its request and take the reply.
pub const SERVE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the server thread waits for the IPC state's lock (an application thread stopped by
/// a tracer may hold it).
const LOCK_WAIT: Duration = Duration::from_millis(500);

/// The serving thread's name.
pub const THREAD_NAME: &str = "gpusnap-ipc";

// ---------------------------------------------------------------------------------------------
// The token and the two messages

/// First bytes of a token: what tells the importer's agent the handle is one of ours.
const TOKEN_MAGIC: [u8; 8] = *b"gpusnapI";
/// Layout version of the token and of the messages (2: the token carries the service's name,
/// which is no longer the key).
pub const VERSION: u32 = 2;
const REQUEST_MAGIC: [u8; 8] = *b"gpusnapQ";
const REPLY_MAGIC: [u8; 8] = *b"gpusnapR";
const REQUEST_BYTES: usize = 40;
const REPLY_BYTES: usize = 24;

/// What an agent-made IPC handle holds: magic (8), version (4), exporter pid (4), key (16),
/// allocation id (8), the service's name (16), zeros (8). Little-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Token {
    pub exporter_pid: NsPid,
    pub key: [u8; 16],
    pub alloc_id: u64,
    /// The random part of the exporter's abstract socket name ([`service_name`]).
    pub name: [u8; 16],
}

/// A handle that begins like a token but is not a valid one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenError {
    Version(u32),
    ReservedNotZero,
    ZeroPid,
}

impl fmt::Display for TokenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenError::Version(v) => write!(f, "token version {v} (this agent speaks {VERSION})"),
            TokenError::ReservedNotZero => write!(f, "token with reserved bytes set"),
            TokenError::ZeroPid => write!(f, "token naming pid 0"),
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

impl Token {
    pub fn encode(&self) -> [u8; HANDLE_BYTES] {
        let mut b = [0u8; HANDLE_BYTES];
        b[0..8].copy_from_slice(&TOKEN_MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.exporter_pid.get().to_le_bytes());
        b[16..32].copy_from_slice(&self.key);
        b[32..40].copy_from_slice(&self.alloc_id.to_le_bytes());
        b[40..56].copy_from_slice(&self.name);
        b
    }

    /// `Ok(None)`: not a token (a driver's handle); `Err`: a token this agent cannot use.
    pub fn decode(b: &[u8; HANDLE_BYTES]) -> Result<Option<Token>, TokenError> {
        if b[0..8] != TOKEN_MAGIC {
            return Ok(None);
        }
        let version = u32_at(b, 8);
        if version != VERSION {
            return Err(TokenError::Version(version));
        }
        if b[56..].iter().any(|&x| x != 0) {
            return Err(TokenError::ReservedNotZero);
        }
        let exporter_pid = NsPid(u32_at(b, 12));
        if exporter_pid == NsPid(0) {
            return Err(TokenError::ZeroPid);
        }
        let mut key = [0u8; 16];
        key.copy_from_slice(&b[16..32]);
        let mut name = [0u8; 16];
        name.copy_from_slice(&b[40..56]);
        Ok(Some(Token {
            exporter_pid,
            key,
            alloc_id: u64_at(b, 32),
            name,
        }))
    }
}

/// Importer → exporter: magic (8), version (4), zero (4), key (16), allocation id (8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub key: [u8; 16],
    pub alloc_id: u64,
}

impl Request {
    pub fn encode(&self) -> [u8; REQUEST_BYTES] {
        let mut b = [0u8; REQUEST_BYTES];
        b[0..8].copy_from_slice(&REQUEST_MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[16..32].copy_from_slice(&self.key);
        b[32..40].copy_from_slice(&self.alloc_id.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<Request> {
        if b.len() != REQUEST_BYTES
            || b[0..8] != REQUEST_MAGIC
            || u32_at(b, 8) != VERSION
            || u32_at(b, 12) != 0
        {
            return None;
        }
        let mut key = [0u8; 16];
        key.copy_from_slice(&b[16..32]);
        Some(Request {
            key,
            alloc_id: u64_at(b, 32),
        })
    }
}

/// Exporter → importer: magic (8), version (4), status (4: 0 or a driver code), size (8); with
/// status 0 the allocation's fd is attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    pub status: CuRes,
    /// The allocation's size (its reservation and mapping), with status 0.
    pub size: u64,
}

impl Reply {
    pub fn encode(&self) -> [u8; REPLY_BYTES] {
        let mut b = [0u8; REPLY_BYTES];
        b[0..8].copy_from_slice(&REPLY_MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.status.to_le_bytes());
        b[16..24].copy_from_slice(&self.size.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<Reply> {
        if b.len() != REPLY_BYTES || b[0..8] != REPLY_MAGIC || u32_at(b, 8) != VERSION {
            return None;
        }
        Some(Reply {
            status: u32_at(b, 12),
            size: u64_at(b, 16),
        })
    }
}

/// The abstract socket name of an exporter's service (without the leading NUL): its pid and
/// the random bits of [`Token::name`], never its key (every user can list the name).
pub fn service_name(pid: NsPid, name: &[u8; 16]) -> String {
    let hex: String = name.iter().map(|b| format!("{b:02x}")).collect();
    format!("gpusnap-ipc:{pid}:{hex}")
}

/// A peer's pid as `SO_PEERCRED` gives it: in this process's (the job's) pid namespace, 0 for a
/// peer outside it; the kernel's `pid_t` is never negative.
fn peer_pid(cred: &libc::ucred) -> NsPid {
    NsPid(cred.pid as u32)
}

/// 128 random bits (`getrandom`).
fn random_bits() -> io::Result<[u8; 16]> {
    let mut out = [0u8; 16];
    let mut got = 0;
    while got < out.len() {
        // SAFETY: the buffer's remaining bytes are writable.
        let n = unsafe { libc::getrandom(out[got..].as_mut_ptr().cast(), out.len() - got, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        got += n as usize;
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Errors

/// Why an IPC call could not be served.
#[derive(Debug)]
pub enum IpcError {
    /// The allocation was made where the device has no POSIX-fd handles.
    NotExportable(u64),
    /// A dump has released the allocation's memory.
    Released(u64),
    /// The service (key, socket, thread) could not be set up.
    Service(io::Error),
    /// A driver call failed.
    Cuda(CuError),
    /// The token is one of ours but unusable.
    Token(TokenError),
    /// Flags other than `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`.
    Flags(u32),
    /// The token names this process (the driver refuses to open one's own handles).
    OwnHandle,
    /// The exporter could not be reached or talked to.
    Connect(io::Error),
    /// The peer is not the process the token names, or not a user allowed.
    WrongPeer { pid: NsPid, uid: u32 },
    /// The exporter refused (status), e.g. a freed allocation.
    Refused(CuRes),
    /// A malformed or unexpected message.
    Protocol(&'static str),
    /// The IPC state's lock is held (by an application thread a tracer stopped).
    Busy,
}

impl fmt::Display for IpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IpcError::NotExportable(id) => write!(
                f,
                "allocation #{id} was made without a POSIX-fd handle (the device has none)"
            ),
            IpcError::Released(id) => write!(f, "allocation #{id} is released by a dump"),
            IpcError::Service(e) => write!(f, "the IPC service could not start: {e}"),
            IpcError::Cuda(e) => write!(f, "{e}"),
            IpcError::Token(e) => write!(f, "{e}"),
            IpcError::Flags(x) => write!(f, "flags {x:#x}"),
            IpcError::OwnHandle => write!(f, "the handle was made by this process"),
            IpcError::Connect(e) => write!(f, "the exporter's agent: {e}"),
            IpcError::WrongPeer { pid, uid } => write!(
                f,
                "the peer (pid {pid}, uid {uid}) is not the exporter or is another user"
            ),
            IpcError::Refused(code) => write!(f, "the exporter refused (status {code})"),
            IpcError::Protocol(what) => write!(f, "protocol: {what}"),
            IpcError::Busy => write!(f, "the IPC state is locked by a stopped thread"),
        }
    }
}

impl IpcError {
    /// What the application gets: the driver's answer in the same place.
    pub fn code(&self) -> CuRes {
        match self {
            IpcError::OwnHandle => CUDA_ERROR_INVALID_CONTEXT,
            // The driver's own failure (no context, out of memory) is the driver's answer.
            IpcError::Cuda(e) => e.code,
            _ => CUDA_ERROR_INVALID_VALUE,
        }
    }
}

impl From<CuError> for IpcError {
    fn from(e: CuError) -> Self {
        IpcError::Cuda(e)
    }
}

// ---------------------------------------------------------------------------------------------
// State

/// An allocation whose memory this process exported.
#[derive(Debug)]
struct Export {
    id: u64,
    size: u64,
    /// The POSIX fd of its physical memory, handed to importers (dup'ed for each).
    fd: OwnedFd,
    /// The pids that fetched it (a dump must hold them all).
    importers: BTreeSet<NsPid>,
}

/// Another process's allocation mapped here.
#[derive(Debug)]
struct Import {
    source: (NsPid, [u8; 16], u64),
    size: u64,
    refs: u32,
    /// The device it is mapped for (the importer's context's, at the open).
    device: i32,
    /// False from a release's unmap until [`reimport`] maps it again (the reservation stays).
    mapped: bool,
}

/// The exporter's service: its key, name and listener (the thread knows the listener by
/// number).
#[derive(Debug)]
struct Service {
    key: [u8; 16],
    /// The random part of the listener's name ([`service_name`]), not the key.
    name: [u8; 16],
    /// Held, never read here: it keeps the name bound and the thread's descriptor open.
    _listener: OwnedFd,
}

#[derive(Debug, Default)]
struct State {
    service: Option<Service>,
    /// By base address of the converted allocation.
    exports: BTreeMap<u64, Export>,
    /// By the base address mapped here.
    imports: BTreeMap<u64, Import>,
}

static STATE: Mutex<State> = Mutex::new(State {
    service: None,
    exports: BTreeMap::new(),
    imports: BTreeMap::new(),
});

/// The state, briefly (application threads; never held across a driver call or I/O).
fn state() -> MutexGuard<'static, State> {
    register_fork_handlers();
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

fn try_state_for(wait: Duration) -> Option<MutexGuard<'static, State>> {
    let deadline = Instant::now() + wait;
    loop {
        match STATE.try_lock() {
            Ok(g) => return Some(g),
            Err(TryLockError::Poisoned(e)) => return Some(e.into_inner()),
            Err(TryLockError::WouldBlock) if Instant::now() >= deadline => return None,
            Err(TryLockError::WouldBlock) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

thread_local! {
    static FORK_GUARD: std::cell::RefCell<Option<MutexGuard<'static, State>>> =
        const { std::cell::RefCell::new(None) };
}

/// Around `fork` the state is held, so a child never inherits it locked; the child closes the
/// listener and the exported fds (it has no serving thread and owns none of the memory) and
/// forgets its imports (it has none of the parent's CUDA state).
fn register_fork_handlers() {
    static ONCE: Once = Once::new();
    extern "C" fn prepare() {
        crate::guard::guard((), || {
            let g = STATE.lock().unwrap_or_else(|e| e.into_inner());
            FORK_GUARD.with(|c| *c.borrow_mut() = Some(g));
        });
    }
    extern "C" fn parent() {
        crate::guard::guard((), || {
            FORK_GUARD.with(|c| c.borrow_mut().take());
        });
    }
    extern "C" fn child() {
        crate::guard::guard((), || {
            if let Some(mut g) = FORK_GUARD.with(|c| c.borrow_mut().take()) {
                *g = State::default();
            }
        });
    }
    ONCE.call_once(|| {
        // SAFETY: the handlers are valid for the life of the process (a preloaded library stays).
        let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        if rc != 0 {
            debug!("ipc: pthread_atfork failed: {rc}");
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Exporter

/// `cuIpcGetMemHandle(ptr)`: `None` when `ptr` is not in a converted allocation (the driver's
/// business); else the token to write, or the status to return.
pub fn get_mem_handle(drv: &Driver, ptr: CUdeviceptr) -> Option<Result<[u8; HANDLE_BYTES], CuRes>> {
    let (id, base, size, backing, exportable) = {
        let t = table::lock();
        let c = t.converted_alloc_containing(ptr)?;
        (c.id, c.addr, c.size, c.backing, c.exportable)
    };
    Some(
        export(drv, id, base, size, backing, exportable).map_err(|e| {
            debug!("cuIpcGetMemHandle({ptr:#x}): {e}");
            e.code()
        }),
    )
}

fn export(
    drv: &Driver,
    id: u64,
    base: u64,
    size: u64,
    backing: Backing,
    exportable: bool,
) -> Result<[u8; HANDLE_BYTES], IpcError> {
    if !exportable {
        return Err(IpcError::NotExportable(id));
    }
    let Backing::Mapped(handle) = backing else {
        return Err(IpcError::Released(id));
    };
    let (key, name) = ensure_service()?;
    let have = state().exports.get(&base).is_some_and(|e| e.id == id);
    if !have {
        // The driver call outside any lock.
        let fd = drv.export_fd(handle)?;
        let mut st = state();
        // Another thread's export of the same allocation is as good; a stale one (an earlier
        // allocation at this address) is replaced.
        if st.exports.get(&base).is_none_or(|e| e.id != id) {
            st.exports.insert(
                base,
                Export {
                    id,
                    size,
                    fd,
                    importers: BTreeSet::new(),
                },
            );
        }
        drop(st);
        // A free that raced with this export would leave the fd keeping freed memory alive.
        let still = table::lock()
            .converted_alloc_containing(base)
            .is_some_and(|c| c.id == id);
        if !still {
            forget_export(base);
            return Err(IpcError::Protocol(
                "the allocation was freed while exported",
            ));
        }
        debug!("ipc: exported #{id} at {base:#x} ({size} bytes)");
    }
    crate::hazards::record(hazard::SERVED_IPC_EXPORT);
    Ok(Token {
        exporter_pid: NsPid(std::process::id()),
        key,
        alloc_id: id,
        name,
    }
    .encode())
}

/// Before the converted allocation at `base` is freed: its exported fd is closed (importers
/// keep their own imports).
pub fn forget_export(base: CUdeviceptr) {
    // Not `state()`: a process that never exported has no fork handlers to register.
    let gone = STATE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .exports
        .remove(&base);
    if let Some(e) = gone {
        debug!("ipc: export of #{} at {base:#x} closed", e.id);
    }
}

/// `sockaddr_un` of an abstract name, and its length.
fn abstract_addr(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain data; all zeros is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = name.as_bytes();
    if bytes.len() + 1 > addr.sun_path.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "name too long"));
    }
    // sun_path[0] stays 0: the abstract namespace.
    for (d, s) in addr.sun_path[1..].iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + bytes.len();
    Ok((addr, len as libc::socklen_t))
}

fn seqpacket_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket creation; the result is checked before it is owned.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The service's key and name, binding the listener and starting the thread the first time.
fn ensure_service() -> Result<([u8; 16], [u8; 16]), IpcError> {
    let mut st = state();
    if let Some(s) = &st.service {
        return Ok((s.key, s.name));
    }
    let key = crate::identity::key().map_err(IpcError::Service)?;
    let random = random_bits().map_err(IpcError::Service)?;
    let name = service_name(NsPid(std::process::id()), &random);
    let listener = seqpacket_socket().map_err(IpcError::Service)?;
    let (addr, len) = abstract_addr(&name).map_err(IpcError::Service)?;
    // SAFETY: addr is a valid sockaddr_un of length len.
    if unsafe { libc::bind(listener.as_raw_fd(), (&raw const addr).cast(), len) } != 0 {
        return Err(IpcError::Service(io::Error::last_os_error()));
    }
    // SAFETY: a bound socket.
    if unsafe { libc::listen(listener.as_raw_fd(), 64) } != 0 {
        return Err(IpcError::Service(io::Error::last_os_error()));
    }
    let raw = listener.as_raw_fd();
    let old = block_all_signals();
    let spawned = std::thread::Builder::new()
        .name(THREAD_NAME.into())
        .stack_size(256 << 10)
        .spawn(move || serve_forever(raw));
    if let Some(old) = old {
        // SAFETY: restoring the mask this thread had.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    }
    spawned.map_err(IpcError::Service)?;
    debug!("ipc: serving on @{name}");
    st.service = Some(Service {
        key,
        name: random,
        _listener: listener,
    });
    Ok((key, random))
}

/// Blocks every signal in the calling thread; returns the old mask. A thread spawned meanwhile
/// starts with every signal blocked (CRIU's and the application's signals never land there).
fn block_all_signals() -> Option<libc::sigset_t> {
    // SAFETY: sigset_t is plain data; sigfillset initializes it; pthread_sigmask writes old.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        (libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old) == 0).then_some(old)
    }
}

fn serve_forever(listener: RawFd) {
    loop {
        // SAFETY: the listener is owned by the state for the life of the process (only a fork
        // child drops it, where this thread does not exist); accept4 returns a new descriptor.
        let fd = unsafe {
            libc::accept4(
                listener,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR | libc::ECONNABORTED | libc::EPROTO) => continue,
                Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                    debug!("ipc: accept: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
                _ => {
                    debug!("ipc: accept: {e}; the service stops");
                    return;
                }
            }
        }
        // SAFETY: a new descriptor from accept4, owned here.
        let conn = unsafe { OwnedFd::from_raw_fd(fd) };
        crate::guard::guard((), || {
            if let Err(e) = serve_one(&conn) {
                debug!("ipc: request not served: {e}");
            }
        });
    }
}

/// One connection: check the peer, read the request, send the fd (or a refusal).
fn serve_one(conn: &OwnedFd) -> Result<(), IpcError> {
    set_timeouts(conn.as_fd(), SERVE_TIMEOUT).map_err(IpcError::Connect)?;
    let cred = gpusnap_proto::peer_cred(conn.as_fd()).map_err(IpcError::Connect)?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if cred.uid != 0 && cred.uid != me {
        debug!(
            "ipc: refusing pid {} uid {}: another user (this process runs as uid {me})",
            cred.pid, cred.uid
        );
        return Err(IpcError::WrongPeer {
            pid: peer_pid(&cred),
            uid: cred.uid,
        });
    }
    let deadline = Instant::now() + SERVE_TIMEOUT;
    let (bytes, _fds) = recv_message(conn.as_fd(), deadline).map_err(IpcError::Connect)?;
    let refuse = |status: CuRes, why: &'static str| {
        let _ = send_message(
            conn.as_fd(),
            &Reply { status, size: 0 }.encode(),
            None,
            deadline,
        );
        Err(IpcError::Protocol(why))
    };
    let Some(req) = Request::decode(&bytes) else {
        return refuse(CUDA_ERROR_INVALID_VALUE, "malformed request");
    };
    let found = {
        let Some(st) = try_state_for(LOCK_WAIT) else {
            return refuse(CUDA_ERROR_INVALID_VALUE, "state busy");
        };
        match &st.service {
            Some(s) if s.key == req.key => {}
            _ => {
                drop(st);
                return refuse(CUDA_ERROR_INVALID_VALUE, "wrong key");
            }
        }
        st.exports
            .values()
            .find(|e| e.id == req.alloc_id)
            .map(|e| (e.size, e.fd.try_clone()))
    };
    let Some((size, fd)) = found else {
        return refuse(CUDA_ERROR_INVALID_VALUE, "no such export (freed?)");
    };
    let fd = fd.map_err(IpcError::Connect)?;
    send_message(
        conn.as_fd(),
        &Reply {
            status: CUDA_SUCCESS,
            size,
        }
        .encode(),
        Some(fd.as_fd()),
        deadline,
    )
    .map_err(IpcError::Connect)?;
    debug!(
        "ipc: handed #{} ({size} bytes) to pid {}",
        req.alloc_id, cred.pid
    );
    // Recorded so that a dump can tell whether every importer is in it.
    if let Some(mut st) = try_state_for(LOCK_WAIT)
        && let Some(e) = st.exports.values_mut().find(|e| e.id == req.alloc_id)
        && let Ok(pid) = u32::try_from(cred.pid)
    {
        e.importers.insert(NsPid(pid));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Importer

/// `cuIpcOpenMemHandle_v2`: `None` when the handle is not a token (the driver's business);
/// else the address mapped here, or the status to return.
pub fn open_mem_handle(
    drv: &Driver,
    handle: &[u8; HANDLE_BYTES],
    flags: u32,
) -> Option<Result<CUdeviceptr, CuRes>> {
    let token = match Token::decode(handle) {
        Ok(None) => return None,
        Ok(Some(t)) => Ok(t),
        Err(e) => Err(IpcError::Token(e)),
    };
    Some(token.and_then(|t| open(drv, &t, flags)).map_err(|e| {
        debug!("cuIpcOpenMemHandle: {e}");
        e.code()
    }))
}

fn open(drv: &Driver, t: &Token, flags: u32) -> Result<CUdeviceptr, IpcError> {
    if flags & !LAZY_ENABLE_PEER_ACCESS != 0 {
        return Err(IpcError::Flags(flags));
    }
    if t.exporter_pid == NsPid(std::process::id()) {
        return Err(IpcError::OwnHandle);
    }
    let source = (t.exporter_pid, t.key, t.alloc_id);
    if let Some(base) = count_open(source) {
        return Ok(base);
    }
    let dev = drv.current_device()?;
    let (fd, size) = fetch(t)?;
    let g = drv.granularity(dev)?;
    if size == 0 || g == 0 || !size.is_multiple_of(g) {
        return Err(IpcError::Protocol("size not a multiple of the granularity"));
    }
    let handle = drv.import_fd(fd.as_fd())?;
    drop(fd);
    let mapped = crate::vmm::map_imported(drv, dev, handle, size);
    // The mapping holds the memory by itself, as in CUDA.
    if let Err(e) = drv.release(0, handle) {
        debug!("ipc: {e}");
    }
    let base = mapped?;
    crate::hazards::record(hazard::SERVED_IPC_IMPORT);
    let mut st = state();
    if let Some((&other, m)) = st.imports.iter_mut().find(|(_, m)| m.source == source) {
        // Another thread opened it meanwhile: use that one, undo ours.
        m.refs += 1;
        drop(st);
        if let Err(e) = crate::vmm::unmap_imported(drv, base, size) {
            debug!("ipc: {e}");
        }
        return Ok(other);
    }
    st.imports.insert(
        base,
        Import {
            source,
            size,
            refs: 1,
            device: dev,
            mapped: true,
        },
    );
    drop(st);
    debug!(
        "ipc: opened #{} of pid {} at {base:#x} ({size} bytes)",
        t.alloc_id, t.exporter_pid
    );
    Ok(base)
}

/// One more open of an import already mapped here: its base.
fn count_open(source: (NsPid, [u8; 16], u64)) -> Option<CUdeviceptr> {
    let mut st = state();
    let (&base, m) = st.imports.iter_mut().find(|(_, m)| m.source == source)?;
    m.refs += 1;
    Some(base)
}

/// `cuIpcCloseMemHandle(ptr)`: `None` when `ptr` is not an import of the agent's (the driver's
/// business); else the status.
pub fn close_mem_handle(drv: &Driver, ptr: CUdeviceptr) -> Option<CuRes> {
    let last = {
        let mut st = state();
        let m = st.imports.get_mut(&ptr)?;
        m.refs -= 1;
        if m.refs > 0 {
            None
        } else {
            st.imports.remove(&ptr).map(|m| (m.size, m.mapped))
        }
    };
    let Some((size, mapped)) = last else {
        return Some(CUDA_SUCCESS);
    };
    if !mapped {
        // Unmapped by a release (a reimport that failed, say): only the reservation is left.
        return Some(match drv.free_reservation(ptr, size) {
            Ok(()) => CUDA_SUCCESS,
            Err(e) => e.code,
        });
    }
    // Work that may still use the mapping finishes first (the driver's error is reported by
    // the next call that waits, as without the agent).
    if let Err(e) = drv.synchronize_current() {
        debug!("ipc: close of {ptr:#x}: {e}");
    }
    Some(match crate::vmm::unmap_imported(drv, ptr, size) {
        Ok(()) => {
            debug!("ipc: closed {ptr:#x}");
            CUDA_SUCCESS
        }
        Err(e) => {
            debug!("ipc: close of {ptr:#x}: {e}");
            e.code
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Checkpointing shares (the agent's thread; the application's threads held)

/// The shares of this process through the agent's CUDA IPC ([`ShareKind::Ipc`]), as
/// `ListSharing` reports them: every import (another process's memory mapped here: its base
/// and size, mapped or not between a release and a reimport, its source's key), and every export
/// (this process's allocation) once per process that fetched it (0: none yet). `None` when the
/// state's lock is held (by a stopped application thread).
pub fn sharing() -> Option<Vec<Share>> {
    let st = try_state_for(LOCK_WAIT)?;
    let mut v = Vec::new();
    for (&base, m) in &st.imports {
        v.push(Share {
            import: true,
            pid: m.source.0,
            id: m.source.2,
            addr: base,
            size: m.size,
            mapped: m.mapped,
            key: m.source.1,
            kind: ShareKind::Ipc,
        });
    }
    let own_key = st.service.as_ref().map_or([0; 16], |s| s.key);
    for (&base, e) in &st.exports {
        let pids: Vec<NsPid> = if e.importers.is_empty() {
            vec![NsPid(0)]
        } else {
            e.importers.iter().copied().collect()
        };
        for pid in pids {
            v.push(Share {
                import: false,
                pid,
                id: e.id,
                addr: base,
                size: e.size,
                mapped: true,
                key: own_key,
                kind: ShareKind::Ipc,
            });
        }
    }
    Some(v)
}

/// A release (dump): unmaps every import of this process, keeping its reservation, so the
/// driver's checkpoint holds none of another process's memory. Returns (imports, bytes).
/// Called with the application's threads held; a failed unmap leaves that import mapped and
/// is returned.
pub fn release_imports(drv: &Driver) -> Result<(u32, u64), IpcError> {
    let mut st = try_state_for(LOCK_WAIT).ok_or(IpcError::Busy)?;
    let (mut n, mut bytes) = (0u32, 0u64);
    for (&base, m) in st.imports.iter_mut().filter(|(_, m)| m.mapped) {
        drv.unmap(base, m.size)?;
        m.mapped = false;
        n += 1;
        bytes += m.size;
    }
    if n > 0 {
        debug!("ipc: released {n} imports ({bytes} bytes), reservations kept");
    }
    Ok((n, bytes))
}

/// A descriptor of the current memory of each exported allocation, for the plugin to hand to
/// importers: (id, base, size, fd). After a restore or a reload the memory is new, so the
/// export's own descriptor (a placeholder CRIU opened, or the memory before the release) is
/// replaced by one of the current memory first. `own(base, id, handle)`: the descriptor a
/// hand-over left as the allocation's own (an imported handle cannot be exported again).
pub fn share_fds(
    drv: &Driver,
    own: impl Fn(u64, u64, cudarc::driver::sys::CUmemGenericAllocationHandle) -> Option<OwnedFd>,
) -> Result<Vec<(u64, u64, u64, OwnedFd)>, IpcError> {
    let bases: Vec<(u64, u64, u64)> = {
        let st = try_state_for(LOCK_WAIT).ok_or(IpcError::Busy)?;
        st.exports.iter().map(|(&b, e)| (b, e.id, e.size)).collect()
    };
    let mut out = Vec::new();
    for (base, id, size) in bases {
        let backing = table::try_lock_for(crate::table::AGENT_LOCK_WAIT)
            .ok_or(IpcError::Busy)?
            .converted_alloc_containing(base)
            .filter(|c| c.id == id && c.addr == base)
            .map(|c| c.backing);
        let Some(Backing::Mapped(handle)) = backing else {
            return Err(IpcError::Released(id));
        };
        let fresh = match own(base, id, handle) {
            Some(fd) => fd,
            None => drv.export_fd(handle)?,
        };
        let dup = fresh.try_clone().map_err(IpcError::Connect)?;
        if let Some(e) = try_state_for(LOCK_WAIT)
            .ok_or(IpcError::Busy)?
            .exports
            .get_mut(&base)
            .filter(|e| e.id == id)
        {
            e.fd = fresh;
        }
        out.push((id, base, size, dup));
    }
    Ok(out)
}

/// The devices this process's imports are mapped for.
pub fn import_devices() -> Option<BTreeSet<i32>> {
    let st = try_state_for(LOCK_WAIT)?;
    Some(st.imports.values().map(|m| m.device).collect())
}

/// The device the import of exporter `exporter_pid`'s allocation `id` is mapped for.
pub fn import_device(exporter_pid: NsPid, id: u64) -> Option<i32> {
    let st = try_state_for(LOCK_WAIT)?;
    st.imports
        .values()
        .find(|m| m.source.0 == exporter_pid && m.source.2 == id)
        .map(|m| m.device)
}

/// Maps `fd` (exporter `exporter_pid`'s allocation `id`, handed by the plugin) again where this
/// process's import of it was mapped before a release. Returns that address.
pub fn reimport(
    drv: &Driver,
    exporter_pid: NsPid,
    id: u64,
    fd: BorrowedFd<'_>,
) -> Result<u64, IpcError> {
    let (base, size, device) = {
        let st = try_state_for(LOCK_WAIT).ok_or(IpcError::Busy)?;
        let Some((&base, m)) = st
            .imports
            .iter()
            .find(|(_, m)| m.source.0 == exporter_pid && m.source.2 == id)
        else {
            return Err(IpcError::Protocol("no import of that allocation here"));
        };
        if m.mapped {
            return Err(IpcError::Protocol("that import is mapped already"));
        }
        (base, m.size, m.device)
    };
    let handle = drv.import_fd(fd)?;
    let mapped = crate::vmm::map_handle(drv, device, base, size, handle);
    // The mapping holds the memory by itself, as after an open.
    if let Err(e) = drv.release(0, handle) {
        debug!("ipc: {e}");
    }
    mapped?;
    if let Some(m) = try_state_for(LOCK_WAIT)
        .ok_or(IpcError::Busy)?
        .imports
        .get_mut(&base)
    {
        m.mapped = true;
    }
    debug!("ipc: #{id} of pid {exporter_pid} mapped again at {base:#x} ({size} bytes)");
    Ok(base)
}

/// Asks the exporter named by `t` for the allocation's fd: (fd, size).
fn fetch(t: &Token) -> Result<(OwnedFd, u64), IpcError> {
    let deadline = Instant::now() + CLIENT_TIMEOUT;
    let sock = seqpacket_socket().map_err(IpcError::Connect)?;
    set_timeouts(sock.as_fd(), CLIENT_TIMEOUT).map_err(IpcError::Connect)?;
    let (addr, len) =
        abstract_addr(&service_name(t.exporter_pid, &t.name)).map_err(IpcError::Connect)?;
    loop {
        // SAFETY: addr is a valid sockaddr_un of length len.
        if unsafe { libc::connect(sock.as_raw_fd(), (&raw const addr).cast(), len) } == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EISCONN) => break,
            Some(libc::EINTR) if Instant::now() < deadline => continue,
            _ => return Err(IpcError::Connect(e)),
        }
    }
    let cred = gpusnap_proto::peer_cred(sock.as_fd()).map_err(IpcError::Connect)?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let user_ok = cred.uid == me || me == 0 || cred.uid == 0;
    if u32::try_from(cred.pid).ok().map(NsPid) != Some(t.exporter_pid) || !user_ok {
        return Err(IpcError::WrongPeer {
            pid: peer_pid(&cred),
            uid: cred.uid,
        });
    }
    let req = Request {
        key: t.key,
        alloc_id: t.alloc_id,
    };
    send_message(sock.as_fd(), &req.encode(), None, deadline).map_err(IpcError::Connect)?;
    let (bytes, mut fds) = recv_message(sock.as_fd(), deadline).map_err(IpcError::Connect)?;
    let reply = Reply::decode(&bytes).ok_or(IpcError::Protocol("malformed reply"))?;
    if reply.status != CUDA_SUCCESS {
        return Err(IpcError::Refused(reply.status));
    }
    if fds.len() != 1 {
        return Err(IpcError::Protocol("reply without exactly one descriptor"));
    }
    Ok((fds.remove(0), reply.size))
}

// ---------------------------------------------------------------------------------------------
// Socket helpers (timeouts, EINTR, SCM_RIGHTS)

fn set_timeouts(fd: BorrowedFd<'_>, t: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: libc::suseconds_t::from(t.subsec_micros() as i32),
    };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: tv is a valid timeval of the size given.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&raw const tv).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Whether an error is a signal's (retry while `deadline` allows).
fn retry(e: &io::Error, deadline: Instant) -> bool {
    e.raw_os_error() == Some(libc::EINTR) && Instant::now() < deadline
}

/// Sends one record, with `fd` attached when given.
fn send_message(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    fd: Option<BorrowedFd<'_>>,
    deadline: Instant,
) -> io::Result<()> {
    // A control buffer for one descriptor, aligned for cmsghdr.
    let mut control = [0u64; 4];
    loop {
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr().cast_mut().cast(),
            iov_len: bytes.len(),
        };
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(fd) = fd {
            // SAFETY: CMSG_SPACE is a pure size computation.
            let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
            debug_assert!(space <= std::mem::size_of_val(&control));
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space;
            // SAFETY: msg_control points at `space` writable, aligned bytes, room for one
            // cmsghdr carrying one descriptor (CMSG_FIRSTHDR is non-null for that size).
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
                libc::CMSG_DATA(c)
                    .cast::<RawFd>()
                    .write_unaligned(fd.as_raw_fd());
            }
        }
        // SAFETY: msg describes valid buffers for the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return if n as usize == bytes.len() {
                Ok(())
            } else {
                Err(io::Error::new(io::ErrorKind::WriteZero, "short send"))
            };
        }
        let e = io::Error::last_os_error();
        if !retry(&e, deadline) {
            return Err(e);
        }
    }
}

/// Receives one record (at most 64 bytes) and the descriptors attached to it (close-on-exec).
fn recv_message(sock: BorrowedFd<'_>, deadline: Instant) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut buf = [0u8; 64];
    let mut control = [0u64; 8];
    loop {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control);
        // SAFETY: msg describes valid, writable buffers.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if retry(&e, deadline) {
                continue;
            }
            return Err(e);
        }
        let mut fds = Vec::new();
        // SAFETY: the kernel filled msg_control; CMSG_FIRSTHDR/NXTHDR walk it within
        // msg_controllen, and each SCM_RIGHTS payload holds whole descriptors now ours.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c).cast::<RawFd>();
                    let header = libc::CMSG_LEN(0) as usize;
                    let count = ((*c).cmsg_len as usize).saturating_sub(header)
                        / std::mem::size_of::<RawFd>();
                    for i in 0..count {
                        fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer closed the connection",
            ));
        }
        if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "truncated message",
            ));
        }
        return Ok((buf[..n as usize].to_vec(), fds));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> Token {
        Token {
            exporter_pid: NsPid(4242),
            key: [7; 16],
            alloc_id: 99,
            name: [9; 16],
        }
    }

    #[test]
    fn tokens_round_trip_and_other_handles_are_not_tokens() {
        let t = token();
        let b = t.encode();
        assert_eq!(b.len(), HANDLE_BYTES);
        assert_eq!(&b[0..8], b"gpusnapI");
        assert_eq!(Token::decode(&b), Ok(Some(t)));
        assert_eq!(Token::decode(&[0u8; HANDLE_BYTES]), Ok(None));
        let mut driver_like = [0xabu8; HANDLE_BYTES];
        driver_like[0] = 0;
        assert_eq!(Token::decode(&driver_like), Ok(None));
    }

    #[test]
    fn bad_tokens_are_refused_not_trusted() {
        let mut b = token().encode();
        b[8] = 1;
        assert_eq!(Token::decode(&b), Err(TokenError::Version(1)));
        let mut b = token().encode();
        b[63] = 1;
        assert_eq!(Token::decode(&b), Err(TokenError::ReservedNotZero));
        let mut t = token();
        t.exporter_pid = NsPid(0);
        assert_eq!(Token::decode(&t.encode()), Err(TokenError::ZeroPid));
        for e in [
            IpcError::Token(TokenError::ZeroPid),
            IpcError::Refused(1),
            IpcError::Flags(2),
            IpcError::Protocol("x"),
        ] {
            assert_eq!(e.code(), CUDA_ERROR_INVALID_VALUE, "{e}");
        }
        assert_eq!(IpcError::OwnHandle.code(), CUDA_ERROR_INVALID_CONTEXT);
    }

    #[test]
    fn messages_round_trip_and_reject_garbage() {
        let r = Request {
            key: [1; 16],
            alloc_id: 5,
        };
        let b = r.encode();
        assert_eq!(b.len(), REQUEST_BYTES);
        assert_eq!(Request::decode(&b), Some(r));
        assert_eq!(Request::decode(&b[..39]), None);
        let mut bad = b;
        bad[12] = 1;
        assert_eq!(Request::decode(&bad), None);
        let p = Reply {
            status: 0,
            size: 2 << 20,
        };
        assert_eq!(Reply::decode(&p.encode()), Some(p));
        assert_eq!(Reply::decode(&b), None, "a request is not a reply");
        assert_eq!(Reply::decode(&[]), None);
    }

    #[test]
    fn the_service_name_is_abstract_and_fits() {
        // The name comes from the token's own random bits, never from its key.
        let t = token();
        assert_eq!(
            service_name(t.exporter_pid, &t.name),
            "gpusnap-ipc:4242:09090909090909090909090909090909"
        );
        assert_eq!(Token::decode(&t.encode()).unwrap().unwrap().name, t.name);
        let name = service_name(NsPid(u32::MAX), &[0xff; 16]);
        assert_eq!(
            name,
            "gpusnap-ipc:4294967295:ffffffffffffffffffffffffffffffff"
        );
        let (addr, len) = abstract_addr(&name).unwrap();
        assert_eq!(addr.sun_path[0], 0);
        assert_eq!(
            len as usize,
            std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len()
        );
    }

    #[test]
    fn a_record_and_a_descriptor_cross_a_socket_pair() {
        let (a, b) = gpusnap_proto::seqpacket_pair().unwrap();
        let deadline = Instant::now() + Duration::from_secs(1);
        let file = std::fs::File::open("/proc/self/maps").unwrap();
        send_message(a.as_fd(), b"hello", Some(file.as_fd()), deadline).unwrap();
        let (bytes, fds) = recv_message(b.as_fd(), deadline).unwrap();
        assert_eq!(bytes, b"hello");
        assert_eq!(fds.len(), 1);
        assert_ne!(fds[0].as_raw_fd(), file.as_raw_fd());
        send_message(a.as_fd(), b"x", None, deadline).unwrap();
        let (bytes, fds) = recv_message(b.as_fd(), deadline).unwrap();
        assert_eq!((bytes.as_slice(), fds.len()), (&b"x"[..], 0));
        set_timeouts(b.as_fd(), Duration::from_millis(50)).unwrap();
        let t0 = Instant::now();
        let e = recv_message(b.as_fd(), Instant::now()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "{e}");
        assert!(t0.elapsed() < Duration::from_secs(1));
        drop(a);
        let e = recv_message(b.as_fd(), deadline).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
