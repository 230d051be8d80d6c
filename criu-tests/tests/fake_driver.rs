//! gpusnap's CUDA orchestration with a real CRIU and the stand-in driver `libfakecuda.so`.
//!
//! CRIU runs with `GPUSNAP_LIBCUDA` naming the fake driver (crate `fake-cuda`), which takes the
//! `fakegpu` workload (a counter with a thread named `fakecuda-rt`) for a CUDA process, keeps its
//! driver state in a file and logs every call with the ptrace state of the target's threads.
//! The tests check the protocol the real driver needs, which CI cannot otherwise see without a
//! GPU: the lock at PAUSE while the process runs, the checkpoint and restore with only the
//! driver's restore thread running, the rollback after `-R` or a failure, and the restore and
//! unlock at RESUME; and that the workload runs on, untraced, with its memory intact.

use std::fs;
use std::time::Duration;

use criu_tests::fake_driver::{Call, FakeDriver, RESTORE_THREAD_COMM, gpusnap_cli, shorts};
use criu_tests::fixtures::output_text;
use criu_tests::inventory::inventory_plugins;
use criu_tests::{CounterLog, CriuRun, Harness, WorkDir, Workload, harness, procs};

const FAKEGPU: &str = env!("CARGO_BIN_EXE_fakegpu");

/// How many more ticks (50 ms each) a process must write to count as running.
const MORE_TICKS: u64 = 5;

/// How soon a released workload must be running again.
const PROMPTLY: Duration = Duration::from_secs(5);

fn setup(test: &str) -> Option<(&'static Harness, WorkDir, FakeDriver)> {
    let h = harness(test)?;
    let w = h.workdir(test);
    let fake = FakeDriver::new(h, &w);
    Some((h, w, fake))
}

/// One `fakegpu` process (a counter with a `fakecuda-rt` thread).
fn spawn_one(w: &WorkDir, seed: u64) -> Workload {
    let seed = seed.to_string();
    let wl = w.spawn(
        "fakegpu",
        FAKEGPU,
        &["--log", "fakegpu.log", "--seed", &seed],
        &[],
        &["fakegpu.log"],
    );
    assert!(restore_thread(wl.root()).is_some(), "no fakecuda-rt thread");
    wl
}

/// A parent without CUDA state and two `fakegpu` children.
fn spawn_tree(w: &WorkDir, seed: u64) -> Workload {
    let seed = seed.to_string();
    w.spawn(
        "fakegpu-tree",
        FAKEGPU,
        &["--dir", ".", "--seed", &seed, "--children", "2"],
        &[],
        &[
            "fakegpu-parent.log",
            "fakegpu-child0.log",
            "fakegpu-child1.log",
        ],
    )
}

/// The tid of `pid`'s `fakecuda-rt` thread.
fn restore_thread(pid: i32) -> Option<i32> {
    procs::tids(pid).into_iter().find(|t| {
        fs::read_to_string(format!("/proc/{pid}/task/{t}/comm"))
            .is_ok_and(|c| c.trim_end() == RESTORE_THREAD_COMM)
    })
}

/// Every thread of `pid` is untraced and not stopped.
fn runs_free(pid: i32) -> bool {
    let t = procs::tids(pid);
    !t.is_empty()
        && t.iter().all(|&tid| {
            procs::tracer_pid(tid) == Some(0)
                && procs::stat(tid).is_some_and(|s| matches!(s.state, 'S' | 'R' | 'D'))
        })
}

/// Polls `f` every 10 ms until it is true or `timeout` has passed; returns its last value.
fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return f();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Process `i` of the workload runs untraced and writes more ticks; its whole log is consistent
/// (counter continues, memory checksum unchanged, in-memory chain unbroken).
fn assert_runs_on(wl: &Workload, i: usize, what: &str) -> CounterLog {
    let pid = wl.pids[i];
    assert!(
        wait_until(PROMPTLY, || runs_free(pid)),
        "{what}: pid {pid} is not running free: {:?}, TracerPid {:?}",
        procs::stat(pid),
        procs::tracer_pid(pid)
    );
    let last = wl.log(i).last();
    let log = CounterLog::wait_for(&wl.logs[i], last + MORE_TICKS, PROMPTLY)
        .unwrap_or_else(|e| panic!("{what}: pid {pid} does not run on: {e}"));
    log.verify()
        .unwrap_or_else(|e| panic!("{what}: pid {pid}: workload state damaged: {e}"));
    assert_eq!(log.pid, pid);
    assert!(
        runs_free(pid),
        "{what}: pid {pid} was stopped or traced again"
    );
    log
}

/// Context for assertion messages: the fake's log and gpusnap's lines.
fn context(fake: &FakeDriver, pids: &[i32], runs: &[&CriuRun]) -> String {
    let mut s = String::new();
    for &p in pids {
        s.push_str(&format!(
            "--- fake driver log of {p} (state {}) ---\n{}",
            fake.state(p),
            fake.log_text(p)
        ));
    }
    for r in runs {
        s.push_str(&format!("{}\n", r.diagnostics()));
    }
    s
}

