//! `scripts/test.sh` never reports what did not run as passed.
//!
//! The script runs here on a copy of itself in a scratch "repository" whose
//! `scripts/install-criu.sh`, `scripts/install-containerd.sh` and
//! `scripts/install-checkpointctl.sh` do nothing, with a `PATH` of stand-ins only: a `cargo` that
//! prints the test output each case gives it and exits with its status, an `id` that says root,
//! and (where the case has one) a `python3` that prints unittest's output, plus the few real
//! tools the script uses. Each case checks the summary and the exit status: a test's
//! `SKIPPED` line, an `#[ignore]`d test, a skipped Python test and a missing `python3` are listed
//! and never make "all checks passed"; `GPUSNAP_REQUIRE_ALL=1` makes a skip a failure; a
//! failure still lists what was skipped before it.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use criu_tests::fixtures::TempDir;

/// The real tools `scripts/test.sh` runs, besides the stand-ins.
const TOOLS: [&str; 10] = [
    "bash", "sh", "dirname", "readlink", "mktemp", "tee", "grep", "sort", "rm", "cat",
];

struct Case<'a> {
    /// `cargo test`'s output and status, against CRIU 4.1.1 and against 4.2.
    test_out: [&'a str; 2],
    test_rc: [i32; 2],
    /// unittest's output, or no `python3` at all.
    python: Option<&'a str>,
    env: &'a [(&'a str, &'a str)],
}

impl Default for Case<'_> {
    fn default() -> Self {
        Case {
            test_out: ["test a::b ... ok\n", "test a::b ... ok\n"],
            test_rc: [0, 0],
            python: Some("test_x (test_m.C.test_x) ... ok\n\nOK\n"),
            env: &[],
        }
    }
}

struct Ran {
    rc: i32,
    out: String,
}

