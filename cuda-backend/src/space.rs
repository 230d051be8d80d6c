//! The disk space a hand-over's drain will write ([`gpusnap_image::Reservation`]), held from
//! PAUSE on, on a thread of its own beside the rest of the dump's work (the keeper's start, the
//! lock, CRIU's seizing, the lend), instead of on the job's pause: on tmpfs holding 16 GiB
//! zeroes 16 GiB of pages, 1.17 s on the H100 host. The hand-over joins it before anything is
//! released, so that a disk without room still fails the dump with the job intact, as when the
//! space was taken there.

use gpusnap_host::pid::HostPid;
use gpusnap_image::{Reservation, ReserveError};
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

/// A reservation being taken since PAUSE. Dropped unjoined (no hand-over came of it), it is
/// stopped and what it held is handed back before the drop returns.
pub struct EarlySpace {
    bytes: u64,
    started: Instant,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Taken>>,
}

/// What the thread made, and how long it took.
struct Taken {
    result: Result<Reservation, ReserveError>,
    took_s: f64,
}

impl std::fmt::Debug for EarlySpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EarlySpace")
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl EarlySpace {
    /// Starts holding `bytes` in `dir` with up to `threads` threads; `None` (the hand-over takes
    /// the space itself) if no thread could be started. Boxed: it waits in the process's plan.
    pub fn start(
        pid: HostPid,
        dir: BorrowedFd<'static>,
        bytes: u64,
        threads: usize,
    ) -> Option<Box<EarlySpace>> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let spawned = std::thread::Builder::new()
            .name("gpusnap-space".into())
            .spawn(move || {
                // Its allocating threads inherit this mask: CRIU's signals stay CRIU's.
                gpusnap_host::signals::block_all();
                let t0 = Instant::now();
                let result = Reservation::take_until(dir, bytes, threads, &stopped);
                Taken {
                    result,
                    took_s: t0.elapsed().as_secs_f64(),
                }
            });
        match spawned {
            Ok(handle) => Some(Box::new(EarlySpace {
                bytes,
                started: Instant::now(),
                stop,
                handle: Some(handle),
            })),
            Err(e) => {
                log::debug!("pid {pid}: the drain's space is taken at the hand-over: {e}");
                None
            }
        }
    }

    /// Waits for the reservation: what it made and how long it took.
    fn join(&mut self) -> Option<Taken> {
        let handle = self.handle.take()?;
        Some(handle.join().unwrap_or_else(|_| Taken {
            result: Err(ReserveError::Io(std::io::Error::other(
                "the reserving thread panicked",
            ))),
            took_s: self.started.elapsed().as_secs_f64(),
        }))
    }
}

impl Drop for EarlySpace {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            self.stop.store(true, Ordering::Relaxed);
            let _ = handle.join();
        }
    }
}

/// The space for a drain of `bytes` in `dir` (the image directory `early` was started in, if
/// any): what `early` held, trimmed to `bytes` or topped up to them, else taken now with up to
/// `threads` threads. Logs how long the caller waited for it.
pub fn hold(
    pid: HostPid,
    dir: BorrowedFd<'_>,
    early: Option<Box<EarlySpace>>,
    bytes: u64,
    threads: usize,
) -> Result<Reservation, ReserveError> {
    let t0 = Instant::now();
    let asked = early.as_ref().map(|e| e.bytes);
    let (held, took_s) = match early.and_then(|mut e| e.join()) {
        Some(Taken {
            result: Ok(mut r),
            took_s,
        }) => {
            if r.bytes() > bytes {
                // The job holds less than it listed at PAUSE.
                r.release(r.bytes() - bytes);
            } else if r.bytes() < bytes {
                r.merge(Reservation::take(dir, bytes - r.bytes(), threads)?);
            }
            (r, took_s)
        }
        // PAUSE asked for more than the job holds now: what it holds may still fit.
        Some(Taken {
            result: Err(ReserveError::NoSpace { .. } | ReserveError::Stopped),
            ..
        }) if asked.is_some_and(|a| a > bytes) => (Reservation::take(dir, bytes, threads)?, 0.0),
        Some(Taken { result: Err(e), .. }) => return Err(e),
        None => (Reservation::take(dir, bytes, threads)?, 0.0),
    };
    let waited_s = t0.elapsed().as_secs_f64();
    let when = if asked.is_some() {
        format!("taken from PAUSE on in {took_s:.3} s")
    } else {
        "taken at the hand-over".to_owned()
    };
    log::info!(
        "pid {pid}: space for the drain held: {:.2} GiB in {} pieces, {when}; the hand-over waited {waited_s:.3} s for it",
        bytes as f64 / (1u64 << 30) as f64,
        held.pieces(),
    );
    Ok(held)
}
