//! The HIP runtime, loaded at run time with `libloading`: only the entry points an in-process
//! agent would use to copy device memory and rebuild VMM mappings.
//!
//! Nothing is linked at build time (the `hip-sys` crates need a ROCm install to build), and a
//! missing library or symbol is an `Err`, never a panic. The CRIU process itself does not need
//! HIP: AMD's checkpointing goes through KFD ioctls and DRM. This table is for code that runs
//! inside the target process.
//!
//! Never run against a real HIP runtime: the build machine has none. The signatures follow
//! `hip_runtime_api.h` (ROCm 5.x to 7.x, where these calls are stable). `hipMemAllocationProp`
//! changed between HIP versions, so [`Hip::mem_create`] takes it as an untyped pointer.

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};

use libloading::Library;

/// Library names tried by [`Hip::load`], in order.
pub const LIBRARY_CANDIDATES: &[&str] = &[
    "libamdhip64.so",
    "libamdhip64.so.7",
    "libamdhip64.so.6",
    "libamdhip64.so.5",
];

/// `hipError_t`; 0 is `hipSuccess`.
pub type HipErrorCode = c_int;
/// `hipStream_t`.
pub type RawStream = *mut c_void;
/// `hipDeviceptr_t`.
pub type DevicePtr = *mut c_void;
/// `hipMemGenericAllocationHandle_t`.
pub type MemHandle = *mut c_void;
/// `hipDevice_t`.
pub type Device = c_int;

#[derive(Debug, thiserror::Error)]
pub enum HipError {
    /// None of the candidate libraries could be loaded.
    #[error("no HIP runtime found (tried {tried}): {errors}")]
    NotFound { tried: String, errors: String },

    /// The library lacks an entry point: it is not HIP, or too old for this call.
    #[error("{library} has no symbol {symbol}")]
    MissingSymbol {
        library: &'static str,
        symbol: &'static str,
    },

    /// A HIP call returned an error.
    #[error("{function} failed: HIP error {code}{}", .name.as_deref().map(|n| format!(" ({n})")).unwrap_or_default())]
    Call {
        function: &'static str,
        code: HipErrorCode,
        name: Option<String>,
    },
}

/// Declares the table of entry points: a field per function, its C name, and its type.
macro_rules! hip_api {
    ($($field:ident: $name:literal => fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The resolved entry points; `None` where the library lacks one.
        struct Api {
            $($field: Option<unsafe extern "C" fn($($arg),*) $(-> $ret)?>,)*
        }

        impl Api {
            fn resolve(lib: &Library) -> Api {
                Api {
                    $($field: {
                        // SAFETY: the symbol, if present, is the HIP function of that name,
                        // whose C signature is the declared type (hip_runtime_api.h). The
                        // copied pointer is only called while `lib` is loaded: `Hip` owns both.
                        unsafe { lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>($name) }
                            .ok()
                            .map(|sym| *sym)
                    },)*
                }
            }
        }
    };
}

hip_api! {
    init: "hipInit" => fn(c_uint) -> HipErrorCode;
    get_device_count: "hipGetDeviceCount" => fn(*mut c_int) -> HipErrorCode;
    driver_get_version: "hipDriverGetVersion" => fn(*mut c_int) -> HipErrorCode;
    device_get: "hipDeviceGet" => fn(*mut Device, c_int) -> HipErrorCode;
    stream_create: "hipStreamCreate" => fn(*mut RawStream) -> HipErrorCode;
    stream_synchronize: "hipStreamSynchronize" => fn(RawStream) -> HipErrorCode;
    stream_destroy: "hipStreamDestroy" => fn(RawStream) -> HipErrorCode;
    memcpy_dtoh_async: "hipMemcpyDtoHAsync"
        => fn(*mut c_void, DevicePtr, usize, RawStream) -> HipErrorCode;
    memcpy_htod_async: "hipMemcpyHtoDAsync"
        => fn(DevicePtr, *mut c_void, usize, RawStream) -> HipErrorCode;
    host_register: "hipHostRegister" => fn(*mut c_void, usize, c_uint) -> HipErrorCode;
    host_unregister: "hipHostUnregister" => fn(*mut c_void) -> HipErrorCode;
    mem_create: "hipMemCreate"
        => fn(*mut MemHandle, usize, *const c_void, c_ulonglong) -> HipErrorCode;
    mem_map: "hipMemMap"
        => fn(*mut c_void, usize, usize, MemHandle, c_ulonglong) -> HipErrorCode;
    mem_unmap: "hipMemUnmap" => fn(*mut c_void, usize) -> HipErrorCode;
    mem_release: "hipMemRelease" => fn(MemHandle) -> HipErrorCode;
    mem_address_reserve: "hipMemAddressReserve"
        => fn(*mut *mut c_void, usize, usize, *mut c_void, c_ulonglong) -> HipErrorCode;
    get_error_name: "hipGetErrorName" => fn(HipErrorCode) -> *const c_char;
}

/// Entry points without which a library is not taken for a HIP runtime.
const REQUIRED: &[&str] = &["hipInit", "hipGetDeviceCount", "hipDriverGetVersion"];

/// A loaded HIP runtime.
pub struct Hip {
    api: Api,
    library: &'static str,
    // Keeps the code behind `api` mapped; dropped last.
    _lib: Library,
}

impl std::fmt::Debug for Hip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hip")
            .field("library", &self.library)
            .finish()
    }
}

