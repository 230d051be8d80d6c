//! Round trips and every kind of damage the readers must refuse, in throwaway directories.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::*;
use gpusnap_proto::pid::{HostPid, NsPid};

/// A fresh directory, removed on drop, with an open fd on it (shared by the crate's tests).
pub(crate) use criu_tests::fixtures::TempDir;

const NSPID: NsPid = NsPid(12);
const CHUNK: usize = 4096;
const BASE: u64 = 0x7f00_0000_0000;

/// Deterministic bytes that zstd cannot shrink.
pub(crate) fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Bytes zstd shrinks a lot.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len).map(|i| ((i / 64) as u64 ^ seed) as u8).collect()
}

struct Image {
    m: Manifest,
    /// The device bytes of each chunk, in manifest order.
    data: Vec<Vec<u8>>,
}

/// A split-path image of two files: file 0 holds 3 raw chunks of allocation 1, file 1 holds
/// 2 zstd chunks (one compressible, one not) of allocation 2. Allocation 3 was left to the driver.
fn make_image(dir: BorrowedFd<'_>) -> Image {
    let mut data = Vec::new();
    let mut chunks = Vec::new();
    let mut w0 = DataFileWriter::create(dir, NSPID, 0).unwrap();
    for i in 0..3u64 {
        let d = noise(CHUNK, i);
        let addr = BASE + i * CHUNK as u64;
        // Both ways of writing a raw chunk (the middle one hashed while it is written).
        chunks.push(if i == 1 {
            w0.append_raw(addr, &d).unwrap().0
        } else {
            w0.append_chunk(addr, &d, Codec::Raw).unwrap()
        });
        data.push(d);
    }
    let mut w1 = DataFileWriter::create(dir, NSPID, 1).unwrap();
    let a2 = BASE + 0x10_0000;
    for (i, d) in [pattern(CHUNK, 7), noise(CHUNK, 9)].into_iter().enumerate() {
        chunks.push(
            w1.append_chunk(a2 + (i * CHUNK) as u64, &d, Codec::Zstd)
                .unwrap(),
        );
        data.push(d);
    }
    let files = vec![w0.finish().unwrap(), w1.finish().unwrap()];
    let m = Manifest {
        format_version: FORMAT_VERSION,
        nspid: NSPID,
        path: CheckpointPath::Split,
        created_unix_s: 1_700_000_000,
        gpusnap_version: "0.1.0".into(),
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
                addr: BASE,
                size: 3 * CHUNK as u64,
                moved: true,
                lent: false,
                rdma_capable: false,
            },
            AllocationRecord {
                id: 2,
                device: 0,
                addr: a2,
                size: 2 * CHUNK as u64,
                moved: true,
                lent: false,
                rdma_capable: false,
            },
            AllocationRecord {
                id: 3,
                device: 0,
                addr: BASE + 0x20_0000,
                size: 1 << 20,
                moved: false,
                lent: false,
                rdma_capable: false,
            },
        ],
        files,
        chunks,
        timings_s: BTreeMap::from([("lock".to_string(), 0.01), ("copy".to_string(), 1.5)]),
        requires: None,
    };
    write_manifest(dir, &m).unwrap();
    Image { m, data }
}

/// Writes `m` without validation (to plant a bad manifest with a correct checksum).
pub(crate) fn plant(dir: BorrowedFd<'_>, m: &Manifest) {
    crate::manifest::write_manifest_bytes(dir, m.nspid, &encode_manifest_unchecked(m)).unwrap();
}

/// Appends `data` at `addr` as a `raw_sum64` chunk, with its device hash as the GPU computes it.
pub(crate) fn append_sum64(w: &mut DataFileWriter, addr: u64, data: &[u8]) -> ChunkEntry {
    let h = gpusnap_proto::devhash::device_hash(data).expect("a whole number of words");
    w.append_raw_sum64(addr, data, h).unwrap()
}

pub(crate) fn flip(path: &Path, offset: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 0x01;
    f.write_all_at(&b, offset).unwrap();
}

fn set_len(path: &Path, len: u64) {
    OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

fn append(path: &Path, bytes: &[u8]) {
    use std::io::Write;
    OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
}

fn read_all(dir: BorrowedFd<'_>, m: &Manifest) -> Result<Vec<Vec<u8>>, ImageError> {
    let readers: std::collections::HashMap<u32, DataFileReader> = m
        .file_indexes()
        .into_iter()
        .map(|i| Ok((i, DataFileReader::open(dir, m, i)?)))
        .collect::<Result<_, ImageError>>()?;
    let mut scratch = Vec::new();
    m.chunks
        .iter()
        .map(|c| {
            let mut out = vec![0u8; c.len as usize];
            readers[&c.file].read_chunk(c, &mut out, &mut scratch)?;
            Ok(out)
        })
        .collect()
}

#[test]
fn round_trip_raw_and_zstd() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    let m = read_manifest(t.fd(), NSPID).unwrap();
    assert_eq!(m, img.m);
    let codecs: Vec<_> = m.chunks.iter().map(|c| c.codec).collect();
    // The compressible chunk stays zstd, the noise falls back to raw.
    assert_eq!(
        codecs,
        [Codec::Raw, Codec::Raw, Codec::Raw, Codec::Zstd, Codec::Raw]
    );
    assert!(m.chunks[3].stored_len < m.chunks[3].len);
    assert_eq!(read_all(t.fd(), &m).unwrap(), img.data);

    let r = verify_image(t.fd(), &m, 4).unwrap();
    assert_eq!(r.chunks, 5);
    assert_eq!(r.bytes, 5 * CHUNK as u64);
    assert_eq!(
        r.stored_bytes,
        m.chunks.iter().map(|c| c.stored_len).sum::<u64>()
    );
    assert_eq!(list_manifests(t.fd()).unwrap(), vec![NSPID]);
}

#[test]
fn raw_chunks_hashed_while_written_match_chunks_hashed_first() {
    // Longer than several pieces, and not a whole number of them.
    let d = noise((600 << 10) + 5, 42);
    let t = TempDir::new("image-test");
    let mut a = DataFileWriter::create(t.fd(), NSPID, 0).unwrap();
    let mut b = DataFileWriter::create(t.fd(), NSPID, 1).unwrap();
    let first = a.append_chunk(BASE, &d, Codec::Raw).unwrap();
    let (streamed, hashes) = b.append_raw(BASE, &d).unwrap();
    assert_eq!(hashes, hash_chunk(&d));
    assert_eq!(
        ChunkEntry {
            file: 0,
            ..streamed.clone()
        },
        first
    );
    // A second chunk follows the first in the file, header included.
    let (second, _) = b.append_raw(BASE + d.len() as u64, &d[..1000]).unwrap();
    assert_eq!(
        second.file_offset,
        streamed.file_offset + streamed.len + RECORD_LEN
    );
    let (fa, fb) = (a.finish().unwrap(), b.finish().unwrap());
    assert_eq!(
        std::fs::read(t.file(&fa.name)).unwrap()[DATA_HEADER_LEN as usize..],
        std::fs::read(t.file(&fb.name)).unwrap()[DATA_HEADER_LEN as usize..fa.size as usize]
    );
    assert_eq!(fb.size, fa.size + RECORD_LEN + 1000);

    // File 1 as an image of its own: read back, verified, and a flipped byte in a later piece
    // of the long chunk is caught both ways.
    let template = make_image(TempDir::new("image-test").fd()).m;
    let m = Manifest {
        allocations: vec![AllocationRecord {
            id: 1,
            device: 0,
            addr: BASE,
            size: d.len() as u64 + 1000,
            moved: true,
            lent: false,
            rdma_capable: false,
        }],
        files: vec![fb.clone()],
        chunks: vec![
            ChunkEntry {
                file: 1,
                ..streamed.clone()
            },
            second,
        ],
        ..template
    };
    std::fs::remove_file(t.file(&fa.name)).unwrap();
    plant(t.fd(), &m);
    let m = read_manifest(t.fd(), NSPID).unwrap();
    assert_eq!(
        read_all(t.fd(), &m).unwrap(),
        [d.clone(), d[..1000].to_vec()]
    );
    verify_image(t.fd(), &m, 2).unwrap();
    flip(&t.file(&fb.name), streamed.file_offset + (300 << 10));
    let is_checksum = |e: &ImageError| matches!(e, ImageError::ChunkChecksum { chunk: 0, .. });
    let e = verify_image(t.fd(), &m, 2).unwrap_err();
    assert!(is_checksum(&e), "{e}");
    let e = read_all(t.fd(), &m).unwrap_err();
    assert!(is_checksum(&e), "{e}");
}