/// The protocol rules every state-changing call must have followed: the lock while the process
/// ran (PAUSE, before CRIU seized it), everything else with CRIU holding the application's
/// threads and only the restore thread running. And the restore thread always ran.
fn assert_ptrace_protocol(calls: &[Call], ctx: &str) {
    for c in calls {
        assert!(
            !c.rt_stopped(),
            "{} ran with the restore thread stopped: {c:?}\n{ctx}",
            c.call
        );
        if c.call == "lock" {
            assert!(
                c.app_none_stopped(),
                "the lock came after CRIU stopped the process (it belongs in PAUSE): {c:?}\n{ctx}"
            );
        } else {
            assert!(
                c.app_all_traced(),
                "{} ran while application threads were not held by CRIU: {c:?}\n{ctx}",
                c.call
            );
        }
    }
}

fn assert_gpusnap_line(run: &CriuRun, needle: &str) {
    assert!(
        !run.gpusnap_lines_with(needle).is_empty(),
        "no `gpusnap: ...{needle}...` line in {}\n{}",
        run.log_path.display(),
        run.diagnostics()
    );
}

/// Contract 1: dump (the process is killed) and restore of one CUDA process: lock at PAUSE,
/// checkpoint with the restore thread running, and at restore: restore, unlock; the image is a
/// transparent-path gpusnap image; the process runs on from where it was.
#[test]
fn dump_and_restore_drive_the_driver() {
    let Some((h, w, fake)) = setup("fake-dump-restore") else {
        return;
    };
    let mut wl = spawn_one(&w, 201);
    let pid = wl.root();
    let rt = restore_thread(pid).unwrap();

    let dump = fake.dump(&w, pid, false, &[], &[]);
    dump.assert_ok();
    let ctx = context(&fake, &[pid], &[&dump]);
    let ops = fake.ops(pid);
    assert_eq!(shorts(&ops), ["lock:0", "checkpoint:0"], "{ctx}");
    assert_ptrace_protocol(&ops, &ctx);
    assert!(ops.iter().all(|c| c.rt == Some(rt)), "{ctx}");
    assert_eq!(fake.state(pid), "checkpointed", "{ctx}");
    assert_gpusnap_line(&dump, "CUDA state found");
    assert_gpusnap_line(&dump, "dump phases");

    // The image: a manifest of the transparent path, and gpusnap in the inventory.
    let manifest = gpusnap_image::manifest_file_name(gpusnap_proto::pid::NsPid(pid as u32));
    assert!(
        w.image_files().contains(&manifest),
        "no {manifest} in {:?}",
        w.image_files()
    );
    let inventory = fs::read(w.images.join("inventory.img")).unwrap();
    assert!(
        inventory_plugins(&inventory)
            .unwrap()
            .contains(&"gpusnap".to_owned()),
        "inventory.img does not list gpusnap"
    );
    let cli = gpusnap_cli(h).unwrap_or_else(|e| panic!("building gpusnap: {e}"));
    let out = std::process::Command::new(cli)
        .arg("inspect")
        .arg(&w.images)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gpusnap inspect failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let procs_json = report["processes"].as_array().unwrap();
    assert_eq!(procs_json.len(), 1, "{report:#}");
    assert_eq!(procs_json[0]["nspid"], pid, "{report:#}");
    assert_eq!(procs_json[0]["path"], "transparent", "{report:#}");
    assert_eq!(procs_json[0]["gpus"][0]["name"], "Fake GPU", "{report:#}");
    // The manifest names the build that wrote it: the one the plugin logged at load.
    let loaded = dump.gpusnap_lines_with(" loaded (stage dump)");
    let build = loaded
        .first()
        .and_then(|l| l.split("gpusnap: gpusnap ").nth(1))
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("no load line in {}", dump.log_path.display()));
    assert!(build.contains('+'), "no commit in the build {build:?}");
    assert_eq!(procs_json[0]["gpusnap_version"], build, "{report:#}");

    wl.reap_dumped();
    let at_dump = wl.log(0).last();
    let restore = fake.restore(&w, &[]);
    restore.assert_ok();
    let ctx = context(&fake, &[pid], &[&dump, &restore]);
    let ops = fake.ops(pid);
    assert_eq!(
        shorts(&ops),
        ["lock:0", "checkpoint:0", "restore:0", "unlock:0"],
        "{ctx}"
    );
    assert_ptrace_protocol(&ops, &ctx);
    assert_eq!(fake.state(pid), "running", "{ctx}");
    assert_eq!(
        restore_thread(pid),
        Some(rt),
        "the restored process has no restore thread of the same tid"
    );
    assert_gpusnap_line(&restore, "restored");
    let log = assert_runs_on(&wl, 0, "after restore");
    assert!(log.last() >= at_dump + MORE_TICKS);
}

/// Contract 2: `criu dump -R`: lock, checkpoint, then (exit's rollback) restore and unlock, all
/// with the restore thread running; the process was never killed, runs on, and no thread is
/// left traced or stopped.
#[test]
fn leave_running_dump_rolls_back_to_running() {
    let Some((_, w, fake)) = setup("fake-leave-running") else {
        return;
    };
    let mut wl = spawn_one(&w, 202);
    let pid = wl.root();
    let dump = fake.dump(&w, pid, true, &[], &[]);
    dump.assert_ok();
    let ctx = context(&fake, &[pid], &[&dump]);
    let ops = fake.ops(pid);
    assert_eq!(
        shorts(&ops),
        ["lock:0", "checkpoint:0", "restore:0", "unlock:0"],
        "{ctx}"
    );
    assert_ptrace_protocol(&ops, &ctx);
    assert_eq!(fake.state(pid), "running", "{ctx}");
    assert_gpusnap_line(&dump, "rolled back to running");
    assert!(
        wl.original_still_running(),
        "the workload died during a -R dump"
    );
    assert_runs_on(&wl, 0, "after dump -R");
}

