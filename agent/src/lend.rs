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
use gpusnap_proto::{Channel, Reply, Request};

use crate::gpu::Gpu;
use crate::log::debug;
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

/// Descriptors held by this process, stamped with its start time: a process CRIU restored has
/// another start time and finds CRIU's placeholders at those numbers instead, which
/// [`of_this_process`] drops.
struct Stamped<T> {
    started: u64,
    held: T,
}

/// What `slot` holds, unless it was stamped by the process this one was restored from (then it
/// is dropped, closing the placeholders). `now`: this process's start time.
fn of_this_process<T>(slot: &mut Option<Stamped<T>>, now: Option<u64>) -> Option<&mut T> {
    if slot.as_ref().is_some_and(|s| Some(s.started) != now) {
        *slot = None;
        debug!("dropping descriptors kept by the process this one was restored from");
    }
    slot.as_mut().map(|s| &mut s.held)
}

fn stamped<T>(held: T) -> Stamped<T> {
    Stamped {
        started: start_time().unwrap_or(0),
        held,
    }
}

/// The descriptors kept since the last release.
static KEPT: Mutex<Option<Stamped<Vec<Kept>>>> = Mutex::new(None);

/// After a reclaim the job maps an *imported* handle, which the driver will not export again:
/// the descriptor it was imported from stays here, the allocation's own, for the next lend
/// (and is closed when the application frees the allocation). By base address: (id, the handle
/// imported from it, fd). A descriptor is lent only while the table still maps that handle
/// there, so one a release could not forget (its lock busy) is never lent for new memory.
type OwnDescriptors = std::collections::BTreeMap<u64, (u64, Handle, OwnedFd)>;

static OWN: Mutex<Option<Stamped<OwnDescriptors>>> = Mutex::new(None);

fn kept() -> std::sync::MutexGuard<'static, Option<Stamped<Vec<Kept>>>> {
    KEPT.lock().unwrap_or_else(|e| e.into_inner())
}

fn own() -> std::sync::MutexGuard<'static, Option<Stamped<OwnDescriptors>>> {
    OWN.lock().unwrap_or_else(|e| e.into_inner())
}

