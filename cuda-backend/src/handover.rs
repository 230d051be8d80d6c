//! The hand-over route of a split dump: the job lends its device memory to the keeper across the
//! driver checkpoint, and the keeper drains it into the image while CRIU dumps the host side.
//!
//! At CHECKPOINT_DEVICES, with the application's threads held: the job's agent exports every
//! converted allocation (`LendBegin`) and keeps the descriptors; the keeper imports each one and
//! maps it at the job's address (`Adopt`); the job releases its handles (milliseconds); the
//! driver checkpoints control state only. Then [`Drain::start`] runs the agent's usual copy-out
//! in the keeper and the plugin's usual writers on a thread of their own, and the hook returns:
//! CRIU dumps the host side meanwhile. `exit` joins the drain and writes the manifest last.
//!
//! Fail closed by ownership: until the manifest is written, the job itself holds its memory
//! (the descriptors it kept), and its threads are held. So whatever dies (CRIU, the keeper, a
//! writer) the job is recoverable without any file: `-R`, a rollback and `gpusnap recover` map
//! its memory back from those descriptors (`Reclaim`).

use crate::agent::{AgentError, AgentSession, KeeperSession, LentAllocation};
use crate::datapath::{self, DataError, DumpData};
use crate::keeper::{Keeper, KeeperError};
use crate::staging::Staging;
use gpusnap_host::pid::{HostPid, NsPid};
use gpusnap_image::{AllocationRecord, Codec};
use std::os::fd::BorrowedFd;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum HandOverError {
    #[error(transparent)]
    Keeper(#[from] KeeperError),
    #[error("the keeper: {0}")]
    KeeperSession(AgentError),
    #[error(
        "the agent lent {lent} allocations but lists {listed} to move: refusing a partial hand-over"
    )]
    Incomplete { lent: usize, listed: usize },
    #[error("the keeper is gone before the drain")]
    NoKeeper,
    #[error(
        "the agent lent allocations {lent:?}, the routes say {planned:?}: refusing a hand-over other than planned"
    )]
    NotAsPlanned { lent: Vec<u64>, planned: Vec<u64> },
    #[error("the PENDING marker of an asynchronous -R could not be written: {0}")]
    Pending(String),
    #[error("no allocation of the process is lendable now")]
    NothingToLend,
    #[error(
        "the agent lent allocation {id} as (device, address, size) {lent:x?}, but listed it as {listed:x?}: refusing to map where the job alone says"
    )]
    NotAsListed {
        id: u64,
        lent: (u32, u64, u64),
        listed: (u32, u64, u64),
    },
    #[error("the agent listed allocation {id} at {addr:#x} with {size} bytes: not a range")]
    BadRange { id: u64, addr: u64, size: u64 },
    #[error("the agent listed allocations {first} and {second} overlapping")]
    Overlap { first: u64, second: u64 },
}

/// The data of a dump whose memory is lent: the keeper, and the drain once it runs (from
/// right after the job's release). The allocations are the provisional manifest's.
pub struct Lent {
    pub keeper: Option<Keeper>,
    pub drain: Option<Drain>,
    /// When the memory changed hands (for the log's time line).
    pub since: Instant,
    /// The route of each allocation (what the image records as lent).
    pub routes: crate::route::Routes,
    /// The allocations not lent but copied out first, before the release: their manifest (the
    /// one on disk until the drain has finished), what a reload after the reclaim needs.
    pub copy_first: Option<Box<gpusnap_image::Manifest>>,
    /// What that copy-first part wrote, merged with the drain's at the end.
    pub copied: Option<Box<DumpData>>,
    /// An asynchronous `-R`: the keeper holds a snapshot, and the drain waits for CRIU's end,
    /// where a process of its own runs it ([`crate::dump`]'s drainer).
    pub background: Option<Box<Background>>,
    /// An asynchronous `-R` whose snapshot took part of the lent memory: the rest is drained
    /// on the pause (`drain`), and once that is joined at CRIU's end, the snapshot's drain
    /// ([`Background`]) is made of it and this.
    pub deferred: Option<Box<Deferred>>,
}

