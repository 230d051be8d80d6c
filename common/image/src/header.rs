//! Fixed-size binary headers of data files: the 64-byte file header and the 64-byte record header
//! in front of every chunk. All integers little-endian; each header ends with the xxh3-64 of its
//! first 56 bytes.

use gpusnap_proto::pid::NsPid;
use xxhash_rust::xxh3::xxh3_64;

use crate::{Codec, DATA_FORMAT_VERSION, ImageError};

/// First 8 bytes of every data file.
pub const DATA_MAGIC: [u8; 8] = *b"GPUSNAPD";
/// Length of the data-file header; the first chunk record starts here.
pub const DATA_HEADER_LEN: u64 = 64;
/// First 8 bytes of every chunk record header.
pub const RECORD_MAGIC: [u8; 8] = *b"GPUSNAPC";
/// Length of a chunk record header; a chunk's stored bytes follow it directly.
pub const RECORD_LEN: u64 = 64;

/// Bytes covered by a header's trailing checksum.
const SUMMED: usize = 56;

fn put_u32(b: &mut [u8; 64], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8; 64], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get_u32(b: &[u8; 64], at: usize) -> u32 {
    let mut v = [0u8; 4];
    v.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(v)
}

fn get_u64(b: &[u8; 64], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

fn seal(b: &mut [u8; 64]) {
    let sum = xxh3_64(&b[..SUMMED]);
    put_u64(b, SUMMED, sum);
}

fn sealed(b: &[u8; 64]) -> bool {
    xxh3_64(&b[..SUMMED]) == get_u64(b, SUMMED)
}

/// The data-file header:
/// `0 magic[8] | 8 version u32 | 12 header_len u32 | 16 nspid u32 | 20 index u32 |
///  24 reserved[32] = 0 | 56 xxh3_64(bytes 0..56) u64`.
pub(crate) fn encode_data_header(nspid: NsPid, index: u32) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(&DATA_MAGIC);
    put_u32(&mut b, 8, DATA_FORMAT_VERSION);
    put_u32(&mut b, 12, DATA_HEADER_LEN as u32);
    put_u32(&mut b, 16, nspid.get());
    put_u32(&mut b, 20, index);
    seal(&mut b);
    b
}

/// Checks a data-file header and that it belongs to process `nspid`, file `index`.
pub(crate) fn check_data_header(
    b: &[u8; 64],
    file: &str,
    nspid: NsPid,
    index: u32,
) -> Result<(), ImageError> {
    let file = || file.to_owned();
    if b[..8] != DATA_MAGIC {
        return Err(ImageError::DataHeaderMagic { file: file() });
    }
    if !sealed(b) {
        return Err(ImageError::DataHeaderChecksum { file: file() });
    }
    let version = get_u32(b, 8);
    if version != DATA_FORMAT_VERSION {
        return Err(ImageError::UnsupportedVersion {
            file: file(),
            found: version.into(),
        });
    }
    let mismatch = |field, expected: u64, found: u64| ImageError::DataHeaderMismatch {
        file: file(),
        field,
        expected,
        found,
    };
    let header_len = get_u32(b, 12);
    if u64::from(header_len) != DATA_HEADER_LEN {
        return Err(mismatch(
            "header length",
            DATA_HEADER_LEN,
            header_len.into(),
        ));
    }
    if get_u32(b, 16) != nspid.get() {
        return Err(mismatch("nspid", nspid.get().into(), get_u32(b, 16).into()));
    }
    if get_u32(b, 20) != index {
        return Err(mismatch("file index", index.into(), get_u32(b, 20).into()));
    }
    if b[24..SUMMED].iter().any(|&x| x != 0) {
        return Err(mismatch("reserved bytes", 0, 1));
    }
    Ok(())
}

/// What a chunk record header says about the chunk that follows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    /// Position of the chunk in its file: 0, 1, 2, ...
    pub seq: u32,
    pub codec: Codec,
    pub addr: u64,
    pub len: u64,
    pub stored_len: u64,
    /// xxh3_64 of the stored bytes (gpusnap-sum64 for `RawSum64`).
    pub checksum: u64,
}

pub(crate) fn codec_id(c: Codec) -> u32 {
    match c {
        Codec::Raw => 0,
        Codec::Zstd => 1,
        // Never written: a zero chunk has no record. Decoding refuses it as unknown.
        Codec::Zero => 2,
        Codec::RawSum64 => 3,
    }
}

/// The record header:
/// `0 magic[8] | 8 seq u32 | 12 codec u32 | 16 addr u64 | 24 len u64 | 32 stored_len u64 |
///  40 checksum u64 | 48 reserved[8] = 0 | 56 xxh3_64(bytes 0..56) u64`.
pub(crate) fn encode_record(r: &Record) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(&RECORD_MAGIC);
    put_u32(&mut b, 8, r.seq);
    put_u32(&mut b, 12, codec_id(r.codec));
    put_u64(&mut b, 16, r.addr);
    put_u64(&mut b, 24, r.len);
    put_u64(&mut b, 32, r.stored_len);
    put_u64(&mut b, 40, r.checksum);
    seal(&mut b);
    b
}

/// Decodes a record header; the error says which check failed.
pub(crate) fn decode_record(b: &[u8; 64]) -> Result<Record, &'static str> {
    if b[..8] != RECORD_MAGIC {
        return Err("bad magic");
    }
    if !sealed(b) {
        return Err("checksum mismatch");
    }
    if b[48..SUMMED].iter().any(|&x| x != 0) {
        return Err("reserved bytes are not zero");
    }
    let codec = match get_u32(b, 12) {
        0 => Codec::Raw,
        1 => Codec::Zstd,
        3 => Codec::RawSum64,
        _ => return Err("unknown codec"),
    };
    Ok(Record {
        seq: get_u32(b, 8),
        codec,
        addr: get_u64(b, 16),
        len: get_u64(b, 24),
        stored_len: get_u64(b, 32),
        checksum: get_u64(b, 40),
    })
}
