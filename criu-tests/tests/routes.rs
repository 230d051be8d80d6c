//! Routes per allocation, with a real CRIU on the stand-in driver: a job with allocations the
//! agent can lend (its converted `cuMemAlloc`s, created exportable) and one it cannot (the
//! workload's own `cuMemCreate` handle of compressible memory, which a keeper does not make,
//! mapped whole: `--app-vmm --app-vmm-compressed`) lends the first to the keeper
//! and copies the other out first, before the driver checkpoint. The image records which was
//! lent; a restore (the job's agent loads all of it: a mixed image is not handed over at restore)
//! and `-R` (the lent ones mapped back from the kept descriptors, the copied one reloaded) run on
//! bit-exact; CRIU killed after the lend or after the release leaves the job running, or held
//! and brought back by `gpusnap recover --images`.
//!
//! Root and CRIU are needed; `GPUSNAP_SKIP_CRIU_TESTS=1` skips.

mod common;

use common::split::Split;
use criu_tests::CriuRun;
use std::time::Duration;

/// 3 data allocations and the counter (converted, exportable on the stand-in) and the
/// workload's own 2 MiB `cuMemCreate` mapping of compressible memory (copied first).
const LENDABLE: usize = 4;
const COPIED_FIRST: usize = 1;

fn start(test: &str) -> Option<Split> {
    Split::launch(
        test,
        1,
        &[
            "--seed",
            "23",
            "--allocs",
            "3",
            "--mib",
            "4",
            "--app-vmm",
            "--app-vmm-compressed",
        ],
        &[],
    )
}

/// The numbers of the routes line the dump logged at PAUSE: (lent, copied first).
fn routes_at_pause(s: &Split, dump: &CriuRun) -> (usize, usize) {
    routes_in(s, dump, false)
}

/// The routes the dump took: its last routes line (the checkpoint logs them again if the
/// allocations changed since PAUSE, as a workload that re-maps its handle every tick may have
/// been seized between the unmap and the map).
fn routes_taken(s: &Split, dump: &CriuRun) -> (usize, usize) {
    routes_in(s, dump, true)
}

fn routes_in(s: &Split, dump: &CriuRun, last: bool) -> (usize, usize) {
    let lines = dump.gpusnap_lines();
    let mut routes = lines.into_iter().filter(|l| l.contains("routes: "));
    let line = if last {
        routes.next_back()
    } else {
        routes.next()
    }
    .unwrap_or_else(|| panic!("no routes line\n{}", s.describe(dump)));
    let after = line.split("routes: ").nth(1).expect("routes: ...");
    // "A lent, B copied first, C left to the driver; ..."
    let num = |what: &str| -> usize {
        after
            .split([',', ';'])
            .find_map(|p| p.trim().strip_suffix(what))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no count of {what:?} in {line}"))
    };
    (num(" lent"), num(" copied first"))
}

/// The lines of a mixed dump: routes per reason at PAUSE, the lend of exactly the exportable
/// ones, the copy-first of the other, the drain.
fn assert_mixed(s: &Split, dump: &CriuRun) {
    assert_eq!(
        routes_at_pause(s, dump),
        (LENDABLE, COPIED_FIRST),
        "{}",
        s.describe(dump)
    );
    s.assert_line(
        dump,
        &[
            &format!("{LENDABLE} lend (created exportable): #"),
            "copy first (the application's own cuMemCreate handle, with properties a keeper cannot make again)",
        ],
    );
    s.assert_line(
        dump,
        &[&format!("{LENDABLE} allocations ("), "lent to keeper pid"],
    );
    s.assert_line(
        dump,
        &[
            &format!("{COPIED_FIRST} allocations ("),
            "copied out first, before the driver checkpoint",
        ],
    );
    s.assert_line(dump, &["drain started"]);
    assert!(
        !dump
            .gpusnap_lines()
            .iter()
            .any(|l| l.contains("hand-over failed")),
        "the hand-over fell back\n{}",
        s.describe(dump)
    );
}

