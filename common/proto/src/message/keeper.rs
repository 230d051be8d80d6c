//! [`KeeperRequest`]: what the keeper serves (plugin → keeper).

use std::fmt;

use super::common::sealed::Sealed;
use super::{CommonRequest, Request, header, kind, open};
use crate::wire::Writer;
use crate::{MAX_MESSAGE, ProtoError};

/// Most allocation ids one `SnapshotIds` carries: what fits in one message after the header
/// and the count.
pub const MAX_SNAPSHOT_IDS: usize = 60;

/// Plugin → the keeper: the requests both servers take, and the keeper's own.
#[derive(Clone, PartialEq)]
pub enum KeeperRequest {
    /// A request the job's agent takes too.
    Common(CommonRequest),
    /// Import the attached exported descriptor and map it at `addr`, the address the job uses,
    /// so the data can be copied out while the job is checkpointed.
    Adopt {
        /// The job's allocation id.
        id: u64,
        /// Device ordinal.
        device: u32,
        /// Device address in the job (the keeper maps at the same one).
        addr: u64,
        /// Bytes.
        size: u64,
    },
    /// Before an asynchronous `criu dump -R` chooses what its snapshot takes: how much of the
    /// free memory of GPU `device` (the keeper's ordinal, the job's) a snapshot may take.
    /// Answered with [`Reply::SnapshotRoom`](crate::Reply::SnapshotRoom).
    SnapshotRoom {
        /// The GPU.
        device: u32,
        /// The most of its free memory the snapshot may take, percent (1..=90).
        share_percent: u32,
    },
    /// Part of the list of allocations the next `Snapshot` takes: up to [`MAX_SNAPSHOT_IDS`]
    /// of the job's allocation ids, at least one. No reply; the keeper takes at most as many
    /// as it adopted, each once.
    SnapshotIds {
        /// Allocation ids.
        ids: Vec<u64>,
    },
    /// After every `Adopt` of an asynchronous `criu dump -R`: copy each allocation the
    /// `SnapshotIds` since the last `Snapshot` listed (`count` of them) device to device into
    /// fresh memory of the keeper's own and let go of its import, so that the job may run on
    /// its own memory while the snapshot is drained. All or nothing for the listed ones:
    /// refused (nothing changed) when they would take more than `share_percent` of any GPU's
    /// free memory. Where some adopted allocations are not listed, the snapshot is set aside:
    /// the keeper's next dump (`DumpBegin` .. `Release`) drains the imports it still holds,
    /// and the dump after it drains the snapshot.
    Snapshot {
        /// The most of a GPU's free memory the snapshot may take, percent (1..=90).
        share_percent: u32,
        /// How many ids the `SnapshotIds` listed.
        count: u32,
    },
    /// At a restore: the job's allocation `id` is to be re-created at `addr` (exportable) on
    /// the GPU with UUID `gpu`; the `RestoreBegin` that follows loads it.
    Expect {
        /// The job's allocation id.
        id: u64,
        /// The UUID of the GPU it goes on (after the restore's GPU plan).
        gpu: [u8; 16],
        /// Device address in the job.
        addr: u64,
        /// Bytes.
        size: u64,
        /// Created `gpuDirectRDMACapable`, as the job's memory was (the image's record).
        rdma_capable: bool,
    },
}

impl KeeperRequest {
    /// Writes the message into `buf`; returns its length.
    pub fn encode(&self, buf: &mut [u8; MAX_MESSAGE]) -> usize {
        let mut w = Writer::new(buf);
        match self {
            KeeperRequest::Common(c) => c.write(&mut w),
            KeeperRequest::Adopt {
                id,
                device,
                addr,
                size,
            } => {
                header(&mut w, kind::REQ_ADOPT);
                w.u64(*id);
                w.u32(*device);
                w.u64(*addr);
                w.u64(*size);
            }
            KeeperRequest::SnapshotRoom {
                device,
                share_percent,
            } => {
                header(&mut w, kind::REQ_SNAPSHOT_ROOM);
                w.u32(*device);
                w.u32(*share_percent);
            }
            KeeperRequest::SnapshotIds { ids } => {
                header(&mut w, kind::REQ_SNAPSHOT_IDS);
                // A longer list is the caller's error: only what one message holds is sent,
                // and the count below says so (the keeper then finds the ids short).
                let ids = &ids[..ids.len().min(MAX_SNAPSHOT_IDS)];
                w.u16(ids.len() as u16);
                for id in ids {
                    w.u64(*id);
                }
            }
            KeeperRequest::Snapshot {
                share_percent,
                count,
            } => {
                header(&mut w, kind::REQ_SNAPSHOT);
                w.u32(*share_percent);
                w.u32(*count);
            }
            KeeperRequest::Expect {
                id,
                gpu,
                addr,
                size,
                rdma_capable,
            } => {
                header(&mut w, kind::REQ_EXPECT);
                w.u64(*id);
                w.bytes16(gpu);
                w.u64(*addr);
                w.u64(*size);
                w.bool(*rdma_capable);
            }
        }
        w.len()
    }

