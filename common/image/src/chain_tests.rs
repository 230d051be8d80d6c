//! Incremental images: references to ancestors through `parent` links, and everything about a
//! chain that readers must refuse (missing or damaged parent, loops, depth, another process).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{OpenOptionsExt, symlink};
use std::path::PathBuf;

use crate::tests::{TempDir, append_sum64, flip, noise, plant};
use crate::*;
use gpusnap_proto::pid::NsPid;

const NSPID: NsPid = NsPid(12);
const CHUNK: usize = 4096;
const BASE: u64 = 0x7e00_0000_0000;

/// A directory holding image directories `1`, `2`, ... (as a user's `criu dump` runs would).
struct Images {
    root: TempDir,
}

impl Images {
    fn new() -> Images {
        Images {
            root: TempDir::new("image-test"),
        }
    }
    fn path(&self, k: u32) -> PathBuf {
        self.root.path().join(k.to_string())
    }
    /// Creates image directory `k`, with `parent -> ../<k-1>` as `--prev-images-dir` makes it.
    fn mkdir(&self, k: u32, parent: Option<u32>) -> File {
        std::fs::create_dir(self.path(k)).unwrap();
        if let Some(p) = parent {
            symlink(format!("../{p}"), self.path(k).join(PARENT_LINK)).unwrap();
        }
        self.open(k)
    }
    fn open(&self, k: u32) -> File {
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(self.path(k))
            .unwrap()
    }
}

fn allocations(chunks: usize) -> Vec<AllocationRecord> {
    vec![AllocationRecord {
        id: 1,
        device: 0,
        addr: BASE,
        size: (chunks * CHUNK) as u64,
        moved: true,
        lent: false,
        rdma_capable: false,
    }]
}

fn manifest(nspid: NsPid, chunks: Vec<ChunkEntry>, files: Vec<FileEntry>) -> Manifest {
    let n = chunks.len();
    Manifest {
        format_version: FORMAT_VERSION,
        nspid,
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
        allocations: allocations(n),
        files,
        chunks,
        timings_s: BTreeMap::new(),
        requires: None,
    }
}

/// Dumps one allocation of `data.len()` chunks into `dir` as the plugin's writers do: each
/// chunk hashed, referenced when the parent holds the same bytes at the same range, written
/// otherwise. Returns the manifest written and how many chunks were written.
fn dump(dir: BorrowedFd<'_>, nspid: NsPid, data: &[Vec<u8>]) -> (Manifest, usize) {
    let index = match parent_for_dedup(dir, nspid, &allocations(data.len())) {
        ParentImage::Usable(i) => Some(i),
        ParentImage::None | ParentImage::Unusable(_) => None,
    };
    let mut writer: Option<DataFileWriter> = None;
    let mut chunks = Vec::new();
    let mut written = 0;
    for (i, d) in data.iter().enumerate() {
        let addr = BASE + (i * CHUNK) as u64;
        let h = hash_chunk(d);
        if let Some(r) = index
            .as_ref()
            .and_then(|x| x.reference(addr, d.len() as u64, &h))
        {
            chunks.push(r);
            continue;
        }
        let w = writer.get_or_insert_with(|| DataFileWriter::create(dir, nspid, 0).unwrap());
        chunks.push(w.append_chunk_hashed(addr, d, Codec::Raw, &h).unwrap());
        written += 1;
    }
    let files = writer
        .map(|w| vec![w.finish().unwrap()])
        .unwrap_or_default();
    let m = manifest(nspid, chunks, files);
    write_manifest(dir, &m).unwrap();
    (m, written)
}

/// The device bytes of every chunk of `m`, in manifest order, read through its sources.
fn read_back(dir: BorrowedFd<'_>, m: &Manifest) -> Result<Vec<Vec<u8>>, ImageError> {
    let sources = ChunkSources::open(dir, m)?;
    let mut out = vec![Vec::new(); m.chunks.len()];
    let mut scratch = Vec::new();
    for (depth, file) in sources.groups() {
        let r = sources.reader(depth, file)?;
        for (i, c) in sources.chunks(depth, file) {
            let mut buf = vec![0u8; c.len as usize];
            r.read_chunk(c, &mut buf, &mut scratch)?;
            out[i] = buf;
        }
    }
    Ok(out)
}

fn data(seed: u64) -> Vec<Vec<u8>> {
    (0..4).map(|i| noise(CHUNK, seed * 100 + i)).collect()
}

