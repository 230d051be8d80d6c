//! The table of configuration keys: one entry per key, each with the setter that validates a raw
//! value (from the file or from the environment) into [`Config`].

use crate::error::{ConfigError, Expected, Origin};
use crate::{Compress, Config, LogLevel, Mode, Verify, device_map};

/// A value before validation.
#[derive(Clone, Copy)]
pub(crate) enum Raw<'a> {
    Toml(&'a toml::Value),
    Env(&'a str),
}

impl Raw<'_> {
    fn shown(&self) -> String {
        match self {
            Raw::Toml(v) => v.to_string(),
            Raw::Env(s) => format!("{s:?}"),
        }
    }
}

type Setter = fn(&mut Config, Raw<'_>, &Origin) -> Result<(), ConfigError>;

/// One configuration key.
pub(crate) struct Key {
    pub name: &'static str,
    pub set: Setter,
}

const THREADS: &str = "0 (one per CPU, at most 16) or an integer in 1..=64";

pub(crate) const KEYS: &[Key] = &[
    Key {
        name: "mode",
        set: |c, r, o| {
            c.mode = match string(r, o, MODES)? {
                "auto" => Mode::Auto,
                "transparent" => Mode::Transparent,
                "off" => Mode::Off,
                _ => return Err(invalid(r, o, MODES)),
            };
            Ok(())
        },
    },
    Key {
        name: "writer_threads",
        set: |c, r, o| {
            c.writer_threads = int(r, o, 0, 64, THREADS)?;
            Ok(())
        },
    },
    Key {
        name: "reader_threads",
        set: |c, r, o| {
            c.reader_threads = int(r, o, 0, 64, THREADS)?;
            Ok(())
        },
    },
    Key {
        name: "staging_slot_mib",
        set: |c, r, o| {
            c.staging_slot_mib = int(r, o, 1, 1024, "an integer in 1..=1024")?;
            Ok(())
        },
    },
    Key {
        name: "staging_slots",
        set: |c, r, o| {
            c.staging_slots = int(r, o, 2, 256, "an integer in 2..=256")?;
            Ok(())
        },
    },
    Key {
        name: "copy_streams",
        set: |c, r, o| {
            c.copy_streams = int(r, o, 1, 16, "an integer in 1..=16")?;
            Ok(())
        },
    },
    Key {
        name: "compress",
        set: |c, r, o| {
            c.compress = match string(r, o, COMPRESS)? {
                "off" => Compress::Off,
                "zstd" => Compress::Zstd,
                "auto" => Compress::Auto,
                _ => return Err(invalid(r, o, COMPRESS)),
            };
            Ok(())
        },
    },
    Key {
        name: "verify_before_restore",
        set: |c, r, o| {
            // The old boolean spellings still mean what they did: true = a host pass always.
            c.verify_before_restore = match boolean(r, o) {
                Ok(true) => Verify::Host,
                Ok(false) => Verify::Off,
                Err(_) => match string(r, o, VERIFY)? {
                    "auto" => Verify::Auto,
                    "host" => Verify::Host,
                    "off" => Verify::Off,
                    _ => return Err(invalid(r, o, VERIFY)),
                },
            };
            Ok(())
        },
    },
    Key {
        name: "incremental",
        set: |c, r, o| {
            c.incremental = boolean(r, o)?;
            Ok(())
        },
    },
    Key {
        name: "durable",
        set: |c, r, o| {
            c.durable = boolean(r, o)?;
            Ok(())
        },
    },
    Key {
        name: "handover",
        set: |c, r, o| {
            c.handover = boolean(r, o)?;
            Ok(())
        },
    },
    Key {
        name: "async_leave_running",
        set: |c, r, o| {
            c.async_leave_running = boolean(r, o)?;
            Ok(())
        },
    },
    Key {
        name: "async_snapshot_share",
        set: |c, r, o| {
            c.async_snapshot_share = int(r, o, 1, 90, "an integer in 1..=90 (percent)")?;
            Ok(())
        },
    },
    Key {
        name: "keeper",
        set: |c, r, o| {
            let path = string(r, o, "an absolute path to gpusnap-keeper, or \"\"")?;
            if !path.is_empty() && !path.starts_with('/') {
                return Err(invalid(r, o, "an absolute path to gpusnap-keeper, or \"\""));
            }
            c.keeper = path.to_owned();
            Ok(())
        },
    },
    Key {
        name: "agent_timeout_ms",
        set: |c, r, o| {
            c.agent_timeout_ms = int(r, o, 100, 600_000, "milliseconds in 100..=600000")?;
            Ok(())
        },
    },
    Key {
        name: "lock_timeout_ms",
        set: |c, r, o| {
            c.lock_timeout_ms = int(
                r,
                o,
                0,
                3_600_000,
                "0 (CRIU's own timeout) or milliseconds in 1..=3600000",
            )?;
            Ok(())
        },
    },
    Key {
        name: "device_map",
        set: |c, r, o| {
            let text = string(
                r,
                o,
                "a string of OLD=NEW GPU UUID pairs separated by commas",
            )?;
            c.device_map = device_map::parse(text).map_err(|why| ConfigError::Invalid {
                origin: o.clone(),
                value: r.shown(),
                allowed: Expected::DeviceMap(why),
            })?;
            Ok(())
        },
    },
    Key {
        name: "allow_other_kernel_driver",
        set: |c, r, o| {
            c.allow_other_kernel_driver = boolean(r, o)?;
            Ok(())
        },
    },
    Key {
        name: "log_level",
        set: |c, r, o| {
            c.log_level = match string(r, o, LOG_LEVELS)? {
                "" => None,
                "error" => Some(LogLevel::Error),
                "warn" => Some(LogLevel::Warn),
                "info" => Some(LogLevel::Info),
                "debug" => Some(LogLevel::Debug),
                _ => return Err(invalid(r, o, LOG_LEVELS)),
            };
            Ok(())
        },
    },
];

const MODES: &str = "one of \"auto\", \"transparent\", \"off\"";
const COMPRESS: &str = "one of \"off\", \"zstd\", \"auto\"";
const VERIFY: &str = "one of \"auto\", \"host\", \"off\" (or true = host, false = off)";
const LOG_LEVELS: &str =
    "one of \"error\", \"warn\", \"info\", \"debug\", or \"\" to follow CRIU's log level";

pub(crate) fn find(name: &str) -> Option<&'static Key> {
    KEYS.iter().find(|k| k.name == name)
}