/// [`own`] for the agent's thread, bounded like the table's lock: an application thread stopped
/// inside `cuMemFree` ([`forget_own`]) holds it for as long as the checkpoint holds the thread.
fn own_within() -> Option<std::sync::MutexGuard<'static, Option<Stamped<OwnDescriptors>>>> {
    let deadline = Instant::now() + AGENT_LOCK_WAIT;
    loop {
        match OWN.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => return Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() >= deadline => return None,
            Err(std::sync::TryLockError::WouldBlock) => {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
}

/// New descriptors (by allocation id) of the allocations among `spans` that keep their own
/// since a reclaim and still map the handle imported from it (`mapped`: id → handle).
fn own_descriptors(
    spans: &[crate::plan::Span],
    mapped: &HashMap<u64, Handle>,
) -> Result<HashMap<u64, OwnedFd>, Fail> {
    let mut g = own_within().ok_or_else(Fail::busy)?;
    let Some(own) = of_this_process(&mut g, start_time()) else {
        return Ok(HashMap::new());
    };
    spans
        .iter()
        .filter_map(|s| match own.get(&s.addr) {
            Some((id, h, fd)) if *id == s.id && mapped.get(id) == Some(h) => Some(
                fd.try_clone()
                    .map(|dup| (s.id, dup))
                    .map_err(|e| Fail::bad_state(format!("dup of #{}'s descriptor: {e}", s.id))),
            ),
            _ => None,
        })
        .collect()
}

/// A copy of the descriptor a hand-over left as allocation `id`'s own (at `addr`), if it still
/// names the memory mapped there (`handle`): an imported handle cannot be exported again, so
/// this is the way to hand that memory on (CUDA IPC after a restore).
pub(crate) fn own_descriptor(addr: u64, id: u64, handle: Handle) -> Option<OwnedFd> {
    let mut g = own_within()?;
    let own = of_this_process(&mut g, start_time())?;
    match own.get(&addr) {
        Some((i, h, fd)) if *i == id && *h == handle => fd.try_clone().ok(),
        _ => None,
    }
}

/// The number of the own descriptor kept for the allocation at `addr`, if any (listed, so that
/// the plugin does not take it for a program's copy of an export).
pub(crate) fn own_fd_number(addr: u64) -> Option<i32> {
    let mut g = own_within()?;
    let own = of_this_process(&mut g, start_time())?;
    own.get(&addr)
        .map(|(_, _, fd)| std::os::fd::AsRawFd::as_raw_fd(fd))
}

/// A copy of the own descriptor the handle `handle` was imported from, wherever it is mapped
/// (an application's export of its handle after a hand-over: the driver will not export an
/// imported handle).
pub(crate) fn own_descriptor_of(handle: Handle) -> Option<OwnedFd> {
    let mut g = own_within()?;
    let own = of_this_process(&mut g, start_time())?;
    own.values()
        .find(|(_, h, _)| *h == handle)
        .and_then(|(_, _, fd)| fd.try_clone().ok())
}

/// Before the application frees the allocation at `addr`: its own descriptor is closed (it
/// would keep the memory alive).
pub fn forget_own(addr: u64) {
    forget_own_in(&mut own(), addr);
}

/// [`forget_own`] from the agent's thread (a release): bounded; a descriptor left is never lent
/// again (its handle is no longer mapped) and goes when the application frees the allocation.
pub(crate) fn forget_own_within(addr: u64, handle: Handle) {
    match own_within() {
        Some(mut g) => {
            forget_own_in(&mut g, addr);
            // The handle's descriptor kept at another address (the program mapped the handle
            // again elsewhere): its memory is released too.
            if let Some(o) = g.as_mut() {
                o.held.retain(|_, (_, h, _)| *h != handle);
            }
        }
        None => debug!("own descriptor of {addr:#x} left (its lock is held): never lent again"),
    }
}

/// After the application let go of its handles whose driver handles are `gone` (the last
/// release, or the last unmap after it): the own descriptors they were imported from are
/// closed, so they never keep memory alive that the application let go. (While the handle
/// lives, its descriptor serves the application's exports of it; a later mapping of it is
/// copied at a dump, not lent: [`crate::table`].)
pub fn forget_own_handles(gone: &[Handle]) {
    if gone.is_empty() {
        return;
    }
    let mut g = own();
    if let Some(o) = g.as_mut() {
        let at: Vec<u64> = o
            .held
            .iter()
            .filter(|(_, (_, h, _))| gone.contains(h))
            .map(|(a, _)| *a)
            .collect();
        for a in at {
            o.held.remove(&a);
            debug!("own descriptor of {a:#x} closed (its handle released by the application)");
        }
    }
}

fn forget_own_in(g: &mut Option<Stamped<OwnDescriptors>>, addr: u64) {
    if let Some(o) = g.as_mut()
        && o.held.remove(&addr).is_some()
    {
        debug!("own descriptor of {addr:#x} closed");
    }
}

/// This process's start time in clock ticks since boot (field 22 of `/proc/self/stat`).
fn start_time() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after = stat.get(stat.rfind(')')? + 1..)?;
    // After the command name: state is field 3, start time field 22.
    after.split_whitespace().nth(19)?.parse().ok()
}

