//! Drives the `gpusnap` binary as a user would, on images made with the image crate.

use gpusnap_host::pid::NsPid;
use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Output};

use criu_tests::fixtures::TempDir;
use gpusnap_image::*;

fn gpusnap(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpusnap"))
        .args(args)
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A split-path image of process `nspid`: 2 files, 3 chunks (one zstd), one driver-saved
/// allocation. Returns the manifest.
fn make_image(dir: BorrowedFd<'_>, nspid: u32) -> Manifest {
    let nspid = NsPid(nspid);
    let base = 0x7f00_0000_0000u64;
    let a: Vec<u8> = (0..65536u32).map(|i| (i * 7 % 251) as u8).collect();
    let zeros = vec![0u8; 65536];
    let mut w0 = DataFileWriter::create(dir, nspid, 0).unwrap();
    let mut w1 = DataFileWriter::create(dir, nspid, 1).unwrap();
    let chunks = vec![
        w0.append_chunk(base, &a, Codec::Raw).unwrap(),
        w1.append_chunk(base + 65536, &zeros, Codec::Zstd).unwrap(),
        w0.append_chunk(base + 2 * 65536, &a, Codec::Zstd).unwrap(),
    ];
    let m = Manifest {
        format_version: FORMAT_VERSION,
        nspid,
        path: CheckpointPath::Split,
        created_unix_s: 1_764_000_000,
        gpusnap_version: gpusnap_image::BUILD.into(),
        driver_version: 13000,
        gpus: vec![GpuRecord {
            ordinal: 0,
            uuid: "0123456789abcdef0123456789abcdef".into(),
            name: "NVIDIA H200".into(),
            total_mem: 150_000_000_000,
        }],
        allocations: vec![
            AllocationRecord {
                id: 1,
                device: 0,
                addr: base,
                size: 3 * 65536,
                moved: true,
                lent: false,
                rdma_capable: false,
            },
            AllocationRecord {
                id: 2,
                device: 0,
                addr: base + (1 << 30),
                size: 1 << 21,
                moved: false,
                lent: false,
                rdma_capable: false,
            },
        ],
        files: vec![w0.finish().unwrap(), w1.finish().unwrap()],
        chunks,
        timings_s: BTreeMap::from([("lock".to_string(), 0.002), ("data".to_string(), 0.5)]),
        requires: None,
    };
    write_manifest(dir, &m).unwrap();
    m
}

/// A kfd-path (AMD) image of process `nspid`: one VRAM buffer object of 64 KiB in one data
/// file, its KFD state, and the manifest.
fn make_amd_image(dir: BorrowedFd<'_>, nspid: u32) -> Manifest {
    let nspid = NsPid(nspid);
    let addr = 0x7f00_0000_0000u64;
    let data: Vec<u8> = (0..65536u32).map(|i| (i % 253) as u8).collect();
    let mut w = DataFileWriter::create(dir, nspid, 0).unwrap();
    let chunk = w.append_chunk(addr, &data, Codec::Raw).unwrap();
    let state = KfdState {
        format_version: KFD_FORMAT_VERSION,
        nspid,
        kfd_version: [1, 16],
        gpus: vec![KfdGpuRecord {
            gpu_id: 4660,
            vendor_id: 0x1002,
            device_id: 0x740f,
            gfx_target_version: 90010,
            simd_count: 416,
            local_mem_bytes: 64 << 30,
            name: "gfx90a".into(),
            drm_render_minor: 128,
        }],
        bos: vec![KfdBoRecord {
            addr,
            size: 65536,
            offset: 0x1000,
            gpu_id: 4660,
            alloc_flags: 1,
            content: true,
        }],
        num_objects: 1,
        priv_data: priv_data_hex(b"opaque"),
        vmas: vec![],
        max_fd: 0,
    };
    write_kfd_state(dir, &state).unwrap();
    let m = Manifest {
        format_version: FORMAT_VERSION,
        nspid,
        path: CheckpointPath::Kfd,
        created_unix_s: 1_764_000_000,
        gpusnap_version: gpusnap_image::BUILD.into(),
        driver_version: 1016,
        gpus: vec![GpuRecord {
            ordinal: 0,
            uuid: format!("{:032x}", 4660),
            name: "gfx90a".into(),
            total_mem: 64 << 30,
        }],
        allocations: vec![AllocationRecord {
            id: 0,
            device: 0,
            addr,
            size: 65536,
            moved: true,
            lent: false,
            rdma_capable: false,
        }],
        files: vec![w.finish().unwrap()],
        chunks: vec![chunk],
        timings_s: BTreeMap::new(),
        requires: None,
    };
    write_manifest(dir, &m).unwrap();
    m
}

#[test]
fn inspect_and_verify_show_an_amd_image() {
    let t = TempDir::new("cli-test");
    make_amd_image(t.fd(), 44);
    let o = gpusnap(&["inspect", t.path_str()]);
    assert!(o.status.success(), "{o:?}");
    let s = stdout(&o);
    assert!(s.contains("process 44 (kfd path)"), "{s}");
    assert!(s.contains("AMD KFD ioctl 1.16"), "{s}");
    assert!(s.contains("gfx90a"), "{s}");
    let o = gpusnap(&["verify", t.path_str()]);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    assert!(
        stdout(&o).contains("ok    process 44: 1 chunks"),
        "{}",
        stdout(&o)
    );
    // The KFD state is part of the image: damage to it is named.
    let state = t.file("gpusnap-44-kfd.img");
    let len = std::fs::metadata(&state).unwrap().len();
    flip(&state, len - 2);
    let o = gpusnap(&["verify", t.path_str()]);
    assert_ne!(o.status.code(), Some(0));
    assert!(stdout(&o).contains("gpusnap-44-kfd.img"), "{}", stdout(&o));
    // Without it, the manifest is refused too.
    std::fs::remove_file(&state).unwrap();
    let o = gpusnap(&["verify", t.path_str()]);
    assert!(
        stdout(&o).contains("gpusnap-44-kfd.img: missing"),
        "{}",
        stdout(&o)
    );
}

fn flip(path: &Path, offset: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 0x20;
    f.write_all_at(&b, offset).unwrap();
}

#[test]
fn inspect_json_parses() {
    let t = TempDir::new("cli-test");
    let m = make_image(t.fd(), 42);
    write_stats(t.fd(), &serde_json::json!({"dump_s": 1.5})).unwrap();
    let o = gpusnap(&["inspect", t.path_str(), "--json"]);
    assert!(o.status.success(), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["structure_ok"], true);
    assert_eq!(v["checksums"], "not checked");
    assert!(v.get("ok").is_none(), "{v}");
    let p = &v["processes"][0];
    assert_eq!(p["nspid"], 42);
    assert_eq!(p["structure_ok"], true);
    assert_eq!(p["checksums"], "not checked");
    assert_eq!(p["path"], "split");
    assert_eq!(p["gpusnap_version"], gpusnap_image::BUILD);
    assert_eq!(p["chunk_count"], 3);
    assert_eq!(p["file_count"], 2);
    assert_eq!(p["total_bytes"], 3 * 65536);
    assert_eq!(
        p["stored_bytes"],
        m.chunks.iter().map(|c| c.stored_len).sum::<u64>()
    );
    assert!(p["compression_ratio"].as_f64().unwrap() > 1.0);
    assert_eq!(p["allocations"][1]["saved_by"], "driver");
    assert_eq!(
        p["allocations"][0]["addr_hex"],
        format!("{:#x}", m.allocations[0].addr)
    );
    assert_eq!(p["allocations"][0]["size"], m.allocations[0].size);
    assert_eq!(p["gpus"][0]["name"], "NVIDIA H200");
    assert_eq!(p["timings_s"]["data"], 0.5);
    assert_eq!(v["stats"]["dump_s"], 1.5);
}

#[test]
fn inspect_text_lists_the_process() {
    let t = TempDir::new("cli-test");
    make_image(t.fd(), 42);
    let o = gpusnap(&["inspect", t.path_str()]);
    assert!(o.status.success(), "{o:?}");
    let s = stdout(&o);
    assert!(s.contains("process 42 (split path)"), "{s}");
    let build = format!("gpusnap {},", gpusnap_image::BUILD);
    assert!(s.contains(&build), "{s}");
    assert!(s.contains("driver-saved"), "{s}");
    assert!(s.contains("timings: data 0.500 s, lock 0.002 s"), "{s}");
}

#[test]
fn verify_good_image() {
    let t = TempDir::new("cli-test");
    make_image(t.fd(), 42);
    make_image(t.fd(), 43);
    let o = gpusnap(&["verify", t.path_str()]);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let s = stdout(&o);
    assert!(s.contains("ok    process 42: 3 chunks"), "{s}");
    assert!(s.contains("ok    process 43: 3 chunks"), "{s}");
}

#[test]
fn verify_flipped_byte_names_file_and_chunk() {
    let t = TempDir::new("cli-test");
    make_image(t.fd(), 42);
    let m = make_image(t.fd(), 43);
    let c = &m.chunks[2];
    flip(
        &t.file(data_file_name(NsPid(43), c.file)),
        c.file_offset + c.stored_len / 2,
    );
    let o = gpusnap(&["verify", t.path_str(), "--threads", "2"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let s = stdout(&o);
    assert!(s.contains("ok    process 42"), "{s}");
    assert!(
        s.contains(
            "FAIL  process 43: gpusnap-43-data-0.img: chunk 2 checksum mismatch (image damaged; do not restore from it)"
        ),
        "{s}"
    );
    // inspect still works (the manifest is intact), and says what it checked: the structure,
    // not the chunks. It never claims the image is fine.
    let o = gpusnap(&["inspect", t.path_str()]);
    assert!(o.status.success(), "{o:?}");
    assert!(
        stdout(&o)
            .contains("not checked: chunk data and checksums (gpusnap verify reads every chunk)"),
        "{o:?}"
    );
    let o = gpusnap(&["inspect", t.path_str(), "--json"]);
    assert!(o.status.success(), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["structure_ok"], true);
    assert_eq!(v["checksums"], "not checked");
    assert!(v.get("ok").is_none(), "{v}");
    for p in v["processes"].as_array().unwrap() {
        assert_eq!(p["structure_ok"], true, "{p}");
        assert_eq!(p["checksums"], "not checked", "{p}");
        assert!(p.get("ok").is_none(), "{p}");
    }
}

#[test]
fn verify_and_inspect_report_a_damaged_manifest() {
    let t = TempDir::new("cli-test");
    make_image(t.fd(), 42);
    flip(&t.file(manifest_file_name(NsPid(42))), 100);
    let o = gpusnap(&["verify", t.path_str()]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(stdout(&o).contains("manifest checksum mismatch"));
    let o = gpusnap(&["inspect", t.path_str(), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["structure_ok"], false);
    assert_eq!(v["processes"][0]["structure_ok"], false);
    assert!(
        v["processes"][0]["error"]
            .as_str()
            .unwrap()
            .contains("manifest checksum mismatch"),
        "{v}"
    );
}

#[test]
fn verify_reports_an_unfinished_dump() {
    let t = TempDir::new("cli-test");
    let w = DataFileWriter::create(t.fd(), NsPid(7), 0).unwrap();
    w.finish().unwrap();
    let o = gpusnap(&["verify", t.path_str()]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        stdout(&o).contains(
            "FAIL  process 7: gpusnap-7-data-0.img: process 7 has no gpusnap-7-manifest.img: its \
             dump did not finish (image incomplete; do not restore from it)"
        ),
        "{o:?}"
    );
    // A manifest that never got its own name is no manifest either.
    std::fs::remove_file(t.file(data_file_name(NsPid(7), 0))).unwrap();
    std::fs::write(t.file(manifest_tmp_name(NsPid(7))), b"GPUSNAP-MANIFEST 2").unwrap();
    let o = gpusnap(&["verify", t.path_str()]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        stdout(&o).contains("process 7: gpusnap-7-manifest.img.tmp: process 7 has no"),
        "{o:?}"
    );
}

/// A complete image whose data file was cut short after the dump (a crash before the page
/// cache reached the disk): verify fails naming the file.
#[test]
fn verify_reports_a_data_file_cut_short() {
    let t = TempDir::new("cli-test");
    make_image(t.fd(), 42);
    let data = t.file(data_file_name(NsPid(42), 0));
    let len = std::fs::metadata(&data).unwrap().len();
    OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let o = gpusnap(&["verify", t.path_str()]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        stdout(&o).contains("FAIL  process 42: gpusnap-42-data-0.img: truncated"),
        "{o:?}"
    );
}

/// Nothing to verify is not "verified": exit 3, for an empty directory and for a missing one,
/// so a script can tell.
#[test]
fn nothing_to_verify_exits_3() {
    let t = TempDir::new("cli-test");
    let o = gpusnap(&["verify", t.path_str()]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    assert!(stdout(&o).contains("no gpusnap images"));
    let o = gpusnap(&["verify", "/nonexistent/gpusnap-dir"]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/gpusnap-dir"));
}

/// `inspect` of a directory with no gpusnap image exits 3 like `verify` (it used to exit 0),
/// still printing its report; a missing directory exits 3 too.
#[test]
fn nothing_to_inspect_exits_3() {
    let t = TempDir::new("cli-test");
    let o = gpusnap(&["inspect", t.path_str()]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    assert!(
        stdout(&o).contains("no gpusnap images (nothing to inspect)"),
        "{o:?}"
    );
    let o = gpusnap(&["inspect", t.path_str(), "--json"]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["processes"].as_array().unwrap().len(), 0);
    let o = gpusnap(&["inspect", "/nonexistent/gpusnap-dir"]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    // CRIU's own files, no gpusnap's: still nothing to inspect.
    std::fs::write(t.file("inventory.img"), b"criu").unwrap();
    assert_eq!(gpusnap(&["inspect", t.path_str()]).status.code(), Some(3));
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &[][..],
        &["frobnicate"],
        &["verify"],
        &["verify", "/tmp", "--threads", "0"],
        &["inspect", "/tmp", "--yaml"],
        &["check", "extra"],
        &["recover"],
    ] {
        let o = gpusnap(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {o:?}");
    }
    let o = gpusnap(&["recover"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("missing PID"));
    assert!(gpusnap(&["--help"]).status.success());
    assert_eq!(gpusnap(&["help", "frobnicate"]).status.code(), Some(2));
}

/// Every subcommand answers `--help` (and `-h`, and `gpusnap help SUB`) with its synopsis and
/// its exit codes, on stdout, exit 0 — also where other arguments stand beside it.
#[test]
fn every_subcommand_has_help() {
    for sub in ["inspect", "verify", "check", "recover", "precopy"] {
        for args in [
            vec![sub, "--help"],
            vec![sub, "-h"],
            vec!["help", sub],
            vec![sub, "/tmp", "--help"],
        ] {
            let o = gpusnap(&args);
            let out = stdout(&o);
            assert_eq!(o.status.code(), Some(0), "{args:?}: {o:?}");
            assert!(
                out.starts_with(&format!("gpusnap {sub} ")),
                "{args:?}: {out}"
            );
            assert!(out.contains("Exit: 0 "), "{args:?}: {out}");
            assert!(!out.contains("unknown option"), "{args:?}: {out}");
        }
    }
    let o = gpusnap(&["--help"]);
    let out = stdout(&o);
    for code in 0..=4 {
        assert!(
            out.contains(&format!("\n  {code}  ")),
            "exit {code} undocumented: {out}"
        );
    }
}

/// `gpusnap check` reads the configuration as the plugin does and lists every problem.
#[test]
fn check_lists_every_configuration_problem() {
    let t = TempDir::new("cli-test");
    let conf = t.file("gpusnap.conf");
    std::fs::write(&conf, "writer_thread = 4\nmode = \"fast\"\n").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_gpusnap"))
        .arg("check")
        .env("GPUSNAP_CONFIG", &conf)
        .env("GPUSNAP_DURABEL", "1")
        .env("GPUSNAP_CRIU", "/nonexistent/criu")
        .output()
        .unwrap();
    let s = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{s}");
    let config: Vec<&str> = s
        .lines()
        .filter(|l| l.starts_with("fail  configuration: "))
        .collect();
    assert_eq!(config.len(), 3, "{s}");
    for needle in ["writer_thread`", "key `mode`", "GPUSNAP_DURABEL"] {
        assert!(config.iter().any(|l| l.contains(needle)), "{needle}: {s}");
    }
    // The hint names a file that exists here: this checkout's example when the binary runs from
    // it, the installed configuration otherwise; never a bare repository path.
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR"));
    let hint = if Path::new(env!("CARGO_BIN_EXE_gpusnap")).starts_with(checkout) {
        format!(
            "({}/common/config/gpusnap.conf.example documents every key)",
            checkout.display()
        )
    } else {
        "(/etc/criu/gpusnap.conf as the gpusnap package installs it".to_owned()
    };
    assert!(config.iter().all(|l| l.contains(&hint)), "{hint}: {s}");
    let o = Command::new(env!("CARGO_BIN_EXE_gpusnap"))
        .arg("check")
        .env("GPUSNAP_CONFIG", "/dev/null")
        .env("GPUSNAP_CRIU", "/nonexistent/criu")
        .output()
        .unwrap();
    assert!(
        stdout(&o).contains("ok    configuration (/dev/null)"),
        "{o:?}"
    );
}

#[test]
fn check_reports_each_finding() {
    let t = TempDir::new("cli-test");
    std::fs::write(t.file("gpusnap.so"), b"").unwrap();
    std::fs::write(t.file("cuda_plugin.so"), b"").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_gpusnap"))
        .arg("check")
        .env("GPUSNAP_CRIU", "/nonexistent/criu")
        .env("CRIU_LIBS_DIR", t.path_str())
        .env("GPUSNAP_AGENT_LIB", "/nonexistent/libgpusnap_agent.so")
        .env("GPUSNAP_LIBCUDA", "libgpusnap-no-such-libcuda.so.1")
        .output()
        .unwrap();
    let s = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{s}");
    for line in s.lines() {
        assert!(
            line.starts_with("ok    ") || line.starts_with("warn  ") || line.starts_with("fail  "),
            "{line}"
        );
        if !line.starts_with("ok") {
            assert!(line.contains("  — "), "{line}");
        }
    }
    assert!(
        s.contains("fail  CRIU at /nonexistent/criu does not run"),
        "{s}"
    );
    assert!(
        s.contains(&format!("ok    plugin {}/gpusnap.so", t.path_str())),
        "{s}"
    );
    assert!(s.contains("warn  CRIU's own CUDA plugin"), "{s}");
    assert!(
        s.contains("warn  agent library /nonexistent/libgpusnap_agent.so not found"),
        "{s}"
    );
    assert!(
        s.contains("fail  libgpusnap-no-such-libcuda.so.1 does not load"),
        "{s}"
    );
}

/// A keeper the configuration names that is no program (a directory) fails the check; it used
/// to pass with a warning, as if none had been configured.
#[test]
fn check_fails_a_configured_keeper_that_is_a_directory() {
    let t = TempDir::new("cli-test");
    std::fs::write(t.file("gpusnap.so"), b"").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_gpusnap"))
        .arg("check")
        .env("GPUSNAP_CRIU", "/nonexistent/criu")
        .env("CRIU_LIBS_DIR", t.path_str())
        .env("GPUSNAP_KEEPER", t.path_str())
        .output()
        .unwrap();
    let s = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{s}");
    assert!(
        s.lines()
            .any(|l| l.starts_with("fail  the configured keeper is unusable")
                && l.contains("not a regular file")),
        "{s}"
    );
}

/// One old criu is one `fail` line, also where Podman is installed and runc would run that
/// same criu from PATH (it used to be judged twice).
#[test]
fn check_fails_one_old_criu_once() {
    use std::os::unix::fs::PermissionsExt;
    let t = TempDir::new("cli-test");
    let bin = t.file("bin");
    std::fs::create_dir(&bin).unwrap();
    for (name, script) in [
        ("criu", "#!/bin/sh\necho 'Version: 3.17'\n"),
        (
            "podman",
            "#!/bin/sh\necho 'runc|/bin/true|/var/lib/containers/storage'\n",
        ),
    ] {
        let p = bin.join(name);
        std::fs::write(&p, script).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let path = format!("{}:/usr/bin:/bin", bin.display());
    let o = Command::new(env!("CARGO_BIN_EXE_gpusnap"))
        .arg("check")
        .env("PATH", &path)
        .env_remove("GPUSNAP_CRIU")
        .env("GPUSNAP_CONFIG", "/dev/null")
        .output()
        .unwrap();
    let s = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{s}");
    let old: Vec<&str> = s.lines().filter(|l| l.contains("3.17")).collect();
    assert_eq!(old.len(), 1, "{s}");
    assert!(old[0].starts_with("fail  CRIU 3.17.0 ("), "{s}");
    assert!(old[0].contains("too old") && old[0].contains("runc"), "{s}");
    assert!(s.contains("podman's runtime runc can checkpoint"), "{s}");
    // A different criu for gpusnap (GPUSNAP_CRIU) leaves the one runc runs judged on its own.
    let o = Command::new(env!("CARGO_BIN_EXE_gpusnap"))
        .arg("check")
        .env("PATH", &path)
        .env("GPUSNAP_CRIU", "/nonexistent/criu")
        .env("GPUSNAP_CONFIG", "/dev/null")
        .output()
        .unwrap();
    let s = stdout(&o);
    assert!(
        s.lines()
            .any(|l| l.starts_with("fail  criu on PATH (") && l.contains("is CRIU 3.17.0")),
        "{s}"
    );
}

#[test]
fn recover_checks_its_arguments_and_the_process() {
    assert_eq!(gpusnap(&["recover"]).status.code(), Some(2));
    assert_eq!(gpusnap(&["recover", "abc"]).status.code(), Some(2));
    let o = gpusnap(&["recover", "2147483646"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no process"));
    // A live process without CUDA state: nothing to recover (exit 0), or, on a host without a
    // driver, an error that says the driver is missing (exit 4, an environment problem).
    let me = std::process::id().to_string();
    let o = gpusnap(&["recover", &me]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    match o.status.code() {
        Some(0) => assert!(text.contains("nothing to recover"), "{text}"),
        Some(4) => assert!(text.contains("NVIDIA driver"), "{text}"),
        other => panic!("unexpected exit {other:?}: {text}"),
    }
}
