//! The agent thread: waits at its door (`gpusnap_proto`'s `door`: no socket name, reached with
//! `pidfd_getfd`), takes one connection at a time from root or the process's own user, and
//! serves requests until the peer closes or an operation ends (after `Released`, `Restored`, `Aborted` or an operation's error the connection is
//! closed: the agent must hold no connection when CRIU dumps the process's descriptors).
//!
//! The thread is started once (first conversion, or at load with `GPUSNAP_AGENT_EAGER=1`),
//! named `gpusnap-agent`, with every signal blocked.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use gpusnap_proto::{
    AllocKind, Channel, DoorInside, ErrorCode, Knock, PROTOCOL_VERSION, ProtoError, Reply, Request,
    peer_cred, take_knock,
};

use crate::gpu::Gpu;
use crate::log::debug;
use crate::session::{Fail, Ring, busy_reply};
use crate::table::{self, AGENT_LOCK_WAIT};
use crate::{dump, restore};

static STARTED: AtomicBool = AtomicBool::new(false);

/// Name of the agent thread (`/proc/<pid>/task/*/comm`).
pub const THREAD_NAME: &str = "gpusnap-agent";

/// Starts the agent thread unless it runs already.
pub fn ensure_started() {
    if STARTED.load(Ordering::Acquire) || STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    crate::install_quiet_panic_hook();
    // The new thread inherits the creator's mask: block everything around the spawn so no
    // signal meant for the application is ever delivered to the agent thread.
    let old = block_all_signals();
    let spawned = std::thread::Builder::new()
        .name(THREAD_NAME.into())
        .spawn(agent_main);
    if let Some(old) = old {
        // SAFETY: old is the mask this thread had; restoring it.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    }
    if let Err(e) = spawned {
        debug!("could not start the agent thread: {e}");
        STARTED.store(false, Ordering::Release);
    }
}

/// Blocks every signal in the calling thread; returns the previous mask.
fn block_all_signals() -> Option<libc::sigset_t> {
    // SAFETY: sigset_t is plain data; sigfillset initializes it; pthread_sigmask writes old.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        (libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old) == 0).then_some(old)
    }
}

/// Descriptor numbers a forked child inherits from the agent and must close: the door's two
/// ends, its label, and the connection being served (-1: none). Written only under the fork
/// fence (the table lock, which fork's prepare handler takes), so a child sees them exactly as
/// they were when it was forked.
static AGENT_FDS: [AtomicI32; 4] = [const { AtomicI32::new(-1) }; 4];
const DOOR_AGENT_END: usize = 0;
const DOOR_CLIENT_END: usize = 1;
const DOOR_LABEL: usize = 2;
const CONNECTION: usize = 3;

/// In a forked child: no agent thread exists; let a child that uses CUDA start its own, and
/// close the parent agent's door and connection, which the child inherited (a client would
/// otherwise find the parent's door in the child, and the parent's connection would stay open).
pub fn forget_in_child() {
    if STARTED.swap(false, Ordering::AcqRel) {
        for slot in &AGENT_FDS {
            let fd = slot.swap(-1, Ordering::AcqRel);
            if fd >= 0 {
                // SAFETY: fd is an inherited copy of the parent agent's descriptor, recorded
                // under the fork fence; nothing in the child uses it (the thread that owned it
                // does not exist here).
                unsafe { libc::close(fd) };
            }
        }
    }
}

