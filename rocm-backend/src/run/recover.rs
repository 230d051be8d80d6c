//! `gpusnap recover PID` of an AMD process: after a dump cut short (CRIU killed while the
//! process's queues were paused), its GPU queues stay stopped while its device memory is in
//! place (an AMD dump never releases memory). Recovering it is one UNPAUSE on its own KFD file,
//! made as its tracer (the kernel's rule for CRIU ioctls on another process's file).

use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

use crate::kfd::KfdError;
use crate::kfd::criu;
use crate::kfd::device::{DeviceFile, KfdDevice};
use gpusnap_proto::{ForeignFd, pidfd_getfd, pidfd_open};

use gpusnap_host::pid::HostPid;
use gpusnap_host::procfs;
use gpusnap_host::ptrace::SeizedProcess;

/// Why an AMD process could not be recovered.
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error("pid {pid}: {source}")]
    Proc {
        pid: HostPid,
        #[source]
        source: io::Error,
    },
    #[error("cannot seize pid {pid} ({source}); is another tracer (CRIU?) still attached?")]
    Seize {
        pid: HostPid,
        #[source]
        source: io::Error,
    },
    #[error("copying KFD file {fd} out of pid {pid}: {source}")]
    GetFd {
        pid: HostPid,
        fd: ForeignFd,
        #[source]
        source: io::Error,
    },
    #[error("pid {pid}: {source}; its GPU queues stay stopped")]
    Unpause {
        pid: HostPid,
        #[source]
        source: KfdError,
    },
}

/// What [`recover`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Recovered {
    /// Its queues were paused; they run again.
    Unpaused,
    /// Its queues were not paused: nothing to recover.
    Running,
}

/// The descriptor number of a KFD file `pid` holds, if any.
pub fn kfd_fd_of(dev: &dyn KfdDevice, pid: HostPid) -> Result<Option<ForeignFd>, RecoverError> {
    let fds = procfs::fd_numbers(pid).map_err(|source| RecoverError::Proc { pid, source })?;
    Ok(fds.into_iter().find(|&fd| {
        let Ok(meta) = procfs::fd_metadata(pid, fd) else {
            return false;
        };
        let ft = meta.file_type();
        if !(ft.is_char_device() || (dev.block_nodes() && ft.is_block_device())) {
            return false;
        }
        procfs::fd_target(pid, fd)
            .is_ok_and(|path| dev.classify(&path, meta.rdev()) == Some(DeviceFile::Kfd))
    }))
}

/// UNPAUSEs the process `pid` if its queues are paused. `Ok(None)`: it holds no KFD file (not
/// an AMD GPU process this host's KFD knows).
pub fn recover(pid: HostPid) -> Result<Option<Recovered>, RecoverError> {
    let Some(dev) = super::kfd_device() else {
        return Ok(None);
    };
    let Some(fd) = kfd_fd_of(dev.as_ref(), pid)? else {
        return Ok(None);
    };
    let seized = SeizedProcess::seize(pid).map_err(|source| RecoverError::Seize { pid, source })?;
    let pidfd = pidfd_open(pid).map_err(|source| RecoverError::Proc { pid, source })?;
    let kfd =
        pidfd_getfd(pidfd.as_fd(), fd).map_err(|source| RecoverError::GetFd { pid, fd, source })?;
    let r = match criu::unpause(dev.as_ref(), kfd.as_fd()) {
        Ok(()) => Ok(Some(Recovered::Unpaused)),
        Err(KfdError::Ioctl { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
            Ok(Some(Recovered::Running))
        }
        Err(source) => Err(RecoverError::Unpause { pid, source }),
    };
    drop(kfd);
    drop(seized);
    r
}
