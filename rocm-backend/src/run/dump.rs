//! The dump side of the kfd path: one AMD process per `/dev/kfd` file CRIU hands over.
//!
//! Order for a process (all inside its `DUMP_EXT_FILE`, while CRIU holds it seized):
//! GET_VERSION (refused below 1.8) → PROCESS_INFO (queues paused) → CHECKPOINT → each VRAM/GTT
//! BO mapped through its dma-buf and written to data files → `gpusnap-<nspid>-kfd.img` →
//! manifest (last) → `gpusnap-kfdfile-<id>.img`. What is left to undo is the process's
//! [`DumpPhase`]: a failure inside the hook UNPAUSEs at once and removes the process's files;
//! `exit` UNPAUSEs every checkpointed process after `criu dump -R` or a failed dump (and removes
//! the files of a failed one). An UNPAUSE that fails leaves a process whose GPU queues stay
//! stopped, so it is killed and reaped ([`gpusnap_host::reap`]), and the log says so (fail closed).
//!
//! Should CRIU die while a process is paused or checkpointed, the process runs on the CPU with
//! its GPU queues stopped and its device memory in place (an AMD dump never releases memory):
//! it computes nothing on the GPU until `gpusnap recover PID` UNPAUSEs it ([`super::recover`]).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::time::Instant;

use crate::bo::BoMapping;
use crate::kfd::criu::{self, KfdCheckpoint};
use crate::kfd::device::{DeviceFile, KfdDevice, device_of, device_of_stat};
use crate::kfd::vma::{self, BoView, VmaNode};
use crate::kfd::{KfdError, KfdVersion};
use crate::topology::{self, Gpu, TopologyError};
use gpusnap_config::Config;
use gpusnap_image::{
    AllocationRecord, CheckpointPath, GpuRecord, ImageError, KfdBoRecord, KfdFileKind,
    KfdFileRecord, KfdGpuRecord, KfdState, KfdVmaNode, KfdVmaRecord, Manifest,
};

use super::coexist;
use super::data::{self, BoSource, DataError, Written};
use super::phase::{DumpPhase, ImpossibleMove};
use gpusnap_host::pid::{HostPid, NsPid};
use gpusnap_host::procfs;
use gpusnap_proto::ForeignFd;

/// Why one AMD process could not be checkpointed.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error("cannot keep the KFD file: {0}")]
    KeepFile(#[source] std::io::Error),
    /// GET_VERSION failed.
    #[error(transparent)]
    Version(KfdError),
    #[error(
        "KFD ioctl {0} has no usable CRIU support (1.8 or newer needed); the process cannot be checkpointed"
    )]
    NoCriuSupport(KfdVersion),
    #[error("{source} ({device})")]
    ProcessInfo {
        device: String,
        #[source]
        source: KfdError,
    },
    #[error(transparent)]
    Checkpoint(KfdError),
    #[error(transparent)]
    Topology(#[from] TopologyError),
    #[error("CHECKPOINT lists gpu_id {0}, which the KFD topology does not")]
    UnknownGpu(u32),
    #[error(
        "the process holding the KFD file was not found, so its device mappings cannot be recorded"
    )]
    HolderNotFound,
    #[error("reading /proc: {0}")]
    Proc(#[source] std::io::Error),
    #[error(
        "its mapping {start:#x}-{end:#x} of {path} at offset {offset:#x} cannot be made again at restore: {why}"
    )]
    Mapping {
        start: u64,
        end: u64,
        path: String,
        offset: u64,
        #[source]
        why: crate::kfd::vma::VmaError,
    },
    #[error(
        "BO {index} at {addr:#x} ({size} bytes, flags {flags:#x}): CHECKPOINT returned no dma-buf for it"
    )]
    NoDmabuf {
        index: usize,
        addr: u64,
        size: u64,
        flags: u32,
    },
    #[error(
        "BO {index} at {addr:#x} ({size} bytes, flags {flags:#x}): its dma-buf cannot be mapped ({source}); VRAM outside the CPU-visible window would need an SDMA copy, which gpusnap does not do"
    )]
    Unmappable {
        index: usize,
        addr: u64,
        size: u64,
        flags: u32,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("internal: {0}")]
    Phase(#[from] ImpossibleMove),
}