    /// Parses one received message. Never panics; trailing bytes are an error; a job's
    /// agent's own request (or any other kind the keeper does not take) is
    /// [`ProtoError::UnknownKind`].
    pub fn decode(b: &[u8]) -> Result<Self, ProtoError> {
        let (k, mut r) = open(b)?;
        let req = match k {
            kind::REQ_ADOPT => KeeperRequest::Adopt {
                id: r.u64()?,
                device: r.u32()?,
                addr: r.u64()?,
                size: r.u64()?,
            },
            kind::REQ_SNAPSHOT_ROOM => KeeperRequest::SnapshotRoom {
                device: r.u32()?,
                share_percent: r.u32()?,
            },
            kind::REQ_SNAPSHOT_IDS => {
                let n = usize::from(r.u16()?);
                if n == 0 || n > MAX_SNAPSHOT_IDS {
                    return Err(ProtoError::Malformed(
                        "a SnapshotIds holds 1 to MAX_SNAPSHOT_IDS ids",
                    ));
                }
                let ids = (0..n).map(|_| r.u64()).collect::<Result<Vec<u64>, _>>()?;
                KeeperRequest::SnapshotIds { ids }
            }
            kind::REQ_SNAPSHOT => KeeperRequest::Snapshot {
                share_percent: r.u32()?,
                count: r.u32()?,
            },
            kind::REQ_EXPECT => KeeperRequest::Expect {
                id: r.u64()?,
                gpu: r.bytes16()?,
                addr: r.u64()?,
                size: r.u64()?,
                rdma_capable: r.bool()?,
            },
            other => KeeperRequest::Common(CommonRequest::read(other, &mut r)?),
        };
        r.finish()?;
        Ok(req)
    }
}

impl From<CommonRequest> for KeeperRequest {
    fn from(c: CommonRequest) -> Self {
        KeeperRequest::Common(c)
    }
}

impl Sealed for KeeperRequest {}

impl Request for KeeperRequest {
    fn encode(&self, buf: &mut [u8; MAX_MESSAGE]) -> usize {
        KeeperRequest::encode(self, buf)
    }
    fn decode(b: &[u8]) -> Result<Self, ProtoError> {
        KeeperRequest::decode(b)
    }
    fn into_common(self) -> Result<CommonRequest, Self> {
        match self {
            KeeperRequest::Common(c) => Ok(c),
            own => Err(own),
        }
    }
}

/// As derived, except that a request both servers take prints as itself (`Release`, not
/// `Common(Release)`): the keeper's refusals name requests by this text.
impl fmt::Debug for KeeperRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeeperRequest::Common(c) => fmt::Debug::fmt(c, f),
            KeeperRequest::Adopt {
                id,
                device,
                addr,
                size,
            } => f
                .debug_struct("Adopt")
                .field("id", id)
                .field("device", device)
                .field("addr", addr)
                .field("size", size)
                .finish(),
            KeeperRequest::SnapshotRoom {
                device,
                share_percent,
            } => f
                .debug_struct("SnapshotRoom")
                .field("device", device)
                .field("share_percent", share_percent)
                .finish(),
            KeeperRequest::SnapshotIds { ids } => {
                f.debug_struct("SnapshotIds").field("ids", ids).finish()
            }
            KeeperRequest::Snapshot {
                share_percent,
                count,
            } => f
                .debug_struct("Snapshot")
                .field("share_percent", share_percent)
                .field("count", count)
                .finish(),
            KeeperRequest::Expect {
                id,
                gpu,
                addr,
                size,
                rdma_capable,
            } => f
                .debug_struct("Expect")
                .field("id", id)
                .field("gpu", gpu)
                .field("addr", addr)
                .field("size", size)
                .field("rdma_capable", rdma_capable)
                .finish(),
        }
    }
}
