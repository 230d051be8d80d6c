//! The hand-over, in the job: its device memory is lent to gpusnap's keeper across the driver
//! checkpoint instead of being copied out first (`docs/design-notes.md`, "Hand-over").
//!
//! `LendBegin` exports every converted allocation as a POSIX descriptor and sends a copy of each
//! to the plugin (which passes it to the keeper); then `Release` unmaps and releases the job's
//! handles (addresses kept) as a dump does, **keeping the exported descriptors**: an open one
//! keeps the physical memory alive by itself, so whatever dies (CRIU, the plugin, the keeper),
//! the held job still owns its data. `Reclaim` maps it back from those descriptors (`-R`, a
//! rollback, `gpusnap recover`): no data moves and no file is read.
//!
//! The kept descriptors are files of the process, which CRIU dumps. In a process CRIU restored
//! they are whatever CRIU opened at those numbers (the plugin's placeholders), not the memory:
//! they are told apart by the process's start time, recorded at the lend, and dropped.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;
use std::time::Instant;

use cudarc::driver::sys::CUmemGenericAllocationHandle as Handle;
use gpusnap_proto::{Channel, CommonRequest, Reply, Request};

use crate::gpu::Gpu;
use crate::log::debug;
use crate::own_fds::{Stamped, of_this_process, stamped, start_time};
use crate::session::{self, Fail, PEER_WAIT, need_driver};
use crate::table::{self, AGENT_LOCK_WAIT, TableError};

/// One allocation's exported memory, kept by the job while its handle is released.
struct Kept {
    id: u64,
    device: i32,
    addr: u64,
    size: u64,
    fd: OwnedFd,
}

/// The descriptors kept since the last release.
static KEPT: Mutex<Option<Stamped<Vec<Kept>>>> = Mutex::new(None);

fn kept() -> std::sync::MutexGuard<'static, Option<Stamped<Vec<Kept>>>> {
    KEPT.lock().unwrap_or_else(|e| e.into_inner())
}

/// Drops kept descriptors that this process did not export (it was restored by CRIU, which
/// opened placeholders at their numbers). Returns how many real ones are kept.
pub fn kept_count() -> u32 {
    let now = start_time();
    // The own descriptors of the process this one was restored from go the same way.
    crate::own_fds::drop_if_restored(now);
    of_this_process(&mut kept(), now).map_or(0, |k| u32::try_from(k.len()).unwrap_or(u32::MAX))
}

/// Forgets every kept descriptor (closing them): the memory is mapped again, or a restore
/// re-creates it.
pub fn forget() {
    kept_count();
    if let Some(k) = kept().take() {
        debug!("closing {} kept descriptors", k.held.len());
    }
}

/// `LendBegin` .. `Release`/`Abort` on this connection, whose requests are `R` (the job's
/// agent's or the keeper's); the connection is closed afterwards. `imports` unmaps the
/// process's CUDA IPC imports at the release.
pub fn run<R: Request>(ch: &Channel, gpu: &mut Gpu, imports: crate::dump::ImportRelease) {
    let mut staging = None;
    let result = lend::<R>(ch, gpu, &mut staging, imports);
    session::conclude(ch, gpu, staging, result);
}

