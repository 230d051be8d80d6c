//! `fakegpu-vmm`: a CUDA driver-API workload for the split-path CI tests.
//!
//! It loads `libcuda.so.1` (the stand-in `libfakecudadev.so` through `LD_LIBRARY_PATH`, or any
//! driver), resolves its entry points through the process's global scope, so that a preloaded
//! gpusnap agent's exports are what it calls, allocates device memory with `cuMemAlloc_v2` and
//! then checks it every tick. Usage:
//!
//! ```text
//! fakegpu-vmm --log PATH [--seed S] [--allocs N] [--mib M] [--resolve dlsym|proc]
//!             [--app-vmm [--app-vmm-remap | --app-vmm-release] [--app-vmm-rdma]
//!                        [--app-vmm-posix] [--app-vmm-compressed] [--app-vmm-peer]]
//!             [--threads T] [--procs P]
//!             [--hazard managed|ipc|ipc-driver|peer|ipc-event|ipc-event-closed]
//!             [--devices D]
//! ```
//!
//! - `N` allocations of `M` MiB (the last one 12345 bytes longer, a size that is not a multiple
//!   of the VMM granularity), a 1 MiB counter allocation (large enough for the agent to convert
//!   every one of these), and a 64 KiB allocation it leaves to the driver.
//! - `--app-vmm`: also 2 MiB the workload maps itself with the VMM calls (reserve, create, map,
//!   set access), as allocators such as PyTorch's expandable segments do, keeping the handle.
//!   With `--app-vmm-remap` it unmaps that handle and maps it again every tick (so a handle value
//!   that did not survive a checkpoint fails the tick); with `--app-vmm-release` it releases the
//!   handle right after mapping it (the mapping alone holds the memory). `--app-vmm-rdma` asks
//!   for `gpuDirectRDMACapable` memory, `--app-vmm-posix` for the POSIX-fd handle type (both:
//!   what PyTorch's expandable segments ask for on an H200; a keeper makes such memory again,
//!   so it is lent), `--app-vmm-compressed` for compressible memory (compressionType 1: a
//!   keeper does not make it, so it is copied first). `--app-vmm-peer` also gives GPU 1
//!   read-write access to the mapping (with `--devices 2`), which the split path would not make
//!   again. Without `--app-vmm-posix` the handle is created without a shareable handle type, and the workload checks that it cannot be
//!   exported, as the driver says without the agent (with it, it exports nothing: an export
//!   nobody imports makes the dump refuse the process). While it keeps the
//!   handle, every tick reads its properties back (`cuMemGetAllocationPropertiesFromHandle`)
//!   and fails the tick unless they are exactly what it created the handle with.
//! - Each data allocation is filled with a pattern from `S` with `cuMemcpyHtoD_v2` (the second
//!   half of allocation 1 with zeros, which compresses); the counter starts at 0.
//! - Every 50 ms, tick `K` (1, 2, ...): every allocation is copied back with `cuMemcpyDtoH_v2`
//!   and compared with its pattern; the counter is read, incremented and written back (a
//!   read-modify-write through device memory) and read again. One line is appended to the log
//!   with a single `write(2)`: `tick K counter C ok 1`, or `ok 0` if any copy failed, any
//!   pattern differed, any helper thread saw a difference, or the counter is not `K` (it lives
//!   in device memory, the tick number in host memory: both must survive a checkpoint
//!   together). Failures are described on stderr.
//! - `--threads T`: `T` more threads copy the 64 KiB allocation back and check it in a loop,
//!   so driver calls are in flight on other threads whenever a checkpoint begins.
//! - `--procs P`: `P - 1` child processes are forked first, each doing all of the above on its
//!   own (seed `S + i`, log `PATH.i`), so a dump has several GPU processes.
//! - `--hazard`: once set up, also make state the driver cannot checkpoint (managed memory, a
//!   CUDA IPC handle for the first allocation, peer access), through the exported symbols, so
//!   the preloaded agent records it and gpusnap must refuse the dump. `ipc-event`: an
//!   interprocess event is created, its IPC handle taken and opened again, and the opened event
//!   kept (an importer's state; the process opens its own handle, which the stand-in driver
//!   allows, so one process does it). `ipc-event-closed`: the same, the opened event destroyed
//!   right after (as PyTorch does), which leaves nothing to refuse.
//! - `--devices D`: data allocation `i` is made on device `i % D` (`cuMemAlloc_v2` with that
//!   device's primary context current), so a process with `D` > 1 has memory on several
//!   GPUs; everything else (the counter, the 64 KiB allocation, `--app-vmm`) is on device 0.
//! - Changing part of the data on request (for incremental checkpoints): when a file
//!   `PATH.mutate` exists at the start of a tick, the workload removes it, overwrites the first
//!   MiB of data allocation 0 with a new pattern (generation `G` = 1, 2, ...), checks against
//!   that from then on, and writes `G` to `PATH.mutated`. The rest of its memory is unchanged.
//! - `--resolve proc`: only `cuGetProcAddress_v2` comes from `dlsym`; every other entry point
//!   is asked of it (CUDA 13.0), as the CUDA runtime does.
//!
//! The first log line is `pid P seed S allocs A bytes B` (`A` counts every allocation).

