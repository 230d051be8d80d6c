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

use crate::agent::KeeperSession;
use gpusnap_host::pid::{HostPid, NsPid};
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
        pid: HostPid,
        err: crate::agent::AgentError,
    },
    #[error("keeper pid {pid}: its connection was already taken")]
    NoSession { pid: HostPid },
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

/// The job a keeper serves, as the caller knows it: a dump knows the job's host pid (CRIU's
/// hooks get it), a restore's `init` only the namespace pid its image names (the process does
/// not exist yet). Two kinds of number, never to be mixed: only messages use either.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobPid {
    Host(HostPid),
    Namespace(NsPid),
}

impl JobPid {
    /// The number, for the session's messages (the only use of a session's pid that a
    /// keeper's session has: it has no door, so nothing looks the number up in `/proc`).
    fn number(self) -> HostPid {
        match self {
            JobPid::Host(p) => p,
            JobPid::Namespace(p) => HostPid(i32::try_from(p.get()).unwrap_or(i32::MAX)),
        }
    }
}

impl std::fmt::Display for JobPid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobPid::Host(p) => write!(f, "pid {p}"),
            JobPid::Namespace(p) => write!(f, "namespace pid {p} (of the image)"),
        }
    }
}

/// A started keeper and the session to it.
pub struct Keeper {
    pid: HostPid,
    /// A pidfd of the keeper: it is not our child, so this is how we see it exit and kill it
    /// without ever signalling a pid that was reused.
    pidfd: OwnedFd,
    session: Option<KeeperSession>,
}

