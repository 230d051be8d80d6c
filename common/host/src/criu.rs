//! CRIU's side of the ABI: the plugin descriptor, hook numbers, and the functions and globals
//! CRIU exports, all looked up at run time.
//!
//! A Rust cdylib is linked with BIND_NOW, so any symbol it imports that the host `criu` lacks
//! makes `dlopen` fail and aborts the dump. Nothing here is imported at link time: everything is
//! found with `dlsym(RTLD_DEFAULT, ..)`, and a missing symbol degrades to a documented fallback.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

/// `CRIU_PLUGIN_VERSION` 0.2.0, the value every CRIU from 4.0 to 4.2 accepts.
pub const PLUGIN_VERSION: c_uint = 2 << 8;
/// Hook slots we fill: up to `POST_FORKING` (12) inclusive.
pub const HOOK_SLOTS: usize = 13;
/// `CR_PLUGIN_HOOK__MAX` of CRIU 4.0..4.1.1; 4.2 added `POST_FORKING`.
pub const MAX_HOOKS_4_1: c_uint = 12;
pub const MAX_HOOKS_4_2: c_uint = 13;

/// Hook numbers (`enum cr_plugin_hook`).
pub mod hook {
    pub const DUMP_EXT_FILE: usize = 2;
    pub const RESTORE_EXT_FILE: usize = 3;
    pub const HANDLE_DEVICE_VMA: usize = 7;
    /// `int(const char *path, uint64_t addr, uint64_t old_pgoff, uint64_t *new_pgoff,
    /// int *plugin_fd)`, in the restored task (since CRIU 3.17, inside every `max_hooks` gpusnap
    /// sets). CRIU 4.1 and 4.2 use the answer only when it is 1, and then take ownership of
    /// `*plugin_fd` when it is >= 0; other answers leave the mapping as dumped.
    pub const UPDATE_VMA_MAP: usize = 8;
    pub const RESUME_DEVICES_LATE: usize = 9;
    pub const PAUSE_DEVICES: usize = 10;
    pub const CHECKPOINT_DEVICES: usize = 11;
    pub const POST_FORKING: usize = 12;
}

/// `enum cr_plugin_stage`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Dump,
    PreDump,
    Restore,
}

impl Stage {
    pub fn from_raw(s: c_int) -> Option<Self> {
        match s {
            0 => Some(Self::Dump),
            1 => Some(Self::PreDump),
            2 => Some(Self::Restore),
            _ => None,
        }
    }
}

/// `cr_plugin_desc_t` of `criu/include/criu-plugin.h`.
#[repr(C)]
pub struct PluginDesc {
    pub name: *const c_char,
    pub init: Option<unsafe extern "C" fn(c_int) -> c_int>,
    pub exit: Option<unsafe extern "C" fn(c_int, c_int)>,
    pub version: c_uint,
    pub max_hooks: c_uint,
    pub hooks: [*const c_void; HOOK_SLOTS],
}

/// CRIU log levels (`compel/loglevels.h`).
pub mod level {
    pub const ERROR: u32 = 1;
    pub const WARN: u32 = 2;
    pub const INFO: u32 = 3;
    pub const DEBUG: u32 = 4;
}