#[test]
fn readers_are_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    fn assert_send<T: Send>() {}
    assert_send_sync::<DataFileReader>();
    assert_send::<DataFileWriter>();

    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    let r = DataFileReader::open(t.fd(), &img.m, 0).unwrap();
    std::thread::scope(|s| {
        for (k, c) in img.m.chunks.iter().enumerate().filter(|(_, c)| c.file == 0) {
            let (r, want) = (&r, &img.data[k]);
            s.spawn(move || {
                let mut out = vec![0u8; c.len as usize];
                r.read_chunk(c, &mut out, &mut Vec::new()).unwrap();
                assert_eq!(&out, want);
            });
        }
    });
}

#[test]
fn files_are_private_and_stale_files_are_replaced() {
    let t = TempDir::new("image-test");
    std::fs::write(t.file(data_file_name(NSPID, 0)), b"stale stale stale").unwrap();
    let img = make_image(t.fd());
    for name in img
        .m
        .files
        .iter()
        .map(|f| f.name.clone())
        .chain([manifest_file_name(NSPID)])
    {
        let meta = std::fs::metadata(t.file(&name)).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600, "{name}");
    }
    assert!(!t.file(manifest_tmp_name(NSPID)).exists());
    read_manifest(t.fd(), NSPID).unwrap();
}

#[test]
fn write_manifest_refuses_what_readers_refuse() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    let mut m = img.m.clone();
    m.chunks[0].addr = BASE + 0x30_0000; // inside the driver-saved allocation
    assert!(matches!(
        write_manifest(t.fd(), &m),
        Err(ImageError::ChunkOutsideAllocation { chunk: 0, .. })
    ));
    let mut m = img.m.clone();
    m.timings_s.insert("nan".into(), f64::NAN);
    assert!(matches!(
        write_manifest(t.fd(), &m),
        Err(ImageError::InvalidManifest { .. })
    ));
    // The good manifest is untouched.
    assert_eq!(read_manifest(t.fd(), NSPID).unwrap(), img.m);
}

#[test]
fn flipped_byte_in_each_data_file_header() {
    for file in 0..2u32 {
        for offset in [0, 9, 17, 21, 30, 60] {
            let t = TempDir::new("image-test");
            make_image(t.fd());
            flip(&t.file(data_file_name(NSPID, file)), offset);
            let e = read_manifest(t.fd(), NSPID).unwrap_err();
            assert!(
                matches!(
                    e,
                    ImageError::DataHeaderMagic { .. } | ImageError::DataHeaderChecksum { .. }
                ),
                "file {file} offset {offset}: {e}"
            );
            assert!(e.to_string().contains(&data_file_name(NSPID, file)));
        }
    }
}

#[test]
fn flipped_byte_in_each_payload_and_record_header() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    for (k, c) in img.m.chunks.iter().enumerate() {
        let path = t.file(data_file_name(NSPID, c.file));
        // payload: first, middle and last byte
        for off in [0, c.stored_len / 2, c.stored_len - 1] {
            flip(&path, c.file_offset + off);
            let m = read_manifest(t.fd(), NSPID).unwrap(); // sizes unchanged: still passes
            let e = verify_image(t.fd(), &m, 2).unwrap_err();
            assert!(
                matches!(e, ImageError::ChunkChecksum { chunk, .. } if chunk == k),
                "chunk {k} +{off}: {e}"
            );
            let msg = e.to_string();
            assert_eq!(
                msg,
                format!(
                    "{}: chunk {k} checksum mismatch (image damaged; do not restore from it)",
                    data_file_name(NSPID, c.file)
                )
            );
            flip(&path, c.file_offset + off);
        }
        // record header: magic, fields, checksum
        for off in [0, 8, 16, 40, 56] {
            flip(&path, c.file_offset - RECORD_LEN + off);
            let e = verify_image(t.fd(), &img.m, 2).unwrap_err();
            assert!(
                matches!(e, ImageError::ChunkRecord { chunk, .. } if chunk == k),
                "chunk {k} record +{off}: {e}"
            );
            flip(&path, c.file_offset - RECORD_LEN + off);
        }
    }
    verify_image(t.fd(), &img.m, 2).unwrap();
}

#[test]
fn truncation_of_each_file() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    let mname = manifest_file_name(NSPID);
    let msize = std::fs::metadata(t.file(&mname)).unwrap().len();
    for name in img
        .m
        .files
        .iter()
        .map(|f| f.name.clone())
        .chain([mname.clone()])
    {
        let path = t.file(&name);
        let original = std::fs::read(&path).unwrap();
        for len in [
            0,
            10,
            63,
            64,
            original.len() as u64 / 2,
            original.len() as u64 - 1,
        ] {
            set_len(&path, len);
            let e = read_manifest(t.fd(), NSPID).unwrap_err();
            let ok = if name == mname && len < 64 {
                // the header line itself is cut short
                matches!(
                    e,
                    ImageError::ManifestHeader { .. } | ImageError::Truncated { .. }
                )
            } else {
                matches!(e, ImageError::Truncated { .. })
            };
            assert!(ok, "{name} cut to {len}: {e}");
            assert!(e.to_string().contains(&name), "{e}");
            std::fs::write(&path, &original).unwrap();
        }
    }
    assert_eq!(
        std::fs::metadata(t.file(&mname)).unwrap().len(),
        msize,
        "restored"
    );
    read_manifest(t.fd(), NSPID).unwrap();
}

#[test]
fn extra_bytes_after_each_file() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    for name in img
        .m
        .files
        .iter()
        .map(|f| f.name.clone())
        .chain([manifest_file_name(NSPID)])
    {
        let path = t.file(&name);
        let original = std::fs::read(&path).unwrap();
        for extra in [&b"\n"[..], b" ", b"garbage"] {
            append(&path, extra);
            let e = read_manifest(t.fd(), NSPID).unwrap_err();
            assert!(matches!(e, ImageError::TrailingData { .. }), "{name}: {e}");
            std::fs::write(&path, &original).unwrap();
        }
    }
}

