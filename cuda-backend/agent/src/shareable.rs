//! Device memory a program shares itself with `cuMemExportToShareableHandle` /
//! `cuMemImportFromShareableHandle` (POSIX fds: PyTorch's expandable segments, programs that
//! pass the fd with `SCM_RIGHTS`), carried on the split path like the agent's own CUDA IPC
//! (`docs/ipc.md`, "Shareable handles").
//!
//! - Exporter: an export of an application handle the agent virtualizes keeps a duplicate of
//!   the fd the driver returned ([`Export`]), so the plugin can tell which import it is
//!   (`kcmp` of the two open files: nothing in the fd names the export), and the fd number the
//!   program got. The duplicates are closed once the handle is gone and the program's fd no
//!   longer is that file. After a restore or a rollback the memory is new: `ShareFds` exports
//!   it again, replaces the duplicates and, while a tracer holds the program's threads, puts
//!   the new export over the program's own fd number (`dup3`), so the program's fd names the
//!   memory it maps again.
//! - Importer: the import is virtualized ([`Import`]): the program gets a value of ours, the
//!   agent keeps the driver's handle, a duplicate of the fd imported (identification only,
//!   closed once the plugin has said whose memory it is: [`note_source`]) and the program's
//!   mappings of it. A release unmaps them and releases the driver's handle (reservations stay
//!   the program's); a reimport imports the exporter's current memory and maps it again at the
//!   same places, and the program's value names it again.
//!
//! Locking: application threads take the state briefly, never across a driver call; the
//! agent's thread only try-locks with a bound (a stopped application thread may hold it).

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUmemGenericAllocationHandle as Handle;
use gpusnap_proto::pid::NsPid;
use gpusnap_proto::{ForeignFd, Share, ShareKind};

use crate::cu::CuError;
use crate::log::debug;
use crate::real::Driver;
use crate::table::{self, Backing};

/// How long the agent's thread waits for the state's lock.
const LOCK_WAIT: Duration = Duration::from_millis(500);

/// One `cuMemExportToShareableHandle` (POSIX fd) of application handle `handle`.
#[derive(Debug)]
struct Export {
    /// The application's (virtual) handle.
    handle: Handle,
    /// The agent's duplicate of the exported fd (the same open file).
    dup: OwnedFd,
    /// The fd number the program got.
    app_fd: RawFd,
}

/// One mapping the program made of an imported handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ImportMap {
    addr: u64,
    size: u64,
    offset: u64,
    /// False from a release's unmap until a reimport maps it again (the reservation stays).
    mapped: bool,
}

/// An imported handle, virtualized.
#[derive(Debug)]
struct Import {
    /// This process's id for it (what `ListSharing` reports until it is resolved).
    id: u64,
    /// The driver's handle while the program holds references and the memory is mapped in.
    real: Option<Handle>,
    /// The program's references: its import and retains, less its releases.
    app_refs: u32,
    /// The device it is used on (the importing thread's context's).
    device: i32,
    /// Duplicate of the imported fd, until the plugin resolved it (or a release).
    ident: Option<OwnedFd>,
    /// The exporter (its pid in this process's namespace) and its allocation id.
    source: Option<(NsPid, u64)>,
    /// The exporter's key ([`crate::identity`]), with `source`.
    source_key: [u8; 16],
    maps: Vec<ImportMap>,
    /// A release took its memory (the driver's handle and every mapping) away.
    released: bool,
}

impl Import {
    fn whole(&self) -> bool {
        !self.released && self.maps.iter().all(|m| m.mapped)
    }
}

#[derive(Debug)]
struct State {
    exports: Vec<Export>,
    /// By the application's (virtual) value.
    imports: BTreeMap<Handle, Import>,
    next_import: u64,
}

static STATE: Mutex<State> = Mutex::new(State {
    exports: Vec::new(),
    imports: BTreeMap::new(),
    next_import: 1,
});

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

