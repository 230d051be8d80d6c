//! Incremental images: chunks whose bytes live in an ancestor image, reached through CRIU's
//! `parent` link (`criu dump --prev-images-dir`).
//!
//! A chunk entry with `parent_depth = d > 0` says: the stored bytes are in data file `file` of
//! the image directory `d` `parent` links up, at `file_offset`, where that image's manifest
//! records the same chunk with depth 0. References are always flattened to the image that
//! holds the bytes, so a reader opens one ancestor per depth and never follows an ancestor's
//! own references.
//!
//! The only name ever followed out of an image directory is the literal `parent`; it must be a
//! directory, the walk is at most [`MAX_CHAIN_DEPTH`] links long, and a directory met twice is a
//! loop. Every ancestor's manifest and data-file headers are checked (as [`crate::read_manifest`]
//! checks an image's own), and every reference must match the ancestor's record of the chunk
//! field for field, before any byte is trusted.

use gpusnap_proto::pid::NsPid;
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;

use crate::manifest::{
    check_for_write, encode_manifest_unchecked, read_manifest_local, write_manifest_bytes,
};
use crate::validate::validate_structure;
use crate::{
    AllocationRecord, CheckpointPath, ChunkEntry, ChunkHashes, DataFileReader, ImageError, IoOp,
    Manifest, manifest_file_name, sys,
};

/// Longest chain of `parent` links a reference may cross. A dump whose parent's chunk is
/// already this deep stores the chunk again instead of referencing it.
pub const MAX_CHAIN_DEPTH: u32 = 8;

/// The one name followed out of an image directory: CRIU's link to the previous image.
pub const PARENT_LINK: &str = "parent";

/// `parent`, `parent/parent`, ... for `depth` links.
fn chain_path(depth: u32) -> String {
    vec![PARENT_LINK; depth as usize].join("/")
}

/// (device, inode) of an open directory, to recognise a loop.
fn dir_id(f: &File, path: &str) -> Result<(u64, u64), ImageError> {
    let m = f
        .metadata()
        .map_err(|e| ImageError::io(path, IoOp::Fstat, e))?;
    Ok((m.dev(), m.ino()))
}

/// Opens `dir`'s `parent` link as a directory; `Ok(None)` if `dir` has no entry of that name.
/// `path` names the link in messages (`parent`, `parent/parent`, ...).
pub fn open_parent_dir(dir: BorrowedFd<'_>, path: &str) -> Result<Option<File>, ImageError> {
    let shown = || match sys::read_link_at(dir, PARENT_LINK) {
        Some(target) => format!("{path} (-> {target})"),
        None => path.to_owned(),
    };
    match sys::open_dir_follow(dir, PARENT_LINK) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            if sys::read_link_at(dir, PARENT_LINK).is_some() {
                Err(ImageError::ParentLink {
                    path: shown(),
                    detail: "the parent image directory does not exist (moved or deleted?)".into(),
                })
            } else {
                Ok(None)
            }
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => Err(ImageError::ParentLink {
            path: shown(),
            detail: "not a directory".into(),
        }),
        Err(e) => Err(ImageError::io(&shown(), IoOp::Open, e)),
    }
}

/// One ancestor image: its directory and its manifest of the same process.
#[derive(Debug)]
struct Ancestor {
    dir: File,
    path: String,
    manifest: Manifest,
    /// (file, file_offset) → position in `manifest.chunks`, for its depth-0 chunks.
    stored: HashMap<(u32, u64), usize>,
}

/// The ancestor images a manifest references, opened and checked; `levels[d - 1]` is depth `d`.
#[derive(Debug, Default)]
pub struct Ancestors {
    levels: Vec<Ancestor>,
}

impl Ancestors {
    /// How many `parent` links deep the references go (0: none).
    pub fn depth(&self) -> u32 {
        self.levels.len() as u32
    }

    /// The manifest of the ancestor `depth` links up (`1..=self.depth()`).
    pub fn manifest(&self, depth: u32) -> Option<&Manifest> {
        Some(&self.level(depth)?.manifest)
    }

