//! Small helpers shared by the subcommands: exit codes, argument errors, the image directory,
//! human-readable sizes.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::process::ExitCode;

pub const EXIT_PROBLEM: u8 = 1;
pub const EXIT_USAGE: u8 = 2;

/// Prints a usage error for `cmd` and returns exit status 2.
pub fn usage_error(cmd: &str, synopsis: &str, msg: &str) -> ExitCode {
    eprintln!("gpusnap {cmd}: {msg}\nusage: gpusnap {cmd} {synopsis}");
    ExitCode::from(EXIT_USAGE)
}

/// Opens an image directory the way the plugin sees it: as a directory file descriptor.
pub fn open_dir(path: &str) -> Result<File, String> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("{path}: {e}"))
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
