//! The driver checkpoint API, loaded from `libcuda.so.1` at run time.
//!
//! cudarc has the argument types but deliberately not the six `cuCheckpointProcess*` functions,
//! so they are resolved here with libloading. Three layers, as in cudarc: raw fn pointers
//! ([`CheckpointApi`] fields), one thin method per call that turns `CUresult` into `Result`,
//! and the callers in the plugin that read like the protocol.

use cudarc::driver::sys::{
    CUcheckpointCheckpointArgs, CUcheckpointGpuPair, CUcheckpointLockArgs, CUcheckpointRestoreArgs,
    CUcheckpointUnlockArgs, CUdevice, CUprocessState, CUresult, CUuuid,
};
use std::ffi::{CStr, c_char, c_int, c_uint};
use std::sync::OnceLock;

/// Where the driver is looked up. Only the soname: a toolkit is not needed.
pub const LIBCUDA: &str = "libcuda.so.1";
/// Environment variable naming another driver library (a driver installed outside the loader's
/// path, or the stand-in driver of the CI tests). Whoever sets CRIU's environment can already
/// preload code into it, so this opens nothing new.
pub const LIBCUDA_ENV: &str = "GPUSNAP_LIBCUDA";

/// The driver library to load: `$GPUSNAP_LIBCUDA`, else `libcuda.so.1`.
pub fn libcuda_path() -> String {
    std::env::var(LIBCUDA_ENV)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| LIBCUDA.to_owned())
}

/// State of a process as the driver sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessState {
    Running,
    Locked,
    Checkpointed,
    Failed,
    Other(u32),
}

impl ProcessState {
    fn from_raw(s: CUprocessState) -> Self {
        match s as u32 {
            0 => Self::Running,
            1 => Self::Locked,
            2 => Self::Checkpointed,
            3 => Self::Failed,
            x => Self::Other(x),
        }
    }
}

impl std::fmt::Display for ProcessState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Running => f.write_str("running"),
            Self::Locked => f.write_str("locked"),
            Self::Checkpointed => f.write_str("checkpointed"),
            Self::Failed => f.write_str("failed"),
            Self::Other(x) => write!(f, "state {x}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error(
        "the NVIDIA driver library cannot be loaded ({0}); install the NVIDIA driver (r570 or newer)"
    )]
    NoLibrary(String),
    #[error(
        "the NVIDIA driver has no checkpoint API ({0} missing); gpusnap needs driver r570 or newer (r580 tested)"
    )]
    NoCheckpointApi(&'static str),
    #[error("{call} failed: {name} ({code})")]
    Cuda {
        call: &'static str,
        code: u32,
        name: String,
    },
}

impl DriverError {
    /// The raw CUresult, when the driver returned one.
    pub fn code(&self) -> Option<u32> {
        match self {
            Self::Cuda { code, .. } => Some(*code),
            _ => None,
        }
    }
}

type CkptFn<A> = unsafe extern "C" fn(c_int, *mut A) -> CUresult;

/// Raw entry points of libcuda that gpusnap calls from inside CRIU.
pub struct CheckpointApi {
    _lib: libloading::Library,
    init: unsafe extern "C" fn(c_uint) -> CUresult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CUresult,
    get_error_name: unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CUresult,
    device_get: unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult,
    device_get_uuid: unsafe extern "C" fn(*mut CUuuid, CUdevice) -> CUresult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CUresult,
    device_total_mem: unsafe extern "C" fn(*mut usize, CUdevice) -> CUresult,
    lock: CkptFn<CUcheckpointLockArgs>,
    checkpoint: CkptFn<CUcheckpointCheckpointArgs>,
    restore: CkptFn<CUcheckpointRestoreArgs>,
    unlock: CkptFn<CUcheckpointUnlockArgs>,
    get_state: unsafe extern "C" fn(c_int, *mut CUprocessState) -> CUresult,
    get_restore_tid: unsafe extern "C" fn(c_int, *mut c_int) -> CUresult,
}

