//! NVIDIA device files held without CUDA state the driver can checkpoint (an NVML user's
//! `/dev/nvidiactl`, fds inherited over `fork`). CRIU cannot dump such a file itself: at dump
//! its path and open flags are recorded (`DUMP_EXT_FILE`), at restore it is opened again in the
//! restored task (`RESTORE_EXT_FILE`). Processes with CUDA state hold none after the driver
//! checkpoint, so this only concerns processes gpusnap did not checkpoint through the driver.
//!
//! A per-GPU node (`/dev/nvidia<N>`) follows the restore's GPU plan: the dump records which GPU
//! it was (the kernel driver's listing: the GPU whose `Device Minor` is the node's), and the
//! restore's `init` works out, for every such record, the node of the GPU that GPU is restored
//! onto ([`plan_nodes`]: `device_map`, the plan made from the listing, or the same GPU). A GPU
//! this host lacks refuses the restore there, before CRIU creates any process; a node missing
//! in the restored task's `/dev` refuses it at `RESTORE_EXT_FILE`, naming the path and the
//! GPUs here. `/dev/nvidiactl`, `/dev/nvidia-uvm` and the driver's other nodes are opened
//! again at their own path.

use crate::host_gpus::GpuNode;
use gpusnap_image::{DevFileRecord, ImageError};
use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// The character-device major of the NVIDIA driver's own nodes (`nvidia<N>`, `nvidiactl`).
const NVIDIA_MAJOR: u32 = 195;

/// The device minor of the GPU behind per-GPU node `path` (`/dev/nvidia<N>`) whose device
/// number is `rdev`: the number's minor for a node of the NVIDIA driver (major 195), else the
/// number in the name (the driver names its nodes so; a node made otherwise, as the stand-in's,
/// is taken by its name). `None` for the driver's other nodes.
fn node_minor(path: &str, rdev: libc::dev_t) -> Option<u32> {
    let named = gpusnap_image::gpu_node_number(path)?;
    Some(if libc::major(rdev) == NVIDIA_MAJOR {
        libc::minor(rdev)
    } else {
        named
    })
}

/// The path and flags of `fd` if it is an NVIDIA device node; a per-GPU node's GPU from the
/// kernel driver's listing (`None` where the listing does not show it, logged).
pub fn describe(fd: BorrowedFd<'_>) -> Option<DevFileRecord> {
    let fd = fd.as_raw_fd();
    // SAFETY: fstat on a borrowed (so open) fd, into a zeroed stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFCHR {
        return None;
    }
    let path = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    let path = path.to_str()?.to_owned();
    if !gpusnap_image::is_nvidia_device_path(&path) {
        return None;
    }
    // SAFETY: F_GETFL on a valid fd.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return None;
    }
    let gpu = node_minor(&path, st.st_rdev).and_then(|minor| {
        let listing = crate::host_gpus::proc_dir();
        match crate::host_gpus::list_nodes(&listing) {
            Ok(nodes) => {
                let found = nodes.into_iter().find(|n| n.minor == minor);
                if found.is_none() {
                    log::warn!(
                        "{path}: no GPU with device minor {minor} in {}; recorded without its GPU (a restore opens the same path)",
                        listing.display()
                    );
                }
                found.map(|n| n.uuid)
            }
            Err(e) => {
                log::warn!(
                    "{path}: its GPU is not known ({e}); recorded without it (a restore opens the same path)"
                );
                None
            }
        }
    });
    Some(DevFileRecord {
        path,
        flags: flags & (libc::O_ACCMODE | libc::O_NONBLOCK),
        gpu,
    })
}

/// DUMP_EXT_FILE: `Ok(false)` when the file is not ours. With `durable`, the image directory
/// is fsynced after the record's rename (its bytes are fsynced before it).
pub fn dump(
    dir: BorrowedFd<'_>,
    fd: BorrowedFd<'_>,
    id: u32,
    durable: bool,
) -> Result<bool, ImageError> {
    let Some(rec) = describe(fd) else {
        return Ok(false);
    };
    gpusnap_image::write_dev_file(dir, id, &rec)?;
    if durable {
        gpusnap_host::fault::sync_dir(dir)?;
    }
    match &rec.gpu {
        Some(g) => log::info!(
            "file {id}: {} (GPU {}) held open without CUDA state; recorded, a restore opens the node of the GPU it goes to",
            rec.path,
            crate::gpumap::dashed(g)
        ),
        None => log::info!(
            "file {id}: {} held open without CUDA state; recorded, it is opened again at restore",
            rec.path
        ),
    }
    Ok(true)
}

