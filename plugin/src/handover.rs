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

use crate::agent::{AgentError, AgentSession, LentAllocation};
use crate::datapath::{self, DataError, DumpData};
use crate::keeper::{Keeper, KeeperError};
use crate::staging::Staging;
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
    #[error("no allocation of the process is lendable now")]
    NothingToLend,
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

/// How long the parts of a lend took, for the log: the job's exports, the keeper's first
/// `Adopt` and the others (the first one waited for the keeper's CUDA start until the plugin
/// waited for the keeper before the lock; the split shows that it no longer does).
#[derive(Debug, Clone, Copy, Default)]
pub struct LendTimes {
    pub export_s: f64,
    pub first_adopt_s: f64,
    pub other_adopts_s: f64,
}

/// Exports the job's memory and has the keeper adopt all of it; returns how many allocations
/// and how long the parts took. Nothing of the job is changed if this fails (its agent is told
/// to abort, which closes the copies).
pub fn lend_to_keeper(
    session: &AgentSession,
    keeper: &Keeper,
    routes: &crate::route::Routes,
) -> Result<(usize, LendTimes), HandOverError> {
    let t0 = Instant::now();
    let lent: Vec<LentAllocation> = session.lend().map_err(HandOverError::KeeperSession)?;
    let mut times = LendTimes {
        export_s: t0.elapsed().as_secs_f64(),
        ..LendTimes::default()
    };
    let listed = routes.lent();
    if lent.len() != listed {
        session.abort();
        return Err(HandOverError::Incomplete {
            lent: lent.len(),
            listed,
        });
    }
    let ids: std::collections::BTreeSet<u64> = lent.iter().map(|l| l.id).collect();
    if ids != routes.lend_ids() {
        session.abort();
        return Err(HandOverError::NotAsPlanned {
            lent: ids.into_iter().collect(),
            planned: routes.lend_ids().into_iter().collect(),
        });
    }
    let ks = keeper.session().ok_or(HandOverError::NoKeeper)?;
    for (i, l) in lent.iter().enumerate() {
        let t = Instant::now();
        if let Err(e) = ks.adopt(l) {
            session.abort();
            return Err(HandOverError::KeeperSession(e));
        }
        let took = t.elapsed().as_secs_f64();
        if i == 0 {
            times.first_adopt_s = took;
        } else {
            times.other_adopts_s += took;
        }
    }
    // `lent` is dropped here: our copies of the descriptors close; the job and the keeper
    // hold the memory.
    Ok((lent.len(), times))
}

/// What a drain needs besides the keeper.
pub struct DrainJob {
    pub staging: Staging,
    pub dir: BorrowedFd<'static>,
    pub pid: i32,
    pub nspid: u32,
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
}

/// The keeper's copy-out with the plugin's writers, on a thread of its own.
pub struct Drain {
    handle: std::thread::JoinHandle<(Result<DumpData, DataError>, AgentSession)>,
    started: Instant,
}

/// A finished drain: what it wrote, and when it ran.
pub struct Drained {
    pub data: Result<DumpData, DataError>,
    /// The keeper's session, given back: dropping it lets the keeper exit (only once CRIU's
    /// own part is over).
    pub session: Option<AgentSession>,
    pub ran_s: f64,
    /// How long the join waited (time CRIU's own dump did not cover).
    pub waited_s: f64,
}

impl Drain {
    /// Starts draining through `session` (the keeper's), which the thread releases at the end.
    pub fn start(session: AgentSession, job: DrainJob) -> std::io::Result<Drain> {
        let started = Instant::now();
        let handle = std::thread::Builder::new()
            .name("gpusnap-drain".into())
            .spawn(move || {
                crate::signals::block_all();
                // CRIU's main thread logs meanwhile, through one unlocked buffer.
                crate::logger::defer_this_thread();
                let DrainJob {
                    staging,
                    dir,
                    pid,
                    nspid,
                    writers,
                    readers,
                    codec,
                    allocations,
                    incremental,
                    limits,
                    durable,
                    first_file,
                } = job;
                // The parent image is read back and checked here, beside CRIU's dump: the
                // job's memory is still whole, so what a damaged parent lacks is written fresh.
                let parent = crate::parent::parent_index(
                    dir,
                    pid,
                    nspid,
                    &allocations,
                    incremental,
                    readers,
                );
                let data = datapath::copy_out_into(
                    &session,
                    &staging,
                    dir,
                    nspid,
                    first_file,
                    writers,
                    codec,
                    parent.as_ref(),
                    limits,
                    durable,
                    datapath::Round::Paused,
                )
                .and_then(|data| {
                    crate::fault::kill_criu_beside_at("dump-drained");
                    // The keeper drops its imports; the job still holds the memory.
                    session.release_keeper().map_err(DataError::from)?;
                    Ok(data)
                });
                (data, session)
            })?;
        Ok(Drain { handle, started })
    }

    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the drain.
    pub fn join(self) -> Drained {
        let t0 = Instant::now();
        let (data, session) = match self.handle.join() {
            Ok((data, session)) => (data, Some(session)),
            Err(_) => (Err(DataError::Panicked("the drain thread")), None),
        };
        Drained {
            data,
            session,
            ran_s: self.started.elapsed().as_secs_f64(),
            waited_s: t0.elapsed().as_secs_f64(),
        }
    }
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
    lent.keeper.take();
}