impl DumpError {
    /// Whether the kernel left the queues running (nothing was paused, so nothing to undo).
    fn before_pause(&self) -> bool {
        matches!(
            self,
            DumpError::KeepFile(_)
                | DumpError::Version(_)
                | DumpError::NoCriuSupport(_)
                | DumpError::ProcessInfo { .. }
        )
    }
}

struct Tracked {
    nspid: NsPid,
    /// The process's pid as this CRIU sees it (found by its open KFD file), for kills.
    host_pid: Option<HostPid>,
    phase: DumpPhase,
}

/// The AMD part of a `criu dump`.
pub struct AmdDump {
    dev: Box<dyn KfdDevice>,
    cfg: Config,
    /// CRIU's image directory, fetched once at init.
    dir: Option<BorrowedFd<'static>>,
    processes: Vec<Tracked>,
    /// `Some(path)` once seen: CRIU's amdgpu plugin is loaded, and gets every AMD file.
    deferred_to: Option<Option<String>>,
    /// Device mappings accepted in `HANDLE_DEVICE_VMA` (all processes), and recorded with a
    /// process's KFD state: the two must agree by the end of the dump.
    vmas_accepted: u64,
    vmas_recorded: u64,
}

/// The pid of the process (other than this one, and of namespace pid `nspid` when given) whose
/// fd refers to the same open file as `fd`: found with `kcmp(KCMP_FILE)` over the fds that
/// link to the same path.
fn holder_of(fd: BorrowedFd<'_>, nspid: Option<NsPid>) -> Option<HostPid> {
    let me = HostPid(std::process::id() as i32);
    // Our own descriptor, as `/proc` names it.
    let path = std::fs::read_link(format!("/proc/{me}/fd/{}", fd.as_raw_fd())).ok()?;
    for pid in procfs::processes().ok()? {
        if pid == me || nspid.is_some_and(|n| procfs::ns_pid(pid).ok() != Some(n)) {
            continue;
        }
        let Ok(fds) = procfs::fd_numbers(pid) else {
            continue;
        };
        for n in fds {
            if procfs::fd_target(pid, n).ok().as_ref() != Some(&path) {
                continue;
            }
            // SAFETY: kcmp compares two files by (pid, fd); no memory is passed.
            let same = unsafe {
                libc::syscall(
                    libc::SYS_kcmp,
                    me.get(),
                    pid.get(),
                    0, // KCMP_FILE
                    fd.as_raw_fd() as libc::c_ulong,
                    n.get() as libc::c_ulong,
                )
            } == 0;
            if same {
                return Some(pid);
            }
        }
    }
    None
}

/// What CHECKPOINT found, with the topology facts of its GPUs: the source of the KFD state
/// and of the manifest.
struct Checkpointed<'a> {
    ckpt: &'a KfdCheckpoint,
    gpus: &'a [KfdGpuRecord],
    version: KfdVersion,
}

