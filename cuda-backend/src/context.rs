//! Settings and handles shared by the hooks of one CRIU run.

use crate::CheckpointApi;
use crate::datapath::Limits;
use crate::driver::GpuInfo;
use gpusnap_config::Config;
use gpusnap_image::Codec;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

/// The image directory a run reads and writes.
pub enum ImageDir {
    /// CRIU's own (inside `criu dump` / `criu restore`).
    Criu(BorrowedFd<'static>),
    /// One opened by `gpusnap recover`.
    Opened(OwnedFd),
}

pub struct Ctx {
    pub api: &'static CheckpointApi,
    pub cfg: Config,
    pub image_dir: ImageDir,
    pub lock_timeout_ms: u32,
    pub driver_version: i32,
    pub gpus: Vec<GpuInfo>,
}

/// Why no usable NVIDIA driver is here, if none is.
pub fn driver_absent_reason() -> Option<String> {
    // A named driver library is taken as it is; otherwise the kernel module must be there.
    let named = std::env::var_os(crate::driver::LIBCUDA_ENV).is_some_and(|v| !v.is_empty());
    if !named && !std::path::Path::new("/proc/driver/nvidia/gpus").exists() {
        return Some("no /proc/driver/nvidia/gpus".into());
    }
    crate::driver::api().err().map(|e| e.to_string())
}

/// The driver could not be loaded for a run, or CRIU gave no image directory.
#[derive(Debug, thiserror::Error)]
pub enum CtxError {
    #[error(transparent)]
    Driver(#[from] crate::DriverError),
    #[error("CRIU gave no image directory")]
    NoImageDir,
}

impl Ctx {
    /// Loads the driver and reads the host's GPUs (inside CRIU, after CRIU has forked: the
    /// driver library must not be initialised before the restore's forks). `dir`: CRIU's image
    /// directory, as the run fetched it at init.
    pub fn open(cfg: &Config, dir: Option<BorrowedFd<'static>>) -> Result<Self, CtxError> {
        let api = crate::driver::api()?;
        api.init()?;
        let driver_version = api.driver_version().unwrap_or(0);
        let gpus = api.gpus()?;
        let dir = dir.ok_or(CtxError::NoImageDir)?;
        let lock_timeout_ms = lock_timeout_ms(cfg.lock_timeout_ms, gpusnap_host::criu::timeout_s());
        log::info!(
            "driver API {driver_version}, {} GPU(s), lock timeout {lock_timeout_ms} ms",
            gpus.len()
        );
        Ok(Ctx {
            api,
            cfg: cfg.clone(),
            image_dir: ImageDir::Criu(dir),
            lock_timeout_ms,
            driver_version,
            gpus,
        })
    }

    /// CRIU's image directory as a `'static` fd, for threads that outlive a borrow of the
    /// context; `None` for a directory `gpusnap recover` opened.
    pub fn criu_image_dir(&self) -> Option<BorrowedFd<'static>> {
        match &self.image_dir {
            ImageDir::Criu(fd) => Some(*fd),
            ImageDir::Opened(_) => None,
        }
    }

    pub fn image_dir(&self) -> BorrowedFd<'_> {
        match &self.image_dir {
            ImageDir::Criu(fd) => *fd,
            ImageDir::Opened(fd) => fd.as_fd(),
        }
    }

    pub fn agent_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.agent_timeout_ms)
    }

    pub fn slot_size(&self) -> usize {
        self.cfg.staging_slot_bytes()
    }

    /// The codec of this run's data chunks (`compress = auto` decided by the image directory).
    pub fn codec(&self) -> Codec {
        codec_for(&self.cfg, self.image_dir()).0
    }

    pub fn limits(&self) -> Limits {
        limits_of(&self.cfg)
    }
}

pub use gpusnap_host::codec::codec_for;

/// The data path's limits: how long the agent may show no progress, and its copy streams.
pub fn limits_of(cfg: &Config) -> Limits {
    Limits {
        stall: Duration::from_millis(cfg.agent_timeout_ms),
        streams: cfg.copy_streams,
    }
}

/// The lock timeout: the configured one, else 80% of CRIU's seizing timeout (the lock runs
/// under CRIU's alarm), else 10 s.
pub fn lock_timeout_ms(configured_ms: u64, criu_timeout_s: Option<u32>) -> u32 {
    if configured_ms > 0 {
        return configured_ms.min(u32::MAX as u64) as u32;
    }
    criu_timeout_s.map_or(8_000, |s| s.saturating_mul(800))
}

#[cfg(test)]
mod tests {
    #[test]
    fn lock_timeout_stays_inside_criu_alarm() {
        assert_eq!(super::lock_timeout_ms(0, Some(10)), 8_000);
        assert_eq!(super::lock_timeout_ms(0, None), 8_000);
        assert_eq!(super::lock_timeout_ms(2_500, Some(10)), 2_500);
    }
}
