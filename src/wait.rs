//! `gpusnap wait DIR [--timeout SECONDS]`: waits until every process's image in DIR is complete
//! or failed. An asynchronous `criu dump -R` (`async_leave_running`) returns before the GPU data
//! is in the image; until a process gpusnap left behind (the drainer) has written it, the
//! directory holds `gpusnap-<pid>-PENDING.txt`, which names that process.
//!
//! Exit: 0 every image complete; 1 a process's image failed (its NOT-A-CHECKPOINT marker, whose
//! cause is printed, or a PENDING marker whose writer is gone: it will never be removed);
//! 3 no gpusnap image in DIR (or no such DIR); 4 DIR unreadable; 5 still pending at the timeout.

use std::os::fd::AsFd;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpusnap_host::pid::{HostPid, NsPid};
use gpusnap_image::ImageFileKind;

use crate::util::{self, EXIT_NOTHING, EXIT_PENDING, EXIT_PROBLEM};

const SYNOPSIS: &str = "DIR [--timeout SECONDS]";

/// How often the directory is looked at again.
const POLL: Duration = Duration::from_millis(50);

/// What the directory says of its images, at one look.
#[derive(Debug, PartialEq, Eq)]
enum State {
    /// No gpusnap file at all.
    Nothing,
    /// Every process has a manifest and no marker.
    Complete(Vec<NsPid>),
    /// A process's image failed: its name, and why.
    Failed { nspid: NsPid, why: String },
    /// Still being written (the first pending process).
    Pending { nspid: NsPid, owner: (HostPid, u64) },
}

pub fn run(args: &[String]) -> ExitCode {
    let mut dir = None;
    let mut timeout = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--timeout" => {
                let Some(v) = it.next() else {
                    return util::usage_error("wait", SYNOPSIS, "--timeout needs a value");
                };
                match v.parse::<f64>() {
                    Ok(s) if s.is_finite() && s >= 0.0 => {
                        timeout = Some(Duration::from_secs_f64(s));
                    }
                    _ => {
                        return util::usage_error(
                            "wait",
                            SYNOPSIS,
                            &format!("--timeout {v:?}: not a number of seconds"),
                        );
                    }
                }
            }
            s if s.starts_with('-') => {
                return util::usage_error("wait", SYNOPSIS, &format!("unknown option {s:?}"));
            }
            s if dir.is_none() => dir = Some(s.to_owned()),
            s => return util::usage_error("wait", SYNOPSIS, &format!("unexpected {s:?}")),
        }
    }
    let Some(dir) = dir else {
        return util::usage_error("wait", SYNOPSIS, "DIR is missing");
    };
    let file = match util::open_dir(&dir) {
        Ok(f) => f,
        Err(e) => return e.exit("wait"),
    };
    let started = Instant::now();
    let mut said = false;
    loop {
        let state = match look(file.as_fd()) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("gpusnap wait: {dir}: {e}");
                return ExitCode::from(util::EXIT_ENVIRONMENT);
            }
        };
        match state {
            State::Nothing => {
                println!("{dir}: no gpusnap images (nothing to wait for)");
                return ExitCode::from(EXIT_NOTHING);
            }
            State::Complete(procs) => {
                println!(
                    "{dir}: complete ({} process{}) after {:.1} s",
                    procs.len(),
                    if procs.len() == 1 { "" } else { "es" },
                    started.elapsed().as_secs_f64()
                );
                return ExitCode::SUCCESS;
            }
            State::Failed { nspid, why } => {
                println!("FAIL  process {nspid}: {why}");
                return ExitCode::from(EXIT_PROBLEM);
            }
            State::Pending { nspid, owner } => {
                if !alive(owner) {
                    // Looked at again: the writer may have finished between the two looks.
                    if let Ok(State::Pending { nspid: n, owner: o }) = look(file.as_fd())
                        && (n, o) == (nspid, owner)
                    {
                        println!(
                            "FAIL  process {nspid}: {} is left by process {} that is gone: the image will never be complete (not a checkpoint; dump the job again)",
                            gpusnap_image::pending_marker_name(nspid),
                            owner.0
                        );
                        return ExitCode::from(EXIT_PROBLEM);
                    }
                    continue;
                }
                if !said {
                    eprintln!(
                        "gpusnap wait: {dir}: process {nspid}'s GPU data is being written by pid {}",
                        owner.0
                    );
                    said = true;
                }
                if timeout.is_some_and(|t| started.elapsed() >= t) {
                    println!(
                        "{dir}: still pending after {:.1} s ({})",
                        started.elapsed().as_secs_f64(),
                        gpusnap_image::pending_marker_name(nspid)
                    );
                    return ExitCode::from(EXIT_PENDING);
                }
                std::thread::sleep(POLL);
            }
        }
    }
}

