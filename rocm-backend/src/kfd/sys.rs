//! Raw KFD (`/dev/kfd`) CRIU interface: `#[repr(C)]` mirrors of `linux/kfd_ioctl.h`, the ioctl
//! numbers, and one `unsafe` call. Nothing else lives here.
//!
//! Written by hand from the Linux uapi header (KFD ioctl 1.11, linux-libc-dev 6.1); the layout
//! tests below, and a test that parses `/usr/include/linux/kfd_ioctl.h` where it is installed,
//! keep the two in step.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// `AMDKFD_IOCTL_BASE`, the ioctl "type" byte of every KFD ioctl.
pub const AMDKFD_IOCTL_BASE: u8 = b'K';

/// The path of the KFD character device.
pub const KFD_DEVICE: &str = "/dev/kfd";

/// The oldest KFD ioctl version CRIU accepts: 1.7 added the CRIU API, 1.8 made SDMA transfers of
/// GTT BOs possible, which checkpointing needs.
pub const KFD_CRIU_MIN_VERSION: (u32, u32) = (1, 8);

// Linux's generic ioctl encoding (asm-generic/ioctl.h, used by x86_64 and arm64, the only
// architectures ROCm ships for): nr in bits 0..8, type in 8..16, size in 16..30, direction in
// 30..32.
const IOC_NRSHIFT: u32 = 0;
const IOC_TYPESHIFT: u32 = 8;
const IOC_SIZESHIFT: u32 = 16;
const IOC_DIRSHIFT: u32 = 30;
const IOC_SIZEBITS: u32 = 14;
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// `_IOC(dir, type, nr, size)`. Fails to compile (in a const) when `size` does not fit 14 bits.
pub const fn ioc(dir: u32, ty: u8, nr: u8, size: usize) -> u32 {
    assert!(size < (1 << IOC_SIZEBITS), "ioctl argument too large");
    (dir << IOC_DIRSHIFT)
        | ((size as u32) << IOC_SIZESHIFT)
        | ((ty as u32) << IOC_TYPESHIFT)
        | ((nr as u32) << IOC_NRSHIFT)
}

/// `_IOR(type, nr, size)`: the kernel writes the argument.
pub const fn ior(ty: u8, nr: u8, size: usize) -> u32 {
    ioc(IOC_READ, ty, nr, size)
}

/// `_IOWR(type, nr, size)`: the argument goes both ways.
pub const fn iowr(ty: u8, nr: u8, size: usize) -> u32 {
    ioc(IOC_READ | IOC_WRITE, ty, nr, size)
}

/// `struct kfd_ioctl_get_version_args`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct KfdIoctlGetVersionArgs {
    pub major_version: u32,
    pub minor_version: u32,
}

/// `AMDKFD_IOC_GET_VERSION`: `AMDKFD_IOR(0x01, struct kfd_ioctl_get_version_args)`.
pub const AMDKFD_IOC_GET_VERSION: u32 =
    ior(AMDKFD_IOCTL_BASE, 0x01, size_of::<KfdIoctlGetVersionArgs>());

/// `enum kfd_criu_op`, the `op` field of [`KfdIoctlCriuArgs`].
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KfdCriuOp {
    /// Pauses (evicts) the process's queues and reports how much CHECKPOINT will return.
    ProcessInfo = 0,
    /// Fills the device and BO buckets and the opaque private data.
    Checkpoint = 1,
    /// Restores the queues that PROCESS_INFO evicted.
    Unpause = 2,
    /// Recreates devices, BOs, queues, events and SVM ranges in the restored process.
    Restore = 3,
    /// Starts MMU notifiers and queues of the process named by `pid`, after its VMAs are placed.
    Resume = 4,
}

/// `struct kfd_ioctl_criu_args`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct KfdIoctlCriuArgs {
    /// User pointer to `num_devices` [`KfdCriuDeviceBucket`]s (CHECKPOINT, RESTORE).
    pub devices: u64,
    /// User pointer to `num_bos` [`KfdCriuBoBucket`]s (CHECKPOINT, RESTORE).
    pub bos: u64,
    /// User pointer to `priv_data_size` bytes of opaque driver data (CHECKPOINT, RESTORE).
    pub priv_data: u64,
    pub priv_data_size: u64,
    pub num_devices: u32,
    pub num_bos: u32,
    /// Queues, events and SVM ranges: opaque to user space.
    pub num_objects: u32,
    /// Out for PROCESS_INFO (the pid in the target's own pid namespace), in for RESUME.
    pub pid: u32,
    /// A [`KfdCriuOp`] value.
    pub op: u32,
}

