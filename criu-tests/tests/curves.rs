//! Curves on the stand-in drivers (issue 36, item 4): measurements, not checks of behaviour, so
//! every test here is `#[ignore]` and `bench/standin-curves.sh` runs them
//! (`cargo test -p criu-tests --test curves -- --ignored --nocapture --test-threads 1`).
//! Each prints one JSON object per case on a line starting `CURVE ` (the script collects them).
//!
//! The stand-in's device memory is host memory and its driver calls are function calls: the
//! figures show the structure (what grows with what), not a GPU's speed.
//!
//! Root and CRIU are needed (`GPUSNAP_SKIP_CRIU_TESTS=1` skips).

mod common;

use common::split::Split;
use criu_tests::CriuRun;

/// The number after `key` in `line` (`key` ends where the number starts).
fn number_after(line: &str, key: &str) -> Option<f64> {
    let rest = &line[line.find(key)? + key.len()..];
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

fn line_with<'a>(run: &'a CriuRun, needle: &str) -> &'a str {
    run.gpusnap_lines()
        .into_iter()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no gpusnap line with {needle:?}\n{}", run.diagnostics()))
}

fn emit(kind: &str, fields: &[(&str, String)]) {
    let body: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    let line = format!("CURVE {{\"kind\":\"{kind}\",{}}}\n", body.join(","));
    print!("{line}");
}

/// The lend's time against the allocation count: `N` allocations of 1 MiB handed over to the
/// keeper in one dump (the workload killed), from the dump's log line.
#[test]
#[ignore = "a measurement: bench/standin-curves.sh runs it"]
fn lend_time_against_the_allocation_count() {
    for n in [16usize, 64, 256, 1312] {
        let allocs = n.to_string();
        let Some(mut s) = Split::launch(
            "curves-lend",
            1,
            &["--seed", "5", "--allocs", &allocs, "--mib", "1"],
            &[],
        ) else {
            return;
        };
        let dump = s.dump(false);
        s.assert_ok(&dump);
        let lent = line_with(&dump, "lent to keeper pid");
        let lend = line_with(&dump, "dump phases:");
        s.reap_dumped();
        let f = |l: &str, k: &str| {
            number_after(l, k)
                .map(|v| format!("{v}"))
                .unwrap_or_else(|| "null".into())
        };
        let lent_count = lent
            .split(" allocations (")
            .next()
            .and_then(|h| h.rsplit(' ').next())
            .unwrap_or("null")
            .to_owned();
        emit(
            "lend",
            &[
                ("allocations_lent", lent_count),
                ("workload_allocs", allocs.clone()),
                ("lend_phase_s", f(lend, "lend ")),
                ("pipelined_s", f(lent, "pipelined in ")),
                ("keeper_round_trip_s", f(lent, "one keeper round trip ")),
                ("keeper_wait_s", f(lent, "waited ")),
                ("line", format!("{:?}", lent.trim())),
            ],
        );
    }
}

/// Seconds from CRIU's seize of the job to its thaw, from the `-v4` log's timestamps: the
/// pause the job feels (the driver lock before the seize is not counted).
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