fn manifest(s: &Split) -> gpusnap_image::Manifest {
    let dir = std::fs::File::open(&s.w.images).expect("open image dir");
    gpusnap_image::read_manifest(
        std::os::fd::AsFd::as_fd(&dir),
        gpusnap_proto::pid::NsPid(s.vmm.pid() as u32),
    )
    .expect("the dump's manifest")
}

/// The image records each allocation's route.
fn assert_recorded(s: &Split) {
    let m = manifest(s);
    let lent = m.allocations.iter().filter(|a| a.lent).count();
    let copied = m.allocations.iter().filter(|a| a.moved && !a.lent).count();
    assert_eq!((lent, copied), (LENDABLE, COPIED_FIRST), "{m:?}");
}

#[test]
fn a_mixed_job_lends_what_it_can_and_copies_the_rest_first() {
    let Some(mut s) = start("routes-mixed-dump-restore") else {
        return;
    };
    let dump = s.dump(false);
    s.assert_ok(&dump);
    assert_mixed(&s, &dump);
    s.assert_line(&dump, &["the drain ran", "beside CRIU's dump"]);
    s.assert_line(
        &dump,
        &[&format!(
            "the image holds {LENDABLE} lent and {COPIED_FIRST} copied-first allocations"
        )],
    );
    assert_recorded(&s);
    let last = s.reap_dumped();
    let restore = s.restore();
    s.assert_ok(&restore);
    // Restore of a mixed image: the job's agent loads all of it (not handed over).
    s.assert_line(&restore, &["not every allocation was lent"]);
    s.assert_runs_on(&last, &restore);
}

#[test]
fn a_mixed_job_runs_on_after_leave_running() {
    let Some(mut s) = start("routes-mixed-R") else {
        return;
    };
    let dump = s.dump(true);
    s.assert_ok(&dump);
    assert_mixed(&s, &dump);
    s.assert_line(
        &dump,
        &[
            &format!("mapped back from the descriptors it kept ({LENDABLE} allocations"),
            "no file read",
        ],
    );
    s.assert_line(
        &dump,
        &["device data reloaded", "the allocations copied out first"],
    );
    assert!(s.vmm.original_running(), "{}", s.describe(&dump));
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, &dump);
    assert_recorded(&s);
}

#[test]
fn criu_killed_in_a_mixed_hand_over_leaves_the_job_recoverable() {
    for (point, held) in [
        ("dump-lent", false),
        ("dump-released", true),
        ("dump-relocked", true),
        ("dump-checkpointed", true),
    ] {
        let Some(s) = start(&format!("routes-kill-{point}")) else {
            return;
        };
        let killed = s.dump_with(false, &[("GPUSNAP_TEST_KILL_CRIU_AT", point)]);
        assert!(!killed.succeeded(), "CRIU was not killed at {point}");
        s.assert_line(&killed, &["test fault", point, "killing CRIU now"]);
        std::thread::sleep(Duration::from_millis(300));
        let before = s.vmm.last_ticks();
        std::thread::sleep(Duration::from_millis(700));
        let moved = s.vmm.last_ticks() != before;
        assert_eq!(
            moved,
            !held,
            "CRIU killed at {point}: the job {}\n{}",
            if moved { "runs" } else { "is held" },
            s.describe(&killed)
        );
        if moved {
            s.assert_runs_on(&before, &killed);
            continue;
        }
        let pid = s.vmm.pid().to_string();
        let images = s.w.images.to_str().expect("utf-8").to_owned();
        if point != "dump-relocked" {
            // With the image: the lent memory mapped back, the copied part reloaded, at once.
            let (ok, text) = s.run_cli(&["recover", &pid, "--images", &images]);
            assert!(
                ok && text.contains("mapped back") && text.contains("copied part reloaded"),
                "CRIU killed at {point}: gpusnap recover --images failed: {text}\n{}",
                s.describe(&killed)
            );
            eprintln!("CRIU killed at {point}: {text}");
            s.assert_runs_on(&before, &killed);
            continue;
        }
        // Without the image the copied part cannot come back: the lent memory is mapped back,
        // and the job stays held.
        let (ok, text) = s.run_cli(&["recover", &pid]);
        assert!(
            !ok,
            "CRIU killed at {point}: recover without images succeeded: {text}"
        );
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(
            s.vmm.last_ticks(),
            before,
            "CRIU killed at {point}: the job ran after a recover without its copied part: {text}\n{}",
            s.describe(&killed)
        );
        let (ok, text) = s.run_cli(&["recover", &pid, "--images", &images]);
        assert!(
            ok && text.contains("reloaded"),
            "CRIU killed at {point}: gpusnap recover --images failed: {text}\n{}",
            s.describe(&killed)
        );
        eprintln!("CRIU killed at {point}: {text}");
        s.assert_runs_on(&before, &killed);
    }
}