use std::ffi::{CStr, CString, c_int, c_void};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::process::exit;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

type CuResult = u32;
type DevPtr = u64;

const TICK: Duration = Duration::from_millis(50);
const MIB: usize = 1 << 20;
const ODD_EXTRA: usize = 12345;
const SMALL: usize = 64 << 10;
/// The VMM granularity the workload asks for is at most this; the app-VMM region is this big.
const APP_VMM: usize = 2 << 20;

type InitFn = unsafe extern "C" fn(u32) -> CuResult;
type DeviceGetFn = unsafe extern "C" fn(*mut c_int, c_int) -> CuResult;
type CtxRetainFn = unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult;
type CtxSetFn = unsafe extern "C" fn(*mut c_void) -> CuResult;
type AllocFn = unsafe extern "C" fn(*mut DevPtr, usize) -> CuResult;
type HtoDFn = unsafe extern "C" fn(DevPtr, *const c_void, usize) -> CuResult;
type DtoHFn = unsafe extern "C" fn(*mut c_void, DevPtr, usize) -> CuResult;
type ReserveFn = unsafe extern "C" fn(*mut DevPtr, usize, usize, DevPtr, u64) -> CuResult;
type CreateFn = unsafe extern "C" fn(*mut u64, usize, *const AllocationProp, u64) -> CuResult;
type MapFn = unsafe extern "C" fn(DevPtr, usize, usize, u64, u64) -> CuResult;
type SetAccessFn = unsafe extern "C" fn(DevPtr, usize, *const AccessDesc, usize) -> CuResult;
type UnmapFn = unsafe extern "C" fn(DevPtr, usize) -> CuResult;
type ReleaseFn = unsafe extern "C" fn(u64) -> CuResult;
type ExportFn = unsafe extern "C" fn(*mut c_void, u64, u32, u64) -> CuResult;
type GetPropsFn = unsafe extern "C" fn(*mut AllocationProp, u64) -> CuResult;
type GetProcAddressV2 =
    unsafe extern "C" fn(*const i8, *mut *mut c_void, c_int, u64, *mut c_int) -> CuResult;

