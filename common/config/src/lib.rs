//! Configuration of the gpusnap CRIU plugin.
//!
//! Podman and CRI-O start CRIU without passing the caller's environment, so the main channel is a
//! TOML file: [`DEFAULT_PATH`], or the file named by the environment variable `GPUSNAP_CONFIG`.
//! A missing default file means "all defaults"; a missing file named by `GPUSNAP_CONFIG` is an
//! error. Only a regular file of at most [`MAX_FILE_BYTES`] is read (symlinks are followed); a
//! directory, a FIFO, a device other than `/dev/null` or a larger file is an error (see
//! `file.rs`). Every key can then be overridden by an environment variable `GPUSNAP_<KEY>` (the key
//! uppercased, e.g. `GPUSNAP_WRITER_THREADS=8`); the environment beats the file.
//!
//! Strictness is on purpose: an unknown key in the file, an unknown `GPUSNAP_*` variable (other
//! than `GPUSNAP_CONFIG` and [`NON_CONFIG_ENV`]), a value of the wrong type or out of range are
//! all errors that say where the value came from and what is allowed. A value from the environment
//! is read as strictly as one from the file: a boolean is exactly `true`, `false`, `1` or `0`,
//! an integer decimal digits only, a string as written (not trimmed). A typo must not silently
//! checkpoint with settings the user did not ask for.
//!
//! `common/config/gpusnap.conf.example` documents every key.
//!
//! This crate only parses and validates; it does not act on any value. Modules: `keys` (every
//! key, its type and its environment name), `file` (the TOML file), `device_map` (which GPU
//! stands in for which), `error` ([`ConfigError`]).

mod device_map;
mod error;
mod file;
mod keys;

#[cfg(test)]
mod tests;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use device_map::{BadUuid, DeviceMapError, normalise_uuid};
pub use error::{ConfigError, Expected, Origin};
pub use file::MAX_FILE_BYTES;

/// The configuration file read when `GPUSNAP_CONFIG` is not set.
pub const DEFAULT_PATH: &str = "/etc/criu/gpusnap.conf";

/// The environment variable that names another configuration file.
pub const CONFIG_ENV: &str = "GPUSNAP_CONFIG";

/// `GPUSNAP_*` environment variables that are not configuration keys but are read elsewhere
/// (by the agent, the test harness, the CRIU scripts or the GPU scripts), so they are not
/// rejected as unknown:
///
/// - every `GPUSNAP_AGENT_*` (see [`NON_CONFIG_PREFIXES`]): read by the in-process agent;
/// - every `GPUSNAP_TEST_*`, and `GPUSNAP_REPO`, `GPUSNAP_SKIP_CRIU_TESTS`, `GPUSNAP_REQUIRE_ALL`:
///   the test suites;
/// - `GPUSNAP_CRIU`, `GPUSNAP_CRIU_ROOT`, `GPUSNAP_CRIU_FORCE`, `GPUSNAP_CRIU_MIRROR`,
///   `GPUSNAP_CRIU_SUITE`: the CRIU wrapper and installer, and `gpusnap check`;
/// - `GPUSNAP_CLI`, `GPUSNAP_LIBCUDA`, `GPUSNAP_SHM_HUGE`: the GPU scripts.
pub const NON_CONFIG_ENV: &[&str] = &[
    "GPUSNAP_CLI",
    "GPUSNAP_CRIU",
    "GPUSNAP_CRIU_FORCE",
    "GPUSNAP_CRIU_MIRROR",
    "GPUSNAP_CRIU_ROOT",
    "GPUSNAP_CRIU_SUITE",
    "GPUSNAP_LIBCUDA",
    "GPUSNAP_REPO",
    "GPUSNAP_REQUIRE_ALL",
    "GPUSNAP_SHM_HUGE",
    "GPUSNAP_SKIP_CRIU_TESTS",
];

/// Prefixes of `GPUSNAP_*` variables owned by other parts (the agent, the test suites).
pub const NON_CONFIG_PREFIXES: &[&str] = &["GPUSNAP_AGENT_", "GPUSNAP_TEST_"];

const ENV_PREFIX: &str = "GPUSNAP_";

/// Whether and how the plugin checkpoints GPU state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// The split path when the process has the gpusnap agent loaded, transparent otherwise.
    #[default]
    Auto,
    /// Never use the agent, even where it is loaded.
    Transparent,
    /// The plugin is disabled: it declines every hook.
    Off,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Auto => "auto",
            Mode::Transparent => "transparent",
            Mode::Off => "off",
        }
    }
}

/// Compression of GPU memory in the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compress {
    #[default]
    Off,
    Zstd,
    /// zstd where the image directory is on a disk (slower than the compressor), raw where it
    /// is in memory (tmpfs, ramfs, hugetlbfs), where compressing would only cost time.
    Auto,
}