impl Keeper {
    /// Starts the keeper binary (`configured`, or found) for the job `job`, loading
    /// `libcuda` (the job's driver library) if given; it makes its context on each of `gpus`
    /// (UUIDs) at once, beside whatever CRIU does meanwhile (a restore's plan is known then).
    pub fn spawn(
        configured: &str,
        libcuda: Option<&Path>,
        gpus: &[[u8; 16]],
        job: JobPid,
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
            Ok((gpusnap_proto::Reply::Detached { pid }, Some(fd))) => (pid, fd),
            Ok((gpusnap_proto::Reply::Error { message, .. }, _)) => {
                return Err(detach_err(DetachError::Refused(message)));
            }
            Ok((other, _)) => {
                return Err(detach_err(DetachError::Unexpected(format!("{other:?}"))));
            }
            Err(e) => return Err(detach_err(DetachError::Report(e))),
        };
        if gpusnap_host::procfs::parent_of(pid).ok() == Some(HostPid(std::process::id() as i32)) {
            // CRIU is a child subreaper here, so the orphan came back to it.
            log::warn!(
                "keeper pid {pid} is a child of CRIU's process after all (CRIU reaps orphans here): CRIU would see its exit"
            );
        }
        log::debug!("keeper {shown} started as pid {pid} for {job}");
        Ok(Keeper {
            pid,
            pidfd,
            // A stopped keeper is noticed within a tenth of a second, not the agent timeout.
            session: Some(KeeperSession::over(job.number(), ours, timeout).watching(pid)),
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

    pub fn pid(&self) -> HostPid {
        self.pid
    }

    /// The session to the keeper (until [`Self::take_session`]).
    pub fn session(&self) -> Option<&KeeperSession> {
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
    pub fn take_session(&mut self) -> Option<KeeperSession> {
        self.session.take()
    }
}

/// Kills one keeper through a pidfd of it: never another process that took its pid.
pub struct KeeperKiller {
    pid: HostPid,
    pidfd: OwnedFd,
}

impl KeeperKiller {
    pub fn pid(&self) -> HostPid {
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
            if !exited_within(fd, gpusnap_host::reap::REAP_WITHIN) {
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
fn reap_starter(pid: HostPid, within: Duration) -> Result<(), DetachError> {
    let deadline = Instant::now() + within;
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid status pointer; WNOHANG never blocks.
        let r = unsafe { libc::waitpid(pid.get(), &mut status, libc::WNOHANG) };
        if r == pid.get() {
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
            let _ = gpusnap_host::reap::kill_and_reap(pid);
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

/// Why a dump's keeper is given no driver library, so the memory is copied out first. The
/// keeper runs as root: it loads only the host's driver library, never a file the job chose.
#[derive(Debug, thiserror::Error)]
pub enum LibraryRefused {
    #[error("the host's driver library {name} is not loaded in CRIU's process")]
    NotLoaded { name: String },
    #[error("the host's driver library {path}: {err}")]
    Stat { path: String, err: std::io::Error },
    #[error(
        "the host's driver library {path} is {why}: the keeper runs as root and loads only a root-owned library that only root can write"
    )]
    NotPrivate { path: String, why: &'static str },
    #[error("reading the job's mappings: {0}")]
    Maps(std::io::Error),
    #[error("the job maps no driver library (libcuda.so*)")]
    NoneMapped,
    #[error(
        "the job maps {job:?} (device {dev_major}:{dev_minor}, inode {inode}), which is not the host's driver library {host} (a container that ships its own libcuda?); the keeper never loads a library the job chose"
    )]
    Mismatch {
        job: String,
        dev_major: u32,
        dev_minor: u32,
        inode: u64,
        host: String,
    },
}

/// A mapped file as `/proc/<pid>/maps` names it: device and inode, which the job cannot fake
/// (the kernel writes them), and the path, which it can (shown only, quoted).
#[derive(Clone, Debug, PartialEq, Eq)]
struct MappedFile {
    dev_major: u32,
    dev_minor: u32,
    inode: u64,
    path: String,
}

/// The driver library a dump's keeper loads for the job `pid`: the host's (`host`, a path or
/// a name the loader resolved for CRIU, e.g. `libcuda.so.1`), and only if it is root's alone
/// and every `libcuda.so*` file the job maps is that same file (device and inode, read from
/// `/proc/<pid>/maps`: no path inside the job's root is ever opened). A job whose driver
/// library is another file (its container's own) gets the copy-first route.
pub fn host_library_for(pid: HostPid, host: &str) -> Result<PathBuf, LibraryRefused> {
    let host = resolve_host_library(host)?;
    let shown = host.display().to_string();
    let md = std::fs::metadata(&host).map_err(|err| LibraryRefused::Stat {
        path: shown.clone(),
        err,
    })?;
    private_to_root(&host, &md)?;
    let maps = gpusnap_host::procfs::maps(pid).map_err(LibraryRefused::Maps)?;
    use std::os::unix::fs::MetadataExt;
    job_maps_only(
        &maps,
        (libc::major(md.dev()), libc::minor(md.dev()), md.ino()),
        &shown,
    )?;
    Ok(host)
}

/// `host` as an absolute path: itself if it names one, else the file the dynamic loader gave
/// CRIU's process for that name (already loaded: `RTLD_NOLOAD` maps and runs nothing).
fn resolve_host_library(host: &str) -> Result<PathBuf, LibraryRefused> {
    if host.contains('/') {
        return std::fs::canonicalize(host).map_err(|err| LibraryRefused::Stat {
            path: host.to_owned(),
            err,
        });
    }
    let not_loaded = || LibraryRefused::NotLoaded {
        name: host.to_owned(),
    };
    let name = CString::new(host).map_err(|_| not_loaded())?;
    // SAFETY: dlopen with a NUL-terminated name; RTLD_NOLOAD only returns a library that is
    // already loaded (no constructor runs); the handle is closed below.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return Err(not_loaded());
    }
    let mut found = None;
    for sym in [c"cuDriverGetVersion", c"cuInit", c"cuGetProcAddress"] {
        // SAFETY: dlsym on a live handle with a NUL-terminated name.
        let addr = unsafe { libc::dlsym(handle, sym.as_ptr()) };
        if addr.is_null() {
            continue;
        }
        // SAFETY: a zeroed Dl_info that dladdr fills; dli_fname, when set, is a NUL-terminated
        // path owned by the loader, copied before the handle is closed.
        unsafe {
            let mut info: libc::Dl_info = std::mem::zeroed();
            if libc::dladdr(addr, &mut info) != 0 && !info.dli_fname.is_null() {
                let bytes = std::ffi::CStr::from_ptr(info.dli_fname).to_bytes();
                use std::os::unix::ffi::OsStrExt;
                found = Some(PathBuf::from(std::ffi::OsStr::from_bytes(bytes)));
            }
        }
        break;
    }
    // SAFETY: closes the reference the NOLOAD dlopen took; the library stays loaded.
    unsafe { libc::dlclose(handle) };
    let path = found.ok_or_else(not_loaded)?;
    std::fs::canonicalize(&path).map_err(|err| LibraryRefused::Stat {
        path: path.display().to_string(),
        err,
    })
}

/// A library root may load: a regular file owned by root, writable by nobody else, in a
/// directory owned by root that nobody else can write.
fn private_to_root(path: &Path, md: &std::fs::Metadata) -> Result<(), LibraryRefused> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let refuse = |why| LibraryRefused::NotPrivate {
        path: path.display().to_string(),
        why,
    };
    if !md.is_file() {
        return Err(refuse("not a regular file"));
    }
    if md.uid() != 0 {
        return Err(refuse("not owned by root"));
    }
    if md.permissions().mode() & 0o022 != 0 {
        return Err(refuse("writable by its group or by others"));
    }
    let dir = path.parent().unwrap_or(Path::new("/"));
    let dmd = std::fs::metadata(dir).map_err(|err| LibraryRefused::Stat {
        path: dir.display().to_string(),
        err,
    })?;
    if dmd.uid() != 0 || dmd.permissions().mode() & 0o022 != 0 {
        return Err(refuse(
            "in a directory that a user other than root owns or can write",
        ));
    }
    Ok(())
}

/// Every `libcuda.so*` file in `maps` (a `/proc/<pid>/maps` text) is the file `host`
/// (major, minor, inode); at least one is mapped.
fn job_maps_only(
    maps: &str,
    (major, minor, inode): (u32, u32, u64),
    host: &str,
) -> Result<(), LibraryRefused> {
    let mut any = false;
    for f in maps.lines().filter_map(mapped_file) {
        let is_driver = Path::new(&f.path)
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libcuda.so"));
        if !is_driver {
            continue;
        }
        if (f.dev_major, f.dev_minor, f.inode) != (major, minor, inode) {
            return Err(LibraryRefused::Mismatch {
                job: f.path,
                dev_major: f.dev_major,
                dev_minor: f.dev_minor,
                inode: f.inode,
                host: host.to_owned(),
            });
        }
        any = true;
    }
    if any {
        Ok(())
    } else {
        Err(LibraryRefused::NoneMapped)
    }
}

/// One line of `/proc/<pid>/maps`: `start-end perms offset major:minor inode path`.
fn mapped_file(line: &str) -> Option<MappedFile> {
    let mut f = line.splitn(6, ' ');
    let (_range, _perms, _off) = (f.next()?, f.next()?, f.next()?);
    let (maj, min) = f.next()?.split_once(':')?;
    let inode: u64 = f.next()?.parse().ok()?;
    let path = f.next()?.trim_start().to_owned();
    (inode != 0 && path.starts_with('/')).then_some(())?;
    Some(MappedFile {
        dev_major: u32::from_str_radix(maj, 16).ok()?,
        dev_minor: u32::from_str_radix(min, 16).ok()?,
        inode,
        path,
    })
}

/// `posix_spawn` of `path` with `args`, the connection `conn` as descriptor [`KEEPER_FD`], in a
/// new session, every signal unblocked and at its default. The environment is ours (CRIU's).
fn spawn(path: &Path, args: &[std::ffi::OsString], conn: i32) -> std::io::Result<HostPid> {
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
            Ok(HostPid(pid))
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

    const MAPS: &str = "\
55d0c0000000-55d0c0001000 r--p 00000000 fe:00 4242                       /usr/bin/job
10000000-10001000 r--p 00000000 00:2a 77                        /home/job/libcuda.so.666
7f0000000000-7f0000100000 r-xp 00000000 fe:00 1234                       /usr/lib/x86_64-linux-gnu/libcuda.so.580.1
7f0000200000-7f0000201000 rw-p 00000000 00:00 0 
7f0000300000-7f0000301000 rw-s 00000000 00:01 99                         /memfd:x (deleted)
";

    #[test]
    fn only_the_hosts_driver_library_may_be_mapped() {
        // A second libcuda the job mapped itself (another device and inode) is refused, by
        // device and inode, whatever its name says.
        let e = job_maps_only(MAPS, (0xfe, 0, 1234), "/usr/lib/libcuda.so.580.1").unwrap_err();
        assert!(
            matches!(&e, LibraryRefused::Mismatch { job, dev_major: 0, dev_minor: 0x2a, inode: 77, .. } if job == "/home/job/libcuda.so.666"),
            "{e}"
        );
        let without: String = MAPS
            .lines()
            .filter(|l| !l.contains(".666"))
            .map(|l| format!("{l}\n"))
            .collect();
        job_maps_only(&without, (0xfe, 0, 1234), "host").unwrap();
        // The same name on another file (a container's own) is refused too.
        let e = job_maps_only(&without, (0xfe, 0, 1235), "host").unwrap_err();
        assert!(matches!(e, LibraryRefused::Mismatch { .. }), "{e}");
        // No driver mapped at all.
        let none: String = without
            .lines()
            .filter(|l| !l.contains("libcuda"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(matches!(
            job_maps_only(&none, (0xfe, 0, 1234), "host"),
            Err(LibraryRefused::NoneMapped)
        ));
    }

    #[test]
    fn the_hosts_library_must_be_roots_alone() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("gpusnap-lib-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let f = dir.join("libcuda.so.1");
        std::fs::write(&f, b"x").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = private_to_root(&f, &std::fs::metadata(&f).unwrap()).unwrap_err();
        assert!(e.to_string().contains("writable"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let md = std::fs::metadata(&f).unwrap();
        use std::os::unix::fs::MetadataExt;
        if md.uid() == 0 {
            private_to_root(&f, &md).unwrap();
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
            let e = private_to_root(&f, &md).unwrap_err();
            assert!(e.to_string().contains("directory"), "{e}");
        } else {
            assert!(
                private_to_root(&f, &md)
                    .unwrap_err()
                    .to_string()
                    .contains("root")
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_library_name_not_loaded_is_refused_without_loading_it() {
        let e = resolve_host_library("libgpusnap-no-such-driver.so.1").unwrap_err();
        assert!(matches!(e, LibraryRefused::NotLoaded { .. }), "{e}");
    }
}
