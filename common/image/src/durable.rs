//! Making an image durable (`durable = true`): the `fsync` of the image directory that must
//! follow the last file created or renamed in it. Data files are synced by their writer
//! ([`crate::DataFileWriter::set_sync`]); a manifest's bytes are always synced before its rename.

use std::os::fd::BorrowedFd;

use crate::{ImageError, IoOp, sys};

/// How [`sync_dir`]'s errors name the directory.
pub const IMAGE_DIR: &str = "image directory";

/// `fsync` of the image directory: every name created, renamed or removed in it so far is on
/// stable storage when this returns `Ok`. It syncs a descriptor of its own, opened for reading,
/// so it works whatever `dir` is (an `O_PATH` descriptor cannot be synced itself). Errors, named
/// [`IMAGE_DIR`], are for the caller to fail on: after a failed `fsync` nothing says what reached
/// the disk.
pub fn sync_dir(dir: BorrowedFd<'_>) -> Result<(), ImageError> {
    let own = sys::open_at(dir, ".", libc::O_RDONLY | libc::O_DIRECTORY, 0)
        .map_err(|e| ImageError::io(IMAGE_DIR, IoOp::Open, e))?;
    own.sync_all()
        .map_err(|e| ImageError::io(IMAGE_DIR, IoOp::Fsync, e))
}
