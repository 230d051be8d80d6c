//! Reading chunks back: [`DataFileReader`] (pread-based, shared by threads), the full
//! [`verify_image`] pass, and [`scan_data_file`] for walking a data file without its manifest.

use gpusnap_proto::pid::NsPid;
use std::fs::File;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

/// Reads are cut into pieces of this size, each hashed right after it arrives, while it is still
/// in the CPU's cache.
const PIECE: usize = 256 << 10;

use gpusnap_proto::devhash;
use xxhash_rust::xxh3::Xxh3Default;

use crate::header::{Record, check_data_header, decode_record};
use crate::validate::{check_chunk_lengths, open_data_file};
use crate::{
    ChunkEntry, ChunkSources, Codec, DATA_HEADER_LEN, ImageError, IoOp, Manifest, RECORD_LEN,
    data_file_name, manifest_file_name, sys,
};

/// One data file of a manifest, open for reading. `Send + Sync`: reads use `pread`, so any number
/// of threads can read chunks of the same file at once.
#[derive(Debug)]
pub struct DataFileReader {
    file: File,
    name: String,
    index: u32,
    size: u64,
    /// (global chunk number, entry) of the manifest's chunks in this file, by file offset.
    chunks: Vec<(usize, ChunkEntry)>,
}

impl DataFileReader {
    /// Opens data file `file` of `m` (the index in its name, as in [`ChunkEntry::file`]),
    /// checking that it exists with exactly the recorded size and an intact header of its own.
    /// `m` should come from [`crate::read_manifest`]; whatever it holds, every read is still
    /// bounds-checked against the real file.
    pub fn open(dir: BorrowedFd<'_>, m: &Manifest, file: u32) -> Result<Self, ImageError> {
        let Some(fe) = m.file(file) else {
            return Err(ImageError::InvalidManifest {
                file: manifest_file_name(m.nspid),
                detail: format!("it lists no {}", data_file_name(m.nspid, file)),
            });
        };
        let f = open_data_file(dir, m.nspid, file, &fe.name, fe.size)?;
        let mut chunks: Vec<(usize, ChunkEntry)> = m
            .chunks
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_stored() && c.file == file && !c.is_reference())
            .map(|(i, c)| (i, c.clone()))
            .collect();
        chunks.sort_by_key(|(_, c)| c.file_offset);
        Ok(DataFileReader {
            file: f,
            name: fe.name.clone(),
            index: file,
            size: fe.size,
            chunks,
        })
    }

    /// The data file's name (for an ancestor's file, with its `parent/` path in front).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Names the file by its path from the image that references it, in messages.
    pub(crate) fn set_path_prefix(&mut self, prefix: &str) {
        self.name = format!("{prefix}/{}", self.name);
    }

    /// The manifest's chunks in this file, as (chunk number in the manifest, entry), in file order.
    pub fn chunks(&self) -> &[(usize, ChunkEntry)] {
        &self.chunks
    }

    /// Reads one chunk into `out` (`out.len() == entry.len`), checking its record header and
    /// checksum, and decompressing a zstd chunk (through `scratch`, which keeps its capacity from
    /// call to call). `out` holds the chunk's device bytes only if this returns `Ok`.
    pub fn read_chunk(
        &self,
        entry: &ChunkEntry,
        out: &mut [u8],
        scratch: &mut Vec<u8>,
    ) -> Result<(), ImageError> {
        if !entry.is_stored() {
            // A zero chunk: nothing in the file. (The structure check saw to its fields.)
            if out.len() as u64 != entry.len {
                return Err(ImageError::BufferSize {
                    file: self.name.clone(),
                    chunk: usize::MAX,
                    expected: entry.len,
                    got: out.len() as u64,
                });
            }
            out.fill(0);
            return Ok(());
        }
        let chunk = self.check_record_for(entry, out)?;
        self.read_payload(entry, chunk, out, scratch)
    }

    /// [`check_record`](Self::check_record), and that `out` holds exactly the chunk's bytes.
    fn check_record_for(&self, entry: &ChunkEntry, out: &[u8]) -> Result<usize, ImageError> {
        let chunk = self.check_record(entry)?;
        if out.len() as u64 != entry.len {
            return Err(ImageError::BufferSize {
                file: self.name.clone(),
                chunk,
                expected: entry.len,
                got: out.len() as u64,
            });
        }
        Ok(chunk)
    }

    /// [`read_chunk`](Self::read_chunk) for a chunk whose bytes the GPU checks against its
    /// device hash after loading: a raw chunk with a device hash is read without the host
    /// checksum pass (its record is still checked); any other is read as `read_chunk` does.
    /// The caller must then make sure the GPU did check it.
    pub fn read_chunk_for_device_check(
        &self,
        entry: &ChunkEntry,
        out: &mut [u8],
        scratch: &mut Vec<u8>,
    ) -> Result<(), ImageError> {
        if !matches!(entry.codec, Codec::Raw | Codec::RawSum64) || entry.device_hash.is_none() {
            return self.read_chunk(entry, out, scratch);
        }
        self.check_record_for(entry, out)?;
        self.pread(out, entry.file_offset)
    }

    /// The stored bytes of `entry` (its record already checked by `check_record`) into `out`,
    /// checksummed and, for zstd, decompressed.
    fn read_payload(
        &self,
        entry: &ChunkEntry,
        chunk: usize,
        out: &mut [u8],
        scratch: &mut Vec<u8>,
    ) -> Result<(), ImageError> {
        match entry.codec {
            // Straight into the caller's buffer; no copy.
            Codec::Raw => self.read_checked(out, entry, chunk),
            Codec::RawSum64 => self.read_checked_sum64(out, entry, chunk),
            Codec::Zero => {
                out.fill(0);
                Ok(())
            }
            Codec::Zstd => {
                let n = entry.stored_len as usize; // <= 1 GiB and inside the file, checked
                if scratch.len() < n {
                    scratch.resize(n, 0);
                }
                let stored = &mut scratch[..n];
                self.read_checked(stored, entry, chunk)?;
                let got = decompress(stored, out);
                match got {
                    Ok(k) if k == out.len() => Ok(()),
                    Ok(k) => Err(ImageError::ChunkDecompress {
                        file: self.name.clone(),
                        chunk,
                        len: entry.len,
                        detail: format!("frame holds {k} bytes"),
                    }),
                    Err(e) => Err(ImageError::ChunkDecompress {
                        file: self.name.clone(),
                        chunk,
                        len: entry.len,
                        detail: e.to_string(),
                    }),
                }
            }
        }
    }

    /// Checks one chunk as [`read_chunk`](Self::read_chunk) does, without keeping its bytes: a
    /// raw chunk streams through `piece` (a cache-sized buffer), a compressed one is read and
    /// decompressed into `out`.
    pub fn check_chunk(
        &self,
        entry: &ChunkEntry,
        piece: &mut Vec<u8>,
        out: &mut Vec<u8>,
        scratch: &mut Vec<u8>,
    ) -> Result<(), ImageError> {
        let chunk = self.check_record(entry)?;
        let device_hash_ok = |sum: u64| match entry.device_hash {
            Some(h) if devhash::finish(sum, entry.len) != h => Err(ImageError::ChunkDeviceHash {
                file: self.name.clone(),
                chunk,
            }),
            _ => Ok(()),
        };
        if !matches!(entry.codec, Codec::Raw | Codec::RawSum64) {
            let n = entry.len as usize; // <= 1 GiB: check_record bounded it
            if out.len() < n {
                out.resize(n, 0);
            }
            self.read_payload(entry, chunk, &mut out[..n], scratch)?;
            let mut parts = devhash::Sum64Parts::default();
            if entry.device_hash.is_some() {
                parts.add_words(0, &out[..n]);
            }
            return device_hash_ok(parts.sum);
        }
        piece.resize(PIECE, 0);
        let mut hasher = Xxh3Default::new();
        let mut parts = devhash::Sum64Parts::default();
        let (mut done, len) = (0u64, entry.stored_len);
        while done < len {
            let n = (len - done).min(PIECE as u64) as usize;
            self.pread(&mut piece[..n], entry.file_offset + done)?;
            if entry.codec == Codec::Raw {
                hasher.update(&piece[..n]);
            }
            if entry.device_hash.is_some() || entry.codec == Codec::RawSum64 {
                // PIECE is a multiple of 8, so pieces start on word boundaries.
                parts.add_words(done / 8, &piece[..n]);
            }
            done += n as u64;
        }
        let stored_sum = match entry.codec {
            Codec::RawSum64 => devhash::finish(parts.sum, entry.len),
            _ => hasher.digest(),
        };
        if stored_sum != entry.checksum {
            return Err(ImageError::ChunkChecksum {
                file: self.name.clone(),
                chunk,
            });
        }
        device_hash_ok(parts.sum)
    }

    /// Reads the stored bytes of `entry` into `buf` (`buf.len() == stored_len`) a piece at a
    /// time, hashing each piece while it is still in the CPU cache (one pass over memory fewer
    /// than reading all, then hashing all), and checks the checksum.
    /// `read_checked` for `RawSum64`: the bytes against their gpusnap-sum64.
    fn read_checked_sum64(
        &self,
        buf: &mut [u8],
        entry: &ChunkEntry,
        chunk: usize,
    ) -> Result<(), ImageError> {
        let mut parts = devhash::Sum64Parts::default();
        for (k, piece) in buf.chunks_mut(PIECE).enumerate() {
            self.pread(piece, entry.file_offset + (k * PIECE) as u64)?;
            // PIECE is a multiple of 8, so pieces start on word boundaries.
            parts.add_words((k * PIECE / 8) as u64, piece);
        }
        if devhash::finish(parts.sum, entry.len) != entry.checksum {
            return Err(ImageError::ChunkChecksum {
                file: self.name.clone(),
                chunk,
            });
        }
        Ok(())
    }

    fn read_checked(
        &self,
        buf: &mut [u8],
        entry: &ChunkEntry,
        chunk: usize,
    ) -> Result<(), ImageError> {
        let mut hasher = Xxh3Default::new();
        for (k, piece) in buf.chunks_mut(PIECE).enumerate() {
            self.pread(piece, entry.file_offset + (k * PIECE) as u64)?;
            hasher.update(piece);
        }
        if hasher.digest() != entry.checksum {
            return Err(ImageError::ChunkChecksum {
                file: self.name.clone(),
                chunk,
            });
        }
        Ok(())
    }

    /// Finds `entry` among this file's chunks and checks its lengths against the file and its
    /// record header against the manifest. Returns the chunk's number (for errors).
    fn check_record(&self, entry: &ChunkEntry) -> Result<usize, ImageError> {
        let name = || self.name.clone();
        // `position`: the record's number in the file. The manifest's chunks of a file tile it
        // from the header to the end (validated sums, no overlaps), so in file order the k-th
        // entry is the k-th record.
        let (chunk, position) = match self
            .chunks
            .binary_search_by_key(&entry.file_offset, |(_, c)| c.file_offset)
        {
            // A reference names the ancestor's entry with its depth; everything else must agree.
            Ok(k) if self.chunks[k].1.same_stored_chunk(entry) && entry.file == self.index => {
                (self.chunks[k].0, k)
            }
            _ => {
                return Err(ImageError::UnknownChunk {
                    file: name(),
                    offset: entry.file_offset,
                });
            }
        };
        // The manifest may not have been validated: bound everything against the real file
        // before reading or allocating.
        check_chunk_lengths(entry.len, entry.stored_len, entry.codec).map_err(|detail| {
            ImageError::ChunkLength {
                file: name(),
                chunk,
                detail,
            }
        })?;
        let end = entry.file_offset.checked_add(entry.stored_len);
        if entry.file_offset < DATA_HEADER_LEN + RECORD_LEN || end.is_none_or(|e| e > self.size) {
            return Err(ImageError::ChunkOutsideFile {
                file: name(),
                chunk,
                data_file: name(),
                start: entry.file_offset.saturating_sub(RECORD_LEN),
                end: end.unwrap_or(u64::MAX),
                size: self.size,
            });
        }

        let mut rh = [0u8; RECORD_LEN as usize];
        self.pread(&mut rh, entry.file_offset - RECORD_LEN)?;
        let rec = decode_record(&rh).map_err(|detail| ImageError::ChunkRecord {
            file: name(),
            chunk,
            detail,
        })?;
        let want = Record {
            seq: rec.seq,
            codec: entry.codec,
            addr: entry.addr,
            len: entry.len,
            stored_len: entry.stored_len,
            checksum: entry.checksum,
        };
        if rec != want {
            return Err(ImageError::ChunkRecord {
                file: name(),
                chunk,
                detail: "disagrees with the manifest",
            });
        }
        if rec.seq as usize != position {
            return Err(ImageError::ChunkSeq {
                file: name(),
                chunk,
                expected: position as u64,
                found: rec.seq.into(),
            });
        }

        Ok(chunk)
    }

    /// `pread` all of `buf` at `offset` (std retries short reads and `EINTR`).
    fn pread(&self, buf: &mut [u8], offset: u64) -> Result<(), ImageError> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| ImageError::io(&self.name, IoOp::Read, e))
    }
}

