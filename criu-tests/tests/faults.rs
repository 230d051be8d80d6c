//! Faults with a real CRIU and gpusnap loaded: failures must never cost the job.
//!
//! - criu killed in the middle of a dump: the workload runs on, untraced;
//! - the image directory fills up during a dump: the dump fails, the workload runs on intact;
//! - a damaged gpusnap image is refused before anything is restored, naming the damage;
//! - the in-process agent's socket survives `dump -R` and dump + restore;
//! - configuration errors fail the dump before the process is touched; `mode = off` works.
//!
//! Everything here runs without a GPU. The GPU variants (a job left locked with its memory
//! released after criu died, brought back by `gpusnap recover`; the lock timeout with a hung
//! agent) need one and are tested elsewhere.

use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime};

use criu_tests::fixtures::Tmpfs;
use criu_tests::inventory::{add_inventory_plugin, inventory_plugins};
use criu_tests::{CounterLog, CriuRun, Workload, harness, procs};
use gpusnap_image::{
    AllocationRecord, CheckpointPath, Codec, DataFileWriter, GpuRecord, Manifest, data_file_name,
    encode_manifest_unchecked, manifest_file_name, write_manifest,
};
use gpusnap_proto::pid::NsPid;
use gpusnap_proto::{AgentRequest, Channel, CommonRequest, PROTOCOL_VERSION, Reply, connect_agent};

const COUNTER: &str = env!("CARGO_BIN_EXE_counter");
const BALLAST: &str = env!("CARGO_BIN_EXE_ballast");

/// How many more ticks (50 ms each) a process must write to count as running.
const MORE_TICKS: u64 = 5;

/// How soon a released workload must be running again.
const PROMPTLY: Duration = Duration::from_secs(3);

/// Polls `f` every 10 ms until it is true or `timeout` has passed; returns its last value.
fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return f();
        }
        sleep(Duration::from_millis(10));
    }
}

/// The workload's root process is running again within [`PROMPTLY`]: not stopped, not traced,
/// writing ticks, and its whole log is consistent (memory checksum unchanged, chain unbroken).
fn assert_runs_free(wl: &mut Workload, what: &str) -> CounterLog {
    let pid = wl.root();
    assert!(
        wl.original_still_running(),
        "{what}: the workload died: {:?}",
        procs::stat(pid)
    );
    let free = |pid| {
        procs::tracer_pid(pid) == Some(0)
            && procs::stat(pid).is_some_and(|s| matches!(s.state, 'S' | 'R' | 'D'))
    };
    assert!(
        wait_until(PROMPTLY, || free(pid)),
        "{what}: pid {pid} is still held after {PROMPTLY:?}: {:?}, TracerPid {:?}",
        procs::stat(pid),
        procs::tracer_pid(pid)
    );
    let last = wl.log(0).last();
    let log = CounterLog::wait_for(&wl.logs[0], last + MORE_TICKS, PROMPTLY)
        .unwrap_or_else(|e| panic!("{what}: the workload does not run on: {e}"));
    log.verify()
        .unwrap_or_else(|e| panic!("{what}: workload state damaged: {e}"));
    assert!(free(pid), "{what}: pid {pid} was stopped or traced again");
    log
}

fn assert_gpusnap_loaded(run: &CriuRun) {
    assert!(
        !run.gpusnap_lines_with("loaded").is_empty(),
        "gpusnap did not load in this run\n{}",
        run.diagnostics()
    );
}

