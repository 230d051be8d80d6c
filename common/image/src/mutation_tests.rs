//! A damaged image is refused, naming a file of it, or reads back bit-exact; never wrong bytes,
//! never a panic.
//!
//! The campaign against the image readers in small form: one real image (a manifest, two data
//! files with raw, fused raw, raw_sum64, shrinking zstd and zstd-stored-raw chunks, and a device-file
//! record), and for every file of it, deterministically: single bit flips spread over its
//! headers, record headers and payloads; cuts at many lengths; garbage appended; its contents
//! swapped with another file's; and, for the manifest, hostile edits sealed again with a correct
//! checksum by the crate's own encoder. Each damaged image goes through what a restore reads
//! ([`read_manifests`], [`verify_image`], every chunk through [`DataFileReader::read_chunk`],
//! [`read_dev_file`]) and what `gpusnap verify` runs ([`unfinished_dumps`], [`read_manifest`] and
//! [`verify_image`] for every manifest).

use std::os::fd::BorrowedFd;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::time::Instant;

use crate::tests::{TempDir, append_sum64, noise};
use crate::*;
use gpusnap_proto::pid::NsPid;

const NSPID: NsPid = NsPid(21);
const DEVFILE_ID: u32 = 5;
const BASE: u64 = 0x7f10_0000_0000;

/// A fixed-seed xorshift64* generator: the cases are the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn compressible(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i / 61) as u8 ^ seed).collect()
}

/// What a restore gets back: every chunk's bytes in manifest order, and the device file.
#[derive(PartialEq, Debug)]
struct Contents {
    chunks: Vec<Vec<u8>>,
    devfile: DevFileRecord,
}

struct Image {
    dir: TempDir,
    manifest: Manifest,
    contents: Contents,
    /// Every file's name and complete bytes.
    files: Vec<(String, Vec<u8>)>,
}

fn build_image() -> Image {
    let dir = TempDir::new("image-test");
    let fd = dir.fd();
    let a0 = BASE;
    let a1 = BASE + 0x10_0000;
    let a2 = BASE + 0x20_0000;
    let mut w0 = DataFileWriter::create(fd, NSPID, 0).unwrap();
    let mut w1 = DataFileWriter::create(fd, NSPID, 1).unwrap();
    let planned: Vec<(u32, u64, Vec<u8>, u8)> = vec![
        (0, a0, noise(1200, 31), 0),
        (0, a0 + 1200, noise(900, 32), 1),
        (0, a0 + 2100, compressible(700, 3), 1),
        (1, a1, compressible(3000, 4), 2),
        (1, a1 + 3000, noise(800, 35), 2),
        (0, a2, noise(1024, 36), 3),
    ];
    let mut chunks = Vec::new();
    for (file, addr, data, how) in planned {
        let w = if file == 0 { &mut w0 } else { &mut w1 };
        let entry = match how {
            0 => w.append_chunk(addr, &data, Codec::Raw).unwrap(),
            1 => w.append_raw(addr, &data).unwrap().0,
            // Checked by its device hash (format 4).
            3 => append_sum64(w, addr, &data),
            _ => w.append_chunk(addr, &data, Codec::Zstd).unwrap(),
        };
        chunks.push((entry, data));
    }
    assert!(
        chunks.iter().any(|(c, _)| c.codec == Codec::Zstd),
        "the image has a zstd chunk"
    );
    assert!(
        chunks.iter().filter(|(c, _)| c.codec == Codec::Raw).count() >= 3,
        "the image has raw chunks"
    );
    let files = vec![w0.finish().unwrap(), w1.finish().unwrap()];
    chunks.sort_by_key(|(c, _)| c.addr);
    let (entries, data): (Vec<ChunkEntry>, Vec<Vec<u8>>) = chunks.into_iter().unzip();
    let allocations = vec![
        AllocationRecord {
            id: 1,
            device: 0,
            addr: a0,
            size: 2800,
            moved: true,
            lent: false,
            rdma_capable: false,
        },
        AllocationRecord {
            id: 2,
            device: 0,
            addr: a1,
            size: 3800,
            moved: true,
            lent: false,
            rdma_capable: false,
        },
        AllocationRecord {
            id: 3,
            device: 0,
            addr: a2,
            size: 1024,
            moved: true,
            lent: false,
            rdma_capable: false,
        },
    ];
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        nspid: NSPID,
        path: CheckpointPath::Split,
        created_unix_s: 1_700_000_000,
        gpusnap_version: "test".into(),
        driver_version: 13000,
        gpus: vec![GpuRecord {
            ordinal: 0,
            uuid: "0123456789abcdef0123456789abcdef".into(),
            name: "NVIDIA H200".into(),
            total_mem: 150_000_000_000,
        }],
        allocations,
        files,
        chunks: entries,
        timings_s: Default::default(),
        requires: None,
    };
    write_manifest(fd, &manifest).unwrap();
    let devfile = DevFileRecord {
        path: "/dev/nvidia0".into(),
        flags: libc::O_RDWR,
        gpu: Some("0123456789abcdef0123456789abcdef".into()),
    };
    write_dev_file(fd, DEVFILE_ID, &devfile).unwrap();
    let mut names = vec![manifest_file_name(NSPID)];
    names.extend(manifest.files.iter().map(|f| f.name.clone()));
    names.push(devfile_name(DEVFILE_ID));
    let files = names
        .into_iter()
        .map(|n| {
            let b = std::fs::read(dir.file(&n)).unwrap();
            (n, b)
        })
        .collect();
    Image {
        dir,
        manifest,
        contents: Contents {
            chunks: data,
            devfile,
        },
        files,
    }
}

