//! What the keeper does: it holds a checkpointed job's device memory and drains it, so that the
//! data moves while CRIU dumps the job's host side instead of before (`docs/design-notes.md`,
//! "Hand-over").
//!
//! It serves [`KeeperRequest`]s on the one connection the plugin gave it: the requests it shares
//! with the job's agent ([`CommonRequest`]), and its own (`Adopt`, `Snapshot`, `Expect`). What
//! it runs on its memory is the agent's own code, linked as a library (`gpusnap_agent`: its
//! driver table, allocation table and operations); the request loop and the keeper's own
//! requests are here.
//! - **Dump**: `Adopt` (with the job's exported descriptor attached) imports an allocation and
//!   maps it at the job's own address where the keeper has it free, else anywhere (the table
//!   entry keeps the job's address as its identity and `mapped_at` for the driver's calls), so
//!   the agent's copy-out ([`gpusnap_agent::dump`]) runs here and the image names the job's
//!   addresses; then `DumpBegin` .. `Release` as in the job, where `Release` drops the keeper's
//!   imports (the job keeps its descriptors, so the memory lives on).
//! - **Restore**: `Expect` records each of the job's allocations at its address on the planned
//!   GPU (reserved at that address here where it is free, else anywhere, as at `Adopt`);
//!   `RestoreBegin` .. `RestoreDataDone` is the agent's own load ([`gpusnap_agent::restore`]:
//!   fresh exportable memory, the chunks copied in, the GPU check), beside CRIU's restore; then
//!   `LendBegin` exports it for the restored job to map (`Take`), and `Release` drops the
//!   keeper's handles once the job holds the memory.
//!
//! The keeper exits when the plugin closes the connection (or dies): it never outlives its
//! purpose, and nothing of the job depends on it staying.

use std::fmt;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};

use gpusnap_proto::{
    Channel, CommonRequest, ErrorCode, KeeperRequest, PROTOCOL_VERSION, ProtoError, Reply,
};

use gpusnap_agent::cu::CuError;
use gpusnap_agent::gpu::Gpu;
use gpusnap_agent::session::Ring;
use gpusnap_agent::table::{self, AGENT_LOCK_WAIT};
use gpusnap_proto::pid::{NsPid, NsTid};

/// A line of the agent's debug log (`GPUSNAP_AGENT_DEBUG=1`; the arguments are not evaluated
/// otherwise), as the agent's own `debug!` writes it.
macro_rules! debug {
    ($($arg:tt)*) => {
        if gpusnap_agent::debugging() {
            gpusnap_agent::write_line(format_args!($($arg)*));
        }
    };
}

/// The keeper's `main`: serves the connection on descriptor `fd` (inherited from the plugin),
/// with `libcuda` the driver library to load (the job's). Returns the process's exit status.
pub fn main_with_fd(fd: i32, libcuda: Option<&str>, gpus: &[[u8; 16]]) -> i32 {
    let libcuda = match libcuda.map(std::ffi::CString::new).transpose() {
        Ok(c) => c,
        Err(_) => {
            gpusnap_agent::role::become_keeper(None);
            eprintln!("gpusnap-keeper: --libcuda holds a NUL byte");
            return 2;
        }
    };
    gpusnap_agent::role::become_keeper(libcuda);
    gpusnap_agent::install_quiet_panic_hook();
    // SAFETY: fcntl(F_GETFD) only checks that the number is open.
    if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        eprintln!(
            "gpusnap-keeper: descriptor {fd} is not open (started by hand? the plugin starts it)"
        );
        return 2;
    }
    // SAFETY: the plugin passed this descriptor for us alone; nothing else owns it.
    let ch = Channel::new(unsafe { OwnedFd::from_raw_fd(fd) });
    let (status, why) = match std::panic::catch_unwind(|| serve(&ch, gpus)) {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => {
            debug!("keeper: {e}");
            (1, format!("the keeper failed: {e}"))
        }
        Err(_) => (3, "the keeper panicked".to_owned()),
    };
    // A keeper that fails still exits only when the plugin lets go: where CRIU reaps orphans
    // the keeper is CRIU's child again, and CRIU takes a child's exit during its restore (or
    // its parasite work) for a failure of its own. Whatever the plugin asks meanwhile is
    // refused, and it goes on without the keeper.
    wait_for_close(&ch, &why);
    status
}

