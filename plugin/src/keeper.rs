//! The keeper process (`gpusnap-keeper`): found, started and ended here. During a split dump it
//! holds the job's device memory across the driver checkpoint (imported from the descriptors the
//! job exported) and serves the agent's copy-out, so the data drains while CRIU dumps the host
//! side ([`crate::handover`]). It has a CUDA context of its own, which CRIU's process must never
//! have: CRIU forks restored trees from itself, and CUDA is not fork-safe.
//!
//! The keeper is started with `posix_spawn` (no fork of CRIU's process), in a session of its
//! own with every signal at its default and unblocked, and speaks on one end of a socket pair.
//! It starts `--detach`ed: the process spawned here forks the keeper, sends its pid and a pidfd
//! of it, and exits at once (reaped here). So the keeper is not CRIU's child: CRIU takes the
//! exit of any child of its own while it works on the tasks for a failure, and a keeper killed
//! then could cost the job (seen in CI: CRIU then failed to cure the job of its parasite). The
//! keeper exits when the plugin closes its end; [`Keeper`]'s `Drop` waits on the pidfd for that
//! (killing it through the pidfd after a grace period).

use crate::agent::AgentSession;
use gpusnap_proto::Channel;
use std::ffi::{CString, c_char};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Where a package installs the keeper when the plugin's directory has none.
pub const INSTALLED_PATH: &str = "/usr/libexec/gpusnap/gpusnap-keeper";

/// The descriptor number of the connection in the keeper.
const KEEPER_FD: i32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    #[error(
        "no gpusnap-keeper next to the plugin ({beside}) nor at {INSTALLED_PATH}; set `keeper` in the configuration"
    )]
    NotFound { beside: String },
    #[error("keeper {path}: {why}")]
    Unusable { path: String, why: String },
    #[error("starting {path}: {err}")]
    Spawn { path: String, err: std::io::Error },
    #[error("starting {path}: it did not detach: {why}")]
    Detach { path: String, why: DetachError },
    #[error("keeper pid {pid} did not become ready: {err}")]
    NotReady {
        pid: libc::pid_t,
        err: crate::agent::AgentError,
    },
    #[error("keeper pid {pid}: its connection was already taken")]
    NoSession { pid: libc::pid_t },
}

/// Why the process that starts the keeper did not hand it over.
#[derive(Debug, thiserror::Error)]
pub enum DetachError {
    #[error("it ended with status {0:#x}")]
    Status(i32),
    #[error("waiting for it: {0}")]
    Wait(std::io::Error),
    #[error("it did not report within {0:?}")]
    TooSlow(Duration),
    #[error("it refused: {0}")]
    Refused(String),
    #[error("it answered {0}")]
    Unexpected(String),
    #[error("its report: {0}")]
    Report(gpusnap_proto::ProtoError),
}

/// How long the started process may take to fork the keeper and report it.
const DETACH_WITHIN: Duration = Duration::from_secs(5);

/// A started keeper and the session to it.
pub struct Keeper {
    pid: libc::pid_t,
    /// A pidfd of the keeper: it is not our child, so this is how we see it exit and kill it
    /// without ever signalling a pid that was reused.
    pidfd: OwnedFd,
    session: Option<AgentSession>,
}

