//! `libfakecuda.so`: a stand-in for the NVIDIA driver library, for CI machines without a GPU.
//!
//! gpusnap loads it instead of `libcuda.so.1` when `GPUSNAP_LIBCUDA` names it. It implements the
//! few device queries the plugin makes and the driver's checkpoint API (`cuCheckpointProcess*`)
//! as a state machine kept in files, and it checks that its caller follows the protocol the real
//! driver needs. It cannot freeze a process's GPU work (there is none); what it checks is the
//! order of the calls and the ptrace state of the target's threads during each call.
//!
//! # The target
//! A process "has CUDA state" iff one of its threads is named [`RESTORE_THREAD_COMM`]
//! (`fakecuda-rt`): that thread plays the driver's restore thread, and its tid is what
//! `cuCheckpointProcessGetRestoreThreadId` returns. Without one, every call about the process
//! returns `CUDA_ERROR_NOT_INITIALIZED` (3), which is what the real driver answers for a process
//! without CUDA state. A thread id is accepted in place of a pid, as by the real driver.
//!
//! # State
//! The driver state of a process (`running`, `locked`, `checkpointed` or `failed`) and the GPUs
//! of its last checkpoint live in the process's own memory when it has a state page
//! ([`state_page`]: the workload maps it where the real driver would set up its state), as the
//! real driver's checkpoint does: CRIU dumps and restores it with the process, so a restore
//! finds it whatever host pid the restored process gets (a container restored into a new pid
//! namespace, a copy imported into a fresh container). A process without the page keeps them in
//! files named by its pid, below.
//!
//! # Files and log (under `$FAKECUDA_DIR`, default [`DEFAULT_DIR`])
//! - `<pid>.state`: the state of a process without a state page (a missing file is
//!   `running`); for a process with one, the last state the driver recorded for that pid (so
//!   that a test can read it after the process is gone), never read back by the driver. A test
//!   sets a state (a process locked by someone else) with [`write_state`], which writes both.
//! - `<pid>.log`: one line per call about `pid`, appended, in the format of [`Record::line`]:
//!   `<call> rc=<CUresult> pid=<pid> state=<before>-><after> rt=<tid> rt_state=<c> app=<cs>
//!   ... start_us=<t> end_us=<t> msg=<text>` (`rt_state` and `app` are the `/proc` states of
//!   the restore thread and of the other threads, in tid order, when the call began; the
//!   times are `CLOCK_MONOTONIC` microseconds, comparable between processes).
//!
//! # Rules (the real driver's, as far as gpusnap relies on them)
//! - lock: running → locked; checkpoint: locked → checkpointed; restore: checkpointed →
//!   locked; unlock: locked → running. Anything else: `CUDA_ERROR_ILLEGAL_STATE` (401), state
//!   unchanged.
//! - The driver's restore thread does the work of all four calls, so it must *run* during
//!   them: if it is in a ptrace or job-control stop (`t`/`T` in `/proc/<pid>/task/<tid>/stat`)
//!   when the call begins or ends, the call fails with `CUDA_ERROR_OPERATING_SYSTEM` (304) and
//!   the log says "restore thread stopped".
//! - The restore needs `cuInit` in the calling process (as documented for the real driver).
//! - A successful checkpoint records the GPUs of the host (in the state page, else in
//!   `<pid>.gpus`, one UUID in hex a line): those are the process's checkpointed GPUs. A restore without GPU pairs needs every
//!   one of them on the host; a restore with pairs must list every checkpointed GPU once as
//!   the old UUID, and name as new UUIDs distinct GPUs of the host. The pairs received are
//!   logged (`gpu_pairs=<old>=<new>,...`). With none recorded (a state a test wrote), the
//!   host's GPUs count as the checkpointed ones.
//! - Argument structs must be zeroed except for their documented fields.
//!
//! # Failure injection (environment of the *calling* process, i.e. CRIU's)
//! - `FAKECUDA_FAIL=op[:after][@pid][,...]` with `op` one of `lock`, `checkpoint`, `restore`,
//!   `unlock`: that call fails with `CUDA_ERROR_UNKNOWN` (999), once per pid (a marker file
//!   `<pid>.injected-<op>` remembers it), for every pid or only for `pid`. Plain: the state
//!   does not change. `:after`: the state changes, then the call still reports the failure (a
//!   driver that timed out after doing the work).
//! - `FAKECUDA_LOCK_DELAY_MS=N`: the lock takes N ms. If N exceeds the lock's `timeoutMs`
//!   (0 = no timeout), the lock waits `timeoutMs` and fails with `CUDA_ERROR_TIMEOUT` (909),
//!   leaving the process running, as the real driver does.
//! - `FAKECUDA_CALL_DELAY_MS=N`: checkpoint and restore take N ms each (to see overlap when a
//!   caller works on several processes in parallel).
//! - `FAKECUDA_NEEDS_APP_MS=N`: checkpoint and restore wait until every other thread of the
//!   process is out of its ptrace stop, as the real driver's checkpoint once did when it waited
//!   on something a stopped application thread held; after N ms without that they fail with
//!   `CUDA_ERROR_OPERATING_SYSTEM` (304), state unchanged. The log gets `app_ran_after_ms`.
//!
//! A malformed value makes every checkpoint call fail with `CUDA_ERROR_INVALID_VALUE`, naming
//! the variable, so that a typo cannot make a test pass.
//!
//! # Devices (environment of the calling process)
//! One device by default ([`DEVICE_NAME`], [`DEVICE_UUID`], [`DEVICE_TOTAL_MEM`]), driver API
//! version [`DRIVER_VERSION`]. The queries (and the restore) need `cuInit(0)` first, like the
//! real ones.
//! - `FAKECUDA_DEVICES=N` (1 to [`MAX_DEVICES`]): `N` devices; device `i` has the UUID
//!   [`DEVICE_UUID`] with the last byte `i + 1` (device 0: [`DEVICE_UUID`] itself), as
//!   `libfakecudadev.so` gives the workload with the same variable.
//! - `FAKECUDA_UUID_SALT=S` (1 to 255): byte 4 of every UUID is `S` (other GPUs of the same
//!   model: a restore on "another host").
//! - `FAKECUDA_DEVICE_NAME=NAME`: every device is named `NAME` (another GPU model).
//!
//! Every exported function catches panics (a panic becomes `CUDA_ERROR_UNKNOWN`) and checks its
//! pointers; nothing unwinds into the caller.

