//! The dump side of the kfd path: one AMD process per `/dev/kfd` file CRIU hands over.
//!
//! Order for a process (all inside its `DUMP_EXT_FILE`, while CRIU holds it seized):
//! GET_VERSION (refused below 1.8) → PROCESS_INFO (queues paused) → CHECKPOINT → each VRAM/GTT
//! BO mapped through its dma-buf and written to data files → `gpusnap-<nspid>-kfd.img` →
//! manifest (last) → `gpusnap-kfdfile-<id>.img`. What is left to undo is a [`KfdPhase`]:
//! a failure inside the hook UNPAUSEs at once and removes the process's files; `exit` UNPAUSEs
//! every checkpointed process after `criu dump -R` or a failed dump (and removes the files of a
//! failed one). An UNPAUSE that fails leaves a process whose GPU queues stay stopped, so it is
//! killed, and the log says so (fail closed).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use gpusnap_config::Config;
use gpusnap_image::{
    AllocationRecord, CheckpointPath, GpuRecord, KfdBoRecord, KfdFileKind, KfdFileRecord,
    KfdGpuRecord, KfdState, KfdVmaNode, KfdVmaRecord, Manifest,
};
use gpusnap_rocm::bo::BoMapping;
use gpusnap_rocm::kfd::criu::{self, KfdCheckpoint};
use gpusnap_rocm::kfd::device::{DeviceFile, KfdDevice, device_of, device_of_stat};
use gpusnap_rocm::kfd::vma::{self, BoView, VmaNode};
use gpusnap_rocm::kfd::{KfdVersion, ProcessInfo};
use gpusnap_rocm::topology::{self, Gpu};

use super::coexist;
use super::data::{self, BoSource};

/// What gpusnap holds of a process whose queues it paused: what decides the undo.
enum KfdPhase {
    /// Image written; queues still paused. `kfd`: a dup of the process's KFD file (the kernel
    /// acts on the process that opened it).
    Checkpointed { kfd: OwnedFd, info: ProcessInfo },
    /// Unpaused (after `-R` or a failure) or killed; nothing left to undo.
    Done,
}

struct Tracked {
    nspid: u32,
    /// The process's pid as this CRIU sees it (found by its open KFD file), for kills.
    host_pid: Option<i32>,
    phase: KfdPhase,
}

/// The AMD part of a `criu dump`.
pub struct AmdDump {
    dev: Box<dyn KfdDevice>,
    cfg: Config,
    processes: Vec<Tracked>,
    /// `Some(path)` once seen: CRIU's amdgpu plugin is loaded, and gets every AMD file.
    deferred_to: Option<Option<String>>,
    /// Device mappings accepted in `HANDLE_DEVICE_VMA` (all processes), and recorded with a
    /// process's KFD state: the two must agree by the end of the dump.
    vmas_accepted: u64,
    vmas_recorded: u64,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The pid of the process (other than this one, and of namespace pid `nspid` when given) whose
/// fd refers to the same open file as `fd`: found with `kcmp(KCMP_FILE)` over the fds that
/// link to the same path.
fn holder_of(fd: BorrowedFd<'_>, nspid: Option<u32>) -> Option<i32> {
    let path = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()?;
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me || nspid.is_some_and(|n| crate::procfs::ns_pid(pid).ok() != Some(n as i32)) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for f in fds.flatten() {
            let Some(n) = f.file_name().to_str().and_then(|s| s.parse::<u64>().ok()) else {
                continue;
            };
            if std::fs::read_link(f.path()).ok().as_ref() != Some(&path) {
                continue;
            }
            // SAFETY: kcmp compares two files by (pid, fd); no memory is passed.
            let same = unsafe {
                libc::syscall(
                    libc::SYS_kcmp,
                    me,
                    pid,
                    0, // KCMP_FILE
                    fd.as_raw_fd() as libc::c_ulong,
                    n as libc::c_ulong,
                )
            } == 0;
            if same {
                return Some(pid);
            }
        }
    }
    None
}

