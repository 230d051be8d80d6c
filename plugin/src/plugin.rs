//! Hook bodies: plain Rust behind the thin `extern "C"` shims in `lib.rs`.
//!
//! One [`Plugin`] lives for one CRIU run (between `init` and `exit`). CRIU calls every hook from
//! its main thread; the mutex only makes that explicit.

use crate::context::{self, Ctx};
use crate::criu::{self, Stage};
use crate::process::{self, Tracked};
use crate::{dump, restore};
use gpusnap_config::{Config, Mode};
use gpusnap_image::Manifest;
use std::collections::HashMap;
use std::sync::Mutex;

pub const NAME: &std::ffi::CStr = c"gpusnap";
pub const ENOTSUP: i32 = -libc::ENOTSUP;

pub struct Plugin {
    stage: Stage,
    cfg: Config,
    /// Why gpusnap does nothing in this run, if it does nothing.
    disabled: Option<String>,
    ctx: Option<Ctx>,
    tracked: Vec<Tracked>,
    in_inventory: bool,
    /// Outcome of the (single, parallel) checkpoint of every tracked process, by pid.
    checkpointed: Vec<(i32, Result<(), dump::DumpError>)>,
    /// Likewise for the restore.
    restored: restore::Restored,
    /// Seconds of the checksum pass at restore (for the stats file).
    verify_s: Option<f64>,
    /// The checksum pass over the image data, running while CRIU restores the tree (4.2+).
    verification: Option<restore::Verification>,
    /// Set in `init` on CRIU 4.2+: start the checksum pass in POST_FORKING (image dir fd).
    verify_after_fork: Option<i32>,
    /// `cuInit` started in POST_FORKING (4.2+) so that it overlaps the rest of CRIU's restore;
    /// joined before the first driver call needs it, or in `exit`.
    driver_warmup: Option<std::thread::JoinHandle<()>>,
    manifests: HashMap<u32, Manifest>,
}

static PLUGIN: Mutex<Option<Plugin>> = Mutex::new(None);

/// Runs `f` on the plugin of this CRIU run; `ENOTSUP` when there is none.
pub fn with<R>(default: R, f: impl FnOnce(&mut Plugin) -> R) -> R {
    let mut g = PLUGIN.lock().unwrap_or_else(|e| e.into_inner());
    match g.as_mut() {
        Some(p) => f(p),
        None => default,
    }
}

fn driver_absent_reason() -> Option<String> {
    // A named driver library is taken as it is; otherwise the kernel module must be there.
    let named = std::env::var_os(gpusnap_cuda::driver::LIBCUDA_ENV).is_some_and(|v| !v.is_empty());
    if !named && !std::path::Path::new("/proc/driver/nvidia/gpus").exists() {
        return Some("no /proc/driver/nvidia/gpus".into());
    }
    gpusnap_cuda::driver::api().err().map(|e| e.to_string())
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
            log::error!("configuration error: {e}; fix it or remove it, then run CRIU again");
            return -1;
        }
    };
    if let Some(level) = cfg.log_level {
        crate::logger::init(Some(level.to_level_filter()));
    }
    log::debug!("configuration: {}", cfg.describe());
    log::debug!("{}", gpusnap_rocm::status_line(&gpusnap_rocm::detect()));
    let mut p = Plugin {
        stage,
        cfg,
        disabled: None,
        ctx: None,
        tracked: Vec::new(),
        in_inventory: false,
        checkpointed: Vec::new(),
        restored: Vec::new(),
        verify_s: None,
        verification: None,
        verify_after_fork: None,
        driver_warmup: None,
        manifests: HashMap::new(),
    };
    if stage != Stage::PreDump && !criu::is_4_1_or_newer() && criu::inside_criu() {
        // CRIU 4.0 lacks the plugin inventory and the `opts` layout gpusnap relies on to tell
        // `criu dump -R`; acting there could leave a process checkpointed.
        log::error!(
            "this CRIU is older than 4.1; gpusnap needs CRIU 4.1 or newer: GPU checkpointing disabled"
        );
        *PLUGIN.lock().unwrap_or_else(|e| e.into_inner()) = Some(Plugin {
            disabled: Some("CRIU older than 4.1".into()),
            ..p
        });
        return 0;
    }
    let rc = match stage {
        Stage::PreDump => {
            p.disabled = Some("pre-dump".into());
            log::info!("pre-dump: GPU state is not pre-dumped (the final dump takes it)");
            0
        }
        Stage::Dump => init_dump(&mut p),
        Stage::Restore => init_restore(&mut p),
    };
    *PLUGIN.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
    rc
}

