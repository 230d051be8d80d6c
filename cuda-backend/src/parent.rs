//! The parent image an incremental dump compares against: found through the image directory's
//! `parent` link, read back and checked whole before anything of it is referenced.

use std::collections::{BTreeSet, HashMap};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use gpusnap_host::pid::{HostPid, NsPid};
use gpusnap_image::{AllocationRecord, ImageError, VerifyReport};

/// One process's parent image, read back and checked: the outcome, and how long it took.
type Checked = (Result<Option<VerifyReport>, ImageError>, f64);

/// The parent images of an incremental dump, read back and checked on a thread of their own
/// from the dump's start ([`start_checks`], at `init`): the check then runs beside CRIU's seize,
/// the lock and the hand-over instead of after them (16 GiB took 1.1 s on the H200, which the
/// final dump of a pre-copy chain otherwise waited for). Each process's result is published as
/// soon as its own parent is checked; a dump's process takes it here, and one that finds none
/// checks its parent itself. The thread is joined at the dump's end ([`finish_checks`]).
#[derive(Default)]
struct Checks {
    /// Processes whose parent the thread has still to check.
    pending: BTreeSet<NsPid>,
    results: HashMap<NsPid, Checked>,
    thread: Option<JoinHandle<()>>,
}

/// One dump per CRIU process, so one set of checks.
static CHECKS: Mutex<Option<Checks>> = Mutex::new(None);
static CHECKED: Condvar = Condvar::new();

fn checks() -> MutexGuard<'static, Option<Checks>> {
    CHECKS.lock().unwrap_or_else(|e| e.into_inner())
}

/// At the dump's `init`: when `dir` has a parent link and `incremental` is on, starts reading
/// back and checking every process's parent image there, with `threads` readers.
pub fn start_checks(dir: BorrowedFd<'_>, incremental: bool, threads: usize) {
    if !incremental {
        return;
    }
    let pdir = match gpusnap_image::open_parent_dir(dir, gpusnap_image::PARENT_LINK) {
        Ok(Some(d)) => d,
        // No parent (a full dump), or one the dump reports when it looks (parent_index).
        Ok(None) | Err(_) => return,
    };
    let Ok(nspids) = gpusnap_image::list_manifests(pdir.as_fd()) else {
        return;
    };
    let Ok(dir) = dir.try_clone_to_owned() else {
        return;
    };
    let mut g = checks();
    *g = Some(Checks {
        pending: nspids.iter().copied().collect(),
        ..Checks::default()
    });
    let started = std::thread::Builder::new()
        .name("gpusnap-parent".into())
        .spawn(move || check_all(&dir, &nspids, threads));
    match started {
        Ok(h) => {
            log::debug!("parent images being checked from the dump's start");
            if let Some(c) = g.as_mut() {
                c.thread = Some(h);
            }
        }
        Err(e) => {
            *g = None;
            log::debug!("parent images not checked ahead ({e}): each dump checks its own");
        }
    }
}

fn check_all(dir: &OwnedFd, nspids: &[NsPid], threads: usize) {
    gpusnap_host::signals::block_all();
    gpusnap_host::logger::defer_this_thread();
    for &nspid in nspids {
        let t0 = Instant::now();
        let r = gpusnap_image::verify_parent(dir.as_fd(), nspid, threads);
        let mut g = checks();
        if let Some(c) = g.as_mut() {
            c.pending.remove(&nspid);
            c.results.insert(nspid, (r, t0.elapsed().as_secs_f64()));
        }
        CHECKED.notify_all();
    }
}