#[test]
fn flipped_bit_anywhere_in_the_manifest() {
    let t = TempDir::new("image-test");
    make_image(t.fd());
    let path = t.file(manifest_file_name(NSPID));
    let len = std::fs::metadata(&path).unwrap().len();
    for off in 0..len {
        flip(&path, off);
        let e = read_manifest(t.fd(), NSPID);
        assert!(e.is_err(), "flip at {off} accepted");
        if off > 70 {
            assert!(
                matches!(e, Err(ImageError::ManifestChecksum { .. })),
                "{off}: {e:?}"
            );
        }
        flip(&path, off);
    }
    read_manifest(t.fd(), NSPID).unwrap();
}

#[test]
fn unknown_version_is_refused() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    let path = t.file(manifest_file_name(NSPID));
    let good = std::fs::read(&path).unwrap();
    // In the header line.
    let bad = String::from_utf8(good.clone()).unwrap().replacen(
        "GPUSNAP-MANIFEST 7 ",
        "GPUSNAP-MANIFEST 8 ",
        1,
    );
    assert_ne!(bad.as_bytes(), &good[..], "the header names version 7");
    std::fs::write(&path, bad).unwrap();
    let e = read_manifest(t.fd(), NSPID).unwrap_err();
    assert!(
        matches!(e, ImageError::UnsupportedVersion { found: 8, .. }),
        "{e}"
    );
    // In the JSON body, with a correct checksum.
    let mut m = img.m.clone();
    m.format_version = 9;
    plant(t.fd(), &m);
    let e = read_manifest(t.fd(), NSPID).unwrap_err();
    assert!(
        matches!(e, ImageError::UnsupportedVersion { found: 9, .. }),
        "{e}"
    );
    // The message names the versions this build reads: every one of READ_MANIFEST_VERSIONS
    // lies in the span it gives.
    let msg = e.to_string();
    let (lo, hi) = (
        *crate::READ_MANIFEST_VERSIONS.iter().min().unwrap(),
        *crate::READ_MANIFEST_VERSIONS.iter().max().unwrap(),
    );
    assert!(
        msg.contains(&format!("manifest versions {lo} to {hi}")),
        "{msg}"
    );
    assert_eq!(hi, crate::FORMAT_VERSION, "a writer's own version is read");
    // In a data file header (resealed, so only the version is wrong).
    std::fs::write(&path, &good).unwrap();
    let dpath = t.file(data_file_name(NSPID, 1));
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&dpath)
        .unwrap();
    let mut h = [0u8; 64];
    f.read_exact_at(&mut h, 0).unwrap();
    h[8] = 2;
    let sum = xxhash_rust::xxh3::xxh3_64(&h[..56]);
    h[56..].copy_from_slice(&sum.to_le_bytes());
    f.write_all_at(&h, 0).unwrap();
    let e = read_manifest(t.fd(), NSPID).unwrap_err();
    assert!(
        matches!(e, ImageError::UnsupportedVersion { found: 2, ref file } if *file == data_file_name(NSPID, 1)),
        "{e}"
    );
}

#[test]
fn bad_file_names_are_refused() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    for name in [
        "../gpusnap-12-data-0.img",
        "gpusnap-12-data-0.img/",
        "/etc/passwd",
        "gpusnap-13-data-0.img",
        "gpusnap-12-data-00.img",
        "gpusnap-12-manifest.img",
        "gpusnap-stats.json",
        "..",
        "",
    ] {
        let mut m = img.m.clone();
        m.files[0].name = name.into();
        plant(t.fd(), &m);
        let e = read_manifest(t.fd(), NSPID).unwrap_err();
        assert!(
            matches!(e, ImageError::BadFileName { index: 0, .. }),
            "{name}: {e}"
        );
        assert!(matches!(
            DataFileReader::open(t.fd(), &m, 0),
            Err(ImageError::InvalidManifest { .. })
        ));
        assert!(matches!(
            verify_image(t.fd(), &m, 1),
            Err(ImageError::BadFileName { .. })
        ));
    }
    // The same file twice.
    let mut m = img.m.clone();
    m.files[0].name = m.files[1].name.clone();
    plant(t.fd(), &m);
    let e = read_manifest(t.fd(), NSPID).unwrap_err();
    assert!(matches!(e, ImageError::InvalidManifest { .. }), "{e}");
}

#[test]
fn file_indexes_may_have_gaps_and_any_order() {
    // Of 12 writers only 3 and 11 got work (the others left no file); listed in name order,
    // where "...-11.img" sorts before "...-3.img".
    let t = TempDir::new("image-test");
    let mut m = make_image(t.fd()).m; // for its GPUs; its files are replaced below
    remove_process_files(t.fd(), NSPID).unwrap();
    let mut w3 = DataFileWriter::create(t.fd(), NSPID, 3).unwrap();
    let mut w11 = DataFileWriter::create(t.fd(), NSPID, 11).unwrap();
    let (a, b) = (noise(CHUNK, 1), pattern(CHUNK, 2));
    m.chunks = vec![
        w11.append_chunk(BASE, &a, Codec::Raw).unwrap(),
        w3.append_chunk(BASE + CHUNK as u64, &b, Codec::Zstd)
            .unwrap(),
    ];
    m.files = vec![w3.finish().unwrap(), w11.finish().unwrap()];
    m.files.sort_by(|x, y| x.name.cmp(&y.name));
    m.allocations.truncate(1);
    m.allocations[0].size = 2 * CHUNK as u64;
    write_manifest(t.fd(), &m).unwrap();
    let m = read_manifest(t.fd(), NSPID).unwrap();
    assert_eq!(m.file_indexes(), vec![11, 3]);
    assert_eq!(m.file(3).unwrap().name, data_file_name(NSPID, 3));
    assert!(m.file(0).is_none());
    assert_eq!(verify_image(t.fd(), &m, 4).unwrap().chunks, 2);
    let r = DataFileReader::open(t.fd(), &m, 11).unwrap();
    let mut out = vec![0; CHUNK];
    r.read_chunk(&m.chunks[0], &mut out, &mut Vec::new())
        .unwrap();
    assert_eq!(out, a);
    assert_eq!(read_all(t.fd(), &m).unwrap(), vec![a, b]);

    // A chunk in a file the manifest does not list.
    let mut bad = m.clone();
    bad.chunks[0].file = 4;
    plant(t.fd(), &bad);
    assert!(matches!(
        read_manifest(t.fd(), NSPID),
        Err(ImageError::ChunkFileIndex {
            chunk: 0,
            index: 4,
            ..
        })
    ));
    // A data file renamed: its header still says index 3.
    std::fs::rename(
        t.file(data_file_name(NSPID, 3)),
        t.file(data_file_name(NSPID, 4)),
    )
    .unwrap();
    let mut bad = m.clone();
    bad.files[1].name = data_file_name(NSPID, 4);
    bad.chunks[1].file = 4;
    plant(t.fd(), &bad);
    assert!(matches!(
        read_manifest(t.fd(), NSPID),
        Err(ImageError::DataHeaderMismatch {
            field: "file index",
            expected: 4,
            found: 3,
            ..
        })
    ));
}