#![allow(non_snake_case)]

use std::ffi::{CStr, c_char, c_int, c_uint};
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// `CUresult`: a C enum, 4 bytes.
pub type CUresult = c_uint;

/// The `CUresult` values this library returns.
pub mod code {
    pub const SUCCESS: u32 = 0;
    pub const INVALID_VALUE: u32 = 1;
    pub const NOT_INITIALIZED: u32 = 3;
    pub const INVALID_DEVICE: u32 = 101;
    pub const OPERATING_SYSTEM: u32 = 304;
    pub const ILLEGAL_STATE: u32 = 401;
    pub const TIMEOUT: u32 = 909;
    pub const UNKNOWN: u32 = 999;
}

/// The name (`/proc/.../comm`) of the thread that plays the driver's restore thread.
pub const RESTORE_THREAD_COMM: &str = "fakecuda-rt";
/// Where state and logs go without `FAKECUDA_DIR`.
pub const DEFAULT_DIR: &str = "/tmp/fakecuda";
pub const DIR_ENV: &str = "FAKECUDA_DIR";
pub const FAIL_ENV: &str = "FAKECUDA_FAIL";
pub const LOCK_DELAY_ENV: &str = "FAKECUDA_LOCK_DELAY_MS";
pub const CALL_DELAY_ENV: &str = "FAKECUDA_CALL_DELAY_MS";
pub const NEEDS_APP_ENV: &str = "FAKECUDA_NEEDS_APP_MS";
pub const DEVICES_ENV: &str = "FAKECUDA_DEVICES";
pub const UUID_SALT_ENV: &str = "FAKECUDA_UUID_SALT";
pub const DEVICE_NAME_ENV: &str = "FAKECUDA_DEVICE_NAME";
/// The most devices `FAKECUDA_DEVICES` may ask for.
pub const MAX_DEVICES: usize = 8;

/// `cuDriverGetVersion`: the r580 branch (CUDA 13.0).
pub const DRIVER_VERSION: c_int = 13000;
pub const DEVICE_NAME: &CStr = c"Fake GPU";
pub const DEVICE_UUID: [u8; 16] = [
    0xfa, 0x4e, 0xc0, 0xda, 0x00, 0x00, 0x40, 0x00, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01,
];
pub const DEVICE_TOTAL_MEM: usize = 80 << 30;

/// Set by `cuInit(0)` in this process.
static INITIALISED: AtomicBool = AtomicBool::new(false);

/// Driver state of a process (`CUprocessState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Running,
    Locked,
    Checkpointed,
    Failed,
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Locked => "locked",
            State::Checkpointed => "checkpointed",
            State::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<State> {
        [
            State::Running,
            State::Locked,
            State::Checkpointed,
            State::Failed,
        ]
        .into_iter()
        .find(|st| st.name() == s)
    }

    /// The `CUprocessState` value.
    pub fn raw(self) -> c_int {
        match self {
            State::Running => 0,
            State::Locked => 1,
            State::Checkpointed => 2,
            State::Failed => 3,
        }
    }
}

/// The four state-changing calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Lock,
    Checkpoint,
    Restore,
    Unlock,
}

impl Op {
    pub const ALL: [Op; 4] = [Op::Lock, Op::Checkpoint, Op::Restore, Op::Unlock];

    pub fn name(self) -> &'static str {
        match self {
            Op::Lock => "lock",
            Op::Checkpoint => "checkpoint",
            Op::Restore => "restore",
            Op::Unlock => "unlock",
        }
    }

    pub fn parse(s: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == s)
    }

    /// The one legal transition: (required state, resulting state).
    pub fn edge(self) -> (State, State) {
        match self {
            Op::Lock => (State::Running, State::Locked),
            Op::Checkpoint => (State::Locked, State::Checkpointed),
            Op::Restore => (State::Checkpointed, State::Locked),
            Op::Unlock => (State::Locked, State::Running),
        }
    }
}

/// One injected failure (`FAKECUDA_FAIL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Injection {
    pub op: Op,
    /// The state changes before the failure is reported.
    pub after: bool,
    /// Only for this process (else for every process).
    pub pid: Option<i32>,
}

/// What the environment asks of this library.
#[derive(Clone, Debug)]
pub struct Settings {
    pub dir: PathBuf,
    pub fail: Vec<Injection>,
    pub lock_delay_ms: u64,
    pub call_delay_ms: u64,
    /// Checkpoint and restore wait at most this long for the other threads to run (0: they do
    /// not).
    pub needs_app_ms: u64,
    /// The number of devices (`FAKECUDA_DEVICES`).
    pub devices: usize,
    /// Byte 4 of every UUID, when not 0 (`FAKECUDA_UUID_SALT`).
    pub uuid_salt: u8,
    /// The devices' name instead of [`DEVICE_NAME`] (`FAKECUDA_DEVICE_NAME`).
    pub device_name: Option<String>,
    /// A malformed variable: every checkpoint call fails, naming it.
    pub error: Option<String>,
}

impl Settings {
    /// Defaults: state under `dir`, no failures, no delays.
    pub fn new(dir: impl Into<PathBuf>) -> Settings {
        Settings {
            dir: dir.into(),
            fail: Vec::new(),
            lock_delay_ms: 0,
            call_delay_ms: 0,
            needs_app_ms: 0,
            devices: 1,
            uuid_salt: 0,
            device_name: None,
            error: None,
        }
    }