fn agent_main() {
    block_all_signals();
    // fork's prepare handler takes the table lock: holding it while the door is made and its
    // numbers recorded means a child inherits either nothing or a door it knows to close.
    // Bounded, like every table lock the agent thread takes; on timeout go on unfenced.
    let fence = table::try_lock_for(AGENT_LOCK_WAIT);
    let installed = gpusnap_proto::install_door();
    if let Ok(d) = &installed {
        AGENT_FDS[DOOR_AGENT_END].store(d.agent_end.as_raw_fd(), Ordering::Release);
        AGENT_FDS[DOOR_CLIENT_END].store(d.client_end.as_raw_fd(), Ordering::Release);
        AGENT_FDS[DOOR_LABEL].store(d.label.as_raw_fd(), Ordering::Release);
    }
    drop(fence);
    let DoorInside {
        agent_end,
        // Kept open for the life of the thread: clients copy the client end, find the label.
        client_end: _client_end,
        label: _label,
    } = match installed {
        Ok(d) => d,
        Err(e) => {
            debug!("cannot make the agent's door, agent stays idle: {e}");
            return;
        }
    };
    let door = Channel::new(agent_end);
    debug!("agent door open");
    let mut agent = Agent { gpu: Gpu::new() };
    loop {
        if let Err(e) = wait_readable(&door) {
            if matches!(e.raw_os_error(), Some(libc::EBADF | libc::ENOTSOCK)) {
                // The application closed our descriptor: never read from that number again.
                debug!("the agent's door is gone ({e}); agent stays idle");
                return;
            }
            debug!("waiting at the door: {e}");
            std::thread::sleep(std::time::Duration::from_millis(100));
            continue;
        }
        let fence = table::try_lock_for(AGENT_LOCK_WAIT);
        let knock = take_knock(&door);
        if let Ok(Knock::Connection(c)) = &knock {
            AGENT_FDS[CONNECTION].store(c.as_raw_fd(), Ordering::Release);
        }
        drop(fence);
        let conn = match knock {
            Ok(Knock::Connection(c)) => c,
            Ok(Knock::Nothing) | Err(ProtoError::Interrupted) => continue,
            Ok(Knock::Malformed(why)) => {
                debug!("ignoring {why} at the door");
                continue;
            }
            Err(ProtoError::Io(e))
                if matches!(e.raw_os_error(), Some(libc::EBADF | libc::ENOTSOCK)) =>
            {
                debug!("the agent's door is gone ({e}); agent stays idle");
                return;
            }
            Err(e) => {
                // E.g. no descriptor left for the attached socket: try again later.
                debug!("taking a knock: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
                continue;
            }
        };
        if peer_allowed(&conn) && first_request_comes(&conn, &door) {
            let ch = Channel::new(conn);
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| agent.serve(&ch))).is_err()
            {
                debug!("agent: panic while serving a connection; closing it");
            }
            close_connection(ch.into_fd());
        } else {
            close_connection(conn);
        }
    }
}

/// Closes the served connection and forgets its number, under the fork fence (a child forked
/// in between would otherwise close whatever file next got that number).
fn close_connection(conn: OwnedFd) {
    let fence = table::try_lock_for(AGENT_LOCK_WAIT);
    // Forgotten first: should the fence have timed out and a fork land in between, the child
    // leaks one descriptor rather than closing whatever file next got this number.
    AGENT_FDS[CONNECTION].store(-1, Ordering::Release);
    drop(conn);
    drop(fence);
}

/// Blocks until a record is queued at the door (signals are blocked in this thread).
fn wait_readable(door: &Channel) -> std::io::Result<()> {
    let mut pfd = libc::pollfd {
        fd: door.fd().as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: pfd is one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, -1) } >= 0 {
            if pfd.revents & libc::POLLNVAL != 0 {
                return Err(std::io::Error::from_raw_os_error(libc::EBADF));
            }
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// How long a connection may take to send its first request. Every client sends one at once
/// (the plugin's `Hello` follows its knock within microseconds).
const FIRST_REQUEST_LIMIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Whether a connection just taken sends a request before another knock waits at the door and
/// within [`FIRST_REQUEST_LIMIT`]: a connection that has said nothing gives way to the next
/// knock at once, so idle knocks queued ahead of the plugin's (anyone with ptrace rights over
/// the process can knock) cost it nothing, and none is still queued when CRIU dumps.
fn first_request_comes(conn: &OwnedFd, door: &Channel) -> bool {
    let deadline = std::time::Instant::now() + FIRST_REQUEST_LIMIT;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: conn.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: door.fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            debug!("closing a connection that sent nothing for {FIRST_REQUEST_LIMIT:?}");
            return false;
        }
        // SAFETY: fds is an array of two valid pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, left.as_millis().max(1) as i32) };
        if n < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return true; // let the request loop find out what is wrong
        }
        if fds[0].revents != 0 {
            return true; // a request, or the peer closed: the serve loop handles both
        }
        if fds[1].revents & libc::POLLIN != 0 {
            debug!("a connection that sent nothing gives way to the next knock");
            return false;
        }
    }
}

/// Root, or the user the process runs as.
fn peer_allowed(conn: &OwnedFd) -> bool {
    match peer_cred(conn.as_fd()) {
        // SAFETY: geteuid has no preconditions.
        Ok(c) if c.uid == 0 || c.uid == unsafe { libc::geteuid() } => true,
        Ok(c) => {
            debug!("refusing a connection from pid {} uid {}", c.pid, c.uid);
            false
        }
        Err(e) => {
            debug!("SO_PEERCRED: {e}");
            false
        }
    }
}

