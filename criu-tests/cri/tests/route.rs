//! The kubelet's checkpoint route on two containerd 2.x instances, "node A" and "node B",
//! spoken to over CRI as the kubelet speaks to them:
//!
//! 1. a GPU-like job (`fakegpu` on the stand-in driver, the transparent path) runs in a pod on
//!    node A, writing its counter log to its stdout (the pod's CRI log);
//! 2. CRI `CheckpointContainer` writes the archive, as the kubelet's checkpoint endpoint has
//!    the runtime do; the job keeps running on A; the archive carries gpusnap's files
//!    (`gpusnap inspect --json` of the archive reads them);
//! 3. the archive becomes a checkpoint image: an OCI image layout written by the test (one
//!    layer = the archive; annotations `org.criu.checkpoint.container.name`, its CRI-O
//!    spelling, and `gpusnap.*` fields from `gpusnap inspect --json`), imported on node B with
//!    `ctr -n k8s.io images import`;
//! 4. node B restores a new pod from it (`RunPodSandbox`, `CreateContainer` with the checkpoint
//!    image, `StartContainer`); the job goes on from the checkpointed tick with its memory and
//!    in-memory chain exact, and node B's CRIU called the stand-in driver's restore.
//!
//! Images come from a registry the test serves on 127.0.0.1 (containerd pulls the base image
//! of a checkpoint at restore, even when it has it). Each node has its own `criu` wrapper,
//! plugin directory and stand-in driver directory (see `cri_tests::node`). Everything started
//! is stopped, and everything mounted unmounted, whether the test passes or not.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cri_tests::cri::{PodSpec, container_config};
use cri_tests::node::{CriuSetup, Node};
use cri_tests::oci;
use cri_tests::registry::Registry;
use criu_tests::counter_log::Tick;
use criu_tests::fake_driver::{FakeDriver, shorts};
use criu_tests::harness::{harness, skipped};
use criu_tests::podman::{run_bounded, shared_libraries};
use criu_tests::{CounterLog, packages};

const TEST: &str = "cri";
/// The job's container name (the checkpoint image's annotation names it).
const JOB: &str = "job";
const SEED: u64 = 35;
/// How soon a started or restored job must be counting.
const PROMPTLY: Duration = Duration::from_secs(20);

/// The job's counter log from its CRI log (`<time> stdout F <line>`): the lines, in order.
fn cri_log_lines(path: &Path) -> Vec<String> {
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

fn parse_tick(line: &str) -> Option<Tick> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let [n, s, a] = f.as_slice() else { return None };
    Some(Tick {
        n: n.parse().ok()?,
        sum: u64::from_str_radix(s, 16).ok()?,
        acc: u64::from_str_radix(a, 16).ok()?,
    })
}

