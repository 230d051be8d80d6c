//! The plugin's side of the conversation with the in-process agent: one [`AgentSession`] per
//! connection, with one method per step of the protocol (`docs/design-notes.md`). The data
//! pumps of [`crate::datapath`] use its channel for the per-chunk messages. A keeper is spoken
//! to the same way, through a [`KeeperSession`]: both are a [`Session`] over the requests their
//! server takes ([`gpusnap_proto::AgentRequest`], [`gpusnap_proto::KeeperRequest`]), and what
//! only one serves is a method of its type alone.
//!
//! The agent has no socket name: the session copies the client end of the agent's door out of
//! the target with `pidfd_getfd` and knocks (`gpusnap_proto`'s `door`), which works across pid
//! and network namespaces alike and needs the ptrace rights CRIU has anyway. The agent's
//! `Hello` must name the target's namespace pid. A knock the agent never answered is withdrawn
//! when the session ends, so CRIU never finds it queued in the process.

use gpusnap_host::pid::{HostPid, HostTid, NsPid, NsTid};
use gpusnap_host::procfs;
use gpusnap_image::AllocationRecord;
use gpusnap_proto::{
    AgentRequest, AllocKind, Channel, CommonRequest, KeeperRequest, PROTOCOL_VERSION, ProtoError,
    Reply, Request, Share,
};
use std::io;
use std::marker::PhantomData;
use std::os::fd::BorrowedFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The agent's thread names itself so (a restored process's agent thread can be found without
/// asking the agent, whose thread is stopped then).
pub const AGENT_THREAD_COMM: &str = "gpusnap-agent";

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("pid {pid}: {err}")]
    Proc { pid: HostPid, err: io::Error },
    #[error("connecting to the agent of pid {pid}: {err}")]
    Connect { pid: HostPid, err: io::Error },
    #[error(
        "the agent behind the door of pid {pid} says it is namespace pid {claimed} (the target is {expected}), or its thread is not the target's gpusnap-agent thread: refusing to talk to it",
        // Shown as the wire's i32 said it (a negative claim too).
        claimed = .claimed.get() as i32
    )]
    Impostor {
        pid: HostPid,
        claimed: NsPid,
        expected: NsPid,
    },
    #[error("agent of pid {pid}: {err}")]
    Proto { pid: HostPid, err: ProtoError },
    #[error("agent of pid {pid} answered {got} where {expected} was expected")]
    Unexpected {
        pid: HostPid,
        expected: &'static str,
        got: String,
    },
    /// `message` is the job's text: shown quoted and escaped.
    #[error("agent of pid {pid} reports: {message:?}")]
    Refused { pid: HostPid, message: String },
    #[error("agent thread (namespace tid {ns_tid}) of pid {pid} not found in /proc/{pid}/task")]
    NoThread { pid: HostPid, ns_tid: NsTid },
    #[error(
        "the agent of pid {pid} reports its memory as released (an earlier dump did not finish?)"
    )]
    AlreadyReleased { pid: HostPid },
    #[error("the agent of pid {pid} made no progress for {stall:?} (hung?)")]
    Stalled { pid: HostPid, stall: Duration },
    /// The peer process (a keeper) is stopped (SIGSTOP, a debugger): it cannot answer, so
    /// waiting out the agent timeout would only hold the job longer.
    #[error(
        "the keeper (pid {peer}) serving pid {pid} is stopped (state {state}) and cannot answer: given up on at once"
    )]
    PeerStopped {
        pid: HostPid,
        peer: HostPid,
        state: char,
    },
    /// More replies of a kind than the agent may send (issue 32, item 4): what it sends is
    /// kept in root's memory, so it is bounded by what it said it holds.
    #[error("the agent of pid {pid} sent more than {limit} {what} ({bound}): refused")]
    TooMany {
        pid: HostPid,
        what: &'static str,
        limit: usize,
        bound: &'static str,
    },
    /// A reply sequence that did not end in its overall time (issue 32, item 6).
    #[error(
        "the agent of pid {pid}: {what} did not end within {limit:?} (the agent timeout plus {per:?} for each of at most {count} replies): refused as hung"
    )]
    Overdue {
        pid: HostPid,
        what: &'static str,
        limit: Duration,
        per: Duration,
        count: usize,
    },
    #[error("the agent of pid {pid} listed {fault}: refused")]
    BadListing { pid: HostPid, fault: ListingFault },
}

/// What is wrong with a listing (`ListAllocations`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ListingFault {
    #[error("allocation id {id} twice")]
    DuplicateId { id: u64 },
    #[error("allocation #{id} [{addr:#x}, +{size}), which wraps around the address space")]
    Wraps { id: u64, addr: u64, size: u64 },
    #[error(
        "allocation #{id} [{addr:#x}, +{size}) overlapping allocation #{other} [{other_addr:#x}, +{other_size})"
    )]
    Overlap {
        id: u64,
        addr: u64,
        size: u64,
        other: u64,
        other_addr: u64,
        other_size: u64,
    },
    #[error("{bytes} bytes of allocations to move, more than the {limit} any job may hold")]
    TooManyBytes { bytes: u64, limit: u64 },
    #[error("{sent} allocations but ended the list with a count of {said}")]
    CountMismatch { sent: usize, said: u32 },
}