/// Why the keeper stopped serving, or could not do what the plugin asked.
#[derive(Debug)]
pub enum KeeperError {
    /// The driver library could not be loaded.
    Load(gpusnap_agent::real::LoadError),
    /// A driver call failed.
    Cuda(CuError),
    /// The connection to the plugin failed.
    Channel {
        doing: &'static str,
        err: ProtoError,
    },
    /// A device number that does not fit the driver's (or the protocol's) type.
    Device(i64),
    /// No GPU with this UUID is visible to the keeper.
    NoGpu([u8; 16]),
    /// The keeper's table stayed locked longer than `AGENT_LOCK_WAIT`.
    TableLocked,
    /// The plugin's list of the parent image's chunks was refused.
    KnownChunks(gpusnap_agent::dump::TooManyKnownChunks),
    /// RDMA-capable memory on a device without POSIX-fd handles: it could not be handed over.
    NotExportable { id: u64 },
    /// A `Snapshot`'s list is not allocations the keeper holds of the job's.
    SnapshotList(SnapshotListError),
}

/// What is wrong with the list of allocations a `Snapshot` is to take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotListError {
    /// No id was listed.
    Empty,
    /// More ids than [`MAX_SNAPSHOT_LIST`] were listed (the rest were not kept).
    TooMany,
    /// The `Snapshot` counts another number of ids than the `SnapshotIds` carried.
    Count { said: u32, got: usize },
    /// An id listed twice.
    Twice(u64),
    /// An id the keeper holds no import of (never adopted, or already in a snapshot).
    NotAdopted(u64),
    /// A snapshot is set aside already (a second `Snapshot` before its dump).
    SetAside,
}

impl fmt::Display for SnapshotListError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => write!(f, "a snapshot of no allocation"),
            Self::TooMany => write!(f, "more than {MAX_SNAPSHOT_LIST} allocations listed"),
            Self::Count { said, got } => {
                write!(
                    f,
                    "the Snapshot counts {said} allocations, {got} were listed"
                )
            }
            Self::Twice(id) => write!(f, "#{id} listed twice"),
            Self::NotAdopted(id) => write!(f, "#{id} is not an allocation the keeper holds"),
            Self::SetAside => write!(f, "a snapshot is set aside already"),
        }
    }
}

impl fmt::Display for KeeperError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Load(why) => write!(f, "{why}"),
            Self::Cuda(e) => write!(f, "{e}"),
            Self::Channel { doing, err } => write!(f, "{doing}: {err}"),
            Self::Device(d) => write!(f, "device {d}"),
            Self::NoGpu(uuid) => write!(f, "no GPU with UUID {} is visible here", hex(uuid)),
            Self::TableLocked => write!(f, "the keeper's table is locked"),
            Self::KnownChunks(why) => write!(f, "{why}"),
            Self::NotExportable { id } => write!(
                f,
                "#{id}: RDMA-capable memory on a device without POSIX-fd handles cannot be handed over"
            ),
            Self::SnapshotList(why) => write!(f, "the snapshot's list: {why}"),
        }
    }
}

impl std::error::Error for KeeperError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Channel { err, .. } => Some(err),
            Self::Load(e) => Some(e),
            Self::KnownChunks(e) => Some(e),
            _ => None,
        }
    }
}

impl From<CuError> for KeeperError {
    fn from(e: CuError) -> Self {
        Self::Cuda(e)
    }
}

fn driver() -> Result<&'static gpusnap_agent::real::Driver, KeeperError> {
    gpusnap_agent::real::driver().map_err(KeeperError::Load)
}

fn reply_to(ch: &Channel, reply: &Reply) -> Result<(), KeeperError> {
    ch.send_reply(reply).map_err(|err| KeeperError::Channel {
        doing: "answering the plugin",
        err,
    })
}

