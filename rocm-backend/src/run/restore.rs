//! The restore side of the kfd path.
//!
//! - `init`, in CRIU before it forks anything: every `kfd` manifest is read with its KFD state
//!   (the image crate checks the two agree), every chunk's checksum is verified (unless
//!   `verify_before_restore = false`), and each process's GPUs are matched to this host's
//!   topology (same model, enough VRAM for its VRAM BOs; gpu_ids translated where they differ).
//!   Any failure refuses the restore before a process exists or a GPU is touched.
//! - `RESTORE_EXT_FILE` of a recorded `/dev/kfd` file, in the restored task: the KFD is opened
//!   (so the kernel makes the task a KFD process), one render node per GPU is opened for the
//!   device buckets, RESTORE re-creates devices, BOs, queues, events; each VRAM/GTT BO's
//!   contents are written back through its dma-buf; the KFD fd is returned to CRIU. A render
//!   node is opened again on the GPU that stands in for the one it was.
//! - `UPDATE_VMA_MAP`, in the restored task, after its files and before its memory is mapped:
//!   each mapping of `/dev/kfd` or a render node recorded at dump is found by its address and
//!   old offset and given the new offset RESTORE reported for its buffer object, and the file to
//!   map it from (see [`TaskFiles`]). A device mapping that cannot be translated ends the
//!   restored task before it runs, naming the mapping.
//! - `RESUME_DEVICES_LATE`, in CRIU: the process is made to die with CRIU (`PTRACE_O_EXITKILL`),
//!   then RESUME starts its queues before it runs. CRIU 4.1 and 4.2 go on with the restore
//!   whatever this hook answers, so on a failure gpusnap kills and reaps the process itself
//!   ([`gpusnap_host::reap`]) and answers -1.
//!
//! Each process's progress is its [`RestorePhase`] (CRIU's copy of the plugin sees `Planned`
//! until RESUME; the restored task's copy sees RESTORE and the contents written back).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::Instant;

use crate::bo::BoMapping;
use crate::gpumatch::{WantedGpu, match_gpus};
use crate::kfd::KfdError;
use crate::kfd::criu;
use crate::kfd::device::{DeviceFile, KfdDevice, open_device};
use crate::kfd::sys::{KFD_IOC_ALLOC_MEM_FLAGS_VRAM, KfdCriuBoBucket, KfdCriuDeviceBucket};
use crate::kfd::vma;
use crate::topology::{self, Gpu, TopologyError};
use gpusnap_config::Config;
use gpusnap_image::{CheckpointPath, ImageError, KfdFileKind, KfdState, KfdVmaNode, Manifest};

use super::data::{self, BoTarget, DataError};
use super::phase::{ImpossibleMove, RestorePhase};
use gpusnap_host::criu::Reopened;
use gpusnap_host::pid::{HostPid, NsPid};

/// Why a restore with AMD GPU processes is refused at init, before CRIU forks anything.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(
        "the image holds {0} AMD GPU processes but this host has no /dev/kfd (amdgpu driver with KFD)"
    )]
    NoKfd(usize),
    #[error("{device}: {source}")]
    Topology {
        device: String,
        #[source]
        source: TopologyError,
    },
    #[error("nspid {nspid}: no GPU here can take the place of {why} ({device})")]
    NoGpu {
        nspid: NsPid,
        #[source]
        why: crate::gpumatch::NoStandIn,
        device: String,
    },
    #[error(
        "the image holds AMD GPU state but gpusnap is disabled (mode = off): the processes would run without it; enable gpusnap to restore"
    )]
    Disabled,
}

