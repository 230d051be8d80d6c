//! The messages: the requests (plugin → agent or keeper) and [`Reply`] (agent or keeper →
//! plugin), their wire encoding, and decoding of untrusted bytes.
//!
//! Two servers take requests, each its own type: [`AgentRequest`] (the job's in-process agent,
//! `agent`) and [`KeeperRequest`] (the keeper, `keeper`). The requests both take are one
//! [`CommonRequest`] (`common`), a variant of each, encoded and decoded in one place. Each
//! type's decoder refuses the other's own kinds ([`ProtoError::UnknownKind`]), as it refuses
//! a reply's.
//!
//! Layout: header `magic u32 | version u16 | kind u16` (little-endian), then the variant's fixed
//! fields in declaration order; strings are `u16 length + UTF-8`, booleans one byte (0/1), enums
//! their numeric value (`AllocKind` u8, `ErrorCode` u16). Request kinds are `0x00xx` (one
//! number space for both request types, so a kind names one request whichever server gets it),
//! reply kinds `0x01xx`, so a message decoded with the wrong decoder is an
//! [`ProtoError::UnknownKind`].

mod agent;
mod common;
mod keeper;

pub use agent::AgentRequest;
pub use common::{CommonRequest, Request};
pub use keeper::{KeeperRequest, MAX_SNAPSHOT_IDS};

use crate::pid::{HostPid, NsPid, NsTid};
use crate::wire::{Reader, Writer};
use crate::{MAX_MESSAGE, PROTOCOL_VERSION, ProtoError, Share, ShareKind};

/// "GSNP" read as a little-endian u32.
pub const MAGIC: u32 = 0x504E_5347;
/// Size of the header every message starts with.
pub const HEADER_LEN: usize = 8;
/// Longest error message put on the wire (longer ones are cut at a character boundary).
pub const MAX_ERROR_MESSAGE: usize = 400;

/// How the agent holds an allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocKind {
    /// A `cuMemAlloc` that the agent turned into a VMM mapping, created exportable: the agent
    /// moves its data, and may lend it at a hand-over (`LendBegin`).
    Converted = 1,
    /// The application's own `cuMemCreate` + `cuMemMap`; recorded only, left to the driver checkpoint.
    AppVmm = 2,
    /// A converted `cuMemAlloc` whose memory could not be created exportable (the device has no
    /// POSIX-fd handles): the agent moves its data by copying only, never lends it.
    ConvertedNoExport = 3,
    /// The whole mapping of one of the application's own `cuMemCreate` handles whose memory is
    /// not what a keeper makes (compression or usage flags, other handle types, another
    /// location: properties a keeper cannot create again): the agent moves its data by copying
    /// only, never lends it.
    AppHandleMapping = 4,
    /// The whole mapping of one of the application's own `cuMemCreate` handles of memory a
    /// keeper makes again (pinned device memory, POSIX-fd handles, RDMA-capable or not:
    /// [`Reply::Allocation::rdma_capable`]), exportable as the application asked or as the
    /// agent created it: moved, and lent at a hand-over like [`AllocKind::Converted`].
    AppHandleLendable = 5,
    /// The whole mapping of one of the application's own handles whose driver handle was
    /// imported at a hand-over (the memory mapped back from a descriptor), which the driver will
    /// not export again: moved by copying only.
    AppHandleImported = 6,
}

impl AllocKind {
    fn from_u8(v: u8) -> Result<Self, ProtoError> {
        match v {
            1 => Ok(AllocKind::Converted),
            2 => Ok(AllocKind::AppVmm),
            3 => Ok(AllocKind::ConvertedNoExport),
            4 => Ok(AllocKind::AppHandleMapping),
            5 => Ok(AllocKind::AppHandleLendable),
            6 => Ok(AllocKind::AppHandleImported),
            _ => Err(ProtoError::Malformed("unknown allocation kind")),
        }
    }

    /// Whether the agent moves the allocation's data (the split path), by lending or copying.
    pub fn moved(self) -> bool {
        !matches!(self, AllocKind::AppVmm)
    }

    /// Whether a `LendBegin` lends it.
    pub fn lendable(self) -> bool {
        matches!(self, AllocKind::Converted | AllocKind::AppHandleLendable)
    }
}