/// `nspid`'s result of [`start_checks`] (waiting for it if need be), taken once; None when none
/// were started or they hold none for it.
fn take_checked(nspid: NsPid) -> Option<(Checked, f64)> {
    let t0 = Instant::now();
    let mut g = checks();
    // Bounded by the thread's life: one that stopped without publishing (a panic) leaves the
    // process to check its own parent, never to wait for ever.
    while g.as_ref().is_some_and(|c| {
        c.pending.contains(&nspid) && !c.thread.as_ref().is_some_and(|t| t.is_finished())
    }) {
        g = CHECKED
            .wait_timeout(g, std::time::Duration::from_millis(100))
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    let waited = t0.elapsed().as_secs_f64();
    g.as_mut()?.results.remove(&nspid).map(|c| (c, waited))
}

/// At the dump's end: waits for the checks still running (none may outlive the plugin) and
/// forgets them.
pub fn finish_checks() {
    let thread = checks().take().and_then(|c| c.thread);
    if let Some(t) = thread {
        let _ = t.join();
    }
}

/// For an incremental dump: the parent image's chunks this process may reference, if the image
/// directory has a usable `parent` link and `incremental` is on. The parent is read and checked
/// first, every chunk of it (`verify_parent`): a damaged parent makes this a full dump, so an
/// image never references bytes that do not read back. Anything else is a full dump too, with
/// the reason in the log. (The copy-first route and `gpusnap precopy` use this; the hand-over's
/// drain takes [`parent_candidate`] and [`parent_checked`] apart, so that the check runs beside
/// its copy instead of before it.)
pub fn parent_index(
    dir: BorrowedFd<'_>,
    pid: HostPid,
    nspid: NsPid,
    allocations: &[AllocationRecord],
    incremental: bool,
    threads: usize,
) -> Option<gpusnap_image::DedupIndex> {
    let index = parent_candidate(dir, pid, nspid, allocations, incremental)?;
    parent_checked(dir, pid, nspid, threads).then_some(index)
}

/// The parent image's chunks this process could reference, **not yet checked**: nothing of it
/// may reach a manifest before [`parent_checked`] says the parent reads back whole. None (a
/// full dump, the reason logged) without a usable parent or with `incremental` off.
pub fn parent_candidate(
    dir: BorrowedFd<'_>,
    pid: HostPid,
    nspid: NsPid,
    allocations: &[AllocationRecord],
    incremental: bool,
) -> Option<gpusnap_image::DedupIndex> {
    use gpusnap_image::ParentImage;
    let found = gpusnap_image::parent_for_dedup(dir, nspid, allocations);
    let index = match found {
        ParentImage::None => return None,
        _ if !incremental => {
            log::info!(
                "pid {pid}: the image directory has a parent link, but incremental = false: full dump"
            );
            return None;
        }
        ParentImage::Unusable(why) => {
            log::info!("pid {pid}: full dump, parent image not used: {why}");
            return None;
        }
        ParentImage::Usable(index) => index,
    };
    log::info!(
        "pid {pid}: incremental dump against the parent image ({} chunks to compare{})",
        index.len(),
        if index.too_deep > 0 {
            format!(
                ", {} already {} links deep are stored again",
                index.too_deep,
                gpusnap_image::MAX_CHAIN_DEPTH
            )
        } else {
            String::new()
        }
    );
    Some(index)
}

/// Whether `nspid`'s parent image read back whole: the check started at `init`
/// ([`start_checks`], waited for) or, if none was, one made now with `threads` readers.
/// Logs the outcome; false (damaged, or gone) means nothing of the parent may be referenced.
pub fn parent_checked(dir: BorrowedFd<'_>, pid: HostPid, nspid: NsPid, threads: usize) -> bool {
    let t0 = Instant::now();
    let (checked, when) = match take_checked(nspid) {
        Some(((r, secs), waited)) => (
            r,
            format!("{secs:.3} s, from the dump's start; waited {waited:.3} s for it"),
        ),
        None => {
            let r = gpusnap_image::verify_parent(dir, nspid, threads);
            (r, format!("{:.3} s", t0.elapsed().as_secs_f64()))
        }
    };
    match checked {
        Ok(Some(report)) => {
            log::info!(
                "pid {pid}: parent image read back and checked: {:.2} GiB in {when}",
                report.bytes as f64 / (1u64 << 30) as f64,
            );
            true
        }
        Ok(None) => {
            log::warn!("pid {pid}: the parent image is gone: nothing of it referenced");
            false
        }
        Err(e) => {
            log::warn!(
                "pid {pid}: the parent image is damaged ({e}): a full dump instead, nothing of it referenced"
            );
            false
        }
    }
}