/// The snapshot's part of an asynchronous `-R` that took part of the lent memory, while the
/// rest is drained on the pause: what its drain needs that the pause's drain does not give back.
pub struct Deferred {
    /// The allocations in the snapshot, by id.
    pub ids: std::collections::BTreeSet<u64>,
    /// Space held for the snapshot's drain (split off the hand-over's at the checkpoint).
    pub reserved: Option<gpusnap_image::Reservation>,
}

/// The drain of an asynchronous `-R`, deferred until CRIU's own part is over: the keeper's
/// session (its memory is the snapshot, not the job's) and what the drain needs.
pub struct Background {
    pub session: KeeperSession,
    pub job: DrainJob,
}

impl Lent {
    /// Memory a job lent in a dump that did not finish, found by `gpusnap recover` (the job's
    /// agent says it keeps the descriptors): nothing to drain, only to reclaim, and, for a
    /// process with a copy-first part, that part's manifest, if the image directory has it.
    pub fn found_kept(copy_first: Option<gpusnap_image::Manifest>) -> Lent {
        Lent {
            keeper: None,
            drain: None,
            since: Instant::now(),
            routes: Default::default(),
            copy_first: copy_first.map(Box::new),
            copied: None,
            background: None,
            deferred: None,
        }
    }
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lent")
            .field("keeper", &self.keeper.as_ref().map(Keeper::pid))
            .field("draining", &self.drain.is_some())
            .finish()
    }
}

/// How long the parts of a lend took, for the log: the whole of it (the job's exports and the
/// keeper's adoptions overlap), one keeper round trip (a `Hello`, measured before: what an
/// adoption costs apart from the keeper's import and mapping), the time spent waiting for the
/// keeper's answers, and the most adoptions in flight at once.
#[derive(Debug, Clone, Copy, Default)]
pub struct LendTimes {
    pub total_s: f64,
    pub round_trip_s: f64,
    pub adopt_wait_s: f64,
    pub most_in_flight: usize,
}

/// Most `Adopt`s sent to the keeper before its answers are read: the keeper answers one after
/// the other, so this bounds its queued answers (and the descriptors in flight) far below any
/// socket buffer, and no side can block the other.
pub const ADOPT_WINDOW: usize = 64;

/// Exports the job's memory and has the keeper adopt all of it, pipelined: each allocation the
/// job lends is checked against its listing and sent to the keeper as it arrives, with up to
/// [`ADOPT_WINDOW`] adoptions in flight, so the job's exports, the keeper's imports and the
/// round trips overlap instead of adding up (issue 36, item 3). Returns how many allocations
/// and how long the parts took. Nothing of the job is changed if this fails (its agent is told
/// to abort, which closes the copies; the keeper's imports go with the keeper).
pub fn lend_to_keeper(
    session: &AgentSession,
    keeper: &Keeper,
    routes: &crate::route::Routes,
) -> Result<(usize, LendTimes), HandOverError> {
    let t0 = Instant::now();
    let listed = listed_to_lend(routes)?;
    let ks = keeper.session().ok_or(HandOverError::NoKeeper)?;
    let mut times = LendTimes::default();
    let t = Instant::now();
    ks.hello().map_err(HandOverError::KeeperSession)?;
    times.round_trip_s = t.elapsed().as_secs_f64();
    let mut seen = std::collections::BTreeSet::new();
    let mut in_flight = std::collections::VecDeque::with_capacity(ADOPT_WINDOW);
    let answer = |in_flight: &mut std::collections::VecDeque<crate::agent::Moved>,
                  times: &mut LendTimes|
     -> Result<(), HandOverError> {
        let Some(sent) = in_flight.pop_front() else {
            return Ok(());
        };
        let t = Instant::now();
        let r = ks.adopted(sent).map_err(HandOverError::KeeperSession);
        times.adopt_wait_s += t.elapsed().as_secs_f64();
        r
    };
    let lent = session.lend_each(|l: LentAllocation| {
        as_listed_one(&l, &listed, &mut seen)?;
        ks.send_adopt(&l).map_err(HandOverError::KeeperSession)?;
        in_flight.push_back(crate::agent::Moved {
            id: l.id,
            addr: l.addr,
            size: l.size,
        });
        times.most_in_flight = times.most_in_flight.max(in_flight.len());
        // `l` is dropped here: our copy of the descriptor closes (the message in flight holds
        // its own); the job and, once adopted, the keeper hold the memory.
        if in_flight.len() >= ADOPT_WINDOW {
            answer(&mut in_flight, &mut times)?;
        }
        Ok(())
    });
    let lent = match lent {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => {
            session.abort();
            return Err(e);
        }
        Err(e) => {
            session.abort();
            return Err(HandOverError::KeeperSession(e));
        }
    };
    while !in_flight.is_empty() {
        if let Err(e) = answer(&mut in_flight, &mut times) {
            session.abort();
            return Err(e);
        }
    }
    let planned = routes.lend_ids();
    if lent != planned.len() || seen != planned {
        session.abort();
        if lent != planned.len() {
            return Err(HandOverError::Incomplete {
                lent,
                listed: planned.len(),
            });
        }
        return Err(HandOverError::NotAsPlanned {
            lent: seen.into_iter().collect(),
            planned: planned.into_iter().collect(),
        });
    }
    times.total_s = t0.elapsed().as_secs_f64();
    Ok((lent, times))
}

