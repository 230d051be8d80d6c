//! `gpusnap check`: is this host ready for GPU checkpoints? Each finding is one line,
//! `ok|warn|fail  <what>  — <what to do>`; exit 1 if any is `fail`. The configuration comes
//! first: the file and the `GPUSNAP_*` environment read as the plugin reads them, each
//! problem a line of its own.
//!
//! Where Podman is installed, `containers` adds what container checkpoints need; `cdi` checks
//! the CDI spec that gives containers the agent; `amd` what AMD GPUs need.
//!
//! Environment: `GPUSNAP_CRIU` (criu binary), `CRIU_LIBS_DIR` (CRIU's plugin directory),
//! `GPUSNAP_AGENT_LIB` (the agent library), `GPUSNAP_LIBCUDA` (driver library to probe, default
//! `libcuda.so.1`).

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use crate::util::{EXIT_PROBLEM, EXIT_USAGE};

mod amd;
mod cdi;
mod containers;

pub(crate) const MIN_CRIU: (u32, u32, u32) = (4, 1, 1);
/// The first CRIU with the POST_FORKING plugin hook.
const FIRST_POST_FORKING_CRIU: (u32, u32, u32) = (4, 2, 0);
const DEFAULT_PLUGIN_DIR: &str = "/usr/lib/criu/";
const DEFAULT_AGENT: &str = "/usr/lib/gpusnap/libgpusnap_agent.so";
/// Driver entry points the plugin cannot work without.
const CUDA_SYMBOLS: [&str; 2] = [
    "cuCheckpointProcessLock",
    "cuCheckpointProcessGetRestoreThreadId",
];
/// CAP_SYS_PTRACE's bit in the capability sets.
const CAP_SYS_PTRACE: u32 = 19;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    Ok,
    Warn,
    Fail,
}

#[derive(Debug)]
pub(crate) struct Finding {
    pub(crate) level: Level,
    what: String,
    todo: String,
}

impl Finding {
    pub(crate) fn ok(what: impl Into<String>) -> Self {
        Finding {
            level: Level::Ok,
            what: what.into(),
            todo: String::new(),
        }
    }
    pub(crate) fn warn(what: impl Into<String>, todo: impl Into<String>) -> Self {
        Finding {
            level: Level::Warn,
            what: what.into(),
            todo: todo.into(),
        }
    }
    pub(crate) fn fail(what: impl Into<String>, todo: impl Into<String>) -> Self {
        Finding {
            level: Level::Fail,
            what: what.into(),
            todo: todo.into(),
        }
    }
    pub(crate) fn line(&self) -> String {
        let tag = match self.level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "fail",
        };
        if self.todo.is_empty() {
            format!("{tag}  {}", self.what)
        } else {
            format!("{tag}  {}  — {}", self.what, self.todo)
        }
    }
}

pub fn run(args: &[String]) -> ExitCode {
    if let Some(a) = args.first() {
        eprintln!("gpusnap check: unexpected {a:?}\nusage: gpusnap check");
        return ExitCode::from(EXIT_USAGE);
    }
    let mut findings = check_config(gpusnap_config::load());
    let (criu_findings, criu) = check_criu();
    findings.extend(criu_findings);
    findings.extend(check_plugin_dir());
    findings.extend(check_driver(Path::new("/proc/driver/nvidia/version")));
    findings.extend(check_libcuda());
    findings.push(check_agent());
    findings.extend(check_ptrace());
    findings.extend(check_gpu_memory());
    findings.extend(amd::check_amd());
    if let Ok(mounts) = std::fs::read_to_string("/proc/mounts") {
        findings.extend(shm_huge_pages(&mounts));
    }
    findings.extend(containers::findings(criu.as_ref()));
    findings.extend(cdi::findings());
    for f in &findings {
        println!("{}", f.line());
    }
    if findings.iter().any(|f| f.level == Level::Fail) {
        ExitCode::from(EXIT_PROBLEM)
    } else {
        ExitCode::SUCCESS
    }
}