/// How long a connection may wait between requests outside an operation. The plugin sends its
/// next request within milliseconds (its longest gap, building the staging ring, is well under
/// a second for the largest ring).
const IDLE_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a connection may last before it begins an operation (`DumpBegin`, `RestoreBegin`);
/// an operation then has its own limits ([`crate::session::PEER_WAIT`]).
const SESSION_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// State kept by the agent thread across connections.
struct Agent {
    gpu: Gpu,
}

impl Agent {
    /// Serves one connection until the peer closes, an operation ends, or the peer idles: the
    /// agent serves one connection at a time, and a client that holds one without using it
    /// (or keeps it with requests outside an operation) would otherwise keep the plugin's
    /// knock queued at the door, which makes CRIU's dump fail on an in-flight socket.
    fn serve(&mut self, ch: &Channel) {
        let deadline = std::time::Instant::now() + SESSION_LIMIT;
        // The parent image's chunks this connection announced (`KnownChunk`), for its dump.
        let mut known = dump::KnownChunks::default();
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                debug!("closing a connection that used {SESSION_LIMIT:?} without an operation");
                return;
            }
            let (req, fd) = match ch.recv_request(Some(left.min(IDLE_LIMIT))) {
                Ok(m) => m,
                Err(ProtoError::Closed | ProtoError::Io(_)) => return,
                Err(ProtoError::Timeout) => {
                    debug!("closing a connection idle for {IDLE_LIMIT:?}");
                    return;
                }
                Err(ProtoError::Interrupted) => continue,
                Err(e @ ProtoError::VersionMismatch { .. }) => {
                    reply(ch, ErrorCode::VersionMismatch, e.to_string());
                    continue;
                }
                Err(e) => {
                    reply(ch, ErrorCode::BadRequest, e.to_string());
                    continue;
                }
            };
            if !matches!(req, Request::KnownChunk { .. }) {
                debug!("request {req:?}");
            }
            let mode = match req {
                Request::PreCopyBegin { .. } => dump::Mode::Live,
                _ => dump::Mode::Stopped,
            };
            let (req, fd) = match crate::take::Take::from_message((req, fd)) {
                Ok(first) => return crate::take::run(ch, &mut self.gpu, first),
                Err(other) => other,
            };
            match (req, fd) {
                (
                    Request::DumpBegin {
                        slot_size,
                        slots,
                        streams,
                    }
                    | Request::PreCopyBegin {
                        slot_size,
                        slots,
                        streams,
                    },
                    Some(memfd),
                ) => {
                    let ring = Ring {
                        slot_size,
                        slots,
                        streams,
                    };
                    return dump::run(
                        &mut self.gpu,
                        ch,
                        ring,
                        memfd,
                        &known,
                        mode,
                        dump::ReleaseAlso {
                            released: crate::own_fds::forget_released,
                            imports: release_imports,
                        },
                    );
                }
                (
                    Request::RestoreBegin {
                        slot_size,
                        slots,
                        streams,
                    },
                    Some(memfd),
                ) => {
                    return restore::run(
                        &mut self.gpu,
                        ch,
                        Ring {
                            slot_size,
                            slots,
                            streams,
                        },
                        memfd,
                    );
                }
                (
                    r @ (Request::DumpBegin { .. }
                    | Request::PreCopyBegin { .. }
                    | Request::RestoreBegin { .. }),
                    None,
                ) => {
                    reply(
                        ch,
                        ErrorCode::BadRequest,
                        format!("{r:?} needs the staging memfd attached"),
                    );
                }
                (Request::Reimport { exporter_pid, id }, Some(fd)) => {
                    reimport(ch, &mut self.gpu, exporter_pid, id, fd)
                }
                (r, Some(_)) => reply(
                    ch,
                    ErrorCode::BadRequest,
                    format!("{r:?} carries no file descriptor"),
                ),
                (
                    Request::KnownChunk {
                        addr,
                        len,
                        device_hash,
                    },
                    None,
                ) => {
                    if let Err(e) = known.insert(addr, len, device_hash) {
                        reply(ch, ErrorCode::BadRequest, e);
                        return;
                    }
                }
                (Request::LendBegin, None) => {
                    return crate::lend::run(ch, &mut self.gpu, release_imports);
                }

                (Request::Reclaim, None) => {
                    crate::lend::reclaim(ch, &mut self.gpu);
                    return;
                }
                (r, None) => {
                    if !self.simple(ch, r) {
                        return;
                    }
                }
            }
        }
    }

    /// Requests answered outside an operation; false when the connection is to be closed.
    fn simple(&mut self, ch: &Channel, req: Request) -> bool {
        let sent = match req {
            Request::Hello { version } if version != PROTOCOL_VERSION => {
                ch.send_reply(&Reply::Error {
                    code: ErrorCode::VersionMismatch,
                    message: format!("agent speaks protocol {PROTOCOL_VERSION}, plugin {version}"),
                })
            }
            Request::Hello { .. } => ch.send_reply(&hello()),
            Request::ListAllocations => list(ch),
            Request::ListSharing => list_sharing(ch),
            Request::ShareFds => share_fds(ch),
            Request::ShareableSource {
                import,
                exporter_pid,
                id,
                key,
            } => shareable_source(ch, import, exporter_pid, id, key),
            Request::Abort => ch.send_reply(&Reply::Aborted),
            other => ch.send_reply(&Reply::Error {
                code: ErrorCode::BadState,
                message: format!("{other:?} without a DumpBegin or RestoreBegin in progress"),
            }),
        };
        sent.is_ok()
    }
}

