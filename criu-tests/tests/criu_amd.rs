//! Real `criu dump`/`restore` of a stand-in AMD GPU process with gpusnap loaded: the stand-in
//! KFD (`fake-kfd`) plays the kernel behind mknod'ed `kfd`/`renderD*` nodes that CRIU hands to
//! the plugin's `DUMP_EXT_FILE`/`RESTORE_EXT_FILE`, as it does real `/dev/kfd` files.
//!
//! What every test can see: the KFD process's state in the daemon (running, paused, ...), its
//! BOs' contents (hashes of the pattern BOs, the counter its queue counts in), the workload's
//! own CPU counter log, and CRIU's log.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criu_tests::build::built;
use criu_tests::fixtures::{TempDir, output_text};
use criu_tests::{CriuRun, WorkDir, Workload, harness};
use fake_kfd::{FakeGpu, StandinSetup};
use gpusnap_rocm::kfd::standin::STANDIN_ENV;
use gpusnap_rocm::kfd::sys::KfdCriuOp;
use serde_json::Value;

/// The stand-in AMD process and the stand-in KFD daemon (binaries of `fake-kfd`), built once
/// per test binary.
fn app() -> String {
    let p = built("fake-kfd", "amd-app");
    p.to_str().expect("UTF-8 path").to_owned()
}
fn daemon() -> PathBuf {
    built("fake-kfd", "fake-kfd")
}

/// One test: a work dir, a stand-in KFD, and the stand-in AMD process.
struct Case {
    w: WorkDir,
    kfd: StandinSetup,
    /// A short directory for the stand-in (its socket path must fit `sun_path`).
    sdir: TempDir,
    app: Workload,
}

impl Case {
    fn start(name: &str, gpus: &[FakeGpu], app_gpus: usize) -> Option<Case> {
        let h = harness(name)?;
        let w = h.workdir(name);
        let sdir = TempDir::short("kfd");
        let kfd =
            StandinSetup::start(sdir.path(), gpus, &daemon()).unwrap_or_else(|e| panic!("{e}"));
        let d = sdir.path().display().to_string();
        let n = app_gpus.to_string();
        let app = w.spawn(
            "amd-app",
            &app(),
            &[
                "--dir",
                &d,
                "--log",
                "counter.log",
                "--seed",
                "7",
                "--gpus",
                &n,
                "--bo-kib",
                "1536",
            ],
            &[],
            &["counter.log"],
        );
        let c = Case { w, kfd, sdir, app };
        c.wait_counter(c.app.root(), 3);
        Some(c)
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![(STANDIN_ENV, self.sdir.path().display().to_string())]
    }

    fn criu_with(&self, args: Vec<String>, log: &str, extra: &[(&str, &str)]) -> CriuRun {
        let env = self.env();
        let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        env.extend_from_slice(extra);
        self.w.run_criu(&args, &env, &self.w.images.join(log))
    }

    fn dump(&self, leave_running: bool) -> CriuRun {
        self.dump_with(leave_running, &[])
    }

    fn dump_with(&self, leave_running: bool, extra: &[(&str, &str)]) -> CriuRun {
        let mut args = self
            .w
            .criu_args_in("dump", &self.w.images, &self.w.images.join("dump.log"));
        args.splice(1..1, ["-t".to_owned(), self.app.root().to_string()]);
        if leave_running {
            args.push("--leave-running".into());
        }
        self.criu_with(args, "dump.log", extra)
    }

    fn restore(&self) -> CriuRun {
        self.restore_with(&[])
    }

    fn restore_with(&self, extra: &[(&str, &str)]) -> CriuRun {
        let mut args = self.w.criu_args_in(
            "restore",
            &self.w.images,
            &self.w.images.join("restore.log"),
        );
        args.push("--restore-detached".into());
        self.criu_with(args, "restore.log", extra)
    }

    fn process(&self) -> Value {
        self.kfd.process(self.app.root() as u32)
    }

    fn counter(&self, pid: i32) -> u64 {
        self.kfd.process(pid as u32)["counter"]
            .as_u64()
            .expect("counter")
    }