/// The configuration as the plugin would load it: one `ok` line, or one `fail` line per
/// problem (the plugin refuses to run on any).
fn check_config(
    loaded: Result<gpusnap_config::Config, gpusnap_config::ConfigError>,
) -> Vec<Finding> {
    let named = std::env::var(gpusnap_config::CONFIG_ENV).ok();
    let (path, _) = gpusnap_config::config_path(named.as_deref());
    match loaded {
        Ok(c) => vec![Finding::ok(format!(
            "configuration ({}{}): {}",
            path.display(),
            if path.exists() {
                ""
            } else {
                ", absent: defaults"
            },
            c.describe()
        ))],
        Err(e) => {
            let exe = std::env::current_exe().ok();
            let todo = format!(
                "fix it ({}); the plugin refuses every dump and restore until then",
                config_example_hint(exe.as_deref(), &|p| p.is_file())
            );
            e.problems()
                .into_iter()
                .map(|p| Finding::fail(format!("configuration: {p}"), todo.clone()))
                .collect()
        }
    }
}

/// The example configuration in a checkout, from its root.
const REPO_CONFIG_EXAMPLE: &str = "common/config/gpusnap.conf.example";
/// The configuration the Debian package installs (scripts/build-deb.sh): the example with every
/// key commented out at its default.
const INSTALLED_CONFIG: &str = "/etc/criu/gpusnap.conf";

/// Where this host documents every configuration key: the checkout's example when this binary
/// runs from one (`target/<profile>/gpusnap`, `.devcarry/gpusnap`), else the configuration file
/// as installed. An installed system has no checkout to point at.
fn config_example_hint(exe: Option<&Path>, is_file: &dyn Fn(&Path) -> bool) -> String {
    let checkout = exe
        .into_iter()
        .flat_map(Path::ancestors)
        .skip(1)
        .take(3)
        .map(|d| d.join(REPO_CONFIG_EXAMPLE))
        .find(|p| is_file(p));
    match checkout {
        Some(example) => format!("{} documents every key", example.display()),
        None => format!(
            "{INSTALLED_CONFIG} as the gpusnap package installs it lists every key, commented out \
             at its default"
        ),
    }
}

fn env_path(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// `name` on `$PATH`, or in the sbin directories a non-root PATH often lacks.
fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `Version: 4.1.1` (from `criu --version`) as (4, 1, 1); a missing patch level is 0.
pub(crate) fn parse_criu_version(out: &str) -> Option<(u32, u32, u32)> {
    let v = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))?
        .trim();
    let mut it = v.split(['.', '-', ' ']).map(|p| p.parse::<u32>());
    let major = it.next()?.ok()?;
    let minor = it.next()?.ok()?;
    let patch = it.next().and_then(Result::ok).unwrap_or(0);
    Some((major, minor, patch))
}

/// The criu that [`check_criu`] judged, and its version: the container part does not judge the
/// same binary a second time.
pub(crate) struct CriuSeen {
    pub(crate) path: PathBuf,
    pub(crate) version: Option<(u32, u32, u32)>,
}

impl CriuSeen {
    /// Whether this criu was found too old (and said so in a `fail` line).
    pub(crate) fn too_old(&self) -> bool {
        self.version.is_some_and(|v| v < MIN_CRIU)
    }
}

fn check_criu() -> (Vec<Finding>, Option<CriuSeen>) {
    let criu = match env_path("GPUSNAP_CRIU") {
        Some(p) => p,
        None => match find_on_path("criu") {
            Some(p) => p,
            None => {
                let f = Finding::fail(
                    "CRIU not found on PATH",
                    format!(
                        "install CRIU >= {}.{}.{} or set GPUSNAP_CRIU to its path",
                        MIN_CRIU.0, MIN_CRIU.1, MIN_CRIU.2
                    ),
                );
                return (vec![f], None);
            }
        },
    };
    let out = match Command::new(&criu).arg("--version").output() {
        Ok(o) => o,
        Err(e) => {
            let f = Finding::fail(
                format!("CRIU at {} does not run: {e}", criu.display()),
                "fix the installation or point GPUSNAP_CRIU at a working criu",
            );
            return (vec![f], None);
        }
    };
    let version = parse_criu_version(&String::from_utf8_lossy(&out.stdout));
    let findings = criu_version_findings(version, &criu);
    (
        findings,
        Some(CriuSeen {
            path: criu,
            version,
        }),
    )
}

