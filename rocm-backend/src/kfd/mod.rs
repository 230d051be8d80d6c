//! The KFD CRIU interface, as thin safe calls over [`sys`].
//!
//! How the kernel (`kfd_chardev.c`) decides which process an op acts on matters here:
//!
//! - PROCESS_INFO, CHECKPOINT, UNPAUSE and RESTORE act on the process that **opened** the
//!   `/dev/kfd` file the ioctl is made on, never on a pid. CRIU makes them on the target's own
//!   KFD fd (drained from the target), which the kernel allows because CRIU is the target's
//!   ptrace parent (the kernel lets a KFD file of another process be used only while that
//!   process is ptraced). Use [`Kfd::from_fd`] for that fd.
//! - RESUME acts on the process named by `pid`, and may be made on any KFD fd ([`Kfd::open`]).
//! - Every CRIU op needs `CAP_CHECKPOINT_RESTORE` or `CAP_SYS_ADMIN`, else `EACCES`.
//!
//! The ops themselves are in [`criu`], written once against [`device::KfdDevice`]; [`Kfd`] is
//! what detection uses (open, GET_VERSION). None of this has been run against a real KFD: the
//! build machine has no AMD GPU.

pub mod criu;
pub mod device;
pub mod standin;
pub mod sys;
pub mod vma;

#[cfg(test)]
mod header_check;

use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use gpusnap_host::pid::NsPid;
use sys::KfdCriuOp;

/// Errors of the KFD calls, each with what the errno most likely means for that call.
#[derive(Debug, thiserror::Error)]
pub enum KfdError {
    /// The device node does not exist: the amdgpu driver (with KFD) is not loaded.
    #[error("{} does not exist (amdgpu KFD driver not loaded)", path.display())]
    NoDevice { path: PathBuf },

    /// The device node exists but could not be opened.
    #[error("cannot open {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// An ioctl failed.
    #[error("KFD {op} failed: {source}{}", errno_hint(.op, .source))]
    Ioctl {
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

fn errno_hint(op: &str, err: &io::Error) -> &'static str {
    match (op, err.raw_os_error().unwrap_or(0)) {
        (_, libc::ENOTTY) => " (not a KFD device, or a kernel without this ioctl)",
        (_, libc::EACCES) => " (needs CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN)",
        (_, libc::EBADF) => {
            " (the KFD fd belongs to another process and the caller is not its ptrace parent)"
        }
        ("PROCESS_INFO", libc::ENODEV) => " (the process uses no GPU through this fd)",
        ("UNPAUSE", libc::EINVAL) => " (the process's queues were not paused)",
        ("RESUME", libc::ESRCH) => " (no KFD process with that pid)",
        _ => "",
    }
}

/// A KFD ioctl interface version (`AMDKFD_IOC_GET_VERSION`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KfdVersion {
    pub major: u32,
    pub minor: u32,
}

impl KfdVersion {
    /// Whether CRIU can checkpoint through this interface (>= 1.8).
    pub fn supports_criu(self) -> bool {
        (self.major, self.minor) >= sys::KFD_CRIU_MIN_VERSION
    }
}

impl fmt::Display for KfdVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// What PROCESS_INFO reports: the sizes CHECKPOINT will fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessInfo {
    /// The process's pid in its own pid namespace (which, in a container, is not CRIU's view).
    pub pid: NsPid,
    pub num_devices: u32,
    pub num_bos: u32,
    /// Queues, events and SVM ranges, opaque to user space.
    pub num_objects: u32,
    pub priv_data_size: u64,
}

/// An open KFD file.
#[derive(Debug)]
pub struct Kfd {
    fd: OwnedFd,
}

impl Kfd {
    /// Opens [`sys::KFD_DEVICE`] read-write, close-on-exec.
    pub fn open() -> Result<Kfd, KfdError> {
        Kfd::open_path(Path::new(sys::KFD_DEVICE))
    }

    /// Opens a KFD device node at `path`.
    pub fn open_path(path: &Path) -> Result<Kfd, KfdError> {
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
        {
            Ok(file) => Ok(Kfd { fd: file.into() }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(KfdError::NoDevice {
                path: path.to_owned(),
            }),
            Err(source) => Err(KfdError::Open {
                path: path.to_owned(),
                source,
            }),
        }
    }

    /// Wraps a KFD fd obtained elsewhere, typically the target's, drained by CRIU.
    pub fn from_fd(fd: OwnedFd) -> Kfd {
        Kfd { fd }
    }

    /// The KFD ioctl interface version.
    pub fn version(&self) -> Result<KfdVersion, KfdError> {
        use device::KfdDevice;
        device::RealKfd.version(self.fd.as_fd())
    }
}

impl AsFd for Kfd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

pub(crate) fn op_name(op: KfdCriuOp) -> &'static str {
    match op {
        KfdCriuOp::ProcessInfo => "PROCESS_INFO",
        KfdCriuOp::Checkpoint => "CHECKPOINT",
        KfdCriuOp::Unpause => "UNPAUSE",
        KfdCriuOp::Restore => "RESTORE",
        KfdCriuOp::Resume => "RESUME",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_order() {
        let v = |major, minor| KfdVersion { major, minor };
        assert!(!v(1, 7).supports_criu());
        assert!(v(1, 8).supports_criu());
        assert!(v(1, 11).supports_criu());
        assert!(v(2, 0).supports_criu());
        assert_eq!(v(1, 11).to_string(), "1.11");
    }

    #[test]
    fn missing_device_is_no_device() {
        let err = Kfd::open_path(Path::new("/nonexistent/kfd")).unwrap_err();
        assert!(matches!(err, KfdError::NoDevice { .. }), "{err}");
    }

    #[test]
    fn ioctls_on_a_non_kfd_file_fail_cleanly() {
        // /dev/null accepts open(O_RDWR) and answers every ioctl with ENOTTY.
        let kfd = Kfd::open_path(Path::new("/dev/null")).unwrap();
        let err = kfd.version().unwrap_err();
        assert!(err.to_string().contains("not a KFD device"), "{err}");
        let KfdError::Ioctl { op, source } = &err else {
            panic!("{err}")
        };
        assert_eq!(*op, "GET_VERSION");
        assert_eq!(source.raw_os_error(), Some(libc::ENOTTY));
    }

    #[test]
    fn hints() {
        let e = |n| io::Error::from_raw_os_error(n);
        assert!(errno_hint("CHECKPOINT", &e(libc::EACCES)).contains("CAP_CHECKPOINT_RESTORE"));
        assert!(errno_hint("PROCESS_INFO", &e(libc::ENODEV)).contains("no GPU"));
        assert_eq!(errno_hint("RESTORE", &e(libc::ENOMEM)), "");
    }
}
