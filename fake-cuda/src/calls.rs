//! The checkpoint lock waits for the process's CUDA calls in flight, as the real driver's does.
//!
//! `libfakecudadev.so` (the workload side, `fake-cuda-device/src/calls.rs`) counts each working
//! call while it runs and writes the counter's address into `$FAKECUDA_DIR/<pid>.calls`. After
//! the lock state is written, [`wait_until_none`] reads that counter through `/proc/<pid>/mem`
//! until it is zero: a call that started before the lock has then returned, and every later
//! one waits for the unlock. A process without the file (the unit tests' targets, workloads with
//! the state page) is not waited for; a counter without its magic word (a stale file of a pid
//! used again) neither.

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// `FKCALLS1` in native byte order: the first word of the counter.
pub const MAGIC: u64 = u64::from_ne_bytes(*b"FKCALLS1");
/// How long a lock without a timeout of its own waits for calls in flight.
const DEFAULT_WAIT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(1);

/// `$FAKECUDA_DIR/<pid>.calls`.
pub fn path(dir: &Path, pid: i32) -> std::path::PathBuf {
    dir.join(format!("{pid}.calls"))
}

/// Parses the file's contents (an address in hex); `None` when malformed.
pub fn parse_address(s: &str) -> Option<u64> {
    u64::from_str_radix(s.trim(), 16).ok().filter(|a| *a != 0)
}

/// The number of calls in flight, `None` when `pid` publishes no counter (or it is not one).
fn in_flight(dir: &Path, pid: i32) -> Option<u64> {
    let addr = parse_address(&fs::read_to_string(path(dir, pid)).ok()?)?;
    let mem = fs::File::open(format!("/proc/{pid}/mem")).ok()?;
    let mut b = [0u8; 16];
    mem.read_exact_at(&mut b, addr).ok()?;
    let word = |at: usize| u64::from_ne_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    (word(0) == MAGIC).then(|| word(8))
}

/// Returns once no call of `pid` is in flight; `Err` (a message) after `timeout_ms` (0: the
/// default of 10 s) with calls still running.
pub fn wait_until_none(dir: &Path, pid: i32, timeout_ms: u32) -> Result<(), String> {
    let limit = match timeout_ms {
        0 => DEFAULT_WAIT,
        ms => Duration::from_millis(u64::from(ms)),
    };
    let start = Instant::now();
    loop {
        match in_flight(dir, pid) {
            None | Some(0) => return Ok(()),
            Some(n) if start.elapsed() >= limit => {
                return Err(format!(
                    "lock timed out after {} ms: {n} CUDA calls of pid {pid} still running; the process stays running",
                    limit.as_millis()
                ));
            }
            Some(_) => std::thread::sleep(POLL),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(parse_address("7f00aa001000\n"), Some(0x7f00_aa00_1000));
        assert_eq!(parse_address("0"), None);
        assert_eq!(parse_address("zz"), None);
        assert_eq!(parse_address(""), None);
    }

    #[test]
    fn a_published_counter_is_waited_for_until_it_is_zero() {
        use std::sync::atomic::{AtomicU64, Ordering};
        #[repr(C)]
        struct Counter {
            magic: AtomicU64,
            n: AtomicU64,
        }
        static C: Counter = Counter {
            magic: AtomicU64::new(MAGIC),
            n: AtomicU64::new(1),
        };
        let dir = std::env::temp_dir().join(format!("fakecuda-calls-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        let pid = std::process::id() as i32;
        fs::write(
            path(&dir, pid),
            format!("{:x}\n", std::ptr::from_ref(&C) as usize),
        )
        .expect("write");
        assert_eq!(in_flight(&dir, pid), Some(1));
        let e = wait_until_none(&dir, pid, 20).expect_err("a call in flight");
        assert!(e.contains("1 CUDA calls"), "{e}");
        let t = std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            C.n.store(0, Ordering::SeqCst);
        });
        wait_until_none(&dir, pid, 5000).expect("the call returned");
        t.join().expect("join");
        // Not a counter there: not waited for.
        C.magic.store(0, Ordering::SeqCst);
        C.n.store(5, Ordering::SeqCst);
        assert_eq!(in_flight(&dir, pid), None);
        fs::remove_dir_all(&dir).expect("clean");
    }
}
