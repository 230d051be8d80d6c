//! Moving device data between the agent and gpusnap's image files through the staging ring.
//!
//! Dump: the agent fills slots (device → host, several streams) and announces each with
//! `ChunkReady`; writer threads, one image file each (writes to one tmpfs file serialise on its
//! inode), checksum and write the slot and hand it back with `SlotFree`.
//! Restore: reader threads, one set of files each, verify and fill free slots and send
//! `ChunkLoad`; the agent copies host → device and hands slots back.
//!
//! Every thread here blocks all signals (CRIU's SIGALRM must reach its main thread) and is
//! joined before the function returns.

use crate::agent::{AgentError, AgentSession, Moved, RingShape, Session, Transfer};
use crate::staging::{RingError, Staging};
use crossbeam_channel::{Receiver, Sender, bounded, unbounded};
use gpusnap_host::pid::{HostPid, NsPid};
use gpusnap_image::{
    ChunkEntry, ChunkSources, Codec, DataFileWriter, DedupIndex, FileEntry, Manifest, hash_chunk,
};
use gpusnap_proto::{ProtoError, Reply, Request};
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long the data path waits for any progress from the agent before giving up.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub stall: Duration,
    pub streams: u32,
}

/// The slowest a data phase may move its bytes (16 MiB/s, far below any disk or network file
/// system an image goes to), for its overall deadline ([`phase_limit`]).
pub const FLOOR_RATE: u64 = 16 << 20;
/// What each chunk may add to a data phase's overall time, whatever its size (its messages and
/// its file write).
pub const PER_CHUNK: Duration = Duration::from_millis(1);

/// A data phase's overall time, counted from the agent's `Ready` (that wait is itself bounded
/// by the agent timeout):
///
/// `limit = agent_timeout + bytes / FLOOR_RATE + chunks × PER_CHUNK`
///
/// where a dump's `bytes` and `chunks` are those of the allocations the agent listed (their
/// slot-sized cut), and a restore's those of the manifest. The per-message timeout alone let a
/// job that answers just before each timeout hold CRIU, and its frozen tree, for ever
/// (issue 32, item 6).
pub fn phase_limit(timeout: Duration, bytes: u64, chunks: u64) -> Duration {
    let at_floor = Duration::from_secs_f64(bytes as f64 / FLOOR_RATE as f64);
    let per_chunk = PER_CHUNK.saturating_mul(u32::try_from(chunks).unwrap_or(u32::MAX));
    timeout.saturating_add(at_floor).saturating_add(per_chunk)
}

/// Which announcement of a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkKind {
    Ready,
    Zero,
    Unchanged,
}

impl std::fmt::Display for ChunkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ChunkKind::Ready => "ChunkReady",
            ChunkKind::Zero => "ChunkZero",
            ChunkKind::Unchanged => "ChunkUnchanged",
        })
    }
}

/// Why a chunk the agent announced is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChunkFault {
    #[error("an allocation it did not list for this transfer")]
    NotListed,
    #[error("which does not lie inside the allocation [{start:#x}, +{size})")]
    Outside { start: u64, size: u64 },
    #[error("which is not one of the allocation's {slot}-byte chunks")]
    NotTheCut { slot: u64 },
    #[error("a range it already announced")]
    Again,
    #[error("in slot {slot} of a ring of {slots}")]
    SlotOutOfRange { slot: u32, slots: u32 },
    #[error("past the {listed} bytes it listed")]
    OverBudget { listed: u64 },
}

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("image: {0}")]
    Image(#[from] gpusnap_image::ImageError),
    #[error("a writer thread panicked")]
    WriterPanicked,
    #[error("all writer threads stopped")]
    WritersGone,
    /// A data file's fsync failed (`durable = true`): not a reason to try another path.
    #[error("durable = true: {0}; the dump is refused, as its data may not be on the disk")]
    Sync(gpusnap_image::ImageError),
    #[error("creating the staging ring: {0}")]
    Ring(std::io::Error),
    #[error("{0} panicked")]
    Panicked(&'static str),
    /// A chunk outside what the agent listed (issue 32, item 5): the phase fails before
    /// anything of it is written.
    #[error(
        "pid {pid}: the agent announced {kind} [{addr:#x}, +{len}) of allocation #{id}, {fault}: refused"
    )]
    Chunk {
        pid: HostPid,
        kind: ChunkKind,
        id: u64,
        addr: u64,
        len: u64,
        fault: ChunkFault,
    },
    #[error(
        "pid {pid}: the agent handed back slot {slot}, which it does not hold (the ring has {slots}): refused"
    )]
    SlotNotLent {
        pid: HostPid,
        slot: u32,
        slots: usize,
    },
    /// The phase's overall deadline ([`phase_limit`]) passed.
    #[error(
        "pid {pid}: the agent did not finish moving {bytes} bytes in {chunks} chunks within {limit:?} (the agent timeout {timeout:?} + the bytes at 16 MiB/s + 1 ms a chunk): refused as hung"
    )]
    Overdue {
        pid: HostPid,
        bytes: u64,
        chunks: u64,
        timeout: Duration,
        limit: Duration,
    },
    #[error("pid {pid}: {err}")]
    RingChanged { pid: HostPid, err: RingError },
}

/// How a load checks the chunks it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadChecks {
    /// Every chunk against its stored checksum as it is read.
    Host,
    /// Raw chunks with a device hash are read without the host pass: the GPU checks them after
    /// loading, before any application thread runs. Should it check fewer than carry a device
    /// hash (its kernel could not run on this host), the whole image is checked on the host
    /// before the load counts as done, the process still stopped. Others as `Host`.
    GpuWhereHashed,
}

