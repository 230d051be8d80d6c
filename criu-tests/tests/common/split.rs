//! The split path with real CRIU on the stand-in drivers, as the tests drive it: a workload
//! (`fakegpu-vmm`) with the agent preloaded on `libfakecudadev.so`, CRIU with the plugin and the
//! checkpoint-API stand-in `libfakecuda.so`, both sharing `FAKECUDA_DIR`.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::{MORE_TICKS, Vmm, libcuda_dir};
use criu_tests::fixtures::output_text;
use criu_tests::{CriuRun, WorkDir, harness, procs};

/// `libfakecuda.so` and the `gpusnap` CLI.
pub fn built() -> &'static (PathBuf, PathBuf) {
    static BUILT: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    BUILT.get_or_init(|| {
        (
            super::built("fake-cuda", "libfakecuda.so"),
            super::built("gpusnap", "gpusnap"),
        )
    })
}

/// What lives outside CRIU's images but must be as at the dump for a restore: the stand-in's
/// driver state of the process (the real driver keeps it inside the process) and the size of the
/// workload's output file (CRIU checks a regular file's size; the agent thread of a killed
/// restore may have written debug lines to it, the application threads never ran).
#[derive(Default)]
pub struct AtDump {
    pub driver_state: String,
    pub out_len: u64,
}

impl AtDump {
    pub fn of(s: &Split) -> AtDump {
        AtDump {
            driver_state: s.driver_state(),
            out_len: fs::metadata(&s.vmm.out).expect("workload output").len(),
        }
    }

    /// Puts both back, for another restore from the same image after a failed one.
    pub fn put_back(&self, s: &Split) {
        let state = s.state.join(format!("{}.state", s.vmm.pid()));
        fs::write(state, format!("{}\n", self.driver_state)).expect("reset the driver state");
        fs::OpenOptions::new()
            .write(true)
            .open(&s.vmm.out)
            .and_then(|f| f.set_len(self.out_len))
            .expect("truncate the workload output");
    }
}

/// One test's setup: the work dir, the stand-in drivers' shared state dir, the workload.
pub struct Split {
    pub w: WorkDir,
    pub fakecuda_so: PathBuf,
    /// The workload's `libcuda.so.1` (the device stand-in under the driver's name).
    pub job_libcuda: PathBuf,
    pub state: PathBuf,
    pub cli: PathBuf,
    pub vmm: Vmm,
    /// Memory each process maps with its own VMM calls (`--app-vmm`): moved like converted
    /// memory unless `GPUSNAP_AGENT_APP_VMM=0`.
    pub app_vmm: bool,
    /// Set in the workload's and in CRIU's environment (stand-in settings such as
    /// `FAKECUDA_DEVICES`).
    pub common_env: Vec<(&'static str, &'static str)>,
}

impl Split {
    /// The workload with half its data allocations on a second GPU, both stand-ins reporting
    /// two.
    pub fn two_gpus(test: &str) -> Option<Split> {
        Split::launch(
            test,
            1,
            &[
                "--seed",
                "7",
                "--allocs",
                "4",
                "--mib",
                "4",
                "--devices",
                "2",
            ],
            &[("FAKECUDA_DEVICES", "2")],
        )
    }

    /// Starts `fakegpu-vmm` with `procs` processes and `args`, the agent preloaded, `env` in
    /// its environment and in CRIU's.
    pub fn launch(
        test: &str,
        procs: usize,
        args: &[&str],
        env: &[(&'static str, &'static str)],
    ) -> Option<Split> {
        Split::launch_agent(test, procs, args, env, None)
    }

    /// [`launch`](Self::launch) with the hostile test build of the agent
    /// (`criu_tests::build::hostile_agent`) playing `attack` (`GPUSNAP_HOSTILE`).
    pub fn hostile(
        test: &str,
        attack: &'static str,
        args: &[&str],
        env: &[(&'static str, &'static str)],
    ) -> Option<Split> {
        let mut env = env.to_vec();
        env.push(("GPUSNAP_HOSTILE", attack));
        let mut s = Split::launch_agent(
            test,
            1,
            args,
            &env,
            Some(criu_tests::build::hostile_agent()),
        )?;
        // The attack is the job's alone: CRIU's configuration would refuse the variable.
        s.common_env.retain(|(k, _)| *k != "GPUSNAP_HOSTILE");
        Some(s)
    }

