//! Settings and handles shared by the hooks of one CRIU run.

use crate::datapath::Limits;
use gpusnap_config::{Compress, Config};
use gpusnap_cuda::CheckpointApi;
use gpusnap_cuda::driver::GpuInfo;
use gpusnap_image::Codec;
use std::os::fd::BorrowedFd;
use std::time::Duration;

pub struct Ctx {
    pub api: &'static CheckpointApi,
    pub cfg: Config,
    pub image_dir_fd: i32,
    pub lock_timeout_ms: u32,
    pub driver_version: i32,
    pub gpus: Vec<GpuInfo>,
}

impl Ctx {
    pub fn image_dir(&self) -> BorrowedFd<'_> {
        // SAFETY: CRIU keeps its image-dir service fd open for the whole run; we never close it.
        unsafe { BorrowedFd::borrow_raw(self.image_dir_fd) }
    }

    pub fn agent_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.agent_timeout_ms)
    }

    pub fn slot_size(&self) -> usize {
        self.cfg.staging_slot_bytes()
    }

    pub fn codec(&self) -> Codec {
        match self.cfg.compress {
            Compress::Off => Codec::Raw,
            Compress::Zstd => Codec::Zstd,
        }
    }

    pub fn limits(&self) -> Limits {
        Limits {
            stall: self.agent_timeout(),
            streams: self.cfg.copy_streams,
        }
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
