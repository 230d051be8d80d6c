//! Settings from the environment, read once: `GPUSNAP_AGENT_MIN_BYTES`, `GPUSNAP_AGENT_DISABLE`,
//! `GPUSNAP_AGENT_APP_VMM`, `GPUSNAP_AGENT_EAGER`, `GPUSNAP_AGENT_DEBUG`.

use std::sync::OnceLock;

/// Allocations smaller than this stay with the driver (cheap to checkpoint, costly to convert).
pub const DEFAULT_MIN_BYTES: u64 = 1 << 20;

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

impl Config {
    /// Parses settings from a variable lookup (the environment, or a test's map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let flag =
            |k: &str| get(k).is_some_and(|v| matches!(v.trim(), "1" | "true" | "yes" | "on"));
        let min_bytes = get("GPUSNAP_AGENT_MIN_BYTES")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(DEFAULT_MIN_BYTES);
        let off =
            |k: &str| get(k).is_some_and(|v| matches!(v.trim(), "0" | "false" | "no" | "off"));
        Config {
            min_bytes,
            disabled: flag("GPUSNAP_AGENT_DISABLE"),
            app_vmm: !off("GPUSNAP_AGENT_APP_VMM"),
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
        let c = parse(&[
            ("GPUSNAP_AGENT_MIN_BYTES", "lots"),
            ("GPUSNAP_AGENT_DISABLE", "0"),
        ]);
        assert_eq!((c.min_bytes, c.disabled), (DEFAULT_MIN_BYTES, false));
        assert!(parse(&[("GPUSNAP_AGENT_APP_VMM", "1")]).app_vmm);
    }
}