/// The allocations the routes lend, by id, their ranges checked before root's keeper maps
/// anything: not empty, not wrapping, not overlapping (one unified address space on every
/// GPU).
fn listed_to_lend(
    routes: &crate::route::Routes,
) -> Result<std::collections::BTreeMap<u64, (u32, u64, u64)>, HandOverError> {
    let mut listed = std::collections::BTreeMap::new();
    let mut ranges = Vec::new();
    for (a, r) in &routes.0 {
        if *r != crate::route::AllocRoute::Lend {
            continue;
        }
        let end = a.addr.checked_add(a.size).filter(|_| a.size > 0);
        let Some(end) = end else {
            return Err(HandOverError::BadRange {
                id: a.id,
                addr: a.addr,
                size: a.size,
            });
        };
        ranges.push((a.addr, end, a.id));
        listed.insert(a.id, (a.device, a.addr, a.size));
    }
    ranges.sort_unstable();
    if let Some(w) = ranges.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(HandOverError::Overlap {
            first: w[0].2,
            second: w[1].2,
        });
    }
    Ok(listed)
}

/// Checks one lent allocation against the job's own listing before root's keeper maps it: an
/// id planned to be lent and not lent before, on the same device, address and size as
/// listed. The agent's `Lent` replies are the job's words; the keeper must not map where they
/// alone say.
fn as_listed_one(
    l: &LentAllocation,
    listed: &std::collections::BTreeMap<u64, (u32, u64, u64)>,
    seen: &mut std::collections::BTreeSet<u64>,
) -> Result<(), HandOverError> {
    let Some(&(device, addr, size)) = listed.get(&l.id) else {
        return Err(HandOverError::NotAsPlanned {
            lent: seen.iter().copied().chain([l.id]).collect(),
            planned: listed.keys().copied().collect(),
        });
    };
    if !seen.insert(l.id) {
        return Err(HandOverError::NotAsPlanned {
            lent: seen.iter().copied().chain([l.id]).collect(),
            planned: listed.keys().copied().collect(),
        });
    }
    if (l.device, l.addr, l.size) != (device, addr, size) {
        return Err(HandOverError::NotAsListed {
            id: l.id,
            lent: (l.device, l.addr, l.size),
            listed: (device, addr, size),
        });
    }
    Ok(())
}

/// [`listed_to_lend`] and [`as_listed_one`] over a whole lend (the unit tests' view).
#[cfg(test)]
fn as_listed(lent: &[LentAllocation], routes: &crate::route::Routes) -> Result<(), HandOverError> {
    let listed = listed_to_lend(routes)?;
    let mut seen = std::collections::BTreeSet::new();
    lent.iter()
        .try_for_each(|l| as_listed_one(l, &listed, &mut seen))
}

