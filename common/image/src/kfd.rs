//! The AMD (KFD) parts of an image: what the kernel's CRIU interface needs back at restore,
//! beside the usual manifest and data files of a process checkpointed on the `kfd` path.
//!
//! - `gpusnap-<nspid>-kfd.img` ([`KfdState`]): the process's KFD checkpoint as
//!   `AMDKFD_IOC_CRIU_OP` CHECKPOINT returned it: its GPUs (with the topology facts a restore
//!   matches against), its buffer-object buckets, the count of opaque objects, and the kernel's
//!   private data. Written before the manifest, which stays the commit point.
//! - `gpusnap-kfdfile-<id>.img` ([`KfdFileRecord`]): one per `/dev/kfd` or render-node file
//!   CRIU handed to the plugin (`id`: CRIU's file id), saying which it is.
//!
//! Versions: 2 (written now) adds to the state the process's device mappings ([`KfdVmaRecord`]:
//! which buffer object each mapping of `/dev/kfd` or a render node shows, at which file offset)
//! and its highest fd number at dump. Version 1 records (no mappings) are still read: a version 1
//! state has no mapping list, and a process of such an image that maps a device is refused at
//! restore when CRIU asks for its mapping. Other versions are refused.
//!
//! Both are sealed the same way: one ASCII line `<MAGIC> 1 <body_len> <xxh3_64 hex>\n`, then
//! `body_len` bytes of compact JSON (unknown fields refused). The contents of the buffer objects
//! are not here: they are chunks of the data files, listed by the manifest like any moved
//! allocation (one allocation per VRAM/GTT buffer object).

use gpusnap_proto::pid::NsPid;
use std::io::Read;
use std::os::fd::BorrowedFd;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::manifest::atomic_write;
use crate::{CheckpointPath, ImageError, IoOp, Manifest, manifest_file_name, sys};

/// First word of `gpusnap-<nspid>-kfd.img`.
pub const KFD_STATE_MAGIC: &str = "GPUSNAP-KFD";
/// First word of `gpusnap-kfdfile-<id>.img`.
pub const KFD_FILE_MAGIC: &str = "GPUSNAP-KFDFILE";
/// The version of both records, as written.
pub const KFD_FORMAT_VERSION: u32 = 2;

/// Largest `max_fd` a KFD state may record (Linux's `nr_open` is at most 2^30).
pub const MAX_FD: u32 = 1 << 30;
/// The oldest version still read (no device mappings recorded).
pub const KFD_FORMAT_VERSION_MIN: u32 = 1;
/// Largest KFD state body accepted (the private data, hex-encoded, dominates): 256 MiB.
pub const MAX_KFD_STATE_BODY: u64 = 256 << 20;
/// Largest file record body accepted.
const MAX_KFD_FILE_BODY: u64 = 4096;
/// Most buffer objects and GPUs a state may list.
const MAX_BOS: usize = 1 << 20;
const MAX_GPUS: usize = 64;
/// Most device mappings a state may list.
const MAX_VMAS: usize = 1 << 20;
/// Longest GPU name.
const MAX_NAME: usize = 256;

/// A GPU the process used, as KFD numbered it at dump, with what a restore must match.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KfdGpuRecord {
    /// The gpu_id the process knows (`user_gpu_id` of the device bucket).
    pub gpu_id: u32,
    pub vendor_id: u32,
    pub device_id: u32,
    /// `gfx_target_version` of the topology (0 if absent).
    pub gfx_target_version: u32,
    pub simd_count: u32,
    /// VRAM of the GPU at dump, bytes.
    pub local_mem_bytes: u64,
    pub name: String,
    /// The render node minor the process's files referred to (0 if unknown).
    pub drm_render_minor: u32,
}

/// One buffer object bucket (`struct kfd_criu_bo_bucket` without the per-run fds).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KfdBoRecord {
    /// GPU virtual address.
    pub addr: u64,
    pub size: u64,
    /// mmap offset at dump.
    pub offset: u64,
    /// The user gpu_id of its GPU (one of [`KfdState::gpus`]).
    pub gpu_id: u32,
    /// `KFD_IOC_ALLOC_MEM_FLAGS_*`.
    pub alloc_flags: u32,
    /// The contents are in the data files (VRAM and GTT objects): the manifest lists an
    /// allocation at `addr` of `size` bytes, moved, on this GPU's ordinal.
    pub content: bool,
}