/// Contract 1: criu SIGKILLed in the middle of a dump, while every task is still seized (it
/// waits in the post-dump action script), leaves the workload running and untraced.
#[test]
fn criu_killed_mid_dump_leaves_workload_running() {
    let Some(h) = harness("criu_killed_mid_dump_leaves_workload_running") else {
        return;
    };
    let w = h.workdir("killed-mid-dump");
    let mut wl = w.spawn_counter(COUNTER, 101, &[]);
    let pid = wl.root();

    // The script holds criu in the post-dump action, after the dump and before criu releases
    // (or, without -R, kills) the tasks. It records its pid and parent for the cleanup.
    let marker = w.path.join("post-dump.pids");
    let script = w.path.join("hold-post-dump.sh");
    fs::write(
        &script,
        format!(
            "#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = post-dump ] || exit 0\n\
             echo \"$$ $PPID\" > '{m}.tmp' && mv '{m}.tmp' '{m}'\nexec sleep 60\n",
            m = marker.display()
        ),
    )
    .unwrap();
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();

    let log = w.path.join("dump.log");
    let mut args = w.criu_args_in("dump", &w.images, &log);
    args.extend([
        "-t".into(),
        pid.to_string(),
        "--action-script".into(),
        script.display().to_string(),
    ]);
    let mut criu = w.spawn_criu(&args, &[], &log);
    let criu_pid = criu.pid();
    let reached = wait_until(Duration::from_secs(30), || {
        marker.exists() || criu.try_status().is_some()
    });
    assert!(
        reached && marker.exists(),
        "criu did not reach the post-dump script (exit status {:?})\n{}",
        criu.try_status(),
        criu.log_so_far()
    );
    let script_pids: Vec<i32> = fs::read_to_string(&marker)
        .unwrap()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();

    // criu holds the workload now: traced by criu, stopped, not ticking.
    assert_eq!(
        procs::tracer_pid(pid),
        Some(criu_pid),
        "the workload is not seized by criu while criu waits in post-dump: {:?}",
        procs::stat(pid)
    );
    let held_at = wl.log(0).last();
    sleep(Duration::from_millis(300));
    assert_eq!(
        wl.log(0).last(),
        held_at,
        "the workload ticked while criu held it"
    );

    let run = criu.kill().unwrap();
    for &p in &script_pids {
        if p > 1 && p != criu_pid {
            procs::signal(p, libc::SIGKILL);
        }
    }
    for &p in &script_pids {
        if p > 1 && p != criu_pid {
            procs::reap(p, Duration::from_secs(5)).unwrap();
        }
    }
    assert_eq!(
        run.status.code(),
        None,
        "criu was not killed: {}",
        run.status
    );
    assert_gpusnap_loaded(&run);
    assert!(
        run.log.contains("Running post-dump scripts") && !run.log.contains("finished successfully"),
        "criu was not killed in post-dump\n{}",
        run.diagnostics()
    );

    let log = assert_runs_free(&mut wl, "after criu was killed mid-dump");
    assert!(log.last() > held_at);
}

/// Contract 2: the image directory (an 8 MiB tmpfs) fills up while a 64 MiB workload is
/// dumped: criu fails, says why, and the workload runs on with its memory intact.
#[test]
fn storage_full_during_dump_leaves_workload_intact() {
    let Some(h) = harness("storage_full_during_dump_leaves_workload_intact") else {
        return;
    };
    let w = h.workdir("storage-full");
    let images = w.path.join("small-images");
    let mount = Tmpfs::mount(&images, "8m");
    let mut wl = w.spawn(
        "ballast",
        BALLAST,
        &["--log", "ballast.log", "--seed", "102", "--mib", "64"],
        &[],
        &["ballast.log"],
    );
    let pid = wl.root();
    // The log lives outside the full file system, or criu could not say what went wrong.
    let log = w.path.join("dump.log");
    let mut args = w.criu_args_in("dump", &images, &log);
    args.extend(["-t".into(), pid.to_string()]);
    let run = w.run_criu(&args, &[], &log);
    assert!(
        !run.status.success() && !run.succeeded(),
        "criu dump into an 8 MiB directory of a 64 MiB process succeeded\n{}",
        run.diagnostics()
    );
    assert_gpusnap_loaded(&run);
    assert!(
        run.log.contains("No space left on device") || run.log.contains("ENOSPC"),
        "the dump log does not mention the write failure (ENOSPC)\n{}",
        run.diagnostics()
    );
    assert_runs_free(&mut wl, "after a dump that ran out of space");
    drop(wl);
    drop(mount);
}

/// Fake GPU state of process `nspid` in `dir`: two data files (indexes 0 and 2) of two 64 KiB
/// chunks each, covering one moved 256 KiB allocation, and a valid manifest.
fn write_fake_gpu_state(dir: &Path, nspid: NsPid) -> Manifest {
    const CHUNK: usize = 64 << 10;
    const BASE: u64 = 0x7f12_3400_0000;
    let d = fs::File::open(dir).unwrap();
    let mut files = Vec::new();
    let mut chunks = Vec::new();
    let mut addr = BASE;
    for index in [0, 2] {
        let mut wr = DataFileWriter::create(d.as_fd(), nspid, index).unwrap();
        for _ in 0..2 {
            let data: Vec<u8> = (0..CHUNK).map(|i| (i as u64 ^ addr) as u8).collect();
            chunks.push(wr.append_chunk(addr, &data, Codec::Raw).unwrap());
            addr += CHUNK as u64;
        }
        files.push(wr.finish().unwrap());
    }
    let m = Manifest {
        format_version: gpusnap_image::FORMAT_VERSION,
        nspid,
        path: CheckpointPath::Split,
        created_unix_s: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs(),
        gpusnap_version: gpusnap_image::BUILD.into(),
        driver_version: 13000,
        gpus: vec![GpuRecord {
            ordinal: 0,
            uuid: "0123456789abcdef0123456789abcdef".into(),
            name: "fake GPU of criu-tests".into(),
            total_mem: 80 << 30,
        }],
        allocations: vec![AllocationRecord {
            id: 1,
            device: 0,
            addr: BASE,
            size: addr - BASE,
            moved: true,
            lent: false,
            rdma_capable: false,
        }],
        files,
        chunks,
        timings_s: [("lock".to_string(), 0.001)].into_iter().collect(),
        requires: None,
    };
    write_manifest(d.as_fd(), &m).unwrap();
    m
}

