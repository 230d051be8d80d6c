//! The driver stack a process ran on, recorded at the dump and checked of the node at the
//! restore's `init` (before CRIU creates any process, and without loading the driver library):
//! the NVIDIA kernel driver's version (`/proc/driver/nvidia/version`) and the driver library the
//! process had mapped, identified by its size and XXH3-128 digest. The dump reads that library
//! through `/proc/<pid>/map_files/<range>` (the very file mapped, whatever the process's mount
//! namespace calls it); the restore reads the file at the same path on this node, as CRIU will
//! map it for the restored process.

use gpusnap_host::pid::HostPid;
use gpusnap_image::{AllocationRecord, LibraryDigest, Manifest, Requirements};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Test hook: a file laid out like `/proc/driver/nvidia/version` (the stand-in's kernel driver).
pub const VERSION_FILE_ENV: &str = "GPUSNAP_TEST_NVIDIA_VERSION";
/// Test hook: one more file-name prefix taken as the driver library (the stand-in's, e.g.
/// `libfakecudadev.so`), besides `libcuda.so`.
pub const LIBRARY_NAME_ENV: &str = "GPUSNAP_TEST_DRIVER_LIBRARY";
/// Test hook: the directory a restore looks up the recorded library path below (another
/// "node"'s files), instead of `/`.
pub const LIBRARY_ROOT_ENV: &str = "GPUSNAP_TEST_DRIVER_ROOT";

/// The real driver library's file names start so (`libcuda.so.1`, `libcuda.so.580.95.05`).
const LIBCUDA_PREFIX: &str = "libcuda.so";

fn env_path(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The kernel driver's version file.
pub fn version_file() -> PathBuf {
    env_path(VERSION_FILE_ENV).unwrap_or_else(|| PathBuf::from("/proc/driver/nvidia/version"))
}

/// `NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  ...` → `580.95.05` (the open
/// module's line too).
pub fn parse_kernel_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|w| {
            let mut parts = w.split('.');
            parts
                .next()
                .is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
                && parts.next().is_some()
                && w.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        })
        .map(str::to_owned)
}

/// This node's kernel driver version, if its version file can be read.
pub fn kernel_driver_version() -> Option<String> {
    let text = std::fs::read_to_string(version_file()).ok()?;
    parse_kernel_version(&text)
}

fn is_driver_library(file_name: &str) -> bool {
    file_name.starts_with(LIBCUDA_PREFIX)
        || std::env::var(LIBRARY_NAME_ENV)
            .ok()
            .filter(|p| !p.is_empty())
            .is_some_and(|p| file_name.starts_with(&p))
}

/// The address range and path of the first mapping of the driver library in `/proc/<pid>/maps`
/// text: `("7f..-7f..", "/usr/lib/.../libcuda.so.580.95.05")`.
pub fn find_library_mapping(maps: &str) -> Option<(&str, &str)> {
    maps.lines().find_map(|l| {
        let mut fields = l.splitn(6, ' ');
        let range = fields.next()?;
        // perms, offset, dev, inode, then the path after padding.
        let path = fields.nth(4)?.trim_start();
        let name = path.rsplit('/').next()?;
        (path.starts_with('/') && !path.ends_with(" (deleted)") && is_driver_library(name))
            .then_some((range, path))
    })
}

/// Digests already computed, by (device, inode, size, ctime in ns): every process of a dump maps
/// the same library. The change time moves with every write and cannot be set back.
type FileKey = (u64, u64, u64, i64, i64);
static DIGESTS: Mutex<BTreeMap<FileKey, String>> = Mutex::new(BTreeMap::new());

fn digest_of(path: &str, f: std::fs::File) -> std::io::Result<LibraryDigest> {
    use std::os::unix::fs::MetadataExt;
    let md = f.metadata()?;
    let key = (md.dev(), md.ino(), md.size(), md.ctime(), md.ctime_nsec());
    if let Some(hex) = DIGESTS.lock().ok().and_then(|d| d.get(&key).cloned()) {
        return Ok(LibraryDigest {
            path: path.to_owned(),
            size: md.size(),
            xxh3_128: hex,
            in_job_root: false,
        });
    }
    let d = LibraryDigest::of_reader(path, &mut std::io::BufReader::new(f))?;
    if let Ok(mut cache) = DIGESTS.lock() {
        cache.insert(key, d.xxh3_128.clone());
    }
    Ok(d)
}