/// What CRIU's version means for gpusnap: too old, usable, or usable but slower to restore.
fn criu_version_findings(version: Option<(u32, u32, u32)>, criu: &Path) -> Vec<Finding> {
    match version {
        Some(v) if v >= MIN_CRIU => {
            let mut f = vec![Finding::ok(format!(
                "CRIU {}.{}.{} ({})",
                v.0,
                v.1,
                v.2,
                criu.display()
            ))];
            if v < FIRST_POST_FORKING_CRIU {
                f.push(Finding::warn(
                    "this CRIU has no POST_FORKING hook: at restore, gpusnap's checksum pass over the image data and cuInit run before and after CRIU's own restore instead of beside it",
                    "with CRIU 4.2 or newer they overlap CRIU's restore (scripts/install-criu.sh builds a 4.2 root with GPUSNAP_CRIU_SUITE=sid)",
                ));
            }
            f
        }
        Some(v) => vec![Finding::fail(
            format!(
                "CRIU {}.{}.{} ({}) is too old",
                v.0,
                v.1,
                v.2,
                criu.display()
            ),
            format!(
                "gpusnap needs CRIU >= {}.{}.{} (plugin inventory API): install one (the \
                 distribution's where it is new enough, else the gpusnap-criu package that \
                 scripts/build-deb.sh --with-criu builds, which puts it on PATH for runc and \
                 Podman too), or set GPUSNAP_CRIU to one",
                MIN_CRIU.0, MIN_CRIU.1, MIN_CRIU.2
            ),
        )],
        None => vec![Finding::warn(
            format!("CRIU at {}: cannot tell its version", criu.display()),
            format!(
                "make sure it is >= {}.{}.{} (`criu --version`)",
                MIN_CRIU.0, MIN_CRIU.1, MIN_CRIU.2
            ),
        )],
    }
}

fn check_plugin_dir() -> Vec<Finding> {
    let dir = env_path("CRIU_LIBS_DIR").unwrap_or_else(|| PathBuf::from(DEFAULT_PLUGIN_DIR));
    if !dir.is_dir() {
        return vec![Finding::fail(
            format!("CRIU plugin directory {} does not exist", dir.display()),
            "create it and install gpusnap.so there (or set CRIU_LIBS_DIR, and pass -L to criu)",
        )];
    }
    let mut out = Vec::new();
    let plugin = dir.join("gpusnap.so");
    if plugin.is_file() {
        out.push(Finding::ok(format!("plugin {}", plugin.display())));
    } else {
        out.push(Finding::fail(
            format!("gpusnap.so is not in {}", dir.display()),
            "install the plugin there (cp target/release/libgpusnap_plugin.so <dir>/gpusnap.so)",
        ));
    }
    // The split path's keeper: the plugin looks beside itself, then in /usr/libexec/gpusnap.
    let configured = gpusnap_config::load().map(|c| c.keeper).unwrap_or_default();
    let beside = dir.join("gpusnap-keeper");
    let keeper = if configured.is_empty() && beside.is_file() {
        beside.to_string_lossy().into_owned()
    } else {
        configured.clone()
    };
    match gpusnap_cuda::keeper::locate(&keeper) {
        Ok(p) => out.push(Finding::ok(format!(
            "keeper {} (the split path hands device memory to it across the driver checkpoint)",
            p.display()
        ))),
        // Named in the configuration and unusable (a directory, not executable): a mistake
        // to fix, not an optional part missing.
        Err(e) if !configured.is_empty() => out.push(Finding::fail(
            format!("the configured keeper is unusable: {e}"),
            "set `keeper` (GPUSNAP_KEEPER) to the gpusnap-keeper program, or remove it to use the one beside the plugin or in /usr/libexec/gpusnap",
        )),
        Err(e) => out.push(Finding::warn(
            format!("no usable gpusnap-keeper: {e}"),
            "without it the split path copies the data out before the driver checkpoint (slower dumps and -R); install it as /usr/libexec/gpusnap/gpusnap-keeper",
        )),
    }
    let upstream = dir.join("cuda_plugin.so");
    if upstream.exists() {
        out.push(Finding::warn(
            format!(
                "CRIU's own CUDA plugin {} is installed too",
                upstream.display()
            ),
            "both would act on GPU processes; remove or move cuda_plugin.so",
        ));
    }
    out
}

/// `NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  ...` → "580.95.05".
fn parse_driver_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|w| {
            let mut parts = w.split('.');
            parts
                .next()
                .is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
                && parts.next().is_some()
                && w.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        })
        .map(str::to_owned)
}

