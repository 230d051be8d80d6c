//! The split path with a process on two GPUs, end to end with a real CRIU: `fakegpu-vmm
//! --devices 2` on the stand-in driver `libfakecudadev.so` (`FAKECUDA_DEVICES=2`: half of its
//! data allocations made on device 1) with the gpusnap agent preloaded, CRIU with the plugin and
//! the checkpoint-API stand-in `libfakecuda.so`, which reports two GPUs too and records the GPUs
//! of each checkpoint and the GPU pairs each restore is given.
//!
//! - dump + restore and `dump -R`: data intact on both devices, bytes logged per GPU;
//! - `device_map` swapping the two GPUs: the plugin logs both moves and the driver gets both
//!   pairs;
//! - the restore host's GPUs have other UUIDs (`FAKECUDA_UUID_SALT`), same model: the pairs are
//!   chosen automatically;
//! - another GPU model (`FAKECUDA_DEVICE_NAME`): the restore is refused, naming the GPU, before
//!   the driver restores anything; the image still restores on the right GPUs afterwards.
//!
//! Root and CRIU are needed, as for `criu-tests`; `GPUSNAP_SKIP_CRIU_TESTS=1` skips.

mod common;

use common::split::Split;
use criu_tests::{CriuRun, procs};

/// The UUID (hex) of device `ordinal` as both stand-ins report it, with `FAKECUDA_UUID_SALT`
/// `salt` (0: none).
fn uuid(ordinal: u8, salt: u8) -> String {
    let mut u = [
        0xfa, 0x4e, 0xc0, 0xda, 0x00, 0x00, 0x40, 0x00, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x01,
    ];
    u[15] = ordinal + 1;
    if salt != 0 {
        u[4] = salt;
    }
    u.iter().map(|b| format!("{b:02x}")).collect()
}

impl Split {
    /// A split dump of memory on both GPUs, with the bytes of each GPU logged.
    fn assert_two_gpu_dump(&self, dump: &CriuRun) {
        self.assert_ok(dump);
        let pid = self.vmm.pid();
        self.assert_line(dump, &[&format!("pid {pid} "), "path split"]);
        // 4 data allocations (two per device) and the counter on device 0.
        self.assert_line(
            dump,
            &[&format!("pid {pid}: "), "agent released 5 allocations"],
        );
        for dev in 0..2 {
            self.assert_line(dump, &[&format!("pid {pid}: GPU {dev}: "), "GiB"]);
        }
    }

    /// The stand-in's log lines of successful restores.
    fn restores(&self) -> Vec<String> {
        self.calls()
            .lines()
            .filter(|l| l.starts_with("restore rc=0 "))
            .map(str::to_owned)
            .collect()
    }
}

/// Dump + restore of a process with memory on two GPUs: both GPUs' data goes through the agent
/// and comes back intact; the GPUs stay where they were, so the driver gets no pairs.
#[test]
fn two_gpus_dump_and_restore() {
    let Some(mut s) = Split::two_gpus("multi-gpu-dump-restore") else {
        return;
    };
    let dump = s.dump(false);
    s.assert_two_gpu_dump(&dump);
    let last = s.reap_dumped();
    let restore = s.restore_in("restore.log", &[]);
    s.assert_ok(&restore);
    s.assert_line(&restore, &["restored (Split path)", "data"]);
    s.assert_runs_on(&last, &restore);
    let r = s.restores();
    assert!(
        r.len() == 1 && r[0].contains(" pairs=0 "),
        "{r:?}\n{}",
        s.describe(&restore)
    );
}

/// `dump -R` of a process on two GPUs: the rollback reloads both GPUs' memory and the process
/// never stops counting.
#[test]
fn two_gpus_dump_leave_running_rolls_back() {
    let Some(mut s) = Split::two_gpus("multi-gpu-dump-R") else {
        return;
    };
    let dump = s.dump(true);
    s.assert_two_gpu_dump(&dump);
    // The hand-over: the -R maps the memory of both GPUs back from what the job kept.
    s.assert_line(&dump, &["device memory mapped back", "no file read"]);
    assert!(s.vmm.original_running(), "{}", s.describe(&dump));
    s.assert_runs_on(&s.vmm.last_ticks(), &dump);
}

