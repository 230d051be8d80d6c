//! ROCm (AMD) backend of gpusnap, built and tested without AMD hardware.
//!
//! What exists:
//! - [`kfd`]: handwritten `#[repr(C)]` mirrors of the KFD CRIU ioctl interface
//!   (`AMDKFD_IOC_CRIU_OP`, `AMDKFD_IOC_GET_VERSION`) checked against `linux/kfd_ioctl.h`;
//!   [`kfd::device::KfdDevice`], where the calls go (the kernel, or the tests' stand-in KFD
//!   [`kfd::standin`], which carries the same structures' bytes); and [`kfd::criu`], the CRIU
//!   sequence written once: PROCESS_INFO, CHECKPOINT, UNPAUSE, RESTORE, RESUME.
//! - [`bo`]: buffer-object contents through their dma-bufs (`mmap`).
//! - [`gpumatch`]: which local GPU takes the place of each GPU of an image.
//! - [`topology`]: the GPUs of the KFD topology in sysfs.
//! - [`detect`] and [`status_line`]: what the plugin logs at init.
//!
//! - [`kfd::vma`]: which BO a mapping of `/dev/kfd` or a render node shows, and its offset
//!   after RESTORE (for the plugin's `HANDLE_DEVICE_VMA`/`UPDATE_VMA_MAP`).
//!
//! - `run`: AMD's side of a CRIU run ([`run::AmdSide`], a [`gpusnap_host::Backend`]): the
//!   dump, restore and recover of AMD processes from CRIU's hooks, built on the above.
//!
//! Host services (CRIU's ABI and log, `/proc`, ptrace, holds, pids, fault points) come from
//! `gpusnap-host`, named by that crate (`gpusnap_host::procfs` etc.). What does not exist: an
//! SDMA copy for VRAM that the CPU cannot map, the HIP split path.
//!
//! What was never run: every ioctl against a real KFD and the topology reader against a real
//! sysfs tree. The build machine has no AMD GPU and no ROCm; the tests cover the layouts, the
//! ioctl numbers, a fake sysfs tree, the failure paths, and the whole sequence with real CRIU
//! against the stand-in KFD (`criu-tests/fake-kfd/`).

pub mod bo;
pub mod gpumatch;
pub mod kfd;
pub mod run;
pub mod topology;

use std::path::Path;

use kfd::{Kfd, KfdError, KfdVersion};
use topology::Gpu;

/// What [`detect`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Detection {
    /// No `/dev/kfd`: no amdgpu KFD driver on this machine.
    NoKfd,
    /// A KFD whose ioctl interface predates usable CRIU support (1.8).
    KfdTooOld { major: u32, minor: u32 },
    /// `/dev/kfd` exists but could not be used: not openable (permissions), the version query
    /// failed, or the topology could not be read.
    Unusable { reason: String },
    /// A KFD with CRIU support, and its GPUs (possibly none).
    Present { version: KfdVersion, gpus: Vec<Gpu> },
}

/// Looks for an AMD KFD on this machine. Never panics; every failure is a [`Detection`].
pub fn detect() -> Detection {
    detect_at(
        Path::new(kfd::sys::KFD_DEVICE),
        Path::new(topology::TOPOLOGY_DIR),
    )
}

/// [`detect`] with another device node and topology directory.
pub fn detect_at(device: &Path, topology_dir: &Path) -> Detection {
    let kfd = match Kfd::open_path(device) {
        Ok(kfd) => kfd,
        Err(KfdError::NoDevice { .. }) => return Detection::NoKfd,
        Err(e) => {
            return Detection::Unusable {
                reason: e.to_string(),
            };
        }
    };
    let version = match kfd.version() {
        Ok(v) => v,
        Err(e) => {
            return Detection::Unusable {
                reason: e.to_string(),
            };
        }
    };
    if !version.supports_criu() {
        return Detection::KfdTooOld {
            major: version.major,
            minor: version.minor,
        };
    }
    match topology::read_gpus(topology_dir) {
        Ok(gpus) => Detection::Present { version, gpus },
        Err(e) => Detection::Unusable {
            reason: e.to_string(),
        },
    }
}