    /// The UUID of device `ordinal` (see the crate docs).
    pub fn uuid(&self, ordinal: usize) -> [u8; 16] {
        let mut u = DEVICE_UUID;
        u[15] = ordinal as u8 + 1;
        if self.uuid_salt != 0 {
            u[4] = self.uuid_salt;
        }
        u
    }

    /// The UUIDs of every device, in ordinal order.
    pub fn uuids(&self) -> Vec<[u8; 16]> {
        (0..self.devices).map(|i| self.uuid(i)).collect()
    }

    /// The devices' name.
    pub fn name(&self) -> Vec<u8> {
        self.device_name.as_ref().map_or_else(
            || DEVICE_NAME.to_bytes().to_vec(),
            |n| n.as_bytes().to_vec(),
        )
    }

    pub fn from_env() -> Settings {
        Settings::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the `FAKECUDA_*` variables through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Settings {
        let dir = get(DIR_ENV)
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| DEFAULT_DIR.to_owned());
        let mut s = Settings::new(dir);
        let mut errors = Vec::new();
        if let Some(v) = get(FAIL_ENV) {
            match parse_injections(&v) {
                Ok(f) => s.fail = f,
                Err(e) => errors.push(format!("{FAIL_ENV}={v:?}: {e}")),
            }
        }
        for (var, slot) in [
            (LOCK_DELAY_ENV, &mut s.lock_delay_ms),
            (CALL_DELAY_ENV, &mut s.call_delay_ms),
            (NEEDS_APP_ENV, &mut s.needs_app_ms),
        ] {
            if let Some(v) = get(var) {
                match v.trim().parse() {
                    Ok(n) => *slot = n,
                    Err(_) => errors.push(format!("{var}={v:?}: not a number of milliseconds")),
                }
            }
        }
        if let Some(v) = get(DEVICES_ENV) {
            match v.trim().parse::<usize>() {
                Ok(n) if (1..=MAX_DEVICES).contains(&n) => s.devices = n,
                _ => errors.push(format!("{DEVICES_ENV}={v:?}: not 1 to {MAX_DEVICES}")),
            }
        }
        if let Some(v) = get(UUID_SALT_ENV) {
            match v.trim().parse::<u8>() {
                Ok(n) if n != 0 => s.uuid_salt = n,
                _ => errors.push(format!("{UUID_SALT_ENV}={v:?}: not 1 to 255")),
            }
        }
        if let Some(v) = get(DEVICE_NAME_ENV) {
            if v.is_empty() || v.len() > 200 || v.contains('\0') {
                errors.push(format!("{DEVICE_NAME_ENV}={v:?}: not a device name"));
            } else {
                s.device_name = Some(v);
            }
        }
        if !errors.is_empty() {
            s.error = Some(errors.join("; "));
        }
        s
    }
}

/// Parses `op[:after][@pid][,...]`; empty items are ignored.
pub fn parse_injections(v: &str) -> Result<Vec<Injection>, String> {
    let mut out = Vec::new();
    for item in v.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (item, pid) = match item.split_once('@') {
            None => (item, None),
            Some((i, p)) => (
                i,
                Some(p.parse().map_err(|_| format!("bad pid {p:?} after `@`"))?),
            ),
        };
        let (name, after) = match item.split_once(':') {
            None => (item, false),
            Some((n, "after")) => (n, true),
            Some((_, w)) => return Err(format!("unknown modifier {w:?} (only `:after`)")),
        };
        let op = Op::parse(name).ok_or_else(|| {
            format!("unknown call {name:?} (lock, checkpoint, restore or unlock)")
        })?;
        out.push(Injection { op, after, pid });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// /proc

/// The thread group of `tid` (a pid is its own).
fn tgid(tid: i32) -> Option<i32> {
    fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))?
        .trim()
        .parse()
        .ok()
}

/// Tids of `pid`'s threads, sorted.
fn threads(pid: i32) -> Vec<i32> {
    let mut v: Vec<i32> = fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    v.sort_unstable();
    v
}

/// The tid of `pid`'s thread named [`RESTORE_THREAD_COMM`] (the first, if several).
pub fn restore_thread(pid: i32) -> Option<i32> {
    threads(pid).into_iter().find(|tid| {
        fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
            .is_ok_and(|c| c.trim_end() == RESTORE_THREAD_COMM)
    })
}

/// The one-letter state of a thread (`R`, `S`, `t`, `T`, `Z`, ...).
pub fn thread_state(pid: i32, tid: i32) -> Option<char> {
    let s = fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    s[s.rfind(')')? + 1..]
        .split_whitespace()
        .next()?
        .chars()
        .next()
}

/// In a ptrace stop (`t`) or a job-control stop (`T`).
pub fn is_stopped(state: char) -> bool {
    matches!(state, 't' | 'T')
}

/// The states of `pid`'s threads other than `rt`, in tid order (`-` if there are none).
fn app_states(pid: i32, rt: i32) -> String {
    let s: String = threads(pid)
        .into_iter()
        .filter(|&t| t != rt)
        .map(|t| thread_state(pid, t).unwrap_or('?'))
        .collect();
    if s.is_empty() { "-".into() } else { s }
}

