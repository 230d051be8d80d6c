//! The host's GPUs as the NVIDIA kernel driver lists them in `/proc/driver/nvidia/gpus/*/information`
//! (model and UUID), read without loading the CUDA driver library.
//!
//! At restore, `init` runs in CRIU's main process before it forks the process tree, where the
//! driver library must not be loaded yet (it may start threads). Reading these files lets
//! gpusnap refuse a restore onto absent or other-model GPUs there, before CRIU restores any
//! process; free memory is asked of NVML in a child process there ([`crate::nvml`]), and checked
//! again later, with the driver loaded. The `Device Minor` lines name each GPU's device node
//! (`/dev/nvidia<minor>`), which [`crate::devfile`] maps to the restore's GPUs.
//!
//! MIG instances have UUIDs of their own that this listing (physical GPUs) lacks, so a
//! `device_map` target it does not show is refused only where [`mig_instances`] finds none.

use crate::gpumap::HostGpu;
use std::path::{Path, PathBuf};

/// Test hook: another directory laid out like `/proc/driver/nvidia/gpus`.
pub const PROC_DIR_ENV: &str = "GPUSNAP_TEST_NVIDIA_PROC";

pub fn proc_dir() -> PathBuf {
    std::env::var_os(PROC_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/proc/driver/nvidia/gpus"), PathBuf::from)
}

/// The value of the `key:` line of an `information` file (after the colon, trimmed).
fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.trim_start().strip_prefix(':'))
        .map(str::trim)
}

/// One `information` file: `Model:` and `GPU UUID:` lines (values after the colon, trimmed).
/// `None` if either is missing or the UUID is not one.
pub fn parse_information(text: &str) -> Option<HostGpu> {
    let field = |key: &str| field(text, key);
    let name = field("Model")?;
    let uuid = gpusnap_config::normalise_uuid(field("GPU UUID")?).ok()?;
    (!name.is_empty()).then(|| HostGpu {
        uuid,
        name: name.to_string(),
        free: None,
    })
}

/// A GPU of the listing and the number of its device node (`/dev/nvidia<minor>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuNode {
    /// 32 lowercase hex digits.
    pub uuid: String,
    pub name: String,
    /// The `Device Minor:` line: the driver makes `/dev/nvidia<minor>` for this GPU.
    pub minor: u32,
}

impl GpuNode {
    pub fn path(&self) -> String {
        format!("/dev/nvidia{}", self.minor)
    }
}

/// One `information` file with its `Device Minor:` line; `None` if a line is missing.
pub fn parse_node(text: &str) -> Option<GpuNode> {
    let gpu = parse_information(text)?;
    let minor = field(text, "Device Minor")?.parse().ok()?;
    Some(GpuNode {
        uuid: gpu.uuid,
        name: gpu.name,
        minor,
    })
}

/// Every GPU listed under `dir` with its device node, like [`list`]; `Err` also when an entry
/// has no `Device Minor:` line.
pub fn list_nodes(dir: &Path) -> std::io::Result<Vec<GpuNode>> {
    read_listing(dir, parse_node)
}

/// The listing's GPUs as a message names them: `GPU-… (model) at /dev/nvidia<N>, …`.
pub fn describe_nodes(nodes: &[GpuNode]) -> String {
    if nodes.is_empty() {
        return "none".into();
    }
    nodes
        .iter()
        .map(|n| {
            format!(
                "{} ({}) at {}",
                crate::gpumap::dashed(&n.uuid),
                n.name,
                n.path()
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every GPU listed under `dir`, sorted by bus directory name. `Err` when the directory cannot
/// be read or an entry cannot be parsed: the caller then skips the early check rather than
/// judging from a partial list.
pub fn list(dir: &Path) -> std::io::Result<Vec<HostGpu>> {
    read_listing(dir, parse_information)
}

/// Each `information` file under `dir` (in bus order) through `parse`.
fn read_listing<T>(dir: &Path, parse: fn(&str) -> Option<T>) -> std::io::Result<Vec<T>> {
    let named = |path: &Path| {
        let path = path.display().to_string();
        move |e: std::io::Error| std::io::Error::new(e.kind(), format!("{path}: {e}"))
    };
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(named(dir))?
        .flatten()
        .map(|e| e.path())
        .collect();
    entries.sort();
    entries
        .iter()
        .map(|p| {
            let info = p.join("information");
            let text = std::fs::read_to_string(&info).map_err(named(&info))?;
            parse(&text).ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "{}: no Model, GPU UUID (or Device Minor) lines",
                        info.display()
                    ),
                )
            })
        })
        .collect()
}

/// Whether this host has MIG instances, as the kernel driver's capability tree beside the listing
/// shows them ([`mig_instances`]).
#[derive(Debug)]
pub enum MigInstances {
    /// The tree is there and no GPU has a GPU instance: every GPU CUDA can use is in the listing.
    Absent,
    /// A GPU instance's directory (the first found; there may be more).
    Present(PathBuf),
    /// The tree cannot be read, or is not there (a container may hide it): cannot tell.
    Unknown(std::io::Error),
}

/// The driver's capability tree beside the listing `gpus_dir`: `capabilities` in the directory
/// above it (`/proc/driver/nvidia/capabilities` for `/proc/driver/nvidia/gpus`).
pub fn capabilities_dir(gpus_dir: &Path) -> Option<PathBuf> {
    Some(gpus_dir.parent()?.join("capabilities"))
}

