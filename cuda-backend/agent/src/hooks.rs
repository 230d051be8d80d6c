//! The exported interposers: `dlsym`, `cuGetProcAddress{,_v2}`, `cuMemAlloc_v2`,
//! `cuMemAllocPitch_v2`, `cuMemFree_v2`; the application's VMM calls `cuMemCreate`, `cuMemMap`,
//! `cuMemUnmap`, `cuMemRelease`, `cuMemRetainAllocationHandle`,
//! `cuMemGetAllocationPropertiesFromHandle`, `cuMulticastBindMem`, which translate its
//! (virtual) handle values (see [`crate::table`]); CUDA IPC (`cuIpcGetMemHandle`,
//! `cuIpcOpenMemHandle_v2`, `cuIpcCloseMemHandle`), which [`crate::ipc`] serves for converted
//! memory; `cuIpcOpenEventHandle` and `cuEventDestroy{,_v2}`, which track the interprocess
//! events opened here ([`crate::hazards`]); and the hazard recorders.
//!
//! Each is thin: it catches panics (none may cross into C) and calls plain Rust in
//! [`crate::convert`] or the real driver function. The CUDA runtime finds driver entry points
//! through `dlsym(libcuda, "cuGetProcAddress*")` and then `cuGetProcAddress`, so those two are
//! where our pointers are handed out; programs linked to libcuda directly reach our exports by
//! symbol interposition (`LD_PRELOAD`).

#![allow(non_snake_case)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

use cudarc::driver::sys::{
    CUcontext, CUdeviceptr, CUdriverProcAddressQueryResult, CUevent, CUipcEventHandle,
    CUipcMemHandle, CUmemAccessDesc, CUmemAllocationProp, CUmemGenericAllocationHandle,
    CUmemLocation, cuuint64_t,
};
use gpusnap_proto::hazard;

use crate::calls::{
    V2_ALLOC_ABI, V2_EVENT_DESTROY_ABI, V2_IPC_OPEN_ABI, V2_PROC_ADDRESS_ABI, hooked_calls,
};
use crate::convert;
use crate::guard::guard;
use crate::log::debug;
use crate::real::{
    self, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_INITIALIZED,
    CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, CUDA_ERROR_UNKNOWN,
    CUDA_SUCCESS, CuRes, Driver,
};
use crate::table;

/// A converted allocation exists: the agent thread serves it from now on. A panic in the start
/// is contained here, so the converted memory still reaches the application.
fn started_for_converted() {
    guard((), crate::server::ensure_started);
}

/// The driver table for a hook, or the status to return without it.
fn driver_for(call: &str) -> Result<&'static Driver, CuRes> {
    crate::install_quiet_panic_hook();
    real::driver().map_err(|e| {
        debug!("{call}: no real driver function: {e}");
        CUDA_ERROR_NOT_INITIALIZED
    })
}

/// Whether `cuGetProcAddress(_, _, version)` returns the ABI of a table line with these versions.
macro_rules! returns_this_abi {
    ($version:ident) => {
        true
    };
    ($version:ident since $first:ident) => {
        $version >= $first
    };
    ($version:ident before $first:ident) => {
        $version < $first
    };
}

/// Declares [`Hooked`] from the table (see [`crate::calls::hooked_calls`]).
macro_rules! hooked_enum {
    (
        hooked { $(
            $variant:ident = $export:ident ( $($arg:ty),* ) $need:ident as $field:ident,
                proc $proc:literal $( $rule:ident $first:ident )?;
        )* }
    ) => {
        /// The driver functions we hand out our own pointer for.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Hooked {
            $( $variant, )*
        }

        impl Hooked {
            /// Every hook, in table order.
            pub const ALL: &[Hooked] = &[$( Hooked::$variant, )*];

            /// libcuda's exported symbol name (what `dlsym` is asked for), also our export's.
            pub fn symbol(self) -> &'static str {
                match self {
                    $( Hooked::$variant => stringify!($export), )*
                }
            }

            /// By libcuda's exported symbol name.
            pub fn from_symbol(name: &[u8]) -> Option<Self> {
                Self::ALL.iter().copied().find(|h| h.symbol().as_bytes() == name)
            }

            /// By `cuGetProcAddress`'s base name and requested version; None where the returned
            /// ABI would not be our hook's signature.
            pub fn from_proc_name(name: &[u8], cuda_version: c_int) -> Option<Self> {
                $(
                    if name == $proc.as_bytes()
                        && returns_this_abi!(cuda_version $($rule $first)?)
                    {
                        return Some(Hooked::$variant);
                    }
                )*
                None
            }

            /// Our export's address.
            pub fn hook_addr(self) -> *mut c_void {
                match self {
                    $( Hooked::$variant => {
                        // Coerced to the table's signature: an export that differs does not build.
                        let hook: unsafe extern "C" fn($($arg),*) -> CuRes = $export;
                        hook as *mut c_void
                    } )*
                }
            }

            /// libcuda's function of the same ABI (null when the driver lacks it).
            pub fn real_addr(self, d: &Driver) -> *mut c_void {
                match self {
                    $( Hooked::$variant => crate::real::entry_addr!($need d.$field), )*
                }
            }
        }
    };
}

hooked_calls!(hooked_enum! {});

// ---------------------------------------------------------------------------------------------
// dlsym

/// `dlsym` itself. `RTLD_NEXT` lookups jump straight to glibc's `dlsym` with the caller's return
/// address untouched (glibc resolves "next" relative to the object that called it, so a call
/// from here would find the wrong next object); every other lookup goes to [`dlsym_hook`].
///
/// # Safety
/// As glibc's `dlsym`: `handle` a valid handle or pseudo-handle, `symbol` a C string.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
/// # Safety
/// As glibc's `dlsym`: `handle` a valid handle or pseudo-handle, `symbol` a C string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // Tail calls only: the stack is as the caller left it when glibc's dlsym or the hook runs.
    // The resolver call keeps the arguments on the stack and the stack 16-byte aligned.
    core::arch::naked_asm!(
        "cmp rdi, -1",
        "jne {hook}",
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {resolve}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 2f",
        "jmp rax",
        "2:",
        "ret",
        hook = sym dlsym_hook,
        resolve = sym real_dlsym_addr,
    )
}

/// Fallback for other architectures: `RTLD_NEXT` is then resolved relative to this library.
#[cfg(not(target_arch = "x86_64"))]
/// # Safety
/// As glibc's `dlsym`: `handle` a valid handle or pseudo-handle, `symbol` a C string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // SAFETY: same contract as dlsym.
    unsafe { dlsym_hook(handle, symbol) }
}

/// glibc's `dlsym` for the trampoline (null if it cannot be found).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
extern "C" fn real_dlsym_addr() -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        real::real_dlsym().map_or(std::ptr::null_mut(), |f| f as *mut c_void)
    })
}

