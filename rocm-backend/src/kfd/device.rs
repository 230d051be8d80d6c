//! Where KFD calls go: the kernel ([`RealKfd`], `ioctl(2)` on `/dev/kfd`) or the stand-in KFD
//! of the tests ([`super::standin::StandinKfd`]), behind one trait, [`KfdDevice`]. Both carry
//! the same `#[repr(C)]` argument structures; the plugin's CRIU sequence
//! ([`super::criu`]) is written once against the trait.

use std::fmt::Debug;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use super::sys::{self, KfdIoctlCriuArgs, KfdIoctlGetVersionArgs};
use super::{KfdError, KfdVersion};

/// What a file descriptor of a process is, as far as AMD GPUs go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceFile {
    /// The KFD device (`/dev/kfd`).
    Kfd,
    /// A DRM render node (`/dev/dri/renderD<minor>`).
    Render { minor: u32 },
}

/// A KFD: the real one or the stand-in.
pub trait KfdDevice: Debug + Send + Sync {
    /// What the device is, for logs ("/dev/kfd", "stand-in KFD at ...").
    fn describe(&self) -> String;

    /// The KFD topology directory (`/sys/class/kfd/kfd/topology` for the kernel).
    fn topology_dir(&self) -> PathBuf;

    /// The path of render node `minor`.
    fn render_path(&self, minor: u32) -> PathBuf;

    /// Whether `fd` (with `path`, its `/proc/self/fd` link, and `rdev`, its device number) is
    /// this KFD's device or one of its render nodes.
    fn classify(&self, path: &Path, rdev: u64) -> Option<DeviceFile>;

    /// Whether this KFD's nodes may be block devices (the stand-in's are, so that they can be
    /// mapped; the kernel's are character devices).
    fn block_nodes(&self) -> bool {
        false
    }

    /// Opens the KFD device for the calling process (which the kernel then acts on).
    fn open_kfd(&self) -> Result<OwnedFd, KfdError>;

