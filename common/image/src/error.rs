//! The one error type of the image crate, with the chunk details two of its variants hold.
//! Every [`ImageError`] message names the file it is about.

use gpusnap_proto::pid::NsPid;
use std::io;

use crate::{
    DATA_FORMAT_VERSION, DEVFILE_FORMAT_VERSION, DEVFILE_FORMAT_VERSION_MIN, KFD_FORMAT_VERSION,
    KFD_FORMAT_VERSION_MIN, MAX_CHAIN_DEPTH, MAX_CHUNK_LEN, MAX_MANIFEST_BODY,
    READ_MANIFEST_VERSIONS,
};

/// Appended to messages that mean the bytes on disk are not what was written.
const DAMAGED: &str = "image damaged; do not restore from it";

/// The versions this build reads, from the constants: `manifest versions 1 to 5, data file
/// version 1, device-file record versions 1 to 2, KFD file versions 1 to 2`.
pub fn versions_read() -> String {
    let span = |lo: u32, hi: u32| {
        if lo == hi {
            format!("version {lo}")
        } else {
            format!("versions {lo} to {hi}")
        }
    };
    let (lo, hi) = (
        READ_MANIFEST_VERSIONS.iter().min().copied().unwrap_or(0),
        READ_MANIFEST_VERSIONS.iter().max().copied().unwrap_or(0),
    );
    format!(
        "manifest {}, data file {}, device-file record {}, KFD file {}",
        span(lo, hi),
        span(DATA_FORMAT_VERSION, DATA_FORMAT_VERSION),
        span(DEVFILE_FORMAT_VERSION_MIN, DEVFILE_FORMAT_VERSION),
        span(KFD_FORMAT_VERSION_MIN, KFD_FORMAT_VERSION)
    )
}

