//! `RestoreBegin` .. `RestoreDataDone`: re-create physical memory at the same addresses for every
//! released allocation, then copy `ChunkLoad`s from the staging ring to the device.
//!
//! Copy-in loop: each `ChunkLoad` is validated (slot, length, destination inside one converted
//! allocation, slot not still in flight), copied on a rotating stream, and its slot's event
//! recorded; finished copies are found by polling events between messages and answered with
//! `SlotFree`; before blocking on the socket the agent waits for the oldest copy instead.

use std::os::fd::OwnedFd;
use std::time::Instant;

use gpusnap_proto::{Channel, CommonRequest, ErrorCode, ProtoError, Reply, Request};

use crate::gpu::Gpu;
use crate::log::debug;
use crate::plan::{self, Chunk, Span};
use crate::real::Driver;
use crate::session::{self, Fail, PEER_WAIT, Ring, need_driver, no_fd};
use crate::staging::Staging;
use crate::table::{self, AGENT_LOCK_WAIT};
use crate::vmm;

/// Runs a whole restore on this connection, whose requests are `R` (the job's agent's or the
/// keeper's); the connection is to be closed afterwards.
pub fn run<R: Request>(gpu: &mut Gpu, ch: &Channel, ring: Ring, memfd: OwnedFd) {
    let mut staging = None;
    let result = restore::<R>(gpu, ch, ring, memfd, &mut staging);
    session::conclude(ch, gpu, staging, result);
}

fn restore<R: Request>(
    gpu: &mut Gpu,
    ch: &Channel,
    ring: Ring,
    memfd: OwnedFd,
    staging: &mut Option<Staging>,
) -> Result<Reply, Fail> {
    let t0 = Instant::now();
    plan::validate_ring(ring.slot_size, ring.slots, ring.streams).map_err(Fail::bad_request)?;
    let drv = need_driver()?;
    let (spans, released) = session::snapshot()?;
    crate::held::by_a_tracer().map_err(Fail::bad_state)?;
    let incomplete = table::try_lock_for(AGENT_LOCK_WAIT)
        .ok_or_else(Fail::busy)?
        .summary()
        .released;
    if !incomplete {
        // Loading into live memory would overwrite the application's data.
        return Err(Fail::bad_state(
            "nothing is released and no reload is pending: there is nothing to restore",
        ));
    }
    // From here the memory is not whole until RestoreDataDone: should this load be cut short
    // (the plugin or CRIU dies), the next Hello says released and the next load starts over.
    table::try_lock_for(AGENT_LOCK_WAIT)
        .ok_or_else(Fail::busy)?
        .reload_begins();
    for dev in session::devices(&spans) {
        gpu.prepare(drv, dev, ring.streams as usize, ring.slots as usize)?;
    }
    let recreated = recreate(drv, &spans, &released)?;
    debug!(
        "restore: re-created {recreated} of {} allocations",
        spans.len()
    );

    let mut st = Staging::map(memfd, ring.slot_size, ring.slots)?;
    if !spans.is_empty() {
        st.register(drv)?;
    }
    let st = staging.insert(st);
    ch.send_reply(&Reply::Ready)?;

    let loaded = copy_in::<R>(gpu, drv, ch, st, ring, &spans)?;
    // Every allocation re-created here must have been filled whole: an image that lists less
    // (a dump cut short, whose other allocations were lent and never drained) leaves the
    // memory counted as released, never taken for whole.
    let recreated_spans: Vec<&Span> = spans
        .iter()
        .zip(&released)
        .filter(|(_, r)| **r)
        .map(|(s, _)| s)
        .collect();
    if let Some((s, covered)) = unfilled(&recreated_spans, loaded.ranges.clone()) {
        return Err(Fail::bad_state(format!(
            "allocation #{} at {:#x} ({} bytes) was re-created, but the image loaded only {covered} bytes of it: refusing to count the memory whole",
            s.id, s.addr, s.size
        )));
    }
    // copy_in waited for every copy and fill before it returned.
    let verified = check_on_device(gpu, drv, &loaded.expected)?;
    table::try_lock_for(AGENT_LOCK_WAIT)
        .ok_or_else(Fail::busy)?
        .reload_complete();
    // Memory lent at the dump and still kept is not needed any more: the image's copy is in.
    crate::lend::forget();
    let micros = t0.elapsed().as_micros() as u64;
    let bytes = loaded.bytes;
    debug!("restore: {bytes} bytes in {micros} us, {verified} chunks checked on the GPU");
    Ok(Reply::Restored {
        bytes,
        micros,
        verified,
    })
}