/// Real `dlsym`, then our pointer instead of libcuda's for the functions we hook.
unsafe extern "C" fn dlsym_hook(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let Some(real_dlsym) = real::real_dlsym() else {
        return std::ptr::null_mut();
    };
    // SAFETY: the caller's arguments are passed to glibc's dlsym unchanged.
    let p = unsafe { real_dlsym(handle, symbol) };
    if p.is_null() || symbol.is_null() {
        return p;
    }
    // SAFETY: symbol is the caller's non-null C string.
    guard(p, || unsafe { swap_dlsym_result(symbol, p) })
}

/// # Safety
/// `symbol` must be a valid C string.
unsafe fn swap_dlsym_result(symbol: *const c_char, p: *mut c_void) -> *mut c_void {
    // SAFETY: guaranteed by the caller.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    if !name.starts_with(b"cu") {
        return p;
    }
    let Some(h) = Hooked::from_symbol(name) else {
        return p;
    };
    if p == h.hook_addr() {
        return p;
    }
    let drv = match driver_for("dlsym") {
        Ok(d) => d,
        Err(_) => {
            // Loading libcuda may have left an error in dlerror(): the caller's dlsym succeeded.
            // SAFETY: dlerror has no preconditions.
            unsafe { libc::dlerror() };
            return p;
        }
    };
    if h.real_addr(drv) == p {
        debug!(
            "dlsym({}): handing out our hook",
            String::from_utf8_lossy(name)
        );
        h.hook_addr()
    } else {
        p
    }
}

// ---------------------------------------------------------------------------------------------
// cuGetProcAddress

/// After a successful real `cuGetProcAddress*`: our hook instead, when the ABI matches.
///
/// # Safety
/// `symbol` null or a valid C string; `pfn` null or valid for reads and writes.
unsafe fn swap_proc(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int) {
    // SAFETY: pfn checked non-null, valid per the caller.
    if symbol.is_null() || pfn.is_null() || unsafe { *pfn }.is_null() {
        return;
    }
    // SAFETY: symbol is a valid C string per the caller.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    if let Some(h) = Hooked::from_proc_name(name, cuda_version) {
        debug!(
            "cuGetProcAddress({}, {cuda_version}): handing out our hook",
            String::from_utf8_lossy(name)
        );
        // SAFETY: pfn is valid for writes per the caller.
        unsafe { *pfn = h.hook_addr() };
    }
}

/// Interposes libcuda's `cuGetProcAddress` (v1 ABI).
///
/// # Safety
/// As the driver function: `symbol` a C string, `pfn` valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: cuuint64_t,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuGetProcAddress") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        let Some(real) = drv.get_proc_address else {
            return CUDA_ERROR_NOT_FOUND;
        };
        // SAFETY: the caller's arguments are passed to the real function unchanged.
        let rc = unsafe { real(symbol, pfn, cudaVersion, flags) };
        if rc == CUDA_SUCCESS {
            // SAFETY: the real call accepted symbol and wrote *pfn.
            unsafe { swap_proc(symbol, pfn, cudaVersion) };
        }
        rc
    })
}

/// Interposes libcuda's `cuGetProcAddress_v2`.
///
/// # Safety
/// As the driver function: `symbol` a C string, `pfn` valid for writes, `symbolStatus` null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: cuuint64_t,
    symbolStatus: *mut CUdriverProcAddressQueryResult,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuGetProcAddress_v2") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        let Some(real) = drv.get_proc_address_v2 else {
            return CUDA_ERROR_NOT_FOUND;
        };
        // SAFETY: the caller's arguments are passed to the real function unchanged.
        let rc = unsafe { real(symbol, pfn, cudaVersion, flags, symbolStatus) };
        if rc == CUDA_SUCCESS {
            // SAFETY: the real call accepted symbol and wrote *pfn.
            unsafe { swap_proc(symbol, pfn, cudaVersion) };
        }
        rc
    })
}

// ---------------------------------------------------------------------------------------------
// Allocation

/// Interposes libcuda's `cuMemAlloc_v2`: converts large allocations.
///
/// # Safety
/// As the driver function: `dptr` valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuMemAlloc_v2") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        if !dptr.is_null()
            && let Some(addr) = convert::try_convert(drv, bytesize as u64)
        {
            started_for_converted();
            // SAFETY: dptr is the caller's non-null out pointer.
            unsafe { *dptr = addr };
            return CUDA_SUCCESS;
        }
        // SAFETY: the caller's arguments are passed to the real function unchanged.
        unsafe { (drv.mem_alloc)(dptr, bytesize) }
    })
}

/// Interposes libcuda's `cuMemAllocPitch_v2`: converts large allocations (pitch rounded to 512).
///
/// # Safety
/// As the driver function: `dptr` and `pPitch` valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pPitch: *mut usize,
    WidthInBytes: usize,
    Height: usize,
    ElementSizeBytes: c_uint,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuMemAllocPitch_v2") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        if !dptr.is_null()
            && !pPitch.is_null()
            && let Some((pitch, total)) =
                crate::vmm::pitch_layout(WidthInBytes as u64, Height as u64, ElementSizeBytes)
            && let Ok(pitch) = usize::try_from(pitch)
            && let Some(addr) = convert::try_convert(drv, total)
        {
            started_for_converted();
            // SAFETY: dptr and pPitch are the caller's non-null out pointers.
            unsafe {
                *dptr = addr;
                *pPitch = pitch;
            }
            return CUDA_SUCCESS;
        }
        // SAFETY: the caller's arguments are passed to the real function unchanged.
        unsafe { (drv.mem_alloc_pitch)(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes) }
    })
}

/// Interposes libcuda's `cuMemFree_v2`: frees converted allocations itself.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuMemFree_v2") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        // The exported fd of a shared allocation would keep its memory alive.
        crate::ipc::forget_export(dptr);
        crate::own_fds::forget_at(dptr);
        if let Some(rc) = convert::free_converted(drv, dptr) {
            return rc;
        }
        // SAFETY: the caller's argument is passed to the real function unchanged.
        unsafe { (drv.mem_free)(dptr) }
    })
}

// ---------------------------------------------------------------------------------------------
// The application's own VMM calls: pass through, record.

/// The device ordinal of a device-located allocation property, read field by field as raw
/// integers (the struct's enum fields may hold values cudarc's Rust enums do not list).
///
/// # Safety
/// `prop` must point at a readable `CUmemAllocationProp`.
unsafe fn device_of_prop(prop: *const CUmemAllocationProp) -> Option<i32> {
    const LOCATION_TYPE_DEVICE: u32 = 1;
    let loc = std::mem::offset_of!(CUmemAllocationProp, location);
    let ty = loc + std::mem::offset_of!(CUmemLocation, type_);
    let id = loc + std::mem::offset_of!(CUmemLocation, id);
    let base = prop.cast::<u8>();
    // SAFETY: both offsets lie inside the struct the caller vouches for; plain integer reads.
    let (ty, id) = unsafe {
        (
            base.add(ty).cast::<u32>().read_unaligned(),
            base.add(id).cast::<i32>().read_unaligned(),
        )
    };
    (ty == LOCATION_TYPE_DEVICE).then_some(id)
}

