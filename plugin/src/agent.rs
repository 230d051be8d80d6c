//! The plugin's side of the conversation with the in-process agent: one [`AgentSession`] per
//! connection, with one method per step of the protocol (`docs/design-notes.md`). The data
//! pumps of [`crate::datapath`] use its channel for the per-chunk messages.
//!
//! The agent has no socket name: the session copies the client end of the agent's door out of
//! the target with `pidfd_getfd` and knocks (`gpusnap_proto`'s `door`), which works across pid
//! and network namespaces alike and needs the ptrace rights CRIU has anyway. The agent's
//! `Hello` must name the target's namespace pid. A knock the agent never answered is withdrawn
//! when the session ends, so CRIU never finds it queued in the process.

use crate::pid::{HostPid, NsPid};
use crate::procfs;
use gpusnap_image::AllocationRecord;
use gpusnap_proto::{AllocKind, Channel, PROTOCOL_VERSION, ProtoError, Reply, Request};
use std::io;
use std::os::fd::BorrowedFd;
use std::time::Duration;

/// The agent's thread names itself so (a restored process's agent thread can be found without
/// asking the agent, whose thread is stopped then).
pub const AGENT_THREAD_COMM: &str = "gpusnap-agent";

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("pid {pid}: {err}")]
    Proc { pid: i32, err: io::Error },
    #[error("connecting to the agent of pid {pid}: {err}")]
    Connect { pid: i32, err: io::Error },
    #[error(
        "the agent behind the door of pid {pid} says it is namespace pid {claimed} (the target is {expected}), or its thread is not the target's gpusnap-agent thread: refusing to talk to it"
    )]
    Impostor {
        pid: i32,
        claimed: i32,
        expected: NsPid,
    },
    #[error("agent of pid {pid}: {err}")]
    Proto { pid: i32, err: ProtoError },
    #[error("agent of pid {pid} answered {got} where {expected} was expected")]
    Unexpected {
        pid: i32,
        expected: &'static str,
        got: String,
    },
    /// `message` is the job's text: shown quoted and escaped.
    #[error("agent of pid {pid} reports: {message:?}")]
    Refused { pid: i32, message: String },
    #[error("agent thread (namespace tid {ns_tid}) of pid {pid} not found in /proc/{pid}/task")]
    NoThread { pid: i32, ns_tid: i32 },
    #[error(
        "the agent of pid {pid} reports its memory as released (an earlier dump did not finish?)"
    )]
    AlreadyReleased { pid: i32 },
    #[error("the agent of pid {pid} made no progress for {stall:?} (hung?)")]
    Stalled { pid: i32, stall: Duration },
}

/// What the agent said about itself.
#[derive(Clone, Debug)]
pub struct AgentHello {
    pub ns_pid: i32,
    pub ns_tid: i32,
    pub allocations: u32,
    pub converted_bytes: u64,
    pub devices: u32,
    pub released: bool,
    /// `gpusnap_proto::hazard` bits: state the driver checkpoint cannot take.
    pub hazards: u32,
    /// Released allocations whose memory the agent holds through descriptors it kept at a
    /// hand-over (`reclaim` maps them back without any file).
    pub kept: u32,
}

/// One allocation lent at a hand-over: where it lives in the job, and a copy of its exported
/// descriptor (the job keeps its own).
#[derive(Debug)]
pub struct LentAllocation {
    pub id: u64,
    pub device: u32,
    pub addr: u64,
    pub size: u64,
    /// The lender made it `gpuDirectRDMACapable`.
    pub rdma_capable: bool,
    pub fd: std::os::fd::OwnedFd,
}

