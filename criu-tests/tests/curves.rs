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