/// Interposes libcuda's `cuMemCreate`: passes through; a device-located handle is virtualized
/// (the application gets the table's value) or, with `GPUSNAP_AGENT_APP_VMM=0`, recorded.
///
/// # Safety
/// As the driver function: `handle` valid for writes, `prop` valid for reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuMemCreate") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        let cfg = crate::config::config();
        let movable = cfg.app_vmm && !cfg.disabled;
        // Plain device memory is made exportable, so that a dump can lend it rather than copy it
        // first; the application still reads back (and can export) only what it asked for.
        let lendable = if movable && !prop.is_null() {
            // SAFETY: the caller's prop points to a whole CUmemAllocationProp (the driver reads
            // it next); copied as bytes, unaligned.
            let asked = unsafe { prop.cast::<table::PropBytes>().read_unaligned() };
            // SAFETY: as above.
            unsafe { device_of_prop(prop) }.and_then(|dev| {
                let posix_fd = drv.posix_fd_handles(dev);
                if let Err(why) = crate::cu::app_lendability(posix_fd, &asked, dev) {
                    debug!("cuMemCreate: {size} bytes on device {dev} are copied first at a dump, not lent: {why}");
                }
                crate::cu::lendable_prop(posix_fd, &asked, dev)
            })
        } else {
            None
        };
        let made_with = lendable.filter(|with_fd| {
            // SAFETY: the bytes are a whole CUmemAllocationProp (plain data, no padding: the
            // layout test in cu.rs), copied out unaligned into a properly aligned local.
            let prop = unsafe {
                with_fd
                    .as_ptr()
                    .cast::<CUmemAllocationProp>()
                    .read_unaligned()
            };
            // SAFETY: handle is the caller's out pointer, prop a valid aligned property struct.
            let rc = unsafe { (drv.mem_create)(handle, size, &prop, flags) };
            rc == CUDA_SUCCESS
        });
        let rc = if made_with.is_some() {
            CUDA_SUCCESS
        } else {
            // SAFETY: the caller's arguments are passed to the real function unchanged.
            unsafe { (drv.mem_create)(handle, size, prop, flags) }
        };
        if rc == CUDA_SUCCESS && !handle.is_null() && !prop.is_null() {
            // SAFETY: the real call accepted prop and wrote *handle.
            if let Some(dev) = unsafe { device_of_prop(prop) } {
                // SAFETY: as above.
                let h = unsafe { *handle };
                if movable {
                    // SAFETY: prop points to a whole CUmemAllocationProp (the driver read it);
                    // copied as bytes, unaligned.
                    let asked = unsafe { prop.cast::<table::PropBytes>().read_unaligned() };
                    let made = made_with.unwrap_or(asked);
                    let v = table::lock().virtualize(h, size as u64, dev, (made, asked));
                    // SAFETY: handle is valid for writes (the driver just wrote it).
                    unsafe { *handle = v };
                } else {
                    table::lock().record_app_create(h, size as u64, dev);
                }
                // A process whose device memory is all its own VMM still gets an agent, so the
                // plugin can list it (and knows the driver checkpoint holds its data).
                crate::server::ensure_started();
            }
        }
        rc
    })
}

/// Calls the driver with the translation of `handle`; if that fails and the translation is
/// another now, once more with the new one. A program thread that reached the driver's
/// checkpoint lock inside the call waited there with the translation of before: across a
/// rollback or `gpusnap recover` the memory may have been released and made again under a new
/// driver handle, and the old one is gone. Returns the handle used and the driver's status.
fn with_current_handle(
    handle: CUmemGenericAllocationHandle,
    call: impl Fn(CUmemGenericAllocationHandle) -> CuRes,
) -> Result<(CUmemGenericAllocationHandle, CuRes), CuRes> {
    let real = real_handle(handle)?;
    let rc = call(real);
    if rc == CUDA_SUCCESS {
        return Ok((real, rc));
    }
    match real_handle(handle) {
        Ok(now) if now != real => {
            debug!("handle {handle:#x} is driver handle {now:#x} now, not {real:#x}: called again");
            Ok((now, call(now)))
        }
        _ => Ok((real, rc)),
    }
}

/// How often a program call on released memory looks whether it is back.
const RELEASED_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// The driver's value for an application handle. While a dump has released the memory the
/// call waits until it is back: the process is then locked or checkpointed by the driver,
/// whose own calls wait the same way (a rollback, `gpusnap recover` or a restore brings the
/// memory back; a job that is killed never returns). Failing instead would show the program
/// an error it never gets without the agent: CI saw a tick fail when CRIU died after the
/// driver checkpoint and the program's thread ran on into such a call before the recover.
fn real_handle(h: CUmemGenericAllocationHandle) -> Result<CUmemGenericAllocationHandle, CuRes> {
    let mut waited = false;
    loop {
        let known = table::lock()
            .real_handle(h)
            .or_else(|| crate::shareable::import_real(h));
        match known {
            None => return Ok(h),
            Some(Some(real)) => {
                if waited {
                    debug!("handle {h:#x} is back (driver handle {real:#x}): the call goes on");
                }
                return Ok(real);
            }
            Some(None) => {
                if !waited {
                    debug!("handle {h:#x} is released by a dump: the call waits for it");
                    waited = true;
                }
                std::thread::sleep(RELEASED_POLL);
            }
        }
    }
}

/// Interposes libcuda's `cuMemMap`: maps the driver's handle, records the mapping.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuMemMap") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        let import = crate::shareable::import_real(handle)
            .is_some()
            .then(crate::shareable::ImportCall::begin);
        // SAFETY: the caller's arguments are passed to the real function, the handle translated.
        let call = |real| unsafe { (drv.mem_map)(ptr, size, offset, real, flags) };
        let (real, rc) = match with_current_handle(handle, call) {
            Ok(done) => done,
            Err(rc) => return rc,
        };
        if rc == CUDA_SUCCESS {
            if import.is_some() {
                crate::shareable::mapped(handle, ptr, size as u64, offset as u64);
                return rc;
            }
            let mut t = table::lock();
            if real == handle {
                t.record_app_map(ptr, size as u64, handle);
            } else {
                t.app_map_virtual(ptr, size as u64, offset as u64, handle);
            }
        }
        rc
    })
}