/// Waits until no thread of `pid` but `rt` is stopped; how long that took, or None after `limit`.
fn wait_for_app_threads(pid: i32, rt: i32, limit: Duration) -> Option<Duration> {
    let t0 = std::time::Instant::now();
    loop {
        if !app_states(pid, rt).chars().any(is_stopped) {
            return Some(t0.elapsed());
        }
        if t0.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `CLOCK_MONOTONIC` in microseconds: comparable between processes of one boot.
pub fn now_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only to `ts`, a valid local.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}

fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

// ---------------------------------------------------------------------------------------------
// State files and logs

pub fn state_path(dir: &Path, pid: i32) -> PathBuf {
    dir.join(format!("{pid}.state"))
}

pub fn log_path(dir: &Path, pid: i32) -> PathBuf {
    dir.join(format!("{pid}.log"))
}

/// The checkpointed GPUs of `pid` (written by a successful checkpoint).
pub fn gpus_path(dir: &Path, pid: i32) -> PathBuf {
    dir.join(format!("{pid}.gpus"))
}

/// The GPUs recorded at `pid`'s checkpoint (in its state page, else in `<pid>.gpus`); none
/// recorded: `None`.
pub fn read_gpus(dir: &Path, pid: i32) -> Result<Option<Vec<[u8; 16]>>, String> {
    if let Some(addr) = state_page::find(pid)? {
        return Ok(state_page::read(pid, addr)?.gpus);
    }
    let p = gpus_path(dir, pid);
    let text = match fs::read_to_string(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", p.display())),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| parse_hex_uuid(l.trim()).ok_or_else(|| format!("{}: bad UUID {l:?}", p.display())))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn parse_hex_uuid(s: &str) -> Option<[u8; 16]> {
    if s.len() != 32 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Records `gpus` as `pid`'s checkpointed GPUs (in its state page, else in `<pid>.gpus`).
fn write_gpus(dir: &Path, pid: i32, gpus: &[[u8; 16]]) -> Result<(), String> {
    if let Some(addr) = state_page::find(pid)? {
        let mut st = state_page::read(pid, addr)?;
        st.gpus = Some(gpus.to_vec());
        return state_page::write(pid, addr, &st);
    }
    let text: String = gpus.iter().map(|g| format!("{}\n", hex(g))).collect();
    let p = gpus_path(dir, pid);
    fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))
}

/// `Err(why)` unless `pairs` may be given to the restore of a process checkpointed on
/// `checkpointed`, on a host with `host` (see the crate docs).
pub fn check_pairs(
    checkpointed: &[[u8; 16]],
    host: &[[u8; 16]],
    pairs: &[([u8; 16], [u8; 16])],
) -> Result<(), String> {
    if pairs.is_empty() {
        return match checkpointed.iter().find(|g| !host.contains(g)) {
            Some(g) => Err(format!(
                "checkpointed GPU {} is not on this host and no GPU pair names it",
                hex(g)
            )),
            None => Ok(()),
        };
    }
    for (i, (old, new)) in pairs.iter().enumerate() {
        if !checkpointed.contains(old) {
            return Err(format!(
                "GPU pair {}={} names a GPU that was not checkpointed",
                hex(old),
                hex(new)
            ));
        }
        if !host.contains(new) {
            return Err(format!(
                "GPU pair {}={} names a GPU that does not exist",
                hex(old),
                hex(new)
            ));
        }
        if pairs[..i].iter().any(|(o, n)| o == old || n == new) {
            return Err(format!(
                "GPU pair {}={} repeats a GPU of an earlier pair",
                hex(old),
                hex(new)
            ));
        }
    }
    match checkpointed
        .iter()
        .find(|g| !pairs.iter().any(|(o, _)| o == *g))
    {
        Some(g) => Err(format!(
            "checkpointed GPU {} is missing from the GPU pairs (every one must be listed)",
            hex(g)
        )),
        None => Ok(()),
    }
}

/// The state recorded for `pid`: in its state page ([`state_page`]) if it has one, else in
/// `<pid>.state`; no file: running.
pub fn read_state(dir: &Path, pid: i32) -> Result<State, String> {
    if let Some(addr) = state_page::find(pid)? {
        return Ok(state_page::read(pid, addr)?.state);
    }
    let p = state_path(dir, pid);
    match fs::read_to_string(&p) {
        Ok(s) => State::parse(s.trim()).ok_or_else(|| format!("{}: bad state {s:?}", p.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(State::Running),
        Err(e) => Err(format!("{}: {e}", p.display())),
    }
}

/// Sets `pid`'s state: in its state page ([`state_page`]) if it has one, and in `<pid>.state`
/// (replaced atomically), which holds the state of a process without a page and, for one with
/// a page, the last state recorded for that pid (for tests and diagnostics; never read back
/// for it).
pub fn write_state(dir: &Path, pid: i32, state: State) -> io::Result<()> {
    let page = state_page::find(pid).map_err(io::Error::other)?;
    if let Some(addr) = page {
        let mut st = state_page::read(pid, addr).map_err(io::Error::other)?;
        st.state = state;
        state_page::write(pid, addr, &st).map_err(io::Error::other)?;
    }
    fs::create_dir_all(dir)?;
    let p = state_path(dir, pid);
    let tmp = dir.join(format!("{pid}.state.{}.tmp", gettid()));
    fs::write(&tmp, format!("{}\n", state.name()))?;
    fs::rename(&tmp, &p)
}

/// Appends one line with a single `write(2)` (lines of concurrent callers do not mix).
fn append(path: &Path, line: &str) {
    if let Some(d) = path.parent() {
        let _ = fs::create_dir_all(d);
    }
    if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(path) {
        let _ = f.write_all(line.as_bytes());
    }
}

/// True the first time it is called for (`pid`, `op`) in `dir`: the injected failure is due.
fn take_injection(dir: &Path, pid: i32, op: Op) -> bool {
    let _ = fs::create_dir_all(dir);
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dir.join(format!("{pid}.injected-{}", op.name())))
        .is_ok()
}

/// One logged call.
#[derive(Debug)]
pub struct Record {
    pub call: &'static str,
    pub pid: i32,
    pub rc: u32,
    pub before: Option<State>,
    pub after: Option<State>,
    pub rt: Option<i32>,
    pub rt_state: Option<char>,
    pub app: Option<String>,
    /// More `key=value` fields (no spaces in either).
    pub extra: Vec<(&'static str, String)>,
    pub start_us: u64,
    pub msg: String,
}

impl Record {
    fn new(call: &'static str, pid: i32) -> Record {
        Record {
            call,
            pid,
            rc: code::SUCCESS,
            before: None,
            after: None,
            rt: None,
            rt_state: None,
            app: None,
            extra: Vec::new(),
            start_us: now_us(),
            msg: String::new(),
        }
    }

    /// `<call> rc=N pid=P [state=A->B|state=A] [rt=T] [rt_state=C] [app=CS] [k=v]... caller=T
    /// start_us=N end_us=N msg=<text to the end of the line>`.
    pub fn line(&self, end_us: u64) -> String {
        let mut l = format!("{} rc={} pid={}", self.call, self.rc, self.pid);
        match (self.before, self.after) {
            (Some(b), Some(a)) => l.push_str(&format!(" state={}->{}", b.name(), a.name())),
            (Some(s), None) | (None, Some(s)) => l.push_str(&format!(" state={}", s.name())),
            (None, None) => {}
        }
        if let Some(rt) = self.rt {
            l.push_str(&format!(" rt={rt}"));
        }
        if let Some(c) = self.rt_state {
            l.push_str(&format!(" rt_state={c}"));
        }
        if let Some(a) = &self.app {
            l.push_str(&format!(" app={a}"));
        }
        for (k, v) in &self.extra {
            l.push_str(&format!(" {k}={v}"));
        }
        let msg = if self.msg.is_empty() { "ok" } else { &self.msg };
        l.push_str(&format!(
            " caller={} start_us={} end_us={end_us} msg={}\n",
            gettid(),
            self.start_us,
            msg.replace('\n', " ")
        ));
        l
    }

    fn log(&self, dir: &Path) {
        append(&log_path(dir, self.pid), &self.line(now_us()));
    }
}

// ---------------------------------------------------------------------------------------------
// The checkpoint API

/// What a state-changing call was given besides the pid.
#[derive(Clone, Debug, Default)]
pub struct OpArgs {
    /// `CUcheckpointLockArgs.timeoutMs` (0: no timeout).
    pub timeout_ms: u32,
    /// `CUcheckpointRestoreArgs.gpuPairs` as (old, new) UUIDs.
    pub pairs: Vec<([u8; 16], [u8; 16])>,
    /// `cuInit` was called in the calling process.
    pub initialised: bool,
    /// The argument struct broke a rule (not zeroed, bad pointer).
    pub bad_args: Option<String>,
}

/// Runs one of the four calls on `pid` and logs it; returns the `CUresult`.
pub fn run_op(s: &Settings, pid: i32, op: Op, args: &OpArgs) -> u32 {
    let mut r = Record::new(op.name(), pid);
    r.rc = op_inner(s, pid, op, args, &mut r);
    r.log(&s.dir);
    r.rc
}

fn op_inner(s: &Settings, pid: i32, op: Op, args: &OpArgs, r: &mut Record) -> u32 {
    match op {
        Op::Lock => r.extra.push(("timeout_ms", args.timeout_ms.to_string())),
        Op::Restore => {
            r.extra.push(("pairs", args.pairs.len().to_string()));
            if !args.pairs.is_empty() {
                let list: Vec<String> = args
                    .pairs
                    .iter()
                    .map(|(o, n)| format!("{}={}", hex(o), hex(n)))
                    .collect();
                r.extra.push(("gpu_pairs", list.join(",")));
            }
        }
        _ => {}
    }
    if let Some(e) = &s.error {
        r.msg = format!("bad fake-driver settings: {e}");
        return code::INVALID_VALUE;
    }
    if let Some(e) = &args.bad_args {
        r.msg = format!("bad argument struct: {e}");
        return code::INVALID_VALUE;
    }
    let pid = tgid(pid).unwrap_or(pid);
    r.pid = pid;
    let Some(rt) = restore_thread(pid) else {
        r.msg = format!("no CUDA state: pid {pid} has no {RESTORE_THREAD_COMM} thread");
        return code::NOT_INITIALIZED;
    };
    r.rt = Some(rt);
    r.rt_state = thread_state(pid, rt);
    r.app = Some(app_states(pid, rt));
    let before = match read_state(&s.dir, pid) {
        Ok(st) => st,
        Err(e) => {
            r.msg = e;
            return code::UNKNOWN;
        }
    };
    r.before = Some(before);
    r.after = Some(before);
    if op == Op::Restore {
        if !args.initialised {
            r.msg = "cuInit was not called in the calling process (the driver needs it before a restore)".into();
            return code::NOT_INITIALIZED;
        }
        let host = s.uuids();
        let checkpointed = match read_gpus(&s.dir, pid) {
            Ok(g) => g.unwrap_or_else(|| host.clone()),
            Err(e) => {
                r.msg = e;
                return code::UNKNOWN;
            }
        };
        if let Err(e) = check_pairs(&checkpointed, &host, &args.pairs) {
            r.msg = e;
            return code::INVALID_VALUE;
        }
    }
    if let Some(e) = restore_thread_not_running(pid, rt, op, "began") {
        r.msg = e;
        return code::OPERATING_SYSTEM;
    }
    if op == Op::Lock && s.lock_delay_ms > 0 {
        let timeout = u64::from(args.timeout_ms);
        if timeout != 0 && s.lock_delay_ms > timeout {
            std::thread::sleep(Duration::from_millis(timeout));
            r.msg = format!(
                "lock timed out after {timeout} ms ({LOCK_DELAY_ENV}={}); the process stays running",
                s.lock_delay_ms
            );
            return code::TIMEOUT;
        }
        std::thread::sleep(Duration::from_millis(s.lock_delay_ms));
    }
    if matches!(op, Op::Checkpoint | Op::Restore) && s.call_delay_ms > 0 {
        std::thread::sleep(Duration::from_millis(s.call_delay_ms));
    }
    if matches!(op, Op::Checkpoint | Op::Restore) && s.needs_app_ms > 0 {
        match wait_for_app_threads(pid, rt, Duration::from_millis(s.needs_app_ms)) {
            Some(waited) => r
                .extra
                .push(("app_ran_after_ms", waited.as_millis().to_string())),
            None => {
                r.msg = format!(
                    "{} waited {} ms ({NEEDS_APP_ENV}) for the process's other threads, which stayed stopped",
                    op.name(),
                    s.needs_app_ms
                );
                return code::OPERATING_SYSTEM;
            }
        }
    }
    if let Some(e) = restore_thread_not_running(pid, rt, op, "ended") {
        r.msg = e;
        return code::OPERATING_SYSTEM;
    }
    let (need, to) = op.edge();
    if before != need {
        r.msg = format!(
            "{} is illegal in state {} (it needs {})",
            op.name(),
            before.name(),
            need.name()
        );
        return code::ILLEGAL_STATE;
    }
    if let Some(inj) = s
        .fail
        .iter()
        .find(|i| i.op == op && i.pid.is_none_or(|p| p == pid))
        && take_injection(&s.dir, pid, op)
    {
        if inj.after {
            if let Err(e) = write_state(&s.dir, pid, to) {
                r.msg = format!("writing the state: {e}");
                return code::UNKNOWN;
            }
            r.after = Some(to);
            r.msg = format!("injected failure after the state change ({FAIL_ENV})");
        } else {
            r.msg = format!("injected failure ({FAIL_ENV})");
        }
        return code::UNKNOWN;
    }
    if op == Op::Checkpoint
        && let Err(e) = write_gpus(&s.dir, pid, &s.uuids())
    {
        r.msg = format!("recording the checkpointed GPUs: {e}");
        return code::UNKNOWN;
    }
    if let Err(e) = write_state(&s.dir, pid, to) {
        r.msg = format!("writing the state: {e}");
        return code::UNKNOWN;
    }
    r.after = Some(to);
    if op == Op::Lock {
        match calls::wait_until_none(&s.dir, pid, args.timeout_ms) {
            Ok(true) => r.extra.push(("waited_for_calls", "1".into())),
            Ok(false) => {}
            Err(e) => {
                // As the real driver: a lock that timed out leaves the process running.
                if let Err(w) = write_state(&s.dir, pid, before) {
                    r.msg = format!("{e}; and writing the state back: {w}");
                    return code::UNKNOWN;
                }
                r.after = Some(before);
                r.msg = e;
                return code::TIMEOUT;
            }
        }
    }
    code::SUCCESS
}

/// `Some(why)` unless the restore thread runs (it does the driver's work).
fn restore_thread_not_running(pid: i32, rt: i32, op: Op, when: &str) -> Option<String> {
    match thread_state(pid, rt) {
        Some(c) if !is_stopped(c) => None,
        Some(c) => Some(format!(
            "restore thread stopped: thread {rt} was in state {c} (a ptrace or job-control stop) when the {} {when}; the driver's restore thread must run during the call",
            op.name()
        )),
        None => Some(format!(
            "restore thread {rt} is gone when the {} {when}",
            op.name()
        )),
    }
}

/// `cuCheckpointProcessGetState` (logged).
pub fn get_state(s: &Settings, pid: i32) -> Result<State, u32> {
    let mut r = Record::new("get_state", pid);
    let out = (|| {
        let pid = tgid(pid).unwrap_or(pid);
        r.pid = pid;
        let Some(rt) = restore_thread(pid) else {
            r.msg = format!("no CUDA state: pid {pid} has no {RESTORE_THREAD_COMM} thread");
            return Err(code::NOT_INITIALIZED);
        };
        r.rt = Some(rt);
        let st = read_state(&s.dir, pid).map_err(|e| {
            r.msg = e;
            code::UNKNOWN
        })?;
        r.after = Some(st);
        Ok(st)
    })();
    r.rc = out.err().unwrap_or(code::SUCCESS);
    r.log(&s.dir);
    out
}

/// `cuCheckpointProcessGetRestoreThreadId` (logged).
pub fn get_restore_tid(s: &Settings, pid: i32) -> Result<i32, u32> {
    let mut r = Record::new("restore_tid", pid);
    let pid = tgid(pid).unwrap_or(pid);
    r.pid = pid;
    let out = restore_thread(pid).ok_or(code::NOT_INITIALIZED);
    match out {
        Ok(rt) => r.rt = Some(rt),
        Err(_) => r.msg = format!("no CUDA state: pid {pid} has no {RESTORE_THREAD_COMM} thread"),
    }
    r.rc = out.err().unwrap_or(code::SUCCESS);
    r.log(&s.dir);
    out
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------
// Argument structs (64 bytes each, CUDA 13.0)

/// `CUcheckpointLockArgs`, `CUcheckpointCheckpointArgs`, `CUcheckpointRestoreArgs` and
/// `CUcheckpointUnlockArgs` are all 64 bytes.
pub const ARGS_SIZE: usize = 64;

/// `CUcheckpointGpuPair`.
#[repr(C)]
#[derive(Clone, Copy)]
struct GpuPair {
    old: [u8; 16],
    new: [u8; 16],
}

/// `Err` naming the first non-zero byte in `bytes[from..]` (reserved fields must be zero).
pub fn check_reserved(bytes: &[u8; ARGS_SIZE], from: usize) -> Result<(), String> {
    match bytes[from..].iter().position(|&b| b != 0) {
        None => Ok(()),
        Some(i) => Err(format!(
            "reserved byte {} is {:#04x}, not zero",
            from + i,
            bytes[from + i]
        )),
    }
}

/// Reads a 64-byte argument struct; `None` for a null pointer (allowed: all defaults).
///
/// # Safety
/// `p` is null or points to 64 readable bytes.
unsafe fn read_args(p: *const u8) -> Option<[u8; ARGS_SIZE]> {
    // SAFETY: non-null `p` points to a 64-byte argument struct (the caller's contract).
    (!p.is_null()).then(|| unsafe { std::ptr::read_unaligned(p.cast::<[u8; ARGS_SIZE]>()) })
}

/// Decodes lock args: `timeoutMs` (bytes 0..4); the rest is reserved.
fn lock_args(bytes: Option<[u8; ARGS_SIZE]>, a: &mut OpArgs) {
    if let Some(b) = bytes {
        a.timeout_ms = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        a.bad_args = check_reserved(&b, 4).err();
    }
}

/// Decodes restore args: `gpuPairs` (0..8), `gpuPairsCount` (8..12); the rest is reserved.
///
/// # Safety
/// A non-null `gpuPairs` in `bytes` points to `gpuPairsCount` pairs.
unsafe fn restore_args(bytes: Option<[u8; ARGS_SIZE]>, a: &mut OpArgs) {
    let Some(b) = bytes else { return };
    let ptr = usize::from_ne_bytes(b[0..8].try_into().expect("8 bytes")) as *const GpuPair;
    let n = u32::from_ne_bytes(b[8..12].try_into().expect("4 bytes")) as usize;
    if let Err(e) = check_reserved(&b, 12) {
        a.bad_args = Some(e);
        return;
    }
    match (ptr.is_null(), n) {
        (true, 0) => {}
        (true, _) => a.bad_args = Some(format!("gpuPairs is NULL but gpuPairsCount is {n}")),
        (false, 0) => a.bad_args = Some("gpuPairs set but gpuPairsCount is 0".into()),
        (false, n) if n > 64 => a.bad_args = Some(format!("gpuPairsCount {n} is implausible")),
        (false, n) => {
            // SAFETY: the caller passes `n` pairs at `ptr` (checked non-null, n <= 64).
            let pairs = unsafe { std::slice::from_raw_parts(ptr, n) };
            a.pairs = pairs.iter().map(|p| (p.old, p.new)).collect();
        }
    }
}

/// Runs `f`, turning a panic into `CUDA_ERROR_UNKNOWN`.
fn guard(f: impl FnOnce() -> u32) -> CUresult {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(code::UNKNOWN)
}

/// Shared body of the four state-changing entry points.
fn op_entry(pid: c_int, op: Op, args: OpArgs) -> CUresult {
    let s = Settings::from_env();
    run_op(
        &s,
        pid,
        op,
        &OpArgs {
            initialised: INITIALISED.load(Ordering::SeqCst),
            ..args
        },
    )
}

/// `CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)`: running → locked.
///
/// # Safety
/// `args` is null or points to a 64-byte `CUcheckpointLockArgs`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessLock(pid: c_int, args: *mut u8) -> CUresult {
    guard(|| {
        let mut a = OpArgs::default();
        // SAFETY: `args` is null or a 64-byte struct (this function's contract).
        lock_args(unsafe { read_args(args) }, &mut a);
        op_entry(pid, Op::Lock, a)
    })
}

/// `CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)`:
/// locked → checkpointed.
///
/// # Safety
/// `args` is null or points to a 64-byte `CUcheckpointCheckpointArgs`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessCheckpoint(pid: c_int, args: *mut u8) -> CUresult {
    guard(|| {
        let mut a = OpArgs::default();
        // SAFETY: `args` is null or a 64-byte struct (this function's contract).
        if let Some(b) = unsafe { read_args(args) } {
            a.bad_args = check_reserved(&b, 0).err();
        }
        op_entry(pid, Op::Checkpoint, a)
    })
}

/// `CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)`:
/// checkpointed → locked.
///
/// # Safety
/// `args` is null or points to a 64-byte `CUcheckpointRestoreArgs` whose `gpuPairs` is null or
/// points to `gpuPairsCount` pairs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessRestore(pid: c_int, args: *mut u8) -> CUresult {
    guard(|| {
        let mut a = OpArgs::default();
        // SAFETY: `args` is null or a valid restore argument struct (this function's contract).
        unsafe { restore_args(read_args(args), &mut a) };
        op_entry(pid, Op::Restore, a)
    })
}

/// `CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)`: locked → running.
///
/// # Safety
/// `args` is null or points to a 64-byte `CUcheckpointUnlockArgs`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessUnlock(pid: c_int, args: *mut u8) -> CUresult {
    guard(|| {
        let mut a = OpArgs::default();
        // SAFETY: `args` is null or a 64-byte struct (this function's contract).
        if let Some(b) = unsafe { read_args(args) } {
            a.bad_args = check_reserved(&b, 0).err();
        }
        op_entry(pid, Op::Unlock, a)
    })
}

