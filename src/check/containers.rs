//! `gpusnap check`, the container part: what Podman will run when it checkpoints.
//!
//! - `criu` on `PATH`: runc runs `criu swrk` from its `PATH` (Podman passes its own), not the
//!   criu that `GPUSNAP_CRIU` names; it must be CRIU >= 4.1.1 (the distribution's, or the
//!   gpusnap-criu package's). Otherwise runc says `checkpoint/restore requires at least CRIU 31100`, or
//!   gpusnap stays disabled.
//! - the OCI runtime Podman uses (`podman info`): runc can checkpoint; crun only when built
//!   with CRIU (`+CRIU` in `crun --version`; Debian 12's is not: `unknown command checkpoint`).
//! - where Podman keeps CRIU's logs: it deletes them after a success unless `--keep` is given.
//! - whether containers can start at all where the host's hard `nofile` limit is below
//!   Podman's default ulimits and there is no CAP_SYS_RESOURCE.
//!
//! Nothing is reported when Podman is not installed. Environment: `PATH`, `CONTAINERS_CONF`.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{CriuSeen, Finding, MIN_CRIU, parse_criu_version};

/// Podman's default `nofile` ulimit for containers (hard and soft).
const PODMAN_DEFAULT_NOFILE: u64 = 1 << 20;
/// CAP_SYS_RESOURCE's bit in the capability sets.
const CAP_SYS_RESOURCE: u32 = 24;

