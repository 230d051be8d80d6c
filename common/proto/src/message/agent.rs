//! [`AgentRequest`]: what the job's in-process agent serves (plugin → agent).

use std::fmt;

use super::common::sealed::Sealed;
use super::{CommonRequest, Request, header, kind, open};
use crate::pid::NsPid;
use crate::wire::Writer;
use crate::{MAX_MESSAGE, ProtoError};

/// Plugin → the job's agent: the requests both servers take, and the agent's own.
#[derive(Clone, PartialEq)]
pub enum AgentRequest {
    /// A request the keeper takes too.
    Common(CommonRequest),
    /// Answered by one [`crate::Reply::Allocation`] per entry, then
    /// [`crate::Reply::AllocationsEnd`].
    ListAllocations,
    /// A pre-copy round (the staging memfd attached, as for `DumpBegin`): copy every
    /// allocation out while the application runs on, then end with `DumpDataDone` (no
    /// `Release`). Chunks are announced as in a dump, but a copied chunk's `ChunkReady` carries
    /// no device hash: the bytes copied from memory the application may be writing are not the
    /// bytes the GPU hashed, so the plugin hashes what it received.
    PreCopyBegin {
        /// Bytes per slot (a multiple of 4096).
        slot_size: u64,
        /// Number of slots in the staging ring.
        slots: u32,
        /// Number of copy streams to use.
        streams: u32,
    },
    /// The job's agent (its threads held): map every released allocation again from the
    /// descriptors kept at `LendBegin`, at its old address; no data moves.
    Reclaim,
    /// To a restored job's agent (its threads held): map the attached exported memory, which
    /// the keeper loaded from the image and checked, at `addr` as allocation `id`.
    Take {
        /// The job's allocation id.
        id: u64,
        /// Device address.
        addr: u64,
        /// Bytes.
        size: u64,
        /// The keeper made the memory `gpuDirectRDMACapable` (its [`crate::Reply::Lent`]): the
        /// job's agent refuses memory other than its program asked for.
        rdma_capable: bool,
    },
    /// Every allocation was handed over with `Take`: the memory is whole if none is missing.
    TakeEnd,
    /// What this process shares through the agent's CUDA IPC: one [`crate::Reply::Shared`]
    /// per export (and importer) and per import, then [`crate::Reply::SharedEnd`].
    ListSharing,
    /// To an exporter: a descriptor of the current memory of every allocation it exported, one
    /// [`crate::Reply::ShareFd`] each (descriptor attached), then
    /// [`crate::Reply::ShareFdEnd`]. Read-only.
    ShareFds,
    /// To an importer (its threads held): map the attached memory at the address where the
    /// import of exporter `exporter_pid`'s allocation `id` was mapped before a release unmapped
    /// it.
    Reimport {
        /// The exporter's pid (as the importer's token names it).
        exporter_pid: NsPid,
        /// The exporter's allocation id.
        id: u64,
    },
    /// To an importer of memory another process exported with `cuMemExportToShareableHandle`
    /// (its threads held): the plugin found (with `kcmp`) that its import `import` is exporter
    /// `exporter_pid`'s allocation `id`. The agent records it (what a later
    /// [`AgentRequest::Reimport`] names) and closes the descriptor it kept to identify the
    /// import.
    ShareableSource {
        /// The importer's own import id ([`crate::Reply::Shared`] of an unresolved import).
        import: u64,
        /// The exporter's pid in the importer's pid namespace.
        exporter_pid: NsPid,
        /// The exporter's allocation id.
        id: u64,
        /// The exporter's key (its [`crate::Share::key`]), so that a later process
        /// with the same pid is never taken for it.
        key: [u8; 16],
    },
}

impl AgentRequest {
    /// Writes the message into `buf`; returns its length.
    pub fn encode(&self, buf: &mut [u8; MAX_MESSAGE]) -> usize {
        let mut w = Writer::new(buf);
        match self {
            AgentRequest::Common(c) => c.write(&mut w),
            AgentRequest::ListAllocations => header(&mut w, kind::REQ_LIST),
            AgentRequest::PreCopyBegin {
                slot_size,
                slots,
                streams,
            } => {
                header(&mut w, kind::REQ_PRECOPY_BEGIN);
                w.u64(*slot_size);
                w.u32(*slots);
                w.u32(*streams);
            }
            AgentRequest::Reclaim => header(&mut w, kind::REQ_RECLAIM),
            AgentRequest::Take {
                id,
                addr,
                size,
                rdma_capable,
            } => {
                header(&mut w, kind::REQ_TAKE);
                w.u64(*id);
                w.u64(*addr);
                w.u64(*size);
                w.bool(*rdma_capable);
            }
            AgentRequest::TakeEnd => header(&mut w, kind::REQ_TAKE_END),
            AgentRequest::ListSharing => header(&mut w, kind::REQ_LIST_SHARING),
            AgentRequest::ShareFds => header(&mut w, kind::REQ_SHARE_FDS),
            AgentRequest::Reimport { exporter_pid, id } => {
                header(&mut w, kind::REQ_REIMPORT);
                w.u32(exporter_pid.get());
                w.u64(*id);
            }
            AgentRequest::ShareableSource {
                import,
                exporter_pid,
                id,
                key,
            } => {
                header(&mut w, kind::REQ_SHAREABLE_SOURCE);
                w.u64(*import);
                w.u32(exporter_pid.get());
                w.u64(*id);
                w.bytes16(key);
            }
        }
        w.len()
    }