fn serve(ch: &Channel, gpus: &[[u8; 16]]) -> Result<(), KeeperError> {
    let drv = driver()?;
    drv.cu_init()?;
    let mut gpu = Gpu::new();
    // The restore's GPUs, before its first request: the context is made while CRIU forks.
    for uuid in gpus {
        match drv.ordinal_of(uuid) {
            Ok(Some(dev)) => {
                if let Err(e) = gpu.prepare(drv, dev, 0, 0) {
                    debug!("keeper: no context on GPU {} yet: {e}", hex(uuid));
                }
            }
            Ok(None) => debug!("keeper: no GPU {} here", hex(uuid)),
            Err(e) => debug!("keeper: GPU {}: {e}", hex(uuid)),
        }
    }
    let mut known = gpusnap_agent::dump::KnownChunks::default();
    // An asynchronous -R's: the ids its `SnapshotIds` listed so far, and a snapshot set aside
    // while the imports the keeper still holds are drained first.
    let mut listed = SnapshotList::default();
    let mut aside: Vec<SetAside> = Vec::new();
    loop {
        // No time limit: a restore's requests come once CRIU has forked the tree, however long
        // that takes, and the keeper must not exit before (where it is CRIU's child, CRIU takes
        // a child's exit then for a failure of its own). The plugin closing its end, or dying,
        // ends the wait.
        let (req, fd) = match ch.recv_request::<KeeperRequest>(None) {
            Ok(m) => m,
            Err(ProtoError::Interrupted) => continue,
            Err(ProtoError::Closed) => return Ok(()),
            Err(err) => {
                return Err(KeeperError::Channel {
                    doing: "waiting for the plugin",
                    err,
                });
            }
        };
        match (req, fd) {
            (KeeperRequest::Common(CommonRequest::Hello { version }), None) => {
                let reply = if version == PROTOCOL_VERSION {
                    hello()
                } else {
                    Reply::Error {
                        code: ErrorCode::VersionMismatch,
                        message: format!("keeper speaks {PROTOCOL_VERSION}, plugin {version}"),
                    }
                };
                reply_to(ch, &reply)?;
            }
            (
                KeeperRequest::Adopt {
                    id,
                    device,
                    addr,
                    size,
                },
                Some(fd),
            ) => {
                let adopted = adopt(&mut gpu, id, device, addr, size, fd);
                answer(ch, adopted.map(|()| Reply::Adopted { id }), || {
                    format!("adopting #{id} at {addr:#x}")
                })?;
            }
            (
                KeeperRequest::SnapshotRoom {
                    device,
                    share_percent,
                },
                None,
            ) => {
                let room = snapshot_room(&mut gpu, device, share_percent).map(|(free, allowed)| {
                    Reply::SnapshotRoom {
                        device,
                        free,
                        allowed,
                    }
                });
                answer(ch, room, || format!("the free memory of GPU {device}"))?;
            }
            (KeeperRequest::SnapshotIds { ids }, None) => listed.add(&ids),
            (
                KeeperRequest::Snapshot {
                    share_percent,
                    count,
                },
                None,
            ) => {
                let list = std::mem::take(&mut listed);
                let made = list
                    .ids(count)
                    .map_err(KeeperError::SnapshotList)
                    .and_then(|ids| snapshot(&mut gpu, share_percent, &ids, &mut aside));
                answer(ch, made, || "making the snapshot".to_owned())?;
            }
            (
                KeeperRequest::Common(CommonRequest::KnownChunk {
                    addr,
                    len,
                    device_hash,
                }),
                None,
            ) => known
                .insert(addr, len, device_hash)
                .map_err(KeeperError::KnownChunks)?,
            (
                KeeperRequest::Common(CommonRequest::DumpBegin {
                    slot_size,
                    slots,
                    streams,
                }),
                Some(memfd),
            ) => {
                let ring = Ring {
                    slot_size,
                    slots,
                    streams,
                };
                gpusnap_agent::dump::run::<KeeperRequest>(
                    &mut gpu,
                    ch,
                    ring,
                    memfd,
                    &known,
                    gpusnap_agent::dump::Mode::Stopped,
                    gpusnap_agent::dump::ReleaseAlso {
                        released: gpusnap_agent::forget_released,
                        imports: gpusnap_agent::dump::no_imports,
                    },
                );
                // A snapshot set aside: the dump that just ended drained the imports; once
                // it released them, the snapshot is what the next dump drains.
                if !aside.is_empty() && take_aside(&mut aside) {
                    continue;
                }
                // Stay until the plugin lets go (in `exit`, after CRIU's part): the plugin
                // decides when the keeper's memory may go, and where CRIU reaps orphans the
                // keeper is its child, whose exit it would take for a failure of its own.
                wait_for_close(ch, OVER);
                return Ok(());
            }
            (
                KeeperRequest::Expect {
                    id,
                    gpu: uuid,
                    addr,
                    size,
                    rdma_capable,
                },
                None,
            ) => {
                let made = gpusnap_agent::cu::KeeperMemory { rdma_capable };
                let expected = expect(&mut gpu, id, &uuid, (addr, size), made);
                answer(
                    ch,
                    expected.map(|device| Reply::Expected { id, device }),
                    || format!("expecting #{id} at {addr:#x}"),
                )?;
            }
            (
                KeeperRequest::Common(CommonRequest::RestoreBegin {
                    slot_size,
                    slots,
                    streams,
                }),
                Some(memfd),
            ) => {
                let ring = Ring {
                    slot_size,
                    slots,
                    streams,
                };
                gpusnap_agent::restore::run::<KeeperRequest>(&mut gpu, ch, ring, memfd);
            }
            (KeeperRequest::Common(CommonRequest::LendBegin), None) => {
                gpusnap_agent::lend::run::<KeeperRequest>(
                    ch,
                    &mut gpu,
                    gpusnap_agent::dump::no_imports,
                );
                // The restored job holds the memory now (or the restore failed and the job is
                // killed): nothing is left to do but let the plugin close.
                wait_for_close(ch, OVER);
                return Ok(());
            }
            (KeeperRequest::Common(CommonRequest::Abort), _) => {
                let _ = ch.send_reply(&Reply::Aborted);
                return Ok(());
            }
            // A request with a descriptor it never carries, or without the one it needs; a
            // step of an operation outside one.
            (
                other @ (KeeperRequest::Common(
                    CommonRequest::Hello { .. }
                    | CommonRequest::KnownChunk { .. }
                    | CommonRequest::LendBegin,
                )
                | KeeperRequest::SnapshotRoom { .. }
                | KeeperRequest::SnapshotIds { .. }
                | KeeperRequest::Snapshot { .. }
                | KeeperRequest::Expect { .. }),
                Some(_),
            )
            | (
                other @ (KeeperRequest::Common(
                    CommonRequest::DumpBegin { .. } | CommonRequest::RestoreBegin { .. },
                )
                | KeeperRequest::Adopt { .. }),
                None,
            )
            | (
                other @ KeeperRequest::Common(
                    CommonRequest::SlotFree { .. }
                    | CommonRequest::Release
                    | CommonRequest::ChunkLoad { .. }
                    | CommonRequest::ChunkZero { .. }
                    | CommonRequest::RestoreDataDone,
                ),
                _,
            ) => {
                let _ = ch.send_reply(&Reply::Error {
                    code: ErrorCode::BadRequest,
                    message: format!("a keeper does not take {other:?} (or its descriptor)"),
                });
            }
        }
    }
}

