//! Small helpers shared by the subcommands: exit codes, argument errors, the image directory,
//! human-readable sizes.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::process::ExitCode;

/// A problem was found: damage, a failed check, a recover or round that did not succeed.
pub const EXIT_PROBLEM: u8 = 1;
/// The command line is wrong.
pub const EXIT_USAGE: u8 = 2;
/// Nothing was found to act on: no gpusnap image in the directory, or no such directory.
pub const EXIT_NOTHING: u8 = 3;
/// The environment kept the command from its work: the configuration, the driver, permissions.
/// `check`, whose work is to find such problems, reports them as [`EXIT_PROBLEM`].
pub const EXIT_ENVIRONMENT: u8 = 4;
/// `wait` timed out: an image is still being written (an asynchronous `criu dump -R`).
pub const EXIT_PENDING: u8 = 5;

/// Every exit status, with what it means (for `--help` and `docs/cli.md`).
pub const EXITS: [(u8, &str); 6] = [
    (0, "ok: intact, ready, done (or nothing needed doing)"),
    (
        EXIT_PROBLEM,
        "a problem was found: damage, a `check` fail line (configuration too), not recovered",
    ),
    (EXIT_USAGE, "usage error"),
    (
        EXIT_NOTHING,
        "nothing found to act on: no gpusnap image in DIR, no such DIR",
    ),
    (
        EXIT_ENVIRONMENT,
        "configuration, driver or permissions stopped the command (`check` reports them: 1)",
    ),
    (
        EXIT_PENDING,
        "`wait` timed out: an image is still pending (being written after `criu dump -R`)",
    ),
];

/// Prints a usage error for `cmd` and returns exit status 2.
pub fn usage_error(cmd: &str, synopsis: &str, msg: &str) -> ExitCode {
    eprintln!("gpusnap {cmd}: {msg}\nusage: gpusnap {cmd} {synopsis} (gpusnap {cmd} --help)");
    ExitCode::from(EXIT_USAGE)
}

/// An image directory that could not be opened, and the exit status that says why.
#[derive(Debug)]
pub struct DirError {
    pub message: String,
    pub code: u8,
}

impl DirError {
    /// Prints `gpusnap <cmd>: <message>` and returns its status.
    pub fn exit(&self, cmd: &str) -> ExitCode {
        eprintln!("gpusnap {cmd}: {}", self.message);
        ExitCode::from(self.code)
    }
}

/// Opens an image directory the way the plugin sees it: as a directory file descriptor. A
/// missing directory (or a path that is not one) is [`EXIT_NOTHING`]; any other failure
/// (permissions, I/O) [`EXIT_ENVIRONMENT`].
pub fn open_dir(path: &str) -> Result<File, DirError> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| DirError {
            code: match e.raw_os_error() {
                Some(libc::ENOENT | libc::ENOTDIR) => EXIT_NOTHING,
                _ => EXIT_ENVIRONMENT,
            },
            message: format!("{path}: {e}"),
        })
}

/// Largest container spec (`spec.dump`) read: a real one is a few KiB.
const MAX_SPEC_BYTES: u64 = 16 << 20;

/// What a container's saved OCI spec (`spec.dump` of a Podman or containerd checkpoint) needs of
/// the node it is restored on, before runc (and so CRIU and gpusnap) runs: the NVIDIA device
/// nodes it names and the mounts of driver files (whose names carry the driver's version).
#[derive(Debug, Default, serde::Serialize)]
pub struct ContainerNeeds {
    /// The spec file read.
    pub spec: String,
    /// `/dev/nvidia*` device nodes of `linux.devices`, and device-node bind mounts.
    pub device_nodes: Vec<String>,
    /// Bind mounts of NVIDIA driver files (`libcuda`, `libnvidia-*`, `nvidia-*` binaries,
    /// firmware), as `source -> destination`.
    pub driver_mounts: Vec<DriverMount>,
    /// Why the spec could not be read, if it could not.
    pub error: Option<String>,
}

#[derive(Debug, serde::Serialize)]
pub struct DriverMount {
    pub source: String,
    pub destination: String,
}

fn is_driver_file(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with("libcuda")
        || name.starts_with("libnvidia")
        || name.starts_with("libnvcuvid")
        || name.starts_with("nvidia-")
        || path.contains("/firmware/nvidia/")
}