/// Why an image file could not be written, read or trusted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// A system call on `file` failed.
    #[error("{file}: {op} failed: {source}")]
    Io {
        file: String,
        op: IoOp,
        #[source]
        source: io::Error,
    },
    /// A file that must exist does not.
    #[error("{file}: missing (image incomplete; do not restore from it)")]
    MissingFile { file: String },
    /// A name in the image directory is a directory, FIFO, device or symlink instead of a file.
    #[error("{file}: not a regular file (symlinks, directories and devices are refused)")]
    NotRegularFile { file: String },
    /// The manifest's first line is not `GPUSNAP-MANIFEST <version> <len> <xxh3>`.
    #[error("{file}: malformed manifest header line: {detail} ({DAMAGED})")]
    ManifestHeader { file: String, detail: &'static str },
    /// A header or manifest carries a format version this build does not read.
    #[error(
        "{file}: format version {found} is not supported (this gpusnap reads {}); use the gpusnap that wrote the image",
        versions_read()
    )]
    UnsupportedVersion { file: String, found: u64 },
    /// The manifest header announces a body larger than any real manifest.
    #[error(
        "{file}: manifest body of {len} bytes exceeds the {MAX_MANIFEST_BODY}-byte limit ({DAMAGED})"
    )]
    ManifestTooLarge { file: String, len: u64 },
    /// A file is shorter than its header or the manifest says.
    #[error("{file}: truncated: {actual} bytes, expected {expected} ({DAMAGED})")]
    Truncated {
        file: String,
        expected: u64,
        actual: u64,
    },
    /// A file is longer than its header or the manifest says.
    #[error("{file}: {actual} bytes, expected {expected}: unexpected trailing data ({DAMAGED})")]
    TrailingData {
        file: String,
        expected: u64,
        actual: u64,
    },
    /// The manifest body does not match the checksum in its header line.
    #[error("{file}: manifest checksum mismatch ({DAMAGED})")]
    ManifestChecksum { file: String },
    /// The manifest body passed its checksum but is not a valid manifest document.
    #[error("{file}: manifest JSON is invalid: {source}")]
    ManifestJson {
        file: String,
        #[source]
        source: serde_json::Error,
    },
    /// The manifest describes a different process than its name says.
    #[error("{file}: manifest is for process {found}, expected {expected}")]
    NspidMismatch {
        file: String,
        expected: NsPid,
        found: NsPid,
    },
    /// `files[index]` is not a data-file name of this process (e.g. contains `/` or `..`).
    #[error("{file}: files[{index}] is named {name:?}, expected {expected:?}")]
    BadFileName {
        file: String,
        index: usize,
        name: String,
        expected: String,
    },
    /// A process has gpusnap files (data files, or a manifest still under its temporary name)
    /// but no manifest: its dump did not finish, and nothing of it may be restored.
    #[error(
        "{file}: process {nspid} has no {manifest}: its dump did not finish (image incomplete; do not restore from it)"
    )]
    UnfinishedDump {
        file: String,
        nspid: NsPid,
        manifest: String,
    },
    /// An asynchronous `-R` is still writing this process's data (its PENDING marker is there).
    #[error(
        "{file}: process {nspid}'s GPU data is still being written after an asynchronous `criu dump -R` (image pending, not yet a checkpoint; `gpusnap wait` waits for it)"
    )]
    PendingDump { file: String, nspid: NsPid },
    /// A data file does not start with `GPUSNAPD`.
    #[error("{file}: not a gpusnap data file (bad magic) ({DAMAGED})")]
    DataHeaderMagic { file: String },
    /// A data-file header does not match its own checksum.
    #[error("{file}: data file header checksum mismatch ({DAMAGED})")]
    DataHeaderChecksum { file: String },
    /// A data-file header is intact but describes another file.
    #[error("{file}: data file header has {field} {found}, expected {expected}")]
    DataHeaderMismatch {
        file: String,
        field: &'static str,
        expected: u64,
        found: u64,
    },
    /// A chunk names a data file that the manifest does not list.
    #[error(
        "{file}: chunk {chunk} is in data file {index}, but the manifest lists {count} data files"
    )]
    ChunkFileIndex {
        file: String,
        chunk: usize,
        index: u32,
        count: usize,
    },
    /// A chunk's `len`/`stored_len`/`codec` are inconsistent or out of bounds.
    #[error("{file}: chunk {chunk}: {detail}")]
    ChunkLength {
        file: String,
        chunk: usize,
        #[source]
        detail: ChunkLengthError,
    },
    /// A chunk of the manifest has a field its format version does not have, or lacks one it
    /// must have.
    #[error("{file}: invalid manifest: chunk {chunk}: {why}")]
    ChunkFields {
        file: String,
        chunk: usize,
        #[source]
        why: ChunkFieldError,
    },
    /// A chunk (with its record header) does not lie inside the data area of its file.
    #[error(
        "{file}: chunk {chunk} (bytes {start}..{end} of {data_file}) lies outside the file's data area (64..{size})"
    )]
    ChunkOutsideFile {
        file: String,
        chunk: usize,
        data_file: String,
        start: u64,
        end: u64,
        size: u64,
    },
    /// Two chunks share bytes of one data file.
    #[error("{file}: chunks {a} and {b} overlap in {data_file}")]
    ChunkOverlap {
        file: String,
        data_file: String,
        a: usize,
        b: usize,
    },
    /// Two chunks claim the same device addresses.
    #[error("{file}: chunks {a} and {b} cover overlapping device addresses")]
    ChunkAddrOverlap { file: String, a: usize, b: usize },
    /// A chunk's device range is not inside an allocation whose data was moved to gpusnap files.
    #[error(
        "{file}: chunk {chunk} (device range {addr:#x}+{len:#x}) lies outside every moved allocation"
    )]
    ChunkOutsideAllocation {
        file: String,
        chunk: usize,
        addr: u64,
        len: u64,
    },
    /// Two allocations overlap in device address space.
    #[error("{file}: allocations {a} and {b} overlap")]
    AllocationOverlap { file: String, a: u64, b: u64 },
    /// A recorded total does not equal the sum of its parts.
    #[error("{file}: {what}: recorded {expected}, but its chunks add up to {actual}")]
    SumMismatch {
        file: String,
        what: String,
        expected: u64,
        actual: u64,
    },
    /// Any other field of the manifest that is out of range or inconsistent.
    #[error("{file}: invalid manifest: {detail}")]
    InvalidManifest { file: String, detail: String },
    /// A chunk's record header in the data file is damaged or disagrees with the manifest.
    #[error("{file}: chunk {chunk} record header: {detail} ({DAMAGED})")]
    ChunkRecord {
        file: String,
        chunk: usize,
        detail: &'static str,
    },
    /// A chunk's record header is intact but its `seq` is not the chunk's position in its data
    /// file (records are numbered 0, 1, 2, ... in file order).
    #[error(
        "{file}: chunk {chunk} record header: seq is {found}, but the record is number {expected} in the file ({DAMAGED})"
    )]
    ChunkSeq {
        file: String,
        chunk: usize,
        expected: u64,
        found: u64,
    },
    /// A chunk's stored bytes do not match their checksum.
    #[error("{file}: chunk {chunk} checksum mismatch ({DAMAGED})")]
    ChunkChecksum { file: String, chunk: usize },
    /// A chunk's device bytes do not match the hash the GPU computed for them at the dump.
    #[error("{file}: chunk {chunk} does not match its device hash ({DAMAGED})")]
    ChunkDeviceHash { file: String, chunk: usize },
    /// A zstd chunk passed its checksum but does not decompress to exactly its recorded length.
    #[error("{file}: chunk {chunk} does not decompress to its {len} bytes: {detail} ({DAMAGED})")]
    ChunkDecompress {
        file: String,
        chunk: usize,
        len: u64,
        detail: String,
    },
    /// `read_chunk` was given an entry that is not one of the manifest's chunks of this file.
    #[error("{file}: no chunk of this file starts at offset {offset} with that entry")]
    UnknownChunk { file: String, offset: u64 },
    /// `read_chunk` was given an output buffer of the wrong length.
    #[error("{file}: chunk {chunk} is {expected} bytes, but the output buffer is {got}")]
    BufferSize {
        file: String,
        chunk: usize,
        expected: u64,
        got: u64,
    },
    /// `append_chunk` was given an empty or oversized chunk, or one whose range wraps.
    #[error(
        "{file}: cannot store a chunk of {len} bytes at {addr:#x} (1 ..= {MAX_CHUNK_LEN} bytes, no wrap)"
    )]
    BadChunk { file: String, addr: u64, len: u64 },
    /// A writer whose earlier write failed was used again.
    #[error("{file}: an earlier write failed; this data file is incomplete")]
    WriterFailed { file: String },
    /// The `parent` link of an image directory (`criu dump --prev-images-dir`) is needed but
    /// missing, not a directory, part of a loop, or leads deeper than [`crate::MAX_CHAIN_DEPTH`].
    #[error("{path}: {detail}")]
    ParentLink { path: String, detail: String },
    /// Something about an ancestor image (reached through `parent` links) is wrong; `path` is
    /// the chain of links, e.g. `parent/parent`.
    #[error("{path}/{source}")]
    InParent {
        path: String,
        #[source]
        source: Box<ImageError>,
    },
    /// A chunk that references an ancestor's data does not match what that ancestor recorded.
    #[error(
        "{file}: chunk {chunk} references data {depth} `parent` link(s) up: {detail} (the parent image changed or is damaged; do not restore from it)"
    )]
    BadReference {
        file: String,
        chunk: usize,
        depth: u32,
        detail: String,
    },
    /// The stats file could not be encoded or parsed.
    #[error("{file}: stats JSON: {source}")]
    StatsJson {
        file: String,
        #[source]
        source: serde_json::Error,
    },
    /// The stats file is larger than any stats file gpusnap writes.
    #[error("{file}: {len} bytes exceeds the stats size limit")]
    StatsTooLarge { file: String, len: u64 },
}