impl Compress {
    pub fn as_str(self) -> &'static str {
        match self {
            Compress::Off => "off",
            Compress::Zstd => "zstd",
            Compress::Auto => "auto",
        }
    }
}

/// How a restore checks the image's data before any restored process runs. Every chunk is
/// checked as it is loaded: against its stored checksum as it is read, or, under `Auto` with
/// device hashes, on the GPU after loading. This chooses:
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verify {
    /// A host pass over every chunk before the GPU is touched, unless every chunk carries a
    /// device hash: then the GPU checks the loaded data instead (no host pass on the critical
    /// path, and no host checksum as chunks are read; damage is found during the load and the
    /// process killed, the image untouched).
    #[default]
    Auto,
    /// Always the host pass before the GPU is touched (`true`, the old default).
    Host,
    /// No pass before the load (`false`).
    Off,
}

impl Verify {
    pub fn as_str(self) -> &'static str {
        match self {
            Verify::Auto => "auto",
            Verify::Host => "host",
            Verify::Off => "off",
        }
    }
}

/// The plugin's own log level, when it should differ from CRIU's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
}

impl LogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
        }
    }

    pub fn to_level_filter(self) -> log::LevelFilter {
        match self {
            LogLevel::Error => log::LevelFilter::Error,
            LogLevel::Warn => log::LevelFilter::Warn,
            LogLevel::Info => log::LevelFilter::Info,
            LogLevel::Debug => log::LevelFilter::Debug,
        }
    }
}

/// The effective configuration. Field names are the keys of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub mode: Mode,
    /// Image writer threads; 0 means one per CPU, at most 16 (see
    /// [`Config::effective_writer_threads`]).
    pub writer_threads: u32,
    /// Image reader threads; 0 means one per CPU, at most 16.
    pub reader_threads: u32,
    /// Size of one pinned staging buffer, in MiB.
    pub staging_slot_mib: u32,
    /// Number of staging buffers.
    pub staging_slots: u32,
    /// Concurrent device↔host copy streams per GPU.
    pub copy_streams: u32,
    pub compress: Compress,
    /// How a restore checks the image's data before the processes run.
    pub verify_before_restore: Verify,
    /// When the image directory has a `parent` link (`criu dump --prev-images-dir`), store only
    /// the chunks that changed since the parent image and reference the others.
    pub incremental: bool,
    /// A dump reports success only once gpusnap's files are on stable storage: every data file
    /// and manifest fsynced, and the image directory fsynced after the last of them was created
    /// or renamed; a failed fsync fails the dump. CRIU's own image files are not covered (CRIU
    /// does not fsync them; see `docs/image-format.md`, "Durability").
    pub durable: bool,
    /// Split path: hand the device memory over to the keeper across the driver checkpoint and
    /// drain it while CRIU dumps the host side (false: copy it out first, on the job's pause).
    pub handover: bool,
    /// `criu dump -R` with the hand-over: the keeper copies the lent memory device to device
    /// into a snapshot of its own, CRIU returns without waiting for the drain, and the keeper's
    /// drainer writes the image afterwards (pending until then: `gpusnap wait`). Off under
    /// container runtimes (CRIU as `swrk`/`service`), which archive the directory at once.
    pub async_leave_running: bool,
    /// The most of a GPU's free memory (percent) an asynchronous `-R` snapshot may take; chosen
    /// per allocation, the largest first: what does not fit is drained on the pause as without
    /// the route.
    pub async_snapshot_share: u32,
    /// The `gpusnap-keeper` binary; empty: next to the plugin, else
    /// `/usr/libexec/gpusnap/gpusnap-keeper`.
    pub keeper: String,
    /// How long to wait for the in-process agent to answer, in milliseconds.
    pub agent_timeout_ms: u64,
    /// Timeout of the GPU lock step in milliseconds; 0 means CRIU's own timeout.
    pub lock_timeout_ms: u64,
    /// (old GPU UUID, new GPU UUID) pairs, each as 32 lowercase hex digits.
    pub device_map: Vec<(String, String)>,
    /// A restore may run on a node whose NVIDIA kernel driver has another version than the
    /// dump's (false: refused at the restore's first hook). The driver library the process had
    /// mapped must be the same file either way.
    pub allow_other_kernel_driver: bool,
    /// `None`: follow CRIU's log level.
    pub log_level: Option<LogLevel>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mode: Mode::Auto,
            writer_threads: 0,
            reader_threads: 0,
            staging_slot_mib: 32,
            staging_slots: 16,
            copy_streams: 4,
            compress: Compress::Off,
            verify_before_restore: Verify::Auto,
            incremental: true,
            durable: false,
            handover: true,
            async_leave_running: false,
            async_snapshot_share: 50,
            keeper: String::new(),
            agent_timeout_ms: 30_000,
            lock_timeout_ms: 0,
            device_map: Vec::new(),
            allow_other_kernel_driver: false,
            log_level: None,
        }
    }
}