impl Keeper {
    /// Starts the keeper binary (`configured`, or found) for the job `job_pid`, loading
    /// `libcuda` (the job's driver library) if given; it makes its context on each of `gpus`
    /// (UUIDs) at once, beside whatever CRIU does meanwhile (a restore's plan is known then).
    pub fn spawn(
        configured: &str,
        libcuda: Option<&Path>,
        gpus: &[[u8; 16]],
        job_pid: i32,
        timeout: Duration,
    ) -> Result<Self, KeeperError> {
        let path = locate(configured)?;
        let shown = path.display().to_string();
        let (ours, theirs) = Channel::pair().map_err(|err| KeeperError::Spawn {
            path: shown.clone(),
            err,
        })?;
        let mut args = vec![
            path.as_os_str().to_owned(),
            "--fd".into(),
            KEEPER_FD.to_string().into(),
            "--detach".into(),
        ];
        if let Some(l) = libcuda {
            args.push("--libcuda".into());
            args.push(l.as_os_str().to_owned());
        }
        for g in gpus {
            args.push("--gpu".into());
            args.push(
                g.iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
                    .into(),
            );
        }
        let starter =
            spawn(&path, &args, theirs.fd().as_raw_fd()).map_err(|err| KeeperError::Spawn {
                path: shown.clone(),
                err,
            })?;
        drop(theirs);
        let detach_err = |why: DetachError| KeeperError::Detach {
            path: shown.clone(),
            why,
        };
        if let Err(why) = reap_starter(starter, DETACH_WITHIN) {
            return Err(detach_err(why));
        }
        let (pid, pidfd) = match ours.recv_reply_with_fd(Some(DETACH_WITHIN)) {
            Ok((gpusnap_proto::Reply::Detached { pid }, Some(fd))) => (pid as libc::pid_t, fd),
            Ok((gpusnap_proto::Reply::Error { message, .. }, _)) => {
                return Err(detach_err(DetachError::Refused(message)));
            }
            Ok((other, _)) => {
                return Err(detach_err(DetachError::Unexpected(format!("{other:?}"))));
            }
            Err(e) => return Err(detach_err(DetachError::Report(e))),
        };
        if crate::procfs::parent_of(pid).ok() == Some(std::process::id() as i32) {
            // CRIU is a child subreaper here, so the orphan came back to it.
            log::warn!(
                "keeper pid {pid} is a child of CRIU's process after all (CRIU reaps orphans here): CRIU would see its exit"
            );
        }
        log::debug!("keeper {shown} started as pid {pid} for pid {job_pid}");
        Ok(Keeper {
            pid,
            pidfd,
            session: Some(AgentSession::over(job_pid, ours, timeout)),
        })
    }

    /// Kills the keeper now (through its pidfd); `Drop` still waits for it to go.
    pub fn kill(&self) {
        signal(self.pidfd.as_fd(), libc::SIGKILL);
    }

