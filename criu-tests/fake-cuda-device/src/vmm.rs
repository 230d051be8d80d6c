//! The VMM calls: address reservations are `PROT_NONE` anonymous mappings, physical memory
//! handles are memfds, `cuMemMap` maps a memfd over (part of) a reservation, `cuMemUnmap` puts
//! the reservation back.
//!
//! A handle is [`HANDLE_TAG`] | fd, so a handle that is not one of ours (or a stale one whose fd
//! was reused) is refused with `CUDA_ERROR_INVALID_HANDLE` rather than mapping some other file.
//! Ranges are checked against `/proc/self/maps` before `mmap(MAP_FIXED)` replaces them.
//!
//! Shareable handles (POSIX fds), as the driver's: `cuMemCreate` remembers whether
//! `requestedHandleTypes` asked for [`HANDLE_TYPE_POSIX_FD`]; `cuMemExportToShareableHandle` of
//! such a handle returns a new open file of the same memfd (any other handle: `CUDA_ERROR_INVALID_VALUE`,
//! an imported one included, as the driver refuses to export those again);
//! `cuMemImportFromShareableHandle` makes a handle from such an fd, in any process. The memfd
//! lives while any fd or mapping of it does, so the exporter's `cuMemRelease` frees nothing an
//! exported fd or an import still holds.

use std::ffi::c_void;

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use crate::call::{self, CuResult, debug, invalid, put};
use crate::codes::{
    CUresult, INVALID_DEVICE, INVALID_HANDLE, NOT_SUPPORTED, OPERATING_SYSTEM, OUT_OF_MEMORY,
};
use crate::ctx::{charge, check_device, need_context, refund};
use crate::maps;

pub type CUdeviceptr = u64;
pub type Handle = u64;

/// Allocation granularity (minimum and recommended), as on current NVIDIA GPUs.
pub const GRANULARITY: u64 = 2 << 20;

/// High bits of every handle this library hands out; the low 32 bits are the memfd.
pub const HANDLE_TAG: u64 = 0xfa4e_0000_0000_0000;

/// The memfd name (`/proc/<pid>/maps` shows `/memfd:fakecuda-dev (deleted)`).
pub const MEMFD_NAME: &std::ffi::CStr = c"fakecuda-dev";

/// The properties a memfd's memory was created with travel in its name, after this prefix
/// (`fakecuda-dev:d<device>:t<handle types, hex>:f<allocFlags, 16 hex digits>`), so that an
/// import in another process reads them back as the driver keeps them with the physical memory.
const PROPS_IN_NAME: &str = "fakecuda-dev:";