/// One look at the directory.
fn look(dir: std::os::fd::BorrowedFd<'_>) -> Result<State, gpusnap_image::ImageError> {
    let files = gpusnap_image::list_image_files(dir)?;
    if let Some((nspid, name)) = files.iter().find_map(|(k, n)| match k {
        ImageFileKind::Failed { nspid } => Some((*nspid, n)),
        _ => None,
    }) {
        let why = read_small(dir, name).unwrap_or_default();
        let cause = why
            .lines()
            .find_map(|l| l.strip_prefix("Cause: "))
            .unwrap_or("no cause given");
        return Ok(State::Failed {
            nspid,
            why: format!("{name}: not a checkpoint: {cause}"),
        });
    }
    if let Some((nspid, name)) = files.iter().find_map(|(k, n)| match k {
        ImageFileKind::Pending { nspid } => Some((*nspid, n)),
        _ => None,
    }) {
        // A marker being replaced (its owner handed over) may be missing for an instant: an
        // unreadable one names no owner that could be alive, so it is looked at again.
        let owner = read_small(dir, name)
            .and_then(|t| gpusnap_image::pending_owner(&t))
            .unwrap_or((HostPid(0), 0));
        return Ok(State::Pending { nspid, owner });
    }
    if let Some((nspid, file)) = gpusnap_image::unfinished_dumps(dir)?.into_iter().next() {
        return Ok(State::Failed {
            nspid,
            why: format!("{file}: its dump did not finish (no manifest): not a checkpoint"),
        });
    }
    let manifests = gpusnap_image::list_manifests(dir)?;
    if manifests.is_empty() {
        return Ok(State::Nothing);
    }
    Ok(State::Complete(manifests))
}

/// Whether the process `pid` that started at `start` still runs.
fn alive((pid, start): (HostPid, u64)) -> bool {
    if pid.get() <= 0 {
        // An unreadable marker: taken for alive once; the second look decides.
        return true;
    }
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        gpusnap_host::procfs::Stat::parse(&s)
            .is_some_and(|st| st.start_time() == Some(start) && !st.exited())
    })
}

/// A marker's text (at most 64 KiB), read through the directory's descriptor.
fn read_small(dir: std::os::fd::BorrowedFd<'_>, name: &str) -> Option<String> {
    use std::io::Read;
    let path = format!(
        "/proc/self/fd/{}/{name}",
        std::os::fd::AsRawFd::as_raw_fd(&dir)
    );
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .ok()?;
    let mut s = String::new();
    f.take(64 << 10).read_to_string(&mut s).ok()?;
    Some(s)
}

use std::os::unix::fs::OpenOptionsExt;

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> (tempdir::Dir, std::fs::File) {
        let d = tempdir::Dir::new();
        let f = std::fs::File::open(&d.0).unwrap();
        (d, f)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "gpusnap-wait-test-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    fn me() -> (HostPid, u64) {
        let pid = HostPid(std::process::id() as i32);
        let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let start = gpusnap_host::procfs::Stat::parse(&s)
            .unwrap()
            .start_time()
            .unwrap();
        (pid, start)
    }

    #[test]
    fn a_directory_is_pending_failed_or_complete_as_its_markers_say() {
        let (d, f) = dir();
        assert_eq!(look(f.as_fd()).unwrap(), State::Nothing);
        let (pid, start) = me();
        let pending = d.0.join(gpusnap_image::pending_marker_name(NsPid(7)));
        std::fs::write(&pending, gpusnap_image::pending_text(pid, start, "test")).unwrap();
        // A manifest beside it does not make it complete.
        std::fs::write(d.0.join(gpusnap_image::manifest_file_name(NsPid(7))), b"x").unwrap();
        let s = look(f.as_fd()).unwrap();
        assert_eq!(
            s,
            State::Pending {
                nspid: NsPid(7),
                owner: (pid, start)
            }
        );
        assert!(alive((pid, start)));
        // The same pid with another start time is another process: gone.
        assert!(!alive((pid, start + 1)));
        std::fs::remove_file(&pending).unwrap();
        assert_eq!(look(f.as_fd()).unwrap(), State::Complete(vec![NsPid(7)]));
        std::fs::remove_file(d.0.join(gpusnap_image::manifest_file_name(NsPid(7)))).unwrap();
        std::fs::write(
            d.0.join(gpusnap_image::failed_marker_name(NsPid(7))),
            "This directory is NOT a usable checkpoint.\nCause: the keeper died\n",
        )
        .unwrap();
        match look(f.as_fd()).unwrap() {
            State::Failed {
                nspid: NsPid(7),
                why,
            } => assert!(why.contains("the keeper died"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
