//! Whether a process sits in a frozen cgroup, and the refusal of a dump that CRIU would make
//! gpusnap start on a frozen process ([`refuse_frozen`]).
//!
//! containerd and CRI-O pause a container (the cgroup freezer) before they checkpoint it, and
//! resume it when the checkpoint returns. CRIU 4.1.x calls `PAUSE_DEVICES` for the dump's first
//! process before it thaws that cgroup (CRIU 4.2 thaws first:
//! [`crate::criu::thaws_before_pause_devices`]); a frozen job's agent cannot answer and its
//! driver threads cannot take the driver's lock, so a dump there would only wait for CRIU's
//! timeout.
//!
//! Read from the cgroup files, never from `/proc/<pid>/stat`: a task frozen by the cgroup v2
//! freezer shows `S`, like any sleeping task, and one frozen by the v1 freezer `D` (in
//! `__refrigerator`), like one waiting on a disk.
//! - cgroup v2: a cgroup is frozen by its own `cgroup.freeze` or by an ancestor's (1); its
//!   `cgroup.events` says `frozen 1` once all its tasks have stopped. The process's cgroup's
//!   `cgroup.events` and the `cgroup.freeze` of it and of every ancestor are read.
//! - cgroup v1: the `freezer.state` of the process's freezer cgroup, which counts its
//!   ancestors: `FROZEN`, or `FREEZING` on the way there.
//!
//! The hierarchies are found in `/proc/self/mountinfo` (CRIU's mounts), the process's cgroups
//! in `/proc/<pid>/cgroup`. What cannot be read or placed (no such mount, a cgroup outside
//! this mount namespace's view) counts as not frozen: the dump goes on as it would have.

use std::fmt;
use std::path::{Component, Path, PathBuf};

use crate::pid::HostPid;

/// A frozen cgroup: the file that says so and what it reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frozen {
    pub file: PathBuf,
    pub reads: String,
}

impl fmt::Display for Frozen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} reads {}", self.file.display(), self.reads)
    }
}

/// A cgroup hierarchy as mounted: the cgroup at the mount's root, and where it is mounted.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Mount {
    root: String,
    point: PathBuf,
}

impl Mount {
    /// The directory of `cgroup` (a path of `/proc/<pid>/cgroup`), if this mount shows it.
    fn dir(&self, cgroup: &str) -> Option<PathBuf> {
        let root = self.root.trim_end_matches('/');
        let below = cgroup.strip_prefix(root)?;
        if !(below.is_empty() || below.starts_with('/')) {
            return None;
        }
        let below = Path::new(below.trim_start_matches('/'));
        // A cgroup outside the reader's cgroup namespace reads `/../..`.
        if below
            .components()
            .any(|c| !matches!(c, Component::Normal(_)))
        {
            return None;
        }
        Some(self.point.join(below))
    }
}

/// The cgroup v2 hierarchy and the cgroup v1 freezer hierarchy, where mounted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupMounts {
    v2: Option<Mount>,
    v1_freezer: Option<Mount>,
}

impl CgroupMounts {
    /// From the text of a `/proc/<pid>/mountinfo`; the first mount of each hierarchy counts.
    pub fn parse(mountinfo: &str) -> CgroupMounts {
        let mut m = CgroupMounts::default();
        for line in mountinfo.lines() {
            // id parent major:minor root mount-point options [optional...] - type source super
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let l: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            let (Some(root), Some(point), Some(fstype)) = (l.get(3), l.get(4), r.first()) else {
                continue;
            };
            let mount = || Mount {
                root: unescape(root),
                point: PathBuf::from(unescape(point)),
            };
            match *fstype {
                "cgroup2" if m.v2.is_none() => m.v2 = Some(mount()),
                "cgroup"
                    if m.v1_freezer.is_none()
                        && r.get(2)
                            .is_some_and(|o| o.split(',').any(|o| o == "freezer")) =>
                {
                    m.v1_freezer = Some(mount())
                }
                _ => {}
            }
        }
        m
    }

