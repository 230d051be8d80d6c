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

/// Every exit status, with what it means (for `--help` and `docs/cli.md`).
pub const EXITS: [(u8, &str); 5] = [
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
