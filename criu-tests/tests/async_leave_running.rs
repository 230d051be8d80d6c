//! The asynchronous `criu dump -R` (`async_leave_running`) with a real CRIU on the stand-in
//! driver: at the checkpoint the keeper copies the lent memory device to device into a snapshot
//! of its own (the stand-in's `cuMemcpyDtoD_v2`: host memory plays device memory), CRIU returns
//! without waiting for the drain, the job runs on its own memory, and a process gpusnap leaves
//! behind (the drainer) writes the image from the snapshot, the manifest last, then removes the
//! PENDING marker. `gpusnap wait` waits for it; until then every reader refuses the directory.
//!
//! The image restores: the job left running is killed and restored from it, and goes on from
//! the dump with its device memory as it was then.
//!
//! The fail-closed cells (`fault::ASYNC_POINTS`): CRIU killed after the snapshot (the job runs
//! on, the image stays PENDING and is refused, `wait` fails); the keeper killed during the
//! background drain (the job runs on, the image is marked NOT-A-CHECKPOINT with the cause); the
//! drainer killed before the manifest (the job runs on, PENDING stays, `wait` fails).
//!
//! Root and CRIU are needed; `GPUSNAP_SKIP_CRIU_TESTS=1` skips.

mod common;

use common::MORE_TICKS;
use common::split::Split;
use criu_tests::CriuRun;
use std::fs;

const ASYNC: (&str, &str) = ("GPUSNAP_ASYNC_LEAVE_RUNNING", "1");

fn start(test: &str) -> Option<Split> {
    Split::launch(
        test,
        1,
        &["--seed", "13", "--allocs", "3", "--mib", "4"],
        &[],
    )
}

fn images(s: &Split) -> String {
    s.w.images.to_str().expect("utf-8").to_owned()
}

fn has_file(s: &Split, suffix: &str) -> bool {
    s.w.image_files().iter().any(|f| f.ends_with(suffix))
}

/// The job a `-R` left running goes on, its memory intact.
fn assert_job_runs_on(s: &mut Split, run: &CriuRun) {
    assert!(s.vmm.original_running(), "{}", s.describe(run));
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, run);
}