fn try_state() -> Option<MutexGuard<'static, State>> {
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        match STATE.try_lock() {
            Ok(g) => return Some(g),
            Err(TryLockError::Poisoned(e)) => return Some(e.into_inner()),
            Err(TryLockError::WouldBlock) if Instant::now() >= deadline => return None,
            Err(TryLockError::WouldBlock) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// The state held locked around `fork` (taken in the prepare handler, after the table's).
pub struct ForkHold(MutexGuard<'static, State>);

impl ForkHold {
    pub fn take() -> Self {
        ForkHold(state())
    }
}

/// A forked child owns none of the parent's exports or imports: their duplicates are closed.
pub fn forget_in_child(hold: Option<ForkHold>) {
    if let Some(mut h) = hold {
        h.0.exports.clear();
        h.0.imports.clear();
    }
}

/// Whether fds `a` and `b` of this process are the same open file (`kcmp`, allowed on oneself).
fn same_file_here(a: RawFd, b: RawFd) -> bool {
    if a < 0 || b < 0 {
        return false;
    }
    // SAFETY: kcmp only compares kernel objects; a closed fd number gives EBADF (-1).
    let pid = unsafe { libc::getpid() };
    // SAFETY: as above; KCMP_FILE (0) takes two fd numbers.
    let rc = unsafe { libc::syscall(libc::SYS_kcmp, pid, pid, 0, a, b) };
    rc == 0
}

fn dup_cloexec(fd: RawFd) -> Option<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC of a number the caller names; a bad one fails with EBADF.
    let d = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    // SAFETY: a new descriptor nothing else owns.
    (d >= 0).then(|| unsafe { OwnedFd::from_raw_fd(d) })
}

// ---------------------------------------------------------------------------------------------
// Application threads

/// The program exported application handle `handle` as POSIX fd `app_fd`. False when the
/// agent could not keep its duplicate (the caller records the refusing hazard instead).
pub fn exported(handle: Handle, app_fd: RawFd) -> bool {
    if !crate::fd_budget::room_for_one_more_descriptor() {
        debug!(
            "cuMemExportToShareableHandle: near the descriptor limit, no duplicate kept; not carried"
        );
        return false;
    }
    let Some(dup) = dup_cloexec(app_fd) else {
        debug!("cuMemExportToShareableHandle: no duplicate of fd {app_fd}; not carried");
        return false;
    };
    debug!(
        "cuMemExportToShareableHandle: handle {handle:#x} exported as fd {app_fd} (kept as fd {})",
        dup.as_raw_fd()
    );
    state().exports.push(Export {
        handle,
        dup,
        app_fd,
    });
    true
}

/// Called after the application released or unmapped a handle: the exports of handles the
/// table no longer knows are closed, unless the program's fd still is that file (then the
/// export is kept, and a dump refuses it: memory the agent no longer moves).
pub fn forget_gone_exports() {
    // The one lock order: the table, then this state (as around `fork`).
    let t = table::lock();
    let mut st = state();
    if st.exports.is_empty() {
        return;
    }
    st.exports.retain(|e| {
        t.real_handle(e.handle).is_some() || same_file_here(e.app_fd, e.dup.as_raw_fd())
    });
}

/// The program imported `real` from its fd `app_fd` on `device`: the value to give it, `None`
/// when the agent could not keep a duplicate (the caller passes the driver's handle on and
/// records the refusing hazard).
pub fn imported(real: Handle, app_fd: RawFd, device: i32) -> Option<Handle> {
    if !crate::fd_budget::room_for_one_more_descriptor() {
        debug!(
            "cuMemImportFromShareableHandle: near the descriptor limit, no duplicate kept; not carried"
        );
        return None;
    }
    let ident = dup_cloexec(app_fd)?;
    let v = table::lock().reserve_virtual();
    let mut st = state();
    let id = st.next_import;
    st.next_import += 1;
    debug!(
        "cuMemImportFromShareableHandle: fd {app_fd} imported as #{id} (handle {v:#x}, device {device})"
    );
    st.imports.insert(
        v,
        Import {
            id,
            real: Some(real),
            app_refs: 1,
            device,
            ident: Some(ident),
            source: None,
            source_key: [0; 16],
            maps: Vec::new(),
            released: false,
        },
    );
    Some(v)
}

/// The driver handle behind an imported value: `None` when `v` is not one, `Some(None)` while
/// a dump has released the memory (or the program released its handle).
pub fn import_real(v: Handle) -> Option<Option<Handle>> {
    let st = state();
    st.imports.get(&v).map(|m| m.real)
}

/// Program calls that map or unmap an imported handle and have not recorded it yet. A thread
/// a dump seizes inside one (after the driver's call, before the record) would leave a mapping
/// the release does not know of, so the listing and the release answer Busy while any is in
/// flight: such a dump is refused before anything is released, and the program runs on.
static IMPORT_CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// One program call on an imported handle, from before the driver's call until it is recorded.
pub struct ImportCall(());

impl ImportCall {
    pub fn begin() -> ImportCall {
        IMPORT_CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        ImportCall(())
    }
}

impl Drop for ImportCall {
    fn drop(&mut self) {
        IMPORT_CALLS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

fn import_call_in_flight() -> bool {
    IMPORT_CALLS.load(std::sync::atomic::Ordering::SeqCst) > 0
}

/// Whether `[addr, addr+size)` holds a recorded mapping of an imported handle.
pub fn maps_an_import(addr: u64, size: u64) -> bool {
    let end = addr.saturating_add(size);
    let st = state();
    st.imports
        .values()
        .any(|m| m.maps.iter().any(|x| x.addr >= addr && x.addr < end))
}

/// The program mapped imported value `v` (the driver accepted it).
pub fn mapped(v: Handle, addr: u64, size: u64, offset: u64) {
    if let Some(m) = state().imports.get_mut(&v) {
        m.maps.push(ImportMap {
            addr,
            size,
            offset,
            mapped: true,
        });
    }
}

/// The program unmapped `[addr, addr+size)`: the import mappings starting inside it are
/// forgotten, and an import left with neither mappings nor references (its duplicate closed).
pub fn unmapped(addr: u64, size: u64) {
    let end = addr.saturating_add(size);
    let mut st = state();
    if st.imports.is_empty() {
        return;
    }
    for m in st.imports.values_mut() {
        m.maps.retain(|x| !(x.addr >= addr && x.addr < end));
    }
    st.imports
        .retain(|_, m| m.app_refs > 0 || !m.maps.is_empty());
}

/// What the application's `cuMemRelease` of an imported value does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// Its last reference: release this driver handle.
    Real(Handle),
    /// Counted (references remain, or a dump released the memory).
    Counted,
    /// The program holds no reference to it.
    Invalid,
}

/// `cuMemRelease(v)`: `None` when `v` is not an imported value.
pub fn app_release(v: Handle) -> Option<Release> {
    let mut st = state();
    let m = st.imports.get_mut(&v)?;
    if m.app_refs == 0 {
        return Some(Release::Invalid);
    }
    m.app_refs -= 1;
    if m.app_refs > 0 {
        return Some(Release::Counted);
    }
    let real = m.real.take();
    if m.maps.is_empty() {
        st.imports.remove(&v);
    }
    Some(real.map_or(Release::Counted, Release::Real))
}

/// `cuMemRetainAllocationHandle(addr)` returned driver handle `real`: the program's value, and
/// whether the driver reference the retain added is to be released again (the agent holds
/// one). After the program's last release its mapping alone held the memory, and the agent no
/// driver handle: the retain's new reference is then the import's handle again, so the program
/// gets its value back and a dump finds the import whole (not a driver handle it never saw).
pub fn retained(real: Handle, addr: u64) -> Option<(Handle, bool)> {
    let mut st = state();
    if let Some((&v, m)) = st.imports.iter_mut().find(|(_, m)| m.real == Some(real)) {
        m.app_refs += 1;
        return Some((v, m.app_refs > 1));
    }
    let (&v, m) = st.imports.iter_mut().find(|(_, m)| {
        m.real.is_none()
            && !m.released
            && m.maps
                .iter()
                .any(|x| addr >= x.addr && addr - x.addr < x.size)
    })?;
    m.real = Some(real);
    m.app_refs = 1;
    Some((v, false))
}

// ---------------------------------------------------------------------------------------------
// The agent's thread (the application's threads held, or read-only)

/// This process's shareable exports and imports ([`ShareKind::Shareable`]), as `ListSharing`
/// reports them (their descriptors are this process's own, numbers the plugin sees as the
/// job's); `None` when a lock is held.
pub fn sharing() -> Option<Vec<Share>> {
    if import_call_in_flight() {
        return None;
    }
    let t = table::try_lock_for(table::AGENT_LOCK_WAIT)?;
    let st = try_state()?;
    let mut v = Vec::new();
    // Without a key (getrandom failed) the exports say zeros, which no resolved import holds
    // unless the plugin told it so.
    let own_key = crate::identity::key().unwrap_or([0; 16]);
    {
        for e in &st.exports {
            // Carried only as a movable mapping of the handle (moved by the split path).
            let moved = t.converted().find(|c| c.app_handle == Some(e.handle));
            let app_fd = if same_file_here(e.app_fd, e.dup.as_raw_fd()) {
                e.app_fd
            } else {
                -1
            };
            v.push(Share {
                import: false,
                pid: NsPid(0),
                id: moved.map_or(0, |c| c.id),
                addr: moved.map_or(0, |c| c.addr),
                size: moved.map_or(0, |c| c.size),
                mapped: moved.is_some(),
                key: own_key,
                kind: ShareKind::Shareable {
                    agent_fd: ForeignFd::new(e.dup.as_raw_fd()),
                    app_fd: ForeignFd::new(app_fd),
                    // The server's to say (`own_fds`).
                    own_fd: None,
                },
            });
        }
    }
    drop(t);
    for m in st.imports.values() {
        let first = m.maps.first();
        let (pid, id, agent_fd) = match (m.source, &m.ident) {
            (Some((pid, id)), _) => (pid, id, -1),
            (None, Some(fd)) => (NsPid(0), m.id, fd.as_raw_fd()),
            (None, None) => (NsPid(0), m.id, -1),
        };
        v.push(Share {
            import: true,
            pid,
            id,
            addr: first.map_or(0, |x| x.addr),
            size: first.map_or(0, |x| x.size),
            mapped: m.whole(),
            key: m.source_key,
            kind: ShareKind::Shareable {
                agent_fd: ForeignFd::new(agent_fd),
                app_fd: None,
                own_fd: None,
            },
        });
    }
    Some(v)
}

/// Why a shareable share could not be handled.
#[derive(Debug)]
pub enum ShareableError {
    /// The state stayed locked (an application thread holds it).
    Busy,
    NoImport(u64),
    /// A release of an import the plugin never resolved (it could not be mapped again).
    Unresolved(u64),
    NothingToReimport {
        pid: NsPid,
        id: u64,
    },
    /// The exported allocation's memory is not back.
    Released(u64),
    Cuda(CuError),
    Os {
        what: &'static str,
        source: std::io::Error,
    },
}

impl std::fmt::Display for ShareableError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShareableError::Busy => write!(
                f,
                "the shareable-handle state stayed locked (an application thread holds it)"
            ),
            ShareableError::NoImport(id) => write!(f, "no import #{id} here"),
            ShareableError::Unresolved(id) => write!(
                f,
                "import #{id} was never resolved to its exporter by the plugin: nothing is released (it could not be mapped again)"
            ),
            ShareableError::NothingToReimport { pid, id } => write!(
                f,
                "no released import of allocation #{id} of pid {pid} to map again here"
            ),
            ShareableError::Released(id) => {
                write!(f, "allocation #{id} is released: its memory is not back")
            }
            ShareableError::Cuda(e) => write!(f, "{e}"),
            ShareableError::Os { what, source } => write!(f, "{what}: {source}"),
        }
    }
}