/// `AMDKFD_IOC_CRIU_OP`: `AMDKFD_IOWR(0x22, struct kfd_ioctl_criu_args)`.
pub const AMDKFD_IOC_CRIU_OP: u32 = iowr(AMDKFD_IOCTL_BASE, 0x22, size_of::<KfdIoctlCriuArgs>());

/// `struct kfd_criu_device_bucket`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct KfdCriuDeviceBucket {
    /// The gpu_id the process saw at checkpoint.
    pub user_gpu_id: u32,
    /// The gpu_id of the local GPU that stands in for it at restore.
    pub actual_gpu_id: u32,
    /// Render node fd the kernel binds the GPU's VM to at restore.
    pub drm_fd: u32,
    pub pad: u32,
}

/// `struct kfd_criu_bo_bucket`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct KfdCriuBoBucket {
    /// GPU virtual address.
    pub addr: u64,
    pub size: u64,
    /// mmap offset of the BO at checkpoint.
    pub offset: u64,
    /// mmap offset of the recreated BO, filled in by RESTORE.
    pub restored_offset: u64,
    /// The user gpu_id the BO belongs to.
    pub gpu_id: u32,
    /// `KFD_IOC_ALLOC_MEM_FLAGS_*`.
    pub alloc_flags: u32,
    /// A dma-buf fd of VRAM/GTT BOs, for copying the contents.
    pub dmabuf_fd: u32,
    pub pad: u32,
}

/// `KFD_IOC_ALLOC_MEM_FLAGS_*`, the values of [`KfdCriuBoBucket::alloc_flags`] this crate
/// distinguishes.
pub const KFD_IOC_ALLOC_MEM_FLAGS_VRAM: u32 = 1 << 0;
pub const KFD_IOC_ALLOC_MEM_FLAGS_GTT: u32 = 1 << 1;
pub const KFD_IOC_ALLOC_MEM_FLAGS_USERPTR: u32 = 1 << 2;
pub const KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL: u32 = 1 << 3;
pub const KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP: u32 = 1 << 4;

/// `KFD_INVALID_FD`: a bucket's `dmabuf_fd` when the kernel made no dma-buf for the BO.
pub const KFD_INVALID_FD: u32 = 0xffff_ffff;

/// Little-endian byte forms of the CRIU structures, field by field (never the padding), for
/// carrying them where a pointer cannot go: the stand-in KFD reads and writes them as the
/// kernel's `copy_from_user`/`copy_to_user` would.
pub mod wire {
    use super::*;

    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
    }
    fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
    }
    fn put32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
    fn put64(b: &mut [u8], at: usize, v: u64) {
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    pub const CRIU_ARGS_LEN: usize = size_of::<KfdIoctlCriuArgs>();
    pub const DEVICE_BUCKET_LEN: usize = size_of::<KfdCriuDeviceBucket>();
    pub const BO_BUCKET_LEN: usize = size_of::<KfdCriuBoBucket>();
    pub const VERSION_ARGS_LEN: usize = size_of::<KfdIoctlGetVersionArgs>();

    impl KfdIoctlCriuArgs {
        pub fn to_bytes(&self) -> [u8; CRIU_ARGS_LEN] {
            let mut b = [0u8; CRIU_ARGS_LEN];
            put64(&mut b, 0, self.devices);
            put64(&mut b, 8, self.bos);
            put64(&mut b, 16, self.priv_data);
            put64(&mut b, 24, self.priv_data_size);
            put32(&mut b, 32, self.num_devices);
            put32(&mut b, 36, self.num_bos);
            put32(&mut b, 40, self.num_objects);
            put32(&mut b, 44, self.pid);
            put32(&mut b, 48, self.op);
            b
        }
        /// `None` unless `b` is exactly [`CRIU_ARGS_LEN`] bytes.
        pub fn from_bytes(b: &[u8]) -> Option<Self> {
            (b.len() == CRIU_ARGS_LEN).then(|| KfdIoctlCriuArgs {
                devices: u64_at(b, 0),
                bos: u64_at(b, 8),
                priv_data: u64_at(b, 16),
                priv_data_size: u64_at(b, 24),
                num_devices: u32_at(b, 32),
                num_bos: u32_at(b, 36),
                num_objects: u32_at(b, 40),
                pid: u32_at(b, 44),
                op: u32_at(b, 48),
            })
        }
    }

    impl KfdCriuDeviceBucket {
        pub fn to_bytes(&self) -> [u8; DEVICE_BUCKET_LEN] {
            let mut b = [0u8; DEVICE_BUCKET_LEN];
            put32(&mut b, 0, self.user_gpu_id);
            put32(&mut b, 4, self.actual_gpu_id);
            put32(&mut b, 8, self.drm_fd);
            put32(&mut b, 12, self.pad);
            b
        }
        pub fn from_bytes(b: &[u8]) -> Option<Self> {
            (b.len() == DEVICE_BUCKET_LEN).then(|| KfdCriuDeviceBucket {
                user_gpu_id: u32_at(b, 0),
                actual_gpu_id: u32_at(b, 4),
                drm_fd: u32_at(b, 8),
                pad: u32_at(b, 12),
            })
        }
    }

    impl KfdCriuBoBucket {
        pub fn to_bytes(&self) -> [u8; BO_BUCKET_LEN] {
            let mut b = [0u8; BO_BUCKET_LEN];
            put64(&mut b, 0, self.addr);
            put64(&mut b, 8, self.size);
            put64(&mut b, 16, self.offset);
            put64(&mut b, 24, self.restored_offset);
            put32(&mut b, 32, self.gpu_id);
            put32(&mut b, 36, self.alloc_flags);
            put32(&mut b, 40, self.dmabuf_fd);
            put32(&mut b, 44, self.pad);
            b
        }
        pub fn from_bytes(b: &[u8]) -> Option<Self> {
            (b.len() == BO_BUCKET_LEN).then(|| KfdCriuBoBucket {
                addr: u64_at(b, 0),
                size: u64_at(b, 8),
                offset: u64_at(b, 16),
                restored_offset: u64_at(b, 24),
                gpu_id: u32_at(b, 32),
                alloc_flags: u32_at(b, 36),
                dmabuf_fd: u32_at(b, 40),
                pad: u32_at(b, 44),
            })
        }
    }

    impl KfdIoctlGetVersionArgs {
        pub fn to_bytes(&self) -> [u8; VERSION_ARGS_LEN] {
            let mut b = [0u8; VERSION_ARGS_LEN];
            put32(&mut b, 0, self.major_version);
            put32(&mut b, 4, self.minor_version);
            b
        }
        pub fn from_bytes(b: &[u8]) -> Option<Self> {
            (b.len() == VERSION_ARGS_LEN).then(|| KfdIoctlGetVersionArgs {
                major_version: u32_at(b, 0),
                minor_version: u32_at(b, 4),
            })
        }
    }
}

