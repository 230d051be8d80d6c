//! Feeds arbitrary bytes through the image readers. The first input byte picks a mode:
//! - 0: raw bytes as the manifest file and as data file 0;
//! - 1: raw bytes as the manifest's JSON body behind a correct header line (so the checksum does
//!   not stop every input), and as data file 0;
//! - 2: a real image written by `DataFileWriter` + `write_manifest` from input-chosen chunks, then
//!   damaged by input-chosen flips, truncations, extensions and manifest edits (re-checksummed).
//!   Oracles: the undamaged image verifies and reads back exactly; after damage, every chunk that
//!   still reads successfully holds exactly the bytes that were written at its address.
//! - 3: raw bytes as a checkpoint archive (`gpusnap inspect/verify ARCHIVE`, `src/archive.rs`:
//!   tar, gzip or zstd), unpacked with small limits into a fresh directory. Oracles: it is
//!   refused or unpacked; nothing but regular files and directories is made, and nothing outside
//!   that directory; the bytes written stay within the limit.
//!
//! Nothing may panic, hang or allocate beyond the input's own scale in any mode.
#![no_main]

use gpusnap_proto::pid::NsPid;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::OnceLock;

use gpusnap_image::*;
use libfuzzer_sys::fuzz_target;

#[path = "../../src/archive.rs"]
#[allow(dead_code)]
mod archive;

const NSPID: NsPid = NsPid(1);

struct Dir {
    path: PathBuf,
    fd: File,
}

fn dir() -> &'static Dir {
    static D: OnceLock<Dir> = OnceLock::new();
    D.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let path = base.join(format!("gpusnap-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        let fd = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(&path)
            .unwrap();
        Dir { path, fd }
    })
}

fn clear(d: &Dir) {
    for e in std::fs::read_dir(&d.path).unwrap() {
        let _ = std::fs::remove_file(e.unwrap().path());
    }
}

/// Reads every chunk the manifest lists; returns (addr, bytes) for those that read cleanly.
fn read_all(fd: BorrowedFd<'_>, m: &Manifest) -> Vec<(u64, Vec<u8>)> {
    let mut ok = Vec::new();
    let mut scratch = Vec::new();
    for i in m.file_indexes() {
        let Ok(r) = DataFileReader::open(fd, m, i) else {
            continue;
        };
        for c in m.chunks.iter().filter(|c| c.file == i) {
            // read_manifest bounded len to 1 GiB; keep the fuzzer's memory small regardless.
            if c.len > 1 << 24 {
                continue;
            }
            let mut out = vec![0u8; c.len as usize];
            if r.read_chunk(c, &mut out, &mut scratch).is_ok() {
                ok.push((c.addr, out));
            }
        }
    }
    ok
}

fn raw_files(d: &Dir, data: &[u8], fix_header: bool) {
    let split = data
        .get(..2)
        .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let rest = data.get(2..).unwrap_or(&[]);
    let split = split.min(rest.len());
    let (manifest, datafile) = rest.split_at(split);
    let mbytes = if fix_header {
        let mut v = format!(
            "GPUSNAP-MANIFEST 1 {} {:016x}\n",
            manifest.len(),
            xxhash_rust::xxh3::xxh3_64(manifest)
        )
        .into_bytes();
        v.extend_from_slice(manifest);
        v
    } else {
        manifest.to_vec()
    };
    std::fs::write(d.path.join(manifest_file_name(NSPID)), mbytes).unwrap();
    std::fs::write(d.path.join(data_file_name(NSPID, 0)), datafile).unwrap();
    let fd = d.fd.as_fd();
    if let Ok(m) = read_manifest(fd, NSPID) {
        let _ = verify_image(fd, &m, 2);
        read_all(fd, &m);
    }
    let _ = scan_data_file(fd, NSPID, 0);
    let _ = list_manifests(fd);
}

/// A little reader over the input that yields zeros once it runs out.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }
}