    /// Waits until the KFD process of `pid` has counted past `min`.
    fn wait_counter(&self, pid: i32, min: u64) -> u64 {
        let t0 = Instant::now();
        loop {
            let v = self.kfd.status(pid as u32);
            if let Some(c) = v["processes"][0]["counter"].as_u64()
                && c > min
            {
                return c;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the GPU queue of pid {pid} does not count past {min}: {v}\n{}",
                self.kfd.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn files(&self) -> Vec<String> {
        self.w.image_files()
    }
}

/// The xxh3 of every pattern BO, by address.
fn bo_hashes(p: &Value) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = p["bos"]
        .as_array()
        .expect("bos")
        .iter()
        .filter_map(|b| Some((b["addr"].as_u64()?, b["xxh3"].as_u64()?)))
        .collect();
    v.sort_unstable();
    v
}

/// The process's mappings of the stand-in's nodes: (start, offset, what the mapping shows at
/// its start: `Ok(addr)` for the stand-in's tag of the BO at `addr`, `Err(first bytes)`
/// otherwise).
fn device_mappings(sdir: &Path, pid: i32) -> Vec<(u64, u64, Result<u64, Vec<u8>>)> {
    use std::os::unix::fs::FileExt;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    gpusnap_rocm::kfd::vma::parse_maps(&maps)
        .into_iter()
        .filter(|m| Path::new(&m.path).parent() == Some(sdir))
        .map(|m| {
            let mut b = [0u8; 16];
            mem.read_exact_at(&mut b, m.start).unwrap();
            let shows = if &b[..8] == b"SKFDMAP1" {
                Ok(u64::from_le_bytes(b[8..].try_into().unwrap()))
            } else {
                Err(b.to_vec())
            };
            (m.start, m.offset, shows)
        })
        .collect()
}

/// Every device mapping of `pid` shows the tag of the BO at its own address.
fn assert_mappings_show_their_bos(sdir: &Path, pid: i32, want: usize) -> Vec<(u64, u64)> {
    let m = device_mappings(sdir, pid);
    assert_eq!(m.len(), want, "device mappings of pid {pid}: {m:?}");
    for (start, off, shows) in &m {
        assert_eq!(
            shows,
            &Ok(*start),
            "the mapping at {start:#x} (offset {off:#x}) does not show its BO"
        );
    }
    m.into_iter().map(|(s, o, _)| (s, o)).collect()
}

fn state(p: &Value) -> &str {
    p["state"].as_str().unwrap_or("?")
}

fn assert_log_has(run: &CriuRun, needle: &str) {
    assert!(
        run.log.contains(needle),
        "{} lacks {needle:?}\n{}",
        run.log_path.display(),
        run.gpusnap_lines().join("\n")
    );
}

/// Dump, reap, restore; asserts the restored process's GPU state equals the dumped one and
/// that it runs on (CPU log and GPU queue).
fn dump_restore_and_check(c: &mut Case) -> (CriuRun, CriuRun) {
    let before = c.process();
    assert_eq!(state(&before), "running");
    let hashes = bo_hashes(&before);
    assert!(!hashes.is_empty());
    // One VRAM buffer and one doorbell page mapped per GPU.
    let n_maps = 2 * before["devices"].as_array().unwrap().len();
    let maps_before = assert_mappings_show_their_bos(c.sdir.path(), c.app.root(), n_maps);
    let dump = c.dump(false);
    dump.assert_ok();
    assert_log_has(&dump, &format!("{n_maps} device mappings"));
    assert_log_has(&dump, "queues paused (PROCESS_INFO");
    assert_log_has(&dump, "checkpointed:");
    c.app.reap_dumped();
    let at_dump = c.app.log(0).last();
    let files = c.files();
    let pid = c.app.root();
    for f in [
        format!("gpusnap-{pid}-manifest.img"),
        format!("gpusnap-{pid}-kfd.img"),
    ] {
        assert!(files.contains(&f), "{f} missing: {files:?}");
    }
    assert!(
        files.iter().any(|f| f.starts_with("gpusnap-kfdfile-")),
        "{files:?}"
    );
    // The image reads back whole through the image crate (what `gpusnap verify` does).
    let dir = std::fs::File::open(&c.w.images).unwrap();
    use std::os::fd::AsFd;
    let m =
        gpusnap_image::read_manifest(dir.as_fd(), gpusnap_proto::pid::NsPid(pid as u32)).unwrap();
    assert_eq!(m.path, gpusnap_image::CheckpointPath::Kfd);
    gpusnap_image::verify_image(dir.as_fd(), &m, 2).unwrap();
    // The daemon freed the dumped process.
    assert_eq!(
        c.kfd.status(pid as u32)["processes"]
            .as_array()
            .unwrap()
            .len(),
        0
    );

    let restore = c.restore();
    restore.assert_ok();
    assert_log_has(&restore, "KFD state restored");
    assert_log_has(&restore, "GPU queues resumed (RESUME)");
    assert_log_has(&restore, "device mappings translated");
    // The mappings are back at their addresses, at the BOs' new offsets, showing their BOs.
    let maps_after = assert_mappings_show_their_bos(c.sdir.path(), pid, n_maps);
    for ((s0, o0), (s1, o1)) in maps_before.iter().zip(&maps_after) {
        assert_eq!(s0, s1);
        assert_ne!(o0, o1, "the mapping at {s0:#x} kept its old offset");
    }
    let after = c.process();
    assert_eq!(state(&after), "running", "{after}");
    assert_eq!(
        bo_hashes(&after),
        hashes,
        "BO contents differ after restore"
    );
    let counter = after["counter"].as_u64().unwrap();
    assert!(counter > 0, "the queue counter was not restored: {after}");
    c.wait_counter(pid, counter + 3);
    let log = c.app.wait_for(0, at_dump + 5);
    log.verify().unwrap();
    assert_eq!(log.pid, pid);
    (dump, restore)
}

#[test]
fn amd_process_dumps_and_restores() {
    let Some(mut c) = Case::start("amd-dump-restore", &[FakeGpu::mi210(4660, 128)], 1) else {
        return;
    };
    let (_, restore) = dump_restore_and_check(&mut c);
    // Contents went through the data path: a checksum pass at init, then the BOs written.
    assert_log_has(&restore, "AMD GPU processes checked (images and checksums");
    // The queue was stopped while checkpointed: the daemon logged every transition.
    let log = c.kfd.log();
    for step in ["PROCESS_INFO", "CHECKPOINT", "RESTORE", "RESUME"] {
        assert!(log.contains(step), "daemon log lacks {step}:\n{log}");
    }
    assert!(
        !log.contains("UNPAUSE"),
        "a plain dump must not unpause:\n{log}"
    );
    // The restored process is a KFD process like any other: it checkpoints again (its KFD file
    // is the one RESTORE_EXT_FILE opened, now under the fd number CRIU gave it).
    let again = c.dump(true);
    again.assert_ok();
    assert_log_has(&again, "checkpointed:");
    assert_eq!(state(&c.process()), "running");
}

#[test]
fn amd_leave_running_unpauses() {
    let Some(c) = Case::start("amd-leave-running", &[FakeGpu::mi210(4660, 128)], 1) else {
        return;
    };
    let hashes = bo_hashes(&c.process());
    let dump = c.dump(true);
    dump.assert_ok();
    assert_log_has(
        &dump,
        "criu dump -R (leave running): undone: GPU queues unpaused",
    );
    let p = c.process();
    assert_eq!(state(&p), "running");
    assert_eq!(bo_hashes(&p), hashes);
    let n = c.counter(c.app.root());
    c.wait_counter(c.app.root(), n + 3);
    c.app.assert_alive();
    let last = c.app.log(0).last();
    c.app.wait_for(0, last + 3).verify().unwrap();
    assert!(
        c.files()
            .contains(&format!("gpusnap-{}-manifest.img", c.app.root()))
    );
}

/// A dump whose KFD step fails: CRIU's dump fails, the process runs on with its queues running
/// and no gpusnap image of it is left.
fn assert_failed_dump_rolled_back(c: &Case, dump: &CriuRun, needle: &str) {
    assert!(
        !dump.succeeded(),
        "the dump should fail\n{}",
        dump.diagnostics()
    );
    assert_log_has(dump, needle);
    let p = c.process();
    assert_eq!(state(&p), "running", "{p}");
    let n = c.counter(c.app.root());
    c.wait_counter(c.app.root(), n + 2);
    c.app.assert_alive();
    let last = c.app.log(0).last();
    c.app.wait_for(0, last + 2).verify().unwrap();
    let left: Vec<String> = c
        .files()
        .into_iter()
        .filter(|f| f.starts_with(&format!("gpusnap-{}-", c.app.root())))
        .collect();
    assert!(left.is_empty(), "files left by a failed dump: {left:?}");
}

#[test]
fn amd_failing_dump_steps_roll_back() {
    let Some(c) = Case::start("amd-dump-failures", &[FakeGpu::mi210(4660, 128)], 1) else {
        return;
    };
    c.kfd.inject(KfdCriuOp::ProcessInfo as u32, libc::EIO, 1);
    let d = c.dump(false);
    assert_failed_dump_rolled_back(
        &c,
        &d,
        "the kernel left its queues running; nothing to undo",
    );

    c.kfd.inject(KfdCriuOp::Checkpoint as u32, libc::ENOMEM, 1);
    let d = c.dump(false);
    assert_failed_dump_rolled_back(&c, &d, "undone: GPU queues unpaused (UNPAUSE)");
    assert_log_has(&d, "CHECKPOINT failed");

    c.kfd.unmappable_dmabufs(true);
    let d = c.dump(false);
    c.kfd.unmappable_dmabufs(false);
    assert_failed_dump_rolled_back(&c, &d, "its dma-buf cannot be mapped");
    assert_log_has(&d, "undone: GPU queues unpaused (UNPAUSE)");

    // The process is still checkpointable after all that.
    let d = c.dump(true);
    d.assert_ok();
    assert_eq!(state(&c.process()), "running");
}

#[test]
fn amd_failed_unpause_kills_the_process() {
    let Some(mut c) = Case::start("amd-unpause-fails", &[FakeGpu::mi210(4660, 128)], 1) else {
        return;
    };
    c.kfd.inject(KfdCriuOp::Checkpoint as u32, libc::EIO, 1);
    c.kfd.inject(KfdCriuOp::Unpause as u32, libc::EIO, 1);
    let d = c.dump(false);
    assert!(!d.succeeded());
    assert_log_has(
        &d,
        &format!(
            "killing pid {} so that it cannot run with its GPU queues stopped (fail closed)",
            c.app.root()
        ),
    );
    c.app.reap_dumped();
}

#[test]
fn amd_failing_restore_steps_end_the_restored_process() {
    let Some(mut c) = Case::start("amd-restore-failures", &[FakeGpu::mi210(4660, 128)], 1) else {
        return;
    };
    let hashes = bo_hashes(&c.process());
    c.dump(false).assert_ok();
    c.app.reap_dumped();
    let pid = c.app.root();
    for (op, needle, criu_fails) in [
        (KfdCriuOp::Restore, "RESTORE failed", true),
        // CRIU ignores RESUME_DEVICES_LATE's answer: gpusnap kills the process itself.
        (
            KfdCriuOp::Resume,
            "the process was killed rather than left running",
            false,
        ),
    ] {
        c.kfd.inject(op as u32, libc::EIO, 1);
        let r = c.restore();
        if criu_fails {
            assert!(!r.succeeded(), "restore with a failing {op:?} succeeded");
        }
        assert_log_has(&r, needle);
        // The restored task CRIU ended is our zombie (we are the subreaper).
        let _ = criu_tests::procs::reap(pid, Duration::from_secs(5));
        criu_tests::procs::wait_pid_free(pid, Duration::from_secs(20)).unwrap();
        let left = c.kfd.status(pid as u32);
        let live: Vec<&Value> = left["processes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| state(p) == "running")
            .collect();
        assert!(
            live.is_empty(),
            "a KFD process runs after a failed restore: {left}"
        );
    }
    // The image is intact: a restore without faults works.
    c.restore().assert_ok();
    let p = c.process();
    assert_eq!(state(&p), "running");
    assert_eq!(bo_hashes(&p), hashes);
}

#[test]
fn amd_damaged_image_is_refused() {
    let Some(mut c) = Case::start("amd-damaged", &[FakeGpu::mi210(4660, 128)], 1) else {
        return;
    };
    c.dump(false).assert_ok();
    c.app.reap_dumped();
    let pid = c.app.root();
    // gpusnap switched off: an image with AMD state is refused, not restored without it.
    let mut args =
        c.w.criu_args_in("restore", &c.w.images, &c.w.images.join("off.log"));
    args.push("--restore-detached".into());
    let sdir = c.sdir.path().display().to_string();
    let r = c.w.run_criu(
        &args,
        &[(STANDIN_ENV, sdir.as_str()), ("GPUSNAP_MODE", "off")],
        &c.w.images.join("off.log"),
    );
    assert!(!r.succeeded());
    assert_log_has(
        &r,
        "holds AMD GPU state but gpusnap is disabled (mode = off)",
    );
    assert!(!criu_tests::procs::is_alive(pid));
    let data = c.w.images.join(format!("gpusnap-{pid}-data-0.img"));
    let mut b = std::fs::read(&data).unwrap();
    let at = b.len() - 100;
    b[at] ^= 0x40;
    std::fs::write(&data, &b).unwrap();
    let r = c.restore();
    assert!(!r.succeeded());
    assert_log_has(&r, "restore refused");
    assert_log_has(&r, &format!("gpusnap-{pid}-data-0.img"));
    assert_log_has(&r, "nothing was restored and no GPU was touched");
    assert!(!criu_tests::procs::is_alive(pid));
    assert!(!c.kfd.log().contains("RESTORE"), "the KFD was touched");

    // A damaged KFD state file is refused too.
    b[at] ^= 0x40;
    std::fs::write(&data, &b).unwrap();
    let state = c.w.images.join(format!("gpusnap-{pid}-kfd.img"));
    let mut s = std::fs::read(&state).unwrap();
    let n = s.len() - 3;
    s[n] ^= 0x01;
    std::fs::write(&state, &s).unwrap();
    let r = c.restore();
    assert!(!r.succeeded());
    assert_log_has(&r, &format!("gpusnap-{pid}-kfd.img"));
}

#[test]
fn amd_topology_mismatch_is_refused_and_other_ids_are_translated() {
    let Some(mut c) = Case::start("amd-topology", &[FakeGpu::mi210(4660, 128)], 1) else {
        return;
    };
    c.dump(false).assert_ok();
    c.app.reap_dumped();
    let pid = c.app.root();
    // Another model only: refused before anything.
    c.kfd.stop();
    let mut other = FakeGpu::mi210(4660, 128);
    other.device_id = 0x744c;
    other.gfx_target_version = 110000;
    c.kfd = StandinSetup::start(c.sdir.path(), &[other], &daemon()).unwrap();
    let r = c.restore();
    assert!(!r.succeeded());
    assert_log_has(&r, "no GPU here can take the place of gpu_id 4660");
    assert_log_has(&r, "no GPU of that model here");
    assert!(!criu_tests::procs::is_alive(pid));
    // The same model, too small.
    c.kfd.stop();
    let mut small = FakeGpu::mi210(4660, 128);
    small.vram_bytes = 1 << 20;
    c.kfd = StandinSetup::start(c.sdir.path(), &[small], &daemon()).unwrap();
    let r = c.restore();
    assert!(!r.succeeded());
    assert_log_has(&r, "too small");
    // The same model under another gpu_id and render node: restored there.
    c.kfd.stop();
    c.kfd = StandinSetup::start(c.sdir.path(), &[FakeGpu::mi210(9999, 129)], &daemon()).unwrap();
    let r = c.restore();
    r.assert_ok();
    assert_log_has(
        &r,
        "gpu_id 4660 of the image is restored on local gpu_id 9999",
    );
    let p = c.process();
    assert_eq!(state(&p), "running");
    c.wait_counter(pid, p["counter"].as_u64().unwrap() + 2);
    let fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.display().to_string())
        .collect();
    assert!(
        fds.iter().any(|f| f.ends_with("/renderD129")),
        "the restored process's render node is not the new GPU's: {fds:?}"
    );
    assert!(c.kfd.log().contains("4660: 9999"), "{}", c.kfd.log());
}

#[test]
fn amd_two_gpus_dump_and_restore() {
    let gpus = [FakeGpu::mi210(4660, 128), FakeGpu::mi210(4661, 129)];
    let Some(mut c) = Case::start("amd-two-gpus", &gpus, 2) else {
        return;
    };
    let p = c.process();
    assert_eq!(p["devices"].as_array().unwrap().len(), 2);
    assert_eq!(bo_hashes(&p).len(), 2);
    let (dump, _) = dump_restore_and_check(&mut c);
    assert_log_has(&dump, "checkpointed: 2 GPUs");
    assert_eq!(c.process()["devices"].as_array().unwrap().len(), 2);
}

/// CRIU's own amdgpu plugin in the same plugin directory (a stand-in of it): gpusnap leaves
/// every AMD file to it, so exactly one plugin handles `/dev/kfd`, and never gpusnap twice.
#[test]
fn amd_coexists_with_criu_amdgpu_plugin() {
    let Some(c) = Case::start("amd-coexist", &[FakeGpu::mi210(4660, 128)], 1) else {
        return;
    };
    // A cdylib only: `cargo test` never builds it.
    let so = criu_tests::build::package(
        &c.w.harness().profile_dir,
        "fake-amdgpu-plugin",
        "libfake_amdgpu_plugin.so",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    std::fs::copy(&so, c.w.plugins.join("amdgpu_plugin.so"))
        .unwrap_or_else(|e| panic!("{}: {e}", so.display()));
    // A loaded amdgpu plugin that takes nothing: gpusnap still defers, nobody takes the
    // process's device mappings (CRIU meets them before its files), CRIU refuses the dump, the
    // process runs on untouched.
    let d = c.dump(true);
    assert!(!d.succeeded());
    assert_log_has(&d, "amdgpu_plugin.so is loaded");
    assert_log_has(&d, "left to it");
    assert_log_has(&d, "Can't handle non-regular mapping");
    // The amdgpu plugin takes the files: the dump succeeds without gpusnap touching the KFD.
    let mut args =
        c.w.criu_args_in("dump", &c.w.images, &c.w.images.join("dump2.log"));
    args.splice(1..1, ["-t".to_owned(), c.app.root().to_string()]);
    args.push("--leave-running".into());
    let env = [
        (STANDIN_ENV, c.sdir.path().display().to_string()),
        ("GPUSNAP_TEST_FAKE_AMDGPU", "claim".to_owned()),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let d = c.w.run_criu(&args, &env, &c.w.images.join("dump2.log"));
    d.assert_ok();
    assert_log_has(&d, "fake amdgpu_plugin: took file");
    assert_log_has(&d, "fake amdgpu_plugin: took a device mapping");
    assert!(!d.log.contains("queues paused"), "gpusnap acted too");
    assert!(
        !c.files().iter().any(|f| f.ends_with("-kfd.img")),
        "{:?}",
        c.files()
    );
    assert!(
        !c.kfd.log().contains("PROCESS_INFO"),
        "the KFD was asked to pause:\n{}",
        c.kfd.log()
    );
    assert_eq!(state(&c.process()), "running");
}

/// A tree of three AMD processes (a parent and two children, each its own KFD process) in one
/// dump and one restore: each is paused, checkpointed, restored and resumed on its own.
#[test]
fn amd_process_tree_dumps_and_restores() {
    let Some(h) = harness("amd_process_tree_dumps_and_restores") else {
        return;
    };
    let w = h.workdir("amd-tree");
    let sdir = TempDir::short("kfd");
    let kfd = StandinSetup::start(sdir.path(), &[FakeGpu::mi210(4660, 128)], &daemon())
        .unwrap_or_else(|e| panic!("{e}"));
    let d = sdir.path().display().to_string();
    let app = w.spawn(
        "amd-app",
        &app(),
        &[
            "--dir",
            &d,
            "--log",
            "counter.log",
            "--seed",
            "11",
            "--children",
            "2",
        ],
        &[],
        &["counter.log", "child0.log", "child1.log"],
    );
    let mut c = Case { w, kfd, sdir, app };
    let pids = c.app.pids.clone();
    let hashes: Vec<Vec<(u64, u64)>> = pids
        .iter()
        .map(|&p| {
            c.wait_counter(p, 2);
            bo_hashes(&c.kfd.process(p as u32))
        })
        .collect();
    assert_ne!(
        hashes[0], hashes[1],
        "the processes' buffers should differ (seeds)"
    );
    let dump = c.dump(false);
    dump.assert_ok();
    assert_eq!(
        dump.log.matches("checkpointed:").count(),
        3,
        "{}",
        dump.gpusnap_lines().join("\n")
    );
    c.app.reap_dumped();
    let at_dump: Vec<u64> = (0..3).map(|i| c.app.log(i).last()).collect();
    let restore = c.restore();
    restore.assert_ok();
    assert_eq!(
        restore.log.matches("GPU queues resumed (RESUME)").count(),
        3
    );
    for (i, &p) in pids.iter().enumerate() {
        let st = c.kfd.process(p as u32);
        assert_eq!(state(&st), "running", "{st}");
        assert_eq!(bo_hashes(&st), hashes[i], "pid {p}: BO contents differ");
        c.wait_counter(p, st["counter"].as_u64().unwrap() + 2);
        c.app.wait_for(i, at_dump[i] + 3).verify().unwrap();
    }
}

/// A mapping of a device gpusnap does not own (another block device) is not claimed: CRIU
/// refuses the dump, and the process runs on with its GPU queues running.
#[test]
fn amd_foreign_device_mapping_is_refused() {
    let Some(h) = harness("amd_foreign_device_mapping_is_refused") else {
        return;
    };
    let w = h.workdir("amd-foreign-map");
    let sdir = TempDir::short("kfd");
    let kfd = StandinSetup::start(sdir.path(), &[FakeGpu::mi210(4660, 128)], &daemon())
        .unwrap_or_else(|e| panic!("{e}"));
    let other = fake_kfd::LoopDevice::attach(&sdir.path().join("other.store")).unwrap();
    let node = w.path.join("other-dev");
    fake_kfd::make_block_node(&node, other.rdev).unwrap();
    let d = sdir.path().display().to_string();
    let n = node.display().to_string();
    let app = w.spawn(
        "amd-app",
        &app(),
        &[
            "--dir",
            &d,
            "--log",
            "counter.log",
            "--seed",
            "5",
            "--map-foreign",
            &n,
        ],
        &[],
        &["counter.log"],
    );
    let c = Case { w, kfd, sdir, app };
    c.wait_counter(c.app.root(), 3);
    let d = c.dump(false);
    assert!(!d.succeeded(), "a foreign mapping was claimed");
    assert_log_has(&d, "Can't handle non-regular mapping");
    assert!(
        !c.kfd.log().contains("PROCESS_INFO"),
        "the KFD was asked to pause"
    );
    assert_eq!(state(&c.process()), "running");
    c.app.assert_alive();
    let last = c.app.log(0).last();
    c.app.wait_for(0, last + 2).verify().unwrap();
}

/// A device mapping the image does not record (here: removed from the KFD state, as an image
/// of a gpusnap that did not record mappings would be) cannot be made again: the restore fails
/// before the process runs, naming the mapping, and no KFD process is left running.
#[test]
fn amd_untranslatable_mapping_fails_the_restore() {
    let Some(mut c) = Case::start("amd-untranslatable", &[FakeGpu::mi210(4660, 128)], 1) else {
        return;
    };
    c.dump(false).assert_ok();
    c.app.reap_dumped();
    let pid = c.app.root();
    let dir = std::fs::File::open(&c.w.images).unwrap();
    use std::os::fd::AsFd;
    let mut st =
        gpusnap_image::read_kfd_state(dir.as_fd(), gpusnap_proto::pid::NsPid(pid as u32)).unwrap();
    assert_eq!(st.vmas.len(), 2);
    let dropped = st.vmas.remove(0);
    std::fs::write(
        c.w.images.join(format!("gpusnap-{pid}-kfd.img")),
        gpusnap_image::encode_kfd_state_unchecked(&st),
    )
    .unwrap();
    let r = c.restore();
    assert!(
        !r.succeeded(),
        "a restore with an untranslatable mapping succeeded"
    );
    assert_log_has(&r, &format!("device mapping at {:#x}", dropped.start));
    assert_log_has(&r, "records no such mapping");
    assert_log_has(&r, "ended before it runs");
    let _ = criu_tests::procs::reap(pid, Duration::from_secs(5));
    criu_tests::procs::wait_pid_free(pid, Duration::from_secs(20)).unwrap();
    let left = c.kfd.status(pid as u32);
    assert!(
        left["processes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| state(p) != "running"),
        "a KFD process runs after a failed restore: {left}"
    );
    assert!(!c.kfd.log().contains("RESUME:"), "{}", c.kfd.log());
}

// ---- Fail closed: CRIU killed at every AMD phase boundary (`GPUSNAP_TEST_KILL_CRIU_AT`) ----
//
// What each kill must leave, from the plugin's protocol (rocm-backend/src/run/phase.rs), not from
// what a run showed:
// - in a dump or its undo (`-R`), the process's queues are paused and its device memory is in
//   place (an AMD dump releases none): it runs on the CPU, computes nothing on the GPU, and
//   `gpusnap recover PID` starts its queues with its buffer objects bit-exact;
// - in a restore, the half-restored process dies (the restored task itself, or
//   `PTRACE_O_EXITKILL` armed before RESUME), and the image restores again.

/// The knob (the plugin's `fault::ENV`).
const KNOB: &str = "GPUSNAP_TEST_KILL_CRIU_AT";

/// Every AMD point the cells cover, in the plugin's order.
const AMD_POINTS: &[&str] = &[
    "amd-dump-paused",
    "amd-dump-checkpointed",
    "amd-rollback",
    "amd-restore-state",
    "amd-restore-resume",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Dump,
    DumpLeaveRunning,
    Restore,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Left {
    /// Alive, its GPU queues paused, its BOs intact: `gpusnap recover` unpauses it.
    Paused,
    /// The restored process is dead; the image restores again.
    Killed,
}

fn expected(op: Op, point: &str) -> Option<Left> {
    match (point, op) {
        ("amd-dump-paused" | "amd-dump-checkpointed", Op::Dump | Op::DumpLeaveRunning) => {
            Some(Left::Paused)
        }
        ("amd-rollback", Op::DumpLeaveRunning) => Some(Left::Paused),
        ("amd-restore-state" | "amd-restore-resume", Op::Restore) => Some(Left::Killed),
        _ => None,
    }
}

#[test]
fn amd_matrix_names_every_amd_fault_point() {
    assert_eq!(AMD_POINTS, gpusnap_host::fault::AMD_POINTS);
    for p in AMD_POINTS {
        let reached: Vec<Op> = [Op::Dump, Op::DumpLeaveRunning, Op::Restore]
            .into_iter()
            .filter(|o| expected(*o, p).is_some())
            .collect();
        assert!(!reached.is_empty(), "{p} is never reached");
        assert_eq!(
            reached.iter().all(|o| *o == Op::Restore),
            p.starts_with("amd-restore-"),
            "{p}: {reached:?}"
        );
    }
}

/// Whether the run was cut by the knob at `point`.
fn killed_at(run: &CriuRun, point: &str) -> bool {
    use std::os::unix::process::ExitStatusExt;
    run.status.signal() == Some(libc::SIGKILL)
        && run
            .log
            .contains(&format!("test fault {KNOB}={point}: killing CRIU now"))
}

fn run_cli(c: &Case, args: &[&str]) -> (bool, String) {
    let cli = criu_tests::fake_driver::gpusnap_cli(c.w.harness()).unwrap_or_else(|e| panic!("{e}"));
    let out = std::process::Command::new(cli)
        .args(args)
        .env(STANDIN_ENV, c.sdir.path())
        .output()
        .expect("run gpusnap");
    (out.status.success(), output_text(&out))
}

fn amd_cell(op: Op, point: &'static str) {
    let name = format!("amd-fault-{point}-{op:?}");
    let Some(mut c) = Case::start(&name, &[FakeGpu::mi210(4660, 128)], 1) else {
        return;
    };
    let want = expected(op, point).expect("a cell of the matrix");
    let pid = c.app.root();
    let hashes = bo_hashes(&c.process());
    let knob = [(KNOB, point)];
    if op == Op::Restore {
        c.dump(false).assert_ok();
        c.app.reap_dumped();
        let r = c.restore_with(&knob);
        assert!(!r.succeeded(), "a restore cut at {point} succeeded");
        assert!(
            r.log.contains(&format!("test fault {KNOB}={point}")),
            "{point} not reached\n{}",
            r.diagnostics()
        );
        assert_eq!(want, Left::Killed);
        // Dead and reaped (we are the subreaper): nothing of it ran on.
        let _ = criu_tests::procs::reap(pid, Duration::from_secs(5));
        criu_tests::procs::wait_pid_free(pid, Duration::from_secs(20)).unwrap();
        let left = c.kfd.status(pid as u32);
        assert!(
            left["processes"]
                .as_array()
                .unwrap()
                .iter()
                .all(|p| state(p) != "running"),
            "a KFD process runs after a restore cut at {point}: {left}"
        );
        // The image is intact: it verifies, and a restore without the knob runs on bit-exact.
        let (ok, out) = run_cli(&c, &["verify", c.w.images.to_str().unwrap()]);
        assert!(ok, "gpusnap verify after a restore cut at {point}: {out}");
        c.restore().assert_ok();
        let p = c.process();
        assert_eq!(state(&p), "running");
        assert_eq!(bo_hashes(&p), hashes);
        return;
    }
    let run = c.dump_with(op == Op::DumpLeaveRunning, &knob);
    assert!(
        killed_at(&run, point),
        "CRIU was not killed at {point} ({})\n{}",
        run.status,
        run.diagnostics()
    );
    assert_eq!(want, Left::Paused);
    // Untraced, alive, its GPU queues stopped, its memory intact.
    let t0 = Instant::now();
    while criu_tests::procs::tracer_pid(pid) != Some(0) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "pid {pid} is still traced after CRIU died"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    c.app.assert_alive();
    let p = c.process();
    assert!(
        matches!(state(&p), "paused" | "checkpointed"),
        "after a kill at {point} the GPU queues run: {p}"
    );
    assert_eq!(bo_hashes(&p), hashes, "BO contents changed");
    let n = c.counter(pid);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(c.counter(pid), n, "the GPU queue counts while paused");
    // `gpusnap recover` starts its queues again; it runs on with its state intact.
    let (ok, out) = run_cli(&c, &["recover", &pid.to_string()]);
    assert!(ok, "gpusnap recover {pid}: {out}");
    assert!(out.contains("AMD GPU queues unpaused"), "{out}");
    let p = c.process();
    assert_eq!(state(&p), "running", "{p}");
    assert_eq!(bo_hashes(&p), hashes);
    c.wait_counter(pid, n + 3);
    let last = c.app.log(0).last();
    c.app.wait_for(0, last + 3).verify().unwrap();
    // A second recover finds nothing to do; a clean dump works.
    let (ok, out) = run_cli(&c, &["recover", &pid.to_string()]);
    assert!(ok && out.contains("nothing to recover"), "{out}");
    c.dump(true).assert_ok();
    assert_eq!(state(&c.process()), "running");
}

macro_rules! amd_cells {
    ($( $name:ident: $op:ident $point:literal; )*) => {
        $(
            #[test]
            fn $name() {
                amd_cell(Op::$op, $point);
            }
        )*
    };
}

amd_cells! {
    amd_fault_dump_paused: Dump "amd-dump-paused";
    amd_fault_dump_checkpointed: Dump "amd-dump-checkpointed";
    amd_fault_dump_r_paused: DumpLeaveRunning "amd-dump-paused";
    amd_fault_dump_r_checkpointed: DumpLeaveRunning "amd-dump-checkpointed";
    amd_fault_dump_r_rollback: DumpLeaveRunning "amd-rollback";
    amd_fault_restore_state: Restore "amd-restore-state";
    amd_fault_restore_resume: Restore "amd-restore-resume";
}