/// `device_map` swapping the two GPUs: the plugin logs both moves, the driver gets both pairs
/// (the stand-in checks them against the checkpointed GPUs and the host's), and the data
/// comes back intact.
#[test]
fn device_map_swaps_the_gpus() {
    let Some(mut s) = Split::two_gpus("multi-gpu-device-map") else {
        return;
    };
    let dump = s.dump(false);
    s.assert_two_gpu_dump(&dump);
    let last = s.reap_dumped();
    let (u0, u1) = (uuid(0, 0), uuid(1, 0));
    let map = format!("{u0}={u1},{u1}={u0}");
    let restore = s.restore_in("restore.log", &[("GPUSNAP_DEVICE_MAP", &map)]);
    s.assert_ok(&restore);
    s.assert_line(&restore, &[&format!("GPU {u0} is restored onto GPU {u1}")]);
    s.assert_line(&restore, &[&format!("GPU {u1} is restored onto GPU {u0}")]);
    s.assert_runs_on(&last, &restore);
    let r = s.restores();
    let want = format!(" pairs=2 gpu_pairs={u0}={u1},{u1}={u0} ");
    assert!(
        r.len() == 1 && r[0].contains(&want),
        "{want} not in {r:?}\n{}",
        s.describe(&restore)
    );
}

/// The restore host's GPUs have other UUIDs, of the same model: each checkpointed GPU is
/// replaced by one of them automatically, and the driver gets the pairs.
#[test]
fn other_gpus_of_the_same_model_are_chosen_automatically() {
    let Some(mut s) = Split::two_gpus("multi-gpu-auto") else {
        return;
    };
    let dump = s.dump(false);
    s.assert_two_gpu_dump(&dump);
    let last = s.reap_dumped();
    let restore = s.restore_in("restore.log", &[("FAKECUDA_UUID_SALT", "5")]);
    s.assert_ok(&restore);
    for dev in 0..2 {
        let line = format!("GPU {} is restored onto GPU {}", uuid(dev, 0), uuid(dev, 5));
        s.assert_line(&restore, &[&line]);
    }
    s.assert_runs_on(&last, &restore);
    let r = s.restores();
    let want = format!(
        " pairs=2 gpu_pairs={}={},{}={} ",
        uuid(0, 0),
        uuid(0, 5),
        uuid(1, 0),
        uuid(1, 5)
    );
    assert!(
        r.len() == 1 && r[0].contains(&want),
        "{want} not in {r:?}\n{}",
        s.describe(&restore)
    );
}

/// Another GPU model on the restore host (the same UUIDs, or other ones): the restore is refused
/// with the GPU named, before the driver restores anything, and nothing runs. The image is left
/// as it was: on the right GPUs it restores afterwards.
#[test]
fn another_gpu_model_is_refused() {
    let Some(mut s) = Split::two_gpus("multi-gpu-other-model") else {
        return;
    };
    let dump = s.dump(false);
    s.assert_two_gpu_dump(&dump);
    let last = s.reap_dumped();
    let u0 = uuid(0, 0);
    for (i, env, why) in [
        (
            0,
            vec![("FAKECUDA_DEVICE_NAME", "Other GPU")],
            "the GPU model must be the same",
        ),
        (
            1,
            vec![
                ("FAKECUDA_DEVICE_NAME", "Other GPU"),
                ("FAKECUDA_UUID_SALT", "5"),
            ],
            "not on this host",
        ),
    ] {
        let restore = s.restore_in(&format!("restore-refused-{i}.log"), &env);
        assert!(
            !restore.status.success(),
            "the restore onto another GPU model succeeded\n{}",
            s.describe(&restore)
        );
        s.assert_line(&restore, &[&format!("GPU {u0}"), why]);
        assert!(
            !s.calls().lines().any(|l| l.starts_with("restore ")),
            "the driver restore was called\n{}",
            s.describe(&restore)
        );
        procs::reap(s.vmm.pid(), common::WAIT).unwrap_or_else(|e| panic!("{e}"));
        assert!(!procs::is_alive(s.vmm.pid()), "{}", s.describe(&restore));
        assert_eq!(s.vmm.last_ticks(), last, "{}", s.describe(&restore));
        procs::wait_pid_free(s.vmm.pid(), common::WAIT).unwrap_or_else(|e| panic!("{e}"));
    }
    let restore = s.restore_in("restore.log", &[]);
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
}

