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

use gpusnap_proto::{Channel, ErrorCode, ProtoError, Reply, Request};

use crate::devhash::ChunkHash;
use crate::gpu::Gpu;
use crate::log::debug;
use crate::plan::{self, Chunk, Span};
use crate::real::Driver;
use crate::session::{self, Fail, PEER_WAIT, Ring, need_driver, no_fd};
use crate::staging::Staging;
use crate::table::{self, AGENT_LOCK_WAIT, TableError};

/// The parent image's chunks a connection announced before its `DumpBegin`: (address,
/// length) → device hash. Bounded, as every input from the socket is.
#[derive(Default)]
pub struct KnownChunks(HashMap<(u64, u64), u64>);

/// Most `KnownChunk`s one connection may send (a million chunks: 32 TiB at 32 MiB).
const MAX_KNOWN: usize = 1 << 20;

impl KnownChunks {
    pub fn insert(&mut self, addr: u64, len: u64, device_hash: u64) -> Result<(), String> {
        if self.0.len() >= MAX_KNOWN {
            return Err(format!("more than {MAX_KNOWN} KnownChunk requests"));
        }
        self.0.insert((addr, len), device_hash);
        Ok(())
    }

    /// Whether the parent holds exactly this chunk (same range, same device hash).
    fn unchanged(&self, c: &Chunk, h: &ChunkHash) -> bool {
        self.0.get(&(c.addr, c.len)) == Some(&h.hash)
    }
}

/// Runs a whole dump on this connection; the connection is to be closed afterwards.
pub fn run(gpu: &mut Gpu, ch: &Channel, ring: Ring, memfd: OwnedFd, known: &KnownChunks) {
    let mut staging = None;
    let result = dump(gpu, ch, ring, memfd, &mut staging, known);
    session::conclude(ch, gpu, staging, result);
}

fn dump(
    gpu: &mut Gpu,
    ch: &Channel,
    ring: Ring,
    memfd: OwnedFd,
    staging: &mut Option<Staging>,
    known: &KnownChunks,
) -> Result<Reply, Fail> {
    let t0 = Instant::now();
    plan::validate_ring(ring.slot_size, ring.slots, ring.streams).map_err(Fail::bad_request)?;
    let drv = need_driver()?;
    let (spans, released) = session::snapshot()?;
    if let Some(i) = released.iter().position(|&r| r) {
        return Err(Fail::bad_state(format!(
            "allocation #{} at {:#x} is released: restore before dumping again",
            spans[i].id, spans[i].addr
        )));
    }
    let chunks = plan::chunks(&spans, ring.slot_size);
    let mut st = Staging::map(memfd, ring.slot_size, ring.slots)
        .map_err(|e| Fail::Reply(ErrorCode::Staging, e))?;
    if !chunks.is_empty() {
        for dev in session::devices(&spans) {
            gpu.prepare(drv, dev, ring.streams as usize, ring.slots as usize)?;
        }
        st.register(drv)?;
    }
    let st = staging.insert(st);
    ch.send_reply(&Reply::Ready)?;
    debug!(
        "dump: {} allocations, {} chunks of at most {} bytes",
        spans.len(),
        chunks.len(),
        ring.slot_size
    );

    let hashes = crate::devhash::hash_chunks(gpu, drv, &chunks);
    debug!(
        "dump: {} of {} chunks hashed on the GPU, {} all zero",
        hashes.iter().flatten().count(),
        chunks.len(),
        hashes.iter().flatten().filter(|h| h.zero).count()
    );
    let bytes = copy_out(gpu, drv, ch, st, ring, &chunks, &hashes, known)?;
    let micros = t0.elapsed().as_micros() as u64;
    debug!("dump: {bytes} bytes in {micros} us");
    ch.send_reply(&Reply::DumpDataDone {
        chunks: chunks.len() as u64,
        bytes,
        micros,
    })?;

    let (req, fd) = ch.recv_request(None)?;
    no_fd(fd)?;
    match req {
        Request::Release => crate::held::by_a_tracer().map_err(Fail::bad_state)?,
        Request::Abort => return Err(Fail::Aborted),
        other => {
            return Err(Fail::unexpected(
                &other,
                "after DumpDataDone (Release or Abort)",
            ));
        }
    }
    let t1 = Instant::now();
    let (count, bytes) = release(drv, &spans)?;
    let micros = t1.elapsed().as_micros() as u64;
    debug!("release: {count} allocations, {bytes} bytes in {micros} us");
    Ok(Reply::Released {
        allocations: count,
        bytes,
        micros,
    })
}

/// Slots the plugin holds (announced, not yet freed) and slots free for the next copy.
struct Slots {
    free: VecDeque<u32>,
    held: Vec<bool>,
    held_count: usize,
}

impl Slots {
    fn new(n: u32) -> Self {
        Slots {
            free: (0..n).collect(),
            held: vec![false; n as usize],
            held_count: 0,
        }
    }

    fn hand_out(&mut self, slot: u32) {
        self.held[slot as usize] = true;
        self.held_count += 1;
    }

    /// A request during the copy loop: `SlotFree` of a held slot, or `Abort`.
    fn on_request(&mut self, req: Request, fd: Option<OwnedFd>) -> Result<(), Fail> {
        no_fd(fd)?;
        match req {
            Request::SlotFree { slot } => {
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
            Request::Abort => Err(Fail::Aborted),
            other => Err(Fail::unexpected(&other, "while data is copied out")),
        }
    }
}

/// The copy-out loop; returns the bytes sent. A chunk its hash found all zero is announced
/// (`ChunkZero`), and one the parent image holds with the same hash (`ChunkUnchanged`),
/// instead of copied.
#[allow(clippy::too_many_arguments)]
fn copy_out(
    gpu: &mut Gpu,
    drv: &Driver,
    ch: &Channel,
    st: &Staging,
    ring: Ring,
    chunks: &[Chunk],
    hashes: &[Option<ChunkHash>],
    known: &KnownChunks,
) -> Result<u64, Fail> {
    let mut slots = Slots::new(ring.slots);
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
            unsafe { drv.copy_dtoh_async(st.slot_ptr(slot), c.addr, c.len, stream)? };
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
        match ch.recv_request(Some(PEER_WAIT)) {
            Ok((req, fd)) => slots.on_request(req, fd)?,
            Err(ProtoError::Interrupted) => {}
            Err(e) => return Err(e.into()),
        }
    }
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
fn release(drv: &Driver, spans: &[Span]) -> Result<(u32, u64), Fail> {
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
        if let Err(e) = drv.unmap(s.addr, s.size) {
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
        count += 1;
        bytes += s.size;
    }
    Ok((count, bytes))
}