/// A GPU as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    pub ordinal: u32,
    /// 16 bytes as 32 lowercase hex digits.
    pub uuid: String,
    pub name: String,
    pub total_mem: u64,
}

/// Loads the driver once per process. `Err` (never a panic) when it is absent or too old.
pub fn api() -> Result<&'static CheckpointApi, DriverError> {
    static API: OnceLock<Result<CheckpointApi, DriverError>> = OnceLock::new();
    match API.get_or_init(CheckpointApi::load) {
        Ok(api) => Ok(api),
        Err(DriverError::NoLibrary(s)) => Err(DriverError::NoLibrary(s.clone())),
        Err(DriverError::NoCheckpointApi(s)) => Err(DriverError::NoCheckpointApi(s)),
        Err(DriverError::Cuda { call, code, name }) => Err(DriverError::Cuda {
            call,
            code: *code,
            name: name.clone(),
        }),
    }
}

macro_rules! symbol {
    ($lib:expr, $name:literal, $missing:expr) => {{
        // SAFETY: the symbol is looked up by its exact C name and stored with the signature that
        // the CUDA driver API (cuda.h, CUDA 13.0) declares for it.
        match unsafe { $lib.get(concat!($name, "\0").as_bytes()) } {
            Ok(s) => *s,
            Err(_) => return Err($missing($name)),
        }
    }};
}

impl CheckpointApi {
    fn load() -> Result<Self, DriverError> {
        // SAFETY: loading libcuda runs its initialisers; it is the vendor's driver library and is
        // designed to be loaded into arbitrary processes.
        let lib = unsafe { libloading::Library::new(libcuda_path()) }
            .map_err(|e| DriverError::NoLibrary(e.to_string()))?;
        let basic = |n: &'static str| DriverError::NoLibrary(format!("symbol {n} missing"));
        let ckpt = DriverError::NoCheckpointApi;
        Ok(Self {
            init: symbol!(lib, "cuInit", basic),
            driver_get_version: symbol!(lib, "cuDriverGetVersion", basic),
            get_error_name: symbol!(lib, "cuGetErrorName", basic),
            device_get_count: symbol!(lib, "cuDeviceGetCount", basic),
            device_get: symbol!(lib, "cuDeviceGet", basic),
            device_get_uuid: symbol!(lib, "cuDeviceGetUuid_v2", basic),
            device_get_name: symbol!(lib, "cuDeviceGetName", basic),
            device_total_mem: symbol!(lib, "cuDeviceTotalMem_v2", basic),
            lock: symbol!(lib, "cuCheckpointProcessLock", ckpt),
            checkpoint: symbol!(lib, "cuCheckpointProcessCheckpoint", ckpt),
            restore: symbol!(lib, "cuCheckpointProcessRestore", ckpt),
            unlock: symbol!(lib, "cuCheckpointProcessUnlock", ckpt),
            get_state: symbol!(lib, "cuCheckpointProcessGetState", ckpt),
            get_restore_tid: symbol!(lib, "cuCheckpointProcessGetRestoreThreadId", ckpt),
            _lib: lib,
        })
    }

    fn check(&self, call: &'static str, r: CUresult) -> Result<(), DriverError> {
        if r as u32 == 0 {
            return Ok(());
        }
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string (or leaves it untouched on
        // an unknown code); `p` is a valid out-pointer.
        let name = if unsafe { (self.get_error_name)(r, &mut p) } as u32 == 0 && !p.is_null() {
            // SAFETY: the driver returned a NUL-terminated static string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        } else {
            "unknown CUDA error".to_string()
        };
        Err(DriverError::Cuda {
            call,
            code: r as u32,
            name,
        })
    }

    /// `cuInit(0)`. The driver requires it in the caller before a restore.
    pub fn init(&self) -> Result<(), DriverError> {
        // SAFETY: plain call with a flags value of 0 as documented.
        self.check("cuInit", unsafe { (self.init)(0) })
    }

    /// Driver API version, e.g. 13000 for the r580 branch.
    pub fn driver_version(&self) -> Result<i32, DriverError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer.
        self.check("cuDriverGetVersion", unsafe {
            (self.driver_get_version)(&mut v)
        })?;
        Ok(v)
    }