/// Writes a directory laid out like `/proc/driver/nvidia/gpus`: one GPU per (uuid hex, model).
/// (The real files write `GPU-` and dashes; that form is covered by the plugin's unit tests.)
fn fake_nvidia_proc(dir: &std::path::Path, gpus: &[(String, &str)]) {
    for (i, (hex, model)) in gpus.iter().enumerate() {
        let bus = dir.join(format!("0000:{:02x}:00.0", 0x10 + i));
        std::fs::create_dir_all(&bus).expect("mkdir bus");
        let info =
            format!("Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t {hex}\nBus Type: \t PCIe\n");
        std::fs::write(bus.join("information"), info).expect("write information");
    }
}

/// When the kernel driver's GPU list (`/proc/driver/nvidia/gpus`, here a stand-in directory)
/// shows only other GPUs of another model, the restore is refused in `init`: CRIU forks no
/// process at all, and the driver is never called. When it lists the dump's own GPUs (whatever
/// it calls their model) the same image restores.
#[test]
fn another_gpu_model_is_refused_before_any_process_is_restored() {
    let Some(mut s) = Split::two_gpus("multi-gpu-other-model-early") else {
        return;
    };
    let dump = s.dump(false);
    s.assert_two_gpu_dump(&dump);
    let last = s.reap_dumped();
    procs::wait_pid_free(s.vmm.pid(), common::WAIT).unwrap_or_else(|e| panic!("{e}"));
    let (u0, u1) = (uuid(0, 0), uuid(1, 0));
    // Other GPUs (other UUIDs) of another model.
    let other = s.w.path.join("proc-other-model");
    fake_nvidia_proc(
        &other,
        &[(uuid(0, 5), "Other GPU"), (uuid(1, 5), "Other GPU")],
    );
    let other_env = other.to_str().expect("utf-8 path").to_owned();
    let restore = s.restore_in(
        "restore-refused-early.log",
        &[("GPUSNAP_TEST_NVIDIA_PROC", &other_env)],
    );
    assert!(
        !restore.status.success(),
        "the restore onto another GPU model succeeded\n{}",
        s.describe(&restore)
    );
    s.assert_line(
        &restore,
        &[
            &format!("GPU {u0}"),
            "is not on this host",
            "before CRIU restored any process",
        ],
    );
    assert!(
        !restore.log.contains("Forking task"),
        "CRIU forked a task before the refusal\n{}",
        s.describe(&restore)
    );
    assert!(
        !s.calls().lines().any(|l| l.starts_with("restore ")),
        "the driver restore was called\n{}",
        s.describe(&restore)
    );
    assert!(!procs::is_alive(s.vmm.pid()), "{}", s.describe(&restore));

    // The dump's own GPUs, with the model spelled another way: the same GPUs, never refused.
    let same = s.w.path.join("proc-same-gpus");
    fake_nvidia_proc(&same, &[(u0, "FAKE GPU (rev 2)"), (u1, "FAKE GPU (rev 2)")]);
    let same_env = same.to_str().expect("utf-8 path").to_owned();
    let restore = s.restore_in("restore.log", &[("GPUSNAP_TEST_NVIDIA_PROC", &same_env)]);
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
}
