//! A `log` backend that writes into CRIU's own log through `print_on_level`.
//!
//! CRIU formats into one static buffer, so calls are serialised here; lines carry the
//! `gpusnap:` prefix. Outside CRIU (unit tests, the CLI) lines go to stderr.

use crate::criu;
use std::ffi::CString;
use std::sync::{Mutex, OnceLock};

struct CriuLogger {
    lock: Mutex<()>,
}

thread_local! {
    /// Set on threads that run while CRIU's main thread works (the drain): CRIU formats every
    /// line in one static buffer and does not lock it, so their lines wait in [`DEFERRED`]
    /// until the main thread prints them ([`print_deferred`]).
    static DEFERS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

static DEFERRED: Mutex<Vec<(u32, CString)>> = Mutex::new(Vec::new());

/// Lines logged by this thread from now on are kept until [`print_deferred`].
pub fn defer_this_thread() {
    DEFERS.with(|d| d.set(true));
}

/// Prints the lines other threads deferred, in order (on CRIU's main thread).
pub fn print_deferred() {
    let lines = std::mem::take(&mut *DEFERRED.lock().unwrap_or_else(|e| e.into_inner()));
    for (level, line) in lines {
        print(level, &line);
    }
}

/// Prints one line now, also from a thread whose lines are deferred: only for the test fault
/// points, the instant before CRIU is killed. It is written straight to CRIU's log descriptor
/// in one write(2), not through CRIU's unlocked format buffer: on the H200 a drain thread's
/// line printed that way was overwritten by CRIU's main thread, which was logging at the
/// same moment, and the kill went unrecorded.
pub fn print_now(text: &str) {
    let line = prefixed(text) + "\n";
    // SAFETY: CRIU's getter takes no arguments.
    match criu::log_get_fd().map(|f| unsafe { f() }) {
        Some(fd) if fd >= 0 => write_all(fd, line.as_bytes()),
        _ => {
            if let Ok(line) = CString::new(line) {
                print(criu::level::WARN, &line);
            }
        }
    }
}

/// write(2) of all of `bytes` to `fd`, retrying short writes and EINTR; gives up on an error
/// (a log line is not worth more).
fn write_all(fd: i32, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: write(2) of a live byte slice to a descriptor number; a bad one only fails.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if n <= 0 {
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

/// `text` as lines of CRIU's log: each line of it prefixed `gpusnap: `, so nothing in it can
/// pass for a line of CRIU's, and every other control character (escape sequences, carriage
/// returns, NUL) written as an escape. Text from the job (an agent's error, a path) can reach a
/// message; this is the last guard, after the quoting where such text is shown.
pub fn prefixed(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 10);
    out.push_str("gpusnap: ");
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\ngpusnap:   "),
            c if c.is_control() => out.extend(c.escape_debug()),
            c => out.push(c),
        }
    }
    out
}

fn print(level: u32, line: &CString) {
    match criu::print_on_level() {
        // SAFETY: a fixed "%s" format with one NUL-terminated string argument.
        Some(print) => unsafe { print(level, c"%s".as_ptr(), line.as_ptr()) },
        None => eprint!("{}", line.to_string_lossy()),
    }
}

impl log::Log for CriuLogger {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::max_level()
    }

    fn log(&self, r: &log::Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let level = match r.level() {
            log::Level::Error => criu::level::ERROR,
            log::Level::Warn => criu::level::WARN,
            log::Level::Info => criu::level::INFO,
            _ => criu::level::DEBUG,
        };
        let mut text = prefixed(&r.args().to_string());
        // CRIU's buffer is 8 KiB; keep well inside it.
        if text.len() > 4000 {
            let mut cut = 4000;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        text.push('\n');
        let Ok(line) = CString::new(text) else { return };
        if DEFERS.with(|d| d.get()) {
            let mut q = DEFERRED.lock().unwrap_or_else(|e| e.into_inner());
            // Bounded: a drain that logs without end must not eat CRIU's memory.
            if q.len() < 10_000 {
                q.push((level, line));
            }
            return;
        }
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        print(level, &line);
    }

    fn flush(&self) {}
}

/// Logs `msg` as an error and says it on CRIU's stderr too, where the user running CRIU sees
/// it: CRIU writes its log (errors included) to the `-o` file only, and `print_on_level`'s
/// one terminal level, `LOG_MSG`, goes to stdout. Skipped where the log already is stderr
/// (CRIU run without `-o`), so the line is not shown twice. For the refusals a user must act
/// on before anything can run (a bad configuration, a bad test knob).
pub fn tell_user(msg: &str) {
    log::error!("{msg}");
    if criu::print_on_level().is_none() || log_is_stderr() || rpc_mode() {
        return;
    }
    write_all(2, (prefixed(msg) + "\n").as_bytes());
}

/// Whether this CRIU serves a runtime over RPC (`criu swrk`, as runc, crun and so Podman and
/// containerd start it, or `criu service`): its stdio then is not a user's terminal. runc gives
/// a checkpoint's CRIU none (`/dev/null`) and a restore's the container's own, where gpusnap's
/// words must never land; the runtime shows CRIU's log and the image directory's marker instead.
pub fn rpc_mode() -> bool {
    std::fs::read("/proc/self/cmdline").is_ok_and(|c| {
        c.split(|b| *b == 0)
            .nth(1)
            .is_some_and(|arg| arg == b"swrk" || arg == b"service")
    })
}

/// Whether CRIU's log descriptor is the same file as its stderr.
fn log_is_stderr() -> bool {
    // SAFETY: CRIU's getter takes no arguments.
    let Some(fd) = criu::log_get_fd().map(|f| unsafe { f() }) else {
        return false;
    };
    let id = |fd: i32| {
        // SAFETY: stat is plain data that fstat fills or leaves.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on a descriptor number with a writable stat.
        (unsafe { libc::fstat(fd, &mut st) } == 0).then_some((st.st_dev, st.st_ino))
    };
    fd == 2 || (id(fd).is_some() && id(fd) == id(2))
}

/// Installs the logger once and follows CRIU's `-v` level (or the configured one).
pub fn init(configured: Option<log::LevelFilter>) {
    static LOGGER: OnceLock<CriuLogger> = OnceLock::new();
    let logger = LOGGER.get_or_init(|| CriuLogger {
        lock: Mutex::new(()),
    });
    let _ = log::set_logger(logger);
    let level = configured.unwrap_or_else(|| {
        // SAFETY: CRIU's getter takes no arguments.
        match criu::log_get_loglevel().map(|f| unsafe { f() }) {
            Some(0 | 1) => log::LevelFilter::Error,
            Some(2) => log::LevelFilter::Warn,
            Some(3) => log::LevelFilter::Info,
            Some(_) => log::LevelFilter::Debug,
            None => log::LevelFilter::Info,
        }
    });
    log::set_max_level(level);
    std::panic::set_hook(Box::new(|info| {
        log::error!("internal error (panic): {info}; please report this as a gpusnap bug");
    }));
}

#[cfg(test)]
mod tests {
    use super::prefixed;

    #[test]
    fn every_line_is_prefixed_and_control_characters_are_escaped() {
        let forged = "x\n(00.9) Dumping finished successfully\x1b[2K\r\0";
        let out = prefixed(forged);
        assert_eq!(
            out,
            "gpusnap: x\ngpusnap:   (00.9) Dumping finished successfully\\u{1b}[2K\\r\\0"
        );
        assert!(out.lines().all(|l| l.starts_with("gpusnap: ")));
    }
}
