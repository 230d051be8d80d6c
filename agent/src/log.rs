//! Debug logging: silent unless `GPUSNAP_AGENT_DEBUG=1`, then one line per message on stderr,
//! prefixed `gpusnap-agent:`, written with a single `write(2)` (no std locks, no buffering).

use std::fmt;

/// Logs when debugging is on (format arguments are not evaluated otherwise).
macro_rules! debug {
    ($($arg:tt)*) => {
        if $crate::config::config().debug {
            $crate::log::write_line(format_args!($($arg)*));
        }
    };
}
pub(crate) use debug;

/// Writes one line to stderr.
pub fn write_line(args: fmt::Arguments<'_>) {
    // SAFETY: getpid and gettid have no preconditions.
    let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
    let line = format!("gpusnap-agent: [{pid}/{tid}] {args}\n");
    let mut rest = line.as_bytes();
    while !rest.is_empty() {
        // SAFETY: rest is a valid byte slice; fd 2 may be closed, then write fails harmlessly.
        let n = unsafe { libc::write(2, rest.as_ptr().cast(), rest.len()) };
        if n <= 0 {
            break;
        }
        rest = &rest[n as usize..];
    }
}