#[test]
fn missing_data_file_is_refused() {
    let t = TempDir::new("image-test");
    make_image(t.fd());
    std::fs::remove_file(t.file(data_file_name(NSPID, 1))).unwrap();
    let e = read_manifest(t.fd(), NSPID).unwrap_err();
    assert!(
        matches!(e, ImageError::MissingFile { ref file } if *file == data_file_name(NSPID, 1)),
        "{e}"
    );
}

#[test]
fn missing_manifest_is_refused() {
    let t = TempDir::new("image-test");
    assert!(matches!(
        read_manifest(t.fd(), NsPid(99)),
        Err(ImageError::MissingFile { .. })
    ));
}

#[test]
fn nspid_mismatch_is_refused() {
    let t = TempDir::new("image-test");
    make_image(t.fd());
    std::fs::rename(
        t.file(manifest_file_name(NSPID)),
        t.file(manifest_file_name(NsPid(13))),
    )
    .unwrap();
    assert!(matches!(
        read_manifest(t.fd(), NsPid(13)),
        Err(ImageError::NspidMismatch {
            expected: NsPid(13),
            found: NsPid(12),
            ..
        })
    ));
}

#[test]
fn chunk_outside_its_file_is_refused() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    for (off, stored) in [(0, None), (64, None), (100, None), (u64::MAX - 8, None)] {
        let mut m = img.m.clone();
        m.chunks[1].file_offset = off;
        if let Some(s) = stored {
            m.chunks[1].stored_len = s;
        }
        plant(t.fd(), &m);
        let e = read_manifest(t.fd(), NSPID).unwrap_err();
        assert!(
            matches!(e, ImageError::ChunkOutsideFile { chunk: 1, .. }),
            "{off}: {e}"
        );
    }
    // Past the end of the file.
    let mut m = img.m.clone();
    m.chunks[2].file_offset = m.files[0].size - 10;
    plant(t.fd(), &m);
    let e = read_manifest(t.fd(), NSPID).unwrap_err();
    assert!(
        matches!(e, ImageError::ChunkOutsideFile { chunk: 2, .. }),
        "{e}"
    );
    // The reader refuses it too, even when handed the unvalidated manifest.
    let r = DataFileReader::open(t.fd(), &m, 0).unwrap();
    let e = r
        .read_chunk(&m.chunks[2], &mut vec![0; CHUNK], &mut Vec::new())
        .unwrap_err();
    assert!(matches!(e, ImageError::ChunkOutsideFile { .. }), "{e}");
    // A chunk in a file the manifest does not list.
    let mut m = img.m.clone();
    m.chunks[0].file = 5;
    plant(t.fd(), &m);
    assert!(matches!(
        read_manifest(t.fd(), NSPID),
        Err(ImageError::ChunkFileIndex {
            chunk: 0,
            index: 5,
            ..
        })
    ));
}

#[test]
fn overlapping_chunks_are_refused() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    // Same bytes of the file.
    let mut m = img.m.clone();
    m.chunks[1].file_offset = m.chunks[0].file_offset + 100;
    plant(t.fd(), &m);
    let e = read_manifest(t.fd(), NSPID).unwrap_err();
    assert!(matches!(e, ImageError::ChunkOverlap { .. }), "{e}");
    // Same device addresses.
    let mut m = img.m.clone();
    m.chunks[1].addr = m.chunks[0].addr + 16;
    plant(t.fd(), &m);
    let e = read_manifest(t.fd(), NSPID).unwrap_err();
    assert!(matches!(e, ImageError::ChunkAddrOverlap { .. }), "{e}");
    // A duplicated entry.
    let mut m = img.m.clone();
    m.chunks.push(m.chunks[0].clone());
    plant(t.fd(), &m);
    assert!(read_manifest(t.fd(), NSPID).is_err());
}

#[test]
fn chunk_outside_any_allocation_is_refused() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    for addr in [
        0,
        BASE - 1,
        BASE + 0x20_0000,
        BASE + 3 * CHUNK as u64 - 1,
        u64::MAX - 10,
    ] {
        let mut m = img.m.clone();
        m.chunks[0].addr = addr;
        plant(t.fd(), &m);
        let e = read_manifest(t.fd(), NSPID).unwrap_err();
        assert!(
            matches!(e, ImageError::ChunkOutsideAllocation { chunk: 0, .. }),
            "{addr:#x}: {e}"
        );
    }
}

#[test]
fn allocation_and_sum_checks() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    let mut m = img.m.clone();
    m.allocations[1].addr = BASE + 100;
    plant(t.fd(), &m);
    assert!(matches!(
        read_manifest(t.fd(), NSPID),
        Err(ImageError::AllocationOverlap { .. })
    ));
    // A moved allocation only partly covered.
    let mut m = img.m.clone();
    m.allocations[0].size += CHUNK as u64;
    plant(t.fd(), &m);
    assert!(matches!(
        read_manifest(t.fd(), NSPID),
        Err(ImageError::SumMismatch { .. })
    ));
    // A chunk dropped from the manifest leaves a hole in its file.
    let mut m = img.m.clone();
    m.chunks.remove(2);
    m.allocations[0].size -= CHUNK as u64;
    plant(t.fd(), &m);
    let e = read_manifest(t.fd(), NSPID).unwrap_err();
    assert!(matches!(e, ImageError::SumMismatch { .. }), "{e}");
    // Raw chunk with stored_len != len; zero and oversized lengths.
    for (len, stored) in [(CHUNK as u64, CHUNK as u64 - 1), (0, 0), (2 << 30, 2 << 30)] {
        let mut m = img.m.clone();
        m.chunks[0].len = len;
        m.chunks[0].stored_len = stored;
        plant(t.fd(), &m);
        assert!(matches!(
            read_manifest(t.fd(), NSPID),
            Err(ImageError::ChunkLength { chunk: 0, .. })
        ));
    }
    // Allocation on an unknown GPU, bad uuid, transparent path with chunks.
    let mut m = img.m.clone();
    m.allocations[2].device = 3;
    plant(t.fd(), &m);
    assert!(matches!(
        read_manifest(t.fd(), NSPID),
        Err(ImageError::InvalidManifest { .. })
    ));
    let mut m = img.m.clone();
    m.gpus[0].uuid = "GPU-0123".into();
    plant(t.fd(), &m);
    assert!(matches!(
        read_manifest(t.fd(), NSPID),
        Err(ImageError::InvalidManifest { .. })
    ));
    let mut m = img.m.clone();
    m.path = CheckpointPath::Transparent;
    plant(t.fd(), &m);
    assert!(matches!(
        read_manifest(t.fd(), NSPID),
        Err(ImageError::InvalidManifest { .. })
    ));
}

#[test]
fn transparent_manifest_round_trip() {
    let t = TempDir::new("image-test");
    let m = Manifest {
        format_version: FORMAT_VERSION,
        nspid: NsPid(7),
        path: CheckpointPath::Transparent,
        created_unix_s: 1,
        gpusnap_version: "0.1.0".into(),
        driver_version: 13000,
        gpus: vec![],
        allocations: vec![],
        files: vec![],
        chunks: vec![],
        timings_s: BTreeMap::new(),
        requires: None,
    };
    write_manifest(t.fd(), &m).unwrap();
    assert_eq!(read_manifest(t.fd(), NsPid(7)).unwrap(), m);
    assert_eq!(verify_image(t.fd(), &m, 8).unwrap().chunks, 0);
}