    /// The tid of the driver's checkpoint helper thread inside `pid`. An error here means, in
    /// practice, that `pid` has no CUDA state.
    pub fn restore_thread_id(&self, pid: i32) -> Result<i32, DriverError> {
        let mut tid: c_int = 0;
        // SAFETY: `tid` is a valid out-pointer; the driver only reads `pid`.
        self.check("cuCheckpointProcessGetRestoreThreadId", unsafe {
            (self.get_restore_tid)(pid, &mut tid)
        })?;
        Ok(tid)
    }

    pub fn process_state(&self, pid: i32) -> Result<ProcessState, DriverError> {
        // SAFETY: CUprocessState is a C enum; zero (RUNNING) is a valid value to start from.
        let mut s: CUprocessState = unsafe { std::mem::zeroed() };
        // SAFETY: `s` is a valid out-pointer.
        self.check("cuCheckpointProcessGetState", unsafe {
            (self.get_state)(pid, &mut s)
        })?;
        Ok(ProcessState::from_raw(s))
    }

    /// RUNNING -> LOCKED. `timeout_ms == 0` waits forever; on timeout the process stays running.
    pub fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), DriverError> {
        // SAFETY: the argument structs are plain C data; all-zero is their documented default.
        let mut a: CUcheckpointLockArgs = unsafe { std::mem::zeroed() };
        a.timeoutMs = timeout_ms;
        // SAFETY: `a` is a valid, zero-initialised argument struct.
        self.check("cuCheckpointProcessLock", unsafe {
            (self.lock)(pid, &mut a)
        })
    }

    /// LOCKED -> CHECKPOINTED: device memory still mapped goes to host memory of the target.
    pub fn checkpoint(&self, pid: i32) -> Result<(), DriverError> {
        // SAFETY: zeroed C argument struct, as documented.
        let mut a: CUcheckpointCheckpointArgs = unsafe { std::mem::zeroed() };
        // SAFETY: `a` is a valid argument struct.
        self.check("cuCheckpointProcessCheckpoint", unsafe {
            (self.checkpoint)(pid, &mut a)
        })
    }

    /// CHECKPOINTED -> LOCKED, optionally onto other GPUs (`pairs` must then list every
    /// checkpointed GPU).
    pub fn restore(&self, pid: i32, pairs: &[([u8; 16], [u8; 16])]) -> Result<(), DriverError> {
        let mut raw: Vec<CUcheckpointGpuPair> = pairs
            .iter()
            .map(|(old, new)| CUcheckpointGpuPair {
                oldUuid: uuid_from_bytes(old),
                newUuid: uuid_from_bytes(new),
            })
            .collect();
        // SAFETY: zeroed C argument struct, as documented.
        let mut a: CUcheckpointRestoreArgs = unsafe { std::mem::zeroed() };
        if !raw.is_empty() {
            a.gpuPairs = raw.as_mut_ptr();
            a.gpuPairsCount = raw.len() as c_uint;
        }
        // SAFETY: `a` is valid; `gpuPairs` points to `raw`, which outlives the call.
        self.check("cuCheckpointProcessRestore", unsafe {
            (self.restore)(pid, &mut a)
        })
    }

    /// LOCKED -> RUNNING.
    pub fn unlock(&self, pid: i32) -> Result<(), DriverError> {
        // SAFETY: zeroed C argument struct, as documented.
        let mut a: CUcheckpointUnlockArgs = unsafe { std::mem::zeroed() };
        // SAFETY: `a` is a valid argument struct.
        self.check("cuCheckpointProcessUnlock", unsafe {
            (self.unlock)(pid, &mut a)
        })
    }

    /// The GPUs visible to this process (needs [`Self::init`] first).
    pub fn gpus(&self) -> Result<Vec<GpuInfo>, DriverError> {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        self.check("cuDeviceGetCount", unsafe {
            (self.device_get_count)(&mut n)
        })?;
        let mut out = Vec::new();
        for ordinal in 0..n.max(0) {
            let mut dev: CUdevice = 0;
            // SAFETY: valid out-pointer, ordinal < count.
            self.check("cuDeviceGet", unsafe {
                (self.device_get)(&mut dev, ordinal)
            })?;
            // SAFETY: CUuuid is 16 plain bytes.
            let mut uuid: CUuuid = unsafe { std::mem::zeroed() };
            // SAFETY: valid out-pointer and device handle.
            self.check("cuDeviceGetUuid_v2", unsafe {
                (self.device_get_uuid)(&mut uuid, dev)
            })?;
            let mut name = [0 as c_char; 256];
            // SAFETY: the buffer is 256 bytes and its length is passed.
            self.check("cuDeviceGetName", unsafe {
                (self.device_get_name)(name.as_mut_ptr(), name.len() as c_int, dev)
            })?;
            let mut total: usize = 0;
            // SAFETY: valid out-pointer and device handle.
            self.check("cuDeviceTotalMem_v2", unsafe {
                (self.device_total_mem)(&mut total, dev)
            })?;
            out.push(GpuInfo {
                ordinal: ordinal as u32,
                uuid: uuid_hex(&uuid_bytes(&uuid)),
                // SAFETY: the driver NUL-terminates within the buffer; the last byte is still 0
                // from initialisation in any case.
                name: unsafe { CStr::from_ptr(name.as_ptr()) }
                    .to_string_lossy()
                    .into_owned(),
                total_mem: total as u64,
            });
        }
        Ok(out)
    }
}