/// Why the agent refused or failed a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    /// The request is invalid in itself (sizes, ranges, slot numbers).
    BadRequest = 1,
    /// The request is valid but not in the agent's current state.
    BadState = 2,
    /// The allocation table is held by a (stopped) application thread.
    Busy = 3,
    /// A CUDA driver call failed (or libcuda is absent).
    Cuda = 4,
    /// The staging memfd could not be validated, mapped or registered.
    Staging = 5,
    /// The peer did not answer in time.
    Timeout = 6,
    /// The peer speaks another protocol version.
    VersionMismatch = 7,
    /// Data on the device does not match the hash the image recorded for it.
    DataMismatch = 8,
}

impl ErrorCode {
    fn from_u16(v: u16) -> Result<Self, ProtoError> {
        Ok(match v {
            1 => ErrorCode::BadRequest,
            2 => ErrorCode::BadState,
            3 => ErrorCode::Busy,
            4 => ErrorCode::Cuda,
            5 => ErrorCode::Staging,
            6 => ErrorCode::Timeout,
            7 => ErrorCode::VersionMismatch,
            8 => ErrorCode::DataMismatch,
            _ => return Err(ProtoError::Malformed("unknown error code")),
        })
    }
}

/// Bits of [`Reply::Hello::hazards`]: what the process did that the driver's checkpoint cannot
/// take, so the plugin refuses the dump (naming the cause) before touching the process.
pub mod hazard {
    /// `cuMemAllocManaged`: managed (unified) memory.
    pub const MANAGED_MEMORY: u32 = 1 << 0;
    /// `cuIpcGetMemHandle` / `cuMemExportToShareableHandle`: device memory shared with others.
    pub const IPC_EXPORT: u32 = 1 << 1;
    /// `cuIpcOpenMemHandle`: another process's device memory mapped here.
    pub const IPC_IMPORT: u32 = 1 << 2;
    /// `cuCtxEnablePeerAccess`: cross-GPU peer mappings.
    pub const PEER_ACCESS: u32 = 1 << 3;
    /// `cuIpcGetMemHandle` of memory the agent converted, served by the agent itself: carried
    /// on the split path when every process it shares with is in the same dump.
    pub const SERVED_IPC_EXPORT: u32 = 1 << 4;
    /// `cuIpcOpenMemHandle` of a handle the agent served: carried like [`SERVED_IPC_EXPORT`].
    pub const SERVED_IPC_IMPORT: u32 = 1 << 5;
    /// `cuIpcOpenEventHandle`: another process's interprocess event opened here and not
    /// destroyed yet (reported only while one is live, not once seen). The driver restores it
    /// without an error, but on the H200 a wait on it after the importer's restore did not wait
    /// for the exporter's work.
    pub const IPC_EVENT_IMPORT: u32 = 1 << 6;
    /// `cuMemExportToShareableHandle` (POSIX fd) of an application handle the agent moves:
    /// carried on the split path when every importer is in the dump (`docs/ipc.md`).
    pub const SHAREABLE_EXPORT: u32 = 1 << 7;
    /// `cuMemImportFromShareableHandle` (POSIX fd), the handle virtualized by the agent:
    /// carried like [`SHAREABLE_EXPORT`].
    pub const SHAREABLE_IMPORT: u32 = 1 << 8;
    /// `cuMemSetAccess` on memory the agent moves with anything but read-write access for the
    /// memory's own GPU (read-only, or other GPUs too): the split path would make that memory
    /// again with the default access, so such a process takes the driver's path, which keeps
    /// it (refused if it imports memory, which the driver's path cannot take).
    pub const ACCESS_SET: u32 = 1 << 9;
    /// The bits that make the plugin ask the agent for its shares (`ListSharing`).
    pub const SHARING: u32 =
        SERVED_IPC_EXPORT | SERVED_IPC_IMPORT | SHAREABLE_EXPORT | SHAREABLE_IMPORT;
    /// The bits of an importer (its release unmaps another process's memory).
    pub const IMPORTING: u32 = SERVED_IPC_IMPORT | SHAREABLE_IMPORT;
    /// The bits that refuse a dump by themselves (the served IPC bits need a look at the tree).
    pub const REFUSING: u32 =
        MANAGED_MEMORY | IPC_EXPORT | IPC_IMPORT | PEER_ACCESS | IPC_EVENT_IMPORT;

