//! `gpusnap-devfile-<id>.img`: an NVIDIA device file a process held open without CUDA state
//! the driver can checkpoint (for example `/dev/nvidiactl` kept by an NVML user, or inherited
//! over `fork`). CRIU cannot dump such a file; the plugin records its path and open flags and
//! opens it again at restore. A per-GPU node (`/dev/nvidia<N>`) also records which GPU it was
//! (its UUID), so that a restore onto other GPUs opens the node of the GPU that GPU went to.
//!
//! Layout (little-endian), version 2, 8 + 4 + 4 + 16 + 2 + len + 8 bytes: `GPUSNAPF` magic,
//! format version (u32), open flags (i32), the GPU's UUID (16 bytes, all zero: none), path
//! length (u16), path bytes, xxh3-64 of everything before it. Version 1 (still read) has no
//! UUID field: 8 + 4 + 4 + 2 + len + 8 bytes.

use std::io::Read;
use std::os::fd::BorrowedFd;

use crate::manifest::atomic_write;
use crate::{ImageError, IoOp, sys};

pub const DEVFILE_MAGIC: &[u8; 8] = b"GPUSNAPF";
/// The device-file record version written: 2 added the GPU's UUID.
pub const DEVFILE_FORMAT_VERSION: u32 = 2;
/// The oldest device-file record version read (1: path and flags only).
pub const DEVFILE_FORMAT_VERSION_MIN: u32 = 1;
/// Longest accepted path (NVIDIA device nodes are short).
const MAX_PATH: usize = 64;

/// What is needed to open the device file again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevFileRecord {
    /// `/dev/nvidia*` only.
    pub path: String,
    /// `open(2)` flags (access mode, `O_NONBLOCK`, ...).
    pub flags: i32,
    /// The GPU a per-GPU node (`/dev/nvidia<N>`) was at dump, as 32 lowercase hex digits (the
    /// form of [`crate::GpuRecord::uuid`]); `None` for the driver's other nodes
    /// (`/dev/nvidiactl`, `/dev/nvidia-uvm`, ...), where the dump could not tell, and in version 1
    /// records.
    pub gpu: Option<String>,
}

/// `gpu` as the record's 16 bytes (all zero for none); `None` if it is not 32 hex digits or is
/// all zero.
fn uuid_bytes(gpu: Option<&str>) -> Option<[u8; 16]> {
    let Some(hex) = gpu else {
        return Some([0; 16]);
    };
    if hex.len() != 32
        || !hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    (out != [0; 16]).then_some(out)
}

fn uuid_hex(b: &[u8]) -> Option<String> {
    (b.iter().any(|&x| x != 0)).then(|| b.iter().map(|x| format!("{x:02x}")).collect())
}

/// `gpusnap-devfile-<id>.img` (`id`: CRIU's file id).
pub fn devfile_name(id: u32) -> String {
    format!("gpusnap-devfile-{id}.img")
}

/// The CRIU file id a name of [`devfile_name`]'s form is for.
fn devfile_id(name: &str) -> Option<u32> {
    crate::names::canonical_u32(
        name.strip_prefix("gpusnap-devfile-")?
            .strip_suffix(".img")?,
    )
}

/// The ids of every device-file record in `dir`, ascending (a restore's `init` checks each
/// before CRIU creates any process).
pub fn list_dev_files(dir: BorrowedFd<'_>) -> Result<Vec<u32>, ImageError> {
    let names = sys::list_dir(dir).map_err(|e| ImageError::io(".", IoOp::Readdir, e))?;
    let mut ids: Vec<u32> = names.iter().filter_map(|n| devfile_id(n)).collect();
    ids.sort_unstable();
    Ok(ids)
}

/// The GPU number of a per-GPU node's path (`/dev/nvidia<N>`, N decimal): the GPU's device
/// minor, as the NVIDIA driver names its nodes. `None` for the driver's other nodes.
pub fn gpu_node_number(path: &str) -> Option<u32> {
    crate::names::canonical_u32(path.strip_prefix("/dev/nvidia")?)
}

/// Whether gpusnap handles this path: an NVIDIA device node, nothing that could leave `/dev`.
pub fn is_nvidia_device_path(path: &str) -> bool {
    let Some(rest) = path.strip_prefix("/dev/nvidia") else {
        return false;
    };
    path.len() <= MAX_PATH
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'/')
        && !rest.contains("//")
        && !path.contains("..")
}

fn invalid(id: u32, detail: &str) -> ImageError {
    ImageError::InvalidManifest {
        file: devfile_name(id),
        detail: detail.to_owned(),
    }
}