/// One line for the plugin's log at init.
pub fn status_line(detection: &Detection) -> String {
    let (min_major, min_minor) = kfd::sys::KFD_CRIU_MIN_VERSION;
    match detection {
        Detection::NoKfd => "rocm: no /dev/kfd, no AMD GPU driver; ROCm backend idle".to_owned(),
        Detection::KfdTooOld { major, minor } => format!(
            "rocm: KFD ioctl {major}.{minor} is too old for CRIU (needs {min_major}.{min_minor}); \
             ROCm backend idle"
        ),
        Detection::Unusable { reason } => {
            format!("rocm: /dev/kfd present but unusable: {reason}; ROCm backend idle")
        }
        Detection::Present { version, gpus } => {
            let list: Vec<String> = gpus.iter().map(describe_gpu).collect();
            format!(
                "rocm: KFD ioctl {version}, {} GPU(s){}{}; AMD GPU processes are checkpointed \
                 through the KFD's CRIU interface (tested on a stand-in KFD only)",
                gpus.len(),
                if list.is_empty() { "" } else { ": " },
                list.join(", ")
            )
        }
    }
}

/// One GPU in one phrase: `gpu_id N vvvv:dddd gfxNNN "name" S SIMDs M MiB at PCI`.
pub fn describe_gpu(g: &Gpu) -> String {
    let mut s = format!(
        "gpu_id {} {:04x}:{:04x}",
        g.gpu_id, g.vendor_id, g.device_id
    );
    if let Some(gfx) = g.gfx_name() {
        s.push(' ');
        s.push_str(&gfx);
    }
    if let Some(name) = &g.name {
        s.push_str(&format!(" \"{name}\""));
    }
    s.push_str(&format!(
        " {} SIMDs {} MiB",
        g.simd_count,
        g.local_mem_bytes >> 20
    ));
    if let Some(pci) = g.pci_address() {
        s.push_str(&format!(" at {pci}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::topology::fake::{TempDir, two_gpus};
    use super::*;

    #[test]
    fn detect_on_this_machine() {
        let d = detect();
        eprintln!("{}", status_line(&d));
        if !Path::new(kfd::sys::KFD_DEVICE).exists() {
            assert_eq!(d, Detection::NoKfd);
        }
    }

    #[test]
    fn detect_missing_device() {
        let t = TempDir::new("detect");
        assert_eq!(
            detect_at(&t.file("kfd"), &t.file("topology")),
            Detection::NoKfd
        );
    }

    #[test]
    fn detect_non_kfd_device_is_unusable() {
        let t = TempDir::new("detect");
        let d = detect_at(Path::new("/dev/null"), t.path());
        let Detection::Unusable { reason } = &d else {
            panic!("{d:?}")
        };
        assert!(reason.contains("GET_VERSION"), "{reason}");
        assert!(status_line(&d).contains("unusable"));
    }

    #[test]
    fn status_lines() {
        assert!(status_line(&Detection::NoKfd).contains("no /dev/kfd"));
        let old = status_line(&Detection::KfdTooOld { major: 1, minor: 6 });
        assert!(old.contains("1.6") && old.contains("1.8"), "{old}");

        let t = TempDir::new("detect");
        two_gpus(t.path());
        let gpus = topology::read_gpus(t.path()).unwrap();
        let line = status_line(&Detection::Present {
            version: KfdVersion {
                major: 1,
                minor: 11,
            },
            gpus,
        });
        assert!(!line.contains('\n'));
        assert!(
            line.contains("KFD ioctl 1.11, 2 GPU(s): gpu_id 43210 1002:740f gfx90a"),
            "{line}"
        );
        assert!(
            line.contains("416 SIMDs 65520 MiB at 0000:c3:00.0"),
            "{line}"
        );
        assert!(
            line.contains("gpu_id 777 1002:744c gfx1100 \"gfx1100\""),
            "{line}"
        );
        assert!(line.contains("stand-in KFD only"), "{line}");

        let none = status_line(&Detection::Present {
            version: KfdVersion { major: 1, minor: 8 },
            gpus: vec![],
        });
        assert!(none.contains("0 GPU(s); "), "{none}");
    }
}
