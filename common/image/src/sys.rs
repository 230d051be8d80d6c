//! Small, exact wrappers over the `*at` system calls on the image directory.
//!
//! Every call retries on `EINTR` and preserves `errno` in the returned `io::Error`. Files are
//! opened with `O_CLOEXEC` (CRIU forks helpers) and `O_NOFOLLOW` (an image directory can come from
//! an archive; a symlink in it must not redirect a write or a read).

use crate::{ImageError, IoOp};
use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};

/// Mode of every file gpusnap creates: the images hold process memory.
pub(crate) const FILE_MODE: libc::mode_t = 0o600;

fn c_name(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Runs `f` until it returns something other than -1/`EINTR`.
fn retry<T: PartialOrd + Default>(mut f: impl FnMut() -> T) -> io::Result<T> {
    loop {
        let r = f();
        if r >= T::default() {
            return Ok(r);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `openat(dir, name, flags | O_CLOEXEC | O_NOFOLLOW, mode)`.
pub(crate) fn open_at(
    dir: BorrowedFd<'_>,
    name: &str,
    flags: libc::c_int,
    mode: libc::mode_t,
) -> io::Result<File> {
    let c = c_name(name)?;
    let flags = flags | libc::O_CLOEXEC | libc::O_NOFOLLOW;
    let fd = retry(|| {
        // SAFETY: `c` is a NUL-terminated string that lives across the call, `dir` is an open
        // descriptor borrowed for the call, and the mode is passed as the promoted `c_uint`
        // the variadic `openat` reads when O_CREAT is set.
        unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags, libc::c_uint::from(mode)) }
    })?;
    // SAFETY: `openat` just returned this descriptor; nothing else owns it.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Opens the directory `name` in `dir`, following a symlink (the one place gpusnap does: CRIU's
/// `parent` link is a symlink by design). `O_DIRECTORY` refuses anything but a directory.
pub(crate) fn open_dir_follow(dir: BorrowedFd<'_>, name: &str) -> io::Result<File> {
    let c = c_name(name)?;
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
    let fd = retry(|| {
        // SAFETY: `c` is NUL-terminated and outlives the call; `dir` is an open descriptor; no
        // mode is passed because O_CREAT is not set.
        unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags) }
    })?;
    // SAFETY: `openat` just returned this descriptor; nothing else owns it.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The target of the symlink `name` in `dir`, if it is one (for messages only).
pub(crate) fn read_link_at(dir: BorrowedFd<'_>, name: &str) -> Option<String> {
    let c = c_name(name).ok()?;
    let mut buf = [0u8; 4096];
    // SAFETY: `c` is NUL-terminated, `buf` is a live buffer of the length passed; readlinkat
    // writes at most that many bytes and does not NUL-terminate.
    let n = unsafe {
        libc::readlinkat(
            dir.as_raw_fd(),
            c.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    let n = usize::try_from(n).ok()?;
    Some(String::from_utf8_lossy(&buf[..n.min(buf.len())]).into_owned())
}

/// Opens an existing file for reading. `O_NONBLOCK` keeps a FIFO planted under an image name from
/// blocking the open; it has no effect on the regular files we go on to accept.
pub(crate) fn open_read(dir: BorrowedFd<'_>, name: &str) -> io::Result<File> {
    open_at(dir, name, libc::O_RDONLY | libc::O_NONBLOCK, 0)
}

/// Opens `name` for reading and checks that it is a regular file (not a directory, FIFO or
/// device planted under an image name); returns it with its size.
pub(crate) fn open_regular(dir: BorrowedFd<'_>, name: &str) -> Result<(File, u64), ImageError> {
    let file = open_read(dir, name).map_err(|e| ImageError::open(name, e))?;
    let meta = file
        .metadata()
        .map_err(|e| ImageError::io(name, IoOp::Fstat, e))?;
    if !meta.is_file() {
        return Err(ImageError::NotRegularFile {
            file: name.to_owned(),
        });
    }
    Ok((file, meta.len()))
}

/// Creates `name` afresh with mode 0600: a stale file of that name is unlinked first, then the
/// file is created with `O_EXCL`, so an existing file (or symlink) is never written through.
pub(crate) fn create_fresh(dir: BorrowedFd<'_>, name: &str) -> io::Result<File> {
    unlink_at(dir, name, true)?;
    open_at(
        dir,
        name,
        libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
        FILE_MODE,
    )
}

/// `unlinkat(dir, name, 0)`; with `missing_ok`, a name that does not exist is not an error.
pub(crate) fn unlink_at(dir: BorrowedFd<'_>, name: &str, missing_ok: bool) -> io::Result<()> {
    let c = c_name(name)?;
    let r = retry(|| {
        // SAFETY: `c` is NUL-terminated and outlives the call; `dir` is an open descriptor.
        unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) }
    });
    match r {
        Err(e) if missing_ok && e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(_) => Ok(()),
    }
}

/// Gives the unnamed file `file` (`O_TMPFILE`, opened without `O_EXCL`) the name `name` in
/// `dir`: `linkat(fd, "", dir, name, AT_EMPTY_PATH)`, which needs `CAP_DAC_READ_SEARCH`; without
/// it (`ENOENT` or `EPERM`), through the file's `/proc/self/fd` link (`AT_SYMLINK_FOLLOW`).
pub(crate) fn link_unnamed(file: &File, dir: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    let c = c_name(name)?;
    let empty = c"";
    let r = retry(|| {
        // SAFETY: both names are NUL-terminated and outlive the call; `file` and `dir` are open
        // descriptors borrowed for the call.
        unsafe {
            libc::linkat(
                file.as_raw_fd(),
                empty.as_ptr(),
                dir.as_raw_fd(),
                c.as_ptr(),
                libc::AT_EMPTY_PATH,
            )
        }
    });
    match r {
        Ok(_) => Ok(()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EPERM)) => {
            let link = c_name(&format!("/proc/self/fd/{}", file.as_raw_fd()))?;
            retry(|| {
                // SAFETY: as above; AT_FDCWD with an absolute path.
                unsafe {
                    libc::linkat(
                        libc::AT_FDCWD,
                        link.as_ptr(),
                        dir.as_raw_fd(),
                        c.as_ptr(),
                        libc::AT_SYMLINK_FOLLOW,
                    )
                }
            })?;
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// `renameat(dir, from, dir, to)`: atomically replaces `to`.
pub(crate) fn rename_at(dir: BorrowedFd<'_>, from: &str, to: &str) -> io::Result<()> {
    let (f, t) = (c_name(from)?, c_name(to)?);
    retry(|| {
        // SAFETY: both names are NUL-terminated and outlive the call; `dir` is an open descriptor.
        unsafe { libc::renameat(dir.as_raw_fd(), f.as_ptr(), dir.as_raw_fd(), t.as_ptr()) }
    })?;
    Ok(())
}

/// `fsync` on the directory itself, so a rename is durable. Not every fd a caller holds can be
/// synced (an `O_PATH` descriptor cannot), so callers treat a failure as advisory.
pub(crate) fn fsync_dir(dir: BorrowedFd<'_>) -> io::Result<()> {
    retry(|| {
        // SAFETY: `dir` is an open descriptor borrowed for the call.
        unsafe { libc::fsync(dir.as_raw_fd()) }
    })?;
    Ok(())
}

/// Closes a `DIR*` on every exit path of [`list_dir`].
struct DirStream(*mut libc::DIR);

impl Drop for DirStream {
    fn drop(&mut self) {
        // SAFETY: the pointer came from a successful `fdopendir` and is closed exactly once here.
        unsafe { libc::closedir(self.0) };
    }
}

/// The UTF-8 names in `dir` (other than `.` and `..`), in no particular order. Names that are not
/// UTF-8 cannot be gpusnap's and are skipped.
pub(crate) fn list_dir(dir: BorrowedFd<'_>) -> io::Result<Vec<String>> {
    // A fresh descriptor of our own: its offset starts at 0 and closedir may close it.
    let own = open_at(dir, ".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    let raw = own.into_raw_fd();
    // SAFETY: `raw` is an open directory descriptor that we own; on success `fdopendir` takes
    // ownership of it (closedir closes it).
    let dirp = unsafe { libc::fdopendir(raw) };
    if dirp.is_null() {
        let e = io::Error::last_os_error();
        // SAFETY: `fdopendir` failed, so `raw` is still ours to close.
        drop(unsafe { OwnedFd::from_raw_fd(raw) });
        return Err(e);
    }
    let stream = DirStream(dirp);
    let mut names = Vec::new();
    loop {
        // SAFETY: `__errno_location` returns this thread's errno slot; clearing it lets us tell
        // the end of the directory from an error, since `readdir` returns NULL for both.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: `stream.0` is a live `DIR*` used only by this thread.
        let ent = unsafe { libc::readdir(stream.0) };
        if ent.is_null() {
            let e = io::Error::last_os_error();
            if e.raw_os_error().unwrap_or(0) != 0 {
                return Err(e);
            }
            break;
        }
        // SAFETY: `ent` points to a dirent that stays valid until the next readdir on this
        // stream, and `d_name` is NUL-terminated within it; we copy it out before that.
        let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) };
        if let Ok(s) = name.to_str()
            && s != "."
            && s != ".."
        {
            names.push(s.to_owned());
        }
    }
    Ok(names)
}

/// Asks the kernel to start writing `[offset, offset+len)` of `file` back to its disk now,
/// without waiting for it (`sync_file_range(SYNC_FILE_RANGE_WRITE)`): a durable dump's final
/// `fsync` then finds most of the file written instead of starting from the whole of it. A hint:
/// a failure here is left for that `fsync` to report.
pub(crate) fn start_writeback(file: &File, offset: u64, len: u64) {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    // SAFETY: a plain syscall on an open descriptor; no memory is passed.
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE);
    }
}