    /// Parses one received message. Never panics; trailing bytes are an error; a keeper's
    /// request (or any other kind the agent does not take) is [`ProtoError::UnknownKind`].
    pub fn decode(b: &[u8]) -> Result<Self, ProtoError> {
        let (k, mut r) = open(b)?;
        let req = match k {
            kind::REQ_LIST => AgentRequest::ListAllocations,
            kind::REQ_PRECOPY_BEGIN => AgentRequest::PreCopyBegin {
                slot_size: r.u64()?,
                slots: r.u32()?,
                streams: r.u32()?,
            },
            kind::REQ_RECLAIM => AgentRequest::Reclaim,
            kind::REQ_TAKE => AgentRequest::Take {
                id: r.u64()?,
                addr: r.u64()?,
                size: r.u64()?,
                rdma_capable: r.bool()?,
            },
            kind::REQ_TAKE_END => AgentRequest::TakeEnd,
            kind::REQ_LIST_SHARING => AgentRequest::ListSharing,
            kind::REQ_SHARE_FDS => AgentRequest::ShareFds,
            kind::REQ_REIMPORT => AgentRequest::Reimport {
                exporter_pid: NsPid(r.u32()?),
                id: r.u64()?,
            },
            kind::REQ_SHAREABLE_SOURCE => AgentRequest::ShareableSource {
                import: r.u64()?,
                exporter_pid: NsPid(r.u32()?),
                id: r.u64()?,
                key: r.bytes16()?,
            },
            other => AgentRequest::Common(CommonRequest::read(other, &mut r)?),
        };
        r.finish()?;
        Ok(req)
    }
}

impl From<CommonRequest> for AgentRequest {
    fn from(c: CommonRequest) -> Self {
        AgentRequest::Common(c)
    }
}

impl Sealed for AgentRequest {}

impl Request for AgentRequest {
    fn encode(&self, buf: &mut [u8; MAX_MESSAGE]) -> usize {
        AgentRequest::encode(self, buf)
    }
    fn decode(b: &[u8]) -> Result<Self, ProtoError> {
        AgentRequest::decode(b)
    }
    fn into_common(self) -> Result<CommonRequest, Self> {
        match self {
            AgentRequest::Common(c) => Ok(c),
            own => Err(own),
        }
    }
}

/// As derived, except that a request both servers take prints as itself (`Release`, not
/// `Common(Release)`): the agent's refusals name requests by this text.
impl fmt::Debug for AgentRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AgentRequest::Common(c) => fmt::Debug::fmt(c, f),
            AgentRequest::ListAllocations => f.write_str("ListAllocations"),
            AgentRequest::PreCopyBegin {
                slot_size,
                slots,
                streams,
            } => f
                .debug_struct("PreCopyBegin")
                .field("slot_size", slot_size)
                .field("slots", slots)
                .field("streams", streams)
                .finish(),
            AgentRequest::Reclaim => f.write_str("Reclaim"),
            AgentRequest::Take {
                id,
                addr,
                size,
                rdma_capable,
            } => f
                .debug_struct("Take")
                .field("id", id)
                .field("addr", addr)
                .field("size", size)
                .field("rdma_capable", rdma_capable)
                .finish(),
            AgentRequest::TakeEnd => f.write_str("TakeEnd"),
            AgentRequest::ListSharing => f.write_str("ListSharing"),
            AgentRequest::ShareFds => f.write_str("ShareFds"),
            AgentRequest::Reimport { exporter_pid, id } => f
                .debug_struct("Reimport")
                .field("exporter_pid", exporter_pid)
                .field("id", id)
                .finish(),
            AgentRequest::ShareableSource {
                import,
                exporter_pid,
                id,
                key,
            } => f
                .debug_struct("ShareableSource")
                .field("import", import)
                .field("exporter_pid", exporter_pid)
                .field("id", id)
                .field("key", key)
                .finish(),
        }
    }
}
