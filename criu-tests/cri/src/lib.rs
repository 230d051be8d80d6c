//! The kubelet's checkpoint route, without a kubelet: two containerd 2.x instances ("nodes")
//! spoken to over CRI as the kubelet speaks to them, a registry and OCI images made by the
//! test, and a checkpoint image built from a CRI checkpoint archive (`tests/route.rs`).
//!
//! - [`checkpointctl`]: Debian's `checkpointctl` (`scripts/install-checkpointctl.sh`), reading
//!   the CRI checkpoint archives;
//! - [`cri`]: a blocking CRI client (the `k8s-cri` protobufs over tonic, on a unix socket);
//! - [`node`]: one containerd instance with its own root, state, sockets, configuration, and
//!   `criu` wrapper (the harness's CRIU root, the gpusnap plugin from a private directory, the
//!   stand-in driver);
//! - [`oci`]: OCI images (image layouts, manifests, configs) written by the test;
//! - [`registry`]: a read-only OCI distribution registry on 127.0.0.1, serving those images
//!   (containerd pulls the base image of a checkpoint at restore even when it has it);
//! - [`route`]: what the route tests share (CRI logs, root file systems, pods, the checkpoint
//!   image, the clean-up).

pub mod checkpointctl;
pub mod cri;
pub mod node;
pub mod oci;
pub mod registry;
pub mod route;

use std::path::PathBuf;

/// The containerd root unpacked by `scripts/install-containerd.sh`:
/// `$GPUSNAP_CONTAINERD_ROOT`, else `<repo>/.containerd-root`.
pub fn containerd_root(repo: &std::path::Path) -> PathBuf {
    std::env::var_os("GPUSNAP_CONTAINERD_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join(".containerd-root"))
}

/// Why the test cannot run here (printed as the reason it was skipped), or `None`.
pub fn cannot_run(repo: &std::path::Path) -> Option<String> {
    let root = containerd_root(repo);
    for b in ["containerd", "containerd-shim-runc-v2", "ctr"] {
        if !root.join("usr/bin").join(b).is_file() {
            return Some(format!(
                "{} has no usr/bin/{b}: run scripts/install-containerd.sh (.ci/run does)",
                root.display()
            ));
        }
    }
    if criu_tests::podman::which("runc").is_none() {
        return Some("runc is not installed (apt-get install runc; .ci/run does)".into());
    }
    if !std::path::Path::new("/bin/busybox").is_file() {
        return Some(
            "/bin/busybox is missing (apt-get install busybox-static; .ci/run does)".into(),
        );
    }
    None
}