/// The driver library process `pid` has mapped, read through `/proc/<pid>/map_files`; `None`
/// if it maps none the dump knows (a stand-in, a library loaded another way) or it cannot be
/// read (logged).
pub fn mapped_driver_library(pid: HostPid) -> Option<LibraryDigest> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let (range, path) = find_library_mapping(&maps)?;
    let opened = std::fs::File::open(format!("/proc/{pid}/map_files/{range}"))
        .and_then(|f| digest_of(path, f));
    match opened {
        Ok(mut d) => {
            d.in_job_root = !same_root_as_ours(pid);
            Some(d)
        }
        Err(e) => {
            log::warn!("pid {pid}: driver library {path} not recorded: {e}");
            None
        }
    }
}

/// Whether process `pid` sees the same root directory as this process (not a container's).
fn same_root_as_ours(pid: HostPid) -> bool {
    use std::os::unix::fs::MetadataExt;
    let id = |p: &str| std::fs::metadata(p).map(|m| (m.dev(), m.ino())).ok();
    id(&format!("/proc/{pid}/root/")).is_some() && id(&format!("/proc/{pid}/root/")) == id("/")
}

/// What a restore of process `pid` needs of the node: the kernel driver's version, its driver
/// library, and the device memory its tracked allocations take per GPU.
pub fn requirements(pid: HostPid, allocations: &[AllocationRecord]) -> Requirements {
    let mut gpu_mem_used = BTreeMap::new();
    for a in allocations {
        *gpu_mem_used.entry(a.device).or_insert(0u64) += a.size;
    }
    Requirements {
        kernel_driver: kernel_driver_version(),
        driver_library: mapped_driver_library(pid),
        gpu_mem_used,
    }
}

/// Why this node cannot take an image, each with what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Mismatch {
    #[error(
        "the image was dumped on NVIDIA kernel driver {image}, this node runs {node}: restore on a node with driver {image}, or set allow_other_kernel_driver = true after trying this pair of versions"
    )]
    KernelDriver { image: String, node: String },
    #[error(
        "the driver library {path} the job had mapped (XXH3-128 {digest}) is not on this node ({why}): install the same NVIDIA driver here, or restore on a node that has it"
    )]
    LibraryAbsent {
        path: String,
        digest: String,
        why: String,
    },
    #[error(
        "the driver library {path} on this node differs from the job's ({node_size} bytes, XXH3-128 {node_digest}; the image needs {size} bytes, {digest}): install the same NVIDIA driver build here, or restore on a node that has it"
    )]
    LibraryDiffers {
        path: String,
        size: u64,
        digest: String,
        node_size: u64,
        node_digest: String,
    },
}

/// The library file a restore maps at `path` on this node.
fn node_path(path: &str) -> PathBuf {
    match env_path(LIBRARY_ROOT_ENV) {
        Some(root) => root.join(path.trim_start_matches('/')),
        None => PathBuf::from(path),
    }
}

/// Every way this node differs from what `manifests` need of its driver stack, each named once.
/// `node_kernel`: this node's kernel driver version, if known (unknown: not judged).
pub fn check_node<'a>(
    manifests: impl IntoIterator<Item = &'a Manifest>,
    node_kernel: Option<&str>,
    allow_other_kernel_driver: bool,
) -> Vec<Mismatch> {
    let mut out: Vec<Mismatch> = Vec::new();
    let mut seen_libs: HashMap<(String, String), ()> = HashMap::new();
    for r in manifests.into_iter().filter_map(|m| m.requires.as_ref()) {
        if let (Some(image), Some(node)) = (&r.kernel_driver, node_kernel)
            && image != node
            && !allow_other_kernel_driver
        {
            let m = Mismatch::KernelDriver {
                image: image.clone(),
                node: node.to_owned(),
            };
            if !out.contains(&m) {
                out.push(m);
            }
        }
        let Some(lib) = &r.driver_library else {
            continue;
        };
        // A container's library lives in its own root, which the runtime mounts at the
        // restore: not to be looked up on this node's root.
        if lib.in_job_root
            || seen_libs
                .insert((lib.path.clone(), lib.xxh3_128.clone()), ())
                .is_some()
        {
            continue;
        }
        if let Some(m) = check_library(lib, &node_path(&lib.path)) {
            out.push(m);
        }
    }
    out
}

