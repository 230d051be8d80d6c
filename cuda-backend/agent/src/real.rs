//! The real functions: glibc's `dlsym` (found with `dlvsym`, which we do not hook) and a table of
//! libcuda's entry points resolved through it, loaded lazily (never at library load).
//!
//! Nothing here goes through `dlsym` as the process sees it (that is our hook) nor through
//! cudarc's wrappers (they resolve through it). Return codes are kept as raw `u32` ([`CuRes`]):
//! cudarc's `CUresult` is a Rust enum, and a code it does not list (a newer driver's) would be
//! undefined behaviour in a value of that type.

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdeviceptr, CUdriverProcAddressQueryResult, CUevent, CUfunction,
    CUipcEventHandle, CUipcMemHandle, CUmemAccessDesc, CUmemAllocationGranularity_flags,
    CUmemAllocationProp, CUmemGenericAllocationHandle, CUmodule, CUresult, CUstream, cuuint64_t,
};

/// A driver status code, as returned (see the module doc for why not `CUresult`).
pub type CuRes = u32;
const _: () = assert!(std::mem::size_of::<CUresult>() == std::mem::size_of::<CuRes>());

pub const CUDA_SUCCESS: CuRes = 0;
pub const CUDA_ERROR_INVALID_VALUE: CuRes = 1;
pub const CUDA_ERROR_NOT_INITIALIZED: CuRes = 3;
pub const CUDA_ERROR_INVALID_CONTEXT: CuRes = 201;
pub const CUDA_ERROR_NOT_FOUND: CuRes = 500;
pub const CUDA_ERROR_NOT_READY: CuRes = 600;
pub const CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: CuRes = 704;
pub const CUDA_ERROR_NOT_SUPPORTED: CuRes = 801;
pub const CUDA_ERROR_UNKNOWN: CuRes = 999;

/// Why the driver table could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// A `dlsym` made while this thread loads the table (libcuda's own start-up, hooked).
    Reentered,
    /// glibc's `dlsym` was not found with `dlvsym` (not glibc, or an unknown version).
    NoDlsym,
    /// `dlopen` of `library` failed; `why` is `dlerror`'s text.
    Dlopen { library: String, why: String },
    /// A required entry point is not exported by the loaded libcuda (too old a driver).
    Missing { symbol: &'static str },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Reentered => write!(f, "libcuda is being loaded by this thread"),
            Self::NoDlsym => write!(f, "glibc's dlsym not found with dlvsym"),
            Self::Dlopen { library, why } => write!(f, "{library} could not be loaded: {why}"),
            Self::Missing { symbol } => write!(f, "{symbol} not found in libcuda.so.1"),
        }
    }
}

impl std::error::Error for LoadError {}

/// `dlsym`'s C signature.
pub type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// glibc's `dlsym`, resolved once with `dlvsym(RTLD_NEXT, "dlsym", <version>)`.
pub fn real_dlsym() -> Option<DlsymFn> {
    let mut p = REAL_DLSYM.load(Ordering::Acquire);
    if p == 0 {
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
            // SAFETY: dlvsym with valid C strings; RTLD_NEXT from this object finds libc's dlsym.
            let f = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !f.is_null() {
                p = f as usize;
                break;
            }
        }
        if p == 0 {
            return None;
        }
        REAL_DLSYM.store(p, Ordering::Release);
    }
    // SAFETY: p is the address of glibc's dlsym, whose signature is DlsymFn.
    Some(unsafe { std::mem::transmute::<usize, DlsymFn>(p) })
}

/// The type of a driver table entry of C signature `$f`: `required` ones are the function
/// pointer, `optional` ones `None` when the driver lacks them.
macro_rules! entry_type {
    (required $f:ty) => { $f };
    (optional $f:ty) => { Option<$f> };
}

/// A resolved entry's address, null for an absent optional one.
macro_rules! entry_addr {
    (required $entry:expr) => {
        $entry as *mut c_void
    };
    (optional $entry:expr) => {
        $entry.map_or(std::ptr::null_mut(), |f| f as *mut c_void)
    };
}
pub(crate) use entry_addr;