/// Sends `reply`, or the error it failed with as a CUDA error naming `what`.
fn answer(
    ch: &Channel,
    reply: Result<Reply, KeeperError>,
    what: impl FnOnce() -> String,
) -> Result<(), KeeperError> {
    let reply = reply.unwrap_or_else(|e| Reply::Error {
        code: ErrorCode::Cuda,
        message: format!("{}: {e}", what()),
    });
    reply_to(ch, &reply)
}

/// What a keeper whose operation is done answers.
const OVER: &str = "the keeper's operation is over";

/// Waits until the plugin closes its end; anything it sends meanwhile is answered with an
/// error saying `why` (the operation is over, or the keeper failed).
fn wait_for_close(ch: &Channel, why: &str) {
    loop {
        match ch.recv_request::<KeeperRequest>(None) {
            Ok(_) => {
                let _ = ch.send_reply(&Reply::Error {
                    code: ErrorCode::BadState,
                    message: why.to_owned(),
                });
            }
            Err(ProtoError::Interrupted) => continue,
            Err(_) => return,
        }
    }
}

/// Reserves `size` bytes for the job's allocation at `addr`: at `addr` where this process has
/// it free, else anywhere (the keeper's own mappings, its driver's and its libraries', may
/// hold the job's address: the H200 found PyTorch's 2 MiB allocations in the job's high mmap
/// area taken). Returns where: the entry keeps the job's address as its identity, and every
/// driver call that touches the memory here goes to the returned one.
fn reserve_for_job(
    drv: &gpusnap_agent::real::Driver,
    addr: u64,
    size: u64,
) -> Result<u64, KeeperError> {
    match drv.reserve_at(addr, size) {
        Ok(()) => Ok(addr),
        Err(e) => {
            let at = drv.reserve(size)?;
            debug!("keeper: the job's {addr:#x} is taken here ({e}): mapped at {at:#x} instead");
            Ok(at)
        }
    }
}