#[test]
fn manifest_header_line_is_strict() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    let path = t.file(manifest_file_name(NSPID));
    let good = std::fs::read(&path).unwrap();
    let nl = good.iter().position(|&b| b == b'\n').unwrap();
    let body = &good[nl + 1..];
    let line = std::str::from_utf8(&good[..nl]).unwrap().to_owned();
    let w: Vec<&str> = line.split(' ').collect();
    for bad in [
        format!("GPUSNAP-MANIFEST  1 {} {}", w[2], w[3]),
        format!("GPUSNAP-MANIFEST 01 {} {}", w[2], w[3]),
        format!("GPUSNAP-MANIFEST 1 +{} {}", w[2], w[3]),
        format!("GPUSNAP-MANIFEST 1 {} {}", w[2], w[3].to_uppercase()),
        format!("GPUSNAP-MANIFEST 1 {} {} x", w[2], w[3]),
        format!("GPUSNAP-MANIFEST 1 {}", w[2]),
        format!("gpusnap-manifest 1 {} {}", w[2], w[3]),
        format!("GPUSNAP-MANIFEST 1 {} {}\r", w[2], w[3]),
    ] {
        let mut bytes = bad.clone().into_bytes();
        bytes.push(b'\n');
        bytes.extend_from_slice(body);
        std::fs::write(&path, &bytes).unwrap();
        let e = read_manifest(t.fd(), NSPID);
        assert!(e.is_err(), "accepted {bad:?}");
    }
    // A body length far beyond the limit.
    std::fs::write(
        &path,
        format!("GPUSNAP-MANIFEST 1 99999999999999 {}\n{{}}", w[3]),
    )
    .unwrap();
    assert!(matches!(
        read_manifest(t.fd(), NSPID),
        Err(ImageError::ManifestTooLarge { .. })
    ));
    // Valid checksum over a body that is not a manifest.
    let junk = b"{\"format_version\":1}";
    let mut bytes = format!(
        "GPUSNAP-MANIFEST 1 {} {:016x}\n",
        junk.len(),
        xxhash_rust::xxh3::xxh3_64(junk)
    )
    .into_bytes();
    bytes.extend_from_slice(junk);
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(
        read_manifest(t.fd(), NSPID),
        Err(ImageError::ManifestJson { .. })
    ));
    drop(img);
}

#[test]
fn read_chunk_checks_its_arguments() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    let r = DataFileReader::open(t.fd(), &img.m, 0).unwrap();
    let c = &img.m.chunks[0];
    let e = r
        .read_chunk(c, &mut vec![0; CHUNK - 1], &mut Vec::new())
        .unwrap_err();
    assert!(matches!(e, ImageError::BufferSize { .. }), "{e}");
    // An entry of the other file, and a forged one.
    let e = r
        .read_chunk(&img.m.chunks[3], &mut vec![0; CHUNK], &mut Vec::new())
        .unwrap_err();
    assert!(matches!(e, ImageError::UnknownChunk { .. }), "{e}");
    let mut forged = c.clone();
    forged.checksum ^= 1;
    assert!(matches!(
        r.read_chunk(&forged, &mut vec![0; CHUNK], &mut Vec::new()),
        Err(ImageError::UnknownChunk { .. })
    ));
    assert!(matches!(
        DataFileReader::open(t.fd(), &img.m, 2),
        Err(ImageError::InvalidManifest { .. })
    ));
    // An entry of file 0 handed to the reader of file 1.
    let r1 = DataFileReader::open(t.fd(), &img.m, 1).unwrap();
    assert!(matches!(
        r1.read_chunk(c, &mut vec![0; CHUNK], &mut Vec::new()),
        Err(ImageError::UnknownChunk { .. })
    ));
}

#[test]
fn writer_refuses_bad_chunks() {
    let t = TempDir::new("image-test");
    let mut w = DataFileWriter::create(t.fd(), NsPid(1), 0).unwrap();
    assert!(matches!(
        w.append_chunk(0, &[], Codec::Raw),
        Err(ImageError::BadChunk { .. })
    ));
    assert!(matches!(
        w.append_chunk(u64::MAX, &[1, 2], Codec::Raw),
        Err(ImageError::BadChunk { .. })
    ));
    assert_eq!(w.bytes_written(), DATA_HEADER_LEN);
    let f = w.finish().unwrap();
    assert_eq!(f.size, DATA_HEADER_LEN);
}

#[test]
fn scan_walks_records_without_a_manifest() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    for file in 0..2u32 {
        let s = scan_data_file(t.fd(), NSPID, file).unwrap();
        assert!(s.stopped.is_none());
        assert_eq!(s.end, s.size);
        let want: Vec<_> = img
            .m
            .chunks
            .iter()
            .filter(|c| c.file == file)
            // Data files do not record the content hash (only the manifest does).
            .map(|c| ChunkEntry {
                content_xxh128: None,
                ..c.clone()
            })
            .collect();
        assert_eq!(s.chunks, want);
    }
    // Damage in the second record stops the walk there.
    let c = &img.m.chunks[1];
    flip(
        &t.file(data_file_name(NSPID, 0)),
        c.file_offset - RECORD_LEN + 20,
    );
    let s = scan_data_file(t.fd(), NSPID, 0).unwrap();
    assert_eq!(s.chunks.len(), 1);
    assert!(matches!(
        s.stopped,
        Some(ImageError::ChunkRecord { chunk: 1, .. })
    ));
}

#[test]
fn names_and_listing() {
    assert_eq!(data_file_name(NsPid(12), 3), "gpusnap-12-data-3.img");
    assert_eq!(manifest_file_name(NsPid(12)), "gpusnap-12-manifest.img");
    assert_eq!(
        parse_file_name("gpusnap-12-data-3.img"),
        Some(ImageFileKind::Data {
            nspid: NsPid(12),
            index: 3
        })
    );
    for bad in [
        "gpusnap-012-manifest.img",
        "gpusnap--1-manifest.img",
        "gpusnap-+1-manifest.img",
        "gpusnap-1-data-.img",
        "gpusnap-1-data-1.img.bak",
        "gpusnap-4294967296-manifest.img",
        "xgpusnap-1-manifest.img",
    ] {
        assert_eq!(parse_file_name(bad), None, "{bad}");
    }
    let t = TempDir::new("image-test");
    make_image(t.fd());
    for n in [
        "gpusnap-3-manifest.img",
        "gpusnap-03-manifest.img",
        "core-1.img",
        "gpusnap-4-manifest.img.tmp",
    ] {
        std::fs::write(t.file(n), b"x").unwrap();
    }
    std::fs::create_dir(t.file("gpusnap-5-manifest.img")).unwrap();
    assert_eq!(
        list_manifests(t.fd()).unwrap(),
        vec![NsPid(3), NsPid(5), NSPID]
    );
    // The directory under a manifest name is refused, not followed.
    assert!(matches!(
        read_manifest(t.fd(), NsPid(5)),
        Err(ImageError::NotRegularFile { .. })
    ));
    assert_eq!(remove_process_files(t.fd(), NSPID).unwrap(), 3);
    assert_eq!(list_manifests(t.fd()).unwrap(), vec![NsPid(3), NsPid(5)]);
    assert!(t.file("core-1.img").exists());
}