/// The container findings (none without Podman). `seen` is the criu the host part judged.
pub(crate) fn findings(seen: Option<&CriuSeen>) -> Vec<Finding> {
    let Some(podman) = on_path("podman") else {
        return Vec::new();
    };
    let mut out: Vec<Finding> = criu_on_path(seen).into_iter().collect();
    let info = Command::new(&podman)
        .args([
            "info",
            "--format",
            "{{.Host.OCIRuntime.Name}}|{{.Host.OCIRuntime.Path}}|{{.Store.GraphRoot}}",
        ])
        .output();
    match info {
        Ok(o) if o.status.success() => {
            let text = String::from_utf8_lossy(&o.stdout);
            let mut f = text.trim().splitn(3, '|');
            let (name, path, graph_root) = (
                f.next().unwrap_or_default(),
                f.next().unwrap_or_default(),
                f.next().unwrap_or_default(),
            );
            let version = Command::new(path)
                .arg("--version")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            out.push(runtime_finding(name, path, &version));
            out.push(criu_logs_finding(graph_root));
        }
        Ok(o) => out.push(Finding::warn(
            format!(
                "`podman info` failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            "cannot tell which OCI runtime Podman uses; fix Podman first",
        )),
        Err(e) => out.push(Finding::warn(
            format!("`podman info` does not run: {e}"),
            "cannot tell which OCI runtime Podman uses",
        )),
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let conf = containers_conf_text();
    out.extend(ulimit_finding(
        hard_nofile(),
        has_cap(&status, CAP_SYS_RESOURCE),
        &conf,
    ));
    out
}

/// `name` in a directory of `PATH` (only `PATH`: it is what runc searches).
fn on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The `criu` runc will run; nothing when it is the criu the host part already failed as too
/// old (one `fail` line for one old criu: that line names what runc needs too).
fn criu_on_path(seen: Option<&CriuSeen>) -> Option<Finding> {
    let Some(criu) = on_path("criu") else {
        return Some(criu_on_path_finding(None, None));
    };
    if seen.is_some_and(|s| s.too_old() && same_file(&s.path, &criu)) {
        return None;
    }
    let version = Command::new(&criu)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| parse_criu_version(&String::from_utf8_lossy(&o.stdout)));
    Some(criu_on_path_finding(Some(&criu), version))
}

/// Whether two paths name one file (the same device and inode, links followed).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (a.metadata(), b.metadata()) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// What the `criu` runc will run means for container checkpoints.
fn criu_on_path_finding(criu: Option<&Path>, version: Option<(u32, u32, u32)>) -> Finding {
    let need = format!("{}.{}.{}", MIN_CRIU.0, MIN_CRIU.1, MIN_CRIU.2);
    let todo = format!(
        "runc runs `criu` from PATH: install CRIU >= {need} as `criu` on Podman's PATH (the \
         distribution's where it is new enough, else the gpusnap-criu package that \
         scripts/build-deb.sh --with-criu builds), or set runc's --criu"
    );
    match (criu, version) {
        (None, _) => Finding::fail("no criu on PATH: Podman (runc) cannot checkpoint", todo),
        (Some(c), Some(v)) if v >= MIN_CRIU => Finding::ok(format!(
            "criu on PATH ({}) is CRIU {}.{}.{}: what runc runs for Podman",
            c.display(),
            v.0,
            v.1,
            v.2
        )),
        (Some(c), Some(v)) => Finding::fail(
            format!(
                "criu on PATH ({}) is CRIU {}.{}.{}: runc would run it and gpusnap needs {need}",
                c.display(),
                v.0,
                v.1,
                v.2
            ),
            todo,
        ),
        (Some(c), None) => Finding::warn(
            format!(
                "criu on PATH ({}): cannot tell its version (runc then fails with \
                 `checkpoint/restore requires at least CRIU 31100`)",
                c.display()
            ),
            todo,
        ),
    }
}

/// `Some(true)` if a `crun --version` text lists `+CRIU`, `Some(false)` if it lists features
/// without it, `None` if it lists none.
fn crun_has_criu(version: &str) -> Option<bool> {
    let features: Vec<&str> = version
        .split_whitespace()
        .filter(|w| w.starts_with('+') || w.starts_with('-'))
        .collect();
    if features.is_empty() {
        None
    } else {
        Some(features.contains(&"+CRIU"))
    }
}

/// Whether Podman's OCI runtime (`name` at `path`, `version` its `--version` output) can
/// checkpoint.
fn runtime_finding(name: &str, path: &str, version: &str) -> Finding {
    let use_runc = "use runc: `runtime = \"runc\"` in the [engine] table of containers.conf, \
                    or `podman --runtime runc` when the container is created";
    match name {
        "runc" => Finding::ok(format!(
            "podman's runtime runc can checkpoint ({path}; it runs criu from PATH)"
        )),
        "crun" => match crun_has_criu(version) {
            Some(true) => Finding::ok(format!(
                "podman's runtime crun can checkpoint ({path}, built with +CRIU; on cgroup v1 \
                 hosts crun refuses checkpoints, runc does not)"
            )),
            Some(false) => Finding::fail(
                format!(
                    "podman's runtime crun ({path}) is built without CRIU: `podman container \
                     checkpoint` fails with `unknown command checkpoint` (Debian 12's crun)"
                ),
                use_runc,
            ),
            None => Finding::warn(
                format!("podman's runtime crun ({path}): cannot tell whether it has CRIU"),
                format!("`crun --version` must list +CRIU; else {use_runc}"),
            ),
        },
        "" => Finding::warn(
            "podman info names no OCI runtime",
            "check `podman info`; gpusnap was tested under runc",
        ),
        other => Finding::warn(
            format!("podman's runtime {other} ({path}): not tested with gpusnap"),
            use_runc,
        ),
    }
}

fn criu_logs_finding(graph_root: &str) -> Finding {
    let root = if graph_root.is_empty() {
        "<GraphRoot>"
    } else {
        graph_root
    };
    Finding::ok(format!(
        "Podman keeps CRIU's logs (with gpusnap's lines) in \
         {root}/overlay-containers/<container id>/userdata/dump.log and restore.log only with \
         `--keep`; `podman inspect -f '{{{{.State.CheckpointLog}}}}' CTR` names them"
    ))
}

fn hard_nofile() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only to `r`, a valid local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return u64::MAX;
    }
    r.rlim_max
}

fn has_cap(status: &str, cap: u32) -> bool {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << cap) != 0)
}

