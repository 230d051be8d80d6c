//! Incremental checkpoints on the split path with a real CRIU and the stand-in drivers:
//! `criu dump -R` into `dump1`, part of the device data changed, `criu dump --prev-images-dir
//! ../dump1 --track-mem` into `dump2` (see below for how the `parent` link is made here),
//! restore from `dump2`.
//!
//! - dump 2 writes only the changed chunks (the first MiB of data allocation 0, which the
//!   workload rewrites on request, and the chunk of the counter, which changes every tick) and
//!   references the rest in `dump1`, including the 2 MiB the workload maps with its own VMM
//!   calls; the restore brings back both, bit for bit (the workload checks every byte of its
//!   device memory against what it holds in host memory every tick);
//! - a damaged or missing parent image: the restore is refused in `init`, naming the file or
//!   the link, before the GPU (the stand-in driver) is called, and nothing runs.
//!
//! CRIU itself: `--prev-images-dir` needs `--track-mem` (CRIU records the dump's uptime for its
//! pid-reuse check only then, and refuses a parent whose pagemaps lack it), and `--track-mem`
//! needs soft-dirty page tracking, which the CI kernel lacks (`Tracking memory is not
//! available`). So these tests make the `parent` link themselves, as CRIU would, to a directory
//! holding only dump 1's gpusnap files (hard links): CRIU finds no pagemaps of its own there and
//! dumps its part in full, gpusnap follows the link. Everything else is real CRIU.
//!
//! Root and CRIU are needed (`GPUSNAP_SKIP_CRIU_TESTS=1` skips).

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::split::Split;
use criu_tests::CriuRun;

const MIB: u64 = 1 << 20;
/// 1 MiB chunks, so that an allocation is several chunks and a change can hit only one.
const CONFIG: [(&str, &str); 1] = [("GPUSNAP_STAGING_SLOT_MIB", "1")];

fn start(test: &str) -> Option<Split> {
    Split::launch(
        test,
        1,
        &[
            "--seed",
            "21",
            "--allocs",
            "3",
            "--mib",
            "4",
            "--app-vmm",
            "--app-vmm-compressed",
        ],
        &[],
    )
}

fn images(s: &Split, name: &str) -> PathBuf {
    let p = s.w.path.join(name);
    fs::create_dir_all(&p).expect("mkdir images");
    p
}

/// The `data` object of the process in `dir`'s `gpusnap-stats.json`.
fn dump_stats(s: &Split, dir: &Path, run: &CriuRun) -> serde_json::Value {
    let text = fs::read_to_string(dir.join("gpusnap-stats.json"))
        .unwrap_or_else(|e| panic!("gpusnap-stats.json: {e}\n{}", s.describe(run)));
    let v: serde_json::Value = serde_json::from_str(&text).expect("stats JSON");
    v["processes"][0]["data"].clone()
}

