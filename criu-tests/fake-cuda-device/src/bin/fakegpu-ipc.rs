//! `fakegpu-ipc`: a CUDA IPC exporter and the importer it spawns, for the CI tests of legacy
//! CUDA IPC (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle_v2` / `cuIpcCloseMemHandle`) on the
//! stand-in driver, with and without the gpusnap agent preloaded.
//!
//! ```text
//! fakegpu-ipc export --bytes N [--offset O] [--opens K] [--resolve dlsym|proc] [--self-open]
//!                    [--free-first] [--importer-uid U] [--importer-preload PATH|none]
//!                    [--hold PATH]
//! ```
//!
//! The exporter allocates `N` bytes with `cuMemAlloc_v2`, fills them with a pattern, takes an
//! IPC handle of `base + O`, and runs itself as the importer (`fakegpu-ipc import ...`, same
//! environment unless `--importer-preload` sets or removes `LD_PRELOAD`, as uid `U` with
//! `--importer-uid`). The importer opens the handle `K` times (default 1), checks that every
//! open returned the same pointer and that the memory holds the exporter's pattern, overwrites
//! it with a second pattern, closes `K` times and once more. The exporter then checks that it
//! sees the importer's pattern. `--self-open`: the exporter first opens its own handle;
//! `--free-first`: it frees the allocation before the importer opens the handle. `--hold PATH`:
//! the exporter writes its pid to `PATH.exporter`; the importer, once it has the memory mapped,
//! writes its pid to `PATH.importer` and waits (at most 20 s) until that file is removed, so
//! that a test can look at both processes in that state.
//!
//! `--loop PATH` (a long-running pair, for checkpoint tests): after the open, the importer
//! writes its pattern over all but the first 8 bytes, then both run until killed, one tick every
//! 20 ms. The importer reads the buffer, checks the pattern, adds 1 to the counter in its first
//! 8 bytes and writes it back; the exporter reads the buffer and checks the pattern. Each
//! appends `tick N counter C ok 0|1` to `PATH.importer` / `PATH.exporter`: the exporter seeing
//! the counter grow is the importer's writes reaching its memory, so the two still share it.
//!
//! Every outcome is one line `key value` on stdout (driver status names, `true`/`false`); the
//! importer's lines come back prefixed `importer `. The tests assert on these lines. The exit
//! status is 0 unless the program itself could not run (bad arguments, no driver).

use std::ffi::{CStr, c_char, c_int, c_void};
use std::process::{Command, exit};

type CuResult = u32;
type DevPtr = u64;

#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle {
    reserved: [u8; 64],
}

type InitFn = unsafe extern "C" fn(u32) -> CuResult;
type DeviceGetFn = unsafe extern "C" fn(*mut c_int, c_int) -> CuResult;
type CtxRetainFn = unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult;
type CtxSetFn = unsafe extern "C" fn(*mut c_void) -> CuResult;
type AllocFn = unsafe extern "C" fn(*mut DevPtr, usize) -> CuResult;
type FreeFn = unsafe extern "C" fn(DevPtr) -> CuResult;
type HtoDFn = unsafe extern "C" fn(DevPtr, *const c_void, usize) -> CuResult;
type DtoHFn = unsafe extern "C" fn(*mut c_void, DevPtr, usize) -> CuResult;
type IpcGetFn = unsafe extern "C" fn(*mut IpcHandle, DevPtr) -> CuResult;
type IpcOpenFn = unsafe extern "C" fn(*mut DevPtr, IpcHandle, u32) -> CuResult;
type IpcCloseFn = unsafe extern "C" fn(DevPtr) -> CuResult;
type ErrorNameFn = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;
type GetProcAddressV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CuResult;

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, what the CUDA runtime passes.
const LAZY_ENABLE_PEER_ACCESS: u32 = 1;

fn die(msg: &str) -> ! {
    eprintln!("fakegpu-ipc: {msg}");
    exit(2)
}

fn dlsym(name: &str) -> *mut c_void {
    let c = std::ffi::CString::new(name).unwrap_or_else(|_| die("bad symbol name"));
    // SAFETY: RTLD_DEFAULT and a valid C string: the global scope, the preloaded agent first.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr()) }
}

struct Driver {
    init: InitFn,
    device_get: DeviceGetFn,
    ctx_retain: CtxRetainFn,
    ctx_set: CtxSetFn,
    alloc: AllocFn,
    free: FreeFn,
    htod: HtoDFn,
    dtoh: DtoHFn,
    ipc_get: IpcGetFn,
    ipc_open: IpcOpenFn,
    ipc_close: IpcCloseFn,
    error_name: ErrorNameFn,
}

