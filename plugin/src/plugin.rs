//! Hook bodies: plain Rust behind the thin `extern "C"` shims in `lib.rs`.
//!
//! One [`Plugin`] lives for one CRIU run (between `init` and `exit`). It reads the configuration,
//! makes one [`Backend`] per GPU vendor for the stage, and hands each hook to them in turn: the
//! first that does not answer "not mine" has it. It also records gpusnap in the image's plugin
//! inventory once a backend has put GPU state into the image. CRIU calls every hook from its
//! main thread; the mutex only makes that explicit.

use gpusnap_cuda::backend::CudaBackend;
use gpusnap_host::criu::{self, Reopened, Stage};
use gpusnap_host::pid::HostPid;
use gpusnap_host::{Answer, Backend};
use gpusnap_rocm::run::AmdSide;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Mutex;

pub use gpusnap_host::criu::PLUGIN_NAME as NAME;
pub const ENOTSUP: i32 = -libc::ENOTSUP;

pub struct Plugin {
    /// `gpusnap` is in the image's plugin inventory (dump).
    in_inventory: bool,
    /// In the order hooks are offered: the AMD side first (its hooks are files CRIU hands to
    /// plugins), then the NVIDIA side.
    backends: Vec<Box<dyn Backend>>,
}

static PLUGIN: Mutex<Option<Plugin>> = Mutex::new(None);

/// Runs `f` on the plugin of this CRIU run; `default` when there is none.
pub fn with<R>(default: R, f: impl FnOnce(&mut Plugin) -> R) -> R {
    let mut g = PLUGIN.lock().unwrap_or_else(|e| e.into_inner());
    match g.as_mut() {
        Some(p) => f(p),
        None => default,
    }
}

pub fn init(raw_stage: i32) -> i32 {
    gpusnap_host::logger::init(None);
    let Some(stage) = Stage::from_raw(raw_stage) else {
        log::error!("unknown CRIU stage {raw_stage}; refusing to run");
        return -1;
    };
    let stage_name = match stage {
        Stage::Dump => "dump",
        Stage::PreDump => "pre-dump",
        Stage::Restore => "restore",
    };
    log::info!(
        "gpusnap {} loaded (stage {stage_name})",
        gpusnap_image::BUILD
    );
    let cfg = match gpusnap_config::load() {
        Ok(c) => c,
        Err(e) => {
            gpusnap_host::logger::tell_user(&format!(
                "configuration error: {e}; fix it or remove it, then run CRIU again (`gpusnap check` lists every problem)"
            ));
            return -1;
        }
    };
    if let Err(e) = gpusnap_host::fault::check() {
        gpusnap_host::logger::tell_user(&format!("{e}; refusing to run"));
        return -1;
    }
    if let Some(level) = cfg.log_level {
        gpusnap_host::logger::init(Some(level.to_level_filter()));
    }
    log::debug!("configuration: {}", cfg.describe());
    log::debug!("{}", gpusnap_rocm::status_line(&gpusnap_rocm::detect()));
    let image_dir = criu::image_dir();
    let (rc, backends) = backends_for(stage, cfg, image_dir);
    *PLUGIN.lock().unwrap_or_else(|e| e.into_inner()) = Some(Plugin {
        in_inventory: false,
        backends,
    });
    rc
}

/// Each vendor's backend for `stage`, in hook order, and `init`'s answer: -1 when a restore
/// is refused (by the first backend that refuses; the others are not asked to say it again).
fn backends_for(
    stage: Stage,
    cfg: gpusnap_config::Config,
    image_dir: Option<BorrowedFd<'static>>,
) -> (i32, Vec<Box<dyn Backend>>) {
    if stage != Stage::PreDump && !criu::is_4_1_or_newer() && criu::inside_criu() {
        // CRIU 4.0 lacks the plugin inventory and the `opts` layout gpusnap relies on to tell
        // `criu dump -R`; acting there could leave a process checkpointed.
        log::error!(
            "this CRIU is older than 4.1; gpusnap needs CRIU 4.1 or newer: GPU checkpointing disabled"
        );
        let why = "CRIU older than 4.1";
        return (
            0,
            vec![
                Box::new(AmdSide::Idle(why.into())),
                Box::new(CudaBackend::disabled(stage, why)),
            ],
        );
    }
    let amd_cfg = cfg.clone();
    let refused = "restore refused";
    let cuda = match CudaBackend::init(stage, cfg, image_dir) {
        Ok(c) => c,
        Err(gpusnap_cuda::backend::Refused) => {
            return (
                -1,
                vec![
                    Box::new(AmdSide::Idle(refused.into())),
                    Box::new(CudaBackend::disabled(stage, refused)),
                ],
            );
        }
    };
    match AmdSide::init(stage, &amd_cfg, image_dir) {
        Ok(amd) => (0, vec![Box::new(amd), Box::new(cuda)]),
        Err(e) => {
            log::error!("amd: restore refused: {e}; nothing was restored and no GPU was touched");
            (
                -1,
                vec![Box::new(AmdSide::Idle(refused.into())), Box::new(cuda)],
            )
        }
    }
}