/// What a drain needs besides the keeper.
pub struct DrainJob {
    pub staging: Staging,
    pub dir: BorrowedFd<'static>,
    pub pid: HostPid,
    pub nspid: NsPid,
    pub writers: usize,
    /// Threads that read the parent image back before anything of it is referenced.
    pub readers: usize,
    pub codec: Codec,
    /// What the job holds, for matching a parent image (an incremental dump).
    pub allocations: Vec<AllocationRecord>,
    pub incremental: bool,
    pub limits: datapath::Limits,
    pub durable: bool,
    /// The first data file number (those below belong to the copy-first part).
    pub first_file: u32,
    /// Space held in the image directory for the drain's data, taken while the dump could
    /// still fail (`None` where the file system cannot hold space).
    pub reserved: Option<gpusnap_image::Reservation>,
}

/// What a drain thread gives back: what it wrote, the keeper's session, and its job (the
/// ring, for a drain that follows on the same keeper).
type DrainEnd = (Result<DumpData, DataError>, KeeperSession, DrainJob);

/// The keeper's copy-out with the plugin's writers, on a thread of its own.
pub struct Drain {
    handle: std::thread::JoinHandle<DrainEnd>,
    started: Instant,
}

/// A finished drain: what it wrote, and when it ran.
pub struct Drained {
    pub data: Result<DumpData, DataError>,
    /// The keeper's session, given back: dropping it lets the keeper exit (only once CRIU's
    /// own part is over).
    pub session: Option<KeeperSession>,
    /// The drain's job, given back (its ring serves the snapshot's drain that may follow).
    pub job: Option<DrainJob>,
    pub ran_s: f64,
    /// How long the join waited (time CRIU's own dump did not cover).
    pub waited_s: f64,
}

impl Drain {
    /// Starts draining through `session` (the keeper's), which the thread releases at the end.
    pub fn start(session: KeeperSession, job: DrainJob) -> std::io::Result<Drain> {
        let started = Instant::now();
        let handle = std::thread::Builder::new()
            .name("gpusnap-drain".into())
            .spawn(move || {
                gpusnap_host::signals::block_all();
                // CRIU's main thread logs meanwhile, through one unlocked buffer.
                gpusnap_host::logger::defer_this_thread();
                let DrainJob {
                    ref staging,
                    dir,
                    pid,
                    nspid,
                    writers,
                    readers,
                    codec,
                    ref allocations,
                    incremental,
                    limits,
                    durable,
                    first_file,
                    ref reserved,
                } = job;
                // The parent image is checked beside the copy, not before it (issue 36, item
                // 2): the copy compares against the parent's chunks at once, and nothing of
                // the parent reaches the image unless the check passes. A parent found damaged
                // is replaced by a second, full copy from the memory the keeper still holds.
                let candidate =
                    crate::parent::parent_candidate(dir, pid, nspid, allocations, incremental);
                let copy = |parent: Option<&gpusnap_image::DedupIndex>, first_file: u32| {
                    datapath::copy_out_into(
                        &session,
                        staging,
                        dir,
                        nspid,
                        first_file,
                        writers,
                        codec,
                        parent,
                        limits,
                        durable,
                        reserved.as_ref(),
                    )
                };
                let data = match candidate.as_ref() {
                    None => copy(None, first_file),
                    Some(index) => std::thread::scope(|s| {
                        let check = s.spawn(|| {
                            gpusnap_host::signals::block_all();
                            gpusnap_host::logger::defer_this_thread();
                            crate::parent::parent_checked(dir, pid, nspid, readers)
                        });
                        let data = copy(Some(index), first_file);
                        // A check thread that panicked counts as a damaged parent.
                        let whole = check.join().unwrap_or(false);
                        match data {
                            Ok(d) if !whole && d.referenced_chunks > 0 => {
                                gpusnap_host::fault::kill_criu_beside_at("dump-parent-damaged");
                                recopy_fresh(dir, pid, d, |next| copy(None, next))
                            }
                            other => other,
                        }
                    }),
                };
                let data = data.and_then(|data| {
                    gpusnap_host::fault::kill_criu_beside_at("dump-drained");
                    // The keeper drops its imports; the job still holds the memory.
                    session.release_keeper().map_err(DataError::from)?;
                    Ok(data)
                });
                (data, session, job)
            })?;
        Ok(Drain { handle, started })
    }

    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the drain.
    pub fn join(self) -> Drained {
        let t0 = Instant::now();
        let (data, session, job) = match self.handle.join() {
            Ok((data, session, job)) => (data, Some(session), Some(job)),
            Err(_) => (Err(DataError::Panicked("the drain thread")), None, None),
        };
        Drained {
            data,
            session,
            job,
            ran_s: self.started.elapsed().as_secs_f64(),
            waited_s: t0.elapsed().as_secs_f64(),
        }
    }
}