/// Most parent chunks announced to the agent (`KnownChunk`) in one dump: the agent's own limit.
const MAX_KNOWN_CHUNKS: usize = 1 << 20;

/// What a dump wrote.
#[derive(Debug, Default)]
pub struct DumpData {
    pub files: Vec<FileEntry>,
    pub chunks: Vec<ChunkEntry>,
    /// Device bytes of every chunk.
    pub bytes: u64,
    /// Bytes stored in this image's data files (`stored_len` of the chunks written here).
    pub stored_bytes: u64,
    /// Chunks, and their device bytes, left unchanged since the parent image and referenced
    /// there instead of written (incremental dump).
    pub referenced_chunks: u64,
    pub referenced_bytes: u64,
    /// Chunks, and their device bytes, the GPU found all zero: recorded, not copied.
    pub zero_chunks: u64,
    pub zero_bytes: u64,
    /// Chunks that carry a hash computed on the GPU.
    pub device_hashed: u64,
    /// Device bytes the agent copied off the GPU into the ring (`ChunkReady`): what the zero
    /// and unchanged chunks it found on the GPU did not spare.
    pub copied_bytes: u64,
    pub seconds: f64,
    /// The writer threads' time, summed over them: where the data phase's host side went.
    pub writers: WritersTime,
}

impl DumpData {
    /// What two data phases of one process wrote together (a hand-over's copy-first part and
    /// its drain, into files of their own).
    pub fn merged(self, other: DumpData) -> DumpData {
        let mut files = self.files;
        files.extend(other.files);
        files.sort_by(|a, b| a.name.cmp(&b.name));
        let mut chunks = self.chunks;
        chunks.extend(other.chunks);
        chunks.sort_by_key(|c| c.addr);
        let mut writers = self.writers;
        writers.threads += other.writers.threads;
        writers.hash_s += other.writers.hash_s;
        writers.write_s += other.writers.write_s;
        writers.wait_s += other.writers.wait_s;
        DumpData {
            files,
            chunks,
            bytes: self.bytes + other.bytes,
            stored_bytes: self.stored_bytes + other.stored_bytes,
            referenced_chunks: self.referenced_chunks + other.referenced_chunks,
            referenced_bytes: self.referenced_bytes + other.referenced_bytes,
            zero_chunks: self.zero_chunks + other.zero_chunks,
            zero_bytes: self.zero_bytes + other.zero_bytes,
            device_hashed: self.device_hashed + other.device_hashed,
            copied_bytes: self.copied_bytes + other.copied_bytes,
            seconds: self.seconds + other.seconds,
            writers,
        }
    }
}

/// Seconds the writer threads spent, summed over the threads: hashing on the host, writing
/// (`pwrite`, compression included) and waiting for the agent's next chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WritersTime {
    pub threads: usize,
    pub hash_s: f64,
    pub write_s: f64,
    pub wait_s: f64,
}

impl WritersTime {
    fn add(&mut self, t: gpusnap_image::WriterTimes, extra_hash: Duration, wait: Duration) {
        self.threads += 1;
        self.hash_s += (t.hash + extra_hash).as_secs_f64();
        self.write_s += t.write.as_secs_f64();
        self.wait_s += wait.as_secs_f64();
    }
}

/// Whose data a copy-out moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Round {
    /// A paused process's (`criu dump`): the agent's device hashes are of the bytes it sends.
    Paused,
    /// A running process's (a pre-copy round): its memory may change while it is copied, so
    /// the writers hash what they received, both ways (XXH3-128 for the next dump's host-side
    /// comparison and gpusnap-sum64 as the chunk's device hash, which that dump compares on
    /// the GPU).
    Live,
}

struct Work {
    slot: u32,
    addr: u64,
    len: u64,
    device_hash: Option<u64>,
}

/// What the agent may announce in one copy-out (issue 32, items 4 and 5): chunks of the
/// allocations it listed for it (or a keeper adopted), each exactly one of the slot-sized
/// pieces the agent cuts an allocation into (`cuda-backend/agent/src/plan.rs`), each once. So root keeps at
/// most one entry per listed chunk and writes at most the listed bytes, and anything else fails
/// the phase at once, naming the allocation and the range.
struct Admission {
    pid: HostPid,
    slot_size: u64,
    slots: u32,
    by_id: HashMap<u64, Moved>,
    /// (allocation id, chunk index) of every chunk announced so far.
    seen: HashSet<(u64, u64)>,
    listed_bytes: u64,
    listed_chunks: u64,
    admitted_bytes: u64,
}

impl Admission {
    fn new(pid: HostPid, moved: Vec<Moved>, slot_size: u64, slots: u32) -> Admission {
        let slot_size = slot_size.max(1);
        let listed_bytes = moved.iter().fold(0u64, |b, m| b.saturating_add(m.size));
        let listed_chunks = moved
            .iter()
            .fold(0u64, |c, m| c.saturating_add(m.size.div_ceil(slot_size)));
        Admission {
            pid,
            slot_size,
            slots,
            by_id: moved.into_iter().map(|m| (m.id, m)).collect(),
            seen: HashSet::new(),
            listed_bytes,
            listed_chunks,
            admitted_bytes: 0,
        }
    }

