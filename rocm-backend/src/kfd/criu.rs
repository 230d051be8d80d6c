//! The KFD CRIU sequence, once, against any [`KfdDevice`]: PROCESS_INFO (pauses the queues),
//! CHECKPOINT (device and BO buckets, private data, a dma-buf per VRAM/GTT BO), UNPAUSE,
//! RESTORE (re-creates them in the calling process) and RESUME (starts its queues).
//!
//! Facts of the kernel interface relied on (`linux/kfd_ioctl.h`, `kfd_chardev.c`):
//! - PROCESS_INFO, CHECKPOINT, UNPAUSE and RESTORE act on the process that opened the file the
//!   ioctl is made on; RESUME on the process `pid` names.
//! - CHECKPOINT wants exactly the counts and size PROCESS_INFO reported, with buffers for them.
//! - The dma-buf fds CHECKPOINT and RESTORE return in `dmabuf_fd` belong to the caller.

use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};

use super::device::KfdDevice;
use super::sys::{
    KFD_INVALID_FD, KFD_IOC_ALLOC_MEM_FLAGS_GTT, KFD_IOC_ALLOC_MEM_FLAGS_VRAM, KfdCriuBoBucket,
    KfdCriuDeviceBucket, KfdCriuOp, KfdIoctlCriuArgs,
};
use super::{KfdError, ProcessInfo, op_name};
use gpusnap_host::pid::{HostPid, NsPid};

/// Most buffer objects, devices and private bytes accepted from a PROCESS_INFO (a guard
/// against a wild answer, far above real processes).
const MAX_BOS: u32 = 1 << 20;
const MAX_DEVICES: u32 = 64;
const MAX_PRIV_DATA: u64 = 1 << 30;

/// Whether the contents of a BO with these flags are saved by gpusnap (VRAM and GTT; userptr
/// memory is the process's own pages, doorbells and MMIO have no contents to keep).
pub fn has_contents(alloc_flags: u32) -> bool {
    alloc_flags & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT) != 0
}

fn ioctl_error(op: KfdCriuOp) -> impl FnOnce(std::io::Error) -> KfdError {
    move |source| KfdError::Ioctl {
        op: op_name(op),
        source,
    }
}

/// PROCESS_INFO: pauses the queues of the process that opened `kfd` and reports the sizes a
/// checkpoint needs. On failure the kernel has restored the queues.
pub fn process_info(dev: &dyn KfdDevice, kfd: BorrowedFd<'_>) -> Result<ProcessInfo, KfdError> {
    let mut args = KfdIoctlCriuArgs {
        op: KfdCriuOp::ProcessInfo as u32,
        ..Default::default()
    };
    // SAFETY: no user pointers (all null); PROCESS_INFO dereferences none.
    unsafe { dev.criu_op(kfd, &mut args) }.map_err(ioctl_error(KfdCriuOp::ProcessInfo))?;
    Ok(ProcessInfo {
        pid: NsPid(args.pid),
        num_devices: args.num_devices,
        num_bos: args.num_bos,
        num_objects: args.num_objects,
        priv_data_size: args.priv_data_size,
    })
}

/// What CHECKPOINT returned.
#[derive(Debug)]
pub struct KfdCheckpoint {
    pub info: ProcessInfo,
    pub devices: Vec<KfdCriuDeviceBucket>,
    /// The BO buckets; `dmabuf_fd` is [`KFD_INVALID_FD`] here, the fds are in `dmabufs`.
    pub bos: Vec<KfdCriuBoBucket>,
    pub priv_data: Vec<u8>,
    /// One per BO (same index): its dma-buf, for the ones the kernel exported.
    pub dmabufs: Vec<Option<OwnedFd>>,
}

