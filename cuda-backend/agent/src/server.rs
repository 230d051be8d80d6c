//! The agent thread: waits at its door (`gpusnap_proto`'s `door`: no socket name, reached with
//! `pidfd_getfd`), takes one connection at a time from root or the process's own user, and
//! serves requests until the peer closes or an operation ends (after `Released`, `Restored`,
//! `Aborted` or an operation's error the connection is closed: the agent must hold no
//! connection when CRIU dumps the process's descriptors). A connection that sends anything
//! malformed is closed at once.
//!
//! From a dump's `DumpBegin` or `LendBegin` until the door is sealed and opened again (the
//! dump's CRIU part is over; `gpusnap_proto::seal_door`), only the dumper's knocks are taken
//! ([`DUMPER`]): another's is dropped without its descriptor ever entering the process, so the
//! thread, whenever the dump stops it, holds no other client's socket for CRIU to find. Nothing
//! here opens a file while it waits (a descriptor open when a tracer stops the thread is dumped
//! with the process).
//!
//! The thread is started once (first conversion, or at load with `GPUSNAP_AGENT_EAGER=1`),
//! named `gpusnap-agent`, with every signal blocked.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use gpusnap_proto::{
    AgentRequest, AllocKind, Channel, CommonRequest, DoorInside, ErrorCode, ForeignFd, Knock,
    PROTOCOL_VERSION, ProtoError, Reply, ShareKind, door_sealed, peer_cred, renew_door,
    take_knock_from,
};

use crate::gpu::Gpu;
use crate::log::debug;
use crate::session::{Fail, Ring, busy_reply};
use crate::table::{self, AGENT_LOCK_WAIT};
use crate::{dump, restore};
use gpusnap_proto::pid::{NsPid, NsTid};

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
/// ends, its label, and the connections taken and not yet closed (-1: none). Written only under
/// the fork fence (the table lock, which fork's prepare handler takes), so a child sees them
/// exactly as they were when it was forked.
static AGENT_FDS: [AtomicI32; FIRST_CONNECTION + WAITING_MAX] =
    [const { AtomicI32::new(-1) }; FIRST_CONNECTION + WAITING_MAX];
const DOOR_AGENT_END: usize = 0;
const DOOR_CLIENT_END: usize = 1;
const DOOR_LABEL: usize = 2;
const FIRST_CONNECTION: usize = 3;

/// Connections taken that have not sent their first request yet, at most: a newer knock
/// replaces the oldest of them.
const WAITING_MAX: usize = 8;

/// In a forked child: no agent thread exists; let a child that uses CUDA start its own, and
/// close the parent agent's door and connections, which the child inherited (a client would
/// otherwise find the parent's door in the child, and the parent's connections would stay open).
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
        client_end,
        label: _label,
    } = match installed {
        Ok(d) => d,
        Err(e) => {
            debug!("cannot make the agent's door, agent stays idle: {e}");
            return;
        }
    };
    let door = Door {
        agent: Channel::new(agent_end),
        client: client_end,
    };
    debug!("agent door open");
    let mut agent = Agent { gpu: Gpu::new() };
    loop {
        if let Err(e) = wait_readable(&door.agent) {
            if matches!(e.raw_os_error(), Some(libc::EBADF | libc::ENOTSOCK)) {
                // The application closed our descriptor: never read from that number again.
                debug!("the agent's door is gone ({e}); agent stays idle");
                return;
            }
            debug!("waiting at the door: {e}");
            std::thread::sleep(std::time::Duration::from_millis(100));
            continue;
        }
        let (conn, first) = match next_connection(&door) {
            Ok(Some(c)) => c,
            Ok(None) => continue,
            Err(Gone) => return,
        };
        let ch = Channel::new(conn.fd);
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| agent.serve(&ch, first)))
            .is_err()
        {
            debug!("agent: panic while serving a connection; closing it");
        }
        close_connection(Taken {
            fd: ch.into_fd(),
            slot: conn.slot,
            since: conn.since,
        });
    }
}

/// The agent's side of its door: its own end, and the client end it keeps for clients to copy
/// (and to replace when the door was sealed).
struct Door {
    agent: Channel,
    client: OwnedFd,
}

/// The door is unusable (the application closed its descriptor): the agent stays idle.
struct Gone;