/// A release's unmap of the process's CUDA IPC imports ([`crate::ipc::release_imports`]).
fn release_imports(drv: &crate::real::Driver, gpu: &mut Gpu) -> Result<(u32, u64), Fail> {
    let mut devices: Vec<i32> = crate::ipc::import_devices()
        .ok_or_else(Fail::busy)?
        .into_iter()
        .collect();
    devices.extend(crate::shareable::import_devices().ok_or_else(Fail::busy)?);
    devices.sort_unstable();
    devices.dedup();
    for dev in devices {
        gpu.prepare(drv, dev, 0, 0)?;
    }
    let (n, bytes) = crate::ipc::release_imports(drv)
        .map_err(|e| Fail::bad_state(format!("unmapping this process's CUDA IPC imports: {e}")))?;
    let (m, more) = crate::shareable::release_imports(drv).map_err(|e| {
        Fail::bad_state(format!(
            "unmapping this process's imports of shareable handles: {e}"
        ))
    })?;
    Ok((n + m, bytes + more))
}

/// `ListSharing`: this process's CUDA IPC shares, then their count.
fn list_sharing(ch: &Channel) -> Result<(), ProtoError> {
    let (Some(shares), Some(shareable)) = (crate::ipc::sharing(), crate::shareable::sharing())
    else {
        return ch.send_reply(&busy_reply());
    };
    for s in &shares {
        ch.send_reply(&Reply::Shared {
            import: s.import,
            pid: s.pid,
            id: s.id,
            addr: s.addr,
            size: s.size,
            mapped: s.mapped,
            shareable: false,
            agent_fd: -1,
            app_fd: -1,
            own_fd: -1,
            key: s.key,
        })?;
    }
    for s in &shareable {
        ch.send_reply(&Reply::Shared {
            import: s.import,
            pid: s.pid,
            id: s.id,
            addr: s.addr,
            size: s.size,
            mapped: s.mapped,
            shareable: true,
            agent_fd: s.agent_fd,
            app_fd: s.app_fd,
            own_fd: if s.import {
                -1
            } else {
                crate::own_fds::number_at(s.addr).unwrap_or(-1)
            },
            key: s.key,
        })?;
    }
    ch.send_reply(&Reply::SharedEnd {
        count: u32::try_from(shares.len() + shareable.len()).unwrap_or(u32::MAX),
    })
}

/// `ShareableSource`: the plugin resolved one of this process's shareable imports.
fn shareable_source(
    ch: &Channel,
    import: u64,
    exporter_pid: u32,
    id: u64,
    key: [u8; 16],
) -> Result<(), ProtoError> {
    match crate::shareable::note_source(import, exporter_pid, id, key) {
        Ok(()) => ch.send_reply(&Reply::SourceNoted),
        Err(crate::shareable::ShareableError::Busy) => ch.send_reply(&busy_reply()),
        Err(e) => ch.send_reply(&Reply::Error {
            code: ErrorCode::BadRequest,
            message: e.to_string(),
        }),
    }
}

