//! [`DataFileWriter`]: appends chunks to one data file. One writer per writer thread.

use gpusnap_proto::pid::NsPid;
use std::fs::File;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use xxhash_rust::xxh3::{Xxh3Default, xxh3_64};

use crate::header::{Record, encode_data_header, encode_record};
use crate::reserve::{HeldFile, Reservation};
use crate::{
    ChunkEntry, Codec, DATA_HEADER_LEN, FileEntry, ImageError, IoOp, MAX_CHUNK_LEN, RECORD_LEN,
    data_file_name, sys,
};

/// zstd level for `Codec::Zstd`: level 1 is the fastest with entropy coding (~0.7 GB/s/core on
/// bf16 weights, several GB/s on zeros).
const ZSTD_LEVEL: i32 = 1;

/// The two hashes of a chunk's device bytes, from one pass over them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHashes {
    /// XXH3-64 (seed 0): the record checksum of a chunk stored raw.
    pub xxh3_64: u64,
    /// XXH3-128 (seed 0): `content_xxh128`, what incremental dumps compare.
    pub xxh3_128: u128,
}

impl ChunkHashes {
    /// `xxh3_128` as the manifest writes it: 32 lowercase hex digits.
    pub fn content_hex(&self) -> String {
        format!("{:032x}", self.xxh3_128)
    }
}

/// Hashes `data` once, giving both XXH3-64 and XXH3-128 (the streaming state of XXH3 is the
/// same for both widths; only the final mix differs), so a raw chunk costs one pass.
pub fn hash_chunk(data: &[u8]) -> ChunkHashes {
    let mut h = Xxh3Default::new();
    h.update(data);
    ChunkHashes {
        xxh3_64: h.digest(),
        xxh3_128: h.digest128(),
    }
}

/// Writes `gpusnap-<nspid>-data-<index>.img`: the header at creation, then one record per
/// [`append_chunk`](Self::append_chunk). `Send`, so it can move to its writer thread.
///
/// Made by [`create`](Self::create), the file has its name from the start; made by
/// [`create_in`](Self::create_in), it is written into space a [`Reservation`] held, and
/// gets its name only once it is whole ([`SealedDataFile::publish`]).
pub struct DataFileWriter {
    file: Arc<File>,
    /// The held piece the file is written into, if it is one.
    held: Option<HeldFile>,
    name: String,
    index: u32,
    /// Bytes written so far, which is where the next record goes.
    offset: u64,
    seq: u32,
    sync: bool,
    /// Set when a write failed part-way: the file's tail is then unknown and no more appends are
    /// accepted.
    failed: bool,
    compressor: Option<zstd::bulk::Compressor<'static>>,
    /// Compressed output, kept between chunks so its capacity is reused.
    scratch: Vec<u8>,
    /// Where this writer's time went ([`WriterTimes`]).
    times: WriterTimes,
}

/// Where a data file writer's time went, for the dump's statistics: hashing chunks as they are
/// written ([`DataFileWriter::append_raw`]), and writing them (`pwrite`, compression included).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WriterTimes {
    pub hash: std::time::Duration,
    pub write: std::time::Duration,
}

impl std::fmt::Debug for DataFileWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataFileWriter")
            .field("name", &self.name)
            .field("offset", &self.offset)
            .field("chunks", &self.seq)
            .finish_non_exhaustive()
    }
}

/// Writes go to explicit offsets (`pwrite`), so a chunk's record header can follow its bytes.
fn write_all_at(file: &File, name: &str, buf: &[u8], offset: u64) -> Result<(), ImageError> {
    // std's write_all_at loops over short writes and retries EINTR.
    file.write_all_at(buf, offset)
        .map_err(|e| ImageError::io(name, IoOp::Write, e))
}

/// [`DataFileWriter::append_raw`] hashes and writes a chunk in pieces of this size, so that the
/// write reads each piece from the CPU's cache, where the hash has just brought it.
const PIECE: usize = 256 << 10;

impl DataFileWriter {
    /// Creates the data file afresh (a stale file of the same name is replaced), mode 0600, and
    /// writes its header.
    pub fn create(dir: BorrowedFd<'_>, nspid: NsPid, index: u32) -> Result<Self, ImageError> {
        let name = data_file_name(nspid, index);
        let file =
            sys::create_fresh(dir, &name).map_err(|e| ImageError::io(&name, IoOp::Create, e))?;
        DataFileWriter::with_header(Arc::new(file), None, name, nspid, index)
    }

