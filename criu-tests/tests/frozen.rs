//! A GPU job in a frozen cgroup, dumped the way a container engine that freezes first has it
//! done (containerd and CRI-O pause the container, then runc runs `criu dump --freeze-cgroup
//! <the container's freezer cgroup> --leave-running`), with plain CRIU and the stand-in driver:
//!
//! - CRIU 4.1 calls PAUSE_DEVICES before it thaws the cgroup: gpusnap refuses the dump at once,
//!   one line naming the frozen cgroup and CRIU 4.2, no wait for CRIU's timeout, no driver call
//!   that changes the job, the cgroup left frozen as the "engine" left it;
//! - CRIU 4.2 thaws first: the dump goes through as for a running job (lock, checkpoint, and the
//!   `-R` rollback), and CRIU freezes the cgroup again at its end, as it found it.
//!
//! Either way the job runs on, intact, once the test thaws the cgroup (the engine's resume).
//! The cgroup is the cgroup v1 freezer's where that is mounted (runc's on a v1 or hybrid host),
//! else a cgroup v2 one; it is removed whether the test passes or not.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criu_tests::fake_driver::{FakeDriver, RESTORE_THREAD_COMM, shorts};
use criu_tests::harness::skipped;
use criu_tests::{CounterLog, harness, procs};
use gpusnap_host::freezer;
use gpusnap_host::pid::HostPid;

const FAKEGPU: &str = env!("CARGO_BIN_EXE_fakegpu");
const TEST: &str = "frozen";
/// Ticks (50 ms each) the job must write after the thaw.
const MORE_TICKS: u64 = 5;
const PROMPTLY: Duration = Duration::from_secs(10);

/// A cgroup of the test's own that can be frozen, with the job in it; dropping it thaws it,
/// moves the job back to the hierarchy's root and removes it.
struct FreezerCgroup {
    dir: PathBuf,
    root: PathBuf,
    v1: bool,
    pid: i32,
}

impl FreezerCgroup {
    /// A new cgroup for `pid` (moved into it), or why there is none here.
    fn new(pid: i32) -> Result<FreezerCgroup, String> {
        let (root, v1) = if Path::new("/sys/fs/cgroup/freezer/tasks").is_file() {
            (PathBuf::from("/sys/fs/cgroup/freezer"), true)
        } else if Path::new("/sys/fs/cgroup/cgroup.controllers").is_file() {
            (PathBuf::from("/sys/fs/cgroup"), false)
        } else if Path::new("/sys/fs/cgroup/unified/cgroup.controllers").is_file() {
            (PathBuf::from("/sys/fs/cgroup/unified"), false)
        } else {
            return Err("no cgroup v1 freezer or cgroup v2 hierarchy under /sys/fs/cgroup".into());
        };
        let dir = root.join(format!("gpusnap-frozen-{}", std::process::id()));
        let _ = fs::remove_dir(&dir);
        fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        let cg = FreezerCgroup { dir, root, v1, pid };
        let procs = cg.dir.join("cgroup.procs");
        fs::write(&procs, pid.to_string())
            .map_err(|e| format!("moving pid {pid} into {}: {e}", procs.display()))?;
        Ok(cg)
    }

    fn state_file(&self) -> PathBuf {
        self.dir.join(if self.v1 {
            "freezer.state"
        } else {
            "cgroup.freeze"
        })
    }

    fn set(&self, frozen: bool) {
        let value = match (self.v1, frozen) {
            (true, true) => "FROZEN",
            (true, false) => "THAWED",
            (false, true) => "1",
            (false, false) => "0",
        };
        fs::write(self.state_file(), value)
            .unwrap_or_else(|e| panic!("{}: {e}", self.state_file().display()));
    }

    /// Whether every task has stopped (v1 `FROZEN`, v2 `frozen 1`).
    fn frozen(&self) -> bool {
        if self.v1 {
            fs::read_to_string(self.state_file()).is_ok_and(|s| s.trim() == "FROZEN")
        } else {
            fs::read_to_string(self.dir.join("cgroup.events"))
                .is_ok_and(|s| s.lines().any(|l| l == "frozen 1"))
        }
    }

