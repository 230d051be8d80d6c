//! AMD GPU processes, checkpointed through the KFD's CRIU interface (the "kfd" path).
//!
//! The hooks are the ones CRIU calls for the files a ROCm process holds: `/dev/kfd` and the
//! render nodes are character devices CRIU does not dump itself, so it hands each to the
//! plugins' `DUMP_EXT_FILE`, and at restore asks `RESTORE_EXT_FILE` for a new fd.
//! - dump, `DUMP_EXT_FILE` of `/dev/kfd` ([`dump`]): PROCESS_INFO (pauses the process's
//!   queues), CHECKPOINT, the VRAM/GTT BOs' contents into gpusnap's data files ([`data`]), the
//!   KFD state file, then the manifest (last). Failure: UNPAUSE (the process runs on) or, if
//!   that fails, the process is killed. `exit` UNPAUSEs after `-R` or a failed dump.
//! - restore ([`restore`]): at init, every kfd image is checked (checksums included) and its
//!   GPUs matched to this host's before CRIU forks anything; `RESTORE_EXT_FILE` of `/dev/kfd`,
//!   in the restored task, opens the KFD, RESTOREs, and writes the BOs' contents back;
//!   render nodes are opened again (on the GPU that now stands in); `RESUME_DEVICES_LATE`
//!   RESUMEs the process before CRIU lets it run.
//! - device mappings: `HANDLE_DEVICE_VMA` accepts exactly the mappings of the KFD node and of
//!   its GPUs' render nodes; the kfd `DUMP_EXT_FILE` records which BO each shows; at restore
//!   `UPDATE_VMA_MAP` maps each at its BO's restored offset through the restored task's own
//!   files (see `restore::TaskFiles`), or ends the task before it runs, naming the mapping.
//!
//! Which KFD: `GPUSNAP_TEST_STANDIN_KFD=<dir>` (tests only) selects the stand-in KFD of that
//! directory; otherwise `/dev/kfd`. Never run on AMD hardware.

pub mod coexist;
pub mod data;
pub mod dump;
pub mod phase;
pub mod recover;
pub mod restore;

use std::os::fd::{BorrowedFd, OwnedFd};

use crate::kfd::device::{KfdDevice, RealKfd};
use crate::kfd::standin::StandinKfd;
use gpusnap_config::Config;

use gpusnap_host::criu::{Reopened, Stage};

/// The KFD this run talks to, if there is one.
pub fn kfd_device() -> Option<Box<dyn KfdDevice>> {
    if let Some(s) = StandinKfd::from_env() {
        return Some(Box::new(s));
    }
    std::path::Path::new(crate::kfd::sys::KFD_DEVICE)
        .exists()
        .then(|| Box::new(RealKfd) as Box<dyn KfdDevice>)
}

/// Whether CRIU's image directory holds a KFD state file.
fn image_has_kfd_state(dir: Option<BorrowedFd<'_>>) -> bool {
    dir.and_then(|dir| gpusnap_image::list_image_files(dir).ok())
        .is_some_and(|files| {
            files
                .iter()
                .any(|(k, _)| matches!(k, gpusnap_image::ImageFileKind::Kfd { .. }))
        })
}

pub use restore::Refused;

/// What gpusnap does with AMD GPU processes in this CRIU run.
pub enum AmdSide {
    /// Nothing, and why (no KFD, mode = off, pre-dump, no kfd image).
    Idle(String),
    Dump(Box<dump::AmdDump>),
    Restore(Box<restore::AmdRestore>),
}

impl AmdSide {
    /// The AMD side of a run; `Err` when a restore must be refused (the caller says why).
    /// `dir`: CRIU's image directory, as the run fetched it at init.
    pub fn init(
        stage: Stage,
        cfg: &Config,
        dir: Option<BorrowedFd<'static>>,
    ) -> Result<AmdSide, Refused> {
        if cfg.mode == gpusnap_config::Mode::Off {
            if stage == Stage::Restore && image_has_kfd_state(dir) {
                return Err(Refused::Disabled);
            }
            return Ok(AmdSide::Idle("mode = off".into()));
        }
        match stage {
            Stage::PreDump => Ok(AmdSide::Idle("pre-dump".into())),
            Stage::Dump => Ok(match kfd_device() {
                Some(dev) => {
                    log::debug!("amd: dump through {}", dev.describe());
                    AmdSide::Dump(Box::new(dump::AmdDump::new(dev, cfg.clone(), dir)))
                }
                None => AmdSide::Idle("no /dev/kfd".into()),
            }),
            Stage::Restore => Ok(match restore::AmdRestore::init(cfg.clone(), dir)? {
                Some(r) => AmdSide::Restore(Box::new(r)),
                None => AmdSide::Idle("no kfd images".into()),
            }),
        }
    }

    /// `DUMP_EXT_FILE`: `None` when the file is not an AMD one gpusnap handles.
    pub fn dump_ext_file(&mut self, fd: BorrowedFd<'_>, id: u32) -> Option<i32> {
        let AmdSide::Dump(d) = self else { return None };
        d.dump_ext_file(fd, id)
    }

