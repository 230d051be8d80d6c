//! `cuMemAlloc_v2`, `cuMemAllocPitch_v2`, `cuMemFree_v2`: plain device allocations (what the
//! agent leaves to the driver: small ones, or any when it is not loaded) are private anonymous
//! mappings, page-aligned (2 MiB-aligned from 2 MiB on, as the driver's are), with a size table
//! for `cuMemFree`. CRIU dumps them as ordinary process memory.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use crate::call::{self, CuResult, invalid, put};
use crate::codes::{CUresult, OPERATING_SYSTEM};
use crate::ctx::{charge, need_context, refund};
use crate::vmm::{CUdeviceptr, GRANULARITY};

/// Pitch alignment of `cuMemAllocPitch`.
pub const PITCH_ALIGN: u64 = 512;

const PAGE: u64 = 4096;

/// Base address → mapped length of every live allocation.
static ALLOCS: Mutex<BTreeMap<u64, u64>> = Mutex::new(BTreeMap::new());

fn allocs() -> MutexGuard<'static, BTreeMap<u64, u64>> {
    ALLOCS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Maps `size` bytes (rounded up to whole pages), aligned to `align`; returns the base.
fn map_aligned(size: u64, align: u64) -> Result<u64, CUresult> {
    let len = size
        .checked_next_multiple_of(PAGE)
        .ok_or(crate::codes::OUT_OF_MEMORY)?;
    let total = len + align.saturating_sub(PAGE);
    // SAFETY: a new anonymous private mapping, nothing fixed.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        call::debug(format_args!(
            "cuMemAlloc: mmap of {total} bytes: {}",
            std::io::Error::last_os_error()
        ));
        return Err(OPERATING_SYSTEM);
    }
    let base = p as u64;
    let start = base.next_multiple_of(align);
    for (s, l) in [
        (base, start - base),
        (start + len, base + total - (start + len)),
    ] {
        if l > 0 {
            // SAFETY: the trimmed ends of the mapping just made.
            unsafe { libc::munmap(s as *mut c_void, l as usize) };
        }
    }
    Ok(start)
}

fn alloc(call: &str, size: u64) -> Result<CUdeviceptr, CUresult> {
    need_context()?;
    if size == 0 {
        invalid(call, format_args!("size 0"))?;
    }
    let align = if size >= GRANULARITY {
        GRANULARITY
    } else {
        PAGE
    };
    let len = size
        .checked_next_multiple_of(PAGE)
        .ok_or(crate::codes::OUT_OF_MEMORY)?;
    charge(len)?;
    match map_aligned(size, align) {
        Ok(p) => {
            allocs().insert(p, len);
            Ok(p)
        }
        Err(e) => {
            refund(len);
            Err(e)
        }
    }
}

pub unsafe extern "C" fn mem_alloc(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    call::run("cuMemAlloc_v2", || {
        if dptr.is_null() {
            return invalid("cuMemAlloc_v2", format_args!("null dptr"));
        }
        let p = alloc("cuMemAlloc_v2", size as u64)?;
        // SAFETY: the caller's out pointer, checked for null above.
        unsafe { put(dptr, p) }
    })
}

/// Managed memory, played by a plain allocation.
pub unsafe extern "C" fn mem_alloc_managed(
    dptr: *mut CUdeviceptr,
    size: usize,
    _flags: u32,
) -> CUresult {
    call::run("cuMemAllocManaged", || {
        if dptr.is_null() {
            return invalid("cuMemAllocManaged", format_args!("null dptr"));
        }
        let p = alloc("cuMemAllocManaged", size as u64)?;
        // SAFETY: the caller's out pointer, checked for null above.
        unsafe { put(dptr, p) }
    })
}

/// An IPC handle: the pointer in the first 8 bytes (nothing can open it).
pub unsafe extern "C" fn ipc_get_mem_handle(handle: *mut [u8; 64], ptr: CUdeviceptr) -> CUresult {
    call::run("cuIpcGetMemHandle", || {
        if handle.is_null() {
            return invalid("cuIpcGetMemHandle", format_args!("null handle"));
        }
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(&ptr.to_le_bytes());
        // SAFETY: the caller's out pointer, checked for null above.
        unsafe { put(handle, h) }
    })
}

pub unsafe extern "C" fn mem_alloc_pitch(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: u32,
) -> CUresult {
    const CALL: &str = "cuMemAllocPitch_v2";
    call::run(CALL, || {
        if dptr.is_null() || pitch.is_null() || !matches!(element_size, 4 | 8 | 16) {
            return invalid(CALL, format_args!("element size {element_size}"));
        }
        let p = (width as u64)
            .checked_next_multiple_of(PITCH_ALIGN)
            .filter(|&p| p > 0)
            .ok_or(crate::codes::INVALID_VALUE)?;
        let total = p
            .checked_mul(height as u64)
            .ok_or(crate::codes::INVALID_VALUE)?;
        let base = alloc(CALL, total)?;
        // SAFETY: the caller's out pointers, checked for null above.
        unsafe {
            put(dptr, base)?;
            put(pitch, p as usize)
        }
    })
}

fn free(ptr: CUdeviceptr) -> CuResult {
    need_context()?;
    if ptr == 0 {
        return Ok(());
    }
    let Some(len) = allocs().remove(&ptr) else {
        return invalid(
            "cuMemFree_v2",
            format_args!("{ptr:#x} is not the base of an allocation of cuMemAlloc"),
        );
    };
    // SAFETY: the mapping made by alloc() for this base, with its length; removed from the
    // table above, so nothing else frees it.
    unsafe { libc::munmap(ptr as *mut c_void, len as usize) };
    refund(len);
    Ok(())
}

pub unsafe extern "C" fn mem_free(ptr: CUdeviceptr) -> CUresult {
    call::run("cuMemFree_v2", || free(ptr))
}