impl Hip {
    /// Loads the first of [`LIBRARY_CANDIDATES`] that exists and has the core HIP entry points.
    pub fn load() -> Result<Hip, HipError> {
        Hip::load_from(LIBRARY_CANDIDATES)
    }

    /// Like [`Hip::load`], with other library names. A library that loads but lacks a core
    /// entry point is an error at once (it is not HIP), rather than a reason to try the next.
    pub fn load_from(candidates: &[&'static str]) -> Result<Hip, HipError> {
        let mut errors = Vec::new();
        for &name in candidates {
            match Hip::open(name) {
                Ok(hip) => {
                    hip.check_required()?;
                    return Ok(hip);
                }
                Err(e) => errors.push(e.to_string()),
            }
        }
        Err(HipError::NotFound {
            tried: candidates.join(", "),
            errors: errors.join("; "),
        })
    }

    fn open(name: &'static str) -> Result<Hip, libloading::Error> {
        // SAFETY: loading a shared library runs its initialisers. The names are HIP runtime
        // libraries (or, in tests, libc), whose initialisers are meant to run in any process.
        let lib = unsafe { Library::new(name) }?;
        Ok(Hip {
            api: Api::resolve(&lib),
            library: name,
            _lib: lib,
        })
    }

    fn check_required(&self) -> Result<(), HipError> {
        let present = [
            self.api.init.is_some(),
            self.api.get_device_count.is_some(),
            self.api.driver_get_version.is_some(),
        ];
        match REQUIRED.iter().zip(present).find(|(_, ok)| !ok) {
            Some((symbol, _)) => Err(self.missing(symbol)),
            None => Ok(()),
        }
    }

    /// The library name that was loaded.
    pub fn library(&self) -> &'static str {
        self.library
    }

    fn missing(&self, symbol: &'static str) -> HipError {
        HipError::MissingSymbol {
            library: self.library,
            symbol,
        }
    }

    /// `Ok` for `hipSuccess`, else a [`HipError::Call`] with the error's name where HIP has one.
    fn check(&self, function: &'static str, code: HipErrorCode) -> Result<(), HipError> {
        if code == 0 {
            return Ok(());
        }
        let name = self.api.get_error_name.and_then(|f| {
            // SAFETY: hipGetErrorName takes any error code and returns null or a pointer to a
            // static NUL-terminated string.
            let p = unsafe { f(code) };
            // SAFETY: `p` is non-null here and points to a static C string (see above).
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        });
        Err(HipError::Call {
            function,
            code,
            name,
        })
    }

