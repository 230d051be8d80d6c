//! The shared test environment: root check, CRIU root, plugin build, per-test work dirs.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::build;
use crate::counter_log::CounterLog;
use crate::criu::{BackgroundCriu, CriuRun};
use crate::fixtures::output_text;
use crate::procs;

/// Set to `1` to skip the CRIU tests (they print that they were skipped).
pub const SKIP_ENV: &str = "GPUSNAP_SKIP_CRIU_TESTS";

/// Use this prebuilt plugin instead of building `gpusnap-plugin` (e.g. on a GPU host
/// without a toolchain, or to test the harness with another plugin).
pub const PLUGIN_SO_ENV: &str = "GPUSNAP_TEST_PLUGIN_SO";

/// Use this prebuilt agent instead of building `gpusnap-agent`.
pub const AGENT_SO_ENV: &str = "GPUSNAP_TEST_AGENT_SO";
/// A prebuilt `gpusnap-keeper` to use instead of building one.
pub const KEEPER_ENV: &str = "GPUSNAP_TEST_KEEPER";

/// Variables meant for this harness or for scripts/install-criu.sh only. gpusnap rejects
/// unknown `GPUSNAP_*` variables in its environment, so they are removed from the
/// environment of criu and of the workloads.
pub const HARNESS_ONLY_ENV: &[&str] = &[
    PLUGIN_SO_ENV,
    AGENT_SO_ENV,
    "GPUSNAP_REPO",
    "GPUSNAP_CRIU_FORCE",
    "GPUSNAP_CRIU_MIRROR",
    "GPUSNAP_CRIU_SUITE",
];

/// How long to wait for workloads to make progress or for pids to become free.
pub const WAIT: Duration = Duration::from_secs(20);

/// Everything the tests need, set up once per test binary.
#[derive(Debug)]
pub struct Harness {
    /// Repository root.
    pub repo: PathBuf,
    /// `target/<profile>` of the running test binary.
    pub profile_dir: PathBuf,
    /// `scripts/criu`.
    pub criu: PathBuf,
    /// The freshly built `libgpusnap_plugin.so`.
    pub plugin_so: PathBuf,
    /// The freshly built `gpusnap-keeper`, installed next to the plugin as a package does.
    pub keeper: PathBuf,
    /// CRIU's version as (major, minor, patch), from `criu --version`.
    pub criu_version: (u32, u32, u32),
    agent: OnceLock<Result<PathBuf, String>>,
}

static HARNESS: OnceLock<Result<Harness, String>> = OnceLock::new();

/// The harness, or `None` if `GPUSNAP_SKIP_CRIU_TESTS=1` (the test should return early).
///
/// Panics with an explanation if CRIU cannot be used (not root, install failure, plugin build
/// failure): a CRIU test must never pass silently without running CRIU.
pub fn harness(test: &str) -> Option<&'static Harness> {
    if std::env::var(SKIP_ENV).is_ok_and(|v| v == "1") {
        skipped(test, &format!("{SKIP_ENV}=1"));
        return None;
    }
    match HARNESS.get_or_init(Harness::init) {
        Ok(h) => Some(h),
        Err(e) => panic!(
            "criu-tests: cannot run CRIU tests: {e}\n(set {SKIP_ENV}=1 to skip them explicitly)"
        ),
    }
}

