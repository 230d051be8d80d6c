//! The Debian packages and a distribution's own `criu` package (issue 25, item 1).
//!
//! `scripts/build-deb.sh` builds `gpusnap` and `gpusnap-criu` from this test build (as the
//! Podman test does); the distribution's `criu` is played by stand-in packages named `criu`
//! (`criu_tests::packages::standin_criu`): dpkg's diversions act on paths, so what
//! `gpusnap-criu` does to Debian's package it does to these. Checked:
//!
//! 1. Debian 12: the distribution's criu (3.17) installed first, then both packages: the
//!    package's CRIU is `/usr/sbin/criu`, the distribution's is kept as `/usr/sbin/criu.distrib`,
//!    no warning at install; `dpkg --purge` of both puts the distribution's file back, byte for
//!    byte, with dpkg's diversions as before and `dpkg --verify criu` clean.
//! 2. The other order (the distribution's criu installed while `gpusnap-criu` is there, as
//!    `apt-get install runc` does through its Recommends): its file goes to `criu.distrib`, the
//!    package's CRIU stays on `PATH`, and the purge of `gpusnap-criu` puts it in place.
//! 3. A distribution whose criu is new enough (Debian 13's 4.1.1: the stand-in runs the
//!    harness's CRIU root, which is Debian trixie's criu): `gpusnap` alone installs without a
//!    word about CRIU, diverts nothing, `gpusnap check` finds that criu good, and a `criu dump
//!    --leave-running` with that criu and its default plugin directory loads the installed
//!    gpusnap. With a 3.17 stand-in instead, the install says that criu is too old.
//!
//! Skipped, with the reason, where dpkg is missing or the host has a `criu` package of its own
//! (the test will not replace it). It takes the Podman test's host-wide lock.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use criu_tests::harness::skipped;
use criu_tests::packages::{
    self, CRIU_BIN, CRIU_DIVERTED, HostCriu, criu_is_standin, dpkg, host_criu, installed,
    standin_criu,
};
use criu_tests::podman::{self, Output};
use criu_tests::{CriuRun, harness};

const TEST: &str = "deb";
const COUNTER: &str = env!("CARGO_BIN_EXE_counter");
/// A Debian 12-like criu: too old for gpusnap.
const OLD_CRIU: &str = "#!/bin/sh\n# stand-in of Debian 12's criu\n\
                        if [ \"$1\" = --version ]; then echo 'Version: 3.17.1'; exit 0; fi\n\
                        echo 'criu 3.17.1 stand-in: not CRIU' >&2\nexit 1\n";

/// Removes what the test installed, whatever happens.
struct Host {
    work: PathBuf,
    _lock: podman::HostLock,
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = dpkg(&["--purge", "gpusnap", "gpusnap-criu"], &self.work);
        if criu_is_standin(&self.work) {
            let _ = dpkg(&["--purge", "criu"], &self.work);
        }
        if std::thread::panicking() {
            eprintln!("criu-tests: keeping {} for inspection", self.work.display());
        } else {
            let _ = fs::remove_dir_all(&self.work);
        }
    }
}

fn ok(o: Result<Output, String>) -> Output {
    let o = o.unwrap_or_else(|e| panic!("{e}"));
    o.assert_ok();
    o
}

/// `criu --version` as a plain system `PATH` finds it: (the path, the version line).
fn criu_on_path(dir: &Path) -> (String, String) {
    let mut cmd = std::process::Command::new("sh");
    cmd.args([
        "-c",
        &format!(
            "PATH={}; command -v criu; criu --version",
            podman::SYSTEM_PATH
        ),
    ]);
    let o = ok(podman::run_bounded(
        &mut cmd,
        "criu --version",
        dir,
        Duration::from_secs(60),
    ));
    let mut lines = o.stdout.lines();
    let path = lines.next().unwrap_or_default().to_owned();
    let version = lines
        .find(|l| l.starts_with("Version:"))
        .unwrap_or_default()
        .to_owned();
    (path, version)
}

/// The diversion of `/usr/sbin/criu`, as (the package that holds it, the path it diverts to),
/// or `None`.
fn diversion(dir: &Path) -> Option<(String, String)> {
    let mut cmd = std::process::Command::new("dpkg-divert");
    cmd.args(["--listpackage", CRIU_BIN]);
    let by = ok(podman::run_bounded(
        &mut cmd,
        "dpkg-divert --listpackage",
        dir,
        Duration::from_secs(60),
    ))
    .stdout
    .trim()
    .to_owned();
    if by.is_empty() {
        return None;
    }
    let mut cmd = std::process::Command::new("dpkg-divert");
    cmd.args(["--truename", CRIU_BIN]);
    let to = ok(podman::run_bounded(
        &mut cmd,
        "dpkg-divert --truename",
        dir,
        Duration::from_secs(60),
    ))
    .stdout
    .trim()
    .to_owned();
    Some((by, to))
}