fn flip_byte(path: &Path, offset: u64) {
    let mut b = fs::read(path).unwrap();
    b[offset as usize] ^= 0x40;
    fs::write(path, b).unwrap();
}

/// Contract 3: a CPU image made to claim GPU state (fake gpusnap files, "gpusnap" in the
/// inventory's plugin list) is refused at restore, before any task is created, for every kind
/// of damage, with a `gpusnap:` line naming it. The intact fake image gets past those checks
/// and fails only for want of a driver.
#[test]
fn damaged_gpusnap_image_refused_before_restore() {
    let Some(h) = harness("damaged_gpusnap_image_refused_before_restore") else {
        return;
    };
    let w = h.workdir("damaged-image");
    let mut wl = w.spawn_counter(COUNTER, 103, &[]);
    let pid = wl.root();
    let nspid = NsPid(pid as u32);
    w.dump(pid, false).assert_ok();
    wl.reap_dumped();
    let criu_files: Vec<String> = w
        .image_files()
        .into_iter()
        .filter(|f| f.ends_with(".img"))
        .collect();
    assert!(criu_files.iter().any(|f| f == "inventory.img"));
    assert!(!criu_files.iter().any(|f| f.starts_with("gpusnap")));

    let data0 = data_file_name(nspid, 0);
    let data2 = data_file_name(nspid, 2);
    let manifest = manifest_file_name(nspid);
    type Damage = fn(&Path, &Manifest, NsPid);
    let cases: Vec<(&str, Damage, String)> = vec![
        ("intact", |_, _, _| {}, String::new()),
        (
            "data-header-byte",
            |d, _, n| flip_byte(&d.join(data_file_name(n, 0)), 40),
            data0.clone(),
        ),
        (
            "chunk-payload-byte",
            |d, m, n| flip_byte(&d.join(data_file_name(n, 2)), m.chunks[3].file_offset + 100),
            format!("{data2}: chunk 3 checksum mismatch"),
        ),
        (
            "truncated-data-file",
            |d, m, n| {
                let f = fs::OpenOptions::new()
                    .write(true)
                    .open(d.join(data_file_name(n, 2)))
                    .unwrap();
                f.set_len(m.files[1].size - 1000).unwrap();
            },
            data2.clone(),
        ),
        (
            "manifest-byte",
            |d, _, n| {
                let p = d.join(manifest_file_name(n));
                let len = fs::metadata(&p).unwrap().len();
                flip_byte(&p, len / 2);
            },
            manifest.clone(),
        ),
        (
            "missing-data-file",
            |d, _, n| fs::remove_file(d.join(data_file_name(n, 0))).unwrap(),
            data0.clone(),
        ),
        (
            "path-escape",
            |d, m, n| {
                let mut bad = m.clone();
                bad.files[1].name = "../etc/passwd".into();
                fs::write(
                    d.join(manifest_file_name(n)),
                    encode_manifest_unchecked(&bad),
                )
                .unwrap();
            },
            "../etc/passwd".into(),
        ),
    ];

    for (name, damage, needle) in &cases {
        let dir = w.path.join(format!("images-{name}"));
        fs::create_dir(&dir).unwrap();
        for f in &criu_files {
            fs::copy(w.images.join(f), dir.join(f)).unwrap();
        }
        add_inventory_plugin(&dir.join("inventory.img"), "gpusnap").unwrap();
        assert_eq!(
            inventory_plugins(&fs::read(dir.join("inventory.img")).unwrap()).unwrap(),
            ["gpusnap"]
        );
        let m = write_fake_gpu_state(&dir, nspid);
        damage(&dir, &m, nspid);

        let log = dir.join("restore.log");
        let mut args = w.criu_args_in("restore", &dir, &log);
        args.push("--restore-detached".into());
        let run = w.run_criu(&args, &[], &log);
        let ctx = || format!("[{name}] {}", run.diagnostics());
        assert!(
            !run.status.success() && !run.succeeded(),
            "restore from a fake GPU image succeeded on a host without a GPU\n{}",
            ctx()
        );
        assert_gpusnap_loaded(&run);
        assert!(
            !run.log.contains("Forking task"),
            "criu created tasks before gpusnap refused the image\n{}",
            ctx()
        );
        let refused = run.gpusnap_lines_with("restore refused");
        if needle.is_empty() {
            assert!(
                refused.is_empty(),
                "an intact image was refused: {refused:#?}\n{}",
                ctx()
            );
            assert!(
                !run.gpusnap_lines_with("no usable NVIDIA driver").is_empty(),
                "the intact image did not fail for want of a driver\n{}",
                ctx()
            );
        } else {
            assert!(
                refused.iter().any(|l| l.contains(needle.as_str())),
                "no `gpusnap: restore refused` line naming {needle:?}: {refused:#?}\n{}",
                ctx()
            );
        }
        assert!(
            !procs::is_alive(pid),
            "[{name}] pid {pid} runs after a refused restore: {:?}",
            procs::stat(pid)
        );
    }

    // The CRIU part of the image was fine all along: without the fake GPU state it restores.
    w.restore().assert_ok();
    let log = wl.wait_for(0, wl.log(0).last() + MORE_TICKS);
    log.verify().unwrap();
}