fn script(path: &Path, text: &str) {
    fs::write(path, text).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

fn run(case: &Case) -> Ran {
    let tmp = TempDir::new("test-sh");
    let root = tmp.path();
    let scripts = root.join("scripts");
    let bin = root.join("bin");
    let data = root.join("data");
    for d in [&scripts, &bin, &data] {
        fs::create_dir_all(d).unwrap();
    }
    fs::copy(repo().join("scripts/test.sh"), scripts.join("test.sh")).unwrap();
    script(&scripts.join("install-criu.sh"), "#!/bin/sh\nexit 0\n");
    for stub in ["install-containerd.sh", "install-checkpointctl.sh"] {
        script(&scripts.join(stub), "#!/bin/sh\nexit 0\n");
    }
    for tool in TOOLS {
        let real = criu_tests::podman::which(tool).unwrap_or_else(|| panic!("no {tool} on PATH"));
        std::os::unix::fs::symlink(real, bin.join(tool)).unwrap();
    }
    script(&bin.join("id"), "#!/bin/sh\necho 0\n");
    for (i, suite) in ["trixie", "sid"].iter().enumerate() {
        fs::write(data.join(format!("test-{suite}.out")), case.test_out[i]).unwrap();
        fs::write(
            data.join(format!("test-{suite}.rc")),
            case.test_rc[i].to_string(),
        )
        .unwrap();
    }
    script(
        &bin.join("cargo"),
        &format!(
            "#!/bin/sh\n\
             case $1 in\n\
             test) s=${{GPUSNAP_CRIU_SUITE:-trixie}}; cat '{d}'/test-$s.out; exit $(cat '{d}'/test-$s.rc) ;;\n\
             *) exit 0 ;;\n\
             esac\n",
            d = data.display()
        ),
    );
    if let Some(py) = case.python {
        fs::write(data.join("python.out"), py).unwrap();
        script(
            &bin.join("python3"),
            &format!(
                "#!/bin/sh\ncat '{}' >&2\nexit 0\n",
                data.join("python.out").display()
            ),
        );
    }
    let mut cmd = Command::new(bin.join("bash"));
    cmd.arg(scripts.join("test.sh"))
        .env_clear()
        .env("PATH", &bin)
        .env("TMPDIR", root);
    for (k, v) in case.env {
        cmd.env(k, v);
    }
    let o = cmd.output().unwrap();
    Ran {
        rc: o.status.code().unwrap_or(-1),
        out: format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    }
}

const ALL_PASSED: &str = "all checks passed (nothing skipped or ignored)";
const PASSED_EXCEPT: &str = "test.sh: passed, except what was SKIPPED or IGNORED (above)";

#[test]
fn everything_ran() {
    let r = run(&Case::default());
    assert_eq!(r.rc, 0, "{}", r.out);
    assert!(r.out.contains(ALL_PASSED), "{}", r.out);
    assert!(!r.out.contains("SKIPPED"), "{}", r.out);
}

#[test]
fn a_skipped_test_is_listed_and_never_passed() {
    let skipped = "test podman ... ok\ncriu-tests: SKIPPED podman: podman is not installed\n";
    let r = run(&Case {
        test_out: [skipped, "test a::b ... ok\n"],
        ..Case::default()
    });
    assert_eq!(r.rc, 0, "{}", r.out);
    assert!(
        r.out
            .contains("    SKIPPED cargo test (CRIU 4.1.1): podman: podman is not installed"),
        "{}",
        r.out
    );
    assert!(r.out.contains(PASSED_EXCEPT), "{}", r.out);
    assert!(!r.out.contains(ALL_PASSED), "{}", r.out);

    // The same with GPUSNAP_REQUIRE_ALL=1: a failure, naming what was skipped.
    let r = run(&Case {
        test_out: [skipped, "test a::b ... ok\n"],
        env: &[("GPUSNAP_REQUIRE_ALL", "1")],
        ..Case::default()
    });
    assert_ne!(r.rc, 0, "{}", r.out);
    assert!(
        r.out.contains("test.sh: FAILED: GPUSNAP_REQUIRE_ALL=1"),
        "{}",
        r.out
    );
    assert!(
        r.out.contains("SKIPPED cargo test (CRIU 4.1.1): podman"),
        "{}",
        r.out
    );
    assert!(
        !r.out.contains("test.sh: passed") && !r.out.contains(ALL_PASSED),
        "{}",
        r.out
    );
}

#[test]
fn another_crates_skip_is_listed_even_inside_a_line() {
    // Another test's output may be on the same line before it.
    let out = "test x ... gpusnap-agent: SKIPPED other_users_are_refused: needs root\nok\n";
    let r = run(&Case {
        test_out: ["test a::b ... ok\n", out],
        ..Case::default()
    });
    assert!(
        r.out
            .contains("    SKIPPED cargo test (CRIU 4.2): other_users_are_refused: needs root"),
        "{}",
        r.out
    );
    assert!(!r.out.contains(ALL_PASSED), "{}", r.out);
}

#[test]
fn ignored_tests_are_listed() {
    let out = "test keeper_killed ... ignored, known defect\ntest a ... ok\n\
               test result: ok. 1 passed; 0 failed; 1 ignored\n";
    for env in [&[][..], &[("GPUSNAP_REQUIRE_ALL", "1")][..]] {
        let r = run(&Case {
            test_out: [out, out],
            env,
            ..Case::default()
        });
        assert_eq!(r.rc, 0, "{env:?}\n{}", r.out);
        assert!(
            r.out
                .contains("    IGNORED cargo test (CRIU 4.1.1): keeper_killed, known defect"),
            "{}",
            r.out
        );
        assert!(r.out.contains(PASSED_EXCEPT), "{}", r.out);
        assert!(!r.out.contains(ALL_PASSED), "{}", r.out);
    }
}

#[test]
fn python_skips_and_a_missing_python_are_listed() {
    let r = run(&Case {
        python: Some("test_a (test_floor.T.test_a) ... skipped 'g++ missing'\n\nOK (skipped=1)\n"),
        ..Case::default()
    });
    assert_eq!(r.rc, 0, "{}", r.out);
    assert!(
        r.out
            .contains("    SKIPPED Python unit tests: test_a (test_floor.T.test_a): 'g++ missing'"),
        "{}",
        r.out
    );
    assert!(!r.out.contains(ALL_PASSED), "{}", r.out);

    let r = run(&Case {
        python: None,
        env: &[("GPUSNAP_REQUIRE_ALL", "1")],
        ..Case::default()
    });
    assert_ne!(r.rc, 0, "{}", r.out);
    assert!(r.out.contains("python3 not found"), "{}", r.out);
}

#[test]
fn the_criu_tests_skipped_by_request_are_listed() {
    let r = run(&Case {
        env: &[("GPUSNAP_SKIP_CRIU_TESTS", "1")],
        ..Case::default()
    });
    assert_eq!(r.rc, 0, "{}", r.out);
    assert!(
        r.out.contains("SKIPPED the CRIU roots and every CRIU test"),
        "{}",
        r.out
    );
    assert!(!r.out.contains(ALL_PASSED), "{}", r.out);
}

#[test]
fn a_failure_still_lists_what_was_skipped() {
    let r = run(&Case {
        test_out: [
            "criu-tests: SKIPPED podman: runc is not installed\ntest a ... FAILED\n",
            "",
        ],
        test_rc: [101, 0],
        ..Case::default()
    });
    assert_ne!(r.rc, 0, "{}", r.out);
    assert!(r.out.contains("test.sh: FAILED: tests failed"), "{}", r.out);
    assert!(
        r.out
            .contains("    SKIPPED cargo test (CRIU 4.1.1): podman: runc is not installed"),
        "{}",
        r.out
    );
    assert!(
        !r.out.contains("test.sh: passed") && !r.out.contains(ALL_PASSED),
        "{}",
        r.out
    );
}