/// A connection taken from the door: its descriptor, its slot in [`AGENT_FDS`], since when.
struct Taken {
    fd: OwnedFd,
    slot: usize,
    since: std::time::Instant,
}

/// A connection's first request, already read.
type First = (AgentRequest, Option<OwnedFd>);

/// The next connection to serve and its first request: every knock at the door is taken (while
/// a dump holds the process, only the dumper's, [`DUMPER`]) and its connection served only once
/// it sends a well-formed request, the first to do so. One that sends anything else, or that
/// closes, is closed at once; one that sends nothing for [`FIRST_REQUEST_LIMIT`], or is the
/// oldest of [`WAITING_MAX`] when another knock comes, is closed too. So neither idle knocks nor
/// garbage hold the agent from the plugin's connection, whose `Hello` follows its knock within
/// microseconds. `Ok(None)`: nothing to serve (back to waiting at the door).
fn next_connection(door: &Door) -> Result<Option<(Taken, First)>, Gone> {
    let mut waiting: Vec<Taken> = Vec::new();
    loop {
        take_knocks(door, &mut waiting)?;
        let now = std::time::Instant::now();
        for t in std::mem::take(&mut waiting) {
            if now.duration_since(t.since) >= FIRST_REQUEST_LIMIT {
                debug!("closing a connection that sent nothing for {FIRST_REQUEST_LIMIT:?}");
                close_connection(t);
            } else {
                waiting.push(t);
            }
        }
        if waiting.is_empty() {
            return Ok(None);
        }
        let mut fds: Vec<libc::pollfd> = std::iter::once(door.agent.fd().as_raw_fd())
            .chain(waiting.iter().map(|t| t.fd.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let left = waiting
            .iter()
            .map(|t| FIRST_REQUEST_LIMIT.saturating_sub(now.duration_since(t.since)))
            .min()
            .unwrap_or_default();
        // SAFETY: fds is a vector of valid pollfds of the length given.
        let n = unsafe {
            libc::poll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                left.as_millis().max(1) as i32,
            )
        };
        if n <= 0 {
            continue; // a signal, or a limit reached: looked at again above
        }
        let mut i = 0;
        for pfd in &fds[1..] {
            if pfd.revents == 0 {
                i += 1;
                continue;
            }
            let t = waiting.remove(i);
            let ch = Channel::new(t.fd);
            let outcome = ch.try_recv_request();
            let t = Taken {
                fd: ch.into_fd(),
                slot: t.slot,
                since: t.since,
            };
            match outcome {
                Ok(Some(first)) => {
                    for other in waiting {
                        close_connection(other);
                    }
                    return Ok(Some((t, first)));
                }
                Ok(None) | Err(ProtoError::Interrupted) => {
                    waiting.insert(i, t);
                    i += 1;
                }
                Err(ProtoError::Closed) => close_connection(t),
                Err(e) => {
                    debug!("closing a connection whose first request is malformed: {e}");
                    refuse_now(t.fd.as_fd(), &e);
                    close_connection(t);
                }
            }
        }
    }
}

/// Takes every knock queued at the door into `waiting` (the oldest closed to make room),
/// dropping those [`take_knock_from`] refuses and connections [`peer_allowed`] refuses; opens a
/// sealed door again.
fn take_knocks(door: &Door, waiting: &mut Vec<Taken>) -> Result<(), Gone> {
    /// What one look at the door found (a connection already recorded in [`AGENT_FDS`]).
    enum Found {
        Conn(Taken),
        Nothing,
        Malformed(&'static str),
        Refused { pid: NsPid, uid: u32 },
    }
    loop {
        // While a dump holds the process, only its knocks are taken; any other's descriptor
        // never enters the process, where CRIU would find it.
        let dumper = dumper();
        if waiting.len() >= WAITING_MAX && readable(door.agent.fd()) {
            let oldest = waiting.remove(0);
            debug!("closing the oldest connection that sent nothing: another knock waits");
            close_connection(oldest);
        }
        let fence = table::try_lock_for(AGENT_LOCK_WAIT);
        let found =
            take_knock_from(&door.agent, |pid, _| dumper == NsPid(0) || pid == dumper).map(|k| {
                match k {
                    Knock::Connection(fd) => {
                        // A slot is free: at most WAITING_MAX wait, and none is being served.
                        let slot = (FIRST_CONNECTION..AGENT_FDS.len())
                            .find(|&i| AGENT_FDS[i].load(Ordering::Acquire) < 0)
                            .unwrap_or(AGENT_FDS.len() - 1);
                        AGENT_FDS[slot].store(fd.as_raw_fd(), Ordering::Release);
                        Found::Conn(Taken {
                            fd,
                            slot,
                            since: std::time::Instant::now(),
                        })
                    }
                    Knock::Nothing => Found::Nothing,
                    Knock::Malformed(why) => Found::Malformed(why),
                    Knock::Refused { pid, uid } => Found::Refused { pid, uid },
                }
            });
        drop(fence);
        match found {
            Ok(Found::Conn(t)) if peer_allowed(&t.fd, dumper) => waiting.push(t),
            Ok(Found::Conn(t)) => close_connection(t),
            Ok(Found::Nothing) | Err(ProtoError::Closed) if door_sealed(door.agent.fd()) => {
                // A dump sealed the door, and this thread runs again: a new door at the same
                // numbers (the label still names them), every old copy of it cut off.
                match renew_door(door.agent.fd(), door.client.as_fd()) {
                    Ok(()) => {
                        // The dump that sealed it is past its CRIU part.
                        DUMPER.store(0, Ordering::Release);
                        debug!("the door was sealed; opened a new one");
                    }
                    Err(e) => {
                        debug!("the door was sealed and cannot be opened again: {e}");
                        std::thread::sleep(std::time::Duration::from_millis(100));
                    }
                }
                return Ok(());
            }
            // An empty record reads as a closed peer; the door is not shut.
            Ok(Found::Nothing) | Err(ProtoError::Closed) => return Ok(()),
            Err(ProtoError::Interrupted) => {}
            Ok(Found::Malformed(why)) => debug!("ignoring {why} at the door"),
            Ok(Found::Refused { pid, uid }) => {
                debug!(
                    "dropped a knock of pid {pid} uid {uid}: pid {dumper} is dumping the process"
                )
            }
            Err(ProtoError::Io(e))
                if matches!(e.raw_os_error(), Some(libc::EBADF | libc::ENOTSOCK)) =>
            {
                debug!("the agent's door is gone ({e}); agent stays idle");
                return Err(Gone);
            }
            Err(e) => {
                // E.g. no descriptor left for the attached socket: try again later.
                debug!("taking a knock: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
                return Ok(());
            }
        }
    }
}

/// Whether a record waits on `fd` now.
fn readable(fd: BorrowedFd<'_>) -> bool {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: pfd is one valid pollfd; a zero timeout never blocks.
    unsafe { libc::poll(&mut pfd, 1, 0) > 0 && pfd.revents & libc::POLLIN != 0 }
}

/// Closes a connection and forgets its number, under the fork fence (a child forked in between
/// would otherwise close whatever file next got that number).
fn close_connection(conn: Taken) {
    let fence = table::try_lock_for(AGENT_LOCK_WAIT);
    // Forgotten first: should the fence have timed out and a fork land in between, the child
    // leaks one descriptor rather than closing whatever file next got this number.
    AGENT_FDS[conn.slot].store(-1, Ordering::Release);
    drop(conn.fd);
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

/// Root, or the user the process runs as; during a dump by `dumper` (not 0), only a
/// connection that dumper made (a knock taken just as the sealing plugin drained the door may
/// be another's).
fn peer_allowed(conn: &OwnedFd, dumper: NsPid) -> bool {
    match peer_cred(conn.as_fd()) {
        Ok(c) if dumper != NsPid(0) && u32::try_from(c.pid).map(NsPid) != Ok(dumper) => {
            debug!(
                "refusing a connection from pid {} while pid {dumper} dumps the process",
                c.pid
            );
            false
        }
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

/// The process (its pid as this process's namespace numbers it) that began a dump of this
/// process (`DumpBegin`, `LendBegin`), until the door it seals is opened again; 0: none, or a
/// dumper outside this pid namespace (then every allowed client is taken, as before).
static DUMPER: AtomicI32 = AtomicI32::new(0);

/// [`DUMPER`], forgotten when that process is gone (CRIU killed before it sealed the door:
/// `gpusnap recover` must get in). No file is opened for it.
fn dumper() -> NsPid {
    let pid = DUMPER.load(Ordering::Acquire);
    if pid <= 0 {
        return NsPid(0);
    }
    // SAFETY: kill with signal 0 sends nothing; it only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        DUMPER.store(0, Ordering::Release);
        return NsPid(0);
    }
    NsPid(pid as u32)
}

/// The connection `ch` begins a dump: while a tracer holds the application (a checkpoint, not
/// a client copying a running job's memory), its peer is [`DUMPER`] from now on.
fn dump_begins(ch: &Channel) {
    if crate::held::by_a_tracer().is_err() {
        return;
    }
    if let Ok(c) = peer_cred(ch.fd()) {
        DUMPER.store(c.pid.max(0), Ordering::Release);
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
    /// `first`: the request the connection was taken on ([`next_connection`]).
    fn serve(&mut self, ch: &Channel, first: First) {
        let deadline = std::time::Instant::now() + SESSION_LIMIT;
        // The parent image's chunks this connection announced (`KnownChunk`), for its dump.
        let mut known = dump::KnownChunks::default();
        let mut first = Some(first);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                debug!("closing a connection that used {SESSION_LIMIT:?} without an operation");
                return;
            }
            let received = match first.take() {
                Some(m) => Ok(m),
                None => ch.recv_request(Some(left.min(IDLE_LIMIT))),
            };
            let (req, fd) = match received {
                Ok(m) => m,
                Err(ProtoError::Closed | ProtoError::Io(_)) => return,
                Err(ProtoError::Timeout) => {
                    debug!("closing a connection idle for {IDLE_LIMIT:?}");
                    return;
                }
                Err(ProtoError::Interrupted) => continue,
                // Anything malformed ends the connection at once: a client that cannot speak
                // the protocol never holds the agent (it serves one connection at a time).
                Err(e) => {
                    debug!("closing a connection that sent a malformed request: {e}");
                    refuse_now(ch.fd(), &e);
                    return;
                }
            };
            if !matches!(req, AgentRequest::Common(CommonRequest::KnownChunk { .. })) {
                debug!("request {req:?}");
            }
            let mode = match req {
                AgentRequest::PreCopyBegin { .. } => dump::Mode::Live,
                _ => dump::Mode::Stopped,
            };
            let (req, fd) = match crate::take::Take::from_message((req, fd)) {
                Ok(first) => return crate::take::run(ch, &mut self.gpu, first),
                Err(other) => other,
            };
            let sent = match (req, fd) {
                (
                    AgentRequest::Common(CommonRequest::DumpBegin {
                        slot_size,
                        slots,
                        streams,
                    })
                    | AgentRequest::PreCopyBegin {
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
                    if matches!(mode, dump::Mode::Stopped) {
                        dump_begins(ch);
                    }
                    return dump::run::<AgentRequest>(
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
                    AgentRequest::Common(CommonRequest::RestoreBegin {
                        slot_size,
                        slots,
                        streams,
                    }),
                    Some(memfd),
                ) => {
                    return restore::run::<AgentRequest>(
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
                    r @ (AgentRequest::Common(
                        CommonRequest::DumpBegin { .. } | CommonRequest::RestoreBegin { .. },
                    )
                    | AgentRequest::PreCopyBegin { .. }),
                    None,
                ) => {
                    reply(
                        ch,
                        ErrorCode::BadRequest,
                        format!("{r:?} needs the staging memfd attached"),
                    );
                    return;
                }
                (AgentRequest::Reimport { exporter_pid, id }, Some(fd)) => {
                    reimport(ch, &mut self.gpu, exporter_pid, id, fd);
                    Ok(())
                }
                (r, Some(_)) => {
                    reply(
                        ch,
                        ErrorCode::BadRequest,
                        format!("{r:?} carries no file descriptor"),
                    );
                    return;
                }
                (
                    AgentRequest::Common(CommonRequest::KnownChunk {
                        addr,
                        len,
                        device_hash,
                    }),
                    None,
                ) => {
                    if let Err(e) = known.insert(addr, len, device_hash) {
                        reply(ch, ErrorCode::BadRequest, e.to_string());
                        return;
                    }
                    Ok(())
                }
                (AgentRequest::Common(CommonRequest::LendBegin), None) => {
                    dump_begins(ch);
                    return crate::lend::run::<AgentRequest>(ch, &mut self.gpu, release_imports);
                }

                (AgentRequest::Reclaim, None) => {
                    crate::lend::reclaim(ch, &mut self.gpu);
                    return;
                }
                // Answered at once, outside an operation.
                (AgentRequest::Common(CommonRequest::Hello { version }), None)
                    if version != PROTOCOL_VERSION =>
                {
                    ch.send_reply(&Reply::Error {
                        code: ErrorCode::VersionMismatch,
                        message: format!(
                            "agent speaks protocol {PROTOCOL_VERSION}, plugin {version}"
                        ),
                    })
                }
                (AgentRequest::Common(CommonRequest::Hello { .. }), None) => {
                    ch.send_reply(&hello())
                }
                (AgentRequest::ListAllocations, None) => list(ch),
                (AgentRequest::ListSharing, None) => list_sharing(ch),
                (AgentRequest::ShareFds, None) => share_fds(ch),
                (
                    AgentRequest::ShareableSource {
                        import,
                        exporter_pid,
                        id,
                        key,
                    },
                    None,
                ) => shareable_source(ch, import, exporter_pid, id, key),
                (AgentRequest::Common(CommonRequest::Abort), None) => {
                    ch.send_reply(&Reply::Aborted)
                }
                // The steps of an operation, outside one; a `Take` or `Reimport` without the
                // memory it maps.
                (
                    other @ (AgentRequest::Common(
                        CommonRequest::SlotFree { .. }
                        | CommonRequest::Release
                        | CommonRequest::ChunkLoad { .. }
                        | CommonRequest::ChunkZero { .. }
                        | CommonRequest::RestoreDataDone,
                    )
                    | AgentRequest::Take { .. }
                    | AgentRequest::TakeEnd
                    | AgentRequest::Reimport { .. }),
                    None,
                ) => ch.send_reply(&Reply::Error {
                    code: ErrorCode::BadState,
                    message: format!("{other:?} without a DumpBegin or RestoreBegin in progress"),
                }),
            };
            if sent.is_err() {
                return;
            }
        }
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
    let count = shares.len() + shareable.len();
    for s in shares {
        ch.send_reply(&Reply::Shared(s))?;
    }
    for mut s in shareable {
        // An export's own descriptor, which a hand-over left the agent (the plugin must not
        // take it for a program's copy).
        if let (false, ShareKind::Shareable { own_fd, .. }) = (s.import, &mut s.kind) {
            *own_fd = crate::own_fds::number_at(s.addr).and_then(ForeignFd::new);
        }
        ch.send_reply(&Reply::Shared(s))?;
    }
    ch.send_reply(&Reply::SharedEnd {
        count: u32::try_from(count).unwrap_or(u32::MAX),
    })
}

/// `ShareableSource`: the plugin resolved one of this process's shareable imports.
fn shareable_source(
    ch: &Channel,
    import: u64,
    exporter_pid: NsPid,
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
fn reimport(ch: &Channel, gpu: &mut crate::gpu::Gpu, exporter_pid: NsPid, id: u64, fd: OwnedFd) {
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

/// The refusal of a malformed request, sent without waiting (a peer that does not read gets
/// nothing) just before its connection is closed.
fn refuse_now(conn: BorrowedFd<'_>, e: &ProtoError) {
    let code = match e {
        ProtoError::VersionMismatch { .. } => ErrorCode::VersionMismatch,
        _ => ErrorCode::BadRequest,
    };
    let mut buf = [0u8; gpusnap_proto::MAX_MESSAGE];
    let n = Reply::Error {
        code,
        message: e.to_string(),
    }
    .encode(&mut buf);
    // SAFETY: send of `n` initialized bytes of `buf` on a socket this thread holds; it never
    // waits and never raises SIGPIPE.
    unsafe {
        libc::send(
            conn.as_raw_fd(),
            buf.as_ptr().cast(),
            n,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
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
        // This process's own namespace's numbers; getpid's pid_t is never negative.
        pid: NsPid(pid as u32),
        tid: NsTid(tid),
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