    /// Human words for a set of bits.
    pub fn describe(bits: u32) -> Vec<&'static str> {
        let mut v = Vec::new();
        if bits & MANAGED_MEMORY != 0 {
            v.push("managed (unified) memory (cuMemAllocManaged / cudaMallocManaged)");
        }
        if bits & IPC_EXPORT != 0 {
            v.push("device memory exported to other processes (CUDA IPC handles)");
        }
        if bits & IPC_IMPORT != 0 {
            v.push("another process's device memory opened through CUDA IPC or a shareable handle");
        }
        if bits & PEER_ACCESS != 0 {
            v.push("peer access between GPUs (cuCtxEnablePeerAccess / cudaDeviceEnablePeerAccess)");
        }
        if bits & SERVED_IPC_EXPORT != 0 {
            v.push("device memory shared with other processes through the agent's CUDA IPC");
        }
        if bits & SERVED_IPC_IMPORT != 0 {
            v.push("another process's device memory opened through the agent's CUDA IPC");
        }
        if bits & IPC_EVENT_IMPORT != 0 {
            v.push(
                "an interprocess CUDA event of another process opened here (cuIpcOpenEventHandle)",
            );
        }
        if bits & SHAREABLE_EXPORT != 0 {
            v.push("device memory exported with cuMemExportToShareableHandle (POSIX fd)");
        }
        if bits & SHAREABLE_IMPORT != 0 {
            v.push("another process's device memory imported with cuMemImportFromShareableHandle");
        }
        if bits & ACCESS_SET != 0 {
            v.push(
                "cuMemSetAccess with access other than read-write for the memory's own GPU (read-only, or other GPUs)",
            );
        }
        v
    }
}