/// Encodes a record (refusing paths that are not NVIDIA device nodes).
pub fn encode_dev_file(id: u32, rec: &DevFileRecord) -> Result<Vec<u8>, ImageError> {
    if !is_nvidia_device_path(&rec.path) {
        return Err(invalid(
            id,
            &format!("{:?} is not an NVIDIA device node", rec.path),
        ));
    }
    let Some(gpu) = uuid_bytes(rec.gpu.as_deref()) else {
        return Err(invalid(
            id,
            &format!("GPU {:?} is not 32 lowercase hex digits", rec.gpu),
        ));
    };
    let mut b = Vec::with_capacity(V2_FIXED + rec.path.len());
    b.extend_from_slice(DEVFILE_MAGIC);
    b.extend_from_slice(&DEVFILE_FORMAT_VERSION.to_le_bytes());
    b.extend_from_slice(&rec.flags.to_le_bytes());
    b.extend_from_slice(&gpu);
    b.extend_from_slice(&(rec.path.len() as u16).to_le_bytes());
    b.extend_from_slice(rec.path.as_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    Ok(b)
}

/// Bytes of a version-1 record besides the path: magic, version, flags, length, checksum.
const V1_FIXED: usize = 8 + 4 + 4 + 2 + 8;
/// Version 2 adds the GPU's 16-byte UUID after the flags.
const V2_FIXED: usize = V1_FIXED + 16;

/// Decodes and checks a record: magic, version, exact length, checksum, path, GPU.
pub fn decode_dev_file(id: u32, b: &[u8]) -> Result<DevFileRecord, ImageError> {
    if b.len() < V1_FIXED || &b[..8] != DEVFILE_MAGIC {
        return Err(invalid(
            id,
            "not a gpusnap device-file record (bad magic or too short)",
        ));
    }
    let version = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
    // Where the path length is: after the flags, and after the GPU's UUID from version 2.
    let len_at = match version {
        1 => 16,
        2 => 32,
        _ => {
            return Err(invalid(
                id,
                &format!(
                    "format version {version}, expected {DEVFILE_FORMAT_VERSION_MIN} to {DEVFILE_FORMAT_VERSION}"
                ),
            ));
        }
    };
    if b.len() < len_at + 2 + 8 {
        return Err(invalid(
            id,
            "length does not match the path length (truncated?)",
        ));
    }
    let flags = i32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
    let gpu = uuid_hex(&b[16..len_at]);
    let len = u16::from_le_bytes(b[len_at..len_at + 2].try_into().expect("2 bytes")) as usize;
    let path_at = len_at + 2;
    if len > MAX_PATH || b.len() != path_at + len + 8 {
        return Err(invalid(
            id,
            "length does not match the path length (truncated?)",
        ));
    }
    let sum = u64::from_le_bytes(b[path_at + len..].try_into().expect("8 bytes"));
    if sum != xxhash_rust::xxh3::xxh3_64(&b[..path_at + len]) {
        return Err(invalid(id, "checksum mismatch (image damaged)"));
    }
    let path = std::str::from_utf8(&b[path_at..path_at + len])
        .map_err(|_| invalid(id, "path is not UTF-8"))?
        .to_owned();
    if !is_nvidia_device_path(&path) {
        return Err(invalid(
            id,
            &format!("{path:?} is not an NVIDIA device node"),
        ));
    }
    Ok(DevFileRecord { path, flags, gpu })
}

/// Writes the record, mode 0600, atomically.
pub fn write_dev_file(dir: BorrowedFd<'_>, id: u32, rec: &DevFileRecord) -> Result<(), ImageError> {
    let bytes = encode_dev_file(id, rec)?;
    let name = devfile_name(id);
    atomic_write(dir, &name, &format!("{name}.tmp"), &bytes)
}

/// Reads and checks the record of file `id`.
pub fn read_dev_file(dir: BorrowedFd<'_>, id: u32) -> Result<DevFileRecord, ImageError> {
    let name = devfile_name(id);
    let (file, _) = sys::open_regular(dir, &name)?;
    let mut b = Vec::new();
    file.take(256)
        .read_to_end(&mut b)
        .map_err(|e| ImageError::io(&name, IoOp::Read, e))?;
    decode_dev_file(id, &b)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn round_trip_and_every_damage_refused() {
        for gpu in [None, Some(UUID.to_owned())] {
            let rec = DevFileRecord {
                path: "/dev/nvidia3".into(),
                flags: libc::O_RDWR | libc::O_NONBLOCK,
                gpu,
            };
            let b = encode_dev_file(7, &rec).unwrap();
            assert_eq!(decode_dev_file(7, &b).unwrap(), rec);
            every_damage_refused(&b);
        }
    }

    /// Version 2's layout, byte by byte: the UUID at 16..32, the path length at 32.
    #[test]
    fn version_2_layout_is_fixed() {
        let rec = DevFileRecord {
            path: "/dev/nvidia3".into(),
            flags: 2,
            gpu: Some(UUID.into()),
        };
        let b = encode_dev_file(1, &rec).unwrap();
        assert_eq!(b.len(), V2_FIXED + 12);
        assert_eq!(&b[..8], b"GPUSNAPF");
        assert_eq!(b[8..12], 2u32.to_le_bytes());
        assert_eq!(b[12..16], 2i32.to_le_bytes());
        assert_eq!(
            b[16..32],
            [
                0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
                0xcd, 0xef
            ]
        );
        assert_eq!(b[32..34], 12u16.to_le_bytes());
        assert_eq!(&b[34..46], b"/dev/nvidia3");
        let sum = xxhash_rust::xxh3::xxh3_64(&b[..46]);
        assert_eq!(b[46..], sum.to_le_bytes());
        // No GPU: sixteen zero bytes.
        let none = DevFileRecord { gpu: None, ..rec };
        assert_eq!(encode_dev_file(1, &none).unwrap()[16..32], [0u8; 16]);
    }

    /// A record as gpusnap before version 2 wrote it (path and flags only) still reads, without
    /// a GPU.
    #[test]
    fn version_1_records_are_still_read() {
        let mut b = Vec::new();
        b.extend_from_slice(b"GPUSNAPF");
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&(libc::O_RDWR).to_le_bytes());
        b.extend_from_slice(&12u16.to_le_bytes());
        b.extend_from_slice(b"/dev/nvidia0");
        let sum = xxhash_rust::xxh3::xxh3_64(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        assert_eq!(b.len(), V1_FIXED + 12);
        let rec = decode_dev_file(4, &b).unwrap();
        assert_eq!(
            rec,
            DevFileRecord {
                path: "/dev/nvidia0".into(),
                flags: libc::O_RDWR,
                gpu: None,
            }
        );
        every_damage_refused(&b);
        let mut v3 = b.clone();
        v3[8] = 3;
        let e = decode_dev_file(4, &v3).unwrap_err().to_string();
        assert!(e.contains("format version 3, expected 1 to 2"), "{e}");
    }

    #[test]
    fn a_gpu_that_is_no_uuid_is_not_written() {
        for bad in ["0123", "0123456789ABCDEF0123456789ABCDEF", &"0".repeat(32)] {
            let rec = DevFileRecord {
                path: "/dev/nvidia0".into(),
                flags: 0,
                gpu: Some(bad.into()),
            };
            assert!(encode_dev_file(1, &rec).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_and_node_numbers() {
        assert_eq!(devfile_id(&devfile_name(17)), Some(17));
        for bad in [
            "gpusnap-devfile-017.img",
            "gpusnap-devfile-.img",
            "gpusnap-devfile-1.img.tmp",
        ] {
            assert_eq!(devfile_id(bad), None, "{bad}");
        }
        assert_eq!(gpu_node_number("/dev/nvidia0"), Some(0));
        assert_eq!(gpu_node_number("/dev/nvidia12"), Some(12));
        for other in [
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia01",
            "/dev/nvidia",
        ] {
            assert_eq!(gpu_node_number(other), None, "{other}");
        }
    }

    fn every_damage_refused(b: &[u8]) {
        for i in 0..b.len() {
            let mut d = b.to_vec();
            d[i] ^= 0x10;
            assert!(decode_dev_file(7, &d).is_err(), "flip at {i} accepted");
        }
        for n in 0..b.len() {
            assert!(
                decode_dev_file(7, &b[..n]).is_err(),
                "truncation to {n} accepted"
            );
        }
        let mut longer = b.to_vec();
        longer.push(0);
        assert!(decode_dev_file(7, &longer).is_err());
    }

    #[test]
    fn only_nvidia_device_nodes() {
        for ok in [
            "/dev/nvidiactl",
            "/dev/nvidia0",
            "/dev/nvidia-uvm",
            "/dev/nvidia-caps/nvidia-cap1",
        ] {
            assert!(is_nvidia_device_path(ok), "{ok}");
        }
        for bad in [
            "/etc/passwd",
            "/dev/nvidia/../sda",
            "/dev/nvidia0 ",
            "/dev/nvidia\0",
            "/dev/nvidia//x",
            "dev/nvidia0",
        ] {
            assert!(!is_nvidia_device_path(bad), "{bad:?}");
            let rec = DevFileRecord {
                path: bad.into(),
                flags: 0,
                gpu: None,
            };
            assert!(encode_dev_file(1, &rec).is_err());
        }
    }
}