/// Why a chunk's `len`, `stored_len` and `codec` do not go together ([`ImageError::ChunkLength`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChunkLengthError {
    /// `len` is 0 or more than [`MAX_CHUNK_LEN`].
    #[error("length {0} is not in 1..={MAX_CHUNK_LEN}")]
    Len(u64),
    /// A zero chunk that stores bytes.
    #[error("zero chunk stores {0} bytes")]
    ZeroStores(u64),
    /// `stored_len` is 0 or more than [`MAX_CHUNK_LEN`].
    #[error("stored length {0} is not in 1..={MAX_CHUNK_LEN}")]
    StoredLen(u64),
    /// A raw or raw_sum64 chunk that does not store exactly its length.
    #[error("raw chunk stores {stored_len} bytes for {len} bytes of data")]
    RawMismatch { len: u64, stored_len: u64 },
    /// A zstd chunk that stores more than its length.
    #[error("zstd chunk stores {stored_len} bytes for {len} bytes of data (larger than raw)")]
    ZstdLarger { len: u64, stored_len: u64 },
}

/// A chunk field that the manifest's format version does not have, or one it must have and
/// lacks ([`ImageError::ChunkFields`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChunkFieldError {
    #[error("device_hash is not a version-{version} field")]
    DeviceHashTooEarly { version: u32 },
    /// The GPU hashes whole 8-byte words only.
    #[error("a device hash or zero chunk of {len} bytes, not a multiple of 8")]
    NotWords { len: u64 },
    #[error("codec raw_sum64 is not a version-{version} codec")]
    RawSum64TooEarly { version: u32 },
    #[error("a raw_sum64 chunk's checksum is its device hash, and it has no content hash")]
    RawSum64Hashes,
    #[error("parent_depth {depth} exceeds the limit of {MAX_CHAIN_DEPTH}")]
    TooDeep { depth: u32 },
    #[error("codec zero is not a version-{version} codec")]
    ZeroTooEarly { version: u32 },
    #[error("a zero chunk has a file, offset, stored length, checksum, content hash or parent")]
    ZeroStored,
    #[error("a zero chunk has no device_hash")]
    ZeroNoDeviceHash,
    #[error("content_xxh128 is not a version-1 field")]
    ContentHashInV1,
    #[error("parent_depth is not a version-1 field")]
    ParentInV1,
    #[error("content_xxh128 is missing")]
    NoContentHash,
    /// The hash as found.
    #[error("content_xxh128 {0:?} is not 32 lowercase hex digits")]
    BadContentHash(String),
}

