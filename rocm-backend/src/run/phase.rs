//! Where one AMD process stands, as one type per operation: [`DumpPhase`] in a dump and
//! [`RestorePhase`] in a restore. Variants own what they hold (the dump's dup of the process's
//! KFD file while its queues are paused), transition methods refuse impossible moves with
//! [`ImpossibleMove`] (the phase unchanged), and every undo is a `match` over the phase.
//!
//! A dump (all in `DUMP_EXT_FILE` of the process's `/dev/kfd`, then CRIU's `exit`):
//!
//! ```text
//! Untouched ─PROCESS_INFO→ Paused ─CHECKPOINT, image written→ Checkpointed ─CRIU dumped→ Dumped
//!                            │                                   │
//!                            └──────────── UNPAUSE ──────────────┴──→ Unpaused
//!                                       (UNPAUSE failed: killed) ────→ Killed
//! ```
//!
//! A restore (init and `RESUME_DEVICES_LATE` in CRIU; the middle in the restored task's own
//! copy of the plugin, which CRIU forked from CRIU's after init):
//!
//! ```text
//! Planned ─RESTORE (task)→ StateRestored ─contents written, mappings translated (task)→ Loaded
//! Planned ─RESUME (CRIU)→ Resumed
//! Planned ─RESUME failed or impossible: killed (CRIU)→ Killed
//! ```

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use crate::kfd::ProcessInfo;

pub use gpusnap_host::ImpossibleMove;

/// Where one AMD process stands in a dump.
#[derive(Debug)]
pub enum DumpPhase {
    /// gpusnap has not touched the process's queues.
    Untouched,
    /// PROCESS_INFO paused its queues; nothing of its image is written. `kfd`: a dup of the
    /// process's KFD file (the kernel acts on the process that opened it).
    Paused { kfd: OwnedFd, info: ProcessInfo },
    /// CHECKPOINT taken and the whole image written; its queues are still paused.
    Checkpointed { kfd: OwnedFd, info: ProcessInfo },
    /// Its queues run again (UNPAUSE): after `criu dump -R` or a failure. Nothing to undo.
    Unpaused,
    /// Killed because its queues could not be started again. Nothing to undo.
    Killed,
    /// CRIU dumped it and ends it. Nothing to undo.
    Dumped,
}

impl DumpPhase {
    pub fn name(&self) -> &'static str {
        match self {
            DumpPhase::Untouched => "untouched",
            DumpPhase::Paused { .. } => "paused",
            DumpPhase::Checkpointed { .. } => "checkpointed",
            DumpPhase::Unpaused => "unpaused",
            DumpPhase::Killed => "killed",
            DumpPhase::Dumped => "dumped",
        }
    }

    fn advance(
        &mut self,
        to: &'static str,
        next: impl FnOnce(DumpPhase) -> Result<DumpPhase, DumpPhase>,
    ) -> Result<(), ImpossibleMove> {
        let from = self.name();
        let current = std::mem::replace(self, DumpPhase::Untouched);
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

    /// PROCESS_INFO took: only from `Untouched`.
    pub fn paused(&mut self, kfd: OwnedFd, info: ProcessInfo) -> Result<(), ImpossibleMove> {
        self.advance("paused", |p| match p {
            DumpPhase::Untouched => Ok(DumpPhase::Paused { kfd, info }),
            other => Err(other),
        })
    }

    /// CHECKPOINT took and the image is whole: only from `Paused`.
    pub fn checkpointed(&mut self) -> Result<(), ImpossibleMove> {
        self.advance("checkpointed", |p| match p {
            DumpPhase::Paused { kfd, info } => Ok(DumpPhase::Checkpointed { kfd, info }),
            other => Err(other),
        })
    }

    /// UNPAUSE took: from `Paused` or `Checkpointed` (the KFD file is closed).
    pub fn unpaused(&mut self) -> Result<(), ImpossibleMove> {
        self.advance("unpaused", |p| match p {
            DumpPhase::Paused { .. } | DumpPhase::Checkpointed { .. } => Ok(DumpPhase::Unpaused),
            other => Err(other),
        })
    }

    /// Killed with its queues stopped: from `Paused` or `Checkpointed`.
    pub fn killed(&mut self) -> Result<(), ImpossibleMove> {
        self.advance("killed", |p| match p {
            DumpPhase::Paused { .. } | DumpPhase::Checkpointed { .. } => Ok(DumpPhase::Killed),
            other => Err(other),
        })
    }

    /// CRIU's dump succeeded: only from `Checkpointed` (a process that was never checkpointed
    /// is not dumped).
    pub fn dumped(&mut self) -> Result<(), ImpossibleMove> {
        self.advance("dumped", |p| match p {
            DumpPhase::Checkpointed { .. } => Ok(DumpPhase::Dumped),
            other => Err(other),
        })
    }

    /// The process's KFD file, while its queues are paused (what an UNPAUSE needs).
    pub fn kfd(&self) -> Option<BorrowedFd<'_>> {
        match self {
            DumpPhase::Paused { kfd, .. } | DumpPhase::Checkpointed { kfd, .. } => {
                Some(kfd.as_fd())
            }
            _ => None,
        }
    }

    /// What PROCESS_INFO said, while its queues are paused.
    pub fn info(&self) -> Option<&ProcessInfo> {
        match self {
            DumpPhase::Paused { info, .. } | DumpPhase::Checkpointed { info, .. } => Some(info),
            _ => None,
        }
    }
}

