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

mod devfile;
mod error;
mod header;
mod manifest;
mod names;
mod reader;
mod stats;
mod sys;
mod validate;
mod writer;

#[cfg(test)]
mod tests;

pub use devfile::{
    DEVFILE_MAGIC, DevFileRecord, decode_dev_file, devfile_name, encode_dev_file,
    is_nvidia_device_path, read_dev_file, write_dev_file,
};
pub use error::ImageError;
pub use header::{DATA_HEADER_LEN, DATA_MAGIC, RECORD_LEN, RECORD_MAGIC};
pub use manifest::{
    AllocationRecord, CheckpointPath, ChunkEntry, Codec, FileEntry, GpuRecord, MANIFEST_MAGIC,
    MAX_MANIFEST_BODY, Manifest, encode_manifest_unchecked, read_manifest, write_manifest,
};
pub use names::{
    ImageFileKind, STATS_FILE_NAME, data_file_name, list_image_files, list_manifests,
    manifest_file_name, manifest_tmp_name, parse_file_name, remove_process_files,
};
pub use reader::{DataFileReader, DataFileScan, VerifyReport, scan_data_file, verify_image};
pub use stats::{MAX_STATS_LEN, read_stats, write_stats};
pub use validate::validate_manifest_structure;
pub use writer::DataFileWriter;

/// The version written into every data-file header and manifest. Readers accept only this one.
pub const FORMAT_VERSION: u32 = 1;

/// Largest chunk (before and after compression) that writers produce and readers accept: 1 GiB.
pub const MAX_CHUNK_LEN: u64 = 1 << 30;
