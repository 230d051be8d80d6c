//! VMM building blocks with undo: reserve + create + map + set access (the conversion of a
//! `cuMemAlloc`), back / unback a reservation (release and restore), and the size arithmetic.
//! Every composite undoes what it did when a later step fails: its steps are made through
//! `Steps`, whose owners undo them when dropped.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys::{CUdevice, CUdeviceptr, CUmemGenericAllocationHandle};

use crate::cu::CuError;
use crate::cu::PropBytes;
use crate::log::{debug, error};
use crate::real::Driver;

/// `cuMemAllocPitch` pitch alignment used for converted pitched allocations.
pub const PITCH_ALIGN: u64 = 512;

/// A converted allocation as made by [`alloc`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmmAlloc {
    pub addr: CUdeviceptr,
    pub size: u64,
    pub handle: CUmemGenericAllocationHandle,
    /// Created with a POSIX-fd shareable handle type (its memory can be exported).
    pub exportable: bool,
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
    Steps::run(drv, |steps| {
        let range = steps.reserve(rounded)?;
        let handle = back_in(steps, dev, range.addr, rounded, None)?;
        Ok(VmmAlloc {
            addr: range.keep(),
            size: rounded,
            handle,
            // The answer `back` created with (asked once per device, then remembered).
            exportable: drv.posix_fd_handles(dev),
        })
    })
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
    Steps::run(drv, |steps| back_in(steps, dev, addr, size, prop))
}

/// [`back`] as steps of a larger sequence: its handle and mapping are undone when a later step
/// of that sequence fails, too.
fn back_in(
    steps: &Steps<'_>,
    dev: CUdevice,
    addr: CUdeviceptr,
    size: u64,
    prop: Option<&PropBytes>,
) -> Result<CUmemGenericAllocationHandle, CuError> {
    let handle = steps.create(addr, size, dev, prop)?;
    let mapping = steps.map(addr, size, handle.raw)?;
    mapping.grant_rw(dev)?;
    mapping.keep();
    Ok(handle.keep())
}

/// Maps an existing handle (an imported one) over the reserved range `addr..addr+size` and
/// grants `dev` read-write access; the handle stays the caller's. On failure nothing is mapped.
pub fn map_handle(
    drv: &Driver,
    dev: CUdevice,
    addr: CUdeviceptr,
    size: u64,
    handle: CUmemGenericAllocationHandle,
) -> Result<(), CuError> {
    Steps::run(drv, |steps| {
        let mapping = steps.map(addr, size, handle)?;
        mapping.grant_rw(dev)?;
        mapping.keep();
        Ok(())
    })
}

/// Maps `handle` (another process's memory, imported) over a new reservation of `size` bytes
/// with read-write access for `dev`; returns the address. The handle stays the caller's. On
/// failure nothing is left behind.
pub fn map_imported(
    drv: &Driver,
    dev: CUdevice,
    handle: CUmemGenericAllocationHandle,
    size: u64,
) -> Result<CUdeviceptr, CuError> {
    Steps::run(drv, |steps| {
        let range = steps.reserve(size)?;
        let mapping = steps.map(range.addr, size, handle)?;
        mapping.grant_rw(dev)?;
        mapping.keep();
        Ok(range.keep())
    })
}

/// Undoes [`map_imported`]: unmap, then free the reservation (not freed while still mapped).
pub fn unmap_imported(drv: &Driver, addr: CUdeviceptr, size: u64) -> Result<(), CuError> {
    drv.unmap(addr, size)?;
    drv.free_reservation(addr, size)
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
    match (first, freed) {
        (Err(e), Err(also)) => {
            // The caller reports the first error; the second mostly follows from it (a range
            // still mapped cannot be freed), so it is logged for debugging only.
            debug!("{also} (code {}), after {e}", also.code);
            Err(e)
        }
        (first, freed) => first.and(freed),
    }
}

/// A sequence of VMM steps that either completes or leaves nothing behind. Each step returns
/// an owner ([`Reservation`], [`PhysicalHandle`], [`Mapping`]) that undoes it when dropped, so
/// a step that fails (its `?`) drops, in reverse order, exactly the owners of the steps done
/// before it; a sequence that succeeds hands each on with `keep`. An undo that fails is
/// collected here and logged with the error that caused it: that error is the caller's to
/// report, and nothing else would say what was left allocated.
struct Steps<'d> {
    drv: &'d Driver,
    failed_undos: RefCell<Vec<CuError>>,
}

