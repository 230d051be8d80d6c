//! The asynchronous `criu dump -R` (`async_leave_running`) with a real CRIU on the stand-in
//! driver: at the checkpoint the keeper copies the lent memory device to device into a snapshot
//! of its own (the stand-in's `cuMemcpyDtoD_v2`: host memory plays device memory), CRIU returns
//! without waiting for the drain, the job runs on its own memory, and a process gpusnap leaves
//! behind (the drainer) writes the image from the snapshot, the manifest last, then removes the
//! PENDING marker. `gpusnap wait` waits for it; until then every reader refuses the directory.
//!
//! The route is chosen per allocation: what fits in the share of the GPU's free memory goes into
//! the snapshot, the largest first, and the rest is drained on the pause as without the route
//! (`FAKECUDA_FREE_MIB` caps the stand-in's free memory). Both images, whole and in part,
//! restore: the job left running is killed and restored from the image, and goes on from the
//! dump with its device memory as it was then.
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
            "nothing drained on the pause",
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

/// 16 MiB lent (allocations of 6, 4 and 4 MiB and the 2 MiB counter, at the stand-in's 2 MiB
/// granularity), 17 MiB free, half of it allowed (8.5 MiB): the largest first, the 6 MiB and
/// then the counter go into the snapshot, neither 4 MiB one fits after the 6 MiB: they are
/// drained on the pause. The manifest, written last by the drainer, lists both parts' chunks.
#[test]
fn a_snapshot_that_fits_in_part_takes_what_fits_and_the_pause_drains_the_rest() {
    let Some(mut s) = start("async-R-part") else {
        return;
    };
    let before = s.vmm.last_ticks()[0];
    let dump = s.dump_with(true, &[ASYNC, ("FAKECUDA_FREE_MIB", "17")]);
    s.assert_ok(&dump);
    s.assert_line(
        &dump,
        &[
            "asynchronous -R per allocation (largest first",
            "2 into the keeper's snapshot (8.00 MiB), drained after CRIU returns",
            "2 drained on the pause (8.00 MiB), not fitting",
            "GPU 0: 17.00 MiB free, 8.50 MiB allowed, 8.00 MiB taken",
        ],
    );
    s.assert_line(
        &dump,
        &[
            "asynchronous -R: 2 allocations (8.00 MiB) copied device to device",
            "2 allocations (8.00 MiB) drained on the pause first",
        ],
    );
    s.assert_line(
        &dump,
        &[
            "2 allocations drained on the pause are written",
            "the keeper's snapshot of 2 allocations is drained after CRIU returns",
        ],
    );
    s.assert_line(&dump, &["CRIU returns now; drainer pid"]);
    assert_job_runs_on(&mut s, &dump);
    let (ok, text) = s.run_cli(&["wait", &images(&s), "--timeout", "120"]);
    assert!(ok, "gpusnap wait: {text}\n{}", s.describe(&dump));
    assert!(!has_file(&s, "-PENDING.txt"), "{:?}", s.w.image_files());
    // The manifest names every lent allocation's chunks, from both parts' data files.
    let (ok, text) = s.run_cli(&["inspect", &images(&s)]);
    assert!(ok, "gpusnap inspect: {text}");
    let (ok, text) = s.run_cli(&["verify", &images(&s)]);
    assert!(ok, "gpusnap verify after wait: {text}");
    assert_job_runs_on(&mut s, &dump);
    kill_and_restore(&mut s, before);
}

/// Each GPU has a budget of its own. Two stand-in GPUs, each with 13 MiB free (6.5 MiB
/// allowed): GPU 0 holds 4 and 4 MiB and the 2 MiB counter, GPU 1 holds 4 and 6 MiB. The
/// snapshot takes one 4 MiB allocation and the counter on GPU 0 and the 6 MiB one on GPU 1;
/// the other two are drained on the pause. The image restores on both GPUs.
#[test]
fn each_gpu_has_its_own_share() {
    let Some(mut s) = Split::two_gpus("async-R-two-gpus") else {
        return;
    };
    let before = s.vmm.last_ticks()[0];
    let dump = s.dump_with(true, &[ASYNC, ("FAKECUDA_FREE_MIB", "13")]);
    s.assert_ok(&dump);
    s.assert_line(
        &dump,
        &[
            "3 into the keeper's snapshot (12.00 MiB)",
            "2 drained on the pause (8.00 MiB)",
            "GPU 0: 13.00 MiB free, 6.50 MiB allowed, 6.00 MiB taken; GPU 1: 13.00 MiB free, 6.50 MiB allowed, 6.00 MiB taken",
        ],
    );
    assert_job_runs_on(&mut s, &dump);
    let (ok, text) = s.run_cli(&["wait", &images(&s), "--timeout", "120"]);
    assert!(ok, "gpusnap wait: {text}\n{}", s.describe(&dump));
    let (ok, text) = s.run_cli(&["verify", &images(&s)]);
    assert!(ok, "gpusnap verify after wait: {text}");
    kill_and_restore(&mut s, before);
}

#[test]
fn a_snapshot_of_which_nothing_fits_is_drained_on_the_pause() {
    let Some(mut s) = start("async-R-no-room") else {
        return;
    };
    // 2 MiB free, half of it allowed: not even the 2 MiB counter fits.
    let dump = s.dump_with(true, &[ASYNC, ("FAKECUDA_FREE_MIB", "2")]);
    s.assert_ok(&dump);
    s.assert_line(
        &dump,
        &[
            "0 into the keeper's snapshot (0.00 MiB)",
            "4 drained on the pause (16.00 MiB)",
        ],
    );
    s.assert_line(
        &dump,
        &[
            "asynchronous -R not taken: no lent allocation fits",
            "all drained on the pause",
        ],
    );
    assert_job_runs_on(&mut s, &dump);
    // The image was complete when CRIU returned.
    assert!(!has_file(&s, "-PENDING.txt"), "{:?}", s.w.image_files());
    let (ok, text) = s.run_cli(&["verify", &images(&s)]);
    assert!(ok, "{text}");
}

