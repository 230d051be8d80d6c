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

/// Item 1: root never runs a library the job chose. The job maps a file of its own named
/// `libcuda.so.666` (first in its maps, below the real driver); a dump with the hand-over on
/// and no test override of the keeper's library must not load it in root's keeper: the job's
/// driver library is not the host's (here the checkpoint stand-in), so the memory is copied
/// first, with the reason logged. The library's constructor records every process it runs in.
#[test]
fn root_never_loads_a_driver_library_the_job_chose() {
    let Some(h) = criu_tests::harness("hostile-job-libcuda") else {
        return;
    };
    // Built outside the test's work dir so that it exists before the workload starts.
    let dir = criu_tests::build::profile_dir()
        .join("criu-tests")
        .join(format!("hostile-libcuda-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let evil = dir.join("libcuda.so.666");
    let marker = dir.join("ran-in");
    let src = dir.join("evil.c");
    std::fs::write(
        &src,
        format!(
            r#"#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>
__attribute__((constructor)) static void ran(void) {{
    FILE *f = fopen("{marker}", "a");
    if (f) {{ fprintf(f, "%d\n", (int)getpid()); fclose(f); }}
    /* Mapped again low, so it is the first libcuda.so* line of the job's maps. */
    int fd = open("{evil}", O_RDONLY);
    if (fd >= 0) {{ mmap((void *)0x10000000, 4096, PROT_READ, MAP_PRIVATE, fd, 0); close(fd); }}
}}
"#,
            marker = marker.display(),
            evil = evil.display()
        ),
    )
    .expect("write evil.c");
    let cc = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&evil)
        .arg(&src)
        .output()
        .expect("run cc");
    assert!(
        cc.status.success(),
        "cc: {}",
        criu_tests::fixtures::output_text(&cc)
    );
    let agent = h.agent_so().expect("agent").to_owned();
    let preload: &'static str =
        Box::leak(format!("{}:{}", evil.display(), agent.display()).into_boxed_str());
    let Some(mut s) = Split::launch_agent(
        "hostile-job-libcuda",
        1,
        ARGS,
        &[("LD_PRELOAD", preload)],
        Some(agent),
    ) else {
        return;
    };
    s.common_env.retain(|(k, _)| *k != "LD_PRELOAD");
    s.vmm.wait_for_tick(2);
    let job = s.vmm.pid();
    let maps = std::fs::read_to_string(format!("/proc/{job}/maps")).expect("maps");
    let first = maps.lines().find(|l| l.contains("libcuda.so"));
    assert!(
        first.is_some_and(|l| l.contains("libcuda.so.666")),
        "the job's own library is not its first libcuda mapping: {first:?}"
    );
    // Hand-over on, no test override: the dump's keeper would pick the job's library.
    let dump = s.dump_with(true, &[("GPUSNAP_TEST_KEEPER_LIBCUDA", "")]);
    s.assert_ok(&dump);
    let ran: Vec<String> = std::fs::read_to_string(&marker)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect();
    assert!(
        ran.iter().all(|p| *p == job.to_string()),
        "the job's library ran in another process (pids {ran:?}, job {job})\n{}",
        s.describe(&dump)
    );
    s.assert_line(&dump, &["no hand-over", "not the host's driver library"]);
    assert_job_runs_on(&mut s, &dump);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Item 8: root's keeper maps only where the job listed. The agent lends every allocation at
/// another address than it listed; the plugin refuses the hand-over before the keeper maps
/// anything, copies the memory first, and the image restores bit-exact.
#[test]
fn a_lend_at_another_address_than_listed_is_refused() {
    let Some(mut s) = Split::hostile("hostile-lend-addr", "lend-addr:0x40000000", ARGS, &[]) else {
        return;
    };
    s.vmm.wait_for_tick(2);
    let dump = s.dump(false);
    s.assert_ok(&dump);
    s.assert_line(&dump, &["refusing to map where the job alone says"]);
    let last = s.reap_dumped();
    let restore = s.restore();
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
}
