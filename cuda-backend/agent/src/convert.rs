//! The allocation path: a `cuMemAlloc` of at least the threshold becomes a VMM mapping (reserve,
//! create, map, set access), recorded in the table; a `cuMemFree` of a converted base address
//! undoes it.
//! Any failure falls back to the real call: the application never fails where it would not have.

use std::panic::AssertUnwindSafe;

use cudarc::driver::sys::CUdeviceptr;

use crate::config::config;
use crate::log::debug;
use crate::real::{CUDA_SUCCESS, CuRes, Driver};
use crate::table::{self, Backing};
use crate::vmm;

/// A converted allocation of `size` bytes on the current context's device, or None to let the
/// real `cuMemAlloc` handle it (too small, disabled, no context, any driver failure). The caller
/// (the hook) starts the agent thread for it: this layer knows nothing of the server.
pub fn try_convert(drv: &Driver, size: u64) -> Option<CUdeviceptr> {
    let cfg = config();
    if cfg.disabled || size == 0 || size < cfg.min_bytes {
        return None;
    }
    std::panic::catch_unwind(AssertUnwindSafe(|| convert(drv, size)))
        .ok()
        .flatten()
}

fn convert(drv: &Driver, size: u64) -> Option<CUdeviceptr> {
    let dev = match drv.current_device() {
        Ok(d) => d,
        Err(e) => {
            debug!("not converting {size} bytes: {e}");
            return None;
        }
    };
    // Driver calls first, then a brief lock: never hold the table across a driver call.
    let a = match vmm::alloc(drv, dev, size) {
        Ok(a) => a,
        Err(e) => {
            debug!("not converting {size} bytes on device {dev}: {e}");
            return None;
        }
    };
    let id = {
        let mut t = table::lock();
        let id = t.insert_converted(dev, a.addr, a.size, a.handle);
        if a.exportable {
            t.set_exportable(a.addr);
        }
        id
    };
    debug!(
        "converted #{id}: {size} bytes -> {:#x} ({} bytes) on device {dev}{}",
        a.addr,
        a.size,
        if a.exportable { ", exportable" } else { "" }
    );
    Some(a.addr)
}

/// Frees `ptr` if it is the base of a converted allocation (Some(status)); None if it is not
/// ours and the real `cuMemFree` must handle it.
pub fn free_converted(drv: &Driver, ptr: CUdeviceptr) -> Option<CuRes> {
    if ptr == 0 {
        return None;
    }
    let entry = table::lock().remove_converted(ptr)?;
    // cuMemFree waits for work that may still use the memory; cuMemUnmap does not promise to.
    // An error here is a previous launch's (the real cuMemFree would report it too): go on.
    if let Err(e) = drv.synchronize_current() {
        debug!("free of #{} at {ptr:#x}: {e}", entry.id);
    }
    let handle = match entry.backing {
        Backing::Mapped(h) => Some(h),
        Backing::Released => None,
    };
    match vmm::free(drv, entry.addr, entry.size, handle) {
        Ok(()) => {
            debug!("freed #{} at {ptr:#x}", entry.id);
            Some(CUDA_SUCCESS)
        }
        Err(e) => {
            debug!("free of #{} at {ptr:#x}: {e}", entry.id);
            Some(e.code)
        }
    }
}