/// The two asynchronous routes each fault is tried on: the whole lent memory in the snapshot,
/// and part of it (`FAKECUDA_FREE_MIB=17`, as in the test above: two allocations in the
/// snapshot, two drained on the pause first).
const ROUTES: [(&str, Option<(&str, &str)>); 2] =
    [("whole", None), ("part", Some(("FAKECUDA_FREE_MIB", "17")))];

/// `config` with the route's setting.
fn on(
    route: Option<(&'static str, &'static str)>,
    config: &[(&'static str, &'static str)],
) -> Vec<(&'static str, &'static str)> {
    config.iter().copied().chain(route).collect()
}

#[test]
fn criu_killed_after_the_snapshot_leaves_the_job_running_and_the_image_refused() {
    for (name, route) in ROUTES {
        let Some(mut s) = start(&format!("async-R-kill-snapshot-{name}")) else {
            return;
        };
        let killed = s.dump_with(
            true,
            &on(
                route,
                &[ASYNC, ("GPUSNAP_TEST_KILL_CRIU_AT", "dump-snapshot-copied")],
            ),
        );
        assert!(!killed.succeeded(), "{name}: CRIU was not killed");
        s.assert_line(
            &killed,
            &["test fault", "dump-snapshot-copied", "killing CRIU now"],
        );
        // Nothing was released yet: the job runs on its own memory at once.
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert_job_runs_on(&mut s, &killed);
        assert!(
            has_file(&s, "-PENDING.txt"),
            "{name}: {:?}",
            s.w.image_files()
        );
        assert!(
            !has_file(&s, "-manifest.img"),
            "{name}: {:?}",
            s.w.image_files()
        );
        let (ok, text) = s.run_cli(&["wait", &images(&s), "--timeout", "30"]);
        assert!(
            !ok && text.contains("that is gone"),
            "{name}: gpusnap wait: {text}"
        );
        let (ok, text) = s.run_cli(&["verify", &images(&s)]);
        assert!(
            !ok && text.contains("PENDING.txt"),
            "{name}: gpusnap verify: {text}"
        );
    }
}

/// Where part was drained on the pause, its files go too: nothing of the process is left but
/// the marker.
#[test]
fn the_keeper_killed_in_the_background_drain_marks_the_image_failed() {
    for (name, route) in ROUTES {
        let Some(mut s) = start(&format!("async-R-kill-keeper-{name}")) else {
            return;
        };
        let dump = s.dump_with(
            true,
            &on(
                route,
                &[
                    ASYNC,
                    ("GPUSNAP_TEST_KILL_CRIU_AT", "async-drain-started"),
                    // Slow chunks: the keeper dies with most of the drain ahead.
                    ("GPUSNAP_STAGING_SLOTS", "2"),
                    ("GPUSNAP_STAGING_SLOT_MIB", "1"),
                ],
            ),
        );
        s.assert_ok(&dump);
        if route.is_some() {
            s.assert_line(&dump, &["2 allocations drained on the pause are written"]);
        }
        assert_job_runs_on(&mut s, &dump);
        let (ok, text) = s.run_cli(&["wait", &images(&s), "--timeout", "120"]);
        assert!(
            !ok && text.contains("NOT-A-CHECKPOINT"),
            "{name}: gpusnap wait: {text}\n{}",
            s.describe(&dump)
        );
        assert!(
            has_file(&s, "-NOT-A-CHECKPOINT.txt"),
            "{name}: {:?}",
            s.w.image_files()
        );
        // No PENDING, no manifest, no data file: the marker alone is left of the process.
        let left: Vec<String> =
            s.w.image_files()
                .into_iter()
                .filter(|f| f.starts_with("gpusnap-") && f != "gpusnap-stats.json")
                .filter(|f| !f.ends_with("-NOT-A-CHECKPOINT.txt"))
                .collect();
        assert!(left.is_empty(), "{name}: {left:?}");
        let (ok, text) = s.run_cli(&["verify", &images(&s)]);
        assert!(!ok, "{name}: gpusnap verify of a failed image: {text}");
        // The job is unaffected, still.
        assert_job_runs_on(&mut s, &dump);
    }
}

#[test]
fn the_drainer_killed_before_the_manifest_leaves_the_image_pending_and_refused() {
    for (name, route) in ROUTES {
        let Some(mut s) = start(&format!("async-R-kill-drainer-{name}")) else {
            return;
        };
        let dump = s.dump_with(
            true,
            &on(
                route,
                &[
                    ASYNC,
                    ("GPUSNAP_TEST_KILL_CRIU_AT", "async-before-manifest"),
                ],
            ),
        );
        s.assert_ok(&dump);
        assert_job_runs_on(&mut s, &dump);
        let (ok, text) = s.run_cli(&["wait", &images(&s), "--timeout", "120"]);
        assert!(
            !ok && text.contains("that is gone"),
            "{name}: gpusnap wait: {text}\n{}",
            s.describe(&dump)
        );
        assert!(
            has_file(&s, "-PENDING.txt"),
            "{name}: {:?}",
            s.w.image_files()
        );
        assert!(
            !has_file(&s, "-manifest.img"),
            "{name}: {:?}",
            s.w.image_files()
        );
        assert_job_runs_on(&mut s, &dump);
    }
}
