//! The split path on the kubelet's checkpoint route: the gpusnap agent given to the job's
//! container by a CDI device, on two containerd 2.x instances ("node A", "node B") spoken to
//! over CRI as the kubelet speaks to them (`cri_tests::node`, as `tests/route.rs` does for the
//! transparent path):
//!
//! 1. each node reads CDI specs from its own directory only (`cdi_spec_dirs`), where its spec
//!    names device `gpusnap.dev/agent=split` (the package's `/etc/cdi/gpusnap.json`, with the
//!    node's own copy of the agent as the host path): a bind mount of the agent, read-only, at
//!    `/usr/lib/gpusnap/libgpusnap_agent.so`, and `LD_PRELOAD` set to it;
//! 2. `fakegpu-vmm` (the device stand-in `libfakecudadev.so` as its `libcuda.so.1`) runs in a
//!    pod on node A, created with that device in the CRI `CreateContainer`'s `cdi_devices`
//!    (as the kubelet passes what a device plugin or DRA driver allocated): the agent is
//!    mounted from node A's copy and preloaded;
//! 3. CRI `CheckpointContainer` while it runs: the dump took the split path (CRIU's `dump.log`
//!    in the archive: the agent moved the device data into gpusnap's files, the job's memory
//!    lent to the keeper and mapped back), the job runs on on node A with every tick good, the
//!    archive holds gpusnap's manifest and data files, and `checkpointctl inspect` (Debian's,
//!    from `scripts/install-checkpointctl.sh`) reads the archive: the job's process, gpusnap's
//!    files counted in its checkpoint size, the CDI mount (node A's copy) in its mounts;
//! 4. on node B, a restore that names the device only as a `cdi.k8s.io/*` annotation fails
//!    (containerd 2.1 drops those annotations at a restore, the archive's and the request's:
//!    the new container has no agent mount, which CRIU's image needs), leaving nothing running;
//! 5. the checkpoint image (as in `tests/route.rs`) is restored in a new pod on node B, whose
//!    `CreateContainer` names the same CDI device, which node B resolves against its own spec
//!    (the agent mounted from node B's copy): the restore loaded the data through the split
//!    path (`restore.log`), and the job goes on from the checkpointed tick with its device memory
//!    and counter exact.
//!
//! With CRIU 4.1 there is no checkpoint: containerd pauses the container (cgroup freezer)
//! before it checkpoints, and CRIU 4.1 runs its PAUSE_DEVICES hook before it thaws the
//! container for the plugins that ask it to (gpusnap does; CRIU 4.2 thaws first: CRIU commit
//! "seize: fix pause devices for frozen containers"), so the agent, frozen, could not answer
//! (it used to be waited for until CRIU's timeout, 10 s, and the driver path taken). gpusnap
//! refuses the dump at that hook at once, before it asks the agent or the driver anything: on
//! CRIU 4.1 the test checks that `CheckpointContainer` fails, that CRIU's log has the refusal
//! naming CRIU 4.2 and no wait for a timeout, that the stand-in driver was asked nothing that
//! changes the job, and that the job runs on on node A untouched, every tick good. The rest of
//! step 3, and steps 4 and 5, run on CRIU 4.2.
//!
//! Node B has two stand-in GPUs to node A's one. The device stand-in has no other UUIDs (no
//! `FAKECUDA_UUID_SALT`), so A's GPU is also B's GPU 0: the GPU remap through CRI is
//! `tests/route.rs`'s (transparent path). Everything started is stopped, and everything
//! mounted unmounted, whether the test passes or not.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use cri_tests::checkpointctl;
use cri_tests::cri::{ContainerConfig, container_config, with_cdi_device};
use cri_tests::node::{AGENT_IN_CONTAINER, CDI_DEVICE, CriuSetup, Node, NodeGpus};
use cri_tests::oci;
use cri_tests::registry::Registry;
use cri_tests::route::{
    Setup, archive_files, archive_member, archived_log_lines, assert_refused_frozen, cri_log_lines,
    import_checkpoint_image, job_pids, pod, rootfs_layer,
};
use criu_tests::fake_driver::FakeDriver;
use criu_tests::harness::{harness, skipped};
use criu_tests::packages;
use criu_tests::podman::run_bounded;