/// Most allocations one agent may list, or lend: far more than a job holds (a PyTorch job with
/// expandable segments maps a few thousand), and a bound on what root keeps for it.
pub const MAX_ALLOCATIONS: usize = 1 << 18;
/// Allocations a running process may make between its `Hello` and its listing (the listing at
/// PAUSE asks a running job): a listing may exceed the `Hello`'s count by this much.
pub const LIST_SLACK: usize = 1024;
/// Most bytes of moved allocations one agent may list (4 TiB: more device memory than any one
/// host has today). The data phase's chunks, its time and its disk are bounded by the listing,
/// so the listing is bounded too.
pub const MAX_LISTED_BYTES: u64 = 1 << 42;
/// What a listing may take per allocation, on top of the agent timeout: its overall time is
/// `agent_timeout + LIST_ALLOWANCE × (the Hello's count + LIST_SLACK)` (at most
/// [`MAX_ALLOCATIONS`] allocations). A reply costs microseconds.
pub const LIST_ALLOWANCE: Duration = Duration::from_micros(100);
/// What a lend may take per allocation, on top of the agent timeout: the job's agent exports
/// each one (about 2 ms on the H200), so `agent_timeout + LEND_ALLOWANCE × (allocations it may
/// lend)`.
pub const LEND_ALLOWANCE: Duration = Duration::from_millis(10);

/// One allocation whose data a transfer moves, as the agent listed it (or a keeper adopted
/// it): the chunks of a copy-out must be its slot-sized cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moved {
    pub id: u64,
    pub addr: u64,
    pub size: u64,
}

/// What the agent said on this connection that bounds what it may send next.
#[derive(Debug, Default)]
struct Said {
    /// The `Hello`'s allocation count.
    hello_allocations: Option<u32>,
    /// The last listing's moved allocations, and how many of them are lendable.
    listed: Option<(Vec<Moved>, usize)>,
    /// Allocations a keeper adopted (its drain moves them).
    adopted: Vec<Moved>,
    /// Those of them in a keeper's snapshot set aside: its next drain moves the others
    /// (`adopted`), the one after it these ([`Session::release_keeper`] swaps them in).
    set_aside: Vec<Moved>,
    /// `Expect`s a keeper answered (a restore's: what its lend gives back).
    expected: usize,
}

/// An overall time for a sequence of replies.
struct Deadline {
    at: Instant,
    limit: Duration,
    what: &'static str,
    per: Duration,
    count: usize,
}

impl Deadline {
    /// `timeout + per × count`: the time a sequence of at most `count` replies may take.
    fn new(timeout: Duration, per: Duration, count: usize, what: &'static str) -> Deadline {
        let limit =
            timeout.saturating_add(per.saturating_mul(u32::try_from(count).unwrap_or(u32::MAX)));
        Deadline {
            at: Instant::now() + limit,
            limit,
            what,
            per,
            count,
        }
    }

    fn overdue(&self, pid: HostPid) -> AgentError {
        AgentError::Overdue {
            pid,
            what: self.what,
            limit: self.limit,
            per: self.per,
            count: self.count,
        }
    }
}

/// What the agent said about itself.
#[derive(Clone, Debug)]
pub struct AgentHello {
    pub ns_pid: NsPid,
    pub ns_tid: NsTid,
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

/// Which way a data transfer goes, as the agent or keeper is asked to begin it
/// ([`Session::begin`]). A pre-copy round, device to ring while the application runs, is the
/// job's agent's alone: [`AgentSession::begin_live`].
#[derive(Clone, Copy, Debug)]
pub enum Transfer {
    /// Device to ring (`DumpBegin`).
    Out,
    /// Ring to device (`RestoreBegin`: the agent re-creates its memory first).
    In,
}

/// The staging ring as the agent is told about it.
#[derive(Clone, Copy, Debug)]
pub struct RingShape {
    pub slot_size: u64,
    pub slots: u32,
    pub streams: u32,
}

/// One connection to a server of the protocol, whose requests are `R`: a job's agent
/// ([`AgentSession`]) or a keeper ([`KeeperSession`]). What both serve is here; what only one
/// does is on its type alone, so a request the other serves cannot be sent to it.
pub struct Session<R> {
    pid: HostPid,
    chan: Channel,
    timeout: Duration,
    /// The door knocked at; `None` in unit tests that play the agent over a plain pair.
    door: Option<gpusnap_proto::Door>,
    /// Whether the agent has answered anything (else the knock may still be queued).
    answered: std::sync::atomic::AtomicBool,
    /// What bounds the agent's next replies (boxed: a session is part of larger values).
    said: Box<Mutex<Said>>,
    /// A peer process of our own making (a keeper) whose state is looked at while a reply is
    /// awaited, so that a stopped one is noticed within [`PEER_CHECK`], not the timeout.
    peer: Option<HostPid>,
    /// The requests this connection's server takes.
    requests: PhantomData<fn(&R)>,
}

/// One connection to the agent of one process.
pub type AgentSession = Session<AgentRequest>;

/// The connection to a keeper (`crate::keeper::Keeper`'s).
pub type KeeperSession = Session<KeeperRequest>;

/// How often a wait for a watched peer's reply looks whether the peer is stopped.
const PEER_CHECK: Duration = Duration::from_millis(100);

/// The keeper's answer to `Snapshot`: `(count, bytes)` copied, or `(needed, allowed, device)`
/// where it would not fit.
pub type SnapshotAnswer = Result<(u32, u64), (u64, u64, u32)>;

impl<R> Drop for Session<R> {
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

impl<R: Request> Session<R> {
    /// A session over a connection of our own making (the keeper's socket pair); `pid` names
    /// the peer in messages. No door, so no identity check: the plugin made both ends.
    pub fn over(pid: HostPid, chan: Channel, timeout: Duration) -> Self {
        Self {
            pid,
            chan,
            timeout,
            door: None,
            answered: std::sync::atomic::AtomicBool::new(false),
            said: Box::default(),
            peer: None,
            requests: PhantomData,
        }
    }

    /// Watches `peer` (the keeper's pid) while replies are awaited: a stopped peer fails the
    /// wait within [`PEER_CHECK`] ([`AgentError::PeerStopped`]).
    pub fn watching(mut self, peer: HostPid) -> Self {
        self.peer = Some(peer);
        self
    }

