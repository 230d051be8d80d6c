//! A pre-copy round (`gpusnap precopy PID --images DIR`): the device data of a running split-path
//! process copied into gpusnap image files while the process runs on, so that a later
//! `criu dump` whose image directory has a `parent` link to DIR copies only what changed since.
//!
//! The process is never stopped or locked. The agent holds its allocation table while the GPU
//! hashes and while each chunk is copied (the application's allocation calls wait for at most
//! the hash kernels or one chunk's copy; its kernels and copies run on). Bytes copied from memory the application
//! may be writing are not the bytes the GPU hashed before, so the writers hash what they
//! received and record that as each chunk's device hash (`datapath::Round::Live`); the final
//! dump compares the GPU's hash of the memory as it is then with it, so a chunk that changed
//! after it was copied is copied again. The round's directory holds gpusnap files only (no CRIU
//! images): it is a parent for dumps, never restored by itself.
//!
//! Failure leaves the process as it was: the round's files are removed, and the round can be
//! run again.

use crate::agent::{AgentError, AgentSession};
use crate::context::{codec_for, limits_of};
use crate::datapath::{self, DataError, DumpData, Round};
use crate::staging::{RingShape, Staging};
use gpusnap_host::pid::{HostPid, NsPid};
use gpusnap_host::procfs;
use gpusnap_image::{AllocationRecord, CheckpointPath, ChunkEntry, ImageError, PARENT_LINK};
use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum PreCopyError {
    #[error(transparent)]
    JobBusy(#[from] gpusnap_host::joblock::JobLockError),
    #[error("configuration: {0}")]
    Config(#[from] gpusnap_config::ConfigError),
    #[error("pid {pid}: {err}")]
    Proc { pid: HostPid, err: std::io::Error },
    #[error(
        "pid {pid} has no gpusnap agent (start it with LD_PRELOAD of libgpusnap_agent.so): a pre-copy round needs the split path"
    )]
    NoAgent { pid: HostPid },
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("{0}")]
    Data(#[from] DataError),
    #[error("{}: {err}", dir.display())]
    ImageDir { dir: PathBuf, err: std::io::Error },
    #[error("{}: {err}", dir.display())]
    ListImages { dir: PathBuf, err: ImageError },
    #[error(
        "{} is in use by another gpusnap precopy ({}): one round at a time writes into a directory; wait for it, or give another directory",
        dir.display(),
        holder.map_or("its pid is not known".to_owned(), |p| format!("pid {p}"))
    )]
    Busy {
        dir: PathBuf,
        holder: Option<HostPid>,
    },
    #[error(
        "{} already holds a gpusnap image of nspid {nspid}: a pre-copy round writes into a directory of its own (it may be the parent of other images)",
        dir.display()
    )]
    NotEmpty { dir: PathBuf, nspid: NsPid },
    #[error(
        "{}: its `parent` link leads to {}, not to {}",
        dir.display(),
        found.display(),
        wanted.display()
    )]
    OtherParent {
        dir: PathBuf,
        found: PathBuf,
        wanted: PathBuf,
    },
    #[error("the NVIDIA driver: {0}")]
    Driver(#[from] crate::DriverError),
    #[error(
        "the process's allocations changed during the round ({0}); nothing of the process was changed: run the round again"
    )]
    Changed(Spoilt),
    #[error("writing the manifest: {0}")]
    Manifest(ImageError),
}

/// How the allocations after a round show that they changed during it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Spoilt {
    #[error("the chunk at {addr:#x} lies in no allocation the agent holds now")]
    NoAllocation { addr: u64 },
    #[error("allocation #{id} at {addr:#x}: {saved} of {size} bytes saved")]
    Partly {
        id: u64,
        addr: u64,
        saved: u64,
        size: u64,
    },
    /// The job made an allocation after the round's listing, and the agent copied it too: its
    /// chunks are refused (they were not listed), and the round with them.
    #[error("allocation #{id} was made after the round's listing")]
    Unlisted { id: u64 },
}

/// What a round saved.
#[derive(Debug)]
pub struct PreCopyReport {
    pub pid: HostPid,
    pub nspid: NsPid,
    pub data: DumpData,
    /// Allocations whose data the round holds, and those it left to the final dump (the
    /// application's own mappings that are not movable, memory allocated during the round).
    pub allocations_saved: usize,
    pub allocations_left: usize,
    /// Whether a parent image was compared against, and why not where one was given.
    pub incremental: bool,
    pub parent_unused: Option<String>,
    pub seconds: f64,
}

