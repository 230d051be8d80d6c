//! The per-process manifest: its types, and reading and writing the manifest file.
//!
//! File layout: one ASCII header line `GPUSNAP-MANIFEST <version> <body_len> <xxh3_64 hex>\n`,
//! then exactly `body_len` bytes of JSON. The checksum covers the body; the header line's own
//! fields are each checked against the file, so a flipped byte anywhere is refused.

use gpusnap_proto::pid::NsPid;
use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::names::manifest_tmp_name;
use crate::{
    FORMAT_VERSION, ImageError, ImageFileKind, IoOp, READ_MANIFEST_VERSIONS, data_file_name,
    manifest_file_name, parse_file_name, sys, validate,
};

/// First word of a manifest file.
pub const MANIFEST_MAGIC: &str = "GPUSNAP-MANIFEST";
/// Largest manifest body readers accept (256 MiB: about a million chunks).
pub const MAX_MANIFEST_BODY: u64 = 256 << 20;
/// Longest possible header line: magic, u32, u64, 16 hex digits, 3 spaces and `\n`.
const MAX_HEADER_LINE: usize = MANIFEST_MAGIC.len() + 1 + 10 + 1 + 20 + 1 + 16 + 1;

/// How a chunk's bytes are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    /// The device bytes as they are.
    Raw,
    /// One zstd frame that decompresses to exactly `len` bytes.
    Zstd,
    /// Nothing stored: the chunk was all zeros on the device (found by its device hash pass),
    /// and a restore fills it with zeros there (version 3).
    Zero,
    /// The device bytes as they are, checked by their device hash (gpusnap-sum64, computed on
    /// the GPU at the dump) instead of XXH3: `checksum` and `device_hash` are that hash, and
    /// there is no `content_xxh128`. The dump then hashes nothing on the host (version 4).
    #[serde(rename = "raw_sum64")]
    RawSum64,
}

/// Where one chunk of device memory is stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkEntry {
    /// Index of the data file: the `<index>` in `gpusnap-<nspid>-data-<index>.img`.
    pub file: u32,
    /// Offset of the stored bytes in that file (its record header is the 64 bytes before).
    pub file_offset: u64,
    /// Device virtual address of the chunk's first byte.
    pub addr: u64,
    /// Length of the chunk in device memory.
    pub len: u64,
    /// Length of the stored bytes in the file (`len` for `Raw`).
    pub stored_len: u64,
    pub codec: Codec,
    /// xxh3_64 of the stored bytes; for `RawSum64`, their gpusnap-sum64 (the device hash).
    pub checksum: u64,
    /// XXH3-128 of the chunk's device bytes (before compression), as 32 lowercase hex digits.
    /// Present in every chunk of a version-2 manifest, absent in version 1. This, with `addr`
    /// and `len`, is what an incremental dump compares with the parent image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_xxh128: Option<String>,
    /// Where the stored bytes are: 0 (the default, not written) means in this image's data file
    /// `file`; `d` in `1..=MAX_CHAIN_DEPTH` means in data file `file` of the image `d` `parent`
    /// links up, where the same chunk is recorded with depth 0 (version 2 only).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub parent_depth: u32,
    /// gpusnap-sum64 of the chunk's device bytes, computed on the GPU by the agent
    /// (`gpusnap_proto::devhash`); a restore checks it on the GPU after loading (version 3;
    /// absent where the agent could not hash on the device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_hash: Option<u64>,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl ChunkEntry {
    /// True if `self` and `other` describe the same stored bytes (every field but
    /// `parent_depth`): a reference and the entry it points at.
    pub fn same_stored_chunk(&self, other: &ChunkEntry) -> bool {
        self.file == other.file
            && self.file_offset == other.file_offset
            && self.addr == other.addr
            && self.len == other.len
            && self.stored_len == other.stored_len
            && self.codec == other.codec
            && self.checksum == other.checksum
            && self.content_xxh128 == other.content_xxh128
            && self.device_hash == other.device_hash
    }

    /// A chunk recorded as all zeros (`Codec::Zero`): nothing stored, no file.
    pub fn zero(addr: u64, len: u64, device_hash: u64) -> Self {
        ChunkEntry {
            file: 0,
            file_offset: 0,
            addr,
            len,
            stored_len: 0,
            codec: Codec::Zero,
            checksum: 0,
            content_xxh128: None,
            parent_depth: 0,
            device_hash: Some(device_hash),
        }
    }

    /// True if the chunk is stored in a data file (not `Codec::Zero`).
    pub fn is_stored(&self) -> bool {
        self.codec != Codec::Zero
    }

    /// True if the bytes are in an ancestor image's data file, not in this image's.
    pub fn is_reference(&self) -> bool {
        self.parent_depth != 0
    }
}