/// The stand-in `criu` package's files are as it installed them (`dpkg --verify criu`).
fn assert_standin_intact(dir: &Path, what: &str) {
    let v = dpkg(&["--verify", "criu"], dir).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        v.ok() && v.stdout.trim().is_empty(),
        "{what}: the distribution's criu package is not intact\n{v}"
    );
}

/// The lines the packages' maintainer scripts said about CRIU.
fn criu_warnings(o: &Output) -> Vec<String> {
    format!("{}\n{}", o.stdout, o.stderr)
        .lines()
        .filter(|l| l.starts_with("gpusnap:") || l.starts_with("gpusnap-criu:"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn packages_and_the_distributions_criu() {
    let Some(h) = harness(TEST) else {
        return;
    };
    for tool in ["dpkg", "dpkg-deb", "dpkg-divert"] {
        if podman::which(tool).is_none() {
            skipped(
                TEST,
                &format!("{tool} is not installed (not a Debian host)"),
            );
            return;
        }
    }
    let lock = podman::HostLock::take(Duration::from_secs(600)).unwrap_or_else(|e| panic!("{e}"));
    let work = h
        .profile_dir
        .join("criu-tests")
        .join(format!("{TEST}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).unwrap();
    if installed("criu", &work) && !criu_is_standin(&work) {
        skipped(
            TEST,
            "this host has a criu package of its own; the test installs stand-ins of it and will not replace it",
        );
        // A skip leaves nothing behind (the work directory held only dpkg's query output).
        let _ = fs::remove_dir_all(&work);
        return;
    }
    let host = Host { work, _lock: lock };
    let work = &host.work;
    for p in ["gpusnap", "gpusnap-criu", "criu"] {
        if installed(p, work) {
            ok(dpkg(&["--purge", p], work));
        }
    }
    assert!(
        !Path::new(CRIU_BIN).exists() && !Path::new(CRIU_DIVERTED).exists(),
        "{CRIU_BIN} or {CRIU_DIVERTED} exists and no package owns it: the test will not overwrite it"
    );
    let (deb, criu_deb) = packages::build(h, work);
    let (deb, criu_deb) = (deb.to_str().unwrap(), criu_deb.to_str().unwrap());
    let v = h.criu_version;
    // The harness's CRIU says `Version: X.Y` or `X.Y.Z`.
    let is_pkg_criu = |(path, version): &(String, String)| {
        path == CRIU_BIN && version.starts_with(&format!("Version: {}.{}", v.0, v.1))
    };

    // The reason for the diversion is in the package's description.
    let desc = ok(dpkg(&["-f", criu_deb, "Description", "Provides"], work)).stdout;
    for want in [
        "3.17",
        "diverted",
        "/usr/sbin/criu.distrib",
        "do not install this package",
    ] {
        assert!(
            desc.contains(want),
            "gpusnap-criu's description lacks {want:?}\n{desc}"
        );
    }

    // 1. Debian 12: the distribution's criu first.
    let old = standin_criu(work, "3.17.1-2+gpusnaptest1", OLD_CRIU);
    ok(dpkg(&["-i", old.to_str().unwrap()], work));
    let before = host_criu(work);
    assert_eq!(before.criu.as_deref(), Some(OLD_CRIU.as_bytes()));
    let install = ok(dpkg(&["-i", deb, criu_deb], work));
    assert_eq!(
        criu_warnings(&install),
        Vec::<String>::new(),
        "the install complained about CRIU\n{install}"
    );
    let found = criu_on_path(work);
    assert!(
        is_pkg_criu(&found),
        "the criu on PATH is not the package's: {found:?}"
    );
    assert_eq!(
        diversion(work),
        Some(("gpusnap-criu".to_owned(), CRIU_DIVERTED.to_owned()))
    );
    assert_eq!(
        fs::read(CRIU_DIVERTED).ok().as_deref(),
        Some(OLD_CRIU.as_bytes())
    );
    ok(dpkg(&["--purge", "gpusnap", "gpusnap-criu"], work));
    assert_eq!(
        host_criu(work),
        before,
        "the purge did not put the distribution's criu and dpkg's diversions back"
    );
    assert!(!Path::new(CRIU_DIVERTED).exists());
    assert_standin_intact(work, "after the purge");

    // 2. The distribution's criu installed while gpusnap-criu is there.
    ok(dpkg(&["--purge", "criu"], work));
    let before = host_criu(work);
    assert_eq!(before.criu, None);
    ok(dpkg(&["-i", criu_deb], work));
    ok(dpkg(&["-i", old.to_str().unwrap()], work));
    let found = criu_on_path(work);
    assert!(
        is_pkg_criu(&found),
        "the criu on PATH is not the package's: {found:?}"
    );
    assert_eq!(
        fs::read(CRIU_DIVERTED).ok().as_deref(),
        Some(OLD_CRIU.as_bytes())
    );
    ok(dpkg(&["--purge", "gpusnap-criu"], work));
    assert_eq!(
        fs::read(CRIU_BIN).ok().as_deref(),
        Some(OLD_CRIU.as_bytes())
    );
    assert_eq!(diversion(work), None);
    assert_standin_intact(work, "after gpusnap-criu's purge");
    ok(dpkg(&["--purge", "criu"], work));
    assert_eq!(host_criu(work), before);

    // 3a. gpusnap alone beside a 3.17 criu: the install says it is too old.
    ok(dpkg(&["-i", old.to_str().unwrap()], work));
    let install = ok(dpkg(&["-i", deb], work));
    let warned = criu_warnings(&install);
    assert!(
        warned
            .iter()
            .any(|l| l.contains("criu on PATH is 3.17.1") && l.contains(">= 4.1.1")),
        "no word about the old criu\n{install}"
    );
    ok(dpkg(&["--purge", "gpusnap", "criu"], work));

    // 3b. gpusnap alone beside a distribution criu that is new enough.
    let new_criu = format!(
        "#!/bin/sh\n# stand-in of a distribution's criu {}.{}.{}: Debian's binary, run from the test's CRIU root\n\
         GPUSNAP_CRIU_ROOT='{}'; export GPUSNAP_CRIU_ROOT\nexec '{}' \"$@\"\n",
        v.0,
        v.1,
        v.2,
        packages::criu_root(h).display(),
        h.criu.display()
    );
    let new = standin_criu(
        work,
        &format!("{}.{}.{}-1+gpusnaptest1", v.0, v.1, v.2),
        &new_criu,
    );
    ok(dpkg(&["-i", new.to_str().unwrap()], work));
    let before = host_criu(work);
    let install = ok(dpkg(&["-i", deb], work));
    assert_eq!(
        criu_warnings(&install),
        Vec::<String>::new(),
        "the install complained about a new enough criu\n{install}"
    );
    assert_eq!(
        host_criu(work),
        before,
        "gpusnap alone changed {CRIU_BIN} or the diversions"
    );
    let mut cmd = std::process::Command::new("/usr/bin/gpusnap");
    cmd.arg("check").env("PATH", podman::SYSTEM_PATH);
    let check = podman::run_bounded(&mut cmd, "gpusnap check", work, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"));
    let criu_ok = format!("ok    CRIU {}.{}.{} ({CRIU_BIN})", v.0, v.1, v.2);
    assert!(
        check.stdout.lines().any(|l| l.starts_with(&criu_ok)),
        "`gpusnap check` does not find the distribution's criu good (wanted a line {criu_ok:?})\n{check}"
    );
    // That criu, with its default plugin directory, loads the installed gpusnap.
    let w = h.workdir("deb-dump");
    let wl = w.spawn_counter(COUNTER, 3, &[]);
    let log = w.path.join("dump.log");
    let args: Vec<String> = [
        "dump",
        "-t",
        &wl.root().to_string(),
        "-D",
        &w.images.display().to_string(),
        "-v4",
        "-o",
        &log.display().to_string(),
        "--leave-running",
    ]
    .map(str::to_owned)
    .into();
    let dump = CriuRun::run(Path::new(CRIU_BIN), &args, &log).unwrap_or_else(|e| panic!("{e}"));
    dump.assert_ok();
    assert!(
        !dump.gpusnap_lines().is_empty(),
        "{CRIU_BIN} dump did not load /usr/lib/criu/gpusnap.so\n{}",
        dump.diagnostics()
    );
    drop(wl);
    ok(dpkg(&["--purge", "gpusnap"], work));
    assert_eq!(host_criu(work), before);
    ok(dpkg(&["--purge", "criu"], work));
    let after: HostCriu = host_criu(work);
    assert_eq!(after.criu, None);
}