    /// This process's (CRIU's) cgroup mounts; none if `/proc/self/mountinfo` cannot be read.
    pub fn of_self() -> CgroupMounts {
        std::fs::read_to_string("/proc/self/mountinfo")
            .map(|t| CgroupMounts::parse(&t))
            .unwrap_or_default()
    }

    /// Whether the process whose `/proc/<pid>/cgroup` reads `cgroups` is in a frozen cgroup.
    pub fn frozen(&self, cgroups: &str) -> Option<Frozen> {
        for line in cgroups.lines() {
            // hierarchy-id:controllers:path; cgroup v2 is `0::path`.
            let mut f = line.splitn(3, ':');
            let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
                continue;
            };
            let found = if id == "0" && controllers.is_empty() {
                self.v2.as_ref().and_then(|m| frozen_v2(m, path))
            } else if controllers.split(',').any(|c| c == "freezer") {
                self.v1_freezer.as_ref().and_then(|m| frozen_v1(m, path))
            } else {
                None
            };
            if found.is_some() {
                return found;
            }
        }
        None
    }
}

/// cgroup v2: the cgroup's `cgroup.events` (`frozen 1`), then its and its ancestors'
/// `cgroup.freeze` (1: frozen, or being frozen).
fn frozen_v2(mount: &Mount, cgroup: &str) -> Option<Frozen> {
    let dir = mount.dir(cgroup)?;
    let events = dir.join("cgroup.events");
    if let Ok(text) = std::fs::read_to_string(&events)
        && text.lines().any(|l| l.trim() == "frozen 1")
    {
        return Some(Frozen {
            file: events,
            reads: "frozen 1".into(),
        });
    }
    dir.ancestors()
        .take_while(|d| d.starts_with(&mount.point))
        .map(|d| d.join("cgroup.freeze"))
        .find(|f| std::fs::read_to_string(f).is_ok_and(|t| t.trim() == "1"))
        .map(|file| Frozen {
            file,
            reads: "1".into(),
        })
}

/// cgroup v1: the freezer cgroup's `freezer.state`.
fn frozen_v1(mount: &Mount, cgroup: &str) -> Option<Frozen> {
    let file = mount.dir(cgroup)?.join("freezer.state");
    let state = std::fs::read_to_string(&file).ok()?;
    let state = state.trim();
    matches!(state, "FROZEN" | "FREEZING").then(|| Frozen {
        reads: state.into(),
        file,
    })
}

/// `\040` and the other octal escapes of mountinfo's fields.
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push(d.iter().fold(0u8, |n, c| n.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `pid` is in a frozen cgroup, as CRIU's mount namespace shows it.
pub fn frozen(pid: HostPid) -> Option<Frozen> {
    let cgroups = std::fs::read_to_string(format!("/proc/{}/cgroup", pid.0)).ok()?;
    CgroupMounts::of_self().frozen(&cgroups)
}

/// `PAUSE_DEVICES` cannot go on for this process.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PauseRefused {
    #[error(
        "its cgroup is frozen ({how}): the container engine (containerd and CRI-O do) froze the container before the checkpoint, and this CRIU ({criu}) calls PAUSE_DEVICES before it thaws it, so gpusnap can neither reach the job's agent nor lock its GPU threads. Nothing was done; the job stays as the engine left it. Use CRIU 4.2 or later (it thaws the container first), or an engine that does not freeze it first"
    )]
    FrozenBeforeThaw { how: Frozen, criu: &'static str },
}

/// `PAUSE_DEVICES` of a GPU process, before anything about it is asked or touched: refused at
/// once when its cgroup is frozen and this CRIU has not thawed it yet (4.1.x). With CRIU 4.2 or
/// later nothing is read.
pub fn refuse_frozen(pid: HostPid) -> Result<(), PauseRefused> {
    if crate::criu::thaws_before_pause_devices() {
        return Ok(());
    }
    refusal(crate::criu::series(), frozen(pid))
}

