//! `gpusnap-stats.json`: free-form run statistics the plugin leaves next to the images.

use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;

use crate::manifest::atomic_write;
use crate::names::{STATS_FILE_NAME, STATS_TMP_NAME};
use crate::{ImageError, IoOp, sys};

/// Largest stats file [`read_stats`] accepts.
pub const MAX_STATS_LEN: u64 = 16 << 20;

/// Writes `v` (pretty-printed) as `gpusnap-stats.json`, mode 0600, atomically (temp + rename).
pub fn write_stats(dir: BorrowedFd<'_>, v: &serde_json::Value) -> Result<(), ImageError> {
    let mut bytes = serde_json::to_vec_pretty(v).map_err(|source| ImageError::StatsJson {
        file: STATS_FILE_NAME.to_owned(),
        source,
    })?;
    bytes.push(b'\n');
    atomic_write(dir, STATS_FILE_NAME, STATS_TMP_NAME, &bytes)
}

/// Reads `gpusnap-stats.json`; `Ok(None)` if there is none.
pub fn read_stats(dir: BorrowedFd<'_>) -> Result<Option<serde_json::Value>, ImageError> {
    let name = STATS_FILE_NAME;
    let (file, len) = match sys::open_regular(dir, name) {
        Ok(f) => f,
        Err(ImageError::MissingFile { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    if len > MAX_STATS_LEN {
        return Err(ImageError::StatsTooLarge {
            file: name.to_owned(),
            len,
        });
    }
    let mut buf = vec![0u8; len as usize];
    file.read_exact_at(&mut buf, 0)
        .map_err(|e| ImageError::io(name, IoOp::Read, e))?;
    serde_json::from_slice(&buf)
        .map(Some)
        .map_err(|source| ImageError::StatsJson {
            file: name.to_owned(),
            source,
        })
}