impl ContainerNeeds {
    /// Reads the OCI spec at `path` (at most [`MAX_SPEC_BYTES`], not following a final symlink).
    pub fn read(path: &std::path::Path) -> ContainerNeeds {
        let mut needs = ContainerNeeds {
            spec: path.display().to_string(),
            ..Default::default()
        };
        let parsed = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .and_then(|f| {
                use std::io::Read;
                let mut text = Vec::new();
                f.take(MAX_SPEC_BYTES + 1).read_to_end(&mut text)?;
                if text.len() as u64 > MAX_SPEC_BYTES {
                    return Err(std::io::Error::other("larger than 16 MiB"));
                }
                serde_json::from_slice::<serde_json::Value>(&text).map_err(std::io::Error::other)
            });
        let spec = match parsed {
            Ok(v) => v,
            Err(e) => {
                needs.error = Some(e.to_string());
                return needs;
            }
        };
        let devices = spec["linux"]["devices"].as_array().into_iter().flatten();
        for d in devices {
            if let Some(p) = d["path"].as_str()
                && p.starts_with("/dev/nvidia")
            {
                needs.device_nodes.push(p.to_owned());
            }
        }
        for m in spec["mounts"].as_array().into_iter().flatten() {
            let (Some(src), Some(dst)) = (m["source"].as_str(), m["destination"].as_str()) else {
                continue;
            };
            if src.starts_with("/dev/nvidia") {
                if !needs.device_nodes.iter().any(|d| d == src) {
                    needs.device_nodes.push(src.to_owned());
                }
            } else if is_driver_file(src) || is_driver_file(dst) {
                needs.driver_mounts.push(DriverMount {
                    source: src.to_owned(),
                    destination: dst.to_owned(),
                });
            }
        }
        needs
    }

    /// The text report's lines.
    pub fn write_text(&self, out: &mut impl std::io::Write) -> std::io::Result<()> {
        writeln!(out, "container spec {}:", self.spec)?;
        if let Some(e) = &self.error {
            return writeln!(out, "  unreadable: {e}");
        }
        if self.device_nodes.is_empty() && self.driver_mounts.is_empty() {
            writeln!(out, "  names no NVIDIA device node or driver file")?;
        }
        for d in &self.device_nodes {
            writeln!(out, "  needs device node {d}")?;
        }
        for m in &self.driver_mounts {
            writeln!(
                out,
                "  needs driver file {} (at {})",
                m.source, m.destination
            )?;
        }
        Ok(())
    }
}

/// The image directory `arg` names, and the container spec that goes with it: `arg` itself, or
/// its `checkpoint/` when `arg` is a container checkpoint (Podman's export or a
/// containerd/kubelet archive, unpacked: `checkpoint/` beside `spec.dump`), or an archive file
/// unpacked into a bounded temporary directory ([`crate::archive`]), which lives as long as the
/// returned [`crate::archive::Unpacked`].
pub fn image_dir(
    arg: &str,
) -> Result<
    (
        String,
        Option<ContainerNeeds>,
        Option<crate::archive::Unpacked>,
    ),
    DirError,
> {
    let path = std::path::Path::new(arg);
    let unpacked = match std::fs::metadata(path) {
        Ok(md) if md.is_file() => Some(crate::archive::unpack(path).map_err(|e| DirError {
            code: match e {
                crate::archive::ArchiveError::NotAnArchive(_) => EXIT_NOTHING,
                crate::archive::ArchiveError::Temp(_) => EXIT_ENVIRONMENT,
                _ => EXIT_PROBLEM,
            },
            message: format!("{arg}: {e}"),
        })?),
        _ => None,
    };
    let root = unpacked
        .as_ref()
        .map_or_else(|| path.to_path_buf(), |u| u.path().to_path_buf());
    let (images, spec) = if root.join("checkpoint").is_dir() {
        (root.join("checkpoint"), Some(root.join("spec.dump")))
    } else if root.file_name().is_some_and(|n| n == "checkpoint") {
        (root.clone(), root.parent().map(|p| p.join("spec.dump")))
    } else {
        (root.clone(), None)
    };
    let container = spec
        .filter(|s| s.symlink_metadata().is_ok())
        .map(|s| ContainerNeeds::read(&s));
    Ok((images.display().to_string(), container, unpacked))
}

/// `1.50 GiB`, `12.0 MiB`, `512 B`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    let prec = if v < 10.0 {
        2
    } else if v < 100.0 {
        1
    } else {
        0
    };
    format!("{v:.prec$} {}", UNITS[u])
}

/// Device bytes per stored byte (`None` when nothing is stored).
pub fn ratio(bytes: u64, stored: u64) -> Option<f64> {
    (stored > 0).then(|| bytes as f64 / stored as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.00 KiB");
        assert_eq!(bytes(3 << 29), "1.50 GiB");
        assert_eq!(bytes(150 << 20), "150 MiB");
        assert_eq!(ratio(10, 0), None);
        assert_eq!(ratio(10, 5), Some(2.0));
    }
}