/// Threads used when a thread count is 0: the number of CPUs this process may run on, at most 16.
fn auto_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(16)
}

fn resolve_threads(configured: u32) -> usize {
    match configured {
        0 => auto_threads(),
        n => n as usize,
    }
}

impl Config {
    /// `writer_threads`, with 0 resolved to the number of CPUs (at most 16).
    pub fn effective_writer_threads(&self) -> usize {
        resolve_threads(self.writer_threads)
    }

    /// `reader_threads`, with 0 resolved to the number of CPUs (at most 16).
    pub fn effective_reader_threads(&self) -> usize {
        resolve_threads(self.reader_threads)
    }

    /// Size of one staging buffer in bytes.
    pub fn staging_slot_bytes(&self) -> usize {
        self.staging_slot_mib as usize * 1024 * 1024
    }

    pub fn agent_timeout(&self) -> Duration {
        Duration::from_millis(self.agent_timeout_ms)
    }

    /// `None` means "use CRIU's own timeout".
    pub fn lock_timeout(&self) -> Option<Duration> {
        (self.lock_timeout_ms != 0).then(|| Duration::from_millis(self.lock_timeout_ms))
    }

    /// The new GPU UUID (32 lowercase hex digits) that stands in for `old`, if mapped. `old` may
    /// be written in either accepted form.
    pub fn mapped_device(&self, old: &str) -> Option<&str> {
        let old = normalise_uuid(old).ok()?;
        self.device_map
            .iter()
            .find(|(o, _)| *o == old)
            .map(|(_, n)| n.as_str())
    }

    /// One line with every effective value, for the plugin's log at init.
    pub fn describe(&self) -> String {
        let threads = |configured: u32, effective: usize| match configured {
            0 => format!("{effective} (auto)"),
            n => n.to_string(),
        };
        let mut s = format!(
            "mode={} writer_threads={} reader_threads={} staging_slot_mib={} staging_slots={} \
             copy_streams={} compress={} verify_before_restore={} incremental={} durable={} \
             handover={} async_leave_running={} async_snapshot_share={} keeper={} agent_timeout_ms={} lock_timeout_ms={}",
            self.mode.as_str(),
            threads(self.writer_threads, self.effective_writer_threads()),
            threads(self.reader_threads, self.effective_reader_threads()),
            self.staging_slot_mib,
            self.staging_slots,
            self.copy_streams,
            self.compress.as_str(),
            self.verify_before_restore.as_str(),
            self.incremental,
            self.durable,
            self.handover,
            self.async_leave_running,
            self.async_snapshot_share,
            if self.keeper.is_empty() {
                "auto"
            } else {
                self.keeper.as_str()
            },
            self.agent_timeout_ms,
            match self.lock_timeout_ms {
                0 => "0 (criu)".to_owned(),
                n => n.to_string(),
            },
        );
        s.push_str(" device_map=");
        if self.device_map.is_empty() {
            s.push_str("none");
        } else {
            for (i, (old, new)) in self.device_map.iter().enumerate() {
                let sep = if i == 0 { "" } else { "," };
                let _ = write!(s, "{sep}{old}={new}");
            }
        }
        let _ = write!(
            s,
            " allow_other_kernel_driver={}",
            self.allow_other_kernel_driver
        );
        let _ = write!(
            s,
            " log_level={}",
            self.log_level.map_or("criu", LogLevel::as_str)
        );
        s
    }
}

/// The file to read and whether it must exist, given the value of `GPUSNAP_CONFIG` (if set).
/// An empty `GPUSNAP_CONFIG` is taken as set: it names no file, and reading it fails.
/// `GPUSNAP_CONFIG=/dev/null` is the way to ignore the default file.
pub fn config_path(gpusnap_config: Option<&str>) -> (PathBuf, bool) {
    match gpusnap_config {
        Some(p) => (PathBuf::from(p), true),
        None => (PathBuf::from(DEFAULT_PATH), false),
    }
}

/// Loads the configuration from the real file ([`DEFAULT_PATH`] or `GPUSNAP_CONFIG`) and the real
/// environment.
pub fn load() -> Result<Config, ConfigError> {
    let mut env = Vec::new();
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(ENV_PREFIX) {
            continue;
        }
        let Some(value) = value.to_str() else {
            return Err(ConfigError::NotUnicode {
                var: name.to_owned(),
            });
        };
        env.push((name.to_owned(), value.to_owned()));
    }
    let named = env
        .iter()
        .rev()
        .find(|(k, _)| k == CONFIG_ENV)
        .map(|(_, v)| v.as_str());
    let (path, required) = config_path(named);
    load_from(Some(&path), required, &env)
}