    /// The watched peer's state, if it is stopped (`T`, or `t`: traced and stopped).
    fn peer_stopped(&self) -> Option<(HostPid, char)> {
        let peer = self.peer?;
        let (state, _) = gpusnap_host::procfs::state_and_start(peer).ok()?;
        matches!(
            state,
            gpusnap_host::procfs::ProcState::Stopped | gpusnap_host::procfs::ProcState::TracingStop
        )
        .then(|| (peer, state.letter()))
    }

    /// `recv` (a channel wait of at most its argument) for at most `timeout`, in slices of
    /// [`PEER_CHECK`] when a peer is watched, failing at once once that peer is stopped.
    fn wait_watched<T>(
        &self,
        timeout: Duration,
        recv: impl Fn(Duration) -> Result<T, ProtoError>,
    ) -> Result<T, AgentError> {
        if self.peer.is_none() {
            return recv(timeout).map_err(self.proto());
        }
        let until = Instant::now() + timeout;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match recv(left.min(PEER_CHECK)) {
                Err(ProtoError::Timeout) if !left.is_zero() => {
                    if let Some((peer, state)) = self.peer_stopped() {
                        return Err(AgentError::PeerStopped {
                            pid: self.pid,
                            peer,
                            state,
                        });
                    }
                    if Instant::now() >= until {
                        return Err(self.proto()(ProtoError::Timeout));
                    }
                }
                r => return r.map_err(self.proto()),
            }
        }
    }

    pub fn pid(&self) -> HostPid {
        self.pid
    }

    /// The connection, for the per-chunk messages of a transfer.
    pub fn channel(&self) -> &Channel {
        &self.chan
    }

    fn proto(&self) -> impl Fn(ProtoError) -> AgentError + '_ {
        |err| AgentError::Proto { pid: self.pid, err }
    }

    fn send(&self, r: &R, fd: Option<BorrowedFd<'_>>) -> Result<(), AgentError> {
        self.chan.send_request(r, fd).map_err(self.proto())
    }

    /// [`Self::send`] of a request both servers take.
    fn send_common(&self, c: CommonRequest, fd: Option<BorrowedFd<'_>>) -> Result<(), AgentError> {
        self.send(&R::from(c), fd)
    }

    /// The next reply; an agent's `Error` becomes [`AgentError::Refused`].
    pub fn recv(&self, timeout: Duration) -> Result<Reply, AgentError> {
        let reply = self.wait_watched(timeout, |t| self.chan.recv_reply(Some(t)))?;
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

    /// The next reply of a sequence bounded by `d`: each waited for at most the agent timeout,
    /// all of them within the deadline.
    fn recv_within(&self, d: &Deadline) -> Result<Reply, AgentError> {
        let left = d.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(d.overdue(self.pid));
        }
        match self.recv(left.min(self.timeout)) {
            Err(AgentError::Proto {
                err: ProtoError::Timeout,
                ..
            }) if Instant::now() >= d.at => Err(d.overdue(self.pid)),
            r => r,
        }
    }

