//! The allocation table: converted allocations (with their Mapped/Released state) and the
//! application's own VMM handles and mappings.
//!
//! The application's `cuMemCreate` handles for device memory are virtualized: the application
//! gets a value of ours ([`VIRTUAL_BASE`] | n), the table keeps the driver's handle. A handle
//! mapped once, whole, at offset 0 (what PyTorch's expandable segments do) is then movable: its
//! mapping is an entry of `converted` like a converted `cuMemAlloc`, released by a dump and
//! re-created at the same address by a restore, while the application's value stays valid.
//! A handle mapped twice or in part is left to the driver checkpoint (recorded only).
//!
//! Driver references: while the application holds a handle (`app_refs > 0`) the table holds
//! exactly one driver reference to it; the application's creates, retains and releases only
//! count. A mapping keeps its physical memory alive by itself, as in CUDA.
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

/// A `cuMemAlloc` the agent converted into a VMM mapping, or a movable mapping of an
/// application handle (`app_handle`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Converted {
    pub id: u64,
    pub device: i32,
    pub addr: u64,
    /// Rounded to the allocation granularity; the size of the reservation and of the mapping.
    pub size: u64,
    /// Where the reservation is in this process: `addr` (the entry's identity, the job's
    /// address) but in a keeper whose own mappings held the job's address
    /// ([`Table::insert_adopted`], [`Table::insert_expected`]).
    pub mapped_at: u64,
    pub backing: Backing,
    /// The application's (virtual) handle mapped here; None for a converted `cuMemAlloc`.
    pub app_handle: Option<Handle>,
    /// Memory created with a POSIX-fd shareable handle type, so it can be exported (to serve
    /// CUDA IPC, to lend it to a keeper): a converted `cuMemAlloc` where the device has such
    /// handles; an application handle whose memory is what a keeper makes
    /// ([`crate::cu::is_keeper_prop`]).
    pub exportable: bool,
    /// In a keeper at a restore: the properties the job's memory is created with
    /// ([`crate::cu::KeeperMemory::prop`], from `Expect`); None for the agent's own.
    pub made_as: Option<PropBytes>,
}

/// Application handle values start here (the driver's own values are small or pointer-like).
pub const VIRTUAL_BASE: Handle = 0x6770_736e_0000_0000;

pub use crate::cu::PropBytes;

/// An application handle for device memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppHandle {
    /// The driver's handle; None while a dump has released the memory.
    pub real: Option<Handle>,
    /// The application's references: its create and retains, less its releases.
    pub app_refs: u32,
    pub size: u64,
    pub device: i32,
    /// The properties the memory was created with (and is created with again).
    pub prop: PropBytes,
    /// The properties the application asked for: `prop` less the POSIX-fd handle type the agent
    /// may have added ([`crate::cu::lendable_prop`]); what the application reads back.
    pub asked: PropBytes,
    /// Live mappings of the handle.
    pub mappings: u32,
    /// Mapped twice or in part at some time: never movable, left to the driver.
    pub pinned: bool,
    /// The driver's handle is imported (a hand-over mapped the memory back from a descriptor),
    /// which the driver will not export again: a later mapping of it is copied, not lent.
    pub imported: bool,
}

/// What the application's `cuMemRelease` of a virtual handle does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AppRelease {
    /// The last application reference: release this driver handle (the table's reference).
    ReleaseReal(Handle),
    /// References remain, or the memory is released by a dump: nothing to call.
    Counted,
    /// The application holds no reference to it any more.
    Invalid,
}

/// A mapping the application made itself with `cuMemMap` (device memory only) that is left to
/// the driver checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppMapping {
    pub id: u64,
    pub device: i32,
    pub addr: u64,
    pub size: u64,
    /// The handle as the application passed it (virtual when it is one of ours).
    pub handle: Handle,
}

