//! An exporter and the importer it spawned, ticking over one shared allocation (the stand-in
//! programs `fakegpu-ipc` and `fakegpu-share`, with `--loop`): started beside the split
//! harness, their logs read, their tree dumped, their sharing checked after it.

use super::split::Split;
use criu_tests::CriuRun;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// One tick line of a `--loop` log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tick {
    pub counter: u64,
    pub ok: bool,
}

/// The pid and the ticks of one side's log.
pub fn read_log(path: &Path) -> (Option<i32>, Vec<Tick>) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    // Only whole lines: the side may be writing its last one as we read (CI once read
    // "tick " and took it for a damaged tick).
    let whole = match text.rfind('\n') {
        Some(end) => &text[..=end],
        None => "",
    };
    let mut pid = None;
    let mut ticks = Vec::new();
    for line in whole.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["pid", p] => pid = p.parse().ok(),
            ["tick", _, "counter", c, "ok", ok] => ticks.push(Tick {
                counter: c.parse().unwrap_or(0),
                ok: *ok == "1",
            }),
            ["tick", ..] => ticks.push(Tick {
                counter: 0,
                ok: false,
            }),
            _ => {}
        }
    }
    (pid, ticks)
}

pub struct Pair {
    pub s: Split,
    pub log: PathBuf,
    pub exporter: std::process::Child,
}

impl Pair {
    /// Starts `fake-cuda-device`'s `bin` as `bin <args> <log> <extra>` under the agent, beside
    /// the split harness's own small workload, and waits until both sides tick.
    pub fn launch(test: &str, bin: &str, args: &[&str], extra: &[&str]) -> Option<Pair> {
        Self::launch_with_nofile(test, bin, args, extra, None)
    }

