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
        let mut text = format!("gpusnap: {}", r.args()).replace('\0', "\\0");
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
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        match criu::print_on_level() {
            // SAFETY: a fixed "%s" format with one NUL-terminated string argument.
            Some(print) => unsafe { print(level, c"%s".as_ptr(), line.as_ptr()) },
            None => eprint!("{}", line.to_string_lossy()),
        }
    }

    fn flush(&self) {}
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