impl<'d> Steps<'d> {
    /// Runs `body`, which makes its steps through the [`Steps`] it is given.
    fn run<T>(
        drv: &'d Driver,
        body: impl FnOnce(&Steps<'d>) -> Result<T, CuError>,
    ) -> Result<T, CuError> {
        let steps = Steps {
            drv,
            failed_undos: RefCell::new(Vec::new()),
        };
        // The owners `body` made are dropped (undone) when it returns, before this reads
        // which of their undos failed.
        let out = body(&steps);
        if let Err(cause) = &out {
            for e in steps.failed_undos.take() {
                error!(
                    "undo failed: {e} (code {}), after {cause}; left allocated",
                    e.code
                );
            }
        }
        out
    }

    fn undo(&self, undone: Result<(), CuError>) {
        if let Err(e) = undone {
            self.failed_undos.borrow_mut().push(e);
        }
    }

    /// `cuMemAddressReserve` of `size` bytes anywhere.
    fn reserve(&self, size: u64) -> Result<Reservation<'_, 'd>, CuError> {
        let addr = self.drv.reserve(size)?;
        Ok(Reservation {
            steps: self,
            addr,
            size,
            kept: false,
        })
    }

    /// `cuMemCreate` for `addr..addr+size` on `dev` (see [`Driver::create`]).
    fn create(
        &self,
        addr: CUdeviceptr,
        size: u64,
        dev: CUdevice,
        prop: Option<&PropBytes>,
    ) -> Result<PhysicalHandle<'_, 'd>, CuError> {
        let raw = self.drv.create(addr, size, dev, prop)?;
        Ok(PhysicalHandle {
            steps: self,
            addr,
            raw,
            kept: false,
        })
    }

    /// `cuMemMap` of `handle` (not owned by the mapping) over `addr..addr+size`.
    fn map(
        &self,
        addr: CUdeviceptr,
        size: u64,
        handle: CUmemGenericAllocationHandle,
    ) -> Result<Mapping<'_, 'd>, CuError> {
        self.drv.map(addr, size, handle)?;
        Ok(Mapping {
            steps: self,
            addr,
            size,
            kept: false,
        })
    }
}

/// A reserved address range: freed when dropped, unless kept.
struct Reservation<'s, 'd> {
    steps: &'s Steps<'d>,
    addr: CUdeviceptr,
    size: u64,
    kept: bool,
}

impl Reservation<'_, '_> {
    /// Hands the reservation on (to the table): its address.
    fn keep(mut self) -> CUdeviceptr {
        self.kept = true;
        self.addr
    }
}

impl Drop for Reservation<'_, '_> {
    fn drop(&mut self) {
        if !self.kept {
            let s = self.steps;
            s.undo(s.drv.free_reservation(self.addr, self.size));
        }
    }
}

/// Physical memory made by `cuMemCreate` (`addr` names it in messages): released when dropped,
/// unless kept.
struct PhysicalHandle<'s, 'd> {
    steps: &'s Steps<'d>,
    addr: CUdeviceptr,
    raw: CUmemGenericAllocationHandle,
    kept: bool,
}

impl PhysicalHandle<'_, '_> {
    /// Hands the handle on (to the table): its raw value.
    fn keep(mut self) -> CUmemGenericAllocationHandle {
        self.kept = true;
        self.raw
    }
}

impl Drop for PhysicalHandle<'_, '_> {
    fn drop(&mut self) {
        if !self.kept {
            let s = self.steps;
            s.undo(s.drv.release(self.addr, self.raw));
        }
    }
}

/// A handle mapped over `addr..addr+size`: unmapped when dropped, unless kept.
struct Mapping<'s, 'd> {
    steps: &'s Steps<'d>,
    addr: CUdeviceptr,
    size: u64,
    kept: bool,
}

impl Mapping<'_, '_> {
    /// `cuMemSetAccess`: read-write for `dev` over the whole mapping.
    fn grant_rw(&self, dev: CUdevice) -> Result<(), CuError> {
        self.steps.drv.set_access_rw(self.addr, self.size, dev)
    }