/// Resolves one entry: `$p` the looked-up address of `$name`, `$f` its C signature. A missing
/// `required` entry returns an error naming it from the enclosing function.
macro_rules! resolve_entry {
    (required $f:ty, $p:expr, $name:expr) => {{
        let p = $p;
        if p.is_null() {
            return Err(LoadError::Missing { symbol: $name });
        }
        // SAFETY: p is libcuda's exported function of this name, whose C signature (CUDA 13
        // cuda.h) is the one declared in this table.
        unsafe { std::mem::transmute::<*mut c_void, $f>(p) }
    }};
    (optional $f:ty, $p:expr, $name:expr) => {{
        let p = $p;
        // SAFETY: as for a required entry; a null pointer stays None.
        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, $f>(p) })
    }};
}

/// Declares the driver table: one typed pointer per entry point, each resolved by name. The
/// calls the agent makes itself (all required) are listed below; the calls it interposes come
/// from [`crate::calls::hooked_calls`] (the `hooked` section), looked up by their export's name.
macro_rules! driver_table {
    (
        required { $( $field:ident = $name:literal ( $($arg:ty),* ); )* }
        hooked { $(
            $variant:ident = $export:ident ( $($harg:ty),* ) $need:ident as $hfield:ident,
                proc $proc:literal $( $rule:ident $first:ident )?;
        )* }
    ) => {
        /// libcuda's entry points used by the agent (resolved from the libcuda handle).
        pub struct Driver {
            $( pub $field: unsafe extern "C" fn($($arg),*) -> CuRes, )*
            $( pub $hfield: entry_type!($need unsafe extern "C" fn($($harg),*) -> CuRes), )*
        }

        impl Driver {
            fn resolve(handle: *mut c_void, dlsym: DlsymFn) -> Result<Self, LoadError> {
                Ok(Driver {
                    $( $field: resolve_entry!(
                        required unsafe extern "C" fn($($arg),*) -> CuRes,
                        lookup(handle, dlsym, concat!($name, "\0")),
                        $name
                    ), )*
                    $( $hfield: resolve_entry!(
                        $need unsafe extern "C" fn($($harg),*) -> CuRes,
                        lookup(handle, dlsym, concat!(stringify!($export), "\0")),
                        stringify!($export)
                    ), )*
                })
            }
        }
    };
}

fn lookup(handle: *mut c_void, dlsym: DlsymFn, name_nul: &str) -> *mut c_void {
    // SAFETY: handle is a live dlopen handle; name_nul is NUL-terminated (concat! above).
    unsafe { dlsym(handle, name_nul.as_ptr().cast()) }
}

crate::calls::hooked_calls!(driver_table! {
    required {
        init = "cuInit"(c_uint);
        get_error_name = "cuGetErrorName"(CuRes, *mut *const c_char);
        device_get = "cuDeviceGet"(*mut CUdevice, c_int);
        device_get_count = "cuDeviceGetCount"(*mut c_int);
        device_get_uuid = "cuDeviceGetUuid_v2"(*mut [u8; 16], CUdevice);
        device_get_attribute = "cuDeviceGetAttribute"(*mut c_int, c_int, CUdevice);
        ctx_get_device = "cuCtxGetDevice"(*mut CUdevice);
        ctx_set_current = "cuCtxSetCurrent"(CUcontext);
        ctx_synchronize = "cuCtxSynchronize"();
        primary_ctx_retain = "cuDevicePrimaryCtxRetain"(*mut CUcontext, CUdevice);
        primary_ctx_release = "cuDevicePrimaryCtxRelease_v2"(CUdevice);
        mem_get_allocation_granularity = "cuMemGetAllocationGranularity"(
            *mut usize, *const CUmemAllocationProp, CUmemAllocationGranularity_flags);
        mem_address_reserve = "cuMemAddressReserve"(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64);
        mem_address_free = "cuMemAddressFree"(CUdeviceptr, usize);
        stream_create = "cuStreamCreate"(*mut CUstream, c_uint);
        stream_synchronize = "cuStreamSynchronize"(CUstream);
        stream_destroy = "cuStreamDestroy_v2"(CUstream);
        event_create = "cuEventCreate"(*mut CUevent, c_uint);
        event_record = "cuEventRecord"(CUevent, CUstream);
        event_synchronize = "cuEventSynchronize"(CUevent);
        event_query = "cuEventQuery"(CUevent);
        mem_host_register = "cuMemHostRegister_v2"(*mut c_void, usize, c_uint);
        mem_host_unregister = "cuMemHostUnregister"(*mut c_void);
        memcpy_dtoh_async = "cuMemcpyDtoHAsync_v2"(*mut c_void, CUdeviceptr, usize, CUstream);
        memcpy_htod_async = "cuMemcpyHtoDAsync_v2"(CUdeviceptr, *const c_void, usize, CUstream);
        memset_d8_async = "cuMemsetD8Async"(CUdeviceptr, u8, usize, CUstream);
        memcpy_dtod = "cuMemcpyDtoD_v2"(CUdeviceptr, CUdeviceptr, usize);
        mem_get_info = "cuMemGetInfo_v2"(*mut usize, *mut usize);
        module_load_data = "cuModuleLoadData"(*mut CUmodule, *const c_void);
        module_get_function = "cuModuleGetFunction"(*mut CUfunction, CUmodule, *const c_char);
        launch_kernel = "cuLaunchKernel"(
            CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CUstream,
            *mut *mut c_void, *mut *mut c_void);
    }
});