/// Reports a skipped test on the real stderr: `eprintln!` would be captured by the test
/// harness and never shown for a passing test. The line, `criu-tests: SKIPPED <test>: <why>`,
/// is what `scripts/test.sh` lists in its summary; it is written with one `write` so that other
/// tests' output does not cut it.
pub fn skipped(test: &str, why: &str) {
    use std::io::Write;
    let line = format!("criu-tests: SKIPPED {test}: {why}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

impl Harness {
    fn init() -> Result<Harness, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(
                "they must run as root (criu dump/restore needs CAP_SYS_ADMIN and ptrace)".into(),
            );
        }
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let repo = find_repo(&exe)?;
        let criu = repo.join("scripts/criu");
        let install = repo.join("scripts/install-criu.sh");
        if !criu.is_file() || !install.is_file() {
            return Err(format!(
                "{} or {} missing",
                criu.display(),
                install.display()
            ));
        }
        // <target>/<profile>/deps/<test binary>
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .ok_or_else(|| format!("unexpected test binary location {}", exe.display()))?
            .to_owned();

        // Fast (a version check) when the root is already there.
        run_checked(&mut Command::new(&install), "scripts/install-criu.sh")?;
        let v = run_checked(
            Command::new(&criu).arg("--version"),
            "scripts/criu --version",
        )?;
        eprintln!("criu-tests: using {}: {}", criu.display(), v.trim());
        let criu_version = parse_criu_version(&v)
            .ok_or_else(|| format!("no `Version: X.Y[.Z]` line in `criu --version`: {v}"))?;

        let plugin_so = prebuilt(PLUGIN_SO_ENV).unwrap_or_else(|| {
            build::package(&profile_dir, "gpusnap-plugin", "libgpusnap_plugin.so")
        })?;
        let keeper = prebuilt(KEEPER_ENV)
            .unwrap_or_else(|| build::package(&profile_dir, "gpusnap-keeper", "gpusnap-keeper"))?;
        procs::become_subreaper().map_err(|e| format!("PR_SET_CHILD_SUBREAPER: {e}"))?;
        Ok(Harness {
            repo,
            profile_dir,
            criu,
            plugin_so,
            keeper,
            criu_version,
            agent: OnceLock::new(),
        })
    }

    /// Builds (once) and returns the in-process agent `libgpusnap_agent.so`.
    pub fn agent_so(&self) -> Result<&Path, String> {
        self.agent
            .get_or_init(|| {
                prebuilt(AGENT_SO_ENV).unwrap_or_else(|| {
                    build::package(&self.profile_dir, "gpusnap-agent", "libgpusnap_agent.so")
                })
            })
            .as_deref()
            .map_err(Clone::clone)
    }

    /// A fresh work directory for one test, with `plugins/gpusnap.so` in it.
    pub fn workdir(&'static self, test: &str) -> WorkDir {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let path = self
            .profile_dir
            .join("criu-tests")
            .join(format!("{test}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        let plugins = path.join("plugins");
        let images = path.join("images");
        for d in [&plugins, &images] {
            fs::create_dir_all(d).unwrap_or_else(|e| panic!("mkdir {}: {e}", d.display()));
        }
        let so = plugins.join("gpusnap.so");
        fs::copy(&self.plugin_so, &so).unwrap_or_else(|e| {
            panic!("copy {} -> {}: {e}", self.plugin_so.display(), so.display())
        });
        // Where the plugin looks for its keeper first (the split path's hand-over).
        let keeper = plugins.join("gpusnap-keeper");
        fs::copy(&self.keeper, &keeper).unwrap_or_else(|e| {
            panic!(
                "copy {} -> {}: {e}",
                self.keeper.display(),
                keeper.display()
            )
        });
        WorkDir {
            h: self,
            path,
            plugins,
            images,
        }
    }
}

/// The repository root (the directory with `scripts/criu`): `$GPUSNAP_REPO`, else the
/// parent of `$CARGO_MANIFEST_DIR` (at run time, then at build time), else the nearest
/// ancestor of the test binary (so that a copied `target/` inside a copied checkout works,
/// e.g. on a GPU host without cargo).
fn find_repo(exe: &Path) -> Result<PathBuf, String> {
    let manifest_dir = |d: PathBuf| d.parent().map(Path::to_path_buf);
    let candidates = std::env::var_os("GPUSNAP_REPO")
        .map(PathBuf::from)
        .into_iter()
        .chain(std::env::var_os("CARGO_MANIFEST_DIR").and_then(|d| manifest_dir(d.into())))
        .chain(manifest_dir(env!("CARGO_MANIFEST_DIR").into()))
        .chain(exe.ancestors().skip(1).map(Path::to_path_buf));
    for c in candidates {
        if c.join("scripts/criu").is_file() {
            return Ok(c);
        }
    }
    Err(format!(
        "cannot find the repository (a directory with scripts/criu) for {}; set GPUSNAP_REPO",
        exe.display()
    ))
}

/// A workload binary: the `CARGO_BIN_EXE_*` path it was built at, or, if that does not
/// exist (a copied `target/`), the file of the same name next to the test binary's profile.
fn workload_bin(h: &Harness, bin: &str) -> PathBuf {
    let p = Path::new(bin);
    if p.is_file() {
        return p.to_owned();
    }
    p.file_name()
        .map_or_else(|| p.to_owned(), |n| h.profile_dir.join(n))
}

/// The file named by env var `var`, if set: `Some(Err)` if it is not a file.
fn prebuilt(var: &str) -> Option<Result<PathBuf, String>> {
    let p = PathBuf::from(std::env::var_os(var)?);
    eprintln!("criu-tests: {var}={} (not building it)", p.display());
    Some(match fs::canonicalize(&p) {
        Ok(p) if p.is_file() => Ok(p),
        _ => Err(format!("{var}={}: no such file", p.display())),
    })
}

/// Runs a command to completion; its output is returned, or included in the error.
fn run_checked(cmd: &mut Command, what: &str) -> Result<String, String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{what}: {e}"))?;
    let text = output_text(&out);
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("{what} failed ({}):\n{text}", out.status))
    }
}

