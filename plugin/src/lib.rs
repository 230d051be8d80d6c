//! gpusnap-plugin: the shared object CRIU loads (`gpusnap.so`), CRIU's side of gpusnap.
//!
//! The `extern "C"` functions here are thin: they catch panics (none may cross into CRIU) and
//! call [`plugin`], which holds one backend per GPU vendor for the run (`gpusnap-cuda`,
//! `gpusnap-rocm`, each a [`gpusnap_host::Backend`]) and hands each hook to them. Modules:
//! - [`plugin`]: the run's backends and the hook bodies that dispatch to them.
//!
//! What the backends share (CRIU's ABI, logging, `/proc`, ptrace, holds, pids, fault points)
//! is `gpusnap-host`; the vendors' orchestration lives in their crates.

pub mod plugin;

use gpusnap_host::criu::{self, HOOK_SLOTS, PluginDesc, hook};
use gpusnap_host::pid::HostPid;
use std::ffi::{c_int, c_void};
use std::os::fd::{BorrowedFd, IntoRawFd};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// Runs a hook body; a panic becomes `on_panic` (it must never unwind into CRIU). CRIU's
/// thread leaves every hook with a filesystem context of its own ([`own_fs_context`]).
fn guard<R>(on_panic: R, f: impl FnOnce() -> R) -> R {
    let r = catch_unwind(AssertUnwindSafe(f)).unwrap_or(on_panic);
    own_fs_context();
    r
}

/// Gives the calling thread a filesystem context (root, cwd, umask) of its own, a copy of the
/// one it had: `unshare(CLONE_FS)`.
///
/// Why: the driver library starts threads inside CRIU (at `cuInit` and later), and so do
/// gpusnap's writers; threads share the filesystem context they were created with. The kernel
/// refuses `setns` into a mount namespace (`EINVAL`) to a thread that shares it, and CRIU
/// switches into a container's mount namespace from its own thread after the device hooks (to
/// dump a tmpfs such as a container's `/dev`): without this every container checkpoint with a
/// real driver failed with `Can't setns .../mnt: Invalid argument`. Threads that already exist
/// keep the old context; CRIU's thread, and what it starts later, the copy. Nothing else
/// changes: the copy has the same root, directory and umask.
fn own_fs_context() {
    // SAFETY: unshare(CLONE_FS) touches only the calling thread's filesystem context, which it
    // copies; it takes no pointers.
    let rc = unsafe { libc::unshare(libc::CLONE_FS) };
    if rc != 0 {
        log::warn!(
            "unshare(CLONE_FS) failed: {}; CRIU may fail to enter a container's mount namespace",
            std::io::Error::last_os_error()
        );
    }
}

unsafe extern "C" fn gpusnap_init(stage: c_int) -> c_int {
    guard(-1, || plugin::init(stage))
}

unsafe extern "C" fn gpusnap_exit(_stage: c_int, ret: c_int) {
    guard((), || plugin::finish(ret))
}

unsafe extern "C" fn pause_devices(pid: c_int) -> c_int {
    guard(-1, || {
        plugin::with(plugin::ENOTSUP, |p| p.pause_devices(HostPid(pid)))
    })
}

unsafe extern "C" fn checkpoint_devices(pid: c_int) -> c_int {
    guard(-1, || {
        plugin::with(plugin::ENOTSUP, |p| p.checkpoint_devices(HostPid(pid)))
    })
}

unsafe extern "C" fn resume_devices_late(pid: c_int) -> c_int {
    guard(-1, || {
        plugin::with(plugin::ENOTSUP, |p| p.resume_devices_late(HostPid(pid)))
    })
}

unsafe extern "C" fn dump_ext_file(fd: c_int, id: c_int) -> c_int {
    guard(-1, || {
        if fd < 0 {
            return plugin::ENOTSUP;
        }
        // SAFETY: `fd` is the dumped file, open in CRIU until this hook returns; the borrow
        // ends with this closure.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        plugin::with(plugin::ENOTSUP, |p| p.dump_ext_file(fd, id))
    })
}

/// CRIU 4.1.1/4.2 call this with `(id)`; criu-dev adds a `bool *retry_needed` that we neither
/// read nor write (on older CRIU that register holds garbage).
unsafe extern "C" fn restore_ext_file(id: c_int) -> c_int {
    guard(-1, || {
        plugin::with(None, |p| p.restore_ext_file(id))
            .map_or(plugin::ENOTSUP, criu::Reopened::into_raw)
    })
}

unsafe extern "C" fn post_forking() -> c_int {
    guard(-1, || plugin::with(plugin::ENOTSUP, |p| p.post_forking()))
}

