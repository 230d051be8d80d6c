//! An image cut short at any point of its writing is refused, never used in part.
//!
//! What a crash can leave of a dump, in the order the plugin writes: data files with any prefix
//! of their bytes (or, on a disk that lost pages, any range zeroed; the file's size may have
//! reached the disk before its data), then a manifest under its temporary name, partly or wholly
//! written, then the manifest under its own name. Every such state is built here from a real
//! image, and what a restore reads first ([`read_manifests`], then [`verify_image`] and the chunk
//! reads) and what `gpusnap verify` runs must refuse it with an error that names the file at
//! fault, or, where the bytes on disk are the complete image's, return exactly its data.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::tests::{TempDir, append_sum64, noise};
use crate::*;
use gpusnap_proto::pid::NsPid;

const SPLIT: NsPid = NsPid(12);
/// A second process with one small data file: one process cut short refuses the directory.
const OTHER: NsPid = NsPid(13);
const BASE: u64 = 0x7f00_0000_0000;

/// One chunk to write: the allocation it belongs to, its bytes, how it is written.
struct Planned {
    nspid: NsPid,
    file: u32,
    addr: u64,
    data: Vec<u8>,
    how: How,
}

#[derive(Clone, Copy)]
enum How {
    /// `append_raw` (a full dump's raw chunk: payload first, record header last).
    RawFused,
    /// `append_chunk` with `Codec::Raw`.
    Raw,
    /// `append_chunk` with `Codec::Zstd` (stored raw where it does not shrink).
    Zstd,
    /// `append_raw_sum64` (a full dump's raw chunk checked by its device hash, format 4:
    /// payload first, record header last).
    RawSum64,
}

/// Bytes zstd shrinks a lot.
fn compressible(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i / 97) as u8 ^ seed).collect()
}

/// The chunks of the image: process 12 in four files (raw both ways, zstd that shrinks and
/// zstd that falls back to raw, raw_sum64), process 13 in one; each file's chunks make one
/// allocation.
fn plan() -> Vec<Planned> {
    let chunk = |nspid, file, addr, data, how| Planned {
        nspid,
        file,
        addr,
        data,
        how,
    };
    let a0 = BASE;
    let a1 = BASE + 0x10_0000;
    let a2 = BASE + 0x20_0000;
    let a3 = BASE + 0x30_0000;
    let a4 = BASE + 0x40_0000;
    vec![
        chunk(SPLIT, 0, a0, noise(3000, 1), How::Raw),
        chunk(SPLIT, 0, a0 + 3000, noise(4096, 2), How::RawFused),
        chunk(SPLIT, 0, a0 + 7096, noise(1500, 3), How::Raw),
        chunk(SPLIT, 1, a1, compressible(5000, 4), How::Zstd),
        chunk(SPLIT, 1, a1 + 5000, noise(2000, 5), How::Zstd),
        chunk(SPLIT, 2, a2, noise(2500, 6), How::RawFused),
        chunk(SPLIT, 2, a2 + 2500, compressible(3500, 7), How::Zstd),
        chunk(OTHER, 0, a3, noise(1800, 8), How::RawFused),
        chunk(SPLIT, 3, a4, noise(4096, 9), How::RawSum64),
        chunk(SPLIT, 3, a4 + 4096, noise(2048, 10), How::RawSum64),
    ]
}

fn manifest(nspid: NsPid, files: Vec<FileEntry>, chunks: Vec<ChunkEntry>) -> Manifest {
    let mut allocations: Vec<AllocationRecord> = Vec::new();
    for c in &chunks {
        match allocations
            .iter_mut()
            .find(|a| a.addr + a.size == c.addr && a.id == u64::from(c.file))
        {
            Some(a) => a.size += c.len,
            None => allocations.push(AllocationRecord {
                id: u64::from(c.file),
                device: 0,
                addr: c.addr,
                size: c.len,
                moved: true,
                lent: false,
                rdma_capable: false,
            }),
        }
    }
    Manifest {
        format_version: FORMAT_VERSION,
        nspid,
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
        chunks,
        timings_s: BTreeMap::from([("data".to_string(), 0.5)]),
        requires: None,
    }
}

/// The device bytes of every chunk, per process, in manifest (address) order.
type Contents = BTreeMap<NsPid, Vec<Vec<u8>>>;

