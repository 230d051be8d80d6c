//! `fakegpu-share`: an exporter and the importer it spawns sharing one VMM allocation through
//! shareable handles (`cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle`, POSIX
//! fds), for the checkpoint tests of such trees on the stand-in driver.
//!
//! ```text
//! fakegpu-share export --bytes N --pass scm|pidfd --loop PATH [--importer-keeps-fd]
//!                      [--detach-importer] [--importer-releases-handle] [--middleman]
//! ```
//!
//! `--middleman`: the exporter also starts `sleep 1000` holding a copy of the exported fd (a
//! process without CUDA that would pass it on); its pid goes to `PATH.middleman`.
//!
//! `--detach-importer`: the importer is started through a process that exits at once, so it is
//! no descendant of the exporter (a dump of the exporter's tree leaves it out).
//!
//! The exporter creates `N` bytes with `cuMemCreate` (POSIX-fd handle type requested), maps them
//! whole at offset 0 in a reservation of its own and exports the handle as a POSIX fd. Then:
//!
//! - `--pass scm`: the fd goes to the importer over a unix socket (`SCM_RIGHTS`) and the
//!   exporter closes its own (what most programs do);
//! - `--pass pidfd`: the exporter keeps its fd and the importer takes it with `pidfd_getfd`
//!   (PyTorch's expandable segments).
//!
//! The importer imports the fd, closes it (unless `--importer-keeps-fd`), reserves, maps the
//! handle whole, sets read-write access (and releases the handle with
//! `--importer-releases-handle`: the mapping holds the memory), writes its pattern over all but the first 8 bytes,
//! and both run until killed, one tick every 20 ms: the importer reads the buffer, checks the
//! pattern and adds 1 to the counter in its first 8 bytes; the exporter reads and checks. Each
//! appends `tick N counter C ok 0|1` to `PATH.importer` / `PATH.exporter` (after a first line
//! `pid P`): the exporter seeing the counter grow is the importer's writes reaching its memory.
//!
//! With `--pass pidfd`, whenever the file `PATH.refetch` exists the importer takes the
//! exporter's fd again (`pidfd_getfd`), imports it, maps it at a second place, compares the two
//! mappings byte for byte, logs `refetch same 0|1` (or `refetch error ...`), undoes the second
//! mapping and removes the file: the exporter's own fd still names the memory they share.
//!
//! Whenever the file `PATH.reexport` exists the exporter exports its handle again (a new fd),
//! imports that fd itself, maps it at a second place, compares the two mappings (all but the
//! counter, which it must then see the importer move through the new mapping), logs
//! `reexport same 0|1` (or `reexport error ...`), undoes it all and removes the file: an export
//! made after a checkpoint names the memory the handle maps.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::process::{Command, exit};

type CuResult = u32;
type DevPtr = u64;
type Handle = u64;

#[repr(C)]
#[derive(Clone, Copy)]
struct Location {
    type_: u32,
    id: c_int,
}

/// `CUmemAllocationProp` (32 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
struct AllocationProp {
    type_: u32,
    requested_handle_types: u32,
    location: Location,
    win32_handle_meta_data: *mut c_void,
    alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy)]
struct AccessDesc {
    location: Location,
    flags: u32,
}

const ALLOCATION_PINNED: u32 = 1;
const LOCATION_DEVICE: u32 = 1;
const HANDLE_TYPE_POSIX_FD: u32 = 1;
const ACCESS_READWRITE: u32 = 3;

