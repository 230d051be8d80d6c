//! The kubelet's checkpoint route on two containerd 2.x instances, "node A" and "node B",
//! spoken to over CRI as the kubelet speaks to them:
//!
//! 1. a GPU-like job (`fakegpu` on the stand-in driver, the transparent path) runs in a pod on
//!    node A, writing its counter log to its stdout (the pod's CRI log);
//! 2. CRI `CheckpointContainer` writes the archive, as the kubelet's checkpoint endpoint has
//!    the runtime do; the job keeps running on A; the archive carries gpusnap's files
//!    (`gpusnap inspect --json` of the archive reads them), and `checkpointctl inspect`
//!    (Debian's, `scripts/install-checkpointctl.sh`) reads the archive, gpusnap's files counted
//!    in its checkpoint size;
//! 3. the archive becomes a checkpoint image: an OCI image layout written by the test (one
//!    layer = the archive; annotations `org.criu.checkpoint.container.name`, its CRI-O
//!    spelling, and `gpusnap.*` fields from `gpusnap inspect --json`), imported on node B with
//!    `ctr -n k8s.io images import`;
//! 4. node B restores a new pod from it (`RunPodSandbox`, `CreateContainer` with the checkpoint
//!    image, `StartContainer`); the job goes on from the checkpointed tick with its memory and
//!    in-memory chain exact, and node B's CRIU called the stand-in driver's restore.
//!
//! Node B really differs from node A: two stand-in GPUs of the same model with other UUIDs
//! (A has one), and its own `gpusnap.conf` whose `device_map` puts A's GPU on B's second GPU
//! (index 1): the driver's restore gets that pair. Before that, node B is given another kernel
//! driver, then another kernel driver and another GPU model: each restore is refused at CRIU's
//! first restore hook with one message naming every mismatch (read from the container's CRIU
//! `restore.log`), CRIU forks nothing, no job process is left on B, and node A's job ticks on.
//!
//! All of that needs CRIU 4.2. containerd freezes the container before it checkpoints, and
//! CRIU 4.1 calls PAUSE_DEVICES before it thaws it (4.2 thaws first), where a real driver's
//! lock of the frozen job waits for CRIU's timeout: gpusnap refuses that dump at once. On CRIU
//! 4.1 the test checks the refusal (`cri_tests::route::assert_refused_frozen`: the CRI call
//! fails, CRIU's log names CRIU 4.2, no wait for a timeout, no driver call that changes the
//! job) and that the job runs on on node A untouched, its memory and chain intact.
//!
//! Images come from a registry the test serves on 127.0.0.1 (containerd pulls the base image
//! of a checkpoint at restore, even when it has it). Each node has its own `criu` wrapper,
//! plugin directory and stand-in driver directory (see `cri_tests::node`). Everything started
//! is stopped, and everything mounted unmounted, whether the test passes or not.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use cri_tests::cri::{PodSpec, container_config};
use cri_tests::node::{CriuSetup, Node, NodeGpus};
use cri_tests::oci;
use cri_tests::registry::Registry;
use cri_tests::route::{
    Setup, archive_files, archived_log_lines, assert_refused_frozen, cri_log_lines, hex,
    import_checkpoint_image, job_pids, pod, rootfs_layer,
};
use criu_tests::counter_log::Tick;
use criu_tests::fake_driver::{FakeDriver, shorts};
use criu_tests::harness::{harness, skipped};
use criu_tests::podman::run_bounded;
use criu_tests::{CounterLog, packages};

const TEST: &str = "cri";
/// The job's container name (the checkpoint image's annotation names it).
const JOB: &str = "job";
const SEED: u64 = 35;
/// How soon a started or restored job must be counting.
const PROMPTLY: Duration = Duration::from_secs(20);
/// Both nodes' kernel driver, and another one.
const KERNEL_DRIVER: &str = "580.95.05";
const OTHER_KERNEL_DRIVER: &str = "575.57.08";

fn parse_tick(line: &str) -> Option<Tick> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let [n, s, a] = f.as_slice() else { return None };
    Some(Tick {
        n: n.parse().ok()?,
        sum: u64::from_str_radix(s, 16).ok()?,
        acc: u64::from_str_radix(a, 16).ok()?,
    })
}