/// Backs every released span with new physical memory at its address (state Mapped), with the
/// application's own allocation properties where the memory was the application's handle.
fn recreate(drv: &Driver, spans: &[Span], released: &[bool]) -> Result<usize, Fail> {
    let mut n = 0;
    for (s, _) in spans.iter().zip(released).filter(|(_, r)| **r) {
        let prop = table::try_lock_for(AGENT_LOCK_WAIT)
            .ok_or_else(Fail::busy)?
            .app_prop(s.addr);
        // At the reservation in this process (a keeper's may lie elsewhere than the job's).
        let handle = vmm::back(drv, s.device, s.at, s.size, prop.as_ref())?;
        if let Some(p) = prop.filter(|_| crate::role::keeper())
            && let Err(f) = made_as_asked(drv, handle, &p, s.addr)
        {
            let _ = vmm::unback(drv, s.at, s.size, handle);
            return Err(f);
        }
        // The guard is dropped at the end of this statement, before any further driver call.
        let marked = match table::try_lock_for(AGENT_LOCK_WAIT) {
            None => Err(Fail::busy()),
            Some(mut t) => t
                .mark_mapped(s.addr, handle, false)
                .map_err(|e| Fail::bad_state(e.to_string())),
        };
        match marked {
            // The application had released its handle: the mapping alone holds the memory.
            Ok(true) => drv.release(s.addr, handle)?,
            Ok(false) => {}
            Err(f) => {
                let _ = vmm::unback(drv, s.at, s.size, handle);
                return Err(f);
            }
        }
        n += 1;
    }
    Ok(n)
}

/// In a keeper: the memory just created for the job's allocation at `addr` is RDMA-capable
/// as `asked` (the job's properties): the driver is asked about the handle it made. Otherwise
/// the keeper's load fails and the job's agent loads the image itself, with the job's own
/// properties (what the restored job checks at `Take` is the keeper's word, this check).
fn made_as_asked(
    drv: &Driver,
    handle: cudarc::driver::sys::CUmemGenericAllocationHandle,
    asked: &crate::cu::PropBytes,
    addr: u64,
) -> Result<(), Fail> {
    let Some(made) = drv.props_of_handle(handle)? else {
        return Ok(());
    };
    let (want, got) = (
        crate::cu::rdma_capable(asked),
        crate::cu::rdma_capable(&made),
    );
    if want != got {
        return Err(Fail::bad_state(format!(
            "the driver made the memory for {addr:#x} with gpuDirectRDMACapable {}, not {} as the job's: the job's agent loads it instead",
            u8::from(got),
            u8::from(want)
        )));
    }
    Ok(())
}

fn chunk_of(span: &Span, addr: u64, len: u64) -> Chunk {
    Chunk {
        alloc_id: span.id,
        device: span.device,
        addr,
        len,
        at: span.device_ptr(addr),
    }
}

