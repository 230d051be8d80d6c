//! What the route tests share (`tests/route.rs`, the transparent path; `tests/split.rs`, the
//! split path through CDI): the jobs' CRI logs, the images' root file systems, the pods, the
//! checkpoint image, the refusal of a checkpoint under CRIU 4.1, and the clean-up of everything
//! a test started.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use criu_tests::fake_driver::{FakeDriver, shorts};
use criu_tests::podman::{run_bounded, shared_libraries};

use crate::cri::PodSpec;
use crate::node::{CriuSetup, Node, NodeGpus};
use crate::oci;
use crate::registry::Registry;

/// A job's output from its CRI log (`<time> stdout F <line>`, partial lines `P` joined): the
/// lines, in order.
pub fn cri_log_lines(path: &Path) -> Vec<String> {
    let text = fs::read_to_string(path).unwrap_or_default();
    let mut out = Vec::new();
    let mut partial = String::new();
    for l in text.lines() {
        let mut f = l.splitn(4, ' ');
        let (_, _, tag, rest) = (f.next(), f.next(), f.next(), f.next().unwrap_or(""));
        partial.push_str(rest);
        if tag != Some("P") {
            out.push(std::mem::take(&mut partial));
        }
    }
    out
}

/// The lines of the container log a CRI checkpoint archive carries (`container.log`): the
/// job's output up to the checkpoint, which containerd may write at the head of the restored
/// container's log.
pub fn archived_log_lines(archive: &Path, work: &Path) -> Vec<String> {
    let out = work.join("archived-container.log");
    fs::write(&out, archive_member(archive, "container.log", work)).unwrap();
    cri_log_lines(&out)
}

/// The text of file `member` of the tar `archive` (bytes that are not UTF-8 replaced; empty
/// when it has no such file).
pub fn archive_member(archive: &Path, member: &str, work: &Path) -> String {
    let dir = work.join("archive-members");
    fs::create_dir_all(&dir).unwrap();
    let mut cmd = std::process::Command::new("tar");
    cmd.arg("-C").arg(&dir).arg("-xf").arg(archive).arg(member);
    run_bounded(
        &mut cmd,
        &format!("tar -xf {member}"),
        work,
        Duration::from_secs(60),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let bytes = fs::read(dir.join(member)).unwrap_or_default();
    let _ = fs::remove_dir_all(&dir);
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The regular files of the tar `archive`: (path, size), in archive order.
pub fn archive_files(archive: &Path, work: &Path) -> Vec<(String, u64)> {
    let mut cmd = std::process::Command::new("tar");
    cmd.arg("-tvf").arg(archive);
    let r = run_bounded(&mut cmd, "tar -tvf", work, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"));
    r.assert_ok();
    // `-rw-r--r-- root/root 1234 2025-01-01 00:00 checkpoint/pages-1.img`
    r.stdout
        .lines()
        .filter(|l| l.starts_with('-'))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let size = f.get(2)?.parse().ok()?;
            Some((f.get(5..)?.join(" "), size))
        })
        .collect()
}

/// An image's root file system as one tar layer: busybox (`sh`, `sleep`, `cat`), and each
/// `(file, path in the image)` of `files` with the shared libraries it needs; `libs_only`
/// are only the libraries of (the files themselves come from elsewhere, e.g. a CDI mount).
pub fn rootfs_layer(work: &Path, files: &[(&Path, &str)], libs_only: &[&Path]) -> Vec<u8> {
    let rootfs = work.join("rootfs");
    let put = |src: &Path, dst: &str| {
        let to = rootfs.join(dst.trim_start_matches('/'));
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(src, &to).unwrap_or_else(|e| panic!("{} -> {}: {e}", src.display(), to.display()));
    };
    let busybox = [(Path::new("/bin/busybox"), "/bin/busybox")];
    for &(bin, at) in busybox.iter().chain(files) {
        put(bin, at);
    }
    for bin in files.iter().map(|f| f.0).chain(libs_only.iter().copied()) {
        for lib in shared_libraries(bin).unwrap_or_else(|e| panic!("{e}")) {
            put(&lib, &lib.display().to_string());
        }
    }
    for tool in ["sh", "sleep", "cat"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(tool)).unwrap();
    }
    for d in ["tmp", "dev", "proc", "sys", "etc"] {
        fs::create_dir_all(rootfs.join(d)).unwrap();
    }
    let tar = work.join("rootfs.tar");
    let mut cmd = std::process::Command::new("tar");
    cmd.arg("-C").arg(&rootfs).arg("-cf").arg(&tar).arg(".");
    run_bounded(&mut cmd, "tar", work, Duration::from_secs(60))
        .unwrap()
        .assert_ok();
    fs::read(&tar).unwrap()
}