#[test]
fn a_pending_marker_refuses_the_directory_even_next_to_its_manifest() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    std::fs::write(t.file(pending_marker_name(NSPID)), b"pending").unwrap();
    assert_eq!(
        unfinished_dumps(t.fd()).unwrap(),
        vec![(NSPID, pending_marker_name(NSPID))]
    );
    let e = read_manifests(t.fd()).unwrap_err();
    assert!(
        matches!(&e, ImageError::PendingDump { nspid, .. } if *nspid == NSPID),
        "{e:?}"
    );
    assert!(e.to_string().contains("PENDING.txt"), "{e}");
    assert!(!e.is_damage());
    std::fs::remove_file(t.file(pending_marker_name(NSPID))).unwrap();
    assert_eq!(read_manifests(t.fd()).unwrap()[&NSPID], img.m);
    assert_eq!(
        parse_file_name("gpusnap-7-PENDING.txt"),
        Some(ImageFileKind::Pending { nspid: NsPid(7) })
    );
    assert_eq!(
        pending_owner(&pending_text(HostPid(42), 123456, "written by a test")),
        Some((HostPid(42), 123456))
    );
    assert_eq!(pending_owner("owner: x 1\n"), None);
}

#[test]
fn processes_with_files_but_no_manifest_are_unfinished_and_refuse_the_directory() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    assert_eq!(unfinished_dumps(t.fd()).unwrap(), vec![]);
    assert_eq!(read_manifests(t.fd()).unwrap()[&NSPID], img.m);
    // A rewrite of a complete manifest that did not finish: the manifest stands.
    std::fs::write(t.file(manifest_tmp_name(NSPID)), b"GPUSNAP").unwrap();
    assert_eq!(unfinished_dumps(t.fd()).unwrap(), vec![]);
    assert_eq!(read_manifests(t.fd()).unwrap().len(), 1);
    // Data files without a manifest, and a manifest still under its temporary name.
    for name in [
        data_file_name(NsPid(14), 2),
        data_file_name(NsPid(14), 0),
        manifest_tmp_name(NsPid(15)),
    ] {
        std::fs::write(t.file(&name), b"x").unwrap();
    }
    std::fs::write(t.file("gpusnap-16-data-01.img"), b"not a gpusnap name").unwrap();
    assert_eq!(
        unfinished_dumps(t.fd()).unwrap(),
        vec![
            (NsPid(14), data_file_name(NsPid(14), 0)),
            (NsPid(15), manifest_tmp_name(NsPid(15)))
        ]
    );
    let e = read_manifests(t.fd()).unwrap_err();
    assert!(
        matches!(
            &e,
            ImageError::UnfinishedDump {
                nspid: NsPid(14),
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "gpusnap-14-data-0.img: process 14 has no gpusnap-14-manifest.img: its dump did not \
         finish (image incomplete; do not restore from it)"
    );
    assert!(e.is_damage());
}

#[test]
fn sync_dir_syncs_any_descriptor_of_the_directory_and_reports_failures() {
    let t = TempDir::new("image-test");
    sync_dir(t.fd()).unwrap();
    // An O_PATH descriptor cannot be synced itself; sync_dir syncs one of its own.
    let o_path = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(t.path())
        .unwrap();
    assert!(o_path.sync_all().is_err());
    sync_dir(o_path.as_fd()).unwrap();
    // procfs implements no fsync (EINVAL): a real failure, returned naming the directory.
    let proc = File::open("/proc").unwrap();
    let e = sync_dir(proc.as_fd()).unwrap_err();
    assert!(
        matches!(
            e,
            ImageError::Io {
                op: IoOp::Fsync,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().starts_with("image directory: fsync failed: "),
        "{e}"
    );
}

#[test]
fn symlinks_are_not_followed() {
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    let name = data_file_name(NSPID, 0);
    let moved = t.file("elsewhere");
    std::fs::rename(t.file(&name), &moved).unwrap();
    std::os::unix::fs::symlink(&moved, t.file(&name)).unwrap();
    assert!(matches!(
        read_manifest(t.fd(), NSPID),
        Err(ImageError::NotRegularFile { .. })
    ));
    // A writer replaces the link instead of writing through it.
    let w = DataFileWriter::create(t.fd(), NSPID, 0).unwrap();
    drop(w);
    assert_eq!(
        std::fs::read(&moved).unwrap().len() as u64,
        img.m.files[0].size
    );
}

#[test]
fn stats_round_trip() {
    let t = TempDir::new("image-test");
    assert_eq!(read_stats(t.fd()).unwrap(), None);
    let v = serde_json::json!({"dump_s": 1.25, "processes": [12]});
    write_stats(t.fd(), &v).unwrap();
    assert_eq!(read_stats(t.fd()).unwrap(), Some(v));
    let meta = std::fs::metadata(t.file(STATS_FILE_NAME)).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o600);
    std::fs::write(t.file(STATS_FILE_NAME), b"{").unwrap();
    assert!(matches!(
        read_stats(t.fd()),
        Err(ImageError::StatsJson { .. })
    ));
}

#[test]
fn large_chunks_round_trip() {
    // A few MiB, to exercise short-read/short-write loops and buffer reuse on real sizes.
    let t = TempDir::new("image-test");
    let mut w = DataFileWriter::create(t.fd(), NsPid(1), 0).unwrap();
    let big = pattern(3 << 20, 1);
    let small = noise(1 << 20, 2);
    let chunks = vec![
        w.append_chunk(0x1000_0000, &big, Codec::Zstd).unwrap(),
        w.append_chunk(0x1000_0000 + (3 << 20), &small, Codec::Zstd)
            .unwrap(),
    ];
    let file = w.finish().unwrap();
    let m = Manifest {
        format_version: FORMAT_VERSION,
        nspid: NsPid(1),
        path: CheckpointPath::Split,
        created_unix_s: 0,
        gpusnap_version: "t".into(),
        driver_version: 0,
        gpus: vec![GpuRecord {
            ordinal: 0,
            uuid: "ABCDEF0123456789abcdef0123456789".into(),
            name: "x".into(),
            total_mem: 0,
        }],
        allocations: vec![AllocationRecord {
            id: 0,
            device: 0,
            addr: 0x1000_0000,
            size: 4 << 20,
            moved: true,
            lent: false,
            rdma_capable: false,
        }],
        files: vec![file],
        chunks,
        timings_s: BTreeMap::new(),
        requires: None,
    };
    write_manifest(t.fd(), &m).unwrap();
    let m = read_manifest(t.fd(), NsPid(1)).unwrap();
    assert_eq!(m.chunks[0].codec, Codec::Zstd);
    assert_eq!(m.chunks[1].codec, Codec::Raw);
    assert_eq!(read_all(t.fd(), &m).unwrap(), vec![big, small]);
}

#[test]
fn zstd_frame_of_the_wrong_size_is_refused() {
    use crate::header::{Record, encode_data_header, encode_record};
    // Hand-made files whose checksums are all right but whose frame holds `n` bytes while the
    // record and manifest claim `len`.
    let t = TempDir::new("image-test");
    let frame = zstd::bulk::compress(&[7u8; 1000], 1).unwrap();
    let base = make_image(t.fd()).m;
    remove_process_files(t.fd(), NSPID).unwrap();
    for (i, len) in [2000u64, 500].into_iter().enumerate() {
        let index = i as u32;
        let rec = Record {
            seq: 0,
            codec: Codec::Zstd,
            addr: BASE,
            len,
            stored_len: frame.len() as u64,
            checksum: xxhash_rust::xxh3::xxh3_64(&frame),
        };
        let mut bytes = encode_data_header(NSPID, index).to_vec();
        bytes.extend_from_slice(&encode_record(&rec));
        bytes.extend_from_slice(&frame);
        std::fs::write(t.file(data_file_name(NSPID, index)), &bytes).unwrap();
        let mut m = base.clone();
        m.files = vec![FileEntry {
            name: data_file_name(NSPID, index),
            size: bytes.len() as u64,
        }];
        m.chunks = vec![ChunkEntry {
            file: index,
            file_offset: 128,
            addr: BASE,
            len,
            stored_len: frame.len() as u64,
            codec: Codec::Zstd,
            checksum: rec.checksum,
            content_xxh128: Some("0".repeat(32)),
            parent_depth: 0,
            device_hash: None,
        }];
        m.allocations.truncate(1);
        m.allocations[0].size = len;
        write_manifest(t.fd(), &m).unwrap();
        let e = verify_image(t.fd(), &m, 1).unwrap_err();
        assert!(
            matches!(e, ImageError::ChunkDecompress { chunk: 0, .. }),
            "{len}: {e}"
        );
    }
}

#[test]
fn a_record_whose_seq_is_not_its_position_in_the_file_is_refused() {
    use crate::header::{decode_record, encode_record};
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    // Chunk 1 is the second record of data file 0. Rewrite its header with seq 5 and a
    // recomputed header checksum, so only seq is wrong.
    let c = &img.m.chunks[1];
    assert_eq!(c.file, 0);
    let path = t.file(data_file_name(NSPID, 0));
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let at = c.file_offset - RECORD_LEN;
    let mut rh = [0u8; RECORD_LEN as usize];
    f.read_exact_at(&mut rh, at).unwrap();
    let mut rec = decode_record(&rh).unwrap();
    assert_eq!(rec.seq, 1);
    rec.seq = 5;
    f.write_all_at(&encode_record(&rec), at).unwrap();
    drop(f);

    // Sizes and header checksums are intact: the manifest still reads.
    let m = read_manifest(t.fd(), NSPID).unwrap();
    let e = verify_image(t.fd(), &m, 1).unwrap_err();
    assert!(
        matches!(
            e,
            ImageError::ChunkSeq {
                chunk: 1,
                expected: 1,
                found: 5,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        format!(
            "{}: chunk 1 record header: seq is 5, but the record is number 1 in the file (image damaged; do not restore from it)",
            data_file_name(NSPID, 0)
        )
    );
    let r = DataFileReader::open(t.fd(), &m, 0).unwrap();
    let mut out = vec![0u8; c.len as usize];
    let e = r.read_chunk(c, &mut out, &mut Vec::new()).unwrap_err();
    assert!(matches!(e, ImageError::ChunkSeq { chunk: 1, .. }), "{e}");
    // The other chunks of the file still read; a walk without the manifest stops there too.
    let c0 = &m.chunks[0];
    let mut out = vec![0u8; c0.len as usize];
    r.read_chunk(c0, &mut out, &mut Vec::new()).unwrap();
    let s = scan_data_file(t.fd(), NSPID, 0).unwrap();
    assert_eq!(s.chunks.len(), 1);
    assert!(
        matches!(
            s.stopped,
            Some(ImageError::ChunkSeq {
                chunk: 1,
                found: 5,
                ..
            })
        ),
        "{:?}",
        s.stopped
    );
}

/// Version 3: zero chunks (nothing stored) and device hashes. A zero chunk validates with no
/// file, reads back as zeros and passes `verify` with the hash of zeros; every field it must not
/// have, a missing or wrong hash, and a version that has no zero chunks are refused; a stored
/// chunk's device hash is checked by `verify` against its bytes.
#[test]
fn zero_chunks_and_device_hashes() {
    use gpusnap_proto::devhash;
    let t = TempDir::new("image-test");
    let img = make_image(t.fd());
    let zbase = BASE + 0x30_0000;
    let zlen = CHUNK as u64;
    let zhash = devhash::zero_hash(zlen).unwrap();
    let mut m = img.m.clone();
    m.allocations.push(AllocationRecord {
        id: 4,
        device: 0,
        addr: zbase,
        size: 2 * zlen,
        moved: true,
        lent: false,
        rdma_capable: false,
    });
    m.chunks.push(ChunkEntry::zero(zbase, zlen, zhash));
    m.chunks.push(ChunkEntry::zero(zbase + zlen, zlen, zhash));
    // The stored chunks' device hashes, as the GPU would have computed them.
    for (c, d) in m.chunks.iter_mut().zip(&img.data) {
        c.device_hash = devhash::device_hash(d);
    }
    write_manifest(t.fd(), &m).unwrap();
    let back = read_manifest(t.fd(), NSPID).unwrap();
    assert_eq!(back, m);
    let data = read_all(t.fd(), &back).unwrap();
    assert!(data[5..].iter().all(|d| d.iter().all(|&b| b == 0)));
    let r = verify_image(t.fd(), &back, 2).unwrap();
    assert_eq!((r.zero_chunks, r.zero_bytes), (2, 2 * zlen));

    // verify checks device hashes: a wrong one on a stored chunk (raw, then zstd) or on a zero
    // chunk is named.
    for i in [0usize, 3, 5] {
        let mut bad = m.clone();
        bad.chunks[i].device_hash = bad.chunks[i].device_hash.map(|h| h ^ 1);
        plant(t.fd(), &bad);
        let bad = read_manifest(t.fd(), NSPID).unwrap();
        let e = verify_image(t.fd(), &bad, 2).unwrap_err();
        assert!(
            matches!(e, ImageError::ChunkDeviceHash { .. }),
            "chunk {i}: {e}"
        );
    }

    // What a zero chunk must not have, and what it must.
    let refused = |edit: &dyn Fn(&mut ChunkEntry), what: &str| {
        let mut bad = m.clone();
        edit(&mut bad.chunks[5]);
        let e = validate_manifest_structure(&bad).unwrap_err();
        assert!(!e.to_string().is_empty(), "{what}");
    };
    refused(&|c| c.stored_len = 1, "stored bytes");
    refused(&|c| c.file = 1, "a file");
    refused(&|c| c.file_offset = 128, "an offset");
    refused(&|c| c.checksum = 7, "a checksum");
    refused(
        &|c| c.content_xxh128 = Some("0".repeat(32)),
        "a content hash",
    );
    refused(&|c| c.parent_depth = 1, "a parent");
    refused(&|c| c.device_hash = None, "no device hash");
    let mut v2 = m.clone();
    v2.format_version = 2;
    for c in &mut v2.chunks {
        c.device_hash = None;
    }
    v2.chunks[5].device_hash = Some(zhash);
    assert!(
        validate_manifest_structure(&v2).is_err(),
        "zero chunk in v2"
    );
    v2.chunks.truncate(5);
    v2.chunks[0].device_hash = Some(1);
    v2.allocations.pop();
    assert!(
        validate_manifest_structure(&v2).is_err(),
        "device hash in v2"
    );
}

/// Version 4: `raw_sum64` chunks, written with no host hash (their checksum is the device hash
/// the GPU computed). They read back, and a damaged byte is found by the host (read and
/// `verify`, through gpusnap-sum64); a read for the GPU's check skips the host pass. A version
/// that has no such codec, a checksum other than the device hash, a content hash or no device
/// hash are refused.
#[test]
fn raw_sum64_chunks_are_checked_by_their_device_hash() {
    let t = TempDir::new("image-test");
    let data: Vec<Vec<u8>> = (0..2).map(|i| noise(CHUNK, 40 + i)).collect();
    let mut w = DataFileWriter::create(t.fd(), NSPID, 0).unwrap();
    let chunks: Vec<ChunkEntry> = data
        .iter()
        .enumerate()
        .map(|(i, d)| append_sum64(&mut w, BASE + (i * CHUNK) as u64, d))
        .collect();
    assert!(chunks.iter().all(|c| c.codec == Codec::RawSum64
        && c.device_hash == Some(c.checksum)
        && c.content_xxh128.is_none()));
    // An odd length has no device hash: refused.
    assert!(w.append_raw_sum64(BASE + 0x10_0000, &[1; 12], 0).is_err());
    let m = Manifest {
        allocations: vec![AllocationRecord {
            id: 1,
            device: 0,
            addr: BASE,
            size: 2 * CHUNK as u64,
            moved: true,
            lent: false,
            rdma_capable: false,
        }],
        files: vec![w.finish().unwrap()],
        chunks,
        ..make_image(TempDir::new("image-test").fd()).m
    };
    write_manifest(t.fd(), &m).unwrap();
    let back = read_manifest(t.fd(), NSPID).unwrap();
    assert_eq!(back, m);
    assert_eq!(read_all(t.fd(), &back).unwrap(), data);
    verify_image(t.fd(), &back, 1).unwrap();

    // One flipped payload byte.
    flip(
        &t.file(data_file_name(NSPID, 0)),
        DATA_HEADER_LEN + RECORD_LEN + 100,
    );
    let e = read_all(t.fd(), &back).unwrap_err();
    assert!(
        matches!(e, ImageError::ChunkChecksum { chunk: 0, .. }),
        "{e}"
    );
    let e = verify_image(t.fd(), &back, 1).unwrap_err();
    assert!(
        matches!(e, ImageError::ChunkChecksum { chunk: 0, .. }),
        "{e}"
    );
    let r = DataFileReader::open(t.fd(), &back, 0).unwrap();
    let mut out = vec![0u8; CHUNK];
    r.read_chunk_for_device_check(&back.chunks[0], &mut out, &mut Vec::new())
        .unwrap();
    assert_ne!(out, data[0], "read as stored, for the GPU to find");

    let refused = |edit: &dyn Fn(&mut Manifest), what: &str| {
        let mut bad = m.clone();
        edit(&mut bad);
        assert!(validate_manifest_structure(&bad).is_err(), "{what}");
    };
    refused(&|m| m.format_version = 3, "raw_sum64 in version 3");
    refused(
        &|m| m.chunks[0].checksum ^= 1,
        "checksum not the device hash",
    );
    refused(&|m| m.chunks[1].device_hash = None, "no device hash");
    refused(
        &|m| m.chunks[1].content_xxh128 = Some("0".repeat(32)),
        "a content hash",
    );
}

#[test]
fn lent_is_written_only_when_true_and_read_back() {
    let mut a = AllocationRecord {
        id: 1,
        device: 0,
        addr: 0x1000,
        size: 4096,
        moved: true,
        lent: false,
        rdma_capable: false,
    };
    let plain = serde_json::to_string(&a).unwrap();
    assert!(!plain.contains("lent"), "{plain}");
    assert_eq!(serde_json::from_str::<AllocationRecord>(&plain).unwrap(), a);
    a.lent = true;
    let lent = serde_json::to_string(&a).unwrap();
    assert!(lent.contains("\"lent\":true"), "{lent}");
    assert!(!lent.contains("rdma"), "{lent}");
    assert_eq!(serde_json::from_str::<AllocationRecord>(&lent).unwrap(), a);
    // Version 6: RDMA-capable memory, written only when true; an older record reads as not.
    a.rdma_capable = true;
    let rdma = serde_json::to_string(&a).unwrap();
    assert!(rdma.contains("\"rdma_capable\":true"), "{rdma}");
    assert_eq!(serde_json::from_str::<AllocationRecord>(&rdma).unwrap(), a);
    let old: AllocationRecord = serde_json::from_str(&lent).unwrap();
    assert!(!old.rdma_capable);
}

#[test]
fn version_7_records_what_a_restore_needs_and_older_manifests_read_without_it() {
    use crate::{LibraryDigest, Requirements};
    let t = TempDir::new("image-test");
    let mut img = make_image(t.fd());
    // Without requirements (as every manifest before version 7): the field is not written.
    let plain = serde_json::to_string(&img.m).unwrap();
    assert!(!plain.contains("requires"), "{plain}");
    let mut old: serde_json::Value = serde_json::from_str(&plain).unwrap();
    old["format_version"] = 6.into();
    let old: Manifest = serde_json::from_value(old).unwrap();
    assert_eq!(old.requires, None);

    let req = Requirements {
        kernel_driver: Some("580.95.05".into()),
        driver_library: Some(LibraryDigest {
            path: "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05".into(),
            size: 1234,
            xxh3_128: "0123456789abcdef0123456789abcdef".into(),
            in_job_root: false,
        }),
        gpu_mem_used: BTreeMap::from([(0, 5 << 20)]),
    };
    img.m.requires = Some(req.clone());
    write_manifest(t.fd(), &img.m).unwrap();
    assert_eq!(
        read_manifest(t.fd(), NSPID).unwrap().requires,
        Some(req.clone())
    );
    assert_eq!(
        req.driver_stack_identity(13000),
        "nvidia=580.95.05;cuda=13000;lib=libcuda.so.580.95.05@0123456789abcdef0123456789abcdef"
    );

    // Each field's rules, refused naming the manifest, both when written and when read.
    let bad = |edit: &dyn Fn(&mut Requirements)| {
        let mut m = img.m.clone();
        let mut r = req.clone();
        edit(&mut r);
        m.requires = Some(r);
        assert!(write_manifest(t.fd(), &m).is_err());
        plant(t.fd(), &m);
        let e = read_manifest(t.fd(), NSPID).unwrap_err();
        assert!(matches!(e, ImageError::InvalidManifest { .. }), "{e}");
    };
    bad(&|r| r.kernel_driver = Some(String::new()));
    bad(&|r| r.kernel_driver = Some("580\n".into()));
    bad(&|r| r.kernel_driver = Some("9".repeat(crate::MAX_REQUIREMENT_TEXT + 1)));
    bad(&|r| r.driver_library.as_mut().unwrap().path = "libcuda.so.1".into());
    bad(&|r| r.driver_library.as_mut().unwrap().xxh3_128 = "ABC".into());
    bad(&|r| {
        r.gpu_mem_used.insert(3, 1);
    });
}
