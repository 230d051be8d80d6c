//! NVIDIA device files held without CUDA state the driver can checkpoint (an NVML user's
//! `/dev/nvidiactl`, fds inherited over `fork`). CRIU cannot dump such a file itself: at dump
//! its path and open flags are recorded (`DUMP_EXT_FILE`), at restore it is opened again in the
//! restored task (`RESTORE_EXT_FILE`). Processes with CUDA state hold none after the driver
//! checkpoint, so this only concerns processes gpusnap did not checkpoint through the driver.

use gpusnap_image::{DevFileRecord, ImageError};
use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// The path and flags of `fd` if it is an NVIDIA device node.
pub fn describe(fd: BorrowedFd<'_>) -> Option<DevFileRecord> {
    let fd = fd.as_raw_fd();
    // SAFETY: fstat on a borrowed (so open) fd, into a zeroed stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFCHR {
        return None;
    }
    let path = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    let path = path.to_str()?.to_owned();
    if !gpusnap_image::is_nvidia_device_path(&path) {
        return None;
    }
    // SAFETY: F_GETFL on a valid fd.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return None;
    }
    Some(DevFileRecord {
        path,
        flags: flags & (libc::O_ACCMODE | libc::O_NONBLOCK),
    })
}

/// DUMP_EXT_FILE: `Ok(false)` when the file is not ours. With `durable`, the image directory
/// is fsynced after the record's rename (its bytes are fsynced before it).
pub fn dump(
    dir: BorrowedFd<'_>,
    fd: BorrowedFd<'_>,
    id: u32,
    durable: bool,
) -> Result<bool, ImageError> {
    let Some(rec) = describe(fd) else {
        return Ok(false);
    };
    gpusnap_image::write_dev_file(dir, id, &rec)?;
    if durable {
        gpusnap_host::fault::sync_dir(dir)?;
    }
    log::info!(
        "file {id}: {} held open without CUDA state; recorded, it is opened again at restore",
        rec.path
    );
    Ok(true)
}

/// Why a recorded device file cannot be opened again.
#[derive(Debug, thiserror::Error)]
pub enum DevFileError {
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("the recorded path {path:?} holds a NUL byte")]
    Nul { path: String },
    #[error(
        "cannot open {path} again ({source}): the process held it at dump time; is the NVIDIA driver loaded here?"
    )]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// RESTORE_EXT_FILE, in the restored task: the new fd, `Ok(None)` when the file is not ours.
pub fn restore(dir: BorrowedFd<'_>, id: u32) -> Result<Option<OwnedFd>, DevFileError> {
    let rec = match gpusnap_image::read_dev_file(dir, id) {
        Ok(r) => r,
        Err(ImageError::MissingFile { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let path = CString::new(rec.path.clone()).map_err(|_| DevFileError::Nul {
        path: rec.path.clone(),
    })?;
    // SAFETY: open(2) with a NUL-terminated path checked to be an NVIDIA device node.
    let fd = unsafe { libc::open(path.as_ptr(), rec.flags) };
    if fd < 0 {
        return Err(DevFileError::Open {
            path: rec.path,
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: open(2) just returned `fd`; nothing else owns it.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn ordinary_files_are_not_ours() {
        let f = std::fs::File::open("/dev/null").unwrap();
        assert!(super::describe(std::os::fd::AsFd::as_fd(&f)).is_none());
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert!(super::describe(std::os::fd::AsFd::as_fd(&f)).is_none());
    }
}
