//! Checks a manifest before anyone trusts it: first its structure (no I/O), then its data files
//! (existence, exact size, header). Chunk payloads are checked later, by checksum, as they are read.

use gpusnap_proto::pid::NsPid;
use std::collections::{HashMap, HashSet};
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;

use crate::header::check_data_header;
use crate::{
    CheckpointPath, ChunkEntry, ChunkFieldError, ChunkLengthError, Codec, DATA_HEADER_LEN,
    ImageError, IoOp, MAX_CHAIN_DEPTH, MAX_CHUNK_LEN, Manifest, READ_MANIFEST_VERSIONS, RECORD_LEN,
    data_file_name, manifest_file_name, sys,
};

/// Longest string field (GPU name, gpusnap version, timing name) a manifest may carry.
const MAX_STRING: usize = 1024;

/// Checks everything about `m` that needs no file: names, bounds, overlaps, coverage and sums.
/// `verify_image` and the writers run this; `read_manifest` runs it and the file checks.
pub fn validate_manifest_structure(m: &Manifest) -> Result<(), ImageError> {
    validate_structure(m, &manifest_file_name(m.nspid))
}

pub(crate) fn validate_structure(m: &Manifest, mf: &str) -> Result<(), ImageError> {
    let invalid = |detail: String| ImageError::InvalidManifest {
        file: mf.to_owned(),
        detail,
    };
    if !READ_MANIFEST_VERSIONS.contains(&m.format_version) {
        return Err(ImageError::UnsupportedVersion {
            file: mf.to_owned(),
            found: m.format_version.into(),
        });
    }
    if m.gpusnap_version.len() > MAX_STRING {
        return Err(invalid("gpusnap_version is too long".into()));
    }
    for (name, v) in &m.timings_s {
        if name.len() > MAX_STRING || !v.is_finite() || *v < 0.0 {
            return Err(invalid(format!(
                "timing {name:?} = {v} is not a finite, non-negative number of seconds"
            )));
        }
    }

    // GPUs: unique ordinals, 32-hex-digit UUIDs.
    let mut ordinals = HashSet::new();
    for g in &m.gpus {
        if !ordinals.insert(g.ordinal) {
            return Err(invalid(format!(
                "GPU ordinal {} is listed twice",
                g.ordinal
            )));
        }
        if g.uuid.len() != 32 || !g.uuid.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(invalid(format!(
                "GPU {} uuid {:?} is not 32 hex digits",
                g.ordinal, g.uuid
            )));
        }
        if g.name.len() > MAX_STRING {
            return Err(invalid(format!("GPU {} name is too long", g.ordinal)));
        }
    }

    // Allocations: non-empty, no wrap, on a listed GPU, unique ids, no overlap.
    let mut ids = HashSet::new();
    for a in &m.allocations {
        if !ids.insert(a.id) {
            return Err(invalid(format!("allocation id {} is listed twice", a.id)));
        }
        if a.size == 0 || a.addr.checked_add(a.size).is_none() {
            return Err(invalid(format!(
                "allocation {} ({:#x}+{:#x}) is empty or wraps the address space",
                a.id, a.addr, a.size
            )));
        }
        if !ordinals.contains(&a.device) {
            return Err(invalid(format!(
                "allocation {} is on device {}, which is not among the manifest's GPUs",
                a.id, a.device
            )));
        }
    }
    let mut allocs: Vec<usize> = (0..m.allocations.len()).collect();
    allocs.sort_by_key(|&i| m.allocations[i].addr);
    for w in allocs.windows(2) {
        let (p, q) = (&m.allocations[w[0]], &m.allocations[w[1]]);
        if p.addr + p.size > q.addr {
            return Err(ImageError::AllocationOverlap {
                file: mf.to_owned(),
                a: p.id,
                b: q.id,
            });
        }
    }

    if m.path == CheckpointPath::Transparent
        && (!m.files.is_empty() || !m.chunks.is_empty() || m.allocations.iter().any(|a| a.moved))
    {
        return Err(invalid(
            "a transparent-path manifest lists data files, chunks or moved allocations".into(),
        ));
    }

    // Files: each exactly gpusnap-<nspid>-data-<index>.img, no index twice, in any order (a
    // writer thread that got no work leaves no file, so indexes may have gaps).
    let mut positions: HashMap<u32, usize> = HashMap::with_capacity(m.files.len());
    for (i, f) in m.files.iter().enumerate() {
        let index = file_index(m, i, mf)?;
        if positions.insert(index, i).is_some() {
            return Err(invalid(format!("{} is listed twice", f.name)));
        }
        if f.size < DATA_HEADER_LEN {
            return Err(invalid(format!(
                "{} has recorded size {}, less than its header",
                f.name, f.size
            )));
        }
    }

    // Chunks, one at a time: the version's fields, file index, lengths and codec, bounds in the
    // file, and that the device range lies inside one moved allocation (which it is then
    // counted towards). A reference (parent_depth > 0) names a data file of an ancestor image:
    // its file and bounds are checked against that ancestor (`chain::open_ancestors`).
    let mut covered = vec![0u64; m.allocations.len()];
    for (i, c) in m.chunks.iter().enumerate() {
        check_version_fields(m.format_version, c).map_err(|why| ImageError::ChunkFields {
            file: mf.to_owned(),
            chunk: i,
            why,
        })?;
        check_chunk_lengths(c.len, c.stored_len, c.codec).map_err(|detail| {
            ImageError::ChunkLength {
                file: mf.to_owned(),
                chunk: i,
                detail,
            }
        })?;
        let start = c.file_offset.saturating_sub(RECORD_LEN);
        let end = c.file_offset.checked_add(c.stored_len);
        if !c.is_stored() {
            // A zero chunk: nothing in any file (check_version_fields saw to its fields).
        } else if c.is_reference() {
            if c.file_offset < DATA_HEADER_LEN + RECORD_LEN || end.is_none() {
                return Err(invalid(format!(
                    "chunk {i} references offset {} of an ancestor's data file, outside any data area",
                    c.file_offset
                )));
            }
        } else {
            let Some(f) = positions.get(&c.file).map(|&p| &m.files[p]) else {
                return Err(ImageError::ChunkFileIndex {
                    file: mf.to_owned(),
                    chunk: i,
                    index: c.file,
                    count: m.files.len(),
                });
            };
            if c.file_offset < DATA_HEADER_LEN + RECORD_LEN || end.is_none_or(|e| e > f.size) {
                return Err(ImageError::ChunkOutsideFile {
                    file: mf.to_owned(),
                    chunk: i,
                    data_file: f.name.clone(),
                    start,
                    end: end.unwrap_or(u64::MAX),
                    size: f.size,
                });
            }
        }
        let outside = || ImageError::ChunkOutsideAllocation {
            file: mf.to_owned(),
            chunk: i,
            addr: c.addr,
            len: c.len,
        };
        let c_end = c.addr.checked_add(c.len).ok_or_else(outside)?;
        // The last allocation starting at or below the chunk is the only one that can hold it.
        let k = allocs.partition_point(|&j| m.allocations[j].addr <= c.addr);
        let a_idx = k.checked_sub(1).map(|k| allocs[k]).ok_or_else(outside)?;
        let a = &m.allocations[a_idx];
        if !a.moved || c_end > a.addr + a.size {
            return Err(outside());
        }
        covered[a_idx] = covered[a_idx].saturating_add(c.len);
        if covered[a_idx] > a.size {
            // Some chunks overlap in address; report the pair.
            return Err(addr_overlap(m, mf));
        }
    }

    // No two chunks of this image share bytes of one of its files (record header included).
    // References may share: two images can both point at one chunk of an ancestor, but one
    // image never references one stored chunk twice (that would put it at two addresses).
    let mut by_offset: Vec<usize> = (0..m.chunks.len())
        .filter(|&i| m.chunks[i].is_stored() && !m.chunks[i].is_reference())
        .collect();
    by_offset.sort_by_key(|&i| (m.chunks[i].file, m.chunks[i].file_offset));
    for w in by_offset.windows(2) {
        let (p, q) = (&m.chunks[w[0]], &m.chunks[w[1]]);
        if p.file == q.file && p.file_offset + p.stored_len > q.file_offset - RECORD_LEN {
            return Err(ImageError::ChunkOverlap {
                file: mf.to_owned(),
                data_file: data_file_name(m.nspid, p.file),
                a: w[0],
                b: w[1],
            });
        }
    }
    // No two chunks share device addresses.
    let mut by_addr: Vec<usize> = (0..m.chunks.len()).collect();
    by_addr.sort_by_key(|&i| m.chunks[i].addr);
    if by_addr.windows(2).any(|w| {
        let (p, q) = (&m.chunks[w[0]], &m.chunks[w[1]]);
        p.addr + p.len > q.addr
    }) {
        return Err(addr_overlap(m, mf));
    }

    // Sums: each data file is its header plus its records, with nothing in between; each moved
    // allocation is covered by its chunks exactly.
    let mut file_sums = vec![DATA_HEADER_LEN; m.files.len()];
    for c in m
        .chunks
        .iter()
        .filter(|c| c.is_stored() && !c.is_reference())
    {
        // Each term is at most 1 GiB + 64 and at most ~2^28 chunks fit in a manifest, but a
        // hand-made manifest is not bound by that: saturate instead of wrapping.
        let s = &mut file_sums[positions[&c.file]];
        *s = s.saturating_add(RECORD_LEN + c.stored_len);
    }
    for (f, sum) in m.files.iter().zip(&file_sums) {
        if *sum != f.size {
            return Err(ImageError::SumMismatch {
                file: mf.to_owned(),
                what: format!("size of {}", f.name),
                expected: f.size,
                actual: *sum,
            });
        }
    }
    for (a, sum) in m.allocations.iter().zip(&covered) {
        if a.moved && *sum != a.size {
            return Err(ImageError::SumMismatch {
                file: mf.to_owned(),
                what: format!("moved allocation {} at {:#x}", a.id, a.addr),
                expected: a.size,
                actual: *sum,
            });
        }
    }
    Ok(())
}

