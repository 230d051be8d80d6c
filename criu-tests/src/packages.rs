//! The Debian packages as the tests install them: `scripts/build-deb.sh` run on this test
//! build's plugin, agent, CLI and keeper and the harness's CRIU root, `dpkg` bounded in time,
//! what the host has as `/usr/sbin/criu` (to check that a purge puts it back), and stand-ins of
//! Debian's own `criu` package (tests/deb.rs).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::Harness;
use crate::fake_driver::gpusnap_cli;
use crate::podman::{self, Output};

/// The path every `criu` package installs, and the one runc and Podman find.
pub const CRIU_BIN: &str = "/usr/sbin/criu";
/// Where `gpusnap-criu` diverts a distribution's `/usr/sbin/criu`.
pub const CRIU_DIVERTED: &str = "/usr/sbin/criu.distrib";

/// `dpkg ARGS`, run in `dir`, within two minutes.
pub fn dpkg(args: &[&str], dir: &Path) -> Result<Output, String> {
    let mut cmd = std::process::Command::new("dpkg");
    cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
    podman::run_bounded(
        &mut cmd,
        &format!("dpkg {}", args.join(" ")),
        dir,
        Duration::from_secs(120),
    )
}

/// Whether dpkg has package `name` installed (or half-installed: anything but unknown).
pub fn installed(name: &str, dir: &Path) -> bool {
    dpkg(&["-s", name], dir).is_ok_and(|o| o.ok())
}

/// The CRIU root the harness runs (the one `scripts/criu` picks).
pub fn criu_root(h: &Harness) -> PathBuf {
    let root = std::env::var_os("GPUSNAP_CRIU_ROOT")
        .filter(|r| !r.is_empty())
        .map_or_else(|| h.repo.join(".criu-root"), PathBuf::from);
    fs::canonicalize(&root).unwrap_or(root)
}

/// `gpusnap_<version>_amd64.deb` and `gpusnap-criu_<criu>+gpusnap1_amd64.deb`, built by
/// `scripts/build-deb.sh --from <this build> --criu-root <the harness's>` into `work/deb`.
pub fn build(h: &Harness, work: &Path) -> (PathBuf, PathBuf) {
    let from = work.join("artifacts");
    fs::create_dir_all(&from).unwrap();
    let agent = h
        .agent_so()
        .unwrap_or_else(|e| panic!("building the agent: {e}"));
    let cli = gpusnap_cli(h).unwrap_or_else(|e| panic!("building gpusnap: {e}"));
    for (src, name) in [
        (h.plugin_so.as_path(), "libgpusnap_plugin.so"),
        (agent, "libgpusnap_agent.so"),
        (cli, "gpusnap"),
        (h.keeper.as_path(), "gpusnap-keeper"),
    ] {
        fs::copy(src, from.join(name)).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    }
    let mut cmd = std::process::Command::new(h.repo.join("scripts/build-deb.sh"));
    cmd.arg("--from")
        .arg(&from)
        .arg("--out")
        .arg(work.join("deb"))
        .arg("--criu-root")
        .arg(criu_root(h));
    let built = podman::run_bounded(
        &mut cmd,
        "scripts/build-deb.sh",
        work,
        Duration::from_secs(300),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    built.assert_ok();
    let debs: Vec<&str> = built.stdout.lines().map(str::trim).collect();
    let [.., deb, criu_deb] = debs.as_slice() else {
        panic!("scripts/build-deb.sh printed no two packages\n{built}");
    };
    for d in [deb, criu_deb] {
        assert!(
            d.ends_with("_amd64.deb") && Path::new(d).is_file(),
            "no package {d:?} from scripts/build-deb.sh\n{built}"
        );
    }
    assert!(
        criu_deb.contains("/gpusnap-criu_"),
        "{criu_deb}: not the CRIU package\n{built}"
    );
    (PathBuf::from(deb), PathBuf::from(criu_deb))
}

/// What the host has as `/usr/sbin/criu` (its bytes, or none) and dpkg's diversions: the
/// packages' purge must leave both as they were before the install.
#[derive(Debug, PartialEq, Eq)]
pub struct HostCriu {
    pub criu: Option<Vec<u8>>,
    pub diversions: String,
}

pub fn host_criu(dir: &Path) -> HostCriu {
    let mut cmd = std::process::Command::new("dpkg-divert");
    cmd.arg("--list");
    let list = podman::run_bounded(&mut cmd, "dpkg-divert --list", dir, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"));
    list.assert_ok();
    let mut diversions: Vec<&str> = list.stdout.lines().collect();
    diversions.sort_unstable();
    HostCriu {
        criu: fs::read(CRIU_BIN).ok(),
        diversions: diversions.join("\n"),
    }
}

/// The maintainer field of the stand-ins of Debian's `criu` package: a `criu` package with
/// another one is the host's own, and the tests leave it alone.
pub const STANDIN_MAINTAINER: &str = "gpusnap tests <criu-tests@localhost>";

/// A stand-in of a distribution's `criu` package, named `criu`, of version `version`, whose
/// only files are `/usr/sbin/criu` (the shell script `script`) and a note in
/// `/usr/share/doc/criu`: dpkg's diversions act on paths, so what `gpusnap-criu` does to
/// Debian's package it does to this one. Written to `dir`; returns the `.deb`.
pub fn standin_criu(dir: &Path, version: &str, script: &str) -> PathBuf {
    let root = dir.join(format!("criu-standin-{version}"));
    let _ = fs::remove_dir_all(&root);
    let sbin = root.join("usr/sbin");
    let doc = root.join("usr/share/doc/criu");
    let debian = root.join("DEBIAN");
    for d in [&sbin, &doc, &debian] {
        fs::create_dir_all(d).unwrap();
    }
    fs::write(sbin.join("criu"), script).unwrap();
    fs::set_permissions(sbin.join("criu"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::write(
        doc.join("README.stand-in"),
        "A stand-in of a distribution's criu package, made by gpusnap's tests.\n",
    )
    .unwrap();
    fs::write(
        debian.join("control"),
        format!(
            "Package: criu\nVersion: {version}\nArchitecture: amd64\nMaintainer: {STANDIN_MAINTAINER}\n\
             Section: admin\nPriority: optional\nDescription: stand-in of a distribution's criu (gpusnap's tests)\n \
             Made and removed by criu-tests; it is not CRIU.\n"
        ),
    )
    .unwrap();
    let mut sums = String::new();
    for f in ["usr/sbin/criu", "usr/share/doc/criu/README.stand-in"] {
        let o = std::process::Command::new("md5sum")
            .arg(f)
            .current_dir(&root)
            .output()
            .unwrap();
        assert!(o.status.success(), "md5sum {f}");
        sums.push_str(&String::from_utf8_lossy(&o.stdout));
    }
    fs::write(debian.join("md5sums"), sums).unwrap();
    let deb = dir.join(format!("criu_{version}_amd64.deb"));
    let mut cmd = std::process::Command::new("dpkg-deb");
    cmd.arg("--root-owner-group")
        .arg("--build")
        .arg(&root)
        .arg(&deb);
    podman::run_bounded(&mut cmd, "dpkg-deb --build", dir, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"))
        .assert_ok();
    deb
}

/// Whether the installed `criu` package is one of the tests' stand-ins.
pub fn criu_is_standin(dir: &Path) -> bool {
    dpkg(&["-s", "criu"], dir).is_ok_and(|o| {
        o.ok()
            && o.stdout
                .contains(&format!("Maintainer: {STANDIN_MAINTAINER}"))
    })
}