/// What a restore gets from the directory: every manifest read and checked, every chunk
/// verified (`verify_before_restore`), then every chunk's bytes through the readers the
/// restore's threads use.
fn restore_reads(dir: BorrowedFd<'_>) -> Result<Contents, ImageError> {
    let manifests = read_manifests(dir)?;
    let mut out = Contents::new();
    for (nspid, m) in &manifests {
        verify_image(dir, m, 1)?;
        out.insert(*nspid, read_chunks(dir, m)?);
    }
    Ok(out)
}

/// Whether `gpusnap verify` fails on `file`: it reports a process with files but no manifest,
/// and runs `read_manifest` and `verify_image` on every manifest (stopped here at the first
/// failure that names `file`, which is all the callers need to know).
fn verify_names(dir: BorrowedFd<'_>, file: &str) -> Result<(), String> {
    let unfinished = unfinished_dumps(dir).unwrap();
    if unfinished.iter().any(|(_, f)| f == file) {
        return Ok(());
    }
    // It reports every process; the one `file` belongs to is looked at first here.
    let owner = parse_file_name(file).and_then(ImageFileKind::nspid);
    let mut nspids = list_manifests(dir).unwrap();
    nspids.sort_by_key(|&n| Some(n) != owner);
    let mut seen = Vec::new();
    for nspid in nspids {
        match read_manifest(dir, nspid).and_then(|m| verify_image(dir, &m, 1)) {
            Err(e) if e.to_string().contains(file) => return Ok(()),
            other => seen.push(format!("{nspid}: {other:?}")),
        }
    }
    Err(format!("unfinished {unfinished:?}, manifests {seen:?}"))
}