/// One CUDA IPC share of a process, as its agent lists it (`ListSharing`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Share {
    /// Another process's allocation mapped here (else one of this process's, exported).
    pub import: bool,
    /// Import: the exporter's pid. Export: a process that fetched it (0: none yet). Pids as the
    /// processes' own namespace numbers them.
    pub pid: u32,
    /// The exporter's allocation id.
    pub id: u64,
    pub addr: u64,
    pub size: u64,
    /// Import: mapped now (a release unmaps it until a reimport). Shareable export: memory the
    /// agent moves (else not carried).
    pub mapped: bool,
    /// Made by the program itself with `cuMemExportToShareableHandle` /
    /// `cuMemImportFromShareableHandle` (see `Reply::Shared`).
    pub shareable: bool,
    /// Shareable: the agent's own descriptor of the export (exporter: its duplicate; importer:
    /// its duplicate of the fd imported, until resolved), -1 if none.
    pub agent_fd: i32,
    /// Shareable export: the program's descriptor of it, while it is still that file (-1).
    pub app_fd: i32,
    /// Export: the agent's own descriptor of the allocation a hand-over left (-1).
    pub own_fd: i32,
    /// The exporter's key: its own for an export, the source's for an import (zeros: an
    /// unresolved shareable import). An import is carried only with an export of the same pid,
    /// allocation *and* key.
    pub key: [u8; 16],
}

impl Share {
    /// A shareable import the plugin has not resolved to its exporter yet.
    pub fn unresolved(&self) -> bool {
        self.shareable && self.import && self.pid == 0
    }
}

/// The current memory of one exported allocation (`ShareFds`), to map in its importers.
#[derive(Debug)]
pub struct SharedMemory {
    pub id: u64,
    pub addr: u64,
    pub size: u64,
    /// The exporter's key (what its importers recorded).
    pub key: [u8; 16],
    pub fd: std::os::fd::OwnedFd,
}

/// Most shares one agent may list (and descriptors it may send): a bound on untrusted input.
const MAX_SHARES: usize = 1 << 16;

/// Which way a data transfer goes, as the agent is asked to begin it.
#[derive(Clone, Copy, Debug)]
pub enum Transfer {
    /// Device to ring (`DumpBegin`).
    Out,
    /// Ring to device (`RestoreBegin`: the agent re-creates its memory first).
    In,
    /// Device to ring while the application runs (`PreCopyBegin`, a pre-copy round).
    OutLive,
}

/// The staging ring as the agent is told about it.
#[derive(Clone, Copy, Debug)]
pub struct RingShape {
    pub slot_size: u64,
    pub slots: u32,
    pub streams: u32,
}

/// One connection to the agent of one process.
pub struct AgentSession {
    pid: i32,
    chan: Channel,
    timeout: Duration,
    /// The door knocked at; `None` in unit tests that play the agent over a plain pair.
    door: Option<gpusnap_proto::Door>,
    /// Whether the agent has answered anything (else the knock may still be queued).
    answered: std::sync::atomic::AtomicBool,
}

impl Drop for AgentSession {
    fn drop(&mut self) {
        if self.answered.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        if let Some(door) = &self.door {
            match door.withdraw() {
                Ok(0) => {}
                Ok(n) => log::warn!(
                    "pid {}: the agent took no knock; withdrew {n} from its door",
                    self.pid
                ),
                Err(e) => log::warn!(
                    "pid {}: cannot withdraw an unanswered knock from the agent's door: {e}",
                    self.pid
                ),
            }
        }
    }
}