/// Which device file a mapping is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KfdVmaNode {
    /// The KFD device (`/dev/kfd`): doorbell and MMIO-remap pages.
    Kfd,
    /// A render node: CPU mappings of VRAM/GTT buffer objects.
    Render,
}

/// One device mapping of the process at dump: `[start, end)` of `node` at file offset `offset`
/// (bytes, as `/proc/<pid>/maps` and CRIU's VMA entry give it), showing bytes
/// `[offset - bo_offset, ...)` of buffer object `bo` (an index into [`KfdState::bos`], whose
/// `offset` is its mmap offset at dump). At restore the new offset is the BO's restored offset
/// plus the same distance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KfdVmaRecord {
    pub start: u64,
    pub end: u64,
    pub offset: u64,
    pub node: KfdVmaNode,
    /// Render node: its minor at dump (0 for `/dev/kfd`).
    pub render_minor: u32,
    pub bo: u32,
}

/// A process's KFD checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KfdState {
    pub format_version: u32,
    #[serde(with = "crate::manifest::nspid_number")]
    pub nspid: NsPid,
    /// The KFD ioctl interface version at dump, `[major, minor]`.
    pub kfd_version: [u32; 2],
    /// GPUs, in the order of the CHECKPOINT device buckets; the manifest's GPU ordinal of a
    /// GPU is its index here.
    pub gpus: Vec<KfdGpuRecord>,
    pub bos: Vec<KfdBoRecord>,
    /// Queues, events and SVM ranges (opaque).
    pub num_objects: u32,
    /// The kernel's private data, lowercase hex.
    pub priv_data: String,
    /// Version 2: the process's device mappings (empty in version 1).
    #[serde(default)]
    pub vmas: Vec<KfdVmaRecord>,
    /// Version 2: the highest fd number the process had at dump (0 if unknown, version 1).
    /// The restore keeps its own files above it, clear of the fds CRIU restores.
    #[serde(default)]
    pub max_fd: u32,
}

impl KfdState {
    /// The private data as bytes (its hex form is checked when read).
    pub fn priv_data_bytes(&self) -> Vec<u8> {
        decode_hex(&self.priv_data).unwrap_or_default()
    }

    /// The index of the GPU with user gpu_id `gpu_id`.
    pub fn gpu_index(&self, gpu_id: u32) -> Option<usize> {
        self.gpus.iter().position(|g| g.gpu_id == gpu_id)
    }

    /// The mapping recorded at `start` with file offset `offset`.
    pub fn vma_at(&self, start: u64, offset: u64) -> Option<&KfdVmaRecord> {
        self.vmas
            .iter()
            .find(|v| v.start == start && v.offset == offset)
    }
}

/// Which KFD file a [`KfdFileRecord`] stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KfdFileKind {
    /// `/dev/kfd`: its restore re-creates the process's KFD state ([`KfdState`] of `nspid`).
    Kfd,
    /// A render node `/dev/dri/renderD<minor>` of the GPU `gpu_id`.
    Render,
}

/// A `/dev/kfd` or render-node file of a checkpointed process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KfdFileRecord {
    pub format_version: u32,
    pub kind: KfdFileKind,
    /// The process that held it (its pid in its own namespace).
    #[serde(with = "crate::manifest::nspid_number")]
    pub nspid: NsPid,
    /// `open(2)` flags: access mode and `O_NONBLOCK` only.
    pub flags: i32,
    /// Render node: the user gpu_id of its GPU (0 for `/dev/kfd`, or a render node of a GPU
    /// the process never bound).
    pub gpu_id: u32,
    /// Render node: its minor at dump (0 for `/dev/kfd`).
    pub render_minor: u32,
}

/// `gpusnap-<nspid>-kfd.img`
pub fn kfd_state_name(nspid: NsPid) -> String {
    format!("gpusnap-{nspid}-kfd.img")
}

/// `gpusnap-kfdfile-<id>.img` (`id`: CRIU's file id).
pub fn kfd_file_name(id: u32) -> String {
    format!("gpusnap-kfdfile-{id}.img")
}

fn invalid(file: &str, detail: String) -> ImageError {
    ImageError::InvalidManifest {
        file: file.to_owned(),
        detail,
    }
}