/// Takes ownership of the dma-buf fds the kernel put into `bos`, leaving [`KFD_INVALID_FD`].
fn take_dmabufs(bos: &mut [KfdCriuBoBucket]) -> Vec<Option<OwnedFd>> {
    bos.iter_mut()
        .map(|b| {
            let fd = std::mem::replace(&mut b.dmabuf_fd, KFD_INVALID_FD);
            if fd == KFD_INVALID_FD || fd > i32::MAX as u32 {
                return None;
            }
            // SAFETY: F_GETFD on any number is harmless; it tells whether the fd is open.
            if unsafe { libc::fcntl(fd as i32, libc::F_GETFD) } < 0 {
                return None;
            }
            // SAFETY: the kernel (or the stand-in's transport) installed this fd in our table
            // for this bucket and handed it to us; nothing else owns it.
            Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
        })
        .collect()
}

/// CHECKPOINT, with the queues paused by [`process_info`] (`info` its answer).
pub fn checkpoint(
    dev: &dyn KfdDevice,
    kfd: BorrowedFd<'_>,
    info: &ProcessInfo,
) -> Result<KfdCheckpoint, KfdError> {
    if info.num_bos > MAX_BOS
        || info.num_devices > MAX_DEVICES
        || info.priv_data_size > MAX_PRIV_DATA
    {
        return Err(KfdError::Ioctl {
            op: "CHECKPOINT",
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "PROCESS_INFO reported {} devices, {} BOs, {} bytes of private data: beyond what gpusnap accepts",
                    info.num_devices, info.num_bos, info.priv_data_size
                ),
            ),
        });
    }
    let mut devices = vec![KfdCriuDeviceBucket::default(); info.num_devices as usize];
    let mut bos = vec![
        KfdCriuBoBucket {
            dmabuf_fd: KFD_INVALID_FD,
            ..Default::default()
        };
        info.num_bos as usize
    ];
    let mut priv_data = vec![0u8; info.priv_data_size as usize];
    let mut args = KfdIoctlCriuArgs {
        devices: devices.as_mut_ptr() as u64,
        bos: bos.as_mut_ptr() as u64,
        priv_data: priv_data.as_mut_ptr() as u64,
        priv_data_size: info.priv_data_size,
        num_devices: info.num_devices,
        num_bos: info.num_bos,
        num_objects: info.num_objects,
        pid: 0,
        op: KfdCriuOp::Checkpoint as u32,
    };
    // SAFETY: the three pointers are live vectors of exactly the counts and size in `args`.
    // On failure the kernel closes the dma-bufs it made; on success they are ours.
    unsafe { dev.criu_op(kfd, &mut args) }.map_err(ioctl_error(KfdCriuOp::Checkpoint))?;
    let dmabufs = take_dmabufs(&mut bos);
    Ok(KfdCheckpoint {
        info: *info,
        devices,
        bos,
        priv_data,
        dmabufs,
    })
}

/// UNPAUSE: restores the queues that PROCESS_INFO paused.
pub fn unpause(dev: &dyn KfdDevice, kfd: BorrowedFd<'_>) -> Result<(), KfdError> {
    let mut args = KfdIoctlCriuArgs {
        op: KfdCriuOp::Unpause as u32,
        ..Default::default()
    };
    // SAFETY: no user pointers.
    unsafe { dev.criu_op(kfd, &mut args) }.map_err(ioctl_error(KfdCriuOp::Unpause))
}

/// What RESTORE returned: the BO buckets (with `restored_offset`) and their dma-bufs.
#[derive(Debug)]
pub struct KfdRestored {
    pub bos: Vec<KfdCriuBoBucket>,
    pub dmabufs: Vec<Option<OwnedFd>>,
}