/// The first pair of chunks, in address order, whose device ranges overlap.
fn addr_overlap(m: &Manifest, mf: &str) -> ImageError {
    let mut by_addr: Vec<usize> = (0..m.chunks.len()).collect();
    by_addr.sort_by_key(|&i| m.chunks[i].addr);
    let (a, b) = by_addr
        .windows(2)
        .find(|w| m.chunks[w[0]].addr.saturating_add(m.chunks[w[0]].len) > m.chunks[w[1]].addr)
        .map_or((0, 0), |w| (w[0], w[1]));
    ImageError::ChunkAddrOverlap {
        file: mf.to_owned(),
        a,
        b,
    }
}

/// The fields that exist only in some versions: version 1 has no `content_xxh128` and no
/// references; version 2 has a `content_xxh128` (32 lowercase hex digits) on every chunk and
/// references at most [`MAX_CHAIN_DEPTH`] links up; version 3 may add `device_hash`, and has
/// zero chunks (`Codec::Zero`: no file, offset, stored bytes, checksum, content hash or
/// reference, and a device hash); version 4 has `raw_sum64` chunks (checksum = device hash,
/// no content hash).
fn check_version_fields(version: u32, c: &ChunkEntry) -> Result<(), ChunkFieldError> {
    if version < 3 && c.device_hash.is_some() {
        return Err(ChunkFieldError::DeviceHashTooEarly { version });
    }
    // The GPU hashes whole 8-byte words only; a hash or zero chunk of another length is no
    // chunk the agent made.
    if (c.device_hash.is_some() || c.codec == Codec::Zero) && !c.len.is_multiple_of(8) {
        return Err(ChunkFieldError::NotWords { len: c.len });
    }
    if c.codec == Codec::RawSum64 {
        if version < 4 {
            return Err(ChunkFieldError::RawSum64TooEarly { version });
        }
        if c.device_hash != Some(c.checksum) || c.content_xxh128.is_some() {
            return Err(ChunkFieldError::RawSum64Hashes);
        }
        if c.parent_depth > MAX_CHAIN_DEPTH {
            return Err(ChunkFieldError::TooDeep {
                depth: c.parent_depth,
            });
        }
        return Ok(());
    }
    if c.codec == Codec::Zero {
        if version < 3 {
            return Err(ChunkFieldError::ZeroTooEarly { version });
        }
        if c.file != 0
            || c.file_offset != 0
            || c.stored_len != 0
            || c.checksum != 0
            || c.content_xxh128.is_some()
            || c.parent_depth != 0
        {
            return Err(ChunkFieldError::ZeroStored);
        }
        if c.device_hash.is_none() {
            return Err(ChunkFieldError::ZeroNoDeviceHash);
        }
        return Ok(());
    }
    match (version, &c.content_xxh128) {
        (1, Some(_)) => return Err(ChunkFieldError::ContentHashInV1),
        (1, None) if c.parent_depth != 0 => return Err(ChunkFieldError::ParentInV1),
        (1, None) => return Ok(()),
        (_, None) => return Err(ChunkFieldError::NoContentHash),
        (_, Some(h)) if !is_hex128(h) => return Err(ChunkFieldError::BadContentHash(h.clone())),
        _ => {}
    }
    if c.parent_depth > MAX_CHAIN_DEPTH {
        return Err(ChunkFieldError::TooDeep {
            depth: c.parent_depth,
        });
    }
    Ok(())
}

