//! Real `criu dump`/`restore` with gpusnap in the plugin directory (see the crate docs).
//!
//! Every test is the parent of the workload it dumps; dumps without `--leave-running` kill
//! the workload, the test reaps it and waits until its pids are free, then restores it with
//! `--restore-detached` and checks that it carries on where it stopped.

use std::fs;

use criu_tests::harness::skipped;
use criu_tests::{CriuRun, WorkDir, Workload, harness, procs};

const COUNTER: &str = env!("CARGO_BIN_EXE_counter");
const TREE: &str = env!("CARGO_BIN_EXE_tree");

/// How many more ticks a restored (or left-running) process must write to count as running.
const MORE_TICKS: u64 = 5;

/// Dumps the workload (killing it), reaps it, restores it; returns the two runs and the last
/// counter value of each process at dump time. Both runs must succeed.
fn dump_and_restore(w: &WorkDir, wl: &mut Workload) -> (CriuRun, CriuRun, Vec<u64>) {
    let dump = w.dump(wl.root(), false);
    dump.assert_ok();
    wl.reap_dumped();
    let at_dump: Vec<u64> = (0..wl.logs.len()).map(|i| wl.log(i).last()).collect();
    let restore = w.restore();
    restore.assert_ok();
    (dump, restore, at_dump)
}

/// Every process is running again, writes at least `MORE_TICKS` more lines, and its whole
/// log (before and after the checkpoint) is consistent: consecutive counters, unchanged
/// memory checksum, unbroken in-memory chain.
fn assert_continues(wl: &Workload, at_dump: &[u64]) {
    wl.assert_alive();
    for (i, &last) in at_dump.iter().enumerate() {
        assert!(
            last >= 3,
            "{}: only {last} ticks before the dump",
            wl.logs[i].display()
        );
        let log = wl.wait_for(i, last + MORE_TICKS);
        log.verify()
            .unwrap_or_else(|e| panic!("after checkpoint at tick {last}: {e}"));
        assert_eq!(log.pid, wl.pids[i]);
    }
    wl.assert_alive();
}

/// Contract 1: The plugin loads in dump and restore: both logs have a `gpusnap:` line saying it loaded.
#[test]
fn plugin_loads_in_dump_and_restore() {
    let Some(h) = harness("plugin_loads_in_dump_and_restore") else {
        return;
    };
    let w = h.workdir("plugin-loads");
    let mut wl = w.spawn_counter(COUNTER, 1, &[]);
    let (dump, restore, _) = dump_and_restore(&w, &mut wl);
    for run in [&dump, &restore] {
        let lines = run.gpusnap_lines();
        assert!(
            lines.iter().any(|l| l.contains("loaded")),
            "no `gpusnap: ... loaded` line in {} ({} gpusnap lines)\n{}",
            run.log_path.display(),
            lines.len(),
            run.diagnostics()
        );
    }
}

/// Contract 2: A CPU-only process dumps (no -R) and restores with gpusnap loaded and keeps running
/// from where it was, with its memory intact.
#[test]
fn cpu_process_restores_and_continues() {
    let Some(h) = harness("cpu_process_restores_and_continues") else {
        return;
    };
    let w = h.workdir("cpu-restore");
    let mut wl = w.spawn_counter(COUNTER, 2, &[]);
    let (_, _, at_dump) = dump_and_restore(&w, &mut wl);
    let size = fs::metadata(&wl.logs[0]).unwrap().len();
    assert_continues(&wl, &at_dump);
    assert!(
        fs::metadata(&wl.logs[0]).unwrap().len() > size,
        "log stopped growing"
    );
}

/// Contract 3: A parent with two children dumps and restores; all three keep running, as a tree.
#[test]
fn process_tree_restores_and_continues() {
    let Some(h) = harness("process_tree_restores_and_continues") else {
        return;
    };
    let w = h.workdir("tree-restore");
    let mut wl = w.spawn_tree(TREE, 3);
    assert_eq!(wl.pids.len(), 3);
    let (_, _, at_dump) = dump_and_restore(&w, &mut wl);
    assert_continues(&wl, &at_dump);
    let parent = wl.root();
    assert_eq!(procs::children(parent), {
        let mut c = wl.pids[1..].to_vec();
        c.sort_unstable();
        c
    });
    for &child in &wl.pids[1..] {
        let st = procs::stat(child).unwrap();
        assert_eq!(st.ppid, parent, "child {child} has a new parent: {st:?}");
        assert_eq!(st.session, parent, "child {child} left the session: {st:?}");
    }
}