fn lend<R: Request>(
    ch: &Channel,
    gpu: &mut Gpu,
    staging: &mut Option<crate::staging::Staging>,
    imports: crate::dump::ImportRelease,
) -> Result<Reply, Fail> {
    let drv = need_driver()?;
    if kept_count() > 0 {
        return Err(Fail::bad_state(
            "memory lent by an earlier hand-over is still kept: reclaim it first",
        ));
    }
    let (spans, released) = session::snapshot()?;
    if let Some(i) = released.iter().position(|&r| r) {
        return Err(Fail::bad_state(format!(
            "allocation #{} at {:#x} is released: restore before dumping again",
            spans[i].id, spans[i].addr
        )));
    }
    // Per allocation id: its handle, whether it was created exportable, and whether it is
    // RDMA-capable (said with each `Lent`, so a restored job can check what a keeper made).
    let (handles, exportable, rdma) = {
        let t = table::try_lock_for(AGENT_LOCK_WAIT).ok_or_else(Fail::busy)?;
        let mut handles: HashMap<u64, Handle> = HashMap::new();
        let mut exportable: HashMap<u64, bool> = HashMap::new();
        let mut rdma: HashMap<u64, bool> = HashMap::new();
        for c in t.converted() {
            let table::Backing::Mapped(h) = c.backing else {
                return Err(Fail::bad_state(format!("allocation #{} is released", c.id)));
            };
            handles.insert(c.id, h);
            exportable.insert(c.id, c.exportable);
            rdma.insert(
                c.id,
                t.app_prop(c.addr)
                    .is_some_and(|p| crate::cu::rdma_capable(&p)),
            );
        }
        (handles, exportable, rdma)
    };
    let mut owned = crate::own_fds::for_lend(&spans, &handles)?;
    // Only what was created exportable (the listing's `Converted`) is lent; the rest
    // (`ConvertedNoExport`, `AppHandleMapping`) the plugin has copied out on this connection
    // (`DumpBegin` after `LentEnd`) before the release.
    let lendable: Vec<&crate::plan::Span> = spans
        .iter()
        .filter(|s| exportable.get(&s.id) == Some(&true))
        .collect();
    crate::fd_budget::lend_fits(lendable.len())?;
    let mut lent = Vec::with_capacity(lendable.len());
    let mut bytes = 0;
    for s in lendable {
        let Some(&handle) = handles.get(&s.id) else {
            return Err(Fail::bad_state(format!(
                "allocation #{} changed during the hand-over",
                s.id
            )));
        };
        gpu.prepare(drv, s.device, 0, 0)?;
        let fd = match owned.remove(&s.id) {
            Some(dup) => dup,
            None => drv.export_fd(handle)?,
        };
        ch.send_reply_with(
            &Reply::Lent {
                id: s.id,
                device: u32::try_from(s.device).unwrap_or(u32::MAX),
                addr: s.addr,
                size: s.size,
                rdma_capable: rdma.get(&s.id) == Some(&true),
            },
            fd.as_fd(),
        )?;
        bytes += s.size;
        lent.push(Kept {
            id: s.id,
            device: s.device,
            addr: s.addr,
            size: s.size,
            fd,
        });
    }
    ch.send_reply(&Reply::LentEnd {
        count: u32::try_from(lent.len()).unwrap_or(u32::MAX),
        bytes,
    })?;
    let lent_ids: std::collections::HashSet<u64> = lent.iter().map(|k| k.id).collect();
    let mut known = crate::dump::KnownChunks::default();
    let mut copied = false;
    const PHASE: &str = "after LentEnd (Release, Abort, or the copy of what is not lent)";
    loop {
        let (req, fd) = ch.recv_request::<R>(Some(PEER_WAIT))?;
        match (session::common(req, PHASE)?, fd) {
            (CommonRequest::Release, None) => {
                crate::held::by_a_tracer().map_err(Fail::bad_state)?;
                break;
            }
            // The copies are closed with `lent`: the memory is the job's alone again.
            (CommonRequest::Abort, None) => return Err(Fail::Aborted),
            (
                CommonRequest::KnownChunk {
                    addr,
                    len,
                    device_hash,
                },
                None,
            ) if !copied => known
                .insert(addr, len, device_hash)
                .map_err(Fail::bad_request)?,
            // What is not lent is copied out first, on this connection, before the release.
            (
                CommonRequest::DumpBegin {
                    slot_size,
                    slots,
                    streams,
                },
                Some(memfd),
            ) if !copied => {
                crate::held::by_a_tracer().map_err(Fail::bad_state)?;
                let ring = session::Ring {
                    slot_size,
                    slots,
                    streams,
                };
                crate::dump::copy_unlent::<R>(gpu, ch, ring, memfd, staging, &known, &lent_ids)?;
                copied = true;
            }
            (other, _) => return Err(Fail::unexpected(&other, PHASE)),
        }
    }
    let t0 = Instant::now();
    // Kept before the release: from the first unmap on, the descriptors are what holds the
    // memory.
    *kept() = Some(stamped(lent));
    let also = crate::dump::ReleaseAlso {
        released: crate::own_fds::forget_released,
        imports,
    };
    let (count, released_bytes) = crate::dump::release(drv, gpu, &spans, also)?;
    let micros = t0.elapsed().as_micros() as u64;
    debug!("hand-over: released {count} allocations ({released_bytes} bytes), descriptors kept");
    Ok(Reply::Released {
        allocations: count,
        bytes: released_bytes,
        micros,
    })
}