fn refusal(criu: &'static str, frozen: Option<Frozen>) -> Result<(), PauseRefused> {
    match frozen {
        Some(how) => Err(PauseRefused::FrozenBeforeThaw { how, criu }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// A fake cgroup tree under a fresh directory: a v2 hierarchy at `<dir>/unified`, a v1
    /// freezer at `<dir>/freezer`, and the mountinfo that names them.
    struct Tree {
        dir: PathBuf,
        mounts: CgroupMounts,
    }

    impl Tree {
        fn new(name: &str) -> Tree {
            let dir =
                std::env::temp_dir().join(format!("gpusnap-freezer-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            let d = dir.display();
            let mountinfo = format!(
                "24 1 0:22 / /sys rw,nosuid shared:7 - sysfs sysfs rw\n\
                 30 24 0:26 / {d}/unified rw,nosuid,nodev,noexec shared:9 - cgroup2 cgroup2 rw,nsdelegate\n\
                 31 24 0:27 / {d}/cpu rw,relatime shared:10 - cgroup cgroup rw,cpu\n\
                 32 24 0:28 / {d}/freezer rw,relatime shared:11 - cgroup cgroup rw,freezer\n"
            );
            let mounts = CgroupMounts::parse(&mountinfo);
            Tree { dir, mounts }
        }

        fn write(&self, file: &str, text: &str) {
            let p = self.dir.join(file);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }

    const PROC_CGROUP: &str = "6:freezer:/k8s.io/job\n4:memory:/k8s.io/job\n0::/kubepods/pod/job\n";

    #[test]
    fn the_mounts_are_read_from_mountinfo() {
        let t = Tree::new("mounts");
        assert_eq!(
            t.mounts.v2,
            Some(Mount {
                root: "/".into(),
                point: t.dir.join("unified")
            })
        );
        assert_eq!(
            t.mounts.v1_freezer.as_ref().unwrap().point,
            t.dir.join("freezer")
        );
        // Escaped mount points, and a controller list with more than the freezer.
        let m = CgroupMounts::parse(
            "40 1 0:30 /ns /cg\\040roups rw - cgroup2 none rw\n\
             41 1 0:31 / /v1 rw - cgroup cgroup rw,freezer,devices\n",
        );
        assert_eq!(m.v2.as_ref().unwrap().point, PathBuf::from("/cg roups"));
        assert_eq!(m.v1_freezer.as_ref().unwrap().point, PathBuf::from("/v1"));
        // A mount of a cgroup below the hierarchy's root shows only what lies below it.
        let v2 = m.v2.unwrap();
        assert_eq!(v2.dir("/ns/a"), Some(PathBuf::from("/cg roups/a")));
        assert_eq!(v2.dir("/ns"), Some(PathBuf::from("/cg roups")));
        assert_eq!(v2.dir("/other"), None);
        assert_eq!(v2.dir("/nsx"), None);
        assert_eq!(CgroupMounts::parse("garbage\n"), CgroupMounts::default());
    }

    #[test]
    fn nothing_frozen() {
        let t = Tree::new("thawed");
        t.write("freezer/k8s.io/job/freezer.state", "THAWED\n");
        t.write("unified/kubepods/pod/job/cgroup.freeze", "0\n");
        t.write(
            "unified/kubepods/pod/job/cgroup.events",
            "populated 1\nfrozen 0\n",
        );
        t.write("unified/kubepods/cgroup.freeze", "0\n");
        assert_eq!(t.mounts.frozen(PROC_CGROUP), None);
        // Files that are not there: not frozen, as far as anyone can tell.
        assert_eq!(t.mounts.frozen("0::/elsewhere\n6:freezer:/gone\n"), None);
        // A cgroup outside the reader's cgroup namespace.
        assert_eq!(t.mounts.frozen("0::/../../kubepods/pod/job\n"), None);
        // No cgroup mounts at all.
        assert_eq!(CgroupMounts::default().frozen(PROC_CGROUP), None);
    }

    #[test]
    fn cgroup_v1_freezer() {
        let t = Tree::new("v1");
        for state in ["FROZEN", "FREEZING"] {
            t.write("freezer/k8s.io/job/freezer.state", &format!("{state}\n"));
            assert_eq!(
                t.mounts.frozen(PROC_CGROUP),
                Some(Frozen {
                    file: t.dir.join("freezer/k8s.io/job/freezer.state"),
                    reads: state.into()
                })
            );
        }
        // The freezer among other controllers of one hierarchy.
        assert!(t.mounts.frozen("3:freezer,devices:/k8s.io/job\n").is_some());
    }

    #[test]
    fn cgroup_v2_own_and_ancestors() {
        let t = Tree::new("v2");
        let job = "unified/kubepods/pod/job";
        t.write(&format!("{job}/cgroup.freeze"), "0\n");
        t.write(&format!("{job}/cgroup.events"), "populated 1\nfrozen 0\n");
        // An ancestor freezing: the job's cgroup is frozen by it (its own file reads 0).
        t.write("unified/kubepods/pod/cgroup.freeze", "1\n");
        assert_eq!(
            t.mounts.frozen(PROC_CGROUP).map(|f| f.file),
            Some(t.dir.join("unified/kubepods/pod/cgroup.freeze"))
        );
        // Its own.
        t.write("unified/kubepods/pod/cgroup.freeze", "0\n");
        t.write(&format!("{job}/cgroup.freeze"), "1\n");
        assert_eq!(
            t.mounts.frozen(PROC_CGROUP),
            Some(Frozen {
                file: t.dir.join(job).join("cgroup.freeze"),
                reads: "1".into()
            })
        );
        // Frozen as the kernel reports it.
        t.write(&format!("{job}/cgroup.freeze"), "0\n");
        t.write(&format!("{job}/cgroup.events"), "populated 1\nfrozen 1\n");
        assert_eq!(
            t.mounts.frozen("0::/kubepods/pod/job\n").map(|f| f.reads),
            Some("frozen 1".into())
        );
        // Nothing above the mount point is read.
        t.write(&format!("{job}/cgroup.events"), "frozen 0\n");
        t.write("cgroup.freeze", "1\n");
        assert_eq!(t.mounts.frozen("0::/kubepods/pod/job\n"), None);
    }

    #[test]
    fn the_refusal_names_the_cause_and_the_remedy() {
        assert_eq!(refusal("4.1", None), Ok(()));
        let how = Frozen {
            file: "/sys/fs/cgroup/freezer/k8s.io/job/freezer.state".into(),
            reads: "FROZEN".into(),
        };
        let e = refusal("4.1", Some(how)).unwrap_err().to_string();
        for part in [
            "its cgroup is frozen (/sys/fs/cgroup/freezer/k8s.io/job/freezer.state reads FROZEN)",
            "this CRIU (4.1) calls PAUSE_DEVICES before it thaws it",
            "neither reach the job's agent nor lock its GPU threads",
            "Nothing was done",
            "Use CRIU 4.2 or later",
        ] {
            assert!(e.contains(part), "{part:?} not in {e:?}");
        }
        assert!(!e.contains('\n'), "one line: {e:?}");
    }

    #[test]
    fn this_test_process_is_not_frozen() {
        assert_eq!(frozen(HostPid(std::process::id() as i32)), None);
        // Outside CRIU the series is unknown (older than 4.1), so the cgroups are read.
        assert_eq!(refuse_frozen(HostPid(std::process::id() as i32)), Ok(()));
    }

    #[test]
    fn octal_escapes() {
        assert_eq!(unescape("/a\\040b\\011c\\134d"), "/a b\tc\\d");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/trailing\\04"), "/trailing\\04");
    }
}
