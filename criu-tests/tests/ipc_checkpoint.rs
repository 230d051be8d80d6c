//! Process trees that share device memory through the agent's CUDA IPC, checkpointed on the
//! split path with a real CRIU and the stand-in driver: `fakegpu-ipc export --loop` (an
//! exporter and the importer it spawned, mapping one 8 MiB allocation; the importer bumps a
//! counter in it every 20 ms, the exporter reads it) is dumped as one tree. The memory is saved
//! once, by the exporter; the importer's release unmaps its import, and once the exporter's
//! memory is back the importer maps it again at the same address before any thread runs.
//! Checked: both processes run on after `-R` and after a restore, the importer's pattern is
//! intact, and the exporter keeps seeing the importer's counter grow (they still share the
//! memory, not two copies). A dump of the importer alone is refused, naming the exporter.
//!
//! Root and CRIU are needed; `GPUSNAP_SKIP_CRIU_TESTS=1` skips.

mod common;

use common::pair::{Pair, read_log};
use std::time::Duration;

impl Pair {
    fn start(test: &str) -> Option<Pair> {
        Pair::launch(
            test,
            "fakegpu-ipc",
            &["export", "--bytes", "8388608", "--loop"],
            &[],
        )
    }
}

/// `-R` of the tree: the importer's share is unmapped for the driver's checkpoint and mapped
/// again from the exporter's memory (mapped back from the descriptors it kept) before it runs.
#[test]
fn a_sharing_tree_runs_on_after_leave_running() {
    let Some(p) = Pair::start("ipc-checkpoint-leave-running") else {
        return;
    };
    let (exporter, _) = p.pids();
    let before = p.counter();
    let dump = p.dump(exporter, true);
    p.s.assert_ok(&dump);
    p.s.assert_line(&dump, &["CUDA IPC shares, every side in this dump"]);
    p.s.assert_line(
        &dump,
        &["CUDA IPC imports mapped again from their exporters' memory"],
    );
    p.assert_shared_on(before, &dump);
}

/// Dump and restore of the tree: the exporter's memory comes back (through the keeper's
/// hand-over or the agent's load) and the importer maps it again at its old address.
#[test]
fn a_sharing_tree_is_restored_sharing_its_memory() {
    for handover in ["true", "false"] {
        let Some(mut p) = Pair::start(&format!("ipc-checkpoint-restore-{handover}")) else {
            return;
        };
        let (exporter, _) = p.pids();
        let dump = p.s.criu(
            "dump",
            "dump.log",
            &["-t", &exporter.to_string()],
            &[("GPUSNAP_HANDOVER", handover)],
        );
        p.s.assert_ok(&dump);
        let before = p.counter();
        let _ = p.exporter.wait();
        p.wait_gone();
        let restore = p.s.restore();
        p.s.assert_ok(&restore);
        p.s.assert_line(
            &restore,
            &["CUDA IPC imports mapped again from their exporters' memory"],
        );
        p.assert_shared_on(before, &restore);
        p.kill_pair();
    }
}

/// The importer alone is not a dump that can carry its share: refused, naming the exporter, and
/// the pair runs on.
#[test]
fn a_dump_of_the_importer_alone_is_refused() {
    let Some(p) = Pair::start("ipc-checkpoint-importer-alone") else {
        return;
    };
    let (exporter, importer) = p.pids();
    let before = p.counter();
    let dump = p.dump(importer, true);
    assert!(!dump.succeeded(), "{}", p.s.describe(&dump));
    p.s.assert_line(
        &dump,
        &[
            &format!("maps device memory of pid {exporter}"),
            "is not in this dump",
        ],
    );
    p.assert_shared_on(before, &dump);
}

/// Whether the side's log stays still for `for_ms` (it is held), and the process is stopped.
fn held(p: &Pair, which: &str, pid: i32, for_ms: u64) -> bool {
    let before = read_log(&p.side(which)).1.len();
    std::thread::sleep(Duration::from_millis(for_ms));
    let after = read_log(&p.side(which)).1.len();
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|t| t.rsplit(')').next().map(|r| r.trim().chars().next()))
        .flatten();
    after == before && matches!(state, Some('T' | 't'))
}

/// CRIU killed in a rollback after the exporter is back and before the importer maps its share
/// again: the exporter runs on, the importer is held (it never runs without the share), and
/// `gpusnap recover` maps the share again from the running exporter; both run on, still sharing.
#[test]
fn criu_killed_before_an_importer_maps_its_share_again_leaves_it_held_and_recoverable() {
    let Some(p) = Pair::start("ipc-checkpoint-kill-rollback") else {
        return;
    };
    let (exporter, importer) = p.pids();
    let before = p.counter();
    let exp = exporter.to_string();
    let dump = p.s.criu(
        "dump",
        "dump.log",
        &["-t", &exp, "--leave-running"],
        &[("GPUSNAP_TEST_KILL_CRIU_AT", "rollback-reimport")],
    );
    assert!(!dump.succeeded(), "{}", p.s.describe(&dump));
    p.s.assert_line(&dump, &["GPUSNAP_TEST_KILL_CRIU_AT=rollback-reimport"]);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        held(&p, "importer", importer, 400),
        "the importer ran (or is not stopped) after CRIU died\n{}\n{}",
        p.s.describe(&dump),
        p.describe()
    );
    // The exporter runs on meanwhile (its rollback was complete).
    p.wait_exporter_ticks(3);
    let (ok, out) = p.s.run_cli(&[
        "recover",
        &importer.to_string(),
        "--images",
        p.s.w.images.to_str().expect("utf-8"),
    ]);
    assert!(
        ok,
        "gpusnap recover of the importer failed:\n{out}\n{}",
        p.describe()
    );
    assert!(out.contains("CUDA IPC shares mapped again"), "{out}");
    p.assert_shared_on(before, &dump);
}

/// CRIU killed in a restore after every process's own memory is back and before the importer
/// maps its share again: nothing of the tree runs (the kernel kills the half-restored
/// processes), and a new restore brings both back, still sharing.
#[test]
fn criu_killed_before_a_restored_importer_maps_its_share_again_runs_nothing() {
    if let Some(p) = Pair::start("ipc-checkpoint-kill-restore") {
        p.killed_restore_runs_nothing_and_a_second_restore_shares();
    }
}