/// A data file of the image (`gpusnap-<nspid>-data-<index>.img`) and its exact size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
}

/// Which way the process's device memory was saved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointPath {
    /// Moved allocations are in gpusnap's data files; the driver checkpoint holds the rest.
    Split,
    /// Everything is in the driver's checkpoint (CRIU's pages); gpusnap holds no data.
    Transparent,
    /// An AMD GPU process checkpointed through the KFD's CRIU interface: every allocation is a
    /// VRAM/GTT buffer object whose contents are in gpusnap's data files, and the kernel's own
    /// state is in `gpusnap-<nspid>-kfd.img` ([`crate::KfdState`]).
    Kfd,
}

/// A GPU the process used.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuRecord {
    pub ordinal: u32,
    /// The GPU's UUID as 32 hex digits.
    pub uuid: String,
    pub name: String,
    pub total_mem: u64,
}

/// A device allocation the agent tracked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocationRecord {
    pub id: u64,
    /// Ordinal of the GPU (one of `Manifest::gpus`).
    pub device: u32,
    pub addr: u64,
    pub size: u64,
    /// true: the data is in gpusnap's files; false: left to the driver checkpoint.
    pub moved: bool,
    /// The dump lent it to the keeper (the agent had created it exportable), so a restore may
    /// load it into the keeper's fresh memory beside CRIU's restore and hand it over. Format 5;
    /// absent (false) before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lent: bool,
    /// The memory was created `gpuDirectRDMACapable` (the application's own `cuMemCreate`
    /// handle asked for it, as PyTorch's expandable segments do): a keeper restoring it makes it
    /// so. Format 6; absent (false) before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rdma_capable: bool,
}

/// How the image's documents store an [`NsPid`]: its bare number (`"nspid": 42`), as they
/// always have. `#[serde(with = ...)]` of every `nspid` field; the number stays inside the
/// format.
pub(crate) mod nspid_number {
    use gpusnap_proto::pid::NsPid;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(nspid: &NsPid, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(nspid.get())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<NsPid, D::Error> {
        u32::deserialize(d).map(NsPid)
    }
}

/// Everything about one checkpointed process. Written last; its presence means the dump of this
/// process completed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format_version: u32,
    #[serde(with = "nspid_number")]
    pub nspid: NsPid,
    pub path: CheckpointPath,
    pub created_unix_s: u64,
    /// The build of gpusnap that wrote the image, [`crate::BUILD`] (`<version>+<commit>`).
    /// Images written before builds were recorded hold the version alone. Only shown, never
    /// interpreted.
    pub gpusnap_version: String,
    /// `cuDriverGetVersion`, e.g. 13000.
    pub driver_version: i32,
    pub gpus: Vec<GpuRecord>,
    pub allocations: Vec<AllocationRecord>,
    pub files: Vec<FileEntry>,
    pub chunks: Vec<ChunkEntry>,
    /// Phase name to seconds, e.g. `"lock": 0.012`.
    pub timings_s: BTreeMap<String, f64>,
    /// What a restore needs of the node beyond the GPUs' models and UUIDs: the driver stack the
    /// process ran on and the device memory it used (format 7; absent before, and then nothing
    /// of it is checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requires: Option<Requirements>,
}

/// Longest text field of [`Requirements`] readers accept (a version string or a path).
pub const MAX_REQUIREMENT_TEXT: usize = 4096;

/// What a restore needs of the node, recorded at the dump (format 7).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Requirements {
    /// The NVIDIA kernel driver's version as `/proc/driver/nvidia/version` gives it, e.g.
    /// `580.95.05`; absent where it could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_driver: Option<String>,
    /// The driver library the process had mapped; absent where it had none the dump knew.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_library: Option<LibraryDigest>,
    /// Device memory in use by the process, in bytes, per GPU ordinal (one of
    /// [`Manifest::gpus`]); only the GPUs where it is known (the split path: the allocations
    /// the agent tracked).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpu_mem_used: BTreeMap<u32, u64>,
}

