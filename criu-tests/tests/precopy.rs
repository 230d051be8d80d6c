//! Pre-copy rounds (`gpusnap precopy`) with real CRIU and the stand-in drivers: rounds copy
//! the device data of the running workload into directories of their own while it ticks on,
//! each round against the one before; the final `criu dump` into a directory whose `parent`
//! link leads to the last round copies only what changed since, and the restore is bit-exact
//! (the workload checks every byte of its device memory every tick).
//!
//! As in `incremental.rs`, the tests make the `parent` link themselves: CRIU's own
//! `--prev-images-dir` needs soft-dirty tracking, which the CI kernel lacks.
//!
//! Root and CRIU are needed (`GPUSNAP_SKIP_CRIU_TESTS=1` skips).

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::split::Split;

const MIB: u64 = 1 << 20;
/// 1 MiB chunks, so that an allocation is several chunks and a change can hit only one.
const CONFIG: [(&str, &str); 1] = [("GPUSNAP_STAGING_SLOT_MIB", "1")];

fn dir(s: &Split, name: &str) -> PathBuf {
    s.w.path.join(name)
}

/// `gpusnap precopy <workload> --images <name> [--parent ../<parent>] --json`, with the
/// plugin's stand-in driver and `CONFIG` in its environment.
fn precopy(s: &Split, name: &str, parent: Option<&str>) -> Output {
    let mut c = Command::new(&s.cli);
    c.arg("precopy")
        .arg(s.vmm.pid().to_string())
        .arg("--images")
        .arg(dir(s, name))
        .arg("--json");
    if let Some(p) = parent {
        c.arg("--parent").arg(format!("../{p}"));
    }
    c.env("GPUSNAP_LIBCUDA", &s.fakecuda_so)
        .env("FAKECUDA_DIR", &s.state)
        .envs(s.common_env.iter().copied())
        .envs(CONFIG)
        .output()
        .expect("run gpusnap precopy")
}