/// Interposes libcuda's `cuMemUnmap`: passes through, forgets the mappings. They stop being
/// movable before the driver is called (a dump must not copy from a range being unmapped).
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuMemUnmap") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        {
            let mut t = table::lock();
            // The driver would unmap the agent's mapping of a converted cuMemAlloc, which the
            // application never mapped (and which cuMemUnmap refuses without the agent).
            if t.overlaps_converted_alloc(ptr, size as u64) {
                return CUDA_ERROR_INVALID_VALUE;
            }
            t.begin_app_unmap(ptr, size as u64);
        }
        let _import = crate::shareable::maps_an_import(ptr, size as u64)
            .then(crate::shareable::ImportCall::begin);
        // SAFETY: the caller's arguments are passed to the real function unchanged.
        let rc = unsafe { (drv.mem_unmap)(ptr, size) };
        if rc == CUDA_SUCCESS {
            let gone = table::lock().record_app_unmap(ptr, size as u64);
            crate::own_fds::forget_handles(&gone);
            crate::shareable::unmapped(ptr, size as u64);
            crate::shareable::forget_gone_exports();
        }
        rc
    })
}

/// One `CUmemAccessDesc` as its bytes say: location type, location id, flags (12 bytes, read
/// as plain words: a program may pass enum values the bindings do not list).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Access {
    location_type: u32,
    location_id: i32,
    flags: u32,
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: u32 = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
const ACCESS_READWRITE: u32 = 3;

/// Whether `access` is what the agent gives memory of `device` when it makes it again
/// (read-write for that GPU alone, said once or more): anything else would be lost.
pub(crate) fn access_is_default(access: &[Access], device: i32) -> bool {
    !access.is_empty()
        && access.iter().all(|a| {
            a.location_type == LOCATION_DEVICE
                && a.location_id == device
                && a.flags == ACCESS_READWRITE
        })
}

/// Interposes `cuMemSetAccess`: passes through; access set on memory the agent moves (its
/// conversions, the program's own mappings, imports) other than the default it would give that
/// memory again is recorded ([`hazard::ACCESS_SET`]): such a process takes the driver's path,
/// which keeps the access.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuMemSetAccess") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        // SAFETY: the caller's arguments are passed to the real function unchanged.
        let rc = unsafe { (drv.mem_set_access)(ptr, size, desc, count) };
        if rc != CUDA_SUCCESS || desc.is_null() || count == 0 {
            return rc;
        }
        let device = table::lock()
            .device_of(ptr)
            .or_else(|| crate::shareable::import_device_at(ptr));
        let Some(device) = device else {
            return rc; // not the agent's to move: the driver's checkpoint keeps it
        };
        let access: Vec<Access> = (0..count.min(64))
            .map(|i| {
                // SAFETY: the driver accepted `count` descriptors at `desc`, 12 bytes each
                // (size test below); read as bytes, unaligned.
                let b = unsafe {
                    desc.cast::<u8>()
                        .add(i * size_of::<CUmemAccessDesc>())
                        .cast::<[u8; 12]>()
                        .read_unaligned()
                };
                let word = |at: usize| u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                Access {
                    location_type: word(0),
                    location_id: word(4) as i32,
                    flags: word(8),
                }
            })
            .collect();
        if count > 64 || !access_is_default(&access, device) {
            crate::hazards::record(hazard::ACCESS_SET);
            debug!(
                "cuMemSetAccess({ptr:#x}, {size} bytes): {access:?} on memory of device {device}: recorded (the driver's path keeps it)"
            );
        }
        rc
    })
}

/// Interposes libcuda's `cuMemRelease`: counts a release of an application handle (the last
/// one releases the driver's handle), passes any other through.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuMemRelease") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        match crate::shareable::app_release(handle) {
            Some(crate::shareable::Release::Real(real)) => {
                // SAFETY: the driver's imported handle behind the application's value, whose
                // last reference this was.
                return unsafe { (drv.mem_release)(real) };
            }
            Some(crate::shareable::Release::Counted) => return CUDA_SUCCESS,
            Some(crate::shareable::Release::Invalid) => return CUDA_ERROR_INVALID_VALUE,
            None => {}
        }
        let action = {
            let mut t = table::lock();
            t.real_handle(handle).map(|_| t.app_release(handle))
        };
        if action.is_some() {
            crate::shareable::forget_gone_exports();
        }
        match action {
            None => {
                // SAFETY: the caller's argument is passed to the real function unchanged.
                let rc = unsafe { (drv.mem_release)(handle) };
                if rc == CUDA_SUCCESS {
                    table::lock().record_app_release(handle);
                }
                rc
            }
            Some(table::AppRelease::ReleaseReal(real)) => {
                // Unmapped already: the handle is gone, and its own descriptor with it.
                if table::lock().real_handle(handle).is_none() {
                    crate::own_fds::forget_handles(&[real]);
                }
                // SAFETY: the driver handle behind the application's, whose last reference
                // this was.
                unsafe { (drv.mem_release)(real) }
            }
            Some(table::AppRelease::Counted) => CUDA_SUCCESS,
            Some(table::AppRelease::Invalid) => CUDA_ERROR_INVALID_VALUE,
        }
    })
}

/// Interposes libcuda's `cuMemRetainAllocationHandle`: returns the application's value for a
/// handle it created (the table keeps a single driver reference).
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut CUmemGenericAllocationHandle,
    addr: *mut c_void,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuMemRetainAllocationHandle") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        let Some(retain) = drv.mem_retain_allocation_handle else {
            return CUDA_ERROR_NOT_SUPPORTED;
        };
        // SAFETY: the caller's arguments are passed to the real function unchanged.
        let rc = unsafe { retain(handle, addr) };
        if rc != CUDA_SUCCESS || handle.is_null() {
            return rc;
        }
        // SAFETY: the driver wrote *handle.
        let real = unsafe { *handle };
        let extra = {
            let mut t = table::lock();
            t.virtual_of(real).map(|v| (v, t.app_retain(v)))
        }
        .or_else(|| crate::shareable::retained(real, addr as usize as u64));
        if let Some((v, release_extra)) = extra {
            // SAFETY: handle is valid for writes.
            unsafe { *handle = v };
            if release_extra {
                // SAFETY: the reference the retain just added; the table holds another.
                unsafe { (drv.mem_release)(real) };
            }
        }
        rc
    })
}