    fn freeze(&self) {
        self.set(true);
        let t0 = Instant::now();
        while !self.frozen() {
            assert!(
                t0.elapsed() < PROMPTLY,
                "{} did not freeze",
                self.dir.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for FreezerCgroup {
    fn drop(&mut self) {
        let _ = fs::write(self.state_file(), if self.v1 { "THAWED" } else { "0" });
        let _ = fs::write(self.root.join("cgroup.procs"), self.pid.to_string());
        let _ = fs::remove_dir(&self.dir);
    }
}

/// Every thread of `pid` is untraced and not stopped.
fn runs_free(pid: i32) -> bool {
    let t = procs::tids(pid);
    !t.is_empty()
        && t.iter().all(|&tid| {
            procs::tracer_pid(tid) == Some(0)
                && procs::stat(tid).is_some_and(|s| matches!(s.state, 'S' | 'R' | 'D'))
        })
}

#[test]
fn a_frozen_job_is_refused_before_criu_4_2() {
    let Some(h) = harness(TEST) else { return };
    let w = h.workdir(TEST);
    let fake = FakeDriver::new(h, &w);
    let mut wl = w.spawn(
        "fakegpu",
        FAKEGPU,
        &["--log", "fakegpu.log", "--seed", "77"],
        &[],
        &["fakegpu.log"],
    );
    let pid = wl.root();
    assert!(
        procs::tids(pid).iter().any(|t| {
            fs::read_to_string(format!("/proc/{pid}/task/{t}/comm"))
                .is_ok_and(|c| c.trim_end() == RESTORE_THREAD_COMM)
        }),
        "no {RESTORE_THREAD_COMM} thread"
    );
    let cg = match FreezerCgroup::new(pid) {
        Ok(cg) => cg,
        Err(why) => {
            skipped(TEST, &why);
            return;
        }
    };
    cg.freeze();
    // What gpusnap reads, from outside CRIU.
    let seen = freezer::frozen(HostPid(pid)).unwrap_or_else(|| {
        panic!(
            "gpusnap does not see pid {pid} frozen in {}",
            cg.dir.display()
        )
    });
    assert!(seen.file.starts_with(&cg.dir), "{seen}");

    let freeze_cgroup = format!("--freeze-cgroup={}", cg.dir.display());
    let t0 = Instant::now();
    let dump = fake.dump(&w, pid, true, &[], &[&freeze_cgroup]);
    let dump_s = t0.elapsed().as_secs_f64();
    let ctx = format!(
        "--- fake driver log of {pid} ---\n{}\n{}",
        fake.log_text(pid),
        dump.diagnostics()
    );
    let ops = fake.ops(pid);
    if h.criu_version < (4, 2, 0) {
        assert!(
            !dump.succeeded(),
            "the dump of a frozen job succeeded\n{ctx}"
        );
        let refusal = dump.gpusnap_lines_with("its cgroup is frozen");
        assert!(
            refusal
                .iter()
                .any(|l| l.contains(&cg.dir.display().to_string())
                    && l.contains("calls PAUSE_DEVICES before it thaws it")
                    && l.contains("Use CRIU 4.2 or later")),
            "no refusal naming the frozen cgroup and CRIU 4.2\n{ctx}"
        );
        let log = fs::read_to_string(&dump.log_path).unwrap_or_default();
        for stall in [
            "interrupted by a signal",
            "Timeout reached",
            "agent is there but unusable",
        ] {
            assert!(!log.contains(stall), "{stall:?} in the log\n{ctx}");
        }
        assert!(ops.is_empty(), "driver calls {:?}\n{ctx}", shorts(&ops));
        assert!(cg.frozen(), "the refused dump thawed the job\n{ctx}");
        eprintln!(
            "criu-tests: {TEST}: CRIU {}.{}.{} refused the frozen job in {dump_s:.2} s: {}",
            h.criu_version.0, h.criu_version.1, h.criu_version.2, refusal[0]
        );
    } else {
        dump.assert_ok();
        assert_eq!(
            shorts(&ops),
            ["lock:0", "checkpoint:0", "restore:0", "unlock:0"],
            "{ctx}"
        );
        assert!(
            dump.gpusnap_lines_with("its cgroup is frozen").is_empty(),
            "{ctx}"
        );
        assert!(cg.frozen(), "CRIU did not freeze the job again\n{ctx}");
        eprintln!(
            "criu-tests: {TEST}: CRIU {}.{}.{} thawed the frozen job first; dump -R in {dump_s:.2} s",
            h.criu_version.0, h.criu_version.1, h.criu_version.2
        );
    }

    // The engine's resume: the job runs on, untraced, its state intact.
    let at_thaw = wl.log(0).last();
    cg.set(false);
    let t0 = Instant::now();
    while !runs_free(pid) {
        assert!(
            t0.elapsed() < PROMPTLY,
            "pid {pid} is not running free after the thaw: {:?}",
            procs::stat(pid)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = CounterLog::wait_for(&wl.logs[0], at_thaw + MORE_TICKS, PROMPTLY)
        .unwrap_or_else(|e| panic!("pid {pid} does not run on after the thaw: {e}"));
    log.verify()
        .unwrap_or_else(|e| panic!("pid {pid}: its state is damaged: {e}"));
    assert!(wl.original_still_running(), "the job died");
    drop(cg);
}