/// The first of `spans` that the loaded `ranges` (address, length) do not cover whole, with
/// the bytes of it they do cover.
fn unfilled<'a>(spans: &[&'a Span], mut ranges: Vec<(u64, u64)>) -> Option<(&'a Span, u64)> {
    ranges.sort_unstable();
    spans.iter().find_map(|s| {
        let end = s.addr.saturating_add(s.size);
        let (mut covered, mut at) = (0u64, s.addr);
        for &(a, l) in ranges.iter().filter(|(a, _)| *a >= s.addr && *a < end) {
            let e = a.saturating_add(l).min(end);
            let from = a.max(at);
            if e > from {
                covered += e - from;
                at = e;
            }
        }
        (covered != s.size).then_some((*s, covered))
    })
}

/// What the copy-in loop did.
struct Loaded {
    /// Device ranges (address, length) filled, from the ring or with zeros.
    ranges: Vec<(u64, u64)>,
    /// Bytes copied from the ring.
    bytes: u64,
    /// Every chunk loaded or zero-filled whose device hash the plugin sent, with that hash.
    expected: Vec<(Chunk, u64)>,
}

/// The loaded chunks' device hashes, computed on the GPU, against the image's. A chunk that
/// differs fails the restore naming it (the memory stays counted as released, so the process
/// is never taken for whole); chunks the GPU could not hash are left to the host checks the
/// plugin made as it read them. Returns how many were checked.
fn check_on_device(gpu: &mut Gpu, drv: &Driver, expected: &[(Chunk, u64)]) -> Result<u64, Fail> {
    if expected.is_empty() {
        return Ok(0);
    }
    let chunks: Vec<Chunk> = expected.iter().map(|(c, _)| *c).collect();
    let got = crate::devhash::hash_chunks(gpu, drv, &chunks);
    let mut checked = 0;
    for ((c, want), got) in expected.iter().zip(got) {
        let Some(got) = got else { continue };
        if got.hash != *want {
            return Err(Fail::Reply(
                ErrorCode::DataMismatch,
                format!(
                    "the chunk at {:#x} ({} bytes) hashes to {:016x} on the GPU after loading, the image recorded {want:016x}",
                    c.addr, c.len, got.hash
                ),
            ));
        }
        checked += 1;
    }
    Ok(checked)
}