/// `CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)`.
///
/// # Safety
/// `state` is null or points to a writable `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessGetState(pid: c_int, state: *mut c_int) -> CUresult {
    guard(|| {
        if state.is_null() {
            return code::INVALID_VALUE;
        }
        match get_state(&Settings::from_env(), pid) {
            Ok(st) => {
                // SAFETY: non-null out-pointer to an int (this function's contract).
                unsafe { state.write(st.raw()) };
                code::SUCCESS
            }
            Err(rc) => rc,
        }
    })
}

/// `CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)`.
///
/// # Safety
/// `tid` is null or points to a writable `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessGetRestoreThreadId(
    pid: c_int,
    tid: *mut c_int,
) -> CUresult {
    guard(|| {
        if tid.is_null() {
            return code::INVALID_VALUE;
        }
        match get_restore_tid(&Settings::from_env(), pid) {
            Ok(t) => {
                // SAFETY: non-null out-pointer to an int (this function's contract).
                unsafe { tid.write(t) };
                code::SUCCESS
            }
            Err(rc) => rc,
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Initialisation, errors and device queries

/// `CUresult cuInit(unsigned flags)`: `flags` must be 0.
///
/// # Safety
/// None: it takes no pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    guard(|| {
        if flags != 0 {
            return code::INVALID_VALUE;
        }
        INITIALISED.store(true, Ordering::SeqCst);
        code::SUCCESS
    })
}

/// `CUresult cuDriverGetVersion(int *version)`.
///
/// # Safety
/// `version` is null or points to a writable `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    guard(|| {
        if version.is_null() {
            return code::INVALID_VALUE;
        }
        // SAFETY: non-null out-pointer (this function's contract).
        unsafe { version.write(DRIVER_VERSION) };
        code::SUCCESS
    })
}