/// The workload's own 2 MiB `cuMemCreate` handle of plain device memory (remapped every tick),
/// beside 2 data allocations and the counter.
fn start_plain(test: &str) -> Option<Split> {
    Split::launch(
        test,
        1,
        &[
            "--seed",
            "29",
            "--allocs",
            "2",
            "--mib",
            "4",
            "--app-vmm",
            "--app-vmm-remap",
        ],
        &[],
    )
}

/// Plain device memory the application made itself is created exportable by the agent (the
/// workload checks that its handle still cannot be exported, as it asked), so all of it is
/// lent; the restore hands everything over through the keeper, and the workload's handle value
/// still maps its memory afterwards.
#[test]
fn a_plain_application_handle_is_lent_and_handed_over_at_restore() {
    let Some(mut s) = start_plain("routes-app-lent") else {
        return;
    };
    let dump = s.dump(false);
    s.assert_ok(&dump);
    // Nothing copied first; the workload's own mapping lent with the rest (unless the dump
    // seized it between its unmap and its map: then it is not listed at all).
    let (lent, copied) = routes_taken(&s, &dump);
    assert!(
        copied == 0 && (3..=4).contains(&lent),
        "routes ({lent}, {copied})\n{}",
        s.describe(&dump)
    );
    s.assert_line(
        &dump,
        &[&format!(
            "the image holds {lent} lent and 0 copied-first allocations"
        )],
    );
    restores_through_the_keeper(&mut s);
}

/// The dumped job (4 allocations) restored: the keeper's memory was taken (not the job's
/// agent's own load after a refusal), and it runs on bit-exact.
fn restores_through_the_keeper(s: &mut Split) {
    let last = s.reap_dumped();
    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_line(&restore, &["restore hand-over planned"]);
    s.assert_line(
        &restore,
        &["the keeper's load ran", "then mapped 4 allocations"],
    );
    s.assert_runs_on(&last, &restore);
}

/// After a `-R` the application's handle maps memory imported from the kept descriptor, which
/// the driver will not export again: once the workload maps it anew, a second `-R` copies that
/// allocation first (and lends the rest), and the job runs on bit-exact both times.
#[test]
fn an_application_handle_mapped_again_after_a_hand_over_is_copied_first() {
    let Some(mut s) = start_plain("routes-app-again") else {
        return;
    };
    let first = s.dump(true);
    s.assert_ok(&first);
    let (lent, copied) = routes_taken(&s, &first);
    assert!(
        copied == 0 && (3..=4).contains(&lent),
        "routes ({lent}, {copied})\n{}",
        s.describe(&first)
    );
    let before = s.vmm.last_ticks();
    s.assert_runs_on(&before, &first);
    let second = s.dump(true);
    s.assert_ok(&second);
    // The re-mapped handle is never lent again: copied first (or, seized between its unmap
    // and its map, not listed); the other three are lent.
    let (lent, copied) = routes_taken(&s, &second);
    assert!(
        lent == 3 && copied <= 1,
        "routes ({lent}, {copied})\n{}",
        s.describe(&second)
    );
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, &second);
    assert!(s.vmm.original_running(), "{}", s.describe(&second));
}