/// `ShareFds`: a descriptor of the current memory of each exported allocation.
fn share_fds(ch: &Channel) -> Result<(), ProtoError> {
    let fds = crate::session::need_driver().and_then(|drv| {
        let mut fds = crate::ipc::share_fds(drv, crate::own_fds::copy_at)
            .map_err(|e| Fail::bad_state(format!("descriptors of the exported memory: {e}")))?;
        // The program's own fds of its exports are made to name the current memory only while
        // a tracer holds its threads (a restore, a rollback, `gpusnap recover`'s reload).
        let repoint = crate::held::by_a_tracer().is_ok();
        fds.extend(
            crate::shareable::share_fds(drv, crate::own_fds::copy_at, repoint).map_err(|e| {
                Fail::bad_state(format!(
                    "descriptors of the memory exported with cuMemExportToShareableHandle: {e}"
                ))
            })?,
        );
        Ok(fds)
    });
    match fds {
        Ok(fds) => {
            // This process's key: what its shares' importers recorded as their source's.
            let key = crate::identity::key().unwrap_or([0; 16]);
            for (id, addr, size, fd) in &fds {
                ch.send_reply_with(
                    &Reply::ShareFd {
                        id: *id,
                        addr: *addr,
                        size: *size,
                        key,
                    },
                    fd.as_fd(),
                )?;
            }
            ch.send_reply(&Reply::ShareFdEnd {
                count: u32::try_from(fds.len()).unwrap_or(u32::MAX),
            })
        }
        Err(f) => match crate::session::fail_reply(f) {
            Some(r) => ch.send_reply(&r),
            None => Ok(()),
        },
    }
}

/// `Reimport`: map exporter `exporter_pid`'s allocation `id` again where this process's import
/// of it was (only while a tracer holds the application's threads, as every load).
fn reimport(ch: &Channel, gpu: &mut crate::gpu::Gpu, exporter_pid: u32, id: u64, fd: OwnedFd) {
    let result = (|| -> Result<u64, Fail> {
        let drv = crate::session::need_driver()?;
        crate::held::by_a_tracer().map_err(Fail::bad_state)?;
        if let Some(device) = crate::ipc::import_device(exporter_pid, id) {
            gpu.prepare(drv, device, 0, 0)?;
            return crate::ipc::reimport(drv, exporter_pid, id, fd.as_fd()).map_err(|e| {
                Fail::bad_state(format!("mapping #{id} of pid {exporter_pid} again: {e}"))
            });
        }
        let device = crate::shareable::import_device(exporter_pid, id).ok_or_else(|| {
            Fail::bad_request(format!(
                "no CUDA IPC or shareable-handle import of #{id} of pid {exporter_pid} here"
            ))
        })?;
        gpu.prepare(drv, device, 0, 0)?;
        crate::shareable::reimport(drv, exporter_pid, id, fd.as_fd()).map_err(|e| {
            Fail::bad_state(format!("importing #{id} of pid {exporter_pid} again: {e}"))
        })
    })();
    crate::session::conclude(ch, gpu, None, result.map(|addr| Reply::Reimported { addr }));
}

fn reply(ch: &Channel, code: ErrorCode, message: String) {
    debug!("error reply {code:?}: {message}");
    let _ = ch.send_reply(&Reply::Error { code, message });
}

fn hello() -> Reply {
    let Some(t) = table::try_lock_for(AGENT_LOCK_WAIT) else {
        return busy_reply();
    };
    let s = t.summary();
    drop(t);
    // SAFETY: getpid and gettid have no preconditions.
    let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
    Reply::Hello {
        version: PROTOCOL_VERSION,
        pid,
        tid,
        allocations: s.entries,
        converted_bytes: s.converted_bytes,
        devices: s.devices,
        released: s.released,
        hazards: crate::hazards::get(),
        kept: crate::lend::kept_count(),
    }
}

fn list(ch: &Channel) -> Result<(), ProtoError> {
    let Some(t) = table::try_lock_for(AGENT_LOCK_WAIT) else {
        return ch.send_reply(&busy_reply());
    };
    let entries = t.listing();
    drop(t);
    for e in &entries {
        ch.send_reply(&Reply::Allocation {
            id: e.id,
            device: u32::try_from(e.device).unwrap_or(u32::MAX),
            addr: e.addr,
            size: e.size,
            kind: match (e.converted, e.exportable, e.app_handle) {
                (false, _, _) => AllocKind::AppVmm,
                (true, true, true) => AllocKind::AppHandleLendable,
                // Not lendable: imported at a hand-over, or properties a keeper cannot make.
                (true, false, true) if e.imported => AllocKind::AppHandleImported,
                (true, false, true) => AllocKind::AppHandleMapping,
                (true, true, false) => AllocKind::Converted,
                (true, false, false) => AllocKind::ConvertedNoExport,
            },
            rdma_capable: e.rdma_capable,
        })?;
    }
    ch.send_reply(&Reply::AllocationsEnd {
        count: u32::try_from(entries.len()).unwrap_or(u32::MAX),
    })
}