fn uuid_bytes(u: &CUuuid) -> [u8; 16] {
    let mut b = [0u8; 16];
    for (d, s) in b.iter_mut().zip(u.bytes.iter()) {
        *d = *s as u8;
    }
    b
}

fn uuid_from_bytes(b: &[u8; 16]) -> CUuuid {
    // SAFETY: CUuuid is 16 plain bytes.
    let mut u: CUuuid = unsafe { std::mem::zeroed() };
    for (d, s) in u.bytes.iter_mut().zip(b.iter()) {
        *d = *s as c_char;
    }
    u
}

/// 32 lowercase hex digits.
pub fn uuid_hex(b: &[u8; 16]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Parses 32 hex digits (dashes and a `GPU-` prefix allowed).
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let s = s.strip_prefix("GPU-").unwrap_or(s);
    let hex: Vec<u8> = s.bytes().filter(|c| *c != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn checkpoint_arg_layouts_match_cuda_13() {
        assert_eq!(size_of::<CUcheckpointLockArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointCheckpointArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointRestoreArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointUnlockArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointGpuPair>(), 32);
        assert_eq!(offset_of!(CUcheckpointLockArgs, timeoutMs), 0);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, gpuPairs), 0);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, gpuPairsCount), 8);
        assert_eq!(offset_of!(CUcheckpointGpuPair, newUuid), 16);
        assert_eq!(size_of::<CUuuid>(), 16);
    }

    #[test]
    fn uuid_round_trip() {
        let s = "GPU-0123abcd-4567-89ef-0123-456789abcdef";
        let b = parse_uuid(s).unwrap();
        assert_eq!(uuid_hex(&b), "0123abcd456789ef0123456789abcdef");
        assert!(parse_uuid("GPU-12").is_none());
        assert!(parse_uuid("zz23abcd456789ef0123456789abcdef").is_none());
    }

    #[test]
    fn missing_driver_is_an_error_not_a_panic() {
        // The build machine and CI have no NVIDIA driver.
        if std::path::Path::new("/proc/driver/nvidia").exists() {
            return;
        }
        match api() {
            Err(DriverError::NoLibrary(_)) => {}
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("libcuda loaded on a machine without a driver"),
        }
        let msg = api().err().unwrap().to_string();
        assert!(msg.contains("r570"), "{msg}");
    }
}