fn init_dump(p: &mut Plugin) -> i32 {
    if p.cfg.mode == Mode::Off {
        p.disabled = Some("mode = off".into());
        log::info!("disabled by configuration (mode = off)");
        return 0;
    }
    if let Some(why) = driver_absent_reason() {
        log::info!("no usable NVIDIA driver on this host ({why}); GPU checkpointing disabled");
        p.disabled = Some(why);
        return 0;
    }
    // Driver calls must run while CRIU holds the other threads with ptrace, not a frozen cgroup.
    if !criu::set_compel_interrupt_only_mode() {
        log::warn!(
            "this CRIU cannot seize in interrupt-only mode; frozen containers may hang the lock"
        );
    }
    0
}

fn init_restore(p: &mut Plugin) -> i32 {
    // `None`: CRIU 4.0 keeps no plugin list; go by our manifests alone.
    if criu::check_and_remove_inventory_plugin(NAME) == Some(false) {
        p.disabled = Some("no GPU state in this image".into());
        log::debug!("the image holds no GPU state; nothing to do");
        return 0;
    }
    let Some(fd) = criu::image_dir() else {
        log::error!("CRIU gave no image directory; cannot restore GPU state");
        return -1;
    };
    // SAFETY: CRIU's image-dir service fd stays open for the whole run.
    let dir = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    match restore::read_manifests(dir) {
        Ok(m) => p.manifests = m,
        Err(e) => {
            log::error!("restore refused: {e}; nothing was restored and no GPU was touched");
            return -1;
        }
    }
    if p.manifests.is_empty() {
        p.disabled = Some("no gpusnap manifests".into());
        return 0;
    }
    log::info!("images checked: {} GPU processes", p.manifests.len());
    for m in p.manifests.values() {
        let refs = m.chunks.iter().filter(|c| c.is_reference());
        let (n, bytes) = refs.fold((0u64, 0u64), |(n, b), c| (n + 1, b + c.len));
        if n > 0 {
            let depth = m.chunks.iter().map(|c| c.parent_depth).max().unwrap_or(0);
            log::info!(
                "nspid {}: incremental image: {bytes} bytes in {n} chunks come from parent images (up to {depth} parent links up, checked)",
                m.nspid
            );
        }
    }
    if p.cfg.mode == Mode::Off {
        log::error!(
            "the image holds GPU state of {} processes but gpusnap is disabled (mode = off): they would run without it; enable gpusnap to restore",
            p.manifests.len()
        );
        return -1;
    }
    if let Some(why) = driver_absent_reason() {
        // The restore fails either way; first say whether the image itself is damaged.
        if p.cfg.verify_before_restore
            && let Err(e) = p.verify_now(fd)
        {
            log::error!("restore refused: {e}; nothing was restored and no GPU was touched");
        }
        log::error!(
            "the image holds GPU state of {} processes but this host has no usable NVIDIA driver ({why}); restore on a host with driver r570 or newer",
            p.manifests.len()
        );
        return -1;
    }
    if let Err(e) = restore::early_gpu_check(&p.manifests, &p.cfg.device_map) {
        log::error!(
            "restore refused: {e} (checked against /proc/driver/nvidia before CRIU restored any process); nothing was restored and no GPU was touched"
        );
        return -1;
    }
    if !p.cfg.verify_before_restore {
        return 0;
    }
    // No thread may live while CRIU forks the process tree: on CRIU 4.2+ the checksum pass
    // starts in POST_FORKING (after the forks) and overlaps the rest of CRIU's restore; on
    // older CRIU it runs here.
    if criu::has_post_forking() {
        p.verify_after_fork = Some(fd);
        return 0;
    }
    match p.verify_now(fd) {
        Ok(secs) => {
            p.verify_s = Some(secs);
            0
        }
        Err(e) => {
            log::error!("restore refused: {e}; nothing was restored and no GPU was touched");
            -1
        }
    }
}

impl Plugin {
    /// The full checksum pass, on this thread (its reader threads are joined before it returns).
    fn verify_now(&self, dir_fd: i32) -> Result<f64, String> {
        restore::Verification::start(
            dir_fd,
            self.manifests.values().cloned().collect(),
            self.cfg.effective_reader_threads(),
            false,
        )
        .finish()
    }