/// What a restore reads, in its order.
fn restore_reads(dir: BorrowedFd<'_>) -> Result<Contents, ImageError> {
    let manifests = read_manifests(dir)?;
    let m = manifests
        .get(&NSPID)
        .ok_or_else(|| ImageError::MissingFile {
            file: manifest_file_name(NSPID),
        })?;
    verify_image(dir, m, 1)?;
    let mut readers = std::collections::BTreeMap::new();
    for i in m.file_indexes() {
        readers.insert(i, DataFileReader::open(dir, m, i)?);
    }
    let mut scratch = Vec::new();
    let mut chunks = Vec::new();
    for c in &m.chunks {
        let mut out = vec![0u8; c.len as usize];
        readers[&c.file].read_chunk(c, &mut out, &mut scratch)?;
        chunks.push(out);
    }
    Ok(Contents {
        chunks,
        devfile: read_dev_file(dir, DEVFILE_ID)?,
    })
}

/// What `gpusnap verify` runs on the directory: `Err` with its first failure.
fn verify_reads(dir: BorrowedFd<'_>) -> Result<(), ImageError> {
    if let Some((nspid, file)) = unfinished_dumps(dir)?.into_iter().next() {
        return Err(ImageError::UnfinishedDump {
            manifest: manifest_file_name(nspid),
            nspid,
            file,
        });
    }
    let nspids = list_manifests(dir)?;
    if !nspids.contains(&NSPID) {
        return Err(ImageError::MissingFile {
            file: manifest_file_name(NSPID),
        });
    }
    for nspid in nspids {
        let m = read_manifest(dir, nspid)?;
        verify_image(dir, &m, 1)?;
    }
    Ok(())
}

/// How one damaged image fared.
#[derive(Debug, PartialEq)]
enum Outcome {
    Refused,
    /// Read back exactly (allowed only where the bytes on disk are the image's own).
    Whole,
}