    /// Admits one announced chunk (`slot`: the ring slot a `ChunkReady` fills).
    fn admit(
        &mut self,
        kind: ChunkKind,
        slot: Option<u32>,
        id: u64,
        addr: u64,
        len: u64,
    ) -> Result<(), DataError> {
        let refuse = |fault| DataError::Chunk {
            pid: self.pid,
            kind,
            id,
            addr,
            len,
            fault,
        };
        if let Some(slot) = slot
            && slot >= self.slots
        {
            return Err(refuse(ChunkFault::SlotOutOfRange {
                slot,
                slots: self.slots,
            }));
        }
        let Some(a) = self.by_id.get(&id) else {
            return Err(refuse(ChunkFault::NotListed));
        };
        let inside = addr >= a.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= a.addr.saturating_add(a.size));
        if !inside {
            return Err(refuse(ChunkFault::Outside {
                start: a.addr,
                size: a.size,
            }));
        }
        let off = addr - a.addr;
        let cut = off.is_multiple_of(self.slot_size) && len == self.slot_size.min(a.size - off);
        if !cut {
            return Err(refuse(ChunkFault::NotTheCut {
                slot: self.slot_size,
            }));
        }
        if !self.seen.insert((id, off / self.slot_size)) {
            return Err(refuse(ChunkFault::Again));
        }
        // Implied by the above (disjoint pieces of listed allocations); kept as the promise.
        self.admitted_bytes += len;
        if self.admitted_bytes > self.listed_bytes {
            return Err(refuse(ChunkFault::OverBudget {
                listed: self.listed_bytes,
            }));
        }
        Ok(())
    }

    /// When the copy-out must be over, counted from now ([`phase_limit`]).
    fn deadline(&self, timeout: Duration) -> Deadline {
        Deadline::new(self.pid, timeout, self.listed_bytes, self.listed_chunks)
    }
}

/// A data phase's overall deadline ([`phase_limit`]).
#[derive(Clone, Copy, Debug)]
struct Deadline {
    pid: HostPid,
    at: Instant,
    timeout: Duration,
    limit: Duration,
    bytes: u64,
    chunks: u64,
}

impl Deadline {
    fn new(pid: HostPid, timeout: Duration, bytes: u64, chunks: u64) -> Deadline {
        let limit = phase_limit(timeout, bytes, chunks);
        Deadline {
            pid,
            at: Instant::now() + limit,
            timeout,
            limit,
            bytes,
            chunks,
        }
    }

    fn check(&self) -> Result<(), DataError> {
        if Instant::now() < self.at {
            return Ok(());
        }
        Err(DataError::Overdue {
            pid: self.pid,
            bytes: self.bytes,
            chunks: self.chunks,
            timeout: self.timeout,
            limit: self.limit,
        })
    }
}

