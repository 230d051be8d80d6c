//! The KFD CRIU interface, as thin safe calls over [`sys`].
//!
//! How the kernel (`kfd_chardev.c`) decides which process an op acts on matters here:
//!
//! - PROCESS_INFO, CHECKPOINT, UNPAUSE and RESTORE act on the process that **opened** the
//!   `/dev/kfd` file the ioctl is made on, never on a pid. CRIU makes them on the target's own
//!   KFD fd (drained from the target), which the kernel allows because CRIU is the target's
//!   ptrace parent. Use [`Kfd::from_fd`] for that fd.
//! - RESUME acts on the process named by `pid`, and may be made on any KFD fd ([`Kfd::open`]).
//! - Every CRIU op needs `CAP_CHECKPOINT_RESTORE` or `CAP_SYS_ADMIN`, else `EACCES`.
//!
//! None of this has been run against a real KFD: the build machine has no AMD GPU.

pub mod criu;
pub mod device;
pub mod standin;
pub mod sys;

#[cfg(test)]
mod header_check;

use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use sys::{KfdCriuOp, KfdIoctlCriuArgs, KfdIoctlGetVersionArgs};

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
    pub pid: u32,
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
        let mut args = KfdIoctlGetVersionArgs::default();
        // SAFETY: GET_VERSION takes a `KfdIoctlGetVersionArgs`, which holds no pointers. It has
        // no side effect, so retrying on EINTR is safe.
        unsafe {
            sys::ioctl(
                self.fd.as_fd(),
                sys::AMDKFD_IOC_GET_VERSION,
                &mut args,
                true,
            )
        }
        .map_err(|source| KfdError::Ioctl {
            op: "GET_VERSION",
            source,
        })?;
        Ok(KfdVersion {
            major: args.major_version,
            minor: args.minor_version,
        })
    }

    /// A CRIU op whose arguments carry no user pointers.
    fn criu_op(&self, op: KfdCriuOp, pid: u32) -> Result<KfdIoctlCriuArgs, KfdError> {
        let mut args = KfdIoctlCriuArgs {
            op: op as u32,
            pid,
            ..Default::default()
        };
        // SAFETY: CRIU_OP takes a `KfdIoctlCriuArgs`. Its user pointers (devices, bos,
        // priv_data) are all null, which the ops used here (PROCESS_INFO, UNPAUSE, RESUME) do not
        // dereference. No retry on EINTR: these ops change the process's state, so an
        // interrupted one is reported rather than repeated.
        unsafe { sys::ioctl(self.fd.as_fd(), sys::AMDKFD_IOC_CRIU_OP, &mut args, false) }.map_err(
            |source| KfdError::Ioctl {
                op: op_name(op),
                source,
            },
        )?;
        Ok(args)
    }

    /// PROCESS_INFO: pauses (evicts) the queues of the process that opened this fd and reports
    /// the sizes a checkpoint needs. The queues stay paused until the returned guard is unpaused
    /// or dropped. On failure the kernel has already restored the queues.
    pub fn process_info(&self) -> Result<PausedProcess<'_>, KfdError> {
        let args = self.criu_op(KfdCriuOp::ProcessInfo, 0)?;
        Ok(PausedProcess {
            kfd: self,
            info: ProcessInfo {
                pid: args.pid,
                num_devices: args.num_devices,
                num_bos: args.num_bos,
                num_objects: args.num_objects,
                priv_data_size: args.priv_data_size,
            },
            unpaused: false,
        })
    }

    /// UNPAUSE: restores the queues a PROCESS_INFO on this fd paused. Prefer
    /// [`PausedProcess::unpause`]; this is for a pause made by another holder of the same file.
    pub fn unpause(&self) -> Result<(), KfdError> {
        self.criu_op(KfdCriuOp::Unpause, 0).map(drop)
    }

    /// RESUME: after restore, starts MMU notifiers and queues of the KFD process `pid` (as seen
    /// from the caller's pid namespace).
    pub fn resume(&self, pid: u32) -> Result<(), KfdError> {
        self.criu_op(KfdCriuOp::Resume, pid).map(drop)
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

/// A process whose GPU queues PROCESS_INFO has paused. Dropping it unpauses them (and logs a
/// failure); [`PausedProcess::unpause`] does so and reports the result. CHECKPOINT, which must
/// happen while paused, is not implemented yet.
#[derive(Debug)]
pub struct PausedProcess<'a> {
    kfd: &'a Kfd,
    info: ProcessInfo,
    unpaused: bool,
}

impl PausedProcess<'_> {
    pub fn info(&self) -> &ProcessInfo {
        &self.info
    }

    /// Restores the queues.
    pub fn unpause(mut self) -> Result<(), KfdError> {
        self.unpaused = true;
        self.kfd.unpause()
    }
}

impl Drop for PausedProcess<'_> {
    fn drop(&mut self) {
        if !self.unpaused
            && let Err(e) = self.kfd.unpause()
        {
            log::warn!(
                "gpusnap-rocm: could not unpause GPU queues of pid {}: {e}",
                self.info.pid
            );
        }
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
        let err = kfd.process_info().unwrap_err();
        let KfdError::Ioctl { op, source } = &err else {
            panic!("{err}")
        };
        assert_eq!(*op, "PROCESS_INFO");
        assert_eq!(source.raw_os_error(), Some(libc::ENOTTY));
        assert!(kfd.unpause().is_err());
        assert!(kfd.resume(1).is_err());
    }

    #[test]
    fn hints() {
        let e = |n| io::Error::from_raw_os_error(n);
        assert!(errno_hint("CHECKPOINT", &e(libc::EACCES)).contains("CAP_CHECKPOINT_RESTORE"));
        assert!(errno_hint("PROCESS_INFO", &e(libc::ENODEV)).contains("no GPU"));
        assert_eq!(errno_hint("RESTORE", &e(libc::ENOMEM)), "");
    }
}
