//! The fake devices and their primary contexts: device queries, `cuDevicePrimaryCtxRetain`,
//! the calling thread's current context (and its device, `cuCtxGetDevice`), `cuMemGetInfo`.
//!
//! One device by default; `FAKECUDA_DEVICES=N` (1 to [`MAX_DEVICES`]) makes `N`. Device `i` has
//! the UUID [`device_uuid`]`(i)` (device 0: [`DEVICE_UUID`]), the same as `fake-cuda` reports
//! to the plugin with the same variable, so images record the same GPUs on both sides. Device
//! memory is accounted for all devices together.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::call::{self, CuResult, put};
use crate::codes::{CUresult, INVALID_CONTEXT, INVALID_DEVICE, OUT_OF_MEMORY};
use crate::rt::need_init;

pub type CUdevice = c_int;
pub type CUcontext = *mut c_void;

/// `cuDriverGetVersion`: CUDA 13.0.
pub const DRIVER_VERSION: c_int = 13000;
pub const DEVICE_NAME: &[u8] = b"Fake GPU";
pub const DEVICE_UUID: [u8; 16] = [
    0xfa, 0x4e, 0xc0, 0xda, 0x00, 0x00, 0x40, 0x00, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01,
];
/// The most devices `FAKECUDA_DEVICES` may ask for.
pub const MAX_DEVICES: usize = 8;
/// Environment variable: the number of devices (default 1).
pub const DEVICES_ENV: &str = "FAKECUDA_DEVICES";

/// The UUID of device `ordinal`: [`DEVICE_UUID`] with the last byte `ordinal + 1` (as
/// `fake-cuda`'s).
pub fn device_uuid(ordinal: usize) -> [u8; 16] {
    let mut u = DEVICE_UUID;
    u[15] = ordinal as u8 + 1;
    u
}

/// The number of devices (`FAKECUDA_DEVICES`, read once; a bad value is reported with
/// `FAKECUDADEV_DEBUG=1` and means 1).
pub fn device_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| match std::env::var(DEVICES_ENV) {
        Err(_) => 1,
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if (1..=MAX_DEVICES).contains(&n) => n,
            _ => {
                call::debug(format_args!(
                    "{DEVICES_ENV}={v:?}: not 1 to {MAX_DEVICES}; one device"
                ));
                1
            }
        },
    })
}

/// "Device memory" the fake device claims; allocations beyond it fail with out-of-memory.
pub const DEVICE_TOTAL_MEM: u64 = 80 << 30;

/// Bytes of device memory in use (allocations and physical handles).
static USED: AtomicU64 = AtomicU64::new(0);

/// Accounts for `bytes` more device memory, or fails with `CUDA_ERROR_OUT_OF_MEMORY`.
pub fn charge(bytes: u64) -> CuResult {
    USED.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
        u.checked_add(bytes).filter(|&n| n <= DEVICE_TOTAL_MEM)
    })
    .map(|_| ())
    .map_err(|_| OUT_OF_MEMORY)
}

/// Gives `bytes` back.
pub fn refund(bytes: u64) {
    let _ = USED.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
        Some(u.saturating_sub(bytes))
    });
}

/// The primary contexts' handles: the addresses of this static's bytes (device `i`: byte `i`).
static PRIMARY: [u8; MAX_DEVICES] = [0; MAX_DEVICES];

/// Device `dev`'s primary context (`dev` checked by the caller).
pub fn primary(dev: usize) -> CUcontext {
    (&raw const PRIMARY[dev]).cast_mut().cast()
}

/// The device whose primary context `ctx` is.
fn device_of(ctx: CUcontext) -> Option<usize> {
    (0..device_count()).find(|&d| primary(d) == ctx)
}

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// `CUDA_ERROR_INVALID_CONTEXT` unless the calling thread has a current context.
pub fn need_context() -> CuResult {
    need_init()?;
    if CURRENT.with(Cell::get) == 0 {
        return Err(INVALID_CONTEXT);
    }
    Ok(())
}

/// `CUDA_ERROR_INVALID_DEVICE` unless `dev` is one of the devices.
pub fn check_device(dev: CUdevice) -> CuResult {
    if usize::try_from(dev).is_ok_and(|d| d < device_count()) {
        Ok(())
    } else {
        Err(INVALID_DEVICE)
    }
}

pub unsafe extern "C" fn driver_get_version(version: *mut c_int) -> CUresult {
    // SAFETY: the caller's out pointer, checked for null by put.
    call::run_unlocked("cuDriverGetVersion", || unsafe {
        put(version, DRIVER_VERSION)
    })
}

pub unsafe extern "C" fn device_get_count(count: *mut c_int) -> CUresult {
    call::run("cuDeviceGetCount", || {
        need_init()?;
        // SAFETY: the caller's out pointer, checked for null by put.
        unsafe { put(count, device_count() as c_int) }
    })
}

pub unsafe extern "C" fn device_get(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    call::run("cuDeviceGet", || {
        need_init()?;
        check_device(ordinal)?;
        // SAFETY: the caller's out pointer, checked for null by put.
        unsafe { put(dev, ordinal) }
    })
}