/// The memfd name recording `p` (a checked property struct).
fn memfd_name_of(p: &AllocationProp) -> std::ffi::CString {
    let name = format!(
        "{PROPS_IN_NAME}d{}:t{:x}:f{}",
        p.location.id,
        p.requested_handle_types,
        p.alloc_flags
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    // Digits, letters and colons only: never a NUL.
    std::ffi::CString::new(name).unwrap_or_else(|_| MEMFD_NAME.to_owned())
}

/// The properties recorded in the name of memfd `fd` ([`memfd_name_of`]).
fn props_of_memfd(fd: i32) -> Option<AllocationProp> {
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    let link = link.to_string_lossy();
    let rest = link.strip_prefix("/memfd:")?.strip_prefix(PROPS_IN_NAME)?;
    let rest = rest.split(' ').next()?;
    let mut fields = rest.split(':');
    let id: i32 = fields.next()?.strip_prefix('d')?.parse().ok()?;
    let types = u32::from_str_radix(fields.next()?.strip_prefix('t')?, 16).ok()?;
    let flags_hex = fields.next()?.strip_prefix('f')?;
    if flags_hex.len() != 16 {
        return None;
    }
    let mut alloc_flags = [0u8; 8];
    for (i, b) in alloc_flags.iter_mut().enumerate() {
        *b = u8::from_str_radix(&flags_hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(AllocationProp {
        type_: ALLOCATION_PINNED,
        requested_handle_types: types,
        location: Location {
            type_: LOCATION_DEVICE,
            id,
        },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags,
    })
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: u32 = 1;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
const ALLOCATION_PINNED: u32 = 1;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: the only shareable handle type played here.
pub const HANDLE_TYPE_POSIX_FD: u32 = 1;
/// Every `CUmemAllocationHandleType` bit cuda.h defines (POSIX fd, Win32, Win32 KMT, fabric).
const HANDLE_TYPES_KNOWN: u32 = 0x1 | 0x2 | 0x4 | 0x8;

/// How a live handle came to be, which decides whether it may be exported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// `cuMemCreate` with a POSIX-fd handle type requested.
    CreatedExportable,
    /// `cuMemImportFromShareableHandle` (not charged: the exporter's memory).
    Imported,
}

/// The handles (by memfd) that are not plain `cuMemCreate` ones; a plain one has no entry.
static ORIGINS: Mutex<BTreeMap<i32, Origin>> = Mutex::new(BTreeMap::new());

fn origins() -> MutexGuard<'static, BTreeMap<i32, Origin>> {
    ORIGINS.lock().unwrap_or_else(|e| e.into_inner())
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Location {
    pub type_: u32,
    pub id: i32,
}

/// `CUmemAllocationProp` (CUDA 13 cuda.h), 32 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AllocationProp {
    pub type_: u32,
    pub requested_handle_types: u32,
    pub location: Location,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`, 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AccessDesc {
    pub location: Location,
    pub flags: u32,
}

fn aligned(x: u64) -> bool {
    x.is_multiple_of(GRANULARITY)
}

/// Checks a property struct: pinned memory on one of the devices.
///
/// # Safety
/// `prop` must be null or point at a readable `CUmemAllocationProp`.
unsafe fn check_prop(call: &str, prop: *const AllocationProp) -> CuResult {
    if prop.is_null() {
        return invalid(call, format_args!("no allocation property"));
    }
    // SAFETY: readable per the caller.
    let p = unsafe { prop.read_unaligned() };
    if p.type_ != ALLOCATION_PINNED {
        return invalid(
            call,
            format_args!("allocation type {} (only pinned)", p.type_),
        );
    }
    if p.location.type_ != LOCATION_DEVICE || check_device(p.location.id).is_err() {
        debug(format_args!(
            "{call}: location type {} id {} (not a device)",
            p.location.type_, p.location.id
        ));
        return Err(INVALID_DEVICE);
    }
    Ok(())
}

pub unsafe extern "C" fn get_granularity(
    granularity: *mut usize,
    prop: *const AllocationProp,
    _option: u32,
) -> CUresult {
    call::run("cuMemGetAllocationGranularity", || {
        need_context()?;
        // SAFETY: prop is null or the caller's readable struct.
        unsafe { check_prop("cuMemGetAllocationGranularity", prop)? };
        // SAFETY: the caller's out pointer, checked for null by put.
        unsafe { put(granularity, GRANULARITY as usize) }
    })
}

fn os_error(call: &str, what: &str) -> CUresult {
    debug(format_args!(
        "{call}: {what}: {}",
        std::io::Error::last_os_error()
    ));
    OPERATING_SYSTEM
}

/// Environment variable: `1` makes every address a `cuMemAddressReserve` wishes for count as
/// taken: the reservation is made elsewhere (never at the wished address), as the real driver
/// does where the process's own mappings hold it (a keeper mapping a job's memory at the job's
/// addresses found them taken on an H200).
pub const ADDRESS_TAKEN_ENV: &str = "FAKECUDA_ADDRESS_TAKEN";

fn wished_addresses_taken() -> bool {
    static TAKEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TAKEN.get_or_init(|| std::env::var(ADDRESS_TAKEN_ENV).is_ok_and(|v| v == "1"))
}

/// `mmap(PROT_NONE)` of `len` bytes at `hint` (0: anywhere), not fixed.
fn map_none(hint: u64, len: usize) -> *mut c_void {
    // SAFETY: a new anonymous mapping; the hint is only a hint (no MAP_FIXED).
    unsafe {
        libc::mmap(
            hint as *mut c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    }
}

fn unmap_range(start: u64, len: u64) {
    if len > 0 {
        // SAFETY: the range is part of a PROT_NONE mapping this call made and owns.
        unsafe { libc::munmap(start as *mut c_void, len as usize) };
    }
}

pub unsafe extern "C" fn address_reserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    addr: CUdeviceptr,
    _flags: u64,
) -> CUresult {
    const CALL: &str = "cuMemAddressReserve";
    call::run(CALL, || {
        need_context()?;
        let size = size as u64;
        let align = (alignment as u64).max(GRANULARITY);
        if ptr.is_null() || size == 0 || !aligned(size) || !align.is_power_of_two() {
            return invalid(
                CALL,
                format_args!(
                    "size {size} alignment {alignment} (size a multiple of {GRANULARITY})"
                ),
            );
        }
        let taken = addr != 0 && wished_addresses_taken();
        if taken {
            debug(format_args!(
                "{CALL}: {addr:#x} counts as taken ({ADDRESS_TAKEN_ENV}=1)"
            ));
        } else if addr != 0 && addr.is_multiple_of(align) {
            let p = map_none(addr, size as usize);
            if p as u64 == addr {
                // SAFETY: the caller's out pointer, checked for null above.
                return unsafe { put(ptr, addr) };
            }
            if p != libc::MAP_FAILED {
                unmap_range(p as u64, size);
            }
        }
        // Room for one more alignment step where the wished address is taken, so that the
        // reservation can step past it should the kernel pick it.
        let spare = if taken { 2 * align } else { align };
        let total = size.checked_add(spare).ok_or(OUT_OF_MEMORY)?;
        let p = map_none(0, total as usize);
        if p == libc::MAP_FAILED {
            return Err(os_error(CALL, "mmap"));
        }
        let base = p as u64;
        let mut start = base.next_multiple_of(align);
        if taken && start == addr {
            start += align;
        }
        unmap_range(base, start - base);
        unmap_range(start + size, base + total - (start + size));
        // SAFETY: the caller's out pointer, checked for null above.
        unsafe { put(ptr, start) }
    })
}

pub unsafe extern "C" fn address_free(ptr: CUdeviceptr, size: usize) -> CUresult {
    const CALL: &str = "cuMemAddressFree";
    call::run(CALL, || {
        need_context()?;
        let size = size as u64;
        if ptr == 0 || !aligned(ptr) || size == 0 || !aligned(size) {
            return invalid(CALL, format_args!("range {ptr:#x} + {size}"));
        }
        // SAFETY: the caller gives back a reservation of this size (the driver's contract);
        // munmap of an unmapped range is harmless.
        if unsafe { libc::munmap(ptr as *mut c_void, size as usize) } != 0 {
            return Err(os_error(CALL, "munmap"));
        }
        Ok(())
    })
}

/// The memfd behind one of our handles, and its size.
fn handle_fd(call: &str, handle: Handle) -> Result<(i32, u64), CUresult> {
    if handle & !0xffff_ffff != HANDLE_TAG {
        debug(format_args!(
            "{call}: {handle:#x} is not a handle of this driver"
        ));
        return Err(INVALID_HANDLE);
    }
    let fd = (handle & 0xffff_ffff) as i32;
    let ours = is_device_memfd(fd);
    // SAFETY: stat is plain data; fstat fills it or fails.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on any integer is safe; it fails for a closed descriptor.
    if !ours || unsafe { libc::fstat(fd, &mut st) } != 0 {
        debug(format_args!(
            "{call}: handle {handle:#x}: fd {fd} is not a live memfd of this driver"
        ));
        return Err(INVALID_HANDLE);
    }
    Ok((fd, st.st_size as u64))
}

pub unsafe extern "C" fn create(
    handle: *mut Handle,
    size: usize,
    prop: *const AllocationProp,
    flags: u64,
) -> CUresult {
    const CALL: &str = "cuMemCreate";
    call::run(CALL, || {
        need_context()?;
        // SAFETY: prop is null or the caller's readable struct.
        unsafe { check_prop(CALL, prop)? };
        let size = size as u64;
        if handle.is_null() || size == 0 || !aligned(size) || flags != 0 {
            return invalid(CALL, format_args!("size {size} flags {flags:#x}"));
        }
        // SAFETY: checked readable by check_prop.
        let asked = unsafe { prop.read_unaligned() };
        let types = asked.requested_handle_types;
        // allocFlags: compressionType, gpuDirectRDMACapable, usage (u16), reserved[4]. The
        // driver stores what it accepts and returns it from
        // cuMemGetAllocationPropertiesFromHandle; a flag byte that is not 0 or 1, or the
        // reserved bytes set, are refused here as invalid.
        let flags = asked.alloc_flags;
        if flags[1] > 1 || flags[4..].iter().any(|&b| b != 0) {
            return invalid(CALL, format_args!("allocation flags {flags:02x?}"));
        }
        if types & !HANDLE_TYPES_KNOWN != 0 {
            return invalid(CALL, format_args!("requested handle types {types:#x}"));
        }
        if types & !HANDLE_TYPE_POSIX_FD != 0 {
            debug(format_args!(
                "{CALL}: requested handle types {types:#x} (only POSIX fds are played)"
            ));
            return Err(NOT_SUPPORTED);
        }
        charge(size)?;
        let name = memfd_name_of(&asked);
        // SAFETY: a valid name and flags.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            refund(size);
            return Err(os_error(CALL, "memfd_create"));
        }
        // SAFETY: fd is the memfd just created.
        if unsafe { libc::ftruncate(fd, size as libc::off_t) } != 0 {
            let e = os_error(CALL, "ftruncate");
            // SAFETY: our own descriptor, used by nobody else yet.
            unsafe { libc::close(fd) };
            refund(size);
            return Err(e);
        }
        let mut o = origins();
        if types & HANDLE_TYPE_POSIX_FD != 0 {
            o.insert(fd, Origin::CreatedExportable);
        } else {
            // A stale entry of a descriptor number closed behind the driver's back.
            o.remove(&fd);
        }
        // SAFETY: the caller's out pointer, checked for null above.
        unsafe { put(handle, HANDLE_TAG | fd as u32 as u64) }
    })
}

/// A new close-on-exec open file of the memfd behind `fd` (`/proc/self/fd/N` opened again):
/// as the driver's, an exported fd (a new open of `/dev/nvidiactl` there) and the memory an
/// import holds are not the same open file as anything else, which is how gpusnap tells one
/// export from another (`kcmp`).
fn reopen_cloexec(call: &str, fd: i32) -> Result<i32, CUresult> {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}"))
        .map_err(|_| os_error(call, "a path with a NUL"))?;
    // SAFETY: open(2) of a NUL-terminated path.
    let new = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if new < 0 {
        return Err(os_error(call, "open(/proc/self/fd/N)"));
    }
    Ok(new)
}

/// Whether `fd` is an open memfd of this driver (in whichever process it was made).
fn is_device_memfd(fd: i32) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .is_ok_and(|p| p.to_string_lossy().starts_with("/memfd:fakecuda-dev"))
}

pub unsafe extern "C" fn export_to_shareable_handle(
    out: *mut c_void,
    handle: Handle,
    handle_type: u32,
    flags: u64,
) -> CUresult {
    const CALL: &str = "cuMemExportToShareableHandle";
    call::run(CALL, || {
        need_context()?;
        if out.is_null() || flags != 0 {
            return invalid(CALL, format_args!("out {out:p} flags {flags:#x}"));
        }
        let (fd, _) = handle_fd(CALL, handle)?;
        if handle_type != HANDLE_TYPE_POSIX_FD {
            debug(format_args!(
                "{CALL}: handle type {handle_type:#x} (only POSIX fds are played)"
            ));
            return Err(
                if handle_type & !HANDLE_TYPES_KNOWN != 0 || handle_type == 0 {
                    crate::codes::INVALID_VALUE
                } else {
                    NOT_SUPPORTED
                },
            );
        }
        match origins().get(&fd) {
            Some(Origin::CreatedExportable) => {}
            Some(Origin::Imported) => {
                return invalid(CALL, format_args!("{handle:#x} was imported"));
            }
            None => {
                return invalid(
                    CALL,
                    format_args!("{handle:#x} was not created with a POSIX-fd handle type"),
                );
            }
        }
        let new = reopen_cloexec(CALL, fd)?;
        // SAFETY: the caller's out pointer (an int for POSIX fds), checked for null above.
        unsafe { put(out.cast::<i32>(), new) }
    })
}

pub unsafe extern "C" fn import_from_shareable_handle(
    handle: *mut Handle,
    os_handle: *mut c_void,
    handle_type: u32,
) -> CUresult {
    const CALL: &str = "cuMemImportFromShareableHandle";
    call::run(CALL, || {
        need_context()?;
        if handle.is_null() {
            return invalid(CALL, format_args!("null handle"));
        }
        if handle_type != HANDLE_TYPE_POSIX_FD {
            debug(format_args!(
                "{CALL}: handle type {handle_type:#x} (only POSIX fds are played)"
            ));
            return Err(NOT_SUPPORTED);
        }
        // A POSIX fd is passed as the pointer's value.
        let Ok(fd) = i32::try_from(os_handle as usize) else {
            return invalid(CALL, format_args!("{os_handle:p} is not a descriptor"));
        };
        if !is_device_memfd(fd) {
            return invalid(
                CALL,
                format_args!("fd {fd} is not memory exported by this driver"),
            );
        }
        let new = reopen_cloexec(CALL, fd)?;
        origins().insert(new, Origin::Imported);
        // SAFETY: the caller's out pointer, checked for null above.
        unsafe { put(handle, HANDLE_TAG | new as u32 as u64) }
    })
}

/// `cuMemGetAllocationPropertiesFromHandle`: the properties the memory was created with, for a
/// created or an imported handle alike (they travel with the memory).
pub unsafe extern "C" fn get_allocation_properties_from_handle(
    prop: *mut AllocationProp,
    handle: Handle,
) -> CUresult {
    const CALL: &str = "cuMemGetAllocationPropertiesFromHandle";
    call::run(CALL, || {
        need_context()?;
        if prop.is_null() {
            return invalid(CALL, format_args!("null property pointer"));
        }
        let (fd, _) = handle_fd(CALL, handle)?;
        let Some(p) = props_of_memfd(fd) else {
            return invalid(CALL, format_args!("{handle:#x}: no properties recorded"));
        };
        // SAFETY: the caller's out pointer, checked for null above; written unaligned.
        unsafe { prop.write_unaligned(p) };
        Ok(())
    })
}

pub unsafe extern "C" fn release(handle: Handle) -> CUresult {
    const CALL: &str = "cuMemRelease";
    call::run(CALL, || {
        need_context()?;
        let (fd, size) = handle_fd(CALL, handle)?;
        let origin = origins().remove(&fd);
        // SAFETY: the memfd behind a handle of ours; the handle is dead after this call, and a
        // mapping made from it stays valid (as the driver's does until it is unmapped), as does
        // any exported fd of it.
        unsafe { libc::close(fd) };
        if origin != Some(Origin::Imported) {
            refund(size);
        }
        Ok(())
    })
}

pub unsafe extern "C" fn map(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: Handle,
    flags: u64,
) -> CUresult {
    const CALL: &str = "cuMemMap";
    call::run(CALL, || {
        need_context()?;
        let size = size as u64;
        let offset = offset as u64;
        if ptr == 0
            || !aligned(ptr)
            || size == 0
            || !aligned(size)
            || !aligned(offset)
            || flags != 0
        {
            return invalid(
                CALL,
                format_args!("ptr {ptr:#x} size {size} offset {offset} flags {flags:#x}"),
            );
        }
        let (fd, fd_size) = handle_fd(CALL, handle)?;
        if offset.checked_add(size).is_none_or(|e| e > fd_size) {
            return invalid(
                CALL,
                format_args!("offset {offset} + size {size} exceeds the handle's {fd_size} bytes"),
            );
        }
        let vmas = maps::read().map_err(|_| OPERATING_SYSTEM)?;
        let end = ptr.checked_add(size).ok_or(crate::codes::INVALID_VALUE)?;
        if !maps::covered(&vmas, ptr, end, |v| v.perms == "---p" && v.inode == 0) {
            return invalid(
                CALL,
                format_args!(
                    "{ptr:#x}..{end:#x} is not an unmapped part of a reservation ({})",
                    maps::describe(&vmas, ptr, end)
                ),
            );
        }
        // SAFETY: the range is a PROT_NONE reservation of ours (checked above), replaced by a
        // shared mapping of the handle's memfd, which is long enough (checked above).
        let p = unsafe {
            libc::mmap(
                ptr as *mut c_void,
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error(CALL, "mmap"));
        }
        Ok(())
    })
}

/// Whether a mapping is device memory of ours (a memfd of this driver, mapped shared).
fn is_device_memory(v: &maps::Vma) -> bool {
    v.perms.starts_with("rw") && v.perms.ends_with('s') && v.path.starts_with("/memfd:fakecuda-dev")
}

pub unsafe extern "C" fn unmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    const CALL: &str = "cuMemUnmap";
    call::run(CALL, || {
        need_context()?;
        let size = size as u64;
        if ptr == 0 || !aligned(ptr) || size == 0 || !aligned(size) {
            return invalid(CALL, format_args!("ptr {ptr:#x} size {size}"));
        }
        let vmas = maps::read().map_err(|_| OPERATING_SYSTEM)?;
        let end = ptr.checked_add(size).ok_or(crate::codes::INVALID_VALUE)?;
        if !maps::covered(&vmas, ptr, end, is_device_memory) {
            return invalid(
                CALL,
                format_args!(
                    "{ptr:#x}..{end:#x} is not mapped device memory ({})",
                    maps::describe(&vmas, ptr, end)
                ),
            );
        }
        // SAFETY: the range is device memory mapped by cuMemMap (checked above); it becomes a
        // PROT_NONE reservation again, with no pages.
        let p = unsafe {
            libc::mmap(
                ptr as *mut c_void,
                size as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error(CALL, "mmap"));
        }
        Ok(())
    })
}

pub unsafe extern "C" fn set_access(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const AccessDesc,
    count: usize,
) -> CUresult {
    const CALL: &str = "cuMemSetAccess";
    call::run(CALL, || {
        need_context()?;
        if ptr == 0 || size == 0 || desc.is_null() || count == 0 {
            return invalid(
                CALL,
                format_args!("ptr {ptr:#x} size {size} {count} descriptors"),
            );
        }
        for i in 0..count {
            // SAFETY: the caller passes `count` readable descriptors.
            let d = unsafe { desc.add(i).read_unaligned() };
            if d.location.type_ != LOCATION_DEVICE || check_device(d.location.id).is_err() {
                debug(format_args!(
                    "{CALL}: descriptor {i}: location type {} id {}",
                    d.location.type_, d.location.id
                ));
                return Err(INVALID_DEVICE);
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_sizes_match_cuda_h() {
        assert_eq!(std::mem::size_of::<AllocationProp>(), 32);
        assert_eq!(std::mem::offset_of!(AllocationProp, location), 8);
        assert_eq!(std::mem::size_of::<AccessDesc>(), 12);
        assert_eq!(
            std::mem::offset_of!(AllocationProp, requested_handle_types),
            4
        );
        assert_eq!(
            std::mem::offset_of!(AllocationProp, win32_handle_meta_data),
            16
        );
        assert_eq!(std::mem::offset_of!(AllocationProp, alloc_flags), 24);
    }

    fn with_context() {
        // SAFETY: plain calls with valid arguments.
        unsafe {
            assert_eq!(crate::rt::init(0), 0);
            assert_eq!(crate::ctx::ctx_set_current(crate::ctx::primary(0)), 0);
        }
    }

    fn prop(handle_types: u32) -> AllocationProp {
        AllocationProp {
            type_: ALLOCATION_PINNED,
            requested_handle_types: handle_types,
            location: Location {
                type_: LOCATION_DEVICE,
                id: 0,
            },
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: [0; 8],
        }
    }

    fn create_with(handle_types: u32) -> Result<Handle, CUresult> {
        let mut h = 0;
        // SAFETY: valid out pointer and property struct.
        match unsafe { create(&mut h, GRANULARITY as usize, &prop(handle_types), 0) } {
            0 => Ok(h),
            e => Err(e),
        }
    }

    fn export(h: Handle) -> Result<i32, CUresult> {
        let mut fd: i32 = -1;
        // SAFETY: an int out pointer, as for POSIX fds.
        match unsafe {
            export_to_shareable_handle((&raw mut fd).cast(), h, HANDLE_TYPE_POSIX_FD, 0)
        } {
            0 => Ok(fd),
            e => Err(e),
        }
    }

    fn import(fd: i32) -> Result<Handle, CUresult> {
        let mut h = 0;
        // SAFETY: a valid out pointer; the fd is passed as the pointer's value.
        match unsafe { import_from_shareable_handle(&mut h, fd as usize as *mut c_void, 1) } {
            0 => Ok(h),
            e => Err(e),
        }
    }

    /// Maps `h` over a new reservation; returns its address.
    fn map_new(h: Handle) -> u64 {
        let mut addr = 0;
        // SAFETY: valid arguments; the reservation is this test's.
        unsafe {
            assert_eq!(address_reserve(&mut addr, GRANULARITY as usize, 0, 0, 0), 0);
            assert_eq!(map(addr, GRANULARITY as usize, 0, h, 0), 0);
        }
        addr
    }

    fn unmap_free(addr: u64) {
        // SAFETY: a mapping made by map_new.
        unsafe {
            assert_eq!(unmap(addr, GRANULARITY as usize), 0);
            assert_eq!(address_free(addr, GRANULARITY as usize), 0);
        }
    }

    #[test]
    fn an_exported_fd_keeps_the_memory_past_the_release_and_imports_as_the_same_memory() {
        with_context();
        let h = create_with(HANDLE_TYPE_POSIX_FD).unwrap();
        let a = map_new(h);
        // SAFETY: a is a mapped, writable range of GRANULARITY bytes.
        unsafe { std::ptr::write_bytes(a as *mut u8, 0x5a, GRANULARITY as usize) };
        let fd = export(h).unwrap();
        assert_ne!((fd as u64), h & 0xffff_ffff, "a new descriptor");
        unmap_free(a);
        // SAFETY: releasing the handle created above.
        assert_eq!(unsafe { release(h) }, 0);
        let imported = import(fd).unwrap();
        // SAFETY: our descriptor; the import holds its own.
        unsafe { libc::close(fd) };
        let b = map_new(imported);
        // SAFETY: b is mapped for GRANULARITY bytes.
        let seen = unsafe { std::slice::from_raw_parts(b as *const u8, GRANULARITY as usize) };
        assert!(seen.iter().all(|&x| x == 0x5a), "the exporter's bytes");
        assert_eq!(
            export(imported),
            Err(crate::codes::INVALID_VALUE),
            "no re-export"
        );
        unmap_free(b);
        // SAFETY: the imported handle, released once.
        assert_eq!(unsafe { release(imported) }, 0);
        // SAFETY: a released handle is no longer valid.
        assert_eq!(unsafe { release(imported) }, INVALID_HANDLE);
    }

    #[test]
    fn only_handles_created_with_posix_fds_export() {
        with_context();
        let plain = create_with(0).unwrap();
        assert_eq!(export(plain), Err(crate::codes::INVALID_VALUE));
        let mut fd = -1;
        let h = create_with(HANDLE_TYPE_POSIX_FD).unwrap();
        // SAFETY: valid out pointer; handle types the stand-in does not play.
        unsafe {
            assert_eq!(
                export_to_shareable_handle((&raw mut fd).cast(), h, 8, 0),
                NOT_SUPPORTED
            );
            assert_eq!(
                export_to_shareable_handle((&raw mut fd).cast(), h, 0, 0),
                crate::codes::INVALID_VALUE
            );
            assert_eq!(
                export_to_shareable_handle((&raw mut fd).cast(), h, 1, 1),
                crate::codes::INVALID_VALUE,
                "flags must be 0"
            );
            assert_eq!(release(plain), 0);
            assert_eq!(release(h), 0);
        }
        assert_eq!(create_with(8), Err(NOT_SUPPORTED), "fabric");
        assert_eq!(create_with(0x100), Err(crate::codes::INVALID_VALUE));
        // An fd that is not exported device memory does not import.
        let file = std::fs::File::open("/proc/self/maps").unwrap();
        use std::os::fd::AsRawFd;
        assert_eq!(import(file.as_raw_fd()), Err(crate::codes::INVALID_VALUE));
        assert_eq!(import(-1), Err(crate::codes::INVALID_VALUE));
    }

    /// As driver r580: legacy IPC of VMM memory is `CUDA_ERROR_INVALID_VALUE`.
    #[test]
    fn legacy_ipc_refuses_vmm_memory() {
        with_context();
        let h = create_with(HANDLE_TYPE_POSIX_FD).unwrap();
        let a = map_new(h);
        let mut ipc = crate::alloc::IpcMemHandle { reserved: [0; 64] };
        for p in [a, a + 4096] {
            // SAFETY: a valid out pointer.
            let rc = unsafe { crate::alloc::ipc_get_mem_handle(&mut ipc, p) };
            assert_eq!(rc, crate::codes::INVALID_VALUE);
        }
        unmap_free(a);
        // SAFETY: the handle created above.
        assert_eq!(unsafe { release(h) }, 0);
    }

    #[test]
    fn devices_say_posix_fd_handles_are_supported() {
        with_context();
        let mut v = 0;
        // SAFETY: valid out pointer.
        unsafe {
            assert_eq!(
                crate::ctx::device_get_attribute(
                    &mut v,
                    crate::ctx::ATTRIBUTE_POSIX_FD_SUPPORTED,
                    0
                ),
                0
            );
            assert_eq!(v, 1);
            assert_eq!(
                crate::ctx::device_get_attribute(&mut v, 100_000, 0),
                crate::codes::INVALID_VALUE
            );
            assert_eq!(
                crate::ctx::device_get_attribute(&mut v, 103, 99),
                INVALID_DEVICE
            );
        }
    }
}