/// Looks for MIG GPU instances in the capability tree beside the listing `gpus_dir`. The NVIDIA
/// driver creates `capabilities/gpu<N>/mig/` for every GPU it attaches (MIG on or off) and one
/// `gi<M>/` in it per GPU instance, with its `access` file and a `ci<K>/` per compute instance
/// (NVIDIA's MIG user guide, "Device Nodes and Capabilities"). No `gi*` anywhere: no MIG instance.
pub fn mig_instances(gpus_dir: &Path) -> MigInstances {
    let Some(caps) = capabilities_dir(gpus_dir) else {
        return MigInstances::Unknown(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{}: no directory above it", gpus_dir.display()),
        ));
    };
    let named = |path: &Path| {
        let path = path.display().to_string();
        move |e: std::io::Error| std::io::Error::new(e.kind(), format!("{path}: {e}"))
    };
    let gpus = match std::fs::read_dir(&caps) {
        Ok(d) => d,
        Err(e) => return MigInstances::Unknown(named(&caps)(e)),
    };
    let mut gpu_dirs: Vec<PathBuf> = gpus
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("gpu"))
        .map(|e| e.path().join("mig"))
        .collect();
    gpu_dirs.sort();
    for mig in gpu_dirs {
        let entries = match std::fs::read_dir(&mig) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return MigInstances::Unknown(named(&mig)(e)),
        };
        let mut gis: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("gi"))
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        gis.sort();
        if let Some(gi) = gis.into_iter().next() {
            return MigInstances::Present(gi);
        }
    }
    MigInstances::Absent
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200: &str = "Model: \t\t NVIDIA H200\nIRQ:   \t\t 123\nGPU UUID: \t GPU-9e4a6df4-7685-21b7-ff26-5d07d01f4ca8\nVideo BIOS: \t 96.00.a5.00.01\nBus Type: \t PCIe\n";

    #[test]
    fn information_file_parses() {
        let g = parse_information(H200).expect("parsed");
        assert_eq!(g.name, "NVIDIA H200");
        assert_eq!(g.uuid, "9e4a6df4768521b7ff265d07d01f4ca8");
        assert!(g.free.is_none());
    }

    #[test]
    fn the_device_minor_names_the_node() {
        let text = format!("{H200}Device Minor: \t 3\nBus Location: \t 0000:1b:00.0\n");
        let n = parse_node(&text).expect("parsed");
        assert_eq!(n.minor, 3);
        assert_eq!(n.path(), "/dev/nvidia3");
        assert_eq!(n.uuid, "9e4a6df4768521b7ff265d07d01f4ca8");
        assert!(parse_node(H200).is_none());
        assert!(parse_node(&format!("{H200}Device Minor: x\n")).is_none());
        assert_eq!(
            describe_nodes(&[n]),
            "GPU-9e4a6df4-7685-21b7-ff26-5d07d01f4ca8 (NVIDIA H200) at /dev/nvidia3"
        );
        assert_eq!(describe_nodes(&[]), "none");
    }

    #[test]
    fn incomplete_information_is_rejected() {
        assert!(parse_information("Model: NVIDIA H200\n").is_none());
        assert!(
            parse_information("GPU UUID: GPU-9e4a6df4-7685-21b7-ff26-5d07d01f4ca8\n").is_none()
        );
        assert!(parse_information("Model: NVIDIA H200\nGPU UUID: not-a-uuid\n").is_none());
        assert!(
            parse_information("Model:\nGPU UUID: GPU-9e4a6df4-7685-21b7-ff26-5d07d01f4ca8\n")
                .is_none()
        );
    }

    #[test]
    fn directory_lists_every_gpu_in_bus_order() {
        let dir = std::env::temp_dir().join(format!("gpusnap-host-gpus-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (bus, uuid) in [
            ("0000:1b:00.0", "GPU-00000000-0000-0000-0000-000000000002"),
            ("0000:0a:00.0", "GPU-00000000-0000-0000-0000-000000000001"),
        ] {
            std::fs::create_dir_all(dir.join(bus)).unwrap();
            std::fs::write(
                dir.join(bus).join("information"),
                format!("Model: NVIDIA H200\nGPU UUID: {uuid}\n"),
            )
            .unwrap();
        }
        let gpus = list(&dir).expect("listed");
        assert_eq!(gpus.len(), 2);
        assert!(gpus[0].uuid.ends_with('1') && gpus[1].uuid.ends_with('2'));
        std::fs::write(dir.join("0000:0a:00.0/information"), "garbage").unwrap();
        assert!(list(&dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(list(&dir).is_err());
    }

    #[test]
    fn mig_instances_are_read_from_the_capability_tree_beside_the_listing() {
        let root = std::env::temp_dir().join(format!("gpusnap-mig-caps-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let gpus = root.join("gpus");
        std::fs::create_dir_all(&gpus).unwrap();
        // No capability tree at all (hidden, as in some containers): cannot tell.
        assert!(matches!(mig_instances(&gpus), MigInstances::Unknown(_)));
        // The tree as the driver lays it out with MIG off: gpu<N>/mig/ and nothing in it.
        let caps = root.join("capabilities");
        std::fs::create_dir_all(caps.join("gpu0/mig")).unwrap();
        std::fs::create_dir_all(caps.join("gpu1/mig")).unwrap();
        std::fs::create_dir_all(caps.join("mig")).unwrap();
        std::fs::write(caps.join("mig/config"), "").unwrap();
        assert!(matches!(mig_instances(&gpus), MigInstances::Absent));
        // One GPU instance with a compute instance, on the second GPU.
        let gi = caps.join("gpu1/mig/gi1");
        std::fs::create_dir_all(gi.join("ci0")).unwrap();
        std::fs::write(
            gi.join("access"),
            "DeviceFileMinor: 12\nDeviceFileMode: 292\n",
        )
        .unwrap();
        match mig_instances(&gpus) {
            MigInstances::Present(p) => assert_eq!(p, gi),
            other => panic!("{other:?}"),
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