/// The JSON report of a round that succeeded.
fn report(s: &Split, out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "gpusnap precopy failed: {}{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.vmm.describe()
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn num(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

/// The workload ticked on, every tick correct, during and after `what`.
fn still_running(s: &Split, what: &str) {
    let after = s.vmm.last_ticks()[0] + 2;
    for log in s.vmm.wait_for_tick(after) {
        if let Err(e) = log.check() {
            panic!("after {what}: {e}\n{}", s.vmm.describe());
        }
    }
}

fn dump_stats(dir: &Path) -> serde_json::Value {
    let text = fs::read_to_string(dir.join("gpusnap-stats.json")).expect("gpusnap-stats.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("stats JSON");
    v["processes"][0]["data"].clone()
}

/// Two rounds while the workload runs (the second against the first), a change, then the
/// final dump against the second round: it writes only the changed MiB and the counter's
/// chunk, and the restore brings everything back bit for bit.
#[test]
fn rounds_then_a_dump_that_copies_only_what_changed() {
    let Some(mut s) = Split::launch(
        "precopy",
        1,
        &["--seed", "31", "--allocs", "3", "--mib", "4", "--app-vmm"],
        &[],
    ) else {
        return;
    };
    s.vmm.wait_for_tick(3);
    let r1 = report(&s, &precopy(&s, "pre1", None));
    still_running(&s, "round 1");
    // 4 + 4 + 6 (the odd size, rounded) + 2 MiB counter + the 2 MiB the workload maps itself.
    assert_eq!(num(&r1, "device_bytes"), 18 * MIB, "{r1}");
    let zero = num(&r1, "bytes_zero");
    assert_eq!(num(&r1, "bytes_written"), 18 * MIB - zero, "{r1}");
    assert_eq!(num(&r1, "bytes_referenced"), 0, "{r1}");
    // 3 data allocations, the counter and the workload's own mapping (the 64 KiB the agent
    // leaves to the driver is not in its table at all).
    assert_eq!(num(&r1, "allocations_saved"), 5, "{r1}");
    assert_eq!(num(&r1, "allocations_left"), 0, "{r1}");
    // The round's image is whole: gpusnap verify reads every chunk.
    let pre1 = dir(&s, "pre1");
    let (ok, text) = s.run_cli(&["verify", pre1.to_str().expect("utf-8 path")]);
    assert!(ok, "{text}");
    // A directory holding an image of this process is not written over.
    let again = precopy(&s, "pre1", None);
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("already holds a gpusnap image"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );

    s.change_some_data();
    let r2 = report(&s, &precopy(&s, "pre2", Some("pre1")));
    still_running(&s, "round 2");
    assert_eq!(r2["incremental"], true, "{r2}");
    // The changed MiB and the counter's chunk are copied again; the rest is referenced.
    assert_eq!(num(&r2, "bytes_written"), 2 * MIB, "{r2}");
    assert_eq!(num(&r2, "bytes_referenced"), 16 * MIB - zero, "{r2}");

    s.change_some_data();
    let st = final_dump_and_restore(&mut s, "pre2");
    assert_eq!(st["bytes_written"].as_u64(), Some(2 * MIB), "{st}");
    assert_eq!(
        st["bytes_referenced"].as_u64(),
        Some(16 * MIB - zero),
        "{st}"
    );
}

/// `criu dump` into `final`, whose `parent` link leads to round `parent`, then a restore that
/// must run on bit-exact from its references. Returns the dump's data stats.
fn final_dump_and_restore(s: &mut Split, parent: &str) -> serde_json::Value {
    let d = dir(s, "final");
    fs::create_dir_all(&d).expect("mkdir final");
    std::os::unix::fs::symlink(format!("../{parent}"), d.join("parent")).expect("parent link");
    let pid = s.vmm.pid().to_string();
    let dump = s.criu_at(&d, "dump", "dump.log", &["-t", &pid], &CONFIG);
    s.assert_ok(&dump);
    s.assert_line(&dump, &["incremental dump against the parent image"]);
    // The parent was read back and checked from the dump's start, beside CRIU's own steps.
    s.assert_line(
        &dump,
        &[
            "parent image read back and checked",
            "from the dump's start",
        ],
    );
    let st = dump_stats(&d);
    let restore = restore_runs_on(s, &d);
    s.assert_line(&restore, &["incremental image", "come from parent images"]);
    st
}

/// After a dump into `d` that killed the workload: a restore from `d` that runs on bit-exact.
fn restore_runs_on(s: &mut Split, d: &Path) -> criu_tests::CriuRun {
    let last = s.reap_dumped();
    let restore = s.criu_at(
        d,
        "restore",
        "restore.log",
        &["--restore-detached"],
        &CONFIG,
    );
    s.assert_ok(&restore);
    s.assert_runs_on(&last, &restore);
    restore
}

/// Rounds while the workload unmaps and maps its own VMM memory every tick: a round either
/// completes or fails saying the memory changed under it; the workload never sees a wrong
/// byte, and a dump against the last complete round restores bit-exact.
#[test]
fn rounds_under_remapping_never_harm_the_job() {
    let Some(mut s) = Split::launch(
        "precopy-remap",
        1,
        &[
            "--seed",
            "32",
            "--allocs",
            "2",
            "--mib",
            "4",
            "--app-vmm",
            "--app-vmm-remap",
        ],
        &[],
    ) else {
        return;
    };
    s.vmm.wait_for_tick(3);
    let mut complete = None;
    for k in 0..6 {
        let name = format!("pre{k}");
        let out = precopy(&s, &name, None);
        if out.status.success() {
            report(&s, &out);
            complete = Some(name);
        } else {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains("run the round again"), "round {k}: {err}");
            // A failed round leaves no image behind.
            let left: Vec<_> = fs::read_dir(dir(&s, &name))
                .map(|d| d.flatten().map(|e| e.file_name()).collect())
                .unwrap_or_default();
            assert!(left.is_empty(), "round {k} left {left:?}");
        }
        still_running(&s, &format!("round {k}"));
    }
    let Some(parent) = complete else {
        panic!("no round of six completed\n{}", s.vmm.describe());
    };
    final_dump_and_restore(&mut s, &parent);
}

/// A process without the agent gets a clear refusal, and nothing is written.
#[test]
fn a_round_needs_the_agent() {
    let Some(s) = Split::launch("precopy-no-agent", 1, &["--allocs", "1", "--mib", "1"], &[])
    else {
        return;
    };
    s.vmm.wait_for_tick(2);
    // Our own process (the test binary) holds no agent.
    let out = Command::new(&s.cli)
        .arg("precopy")
        .arg(std::process::id().to_string())
        .arg("--images")
        .arg(dir(&s, "none"))
        .env("GPUSNAP_LIBCUDA", &s.fakecuda_so)
        .env("FAKECUDA_DIR", &s.state)
        .output()
        .expect("run gpusnap precopy");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("has no gpusnap agent"), "{err}");
    let left: Vec<_> = fs::read_dir(dir(&s, "none"))
        .map(|d| d.flatten().collect())
        .unwrap_or_default();
    assert!(left.is_empty());
}

/// The CLI killed in the middle of a round (SIGKILL, at several points): the job never stops
/// or sees a wrong byte, the agent serves the next round, and that round's image is whole.
#[test]
fn a_round_killed_part_way_leaves_the_job_as_it_was() {
    let Some(s) = Split::launch(
        "precopy-killed",
        1,
        &["--seed", "33", "--allocs", "3", "--mib", "4"],
        &[],
    ) else {
        return;
    };
    s.vmm.wait_for_tick(3);
    for (k, after_ms) in [5u64, 30, 80].into_iter().enumerate() {
        let mut c = Command::new(&s.cli);
        c.arg("precopy")
            .arg(s.vmm.pid().to_string())
            .arg("--images")
            .arg(dir(&s, &format!("killed{k}")))
            .env("GPUSNAP_LIBCUDA", &s.fakecuda_so)
            .env("FAKECUDA_DIR", &s.state)
            .envs(CONFIG)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        let mut child = c.spawn().expect("start gpusnap precopy");
        std::thread::sleep(std::time::Duration::from_millis(after_ms));
        let _ = child.kill();
        let _ = child.wait();
        still_running(&s, &format!("a round killed after {after_ms} ms"));
    }
    let r = report(&s, &precopy(&s, "after", None));
    assert_eq!(num(&r, "allocations_left"), 0, "{r}");
    let after = dir(&s, "after");
    let (ok, text) = s.run_cli(&["verify", after.to_str().expect("utf-8 path")]);
    assert!(ok, "{text}");
    still_running(&s, "the round after");
}

/// A pre-copy round `pre1` of the workload, then one byte of its first data file damaged (the
/// round's `gpusnap verify` fails); returns the final dump's directory, linked to it.
fn a_damaged_round(s: &Split) -> PathBuf {
    s.vmm.wait_for_tick(3);
    report(s, &precopy(s, "pre1", None));
    still_running(s, "the round");
    let pre1 = dir(s, "pre1");
    let mut files: Vec<PathBuf> = fs::read_dir(&pre1)
        .expect("the round's dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.contains("-data-") && n.ends_with(".img"))
        })
        .collect();
    files.sort();
    let file = files.first().expect("a data file of the round");
    // Past the file's and the first record's 64-byte headers (docs/image-format.md).
    let at = 64 + 64 + 1000;
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .expect("open the round's data file");
    let mut b = [0u8; 1];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, at).expect("read a payload byte");
    b[0] ^= 0x40;
    std::os::unix::fs::FileExt::write_all_at(&f, &b, at).expect("write a payload byte");
    let (ok, text) = s.run_cli(&["verify", pre1.to_str().expect("utf-8 path")]);
    assert!(!ok, "gpusnap verify passed a damaged round: {text}");
    let d = dir(s, "final");
    fs::create_dir_all(&d).expect("mkdir final");
    std::os::unix::fs::symlink("../pre1", d.join("parent")).expect("parent link");
    d
}