/// The name of a `CUresult` this library returns.
pub fn error_name(rc: u32) -> Option<&'static CStr> {
    Some(match rc {
        code::SUCCESS => c"CUDA_SUCCESS",
        code::INVALID_VALUE => c"CUDA_ERROR_INVALID_VALUE",
        code::NOT_INITIALIZED => c"CUDA_ERROR_NOT_INITIALIZED",
        code::INVALID_DEVICE => c"CUDA_ERROR_INVALID_DEVICE",
        code::OPERATING_SYSTEM => c"CUDA_ERROR_OPERATING_SYSTEM",
        code::ILLEGAL_STATE => c"CUDA_ERROR_ILLEGAL_STATE",
        code::TIMEOUT => c"CUDA_ERROR_TIMEOUT",
        code::UNKNOWN => c"CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
}

/// `CUresult cuGetErrorName(CUresult error, const char **str)`: a static string, or NULL and
/// `CUDA_ERROR_INVALID_VALUE` for an unknown code.
///
/// # Safety
/// `s` is null or points to a writable `const char *`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, s: *mut *const c_char) -> CUresult {
    guard(|| {
        if s.is_null() {
            return code::INVALID_VALUE;
        }
        let (p, rc) = match error_name(error) {
            Some(n) => (n.as_ptr(), code::SUCCESS),
            None => (std::ptr::null(), code::INVALID_VALUE),
        };
        // SAFETY: non-null out-pointer (this function's contract); `p` is static or null.
        unsafe { s.write(p) };
        rc
    })
}

