//! What gpusnap has done to one GPU process during a dump, as one type: [`Phase`]. Its
//! variants own what they hold (the moved data once memory is released), its transition
//! methods refuse impossible moves, and the one undo sequence ([`crate::dump::rollback`], shared
//! by a failed dump, `criu dump -R` and `gpusnap recover`) is a `match` over it.
//!
//! The phases of a dump, in order (`docs/design-notes.md`):
//!
//! ```text
//! Untouched ─lock→ Locked ─unlock→ DataOut ─release→ Released ─lock→ Relocked ─checkpoint→ Checkpointed
//!                    │                │ (split failed before release: files removed, relock)
//!                    │                └─lock→ Locked
//!                    └─checkpoint→ Checkpointed          (transparent path)
//! ```
//!
//! `Untouched` also covers a process that was already locked by someone else at PAUSE: gpusnap
//! did not lock it, so it does not unlock it.

use crate::ProcessState;
use crate::datapath::DumpData;
use gpusnap_host::pid::{HostPid, HostTid, NsPid, NsTid};
use gpusnap_image::Manifest;

/// Device data that lives only in gpusnap's image files while the process's memory is released:
/// the manifest written before the release (what a reload needs) and, in a dump, what the
/// data phase moved (for the log and the stats).
#[derive(Debug)]
pub struct MovedData {
    pub manifest: Box<Manifest>,
    pub stats: Option<Box<DumpData>>,
    /// Hand-over: the memory is not in the files (yet) but lent: the job holds it through the
    /// descriptors it kept, and the keeper drains it. `manifest` then lists the allocations
    /// only, and is never written before the drain has finished.
    pub lent: Option<Box<crate::handover::Lent>>,
}

impl MovedData {
    /// Whether the job holds its memory itself (lent, not only in files): an undo maps it back
    /// instead of reloading it.
    pub fn is_lent(&self) -> bool {
        self.lent.is_some()
    }
}

/// Where one GPU process stands in a dump.
#[derive(Debug)]
pub enum Phase {
    /// gpusnap has changed nothing (the driver state is as found at PAUSE).
    Untouched,
    /// gpusnap locked the driver state; device memory is in place.
    Locked,
    /// Split path: unlocked again so the agent can copy device memory out; memory in place.
    DataOut,
    /// Split path: the agent has been told to release its memory (some or all may be gone): the
    /// data lives only in the image files. The driver state is unlocked.
    Released(MovedData),
    /// Released, and locked again by the driver.
    Relocked(MovedData),
    /// The driver checkpointed the process (with its memory on the transparent path, control
    /// state only after a release).
    Checkpointed(Option<MovedData>),
}

