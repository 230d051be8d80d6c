//! `fakegpu-vmm` on `libfakecudadev.so`, without CRIU (no root needed): alone, and with the
//! gpusnap agent preloaded, whose conversions must then be real VMM mappings of the stand-in
//! driver (memfds mapped over reservations) while the workload sees its data intact; and the
//! stand-in's checkpoint lock, which holds every driver call while `$FAKECUDA_DIR` says so.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::Duration;

use common::{Vmm, libcuda_dir};

fn workdir(name: &str) -> PathBuf {
    let d = common::profile_dir()
        .join("fake-cuda-device-tests")
        .join(format!("{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).expect("mkdir work dir");
    d
}

fn agent_so() -> PathBuf {
    common::built("gpusnap-agent", "libgpusnap_agent.so")
}

/// Threads of `pid` by name.
fn thread_names(pid: i32) -> Vec<String> {
    fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| fs::read_to_string(e.path().join("comm")).ok())
                .map(|c| c.trim_end().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Mappings of `pid` whose line contains `needle`.
fn maps_with(pid: i32, needle: &str) -> usize {
    fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

/// Lines of the workload's output where the stand-in driver reports a failed call.
/// The stand-in's failed calls, but the one `--app-vmm` makes on purpose (the export of its
/// handle created without shareable handle types, which must fail).
fn failed_calls(vmm: &Vmm) -> Vec<String> {
    fs::read_to_string(&vmm.out)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("fakecudadev[") && l.contains("failed"))
        .filter(|l| !l.contains("cuMemExportToShareableHandle failed: CUDA_ERROR_INVALID_VALUE"))
        .map(str::to_owned)
        .collect()
}

fn run(name: &str, args: &[&str], agent: bool) {
    run_on(name, args, agent, false);
}

/// As [`run`]; `no_posix_fd`: the stand-in's devices say they have no POSIX-fd handles.
fn run_on(name: &str, args: &[&str], agent: bool, no_posix_fd: bool) {
    let dir = workdir(name);
    let lib = libcuda_dir(&dir);
    let agent_so = agent_so();
    let mut env: Vec<(&str, &Path)> = vec![
        ("LD_LIBRARY_PATH", &lib),
        ("FAKECUDADEV_DEBUG", Path::new("1")),
    ];
    if agent {
        env.push(("LD_PRELOAD", &agent_so));
        env.push(("GPUSNAP_AGENT_DEBUG", Path::new("1")));
    }
    if no_posix_fd {
        env.push(("FAKECUDA_NO_POSIX_FD", Path::new("1")));
    }
    let vmm = Vmm::start(&dir, "vmm", 1, args, &env);
    let log = vmm.wait_for_tick(6).remove(0);
    if let Err(e) = log.check() {
        panic!("{e}\n{}", vmm.describe());
    }
    let app_vmm = args.contains(&"--app-vmm");
    assert_eq!(
        log.allocs,
        5 + u64::from(app_vmm),
        "3 data allocations, the small one, the counter (and the app's own VMM)"
    );
    let pid = vmm.pid();
    let names = thread_names(pid);
    assert!(
        names.iter().any(|n| n == "fakecuda-rt"),
        "no restore thread: {names:?}"
    );
    let out = fs::read_to_string(&vmm.out).unwrap_or_default();
    let device_maps = maps_with(pid, "/memfd:fakecuda-dev");
    if agent {
        assert!(
            names.iter().any(|n| n == "gpusnap-agent"),
            "no agent thread: {names:?}\n{}",
            vmm.describe()
        );
        let converted = out.lines().filter(|l| l.contains("converted #")).count();
        assert_eq!(
            converted,
            4,
            "the three data allocations and the counter are converted, the 64 KiB one is not\n{}",
            vmm.describe()
        );
        let exportable = out
            .lines()
            .filter(|l| l.contains("converted #") && l.ends_with(", exportable"))
            .count();
        let expected = if no_posix_fd { 0 } else { 4 };
        assert_eq!(
            exportable,
            expected,
            "conversions are exportable (POSIX fds) where the device supports it\n{}",
            vmm.describe()
        );
        assert_eq!(
            device_maps,
            4 + usize::from(app_vmm),
            "one memfd mapping per conversion (and the app's own)"
        );
        if args.contains(&"proc") {
            assert!(
                out.contains("cuGetProcAddress(cuMemAlloc, 13000): handing out our hook"),
                "{}",
                vmm.describe()
            );
        }
    } else {
        assert_eq!(
            device_maps,
            usize::from(app_vmm),
            "no VMM but the app's own"
        );
    }
    let failed = failed_calls(&vmm);
    assert!(failed.is_empty(), "{failed:?}\n{}", vmm.describe());
    drop(vmm);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn runs_on_the_stand_in_driver_alone() {
    run("alone-dlsym", &["--seed", "7"], false);
}

#[test]
fn runs_alone_through_cu_get_proc_address() {
    run("alone-proc", &["--resolve", "proc", "--app-vmm"], false);
}

#[test]
fn runs_with_the_agent_converting_its_allocations() {
    run(
        "agent-dlsym",
        &["--app-vmm", "--threads", "2", "--seed", "3"],
        true,
    );
}

#[test]
fn runs_with_the_agent_through_cu_get_proc_address() {
    run("agent-proc", &["--resolve", "proc"], true);
}

/// A device without POSIX-fd handles: the agent converts as before, not exportable.
#[test]
fn runs_with_the_agent_on_a_device_without_posix_fd_handles() {
    run_on("agent-no-fd", &["--seed", "5"], true, true);
}

/// While `$FAKECUDA_DIR/<pid>.state` says `locked`, every driver call of the process waits (as
/// the real driver's lock holds every CUDA call); `running` lets them go on.
#[test]
fn the_checkpoint_lock_holds_driver_calls() {
    let dir = workdir("lock");
    let lib = libcuda_dir(&dir);
    let state = dir.join("fakecuda");
    fs::create_dir_all(&state).expect("mkdir");
    let vmm = Vmm::start(
        &dir,
        "vmm",
        1,
        &["--threads", "1"],
        &[
            ("LD_LIBRARY_PATH", &lib),
            ("FAKECUDADEV_DEBUG", Path::new("1")),
            ("FAKECUDA_DIR", &state),
        ],
    );
    let file = state.join(format!("{}.state", vmm.pid()));
    let set = |s: &str| {
        let tmp = state.join("tmp");
        fs::write(&tmp, format!("{s}\n")).expect("write state");
        fs::rename(&tmp, &file).expect("rename state");
    };
    set("locked");
    sleep(Duration::from_millis(200));
    let held = vmm.last_ticks()[0];
    sleep(Duration::from_millis(400));
    assert_eq!(
        vmm.last_ticks()[0],
        held,
        "ticks went on while locked\n{}",
        vmm.describe()
    );
    set("running");
    let log = vmm.wait_for_tick(held + 3).remove(0);
    if let Err(e) = log.check() {
        panic!("{e}\n{}", vmm.describe());
    }
    drop(vmm);
    let _ = fs::remove_dir_all(&dir);
}