fn check_library(lib: &LibraryDigest, at: &Path) -> Option<Mismatch> {
    let digest = std::fs::File::open(at).and_then(|f| {
        let size = f.metadata()?.len();
        if size != lib.size {
            // No need to read it: the size tells already.
            return Ok(LibraryDigest {
                path: lib.path.clone(),
                size,
                xxh3_128: "(not computed: the size differs)".into(),
                in_job_root: false,
            });
        }
        digest_of(&lib.path, f)
    });
    match digest {
        Ok(d) if d.size == lib.size && d.xxh3_128 == lib.xxh3_128 => None,
        Ok(d) => Some(Mismatch::LibraryDiffers {
            path: lib.path.clone(),
            size: lib.size,
            digest: lib.xxh3_128.clone(),
            node_size: d.size,
            node_digest: d.xxh3_128,
        }),
        Err(e) => Some(Mismatch::LibraryAbsent {
            path: lib.path.clone(),
            digest: lib.xxh3_128.clone(),
            why: format!("{}: {e}", at.display()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_parse() {
        let t = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Tue Sep 23 09:55:41 UTC 2025\nGCC version:  gcc version 12.2.0\n";
        assert_eq!(parse_kernel_version(t).as_deref(), Some("580.95.05"));
        let open =
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build\n";
        assert_eq!(parse_kernel_version(open).as_deref(), Some("570.124.06"));
        assert_eq!(parse_kernel_version("nothing"), None);
    }

    #[test]
    fn the_driver_library_mapping_is_found_by_its_name() {
        let maps = "\
55d0a0000000-55d0a0001000 r--p 00000000 08:01 123 /usr/bin/python3.11
7f0000000000-7f0000100000 r--p 00000000 08:01 456                        /usr/lib/x86_64-linux-gnu/libcudart.so.12
7f0000200000-7f0000300000 r--p 00000000 08:01 789                        /usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05
7f0000300000-7f0000400000 r-xp 00100000 08:01 789                        /usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05
7f0000400000-7f0000500000 rw-s 00000000 00:05 1                          /dev/nvidia0
";
        assert_eq!(
            find_library_mapping(maps),
            Some((
                "7f0000200000-7f0000300000",
                "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05"
            ))
        );
        assert_eq!(
            find_library_mapping("7f0-7f1 r--p 0 08:01 1 /lib/libcuda.so.1 (deleted)\n"),
            None
        );
        assert_eq!(find_library_mapping("7f0-7f1 rw-p 0 00:00 0\n"), None);
    }

    #[test]
    fn every_mismatch_is_named_once() {
        let dir = std::env::temp_dir().join(format!("gpusnap-stack-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join("libcuda.so.1");
        std::fs::write(&lib, b"the job's driver").unwrap();
        let recorded = LibraryDigest::of_reader(
            lib.to_str().unwrap(),
            &mut std::fs::File::open(&lib).unwrap(),
        )
        .unwrap();
        let m = Manifest {
            requires: Some(Requirements {
                kernel_driver: Some("580.95.05".into()),
                driver_library: Some(recorded.clone()),
                gpu_mem_used: BTreeMap::new(),
            }),
            ..crate::test_manifest()
        };
        let two = [
            m.clone(),
            Manifest {
                nspid: gpusnap_host::pid::NsPid(8),
                ..m.clone()
            },
        ];
        assert!(check_node(&two, Some("580.95.05"), false).is_empty());
        assert!(
            check_node(&two, None, false).is_empty(),
            "unknown: not judged"
        );
        let other = check_node(&two, Some("575.57.08"), false);
        assert_eq!(other.len(), 1, "{other:?}");
        assert!(other[0].to_string().contains("allow_other_kernel_driver"));
        assert!(check_node(&two, Some("575.57.08"), true).is_empty());

        std::fs::write(&lib, b"another driver!!").unwrap();
        let e = check_node(&two, Some("575.57.08"), false);
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(matches!(e[1], Mismatch::LibraryDiffers { .. }), "{e:?}");
        std::fs::write(&lib, b"short").unwrap();
        assert!(matches!(
            check_node(&two, None, false)[..],
            [Mismatch::LibraryDiffers { node_size: 5, .. }]
        ));
        std::fs::remove_file(&lib).unwrap();
        assert!(matches!(
            check_node(&two, None, false)[..],
            [Mismatch::LibraryAbsent { .. }]
        ));
        assert!(check_node(&[crate::test_manifest()], Some("1.2"), false).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