/// How a transfer begins on its session, the ring's memfd and shape given: [`Session::begin`]
/// one way or the other, or a pre-copy round's [`AgentSession::begin_live`] (the job's agent's
/// alone, so only a copy-out on an [`AgentSession`] may be one).
type Begin<R> = fn(&Session<R>, BorrowedFd<'_>, RingShape) -> Result<(), AgentError>;

/// Tells the agent about the ring (its memfd attached) with `begin` and waits until it is
/// mapped and pinned. The ring is checked as we made it (size and seals) before and after: the
/// job holds it from here on.
fn hand_over_ring<R: Request>(
    agent: &Session<R>,
    staging: &Staging,
    limits: Limits,
    begin: Begin<R>,
) -> Result<(), DataError> {
    let intact = || {
        staging
            .check_intact()
            .map_err(|err| DataError::RingChanged {
                pid: agent.pid(),
                err,
            })
    };
    intact()?;
    let shape = RingShape {
        slot_size: staging.slot_size() as u64,
        slots: staging.slots() as u32,
        streams: limits.streams,
    };
    begin(agent, staging.fd().as_fd(), shape)?;
    intact()
}

/// Copies every converted allocation of the agent into image files `gpusnap-<nspid>-data-*`.
/// With `parent` (an incremental dump), a chunk whose device range and device hash match a
/// chunk of the parent chain is not even copied off the GPU (the agent compares the hashes
/// there) and is recorded as a reference to it; a chunk without device hashes on either side
/// is copied and compared by XXH3-128 as before. With `durable`, each writer fsyncs its file when it
/// is done. On success the agent holds its data in the ring no more; memory is not yet released.
#[allow(clippy::too_many_arguments)]
pub fn copy_out(
    agent: &AgentSession,
    staging: &Staging,
    dir: BorrowedFd<'_>,
    nspid: NsPid,
    writers: usize,
    codec: Codec,
    parent: Option<&DedupIndex>,
    limits: Limits,
    durable: bool,
    round: Round,
) -> Result<DumpData, DataError> {
    let first_file = 0;
    let begin: Begin<_> = match round {
        Round::Paused => |a, fd, shape| a.begin(Transfer::Out, fd, shape),
        Round::Live => AgentSession::begin_live,
    };
    copy_out_round(
        agent,
        staging,
        dir,
        nspid,
        first_file,
        writers,
        codec,
        parent,
        limits,
        durable,
        (round, begin),
        None,
    )
}

/// [`copy_out`] of a paused process's memory on any session (a keeper's: a hand-over's drain),
/// into data files numbered from `first_file` on (after a copy-first part of the same process,
/// which took the numbers below it).
#[allow(clippy::too_many_arguments)]
pub fn copy_out_into<R: Request>(
    agent: &Session<R>,
    staging: &Staging,
    dir: BorrowedFd<'_>,
    nspid: NsPid,
    first_file: u32,
    writers: usize,
    codec: Codec,
    parent: Option<&DedupIndex>,
    limits: Limits,
    durable: bool,
    reserved: Option<&gpusnap_image::Reservation>,
) -> Result<DumpData, DataError> {
    let begin: Begin<R> = |a, fd, shape| a.begin(Transfer::Out, fd, shape);
    copy_out_round(
        agent,
        staging,
        dir,
        nspid,
        first_file,
        writers,
        codec,
        parent,
        limits,
        durable,
        (Round::Paused, begin),
        reserved,
    )
}

/// The copy-out of [`copy_out`] and [`copy_out_into`]: `round`, begun on the session with
/// `begin`.
#[allow(clippy::too_many_arguments)]
fn copy_out_round<R: Request>(
    agent: &Session<R>,
    staging: &Staging,
    dir: BorrowedFd<'_>,
    nspid: NsPid,
    first_file: u32,
    writers: usize,
    codec: Codec,
    parent: Option<&DedupIndex>,
    limits: Limits,
    durable: bool,
    (round, begin): (Round, Begin<R>),
    reserved: Option<&gpusnap_image::Reservation>,
) -> Result<DumpData, DataError> {
    let t0 = Instant::now();
    // The parent's chunks with device hashes: the agent compares them on the GPU and does not
    // copy what is unchanged.
    if let Some(p) = parent {
        // At most what the agent takes on one connection; the rest are copied, and stored again
        // unless the parent holds them with an XXH3 hash to compare on the host.
        for (addr, len, hash) in p.device_hashes().into_iter().take(MAX_KNOWN_CHUNKS) {
            agent.known_chunk(addr, len, hash)?;
        }
    }
    let mut admission = Admission::new(
        agent.pid(),
        agent.moved(),
        staging.slot_size() as u64,
        staging.slots() as u32,
    );
    hand_over_ring(agent, staging, limits, begin)?;
    let deadline = admission.deadline(limits.stall);

    let (work_tx, work_rx) = bounded::<Work>(staging.slots());
    let (err_tx, err_rx) = unbounded::<DataError>();
    let writers = writers.max(1);
    let result = std::thread::scope(|s| {
        let handles: Vec<_> = (0..writers)
            .map(|index| {
                let rx = work_rx.clone();
                let err_tx = err_tx.clone();
                let out = Out {
                    dir,
                    nspid,
                    codec,
                    parent,
                    durable,
                    round,
                    reserved,
                };
                let index = first_file.saturating_add(index as u32);
                s.spawn(move || writer(index, rx, err_tx, agent, staging, out))
            })
            .collect();
        drop(work_rx);
        let mut data = DumpData::default();
        let outcome = pump_dump_replies(
            agent,
            &work_tx,
            &err_rx,
            Bounds {
                stall: limits.stall,
                deadline,
                admission: &mut admission,
            },
            parent,
            &mut data.chunks,
            &mut data.copied_bytes,
        );
        drop(work_tx);
        let mut files = Vec::new();
        for h in handles {
            match h.join() {
                Ok(Some(w)) => {
                    files.extend(w.file);
                    data.chunks.extend(w.chunks);
                    data.writers.add(w.times, w.hash_outside, w.waited);
                }
                Ok(None) => {}
                Err(_) => return Err(DataError::WriterPanicked),
            }
        }
        outcome?;
        if let Ok(e) = err_rx.try_recv() {
            return Err(e);
        }
        data.files = finish_files(dir, files)?;
        Ok(data)
    });
    let mut data = match result {
        Ok(d) => d,
        Err(e) => {
            if !agent.abort() {
                // The agent did not confirm: it may still have the ring mapped.
                staging.discard();
            }
            return Err(e);
        }
    };
    data.files.sort_by(|a, b| a.name.cmp(&b.name));
    data.chunks.sort_by_key(|c| c.addr);
    data.bytes = data.chunks.iter().map(|c| c.len).sum();
    data.zero_chunks = data.chunks.iter().filter(|c| !c.is_stored()).count() as u64;
    data.zero_bytes = data
        .chunks
        .iter()
        .filter(|c| !c.is_stored())
        .map(|c| c.len)
        .sum();
    data.device_hashed = data
        .chunks
        .iter()
        .filter(|c| c.device_hash.is_some())
        .count() as u64;
    let (refs, own): (Vec<&ChunkEntry>, Vec<&ChunkEntry>) =
        data.chunks.iter().partition(|c| c.is_reference());
    data.stored_bytes = own.iter().map(|c| c.stored_len).sum();
    data.referenced_chunks = refs.len() as u64;
    data.referenced_bytes = refs.iter().map(|c| c.len).sum();
    data.seconds = t0.elapsed().as_secs_f64();
    Ok(data)
}

/// What bounds a dump's replies: the stall (time without any message), the overall deadline,
/// and the chunks the agent may announce.
struct Bounds<'a> {
    stall: Duration,
    deadline: Deadline,
    admission: &'a mut Admission,
}

