//! Process trees that share device memory through shareable handles the program made itself
//! (`cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle`, POSIX fds), checkpointed
//! on the split path with a real CRIU and the stand-in driver: `fakegpu-share export --loop`
//! (an exporter of one 8 MiB `cuMemCreate` allocation and the importer it spawned; the importer
//! bumps a counter in it every 20 ms, the exporter reads it), in both ways of passing the fd:
//! `scm` (`SCM_RIGHTS`, both sides close their fds) and `pidfd` (the exporter keeps its fd, the
//! importer takes it with `pidfd_getfd`, as PyTorch does). The plugin finds the import's export
//! with `kcmp`; the memory is saved once, by the exporter; the importer's release unmaps it and
//! a reimport maps the exporter's current memory at the same place before any thread runs.
//! Checked: both run on after `-R` and after a restore, bit-exact and still sharing (the
//! exporter sees the importer's counter grow); in `pidfd` mode the exporter's own fd names the
//! memory they share afterwards (the importer takes it again and compares); a dump of the
//! importer alone is refused naming the exporter, of the exporter alone refused; a descriptor
//! of the export held by the importer, or by a process without CUDA, is refused; CRIU killed
//! at the reimport points and before a rolled-back exporter's fd names its memory again
//! (`rollback-repoint`).
//!
//! Root and CRIU are needed; `GPUSNAP_SKIP_CRIU_TESTS=1` skips.

mod common;

use common::pair::{Pair, read_log};
use std::time::{Duration, Instant};

impl Pair {
    fn start(test: &str, pass: &str) -> Option<Pair> {
        Self::start_with(test, pass, &[])
    }

    fn start_with(test: &str, pass: &str, extra: &[&str]) -> Option<Pair> {
        Pair::launch(
            test,
            "fakegpu-share",
            &["export", "--bytes", "8388608", "--pass", pass, "--loop"],
            extra,
        )
    }
}