/// The job a `-R` left running is killed and the image restored. The restored job goes on from
/// the dump: its first tick follows the one the dump caught (after `before`, at most one past
/// the last the job wrote before it was killed), and every tick is `ok 1` with the device
/// counter equal to it, so the device memory restored is the memory at the dump, bit for bit
/// as the job checks it (its patterns and its counter), whichever part each allocation was in.
fn kill_and_restore(s: &mut Split, before: u64) {
    let pid = s.vmm.pid();
    for &p in &s.vmm.pids {
        // SAFETY: kill(2) of the test's own workload.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    let last = s.reap_dumped()[0];
    // The driver state the stand-in keeps in a file plays the one inside the process image,
    // which the dump caught checkpointed (the rollback of `-R` made the file say running).
    fs::write(s.state.join(format!("{pid}.state")), "checkpointed\n").expect("driver state");
    // The tick log keeps its header: the restored job appends its ticks from the dump on.
    let log = &s.vmm.logs[0];
    let text = fs::read_to_string(log).expect("tick log");
    let header = text.lines().next().expect("the log's header");
    fs::write(log, format!("{header}\n")).expect("rewrite the tick log");
    let restore = s.restore();
    s.assert_ok(&restore);
    let first = s.vmm.wait_for_tick(before + 1)[0].ticks[0].tick;
    assert!(
        before < first && first <= last + 1,
        "the restored job's first tick {first}: the dump was after tick {before}, the job ran to {last}\n{}",
        s.describe(&restore)
    );
    let logs = s.vmm.wait_for_tick(first + MORE_TICKS);
    for (i, t) in logs[0].ticks.iter().enumerate() {
        assert!(
            t.tick == first + i as u64 && t.ok && t.counter == t.tick,
            "after the restore, tick {i} from {first}: {t:?}\n{}",
            s.describe(&restore)
        );
    }
}

#[test]
fn an_asynchronous_leave_running_is_pending_then_complete_and_restores() {
    let Some(mut s) = start("async-R") else {
        return;
    };
    let before = s.vmm.last_ticks()[0];
    let dump = s.dump_with(true, &[ASYNC]);
    s.assert_ok(&dump);
    s.assert_line(
        &dump,
        &[
            "asynchronous -R: 4 allocations",
            "copied device to device into the keeper's snapshot",
        ],
    );
    s.assert_line(&dump, &["CRIU returns now; drainer pid"]);
    s.assert_line(&dump, &["mapped back from the descriptors it kept"]);
    assert_job_runs_on(&mut s, &dump);
    let (ok, text) = s.run_cli(&["wait", &images(&s), "--timeout", "120"]);
    assert!(ok, "gpusnap wait: {text}\n{}", s.describe(&dump));
    assert!(text.contains("complete"), "{text}");
    assert!(!has_file(&s, "-PENDING.txt"), "{:?}", s.w.image_files());
    assert!(has_file(&s, "-manifest.img"), "{:?}", s.w.image_files());
    let (ok, text) = s.run_cli(&["verify", &images(&s)]);
    assert!(ok, "gpusnap verify after wait: {text}");
    // The job ran on meanwhile, its memory intact.
    assert_job_runs_on(&mut s, &dump);
    kill_and_restore(&mut s, before);
}

#[test]
fn a_snapshot_that_does_not_fit_is_drained_on_the_pause() {
    let Some(mut s) = start("async-R-no-room") else {
        return;
    };
    // 12 MiB lent, 10 MiB free, half of it allowed.
    let dump = s.dump_with(true, &[ASYNC, ("FAKECUDA_FREE_MIB", "10")]);
    s.assert_ok(&dump);
    s.assert_line(
        &dump,
        &[
            "asynchronous -R not taken: the snapshot needs",
            "drained on the pause",
        ],
    );
    assert_job_runs_on(&mut s, &dump);
    // The image was complete when CRIU returned.
    assert!(!has_file(&s, "-PENDING.txt"), "{:?}", s.w.image_files());
    let (ok, text) = s.run_cli(&["verify", &images(&s)]);
    assert!(ok, "{text}");
}

#[test]
fn criu_killed_after_the_snapshot_leaves_the_job_running_and_the_image_refused() {
    let Some(mut s) = start("async-R-kill-snapshot") else {
        return;
    };
    let killed = s.dump_with(
        true,
        &[ASYNC, ("GPUSNAP_TEST_KILL_CRIU_AT", "dump-snapshot-copied")],
    );
    assert!(!killed.succeeded(), "CRIU was not killed");
    s.assert_line(
        &killed,
        &["test fault", "dump-snapshot-copied", "killing CRIU now"],
    );
    // Nothing was released yet: the job runs on its own memory at once.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_job_runs_on(&mut s, &killed);
    assert!(has_file(&s, "-PENDING.txt"), "{:?}", s.w.image_files());
    assert!(!has_file(&s, "-manifest.img"), "{:?}", s.w.image_files());
    let (ok, text) = s.run_cli(&["wait", &images(&s), "--timeout", "30"]);
    assert!(!ok && text.contains("that is gone"), "gpusnap wait: {text}");
    let (ok, text) = s.run_cli(&["verify", &images(&s)]);
    assert!(
        !ok && text.contains("PENDING.txt"),
        "gpusnap verify: {text}"
    );
}

#[test]
fn the_keeper_killed_in_the_background_drain_marks_the_image_failed() {
    let Some(mut s) = start("async-R-kill-keeper") else {
        return;
    };
    let dump = s.dump_with(
        true,
        &[
            ASYNC,
            ("GPUSNAP_TEST_KILL_CRIU_AT", "async-drain-started"),
            // Slow chunks: the keeper dies with most of the drain ahead.
            ("GPUSNAP_STAGING_SLOTS", "2"),
            ("GPUSNAP_STAGING_SLOT_MIB", "1"),
        ],
    );
    s.assert_ok(&dump);
    assert_job_runs_on(&mut s, &dump);
    let (ok, text) = s.run_cli(&["wait", &images(&s), "--timeout", "120"]);
    assert!(
        !ok && text.contains("NOT-A-CHECKPOINT"),
        "gpusnap wait: {text}\n{}",
        s.describe(&dump)
    );
    assert!(
        has_file(&s, "-NOT-A-CHECKPOINT.txt"),
        "{:?}",
        s.w.image_files()
    );
    assert!(!has_file(&s, "-PENDING.txt"), "{:?}", s.w.image_files());
    assert!(!has_file(&s, "-manifest.img"), "{:?}", s.w.image_files());
    let (ok, text) = s.run_cli(&["verify", &images(&s)]);
    assert!(!ok, "gpusnap verify of a failed image: {text}");
    // The job is unaffected, still.
    assert_job_runs_on(&mut s, &dump);
}

#[test]
fn the_drainer_killed_before_the_manifest_leaves_the_image_pending_and_refused() {
    let Some(mut s) = start("async-R-kill-drainer") else {
        return;
    };
    let dump = s.dump_with(
        true,
        &[
            ASYNC,
            ("GPUSNAP_TEST_KILL_CRIU_AT", "async-before-manifest"),
        ],
    );
    s.assert_ok(&dump);
    assert_job_runs_on(&mut s, &dump);
    let (ok, text) = s.run_cli(&["wait", &images(&s), "--timeout", "120"]);
    assert!(
        !ok && text.contains("that is gone"),
        "gpusnap wait: {text}\n{}",
        s.describe(&dump)
    );
    assert!(has_file(&s, "-PENDING.txt"), "{:?}", s.w.image_files());
    assert!(!has_file(&s, "-manifest.img"), "{:?}", s.w.image_files());
    assert_job_runs_on(&mut s, &dump);
}
