//! Never a CPU-only checkpoint of a GPU job (issue 35, item 5): real CRIU, the stand-in driver,
//! the transparent path's `fakegpu` workload.
//!
//! - gpusnap disabled by configuration (`GPUSNAP_MODE=off`): a `criu dump` of a process with
//!   CUDA state fails at PAUSE_DEVICES, naming the cause; the driver is not asked to lock or
//!   checkpoint; the job runs on. A process without CUDA state is dumped as before. With CRIU's
//!   own `cuda_plugin.so` loaded (a stand-in of it: a plugin that takes nothing), gpusnap leaves
//!   the process to it, as CRIU offers PAUSE_DEVICES to one plugin after another and stops at
//!   the first answer.
//! - the plugin missing at restore: the image of a dump with gpusnap lists it in CRIU's plugin
//!   inventory, so `criu restore` without gpusnap fails before it creates any process; with
//!   gpusnap the same image restores and the job goes on.
//!
//! Root and CRIU are needed, as for `criu-tests`; `GPUSNAP_SKIP_CRIU_TESTS=1` skips.

use std::fs;
use std::time::Duration;

use criu_tests::fake_driver::{FakeDriver, shorts};
use criu_tests::inventory::inventory_plugins;
use criu_tests::{CounterLog, CriuRun, WorkDir, Workload, harness, procs};

const FAKEGPU: &str = env!("CARGO_BIN_EXE_fakegpu");
const COUNTER: &str = env!("CARGO_BIN_EXE_counter");
const PROMPTLY: Duration = Duration::from_secs(5);
const REFUSAL: &str = "has CUDA state, but gpusnap is disabled (mode = off)";

fn spawn_fakegpu(w: &WorkDir, seed: u64) -> Workload {
    let seed = seed.to_string();
    w.spawn(
        "fakegpu",
        FAKEGPU,
        &["--log", "fakegpu.log", "--seed", &seed],
        &[],
        &["fakegpu.log"],
    )
}

/// The workload's process writes more ticks, untraced, with its state intact.
fn runs_on(wl: &Workload, what: &str) {
    let pid = wl.root();
    let last = wl.log(0).last();
    let log = CounterLog::wait_for(&wl.logs[0], last + 3, PROMPTLY)
        .unwrap_or_else(|e| panic!("{what}: pid {pid} does not run on: {e}"));
    log.verify()
        .unwrap_or_else(|e| panic!("{what}: pid {pid}: state damaged: {e}"));
    assert_eq!(procs::tracer_pid(pid), Some(0), "{what}: pid {pid} traced");
}

fn log_has(run: &CriuRun, needle: &str) -> bool {
    run.log.contains(needle)
}