    fn level(&self, depth: u32) -> Option<&Ancestor> {
        self.levels.get((depth as usize).checked_sub(1)?)
    }
}

/// Opens and checks every ancestor that `m` references: follows `parent` as deep as the deepest
/// reference, reads each ancestor's manifest of the same process (header, checksum, structure,
/// data files' existence, sizes and headers), and checks that each reference matches, field for
/// field, a chunk that the ancestor stores itself. Reads no chunk payloads.
pub fn open_ancestors(dir: BorrowedFd<'_>, m: &Manifest) -> Result<Ancestors, ImageError> {
    let mf = manifest_file_name(m.nspid);
    let need = m.chunks.iter().map(|c| c.parent_depth).max().unwrap_or(0);
    if need == 0 {
        return Ok(Ancestors::default());
    }
    if need > MAX_CHAIN_DEPTH {
        return Err(ImageError::InvalidManifest {
            file: mf,
            detail: format!(
                "references reach {need} parent links up; the limit is {MAX_CHAIN_DEPTH}"
            ),
        });
    }
    let top = sys::open_dir_follow(dir, ".").map_err(|e| ImageError::io(".", IoOp::Open, e))?;
    let mut seen = vec![dir_id(&top, ".")?];
    let mut levels: Vec<Ancestor> = Vec::with_capacity(need as usize);
    for depth in 1..=need {
        let path = chain_path(depth);
        let below = levels.last().map_or(dir, |a| a.dir.as_fd());
        let pdir = open_parent_dir(below, &path)?.ok_or_else(|| ImageError::ParentLink {
            path: path.clone(),
            detail: format!(
                "missing: {mf} references data {need} parent link(s) up (an incremental dump, \
                 criu dump --prev-images-dir); that image must stay in place for a restore"
            ),
        })?;
        let id = dir_id(&pdir, &path)?;
        if seen.contains(&id) {
            return Err(ImageError::ParentLink {
                path,
                detail: "loop: leads back to an image directory already in the chain".into(),
            });
        }
        seen.push(id);
        let manifest =
            read_manifest_local(pdir.as_fd(), m.nspid).map_err(|e| e.in_parent(&path))?;
        if manifest.path != CheckpointPath::Split {
            return Err(ImageError::InvalidManifest {
                file: manifest_file_name(m.nspid),
                detail: "a transparent-path image holds no data to reference".into(),
            }
            .in_parent(&path));
        }
        let stored = manifest
            .chunks
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_stored() && !c.is_reference())
            .map(|(i, c)| ((c.file, c.file_offset), i))
            .collect();
        levels.push(Ancestor {
            dir: pdir,
            path,
            manifest,
            stored,
        });
    }
    for (i, c) in m
        .chunks
        .iter()
        .enumerate()
        .filter(|(_, c)| c.is_reference())
    {
        let bad = |detail: String| ImageError::BadReference {
            file: mf.clone(),
            chunk: i,
            depth: c.parent_depth,
            detail,
        };
        let a = &levels[c.parent_depth as usize - 1];
        let Some(&k) = a.stored.get(&(c.file, c.file_offset)) else {
            return Err(bad(format!(
                "{}/{} stores no chunk at offset {} of data file {}",
                a.path, mf, c.file_offset, c.file
            )));
        };
        if !a.manifest.chunks[k].same_stored_chunk(c) {
            return Err(bad(format!(
                "{}/{} records chunk {k} there with other contents",
                a.path, mf
            )));
        }
    }
    Ok(Ancestors { levels })
}

/// Where the chunks of one manifest are read from: its own data files (depth 0) and, for
/// references, the data files of its ancestors.
#[derive(Debug)]
pub struct ChunkSources<'a> {
    dir: BorrowedFd<'a>,
    manifest: &'a Manifest,
    ancestors: Ancestors,
}

