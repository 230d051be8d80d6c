//! `DumpBegin` .. `Release`: copy every converted allocation out through the staging ring,
//! then, on `Release`, unmap and release the physical memory (address reservations kept).
//!
//! Copy-out loop: chunk k goes into a free slot on stream k % streams and the slot's event is
//! recorded; as many copies are in flight as there are free slots; the oldest copy is waited
//! for and announced (`ChunkReady`); `SlotFree` messages are drained between steps; the agent
//! blocks on the socket (at most [`PEER_WAIT`]) only when no slot is free and nothing is in
//! flight.

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::time::Instant;

use gpusnap_proto::{Channel, CommonRequest, ProtoError, Reply, Request};

use crate::devhash::{self, ChunkHash};
use crate::gpu::Gpu;
use crate::log::debug;
use crate::plan::{self, Chunk, Span};
use crate::real::Driver;
use crate::session::{self, Fail, PEER_WAIT, Ring, need_driver, no_fd};
use crate::staging::Staging;
use crate::table::{self, AGENT_LOCK_WAIT, LiveState, TableError};
use cudarc::driver::sys::CUmemGenericAllocationHandle as Handle;

/// How long a pre-copy round waits for an application handle, unmapped where it was, to be
/// mapped there again (allocators unmap and map their handles) before giving up.
const REMAP_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// The parent image's chunks a connection announced before its `DumpBegin`: (address,
/// length) → device hash. Bounded, as every input from the socket is.
#[derive(Default)]
pub struct KnownChunks(HashMap<(u64, u64), u64>);

/// Most `KnownChunk`s one connection may send (a million chunks: 32 TiB at 32 MiB).
const MAX_KNOWN: usize = 1 << 20;

/// A connection sent more `KnownChunk`s than [`MAX_KNOWN`]: the list is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooManyKnownChunks;

impl std::fmt::Display for TooManyKnownChunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "more than {MAX_KNOWN} KnownChunk requests")
    }
}

impl std::error::Error for TooManyKnownChunks {}

impl KnownChunks {
    pub fn insert(
        &mut self,
        addr: u64,
        len: u64,
        device_hash: u64,
    ) -> Result<(), TooManyKnownChunks> {
        // The same chunk again (a keeper's second drain, told the parent's chunks once more)
        // takes no more room.
        if self.0.len() >= MAX_KNOWN && !self.0.contains_key(&(addr, len)) {
            return Err(TooManyKnownChunks);
        }
        self.0.insert((addr, len), device_hash);
        Ok(())
    }

    /// Whether the parent holds exactly this chunk (same range, same device hash).
    fn unchanged(&self, c: &Chunk, h: &ChunkHash) -> bool {
        self.0.get(&(c.addr, c.len)) == Some(&h.hash)
    }
}

/// What the application does while data is copied out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `DumpBegin`: its threads are stopped (CRIU holds them), so nothing changes the table or
    /// the memory. Copies are pipelined over the ring's slots and streams, chunks announced
    /// with their device hashes, and `Release` (or `Abort`) follows.
    Stopped,
    /// `PreCopyBegin`: it runs on. The table lock is held while the GPU hashes and while each
    /// chunk is copied, so no allocation is freed or unmapped under a copy (the application's
    /// allocation calls wait for at most the hash kernels or one chunk's copy, both waited for
    /// on the agent's own stream); a copied chunk is announced without a device hash, and the
    /// round ends with `DumpDataDone`.
    Live,
}

/// Unmaps the process's CUDA IPC imports (reservations kept) at a release: (imports, bytes).
/// It makes the contexts it needs current on the agent's thread (`Gpu`).
pub type ImportRelease = fn(&Driver, &mut Gpu) -> Result<(u32, u64), Fail>;

/// What a `Release` does besides unmapping the converted allocations, passed in by the layers
/// above (which this one does not import).
#[derive(Clone, Copy)]
pub struct ReleaseAlso {
    /// Told of each allocation a `Release` unmaps: `own_fds::forget_released`.
    pub released: fn(u64, Handle),
    pub imports: ImportRelease,
}