/// Where a recorded per-GPU node is opened at this restore.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reopen {
    /// The node of the GPU the recorded one goes to.
    pub path: String,
    /// That GPU (32 hex digits) and its device minor, checked on the node opened.
    pub gpu: String,
    pub minor: u32,
}

/// Each recorded per-GPU node's [`Reopen`], by CRIU file id, made at `init`. A record not in it
/// (no GPU recorded, no listing to map it by) is opened at its own path.
#[derive(Clone, Debug, Default)]
pub struct NodePlan {
    pub nodes: HashMap<u32, Reopen>,
    /// The listing's GPUs, for messages at `RESTORE_EXT_FILE`.
    pub host: Vec<GpuNode>,
}

/// Why a recorded per-GPU node cannot follow its GPU onto this host.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("listing the device-file records: {0}")]
    List(#[source] ImageError),
    #[error("device file record {id}: {source}")]
    Record {
        id: u32,
        #[source]
        source: ImageError,
    },
    #[error(
        "{path} (GPU {gpu} at dump) goes with that GPU to GPU {target}, which is not on this host; this host's GPUs: {host}. Fix device_map to name one of them"
    )]
    TargetAbsent {
        path: String,
        gpu: String,
        target: String,
        host: String,
    },
    #[error(
        "{path} (GPU {gpu} at dump): that GPU is not on this host and no GPU of the restore's plan takes its place; this host's GPUs: {host}. Set device_map to choose one"
    )]
    NoTarget {
        path: String,
        gpu: String,
        host: String,
    },
}

/// The GPU each GPU of the image goes to, as `init` knows it: `device_map` first, then the
/// pairs of the plan made from the kernel driver's listing (every process's; the first wins
/// where two differ, logged), all as 32 hex digits.
pub fn targets(
    device_map: &[(String, String)],
    planned: &[crate::gpumap::Pair],
) -> HashMap<String, String> {
    let mut out: HashMap<String, String> = HashMap::new();
    for p in planned {
        match out.get(&p.old) {
            Some(new) if *new != p.new => log::warn!(
                "GPU {} goes to GPU {new} in one process's plan and to {} in another's; its device nodes follow the first",
                p.old,
                p.new
            ),
            Some(_) => {}
            None => {
                out.insert(p.old.clone(), p.new.clone());
            }
        }
    }
    for (old, new) in device_map {
        out.insert(old.clone(), new.clone());
    }
    out
}

/// `init(RESTORE)`: [`plan_nodes`] against the kernel driver's listing, with the GPU pairs of
/// `device_map` and `planned` (the plan `init` made from the listing). With `left_to_driver`
/// (the image's GPUs are MIG instances, planned only after CRIU's restore) or a `device_map`
/// target the listing lacks (a MIG instance, or refused already by the GPU check), or a listing
/// without device minors, every record keeps its own path.
pub fn plan_at_init(
    dir: BorrowedFd<'_>,
    device_map: &[(String, String)],
    planned: &[crate::gpumap::Pair],
    left_to_driver: bool,
) -> Result<NodePlan, Vec<NodeError>> {
    let listing = crate::host_gpus::proc_dir();
    let host = match crate::host_gpus::list_nodes(&listing) {
        Ok(_) if left_to_driver => {
            log::debug!("device nodes: the GPU plan is the driver's; they keep their paths");
            None
        }
        Ok(h)
            if device_map
                .iter()
                .any(|(_, new)| !h.iter().any(|n| n.uuid == *new)) =>
        {
            log::debug!(
                "device nodes: device_map names a GPU the listing lacks; they keep their paths"
            );
            None
        }
        Ok(h) => Some(h),
        Err(e) => {
            log::debug!("device nodes: no listing to map them by ({e})");
            None
        }
    };
    plan_nodes(dir, host.as_deref(), &targets(device_map, planned))
}

