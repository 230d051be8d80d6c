//! What the tests on the stand-in CUDA device (`fake-cuda-device`) share: the built stand-in
//! library and its `libcuda.so.1` link, starting `fakegpu-vmm`, and reading its log.

#![allow(dead_code)] // each test binary uses its own part

pub mod pair;
pub mod split;

/// Ticks a process must write after a restore or rollback to count as running on.
pub const MORE_TICKS: u64 = 5;

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

#[allow(unused_imports)] // each test binary uses its own part
pub use criu_tests::build::{built, profile_dir};

/// How long a workload may take to write the ticks a test waits for.
pub const WAIT: Duration = Duration::from_secs(20);

/// `libfakecudadev.so`, the stand-in device's library.
pub fn fakecudadev_so() -> PathBuf {
    built("fake-cuda-device", "libfakecudadev.so")
}

/// `fakegpu-vmm`, the workload on the stand-in device (a binary of `fake-cuda-device`).
pub fn vmm_bin() -> PathBuf {
    built("fake-cuda-device", "fakegpu-vmm")
}

/// `dir/lib/libcuda.so.1` → `libfakecudadev.so`; returns `dir/lib` (for `LD_LIBRARY_PATH`).
pub fn libcuda_dir(dir: &Path) -> PathBuf {
    let lib = dir.join("lib");
    fs::create_dir_all(&lib).expect("mkdir lib");
    let link = lib.join("libcuda.so.1");
    let _ = fs::remove_file(&link);
    // A hard link (a copy across file systems), not a symlink: the workload's mappings then
    // name `libcuda.so.1`, as a real driver's do, which is how the plugin finds the library a
    // job uses (its keeper loads the same one).
    let so = fakecudadev_so();
    fs::hard_link(&so, &link)
        .or_else(|_| fs::copy(&so, &link).map(drop))
        .expect("libcuda.so.1 in the test's lib dir");
    lib
}

/// A running `fakegpu-vmm` (with `--procs P`: its `P` processes); killed and reaped on drop.
#[derive(Debug)]
pub struct Vmm {
    /// Root process first, then the children in the order of their logs.
    pub pids: Vec<i32>,
    /// `<name>.log`, then `<name>.log.1` ...
    pub logs: Vec<PathBuf>,
    /// Their stdout and stderr (shared).
    pub out: PathBuf,
    child: Option<Child>,
}

impl Vmm {
    /// Starts `fakegpu-vmm --log <dir>/<name>.log args...` in a new session with `env`, and
    /// waits for the first 3 ticks of each of its `procs` processes (`--procs` is added when
    /// there is more than one).
    pub fn start(
        dir: &Path,
        name: &str,
        procs: usize,
        args: &[&str],
        env: &[(&str, &Path)],
    ) -> Vmm {
        let log = dir.join(format!("{name}.log"));
        let out = dir.join(format!("{name}.out"));
        // Empty, then open for appending only: CRIU records no size for a file open
        // `O_WRONLY|O_APPEND` (a log), so a restore does not refuse the output for having grown
        // since the dump (a job left running by `dump -R`, then restored from that image).
        fs::File::create(&out).expect("create workload output");
        let f = fs::OpenOptions::new()
            .append(true)
            .open(&out)
            .expect("open workload output");
        let mut cmd = Command::new(vmm_bin());
        for v in [
            "GPUSNAP_TEST_PLUGIN_SO",
            "GPUSNAP_TEST_AGENT_SO",
            "GPUSNAP_AGENT_EAGER",
            "GPUSNAP_AGENT_DISABLE",
            "GPUSNAP_AGENT_MIN_BYTES",
        ] {
            cmd.env_remove(v);
        }
        cmd.arg("--log").arg(&log).args(args);
        if procs > 1 {
            cmd.args(["--procs", &procs.to_string()]);
        }
        cmd.envs(env.iter().map(|(k, v)| (k, v.as_os_str())))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(f.try_clone().expect("dup"))
            .stderr(f);
        // SAFETY: the closure runs in the forked child before exec and only calls setsid(2),
        // which is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start fakegpu-vmm");
        let mut logs = vec![log.clone()];
        logs.extend((1..procs).map(|i| PathBuf::from(format!("{}.{i}", log.display()))));
        let mut vmm = Vmm {
            pids: vec![child.id() as i32],
            logs,
            out,
            child: Some(child),
        };
        let first = vmm.wait_for_tick(3);
        assert_eq!(first[0].pid, vmm.pids[0], "{}", vmm.describe());
        vmm.pids = first.iter().map(|l| l.pid).collect();
        vmm
    }

    /// The root process.
    pub fn pid(&self) -> i32 {
        self.pids[0]
    }

    /// Every process's log now.
    pub fn read(&self) -> Vec<VmmLog> {
        self.logs
            .iter()
            .map(|p| {
                VmmLog::read(p)
                    .unwrap_or_else(|e| panic!("{e}\n{}", self.describe()))
                    .unwrap_or_else(|| panic!("no log header yet\n{}", self.describe()))
            })
            .collect()
    }

    /// The last tick of every process.
    pub fn last_ticks(&self) -> Vec<u64> {
        self.read().iter().map(VmmLog::last_tick).collect()
    }

