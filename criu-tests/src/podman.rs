//! Podman for the container test (`tests/podman.rs`): every command bounded in time, the
//! test's own `containers.conf`, a `criu` wrapper on runc's `PATH`, an image made without a
//! registry, and the clean-up of what the test created.
//!
//! runc runs `criu swrk` from its `PATH` and passes CRIU no other environment than `PATH`,
//! `XDG_RUNTIME_DIR` and `PWD`: the wrapper is where the test chooses the CRIU root (the
//! harness's: 4.1.1 or 4.2.x) and the stand-in driver. gpusnap's own settings come from
//! `/etc/criu/gpusnap.conf` only.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::procs;

/// How long one podman command may take before it counts as hung.
pub const COMMAND_LIMIT: Duration = Duration::from_secs(90);

/// A host-wide lock (`flock` on [`LOCK_PATH`]): the test installs a package into the system,
/// so two checkouts must not run it at once. Released when dropped.
#[derive(Debug)]
pub struct HostLock {
    /// The locked file: the lock lives as long as this descriptor.
    _file: fs::File,
}

pub const LOCK_PATH: &str = "/run/lock/gpusnap-podman-test.lock";

impl HostLock {
    /// Waits at most `limit` for the lock.
    pub fn take(limit: Duration) -> Result<HostLock, String> {
        use std::os::fd::AsRawFd;
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(LOCK_PATH)
            .map_err(|e| format!("{LOCK_PATH}: {e}"))?;
        let t0 = Instant::now();
        loop {
            // SAFETY: flock on a descriptor this function owns; no memory is involved.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(HostLock { _file: f });
            }
            if t0.elapsed() > limit {
                return Err(format!(
                    "{LOCK_PATH} is held for more than {limit:?}: another gpusnap Podman test runs on this host"
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Why the test cannot run here (printed as the reason it was skipped), or `None`.
pub fn cannot_run() -> Option<String> {
    for tool in ["podman", "runc"] {
        if which(tool).is_none() {
            return Some(format!(
                "{tool} is not installed (apt-get install --no-install-recommends podman runc \
                 busybox-static; .ci/run installs them)"
            ));
        }
    }
    None
}

/// `name` on `PATH` (or in the sbin directories).
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// What a finished command did.
#[derive(Debug)]
pub struct Output {
    pub what: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

impl Output {
    pub fn ok(&self) -> bool {
        self.status.success()
    }

    /// Panics, with everything the command said, unless it succeeded.
    pub fn assert_ok(&self) -> &Output {
        assert!(self.ok(), "{self}");
        self
    }
}

impl std::fmt::Display for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}`: {} after {:.1} s\n--- stdout ---\n{}--- stderr ---\n{}",
            self.what,
            self.status,
            self.took.as_secs_f64(),
            self.stdout,
            self.stderr
        )
    }
}

/// Runs `cmd` (stdio to files in `dir`), killing its whole session if it takes longer than
/// `limit`: `Err` then says it hung, with what it had printed.
pub fn run_bounded(
    cmd: &mut Command,
    what: &str,
    dir: &Path,
    limit: Duration,
) -> Result<Output, String> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let out_path = dir.join(format!("cmd-{n}.out"));
    let err_path = dir.join(format!("cmd-{n}.err"));
    let out = fs::File::create(&out_path).map_err(|e| format!("{}: {e}", out_path.display()))?;
    let err = fs::File::create(&err_path).map_err(|e| format!("{}: {e}", err_path.display()))?;
    cmd.stdout(out).stderr(err);
    let t0 = Instant::now();
    let mut child = procs::spawn_in_new_session(cmd).map_err(|e| format!("`{what}`: {e}"))?;
    let pgid = child.id() as i32;
    let read = |p: &Path| fs::read_to_string(p).unwrap_or_default();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return Ok(Output {
                    what: what.to_owned(),
                    status,
                    stdout: read(&out_path),
                    stderr: read(&err_path),
                    took: t0.elapsed(),
                });
            }
            Ok(None) if t0.elapsed() > limit => {
                // SAFETY: kill(2) with a negative pid signals that process group; no memory
                // is involved. The group is the session this function started.
                unsafe { libc::kill(-pgid, libc::SIGKILL) };
                let _ = child.wait();
                return Err(format!(
                    "`{what}` did not end within {limit:?} (a hang): its session was killed\n--- stdout ---\n{}--- stderr ---\n{}",
                    read(&out_path),
                    read(&err_path)
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("`{what}`: wait: {e}")),
        }
    }
}

/// Podman as the test runs it: `PATH` with the `criu` wrapper first, `CONTAINERS_CONF`, and
/// the names of everything it created, removed by [`Podman::clean_up`].
#[derive(Debug)]
pub struct Podman {
    /// Directory of the `criu` wrapper (first on `PATH`).
    pub bin: PathBuf,
    /// The test's `containers.conf`.
    pub conf: PathBuf,
    /// Command output files.
    pub dir: PathBuf,
    pub containers: Vec<String>,
    pub images: Vec<String>,
    /// Run podman with a plain system `PATH` (no wrapper of the test's on it).
    pub plain_path: bool,
}

/// The `PATH` of a plain root shell on Debian.
pub const SYSTEM_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

impl Podman {
    /// `containers.conf` for these hosts: runc (Debian 12's crun has no CRIU), and ulimits
    /// within the hard limits of this process (podman's defaults exceed them where the host
    /// gives no CAP_SYS_RESOURCE, and containers then fail to start).
    pub fn containers_conf() -> String {
        let hard = |res| {
            let mut r = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes only to `r`, a valid local.
            unsafe { libc::getrlimit(res, &mut r) };
            r.rlim_max.min(1 << 20)
        };
        let nofile = hard(libc::RLIMIT_NOFILE);
        let nproc = hard(libc::RLIMIT_NPROC).min(4096);
        format!(
            "# The gpusnap Podman test's containers.conf (CONTAINERS_CONF).\n\
             [containers]\n\
             default_ulimits = [\"nofile={nofile}:{nofile}\", \"nproc={nproc}:{nproc}\"]\n\
             [engine]\n\
             runtime = \"runc\"\n"
        )
    }

    pub fn new(dir: &Path, wrapper: &str) -> Result<Podman, String> {
        let bin = dir.join("bin");
        fs::create_dir_all(&bin).map_err(|e| format!("{}: {e}", bin.display()))?;
        let criu = bin.join("criu");
        fs::write(&criu, wrapper).map_err(|e| format!("{}: {e}", criu.display()))?;
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&criu, fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", criu.display()))?;
        let conf = dir.join("containers.conf");
        fs::write(&conf, Self::containers_conf())
            .map_err(|e| format!("{}: {e}", conf.display()))?;
        Ok(Podman {
            bin,
            conf,
            dir: dir.to_owned(),
            containers: Vec::new(),
            images: Vec::new(),
            plain_path: false,
        })
    }

    /// `PATH` with the wrapper's directory first.
    pub fn path_env(&self) -> std::ffi::OsString {
        let old = std::env::var_os("PATH").unwrap_or_default();
        let mut dirs = vec![self.bin.clone()];
        dirs.extend(std::env::split_paths(&old));
        std::env::join_paths(dirs).expect("PATH entries without ':'")
    }

    /// A command with the test's environment (`PATH`, `CONTAINERS_CONF`).
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        let path = if self.plain_path {
            SYSTEM_PATH.into()
        } else {
            self.path_env()
        };
        cmd.env("PATH", path)
            .env("CONTAINERS_CONF", &self.conf)
            .stdin(Stdio::null());
        for v in crate::harness::HARNESS_ONLY_ENV {
            cmd.env_remove(v);
        }
        cmd
    }

    /// `podman <args>`, bounded by [`COMMAND_LIMIT`]; a hang panics with a clear message.
    pub fn run(&self, args: &[&str]) -> Output {
        self.run_within(args, COMMAND_LIMIT)
    }

    pub fn run_within(&self, args: &[&str], limit: Duration) -> Output {
        let what = format!("podman {}", args.join(" "));
        let mut cmd = self.command("podman");
        cmd.args(args);
        run_bounded(&mut cmd, &what, &self.dir, limit).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `podman inspect -f FORMAT NAME`, trimmed.
    pub fn inspect(&self, name: &str, format: &str) -> String {
        self.run(&["inspect", "-f", format, name])
            .assert_ok()
            .stdout
            .trim()
            .to_owned()
    }

    /// The host pid of the container's init (0 when it is not running).
    pub fn init_pid(&self, name: &str) -> i32 {
        self.inspect(name, "{{.State.Pid}}").parse().unwrap_or(0)
    }

    /// Removes every container and image this test created; never panics (used from `Drop`).
    pub fn clean_up(&mut self) {
        for c in std::mem::take(&mut self.containers) {
            let mut cmd = self.command("podman");
            cmd.args(["rm", "-f", "-t", "0", &c]);
            if let Err(e) = run_bounded(&mut cmd, "podman rm", &self.dir, COMMAND_LIMIT) {
                eprintln!("criu-tests: warning: removing container {c}: {e}");
            }
        }
        for i in std::mem::take(&mut self.images) {
            let mut cmd = self.command("podman");
            cmd.args(["rmi", "-f", &i]);
            if let Err(e) = run_bounded(&mut cmd, "podman rmi", &self.dir, COMMAND_LIMIT) {
                eprintln!("criu-tests: warning: removing image {i}: {e}");
            }
        }
        reap_zombies();
    }
}

/// What every container and image name of the Podman test starts with: containers
/// `gpusnap-test-<pid>-<what>`, images `localhost/gpusnap-test:<pid>`, `<pid>` the test's.
pub const NAME_PREFIX: &str = "gpusnap-test";

/// The pid of the test run that named a container `gpusnap-test-<pid>-<what>` or an image
/// `[localhost/]gpusnap-test:<pid>`; `None` for any other name.
pub fn test_pid_of(name: &str) -> Option<i32> {
    let name = name.strip_prefix("localhost/").unwrap_or(name);
    let rest = name.strip_prefix(NAME_PREFIX)?;
    let pid = if let Some(tag) = rest.strip_prefix(':') {
        tag
    } else {
        rest.strip_prefix('-')?.split_once('-')?.0
    };
    (!pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
        .then(|| pid.parse().ok())
        .flatten()
}

impl Podman {
    /// Removes the containers and images an earlier run of the test left behind (one that was
    /// killed or interrupted before its clean-up): those named with [`NAME_PREFIX`] whose test
    /// pid is no longer alive. Call it holding the [`HostLock`]. Returns what it removed;
    /// failures are warnings, never panics.
    pub fn remove_stale(&self) -> Vec<String> {
        let list = |args: &[&str]| -> Vec<String> {
            let mut cmd = self.command("podman");
            cmd.args(args);
            match run_bounded(&mut cmd, "podman list", &self.dir, COMMAND_LIMIT) {
                Ok(o) if o.ok() => o.stdout.lines().map(|l| l.trim().to_owned()).collect(),
                Ok(o) => {
                    eprintln!("criu-tests: warning: listing earlier runs' leftovers: {o}");
                    Vec::new()
                }
                Err(e) => {
                    eprintln!("criu-tests: warning: listing earlier runs' leftovers: {e}");
                    Vec::new()
                }
            }
        };
        let stale = |name: &String| test_pid_of(name).is_some_and(|pid| !procs::is_alive(pid));
        let mut removed = Vec::new();
        let containers = list(&["ps", "-a", "--format", "{{.Names}}"]);
        for c in containers.iter().filter(|c| stale(c)) {
            let mut cmd = self.command("podman");
            cmd.args(["rm", "-f", "-t", "0", c]);
            match run_bounded(&mut cmd, "podman rm", &self.dir, COMMAND_LIMIT) {
                Ok(o) if o.ok() => removed.push(format!("container {c}")),
                Ok(o) => eprintln!("criu-tests: warning: removing stale container {c}: {o}"),
                Err(e) => eprintln!("criu-tests: warning: removing stale container {c}: {e}"),
            }
        }
        let images = list(&["images", "--format", "{{.Repository}}:{{.Tag}}"]);
        for i in images.iter().filter(|i| stale(i)) {
            let mut cmd = self.command("podman");
            cmd.args(["rmi", "-f", i]);
            match run_bounded(&mut cmd, "podman rmi", &self.dir, COMMAND_LIMIT) {
                Ok(o) if o.ok() => removed.push(format!("image {i}")),
                Ok(o) => eprintln!("criu-tests: warning: removing stale image {i}: {o}"),
                Err(e) => eprintln!("criu-tests: warning: removing stale image {i}: {e}"),
            }
        }
        reap_zombies();
        removed
    }
}

/// Reaps every exited child of this process (the harness is a subreaper, so the daemonised
/// conmon processes of the test's containers end up as its children).
pub fn reap_zombies() {
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes only to `status`; WNOHANG never blocks.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG | libc::__WALL) };
        if pid <= 0 {
            break;
        }
    }
}

/// The shared libraries `ldd` lists for `bin` (absolute paths, the loader included); none for
/// a static binary.
pub fn shared_libraries(bin: &Path) -> Result<Vec<PathBuf>, String> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .map_err(|e| format!("ldd {}: {e}", bin.display()))?;
    let said = crate::fixtures::output_text(&out);
    if said.contains("not a dynamic executable") || said.contains("statically linked") {
        return Ok(Vec::new());
    }
    if !out.status.success() {
        return Err(format!(
            "ldd {}: {}\n{}",
            bin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_pid_is_read_from_its_names() {
        assert_eq!(test_pid_of("gpusnap-test-4242-cpu"), Some(4242));
        assert_eq!(test_pid_of("gpusnap-test-4242-split-copy"), Some(4242));
        assert_eq!(test_pid_of("localhost/gpusnap-test:4242"), Some(4242));
        assert_eq!(test_pid_of("gpusnap-test:4242"), Some(4242));
        for other in [
            "job",
            "gpusnap-test",
            "gpusnap-test-",
            "gpusnap-test-4242",
            "gpusnap-test-abc-cpu",
            "gpusnap-test--cpu",
            "localhost/gpusnap-test:latest",
            "docker.io/library/busybox:latest",
            "gpusnap-tests-4242-cpu",
            "<none>:<none>",
        ] {
            assert_eq!(test_pid_of(other), None, "{other}");
        }
    }

    /// With a stand-in `podman` first on the test's `PATH`: only the names of a run whose pid
    /// is gone are removed, containers before images.
    #[test]
    fn only_a_gone_runs_leftovers_are_removed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("gpusnap-stale-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let podman = Podman::new(&dir, "#!/bin/sh\nexit 1\n").unwrap();
        let mut child = Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let alive = std::process::id();
        let log = dir.join("calls");
        let fake = format!(
            "#!/bin/sh\n\
             case \"$1\" in\n\
             ps) printf 'gpusnap-test-{gone}-cpu\\ngpusnap-test-{alive}-cpu\\njob\\n' ;;\n\
             images) printf 'localhost/gpusnap-test:{gone}\\nlocalhost/gpusnap-test:{alive}\\n\\
             docker.io/library/busybox:latest\\n' ;;\n\
             *) echo \"$@\" >>'{}' ;;\n\
             esac\n",
            log.display()
        );
        let bin = podman.bin.join("podman");
        fs::write(&bin, fake).unwrap();
        fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
        let removed = podman.remove_stale();
        assert_eq!(
            removed,
            [
                format!("container gpusnap-test-{gone}-cpu"),
                format!("image localhost/gpusnap-test:{gone}"),
            ]
        );
        assert_eq!(
            fs::read_to_string(&log).unwrap(),
            format!("rm -f -t 0 gpusnap-test-{gone}-cpu\nrmi -f localhost/gpusnap-test:{gone}\n")
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