/// `Reclaim`: maps every kept allocation again at its address. Allocations done so far stay
/// mapped if a later one fails (the next `Reclaim` does the rest).
pub fn reclaim(ch: &Channel, gpu: &mut Gpu) -> bool {
    let reply = match reclaim_all(gpu) {
        Ok(r) => r,
        Err(f) => match session::fail_reply(f) {
            Some(r) => r,
            None => return false,
        },
    };
    ch.send_reply(&reply).is_ok()
}

fn reclaim_all(gpu: &mut Gpu) -> Result<Reply, Fail> {
    let drv = need_driver()?;
    crate::held::by_a_tracer().map_err(Fail::bad_state)?;
    if kept_count() == 0 {
        let released = table::try_lock_for(AGENT_LOCK_WAIT)
            .ok_or_else(Fail::busy)?
            .summary()
            .released;
        // A lend of no allocations (a process that only maps others' CUDA IPC memory) leaves
        // nothing to map back.
        if !released {
            return Ok(Reply::Reclaimed {
                allocations: 0,
                bytes: 0,
                micros: 0,
            });
        }
        return Err(Fail::bad_state(
            "no lent memory is kept here: a reload from the image is needed",
        ));
    }
    let t0 = Instant::now();
    let mut guard = kept();
    let m = guard.as_mut().expect("counted above");
    let (mut count, mut bytes) = (0u32, 0u64);
    while let Some(k) = m.held.last() {
        // The memory the job had: nothing to check.
        let handle =
            map_from_descriptor(drv, gpu, k.device, k.addr, k.size, k.fd.as_fd(), |_| Ok(()))?;
        count += 1;
        bytes += k.size;
        debug!("reclaimed #{} at {:#x} ({} bytes)", k.id, k.addr, k.size);
        if let Some(k) = m.held.pop() {
            // The mapped handle is an import now: keep the descriptor for the next lend.
            crate::own_fds::keep_own(k.id, k.addr, handle, k.fd);
        }
    }
    *guard = None;
    Ok(Reply::Reclaimed {
        allocations: count,
        bytes,
        micros: t0.elapsed().as_micros() as u64,
    })
}

/// Imports the exported memory `fd` and maps it at `addr`, the table's allocation there
/// (`Reclaim`, and a restore's hand-over). `check` sees the imported handle before it is mapped
/// (refused: released, nothing mapped). Returns the imported handle; an allocation freed
/// meanwhile is unmapped again.
pub(crate) fn map_from_descriptor(
    drv: &crate::real::Driver,
    gpu: &mut Gpu,
    device: i32,
    addr: u64,
    size: u64,
    fd: std::os::fd::BorrowedFd<'_>,
    check: impl FnOnce(Handle) -> Result<(), Fail>,
) -> Result<Handle, Fail> {
    gpu.prepare(drv, device, 0, 0)?;
    let handle = drv.import_fd(fd)?;
    if let Err(f) = check(handle) {
        let _ = drv.release(addr, handle);
        return Err(f);
    }
    if let Err(e) = crate::vmm::map_handle(drv, device, addr, size, handle) {
        let _ = drv.release(addr, handle);
        return Err(e.into());
    }
    let marked = table::try_lock_for(AGENT_LOCK_WAIT)
        .ok_or_else(Fail::busy)?
        .mark_mapped(addr, handle, true);
    match marked {
        Ok(false) => {}
        // The application released its handle meanwhile: only the mapping holds it.
        Ok(true) => drv.release(addr, handle)?,
        Err(TableError::NotFound(_)) => {
            // Freed since (cannot happen while held, but never leave it mapped).
            let _ = crate::vmm::unback(drv, addr, size, handle);
        }
        Err(e) => return Err(Fail::bad_state(e.to_string())),
    }
    Ok(handle)
}
