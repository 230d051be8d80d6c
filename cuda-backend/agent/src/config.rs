//! Settings from the environment, read once: `GPUSNAP_AGENT_MIN_BYTES`, `GPUSNAP_AGENT_DISABLE`,
//! `GPUSNAP_AGENT_APP_VMM`, `GPUSNAP_AGENT_EAGER`, `GPUSNAP_AGENT_DEBUG`. A value the agent
//! cannot read is refused, never replaced by the default (see [`config`]).

use std::fmt;
use std::sync::OnceLock;

use crate::log::error;

/// Allocations smaller than this stay with the driver (cheap to checkpoint, costly to convert).
pub const DEFAULT_MIN_BYTES: u64 = 1 << 20;

const MIN_BYTES_VAR: &str = "GPUSNAP_AGENT_MIN_BYTES";
const DISABLE_VAR: &str = "GPUSNAP_AGENT_DISABLE";
const APP_VMM_VAR: &str = "GPUSNAP_AGENT_APP_VMM";
const EAGER_VAR: &str = "GPUSNAP_AGENT_EAGER";
const DEBUG_VAR: &str = "GPUSNAP_AGENT_DEBUG";

/// What a flag takes (in any letter case), as the plugin's own settings do.
const FLAG: &str = "a flag (1/0, true/false, yes/no or on/off)";
/// What `GPUSNAP_AGENT_MIN_BYTES` takes.
const BYTES: &str = "a number of bytes (a whole number, such as 1048576)";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Smallest `cuMemAlloc` that is converted.
    pub min_bytes: u64,
    /// No conversion at all (hooks pass through, app VMM is still recorded).
    pub disabled: bool,
    /// The application's own `cuMemCreate` handles are virtualized so the split path can move
    /// their memory (`GPUSNAP_AGENT_APP_VMM=0`: recorded only, left to the driver checkpoint).
    pub app_vmm: bool,
    /// Start the agent thread at library load.
    pub eager: bool,
    /// Log to stderr.
    pub debug: bool,
}

/// A variable set to a value the agent cannot read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadSetting {
    pub var: &'static str,
    pub value: String,
    /// What the variable takes.
    pub expected: &'static str,
}

impl fmt::Display for BadSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={:?} is not {}", self.var, self.value, self.expected)
    }
}

/// A flag's value (blanks around it and letter case aside); None for anything else, empty too.
fn parse_flag(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// A byte count (blanks around it aside); None for anything else, empty too.
fn parse_bytes(value: &str) -> Option<u64> {
    value.trim().parse().ok()
}

/// `var`'s value through `parse`, `default` when it is unset; a value `parse` refuses is
/// added to `bad` (and `default` returned, for the caller to discard).
fn read<T>(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
    parse: fn(&str) -> Option<T>,
    expected: &'static str,
    default: T,
    bad: &mut Vec<BadSetting>,
) -> T {
    let Some(value) = get(var) else {
        return default;
    };
    parse(&value).unwrap_or_else(|| {
        bad.push(BadSetting {
            var,
            value,
            expected,
        });
        default
    })
}

impl Config {
    /// Parses settings from a variable lookup (the environment, or a test's map). Every
    /// variable that is set must be valid; otherwise each bad one is returned.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, Vec<BadSetting>> {
        let mut bad = Vec::new();
        let config = Config {
            min_bytes: read(
                &get,
                MIN_BYTES_VAR,
                parse_bytes,
                BYTES,
                DEFAULT_MIN_BYTES,
                &mut bad,
            ),
            disabled: read(&get, DISABLE_VAR, parse_flag, FLAG, false, &mut bad),
            app_vmm: read(&get, APP_VMM_VAR, parse_flag, FLAG, true, &mut bad),
            eager: read(&get, EAGER_VAR, parse_flag, FLAG, false, &mut bad),
            debug: read(&get, DEBUG_VAR, parse_flag, FLAG, false, &mut bad),
        };
        if bad.is_empty() { Ok(config) } else { Err(bad) }
    }

    /// The settings the agent runs with after a bad one: off (see [`config`]), with debug
    /// logging still as `GPUSNAP_AGENT_DEBUG` asks when that variable itself is good.
    fn off(get: impl Fn(&str) -> Option<String>) -> Self {
        Config {
            min_bytes: DEFAULT_MIN_BYTES,
            disabled: true,
            app_vmm: false,
            eager: false,
            debug: get(DEBUG_VAR).and_then(|v| parse_flag(&v)).unwrap_or(false),
        }
    }

    /// The settings to run with: as parsed, or, with any bad variable, [`Config::off`] after
    /// `report` was given every bad one.
    fn resolve(get: impl Fn(&str) -> Option<String>, report: impl FnOnce(&[BadSetting])) -> Self {
        match Self::from_lookup(&get) {
            Ok(config) => config,
            Err(bad) => {
                report(&bad);
                Self::off(&get)
            }
        }
    }
}