fn check_driver(version_file: &Path) -> Vec<Finding> {
    let text = match std::fs::read_to_string(version_file) {
        Ok(t) => t,
        Err(_) => {
            return vec![Finding::fail(
                "NVIDIA kernel driver not loaded",
                format!(
                    "{} is missing: install the NVIDIA driver (>= 570) or load nvidia.ko",
                    version_file.display()
                ),
            )];
        }
    };
    let Some(v) = parse_driver_version(&text) else {
        return vec![Finding::warn(
            format!("NVIDIA driver: cannot parse {}", version_file.display()),
            "check the driver version by hand (>= 570 needed for the checkpoint API)",
        )];
    };
    let major: u32 = v
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    if major < 550 {
        vec![Finding::fail(
            format!("NVIDIA driver {v} has no checkpoint API"),
            "upgrade to driver 570 or newer",
        )]
    } else if major < 570 {
        vec![Finding::warn(
            format!("NVIDIA driver {v}"),
            "driver 570 or newer is recommended (gpusnap is developed against 580)",
        )]
    } else {
        vec![Finding::ok(format!("NVIDIA driver {v}"))]
    }
}

fn check_libcuda() -> Vec<Finding> {
    let lib = std::env::var("GPUSNAP_LIBCUDA").unwrap_or_else(|_| "libcuda.so.1".to_owned());
    match probe_library(&lib, &CUDA_SYMBOLS) {
        Err(e) => vec![Finding::fail(
            format!("{lib} does not load: {e}"),
            "install the NVIDIA user-space driver (libcuda) matching the kernel module",
        )],
        Ok(missing) if missing.is_empty() => vec![Finding::ok(format!(
            "{lib} loads and has the checkpoint API"
        ))],
        Ok(missing) => vec![Finding::fail(
            format!("{lib} lacks {}", missing.join(", ")),
            "upgrade the NVIDIA driver to 570 or newer",
        )],
    }
}

/// Why [`probe_library`] could not load a library.
#[derive(Debug)]
enum LoadError {
    /// The name holds a NUL byte (`GPUSNAP_LIBCUDA` as set).
    NulInName,
    /// `dlopen` failed; `dlerror`'s text.
    Dlopen(String),
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::NulInName => f.write_str("name contains NUL"),
            LoadError::Dlopen(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for LoadError {}

/// `dlopen`s `lib` and returns which of `symbols` it lacks.
fn probe_library(lib: &str, symbols: &[&str]) -> Result<Vec<String>, LoadError> {
    let name = CString::new(lib).map_err(|_| LoadError::NulInName)?;
    // SAFETY: `name` is NUL-terminated. Loading the driver library runs its initialisers, which
    // is what any CUDA program does; no CUDA function is called.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(LoadError::Dlopen(dl_error()));
    }
    let mut missing = Vec::new();
    for s in symbols {
        let sym = CString::new(*s).expect("symbol names have no NUL");
        // SAFETY: `handle` came from a successful dlopen and `sym` is NUL-terminated; the
        // returned pointer is only compared with null, never called.
        if unsafe { libc::dlsym(handle, sym.as_ptr()) }.is_null() {
            missing.push((*s).to_owned());
        }
    }
    // SAFETY: `handle` is a live handle from dlopen, closed once; no symbol from it is kept.
    unsafe { libc::dlclose(handle) };
    Ok(missing)
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied out at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        return "unknown dlopen error".to_owned();
    }
    // SAFETY: non-null, NUL-terminated, see above.
    unsafe { std::ffi::CStr::from_ptr(e) }
        .to_string_lossy()
        .into_owned()
}

fn check_agent() -> Finding {
    let agent = env_path("GPUSNAP_AGENT_LIB").unwrap_or_else(|| PathBuf::from(DEFAULT_AGENT));
    if agent.is_file() {
        Finding::ok(format!("agent library {}", agent.display()))
    } else {
        Finding::warn(
            format!("agent library {} not found", agent.display()),
            "install it to use the fast split path (LD_PRELOAD it into GPU programs); \
             without it every process takes the slower transparent path",
        )
    }
}

/// Whether bit `cap` is set in the `CapEff:` line of a /proc/<pid>/status text.
fn has_capability(status: &str, cap: u32) -> bool {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << cap) != 0)
}