    /// `hipInit(0)`.
    pub fn init(&self) -> Result<(), HipError> {
        let f = self.api.init.ok_or_else(|| self.missing("hipInit"))?;
        // SAFETY: hipInit takes a flags word that must be 0 and touches no caller memory.
        self.check("hipInit", unsafe { f(0) })
    }

    /// `hipGetDeviceCount`.
    pub fn device_count(&self) -> Result<u32, HipError> {
        let f = self
            .api
            .get_device_count
            .ok_or_else(|| self.missing("hipGetDeviceCount"))?;
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid, writable int for the duration of the call.
        self.check("hipGetDeviceCount", unsafe { f(&mut n) })?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    /// `hipDriverGetVersion`.
    pub fn driver_version(&self) -> Result<i32, HipError> {
        let f = self
            .api
            .driver_get_version
            .ok_or_else(|| self.missing("hipDriverGetVersion"))?;
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid, writable int for the duration of the call.
        self.check("hipDriverGetVersion", unsafe { f(&mut v) })?;
        Ok(v)
    }

    /// `hipDeviceGet`.
    pub fn device_get(&self, ordinal: i32) -> Result<Device, HipError> {
        let f = self
            .api
            .device_get
            .ok_or_else(|| self.missing("hipDeviceGet"))?;
        let mut d: Device = 0;
        // SAFETY: `d` is a valid, writable int; an invalid ordinal is an error code, not UB.
        self.check("hipDeviceGet", unsafe { f(&mut d, ordinal) })?;
        Ok(d)
    }

    /// `hipStreamCreate`, as an owned stream destroyed on drop.
    pub fn stream_create(&self) -> Result<Stream<'_>, HipError> {
        let f = self
            .api
            .stream_create
            .ok_or_else(|| self.missing("hipStreamCreate"))?;
        let mut raw: RawStream = std::ptr::null_mut();
        // SAFETY: `raw` is a valid, writable stream handle slot.
        self.check("hipStreamCreate", unsafe { f(&mut raw) })?;
        Ok(Stream { hip: self, raw })
    }

