//! A stand-in for CRIU's own `amdgpu_plugin.so`, for the coexistence test: this crate's cdylib,
//! copied into CRIU's plugin directory under that name, is a CRIU plugin named
//! `amdgpu_plugin` with one hook, `DUMP_EXT_FILE`. With `GPUSNAP_TEST_FAKE_AMDGPU=claim` it
//! takes every file of the stand-in KFD's device (10:229) and logs `fake amdgpu_plugin: took
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

unsafe extern "C" fn dump_ext_file(fd: c_int, id: c_int) -> c_int {
    let claim = std::env::var("GPUSNAP_TEST_FAKE_AMDGPU").is_ok_and(|v| v == "claim");
    // SAFETY: a zeroed stat is a valid out-buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on the fd CRIU passes, into a local buffer.
    let is_standin = unsafe { libc::fstat(fd, &mut st) } == 0
        && st.st_mode & libc::S_IFMT == libc::S_IFCHR
        && st.st_rdev == libc::makedev(crate::NODE_MAJOR, crate::NODE_MINOR);
    if claim && is_standin {
        criu_log(&format!("fake amdgpu_plugin: took file {id}"));
        return 0;
    }
    -libc::ENOTSUP
}

const fn hooks() -> [*const c_void; 12] {
    let mut h = [std::ptr::null(); 12];
    h[2] = dump_ext_file as *const c_void;
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