/// `gpusnap precopy <job> --images <dir>` (a round while the job runs).
fn precopy_round(s: &Split, dir: &std::path::Path) {
    let out = std::process::Command::new(&s.cli)
        .arg("precopy")
        .arg(s.vmm.pid().to_string())
        .arg("--images")
        .arg(dir)
        .env("GPUSNAP_LIBCUDA", &s.fakecuda_so)
        .env("FAKECUDA_DIR", &s.state)
        .envs(s.common_env.iter().copied())
        .output()
        .expect("run gpusnap precopy");
    assert!(
        out.status.success(),
        "gpusnap precopy failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// At stand-in sizes 64 MiB to 1 GiB, in the same run on the same job: a full `criu dump -R`
/// (its pause, and the drain beside it), then a pre-copy round and the final `-R` dump against
/// it (its pause, the drain, what it referenced).
#[test]
#[ignore = "a measurement: bench/standin-curves.sh runs it"]
fn pre_copy_final_pause_against_a_full_dump() {
    for mib in [64u64, 256, 1024] {
        let per = (mib / 4).to_string();
        let Some(s) = Split::launch(
            "curves-precopy",
            1,
            &["--seed", "9", "--allocs", "4", "--mib", &per],
            &[],
        ) else {
            return;
        };
        s.vmm.wait_for_tick(2);
        let full_dir = s.w.path.join("full");
        std::fs::create_dir_all(&full_dir).expect("mkdir full");
        let pid = s.vmm.pid().to_string();
        let full = s.criu_at(&full_dir, "dump", "full.log", &["-t", &pid, "-R"], &[]);
        s.assert_ok(&full);
        let pre = s.w.path.join("pre1");
        precopy_round(&s, &pre);
        let fin_dir = s.w.path.join("final");
        std::fs::create_dir_all(&fin_dir).expect("mkdir final");
        std::os::unix::fs::symlink("../pre1", fin_dir.join("parent")).expect("parent link");
        let fin = s.criu_at(&fin_dir, "dump", "final.log", &["-t", &pid, "-R"], &[]);
        s.assert_ok(&fin);
        let drain = |r: &CriuRun| {
            let l = line_with(r, "the drain ran");
            (
                number_after(l, "the drain ran ").unwrap_or(f64::NAN),
                number_after(l, "it waited ").unwrap_or(f64::NAN),
            )
        };
        let (full_drain, full_wait) = drain(&full);
        let (fin_drain, fin_wait) = drain(&fin);
        let checked = fin
            .gpusnap_lines()
            .into_iter()
            .find(|l| l.contains("parent image read back and checked"))
            .map_or("null".to_owned(), |l| format!("{:?}", l.trim()));
        emit(
            "precopy",
            &[
                ("mib", mib.to_string()),
                ("full_pause_s", format!("{:.3}", pause_s(&full))),
                ("full_drain_s", format!("{full_drain}")),
                ("full_wait_s", format!("{full_wait}")),
                ("final_pause_s", format!("{:.3}", pause_s(&fin))),
                ("final_drain_s", format!("{fin_drain}")),
                ("final_wait_s", format!("{fin_wait}")),
                ("parent_check", checked),
            ],
        );
        for &p in &s.vmm.pids {
            // SAFETY: kill(2) of the test's own workload.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
    }
}

/// The drain's write rate with the image directory on tmpfs (`/dev/shm`, where a GPU host's
/// CRIU images often go): a `criu dump -R` of 4 allocations of 256 MiB to 1 GiB in all, its pause
/// (seize to thaw), the data line the drain logs (its bytes, seconds and rate), and how long
/// the hand-over waited for the drain's space to be held (`null` where that line is not
/// logged). On tmpfs holding space allocates and zeroes pages, and a write into a page not yet
/// allocated does the same.
#[test]
#[ignore = "a measurement: bench/standin-curves.sh runs it"]
fn drain_write_rate_with_images_in_dev_shm() {
    for mib in [256u64, 1024] {
        let per = (mib / 4).to_string();
        let Some(s) = Split::launch(
            "curves-shm",
            1,
            &["--seed", "13", "--allocs", "4", "--mib", &per],
            &[],
        ) else {
            return;
        };
        s.vmm.wait_for_tick(2);
        let dir = std::path::PathBuf::from(format!(
            "/dev/shm/gpusnap-curves-{}-{mib}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir in /dev/shm");
        let pid = s.vmm.pid().to_string();
        let dump = s.criu_at(&dir, "dump", "shm.log", &["-t", &pid, "-R"], &[]);
        s.assert_ok(&dump);
        let data = line_with(&dump, "GiB/s) into");
        let drain = line_with(&dump, "the drain ran");
        let held = dump
            .gpusnap_lines()
            .into_iter()
            .find(|l| l.contains("space for the drain held"))
            .and_then(|l| number_after(l, "the hand-over waited "))
            .map_or("null".to_owned(), |v| format!("{v}"));
        let f = |l: &str, k: &str| {
            number_after(l, k)
                .map(|v| format!("{v}"))
                .unwrap_or_else(|| "null".into())
        };
        emit(
            "shm_drain",
            &[
                ("mib", mib.to_string()),
                ("pause_s", format!("{:.3}", pause_s(&dump))),
                ("drain_s", f(drain, "the drain ran ")),
                ("drain_wait_s", f(drain, "it waited ")),
                ("data_s", f(data, " GiB in ")),
                ("data_gib_per_s", f(data, " s (")),
                ("reserve_wait_s", held),
            ],
        );
        let _ = std::fs::remove_dir_all(&dir);
        for &p in &s.vmm.pids {
            // SAFETY: kill(2) of the test's own workload.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
    }
}