/// `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`, `CUDA_ERROR_INVALID_DEVICE` for a device
/// that is not there, else success.
fn device_call(s: &Settings, dev: c_int) -> u32 {
    if !INITIALISED.load(Ordering::SeqCst) {
        code::NOT_INITIALIZED
    } else if !usize::try_from(dev).is_ok_and(|d| d < s.devices) {
        code::INVALID_DEVICE
    } else {
        code::SUCCESS
    }
}

/// `CUresult cuDeviceGetCount(int *count)`: `FAKECUDA_DEVICES` (1).
///
/// # Safety
/// `count` is null or points to a writable `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    guard(|| {
        if count.is_null() {
            return code::INVALID_VALUE;
        }
        let s = Settings::from_env();
        let rc = device_call(&s, 0);
        if rc == code::SUCCESS {
            // SAFETY: non-null out-pointer (this function's contract).
            unsafe { count.write(s.devices as c_int) };
        }
        rc
    })
}

/// `CUresult cuDeviceGet(CUdevice *device, int ordinal)`: ordinal `i` is device `i`.
///
/// # Safety
/// `device` is null or points to a writable `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> CUresult {
    guard(|| {
        if device.is_null() {
            return code::INVALID_VALUE;
        }
        let rc = device_call(&Settings::from_env(), ordinal);
        if rc == code::SUCCESS {
            // SAFETY: non-null out-pointer (this function's contract).
            unsafe { device.write(ordinal) };
        }
        rc
    })
}