/// A parent found damaged after the copy referenced some of its chunks: the copy's files are
/// removed and everything is copied again, with no parent, from the memory the keeper still
/// holds (its imports are released only after this), into data files numbered after the first
/// copy's. Nothing the first copy wrote reaches the manifest.
fn recopy_fresh(
    dir: BorrowedFd<'_>,
    pid: HostPid,
    first: DumpData,
    copy: impl FnOnce(u32) -> Result<DumpData, DataError>,
) -> Result<DumpData, DataError> {
    let t0 = Instant::now();
    let next = first
        .files
        .iter()
        .filter_map(|f| match gpusnap_image::parse_file_name(&f.name) {
            Some(gpusnap_image::ImageFileKind::Data { index, .. }) => Some(index),
            _ => None,
        })
        .max()
        .map_or(0, |n| n.saturating_add(1));
    for f in &first.files {
        if let Err(e) = gpusnap_image::remove_data_file(dir, &f.name) {
            log::warn!(
                "pid {pid}: {}: not removed ({e}); the manifest does not name it",
                f.name
            );
        }
    }
    let data = copy(next)?;
    log::info!(
        "pid {pid}: the parent's {} referenced chunks written fresh from the keeper's memory: a full copy again in {:.3} s",
        first.referenced_chunks,
        t0.elapsed().as_secs_f64()
    );
    Ok(data)
}