/// Main-thread side of a dump: route `ChunkReady` to writers until `DumpDataDone`; record each
/// `ChunkZero` and `ChunkUnchanged` (nothing to write) in `unwritten`. Every announcement is
/// admitted first ([`Admission`]), and the whole ends by the deadline.
fn pump_dump_replies<R: Request>(
    agent: &Session<R>,
    work: &Sender<Work>,
    errors: &Receiver<DataError>,
    bounds: Bounds<'_>,
    parent: Option<&DedupIndex>,
    unwritten: &mut Vec<ChunkEntry>,
    copied: &mut u64,
) -> Result<(), DataError> {
    let Bounds {
        stall,
        deadline,
        admission,
    } = bounds;
    let mut last = Instant::now();
    // The second announcement means the first chunk was handed to a writer (a point for a
    // test to kill CRIU at).
    let mut sent = 0u64;
    loop {
        if let Ok(e) = errors.try_recv() {
            return Err(e);
        }
        deadline.check()?;
        match agent.recv(Duration::from_millis(200)) {
            Ok(Reply::ChunkReady {
                slot,
                alloc_id,
                addr,
                len,
                device_hash,
            }) => {
                last = Instant::now();
                admission.admit(ChunkKind::Ready, Some(slot), alloc_id, addr, len)?;
                if sent == 1 {
                    gpusnap_host::fault::kill_criu_at("dump-data-out");
                }
                sent += 1;
                *copied += len;
                let w = Work {
                    slot,
                    addr,
                    len,
                    device_hash,
                };
                if work.send(w).is_err() {
                    return Err(DataError::WritersGone);
                }
            }
            Ok(Reply::ChunkZero {
                alloc_id,
                addr,
                len,
                device_hash,
            }) => {
                last = Instant::now();
                admission.admit(ChunkKind::Zero, None, alloc_id, addr, len)?;
                unwritten.push(ChunkEntry::zero(addr, len, device_hash));
            }
            Ok(Reply::ChunkUnchanged {
                alloc_id,
                addr,
                len,
                device_hash,
            }) => {
                last = Instant::now();
                admission.admit(ChunkKind::Unchanged, None, alloc_id, addr, len)?;
                let r = parent.and_then(|p| p.reference_by_device_hash(addr, len, device_hash));
                match r {
                    Some(r) => unwritten.push(r),
                    None => {
                        return Err(AgentError::Unexpected {
                            pid: agent.pid(),
                            expected: "ChunkReady (no parent chunk of that range and hash)",
                            got: format!("ChunkUnchanged at {addr:#x}, {len} bytes"),
                        }
                        .into());
                    }
                }
            }
            Ok(Reply::DumpDataDone { .. }) => return Ok(()),
            Ok(other) => return Err(unexpected(agent, "ChunkReady", other)),
            Err(e) => waiting(agent, e, last, stall)?,
        }
    }
}

/// Where a writer thread puts chunks.
#[derive(Clone, Copy)]
struct Out<'a> {
    dir: BorrowedFd<'a>,
    nspid: NsPid,
    codec: Codec,
    parent: Option<&'a DedupIndex>,
    /// fsync each file when it is finished.
    durable: bool,
    round: Round,
    /// Space held for this copy (a drain's): each writer's data file is written into a piece
    /// of it, and named once every writer is done ([`finish_files`]).
    reserved: Option<&'a gpusnap_image::Reservation>,
}

/// What one writer thread made: its file, not yet ended (created with the first chunk it
/// writes; a thread whose chunks were all references leaves none), every chunk entry it made,
/// references included, and where its time went.
struct Written {
    file: Option<DataFileWriter>,
    chunks: Vec<ChunkEntry>,
    times: gpusnap_image::WriterTimes,
    /// Hashing done before the file writer saw the chunk (incremental or compressed dumps).
    hash_outside: Duration,
    waited: Duration,
}

/// One writer thread.
fn writer<R: Request>(
    index: u32,
    work: Receiver<Work>,
    errors: Sender<DataError>,
    agent: &Session<R>,
    staging: &Staging,
    out: Out<'_>,
) -> Option<Written> {
    gpusnap_host::signals::block_all();
    let mut file: Option<DataFileWriter> = None;
    let mut chunks = Vec::new();
    let mut failed = false;
    let (mut waited, mut hash_outside) = (Duration::ZERO, Duration::ZERO);
    let mut idle_since = Instant::now();
    for w in work.iter() {
        waited += idle_since.elapsed();
        if !failed {
            let res = (|| {
                // SAFETY: the agent announced this slot with ChunkReady and will not touch it
                // until we send SlotFree below.
                let data = unsafe { staging.slot(w.slot as usize, w.len as usize) };
                // An incremental dump must hash a chunk before it knows whether to write it; a
                // full dump of raw chunks hashes each piece as it writes it (one memory pass less).
                let t0 = Instant::now();
                // A raw chunk of a paused process with a device hash needs no host hash at all
                // (`raw_sum64`), unless a parent chunk without one could match it on the host.
                let host_compare = out
                    .parent
                    .is_some_and(|p| p.wants_host_compare(w.addr, w.len));
                let sum64_only = out.round == Round::Paused
                    && out.codec == Codec::Raw
                    && w.device_hash.is_some()
                    && !host_compare;
                let hashes = match (out.parent, out.codec, out.round) {
                    _ if sum64_only => None,
                    (None, Codec::Raw, Round::Paused) => None,
                    _ => Some(hash_chunk(data)),
                };
                let device_hash = match out.round {
                    Round::Paused => w.device_hash,
                    Round::Live => gpusnap_proto::devhash::device_hash(data),
                };
                hash_outside += t0.elapsed();
                if let (Some(p), Some(h)) = (out.parent, &hashes)
                    && let Some(r) = p.reference(w.addr, w.len, h)
                {
                    return Ok(r);
                }
                if file.is_none() {
                    // Into the space held for the drain, where there is some: the file's
                    // writes stay inside it, and it is named only once whole.
                    let mut f = match out.reserved {
                        Some(r) => DataFileWriter::create_in(r, out.nspid, index),
                        None => DataFileWriter::create(out.dir, out.nspid, index),
                    }
                    .map_err(DataError::from)?;
                    f.set_sync(out.durable);
                    file = Some(f);
                }
                let f = file.as_mut().expect("created above");
                let entry = match (hashes, device_hash) {
                    (None, Some(d)) if sum64_only => f.append_raw_sum64(w.addr, data, d),
                    (None, _) => f.append_raw(w.addr, data).map(|(entry, _)| entry),
                    (Some(h), _) => f.append_chunk_hashed(w.addr, data, out.codec, &h),
                };
                entry
                    .map(|e| ChunkEntry { device_hash, ..e })
                    .map_err(DataError::from)
            })();
            match res {
                Ok(entry) => chunks.push(entry),
                Err(e) => {
                    failed = true;
                    let _ = errors.send(e);
                }
            }
        }
        // Free the slot even after a failure, so the agent is never left waiting.
        let _ = agent.slot_free(w.slot);
        idle_since = Instant::now();
    }
    if failed {
        return None;
    }
    let times = file.as_ref().map(DataFileWriter::times).unwrap_or_default();
    Some(Written {
        file,
        chunks,
        times,
        hash_outside,
        waited,
    })
}