/// Agent or keeper → plugin (one type: both answer in the same words).
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// Answer to [`CommonRequest::Hello`].
    Hello {
        /// The agent's [`PROTOCOL_VERSION`].
        version: u16,
        /// The agent's pid in its own pid namespace.
        pid: NsPid,
        /// The agent thread's tid in its own pid namespace.
        tid: NsTid,
        /// Entries the agent tracks (converted and application VMM).
        allocations: u32,
        /// Bytes of converted allocations.
        converted_bytes: u64,
        /// Distinct devices among converted allocations.
        devices: u32,
        /// Whether any converted allocation's physical memory is released, or a reload of it
        /// began and did not complete (the memory is not whole).
        released: bool,
        /// [`hazard`] bits: state the driver cannot checkpoint, seen since the process started
        /// ([`hazard::IPC_EVENT_IMPORT`]: held now).
        hazards: u32,
        /// Released allocations whose memory the agent still holds through descriptors it kept
        /// at a hand-over ([`AgentRequest::Reclaim`] maps them again without any file).
        kept: u32,
    },
    /// One tracked allocation.
    Allocation {
        /// Agent-assigned id, unique within the process.
        id: u64,
        /// Device ordinal.
        device: u32,
        /// Base device address.
        addr: u64,
        /// Size in bytes (rounded to the allocation granularity for converted ones).
        size: u64,
        /// How it is held.
        kind: AllocKind,
        /// Its memory is `gpuDirectRDMACapable` (the application's own handle asked for it): a
        /// keeper restoring it makes it so.
        rdma_capable: bool,
    },
    /// End of a listing.
    AllocationsEnd {
        /// Number of [`Reply::Allocation`] messages sent.
        count: u32,
    },
    /// The staging is mapped and registered; data moves next.
    Ready,
    /// Slot `slot` holds `len` bytes of allocation `alloc_id` starting at device address `addr`.
    ChunkReady {
        /// Slot index.
        slot: u32,
        /// Allocation id.
        alloc_id: u64,
        /// Device address of the chunk's first byte.
        addr: u64,
        /// Bytes in the slot.
        len: u64,
        /// The chunk's hash computed on the device (`crate::devhash`); `None` when the agent
        /// could not hash on the device.
        device_hash: Option<u64>,
    },
    /// The chunk at `addr` is all zeros on the device: it was not copied and uses no slot.
    ChunkZero {
        /// Allocation id.
        alloc_id: u64,
        /// Device address of the chunk's first byte.
        addr: u64,
        /// Bytes.
        len: u64,
        /// As for `ChunkReady` (always known: zeros are only found by hashing).
        device_hash: u64,
    },
    /// The chunk at `addr` hashes on the device as the [`CommonRequest::KnownChunk`] said: it was not
    /// copied and uses no slot.
    ChunkUnchanged {
        /// Allocation id.
        alloc_id: u64,
        /// Device address of the chunk's first byte.
        addr: u64,
        /// Bytes.
        len: u64,
        /// Its device hash (the known one).
        device_hash: u64,
    },
    /// Every chunk was copied out and every slot came back.
    DumpDataDone {
        /// Chunks sent.
        chunks: u64,
        /// Bytes sent.
        bytes: u64,
        /// Time since `DumpBegin`.
        micros: u64,
    },
    /// Physical memory released; the agent closes the connection after this.
    Released {
        /// Allocations released.
        allocations: u32,
        /// Bytes released.
        bytes: u64,
        /// Time the release took.
        micros: u64,
    },
    /// The copy out of this slot (restore) completed; the plugin may refill it.
    SlotFree {
        /// Slot index.
        slot: u32,
    },
    /// Every chunk was copied in; the agent closes the connection after this.
    Restored {
        /// Bytes copied to the device.
        bytes: u64,
        /// Time since `RestoreBegin`.
        micros: u64,
        /// Chunks whose device hash was checked on the device after the load (all matched).
        verified: u64,
    },
    /// Answer to [`CommonRequest::LendBegin`], one per converted allocation, with a copy of its
    /// exported descriptor attached.
    Lent {
        /// Allocation id.
        id: u64,
        /// Device ordinal.
        device: u32,
        /// Device address.
        addr: u64,
        /// Bytes.
        size: u64,
        /// The memory is `gpuDirectRDMACapable` (as the lender created it).
        rdma_capable: bool,
    },
    /// Every converted allocation was lent.
    LentEnd {
        /// Number of [`Reply::Lent`] messages sent.
        count: u32,
        /// Their bytes.
        bytes: u64,
    },
    /// What a snapshot may take of one GPU's free memory (`SnapshotRoom`).
    SnapshotRoom {
        /// The keeper's ordinal of the GPU.
        device: u32,
        /// Its free memory now, bytes.
        free: u64,
        /// What the share allows of it, bytes: what a `Snapshot` may take there.
        allowed: u64,
    },
    /// The keeper holds a snapshot of every allocation the `Snapshot` listed, and no import of
    /// the job's of them.
    Snapshotted {
        /// Allocations copied.
        count: u32,
        /// Their bytes.
        bytes: u64,
    },
    /// The snapshot was not made (nothing changed): it would not fit.
    SnapshotRefused {
        /// Bytes the snapshot needs on the GPU that lacked room.
        needed: u64,
        /// What the share allowed there.
        allowed: u64,
        /// The keeper's ordinal of that GPU.
        device: u32,
    },
    /// The keeper mapped allocation `id` at the job's address.
    Adopted {
        /// Allocation id.
        id: u64,
    },
    /// The keeper recorded allocation `id` for the load, on its device ordinal `device`.
    Expected {
        /// Allocation id.
        id: u64,
        /// The keeper's ordinal of the GPU.
        device: u32,
    },
    /// The job mapped handed-over allocation `id` at its address.
    Taken {
        /// Allocation id.
        id: u64,
    },
    /// Every released allocation of the job is mapped from handed-over memory.
    TakenAll {
        /// Allocations mapped.
        allocations: u32,
        /// Their bytes.
        bytes: u64,
        /// Time since the first `Take`.
        micros: u64,
    },
    /// One share ([`AgentRequest::ListSharing`]): what it is, and how it is shared ([`Share`]).
    Shared(Share),
    /// Every share was listed.
    SharedEnd {
        /// Number of [`Reply::Shared`] sent.
        count: u32,
    },
    /// The current memory of exported allocation `id` (descriptor attached), and the exporter's
    /// key ([`Share::key`]): an importer maps it again only if it is its source's.
    ShareFd {
        id: u64,
        addr: u64,
        size: u64,
        key: [u8; 16],
    },
    /// Every exported allocation's descriptor was sent.
    ShareFdEnd {
        /// Number of [`Reply::ShareFd`] sent.
        count: u32,
    },
    /// The import is mapped again at `addr`.
    Reimported { addr: u64 },
    /// [`AgentRequest::ShareableSource`] is recorded.
    SourceNoted,
    /// The first message of a keeper started detached: it runs as `pid`, and a pidfd of it is
    /// attached. The process the plugin started has exited by then, so the keeper is not a
    /// child of CRIU's: CRIU never sees its exit.
    Detached {
        /// The keeper's pid (in the plugin's pid namespace).
        pid: HostPid,
    },
    /// Every released allocation is mapped again from its kept descriptor.
    Reclaimed {
        /// Allocations mapped again.
        allocations: u32,
        /// Their bytes.
        bytes: u64,
        /// Time it took.
        micros: u64,
    },
    /// The operation was abandoned; memory is mapped.
    Aborted,
    /// The request failed.
    Error {
        /// What kind of failure.
        code: ErrorCode,
        /// Human-readable detail (truncated to [`MAX_ERROR_MESSAGE`] bytes on encode).
        message: String,
    },
}