/// Waits until the CRI log at `path` has a tick `>= min`; returns its lines.
fn wait_ticks(path: &Path, min: u64, what: &str) -> Vec<String> {
    let t0 = Instant::now();
    loop {
        let lines = cri_log_lines(path);
        if lines
            .iter()
            .filter_map(|l| parse_tick(l))
            .any(|t| t.n >= min)
        {
            return lines;
        }
        assert!(
            t0.elapsed() < PROMPTLY,
            "{what}: no tick {min} in {} within {PROMPTLY:?}; last lines: {:?}",
            path.display(),
            lines.iter().rev().take(5).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The image's rootfs: busybox, `fakegpu` and its shared libraries; a tar of it.
fn rootfs_layer(work: &Path, fakegpu: &Path) -> Vec<u8> {
    let rootfs = work.join("rootfs");
    let put = |src: &Path, dst: &str| {
        let to = rootfs.join(dst.trim_start_matches('/'));
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(src, &to).unwrap_or_else(|e| panic!("{} -> {}: {e}", src.display(), to.display()));
    };
    for (bin, at) in [
        (Path::new("/bin/busybox"), "/bin/busybox"),
        (fakegpu, "/usr/local/bin/fakegpu"),
    ] {
        put(bin, at);
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

/// Everything the test started; dropping it shuts both nodes down and stops the registry.
struct Setup {
    work: PathBuf,
    nodes: Vec<Node>,
    _registry: Registry,
}

impl Drop for Setup {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.shut_down();
        }
        cri_tests::node::unmount_under(&self.work);
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

fn cgroup_parent() -> String {
    format!("/gpusnap-cri-{}", std::process::id())
}

fn pod(node: &Node, name: &str) -> PodSpec {
    PodSpec {
        name: name.into(),
        uid: format!("uid-{name}-{}", std::process::id()),
        log_directory: node.logs.join(name),
        cgroup_parent: cgroup_parent(),
    }
}

#[test]
fn cri_checkpoint_to_an_image_restored_on_another_node() {
    let Some(h) = harness(TEST) else { return };
    if let Some(why) = cri_tests::cannot_run(&h.repo) {
        skipped(TEST, &why);
        return;
    }
    let v = h.criu_version;
    let fakegpu = criu_tests::build::built("criu-tests", "fakegpu");
    let fakecuda_so = criu_tests::fake_driver::fakecuda_so(h)
        .unwrap_or_else(|e| panic!("building the fake driver: {e}"))
        .to_owned();
    let cli = criu_tests::fake_driver::gpusnap_cli(h)
        .unwrap_or_else(|e| panic!("building gpusnap: {e}"))
        .to_owned();
    let work = h
        .profile_dir
        .join("criu-tests")
        .join(format!("{TEST}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).unwrap();

    // The images: the job's and the pause image, one layer, served by the test's registry.
    let registry = Registry::start().unwrap_or_else(|e| panic!("{e}"));
    let layer = rootfs_layer(&work, &fakegpu);
    let env = serde_json::json!(["PATH=/usr/local/bin:/bin"]);
    let job_image = oci::image(
        layer.clone(),
        serde_json::json!({ "Env": env, "Cmd": ["/bin/sh"] }),
        &BTreeMap::new(),
    );
    let pause_image = oci::image(
        layer,
        serde_json::json!({ "Env": env, "Cmd": ["/bin/busybox", "sleep", "2000000000"] }),
        &BTreeMap::new(),
    );
    let job_ref = registry.put("gpusnap-cri/job", "1", &job_image);
    let pause_ref = registry.put("gpusnap-cri/pause", "1", &pause_image);

    let criu = CriuSetup {
        criu: h.criu.clone(),
        criu_root: packages::criu_root(h),
        plugin_so: h.plugin_so.clone(),
        keeper: h.keeper.clone(),
        fakecuda_so: fakecuda_so.clone(),
    };
    let containerd = cri_tests::containerd_root(&h.repo);
    let mut s = Setup {
        work: work.clone(),
        nodes: Vec::new(),
        _registry: registry,
    };
    for name in ["a", "b"] {
        let n = Node::start(name, &work.join(name), &containerd, &criu, &pause_ref)
            .unwrap_or_else(|e| panic!("{e}"));
        s.nodes.push(n);
    }
    eprintln!(
        "criu-tests: cri test with CRIU {}.{}.{}, containerd {}",
        v.0,
        v.1,
        v.2,
        s.nodes[0]
            .cri()
            .version()
            .map(|r| r.runtime_version)
            .unwrap_or_default()
    );
    for n in &mut s.nodes {
        for r in [&job_ref, &pause_ref] {
            n.cri()
                .pull_image(r)
                .unwrap_or_else(|e| panic!("node {}: {e}\n{}", n.name, n.log()));
        }
    }

    // 1. The job in a pod on node A.
    let a = &mut s.nodes[0];
    let pod_a = pod(a, "pod-a");
    let pa = a
        .cri()
        .run_pod(&pod_a)
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    a.pods.push((pa.clone(), Vec::new()));
    let seed = SEED.to_string();
    let cmd = [
        "/usr/local/bin/fakegpu",
        "--log",
        "/dev/stdout",
        "--seed",
        &seed,
    ];
    let ca = a
        .cri()
        .create_container(&pa, &pod_a, container_config(JOB, &job_ref, &cmd))
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    a.pods[0].1.push(ca.clone());
    a.cri()
        .start_container(&ca)
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    let log_a = pod_a.log_directory.join(format!("{JOB}.log"));
    wait_ticks(&log_a, 10, "node A's job");
    let pid_a = a.cri().container_pid(&ca).unwrap();
    assert!(pid_a > 0, "node A's job has no pid");

    // 2. CRI CheckpointContainer, as the kubelet's checkpoint endpoint has it done.
    let archive = work.join("checkpoint.tar");
    let t0 = Instant::now();
    a.cri()
        .checkpoint_container(&ca, &archive)
        .unwrap_or_else(|e| {
            panic!(
                "{e}\n--- containerd A ---\n{}\n--- fake driver ---\n{}",
                a.log(),
                FakeDriver {
                    so: fakecuda_so.clone(),
                    dir: a.fakecuda.clone()
                }
                .log_text(pid_a)
            )
        });
    let checkpoint_s = t0.elapsed().as_secs_f64();
    let at_return = cri_log_lines(&log_a)
        .iter()
        .filter_map(|l| parse_tick(l))
        .map(|t| t.n)
        .max()
        .unwrap_or(0);
    let fake_a = FakeDriver {
        so: fakecuda_so.clone(),
        dir: a.fakecuda.clone(),
    };
    let ops = fake_a.ops(pid_a);
    assert_eq!(
        shorts(&ops),
        ["lock:0", "checkpoint:0", "restore:0", "unlock:0"],
        "node A's CRIU did not checkpoint the job through the stand-in driver (leave-running)\n{}",
        fake_a.log_text(pid_a)
    );
    // The job runs on on node A.
    wait_ticks(&log_a, at_return + 3, "node A's job after its checkpoint");
    assert_eq!(a.cri().container_pid(&ca).unwrap(), pid_a);

    // The archive carries gpusnap's files: `gpusnap inspect --json` reads it as it is.
    let mut cmd = std::process::Command::new(&cli);
    cmd.arg("inspect").arg(&archive).arg("--json");
    let inspect = run_bounded(
        &mut cmd,
        "gpusnap inspect --json",
        &work,
        Duration::from_secs(60),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    inspect.assert_ok();
    let inspect_json: serde_json::Value = serde_json::from_str(&inspect.stdout)
        .unwrap_or_else(|e| panic!("gpusnap inspect --json: {e}\n{inspect}"));

    // 3. The checkpoint image: the archive as its one layer, and the annotations.
    let t0 = Instant::now();
    let mut annotations = oci::gpusnap_annotations(&inspect_json);
    assert!(
        annotations.keys().any(|k| k.starts_with("gpusnap.")),
        "no gpusnap.* annotation from {inspect_json}"
    );
    eprintln!("criu-tests: checkpoint image annotations: {annotations:?}");
    annotations.insert("org.criu.checkpoint.container.name".into(), JOB.into());
    annotations.insert(
        "io.kubernetes.cri-o.annotations.checkpoint.name".into(),
        JOB.into(),
    );
    let ck_image = oci::image(
        fs::read(&archive).unwrap(),
        serde_json::json!({}),
        &annotations,
    );
    let layout = work.join("checkpoint-image");
    let ck_name = format!("localhost/gpusnap-cri-checkpoint:{}", std::process::id());
    ck_image
        .write_layout(&layout, &ck_name)
        .unwrap_or_else(|e| panic!("{e}"));
    let layout_tar = work.join("checkpoint-image.tar");
    let mut cmd = std::process::Command::new("tar");
    cmd.arg("-C")
        .arg(&layout)
        .arg("-cf")
        .arg(&layout_tar)
        .arg(".");
    run_bounded(&mut cmd, "tar", &work, Duration::from_secs(60))
        .unwrap()
        .assert_ok();
    let b = &mut s.nodes[1];
    b.ctr(&["images", "import", &layout_tar.display().to_string()])
        .unwrap_or_else(|e| panic!("{e}"))
        .assert_ok();
    let image_s = t0.elapsed().as_secs_f64();

    // 4. Node B: a new pod, the container created from the checkpoint image.
    let pod_b = pod(b, "pod-b");
    let pb = b
        .cri()
        .run_pod(&pod_b)
        .unwrap_or_else(|e| panic!("{e}\n{}", b.log()));
    b.pods.push((pb.clone(), Vec::new()));
    let t0 = Instant::now();
    let cb = b
        .cri()
        .create_container(&pb, &pod_b, container_config(JOB, &ck_name, &[]))
        .unwrap_or_else(|e| panic!("{e}\n{}", b.log()));
    b.pods[0].1.push(cb.clone());
    let create_s = t0.elapsed().as_secs_f64();
    b.cri().start_container(&cb).unwrap_or_else(|e| {
        let restore_log = b.dir.join(format!(
            "state/io.containerd.runtime.v2.task/k8s.io/{cb}/restore.log"
        ));
        panic!(
            "{e}\n--- restore.log ---\n{}\n--- containerd B ---\n{}",
            fs::read_to_string(&restore_log).unwrap_or_default(),
            b.log()
        )
    });
    let restore_s = t0.elapsed().as_secs_f64();
    let pid_b = b.cri().container_pid(&cb).unwrap();

    // The job goes on from the checkpoint, exactly.
    let log_b = pod_b.log_directory.join(format!("{JOB}.log"));
    let first_b = {
        let lines = wait_ticks(&log_b, 1, "node B's restored job");
        let first = parse_tick(&lines[0]).unwrap_or_else(|| {
            panic!(
                "node B's job did not resume: its log starts with {:?}",
                lines[0]
            )
        });
        first.n
    };
    assert!(
        first_b > 10 && first_b <= at_return + 1,
        "node B's job resumed at tick {first_b}; node A's job was at {at_return} when the checkpoint returned"
    );
    let lines_b = wait_ticks(&log_b, first_b + 5, "node B's restored job");
    let lines_a = cri_log_lines(&log_a);
    let merged = work.join("merged.log");
    let mut text = format!("{}\n", lines_a[0]);
    for l in lines_a[1..]
        .iter()
        .filter(|l| parse_tick(l).is_some_and(|t| t.n < first_b))
    {
        text.push_str(l);
        text.push('\n');
    }
    for l in &lines_b {
        text.push_str(l);
        text.push('\n');
    }
    fs::write(&merged, text).unwrap();
    let log = CounterLog::read(&merged).unwrap().unwrap();
    log.verify()
        .unwrap_or_else(|e| panic!("the job's state after the restore on node B is damaged: {e}"));
    assert_eq!(log.seed, SEED);

    // Node B's CRIU restored the job through the stand-in driver.
    let fake_b = FakeDriver {
        so: fakecuda_so,
        dir: b.fakecuda.clone(),
    };
    let ops = fake_b.ops(pid_b);
    assert_eq!(
        shorts(&ops),
        ["restore:0", "unlock:0"],
        "node B's CRIU did not restore the job through the stand-in driver\n{}",
        fake_b.log_text(pid_b)
    );
    assert_eq!(ops[0].before.as_deref(), Some("checkpointed"));

    eprintln!(
        "criu-tests: cri route: checkpoint {checkpoint_s:.2} s (archive {} KiB), image build + \
         import {image_s:.2} s, restore create {create_s:.2} s + start {:.2} s; job resumed at \
         tick {first_b}, {} ticks verified",
        fs::metadata(&archive).map(|m| m.len() / 1024).unwrap_or(0),
        restore_s - create_s,
        log.ticks.len()
    );
}