/// Creates `name` in `dir` with `text`, never following or reusing a file planted there
/// (`O_EXCL|O_NOFOLLOW`): the NOT-A-CHECKPOINT marker, from the plugin and from the drainer.
pub fn write_new_marker(dir: BorrowedFd<'_>, name: &str, text: &str) -> std::io::Result<()> {
    let c = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    // SAFETY: openat on the image dir's descriptor with a NUL-terminated name;
    // O_EXCL|O_NOFOLLOW never follows or reuses a file planted there.
    let fd = unsafe {
        libc::openat(
            std::os::fd::AsRawFd::as_raw_fd(&dir),
            c.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o600,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by the File from here on.
    let mut f = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    std::io::Write::write_all(&mut f, text.as_bytes())
}

/// Writes (or replaces, atomically) the PENDING marker of process `nspid`, naming this
/// process as the one that writes the data ([`gpusnap_image::pending_text`]).
pub fn write_pending(dir: BorrowedFd<'_>, nspid: NsPid, words: &str) -> std::io::Result<()> {
    // SAFETY: getpid has no preconditions.
    let me = HostPid(unsafe { libc::getpid() });
    let start = std::fs::read_to_string(format!("/proc/{me}/stat"))
        .ok()
        .and_then(|s| gpusnap_host::procfs::Stat::parse(&s).and_then(|s| s.start_time()))
        .unwrap_or(0);
    let name = gpusnap_image::pending_marker_name(nspid);
    let tmp = format!("{name}.tmp");
    let _ = unlink_at(dir, &tmp);
    write_new_marker(dir, &tmp, &gpusnap_image::pending_text(me, start, words))?;
    let (a, b) = (
        std::ffi::CString::new(tmp).map_err(std::io::Error::other)?,
        std::ffi::CString::new(name).map_err(std::io::Error::other)?,
    );
    let raw = std::os::fd::AsRawFd::as_raw_fd(&dir);
    // SAFETY: renameat within the image directory with NUL-terminated names.
    if unsafe { libc::renameat(raw, a.as_ptr(), raw, b.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Removes `name` from `dir` (a marker).
pub fn unlink_at(dir: BorrowedFd<'_>, name: &str) -> std::io::Result<()> {
    let c = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    // SAFETY: unlinkat on the image dir's descriptor with a NUL-terminated name.
    if unsafe { libc::unlinkat(std::os::fd::AsRawFd::as_raw_fd(&dir), c.as_ptr(), 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Stops a drain that must not finish (the dump failed): ends the keeper (its connection goes,
/// so the drain's reads fail at once) and joins the thread.
pub fn abandon(lent: &mut Lent) {
    // Killing the keeper makes every pending read of the drain fail; its imports go with it.
    if let Some(k) = &lent.keeper {
        k.kill();
    }
    if let Some(d) = lent.drain.take() {
        let _ = d.join();
    }
    lent.background.take();
    lent.deferred.take();
    lent.keeper.take();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::{AllocRoute, Routes};
    use gpusnap_image::AllocationRecord;

    fn record(id: u64, addr: u64, size: u64) -> AllocationRecord {
        AllocationRecord {
            id,
            device: 0,
            addr,
            size,
            moved: true,
            lent: true,
            rdma_capable: false,
        }
    }

    fn lent(id: u64, addr: u64, size: u64) -> LentAllocation {
        LentAllocation {
            id,
            device: 0,
            addr,
            size,
            rdma_capable: false,
            fd: std::fs::File::open("/dev/null").unwrap().into(),
        }
    }

    fn routes(records: &[AllocationRecord]) -> Routes {
        Routes(
            records
                .iter()
                .map(|r| (r.clone(), AllocRoute::Lend))
                .collect(),
        )
    }

    #[test]
    fn a_lend_must_be_as_the_job_listed() {
        let r = routes(&[
            record(1, 0x10_0000, 0x20_0000),
            record(2, 0x40_0000, 0x20_0000),
        ]);
        as_listed(
            &[lent(1, 0x10_0000, 0x20_0000), lent(2, 0x40_0000, 0x20_0000)],
            &r,
        )
        .unwrap();
        // Another address or size than listed: refused before the keeper maps anything.
        let e = as_listed(
            &[lent(1, 0x10_0000, 0x20_0000), lent(2, 0x80_0000, 0x20_0000)],
            &r,
        )
        .unwrap_err();
        assert!(matches!(e, HandOverError::NotAsListed { id: 2, .. }), "{e}");
        let e = as_listed(&[lent(1, 0x10_0000, 0x40_0000)], &r).unwrap_err();
        assert!(matches!(e, HandOverError::NotAsListed { id: 1, .. }), "{e}");
        // An id that was never listed.
        let e = as_listed(&[lent(3, 0x10_0000, 0x20_0000)], &r).unwrap_err();
        assert!(matches!(e, HandOverError::NotAsPlanned { .. }), "{e}");
    }

    #[test]
    fn listed_ranges_must_be_well_formed() {
        let overlapping = routes(&[
            record(1, 0x10_0000, 0x20_0000),
            record(2, 0x20_0000, 0x20_0000),
        ]);
        let e = as_listed(
            &[lent(1, 0x10_0000, 0x20_0000), lent(2, 0x20_0000, 0x20_0000)],
            &overlapping,
        )
        .unwrap_err();
        assert!(matches!(e, HandOverError::Overlap { .. }), "{e}");
        let wrapping = routes(&[record(1, u64::MAX - 10, 0x20_0000)]);
        let e = as_listed(&[lent(1, u64::MAX - 10, 0x20_0000)], &wrapping).unwrap_err();
        assert!(matches!(e, HandOverError::BadRange { .. }), "{e}");
        let empty = routes(&[record(1, 0x10_0000, 0)]);
        let e = as_listed(&[lent(1, 0x10_0000, 0)], &empty).unwrap_err();
        assert!(matches!(e, HandOverError::BadRange { .. }), "{e}");
    }
}