fn encode_hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    s.as_bytes()
        .chunks(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

/// Hex for [`KfdState::priv_data`].
pub fn priv_data_hex(b: &[u8]) -> String {
    encode_hex(b)
}

/// `<magic> <version> <len> <xxh3>\n<body>`, at the current version.
#[cfg(test)]
fn seal(magic: &str, body: &[u8]) -> Vec<u8> {
    seal_version(magic, KFD_FORMAT_VERSION, body)
}

fn seal_version(magic: &str, version: u32, body: &[u8]) -> Vec<u8> {
    let mut out = format!("{magic} {version} {} {:016x}\n", body.len(), xxh3_64(body)).into_bytes();
    out.extend_from_slice(body);
    out
}

/// The body of a sealed record and its version, after checking its header line, length and
/// checksum.
fn unseal<'a>(
    magic: &str,
    b: &'a [u8],
    file: &str,
    max: u64,
) -> Result<(u32, &'a [u8]), ImageError> {
    let bad = |detail: &'static str| ImageError::ManifestHeader {
        file: file.to_owned(),
        detail,
    };
    let nl = b
        .iter()
        .take(128)
        .position(|&c| c == b'\n')
        .ok_or(bad("no header line"))?;
    let line = std::str::from_utf8(&b[..nl]).map_err(|_| bad("header line is not ASCII"))?;
    let mut words = line.split(' ');
    if words.next() != Some(magic) {
        return Err(bad("bad magic"));
    }
    let canonical = |w: Option<&str>| {
        w.filter(|w| {
            !w.is_empty()
                && w.bytes().all(|c| c.is_ascii_digit())
                && (w.len() == 1 || !w.starts_with('0'))
        })
        .and_then(|w| w.parse::<u64>().ok())
    };
    let version = canonical(words.next()).ok_or(bad("bad version field"))?;
    if !(u64::from(KFD_FORMAT_VERSION_MIN)..=u64::from(KFD_FORMAT_VERSION)).contains(&version) {
        return Err(ImageError::UnsupportedVersion {
            file: file.to_owned(),
            found: version,
        });
    }
    let version = version as u32;
    let len = canonical(words.next()).ok_or(bad("bad length field"))?;
    let sum = words.next().ok_or(bad("no checksum field"))?;
    if sum.len() != 16 || !sum.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(bad("checksum field is not 16 lowercase hex digits"));
    }
    let sum = u64::from_str_radix(sum, 16).map_err(|_| bad("bad checksum field"))?;
    if words.next().is_some() {
        return Err(bad("extra fields"));
    }
    if len > max {
        return Err(ImageError::ManifestTooLarge {
            file: file.to_owned(),
            len,
        });
    }
    let body = &b[nl + 1..];
    let expected = (nl + 1) as u64 + len;
    if (body.len() as u64) < len {
        return Err(ImageError::Truncated {
            file: file.to_owned(),
            actual: b.len() as u64,
            expected,
        });
    }
    if (body.len() as u64) > len {
        return Err(ImageError::TrailingData {
            file: file.to_owned(),
            actual: b.len() as u64,
            expected,
        });
    }
    if xxh3_64(body) != sum {
        return Err(ImageError::ManifestChecksum {
            file: file.to_owned(),
        });
    }
    Ok((version, body))
}

fn read_sealed(dir: BorrowedFd<'_>, name: &str, max: u64) -> Result<Vec<u8>, ImageError> {
    let (file, _) = sys::open_regular(dir, name)?;
    let mut b = Vec::new();
    file.take(max + 128)
        .read_to_end(&mut b)
        .map_err(|e| ImageError::io(name, IoOp::Read, e))?;
    Ok(b)
}