    /// The data file of `nspid` and `index`, written into a piece of `reserved`, space held
    /// in the image directory (`Reservation::claim`): it has no name until it is whole
    /// ([`Self::seal`], then [`SealedDataFile::publish`]). Past the piece's share, each chunk
    /// first hands back as much of the space held elsewhere (`reserve`'s rule), so the drain's
    /// writes stay inside what was held. Dropped unpublished, the file is gone.
    pub fn create_in(reserved: &Reservation, nspid: NsPid, index: u32) -> Result<Self, ImageError> {
        let name = data_file_name(nspid, index);
        let piece = reserved
            .claim()
            .map_err(|e| ImageError::io(&name, IoOp::Create, e))?;
        let file = piece.file().clone();
        piece.room(DATA_HEADER_LEN);
        DataFileWriter::with_header(file, Some(piece), name, nspid, index)
    }

    fn with_header(
        file: Arc<File>,
        held: Option<HeldFile>,
        name: String,
        nspid: NsPid,
        index: u32,
    ) -> Result<Self, ImageError> {
        write_all_at(&file, &name, &encode_data_header(nspid, index), 0)?;
        Ok(DataFileWriter {
            file,
            held,
            name,
            index,
            offset: DATA_HEADER_LEN,
            seq: 0,
            sync: false,
            failed: false,
            compressor: None,
            scratch: Vec::new(),
            times: WriterTimes::default(),
        })
    }

    /// With `true`, [`finish`](Self::finish) calls `fsync` on the file, so its bytes and size are
    /// on stable storage before its entry is returned (`durable = true`; its name is durable only
    /// once the directory is synced too, [`crate::sync_dir`]), and each chunk's writeback is
    /// started as soon as it is written, so the disk works while the dump goes on. On tmpfs it
    /// costs nothing worth measuring. Default `false`.
    pub fn set_sync(&mut self, sync: bool) {
        self.sync = sync;
    }

    /// The data file's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes written so far (header included).
    pub fn bytes_written(&self) -> u64 {
        self.offset
    }

    /// Where this writer's time went so far.
    pub fn times(&self) -> WriterTimes {
        self.times
    }

    /// Appends one chunk: the device bytes at `addr`. With `Codec::Zstd` the chunk is compressed
    /// at level 1 and stored raw instead when that does not shrink it; the returned entry says
    /// which. Raw chunks are checksummed and written straight from `data`, with no copy.
    pub fn append_chunk(
        &mut self,
        addr: u64,
        data: &[u8],
        codec: Codec,
    ) -> Result<ChunkEntry, ImageError> {
        self.append_chunk_hashed(addr, data, codec, &hash_chunk(data))
    }

    /// [`append_chunk`](Self::append_chunk) with `hashes` already computed from `data` (by
    /// [`hash_chunk`]; an incremental dump hashes a chunk before it decides to write it).
    pub fn append_chunk_hashed(
        &mut self,
        addr: u64,
        data: &[u8],
        codec: Codec,
        hashes: &ChunkHashes,
    ) -> Result<ChunkEntry, ImageError> {
        self.check_append(addr, data.len() as u64)?;
        let t0 = std::time::Instant::now();
        let (stored, codec): (&[u8], Codec) = match codec {
            // A zero chunk is recorded without any file (`ChunkEntry::zero`); asked to store
            // one anyway, store its bytes.
            Codec::Raw | Codec::Zero | Codec::RawSum64 => (data, Codec::Raw),
            Codec::Zstd => match compress(&mut self.compressor, &mut self.scratch, data) {
                Some(n) => (&self.scratch[..n], Codec::Zstd),
                None => (data, Codec::Raw),
            },
        };
        self.room(stored.len() as u64);
        let record = Record {
            seq: self.seq,
            codec,
            addr,
            len: data.len() as u64,
            stored_len: stored.len() as u64,
            checksum: match codec {
                Codec::Zstd => xxh3_64(stored),
                Codec::Raw | Codec::Zero | Codec::RawSum64 => hashes.xxh3_64,
            },
        };
        let result = write_all_at(&self.file, &self.name, &encode_record(&record), self.offset)
            .and_then(|()| write_all_at(&self.file, &self.name, stored, self.offset + RECORD_LEN));
        self.times.write += t0.elapsed();
        if let Err(e) = result {
            self.failed = true;
            return Err(e);
        }
        Ok(self.committed(&record, Some(hashes)))
    }

