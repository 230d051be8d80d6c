//! The KFD topology in sysfs: which GPUs this machine has, as KFD numbers them.
//!
//! Layout (`/sys/class/kfd/kfd/topology`): `generation_id`, and `nodes/<N>/` per node with
//! `gpu_id` (0 for a CPU node), `name`, `properties` (`key value` lines of integers) and
//! `mem_banks/<M>/properties`. Recent kernels report `local_mem_size 0` in the node properties and
//! the real VRAM size in the memory banks, so both are read.
//!
//! Every function takes the topology directory, so tests feed a fake tree.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

/// Where the kernel publishes the KFD topology.
pub const TOPOLOGY_DIR: &str = "/sys/class/kfd/kfd/topology";

/// Memory bank heap types counted as the GPU's local memory (`HSA_HEAPTYPE_FRAME_BUFFER_PUBLIC`
/// and `_PRIVATE`).
const HEAP_FB_PUBLIC: u64 = 1;
const HEAP_FB_PRIVATE: u64 = 2;

/// How often the node list is read again when `generation_id` changed while it was read.
const MAX_ATTEMPTS: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// No topology directory: the KFD driver is not loaded.
    #[error("no KFD topology at {}", path.display())]
    Missing { path: PathBuf },

    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("{}: {what}", path.display())]
    Parse { path: PathBuf, what: String },

    #[error("{}: no `{key}` property", path.display())]
    MissingProperty { path: PathBuf, key: &'static str },

    /// The topology changed (hotplug, driver reload) every time it was read.
    #[error("KFD topology at {} kept changing while read", path.display())]
    Unstable { path: PathBuf },
}

/// One GPU node of the KFD topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// The node's index under `nodes/`.
    pub node: u32,
    /// KFD's id of the GPU, the one CRIU's images and BO buckets refer to.
    pub gpu_id: u32,
    /// The `name` file (an ASIC name such as "ALDEBARAN"), if present and not empty.
    pub name: Option<String>,
    /// PCI vendor id (0x1002 for AMD).
    pub vendor_id: u32,
    pub device_id: u32,
    pub simd_count: u32,
    /// VRAM in bytes: frame-buffer memory banks, or `local_mem_size` where there are none.
    pub local_mem_bytes: u64,
    /// `gfx_target_version`, e.g. 90010 for gfx90a.
    pub gfx_target_version: Option<u32>,
    pub drm_render_minor: Option<u32>,
    /// Every integer property of the node, for the checks a restore makes.
    pub properties: BTreeMap<String, u64>,
}

impl Gpu {
    pub fn property(&self, key: &str) -> Option<u64> {
        self.properties.get(key).copied()
    }

    /// The LLVM target name, e.g. "gfx90a", "gfx942", "gfx1100".
    pub fn gfx_name(&self) -> Option<String> {
        let v = self.gfx_target_version.filter(|v| *v != 0)?;
        Some(format!(
            "gfx{}{:x}{:x}",
            v / 10_000,
            (v / 100) % 100,
            v % 100
        ))
    }

    /// The PCI address `dddd:bb:dd.f`, from `domain` and `location_id`.
    pub fn pci_address(&self) -> Option<String> {
        let loc = self.property("location_id")?;
        let domain = self.property("domain").unwrap_or(0);
        Some(format!(
            "{domain:04x}:{:02x}:{:02x}.{:x}",
            (loc >> 8) & 0xff,
            (loc >> 3) & 0x1f,
            loc & 0x7
        ))
    }
}

/// The GPUs of the system's KFD topology.
pub fn system_gpus() -> Result<Vec<Gpu>, TopologyError> {
    read_gpus(Path::new(TOPOLOGY_DIR))
}

/// The GPU nodes under `topology_dir` (a directory laid out as [`TOPOLOGY_DIR`]), ordered by
/// node index. CPU nodes (`gpu_id` 0) are left out. The list is read again when
/// `generation_id` changes meanwhile.
pub fn read_gpus(topology_dir: &Path) -> Result<Vec<Gpu>, TopologyError> {
    if !topology_dir.join("nodes").is_dir() {
        return Err(TopologyError::Missing {
            path: topology_dir.to_owned(),
        });
    }
    let generation = || read_optional(&topology_dir.join("generation_id"));
    for _ in 0..MAX_ATTEMPTS {
        let before = generation()?;
        let gpus = read_nodes(&topology_dir.join("nodes"))?;
        if generation()? == before {
            return Ok(gpus);
        }
    }
    Err(TopologyError::Unstable {
        path: topology_dir.to_owned(),
    })
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> TopologyError + '_ {
    move |source| TopologyError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The trimmed contents of a file, or `None` if it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, TopologyError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s.trim().to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(path)(e)),
    }
}

/// The numbered subdirectories of `dir`, sorted by number; other entries are ignored.
fn numbered_entries(dir: &Path) -> Result<Vec<(u32, PathBuf)>, TopologyError> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        if let Some(n) = entry.file_name().to_str().and_then(|s| s.parse().ok()) {
            out.push((n, entry.path()));
        }
    }
    out.sort_by_key(|(n, _)| *n);
    Ok(out)
}