/// Checks everything about a state that needs no other file.
pub fn validate_kfd_state(s: &KfdState) -> Result<(), ImageError> {
    let file = kfd_state_name(s.nspid);
    let bad = |d: String| invalid(&file, d);
    if !(KFD_FORMAT_VERSION_MIN..=KFD_FORMAT_VERSION).contains(&s.format_version) {
        return Err(ImageError::UnsupportedVersion {
            file,
            found: s.format_version.into(),
        });
    }
    if s.format_version < 2 && (!s.vmas.is_empty() || s.max_fd != 0) {
        return Err(bad("a version 1 state lists device mappings".into()));
    }
    // A descriptor number: the kernel's limit on open files is far below this.
    if s.max_fd > MAX_FD {
        return Err(bad(format!("max_fd {} exceeds {MAX_FD}", s.max_fd)));
    }
    if s.gpus.is_empty() || s.gpus.len() > MAX_GPUS {
        return Err(bad(format!(
            "{} GPUs listed (1..={MAX_GPUS})",
            s.gpus.len()
        )));
    }
    for (i, g) in s.gpus.iter().enumerate() {
        if g.gpu_id == 0 || s.gpus[..i].iter().any(|h| h.gpu_id == g.gpu_id) {
            return Err(bad(format!("gpu_id {} is 0 or listed twice", g.gpu_id)));
        }
        if g.name.len() > MAX_NAME {
            return Err(bad(format!("GPU {} name is too long", g.gpu_id)));
        }
    }
    if s.bos.len() > MAX_BOS {
        return Err(bad(format!(
            "{} buffer objects (at most {MAX_BOS})",
            s.bos.len()
        )));
    }
    for (i, bo) in s.bos.iter().enumerate() {
        if bo.size == 0 || bo.addr.checked_add(bo.size).is_none() {
            return Err(bad(format!(
                "buffer object {i} ({:#x}+{:#x}) is empty or wraps",
                bo.addr, bo.size
            )));
        }
        if s.gpu_index(bo.gpu_id).is_none() {
            return Err(bad(format!(
                "buffer object {i} is on gpu_id {}, which is not listed",
                bo.gpu_id
            )));
        }
    }
    if decode_hex(&s.priv_data).is_none() {
        return Err(bad("priv_data is not lowercase hex of whole bytes".into()));
    }
    if s.vmas.len() > MAX_VMAS {
        return Err(bad(format!(
            "{} device mappings (at most {MAX_VMAS})",
            s.vmas.len()
        )));
    }
    for (i, v) in s.vmas.iter().enumerate() {
        let page = |x: u64| x.is_multiple_of(4096);
        if v.end <= v.start || !page(v.start) || !page(v.end) || !page(v.offset) {
            return Err(bad(format!(
                "device mapping {i} ({:#x}-{:#x} at offset {:#x}) is empty or not page-aligned",
                v.start, v.end, v.offset
            )));
        }
        if s.vmas[..i]
            .iter()
            .any(|w| w.start < v.end && v.start < w.end)
        {
            return Err(bad(format!(
                "device mapping {i} ({:#x}-{:#x}) overlaps another",
                v.start, v.end
            )));
        }
        let Some(bo) = s.bos.get(v.bo as usize) else {
            return Err(bad(format!(
                "device mapping {i} shows buffer object {}, which is not listed",
                v.bo
            )));
        };
        let inside = v
            .offset
            .checked_sub(bo.offset)
            .and_then(|d| d.checked_add(v.end - v.start))
            .is_some_and(|e| e <= bo.size);
        if !inside {
            return Err(bad(format!(
                "device mapping {i} ({:#x} bytes at offset {:#x}) lies outside buffer object {} (offset {:#x}, {:#x} bytes)",
                v.end - v.start,
                v.offset,
                v.bo,
                bo.offset,
                bo.size
            )));
        }
        if (v.node == KfdVmaNode::Kfd) != (v.render_minor == 0) {
            return Err(bad(format!(
                "device mapping {i}: render minor {} does not go with a {:?} mapping",
                v.render_minor, v.node
            )));
        }
    }
    Ok(())
}