/// Runs both readers on the directory, each under `catch_unwind`: `Err` describes what went
/// wrong (a panic, an error that names no file of the image, wrong bytes, the two readers
/// disagreeing).
fn judge(img: &Image, state: &str) -> Result<Outcome, String> {
    let dir = img.dir.fd();
    let names_a_file = |e: &ImageError| {
        let s = e.to_string();
        img.files.iter().any(|(n, _)| s.contains(n.as_str()))
    };
    let restore = catch_unwind(AssertUnwindSafe(|| restore_reads(dir)))
        .map_err(|_| format!("{state}: the restore's reads panicked"))?;
    let verify = catch_unwind(AssertUnwindSafe(|| verify_reads(dir)))
        .map_err(|_| format!("{state}: gpusnap verify's reads panicked"))?;
    if let Err(e) = &verify
        && !names_a_file(e)
    {
        return Err(format!("{state}: verify's error names no file: {e}"));
    }
    match restore {
        Err(e) if !names_a_file(&e) => Err(format!("{state}: refused naming no file: {e}")),
        Err(_) => Ok(Outcome::Refused),
        Ok(got) if got != img.contents => Err(format!("{state}: read back wrong bytes")),
        Ok(_) => {
            // The devfile is not `gpusnap verify`'s; the rest it must refuse too.
            if verify.is_err() {
                Err(format!(
                    "{state}: the restore read it whole, verify refused: {verify:?}"
                ))
            } else {
                Ok(Outcome::Whole)
            }
        }
    }
}

fn put(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
}

/// Where to flip bits in file `i` of the image: its header and record headers byte by byte (a
/// random bit of each), and spread positions over the rest (the payloads, the manifest body).
fn flip_positions(img: &Image, i: usize, rng: &mut Rng) -> Vec<(usize, u8)> {
    let len = img.files[i].1.len();
    let mut heads: Vec<usize> = Vec::new();
    if i == 0 {
        // The manifest's header line.
        let line = img.files[0].1.iter().position(|&b| b == b'\n').unwrap() + 1;
        heads.extend(0..line);
    } else if i <= img.manifest.files.len() {
        let index = (i - 1) as u32;
        heads.extend(0..DATA_HEADER_LEN as usize);
        for c in img.manifest.chunks.iter().filter(|c| c.file == index) {
            let r = (c.file_offset - RECORD_LEN) as usize;
            heads.extend(r..r + RECORD_LEN as usize);
        }
    } else {
        heads.extend(0..len);
    }
    let mut v: Vec<(usize, u8)> = heads
        .into_iter()
        .map(|p| (p, 1u8 << rng.below(8)))
        .collect();
    while v.len() < 200.min(len * 8) {
        v.push((rng.below(len as u64) as usize, 1u8 << rng.below(8)));
    }
    v.sort_unstable();
    v.dedup();
    v
}

