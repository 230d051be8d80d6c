//! Whether the process is held by the tracer that checkpoints it: the agent releases memory or
//! loads it only then (`docs/design-notes.md`, "Fail closed").
//!
//! During a checkpoint, restore, rollback or `gpusnap recover`, the tracer holds every thread of
//! the process in a ptrace stop and lets run only the agent's thread and the driver's restore
//! thread. A client that asks for a release or a load while the application runs (anyone who
//! can connect: root or the owner) would free memory under it or overwrite live data, so such a
//! request is refused, whoever sends it.

use std::{fmt, io};

/// Why the process does not count as held by a tracer.
#[derive(Debug)]
pub enum NotHeld {
    /// `/proc/self/task` could not be read.
    ListThreads(io::Error),
    /// These threads (other than the caller) are neither in a ptrace stop nor exited.
    Running(Vec<i32>),
}

impl fmt::Display for NotHeld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ListThreads(e) => write!(f, "cannot list this process's threads: {e}"),
            Self::Running(tids) => write!(
                f,
                "{} threads of this process run (tids {tids:?}): memory is released or loaded only while a checkpoint holds the application's threads stopped",
                tids.len()
            ),
        }
    }
}

impl std::error::Error for NotHeld {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::ListThreads(e) => Some(e),
            Self::Running(_) => None,
        }
    }
}

/// `Ok` when every thread of this process but the caller and at most one other is in a ptrace
/// stop (state `t`), exited threads aside; else what runs.
pub fn by_a_tracer() -> Result<(), NotHeld> {
    if crate::role::keeper() {
        // A keeper runs no application: its memory is the job's, lent to it.
        return Ok(());
    }
    let running = running_threads().map_err(NotHeld::ListThreads)?;
    if running.len() <= 1 {
        return Ok(());
    }
    Err(NotHeld::Running(running))
}

/// The threads of this process, other than the caller, that are neither in a ptrace stop nor
/// exited.
fn running_threads() -> io::Result<Vec<i32>> {
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() };
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/task")?.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if tid == me {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue; // exited meanwhile
        };
        if !matches!(state_of(&stat), Some("t" | "Z" | "X")) {
            out.push(tid);
        }
    }
    Ok(out)
}

/// The state letter of a `stat` line (after the command name, which may hold spaces and
/// parentheses).
fn state_of(stat: &str) -> Option<&str> {
    stat.get(stat.rfind(')')? + 1..)?.split_whitespace().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_is_read_after_the_command_name() {
        assert_eq!(state_of("42 (a b) c)) t 1 42"), Some("t"));
        assert_eq!(state_of("42 (x) S 1"), Some("S"));
        assert_eq!(state_of("garbage"), None);
    }

    #[test]
    fn a_process_whose_threads_run_is_not_held() {
        // The test harness runs this with other threads of its own; two sleepers make sure.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::thread::sleep(std::time::Duration::from_millis(5));
                    }
                })
            })
            .collect();
        let r = by_a_tracer();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in threads {
            t.join().unwrap();
        }
        let e = r.unwrap_err().to_string();
        assert!(e.contains("threads of this process run"), "{e}");
    }
}