/// `init(RESTORE)`: where each recorded per-GPU node of `dir` is opened, against the listing
/// `host` (`None`: it cannot be read, and every record keeps its own path) and the GPU pairs
/// `targets` ([`targets`]). Every record that cannot follow its GPU is returned.
pub fn plan_nodes(
    dir: BorrowedFd<'_>,
    host: Option<&[GpuNode]>,
    targets: &HashMap<String, String>,
) -> Result<NodePlan, Vec<NodeError>> {
    let ids = match gpusnap_image::list_dev_files(dir) {
        Ok(ids) => ids,
        Err(source) => return Err(vec![NodeError::List(source)]),
    };
    let mut records = Vec::new();
    let mut problems = Vec::new();
    for id in ids {
        match gpusnap_image::read_dev_file(dir, id) {
            Ok(r) => records.push((id, r)),
            Err(source) => problems.push(NodeError::Record { id, source }),
        }
    }
    match plan_records(&records, host, targets) {
        Ok(plan) if problems.is_empty() => Ok(plan),
        Ok(_) => Err(problems),
        Err(more) => {
            problems.extend(more);
            Err(problems)
        }
    }
}

/// [`plan_nodes`] of records already read.
pub fn plan_records(
    records: &[(u32, DevFileRecord)],
    host: Option<&[GpuNode]>,
    targets: &HashMap<String, String>,
) -> Result<NodePlan, Vec<NodeError>> {
    let mut plan = NodePlan::default();
    let Some(host) = host else {
        if records.iter().any(|(_, r)| r.gpu.is_some()) {
            log::warn!(
                "per-GPU device files are opened again at their own path: this restore cannot map them to its GPUs (no listing with device minors, or a GPU plan made only after CRIU's restore)"
            );
        }
        return Ok(plan);
    };
    plan.host = host.to_vec();
    let mut problems = Vec::new();
    for (id, rec) in records {
        let Some(gpu) = &rec.gpu else { continue };
        let target = targets.get(gpu).unwrap_or(gpu);
        let described = || crate::host_gpus::describe_nodes(host);
        match host.iter().find(|n| n.uuid == *target) {
            Some(n) => {
                if n.path() != rec.path {
                    log::info!(
                        "file {id}: {} (GPU {}) is opened as {} (GPU {})",
                        rec.path,
                        crate::gpumap::dashed(gpu),
                        n.path(),
                        crate::gpumap::dashed(&n.uuid)
                    );
                }
                plan.nodes.insert(
                    *id,
                    Reopen {
                        path: n.path(),
                        gpu: n.uuid.clone(),
                        minor: n.minor,
                    },
                );
            }
            None if target == gpu => problems.push(NodeError::NoTarget {
                path: rec.path.clone(),
                gpu: crate::gpumap::dashed(gpu),
                host: described(),
            }),
            None => problems.push(NodeError::TargetAbsent {
                path: rec.path.clone(),
                gpu: crate::gpumap::dashed(gpu),
                target: crate::gpumap::dashed(target),
                host: described(),
            }),
        }
    }
    if problems.is_empty() {
        Ok(plan)
    } else {
        Err(problems)
    }
}

/// Why a recorded device file cannot be opened again.
#[derive(Debug, thiserror::Error)]
pub enum DevFileError {
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("the recorded path {path:?} holds a NUL byte")]
    Nul { path: String },
    #[error(
        "cannot open {path} again ({source}): the process held it at dump time; is the NVIDIA driver loaded here?"
    )]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot open {path} ({source}), the node of GPU {gpu}, where the GPU of {recorded} (held at dump time) is restored: the restored process's /dev lacks it. This host's GPUs: {host}; give the job that GPU's device node"
    )]
    OpenMapped {
        path: String,
        recorded: String,
        gpu: String,
        host: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path} in the restored process's /dev is device {major}:{minor}, not GPU {gpu}'s node ({NVIDIA_MAJOR}:{expected}); give the job that GPU's device node"
    )]
    OtherNode {
        path: String,
        gpu: String,
        major: u32,
        minor: u32,
        expected: u32,
    },
}

