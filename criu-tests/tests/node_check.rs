//! A node that cannot take an image is refused at the restore's `init`, before CRIU creates any
//! process, with one message naming every mismatch (issue 35): real CRIU, the split path's
//! stand-ins, the job left running by `dump -R`.
//!
//! - the image records what a restore needs (`requires`: the stand-in kernel driver's version
//!   from `GPUSNAP_TEST_NVIDIA_VERSION`, the digest of the job's `libcuda.so.1`, the device memory
//!   per GPU), and `gpusnap inspect --json` shows it with the driver-stack identity;
//! - another kernel driver version, another driver library at the job's path
//!   (`GPUSNAP_TEST_DRIVER_ROOT`), another GPU model, and all three at once: refused, CRIU forks
//!   no task, the driver restores nothing, the job ticks on;
//! - `device_map` onto a GPU the node lacks, on a node whose capability tree shows no MIG
//!   instance (`capabilities/gpu0/mig/` empty beside the listing): refused the same way, naming
//!   that UUID and the node's GPUs;
//! - other GPUs of the same model (`FAKECUDA_UUID_SALT`) on a node with another kernel driver
//!   and `allow_other_kernel_driver = true`: restored, bit-exact.
//! - the free memory of the listed GPUs is asked of NVML at `init`, in a child process that is
//!   gone before CRIU forks the tree: with the dumped GPU listed (so the early check runs and asks)
//!   the restore goes on, bit-exact. The stand-in has no NVML (the child answers that it cannot
//!   tell), so a refusal for free memory is shown by the unit tests only.
//!
//! Root and CRIU are needed, as for `criu-tests`; `GPUSNAP_SKIP_CRIU_TESTS=1` skips.

mod common;

use common::split::Split;
use criu_tests::CriuRun;
use std::fs;
use std::path::Path;

const DUMP_VERSION: &str = "580.95.05";
const OTHER_VERSION: &str = "575.57.08";

fn version_file(dir: &Path, name: &str, version: &str) -> String {
    let path = dir.join(name);
    fs::write(
        &path,
        format!(
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Tue Sep 23 09:55:41 UTC 2025\nGCC version:  gcc version 12.2.0\n"
        ),
    )
    .expect("write version file");
    path.to_str().expect("utf-8 path").to_owned()
}