mod kind {
    pub const REQ_HELLO: u16 = 0x0001;
    pub const REQ_LIST: u16 = 0x0002;
    pub const REQ_DUMP_BEGIN: u16 = 0x0003;
    pub const REQ_SLOT_FREE: u16 = 0x0004;
    pub const REQ_RELEASE: u16 = 0x0005;
    pub const REQ_ABORT: u16 = 0x0006;
    pub const REQ_RESTORE_BEGIN: u16 = 0x0007;
    pub const REQ_CHUNK_LOAD: u16 = 0x0008;
    pub const REQ_RESTORE_DONE: u16 = 0x0009;
    pub const REQ_CHUNK_ZERO: u16 = 0x000A;
    pub const REQ_KNOWN_CHUNK: u16 = 0x000B;
    pub const REQ_PRECOPY_BEGIN: u16 = 0x000C;
    pub const REQ_LEND_BEGIN: u16 = 0x000D;
    pub const REQ_ADOPT: u16 = 0x000E;
    pub const REQ_RECLAIM: u16 = 0x000F;
    pub const REQ_EXPECT: u16 = 0x0010;
    pub const REQ_TAKE: u16 = 0x0011;
    pub const REQ_TAKE_END: u16 = 0x0012;
    pub const REQ_LIST_SHARING: u16 = 0x0013;
    pub const REQ_SHARE_FDS: u16 = 0x0014;
    pub const REQ_REIMPORT: u16 = 0x0015;
    pub const REQ_SHAREABLE_SOURCE: u16 = 0x0016;
    pub const REQ_SNAPSHOT: u16 = 0x0017;
    pub const REQ_SNAPSHOT_ROOM: u16 = 0x0018;
    pub const REQ_SNAPSHOT_IDS: u16 = 0x0019;

    pub const REP_HELLO: u16 = 0x0101;
    pub const REP_ALLOCATION: u16 = 0x0102;
    pub const REP_ALLOCATIONS_END: u16 = 0x0103;
    pub const REP_READY: u16 = 0x0104;
    pub const REP_CHUNK_READY: u16 = 0x0105;
    pub const REP_DUMP_DONE: u16 = 0x0106;
    pub const REP_RELEASED: u16 = 0x0107;
    pub const REP_SLOT_FREE: u16 = 0x0108;
    pub const REP_RESTORED: u16 = 0x0109;
    pub const REP_ABORTED: u16 = 0x010A;
    pub const REP_ERROR: u16 = 0x010B;
    pub const REP_CHUNK_ZERO: u16 = 0x010C;
    pub const REP_CHUNK_UNCHANGED: u16 = 0x010D;
    pub const REP_LENT: u16 = 0x010E;
    pub const REP_LENT_END: u16 = 0x010F;
    pub const REP_ADOPTED: u16 = 0x0110;
    pub const REP_RECLAIMED: u16 = 0x0111;
    pub const REP_EXPECTED: u16 = 0x0112;
    pub const REP_TAKEN: u16 = 0x0113;
    pub const REP_TAKEN_ALL: u16 = 0x0114;
    pub const REP_DETACHED: u16 = 0x0115;
    pub const REP_SHARED: u16 = 0x0116;
    pub const REP_SHARED_END: u16 = 0x0117;
    pub const REP_SHARE_FD: u16 = 0x0118;
    pub const REP_SHARE_FD_END: u16 = 0x0119;
    pub const REP_REIMPORTED: u16 = 0x011A;
    pub const REP_SOURCE_NOTED: u16 = 0x011B;
    pub const REP_SNAPSHOTTED: u16 = 0x011C;
    pub const REP_SNAPSHOT_REFUSED: u16 = 0x011D;
    pub const REP_SNAPSHOT_ROOM: u16 = 0x011E;
}

/// An optional u64: a presence byte (0/1), then the value (0 when absent).
fn opt_u64(w: &mut Writer<'_>, v: Option<u64>) {
    w.bool(v.is_some());
    w.u64(v.unwrap_or(0));
}

fn read_opt_u64(r: &mut Reader<'_>) -> Result<Option<u64>, ProtoError> {
    let present = r.bool()?;
    let v = r.u64()?;
    match (present, v) {
        (true, v) => Ok(Some(v)),
        (false, 0) => Ok(None),
        (false, _) => Err(ProtoError::Malformed("a value where none is present")),
    }
}

fn header(w: &mut Writer<'_>, kind: u16) {
    w.u32(MAGIC);
    w.u16(PROTOCOL_VERSION);
    w.u16(kind);
}

