//! `gpusnap check`, the CDI part: can a container get the agent with one flag?
//!
//! The package installs a CDI spec, `/etc/cdi/gpusnap.json`: the device
//! `gpusnap.dev/agent=split` bind-mounts the agent read-only into the container and sets
//! `LD_PRELOAD` to it. Runtimes that read CDI specs (Podman >= 4.1, containerd, CRI-O) apply it
//! for `--device gpusnap.dev/agent=split` (Podman) or the CDI device request of their own
//! configuration. This module checks that the spec is there and means what it should: the kind
//! and the device, an `LD_PRELOAD` that names the mount's container path, a mount whose host
//! file is the agent, read-only; that no other spec declares the same kind (the runtimes refuse
//! a device declared twice); and, where Podman is installed, whether its version reads CDI.
//!
//! Nothing is a failure unless a spec is there and broken: without a spec a container can still
//! get the agent by hand (`-v` and `-e LD_PRELOAD=`).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use super::Finding;

/// The spec the package installs.
pub const SPEC: &str = "/etc/cdi/gpusnap.json";
/// The directories CDI runtimes read specs from, by default.
const SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];
pub const KIND: &str = "gpusnap.dev/agent";
pub const DEVICE: &str = "split";
/// The first Podman that applies CDI devices given with `--device`.
const PODMAN_CDI: (u32, u32) = (4, 1);