    /// Waits until every process has logged tick `n`.
    pub fn wait_for_tick(&self, n: u64) -> Vec<VmmLog> {
        let deadline = Instant::now() + WAIT;
        loop {
            let logs: Vec<Option<VmmLog>> = self
                .logs
                .iter()
                .map(|p| VmmLog::read(p).ok().flatten())
                .collect();
            if logs
                .iter()
                .all(|l| l.as_ref().is_some_and(|l| l.last_tick() >= n))
            {
                return logs.into_iter().flatten().collect();
            }
            if Instant::now() >= deadline {
                panic!(
                    "fakegpu-vmm did not reach tick {n} within {WAIT:?}\n{}",
                    self.describe()
                );
            }
            sleep(Duration::from_millis(20));
        }
    }

    /// The workload's output and the end of its logs, for failure messages.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        for p in &self.logs {
            let log = fs::read_to_string(p).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            s.push_str(&format!(
                "--- fakegpu-vmm log {} (newest first) ---\n{}\n",
                p.display(),
                tail.join("\n")
            ));
        }
        let out = fs::read_to_string(&self.out).unwrap_or_default();
        let out_tail: Vec<&str> = out.lines().rev().take(60).collect();
        s.push_str(&format!(
            "--- output {} (last 60 lines, newest first) ---\n{}",
            self.out.display(),
            out_tail.join("\n")
        ));
        s
    }

    /// Whether the root process started here is still running (not exited, not reaped).
    pub fn original_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Waits for the original root process to end (CRIU killed it after a dump); returns
    /// whether it was killed by a signal rather than exiting (true once it is gone: a restored
    /// copy is reaped by `procs::reap`).
    pub fn wait_original(&mut self) -> bool {
        let Some(mut c) = self.child.take() else {
            return true;
        };
        let st = c.wait().expect("wait for fakegpu-vmm");
        !st.success() && st.code().is_none()
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        for &pid in &self.pids {
            // SAFETY: kill(2) has no memory-safety preconditions; the pids are our workload's
            // (or its restored copies, which have the same pids).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
        // Restored copies and orphaned children are our children too (we are a subreaper in
        // the CRIU tests): reap them until they are gone (at most 5 s each).
        for &pid in &self.pids {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
                let mut status = 0;
                // SAFETY: waitpid writes only to status; WNOHANG never blocks.
                unsafe { libc::waitpid(pid, &mut status, libc::__WALL | libc::WNOHANG) };
                sleep(Duration::from_millis(5));
            }
        }
    }
}

/// One log line after the header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tick {
    pub tick: u64,
    pub counter: u64,
    pub ok: bool,
}

/// The log of `fakegpu-vmm`: `pid P seed S allocs A bytes B`, then `tick T counter C ok 0|1`.
#[derive(Clone, Debug)]
pub struct VmmLog {
    pub pid: i32,
    pub allocs: u64,
    pub bytes: u64,
    pub ticks: Vec<Tick>,
}

impl VmmLog {
    /// `Ok(None)` while the header is not complete; an incomplete last line is ignored.
    pub fn read(path: &Path) -> Result<Option<VmmLog>, String> {
        let text = match fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let Some(end) = text.rfind('\n') else {
            return Ok(None);
        };
        let mut lines = text[..end].lines();
        let bad = |l: &str| format!("{}: bad line {l:?}", path.display());
        let header = lines.next().unwrap_or_default();
        let h: Vec<&str> = header.split(' ').collect();
        let (pid, allocs, bytes) = match h.as_slice() {
            ["pid", p, "seed", _, "allocs", a, "bytes", b] => (
                p.parse().map_err(|_| bad(header))?,
                a.parse().map_err(|_| bad(header))?,
                b.parse().map_err(|_| bad(header))?,
            ),
            _ => return Err(bad(header)),
        };
        let mut ticks = Vec::new();
        for l in lines {
            let f: Vec<&str> = l.split(' ').collect();
            let ["tick", t, "counter", c, "ok", ok] = f.as_slice() else {
                return Err(bad(l));
            };
            ticks.push(Tick {
                tick: t.parse().map_err(|_| bad(l))?,
                counter: c.parse().map_err(|_| bad(l))?,
                ok: match *ok {
                    "1" => true,
                    "0" => false,
                    _ => return Err(bad(l)),
                },
            });
        }
        Ok(Some(VmmLog {
            pid,
            allocs,
            bytes,
            ticks,
        }))
    }

    pub fn last_tick(&self) -> u64 {
        self.ticks.last().map_or(0, |t| t.tick)
    }

    /// Every tick so far is `ok 1`, ticks are consecutive from 1 and the device counter equals
    /// the tick: nothing was lost, reset or damaged, before or after a checkpoint.
    pub fn check(&self) -> Result<(), String> {
        for (i, t) in self.ticks.iter().enumerate() {
            let want = i as u64 + 1;
            if t.tick != want {
                return Err(format!("line {}: {t:?}, expected tick {want}", i + 2));
            }
            if !t.ok || t.counter != t.tick {
                return Err(format!("line {}: {t:?}", i + 2));
            }
        }
        Ok(())
    }
}