/// Runs one pre-copy round of `pid` into `images` (created if missing), against `parent` if
/// given (the `parent` link is made as `criu dump --prev-images-dir` makes it: relative paths
/// are taken from `images`).
pub fn precopy(
    pid: HostPid,
    images: &Path,
    parent: Option<&Path>,
) -> Result<PreCopyReport, PreCopyError> {
    let t0 = Instant::now();
    let cfg = gpusnap_config::load()?;
    // Never beside a dump or `recover` of the same job (gpusnap_host::joblock).
    let _job_lock = gpusnap_host::joblock::JobLock::take(pid)?;
    let nspid = procfs::ns_pid(pid).map_err(|err| PreCopyError::Proc { pid, err })?;
    let api = crate::driver::api()?;
    api.init()?;
    let driver = (api.driver_version().unwrap_or(0), api.gpus()?);

    let dir = open_round_dir(images, nspid, parent)?;
    let session =
        AgentSession::connect(pid, cfg.agent_timeout())?.ok_or(PreCopyError::NoAgent { pid })?;
    session.hello_intact()?;
    let before = session.list()?;
    let (index, parent_unused) = match gpusnap_image::parent_for_dedup(dir.as_fd(), nspid, &before)
    {
        gpusnap_image::ParentImage::None => (None, None),
        _ if !cfg.incremental => (None, Some("incremental = false".to_owned())),
        gpusnap_image::ParentImage::Usable(i) => (Some(i), None),
        gpusnap_image::ParentImage::Unusable(why) => (None, Some(why)),
    };
    let ring = RingShape::for_dump(
        cfg.staging_slot_bytes(),
        cfg.staging_slots as usize,
        before.iter().filter(|a| a.moved).map(|a| a.size),
    );
    let staging = Staging::new(ring.slot_size, ring.slots).map_err(DataError::Ring)?;
    let copied = datapath::copy_out(
        &session,
        &staging,
        dir.as_fd(),
        nspid,
        cfg.effective_writer_threads(),
        codec_for(&cfg, dir.as_fd()).0,
        index.as_ref(),
        limits_of(&cfg),
        cfg.durable,
        Round::Live,
    );
    drop(session);
    // A live round races the program: an allocation made after the listing is refused by the
    // data path, and the round is one to run again, like any other change during it.
    let copied = copied.map_err(|e| match e {
        DataError::Chunk {
            id,
            fault: crate::datapath::ChunkFault::NotListed,
            ..
        } => PreCopyError::Changed(Spoilt::Unlisted { id }),
        e => PreCopyError::from(e),
    });
    let written = copied.and_then(|data| {
        // The agent ended the connection with the round; what it holds now says which
        // allocations the chunks belong to (some may have been made after the first list). An
        // application mapping caught between its unmap and map again lists as left to the
        // driver: ask again a few times before calling the round spoilt.
        let mut tries = 0;
        let allocations = loop {
            let after = AgentSession::connect(pid, cfg.agent_timeout())?
                .ok_or(PreCopyError::NoAgent { pid })?
                .list()?;
            match saved_allocations(after, &data.chunks) {
                Ok(a) => break a,
                Err(_) if tries < 5 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(why) => return Err(PreCopyError::Changed(why)),
            }
        };
        let mut m = crate::dump::manifest_of(
            nspid,
            CheckpointPath::Split,
            (driver.0, &driver.1),
            allocations,
            &data,
        );
        m.timings_s
            .insert("precopy".into(), t0.elapsed().as_secs_f64());
        gpusnap_image::write_manifest(dir.as_fd(), &m).map_err(PreCopyError::Manifest)?;
        if cfg.durable {
            gpusnap_image::sync_dir(dir.as_fd()).map_err(PreCopyError::Manifest)?;
        }
        Ok((data, m.allocations))
    });
    let (data, allocations) = match written {
        Ok(w) => w,
        Err(e) => {
            if let Err(r) = gpusnap_image::remove_process_files(dir.as_fd(), nspid) {
                log::warn!("removing the round's partial files: {r}");
            }
            return Err(e);
        }
    };
    let saved = allocations.iter().filter(|a| a.moved).count();
    Ok(PreCopyReport {
        pid,
        nspid,
        allocations_saved: saved,
        allocations_left: allocations.len() - saved,
        incremental: index.is_some(),
        parent_unused,
        data,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Opens (creating it if needed) the round's directory, locked for this round (`flock` on the
/// directory, held as long as the returned descriptor: a second round into it is refused,
/// naming the first), refusing one that already holds an image of `nspid`, and makes its
/// `parent` link.
fn open_round_dir(
    images: &Path,
    nspid: NsPid,
    parent: Option<&Path>,
) -> Result<OwnedFd, PreCopyError> {
    let at = |err| PreCopyError::ImageDir {
        dir: images.to_owned(),
        err,
    };
    fs::create_dir_all(images).map_err(at)?;
    let dir: OwnedFd = fs::File::open(images).map_err(at)?.into();
    lock_round_dir(&dir, images)?;
    let ours = gpusnap_image::list_image_files(dir.as_fd())
        .map_err(|err| PreCopyError::ListImages {
            dir: images.to_owned(),
            err,
        })?
        .iter()
        .any(|(kind, _)| kind.nspid() == Some(nspid));
    if ours {
        return Err(PreCopyError::NotEmpty {
            dir: images.to_owned(),
            nspid,
        });
    }
    if let Some(wanted) = parent {
        let link = images.join(PARENT_LINK);
        match fs::read_link(&link) {
            Ok(found) if found == wanted => {}
            Ok(found) => {
                return Err(PreCopyError::OtherParent {
                    dir: images.to_owned(),
                    found,
                    wanted: wanted.to_owned(),
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::os::unix::fs::symlink(wanted, &link).map_err(at)?;
            }
            Err(e) => return Err(at(e)),
        }
    }
    Ok(dir)
}

/// Takes the round's lock on `dir` without waiting; a lock held by another round is
/// [`PreCopyError::Busy`], naming its holder as `/proc/locks` does.
fn lock_round_dir(dir: &OwnedFd, images: &Path) -> Result<(), PreCopyError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    loop {
        // SAFETY: flock(2) on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => {
                let holder = fs::metadata(images)
                    .ok()
                    .and_then(|m| procfs::flock_holder(m.dev(), m.ino()).ok().flatten());
                return Err(PreCopyError::Busy {
                    dir: images.to_owned(),
                    holder,
                });
            }
            _ => {
                return Err(PreCopyError::ImageDir {
                    dir: images.to_owned(),
                    err,
                });
            }
        }
    }
}

/// The manifest's allocations: every allocation the agent lists after the round, marked moved
/// where the round's chunks cover it exactly, left (not moved) where it has none. Any other
/// case (a chunk outside every allocation, or an allocation covered in part) means allocations
/// were freed or replaced during the round.
fn saved_allocations(
    mut listed: Vec<AllocationRecord>,
    chunks: &[ChunkEntry],
) -> Result<Vec<AllocationRecord>, Spoilt> {
    listed.sort_by_key(|a| a.addr);
    let mut covered = vec![0u64; listed.len()];
    for c in chunks {
        let k = listed.partition_point(|a| a.addr <= c.addr);
        let inside = k.checked_sub(1).filter(|&i| {
            let a = &listed[i];
            a.moved && c.addr.saturating_add(c.len) <= a.addr.saturating_add(a.size)
        });
        let Some(i) = inside else {
            return Err(Spoilt::NoAllocation { addr: c.addr });
        };
        covered[i] += c.len;
    }
    for (a, &sum) in listed.iter_mut().zip(&covered) {
        if sum == 0 {
            a.moved = false;
        } else if sum != a.size {
            return Err(Spoilt::Partly {
                id: a.id,
                addr: a.addr,
                saved: sum,
                size: a.size,
            });
        }
    }
    Ok(listed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(id: u64, addr: u64, size: u64, moved: bool) -> AllocationRecord {
        AllocationRecord {
            id,
            device: 0,
            addr,
            size,
            moved,
            lent: false,
            rdma_capable: false,
        }
    }

    #[test]
    fn allocations_are_saved_whole_or_left() {
        let chunks = vec![
            ChunkEntry::zero(0x1000_0000, 1 << 20, 0),
            ChunkEntry::zero(0x1010_0000, 1 << 20, 0),
        ];
        let listed = vec![
            alloc(2, 0x2000_0000, 1 << 20, true),
            alloc(1, 0x1000_0000, 2 << 20, true),
            alloc(3, 0x3000_0000, 4096, false),
        ];
        let got = saved_allocations(listed, &chunks).unwrap();
        let moved: Vec<(u64, bool)> = got.iter().map(|a| (a.id, a.moved)).collect();
        assert_eq!(moved, vec![(1, true), (2, false), (3, false)]);

        // Covered in part: it was freed and replaced during the round.
        let listed = vec![alloc(1, 0x1000_0000, 4 << 20, true)];
        let e = saved_allocations(listed, &chunks).unwrap_err();
        assert_eq!(
            e,
            Spoilt::Partly {
                id: 1,
                addr: 0x1000_0000,
                saved: 2 << 20,
                size: 4 << 20
            }
        );
        assert!(e.to_string().contains("2097152 of 4194304 bytes"), "{e}");
        // A chunk in no allocation held now.
        let e = saved_allocations(vec![alloc(5, 0x1010_0000, 1 << 20, true)], &chunks).unwrap_err();
        assert_eq!(e, Spoilt::NoAllocation { addr: 0x1000_0000 });
        // A chunk in an allocation now left to the driver.
        let e =
            saved_allocations(vec![alloc(1, 0x1000_0000, 2 << 20, false)], &chunks).unwrap_err();
        assert!(matches!(e, Spoilt::NoAllocation { .. }), "{e}");
    }

    /// Two rounds into one directory: the second is refused while the first holds it, naming
    /// the first; once the first is done (its descriptor closed) the directory opens again.
    #[test]
    fn a_second_round_into_one_directory_is_refused() {
        let d = std::env::temp_dir().join(format!("gpusnap-precopy-lock-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        let first = open_round_dir(&d, NsPid(7), None).unwrap();
        let e = open_round_dir(&d, NsPid(8), None).unwrap_err();
        match &e {
            PreCopyError::Busy { dir, holder } => {
                assert_eq!(dir, &d);
                assert_eq!(
                    holder.map(HostPid::get),
                    Some(std::process::id() as i32),
                    "{e}"
                );
            }
            other => panic!("not refused as busy: {other}"),
        }
        assert!(
            e.to_string().contains("another gpusnap precopy (pid "),
            "{e}"
        );
        drop(first);
        drop(open_round_dir(&d, NsPid(8), None).unwrap());
        let _ = fs::remove_dir_all(&d);
    }
}