/// Decompresses one zstd frame into `out`; returns the bytes written. `out` bounds the output, so
/// a hostile frame cannot make it allocate or write more. A context per call (a few hundred KiB,
/// microseconds) is noise next to a multi-MiB chunk, and keeps this library free of thread-locals
/// with destructors, which do not mix with a plugin that CRIU may dlclose.
fn decompress(frame: &[u8], out: &mut [u8]) -> std::io::Result<usize> {
    zstd::bulk::Decompressor::new()?.decompress_to_buffer(frame, out)
}

/// What a full verification pass covered.
#[derive(Clone, Debug, PartialEq)]
pub struct VerifyReport {
    pub chunks: u64,
    /// Device bytes (sum of `len`).
    pub bytes: u64,
    /// Bytes in the data files (sum of `stored_len`), this image's and its ancestors'.
    pub stored_bytes: u64,
    /// Chunks, and their device bytes, whose stored bytes are in ancestor images (references).
    pub referenced_chunks: u64,
    pub referenced_bytes: u64,
    /// How many `parent` links deep the references went (0: none).
    pub chain_depth: u32,
    /// Chunks, and their device bytes, recorded as all zero (no stored bytes).
    pub zero_chunks: u64,
    pub zero_bytes: u64,
    pub seconds: f64,
}