/// The refusal logged for bad settings: each one, then what the agent does instead.
fn refusal(bad: &[BadSetting]) -> String {
    let each: Vec<String> = bad.iter().map(ToString::to_string).collect();
    format!(
        "{}; the agent is off in this process: it converts nothing and gpusnap checkpoints the \
         process through the driver alone",
        each.join("; ")
    )
}

/// The process's settings, read from the environment on first use (at library load: see
/// `on_load` in lib.rs).
///
/// A set variable must be valid (blanks around the value and letter case aside; set but empty
/// is not valid). A bad one is refused loudly, never replaced by its default: the agent logs an
/// error naming each bad variable and its value (always written, debugging or not) and turns
/// itself off for this process, as with `GPUSNAP_AGENT_DISABLE=1`. The hooks then pass every
/// allocation through to the driver, the program's own VMM handles stay the driver's (recorded,
/// not taken over) and nothing starts at load, so gpusnap checkpoints all of the process's
/// memory through the driver. Off rather than a default, because off needs no guess at what the
/// user meant: it is the path gpusnap takes for any process without the agent, only slower.
pub fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| {
        // A value that is not UTF-8 is read lossily, so it is refused rather than taken as unset.
        let env = |k: &str| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned());
        Config::resolve(env, |bad| error!("{}", refusal(bad)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn parse(pairs: &[(&str, &str)]) -> Config {
        Config::from_lookup(lookup(pairs)).expect("valid settings")
    }

    /// The bad settings of `pairs`, as `VAR=value` pairs.
    fn refused(pairs: &[(&str, &str)]) -> Vec<(&'static str, String)> {
        Config::from_lookup(lookup(pairs))
            .expect_err("bad settings")
            .into_iter()
            .map(|b| (b.var, b.value))
            .collect()
    }

    #[test]
    fn defaults_and_overrides() {
        assert_eq!(
            parse(&[]),
            Config {
                min_bytes: DEFAULT_MIN_BYTES,
                disabled: false,
                app_vmm: true,
                eager: false,
                debug: false
            }
        );
        let c = parse(&[
            ("GPUSNAP_AGENT_MIN_BYTES", "4096"),
            ("GPUSNAP_AGENT_DISABLE", "1"),
            ("GPUSNAP_AGENT_EAGER", "1"),
            ("GPUSNAP_AGENT_DEBUG", "1"),
            ("GPUSNAP_AGENT_APP_VMM", "0"),
        ]);
        assert_eq!(
            c,
            Config {
                min_bytes: 4096,
                disabled: true,
                app_vmm: false,
                eager: true,
                debug: true
            }
        );
        // A bad MIN_BYTES was taken as the default before; now it is refused (see below).
        assert_eq!(
            refused(&[
                ("GPUSNAP_AGENT_MIN_BYTES", "lots"),
                ("GPUSNAP_AGENT_DISABLE", "0"),
            ]),
            [("GPUSNAP_AGENT_MIN_BYTES", "lots".to_owned())]
        );
        assert!(!parse(&[("GPUSNAP_AGENT_DISABLE", "0")]).disabled);
        assert!(parse(&[("GPUSNAP_AGENT_APP_VMM", "1")]).app_vmm);
    }

    const FLAGS: [&str; 4] = [
        "GPUSNAP_AGENT_DISABLE",
        "GPUSNAP_AGENT_APP_VMM",
        "GPUSNAP_AGENT_EAGER",
        "GPUSNAP_AGENT_DEBUG",
    ];

    #[test]
    fn valid_values() {
        for (v, n) in [
            ("0", 0),
            ("4096", 4096),
            (" 4096\n", 4096),
            ("+512", 512),
            ("18446744073709551615", u64::MAX),
        ] {
            assert_eq!(
                parse(&[("GPUSNAP_AGENT_MIN_BYTES", v)]).min_bytes,
                n,
                "{v:?}"
            );
        }
        for var in FLAGS {
            for (v, on) in [
                ("1", true),
                ("true", true),
                ("YES", true),
                (" On ", true),
                ("0", false),
                ("False", false),
                ("no", false),
                ("OFF", false),
            ] {
                let c = parse(&[(var, v)]);
                let got = match var {
                    "GPUSNAP_AGENT_DISABLE" => c.disabled,
                    "GPUSNAP_AGENT_APP_VMM" => c.app_vmm,
                    "GPUSNAP_AGENT_EAGER" => c.eager,
                    _ => c.debug,
                };
                assert_eq!(got, on, "{var}={v:?}");
            }
        }
    }

    #[test]
    fn invalid_values_are_refused_naming_the_variable_and_value() {
        for v in [
            "lots",
            "-1",
            "1.5",
            "1M",
            "1 048 576",
            "0x100000",
            "18446744073709551616",
        ] {
            assert_eq!(
                refused(&[("GPUSNAP_AGENT_MIN_BYTES", v)]),
                [("GPUSNAP_AGENT_MIN_BYTES", v.to_owned())]
            );
        }
        for var in FLAGS {
            for v in ["2", "-1", "maybe", "enabled", "y", "n", "1 1", "\u{fffd}"] {
                assert_eq!(refused(&[(var, v)]), [(var, v.to_owned())]);
            }
        }
        // Every bad one is named, the good ones are not.
        assert_eq!(
            refused(&[
                ("GPUSNAP_AGENT_MIN_BYTES", "1MiB"),
                ("GPUSNAP_AGENT_APP_VMM", "disable"),
                ("GPUSNAP_AGENT_DEBUG", "1"),
            ]),
            [
                ("GPUSNAP_AGENT_MIN_BYTES", "1MiB".to_owned()),
                ("GPUSNAP_AGENT_APP_VMM", "disable".to_owned()),
            ]
        );
    }

    #[test]
    fn set_but_empty_is_refused() {
        for var in FLAGS.into_iter().chain(["GPUSNAP_AGENT_MIN_BYTES"]) {
            for v in ["", "  "] {
                assert_eq!(refused(&[(var, v)]), [(var, v.to_owned())]);
            }
        }
    }

    #[test]
    fn the_refusal_names_each_bad_value_and_what_it_takes() {
        let bad = Config::from_lookup(lookup(&[
            ("GPUSNAP_AGENT_MIN_BYTES", "lots"),
            ("GPUSNAP_AGENT_EAGER", ""),
        ]))
        .unwrap_err();
        assert_eq!(
            refusal(&bad),
            "GPUSNAP_AGENT_MIN_BYTES=\"lots\" is not a number of bytes (a whole number, such as \
             1048576); GPUSNAP_AGENT_EAGER=\"\" is not a flag (1/0, true/false, yes/no or on/off); \
             the agent is off in this process: it converts nothing and gpusnap checkpoints the \
             process through the driver alone"
        );
    }

    #[test]
    fn a_bad_setting_turns_the_agent_off() {
        let off = Config {
            min_bytes: DEFAULT_MIN_BYTES,
            disabled: true,
            app_vmm: false,
            eager: false,
            debug: false,
        };
        let mut reported = Vec::new();
        let c = Config::resolve(
            lookup(&[
                ("GPUSNAP_AGENT_MIN_BYTES", "4k"),
                ("GPUSNAP_AGENT_EAGER", "1"),
                ("GPUSNAP_AGENT_APP_VMM", "1"),
            ]),
            |bad| reported.extend(bad.iter().map(|b| b.var)),
        );
        assert_eq!(c, off);
        assert_eq!(reported, ["GPUSNAP_AGENT_MIN_BYTES"]);
        // Debug logging stays as asked when that variable itself is good.
        let c = Config::resolve(
            lookup(&[
                ("GPUSNAP_AGENT_MIN_BYTES", "4k"),
                ("GPUSNAP_AGENT_DEBUG", "1"),
            ]),
            |_| {},
        );
        assert_eq!(
            c,
            Config {
                debug: true,
                ..off.clone()
            }
        );
        let c = Config::resolve(lookup(&[("GPUSNAP_AGENT_DEBUG", "loud")]), |_| {});
        assert_eq!(c, off);
        // Good settings are taken as they are, nothing reported.
        let c = Config::resolve(lookup(&[("GPUSNAP_AGENT_MIN_BYTES", "4096")]), |_| {
            panic!("nothing to report")
        });
        assert_eq!(c.min_bytes, 4096);
        assert!(!c.disabled);
    }
}