/// Interposes libcuda's `cuMemGetAllocationPropertiesFromHandle`: translates the handle.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationPropertiesFromHandle(
    prop: *mut CUmemAllocationProp,
    handle: CUmemGenericAllocationHandle,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuMemGetAllocationPropertiesFromHandle") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        let Some(get) = drv.mem_get_allocation_properties_from_handle else {
            return CUDA_ERROR_NOT_SUPPORTED;
        };
        // SAFETY: the caller's arguments, the handle translated.
        let call = |real| unsafe { get(prop, real) };
        let rc = match with_current_handle(handle, call) {
            Ok((_, rc)) => rc,
            Err(rc) => return rc,
        };
        let known = {
            let t = table::lock();
            t.props_of(handle).map(|p| (p, t.is_imported(handle)))
        };
        if rc == CUDA_SUCCESS
            && !prop.is_null()
            && let Some(((asked, made), imported)) = known
        {
            if imported {
                // Memory imported at a hand-over: what the driver says of an import need not be
                // what the creator asked (not measured), and the memory was made with exactly
                // those properties (checked at the hand-over). The location stays the driver's.
                let location = std::mem::offset_of!(CUmemAllocationProp, location);
                let location_end = location + std::mem::size_of::<CUmemLocation>();
                let out = prop.cast::<u8>();
                for (i, b) in asked.iter().enumerate() {
                    if !(location..location_end).contains(&i) {
                        // SAFETY: prop is the caller's whole CUmemAllocationProp, just written
                        // by the driver; i lies inside it.
                        unsafe { out.add(i).write(*b) };
                    }
                }
                return rc;
            }
            let types = crate::cu::requested_handle_types(&asked);
            if types != crate::cu::requested_handle_types(&made) {
                // The handle type the agent added is not the application's to see.
                // SAFETY: prop is the caller's whole CUmemAllocationProp, just written by the
                // driver; only its requestedHandleTypes (a u32 at that offset) is replaced.
                unsafe {
                    prop.cast::<u8>()
                        .add(std::mem::offset_of!(
                            CUmemAllocationProp,
                            requestedHandleTypes
                        ))
                        .cast::<u32>()
                        .write_unaligned(types)
                };
            }
        }
        rc
    })
}

/// Calls an optional driver function through `call` and records `bit` when `ok(rc)`.
fn record_hazard<F: Copy>(
    name: &str,
    bit: u32,
    pick: impl FnOnce(&Driver) -> Option<F>,
    call: impl FnOnce(F) -> CuRes,
    ok: impl FnOnce(CuRes) -> bool,
) -> CuRes {
    let drv = match driver_for(name) {
        Ok(d) => d,
        Err(rc) => return rc,
    };
    let Some(f) = pick(drv) else {
        return CUDA_ERROR_NOT_SUPPORTED;
    };
    let rc = call(f);
    if ok(rc) {
        crate::hazards::record(bit);
        debug!("{name}: recorded (the driver checkpoint cannot take this state)");
    }
    rc
}

/// Interposes `cuMemAllocManaged`: passes through, records managed memory.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    size: usize,
    flags: c_uint,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        record_hazard(
            "cuMemAllocManaged",
            hazard::MANAGED_MEMORY,
            |d| d.mem_alloc_managed,
            // SAFETY: the caller's arguments are passed to the real function unchanged.
            |f| unsafe { f(dptr, size, flags) },
            |rc| rc == CUDA_SUCCESS,
        )
    })
}

/// Interposes `cuIpcGetMemHandle`: a converted allocation is the agent's to share (see
/// [`crate::ipc`]); any other memory passes through, the export recorded.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetMemHandle(
    handle: *mut CUipcMemHandle,
    dptr: CUdeviceptr,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuIpcGetMemHandle") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        if !handle.is_null()
            && let Some(served) = crate::ipc::get_mem_handle(drv, dptr)
        {
            return match served {
                Ok(token) => {
                    // SAFETY: handle is the caller's non-null out pointer to 64 bytes.
                    unsafe {
                        handle
                            .cast::<[u8; crate::ipc::HANDLE_BYTES]>()
                            .write_unaligned(token)
                    };
                    // The agent thread lists the share for a dump (and serves it).
                    crate::server::ensure_started();
                    CUDA_SUCCESS
                }
                Err(rc) => rc,
            };
        }
        record_hazard(
            "cuIpcGetMemHandle",
            hazard::IPC_EXPORT,
            |d| d.ipc_get_mem_handle,
            // SAFETY: the caller's arguments are passed to the real function unchanged.
            |f| unsafe { f(handle, dptr) },
            |rc| rc == CUDA_SUCCESS,
        )
    })
}

/// Interposes `cuIpcOpenMemHandle_v2` (the handle is passed by value, as in cuda.h): an agent's
/// token is opened by [`crate::ipc`]; any other handle passes through, the import recorded.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    dptr: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    flags: c_uint,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuIpcOpenMemHandle_v2") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        let bytes = handle.reserved.map(|c| c as u8);
        if !dptr.is_null()
            && let Some(served) = crate::ipc::open_mem_handle(drv, &bytes, flags)
        {
            return match served {
                Ok(addr) => {
                    // SAFETY: dptr is the caller's non-null out pointer.
                    unsafe { *dptr = addr };
                    // An importer without allocations of its own still answers a dump.
                    crate::server::ensure_started();
                    CUDA_SUCCESS
                }
                Err(rc) => rc,
            };
        }
        record_hazard(
            "cuIpcOpenMemHandle_v2",
            hazard::IPC_IMPORT,
            |d| d.ipc_open_mem_handle,
            // SAFETY: the caller's arguments are passed to the real function unchanged.
            |f| unsafe { f(dptr, handle, flags) },
            |rc| rc == CUDA_SUCCESS,
        )
    })
}

/// Interposes `cuIpcCloseMemHandle`: the agent's imports are closed by [`crate::ipc`]; any other
/// pointer passes through.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcCloseMemHandle(dptr: CUdeviceptr) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuIpcCloseMemHandle") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        if let Some(rc) = crate::ipc::close_mem_handle(drv, dptr) {
            return rc;
        }
        let Some(close) = drv.ipc_close_mem_handle else {
            return CUDA_ERROR_NOT_SUPPORTED;
        };
        // SAFETY: the caller's argument is passed to the real function unchanged.
        unsafe { close(dptr) }
    })
}

/// Interposes `cuCtxEnablePeerAccess`: passes through, records peer mappings.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: CUcontext, flags: c_uint) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        record_hazard(
            "cuCtxEnablePeerAccess",
            hazard::PEER_ACCESS,
            |d| d.ctx_enable_peer_access,
            // SAFETY: the caller's arguments are passed to the real function unchanged.
            |f| unsafe { f(peer, flags) },
            |rc| rc == CUDA_SUCCESS || rc == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
        )
    })
}

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const HANDLE_TYPE_POSIX_FD: c_uint = 1;