/// RESTORE in the calling process (which opened `kfd`): devices (with `actual_gpu_id` and a
/// render-node `drm_fd` of the calling process each), BOs and private data as checkpointed.
pub fn restore(
    dev: &dyn KfdDevice,
    kfd: BorrowedFd<'_>,
    mut devices: Vec<KfdCriuDeviceBucket>,
    mut bos: Vec<KfdCriuBoBucket>,
    mut priv_data: Vec<u8>,
    num_objects: u32,
) -> Result<KfdRestored, KfdError> {
    for b in &mut bos {
        b.dmabuf_fd = KFD_INVALID_FD;
        b.restored_offset = 0;
    }
    let mut args = KfdIoctlCriuArgs {
        devices: devices.as_mut_ptr() as u64,
        bos: bos.as_mut_ptr() as u64,
        priv_data: priv_data.as_mut_ptr() as u64,
        priv_data_size: priv_data.len() as u64,
        num_devices: devices.len() as u32,
        num_bos: bos.len() as u32,
        num_objects,
        pid: 0,
        op: KfdCriuOp::Restore as u32,
    };
    // SAFETY: the three pointers are live vectors of exactly the counts and size in `args`.
    // On failure the kernel closes the dma-bufs it made; on success they are ours.
    unsafe { dev.criu_op(kfd, &mut args) }.map_err(ioctl_error(KfdCriuOp::Restore))?;
    let dmabufs = take_dmabufs(&mut bos);
    Ok(KfdRestored { bos, dmabufs })
}

/// RESUME: starts the queues of the restored KFD process `pid` (the caller's pid namespace).
pub fn resume(dev: &dyn KfdDevice, kfd: BorrowedFd<'_>, pid: HostPid) -> Result<(), KfdError> {
    let mut args = KfdIoctlCriuArgs {
        op: KfdCriuOp::Resume as u32,
        // The ioctl's u32: the same bits as the pid_t.
        pid: pid.get() as u32,
        ..Default::default()
    };
    // SAFETY: no user pointers.
    unsafe { dev.criu_op(kfd, &mut args) }.map_err(ioctl_error(KfdCriuOp::Resume))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kfd::device::RealKfd;
    use std::os::fd::AsFd;

    #[test]
    fn contents_of_vram_and_gtt_only() {
        assert!(has_contents(KFD_IOC_ALLOC_MEM_FLAGS_VRAM));
        assert!(has_contents(KFD_IOC_ALLOC_MEM_FLAGS_GTT | 0x8000_0000));
        assert!(!has_contents(
            crate::kfd::sys::KFD_IOC_ALLOC_MEM_FLAGS_USERPTR
        ));
        assert!(!has_contents(
            crate::kfd::sys::KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL
        ));
    }

    #[test]
    fn ops_on_a_non_kfd_file_fail_with_their_name() {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
            .unwrap();
        let err = process_info(&RealKfd, f.as_fd()).unwrap_err();
        assert!(err.to_string().contains("PROCESS_INFO"), "{err}");
        assert!(err.to_string().contains("not a KFD device"), "{err}");
        let info = ProcessInfo {
            pid: NsPid(1),
            num_devices: 1,
            num_bos: 2,
            num_objects: 0,
            priv_data_size: 16,
        };
        let err = checkpoint(&RealKfd, f.as_fd(), &info).unwrap_err();
        assert!(err.to_string().contains("CHECKPOINT"), "{err}");
        assert!(unpause(&RealKfd, f.as_fd()).is_err());
        assert!(resume(&RealKfd, f.as_fd(), HostPid(1)).is_err());
        let err = restore(&RealKfd, f.as_fd(), vec![], vec![], vec![], 0).unwrap_err();
        assert!(err.to_string().contains("RESTORE"), "{err}");
    }

    #[test]
    fn wild_sizes_are_refused_before_any_call() {
        let f = std::fs::File::open("/dev/null").unwrap();
        let info = ProcessInfo {
            pid: NsPid(1),
            num_devices: 1,
            num_bos: u32::MAX,
            num_objects: 0,
            priv_data_size: 0,
        };
        let err = checkpoint(&RealKfd, f.as_fd(), &info).unwrap_err();
        assert!(err.to_string().contains("beyond"), "{err}");
    }
}