/// Checks magic and version; returns the kind and a reader over the body.
fn open(b: &[u8]) -> Result<(u16, Reader<'_>), ProtoError> {
    if b.len() > MAX_MESSAGE {
        return Err(ProtoError::TooLong);
    }
    let mut r = Reader::new(b);
    let magic = r
        .u32()
        .map_err(|_| ProtoError::Malformed("shorter than the header"))?;
    if magic != MAGIC {
        return Err(ProtoError::BadMagic);
    }
    let version = r
        .u16()
        .map_err(|_| ProtoError::Malformed("shorter than the header"))?;
    let kind = r
        .u16()
        .map_err(|_| ProtoError::Malformed("shorter than the header"))?;
    if version != PROTOCOL_VERSION {
        return Err(ProtoError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: version,
        });
    }
    Ok((kind, r))
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub(crate) fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Reply {
    /// Writes the message into `buf`; returns its length. `Error` messages are cut to
    /// [`MAX_ERROR_MESSAGE`] bytes.
    pub fn encode(&self, buf: &mut [u8; MAX_MESSAGE]) -> usize {
        let mut w = Writer::new(buf);
        match self {
            Reply::Hello {
                version,
                pid,
                tid,
                allocations,
                converted_bytes,
                devices,
                released,
                hazards,
                kept,
            } => {
                header(&mut w, kind::REP_HELLO);
                w.u16(*version);
                // The wire's i32: the same four bytes as the u32.
                w.u32(pid.get());
                w.i32(tid.get());
                w.u32(*allocations);
                w.u64(*converted_bytes);
                w.u32(*devices);
                w.bool(*released);
                w.u32(*hazards);
                w.u32(*kept);
            }
            Reply::Allocation {
                id,
                device,
                addr,
                size,
                kind,
                rdma_capable,
            } => {
                header(&mut w, kind::REP_ALLOCATION);
                w.u64(*id);
                w.u32(*device);
                w.u64(*addr);
                w.u64(*size);
                w.u8(*kind as u8);
                w.bool(*rdma_capable);
            }
            Reply::AllocationsEnd { count } => {
                header(&mut w, kind::REP_ALLOCATIONS_END);
                w.u32(*count);
            }
            Reply::Ready => header(&mut w, kind::REP_READY),
            Reply::ChunkReady {
                slot,
                alloc_id,
                addr,
                len,
                device_hash,
            } => {
                header(&mut w, kind::REP_CHUNK_READY);
                w.u32(*slot);
                w.u64(*alloc_id);
                w.u64(*addr);
                w.u64(*len);
                opt_u64(&mut w, *device_hash);
            }
            Reply::ChunkZero {
                alloc_id,
                addr,
                len,
                device_hash,
            } => {
                header(&mut w, kind::REP_CHUNK_ZERO);
                w.u64(*alloc_id);
                w.u64(*addr);
                w.u64(*len);
                w.u64(*device_hash);
            }
            Reply::ChunkUnchanged {
                alloc_id,
                addr,
                len,
                device_hash,
            } => {
                header(&mut w, kind::REP_CHUNK_UNCHANGED);
                w.u64(*alloc_id);
                w.u64(*addr);
                w.u64(*len);
                w.u64(*device_hash);
            }
            Reply::DumpDataDone {
                chunks,
                bytes,
                micros,
            } => {
                header(&mut w, kind::REP_DUMP_DONE);
                w.u64(*chunks);
                w.u64(*bytes);
                w.u64(*micros);
            }
            Reply::Released {
                allocations,
                bytes,
                micros,
            } => {
                header(&mut w, kind::REP_RELEASED);
                w.u32(*allocations);
                w.u64(*bytes);
                w.u64(*micros);
            }
            Reply::SlotFree { slot } => {
                header(&mut w, kind::REP_SLOT_FREE);
                w.u32(*slot);
            }
            Reply::Restored {
                bytes,
                micros,
                verified,
            } => {
                header(&mut w, kind::REP_RESTORED);
                w.u64(*bytes);
                w.u64(*micros);
                w.u64(*verified);
            }
            Reply::Lent {
                id,
                device,
                addr,
                size,
                rdma_capable,
            } => {
                header(&mut w, kind::REP_LENT);
                w.u64(*id);
                w.u32(*device);
                w.u64(*addr);
                w.u64(*size);
                w.bool(*rdma_capable);
            }
            Reply::LentEnd { count, bytes } => {
                header(&mut w, kind::REP_LENT_END);
                w.u32(*count);
                w.u64(*bytes);
            }
            Reply::Snapshotted { count, bytes } => {
                header(&mut w, kind::REP_SNAPSHOTTED);
                w.u32(*count);
                w.u64(*bytes);
            }
            Reply::SnapshotRoom {
                device,
                free,
                allowed,
            } => {
                header(&mut w, kind::REP_SNAPSHOT_ROOM);
                w.u32(*device);
                w.u64(*free);
                w.u64(*allowed);
            }
            Reply::SnapshotRefused {
                needed,
                allowed,
                device,
            } => {
                header(&mut w, kind::REP_SNAPSHOT_REFUSED);
                w.u64(*needed);
                w.u64(*allowed);
                w.u32(*device);
            }
            Reply::Adopted { id } => {
                header(&mut w, kind::REP_ADOPTED);
                w.u64(*id);
            }
            Reply::Expected { id, device } => {
                header(&mut w, kind::REP_EXPECTED);
                w.u64(*id);
                w.u32(*device);
            }
            Reply::Taken { id } => {
                header(&mut w, kind::REP_TAKEN);
                w.u64(*id);
            }
            Reply::TakenAll {
                allocations,
                bytes,
                micros,
            } => {
                header(&mut w, kind::REP_TAKEN_ALL);
                w.u32(*allocations);
                w.u64(*bytes);
                w.u64(*micros);
            }
            Reply::Detached { pid } => {
                header(&mut w, kind::REP_DETACHED);
                // The wire's u32: the same four bytes as the i32.
                w.i32(pid.get());
            }
            Reply::Shared(Share {
                import,
                pid,
                id,
                addr,
                size,
                mapped,
                key,
                kind: how,
            }) => {
                header(&mut w, kind::REP_SHARED);
                let (shareable, [agent_fd, app_fd, own_fd]) = match *how {
                    ShareKind::Ipc => (false, [None; 3]),
                    ShareKind::Shareable {
                        agent_fd,
                        app_fd,
                        own_fd,
                    } => (true, [agent_fd, app_fd, own_fd]),
                };
                w.bool(*import);
                w.u32(pid.get());
                w.u64(*id);
                w.u64(*addr);
                w.u64(*size);
                w.bool(*mapped);
                w.bool(shareable);
                w.fd(agent_fd);
                w.fd(app_fd);
                w.fd(own_fd);
                w.bytes16(key);
            }
            Reply::SharedEnd { count } => {
                header(&mut w, kind::REP_SHARED_END);
                w.u32(*count);
            }
            Reply::ShareFd {
                id,
                addr,
                size,
                key,
            } => {
                header(&mut w, kind::REP_SHARE_FD);
                w.u64(*id);
                w.u64(*addr);
                w.u64(*size);
                w.bytes16(key);
            }
            Reply::ShareFdEnd { count } => {
                header(&mut w, kind::REP_SHARE_FD_END);
                w.u32(*count);
            }
            Reply::Reimported { addr } => {
                header(&mut w, kind::REP_REIMPORTED);
                w.u64(*addr);
            }
            Reply::SourceNoted => header(&mut w, kind::REP_SOURCE_NOTED),
            Reply::Reclaimed {
                allocations,
                bytes,
                micros,
            } => {
                header(&mut w, kind::REP_RECLAIMED);
                w.u32(*allocations);
                w.u64(*bytes);
                w.u64(*micros);
            }
            Reply::Aborted => header(&mut w, kind::REP_ABORTED),
            Reply::Error { code, message } => {
                header(&mut w, kind::REP_ERROR);
                w.u16(*code as u16);
                w.str(truncate_utf8(message, MAX_ERROR_MESSAGE));
            }
        }
        w.len()
    }

    /// Parses one received message. Never panics; trailing bytes are an error.
    pub fn decode(b: &[u8]) -> Result<Self, ProtoError> {
        let (k, mut r) = open(b)?;
        let rep = match k {
            kind::REP_HELLO => Reply::Hello {
                version: r.u16()?,
                pid: NsPid(r.u32()?),
                tid: NsTid(r.i32()?),
                allocations: r.u32()?,
                converted_bytes: r.u64()?,
                devices: r.u32()?,
                released: r.bool()?,
                hazards: r.u32()?,
                kept: r.u32()?,
            },
            kind::REP_ALLOCATION => Reply::Allocation {
                id: r.u64()?,
                device: r.u32()?,
                addr: r.u64()?,
                size: r.u64()?,
                kind: AllocKind::from_u8(r.u8()?)?,
                rdma_capable: r.bool()?,
            },
            kind::REP_ALLOCATIONS_END => Reply::AllocationsEnd { count: r.u32()? },
            kind::REP_READY => Reply::Ready,
            kind::REP_CHUNK_READY => Reply::ChunkReady {
                slot: r.u32()?,
                alloc_id: r.u64()?,
                addr: r.u64()?,
                len: r.u64()?,
                device_hash: read_opt_u64(&mut r)?,
            },
            kind::REP_CHUNK_ZERO => Reply::ChunkZero {
                alloc_id: r.u64()?,
                addr: r.u64()?,
                len: r.u64()?,
                device_hash: r.u64()?,
            },
            kind::REP_CHUNK_UNCHANGED => Reply::ChunkUnchanged {
                alloc_id: r.u64()?,
                addr: r.u64()?,
                len: r.u64()?,
                device_hash: r.u64()?,
            },
            kind::REP_DUMP_DONE => Reply::DumpDataDone {
                chunks: r.u64()?,
                bytes: r.u64()?,
                micros: r.u64()?,
            },
            kind::REP_RELEASED => Reply::Released {
                allocations: r.u32()?,
                bytes: r.u64()?,
                micros: r.u64()?,
            },
            kind::REP_SLOT_FREE => Reply::SlotFree { slot: r.u32()? },
            kind::REP_RESTORED => Reply::Restored {
                bytes: r.u64()?,
                micros: r.u64()?,
                verified: r.u64()?,
            },
            kind::REP_LENT => Reply::Lent {
                id: r.u64()?,
                device: r.u32()?,
                addr: r.u64()?,
                size: r.u64()?,
                rdma_capable: r.bool()?,
            },
            kind::REP_LENT_END => Reply::LentEnd {
                count: r.u32()?,
                bytes: r.u64()?,
            },
            kind::REP_ADOPTED => Reply::Adopted { id: r.u64()? },
            kind::REP_SNAPSHOTTED => Reply::Snapshotted {
                count: r.u32()?,
                bytes: r.u64()?,
            },
            kind::REP_SNAPSHOT_ROOM => Reply::SnapshotRoom {
                device: r.u32()?,
                free: r.u64()?,
                allowed: r.u64()?,
            },
            kind::REP_SNAPSHOT_REFUSED => Reply::SnapshotRefused {
                needed: r.u64()?,
                allowed: r.u64()?,
                device: r.u32()?,
            },
            kind::REP_EXPECTED => Reply::Expected {
                id: r.u64()?,
                device: r.u32()?,
            },
            kind::REP_TAKEN => Reply::Taken { id: r.u64()? },
            kind::REP_TAKEN_ALL => Reply::TakenAll {
                allocations: r.u32()?,
                bytes: r.u64()?,
                micros: r.u64()?,
            },
            kind::REP_DETACHED => Reply::Detached {
                pid: HostPid(r.i32()?),
            },
            kind::REP_SHARED => {
                let import = r.bool()?;
                let pid = NsPid(r.u32()?);
                let id = r.u64()?;
                let addr = r.u64()?;
                let size = r.u64()?;
                let mapped = r.bool()?;
                let shareable = r.bool()?;
                let (agent_fd, app_fd, own_fd) = (r.fd()?, r.fd()?, r.fd()?);
                let how = if shareable {
                    ShareKind::Shareable {
                        agent_fd,
                        app_fd,
                        own_fd,
                    }
                } else if agent_fd.is_none() && app_fd.is_none() && own_fd.is_none() {
                    ShareKind::Ipc
                } else {
                    return Err(ProtoError::Malformed(
                        "a CUDA IPC share with a descriptor (only shareable handles have them)",
                    ));
                };
                Reply::Shared(Share {
                    import,
                    pid,
                    id,
                    addr,
                    size,
                    mapped,
                    key: r.bytes16()?,
                    kind: how,
                })
            }
            kind::REP_SHARED_END => Reply::SharedEnd { count: r.u32()? },
            kind::REP_SHARE_FD => Reply::ShareFd {
                id: r.u64()?,
                addr: r.u64()?,
                size: r.u64()?,
                key: r.bytes16()?,
            },
            kind::REP_SHARE_FD_END => Reply::ShareFdEnd { count: r.u32()? },
            kind::REP_REIMPORTED => Reply::Reimported { addr: r.u64()? },
            kind::REP_SOURCE_NOTED => Reply::SourceNoted,
            kind::REP_RECLAIMED => Reply::Reclaimed {
                allocations: r.u32()?,
                bytes: r.u64()?,
                micros: r.u64()?,
            },
            kind::REP_ABORTED => Reply::Aborted,
            kind::REP_ERROR => Reply::Error {
                code: ErrorCode::from_u16(r.u16()?)?,
                message: r.str()?,
            },
            other => return Err(ProtoError::UnknownKind(other)),
        };
        r.finish()?;
        Ok(rep)
    }
}