impl<'a> ChunkSources<'a> {
    /// Checks `m`'s structure and opens and checks its ancestors ([`open_ancestors`]).
    pub fn open(dir: BorrowedFd<'a>, m: &'a Manifest) -> Result<Self, ImageError> {
        validate_structure(m, &manifest_file_name(m.nspid))?;
        let ancestors = open_ancestors(dir, m)?;
        Ok(ChunkSources {
            dir,
            manifest: m,
            ancestors,
        })
    }

    pub fn manifest(&self) -> &Manifest {
        self.manifest
    }

    pub fn ancestors(&self) -> &Ancestors {
        &self.ancestors
    }

    /// Every (depth, data-file index) that holds chunks of the manifest, ascending.
    pub fn groups(&self) -> Vec<(u32, u32)> {
        let set: BTreeSet<(u32, u32)> = self
            .manifest
            .chunks
            .iter()
            .filter(|c| c.is_stored())
            .map(|c| (c.parent_depth, c.file))
            .collect();
        set.into_iter().collect()
    }

    /// The manifest's chunks stored in data file `file` at `depth`, as (position in the
    /// manifest, entry), in file order.
    pub fn chunks(&self, depth: u32, file: u32) -> Vec<(usize, &'a ChunkEntry)> {
        let mut v: Vec<(usize, &ChunkEntry)> = self
            .manifest
            .chunks
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_stored() && c.parent_depth == depth && c.file == file)
            .collect();
        v.sort_by_key(|(_, c)| c.file_offset);
        v
    }

    /// Opens data file `file` at `depth` (0: this image). An ancestor's reader checks chunks
    /// against the ancestor's manifest and names its file with the `parent/` path in front.
    pub fn reader(&self, depth: u32, file: u32) -> Result<DataFileReader, ImageError> {
        if depth == 0 {
            return DataFileReader::open(self.dir, self.manifest, file);
        }
        let Some(a) = self.ancestors.level(depth) else {
            return Err(ImageError::ParentLink {
                path: chain_path(depth),
                detail: "not opened (no chunk references it)".into(),
            });
        };
        let mut r = DataFileReader::open(a.dir.as_fd(), &a.manifest, file)
            .map_err(|e| e.in_parent(&a.path))?;
        r.set_path_prefix(&a.path);
        Ok(r)
    }
}

/// What an incremental dump may reference: the chunks of the parent image, by device range.
#[derive(Debug)]
pub struct DedupIndex {
    /// (addr, len) → (XXH3-128 of the device bytes, the entry to store: depth already + 1).
    by_range: HashMap<(u64, u64), (u128, ChunkEntry)>,
    /// (addr, len) → (device hash, the entry to store), for parent chunks that have one: what
    /// the agent compares on the GPU, so that unchanged chunks are never copied off it.
    by_device_hash: HashMap<(u64, u64), (u64, ChunkEntry)>,
    /// Parent chunks that are already [`MAX_CHAIN_DEPTH`] deep, so cannot be referenced.
    pub too_deep: usize,
}

impl DedupIndex {
    /// The reference to record instead of writing a chunk of `len` bytes at `addr` whose hashes
    /// are `h`, if the parent chain holds exactly these bytes there; `None`: write it.
    pub fn reference(&self, addr: u64, len: u64, h: &ChunkHashes) -> Option<ChunkEntry> {
        match self.by_range.get(&(addr, len)) {
            Some((hash, entry)) if *hash == h.xxh3_128 => Some(entry.clone()),
            _ => None,
        }
    }

    /// Every referencable parent chunk with a device hash, as (addr, len, device hash).
    pub fn device_hashes(&self) -> Vec<(u64, u64, u64)> {
        let mut v: Vec<_> = self
            .by_device_hash
            .iter()
            .map(|(&(a, l), (h, _))| (a, l, *h))
            .collect();
        v.sort_unstable();
        v
    }