#[cfg(test)]
impl Driver {
    /// A table resolved through a stand-in `dlsym`, for tests of the code that calls the driver.
    pub(crate) fn resolve_with(dlsym: DlsymFn) -> Result<Self, LoadError> {
        Self::resolve(std::ptr::null_mut(), dlsym)
    }
}

static DRIVER: OnceLock<Driver> = OnceLock::new();
static DRIVER_INIT: Mutex<()> = Mutex::new(());

thread_local! {
    /// Set while this thread loads the table: a `dlsym` made by libcuda's own start-up (our
    /// hook) must not try to load it again.
    static LOADING: Cell<bool> = const { Cell::new(false) };
}

/// The driver table, loaded on first use. A failure is not remembered: a process may load
/// libcuda later (e.g. Python importing torch), so a later call tries again.
pub fn driver() -> Result<&'static Driver, LoadError> {
    if let Some(d) = DRIVER.get() {
        return Ok(d);
    }
    if LOADING.with(Cell::get) {
        return Err(LoadError::Reentered);
    }
    let _guard = DRIVER_INIT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = DRIVER.get() {
        return Ok(d);
    }
    LOADING.with(|l| l.set(true));
    let loaded = load();
    LOADING.with(|l| l.set(false));
    let d = loaded?;
    Ok(DRIVER.get_or_init(|| d))
}

/// The table if it is already loaded (never loads).
pub fn driver_if_loaded() -> Option<&'static Driver> {
    DRIVER.get()
}

fn load() -> Result<Driver, LoadError> {
    let dlsym = real_dlsym().ok_or(LoadError::NoDlsym)?;
    // A keeper loads the very library its job uses (found in the job's mappings).
    if let Some(path) = crate::role::libcuda() {
        // SAFETY: dlopen with a valid C string, the path the plugin named.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            return Err(LoadError::Dlopen {
                library: path.to_string_lossy().into_owned(),
                why: dlerror_text(),
            });
        }
        return Driver::resolve(handle, dlsym);
    }
    // SAFETY: dlopen with a valid C string; NOLOAD only returns an already loaded libcuda.
    let mut handle =
        unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        // SAFETY: as above; this loads libcuda (only reached when the agent was asked to work).
        handle =
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    }
    if handle.is_null() {
        return Err(LoadError::Dlopen {
            library: "libcuda.so.1".to_owned(),
            why: dlerror_text(),
        });
    }
    // The handle is kept for the life of the process: the table points into libcuda.
    Driver::resolve(handle, dlsym)
}