/// Interposes `cuMemExportToShareableHandle`: passes through (the handle translated). A POSIX
/// fd of an application handle the agent virtualizes is kept track of ([`crate::shareable`],
/// carried on the split path); any other export records the refusing `IPC_EXPORT`.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    out: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    handle_type: c_uint,
    flags: u64,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        if let Some((asked, made)) = table::lock().props_of(handle) {
            let added = crate::cu::requested_handle_types(&made)
                & !crate::cu::requested_handle_types(&asked);
            if added & handle_type != 0 {
                // Not a type the application created the handle with (the agent may have added
                // it): the driver's answer for such an export.
                return CUDA_ERROR_INVALID_VALUE;
            }
        }
        let app = handle;
        let handle = match real_handle(handle) {
            Ok(r) => r,
            Err(rc) => return rc,
        };
        let ours = table::lock().real_handle(app).is_some();
        if ours && handle_type == HANDLE_TYPE_POSIX_FD && !out.is_null() {
            let drv = match driver_for("cuMemExportToShareableHandle") {
                Ok(d) => d,
                Err(rc) => return rc,
            };
            let Some(export) = drv.mem_export_to_shareable_handle else {
                return CUDA_ERROR_NOT_SUPPORTED;
            };
            // SAFETY: the caller's arguments, the handle translated.
            let mut rc = unsafe { export(out, handle, handle_type, flags) };
            if rc != CUDA_SUCCESS
                && let Some(own) = crate::own_fds::copy_of_handle(handle)
            {
                // After a hand-over the memory is mapped from an imported handle, which the
                // driver will not export again: the descriptor it was imported from names the
                // same memory, so a copy of it is the program's export.
                // SAFETY: for POSIX fds `out` points to an int (checked non-null above).
                unsafe {
                    out.cast::<c_int>()
                        .write_unaligned(std::os::fd::IntoRawFd::into_raw_fd(own))
                };
                rc = CUDA_SUCCESS;
            }
            if rc == CUDA_SUCCESS {
                // SAFETY: for POSIX fds the driver wrote an int through `out`.
                let fd = unsafe { out.cast::<c_int>().read_unaligned() };
                if crate::shareable::exported(app, fd) {
                    crate::hazards::record(hazard::SHAREABLE_EXPORT);
                } else {
                    crate::hazards::record(hazard::IPC_EXPORT);
                }
                crate::server::ensure_started();
            }
            return rc;
        }
        record_hazard(
            "cuMemExportToShareableHandle",
            hazard::IPC_EXPORT,
            |d| d.mem_export_to_shareable_handle,
            // SAFETY: the caller's arguments, the handle translated.
            |f| unsafe { f(out, handle, handle_type, flags) },
            |rc| rc == CUDA_SUCCESS,
        )
    })
}

/// Interposes `cuMulticastBindMem`: binds the driver's handle behind the application's, and pins
/// it to the driver checkpoint (moving bound memory would break the multicast binding).
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMulticastBindMem(
    mc_handle: CUmemGenericAllocationHandle,
    mc_offset: usize,
    mem_handle: CUmemGenericAllocationHandle,
    mem_offset: usize,
    size: usize,
    flags: u64,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuMulticastBindMem") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        let Some(bind) = drv.multicast_bind_mem else {
            return CUDA_ERROR_NOT_SUPPORTED;
        };
        let real = match real_handle(mem_handle) {
            Ok(r) => r,
            Err(rc) => return rc,
        };
        // SAFETY: the caller's arguments, the memory handle translated.
        let rc = unsafe { bind(mc_handle, mc_offset, real, mem_offset, size, flags) };
        if rc == CUDA_SUCCESS && real != mem_handle {
            if crate::shareable::import_real(mem_handle).is_some() {
                // Another process's memory bound to a multicast object: a release would unmap
                // bound memory, so such a process is not carried (refused at dump).
                crate::hazards::record(hazard::IPC_IMPORT);
            } else {
                table::lock().pin(mem_handle);
            }
        }
        rc
    })
}

/// Interposes `cuMemImportFromShareableHandle`: passes through. A POSIX fd import is
/// virtualized ([`crate::shareable`]: the application gets a value of ours, so that the memory
/// can be imported again after a checkpoint; another process's memory is never moved); any
/// other import, or one the agent cannot keep track of, records the refusing `IPC_IMPORT`.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    handle_type: c_uint,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let cfg = crate::config::config();
        if handle_type == HANDLE_TYPE_POSIX_FD && !handle.is_null() && cfg.app_vmm && !cfg.disabled
        {
            let drv = match driver_for("cuMemImportFromShareableHandle") {
                Ok(d) => d,
                Err(rc) => return rc,
            };
            let Some(import) = drv.mem_import_from_shareable_handle else {
                return CUDA_ERROR_NOT_SUPPORTED;
            };
            // SAFETY: the caller's arguments are passed to the real function unchanged.
            let rc = unsafe { import(handle, os_handle, handle_type) };
            if rc != CUDA_SUCCESS {
                return rc;
            }
            // SAFETY: the real call succeeded and wrote *handle.
            let real = unsafe { *handle };
            // The POSIX fd is the pointer's value, as cuda.h documents.
            let fd = os_handle as usize as c_int;
            let v = drv
                .current_device()
                .ok()
                .and_then(|dev| crate::shareable::imported(real, fd, dev));
            match v {
                Some(v) => {
                    // SAFETY: handle is valid for writes (the driver just wrote it).
                    unsafe { *handle = v };
                    crate::hazards::record(hazard::SHAREABLE_IMPORT);
                }
                None => {
                    crate::hazards::record(hazard::IPC_IMPORT);
                    debug!("cuMemImportFromShareableHandle: not tracked; recorded as refusing");
                }
            }
            crate::server::ensure_started();
            return rc;
        }
        record_hazard(
            "cuMemImportFromShareableHandle",
            hazard::IPC_IMPORT,
            |d| d.mem_import_from_shareable_handle,
            // SAFETY: the caller's arguments are passed to the real function unchanged.
            |f| unsafe { f(handle, os_handle, handle_type) },
            |rc| rc == CUDA_SUCCESS,
        )
    })
}

// ---------------------------------------------------------------------------------------------
// Interprocess events

/// Interposes `cuIpcOpenEventHandle` (the handle is passed by value, as in cuda.h): passes
/// through, and the opened event is reported as a hazard until it is destroyed (the driver
/// restores it, but a wait on it after the restore did not wait for the exporter on the H200).
/// The agent thread is started, so a process with no memory of the agent's still answers a dump.
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenEventHandle(
    event: *mut CUevent,
    handle: CUipcEventHandle,
) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        let drv = match driver_for("cuIpcOpenEventHandle") {
            Ok(d) => d,
            Err(rc) => return rc,
        };
        let Some(open) = drv.ipc_open_event_handle else {
            return CUDA_ERROR_NOT_SUPPORTED;
        };
        // SAFETY: the caller's arguments are passed to the real function unchanged.
        let rc = unsafe { open(event, handle) };
        if rc == CUDA_SUCCESS && !event.is_null() {
            // SAFETY: the real call succeeded, so it wrote the caller's out pointer.
            let opened = unsafe { *event };
            crate::hazards::ipc_event_opened(opened as usize);
            debug!("cuIpcOpenEventHandle: {opened:p} recorded until it is destroyed");
            crate::server::ensure_started();
        }
        rc
    })
}