    /// `AMDKFD_IOC_GET_VERSION` on `fd`.
    fn version(&self, fd: BorrowedFd<'_>) -> Result<KfdVersion, KfdError>;

    /// `AMDKFD_IOC_CRIU_OP` on `fd`. The dma-buf fds of CHECKPOINT and RESTORE come back in the
    /// BO buckets' `dmabuf_fd`, owned by the caller, as the kernel returns them.
    ///
    /// # Safety
    ///
    /// Every user pointer in `args` (devices, bos, priv_data) must be null or valid for reads
    /// and writes of the sizes its counts give (`num_devices` device buckets, `num_bos` BO
    /// buckets, `priv_data_size` bytes), for the op's duration.
    unsafe fn criu_op(&self, fd: BorrowedFd<'_>, args: &mut KfdIoctlCriuArgs) -> io::Result<()>;
}

/// The kernel's KFD.
#[derive(Debug, Default)]
pub struct RealKfd;

/// Character-device major of DRM (`/dev/dri/*`).
pub const DRM_MAJOR: u32 = 226;
/// Render nodes are DRM minors 128..=255.
const RENDER_MINOR_BASE: u32 = 128;

impl KfdDevice for RealKfd {
    fn describe(&self) -> String {
        sys::KFD_DEVICE.to_owned()
    }

    fn topology_dir(&self) -> PathBuf {
        PathBuf::from(crate::topology::TOPOLOGY_DIR)
    }

    fn render_path(&self, minor: u32) -> PathBuf {
        PathBuf::from(format!("/dev/dri/renderD{minor}"))
    }

    fn classify(&self, path: &Path, rdev: u64) -> Option<DeviceFile> {
        if path == Path::new(sys::KFD_DEVICE) {
            return Some(DeviceFile::Kfd);
        }
        let (major, minor) = (libc::major(rdev), libc::minor(rdev));
        (major == DRM_MAJOR && minor >= RENDER_MINOR_BASE).then_some(DeviceFile::Render { minor })
    }

    fn open_kfd(&self) -> Result<OwnedFd, KfdError> {
        open_device(Path::new(sys::KFD_DEVICE))
    }

    fn version(&self, fd: BorrowedFd<'_>) -> Result<KfdVersion, KfdError> {
        let mut args = KfdIoctlGetVersionArgs::default();
        // SAFETY: GET_VERSION takes a `KfdIoctlGetVersionArgs`, which holds no pointers, and has
        // no side effect, so a retry on EINTR is safe.
        unsafe { sys::ioctl(fd, sys::AMDKFD_IOC_GET_VERSION, &mut args, true) }.map_err(
            |source| KfdError::Ioctl {
                op: "GET_VERSION",
                source,
            },
        )?;
        Ok(KfdVersion {
            major: args.major_version,
            minor: args.minor_version,
        })
    }

    unsafe fn criu_op(&self, fd: BorrowedFd<'_>, args: &mut KfdIoctlCriuArgs) -> io::Result<()> {
        // SAFETY: CRIU_OP takes a `KfdIoctlCriuArgs`; the caller guarantees its pointers. No
        // retry on EINTR: these ops change the process's state.
        unsafe { sys::ioctl(fd, sys::AMDKFD_IOC_CRIU_OP, args, false) }
    }
}

/// Opens a device node read-write, close-on-exec.
pub fn open_device(path: &Path) -> Result<OwnedFd, KfdError> {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        Ok(f) => Ok(f.into()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(KfdError::NoDevice {
            path: path.to_owned(),
        }),
        Err(source) => Err(KfdError::Open {
            path: path.to_owned(),
            source,
        }),
    }
}

/// The `/proc/self/fd` link and the device number of `fd`, if it is a character device.
pub fn char_device_of(fd: BorrowedFd<'_>) -> Option<(PathBuf, u64)> {
    device_of(fd, false)
}

/// The `/proc/self/fd` link and the device number of `fd`, if it is a character device (or,
/// with `block`, a block device).
pub fn device_of(fd: BorrowedFd<'_>, block: bool) -> Option<(PathBuf, u64)> {
    // SAFETY: a zeroed `stat` is a valid out-buffer for fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on a borrowed (open) fd into a local buffer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return None;
    }
    let kind = st.st_mode & libc::S_IFMT;
    if kind != libc::S_IFCHR && !(block && kind == libc::S_IFBLK) {
        return None;
    }
    let path = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()?;
    Some((path, st.st_rdev))
}

/// The path and device number of a device node `st` describes, opened as `fd` (CRIU's
/// `HANDLE_DEVICE_VMA` passes both): `None` unless a character device (or, with `block`, a
/// block device).
pub fn device_of_stat(
    fd: BorrowedFd<'_>,
    mode: libc::mode_t,
    rdev: u64,
    block: bool,
) -> Option<(PathBuf, u64)> {
    let kind = mode & libc::S_IFMT;
    if kind != libc::S_IFCHR && !(block && kind == libc::S_IFBLK) {
        return None;
    }
    let path = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()?;
    Some((path, rdev))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_kfd_classifies_by_path_and_drm_major() {
        let k = RealKfd;
        assert_eq!(
            k.classify(Path::new("/dev/kfd"), libc::makedev(511, 0)),
            Some(DeviceFile::Kfd)
        );
        assert_eq!(
            k.classify(Path::new("/dev/dri/renderD129"), libc::makedev(226, 129)),
            Some(DeviceFile::Render { minor: 129 })
        );
        // card nodes are not render nodes
        assert_eq!(
            k.classify(Path::new("/dev/dri/card0"), libc::makedev(226, 0)),
            None
        );
        assert_eq!(
            k.classify(Path::new("/dev/null"), libc::makedev(1, 3)),
            None
        );
        assert_eq!(k.render_path(128), PathBuf::from("/dev/dri/renderD128"));
    }

    #[test]
    fn char_devices_only() {
        let f = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsFd;
        let (p, rdev) = char_device_of(f.as_fd()).unwrap();
        assert_eq!(p, PathBuf::from("/dev/null"));
        assert_eq!(rdev, libc::makedev(1, 3));
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert!(char_device_of(f.as_fd()).is_none());
    }
}