/// A file the restore needs as it was, named by the path the process saw and identified by
/// its size and XXH3-128 digest (read through `/proc/<pid>/map_files`, never by that path).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LibraryDigest {
    /// The mapping's path in the process's mount namespace, e.g.
    /// `/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05`.
    pub path: String,
    pub size: u64,
    /// XXH3-128 of the file's bytes, as 32 lowercase hex digits.
    pub xxh3_128: String,
    /// The process saw another root than CRIU's (a container): `path` is inside that root,
    /// which the runtime mounts again at a restore; CRIU's first hook cannot look at it, so only
    /// a runtime or scheduler compares the digest (`gpusnap inspect --json`). Absent: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_job_root: bool,
}

impl LibraryDigest {
    /// The digest of everything `r` reads until its end, for a file the process saw at `path`.
    pub fn of_reader(path: &str, r: &mut impl std::io::Read) -> std::io::Result<LibraryDigest> {
        let mut h = xxhash_rust::xxh3::Xxh3Default::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut size = 0u64;
        loop {
            let n = match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            h.update(&buf[..n]);
            size += n as u64;
        }
        Ok(LibraryDigest {
            path: path.to_owned(),
            size,
            xxh3_128: format!("{:032x}", h.digest128()),
            in_job_root: false,
        })
    }

    /// The file name of [`Self::path`].
    pub fn file_name(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or(&self.path)
    }
}

impl Requirements {
    /// The driver-stack identity a runtime or scheduler compares between nodes (KEP-6274):
    /// `nvidia=<kernel driver>;cuda=<API version>;lib=<file name>@<xxh3-128>`, the parts known.
    pub fn driver_stack_identity(&self, cuda_api: i32) -> String {
        let mut parts = Vec::new();
        if let Some(k) = &self.kernel_driver {
            parts.push(format!("nvidia={k}"));
        }
        if cuda_api > 0 {
            parts.push(format!("cuda={cuda_api}"));
        }
        if let Some(l) = &self.driver_library {
            parts.push(format!("lib={}@{}", l.file_name(), l.xxh3_128));
        }
        parts.join(";")
    }

    /// The fields' own rules: bounded printable text, a digest of 32 lowercase hex digits,
    /// GPU ordinals of the image; a problem names `file`.
    fn check(&self, gpus: &[GpuRecord], file: &str) -> Result<(), ImageError> {
        let bad = |detail: String| ImageError::InvalidManifest {
            file: file.to_owned(),
            detail,
        };
        let text_ok = |s: &str| {
            !s.is_empty() && s.len() <= MAX_REQUIREMENT_TEXT && s.chars().all(|c| !c.is_control())
        };
        if let Some(k) = &self.kernel_driver
            && !text_ok(k)
        {
            return Err(bad(
                "requires.kernel_driver is empty, too long or not printable".into(),
            ));
        }
        if let Some(l) = &self.driver_library {
            if !text_ok(&l.path) || !l.path.starts_with('/') {
                return Err(bad(
                    "requires.driver_library.path is not an absolute printable path".into(),
                ));
            }
            if l.xxh3_128.len() != 32
                || !l
                    .xxh3_128
                    .bytes()
                    .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            {
                return Err(bad(
                    "requires.driver_library.xxh3_128 is not 32 lowercase hex digits".into(),
                ));
            }
        }
        if let Some(o) = self
            .gpu_mem_used
            .keys()
            .find(|o| !gpus.iter().any(|g| g.ordinal == **o))
        {
            return Err(bad(format!(
                "requires.gpu_mem_used names GPU ordinal {o}, not one of the image's GPUs"
            )));
        }
        Ok(())
    }
}

/// [`Requirements::check`] of `m`'s requirements, as an [`ImageError`] naming `file`.
fn check_requirements(m: &Manifest, file: &str) -> Result<(), ImageError> {
    match &m.requires {
        Some(r) => r.check(&m.gpus, file),
        None => Ok(()),
    }
}

impl Manifest {
    /// A manifest this gpusnap writes now for process `nspid`: the writer's fields filled in
    /// ([`FORMAT_VERSION`], the time, [`crate::BUILD`]), no GPUs, allocations, files, chunks or
    /// timings yet. Every writer of a manifest starts here.
    pub fn begin(nspid: NsPid, path: CheckpointPath, driver_version: i32) -> Manifest {
        Manifest {
            format_version: FORMAT_VERSION,
            nspid,
            path,
            created_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            gpusnap_version: crate::BUILD.to_owned(),
            driver_version,
            gpus: Vec::new(),
            allocations: Vec::new(),
            files: Vec::new(),
            chunks: Vec::new(),
            timings_s: BTreeMap::new(),
            requires: None,
        }
    }

