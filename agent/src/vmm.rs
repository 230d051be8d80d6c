//! VMM building blocks with undo: reserve + create + map + set access (the conversion of a
//! `cuMemAlloc`), back / unback a reservation (release and restore), and the size arithmetic.
//! Every composite undoes what it did when a later step fails.

use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys::{CUdevice, CUdeviceptr, CUmemGenericAllocationHandle};

use crate::cu::CuError;
use crate::real::Driver;
use crate::table::PropBytes;

/// `cuMemAllocPitch` pitch alignment used for converted pitched allocations.
pub const PITCH_ALIGN: u64 = 512;

/// A converted allocation as made by [`alloc`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmmAlloc {
    pub addr: CUdeviceptr,
    pub size: u64,
    pub handle: CUmemGenericAllocationHandle,
}

/// `size` rounded up to a multiple of `granularity` (a power of two or not); None on overflow
/// or a zero granularity.
pub fn round_up(size: u64, granularity: u64) -> Option<u64> {
    if granularity == 0 {
        return None;
    }
    size.checked_next_multiple_of(granularity)
}

/// Pitch and total size for `cuMemAllocPitch(width, height, elem)`, or None when the real call
/// must decide (invalid element size, zero or overflowing dimensions).
pub fn pitch_layout(width: u64, height: u64, elem_size: u32) -> Option<(u64, u64)> {
    if !matches!(elem_size, 4 | 8 | 16) || width == 0 || height == 0 {
        return None;
    }
    let pitch = width.checked_next_multiple_of(PITCH_ALIGN)?;
    Some((pitch, pitch.checked_mul(height)?))
}

/// Granularity per device ordinal, cached (0 = not asked yet).
static GRANULARITY: [AtomicU64; 64] = [const { AtomicU64::new(0) }; 64];

fn granularity(drv: &Driver, dev: CUdevice) -> Result<u64, CuError> {
    let slot = usize::try_from(dev).ok().and_then(|i| GRANULARITY.get(i));
    if let Some(g) = slot.map(|s| s.load(Ordering::Relaxed)).filter(|&g| g != 0) {
        return Ok(g);
    }
    let g = drv.granularity(dev)?;
    if let Some(s) = slot {
        s.store(g, Ordering::Relaxed);
    }
    Ok(g)
}

/// Converts an allocation of `size` bytes on `dev`: reserve, then [`back`]. The size is rounded
/// up to the device's minimum granularity.
pub fn alloc(drv: &Driver, dev: CUdevice, size: u64) -> Result<VmmAlloc, CuError> {
    let g = granularity(drv, dev)?;
    let rounded = round_up(size, g).ok_or_else(|| CuError {
        call: format!("rounding {size} bytes to granularity {g}"),
        code: crate::real::CUDA_ERROR_UNKNOWN,
        name: "overflow".into(),
    })?;
    let addr = drv.reserve(rounded)?;
    match back(drv, dev, addr, rounded, None) {
        Ok(handle) => Ok(VmmAlloc {
            addr,
            size: rounded,
            handle,
        }),
        Err(e) => {
            let _ = drv.free_reservation(addr, rounded);
            Err(e)
        }
    }
}

/// Physical memory for the reserved range `addr..addr+size` on `dev`: create (with the
/// application's properties `prop` when given, else pinned device memory), map, grant
/// read-write access to `dev`. On failure nothing is left behind.
pub fn back(
    drv: &Driver,
    dev: CUdevice,
    addr: CUdeviceptr,
    size: u64,
    prop: Option<&PropBytes>,
) -> Result<CUmemGenericAllocationHandle, CuError> {
    let handle = drv.create(addr, size, dev, prop)?;
    if let Err(e) = drv.map(addr, size, handle) {
        let _ = drv.release(addr, handle);
        return Err(e);
    }
    if let Err(e) = drv.set_access_rw(addr, size, dev) {
        let _ = drv.unmap(addr, size);
        let _ = drv.release(addr, handle);
        return Err(e);
    }
    Ok(handle)
}

/// Unmaps and releases the physical memory behind `addr..addr+size`, keeping the reservation.
/// When the unmap fails nothing is released (the memory is still mapped and valid).
pub fn unback(
    drv: &Driver,
    addr: CUdeviceptr,
    size: u64,
    handle: CUmemGenericAllocationHandle,
) -> Result<(), CuError> {
    drv.unmap(addr, size)?;
    drv.release(addr, handle)
}

/// Frees a converted allocation: unback if still backed, then free the reservation. Returns
/// the first error, going on with the rest regardless.
pub fn free(
    drv: &Driver,
    addr: CUdeviceptr,
    size: u64,
    handle: Option<CUmemGenericAllocationHandle>,
) -> Result<(), CuError> {
    let mut first = Ok(());
    if let Some(h) = handle {
        first = unback(drv, addr, size, h);
    }
    let freed = drv.free_reservation(addr, size);
    first.and(freed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding() {
        assert_eq!(round_up(1, 2 << 20), Some(2 << 20));
        assert_eq!(round_up(2 << 20, 2 << 20), Some(2 << 20));
        assert_eq!(round_up((2 << 20) + 1, 2 << 20), Some(4 << 20));
        assert_eq!(round_up(u64::MAX, 2 << 20), None);
        assert_eq!(round_up(5, 0), None);
        assert_eq!(round_up(5, 3), Some(6));
    }

    #[test]
    fn pitch() {
        assert_eq!(pitch_layout(1, 1, 4), Some((512, 512)));
        assert_eq!(pitch_layout(512, 3, 8), Some((512, 1536)));
        assert_eq!(pitch_layout(513, 1024, 16), Some((1024, 1024 * 1024)));
        assert_eq!(
            pitch_layout(100, 10, 2),
            None,
            "element size must be 4, 8 or 16"
        );
        assert_eq!(pitch_layout(0, 10, 4), None);
        assert_eq!(pitch_layout(10, 0, 4), None);
        assert_eq!(pitch_layout(u64::MAX, 1, 4), None);
        assert_eq!(pitch_layout(1 << 40, 1 << 40, 4), None);
    }
}