/// Imports the job's exported descriptor and maps it at the job's address, or where this
/// process has room ([`reserve_for_job`]).
fn adopt(
    gpu: &mut Gpu,
    id: u64,
    device: u32,
    addr: u64,
    size: u64,
    fd: OwnedFd,
) -> Result<(), KeeperError> {
    let drv = driver()?;
    let dev = i32::try_from(device).map_err(|_| KeeperError::Device(device.into()))?;
    gpu.prepare(drv, dev, 1, 1)?;
    let at = reserve_for_job(drv, addr, size)?;
    let handle = match drv.import_fd(fd.as_fd()) {
        Ok(h) => h,
        Err(e) => {
            let _ = drv.free_reservation(at, size);
            return Err(e.into());
        }
    };
    // The import holds the memory now; the descriptor is the job's business.
    drop(fd);
    if let Err(e) = gpusnap_agent::vmm::map_handle(drv, dev, at, size, handle) {
        let _ = drv.release(at, handle);
        let _ = drv.free_reservation(at, size);
        return Err(e.into());
    }
    table::try_lock_for(AGENT_LOCK_WAIT)
        .ok_or(KeeperError::TableLocked)?
        .insert_adopted(id, dev, (addr, at), size, handle);
    debug!("keeper: adopted #{id} at {addr:#x} (here {at:#x}, {size} bytes) on device {dev}");
    Ok(())
}

/// Most allocations one `Snapshot` may list: as many as a listing may hold
/// (`gpusnap_cuda::agent::MAX_ALLOCATIONS`); the keeper also takes no more than it adopted.
pub const MAX_SNAPSHOT_LIST: usize = 1 << 18;

/// The ids the `SnapshotIds` since the last `Snapshot` listed, bounded: past
/// [`MAX_SNAPSHOT_LIST`] nothing more is kept and the `Snapshot` is refused.
#[derive(Debug, Default)]
struct SnapshotList {
    ids: Vec<u64>,
    too_many: bool,
}

impl SnapshotList {
    fn add(&mut self, ids: &[u64]) {
        if self.too_many || self.ids.len() + ids.len() > MAX_SNAPSHOT_LIST {
            self.too_many = true;
            return;
        }
        self.ids.extend_from_slice(ids);
    }

    /// The listed ids, if the `Snapshot`'s `count` says as many and none is there twice.
    fn ids(self, count: u32) -> Result<std::collections::BTreeSet<u64>, SnapshotListError> {
        if self.too_many {
            return Err(SnapshotListError::TooMany);
        }
        if usize::try_from(count).ok() != Some(self.ids.len()) {
            return Err(SnapshotListError::Count {
                said: count,
                got: self.ids.len(),
            });
        }
        if self.ids.is_empty() {
            return Err(SnapshotListError::Empty);
        }
        let mut set = std::collections::BTreeSet::new();
        for id in self.ids {
            if !set.insert(id) {
                return Err(SnapshotListError::Twice(id));
            }
        }
        Ok(set)
    }
}