/// Hostile manifests, each sealed with a correct checksum: name and manifest.
fn manifest_edits(m: &Manifest) -> Vec<(&'static str, Manifest)> {
    let mut out: Vec<(&'static str, Manifest)> = Vec::new();
    let mut edit = |what: &'static str, f: &dyn Fn(&mut Manifest)| {
        let mut e = m.clone();
        f(&mut e);
        assert_ne!(&e, m, "{what}: the edit changes the manifest");
        out.push((what, e));
    };
    let first_in = |m: &Manifest, file: u32| m.chunks.iter().position(|c| c.file == file).unwrap();
    edit("a chunk past the end of its file", &|e| {
        e.chunks[0].file_offset = e.files[0].size + RECORD_LEN;
    });
    edit("a chunk whose stored bytes run past the end", &|e| {
        let last = e.chunks.iter().rposition(|c| c.file == 0).unwrap();
        e.chunks[last].stored_len += 4096;
        e.chunks[last].len += 4096;
    });
    edit("two chunks at one file offset", &|e| {
        e.chunks[1].file_offset = e.chunks[0].file_offset;
    });
    edit("chunks overlapping in the file", &|e| {
        e.chunks[1].file_offset -= 8;
    });
    edit("a raw chunk one byte longer than its record", &|e| {
        e.chunks[0].len += 1;
        e.chunks[0].stored_len += 1;
    });
    edit("a raw chunk one byte shorter than its record", &|e| {
        e.chunks[0].len -= 1;
        e.chunks[0].stored_len -= 1;
    });
    edit("a zstd chunk with another length", &|e| {
        let z = e
            .chunks
            .iter()
            .position(|c| c.codec == Codec::Zstd)
            .unwrap();
        e.chunks[z].len += 1;
    });
    edit("a zstd chunk called raw", &|e| {
        let z = e
            .chunks
            .iter()
            .position(|c| c.codec == Codec::Zstd)
            .unwrap();
        e.chunks[z].codec = Codec::Raw;
    });
    edit("a raw chunk called zstd", &|e| {
        e.chunks[0].codec = Codec::Zstd
    });
    edit("a chunk with another checksum", &|e| {
        e.chunks[2].checksum ^= 1
    });
    edit("a chunk at another address", &|e| e.chunks[0].addr += 1);
    edit("two chunks at one address", &|e| {
        e.chunks[1].addr = e.chunks[0].addr;
    });
    edit("a chunk listed twice", &|e| {
        let c = e.chunks[0].clone();
        e.chunks.insert(1, c);
    });
    edit("a chunk left out", &|e| {
        e.chunks.remove(1);
    });
    edit("the last chunk of a file left out", &|e| {
        let last = e.chunks.iter().rposition(|c| c.file == 1).unwrap();
        e.chunks.remove(last);
    });
    edit("a chunk in a file not listed", &|e| e.chunks[0].file = 7);
    edit("a chunk moved to the other file", &|e| {
        let i = first_in(e, 1);
        e.chunks[i].file = 0;
    });
    edit("a chunk of length 0", &|e| {
        e.chunks[0].len = 0;
        e.chunks[0].stored_len = 0;
    });
    edit("a chunk from an ancestor that is not there", &|e| {
        e.chunks[0].parent_depth = 1;
    });
    edit("a file listed twice", &|e| {
        let f = e.files[0].clone();
        e.files.push(f);
    });
    edit("a file left out", &|e| {
        e.files.remove(1);
    });
    edit("a file one byte longer", &|e| e.files[0].size += 1);
    edit("a file one byte shorter", &|e| e.files[1].size -= 1);
    edit("a file of another process", &|e| {
        e.files[0].name = data_file_name(NsPid(NSPID.get() + 1), 0);
    });
    edit("a file outside the directory", &|e| {
        e.files[0].name = format!("../{}", e.files[0].name);
    });
    edit("an allocation larger than its chunks", &|e| {
        e.allocations[0].size += 4096;
    });
    edit("an allocation smaller than its chunks", &|e| {
        e.allocations[1].size -= 1;
    });
    edit("allocations that overlap", &|e| {
        e.allocations[1].addr = e.allocations[0].addr + 16;
    });
    edit("an allocation on a GPU not listed", &|e| {
        e.allocations[0].device = 3;
    });
    edit("another process's number", &|e| {
        e.nspid = NsPid(NSPID.get() + 1)
    });
    edit("an unknown format version", &|e| e.format_version = 99);
    edit("no GPUs", &|e| e.gpus.clear());
    out
}