impl From<CuError> for ShareableError {
    fn from(e: CuError) -> Self {
        ShareableError::Cuda(e)
    }
}

/// `ShareableSource`: import `import` is exporter `pid`'s allocation `id`, an exporter whose
/// key is `key`; the duplicate kept to identify it is closed.
pub fn note_source(import: u64, pid: NsPid, id: u64, key: [u8; 16]) -> Result<(), ShareableError> {
    let mut st = try_state().ok_or(ShareableError::Busy)?;
    let m = st
        .imports
        .values_mut()
        .find(|m| m.id == import)
        .ok_or(ShareableError::NoImport(import))?;
    m.source = Some((pid, id));
    m.source_key = key;
    m.ident = None;
    debug!("shareable: import #{import} is allocation #{id} of pid {pid}");
    Ok(())
}

/// The devices the imports are used on (a release prepares them).
pub fn import_devices() -> Option<Vec<i32>> {
    let st = try_state()?;
    let mut v: Vec<i32> = st.imports.values().map(|m| m.device).collect();
    v.sort_unstable();
    v.dedup();
    Some(v)
}

/// A release: every import's mappings are unmapped and its driver handle released (the
/// reservations stay the program's), so the driver's checkpoint holds none of another
/// process's memory. Refused before anything is touched when an import is not resolved.
/// Returns (imports, bytes unmapped).
pub fn release_imports(drv: &Driver) -> Result<(u32, u64), ShareableError> {
    if import_call_in_flight() {
        return Err(ShareableError::Busy);
    }
    let mut st = try_state().ok_or(ShareableError::Busy)?;
    if let Some(m) = st.imports.values().find(|m| m.source.is_none()) {
        return Err(ShareableError::Unresolved(m.id));
    }
    let (mut n, mut bytes) = (0u32, 0u64);
    for m in st.imports.values_mut().filter(|m| !m.released) {
        // Released from the first unmap on: should one fail, a reimport still takes it whole.
        m.released = true;
        for x in m.maps.iter_mut().filter(|x| x.mapped) {
            drv.unmap(x.addr, x.size)?;
            x.mapped = false;
            bytes += x.size;
        }
        if let Some(h) = m.real.take() {
            drv.release(0, h)?;
        }
        m.ident = None;
        n += 1;
    }
    if n > 0 {
        debug!("shareable: released {n} imports ({bytes} bytes mapped), reservations kept");
    }
    Ok((n, bytes))
}