/// Says hello to the agent of `pid` (retrying the connection for a while, the agent thread may
/// still be starting) and waits until the agent has closed the connection again, so that a
/// following dump sees only its door.
fn agent_hello(pid: i32, what: &str) -> Reply {
    let baseline = procs::socket_fds(pid);
    let mut fd = None;
    let connected = wait_until(Duration::from_secs(5), || {
        fd = connect_agent(gpusnap_proto::pid::HostPid(pid)).ok();
        fd.is_some()
    });
    assert!(
        connected,
        "{what}: cannot reach the agent of pid {pid} through its door: {}",
        connect_agent(gpusnap_proto::pid::HostPid(pid)).unwrap_err()
    );
    let ch = Channel::new(fd.unwrap());
    ch.send_request(
        &AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION,
        }),
        None,
    )
    .unwrap_or_else(|e| panic!("{what}: sending Hello: {e}"));
    let reply = ch
        .recv_reply(Some(Duration::from_secs(5)))
        .unwrap_or_else(|e| panic!("{what}: no answer to Hello: {e}"));
    drop(ch);
    assert!(
        wait_until(Duration::from_secs(5), || procs::socket_fds(pid)
            <= baseline),
        "{what}: the agent kept the connection open ({} sockets, {baseline} before)",
        procs::socket_fds(pid)
    );
    reply
}

fn assert_agent_answers(pid: i32, what: &str) {
    match agent_hello(pid, what) {
        Reply::Hello {
            version,
            pid: agent_pid,
            allocations,
            released,
            ..
        } => {
            assert_eq!(version, PROTOCOL_VERSION, "{what}");
            assert_eq!(
                agent_pid.get() as i32,
                pid,
                "{what}: the agent reports another pid"
            );
            assert_eq!(allocations, 0, "{what}: allocations without a GPU");
            assert!(!released, "{what}");
        }
        other => panic!("{what}: Hello answered with {other:?}"),
    }
}

/// Contract 4: the agent's door (a socket pair and its label memfd) is checkpointed and restored
/// by CRIU: a process with the agent preloaded survives `dump -R` and dump + restore, and its
/// agent answers through the door after each.
#[test]
fn agent_door_survives_dump_and_restore() {
    let Some(h) = harness("agent_door_survives_dump_and_restore") else {
        return;
    };
    let agent = h
        .agent_so()
        .unwrap_or_else(|e| panic!("building the agent: {e}"));
    let agent = agent.to_str().expect("UTF-8 agent path");
    let mut w = h.workdir("agent-socket");
    let mut wl = w.spawn_counter(
        COUNTER,
        104,
        &[("LD_PRELOAD", agent), ("GPUSNAP_AGENT_EAGER", "1")],
    );
    let pid = wl.root();
    assert_agent_answers(pid, "before any dump");

    w.dump(pid, true).assert_ok();
    assert_runs_free(&mut wl, "after criu dump -R");
    assert_agent_answers(pid, "after criu dump -R");

    // A second, killing dump into a fresh image directory, then restore.
    fs::rename(&w.images, w.path.join("images-leave-running")).unwrap();
    w.images = w.path.join("images-2");
    fs::create_dir(&w.images).unwrap();
    w.dump(pid, false).assert_ok();
    wl.reap_dumped();
    let at_dump = wl.log(0).last();
    w.restore().assert_ok();
    let log = wl.wait_for(0, at_dump + MORE_TICKS);
    log.verify().unwrap();
    assert!(
        procs::maps_contain(pid, agent),
        "the agent is not mapped into the restored process"
    );
    assert_agent_answers(pid, "after criu dump and restore");
}