#[test]
fn hash_chunk_gives_both_xxh3_widths_in_one_pass() {
    for len in [0, 1, 16, 240, 241, 1024, 65_536 + 3, (1 << 20) + 17] {
        let d = noise(len, len as u64);
        let h = hash_chunk(&d);
        assert_eq!(h.xxh3_64, xxhash_rust::xxh3::xxh3_64(&d), "{len}");
        assert_eq!(h.xxh3_128, xxhash_rust::xxh3::xxh3_128(&d), "{len}");
        assert_eq!(h.content_hex().len(), 32);
    }
}

#[test]
fn incremental_dump_references_unchanged_chunks_and_reads_back() {
    let imgs = Images::new();
    let d1 = imgs.mkdir(1, None);
    let v1 = data(1);
    let (m1, written) = dump(d1.as_fd(), NSPID, &v1);
    assert_eq!(written, 4);
    assert!(m1.chunks.iter().all(|c| !c.is_reference()));

    // Chunk 2 changes: only it is written.
    let d2 = imgs.mkdir(2, Some(1));
    let mut v2 = v1.clone();
    v2[2] = noise(CHUNK, 777);
    let (m2, written) = dump(d2.as_fd(), NSPID, &v2);
    assert_eq!(written, 1);
    let depths: Vec<u32> = m2.chunks.iter().map(|c| c.parent_depth).collect();
    assert_eq!(depths, [1, 1, 0, 1]);
    assert_eq!(m2.files.len(), 1);
    assert_eq!(read_manifest(d2.as_fd(), NSPID).unwrap(), m2);
    assert_eq!(read_back(d2.as_fd(), &m2).unwrap(), v2);
    let r = verify_image(d2.as_fd(), &m2, 2).unwrap();
    assert_eq!((r.referenced_chunks, r.chain_depth), (3, 1));
    assert_eq!(r.referenced_bytes, 3 * CHUNK as u64);

    // Nothing changes: nothing is written, and references are flattened to where the bytes
    // are (image 1 for chunks 0, 1, 3; image 2 for chunk 2).
    let d3 = imgs.mkdir(3, Some(2));
    let (m3, written) = dump(d3.as_fd(), NSPID, &v2);
    assert_eq!(written, 0);
    assert!(m3.files.is_empty());
    let depths: Vec<u32> = m3.chunks.iter().map(|c| c.parent_depth).collect();
    assert_eq!(depths, [2, 2, 1, 2]);
    assert_eq!(read_back(d3.as_fd(), &m3).unwrap(), v2);
    assert_eq!(verify_image(d3.as_fd(), &m3, 1).unwrap().chain_depth, 2);

    // Same bytes at another address are not a match: the range must be the same.
    let d4 = imgs.mkdir(4, Some(3));
    let rotated: Vec<Vec<u8>> = (0..4).map(|i| v2[(i + 1) % 4].clone()).collect();
    let (_, written) = dump(d4.as_fd(), NSPID, &rotated);
    assert_eq!(written, 4);
}

#[test]
fn chain_depth_is_bounded() {
    let imgs = Images::new();
    let v = data(2);
    let first = imgs.mkdir(1, None);
    dump(first.as_fd(), NSPID, &v);
    // Images 2..=9 reference image 1 at depths 1..=8; image 10 would need depth 9, so it
    // stores the data again, and image 11 references image 10.
    for k in 2..=11u32 {
        let d = imgs.mkdir(k, Some(k - 1));
        let (m, written) = dump(d.as_fd(), NSPID, &v);
        let want = match k {
            2..=9 => k - 1,
            10 => 0,
            _ => 1,
        };
        assert!(m.chunks.iter().all(|c| c.parent_depth == want), "image {k}");
        assert_eq!(written, if k == 10 { 4 } else { 0 }, "image {k}");
        assert_eq!(read_back(d.as_fd(), &m).unwrap(), v, "image {k}");
    }
    // A hand-made manifest deeper than the limit is refused as such.
    let d9 = imgs.open(9);
    let mut m = read_manifest(d9.as_fd(), NSPID).unwrap();
    m.chunks[0].parent_depth = MAX_CHAIN_DEPTH + 1;
    plant(d9.as_fd(), &m);
    let e = read_manifest(d9.as_fd(), NSPID).unwrap_err();
    assert!(
        e.to_string()
            .contains("parent_depth 9 exceeds the limit of 8"),
        "{e}"
    );
}