    /// Appends one chunk stored raw, hashing it on the way: each piece is hashed and then written
    /// while it is in the CPU's cache, one pass over memory fewer than hashing the whole chunk
    /// and then writing it. The record header, which holds the checksum, is written last.
    /// Returns the entry and the chunk's hashes.
    pub fn append_raw(
        &mut self,
        addr: u64,
        data: &[u8],
    ) -> Result<(ChunkEntry, ChunkHashes), ImageError> {
        self.check_append(addr, data.len() as u64)?;
        self.room(data.len() as u64);
        let mut hasher = Xxh3Default::new();
        let base = self.offset + RECORD_LEN;
        let mut result = Ok(());
        for (k, piece) in data.chunks(PIECE).enumerate() {
            let t0 = std::time::Instant::now();
            hasher.update(piece);
            let t1 = std::time::Instant::now();
            result = write_all_at(&self.file, &self.name, piece, base + (k * PIECE) as u64);
            self.times.hash += t1 - t0;
            self.times.write += t1.elapsed();
            if result.is_err() {
                break;
            }
        }
        let hashes = ChunkHashes {
            xxh3_64: hasher.digest(),
            xxh3_128: hasher.digest128(),
        };
        let record = Record {
            seq: self.seq,
            codec: Codec::Raw,
            addr,
            len: data.len() as u64,
            stored_len: data.len() as u64,
            checksum: hashes.xxh3_64,
        };
        let result = result.and_then(|()| {
            write_all_at(&self.file, &self.name, &encode_record(&record), self.offset)
        });
        if let Err(e) = result {
            self.failed = true;
            return Err(e);
        }
        Ok((self.committed(&record, Some(&hashes)), hashes))
    }

    /// Appends a raw chunk whose device hash the GPU computed (`Codec::RawSum64`): its record's
    /// checksum is that hash, so nothing is hashed here and the bytes go to the file in one
    /// write. The caller vouches that `device_hash` is the gpusnap-sum64 of `data` (the agent
    /// hashed the device memory the bytes were copied from, with the application stopped); a
    /// reader checks it, on the host or on the GPU.
    pub fn append_raw_sum64(
        &mut self,
        addr: u64,
        data: &[u8],
        device_hash: u64,
    ) -> Result<ChunkEntry, ImageError> {
        self.check_append(addr, data.len() as u64)?;
        if !data.len().is_multiple_of(8) {
            return Err(ImageError::BadChunk {
                file: self.name.clone(),
                addr,
                len: data.len() as u64,
            });
        }
        let t0 = std::time::Instant::now();
        self.room(data.len() as u64);
        let record = Record {
            seq: self.seq,
            codec: Codec::RawSum64,
            addr,
            len: data.len() as u64,
            stored_len: data.len() as u64,
            checksum: device_hash,
        };
        let result =
            write_all_at(&self.file, &self.name, data, self.offset + RECORD_LEN).and_then(|()| {
                write_all_at(&self.file, &self.name, &encode_record(&record), self.offset)
            });
        self.times.write += t0.elapsed();
        if let Err(e) = result {
            self.failed = true;
            return Err(e);
        }
        let mut entry = self.committed(&record, None);
        entry.device_hash = Some(device_hash);
        Ok(entry)
    }

    /// Makes room for a record of `stored` bytes at the end of a file written into held space
    /// ([`HeldFile::room`]); nothing for a named file.
    fn room(&self, stored: u64) {
        if let Some(h) = &self.held {
            h.room(self.offset + RECORD_LEN + stored);
        }
    }