fn read_nodes(nodes_dir: &Path) -> Result<Vec<Gpu>, TopologyError> {
    let mut gpus = Vec::new();
    for (node, dir) in numbered_entries(nodes_dir)? {
        let gpu_id_path = dir.join("gpu_id");
        let gpu_id = std::fs::read_to_string(&gpu_id_path).map_err(io_err(&gpu_id_path))?;
        let gpu_id: u32 = gpu_id.trim().parse().map_err(|_| TopologyError::Parse {
            what: format!("gpu_id {:?} is not an integer", gpu_id.trim()),
            path: gpu_id_path.clone(),
        })?;
        if gpu_id == 0 {
            continue; // a CPU node
        }
        gpus.push(read_gpu(node, gpu_id, &dir)?);
    }
    Ok(gpus)
}

fn read_gpu(node: u32, gpu_id: u32, dir: &Path) -> Result<Gpu, TopologyError> {
    let props_path = dir.join("properties");
    let text = std::fs::read_to_string(&props_path).map_err(io_err(&props_path))?;
    let properties = parse_properties(&text, &props_path)?;
    let required = |key: &'static str| -> Result<u32, TopologyError> {
        let value = properties
            .get(key)
            .ok_or_else(|| TopologyError::MissingProperty {
                path: props_path.clone(),
                key,
            })?;
        u32::try_from(*value).map_err(|_| TopologyError::Parse {
            path: props_path.clone(),
            what: format!("{key} {value} does not fit 32 bits"),
        })
    };
    let optional_u32 = |key: &str| properties.get(key).and_then(|v| u32::try_from(*v).ok());

    let banks = frame_buffer_bytes(&dir.join("mem_banks"))?;
    let local_mem_bytes = match banks {
        Some(bytes) if bytes > 0 => bytes,
        _ => properties.get("local_mem_size").copied().unwrap_or(0),
    };
    Ok(Gpu {
        node,
        gpu_id,
        name: read_optional(&dir.join("name"))?.filter(|n| !n.is_empty()),
        vendor_id: required("vendor_id")?,
        device_id: required("device_id")?,
        simd_count: required("simd_count")?,
        local_mem_bytes,
        gfx_target_version: optional_u32("gfx_target_version"),
        drm_render_minor: optional_u32("drm_render_minor"),
        properties,
    })
}

/// Sum of the frame-buffer banks under `mem_banks`, or `None` without that directory.
fn frame_buffer_bytes(banks_dir: &Path) -> Result<Option<u64>, TopologyError> {
    if !banks_dir.is_dir() {
        return Ok(None);
    }
    let mut total = 0u64;
    for (_, bank) in numbered_entries(banks_dir)? {
        let path = bank.join("properties");
        let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
        let props = parse_properties(&text, &path)?;
        let heap = props.get("heap_type").copied();
        if matches!(heap, Some(HEAP_FB_PUBLIC | HEAP_FB_PRIVATE)) {
            total = total.saturating_add(props.get("size_in_bytes").copied().unwrap_or(0));
        }
    }
    Ok(Some(total))
}

/// Parses `key value` lines. Values that are not unsigned integers are skipped (the kernel may
/// add properties this code does not know); a line that is not `key value` is an error.
fn parse_properties(text: &str, path: &Path) -> Result<BTreeMap<String, u64>, TopologyError> {
    let mut props = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let mut words = line.split_whitespace();
        let (Some(key), Some(value), None) = (words.next(), words.next(), words.next()) else {
            if line.trim().is_empty() {
                continue;
            }
            return Err(TopologyError::Parse {
                path: path.to_owned(),
                what: format!("line {}: expected `key value`, got {line:?}", i + 1),
            });
        };
        match value.parse::<u64>() {
            Ok(v) => {
                props.insert(key.to_owned(), v);
            }
            Err(_) => log::debug!("{}: skipping {key} {value}", path.display()),
        }
    }
    Ok(props)
}

/// Helpers to build a fake topology tree, shared with the crate's other tests.
#[cfg(test)]
pub(crate) mod fake {
    use std::path::Path;

    /// A fresh temporary directory, removed on drop.
    pub use criu_tests::fixtures::TempDir;