/// Checks that the manifest of the same process describes exactly the buffer objects whose
/// contents the state says are saved: path `kfd`, one GPU per state GPU (ordinal = index), one
/// moved allocation per content BO (same address, size and GPU) and no other allocation.
pub fn check_kfd_state_against_manifest(s: &KfdState, m: &Manifest) -> Result<(), ImageError> {
    let mf = manifest_file_name(m.nspid);
    let bad = |d: String| invalid(&mf, d);
    if m.nspid != s.nspid {
        return Err(ImageError::NspidMismatch {
            file: kfd_state_name(s.nspid),
            found: s.nspid,
            expected: m.nspid,
        });
    }
    if m.path != CheckpointPath::Kfd {
        return Err(bad(format!(
            "path {:?} does not go with {}",
            m.path,
            kfd_state_name(s.nspid)
        )));
    }
    if m.gpus.len() != s.gpus.len() || m.gpus.iter().any(|g| g.ordinal as usize >= s.gpus.len()) {
        return Err(bad(format!(
            "lists {} GPUs; {} lists {}",
            m.gpus.len(),
            kfd_state_name(s.nspid),
            s.gpus.len()
        )));
    }
    let mut want: Vec<(u64, u64, u32)> = s
        .bos
        .iter()
        .filter(|b| b.content)
        .map(|b| (b.addr, b.size, s.gpu_index(b.gpu_id).unwrap_or(0) as u32))
        .collect();
    let mut have: Vec<(u64, u64, u32)> = m
        .allocations
        .iter()
        .filter(|a| a.moved)
        .map(|a| (a.addr, a.size, a.device))
        .collect();
    want.sort_unstable();
    have.sort_unstable();
    if want != have || m.allocations.iter().any(|a| !a.moved) {
        return Err(bad(format!(
            "its allocations do not match the {} buffer objects with contents in {}",
            want.len(),
            kfd_state_name(s.nspid)
        )));
    }
    Ok(())
}

/// Writes `gpusnap-<nspid>-kfd.img` atomically, after [`validate_kfd_state`].
pub fn write_kfd_state(dir: BorrowedFd<'_>, s: &KfdState) -> Result<(), ImageError> {
    validate_kfd_state(s)?;
    let name = kfd_state_name(s.nspid);
    atomic_write(
        dir,
        &name,
        &format!("{name}.tmp"),
        &encode_kfd_state_unchecked(s),
    )
}

/// Decodes and checks the bytes of `gpusnap-<nspid>-kfd.img`.
pub fn decode_kfd_state(nspid: NsPid, b: &[u8]) -> Result<KfdState, ImageError> {
    let file = kfd_state_name(nspid);
    let (version, body) = unseal(KFD_STATE_MAGIC, b, &file, MAX_KFD_STATE_BODY)?;
    let s: KfdState = serde_json::from_slice(body).map_err(|source| ImageError::ManifestJson {
        file: file.clone(),
        source,
    })?;
    if s.format_version != version {
        return Err(invalid(
            &file,
            format!(
                "header says version {version}, body says {}",
                s.format_version
            ),
        ));
    }
    if s.nspid != nspid {
        return Err(ImageError::NspidMismatch {
            file,
            found: s.nspid,
            expected: nspid,
        });
    }
    validate_kfd_state(&s)?;
    Ok(s)
}

/// Reads and checks `gpusnap-<nspid>-kfd.img`.
pub fn read_kfd_state(dir: BorrowedFd<'_>, nspid: NsPid) -> Result<KfdState, ImageError> {
    let name = kfd_state_name(nspid);
    decode_kfd_state(nspid, &read_sealed(dir, &name, MAX_KFD_STATE_BODY)?)
}

/// The bytes of `gpusnap-<nspid>-kfd.img` without validation, for tests that damage images.
#[doc(hidden)]
pub fn encode_kfd_state_unchecked(s: &KfdState) -> Vec<u8> {
    let body = if s.format_version < 2 {
        // Version 1 had neither field: written as a version 1 dump wrote it.
        let mut v = serde_json::to_value(s).expect("a KfdState always serializes");
        if let Some(o) = v.as_object_mut() {
            o.remove("vmas");
            o.remove("max_fd");
        }
        serde_json::to_vec(&v).expect("JSON always serializes")
    } else {
        serde_json::to_vec(s).expect("a KfdState always serializes")
    };
    seal_version(KFD_STATE_MAGIC, s.format_version, &body)
}

fn check_file_record(id: u32, r: &KfdFileRecord) -> Result<(), ImageError> {
    let file = kfd_file_name(id);
    if !(KFD_FORMAT_VERSION_MIN..=KFD_FORMAT_VERSION).contains(&r.format_version) {
        return Err(ImageError::UnsupportedVersion {
            file,
            found: r.format_version.into(),
        });
    }
    if r.flags & !(libc::O_ACCMODE | libc::O_NONBLOCK) != 0 {
        return Err(invalid(
            &file,
            format!("open flags {:#x} not allowed", r.flags),
        ));
    }
    Ok(())
}

