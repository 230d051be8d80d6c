//! Hook bodies: plain Rust behind the thin `extern "C"` shims in `lib.rs`.
//!
//! One [`Plugin`] lives for one CRIU run (between `init` and `exit`): it serves NVIDIA device
//! files that hold no CUDA state, and dispatches the GPU hooks to the run of its stage
//! ([`Run`]): a [`DumpRun`], a [`RestoreRun`], or nothing, with the reason. CRIU calls every
//! hook from its main thread; the mutex only makes that explicit.

use crate::criu::{self, Stage};
use crate::dump::DumpRun;
use crate::restore::{RestoreInit, RestoreRun};
use gpusnap_config::Mode;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Mutex;

pub use crate::criu::PLUGIN_NAME as NAME;
pub const ENOTSUP: i32 = -libc::ENOTSUP;

/// What gpusnap does with the GPU processes of this run.
pub enum Run {
    /// Nothing: the reason (for the log and tests).
    Disabled(String),
    Dump(Box<DumpRun>),
    Restore(Box<RestoreRun>),
}

pub struct Plugin {
    stage: Stage,
    /// Device files are recorded and re-opened unless gpusnap is off.
    device_files: bool,
    /// `durable = true`: a device-file record is fsynced with its directory before the hook
    /// answers.
    durable: bool,
    /// `gpusnap` is in the image's plugin inventory (dump).
    in_inventory: bool,
    /// CRIU's image directory in CRIU's own process, fetched once at `init` (the runs hold it
    /// too). Hooks that run in a restored task fetch that task's own ([`criu::image_dir`]).
    image_dir: Option<BorrowedFd<'static>>,
    run: Run,
    /// AMD GPU processes (`crate::amd`), beside the CUDA run.
    amd: crate::amd::AmdSide,
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

/// A hook's answer for one pid.
fn answer(r: Option<bool>) -> i32 {
    match r {
        Some(true) => 0,
        Some(false) => -1,
        None => ENOTSUP,
    }
}

pub fn init(raw_stage: i32) -> i32 {
    crate::logger::init(None);
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
            crate::logger::tell_user(&format!(
                "configuration error: {e}; fix it or remove it, then run CRIU again (`gpusnap check` lists every problem)"
            ));
            return -1;
        }
    };
    if let Err(e) = crate::fault::check() {
        crate::logger::tell_user(&format!("{e}; refusing to run"));
        return -1;
    }
    if let Some(level) = cfg.log_level {
        crate::logger::init(Some(level.to_level_filter()));
    }
    log::debug!("configuration: {}", cfg.describe());
    log::debug!("{}", gpusnap_rocm::status_line(&gpusnap_rocm::detect()));
    let image_dir = criu::image_dir();
    let device_files = cfg.mode != Mode::Off;
    let amd_cfg = cfg.clone();
    let durable = cfg.durable;
    let (rc, run) = if stage != Stage::PreDump && !criu::is_4_1_or_newer() && criu::inside_criu() {
        // CRIU 4.0 lacks the plugin inventory and the `opts` layout gpusnap relies on to tell
        // `criu dump -R`; acting there could leave a process checkpointed.
        log::error!(
            "this CRIU is older than 4.1; gpusnap needs CRIU 4.1 or newer: GPU checkpointing disabled"
        );
        (0, Run::Disabled("CRIU older than 4.1".into()))
    } else {
        match stage {
            Stage::PreDump => {
                log::info!("pre-dump: GPU state is not pre-dumped (the final dump takes it)");
                (0, Run::Disabled("pre-dump".into()))
            }
            Stage::Dump => (0, init_dump(cfg, image_dir)),
            Stage::Restore => match RestoreRun::init(cfg, image_dir) {
                RestoreInit::Run(r) => (0, Run::Restore(r)),
                RestoreInit::NothingToDo(why) => (0, Run::Disabled(why)),
                RestoreInit::Refused => (-1, Run::Disabled("restore refused".into())),
            },
        }
    };
    let (rc, amd) = if !criu::is_4_1_or_newer() && criu::inside_criu() {
        (rc, crate::amd::AmdSide::Idle("CRIU older than 4.1".into()))
    } else if rc != 0 {
        // Refused already, with its reason: the AMD side would only say it again.
        (rc, crate::amd::AmdSide::Idle("restore refused".into()))
    } else {
        match crate::amd::AmdSide::init(stage, &amd_cfg, image_dir) {
            Ok(a) => (rc, a),
            Err(e) => {
                log::error!(
                    "amd: restore refused: {e}; nothing was restored and no GPU was touched"
                );
                (-1, crate::amd::AmdSide::Idle("restore refused".into()))
            }
        }
    };
    *PLUGIN.lock().unwrap_or_else(|e| e.into_inner()) = Some(Plugin {
        stage,
        device_files: device_files && stage != Stage::PreDump,
        durable,
        in_inventory: false,
        image_dir,
        run,
        amd,
    });
    rc
}

fn init_dump(cfg: gpusnap_config::Config, dir: Option<BorrowedFd<'static>>) -> Run {
    if cfg.mode == Mode::Off {
        log::info!("disabled by configuration (mode = off)");
        return Run::Disabled("mode = off".into());
    }
    if let Some(why) = crate::context::driver_absent_reason() {
        log::info!(
            "no usable NVIDIA driver on this host ({why}); NVIDIA GPU checkpointing disabled"
        );
        return Run::Disabled(why);
    }
    // Driver calls must run while CRIU holds the other threads with ptrace, not a frozen cgroup.
    if !criu::set_compel_interrupt_only_mode() {
        log::warn!(
            "this CRIU cannot seize in interrupt-only mode; frozen containers may hang the lock"
        );
    }
    if let Some(d) = dir {
        crate::parent::start_checks(d, cfg.incremental, cfg.effective_reader_threads());
    }
    Run::Dump(Box::new(DumpRun::new(cfg, dir)))
}