type InitFn = unsafe extern "C" fn(u32) -> CuResult;
type DeviceGetFn = unsafe extern "C" fn(*mut c_int, c_int) -> CuResult;
type CtxRetainFn = unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult;
type CtxSetFn = unsafe extern "C" fn(*mut c_void) -> CuResult;
type HtoDFn = unsafe extern "C" fn(DevPtr, *const c_void, usize) -> CuResult;
type DtoHFn = unsafe extern "C" fn(*mut c_void, DevPtr, usize) -> CuResult;
type ReserveFn = unsafe extern "C" fn(*mut DevPtr, usize, usize, DevPtr, u64) -> CuResult;
type FreeAddrFn = unsafe extern "C" fn(DevPtr, usize) -> CuResult;
type CreateFn = unsafe extern "C" fn(*mut Handle, usize, *const AllocationProp, u64) -> CuResult;
type MapFn = unsafe extern "C" fn(DevPtr, usize, usize, Handle, u64) -> CuResult;
type SetAccessFn = unsafe extern "C" fn(DevPtr, usize, *const AccessDesc, usize) -> CuResult;
type UnmapFn = unsafe extern "C" fn(DevPtr, usize) -> CuResult;
type ReleaseFn = unsafe extern "C" fn(Handle) -> CuResult;
type ExportFn = unsafe extern "C" fn(*mut c_void, Handle, u32, u64) -> CuResult;
type ImportFn = unsafe extern "C" fn(*mut Handle, *mut c_void, u32) -> CuResult;
type ErrorNameFn = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;

fn die(msg: &str) -> ! {
    eprintln!("fakegpu-share: {msg}");
    exit(2)
}

fn sym(name: &str) -> *mut c_void {
    let c = std::ffi::CString::new(name).unwrap_or_else(|_| die("bad symbol name"));
    // SAFETY: RTLD_DEFAULT and a valid C string: the global scope, the preloaded agent first.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr()) };
    if p.is_null() {
        die(&format!("{name} not found"));
    }
    p
}

macro_rules! entry {
    ($name:literal, $ty:ty) => {{
        let p = sym($name);
        // SAFETY: p is the driver's entry point of that name, whose C signature (cuda.h) is $ty.
        unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
    }};
}

struct Driver {
    htod: HtoDFn,
    dtoh: DtoHFn,
    reserve: ReserveFn,
    free_addr: FreeAddrFn,
    create: CreateFn,
    map: MapFn,
    set_access: SetAccessFn,
    unmap: UnmapFn,
    release: ReleaseFn,
    export: ExportFn,
    import: ImportFn,
    error_name: ErrorNameFn,
}

impl Driver {
    /// Loads libcuda, starts device 0's primary context on this thread.
    fn start() -> Driver {
        // SAFETY: a valid C string; the handle is kept for the life of the process.
        let h =
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            die("dlopen(libcuda.so.1) failed");
        }
        let init: InitFn = entry!("cuInit", InitFn);
        let device_get: DeviceGetFn = entry!("cuDeviceGet", DeviceGetFn);
        let ctx_retain: CtxRetainFn = entry!("cuDevicePrimaryCtxRetain", CtxRetainFn);
        let ctx_set: CtxSetFn = entry!("cuCtxSetCurrent", CtxSetFn);
        let d = Driver {
            htod: entry!("cuMemcpyHtoD_v2", HtoDFn),
            dtoh: entry!("cuMemcpyDtoH_v2", DtoHFn),
            reserve: entry!("cuMemAddressReserve", ReserveFn),
            free_addr: entry!("cuMemAddressFree", FreeAddrFn),
            create: entry!("cuMemCreate", CreateFn),
            map: entry!("cuMemMap", MapFn),
            set_access: entry!("cuMemSetAccess", SetAccessFn),
            unmap: entry!("cuMemUnmap", UnmapFn),
            release: entry!("cuMemRelease", ReleaseFn),
            export: entry!("cuMemExportToShareableHandle", ExportFn),
            import: entry!("cuMemImportFromShareableHandle", ImportFn),
            error_name: entry!("cuGetErrorName", ErrorNameFn),
        };
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: plain calls with valid out pointers.
        let rc = unsafe {
            let mut rc = init(0);
            if rc == 0 {
                rc = device_get(&mut dev, 0);
            }
            if rc == 0 {
                rc = ctx_retain(&mut ctx, dev);
            }
            if rc == 0 {
                rc = ctx_set(ctx);
            }
            rc
        };
        d.check("CUDA start-up", rc);
        d
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

    fn check(&self, what: &str, rc: CuResult) {
        if rc != 0 {
            die(&format!("{what}: {}", self.name(rc)));
        }
    }