    /// The data-file index of `files[pos]`: the `<index>` in `gpusnap-<nspid>-data-<index>.img`.
    /// `None` if there is no such entry or its name is not exactly that form for this process.
    pub fn file_index_at(&self, pos: usize) -> Option<u32> {
        match parse_file_name(&self.files.get(pos)?.name)? {
            ImageFileKind::Data { nspid, index } if nspid == self.nspid => Some(index),
            _ => None,
        }
    }

    /// The entry of data file `index` (the number in its name, as in [`ChunkEntry::file`]).
    pub fn file(&self, index: u32) -> Option<&FileEntry> {
        let name = data_file_name(self.nspid, index);
        self.files.iter().find(|f| f.name == name)
    }

    /// The data-file indexes of `files`, in their order there (invalid names skipped). Iterate
    /// over these, not `0..files.len()`: indexes may have gaps.
    pub fn file_indexes(&self) -> Vec<u32> {
        (0..self.files.len())
            .filter_map(|i| self.file_index_at(i))
            .collect()
    }
}

/// The checks [`crate::write_manifest`] makes of `m` before writing it, but the ancestors':
/// only [`FORMAT_VERSION`] is written, and a manifest a restore would refuse never is.
pub(crate) fn check_for_write(dir: BorrowedFd<'_>, m: &Manifest) -> Result<(), ImageError> {
    let name = manifest_file_name(m.nspid);
    if m.format_version != FORMAT_VERSION {
        return Err(ImageError::UnsupportedVersion {
            file: name,
            found: m.format_version.into(),
        });
    }
    validate::validate_structure(m, &name)?;
    check_requirements(m, &name)?;
    validate::validate_files(dir, m, &name)?;
    check_kfd_state(dir, m)
}