pub use gpusnap_host::ImpossibleMove;

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Untouched => "untouched",
            Phase::Locked => "locked",
            Phase::DataOut => "data out",
            Phase::Released(_) => "released",
            Phase::Relocked(_) => "relocked",
            Phase::Checkpointed(_) => "checkpointed",
        }
    }

    /// Moves to the phase `next` makes of the current one, or refuses (phase unchanged).
    fn advance(
        &mut self,
        to: &'static str,
        next: impl FnOnce(Phase) -> Result<Phase, Phase>,
    ) -> Result<(), ImpossibleMove> {
        let from = self.name();
        let current = std::mem::replace(self, Phase::Untouched);
        match next(current) {
            Ok(p) => {
                *self = p;
                Ok(())
            }
            Err(p) => {
                *self = p;
                Err(ImpossibleMove { from, to })
            }
        }
    }

    /// The driver lock took: from `Untouched` (PAUSE), `DataOut` (the split path gave up before
    /// any release) or `Released` (after the release).
    pub fn locked(&mut self) -> Result<(), ImpossibleMove> {
        self.advance("locked", |p| match p {
            Phase::Untouched | Phase::DataOut => Ok(Phase::Locked),
            Phase::Released(d) => Ok(Phase::Relocked(d)),
            other => Err(other),
        })
    }

    /// The driver unlock took, for the agent's copy: only from `Locked`.
    pub fn unlocked_for_data(&mut self) -> Result<(), ImpossibleMove> {
        self.advance("data out", |p| match p {
            Phase::Locked => Ok(Phase::DataOut),
            other => Err(other),
        })
    }

    /// The release is about to be sent: from `DataOut`, taking the data that now lives only in
    /// the files.
    pub fn released(&mut self, data: MovedData) -> Result<(), ImpossibleMove> {
        self.advance("released", |p| match p {
            Phase::DataOut => Ok(Phase::Released(data)),
            other => Err(other),
        })
    }

    /// The driver checkpoint took: from `Untouched` (already locked by someone else),
    /// `Locked` or `Relocked`.
    pub fn checkpointed(&mut self) -> Result<(), ImpossibleMove> {
        self.advance("checkpointed", |p| match p {
            Phase::Untouched | Phase::Locked => Ok(Phase::Checkpointed(None)),
            Phase::Relocked(d) => Ok(Phase::Checkpointed(Some(d))),
            other => Err(other),
        })
    }

    /// [`Self::moved`], to change.
    pub fn moved_mut(&mut self) -> Option<&mut MovedData> {
        match self {
            Phase::Released(d) | Phase::Relocked(d) | Phase::Checkpointed(Some(d)) => Some(d),
            _ => None,
        }
    }

    /// The data moved out, if memory was released (whatever the driver did since).
    pub fn moved(&self) -> Option<&MovedData> {
        match self {
            Phase::Released(d) | Phase::Relocked(d) | Phase::Checkpointed(Some(d)) => Some(d),
            _ => None,
        }
    }

    /// Whether device memory is (maybe) absent: from the release until a reload.
    pub fn memory_released(&self) -> bool {
        self.moved().is_some()
    }

    /// What the driver holds the process in, by this phase.
    pub fn driver_state(&self, initial: ProcessState) -> ProcessState {
        match self {
            Phase::Untouched => initial,
            Phase::Locked | Phase::Relocked(_) => ProcessState::Locked,
            Phase::DataOut | Phase::Released(_) => ProcessState::Running,
            Phase::Checkpointed(_) => ProcessState::Checkpointed,
        }
    }

    /// The phase of a process found by `gpusnap recover`: what the driver holds it in, and the
    /// data of its interrupted dump if the agent's memory is released.
    pub fn found(driver: ProcessState, moved: Option<MovedData>) -> Phase {
        Phase::Untouched.reconciled_with(ProcessState::Running, driver, moved)
    }

    /// The phase the driver says the process is in, where a failed driver call leaves the
    /// phase in doubt (a checkpoint that failed late may have taken; a lock that failed may
    /// still hold). The data held is kept whatever the driver says.
    pub fn reconciled(self, initial: ProcessState, driver: ProcessState) -> Phase {
        if self.driver_state(initial) == driver {
            return self;
        }
        let data = match self {
            Phase::Released(d) | Phase::Relocked(d) | Phase::Checkpointed(Some(d)) => Some(d),
            _ => None,
        };
        Phase::Untouched.reconciled_with(initial, driver, data)
    }

    fn reconciled_with(
        self,
        initial: ProcessState,
        driver: ProcessState,
        data: Option<MovedData>,
    ) -> Phase {
        match (driver, data) {
            (ProcessState::Checkpointed, d) => Phase::Checkpointed(d),
            (ProcessState::Locked, Some(d)) => Phase::Relocked(d),
            (ProcessState::Running, Some(d)) => Phase::Released(d),
            (ProcessState::Locked, None) if initial == ProcessState::Locked => Phase::Untouched,
            (ProcessState::Locked, None) => Phase::Locked,
            (ProcessState::Running, None) => Phase::Untouched,
            // The driver reports something else (`Other`, or failed): keep what we know.
            (_, d) => d.map_or(Phase::Untouched, Phase::Released),
        }
    }
}

/// Where the device data goes, chosen at PAUSE.
#[derive(Debug)]
pub enum Route {
    /// The driver checkpoint copies device memory into the process; CRIU dumps it as pages.
    Transparent,
    /// The agent moves converted allocations into gpusnap's files; the driver keeps control
    /// state and whatever the agent did not take.
    Split(SplitPlan),
}

/// What the agent said while the process still ran.
#[derive(Debug)]
pub struct SplitPlan {
    /// The agent's control thread, as the process itself numbers it.
    pub agent_ns_tid: NsTid,
    pub allocations_at_pause: u32,
    pub converted_bytes_at_pause: u64,
    /// The staging ring, made while the process still ran (populating it is not free), for
    /// the allocations the agent listed then; used if they are the same at the checkpoint.
    pub early_ring: Option<(crate::staging::RingShape, crate::staging::Staging)>,
    /// The space the drain of a hand-over will write, being held since PAUSE
    /// ([`crate::space`]); joined at the checkpoint, before anything is released.
    pub early_space: Option<Box<crate::space::EarlySpace>>,
    /// The keeper started at PAUSE for a hand-over (`None`: the data is copied out first, on
    /// the job's pause; the reason is in the log).
    pub keeper: Option<crate::keeper::Keeper>,
    /// The route of each allocation, decided at PAUSE (and logged): what the keeper is lent,
    /// what is copied out first. The checkpoint lists again and says so if they changed.
    pub routes: crate::route::Routes,
}