/// The workload's own 2 MiB `cuMemCreate` handle as PyTorch's expandable segments make it on an
/// H200 (POSIX-fd handle type asked, `gpuDirectRDMACapable`), kept and checked every tick
/// (data and the properties read back), beside 2 data allocations and the counter.
fn start_rdma(test: &str) -> Option<Split> {
    Split::launch(
        test,
        1,
        &[
            "--seed",
            "31",
            "--allocs",
            "2",
            "--mib",
            "4",
            "--app-vmm",
            "--app-vmm-posix",
            "--app-vmm-rdma",
        ],
        &[],
    )
}

/// Everything of the RDMA job is lent at the dump, its own handle among it, and the image
/// records that handle's memory as RDMA-capable.
fn assert_rdma_lent(s: &Split, dump: &CriuRun) {
    assert_eq!(routes_taken(s, dump), (4, 0), "{}", s.describe(dump));
    s.assert_line(dump, &["routes: 4 lent", "1 of the lent are RDMA-capable"]);
    let m = manifest(s);
    let rdma: Vec<_> = m.allocations.iter().filter(|a| a.rdma_capable).collect();
    assert!(
        rdma.len() == 1 && rdma[0].lent && rdma[0].size == 2 << 20,
        "{m:?}"
    );
    assert!(
        m.allocations.iter().filter(|a| a.moved).all(|a| a.lent),
        "{m:?}"
    );
}

/// RDMA-capable memory with the POSIX-fd type the program asked for itself is lent, and the
/// restore hands it over through the keeper, which makes it RDMA-capable again (checked with the
/// driver in the keeper; the job's agent refuses memory the keeper says is of another kind);
/// the workload reads back exactly the properties it created its handle with, every tick after
/// the restore.
#[test]
fn rdma_capable_application_memory_is_lent_and_made_again_at_restore() {
    let Some(mut s) = start_rdma("routes-rdma-restore") else {
        return;
    };
    let dump = s.dump(false);
    s.assert_ok(&dump);
    assert_rdma_lent(&s, &dump);
    restores_through_the_keeper(&mut s);
}

/// The same job dumped with `-R`: the lent memory is mapped back from the kept descriptors (the
/// same memory), the workload's properties still read back as created, and a second `-R` lends
/// the handle again (its kept descriptor) and runs on.
#[test]
fn rdma_capable_application_memory_runs_on_after_leave_running() {
    let Some(mut s) = start_rdma("routes-rdma-R") else {
        return;
    };
    let first = s.dump(true);
    s.assert_ok(&first);
    assert_rdma_lent(&s, &first);
    let before = s.vmm.last_ticks();
    s.assert_runs_on(&before, &first);
    let second = s.dump(true);
    s.assert_ok(&second);
    assert_eq!(routes_taken(&s, &second), (4, 0), "{}", s.describe(&second));
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, &second);
    assert!(s.vmm.original_running(), "{}", s.describe(&second));
}

/// The program gives a second GPU access to its own mapping (`cuMemSetAccess` with two
/// descriptors): the split path would map that memory again with read-write access for its own
/// GPU only, so the agent records it and the process takes the driver's path, which keeps the
/// access; dumped, restored, and it runs on bit-exact, with no data file of gpusnap's.
#[test]
fn access_for_another_gpu_takes_the_driver_s_path() {
    let Some(mut s) = Split::launch(
        "routes-peer-access",
        1,
        &[
            "--seed",
            "41",
            "--allocs",
            "2",
            "--mib",
            "4",
            "--devices",
            "2",
            "--app-vmm",
            "--app-vmm-peer",
        ],
        &[("FAKECUDA_DEVICES", "2")],
    ) else {
        return;
    };
    let dump = s.dump(false);
    s.assert_ok(&dump);
    s.assert_line(
        &dump,
        &[
            "cuMemSetAccess with access other than read-write",
            "the driver's path",
        ],
    );
    s.assert_line(&dump, &["path transparent"]);
    let data: Vec<String> =
        s.w.image_files()
            .into_iter()
            .filter(|f| f.contains("-data-"))
            .collect();
    assert!(
        data.is_empty(),
        "gpusnap data files on the driver's path: {data:?}"
    );
    let last = s.reap_dumped();
    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
}