/// One test's directory: `plugins/` (CRIU's `-L`), `images/` (`-D`), workload logs.
///
/// Removed when the test passes; kept (and its path printed) when it fails.
#[derive(Debug)]
pub struct WorkDir {
    h: &'static Harness,
    pub path: PathBuf,
    pub plugins: PathBuf,
    pub images: PathBuf,
}

impl WorkDir {
    /// The harness this directory belongs to (CRIU path and version, plugin).
    pub fn harness(&self) -> &'static Harness {
        self.h
    }

    /// Starts `bin` (a workload from `CARGO_BIN_EXE_*`) in a new session, stdio to
    /// `<name>.out`, cwd = the work dir. `logs` are the counter logs it will write, root
    /// process's first.
    pub fn spawn(
        &self,
        name: &str,
        bin: &str,
        args: &[&str],
        env: &[(&str, &str)],
        logs: &[&str],
    ) -> Workload {
        let out_path = self.path.join(format!("{name}.out"));
        let out = fs::File::create(&out_path).expect("create workload output file");
        let err = out.try_clone().expect("dup workload output file");
        let mut cmd = Command::new(workload_bin(self.h, bin));
        for v in HARNESS_ONLY_ENV {
            cmd.env_remove(v);
        }
        cmd.args(args)
            .envs(env.iter().copied())
            .current_dir(&self.path)
            .stdout(out)
            .stderr(err);
        let child = procs::spawn_in_new_session(&mut cmd)
            .unwrap_or_else(|e| panic!("cannot start workload {bin}: {e}"));
        let logs: Vec<PathBuf> = logs.iter().map(|l| self.path.join(l)).collect();
        let mut w = Workload {
            pids: vec![child.id() as i32],
            child: Some(child),
            logs,
            out_path,
        };
        // Wait until every process has written a few ticks, learning their pids.
        for i in 0..w.logs.len() {
            let log = w.wait_for(i, 3);
            if i > 0 {
                w.pids.push(log.pid);
            } else {
                assert_eq!(log.pid, w.pids[0], "{}: unexpected pid", log.path.display());
            }
        }
        w
    }

    /// Starts the `counter` workload (one process) with the given extra environment.
    pub fn spawn_counter(&self, bin: &str, seed: u64, env: &[(&str, &str)]) -> Workload {
        let seed = seed.to_string();
        self.spawn(
            "counter",
            bin,
            &["--log", "counter.log", "--seed", &seed],
            env,
            &["counter.log"],
        )
    }

    /// Starts the `tree` workload (parent + 2 children).
    pub fn spawn_tree(&self, bin: &str, seed: u64) -> Workload {
        let seed = seed.to_string();
        self.spawn(
            "tree",
            bin,
            &["--dir", ".", "--seed", &seed],
            &[],
            &["tree-parent.log", "tree-child0.log", "tree-child1.log"],
        )
    }

    /// `criu dump -t <pid> -D images -L plugins -v4 -o dump.log [--leave-running]`.
    pub fn dump(&self, pid: i32, leave_running: bool) -> CriuRun {
        let mut args = self.common_args("dump", "dump.log");
        args.splice(1..1, ["-t".to_owned(), pid.to_string()]);
        if leave_running {
            args.push("--leave-running".into());
        }
        CriuRun::run(&self.h.criu, &args, &self.images.join("dump.log"))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `criu restore -D images -L plugins -v4 -o restore.log --restore-detached`.
    pub fn restore(&self) -> CriuRun {
        let mut args = self.common_args("restore", "restore.log");
        args.push("--restore-detached".into());
        CriuRun::run(&self.h.criu, &args, &self.images.join("restore.log"))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn common_args(&self, action: &str, log: &str) -> Vec<String> {
        vec![
            action.into(),
            "-D".into(),
            self.images.display().to_string(),
            "-L".into(),
            self.plugins.display().to_string(),
            "-v4".into(),
            "-o".into(),
            log.into(),
        ]
    }

    /// `criu <action> -D <images> -L plugins -v4 -o <log>`, with `log` absolute: for image
    /// directories other than [`WorkDir::images`], and for logs that must not be written into
    /// the image directory (a full file system).
    pub fn criu_args_in(&self, action: &str, images: &Path, log: &Path) -> Vec<String> {
        vec![
            action.into(),
            "-D".into(),
            images.display().to_string(),
            "-L".into(),
            self.plugins.display().to_string(),
            "-v4".into(),
            "-o".into(),
            log.display().to_string(),
        ]
    }

    /// Runs `scripts/criu <args>` with `env` added to its environment; `log` is its `-o` log.
    pub fn run_criu(&self, args: &[String], env: &[(&str, &str)], log: &Path) -> CriuRun {
        CriuRun::run_with_env(&self.h.criu, args, env, log).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts `scripts/criu <args>` in the background (see [`BackgroundCriu`]).
    pub fn spawn_criu(&self, args: &[String], env: &[(&str, &str)], log: &Path) -> BackgroundCriu {
        BackgroundCriu::spawn(&self.h.criu, args, env, log).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Names of the files in the image directory.
    pub fn image_files(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(&self.images)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("criu-tests: keeping {} for inspection", self.path.display());
        } else {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// A running test workload: its processes (root first) and their counter logs.
///
/// Dropping it SIGKILLs and reaps every process, whether original or restored.
#[derive(Debug)]
pub struct Workload {
    pub pids: Vec<i32>,
    pub logs: Vec<PathBuf>,
    /// The workload's stdout/stderr.
    pub out_path: PathBuf,
    child: Option<Child>,
}

impl Workload {
    pub fn root(&self) -> i32 {
        self.pids[0]
    }

    /// Reads log `i` (`0` = root process).
    pub fn log(&self, i: usize) -> CounterLog {
        CounterLog::read(&self.logs[i])
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("{}: no header yet", self.logs[i].display()))
    }

    /// Waits until process `i` has logged counter value `min`.
    pub fn wait_for(&self, i: usize, min: u64) -> CounterLog {
        CounterLog::wait_for(&self.logs[i], min, WAIT).unwrap_or_else(|e| {
            let out = fs::read_to_string(&self.out_path).unwrap_or_default();
            panic!("{e}\nworkload output ({}):\n{out}", self.out_path.display())
        })
    }

    /// After a dump that killed the tree: reap every process and wait until none of their
    /// pids is in use as pid, pgid or sid, so that `criu restore` can recreate them.
    pub fn reap_dumped(&mut self) {
        if let Some(mut c) = self.child.take() {
            let st = c.wait().expect("wait for dumped workload");
            assert!(
                !st.success(),
                "the dumped workload exited normally ({st}); CRIU should have killed it"
            );
        }
        for &pid in &self.pids {
            procs::reap(pid, WAIT).unwrap_or_else(|e| panic!("after dump: {e}"));
        }
        for &pid in &self.pids {
            procs::wait_pid_free(pid, WAIT).unwrap_or_else(|e| panic!("before restore: {e}"));
        }
    }

    /// Panics unless every process of the workload exists and is not a zombie.
    pub fn assert_alive(&self) {
        for &pid in &self.pids {
            assert!(
                procs::is_alive(pid),
                "workload process {pid} is not running: {:?}",
                procs::stat(pid)
            );
        }
    }

    /// Whether the original root process is still our (unreaped, running) child.
    pub fn original_still_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        procs::kill_and_reap(&self.pids);
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `Version: 4.2.1` (or `Version: 4.2`) → (4, 2, 1).
fn parse_criu_version(text: &str) -> Option<(u32, u32, u32)> {
    let v = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))?;
    let mut parts = v.trim().split('.').map(|p| p.parse::<u32>());
    let major = parts.next()?.ok()?;
    let minor = parts.next()?.ok()?;
    let patch = parts.next().unwrap_or(Ok(0)).ok()?;
    Some((major, minor, patch))
}

#[cfg(test)]
mod version_tests {
    use super::parse_criu_version;

    #[test]
    fn criu_versions_parse() {
        assert_eq!(parse_criu_version("Version: 4.1.1\n"), Some((4, 1, 1)));
        assert_eq!(
            parse_criu_version("Version: 4.2\nGitID: x\n"),
            Some((4, 2, 0))
        );
        assert_eq!(parse_criu_version("criu 4.2"), None);
        assert_eq!(parse_criu_version("Version: four"), None);
    }
}
