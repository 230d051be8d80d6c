//! [`CommonRequest`]: the requests both servers take (the job's agent and the keeper), and
//! [`Request`], what the two request types ([`super::AgentRequest`], [`super::KeeperRequest`])
//! have in common: their encoding, their decoding of untrusted bytes, and their shared part.
//!
//! The shared requests are encoded and decoded here only, for both types: each type's decoder
//! reads its own kinds and hands every other kind to [`CommonRequest::read`], which refuses
//! any kind it does not know ([`ProtoError::UnknownKind`]), the other server's included.

use std::fmt;

use super::{header, kind, opt_u64, read_opt_u64};
use crate::wire::{Reader, Writer};
use crate::{MAX_MESSAGE, ProtoError};

/// A request type: what one server takes, as a whole. Two implement it, sealed here:
/// [`super::AgentRequest`] (the job's agent) and [`super::KeeperRequest`] (the keeper). A
/// request of one is not a value of the other, so sending a keeper's request to a job's agent
/// does not compile.
pub trait Request:
    Sized + Clone + PartialEq + fmt::Debug + From<CommonRequest> + sealed::Sealed
{
    /// Writes the message into `buf`; returns its length.
    fn encode(&self, buf: &mut [u8; MAX_MESSAGE]) -> usize;
    /// Parses one received message. Never panics; trailing bytes are an error; a kind this
    /// server does not take (the other server's, or none) is [`ProtoError::UnknownKind`].
    fn decode(b: &[u8]) -> Result<Self, ProtoError>;
    /// The request both servers take, or this one given back (one of this server's own).
    fn into_common(self) -> Result<CommonRequest, Self>;
}

pub(super) mod sealed {
    /// Only this crate's request types are [`super::Request`]s: each is a decoder of untrusted
    /// bytes, and the protocol's decoders all live here.
    pub trait Sealed {}
}

/// Plugin → agent or keeper: the requests both take. Each server's type carries them as its
/// `Common` variant.
#[derive(Clone, Debug, PartialEq)]
pub enum CommonRequest {
    /// First message of a connection.
    Hello {
        /// The sender's [`crate::PROTOCOL_VERSION`].
        version: u16,
    },
    /// A staging memfd of `slot_size * slots` bytes is attached (SCM_RIGHTS).
    DumpBegin {
        /// Bytes per slot (a multiple of 4096).
        slot_size: u64,
        /// Number of slots in the staging ring.
        slots: u32,
        /// Number of copy streams to use.
        streams: u32,
    },
    /// The plugin has finished with a slot's data (dump) — the agent may reuse it.
    SlotFree {
        /// Slot index.
        slot: u32,
    },
    /// Unmap and release every converted allocation's physical memory (reservations kept).
    Release,
    /// Stop the current operation; memory stays mapped.
    Abort,
    /// A staging memfd is attached. The agent re-creates physical memory for every released allocation.
    RestoreBegin {
        /// Bytes per slot (a multiple of 4096).
        slot_size: u64,
        /// Number of slots in the staging ring.
        slots: u32,
        /// Number of copy streams to use.
        streams: u32,
    },
    /// Copy `len` bytes from staging slot `slot` to device address `addr`.
    ChunkLoad {
        /// Slot index.
        slot: u32,
        /// Destination device address.
        addr: u64,
        /// Bytes to copy (at most the slot size).
        len: u64,
        /// The chunk's recorded device hash (`crate::devhash`), checked on the device after
        /// the last chunk is loaded and before `Restored`.
        device_hash: Option<u64>,
    },
    /// Fill `len` bytes at device address `addr` with zeros (a chunk recorded as all zero;
    /// no slot is used and no reply is sent).
    ChunkZero {
        /// Destination device address.
        addr: u64,
        /// Bytes to fill.
        len: u64,
        /// As for `ChunkLoad`.
        device_hash: Option<u64>,
    },
    /// No more chunks: finish the copies and report.
    RestoreDataDone,
    /// Before a `DumpBegin` on this connection (no reply): the parent image holds the chunk at
    /// `addr` of `len` bytes with this device hash. The dump that follows announces such a chunk
    /// as [`crate::Reply::ChunkUnchanged`] instead of copying it if its device hash is still the
    /// same.
    KnownChunk {
        /// Device address of the chunk's first byte.
        addr: u64,
        /// Bytes.
        len: u64,
        /// Its device hash in the parent image.
        device_hash: u64,
    },
    /// Hand-over (the job's agent, its threads held): export every lendable allocation
    /// ([`crate::AllocKind::Converted`]) and send one [`crate::Reply::Lent`] per allocation
    /// with a copy of the exported descriptor attached, then [`crate::Reply::LentEnd`]. The
    /// agent keeps its own copies. `Release` (the memory then lives on in the kept descriptors
    /// and in whoever imported them) or `Abort` (the copies are closed, nothing changed)
    /// follows; or, where some moved allocations are not lendable, `KnownChunk`s and a
    /// `DumpBegin` on the same connection first, which copies out only those (not the lent
    /// ones), then `Release` of all. A keeper lends what it loaded at a restore the same way.
    LendBegin,
}