/// The entry point of export name `export` (base name `base` for `cuGetProcAddress`).
fn lookup(proc: Option<GetProcAddressV2>, export: &str, base: &str) -> *mut c_void {
    let p = match proc {
        None => dlsym(export),
        Some(gpa) => {
            let c = std::ffi::CString::new(base).unwrap_or_else(|_| die("bad symbol name"));
            let mut p = std::ptr::null_mut();
            let mut status = 0;
            // SAFETY: valid C string and out pointers; CUDA 13.0 ABI, default flags.
            let rc = unsafe { gpa(c.as_ptr(), &mut p, 13000, 0, &mut status) };
            if rc != 0 {
                die(&format!("cuGetProcAddress({base}) failed: {rc}"));
            }
            p
        }
    };
    if p.is_null() {
        die(&format!("{export} not found"));
    }
    p
}

macro_rules! entry {
    ($proc:expr, $export:literal, $base:literal, $ty:ty) => {{
        let p = lookup($proc, $export, $base);
        // SAFETY: p is the driver's entry point of that name, whose C signature (CUDA 13
        // cuda.h) is $ty.
        unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
    }};
}

impl Driver {
    fn load(resolve: &str) -> Driver {
        // SAFETY: a valid C string; the handle is kept for the life of the process.
        let h =
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            die("dlopen(libcuda.so.1) failed");
        }
        let proc = match resolve {
            "dlsym" => None,
            "proc" => {
                let p = dlsym("cuGetProcAddress_v2");
                if p.is_null() {
                    die("cuGetProcAddress_v2 not found");
                }
                // SAFETY: the driver's cuGetProcAddress_v2, of this C signature.
                Some(unsafe { std::mem::transmute::<*mut c_void, GetProcAddressV2>(p) })
            }
            other => die(&format!("--resolve {other}: dlsym or proc")),
        };
        Driver {
            init: entry!(proc, "cuInit", "cuInit", InitFn),
            device_get: entry!(proc, "cuDeviceGet", "cuDeviceGet", DeviceGetFn),
            ctx_retain: entry!(
                proc,
                "cuDevicePrimaryCtxRetain",
                "cuDevicePrimaryCtxRetain",
                CtxRetainFn
            ),
            ctx_set: entry!(proc, "cuCtxSetCurrent", "cuCtxSetCurrent", CtxSetFn),
            alloc: entry!(proc, "cuMemAlloc_v2", "cuMemAlloc", AllocFn),
            free: entry!(proc, "cuMemFree_v2", "cuMemFree", FreeFn),
            htod: entry!(proc, "cuMemcpyHtoD_v2", "cuMemcpyHtoD", HtoDFn),
            dtoh: entry!(proc, "cuMemcpyDtoH_v2", "cuMemcpyDtoH", DtoHFn),
            ipc_get: entry!(proc, "cuIpcGetMemHandle", "cuIpcGetMemHandle", IpcGetFn),
            ipc_open: entry!(
                proc,
                "cuIpcOpenMemHandle_v2",
                "cuIpcOpenMemHandle",
                IpcOpenFn
            ),
            ipc_close: entry!(
                proc,
                "cuIpcCloseMemHandle",
                "cuIpcCloseMemHandle",
                IpcCloseFn
            ),
            error_name: entry!(proc, "cuGetErrorName", "cuGetErrorName", ErrorNameFn),
        }
    }

    fn name(&self, rc: CuResult) -> String {
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: a valid out pointer; the driver writes a static string or fails.
        if unsafe { (self.error_name)(rc, &mut s) } == 0 && !s.is_null() {
            // SAFETY: a static NUL-terminated string of the driver.
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        } else {
            format!("CUDA error {rc}")
        }
    }

    /// cuInit and device 0's primary context, current on this thread.
    fn start(&self) {
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: plain calls with valid out pointers.
        let rc = unsafe {
            let mut rc = (self.init)(0);
            if rc == 0 {
                rc = (self.device_get)(&mut dev, 0);
            }
            if rc == 0 {
                rc = (self.ctx_retain)(&mut ctx, dev);
            }
            if rc == 0 {
                rc = (self.ctx_set)(ctx);
            }
            rc
        };
        if rc != 0 {
            die(&format!("CUDA start-up failed: {}", self.name(rc)));
        }
    }

    fn read(&self, p: DevPtr, len: usize) -> Result<Vec<u8>, String> {
        let mut v = vec![0u8; len];
        // SAFETY: v is len writable bytes.
        let rc = unsafe { (self.dtoh)(v.as_mut_ptr().cast(), p, len) };
        if rc != 0 {
            return Err(self.name(rc));
        }
        Ok(v)
    }

    fn write(&self, p: DevPtr, data: &[u8]) -> CuResult {
        // SAFETY: data is readable for its length.
        unsafe { (self.htod)(p, data.as_ptr().cast(), data.len()) }
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

const EXPORTER_SEED: u8 = 0x11;
const IMPORTER_SEED: u8 = 0x77;

fn report(key: &str, value: impl std::fmt::Display) {
    println!("{key} {value}");
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 64]> {
    let mut out = [0u8; 64];
    if s.len() != 128 {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// `--name value` options after the role.
struct Args(Vec<String>);

impl Args {
    fn value(&self, name: &str) -> Option<&str> {
        let i = self.0.iter().position(|a| a == name)?;
        Some(
            self.0
                .get(i + 1)
                .unwrap_or_else(|| die(&format!("{name} needs a value"))),
        )
    }
    fn number(&self, name: &str, default: u64) -> u64 {
        self.value(name).map_or(default, |v| {
            v.parse()
                .unwrap_or_else(|_| die(&format!("{name} {v}: not a number")))
        })
    }
    fn flag(&self, name: &str) -> bool {
        self.0.iter().any(|a| a == name)
    }
}

fn export(args: &Args) {
    let bytes = args.number("--bytes", 8 << 20) as usize;
    let offset = args.number("--offset", 0);
    let resolve = args.value("--resolve").unwrap_or("dlsym");
    let drv = Driver::load(resolve);
    drv.start();
    let mut base: DevPtr = 0;
    // SAFETY: a valid out pointer.
    let rc = unsafe { (drv.alloc)(&mut base, bytes) };
    if rc != 0 {
        die(&format!("cuMemAlloc({bytes}): {}", drv.name(rc)));
    }
    let rc = drv.write(base, &pattern(EXPORTER_SEED, bytes));
    if rc != 0 {
        die(&format!("cuMemcpyHtoD: {}", drv.name(rc)));
    }
    let mut h = IpcHandle { reserved: [0; 64] };
    // SAFETY: a valid out pointer; the pointer lies in the allocation (or is the test's choice).
    let rc = unsafe { (drv.ipc_get)(&mut h, base + offset) };
    report("get", drv.name(rc));
    if rc != 0 {
        return;
    }
    if args.flag("--self-open") {
        let mut p = 0;
        // SAFETY: a valid out pointer, the handle by value.
        let rc = unsafe { (drv.ipc_open)(&mut p, h, LAZY_ENABLE_PEER_ACCESS) };
        report("self-open", drv.name(rc));
    }
    let freed = args.flag("--free-first");
    if freed {
        // SAFETY: the allocation made above, freed once.
        report("free", drv.name(unsafe { (drv.free)(base) }));
    }
    if let Some(hold) = args.value("--hold") {
        // Written now; waited for after the importer's turn (see `hold`).
        std::fs::write(format!("{hold}.exporter"), std::process::id().to_string())
            .unwrap_or_else(|e| die(&format!("{hold}.exporter: {e}")));
    }
    let exe = std::env::current_exe().unwrap_or_else(|e| die(&format!("current_exe: {e}")));
    if let Some(log) = args.value("--loop") {
        // The importer is a child: the two are one tree, as a dump of the exporter sees it.
        let mut importer = Command::new(exe)
            .args(["import", "--handle", &hex(&h.reserved), "--bytes"])
            .arg(bytes.to_string())
            .args(["--resolve", resolve, "--loop", log])
            .spawn()
            .unwrap_or_else(|e| die(&format!("running the importer: {e}")));
        std::thread::spawn(move || importer.wait());
        // Reading starts once the importer has written its pattern (its first tick).
        let t0 = std::time::Instant::now();
        while !std::fs::read_to_string(format!("{log}.importer")).is_ok_and(|t| t.contains("tick "))
            && t0.elapsed() < std::time::Duration::from_secs(20)
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        tick_loop(&drv, base, bytes, &format!("{log}.exporter"), false);
    }
    let mut cmd = Command::new(exe);
    cmd.args(["import", "--handle", &hex(&h.reserved), "--bytes"])
        .arg(bytes.to_string())
        .args(["--resolve", resolve]);
    if let Some(k) = args.value("--opens") {
        cmd.args(["--opens", k]);
    }
    if let Some(hold) = args.value("--hold") {
        cmd.args(["--hold", hold]);
    }
    match args.value("--importer-preload") {
        None => {}
        Some("none") => {
            cmd.env_remove("LD_PRELOAD");
        }
        Some(p) => {
            cmd.env("LD_PRELOAD", p);
        }
    }
    if let Some(uid) = args.value("--importer-uid") {
        use std::os::unix::process::CommandExt;
        let uid: u32 = uid
            .parse()
            .unwrap_or_else(|_| die("--importer-uid: not a number"));
        cmd.uid(uid).gid(uid);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| die(&format!("running the importer: {e}")));
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        report("importer", line);
    }
    for line in String::from_utf8_lossy(&out.stderr).lines() {
        eprintln!("importer: {line}");
    }
    report("importer-exit", out.status.code().unwrap_or(-1));
    if freed {
        return;
    }
    match drv.read(base, bytes) {
        Ok(v) => report(
            "exporter-sees-importer-writes",
            v == pattern(IMPORTER_SEED, bytes),
        ),
        Err(e) => report("exporter-read", e),
    }
    // SAFETY: the allocation made above, freed once.
    report("free", drv.name(unsafe { (drv.free)(base) }));
}

fn import(args: &Args) {
    let bytes = args.number("--bytes", 0) as usize;
    let opens = args.number("--opens", 1);
    let handle = args
        .value("--handle")
        .and_then(unhex)
        .unwrap_or_else(|| die("--handle: 128 hex digits"));
    let drv = Driver::load(args.value("--resolve").unwrap_or("dlsym"));
    drv.start();
    let h = IpcHandle { reserved: handle };
    let mut first: Option<DevPtr> = None;
    for k in 0..opens {
        let mut p = 0;
        // SAFETY: a valid out pointer, the handle by value.
        let rc = unsafe { (drv.ipc_open)(&mut p, h, LAZY_ENABLE_PEER_ACCESS) };
        report(&format!("open{k}"), drv.name(rc));
        if rc == 0 {
            match first {
                None => first = Some(p),
                Some(f) => report(&format!("open{k}-same-pointer"), f == p),
            }
        }
    }
    let Some(p) = first else {
        return;
    };
    if let Some(log) = args.value("--loop") {
        let mut data = pattern(IMPORTER_SEED, bytes);
        data[..8].copy_from_slice(&0u64.to_le_bytes());
        let rc = drv.write(p, &data);
        if rc != 0 {
            die(&format!("writing the shared buffer: {}", drv.name(rc)));
        }
        tick_loop(&drv, p, bytes, &format!("{log}.importer"), true);
    }
    match drv.read(p, bytes) {
        Ok(v) => report("sees-exporter-data", v == pattern(EXPORTER_SEED, bytes)),
        Err(e) => report("read", e),
    }
    report(
        "write",
        drv.name(drv.write(p, &pattern(IMPORTER_SEED, bytes))),
    );
    if let Some(hold) = args.value("--hold") {
        hold_at(&format!("{hold}.importer"));
    }
    for k in 0..opens {
        // SAFETY: the pointer the opens returned.
        let rc = unsafe { (drv.ipc_close)(p) };
        report(&format!("close{k}"), drv.name(rc));
        if k + 1 < opens {
            // Still mapped while one open is left.
            report(
                &format!("after-close{k}-readable"),
                drv.read(p, bytes.min(4096)).is_ok(),
            );
        }
    }
    // SAFETY: as above; every open is closed now.
    report("close-extra", drv.name(unsafe { (drv.ipc_close)(p) }));
}

/// One tick every 20 ms until killed: read the buffer at `p`, check the importer's pattern past
/// the counter, and (`bump`, the importer) add 1 to the counter; a line per tick in `log`.
fn tick_loop(drv: &Driver, p: DevPtr, bytes: usize, log: &str, bump: bool) -> ! {
    use std::io::Write;
    let want = pattern(IMPORTER_SEED, bytes);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap_or_else(|e| die(&format!("{log}: {e}")));
    let _ = writeln!(f, "pid {}", std::process::id());
    let mut tick = 0u64;
    loop {
        let (counter, ok) = match drv.read(p, bytes) {
            Ok(v) => {
                let c = u64::from_le_bytes(v[..8].try_into().unwrap_or([0; 8]));
                (c, v[8..] == want[8..])
            }
            Err(e) => {
                let _ = writeln!(f, "tick {tick} error {e}");
                (0, false)
            }
        };
        if bump {
            let rc = drv.write(p, &(counter + 1).to_le_bytes());
            if rc != 0 {
                let _ = writeln!(f, "tick {tick} write-error {}", drv.name(rc));
            }
        }
        let _ = writeln!(f, "tick {tick} counter {counter} ok {}", u8::from(ok));
        tick += 1;
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Writes this pid to `path` and waits until the file is removed (at most 20 s).
fn hold_at(path: &str) {
    std::fs::write(path, std::process::id().to_string())
        .unwrap_or_else(|e| die(&format!("{path}: {e}")));
    let t0 = std::time::Instant::now();
    while std::path::Path::new(path).exists() && t0.elapsed() < std::time::Duration::from_secs(20) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    report("held", path);
}

fn main() {
    let mut argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.is_empty() {
        die("usage: fakegpu-ipc export|import [options]");
    }
    let role = argv.remove(0);
    let args = Args(argv);
    match role.as_str() {
        "export" => export(&args),
        "import" => import(&args),
        other => die(&format!("{other}: export or import")),
    }
}