fn check_ptrace() -> Vec<Finding> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let cap = has_capability(&status, CAP_SYS_PTRACE);
    let mut out = vec![if root {
        Finding::ok("running as root")
    } else if cap {
        Finding::warn(
            "not root, but CAP_SYS_PTRACE is available",
            "CRIU itself usually needs root; run criu and gpusnap as root",
        )
    } else {
        Finding::fail(
            "not root and no CAP_SYS_PTRACE",
            "run as root (CRIU and the plugin ptrace the checkpointed process)",
        )
    }];
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
    {
        None | Some(0) => out.push(Finding::ok("ptrace not restricted by Yama")),
        Some(1) if root || cap => out.push(Finding::ok("Yama ptrace_scope 1 (root may ptrace)")),
        Some(2) if cap => out.push(Finding::ok("Yama ptrace_scope 2 (CAP_SYS_PTRACE held)")),
        Some(3) => out.push(Finding::fail(
            "Yama ptrace_scope 3: ptrace is disabled until reboot",
            "set kernel.yama.ptrace_scope to 1 or lower at boot (it cannot be lowered from 3)",
        )),
        Some(n) => out.push(Finding::fail(
            format!("Yama ptrace_scope {n} forbids ptrace for this user"),
            "run as root with CAP_SYS_PTRACE, or `sysctl kernel.yama.ptrace_scope=1`",
        )),
    }
    out
}

/// `index, free MiB, total MiB` lines from nvidia-smi.
fn parse_smi(text: &str) -> Vec<(String, u64, u64)> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            match f.as_slice() {
                [i, free, total] => {
                    Some(((*i).to_owned(), free.parse().ok()?, total.parse().ok()?))
                }
                _ => None,
            }
        })
        .collect()
}

fn check_gpu_memory() -> Vec<Finding> {
    let out = Command::new("nvidia-smi")
        .args([
            "--query-gpu=index,memory.free,memory.total",
            "--format=csv,noheader,nounits",
        ])
        .output();
    let out = match out {
        Ok(o) if o.status.success() => o,
        Ok(o) => {
            return vec![Finding::warn(
                format!("nvidia-smi failed ({})", o.status),
                "cannot report free GPU memory; check `nvidia-smi` by hand",
            )];
        }
        Err(_) => {
            return vec![Finding::warn(
                "nvidia-smi not found",
                "cannot report free GPU memory; restore needs as much as the process used",
            )];
        }
    };
    let gpus = parse_smi(&String::from_utf8_lossy(&out.stdout));
    if gpus.is_empty() {
        return vec![Finding::warn(
            "nvidia-smi lists no GPUs",
            "check that the GPUs are visible to this host (and container)",
        )];
    }
    gpus.into_iter()
        .map(|(i, free, total)| {
            let what = format!("GPU {i}: {free} MiB free of {total} MiB");
            if total > 0 && free * 10 < total {
                Finding::warn(
                    what,
                    "little free memory: a restore needs as much as the checkpointed process used",
                )
            } else {
                Finding::ok(what)
            }
        })
        .collect()
}

