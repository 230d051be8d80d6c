//! `gpusnap inspect` and `gpusnap verify` given a checkpoint archive as it is (a Podman export,
//! plain or compressed; a containerd/kubelet archive), and hostile archives refused whole.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use criu_tests::fixtures::TempDir;
use gpusnap_image::*;

/// `gpusnap ARGS` with `$TMPDIR` set to `tmp` (where archives are unpacked).
fn gpusnap(tmp: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpusnap"))
        .args(args)
        .env("TMPDIR", tmp)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

const SPEC: &str = r#"{
  "ociVersion": "1.0.2",
  "mounts": [
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {"destination": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05", "type": "bind",
     "source": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05", "options": ["ro", "bind"]},
    {"destination": "/usr/bin/nvidia-smi", "type": "bind", "source": "/usr/bin/nvidia-smi"},
    {"destination": "/dev/nvidia-uvm", "type": "bind", "source": "/dev/nvidia-uvm"}
  ],
  "linux": {"devices": [
    {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0},
    {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
    {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}
  ]}
}"#;

/// A container checkpoint laid out as Podman and containerd write it: `checkpoint/` with a
/// transparent-path gpusnap image of process 1 (format 7, its requirements recorded) and a CRIU
/// file, `spec.dump` and `config.dump` beside it.
fn container_checkpoint(root: &Path) {
    let ck = root.join("checkpoint");
    std::fs::create_dir_all(&ck).unwrap();
    std::fs::write(ck.join("inventory.img"), b"criu's own").unwrap();
    std::fs::write(root.join("spec.dump"), SPEC).unwrap();
    std::fs::write(root.join("config.dump"), b"{}").unwrap();
    let mut m = Manifest::begin(
        gpusnap_host::pid::NsPid(1),
        CheckpointPath::Transparent,
        13000,
    );
    m.gpus = vec![GpuRecord {
        ordinal: 0,
        uuid: "0123456789abcdef0123456789abcdef".into(),
        name: "NVIDIA H200".into(),
        total_mem: 150_000_000_000,
    }];
    m.requires = Some(Requirements {
        kernel_driver: Some("580.95.05".into()),
        driver_library: Some(LibraryDigest {
            path: "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05".into(),
            size: 1000,
            xxh3_128: "00112233445566778899aabbccddeeff".into(),
            in_job_root: false,
        }),
        gpu_mem_used: BTreeMap::from([(0, 3 << 30)]),
    });
    let d = std::fs::File::open(&ck).unwrap();
    write_manifest(d.as_fd(), &m).unwrap();
}

/// A tar of everything under `root`, as `tar -C root -cf - .` writes it.
fn tar_of(root: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.append_dir_all(".", root).unwrap();
    b.into_inner().unwrap()
}

fn write(path: &Path, bytes: &[u8]) -> String {
    std::fs::write(path, bytes).unwrap();
    path.to_str().unwrap().to_owned()
}

fn assert_nothing_left(tmp: &Path) {
    let left: Vec<PathBuf> = std::fs::read_dir(tmp)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(left.is_empty(), "left in $TMPDIR: {left:?}");
}

#[test]
fn podman_and_containerd_archives_are_read_as_they_are() {
    let t = TempDir::new("archive-ok");
    let src = t.path().join("src");
    container_checkpoint(&src);
    let tmp = t.path().join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let tar = tar_of(&src);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&tar).unwrap();
    let gz = gz.finish().unwrap();
    let zst = zstd::encode_all(&tar[..], 3).unwrap();
    for (name, bytes) in [
        ("export.tar", &tar),
        ("export.tar.gz", &gz),
        ("export.tar.zst", &zst),
    ] {
        let archive = write(&t.path().join(name), bytes);
        let o = gpusnap(&tmp, &["inspect", "--json", &archive]);
        assert!(o.status.success(), "{name}: {}", text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["processes"][0]["nspid"], 1, "{name}");
        assert_eq!(
            v["processes"][0]["requires"]["kernel_driver"], "580.95.05",
            "{name}"
        );
        assert_eq!(
            v["driver_stack_identity"],
            "nvidia=580.95.05;cuda=13000;lib=libcuda.so.580.95.05@00112233445566778899aabbccddeeff"
        );
        assert_eq!(v["min_gpu_memory_bytes"], 3u64 << 30);
        assert_eq!(
            v["container"]["device_nodes"],
            serde_json::json!(["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]),
            "{name}"
        );
        let mounts = v["container"]["driver_mounts"].to_string();
        assert!(
            mounts.contains("libcuda.so.580.95.05") && mounts.contains("nvidia-smi"),
            "{mounts}"
        );
        let o = gpusnap(&tmp, &["inspect", &archive]);
        let out = text(&o);
        assert!(o.status.success(), "{out}");
        assert!(out.contains("needs device node /dev/nvidia0"), "{out}");
        assert!(
            out.contains("needs: driver stack nvidia=580.95.05"),
            "{out}"
        );
        let o = gpusnap(&tmp, &["verify", &archive]);
        assert!(o.status.success(), "{name}: {}", text(&o));
        assert_nothing_left(&tmp);
    }
    // The unpacked directory itself, and its checkpoint/ directory, read the same way.
    for dir in [src.clone(), src.join("checkpoint")] {
        let o = gpusnap(&tmp, &["inspect", "--json", dir.to_str().unwrap()]);
        assert!(o.status.success(), "{}", text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["container"]["device_nodes"][0], "/dev/nvidia0");
    }
    // A file that is no archive: nothing to act on.
    let junk = write(&t.path().join("junk"), &[7u8; 2000]);
    let o = gpusnap(&tmp, &["inspect", &junk]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert_nothing_left(&tmp);
}

/// One raw tar entry: `name` written into the header as it is (the builder would refuse it).
fn raw_entry(out: &mut Vec<u8>, name: &[u8], kind: tar::EntryType, link: &[u8], data: &[u8]) {
    let mut h = tar::Header::new_gnu();
    h.as_old_mut().name[..name.len()].copy_from_slice(name);
    h.as_old_mut().linkname[..link.len()].copy_from_slice(link);
    h.set_entry_type(kind);
    h.set_mode(0o644);
    h.set_size(data.len() as u64);
    h.set_cksum();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
}

fn end(mut v: Vec<u8>) -> Vec<u8> {
    v.extend_from_slice(&[0u8; 1024]);
    v
}

#[test]
fn hostile_archives_are_refused_whole_and_leave_nothing() {
    use tar::EntryType as E;
    let t = TempDir::new("archive-hostile");
    let tmp = t.path().join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let outside = t.path().join("outside");
    let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
    let one = |name: &[u8], kind, link: &[u8], data: &[u8]| {
        let mut v = Vec::new();
        raw_entry(&mut v, b"checkpoint/", E::Directory, b"", b"");
        raw_entry(&mut v, name, kind, link, data);
        end(v)
    };
    let out_link = outside.to_str().unwrap().as_bytes().to_vec();
    cases.push((
        "symlink out",
        one(b"checkpoint/evil", E::Symlink, &out_link, b""),
        "link",
    ));
    cases.push((
        "hard link",
        one(b"checkpoint/evil", E::Link, b"/etc/passwd", b""),
        "link",
    ));
    cases.push(("dot-dot", one(b"../evil", E::Regular, b"", b"x"), "`..`"));
    cases.push((
        "dot-dot inside",
        one(b"checkpoint/../../evil", E::Regular, b"", b"x"),
        "`..`",
    ));
    cases.push((
        "absolute",
        one(out_link.as_slice(), E::Regular, b"", b"x"),
        "absolute",
    ));
    cases.push((
        "device",
        one(b"checkpoint/nvidia0", E::Char, b"", b""),
        "device",
    ));
    cases.push(("fifo", one(b"checkpoint/p", E::Fifo, b"", b""), "FIFO"));
    // A file then a link of the same name, and a file met twice.
    let mut twice = Vec::new();
    raw_entry(&mut twice, b"a", E::Regular, b"", b"one");
    raw_entry(&mut twice, b"a", E::Regular, b"", b"two");
    cases.push(("twice", end(twice), "met twice"));
    // A file whose header claims 2 TiB: refused before anything is read.
    let mut huge = Vec::new();
    let mut h = tar::Header::new_gnu();
    h.set_path("checkpoint-huge").unwrap();
    h.set_size(2 << 40);
    h.set_entry_type(E::Regular);
    h.set_cksum();
    huge.extend_from_slice(h.as_bytes());
    huge.extend_from_slice(&[0u8; 4096]);
    cases.push(("huge", huge, "more than"));
    // A GNU long name of 2 MiB (compressed to almost nothing): its headers are refused.
    let mut long = Vec::new();
    let name = vec![b'a'; 2 << 20];
    let mut h = tar::Header::new_gnu();
    h.as_old_mut().name[..13].copy_from_slice(b"././@LongLink");
    h.set_entry_type(E::GNULongName);
    h.set_size(name.len() as u64);
    h.set_cksum();
    long.extend_from_slice(h.as_bytes());
    long.extend_from_slice(&name);
    long.resize(long.len().div_ceil(512) * 512, 0);
    raw_entry(&mut long, b"x", E::Regular, b"", b"x");
    let long = zstd::encode_all(&end(long)[..], 3).unwrap();
    cases.push(("long name bomb", long, "1 MiB"));

    for (what, bytes, needle) in cases {
        let archive = write(&t.path().join("hostile.tar"), &bytes);
        for cmd in ["inspect", "verify"] {
            let o = gpusnap(&tmp, &[cmd, &archive]);
            let out = text(&o);
            assert_eq!(o.status.code(), Some(1), "{what} ({cmd}): {out}");
            assert!(
                out.contains(needle),
                "{what} ({cmd}): {needle:?} not in {out}"
            );
            assert_nothing_left(&tmp);
            assert!(!outside.exists(), "{what}: a file was made outside");
        }
    }
}