    /// [`launch`](Self::launch) with the pair's soft `RLIMIT_NOFILE` set to `nofile` (the
    /// importer inherits it).
    pub fn launch_with_nofile(
        test: &str,
        bin: &str,
        args: &[&str],
        extra: &[&str],
        nofile: Option<u64>,
    ) -> Option<Pair> {
        // The harness's own workload is one small process; the pair is started beside it.
        let s = Split::launch(
            test,
            1,
            &["--seed", "5", "--allocs", "1", "--mib", "2"],
            &[],
        )?;
        let log = s.w.path.join("share");
        let lib = super::libcuda_dir(&s.w.path);
        let agent = s.w.harness().agent_so().expect("agent").to_owned();
        let mut cmd = Command::new(super::built("fake-cuda-device", bin));
        cmd.args(args)
            .arg(&log)
            .args(extra)
            .env("LD_LIBRARY_PATH", &lib)
            .env("LD_PRELOAD", &agent)
            .env("GPUSNAP_AGENT_DEBUG", "1")
            .env("FAKECUDA_DIR", &s.state)
            .env_remove("GPUSNAP_AGENT_MIN_BYTES")
            .stdout(std::fs::File::create(s.w.path.join("share.out")).expect("out"))
            .stderr(std::fs::File::create(s.w.path.join("share.err")).expect("err"));
        if let Some(soft) = nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: between fork and exec only getrlimit/setrlimit run (async-signal-safe),
            // on plain structs of this closure.
            unsafe {
                cmd.pre_exec(move || {
                    let mut lim = libc::rlimit {
                        rlim_cur: 0,
                        rlim_max: 0,
                    };
                    if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    lim.rlim_cur = soft.min(lim.rlim_max);
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                })
            };
        }
        let exporter = criu_tests::procs::spawn_in_new_session(&mut cmd).expect(bin);
        let p = Pair { s, log, exporter };
        p.wait_ticks(5);
        Some(p)
    }

    pub fn side(&self, which: &str) -> PathBuf {
        self.log.with_extension(which)
    }

    /// Waits until both sides logged `n` more ticks than now; returns (exporter, importer).
    pub fn wait_ticks(&self, n: usize) -> (Vec<Tick>, Vec<Tick>) {
        let base = (
            read_log(&self.side("exporter")).1.len(),
            read_log(&self.side("importer")).1.len(),
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let e = read_log(&self.side("exporter")).1;
            let i = read_log(&self.side("importer")).1;
            if e.len() >= base.0 + n && i.len() >= base.1 + n {
                return (e, i);
            }
            assert!(
                Instant::now() < deadline,
                "the pair stopped ticking: exporter {} ticks, importer {} ticks\n{}",
                e.len(),
                i.len(),
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the exporter alone logged `n` more ticks.
    pub fn wait_exporter_ticks(&self, n: usize) {
        let base = read_log(&self.side("exporter")).1.len();
        let deadline = Instant::now() + Duration::from_secs(20);
        while read_log(&self.side("exporter")).1.len() < base + n {
            assert!(
                Instant::now() < deadline,
                "the exporter stopped\n{}",
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pids(&self) -> (i32, i32) {
        (
            read_log(&self.side("exporter")).0.expect("exporter pid"),
            read_log(&self.side("importer")).0.expect("importer pid"),
        )
    }

    pub fn describe(&self) -> String {
        let tail = |p: PathBuf| {
            let t = std::fs::read_to_string(&p).unwrap_or_default();
            let lines: Vec<&str> = t.lines().collect();
            lines[lines.len().saturating_sub(8)..].join("\n")
        };
        format!(
            "--- exporter log ---\n{}\n--- importer log ---\n{}\n--- stderr ---\n{}",
            tail(self.side("exporter")),
            tail(self.side("importer")),
            tail(self.s.w.path.join("share.err"))
        )
    }

    pub fn dump(&self, pid: i32, leave_running: bool) -> CriuRun {
        let pid = pid.to_string();
        let mut extra = vec!["-t", pid.as_str()];
        if leave_running {
            extra.push("--leave-running");
        }
        self.s.criu("dump", "dump.log", &extra, &[])
    }

    /// Both sides run on, bit-exact, and still share the memory: every tick `ok`, the counter
    /// the importer bumps keeps growing past `before`, and the exporter sees it grow.
    pub fn assert_shared_on(&self, before: u64, run: &CriuRun) {
        let (e, i) = self.wait_ticks(10);
        let all_ok = e.iter().chain(&i).all(|t| t.ok);
        assert!(
            all_ok,
            "a tick saw a damaged buffer\n{}\n{}",
            self.s.describe(run),
            self.describe()
        );
        let last_i = i.last().expect("importer ticks").counter;
        let last_e = e.last().expect("exporter ticks").counter;
        assert!(
            last_i > before && last_e > before,
            "the counter did not grow past {before} on both sides (importer {last_i}, exporter {last_e}): the memory is not shared\n{}\n{}",
            self.s.describe(run),
            self.describe()
        );
    }

    pub fn counter(&self) -> u64 {
        read_log(&self.side("importer"))
            .1
            .last()
            .map_or(0, |t| t.counter)
    }

    /// Waits until both dumped processes are gone (their pids free for the restore); the
    /// importer, an orphan once the exporter died, may be the harness's to reap.
    pub fn wait_gone(&self) {
        let (e, i) = self.pids();
        let deadline = Instant::now() + Duration::from_secs(20);
        for pid in [e, i] {
            while Path::new(&format!("/proc/{pid}")).exists() {
                // SAFETY: waitpid with WNOHANG and no status; a pid that is not our child
                // only fails.
                unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
                assert!(
                    Instant::now() < deadline,
                    "pid {pid} still there after the dump"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    /// The tree dumped, then CRIU killed in its restore before the importer maps its share
    /// again (`restore-reimport`): nothing of the tree runs (the kernel kills the half-restored
    /// processes), and a new restore brings both back, still sharing.
    pub fn killed_restore_runs_nothing_and_a_second_restore_shares(mut self) {
        let p = &mut self;
        let (exporter, importer) = p.pids();
        let dump =
            p.s.criu("dump", "dump.log", &["-t", &exporter.to_string()], &[]);
        p.s.assert_ok(&dump);
        let before = p.counter();
        let _ = p.exporter.wait();
        p.wait_gone();
        // The pair's stderr as at the dump: the agents' debug lines of the killed restore grow it,
        // and CRIU restores only a file of the size it dumped.
        let outputs: Vec<(PathBuf, u64)> = ["share.err", "share.out"]
            .iter()
            .map(|f| p.s.w.path.join(f))
            .map(|f| {
                let len = std::fs::metadata(&f).map_or(0, |m| m.len());
                (f, len)
            })
            .collect();
        // The stand-in keeps each process's driver state in a file (the real driver keeps it in the
        // process, restored with it): as at the dump, for the second restore.
        let driver_states: Vec<(PathBuf, String)> = [exporter, importer]
            .iter()
            .map(|pid| p.s.state.join(format!("{pid}.state")))
            .map(|f| {
                let text = std::fs::read_to_string(&f).unwrap_or_default();
                (f, text)
            })
            .collect();
        let restore = p.s.criu(
            "restore",
            "restore.log",
            &["--restore-detached"],
            &[("GPUSNAP_TEST_KILL_CRIU_AT", "restore-reimport")],
        );
        assert!(!restore.succeeded(), "{}", p.s.describe(&restore));
        p.s.assert_line(&restore, &["GPUSNAP_TEST_KILL_CRIU_AT=restore-reimport"]);
        // Killed with CRIU (PTRACE_O_EXITKILL): no tick after the dump's last one.
        std::thread::sleep(Duration::from_millis(300));
        let ticks_now = read_log(&p.side("importer")).1.len();
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            read_log(&p.side("importer")).1.len(),
            ticks_now,
            "the importer ticked after CRIU died in the restore\n{}",
            p.describe()
        );
        p.wait_gone();
        for (f, len) in &outputs {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(f)
                .expect("pair output");
            file.set_len(*len)
                .expect("truncate to its size at the dump");
        }
        for (f, text) in &driver_states {
            std::fs::write(f, text).expect("the stand-in's driver state as at the dump");
        }
        let again = p.s.restore_in("restore-again.log", &[]);
        p.s.assert_ok(&again);
        p.assert_shared_on(before, &again);
        p.kill_pair();
    }

    pub fn kill_pair(&mut self) {
        let (e, i) = self.pids();
        for pid in [i, e] {
            // SAFETY: kill(2) of the test's own workload.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = self.exporter.wait();
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        if let (Some(e), Some(i)) = (
            read_log(&self.side("exporter")).0,
            read_log(&self.side("importer")).0,
        ) {
            for pid in [i, e] {
                // SAFETY: kill(2) of the test's own workload (or of nothing any more).
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let _ = self.exporter.try_wait();
    }
}