pub unsafe extern "C" fn device_get_name(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    call::run("cuDeviceGetName", || {
        need_init()?;
        check_device(dev)?;
        let len = usize::try_from(len).unwrap_or(0);
        if name.is_null() || len == 0 {
            return call::invalid("cuDeviceGetName", format_args!("no buffer"));
        }
        let n = DEVICE_NAME.len().min(len - 1);
        // SAFETY: name is valid for `len` bytes per the caller; n + 1 <= len.
        unsafe {
            std::ptr::copy_nonoverlapping(DEVICE_NAME.as_ptr(), name.cast::<u8>(), n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

pub unsafe extern "C" fn device_total_mem(bytes: *mut usize, dev: CUdevice) -> CUresult {
    call::run("cuDeviceTotalMem_v2", || {
        need_init()?;
        check_device(dev)?;
        // SAFETY: the caller's out pointer, checked for null by put.
        unsafe { put(bytes, DEVICE_TOTAL_MEM as usize) }
    })
}

pub unsafe extern "C" fn device_get_uuid(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    call::run("cuDeviceGetUuid", || {
        need_init()?;
        check_device(dev)?;
        // SAFETY: the caller's out pointer (a 16-byte CUuuid), checked for null by put.
        unsafe { put(uuid, device_uuid(dev as usize)) }
    })
}

pub unsafe extern "C" fn primary_ctx_retain(ctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    call::run("cuDevicePrimaryCtxRetain", || {
        need_init()?;
        check_device(dev)?;
        // SAFETY: the caller's out pointer, checked for null by put.
        unsafe { put(ctx, primary(dev as usize)) }
    })
}

pub unsafe extern "C" fn primary_ctx_release(dev: CUdevice) -> CUresult {
    call::run("cuDevicePrimaryCtxRelease_v2", || {
        need_init()?;
        check_device(dev)
    })
}

pub unsafe extern "C" fn ctx_set_current(ctx: CUcontext) -> CUresult {
    call::run("cuCtxSetCurrent", || {
        need_init()?;
        if !ctx.is_null() && device_of(ctx).is_none() {
            debug_bad_context("cuCtxSetCurrent", ctx);
            return Err(INVALID_CONTEXT);
        }
        CURRENT.with(|c| c.set(ctx as usize));
        Ok(())
    })
}

pub unsafe extern "C" fn ctx_get_current(ctx: *mut CUcontext) -> CUresult {
    call::run("cuCtxGetCurrent", || {
        need_init()?;
        let cur = CURRENT.with(Cell::get) as CUcontext;
        // SAFETY: the caller's out pointer, checked for null by put.
        unsafe { put(ctx, cur) }
    })
}

pub unsafe extern "C" fn ctx_get_device(dev: *mut CUdevice) -> CUresult {
    call::run("cuCtxGetDevice", || {
        need_context()?;
        let cur = CURRENT.with(Cell::get) as CUcontext;
        let d = device_of(cur).ok_or(INVALID_CONTEXT)?;
        // SAFETY: the caller's out pointer, checked for null by put.
        unsafe { put(dev, d as CUdevice) }
    })
}

/// Peer access: accepted (it only has to succeed).
/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
pub const ATTRIBUTE_VMM_SUPPORTED: c_int = 102;
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
pub const ATTRIBUTE_POSIX_FD_SUPPORTED: c_int = 103;
/// Environment variable: `1` makes the devices answer 0 for POSIX-fd handles (a driver or GPU
/// without them), so that the agent's non-exportable route can be tested.
pub const NO_POSIX_FD_ENV: &str = "FAKECUDA_NO_POSIX_FD";

fn posix_fd_supported() -> bool {
    static NO: OnceLock<bool> = OnceLock::new();
    !*NO.get_or_init(|| std::env::var(NO_POSIX_FD_ENV).is_ok_and(|v| v == "1"))
}

/// `cuDeviceGetAttribute`: the attributes the agent asks about; any other is
/// `CUDA_ERROR_INVALID_VALUE` (not played).
pub unsafe extern "C" fn device_get_attribute(
    value: *mut c_int,
    attribute: c_int,
    dev: CUdevice,
) -> CUresult {
    const CALL: &str = "cuDeviceGetAttribute";
    call::run_unlocked(CALL, || {
        need_init()?;
        check_device(dev)?;
        let v = match attribute {
            ATTRIBUTE_VMM_SUPPORTED => 1,
            ATTRIBUTE_POSIX_FD_SUPPORTED => c_int::from(posix_fd_supported()),
            _ => return call::invalid(CALL, format_args!("attribute {attribute} is not played")),
        };
        // SAFETY: the caller's out pointer, checked for null by put.
        unsafe { put(value, v) }
    })
}

pub unsafe extern "C" fn enable_peer_access(_peer: CUcontext, _flags: u32) -> CUresult {
    call::run("cuCtxEnablePeerAccess", need_context)
}

pub unsafe extern "C" fn ctx_synchronize() -> CUresult {
    call::run("cuCtxSynchronize", need_context)
}

pub unsafe extern "C" fn mem_get_info(free: *mut usize, total: *mut usize) -> CUresult {
    call::run("cuMemGetInfo_v2", || {
        need_context()?;
        let used = USED.load(Ordering::Acquire);
        // `FAKECUDA_FREE_MIB`: a device with at most that much free (a test of what does not
        // fit, such as an asynchronous -R's snapshot).
        let cap = std::env::var("FAKECUDA_FREE_MIB")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(u64::MAX, |m| m << 20);
        // SAFETY: the caller's out pointers, checked for null by put.
        unsafe {
            put(
                free,
                DEVICE_TOTAL_MEM.saturating_sub(used).min(cap) as usize,
            )?;
            put(total, DEVICE_TOTAL_MEM as usize)
        }
    })
}

fn debug_bad_context(call: &str, ctx: CUcontext) {
    call::debug(format_args!(
        "{call}: {ctx:p} is not a context of this driver"
    ));
}