/// The CDI findings.
pub fn findings() -> Vec<Finding> {
    let mut out = Vec::new();
    let spec = Path::new(SPEC);
    match std::fs::read_to_string(spec) {
        Ok(text) => out.push(match spec_problem(&text) {
            None => Finding::ok(format!(
                "CDI spec {SPEC}: `--device {KIND}={DEVICE}` mounts the agent into a container \
                 and preloads it"
            )),
            Some(why) => Finding::fail(
                format!("CDI spec {SPEC}: {why}"),
                "reinstall the gpusnap package (dpkg -i gpusnap_*.deb), or remove the file",
            ),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => out.push(Finding::warn(
            format!("no CDI spec {SPEC}: containers cannot get the agent with `--device {KIND}={DEVICE}`"),
            "install the gpusnap package, or add the agent by hand: -v \
             /usr/lib/gpusnap/libgpusnap_agent.so:/usr/lib/gpusnap/libgpusnap_agent.so:ro -e \
             LD_PRELOAD=/usr/lib/gpusnap/libgpusnap_agent.so",
        )),
        Err(e) => out.push(Finding::fail(
            format!("CDI spec {SPEC}: {e}"),
            "make it readable, or reinstall the gpusnap package",
        )),
    }
    let others = other_specs_of_kind(&SPEC_DIRS.map(PathBuf::from));
    if !others.is_empty() {
        out.push(Finding::fail(
            format!(
                "other CDI specs declare {KIND}: {}",
                others
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            format!("remove them: runtimes refuse a device declared twice; {SPEC} is the one"),
        ));
    }
    if let Some(version) = podman_version() {
        out.push(podman_finding(&version));
    }
    out
}

/// What is wrong with a spec's text, or `None`.
pub fn spec_problem(text: &str) -> Option<String> {
    spec_problem_with(text, |p| std::fs::metadata(p).is_ok_and(|m| m.is_file()))
}

/// [`spec_problem`], with `is_file` saying whether a host path is a regular file.
fn spec_problem_with(text: &str, is_file: impl Fn(&Path) -> bool) -> Option<String> {
    let doc: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return Some(format!("not valid JSON: {e}")),
    };
    if !doc["cdiVersion"].is_string() {
        return Some("no cdiVersion".into());
    }
    if doc["kind"] != KIND {
        return Some(format!("kind is {}, not {KIND:?}", doc["kind"]));
    }
    let Some(devices) = doc["devices"].as_array() else {
        return Some("no devices list".into());
    };
    let Some(dev) = devices.iter().find(|d| d["name"] == DEVICE) else {
        return Some(format!("no device named {DEVICE:?}"));
    };
    let edits = &dev["containerEdits"];
    let preload: Vec<&str> = edits["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e.as_str()?.strip_prefix("LD_PRELOAD="))
        .collect();
    let [preload] = preload.as_slice() else {
        return Some(format!(
            "device {DEVICE:?} sets LD_PRELOAD {} times, not once",
            preload.len()
        ));
    };
    if !preload.ends_with("/libgpusnap_agent.so") {
        return Some(format!(
            "LD_PRELOAD={preload}: not the agent libgpusnap_agent.so"
        ));
    }
    let Some(mount) = edits["mounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["containerPath"] == *preload)
    else {
        return Some(format!(
            "LD_PRELOAD={preload}, but no mount puts anything there in the container"
        ));
    };
    let Some(host) = mount["hostPath"].as_str() else {
        return Some(format!("the mount at {preload} has no hostPath"));
    };
    if !is_file(Path::new(host)) {
        return Some(format!(
            "the mount's host file {host} is missing: containers with the device would fail to start"
        ));
    }
    let options: Vec<&str> = mount["options"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if !options.contains(&"ro") || !options.contains(&"bind") {
        return Some(format!(
            "the mount of {host} has options {options:?}: it must be a read-only bind mount (\"ro\", \"bind\")"
        ));
    }
    None
}

/// Spec files other than [`SPEC`] in `dirs` that declare [`KIND`].
fn other_specs_of_kind(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for d in dirs {
        let Ok(entries) = std::fs::read_dir(d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p == Path::new(SPEC)
                || !matches!(
                    p.extension().and_then(|x| x.to_str()),
                    Some("json" | "yaml" | "yml")
                )
            {
                continue;
            }
            // A spec names its kind once; a text search finds it in JSON and YAML alike.
            if std::fs::read_to_string(&p).is_ok_and(|t| t.contains(KIND)) {
                found.push(p);
            }
        }
    }
    found.sort();
    found
}

/// `podman --version`'s text, if Podman is on `PATH` and answers.
fn podman_version() -> Option<String> {
    let o = Command::new("podman").arg("--version").output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

/// Whether the Podman of `version` (`podman version 4.3.1`) applies CDI devices.
fn podman_finding(version: &str) -> Finding {
    let v = version.split_whitespace().last().unwrap_or_default();
    let mut parts = v.split(['.', '-', '+']).map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) if (major, minor) >= PODMAN_CDI => Finding::ok(format!(
            "Podman {v} reads CDI specs from {}: `podman run --device {KIND}={DEVICE} ...` gives a \
             container the agent",
            SPEC_DIRS.join(" and ")
        )),
        (Some(_), Some(_)) => Finding::warn(
            format!(
                "Podman {v} does not read CDI specs (Podman {}.{} does)",
                PODMAN_CDI.0, PODMAN_CDI.1
            ),
            "add the agent by hand: -v /usr/lib/gpusnap/libgpusnap_agent.so:/usr/lib/gpusnap/libgpusnap_agent.so:ro -e LD_PRELOAD=/usr/lib/gpusnap/libgpusnap_agent.so",
        ),
        _ => Finding::warn(
            format!("cannot read Podman's version from {:?}", version.trim()),
            format!(
                "Podman {}.{} or newer reads CDI specs",
                PODMAN_CDI.0, PODMAN_CDI.1
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec `scripts/build-deb.sh` installs, read from the script itself.
    fn packaged_spec() -> String {
        let script = include_str!("../../scripts/build-deb.sh");
        let start = script
            .find("<<'SPEC'\n")
            .expect("build-deb.sh writes the spec with <<'SPEC'")
            + "<<'SPEC'\n".len();
        let len = script[start..].find("\nSPEC\n").expect("end of the spec");
        script[start..start + len].to_owned()
    }

    fn agent_exists(p: &Path) -> bool {
        p == Path::new("/usr/lib/gpusnap/libgpusnap_agent.so")
    }

    #[test]
    fn the_packaged_spec_is_sound() {
        assert_eq!(spec_problem_with(&packaged_spec(), agent_exists), None);
    }

    #[test]
    fn broken_specs_are_named() {
        let good = packaged_spec();
        let cases: [(&str, &str, &str); 7] = [
            (
                "\"kind\": \"gpusnap.dev/agent\"",
                "\"kind\": \"nvidia.com/gpu\"",
                "kind is",
            ),
            (
                "\"name\": \"split\"",
                "\"name\": \"fast\"",
                "no device named",
            ),
            (
                "\"LD_PRELOAD=/usr/lib/gpusnap/libgpusnap_agent.so\"",
                "\"LD_LIBRARY_PATH=/x\"",
                "LD_PRELOAD 0 times",
            ),
            (
                "\"containerPath\": \"/usr/lib/gpusnap/libgpusnap_agent.so\"",
                "\"containerPath\": \"/opt/agent.so\"",
                "no mount puts anything there",
            ),
            (
                "\"hostPath\": \"/usr/lib/gpusnap/libgpusnap_agent.so\"",
                "\"hostPath\": \"/nowhere/libgpusnap_agent.so\"",
                "host file /nowhere/libgpusnap_agent.so is missing",
            ),
            ("[\"ro\", ", "[", "read-only bind mount"),
            ("\"cdiVersion\"", "\"version\"", "no cdiVersion"),
        ];
        for (from, to, why) in cases {
            assert!(good.contains(from), "{from}");
            let bad = good.replacen(from, to, 1);
            let got = spec_problem_with(&bad, agent_exists);
            assert!(
                got.as_deref().is_some_and(|g| g.contains(why)),
                "{from} -> {to}: {got:?}, expected {why:?}"
            );
        }
        let got = spec_problem_with("{\"cdiVersion\": ", agent_exists).unwrap();
        assert!(got.contains("not valid JSON"), "{got}");
    }

    #[test]
    fn podman_versions() {
        assert!(
            podman_finding("podman version 4.3.1\n")
                .line()
                .starts_with("ok")
        );
        assert!(
            podman_finding("podman version 5.0.0-dev\n")
                .line()
                .starts_with("ok")
        );
        let old = podman_finding("podman version 3.4.4\n").line();
        assert!(
            old.starts_with("warn") && old.contains("does not read CDI"),
            "{old}"
        );
        assert!(podman_finding("podman\n").line().starts_with("warn"));
    }

    #[test]
    fn other_specs_of_the_kind_are_found() {
        let dir = std::env::temp_dir().join(format!("gpusnap-cdi-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("nvidia.yaml"), "kind: nvidia.com/gpu\n").unwrap();
        std::fs::write(dir.join("old.yaml"), "kind: gpusnap.dev/agent\n").unwrap();
        std::fs::write(dir.join("notes.txt"), "gpusnap.dev/agent").unwrap();
        let found = other_specs_of_kind(&[dir.clone(), dir.join("absent")]);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(found, [dir.join("old.yaml")]);
    }
}