fn sym(name: &CStr) -> *mut c_void {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name has no preconditions.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

macro_rules! criu_fn {
    ($vis:vis fn $fn_name:ident = $sym:literal : $ty:ty) => {
        $vis fn $fn_name() -> Option<$ty> {
            static F: OnceLock<usize> = OnceLock::new();
            let p = *F.get_or_init(|| sym($sym) as usize);
            // SAFETY: `p` is CRIU's exported function of that C name; `$ty` is its C signature
            // in every CRIU version that exports it (4.0..4.2).
            (p != 0).then(|| unsafe { std::mem::transmute::<usize, $ty>(p) })
        }
    };
}

pub type PrintOnLevel = unsafe extern "C" fn(c_uint, *const c_char, ...);
criu_fn!(pub fn print_on_level = c"print_on_level": PrintOnLevel);
criu_fn!(pub fn log_get_loglevel = c"log_get_loglevel": unsafe extern "C" fn() -> c_uint);
criu_fn!(pub fn log_get_fd = c"log_get_fd": unsafe extern "C" fn() -> c_int);
criu_fn!(fn image_dir_fn = c"criu_get_image_dir": unsafe extern "C" fn() -> c_int);
criu_fn!(fn add_inventory_fn = c"add_inventory_plugin": unsafe extern "C" fn(*const c_char) -> c_int);
criu_fn!(fn check_inventory_fn = c"check_and_remove_inventory_plugin": unsafe extern "C" fn(*const c_char, usize) -> bool);
criu_fn!(fn interrupt_only_fn = c"set_compel_interrupt_only_mode": unsafe extern "C" fn());
criu_fn!(fn alarm_timeouted_fn = c"alarm_timeouted": unsafe extern "C" fn() -> bool);

/// `RESTORE_EXT_FILE`'s answer for a file gpusnap recorded: the reopened file (CRIU takes it)
/// or a failure (already logged).
#[derive(Debug)]
pub enum Reopened {
    Fd(std::os::fd::OwnedFd),
    Failed,
}

impl Reopened {
    /// The hook's return value: the fd, given up to CRIU, or -1.
    pub fn into_raw(self) -> c_int {
        match self {
            Reopened::Fd(fd) => std::os::fd::IntoRawFd::into_raw_fd(fd),
            Reopened::Failed => -1,
        }
    }
}

/// The plugin's name: in its descriptor and in the image's plugin inventory.
pub const PLUGIN_NAME: &CStr = c"gpusnap";

/// True when running inside a `criu` binary (its logging function is there).
pub fn inside_criu() -> bool {
    print_on_level().is_some() && image_dir_fn().is_some()
}

/// The image directory (`criu_get_image_dir()`), a service fd of CRIU's. Fetched once per run,
/// by `plugin::init` in CRIU's process (the runs hold it), and once per call of a hook that runs
/// in a restored task (`RESTORE_EXT_FILE`): CRIU moves its service fds to other numbers in
/// each restored task, so the number fetched at init is not the task's.
pub fn image_dir() -> Option<std::os::fd::BorrowedFd<'static>> {
    // SAFETY: CRIU's function takes no arguments and returns a service fd.
    let fd = image_dir_fn()
        .map(|f| unsafe { f() })
        .filter(|fd| *fd >= 0)?;
    // SAFETY: CRIU keeps its image-directory service fd open for the whole run, in its own
    // process and in restored tasks, and gpusnap never closes it; the plugin is unloaded before
    // CRIU exits, so nothing of ours outlives it.
    Some(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })
}

/// Registers `name` in the image inventory. `false` on CRIU 4.0, which has no plugin list.
pub fn add_inventory_plugin(name: &CStr) -> bool {
    // SAFETY: CRIU copies the string; `name` is NUL-terminated.
    add_inventory_fn().is_some_and(|f| unsafe { f(name.as_ptr()) } == 0)
}

/// At restore: does the inventory list `name`? `None` on CRIU 4.0 (no list; all plugins apply).
pub fn check_and_remove_inventory_plugin(name: &CStr) -> Option<bool> {
    // SAFETY: `name` is NUL-terminated and its length is passed without the NUL.
    check_inventory_fn().map(|f| unsafe { f(name.as_ptr(), name.to_bytes().len()) })
}

/// Asks CRIU to seize with ptrace instead of freezing the cgroup (driver calls must run while
/// the other threads are stopped). Returns whether this CRIU has the switch.
pub fn set_compel_interrupt_only_mode() -> bool {
    interrupt_only_fn()
        // SAFETY: no arguments, sets a CRIU global.
        .map(|f| unsafe { f() })
        .is_some()
}

/// Whether CRIU's SIGALRM timeout for seizing has fired.
pub fn alarm_timeouted() -> bool {
    // SAFETY: no arguments, reads a CRIU global.
    alarm_timeouted_fn().is_some_and(|f| unsafe { f() })
}

/// Is this CRIU 4.1 or newer? (The plugin-inventory API arrived in 4.1; gpusnap needs 4.1's
/// `opts` layout to tell `-R`, and the inventory to mark images with GPU state.)
pub fn is_4_1_or_newer() -> bool {
    add_inventory_fn().is_some()
}

/// Is this CRIU 4.2 or newer? (`found_uprobes_vma` arrived together with `POST_FORKING`.)
pub fn has_post_forking() -> bool {
    !sym(c"found_uprobes_vma").is_null()
}