    /// DUMP_EXT_FILE: NVIDIA device files held without CUDA state.
    pub fn dump_ext_file(&mut self, fd: i32, id: i32) -> i32 {
        if self.stage != Stage::Dump || self.cfg.mode == Mode::Off || id < 0 {
            return ENOTSUP;
        }
        let Some(dir) = criu::image_dir() else {
            return ENOTSUP;
        };
        // SAFETY: CRIU's image-dir service fd stays open for the whole run.
        let dir = unsafe { std::os::fd::BorrowedFd::borrow_raw(dir) };
        match crate::devfile::dump(dir, fd, id as u32) {
            Ok(true) => {
                if !self.in_inventory {
                    self.in_inventory = criu::add_inventory_plugin(NAME);
                }
                0
            }
            Ok(false) => ENOTSUP,
            Err(e) => {
                log::error!("file {id}: recording an NVIDIA device file failed: {e}");
                -1
            }
        }
    }

    /// RESTORE_EXT_FILE, in a restored task: open the device file again.
    pub fn restore_ext_file(&mut self, id: i32) -> i32 {
        if self.stage != Stage::Restore || self.cfg.mode == Mode::Off || id < 0 {
            return ENOTSUP;
        }
        let Some(dir) = criu::image_dir() else {
            return ENOTSUP;
        };
        // SAFETY: CRIU's image-dir service fd is valid in restored tasks too.
        let dir = unsafe { std::os::fd::BorrowedFd::borrow_raw(dir) };
        match crate::devfile::restore(dir, id as u32) {
            Ok(Some(fd)) => fd,
            Ok(None) => ENOTSUP,
            Err(e) => {
                log::error!("file {id}: {e}");
                -1
            }
        }
    }

    /// POST_FORKING (CRIU 4.2+): every task is forked; background work may start now. Always
    /// answers "not mine" so that other plugins' POST_FORKING hooks run too.
    pub fn post_forking(&mut self) -> i32 {
        if let Some(fd) = self.verify_after_fork.take() {
            self.verification = Some(restore::Verification::start(
                fd,
                self.manifests.values().cloned().collect(),
                self.cfg.effective_reader_threads(),
                true,
            ));
        }
        if self.disabled.is_none() && !self.manifests.is_empty() && self.ctx.is_none() {
            // cuInit takes ~0.2 s on the H200; CRIU restores memory meanwhile. The driver is
            // loaded already (init checked it), and no process is forked after this hook.
            self.driver_warmup = std::thread::Builder::new()
                .name("gpusnap-cuinit".into())
                .spawn(|| {
                    crate::datapath::block_signals();
                    if let Ok(api) = gpusnap_cuda::driver::api() {
                        let _ = api.init();
                    }
                })
                .ok();
        }
        ENOTSUP
    }

    /// Loads the driver and reads the host's GPUs, once, on first need (after CRIU forked).
    fn ctx(&mut self) -> Result<&Ctx, String> {
        if self.ctx.is_none() {
            if let Some(h) = self.driver_warmup.take() {
                let _ = h.join();
                log::info!("cuInit ran beside CRIU's restore (started in POST_FORKING)");
            }
            let api = gpusnap_cuda::driver::api().map_err(|e| e.to_string())?;
            api.init().map_err(|e| e.to_string())?;
            let driver_version = api.driver_version().unwrap_or(0);
            let gpus = api.gpus().map_err(|e| e.to_string())?;
            let fd = criu::image_dir().ok_or("CRIU gave no image directory")?;
            let lock_timeout_ms =
                context::lock_timeout_ms(self.cfg.lock_timeout_ms, criu::timeout_s());
            log::info!(
                "driver API {driver_version}, {} GPU(s), lock timeout {lock_timeout_ms} ms",
                gpus.len()
            );
            self.ctx = Some(Ctx {
                api,
                cfg: self.cfg.clone(),
                image_dir_fd: fd,
                lock_timeout_ms,
                driver_version,
                gpus,
            });
        }
        Ok(self.ctx.as_ref().expect("set above"))
    }