/// Everything a route test started; dropping it shuts the nodes down, stops the registry,
/// unmounts what is left under `work` and removes the pods' cgroups (and `work`, unless the
/// test failed).
#[derive(Debug)]
pub struct Setup {
    pub work: PathBuf,
    pub nodes: Vec<Node>,
    pub registry: Registry,
}

impl Setup {
    /// Starts a node per `(name, gpus)` under `work`, says which CRIU (`v`) and containerd
    /// run, and has every node pull `images`. `what` names the test in that line.
    #[allow(clippy::too_many_arguments)]
    pub fn start_nodes(
        &mut self,
        what: &str,
        v: (u32, u32, u32),
        containerd: &Path,
        criu: &CriuSetup,
        nodes: &[(&str, &NodeGpus)],
        pause: &str,
        images: &[&str],
    ) {
        for (name, gpus) in nodes {
            let n = Node::start(name, &self.work.join(name), containerd, criu, gpus, pause)
                .unwrap_or_else(|e| panic!("{e}"));
            self.nodes.push(n);
        }
        eprintln!(
            "criu-tests: {what} with CRIU {}.{}.{}, containerd {}",
            v.0,
            v.1,
            v.2,
            self.nodes[0]
                .cri()
                .version()
                .map(|r| r.runtime_version)
                .unwrap_or_default()
        );
        for n in &mut self.nodes {
            for r in images {
                n.cri()
                    .pull_image(r)
                    .unwrap_or_else(|e| panic!("node {}: {e}\n{}", n.name, n.log()));
            }
        }
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.shut_down();
        }
        crate::node::unmount_under(&self.work);
        remove_cgroups();
        if std::thread::panicking() {
            eprintln!("criu-tests: keeping {} for inspection", self.work.display());
        } else {
            let _ = fs::remove_dir_all(&self.work);
        }
    }
}

/// Removes the pods' cgroup parent (and what runc left in it) in every hierarchy.
fn remove_cgroups() {
    fn rmdir_tree(d: &Path) {
        if let Ok(entries) = fs::read_dir(d) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    rmdir_tree(&e.path());
                }
            }
        }
        let _ = fs::remove_dir(d);
    }
    let parent = cgroup_parent();
    let name = parent.trim_start_matches('/');
    let mut roots = vec![PathBuf::from("/sys/fs/cgroup")];
    if let Ok(entries) = fs::read_dir("/sys/fs/cgroup") {
        roots.extend(entries.flatten().map(|e| e.path()));
    }
    for r in roots {
        let d = r.join(name);
        if d.is_dir() {
            rmdir_tree(&d);
        }
    }
}

/// The pods' cgroup parent: one per test process.
pub fn cgroup_parent() -> String {
    format!("/gpusnap-cri-{}", std::process::id())
}

/// Pod `name` on `node`: its logs in the node's log directory, the test's cgroup parent.
pub fn pod(node: &Node, name: &str) -> PodSpec {
    PodSpec {
        name: name.into(),
        uid: format!("uid-{name}-{}", std::process::id()),
        log_directory: node.logs.join(name),
        cgroup_parent: cgroup_parent(),
    }
}