unsafe extern "C" fn handle_device_vma(fd: c_int, st: *const libc::stat) -> c_int {
    guard(plugin::ENOTSUP, || {
        if st.is_null() {
            return plugin::ENOTSUP;
        }
        // SAFETY: CRIU passes a pointer to the stat of the mapped device file.
        let (mode, rdev) = unsafe { ((*st).st_mode, (*st).st_rdev) };
        // SAFETY: `fd` is the mapped file (opened through map_files), open in CRIU until this
        // hook returns; the borrow ends with this closure.
        let fd = (fd >= 0).then(|| unsafe { BorrowedFd::borrow_raw(fd) });
        let rc = plugin::with(plugin::ENOTSUP, |p| p.handle_device_vma(fd, mode, rdev));
        if rc != plugin::ENOTSUP {
            return rc;
        }
        if gpusnap_rocm::run::explain_device_vma(rdev) {
            return plugin::ENOTSUP;
        }
        if libc::major(rdev) == NVIDIA_MAJOR {
            log::error!(
                "a process maps an NVIDIA device ({}:{}) but has no CUDA state the driver can checkpoint \
                 (e.g. it forked from a CUDA process, or uses NVML on a pre-r570 driver); it cannot be checkpointed",
                libc::major(rdev),
                libc::minor(rdev)
            );
        }
        plugin::ENOTSUP
    })
}

/// UPDATE_VMA_MAP, in a restored task: 1 with the new offset and an fd (CRIU takes it) for a
/// device mapping gpusnap recorded; -ENOTSUP (left as dumped) for any other.
unsafe extern "C" fn update_vma_map(
    path: *const std::ffi::c_char,
    addr: u64,
    old_pgoff: u64,
    new_pgoff: *mut u64,
    plugin_fd: *mut c_int,
) -> c_int {
    guard(plugin::ENOTSUP, || {
        if path.is_null() || new_pgoff.is_null() || plugin_fd.is_null() {
            return plugin::ENOTSUP;
        }
        // SAFETY: CRIU passes the mapped file's NUL-terminated path, valid for the call.
        let path = unsafe { std::ffi::CStr::from_ptr(path) }.to_string_lossy();
        match plugin::with(None, |p| p.update_vma_map(&path, addr, old_pgoff)) {
            Some((new, fd)) => {
                // SAFETY: both out-pointers are CRIU's locals, valid and writable for the call;
                // CRIU takes ownership of the fd.
                unsafe {
                    new_pgoff.write(new);
                    plugin_fd.write(fd.into_raw_fd());
                }
                1
            }
            None => plugin::ENOTSUP,
        }
    })
}

/// Character-device major of `/dev/nvidia*` (fixed by the NVIDIA driver).
const NVIDIA_MAJOR: u32 = 195;

const fn hooks() -> [*const c_void; HOOK_SLOTS] {
    let mut h = [std::ptr::null(); HOOK_SLOTS];
    h[hook::DUMP_EXT_FILE] = dump_ext_file as *const c_void;
    h[hook::RESTORE_EXT_FILE] = restore_ext_file as *const c_void;
    h[hook::HANDLE_DEVICE_VMA] = handle_device_vma as *const c_void;
    h[hook::UPDATE_VMA_MAP] = update_vma_map as *const c_void;
    h[hook::RESUME_DEVICES_LATE] = resume_devices_late as *const c_void;
    h[hook::PAUSE_DEVICES] = pause_devices as *const c_void;
    h[hook::CHECKPOINT_DEVICES] = checkpoint_devices as *const c_void;
    // Read by CRIU only when `max_hooks` is 13 (4.2+), see `set_max_hooks`.
    h[hook::POST_FORKING] = post_forking as *const c_void;
    h
}

/// The descriptor CRIU looks up with `dlsym`. `max_hooks` is set when the library loads (see
/// [`set_max_hooks`]): CRIU 4.1.1 rejects a plugin that claims more hooks than it knows.
#[unsafe(no_mangle)]
pub static mut CR_PLUGIN_DESC: PluginDesc = PluginDesc {
    name: plugin::NAME.as_ptr(),
    init: Some(gpusnap_init),
    exit: Some(gpusnap_exit),
    version: criu::PLUGIN_VERSION,
    max_hooks: criu::MAX_HOOKS_4_1,
    hooks: hooks(),
};