/// Every chunk of `m` through [`DataFileReader::read_chunk`], as the restore loads them.
fn read_chunks(dir: BorrowedFd<'_>, m: &Manifest) -> Result<Vec<Vec<u8>>, ImageError> {
    let mut readers = BTreeMap::new();
    for i in m.file_indexes() {
        readers.insert(i, DataFileReader::open(dir, m, i)?);
    }
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

/// The state must be refused, by the restore's reads and by `gpusnap verify`'s, with an error
/// that names `file`.
fn assert_refused(dir: BorrowedFd<'_>, file: &str, state: &str) {
    match restore_reads(dir) {
        Ok(_) => panic!("{state}: the restore's reads accepted it"),
        Err(e) => assert!(
            e.to_string().contains(file),
            "{state}: refused, but the error does not name {file}: {e}"
        ),
    }
    if let Err(e) = verify_names(dir, file) {
        panic!("{state}: gpusnap verify would not fail on {file}: {e}");
    }
}

/// The state must give exactly `want`.
fn assert_whole(dir: BorrowedFd<'_>, want: &Contents, state: &str) {
    match restore_reads(dir) {
        Ok(got) => assert!(got == *want, "{state}: read back other bytes"),
        Err(e) => panic!("{state}: a complete image was refused: {e}"),
    }
    assert_eq!(unfinished_dumps(dir).unwrap(), vec![], "{state}");
}

/// A reader given the complete image's manifest (as if it trusted one it had kept) never gets
/// wrong bytes from `name` in its current state: the file is refused, or each chunk comes back
/// exactly as written or is refused, naming the file.
fn assert_no_wrong_bytes(dir: BorrowedFd<'_>, m: &Manifest, want: &[Vec<u8>], name: &str) {
    for index in m.file_indexes() {
        if m.file(index).is_none_or(|f| f.name != name) {
            continue;
        }
        let reader = match DataFileReader::open(dir, m, index) {
            Ok(r) => r,
            Err(e) => {
                assert!(e.to_string().contains(name), "{e}");
                continue;
            }
        };
        let mut scratch = Vec::new();
        for (i, c) in m.chunks.iter().enumerate().filter(|(_, c)| c.file == index) {
            let mut out = vec![0u8; c.len as usize];
            match reader.read_chunk(c, &mut out, &mut scratch) {
                Ok(()) => assert!(out == want[i], "{name}: chunk {i} read back wrong bytes"),
                Err(e) => assert!(e.to_string().contains(name), "{e}"),
            }
        }
    }
}

/// A complete image (both processes), written as the plugin writes one.
struct Written {
    dir: TempDir,
    manifests: BTreeMap<NsPid, Manifest>,
    contents: Contents,
}

fn write_image() -> Written {
    let t = TempDir::new("image-test");
    let (manifests, contents) = write_steps(t.fd(), &mut |_, _| {});
    Written {
        dir: t,
        manifests,
        contents,
    }
}

/// A point of the write sequence, handed to the observer of [`write_steps`].
enum Step {
    /// A data file, or a chunk in it, was written; the manifest is not there yet.
    Data,
    /// The manifest of this process is written, and the next process's not yet.
    ManifestDone,
}

/// Writes the image step by step in the plugin's order (every writer of a process creates its
/// file, the writers append in turn as parallel threads would, each file is finished with
/// `fsync`, then the manifest, then the next process), calling `seen` after every step with
/// the process it was about.
fn write_steps(
    dir: BorrowedFd<'_>,
    seen: &mut dyn FnMut(Step, NsPid),
) -> (BTreeMap<NsPid, Manifest>, Contents) {
    let planned = plan();
    let mut manifests = BTreeMap::new();
    let mut contents = Contents::new();
    for nspid in [SPLIT, OTHER] {
        let mine: Vec<&Planned> = planned.iter().filter(|p| p.nspid == nspid).collect();
        let mut writers: BTreeMap<u32, DataFileWriter> = BTreeMap::new();
        for p in &mine {
            if let std::collections::btree_map::Entry::Vacant(slot) = writers.entry(p.file) {
                let mut w = DataFileWriter::create(dir, nspid, p.file).unwrap();
                w.set_sync(true);
                slot.insert(w);
                seen(Step::Data, nspid);
            }
        }
        let mut chunks = Vec::new();
        // Round robin over the files, as the writer threads interleave.
        let mut queues: Vec<Vec<&&Planned>> = writers
            .keys()
            .map(|f| mine.iter().filter(|p| p.file == *f).collect())
            .collect();
        while queues.iter().any(|q| !q.is_empty()) {
            for q in queues.iter_mut().filter(|q| !q.is_empty()) {
                let p = q.remove(0);
                let w = writers.get_mut(&p.file).unwrap();
                let entry = match p.how {
                    How::RawFused => w.append_raw(p.addr, &p.data).unwrap().0,
                    How::Raw => w.append_chunk(p.addr, &p.data, Codec::Raw).unwrap(),
                    How::Zstd => w.append_chunk(p.addr, &p.data, Codec::Zstd).unwrap(),
                    How::RawSum64 => append_sum64(w, p.addr, &p.data),
                };
                chunks.push((entry, p.data.clone()));
                seen(Step::Data, nspid);
            }
        }
        let mut files = Vec::new();
        for (_, w) in writers {
            files.push(w.finish().unwrap());
            seen(Step::Data, nspid);
        }
        chunks.sort_by_key(|(c, _)| c.addr);
        let (entries, data): (Vec<ChunkEntry>, Vec<Vec<u8>>) = chunks.into_iter().unzip();
        let m = manifest(nspid, files, entries);
        write_manifest(dir, &m).unwrap();
        sync_dir(dir).unwrap();
        manifests.insert(nspid, m);
        contents.insert(nspid, data);
        seen(Step::ManifestDone, nspid);
    }
    (manifests, contents)
}

/// The file's bytes.
fn bytes_of(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

fn set_len(path: &Path, len: u64) {
    OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

fn zero(path: &Path, range: std::ops::Range<u64>) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    let zeros = vec![0u8; (range.end - range.start) as usize];
    f.write_all_at(&zeros, range.start).unwrap();
}

/// Puts the file's complete bytes back (without truncating it to 0 first, which makes ext4
/// flush the file on close).
fn restore_file(path: &Path, bytes: &[u8]) {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap();
    f.write_all_at(bytes, 0).unwrap();
    f.set_len(bytes.len() as u64).unwrap();
}

/// Where a data file's records start (the offset of each 64-byte record header), and its end.
fn record_starts(m: &Manifest, index: u32) -> Vec<u64> {
    let mut v: Vec<u64> = m
        .chunks
        .iter()
        .filter(|c| c.file == index)
        .map(|c| c.file_offset - RECORD_LEN)
        .collect();
    v.sort_unstable();
    v
}

/// Offsets of a data file at which to cut it or from which to lose its bytes: its header's
/// fields, and at and around every record boundary, inside every record header and payload.
fn boundaries(starts: &[u64], end: u64) -> Vec<u64> {
    let mut v: Vec<u64> = vec![0, 1, 8, 12, 16, 20, 24, 56, 63];
    for (i, &r) in starts.iter().enumerate() {
        let next = starts.get(i + 1).copied().unwrap_or(end);
        let payload = next - r - RECORD_LEN;
        for d in [0, 1, 8, 40, 56, 63, 64, 65] {
            v.push(r + d);
        }
        v.extend([r + RECORD_LEN + payload / 2, next - 1]);
    }
    v.retain(|&l| l < end);
    v.sort_unstable();
    v.dedup();
    v
}

/// Prefix lengths to cut a data file at: [`boundaries`], every length through the header and
/// the first record header, and a spread of other lengths (deterministic).
fn cut_points(starts: &[u64], end: u64) -> Vec<u64> {
    let mut v = boundaries(starts, end);
    v.extend(0..=DATA_HEADER_LEN + RECORD_LEN);
    let mut x = end | 1;
    for _ in 0..16 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        v.push((x >> 33) % end);
    }
    v.retain(|&l| l < end);
    v.sort_unstable();
    v.dedup();
    v
}

/// Every point of the write sequence: until a process's manifest is in place under its own
/// name, its data files (and its manifest under the temporary name, whatever part of it is
/// written) are refused, naming one of its files; once it is, the image reads back whole, also
/// with a rewrite of the manifest left unfinished beside it (the plugin rewrites manifests with
/// their final timings when CRIU ends).
#[test]
fn every_step_of_the_write_sequence_is_refused_until_the_manifest_is_in_place() {
    let t = TempDir::new("image-test");
    let dir = t.fd();
    let mut done: Contents = Contents::new();
    let mut steps = 0;
    let (manifests, contents) = write_steps(dir, &mut |step, nspid| {
        steps += 1;
        let state = format!("step {steps} (process {nspid})");
        match step {
            Step::Data => {
                let file = &unfinished_dumps(dir).unwrap()[0].1;
                assert!(
                    file.starts_with(&format!("gpusnap-{nspid}-")),
                    "{state}: {file}"
                );
                assert_refused(dir, file, &state);
                match restore_reads(dir) {
                    Err(ImageError::UnfinishedDump { nspid: n, .. }) => assert_eq!(n, nspid),
                    other => panic!("{state}: {other:?}"),
                }
            }
            Step::ManifestDone => {
                // Only the processes done so far are read; each in full.
                let got = restore_reads(dir).unwrap();
                assert_eq!(got.keys().copied().max(), Some(nspid), "{state}");
                done = got;
            }
        }
    });
    assert_eq!(done, contents);
    assert!(steps > 12, "{steps} steps");

    // The manifest of a process whose data files are all written, stopped at every stage of
    // its atomic write: the temporary file partly or wholly written, not yet renamed.
    let m = &manifests[&SPLIT];
    let bytes = encode_manifest_unchecked(m);
    let name = manifest_file_name(SPLIT);
    let tmp = manifest_tmp_name(SPLIT);
    let kept = bytes_of(&t.file(&name));
    std::fs::remove_file(t.file(&name)).unwrap();
    let header_line = bytes.iter().position(|&b| b == b'\n').unwrap() + 1;
    for len in [
        0,
        1,
        header_line - 1,
        header_line,
        bytes.len() / 2,
        bytes.len() - 1,
        bytes.len(),
    ] {
        std::fs::write(t.file(&tmp), &bytes[..len]).unwrap();
        let state = format!("{tmp} holding {len} of {} bytes, no {name}", bytes.len());
        assert_refused(dir, &tmp, &state);
    }
    std::fs::remove_file(t.file(&tmp)).unwrap();
    assert_refused(dir, &data_file_name(SPLIT, 0), "data files, no manifest");
    std::fs::write(t.file(&name), &kept).unwrap();
    assert_whole(dir, &contents, "the manifest renamed into place");

    // The rewrite at CRIU's end, cut short: the complete manifest stands.
    let mut rewritten = m.clone();
    rewritten.timings_s.insert("release".into(), 0.25);
    let again = encode_manifest_unchecked(&rewritten);
    for len in [0, again.len() / 3, again.len()] {
        std::fs::write(t.file(&tmp), &again[..len]).unwrap();
        assert_whole(dir, &contents, &format!("a rewrite's {tmp} of {len} bytes"));
    }
}

/// Every data file cut at many lengths, and with ranges of it lost (zeroed: a page that did not
/// reach the disk, a record header that `append_raw` writes last, the tail after a size that
/// reached the disk before the data), each under a complete manifest: refused, naming the file,
/// unless the bytes are the complete file's again; a reader that trusts the complete manifest
/// never reads a wrong byte either.
#[test]
fn data_files_cut_short_or_with_lost_writes_are_refused() {
    let w = write_image();
    let dir = w.dir.fd();
    let mut states = 0;
    for (nspid, m) in &w.manifests {
        for index in m.file_indexes() {
            let name = m.file(index).unwrap().name.clone();
            let path = w.dir.file(&name);
            let full = bytes_of(&path);
            let end = full.len() as u64;
            let starts = record_starts(m, index);
            assert_eq!(starts[0], DATA_HEADER_LEN);
            // Cut short, longest first (truncating a file only shrinks it).
            for &len in cut_points(&starts, end).iter().rev() {
                set_len(&path, len);
                let state = format!("{name} cut to {len} of {end} bytes");
                assert_refused(dir, &name, &state);
                assert_no_wrong_bytes(dir, m, &w.contents[nspid], &name);
                states += 1;
            }
            restore_file(&path, &full);
            // The size reached the disk, the bytes after `len` did not.
            for len in boundaries(&starts, end) {
                set_len(&path, len);
                set_len(&path, end);
                let state = format!("{name} with bytes {len}..{end} lost");
                if full[len as usize..].iter().all(|&b| b == 0) {
                    assert_whole(dir, &w.contents, &state);
                } else {
                    assert_refused(dir, &name, &state);
                }
                assert_no_wrong_bytes(dir, m, &w.contents[nspid], &name);
                restore_file(&path, &full);
                states += 1;
            }
            // One range lost in the middle: the file header, each record header (what
            // `append_raw` writes last), and a page-sized piece of each payload.
            let mut holes: Vec<std::ops::Range<u64>> = Vec::new();
            holes.push(0..DATA_HEADER_LEN);
            for (i, &r) in starts.iter().enumerate() {
                let next = starts.get(i + 1).copied().unwrap_or(end);
                holes.push(r..r + RECORD_LEN);
                let a = r + RECORD_LEN + (next - r - RECORD_LEN) / 3;
                holes.push(a..(a + 512).min(next));
            }
            for hole in holes {
                zero(&path, hole.clone());
                let state = format!("{name} with bytes {hole:?} lost");
                let was_zero = full[hole.start as usize..hole.end as usize]
                    .iter()
                    .all(|&b| b == 0);
                if was_zero {
                    assert_whole(dir, &w.contents, &state);
                } else {
                    assert_refused(dir, &name, &state);
                }
                assert_no_wrong_bytes(dir, m, &w.contents[nspid], &name);
                restore_file(&path, &full);
                states += 1;
            }
            assert_whole(dir, &w.contents, &format!("{name} put back"));
        }
    }
    assert!(states > 400, "{states} states");
}

/// A manifest cut at every length through its header line and at every 16th after it, or with
/// its tail lost from there, is refused naming it; so is a missing data file under a complete
/// manifest.
#[test]
fn manifest_cut_short_or_data_file_missing_is_refused() {
    let w = write_image();
    let dir = w.dir.fd();
    for nspid in [SPLIT, OTHER] {
        let name = manifest_file_name(nspid);
        let path = w.dir.file(&name);
        let full = bytes_of(&path);
        let end = full.len() as u64;
        let line = full.iter().position(|&b| b == b'\n').unwrap() as u64 + 1;
        let mut points: Vec<u64> = (0..=line).chain((line..end).step_by(16)).collect();
        points.extend([end - 2, end - 1]);
        points.sort_unstable();
        points.dedup();
        for &len in points.iter().rev() {
            set_len(&path, len);
            assert_refused(dir, &name, &format!("{name} cut to {len} of {end} bytes"));
        }
        restore_file(&path, &full);
        for &len in &points {
            set_len(&path, len);
            set_len(&path, end);
            assert_refused(dir, &name, &format!("{name} with bytes {len}..{end} lost"));
            restore_file(&path, &full);
        }
    }
    for m in w.manifests.values() {
        for f in &m.files {
            let path = w.dir.file(&f.name);
            let full = bytes_of(&path);
            std::fs::remove_file(&path).unwrap();
            assert_refused(dir, &f.name, &format!("{} missing", f.name));
            restore_file(&path, &full);
        }
    }
    assert_whole(dir, &w.contents, "everything put back");
}
