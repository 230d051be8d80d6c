//! File names in the image directory, and listing them.
//!
//! Only the exact forms below are gpusnap's; anything else in CRIU's image directory is ignored.
//! Numbers are canonical decimal (no sign, no leading zeros), so a name maps to one process.

use std::os::fd::BorrowedFd;

use crate::sys;
use crate::{ImageError, IoOp};
use gpusnap_proto::pid::{HostPid, NsPid};

/// Name of the optional stats file that the plugin leaves next to the images.
pub const STATS_FILE_NAME: &str = "gpusnap-stats.json";
pub(crate) const STATS_TMP_NAME: &str = "gpusnap-stats.json.tmp";

/// `gpusnap-<nspid>-data-<index>.img`
pub fn data_file_name(nspid: NsPid, index: u32) -> String {
    format!("gpusnap-{nspid}-data-{index}.img")
}

/// `gpusnap-<nspid>-manifest.img`
pub fn manifest_file_name(nspid: NsPid) -> String {
    format!("gpusnap-{nspid}-manifest.img")
}

/// `gpusnap-<nspid>-manifest.img.tmp`: the manifest before its atomic rename.
pub fn manifest_tmp_name(nspid: NsPid) -> String {
    format!("gpusnap-{nspid}-manifest.img.tmp")
}

/// `gpusnap-<nspid>-NOT-A-CHECKPOINT.txt`: left by a dump whose GPU data was lost after CRIU
/// had decided its own part succeeded (CRIU then reports success); it says why, in words.
/// Like any gpusnap file of a process without a manifest, it makes every tool refuse the
/// directory as an unfinished dump.
pub fn failed_marker_name(nspid: NsPid) -> String {
    format!("gpusnap-{nspid}-NOT-A-CHECKPOINT.txt")
}

/// `gpusnap-<nspid>-PENDING.txt`: an asynchronous `criu dump -R` (`async_leave_running`) let
/// CRIU return before this process's GPU data was in the image; a process gpusnap left behind
/// writes it and removes this file only after the manifest is in place (or replaces it with the
/// NOT-A-CHECKPOINT marker). While it exists every tool refuses the directory as unfinished,
/// naming it, even next to a manifest; `gpusnap wait` waits for it to go.
pub fn pending_marker_name(nspid: NsPid) -> String {
    format!("gpusnap-{nspid}-PENDING.txt")
}

/// The text of a PENDING marker: who writes the data (the process `pid` that started at
/// `start`, in clock ticks since boot, `/proc/<pid>/stat` field 22), then words for people.
/// `gpusnap wait` reads the owner back ([`pending_owner`]): a marker whose owner is gone will
/// never be removed, and the image is then a failed one.
pub fn pending_text(pid: HostPid, start: u64, words: &str) -> String {
    format!("owner: {pid} {start}\n{words}\n")
}

/// The owner a PENDING marker names ([`pending_text`]): `(pid, start time)`.
pub fn pending_owner(text: &str) -> Option<(HostPid, u64)> {
    let line = text.lines().next()?.strip_prefix("owner: ")?;
    let (pid, start) = line.split_once(' ')?;
    Some((HostPid(pid.parse().ok()?), start.parse().ok()?))
}

/// What a gpusnap file name denotes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ImageFileKind {
    Manifest {
        nspid: NsPid,
    },
    /// A manifest whose write did not complete (the dump failed or was interrupted).
    ManifestTmp {
        nspid: NsPid,
    },
    Data {
        nspid: NsPid,
        index: u32,
    },
    /// The KFD state of an AMD process (`gpusnap-<nspid>-kfd.img`, [`crate::KfdState`]).
    Kfd {
        nspid: NsPid,
    },
    /// [`failed_marker_name`]: this process's dump failed after CRIU's part.
    Failed {
        nspid: NsPid,
    },
    /// [`pending_marker_name`]: this process's data is still being written after CRIU returned.
    Pending {
        nspid: NsPid,
    },
    Stats,
    StatsTmp,
}

impl ImageFileKind {
    /// The process the file belongs to, if it belongs to one.
    pub fn nspid(self) -> Option<NsPid> {
        match self {
            ImageFileKind::Manifest { nspid }
            | ImageFileKind::ManifestTmp { nspid }
            | ImageFileKind::Data { nspid, .. }
            | ImageFileKind::Kfd { nspid }
            | ImageFileKind::Failed { nspid }
            | ImageFileKind::Pending { nspid } => Some(nspid),
            ImageFileKind::Stats | ImageFileKind::StatsTmp => None,
        }
    }
}

/// A canonical decimal u32: digits only, no leading zero unless the number is 0.
pub(crate) fn canonical_u32(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0'))
    {
        return None;
    }
    s.parse().ok()
}

/// Classifies `name`; `None` if it is not exactly one of gpusnap's names.
pub fn parse_file_name(name: &str) -> Option<ImageFileKind> {
    match name {
        STATS_FILE_NAME => return Some(ImageFileKind::Stats),
        STATS_TMP_NAME => return Some(ImageFileKind::StatsTmp),
        _ => {}
    }
    let rest = name.strip_prefix("gpusnap-")?;
    let (pid, rest) = rest.split_once('-')?;
    let nspid = NsPid(canonical_u32(pid)?);
    match rest {
        "manifest.img" => Some(ImageFileKind::Manifest { nspid }),
        "manifest.img.tmp" => Some(ImageFileKind::ManifestTmp { nspid }),
        "kfd.img" => Some(ImageFileKind::Kfd { nspid }),
        "NOT-A-CHECKPOINT.txt" => Some(ImageFileKind::Failed { nspid }),
        "PENDING.txt" => Some(ImageFileKind::Pending { nspid }),
        _ => {
            let index = canonical_u32(rest.strip_prefix("data-")?.strip_suffix(".img")?)?;
            Some(ImageFileKind::Data { nspid, index })
        }
    }
}