/// Drops kept descriptors that this process did not export (it was restored by CRIU, which
/// opened placeholders at their numbers). Returns how many real ones are kept.
pub fn kept_count() -> u32 {
    let now = start_time();
    // The own descriptors of the process this one was restored from go the same way, so a
    // restored process holds no placeholders longer than its first Hello.
    if let Some(mut g) = own_within() {
        of_this_process(&mut g, now);
    }
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

/// `LendBegin` .. `Release`/`Abort` on this connection; the connection is closed afterwards.
/// `imports` unmaps the process's CUDA IPC imports at the release.
pub fn run(ch: &Channel, gpu: &mut Gpu, imports: crate::dump::ImportRelease) {
    let mut staging = None;
    let result = lend(ch, gpu, &mut staging, imports);
    session::conclude(ch, gpu, staging, result);
}

fn lend(
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
    let mut owned = own_descriptors(&spans, &handles)?;
    // Only what was created exportable (the listing's `Converted`) is lent; the rest
    // (`ConvertedNoExport`, `AppHandleMapping`) the plugin has copied out on this connection
    // (`DumpBegin` after `LentEnd`) before the release.
    let lendable: Vec<&crate::plan::Span> = spans
        .iter()
        .filter(|s| exportable.get(&s.id) == Some(&true))
        .collect();
    descriptors_fit(lendable.len())?;
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
    loop {
        let (req, fd) = ch.recv_request(Some(PEER_WAIT))?;
        match (req, fd) {
            (Request::Release, None) => {
                crate::held::by_a_tracer().map_err(Fail::bad_state)?;
                break;
            }
            // The copies are closed with `lent`: the memory is the job's alone again.
            (Request::Abort, None) => return Err(Fail::Aborted),
            (
                Request::KnownChunk {
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
                Request::DumpBegin {
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
                crate::dump::copy_unlent(gpu, ch, ring, memfd, staging, &known, &lent_ids)?;
                copied = true;
            }
            (other, _) => {
                return Err(Fail::unexpected(
                    &other,
                    "after LentEnd (Release, Abort, or the copy of what is not lent)",
                ));
            }
        }
    }
    let t0 = Instant::now();
    // Kept before the release: from the first unmap on, the descriptors are what holds the
    // memory.
    *kept() = Some(stamped(lent));
    let also = crate::dump::ReleaseAlso {
        released: forget_own_within,
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

/// Descriptors the job keeps open beyond the kept ones, so that its own work (and a reload, if
/// the rollback must reload) still finds some.
const DESCRIPTOR_MARGIN: u64 = 32;

/// Refuses a lend whose `n` kept descriptors would not fit under the job's own limit with
/// [`DESCRIPTOR_MARGIN`] to spare (the limit is the application's: it is not raised). The
/// plugin then copies the data out first, and nothing of the job changed.
fn descriptors_fit(n: usize) -> Result<(), Fail> {
    let need = n as u64 + DESCRIPTOR_MARGIN;
    match descriptors_in_use() {
        Some((open, limit)) if open + need > limit => Err(Fail::bad_state(format!(
            "descriptor limit: the process has {open} of {limit} descriptors open; lending {n} allocations needs {need} more (one kept per allocation, and a margin)"
        ))),
        _ => Ok(()),
    }
}

/// Whether the agent may keep one more descriptor of its own and still leave the program
/// [`DESCRIPTOR_MARGIN`] under its soft limit (the agent's copies must never make the program
/// run out of descriptors sooner than without it).
pub(crate) fn room_for_one_more_descriptor() -> bool {
    descriptors_in_use().is_none_or(|(open, limit)| open + 1 + DESCRIPTOR_MARGIN <= limit)
}

/// The process's open descriptors and its soft `RLIMIT_NOFILE`; None when unlimited or unknown.
fn descriptors_in_use() -> Option<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) into a valid rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0
        || lim.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    Some((open, lim.rlim_cur))
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
            keep_own(k.id, k.addr, handle, k.fd);
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

/// Keeps `fd`, the descriptor the handle mapped at `addr` was imported from, as allocation
/// `id`'s own: the driver will not export an imported handle again, so the next lend passes
/// this descriptor on instead.
pub(crate) fn keep_own(id: u64, addr: u64, handle: Handle, fd: OwnedFd) {
    match own_within() {
        Some(mut g) => {
            // A restored process first drops what the process it was restored from kept.
            of_this_process(&mut g, start_time());
            g.get_or_insert_with(|| stamped(OwnDescriptors::new()))
                .held
                .insert(addr, (id, handle, fd));
        }
        // The mapping holds the memory; the next lend copies this one first instead.
        None => debug!("#{id}'s descriptor not kept (its lock is held)"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn start_time_is_read_from_stat() {
        let t = super::start_time().expect("this process has a start time");
        assert!(t > 0);
        assert_eq!(super::start_time(), Some(t), "stable for one process");
    }
}
