//! How data chunks are stored in an image directory (`compress`, with `auto` decided by the
//! directory's file system): the same rule for every vendor's data.

use gpusnap_config::{Compress, Config};
use gpusnap_image::Codec;
use std::os::fd::BorrowedFd;

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
}