/// A CRI checkpoint under CRIU 4.1, refused at once: containerd freezes the container before
/// it checkpoints, and CRIU 4.1 calls PAUSE_DEVICES before it thaws it, so gpusnap refuses the
/// dump there (the agent could not answer, nor the driver lock frozen threads: either would
/// wait for CRIU's timeout). Checks that `checkpointed` (what `CheckpointContainer` answered
/// for container `id` on `node`) is a failure, that CRIU's log has gpusnap's refusal naming
/// CRIU 4.2 and no wait for CRIU's timeout, and that the stand-in driver (`fake`) was asked
/// nothing that changes job `pid`'s state. Returns the refusal line.
pub fn assert_refused_frozen(
    node: &Node,
    id: &str,
    checkpointed: Result<(), String>,
    fake: &FakeDriver,
    pid: i32,
) -> String {
    let log = node.failed_dump_log(id);
    assert!(
        checkpointed.is_err(),
        "CRI CheckpointContainer of a frozen container succeeded on CRIU 4.1\n--- dump.log ---\n{log}"
    );
    let line = log
        .lines()
        .find(|l| {
            l.contains("gpusnap:")
                && l.contains("its cgroup is frozen")
                && l.contains("calls PAUSE_DEVICES before it thaws it")
                && l.contains("Use CRIU 4.2 or later")
        })
        .unwrap_or_else(|| {
            panic!(
                "no refusal of the frozen container in CRIU's log ({:?})\n--- dump.log ---\n{log}\n--- containerd {} ---\n{}",
                checkpointed.err(),
                node.name,
                node.log()
            )
        })
        .to_owned();
    for stall in [
        "interrupted by a signal",
        "Timeout reached",
        "agent is there but unusable",
    ] {
        assert!(
            !log.contains(stall),
            "CRIU's log of the refused checkpoint has {stall:?}\n--- dump.log ---\n{log}"
        );
    }
    let ops = fake.ops(pid);
    assert!(
        ops.is_empty(),
        "the stand-in driver was asked to change the frozen job's state: {:?}\n{}",
        shorts(&ops),
        fake.log_text(pid)
    );
    line
}

/// A `GPU-…` UUID as gpusnap and the stand-in driver print it: 32 hex digits.
pub fn hex(uuid: &str) -> String {
    uuid.trim_start_matches("GPU-").replace('-', "")
}

/// Every process named `comm` started by a node whose directory is `dir` (one of its
/// ancestors, the shim, names `dir` in its command line), sorted.
pub fn job_pids(dir: &Path, comm: &str) -> Vec<i32> {
    let dir = dir.display().to_string();
    let of_node = |mut p: i32| {
        for _ in 0..32 {
            let cmdline = fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&dir) {
                return true;
            }
            let stat = fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // `pid (comm) state ppid ...`: the comm may hold spaces, not `)`.
            match stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok())
            {
                Some(pp) if pp > 1 => p = pp,
                _ => return false,
            }
        }
        false
    };
    let mut out: Vec<i32> = fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                .filter(|&p| {
                    fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == comm)
                        && of_node(p)
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort_unstable();
    out
}

/// The checkpoint image of CRI checkpoint `archive` of container `container`: an OCI image
/// layout (one layer = the archive; the annotations containerd and CRI-O read, and
/// `annotations`), tarred, imported on `node` as `name` with `ctr images import`.
pub fn import_checkpoint_image(
    node: &Node,
    archive: &Path,
    container: &str,
    mut annotations: std::collections::BTreeMap<String, String>,
    name: &str,
    work: &Path,
) {
    annotations.insert(
        "org.criu.checkpoint.container.name".into(),
        container.into(),
    );
    annotations.insert(
        "io.kubernetes.cri-o.annotations.checkpoint.name".into(),
        container.into(),
    );
    let image = oci::image(
        fs::read(archive).unwrap(),
        serde_json::json!({}),
        &annotations,
    );
    let layout = work.join("checkpoint-image");
    image
        .write_layout(&layout, name)
        .unwrap_or_else(|e| panic!("{e}"));
    let layout_tar = work.join("checkpoint-image.tar");
    let mut cmd = std::process::Command::new("tar");
    cmd.arg("-C")
        .arg(&layout)
        .arg("-cf")
        .arg(&layout_tar)
        .arg(".");
    run_bounded(&mut cmd, "tar", work, Duration::from_secs(60))
        .unwrap()
        .assert_ok();
    node.ctr(&["images", "import", &layout_tar.display().to_string()])
        .unwrap_or_else(|e| panic!("{e}"))
        .assert_ok();
}
