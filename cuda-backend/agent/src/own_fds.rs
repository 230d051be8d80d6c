//! The descriptors a job holds of its own device memory after a hand-over: what the driver
//! needs to hand that memory on, since it will not export an imported handle again.
//!
//! - **Own descriptors.** After a reclaim (`-R`, a rollback) or a restore's hand-over the job
//!   maps a handle it imported from a descriptor; that descriptor stays the allocation's own
//!   ([`keep_own`]), lent again at the next dump ([`for_lend`]) and served as the program's
//!   export of the handle or as CUDA IPC ([`copy_at`], [`copy_of_handle`]). It is closed when
//!   the program lets go of the memory or a release takes it ([`forget_at`], [`forget_released`],
//!   [`forget_handles`]), so it never keeps memory alive that the program let go.
//! - **Stamps.** Every set of such descriptors is stamped with the process's start time
//!   ([`Stamped`], also used for the descriptors `lend` keeps across a release): in a process
//!   CRIU restored, the same numbers are CRIU's placeholders, and [`of_this_process`] drops them.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::time::Instant;

use cudarc::driver::sys::CUmemGenericAllocationHandle as Handle;

use crate::log::debug;
use crate::session::Fail;
use crate::table::AGENT_LOCK_WAIT;

/// Descriptors held by this process, stamped with its start time: a process CRIU restored has
/// another start time and finds CRIU's placeholders at those numbers instead, which
/// [`of_this_process`] drops.
pub(crate) struct Stamped<T> {
    started: u64,
    pub(crate) held: T,
}

/// What `slot` holds, unless it was stamped by the process this one was restored from (then it
/// is dropped, closing the placeholders). `now`: this process's start time.
pub(crate) fn of_this_process<T>(
    slot: &mut Option<Stamped<T>>,
    now: Option<u64>,
) -> Option<&mut T> {
    if slot.as_ref().is_some_and(|s| Some(s.started) != now) {
        *slot = None;
        debug!("dropping descriptors kept by the process this one was restored from");
    }
    slot.as_mut().map(|s| &mut s.held)
}

pub(crate) fn stamped<T>(held: T) -> Stamped<T> {
    Stamped {
        started: start_time().unwrap_or(0),
        held,
    }
}

/// After a reclaim the job maps an *imported* handle, which the driver will not export again:
/// the descriptor it was imported from stays here, the allocation's own, for the next lend
/// (and is closed when the application frees the allocation). By base address: (id, the handle
/// imported from it, fd). A descriptor is lent only while the table still maps that handle
/// there, so one a release could not forget (its lock busy) is never lent for new memory.
type OwnDescriptors = std::collections::BTreeMap<u64, (u64, Handle, OwnedFd)>;

static OWN: Mutex<Option<Stamped<OwnDescriptors>>> = Mutex::new(None);

fn own() -> std::sync::MutexGuard<'static, Option<Stamped<OwnDescriptors>>> {
    OWN.lock().unwrap_or_else(|e| e.into_inner())
}

/// [`own`] for the agent's thread, bounded like the table's lock: an application thread stopped
/// inside `cuMemFree` ([`forget_at`]) holds it for as long as the checkpoint holds the thread.
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
pub(crate) fn for_lend(
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
pub(crate) fn copy_at(addr: u64, id: u64, handle: Handle) -> Option<OwnedFd> {
    let mut g = own_within()?;
    let own = of_this_process(&mut g, start_time())?;
    match own.get(&addr) {
        Some((i, h, fd)) if *i == id && *h == handle => fd.try_clone().ok(),
        _ => None,
    }
}

/// The number of the own descriptor kept for the allocation at `addr`, if any (listed, so that
/// the plugin does not take it for a program's copy of an export).
pub(crate) fn number_at(addr: u64) -> Option<i32> {
    let mut g = own_within()?;
    let own = of_this_process(&mut g, start_time())?;
    own.get(&addr)
        .map(|(_, _, fd)| std::os::fd::AsRawFd::as_raw_fd(fd))
}

/// A copy of the own descriptor the handle `handle` was imported from, wherever it is mapped
/// (an application's export of its handle after a hand-over: the driver will not export an
/// imported handle).
pub(crate) fn copy_of_handle(handle: Handle) -> Option<OwnedFd> {
    let mut g = own_within()?;
    let own = of_this_process(&mut g, start_time())?;
    own.values()
        .find(|(_, h, _)| *h == handle)
        .and_then(|(_, _, fd)| fd.try_clone().ok())
}

/// Before the application frees the allocation at `addr`: its own descriptor is closed (it
/// would keep the memory alive).
pub fn forget_at(addr: u64) {
    forget_in(&mut own(), addr);
}

/// `forget_at` from the agent's thread (a release): bounded; a descriptor left is never lent
/// again (its handle is no longer mapped) and goes when the application frees the allocation.
pub fn forget_released(addr: u64, handle: Handle) {
    match own_within() {
        Some(mut g) => {
            forget_in(&mut g, addr);
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
pub fn forget_handles(gone: &[Handle]) {
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

fn forget_in(g: &mut Option<Stamped<OwnDescriptors>>, addr: u64) {
    if let Some(o) = g.as_mut()
        && o.held.remove(&addr).is_some()
    {
        debug!("own descriptor of {addr:#x} closed");
    }
}

/// Drops the own descriptors of the process this one was restored from (CRIU's placeholders),
/// so that a restored process holds none longer than its first `Hello`.
pub(crate) fn drop_if_restored(now: Option<u64>) {
    if let Some(mut g) = own_within() {
        of_this_process(&mut g, now);
    }
}

/// This process's start time in clock ticks since boot (field 22 of `/proc/self/stat`).
pub(crate) fn start_time() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after = stat.get(stat.rfind(')')? + 1..)?;
    // After the command name: state is field 3, start time field 22.
    after.split_whitespace().nth(19)?.parse().ok()
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