impl Plugin {
    /// Marks the image as holding GPU state (once).
    fn note_gpu_state(&mut self) {
        if !self.in_inventory {
            self.in_inventory = criu::add_inventory_plugin(NAME);
        }
    }

    /// The first answer other than "not mine"; a dump-side answer that put GPU state into the
    /// image is noted in the inventory.
    fn first(&mut self, notes_state: bool, mut ask: impl FnMut(&mut dyn Backend) -> Answer) -> i32 {
        let answer = self
            .backends
            .iter_mut()
            .map(|b| ask(b.as_mut()))
            .find(|a| *a != Answer::NotMine)
            .unwrap_or(Answer::NotMine);
        if notes_state && answer == Answer::Done {
            self.note_gpu_state();
        }
        answer.rc()
    }

    /// DUMP_EXT_FILE: a device file (AMD's KFD and render nodes, NVIDIA's device files).
    pub fn dump_ext_file(&mut self, fd: BorrowedFd<'_>, id: i32) -> i32 {
        let Ok(id) = u32::try_from(id) else {
            return ENOTSUP;
        };
        self.first(true, |b| b.dump_ext_file(fd, id))
    }

    /// RESTORE_EXT_FILE, in a restored task: the device file again. `None`: not a file gpusnap
    /// recorded.
    pub fn restore_ext_file(&mut self, id: i32) -> Option<Reopened> {
        let id = u32::try_from(id).ok()?;
        // In a restored task: its own number for CRIU's image directory.
        let dir = criu::image_dir()?;
        self.backends
            .iter_mut()
            .find_map(|b| b.restore_ext_file(dir, id))
    }

    /// HANDLE_DEVICE_VMA: 0 for a mapping of a device file a backend handles, "not mine" else.
    pub fn handle_device_vma(&mut self, fd: Option<BorrowedFd<'_>>, mode: u32, rdev: u64) -> i32 {
        let Some(fd) = fd else {
            return ENOTSUP;
        };
        self.first(true, |b| b.handle_device_vma(fd, mode, rdev))
    }

    /// UPDATE_VMA_MAP, in a restored task: `Some((new offset, fd))` for a device mapping gpusnap
    /// recorded; `None` for any other mapping.
    pub fn update_vma_map(&mut self, path: &str, addr: u64, old: u64) -> Option<(u64, OwnedFd)> {
        self.backends
            .iter_mut()
            .find_map(|b| b.update_vma_map(path, addr, old))
    }

    /// POST_FORKING (CRIU 4.2+): every task is forked; background work may start now. Always
    /// answers "not mine" so that other plugins' POST_FORKING hooks run too.
    pub fn post_forking(&mut self) -> i32 {
        for b in &mut self.backends {
            b.post_forking();
        }
        ENOTSUP
    }

    pub fn pause_devices(&mut self, pid: HostPid) -> i32 {
        self.first(true, |b| b.pause_devices(pid))
    }

    pub fn checkpoint_devices(&mut self, pid: HostPid) -> i32 {
        self.first(false, |b| b.checkpoint_devices(pid))
    }

    pub fn resume_devices_late(&mut self, pid: HostPid) -> i32 {
        self.first(false, |b| b.resume_devices_late(pid))
    }

    pub fn exit(&mut self, ret: i32) {
        for b in &mut self.backends {
            b.exit(ret);
        }
    }
}

/// Called by `exit`: runs the run's end and forgets this run.
pub fn finish(ret: i32) {
    let mut g = PLUGIN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = g.as_mut() {
        p.exit(ret);
    }
    *g = None;
}
