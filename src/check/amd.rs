//! The AMD part of `gpusnap check`: is there a KFD, does it support CRIU, which AMD GPUs does
//! it list, and is CRIU's own amdgpu plugin installed beside gpusnap.

use std::path::{Path, PathBuf};

use gpusnap_rocm::kfd::device::KfdDevice;
use gpusnap_rocm::kfd::{KfdError, KfdVersion};
use gpusnap_rocm::topology::{self, Gpu, TopologyError};

use super::{DEFAULT_PLUGIN_DIR, Finding, env_path};

/// CRIU's amdgpu plugin's file name (gpusnap leaves AMD processes to it when it is loaded).
const AMDGPU_PLUGIN: &str = "amdgpu_plugin.so";

/// What was found of the KFD, before judging it.
struct Probe {
    device: String,
    version: Result<KfdVersion, KfdError>,
    gpus: Result<Vec<Gpu>, TopologyError>,
}

pub(super) fn check_amd() -> Vec<Finding> {
    let dev: Box<dyn KfdDevice> = match gpusnap_rocm::kfd::standin::StandinKfd::from_env() {
        Some(s) => Box::new(s),
        None if Path::new(gpusnap_rocm::kfd::sys::KFD_DEVICE).exists() => {
            Box::new(gpusnap_rocm::kfd::device::RealKfd)
        }
        None => {
            return vec![Finding::ok(
                "no /dev/kfd: no AMD GPU driver; gpusnap's AMD (kfd) path stays idle",
            )];
        }
    };
    let version = dev
        .open_kfd()
        .and_then(|fd| dev.version(std::os::fd::AsFd::as_fd(&fd)));
    let gpus = topology::read_gpus(&dev.topology_dir());
    let plugin_dir = env_path("CRIU_LIBS_DIR").unwrap_or_else(|| PathBuf::from(DEFAULT_PLUGIN_DIR));
    judge(
        &Probe {
            device: dev.describe(),
            version,
            gpus,
        },
        &plugin_dir,
    )
}

fn judge(p: &Probe, plugin_dir: &Path) -> Vec<Finding> {
    let mut out = Vec::new();
    match &p.version {
        Ok(v) if v.supports_criu() => out.push(Finding::ok(format!(
            "{}: KFD ioctl {v}, supports CRIU (AMDKFD_IOC_CRIU_OP)",
            p.device
        ))),
        Ok(v) => out.push(Finding::fail(
            format!("{}: KFD ioctl {v} has no usable CRIU support", p.device),
            "AMD GPU processes cannot be checkpointed: use a kernel whose KFD is 1.8 or newer",
        )),
        Err(e) => out.push(Finding::fail(
            format!("{}: {e}", p.device),
            "run as root, and check that the amdgpu driver is loaded",
        )),
    }
    match &p.gpus {
        Ok(gpus) if gpus.is_empty() => out.push(Finding::warn(
            format!("{}: the KFD topology lists no GPU", p.device),
            "nothing to checkpoint on AMD",
        )),
        Ok(gpus) => {
            for g in gpus {
                out.push(Finding::ok(format!(
                    "AMD GPU {}",
                    gpusnap_rocm::describe_gpu(g)
                )));
            }
            out.push(Finding::warn(
                "gpusnap's AMD (kfd) path was tested on a stand-in KFD only, never on AMD hardware",
                "try it on a process you can lose first (README, support matrix)",
            ));
        }
        Err(e) => out.push(Finding::fail(
            format!("KFD topology: {e}"),
            "check /sys/class/kfd/kfd/topology",
        )),
    }
    let upstream = plugin_dir.join(AMDGPU_PLUGIN);
    if upstream.exists() {
        out.push(Finding::warn(
            format!(
                "CRIU's own amdgpu plugin {} is installed too",
                upstream.display()
            ),
            "gpusnap then leaves every AMD process to it (documented rule); remove it to have gpusnap checkpoint AMD GPUs",
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::Level;

    fn probe(
        version: Result<KfdVersion, KfdError>,
        gpus: Result<Vec<Gpu>, TopologyError>,
    ) -> Probe {
        Probe {
            device: "/dev/kfd".into(),
            version,
            gpus,
        }
    }

    fn gpu() -> Gpu {
        Gpu {
            node: 1,
            gpu_id: 4660,
            name: None,
            vendor_id: 0x1002,
            device_id: 0x740f,
            simd_count: 416,
            local_mem_bytes: 64 << 30,
            gfx_target_version: Some(90010),
            drm_render_minor: Some(128),
            properties: Default::default(),
        }
    }

    #[test]
    fn kfd_versions_and_gpus_are_judged() {
        let v = |major, minor| Ok(KfdVersion { major, minor });
        let f = judge(&probe(v(1, 16), Ok(vec![gpu()])), Path::new("/nonexistent"));
        assert_eq!(f[0].level, Level::Ok);
        assert!(f[0].what.contains("1.16, supports CRIU"), "{}", f[0].line());
        assert!(
            f[1].what.contains("gpu_id 4660 1002:740f gfx90a"),
            "{}",
            f[1].line()
        );
        assert!(f[2].what.contains("never on AMD hardware"));
        let f = judge(&probe(v(1, 6), Ok(vec![])), Path::new("/nonexistent"));
        assert_eq!(f[0].level, Level::Fail);
        assert!(f[0].what.contains("no usable CRIU support"));
        assert_eq!(f[1].level, Level::Warn);
        let f = judge(
            &probe(
                Err(KfdError::Ioctl {
                    op: "GET_VERSION",
                    source: std::io::Error::from_raw_os_error(libc::EACCES),
                }),
                Err(TopologyError::Missing {
                    path: "/nonexistent".into(),
                }),
            ),
            Path::new("/"),
        );
        assert_eq!((f[0].level, f[1].level), (Level::Fail, Level::Fail));
    }

    #[test]
    fn the_upstream_plugin_is_named() {
        let d = std::env::temp_dir().join(format!("gpusnap-check-amd-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(AMDGPU_PLUGIN), b"").unwrap();
        let f = judge(
            &probe(
                Ok(KfdVersion {
                    major: 1,
                    minor: 16,
                }),
                Ok(vec![]),
            ),
            &d,
        );
        let _ = std::fs::remove_dir_all(&d);
        assert!(f.iter().any(|f| f.what.contains("amdgpu plugin")
            && f.todo.contains("leaves every AMD process to it")));
    }
}