/// The system call an [`ImageError::Io`] is about: callers match on it (a failed `Fsync` means
/// the disk may have lost writes) instead of on the message. Shown as the call's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum IoOp {
    Open,
    Create,
    Read,
    Write,
    Fsync,
    Fstat,
    Readdir,
    Unlink,
    Rename,
    /// Cutting a file to its length (`ftruncate`).
    Truncate,
    /// Naming an unnamed file (`linkat`).
    Link,
}

impl std::fmt::Display for IoOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoOp::Open => "open",
            IoOp::Create => "create",
            IoOp::Read => "read",
            IoOp::Write => "write",
            IoOp::Fsync => "fsync",
            IoOp::Fstat => "fstat",
            IoOp::Readdir => "readdir",
            IoOp::Unlink => "unlink",
            IoOp::Rename => "rename",
            IoOp::Truncate => "truncate",
            IoOp::Link => "link",
        })
    }
}

impl ImageError {
    pub(crate) fn io(file: &str, op: IoOp, source: io::Error) -> Self {
        ImageError::Io {
            file: file.to_owned(),
            op,
            source,
        }
    }

    /// Like [`ImageError::io`], but a missing file becomes [`ImageError::MissingFile`] and a
    /// symlink (refused by `O_NOFOLLOW` with `ELOOP`) [`ImageError::NotRegularFile`].
    pub(crate) fn open(file: &str, source: io::Error) -> Self {
        let file = file.to_owned();
        match (source.kind(), source.raw_os_error()) {
            (io::ErrorKind::NotFound, _) => ImageError::MissingFile { file },
            (_, Some(libc::ELOOP)) => ImageError::NotRegularFile { file },
            _ => ImageError::Io {
                file,
                op: IoOp::Open,
                source,
            },
        }
    }

    /// `self`, as found in the ancestor image at `path` (`parent`, `parent/parent`, ...).
    pub(crate) fn in_parent(self, path: &str) -> Self {
        ImageError::InParent {
            path: path.to_owned(),
            source: Box::new(self),
        }
    }

    /// True when the error means the image bytes are damaged or inconsistent (as opposed to an
    /// I/O failure of this host, a missing permission or a caller mistake).
    pub fn is_damage(&self) -> bool {
        if let ImageError::InParent { source, .. } = self {
            return source.is_damage();
        }
        !matches!(
            self,
            ImageError::Io { .. }
                | ImageError::UnknownChunk { .. }
                | ImageError::BufferSize { .. }
                | ImageError::BadChunk { .. }
                | ImageError::WriterFailed { .. }
                | ImageError::PendingDump { .. }
        )
    }
}