/// A pre-copy parent is checked, not trusted: one byte of the round's data file damaged, then
/// the final dump (the hand-over) against it. The drain compares against the round while the
/// round is read back beside it, finds the damage, and copies everything again from the memory
/// the keeper still holds: nothing of the round is referenced, and the image restores
/// bit-exact.
#[test]
fn a_damaged_pre_copy_parent_is_never_referenced() {
    let Some(mut s) = Split::launch(
        "precopy-damaged-parent",
        1,
        &["--seed", "37", "--allocs", "3", "--mib", "4"],
        &[],
    ) else {
        return;
    };
    let d = a_damaged_round(&s);
    let pid = s.vmm.pid().to_string();
    let dump = s.criu_at(&d, "dump", "dump.log", &["-t", &pid], &CONFIG);
    s.assert_ok(&dump);
    s.assert_line(&dump, &["lent to keeper"]);
    s.assert_line(
        &dump,
        &["the parent image is damaged", "nothing of it referenced"],
    );
    s.assert_line(&dump, &["written fresh from the keeper's memory"]);
    let st = dump_stats(&d);
    assert_eq!(st["bytes_referenced"].as_u64(), Some(0), "{st}");
    restore_runs_on(&mut s, &d);
}

/// CRIU killed where the drain found the parent damaged, before the copy again: the job is
/// held (its memory its own, through the descriptors it kept), `gpusnap recover` maps it back
/// and it runs on bit-exact, and the directory holds no manifest (nothing restores).
#[test]
fn criu_killed_when_the_parent_is_found_damaged_leaves_the_job_recoverable() {
    let Some(s) = Split::launch(
        "precopy-damaged-parent-kill",
        1,
        &["--seed", "41", "--allocs", "3", "--mib", "4"],
        &[],
    ) else {
        return;
    };
    let d = a_damaged_round(&s);
    let pid = s.vmm.pid().to_string();
    let mut config = CONFIG.to_vec();
    config.push(("GPUSNAP_TEST_KILL_CRIU_AT", "dump-parent-damaged"));
    let killed = s.criu_at(&d, "dump", "dump.log", &["-t", &pid], &config);
    assert!(!killed.succeeded(), "CRIU was not killed");
    s.assert_line(
        &killed,
        &["test fault", "dump-parent-damaged", "killing CRIU now"],
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    let held = s.vmm.last_ticks();
    std::thread::sleep(std::time::Duration::from_millis(700));
    assert_eq!(
        s.vmm.last_ticks(),
        held,
        "the job ran on\n{}",
        s.describe(&killed)
    );
    let (ok, text) = s.run_cli(&["recover", &pid]);
    assert!(
        ok && text.contains("mapped back"),
        "{text}\n{}",
        s.describe(&killed)
    );
    s.assert_runs_on(&held, &killed);
    let manifests: Vec<_> = fs::read_dir(&d)
        .expect("the final dump's dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("manifest"))
        .map(|e| e.file_name())
        .collect();
    assert!(manifests.is_empty(), "{manifests:?}");
}
