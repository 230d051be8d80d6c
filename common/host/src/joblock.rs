//! One gpusnap operation at a time per job. A dump, a `gpusnap recover` or a pre-copy round
//! of a GPU process takes an exclusive `flock` on a file named by the process's host pid and
//! start time (so a reused pid is another job), before any driver call, and holds it for as
//! long as it works on the process. The lock belongs to the open file of CRIU's (or the CLI's)
//! process: the kernel drops it when that process dies, so a crashed CRIU never leaves a job
//! locked out. A second operation is refused at once, before it touches anything: two CRIUs
//! that both lock the driver and both roll back strand the job (found in CI with two
//! `criu dump -R` started together).

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

use crate::pid::HostPid;

/// Where the lock files live (root's; created 0700 when missing).
pub const LOCK_DIR: &str = "/run/gpusnap/jobs";

#[derive(Debug, thiserror::Error)]
pub enum JobLockError {
    #[error(
        "another gpusnap operation (a dump, `gpusnap recover` or a pre-copy round) is working on this process now; refusing a second one before anything is touched: wait for the first to end, then try again"
    )]
    Busy { pid: HostPid },
    #[error("pid {pid}: reading its start time: {err}")]
    Proc { pid: HostPid, err: io::Error },
    #[error("the job lock {path}: {err}")]
    Io { path: String, err: io::Error },
}

/// The lock of one job, held until dropped (then its file is removed).
#[derive(Debug)]
pub struct JobLock {
    file: std::fs::File,
    path: PathBuf,
}

impl JobLock {
    /// Takes the lock of `pid`, or says another operation holds it. Never waits.
    pub fn take(pid: HostPid) -> Result<JobLock, JobLockError> {
        Self::take_in(&PathBuf::from(LOCK_DIR), pid)
    }

    fn take_in(dir: &std::path::Path, pid: HostPid) -> Result<JobLock, JobLockError> {
        let (_, start) =
            crate::procfs::state_and_start(pid).map_err(|err| JobLockError::Proc { pid, err })?;
        let io = |path: &std::path::Path| {
            let path = path.display().to_string();
            move |err| JobLockError::Io { path, err }
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io(dir))?;
        let path = dir.join(format!("{pid}-{start}.lock"));
        // The file is unlinked by the holder that drops it; one opened just before that is
        // another file than the one at the path now, so whoever locked it tries again.
        loop {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .mode(0o600)
                .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
                .open(&path)
                .map_err(io(&path))?;
            // SAFETY: flock on a descriptor this function owns; no memory is passed.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let err = io::Error::last_os_error();
                return Err(match err.raw_os_error() {
                    Some(libc::EWOULDBLOCK) => JobLockError::Busy { pid },
                    _ => JobLockError::Io {
                        path: path.display().to_string(),
                        err,
                    },
                });
            }
            let ours = file.metadata().map_err(io(&path))?;
            match std::fs::symlink_metadata(&path) {
                Ok(now) if (now.dev(), now.ino()) == (ours.dev(), ours.ino()) => {
                    return Ok(JobLock { file, path });
                }
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io(&path)(e)),
            }
        }
    }
}

impl Drop for JobLock {
    fn drop(&mut self) {
        // Unlinked while still locked: a waiter that opened it sees another file at the path.
        let _ = std::fs::remove_file(&self.path);
        let _ = &self.file;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_operation_on_one_job_is_refused_until_the_first_ends() {
        let dir = std::env::temp_dir().join(format!("gpusnap-joblock-{}", std::process::id()));
        let me = HostPid(std::process::id() as i32);
        let first = JobLock::take_in(&dir, me).unwrap();
        let e = JobLock::take_in(&dir, me).unwrap_err();
        assert!(matches!(e, JobLockError::Busy { .. }), "{e}");
        assert!(e.to_string().contains("before anything is touched"), "{e}");
        drop(first);
        let again = JobLock::take_in(&dir, me).unwrap();
        drop(again);
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "lock files left"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_lock_is_dropped_with_its_process() {
        // A child takes the lock and dies without unlocking: the kernel releases it.
        let dir = std::env::temp_dir().join(format!("gpusnap-joblock-kill-{}", std::process::id()));
        let me = HostPid(std::process::id() as i32);
        // SAFETY: fork in a test; the child only takes the lock and exits with _exit.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let l = JobLock::take_in(&dir, me);
            std::mem::forget(l);
            // SAFETY: ends the forked child without running the parent's destructors.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        unsafe { libc::waitpid(child, &mut status, 0) };
        JobLock::take_in(&dir, me).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