    /// Leaves the range mapped.
    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Mapping<'_, '_> {
    fn drop(&mut self) {
        if !self.kept {
            let s = self.steps;
            s.undo(s.drv.unmap(self.addr, self.size));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::ffi::{CStr, c_char, c_void};

    use cudarc::driver::sys::{
        CUmemAccessDesc, CUmemAllocationGranularity_flags, CUmemAllocationProp,
    };

    use crate::real::CuRes;

    /// The status every failing stand-in call returns (`CUDA_ERROR_OUT_OF_MEMORY`).
    const FAILED: CuRes = 2;
    const BASE: CUdeviceptr = 0x7f00_0000_0000;
    const HANDLE: CUmemGenericAllocationHandle = 7;
    const GRANULE: u64 = 2 << 20;

    thread_local! {
        /// The stand-in calls this test made, in order, and the ones that are to fail.
        static CALLS: RefCell<Vec<&'static str>> = const { RefCell::new(Vec::new()) };
        static FAILING: RefCell<&'static [&'static str]> = const { RefCell::new(&[]) };
    }

    fn outcome(call: &'static str) -> CuRes {
        CALLS.with(|c| c.borrow_mut().push(call));
        if FAILING.with(|f| f.borrow().contains(&call)) {
            FAILED
        } else {
            0
        }
    }

    unsafe extern "C" fn error_name(_: CuRes, _: *mut *const c_char) -> CuRes {
        crate::real::CUDA_ERROR_INVALID_VALUE
    }
    unsafe extern "C" fn granularity(
        g: *mut usize,
        _: *const CUmemAllocationProp,
        _: CUmemAllocationGranularity_flags,
    ) -> CuRes {
        // SAFETY: g is the wrapper's out pointer.
        unsafe { *g = GRANULE as usize };
        0
    }
    unsafe extern "C" fn reserve(
        addr: *mut CUdeviceptr,
        _: usize,
        _: usize,
        _: CUdeviceptr,
        _: u64,
    ) -> CuRes {
        // SAFETY: addr is the wrapper's out pointer.
        unsafe { *addr = BASE };
        outcome("cuMemAddressReserve")
    }
    unsafe extern "C" fn address_free(_: CUdeviceptr, _: usize) -> CuRes {
        outcome("cuMemAddressFree")
    }
    unsafe extern "C" fn create(
        h: *mut CUmemGenericAllocationHandle,
        _: usize,
        _: *const CUmemAllocationProp,
        _: u64,
    ) -> CuRes {
        // SAFETY: h is the wrapper's out pointer.
        unsafe { *h = HANDLE };
        outcome("cuMemCreate")
    }
    unsafe extern "C" fn map(
        _: CUdeviceptr,
        _: usize,
        _: usize,
        _: CUmemGenericAllocationHandle,
        _: u64,
    ) -> CuRes {
        outcome("cuMemMap")
    }
    unsafe extern "C" fn set_access(
        _: CUdeviceptr,
        _: usize,
        _: *const CUmemAccessDesc,
        _: usize,
    ) -> CuRes {
        outcome("cuMemSetAccess")
    }
    unsafe extern "C" fn unmap(_: CUdeviceptr, _: usize) -> CuRes {
        outcome("cuMemUnmap")
    }
    unsafe extern "C" fn release(_: CUmemGenericAllocationHandle) -> CuRes {
        outcome("cuMemRelease")
    }
    unsafe extern "C" fn device_attribute(
        v: *mut std::ffi::c_int,
        _: std::ffi::c_int,
        _: i32,
    ) -> CuRes {
        // SAFETY: v is the wrapper's out pointer.
        unsafe { *v = 1 };
        0
    }

    /// A stand-in libcuda: the VMM calls above; any other name resolves to a pointer these
    /// tests never call.
    unsafe extern "C" fn stand_in(_: *mut c_void, symbol: *const c_char) -> *mut c_void {
        // SAFETY: symbol is the driver table's NUL-terminated name.
        match unsafe { CStr::from_ptr(symbol) }.to_bytes() {
            b"cuGetErrorName" => error_name as *mut c_void,
            b"cuMemGetAllocationGranularity" => granularity as *mut c_void,
            b"cuMemAddressReserve" => reserve as *mut c_void,
            b"cuMemAddressFree" => address_free as *mut c_void,
            b"cuMemCreate" => create as *mut c_void,
            b"cuMemMap" => map as *mut c_void,
            b"cuMemSetAccess" => set_access as *mut c_void,
            b"cuMemUnmap" => unmap as *mut c_void,
            b"cuMemRelease" => release as *mut c_void,
            b"cuDeviceGetAttribute" => device_attribute as *mut c_void,
            _ => symbol.cast_mut().cast(),
        }
    }

    /// Runs `f` against the stand-in with `failing` calls failing; returns the calls it made and
    /// the error lines it logged.
    fn with_failing<T>(
        failing: &'static [&'static str],
        f: impl FnOnce(&Driver) -> T,
    ) -> (T, Vec<&'static str>, Vec<String>) {
        let drv = Driver::resolve_with(stand_in).unwrap();
        CALLS.with(|c| c.borrow_mut().clear());
        FAILING.with(|f| *f.borrow_mut() = failing);
        let (out, logged) = crate::log::capture::logged(|| f(&drv));
        let errors = logged
            .into_iter()
            .filter(|l| l.starts_with("error: "))
            .collect();
        (out, CALLS.with(|c| c.take()), errors)
    }

    #[test]
    fn a_failed_undo_is_logged_the_first_error_returned_and_every_undo_still_tried() {
        let (r, calls, errors) = with_failing(&["cuMemMap", "cuMemRelease"], |d| {
            back(d, 0, BASE, GRANULE, None)
        });
        assert_eq!(
            r.unwrap_err().call,
            format!("cuMemMap(addr {BASE:#x}, {GRANULE} bytes)")
        );
        assert_eq!(calls, ["cuMemCreate", "cuMemMap", "cuMemRelease"]);
        assert_eq!(
            errors,
            [format!(
                "error: undo failed: cuMemRelease(handle of addr {BASE:#x}) failed: CUDA error 2 \
                 (code 2), after cuMemMap(addr {BASE:#x}, {GRANULE} bytes) failed: CUDA error 2; \
                 left allocated"
            )]
        );

        let (r, calls, errors) =
            with_failing(&["cuMemSetAccess", "cuMemUnmap", "cuMemRelease"], |d| {
                back(d, 0, BASE, GRANULE, None)
            });
        let e = r.unwrap_err();
        assert!(e.call.starts_with("cuMemSetAccess("), "{e}");
        assert_eq!(e.code, FAILED);
        assert_eq!(
            calls,
            [
                "cuMemCreate",
                "cuMemMap",
                "cuMemSetAccess",
                "cuMemUnmap",
                "cuMemRelease"
            ]
        );
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].contains("undo failed: cuMemUnmap(") && errors[0].contains("(code 2)"));
        assert!(errors[1].contains("undo failed: cuMemRelease("));
        assert!(errors.iter().all(|l| l.contains("after cuMemSetAccess(")));