/// `ioctl(fd, request, arg)`, retried on `EINTR` when `retry_eintr`, with errno preserved.
///
/// # Safety
///
/// `request` must be an ioctl whose argument is a `T` (size and direction encoded in it), and
/// every user pointer inside `*arg` must be valid for what the kernel does with it.
pub unsafe fn ioctl<T>(
    fd: BorrowedFd<'_>,
    request: u32,
    arg: &mut T,
    retry_eintr: bool,
) -> io::Result<()> {
    loop {
        // SAFETY: `fd` is open for the duration of the borrow; `arg` is a valid, exclusively
        // borrowed `T`, and the caller guarantees that `request` takes a `T` and that the
        // pointers inside it are valid. The cast to `libc::Ioctl` is how C passes the number.
        let rc = unsafe {
            libc::ioctl(
                fd.as_raw_fd(),
                request as libc::Ioctl,
                std::ptr::from_mut(arg),
            )
        };
        if rc != -1 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if !(retry_eintr && err.kind() == io::ErrorKind::Interrupted) {
            return Err(err);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn ioctl_numbers() {
        // Values computed by gcc from the uapi header (see the crate's reference notes).
        assert_eq!(AMDKFD_IOC_CRIU_OP, 0xC038_4B22);
        assert_eq!(AMDKFD_IOC_GET_VERSION, 0x8008_4B01);
        assert_eq!(iowr(b'K', 0x22, 56), 0xC038_4B22);
    }

    #[test]
    fn criu_args_layout() {
        assert_eq!(size_of::<KfdIoctlCriuArgs>(), 56);
        assert_eq!(align_of::<KfdIoctlCriuArgs>(), 8);
        assert_eq!(offset_of!(KfdIoctlCriuArgs, devices), 0);
        assert_eq!(offset_of!(KfdIoctlCriuArgs, bos), 8);
        assert_eq!(offset_of!(KfdIoctlCriuArgs, priv_data), 16);
        assert_eq!(offset_of!(KfdIoctlCriuArgs, priv_data_size), 24);
        assert_eq!(offset_of!(KfdIoctlCriuArgs, num_devices), 32);
        assert_eq!(offset_of!(KfdIoctlCriuArgs, num_bos), 36);
        assert_eq!(offset_of!(KfdIoctlCriuArgs, num_objects), 40);
        assert_eq!(offset_of!(KfdIoctlCriuArgs, pid), 44);
        assert_eq!(offset_of!(KfdIoctlCriuArgs, op), 48);
    }

    #[test]
    fn device_bucket_layout() {
        assert_eq!(size_of::<KfdCriuDeviceBucket>(), 16);
        assert_eq!(offset_of!(KfdCriuDeviceBucket, user_gpu_id), 0);
        assert_eq!(offset_of!(KfdCriuDeviceBucket, actual_gpu_id), 4);
        assert_eq!(offset_of!(KfdCriuDeviceBucket, drm_fd), 8);
        assert_eq!(offset_of!(KfdCriuDeviceBucket, pad), 12);
    }

    #[test]
    fn bo_bucket_layout() {
        assert_eq!(size_of::<KfdCriuBoBucket>(), 48);
        assert_eq!(align_of::<KfdCriuBoBucket>(), 8);
        assert_eq!(offset_of!(KfdCriuBoBucket, addr), 0);
        assert_eq!(offset_of!(KfdCriuBoBucket, size), 8);
        assert_eq!(offset_of!(KfdCriuBoBucket, offset), 16);
        assert_eq!(offset_of!(KfdCriuBoBucket, restored_offset), 24);
        assert_eq!(offset_of!(KfdCriuBoBucket, gpu_id), 32);
        assert_eq!(offset_of!(KfdCriuBoBucket, alloc_flags), 36);
        assert_eq!(offset_of!(KfdCriuBoBucket, dmabuf_fd), 40);
        assert_eq!(offset_of!(KfdCriuBoBucket, pad), 44);
    }

    #[test]
    fn version_args_layout() {
        assert_eq!(size_of::<KfdIoctlGetVersionArgs>(), 8);
        assert_eq!(offset_of!(KfdIoctlGetVersionArgs, major_version), 0);
        assert_eq!(offset_of!(KfdIoctlGetVersionArgs, minor_version), 4);
    }

    #[test]
    fn wire_forms_round_trip_at_the_c_offsets() {
        let a = KfdIoctlCriuArgs {
            devices: 1,
            bos: 2,
            priv_data: 3,
            priv_data_size: 4,
            num_devices: 5,
            num_bos: 6,
            num_objects: 7,
            pid: 8,
            op: 9,
        };
        let b = a.to_bytes();
        assert_eq!(KfdIoctlCriuArgs::from_bytes(&b), Some(a));
        assert_eq!(b[offset_of!(KfdIoctlCriuArgs, pid)], 8);
        assert_eq!(b[offset_of!(KfdIoctlCriuArgs, op)], 9);
        assert_eq!(KfdIoctlCriuArgs::from_bytes(&b[..55]), None);
        let bo = KfdCriuBoBucket {
            addr: 10,
            size: 11,
            offset: 12,
            restored_offset: 13,
            gpu_id: 14,
            alloc_flags: 15,
            dmabuf_fd: 16,
            pad: 0,
        };
        let b = bo.to_bytes();
        assert_eq!(KfdCriuBoBucket::from_bytes(&b), Some(bo));
        assert_eq!(b[offset_of!(KfdCriuBoBucket, dmabuf_fd)], 16);
        let d = KfdCriuDeviceBucket {
            user_gpu_id: 1,
            actual_gpu_id: 2,
            drm_fd: 3,
            pad: 0,
        };
        let b = d.to_bytes();
        assert_eq!(KfdCriuDeviceBucket::from_bytes(&b), Some(d));
        assert_eq!(b[offset_of!(KfdCriuDeviceBucket, drm_fd)], 3);
        let v = KfdIoctlGetVersionArgs {
            major_version: 1,
            minor_version: 16,
        };
        assert_eq!(KfdIoctlGetVersionArgs::from_bytes(&v.to_bytes()), Some(v));
    }

    #[test]
    fn criu_ops() {
        assert_eq!(KfdCriuOp::ProcessInfo as u32, 0);
        assert_eq!(KfdCriuOp::Checkpoint as u32, 1);
        assert_eq!(KfdCriuOp::Unpause as u32, 2);
        assert_eq!(KfdCriuOp::Restore as u32, 3);
        assert_eq!(KfdCriuOp::Resume as u32, 4);
    }

    #[test]
    fn ioctl_on_a_non_kfd_fd_fails_with_errno() {
        let f = std::fs::File::open("/dev/null").unwrap();
        let mut args = KfdIoctlGetVersionArgs::default();
        use std::os::fd::AsFd;
        // SAFETY: GET_VERSION takes a `KfdIoctlGetVersionArgs` with no pointers in it.
        let err = unsafe { ioctl(f.as_fd(), AMDKFD_IOC_GET_VERSION, &mut args, true) }.unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOTTY));
    }
}