impl Plugin {
    /// Marks the image as holding GPU state (once).
    fn note_gpu_state(&mut self) {
        if !self.in_inventory {
            self.in_inventory = criu::add_inventory_plugin(NAME);
        }
    }

    /// DUMP_EXT_FILE: NVIDIA device files held without CUDA state.
    pub fn dump_ext_file(&mut self, fd: BorrowedFd<'_>, id: i32) -> i32 {
        if self.stage != Stage::Dump || !self.device_files || id < 0 {
            return ENOTSUP;
        }
        if let Some(rc) = self.amd.dump_ext_file(fd, id as u32) {
            if rc == 0 {
                self.note_gpu_state();
            }
            return rc;
        }
        let Some(dir) = self.image_dir else {
            return ENOTSUP;
        };
        match crate::devfile::dump(dir, fd, id as u32, self.durable) {
            Ok(true) => {
                self.note_gpu_state();
                0
            }
            Ok(false) => ENOTSUP,
            Err(e) => {
                log::error!("file {id}: recording an NVIDIA device file failed: {e}");
                -1
            }
        }
    }

    /// RESTORE_EXT_FILE, in a restored task: open the device file again. `None`: not a file
    /// gpusnap recorded.
    pub fn restore_ext_file(&mut self, id: i32) -> Option<criu::Reopened> {
        if self.stage != Stage::Restore || !self.device_files || id < 0 {
            return None;
        }
        // In a restored task: its own number for CRIU's image directory, not `self.image_dir`.
        let dir = criu::image_dir()?;
        if let Some(r) = self.amd.restore_ext_file(dir, id as u32) {
            return Some(r);
        }
        match crate::devfile::restore(dir, id as u32) {
            Ok(Some(fd)) => Some(criu::Reopened::Fd(fd)),
            Ok(None) => None,
            Err(e) => {
                log::error!("file {id}: {e}");
                Some(criu::Reopened::Failed)
            }
        }
    }

    /// HANDLE_DEVICE_VMA: 0 for a mapping of an AMD device file this dump handles (recorded
    /// with its process's KFD state), "not mine" for anything else.
    pub fn handle_device_vma(&mut self, fd: Option<BorrowedFd<'_>>, mode: u32, rdev: u64) -> i32 {
        if self.stage != Stage::Dump || !self.device_files {
            return ENOTSUP;
        }
        let Some(fd) = fd else {
            return ENOTSUP;
        };
        match self.amd.handle_device_vma(fd, mode, rdev) {
            Some(rc) => {
                if rc == 0 {
                    self.note_gpu_state();
                }
                rc
            }
            None => ENOTSUP,
        }
    }

    /// UPDATE_VMA_MAP, in a restored task: `Some((new offset, fd))` for a device mapping gpusnap
    /// recorded; `None` for any other mapping.
    pub fn update_vma_map(&mut self, path: &str, addr: u64, old: u64) -> Option<(u64, OwnedFd)> {
        if self.stage != Stage::Restore || !self.device_files {
            return None;
        }
        self.amd.update_vma_map(path, addr, old)
    }

    /// POST_FORKING (CRIU 4.2+): every task is forked; background work may start now. Always
    /// answers "not mine" so that other plugins' POST_FORKING hooks run too.
    pub fn post_forking(&mut self) -> i32 {
        if let Run::Restore(r) = &mut self.run {
            r.post_forking();
        }
        ENOTSUP
    }

    pub fn pause_devices(&mut self, pid: i32) -> i32 {
        let Run::Dump(d) = &mut self.run else {
            return ENOTSUP;
        };
        let r = d.pause_devices(pid);
        if r == Some(true) {
            self.note_gpu_state();
        }
        answer(r)
    }

    pub fn checkpoint_devices(&mut self, pid: i32) -> i32 {
        match &mut self.run {
            Run::Dump(d) => {
                let rc = answer(d.checkpoint_devices(pid));
                seal_agent_door(pid);
                rc
            }
            _ => ENOTSUP,
        }
    }

    pub fn resume_devices_late(&mut self, pid: i32) -> i32 {
        if let Some(rc) = self.amd.resume_devices_late(pid) {
            return rc;
        }
        match &mut self.run {
            Run::Restore(r) => answer(r.resume_devices_late(pid)),
            _ => ENOTSUP,
        }
    }

    pub fn exit(&mut self, ret: i32) {
        self.amd.exit(ret);
        match &mut self.run {
            Run::Dump(d) => {
                d.exit(ret);
                crate::parent::finish_checks();
            }
            Run::Restore(r) => r.exit(),
            Run::Disabled(_) => {}
        }
    }
}

/// After CHECKPOINT_DEVICES of `pid` (CRIU calls it for every process of the tree, and the
/// first call has stopped again every agent thread it let run): `pid`'s agent door, if it has
/// one, is sealed until CRIU has dumped its descriptors (`gpusnap_proto::seal_door`), so that no
/// other client's knock is in flight there, where CRIU cannot dump it. The agent opens a new
/// door once its thread runs again.
fn seal_agent_door(pid: i32) {
    match gpusnap_proto::seal_door(pid) {
        Ok(Some(n)) if n > 0 => log::info!(
            "pid {pid}: the agent's door sealed for the dump; {n} knocks of other clients taken out of it"
        ),
        Ok(_) => {}
        Err(e) => log::warn!("pid {pid}: cannot seal the agent's door for the dump: {e}"),
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
