//! `gpusnap-devfile-<id>.img`: an NVIDIA device file a process held open without CUDA state
//! the driver can checkpoint (for example `/dev/nvidiactl` kept by an NVML user, or inherited
//! over `fork`). CRIU cannot dump such a file; the plugin records its path and open flags and
//! opens it again at restore.
//!
//! Layout (little-endian), 8 + 4 + 4 + 2 + len + 8 bytes:
//! `GPUSNAPF` magic, format version (u32), open flags (i32), path length (u16), path bytes,
//! xxh3-64 of everything before it.

use std::io::Read;
use std::os::fd::BorrowedFd;

use crate::manifest::atomic_write;
use crate::{DATA_FORMAT_VERSION, ImageError, IoOp, sys};

pub const DEVFILE_MAGIC: &[u8; 8] = b"GPUSNAPF";
/// Longest accepted path (NVIDIA device nodes are short).
const MAX_PATH: usize = 64;

/// What is needed to open the device file again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevFileRecord {
    /// `/dev/nvidia*` only.
    pub path: String,
    /// `open(2)` flags (access mode, `O_NONBLOCK`, ...).
    pub flags: i32,
}

/// `gpusnap-devfile-<id>.img` (`id`: CRIU's file id).
pub fn devfile_name(id: u32) -> String {
    format!("gpusnap-devfile-{id}.img")
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
    let mut b = Vec::with_capacity(26 + rec.path.len());
    b.extend_from_slice(DEVFILE_MAGIC);
    b.extend_from_slice(&DATA_FORMAT_VERSION.to_le_bytes());
    b.extend_from_slice(&rec.flags.to_le_bytes());
    b.extend_from_slice(&(rec.path.len() as u16).to_le_bytes());
    b.extend_from_slice(rec.path.as_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    Ok(b)
}

/// Decodes and checks a record: magic, version, exact length, checksum, path.
pub fn decode_dev_file(id: u32, b: &[u8]) -> Result<DevFileRecord, ImageError> {
    if b.len() < 26 || &b[..8] != DEVFILE_MAGIC {
        return Err(invalid(
            id,
            "not a gpusnap device-file record (bad magic or too short)",
        ));
    }
    let version = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
    if version != DATA_FORMAT_VERSION {
        return Err(invalid(
            id,
            &format!("format version {version}, expected {DATA_FORMAT_VERSION}"),
        ));
    }
    let flags = i32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
    let len = u16::from_le_bytes(b[16..18].try_into().expect("2 bytes")) as usize;
    if len > MAX_PATH || b.len() != 18 + len + 8 {
        return Err(invalid(
            id,
            "length does not match the path length (truncated?)",
        ));
    }
    let sum = u64::from_le_bytes(b[18 + len..].try_into().expect("8 bytes"));
    if sum != xxhash_rust::xxh3::xxh3_64(&b[..18 + len]) {
        return Err(invalid(id, "checksum mismatch (image damaged)"));
    }
    let path = std::str::from_utf8(&b[18..18 + len])
        .map_err(|_| invalid(id, "path is not UTF-8"))?
        .to_owned();
    if !is_nvidia_device_path(&path) {
        return Err(invalid(
            id,
            &format!("{path:?} is not an NVIDIA device node"),
        ));
    }
    Ok(DevFileRecord { path, flags })
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

    #[test]
    fn round_trip_and_every_damage_refused() {
        let rec = DevFileRecord {
            path: "/dev/nvidiactl".into(),
            flags: libc::O_RDWR | libc::O_NONBLOCK,
        };
        let b = encode_dev_file(7, &rec).unwrap();
        assert_eq!(decode_dev_file(7, &b).unwrap(), rec);
        for i in 0..b.len() {
            let mut d = b.clone();
            d[i] ^= 0x10;
            assert!(decode_dev_file(7, &d).is_err(), "flip at {i} accepted");
        }
        for n in 0..b.len() {
            assert!(
                decode_dev_file(7, &b[..n]).is_err(),
                "truncation to {n} accepted"
            );
        }
        let mut longer = b.clone();
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
            };
            assert!(encode_dev_file(1, &rec).is_err());
        }
    }
}