/// Every damage to every file of the image is refused, naming a file of it, or reads back
/// bit-exact where the bytes are the image's own; never a wrong byte, never a panic.
#[test]
fn every_damage_to_every_file_of_an_image_is_refused_or_harmless() {
    let started = Instant::now();
    let img = build_image();
    let mut failures: Vec<String> = Vec::new();
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    let mut whole_after_change: Vec<String> = Vec::new();
    let mut rng = Rng(0x5eed_cafe_f00d_0001);

    let mut run = |state: String, kind: &'static str, changed: bool| {
        *counts.entry(kind).or_default() += 1;
        match judge(&img, &state) {
            Err(f) => failures.push(f),
            Ok(Outcome::Whole) if changed => whole_after_change.push(state),
            Ok(_) => {}
        }
    };

    // The undamaged image reads back whole.
    assert_eq!(judge(&img, "the undamaged image"), Ok(Outcome::Whole));

    for i in 0..img.files.len() {
        let (name, full) = &img.files[i];
        let path = img.dir.file(name);
        for (pos, bit) in flip_positions(&img, i, &mut rng) {
            let mut b = full.clone();
            b[pos] ^= bit;
            put(&path, &b);
            run(
                format!("{name}: bit {bit:#04x} of byte {pos} flipped"),
                "flip",
                true,
            );
        }
        let len = full.len() as u64;
        let mut cuts: Vec<u64> = vec![0, 1, 7, 8, 63, 64, 65, 127, 128, len / 2, len - 1];
        for _ in 0..20 {
            cuts.push(rng.below(len));
        }
        cuts.retain(|&c| c < len);
        cuts.sort_unstable();
        cuts.dedup();
        for c in cuts {
            put(&path, &full[..c as usize]);
            run(format!("{name}: cut to {c} of {len} bytes"), "cut", true);
        }
        let first_record: Vec<u8> = img.files[1].1
            [DATA_HEADER_LEN as usize..(DATA_HEADER_LEN + RECORD_LEN) as usize]
            .to_vec();
        for (what, tail) in [
            ("a zero byte", vec![0u8]),
            ("64 zero bytes", vec![0u8; 64]),
            ("noise", noise(300, 9)),
            ("a copy of a record header", first_record),
            ("a copy of itself", full.clone()),
        ] {
            let mut b = full.clone();
            b.extend_from_slice(&tail);
            put(&path, &b);
            run(format!("{name}: {what} appended"), "append", true);
        }
        put(&path, full);
        for (j, (other, other_bytes)) in img.files.iter().enumerate().skip(i + 1) {
            let other_path = img.dir.file(other);
            put(&path, other_bytes);
            put(&other_path, full);
            run(format!("{name} and {other} swapped"), "swap", true);
            put(&path, other_bytes);
            put(&other_path, other_bytes);
            run(format!("{other} in place of {name}"), "swap", true);
            put(&path, full);
            put(&other_path, full);
            run(format!("{name} in place of {other}"), "swap", true);
            put(&other_path, &img.files[j].1);
        }
        put(&path, full);
    }

    let mpath = img.dir.file(&img.files[0].0);
    for (what, m) in manifest_edits(&img.manifest) {
        put(&mpath, &encode_manifest_unchecked(&m));
        run(
            format!("manifest resealed with {what}"),
            "manifest edit",
            true,
        );
    }
    // Sealed again unchanged: the same bytes, read back whole.
    let resealed = encode_manifest_unchecked(&img.manifest);
    assert_eq!(
        resealed, img.files[0].1,
        "the encoder reproduces the manifest"
    );
    put(&mpath, &resealed);
    run("manifest resealed unchanged".into(), "manifest edit", false);
    assert_eq!(judge(&img, "everything put back"), Ok(Outcome::Whole));

    let elapsed = started.elapsed();
    eprintln!("cases {counts:?} in {elapsed:?}");
    assert!(
        failures.is_empty(),
        "{} of the cases went wrong, first ones:\n{}",
        failures.len(),
        failures[..failures.len().min(25)].join("\n")
    );
    assert!(
        whole_after_change.is_empty(),
        "changed bytes accepted as the image ({}):\n{}",
        whole_after_change.len(),
        whole_after_change[..whole_after_change.len().min(25)].join("\n")
    );
    assert!(counts["flip"] > 600, "{counts:?}");
    assert!(counts["cut"] > 80, "{counts:?}");
    assert!(counts["swap"] >= 18, "{counts:?}");
    assert!(counts["manifest edit"] >= 30, "{counts:?}");
}