/// `CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)`: [`Settings::uuid`].
///
/// # Safety
/// `uuid` is null or points to 16 writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut u8, dev: c_int) -> CUresult {
    guard(|| {
        if uuid.is_null() {
            return code::INVALID_VALUE;
        }
        let s = Settings::from_env();
        let rc = device_call(&s, dev);
        if rc == code::SUCCESS {
            // SAFETY: non-null pointer to a 16-byte CUuuid (this function's contract).
            unsafe {
                uuid.cast::<[u8; 16]>()
                    .write_unaligned(s.uuid(dev as usize))
            };
        }
        rc
    })
}

/// `CUresult cuDeviceGetName(char *name, int len, CUdevice dev)`: [`Settings::name`], truncated
/// to `len - 1` bytes and NUL-terminated.
///
/// # Safety
/// `name` is null or points to `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    guard(|| {
        if name.is_null() || len <= 0 {
            return code::INVALID_VALUE;
        }
        let s = Settings::from_env();
        let rc = device_call(&s, dev);
        if rc == code::SUCCESS {
            let src = s.name();
            let n = src.len().min(len as usize - 1);
            // SAFETY: `name` has `len` writable bytes (this function's contract) and
            // n + 1 <= len.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), name.cast::<u8>(), n);
                name.add(n).write(0);
            }
        }
        rc
    })
}

/// `CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)`: [`DEVICE_TOTAL_MEM`].
///
/// # Safety
/// `bytes` is null or points to a writable `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CUresult {
    guard(|| {
        if bytes.is_null() {
            return code::INVALID_VALUE;
        }
        let rc = device_call(&Settings::from_env(), dev);
        if rc == code::SUCCESS {
            // SAFETY: non-null out-pointer (this function's contract).
            unsafe { bytes.write(DEVICE_TOTAL_MEM) };
        }
        rc
    })
}

pub mod calls;
pub mod state_page;

#[cfg(test)]
mod tests;