/// Why one AMD process could not be restored in its task (CRIU then ends the task).
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("the image has no KFD state for process {0}")]
    NoState(NsPid),
    #[error("RESTORE_EXT_FILE ran in pid {pid} (namespace pid {found:?}), not in process {nspid}")]
    WrongTask {
        pid: HostPid,
        found: Option<NsPid>,
        nspid: NsPid,
    },
    #[error(transparent)]
    Kfd(#[from] KfdError),
    #[error("local gpu_id {0} has no render node")]
    NoRenderNode(u32),
    #[error("keeping {what}: {source}")]
    Keep {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("RESTORE returned no dma-buf for BO {index} at {addr:#x}")]
    NoDmabuf { index: usize, addr: u64 },
    #[error(
        "BO {index} at {addr:#x}: its dma-buf cannot be mapped ({source}); the contents cannot be written back"
    )]
    Unmappable {
        index: usize,
        addr: u64,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Data(#[from] DataError),
    #[error("internal: {0}")]
    Phase(#[from] ImpossibleMove),
}

/// Why a device mapping of a restored task cannot be made again.
#[derive(Debug, thiserror::Error)]
#[error("device mapping at {addr:#x} of {path} (offset {old:#x}) cannot be made again: {why}")]
pub struct MapError {
    pub addr: u64,
    pub path: String,
    pub old: u64,
    pub why: MapWhy,
}

#[derive(Debug, thiserror::Error)]
pub enum MapWhy {
    #[error(
        "this task restored no KFD state (its image records no KFD file for it, or the mapping belongs to a process gpusnap did not checkpoint)"
    )]
    NoState,
    #[error(
        "the image of nspid {0} records no such mapping (written by a gpusnap that did not record device mappings, or damaged)"
    )]
    NotRecorded(NsPid),
    #[error("RESTORE gave its {0} an offset that does not fit the mapping")]
    Offset(String),
    #[error("its file is no longer open in this task")]
    FileClosed,
    #[error("dup: {0}")]
    Dup(#[source] std::io::Error),
}

/// Why RESUME could not start a restored process's queues (it is killed instead).
#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    #[error("cannot open the KFD for RESUME: {0}")]
    OpenKfd(#[source] KfdError),
    #[error("cannot make it die with CRIU: {0}")]
    ExitKill(#[from] gpusnap_host::ptrace::PtraceError),
    #[error(transparent)]
    Resume(KfdError),
    #[error("internal: {0}")]
    Phase(#[from] ImpossibleMove),
}

/// One process to restore, checked.
struct Plan {
    manifest: Manifest,
    state: KfdState,
    /// For each GPU of `state.gpus` (same index), the local GPU that takes its place.
    local: Vec<Gpu>,
    phase: RestorePhase,
}

/// Which file of the restored task a translated mapping is made through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MapThrough {
    Kfd,
    /// The render node of this local minor.
    Render(u32),
}

/// A device mapping of the image, translated after RESTORE.
#[derive(Debug, Clone)]
struct Translated {
    start: u64,
    end: u64,
    old: u64,
    /// `None`: the BO's restored offset does not give one (reported when CRIU asks).
    new: Option<u64>,
    through: MapThrough,
    what: String,
}

/// The files a restored task keeps for its device mappings, in the task's own copy of the
/// plugin (the hooks that use them, `RESTORE_EXT_FILE` and `UPDATE_VMA_MAP`, run in the
/// restored task; CRIU forks a task's children before it restores the task's files, so none
/// inherits them).
///
/// Why these files: DRM lets a process map a buffer object only through the open file the BO
/// was created with. RESTORE creates the BOs with the render-node file of each GPU it is given
/// (the device buckets' `drm_fd`), so that one open file per GPU must serve RESTORE, every
/// render-node fd CRIU restores for the process (they are dups of it, so the process keeps
/// using the file its BOs belong to) and every render-node mapping (CRIU maps from a dup of it).
/// `/dev/kfd` mappings act on the calling process through any of its KFD files; they are made
/// from a dup of the KFD file RESTORE ran on. The files sit at fd numbers above the highest fd
/// the process had at dump (close-on-exec), where CRIU restores none of the process's own fds;
/// they are closed once every recorded mapping of the task was handed out. CRIU 4.1/4.2 take
/// ownership of the fd `UPDATE_VMA_MAP` returns, so each answer is a fresh dup.
struct TaskFiles {
    nspid: NsPid,
    /// The task that opened them (`getpid()`).
    pid: HostPid,
    /// Lowest fd number used.
    base: i32,
    kfd: Option<OwnedFd>,
    renders: BTreeMap<u32, OwnedFd>,
    vmas: Vec<Translated>,
    served: usize,
}

/// Moves `fd` to the lowest free number at or above `base`, close-on-exec.
fn above(fd: OwnedFd, base: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC on an open fd we own; the new fd is returned to us alone.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, base) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `n` is a fresh fd nothing else owns.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(n) })
}

/// Ends the restored task: a device mapping it needs cannot be made, and it must not run
/// without it. CRIU sees a task die during restore and fails the whole restore.
pub(super) fn end_restored_task() -> ! {
    // SAFETY: _exit(2) ends this (restored, not yet running) task at once; nothing of the
    // process's own has run yet, and CRIU's state in this task dies with it.
    unsafe { libc::_exit(1) }
}