const TEST: &str = "cri-split";
const JOB: &str = "job";
const SEED: &str = "405";
/// `--allocs 2`: two data allocations, the counter, the 64 KiB one the agent leaves alone.
const ALLOCS: &str = "2";
/// How soon a started or restored job must be counting.
const PROMPTLY: Duration = Duration::from_secs(20);
const KERNEL_DRIVER: &str = "580.95.05";
/// Where the image has the device stand-in, as `libcuda.so.1`.
const FAKE_LIBCUDA_DIR: &str = "/usr/local/lib/fakecuda";

/// One tick of `fakegpu-vmm`: `tick K counter C ok O`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tick {
    n: u64,
    counter: u64,
    ok: bool,
}

fn parse_tick(line: &str) -> Option<Tick> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let ["tick", n, "counter", c, "ok", ok] = f.as_slice() else {
        return None;
    };
    Some(Tick {
        n: n.parse().ok()?,
        counter: c.parse().ok()?,
        ok: *ok == "1",
    })
}

/// The ticks among `lines`.
fn ticks(lines: &[String]) -> Vec<Tick> {
    lines.iter().filter_map(|l| parse_tick(l)).collect()
}

/// `ticks` follow one another from `from` (the tick number in host memory, the counter in
/// device memory: both must survive together), every one good.
fn check_ticks(ticks: &[Tick], from: u64, what: &str) {
    for (i, t) in ticks.iter().enumerate() {
        let want = from + i as u64;
        assert!(
            t.n == want && t.counter == want && t.ok,
            "{what}: tick {i} after {from} is {t:?}, not tick {want} counter {want} ok 1; all: {ticks:?}"
        );
    }
}