    fn try_call(&self, what: &str, rc: CuResult) -> Result<(), String> {
        if rc == 0 {
            Ok(())
        } else {
            Err(format!("{what}: {}", self.name(rc)))
        }
    }

    /// Reserves `bytes` and maps `h` there whole, read-write for device 0.
    fn map_whole(&self, h: Handle, bytes: usize) -> Result<DevPtr, String> {
        let mut p: DevPtr = 0;
        // SAFETY: valid out pointer; no alignment or address wish.
        self.try_call("cuMemAddressReserve", unsafe {
            (self.reserve)(&mut p, bytes, 0, 0, 0)
        })?;
        // SAFETY: p..p+bytes is our reservation, h a live handle of that size.
        self.try_call("cuMemMap", unsafe { (self.map)(p, bytes, 0, h, 0) })?;
        let desc = AccessDesc {
            location: Location {
                type_: LOCATION_DEVICE,
                id: 0,
            },
            flags: ACCESS_READWRITE,
        };
        // SAFETY: the range is mapped; one valid descriptor.
        self.try_call("cuMemSetAccess", unsafe {
            (self.set_access)(p, bytes, &desc, 1)
        })?;
        Ok(p)
    }

    fn import(&self, fd: RawFd) -> Result<Handle, String> {
        let mut h: Handle = 0;
        // SAFETY: valid out pointer; the POSIX fd is passed as the pointer's value (cuda.h).
        self.try_call("cuMemImportFromShareableHandle", unsafe {
            (self.import)(&mut h, fd as usize as *mut c_void, HANDLE_TYPE_POSIX_FD)
        })?;
        Ok(h)
    }

    fn read(&self, p: DevPtr, len: usize) -> Result<Vec<u8>, String> {
        let mut v = vec![0u8; len];
        // SAFETY: v is len writable bytes.
        self.try_call("cuMemcpyDtoH", unsafe {
            (self.dtoh)(v.as_mut_ptr().cast(), p, len)
        })?;
        Ok(v)
    }

    fn write(&self, p: DevPtr, data: &[u8]) -> Result<(), String> {
        // SAFETY: data is readable for its length.
        self.try_call("cuMemcpyHtoD", unsafe {
            (self.htod)(p, data.as_ptr().cast(), data.len())
        })
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ 0x5a)
        .collect()
}

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

/// Sends `fd` over the stream socket `sock` with `SCM_RIGHTS` (one byte of data).
fn send_fd(sock: RawFd, fd: RawFd) {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE of one int is a constant computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<c_int>() as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: msghdr is plain data; all zeros is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: the control buffer holds one header of CMSG_SPACE(int) bytes, written in place.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<c_int>() as u32) as usize;
        libc::CMSG_DATA(c).cast::<c_int>().write_unaligned(fd);
    }
    // SAFETY: msg points to live buffers.
    if unsafe { libc::sendmsg(sock, &msg, 0) } != 1 {
        die(&format!("sendmsg: {}", std::io::Error::last_os_error()));
    }
}