/// The AMD part of a `criu restore`.
pub struct AmdRestore {
    dev: Box<dyn KfdDevice>,
    cfg: Config,
    plans: BTreeMap<NsPid, Plan>,
    /// A KFD file of CRIU's own, for RESUME (which names its process by pid).
    resume_kfd: Option<OwnedFd>,
    /// In a restored task: its files for device mappings.
    task: Option<TaskFiles>,
}

fn wanted(state: &KfdState) -> Vec<WantedGpu> {
    state
        .gpus
        .iter()
        .map(|g| WantedGpu {
            gpu_id: g.gpu_id,
            vendor_id: g.vendor_id,
            device_id: g.device_id,
            gfx_target_version: g.gfx_target_version,
            simd_count: g.simd_count,
            name: g.name.clone(),
            vram_bytes: state
                .bos
                .iter()
                .filter(|b| {
                    b.gpu_id == g.gpu_id && b.alloc_flags & KFD_IOC_ALLOC_MEM_FLAGS_VRAM != 0
                })
                .map(|b| b.size)
                .sum(),
        })
        .collect()
}

impl AmdRestore {
    /// `Ok(None)`: the image has no kfd process. `Err`: the restore is refused.
    pub fn init(cfg: Config, dir: Option<BorrowedFd<'_>>) -> Result<Option<AmdRestore>, Refused> {
        let Some(dir) = dir else {
            return Ok(None);
        };
        // The CUDA side reads the same directory and names damage too; a kfd image in it is
        // refused there as well.
        let manifests = gpusnap_image::read_manifests(dir)?;
        let kfd: Vec<Manifest> = manifests
            .into_values()
            .filter(|m| m.path == CheckpointPath::Kfd)
            .collect();
        if kfd.is_empty() {
            return Ok(None);
        }
        let dev = super::kfd_device().ok_or(Refused::NoKfd(kfd.len()))?;
        let local =
            topology::read_gpus(&dev.topology_dir()).map_err(|source| Refused::Topology {
                device: dev.describe(),
                source,
            })?;
        let t0 = Instant::now();
        let mut plans = BTreeMap::new();
        for m in kfd {
            let nspid = m.nspid;
            let state = gpusnap_image::read_kfd_state(dir, nspid)?;
            let mapped = match_gpus(&wanted(&state), &local).map_err(|why| Refused::NoGpu {
                nspid,
                why,
                device: dev.describe(),
            })?;
            for (w, l) in state.gpus.iter().zip(&mapped) {
                if w.gpu_id != l.gpu_id {
                    log::info!(
                        "amd: nspid {nspid}: gpu_id {} of the image is restored on local gpu_id {} (same model)",
                        w.gpu_id,
                        l.gpu_id
                    );
                }
            }
            if cfg.verify_before_restore != gpusnap_config::Verify::Off {
                gpusnap_image::verify_image(dir, &m, cfg.effective_reader_threads())?;
            }
            plans.insert(
                nspid,
                Plan {
                    manifest: m,
                    state,
                    local: mapped,
                    phase: RestorePhase::Planned,
                },
            );
        }
        log::info!(
            "amd: {} AMD GPU processes checked (images{}, GPUs matched on {}) in {:.3} s",
            plans.len(),
            if cfg.verify_before_restore != gpusnap_config::Verify::Off {
                " and checksums"
            } else {
                ""
            },
            dev.describe(),
            t0.elapsed().as_secs_f64()
        );
        Ok(Some(AmdRestore {
            dev,
            cfg,
            plans,
            resume_kfd: None,
            task: None,
        }))
    }

    /// The task's files (made on first use in this task).
    fn task_files(&mut self, nspid: NsPid) -> &mut TaskFiles {
        // SAFETY: getpid has no preconditions.
        let me = HostPid(unsafe { libc::getpid() });
        if self.task.as_ref().is_none_or(|t| t.pid != me) {
            let max_fd = self.plans.get(&nspid).map_or(0, |p| p.state.max_fd);
            // A version 1 image does not say; 1024 is above what most processes hold.
            let base = match i32::try_from(max_fd).ok().and_then(|f| f.checked_add(1)) {
                Some(b) if max_fd > 0 => b,
                _ => 1024,
            };
            self.task = Some(TaskFiles {
                nspid,
                pid: me,
                base,
                kfd: None,
                renders: BTreeMap::new(),
                vmas: Vec::new(),
                served: 0,
            });
        }
        self.task.as_mut().expect("set above")
    }