/// A process with no imports to unmap (the keeper).
pub fn no_imports(_: &Driver, _: &mut Gpu) -> Result<(u32, u64), Fail> {
    Ok((0, 0))
}

/// Runs a whole dump or pre-copy round on this connection, whose requests are `R` (the job's
/// agent's or the keeper's); the connection is to be closed afterwards; `also` is what a
/// `Release` does besides (see `release`).
#[allow(clippy::too_many_arguments)]
pub fn run<R: Request>(
    gpu: &mut Gpu,
    ch: &Channel,
    ring: Ring,
    memfd: OwnedFd,
    known: &KnownChunks,
    mode: Mode,
    also: ReleaseAlso,
) {
    let mut staging = None;
    let result = dump::<R>(gpu, ch, ring, memfd, &mut staging, known, mode, also);
    session::conclude(ch, gpu, staging, result);
}

/// The spans to copy; refuses when a dump released memory that no restore brought back.
fn spans_to_copy(t: &table::Table) -> Result<Vec<Span>, Fail> {
    let (spans, released) = session::spans_of(t);
    if let Some(i) = released.iter().position(|&r| r) {
        return Err(Fail::bad_state(format!(
            "allocation #{} at {:#x} is released: restore before dumping again",
            spans[i].id, spans[i].addr
        )));
    }
    Ok(spans)
}

#[allow(clippy::too_many_arguments)]
fn dump<R: Request>(
    gpu: &mut Gpu,
    ch: &Channel,
    ring: Ring,
    memfd: OwnedFd,
    staging: &mut Option<Staging>,
    known: &KnownChunks,
    mode: Mode,
    also: ReleaseAlso,
) -> Result<Reply, Fail> {
    let none = std::collections::HashSet::new();
    let (spans, done) = copy_phase::<R>(gpu, ch, ring, memfd, staging, known, mode, &none)?;
    if mode == Mode::Live {
        // The round is over; `conclude` sends this once the ring is let go.
        return Ok(done);
    }
    ch.send_reply(&done)?;

    const PHASE: &str = "after DumpDataDone (Release, Abort, or a keeper's copy again)";
    loop {
        let (req, fd) = ch.recv_request::<R>(None)?;
        match (session::common(req, PHASE)?, fd) {
            (CommonRequest::Release, None) => {
                crate::held::by_a_tracer().map_err(Fail::bad_state)?;
                break;
            }
            (CommonRequest::Abort, None) => return Err(Fail::Aborted),
            // A keeper's drain whose parent image was found damaged after the copy compared
            // against it: everything again, compared with nothing, from the memory still held.
            (
                CommonRequest::DumpBegin {
                    slot_size,
                    slots,
                    streams,
                },
                Some(memfd),
            ) if crate::role::keeper() => {
                if let Some(st) = staging.take() {
                    gpu.quiesce(need_driver()?);
                    st.close()?;
                }
                let ring = Ring {
                    slot_size,
                    slots,
                    streams,
                };
                let nothing = KnownChunks::default();
                let (_, done) =
                    copy_phase::<R>(gpu, ch, ring, memfd, staging, &nothing, mode, &none)?;
                ch.send_reply(&done)?;
            }
            (other, _) => return Err(Fail::unexpected(&other, PHASE)),
        }
    }
    let drv = need_driver()?;
    let t1 = Instant::now();
    let (count, bytes) = release(drv, gpu, &spans, also)?;
    let micros = t1.elapsed().as_micros() as u64;
    debug!("release: {count} allocations, {bytes} bytes in {micros} us");
    Ok(Reply::Released {
        allocations: count,
        bytes,
        micros,
    })
}