/// Ends the writers' files once every writer is done and the copy succeeded: each is sealed
/// (a file written into held space cut to its bytes, which frees the rest of its piece; with
/// `durable`, each fsynced), on threads of their own where there are several, and only then
/// are they named, so that a copy that fails leaves none of its held files named. A failed
/// fsync is [`DataError::Sync`]; should a name fail, the names given before it are removed.
fn finish_files(
    dir: BorrowedFd<'_>,
    files: Vec<DataFileWriter>,
) -> Result<Vec<FileEntry>, DataError> {
    let seal = |f: DataFileWriter| {
        f.seal().map_err(|e| match e {
            e @ gpusnap_image::ImageError::Io {
                op: gpusnap_image::IoOp::Fsync,
                ..
            } => DataError::Sync(e),
            e => DataError::Image(e),
        })
    };
    let sealed: Vec<Result<gpusnap_image::SealedDataFile, DataError>> = if files.len() > 1 {
        std::thread::scope(|s| {
            let handles: Vec<_> = files
                .into_iter()
                .map(|f| {
                    s.spawn(move || {
                        gpusnap_host::signals::block_all();
                        seal(f)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(Err(DataError::WriterPanicked)))
                .collect()
        })
    } else {
        files.into_iter().map(seal).collect()
    };
    let sealed = sealed.into_iter().collect::<Result<Vec<_>, DataError>>()?;
    let mut entries: Vec<FileEntry> = Vec::with_capacity(sealed.len());
    for f in sealed {
        match f.publish() {
            Ok(e) => entries.push(e),
            Err(err) => {
                for e in &entries {
                    let _ = gpusnap_image::remove_data_file(dir, &e.name);
                }
                return Err(err.into());
            }
        }
    }
    Ok(entries)
}

/// A wait for the agent's next message ended without one: fine while it shows progress within
/// `stall`, else the agent counts as hung.
fn waiting<R: Request>(
    agent: &Session<R>,
    e: AgentError,
    last: Instant,
    stall: Duration,
) -> Result<(), DataError> {
    match e {
        AgentError::Proto {
            err: ProtoError::Timeout | ProtoError::Interrupted,
            ..
        } if last.elapsed() <= stall => Ok(()),
        AgentError::Proto {
            err: ProtoError::Timeout | ProtoError::Interrupted,
            ..
        } => Err(AgentError::Stalled {
            pid: agent.pid(),
            stall,
        }
        .into()),
        e => Err(e.into()),
    }
}

fn unexpected<R: Request>(agent: &Session<R>, expected: &'static str, got: Reply) -> DataError {
    AgentError::Unexpected {
        pid: agent.pid(),
        expected,
        got: format!("{got:?}"),
    }
    .into()
}

/// What a load moved.
#[derive(Debug, Default)]
pub struct LoadStats {
    pub bytes: u64,
    /// Chunks filled with zeros on the device, and their bytes.
    pub zero_chunks: u64,
    pub zero_bytes: u64,
    /// Chunks whose device hash the agent checked on the GPU after loading.
    pub verified_on_device: u64,
    /// Chunks sent with a device hash (what the agent was asked to check).
    pub device_hashed: u64,
    pub seconds: f64,
}

/// Re-creates the agent's memory at the recorded addresses and fills it from the image (and,
/// for chunks an incremental dump referenced, from its ancestors through `parent` links; they
/// are opened and checked before the agent is asked to re-create anything).
#[allow(clippy::too_many_arguments)]
pub fn copy_in<R: Request>(
    agent: &Session<R>,
    staging: &Staging,
    dir: BorrowedFd<'_>,
    manifest: &Manifest,
    readers: usize,
    limits: Limits,
    fault_point: &'static str,
    checks: ReadChecks,
) -> Result<LoadStats, DataError> {
    let t0 = Instant::now();
    let sources = ChunkSources::open(dir, manifest)?;
    hand_over_ring(agent, staging, limits, |a, fd, shape| {
        a.begin(Transfer::In, fd, shape)
    })?;
    let bytes = manifest
        .chunks
        .iter()
        .fold(0u64, |b, c| b.saturating_add(c.len));
    let deadline = Deadline::new(
        agent.pid(),
        limits.stall,
        bytes,
        manifest.chunks.len() as u64,
    );
    // Which slots the agent holds (between our ChunkLoad and its SlotFree): a SlotFree of
    // another is refused, so that a reader never fills a slot the agent is copying from.
    let lent: Vec<AtomicBool> = (0..staging.slots())
        .map(|_| AtomicBool::new(false))
        .collect();

    let (free_tx, free_rx) = bounded::<u32>(staging.slots());
    for i in 0..staging.slots() as u32 {
        let _ = free_tx.send(i);
    }
    let (err_tx, err_rx) = unbounded::<DataError>();
    let files = file_groups(manifest);
    let readers = readers.clamp(1, files.len().max(1));
    // Zero chunks use no slot: the agent fills them on the device, before any load is queued.
    let zeros: Vec<&ChunkEntry> = manifest.chunks.iter().filter(|c| !c.is_stored()).collect();
    for c in &zeros {
        agent.chunk_zero(c.addr, c.len, c.device_hash)?;
    }
    let total = manifest.chunks.len() - zeros.len();
    let outcome = std::thread::scope(|s| {
        for r in 0..readers {
            let free_rx = free_rx.clone();
            let err_tx = err_tx.clone();
            let (files, sources, lent) = (&files, &sources, &lent);
            s.spawn(move || {
                gpusnap_host::signals::block_all();
                let mine = files.iter().copied().skip(r).step_by(readers);
                let ring = LoadRing { staging, lent };
                if let Err(e) = read_files(mine, &free_rx, agent, ring, sources, checks) {
                    let _ = err_tx.send(e);
                }
            });
        }
        drop(free_rx);
        let res = pump_load_replies(
            agent,
            &free_tx,
            &err_rx,
            total,
            (limits.stall, deadline),
            fault_point,
            &lent,
        );
        // Unblock readers waiting for a slot, whatever happened.
        drop(free_tx);
        res
    });
    outcome?;
    if let Ok(e) = err_rx.try_recv() {
        return Err(e);
    }
    let pid = agent.pid();
    let (bytes, verified_on_device) = agent.finish_restore()?;
    let device_hashed = manifest
        .chunks
        .iter()
        .filter(|c| c.device_hash.is_some())
        .count() as u64;
    if checks == ReadChecks::GpuWhereHashed && verified_on_device < device_hashed {
        // Some chunks went unchecked on both sides: check what the files hold now, on the
        // host (the loaded bytes came from them), before any thread may run.
        let t1 = Instant::now();
        gpusnap_host::fault::kill_criu_at("restore-host-check");
        gpusnap_image::verify_image(dir, manifest, readers)?;
        log::warn!(
            "pid {pid}: the GPU checked only {verified_on_device} of the {device_hashed} chunks with device hashes after loading (its kernel could not run here); the image was checked on the host instead, in {:.3} s",
            t1.elapsed().as_secs_f64()
        );
    }
    Ok(LoadStats {
        bytes,
        zero_chunks: zeros.len() as u64,
        zero_bytes: zeros.iter().map(|c| c.len).sum(),
        verified_on_device,
        device_hashed,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// The data files that hold chunks, as (parent depth, index): 0 for this image's own, `d` for
/// a file of the image `d` `parent` links up. Writers that got no chunk wrote no file, so the
/// indexes can have gaps (`data-0`, `data-2`, ...): they are not `0..files.len()`.
fn file_groups(manifest: &Manifest) -> Vec<(u32, u32)> {
    let mut v: Vec<(u32, u32)> = manifest
        .chunks
        .iter()
        .filter(|c| c.is_stored())
        .map(|c| (c.parent_depth, c.file))
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The ring of a load, with which of its slots the agent holds.
#[derive(Clone, Copy)]
struct LoadRing<'a> {
    staging: &'a Staging,
    lent: &'a [AtomicBool],
}

fn read_files<R: Request>(
    files: impl Iterator<Item = (u32, u32)>,
    free: &Receiver<u32>,
    agent: &Session<R>,
    ring: LoadRing<'_>,
    sources: &ChunkSources<'_>,
    checks: ReadChecks,
) -> Result<(), DataError> {
    let LoadRing { staging, lent } = ring;
    let mut scratch = Vec::new();
    for (depth, file) in files {
        let reader = sources.reader(depth, file)?;
        for (_, c) in sources.chunks(depth, file) {
            let Ok(slot) = free.recv() else {
                return Ok(()); // the load was abandoned
            };
            // SAFETY: the slot came from the free list: the agent is done with it and no
            // other reader holds it.
            let out = unsafe { staging.slot_mut(slot as usize, c.len as usize) };
            match checks {
                ReadChecks::Host => reader.read_chunk(c, out, &mut scratch)?,
                ReadChecks::GpuWhereHashed => {
                    reader.read_chunk_for_device_check(c, out, &mut scratch)?
                }
            }
            // Lent before the agent can hand it back.
            lent[slot as usize].store(true, Ordering::SeqCst);
            agent.chunk_load(slot, c.addr, c.len, c.device_hash)?;
        }
    }
    Ok(())
}

/// Main-thread side of a load: every `SlotFree` (of a slot the agent holds) goes back to the
/// readers until all `total` chunks are loaded, by the deadline.
fn pump_load_replies<R: Request>(
    agent: &Session<R>,
    free: &Sender<u32>,
    errors: &Receiver<DataError>,
    total: usize,
    (stall, deadline): (Duration, Deadline),
    fault_point: &'static str,
    lent: &[AtomicBool],
) -> Result<(), DataError> {
    let mut done = 0;
    let mut last = Instant::now();
    while done < total {
        if let Ok(e) = errors.try_recv() {
            return Err(e);
        }
        deadline.check()?;
        match agent.recv(Duration::from_millis(200)) {
            Ok(Reply::SlotFree { slot }) => {
                let held = lent
                    .get(slot as usize)
                    .is_some_and(|l| l.swap(false, Ordering::SeqCst));
                if !held {
                    return Err(DataError::SlotNotLent {
                        pid: agent.pid(),
                        slot,
                        slots: lent.len(),
                    });
                }
                done += 1;
                if done == 1 {
                    gpusnap_host::fault::kill_criu_at(fault_point);
                }
                last = Instant::now();
                let _ = free.send(slot);
            }
            Ok(other) => return Err(unexpected(agent, "SlotFree", other)),
            Err(e) => waiting(agent, e, last, stall)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(file: u32, addr: u64) -> ChunkEntry {
        ChunkEntry {
            file,
            file_offset: 64,
            addr,
            len: 4096,
            stored_len: 4096,
            codec: Codec::Raw,
            checksum: 0,
            content_xxh128: None,
            parent_depth: 0,
            device_hash: None,
        }
    }

    #[test]
    fn file_indexes_follow_the_chunks_not_the_file_count() {
        // Regression: with 9 of 16 writers busy, files 0..9 were assumed and data-0 was missing.
        let m = Manifest {
            chunks: vec![
                chunk(5, 0),
                chunk(2, 4096),
                chunk(5, 8192),
                chunk(11, 12288),
                ChunkEntry {
                    parent_depth: 2,
                    ..chunk(5, 16384)
                },
            ],
            ..crate::test_manifest()
        };
        assert_eq!(file_groups(&m), vec![(0, 2), (0, 5), (0, 11), (2, 5)]);
    }

    fn fault(r: Result<(), DataError>) -> Option<ChunkFault> {
        match r {
            Ok(()) => None,
            Err(DataError::Chunk { fault, .. }) => Some(fault),
            Err(e) => panic!("{e}"),
        }
    }

    /// Issue 32, items 4 and 5: only the slot-sized cut of a listed allocation, each piece
    /// once, in a slot of the ring.
    #[test]
    fn only_the_listed_chunks_are_admitted_once() {
        let a = Moved {
            id: 7,
            addr: 1 << 30,
            size: 10 * 4096 + 100,
        };
        let slot = 4 * 4096;
        let mut adm = Admission::new(HostPid(1), vec![a], slot, 2);
        assert_eq!((adm.listed_chunks, adm.listed_bytes), (3, a.size));
        let base = a.addr;
        use ChunkKind::*;
        assert_eq!(fault(adm.admit(Ready, Some(0), 7, base, slot)), None);
        assert_eq!(
            fault(adm.admit(Zero, None, 7, base, slot)),
            Some(ChunkFault::Again)
        );
        assert_eq!(
            fault(adm.admit(Ready, Some(2), 7, base + slot, slot)),
            Some(ChunkFault::SlotOutOfRange { slot: 2, slots: 2 })
        );
        assert_eq!(
            fault(adm.admit(Zero, None, 8, base + slot, slot)),
            Some(ChunkFault::NotListed)
        );
        assert_eq!(
            fault(adm.admit(Zero, None, 7, base + 4096, slot)),
            Some(ChunkFault::NotTheCut { slot })
        );
        assert_eq!(
            fault(adm.admit(Zero, None, 7, base + slot, 4096)),
            Some(ChunkFault::NotTheCut { slot })
        );
        assert_eq!(
            fault(adm.admit(Unchanged, None, 7, base - 4096, 4096)),
            Some(ChunkFault::Outside {
                start: a.addr,
                size: a.size
            })
        );
        assert_eq!(
            fault(adm.admit(Ready, Some(1), 7, base + 2 * slot, slot)),
            Some(ChunkFault::Outside {
                start: a.addr,
                size: a.size
            })
        );
        assert_eq!(fault(adm.admit(Zero, None, 7, base + slot, slot)), None);
        let last = a.size - 2 * slot;
        assert_eq!(
            fault(adm.admit(Unchanged, None, 7, base + 2 * slot, last)),
            None
        );
        assert_eq!(adm.admitted_bytes, a.size);
        // Nothing listed: nothing admitted.
        let mut none = Admission::new(HostPid(1), Vec::new(), slot, 2);
        assert_eq!(
            fault(none.admit(Zero, None, 7, base, slot)),
            Some(ChunkFault::NotListed)
        );
    }

    /// Issue 32, item 6: the formula.
    #[test]
    fn a_phase_limit_grows_with_what_it_moves() {
        let t = Duration::from_secs(30);
        assert_eq!(phase_limit(t, 0, 0), t);
        assert_eq!(
            phase_limit(t, 16 << 20, 1000),
            t + Duration::from_secs(1) + Duration::from_secs(1)
        );
        assert_eq!(
            phase_limit(Duration::from_secs(1), 8 << 30, 256),
            Duration::from_secs(1 + 512) + Duration::from_millis(256)
        );
        // Never overflows.
        assert!(phase_limit(t, u64::MAX, u64::MAX) > t);
    }
}