/// The copy-in loop.
fn copy_in<R: Request>(
    gpu: &mut Gpu,
    drv: &Driver,
    ch: &Channel,
    st: &Staging,
    ring: Ring,
    spans: &[Span],
) -> Result<Loaded, Fail> {
    const PHASE: &str = "while data is copied in";
    let mut expected = Vec::new();
    let mut ranges = Vec::new();
    let mut busy = vec![false; ring.slots as usize];
    // (slot, device) in issue order.
    let mut inflight: Vec<(u32, i32)> = Vec::new();
    let mut issued = 0usize;
    let mut bytes = 0u64;
    loop {
        // Answer every copy that has finished.
        let mut i = 0;
        while i < inflight.len() {
            let (slot, dev) = inflight[i];
            let d = gpu.activate(drv, dev)?;
            if drv.event_done(d.events[slot as usize])? {
                inflight.remove(i);
                busy[slot as usize] = false;
                ch.send_reply(&Reply::SlotFree { slot })?;
            } else {
                i += 1;
            }
        }
        let (req, fd) = match ch.try_recv_request::<R>()? {
            Some(m) => m,
            None if !inflight.is_empty() => {
                // Nothing to read: finish the oldest copy rather than block on the socket.
                let (slot, dev) = inflight.remove(0);
                let d = gpu.activate(drv, dev)?;
                drv.wait_event(d.events[slot as usize])?;
                busy[slot as usize] = false;
                ch.send_reply(&Reply::SlotFree { slot })?;
                continue;
            }
            None => match ch.recv_request(Some(PEER_WAIT)) {
                Ok(m) => m,
                Err(ProtoError::Interrupted) => continue,
                Err(e) => return Err(e.into()),
            },
        };
        no_fd(fd)?;
        match session::common(req, PHASE)? {
            CommonRequest::ChunkLoad {
                slot,
                addr,
                len,
                device_hash,
            } => {
                let span =
                    plan::check_chunk_load(spans, slot, addr, len, ring.slots, ring.slot_size)
                        .map_err(Fail::bad_request)?;
                if let Some(h) = device_hash {
                    expected.push((chunk_of(span, addr, len), h));
                }
                if busy[slot as usize] {
                    return Err(Fail::bad_request(format!(
                        "ChunkLoad into slot {slot}, which is still being copied"
                    )));
                }
                let d = gpu.activate(drv, span.device)?;
                let stream = d.streams[issued % ring.streams as usize];
                let dst = span.device_ptr(addr);
                // SAFETY: the slot lies in the registered staging, which stays mapped until every
                // copy is waited for; [addr, addr+len) is inside a converted allocation that is
                // mapped (re-created above, at `dst` in this process), checked by
                // check_chunk_load.
                unsafe { drv.copy_htod_async(dst, st.slot_ptr(slot).cast_const(), len, stream)? };
                drv.record(d.events[slot as usize], stream)?;
                busy[slot as usize] = true;
                inflight.push((slot, span.device));
                issued += 1;
                bytes += len;
                ranges.push((addr, len));
            }
            CommonRequest::ChunkZero {
                addr,
                len,
                device_hash,
            } => {
                let span = plan::containing(spans, addr, len)
                    .filter(|_| len > 0)
                    .ok_or_else(|| {
                        Fail::bad_request(format!(
                            "ChunkZero [{addr:#x}, +{len}) is not inside one converted allocation"
                        ))
                    })?;
                if let Some(h) = device_hash {
                    expected.push((chunk_of(span, addr, len), h));
                }
                let d = gpu.activate(drv, span.device)?;
                let stream = d.streams[issued % ring.streams as usize];
                // Fresh device memory reads as zeros on the GPUs measured, but nothing promises
                // it: fill it (HBM speed, milliseconds even for tens of GiB).
                drv.memset_async(span.device_ptr(addr), 0, len, stream)?;
                issued += 1;
                ranges.push((addr, len));
            }
            CommonRequest::RestoreDataDone => {
                for (slot, dev) in std::mem::take(&mut inflight) {
                    let d = gpu.activate(drv, dev)?;
                    drv.wait_event(d.events[slot as usize])?;
                    ch.send_reply(&Reply::SlotFree { slot })?;
                }
                // The fills are on the same streams, tracked by no event.
                gpu.sync_all(drv)?;
                return Ok(Loaded {
                    ranges,
                    bytes,
                    expected,
                });
            }
            CommonRequest::Abort => return Err(Fail::Aborted),
            other => return Err(Fail::unexpected(&other, PHASE)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Span, unfilled};

    #[test]
    fn a_recreated_allocation_must_be_filled_whole() {
        let a = Span {
            id: 1,
            device: 0,
            addr: 0x1000,
            size: 0x300,
            at: 0x1000,
        };
        let b = Span {
            id: 2,
            device: 0,
            addr: 0x2000,
            size: 0x100,
            at: 0x2000,
        };
        let whole = vec![
            (0x1000, 0x100),
            (0x1200, 0x100),
            (0x1100, 0x100),
            (0x2000, 0x100),
        ];
        assert!(unfilled(&[&a, &b], whole).is_none());
        // One allocation with no chunk at all (lent, never drained into this image).
        let r = unfilled(&[&a, &b], vec![(0x1000, 0x300)]).expect("b is not filled");
        assert_eq!((r.0.id, r.1), (2, 0));
        // A hole, and a chunk loaded twice does not make up for it.
        let r = unfilled(
            &[&a],
            vec![(0x1000, 0x100), (0x1000, 0x100), (0x1200, 0x100)],
        )
        .expect("a hole");
        assert_eq!((r.0.id, r.1), (1, 0x200));
        // Spans not re-created are not asked about.
        assert!(unfilled(&[], vec![]).is_none());
    }
}