fn num(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

/// dump 1 (`-R`), a change, dump 2 against dump 1 (the workload is killed). Returns the parent
/// image dir and dump 2's, both dumps' stats and the last tick.
fn two_dumps(s: &mut Split) -> (PathBuf, PathBuf, [serde_json::Value; 2], Vec<u64>) {
    two_dumps_with(s, &CONFIG)
}

/// [`two_dumps`] with another CRIU environment (`config`).
fn two_dumps_with(
    s: &mut Split,
    config: &[(&str, &str)],
) -> (PathBuf, PathBuf, [serde_json::Value; 2], Vec<u64>) {
    let pid = s.vmm.pid().to_string();
    let d1 = images(s, "dump1");
    let dump1 = s.criu_at(
        &d1,
        "dump",
        "dump1.log",
        &["-t", &pid, "--leave-running"],
        config,
    );
    s.assert_ok(&dump1);
    if s.app_vmm {
        // The application's own VMM memory is compressible, which a keeper does not make, so
        // the agent does not lend it: it alone is copied out first
        // (its route named in the log), the rest is lent; the -R maps the lent memory back and
        // reloads that part from the files.
        s.assert_line(
            &dump1,
            &["copy first (the application's own cuMemCreate handle"],
        );
        s.assert_line(&dump1, &["device memory mapped back", "no file read"]);
        s.assert_line(
            &dump1,
            &["device data reloaded", "the allocations copied out first"],
        );
    } else {
        // The hand-over: the -R maps the memory back from what the job kept.
        s.assert_line(&dump1, &["device memory mapped back", "no file read"]);
    }
    let stats1 = dump_stats(s, &d1, &dump1);

    s.change_some_data();

    // The GPU part of dump 1 alone, as the parent (see the module comment).
    let g1 = images(s, "gpu1");
    for f in fs::read_dir(&d1).expect("read dump1").flatten() {
        let name = f.file_name();
        if name.to_string_lossy().starts_with("gpusnap-") {
            fs::hard_link(f.path(), g1.join(&name)).expect("link a gpusnap file");
        }
    }
    let d2 = images(s, "dump2");
    std::os::unix::fs::symlink("../gpu1", d2.join("parent")).expect("parent link");
    let dump2 = s.criu_at(&d2, "dump", "dump2.log", &["-t", &pid], config);
    s.assert_ok(&dump2);
    assert!(
        fs::symlink_metadata(d2.join("parent")).is_ok_and(|m| m.file_type().is_symlink()),
        "CRIU made no parent link\n{}",
        s.describe(&dump2)
    );
    s.assert_line(&dump2, &["incremental dump against the parent image"]);
    s.assert_line(&dump2, &["written", "referenced", "unchanged"]);
    let stats2 = dump_stats(s, &d2, &dump2);
    let last = s.reap_dumped();
    (g1, d2, [stats1, stats2], last)
}

/// Dump 2 writes only the two changed chunks and the restore from it is bit-exact, changed
/// and unchanged parts alike.
#[test]
fn incremental_dump_writes_only_what_changed() {
    let Some(mut s) = start("incremental") else {
        return;
    };
    let (_, d2, [full, incr], last) = two_dumps(&mut s);
    let device = num(&full, "device_bytes");
    // 4 + 4 + 6 (the odd size, rounded to the granularity) + 2 MiB of counter + the 2 MiB
    // the process mapped itself (moved by the agent too).
    assert_eq!(device, 18 * MIB, "{full}");
    // Memory never written is all zero on the device: recorded as zero, not written (4 MiB
    // of the workload's allocations here).
    let zero = num(&full, "bytes_zero");
    assert!(zero > 0, "{full}");
    assert_eq!(num(&full, "bytes_written"), device - zero, "{full}");
    assert_eq!(num(&full, "bytes_referenced"), 0, "{full}");
    assert_eq!(num(&incr, "device_bytes"), device, "{incr}");
    // The first MiB of allocation 0 and the counter's first chunk; nothing else.
    assert_eq!(num(&incr, "bytes_written"), 2 * MIB, "{incr}");
    assert_eq!(num(&incr, "bytes_zero"), zero, "{incr}");
    // Unchanged chunks were not even copied off the device: the agent compared their device
    // hashes with the parent's on the GPU. Its last dump sent the 2 changed MiB only.
    let out = fs::read_to_string(&s.vmm.out).expect("the workload's output");
    let sent: Vec<u64> = out
        .lines()
        .filter_map(|l| {
            l.split("dump: ")
                .nth(1)?
                .split(" bytes in ")
                .next()?
                .parse()
                .ok()
        })
        .collect();
    // The job's agent copies only what is not lent (the workload's own 2 MiB mapping, copied
    // out first: unchanged, so nothing); the keeper copies the lent rest, as the plugin counts.
    assert_eq!(
        sent.last(),
        Some(&0),
        "bytes the job's agent copied off the device, per dump: {sent:?}"
    );
    assert_eq!(num(&incr, "bytes_copied_off_device"), 2 * MIB, "{incr}");
    assert_eq!(
        num(&full, "bytes_copied_off_device"),
        device - zero,
        "{full}"
    );
    assert_eq!(num(&incr, "bytes_referenced"), 16 * MIB - zero, "{incr}");
    eprintln!(
        "incremental: full dump wrote {} bytes, incremental dump wrote {} and referenced {}",
        num(&full, "bytes_written"),
        num(&incr, "bytes_written"),
        num(&incr, "bytes_referenced")
    );

    // The CLI follows the chain.
    let out = std::process::Command::new(&s.cli)
        .arg("verify")
        .arg(&d2)
        .output()
        .expect("run gpusnap verify");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && text.contains("12 chunks referenced from parent images")
            && text.contains("in 4 zero chunks"),
        "{text}"
    );
    let out = std::process::Command::new(&s.cli)
        .args(["inspect", "--json"])
        .arg(&d2)
        .output()
        .expect("run gpusnap inspect");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("inspect JSON");
    let p = &v["processes"][0];
    assert_eq!(p["referenced_bytes"].as_u64(), Some(12 * MIB), "{p}");
    assert_eq!(p["zero_bytes"].as_u64(), Some(4 * MIB), "{p}");
    assert_eq!(p["stored_here_bytes"].as_u64(), Some(2 * MIB), "{p}");
    assert_eq!(p["chain_depth"].as_u64(), Some(1), "{p}");

    let restore = s.criu_at(
        &d2,
        "restore",
        "restore.log",
        &["--restore-detached"],
        &CONFIG,
    );
    s.assert_ok(&restore);
    s.assert_line(&restore, &["incremental image", "come from parent images"]);
    s.assert_line(&restore, &["restored (Split path)", "data"]);
    s.assert_runs_on(&last, &restore);
}

