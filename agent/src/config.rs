//! Settings from the environment, read once: `GPUSNAP_AGENT_MIN_BYTES`, `GPUSNAP_AGENT_DISABLE`,
//! `GPUSNAP_AGENT_EAGER`, `GPUSNAP_AGENT_DEBUG`.

use std::sync::OnceLock;

/// Allocations smaller than this stay with the driver (cheap to checkpoint, costly to convert).
pub const DEFAULT_MIN_BYTES: u64 = 1 << 20;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Smallest `cuMemAlloc` that is converted.
    pub min_bytes: u64,
    /// No conversion at all (hooks pass through, app VMM is still recorded).
    pub disabled: bool,
    /// Start the agent thread at library load.
    pub eager: bool,
    /// Log to stderr.
    pub debug: bool,
}

impl Config {
    /// Parses settings from a variable lookup (the environment, or a test's map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let flag =
            |k: &str| get(k).is_some_and(|v| matches!(v.trim(), "1" | "true" | "yes" | "on"));
        let min_bytes = get("GPUSNAP_AGENT_MIN_BYTES")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(DEFAULT_MIN_BYTES);
        Config {
            min_bytes,
            disabled: flag("GPUSNAP_AGENT_DISABLE"),
            eager: flag("GPUSNAP_AGENT_EAGER"),
            debug: flag("GPUSNAP_AGENT_DEBUG"),
        }
    }
}

/// The process's settings, read from the environment on first use.
pub fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| Config::from_lookup(|k| std::env::var(k).ok()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(pairs: &[(&str, &str)]) -> Config {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn defaults_and_overrides() {
        assert_eq!(
            parse(&[]),
            Config {
                min_bytes: DEFAULT_MIN_BYTES,
                disabled: false,
                eager: false,
                debug: false
            }
        );
        let c = parse(&[
            ("GPUSNAP_AGENT_MIN_BYTES", "4096"),
            ("GPUSNAP_AGENT_DISABLE", "1"),
            ("GPUSNAP_AGENT_EAGER", "1"),
            ("GPUSNAP_AGENT_DEBUG", "1"),
        ]);
        assert_eq!(
            c,
            Config {
                min_bytes: 4096,
                disabled: true,
                eager: true,
                debug: true
            }
        );
        let c = parse(&[
            ("GPUSNAP_AGENT_MIN_BYTES", "lots"),
            ("GPUSNAP_AGENT_DISABLE", "0"),
        ]);
        assert_eq!((c.min_bytes, c.disabled), (DEFAULT_MIN_BYTES, false));
    }
}