    /// The reference to record for a chunk the agent found unchanged on the GPU: the parent
    /// chain's chunk of this range and device hash. `None`: the parent has no such chunk (the
    /// agent's claim is then wrong, and nothing may be referenced).
    pub fn reference_by_device_hash(&self, addr: u64, len: u64, hash: u64) -> Option<ChunkEntry> {
        match self.by_device_hash.get(&(addr, len)) {
            Some((h, entry)) if *h == hash => Some(entry.clone()),
            _ => None,
        }
    }

    /// How many parent chunks can be referenced, by either hash.
    pub fn len(&self) -> usize {
        let only_device = self
            .by_device_hash
            .keys()
            .filter(|k| !self.by_range.contains_key(k))
            .count();
        self.by_range.len() + only_device
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a chunk at this range is worth hashing on the host to compare with the parent:
    /// the parent holds one there that only a host hash can match (it has no device hash).
    pub fn wants_host_compare(&self, addr: u64, len: u64) -> bool {
        self.by_range.contains_key(&(addr, len)) && !self.by_device_hash.contains_key(&(addr, len))
    }
}

/// Whether a dump into `dir` can be incremental.
#[derive(Debug)]
pub enum ParentImage {
    /// `dir` has no `parent` link: a full dump.
    None,
    /// There is a parent, but it cannot be used for this process (the reason, for the log): a
    /// full dump.
    Unusable(String),
    /// The parent image of the same process with the same allocations.
    Usable(DedupIndex),
}

fn moved_set(allocs: &[AllocationRecord]) -> Vec<(u64, u64, u32)> {
    let mut v: Vec<_> = allocs
        .iter()
        .filter(|a| a.moved)
        .map(|a| (a.addr, a.size, a.device))
        .collect();
    v.sort_unstable();
    v
}

/// Reads every chunk of the parent image of process `nspid` (behind `dir`'s `parent` link, its
/// own ancestors included) and checks it, as a restore would: an incremental dump references
/// the parent's bytes, so it must not trust a parent it has not read. `Ok(None)`: no parent.
pub fn verify_parent(
    dir: BorrowedFd<'_>,
    nspid: NsPid,
    threads: usize,
) -> Result<Option<crate::VerifyReport>, ImageError> {
    let Some(pdir) = open_parent_dir(dir, PARENT_LINK)? else {
        return Ok(None);
    };
    let m = crate::read_manifest(pdir.as_fd(), nspid).map_err(|e| e.in_parent(PARENT_LINK))?;
    crate::verify_image(pdir.as_fd(), &m, threads)
        .map(Some)
        .map_err(|e| e.in_parent(PARENT_LINK))
}

/// For a dump of process `nspid` into `dir`, whose agent holds `allocations`: the parent
/// image's chunks that it may reference. The parent is read as a restore would read it
/// (`read_manifest`, its own ancestors included), so a reference is only ever made to data
/// that a reader accepts. It must be a split-path image of version 2 or later (version 3 adds
/// device hashes, compared on the GPU) for the same process; only chunks of the moved
/// allocations both hold alike (address, size, device) are offered, and at least one must be.
pub fn parent_for_dedup(
    dir: BorrowedFd<'_>,
    nspid: NsPid,
    allocations: &[AllocationRecord],
) -> ParentImage {
    let pdir = match open_parent_dir(dir, PARENT_LINK) {
        Ok(Some(d)) => d,
        Ok(None) => return ParentImage::None,
        Err(e) => return ParentImage::Unusable(e.to_string()),
    };
    let ids =
        sys::open_dir_follow(dir, ".").and_then(|top| Ok((top.metadata()?, pdir.metadata()?)));
    match ids {
        Ok((a, b)) if (a.dev(), a.ino()) == (b.dev(), b.ino()) => {
            return ParentImage::Unusable(
                "parent: loop: the link leads back to this image directory".into(),
            );
        }
        Ok(_) => {}
        Err(e) => return ParentImage::Unusable(format!("parent: {e}")),
    }
    let m = match crate::read_manifest(pdir.as_fd(), nspid) {
        Ok(m) => m,
        Err(ImageError::MissingFile { file }) if file == manifest_file_name(nspid) => {
            return ParentImage::Unusable(format!(
                "parent/{file}: missing (the process was not dumped there on the split path)"
            ));
        }
        Err(e) => return ParentImage::Unusable(e.in_parent(PARENT_LINK).to_string()),
    };
    if m.path != CheckpointPath::Split {
        return ParentImage::Unusable("the parent image took the transparent path".into());
    }
    if m.format_version < 2 {
        return ParentImage::Unusable(format!(
            "the parent image is format version {} (no content hashes to compare)",
            m.format_version
        ));
    }
    // Only chunks of allocations the process still holds as they were (same address, size and
    // device) may be referenced: an allocation that grew, moved or was replaced is stored anew.
    let now = moved_set(allocations);
    let common: Vec<(u64, u64, u32)> = moved_set(&m.allocations)
        .into_iter()
        .filter(|a| now.binary_search(a).is_ok())
        .collect();
    if common.is_empty() {
        return ParentImage::Unusable(
            "the process's allocations differ from the parent image's (address, size, device): none in common"
                .into(),
        );
    }
    let in_common = |addr: u64, len: u64| {
        let k = common.partition_point(|&(a, _, _)| a <= addr);
        k.checked_sub(1)
            .map(|k| common[k])
            .is_some_and(|(a, size, _)| addr.saturating_add(len) <= a.saturating_add(size))
    };
    let mut index = DedupIndex {
        by_range: HashMap::with_capacity(m.chunks.len()),
        by_device_hash: HashMap::with_capacity(m.chunks.len()),
        too_deep: 0,
    };
    for c in m.chunks {
        if !in_common(c.addr, c.len) {
            continue;
        }
        if c.parent_depth >= MAX_CHAIN_DEPTH {
            index.too_deep += 1;
            continue;
        }
        // Zero chunks are never referenced: a dump finds them again.
        if !c.is_stored() {
            continue;
        }
        let content = c
            .content_xxh128
            .as_deref()
            .and_then(|h| u128::from_str_radix(h, 16).ok());
        let entry = ChunkEntry {
            parent_depth: c.parent_depth + 1,
            ..c
        };
        if let Some(d) = entry.device_hash {
            index
                .by_device_hash
                .insert((entry.addr, entry.len), (d, entry.clone()));
        }
        // A `raw_sum64` chunk has no content hash: it can only be matched on the GPU.
        if let Some(hash) = content {
            index
                .by_range
                .insert((entry.addr, entry.len), (hash, entry));
        }
    }
    ParentImage::Usable(index)
}

/// Reads, checks and returns the manifest of process `nspid`. Validates everything that can be
/// checked without reading chunk data (see `docs/image-format.md`, "What readers refuse"): the
/// header line, checksum, version, JSON schema, every name, every data file's existence, exact
/// size and header, every chunk's bounds, overlaps, allocations and sums; and, if chunks
/// reference ancestor images, the `parent` chain, each ancestor's manifest and data files as
/// above, and that every reference matches the ancestor's own record of the chunk.
pub fn read_manifest(dir: BorrowedFd<'_>, nspid: NsPid) -> Result<Manifest, ImageError> {
    let m = read_manifest_local(dir, nspid)?;
    open_ancestors(dir, &m)?;
    Ok(m)
}

/// Writes `m` as `gpusnap-<nspid>-manifest.img`, after checking it as [`read_manifest`] would
/// (data files and referenced ancestors included), so a manifest that a restore would refuse
/// is never written. Atomic: written to `gpusnap-<nspid>-manifest.img.tmp`, fsynced, then
/// renamed over the final name.
pub fn write_manifest(dir: BorrowedFd<'_>, m: &Manifest) -> Result<(), ImageError> {
    check_for_write(dir, m)?;
    open_ancestors(dir, m)?;
    write_manifest_bytes(dir, m.nspid, &encode_manifest_unchecked(m))
}
