//! The workspace's other artifacts, built from a running test: cdylibs (which `cargo test`
//! never rebuilds, not even a package's own) and the binaries of other packages (a test sees
//! `CARGO_BIN_EXE_*` only for its own package's binaries), in the profile and target dir of the
//! running test binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use crate::fixtures::output_text;

/// `target/<profile>` of the running test binary (`<target>/<profile>/deps/<test binary>`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .unwrap_or_else(|| panic!("unexpected test binary location {}", exe.display()))
        .to_owned()
}

/// A file cargo built into `profile_dir` (or its `deps/`).
pub fn artifact(profile_dir: &Path, name: &str) -> Option<PathBuf> {
    [profile_dir.join(name), profile_dir.join("deps").join(name)]
        .into_iter()
        .find(|c| c.is_file())
}

/// `$CARGO build -p <packages>` in the profile and target dir of `profile_dir`.
pub fn cargo_build(profile_dir: &Path, packages: &[&str]) -> Result<(), String> {
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev".to_owned(),
        Some(p) => p.to_owned(),
        None => return Err(format!("bad profile dir {}", profile_dir.display())),
    };
    let target_dir = profile_dir.parent().ok_or("profile dir has no parent")?;
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.args(["build", "--quiet", "--profile", &profile])
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null());
    for p in packages {
        cmd.args(["-p", p]);
    }
    eprintln!("criu-tests: building {packages:?} ({profile})");
    let out = cmd
        .output()
        .map_err(|e| format!("cargo build {packages:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo build {packages:?} failed ({}):\n{}",
            out.status,
            output_text(&out)
        ));
    }
    Ok(())
}

/// Builds `package` and returns its `artifact` (a file in `profile_dir` or its `deps/`).
pub fn package(profile_dir: &Path, package: &str, artifact: &str) -> Result<PathBuf, String> {
    cargo_build(profile_dir, &[package])?;
    self::artifact(profile_dir, artifact).ok_or_else(|| {
        format!(
            "{artifact} was not produced by building {package} (in {})",
            profile_dir.display()
        )
    })
}

/// Builds `package` (once per test binary) and returns its `artifact`, in the running test's
/// profile; panics if either fails. Always built once: a file already there may be stale.
pub fn built(package: &'static str, artifact: &str) -> PathBuf {
    static BUILT: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let profile_dir = profile_dir();
    let mut done = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !done.contains(&package) {
        cargo_build(&profile_dir, &[package]).unwrap_or_else(|e| panic!("{e}"));
        done.push(package);
    }
    self::artifact(&profile_dir, artifact)
        .unwrap_or_else(|| panic!("{artifact} not found after building {package}"))
}

/// The hostile test build of the agent (`gpusnap-agent` with its `hostile` feature:
/// `gpusnap_proto::hostile`), built once per test binary into a target dir of its own
/// (`<target>/hostile`) so that the feature never reaches the workspace's own agent.
pub fn hostile_agent() -> PathBuf {
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut done = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = done.as_ref() {
        return p.clone();
    }
    let profile_dir = profile_dir();
    let target = profile_dir
        .parent()
        .expect("profile dir has a parent")
        .join("hostile");
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.args([
        "build",
        "--quiet",
        "-p",
        "gpusnap-agent",
        "--features",
        "hostile",
        "--lib",
    ])
    .arg("--target-dir")
    .arg(&target)
    .current_dir(env!("CARGO_MANIFEST_DIR"))
    .stdin(Stdio::null());
    eprintln!(
        "criu-tests: building the hostile agent into {}",
        target.display()
    );
    let out = cmd.output().expect("cargo build of the hostile agent");
    assert!(
        out.status.success(),
        "cargo build of the hostile agent failed ({}):\n{}",
        out.status,
        output_text(&out)
    );
    let so = artifact(&target.join("debug"), "libgpusnap_agent.so")
        .expect("libgpusnap_agent.so in the hostile target dir");
    *done = Some(so.clone());
    so
}
