//! The stand-in KFD's rules, without CRIU: the ones the kernel enforces that the plugin must
//! live with (op order, counts, who may call, RESUME by pid), checked through the same
//! `KfdDevice` calls the plugin makes.

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fake_kfd::{FakeGpu, StandinSetup};
use gpusnap_rocm::kfd::criu;
use gpusnap_rocm::kfd::device::KfdDevice;
use gpusnap_rocm::kfd::standin::StandinKfd;

use criu_tests::build::built;
use criu_tests::fixtures::TempDir;

fn errno(e: &gpusnap_rocm::kfd::KfdError) -> Option<i32> {
    match e {
        gpusnap_rocm::kfd::KfdError::Ioctl { source, .. } => source.raw_os_error(),
        _ => None,
    }
}

struct App(Child);

impl Drop for App {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The KFD fd (3) of `pid`, copied into this process with `pidfd_getfd`.
fn steal_kfd_fd(pid: i32) -> OwnedFd {
    // SAFETY: pidfd_open(pid, 0) has no memory arguments.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
    assert!(
        pidfd >= 0,
        "pidfd_open: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a fresh fd.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    // SAFETY: pidfd_getfd(pidfd, 3, 0) copies the target's fd 3 into this process.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_pidfd_getfd,
            std::os::fd::AsRawFd::as_raw_fd(&pidfd),
            3,
            0,
        )
    } as i32;
    assert!(fd >= 0, "pidfd_getfd: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

#[test]
fn the_stand_in_enforces_the_kernels_rules() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        criu_tests::harness::skipped(
            "the_stand_in_enforces_the_kernels_rules",
            "needs root (mknod)",
        );
        return;
    }
    let tmp = TempDir::new("kfd-rules");
    let dir = tmp.path();
    // The stand-in KFD daemon and the stand-in AMD process (binaries of `fake-kfd`).
    let s = StandinSetup::start(
        dir,
        &[FakeGpu::mi210(4660, 128)],
        &built("fake-kfd", "fake-kfd"),
    )
    .unwrap();
    let dev = StandinKfd::new(dir);

    // A KFD process of this test, with nothing on it: nothing to pause.
    let mine = dev.open_kfd().unwrap();
    assert_eq!(dev.version(mine.as_fd()).unwrap().to_string(), "1.16");
    let e = criu::process_info(&dev, mine.as_fd()).unwrap_err();
    assert_eq!(errno(&e), Some(libc::EINVAL), "{e}");
    // RESUME of a pid with no restored KFD process.
    let e = criu::resume(&dev, mine.as_fd(), gpusnap_host::pid::HostPid(999_999)).unwrap_err();
    assert_eq!(errno(&e), Some(libc::ESRCH), "{e}");
    // RESTORE needs the caller's render node of the GPU as drm_fd: an ordinary fd is refused.
    let null = std::fs::File::open("/dev/null").unwrap();
    let dev_bucket = gpusnap_rocm::kfd::sys::KfdCriuDeviceBucket {
        user_gpu_id: 4660,
        actual_gpu_id: 4660,
        drm_fd: std::os::fd::AsRawFd::as_raw_fd(&null) as u32,
        pad: 0,
    };
    let e = criu::restore(&dev, mine.as_fd(), vec![dev_bucket], vec![], vec![], 0).unwrap_err();
    assert_eq!(errno(&e), Some(libc::EINVAL), "{e}");

    // A running stand-in AMD process, not traced.
    let app = App(Command::new(built("fake-kfd", "amd-app"))
        .args(["--dir", dir.to_str().unwrap(), "--log"])
        .arg(dir.join("app.log"))
        .args(["--seed", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    let pid = app.0.id() as i32;
    let t0 = Instant::now();
    while s.status(pid as u32)["processes"][0]["state"] != "running" {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", s.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    let theirs = steal_kfd_fd(pid);
    // Not the process, and the process is not ptraced: refused, as the kernel refuses (EBADF).
    let e = criu::process_info(&dev, theirs.as_fd()).unwrap_err();
    assert_eq!(errno(&e), Some(libc::EBADF), "{e}");
    assert_eq!(s.process(pid as u32)["state"], "running");
    drop(app);
    // `s`, then `tmp` (the directory), go on drop.
}