/// The copy-out of a hand-over's allocations that are not lent (`lent`: their ids), on the
/// lend's connection after `LentEnd`, the application's threads held: every other converted
/// allocation goes through the ring as in a dump, and `DumpDataDone` is sent. The `Release`
/// that follows (all of them, lent ones included) is the lend's.
pub(crate) fn copy_unlent<R: Request>(
    gpu: &mut Gpu,
    ch: &Channel,
    ring: Ring,
    memfd: OwnedFd,
    staging: &mut Option<Staging>,
    known: &KnownChunks,
    lent: &std::collections::HashSet<u64>,
) -> Result<(), Fail> {
    let (spans, done) = copy_phase::<R>(gpu, ch, ring, memfd, staging, known, Mode::Stopped, lent)?;
    debug!("hand-over: {} allocations copied out first", spans.len());
    ch.send_reply(&done)?;
    Ok(())
}

/// The copy of a dump or a pre-copy round, up to its `DumpDataDone` (returned, not sent), of
/// every converted allocation but those in `skip`; returns the spans copied.
#[allow(clippy::too_many_arguments)]
fn copy_phase<R: Request>(
    gpu: &mut Gpu,
    ch: &Channel,
    ring: Ring,
    memfd: OwnedFd,
    staging: &mut Option<Staging>,
    known: &KnownChunks,
    mode: Mode,
    skip: &std::collections::HashSet<u64>,
) -> Result<(Vec<Span>, Reply), Fail> {
    let t0 = Instant::now();
    plan::validate_ring(ring.slot_size, ring.slots, ring.streams).map_err(Fail::bad_request)?;
    let drv = need_driver()?;
    let mut spans = spans_to_copy(&*table::try_lock_for(AGENT_LOCK_WAIT).ok_or_else(Fail::busy)?)?;
    spans.retain(|s| !skip.contains(&s.id));
    let mut st = Staging::map(memfd, ring.slot_size, ring.slots)?;
    // With nothing to copy, the ring is not registered; a round then copies nothing either (its
    // second look must find the devices prepared here).
    if !spans.is_empty() {
        for dev in session::devices(&spans) {
            gpu.prepare(drv, dev, ring.streams as usize, ring.slots as usize)?;
        }
        st.register(drv)?;
    }
    let st = staging.insert(st);
    ch.send_reply(&Reply::Ready)?;

    // Live: the application handle each allocation maps, if any (it may be unmapped and
    // mapped again during the round, as a new entry of the same memory).
    let mut handles = HashMap::new();
    let (chunks, hashes) = match mode {
        Mode::Stopped => {
            let chunks = plan::chunks(&spans, ring.slot_size);
            let hashes = devhash::hash_chunks(gpu, drv, &chunks);
            (chunks, hashes)
        }
        Mode::Live => {
            // Whatever may wait for the application's own GPU work (loading the kernel,
            // allocating and freeing its result buffers) is done without the table; only the
            // launches and the wait for them, on the agent's own stream, hold it. The buffers
            // have room for what the application may allocate meanwhile.
            let room: Vec<(i32, usize)> = devhash::counts(&plan::chunks(&spans, ring.slot_size))
                .into_iter()
                .map(|(dev, n)| (dev, n + n / 2 + 64))
                .collect();
            let passes = devhash::Passes::prepare(gpu, drv, &room);
            let prepared = session::devices(&spans);
            // The application may have allocated or freed since: look again, under the table,
            // so that nothing the kernel reads is unmapped under it.
            let t = table::try_lock_for(AGENT_LOCK_WAIT).ok_or_else(Fail::busy)?;
            let taken = spans_to_copy(&t).and_then(|now| {
                let chunks = plan::chunks(&now, ring.slot_size);
                let fits = passes.fit(&devhash::counts(&chunks))
                    && session::devices(&now).iter().all(|d| prepared.contains(d));
                if !fits {
                    return Err(Fail::bad_state(
                        "the process allocated too much, or on another GPU, while the round \
                         began; nothing of the application was changed: run the round again"
                            .to_owned(),
                    ));
                }
                let hashes = passes.run(gpu, drv, &chunks);
                handles.extend(t.converted().map(|c| (c.id, c.app_handle)));
                Ok((chunks, hashes))
            });
            drop(t);
            passes.free(gpu, drv);
            taken?
        }
    };
    debug!(
        "dump ({mode:?}): {} chunks of at most {} bytes; {} hashed on the GPU, {} all zero",
        chunks.len(),
        ring.slot_size,
        hashes.iter().flatten().count(),
        hashes.iter().flatten().filter(|h| h.zero).count()
    );
    let job = CopyJob {
        drv,
        ch,
        st,
        ring,
        chunks: &chunks,
        hashes: &hashes,
        known,
    };
    let bytes = match mode {
        Mode::Stopped => copy_out::<R>(gpu, job)?,
        Mode::Live => copy_out_live::<R>(gpu, job, &handles)?,
    };
    let micros = t0.elapsed().as_micros() as u64;
    debug!("dump: {bytes} bytes in {micros} us ({mode:?})");
    let done = Reply::DumpDataDone {
        chunks: chunks.len() as u64,
        bytes,
        micros,
    };
    Ok((spans, done))
}