/// `CUmemAllocationProp` (CUDA 13 cuda.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AllocationProp {
    type_: u32,
    requested_handle_types: u32,
    location_type: u32,
    location_id: i32,
    win32_handle_meta_data: *mut c_void,
    alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`.
#[repr(C)]
struct AccessDesc {
    location_type: u32,
    location_id: i32,
    flags: u32,
}

/// The driver entry points the workload uses.
struct Driver {
    init: InitFn,
    device_get: DeviceGetFn,
    primary_ctx_retain: CtxRetainFn,
    ctx_set_current: CtxSetFn,
    mem_alloc: AllocFn,
    htod: HtoDFn,
    dtoh: DtoHFn,
    reserve: ReserveFn,
    create: CreateFn,
    map: MapFn,
    set_access: SetAccessFn,
    unmap: UnmapFn,
    release: ReleaseFn,
    export: ExportFn,
    get_props: GetPropsFn,
}

/// How entry points are found.
#[derive(Clone, Copy)]
enum Resolve {
    Dlsym,
    ProcAddress(GetProcAddressV2),
}

fn die(msg: &str) -> ! {
    eprintln!("fakegpu-vmm: {msg}");
    exit(2)
}

fn dlsym(name: &str) -> *mut c_void {
    let c = CString::new(name).unwrap_or_else(|_| die("bad symbol name"));
    // SAFETY: RTLD_DEFAULT and a valid C string.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr()) }
}

/// Looks up `export` (dlsym) or `base` (cuGetProcAddress).
fn lookup(how: Resolve, export: &str, base: &str) -> *mut c_void {
    let p = match how {
        Resolve::Dlsym => dlsym(export),
        Resolve::ProcAddress(gpa) => {
            let c = CString::new(base).unwrap_or_else(|_| die("bad symbol name"));
            let mut p = std::ptr::null_mut();
            let mut status = 0;
            // SAFETY: a valid C string and out pointers.
            let rc = unsafe { gpa(c.as_ptr(), &mut p, 13000, 0, &mut status) };
            if rc != 0 {
                die(&format!(
                    "cuGetProcAddress_v2({base}) = {rc}, status {status}"
                ));
            }
            p
        }
    };
    if p.is_null() {
        die(&format!("{export} not found"));
    }
    p
}

/// The entry point `$export` (`$base` for cuGetProcAddress) as a `$ty`.
macro_rules! entry {
    ($how:expr, $export:literal, $base:literal, $ty:ty) => {{
        let p = lookup($how, $export, $base);
        // SAFETY: p is the driver's entry point of that name, whose C signature (CUDA 13
        // cuda.h) is $ty.
        unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
    }};
}

impl Driver {
    fn load(how: &str) -> Driver {
        // SAFETY: a valid C string; the handle is kept for the life of the process.
        let h =
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            // SAFETY: dlerror returns null or a valid C string.
            let e = unsafe { libc::dlerror() };
            let msg = if e.is_null() {
                "unknown error".into()
            } else {
                // SAFETY: non-null C string from dlerror.
                unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
            };
            die(&format!("dlopen(libcuda.so.1): {msg}"));
        }
        let how = match how {
            "dlsym" => Resolve::Dlsym,
            "proc" => {
                let p = dlsym("cuGetProcAddress_v2");
                if p.is_null() {
                    die("cuGetProcAddress_v2 not found");
                }
                // SAFETY: the driver's cuGetProcAddress_v2, of this C signature.
                Resolve::ProcAddress(unsafe {
                    std::mem::transmute::<*mut c_void, GetProcAddressV2>(p)
                })
            }
            other => die(&format!("--resolve {other}: dlsym or proc")),
        };
        Driver {
            init: entry!(how, "cuInit", "cuInit", InitFn),
            device_get: entry!(how, "cuDeviceGet", "cuDeviceGet", DeviceGetFn),
            primary_ctx_retain: entry!(
                how,
                "cuDevicePrimaryCtxRetain",
                "cuDevicePrimaryCtxRetain",
                CtxRetainFn
            ),
            ctx_set_current: entry!(how, "cuCtxSetCurrent", "cuCtxSetCurrent", CtxSetFn),
            mem_alloc: entry!(how, "cuMemAlloc_v2", "cuMemAlloc", AllocFn),
            htod: entry!(how, "cuMemcpyHtoD_v2", "cuMemcpyHtoD", HtoDFn),
            dtoh: entry!(how, "cuMemcpyDtoH_v2", "cuMemcpyDtoH", DtoHFn),
            reserve: entry!(how, "cuMemAddressReserve", "cuMemAddressReserve", ReserveFn),
            create: entry!(how, "cuMemCreate", "cuMemCreate", CreateFn),
            map: entry!(how, "cuMemMap", "cuMemMap", MapFn),
            set_access: entry!(how, "cuMemSetAccess", "cuMemSetAccess", SetAccessFn),
            unmap: entry!(how, "cuMemUnmap", "cuMemUnmap", UnmapFn),
            release: entry!(how, "cuMemRelease", "cuMemRelease", ReleaseFn),
            export: entry!(
                how,
                "cuMemExportToShareableHandle",
                "cuMemExportToShareableHandle",
                ExportFn
            ),
            get_props: entry!(
                how,
                "cuMemGetAllocationPropertiesFromHandle",
                "cuMemGetAllocationPropertiesFromHandle",
                GetPropsFn
            ),
        }
    }

    fn check(&self, what: &str, rc: CuResult) -> Result<(), String> {
        if rc == 0 {
            Ok(())
        } else {
            Err(format!("{what} failed: CUDA error {rc}"))
        }
    }

    /// `cuInit`, device 0, its primary context made current; returns the context.
    fn setup(&self) -> Result<*mut c_void, String> {
        // SAFETY: flags 0.
        self.check("cuInit", unsafe { (self.init)(0) })?;
        let ctx = self.primary_context(0)?;
        self.make_current(ctx)?;
        Ok(ctx)
    }

    /// Device `ordinal`'s primary context (retained).
    fn primary_context(&self, ordinal: c_int) -> Result<*mut c_void, String> {
        let mut dev = -1;
        // SAFETY: valid out pointer.
        self.check(&format!("cuDeviceGet({ordinal})"), unsafe {
            (self.device_get)(&mut dev, ordinal)
        })?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out pointer, a device from cuDeviceGet.
        self.check("cuDevicePrimaryCtxRetain", unsafe {
            (self.primary_ctx_retain)(&mut ctx, dev)
        })?;
        Ok(ctx)
    }

    fn make_current(&self, ctx: *mut c_void) -> Result<(), String> {
        // SAFETY: a context from cuDevicePrimaryCtxRetain.
        self.check("cuCtxSetCurrent", unsafe { (self.ctx_set_current)(ctx) })
    }

    fn alloc(&self, len: usize) -> Result<DevPtr, String> {
        let mut p = 0;
        // SAFETY: valid out pointer.
        self.check(&format!("cuMemAlloc_v2({len})"), unsafe {
            (self.mem_alloc)(&mut p, len)
        })?;
        Ok(p)
    }

    /// `APP_VMM` bytes mapped with the application's own VMM calls on device 0, created with
    /// `prop`; returns the address and the handle.
    fn app_vmm(&self, prop: &AllocationProp) -> Result<(DevPtr, u64), String> {
        let prop = *prop;
        let mut addr = 0;
        // SAFETY: valid out pointer; no fixed address, default alignment.
        self.check("cuMemAddressReserve", unsafe {
            (self.reserve)(&mut addr, APP_VMM, 0, 0, 0)
        })?;
        let mut handle = 0;
        // SAFETY: valid out pointer and property struct.
        self.check("cuMemCreate", unsafe {
            (self.create)(&mut handle, APP_VMM, &prop, 0)
        })?;
        // Created with no shareable handle type: not exportable (whatever the agent makes of
        // the memory behind it). One created with the POSIX-fd type is not exported here: an
        // export nobody imports would make the dump refuse the process (`docs/ipc.md`).
        if prop.requested_handle_types & 1 == 0 {
            let mut fd: c_int = -1;
            // SAFETY: an int out pointer, the handle just made, POSIX-fd type, no flags.
            let rc = unsafe { (self.export)((&raw mut fd).cast(), handle, 1, 0) };
            if rc == 0 {
                // SAFETY: the descriptor the export just returned.
                unsafe { libc::close(fd) };
                return Err("cuMemExportToShareableHandle of a handle created without \
                            shareable handle types succeeded"
                    .into());
            }
        }
        self.check_props(handle, &prop)?;
        // SAFETY: the reservation and the handle just made, of the same size.
        self.check("cuMemMap", unsafe {
            (self.map)(addr, APP_VMM, 0, handle, 0)
        })?;
        self.app_vmm_access(addr)?;
        Ok((addr, handle))
    }

    /// The handle's properties read back must be exactly `asked`.
    fn check_props(&self, handle: u64, asked: &AllocationProp) -> Result<(), String> {
        let mut got = AllocationProp {
            type_: 0,
            requested_handle_types: 0,
            location_type: 0,
            location_id: 0,
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: [0; 8],
        };
        // SAFETY: a valid out struct; the application's live handle.
        self.check("cuMemGetAllocationPropertiesFromHandle", unsafe {
            (self.get_props)(&mut got, handle)
        })?;
        if got != *asked {
            return Err(format!(
                "the handle's properties read back {got:?}, created with {asked:?}"
            ));
        }
        Ok(())
    }

    fn app_vmm_access(&self, addr: DevPtr) -> Result<(), String> {
        let desc = AccessDesc {
            location_type: 1,
            location_id: 0,
            flags: 3,
        };
        // SAFETY: a mapping of APP_VMM bytes at addr; one descriptor.
        self.check("cuMemSetAccess", unsafe {
            (self.set_access)(addr, APP_VMM, &desc, 1)
        })
    }

    /// Read-write access to the application's mapping for GPU 1 as well (a peer GPU reading a
    /// device-0 allocation, as multi-GPU allocators set it up).
    fn app_vmm_peer_access(&self, addr: DevPtr) -> Result<(), String> {
        let desc = [0, 1].map(|id| AccessDesc {
            location_type: 1,
            location_id: id,
            flags: 3,
        });
        // SAFETY: a mapping of APP_VMM bytes at addr; two descriptors.
        self.check("cuMemSetAccess(peer)", unsafe {
            (self.set_access)(addr, APP_VMM, desc.as_ptr(), desc.len())
        })
    }

    /// Unmaps the application's mapping and maps `handle` there again (its contents stay).
    fn app_vmm_remap(&self, addr: DevPtr, handle: u64) -> Result<(), String> {
        // SAFETY: the whole mapping made by app_vmm.
        self.check("cuMemUnmap", unsafe { (self.unmap)(addr, APP_VMM) })?;
        // SAFETY: the reservation just unmapped and the handle the workload holds.
        self.check(&format!("cuMemMap(handle {handle:#x})"), unsafe {
            (self.map)(addr, APP_VMM, 0, handle, 0)
        })?;
        self.app_vmm_access(addr)
    }

    fn app_vmm_release(&self, handle: u64) -> Result<(), String> {
        // SAFETY: the handle from app_vmm, released once.
        self.check("cuMemRelease", unsafe { (self.release)(handle) })
    }

    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), String> {
        // SAFETY: src is a live slice; dst a device allocation at least as long.
        let rc = unsafe { (self.htod)(dst, src.as_ptr().cast(), src.len()) };
        self.check(
            &format!("cuMemcpyHtoD_v2({dst:#x}, {} bytes)", src.len()),
            rc,
        )
    }

    fn download(&self, dst: &mut [u8], src: DevPtr) -> Result<(), String> {
        // SAFETY: dst is a live slice; src a device allocation at least as long.
        let rc = unsafe { (self.dtoh)(dst.as_mut_ptr().cast(), src, dst.len()) };
        self.check(
            &format!("cuMemcpyDtoH_v2({src:#x}, {} bytes)", dst.len()),
            rc,
        )
    }
}

/// The pattern of data allocation `index` (splitmix64 from the seed and the index).
fn pattern(seed: u64, index: u64, len: usize) -> Vec<u8> {
    let mut x = seed ^ index.wrapping_mul(0xd1b5_4a32_d192_ed03);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    if index == 1 {
        // Half zeros: something for compression to find.
        out[len / 2..].fill(0);
    }
    out
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn num(args: &[String], name: &str, default: u64) -> u64 {
    arg(args, name).map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|_| die(&format!("{name} {v}: not a number")))
    })
}

fn write_line(log: &mut File, line: &str) {
    if let Err(e) = log.write_all(line.as_bytes()) {
        die(&format!("writing the log: {e}"));
    }
}

/// A device buffer and what it must hold.
struct Buffer {
    ptr: DevPtr,
    expected: Vec<u8>,
}

/// The workload's settings.
struct Settings {
    log: String,
    seed: u64,
    allocs: usize,
    mib: usize,
    resolve: String,
    app_vmm: bool,
    app_vmm_remap: bool,
    app_vmm_release: bool,
    app_vmm_rdma: bool,
    app_vmm_posix: bool,
    app_vmm_compressed: bool,
    app_vmm_peer: bool,
    threads: usize,
    hazard: Option<String>,
    devices: usize,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mut s = Settings {
        log: arg(&args, "--log").unwrap_or_else(|| die("--log PATH is required")),
        seed: num(&args, "--seed", 1),
        allocs: num(&args, "--allocs", 3).max(1) as usize,
        mib: num(&args, "--mib", 4).max(1) as usize,
        resolve: arg(&args, "--resolve").unwrap_or_else(|| "dlsym".into()),
        app_vmm: args.iter().any(|a| a == "--app-vmm"),
        app_vmm_remap: args.iter().any(|a| a == "--app-vmm-remap"),
        app_vmm_release: args.iter().any(|a| a == "--app-vmm-release"),
        app_vmm_rdma: args.iter().any(|a| a == "--app-vmm-rdma"),
        app_vmm_posix: args.iter().any(|a| a == "--app-vmm-posix"),
        app_vmm_compressed: args.iter().any(|a| a == "--app-vmm-compressed"),
        app_vmm_peer: args.iter().any(|a| a == "--app-vmm-peer"),
        threads: num(&args, "--threads", 0) as usize,
        hazard: arg(&args, "--hazard"),
        devices: num(&args, "--devices", 1).max(1) as usize,
    };
    let procs = num(&args, "--procs", 1).max(1);
    for i in 1..procs {
        // SAFETY: single-threaded here (nothing started yet); the child goes on below.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            die("fork failed");
        }
        if pid == 0 {
            // SAFETY: PR_SET_PDEATHSIG takes a signal number: the child dies with its parent.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
            s.log = format!("{}.{i}", s.log);
            s.seed += i;
            break;
        }
    }
    run(&s);
}

/// Calls the exported entry point for `kind` (see `--hazard`).
fn make_hazard(kind: &str, ctx: *mut c_void, first: DevPtr) -> Result<(), String> {
    type ManagedFn = unsafe extern "C" fn(*mut DevPtr, usize, u32) -> CuResult;
    type IpcFn = unsafe extern "C" fn(*mut [u8; 64], DevPtr) -> CuResult;
    type PeerFn = unsafe extern "C" fn(*mut c_void, u32) -> CuResult;
    let rc = match kind {
        "managed" => {
            let f = entry!(
                Resolve::Dlsym,
                "cuMemAllocManaged",
                "cuMemAllocManaged",
                ManagedFn
            );
            let mut p = 0;
            // SAFETY: a valid out pointer; flags 1 is CU_MEM_ATTACH_GLOBAL.
            unsafe { f(&mut p, MIB, 1) }
        }
        "ipc" => {
            let f = entry!(
                Resolve::Dlsym,
                "cuIpcGetMemHandle",
                "cuIpcGetMemHandle",
                IpcFn
            );
            let mut h = [0u8; 64];
            // SAFETY: a valid 64-byte out buffer and a live allocation.
            unsafe { f(&mut h, first) }
        }
        "ipc-driver" => {
            // A small allocation (under the agent's conversion threshold) goes to the driver,
            // and so does its IPC handle: CUDA IPC the agent does not serve.
            type AllocFn = unsafe extern "C" fn(*mut DevPtr, usize) -> CuResult;
            let alloc = entry!(Resolve::Dlsym, "cuMemAlloc_v2", "cuMemAlloc", AllocFn);
            let f = entry!(
                Resolve::Dlsym,
                "cuIpcGetMemHandle",
                "cuIpcGetMemHandle",
                IpcFn
            );
            let mut small = 0;
            let mut h = [0u8; 64];
            // SAFETY: a valid out pointer.
            match unsafe { alloc(&mut small, 64 << 10) } {
                // SAFETY: a valid 64-byte out buffer and the live allocation just made.
                0 => unsafe { f(&mut h, small) },
                rc => rc,
            }
        }
        "ipc-event" | "ipc-event-closed" => {
            type CreateFn = unsafe extern "C" fn(*mut *mut c_void, u32) -> CuResult;
            type GetFn = unsafe extern "C" fn(*mut [u8; 64], *mut c_void) -> CuResult;
            type OpenFn = unsafe extern "C" fn(*mut *mut c_void, [u8; 64]) -> CuResult;
            type DestroyFn = unsafe extern "C" fn(*mut c_void) -> CuResult;
            let create = entry!(Resolve::Dlsym, "cuEventCreate", "cuEventCreate", CreateFn);
            let get = entry!(
                Resolve::Dlsym,
                "cuIpcGetEventHandle",
                "cuIpcGetEventHandle",
                GetFn
            );
            let open = entry!(
                Resolve::Dlsym,
                "cuIpcOpenEventHandle",
                "cuIpcOpenEventHandle",
                OpenFn
            );
            let destroy = entry!(
                Resolve::Dlsym,
                "cuEventDestroy_v2",
                "cuEventDestroy",
                DestroyFn
            );
            let (mut event, mut opened, mut h) =
                (std::ptr::null_mut(), std::ptr::null_mut(), [0u8; 64]);
            // SAFETY: valid out pointers; flags: CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING.
            let mut rc = unsafe { create(&mut event, 0x4 | 0x2) };
            if rc == 0 {
                // SAFETY: a valid 64-byte out buffer and the interprocess event just made.
                rc = unsafe { get(&mut h, event) };
            }
            if rc == 0 {
                // SAFETY: a valid out pointer and the handle just taken.
                rc = unsafe { open(&mut opened, h) };
            }
            if rc == 0 && kind == "ipc-event-closed" {
                // SAFETY: the event just opened, destroyed once.
                rc = unsafe { destroy(opened) };
            }
            rc
        }
        "peer" => {
            let f = entry!(
                Resolve::Dlsym,
                "cuCtxEnablePeerAccess",
                "cuCtxEnablePeerAccess",
                PeerFn
            );
            // SAFETY: a context from cuDevicePrimaryCtxRetain.
            unsafe { f(ctx, 0) }
        }
        other => {
            return Err(format!(
                "--hazard {other}: managed, ipc, ipc-driver, peer, ipc-event or ipc-event-closed"
            ));
        }
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("--hazard {kind}: CUDA error {rc}"))
    }
}

fn run(s: &Settings) -> ! {
    let drv = Arc::new(Driver::load(&s.resolve));
    let ctx = drv.setup().unwrap_or_else(|e| die(&e));
    let contexts: Vec<*mut c_void> = std::iter::once(ctx)
        .chain((1..s.devices).map(|d| drv.primary_context(d as c_int).unwrap_or_else(|e| die(&e))))
        .collect();
    // (length, pattern index, device)
    let mut sizes: Vec<(usize, u64, usize)> = (0..s.allocs)
        .map(|i| {
            let extra = if i + 1 == s.allocs { ODD_EXTRA } else { 0 };
            (s.mib * MIB + extra, i as u64, i % s.devices)
        })
        .collect();
    sizes.push((SMALL, s.allocs as u64, 0));
    let mut buffers: Vec<Buffer> = sizes
        .into_iter()
        .map(|(len, index, device)| {
            drv.make_current(contexts[device])
                .unwrap_or_else(|e| die(&e));
            Buffer {
                ptr: drv.alloc(len).unwrap_or_else(|e| die(&e)),
                expected: pattern(s.seed, index, len),
            }
        })
        .collect();
    drv.make_current(ctx).unwrap_or_else(|e| die(&e));
    let mut remap = None;
    // The application's handle and the properties it was created with, while it is kept.
    let mut kept_handle = None;
    if s.app_vmm {
        // allocFlags: compressionType (byte 0), gpuDirectRDMACapable (byte 1).
        let prop = AllocationProp {
            type_: 1,
            requested_handle_types: u32::from(s.app_vmm_posix),
            location_type: 1,
            location_id: 0,
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: [
                u8::from(s.app_vmm_compressed),
                u8::from(s.app_vmm_rdma),
                0,
                0,
                0,
                0,
                0,
                0,
            ],
        };
        let (ptr, handle) = drv.app_vmm(&prop).unwrap_or_else(|e| die(&e));
        if s.app_vmm_peer {
            drv.app_vmm_peer_access(ptr).unwrap_or_else(|e| die(&e));
        }
        if s.app_vmm_release {
            drv.app_vmm_release(handle).unwrap_or_else(|e| die(&e));
        } else {
            kept_handle = Some((handle, prop));
            if s.app_vmm_remap {
                remap = Some((ptr, handle));
            }
        }
        buffers.push(Buffer {
            ptr,
            expected: pattern(s.seed, 100, APP_VMM),
        });
    }
    for b in &buffers {
        drv.upload(b.ptr, &b.expected).unwrap_or_else(|e| die(&e));
    }
    if let Some(h) = &s.hazard {
        make_hazard(h, ctx, buffers[0].ptr).unwrap_or_else(|e| die(&e));
    }
    let counter = drv.alloc(MIB).unwrap_or_else(|e| die(&e));
    drv.upload(counter, &0u64.to_le_bytes())
        .unwrap_or_else(|e| die(&e));

    let helper_failed = Arc::new(AtomicBool::new(false));
    let small = &buffers[s.allocs];
    for t in 0..s.threads {
        let (drv, failed) = (Arc::clone(&drv), Arc::clone(&helper_failed));
        let (ptr, expected) = (small.ptr, small.expected.clone());
        let ctx = ctx as usize;
        std::thread::Builder::new()
            .name(format!("vmm-helper-{t}"))
            .spawn(move || helper(&drv, ctx as *mut c_void, ptr, &expected, &failed))
            .unwrap_or_else(|e| die(&format!("starting a helper thread: {e}")));
    }

    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&s.log)
        .unwrap_or_else(|e| die(&format!("{}: {e}", s.log)));
    let total: usize = buffers.iter().map(|b| b.expected.len()).sum::<usize>() + MIB;
    write_line(
        &mut log,
        &format!(
            "pid {} seed {} allocs {} bytes {total}\n",
            std::process::id(),
            s.seed,
            buffers.len() + 1
        ),
    );
    let mut scratch = vec![0u8; buffers.iter().map(|b| b.expected.len()).max().unwrap_or(0)];
    let mut generation = 0u64;
    for tick in 1u64.. {
        let mut errors = Vec::new();
        if std::fs::remove_file(format!("{}.mutate", s.log)).is_ok() {
            generation += 1;
            if let Err(e) = mutate(&drv, &mut buffers[0], s.seed, generation) {
                errors.push(e);
            }
            if let Err(e) = std::fs::write(format!("{}.mutated", s.log), generation.to_string()) {
                errors.push(format!("writing {}.mutated: {e}", s.log));
            }
        }
        if let Some((ptr, handle)) = remap
            && let Err(e) = drv.app_vmm_remap(ptr, handle)
        {
            errors.push(e);
        }
        if let Some((handle, prop)) = &kept_handle
            && let Err(e) = drv.check_props(*handle, prop)
        {
            errors.push(e);
        }
        for b in &buffers {
            let dst = &mut scratch[..b.expected.len()];
            match drv.download(dst, b.ptr) {
                Ok(()) if *dst == b.expected[..] => {}
                Ok(()) => {
                    let at = dst.iter().zip(&b.expected).position(|(a, b)| a != b);
                    errors.push(format!(
                        "allocation {:#x} differs from its pattern at byte {at:?}",
                        b.ptr
                    ));
                }
                Err(e) => errors.push(e),
            }
        }
        let value = tick_counter(&drv, counter).unwrap_or_else(|e| {
            errors.push(e);
            0
        });
        if value != tick && errors.is_empty() {
            errors.push(format!("the device counter is {value}, expected {tick}"));
        }
        if helper_failed.swap(false, Ordering::AcqRel) {
            errors.push("a helper thread saw a failed copy or a changed allocation".into());
        }
        for e in &errors {
            eprintln!("fakegpu-vmm: tick {tick}: {e}");
        }
        let ok = u8::from(errors.is_empty());
        write_line(&mut log, &format!("tick {tick} counter {value} ok {ok}\n"));
        std::thread::sleep(TICK);
    }
    unreachable!("the tick loop does not end")
}

/// Overwrites the first MiB of `b` with the pattern of `generation` (see `PATH.mutate`).
fn mutate(drv: &Driver, b: &mut Buffer, seed: u64, generation: u64) -> Result<(), String> {
    let n = MIB.min(b.expected.len());
    let fresh = pattern(seed ^ 0x5eed, 1000 + generation, n);
    b.expected[..n].copy_from_slice(&fresh);
    drv.upload(b.ptr, &fresh)
}

/// A helper thread: copies `ptr` back and compares it, every 5 ms, forever.
fn helper(drv: &Driver, ctx: *mut c_void, ptr: DevPtr, expected: &[u8], failed: &AtomicBool) {
    if let Err(e) = drv.make_current(ctx) {
        eprintln!("fakegpu-vmm: helper: {e}");
        failed.store(true, Ordering::Release);
    }
    let mut buf = vec![0u8; expected.len()];
    loop {
        match drv.download(&mut buf, ptr) {
            Ok(()) if buf == expected => {}
            Ok(()) => {
                eprintln!("fakegpu-vmm: helper: {ptr:#x} differs from its pattern");
                failed.store(true, Ordering::Release);
            }
            Err(e) => {
                eprintln!("fakegpu-vmm: helper: {e}");
                failed.store(true, Ordering::Release);
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Reads the counter, writes it back incremented, reads it again; returns the new value.
fn tick_counter(drv: &Driver, counter: DevPtr) -> Result<u64, String> {
    let mut b = [0u8; 8];
    drv.download(&mut b, counter)?;
    let next = u64::from_le_bytes(b) + 1;
    drv.upload(counter, &next.to_le_bytes())?;
    drv.download(&mut b, counter)?;
    let back = u64::from_le_bytes(b);
    if back != next {
        return Err(format!(
            "the counter reads {back} right after writing {next}"
        ));
    }
    Ok(next)
}