    pub fn pause_devices(&mut self, pid: i32) -> i32 {
        if self.disabled.is_some() || self.stage != Stage::Dump {
            return ENOTSUP;
        }
        let ctx = match self.ctx() {
            Ok(c) => c,
            Err(e) => {
                log::error!("cannot use the NVIDIA driver: {e}");
                return -1;
            }
        };
        match dump::pause(ctx, pid) {
            Ok(Some(t)) => {
                self.tracked.push(t);
                if !self.in_inventory {
                    self.in_inventory = criu::add_inventory_plugin(NAME);
                }
                0
            }
            Ok(None) => ENOTSUP,
            Err(e) => {
                log::error!("pid {pid}: {e}");
                -1
            }
        }
    }

    pub fn checkpoint_devices(&mut self, pid: i32) -> i32 {
        let Some(ctx) = self.ctx.as_ref() else {
            return ENOTSUP;
        };
        if !self.tracked.iter().any(|t| t.pid == pid) {
            return ENOTSUP;
        }
        // The first call does every process, in parallel; later calls report the outcome.
        if self.checkpointed.is_empty() {
            self.checkpointed = dump::checkpoint_all(ctx, &mut self.tracked);
        }
        match self.checkpointed.iter().find(|(p, _)| *p == pid) {
            Some((_, Ok(()))) => 0,
            Some((_, Err(e))) => {
                log::error!(
                    "pid {pid}: checkpoint failed: {e}; the dump is aborted and the process rolled back"
                );
                -1
            }
            None => ENOTSUP,
        }
    }

    pub fn resume_devices_late(&mut self, pid: i32) -> i32 {
        if self.disabled.is_some() || self.stage != Stage::Restore {
            return ENOTSUP;
        }
        // The first call restores every GPU process of the image, in parallel.
        if self.restored.is_empty() {
            // POST_FORKING may not have come (a CRIU without it): verify here, still before
            // any GPU is touched.
            let verified = match (self.verification.take(), self.verify_after_fork.take()) {
                (Some(mut v), _) => v.finish().map(Some),
                (None, Some(fd)) => self.verify_now(fd).map(Some),
                (None, None) => Ok(None),
            };
            match verified {
                Ok(Some(secs)) => self.verify_s = Some(secs),
                Ok(None) => {}
                Err(e) => {
                    log::error!(
                        "restore refused: {e}; no GPU was touched. The restored processes are killed rather than left without their GPU state"
                    );
                    self.kill_restored(pid);
                    self.disabled = Some("damaged image".into());
                    return -1;
                }
            }
            if let Err(e) = self.ctx() {
                log::error!("cannot use the NVIDIA driver: {e}");
                return -1;
            }
            let nspids: Vec<u32> = self.manifests.keys().copied().collect();
            let found = restore::find_restored(pid, &nspids);
            let mut items = Vec::new();
            for (nspid, m) in &self.manifests {
                match found.get(nspid) {
                    Some(host) => items.push((*host, m.clone())),
                    None => log::error!(
                        "no restored process has nspid {nspid}; its GPU state is not restored"
                    ),
                }
            }
            let ctx = self.ctx.as_ref().expect("created above");
            self.restored = restore::resume_all(ctx, &items);
            let several = self.restored.len() > 1;
            for (p, r) in &self.restored {
                if let Err(e) = r {
                    // Found on the H200: driver 580 checkpoints a CUDA IPC importer, then cannot
                    // restore it.
                    let hint = match e {
                        dump::DumpError::Driver { what, .. }
                            if several && *what == restore::DRIVER_RESTORE =>
                        {
                            " A known cause with several GPU processes: one had opened another's memory through CUDA IPC, which the driver (before r610) checkpoints but cannot restore; such an image cannot be restored."
                        }
                        _ => "",
                    };
                    log::error!(
                        "pid {p}: GPU restore failed: {e}. The process is killed rather than left running without its GPU state; the image is unchanged: fix the cause and restore again.{hint}"
                    );
                    // SAFETY: kill(2) on a pid that CRIU restored and still holds stopped.
                    unsafe { libc::kill(*p, libc::SIGKILL) };
                }
            }
        }
        match self.restored.iter().find(|(p, _)| *p == pid) {
            Some((_, Ok(_))) => 0,
            Some((_, Err(_))) => -1,
            None => ENOTSUP,
        }
    }