    /// [`launch`](Self::launch) with `agent` preloaded (else the workspace's agent).
    pub fn launch_agent(
        test: &str,
        procs: usize,
        args: &[&str],
        env: &[(&'static str, &'static str)],
        agent: Option<PathBuf>,
    ) -> Option<Split> {
        let h = harness(test)?;
        let w = h.workdir(test);
        let (fakecuda_so, cli) = built().clone();
        let agent =
            agent.unwrap_or_else(|| h.agent_so().unwrap_or_else(|e| panic!("{e}")).to_owned());
        let state = w.path.join("fakecuda");
        fs::create_dir_all(&state).expect("mkdir fakecuda");
        let lib = libcuda_dir(&w.path);
        let mut vmm_env: Vec<(&str, &Path)> = vec![
            ("LD_LIBRARY_PATH", &lib),
            ("LD_PRELOAD", &agent),
            ("GPUSNAP_AGENT_DEBUG", Path::new("1")),
            ("FAKECUDADEV_DEBUG", Path::new("1")),
            ("FAKECUDA_DIR", &state),
        ];
        vmm_env.extend(env.iter().map(|(k, v)| (*k, Path::new(*v))));
        let vmm = Vmm::start(&w.path, "vmm", procs, args, &vmm_env);
        let job_libcuda = lib.join("libcuda.so.1");
        Some(Split {
            w,
            fakecuda_so,
            job_libcuda,
            state,
            cli,
            vmm,
            app_vmm: args.contains(&"--app-vmm"),
            common_env: env.to_vec(),
        })
    }

    /// `criu <action>` with the plugin, the checkpoint-API stand-in and `config` (gpusnap
    /// settings as `GPUSNAP_<KEY>` variables) in its environment; `log` in the work dir.
    pub fn criu(
        &self,
        action: &str,
        log: &str,
        extra: &[&str],
        config: &[(&str, &str)],
    ) -> CriuRun {
        self.criu_at(&self.w.images, action, log, extra, config)
    }

    /// [`criu`](Self::criu) with the image directory `images` (for a series of dumps).
    pub fn criu_at(
        &self,
        images: &Path,
        action: &str,
        log: &str,
        extra: &[&str],
        config: &[(&str, &str)],
    ) -> CriuRun {
        let log = self.w.path.join(log);
        let mut args = self.w.criu_args_in(action, images, &log);
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut env = vec![
            (
                "GPUSNAP_LIBCUDA",
                self.fakecuda_so.to_str().expect("utf-8 path"),
            ),
            ("FAKECUDA_DIR", self.state.to_str().expect("utf-8 path")),
            // A restore's keeper loads the job's driver (here the device stand-in).
            (
                "GPUSNAP_TEST_KEEPER_LIBCUDA",
                self.job_libcuda.to_str().expect("utf-8 path"),
            ),
        ];
        env.extend_from_slice(&self.common_env);
        env.extend_from_slice(config);
        self.w.run_criu(&args, &env, &log)
    }

    pub fn dump_with(&self, leave_running: bool, config: &[(&str, &str)]) -> CriuRun {
        let pid = self.vmm.pid().to_string();
        let mut extra = vec!["-t", pid.as_str()];
        if leave_running {
            extra.push("--leave-running");
        }
        self.criu("dump", "dump.log", &extra, config)
    }

    pub fn dump(&self, leave_running: bool) -> CriuRun {
        self.dump_with(leave_running, &[])
    }

    pub fn restore_with(&self, config: &[(&str, &str)]) -> CriuRun {
        self.restore_in("restore.log", config)
    }

    /// `criu restore` logging to `log` in the work dir.
    pub fn restore_in(&self, log: &str, config: &[(&str, &str)]) -> CriuRun {
        self.criu("restore", log, &["--restore-detached"], config)
    }

    /// The stand-in driver's call log for the root process.
    pub fn calls(&self) -> String {
        fs::read_to_string(self.state.join(format!("{}.log", self.vmm.pid()))).unwrap_or_default()
    }

    pub fn restore(&self) -> CriuRun {
        self.restore_with(&[])
    }

    /// Empties the image dir for another dump.
    pub fn clear_images(&self) {
        fs::remove_dir_all(&self.w.images).expect("remove images");
        fs::create_dir_all(&self.w.images).expect("mkdir images");
    }

    /// Arms a fault in the workload's stand-in driver (see `inject.rs`): `fail <call>` or
    /// `hang <call>`, in every process.
    pub fn inject(&self, directive: &str) {
        for pid in &self.vmm.pids {
            let p = self.state.join(format!("{pid}.dev-inject"));
            fs::write(&p, format!("{directive}\n")).expect("write the injection file");
        }
    }

    /// After a dump that killed the workload: reaped, its pids free for the restore; returns
    /// the last tick of each process.
    pub fn reap_dumped(&mut self) -> Vec<u64> {
        assert!(
            self.vmm.wait_original(),
            "CRIU should have killed the workload"
        );
        for &pid in &self.vmm.pids {
            procs::reap(pid, super::WAIT).unwrap_or_else(|e| panic!("{e}"));
        }
        for &pid in &self.vmm.pids {
            procs::wait_pid_free(pid, super::WAIT).unwrap_or_else(|e| panic!("{e}"));
        }
        self.vmm.last_ticks()
    }