fn chunk_bytes(len: usize, seed: u8, compressible: bool) -> Vec<u8> {
    if compressible {
        return (0..len).map(|i| (i / 97) as u8 ^ seed).collect();
    }
    let mut x = u64::from(seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn structured(d: &Dir, data: &[u8]) {
    let fd = d.fd.as_fd();
    let mut b = Bytes(data);
    let base = 0x7000_0000_0000u64;
    let mut addr = base;
    let mut chunks = Vec::new();
    let mut files = Vec::new();
    let mut written: HashMap<u64, Vec<u8>> = HashMap::new();
    // One or two files, with input-chosen indexes (gaps happen: idle writers leave no file).
    let first = u32::from(b.u8() % 4);
    let indexes: Vec<u32> = match b.u8() % 3 {
        0 => vec![first],
        1 => vec![first, first + 1],
        _ => vec![first + 9, first], // out of order
    };
    for &f in &indexes {
        let mut w = DataFileWriter::create(fd, NSPID, f).unwrap();
        for _ in 0..b.u8() % 4 {
            let len = 1 + (b.u32() % 6000) as usize;
            let flags = b.u8();
            let bytes = chunk_bytes(len, b.u8(), flags & 1 == 0);
            let codec = if flags & 2 == 0 {
                Codec::Zstd
            } else {
                Codec::Raw
            };
            chunks.push(w.append_chunk(addr, &bytes, codec).unwrap());
            written.insert(addr, bytes);
            addr += len as u64;
        }
        files.push(w.finish().unwrap());
    }
    let mut allocations = vec![AllocationRecord {
        id: 2,
        device: 0,
        addr: base + (1 << 30),
        size: 4096,
        moved: false,
        lent: false,
        rdma_capable: false,
    }];
    if addr > base {
        allocations.push(AllocationRecord {
            id: 1,
            device: 0,
            addr: base,
            size: addr - base,
            moved: true,
            lent: false,
            rdma_capable: false,
        });
    }
    let m = Manifest {
        format_version: FORMAT_VERSION,
        nspid: NSPID,
        path: CheckpointPath::Split,
        created_unix_s: 0,
        gpusnap_version: "fuzz".into(),
        driver_version: 13000,
        gpus: vec![GpuRecord {
            ordinal: 0,
            uuid: "00112233445566778899aabbccddeeff".into(),
            name: "fuzz".into(),
            total_mem: 1 << 34,
        }],
        allocations,
        files,
        chunks,
        timings_s: Default::default(),
        requires: None,
    };
    write_manifest(fd, &m).expect("a freshly written image is accepted");
    assert_eq!(read_manifest(fd, NSPID).unwrap(), m);
    verify_image(fd, &m, 2).expect("a freshly written image verifies");
    for (a, bytes) in read_all(fd, &m) {
        assert_eq!(&written[&a], &bytes);
    }

    // Damage.
    let names: Vec<String> = m
        .files
        .iter()
        .map(|f| f.name.clone())
        .chain([manifest_file_name(NSPID)])
        .collect();
    let mut edited = m.clone();
    let mut edit_manifest = false;
    for _ in 0..1 + b.u8() % 3 {
        let kind = b.u8() % 5;
        let name = &names[b.u8() as usize % names.len()];
        let path = d.path.join(name);
        let mut content = std::fs::read(&path).unwrap();
        match kind {
            0 | 1 if !content.is_empty() => {
                let at = b.u32() as usize % content.len();
                content[at] ^= b.u8() | 1;
            }
            2 => content.truncate(b.u32() as usize % (content.len() + 1)),
            3 => content.extend(std::iter::repeat_n(b.u8(), 1 + b.u8() as usize % 70)),
            _ => {
                edit_manifest = true;
                if !edited.chunks.is_empty() {
                    let i = b.u8() as usize % edited.chunks.len();
                    let v = b.u64();
                    let c = &mut edited.chunks[i];
                    match b.u8() % 7 {
                        // (7 fields; `file` edits also exercise unlisted indexes)
                        0 => c.file = v as u32,
                        1 => c.file_offset = v,
                        2 => c.addr = v,
                        3 => c.len = v,
                        4 => c.stored_len = v,
                        5 => c.checksum = v,
                        _ => c.codec = if v & 1 == 0 { Codec::Raw } else { Codec::Zstd },
                    }
                } else {
                    edited.allocations[0].size = b.u64();
                }
                continue;
            }
        }
        std::fs::write(&path, content).unwrap();
    }
    if edit_manifest {
        std::fs::write(
            d.path.join(manifest_file_name(NSPID)),
            encode_manifest_unchecked(&edited),
        )
        .unwrap();
    }
    if let Ok(m2) = read_manifest(fd, NSPID) {
        let verified = verify_image(fd, &m2, 2).is_ok();
        let got = read_all(fd, &m2);
        if verified {
            assert_eq!(
                got.len(),
                m2.chunks.len(),
                "verify passed but a read failed"
            );
        }
        for (a, bytes) in got {
            assert_eq!(
                written.get(&a),
                Some(&bytes),
                "a damaged image returned bytes that were never written at {a:#x}"
            );
        }
    }
    for &i in &indexes {
        let _ = scan_data_file(fd, NSPID, i);
    }
}

fuzz_target!(|data: &[u8]| {
    let d = dir();
    clear(d);
    match data.first().map(|b| b % 4) {
        Some(0) => raw_files(d, &data[1..], false),
        Some(1) => raw_files(d, &data[1..], true),
        Some(2) => structured(d, &data[1..]),
        Some(_) => unpack(d, &data[1..]),
        None => {}
    }
});

/// Mode 3: the archive reader on arbitrary bytes, into `<dir>/unpack`.
fn unpack(d: &Dir, data: &[u8]) {
    let root = d.path.join("unpack");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir(&root).unwrap();
    let limits = archive::Limits {
        bytes: 1 << 20,
        entries: 64,
    };
    let _ = archive::unpack_into(data, &root, limits);
    let mut total = 0u64;
    let mut stack = vec![root.clone()];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            assert!(t.is_file() || t.is_dir(), "{:?} is neither", e.path());
            if t.is_dir() {
                stack.push(e.path());
            } else {
                total += e.metadata().unwrap().len();
            }
        }
    }
    assert!(total <= 1 << 20, "{total} bytes unpacked");
    for e in std::fs::read_dir(&d.path).unwrap() {
        let name = e.unwrap().file_name();
        assert!(
            name == "unpack" || name.to_string_lossy().starts_with("gpusnap-"),
            "{name:?} made beside the unpack directory"
        );
    }
    std::fs::remove_dir_all(&root).unwrap();
}