/// The device of the import mapped at an address holding `ptr`.
pub fn import_device_at(ptr: u64) -> Option<i32> {
    let st = state();
    st.imports
        .values()
        .find(|m| {
            m.maps
                .iter()
                .any(|x| ptr >= x.addr && ptr - x.addr < x.size)
        })
        .map(|m| m.device)
}

/// The device the import of exporter `pid`'s allocation `id` is used on.
pub fn import_device(pid: NsPid, id: u64) -> Option<i32> {
    let st = try_state()?;
    st.imports
        .values()
        .find(|m| m.source == Some((pid, id)))
        .map(|m| m.device)
}

/// Imports `fd` (exporter `pid`'s allocation `id`, handed by the plugin) for every released
/// import of it and maps it again where the program had mapped it. Returns the first address.
pub fn reimport(
    drv: &Driver,
    pid: NsPid,
    id: u64,
    fd: BorrowedFd<'_>,
) -> Result<u64, ShareableError> {
    let todo: Vec<(Handle, i32, Vec<ImportMap>, bool)> = {
        let st = try_state().ok_or(ShareableError::Busy)?;
        st.imports
            .iter()
            .filter(|(_, m)| m.source == Some((pid, id)) && m.released)
            .map(|(&v, m)| (v, m.device, m.maps.clone(), m.app_refs > 0))
            .collect()
    };
    if todo.is_empty() {
        return Err(ShareableError::NothingToReimport { pid, id });
    }
    let mut first = 0;
    for (v, device, maps, keep) in todo {
        // What a release that failed part-way left of the old memory goes first: every mapping
        // is made from the exporter's current memory.
        for x in maps.iter().filter(|x| x.mapped) {
            drv.unmap(x.addr, x.size)?;
            if let Some(m) = try_state().ok_or(ShareableError::Busy)?.imports.get_mut(&v)
                && let Some(y) = m.maps.iter_mut().find(|y| y.addr == x.addr)
            {
                y.mapped = false;
            }
        }
        let old = try_state()
            .ok_or(ShareableError::Busy)?
            .imports
            .get_mut(&v)
            .and_then(|m| m.real.take());
        if let Some(h) = old {
            drv.release(0, h)?;
        }
        let h = drv.import_fd(fd)?;
        let mut done = Vec::new();
        let mapped = maps.iter().try_for_each(|x| {
            drv.map_at(x.addr, x.size, x.offset, h)?;
            done.push(x.addr);
            drv.set_access_rw(x.addr, x.size, device)
        });
        if let Err(e) = mapped {
            for &a in &done {
                if let Some(x) = maps.iter().find(|x| x.addr == a)
                    && let Err(u) = drv.unmap(x.addr, x.size)
                {
                    debug!("shareable: {u}");
                }
            }
            if let Err(r) = drv.release(0, h) {
                debug!("shareable: {r}");
            }
            return Err(e.into());
        }
        let real = if keep {
            Some(h)
        } else {
            // Only the mappings hold the memory, as before the release.
            drv.release(0, h)?;
            None
        };
        let mut st = try_state().ok_or(ShareableError::Busy)?;
        if let Some(m) = st.imports.get_mut(&v) {
            m.real = real;
            m.released = false;
            for x in m.maps.iter_mut() {
                x.mapped = true;
            }
        }
        if first == 0 {
            first = maps.first().map_or(0, |x| x.addr);
        }
        debug!(
            "shareable: #{id} of pid {pid} mapped again ({} mappings) for handle {v:#x}",
            maps.len()
        );
    }
    Ok(first)
}