/// Contract 4: `criu dump --leave-running` with gpusnap: the process just continues.
#[test]
fn leave_running_dump_continues() {
    let Some(h) = harness("leave_running_dump_continues") else {
        return;
    };
    let w = h.workdir("leave-running");
    let mut wl = w.spawn_counter(COUNTER, 4, &[]);
    let dump = w.dump(wl.root(), true);
    dump.assert_ok();
    let at_dump = wl.log(0).last();
    assert!(
        wl.original_still_running(),
        "the workload died during a -R dump"
    );
    assert_continues(&wl, &[at_dump]);
    let files = w.image_files();
    assert!(
        files.iter().any(|f| f.starts_with("pages-")) && files.iter().any(|f| f == "inventory.img"),
        "no images written: {files:?}"
    );
}

/// Contract 5: With no GPU state, gpusnap writes no image files and no inventory entry.
#[test]
fn cpu_dump_has_no_gpusnap_images_or_inventory_entry() {
    let Some(h) = harness("cpu_dump_has_no_gpusnap_images_or_inventory_entry") else {
        return;
    };
    let w = h.workdir("no-gpusnap-state");
    let mut wl = w.spawn_counter(COUNTER, 5, &[]);
    let dump = w.dump(wl.root(), false);
    dump.assert_ok();
    let files = w.image_files();
    let ours: Vec<&String> = files.iter().filter(|f| f.starts_with("gpusnap")).collect();
    assert!(
        ours.is_empty(),
        "gpusnap image files for a CPU-only process: {ours:?}"
    );
    let inventory = fs::read(w.images.join("inventory.img")).expect("inventory.img");
    assert!(
        !inventory.windows(7).any(|b| b == b"gpusnap"),
        "inventory.img names gpusnap although no GPU state was dumped"
    );
    // And a restore does not ask for the plugin either.
    wl.reap_dumped();
    w.restore().assert_ok();
    wl.assert_alive();
}

/// Contract 6: Without an NVIDIA driver gpusnap disables itself with exactly one log line, and the
/// dump still succeeds.
#[test]
fn disabled_without_driver_logs_once() {
    let Some(h) = harness("disabled_without_driver_logs_once") else {
        return;
    };
    if nvidia_driver_present() {
        skipped(
            "disabled_without_driver_logs_once",
            "an NVIDIA driver is present",
        );
        return;
    }
    let w = h.workdir("disabled");
    let wl = w.spawn_counter(COUNTER, 6, &[]);
    let dump = w.dump(wl.root(), true);
    dump.assert_ok();
    let disabled: Vec<&str> = dump
        .gpusnap_lines()
        .into_iter()
        .filter(|l| l.to_ascii_lowercase().contains("disabled"))
        .collect();
    assert_eq!(
        disabled.len(),
        1,
        "expected exactly one `gpusnap: ... disabled` line, got {disabled:#?}\n{}",
        dump.diagnostics()
    );
}

/// Contract 7: A process with the in-process agent preloaded (eager mode) dumps, restores and runs on.
#[test]
fn agent_preloaded_process_restores_and_continues() {
    let Some(h) = harness("agent_preloaded_process_restores_and_continues") else {
        return;
    };
    let agent = h
        .agent_so()
        .unwrap_or_else(|e| panic!("building the agent: {e}"));
    let agent = agent.to_str().expect("UTF-8 agent path");
    let w = h.workdir("agent");
    let mut wl = w.spawn_counter(
        COUNTER,
        7,
        &[("LD_PRELOAD", agent), ("GPUSNAP_AGENT_EAGER", "1")],
    );
    assert!(
        procs::maps_contain(wl.root(), agent),
        "the agent {agent} is not mapped into the workload"
    );
    let (_, _, at_dump) = dump_and_restore(&w, &mut wl);
    assert_continues(&wl, &at_dump);
    assert!(
        procs::maps_contain(wl.root(), agent),
        "the agent {agent} is not mapped into the restored workload"
    );
}

/// Whether the host has an NVIDIA driver: a loadable `libcuda.so.1` or GPUs registered by
/// the kernel module.
fn nvidia_driver_present() -> bool {
    let gpus = std::fs::read_dir("/proc/driver/nvidia/gpus").is_ok_and(|mut d| d.next().is_some());
    // SAFETY: dlopen with a valid NUL-terminated name; the handle is closed again at once.
    let libcuda = unsafe {
        let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if !h.is_null() {
            libc::dlclose(h);
        }
        !h.is_null()
    };
    gpus || libcuda
}
