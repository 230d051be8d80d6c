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
//! - `RESUME_DEVICES_LATE`, in CRIU: RESUME of each restored AMD process, before it runs. A
//!   failure answers -1, and CRIU kills the restored tree.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, IntoRawFd, OwnedFd};
use std::time::Instant;

use gpusnap_config::Config;
use gpusnap_image::{CheckpointPath, KfdFileKind, KfdState, Manifest};
use gpusnap_rocm::bo::BoMapping;
use gpusnap_rocm::gpumatch::{WantedGpu, match_gpus};
use gpusnap_rocm::kfd::criu;
use gpusnap_rocm::kfd::device::{KfdDevice, open_device};
use gpusnap_rocm::kfd::sys::{KFD_IOC_ALLOC_MEM_FLAGS_VRAM, KfdCriuBoBucket, KfdCriuDeviceBucket};
use gpusnap_rocm::topology::{self, Gpu};

use super::data::{self, BoTarget};

/// One process to restore, checked.
struct Plan {
    manifest: Manifest,
    state: KfdState,
    /// For each GPU of `state.gpus` (same index), the local GPU that takes its place.
    local: Vec<Gpu>,
}

/// The AMD part of a `criu restore`.
pub struct AmdRestore {
    dev: Box<dyn KfdDevice>,
    cfg: Config,
    plans: BTreeMap<u32, Plan>,
    /// A KFD file of CRIU's own, for RESUME (which names its process by pid).
    resume_kfd: Option<OwnedFd>,
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
    /// `Ok(None)`: the image has no kfd process. `Err(super::Refused)`: refused (logged).
    pub fn init(cfg: Config) -> Result<Option<AmdRestore>, super::Refused> {
        let Some(dir) = crate::criu::image_dir() else {
            return Ok(None);
        };
        let manifests = match gpusnap_image::read_manifests(dir) {
            Ok(m) => m,
            // The CUDA side reads the same directory and names the damage; a kfd image in
            // it is refused there too.
            Err(e) => {
                log::error!(
                    "amd: restore refused: {e}; nothing was restored and no GPU was touched"
                );
                return Err(super::Refused);
            }
        };
        let kfd: Vec<Manifest> = manifests
            .into_values()
            .filter(|m| m.path == CheckpointPath::Kfd)
            .collect();
        if kfd.is_empty() {
            return Ok(None);
        }
        let refuse = |why: String| {
            log::error!("amd: restore refused: {why}; nothing was restored and no GPU was touched");
        };
        let Some(dev) = super::kfd_device() else {
            refuse(format!(
                "the image holds {} AMD GPU processes but this host has no /dev/kfd (amdgpu driver with KFD)",
                kfd.len()
            ));
            return Err(super::Refused);
        };
        let local = match topology::read_gpus(&dev.topology_dir()) {
            Ok(g) => g,
            Err(e) => {
                refuse(format!("{}: {e}", dev.describe()));
                return Err(super::Refused);
            }
        };
        let t0 = Instant::now();
        let mut plans = BTreeMap::new();
        for m in kfd {
            let nspid = m.nspid;
            let state = match gpusnap_image::read_kfd_state(dir, nspid) {
                Ok(s) => s,
                Err(e) => {
                    refuse(e.to_string());
                    return Err(super::Refused);
                }
            };
            let mapped = match match_gpus(&wanted(&state), &local) {
                Ok(g) => g,
                Err(e) => {
                    refuse(format!(
                        "nspid {nspid}: no GPU here can take the place of {e} ({})",
                        dev.describe()
                    ));
                    return Err(super::Refused);
                }
            };
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
                let threads = cfg.reader_threads.max(1) as usize;
                if let Err(e) = gpusnap_image::verify_image(dir, &m, threads) {
                    refuse(e.to_string());
                    return Err(super::Refused);
                }
            }
            plans.insert(
                nspid,
                Plan {
                    manifest: m,
                    state,
                    local: mapped,
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
        }))
    }

    /// The local GPU standing in for user gpu_id `gpu_id` of process `nspid`.
    fn local_gpu(&self, nspid: u32, gpu_id: u32) -> Option<&Gpu> {
        let p = self.plans.get(&nspid)?;
        let i = p.state.gpu_index(gpu_id)?;
        p.local.get(i)
    }

    pub fn restore_ext_file(&mut self, id: u32) -> Option<i32> {
        // In a restored task CRIU's image directory is another service fd than at init.
        let dir = crate::criu::image_dir()?;
        let rec = match gpusnap_image::read_kfd_file(dir, id) {
            Ok(r) => r,
            Err(gpusnap_image::ImageError::MissingFile { .. }) => return None,
            Err(e) => {
                log::error!("amd: file {id}: {e}");
                return Some(-1);
            }
        };
        Some(match rec.kind {
            KfdFileKind::Render => {
                let minor = self
                    .local_gpu(rec.nspid, rec.gpu_id)
                    .and_then(|g| g.drm_render_minor)
                    .unwrap_or(rec.render_minor);
                let path = self.dev.render_path(minor);
                match std::fs::OpenOptions::new()
                    .read(true)
                    .write(rec.flags & libc::O_ACCMODE != libc::O_RDONLY)
                    .open(&path)
                {
                    Ok(f) => OwnedFd::from(f).into_raw_fd(),
                    Err(e) => {
                        log::error!(
                            "amd: file {id}: cannot open render node {}: {e}",
                            path.display()
                        );
                        -1
                    }
                }
            }
            KfdFileKind::Kfd => match self.restore_process(dir, rec.nspid) {
                Ok(fd) => fd.into_raw_fd(),
                Err(e) => {
                    log::error!(
                        "amd: nspid {}: restore failed: {e}; CRIU ends the restored process",
                        rec.nspid
                    );
                    -1
                }
            },
        })
    }

    /// In the restored task: open the KFD, RESTORE, write the BOs' contents back.
    fn restore_process(&self, dir: BorrowedFd<'_>, nspid: u32) -> Result<OwnedFd, String> {
        let t0 = Instant::now();
        let plan = self
            .plans
            .get(&nspid)
            .ok_or_else(|| format!("the image has no KFD state for process {nspid}"))?;
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() };
        match crate::procfs::ns_pid(me) {
            Ok(n) if n as u32 == nspid => {}
            other => {
                return Err(format!(
                    "RESTORE_EXT_FILE ran in pid {me} (namespace pid {other:?}), not in process {nspid}"
                ));
            }
        }
        let kfd = self.dev.open_kfd().map_err(|e| e.to_string())?;
        let mut renders = Vec::new();
        let mut devices = Vec::new();
        for (g, l) in plan.state.gpus.iter().zip(&plan.local) {
            let minor = l
                .drm_render_minor
                .ok_or_else(|| format!("local gpu_id {} has no render node", l.gpu_id))?;
            let r = open_device(&self.dev.render_path(minor)).map_err(|e| e.to_string())?;
            devices.push(KfdCriuDeviceBucket {
                user_gpu_id: g.gpu_id,
                actual_gpu_id: l.gpu_id,
                drm_fd: r.as_raw_fd() as u32,
                pad: 0,
            });
            renders.push(r);
        }
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
        )
        .map_err(|e| e.to_string())?;
        let t_restore = t0.elapsed().as_secs_f64();
        let mut maps = Vec::new();
        for (i, b) in plan.state.bos.iter().enumerate() {
            if !b.content {
                continue;
            }
            let fd = restored.dmabufs[i].as_ref().ok_or_else(|| {
                format!("RESTORE returned no dma-buf for BO {i} at {:#x}", b.addr)
            })?;
            let m = BoMapping::map(fd.as_fd(), b.size, true).map_err(|e| {
                format!(
                    "BO {i} at {:#x}: its dma-buf cannot be mapped ({e}); the contents cannot be written back",
                    b.addr
                )
            })?;
            maps.push((b.addr, m));
        }
        let targets: Vec<BoTarget<'_>> = maps
            .iter()
            .map(|(addr, map)| BoTarget { addr: *addr, map })
            .collect();
        let (bytes, secs) = data::read_bos(
            dir,
            &plan.manifest,
            &targets,
            self.cfg.reader_threads as usize,
        )?;
        drop(targets);
        drop(maps);
        drop(renders);
        log::info!(
            "amd: nspid {nspid}: KFD state restored ({} GPUs, {} BOs; RESTORE {:.3} s), {bytes} bytes of BO contents written back in {secs:.3} s; queues wait for RESUME",
            plan.state.gpus.len(),
            plan.state.bos.len(),
            t_restore
        );
        Ok(kfd)
    }

    pub fn resume_devices_late(&mut self, pid: i32) -> Option<i32> {
        let nspid = crate::procfs::ns_pid(pid).ok()? as u32;
        if !self.plans.contains_key(&nspid) {
            return None;
        }
        let t0 = Instant::now();
        if self.resume_kfd.is_none() {
            match self.dev.open_kfd() {
                Ok(k) => self.resume_kfd = Some(k),
                Err(e) => {
                    let killed = super::dump::kill(pid).is_ok();
                    log::error!(
                        "amd: pid {pid}: cannot open the KFD for RESUME: {e}; {}",
                        if killed {
                            "the process was killed rather than left running with its GPU queues stopped"
                        } else {
                            "killing it failed too: it must not run: kill it by hand"
                        }
                    );
                    return Some(-1);
                }
            }
        }
        let kfd = self.resume_kfd.as_ref().expect("opened above");
        match criu::resume(self.dev.as_ref(), kfd.as_fd(), pid as u32) {
            Ok(()) => {
                log::info!(
                    "amd: pid {pid} (nspid {nspid}): GPU queues resumed (RESUME) in {:.3} s",
                    t0.elapsed().as_secs_f64()
                );
                Some(0)
            }
            Err(e) => {
                // CRIU 4.1 and 4.2 go on with the restore whatever this hook answers, so the
                // process is killed here: it must not run with its GPU queues stopped.
                match super::dump::kill(pid) {
                    Ok(()) => log::error!(
                        "amd: pid {pid} (nspid {nspid}): {e}; the process was killed rather than left running with its GPU queues stopped; the image is unchanged: restore again"
                    ),
                    Err(k) => log::error!(
                        "amd: pid {pid} (nspid {nspid}): {e}; killing it failed too ({k}): it must not run: kill it by hand"
                    ),
                }
                Some(-1)
            }
        }
    }

    pub fn exit(&mut self) {
        self.resume_kfd = None;
    }
}