/// Does this CRIU thaw a cgroup frozen before the dump ahead of its `PAUSE_DEVICES` hook? CRIU
/// 4.1.x runs `PAUSE_DEVICES` for the dump's first process before it thaws the cgroup that
/// `--freeze-cgroup` names (`collect_pstree` in `criu/seize.c`), the other processes' after; 4.2
/// thaws first (CRIU commit fddca67cc, "seize: fix pause devices for frozen containers"). Told
/// by 4.2's exports, as [`has_post_forking`].
pub fn thaws_before_pause_devices() -> bool {
    has_post_forking()
}

/// CRIU's release series, as far as its exports tell (CRIU exports no version string), for
/// messages: "4.2 or later", "4.1" or "older than 4.1".
pub fn series() -> &'static str {
    if has_post_forking() {
        "4.2 or later"
    } else if is_4_1_or_newer() {
        "4.1"
    } else {
        "older than 4.1"
    }
}

/// Fields of CRIU's `struct cr_options` that are stable from 4.0 to criu-dev (x86_64).
const OPTS_FINAL_STATE: usize = 0;
const OPTS_TIMEOUT: usize = 352;
/// `TASK_ALIVE` in `opts.final_state`: `-R` / leave-running.
const TASK_ALIVE: c_int = 1;

/// CRIU's `opts`, only behind a version check: the plugin-inventory API marks CRIU >= 4.1,
/// whose `opts` layout we know.
fn opts_base() -> Option<*mut u8> {
    add_inventory_fn()?;
    let base = sym(c"opts");
    (!base.is_null()).then(|| base.cast::<u8>())
}

fn opts_field<T: Copy>(offset: usize) -> Option<T> {
    let base = opts_base()?;
    // SAFETY: `opts` is CRIU's global `struct cr_options` (0x1f8 bytes in 4.1.1); the offsets
    // above lie inside it for every version that has the inventory API.
    Some(unsafe { std::ptr::read_unaligned(base.add(offset).cast::<T>()) })
}

/// `criu dump -R` (leave running), read from `opts.final_state`.
pub fn leave_running() -> bool {
    opts_field::<c_int>(OPTS_FINAL_STATE) == Some(TASK_ALIVE)
}

/// Makes CRIU leave the dumped tasks alive when it ends the dump (`opts.final_state =
/// TASK_ALIVE`, what `-R` sets), for a dump whose device data could not be written after
/// CRIU's own part had succeeded: `exit` cannot fail the dump, but the job must not be killed
/// with its data nowhere. Returns whether it was set.
pub fn keep_tasks_alive() -> bool {
    let Some(base) = opts_base() else {
        return false;
    };
    // SAFETY: as in `opts_field`: `final_state` is the int at offset 0 of CRIU's `opts` for
    // every version with the inventory API; CRIU reads it only after `exit` returns, on this
    // (its main) thread.
    unsafe { std::ptr::write_unaligned(base.add(OPTS_FINAL_STATE).cast::<c_int>(), TASK_ALIVE) };
    true
}

/// CRIU's `--timeout` in seconds (default 10), if it can be read.
pub fn timeout_s() -> Option<u32> {
    opts_field::<c_uint>(OPTS_TIMEOUT).filter(|t| (1..=86_400).contains(t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn descriptor_layout_matches_criu_plugin_h() {
        assert_eq!(offset_of!(PluginDesc, name), 0);
        assert_eq!(offset_of!(PluginDesc, init), 8);
        assert_eq!(offset_of!(PluginDesc, exit), 16);
        assert_eq!(offset_of!(PluginDesc, version), 24);
        assert_eq!(offset_of!(PluginDesc, max_hooks), 28);
        assert_eq!(offset_of!(PluginDesc, hooks), 32);
        assert_eq!(size_of::<PluginDesc>(), 32 + 8 * HOOK_SLOTS);
        assert_eq!(PLUGIN_VERSION, 0x200);
    }

    #[test]
    fn outside_criu_everything_degrades() {
        assert!(!inside_criu());
        assert!(image_dir().is_none());
        assert!(!add_inventory_plugin(c"gpusnap"));
        assert_eq!(check_and_remove_inventory_plugin(c"gpusnap"), None);
        assert!(!leave_running());
        assert_eq!(timeout_s(), None);
        assert!(!alarm_timeouted());
        assert!(!set_compel_interrupt_only_mode());
        assert!(!thaws_before_pause_devices());
        assert_eq!(series(), "older than 4.1");
    }
}