/// Receives one fd sent by [`send_fd`].
fn recv_fd(sock: RawFd) -> OwnedFd {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: a constant computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<c_int>() as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: plain data, zeroed.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: msg points to live buffers.
    if unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) } != 1 {
        die(&format!("recvmsg: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: the kernel filled the control buffer; the first header, if any, is ours.
    let fd = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null() || (*c).cmsg_type != libc::SCM_RIGHTS {
            die("no descriptor received");
        }
        libc::CMSG_DATA(c).cast::<c_int>().read_unaligned()
    };
    // SAFETY: a new descriptor the kernel installed for us.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// `pidfd_getfd` of `pid`'s fd `fd` (PyTorch's way of taking an exporter's fd).
fn take_fd(pid: i32, fd: RawFd) -> Result<OwnedFd, String> {
    // SAFETY: pidfd_open(pid, 0) returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as c_int;
    if pidfd < 0 {
        return Err(format!("pidfd_open: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a new descriptor, owned here.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    // SAFETY: pidfd_getfd(pidfd, fd, 0) returns a new descriptor or -1.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) } as c_int;
    if got < 0 {
        return Err(format!("pidfd_getfd: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a new descriptor, owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(got) })
}

/// One line in one `write` (an append of a few bytes): a reader never sees half of it.
fn log_line(f: &mut std::fs::File, line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = f.write_all(format!("{line}\n").as_bytes());
}

fn open_log(path: &str) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| die(&format!("{path}: {e}")))
}

fn export(args: &Args) {
    let bytes = args.number("--bytes", 8 << 20) as usize;
    let pass = args.value("--pass").unwrap_or("scm").to_owned();
    let log = args
        .value("--loop")
        .unwrap_or_else(|| die("--loop PATH"))
        .to_owned();
    let drv = Driver::start();
    let prop = AllocationProp {
        type_: ALLOCATION_PINNED,
        requested_handle_types: HANDLE_TYPE_POSIX_FD,
        location: Location {
            type_: LOCATION_DEVICE,
            id: 0,
        },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: [0; 8],
    };
    let mut h: Handle = 0;
    // SAFETY: valid out pointer and property struct.
    drv.check("cuMemCreate", unsafe {
        (drv.create)(&mut h, bytes, &prop, 0)
    });
    let base = drv.map_whole(h, bytes).unwrap_or_else(|e| die(&e));
    let mut fd: c_int = -1;
    // SAFETY: for POSIX fds the out parameter is an int.
    drv.check("cuMemExportToShareableHandle", unsafe {
        (drv.export)((&raw mut fd).cast(), h, HANDLE_TYPE_POSIX_FD, 0)
    });
    if args.flag("--middleman") {
        // A process without CUDA that holds a copy of the exported fd (one that would pass it
        // on): `sleep`, the fd inherited at exec. Its pid goes to PATH.middleman.
        // SAFETY: F_DUPFD (no CLOEXEC) of the exported fd, so the child inherits the copy.
        let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD, 0) };
        if copy < 0 {
            die(&format!("dup: {}", std::io::Error::last_os_error()));
        }
        let mut sleeper = Command::new("sleep")
            .arg("1000")
            .env_remove("LD_PRELOAD")
            .spawn()
            .unwrap_or_else(|e| die(&format!("running the middleman: {e}")));
        // SAFETY: our copy, closed once (the child has its own).
        unsafe { libc::close(copy) };
        std::fs::write(format!("{log}.middleman"), sleeper.id().to_string())
            .unwrap_or_else(|e| die(&format!("{log}.middleman: {e}")));
        std::thread::spawn(move || sleeper.wait());
    }
    let exe = std::env::current_exe().unwrap_or_else(|e| die(&format!("current_exe: {e}")));
    let mut cmd = Command::new(exe);
    if args.flag("--detach-importer") {
        // Through a process that exits at once: the importer is no descendant of ours.
        cmd.arg("detach");
    }
    cmd.args(["import", "--bytes", &bytes.to_string(), "--loop", &log]);
    if args.flag("--importer-keeps-fd") {
        cmd.arg("--keep-fd");
    }
    if args.flag("--importer-releases-handle") {
        cmd.arg("--release-handle");
    }
    let mut sock_mine = None;
    if pass == "pidfd" {
        // The importer (our child) takes the fd with pidfd_getfd: let it, whatever Yama says.
        // SAFETY: prctl with plain integer arguments.
        unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
        cmd.args([
            "--from-pid",
            &std::process::id().to_string(),
            "--from-fd",
            &fd.to_string(),
        ]);
    } else {
        let mut pair = [0 as c_int; 2];
        let kind = libc::SOCK_STREAM | libc::SOCK_CLOEXEC;
        // SAFETY: a valid out array of two ints.
        if unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, pair.as_mut_ptr()) } != 0 {
            die(&format!("socketpair: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: F_SETFD on the child's end, so that it (alone) is inherited at exec.
        unsafe { libc::fcntl(pair[1], libc::F_SETFD, 0) };
        // SAFETY: two new descriptors, owned here (the child's end is inherited: no CLOEXEC).
        let (mine, theirs) =
            unsafe { (OwnedFd::from_raw_fd(pair[0]), OwnedFd::from_raw_fd(pair[1])) };
        cmd.args(["--sock", &theirs.as_raw_fd().to_string()]);
        sock_mine = Some((mine, theirs));
    }
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| die(&format!("running the importer: {e}")));
    if let Some((mine, theirs)) = sock_mine {
        drop(theirs);
        send_fd(mine.as_raw_fd(), fd);
        drop(mine);
        // The importer has its own now.
        // SAFETY: the fd the export returned, closed once.
        unsafe { libc::close(fd) };
    }
    std::thread::spawn(move || child.wait());
    let t0 = std::time::Instant::now();
    while !std::fs::read_to_string(format!("{log}.importer")).is_ok_and(|t| t.contains("tick "))
        && t0.elapsed() < std::time::Duration::from_secs(20)
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let reexport = Again::Reexport(h, format!("{log}.reexport"));
    tick_loop(
        &drv,
        base,
        bytes,
        &format!("{log}.exporter"),
        false,
        reexport,
    );
}

/// What a tick loop does again when its trigger file appears.
enum Again {
    Nothing,
    /// The importer: take the exporter's fd again (pid, fd number).
    Refetch((i32, RawFd), String),
    /// The exporter: export its handle again.
    Reexport(Handle, String),
}

/// A new export of `h`, imported here and mapped at a second place: whether it holds what the
/// mapping at `p` holds.
fn reexport(drv: &Driver, h: Handle, p: DevPtr, bytes: usize) -> Result<bool, String> {
    let mut fd: c_int = -1;
    // SAFETY: for POSIX fds the out parameter is an int.
    let rc = unsafe { (drv.export)((&raw mut fd).cast(), h, HANDLE_TYPE_POSIX_FD, 0) };
    if rc != 0 {
        return Err(format!("cuMemExportToShareableHandle: CUDA error {rc}"));
    }
    // SAFETY: the descriptor the export just returned, owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let again = drv.import(fd.as_raw_fd())?;
    drop(fd);
    let q = drv.map_whole(again, bytes)?;
    // The importer bumps the counter (the first 8 bytes) meanwhile: compare the rest, and see
    // the counter through the new mapping move when the importer writes through the old one.
    let (a, b) = (drv.read(p, bytes)?, drv.read(q, bytes)?);
    let mut same = a[8..] == b[8..];
    if same {
        let c = |v: &[u8]| u64::from_le_bytes(v[..8].try_into().unwrap_or([0; 8]));
        let t0 = std::time::Instant::now();
        let start = c(&drv.read(q, bytes)?);
        same = loop {
            if c(&drv.read(q, 8)?) != start {
                break true;
            }
            if t0.elapsed() > std::time::Duration::from_secs(5) {
                break false;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
    }
    // SAFETY: the mapping and reservation made just above, undone once.
    unsafe {
        (drv.unmap)(q, bytes);
        (drv.free_addr)(q, bytes);
        (drv.release)(again);
    }
    Ok(same)
}

fn import(args: &Args) {
    let bytes = args.number("--bytes", 0) as usize;
    let log = args
        .value("--loop")
        .unwrap_or_else(|| die("--loop PATH"))
        .to_owned();
    let from = args.value("--from-pid").map(|p| {
        (
            p.parse::<i32>().unwrap_or(0),
            args.number("--from-fd", 0) as RawFd,
        )
    });
    let fd = match (from, args.value("--sock")) {
        (Some((pid, fd)), _) => take_fd(pid, fd).unwrap_or_else(|e| die(&e)),
        (None, Some(s)) => {
            let s: RawFd = s.parse().unwrap_or_else(|_| die("--sock: not a number"));
            // SAFETY: the socket the exporter left open for us at exec.
            let sock = unsafe { OwnedFd::from_raw_fd(s) };
            recv_fd(sock.as_raw_fd())
        }
        _ => die("--from-pid P --from-fd F, or --sock S"),
    };
    let drv = Driver::start();
    let h = drv.import(fd.as_raw_fd()).unwrap_or_else(|e| die(&e));
    if args.flag("--keep-fd") {
        std::mem::forget(fd);
    } else {
        drop(fd);
    }
    let p = drv.map_whole(h, bytes).unwrap_or_else(|e| die(&e));
    if args.flag("--release-handle") {
        // The mapping holds the memory by itself, as in CUDA.
        // SAFETY: the handle imported above, released once.
        drv.check("cuMemRelease", unsafe { (drv.release)(h) });
    }
    let mut data = pattern(bytes);
    data[..8].copy_from_slice(&0u64.to_le_bytes());
    drv.write(p, &data).unwrap_or_else(|e| die(&e));
    let again = match from {
        Some(f) => Again::Refetch(f, format!("{log}.refetch")),
        None => Again::Nothing,
    };
    tick_loop(&drv, p, bytes, &format!("{log}.importer"), true, again);
}

/// The exporter's fd taken again, imported and mapped at a second place: whether it holds what
/// the mapping at `p` holds.
fn refetch(drv: &Driver, (pid, fd): (i32, RawFd), p: DevPtr, bytes: usize) -> Result<bool, String> {
    let got = take_fd(pid, fd)?;
    let h = drv.import(got.as_raw_fd())?;
    drop(got);
    let q = drv.map_whole(h, bytes)?;
    let same = drv.read(p, bytes)? == drv.read(q, bytes)?;
    // The counter may have moved between the two reads only through our own writes (none).
    // SAFETY: the mapping and reservation made just above, undone once.
    unsafe {
        (drv.unmap)(q, bytes);
        (drv.free_addr)(q, bytes);
        (drv.release)(h);
    }
    Ok(same)
}

/// One tick every 20 ms until killed (see the module's comment).
fn tick_loop(drv: &Driver, p: DevPtr, bytes: usize, log: &str, bump: bool, again: Again) -> ! {
    let want = pattern(bytes);
    let mut f = open_log(log);
    log_line(&mut f, format_args!("pid {}", std::process::id()));
    let mut tick = 0u64;
    loop {
        match &again {
            Again::Refetch(from, trigger) if std::path::Path::new(trigger).exists() => {
                match refetch(drv, *from, p, bytes) {
                    Ok(same) => log_line(&mut f, format_args!("refetch same {}", u8::from(same))),
                    Err(e) => log_line(&mut f, format_args!("refetch error {e}")),
                }
                let _ = std::fs::remove_file(trigger);
            }
            Again::Reexport(h, trigger) if std::path::Path::new(trigger).exists() => {
                match reexport(drv, *h, p, bytes) {
                    Ok(same) => log_line(&mut f, format_args!("reexport same {}", u8::from(same))),
                    Err(e) => log_line(&mut f, format_args!("reexport error {e}")),
                }
                let _ = std::fs::remove_file(trigger);
            }
            _ => {}
        }
        let (counter, ok) = match drv.read(p, bytes) {
            Ok(v) => {
                let c = u64::from_le_bytes(v[..8].try_into().unwrap_or([0; 8]));
                (c, v[8..] == want[8..])
            }
            Err(e) => {
                log_line(&mut f, format_args!("tick {tick} error {e}"));
                (0, false)
            }
        };
        if bump && let Err(e) = drv.write(p, &(counter + 1).to_le_bytes()) {
            log_line(&mut f, format_args!("tick {tick} write-error {e}"));
        }
        log_line(
            &mut f,
            format_args!("tick {tick} counter {counter} ok {}", u8::from(ok)),
        );
        tick += 1;
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn main() {
    let mut argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.is_empty() {
        die("usage: fakegpu-share export|import [options]");
    }
    let role = argv.remove(0);
    let args = Args(argv);
    match role.as_str() {
        "export" => export(&args),
        "import" => import(&args),
        "detach" => {
            let exe = std::env::current_exe().unwrap_or_else(|e| die(&format!("current_exe: {e}")));
            // Exits at once without waiting: the importer is re-parented away from the
            // exporter's tree (the point of `detach`).
            let child = Command::new(exe)
                .args(&args.0)
                .spawn()
                .unwrap_or_else(|e| die(&format!("running the importer: {e}")));
            std::mem::forget(child);
        }
        other => die(&format!("{other}: export or import")),
    }
}