/// Loads the configuration from `file` (if any) and then applies `env`, a list of environment
/// variables (other variables than `GPUSNAP_*` are ignored; `GPUSNAP_CONFIG` is not read here).
///
/// Every problem is reported at once: one is returned as itself, several as
/// [`ConfigError::Several`] (each in the order found: the file's keys, then the environment).
///
/// If `file` does not exist, that is an error when `file_required`, and means "defaults"
/// otherwise. Any other failure to read it is always an error, and so is a file that is not a
/// regular file (other than the null device, which reads as empty) or is larger than
/// [`MAX_FILE_BYTES`]. Later entries of `env` win over
/// earlier ones with the same name.
pub fn load_from(
    file: Option<&Path>,
    file_required: bool,
    env: &[(String, String)],
) -> Result<Config, ConfigError> {
    let mut config = Config::default();
    let mut problems = Vec::new();
    if let Some(path) = file {
        apply_file(&mut config, path, file_required, &mut problems);
    }
    apply_env(&mut config, env, &mut problems);
    match problems.len() {
        0 => Ok(config),
        1 => Err(problems.remove(0)),
        _ => Err(ConfigError::Several(problems)),
    }
}

fn apply_file(config: &mut Config, path: &Path, required: bool, problems: &mut Vec<ConfigError>) {
    let text = match file::read(path) {
        Ok(text) => text,
        Err(ConfigError::Read { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound && !required =>
        {
            return;
        }
        Err(e) => return problems.push(e),
    };
    let table: toml::Table = match text.parse() {
        Ok(t) => t,
        Err(e) => {
            return problems.push(ConfigError::Parse {
                path: path.to_owned(),
                message: one_line_parse_error(&text, &e),
            });
        }
    };
    for (name, value) in &table {
        let Some(key) = keys::find(name) else {
            problems.push(ConfigError::UnknownKey {
                path: path.to_owned(),
                key: name.clone(),
                valid: keys::names(),
            });
            continue;
        };
        let origin = Origin::File {
            path: path.to_owned(),
            key: name.clone(),
        };
        if let Err(e) = (key.set)(config, keys::Raw::Toml(value), &origin) {
            problems.push(e);
        }
    }
}

/// `line L, column C: message`, so the error fits on one line of CRIU's log.
fn one_line_parse_error(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim_end();
    let Some(span) = e.span() else {
        return message.to_owned();
    };
    let before = text.get(..span.start).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    format!("line {line}, column {column}: {message}")
}

fn apply_env(config: &mut Config, env: &[(String, String)], problems: &mut Vec<ConfigError>) {
    for (var, value) in env {
        let Some(suffix) = var.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        if var == CONFIG_ENV || NON_CONFIG_ENV.contains(&var.as_str()) {
            continue;
        }
        // The variable must be exactly the uppercased key: GPUSNAP_writer_threads is a typo.
        // Keys come first: GPUSNAP_AGENT_TIMEOUT_MS is a key, other GPUSNAP_AGENT_* are not.
        let key = keys::KEYS
            .iter()
            .find(|k| k.name.to_ascii_uppercase() == suffix);
        if key.is_none() && NON_CONFIG_PREFIXES.iter().any(|p| var.starts_with(p)) {
            continue;
        }
        let Some(key) = key else {
            problems.push(ConfigError::UnknownEnv {
                var: var.clone(),
                valid: valid_env_names(),
            });
            continue;
        };
        let origin = Origin::Env { var: var.clone() };
        if let Err(e) = (key.set)(config, keys::Raw::Env(value), &origin) {
            problems.push(e);
        }
    }
}

/// The variables a user sets: one per key, and `GPUSNAP_CONFIG`. The build, test and script
/// variables that are let through ([`NON_CONFIG_ENV`], [`NON_CONFIG_PREFIXES`]) are not
/// settings, so a typo is not offered them.
fn valid_env_names() -> String {
    let mut names: Vec<String> = keys::KEYS
        .iter()
        .map(|k| format!("{ENV_PREFIX}{}", k.name.to_ascii_uppercase()))
        .collect();
    names.push(CONFIG_ENV.to_owned());
    names.join(", ")
}

/// The names of all configuration keys, in the order of the example file.
pub fn key_names() -> impl Iterator<Item = &'static str> {
    keys::KEYS.iter().map(|k| k.name)
}