/// Writes `gpusnap-kfdfile-<id>.img` atomically.
pub fn write_kfd_file(dir: BorrowedFd<'_>, id: u32, r: &KfdFileRecord) -> Result<(), ImageError> {
    check_file_record(id, r)?;
    let body = serde_json::to_vec(r).expect("a KfdFileRecord always serializes");
    let name = kfd_file_name(id);
    atomic_write(
        dir,
        &name,
        &format!("{name}.tmp"),
        &seal_version(KFD_FILE_MAGIC, r.format_version, &body),
    )
}

/// Decodes and checks the bytes of `gpusnap-kfdfile-<id>.img`.
pub fn decode_kfd_file(id: u32, b: &[u8]) -> Result<KfdFileRecord, ImageError> {
    let file = kfd_file_name(id);
    let (version, body) = unseal(KFD_FILE_MAGIC, b, &file, MAX_KFD_FILE_BODY)?;
    let r: KfdFileRecord =
        serde_json::from_slice(body).map_err(|source| ImageError::ManifestJson {
            file: file.clone(),
            source,
        })?;
    if r.format_version != version {
        return Err(invalid(
            &file,
            format!(
                "header says version {version}, body says {}",
                r.format_version
            ),
        ));
    }
    check_file_record(id, &r)?;
    Ok(r)
}