fn dlerror_text() -> String {
    // SAFETY: dlerror returns null or a valid C string owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: e is a valid NUL-terminated string (checked non-null).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl Driver {
    /// `CUDA_ERROR_OUT_OF_MEMORY` and the like, or `CUDA error <n>` when the driver has no name.
    pub fn error_name(&self, code: CuRes) -> String {
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string or fails.
        let rc = unsafe { (self.get_error_name)(code, &mut s) };
        if rc == CUDA_SUCCESS && !s.is_null() {
            // SAFETY: the driver returned a static NUL-terminated string.
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        } else {
            format!("CUDA error {code}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hooks::Hooked;

    /// A stand-in `dlsym` that "finds" every symbol at the address of its own name: a pointer
    /// read back as a C string says which name a table entry was resolved by.
    unsafe extern "C" fn name_as_address(_: *mut c_void, symbol: *const c_char) -> *mut c_void {
        symbol.cast_mut().cast()
    }

    /// As [`name_as_address`], but the given driver lacks `cuMulticastBindMem`.
    unsafe extern "C" fn without_multicast(h: *mut c_void, symbol: *const c_char) -> *mut c_void {
        // SAFETY: symbol is the table's NUL-terminated name.
        if unsafe { CStr::from_ptr(symbol) } == c"cuMulticastBindMem" {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract.
        unsafe { name_as_address(h, symbol) }
    }

    unsafe extern "C" fn finds_nothing(_: *mut c_void, _: *const c_char) -> *mut c_void {
        std::ptr::null_mut()
    }

    /// The name a resolved entry point was looked up by (see [`name_as_address`]).
    fn looked_up_as(p: *mut c_void) -> String {
        assert!(!p.is_null());
        // SAFETY: with name_as_address, every resolved pointer is a table name (never called).
        unsafe { CStr::from_ptr(p.cast()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn each_hook_hands_out_the_real_function_of_its_libcuda_symbol() {
        let drv = Driver::resolve(std::ptr::null_mut(), name_as_address).unwrap();
        for (h, symbol) in [
            (Hooked::MemAlloc, "cuMemAlloc_v2"),
            (Hooked::MemFree, "cuMemFree_v2"),
            (Hooked::MemAllocPitch, "cuMemAllocPitch_v2"),
            (Hooked::MemCreate, "cuMemCreate"),
            (Hooked::MemMap, "cuMemMap"),
            (Hooked::MemUnmap, "cuMemUnmap"),
            (Hooked::MemRelease, "cuMemRelease"),
            (
                Hooked::MemRetainAllocationHandle,
                "cuMemRetainAllocationHandle",
            ),
            (
                Hooked::MemGetAllocationPropertiesFromHandle,
                "cuMemGetAllocationPropertiesFromHandle",
            ),
            (Hooked::MulticastBindMem, "cuMulticastBindMem"),
            (Hooked::GetProcAddress, "cuGetProcAddress"),
            (Hooked::GetProcAddressV2, "cuGetProcAddress_v2"),
            (Hooked::MemAllocManaged, "cuMemAllocManaged"),
            (Hooked::IpcGetMemHandle, "cuIpcGetMemHandle"),
            (Hooked::IpcOpenMemHandle, "cuIpcOpenMemHandle_v2"),
            (Hooked::IpcCloseMemHandle, "cuIpcCloseMemHandle"),
            (Hooked::CtxEnablePeerAccess, "cuCtxEnablePeerAccess"),
            (
                Hooked::MemExportToShareableHandle,
                "cuMemExportToShareableHandle",
            ),
            (
                Hooked::MemImportFromShareableHandle,
                "cuMemImportFromShareableHandle",
            ),
            (Hooked::IpcOpenEventHandle, "cuIpcOpenEventHandle"),
            (Hooked::EventDestroy, "cuEventDestroy_v2"),
            (Hooked::EventDestroyV1, "cuEventDestroy"),
        ] {
            assert_eq!(looked_up_as(h.real_addr(&drv)), symbol, "{h:?}");
            assert_eq!(Hooked::from_symbol(symbol.as_bytes()), Some(h));
        }
        // Calls the agent makes itself, looked up by their exported (versioned) names.
        assert_eq!(looked_up_as(drv.init as *mut c_void), "cuInit");
        assert_eq!(
            looked_up_as(drv.mem_host_register as *mut c_void),
            "cuMemHostRegister_v2"
        );
        assert_eq!(
            looked_up_as(drv.memcpy_dtoh_async as *mut c_void),
            "cuMemcpyDtoHAsync_v2"
        );
        // The agent's own events are destroyed through the hooked entry: libcuda's function,
        // not our export.
        assert_eq!(
            looked_up_as(drv.event_destroy as *mut c_void),
            "cuEventDestroy_v2"
        );
        assert_ne!(
            drv.event_destroy as *mut c_void,
            Hooked::EventDestroy.hook_addr()
        );
    }

    #[test]
    fn a_missing_optional_entry_point_is_null_a_missing_required_one_an_error() {
        let drv = Driver::resolve(std::ptr::null_mut(), without_multicast).unwrap();
        assert!(drv.multicast_bind_mem.is_none());
        assert!(Hooked::MulticastBindMem.real_addr(&drv).is_null());
        assert_eq!(looked_up_as(Hooked::MemMap.real_addr(&drv)), "cuMemMap");
        let err = Driver::resolve(std::ptr::null_mut(), finds_nothing)
            .err()
            .expect("a driver without cuInit");
        assert_eq!(err.to_string(), "cuInit not found in libcuda.so.1");
    }
}
