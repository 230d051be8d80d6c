//! The one error type of this crate: every message names where the bad value came from.

use std::fmt;
use std::path::PathBuf;

use crate::device_map::DeviceMapError;

/// Where a value came from: a key in a configuration file, or an environment variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// `key` in the TOML file at `path`.
    File { path: PathBuf, key: String },
    /// The environment variable `var`.
    Env { var: String },
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File { path, key } => write!(f, "key `{key}` in {}", path.display()),
            Origin::Env { var } => write!(f, "environment variable {var}"),
        }
    }
}

/// What a value must be, as [`ConfigError::Invalid`] says it after `expected`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expected {
    /// A key's rule in words (`1..=64`, `one of "off", "zstd", "auto"`).
    Rule(String),
    /// The rule of `device_map`, with what its parser found wrong in the value.
    DeviceMap(DeviceMapError),
}

impl fmt::Display for Expected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expected::Rule(rule) => f.write_str(rule),
            Expected::DeviceMap(e) => write!(f, "{e}"),
        }
    }
}

/// Why the configuration could not be loaded. The plugin refuses to start on any of these rather
/// than run with a configuration the user did not ask for.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file named by `GPUSNAP_CONFIG` does not exist, or an existing file could not be read.
    #[error("cannot read configuration file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The configuration file is not a regular file (nor the null device, which reads as empty).
    #[error(
        "configuration file {} is {what}, not a regular file; only a regular file is read \
         (GPUSNAP_CONFIG=/dev/null reads none)",
        path.display()
    )]
    NotRegular { path: PathBuf, what: &'static str },

    /// The configuration file is larger than any configuration file needs to be.
    #[error(
        "configuration file {} is larger than {} KiB, the most that is read (every key with its \
         comment is about 4 KiB)",
        path.display(),
        max_bytes / 1024
    )]
    TooLarge { path: PathBuf, max_bytes: u64 },

    /// The file is not valid TOML.
    #[error("configuration file {} is not valid TOML: {message}", path.display())]
    Parse { path: PathBuf, message: String },

    /// The file has a key this version does not know.
    #[error("unknown key `{key}` in {}; valid keys: {valid}", path.display())]
    UnknownKey {
        path: PathBuf,
        key: String,
        valid: String,
    },

    /// A `GPUSNAP_*` environment variable that is neither a configuration key nor on the
    /// allowlist of non-configuration variables.
    #[error("unknown environment variable {var}; valid: {valid}")]
    UnknownEnv { var: String, valid: String },

    /// A `GPUSNAP_*` environment variable whose value is not UTF-8.
    #[error("environment variable {var} is not valid UTF-8")]
    NotUnicode { var: String },

    /// A value of the wrong type or outside its range.
    #[error("invalid value {value} for {origin}: expected {allowed}")]
    Invalid {
        origin: Origin,
        value: String,
        allowed: Expected,
    },

    /// More than one of the above, all found in one pass (never nested, never fewer than two).
    #[error("{} configuration problems: {}", .0.len(), numbered(.0))]
    Several(Vec<ConfigError>),
}

impl ConfigError {
    /// Each problem on its own: this one, or every one of [`ConfigError::Several`].
    pub fn problems(&self) -> Vec<&ConfigError> {
        match self {
            ConfigError::Several(all) => all.iter().collect(),
            one => vec![one],
        }
    }
}

fn numbered(all: &[ConfigError]) -> String {
    all.iter()
        .enumerate()
        .map(|(i, e)| format!("({}) {e}", i + 1))
        .collect::<Vec<_>>()
        .join("; ")
}