/// Contract 5: a configuration error fails the dump before criu touches the process, with a
/// `gpusnap:` line naming the problem, in CRIU's log and on CRIU's stderr (a user who runs
/// `criu dump -o FILE` sees why on the terminal); every problem of a run in that one line;
/// `GPUSNAP_MODE=off` dumps with gpusnap disabled.
#[test]
fn config_errors_fail_dump_before_touching_process() {
    let Some(h) = harness("config_errors_fail_dump_before_touching_process") else {
        return;
    };
    let w = h.workdir("config-errors");
    let mut wl = w.spawn_counter(COUNTER, 105, &[]);
    let pid = wl.root();
    let conf = w.path.join("gpusnap.conf");
    fs::write(&conf, "mode = \"auto\"\nlock_timout_ms = 5000\n").unwrap();
    let conf = conf.display().to_string();
    let two = w.path.join("two-bad.conf");
    fs::write(&two, "compres = \"zstd\"\nlock_timout_ms = 5000\n").unwrap();
    let two = two.display().to_string();
    let missing = w.path.join("no-such.conf").display().to_string();
    let bad = [
        (
            "unknown-key",
            ("GPUSNAP_CONFIG", conf.as_str()),
            "lock_timout_ms",
        ),
        (
            "missing-file",
            ("GPUSNAP_CONFIG", missing.as_str()),
            "no-such.conf",
        ),
        (
            "unknown-variable",
            ("GPUSNAP_WRITER_THRADS", "4"),
            "GPUSNAP_WRITER_THRADS",
        ),
        ("two-bad-keys", ("GPUSNAP_CONFIG", two.as_str()), "compres`"),
    ];
    for (name, env, needle) in &bad {
        let images = w.path.join(format!("images-{name}"));
        fs::create_dir(&images).unwrap();
        let log = images.join("dump.log");
        let mut args = w.criu_args_in("dump", &images, &log);
        args.extend(["-t".into(), pid.to_string()]);
        let run = w.run_criu(&args, &[*env], &log);
        let ctx = || format!("[{name}] {}", run.diagnostics());
        assert!(
            !run.status.success() && !run.succeeded(),
            "dump with a configuration error succeeded\n{}",
            ctx()
        );
        let errors = run.gpusnap_lines_with("configuration error");
        assert!(
            errors.iter().any(|l| l.contains(needle)),
            "no `gpusnap: configuration error` line naming {needle:?}: {errors:#?}\n{}",
            ctx()
        );
        let told: Vec<&str> = run
            .output
            .lines()
            .filter(|l| l.starts_with("gpusnap: configuration error"))
            .collect();
        assert!(
            told.len() == 1 && told[0].contains(needle),
            "CRIU's stderr does not say why ({needle:?}): {:?}\n{}",
            run.output,
            ctx()
        );
        if *name == "two-bad-keys" {
            assert!(
                told[0].contains("2 configuration problems")
                    && told[0].contains("compres`")
                    && told[0].contains("lock_timout_ms`"),
                "both bad keys in one line: {told:?}"
            );
        }
        assert!(
            !run.log.contains("Seized task"),
            "criu seized the process although the configuration is broken\n{}",
            ctx()
        );
        let pages: Vec<String> = fs::read_dir(&images)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("pages-") || n.starts_with("core-"))
            .collect();
        assert!(pages.is_empty(), "[{name}] images written: {pages:?}");
        assert_runs_free(&mut wl, &format!("after a dump with a {name} error"));
    }

    let images = w.path.join("images-off");
    fs::create_dir(&images).unwrap();
    let log = images.join("dump.log");
    let mut args = w.criu_args_in("dump", &images, &log);
    args.extend(["-t".into(), pid.to_string(), "--leave-running".into()]);
    let run = w.run_criu(&args, &[("GPUSNAP_MODE", "off")], &log);
    run.assert_ok();
    assert!(
        !run.gpusnap_lines_with("disabled by configuration")
            .is_empty(),
        "GPUSNAP_MODE=off: no `gpusnap: disabled by configuration` line\n{}",
        run.diagnostics()
    );
    assert_runs_free(&mut wl, "after a dump with GPUSNAP_MODE=off");
}