/// Runs during `dlopen`, before CRIU reads the descriptor.
extern "C" fn set_max_hooks() {
    let n = if criu::has_post_forking() {
        criu::MAX_HOOKS_4_2
    } else {
        criu::MAX_HOOKS_4_1
    };
    // SAFETY: runs once in the loader's constructor phase, before anything else can read the
    // descriptor; a raw-pointer write avoids creating a reference to the mutable static.
    unsafe { (&raw mut CR_PLUGIN_DESC.max_hooks).write(n) };
}

#[used]
#[unsafe(link_section = ".init_array")]
static SET_MAX_HOOKS: extern "C" fn() = set_max_hooks;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_is_wired() {
        // SAFETY: tests read the descriptor after the constructor ran; nothing writes it now.
        let d = unsafe { (&raw const CR_PLUGIN_DESC).read() };
        assert_eq!(d.version, 0x200);
        // No CRIU here: the 4.1 hook count.
        assert_eq!(d.max_hooks, 12);
        assert!(!d.hooks[hook::PAUSE_DEVICES].is_null());
        assert!(!d.hooks[hook::CHECKPOINT_DEVICES].is_null());
        assert!(!d.hooks[hook::RESUME_DEVICES_LATE].is_null());
        assert!(!d.hooks[hook::POST_FORKING].is_null());
        assert!(!d.hooks[hook::HANDLE_DEVICE_VMA].is_null());
        assert!(!d.hooks[hook::UPDATE_VMA_MAP].is_null());
        // Both lie inside the hook count of every CRIU gpusnap supports.
        assert!(hook::UPDATE_VMA_MAP < criu::MAX_HOOKS_4_1 as usize);
        assert!(d.hooks[0].is_null());
        // SAFETY: the name is a static C string.
        let name = unsafe { std::ffi::CStr::from_ptr(d.name) };
        assert_eq!(name, c"gpusnap");
    }

    #[test]
    fn leaving_a_hook_lets_the_thread_enter_a_mount_namespace_despite_other_threads() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            // setns needs CAP_SYS_ADMIN. On the real stderr (eprintln! is captured for a
            // passing test), in the form scripts/test.sh lists in its summary.
            use std::io::Write;
            let _ = std::io::stderr().write_all(
                b"gpusnap-plugin: SKIPPED leaving_a_hook_lets_the_thread_enter_a_mount_namespace_despite_other_threads: needs root (setns)\n",
            );
            return;
        }
        // In a child process, so that the test harness's threads and cwd are not involved.
        // SAFETY: the child only makes a thread, syscalls and _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = (|| {
                let ns = std::fs::File::open("/proc/self/ns/mnt").ok()?;
                let fd = std::os::fd::AsRawFd::as_raw_fd(&ns);
                // A thread that shares this one's filesystem context, as the driver's do.
                std::thread::spawn(|| std::thread::sleep(std::time::Duration::from_secs(30)));
                std::thread::sleep(std::time::Duration::from_millis(50));
                // SAFETY: setns with a namespace fd this closure owns.
                let shared = unsafe { libc::setns(fd, libc::CLONE_NEWNS) };
                let einval = std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL);
                let r = guard(0, || 7);
                // SAFETY: as above.
                let own = unsafe { libc::setns(fd, libc::CLONE_NEWNS) };
                Some(if shared == -1 && einval && r == 7 && own == 0 {
                    0
                } else {
                    1
                })
            })()
            .unwrap_or(2);
            // SAFETY: ends the child at once, without running the parent's atexit handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child made above; writes only `status`.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "setns into the mount namespace: exit {}: expected EINVAL with a shared filesystem context and success after a hook",
            libc::WEXITSTATUS(status)
        );
    }

    #[test]
    fn hooks_outside_a_run_say_not_mine() {
        // SAFETY: calling our own hooks with no plugin run active.
        unsafe {
            assert_eq!(pause_devices(1), plugin::ENOTSUP);
            assert_eq!(checkpoint_devices(1), plugin::ENOTSUP);
            assert_eq!(resume_devices_late(1), plugin::ENOTSUP);
            let (mut off, mut fd) = (7u64, -1);
            assert_eq!(
                update_vma_map(c"/dev/kfd".as_ptr(), 0x1000, 0, &mut off, &mut fd),
                plugin::ENOTSUP
            );
            assert_eq!((off, fd), (7, -1));
            assert_eq!(
                update_vma_map(std::ptr::null(), 0, 0, &mut off, &mut fd),
                plugin::ENOTSUP
            );
            // SAFETY: a zeroed stat is a valid value to pass.
            let st: libc::stat = std::mem::zeroed();
            assert_eq!(handle_device_vma(-1, &st), plugin::ENOTSUP);
            assert_eq!(handle_device_vma(-1, std::ptr::null()), plugin::ENOTSUP);
        }
    }
}