/// What a pre-copy round finds where it is about to copy ([`Table::live_state`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LiveState {
    /// Mapped as it was (for an application handle: the same handle mapped again at the same
    /// place, so the same physical memory): copy it now, under the lock.
    Mapped,
    /// An application handle that is not mapped there at the moment but still exists: it may
    /// be mapped again soon (allocators unmap and map their handles).
    Remapping,
    /// Freed, or its handle released: the round cannot finish.
    Gone,
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
    /// A converted entry a hand-over lends ([`Converted::exportable`]); the others are copied.
    pub exportable: bool,
    /// A converted entry that is the mapping of an application handle.
    pub app_handle: bool,
    /// That handle's driver handle is imported (a hand-over mapped it back from a descriptor).
    pub imported: bool,
    /// Its memory is `gpuDirectRDMACapable` (an application handle's, or a keeper's entry
    /// made so): a keeper restoring it must make it so.
    pub rdma_capable: bool,
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
    /// Device handles the application created with the agent's app-VMM support off: recorded.
    app_handles: BTreeMap<Handle, (u64, i32)>,
    app_maps: BTreeMap<u64, AppMapping>,
    /// Virtual handle -> the application's handle.
    virtual_handles: BTreeMap<Handle, AppHandle>,
    next_virtual: Handle,
    /// A reload (restore, rollback, recover) began and has not completed: the memory may be
    /// re-created but holds only part of its data. It counts as released until a reload
    /// completes, so that whoever comes next loads it again instead of letting it run.
    reload_incomplete: bool,
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
            virtual_handles: BTreeMap::new(),
            next_virtual: VIRTUAL_BASE + 1,
            reload_incomplete: false,
        }
    }

    fn take_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Records a fresh conversion (state Mapped); returns its id.
    pub fn insert_converted(&mut self, device: i32, addr: u64, size: u64, handle: Handle) -> u64 {
        self.insert_movable(device, addr, size, handle, None)
    }

    /// In a keeper: another process's allocation `id` at `addr` in the job (`at` is `(addr,
    /// mapped_at)`), imported and mapped here at `mapped_at` (the job's address where it was free), kept under the job's
    /// id and address so the chunks name the job's allocations.
    pub fn insert_adopted(
        &mut self,
        id: u64,
        device: i32,
        at: (u64, u64),
        size: u64,
        handle: Handle,
    ) {
        self.insert_for_job(id, device, at, size, Backing::Mapped(handle), false);
    }

    /// In a keeper: the adopted allocation of the job at `addr` is now the snapshot mapped at
    /// `mapped_at` here, held by `handle` (the import it replaces is let go by the caller).
    pub fn replace_adopted(&mut self, addr: u64, mapped_at: u64, handle: Handle) {
        if let Some(c) = self.converted.get_mut(&addr) {
            c.mapped_at = mapped_at;
            c.backing = Backing::Mapped(handle);
        }
    }

    /// In a keeper at a restore: the job's allocation `id` at `addr` (`at` is `(addr,
    /// mapped_at)`), to be re-created here
    /// at `mapped_at` (its reservation, made) by the load that follows (state Released until
    /// then).
    /// `made_as`: the properties to create it with (None: the agent's own).
    pub fn insert_expected(
        &mut self,
        id: u64,
        device: i32,
        at: (u64, u64),
        size: u64,
        (exportable, made_as): (bool, Option<PropBytes>),
    ) {
        self.insert_for_job(id, device, at, size, Backing::Released, exportable);
        if let Some(c) = self.converted.get_mut(&at.0) {
            c.made_as = made_as;
        }
    }

    /// A keeper's entry for the job's allocation `id`, under the job's id and address.
    fn insert_for_job(
        &mut self,
        id: u64,
        device: i32,
        (addr, mapped_at): (u64, u64),
        size: u64,
        backing: Backing,
        exportable: bool,
    ) {
        self.next_id = self.next_id.max(id.saturating_add(1));
        let c = Converted {
            id,
            device,
            addr,
            size,
            mapped_at,
            backing,
            app_handle: None,
            exportable,
            made_as: None,
        };
        self.converted.insert(addr, c);
    }

    /// A mapped entry the split path moves: a conversion, or the whole mapping of the
    /// application's (virtual) handle `app_handle`.
    fn insert_movable(
        &mut self,
        device: i32,
        addr: u64,
        size: u64,
        handle: Handle,
        app_handle: Option<Handle>,
    ) -> u64 {
        let id = self.take_id();
        self.converted.insert(
            addr,
            Converted {
                id,
                device,
                addr,
                size,
                mapped_at: addr,
                backing: Backing::Mapped(handle),
                app_handle,
                exportable: false,
                made_as: None,
            },
        );
        id
    }

    /// Records that the converted allocation at `addr` was created exportable.
    pub fn set_exportable(&mut self, addr: u64) {
        if let Some(c) = self.converted.get_mut(&addr) {
            c.exportable = true;
        }
    }

    /// The device of the memory the agent moves (a converted `cuMemAlloc` or an application
    /// mapping) whose range holds `ptr`.
    pub fn device_of(&self, ptr: u64) -> Option<i32> {
        let (_, c) = self.converted.range(..=ptr).next_back()?;
        (ptr - c.addr < c.size).then_some(c.device)
    }

    /// The converted `cuMemAlloc` (not an application mapping) whose range holds `ptr`.
    pub fn converted_alloc_containing(&self, ptr: u64) -> Option<&Converted> {
        let (_, c) = self.converted.range(..=ptr).next_back()?;
        (c.app_handle.is_none() && ptr - c.addr < c.size).then_some(c)
    }

    /// Removes the converted `cuMemAlloc` whose base is `addr` (an application mapping is
    /// never freed this way).
    pub fn remove_converted(&mut self, addr: u64) -> Option<Converted> {
        if self.converted.get(&addr)?.app_handle.is_some() {
            return None;
        }
        self.converted.remove(&addr)
    }

    /// Converted allocations in address order.
    pub fn converted(&self) -> impl Iterator<Item = &Converted> {
        self.converted.values()
    }

    /// Mapped -> Released; returns the handle and whether the table holds a driver reference
    /// to it that must be released after the unmap (an application handle the application has
    /// released already is held by its mapping alone).
    pub fn mark_released(&mut self, addr: u64) -> Result<(Handle, bool), TableError> {
        let c = self
            .converted
            .get_mut(&addr)
            .ok_or(TableError::NotFound(addr))?;
        let Backing::Mapped(h) = c.backing else {
            return Err(TableError::AlreadyReleased(addr));
        };
        c.backing = Backing::Released;
        let Some(v) = c.app_handle else {
            return Ok((h, true));
        };
        let ah = self
            .virtual_handles
            .get_mut(&v)
            .expect("a movable mapping's handle is in the table");
        ah.real = None;
        Ok((h, ah.app_refs > 0))
    }

    /// Undoes [`mark_released`](Self::mark_released) when the unmap failed.
    pub fn unmark_released(&mut self, addr: u64, handle: Handle) {
        if let Some(c) = self.converted.get_mut(&addr) {
            c.backing = Backing::Mapped(handle);
            if let Some(ah) = c.app_handle.and_then(|v| self.virtual_handles.get_mut(&v)) {
                ah.real = Some(handle);
            }
        }
    }

    /// Released -> Mapped with the new handle, `imported` from a descriptor or created. Returns
    /// true when the table must not keep a driver reference to it (the application has
    /// released its handle: only the mapping holds the memory), i.e. the caller releases it
    /// once mapped.
    pub fn mark_mapped(
        &mut self,
        addr: u64,
        handle: Handle,
        imported: bool,
    ) -> Result<bool, TableError> {
        let c = self
            .converted
            .get_mut(&addr)
            .ok_or(TableError::NotFound(addr))?;
        if let Backing::Mapped(_) = c.backing {
            return Err(TableError::NotReleased(addr));
        }
        c.backing = Backing::Mapped(handle);
        let Some(ah) = c.app_handle.and_then(|v| self.virtual_handles.get_mut(&v)) else {
            return Ok(false);
        };
        ah.real = Some(handle);
        ah.imported = imported;
        Ok(ah.app_refs == 0)
    }

    /// The allocation properties for re-creating the memory at `addr`: the application's own
    /// for the mapping of its handle, the job's in a keeper's entry that `Expect` gave them;
    /// None for a converted `cuMemAlloc` (the agent's own properties).
    pub fn app_prop(&self, addr: u64) -> Option<PropBytes> {
        let c = self.converted.get(&addr)?;
        match c.app_handle {
            Some(v) => Some(self.virtual_handles.get(&v)?.prop),
            None => c.made_as,
        }
    }

    /// A driver handle for device memory the application just created: returns the value the
    /// application gets instead.
    pub fn virtualize(
        &mut self,
        real: Handle,
        size: u64,
        device: i32,
        (prop, asked): (PropBytes, PropBytes),
    ) -> Handle {
        let v = self.next_virtual;
        self.next_virtual += 1;
        self.virtual_handles.insert(
            v,
            AppHandle {
                real: Some(real),
                app_refs: 1,
                size,
                device,
                prop,
                asked,
                mappings: 0,
                pinned: false,
                imported: false,
            },
        );
        v
    }

    /// A value of the application-handle range that no handle of this table will take (for
    /// the imports of `shareable`).
    pub fn reserve_virtual(&mut self) -> Handle {
        let v = self.next_virtual;
        self.next_virtual += 1;
        v
    }

    /// The driver handle behind an application value: `None` when the value is not one of
    /// ours (pass it on unchanged), `Some(None)` while a dump has released the memory.
    pub fn real_handle(&self, h: Handle) -> Option<Option<Handle>> {
        self.virtual_handles.get(&h).map(|a| a.real)
    }

    /// The properties the application asked for when it created virtual handle `v`, and the
    /// ones its memory was made with; None when `v` is not one of ours.
    pub fn props_of(&self, v: Handle) -> Option<(PropBytes, PropBytes)> {
        self.virtual_handles.get(&v).map(|a| (a.asked, a.prop))
    }

    /// Whether virtual handle `v`'s driver handle is imported (a hand-over mapped its memory
    /// back from a descriptor).
    pub fn is_imported(&self, v: Handle) -> bool {
        self.virtual_handles.get(&v).is_some_and(|a| a.imported)
    }

    /// The application value of a driver handle (for `cuMemRetainAllocationHandle`), if the
    /// handle is one the application created.
    pub fn virtual_of(&self, real: Handle) -> Option<Handle> {
        self.virtual_handles
            .iter()
            .find(|(_, a)| a.real == Some(real))
            .map(|(v, _)| *v)
    }

    /// The application retained handle `v` (`cuMemRetainAllocationHandle`), which gave the
    /// driver one more reference: returns true when that reference is to be released again
    /// (the table already holds one).
    pub fn app_retain(&mut self, v: Handle) -> bool {
        let Some(a) = self.virtual_handles.get_mut(&v) else {
            return false;
        };
        a.app_refs += 1;
        a.app_refs > 1
    }

    /// The application released handle `v` (`cuMemRelease`).
    pub fn app_release(&mut self, v: Handle) -> AppRelease {
        let Some(a) = self.virtual_handles.get_mut(&v) else {
            return AppRelease::Invalid;
        };
        if a.app_refs == 0 {
            return AppRelease::Invalid;
        }
        a.app_refs -= 1;
        if a.app_refs > 0 {
            return AppRelease::Counted;
        }
        let real = a.real;
        if a.mappings == 0 {
            self.virtual_handles.remove(&v);
        }
        real.map_or(AppRelease::Counted, AppRelease::ReleaseReal)
    }

    /// Handle `v` is bound where moving it would break the binding (a multicast object): its
    /// movable mapping, if any, is left to the driver from now on.
    pub fn pin(&mut self, v: Handle) {
        let Some(a) = self.virtual_handles.get_mut(&v) else {
            return;
        };
        a.pinned = true;
        let device = a.device;
        let moved: Vec<u64> = self
            .converted
            .values()
            .filter(|c| c.app_handle == Some(v))
            .map(|c| c.addr)
            .collect();
        for at in moved {
            if let Some(c) = self.converted.remove(&at) {
                self.insert_app_mapping(device, at, c.size, v);
            }
        }
    }

    /// The application mapped virtual handle `v` at `addr` (the driver accepted it). A whole
    /// mapping at offset 0 of a handle not mapped before becomes movable; any other mapping is
    /// recorded and pins the handle (and demotes its movable mapping) to the driver checkpoint.
    pub fn app_map_virtual(&mut self, addr: u64, size: u64, offset: u64, v: Handle) {
        let Some(a) = self.virtual_handles.get_mut(&v) else {
            return;
        };
        let (Some(real), device) = (a.real, a.device) else {
            return;
        };
        a.mappings += 1;
        if !a.pinned && a.mappings == 1 && offset == 0 && size == a.size {
            // Lent by a hand-over only if a keeper would make the same memory at a restore, and
            // only while the driver can export it.
            let lendable = crate::cu::is_keeper_prop(&a.prop, device) && !a.imported;
            self.insert_movable(device, addr, size, real, Some(v));
            if lendable {
                self.set_exportable(addr);
            }
            return;
        }
        self.pin(v);
        self.insert_app_mapping(device, addr, size, v);
    }

    /// Records a mapping of the application's that stays with the driver checkpoint.
    fn insert_app_mapping(&mut self, device: i32, addr: u64, size: u64, handle: Handle) {
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
            self.insert_app_mapping(device, addr, size, handle);
        }
    }

    /// The application is about to unmap `[addr, addr+size)`: its movable mappings that start
    /// inside it become mappings left to the driver checkpoint, before the driver is called. A
    /// dump (or pre-copy) that looks at the table while the unmap is under way then never
    /// copies from an address that may already be unmapped. Should the driver refuse the
    /// unmap, they stay left to the driver: slower to checkpoint, never wrong.
    pub fn begin_app_unmap(&mut self, addr: u64, size: u64) {
        let end = addr.saturating_add(size);
        let moving: Vec<u64> = self
            .converted
            .range(addr..end)
            .filter(|(_, c)| c.app_handle.is_some())
            .map(|(a, _)| *a)
            .collect();
        for a in moving {
            if let Some(c) = self.converted.remove(&a) {
                let v = c.app_handle.expect("filtered on app_handle above");
                self.insert_app_mapping(c.device, c.addr, c.size, v);
            }
        }
    }

    /// Whether `[addr, addr+size)` overlaps a converted `cuMemAlloc` (not an application
    /// mapping): memory the application did not map itself, which `cuMemUnmap` must not touch.
    pub fn overlaps_converted_alloc(&self, addr: u64, size: u64) -> bool {
        let end = addr.saturating_add(size);
        // One starting below `addr` that reaches into the range, or one starting inside it.
        self.converted
            .range(..addr)
            .next_back()
            .is_some_and(|(_, c)| c.app_handle.is_none() && c.addr.saturating_add(c.size) > addr)
            || self
                .converted
                .range(addr..end)
                .any(|(_, c)| c.app_handle.is_none())
    }

    /// Where `[addr, addr+len)` of the memory a pre-copy round found as entry `id` (a mapping
    /// of application handle `handle`, if it was one) stands now: see [`LiveState`].
    pub fn live_state(&self, id: u64, handle: Option<Handle>, addr: u64, len: u64) -> LiveState {
        let inside = self
            .converted
            .range(..=addr)
            .next_back()
            .map(|(_, c)| c)
            .filter(|c| {
                addr.checked_add(len)
                    .is_some_and(|end| end <= c.addr.saturating_add(c.size))
            });
        if let Some(c) = inside
            && matches!(c.backing, Backing::Mapped(_))
            && (c.id == id || (handle.is_some() && c.app_handle == handle))
        {
            return LiveState::Mapped;
        }
        match handle.and_then(|v| self.virtual_handles.get(&v)) {
            Some(h) if h.real.is_some() => LiveState::Remapping,
            _ => LiveState::Gone,
        }
    }

    /// The application unmapped `[addr, addr+size)`: forget the mappings that start inside it
    /// (and a virtual handle left with neither mappings nor application references).
    /// Returns the driver handles of the application handles that are gone with it (no
    /// reference and no mapping left).
    pub fn record_app_unmap(&mut self, addr: u64, size: u64) -> Vec<Handle> {
        let end = addr.saturating_add(size);
        let mut handles = Vec::new();
        let gone: Vec<u64> = self.app_maps.range(addr..end).map(|(a, _)| *a).collect();
        for a in gone {
            handles.extend(self.app_maps.remove(&a).map(|m| m.handle));
        }
        let moved: Vec<u64> = self
            .converted
            .range(addr..end)
            .filter(|(_, c)| c.app_handle.is_some())
            .map(|(a, _)| *a)
            .collect();
        for a in moved {
            handles.extend(self.converted.remove(&a).and_then(|c| c.app_handle));
        }
        let mut dropped = Vec::new();
        for v in handles {
            if let Some(h) = self.virtual_handles.get_mut(&v) {
                h.mappings = h.mappings.saturating_sub(1);
                if h.mappings == 0 && h.app_refs == 0 {
                    dropped.extend(self.virtual_handles.remove(&v).and_then(|a| a.real));
                }
            }
        }
        dropped
    }

    /// Every entry, converted first then the application's, each in address order.
    pub fn listing(&self) -> Vec<Listed> {
        let conv = self.converted.values().map(|c| {
            let handle = c.app_handle.and_then(|v| self.virtual_handles.get(&v));
            let prop = handle.map(|a| a.prop).or(c.made_as);
            Listed {
                id: c.id,
                device: c.device,
                addr: c.addr,
                size: c.size,
                converted: true,
                exportable: c.exportable,
                app_handle: c.app_handle.is_some(),
                imported: handle.is_some_and(|a| a.imported),
                rdma_capable: prop.is_some_and(|p| crate::cu::rdma_capable(&p)),
            }
        });
        let app = self.app_maps.values().map(|m| Listed {
            id: m.id,
            device: m.device,
            addr: m.addr,
            size: m.size,
            converted: false,
            exportable: false,
            app_handle: false,
            imported: false,
            rdma_capable: false,
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
            released: self.reload_incomplete
                || self
                    .converted
                    .values()
                    .any(|c| c.backing == Backing::Released),
        }
    }

    /// A reload begins: until [`reload_complete`](Self::reload_complete), the memory counts as
    /// released whatever is mapped.
    pub fn reload_begins(&mut self) {
        self.reload_incomplete = true;
    }

    /// Every chunk of a reload is in device memory.
    pub fn reload_complete(&mut self) {
        self.reload_incomplete = false;
    }

    /// Forgets everything (a forked child owns none of the parent's device memory).
    pub fn clear(&mut self) {
        self.reload_incomplete = false;
        self.converted.clear();
        self.app_handles.clear();
        self.app_maps.clear();
        self.virtual_handles.clear();
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
            t.mark_mapped(0x1000, 8, false),
            Err(TableError::NotReleased(0x1000))
        );
        assert_eq!(t.mark_released(0x1000), Ok((7, true)));
        assert!(t.summary().released);
        assert_eq!(
            t.mark_released(0x1000),
            Err(TableError::AlreadyReleased(0x1000))
        );
        assert_eq!(t.mark_mapped(0x1000, 9, false), Ok(false));
        assert_eq!(t.converted().next().unwrap().backing, Backing::Mapped(9));
        assert!(!t.summary().released);
        assert_eq!(t.mark_released(0x5000), Err(TableError::NotFound(0x5000)));
        assert_eq!(
            t.mark_mapped(0x5000, 1, false),
            Err(TableError::NotFound(0x5000))
        );
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

    const PROP: PropBytes = [0; std::mem::size_of::<PropBytes>()];

    #[test]
    fn a_whole_mapping_of_an_app_handle_moves_and_keeps_its_value() {
        let mut t = Table::new();
        let v = t.virtualize(500, MB2, 0, (PROP, PROP));
        assert!(v > VIRTUAL_BASE);
        assert_eq!(t.real_handle(v), Some(Some(500)));
        assert_eq!(t.real_handle(500), None, "driver values pass through");
        t.app_map_virtual(0x7000_0000, MB2, 0, v);
        let l = t.listing();
        assert_eq!(l.len(), 1);
        assert!(l[0].converted, "moved by the split path");
        assert_eq!(t.summary().converted_bytes, MB2);
        assert_eq!(
            t.remove_converted(0x7000_0000),
            None,
            "cuMemFree cannot free it"
        );

        // dump: released, the table's reference dropped; restore: a new driver handle
        assert_eq!(t.mark_released(0x7000_0000), Ok((500, true)));
        assert_eq!(t.real_handle(v), Some(None));
        assert_eq!(t.mark_mapped(0x7000_0000, 600, false), Ok(false));
        assert_eq!(t.real_handle(v), Some(Some(600)), "same value, new memory");
        assert_eq!(t.virtual_of(600), Some(v));

        // the application releases, then unmaps: the entry goes
        assert_eq!(t.app_release(v), AppRelease::ReleaseReal(600));
        assert_eq!(t.app_release(v), AppRelease::Invalid);
        assert_eq!(t.listing().len(), 1, "the mapping still holds the memory");
        t.record_app_unmap(0x7000_0000, MB2);
        assert!(t.listing().is_empty());
        assert_eq!(t.real_handle(v), None);
    }

    #[test]
    fn a_reload_cut_short_counts_as_released() {
        let mut t = Table::new();
        t.insert_converted(0, 0x1000, 0x1000, 7);
        assert_eq!(t.mark_released(0x1000), Ok((7, true)));
        t.reload_begins();
        assert_eq!(t.mark_mapped(0x1000, 9, false), Ok(false));
        assert!(
            t.summary().released,
            "re-created but not reloaded is not whole"
        );
        t.reload_complete();
        assert!(!t.summary().released);
    }

    #[test]
    fn a_released_app_handle_is_held_by_its_mapping_alone() {
        let mut t = Table::new();
        let v = t.virtualize(500, MB2, 1, (PROP, PROP));
        t.app_map_virtual(0x7000_0000, MB2, 0, v);
        assert_eq!(t.app_release(v), AppRelease::ReleaseReal(500));
        // dump: no table reference left to release; restore: release the new one once mapped
        assert_eq!(t.mark_released(0x7000_0000), Ok((500, false)));
        assert_eq!(t.mark_mapped(0x7000_0000, 700, false), Ok(true));
        assert_eq!(t.app_prop(0x7000_0000), Some(PROP));
    }

    #[test]
    fn retains_are_counted_over_one_driver_reference() {
        let mut t = Table::new();
        let v = t.virtualize(500, MB2, 0, (PROP, PROP));
        t.app_map_virtual(0x7000_0000, MB2, 0, v);
        assert!(
            t.app_retain(v),
            "the table already holds a reference: drop the extra one"
        );
        assert_eq!(t.app_release(v), AppRelease::Counted);
        assert_eq!(t.app_release(v), AppRelease::ReleaseReal(500));
        assert!(
            !t.app_retain(v),
            "retained after the last release: keep the driver's"
        );
        assert_eq!(t.app_release(v), AppRelease::ReleaseReal(500));
    }

    #[test]
    fn a_handle_mapped_twice_or_in_part_is_left_to_the_driver() {
        let mut t = Table::new();
        let v = t.virtualize(500, 2 * MB2, 0, (PROP, PROP));
        t.app_map_virtual(0x7000_0000, 2 * MB2, 0, v);
        assert!(t.listing()[0].converted);
        t.app_map_virtual(0x9000_0000, 2 * MB2, 0, v);
        let l = t.listing();
        assert_eq!(l.len(), 2);
        assert!(l.iter().all(|e| !e.converted), "both demoted: {l:?}");
        assert_eq!(t.summary().converted_bytes, 0);
        t.record_app_unmap(0x7000_0000, 2 * MB2);
        t.record_app_unmap(0x9000_0000, 2 * MB2);
        t.app_map_virtual(0x7000_0000, 2 * MB2, 0, v);
        assert!(!t.listing()[0].converted, "pinned for good");

        let w = t.virtualize(501, 2 * MB2, 0, (PROP, PROP));
        t.app_map_virtual(0xa000_0000, MB2, MB2, w);
        assert!(t.listing().iter().all(|e| !e.converted), "part of a handle");

        let x = t.virtualize(502, MB2, 0, (PROP, PROP));
        t.app_map_virtual(0xb000_0000, MB2, 0, x);
        assert!(
            t.listing()
                .iter()
                .any(|e| e.addr == 0xb000_0000 && e.converted)
        );
        t.pin(x); // bound to a multicast object
        assert!(t.listing().iter().all(|e| !e.converted), "pinned");
        assert_eq!(t.real_handle(x), Some(Some(502)), "still translated");
    }

    #[test]
    fn an_app_mapping_being_unmapped_is_no_longer_movable() {
        let mut t = Table::new();
        let v = t.virtualize(
            0x51,
            2 << 20,
            0,
            (
                [0; std::mem::size_of::<PropBytes>()],
                [0; std::mem::size_of::<PropBytes>()],
            ),
        );
        t.app_map_virtual(0x4000_0000, 2 << 20, 0, v);
        // A thread stopped between this and the driver's unmap leaves it to the driver.
        t.begin_app_unmap(0x4000_0000, 2 << 20);
        assert_eq!(t.converted().count(), 0);
        assert!(
            t.listing()
                .iter()
                .any(|l| l.addr == 0x4000_0000 && !l.converted)
        );
        // The unmap done: nothing of it is left, and the handle may be mapped (and moved) again.
        t.record_app_unmap(0x4000_0000, 2 << 20);
        assert!(t.listing().is_empty());
        t.app_map_virtual(0x4000_0000, 2 << 20, 0, v);
        assert_eq!(t.converted().count(), 1);
    }

    #[test]
    fn converted_allocs_are_found_by_any_overlap() {
        let mut t = Table::new();
        t.insert_converted(0, 0x1000_0000, 4 << 20, 7);
        let v = t.virtualize(
            0x51,
            2 << 20,
            0,
            (
                [0; std::mem::size_of::<PropBytes>()],
                [0; std::mem::size_of::<PropBytes>()],
            ),
        );
        t.app_map_virtual(0x2000_0000, 2 << 20, 0, v);
        assert!(t.overlaps_converted_alloc(0x1000_0000, 4096));
        assert!(t.overlaps_converted_alloc(0x1020_0000, 1 << 20), "inside");
        assert!(
            t.overlaps_converted_alloc(0x0f00_0000, 0x0100_1000),
            "reaching into it"
        );
        assert!(
            !t.overlaps_converted_alloc(0x1040_0000, 4096),
            "just past its end"
        );
        assert!(
            !t.overlaps_converted_alloc(0x0f00_0000, 0x0100_0000),
            "just before it"
        );
        assert!(
            !t.overlaps_converted_alloc(0x2000_0000, 2 << 20),
            "the application's own"
        );
    }

    #[test]
    fn live_state_checks_id_range_and_backing() {
        use LiveState::*;
        let mut t = Table::new();
        let id = t.insert_converted(0, 0x1000_0000, 4 << 20, 7);
        assert_eq!(t.live_state(id, None, 0x1000_0000, 4 << 20), Mapped);
        assert_eq!(t.live_state(id, None, 0x1020_0000, 2 << 20), Mapped);
        assert_eq!(
            t.live_state(id, None, 0x1020_0000, (2 << 20) + 1),
            Gone,
            "past the end"
        );
        assert_eq!(
            t.live_state(id + 1, None, 0x1000_0000, 1),
            Gone,
            "another id there"
        );
        assert_eq!(
            t.live_state(id, None, 0x0fff_f000, 1),
            Gone,
            "below the base"
        );
        t.mark_released(0x1000_0000).unwrap();
        assert_eq!(t.live_state(id, None, 0x1000_0000, 1), Gone, "released");
        t.mark_mapped(0x1000_0000, 8, false).unwrap();
        t.remove_converted(0x1000_0000);
        assert_eq!(t.live_state(id, None, 0x1000_0000, 1), Gone, "freed");
    }

    #[test]
    fn live_state_follows_an_application_handle_through_a_remap() {
        use LiveState::*;
        let mut t = Table::new();
        let v = t.virtualize(
            0x51,
            2 << 20,
            0,
            (
                [0; std::mem::size_of::<PropBytes>()],
                [0; std::mem::size_of::<PropBytes>()],
            ),
        );
        t.app_map_virtual(0x4000_0000, 2 << 20, 0, v);
        let id = t.converted().next().expect("movable").id;
        assert_eq!(t.live_state(id, Some(v), 0x4000_0000, 1 << 20), Mapped);
        t.begin_app_unmap(0x4000_0000, 2 << 20);
        assert_eq!(t.live_state(id, Some(v), 0x4000_0000, 1 << 20), Remapping);
        t.record_app_unmap(0x4000_0000, 2 << 20);
        assert_eq!(t.live_state(id, Some(v), 0x4000_0000, 1 << 20), Remapping);
        // Mapped again: a new entry, the same handle and so the same memory.
        t.app_map_virtual(0x4000_0000, 2 << 20, 0, v);
        assert_ne!(t.converted().next().unwrap().id, id);
        assert_eq!(t.live_state(id, Some(v), 0x4000_0000, 1 << 20), Mapped);
        // Unmapped and released by the application: gone for good.
        t.begin_app_unmap(0x4000_0000, 2 << 20);
        t.record_app_unmap(0x4000_0000, 2 << 20);
        assert_eq!(t.app_release(v), AppRelease::ReleaseReal(0x51));
        assert_eq!(t.live_state(id, Some(v), 0x4000_0000, 1 << 20), Gone);
    }

    #[test]
    fn a_keeper_s_entry_is_the_job_s_address_mapped_elsewhere() {
        let mut t = Table::new();
        t.insert_adopted(7, 0, (0x7fc4_dba0_0000, 0x7f00_0000_0000), MB2, 0x11);
        t.insert_expected(
            9,
            0,
            (0x7fc4_dbe0_0000, 0x7fc4_dbe0_0000),
            MB2,
            (true, None),
        );
        let (spans, released) = crate::session::spans_of(&t);
        let got: Vec<(u64, u64, u64)> = spans.iter().map(|s| (s.id, s.addr, s.at)).collect();
        assert_eq!(
            got,
            vec![
                (7, 0x7fc4_dba0_0000, 0x7f00_0000_0000),
                (9, 0x7fc4_dbe0_0000, 0x7fc4_dbe0_0000),
            ]
        );
        assert_eq!(released, vec![false, true]);
        // Found, marked and listed by the job's address.
        assert_eq!(t.mark_released(0x7fc4_dba0_0000), Ok((0x11, true)));
        assert!(t.listing().iter().all(|l| l.addr >> 32 == 0x7fc4));
        // The job's own entries are mapped where they are.
        let id = t.insert_converted(0, 0x1000_0000, MB2, 0x12);
        let c = t.converted().find(|c| c.id == id).unwrap();
        assert_eq!(c.mapped_at, c.addr);
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