/// Slots the plugin holds (announced, not yet freed) and slots free for the next copy, on a
/// connection whose requests are `R`.
struct Slots<R> {
    free: VecDeque<u32>,
    held: Vec<bool>,
    held_count: usize,
    requests: std::marker::PhantomData<R>,
}

impl<R: Request> Slots<R> {
    fn new(n: u32) -> Self {
        Slots {
            free: (0..n).collect(),
            held: vec![false; n as usize],
            held_count: 0,
            requests: std::marker::PhantomData,
        }
    }

    fn hand_out(&mut self, slot: u32) {
        self.held[slot as usize] = true;
        self.held_count += 1;
    }

    /// A request during the copy loop: `SlotFree` of a held slot, or `Abort`.
    fn on_request(&mut self, req: R, fd: Option<OwnedFd>) -> Result<(), Fail> {
        const PHASE: &str = "while data is copied out";
        no_fd(fd)?;
        match session::common(req, PHASE)? {
            CommonRequest::SlotFree { slot } => {
                match self.held.get_mut(slot as usize) {
                    Some(h) if *h => *h = false,
                    _ => {
                        return Err(Fail::bad_request(format!(
                            "SlotFree for slot {slot}, which the plugin does not hold"
                        )));
                    }
                }
                self.held_count -= 1;
                self.free.push_back(slot);
                Ok(())
            }
            CommonRequest::Abort => Err(Fail::Aborted),
            other => Err(Fail::unexpected(&other, PHASE)),
        }
    }