/// Where one AMD process stands in a restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestorePhase {
    /// Checked at init (image, checksums, GPUs matched); nothing of it exists yet.
    Planned,
    /// In the restored task: RESTORE re-created its KFD state; its buffer objects' contents
    /// are not (all) written back.
    StateRestored,
    /// In the restored task: contents written back and `mappings` device mappings translated;
    /// its queues wait for RESUME.
    Loaded { mappings: usize },
    /// In CRIU: RESUME started its queues; it may run.
    Resumed,
    /// In CRIU: killed before it ran (its queues could not be started).
    Killed,
}

impl RestorePhase {
    pub fn name(&self) -> &'static str {
        match self {
            RestorePhase::Planned => "planned",
            RestorePhase::StateRestored => "state restored",
            RestorePhase::Loaded { .. } => "loaded",
            RestorePhase::Resumed => "resumed",
            RestorePhase::Killed => "killed",
        }
    }

    fn advance(
        &mut self,
        to: &'static str,
        next: impl FnOnce(&RestorePhase) -> Option<RestorePhase>,
    ) -> Result<(), ImpossibleMove> {
        match next(self) {
            Some(p) => {
                *self = p;
                Ok(())
            }
            None => Err(ImpossibleMove {
                from: self.name(),
                to,
            }),
        }
    }

    /// RESTORE took, in the restored task: only from `Planned`.
    pub fn state_restored(&mut self) -> Result<(), ImpossibleMove> {
        self.advance("state restored", |p| {
            matches!(p, RestorePhase::Planned).then_some(RestorePhase::StateRestored)
        })
    }

    /// Contents back and mappings translated: only from `StateRestored`.
    pub fn loaded(&mut self, mappings: usize) -> Result<(), ImpossibleMove> {
        self.advance("loaded", |p| {
            matches!(p, RestorePhase::StateRestored).then_some(RestorePhase::Loaded { mappings })
        })
    }

    /// RESUME took, in CRIU: only from `Planned` (CRIU's copy never sees the task's steps).
    pub fn resumed(&mut self) -> Result<(), ImpossibleMove> {
        self.advance("resumed", |p| {
            matches!(p, RestorePhase::Planned).then_some(RestorePhase::Resumed)
        })
    }

    /// Killed before it ran, in CRIU: only from `Planned`.
    pub fn killed(&mut self) -> Result<(), ImpossibleMove> {
        self.advance("killed", |p| {
            matches!(p, RestorePhase::Planned).then_some(RestorePhase::Killed)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> ProcessInfo {
        ProcessInfo {
            pid: gpusnap_host::pid::NsPid(7),
            num_devices: 1,
            num_bos: 2,
            num_objects: 3,
            priv_data_size: 4,
        }
    }

    fn fd() -> OwnedFd {
        std::fs::File::open("/dev/null").unwrap().into()
    }

    #[test]
    fn a_dump_moves_in_order_and_refuses_the_rest() {
        let mut p = DumpPhase::Untouched;
        assert!(p.kfd().is_none());
        assert_eq!(
            p.checkpointed(),
            Err(ImpossibleMove {
                from: "untouched",
                to: "checkpointed"
            })
        );
        assert_eq!(p.unpaused().unwrap_err().from, "untouched");
        p.paused(fd(), info()).unwrap();
        assert!(p.kfd().is_some());
        assert_eq!(p.info(), Some(&info()));
        assert_eq!(p.dumped().unwrap_err().from, "paused", "never checkpointed");
        assert_eq!(p.name(), "paused", "a refused move leaves the phase");
        assert_eq!(p.paused(fd(), info()).unwrap_err().from, "paused");
        p.checkpointed().unwrap();
        assert!(p.kfd().is_some(), "the KFD file is held until the undo");
        p.dumped().unwrap();
        assert!(p.kfd().is_none());
        assert_eq!(p.unpaused().unwrap_err().from, "dumped");
        assert_eq!(p.killed().unwrap_err().from, "dumped");
    }

    #[test]
    fn a_dump_is_undone_from_either_paused_phase() {
        for checkpointed in [false, true] {
            let mut p = DumpPhase::Untouched;
            p.paused(fd(), info()).unwrap();
            if checkpointed {
                p.checkpointed().unwrap();
            }
            let mut q = DumpPhase::Untouched;
            q.paused(fd(), info()).unwrap();
            p.unpaused().unwrap();
            q.killed().unwrap();
            assert_eq!((p.name(), q.name()), ("unpaused", "killed"));
            assert!(p.kfd().is_none() && q.kfd().is_none());
            assert_eq!(p.killed().unwrap_err().from, "unpaused");
        }
    }

    #[test]
    fn a_restore_moves_in_order_and_refuses_the_rest() {
        let mut p = RestorePhase::Planned;
        assert_eq!(p.loaded(2).unwrap_err().from, "planned");
        p.state_restored().unwrap();
        assert_eq!(p.resumed().unwrap_err().from, "state restored");
        p.loaded(2).unwrap();
        assert_eq!(p, RestorePhase::Loaded { mappings: 2 });
        let mut c = RestorePhase::Planned;
        c.resumed().unwrap();
        assert_eq!(c.killed().unwrap_err().from, "resumed");
        let mut k = RestorePhase::Planned;
        k.killed().unwrap();
        assert_eq!(k.resumed().unwrap_err().from, "killed");
    }
}
