//! Logging: one line per message on stderr, prefixed `gpusnap-agent:`, written with a single
//! `write(2)` (no std locks, no buffering). [`debug!`] is silent unless `GPUSNAP_AGENT_DEBUG=1`;
//! [`error!`] always writes, for the few failures nobody else would report (a bad setting, memory
//! an undo could not give back): the agent otherwise stays quiet inside someone else's process.

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

/// Logs always, as `error: ...`. Never reads the settings, so their parser can report with it.
macro_rules! error {
    ($($arg:tt)*) => {
        $crate::log::write_line(format_args!("error: {}", format_args!($($arg)*)))
    };
}
pub(crate) use error;

/// Writes one line to stderr.
pub fn write_line(args: fmt::Arguments<'_>) {
    // SAFETY: getpid and gettid have no preconditions.
    let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
    let line = format!("gpusnap-agent: [{pid}/{tid}] {args}\n");
    #[cfg(test)]
    if capture::take(&line) {
        return;
    }
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

/// Tests read what the code under test logs (their own thread's lines) instead of stderr.
#[cfg(test)]
pub(crate) mod capture {
    use std::cell::RefCell;

    thread_local! {
        static LINES: RefCell<Option<Vec<String>>> = const { RefCell::new(None) };
    }

    /// Runs `f`, returning what it logged on this thread (lines without the prefix).
    pub fn logged<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
        LINES.with(|l| *l.borrow_mut() = Some(Vec::new()));
        let out = f();
        (
            out,
            LINES.with(|l| l.borrow_mut().take()).unwrap_or_default(),
        )
    }

    /// Keeps `line` when this thread is capturing.
    pub(super) fn take(line: &str) -> bool {
        LINES.with(|l| match l.borrow_mut().as_mut() {
            Some(lines) => {
                let text = line.split_once("] ").map_or(line, |(_, t)| t);
                lines.push(text.trim_end().to_owned());
                true
            }
            None => false,
        })
    }
}