impl AgentSession {
    /// Connects to the agent of host pid `pid`. `Ok(None)`: no agent listens there (the process
    /// goes the driver path). `timeout` bounds every wait for an answer.
    pub fn connect(pid: i32, timeout: Duration) -> Result<Option<Self>, AgentError> {
        let connect_err = |err| AgentError::Connect { pid, err };
        let Some(door) = gpusnap_proto::Door::open(pid).map_err(connect_err)? else {
            return Ok(None);
        };
        let fd = door.knock().map_err(connect_err)?;
        Ok(Some(Self {
            pid,
            chan: Channel::new(fd),
            timeout,
            door: Some(door),
            answered: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// Like [`Self::connect`], for a process known to run the agent.
    pub fn connect_expected(pid: i32, timeout: Duration) -> Result<Self, AgentError> {
        Self::connect(pid, timeout)?.ok_or(AgentError::Connect {
            pid,
            err: io::Error::new(io::ErrorKind::NotFound, "the agent's socket is gone"),
        })
    }

    /// A session over a connection of our own making (the keeper's socket pair); `pid` names
    /// the peer in messages. No door, so no identity check: the plugin made both ends.
    pub fn over(pid: i32, chan: Channel, timeout: Duration) -> Self {
        Self {
            pid,
            chan,
            timeout,
            door: None,
            answered: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The connection, for the per-chunk messages of a transfer.
    pub fn channel(&self) -> &Channel {
        &self.chan
    }

    fn proto(&self) -> impl Fn(ProtoError) -> AgentError + '_ {
        |err| AgentError::Proto { pid: self.pid, err }
    }

    fn send(&self, r: &Request, fd: Option<BorrowedFd<'_>>) -> Result<(), AgentError> {
        self.chan.send_request(r, fd).map_err(self.proto())
    }

    /// The next reply; an agent's `Error` becomes [`AgentError::Refused`].
    pub fn recv(&self, timeout: Duration) -> Result<Reply, AgentError> {
        let reply = self.chan.recv_reply(Some(timeout)).map_err(self.proto())?;
        self.answered
            .store(true, std::sync::atomic::Ordering::Relaxed);
        match reply {
            Reply::Error { message, .. } => Err(AgentError::Refused {
                pid: self.pid,
                message,
            }),
            r => Ok(r),
        }
    }

    /// The next reply and the descriptor it may carry; an agent's `Error` (without one) becomes
    /// [`AgentError::Refused`].
    fn recv_with_fd(&self) -> Result<(Reply, Option<std::os::fd::OwnedFd>), AgentError> {
        let (reply, fd) = self
            .chan
            .recv_reply_with_fd(Some(self.timeout))
            .map_err(self.proto())?;
        self.answered
            .store(true, std::sync::atomic::Ordering::Relaxed);
        match (reply, fd) {
            (Reply::Error { message, .. }, None) => Err(AgentError::Refused {
                pid: self.pid,
                message,
            }),
            other => Ok(other),
        }
    }

    fn unexpected(&self, expected: &'static str, got: Reply) -> AgentError {
        AgentError::Unexpected {
            pid: self.pid,
            expected,
            got: format!("{got:?}"),
        }
    }

    /// `Hello`: who the agent is and what it holds.
    pub fn hello(&self) -> Result<AgentHello, AgentError> {
        self.send(
            &Request::Hello {
                version: PROTOCOL_VERSION,
            },
            None,
        )?;
        match self.recv(self.timeout)? {
            Reply::Hello {
                version: _,
                pid: ns_pid,
                tid,
                allocations,
                converted_bytes,
                devices,
                released,
                hazards,
                kept,
            } => {
                if self.door.is_some() {
                    let expected = procfs::ns_pid(HostPid(self.pid))
                        .map_err(|err| AgentError::Proc { pid: self.pid, err })?;
                    // And the thread that answers is the target's agent thread (a child that
                    // inherited the door without fork's handlers could share the pid number in
                    // a pid namespace of its own).
                    let answering = procfs::host_tid(self.pid, tid).ok().flatten();
                    // The agent's claim is its getpid(), an i32 on the wire.
                    if u32::try_from(ns_pid).map(NsPid) != Ok(expected)
                        || answering.is_none()
                        || answering != agent_thread(self.pid)
                    {
                        return Err(AgentError::Impostor {
                            pid: self.pid,
                            claimed: ns_pid,
                            expected,
                        });
                    }
                }
                Ok(AgentHello {
                    ns_pid,
                    ns_tid: tid,
                    hazards,
                    allocations,
                    converted_bytes,
                    devices,
                    released,
                    kept,
                })
            }
            got => Err(self.unexpected("Hello", got)),
        }
    }

    /// `Hello`, refusing an agent whose memory is released already.
    pub fn hello_intact(&self) -> Result<AgentHello, AgentError> {
        let h = self.hello()?;
        if h.released {
            return Err(AgentError::AlreadyReleased { pid: self.pid });
        }
        Ok(h)
    }

    /// `ListAllocations`: every allocation the agent tracks.
    pub fn list(&self) -> Result<Vec<AllocationRecord>, AgentError> {
        Ok(self.list_kinds()?.into_iter().map(|(a, _)| a).collect())
    }

    /// `ListAllocations`, with how the agent holds each (what its route depends on).
    pub fn list_kinds(&self) -> Result<Vec<(AllocationRecord, AllocKind)>, AgentError> {
        self.send(&Request::ListAllocations, None)?;
        let mut out = Vec::new();
        loop {
            match self.recv(self.timeout)? {
                Reply::Allocation {
                    id,
                    device,
                    addr,
                    size,
                    kind,
                    rdma_capable,
                } => out.push((
                    AllocationRecord {
                        id,
                        device,
                        addr,
                        size,
                        moved: kind.moved(),
                        lent: false,
                        rdma_capable,
                    },
                    kind,
                )),
                Reply::AllocationsEnd { .. } => return Ok(out),
                got => return Err(self.unexpected("Allocation", got)),
            }
        }
    }

    /// `DumpBegin` / `RestoreBegin` with the ring's memfd attached; returns once the agent has
    /// mapped and pinned it (and, for a restore, re-created its memory).
    pub fn begin(
        &self,
        way: Transfer,
        ring: BorrowedFd<'_>,
        shape: RingShape,
    ) -> Result<(), AgentError> {
        let RingShape {
            slot_size,
            slots,
            streams,
        } = shape;
        let req = match way {
            Transfer::Out => Request::DumpBegin {
                slot_size,
                slots,
                streams,
            },
            Transfer::In => Request::RestoreBegin {
                slot_size,
                slots,
                streams,
            },
            Transfer::OutLive => Request::PreCopyBegin {
                slot_size,
                slots,
                streams,
            },
        };
        self.send(&req, Some(ring))?;
        match self.recv(self.timeout)? {
            Reply::Ready => Ok(()),
            got => Err(self.unexpected("Ready", got)),
        }
    }

    /// `LendBegin`: the job's agent exports every converted allocation; returns them with a
    /// copy of each descriptor. `release` (or `abort`) must follow.
    pub fn lend(&self) -> Result<Vec<LentAllocation>, AgentError> {
        self.send(&Request::LendBegin, None)?;
        let mut out = Vec::new();
        loop {
            match self.recv_with_fd()? {
                (
                    Reply::Lent {
                        id,
                        device,
                        addr,
                        size,
                        rdma_capable,
                    },
                    Some(fd),
                ) => out.push(LentAllocation {
                    id,
                    device,
                    addr,
                    size,
                    rdma_capable,
                    fd,
                }),
                (Reply::LentEnd { count, .. }, None) if count as usize == out.len() => {
                    return Ok(out);
                }
                (got, fd) => {
                    return Err(self.unexpected(
                        if fd.is_some() {
                            "Lent (a descriptor came with another reply)"
                        } else {
                            "Lent with its descriptor, or LentEnd with the count of them"
                        },
                        got,
                    ));
                }
            }
        }
    }

    /// `Adopt` (to a keeper): import `lent`'s descriptor and map it at the job's address.
    pub fn adopt(&self, lent: &LentAllocation) -> Result<(), AgentError> {
        use std::os::fd::AsFd;
        let req = Request::Adopt {
            id: lent.id,
            device: lent.device,
            addr: lent.addr,
            size: lent.size,
        };
        self.send(&req, Some(lent.fd.as_fd()))?;
        match self.recv(self.timeout)? {
            Reply::Adopted { id } if id == lent.id => Ok(()),
            got => Err(self.unexpected("Adopted", got)),
        }
    }

    /// `Reclaim`: the job's agent maps its released memory again from the descriptors it kept
    /// at the hand-over, and closes the connection. Returns (allocations, bytes).
    pub fn reclaim(self) -> Result<(u32, u64), AgentError> {
        self.send(&Request::Reclaim, None)?;
        let r = match self.recv(self.timeout)? {
            Reply::Reclaimed {
                allocations, bytes, ..
            } => (allocations, bytes),
            got => return Err(self.unexpected("Reclaimed", got)),
        };
        self.wait_closed()?;
        Ok(r)
    }

    /// `ListSharing`: the process's CUDA IPC shares through its agent.
    pub fn list_sharing(&self) -> Result<Vec<Share>, AgentError> {
        self.send(&Request::ListSharing, None)?;
        let mut out = Vec::new();
        loop {
            match self.recv(self.timeout)? {
                Reply::Shared {
                    import,
                    pid,
                    id,
                    addr,
                    size,
                    mapped,
                    shareable,
                    agent_fd,
                    app_fd,
                    own_fd,
                    key,
                } if out.len() < MAX_SHARES => out.push(Share {
                    import,
                    pid,
                    id,
                    addr,
                    size,
                    mapped,
                    shareable,
                    agent_fd,
                    app_fd,
                    own_fd,
                    key,
                }),
                Reply::SharedEnd { count } if count as usize == out.len() => return Ok(out),
                got => return Err(self.unexpected("Shared, or SharedEnd with their count", got)),
            }
        }
    }

    /// `ShareFds`: a descriptor of the current memory of each allocation the process exported.
    pub fn share_fds(&self) -> Result<Vec<SharedMemory>, AgentError> {
        self.send(&Request::ShareFds, None)?;
        let mut out = Vec::new();
        loop {
            match self.recv_with_fd()? {
                (
                    Reply::ShareFd {
                        id,
                        addr,
                        size,
                        key,
                    },
                    Some(fd),
                ) if out.len() < MAX_SHARES => {
                    out.push(SharedMemory {
                        id,
                        addr,
                        size,
                        key,
                        fd,
                    });
                }
                (Reply::ShareFdEnd { count }, None) if count as usize == out.len() => {
                    return Ok(out);
                }
                (got, _) => {
                    return Err(self.unexpected(
                        "ShareFd with its descriptor, or ShareFdEnd with their count",
                        got,
                    ));
                }
            }
        }
    }

    /// `Reimport`: map `mem` (exporter `exporter_pid`'s) again where the process imported it.
    pub fn reimport(&self, exporter_pid: u32, mem: &SharedMemory) -> Result<u64, AgentError> {
        use std::os::fd::AsFd;
        let req = Request::Reimport {
            exporter_pid,
            id: mem.id,
        };
        self.send(&req, Some(mem.fd.as_fd()))?;
        match self.recv(self.timeout)? {
            Reply::Reimported { addr } => Ok(addr),
            got => Err(self.unexpected("Reimported", got)),
        }
    }

    /// `ShareableSource`: the process's shareable import `import` is exporter `exporter_pid`'s
    /// allocation `id`.
    pub fn shareable_source(
        &self,
        import: u64,
        exporter_pid: u32,
        id: u64,
        key: [u8; 16],
    ) -> Result<(), AgentError> {
        let req = Request::ShareableSource {
            import,
            exporter_pid,
            id,
            key,
        };
        self.send(&req, None)?;
        match self.recv(self.timeout)? {
            Reply::SourceNoted => Ok(()),
            got => Err(self.unexpected("SourceNoted", got)),
        }
    }

    /// `SlotFree`: a dump's slot was written and may be filled again.
    pub fn slot_free(&self, slot: u32) -> Result<(), AgentError> {
        self.send(&Request::SlotFree { slot }, None)
    }

    /// `ChunkLoad`: a restore's slot holds `len` bytes for device address `addr`, whose device
    /// hash the agent checks after the load if the image recorded one.
    pub fn chunk_load(
        &self,
        slot: u32,
        addr: u64,
        len: u64,
        device_hash: Option<u64>,
    ) -> Result<(), AgentError> {
        let req = Request::ChunkLoad {
            slot,
            addr,
            len,
            device_hash,
        };
        self.send(&req, None)
    }

    /// `KnownChunk` (before `begin(Transfer::Out)`): the parent image holds this chunk with this
    /// device hash; the dump announces it `ChunkUnchanged` instead of copying it if it is.
    pub fn known_chunk(&self, addr: u64, len: u64, device_hash: u64) -> Result<(), AgentError> {
        let req = Request::KnownChunk {
            addr,
            len,
            device_hash,
        };
        self.send(&req, None)
    }

    /// `ChunkZero`: a restore's chunk recorded as all zeros; the agent fills it on the device.
    pub fn chunk_zero(
        &self,
        addr: u64,
        len: u64,
        device_hash: Option<u64>,
    ) -> Result<(), AgentError> {
        let req = Request::ChunkZero {
            addr,
            len,
            device_hash,
        };
        self.send(&req, None)
    }

    /// `Abort`: the agent stops and keeps its memory. Best effort, bounded; true when the agent
    /// confirmed (it has unmapped the ring then).
    pub fn abort(&self) -> bool {
        if self.send(&Request::Abort, None).is_err() {
            return false;
        }
        let deadline = std::time::Instant::now() + self.timeout.min(Duration::from_secs(10));
        while std::time::Instant::now() < deadline {
            match self.chan.recv_reply(Some(Duration::from_millis(200))) {
                Ok(Reply::Aborted) | Ok(Reply::Error { .. }) | Err(ProtoError::Closed) => {
                    return true;
                }
                Ok(_) | Err(ProtoError::Timeout) | Err(ProtoError::Interrupted) => continue,
                Err(_) => return false,
            }
        }
        false
    }

    /// `Release`: the agent releases its physical memory (address reservations kept), replies
    /// and closes the connection; this waits for the close, so that the process holds no
    /// socket to CRIU when its files are dumped. Returns (allocations, bytes) released.
    pub fn release(self) -> Result<(u32, u64), AgentError> {
        self.send(&Request::Release, None)?;
        let r = match self.recv(self.timeout)? {
            Reply::Released {
                allocations, bytes, ..
            } => (allocations, bytes),
            got => return Err(self.unexpected("Released", got)),
        };
        self.wait_closed()?;
        Ok(r)
    }

    /// `Release` to a keeper: it drops its imports and answers, and stays until the session is
    /// dropped (its exit while CRIU works on the tasks would fail the dump).
    pub fn release_keeper(&self) -> Result<(u32, u64), AgentError> {
        self.send(&Request::Release, None)?;
        match self.recv(self.timeout)? {
            Reply::Released {
                allocations, bytes, ..
            } => Ok((allocations, bytes)),
            got => Err(self.unexpected("Released", got)),
        }
    }

    /// `RestoreDataDone` after the last `ChunkLoad`: the agent synchronises, checks the device
    /// hashes it was given on the GPU, and answers with the bytes it loaded and the chunks it
    /// checked (a job's agent then closes the connection: [`Self::closed`]; a keeper stays).
    pub fn finish_restore(&self) -> Result<(u64, u64), AgentError> {
        self.send(&Request::RestoreDataDone, None)?;
        match self.recv(self.timeout)? {
            Reply::Restored {
                bytes, verified, ..
            } => Ok((bytes, verified)),
            got => Err(self.unexpected("Restored", got)),
        }
    }

    /// `Expect` (to a keeper at a restore): allocation `a` of the job goes at its address on
    /// the GPU `gpu`, made RDMA-capable where the image says it was. Returns the keeper's
    /// ordinal of that GPU.
    pub fn expect(&self, a: &AllocationRecord, gpu: [u8; 16]) -> Result<u32, AgentError> {
        let id = a.id;
        self.send(
            &Request::Expect {
                id,
                gpu,
                addr: a.addr,
                size: a.size,
                rdma_capable: a.rdma_capable,
            },
            None,
        )?;
        match self.recv(self.timeout)? {
            Reply::Expected { id: got, device } if got == id => Ok(device),
            got => Err(self.unexpected("Expected", got)),
        }
    }

    /// `Take` (to a restored job's agent): map `lent`'s memory at its address.
    pub fn take(&self, lent: &LentAllocation) -> Result<(), AgentError> {
        use std::os::fd::AsFd;
        let req = Request::Take {
            id: lent.id,
            addr: lent.addr,
            size: lent.size,
            rdma_capable: lent.rdma_capable,
        };
        self.send(&req, Some(lent.fd.as_fd()))?;
        match self.recv(self.timeout)? {
            Reply::Taken { id } if id == lent.id => Ok(()),
            got => Err(self.unexpected("Taken", got)),
        }
    }

    /// `TakeEnd`: every allocation was handed over; the agent checks that none is missing,
    /// answers and closes the connection. Returns (allocations, bytes, microseconds).
    pub fn take_end(self) -> Result<(u32, u64, u64), AgentError> {
        self.send(&Request::TakeEnd, None)?;
        let r = match self.recv(self.timeout)? {
            Reply::TakenAll {
                allocations,
                bytes,
                micros,
            } => (allocations, bytes, micros),
            got => return Err(self.unexpected("TakenAll", got)),
        };
        self.wait_closed()?;
        Ok(r)
    }

    /// Waits for the agent to close the connection (after an operation that ends it).
    pub fn closed(self) -> Result<(), AgentError> {
        self.wait_closed()
    }

    fn wait_closed(&self) -> Result<(), AgentError> {
        match self.chan.recv_reply(Some(self.timeout)) {
            Err(ProtoError::Closed) => Ok(()),
            Err(err) => Err(AgentError::Proto { pid: self.pid, err }),
            Ok(got) => Err(self.unexpected("end of connection", got)),
        }
    }
}

/// Host tid of the agent thread of `pid` whose tid in the process's namespace is `ns_tid`.
pub fn host_tid(pid: i32, ns_tid: i32) -> Result<i32, AgentError> {
    procfs::host_tid(pid, ns_tid)
        .map_err(|err| AgentError::Proc { pid, err })?
        .ok_or(AgentError::NoThread { pid, ns_tid })
}

/// Host tid of the agent's thread of `pid`, found by its name, if there is one.
pub fn agent_thread(pid: i32) -> Option<i32> {
    procfs::thread_named(pid, AGENT_THREAD_COMM).ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_agent_means_none() {
        // Our own test process runs no agent.
        let me = std::process::id() as i32;
        assert!(
            AgentSession::connect(me, Duration::from_secs(1))
                .unwrap()
                .is_none()
        );
        assert!(matches!(host_tid(me, -5), Err(AgentError::NoThread { .. })));
        assert_eq!(agent_thread(me), None);
    }

    #[test]
    fn a_session_speaks_the_protocol_in_order() {
        // The other end plays the agent for one hello and one list.
        let (ours, theirs) = Channel::pair().unwrap();
        let s = AgentSession {
            pid: 1,
            chan: ours,
            timeout: Duration::from_secs(5),
            door: None,
            answered: std::sync::atomic::AtomicBool::new(false),
        };
        let agent = std::thread::spawn(move || {
            let (r, _) = theirs.recv_request(Some(Duration::from_secs(5))).unwrap();
            assert!(matches!(r, Request::Hello { .. }));
            theirs
                .send_reply(&Reply::Hello {
                    version: PROTOCOL_VERSION,
                    pid: 7,
                    tid: 8,
                    allocations: 1,
                    converted_bytes: 4096,
                    devices: 1,
                    released: true,
                    hazards: 0,
                    kept: 0,
                })
                .unwrap();
            let (r, _) = theirs.recv_request(Some(Duration::from_secs(5))).unwrap();
            assert!(matches!(r, Request::ListAllocations));
            theirs
                .send_reply(&Reply::Allocation {
                    id: 3,
                    device: 0,
                    addr: 0x1000,
                    size: 4096,
                    kind: AllocKind::Converted,
                    rdma_capable: false,
                })
                .unwrap();
            theirs
                .send_reply(&Reply::AllocationsEnd { count: 1 })
                .unwrap();
        });
        assert!(matches!(
            s.hello_intact(),
            Err(AgentError::AlreadyReleased { pid: 1 })
        ));
        let list = s.list().unwrap();
        assert_eq!(list.len(), 1);
        assert!(list[0].moved && list[0].addr == 0x1000);
        agent.join().unwrap();
    }
}