/// Images on `/dev/shm` (tmpfs) move faster in huge pages: on the H200 a 16 GiB split dump went
/// from 1.80 to 1.65 s and the restore from 1.76 to 1.40 s (README, benchmark runs 4 and 5).
fn shm_huge_pages(mounts: &str) -> Option<Finding> {
    let opts = mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() > 3 && f[1] == "/dev/shm" && f[2] == "tmpfs").then(|| f[3])
    })?;
    let huge = opts
        .split(',')
        .find_map(|o| o.strip_prefix("huge="))
        .unwrap_or("never");
    Some(if huge == "never" || huge == "deny" {
        Finding::warn(
            "/dev/shm (tmpfs) has no huge pages",
            "if images go there, `mount -o remount,huge=always /dev/shm` made 16 GiB split dumps 8% and restores 20% faster on an H200",
        )
    } else {
        Finding::ok(format!("/dev/shm (tmpfs) uses huge pages (huge={huge})"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn criu_versions() {
        assert_eq!(
            parse_criu_version("Version: 4.1.1\nGitID: v4.1.1\n"),
            Some((4, 1, 1))
        );
        assert_eq!(parse_criu_version("Version: 3.17\n"), Some((3, 17, 0)));
        assert_eq!(parse_criu_version("Version: 4.2-rc1\n"), Some((4, 2, 0)));
        assert_eq!(parse_criu_version("criu\n"), None);
        assert!(parse_criu_version("Version: 4.1.1").unwrap() >= MIN_CRIU);
        assert!(parse_criu_version("Version: 4.1").unwrap() < MIN_CRIU);
    }

    #[test]
    fn criu_versions_are_judged() {
        let p = Path::new("/usr/sbin/criu");
        let levels = |v| {
            criu_version_findings(Some(v), p)
                .iter()
                .map(|f| f.level)
                .collect::<Vec<_>>()
        };
        assert_eq!(levels((4, 0, 0)), [Level::Fail]);
        assert_eq!(levels((4, 1, 1)), [Level::Ok, Level::Warn]);
        assert_eq!(levels((4, 2, 1)), [Level::Ok]);
        assert_eq!(
            criu_version_findings(None, p)
                .iter()
                .map(|f| f.level)
                .collect::<Vec<_>>(),
            [Level::Warn]
        );
    }

    #[test]
    fn the_config_hint_names_a_file_of_this_host() {
        let example = Path::new("/src/gpusnap/common/config/gpusnap.conf.example");
        let only_the_checkout = |p: &Path| p == example;
        for exe in [
            "/src/gpusnap/target/release/gpusnap",
            "/src/gpusnap/target/debug/gpusnap",
            "/src/gpusnap/.devcarry/gpusnap",
        ] {
            assert_eq!(
                config_example_hint(Some(Path::new(exe)), &only_the_checkout),
                "/src/gpusnap/common/config/gpusnap.conf.example documents every key",
                "{exe}"
            );
        }
        // Installed: no checkout above /usr/bin, and no repository path in the hint.
        for exe in [Some(Path::new("/usr/bin/gpusnap")), None] {
            let hint = config_example_hint(exe, &only_the_checkout);
            assert!(
                hint.starts_with("/etc/criu/gpusnap.conf as the gpusnap package"),
                "{hint}"
            );
            assert!(
                !hint.contains("common/config/gpusnap.conf.example"),
                "{hint}"
            );
        }
    }

    #[test]
    fn driver_versions() {
        let t = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Tue Sep 23 09:55:41 UTC 2025\nGCC version:  gcc version 12.2.0\n";
        assert_eq!(parse_driver_version(t).as_deref(), Some("580.95.05"));
        let open =
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build\n";
        assert_eq!(parse_driver_version(open).as_deref(), Some("570.124.06"));
        assert_eq!(parse_driver_version("nothing"), None);
        assert_eq!(
            check_driver(Path::new("/nonexistent/version"))[0].level,
            Level::Fail
        );
    }

    #[test]
    fn capabilities_and_smi() {
        let status = "Name:\tx\nCapEff:\t000001ffffffffff\n";
        assert!(has_capability(status, CAP_SYS_PTRACE));
        assert!(!has_capability(
            "CapEff:\t0000000000000000\n",
            CAP_SYS_PTRACE
        ));
        assert!(!has_capability("", CAP_SYS_PTRACE));
        assert_eq!(
            parse_smi("0, 140000, 143771\n1, 100, 143771\nbad\n"),
            vec![("0".into(), 140000, 143771), ("1".into(), 100, 143771)]
        );
    }

    #[test]
    fn shm_huge_pages_are_judged_from_the_mount_options() {
        let plain = "tmpfs /dev/shm tmpfs rw,relatime,size=1024k 0 0\n";
        assert_eq!(shm_huge_pages(plain).unwrap().level, Level::Warn);
        let huge = "proc /proc proc rw 0 0\ntmpfs /dev/shm tmpfs rw,size=1k,huge=always 0 0\n";
        let f = shm_huge_pages(huge).unwrap();
        assert_eq!(f.level, Level::Ok);
        assert!(f.what.contains("huge=always"));
        assert!(shm_huge_pages("none /dev/shm ext4 rw 0 0\n").is_none());
    }

    #[test]
    fn finding_lines() {
        assert_eq!(Finding::ok("CRIU 4.1.1").line(), "ok    CRIU 4.1.1");
        assert_eq!(Finding::fail("x", "do y").line(), "fail  x  — do y");
    }

    #[test]
    fn missing_library_is_reported() {
        assert!(probe_library("libgpusnap-does-not-exist.so", &CUDA_SYMBOLS).is_err());
        // libc has no checkpoint API.
        let missing = probe_library("libc.so.6", &CUDA_SYMBOLS).unwrap();
        assert_eq!(missing.len(), 2);
    }
}