#[test]
fn loops_are_refused() {
    let imgs = Images::new();
    let v = data(3);
    let d1 = imgs.mkdir(1, None);
    dump(d1.as_fd(), NSPID, &v);
    let d2 = imgs.mkdir(2, Some(1));
    let (m2, _) = dump(d2.as_fd(), NSPID, &v);
    // 1's parent now leads back to 2, and 2's manifest claims data 2 links up.
    symlink("../2", imgs.path(1).join(PARENT_LINK)).unwrap();
    let mut m = m2.clone();
    for c in &mut m.chunks {
        c.parent_depth = 2;
    }
    plant(d2.as_fd(), &m);
    let e = read_manifest(d2.as_fd(), NSPID).unwrap_err();
    assert!(
        matches!(&e, ImageError::ParentLink { path, detail } if path.starts_with("parent/parent") && detail.contains("loop")),
        "{e}"
    );
    // A parent link to the directory itself: a dump does not use it.
    let d3 = imgs.mkdir(3, None);
    symlink(".", imgs.path(3).join(PARENT_LINK)).unwrap();
    match parent_for_dedup(d3.as_fd(), NSPID, &allocations(4)) {
        ParentImage::Unusable(why) => assert!(why.contains("loop"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn missing_parent_is_refused_naming_it() {
    let imgs = Images::new();
    let v = data(4);
    let d1 = imgs.mkdir(1, None);
    dump(d1.as_fd(), NSPID, &v);
    let d2 = imgs.mkdir(2, Some(1));
    let mut v2 = v.clone();
    v2[0] = noise(CHUNK, 5);
    let (m2, _) = dump(d2.as_fd(), NSPID, &v2);

    // The parent directory deleted: the link dangles.
    std::fs::rename(imgs.path(1), imgs.root.path().join("moved")).unwrap();
    let e = read_manifest(d2.as_fd(), NSPID).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, ImageError::ParentLink { .. })
            && msg.contains("parent (-> ../1)")
            && msg.contains("does not exist"),
        "{msg}"
    );
    assert!(verify_image(d2.as_fd(), &m2, 1).is_err());

    // The link itself removed.
    std::fs::remove_file(imgs.path(2).join(PARENT_LINK)).unwrap();
    let e = read_manifest(d2.as_fd(), NSPID).unwrap_err();
    assert!(
        e.to_string().starts_with("parent: missing")
            && e.to_string().contains("gpusnap-12-manifest.img"),
        "{e}"
    );

    // A regular file named parent.
    std::fs::write(imgs.path(2).join(PARENT_LINK), b"x").unwrap();
    let e = read_manifest(d2.as_fd(), NSPID).unwrap_err();
    assert!(e.to_string().contains("not a directory"), "{e}");

    // The parent back in place, but its data file gone.
    std::fs::remove_file(imgs.path(2).join(PARENT_LINK)).unwrap();
    std::fs::rename(imgs.root.path().join("moved"), imgs.path(1)).unwrap();
    symlink("../1", imgs.path(2).join(PARENT_LINK)).unwrap();
    read_manifest(d2.as_fd(), NSPID).unwrap();
    std::fs::remove_file(imgs.path(1).join(data_file_name(NSPID, 0))).unwrap();
    let e = read_manifest(d2.as_fd(), NSPID).unwrap_err();
    assert_eq!(
        e.to_string(),
        "parent/gpusnap-12-data-0.img: missing (image incomplete; do not restore from it)"
    );
}

#[test]
fn damaged_parent_chunk_is_refused_naming_the_parent_file() {
    let imgs = Images::new();
    let v = data(5);
    let d1 = imgs.mkdir(1, None);
    let (m1, _) = dump(d1.as_fd(), NSPID, &v);
    let d2 = imgs.mkdir(2, Some(1));
    let (m2, _) = dump(d2.as_fd(), NSPID, &v);
    // A payload byte of the parent's chunk 1: manifests still read (no payload is read), but
    // the checksum pass and a reader refuse it.
    let c = &m1.chunks[1];
    flip(
        &imgs.path(1).join(data_file_name(NSPID, c.file)),
        c.file_offset + 100,
    );
    let m = read_manifest(d2.as_fd(), NSPID).unwrap();
    let e = verify_image(d2.as_fd(), &m, 2).unwrap_err();
    assert!(e.is_damage());
    assert_eq!(
        e.to_string(),
        "parent/gpusnap-12-data-0.img: chunk 1 checksum mismatch (image damaged; do not restore from it)"
    );
    assert!(read_back(d2.as_fd(), &m2).is_err());
    // A damaged parent is not used for a new dump's references either.
    let d3 = imgs.mkdir(3, Some(1));
    let (m3, _) = dump(d3.as_fd(), NSPID, &v);
    assert!(
        m3.chunks.iter().all(|c| c.parent_depth == 1),
        "a payload is not read to decide"
    );
    flip(&imgs.path(1).join(manifest_file_name(NSPID)), 40);
    match parent_for_dedup(d3.as_fd(), NSPID, &allocations(4)) {
        ParentImage::Unusable(why) => {
            assert!(why.starts_with("parent/gpusnap-12-manifest.img"), "{why}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_reference_must_match_the_parents_record() {
    let imgs = Images::new();
    let v = data(6);
    let d1 = imgs.mkdir(1, None);
    dump(d1.as_fd(), NSPID, &v);
    let d2 = imgs.mkdir(2, Some(1));
    let (m2, _) = dump(d2.as_fd(), NSPID, &v);
    // The parent directory re-dumped with other data after image 2 was made.
    for f in std::fs::read_dir(imgs.path(1)).unwrap() {
        std::fs::remove_file(f.unwrap().path()).unwrap();
    }
    dump(d1.as_fd(), NSPID, &data(60));
    let e = read_manifest(d2.as_fd(), NSPID).unwrap_err();
    assert!(
        matches!(
            e,
            ImageError::BadReference {
                chunk: 0,
                depth: 1,
                ..
            }
        ) && e.is_damage(),
        "{e}"
    );
    // A reference to an offset where the parent stores nothing.
    dump(d1.as_fd(), NSPID, &v);
    read_manifest(d2.as_fd(), NSPID).unwrap();
    let mut m = m2.clone();
    m.chunks[3].file_offset += 1;
    plant(d2.as_fd(), &m);
    let e = read_manifest(d2.as_fd(), NSPID).unwrap_err();
    assert!(e.to_string().contains("stores no chunk at offset"), "{e}");
}

#[test]
fn another_process_or_other_allocations_make_a_full_dump() {
    let imgs = Images::new();
    let v = data(7);
    let d1 = imgs.mkdir(1, None);
    dump(d1.as_fd(), NsPid(NSPID.get() + 1), &v);
    let d2 = imgs.mkdir(2, Some(1));
    match parent_for_dedup(d2.as_fd(), NSPID, &allocations(4)) {
        ParentImage::Unusable(why) => {
            assert!(why.contains("gpusnap-12-manifest.img: missing"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    let (_, written) = dump(d2.as_fd(), NSPID, &v);
    assert_eq!(written, 4);
    // Same process, but its allocation grew: no references.
    let d3 = imgs.mkdir(3, Some(2));
    match parent_for_dedup(d3.as_fd(), NSPID, &allocations(5)) {
        ParentImage::Unusable(why) => assert!(why.contains("allocations differ"), "{why}"),
        other => panic!("{other:?}"),
    }
    // No parent link at all.
    assert!(matches!(
        parent_for_dedup(d1.as_fd(), NSPID, &allocations(4)),
        ParentImage::None
    ));
    // A manifest that references a parent holding only another process's image is refused.
    let (m3, _) = dump(d3.as_fd(), NSPID, &v);
    assert!(m3.chunks.iter().all(|c| c.parent_depth == 1));
    std::fs::remove_file(imgs.path(3).join(PARENT_LINK)).unwrap();
    symlink("../1", imgs.path(3).join(PARENT_LINK)).unwrap();
    let e = read_manifest(d3.as_fd(), NSPID).unwrap_err();
    assert_eq!(
        e.to_string(),
        "parent/gpusnap-12-manifest.img: missing (image incomplete; do not restore from it)"
    );
}

#[test]
fn version_1_manifests_are_still_read_and_not_referenced() {
    let imgs = Images::new();
    let d1 = imgs.mkdir(1, None);
    let v = data(8);
    let (m, _) = dump(d1.as_fd(), NSPID, &v);
    let mut old = m.clone();
    old.format_version = 1;
    for c in &mut old.chunks {
        c.content_xxh128 = None;
    }
    plant(d1.as_fd(), &old);
    assert_eq!(read_manifest(d1.as_fd(), NSPID).unwrap(), old);
    assert_eq!(read_back(d1.as_fd(), &old).unwrap(), v);
    let d2 = imgs.mkdir(2, Some(1));
    match parent_for_dedup(d2.as_fd(), NSPID, &allocations(4)) {
        ParentImage::Unusable(why) => assert!(why.contains("format version 1"), "{why}"),
        other => panic!("{other:?}"),
    }
    // Version-2 fields in a version-1 manifest, or a version-2 chunk without its hash.
    let mut bad = old.clone();
    bad.chunks[0].content_xxh128 = m.chunks[0].content_xxh128.clone();
    plant(d1.as_fd(), &bad);
    assert!(read_manifest(d1.as_fd(), NSPID).is_err());
    let mut bad = m.clone();
    bad.chunks[0].content_xxh128 = None;
    plant(d1.as_fd(), &bad);
    let e = read_manifest(d1.as_fd(), NSPID).unwrap_err();
    assert!(e.to_string().contains("content_xxh128 is missing"), "{e}");
}

#[test]
fn only_allocations_held_alike_are_referenced() {
    let imgs = Images::new();
    let v = data(9);
    let d1 = imgs.mkdir(1, None);
    let (mut m1, _) = dump(d1.as_fd(), NSPID, &v);
    // The parent held two allocations of two chunks each.
    let half = (2 * CHUNK) as u64;
    m1.allocations = vec![
        AllocationRecord {
            id: 1,
            device: 0,
            addr: BASE,
            size: half,
            moved: true,
            lent: false,
            rdma_capable: false,
        },
        AllocationRecord {
            id: 2,
            device: 0,
            addr: BASE + half,
            size: half,
            moved: true,
            lent: false,
            rdma_capable: false,
        },
    ];
    write_manifest(d1.as_fd(), &m1).unwrap();
    let d2 = imgs.mkdir(2, Some(1));
    // Now the first is as it was and the second grew: only the first one's chunks are offered.
    let mut now = m1.allocations.clone();
    now[1].size += CHUNK as u64;
    let index = match parent_for_dedup(d2.as_fd(), NSPID, &now) {
        ParentImage::Usable(i) => i,
        other => panic!("{other:?}"),
    };
    assert_eq!(index.len(), 2);
    let at = |i: usize| BASE + (i * CHUNK) as u64;
    assert!(
        index
            .reference(at(1), CHUNK as u64, &hash_chunk(&v[1]))
            .is_some()
    );
    assert!(
        index
            .reference(at(2), CHUNK as u64, &hash_chunk(&v[2]))
            .is_none()
    );
    // An allocation now left to the driver offers nothing either.
    now[1].size -= CHUNK as u64;
    now[0].moved = false;
    let d3 = imgs.mkdir(3, Some(1));
    match parent_for_dedup(d3.as_fd(), NSPID, &now) {
        ParentImage::Usable(i) => assert_eq!(i.len(), 2, "only the second allocation's chunks"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn raw_sum64_parent_chunks_are_offered_by_device_hash_only() {
    use gpusnap_proto::devhash;
    let imgs = Images::new();
    let v = data(11);
    let d1 = imgs.mkdir(1, None);
    let mut w = DataFileWriter::create(d1.as_fd(), NSPID, 0).unwrap();
    let chunks: Vec<ChunkEntry> = v
        .iter()
        .enumerate()
        .map(|(i, d)| append_sum64(&mut w, BASE + (i * CHUNK) as u64, d))
        .collect();
    let m1 = manifest(NSPID, chunks, vec![w.finish().unwrap()]);
    write_manifest(d1.as_fd(), &m1).unwrap();
    let d2 = imgs.mkdir(2, Some(1));
    let index = match parent_for_dedup(d2.as_fd(), NSPID, &allocations(v.len())) {
        ParentImage::Usable(i) => i,
        other => panic!("{other:?}"),
    };
    assert_eq!(index.len(), v.len());
    assert_eq!(index.device_hashes().len(), v.len());
    let (addr, len) = (BASE, CHUNK as u64);
    let h = devhash::device_hash(&v[0]).unwrap();
    let r = index
        .reference_by_device_hash(addr, len, h)
        .expect("offered");
    assert_eq!((r.codec, r.parent_depth), (Codec::RawSum64, 1));
    // No host hash to compare with: a dump need not hash such a chunk on the host.
    assert!(!index.wants_host_compare(addr, len));
    assert!(index.reference(addr, len, &hash_chunk(&v[0])).is_none());
}
