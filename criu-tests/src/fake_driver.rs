//! The stand-in NVIDIA driver in the CRIU tests: `libfakecuda.so` (crate `fake-cuda`).
//!
//! gpusnap loads it instead of `libcuda.so.1` when CRIU's environment has `GPUSNAP_LIBCUDA`;
//! it takes a process with a thread named [`RESTORE_THREAD_COMM`] for a CUDA process, keeps the
//! driver state of each process in the process's state page (restored with it by CRIU), records
//! the last state of each pid in `FAKECUDA_DIR/<pid>.state` and logs every call in
//! `FAKECUDA_DIR/<pid>.log` (format: the `fake-cuda` crate docs). This module builds it, starts
//! the restore thread in workloads ([`spawn_restore_thread`]), runs criu with it
//! ([`FakeDriver::dump`], [`FakeDriver::restore`]) and reads its logs ([`Call`]).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use crate::build;
use crate::criu::CriuRun;
use crate::harness::{Harness, WorkDir};

/// The thread name that makes the fake driver see CUDA state.
pub const RESTORE_THREAD_COMM: &str = "fakecuda-rt";

/// Sets up the stand-in driver's state in this process, as `cuInit` would: its state page
/// (`fakecuda::state_page`, where the stand-in keeps the process's driver state, in the
/// process's memory as the real driver does, so that it survives a restore under another host
/// pid) and the stand-in for the driver's restore thread, a thread named `fakecuda-rt` that
/// sleeps in a loop forever. Call it before anything that must happen in a single-threaded
/// process (`fork`).
pub fn spawn_restore_thread() -> io::Result<()> {
    fakecuda::state_page::create_in_this_process()?;
    std::thread::Builder::new()
        .name(RESTORE_THREAD_COMM.into())
        .spawn(|| {
            // Named again with prctl, the way a C driver names its threads (std sets the same
            // name with pthread_setname_np).
            // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
            unsafe { libc::prctl(libc::PR_SET_NAME, c"fakecuda-rt".as_ptr()) };
            loop {
                std::thread::sleep(Duration::from_millis(50));
            }
        })
        .map(drop)
}

/// `libfakecuda.so`, built once per test binary.
pub fn fakecuda_so(h: &Harness) -> Result<&'static Path, String> {
    static SO: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    SO.get_or_init(|| build::package(&h.profile_dir, "fake-cuda", "libfakecuda.so"))
        .as_deref()
        .map_err(Clone::clone)
}

/// The `gpusnap` command-line tool, built once per test binary.
pub fn gpusnap_cli(h: &Harness) -> Result<&'static Path, String> {
    static CLI: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    CLI.get_or_init(|| build::package(&h.profile_dir, "gpusnap", "gpusnap"))
        .as_deref()
        .map_err(Clone::clone)
}

/// One test's fake driver: the library and the directory of its state files and logs.
#[derive(Debug)]
pub struct FakeDriver {
    pub so: PathBuf,
    pub dir: PathBuf,
}

impl FakeDriver {
    /// Builds the library (once) and uses `<work dir>/fakecuda` for state and logs.
    pub fn new(h: &Harness, w: &WorkDir) -> FakeDriver {
        let so = fakecuda_so(h)
            .unwrap_or_else(|e| panic!("building the fake driver: {e}"))
            .to_owned();
        let dir = w.path.join("fakecuda");
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        FakeDriver { so, dir }
    }