/// Reads the record of CRIU file `id`; [`ImageError::MissingFile`] when there is none (the file
/// is not a KFD file gpusnap recorded).
pub fn read_kfd_file(dir: BorrowedFd<'_>, id: u32) -> Result<KfdFileRecord, ImageError> {
    let name = kfd_file_name(id);
    decode_kfd_file(id, &read_sealed(dir, &name, MAX_KFD_FILE_BODY)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AllocationRecord, GpuRecord};

    fn state() -> KfdState {
        KfdState {
            format_version: 2,
            nspid: NsPid(42),
            kfd_version: [1, 16],
            gpus: vec![KfdGpuRecord {
                gpu_id: 4321,
                vendor_id: 0x1002,
                device_id: 0x740f,
                gfx_target_version: 90010,
                simd_count: 416,
                local_mem_bytes: 64 << 30,
                name: "gfx90a".into(),
                drm_render_minor: 128,
            }],
            bos: vec![
                KfdBoRecord {
                    addr: 0x7000_0000,
                    size: 1 << 20,
                    offset: 0x1000,
                    gpu_id: 4321,
                    alloc_flags: 1,
                    content: true,
                },
                KfdBoRecord {
                    addr: 0x8000_0000,
                    size: 4096,
                    offset: 0x2000,
                    gpu_id: 4321,
                    alloc_flags: 8,
                    content: false,
                },
            ],
            num_objects: 1,
            priv_data: priv_data_hex(b"\x00\x01\xfe\xff"),
            vmas: vec![
                KfdVmaRecord {
                    start: 0x7000_0000,
                    end: 0x7010_0000,
                    offset: 0x1000,
                    node: KfdVmaNode::Render,
                    render_minor: 128,
                    bo: 0,
                },
                KfdVmaRecord {
                    start: 0x8000_0000,
                    end: 0x8000_1000,
                    offset: 0x2000,
                    node: KfdVmaNode::Kfd,
                    render_minor: 0,
                    bo: 1,
                },
            ],
            max_fd: 9,
        }
    }

    fn manifest(s: &KfdState) -> Manifest {
        Manifest {
            format_version: crate::FORMAT_VERSION,
            nspid: s.nspid,
            path: CheckpointPath::Kfd,
            created_unix_s: 0,
            gpusnap_version: String::new(),
            driver_version: 0,
            gpus: vec![GpuRecord {
                ordinal: 0,
                uuid: format!("{:032x}", 4321),
                name: "gfx90a".into(),
                total_mem: 64 << 30,
            }],
            allocations: vec![AllocationRecord {
                id: 0,
                device: 0,
                addr: 0x7000_0000,
                size: 1 << 20,
                moved: true,
                lent: false,
                rdma_capable: false,
            }],
            files: vec![],
            chunks: vec![],
            timings_s: Default::default(),
            requires: None,
        }
    }

    #[test]
    fn state_round_trip_and_every_damage_refused() {
        let s = state();
        let b = encode_kfd_state_unchecked(&s);
        assert_eq!(decode_kfd_state(NsPid(42), &b).unwrap(), s);
        assert_eq!(s.priv_data_bytes(), b"\x00\x01\xfe\xff");
        for i in 0..b.len() {
            let mut d = b.clone();
            d[i] ^= 0x04;
            assert!(
                decode_kfd_state(NsPid(42), &d).is_err(),
                "flip at {i} accepted"
            );
        }
        for n in 0..b.len() {
            assert!(
                decode_kfd_state(NsPid(42), &b[..n]).is_err(),
                "cut to {n} accepted"
            );
        }
        let mut longer = b.clone();
        longer.push(b' ');
        assert!(decode_kfd_state(NsPid(42), &longer).is_err());
        assert!(matches!(
            decode_kfd_state(NsPid(43), &b),
            Err(ImageError::NspidMismatch { .. })
        ));
    }

    #[test]
    fn invalid_states_refused() {
        type Edit = Box<dyn Fn(&mut KfdState)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("no GPU", Box::new(|s| s.gpus.clear())),
            ("gpu twice", Box::new(|s| s.gpus.push(s.gpus[0].clone()))),
            ("empty BO", Box::new(|s| s.bos[0].size = 0)),
            ("wrapping BO", Box::new(|s| s.bos[0].addr = u64::MAX)),
            ("unknown GPU", Box::new(|s| s.bos[1].gpu_id = 5)),
            ("odd hex", Box::new(|s| s.priv_data.push('a'))),
            ("upper hex", Box::new(|s| s.priv_data = "AB".into())),
            ("version", Box::new(|s| s.format_version = 3)),
            ("version 0", Box::new(|s| s.format_version = 0)),
            (
                "empty mapping",
                Box::new(|s| s.vmas[0].end = s.vmas[0].start),
            ),
            ("unaligned mapping", Box::new(|s| s.vmas[0].offset += 1)),
            ("mapping of no BO", Box::new(|s| s.vmas[0].bo = 7)),
            ("mapping past its BO", Box::new(|s| s.vmas[1].end += 0x1000)),
            (
                "mapping before its BO",
                Box::new(|s| s.vmas[1].offset = 0x1000),
            ),
            (
                "overlapping mappings",
                Box::new(|s| {
                    let mut v = s.vmas[0].clone();
                    v.start += 0x1000;
                    v.end = v.start + 0x1000;
                    s.vmas.push(v)
                }),
            ),
            (
                "kfd mapping with a minor",
                Box::new(|s| s.vmas[1].render_minor = 128),
            ),
            (
                "render mapping without one",
                Box::new(|s| s.vmas[0].render_minor = 0),
            ),
        ];
        for (what, f) in cases {
            let mut s = state();
            f(&mut s);
            let err = decode_kfd_state(NsPid(42), &encode_kfd_state_unchecked(&s)).unwrap_err();
            assert!(
                err.to_string().contains("gpusnap-42-kfd.img"),
                "{what}: {err}"
            );
        }
    }

    #[test]
    fn version_1_states_are_still_read() {
        let mut s = state();
        s.format_version = 1;
        s.vmas.clear();
        s.max_fd = 0;
        let b = encode_kfd_state_unchecked(&s);
        assert!(b.starts_with(b"GPUSNAP-KFD 1 "));
        let body =
            std::str::from_utf8(&b[b.iter().position(|&c| c == b'\n').unwrap() + 1..]).unwrap();
        assert!(!body.contains("vmas") && !body.contains("max_fd"), "{body}");
        assert_eq!(decode_kfd_state(NsPid(42), &b).unwrap(), s);
        let mut with_maps = state();
        with_maps.format_version = 1;
        assert!(validate_kfd_state(&with_maps).is_err());
        // A header and body that disagree on the version are refused.
        let mut v2 = state();
        v2.vmas.clear();
        let body = serde_json::to_vec(&v2).unwrap();
        let err =
            decode_kfd_state(NsPid(42), &seal_version(KFD_STATE_MAGIC, 1, &body)).unwrap_err();
        assert!(err.to_string().contains("header says version 1"), "{err}");
        // A version from the future is refused by its number.
        let err =
            decode_kfd_state(NsPid(42), &seal_version(KFD_STATE_MAGIC, 3, &body)).unwrap_err();
        assert!(
            matches!(err, ImageError::UnsupportedVersion { found: 3, .. }),
            "{err}"
        );
        // Version 1 file records too.
        let r = KfdFileRecord {
            format_version: 1,
            kind: KfdFileKind::Kfd,
            nspid: NsPid(42),
            flags: libc::O_RDWR,
            gpu_id: 0,
            render_minor: 0,
        };
        let b = seal_version(KFD_FILE_MAGIC, 1, &serde_json::to_vec(&r).unwrap());
        assert_eq!(decode_kfd_file(3, &b).unwrap(), r);
    }

    #[test]
    fn mappings_are_found_by_address_and_offset() {
        let s = state();
        assert_eq!(s.vma_at(0x7000_0000, 0x1000).map(|v| v.bo), Some(0));
        assert_eq!(s.vma_at(0x8000_0000, 0x2000).map(|v| v.bo), Some(1));
        assert!(s.vma_at(0x7000_0000, 0x2000).is_none());
        assert!(s.vma_at(0x7000_1000, 0x1000).is_none());
    }

    #[test]
    fn state_and_manifest_must_agree() {
        let s = state();
        let m = manifest(&s);
        check_kfd_state_against_manifest(&s, &m).unwrap();
        let mut other = m.clone();
        other.allocations[0].size = 4096;
        assert!(check_kfd_state_against_manifest(&s, &other).is_err());
        let mut other = m.clone();
        other.path = CheckpointPath::Split;
        assert!(check_kfd_state_against_manifest(&s, &other).is_err());
        let mut other = m.clone();
        other.allocations[0].moved = false;
        assert!(check_kfd_state_against_manifest(&s, &other).is_err());
        let mut other = m;
        other.gpus.clear();
        assert!(check_kfd_state_against_manifest(&s, &other).is_err());
    }

    #[test]
    fn the_state_file_is_a_file_of_its_process() {
        use crate::{ImageFileKind, parse_file_name};
        assert_eq!(
            parse_file_name("gpusnap-42-kfd.img"),
            Some(ImageFileKind::Kfd { nspid: NsPid(42) })
        );
        assert_eq!(parse_file_name("gpusnap-042-kfd.img"), None);
        assert_eq!(parse_file_name("gpusnap-kfdfile-3.img"), None);
        assert_eq!(
            ImageFileKind::Kfd { nspid: NsPid(42) }.nspid(),
            Some(NsPid(42))
        );
        // A state without its manifest is an unfinished dump, and goes with the process.
        let dir = std::env::temp_dir().join(format!("gpusnap-kfd-names-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let f = std::fs::File::open(&dir).unwrap();
        use std::os::fd::AsFd;
        write_kfd_state(f.as_fd(), &state()).unwrap();
        assert_eq!(
            crate::unfinished_dumps(f.as_fd()).unwrap(),
            vec![(NsPid(42), "gpusnap-42-kfd.img".to_owned())]
        );
        assert_eq!(read_kfd_state(f.as_fd(), NsPid(42)).unwrap(), state());
        assert_eq!(
            crate::remove_process_files(f.as_fd(), NsPid(42)).unwrap(),
            1
        );
        assert!(matches!(
            read_kfd_state(f.as_fd(), NsPid(42)),
            Err(ImageError::MissingFile { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn file_records() {
        let r = KfdFileRecord {
            format_version: 2,
            kind: KfdFileKind::Render,
            nspid: NsPid(42),
            flags: libc::O_RDWR,
            gpu_id: 4321,
            render_minor: 129,
        };
        let b = seal(KFD_FILE_MAGIC, &serde_json::to_vec(&r).unwrap());
        assert_eq!(decode_kfd_file(3, &b).unwrap(), r);
        for i in 0..b.len() {
            let mut d = b.clone();
            d[i] ^= 0x01;
            assert!(decode_kfd_file(3, &d).is_err(), "flip at {i} accepted");
        }
        let mut bad = r.clone();
        bad.flags = libc::O_CREAT | libc::O_RDWR;
        assert!(
            decode_kfd_file(3, &seal(KFD_FILE_MAGIC, &serde_json::to_vec(&bad).unwrap())).is_err()
        );
        // A state is not a file record.
        assert!(decode_kfd_file(3, &encode_kfd_state_unchecked(&state())).is_err());
    }

    #[test]
    fn max_fd_is_bounded() {
        let mut s = state();
        s.max_fd = MAX_FD;
        validate_kfd_state(&s).unwrap();
        s.max_fd = MAX_FD + 1;
        let e = validate_kfd_state(&s).unwrap_err().to_string();
        assert!(e.contains("max_fd"), "{e}");
    }
}