/// A damaged parent chunk, then a parent directory that is gone: each restore is refused in
/// `init`, saying why, before the stand-in driver sees any restore call, and nothing runs.
#[test]
fn restore_refuses_a_damaged_or_missing_parent() {
    let Some(mut s) = start("incremental-bad-parent") else {
        return;
    };
    let (d1, d2, _, last) = two_dumps(&mut s);
    let calls = s.calls();

    // One payload byte of every chunk record in the parent's data files (the chunks dump 2
    // references among them): 64-byte file header, then 64-byte record + 1 MiB per chunk.
    let prefix = format!("gpusnap-{}-data-", s.vmm.pid());
    for f in fs::read_dir(&d1).expect("read the parent").flatten() {
        if !f.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(f.path())
            .expect("open data file");
        let len = file.metadata().expect("stat").len();
        let mut at = 64 + 64 + 100;
        while at < len {
            let mut b = [0u8; 1];
            file.read_exact_at(&mut b, at).expect("read");
            b[0] ^= 0x40;
            file.write_all_at(&b, at).expect("write");
            at += 64 + MIB;
        }
    }
    let restore = s.criu_at(
        &d2,
        "restore",
        "restore-damaged.log",
        &["--restore-detached"],
        &[CONFIG[0], ("GPUSNAP_VERIFY_BEFORE_RESTORE", "host")],
    );
    assert!(!restore.status.success(), "{}", s.describe(&restore));
    s.assert_line(
        &restore,
        &["restore refused", "parent/", &prefix, "checksum mismatch"],
    );
    s.assert_nothing_runs(&last, &restore);
    assert_eq!(s.calls(), calls, "the driver was called");

    // The parent directory moved away: the link dangles.
    fs::rename(&d1, s.w.path.join("gpu1.moved")).expect("move the parent");
    let restore = s.criu_at(
        &d2,
        "restore",
        "restore-missing.log",
        &["--restore-detached"],
        &CONFIG,
    );
    assert!(!restore.status.success(), "{}", s.describe(&restore));
    s.assert_line(
        &restore,
        &["restore refused", "parent (-> ../gpu1)", "does not exist"],
    );
    s.assert_nothing_runs(&last, &restore);
    assert_eq!(s.calls(), calls, "the driver was called");
}

/// Incremental dumps of a process with memory on two GPUs, compressed: the chunks are matched
/// by their device bytes (not their stored, compressed bytes), each GPU's unchanged chunks are
/// referenced, and the restore brings both GPUs' memory back bit for bit.
#[test]
fn incremental_dump_across_two_gpus_with_zstd() {
    let Some(mut s) = Split::two_gpus("incremental-two-gpus-zstd") else {
        return;
    };
    let config = [
        ("GPUSNAP_STAGING_SLOT_MIB", "1"),
        ("GPUSNAP_COMPRESS", "zstd"),
    ];
    let (_, d2, [full, incr], last) = two_dumps_with(&mut s, &config);
    let device = num(&full, "device_bytes");
    assert_eq!(num(&full, "bytes_referenced"), 0, "{full}");
    assert_eq!(num(&incr, "device_bytes"), device, "{incr}");
    // Only the rewritten MiB and the counter's chunk are new; everything else is referenced.
    let zero = num(&incr, "bytes_zero");
    assert_eq!(
        num(&incr, "bytes_referenced"),
        device - 2 * MIB - zero,
        "{incr}"
    );
    assert!(num(&incr, "bytes_written") <= 2 * MIB, "{incr}");
    let restore = s.criu_at(
        &d2,
        "restore",
        "restore.log",
        &["--restore-detached"],
        &config,
    );
    s.assert_ok(&restore);
    s.assert_line(&restore, &["incremental image", "come from parent images"]);
    s.assert_runs_on(&last, &restore);
}