/// What a snapshot may take of GPU `device`'s free memory: `(free, allowed)`.
fn snapshot_room(
    gpu: &mut Gpu,
    device: u32,
    share_percent: u32,
) -> Result<(u64, u64), KeeperError> {
    let drv = driver()?;
    let dev = i32::try_from(device).map_err(|_| KeeperError::Device(device.into()))?;
    gpu.prepare(drv, dev, 1, 1)?;
    let (free, _) = drv.mem_info()?;
    Ok((free, allowance(free, share_percent)))
}

/// `share_percent` (1..=90) of `free` bytes.
fn allowance(free: u64, share_percent: u32) -> u64 {
    free / 100 * u64::from(share_percent.clamp(1, 90))
}

/// An adopted allocation as the snapshot finds it.
struct Adopted {
    id: u64,
    addr: u64,
    device: i32,
    size: u64,
    at: u64,
    handle: cudarc::driver::sys::CUmemGenericAllocationHandle,
}

/// A snapshot set aside (out of the table) while the imports the keeper still holds are
/// drained first: each allocation's copy, as the table will hold it.
struct SetAside {
    id: u64,
    device: i32,
    addr: u64,
    size: u64,
    at: u64,
    handle: cudarc::driver::sys::CUmemGenericAllocationHandle,
}

/// The snapshot of an asynchronous `criu dump -R`: each adopted allocation `ids` lists copied
/// device to device into fresh memory of the keeper's own, then its import of the job's memory
/// let go, so that the job can run on its own memory while the snapshot is drained. All or
/// nothing for the listed ones: where they would take more than `share_percent` of a GPU's
/// free memory, or a copy fails, the keeper's table is as before (the imports kept, no
/// snapshot memory left). Where every adopted allocation is listed, the table's entries now
/// hold the snapshot; else the snapshot is set aside in `aside`, and the table keeps the
/// imports of the others, which the next dump drains ([`take_aside`]).
fn snapshot(
    gpu: &mut Gpu,
    share_percent: u32,
    ids: &std::collections::BTreeSet<u64>,
    aside: &mut Vec<SetAside>,
) -> Result<Reply, KeeperError> {
    let drv = driver()?;
    if !aside.is_empty() {
        return Err(KeeperError::SnapshotList(SnapshotListError::SetAside));
    }
    let adopted: Vec<Adopted> = table::try_lock_for(AGENT_LOCK_WAIT)
        .ok_or(KeeperError::TableLocked)?
        .converted()
        .filter_map(|c| match c.backing {
            table::Backing::Mapped(handle) => Some(Adopted {
                id: c.id,
                addr: c.addr,
                device: c.device,
                size: c.size,
                at: c.mapped_at,
                handle,
            }),
            table::Backing::Released => None,
        })
        .collect();
    if let Some(&id) = ids.iter().find(|id| !adopted.iter().any(|e| e.id == **id)) {
        return Err(KeeperError::SnapshotList(SnapshotListError::NotAdopted(id)));
    }
    let whole = ids.len() == adopted.len();
    let entries: Vec<&Adopted> = adopted.iter().filter(|e| ids.contains(&e.id)).collect();
    let mut per_device = std::collections::BTreeMap::<i32, u64>::new();
    for e in &entries {
        *per_device.entry(e.device).or_default() += e.size;
    }
    for (&dev, &needed) in &per_device {
        gpu.prepare(drv, dev, 1, 1)?;
        let (free, _) = drv.mem_info()?;
        let allowed = allowance(free, share_percent);
        if needed > allowed {
            debug!("keeper: no snapshot: {needed} bytes on device {dev}, {allowed} allowed");
            return Ok(Reply::SnapshotRefused {
                needed,
                allowed,
                device: u32::try_from(dev).map_err(|_| KeeperError::Device(dev.into()))?,
            });
        }
    }
    let mut made: Vec<(usize, gpusnap_agent::vmm::VmmAlloc)> = Vec::with_capacity(entries.len());
    let undo = |made: Vec<(usize, gpusnap_agent::vmm::VmmAlloc)>| {
        for (_, a) in made {
            let _ = gpusnap_agent::vmm::free(drv, a.addr, a.size, Some(a.handle));
        }
    };
    for (i, e) in entries.iter().enumerate() {
        let copied = gpu
            .prepare(drv, e.device, 1, 1)
            .map_err(KeeperError::from)
            .and_then(|()| {
                let a = gpusnap_agent::vmm::alloc(drv, e.device, e.size)?;
                if let Err(err) = drv.copy_dtod(a.addr, e.at, e.size) {
                    let _ = gpusnap_agent::vmm::free(drv, a.addr, a.size, Some(a.handle));
                    return Err(err.into());
                }
                Ok(a)
            });
        match copied {
            Ok(a) => made.push((i, a)),
            Err(err) => {
                undo(made);
                return Err(err);
            }
        }
    }
    for &dev in per_device.keys() {
        gpu.prepare(drv, dev, 1, 1)?;
        if let Err(err) = drv.synchronize_current() {
            undo(made);
            return Err(err.into());
        }
    }
    // Every copy is complete: the snapshot replaces the imports. The job keeps its memory
    // through its own descriptors; from here the keeper maps none of it.
    let mut t = table::try_lock_for(AGENT_LOCK_WAIT).ok_or(KeeperError::TableLocked)?;
    let mut bytes = 0u64;
    for (i, a) in &made {
        let e = entries[*i];
        if whole {
            t.replace_adopted(e.addr, a.addr, a.handle);
        } else {
            // Out of the table until the imports left there are drained.
            t.remove_converted(e.addr);
            aside.push(SetAside {
                id: e.id,
                device: e.device,
                addr: e.addr,
                size: e.size,
                at: a.addr,
                handle: a.handle,
            });
        }
        bytes += e.size;
        if let Err(err) = gpusnap_agent::vmm::free(drv, e.at, e.size, Some(e.handle)) {
            // The import stays mapped here: harmless (the job's memory lives on through its
            // descriptors either way), and it goes with the keeper.
            debug!("keeper: letting go of the import at {:#x}: {err}", e.at);
        }
    }
    drop(t);
    debug!(
        "keeper: snapshot of {} allocations, {bytes} bytes{}",
        made.len(),
        if whole {
            String::new()
        } else {
            format!(
                ", set aside: the other {} imports are drained first",
                adopted.len() - made.len()
            )
        }
    );
    Ok(Reply::Snapshotted {
        count: u32::try_from(made.len()).unwrap_or(u32::MAX),
        bytes,
    })
}

