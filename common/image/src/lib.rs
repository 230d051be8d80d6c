//! gpusnap's on-disk image format, and the only code in gpusnap that parses image bytes.
//!
//! A checkpointed GPU process leaves, in CRIU's image directory:
//! - data files `gpusnap-<nspid>-data-<index>.img`, one per writer thread: a 64-byte header, then
//!   chunk records (a 64-byte record header and the chunk's stored bytes, raw or one zstd frame);
//! - one manifest `gpusnap-<nspid>-manifest.img`, written last by an atomic rename: a checksummed
//!   header line followed by a JSON body that lists GPUs, allocations, files and chunks.
//!
//! The manifest is the source of truth; the record headers in data files exist so that damage can
//! be pinned to a chunk and so a data file can be walked without its manifest ([`scan_data_file`]).
//! `docs/image-format.md` describes every byte.
//!
//! Boundaries: this crate knows nothing of CUDA, CRIU or the agent. Files are always opened relative
//! to a directory file descriptor (CRIU hands plugins `criu_get_image_dir()`), never by path. Every
//! size read from a file is untrusted until checked; readers refuse anything they cannot prove whole.
//!
//! Modules:
//! - `header`: the 64-byte headers of data files and chunk records;
//! - `writer` / `reader`: data files, written chunk by chunk and read back checked;
//! - `manifest` / `validate`: the manifest, its encoding and its structural checks;
//! - `chain`: a pre-copy chain's parent images, and what a dump may reference in them;
//! - `names`: gpusnap's file names in CRIU's directory, and listing them;
//! - `stats`: `gpusnap-stats.json`;
//! - `kfd` / `devfile`: an AMD process's KFD state, and device-file records;
//! - `durable` / `reserve`: fsync of the directory, and disk space held for a drain;
//! - `error`: [`ImageError`]; `sys`: the few system calls, relative to a directory descriptor.

mod chain;
mod devfile;
mod durable;
mod error;
mod header;
mod kfd;
mod manifest;
mod names;
mod reader;
mod reserve;
mod stats;
mod sys;
mod validate;
mod writer;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod chain_tests;

#[cfg(test)]
mod cut_short_tests;

#[cfg(test)]
mod mutation_tests;

pub use chain::{
    Ancestors, ChunkSources, DedupIndex, MAX_CHAIN_DEPTH, PARENT_LINK, ParentImage, open_ancestors,
    open_parent_dir, parent_for_dedup, read_manifest, verify_parent, write_manifest,
};
pub use devfile::{
    DEVFILE_FORMAT_VERSION, DEVFILE_FORMAT_VERSION_MIN, DEVFILE_MAGIC, DevFileRecord,
    decode_dev_file, devfile_name, encode_dev_file, gpu_node_number, is_nvidia_device_path,
    list_dev_files, read_dev_file, write_dev_file,
};
pub use durable::{IMAGE_DIR, sync_dir};
pub use error::{ChunkFieldError, ChunkLengthError, ImageError, IoOp, versions_read};
pub use header::{DATA_HEADER_LEN, DATA_MAGIC, RECORD_LEN, RECORD_MAGIC};
pub use kfd::{
    KFD_FILE_MAGIC, KFD_FORMAT_VERSION, KFD_FORMAT_VERSION_MIN, KFD_STATE_MAGIC, KfdBoRecord,
    KfdFileKind, KfdFileRecord, KfdGpuRecord, KfdState, KfdVmaNode, KfdVmaRecord,
    MAX_KFD_STATE_BODY, check_kfd_state_against_manifest, decode_kfd_file, decode_kfd_state,
    encode_kfd_state_unchecked, kfd_file_name, kfd_state_name, priv_data_hex, read_kfd_file,
    read_kfd_state, validate_kfd_state, write_kfd_file, write_kfd_state,
};
pub use manifest::{
    AllocationRecord, CheckpointPath, ChunkEntry, Codec, FileEntry, GpuRecord, LibraryDigest,
    MANIFEST_MAGIC, MAX_MANIFEST_BODY, MAX_REQUIREMENT_TEXT, Manifest, Requirements,
    encode_manifest_unchecked,
};
pub use names::{
    ImageFileKind, STATS_FILE_NAME, data_file_name, failed_marker_name, list_image_files,
    list_manifests, manifest_file_name, manifest_tmp_name, parse_file_name, pending_marker_name,
    pending_owner, pending_text, read_manifests, remove_data_file, remove_process_files,
    unfinished_dumps,
};
pub use reader::{DataFileReader, DataFileScan, VerifyReport, scan_data_file, verify_image};
pub use reserve::{CHUNK_OVERHEAD, Reservation, ReserveError};
pub use stats::{MAX_STATS_LEN, read_stats, write_stats};
pub use validate::validate_manifest_structure;
pub use writer::{ChunkHashes, DataFileWriter, SealedDataFile, WriterTimes, hash_chunk};

/// Which build of gpusnap this is: `<version>+<commit>`, where `<commit>` is the short git hash
/// of the source, with `-dirty` if it had uncommitted changes, or `unknown` if it was not built
/// from a git checkout (see `build.rs`). The plugin logs it at load and writes it into every
/// manifest as [`Manifest::gpusnap_version`].
pub const BUILD: &str = env!("GPUSNAP_BUILD");

/// The manifest version this gpusnap writes. Version 2 added `content_xxh128` and
/// `parent_depth` to chunk entries (incremental checkpoints); version 3 `device_hash` and the
/// `zero` codec (chunks hashed and found all zero on the GPU); version 4 the `raw_sum64` codec
/// (raw chunks checked by their device hash, so the dump hashes nothing on the host); version 5
/// `lent` on allocation entries (a restore may hand the memory over); version 6
/// `rdma_capable` on allocation entries (what a keeper restoring the memory must make); version
/// 7 `requires` (the kernel driver's version, the driver library's digest and the device memory
/// in use per GPU: what a restore checks of the node first). Readers accept
/// [`READ_MANIFEST_VERSIONS`].
pub const FORMAT_VERSION: u32 = 7;

/// Manifest versions readers accept: 1 (no incremental fields), 2, 3, 4, 5, 6 and 7.
pub const READ_MANIFEST_VERSIONS: [u32; 7] = [1, 2, 3, 4, 5, 6, 7];

/// The version of the data-file header. Its layout did not change with manifest version 2, so
/// it is still 1, and readers accept only 1. (The device-file record has its own version,
/// [`DEVFILE_FORMAT_VERSION`].)
pub const DATA_FORMAT_VERSION: u32 = 1;

/// Largest chunk (before and after compression) that writers produce and readers accept: 1 GiB.
pub const MAX_CHUNK_LEN: u64 = 1 << 30;