        // Only the failed undo is logged; the cause is the caller's to report.
        let (r, calls, errors) = with_failing(&["cuMemSetAccess", "cuMemRelease"], |d| {
            back(d, 0, BASE, GRANULE, None)
        });
        assert!(r.is_err());
        assert_eq!(calls.len(), 5);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("undo failed: cuMemRelease("));

        let (r, calls, errors) =
            with_failing(&["cuMemCreate", "cuMemAddressFree"], |d| alloc(d, 0, 1));
        assert!(r.unwrap_err().call.starts_with("cuMemCreate("));
        assert_eq!(
            calls,
            ["cuMemAddressReserve", "cuMemCreate", "cuMemAddressFree"]
        );
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].contains("undo failed: cuMemAddressFree(addr 0x7f0000000000, 2097152 bytes)")
        );
        assert!(errors[0].contains("after cuMemCreate("));

        let (r, calls, errors) = with_failing(&["cuMemMap"], |d| alloc(d, 0, 1));
        assert!(r.unwrap_err().call.starts_with("cuMemMap("));
        assert_eq!(
            calls,
            [
                "cuMemAddressReserve",
                "cuMemCreate",
                "cuMemMap",
                "cuMemRelease",
                "cuMemAddressFree"
            ]
        );
        assert!(errors.is_empty(), "undone cleanly: {errors:?}");

        let (r, calls, errors) = with_failing(&[], |d| alloc(d, 0, 1));
        assert_eq!(
            r.unwrap(),
            VmmAlloc {
                addr: BASE,
                size: GRANULE,
                handle: HANDLE,
                exportable: true,
            }
        );
        assert_eq!(
            calls,
            [
                "cuMemAddressReserve",
                "cuMemCreate",
                "cuMemMap",
                "cuMemSetAccess"
            ]
        );
        assert!(errors.is_empty());
    }

    #[test]
    fn free_goes_on_after_a_failure_and_returns_the_first() {
        let (r, calls, errors) = with_failing(&["cuMemUnmap", "cuMemAddressFree"], |d| {
            free(d, BASE, GRANULE, Some(HANDLE))
        });
        assert!(r.unwrap_err().call.starts_with("cuMemUnmap("));
        assert_eq!(
            calls,
            ["cuMemUnmap", "cuMemAddressFree"],
            "nothing released while mapped"
        );
        assert!(
            errors.is_empty(),
            "the second failure is debug only: {errors:?}"
        );

        let (r, calls, _) = with_failing(&["cuMemAddressFree"], |d| {
            free(d, BASE, GRANULE, Some(HANDLE))
        });
        assert!(r.unwrap_err().call.starts_with("cuMemAddressFree("));
        assert_eq!(calls, ["cuMemUnmap", "cuMemRelease", "cuMemAddressFree"]);

        let (r, calls, _) = with_failing(&[], |d| free(d, BASE, GRANULE, None));
        assert!(r.is_ok());
        assert_eq!(calls, ["cuMemAddressFree"]);
    }

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