/// The key names, comma separated, for error messages.
pub(crate) fn names() -> String {
    KEYS.iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
}

fn invalid(raw: Raw<'_>, origin: &Origin, allowed: &str) -> ConfigError {
    ConfigError::Invalid {
        origin: origin.clone(),
        value: raw.shown(),
        allowed: Expected::Rule(allowed.to_owned()),
    }
}

fn int<T: TryFrom<u64>>(
    raw: Raw<'_>,
    origin: &Origin,
    min: u64,
    max: u64,
    allowed: &str,
) -> Result<T, ConfigError> {
    let value = match raw {
        Raw::Toml(toml::Value::Integer(i)) => u64::try_from(*i).ok(),
        Raw::Toml(_) => None,
        Raw::Env(s) => env_decimal(s),
    };
    value
        .filter(|v| (min..=max).contains(v))
        .and_then(|v| T::try_from(v).ok())
        .ok_or_else(|| match raw {
            Raw::Toml(_) => invalid(raw, origin, allowed),
            Raw::Env(_) => invalid(raw, origin, &format!("{allowed}, {ENV_INTEGER}")),
        })
}

/// How an integer is written in the environment.
const ENV_INTEGER: &str = "written in decimal digits only (no sign, spaces or leading zeros)";

/// An integer from the environment: decimal digits only, as a TOML integer is written, so
/// `+4`, ` 4`, `04` or `4_000` are refused rather than read as 4 or 4000. (`str::parse` alone
/// takes a leading `+`.)
fn env_decimal(s: &str) -> Option<u64> {
    let digits_only = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let leading_zero = s.len() > 1 && s.starts_with('0');
    if !digits_only || leading_zero {
        return None;
    }
    s.parse().ok()
}

/// The accepted spellings of a boolean in the environment.
const ENV_BOOLEAN: &str = "exactly one of true, false, 1, 0";

fn boolean(raw: Raw<'_>, origin: &Origin) -> Result<bool, ConfigError> {
    let value = match raw {
        Raw::Toml(toml::Value::Boolean(b)) => Some(*b),
        Raw::Toml(_) => None,
        // The file's spellings, plus 1/0, which the documentation and scripts use
        // (GPUSNAP_DURABLE=1). Exactly these: no case folding, no spaces, no yes/no or on/off.
        Raw::Env(s) => match s {
            "true" | "1" => Some(true),
            "false" | "0" => Some(false),
            _ => None,
        },
    };
    value.ok_or_else(|| match raw {
        Raw::Toml(_) => invalid(raw, origin, "true or false"),
        Raw::Env(_) => invalid(raw, origin, ENV_BOOLEAN),
    })
}

fn string<'a>(raw: Raw<'a>, origin: &Origin, allowed: &str) -> Result<&'a str, ConfigError> {
    match raw {
        Raw::Toml(toml::Value::String(s)) => Ok(s.as_str()),
        Raw::Toml(_) => Err(invalid(raw, origin, allowed)),
        // As written: the file's string is not trimmed either (`mode = " auto"` is refused).
        Raw::Env(s) => Ok(s),
    }
}