    /// `hipMemcpyDtoHAsync` on `stream`.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for `bytes` writes until the stream is synchronised, and `src` must be
    /// a device allocation of at least `bytes` in the current context.
    pub unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut c_void,
        src: DevicePtr,
        bytes: usize,
        stream: &Stream<'_>,
    ) -> Result<(), HipError> {
        let f = self
            .api
            .memcpy_dtoh_async
            .ok_or_else(|| self.missing("hipMemcpyDtoHAsync"))?;
        // SAFETY: the caller guarantees both ranges; `stream` is a live stream of this runtime.
        self.check("hipMemcpyDtoHAsync", unsafe {
            f(dst, src, bytes, stream.raw)
        })
    }

    /// `hipMemcpyHtoDAsync` on `stream`.
    ///
    /// # Safety
    ///
    /// `src` must be valid for `bytes` reads and unchanged until the stream is synchronised, and
    /// `dst` must be a device allocation of at least `bytes` in the current context.
    pub unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const c_void,
        bytes: usize,
        stream: &Stream<'_>,
    ) -> Result<(), HipError> {
        let f = self
            .api
            .memcpy_htod_async
            .ok_or_else(|| self.missing("hipMemcpyHtoDAsync"))?;
        // SAFETY: the caller guarantees both ranges; HIP declares `src` non-const but only reads
        // it; `stream` is a live stream of this runtime.
        self.check("hipMemcpyHtoDAsync", unsafe {
            f(dst, src.cast_mut(), bytes, stream.raw)
        })
    }

    /// `hipHostRegister`: pins host memory for DMA.
    ///
    /// # Safety
    ///
    /// `ptr..ptr+bytes` must be mapped host memory that stays mapped until
    /// [`Hip::host_unregister`].
    pub unsafe fn host_register(
        &self,
        ptr: *mut c_void,
        bytes: usize,
        flags: u32,
    ) -> Result<(), HipError> {
        let f = self
            .api
            .host_register
            .ok_or_else(|| self.missing("hipHostRegister"))?;
        // SAFETY: the caller guarantees the range is mapped for as long as it is registered.
        self.check("hipHostRegister", unsafe { f(ptr, bytes, flags) })
    }

    /// `hipHostUnregister`.
    ///
    /// # Safety
    ///
    /// `ptr` must have been registered with [`Hip::host_register`] and no copy using it may be
    /// in flight.
    pub unsafe fn host_unregister(&self, ptr: *mut c_void) -> Result<(), HipError> {
        let f = self
            .api
            .host_unregister
            .ok_or_else(|| self.missing("hipHostUnregister"))?;
        // SAFETY: the caller guarantees `ptr` is registered and idle.
        self.check("hipHostUnregister", unsafe { f(ptr) })
    }

    /// `hipMemCreate`: a physical allocation.
    ///
    /// # Safety
    ///
    /// `prop` must point to a `hipMemAllocationProp` laid out as the loaded HIP version expects.
    pub unsafe fn mem_create(
        &self,
        bytes: usize,
        prop: *const c_void,
        flags: u64,
    ) -> Result<MemHandle, HipError> {
        let f = self
            .api
            .mem_create
            .ok_or_else(|| self.missing("hipMemCreate"))?;
        let mut handle: MemHandle = std::ptr::null_mut();
        // SAFETY: `handle` is a writable slot; the caller guarantees `prop`.
        self.check("hipMemCreate", unsafe {
            f(&mut handle, bytes, prop, flags)
        })?;
        Ok(handle)
    }

    /// `hipMemAddressReserve`: reserves a device virtual address range.
    ///
    /// # Safety
    ///
    /// `addr` is only a hint; the returned range must be freed by the caller (HIP's
    /// `hipMemAddressFree`, not in this table yet).
    pub unsafe fn mem_address_reserve(
        &self,
        bytes: usize,
        alignment: usize,
        addr: *mut c_void,
        flags: u64,
    ) -> Result<*mut c_void, HipError> {
        let f = self
            .api
            .mem_address_reserve
            .ok_or_else(|| self.missing("hipMemAddressReserve"))?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a writable slot; `addr` is a hint the driver may ignore.
        self.check("hipMemAddressReserve", unsafe {
            f(&mut ptr, bytes, alignment, addr, flags)
        })?;
        Ok(ptr)
    }

    /// `hipMemMap`: maps `handle` at `ptr`.
    ///
    /// # Safety
    ///
    /// `ptr..ptr+bytes` must lie in a range reserved with [`Hip::mem_address_reserve`] and not
    /// be mapped; `handle` must be a live allocation of at least `offset + bytes`.
    pub unsafe fn mem_map(
        &self,
        ptr: *mut c_void,
        bytes: usize,
        offset: usize,
        handle: MemHandle,
        flags: u64,
    ) -> Result<(), HipError> {
        let f = self.api.mem_map.ok_or_else(|| self.missing("hipMemMap"))?;
        // SAFETY: the caller guarantees the range and the handle.
        self.check("hipMemMap", unsafe { f(ptr, bytes, offset, handle, flags) })
    }

    /// `hipMemUnmap`.
    ///
    /// # Safety
    ///
    /// `ptr..ptr+bytes` must be mapped with [`Hip::mem_map`], and nothing may use it any more.
    pub unsafe fn mem_unmap(&self, ptr: *mut c_void, bytes: usize) -> Result<(), HipError> {
        let f = self
            .api
            .mem_unmap
            .ok_or_else(|| self.missing("hipMemUnmap"))?;
        // SAFETY: the caller guarantees the range is mapped and unused.
        self.check("hipMemUnmap", unsafe { f(ptr, bytes) })
    }

    /// `hipMemRelease`.
    ///
    /// # Safety
    ///
    /// `handle` must come from [`Hip::mem_create`] and not have been released.
    pub unsafe fn mem_release(&self, handle: MemHandle) -> Result<(), HipError> {
        let f = self
            .api
            .mem_release
            .ok_or_else(|| self.missing("hipMemRelease"))?;
        // SAFETY: the caller guarantees `handle` is live and released once.
        self.check("hipMemRelease", unsafe { f(handle) })
    }
}

