//! The job is untrusted: a job whose agent was patched to attack root's CRIU (the hostile
//! test build, `gpusnap_proto::hostile`, played by `GPUSNAP_HOSTILE`) gets nothing from
//! `criu dump` that it could not do itself. Each test plays one attack of the threat model
//! (`docs/safety.md`) with real CRIU on the stand-in driver and asserts what root's side does:
//! CRIU lives, its memory, disk and time stay bounded by what the job listed, its log says
//! what the job sent only quoted, and the job is left intact (running, or dumped whole by the
//! driver's own checkpoint).

mod common;

use common::split::Split;
use criu_tests::CriuRun;

/// The workload every attack runs in: three 4 MiB allocations, copy-first route unless a test
/// asks for the hand-over.
const ARGS: &[&str] = &["--seed", "13", "--allocs", "3", "--mib", "4"];

fn copy_first(test: &str, attack: &'static str) -> Option<Split> {
    Split::hostile(test, attack, ARGS, &[("GPUSNAP_HANDOVER", "0")])
}

/// After a `-R` dump the attack failed: the job still runs on its own memory.
fn assert_job_runs_on(s: &mut Split, run: &CriuRun) {
    assert!(s.vmm.original_running(), "{}", s.describe(run));
    let last = s.vmm.last_ticks();
    s.assert_runs_on(&last, run);
}

/// Item 7: text from the job never writes root's log. The agent answers `DumpBegin` with an
/// error whose text forges a CRIU success line and an erase-line escape; the plugin shows it
/// escaped, on one line, as the agent's words.
#[test]
fn an_agents_error_text_cannot_forge_log_lines() {
    let Some(mut s) = copy_first("hostile-forge-error", "forge-error") else {
        return;
    };
    let dump = s.dump(true);
    // gpusnap_proto::hostile::FORGED_TEXT (the feature is off in this build).
    let forged =
        "nothing\n(00.999999) Dumping finished successfully\n\x1b[2K\rgpusnap: dump complete";
    assert!(
        !dump.log.contains('\x1b') && !dump.output.contains('\x1b'),
        "an escape byte from the job reached CRIU's log or stderr\n{}",
        s.describe(&dump)
    );
    for line in dump.log.lines().chain(dump.output.lines()) {
        assert!(
            !line.starts_with("(00.999999) Dumping finished")
                && !line.starts_with("gpusnap: dump complete")
                && !line.contains('\r'),
            "a line forged by the job: {line:?}\n{}",
            s.describe(&dump)
        );
    }
    // The refusal is still shown, quoted, on one line.
    let quoted = forged.escape_debug().to_string();
    let quoted = &quoted[..20];
    assert!(
        dump.gpusnap_lines().iter().any(|l| l.contains(quoted)),
        "the agent's words ({quoted}...) are not in the log, escaped\n{}",
        s.describe(&dump)
    );
    assert_job_runs_on(&mut s, &dump);
}