/// After a dump of the imports a set-aside snapshot waited for: where that dump ended with
/// its `Release` (every entry of the table released), the released entries leave the table
/// (their address ranges freed) and the snapshot takes their place, for the next dump; `true`
/// then. Otherwise (the dump failed or was aborted) nothing changes and the snapshot goes
/// with the keeper.
fn take_aside(aside: &mut Vec<SetAside>) -> bool {
    let Ok(drv) = driver() else {
        return false;
    };
    let Some(mut t) = table::try_lock_for(AGENT_LOCK_WAIT) else {
        return false;
    };
    let released: Vec<(u64, u64, u64)> = t
        .converted()
        .filter(|c| c.backing == table::Backing::Released)
        .map(|c| (c.addr, c.mapped_at, c.size))
        .collect();
    if released.len() != t.converted().count() {
        debug!("keeper: the dump before the snapshot's did not release every import");
        return false;
    }
    for (addr, at, size) in released {
        t.remove_converted(addr);
        if let Err(e) = drv.free_reservation(at, size) {
            debug!("keeper: freeing the range at {at:#x}: {e}");
        }
    }
    let n = aside.len();
    for a in aside.drain(..) {
        t.insert_adopted(a.id, a.device, (a.addr, a.at), a.size, a.handle);
    }
    debug!("keeper: the imports are drained; the snapshot of {n} allocations is next");
    true
}