impl CommonRequest {
    /// Writes the message (header and fields) with `w`.
    pub(super) fn write(&self, w: &mut Writer<'_>) {
        match self {
            CommonRequest::Hello { version } => {
                header(w, kind::REQ_HELLO);
                w.u16(*version);
            }
            CommonRequest::DumpBegin {
                slot_size,
                slots,
                streams,
            } => {
                header(w, kind::REQ_DUMP_BEGIN);
                w.u64(*slot_size);
                w.u32(*slots);
                w.u32(*streams);
            }
            CommonRequest::SlotFree { slot } => {
                header(w, kind::REQ_SLOT_FREE);
                w.u32(*slot);
            }
            CommonRequest::Release => header(w, kind::REQ_RELEASE),
            CommonRequest::Abort => header(w, kind::REQ_ABORT),
            CommonRequest::RestoreBegin {
                slot_size,
                slots,
                streams,
            } => {
                header(w, kind::REQ_RESTORE_BEGIN);
                w.u64(*slot_size);
                w.u32(*slots);
                w.u32(*streams);
            }
            CommonRequest::ChunkLoad {
                slot,
                addr,
                len,
                device_hash,
            } => {
                header(w, kind::REQ_CHUNK_LOAD);
                w.u32(*slot);
                w.u64(*addr);
                w.u64(*len);
                opt_u64(w, *device_hash);
            }
            CommonRequest::ChunkZero {
                addr,
                len,
                device_hash,
            } => {
                header(w, kind::REQ_CHUNK_ZERO);
                w.u64(*addr);
                w.u64(*len);
                opt_u64(w, *device_hash);
            }
            CommonRequest::RestoreDataDone => header(w, kind::REQ_RESTORE_DONE),
            CommonRequest::KnownChunk {
                addr,
                len,
                device_hash,
            } => {
                header(w, kind::REQ_KNOWN_CHUNK);
                w.u64(*addr);
                w.u64(*len);
                w.u64(*device_hash);
            }
            CommonRequest::LendBegin => header(w, kind::REQ_LEND_BEGIN),
        }
    }

    /// The body of a request of kind `k` (its header already checked), read from `r`; any
    /// kind that is not one of these is [`ProtoError::UnknownKind`]. The caller checks that
    /// nothing follows ([`Reader::finish`]).
    pub(super) fn read(k: u16, r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(match k {
            kind::REQ_HELLO => CommonRequest::Hello { version: r.u16()? },
            kind::REQ_DUMP_BEGIN => CommonRequest::DumpBegin {
                slot_size: r.u64()?,
                slots: r.u32()?,
                streams: r.u32()?,
            },
            kind::REQ_SLOT_FREE => CommonRequest::SlotFree { slot: r.u32()? },
            kind::REQ_RELEASE => CommonRequest::Release,
            kind::REQ_ABORT => CommonRequest::Abort,
            kind::REQ_RESTORE_BEGIN => CommonRequest::RestoreBegin {
                slot_size: r.u64()?,
                slots: r.u32()?,
                streams: r.u32()?,
            },
            kind::REQ_CHUNK_LOAD => CommonRequest::ChunkLoad {
                slot: r.u32()?,
                addr: r.u64()?,
                len: r.u64()?,
                device_hash: read_opt_u64(r)?,
            },
            kind::REQ_CHUNK_ZERO => CommonRequest::ChunkZero {
                addr: r.u64()?,
                len: r.u64()?,
                device_hash: read_opt_u64(r)?,
            },
            kind::REQ_RESTORE_DONE => CommonRequest::RestoreDataDone,
            kind::REQ_KNOWN_CHUNK => CommonRequest::KnownChunk {
                addr: r.u64()?,
                len: r.u64()?,
                device_hash: r.u64()?,
            },
            kind::REQ_LEND_BEGIN => CommonRequest::LendBegin,
            other => return Err(ProtoError::UnknownKind(other)),
        })
    }
}