/// A descriptor of the current memory of each exported handle's allocation, for the plugin
/// to hand to importers: (id, addr, size, fd). With `repoint` (a tracer holds the program's
/// threads) the duplicates are replaced by the new export (the old ones would keep memory a
/// reload replaced alive) and every fd number the program still holds of an export is made the
/// new export (`dup3`); without, nothing here changes. `own`: the descriptor a hand-over
/// left as the allocation's own (an imported handle cannot be exported again).
pub fn share_fds(
    drv: &Driver,
    own: impl Fn(u64, u64, Handle) -> Option<OwnedFd>,
    repoint: bool,
) -> Result<Vec<(u64, u64, u64, OwnedFd)>, ShareableError> {
    let handles: Vec<Handle> = {
        let mut st = try_state().ok_or(ShareableError::Busy)?;
        // Before this call opens any descriptor: a number the program no longer holds as the
        // export is forgotten, so a descriptor of ours that takes that number later is never
        // taken for the program's (found on the H200: the program had closed its fd after
        // passing it on, and dup3 over our own new descriptor failed the restore).
        forget_stale_app_fds(&mut st.exports);
        let mut v: Vec<Handle> = st.exports.iter().map(|e| e.handle).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let mut out = Vec::new();
    for handle in handles {
        let moved = table::try_lock_for(table::AGENT_LOCK_WAIT)
            .ok_or(ShareableError::Busy)?
            .converted()
            .find(|c| c.app_handle == Some(handle))
            .map(|c| (c.id, c.addr, c.size, c.backing));
        let Some((id, addr, size, backing)) = moved else {
            // Not memory the agent moves: nothing new to hand out (a dump refuses it).
            continue;
        };
        let Backing::Mapped(real) = backing else {
            return Err(ShareableError::Released(id));
        };
        let fresh = match own(addr, id, real) {
            Some(fd) => fd,
            None => drv.export_fd(real)?,
        };
        if !repoint {
            // Read-only (the program runs): its fds and the duplicates that match them stay.
            out.push((id, addr, size, fresh));
            continue;
        }
        let mut st = try_state().ok_or(ShareableError::Busy)?;
        for e in st.exports.iter_mut().filter(|e| e.handle == handle) {
            if e.app_fd >= 0
                && e.app_fd != fresh.as_raw_fd()
                && same_file_here(e.app_fd, e.dup.as_raw_fd())
            {
                // The program's close-on-exec flag stays as it set it (it may pass the fd on
                // to a program it execs).
                // SAFETY: F_GETFD on an open descriptor of this process (checked just above).
                let cloexec = unsafe { libc::fcntl(e.app_fd, libc::F_GETFD) } & libc::FD_CLOEXEC;
                let flags = if cloexec != 0 { libc::O_CLOEXEC } else { 0 };
                // SAFETY: both numbers are open descriptors of this process; dup3 replaces the
                // program's (the same open file as our duplicate, checked just above) with the
                // new export, atomically.
                let rc = unsafe { libc::dup3(fresh.as_raw_fd(), e.app_fd, flags) };
                if rc < 0 {
                    return Err(ShareableError::Os {
                        what: "dup3 of the new export over the program's fd",
                        source: std::io::Error::last_os_error(),
                    });
                }
                debug!(
                    "shareable: the program's fd {} names #{id}'s current memory again",
                    e.app_fd
                );
            }
            e.dup = fresh.try_clone().map_err(|source| ShareableError::Os {
                what: "dup of the new export",
                source,
            })?;
        }
        drop(st);
        out.push((id, addr, size, fresh));
    }
    Ok(out)
}

/// Forgets the program's fd number of each export whose number is no longer the same open
/// file as the agent's duplicate (the program closed it; the number may name anything now).
fn forget_stale_app_fds(exports: &mut [Export]) {
    for e in exports.iter_mut() {
        if e.app_fd >= 0 && !same_file_here(e.app_fd, e.dup.as_raw_fd()) {
            debug!(
                "shareable: fd {} is no longer the program's export; forgotten",
                e.app_fd
            );
            e.app_fd = -1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A program that closed its exported fd: the number is forgotten before anything of ours
    /// can take it, and one still held is kept.
    #[test]
    fn a_closed_program_fd_is_forgotten() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (c, _d) = std::os::unix::net::UnixStream::pair().unwrap();
        let dup_a = dup_cloexec(a.as_raw_fd()).unwrap();
        let dup_c = dup_cloexec(c.as_raw_fd()).unwrap();
        let closed = a.as_raw_fd();
        let mut exports = vec![
            Export {
                handle: 1,
                dup: dup_a,
                app_fd: closed,
            },
            Export {
                handle: 2,
                dup: dup_c,
                app_fd: c.as_raw_fd(),
            },
        ];
        drop(a);
        forget_stale_app_fds(&mut exports);
        assert_eq!(exports[0].app_fd, -1, "closed by the program");
        assert_eq!(exports[1].app_fd, c.as_raw_fd(), "still the program's");
        // A file of ours that takes the old number later is never the program's.
        let ours = dup_cloexec(exports[0].dup.as_raw_fd()).unwrap();
        forget_stale_app_fds(&mut exports);
        assert_eq!(exports[0].app_fd, -1);
        drop(ours);
    }

    #[test]
    fn kcmp_tells_one_open_file_from_another() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let dup = dup_cloexec(a.as_raw_fd()).unwrap();
        assert!(same_file_here(a.as_raw_fd(), dup.as_raw_fd()));
        assert!(!same_file_here(a.as_raw_fd(), b.as_raw_fd()));
        assert!(!same_file_here(a.as_raw_fd(), -1));
        drop(a);
        // A closed number is no file at all.
        let closed = dup.as_raw_fd() + 1000;
        assert!(!same_file_here(closed, dup.as_raw_fd()));
    }

    /// An import's life as the hooks see it (and a call in flight): the program's value names
    /// the driver's handle, its mappings are recorded, the last release with no mapping left
    /// forgets it and closes the duplicate kept to identify it. (One test: the state is the
    /// process's.)
    #[test]
    fn an_import_is_virtualized_and_forgotten_with_its_duplicate() {
        // A program call on an imported handle in flight makes the listing Busy (a dump is then
        // refused before any release); its end lifts it. (Here: the state is the process's.)
        let call = ImportCall::begin();
        assert!(sharing().is_none(), "listing while a call is in flight");
        drop(call);
        assert!(!import_call_in_flight());
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let v = imported(0x51, a.as_raw_fd(), 0).unwrap();
        assert_eq!(import_real(v), Some(Some(0x51)));
        assert_eq!(import_real(0x52), None);
        mapped(v, 0x4000_0000, 2 << 20, 0);
        let listed = sharing().unwrap();
        let s = listed.iter().find(|s| s.import).unwrap();
        assert_eq!((s.pid.get(), s.addr, s.mapped), (0, 0x4000_0000, true));
        let ShareKind::Shareable { agent_fd, .. } = s.kind else {
            panic!("a shareable handle's share: {s:?}");
        };
        let dup = agent_fd.map_or(-1, ForeignFd::get);
        assert!(
            dup >= 0 && same_file_here(dup, a.as_raw_fd()),
            "one duplicate kept"
        );
        // A retain of the driver's handle gives the program's value back, counted.
        assert_eq!(retained(0x51, 0x4000_0000), Some((v, true)));
        assert_eq!(app_release(v), Some(Release::Counted));
        // The last release: the driver's handle is released, the mapping keeps the memory.
        assert_eq!(app_release(v), Some(Release::Real(0x51)));
        assert_eq!(app_release(v), Some(Release::Invalid));
        // A retain from the mapping after that: the driver's new reference is the import's
        // again, under the program's value; outside the mapping nothing is adopted.
        assert_eq!(retained(0x53, 0x4000_0000 + (2 << 20)), None);
        assert_eq!(retained(0x53, 0x4000_1000), Some((v, false)));
        assert_eq!(import_real(v), Some(Some(0x53)));
        assert_eq!(app_release(v), Some(Release::Real(0x53)));
        assert!(
            same_file_here(dup, a.as_raw_fd()),
            "still mapped: still tracked"
        );
        unmapped(0x4000_0000, 2 << 20);
        assert_eq!(import_real(v), None, "forgotten");
        assert!(
            !same_file_here(dup, a.as_raw_fd()),
            "its duplicate is closed"
        );
        assert_eq!(app_release(v), None);
    }
}