/// Records the job's allocation `id` at `addr` (`size` bytes) on the GPU with UUID `uuid` for
/// the load that follows, to be made as `made` says (the job's memory was RDMA-capable or
/// not), and reserves an address range for it here (the job's where it is free,
/// [`reserve_for_job`]). Returns the keeper's ordinal of that GPU.
fn expect(
    gpu: &mut Gpu,
    id: u64,
    uuid: &[u8; 16],
    (addr, size): (u64, u64),
    made: gpusnap_agent::cu::KeeperMemory,
) -> Result<u32, KeeperError> {
    let drv = driver()?;
    let dev = drv.ordinal_of(uuid)?.ok_or(KeeperError::NoGpu(*uuid))?;
    let cu_dev = drv.device(dev)?;
    let exportable = drv.posix_fd_handles(cu_dev);
    // Plain memory is the agent's own (exportable where the device can); anything else is
    // made with exactly the job's properties, which need POSIX-fd handles to be handed over.
    let made_as = match (made.rdma_capable, exportable) {
        (false, _) => None,
        (true, true) => Some(made.prop(cu_dev)),
        (true, false) => return Err(KeeperError::NotExportable { id }),
    };
    // The reservation is made in that device's context.
    gpu.prepare(drv, dev, 0, 0)?;
    let at = reserve_for_job(drv, addr, size)?;
    match table::try_lock_for(AGENT_LOCK_WAIT) {
        Some(mut t) => t.insert_expected(id, dev, (addr, at), size, (exportable, made_as)),
        None => {
            let _ = drv.free_reservation(at, size);
            return Err(KeeperError::TableLocked);
        }
    }
    debug!(
        "keeper: expecting #{id} at {addr:#x} (here {at:#x}, {size} bytes) on device {dev}{}",
        if made.rdma_capable {
            ", RDMA-capable"
        } else {
            ""
        }
    );
    u32::try_from(dev).map_err(|_| KeeperError::Device(dev.into()))
}

fn hex(b: &[u8; 16]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn hello() -> Reply {
    let s = table::try_lock_for(AGENT_LOCK_WAIT).map(|t| t.summary());
    // SAFETY: getpid and gettid have no preconditions.
    let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
    Reply::Hello {
        version: PROTOCOL_VERSION,
        // Its own pid namespace's numbers; getpid's pid_t is never negative.
        pid: NsPid(pid as u32),
        tid: NsTid(tid),
        allocations: s.as_ref().map_or(0, |s| s.entries),
        converted_bytes: s.as_ref().map_or(0, |s| s.converted_bytes),
        devices: s.as_ref().map_or(0, |s| s.devices),
        released: false,
        hazards: 0,
        kept: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_list_is_what_its_count_says_each_id_once() {
        let mut l = SnapshotList::default();
        l.add(&[3, 1]);
        l.add(&[2]);
        assert_eq!(l.ids(3).unwrap().into_iter().collect::<Vec<_>>(), [1, 2, 3]);
        let mut l = SnapshotList::default();
        l.add(&[3, 1]);
        assert_eq!(
            l.ids(3).unwrap_err(),
            SnapshotListError::Count { said: 3, got: 2 }
        );
        let mut l = SnapshotList::default();
        l.add(&[3, 1, 3]);
        assert_eq!(l.ids(3).unwrap_err(), SnapshotListError::Twice(3));
        assert_eq!(
            SnapshotList::default().ids(0).unwrap_err(),
            SnapshotListError::Empty
        );
    }

    #[test]
    fn a_snapshot_list_is_bounded() {
        let mut l = SnapshotList::default();
        let chunk: Vec<u64> = (0..60).collect();
        for _ in 0..MAX_SNAPSHOT_LIST / 60 {
            l.add(&chunk);
        }
        assert!(!l.too_many);
        // Past the bound nothing more is kept, and the snapshot is refused.
        l.add(&chunk);
        assert!(l.too_many && l.ids.len() <= MAX_SNAPSHOT_LIST);
        let n = l.ids.len() as u32;
        assert_eq!(l.ids(n).unwrap_err(), SnapshotListError::TooMany);
    }

    #[test]
    fn the_share_is_of_the_free_memory_within_1_to_90_percent() {
        assert_eq!(allowance(10 << 20, 50), 5_242_850);
        assert_eq!(allowance(100, 0), 1);
        assert_eq!(allowance(100, 100), 90);
    }
}
