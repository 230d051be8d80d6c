//! The small fixtures every test crate of the workspace shares: a throwaway directory
//! ([`TempDir`]), a size-limited file system ([`Tmpfs`]), and a command's output as one text.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicU32, Ordering};

/// A fresh directory `gpusnap-<tag>-<pid>-<n>`, removed on drop, with an open fd on it.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
    fd: File,
}

impl TempDir {
    /// Under the system temp dir.
    pub fn new(tag: &str) -> TempDir {
        TempDir::new_in(&std::env::temp_dir(), tag)
    }

    /// Directly under `/tmp`, whatever `TMPDIR` says: for a socket path, which must fit
    /// `sun_path`.
    pub fn short(tag: &str) -> TempDir {
        TempDir::new_in(Path::new("/tmp"), tag)
    }

    fn new_in(parent: &Path, tag: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let path = parent.join(format!(
            "gpusnap-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        let fd = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(&path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        TempDir { path, fd }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path as a string, for command-line arguments.
    pub fn path_str(&self) -> &str {
        self.path.to_str().expect("temp dir path is UTF-8")
    }

    /// An fd on the directory (`O_DIRECTORY`), for the `*at` calls.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// `name` inside the directory.
    pub fn file(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// A tmpfs of a given size mounted on a directory (root); unmounted on drop (lazily if still
/// busy).
#[derive(Debug)]
pub struct Tmpfs(CString);

impl Tmpfs {
    /// Creates `dir` and mounts a tmpfs of `size` (`mount -o size=`: `8m`, `24m`) on it; panics
    /// if the mount fails.
    pub fn mount(dir: &Path, size: &str) -> Tmpfs {
        fs::create_dir_all(dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let target = CString::new(dir.as_os_str().as_bytes()).expect("path without NUL");
        let opts = CString::new(format!("size={size},mode=0700")).expect("options");
        // SAFETY: every pointer is a valid NUL-terminated string that outlives the call.
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        assert_eq!(
            rc,
            0,
            "mount -t tmpfs -o size={size} on {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        );
        Tmpfs(target)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // SAFETY: a valid NUL-terminated path.
        if unsafe { libc::umount2(self.0.as_ptr(), 0) } != 0 {
            // SAFETY: as above.
            unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// A command's stdout, then its stderr, as one (lossy UTF-8) text.
pub fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
