//! The allocation table: converted allocations (with their Mapped/Released state) and the
//! application's own VMM handles and mappings, recorded only.
//!
//! Locking rule: application threads take the lock briefly and never across a driver call; the
//! agent thread only ever try-locks with a bound ([`try_lock_for`]), since an application thread
//! stopped by ptrace may hold it.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUmemGenericAllocationHandle as Handle;

/// Physical backing of a converted allocation; the state machine is `Mapped -> Released ->
/// Mapped`, nothing else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Physical memory mapped at the address, held by this handle.
    Mapped(Handle),
    /// Physical memory released; only the address reservation is left.
    Released,
}

/// A `cuMemAlloc` the agent converted into a VMM mapping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Converted {
    pub id: u64,
    pub device: i32,
    pub addr: u64,
    /// Rounded to the allocation granularity; the size of the reservation and of the mapping.
    pub size: u64,
    pub backing: Backing,
}

/// A mapping the application made itself with `cuMemMap` (device memory only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppMapping {
    pub id: u64,
    pub device: i32,
    pub addr: u64,
    pub size: u64,
    pub handle: Handle,
}

/// An impossible transition or a missing entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TableError {
    NotFound(u64),
    AlreadyReleased(u64),
    NotReleased(u64),
}

impl fmt::Display for TableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TableError::NotFound(a) => write!(f, "no converted allocation at {a:#x}"),
            TableError::AlreadyReleased(a) => write!(f, "allocation at {a:#x} is already released"),
            TableError::NotReleased(a) => write!(f, "allocation at {a:#x} is mapped, not released"),
        }
    }
}

/// One entry of a listing, both kinds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub id: u64,
    pub device: i32,
    pub addr: u64,
    pub size: u64,
    pub converted: bool,
}

/// Counts for `Hello`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub entries: u32,
    pub converted_bytes: u64,
    pub devices: u32,
    pub released: bool,
}

/// All tracked allocations.
#[derive(Debug)]
pub struct Table {
    next_id: u64,
    converted: BTreeMap<u64, Converted>,
    app_handles: BTreeMap<Handle, (u64, i32)>,
    app_maps: BTreeMap<u64, AppMapping>,
}

impl Default for Table {
    fn default() -> Self {
        Self::new()
    }
}

impl Table {
    pub const fn new() -> Self {
        Table {
            next_id: 1,
            converted: BTreeMap::new(),
            app_handles: BTreeMap::new(),
            app_maps: BTreeMap::new(),
        }
    }

    fn take_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Records a fresh conversion (state Mapped); returns its id.
    pub fn insert_converted(&mut self, device: i32, addr: u64, size: u64, handle: Handle) -> u64 {
        let id = self.take_id();
        self.converted.insert(
            addr,
            Converted {
                id,
                device,
                addr,
                size,
                backing: Backing::Mapped(handle),
            },
        );
        id
    }

    /// Removes the converted allocation whose base is `addr`.
    pub fn remove_converted(&mut self, addr: u64) -> Option<Converted> {
        self.converted.remove(&addr)
    }

    /// Converted allocations in address order.
    pub fn converted(&self) -> impl Iterator<Item = &Converted> {
        self.converted.values()
    }

    /// Mapped -> Released; returns the handle to release.
    pub fn mark_released(&mut self, addr: u64) -> Result<Handle, TableError> {
        let c = self
            .converted
            .get_mut(&addr)
            .ok_or(TableError::NotFound(addr))?;
        match c.backing {
            Backing::Mapped(h) => {
                c.backing = Backing::Released;
                Ok(h)
            }
            Backing::Released => Err(TableError::AlreadyReleased(addr)),
        }
    }

    /// Released -> Mapped with the new handle.
    pub fn mark_mapped(&mut self, addr: u64, handle: Handle) -> Result<(), TableError> {
        let c = self
            .converted
            .get_mut(&addr)
            .ok_or(TableError::NotFound(addr))?;
        match c.backing {
            Backing::Released => {
                c.backing = Backing::Mapped(handle);
                Ok(())
            }
            Backing::Mapped(_) => Err(TableError::NotReleased(addr)),
        }
    }

    /// The application created physical memory (device-located only are recorded).
    pub fn record_app_create(&mut self, handle: Handle, size: u64, device: i32) {
        self.app_handles.insert(handle, (size, device));
    }

    /// The application released a handle. Its mappings stay recorded until unmapped: the
    /// physical memory lives while it is mapped.
    pub fn record_app_release(&mut self, handle: Handle) {
        self.app_handles.remove(&handle);
    }

    /// The application mapped a handle; recorded when the handle is one we saw created.
    pub fn record_app_map(&mut self, addr: u64, size: u64, handle: Handle) {
        if let Some(&(_, device)) = self.app_handles.get(&handle) {
            let id = self.take_id();
            self.app_maps.insert(
                addr,
                AppMapping {
                    id,
                    device,
                    addr,
                    size,
                    handle,
                },
            );
        }
    }

    /// The application unmapped `[addr, addr+size)`: forget the mappings that start inside it.
    pub fn record_app_unmap(&mut self, addr: u64, size: u64) {
        let end = addr.saturating_add(size);
        let gone: Vec<u64> = self.app_maps.range(addr..end).map(|(a, _)| *a).collect();
        for a in gone {
            self.app_maps.remove(&a);
        }
    }