    /// The task's render-node file of local minor `minor`, opened once.
    fn render_file(&mut self, nspid: NsPid, minor: u32) -> Result<BorrowedFd<'_>, RestoreError> {
        let path = self.dev.render_path(minor);
        let t = self.task_files(nspid);
        if !t.renders.contains_key(&minor) {
            let f = open_device(&path)?;
            let f = above(f, t.base).map_err(|source| RestoreError::Keep {
                what: format!("render node {}", path.display()),
                source,
            })?;
            t.renders.insert(minor, f);
        }
        Ok(t.renders[&minor].as_fd())
    }

    /// The local GPU standing in for user gpu_id `gpu_id` of process `nspid`.
    fn local_gpu(&self, nspid: NsPid, gpu_id: u32) -> Option<&Gpu> {
        let p = self.plans.get(&nspid)?;
        let i = p.state.gpu_index(gpu_id)?;
        p.local.get(i)
    }

    /// `dir`: the image directory as this restored task sees it (CRIU's service fd has another
    /// number here than at init).
    pub fn restore_ext_file(&mut self, dir: BorrowedFd<'_>, id: u32) -> Option<Reopened> {
        let rec = match gpusnap_image::read_kfd_file(dir, id) {
            Ok(r) => r,
            Err(gpusnap_image::ImageError::MissingFile { .. }) => return None,
            Err(e) => {
                log::error!("amd: file {id}: {e}");
                return Some(Reopened::Failed);
            }
        };
        Some(match rec.kind {
            KfdFileKind::Render => {
                let minor = self
                    .local_gpu(rec.nspid, rec.gpu_id)
                    .and_then(|g| g.drm_render_minor)
                    .unwrap_or(rec.render_minor);
                let path = self.dev.render_path(minor);
                // A GPU of the process: the one open file its BOs belong to (see
                // `TaskFiles`). Any other render node: opened as it was.
                let shared = self.plans.contains_key(&rec.nspid)
                    && self.local_gpu(rec.nspid, rec.gpu_id).is_some();
                let opened = if shared {
                    self.render_file(rec.nspid, minor).and_then(|f| {
                        f.try_clone_to_owned().map_err(|source| RestoreError::Keep {
                            what: "a dup of the render node".into(),
                            source,
                        })
                    })
                } else {
                    std::fs::OpenOptions::new()
                        .read(true)
                        .write(rec.flags & libc::O_ACCMODE != libc::O_RDONLY)
                        .open(&path)
                        .map(OwnedFd::from)
                        .map_err(|source| RestoreError::Keep {
                            what: format!("render node {}", path.display()),
                            source,
                        })
                };
                match opened {
                    Ok(f) => Reopened::Fd(f),
                    Err(e) => {
                        log::error!(
                            "amd: file {id}: cannot open render node {}: {e}",
                            path.display()
                        );
                        Reopened::Failed
                    }
                }
            }
            KfdFileKind::Kfd => match self.restore_process(dir, rec.nspid) {
                Ok(fd) => Reopened::Fd(fd),
                Err(e) => {
                    log::error!(
                        "amd: nspid {}: restore failed: {e}; CRIU ends the restored process",
                        rec.nspid
                    );
                    Reopened::Failed
                }
            },
        })
    }

    /// In the restored task: open the KFD, RESTORE, write the BOs' contents back, translate
    /// the device mappings.
    fn restore_process(
        &mut self,
        dir: BorrowedFd<'_>,
        nspid: NsPid,
    ) -> Result<OwnedFd, RestoreError> {
        let t0 = Instant::now();
        if !self.plans.contains_key(&nspid) {
            return Err(RestoreError::NoState(nspid));
        }
        // SAFETY: getpid has no preconditions.
        let me = HostPid(unsafe { libc::getpid() });
        match gpusnap_host::procfs::ns_pid(me) {
            Ok(n) if n == nspid => {}
            other => {
                return Err(RestoreError::WrongTask {
                    pid: me,
                    found: other.ok(),
                    nspid,
                });
            }
        }
        let kfd = self.dev.open_kfd()?;
        let pairs: Vec<(u32, u32, Option<u32>)> = {
            let plan = &self.plans[&nspid];
            plan.state
                .gpus
                .iter()
                .zip(&plan.local)
                .map(|(g, l)| (g.gpu_id, l.gpu_id, l.drm_render_minor))
                .collect()
        };
        let mut devices = Vec::new();
        let mut local_minor = BTreeMap::new();
        for (user, actual, minor) in pairs {
            let minor = minor.ok_or(RestoreError::NoRenderNode(actual))?;
            let r = self.render_file(nspid, minor)?;
            devices.push(KfdCriuDeviceBucket {
                user_gpu_id: user,
                actual_gpu_id: actual,
                drm_fd: r.as_raw_fd() as u32,
                pad: 0,
            });
            local_minor.insert(user, minor);
        }
        let plan = self
            .plans
            .get_mut(&nspid)
            .ok_or(RestoreError::NoState(nspid))?;
        let bos: Vec<KfdCriuBoBucket> = plan
            .state
            .bos
            .iter()
            .map(|b| KfdCriuBoBucket {
                addr: b.addr,
                size: b.size,
                offset: b.offset,
                gpu_id: b.gpu_id,
                alloc_flags: b.alloc_flags,
                ..Default::default()
            })
            .collect();
        let restored = criu::restore(
            self.dev.as_ref(),
            kfd.as_fd(),
            devices,
            bos,
            plan.state.priv_data_bytes(),
            plan.state.num_objects,
        )?;
        plan.phase.state_restored()?;
        gpusnap_host::fault::kill_criu_at("amd-restore-state");
        let plan = &self.plans[&nspid];
        let t_restore = t0.elapsed().as_secs_f64();
        let mut maps = Vec::new();
        for (i, b) in plan.state.bos.iter().enumerate() {
            if !b.content {
                continue;
            }
            let fd = restored.dmabufs[i].as_ref().ok_or(RestoreError::NoDmabuf {
                index: i,
                addr: b.addr,
            })?;
            let m = BoMapping::map(fd.as_fd(), b.size, true).map_err(|source| {
                RestoreError::Unmappable {
                    index: i,
                    addr: b.addr,
                    source,
                }
            })?;
            maps.push((b.addr, m));
        }
        let targets: Vec<BoTarget<'_>> = maps
            .iter()
            .map(|(addr, map)| BoTarget { addr: *addr, map })
            .collect();
        let (bytes, secs) = data::read_bos(dir, &plan.manifest, &targets, &self.cfg)?;
        drop(targets);
        drop(maps);
        // Every recorded mapping's new offset, from its BO's restored offset.
        let translated: Vec<Translated> = plan
            .state
            .vmas
            .iter()
            .map(|v| {
                let old_bo = &plan.state.bos[v.bo as usize];
                let new_bo = &restored.bos[v.bo as usize];
                let through = match v.node {
                    KfdVmaNode::Kfd => MapThrough::Kfd,
                    KfdVmaNode::Render => MapThrough::Render(
                        local_minor
                            .get(&old_bo.gpu_id)
                            .copied()
                            .unwrap_or(v.render_minor),
                    ),
                };
                Translated {
                    start: v.start,
                    end: v.end,
                    old: v.offset,
                    new: vma::translate(v.offset, old_bo.offset, new_bo.restored_offset),
                    through,
                    what: format!(
                        "{} BO {} at {:#x}",
                        vma::bo_kind(old_bo.alloc_flags),
                        v.bo,
                        old_bo.addr
                    ),
                }
            })
            .collect();
        let (n_gpus, n_bos) = (plan.state.gpus.len(), plan.state.bos.len());
        let keep = |source| RestoreError::Keep {
            what: "the KFD file".into(),
            source,
        };
        let base = self.task_files(nspid).base;
        let kfd_kept = above(kfd.try_clone().map_err(keep)?, base).map_err(keep)?;
        let t = self.task_files(nspid);
        t.kfd = Some(kfd_kept);
        let n_vmas = translated.len();
        t.vmas = translated;
        t.served = 0;
        if let Some(p) = self.plans.get_mut(&nspid) {
            p.phase.loaded(n_vmas)?;
        }
        log::info!(
            "amd: nspid {nspid}: KFD state restored ({n_gpus} GPUs, {n_bos} BOs; RESTORE {t_restore:.3} s), {bytes} bytes of BO contents written back in {secs:.3} s, {n_vmas} device mappings translated; queues wait for RESUME"
        );
        Ok(kfd)
    }

    /// Whether `path` (as CRIU recorded it at dump) is a file of this KFD.
    fn classify_path(&self, path: &str) -> Option<DeviceFile> {
        use std::os::unix::fs::MetadataExt;
        let p = std::path::Path::new(path);
        let rdev = std::fs::metadata(p).map_or(0, |m| m.rdev());
        self.dev.classify(p, rdev).or_else(|| {
            // A render node of the dump that this host lacks (restored on another GPU).
            let minor = path.strip_prefix("/dev/dri/renderD")?.parse().ok()?;
            Some(DeviceFile::Render { minor })
        })
    }

    /// `UPDATE_VMA_MAP`, in the restored task: `None` when `path` is no file of this KFD;
    /// otherwise the new offset and a fresh fd to map from (CRIU takes it), or why not.
    pub fn update_vma_map(
        &mut self,
        path: &str,
        addr: u64,
        old: u64,
    ) -> Option<Result<(u64, OwnedFd), MapError>> {
        self.classify_path(path)?;
        // SAFETY: getpid has no preconditions.
        let me = HostPid(unsafe { libc::getpid() });
        let named = |why: MapWhy| MapError {
            addr,
            path: path.to_owned(),
            old,
            why,
        };
        let Some(t) = self.task.as_mut().filter(|t| t.pid == me) else {
            return Some(Err(named(MapWhy::NoState)));
        };
        let Some(i) = t.vmas.iter().position(|v| v.start == addr && v.old == old) else {
            return Some(Err(named(MapWhy::NotRecorded(t.nspid))));
        };
        let v = t.vmas[i].clone();
        let Some(new) = v.new else {
            return Some(Err(named(MapWhy::Offset(v.what))));
        };
        let file = match v.through {
            MapThrough::Kfd => t.kfd.as_ref(),
            MapThrough::Render(minor) => t.renders.get(&minor),
        };
        let Some(file) = file else {
            return Some(Err(named(MapWhy::FileClosed)));
        };
        let fd = match file.try_clone() {
            Ok(f) => f,
            Err(e) => return Some(Err(named(MapWhy::Dup(e)))),
        };
        log::info!(
            "amd: nspid {}: mapping {:#x}-{:#x} ({}): offset {old:#x} -> {new:#x}",
            t.nspid,
            v.start,
            v.end,
            v.what
        );
        t.served += 1;
        if t.served >= t.vmas.len() {
            // Every recorded mapping has its own dup now: the task's own copies can go.
            t.kfd = None;
            t.renders.clear();
        }
        Some(Ok((new, fd)))
    }

    /// `RESUME_DEVICES_LATE`: `None` when `pid` is not a restored AMD process. The process is
    /// made to die with CRIU first; a RESUME that fails kills and reaps it (CRIU 4.1 and 4.2
    /// go on with the restore whatever this hook answers).
    pub fn resume_devices_late(&mut self, pid: HostPid) -> Option<i32> {
        let nspid = gpusnap_host::procfs::ns_pid(pid).ok()?;
        if !self.plans.contains_key(&nspid) {
            return None;
        }
        let t0 = Instant::now();
        match self.resume(pid, nspid) {
            Ok(()) => {
                log::info!(
                    "amd: pid {pid} (nspid {nspid}): GPU queues resumed (RESUME) in {:.3} s",
                    t0.elapsed().as_secs_f64()
                );
                Some(0)
            }
            Err(e) => {
                match gpusnap_host::reap::kill_and_reap(pid) {
                    Ok(_) => log::error!(
                        "amd: pid {pid} (nspid {nspid}): {e}; the process was killed rather than left running with its GPU queues stopped; the image is unchanged: restore again"
                    ),
                    Err(k) => log::error!(
                        "amd: pid {pid} (nspid {nspid}): {e}; {k} too: it must not run: kill it by hand"
                    ),
                }
                if let Some(p) = self.plans.get_mut(&nspid) {
                    let _ = p.phase.killed();
                }
                Some(-1)
            }
        }
    }

    fn resume(&mut self, pid: HostPid, nspid: NsPid) -> Result<(), ResumeError> {
        gpusnap_host::hold::kill_if_criu_dies(pid, &[])?;
        gpusnap_host::fault::kill_criu_at("amd-restore-resume");
        let kfd = match &self.resume_kfd {
            Some(k) => k,
            None => self
                .resume_kfd
                .insert(self.dev.open_kfd().map_err(ResumeError::OpenKfd)?),
        };
        criu::resume(self.dev.as_ref(), kfd.as_fd(), pid).map_err(ResumeError::Resume)?;
        if let Some(p) = self.plans.get_mut(&nspid) {
            p.phase.resumed()?;
        }
        Ok(())
    }

    pub fn exit(&mut self) {
        self.resume_kfd = None;
        self.task = None;
    }
}