/// 32 hex digits as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as `nvidia-smi -L` and the
/// kernel driver's `information` files write a UUID.
fn dashed(hex: &str) -> String {
    assert_eq!(hex.len(), 32, "not a UUID: {hex}");
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

impl Split {
    /// The stand-in driver's restore calls so far (a `-R` dump makes one).
    fn driver_restores(&self) -> usize {
        self.calls()
            .lines()
            .filter(|l| l.starts_with("restore "))
            .count()
    }

    /// The restore was refused before anything was created, naming each of `needles` on one
    /// line; the job dumped with `-R` still runs on.
    fn assert_refused_early(&self, restores_before: usize, run: &CriuRun, needles: &[&str]) {
        assert!(
            !run.status.success(),
            "the restore succeeded\n{}",
            self.describe(run)
        );
        let mut all = vec!["restore refused: this node cannot take the image"];
        all.extend_from_slice(needles);
        all.push("before CRIU restored any process");
        self.assert_line(run, &all);
        assert!(
            !run.log.contains("Forking task"),
            "CRIU forked a task before the refusal\n{}",
            self.describe(run)
        );
        assert_eq!(
            self.driver_restores(),
            restores_before,
            "the driver restore was called\n{}",
            self.describe(run)
        );
        let before = self.vmm.last_ticks()[0];
        self.vmm.wait_for_tick(before + 2);
        for log in self.vmm.read() {
            log.check()
                .unwrap_or_else(|e| panic!("{e}\n{}", self.describe(run)));
        }
    }
}

#[test]
fn a_node_that_cannot_take_the_image_is_refused_before_any_process_is_created() {
    let test = "node-check";
    let Some(mut s) = Split::launch(
        test,
        1,
        &["--seed", "5", "--allocs", "2", "--mib", "2"],
        &[],
    ) else {
        return;
    };
    let dir = s.w.path.clone();
    let at_dump = version_file(&dir, "version-dump", DUMP_VERSION);
    let other = version_file(&dir, "version-other", OTHER_VERSION);
    let dump = s.dump_with(true, &[("GPUSNAP_TEST_NVIDIA_VERSION", &at_dump)]);
    s.assert_ok(&dump);
    assert!(s.vmm.original_running(), "{}", s.describe(&dump));

    // What the image says a restore needs.
    let images = s.w.images.to_str().expect("utf-8 path").to_owned();
    let (ok, out) = s.run_cli(&["inspect", "--json", &images]);
    assert!(ok, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let p = &v["processes"][0];
    assert_eq!(p["requires"]["kernel_driver"], DUMP_VERSION, "{out}");
    let lib = &p["requires"]["driver_library"];
    let lib_path = lib["path"].as_str().unwrap_or_else(|| panic!("{out}"));
    assert!(lib_path.ends_with("/libcuda.so.1"), "{out}");
    assert_eq!(lib["xxh3_128"].as_str().map(str::len), Some(32), "{out}");
    let identity = v["driver_stack_identity"].as_str().unwrap_or_default();
    assert!(
        identity.starts_with(&format!("nvidia={DUMP_VERSION};"))
            && identity.contains("lib=libcuda.so.1@"),
        "{out}"
    );
    assert!(
        v["min_gpu_memory_bytes"].as_u64().unwrap_or(0) >= 4 << 20,
        "{out}"
    );

    let restores = s.driver_restores();
    // Another kernel driver.
    let run = s.restore_in(
        "restore-kernel.log",
        &[("GPUSNAP_TEST_NVIDIA_VERSION", &other)],
    );
    s.assert_refused_early(
        restores,
        &run,
        &[DUMP_VERSION, OTHER_VERSION, "allow_other_kernel_driver"],
    );

    // Another driver library at the job's path on "this node".
    let root = dir.join("node-b-root");
    let lib_b = root.join(lib_path.trim_start_matches('/'));
    fs::create_dir_all(lib_b.parent().expect("a parent")).expect("mkdir");
    let mut bytes = fs::read(lib_path).expect("read the job's library");
    bytes[100] ^= 0xff;
    fs::write(&lib_b, &bytes).expect("write another library");
    let root_env = root.to_str().expect("utf-8 path").to_owned();
    let run = s.restore_in(
        "restore-library.log",
        &[
            ("GPUSNAP_TEST_NVIDIA_VERSION", &at_dump),
            ("GPUSNAP_TEST_DRIVER_ROOT", &root_env),
        ],
    );
    s.assert_refused_early(restores, &run, &["driver library", lib_path, "differs"]);

    // All at once, another GPU model too: one line, every mismatch numbered.
    let proc_other = dir.join("proc-other-model");
    let bus = proc_other.join("0000:10:00.0");
    fs::create_dir_all(&bus).expect("mkdir bus");
    fs::write(
        bus.join("information"),
        "Model: \t\t Other GPU\nGPU UUID: \t GPU-00000000-0000-0000-0000-0000000000bb\n",
    )
    .expect("write information");
    fs::remove_file(&lib_b).expect("remove");
    let proc_env = proc_other.to_str().expect("utf-8 path").to_owned();
    let run = s.restore_in(
        "restore-all.log",
        &[
            ("GPUSNAP_TEST_NVIDIA_VERSION", &other),
            ("GPUSNAP_TEST_DRIVER_ROOT", &root_env),
            ("GPUSNAP_TEST_NVIDIA_PROC", &proc_env),
        ],
    );
    s.assert_refused_early(
        restores,
        &run,
        &[
            "(1) ",
            OTHER_VERSION,
            "(2) ",
            "is not on this node",
            "(3) ",
            "is not on this host",
        ],
    );

    // device_map onto a GPU this node does not have, on a node that lists the dump's own GPU and
    // has no MIG instance (laid out like /proc/driver/nvidia: the listing, and beside it the
    // capability tree as the driver makes it with MIG off, `gpu0/mig/` with no `gi*`): the
    // target cannot be a MIG instance, so it is refused here, named, with the node's GPUs.
    let dumped = p["gpus"][0]["uuid"]
        .as_str()
        .unwrap_or_else(|| panic!("{out}"))
        .to_owned();
    let node = dir.join("node-no-mig");
    let listing = node.join("gpus");
    let bus = listing.join("0000:10:00.0");
    fs::create_dir_all(&bus).expect("mkdir bus");
    fs::create_dir_all(node.join("capabilities/gpu0/mig")).expect("mkdir capabilities");
    fs::write(
        bus.join("information"),
        format!("Model: \t\t Fake GPU\nGPU UUID: \t {}\n", dashed(&dumped)),
    )
    .expect("write information");
    let listing_env = listing.to_str().expect("utf-8 path").to_owned();
    let absent = "GPU-deadbeef-0000-4000-8000-00000000dead";
    let map = format!("{}={absent}", dashed(&dumped));
    let run = s.restore_in(
        "restore-device-map.log",
        &[
            ("GPUSNAP_TEST_NVIDIA_VERSION", &at_dump),
            ("GPUSNAP_TEST_NVIDIA_PROC", &listing_env),
            ("GPUSNAP_DEVICE_MAP", &map),
        ],
    );
    s.assert_refused_early(
        restores,
        &run,
        &[
            &format!("device_map target {absent} is not on this host"),
            "no MIG instances",
            &format!("{} (Fake GPU)", dashed(&dumped)),
            "Fix device_map",
        ],
    );

    // Other GPUs of the same model, another kernel driver allowed: restored, bit-exact (from a
    // dump that stopped the job, so that its pids are free).
    s.clear_images();
    let dump = s.dump_with(false, &[("GPUSNAP_TEST_NVIDIA_VERSION", &at_dump)]);
    s.assert_ok(&dump);
    let last = s.reap_dumped();
    let run = s.restore_in(
        "restore.log",
        &[
            ("GPUSNAP_TEST_NVIDIA_VERSION", &other),
            ("GPUSNAP_ALLOW_OTHER_KERNEL_DRIVER", "true"),
            ("FAKECUDA_UUID_SALT", "5"),
        ],
    );
    s.assert_ok(&run);
    s.assert_line(&run, &["is restored onto GPU"]);
    s.assert_runs_on(&last, &run);
}

/// `init` asks NVML for free memory in a child process of CRIU's, which it reaps before it
/// returns: CRIU then forks and restores the tree as ever (on 4.1 and 4.2).
#[test]
fn free_memory_is_asked_at_init_apart_from_criu() {
    let test = "node-free-apart";
    let Some(mut s) = Split::launch(
        test,
        1,
        &["--seed", "6", "--allocs", "2", "--mib", "2"],
        &[],
    ) else {
        return;
    };
    let dump = s.dump_with(false, &[]);
    s.assert_ok(&dump);
    let images = s.w.images.to_str().expect("utf-8 path").to_owned();
    let (ok, out) = s.run_cli(&["inspect", "--json", &images]);
    assert!(ok, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let dumped = v["processes"][0]["gpus"][0]["uuid"]
        .as_str()
        .unwrap_or_else(|| panic!("{out}"))
        .to_owned();
    let last = s.reap_dumped();
    let listing = s.w.path.join("node-listing");
    let bus = listing.join("0000:10:00.0");
    fs::create_dir_all(&bus).expect("mkdir bus");
    fs::write(
        bus.join("information"),
        format!("Model: \t\t Fake GPU\nGPU UUID: \t {}\n", dashed(&dumped)),
    )
    .expect("write information");
    let listing_env = listing.to_str().expect("utf-8 path").to_owned();
    let run = s.restore_in("restore.log", &[("GPUSNAP_TEST_NVIDIA_PROC", &listing_env)]);
    s.assert_ok(&run);
    s.assert_line(
        &run,
        &[
            "free memory of 0 of 1 GPUs known before CRIU's restore",
            "asked in a child process",
        ],
    );
    s.assert_runs_on(&last, &run);
}