    pub fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    /// A CPU node 0, an MI210-like GPU node 1 with memory banks, and a GPU node 10 with only
    /// `local_mem_size` (and an unparsable property, and a name).
    pub fn two_gpus(root: &Path) {
        let nodes = root.join("nodes");
        write(&root.join("generation_id"), "3\n");
        write(&nodes.join("0/gpu_id"), "0\n");
        write(
            &nodes.join("0/properties"),
            "cpu_cores_count 64\nsimd_count 0\nvendor_id 0\ndevice_id 0\n",
        );
        write(&nodes.join("1/gpu_id"), "43210\n");
        write(&nodes.join("1/name"), "\n");
        write(
            &nodes.join("1/properties"),
            "cpu_cores_count 0\nsimd_count 416\nmem_banks_count 1\nvendor_id 4098\n\
             device_id 29711\nlocation_id 49920\ndomain 0\ndrm_render_minor 128\n\
             gfx_target_version 90010\nlocal_mem_size 0\nfw_version 78\n",
        );
        write(
            &nodes.join("1/mem_banks/0/properties"),
            "heap_type 1\nsize_in_bytes 68702699520\nflags 0\nwidth 4096\n",
        );
        write(
            &nodes.join("1/mem_banks/1/properties"),
            "heap_type 0\nsize_in_bytes 1000\n",
        );
        write(&nodes.join("10/gpu_id"), "777\n");
        write(&nodes.join("10/name"), "gfx1100\n");
        write(
            &nodes.join("10/properties"),
            "simd_count 96\nvendor_id 4098\ndevice_id 29772\nlocal_mem_size 25753026560\n\
             gfx_target_version 110000\nsomething_new -1\n\n",
        );
        write(&nodes.join("README"), "not a node\n");
    }
}

#[cfg(test)]
mod tests {
    use super::fake::{TempDir, two_gpus, write};
    use super::*;

    #[test]
    fn parses_fake_tree() {
        let t = TempDir::new("topo");
        two_gpus(t.path());
        let gpus = read_gpus(t.path()).unwrap();
        assert_eq!(gpus.len(), 2);

        let a = &gpus[0];
        assert_eq!((a.node, a.gpu_id), (1, 43210));
        assert_eq!(a.name, None);
        assert_eq!((a.vendor_id, a.device_id), (0x1002, 0x740f));
        assert_eq!(a.simd_count, 416);
        assert_eq!(a.local_mem_bytes, 68_702_699_520);
        assert_eq!(a.gfx_name().as_deref(), Some("gfx90a"));
        assert_eq!(a.drm_render_minor, Some(128));
        assert_eq!(a.pci_address().as_deref(), Some("0000:c3:00.0"));
        assert_eq!(a.property("fw_version"), Some(78));

        let b = &gpus[1];
        assert_eq!((b.node, b.gpu_id), (10, 777));
        assert_eq!(b.name.as_deref(), Some("gfx1100"));
        assert_eq!(b.local_mem_bytes, 25_753_026_560);
        assert_eq!(b.gfx_name().as_deref(), Some("gfx1100"));
        assert_eq!(b.drm_render_minor, None);
        assert_eq!(b.property("something_new"), None);
        assert_eq!(b.pci_address(), None);
    }

    #[test]
    fn gfx_names() {
        let t = TempDir::new("topo");
        two_gpus(t.path());
        let mut g = read_gpus(t.path()).unwrap().remove(0);
        for (v, name) in [(90402, "gfx942"), (90008, "gfx908"), (110001, "gfx1101")] {
            g.gfx_target_version = Some(v);
            assert_eq!(g.gfx_name().as_deref(), Some(name));
        }
        g.gfx_target_version = Some(0);
        assert_eq!(g.gfx_name(), None);
    }

    #[test]
    fn no_topology() {
        let t = TempDir::new("topo");
        let err = read_gpus(&t.file("absent")).unwrap_err();
        assert!(matches!(err, TopologyError::Missing { .. }), "{err}");
    }

    #[test]
    fn cpu_only_topology_has_no_gpus() {
        let t = TempDir::new("topo");
        write(&t.file("nodes/0/gpu_id"), "0\n");
        assert_eq!(read_gpus(t.path()).unwrap(), vec![]);
    }

    #[test]
    fn missing_required_property() {
        let t = TempDir::new("topo");
        write(&t.file("nodes/0/gpu_id"), "5\n");
        write(
            &t.file("nodes/0/properties"),
            "vendor_id 4098\nsimd_count 4\n",
        );
        let err = read_gpus(t.path()).unwrap_err();
        assert!(
            matches!(
                err,
                TopologyError::MissingProperty {
                    key: "device_id",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn malformed_files() {
        let t = TempDir::new("topo");
        write(&t.file("nodes/0/gpu_id"), "abc\n");
        assert!(matches!(
            read_gpus(t.path()).unwrap_err(),
            TopologyError::Parse { .. }
        ));
        write(&t.file("nodes/0/gpu_id"), "5\n");
        write(&t.file("nodes/0/properties"), "vendor_id\n");
        let err = read_gpus(t.path()).unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
        write(&t.file("nodes/0/properties"), "");
        std::fs::remove_file(t.file("nodes/0/properties")).unwrap();
        assert!(matches!(
            read_gpus(t.path()).unwrap_err(),
            TopologyError::Io { .. }
        ));
    }

    #[test]
    fn real_system_topology_reads_or_is_missing() {
        match system_gpus() {
            Ok(gpus) => eprintln!("KFD topology: {} GPU(s)", gpus.len()),
            Err(TopologyError::Missing { .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }
}