impl Checkpointed<'_> {
    /// The index (in `gpus`) of user gpu_id `gpu_id`.
    fn gpu_index(&self, gpu_id: u32) -> usize {
        self.gpus
            .iter()
            .position(|g| g.gpu_id == gpu_id)
            .unwrap_or(0)
    }

    /// The manifest of the process: every content BO an allocation, every chunk written.
    fn manifest(
        &self,
        nspid: NsPid,
        written: &Written,
        timings: BTreeMap<String, f64>,
    ) -> Manifest {
        let v = self.version;
        let mut m = Manifest::begin(
            nspid,
            CheckpointPath::Kfd,
            (v.major * 1000 + v.minor) as i32,
        );
        m.gpus = self
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| GpuRecord {
                ordinal: i as u32,
                uuid: format!("{:032x}", g.gpu_id),
                name: g.name.clone(),
                total_mem: g.local_mem_bytes,
            })
            .collect();
        m.allocations = self
            .ckpt
            .bos
            .iter()
            .enumerate()
            .filter(|(_, b)| criu::has_contents(b.alloc_flags))
            .map(|(i, b)| AllocationRecord {
                id: i as u64,
                device: self.gpu_index(b.gpu_id) as u32,
                addr: b.addr,
                size: b.size,
                moved: true,
                lent: false,
                rdma_capable: false,
            })
            .collect();
        m.files = written.files.clone();
        m.chunks = written.chunks.clone();
        m.timings_s = timings;
        m
    }

    /// The KFD state file of the process.
    fn state(&self, nspid: NsPid, vmas: Vec<KfdVmaRecord>, max_fd: u32) -> KfdState {
        KfdState {
            format_version: gpusnap_image::KFD_FORMAT_VERSION,
            nspid,
            kfd_version: [self.version.major, self.version.minor],
            gpus: self.gpus.to_vec(),
            bos: self
                .ckpt
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
            num_objects: self.ckpt.info.num_objects,
            priv_data: gpusnap_image::priv_data_hex(&self.ckpt.priv_data),
            vmas,
            max_fd,
        }
    }
}