/// RESTORE_EXT_FILE, in the restored task: the new fd, `Ok(None)` when the file is not ours. A
/// per-GPU node in `plan` is opened at its [`Reopen`] path, and checked to be that GPU's node
/// where it is the NVIDIA driver's.
pub fn restore(
    dir: BorrowedFd<'_>,
    id: u32,
    plan: &NodePlan,
) -> Result<Option<OwnedFd>, DevFileError> {
    let rec = match gpusnap_image::read_dev_file(dir, id) {
        Ok(r) => r,
        Err(ImageError::MissingFile { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let mapped = plan.nodes.get(&id);
    let path = mapped.map_or(rec.path.as_str(), |m| m.path.as_str());
    let c_path = CString::new(path).map_err(|_| DevFileError::Nul {
        path: path.to_owned(),
    })?;
    // SAFETY: open(2) with a NUL-terminated path: the record's, checked to be an NVIDIA device
    // node, or `/dev/nvidia<N>` made from the listing.
    let fd = unsafe { libc::open(c_path.as_ptr(), rec.flags) };
    if fd < 0 {
        let source = std::io::Error::last_os_error();
        return Err(match mapped {
            Some(m) => DevFileError::OpenMapped {
                path: m.path.clone(),
                recorded: rec.path,
                gpu: crate::gpumap::dashed(&m.gpu),
                host: crate::host_gpus::describe_nodes(&plan.host),
                source,
            },
            None => DevFileError::Open {
                path: rec.path,
                source,
            },
        });
    }
    // SAFETY: open(2) just returned `fd`; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if let Some(m) = mapped {
        check_node(fd.as_raw_fd(), m)?;
    }
    Ok(Some(fd))
}

/// A node of the NVIDIA driver (major 195) opened for `m` must be its GPU's (minor); a node
/// made otherwise (the stand-in's) is taken by its name.
fn check_node(fd: i32, m: &Reopen) -> Result<(), DevFileError> {
    // SAFETY: fstat on an fd just opened, into a zeroed stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Ok(());
    }
    let (major, minor) = (libc::major(st.st_rdev), libc::minor(st.st_rdev));
    if major == NVIDIA_MAJOR && minor != m.minor {
        return Err(DevFileError::OtherNode {
            path: m.path.clone(),
            gpu: crate::gpumap::dashed(&m.gpu),
            major,
            minor,
            expected: m.minor,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpumap::Pair;

    const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
    const C: &str = "cccccccccccccccccccccccccccccccc";

    #[test]
    fn ordinary_files_are_not_ours() {
        let f = std::fs::File::open("/dev/null").unwrap();
        assert!(super::describe(std::os::fd::AsFd::as_fd(&f)).is_none());
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert!(super::describe(std::os::fd::AsFd::as_fd(&f)).is_none());
    }

    #[test]
    fn a_node_of_the_nvidia_driver_is_known_by_its_device_number() {
        let nvidia = libc::makedev(NVIDIA_MAJOR, 5);
        assert_eq!(node_minor("/dev/nvidia2", nvidia), Some(5));
        // A node made otherwise (the stand-in's) by its name.
        assert_eq!(node_minor("/dev/nvidia2", libc::makedev(10, 229)), Some(2));
        assert_eq!(node_minor("/dev/nvidiactl", nvidia), None);
        assert_eq!(node_minor("/dev/nvidia-uvm", nvidia), None);
    }

    fn node(uuid: &str, name: &str, minor: u32) -> GpuNode {
        GpuNode {
            uuid: uuid.into(),
            name: name.into(),
            minor,
        }
    }

    fn rec(path: &str, gpu: Option<&str>) -> DevFileRecord {
        DevFileRecord {
            path: path.into(),
            flags: libc::O_RDWR,
            gpu: gpu.map(Into::into),
        }
    }

    fn pair(old: &str, new: &str) -> Pair {
        Pair {
            old: old.into(),
            new: new.into(),
        }
    }

    #[test]
    fn a_per_gpu_node_follows_its_gpu() {
        let host = [node(A, "NVIDIA H200", 1), node(B, "NVIDIA H200", 4)];
        let records = [
            (1, rec("/dev/nvidia0", Some(A))),
            (2, rec("/dev/nvidiactl", None)),
            (3, rec("/dev/nvidia7", Some(C))),
        ];
        // The same GPU, now at another minor; C replaced by B in the plan.
        let plan = plan_records(&records, Some(&host), &targets(&[], &[pair(C, B)])).unwrap();
        assert_eq!(plan.nodes[&1].path, "/dev/nvidia1");
        assert_eq!(plan.nodes[&3].path, "/dev/nvidia4");
        assert_eq!((plan.nodes[&3].gpu.as_str(), plan.nodes[&3].minor), (B, 4));
        assert!(!plan.nodes.contains_key(&2), "nvidiactl keeps its path");
        // device_map wins over the plan.
        let map = [(C.to_owned(), A.to_owned())];
        let plan = plan_records(&records, Some(&host), &targets(&map, &[pair(C, B)])).unwrap();
        assert_eq!(plan.nodes[&3].path, "/dev/nvidia1");
        // No listing: every record keeps its path.
        let plan = plan_records(&records, None, &HashMap::new()).unwrap();
        assert!(plan.nodes.is_empty());
    }

    #[test]
    fn a_gpu_without_a_place_here_is_refused_naming_the_node_and_the_gpus_here() {
        let host = [node(A, "NVIDIA H200", 0)];
        let records = [
            (1, rec("/dev/nvidia3", Some(C))),
            (2, rec("/dev/nvidia5", Some(B))),
        ];
        let map = [(B.to_owned(), C.to_owned())];
        let e = plan_records(&records, Some(&host), &targets(&map, &[])).unwrap_err();
        assert_eq!(e.len(), 2, "{e:?}");
        let first = e[0].to_string();
        assert!(
            first.contains("/dev/nvidia3")
                && first.contains("GPU-cccccccc-cccc-cccc-cccc-cccccccccccc at dump")
                && first.contains("no GPU of the restore's plan takes its place")
                && first.contains(
                    "this host's GPUs: GPU-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa (NVIDIA H200) at /dev/nvidia0"
                )
                && first.contains("device_map"),
            "{first}"
        );
        let second = e[1].to_string();
        assert!(
            second.contains("/dev/nvidia5")
                && second.contains(
                    "to GPU GPU-cccccccc-cccc-cccc-cccc-cccccccccccc, which is not on this host"
                ),
            "{second}"
        );
    }

    #[test]
    fn the_first_plan_wins_where_two_differ() {
        let t = targets(&[], &[pair(A, B), pair(A, C), pair(B, C)]);
        assert_eq!(t[A], B);
        assert_eq!(t[B], C);
    }

    /// A temporary image directory holding one record.
    fn image_with(rec: &DevFileRecord) -> (std::path::PathBuf, std::fs::File) {
        let dir = std::env::temp_dir().join(format!(
            "gpusnap-devfile-{}-{}",
            std::process::id(),
            rec.path.replace('/', "_")
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let f = std::fs::File::open(&dir).unwrap();
        gpusnap_image::write_dev_file(std::os::fd::AsFd::as_fd(&f), 9, rec).unwrap();
        (dir, f)
    }

    #[test]
    fn restore_opens_the_planned_node_or_names_it_and_the_gpus_here() {
        let (dir, f) = image_with(&rec("/dev/nvidia0", Some(A)));
        let fd = std::os::fd::AsFd::as_fd(&f);
        let mut plan = NodePlan {
            host: vec![node(B, "NVIDIA H200", 6)],
            ..Default::default()
        };
        plan.nodes.insert(
            9,
            Reopen {
                path: "/dev/nvidia-gpusnap-test-absent".into(),
                gpu: B.into(),
                minor: 6,
            },
        );
        let e = restore(fd, 9, &plan).unwrap_err().to_string();
        assert!(
            e.contains("cannot open /dev/nvidia-gpusnap-test-absent")
                && e.contains("GPU-bbbbbbbb-bbbb-bbbb-bbbb-bbbbbbbbbbbb")
                && e.contains("/dev/nvidia0")
                && e.contains("(NVIDIA H200) at /dev/nvidia6"),
            "{e}"
        );
        // A node that is not the NVIDIA driver's is taken as it is.
        plan.nodes.get_mut(&9).unwrap().path = "/dev/null".into();
        assert!(restore(fd, 9, &plan).unwrap().is_some());
        // Not ours.
        assert!(restore(fd, 10, &plan).unwrap().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
