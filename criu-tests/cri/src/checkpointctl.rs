//! Debian's `checkpointctl` (the checkpoint-restore project's tool that reads the checkpoint
//! archives of Podman, CRI-O and containerd), unpacked by `scripts/install-checkpointctl.sh`
//! into `.checkpointctl-root` and run through `scripts/checkpointctl` (on the CRIU root's glibc:
//! Debian's build needs glibc 2.38, Debian 12 has 2.36).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use criu_tests::podman::{Output, run_bounded};

/// The root `scripts/install-checkpointctl.sh` unpacks into:
/// `$GPUSNAP_CHECKPOINTCTL_ROOT`, else `<repo>/.checkpointctl-root`.
pub fn root(repo: &Path) -> PathBuf {
    std::env::var_os("GPUSNAP_CHECKPOINTCTL_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join(".checkpointctl-root"))
}

/// The installed `checkpointctl`.
#[derive(Debug, Clone)]
pub struct Checkpointctl {
    /// `scripts/checkpointctl`.
    pub launcher: PathBuf,
    pub root: PathBuf,
}

/// Finds the installed `checkpointctl`; the error says why there is none (printed as the
/// reason a test skipped it).
pub fn find(repo: &Path) -> Result<Checkpointctl, String> {
    let launcher = repo.join("scripts/checkpointctl");
    let root = root(repo);
    if !root.join("usr/bin/checkpointctl").is_file()
        || !root.join(".gpusnap-checkpointctl-root").is_file()
    {
        return Err(format!(
            "{} has no usr/bin/checkpointctl: run scripts/install-checkpointctl.sh (scripts/test.sh does)",
            root.display()
        ));
    }
    if !launcher.is_file() {
        return Err(format!("{} is missing", launcher.display()));
    }
    Ok(Checkpointctl { launcher, root })
}

/// What `checkpointctl inspect` showed of an archive.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// One line: engine, container, sizes, what of gpusnap's files was counted.
    pub summary: String,
    /// The container's mounts from `spec.dump`: (destination, source).
    pub mounts: Vec<(String, String)>,
    /// The command of the container's first process, from CRIU's images.
    pub command: String,
}

impl Checkpointctl {
    /// `checkpointctl <args>`, bounded in time.
    pub fn run(&self, args: &[&str], work: &Path) -> Result<Output, String> {
        let mut cmd = Command::new(&self.launcher);
        cmd.env("GPUSNAP_CHECKPOINTCTL_ROOT", &self.root).args(args);
        run_bounded(
            &mut cmd,
            &format!("checkpointctl {}", args.join(" ")),
            work,
            Duration::from_secs(120),
        )
    }

    /// Runs `checkpointctl inspect` on the CRI checkpoint `archive` of container `container`
    /// (as a tree, then `--all --format json`) and checks that it reads it: the engine is
    /// containerd, the container's name is `container`, and its checkpoint size is the sum of
    /// the sizes of the archive's `checkpoint/` files (`files`, from the archive's listing),
    /// gpusnap's `gpusnap-*` files among them (there must be some).
    pub fn assert_reads(
        &self,
        archive: &Path,
        container: &str,
        files: &[(String, u64)],
        work: &Path,
    ) -> Result<Report, String> {
        let a = archive.display().to_string();
        let tree = self.run(&["inspect", &a], work)?;
        if !tree.ok() || !tree.stdout.contains(container) || !tree.stdout.contains("containerd") {
            return Err(format!(
                "checkpointctl inspect does not show container {container} of containerd:\n{tree}"
            ));
        }
        let out = self.run(&["inspect", &a, "--all", "--format", "json"], work)?;
        if !out.ok() {
            return Err(format!("{out}"));
        }
        let json: serde_json::Value = serde_json::from_str(&out.stdout)
            .map_err(|e| format!("checkpointctl inspect --format json: {e}\n{out}"))?;
        let node = json
            .as_array()
            .and_then(|a| a.first())
            .ok_or_else(|| format!("checkpointctl inspect --format json: no container: {json}"))?;
        let field = |k: &str| node[k].as_str().unwrap_or_default().to_owned();
        if field("engine") != "containerd" || field("container_name") != container {
            return Err(format!(
                "checkpointctl: engine {:?}, container {:?}; expected containerd, {container:?}: {node}",
                field("engine"),
                field("container_name")
            ));
        }
        let in_checkpoint = |f: &str| f.trim_start_matches("./").starts_with("checkpoint/");
        let name = |f: &str| {
            f.trim_start_matches("./")
                .trim_start_matches("checkpoint/")
                .to_owned()
        };
        let criu: u64 = files
            .iter()
            .filter(|(f, _)| in_checkpoint(f))
            .map(|f| f.1)
            .sum();
        let ours: Vec<&(String, u64)> = files
            .iter()
            .filter(|(f, _)| in_checkpoint(f) && name(f).starts_with("gpusnap-"))
            .collect();
        let ours_bytes: u64 = ours.iter().map(|f| f.1).sum();
        let total = node["checkpoint_size"]["total_size"].as_u64().unwrap_or(0);
        let pages = node["checkpoint_size"]["memory_pages_size"]
            .as_u64()
            .unwrap_or(0);
        if ours.is_empty() || total != criu || total < ours_bytes + pages {
            return Err(format!(
                "checkpointctl's checkpoint size {total} (pages {pages}) is not the archive's \
                 checkpoint/ files ({criu} bytes) with gpusnap's {} files ({ours_bytes} bytes) \
                 among them: {node}",
                ours.len()
            ));
        }
        let mounts = node["mounts"]
            .as_array()
            .map(|m| {
                m.iter()
                    .map(|m| {
                        let s = |k: &str| m[k].as_str().unwrap_or_default().to_owned();
                        (s("destination"), s("source"))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let command = node["process_tree"]["command"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let summary = format!(
            "engine containerd, container {container}, checkpoint size {total} bytes (memory \
             pages {pages}), gpusnap's {} files ({ours_bytes} bytes: {}) counted in it",
            ours.len(),
            ours.iter()
                .map(|f| name(&f.0))
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(Report {
            summary,
            mounts,
            command,
        })
    }
}