    /// `RESTORE_EXT_FILE`, in the restored task: `None` when `id` is not a file gpusnap
    /// recorded as an AMD one. `dir`: the image directory as this task sees it.
    pub fn restore_ext_file(&mut self, dir: BorrowedFd<'_>, id: u32) -> Option<Reopened> {
        let AmdSide::Restore(r) = self else {
            return None;
        };
        r.restore_ext_file(dir, id)
    }

    /// `HANDLE_DEVICE_VMA`: `Some(0)` for a mapping of an AMD device file this dump handles;
    /// `None` otherwise.
    pub fn handle_device_vma(&mut self, fd: BorrowedFd<'_>, mode: u32, rdev: u64) -> Option<i32> {
        let AmdSide::Dump(d) = self else { return None };
        d.handle_device_vma(fd, mode, rdev)
    }

    /// `UPDATE_VMA_MAP`, in the restored task: `None` when `path` is no AMD file of this
    /// restore; else the new offset and an fd for CRIU (which takes it). A mapping that cannot
    /// be made again ends the restored task here, after saying which mapping.
    pub fn update_vma_map(&mut self, path: &str, addr: u64, old: u64) -> Option<(u64, OwnedFd)> {
        let AmdSide::Restore(r) = self else {
            return None;
        };
        match r.update_vma_map(path, addr, old)? {
            Ok(mapped) => Some(mapped),
            Err(e) => {
                log::error!(
                    "amd: {e}; the restored process is ended before it runs (CRIU fails the restore)"
                );
                restore::end_restored_task()
            }
        }
    }

    /// `RESUME_DEVICES_LATE`: `None` when `pid` is not a restored AMD process.
    pub fn resume_devices_late(&mut self, pid: gpusnap_host::pid::HostPid) -> Option<i32> {
        let AmdSide::Restore(r) = self else {
            return None;
        };
        r.resume_devices_late(pid)
    }

    pub fn exit(&mut self, ret: i32) {
        match self {
            AmdSide::Dump(d) => d.exit(ret),
            AmdSide::Restore(r) => r.exit(),
            AmdSide::Idle(_) => {}
        }
    }
}

/// The AMD side answers CRIU's file and mapping hooks (the KFD is a file CRIU hands to
/// plugins), and resumes restored processes.
impl gpusnap_host::Backend for AmdSide {
    fn name(&self) -> &'static str {
        "amd"
    }

    fn dump_ext_file(&mut self, fd: BorrowedFd<'_>, id: u32) -> gpusnap_host::Answer {
        AmdSide::dump_ext_file(self, fd, id)
            .map_or(gpusnap_host::Answer::NotMine, gpusnap_host::Answer::of_rc)
    }

    fn restore_ext_file(&mut self, dir: BorrowedFd<'_>, id: u32) -> Option<Reopened> {
        AmdSide::restore_ext_file(self, dir, id)
    }

    fn handle_device_vma(
        &mut self,
        fd: BorrowedFd<'_>,
        mode: u32,
        rdev: u64,
    ) -> gpusnap_host::Answer {
        AmdSide::handle_device_vma(self, fd, mode, rdev)
            .map_or(gpusnap_host::Answer::NotMine, gpusnap_host::Answer::of_rc)
    }

    fn update_vma_map(&mut self, path: &str, addr: u64, old: u64) -> Option<(u64, OwnedFd)> {
        AmdSide::update_vma_map(self, path, addr, old)
    }

    fn resume_devices_late(&mut self, pid: gpusnap_host::pid::HostPid) -> gpusnap_host::Answer {
        AmdSide::resume_devices_late(self, pid)
            .map_or(gpusnap_host::Answer::NotMine, gpusnap_host::Answer::of_rc)
    }

    fn exit(&mut self, ret: i32) {
        AmdSide::exit(self, ret)
    }
}

/// Character-device major of DRM (`/dev/dri/*`).
const DRM_MAJOR: u32 = crate::kfd::device::DRM_MAJOR;

/// The major of `/dev/kfd` on this host (allocated at driver load), from `/proc/devices`.
fn kfd_major() -> Option<u32> {
    gpusnap_host::procfs::char_major("kfd").ok().flatten()
}

/// `HANDLE_DEVICE_VMA` of a mapping of an AMD device (`/dev/kfd` or a DRM node) that gpusnap
/// did not take (no KFD here, a DRM node of no GPU of the KFD, pre-dump, CRIU's amdgpu plugin
/// loaded, gpusnap off): says so before CRIU's own error. Returns whether `rdev` is one.
pub fn explain_device_vma(rdev: u64) -> bool {
    let major = libc::major(rdev);
    let amd = major == DRM_MAJOR || kfd_major() == Some(major);
    if amd {
        log::error!(
            "amd: a process maps a GPU device ({major}:{}: /dev/kfd or a DRM node) that gpusnap does not checkpoint in this run (no KFD, a DRM node of no GPU of the KFD, pre-dump, CRIU's amdgpu plugin loaded, or gpusnap off); CRIU refuses the mapping",
            libc::minor(rdev)
        );
    }
    amd
}