/// One GPU process of a dump.
#[derive(Debug)]
pub struct Tracked {
    /// Host pid (what hooks get).
    pub pid: HostPid,
    /// Pid inside the process's own pid namespace (what image names use).
    pub nspid: NsPid,
    pub restore_tid: HostTid,
    /// Driver state found at PAUSE; a rollback returns the process to it.
    pub initial: ProcessState,
    pub phase: Phase,
    pub route: Route,
    /// The gpusnap agent answered at PAUSE (it records what the driver cannot checkpoint).
    pub agent: bool,
    /// Its application threads, held should CRIU die while its memory is released (placed
    /// before the release, released by the tracer once the driver lock holds the process or
    /// the memory is back).
    pub hold: Option<gpusnap_host::hold::Hold>,
    /// Phase name and seconds, in order.
    pub timings: Vec<(&'static str, f64)>,
    /// Its CUDA IPC shares through the agent, as listed at PAUSE (`crate::sharing`).
    pub shares: Vec<gpusnap_proto::Share>,
    /// This dump's claim on the process ([`gpusnap_host::joblock`]), held until the dump ends.
    pub job_lock: Option<gpusnap_host::joblock::JobLock>,
}

impl Tracked {
    pub fn is_split(&self) -> bool {
        matches!(self.route, Route::Split(_))
    }

    pub fn time(&mut self, phase: &'static str, seconds: f64) {
        self.timings.push((phase, seconds));
    }

    pub fn timings_line(&self) -> String {
        self.timings
            .iter()
            .map(|(k, v)| format!("{k} {v:.3} s"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moved() -> MovedData {
        MovedData {
            manifest: Box::new(crate::test_manifest()),
            stats: None,
            lent: None,
        }
    }

    #[test]
    fn the_split_dump_walks_its_phases_in_order() {
        let mut p = Phase::Untouched;
        p.locked().unwrap();
        p.unlocked_for_data().unwrap();
        assert!(!p.memory_released());
        p.released(moved()).unwrap();
        assert!(p.memory_released());
        p.locked().unwrap();
        assert!(matches!(p, Phase::Relocked(_)));
        p.checkpointed().unwrap();
        assert!(matches!(p, Phase::Checkpointed(Some(_))));
        assert!(
            p.memory_released(),
            "the data stays owned after the checkpoint"
        );
    }

    #[test]
    fn impossible_moves_are_refused_and_change_nothing() {
        let mut p = Phase::Untouched;
        assert_eq!(
            p.released(moved()),
            Err(ImpossibleMove {
                from: "untouched",
                to: "released"
            })
        );
        assert!(matches!(p, Phase::Untouched));
        assert!(p.unlocked_for_data().is_err());
        p.locked().unwrap();
        p.unlocked_for_data().unwrap();
        // Memory may be gone from the release on: checkpointing without the lock is refused.
        p.released(moved()).unwrap();
        assert!(p.checkpointed().is_err());
        assert!(matches!(p, Phase::Released(_)), "data kept after a refusal");
        assert!(p.unlocked_for_data().is_err());
    }

    #[test]
    fn a_split_path_that_gives_up_before_the_release_is_locked_again() {
        let mut p = Phase::Locked;
        p.unlocked_for_data().unwrap();
        p.locked().unwrap();
        assert!(matches!(p, Phase::Locked));
        p.checkpointed().unwrap();
        assert!(matches!(p, Phase::Checkpointed(None)));
    }

    #[test]
    fn the_driver_settles_a_phase_in_doubt() {
        use ProcessState::*;
        // A checkpoint that failed but took.
        let p = Phase::Locked.reconciled(Running, Checkpointed);
        assert!(matches!(p, Phase::Checkpointed(None)));
        // A checkpoint that failed and left the lock: the data stays with the phase.
        let p = Phase::Checkpointed(Some(moved())).reconciled(Running, Locked);
        assert!(matches!(p, Phase::Relocked(_)));
        // A lock that failed after the release.
        let p = Phase::Relocked(moved()).reconciled(Running, Running);
        assert!(matches!(p, Phase::Released(_)));
        // Someone else's lock is not ours to undo.
        let p = Phase::Checkpointed(None).reconciled(Locked, Locked);
        assert!(matches!(p, Phase::Untouched));
        // Agreement changes nothing.
        assert!(matches!(
            Phase::Locked.reconciled(Running, Locked),
            Phase::Locked
        ));
    }
}