/// Every gpusnap file in `dir`, sorted by kind (manifests first), then process, then index.
pub fn list_image_files(dir: BorrowedFd<'_>) -> Result<Vec<(ImageFileKind, String)>, ImageError> {
    let names = sys::list_dir(dir).map_err(|e| ImageError::io(".", IoOp::Readdir, e))?;
    let mut files: Vec<_> = names
        .into_iter()
        .filter_map(|n| parse_file_name(&n).map(|k| (k, n)))
        .collect();
    files.sort();
    Ok(files)
}

/// The processes (namespace pids) that have a manifest in `dir`, ascending.
pub fn list_manifests(dir: BorrowedFd<'_>) -> Result<Vec<NsPid>, ImageError> {
    Ok(list_image_files(dir)?
        .into_iter()
        .filter_map(|(k, _)| match k {
            ImageFileKind::Manifest { nspid } => Some(nspid),
            _ => None,
        })
        .collect())
}

/// The processes that have gpusnap files but no manifest (their dump did not finish: data files
/// written before the manifest, or a manifest left under its temporary name), ascending, each
/// with the first such file's name. A temporary manifest next to a manifest is not one of them:
/// that is a rewrite of a complete manifest that did not finish, and the manifest stands. A
/// PENDING marker counts whatever else is there (the manifest may already be in place while the
/// marker is not yet removed), and is the name given for its process.
pub fn unfinished_dumps(dir: BorrowedFd<'_>) -> Result<Vec<(NsPid, String)>, ImageError> {
    let files = list_image_files(dir)?;
    let finished: Vec<NsPid> = files
        .iter()
        .filter_map(|(k, _)| match k {
            ImageFileKind::Manifest { nspid } => Some(*nspid),
            _ => None,
        })
        .collect();
    let mut out: Vec<(NsPid, String)> = files
        .iter()
        .filter_map(|(k, name)| match k {
            ImageFileKind::Pending { nspid } => Some((*nspid, name.clone())),
            _ => None,
        })
        .collect();
    for (kind, name) in files {
        let nspid = match kind {
            ImageFileKind::ManifestTmp { nspid }
            | ImageFileKind::Data { nspid, .. }
            | ImageFileKind::Kfd { nspid }
            | ImageFileKind::Failed { nspid } => nspid,
            _ => continue,
        };
        if !finished.contains(&nspid) && !out.iter().any(|(p, _)| *p == nspid) {
            out.push((nspid, name));
        }
    }
    out.sort();
    Ok(out)
}

/// Every manifest of the image directory, each read and checked as [`crate::read_manifest`]
/// does, keyed by namespace pid. Refuses the whole directory first if any process's dump did
/// not finish ([`unfinished_dumps`], [`ImageError::UnfinishedDump`]): an image cut short is
/// refused, never restored in part. What a restore reads before it touches anything.
pub fn read_manifests(
    dir: BorrowedFd<'_>,
) -> Result<std::collections::BTreeMap<NsPid, crate::Manifest>, ImageError> {
    if let Some((nspid, file)) = unfinished_dumps(dir)?.into_iter().next() {
        if let Some(ImageFileKind::Pending { .. }) = parse_file_name(&file) {
            return Err(ImageError::PendingDump { file, nspid });
        }
        return Err(ImageError::UnfinishedDump {
            file,
            nspid,
            manifest: manifest_file_name(nspid),
        });
    }
    list_manifests(dir)?
        .into_iter()
        .map(|nspid| Ok((nspid, crate::read_manifest(dir, nspid)?)))
        .collect()
}

/// Removes every file of process `nspid` (manifest first, so that an interrupted removal never
/// leaves a manifest pointing at missing data). Returns how many files were removed. For the
/// plugin's rollback and for clearing a stale image before a new dump.
pub fn remove_process_files(dir: BorrowedFd<'_>, nspid: NsPid) -> Result<usize, ImageError> {
    let mut n = 0;
    for (kind, name) in list_image_files(dir)? {
        if kind.nspid() == Some(nspid) {
            sys::unlink_at(dir, &name, true).map_err(|e| ImageError::io(&name, IoOp::Unlink, e))?;
            n += 1;
        }
    }
    Ok(n)
}

/// Removes one data file of a dump that is still being written (a drain that copies again
/// what it wrote against a parent found damaged). Only a data file's name is taken.
pub fn remove_data_file(dir: BorrowedFd<'_>, name: &str) -> Result<(), ImageError> {
    match parse_file_name(name) {
        Some(ImageFileKind::Data { .. }) => {
            sys::unlink_at(dir, name, false).map_err(|e| ImageError::io(name, IoOp::Unlink, e))
        }
        _ => Err(ImageError::io(
            name,
            IoOp::Unlink,
            std::io::Error::from_raw_os_error(libc::EINVAL),
        )),
    }
}
