//! gpusnap-proto: the control protocol between the CRIU plugin and its two servers, the
//! in-process agent and the keeper.
//!
//! Boundaries: this crate knows the messages, their byte layout, and the sockets they travel
//! on. It knows nothing of CUDA, CRIU or images; the agent (`gpusnap-agent`), the keeper
//! (`gpusnap-keeper`) and the plugin use it, and it is the only place that parses protocol
//! bytes.
//!
//! Modules:
//! - `message`: the requests, one type per server ([`AgentRequest`] for the job's agent,
//!   [`KeeperRequest`] for the keeper, both carrying the [`CommonRequest`]s they share, both a
//!   [`Request`]), and [`Reply`]; their encoding; decoding checks untrusted bytes exactly, and
//!   each server's decoder refuses the other's requests.
//! - `wire`: the bounds-checked little-endian reader and writer the messages are built from.
//! - `socket`: `SOCK_SEQPACKET` pairs, `SO_PEERCRED`.
//! - `door`: how a client reaches a process's agent (no socket name; `pidfd_getfd`).
//! - `channel`: [`Channel`], one connection; whole messages, at most one fd attached, timeouts.
//! - `error`: [`ProtoError`].
//! - `devhash`: the device hash's definition, which the agent's GPU kernel and the host agree on.
//! - `share`: [`Share`], one share of device memory as a job's agent lists it (its
//!   [`ShareKind`]: the agent's CUDA IPC, or a shareable handle with its descriptors).
//! - `fd`: [`ForeignFd`], another process's descriptor number (the job's), never one of ours.
//! - `pid`: [`pid::HostPid`] and [`pid::NsPid`], the two kinds of process id, and
//!   [`pid::HostTid`] and [`pid::NsTid`], the two of thread id, as types that do not mix (the
//!   host services re-export them as `gpusnap_host::pid`).
//! - `hostile` (cargo feature `hostile`, test builds only): the agent turned adversary, for CI.

mod channel;
pub mod devhash;
mod door;
mod error;
mod fd;
#[cfg(feature = "hostile")]
pub mod hostile;
mod message;
pub mod pid;
mod share;
mod socket;
mod wire;

#[cfg(test)]
mod tests;

pub use channel::Channel;
pub use door::{
    DOOR_LABEL_PREFIX, Door, DoorInside, KNOCK, Knock, connect_agent, door_sealed, install_door,
    parse_label, pidfd_getfd, pidfd_open, renew_door, seal_door, take_knock, take_knock_from,
};
pub use error::ProtoError;
pub use fd::ForeignFd;
pub use message::{
    AgentRequest, AllocKind, CommonRequest, ErrorCode, HEADER_LEN, KeeperRequest, MAGIC,
    MAX_ERROR_MESSAGE, MAX_SNAPSHOT_IDS, Reply, Request, hazard,
};
pub use share::{Share, ShareKind};
pub use socket::{peer_cred, seqpacket_pair};

/// Version carried in every message header and in `Hello`.
pub const PROTOCOL_VERSION: u16 = 9;
/// Largest message on the wire, header included.
pub const MAX_MESSAGE: usize = 512;
