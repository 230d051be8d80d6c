//! Reading the configuration file: regular files only, and at most [`MAX_FILE_BYTES`] of them.
//!
//! A hostile or mistaken `GPUSNAP_CONFIG` must not hang or balloon CRIU: `/dev/zero` used to be
//! read until the kernel killed CRIU, and a FIFO blocked it in `open()` forever. Symlinks are
//! followed (a symlinked `/etc` file is normal); what counts is the file finally opened, checked
//! with `fstat` on the open descriptor so that swapping the path in between cannot slip a device
//! or a FIFO past the check. The path is also checked with `stat` before opening, so that a
//! device is refused without being opened (opening some devices has effects of its own).
//!
//! The one file that is not regular and is still read is the null device (`/dev/null`, or any
//! path to character device 1:3): it reads as empty, and `GPUSNAP_CONFIG=/dev/null` is the
//! documented way to ignore the default file.

use std::fs::{File, FileType, Metadata, OpenOptions};
use std::io::Read as _;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::Path;

use crate::error::ConfigError;

/// The largest configuration file read. Every key with a long comment is about 4 KiB.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// The text of the configuration file at `path`. A file that does not exist is
/// [`ConfigError::Read`] with [`std::io::ErrorKind::NotFound`]; the caller decides whether that
/// means "defaults".
pub(crate) fn read(path: &Path) -> Result<String, ConfigError> {
    let read_error = |source| ConfigError::Read {
        path: path.to_owned(),
        source,
    };
    // Refuse a device, FIFO or directory before opening it; the check after opening is the one
    // that counts.
    check_kind(path, &std::fs::metadata(path).map_err(read_error)?)?;
    // O_NONBLOCK: should the path have become a FIFO since the check, open() returns at once
    // instead of waiting for a writer. O_NOCTTY: a terminal does not become CRIU's controlling
    // terminal. O_CLOEXEC (std sets it anyway): the descriptor does not leak into CRIU's
    // children.
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .map_err(read_error)?;
    let opened = file.metadata().map_err(read_error)?;
    check_kind(path, &opened)?;
    if opened.len() > MAX_FILE_BYTES {
        return Err(too_large(path));
    }
    read_capped(&mut file, path)
}

/// Reads at most `MAX_FILE_BYTES + 1` bytes, so a file that grows while it is read cannot
/// balloon memory either.
fn read_capped(file: &mut File, path: &Path) -> Result<String, ConfigError> {
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large(path));
    }
    String::from_utf8(bytes).map_err(|e| ConfigError::Read {
        path: path.to_owned(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "not valid UTF-8 (first bad byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        ),
    })
}

fn too_large(path: &Path) -> ConfigError {
    ConfigError::TooLarge {
        path: path.to_owned(),
        max_bytes: MAX_FILE_BYTES,
    }
}

fn check_kind(path: &Path, metadata: &Metadata) -> Result<(), ConfigError> {
    let file_type = metadata.file_type();
    if file_type.is_file() || is_null_device(metadata) {
        return Ok(());
    }
    Err(ConfigError::NotRegular {
        path: path.to_owned(),
        what: describe(file_type),
    })
}

fn is_null_device(metadata: &Metadata) -> bool {
    metadata.file_type().is_char_device() && metadata.rdev() == libc::makedev(1, 3)
}

/// What a file that is not regular is, as "is ..." continues.
fn describe(file_type: FileType) -> &'static str {
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_fifo() {
        "a FIFO (named pipe)"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "of an unknown file type"
    }
}