    /// Refuses an append after a failed write, and chunks of no or too many bytes.
    fn check_append(&self, addr: u64, len: u64) -> Result<(), ImageError> {
        if self.failed {
            return Err(ImageError::WriterFailed {
                file: self.name.clone(),
            });
        }
        if len == 0 || len > MAX_CHUNK_LEN || addr.checked_add(len).is_none() {
            return Err(ImageError::BadChunk {
                file: self.name.clone(),
                addr,
                len,
            });
        }
        Ok(())
    }

    /// The entry of the chunk just written at `self.offset`, which then moves past it.
    fn committed(&mut self, record: &Record, hashes: Option<&ChunkHashes>) -> ChunkEntry {
        let entry = ChunkEntry {
            file: self.index,
            file_offset: self.offset + RECORD_LEN,
            addr: record.addr,
            len: record.len,
            stored_len: record.stored_len,
            codec: record.codec,
            checksum: record.checksum,
            content_xxh128: hashes.map(ChunkHashes::content_hex),
            parent_depth: 0,
            device_hash: None,
        };
        if self.sync {
            crate::sys::start_writeback(&self.file, self.offset, RECORD_LEN + record.stored_len);
        }
        self.offset += RECORD_LEN + record.stored_len;
        self.seq += 1;
        entry
    }

    /// Ends the file (with `fsync` if [`set_sync`](Self::set_sync) asked for it) and returns
    /// its manifest entry: [`seal`](Self::seal), then [`SealedDataFile::publish`]. A failed
    /// `fsync` is an error naming the file.
    pub fn finish(self) -> Result<FileEntry, ImageError> {
        self.seal()?.publish()
    }

    /// Ends the file without naming it yet: a file written into held space is cut to the
    /// bytes written (the rest of its piece goes back to the file system: seal only once every
    /// writer of the reservation is done), then, as every file, synced if
    /// [`set_sync`](Self::set_sync) asked for it.
    pub fn seal(self) -> Result<SealedDataFile, ImageError> {
        if self.failed {
            return Err(ImageError::WriterFailed { file: self.name });
        }
        if let Some(h) = &self.held {
            h.seal(self.offset)
                .map_err(|e| ImageError::io(&self.name, IoOp::Truncate, e))?;
        }
        if self.sync {
            self.file
                .sync_all()
                .map_err(|e| ImageError::io(&self.name, IoOp::Fsync, e))?;
        }
        Ok(SealedDataFile {
            held: self.held,
            name: self.name,
            size: self.offset,
        })
    }
}

/// A data file whole and synced as asked ([`DataFileWriter::seal`]), not yet named if it was
/// written into held space.
#[derive(Debug)]
pub struct SealedDataFile {
    held: Option<HeldFile>,
    name: String,
    size: u64,
}

impl SealedDataFile {
    /// The data file's name (what [`publish`](Self::publish) gives it).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Names the file (a file written into held space: `linkat`, a stale file of that name
    /// replaced; a file made by [`DataFileWriter::create`] has its name already) and returns
    /// its manifest entry. Its name is durable once the directory is synced
    /// ([`crate::sync_dir`]).
    pub fn publish(self) -> Result<FileEntry, ImageError> {
        if let Some(h) = &self.held {
            h.link(&self.name)
                .map_err(|e| ImageError::io(&self.name, IoOp::Link, e))?;
        }
        Ok(FileEntry {
            name: self.name,
            size: self.size,
        })
    }
}

/// Compresses `data` into `scratch` at [`ZSTD_LEVEL`]; `Some(n)` if the frame (`scratch[..n]`) is
/// smaller than `data`, `None` if the chunk should be stored raw.
fn compress(
    ctx: &mut Option<zstd::bulk::Compressor<'static>>,
    scratch: &mut Vec<u8>,
    data: &[u8],
) -> Option<usize> {
    let c = match ctx {
        Some(c) => c,
        None => match zstd::bulk::Compressor::new(ZSTD_LEVEL) {
            Ok(c) => ctx.insert(c),
            Err(e) => {
                log::warn!("zstd context: {e}; storing raw");
                return None;
            }
        },
    };
    // Room for a frame one byte smaller than the input: zstd stops with "destination too small"
    // as soon as compression stops paying, which then means "store raw".
    scratch.clear();
    scratch.reserve(data.len());
    match c.compress_to_buffer(data, scratch) {
        Ok(n) if n < data.len() => Some(n),
        _ => None,
    }
}