impl AmdDump {
    pub fn new(dev: Box<dyn KfdDevice>, cfg: Config, dir: Option<BorrowedFd<'static>>) -> AmdDump {
        AmdDump {
            dev,
            cfg,
            dir,
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
        pid: HostPid,
        ckpt: &KfdCheckpoint,
        gpus: &[KfdGpuRecord],
    ) -> Result<Vec<KfdVmaRecord>, DumpError> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let maps = procfs::maps(pid).map_err(DumpError::Proc)?;
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
            let Ok(meta) = procfs::mapped_file_metadata(pid, m.start, m.end) else {
                continue;
            };
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
                |why| DumpError::Mapping {
                    start: m.start,
                    end: m.end,
                    path: m.path.clone(),
                    offset: m.offset,
                    why,
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
        let dir = self.dir?;
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

    fn nspid_of(host: Option<HostPid>) -> NsPid {
        host.and_then(|p| procfs::ns_pid(p).ok())
            .unwrap_or(NsPid(0))
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
        let mut t = Tracked {
            nspid: NsPid(0),
            host_pid: None,
            phase: DumpPhase::Untouched,
        };
        match self.checkpoint(dir, fd, id, &mut t) {
            Ok(n_vmas) => {
                self.vmas_recorded += n_vmas;
                self.processes.push(t);
                0
            }
            Err(e) if e.before_pause() => {
                log::error!(
                    "amd: file {id}: {e}; the kernel left its queues running; nothing to undo"
                );
                -1
            }
            Err(e) => {
                log::error!("amd: nspid {}: {e}", t.nspid);
                if let Err(e) = gpusnap_image::remove_process_files(dir, t.nspid) {
                    log::warn!("amd: nspid {}: removing its partial image: {e}", t.nspid);
                }
                let _ = gpusnap_host::fault::sync_dir(dir);
                self.undo(&mut t, "the dump failed");
                -1
            }
        }
    }

    /// PROCESS_INFO, CHECKPOINT and everything written for the process of `fd`, moving `t`
    /// through its phases.
    fn checkpoint(
        &self,
        dir: BorrowedFd<'_>,
        fd: BorrowedFd<'_>,
        id: u32,
        t: &mut Tracked,
    ) -> Result<u64, DumpError> {
        let t0 = Instant::now();
        let kfd = fd.try_clone_to_owned().map_err(DumpError::KeepFile)?;
        let version = self.dev.version(kfd.as_fd()).map_err(DumpError::Version)?;
        if !version.supports_criu() {
            return Err(DumpError::NoCriuSupport(version));
        }
        let info = criu::process_info(self.dev.as_ref(), kfd.as_fd()).map_err(|source| {
            DumpError::ProcessInfo {
                device: self.dev.describe(),
                source,
            }
        })?;
        t.nspid = info.pid;
        t.phase.paused(kfd, info)?;
        gpusnap_host::fault::kill_criu_at("amd-dump-paused");
        let t_info = t0.elapsed().as_secs_f64();
        t.host_pid = holder_of(fd, Some(info.pid));
        log::info!(
            "amd: nspid {} (pid {}): queues paused (PROCESS_INFO: {} GPUs, {} BOs, {} objects, {} bytes of private data) in {:.3} s",
            info.pid,
            t.host_pid.map_or("?".into(), |p| p.to_string()),
            info.num_devices,
            info.num_bos,
            info.num_objects,
            info.priv_data_size,
            t_info
        );
        let kfd = t.phase.kfd().ok_or(ImpossibleMove {
            from: t.phase.name(),
            to: "checkpointed",
        })?;
        let n_vmas = self.save(dir, kfd, version, id, t, t0, t_info)?;
        t.phase.checkpointed()?;
        gpusnap_host::fault::kill_criu_at("amd-dump-checkpointed");
        Ok(n_vmas)
    }

    /// CHECKPOINT and everything written for one paused process; returns how many device
    /// mappings it recorded.
    #[allow(clippy::too_many_arguments)]
    fn save(
        &self,
        dir: BorrowedFd<'_>,
        kfd: BorrowedFd<'_>,
        version: KfdVersion,
        id: u32,
        t: &Tracked,
        t0: Instant,
        t_info: f64,
    ) -> Result<u64, DumpError> {
        let nspid = t.nspid;
        let info = t.phase.info().copied().ok_or(ImpossibleMove {
            from: t.phase.name(),
            to: "checkpointed",
        })?;
        let ckpt =
            criu::checkpoint(self.dev.as_ref(), kfd, &info).map_err(DumpError::Checkpoint)?;
        let t_ckpt = t0.elapsed().as_secs_f64() - t_info;
        let local = topology::read_gpus(&self.dev.topology_dir())?;
        let gpus = describe_gpus(&ckpt, &local)?;
        let taken = Checkpointed {
            ckpt: &ckpt,
            gpus: &gpus,
            version,
        };
        // Its device mappings, read while CRIU holds it seized (they cannot change).
        let pid = t.host_pid.ok_or(DumpError::HolderNotFound)?;
        let vmas = self.record_vmas(pid, &ckpt, &gpus)?;
        let max_fd = procfs::fd_numbers(pid)
            .map_err(DumpError::Proc)?
            .into_iter()
            .max()
            .map_or(0, ForeignFd::get)
            .max(0) as u32;
        // Map every content BO through its dma-buf.
        let mut maps: Vec<(usize, BoMapping)> = Vec::new();
        for (i, b) in ckpt.bos.iter().enumerate() {
            if !criu::has_contents(b.alloc_flags) {
                continue;
            }
            let fd = ckpt.dmabufs[i].as_ref().ok_or(DumpError::NoDmabuf {
                index: i,
                addr: b.addr,
                size: b.size,
                flags: b.alloc_flags,
            })?;
            let m = BoMapping::map(fd.as_fd(), b.size, false).map_err(|source| {
                DumpError::Unmappable {
                    index: i,
                    addr: b.addr,
                    size: b.size,
                    flags: b.alloc_flags,
                    source,
                }
            })?;
            maps.push((i, m));
        }
        let sources: Vec<BoSource<'_>> = maps
            .iter()
            .map(|(i, m)| BoSource {
                addr: ckpt.bos[*i].addr,
                map: m,
                gpu: taken.gpu_index(ckpt.bos[*i].gpu_id),
            })
            .collect();
        let codec = gpusnap_host::codec::codec_for(&self.cfg, dir).0;
        gpusnap_image::remove_process_files(dir, nspid)?;
        let written = data::write_bos(dir, nspid, &sources, &self.cfg, codec)?;
        drop(sources);
        drop(maps);
        let state = taken.state(nspid, vmas, max_fd);
        gpusnap_image::write_kfd_state(dir, &state)?;
        let mut timings = BTreeMap::new();
        timings.insert("process_info".to_owned(), t_info);
        timings.insert("checkpoint".to_owned(), t_ckpt);
        timings.insert("data".to_owned(), written.seconds);
        let manifest = taken.manifest(nspid, &written, timings);
        gpusnap_image::write_manifest(dir, &manifest)?;
        let rec = KfdFileRecord {
            format_version: gpusnap_image::KFD_FORMAT_VERSION,
            kind: KfdFileKind::Kfd,
            nspid,
            flags: Self::open_flags(kfd),
            gpu_id: 0,
            render_minor: 0,
        };
        gpusnap_image::write_kfd_file(dir, id, &rec)?;
        if self.cfg.durable {
            gpusnap_host::fault::sync_dir(dir)?;
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

    /// UNPAUSE a process whose queues gpusnap paused; kill (and reap) it when that fails.
    fn undo(&self, t: &mut Tracked, why: &str) {
        let nspid = t.nspid;
        let Some(kfd) = t.phase.kfd() else {
            return; // nothing paused
        };
        let unpaused = criu::unpause(self.dev.as_ref(), kfd);
        match unpaused {
            Ok(()) => {
                log::info!(
                    "amd: nspid {nspid}: {why}: undone: GPU queues unpaused (UNPAUSE); the process keeps running"
                );
                let _ = t.phase.unpaused();
            }
            Err(e) => match t.host_pid {
                Some(p) => {
                    // Said first: CRIU may end at once when a task it holds dies.
                    log::error!(
                        "amd: nspid {nspid}: {why}, and {e}: killing pid {p} so that it cannot run with its GPU queues stopped (fail closed)"
                    );
                    match gpusnap_host::reap::kill_and_reap(p) {
                        Ok(_) => {
                            let _ = t.phase.killed();
                        }
                        Err(k) => log::error!(
                            "amd: nspid {nspid}: {k}: its GPU queues stay stopped; kill it by hand"
                        ),
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
        let leave_running = gpusnap_host::criu::leave_running();
        let dir = self.dir;
        let mut processes = std::mem::take(&mut self.processes);
        for t in &mut processes {
            if !matches!(t.phase, DumpPhase::Checkpointed { .. }) {
                continue;
            }
            let nspid = t.nspid;
            if ret != 0 {
                if let Some(dir) = dir
                    && let Err(e) = gpusnap_image::remove_process_files(dir, nspid)
                {
                    log::warn!("amd: nspid {nspid}: removing the image of a failed dump: {e}");
                }
                gpusnap_host::fault::kill_criu_at("amd-rollback");
                self.undo(t, "CRIU's dump failed");
            } else if leave_running {
                gpusnap_host::fault::kill_criu_at("amd-rollback");
                self.undo(t, "criu dump -R (leave running)");
            } else {
                let bos = t.phase.info().map_or(0, |i| i.num_bos);
                let _ = t.phase.dumped();
                log::debug!("amd: nspid {nspid}: dumped ({bos} BOs); CRIU ends the process");
            }
        }
        self.processes = processes;
    }
}

/// The GPUs of a checkpoint, with their topology facts. A GPU the topology does not list is
/// refused: a restore could not match it.
fn describe_gpus(ckpt: &KfdCheckpoint, local: &[Gpu]) -> Result<Vec<KfdGpuRecord>, DumpError> {
    ckpt.devices
        .iter()
        .map(|d| {
            let g = local
                .iter()
                .find(|g| g.gpu_id == d.user_gpu_id)
                .ok_or(DumpError::UnknownGpu(d.user_gpu_id))?;
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