    /// The variables that make gpusnap (inside criu) use this fake driver.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("GPUSNAP_LIBCUDA".into(), self.so.display().to_string()),
            ("FAKECUDA_DIR".into(), self.dir.display().to_string()),
        ]
    }

    fn run(&self, w: &WorkDir, mut args: Vec<String>, env: &[(&str, &str)], log: &Path) -> CriuRun {
        let mut all = self.env();
        all.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let all: Vec<(&str, &str)> = all.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        args.retain(|a| !a.is_empty());
        w.run_criu(&args, &all, log)
    }

    /// `criu dump -t <pid> [-R] [extra]` into the work dir's images, with the fake driver and
    /// `env` in criu's environment; the log is `images/dump.log`.
    pub fn dump(
        &self,
        w: &WorkDir,
        pid: i32,
        leave_running: bool,
        env: &[(&str, &str)],
        extra: &[&str],
    ) -> CriuRun {
        let log = w.images.join("dump.log");
        let mut args = w.criu_args_in("dump", &w.images, &log);
        args.extend(["-t".to_owned(), pid.to_string()]);
        if leave_running {
            args.push("--leave-running".into());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        self.run(w, args, env, &log)
    }

    /// `criu restore --restore-detached` from the work dir's images, with the fake driver and
    /// `env` in criu's environment; the log is `images/restore.log`.
    pub fn restore(&self, w: &WorkDir, env: &[(&str, &str)]) -> CriuRun {
        let log = w.images.join("restore.log");
        let mut args = w.criu_args_in("restore", &w.images, &log);
        args.push("--restore-detached".into());
        self.run(w, args, env, &log)
    }

    /// The fake's log of `pid`, as text ("" if none).
    pub fn log_text(&self, pid: i32) -> String {
        fs::read_to_string(self.dir.join(format!("{pid}.log"))).unwrap_or_default()
    }

    /// Every call the fake logged for `pid`.
    pub fn calls(&self, pid: i32) -> Vec<Call> {
        let text = self.log_text(pid);
        text.lines()
            .map(|l| Call::parse(l).unwrap_or_else(|| panic!("bad fake driver log line {l:?}")))
            .collect()
    }

    /// The state-changing calls (lock, checkpoint, restore, unlock) for `pid`, in order.
    pub fn ops(&self, pid: i32) -> Vec<Call> {
        self.calls(pid)
            .into_iter()
            .filter(|c| {
                matches!(
                    c.call.as_str(),
                    "lock" | "checkpoint" | "restore" | "unlock"
                )
            })
            .collect()
    }

    /// The last driver state the fake recorded for `pid` (its state file; none: `running`).
    pub fn state(&self, pid: i32) -> String {
        match fs::read_to_string(self.dir.join(format!("{pid}.state"))) {
            Ok(s) => s.trim().to_owned(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => "running".into(),
            Err(e) => panic!("fake driver state of {pid}: {e}"),
        }
    }

    /// Sets the driver state of `pid` (e.g. `locked`: a process locked by someone else), in its
    /// state page if it has one, and in its state file.
    pub fn set_state(&self, pid: i32, state: &str) {
        let st = fakecuda::State::parse(state)
            .unwrap_or_else(|| panic!("{state:?} is not a fake driver state"));
        fakecuda::write_state(&self.dir, pid, st)
            .unwrap_or_else(|e| panic!("setting the fake driver state of {pid}: {e}"));
    }

    /// The driver state the stand-in keeps in `pid`'s own memory (its state page), if it has
    /// one; `None` for a process without one (or gone).
    pub fn state_in_memory(&self, pid: i32) -> Option<String> {
        let addr = fakecuda::state_page::find(pid).ok()??;
        fakecuda::state_page::read(pid, addr)
            .ok()
            .map(|s| s.state.name().to_owned())
    }
}

/// One line of the fake driver's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// `lock`, `checkpoint`, `restore`, `unlock`, `get_state` or `restore_tid`.
    pub call: String,
    pub rc: u32,
    pub pid: i32,
    /// State before and after the call (for `get_state`: `after` only).
    pub before: Option<String>,
    pub after: Option<String>,
    /// The restore thread and its `/proc` state when the call began.
    pub rt: Option<i32>,
    pub rt_state: Option<char>,
    /// `/proc` states of the other threads when the call began, in tid order.
    pub app: Option<String>,
    pub start_us: u64,
    pub end_us: u64,
    pub msg: String,
    /// Every `key=value` field before `msg`.
    pub fields: BTreeMap<String, String>,
}