/// Waits until the CRI log at `path` has a tick `>= min` after its first `skip` lines; returns
/// the lines after those.
fn wait_ticks(path: &Path, skip: usize, min: u64, what: &str) -> Vec<String> {
    let t0 = Instant::now();
    loop {
        let lines: Vec<String> = cri_log_lines(path).into_iter().skip(skip).collect();
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

/// A restore on node B from checkpoint image `image` is refused: `StartContainer` fails, the
/// container's CRIU restore log has gpusnap's one-line refusal naming each of `needles`, CRIU
/// created no process, the stand-in driver restored nothing, and nothing of the job runs on B.
/// The failed container is removed.
fn refused_on_b(
    b: &mut Node,
    pod_id: &str,
    pod: &PodSpec,
    image: &str,
    what: &str,
    needles: &[&str],
) {
    // A log of its own: containerd writes the checkpoint's container log there, even for a
    // restore that fails.
    let mut config = container_config(JOB, image, &[]);
    config.log_path = format!("{JOB}-refused-{}.log", what.replace(' ', "-"));
    let id = b
        .cri()
        .create_container(pod_id, pod, config)
        .unwrap_or_else(|e| panic!("{what}: {e}\n{}", b.log()));
    let started = b.cri().start_container(&id);
    let log = b.restore_log(&id);
    let describe = || {
        format!(
            "--- restore.log ---\n{log}\n--- containerd B ---\n{}",
            b.log()
        )
    };
    assert!(
        started.is_err(),
        "{what}: node B restored the job\n{}",
        describe()
    );
    let line = log
        .lines()
        .find(|l| l.contains("restore refused: this node cannot take the image"))
        .unwrap_or_else(|| panic!("{what}: no refusal in the restore log\n{}", describe()));
    for n in needles {
        assert!(
            line.contains(n),
            "{what}: the refusal does not name {n:?}: {line}"
        );
    }
    assert!(
        line.contains("before CRIU restored any process"),
        "{what}: {line}"
    );
    assert!(
        !log.contains("Forking task"),
        "{what}: CRIU forked a task\n{}",
        describe()
    );
    let restores: Vec<String> = fs::read_dir(&b.fakecuda)
        .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
        .unwrap_or_default()
        .iter()
        .filter_map(|p| fs::read_to_string(p).ok())
        .flat_map(|t| t.lines().map(str::to_owned).collect::<Vec<_>>())
        .filter(|l| l.starts_with("restore "))
        .collect();
    assert!(
        restores.is_empty(),
        "{what}: the driver restored: {restores:?}"
    );
    let left = job_pids(&b.dir, "fakegpu");
    assert!(
        left.is_empty(),
        "{what}: job processes {left:?} were left on node B\n{}",
        describe()
    );
    let (status, _) = b
        .cri()
        .container_status(&id)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(status.state, 1, "{what}: the container runs");
    eprintln!("criu-tests: cri refusal ({what}): {line}");
    b.cri()
        .remove_container(&id)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    cri_tests::node::unmount_checkpoint_views(&b.dir);
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
    let layer = rootfs_layer(&work, &[(&fakegpu, "/usr/local/bin/fakegpu")], &[]);
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
        agent: None,
        keeper_libcuda: None,
    };
    let containerd = cri_tests::containerd_root(&h.repo);
    let mut s = Setup {
        work: work.clone(),
        nodes: Vec::new(),
        registry,
    };
    // Node A: one stand-in GPU. Node B: two others of the same model (other UUIDs), and a
    // gpusnap.conf whose device_map puts A's GPU on B's second one (another index).
    let gpus_a = NodeGpus::new(1, 0, KERNEL_DRIVER);
    let mut gpus_b = NodeGpus::new(2, 0x0b, KERNEL_DRIVER);
    gpus_b.config = format!("device_map = \"{}={}\"\n", gpus_a.uuid(0), gpus_b.uuid(1));
    s.start_nodes(
        "cri test",
        v,
        &containerd,
        &criu,
        &[("a", &gpus_a), ("b", &gpus_b)],
        &pause_ref,
        &[&job_ref, &pause_ref],
    );

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
    wait_ticks(&log_a, 0, 10, "node A's job");
    let pid_a = a.cri().container_pid(&ca).unwrap();
    assert!(pid_a > 0, "node A's job has no pid");

    // 2. CRI CheckpointContainer, as the kubelet's checkpoint endpoint has it done.
    let archive = work.join("checkpoint.tar");
    let t0 = Instant::now();
    let checkpointed = a.cri().checkpoint_container(&ca, &archive);
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
    if v < (4, 2, 0) {
        // CRIU 4.1: refused at PAUSE_DEVICES, the container still frozen; nothing to restore.
        let line = assert_refused_frozen(a, &ca, checkpointed, &fake_a, pid_a);
        wait_ticks(
            &log_a,
            0,
            at_return + 3,
            "node A's job after the refused checkpoint",
        );
        assert_eq!(a.cri().container_pid(&ca).unwrap(), pid_a);
        assert_eq!(
            job_pids(&a.dir, "fakegpu"),
            [pid_a],
            "node A's job, and it alone"
        );
        // Its memory and in-memory chain intact, every tick.
        let own = work.join("node-a.log");
        fs::write(&own, cri_log_lines(&log_a).join("\n") + "\n").unwrap();
        let log = CounterLog::read(&own).unwrap().unwrap();
        log.verify().unwrap_or_else(|e| {
            panic!("node A's job after the refused checkpoint is damaged: {e}")
        });
        eprintln!(
            "criu-tests: cri route (CRIU {}.{}.{}): the checkpoint of the frozen container \
             refused in {checkpoint_s:.2} s, the job untouched ({} ticks verified): {line}",
            v.0,
            v.1,
            v.2,
            log.ticks.len()
        );
        return;
    }
    checkpointed.unwrap_or_else(|e| {
        panic!(
            "{e}\n--- containerd A ---\n{}\n--- fake driver ---\n{}",
            a.log(),
            fake_a.log_text(pid_a)
        )
    });
    let ops = fake_a.ops(pid_a);
    assert_eq!(
        shorts(&ops),
        ["lock:0", "checkpoint:0", "restore:0", "unlock:0"],
        "node A's CRIU did not checkpoint the job through the stand-in driver (leave-running)\n{}",
        fake_a.log_text(pid_a)
    );
    // The job runs on on node A.
    wait_ticks(
        &log_a,
        0,
        at_return + 3,
        "node A's job after its checkpoint",
    );
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
    // So does Debian's checkpointctl, gpusnap's files among what it counts.
    match cri_tests::checkpointctl::find(&h.repo) {
        Err(why) => skipped(&format!("{TEST} checkpointctl inspect"), &why),
        Ok(ck) => {
            let files = archive_files(&archive, &work);
            let report = ck
                .assert_reads(&archive, JOB, &files, &work)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(report.command, "fakegpu", "checkpointctl's process tree");
            eprintln!("criu-tests: checkpointctl inspect: {}", report.summary);
        }
    }

    // 3. The checkpoint image: the archive as its one layer, and the annotations.
    let t0 = Instant::now();
    let annotations = oci::gpusnap_annotations(&inspect_json);
    assert!(
        annotations.keys().any(|k| k.starts_with("gpusnap.")),
        "no gpusnap.* annotation from {inspect_json}"
    );
    eprintln!("criu-tests: checkpoint image annotations: {annotations:?}");
    let ck_name = format!("localhost/gpusnap-cri-checkpoint:{}", std::process::id());
    let b = &mut s.nodes[1];
    import_checkpoint_image(b, &archive, JOB, annotations, &ck_name, &work);
    let image_s = t0.elapsed().as_secs_f64();

    // 4. Node B: a new pod, the container created from the checkpoint image.
    let pod_b = pod(b, "pod-b");
    let pb = b
        .cri()
        .run_pod(&pod_b)
        .unwrap_or_else(|e| panic!("{e}\n{}", b.log()));
    b.pods.push((pb.clone(), Vec::new()));

    // A node B that cannot take the image is refused at CRIU's first restore hook, before any
    // process is created (the check is gpusnap's, whatever the CRIU version).
    {
        let mut other_kernel = gpus_b.clone();
        other_kernel.kernel_driver = OTHER_KERNEL_DRIVER.into();
        let mut other_model = NodeGpus::new(2, 0x0b, OTHER_KERNEL_DRIVER);
        other_model.model = Some("Other GPU".into());
        let cases: [(&str, &NodeGpus, &[&str]); 2] = [
            (
                "another kernel driver",
                &other_kernel,
                &[
                    KERNEL_DRIVER,
                    OTHER_KERNEL_DRIVER,
                    "allow_other_kernel_driver",
                ],
            ),
            (
                "another kernel driver and another GPU model",
                &other_model,
                &[
                    "(1) ",
                    OTHER_KERNEL_DRIVER,
                    "(2) ",
                    &hex(&gpus_a.uuid(0)),
                    "Fake GPU",
                    "is not on this host",
                ],
            ),
        ];
        for (what, gpus, needles) in cases {
            let b = &mut s.nodes[1];
            b.set_gpus(gpus).unwrap_or_else(|e| panic!("{e}"));
            refused_on_b(b, &pb, &pod_b, &ck_name, what, needles);
            let a = &mut s.nodes[0];
            assert_eq!(a.cri().container_pid(&ca).unwrap(), pid_a);
            assert_eq!(
                job_pids(&a.dir, "fakegpu"),
                [pid_a],
                "node A's job, and it alone"
            );
            let last = cri_log_lines(&log_a)
                .iter()
                .filter_map(|l| parse_tick(l))
                .map(|t| t.n)
                .max()
                .unwrap_or(0);
            wait_ticks(
                &log_a,
                0,
                last + 2,
                "node A's job after a refusal on node B",
            );
        }
        s.nodes[1]
            .set_gpus(&gpus_b)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let b = &mut s.nodes[1];
    let t0 = Instant::now();
    let cb = b
        .cri()
        .create_container(&pb, &pod_b, container_config(JOB, &ck_name, &[]))
        .unwrap_or_else(|e| panic!("{e}\n{}", b.log()));
    b.pods[0].1.push(cb.clone());
    let create_s = t0.elapsed().as_secs_f64();
    b.cri().start_container(&cb).unwrap_or_else(|e| {
        panic!(
            "{e}\n--- restore.log ---\n{}\n--- containerd B ---\n{}",
            b.restore_log(&cb),
            b.log()
        )
    });
    let restore_s = t0.elapsed().as_secs_f64();
    let pid_b = b.cri().container_pid(&cb).unwrap();

    // The job goes on from the checkpoint, exactly. containerd may have put the archive's
    // container log (node A's output up to the checkpoint) at the head of node B's.
    let log_b = pod_b.log_directory.join(format!("{JOB}.log"));
    let archived = archived_log_lines(&archive, &work);
    let skip_b = if cri_log_lines(&log_b).starts_with(&archived) {
        archived.len()
    } else {
        0
    };
    let first_b = {
        let lines = wait_ticks(&log_b, skip_b, 1, "node B's restored job");
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
    let lines_b = wait_ticks(&log_b, skip_b, first_b + 5, "node B's restored job");
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
    // Onto node B's second GPU, as its device_map says.
    assert_eq!(
        ops[0].fields.get("gpu_pairs").map(String::as_str),
        Some(format!("{}={}", hex(&gpus_a.uuid(0)), hex(&gpus_b.uuid(1))).as_str()),
        "node B's restore did not map node A's GPU to node B's GPU 1\n{}",
        fake_b.log_text(pid_b)
    );
    let restore_log = b.restore_log(&cb);
    assert!(
        restore_log.contains(&format!("is restored onto GPU {}", hex(&gpus_b.uuid(1)))),
        "node B's restore log does not say where the GPU went:\n{restore_log}"
    );

    eprintln!(
        "criu-tests: cri route: checkpoint {checkpoint_s:.2} s (archive {} KiB), image build + \
         import {image_s:.2} s, restore create {create_s:.2} s + start {:.2} s; job resumed at \
         tick {first_b}, {} ticks verified",
        fs::metadata(&archive).map(|m| m.len() / 1024).unwrap_or(0),
        restore_s - create_s,
        log.ticks.len()
    );
}