    /// A handle that can kill this keeper from elsewhere (while a thread owns the `Keeper`).
    pub fn killer(&self) -> std::io::Result<KeeperKiller> {
        Ok(KeeperKiller {
            pid: self.pid,
            pidfd: self.pidfd.try_clone()?,
        })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The session to the keeper (until [`Self::take_session`]).
    pub fn session(&self) -> Option<&AgentSession> {
        self.session.as_ref()
    }

    /// Waits until the keeper has started CUDA (its driver and the contexts it was started
    /// for): it answers `Hello` only then. Returns how long that took.
    pub fn wait_ready(&self) -> Result<f64, KeeperError> {
        let t0 = Instant::now();
        let session = self
            .session
            .as_ref()
            .ok_or(KeeperError::NoSession { pid: self.pid })?;
        session
            .hello()
            .map_err(|err| KeeperError::NotReady { pid: self.pid, err })?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Takes the session (its `release` consumes it).
    pub fn take_session(&mut self) -> Option<AgentSession> {
        self.session.take()
    }
}

/// Kills one keeper through a pidfd of it: never another process that took its pid.
pub struct KeeperKiller {
    pid: libc::pid_t,
    pidfd: OwnedFd,
}

impl KeeperKiller {
    pub fn pid(&self) -> i32 {
        self.pid
    }

    pub fn kill(&self) {
        signal(self.pidfd.as_fd(), libc::SIGKILL);
    }
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keeper(pid {})", self.pid)
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        // Closing our end tells the keeper to go (it drops its imports as it exits).
        drop(self.session.take());
        let fd = self.pidfd.as_fd();
        if !exited_within(fd, Duration::from_secs(5)) {
            log::warn!(
                "keeper pid {} did not exit within 5 s: killing it",
                self.pid
            );
            signal(fd, libc::SIGKILL);
            if !exited_within(fd, crate::reap::REAP_WITHIN) {
                log::warn!("keeper pid {} still there after SIGKILL", self.pid);
            }
        }
        // Only if CRIU reaps orphans here is the keeper our child: then it is ours to reap.
        // Through the pidfd, so no other child of CRIU's can ever be reaped by mistake.
        // SAFETY: siginfo_t is plain data; all zeroes is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on a pidfd we own with a writable siginfo; WNOHANG never blocks, and
        // a process that is not our child only fails with ECHILD.
        unsafe {
            libc::waitid(
                libc::P_PIDFD,
                fd.as_raw_fd() as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG,
            )
        };
    }
}

/// Reaps the process that started the keeper (our child, which exits as soon as it has forked
/// the keeper and reported it). Killed and reaped if it takes longer than `within`.
fn reap_starter(pid: libc::pid_t, within: Duration) -> Result<(), DetachError> {
    let deadline = Instant::now() + within;
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid status pointer; WNOHANG never blocks.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return match (libc::WIFEXITED(status), libc::WEXITSTATUS(status)) {
                (true, 0) => Ok(()),
                _ => Err(DetachError::Status(status)),
            };
        }
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(DetachError::Wait(e));
        }
        if Instant::now() >= deadline {
            let _ = crate::reap::kill_and_reap(pid);
            return Err(DetachError::TooSlow(within));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether the process of `pidfd` exits within `within` (a pidfd is readable once it has).
fn exited_within(pidfd: BorrowedFd<'_>, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut p = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd that lives across the call.
        let r = unsafe { libc::poll(&mut p, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if r > 0 {
            return true;
        }
        if r == 0 || Instant::now() >= deadline {
            return false;
        }
        // r < 0: EINTR (CRIU's SIGALRM, say): wait on for what is left.
    }
}

/// Sends `sig` to the process of `pidfd` (never to a pid that might have been reused).
fn signal(pidfd: BorrowedFd<'_>, sig: i32) {
    // SAFETY: pidfd_send_signal with a pidfd we own, no siginfo and no flags.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r != 0 {
        log::debug!(
            "keeper: pidfd_send_signal: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The keeper binary: the configured path, else next to the plugin, else [`INSTALLED_PATH`].
/// It must be a regular, executable file that only its owner (root or us) can write.
pub fn locate(configured: &str) -> Result<PathBuf, KeeperError> {
    let candidate = if !configured.is_empty() {
        PathBuf::from(configured)
    } else {
        let beside = plugin_dir().map(|d| d.join("gpusnap-keeper"));
        match beside {
            Some(p) if p.exists() => p,
            _ if Path::new(INSTALLED_PATH).exists() => PathBuf::from(INSTALLED_PATH),
            other => {
                return Err(KeeperError::NotFound {
                    beside: other.map_or("plugin directory unknown".into(), |p| {
                        p.display().to_string()
                    }),
                });
            }
        }
    };
    check_binary(&candidate)?;
    Ok(candidate)
}

fn check_binary(path: &Path) -> Result<(), KeeperError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let unusable = |why: String| KeeperError::Unusable {
        path: path.display().to_string(),
        why,
    };
    let md = std::fs::metadata(path).map_err(|e| unusable(e.to_string()))?;
    if !md.is_file() {
        return Err(unusable("not a regular file".into()));
    }
    if md.permissions().mode() & 0o111 == 0 {
        return Err(unusable("not executable".into()));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if md.uid() != 0 && md.uid() != me {
        return Err(unusable(format!(
            "owned by uid {}, neither root nor us",
            md.uid()
        )));
    }
    if md.permissions().mode() & 0o022 != 0 {
        return Err(unusable(
            "writable by its group or by others (it runs as CRIU's user)".into(),
        ));
    }
    Ok(())
}

/// The directory this plugin was loaded from.
fn plugin_dir() -> Option<PathBuf> {
    // SAFETY: dladdr with the address of a function of this library and a zeroed Dl_info.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above; dli_fname, when set, is a NUL-terminated path owned by the loader.
    let name = unsafe {
        if libc::dladdr(plugin_dir as *const libc::c_void, &mut info) == 0
            || info.dli_fname.is_null()
        {
            return None;
        }
        std::ffi::CStr::from_ptr(info.dli_fname)
    };
    let p = PathBuf::from(std::ffi::OsStr::new(
        std::str::from_utf8(name.to_bytes()).ok()?,
    ));
    p.parent().map(Path::to_path_buf)
}

/// The driver library the job `pid` has mapped, as a path this process can open (through the
/// job's root, for a container), if any.
pub fn job_libcuda(pid: i32) -> Option<PathBuf> {
    let maps = crate::procfs::maps(pid).ok()?;
    let path = maps.lines().find_map(|l| {
        let p = l.split_whitespace().nth(5)?;
        let name = Path::new(p).file_name()?.to_str()?;
        name.starts_with("libcuda.so").then(|| p.to_owned())
    })?;
    Some(PathBuf::from(format!("/proc/{pid}/root{path}")))
}

/// `posix_spawn` of `path` with `args`, the connection `conn` as descriptor [`KEEPER_FD`], in a
/// new session, every signal unblocked and at its default. The environment is ours (CRIU's).
fn spawn(path: &Path, args: &[std::ffi::OsString], conn: i32) -> std::io::Result<libc::pid_t> {
    use std::os::unix::ffi::OsStrExt;
    let cstr = |s: &std::ffi::OsStr| {
        CString::new(s.as_bytes()).map_err(|_| std::io::Error::other("a NUL byte in an argument"))
    };
    let prog = cstr(path.as_os_str())?;
    let argv_c: Vec<CString> = args.iter().map(|a| cstr(a)).collect::<Result<_, _>>()?;
    let mut argv: Vec<*mut c_char> = argv_c.iter().map(|a| a.as_ptr().cast_mut()).collect();
    argv.push(std::ptr::null_mut());
    let err = |rc: i32| std::io::Error::from_raw_os_error(rc);
    // SAFETY: the file actions and attributes are initialised before use and destroyed after;
    // argv is a NULL-terminated array of C strings that outlive the call; environ is the
    // process's environment.
    unsafe {
        let mut actions: libc::posix_spawn_file_actions_t = std::mem::zeroed();
        let mut attr: libc::posix_spawnattr_t = std::mem::zeroed();
        libc::posix_spawn_file_actions_init(&mut actions);
        libc::posix_spawnattr_init(&mut attr);
        let result = (|| {
            // dup2 onto another number clears close-on-exec; the same number needs it cleared.
            if conn == KEEPER_FD {
                let flags = libc::fcntl(conn, libc::F_GETFD);
                libc::fcntl(conn, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
            } else {
                let rc = libc::posix_spawn_file_actions_adddup2(&mut actions, conn, KEEPER_FD);
                if rc != 0 {
                    return Err(err(rc));
                }
            }
            let mut empty: libc::sigset_t = std::mem::zeroed();
            let mut all: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            libc::sigfillset(&mut all);
            libc::posix_spawnattr_setsigmask(&mut attr, &empty);
            libc::posix_spawnattr_setsigdefault(&mut attr, &all);
            let flags = (libc::POSIX_SPAWN_SETSIGMASK | libc::POSIX_SPAWN_SETSIGDEF)
                as libc::c_short
                | libc::POSIX_SPAWN_SETSID;
            libc::posix_spawnattr_setflags(&mut attr, flags);
            let mut pid: libc::pid_t = 0;
            unsafe extern "C" {
                static environ: *const *mut c_char;
            }
            let rc = libc::posix_spawn(
                &mut pid,
                prog.as_ptr(),
                &actions,
                &attr,
                argv.as_ptr(),
                environ,
            );
            if rc != 0 {
                return Err(err(rc));
            }
            Ok(pid)
        })();
        libc::posix_spawn_file_actions_destroy(&mut actions);
        libc::posix_spawnattr_destroy(&mut attr);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keeper_path_must_be_a_private_executable() {
        let dir = std::env::temp_dir().join(format!("gpusnap-keeper-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("gpusnap-keeper");
        std::fs::write(&f, b"#!/bin/sh\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = locate(f.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("not executable"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = locate(f.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("writable by its group or by others"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(locate(f.to_str().unwrap()).unwrap(), f);
        let e = locate(dir.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_libcuda_mapping_is_found_through_the_jobs_root() {
        // This test process maps no libcuda.
        assert_eq!(job_libcuda(std::process::id() as i32), None);
    }
}
