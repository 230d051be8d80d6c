//! A stand-in for CRIU's own `amdgpu_plugin.so`, for the coexistence test: this cdylib,
//! copied into CRIU's plugin directory under that name, is a CRIU plugin named
//! `amdgpu_plugin` with one hook, `DUMP_EXT_FILE`. With `GPUSNAP_TEST_FAKE_AMDGPU=claim` it
//! takes every file and device mapping of the stand-in KFD's nodes and logs `fake amdgpu_plugin: took
//! file <id>` into CRIU's log; otherwise it takes nothing. It saves nothing: it only shows
//! which plugin CRIU gave a file to.

use std::ffi::{CString, c_char, c_int, c_uint, c_void};

/// `cr_plugin_desc_t` (CRIU 4.x): name, init, exit, version, max_hooks, hooks.
#[repr(C)]
pub struct FakePluginDesc {
    name: *const c_char,
    init: Option<unsafe extern "C" fn(c_int) -> c_int>,
    exit: Option<unsafe extern "C" fn(c_int, c_int)>,
    version: c_uint,
    max_hooks: c_uint,
    hooks: [*const c_void; 12],
}

// SAFETY: the descriptor is immutable data CRIU only reads.
unsafe impl Sync for FakePluginDesc {}

unsafe extern "C" fn init(_stage: c_int) -> c_int {
    0
}

unsafe extern "C" fn exit(_stage: c_int, _ret: c_int) {}

type PrintOnLevel = unsafe extern "C" fn(c_uint, *const c_char, ...);

fn criu_log(text: &str) {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"print_on_level".as_ptr()) };
    let Ok(line) = CString::new(format!("{text}\n")) else {
        return;
    };
    if !f.is_null() {
        // SAFETY: CRIU's print_on_level(level, fmt, ...), called with "%s" and one C string.
        unsafe {
            let f: PrintOnLevel = std::mem::transmute::<*mut c_void, PrintOnLevel>(f);
            f(3, c"%s".as_ptr(), line.as_ptr());
        }
    }
}

/// Whether `fd` is a node of the stand-in KFD (a file in its directory).
fn is_standin(fd: c_int) -> bool {
    let Some(dir) = std::env::var_os(gpusnap_rocm::kfd::standin::STANDIN_ENV) else {
        return false;
    };
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .is_ok_and(|p| p.parent() == Some(std::path::Path::new(&dir)))
}

fn claiming() -> bool {
    std::env::var("GPUSNAP_TEST_FAKE_AMDGPU").is_ok_and(|v| v == "claim")
}

unsafe extern "C" fn dump_ext_file(fd: c_int, id: c_int) -> c_int {
    if claiming() && is_standin(fd) {
        criu_log(&format!("fake amdgpu_plugin: took file {id}"));
        return 0;
    }
    -libc::ENOTSUP
}

unsafe extern "C" fn handle_device_vma(fd: c_int, _st: *const libc::stat) -> c_int {
    if claiming() && is_standin(fd) {
        criu_log("fake amdgpu_plugin: took a device mapping");
        return 0;
    }
    -libc::ENOTSUP
}

const fn hooks() -> [*const c_void; 12] {
    let mut h = [std::ptr::null(); 12];
    h[2] = dump_ext_file as *const c_void;
    h[7] = handle_device_vma as *const c_void;
    h
}

#[unsafe(no_mangle)]
pub static CR_PLUGIN_DESC: FakePluginDesc = FakePluginDesc {
    name: c"amdgpu_plugin".as_ptr(),
    init: Some(init),
    exit: Some(exit),
    version: 2 << 8,
    max_hooks: 12,
    hooks: hooks(),
};