/// A call made with `FAKECUDA_NEEDS_APP_MS` saw the other threads run about `stall::STALL`
/// (3 s) after it began: gpusnap waited that long for progress, then let them run.
fn assert_others_ran_after_the_stall(call: &Call, ctx: &str) {
    let waited: u64 = call
        .fields
        .get("app_ran_after_ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("the {} did not record its wait\n{ctx}", call.call));
    assert!(
        (2_000..15_000).contains(&waited),
        "the other threads ran {waited} ms into the {} (expected about 3 s)\n{ctx}",
        call.call
    );
}

/// The driver checkpoint waits on a thread CRIU holds, as a PyTorch job's did on the H200 (the
/// fake's checkpoint waits until the other threads run): after `stall::STALL` without progress
/// gpusnap lets the process's other threads run until the checkpoint returns, stops them again,
/// and the dump and the restore succeed; the process runs on intact.
#[test]
fn checkpoint_waiting_on_a_stopped_thread_is_unblocked() {
    let Some((_, w, fake)) = setup("fake-checkpoint-stall") else {
        return;
    };
    let mut wl = spawn_one(&w, 211);
    let pid = wl.root();
    let needs_app = [("FAKECUDA_NEEDS_APP_MS", "20000")];
    let dump = fake.dump(&w, pid, false, &needs_app, &[]);
    let ctx = context(&fake, &[pid], &[&dump]);
    dump.assert_ok();
    let ops = fake.ops(pid);
    assert_eq!(shorts(&ops), ["lock:0", "checkpoint:0"], "{ctx}");
    assert_ptrace_protocol(&ops, &ctx);
    assert_others_ran_after_the_stall(&ops[1], &ctx);
    assert_gpusnap_line(&dump, "shows no progress");
    assert_gpusnap_line(&dump, "until the driver call returns");
    assert_eq!(fake.state(pid), "checkpointed", "{ctx}");

    wl.reap_dumped();
    let at_dump = wl.log(0).last();
    let restore = fake.restore(&w, &[]);
    restore.assert_ok();
    let log = assert_runs_on(&wl, 0, "after a dump whose checkpoint stalled");
    assert!(log.last() >= at_dump + MORE_TICKS);
}

/// The driver restore waits on a thread CRIU holds (restored threads come back in the state
/// they were dumped in, locks included): gpusnap lets the other threads run until the restore
/// returns and stops them again *before* the unlock, so the unlock (and everything after it)
/// still runs with the application held; the process runs on intact.
#[test]
fn restore_waiting_on_a_stopped_thread_is_unblocked() {
    let Some((_, w, fake)) = setup("fake-restore-stall") else {
        return;
    };
    let mut wl = spawn_one(&w, 212);
    let pid = wl.root();
    let dump = fake.dump(&w, pid, false, &[], &[]);
    dump.assert_ok();
    wl.reap_dumped();
    let at_dump = wl.log(0).last();
    let needs_app = [("FAKECUDA_NEEDS_APP_MS", "20000")];
    let restore = fake.restore(&w, &needs_app);
    let ctx = context(&fake, &[pid], &[&dump, &restore]);
    restore.assert_ok();
    let ops = fake.ops(pid);
    assert_eq!(
        shorts(&ops),
        ["lock:0", "checkpoint:0", "restore:0", "unlock:0"],
        "{ctx}"
    );
    // The unlock's `app` states: every application thread held again.
    assert_ptrace_protocol(&ops, &ctx);
    assert_others_ran_after_the_stall(&ops[2], &ctx);
    assert_gpusnap_line(&restore, "until the driver call returns");
    let log = assert_runs_on(&wl, 0, "after a restore whose driver call stalled");
    assert!(log.last() >= at_dump + MORE_TICKS);
}

/// Contract 3: the driver checkpoint fails (the fake fails it once, the state stays locked):
/// the dump fails naming the call, and the rollback brings the process back to running: an
/// unlock, as it is locked, not a restore. The workload runs on, untraced.
#[test]
fn failed_checkpoint_is_rolled_back() {
    let Some((_, w, fake)) = setup("fake-checkpoint-fails") else {
        return;
    };
    let mut wl = spawn_one(&w, 203);
    let pid = wl.root();
    let dump = fake.dump(&w, pid, false, &[("FAKECUDA_FAIL", "checkpoint")], &[]);
    let ctx = context(&fake, &[pid], &[&dump]);
    assert!(!dump.succeeded(), "the dump succeeded\n{ctx}");
    assert_gpusnap_line(&dump, "cuCheckpointProcessCheckpoint failed");
    let ops = fake.ops(pid);
    assert_eq!(shorts(&ops)[..2], ["lock:0", "checkpoint:999"], "{ctx}");
    assert_ptrace_protocol(&ops, &ctx);
    assert_eq!(
        fake.state(pid),
        "running",
        "the process was left {}\n{ctx}",
        fake.state(pid)
    );
    assert_eq!(
        ops.last().map(Call::short).as_deref(),
        Some("unlock:0"),
        "{ctx}"
    );
    assert!(wl.original_still_running(), "the dump killed the workload");
    assert_runs_on(&wl, 0, "after a failed checkpoint");
}

/// Contract 3b: the driver checkpoint fails *after* it checkpointed (the fake moves the state,
/// then reports an error, as a driver that timed out late): the rollback restores and unlocks.
#[test]
fn late_failed_checkpoint_is_restored_and_unlocked() {
    let Some((_, w, fake)) = setup("fake-checkpoint-fails-late") else {
        return;
    };
    let mut wl = spawn_one(&w, 204);
    let pid = wl.root();
    let dump = fake.dump(
        &w,
        pid,
        false,
        &[("FAKECUDA_FAIL", "checkpoint:after")],
        &[],
    );
    let ctx = context(&fake, &[pid], &[&dump]);
    assert!(!dump.succeeded(), "the dump succeeded\n{ctx}");
    assert_gpusnap_line(&dump, "cuCheckpointProcessCheckpoint failed");
    let ops = fake.ops(pid);
    assert_eq!(
        shorts(&ops),
        ["lock:0", "checkpoint:999", "restore:0", "unlock:0"],
        "{ctx}"
    );
    assert_ptrace_protocol(&ops, &ctx);
    assert_eq!(fake.state(pid), "running", "{ctx}");
    assert_gpusnap_line(&dump, "rolled back to running");
    // A failed dump leaves no gpusnap image behind.
    let ours: Vec<String> = w
        .image_files()
        .into_iter()
        .filter(|f| f.starts_with("gpusnap-"))
        .collect();
    assert!(
        ours.is_empty(),
        "gpusnap files after a failed dump: {ours:?}"
    );
    assert!(wl.original_still_running(), "the dump killed the workload");
    assert_runs_on(&wl, 0, "after a late checkpoint failure");
}

/// Checks shared by the lock-failure tests: the dump failed with the plugin's lock message, the
/// fake saw exactly one failed lock and nothing else, the process runs on unlocked.
fn assert_lock_failure(fake: &FakeDriver, wl: &mut Workload, dump: &CriuRun, rc: u32) -> Call {
    let pid = wl.root();
    let ctx = context(fake, &[pid], &[dump]);
    assert!(!dump.succeeded(), "the dump succeeded\n{ctx}");
    assert_gpusnap_line(dump, &format!("locking the CUDA state of pid {pid} failed"));
    let ops = fake.ops(pid);
    assert_eq!(shorts(&ops), [format!("lock:{rc}")], "{ctx}");
    assert_ptrace_protocol(&ops, &ctx);
    assert_eq!(fake.state(pid), "running", "{ctx}");
    assert!(wl.original_still_running(), "the dump killed the workload");
    assert_runs_on(wl, 0, "after a failed lock");
    ops[0].clone()
}

/// Contract 4: the lock fails: the dump fails with gpusnap's lock message, nothing else is
/// called, the process stays running.
#[test]
fn failed_lock_fails_the_dump_and_leaves_the_process_running() {
    let Some((_, w, fake)) = setup("fake-lock-fails") else {
        return;
    };
    let mut wl = spawn_one(&w, 205);
    let dump = fake.dump(&w, wl.root(), false, &[("FAKECUDA_FAIL", "lock")], &[]);
    assert_lock_failure(&fake, &mut wl, &dump, 999);
}

/// Contract 4c: the lock reports a failure but took effect (the fake's `lock:after`): the
/// plugin must not leave the process locked. It unlocks at once (in PAUSE, while the process
/// still runs), and the dump fails with the lock message.
#[test]
fn lock_that_failed_but_took_effect_is_undone() {
    let Some((_, w, fake)) = setup("fake-lock-after") else {
        return;
    };
    let mut wl = spawn_one(&w, 207);
    let pid = wl.root();
    let dump = fake.dump(&w, pid, false, &[("FAKECUDA_FAIL", "lock:after")], &[]);
    let ctx = context(&fake, &[pid], &[&dump]);
    assert!(!dump.succeeded(), "the dump succeeded\n{ctx}");
    assert_gpusnap_line(
        &dump,
        &format!("locking the CUDA state of pid {pid} failed"),
    );
    assert_eq!(shorts(&fake.ops(pid)), ["lock:999", "unlock:0"], "{ctx}");
    assert_eq!(fake.state(pid), "running", "{ctx}");
    assert!(wl.original_still_running(), "the dump killed the workload");
    assert_runs_on(&wl, 0, "after a lock that failed late");
}

/// Contract 4b: the lock times out (gpusnap's lock_timeout_ms = 300, the fake needs 20 s): the
/// driver is given the configured timeout, the dump fails after it, the process stays running.
#[test]
fn lock_timeout_fails_the_dump_and_leaves_the_process_running() {
    let Some((_, w, fake)) = setup("fake-lock-timeout") else {
        return;
    };
    let mut wl = spawn_one(&w, 206);
    let env = [
        ("FAKECUDA_LOCK_DELAY_MS", "20000"),
        ("GPUSNAP_LOCK_TIMEOUT_MS", "300"),
    ];
    let t0 = std::time::Instant::now();
    let dump = fake.dump(&w, wl.root(), false, &env, &[]);
    let took = t0.elapsed();
    let lock = assert_lock_failure(&fake, &mut wl, &dump, 909);
    assert_eq!(
        lock.fields.get("timeout_ms").map(String::as_str),
        Some("300")
    );
    assert_gpusnap_line(&dump, "within 300 ms");
    assert!(took < Duration::from_secs(10), "the dump took {took:?}");
}

/// Contract 5: a parent (no CUDA) with two CUDA children: one dump checkpoints both, in
/// parallel (their checkpoint calls overlap); one restore restores both, in parallel; all three
/// run on.
#[test]
fn tree_of_gpu_processes_is_checkpointed_and_restored_in_parallel() {
    let Some((_, w, fake)) = setup("fake-tree") else {
        return;
    };
    let mut wl = spawn_tree(&w, 207);
    assert_eq!(wl.pids.len(), 3);
    let (parent, kids) = (wl.pids[0], [wl.pids[1], wl.pids[2]]);
    assert!(restore_thread(parent).is_none());
    let slow = [("FAKECUDA_CALL_DELAY_MS", "300")];
    let dump = fake.dump(&w, parent, false, &slow, &[]);
    dump.assert_ok();
    let ctx = context(&fake, &wl.pids, &[&dump]);
    assert!(fake.ops(parent).is_empty(), "{ctx}");
    for k in kids {
        let ops = fake.ops(k);
        assert_eq!(shorts(&ops), ["lock:0", "checkpoint:0"], "{ctx}");
        assert_ptrace_protocol(&ops, &ctx);
        assert_eq!(fake.state(k), "checkpointed", "{ctx}");
    }
    assert_gpusnap_line(&dump, "2 GPU processes checkpointed in parallel");
    // Neither child has the agent: CUDA IPC between them would go unseen, and the log says so.
    assert_gpusnap_line(&dump, "CUDA IPC between them cannot be detected");
    let overlap = |call: &str| {
        let [a, b] = kids.map(|k| {
            fake.ops(k)
                .into_iter()
                .find(|c| c.call == call)
                .unwrap_or_else(|| panic!("no {call} of {k}\n{ctx}"))
        });
        a.start_us < b.end_us && b.start_us < a.end_us
    };
    assert!(
        overlap("checkpoint"),
        "the checkpoints did not overlap\n{ctx}"
    );
    for m in kids.map(|k| gpusnap_image::manifest_file_name(gpusnap_proto::pid::NsPid(k as u32))) {
        assert!(w.image_files().contains(&m), "no {m}");
    }

    wl.reap_dumped();
    let restore = fake.restore(&w, &slow);
    restore.assert_ok();
    let ctx = context(&fake, &wl.pids, &[&dump, &restore]);
    for k in kids {
        let ops = fake.ops(k);
        assert_eq!(
            shorts(&ops),
            ["lock:0", "checkpoint:0", "restore:0", "unlock:0"],
            "{ctx}"
        );
        assert_ptrace_protocol(&ops, &ctx);
        assert_eq!(fake.state(k), "running", "{ctx}");
    }
    assert_gpusnap_line(&restore, "2 GPU processes restored in parallel");
    assert!(overlap("restore"), "the restores did not overlap\n{ctx}");
    for i in 0..3 {
        assert_runs_on(&wl, i, "after restoring the tree");
    }
    for k in kids {
        assert_eq!(procs::stat(k).unwrap().ppid, parent);
    }
}

/// Contract 6: a process that was already locked before the dump (by someone else) is
/// checkpointed without a lock of ours, and `-R` returns it to locked, not running.
#[test]
fn leave_running_returns_a_locked_process_to_locked() {
    let Some((_, w, fake)) = setup("fake-prelocked") else {
        return;
    };
    let mut wl = spawn_one(&w, 208);
    let pid = wl.root();
    fake.set_state(pid, "locked");
    let dump = fake.dump(&w, pid, true, &[], &[]);
    dump.assert_ok();
    let ctx = context(&fake, &[pid], &[&dump]);
    let ops = fake.ops(pid);
    assert_eq!(shorts(&ops), ["checkpoint:0", "restore:0"], "{ctx}");
    assert_ptrace_protocol(&ops, &ctx);
    assert_eq!(fake.state(pid), "locked", "{ctx}");
    assert_gpusnap_line(&dump, "driver state locked");
    assert_gpusnap_line(&dump, "rolled back to locked");
    assert!(wl.original_still_running(), "the workload died during -R");
    // The fake cannot hold the process's CPU threads (a real lock only blocks CUDA calls):
    // it runs on, untraced.
    assert_runs_on(&wl, 0, "after -R of a locked process");
}

/// Contract 7: the driver restore fails at `criu restore`: the restore fails naming the call,
/// and the restored process is killed rather than left running without its GPU state; the
/// image is unchanged, and a second restore succeeds.
#[test]
fn failed_driver_restore_kills_the_process_and_the_image_stays_usable() {
    let Some((_, w, fake)) = setup("fake-restore-fails") else {
        return;
    };
    let mut wl = spawn_one(&w, 209);
    let pid = wl.root();
    fake.dump(&w, pid, false, &[], &[]).assert_ok();
    wl.reap_dumped();
    let restore = fake.restore(&w, &[("FAKECUDA_FAIL", "restore")]);
    let ctx = context(&fake, &[pid], &[&restore]);
    assert!(!restore.succeeded(), "the restore succeeded\n{ctx}");
    assert_gpusnap_line(&restore, "cuCheckpointProcessRestore failed");
    assert!(
        wait_until(PROMPTLY, || !procs::is_alive(pid)),
        "the process runs without its GPU state\n{ctx}"
    );
    assert_eq!(
        shorts(&fake.ops(pid)),
        ["lock:0", "checkpoint:0", "restore:999"],
        "{ctx}"
    );
    // The fake's state file plays the driver state inside the process image: still
    // checkpointed, as in the image. Restore again.
    assert_eq!(fake.state(pid), "checkpointed", "{ctx}");
    procs::reap(pid, PROMPTLY).unwrap();
    procs::wait_pid_free(pid, PROMPTLY).unwrap();
    let again = fake.restore(&w, &[]);
    again.assert_ok();
    let ctx = context(&fake, &[pid], &[&restore, &again]);
    assert_eq!(
        shorts(&fake.ops(pid)),
        [
            "lock:0",
            "checkpoint:0",
            "restore:999",
            "restore:0",
            "unlock:0"
        ],
        "{ctx}"
    );
    assert_runs_on(&wl, 0, "after the second restore");
}

/// Contract 5b: in a tree, the second CUDA child's lock fails after the first child was locked
/// and seized: the dump fails, and the first child is unlocked again (with its restore thread
/// running); both children run on.
#[test]
fn failed_lock_in_a_tree_unlocks_the_processes_already_locked() {
    let Some((_, w, fake)) = setup("fake-tree-lock-fails") else {
        return;
    };
    let mut wl = spawn_tree(&w, 210);
    let kids = [wl.pids[1], wl.pids[2]];
    let fail = format!("lock@{}", kids[1]);
    let dump = fake.dump(&w, wl.root(), false, &[("FAKECUDA_FAIL", &fail)], &[]);
    let ctx = context(&fake, &wl.pids, &[&dump]);
    assert!(!dump.succeeded(), "the dump succeeded\n{ctx}");
    assert_gpusnap_line(
        &dump,
        &format!("locking the CUDA state of pid {} failed", kids[1]),
    );
    let first = fake.ops(kids[0]);
    assert_eq!(
        shorts(&first),
        ["lock:0", "unlock:0"],
        "the child paused first (CRIU pauses children in creation order) was not unlocked\n{ctx}"
    );
    assert_ptrace_protocol(&first, &ctx);
    assert_eq!(shorts(&fake.ops(kids[1])), ["lock:999"], "{ctx}");
    for k in kids {
        assert_eq!(fake.state(k), "running", "{ctx}");
    }
    assert!(wl.original_still_running(), "the dump killed the workload");
    for i in 0..3 {
        assert_runs_on(&wl, i, "after a failed lock in a tree");
    }
}

/// Contract 5c: in a tree, one child's checkpoint fails (late: the driver checkpointed it)
/// while the other's succeeds: the dump fails and both are restored and unlocked.
#[test]
fn failed_checkpoint_in_a_tree_rolls_back_every_process() {
    let Some((_, w, fake)) = setup("fake-tree-checkpoint-fails") else {
        return;
    };
    let mut wl = spawn_tree(&w, 211);
    let kids = [wl.pids[1], wl.pids[2]];
    let fail = format!("checkpoint:after@{}", kids[1]);
    let dump = fake.dump(&w, wl.root(), false, &[("FAKECUDA_FAIL", &fail)], &[]);
    let ctx = context(&fake, &wl.pids, &[&dump]);
    assert!(!dump.succeeded(), "the dump succeeded\n{ctx}");
    for (k, rc) in [(kids[0], 0), (kids[1], 999)] {
        let ops = fake.ops(k);
        assert_eq!(
            shorts(&ops),
            [
                "lock:0".to_owned(),
                format!("checkpoint:{rc}"),
                "restore:0".into(),
                "unlock:0".into()
            ],
            "{ctx}"
        );
        assert_ptrace_protocol(&ops, &ctx);
        assert_eq!(fake.state(k), "running", "{ctx}");
    }
    assert!(wl.original_still_running(), "the dump killed the workload");
    for i in 0..3 {
        assert_runs_on(&wl, i, "after a failed checkpoint in a tree");
    }
}

/// Contract 6b: a process that was already checkpointed before the dump is left alone: no
/// driver call changes it, and after `-R` it is still checkpointed.
#[test]
fn leave_running_leaves_a_checkpointed_process_checkpointed() {
    let Some((_, w, fake)) = setup("fake-precheckpointed") else {
        return;
    };
    let wl = spawn_one(&w, 212);
    let pid = wl.root();
    fake.set_state(pid, "checkpointed");
    let dump = fake.dump(&w, pid, true, &[], &[]);
    dump.assert_ok();
    let ctx = context(&fake, &[pid], &[&dump]);
    assert!(fake.ops(pid).is_empty(), "{ctx}");
    assert_eq!(fake.state(pid), "checkpointed", "{ctx}");
    assert_gpusnap_line(&dump, "already checkpointed before the dump");
}

/// Contract 8: `gpusnap recover` (outside CRIU) brings back a process that a dump cut short
/// left checkpointed: it holds every thread itself, runs the restore thread for the driver's
/// restore and unlock, and lets the process go.
#[test]
fn gpusnap_recover_restores_and_unlocks_a_checkpointed_process() {
    let Some((h, w, fake)) = setup("fake-recover") else {
        return;
    };
    let wl = spawn_one(&w, 213);
    let pid = wl.root();
    fake.set_state(pid, "checkpointed");
    let cli = gpusnap_cli(h).unwrap_or_else(|e| panic!("building gpusnap: {e}"));
    let out = std::process::Command::new(cli)
        .args(["recover", &pid.to_string()])
        .envs(fake.env())
        .output()
        .unwrap();
    let text = output_text(&out);
    let ctx = format!(
        "gpusnap recover: {}\n{text}\n{}",
        out.status,
        context(&fake, &[pid], &[])
    );
    assert!(out.status.success(), "{ctx}");
    assert!(text.contains("recovered"), "{ctx}");
    let ops = fake.ops(pid);
    assert_eq!(shorts(&ops), ["restore:0", "unlock:0"], "{ctx}");
    assert_ptrace_protocol(&ops, &ctx);
    assert_eq!(fake.state(pid), "running", "{ctx}");
    assert_runs_on(&wl, 0, "after gpusnap recover");
}

/// A `fakegpu` process that is PID 1 of a pid namespace of its own (`unshare --pid --fork`,
/// then `setsid` so that it leads its own session and process group inside it, as a
/// container's init does); killed and reaped with the `unshare` process on drop.
struct NamespaceInit {
    unshare: std::process::Child,
    /// The init's pid in the test's (host) pid namespace.
    pid: i32,
    log: std::path::PathBuf,
}

impl NamespaceInit {
    /// `kill_child`: `unshare --kill-child`, which gives the init a parent-death signal
    /// (SIGKILL); CRIU restores it, so a restored init is killed when CRIU exits.
    fn spawn(w: &WorkDir, seed: u64, kill_child: bool) -> NamespaceInit {
        let log = w.path.join("fakegpu-init.log");
        let mut cmd = std::process::Command::new("unshare");
        cmd.args(["--pid", "--fork"]);
        if kill_child {
            cmd.arg("--kill-child");
        }
        cmd.args(["setsid", FAKEGPU, "--log"])
            .arg(&log)
            .args(["--seed", &seed.to_string()])
            .current_dir(&w.path)
            // Not a file: `unshare` reports on stderr after the dump, and CRIU refuses to restore
            // a regular file whose size changed.
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        let unshare = procs::spawn_in_new_session(&mut cmd)
            .unwrap_or_else(|e| panic!("unshare --pid --fork (util-linux) is needed: {e}"));
        let mut init = NamespaceInit {
            pid: 0,
            unshare,
            log,
        };
        let first = CounterLog::wait_for(&init.log, 3, criu_tests::harness::WAIT)
            .unwrap_or_else(|e| panic!("the namespace's init does not run: {e}"));
        assert_eq!(first.pid, 1, "the workload is not PID 1 of its namespace");
        init.pid = match procs::children(init.unshare.id() as i32).as_slice() {
            [p] => *p,
            other => panic!("unshare has children {other:?}, expected one"),
        };
        assert!(restore_thread(init.pid).is_some(), "no fakecuda-rt thread");
        init
    }
}

impl Drop for NamespaceInit {
    fn drop(&mut self) {
        procs::kill_and_reap(&[self.pid]);
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
    }
}

/// How long a failed restore of a namespace's init may take to end: the plugin kills the
/// process after a few driver calls; CRIU then only cleans up.
const FAILED_RESTORE_ENDS_WITHIN: Duration = Duration::from_secs(20);

/// The GPU process is PID 1 of a pid namespace (a container's GPU process) and its driver
/// restore fails: the plugin kills it, and `criu restore` must end with the error named, within
/// a bounded time. Killing PID 1 makes the kernel wait, in its exit, for the namespace's other
/// tasks, among them the process's own killed threads, which only their tracer (CRIU, in the
/// plugin) can reap, while CRIU waits for PID 1: without the plugin reaping them, the restore
/// hangs forever.
#[test]
fn failed_driver_restore_of_a_namespace_init_ends_promptly() {
    let Some((_, w, fake)) = setup("fake-pidns-init-restore-fails") else {
        return;
    };
    let mut init = NamespaceInit::spawn(&w, 214, true);
    let pid = init.pid;
    let dump = fake.dump(&w, pid, false, &[], &[]);
    dump.assert_ok();
    let ctx = context(&fake, &[pid], &[&dump]);
    assert_eq!(shorts(&fake.ops(pid)), ["lock:0", "checkpoint:0"], "{ctx}");
    assert_gpusnap_line(&dump, "(nspid 1)");
    let st = init.unshare.wait().unwrap();
    assert!(
        !st.success(),
        "unshare exited normally ({st}): CRIU should have killed its child"
    );
    procs::reap(pid, PROMPTLY).unwrap();
    let at_dump = CounterLog::read(&init.log).unwrap().unwrap().last();

    let log = w.images.join("restore.log");
    let mut args = w.criu_args_in("restore", &w.images, &log);
    args.push("--restore-detached".into());
    let mut env = fake.env();
    env.push(("FAKECUDA_FAIL".into(), "restore".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let t0 = std::time::Instant::now();
    let criu = w.spawn_criu(&args, &env, &log);
    let restore = criu.wait(FAILED_RESTORE_ENDS_WITHIN).unwrap_or_else(|e| {
        panic!(
            "criu restore of a namespace's init whose GPU restore failed did not end: {e}\n{}",
            fs::read_to_string(&log).unwrap_or_default()
        )
    });
    let took = t0.elapsed();
    let ctx = context(&fake, &[], &[&restore]);
    assert!(!restore.succeeded(), "the restore succeeded\n{ctx}");
    assert_gpusnap_line(&restore, "cuCheckpointProcessRestore failed");
    // The restored init's host pid, from the plugin's error line.
    let line = restore
        .gpusnap_lines_with("GPU restore failed")
        .first()
        .copied()
        .unwrap_or_else(|| panic!("no `GPU restore failed` line\n{ctx}"))
        .to_owned();
    let restored: i32 = line
        .split("gpusnap: pid ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {line:?}\n{ctx}"));
    init.pid = restored;
    let ctx = context(&fake, &[restored], &[&restore]);
    // One driver call, the restore, and it failed as injected (999). The restored init has
    // another host pid than the dumped one; the stand-in keeps the driver state in the
    // process's memory, as the real driver does, so it found the init checkpointed (not 401).
    assert_ne!(restored, pid, "the restored init kept its host pid\n{ctx}");
    let ops = fake.ops(restored);
    assert_eq!(shorts(&ops), ["restore:999"], "{ctx}");
    assert_eq!(ops[0].before.as_deref(), Some("checkpointed"), "{ctx}");
    procs::reap(restored, PROMPTLY).unwrap_or_else(|e| panic!("{e}\n{ctx}"));
    assert!(!procs::is_alive(restored), "{ctx}");
    assert_eq!(
        CounterLog::read(&init.log).unwrap().unwrap().last(),
        at_dump,
        "the process ran after its failed restore\n{ctx}"
    );
    eprintln!("criu restore failed, as it must, in {took:?}");
}

/// The GPU process is PID 1 of a pid namespace (a container's init), dumped and restored: the
/// restored init gets another host pid, and its driver restore must still find it checkpointed
/// (the stand-in keeps the state in the process's memory, as the real driver does; it used to
/// key it by host pid, and the restore of a container failed with `CUDA_ERROR_ILLEGAL_STATE`).
#[test]
fn namespace_init_restored_under_another_host_pid_runs_on() {
    let Some((_, w, fake)) = setup("fake-pidns-init-restore") else {
        return;
    };
    let mut init = NamespaceInit::spawn(&w, 215, false);
    let pid = init.pid;
    let dump = fake.dump(&w, pid, false, &[], &[]);
    dump.assert_ok();
    assert_eq!(fake.state(pid), "checkpointed");
    let _ = init.unshare.wait();
    procs::reap(pid, PROMPTLY).unwrap();
    let at_dump = CounterLog::read(&init.log).unwrap().unwrap().last();

    let log = w.images.join("restore.log");
    let pidfile = w.path.join("restored.pid");
    let mut args = w.criu_args_in("restore", &w.images, &log);
    args.push("--restore-detached".into());
    args.push("--pidfile".into());
    args.push(pidfile.display().to_string());
    let env = fake.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let restore = w.run_criu(&args, &env, &log);
    restore.assert_ok();
    let restored: i32 = fs::read_to_string(&pidfile)
        .unwrap_or_else(|e| panic!("{}: {e}", pidfile.display()))
        .trim()
        .parse()
        .unwrap();
    init.pid = restored;
    let ctx = context(&fake, &[restored], &[&restore]);
    assert_ne!(restored, pid, "the restored init kept its host pid\n{ctx}");
    let ops = fake.ops(restored);
    assert_eq!(shorts(&ops), ["restore:0", "unlock:0"], "{ctx}");
    assert_eq!(ops[0].before.as_deref(), Some("checkpointed"), "{ctx}");
    assert_ptrace_protocol(&ops, &ctx);
    assert_eq!(
        fake.state_in_memory(restored).as_deref(),
        Some("running"),
        "{ctx}\nmaps of {restored}:\n{}",
        fs::read_to_string(format!("/proc/{restored}/maps")).unwrap_or_default()
    );
    let after = CounterLog::wait_for(&init.log, at_dump + MORE_TICKS, PROMPTLY)
        .unwrap_or_else(|e| panic!("the restored init does not run on: {e}\n{ctx}"));
    after
        .verify()
        .unwrap_or_else(|e| panic!("the restored init's state is damaged: {e}\n{ctx}"));
}