/// Reads every chunk of `m`, in its own data files and, for references, in its ancestors'
/// (opened and checked first, see [`crate::open_ancestors`]), and checks its record header,
/// checksum and decompression, `threads` data files at a time. Stops at the first error,
/// which it returns.
pub fn verify_image(
    dir: BorrowedFd<'_>,
    m: &Manifest,
    threads: usize,
) -> Result<VerifyReport, ImageError> {
    let start = Instant::now();
    let sources = ChunkSources::open(dir, m)?;
    let indexes = sources.groups();
    let nfiles = indexes.len();
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<ImageError>> = Mutex::new(None);
    let workers = threads.clamp(1, nfiles.max(1));

    std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let (mut piece, mut out, mut scratch) = (Vec::new(), Vec::new(), Vec::new());
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= nfiles || failed.load(Ordering::Relaxed) {
                            break;
                        }
                        let (depth, file) = indexes[i];
                        let bufs = (&mut piece, &mut out, &mut scratch);
                        let r = verify_file(&sources, depth, file, &failed, bufs);
                        if let Err(e) = r {
                            let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                            slot.get_or_insert(e);
                            failed.store(true, Ordering::Relaxed);
                            break;
                        }
                    }
                })
            })
            .collect();
        // Join explicitly (pthread_join), so every worker has fully exited, thread-local
        // destructors included, when this returns; a panic in a worker is re-raised here.
        for h in handles {
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    check_zero_chunks(m)?;
    let refs = || m.chunks.iter().filter(|c| c.is_reference());
    Ok(VerifyReport {
        chunks: m.chunks.len() as u64,
        bytes: m.chunks.iter().map(|c| c.len).sum(),
        stored_bytes: m.chunks.iter().map(|c| c.stored_len).sum(),
        referenced_chunks: refs().count() as u64,
        referenced_bytes: refs().map(|c| c.len).sum(),
        chain_depth: sources.ancestors().depth(),
        zero_chunks: m.chunks.iter().filter(|c| !c.is_stored()).count() as u64,
        zero_bytes: m
            .chunks
            .iter()
            .filter(|c| !c.is_stored())
            .map(|c| c.len)
            .sum(),
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Every zero chunk's device hash is the hash of that many zero bytes (all lengths from one
/// running sum, `devhash::zero_hashes`: at most 1 GiB, 2^27 steps, however many lengths a
/// manifest lists).
fn check_zero_chunks(m: &Manifest) -> Result<(), ImageError> {
    let lens: Vec<u64> = m
        .chunks
        .iter()
        .filter(|c| !c.is_stored())
        .map(|c| c.len)
        .collect();
    let known: std::collections::HashMap<u64, Option<u64>> =
        devhash::zero_hashes(&lens).into_iter().collect();
    for (i, c) in m.chunks.iter().enumerate().filter(|(_, c)| !c.is_stored()) {
        let want = known.get(&c.len).copied().flatten();
        if want.is_none() || c.device_hash != want {
            return Err(ImageError::ChunkDeviceHash {
                file: manifest_file_name(m.nspid),
                chunk: i,
            });
        }
    }
    Ok(())
}

fn verify_file(
    sources: &ChunkSources<'_>,
    depth: u32,
    index: u32,
    failed: &AtomicBool,
    (piece, out, scratch): (&mut Vec<u8>, &mut Vec<u8>, &mut Vec<u8>),
) -> Result<(), ImageError> {
    let r = sources.reader(depth, index)?;
    for (_, c) in sources.chunks(depth, index) {
        if failed.load(Ordering::Relaxed) {
            return Ok(());
        }
        r.check_chunk(c, piece, out, scratch)?;
    }
    Ok(())
}

/// The chunks found by walking a data file's record headers, for recovery without a manifest.
#[derive(Debug)]
pub struct DataFileScan {
    /// The file's size.
    pub size: u64,
    /// Every chunk whose record header is intact and whose stored bytes lie inside the file, in
    /// file order (`file` is the data file's index). Payloads are not read: check them with
    /// a reader before use.
    pub chunks: Vec<ChunkEntry>,
    /// Offset where the walk stopped: `size` if every byte was accounted for.
    pub end: u64,
    /// Why the walk stopped before `size`, if it did.
    pub stopped: Option<ImageError>,
}

/// Walks `gpusnap-<nspid>-data-<index>.img` record by record, without a manifest. Fails only if
/// the file cannot be opened or its header is bad; damage further in ends the walk.
pub fn scan_data_file(
    dir: BorrowedFd<'_>,
    nspid: NsPid,
    index: u32,
) -> Result<DataFileScan, ImageError> {
    let name = data_file_name(nspid, index);
    let (file, size) = sys::open_regular(dir, &name)?;
    if size < DATA_HEADER_LEN {
        return Err(ImageError::Truncated {
            file: name,
            expected: DATA_HEADER_LEN,
            actual: size,
        });
    }
    let mut h = [0u8; DATA_HEADER_LEN as usize];
    file.read_exact_at(&mut h, 0)
        .map_err(|e| ImageError::io(&name, IoOp::Read, e))?;
    check_data_header(&h, &name, nspid, index)?;

    let mut scan = DataFileScan {
        size,
        chunks: Vec::new(),
        end: DATA_HEADER_LEN,
        stopped: None,
    };
    while scan.end < size {
        let chunk = scan.chunks.len();
        let stop = |detail| ImageError::ChunkRecord {
            file: name.clone(),
            chunk,
            detail,
        };
        if size - scan.end < RECORD_LEN {
            scan.stopped = Some(stop("truncated"));
            break;
        }
        let mut rh = [0u8; RECORD_LEN as usize];
        if let Err(e) = file.read_exact_at(&mut rh, scan.end) {
            scan.stopped = Some(ImageError::io(&name, IoOp::Read, e));
            break;
        }
        let rec = match decode_record(&rh) {
            Ok(r) => r,
            Err(detail) => {
                scan.stopped = Some(stop(detail));
                break;
            }
        };
        let payload = scan.end + RECORD_LEN;
        if rec.seq as usize != chunk {
            scan.stopped = Some(ImageError::ChunkSeq {
                file: name.clone(),
                chunk,
                expected: chunk as u64,
                found: rec.seq.into(),
            });
            break;
        }
        if let Err(detail) = check_chunk_lengths(rec.len, rec.stored_len, rec.codec) {
            scan.stopped = Some(ImageError::ChunkLength {
                file: name.clone(),
                chunk,
                detail,
            });
            break;
        }
        if rec.stored_len > size - payload {
            scan.stopped = Some(stop("stored bytes run past the end of the file"));
            break;
        }
        if rec.addr.checked_add(rec.len).is_none() {
            scan.stopped = Some(stop("device range wraps the address space"));
            break;
        }
        scan.chunks.push(ChunkEntry {
            file: index,
            file_offset: payload,
            addr: rec.addr,
            len: rec.len,
            stored_len: rec.stored_len,
            codec: rec.codec,
            checksum: rec.checksum,
            content_xxh128: None,
            parent_depth: 0,
            device_hash: None,
        });
        scan.end = payload + rec.stored_len;
    }
    Ok(scan)
}