fn is_hex128(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `len` and `stored_len` in 1..=1 GiB; Raw and RawSum64 store exactly `len`, Zstd at most
/// `len`, Zero nothing.
pub(crate) fn check_chunk_lengths(
    len: u64,
    stored_len: u64,
    codec: Codec,
) -> Result<(), ChunkLengthError> {
    if len == 0 || len > MAX_CHUNK_LEN {
        return Err(ChunkLengthError::Len(len));
    }
    if codec == Codec::Zero {
        return match stored_len {
            0 => Ok(()),
            n => Err(ChunkLengthError::ZeroStores(n)),
        };
    }
    if stored_len == 0 || stored_len > MAX_CHUNK_LEN {
        return Err(ChunkLengthError::StoredLen(stored_len));
    }
    match codec {
        Codec::Raw | Codec::RawSum64 if stored_len != len => {
            Err(ChunkLengthError::RawMismatch { len, stored_len })
        }
        Codec::Zstd if stored_len > len => Err(ChunkLengthError::ZstdLarger { len, stored_len }),
        _ => Ok(()),
    }
}

/// Every data file exists, is a regular file of exactly the recorded size, and has a valid header
/// for this process and index.
pub(crate) fn validate_files(
    dir: BorrowedFd<'_>,
    m: &Manifest,
    mf: &str,
) -> Result<(), ImageError> {
    for (i, f) in m.files.iter().enumerate() {
        let index = file_index(m, i, mf)?;
        open_data_file(dir, m.nspid, index, &f.name, f.size)?;
    }
    Ok(())
}

/// Opens data file `index` of `nspid`, checks that it is a regular file of exactly `size` bytes
/// and that its header is intact and its own.
pub(crate) fn open_data_file(
    dir: BorrowedFd<'_>,
    nspid: NsPid,
    index: u32,
    name: &str,
    size: u64,
) -> Result<std::fs::File, ImageError> {
    let (file, actual) = sys::open_regular(dir, name)?;
    if actual < size {
        return Err(ImageError::Truncated {
            file: name.to_owned(),
            expected: size,
            actual,
        });
    }
    if actual > size {
        return Err(ImageError::TrailingData {
            file: name.to_owned(),
            expected: size,
            actual,
        });
    }
    if actual < DATA_HEADER_LEN {
        return Err(ImageError::Truncated {
            file: name.to_owned(),
            expected: DATA_HEADER_LEN,
            actual,
        });
    }
    let mut h = [0u8; DATA_HEADER_LEN as usize];
    file.read_exact_at(&mut h, 0)
        .map_err(|e| ImageError::io(name, IoOp::Read, e))?;
    check_data_header(&h, name, nspid, index)?;
    Ok(file)
}

/// The index of `m.files[i]`, from its name, which must be exactly `gpusnap-<nspid>-data-<index>.img`.
fn file_index(m: &Manifest, i: usize, mf: &str) -> Result<u32, ImageError> {
    m.file_index_at(i).ok_or_else(|| ImageError::BadFileName {
        file: mf.to_owned(),
        index: i,
        name: m.files[i].name.clone(),
        expected: format!("gpusnap-{}-data-<index>.img", m.nspid),
    })
}