impl Call {
    /// Parses `<call> k=v ... msg=<text>`; `None` if the line is malformed.
    pub fn parse(line: &str) -> Option<Call> {
        let (head, msg) = line.split_once(" msg=")?;
        let mut words = head.split_whitespace();
        let call = words.next()?.to_owned();
        let mut fields = BTreeMap::new();
        for w in words {
            let (k, v) = w.split_once('=')?;
            fields.insert(k.to_owned(), v.to_owned());
        }
        let (before, after) = match fields.get("state") {
            Some(s) => match s.split_once("->") {
                Some((b, a)) => (Some(b.to_owned()), Some(a.to_owned())),
                None => (None, Some(s.clone())),
            },
            None => (None, None),
        };
        let num = |k: &str| fields.get(k).and_then(|v| v.parse::<u64>().ok());
        Some(Call {
            rc: fields.get("rc")?.parse().ok()?,
            pid: fields.get("pid")?.parse().ok()?,
            before,
            after,
            rt: fields.get("rt").and_then(|v| v.parse().ok()),
            rt_state: fields.get("rt_state").and_then(|v| v.chars().next()),
            app: fields.get("app").cloned(),
            start_us: num("start_us")?,
            end_us: num("end_us")?,
            msg: msg.to_owned(),
            call,
            fields,
        })
    }

    /// True if the call succeeded.
    pub fn ok(&self) -> bool {
        self.rc == 0
    }

    /// `call:rc`, e.g. `lock:0`, for compact assertions.
    pub fn short(&self) -> String {
        format!("{}:{}", self.call, self.rc)
    }

    /// True if the restore thread was in a ptrace or job-control stop when the call began.
    pub fn rt_stopped(&self) -> bool {
        self.rt_state.is_some_and(|c| matches!(c, 't' | 'T'))
    }

    /// True if every other thread was in a ptrace stop (`t`) when the call began.
    pub fn app_all_traced(&self) -> bool {
        self.app
            .as_deref()
            .is_some_and(|a| !a.is_empty() && a.chars().all(|c| c == 't'))
    }

    /// True if no other thread was stopped when the call began.
    pub fn app_none_stopped(&self) -> bool {
        self.app
            .as_deref()
            .is_some_and(|a| !a.chars().any(|c| matches!(c, 't' | 'T')))
    }
}

/// `call:rc` of each call, for assertions and messages.
pub fn shorts(calls: &[Call]) -> Vec<String> {
    calls.iter().map(Call::short).collect()
}

/// The split path's stand-in device and its workload: `libfakecudadev.so` and `fakegpu-vmm`
/// (package `fake-cuda-device`), built once per test binary.
pub fn fake_device(h: &Harness) -> Result<(&'static Path, &'static Path), String> {
    static BUILT: OnceLock<Result<(PathBuf, PathBuf), String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let so = build::package(&h.profile_dir, "fake-cuda-device", "libfakecudadev.so")?;
            let bin = h.profile_dir.join("fakegpu-vmm");
            if bin.is_file() {
                Ok((so, bin))
            } else {
                Err(format!("{} was not produced by the build", bin.display()))
            }
        })
        .as_ref()
        .map(|(so, bin)| (so.as_path(), bin.as_path()))
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fake_driver_lines() {
        let c = Call::parse(
            "checkpoint rc=304 pid=42 state=locked->locked rt=43 rt_state=t app=tS caller=7 start_us=10 end_us=20 msg=restore thread stopped: x=y z",
        )
        .unwrap();
        assert_eq!(c.short(), "checkpoint:304");
        assert_eq!((c.pid, c.rt, c.rt_state), (42, Some(43), Some('t')));
        assert_eq!(
            (c.before.as_deref(), c.after.as_deref()),
            (Some("locked"), Some("locked"))
        );
        assert_eq!((c.start_us, c.end_us), (10, 20));
        assert_eq!(c.msg, "restore thread stopped: x=y z");
        assert!(c.rt_stopped() && !c.app_all_traced() && !c.app_none_stopped());
        let g = Call::parse(
            "get_state rc=0 pid=42 state=locked rt=43 caller=7 start_us=1 end_us=2 msg=ok",
        )
        .unwrap();
        assert_eq!((g.before, g.after.as_deref()), (None, Some("locked")));
        assert!(Call::parse("lock rc=0 pid=1").is_none());
        assert!(Call::parse("lock rc=x pid=1 start_us=1 end_us=2 msg=ok").is_none());
    }
}