    /// Every entry, converted first then the application's, each in address order.
    pub fn listing(&self) -> Vec<Listed> {
        let conv = self.converted.values().map(|c| Listed {
            id: c.id,
            device: c.device,
            addr: c.addr,
            size: c.size,
            converted: true,
        });
        let app = self.app_maps.values().map(|m| Listed {
            id: m.id,
            device: m.device,
            addr: m.addr,
            size: m.size,
            converted: false,
        });
        conv.chain(app).collect()
    }

    pub fn summary(&self) -> Summary {
        let mut devices: Vec<i32> = self.converted.values().map(|c| c.device).collect();
        devices.sort_unstable();
        devices.dedup();
        Summary {
            entries: u32::try_from(self.converted.len() + self.app_maps.len()).unwrap_or(u32::MAX),
            converted_bytes: self.converted.values().map(|c| c.size).sum(),
            devices: devices.len() as u32,
            released: self
                .converted
                .values()
                .any(|c| c.backing == Backing::Released),
        }
    }

    /// Forgets everything (a forked child owns none of the parent's device memory).
    pub fn clear(&mut self) {
        self.converted.clear();
        self.app_handles.clear();
        self.app_maps.clear();
    }
}

/// The process's table.
pub static TABLE: Mutex<Table> = Mutex::new(Table::new());

/// Locks the table (application threads: brief holds only). A poisoned lock is still usable:
/// every mutation leaves the table consistent.
pub fn lock() -> MutexGuard<'static, Table> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bound used by the agent thread.
pub const AGENT_LOCK_WAIT: Duration = Duration::from_millis(500);

/// Tries to lock the table for at most `wait` (the agent thread must never block on it).
pub fn try_lock_for(wait: Duration) -> Option<MutexGuard<'static, Table>> {
    let deadline = Instant::now() + wait;
    loop {
        match TABLE.try_lock() {
            Ok(g) => return Some(g),
            Err(TryLockError::Poisoned(e)) => return Some(e.into_inner()),
            Err(TryLockError::WouldBlock) => {}
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB2: u64 = 2 << 20;

    #[test]
    fn insert_and_remove_by_base() {
        let mut t = Table::new();
        let a = t.insert_converted(0, 0x1000_0000, MB2, 11);
        let b = t.insert_converted(1, 0x2000_0000, 2 * MB2, 12);
        assert_ne!(a, b);
        let addrs: Vec<u64> = t.converted().map(|c| c.addr).collect();
        assert_eq!(addrs, vec![0x1000_0000, 0x2000_0000]);
        assert_eq!(t.remove_converted(0x1000_0000).map(|c| c.id), Some(a));
        assert!(t.remove_converted(0x1000_0000).is_none());
        assert!(
            t.remove_converted(0x2000_0000 + 1).is_none(),
            "only by base address"
        );
        assert_eq!(t.converted().map(|c| c.id).collect::<Vec<_>>(), vec![b]);
    }

    #[test]
    fn state_machine_refuses_impossible_transitions() {
        let mut t = Table::new();
        t.insert_converted(0, 0x1000, MB2, 7);
        assert_eq!(
            t.mark_mapped(0x1000, 8),
            Err(TableError::NotReleased(0x1000))
        );
        assert_eq!(t.mark_released(0x1000), Ok(7));
        assert!(t.summary().released);
        assert_eq!(
            t.mark_released(0x1000),
            Err(TableError::AlreadyReleased(0x1000))
        );
        assert_eq!(t.mark_mapped(0x1000, 9), Ok(()));
        assert_eq!(t.converted().next().unwrap().backing, Backing::Mapped(9));
        assert!(!t.summary().released);
        assert_eq!(t.mark_released(0x5000), Err(TableError::NotFound(0x5000)));
        assert_eq!(t.mark_mapped(0x5000, 1), Err(TableError::NotFound(0x5000)));
    }

    #[test]
    fn app_vmm_is_recorded_and_listed() {
        let mut t = Table::new();
        t.insert_converted(0, 0x9000_0000, MB2, 1);
        t.record_app_map(0x1000, MB2, 99); // unknown handle: ignored
        t.record_app_create(5, 4 * MB2, 1);
        t.record_app_map(0x4000_0000, MB2, 5);
        t.record_app_map(0x4000_0000 + MB2, MB2, 5);
        t.record_app_release(5); // mappings stay
        let l = t.listing();
        assert_eq!(l.len(), 3);
        assert!(l[0].converted && !l[1].converted && !l[2].converted);
        assert_eq!((l[1].addr, l[1].device, l[1].size), (0x4000_0000, 1, MB2));
        let s = t.summary();
        assert_eq!(
            (s.entries, s.converted_bytes, s.devices, s.released),
            (3, MB2, 1, false)
        );
        t.record_app_unmap(0x4000_0000, 2 * MB2);
        assert_eq!(t.listing().len(), 1);
        let ids: Vec<u64> = l.iter().map(|e| e.id).collect();
        let mut dedup = ids.clone();
        dedup.dedup();
        assert_eq!(ids, dedup, "ids are unique");
        t.clear();
        assert_eq!(t.summary(), Summary::default());
    }

    #[test]
    fn bounded_try_lock_gives_up() {
        let held = lock();
        let t0 = Instant::now();
        let other = std::thread::spawn(|| try_lock_for(Duration::from_millis(50)).is_some());
        assert!(!other.join().unwrap());
        assert!(t0.elapsed() >= Duration::from_millis(50));
        drop(held);
        assert!(try_lock_for(Duration::from_millis(50)).is_some());
    }
}