impl Pair {
    /// The importer takes the exporter's fd again (`pidfd` mode) and compares what it maps
    /// with its own mapping: true when they are the same memory.
    fn refetch_same(&self) -> bool {
        let trigger = self.log.with_extension("refetch");
        std::fs::write(&trigger, "").expect("refetch trigger");
        let deadline = Instant::now() + Duration::from_secs(20);
        while trigger.exists() {
            assert!(
                Instant::now() < deadline,
                "the importer did not take the fd again\n{}",
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let text = std::fs::read_to_string(self.side("importer")).unwrap_or_default();
        let last = text
            .lines()
            .rfind(|l| l.starts_with("refetch"))
            .unwrap_or("none")
            .to_owned();
        assert!(
            last.starts_with("refetch same"),
            "{last}\n{}",
            self.describe()
        );
        last == "refetch same 1"
    }

    /// The exporter exports its handle again (a new fd), imports it itself and compares what it
    /// maps with its own mapping: true when they are the same memory. After a hand-over the
    /// handle maps imported memory, which the driver will not export again; the program's
    /// export must work all the same. (The new export is imported by no one: a later dump of
    /// the tree is refused, so this comes last.)
    fn reexport_same(&self) -> bool {
        let trigger = self.log.with_extension("reexport");
        std::fs::write(&trigger, "").expect("reexport trigger");
        let deadline = Instant::now() + Duration::from_secs(20);
        while trigger.exists() {
            assert!(
                Instant::now() < deadline,
                "the exporter did not export again\n{}",
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let text = std::fs::read_to_string(self.side("exporter")).unwrap_or_default();
        let last = text
            .lines()
            .rfind(|l| l.starts_with("reexport"))
            .unwrap_or("none")
            .to_owned();
        assert!(
            last.starts_with("reexport same"),
            "{last}\n{}",
            self.describe()
        );
        last == "reexport same 1"
    }
}

const PASSES: [&str; 2] = ["scm", "pidfd"];

/// `-R` of the tree, both ways of passing the fd: the importer's mapping is unmapped for the
/// driver's checkpoint and mapped again from the exporter's memory before it runs.
#[test]
fn a_shareable_tree_runs_on_after_leave_running() {
    let configs: [(&str, &[&str]); 3] = [
        ("scm", &[]),
        ("pidfd", &[]),
        // The importer releases its handle once mapped: the mapping alone holds the memory.
        ("scm", &["--importer-releases-handle"]),
    ];
    for (i, (pass, extra)) in configs.into_iter().enumerate() {
        let Some(p) = Pair::start_with(&format!("shareable-leave-running-{pass}-{i}"), pass, extra)
        else {
            return;
        };
        let (exporter, _) = p.pids();
        let before = p.counter();
        let dump = p.dump(exporter, true);
        p.s.assert_ok(&dump);
        p.s.assert_line(
            &dump,
            &["imports of shareable handles resolved to their exporters"],
        );
        p.s.assert_line(
            &dump,
            &["CUDA IPC imports mapped again from their exporters' memory"],
        );
        p.assert_shared_on(before, &dump);
        if pass == "pidfd" {
            assert!(
                p.refetch_same(),
                "after -R the exporter's own fd names other memory\n{}",
                p.describe()
            );
        }
        // Again: the import is known by its exporter now, the exporter's descriptors are of
        // the memory the first rollback brought back.
        let before = p.counter();
        let again = p.s.criu(
            "dump",
            "dump-again.log",
            &["-t", &exporter.to_string(), "--leave-running"],
            &[],
        );
        p.s.assert_ok(&again);
        p.s.assert_line(
            &again,
            &["CUDA IPC imports mapped again from their exporters' memory"],
        );
        p.assert_shared_on(before, &again);
        assert!(
            p.reexport_same(),
            "after two -R the exporter's new export names other memory\n{}",
            p.describe()
        );
    }
}

/// Dump and restore of the tree (hand-over and agent load): the exporter's memory comes back,
/// the importer maps it again at its old place, and in `pidfd` mode the exporter's own fd
/// names that memory.
#[test]
fn a_shareable_tree_is_restored_sharing_its_memory() {
    for pass in PASSES {
        for handover in ["true", "false"] {
            let Some(mut p) = Pair::start(&format!("shareable-restore-{pass}-{handover}"), pass)
            else {
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
            if pass == "pidfd" {
                assert!(
                    p.refetch_same(),
                    "after the restore the exporter's own fd names other memory\n{}",
                    p.describe()
                );
            }
            // The restored tree is dumped again (-R), still sharing after it.
            let before = p.counter();
            let (exporter, _) = p.pids();
            let again = p.s.criu(
                "dump",
                "dump-again.log",
                &["-t", &exporter.to_string(), "--leave-running"],
                &[],
            );
            p.s.assert_ok(&again);
            p.assert_shared_on(before, &again);
            assert!(
                p.reexport_same(),
                "after the restore the exporter's new export names other memory\n{}",
                p.describe()
            );
            p.kill_pair();
        }
    }
}

/// The importer alone: refused, naming the exporter (found holding the export's open file),
/// and the pair runs on.
#[test]
fn a_dump_of_the_importer_alone_is_refused_naming_the_exporter() {
    for pass in PASSES {
        let Some(p) = Pair::start(&format!("shareable-importer-alone-{pass}"), pass) else {
            return;
        };
        let (exporter, importer) = p.pids();
        let before = p.counter();
        let dump = p.dump(importer, true);
        assert!(!dump.succeeded(), "{}", p.s.describe(&dump));
        p.s.assert_line(
            &dump,
            &[
                &format!("pid {importer} imported device memory"),
                &format!("that pid {exporter} exported, and pid {exporter} is not in this dump"),
            ],
        );
        p.assert_shared_on(before, &dump);
    }
}

/// Near its descriptor limit (a soft `RLIMIT_NOFILE` of 36, a margin of 32 kept free) the agent
/// keeps no copy of an export or an import, so the program gets exactly the descriptors it
/// would get without the agent; such shares are not carried: the dump is refused naming them,
/// and the pair runs on sharing. 36 is the margin plus the four descriptors every process has
/// when the agent counts (the three standard ones and the listing's own): the count at the
/// moment of the export depends on how far the program's start-up got (a limit of 40 let a copy
/// be kept once in CI), so only a limit no start-up can get under makes this test decide.
#[test]
fn near_the_descriptor_limit_the_agent_keeps_no_copies_and_refuses() {
    let Some(p) = Pair::launch_with_nofile(
        "shareable-nofile",
        "fakegpu-share",
        &["export", "--bytes", "8388608", "--pass", "scm", "--loop"],
        &[],
        Some(36),
    ) else {
        return;
    };
    let (exporter, _) = p.pids();
    let before = p.counter();
    let dump = p.dump(exporter, true);
    assert!(!dump.succeeded(), "{}", p.s.describe(&dump));
    p.s.assert_line(
        &dump,
        &["device memory exported to other processes (CUDA IPC handles)"],
    );
    p.assert_shared_on(before, &dump);
}

/// The exporter without its importer (started outside the exporter's tree): refused, since an
/// importer outside the dump cannot be seen, and the pair runs on.
#[test]
fn a_dump_of_the_exporter_without_its_importer_is_refused() {
    for pass in PASSES {
        let Some(p) = Pair::start_with(
            &format!("shareable-exporter-alone-{pass}"),
            pass,
            &["--detach-importer"],
        ) else {
            return;
        };
        let (exporter, _) = p.pids();
        let before = p.counter();
        let dump = p.dump(exporter, true);
        assert!(!dump.succeeded(), "{}", p.s.describe(&dump));
        p.s.assert_line(
            &dump,
            &[&format!(
                "pid {exporter} exported device memory (cuMemExportToShareableHandle) that no process of this dump imported"
            )],
        );
        p.assert_shared_on(before, &dump);
    }
}

/// A descriptor of the export held by the importer after its import: not carried (after a
/// restore it would name other memory), refused naming it; the pair runs on.
#[test]
fn an_export_descriptor_held_by_the_importer_is_refused() {
    let Some(p) = Pair::start_with(
        "shareable-importer-keeps-fd",
        "scm",
        &["--importer-keeps-fd"],
    ) else {
        return;
    };
    let (exporter, importer) = p.pids();
    let before = p.counter();
    let dump = p.dump(exporter, true);
    assert!(!dump.succeeded(), "{}", p.s.describe(&dump));
    p.s.assert_line(
        &dump,
        &[
            &format!("pid {importer} holds fd"),
            &format!("a descriptor of device memory pid {exporter} exported"),
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
    let Some(p) = Pair::start("shareable-kill-rollback", "pidfd") else {
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
    assert!(
        p.refetch_same(),
        "the exporter's own fd names other memory after the rollback\n{}",
        p.describe()
    );
    // The recovered tree is dumped again: the recover's read-only ShareFds of the running
    // exporter left its descriptors as they were (its own fd is still its agent's duplicate).
    let before = p.counter();
    let again = p.s.criu(
        "dump",
        "dump-again.log",
        &["-t", &exp, "--leave-running"],
        &[],
    );
    p.s.assert_ok(&again);
    p.assert_shared_on(before, &again);
    assert!(
        p.refetch_same(),
        "the exporter's own fd names other memory after the second rollback\n{}",
        p.describe()
    );
}

/// A process without CUDA in the dump (it would pass the fd on) holding a copy of the
/// exported fd: refused naming it, as its copy would name no memory after a restore; the pair
/// runs on.
#[test]
fn an_export_descriptor_held_by_a_process_without_cuda_is_refused() {
    let Some(p) = Pair::start_with("shareable-middleman", "scm", &["--middleman"]) else {
        return;
    };
    let middleman: i32 = std::fs::read_to_string(p.log.with_extension("middleman"))
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .expect("the middleman's pid");
    let (exporter, _) = p.pids();
    let before = p.counter();
    let dump = p.dump(exporter, true);
    // SAFETY: kill(2) of the test's own workload.
    unsafe { libc::kill(middleman, libc::SIGKILL) };
    assert!(!dump.succeeded(), "{}", p.s.describe(&dump));
    p.s.assert_line(
        &dump,
        &[
            &format!("pid {middleman} holds fd"),
            &format!("a descriptor of device memory pid {exporter} exported"),
        ],
    );
    p.assert_shared_on(before, &dump);
}

/// CRIU killed in a rollback after the exporter's memory is back and before its agent puts it
/// under the program's fd: neither side runs (the exporter never runs with an fd of the old
/// memory, the importer is not rolled back yet), and `gpusnap recover` of the exporter, then of
/// the importer, brings both back sharing, the exporter's fd naming the shared memory.
#[test]
fn criu_killed_before_an_exporter_s_fd_names_its_memory_again_leaves_both_held_and_recoverable() {
    let Some(p) = Pair::start("shareable-kill-repoint", "pidfd") else {
        return;
    };
    let (exporter, importer) = p.pids();
    let before = p.counter();
    let exp = exporter.to_string();
    let dump = p.s.criu(
        "dump",
        "dump.log",
        &["-t", &exp, "--leave-running"],
        &[("GPUSNAP_TEST_KILL_CRIU_AT", "rollback-repoint")],
    );
    assert!(!dump.succeeded(), "{}", p.s.describe(&dump));
    p.s.assert_line(&dump, &["GPUSNAP_TEST_KILL_CRIU_AT=rollback-repoint"]);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        held(&p, "exporter", exporter, 400),
        "the exporter ran (or is not stopped) after CRIU died\n{}\n{}",
        p.s.describe(&dump),
        p.describe()
    );
    // The importer is not rolled back yet: locked by the driver (its CUDA calls wait), so it
    // logs no tick.
    let ticks = read_log(&p.side("importer")).1.len();
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(
        read_log(&p.side("importer")).1.len(),
        ticks,
        "the importer ticked after CRIU died\n{}\n{}",
        p.s.describe(&dump),
        p.describe()
    );
    let images = p.s.w.images.to_str().expect("utf-8").to_owned();
    for pid in [exporter, importer] {
        let (ok, out) =
            p.s.run_cli(&["recover", &pid.to_string(), "--images", &images]);
        assert!(
            ok,
            "gpusnap recover of pid {pid} failed:\n{out}\n{}",
            p.describe()
        );
    }
    p.assert_shared_on(before, &dump);
    assert!(
        p.refetch_same(),
        "the exporter's own fd names other memory after the recover\n{}",
        p.describe()
    );
}

/// CRIU killed in a restore after every process's own memory is back and before the importer
/// maps its share again: nothing of the tree runs (the kernel kills the half-restored
/// processes), and a new restore brings both back, still sharing.
#[test]
fn criu_killed_before_a_restored_importer_maps_its_share_again_runs_nothing() {
    if let Some(p) = Pair::start("shareable-kill-restore", "scm") {
        p.killed_restore_runs_nothing_and_a_second_restore_shares();
    }
}
