//! Settings and handles shared by the hooks of one CRIU run.

use crate::datapath::Limits;
use gpusnap_config::{Compress, Config};
use gpusnap_cuda::CheckpointApi;
use gpusnap_cuda::driver::GpuInfo;
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
    let named = std::env::var_os(gpusnap_cuda::driver::LIBCUDA_ENV).is_some_and(|v| !v.is_empty());
    if !named && !std::path::Path::new("/proc/driver/nvidia/gpus").exists() {
        return Some("no /proc/driver/nvidia/gpus".into());
    }
    gpusnap_cuda::driver::api().err().map(|e| e.to_string())
}

/// The driver could not be loaded for a run, or CRIU gave no image directory.
#[derive(Debug, thiserror::Error)]
pub enum CtxError {
    #[error(transparent)]
    Driver(#[from] gpusnap_cuda::DriverError),
    #[error("CRIU gave no image directory")]
    NoImageDir,
}

impl Ctx {
    /// Loads the driver and reads the host's GPUs (inside CRIU, after CRIU has forked: the
    /// driver library must not be initialised before the restore's forks). `dir`: CRIU's image
    /// directory, as the run fetched it at init.
    pub fn open(cfg: &Config, dir: Option<BorrowedFd<'static>>) -> Result<Self, CtxError> {
        let api = gpusnap_cuda::driver::api()?;
        api.init()?;
        let driver_version = api.driver_version().unwrap_or(0);
        let gpus = api.gpus()?;
        let dir = dir.ok_or(CtxError::NoImageDir)?;
        let lock_timeout_ms = lock_timeout_ms(cfg.lock_timeout_ms, crate::criu::timeout_s());
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

/// The codec data chunks are written with into `dir`, and why (for the log).
pub fn codec_for(cfg: &Config, dir: BorrowedFd<'_>) -> (Codec, &'static str) {
    match cfg.compress {
        Compress::Off => (Codec::Raw, "compress = off"),
        Compress::Zstd => (Codec::Zstd, "compress = zstd"),
        Compress::Auto => match in_memory(dir) {
            Some(true) => (
                Codec::Raw,
                "compress = auto: the image directory is in memory",
            ),
            Some(false) => (
                Codec::Zstd,
                "compress = auto: the image directory is on a disk",
            ),
            None => (
                Codec::Raw,
                "compress = auto: the image directory's filesystem is unknown",
            ),
        },
    }
}

/// Whether `dir` lies on a filesystem held in memory (tmpfs, ramfs, hugetlbfs); `None` when
/// `fstatfs` fails.
fn in_memory(dir: BorrowedFd<'_>) -> Option<bool> {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    use std::os::fd::AsRawFd;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: fstatfs writes one statfs into the buffer we own; checked before it is read.
    let rc = unsafe { libc::fstatfs(dir.as_raw_fd(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // f_type is i64 on x86_64, narrower elsewhere.
    #[allow(clippy::unnecessary_cast)]
    // SAFETY: fstatfs succeeded, so it filled the struct.
    let f_type = unsafe { st.assume_init() }.f_type as i64;
    Some(matches!(
        f_type,
        TMPFS_MAGIC | RAMFS_MAGIC | HUGETLBFS_MAGIC
    ))
}

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
    fn compress_auto_follows_the_filesystem() {
        use std::os::fd::AsFd;
        let mut cfg = gpusnap_config::Config {
            compress: gpusnap_config::Compress::Auto,
            ..Default::default()
        };
        let shm = std::fs::File::open("/dev/shm").expect("/dev/shm");
        assert_eq!(super::codec_for(&cfg, shm.as_fd()).0, super::Codec::Raw);
        // The build tree is on a disk here (CI and the development machine).
        let disk = std::fs::File::open(env!("CARGO_MANIFEST_DIR")).expect("crate dir");
        if super::in_memory(disk.as_fd()) == Some(false) {
            assert_eq!(super::codec_for(&cfg, disk.as_fd()).0, super::Codec::Zstd);
        }
        cfg.compress = gpusnap_config::Compress::Off;
        assert_eq!(super::codec_for(&cfg, disk.as_fd()).0, super::Codec::Raw);
    }

    #[test]
    fn lock_timeout_stays_inside_criu_alarm() {
        assert_eq!(super::lock_timeout_ms(0, Some(10)), 8_000);
        assert_eq!(super::lock_timeout_ms(0, None), 8_000);
        assert_eq!(super::lock_timeout_ms(2_500, Some(10)), 2_500);
    }
}
