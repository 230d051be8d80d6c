//! The VMM calls: address reservations are `PROT_NONE` anonymous mappings, physical memory
//! handles are memfds, `cuMemMap` maps a memfd over (part of) a reservation, `cuMemUnmap` puts
//! the reservation back.
//!
//! A handle is [`HANDLE_TAG`] | fd, so a handle that is not one of ours (or a stale one whose fd
//! was reused) is refused with `CUDA_ERROR_INVALID_HANDLE` rather than mapping some other file.
//! Ranges are checked against `/proc/self/maps` before `mmap(MAP_FIXED)` replaces them.

use std::ffi::c_void;

use crate::call::{self, CuResult, debug, invalid, put};
use crate::codes::{CUresult, INVALID_DEVICE, INVALID_HANDLE, OPERATING_SYSTEM, OUT_OF_MEMORY};
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

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: u32 = 1;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
const ALLOCATION_PINNED: u32 = 1;

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
        if addr != 0 && addr.is_multiple_of(align) {
            let p = map_none(addr, size as usize);
            if p as u64 == addr {
                // SAFETY: the caller's out pointer, checked for null above.
                return unsafe { put(ptr, addr) };
            }
            if p != libc::MAP_FAILED {
                unmap_range(p as u64, size);
            }
        }
        let total = size.checked_add(align).ok_or(OUT_OF_MEMORY)?;
        let p = map_none(0, total as usize);
        if p == libc::MAP_FAILED {
            return Err(os_error(CALL, "mmap"));
        }
        let base = p as u64;
        let start = base.next_multiple_of(align);
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
    let ours = std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .is_ok_and(|p| p.to_string_lossy().starts_with("/memfd:fakecuda-dev"));
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
        charge(size)?;
        // SAFETY: a valid name and flags.
        let fd = unsafe { libc::memfd_create(MEMFD_NAME.as_ptr(), libc::MFD_CLOEXEC) };
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
        // SAFETY: the caller's out pointer, checked for null above.
        unsafe { put(handle, HANDLE_TAG | fd as u32 as u64) }
    })
}

pub unsafe extern "C" fn release(handle: Handle) -> CUresult {
    const CALL: &str = "cuMemRelease";
    call::run(CALL, || {
        need_context()?;
        let (fd, size) = handle_fd(CALL, handle)?;
        // SAFETY: the memfd behind a handle of ours; the handle is dead after this call, and a
        // mapping made from it stays valid (as the driver's does until it is unmapped).
        unsafe { libc::close(fd) };
        refund(size);
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
    }
}
