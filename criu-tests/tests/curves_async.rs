//! Curves on the stand-in drivers for the asynchronous `criu dump -R` (issue 36, items 1 and 4):
//! at stand-in sizes 64 MiB to 1 GiB, in the same run on the same job, the `-R` pause without
//! the route (the drain on the pause, the baseline), with it (the keeper's device-to-device
//! snapshot on the pause, the drain after CRIU returns: how long until `gpusnap wait` says
//! complete), with it and room for part of the job (`FAKECUDA_FREE_MIB`: the largest
//! allocations that fit in the snapshot, the rest drained on the pause), and with it but too
//! little free device memory for any allocation (all drained on the pause). A measurement, `#[ignore]`: `bench/async-curves.sh` runs it. Each case prints
//! one JSON object on a line starting `CURVE `.
//!
//! The stand-in's device memory is host memory: its "device-to-device" copy is a host memcpy
//! and its drain a host-to-file copy at a 2-core machine's speed. The figures show structure
//! (what the pause grows with), not a GPU's speed.

mod common;

use common::split::Split;
use criu_tests::CriuRun;
use std::time::Instant;

/// Seconds from CRIU's seize of the job to its thaw (the `-v4` log's timestamps).
fn pause_s(run: &CriuRun) -> f64 {
    let ts = |needle: &str| {
        run.log
            .lines()
            .find(|l| l.contains(needle))
            .and_then(|l| l.strip_prefix('('))
            .and_then(|l| l.split(')').next())
            .and_then(|t| t.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {needle:?} line in {}", run.log_path.display()))
    };
    ts("Unfreezing tasks") - ts("Seized task")
}

fn has(run: &CriuRun, needle: &str) -> bool {
    run.gpusnap_lines().iter().any(|l| l.contains(needle))
}

#[test]
#[ignore = "a measurement: bench/async-curves.sh runs it"]
fn async_leave_running_pause_against_the_drain_on_the_pause() {
    for mib in [64u64, 256, 1024] {
        let per = (mib / 4).to_string();
        // Half of this much free is allowed: about a third of the job goes into the snapshot
        // (the largest allocation and the counter), the rest is drained on the pause.
        let free_mib = mib.to_string();
        let Some(s) = Split::launch(
            "curves-async",
            1,
            &["--seed", "5", "--allocs", "4", "--mib", &per],
            &[],
        ) else {
            return;
        };
        s.vmm.wait_for_tick(2);
        let pid = s.vmm.pid().to_string();
        let mut cases = Vec::new();
        for (case, env) in [
            ("sync", vec![]),
            ("async", vec![("GPUSNAP_ASYNC_LEAVE_RUNNING", "1")]),
            (
                "async_part",
                vec![
                    ("GPUSNAP_ASYNC_LEAVE_RUNNING", "1"),
                    ("FAKECUDA_FREE_MIB", free_mib.as_str()),
                ],
            ),
            (
                "async_no_room",
                vec![
                    ("GPUSNAP_ASYNC_LEAVE_RUNNING", "1"),
                    ("FAKECUDA_FREE_MIB", "2"),
                ],
            ),
        ] {
            let dir = s.w.path.join(case);
            std::fs::create_dir_all(&dir).expect("mkdir");
            let t0 = Instant::now();
            let run = s.criu_at(
                &dir,
                "dump",
                &format!("{case}.log"),
                &["-t", &pid, "-R"],
                &env,
            );
            let criu_s = t0.elapsed().as_secs_f64();
            s.assert_ok(&run);
            let out = std::process::Command::new(&s.cli)
                .args(["wait", dir.to_str().expect("utf-8"), "--timeout", "600"])
                .output()
                .expect("gpusnap wait");
            assert!(
                out.status.success(),
                "{case}: gpusnap wait: {}",
                String::from_utf8_lossy(&out.stdout)
            );
            let complete_s = t0.elapsed().as_secs_f64();
            cases.push(format!(
                "\"{case}\":{{\"pause_s\":{:.3},\"criu_s\":{criu_s:.3},\"complete_s\":{complete_s:.3},\"snapshot\":{}}}",
                pause_s(&run),
                has(&run, "copied device to device into the keeper's snapshot")
            ));
        }
        println!(
            "CURVE {{\"kind\":\"async_R\",\"mib\":{mib},{}}}",
            cases.join(",")
        );
        for &p in &s.vmm.pids {
            // SAFETY: kill(2) of the test's own workload.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
    }
}
