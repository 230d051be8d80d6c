//! An MPS daemon of the process's user makes its CUDA processes MPS clients, which the driver
//! checkpoint cannot take: gpusnap refuses the dump with the daemon named, before the process
//! is touched. The daemon here is `sleep` under the name `nvidia-cuda-mps-control`, which is
//! what gpusnap looks for; the real one was run on the H200 (`gpu/torch_cases.sh --cases mps`).
//!
//! A test binary of its own: the stand-in daemon runs as root, the uid of every test's
//! workload, so it would refuse the dumps of tests running next to it.
//!
//! Root and CRIU are needed (`GPUSNAP_SKIP_CRIU_TESTS=1` skips).

mod common;

use std::fs;
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use common::split::Split;

/// `sleep` copied to `nvidia-cuda-mps-control` in `dir` and started: its command name is
/// what a real MPS control daemon's is.
fn stand_in_mps_daemon(dir: &std::path::Path) -> Child {
    let exe = dir.join("nvidia-cuda-mps-control");
    fs::copy("/bin/sleep", &exe).expect("copy /bin/sleep");
    Command::new(&exe)
        .arg("600")
        .stdin(Stdio::null())
        .spawn()
        .expect("start the stand-in MPS daemon")
}

/// Waits until `pid` is a zombie (exited, not reaped).
fn wait_zombie(pid: u32) {
    let t0 = Instant::now();
    loop {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat
            .rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z'))
        {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "pid {pid} not a zombie: {stat}"
        );
        sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_mps_daemon_refuses_the_dump_until_it_exits() {
    let Some(mut s) = Split::launch(
        "mps-daemon",
        1,
        &["--seed", "5", "--allocs", "2", "--mib", "4"],
        &[],
    ) else {
        return;
    };
    let mut daemon = stand_in_mps_daemon(&s.w.path);
    s.vmm.wait_for_tick(3);

    let dump = s.dump(true);
    let killed = daemon.kill();
    assert!(
        !dump.succeeded(),
        "the dump succeeded with an MPS daemon running\n{}",
        s.describe(&dump)
    );
    let daemon_pid = daemon.id().to_string();
    s.assert_line(
        &dump,
        &[
            "cannot be checkpointed",
            "CUDA MPS",
            "nvidia-cuda-mps-control",
            &daemon_pid,
        ],
    );
    let calls =
        fs::read_to_string(s.state.join(format!("{}.log", s.vmm.pid()))).unwrap_or_default();
    assert!(
        !calls.lines().any(|l| l.starts_with("lock")),
        "the process was locked before the refusal\n{calls}"
    );
    assert!(s.vmm.original_running(), "{}", s.describe(&dump));
    s.assert_runs_on(&s.vmm.last_ticks(), &dump);

    // The daemon has exited but is not reaped yet: it serves no client, and the dump goes on.
    killed.expect("kill the stand-in MPS daemon");
    wait_zombie(daemon.id());
    let dump = s.dump(true);
    let _ = daemon.wait();
    s.assert_ok(&dump);
    s.assert_runs_on(&s.vmm.last_ticks(), &dump);
}