/// The containers.conf Podman reads first (`CONTAINERS_CONF`, else the system one).
fn containers_conf_text() -> String {
    let path = std::env::var_os("CONTAINERS_CONF")
        .map_or_else(|| "/etc/containers/containers.conf".into(), PathBuf::from);
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Containers cannot start where Podman's default `nofile` exceeds the hard limit and raising
/// it is not allowed, unless containers.conf sets `default_ulimits`.
fn ulimit_finding(hard_nofile: u64, sys_resource: bool, conf: &str) -> Option<Finding> {
    if hard_nofile >= PODMAN_DEFAULT_NOFILE || sys_resource {
        return None;
    }
    let set = conf
        .lines()
        .any(|l| l.trim_start().starts_with("default_ulimits"));
    Some(if set {
        Finding::ok(format!(
            "hard nofile limit {hard_nofile} without CAP_SYS_RESOURCE; containers.conf sets default_ulimits"
        ))
    } else {
        Finding::warn(
            format!(
                "hard nofile limit {hard_nofile} without CAP_SYS_RESOURCE: containers fail to start \
                 (`setrlimit RLIMIT_NOFILE: Operation not permitted`)"
            ),
            format!(
                "set default_ulimits = [\"nofile={hard_nofile}:{hard_nofile}\", \"nproc=1024:1024\"] \
                 in the [containers] table of containers.conf (or --ulimit on podman run)"
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::Level;

    #[test]
    fn criu_on_path_is_judged() {
        let p = Path::new("/usr/local/sbin/criu");
        assert_eq!(criu_on_path_finding(None, None).level, Level::Fail);
        let ok = criu_on_path_finding(Some(p), Some((4, 1, 1)));
        assert_eq!(ok.level, Level::Ok);
        assert!(
            ok.line()
                .contains("criu on PATH (/usr/local/sbin/criu) is CRIU 4.1.1")
        );
        let old = criu_on_path_finding(Some(p), Some((3, 17, 1)));
        assert_eq!(old.level, Level::Fail);
        assert!(
            old.line().contains("gpusnap-criu package"),
            "{}",
            old.line()
        );
        assert_eq!(criu_on_path_finding(Some(p), None).level, Level::Warn);
    }

    #[test]
    fn one_criu_is_one_file() {
        let t = std::env::temp_dir().join(format!("gpusnap-same-file-{}", std::process::id()));
        std::fs::create_dir_all(&t).unwrap();
        let (criu, other, link) = (t.join("criu"), t.join("other"), t.join("link"));
        std::fs::write(&criu, b"").unwrap();
        std::fs::write(&other, b"").unwrap();
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&criu, &link).unwrap();
        assert!(same_file(&criu, &link));
        assert!(!same_file(&criu, &other));
        assert!(!same_file(&criu, &t.join("missing")));
        std::fs::remove_dir_all(&t).unwrap();
    }

    #[test]
    fn runtimes_are_judged() {
        let debian_crun = "crun version 1.8.1\ncommit: f8a096be060b22ccd3d5f3ebe44108517fbf6c30\n\
                           rundir: /run/user/0/crun\nspec: 1.0.0\n\
                           +SYSTEMD +SELINUX +APPARMOR +CAP +SECCOMP +EBPF +YAJL\n";
        assert_eq!(crun_has_criu(debian_crun), Some(false));
        assert_eq!(
            crun_has_criu("crun version 1.14\n+SYSTEMD +CRIU +YAJL"),
            Some(true)
        );
        assert_eq!(crun_has_criu("crun version 1.8.1"), None);
        let f = runtime_finding("crun", "/usr/bin/crun", debian_crun);
        assert_eq!(f.level, Level::Fail);
        assert!(f.line().contains("unknown command checkpoint") && f.line().contains("runc"));
        assert_eq!(
            runtime_finding("crun", "/usr/bin/crun", "+CRIU").level,
            Level::Ok
        );
        let runc = runtime_finding("runc", "/usr/bin/runc", "runc version 1.1.5");
        assert_eq!(runc.level, Level::Ok);
        assert!(runc.line().contains("podman's runtime runc can checkpoint"));
        assert_eq!(runtime_finding("youki", "/x", "").level, Level::Warn);
    }

    #[test]
    fn the_criu_log_place_is_named() {
        let f = criu_logs_finding("/var/lib/containers/storage");
        assert!(f.line().contains(
            "/var/lib/containers/storage/overlay-containers/<container id>/userdata/dump.log"
        ));
        assert!(f.line().contains("--keep") && f.line().contains("{{.State.CheckpointLog}}"));
    }

    #[test]
    fn ulimits_are_judged() {
        assert!(ulimit_finding(1 << 20, false, "").is_none());
        assert!(ulimit_finding(20000, true, "").is_none());
        let warn = ulimit_finding(20000, false, "").unwrap();
        assert_eq!(warn.level, Level::Warn);
        assert!(warn.line().contains("nofile=20000:20000"));
        let set = "[containers]\ndefault_ulimits = [\"nofile=20000:20000\"]\n";
        assert_eq!(ulimit_finding(20000, false, set).unwrap().level, Level::Ok);
    }
}