/// A destroy through `real` (either ABI), the event forgotten by [`crate::hazards`] when it was
/// an opened one. Every event of the process comes here: one atomic load when none is opened.
fn destroy_event(event: CUevent, real: unsafe extern "C" fn(CUevent) -> CuRes) -> CuRes {
    // SAFETY: the caller's argument is passed to the real function unchanged.
    let rc = unsafe { real(event) };
    if rc == CUDA_SUCCESS {
        crate::hazards::event_destroyed(event as usize);
    }
    rc
}

/// Interposes `cuEventDestroy_v2` (what `cudaEventDestroy` reaches).
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(event: CUevent) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || {
        match driver_for("cuEventDestroy_v2") {
            Ok(d) => destroy_event(event, d.event_destroy),
            Err(rc) => rc,
        }
    })
}

/// Interposes the v1 export `cuEventDestroy` (same C signature; what `cuGetProcAddress` returns
/// for versions before 4.0, and what a program built against an old cuda.h links to).
///
/// # Safety
/// As the driver function.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy(event: CUevent) -> CuRes {
    guard(CUDA_ERROR_UNKNOWN, || match driver_for("cuEventDestroy") {
        Ok(d) => match d.event_destroy_v1 {
            Some(real) => destroy_event(event, real),
            None => CUDA_ERROR_NOT_SUPPORTED,
        },
        Err(rc) => rc,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_hooks_are_found_by_symbol_and_proc_name() {
        assert_eq!(
            Hooked::from_symbol(b"cuIpcOpenEventHandle"),
            Some(Hooked::IpcOpenEventHandle)
        );
        assert_eq!(
            Hooked::from_symbol(b"cuEventDestroy_v2"),
            Some(Hooked::EventDestroy)
        );
        assert_eq!(
            Hooked::from_symbol(b"cuEventDestroy"),
            Some(Hooked::EventDestroyV1)
        );
        for v in [0, 1000, 12000, 13000] {
            assert_eq!(
                Hooked::from_proc_name(b"cuIpcOpenEventHandle", v),
                Some(Hooked::IpcOpenEventHandle)
            );
        }
        let below = V2_EVENT_DESTROY_ABI - 1;
        assert_eq!(
            Hooked::from_proc_name(b"cuEventDestroy", below),
            Some(Hooked::EventDestroyV1)
        );
        for v in [V2_EVENT_DESTROY_ABI, 12000, 13000] {
            assert_eq!(
                Hooked::from_proc_name(b"cuEventDestroy", v),
                Some(Hooked::EventDestroy)
            );
        }
        assert_eq!(Hooked::from_proc_name(b"cuEventDestroy_v2", 13000), None);
        assert_eq!(Hooked::from_proc_name(b"cuIpcGetEventHandle", 13000), None);
    }

    #[test]
    fn hazard_hooks_are_found_by_symbol_and_proc_name() {
        for (sym, proc_name, v, h) in [
            (
                &b"cuMemAllocManaged"[..],
                &b"cuMemAllocManaged"[..],
                13000,
                Hooked::MemAllocManaged,
            ),
            (
                b"cuIpcGetMemHandle",
                b"cuIpcGetMemHandle",
                13000,
                Hooked::IpcGetMemHandle,
            ),
            (
                b"cuIpcOpenMemHandle_v2",
                b"cuIpcOpenMemHandle",
                13000,
                Hooked::IpcOpenMemHandle,
            ),
            (
                b"cuCtxEnablePeerAccess",
                b"cuCtxEnablePeerAccess",
                13000,
                Hooked::CtxEnablePeerAccess,
            ),
            (
                b"cuMemExportToShareableHandle",
                b"cuMemExportToShareableHandle",
                13000,
                Hooked::MemExportToShareableHandle,
            ),
            (
                b"cuMemImportFromShareableHandle",
                b"cuMemImportFromShareableHandle",
                13000,
                Hooked::MemImportFromShareableHandle,
            ),
        ] {
            assert_eq!(Hooked::from_symbol(sym), Some(h));
            assert_eq!(Hooked::from_proc_name(proc_name, v), Some(h));
            assert!(!h.hook_addr().is_null());
        }
        // The v1 export of cuIpcOpenMemHandle keeps its own ABI: not swapped.
        assert_eq!(Hooked::from_proc_name(b"cuIpcOpenMemHandle", 10020), None);
        assert_eq!(Hooked::from_symbol(b"cuIpcOpenMemHandle"), None);
    }

    #[test]
    fn proc_names_swap_only_for_matching_abi() {
        assert_eq!(
            Hooked::from_proc_name(b"cuMemAlloc", 13000),
            Some(Hooked::MemAlloc)
        );
        assert_eq!(
            Hooked::from_proc_name(b"cuMemAlloc", 3020),
            Some(Hooked::MemAlloc)
        );
        assert_eq!(
            Hooked::from_proc_name(b"cuMemAlloc", 3010),
            None,
            "v1 ABI (32-bit sizes)"
        );
        assert_eq!(Hooked::from_proc_name(b"cuMemFree", 2000), None);
        assert_eq!(
            Hooked::from_proc_name(b"cuMemAllocPitch", 12000),
            Some(Hooked::MemAllocPitch)
        );
        assert_eq!(
            Hooked::from_proc_name(b"cuMemCreate", 10020),
            Some(Hooked::MemCreate)
        );
        assert_eq!(
            Hooked::from_proc_name(b"cuMemMap", 13000),
            Some(Hooked::MemMap)
        );
        assert_eq!(
            Hooked::from_proc_name(b"cuMemUnmap", 13000),
            Some(Hooked::MemUnmap)
        );
        assert_eq!(
            Hooked::from_proc_name(b"cuMemRelease", 13000),
            Some(Hooked::MemRelease)
        );
        assert_eq!(
            Hooked::from_proc_name(b"cuGetProcAddress", 13000),
            Some(Hooked::GetProcAddressV2)
        );
        assert_eq!(
            Hooked::from_proc_name(b"cuGetProcAddress", 11080),
            Some(Hooked::GetProcAddress)
        );
        assert_eq!(Hooked::from_proc_name(b"cuMemAlloc_v2", 13000), None);
        assert_eq!(Hooked::from_proc_name(b"cuMemAllocAsync", 13000), None);
        assert_eq!(Hooked::from_proc_name(b"", 13000), None);
    }

    #[test]
    fn exported_names_map_to_hooks() {
        for (name, h) in [
            (&b"cuMemAlloc_v2"[..], Hooked::MemAlloc),
            (b"cuMemFree_v2", Hooked::MemFree),
            (b"cuMemAllocPitch_v2", Hooked::MemAllocPitch),
            (b"cuMemCreate", Hooked::MemCreate),
            (b"cuMemMap", Hooked::MemMap),
            (b"cuMemUnmap", Hooked::MemUnmap),
            (b"cuMemRelease", Hooked::MemRelease),
            (
                b"cuMemRetainAllocationHandle",
                Hooked::MemRetainAllocationHandle,
            ),
            (
                b"cuMemGetAllocationPropertiesFromHandle",
                Hooked::MemGetAllocationPropertiesFromHandle,
            ),
            (b"cuMulticastBindMem", Hooked::MulticastBindMem),
            (b"cuGetProcAddress", Hooked::GetProcAddress),
            (b"cuGetProcAddress_v2", Hooked::GetProcAddressV2),
        ] {
            assert_eq!(Hooked::from_symbol(name), Some(h));
            assert!(!h.hook_addr().is_null());
            if h != Hooked::GetProcAddress && h != Hooked::GetProcAddressV2 {
                let base = std::str::from_utf8(name).unwrap().trim_end_matches("_v2");
                assert_eq!(
                    Hooked::from_proc_name(base.as_bytes(), 13000),
                    Some(h),
                    "{base}"
                );
            }
        }
        assert_eq!(
            Hooked::from_symbol(b"cuMemAlloc"),
            None,
            "the v1 ABI is not hooked"
        );
        assert_eq!(Hooked::from_symbol(b"cuMemFree"), None);
    }

    #[test]
    fn every_hook_is_found_by_its_own_symbol_and_has_its_own_export() {
        let mut exports = std::collections::HashSet::new();
        for &h in Hooked::ALL {
            assert_eq!(Hooked::from_symbol(h.symbol().as_bytes()), Some(h));
            assert!(!h.hook_addr().is_null());
            assert!(exports.insert(h.hook_addr()), "{h:?} shares an export");
        }
        assert_eq!(Hooked::ALL.len(), 23);
    }

    #[test]
    fn proc_name_versions_at_each_boundary() {
        for (name, below, from, h) in [
            (&b"cuMemAlloc"[..], 3019, 3020, Hooked::MemAlloc),
            (b"cuMemFree", 3019, 3020, Hooked::MemFree),
            (b"cuMemAllocPitch", 3019, 3020, Hooked::MemAllocPitch),
            (
                b"cuIpcOpenMemHandle",
                10999,
                11000,
                Hooked::IpcOpenMemHandle,
            ),
        ] {
            assert_eq!(Hooked::from_proc_name(name, below), None, "{h:?}");
            assert_eq!(Hooked::from_proc_name(name, from), Some(h));
        }
        assert_eq!(
            Hooked::from_proc_name(b"cuGetProcAddress", 11999),
            Some(Hooked::GetProcAddress)
        );
        assert_eq!(
            Hooked::from_proc_name(b"cuGetProcAddress", 12000),
            Some(Hooked::GetProcAddressV2)
        );
        // The rest are one ABI at every version.
        for (name, h) in [
            (&b"cuMemCreate"[..], Hooked::MemCreate),
            (b"cuMemMap", Hooked::MemMap),
            (b"cuMemUnmap", Hooked::MemUnmap),
            (b"cuMemRelease", Hooked::MemRelease),
            (
                b"cuMemRetainAllocationHandle",
                Hooked::MemRetainAllocationHandle,
            ),
            (
                b"cuMemGetAllocationPropertiesFromHandle",
                Hooked::MemGetAllocationPropertiesFromHandle,
            ),
            (b"cuMulticastBindMem", Hooked::MulticastBindMem),
            (b"cuMemAllocManaged", Hooked::MemAllocManaged),
            (b"cuIpcGetMemHandle", Hooked::IpcGetMemHandle),
            (b"cuIpcCloseMemHandle", Hooked::IpcCloseMemHandle),
            (b"cuCtxEnablePeerAccess", Hooked::CtxEnablePeerAccess),
            (
                b"cuMemExportToShareableHandle",
                Hooked::MemExportToShareableHandle,
            ),
            (
                b"cuMemImportFromShareableHandle",
                Hooked::MemImportFromShareableHandle,
            ),
        ] {
            for v in [0, 1000, 12000, i32::MAX] {
                assert_eq!(Hooked::from_proc_name(name, v), Some(h), "{h:?} at {v}");
            }
        }
        // Exported names are not proc names, nor the other way round.
        assert_eq!(
            Hooked::from_proc_name(b"cuIpcOpenMemHandle_v2", 13000),
            None
        );
        assert_eq!(Hooked::from_proc_name(b"cuGetProcAddress_v2", 13000), None);
        assert_eq!(Hooked::from_symbol(b"cuMemAllocPitch"), None);
        assert_eq!(Hooked::from_symbol(b"cuMemHostRegister_v2"), None);
    }

    #[test]
    fn device_of_prop_reads_the_location() {
        use cudarc::driver::sys::*;
        let mut prop = CUmemAllocationProp {
            type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: CUmemLocation {
                type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: 3,
            },
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        };
        // SAFETY: prop is a live struct.
        assert_eq!(unsafe { device_of_prop(&prop) }, Some(3));
        prop.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST;
        // SAFETY: as above.
        assert_eq!(unsafe { device_of_prop(&prop) }, None);
    }

    #[test]
    fn dlsym_still_works_through_the_hook() {
        // The unit-test binary links this crate, so `dlsym` here is our export.
        // SAFETY: dlsym with a valid handle and name.
        let p = unsafe { dlsym(libc::RTLD_DEFAULT, c"getpid".as_ptr()) };
        assert!(!p.is_null());
        // SAFETY: p is libc's getpid.
        let getpid: extern "C" fn() -> i32 = unsafe { std::mem::transmute(p) };
        assert_eq!(getpid(), std::process::id() as i32);
        // SAFETY: as above, RTLD_NEXT through the trampoline.
        let n = unsafe { dlsym(libc::RTLD_NEXT, c"getpid".as_ptr()) };
        assert!(!n.is_null());
        // SAFETY: as above.
        assert!(unsafe { dlsym(libc::RTLD_DEFAULT, c"no_such_symbol_gpusnap".as_ptr()) }.is_null());
    }

    #[test]
    fn only_read_write_for_the_memory_s_own_gpu_is_the_default_access() {
        assert_eq!(
            size_of::<CUmemAccessDesc>(),
            12,
            "the bytes cuMemSetAccess is read as"
        );
        let rw = |id| Access {
            location_type: LOCATION_DEVICE,
            location_id: id,
            flags: ACCESS_READWRITE,
        };
        assert!(access_is_default(&[rw(2)], 2));
        assert!(access_is_default(&[rw(2), rw(2)], 2));
        assert!(!access_is_default(&[], 2));
        assert!(!access_is_default(&[rw(2), rw(3)], 2), "a peer GPU");
        assert!(!access_is_default(&[rw(3)], 2), "another GPU only");
        let read_only = Access { flags: 1, ..rw(2) };
        assert!(!access_is_default(&[read_only], 2));
        let host = Access {
            location_type: 2,
            ..rw(2)
        };
        assert!(!access_is_default(&[host], 2));
    }
}