/// A HIP stream, destroyed on drop.
#[derive(Debug)]
pub struct Stream<'a> {
    hip: &'a Hip,
    raw: RawStream,
}

impl Stream<'_> {
    /// `hipStreamSynchronize`: waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), HipError> {
        let f = self
            .hip
            .api
            .stream_synchronize
            .ok_or_else(|| self.hip.missing("hipStreamSynchronize"))?;
        // SAFETY: `self.raw` is a live stream created by this runtime.
        self.hip
            .check("hipStreamSynchronize", unsafe { f(self.raw) })
    }

    pub fn as_raw(&self) -> RawStream {
        self.raw
    }
}

impl Drop for Stream<'_> {
    fn drop(&mut self) {
        let Some(f) = self.hip.api.stream_destroy else {
            return;
        };
        // SAFETY: `self.raw` is a live stream of this runtime, destroyed exactly once here.
        let code = unsafe { f(self.raw) };
        if let Err(e) = self.hip.check("hipStreamDestroy", code) {
            log::warn!("gpusnap-rocm: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_fails_cleanly_without_rocm() {
        match Hip::load() {
            Err(HipError::NotFound { tried, errors }) => {
                for name in LIBRARY_CANDIDATES {
                    assert!(tried.contains(name), "{tried}");
                }
                assert!(!errors.is_empty());
            }
            Err(e) => panic!("unexpected error: {e}"),
            Ok(hip) => eprintln!("a HIP runtime is installed here: {}", hip.library()),
        }
    }

    #[test]
    fn a_library_without_hip_is_rejected() {
        let err = Hip::load_from(&["libc.so.6"]).unwrap_err();
        assert!(
            matches!(
                err,
                HipError::MissingSymbol {
                    library: "libc.so.6",
                    symbol: "hipInit"
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn every_call_reports_a_missing_symbol() {
        // libc loads, and has none of the HIP entry points.
        let hip = Hip::open("libc.so.6").unwrap();
        let missing = |r: Result<(), HipError>, sym: &str| match r {
            Err(HipError::MissingSymbol { symbol, .. }) => assert_eq!(symbol, sym),
            other => panic!("{sym}: {other:?}"),
        };
        missing(hip.init(), "hipInit");
        missing(hip.device_count().map(drop), "hipGetDeviceCount");
        missing(hip.driver_version().map(drop), "hipDriverGetVersion");
        missing(hip.device_get(0).map(drop), "hipDeviceGet");
        missing(hip.stream_create().map(drop), "hipStreamCreate");
        let null = std::ptr::null_mut();
        // SAFETY: each call fails on the missing symbol before any pointer is used.
        unsafe {
            missing(hip.host_register(null, 0, 0), "hipHostRegister");
            missing(hip.host_unregister(null), "hipHostUnregister");
            missing(
                hip.mem_create(0, std::ptr::null(), 0).map(drop),
                "hipMemCreate",
            );
            missing(
                hip.mem_address_reserve(0, 0, null, 0).map(drop),
                "hipMemAddressReserve",
            );
            missing(hip.mem_map(null, 0, 0, null, 0), "hipMemMap");
            missing(hip.mem_unmap(null, 0), "hipMemUnmap");
            missing(hip.mem_release(null), "hipMemRelease");
        }
    }

    #[test]
    fn call_error_message() {
        let e = HipError::Call {
            function: "hipInit",
            code: 100,
            name: Some("hipErrorNoDevice".into()),
        };
        assert_eq!(
            e.to_string(),
            "hipInit failed: HIP error 100 (hipErrorNoDevice)"
        );
    }
}