    /// [`Self::recv_within`] for replies that may carry a descriptor.
    fn recv_fd_within(
        &self,
        d: &Deadline,
    ) -> Result<(Reply, Option<std::os::fd::OwnedFd>), AgentError> {
        let left = d.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(d.overdue(self.pid));
        }
        match self.recv_with_fd(left.min(self.timeout)) {
            Err(AgentError::Proto {
                err: ProtoError::Timeout,
                ..
            }) if Instant::now() >= d.at => Err(d.overdue(self.pid)),
            r => r,
        }
    }

    /// What bounds the agent's next replies.
    fn said(&self) -> std::sync::MutexGuard<'_, Said> {
        self.said.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The allocations whose chunks a copy-out on this connection may announce: the moved ones
    /// of the last listing, and those a keeper adopted. Empty if neither: then no chunk is
    /// accepted.
    pub fn moved(&self) -> Vec<Moved> {
        let said = self.said();
        let mut v: Vec<Moved> = said
            .listed
            .as_ref()
            .map(|(m, _)| m.clone())
            .unwrap_or_default();
        v.extend(said.adopted.iter().copied());
        v
    }

    /// The next reply and the descriptor it may carry, waited for at most `timeout`; an
    /// agent's `Error` (without one) becomes [`AgentError::Refused`].
    fn recv_with_fd(
        &self,
        timeout: Duration,
    ) -> Result<(Reply, Option<std::os::fd::OwnedFd>), AgentError> {
        let (reply, fd) = self.wait_watched(timeout, |t| self.chan.recv_reply_with_fd(Some(t)))?;
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

    fn bad_listing(&self, fault: ListingFault) -> AgentError {
        AgentError::BadListing {
            pid: self.pid,
            fault,
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
        self.send_common(
            CommonRequest::Hello {
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
                    let expected = procfs::ns_pid(self.pid)
                        .map_err(|err| AgentError::Proc { pid: self.pid, err })?;
                    // And the thread that answers is the target's agent thread (a child that
                    // inherited the door without fork's handlers could share the pid number in
                    // a pid namespace of its own).
                    let answering = procfs::host_tid(self.pid, tid).ok().flatten();
                    // The agent's claim is its getpid(), an i32 on the wire (a negative one
                    // is no namespace pid: never the expected one).
                    if ns_pid != expected
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
                self.said().hello_allocations = Some(allocations);
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
            Transfer::Out => CommonRequest::DumpBegin {
                slot_size,
                slots,
                streams,
            },
            Transfer::In => CommonRequest::RestoreBegin {
                slot_size,
                slots,
                streams,
            },
        };
        self.begin_with(&R::from(req), ring)
    }

    /// Sends `req`, which begins a transfer, with the ring's memfd attached, and waits for
    /// `Ready`.
    fn begin_with(&self, req: &R, ring: BorrowedFd<'_>) -> Result<(), AgentError> {
        self.send(req, Some(ring))?;
        match self.recv(self.timeout)? {
            Reply::Ready => Ok(()),
            got => Err(self.unexpected("Ready", got)),
        }
    }

    /// `LendBegin`: the job's agent exports every converted allocation; returns them with a
    /// copy of each descriptor. `release` (or `abort`) must follow.
    pub fn lend(&self) -> Result<Vec<LentAllocation>, AgentError> {
        let mut out = Vec::new();
        let r = self.lend_each(|l| {
            out.push(l);
            Ok::<(), std::convert::Infallible>(())
        })?;
        match r {
            Ok(_) => Ok(out),
            Err(never) => match never {},
        }
    }

    /// `LendBegin`, each lent allocation given to `each` as its `Lent` arrives (so that a
    /// keeper adopts one while the job exports the next); returns how many. `release` (or
    /// `abort`) must follow.
    ///
    /// Each reply carries a descriptor, so they are bounded (issue 32, items 4 and 6): no more
    /// than the lendable allocations the agent listed on this connection (a keeper: the
    /// allocations it was told to expect), all within `agent_timeout + LEND_ALLOWANCE × that
    /// many` of the job's own time: what `each` takes moves the deadline on by as much, so
    /// the job is never blamed for its reader's work. When `each` fails, the rest of the lend
    /// is still read (and its descriptors closed), so that an `abort` finds the job's agent
    /// waiting for it; the outer error is the job's, the inner one `each`'s.
    pub fn lend_each<E>(
        &self,
        mut each: impl FnMut(LentAllocation) -> Result<(), E>,
    ) -> Result<Result<usize, E>, AgentError> {
        let (limit, bound) = {
            let said = self.said();
            match (&said.listed, said.expected) {
                (Some((_, lendable)), _) => (*lendable, "the lendable allocations it listed"),
                (None, n) if n > 0 => (n, "the allocations it was told to expect"),
                (None, _) => (MAX_ALLOCATIONS, "the most any agent may list"),
            }
        };
        self.send_common(CommonRequest::LendBegin, None)?;
        let mut deadline = Deadline::new(self.timeout, LEND_ALLOWANCE, limit, "its lend");
        let mut count = 0usize;
        let mut failed: Option<E> = None;
        loop {
            match self.recv_fd_within(&deadline)? {
                (Reply::Lent { .. }, Some(_)) if count >= limit => {
                    return Err(AgentError::TooMany {
                        pid: self.pid,
                        what: "lent allocations",
                        limit,
                        bound,
                    });
                }
                (
                    Reply::Lent {
                        id,
                        device,
                        addr,
                        size,
                        rdma_capable,
                    },
                    Some(fd),
                ) => {
                    count += 1;
                    if failed.is_some() {
                        continue;
                    }
                    let t = Instant::now();
                    let r = each(LentAllocation {
                        id,
                        device,
                        addr,
                        size,
                        rdma_capable,
                        fd,
                    });
                    deadline.at += t.elapsed();
                    if let Err(e) = r {
                        failed = Some(e);
                    }
                }
                (Reply::LentEnd { count: said, .. }, None) if said as usize == count => {
                    return Ok(failed.map_or(Ok(count), Err));
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

    /// `SlotFree`: a dump's slot was written and may be filled again.
    pub fn slot_free(&self, slot: u32) -> Result<(), AgentError> {
        self.send_common(CommonRequest::SlotFree { slot }, None)
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
        let req = CommonRequest::ChunkLoad {
            slot,
            addr,
            len,
            device_hash,
        };
        self.send_common(req, None)
    }

    /// `KnownChunk` (before `begin(Transfer::Out)`): the parent image holds this chunk with this
    /// device hash; the dump announces it `ChunkUnchanged` instead of copying it if it is.
    pub fn known_chunk(&self, addr: u64, len: u64, device_hash: u64) -> Result<(), AgentError> {
        let req = CommonRequest::KnownChunk {
            addr,
            len,
            device_hash,
        };
        self.send_common(req, None)
    }

    /// `ChunkZero`: a restore's chunk recorded as all zeros; the agent fills it on the device.
    pub fn chunk_zero(
        &self,
        addr: u64,
        len: u64,
        device_hash: Option<u64>,
    ) -> Result<(), AgentError> {
        let req = CommonRequest::ChunkZero {
            addr,
            len,
            device_hash,
        };
        self.send_common(req, None)
    }

    /// `Abort`: the agent stops and keeps its memory. Best effort, bounded; true when the agent
    /// confirmed (it has unmapped the ring then).
    pub fn abort(&self) -> bool {
        if self.send_common(CommonRequest::Abort, None).is_err() {
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

    /// `RestoreDataDone` after the last `ChunkLoad`: the agent synchronises, checks the device
    /// hashes it was given on the GPU, and answers with the bytes it loaded and the chunks it
    /// checked (a job's agent then closes the connection: [`Self::closed`]; a keeper stays).
    pub fn finish_restore(&self) -> Result<(u64, u64), AgentError> {
        self.send_common(CommonRequest::RestoreDataDone, None)?;
        match self.recv(self.timeout)? {
            Reply::Restored {
                bytes, verified, ..
            } => Ok((bytes, verified)),
            got => Err(self.unexpected("Restored", got)),
        }
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

/// What only a job's agent serves.
impl Session<AgentRequest> {
    /// Connects to the agent of host pid `pid`. `Ok(None)`: no agent listens there (the process
    /// goes the driver path). `timeout` bounds every wait for an answer.
    pub fn connect(pid: HostPid, timeout: Duration) -> Result<Option<Self>, AgentError> {
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
            said: Box::default(),
            peer: None,
            requests: PhantomData,
        }))
    }

    /// Like [`Self::connect`], for a process known to run the agent.
    pub fn connect_expected(pid: HostPid, timeout: Duration) -> Result<Self, AgentError> {
        Self::connect(pid, timeout)?.ok_or(AgentError::Connect {
            pid,
            err: io::Error::new(io::ErrorKind::NotFound, "the agent's socket is gone"),
        })
    }

    /// `ListAllocations`: every allocation the agent tracks.
    pub fn list(&self) -> Result<Vec<AllocationRecord>, AgentError> {
        Ok(self.list_kinds()?.into_iter().map(|(a, _)| a).collect())
    }

    /// `ListAllocations`, with how the agent holds each (what its route depends on).
    ///
    /// Bounded (issue 32, items 4 and 6): at most the `Hello`'s count plus [`LIST_SLACK`]
    /// allocations (without a `Hello` on this connection, [`MAX_ALLOCATIONS`]), all within
    /// `agent_timeout + LIST_ALLOWANCE × that many`; ids unique, the moved allocations apart
    /// and no more than [`MAX_LISTED_BYTES`] together, and the end's count right. The moved
    /// ones bound the chunks of a copy-out on this connection ([`Self::moved`]).
    pub fn list_kinds(&self) -> Result<Vec<(AllocationRecord, AllocKind)>, AgentError> {
        let (limit, bound) = match self.said().hello_allocations {
            Some(n) => (
                (n as usize).saturating_add(LIST_SLACK).min(MAX_ALLOCATIONS),
                "its Hello's count plus the slack for a running job",
            ),
            None => (MAX_ALLOCATIONS, "the most any agent may list"),
        };
        self.send(&AgentRequest::ListAllocations, None)?;
        let deadline = Deadline::new(self.timeout, LIST_ALLOWANCE, limit, "its listing");
        let mut out = Vec::new();
        loop {
            match self.recv_within(&deadline)? {
                Reply::Allocation { .. } if out.len() >= limit => {
                    return Err(AgentError::TooMany {
                        pid: self.pid,
                        what: "allocations",
                        limit,
                        bound,
                    });
                }
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
                Reply::AllocationsEnd { count } => {
                    if count as usize != out.len() {
                        return Err(self.bad_listing(ListingFault::CountMismatch {
                            sent: out.len(),
                            said: count,
                        }));
                    }
                    let moved = check_listing(&out).map_err(|f| self.bad_listing(f))?;
                    let lendable = out.iter().filter(|(_, k)| k.lendable()).count();
                    self.said().listed = Some((moved, lendable));
                    return Ok(out);
                }
                got => return Err(self.unexpected("Allocation", got)),
            }
        }
    }

    /// `PreCopyBegin` with the ring's memfd attached (a pre-copy round: device to ring while
    /// the application runs); returns once the agent has mapped and pinned it.
    pub fn begin_live(&self, ring: BorrowedFd<'_>, shape: RingShape) -> Result<(), AgentError> {
        let RingShape {
            slot_size,
            slots,
            streams,
        } = shape;
        let req = AgentRequest::PreCopyBegin {
            slot_size,
            slots,
            streams,
        };
        self.begin_with(&req, ring)
    }

    /// `Reclaim`: the job's agent maps its released memory again from the descriptors it kept
    /// at the hand-over, and closes the connection. Returns (allocations, bytes).
    pub fn reclaim(self) -> Result<(u32, u64), AgentError> {
        self.send(&AgentRequest::Reclaim, None)?;
        let r = match self.recv(self.timeout)? {
            Reply::Reclaimed {
                allocations, bytes, ..
            } => (allocations, bytes),
            got => return Err(self.unexpected("Reclaimed", got)),
        };
        self.wait_closed()?;
        Ok(r)
    }

    /// `ListSharing`: the process's CUDA IPC shares through its agent (at most
    /// [`MAX_SHARES`], within `agent_timeout + LIST_ALLOWANCE × MAX_SHARES`).
    pub fn list_sharing(&self) -> Result<Vec<Share>, AgentError> {
        self.send(&AgentRequest::ListSharing, None)?;
        let deadline = Deadline::new(self.timeout, LIST_ALLOWANCE, MAX_SHARES, "its shares");
        let mut out = Vec::new();
        loop {
            match self.recv_within(&deadline)? {
                Reply::Shared(share) if out.len() < MAX_SHARES => out.push(share),
                Reply::SharedEnd { count } if count as usize == out.len() => return Ok(out),
                got => return Err(self.unexpected("Shared, or SharedEnd with their count", got)),
            }
        }
    }

    /// `ShareFds`: a descriptor of the current memory of each allocation the process exported
    /// (at most [`MAX_SHARES`], within `agent_timeout + LEND_ALLOWANCE × MAX_SHARES`).
    pub fn share_fds(&self) -> Result<Vec<SharedMemory>, AgentError> {
        self.send(&AgentRequest::ShareFds, None)?;
        let deadline = Deadline::new(
            self.timeout,
            LEND_ALLOWANCE,
            MAX_SHARES,
            "its shares' descriptors",
        );
        let mut out = Vec::new();
        loop {
            match self.recv_fd_within(&deadline)? {
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
    pub fn reimport(&self, exporter_pid: NsPid, mem: &SharedMemory) -> Result<u64, AgentError> {
        use std::os::fd::AsFd;
        let req = AgentRequest::Reimport {
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
        exporter_pid: NsPid,
        id: u64,
        key: [u8; 16],
    ) -> Result<(), AgentError> {
        let req = AgentRequest::ShareableSource {
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

    /// `Release`: the agent releases its physical memory (address reservations kept), replies
    /// and closes the connection; this waits for the close, so that the process holds no
    /// socket to CRIU when its files are dumped. Returns (allocations, bytes) released.
    pub fn release(self) -> Result<(u32, u64), AgentError> {
        self.send_common(CommonRequest::Release, None)?;
        let r = match self.recv(self.timeout)? {
            Reply::Released {
                allocations, bytes, ..
            } => (allocations, bytes),
            got => return Err(self.unexpected("Released", got)),
        };
        self.wait_closed()?;
        Ok(r)
    }

    /// `Take` (to a restored job's agent): map `lent`'s memory at its address.
    pub fn take(&self, lent: &LentAllocation) -> Result<(), AgentError> {
        use std::os::fd::AsFd;
        let req = AgentRequest::Take {
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
        self.send(&AgentRequest::TakeEnd, None)?;
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
}

/// What only a keeper serves.
impl Session<KeeperRequest> {
    /// `Adopt` (to a keeper): import `lent`'s descriptor and map it at the job's address.
    pub fn adopt(&self, lent: &LentAllocation) -> Result<(), AgentError> {
        self.send_adopt(lent)?;
        self.adopted(Moved {
            id: lent.id,
            addr: lent.addr,
            size: lent.size,
        })
    }

    /// The `Adopt` of [`Self::adopt`] alone: its `Adopted` is read by [`Self::adopted`], in
    /// the order sent (the keeper answers one request after the other), so that several may
    /// be in flight.
    pub fn send_adopt(&self, lent: &LentAllocation) -> Result<(), AgentError> {
        use std::os::fd::AsFd;
        let req = KeeperRequest::Adopt {
            id: lent.id,
            device: lent.device,
            addr: lent.addr,
            size: lent.size,
        };
        self.send(&req, Some(lent.fd.as_fd()))
    }

    /// The keeper's answer to the oldest `Adopt` still unanswered, which was for `sent`.
    pub fn adopted(&self, sent: Moved) -> Result<(), AgentError> {
        match self.recv(self.timeout)? {
            Reply::Adopted { id } if id == sent.id => {
                self.said().adopted.push(sent);
                Ok(())
            }
            got => Err(self.unexpected("Adopted", got)),
        }
    }

    /// `SnapshotRoom` to the keeper (an asynchronous `-R`): `(free, allowed)`, GPU `device`'s
    /// free memory and what `share_percent` of it allows a snapshot to take there.
    pub fn snapshot_room(&self, device: u32, share_percent: u32) -> Result<(u64, u64), AgentError> {
        self.send(
            &KeeperRequest::SnapshotRoom {
                device,
                share_percent,
            },
            None,
        )?;
        match self.recv(self.timeout)? {
            Reply::SnapshotRoom {
                device: d,
                free,
                allowed,
            } if d == device => Ok((free, allowed)),
            got => Err(self.unexpected("SnapshotRoom", got)),
        }
    }

    /// `SnapshotIds` .. `Snapshot` to the keeper (an asynchronous `-R`): `Ok(Ok((count,
    /// bytes)))` once it holds a device-to-device copy of every adopted allocation in `ids`
    /// and no import of the job's of them; `Ok(Err((needed, allowed, device)))` when they
    /// would not fit in `share_percent` of a GPU's free memory (nothing changed). The copies
    /// take the device's time, not the link's. Where `ids` leaves some adopted allocations
    /// out, the keeper sets the snapshot aside: its next drain moves those others, and the one
    /// after it the snapshot ([`Self::release_keeper`]).
    pub fn snapshot(
        &self,
        share_percent: u32,
        ids: &std::collections::BTreeSet<u64>,
    ) -> Result<SnapshotAnswer, AgentError> {
        let list: Vec<u64> = ids.iter().copied().collect();
        for part in list.chunks(gpusnap_proto::MAX_SNAPSHOT_IDS) {
            self.send(&KeeperRequest::SnapshotIds { ids: part.to_vec() }, None)?;
        }
        let count = u32::try_from(list.len()).unwrap_or(u32::MAX);
        self.send(
            &KeeperRequest::Snapshot {
                share_percent,
                count,
            },
            None,
        )?;
        match self.recv(self.timeout)? {
            Reply::Snapshotted { count, bytes } => {
                let mut said = self.said();
                if said.adopted.iter().any(|m| !ids.contains(&m.id)) {
                    let (snapshot, rest) = std::mem::take(&mut said.adopted)
                        .into_iter()
                        .partition(|m| ids.contains(&m.id));
                    said.adopted = rest;
                    said.set_aside = snapshot;
                }
                Ok(Ok((count, bytes)))
            }
            Reply::SnapshotRefused {
                needed,
                allowed,
                device,
            } => Ok(Err((needed, allowed, device))),
            got => Err(self.unexpected("Snapshotted", got)),
        }
    }

    /// `Release` to a keeper: it drops its imports and answers, and stays until the session is
    /// dropped (its exit while CRIU works on the tasks would fail the dump). A snapshot it set
    /// aside is what its next drain moves.
    pub fn release_keeper(&self) -> Result<(u32, u64), AgentError> {
        self.send_common(CommonRequest::Release, None)?;
        match self.recv(self.timeout)? {
            Reply::Released {
                allocations, bytes, ..
            } => {
                let mut said = self.said();
                if !said.set_aside.is_empty() {
                    said.adopted = std::mem::take(&mut said.set_aside);
                }
                Ok((allocations, bytes))
            }
            got => Err(self.unexpected("Released", got)),
        }
    }

    /// `Expect` (to a keeper at a restore): allocation `a` of the job goes at its address on
    /// the GPU `gpu`, made RDMA-capable where the image says it was. Returns the keeper's
    /// ordinal of that GPU.
    pub fn expect(&self, a: &AllocationRecord, gpu: [u8; 16]) -> Result<u32, AgentError> {
        let id = a.id;
        self.send(
            &KeeperRequest::Expect {
                id,
                gpu,
                addr: a.addr,
                size: a.size,
                rdma_capable: a.rdma_capable,
            },
            None,
        )?;
        match self.recv(self.timeout)? {
            Reply::Expected { id: got, device } if got == id => {
                self.said().expected += 1;
                Ok(device)
            }
            got => Err(self.unexpected("Expected", got)),
        }
    }
}

/// A listing's moved allocations, once its ids are unique, the moved ones do not wrap, do not
/// overlap one another (no two live mappings share an address) and are no more than
/// [`MAX_LISTED_BYTES`] together.
fn check_listing(listed: &[(AllocationRecord, AllocKind)]) -> Result<Vec<Moved>, ListingFault> {
    let mut ids = std::collections::HashSet::with_capacity(listed.len());
    for (a, _) in listed {
        if !ids.insert(a.id) {
            return Err(ListingFault::DuplicateId { id: a.id });
        }
    }
    let mut moved: Vec<Moved> = listed
        .iter()
        .filter(|(a, _)| a.moved)
        .map(|(a, _)| Moved {
            id: a.id,
            addr: a.addr,
            size: a.size,
        })
        .collect();
    moved.sort_by_key(|m| m.addr);
    let mut bytes = 0u64;
    let mut prev: Option<&Moved> = None;
    for m in &moved {
        if m.addr.checked_add(m.size).is_none() {
            return Err(ListingFault::Wraps {
                id: m.id,
                addr: m.addr,
                size: m.size,
            });
        }
        if let Some(p) = prev
            && p.addr + p.size > m.addr
        {
            return Err(ListingFault::Overlap {
                id: m.id,
                addr: m.addr,
                size: m.size,
                other: p.id,
                other_addr: p.addr,
                other_size: p.size,
            });
        }
        bytes = bytes.saturating_add(m.size);
        if m.size > 0 {
            prev = Some(m);
        }
    }
    if bytes > MAX_LISTED_BYTES {
        return Err(ListingFault::TooManyBytes {
            bytes,
            limit: MAX_LISTED_BYTES,
        });
    }
    Ok(moved)
}

/// Host tid of the agent thread of `pid` whose tid in the process's namespace is `ns_tid`.
pub fn host_tid(pid: HostPid, ns_tid: NsTid) -> Result<HostTid, AgentError> {
    procfs::host_tid(pid, ns_tid)
        .map_err(|err| AgentError::Proc { pid, err })?
        .ok_or(AgentError::NoThread { pid, ns_tid })
}

/// Host tid of the agent's thread of `pid`, found by its name, if there is one.
pub fn agent_thread(pid: HostPid) -> Option<HostTid> {
    procfs::thread_named(pid, AGENT_THREAD_COMM).ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn no_agent_means_none() {
        // Our own test process runs no agent.
        let me = HostPid(std::process::id() as i32);
        assert!(
            AgentSession::connect(me, Duration::from_secs(1))
                .unwrap()
                .is_none()
        );
        assert!(matches!(
            host_tid(me, NsTid(-5)),
            Err(AgentError::NoThread { .. })
        ));
        assert_eq!(agent_thread(me), None);
    }

    #[test]
    fn a_session_speaks_the_protocol_in_order() {
        // The other end plays the agent for one hello and one list.
        let (ours, theirs) = Channel::pair().unwrap();
        let s = AgentSession {
            pid: HostPid(1),
            chan: ours,
            timeout: Duration::from_secs(5),
            door: None,
            answered: std::sync::atomic::AtomicBool::new(false),
            said: Box::default(),
            peer: None,
            requests: PhantomData,
        };
        let agent = std::thread::spawn(move || {
            let (r, _) = theirs
                .recv_request::<AgentRequest>(Some(Duration::from_secs(5)))
                .unwrap();
            assert!(matches!(
                r,
                AgentRequest::Common(CommonRequest::Hello { .. })
            ));
            theirs
                .send_reply(&Reply::Hello {
                    version: PROTOCOL_VERSION,
                    pid: NsPid(7),
                    tid: NsTid(8),
                    allocations: 1,
                    converted_bytes: 4096,
                    devices: 1,
                    released: true,
                    hazards: 0,
                    kept: 0,
                })
                .unwrap();
            let (r, _) = theirs
                .recv_request::<AgentRequest>(Some(Duration::from_secs(5)))
                .unwrap();
            assert!(matches!(r, AgentRequest::ListAllocations));
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
            Err(AgentError::AlreadyReleased { pid: HostPid(1) })
        ));
        let list = s.list().unwrap();
        assert_eq!(list.len(), 1);
        assert!(list[0].moved && list[0].addr == 0x1000);
        agent.join().unwrap();
    }

    fn allocation(id: u64, addr: u64, size: u64) -> Reply {
        Reply::Allocation {
            id,
            device: 0,
            addr,
            size,
            kind: AllocKind::Converted,
            rdma_capable: false,
        }
    }

    fn hello_reply(allocations: u32) -> Reply {
        Reply::Hello {
            version: PROTOCOL_VERSION,
            pid: NsPid(7),
            tid: NsTid(8),
            allocations,
            converted_bytes: 0,
            devices: 1,
            released: false,
            hazards: 0,
            kept: 0,
        }
    }

    /// A session whose agent (a thread) answers `Hello` with `allocations` and then the
    /// listing request with `play`; returns the listing's outcome and how long it took.
    fn list_against(
        allocations: u32,
        timeout: Duration,
        play: impl FnOnce(&Channel) + Send + 'static,
    ) -> (Result<Vec<AllocationRecord>, AgentError>, Duration) {
        let (ours, theirs) = Channel::pair().unwrap();
        let s = AgentSession::over(HostPid(1), ours, timeout);
        let agent = std::thread::spawn(move || {
            let (r, _) = theirs
                .recv_request::<AgentRequest>(Some(Duration::from_secs(5)))
                .unwrap();
            assert!(matches!(
                r,
                AgentRequest::Common(CommonRequest::Hello { .. })
            ));
            theirs.send_reply(&hello_reply(allocations)).unwrap();
            let (r, _) = theirs
                .recv_request::<AgentRequest>(Some(Duration::from_secs(5)))
                .unwrap();
            assert!(matches!(r, AgentRequest::ListAllocations));
            play(&theirs);
        });
        s.hello().unwrap();
        let t0 = Instant::now();
        let listed = s.list();
        let took = t0.elapsed();
        drop(s);
        agent.join().unwrap();
        (listed, took)
    }

    /// Issue 32, item 4: a flood of `Allocation` replies is refused once it passes the
    /// `Hello`'s count and the slack, not kept.
    #[test]
    fn a_listing_is_bounded_by_the_hello() {
        let (listed, _) = list_against(3, Duration::from_secs(5), |ch| {
            for i in 0..100_000u64 {
                if ch
                    .send_reply(&allocation(i + 1, (i + 1) << 30, 1 << 20))
                    .is_err()
                {
                    return; // the session hung up: refused
                }
            }
            let _ = ch.send_reply(&Reply::AllocationsEnd { count: 100_000 });
        });
        match listed {
            Err(AgentError::TooMany { what, limit, .. }) => {
                assert_eq!((what, limit), ("allocations", 3 + LIST_SLACK));
            }
            other => panic!("{other:?}"),
        }
    }

    /// Duplicated ids, overlapping moved allocations and a wrong count are refused.
    #[test]
    fn a_listing_that_cannot_be_true_is_refused() {
        type Case = (Vec<Reply>, fn(&ListingFault) -> bool);
        let cases: Vec<Case> = vec![
            (
                vec![allocation(1, 1 << 30, 4096), allocation(1, 2 << 30, 4096)],
                |f| matches!(f, ListingFault::DuplicateId { id: 1 }),
            ),
            (
                vec![
                    allocation(1, 1 << 30, 8192),
                    allocation(2, (1 << 30) + 4096, 4096),
                ],
                |f| {
                    matches!(
                        f,
                        ListingFault::Overlap {
                            id: 2,
                            other: 1,
                            ..
                        }
                    )
                },
            ),
            (vec![allocation(1, u64::MAX - 10, 4096)], |f| {
                matches!(f, ListingFault::Wraps { id: 1, .. })
            }),
            (vec![allocation(1, 1 << 30, MAX_LISTED_BYTES + 1)], |f| {
                matches!(f, ListingFault::TooManyBytes { .. })
            }),
        ];
        for (replies, expect) in cases {
            let n = replies.len() as u32;
            let (listed, _) = list_against(n, Duration::from_secs(5), move |ch| {
                for r in &replies {
                    ch.send_reply(r).unwrap();
                }
                ch.send_reply(&Reply::AllocationsEnd { count: n }).unwrap();
            });
            match listed {
                Err(AgentError::BadListing { fault, .. }) if expect(&fault) => {}
                other => panic!("{other:?}"),
            }
        }
        let (listed, _) = list_against(1, Duration::from_secs(5), |ch| {
            ch.send_reply(&allocation(1, 1 << 30, 4096)).unwrap();
            ch.send_reply(&Reply::AllocationsEnd { count: 2 }).unwrap();
        });
        assert!(
            matches!(
                listed,
                Err(AgentError::BadListing {
                    fault: ListingFault::CountMismatch { sent: 1, said: 2 },
                    ..
                })
            ),
            "{listed:?}"
        );
    }

    /// Issue 32, item 6: a listing whose replies each come within the timeout, but never end,
    /// is refused at `timeout + LIST_ALLOWANCE × (count + slack)`.
    #[test]
    fn a_dripping_listing_ends_at_its_deadline() {
        let timeout = Duration::from_millis(300);
        let (listed, took) = list_against(2, timeout, |ch| {
            for i in 0..40u64 {
                std::thread::sleep(Duration::from_millis(200));
                if ch
                    .send_reply(&allocation(i + 1, (i + 1) << 30, 4096))
                    .is_err()
                {
                    return;
                }
            }
        });
        assert!(
            matches!(
                listed,
                Err(AgentError::Overdue {
                    what: "its listing",
                    ..
                })
            ),
            "{listed:?}"
        );
        let limit = timeout + LIST_ALLOWANCE * (2 + LIST_SLACK as u32);
        assert!(
            took >= limit && took < limit + Duration::from_millis(250),
            "{took:?}"
        );
    }

    /// The moved allocations of a listing bound a copy-out; a lend is bounded by the
    /// lendable ones.
    #[test]
    fn a_lend_is_bounded_by_the_listing() {
        let (ours, theirs) = Channel::pair().unwrap();
        let s = AgentSession::over(HostPid(1), ours, Duration::from_secs(5));
        let agent = std::thread::spawn(move || {
            let (r, _) = theirs
                .recv_request::<AgentRequest>(Some(Duration::from_secs(5)))
                .unwrap();
            assert!(matches!(r, AgentRequest::ListAllocations));
            theirs.send_reply(&allocation(4, 1 << 30, 8192)).unwrap();
            theirs
                .send_reply(&Reply::Allocation {
                    id: 5,
                    device: 0,
                    addr: 1 << 30,
                    size: 8192,
                    kind: AllocKind::AppVmm,
                    rdma_capable: false,
                })
                .unwrap();
            theirs
                .send_reply(&Reply::AllocationsEnd { count: 2 })
                .unwrap();
            let (r, _) = theirs
                .recv_request::<AgentRequest>(Some(Duration::from_secs(5)))
                .unwrap();
            assert!(matches!(r, AgentRequest::Common(CommonRequest::LendBegin)));
            for id in 0..3 {
                let f = std::fs::File::open("/dev/null").unwrap();
                let lent = Reply::Lent {
                    id,
                    device: 0,
                    addr: 1 << 30,
                    size: 8192,
                    rdma_capable: false,
                };
                if theirs.send_reply_with(&lent, f.as_fd()).is_err() {
                    return;
                }
            }
        });
        let listed = s.list().unwrap();
        assert_eq!(listed.len(), 2);
        // The AppVmm one is not moved, and may overlap.
        assert_eq!(
            s.moved(),
            vec![Moved {
                id: 4,
                addr: 1 << 30,
                size: 8192
            }]
        );
        match s.lend() {
            Err(AgentError::TooMany { what, limit, .. }) => {
                assert_eq!((what, limit), ("lent allocations", 1));
            }
            other => panic!("{other:?}"),
        }
        drop(s);
        agent.join().unwrap();
    }
}