/// Waits until the CRI log at `path` has a tick `>= min` after its first `skip` lines; returns
/// the lines after those.
fn wait_ticks(path: &Path, skip: usize, min: u64, what: &str) -> Vec<String> {
    let t0 = Instant::now();
    loop {
        let lines: Vec<String> = cri_log_lines(path).into_iter().skip(skip).collect();
        if ticks(&lines).iter().any(|t| t.n >= min) {
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

/// The job's container config: `fakegpu-vmm` on the device stand-in, writing its ticks to its
/// stdout (the pod's CRI log), with the agent's CDI device; `image` the job's image or the
/// checkpoint image.
fn job_config(image: &str, cmd: &[&str]) -> ContainerConfig {
    let mut c = container_config(JOB, image, cmd);
    for (key, value) in [
        ("LD_LIBRARY_PATH", FAKE_LIBCUDA_DIR),
        // The stand-in device's state in the job's own memory: it would otherwise look for it
        // under the pid the job has in its pid namespace.
        ("FAKECUDADEV_STATE_PAGE", "1"),
    ] {
        c.envs.push(k8s_cri::v1::KeyValue {
            key: key.into(),
            value: value.into(),
        });
    }
    with_cdi_device(c, CDI_DEVICE)
}

/// The agent is mapped into `pid`, from the mount at [`AGENT_IN_CONTAINER`] whose source is
/// node `node`'s own copy of it.
fn assert_agent_from(pid: i32, node: &Node, what: &str) {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    assert!(
        maps.contains(AGENT_IN_CONTAINER),
        "{what}: the CDI device did not preload the agent into pid {pid}:\n{maps}"
    );
    // mountinfo: `id parent major:minor root mount-point ...`: a file bind mount's root is the
    // file's path in its file system.
    let info = fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
    let line = info
        .lines()
        .find(|l| l.split_whitespace().nth(4) == Some(AGENT_IN_CONTAINER))
        .unwrap_or_else(|| {
            panic!("{what}: no mount at {AGENT_IN_CONTAINER} in pid {pid}:\n{info}")
        });
    let own = node.dir.join("agent/libgpusnap_agent.so");
    let root = line.split_whitespace().nth(3).unwrap_or_default();
    assert!(
        own.display().to_string().ends_with(root) && root.ends_with("agent/libgpusnap_agent.so"),
        "{what}: the agent is not mounted from node {}'s copy ({}): {line}",
        node.name,
        own.display()
    );
}

/// A line of `log` that holds every one of `parts`.
fn assert_line(log: &str, parts: &[&str], what: &str) {
    assert!(
        log.lines().any(|l| parts.iter().all(|p| l.contains(p))),
        "{what}: no line with {parts:?} in:\n{log}"
    );
}

#[test]
fn cri_split_path_through_cdi() {
    let Some(h) = harness(TEST) else { return };
    if let Some(why) = cri_tests::cannot_run(&h.repo) {
        skipped(TEST, &why);
        return;
    }
    let v = h.criu_version;
    // Whether containerd's checkpoint can be taken at all: see the module's doc.
    let thawed_first = v >= (4, 2, 0);
    let fakecuda_so = criu_tests::fake_driver::fakecuda_so(h)
        .unwrap_or_else(|e| panic!("building the fake driver: {e}"))
        .to_owned();
    let (device_so, vmm) = criu_tests::fake_driver::fake_device(h)
        .unwrap_or_else(|e| panic!("building the stand-in device: {e}"));
    let agent = h
        .agent_so()
        .unwrap_or_else(|e| panic!("building the agent: {e}"))
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

    // The images: the job's (busybox, fakegpu-vmm, the device stand-in as libcuda.so.1, the
    // libraries the agent needs: the agent itself comes from the CDI device) and the pause one.
    let registry = Registry::start().unwrap_or_else(|e| panic!("{e}"));
    let libcuda = format!("{FAKE_LIBCUDA_DIR}/libcuda.so.1");
    let layer = rootfs_layer(
        &work,
        &[
            (vmm, "/usr/local/bin/fakegpu-vmm"),
            (device_so, libcuda.as_str()),
        ],
        &[&agent],
    );
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
    let job_ref = registry.put("gpusnap-cri-split/job", "1", &job_image);
    let pause_ref = registry.put("gpusnap-cri-split/pause", "1", &pause_image);

    let criu = CriuSetup {
        criu: h.criu.clone(),
        criu_root: packages::criu_root(h),
        plugin_so: h.plugin_so.clone(),
        keeper: h.keeper.clone(),
        fakecuda_so: fakecuda_so.clone(),
        agent: Some(agent.clone()),
        keeper_libcuda: Some(device_so.to_owned()),
    };
    let containerd = cri_tests::containerd_root(&h.repo);
    let mut s = Setup {
        work: work.clone(),
        nodes: Vec::new(),
        registry,
    };
    let gpus_a = NodeGpus::new(1, 0, KERNEL_DRIVER);
    let gpus_b = NodeGpus::new(2, 0, KERNEL_DRIVER);
    s.start_nodes(
        "cri split test",
        v,
        &containerd,
        &criu,
        &[("a", &gpus_a), ("b", &gpus_b)],
        &pause_ref,
        &[&job_ref, &pause_ref],
    );

    // 1. The job in a pod on node A, the agent from node A's CDI device.
    let a = &mut s.nodes[0];
    let pod_a = pod(a, "pod-a");
    let pa = a
        .cri()
        .run_pod(&pod_a)
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    a.pods.push((pa.clone(), Vec::new()));
    let cmd = [
        "/usr/local/bin/fakegpu-vmm",
        "--log",
        "/dev/stdout",
        "--seed",
        SEED,
        "--allocs",
        ALLOCS,
        "--mib",
        "4",
    ];
    let ca = a
        .cri()
        .create_container(&pa, &pod_a, job_config(&job_ref, &cmd))
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    a.pods[0].1.push(ca.clone());
    a.cri()
        .start_container(&ca)
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    let log_a = pod_a.log_directory.join(format!("{JOB}.log"));
    wait_ticks(&log_a, 0, 10, "node A's job");
    let pid_a = a.cri().container_pid(&ca).unwrap();
    assert!(pid_a > 0, "node A's job has no pid");
    assert_agent_from(pid_a, a, "node A's job");

    // 2. CRI CheckpointContainer while it runs.
    let archive = work.join("checkpoint.tar");
    let t0 = Instant::now();
    let checkpointed = a.cri().checkpoint_container(&ca, &archive);
    let checkpoint_s = t0.elapsed().as_secs_f64();
    if !thawed_first {
        // CRIU 4.1: refused at PAUSE_DEVICES, the container still frozen; nothing to restore.
        let fake_a = FakeDriver {
            so: fakecuda_so.clone(),
            dir: a.fakecuda.clone(),
        };
        let line = assert_refused_frozen(a, &ca, checkpointed, &fake_a, pid_a);
        let at_return = ticks(&cri_log_lines(&log_a))
            .iter()
            .map(|t| t.n)
            .max()
            .unwrap_or(0);
        let lines_a = wait_ticks(
            &log_a,
            0,
            at_return + 5,
            "node A's job after the refused checkpoint",
        );
        check_ticks(
            &ticks(&lines_a),
            1,
            "node A's job after the refused checkpoint",
        );
        assert_eq!(a.cri().container_pid(&ca).unwrap(), pid_a);
        assert_eq!(
            job_pids(&a.dir, "fakegpu-vmm"),
            [pid_a],
            "node A's job, and it alone"
        );
        eprintln!(
            "criu-tests: cri split (CRIU {}.{}.{}): the checkpoint of the frozen container refused \
             in {checkpoint_s:.2} s, the job untouched: {line}",
            v.0, v.1, v.2
        );
        return;
    }
    checkpointed.unwrap_or_else(|e| panic!("{e}\n--- containerd A ---\n{}", a.log()));
    let at_return = ticks(&cri_log_lines(&log_a))
        .iter()
        .map(|t| t.n)
        .max()
        .unwrap_or(0);
    let dump_log = archive_member(&archive, "dump.log", &work);
    let expected: &[&[&str]] = &[
        &["(nspid 1)", "path split"],
        &["data", "into", "files"],
        &["lent to keeper"],
        &["device memory mapped back", "no file read"],
    ];
    for parts in expected {
        assert_line(&dump_log, parts, "the CRI checkpoint (dump.log)");
    }
    // The device memory went through the agent into gpusnap's files. (CRIU dumps the stand-in's
    // device memory too: with the hand-over, a leave-running dump keeps the exported
    // descriptors in the job to map the memory back, and the stand-in's are memfds, which CRIU
    // dumps with their contents.)
    let memfds = archive_member(&archive, "checkpoint/memfd.img", &work);
    assert!(
        memfds.contains("gpusnap-agent-door") && !memfds.contains("gpusnap-staging"),
        "CRIU dumped the staging ring, or checkpoint/memfd.img lacks the agent's door"
    );
    // The job runs on on node A, every tick good.
    let lines_a = wait_ticks(
        &log_a,
        0,
        at_return + 5,
        "node A's job after its checkpoint",
    );
    check_ticks(&ticks(&lines_a), 1, "node A's job after its checkpoint");
    assert_eq!(a.cri().container_pid(&ca).unwrap(), pid_a);

    // The archive holds gpusnap's manifest and data files of the job (pid 1 in its namespace).
    let files = archive_files(&archive, &work);
    let gpusnap: Vec<&(String, u64)> = files
        .iter()
        .filter(|(f, _)| f.starts_with("checkpoint/gpusnap-"))
        .collect();
    assert!(
        gpusnap
            .iter()
            .any(|(f, _)| f == "checkpoint/gpusnap-1-manifest.img")
            && gpusnap
                .iter()
                .any(|(f, _)| f.starts_with("checkpoint/gpusnap-1-data-")),
        "no gpusnap manifest or data files in the archive: {files:?}"
    );
    let mut cmd = std::process::Command::new(&cli);
    cmd.arg("verify").arg(&archive);
    run_bounded(&mut cmd, "gpusnap verify", &work, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"))
        .assert_ok();
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

    // checkpointctl reads the archive as it is, gpusnap's files among what it counts.
    match checkpointctl::find(&h.repo) {
        Err(why) => skipped(&format!("{TEST} checkpointctl inspect"), &why),
        Ok(ck) => {
            let report = ck
                .assert_reads(&archive, JOB, &files, &work)
                .unwrap_or_else(|e| panic!("{e}"));
            let agent_mount = report.mounts.iter().find(|m| m.0 == AGENT_IN_CONTAINER);
            assert!(
                agent_mount.is_some_and(|m| m.1
                    == s.nodes[0]
                        .dir
                        .join("agent/libgpusnap_agent.so")
                        .display()
                        .to_string()),
                "checkpointctl's mounts have no {AGENT_IN_CONTAINER} from node A's copy: {:?}",
                report.mounts
            );
            assert_eq!(
                report.command, "fakegpu-vmm",
                "checkpointctl's process tree"
            );
            eprintln!("criu-tests: checkpointctl inspect: {}", report.summary);
        }
    }

    // 3. The checkpoint image, imported on node B.
    let t0 = Instant::now();
    let annotations = oci::gpusnap_annotations(&inspect_json);
    let ck_name = format!(
        "localhost/gpusnap-cri-split-checkpoint:{}",
        std::process::id()
    );
    import_checkpoint_image(&s.nodes[1], &archive, JOB, annotations, &ck_name, &work);
    let image_s = t0.elapsed().as_secs_f64();

    // 4. Node B: a new pod, the container created from the checkpoint image with the same CDI
    // device, which node B resolves against its own spec.
    let b = &mut s.nodes[1];
    let pod_b = pod(b, "pod-b");
    let pb = b
        .cri()
        .run_pod(&pod_b)
        .unwrap_or_else(|e| panic!("{e}\n{}", b.log()));
    b.pods.push((pb.clone(), Vec::new()));

    // containerd drops `cdi.k8s.io/*` annotations at a restore (the archive's and the
    // request's alike): a restore that names the device only so gets no agent, and fails.
    let mut config = job_config(&ck_name, &[]);
    config.cdi_devices.clear();
    config
        .annotations
        .insert("cdi.k8s.io/gpusnap".into(), CDI_DEVICE.into());
    config.log_path = format!("{JOB}-annotation-only.log");
    let id = b
        .cri()
        .create_container(&pb, &pod_b, config)
        .unwrap_or_else(|e| panic!("{e}\n{}", b.log()));
    let started = b.cri().start_container(&id);
    let log = b.restore_log(&id);
    assert!(
        started.is_err(),
        "node B restored the job without the agent's CDI device\n--- restore.log ---\n{log}"
    );
    // CRIU finds no mount in the new container for the agent's bind mount in the image.
    assert!(
        log.contains(AGENT_IN_CONTAINER.trim_start_matches('/'))
            && log.contains("No mapping for")
            && !log.contains("restored (Split path)"),
        "the restore without the agent's CDI device failed elsewhere than at the agent\n\
         --- restore.log ---\n{log}\n--- containerd B ---\n{}",
        b.log()
    );
    let left = job_pids(&b.dir, "fakegpu-vmm");
    assert!(left.is_empty(), "job processes {left:?} left on node B");
    let why = log
        .lines()
        .find(|l| l.contains("No mapping for"))
        .unwrap_or_default()
        .to_owned();
    eprintln!("criu-tests: cri split: the restore with the device as an annotation only: {why}");
    b.cri()
        .remove_container(&id)
        .unwrap_or_else(|e| panic!("{e}"));
    cri_tests::node::unmount_checkpoint_views(&b.dir);

    // With the device in `cdi_devices`, as a kubelet passes what it allocated on node B.
    let t0 = Instant::now();
    let cb = b
        .cri()
        .create_container(&pb, &pod_b, job_config(&ck_name, &[]))
        .unwrap_or_else(|e| panic!("{e}\n{}", b.log()));
    b.pods[0].1.push(cb.clone());
    b.cri().start_container(&cb).unwrap_or_else(|e| {
        panic!(
            "{e}\n--- restore.log ---\n{}\n--- containerd B ---\n{}",
            b.restore_log(&cb),
            b.log()
        )
    });
    let restore_s = t0.elapsed().as_secs_f64();
    let pid_b = b.cri().container_pid(&cb).unwrap();
    assert!(pid_b > 0, "node B's job has no pid");
    assert_agent_from(pid_b, b, "node B's restored job");
    let restore_log = b.restore_log(&cb);
    assert_line(
        &restore_log,
        &["restored (Split path)", "data"],
        "node B's restore (restore.log)",
    );

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
        ticks(&lines)[0].n
    };
    assert!(
        first_b > 10 && first_b <= at_return + 1,
        "node B's job resumed at tick {first_b}; node A's job was at {at_return} when the checkpoint returned"
    );
    let lines_b = wait_ticks(&log_b, skip_b, first_b + 5, "node B's restored job");
    let ticks_b = ticks(&lines_b);
    check_ticks(&ticks_b, first_b, "node B's restored job");
    // Node A's ticks up to the checkpoint, then node B's: one job.
    let mut merged: Vec<Tick> = ticks(&cri_log_lines(&log_a))
        .into_iter()
        .filter(|t| t.n < first_b)
        .collect();
    merged.extend(&ticks_b);
    check_ticks(&merged, 1, "the job across the two nodes");

    eprintln!(
        "criu-tests: cri split route (split path): checkpoint {checkpoint_s:.2} s (archive {} KiB, \
         gpusnap's files {} KiB), image build + import {image_s:.2} s, restore {restore_s:.2} s; \
         job resumed at tick {first_b}, {} ticks verified",
        fs::metadata(&archive).map(|m| m.len() / 1024).unwrap_or(0),
        gpusnap.iter().map(|f| f.1).sum::<u64>() / 1024,
        merged.len()
    );
}