    /// Adds the restore's timings to `gpusnap-stats.json` (best effort: the image directory may
    /// be read-only at restore).
    fn write_restore_stats(&self) {
        let processes: Vec<serde_json::Value> = self
            .restored
            .iter()
            .filter_map(|(_, r)| r.as_ref().ok().cloned())
            .collect();
        if processes.is_empty() {
            return;
        }
        let Some(fd) = criu::image_dir() else { return };
        // SAFETY: CRIU's image-dir service fd stays open until after `exit`.
        let dir = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let mut doc = gpusnap_image::read_stats(dir)
            .ok()
            .flatten()
            .filter(|v| v.is_object())
            .unwrap_or_else(|| serde_json::json!({}));
        doc["restore"] = serde_json::json!({
            "verify_s": self.verify_s,
            "processes": processes,
        });
        if let Err(e) = gpusnap_image::write_stats(dir, &doc) {
            log::debug!("restore timings not added to gpusnap-stats.json: {e}");
        }
    }

    /// Kills every restored process of ours (their GPU state cannot be brought back).
    fn kill_restored(&self, any_pid: i32) {
        let nspids: Vec<u32> = self.manifests.keys().copied().collect();
        for host in restore::find_restored(any_pid, &nspids).values() {
            // SAFETY: kill(2) on a process CRIU restored and still holds stopped.
            unsafe { libc::kill(*host, libc::SIGKILL) };
        }
    }

    pub fn exit(&mut self, ret: i32) {
        if let Some(mut v) = self.verification.take() {
            // Never leave the thread running past `exit`: CRIU unloads us next.
            let _ = v.finish();
        }
        if let Some(h) = self.driver_warmup.take() {
            let _ = h.join();
        }
        if self.stage == Stage::Restore {
            self.write_restore_stats();
            return;
        }
        if self.stage != Stage::Dump || self.tracked.is_empty() {
            return;
        }
        let Some(ctx) = self.ctx.as_ref() else { return };
        let leave_running = criu::leave_running();
        let mut stats = Vec::new();
        for t in &mut self.tracked {
            if ret == 0 {
                let m = dump::manifest_for(ctx, t);
                if let Err(e) = gpusnap_image::write_manifest(ctx.image_dir(), &m) {
                    log::error!(
                        "pid {}: writing the manifest failed: {e}; this image cannot be restored",
                        t.pid
                    );
                }
                stats.push(serde_json_value(t));
            }
            if ret != 0 || leave_running {
                match dump::rollback(ctx, t) {
                    // A failed dump's files are no use to anyone.
                    Ok(()) if ret != 0 => dump::remove_partial_files(ctx, t),
                    Ok(()) => {}
                    Err(e) => {
                        let held = match t.driver {
                            process::DriverStage::Locked => {
                                "it is held locked by the driver (its CUDA calls wait), so it does not run without its GPU memory"
                            }
                            process::DriverStage::Checkpointed => {
                                "it is left checkpointed by the driver (its CUDA calls wait)"
                            }
                            process::DriverStage::Running => {
                                "it may run without all of its GPU memory"
                            }
                        };
                        log::error!(
                            "pid {}: ROLLBACK FAILED: {e}. {held}. Bring it back with `gpusnap recover {} --images <this image dir>`",
                            t.pid,
                            t.pid
                        );
                    }
                }
            }
        }
        if ret == 0 && !stats.is_empty() {
            let doc = serde_json::json!({ "stage": "dump", "processes": stats });
            if let Err(e) = gpusnap_image::write_stats(ctx.image_dir(), &doc) {
                log::warn!("writing gpusnap-stats.json failed: {e}");
            }
        }
    }
}

fn serde_json_value(t: &Tracked) -> serde_json::Value {
    let timings: serde_json::Map<String, serde_json::Value> = t
        .timings
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
        .collect();
    let mut v = serde_json::json!({
        "nspid": t.nspid,
        "path": if t.is_split() { "split" } else { "transparent" },
        "timings_s": timings,
    });
    if let crate::process::DataPath::Split(s) = &t.path
        && let Some(d) = &s.data
    {
        // What this dump stored, against what it referenced unchanged in its parent images.
        v["data"] = serde_json::json!({
            "chunks": d.chunks.len(),
            "device_bytes": d.bytes,
            "bytes_written": d.stored_bytes,
            "chunks_referenced": d.referenced_chunks,
            "bytes_referenced": d.referenced_bytes,
            "incremental": d.referenced_chunks > 0,
        });
    }
    v
}

/// Called by `exit`: runs the dump's end and forgets this run.
pub fn finish(ret: i32) {
    let mut g = PLUGIN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = g.as_mut() {
        p.exit(ret);
    }
    *g = None;
}