    /// Waits (at most [`PEER_WAIT`]) for the plugin's next request and takes it.
    fn wait_for_peer(&mut self, ch: &Channel) -> Result<(), Fail> {
        match ch.recv_request(Some(PEER_WAIT)) {
            Ok((req, fd)) => self.on_request(req, fd),
            Err(ProtoError::Interrupted) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

/// What a copy-out loop works with: the connection, the registered ring, the chunks with their
/// GPU hashes, and the parent's chunks (`KnownChunk`).
#[derive(Clone, Copy)]
struct CopyJob<'a> {
    drv: &'a Driver,
    ch: &'a Channel,
    st: &'a Staging,
    ring: Ring,
    chunks: &'a [Chunk],
    hashes: &'a [Option<ChunkHash>],
    known: &'a KnownChunks,
}

/// The copy-out loop; returns the bytes sent. A chunk its hash found all zero is announced
/// (`ChunkZero`), and one the parent image holds with the same hash (`ChunkUnchanged`),
/// instead of copied.
fn copy_out<R: Request>(gpu: &mut Gpu, job: CopyJob<'_>) -> Result<u64, Fail> {
    let CopyJob {
        drv,
        ch,
        st,
        ring,
        chunks,
        hashes,
        known,
    } = job;
    let mut slots = Slots::<R>::new(ring.slots);
    let mut inflight: VecDeque<(u32, usize)> = VecDeque::new();
    let mut next = 0usize;
    let mut bytes = 0u64;
    loop {
        while let Some((req, fd)) = ch.try_recv_request()? {
            slots.on_request(req, fd)?;
        }
        while next < chunks.len() {
            if let Some(announcement) = not_copied(&chunks[next], hashes[next], known) {
                ch.send_reply(&announcement)?;
                next += 1;
                continue;
            }
            let Some(slot) = slots.free.pop_front() else {
                break;
            };
            let c = &chunks[next];
            let dev = gpu.activate(drv, c.device)?;
            let stream = dev.streams[next % ring.streams as usize];
            // SAFETY: the slot lies in the registered staging, which stays mapped until every
            // copy is waited for (conclude() quiesces before unmapping); c is inside a mapped
            // converted allocation (application threads are stopped, the table said Mapped).
            unsafe { drv.copy_dtoh_async(st.slot_ptr(slot), c.at, c.len, stream)? };
            drv.record(dev.events[slot as usize], stream)?;
            inflight.push_back((slot, next));
            next += 1;
        }
        if let Some((slot, i)) = inflight.pop_front() {
            let c = &chunks[i];
            let dev = gpu.activate(drv, c.device)?;
            drv.wait_event(dev.events[slot as usize])?;
            ch.send_reply(&Reply::ChunkReady {
                slot,
                alloc_id: c.alloc_id,
                addr: c.addr,
                len: c.len,
                device_hash: hashes[i].map(|h| h.hash),
            })?;
            slots.hand_out(slot);
            bytes += c.len;
            continue;
        }
        if next == chunks.len() && slots.held_count == 0 {
            return Ok(bytes);
        }
        slots.wait_for_peer(ch)?;
    }
}

/// The copy-out loop of a pre-copy round, with the application running; returns the bytes
/// sent. Each chunk is copied and waited for while the table lock is held and after checking
/// that its allocation is still mapped, so the application cannot free or unmap it under the
/// copy. An allocation gone since the round began fails the round (nothing is lost: the
/// application's memory is untouched, and the round can be run again).
fn copy_out_live<R: Request>(
    gpu: &mut Gpu,
    job: CopyJob<'_>,
    handles: &HashMap<u64, Option<Handle>>,
) -> Result<u64, Fail> {
    let (drv, ch, st) = (job.drv, job.ch, job.st);
    let (chunks, hashes, known) = (job.chunks, job.hashes, job.known);
    let mut slots = Slots::<R>::new(job.ring.slots);
    let mut bytes = 0u64;
    for (i, c) in chunks.iter().enumerate() {
        if let Some(announcement) = not_copied(c, hashes[i], known) {
            ch.send_reply(&announcement)?;
            continue;
        }
        let slot = loop {
            while let Some((req, fd)) = ch.try_recv_request()? {
                slots.on_request(req, fd)?;
            }
            if let Some(slot) = slots.free.pop_front() {
                break slot;
            }
            slots.wait_for_peer(ch)?;
        };
        let handle = handles.get(&c.alloc_id).copied().flatten();
        let deadline = Instant::now() + REMAP_WAIT;
        loop {
            let t = table::try_lock_for(AGENT_LOCK_WAIT).ok_or_else(Fail::busy)?;
            match t.live_state(c.alloc_id, handle, c.addr, c.len) {
                LiveState::Mapped => {}
                LiveState::Remapping if Instant::now() < deadline => {
                    drop(t);
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    continue;
                }
                LiveState::Remapping | LiveState::Gone => {
                    return Err(Fail::bad_state(format!(
                        "allocation #{} (chunk at {:#x}) was freed or unmapped during the pre-copy round; \
                         nothing of the application was changed: run the round again",
                        c.alloc_id, c.addr
                    )));
                }
            }
            let dev = gpu.activate(drv, c.device)?;
            let stream = dev.streams[0];
            // SAFETY: the slot lies in the registered staging, which stays mapped until every
            // copy is waited for; c lies inside a mapped allocation (checked above) that cannot
            // be freed or unmapped before the table lock is released, after the wait below.
            unsafe { drv.copy_dtoh_async(st.slot_ptr(slot), c.at, c.len, stream)? };
            drv.record(dev.events[slot as usize], stream)?;
            drv.wait_event(dev.events[slot as usize])?;
            break;
        }
        ch.send_reply(&Reply::ChunkReady {
            slot,
            alloc_id: c.alloc_id,
            addr: c.addr,
            len: c.len,
            device_hash: None,
        })?;
        slots.hand_out(slot);
        bytes += c.len;
        // Let an application thread waiting for the table have it before the next chunk.
        std::thread::yield_now();
    }
    while slots.held_count > 0 {
        slots.wait_for_peer(ch)?;
    }
    Ok(bytes)
}

/// The announcement of a chunk that is not copied: all zero (`ChunkZero`), or as the parent
/// image holds it (`ChunkUnchanged`); `None`: copy it.
fn not_copied(c: &Chunk, hash: Option<ChunkHash>, known: &KnownChunks) -> Option<Reply> {
    let h = hash?;
    let (alloc_id, addr, len, device_hash) = (c.alloc_id, c.addr, c.len, h.hash);
    if h.zero {
        Some(Reply::ChunkZero {
            alloc_id,
            addr,
            len,
            device_hash,
        })
    } else if known.unchanged(c, &h) {
        Some(Reply::ChunkUnchanged {
            alloc_id,
            addr,
            len,
            device_hash,
        })
    } else {
        None
    }
}

/// Unmaps and releases every dumped allocation, keeping its reservation. The table is marked
/// first (so a concurrent free cannot release the handle twice) and restored if the unmap fails.
/// `released(addr, handle)` is told of each allocation whose memory is gone: the hand-over's registry of
/// kept descriptors (`own_fds::forget_released`) sits above this module and is passed in.
pub(crate) fn release(
    drv: &Driver,
    gpu: &mut Gpu,
    spans: &[Span],
    also: ReleaseAlso,
) -> Result<(u32, u64), Fail> {
    let released = also.released;
    let mut count = 0u32;
    let mut bytes = 0u64;
    for s in spans {
        let marked = table::try_lock_for(AGENT_LOCK_WAIT)
            .ok_or_else(Fail::busy)?
            .mark_released(s.addr);
        let (handle, holds_reference) = match marked {
            Ok(m) => m,
            // Freed or released meanwhile: nothing of ours to release.
            Err(e @ (TableError::NotFound(_) | TableError::AlreadyReleased(_))) => {
                debug!("release: skipping #{}: {e}", s.id);
                continue;
            }
            Err(e) => return Err(Fail::bad_state(e.to_string())),
        };
        // The mapping in this process (a keeper's may lie elsewhere than the job's address).
        if let Err(e) = drv.unmap(s.at, s.size) {
            if let Some(mut t) = table::try_lock_for(AGENT_LOCK_WAIT) {
                t.unmark_released(s.addr, handle);
            }
            return Err(e.into());
        }
        // Unmapped: the address holds no data any more, so the entry stays Released even if the
        // release fails (the physical memory would then leak into the driver's checkpoint).
        // An application handle the application released already was held by the mapping only.
        if holds_reference {
            drv.release(s.addr, handle)?;
        }
        // A descriptor kept since a reclaim names this memory, which is gone from here on (a
        // hand-over's lend holds its own copy): never lend it again.
        released(s.addr, handle);
        count += 1;
        bytes += s.size;
    }
    let (imports, import_bytes) = (also.imports)(drv, gpu)?;
    if imports > 0 {
        debug!("release: {imports} CUDA IPC imports ({import_bytes} bytes) unmapped");
    }
    Ok((count, bytes))
}