/// The bytes of a manifest file for `m`, without any validation. For tests, fuzzing and tools
/// that need to produce damaged images on purpose; the plugin uses [`write_manifest`].
#[doc(hidden)]
pub fn encode_manifest_unchecked(m: &Manifest) -> Vec<u8> {
    let body = serde_json::to_vec(m).expect("a Manifest always serializes");
    let mut out = format!(
        "{MANIFEST_MAGIC} {} {} {:016x}\n",
        m.format_version,
        body.len(),
        xxh3_64(&body)
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// Atomically replaces the manifest of `nspid` with `bytes`.
pub(crate) fn write_manifest_bytes(
    dir: BorrowedFd<'_>,
    nspid: NsPid,
    bytes: &[u8],
) -> Result<(), ImageError> {
    atomic_write(
        dir,
        &manifest_file_name(nspid),
        &manifest_tmp_name(nspid),
        bytes,
    )
}

/// temp file + write + fsync + renameat + (advisory) fsync of the directory.
pub(crate) fn atomic_write(
    dir: BorrowedFd<'_>,
    name: &str,
    tmp: &str,
    bytes: &[u8],
) -> Result<(), ImageError> {
    let result = (|| {
        let mut f =
            sys::create_fresh(dir, tmp).map_err(|e| ImageError::io(tmp, IoOp::Create, e))?;
        f.write_all(bytes)
            .map_err(|e| ImageError::io(tmp, IoOp::Write, e))?;
        f.sync_all()
            .map_err(|e| ImageError::io(tmp, IoOp::Fsync, e))?;
        drop(f);
        sys::rename_at(dir, tmp, name).map_err(|e| ImageError::io(name, IoOp::Rename, e))
    })();
    if result.is_err() {
        let _ = sys::unlink_at(dir, tmp, true);
        return result;
    }
    if let Err(e) = sys::fsync_dir(dir) {
        log::debug!("fsync of the image directory after writing {name}: {e}");
    }
    Ok(())
}

/// A canonical decimal number (digits only, no leading zeros).
fn canonical_u64(s: &[u8]) -> Option<u64> {
    if s.is_empty() || !s.iter().all(u8::is_ascii_digit) || (s.len() > 1 && s[0] == b'0') {
        return None;
    }
    std::str::from_utf8(s).ok()?.parse().ok()
}

/// The fields of a manifest header line, and its length including `\n`.
struct HeaderLine {
    version: u64,
    body_len: u64,
    checksum: u64,
    line_len: usize,
}

fn parse_header_line(head: &[u8], file: &str) -> Result<HeaderLine, ImageError> {
    let bad = |detail| ImageError::ManifestHeader {
        file: file.to_owned(),
        detail,
    };
    let Some(nl) = head.iter().position(|&b| b == b'\n') else {
        return Err(bad("no header line"));
    };
    let mut words = head[..nl].split(|&b| b == b' ');
    if words.next() != Some(MANIFEST_MAGIC.as_bytes()) {
        return Err(bad("not a gpusnap manifest (bad magic)"));
    }
    let version = words
        .next()
        .and_then(canonical_u64)
        .ok_or(bad("bad version field"))?;
    if !READ_MANIFEST_VERSIONS
        .iter()
        .any(|&v| u64::from(v) == version)
    {
        return Err(ImageError::UnsupportedVersion {
            file: file.to_owned(),
            found: version,
        });
    }
    let body_len = words
        .next()
        .and_then(canonical_u64)
        .ok_or(bad("bad length field"))?;
    let sum = words.next().ok_or(bad("no checksum field"))?;
    if sum.len() != 16 || !sum.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(bad("checksum field is not 16 lowercase hex digits"));
    }
    let checksum = std::str::from_utf8(sum)
        .ok()
        .and_then(|s| u64::from_str_radix(s, 16).ok())
        .ok_or(bad("bad checksum field"))?;
    if words.next().is_some() {
        return Err(bad("extra fields"));
    }
    Ok(HeaderLine {
        version,
        body_len,
        checksum,
        line_len: nl + 1,
    })
}

/// [`crate::read_manifest`] without following references to ancestor images.
pub(crate) fn read_manifest_local(
    dir: BorrowedFd<'_>,
    nspid: NsPid,
) -> Result<Manifest, ImageError> {
    let name = manifest_file_name(nspid);
    let (file, size) = sys::open_regular(dir, &name)?;

    let mut head = [0u8; MAX_HEADER_LINE];
    let head_len = size.min(MAX_HEADER_LINE as u64) as usize;
    file.read_exact_at(&mut head[..head_len], 0)
        .map_err(|e| ImageError::io(&name, IoOp::Read, e))?;
    let h = parse_header_line(&head[..head_len], &name)?;
    if h.body_len > MAX_MANIFEST_BODY {
        return Err(ImageError::ManifestTooLarge {
            file: name,
            len: h.body_len,
        });
    }
    let expected = h.line_len as u64 + h.body_len;
    if size < expected {
        return Err(ImageError::Truncated {
            file: name,
            expected,
            actual: size,
        });
    }
    if size > expected {
        return Err(ImageError::TrailingData {
            file: name,
            expected,
            actual: size,
        });
    }

    // body_len is now bounded by MAX_MANIFEST_BODY and by the file's real size.
    let mut body = vec![0u8; h.body_len as usize];
    file.read_exact_at(&mut body, h.line_len as u64)
        .map_err(|e| ImageError::io(&name, IoOp::Read, e))?;
    if xxh3_64(&body) != h.checksum {
        return Err(ImageError::ManifestChecksum { file: name });
    }
    let m: Manifest = serde_json::from_slice(&body).map_err(|source| ImageError::ManifestJson {
        file: name.clone(),
        source,
    })?;
    if u64::from(m.format_version) != h.version {
        return Err(ImageError::ManifestHeader {
            file: name,
            detail: "the header line and the body disagree on the format version",
        });
    }
    if m.nspid != nspid {
        return Err(ImageError::NspidMismatch {
            file: name,
            expected: nspid,
            found: m.nspid,
        });
    }
    validate::validate_structure(&m, &name)?;
    check_requirements(&m, &name)?;
    validate::validate_files(dir, &m, &name)?;
    check_kfd_state(dir, &m)?;
    Ok(m)
}

/// A `kfd`-path manifest goes with the process's KFD state file, and the two must agree.
fn check_kfd_state(dir: BorrowedFd<'_>, m: &Manifest) -> Result<(), ImageError> {
    if m.path == CheckpointPath::Kfd {
        let s = crate::read_kfd_state(dir, m.nspid)?;
        crate::check_kfd_state_against_manifest(&s, m)?;
    }
    Ok(())
}