/// SIGKILL to `pid`.
pub(super) fn kill(pid: i32) -> std::io::Result<()> {
    // SAFETY: kill(2) with a pid found for this process; no memory is passed.
    if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl AmdDump {
    pub fn new(dev: Box<dyn KfdDevice>, cfg: Config) -> AmdDump {
        AmdDump {
            dev,
            cfg,
            processes: Vec::new(),
            deferred_to: None,
            vmas_accepted: 0,
            vmas_recorded: 0,
        }
    }

    /// `HANDLE_DEVICE_VMA`: `Some(0)` for a mapping of this KFD's node or of the render node
    /// of one of its GPUs (its contents are the process's buffer objects, which the KFD
    /// checkpoint saves; the mapping itself is recorded with the process's KFD state and made
    /// again at restore); `None` for anything else, which another plugin or CRIU must handle.
    pub fn handle_device_vma(&mut self, fd: BorrowedFd<'_>, mode: u32, rdev: u64) -> Option<i32> {
        let (path, rdev) = device_of_stat(fd, mode, rdev, self.dev.block_nodes())?;
        let kind = self.dev.classify(&path, rdev)?;
        if self.deferred() {
            return None;
        }
        if let DeviceFile::Render { minor } = kind {
            let ours = topology::read_gpus(&self.dev.topology_dir())
                .ok()
                .is_some_and(|g| g.iter().any(|g| g.drm_render_minor == Some(minor)));
            if !ours {
                log::info!(
                    "amd: a mapping of {} is not gpusnap's: no GPU of {} has render minor {minor}",
                    path.display(),
                    self.dev.describe()
                );
                return None;
            }
        }
        self.vmas_accepted += 1;
        log::debug!(
            "amd: a mapping of {} accepted (HANDLE_DEVICE_VMA); it is recorded with the process's KFD state",
            path.display()
        );
        Some(0)
    }

    /// The device mappings of `pid` (seized), each matched to the BO it shows. An error names
    /// the first mapping gpusnap could not map again at restore.
    fn record_vmas(
        &self,
        pid: i32,
        ckpt: &KfdCheckpoint,
        gpus: &[KfdGpuRecord],
    ) -> Result<Vec<KfdVmaRecord>, String> {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .map_err(|e| format!("reading /proc/{pid}/maps: {e}"))?;
        let bos: Vec<BoView> = ckpt
            .bos
            .iter()
            .map(|b| BoView {
                offset: b.offset,
                size: b.size,
                alloc_flags: b.alloc_flags,
                gpu_id: b.gpu_id,
            })
            .collect();
        let mut out = Vec::new();
        for m in vma::parse_maps(&maps) {
            if m.path.is_empty() {
                continue;
            }
            // The mapped file itself (not its path, which may be gone): its device number.
            let link = format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end);
            let Ok(meta) = std::fs::metadata(&link) else {
                continue;
            };
            use std::os::unix::fs::{FileTypeExt, MetadataExt};
            let ft = meta.file_type();
            if !(ft.is_char_device() || (self.dev.block_nodes() && ft.is_block_device())) {
                continue;
            }
            let path = std::path::Path::new(&m.path);
            let Some(kind) = self.dev.classify(path, meta.rdev()) else {
                continue;
            };
            let node = match kind {
                DeviceFile::Kfd => VmaNode::Kfd,
                DeviceFile::Render { minor } => VmaNode::Render { minor },
            };
            let gpu_of_minor = |minor: u32| {
                gpus.iter()
                    .find(|g| g.drm_render_minor == minor)
                    .map(|g| g.gpu_id)
            };
            let bo = vma::identify(node, m.start, m.end, m.offset, &bos, gpu_of_minor).map_err(
                |e| {
                    format!(
                        "its mapping {:#x}-{:#x} of {} at offset {:#x} cannot be made again at restore: {e}",
                        m.start, m.end, m.path, m.offset
                    )
                },
            )?;
            let b = &ckpt.bos[bo];
            log::debug!(
                "amd: mapping {:#x}-{:#x} of {} at offset {:#x}: {} BO {bo} at {:#x}",
                m.start,
                m.end,
                m.path,
                m.offset,
                vma::bo_kind(b.alloc_flags),
                b.addr
            );
            out.push(KfdVmaRecord {
                start: m.start,
                end: m.end,
                offset: m.offset,
                node: match node {
                    VmaNode::Kfd => KfdVmaNode::Kfd,
                    VmaNode::Render { .. } => KfdVmaNode::Render,
                },
                render_minor: match node {
                    VmaNode::Kfd => 0,
                    VmaNode::Render { minor } => minor,
                },
                bo: bo as u32,
            });
        }
        Ok(out)
    }

    /// Whether CRIU's amdgpu plugin takes the AMD files of this run (decided once, logged).
    fn deferred(&mut self) -> bool {
        let d = self.deferred_to.get_or_insert_with(|| {
            let p = coexist::loaded_amdgpu_plugin();
            if let Some(path) = &p {
                log::warn!(
                    "amd: CRIU's {} is loaded ({path}): every AMD file (/dev/kfd, render nodes) of this dump is left to it; gpusnap checkpoints no AMD process in this run",
                    coexist::AMDGPU_PLUGIN
                );
            }
            p
        });
        d.is_some()
    }

    pub fn dump_ext_file(&mut self, fd: BorrowedFd<'_>, id: u32) -> Option<i32> {
        let (path, rdev) = device_of(fd, self.dev.block_nodes())?;
        let kind = self.dev.classify(&path, rdev)?;
        if self.deferred() {
            return None;
        }
        let dir = crate::criu::image_dir()?;
        Some(match kind {
            DeviceFile::Render { minor } => self.dump_render(dir, fd, id, minor, &path),
            DeviceFile::Kfd => self.dump_kfd(dir, fd, id),
        })
    }

    fn open_flags(fd: BorrowedFd<'_>) -> i32 {
        // SAFETY: F_GETFL on a borrowed fd.
        let f = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        f.max(0) & (libc::O_ACCMODE | libc::O_NONBLOCK)
    }

    fn nspid_of(host: Option<i32>) -> u32 {
        host.and_then(|p| crate::procfs::ns_pid(p).ok())
            .map_or(0, |n| n as u32)
    }

    fn dump_render(
        &mut self,
        dir: BorrowedFd<'_>,
        fd: BorrowedFd<'_>,
        id: u32,
        minor: u32,
        path: &std::path::Path,
    ) -> i32 {
        let gpu_id = topology::read_gpus(&self.dev.topology_dir())
            .ok()
            .and_then(|g| g.into_iter().find(|g| g.drm_render_minor == Some(minor)))
            .map_or(0, |g| g.gpu_id);
        let rec = KfdFileRecord {
            format_version: gpusnap_image::KFD_FORMAT_VERSION,
            kind: KfdFileKind::Render,
            nspid: Self::nspid_of(holder_of(fd, None)),
            flags: Self::open_flags(fd),
            gpu_id,
            render_minor: minor,
        };
        match gpusnap_image::write_kfd_file(dir, id, &rec) {
            Ok(()) => {
                log::info!(
                    "amd: file {id}: render node {} (gpu_id {gpu_id}) of nspid {} recorded; opened again at restore on the GPU that stands in for it",
                    path.display(),
                    rec.nspid
                );
                0
            }
            Err(e) => {
                log::error!(
                    "amd: file {id}: recording render node {}: {e}",
                    path.display()
                );
                -1
            }
        }
    }

    fn dump_kfd(&mut self, dir: BorrowedFd<'_>, fd: BorrowedFd<'_>, id: u32) -> i32 {
        let t0 = Instant::now();
        let kfd = match fd.try_clone_to_owned() {
            Ok(k) => k,
            Err(e) => {
                log::error!("amd: file {id}: cannot keep the KFD file: {e}");
                return -1;
            }
        };
        let version = match self.dev.version(kfd.as_fd()) {
            Ok(v) if v.supports_criu() => v,
            Ok(v) => {
                log::error!(
                    "amd: file {id}: KFD ioctl {v} has no usable CRIU support (1.8 or newer needed); the process cannot be checkpointed; nothing was done"
                );
                return -1;
            }
            Err(e) => {
                log::error!("amd: file {id}: {e}; nothing was done");
                return -1;
            }
        };
        let info = match criu::process_info(self.dev.as_ref(), kfd.as_fd()) {
            Ok(i) => i,
            Err(e) => {
                log::error!(
                    "amd: file {id} ({}): {e}; the kernel left its queues running; nothing to undo",
                    self.dev.describe()
                );
                return -1;
            }
        };
        let t_info = t0.elapsed().as_secs_f64();
        let host_pid = holder_of(fd, Some(info.pid));
        log::info!(
            "amd: nspid {} (pid {}): queues paused (PROCESS_INFO: {} GPUs, {} BOs, {} objects, {} bytes of private data) in {:.3} s",
            info.pid,
            host_pid.map_or("?".into(), |p| p.to_string()),
            info.num_devices,
            info.num_bos,
            info.num_objects,
            info.priv_data_size,
            t_info
        );
        match self.save(dir, kfd.as_fd(), &info, version, id, host_pid, t0, t_info) {
            Ok(n_vmas) => {
                self.vmas_recorded += n_vmas;
                self.processes.push(Tracked {
                    nspid: info.pid,
                    host_pid,
                    phase: KfdPhase::Checkpointed { kfd, info },
                });
                0
            }
            Err(e) => {
                log::error!("amd: nspid {}: {e}", info.pid);
                if let Err(e) = gpusnap_image::remove_process_files(dir, info.pid) {
                    log::warn!("amd: nspid {}: removing its partial image: {e}", info.pid);
                }
                let _ = crate::fault::sync_dir(dir);
                self.undo(kfd.as_fd(), info.pid, host_pid, "the dump failed");
                -1
            }
        }
    }

    /// CHECKPOINT and everything written for one process.
    #[allow(clippy::too_many_arguments)]
    fn save(
        &self,
        dir: BorrowedFd<'_>,
        kfd: BorrowedFd<'_>,
        info: &ProcessInfo,
        version: KfdVersion,
        id: u32,
        host_pid: Option<i32>,
        t0: Instant,
        t_info: f64,
    ) -> Result<u64, String> {
        let nspid = info.pid;
        let ckpt = criu::checkpoint(self.dev.as_ref(), kfd, info).map_err(|e| e.to_string())?;
        let t_ckpt = t0.elapsed().as_secs_f64() - t_info;
        let local = topology::read_gpus(&self.dev.topology_dir()).map_err(|e| e.to_string())?;
        let gpus = describe_gpus(&ckpt, &local)?;
        // Its device mappings, read while CRIU holds it seized (they cannot change).
        let pid = host_pid.ok_or(
            "the process holding the KFD file was not found, so its device mappings cannot be recorded",
        )?;
        let vmas = self.record_vmas(pid, &ckpt, &gpus)?;
        let max_fd = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map_err(|e| format!("reading /proc/{pid}/fd: {e}"))?
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .max()
            .unwrap_or(0);
        // Map every content BO through its dma-buf.
        let mut maps: Vec<(usize, BoMapping)> = Vec::new();
        for (i, b) in ckpt.bos.iter().enumerate() {
            if !criu::has_contents(b.alloc_flags) {
                continue;
            }
            let fd = ckpt.dmabufs[i].as_ref().ok_or_else(|| {
                format!(
                    "BO {i} at {:#x} ({} bytes, flags {:#x}): CHECKPOINT returned no dma-buf for it",
                    b.addr, b.size, b.alloc_flags
                )
            })?;
            let m = BoMapping::map(fd.as_fd(), b.size, false).map_err(|e| {
                format!(
                    "BO {i} at {:#x} ({} bytes, flags {:#x}): its dma-buf cannot be mapped ({e}); VRAM outside the CPU-visible window would need an SDMA copy, which gpusnap does not do",
                    b.addr, b.size, b.alloc_flags
                )
            })?;
            maps.push((i, m));
        }
        let gpu_index = |gpu_id: u32| gpus.iter().position(|g| g.gpu_id == gpu_id).unwrap_or(0);
        let sources: Vec<BoSource<'_>> = maps
            .iter()
            .map(|(i, m)| BoSource {
                addr: ckpt.bos[*i].addr,
                map: m,
                gpu: gpu_index(ckpt.bos[*i].gpu_id),
            })
            .collect();
        let codec = crate::context::codec_for(&self.cfg, dir).0;
        gpusnap_image::remove_process_files(dir, nspid).map_err(|e| e.to_string())?;
        let written = data::write_bos(
            dir,
            nspid,
            &sources,
            self.cfg.writer_threads as usize,
            codec,
            self.cfg.durable,
        )?;
        drop(sources);
        drop(maps);
        let state = KfdState {
            format_version: gpusnap_image::KFD_FORMAT_VERSION,
            nspid,
            kfd_version: [version.major, version.minor],
            gpus: gpus.clone(),
            bos: ckpt
                .bos
                .iter()
                .map(|b| KfdBoRecord {
                    addr: b.addr,
                    size: b.size,
                    offset: b.offset,
                    gpu_id: b.gpu_id,
                    alloc_flags: b.alloc_flags,
                    content: criu::has_contents(b.alloc_flags),
                })
                .collect(),
            num_objects: info.num_objects,
            priv_data: gpusnap_image::priv_data_hex(&ckpt.priv_data),
            vmas,
            max_fd,
        };
        gpusnap_image::write_kfd_state(dir, &state).map_err(|e| e.to_string())?;
        let mut timings = BTreeMap::new();
        timings.insert("process_info".to_owned(), t_info);
        timings.insert("checkpoint".to_owned(), t_ckpt);
        timings.insert("data".to_owned(), written.seconds);
        let manifest = Manifest {
            format_version: gpusnap_image::FORMAT_VERSION,
            nspid,
            path: CheckpointPath::Kfd,
            created_unix_s: unix_now(),
            gpusnap_version: gpusnap_image::BUILD.to_owned(),
            driver_version: (version.major * 1000 + version.minor) as i32,
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(i, g)| GpuRecord {
                    ordinal: i as u32,
                    uuid: format!("{:032x}", g.gpu_id),
                    name: g.name.clone(),
                    total_mem: g.local_mem_bytes,
                })
                .collect(),
            allocations: ckpt
                .bos
                .iter()
                .enumerate()
                .filter(|(_, b)| criu::has_contents(b.alloc_flags))
                .map(|(i, b)| AllocationRecord {
                    id: i as u64,
                    device: gpu_index(b.gpu_id) as u32,
                    addr: b.addr,
                    size: b.size,
                    moved: true,
                })
                .collect(),
            files: written.files.clone(),
            chunks: written.chunks.clone(),
            timings_s: timings,
        };
        gpusnap_image::write_manifest(dir, &manifest).map_err(|e| e.to_string())?;
        let rec = KfdFileRecord {
            format_version: gpusnap_image::KFD_FORMAT_VERSION,
            kind: KfdFileKind::Kfd,
            nspid,
            flags: Self::open_flags(kfd),
            gpu_id: 0,
            render_minor: 0,
        };
        gpusnap_image::write_kfd_file(dir, id, &rec).map_err(|e| e.to_string())?;
        if self.cfg.durable {
            crate::fault::sync_dir(dir).map_err(|e| e.to_string())?;
        }
        log::info!(
            "amd: nspid {nspid}: checkpointed: {} GPUs, {} BOs ({} with contents, {} bytes in {} chunks, {} data files), {} device mappings; timings: process_info {:.3} s, checkpoint {:.3} s, data {:.3} s, total {:.3} s",
            gpus.len(),
            ckpt.bos.len(),
            manifest.allocations.len(),
            written.bytes,
            written.chunks.len(),
            written.files.len(),
            state.vmas.len(),
            t_info,
            t_ckpt,
            written.seconds,
            t0.elapsed().as_secs_f64()
        );
        Ok(state.vmas.len() as u64)
    }

    /// UNPAUSE a process whose queues gpusnap paused; kill it when that fails.
    fn undo(&self, kfd: BorrowedFd<'_>, nspid: u32, host_pid: Option<i32>, why: &str) {
        match criu::unpause(self.dev.as_ref(), kfd) {
            Ok(()) => log::info!(
                "amd: nspid {nspid}: {why}: undone: GPU queues unpaused (UNPAUSE); the process keeps running"
            ),
            Err(e) => match host_pid {
                Some(p) => {
                    // Said first: CRIU may end at once when a task it holds dies.
                    log::error!(
                        "amd: nspid {nspid}: {why}, and {e}: killing pid {p} so that it cannot run with its GPU queues stopped (fail closed)"
                    );
                    if let Err(k) = kill(p) {
                        log::error!(
                            "amd: nspid {nspid}: killing pid {p} failed ({k}): its GPU queues stay stopped; kill it by hand"
                        );
                    }
                }
                None => log::error!(
                    "amd: nspid {nspid}: {why}, and {e}; its host pid is unknown, so it could not be killed: its GPU queues stay stopped"
                ),
            },
        }
    }

    /// After CRIU's dump: UNPAUSE after `-R` or a failed dump; a failed dump's files go.
    pub fn exit(&mut self, ret: i32) {
        if ret == 0 && self.vmas_accepted != self.vmas_recorded {
            log::error!(
                "amd: {} device mappings were accepted but {} recorded with a process's KFD state: a process maps /dev/kfd or a render node without holding a KFD file gpusnap checkpointed; its restore will be refused when CRIU asks for that mapping",
                self.vmas_accepted,
                self.vmas_recorded
            );
        }
        let leave_running = crate::criu::leave_running();
        let dir = crate::criu::image_dir();
        for i in 0..self.processes.len() {
            let t = std::mem::replace(&mut self.processes[i].phase, KfdPhase::Done);
            let (nspid, host_pid) = (self.processes[i].nspid, self.processes[i].host_pid);
            let KfdPhase::Checkpointed { kfd, info } = t else {
                continue;
            };
            if ret != 0 {
                if let Some(dir) = dir
                    && let Err(e) = gpusnap_image::remove_process_files(dir, nspid)
                {
                    log::warn!("amd: nspid {nspid}: removing the image of a failed dump: {e}");
                }
                self.undo(kfd.as_fd(), nspid, host_pid, "CRIU's dump failed");
            } else if leave_running {
                self.undo(kfd.as_fd(), nspid, host_pid, "criu dump -R (leave running)");
            } else {
                log::debug!(
                    "amd: nspid {nspid}: dumped ({} BOs); CRIU ends the process",
                    info.num_bos
                );
            }
        }
    }
}

/// The GPUs of a checkpoint, with their topology facts. A GPU the topology does not list is
/// refused: a restore could not match it.
fn describe_gpus(ckpt: &KfdCheckpoint, local: &[Gpu]) -> Result<Vec<KfdGpuRecord>, String> {
    ckpt.devices
        .iter()
        .map(|d| {
            let g = local
                .iter()
                .find(|g| g.gpu_id == d.user_gpu_id)
                .ok_or_else(|| {
                    format!(
                        "CHECKPOINT lists gpu_id {}, which the KFD topology does not",
                        d.user_gpu_id
                    )
                })?;
            Ok(KfdGpuRecord {
                gpu_id: g.gpu_id,
                vendor_id: g.vendor_id,
                device_id: g.device_id,
                gfx_target_version: g.gfx_target_version.unwrap_or(0),
                simd_count: g.simd_count,
                local_mem_bytes: g.local_mem_bytes,
                name: g.name.clone().or_else(|| g.gfx_name()).unwrap_or_default(),
                drm_render_minor: g.drm_render_minor.unwrap_or(0),
            })
        })
        .collect()
}
