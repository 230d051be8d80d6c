//! The driver checkpoint API, loaded from `libcuda.so.1` at run time.
//!
//! cudarc has the argument types but deliberately not the six `cuCheckpointProcess*` functions,
//! so they are resolved here with libloading. Three layers, as in cudarc: raw fn pointers
//! ([`CheckpointApi`] fields), one thin method per call that turns the status code into
//! `Result` ([`check`]), and the callers in the plugin that read like the protocol.
//!
//! Status codes and the process state cross the FFI boundary as raw `u32` ([`CuResult`],
//! [`RawProcessState`]), never as cudarc's `CUresult`/`CUprocessState`: those are Rust enums,
//! and a value they do not list (a newer driver's error code, or CUDA 13.4's CHECKPOINTING and
//! RESTORING states) would be undefined behaviour in them. The argument structs are cudarc's
//! (plain integers, pointers and bytes); their layouts are tested against cuda.h below.
//!
//! [`stack`]: the driver stack a process ran on (kernel driver version, driver library digest),
//! recorded at a dump and checked of the node at a restore's `init`.

pub mod stack;

use crate::GpuUuid;
use cudarc::driver::sys::{
    CUcheckpointCheckpointArgs, CUcheckpointGpuPair, CUcheckpointLockArgs, CUcheckpointRestoreArgs,
    CUcheckpointUnlockArgs, CUdevice, CUprocessState, CUresult, CUuuid,
};
use gpusnap_host::pid::{HostPid, HostTid};
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
    /// The state a `CUprocessState` value names (cuda.h: RUNNING 0, LOCKED 1, CHECKPOINTED 2,
    /// FAILED 3); any other value, e.g. a newer driver's, is [`Self::Other`].
    pub fn from_raw(raw: RawProcessState) -> Self {
        match raw {
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

/// A driver status code (`CUresult`) as the driver returns it; see the module doc for why not
/// cudarc's enum.
pub type CuResult = u32;
/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: CuResult = 0;
/// A `CUprocessState` as the driver writes it; [`ProcessState::from_raw`] reads it.
pub type RawProcessState = u32;

// Both C enums are passed as 32-bit integers.
const _: () = assert!(std::mem::size_of::<CUresult>() == std::mem::size_of::<CuResult>());
const _: () =
    assert!(std::mem::size_of::<CUprocessState>() == std::mem::size_of::<RawProcessState>());

/// `CUresult cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock}(int pid, Cu...Args *args)`.
type CkptFn<A> = unsafe extern "C" fn(c_int, *mut A) -> CuResult;

/// Raw entry points of libcuda that gpusnap calls from inside CRIU.
pub struct CheckpointApi {
    _lib: libloading::Library,
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CUdevice, c_int) -> CuResult,
    device_get_uuid: unsafe extern "C" fn(*mut CUuuid, CUdevice) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CuResult,
    device_total_mem: unsafe extern "C" fn(*mut usize, CUdevice) -> CuResult,
    lock: CkptFn<CUcheckpointLockArgs>,
    checkpoint: CkptFn<CUcheckpointCheckpointArgs>,
    restore: CkptFn<CUcheckpointRestoreArgs>,
    unlock: CkptFn<CUcheckpointUnlockArgs>,
    get_state: unsafe extern "C" fn(c_int, *mut RawProcessState) -> CuResult,
    get_restore_tid: unsafe extern "C" fn(c_int, *mut c_int) -> CuResult,
}

/// The result layer: `Ok` for `CUDA_SUCCESS`, else the error of `call`, named by `error_name`
/// (the driver's `cuGetErrorName`; `None` for a code it does not know).
fn check(
    code: CuResult,
    call: &'static str,
    error_name: impl FnOnce(CuResult) -> Option<String>,
) -> Result<(), DriverError> {
    if code == CUDA_SUCCESS {
        return Ok(());
    }
    Err(DriverError::Cuda {
        call,
        code,
        name: error_name(code).unwrap_or_else(|| "unknown CUDA error".to_string()),
    })
}

/// A GPU as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    pub ordinal: u32,
    /// Images record it as 32 lowercase hex digits (its `Display`).
    pub uuid: GpuUuid,
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
        // the CUDA driver API (cuda.h, CUDA 13.0) declares for it, its C enums (CUresult,
        // CUprocessState) as the 32-bit integers they are passed as.
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

    fn check(&self, code: CuResult, call: &'static str) -> Result<(), DriverError> {
        check(code, call, |code| self.error_name(code))
    }

    /// `cuGetErrorName(code)`, `None` for a code the driver does not know.
    fn error_name(&self, code: CuResult) -> Option<String> {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName takes any code (it answers CUDA_ERROR_INVALID_VALUE for one it
        // does not know) and on success writes a pointer to a static string; `p` is a valid
        // out-pointer.
        let found = unsafe { (self.get_error_name)(code, &mut p) } == CUDA_SUCCESS;
        (found && !p.is_null()).then(|| {
            // SAFETY: the driver returned a NUL-terminated static string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        })
    }

    /// `cuInit(0)`. The driver requires it in the caller before a restore.
    pub fn init(&self) -> Result<(), DriverError> {
        // SAFETY: plain call with a flags value of 0 as documented.
        let code = unsafe { (self.init)(0) };
        self.check(code, "cuInit")
    }

    /// Driver API version, e.g. 13000 for the r580 branch.
    pub fn driver_version(&self) -> Result<i32, DriverError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer.
        let code = unsafe { (self.driver_get_version)(&mut v) };
        self.check(code, "cuDriverGetVersion")?;
        Ok(v)
    }

    /// The tid of the driver's checkpoint helper thread inside `pid`. An error here means, in
    /// practice, that `pid` has no CUDA state.
    pub fn restore_thread_id(&self, pid: HostPid) -> Result<HostTid, DriverError> {
        let mut tid: c_int = 0;
        // SAFETY: `tid` is a valid out-pointer; the driver only reads `pid`.
        let code = unsafe { (self.get_restore_tid)(pid.get(), &mut tid) };
        self.check(code, "cuCheckpointProcessGetRestoreThreadId")?;
        Ok(HostTid(tid))
    }

    pub fn process_state(&self, pid: HostPid) -> Result<ProcessState, DriverError> {
        let mut s: RawProcessState = 0;
        // SAFETY: `s` is a valid out-pointer to a 32-bit integer, the size of CUprocessState.
        let code = unsafe { (self.get_state)(pid.get(), &mut s) };
        self.check(code, "cuCheckpointProcessGetState")?;
        Ok(ProcessState::from_raw(s))
    }

    /// RUNNING -> LOCKED. `timeout_ms == 0` waits forever; on timeout the process stays running.
    pub fn lock(&self, pid: HostPid, timeout_ms: u32) -> Result<(), DriverError> {
        // SAFETY: the argument structs are plain C data; all-zero is their documented default.
        let mut a: CUcheckpointLockArgs = unsafe { std::mem::zeroed() };
        a.timeoutMs = timeout_ms;
        // SAFETY: `a` is a valid, zero-initialised argument struct.
        let code = unsafe { (self.lock)(pid.get(), &mut a) };
        self.check(code, "cuCheckpointProcessLock")
    }

    /// LOCKED -> CHECKPOINTED: device memory still mapped goes to host memory of the target.
    pub fn checkpoint(&self, pid: HostPid) -> Result<(), DriverError> {
        // SAFETY: zeroed C argument struct, as documented.
        let mut a: CUcheckpointCheckpointArgs = unsafe { std::mem::zeroed() };
        // SAFETY: `a` is a valid argument struct.
        let code = unsafe { (self.checkpoint)(pid.get(), &mut a) };
        self.check(code, "cuCheckpointProcessCheckpoint")
    }

    /// CHECKPOINTED -> LOCKED, optionally onto other GPUs: `pairs` are (checkpointed GPU, GPU
    /// it is restored onto) and must then list every checkpointed GPU.
    pub fn restore(&self, pid: HostPid, pairs: &[(GpuUuid, GpuUuid)]) -> Result<(), DriverError> {
        let mut raw = gpu_pairs(pairs);
        // SAFETY: zeroed C argument struct, as documented.
        let mut a: CUcheckpointRestoreArgs = unsafe { std::mem::zeroed() };
        if !raw.is_empty() {
            a.gpuPairs = raw.as_mut_ptr();
            a.gpuPairsCount = raw.len() as c_uint;
        }
        // SAFETY: `a` is valid; `gpuPairs` points to `raw`, which outlives the call.
        let code = unsafe { (self.restore)(pid.get(), &mut a) };
        self.check(code, "cuCheckpointProcessRestore")
    }

    /// LOCKED -> RUNNING.
    pub fn unlock(&self, pid: HostPid) -> Result<(), DriverError> {
        // SAFETY: zeroed C argument struct, as documented.
        let mut a: CUcheckpointUnlockArgs = unsafe { std::mem::zeroed() };
        // SAFETY: `a` is a valid argument struct.
        let code = unsafe { (self.unlock)(pid.get(), &mut a) };
        self.check(code, "cuCheckpointProcessUnlock")
    }

    /// The GPUs visible to this process (needs [`Self::init`] first).
    pub fn gpus(&self) -> Result<Vec<GpuInfo>, DriverError> {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        let code = unsafe { (self.device_get_count)(&mut n) };
        self.check(code, "cuDeviceGetCount")?;
        let mut out = Vec::new();
        for ordinal in 0..n.max(0) {
            let mut dev: CUdevice = 0;
            // SAFETY: valid out-pointer, ordinal < count.
            let code = unsafe { (self.device_get)(&mut dev, ordinal) };
            self.check(code, "cuDeviceGet")?;
            let mut uuid = CUuuid { bytes: [0; 16] };
            // SAFETY: valid out-pointer and device handle.
            let code = unsafe { (self.device_get_uuid)(&mut uuid, dev) };
            self.check(code, "cuDeviceGetUuid_v2")?;
            let mut name = [0 as c_char; 256];
            // SAFETY: the buffer is 256 bytes and its length is passed; the driver writes at most
            // that many.
            let code =
                unsafe { (self.device_get_name)(name.as_mut_ptr(), name.len() as c_int, dev) };
            self.check(code, "cuDeviceGetName")?;
            let mut total: usize = 0;
            // SAFETY: valid out-pointer and device handle.
            let code = unsafe { (self.device_total_mem)(&mut total, dev) };
            self.check(code, "cuDeviceTotalMem_v2")?;
            out.push(GpuInfo {
                ordinal: ordinal as u32,
                uuid: GpuUuid::from(uuid),
                name: c_string(&name),
                total_mem: total as u64,
            });
        }
        Ok(out)
    }
}

/// `pairs` as `cuCheckpointProcessRestore` takes them.
fn gpu_pairs(pairs: &[(GpuUuid, GpuUuid)]) -> Vec<CUcheckpointGpuPair> {
    pairs
        .iter()
        .map(|&(old, new)| CUcheckpointGpuPair {
            oldUuid: old.into(),
            newUuid: new.into(),
        })
        .collect()
}

/// The text of a NUL-terminated C string the driver wrote into `buf`, up to the end of `buf`
/// should it have no NUL.
fn c_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf.iter().map(|c| c.to_ne_bytes()[0]).collect();
    let text = CStr::from_bytes_until_nul(&bytes).map_or(&bytes[..], CStr::to_bytes);
    String::from_utf8_lossy(text).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

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

    /// Every field of the structs the driver reads, against cuda.h of CUDA 13.0 (x86_64 and
    /// aarch64 lay them out alike): the driver rejects a non-zero reserved byte, so a field
    /// that moved would fail there, not here, without these.
    #[test]
    fn checkpoint_arg_fields_sit_where_cuda_h_puts_them() {
        // { unsigned int timeoutMs; unsigned int reserved0; cuuint64_t reserved1[7]; }
        assert_eq!(align_of::<CUcheckpointLockArgs>(), 8);
        assert_eq!(offset_of!(CUcheckpointLockArgs, reserved0), 4);
        assert_eq!(offset_of!(CUcheckpointLockArgs, reserved1), 8);
        // { cuuint64_t reserved[8]; }
        assert_eq!(align_of::<CUcheckpointCheckpointArgs>(), 8);
        assert_eq!(offset_of!(CUcheckpointCheckpointArgs, reserved), 0);
        assert_eq!(align_of::<CUcheckpointUnlockArgs>(), 8);
        assert_eq!(offset_of!(CUcheckpointUnlockArgs, reserved), 0);
        // { CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount; char reserved[44];
        //   cuuint64_t reserved1; }
        assert_eq!(align_of::<CUcheckpointRestoreArgs>(), 8);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, reserved), 12);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, reserved1), 56);
        // { CUuuid oldUuid; CUuuid newUuid; }, an array of them packed without padding.
        assert_eq!(align_of::<CUcheckpointGpuPair>(), 1);
        assert_eq!(offset_of!(CUcheckpointGpuPair, oldUuid), 0);
        // { char bytes[16]; }
        assert_eq!(align_of::<CUuuid>(), 1);
        assert_eq!(offset_of!(CUuuid, bytes), 0);
    }

    #[test]
    fn raw_codes_match_cuda_h() {
        assert_eq!(CUresult::CUDA_SUCCESS as CuResult, CUDA_SUCCESS);
        for (c, state) in [
            (
                CUprocessState::CU_PROCESS_STATE_RUNNING,
                ProcessState::Running,
            ),
            (
                CUprocessState::CU_PROCESS_STATE_LOCKED,
                ProcessState::Locked,
            ),
            (
                CUprocessState::CU_PROCESS_STATE_CHECKPOINTED,
                ProcessState::Checkpointed,
            ),
            (
                CUprocessState::CU_PROCESS_STATE_FAILED,
                ProcessState::Failed,
            ),
        ] {
            assert_eq!(ProcessState::from_raw(c as RawProcessState), state);
        }
    }

    #[test]
    fn a_state_cuda_13_0_does_not_list_is_other() {
        // CUDA 13.4 added CHECKPOINTING (4) and RESTORING (5); a driver may answer them.
        assert_eq!(ProcessState::from_raw(4), ProcessState::Other(4));
        assert_eq!(ProcessState::from_raw(5).to_string(), "state 5");
        assert_eq!(
            ProcessState::from_raw(u32::MAX),
            ProcessState::Other(u32::MAX)
        );
    }

    #[test]
    fn success_is_ok_and_any_other_code_an_error_naming_the_call() {
        let never = |_: CuResult| -> Option<String> { panic!("success needs no name") };
        assert!(check(CUDA_SUCCESS, "cuInit", never).is_ok());

        let e = check(401, "cuCheckpointProcessLock", |code| {
            (code == 401).then(|| "CUDA_ERROR_ILLEGAL_STATE".to_string())
        })
        .unwrap_err();
        assert_eq!(e.code(), Some(401));
        assert_eq!(
            e.to_string(),
            "cuCheckpointProcessLock failed: CUDA_ERROR_ILLEGAL_STATE (401)"
        );

        // A code no CUresult lists (a newer driver's) is carried as it came.
        let e = check(123_456, "cuCheckpointProcessRestore", |_| None).unwrap_err();
        assert_eq!(e.code(), Some(123_456));
        assert_eq!(
            e.to_string(),
            "cuCheckpointProcessRestore failed: unknown CUDA error (123456)"
        );
    }

    #[test]
    fn gpu_pairs_keep_old_and_new_in_place() {
        let (a, b) = (
            GpuUuid::from_bytes([0xa0; 16]),
            GpuUuid::from_bytes([0x0b; 16]),
        );
        let raw = gpu_pairs(&[(a, b), (b, a)]);
        assert_eq!(raw.len(), 2);
        assert_eq!(GpuUuid::from(raw[0].oldUuid), a);
        assert_eq!(GpuUuid::from(raw[0].newUuid), b);
        assert_eq!(GpuUuid::from(raw[1].oldUuid), b);
        assert_eq!(GpuUuid::from(raw[1].newUuid), a);
        assert!(gpu_pairs(&[]).is_empty());
    }

    #[test]
    fn device_names_end_at_the_nul_or_the_buffer() {
        let mut buf = [0 as c_char; 8];
        for (d, s) in buf.iter_mut().zip(b"H200\0xyz") {
            *d = c_char::from_ne_bytes([*s]);
        }
        assert_eq!(c_string(&buf), "H200");
        let full = [c_char::from_ne_bytes([b'x']); 4];
        assert_eq!(c_string(&full), "xxxx");
    }

    #[test]
    fn uuid_round_trip() {
        let s = "GPU-0123abcd-4567-89ef-0123-456789abcdef";
        let b: GpuUuid = s.parse().unwrap();
        assert_eq!(b.to_string(), "0123abcd456789ef0123456789abcdef");
        assert!("GPU-12".parse::<GpuUuid>().is_err());
        assert!(
            "zz23abcd456789ef0123456789abcdef"
                .parse::<GpuUuid>()
                .is_err()
        );
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