#[test]
fn a_gpu_job_is_not_dumped_without_its_gpu_state_when_gpusnap_is_off() {
    let test = "cpu-only-off";
    let Some(h) = harness(test) else { return };
    let w = h.workdir(test);
    let fake = FakeDriver::new(h, &w);
    let off = [("GPUSNAP_MODE", "off")];

    // A process with CUDA state: refused, untouched.
    let wl = spawn_fakegpu(&w, 51);
    let pid = wl.root();
    let dump = fake.dump(&w, pid, true, &off, &[]);
    assert!(
        !dump.succeeded(),
        "a CUDA process was dumped without its GPU state\n{}",
        dump.diagnostics()
    );
    let line = dump
        .gpusnap_lines()
        .into_iter()
        .find(|l| l.contains(REFUSAL))
        .unwrap_or_else(|| panic!("no refusal naming the cause\n{}", dump.diagnostics()));
    eprintln!("criu-tests: {test}: {line}");
    assert!(line.contains(&format!("pid {pid} ")), "{line}");
    assert!(line.contains("mode = auto"), "{line}");
    assert!(
        shorts(&fake.ops(pid)).is_empty(),
        "the driver was asked to change the process's state: {}",
        fake.log_text(pid)
    );
    assert!(
        !w.image_files().iter().any(|f| f == "inventory.img"),
        "the refused dump left an image: {:?}",
        w.image_files()
    );
    runs_on(&wl, "after the refused dump");

    // CRIU's own cuda_plugin (a stand-in that takes nothing) loaded: left to it. The stand-in
    // saves no GPU state, so CRIU's dump succeeds here; the real cuda_plugin would checkpoint it.
    let so = criu_tests::build::package(
        &h.profile_dir,
        "fake-amdgpu-plugin",
        "libfake_amdgpu_plugin.so",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let cuda_plugin = w.plugins.join("cuda_plugin.so");
    fs::copy(&so, &cuda_plugin).unwrap_or_else(|e| panic!("{}: {e}", so.display()));
    let log = w.images.join("dump-cuda-plugin.log");
    let mut args = w.criu_args_in("dump", &w.images, &log);
    args.extend(["-t".into(), pid.to_string(), "--leave-running".into()]);
    let mut env = fake.env();
    env.push(("GPUSNAP_MODE".into(), "off".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let dump = w.run_criu(&args, &env, &log);
    dump.assert_ok();
    assert!(
        log_has(&dump, "GPU state is left to") && log_has(&dump, "/cuda_plugin.so"),
        "{}",
        dump.diagnostics()
    );
    assert!(!log_has(&dump, REFUSAL), "{}", dump.diagnostics());
    fs::remove_file(&cuda_plugin).unwrap();
    runs_on(&wl, "after the dump left to cuda_plugin");
    drop(wl);

    // A process without CUDA state: gpusnap off stands in nobody's way.
    for f in w.image_files() {
        let _ = fs::remove_file(w.images.join(f));
    }
    let plain = w.spawn_counter(COUNTER, 52, &[]);
    let dump = fake.dump(&w, plain.root(), true, &off, &[]);
    dump.assert_ok();
    assert!(!log_has(&dump, REFUSAL), "{}", dump.diagnostics());
}

#[test]
fn an_image_with_gpu_state_is_not_restored_without_gpusnap() {
    let test = "cpu-only-missing-plugin";
    let Some(h) = harness(test) else { return };
    let w = h.workdir(test);
    let fake = FakeDriver::new(h, &w);
    let mut wl = spawn_fakegpu(&w, 53);
    let pid = wl.root();
    let dump = fake.dump(&w, pid, false, &[], &[]);
    dump.assert_ok();
    wl.reap_dumped();
    let inventory = fs::read(w.images.join("inventory.img")).unwrap();
    assert!(
        inventory_plugins(&inventory)
            .unwrap()
            .contains(&"gpusnap".to_owned()),
        "inventory.img does not list gpusnap"
    );

    // No gpusnap in CRIU's plugin directory: CRIU refuses the image before any process.
    let empty = w.path.join("no-plugins");
    fs::create_dir_all(&empty).unwrap();
    let log = w.images.join("restore-without.log");
    let mut args = w.criu_args_in("restore", &w.images, &log);
    let at = args.iter().position(|a| a == "-L").unwrap() + 1;
    args[at] = empty.display().to_string();
    args.push("--restore-detached".into());
    let env = fake.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let run = w.run_criu(&args, &env, &log);
    assert!(
        !run.succeeded(),
        "restored without gpusnap\n{}",
        run.diagnostics()
    );
    let why: Vec<&str> = run.log.lines().filter(|l| l.contains("Error")).collect();
    eprintln!("criu-tests: {test}: CRIU without gpusnap: {why:?}");
    assert!(
        run.log.contains("Missing required plugin: gpusnap"),
        "CRIU's refusal does not name the missing plugin\n{}",
        run.diagnostics()
    );
    assert!(
        !run.log.contains("Forking task"),
        "CRIU created a process first\n{}",
        run.diagnostics()
    );
    assert!(
        fake.ops(pid).iter().all(|c| c.call != "restore"),
        "the driver restored: {}",
        fake.log_text(pid)
    );
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "a process with the job's pid {pid} exists"
    );

    // With gpusnap the same image restores, and the job goes on.
    let run = fake.restore(&w, &[]);
    run.assert_ok();
    assert_eq!(
        shorts(&fake.ops(pid))
            .iter()
            .filter(|s| s.starts_with("restore"))
            .count(),
        1,
        "{}",
        fake.log_text(pid)
    );
    let last = wl.log(0).last();
    let log = CounterLog::wait_for(&wl.logs[0], last + 3, PROMPTLY)
        .unwrap_or_else(|e| panic!("the restored job does not run on: {e}"));
    log.verify()
        .unwrap_or_else(|e| panic!("restored state damaged: {e}"));
}