    /// After a failed restore: nothing of the workload runs and its logs did not grow.
    pub fn assert_nothing_runs(&self, last: &[u64], run: &CriuRun) {
        for &pid in &self.vmm.pids {
            procs::reap(pid, super::WAIT).unwrap_or_else(|e| panic!("{e}"));
            assert!(!procs::is_alive(pid), "{}", self.describe(run));
        }
        assert_eq!(
            self.vmm.last_ticks(),
            last,
            "the workload ran after a failed restore\n{}",
            self.describe(run)
        );
    }

    /// Everything a failure message needs: the criu log's gpusnap lines, the workload, the
    /// stand-in driver's call log.
    pub fn describe(&self, run: &CriuRun) -> String {
        let mut calls = String::new();
        for pid in &self.vmm.pids {
            let log = fs::read_to_string(self.state.join(format!("{pid}.log")))
                .unwrap_or_else(|e| format!("<{e}>"));
            calls.push_str(&format!("--- fake driver calls for pid {pid} ---\n{log}"));
        }
        format!("{}\n{}\n{calls}", run.diagnostics(), self.vmm.describe())
    }

    pub fn assert_ok(&self, run: &CriuRun) {
        assert!(
            run.succeeded(),
            "criu failed ({}): {}\n{}",
            run.status,
            run.cmdline,
            self.describe(run)
        );
    }

    /// Asserts that a gpusnap line of `run` contains every one of `needles`.
    pub fn assert_line(&self, run: &CriuRun, needles: &[&str]) {
        assert!(
            run.gpusnap_lines()
                .iter()
                .any(|l| needles.iter().all(|n| l.contains(n))),
            "no gpusnap line with {needles:?} in {}\n{}",
            run.log_path.display(),
            self.describe(run)
        );
    }

    /// `gpusnap ARGS` with the plugin's stand-in driver: whether it succeeded, and its stdout and
    /// stderr.
    pub fn run_cli(&self, args: &[&str]) -> (bool, String) {
        let out = std::process::Command::new(&self.cli)
            .args(args)
            .env("GPUSNAP_LIBCUDA", &self.fakecuda_so)
            .env("FAKECUDA_DIR", &self.state)
            .env_remove("GPUSNAP_TEST_KILL_CRIU_AT")
            .output()
            .expect("run gpusnap");
        let text = output_text(&out);
        (out.status.success(), text)
    }

    /// The driver state the stand-in keeps for the workload (`running` without a file).
    pub fn driver_state(&self) -> String {
        fs::read_to_string(self.state.join(format!("{}.state", self.vmm.pid())))
            .map_or_else(|_| "running".into(), |t| t.trim().to_owned())
    }

    /// Has the workload rewrite the first MiB of its allocation 0 and waits until a tick after
    /// that has been logged.
    pub fn change_some_data(&self) {
        let log = &self.vmm.logs[0];
        let done = PathBuf::from(format!("{}.mutated", log.display()));
        let _ = fs::remove_file(&done);
        fs::write(format!("{}.mutate", log.display()), b"").expect("request a change");
        let t0 = std::time::Instant::now();
        while !done.exists() {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(20),
                "the workload did not change its data\n{}",
                self.vmm.describe()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let after = self.vmm.last_ticks()[0] + 1;
        self.vmm.wait_for_tick(after);
    }

    /// The workload runs on: every process writes `MORE_TICKS` more ticks after `last`, and
    /// its whole log is consistent (every tick `ok 1`, consecutive, the device counter equal
    /// to the tick).
    pub fn assert_runs_on(&self, last: &[u64], run: &CriuRun) {
        assert!(
            last.iter().all(|&t| t >= 3),
            "too few ticks before: {last:?}"
        );
        let max = last.iter().copied().max().unwrap_or(0);
        let logs = self.vmm.wait_for_tick(max + MORE_TICKS);
        for (log, &pid) in logs.iter().zip(&self.vmm.pids) {
            if let Err(e) = log.check() {
                panic!(
                    "pid {pid}, checkpoint at ticks {last:?}: {e}\n{}",
                    self.describe(run)
                );
            }
            assert_eq!(log.pid, pid);
        }
    }
}

/// The keeper's pid in CRIU's log so far: the number after the first `keeper pid ` (the line
/// that plans the hand-over, or a restore's keeper line).
pub fn keeper_pid(log: &str) -> Option<i32> {
    log.lines()
        .find_map(|l| l.split("keeper pid ").nth(1))
        .and_then(|t| t.split_whitespace().next())
        .and_then(|p| p.parse::<i32>().ok())
}
