//! The checkpoint lock waits for the process's CUDA calls in flight, as the real driver's does.
//!
//! `libfakecudadev.so` (the workload side, `criu-tests/fake-cuda-device/src/calls.rs`) gives each working
//! call of a thread a slot holding the thread's id while it runs, and writes the slots' address
//! into `$FAKECUDA_DIR/<pid>.calls`. After the lock state is written, [`wait_until_none`] reads
//! the slots through `/proc/<pid>/mem` until none names a thread that runs: a call that started
//! before the lock has then returned, and every later one waits for the unlock. A slot of a
//! stopped thread (ptrace or job control) or of a thread the process does not have does not
//! count: it cannot finish a call, and it was stopped at the gate's edge (the lock of `PAUSE` is
//! taken while the threads run, so CRIU seizes none inside a call). A process without the file
//! (the unit tests' targets, workloads with the state page) is not waited for; slots without
//! their magic word (a stale file of a pid used again) neither.

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// `FKCALLS2` in native byte order: the first word of the slots.
pub const MAGIC: u64 = u64::from_ne_bytes(*b"FKCALLS2");
/// Slots after the magic word and the overflow count.
pub const SLOTS: usize = 64;
const BYTES: usize = 16 + 4 * SLOTS;
/// How long a lock without a timeout of its own waits for calls in flight (a bound the real
/// driver does not have: it keeps a test from hanging).
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

/// What the slots say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Slots {
    /// Calls without a slot (more than [`SLOTS`] at once).
    pub overflow: u64,
    /// The threads in calls.
    pub tids: Vec<u32>,
}

/// Parses the slots' bytes; `None` without the magic word.
pub fn parse_slots(b: &[u8; BYTES]) -> Option<Slots> {
    let u64_at = |at: usize| u64::from_ne_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    if u64_at(0) != MAGIC {
        return None;
    }
    let tids = (0..SLOTS)
        .map(|i| u32::from_ne_bytes(b[16 + 4 * i..20 + 4 * i].try_into().expect("4 bytes")))
        .filter(|t| *t != 0)
        .collect();
    Some(Slots {
        overflow: u64_at(8),
        tids,
    })
}

/// The slots `pid` publishes, `None` when it publishes none (or they are not slots).
fn slots_of(dir: &Path, pid: i32) -> Option<Slots> {
    let addr = parse_address(&fs::read_to_string(path(dir, pid)).ok()?)?;
    let mem = fs::File::open(format!("/proc/{pid}/mem")).ok()?;
    let mut b = [0u8; BYTES];
    mem.read_exact_at(&mut b, addr).ok()?;
    parse_slots(&b)
}

/// Whether thread `tid` of `pid` exists and is not stopped (state `t` or `T`).
fn runs(pid: i32, tid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")) else {
        return false;
    };
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next());
    !matches!(state, Some("t" | "T") | None)
}

/// The calls of `pid` the lock waits for: those of running threads, and any without a slot.
fn busy(dir: &Path, pid: i32) -> Option<String> {
    let s = slots_of(dir, pid)?;
    let running: Vec<u32> = s.tids.iter().copied().filter(|&t| runs(pid, t)).collect();
    (s.overflow > 0 || !running.is_empty()).then(|| {
        format!(
            "CUDA calls of pid {pid} still running (threads {running:?}{})",
            if s.overflow > 0 {
                format!(", and {} more", s.overflow)
            } else {
                String::new()
            }
        )
    })
}

/// Returns once no call of `pid` is in flight: `Ok(true)` if it had to wait; `Err` (a message)
/// after `timeout_ms` (0: the default of 10 s) with calls still running.
pub fn wait_until_none(dir: &Path, pid: i32, timeout_ms: u32) -> Result<bool, String> {
    let limit = match timeout_ms {
        0 => DEFAULT_WAIT,
        ms => Duration::from_millis(u64::from(ms)),
    };
    let start = Instant::now();
    let mut waited = false;
    loop {
        match busy(dir, pid) {
            None => return Ok(waited),
            Some(what) if start.elapsed() >= limit => {
                return Err(format!(
                    "lock timed out after {} ms: {what}; the process stays running",
                    limit.as_millis()
                ));
            }
            Some(_) => {
                waited = true;
                std::thread::sleep(POLL);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

    #[test]
    fn addresses() {
        assert_eq!(parse_address("7f00aa001000\n"), Some(0x7f00_aa00_1000));
        assert_eq!(parse_address("0"), None);
        assert_eq!(parse_address("zz"), None);
        assert_eq!(parse_address(""), None);
    }

    #[repr(C)]
    struct Published {
        magic: AtomicU64,
        overflow: AtomicU64,
        tids: [AtomicU32; SLOTS],
    }
    static P: Published = Published {
        magic: AtomicU64::new(MAGIC),
        overflow: AtomicU64::new(0),
        tids: [const { AtomicU32::new(0) }; SLOTS],
    };

    /// This process publishes slots like a workload; a thread of its own in a slot holds the
    /// lock up until it leaves, a tid this process does not have does not.
    #[test]
    fn a_running_thread_in_a_slot_is_waited_for_and_others_are_not() {
        let dir = std::env::temp_dir().join(format!("fakecuda-calls-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        let pid = std::process::id() as i32;
        fs::write(
            path(&dir, pid),
            format!("{:x}\n", std::ptr::from_ref(&P) as usize),
        )
        .expect("write");
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() } as u32;
        P.tids[3].store(me, Ordering::SeqCst);
        assert_eq!(slots_of(&dir, pid).expect("slots").tids, vec![me]);
        let e = wait_until_none(&dir, pid, 20).expect_err("a call in flight");
        assert!(e.contains(&format!("threads [{me}]")), "{e}");
        let t = std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            P.tids[3].store(0, Ordering::SeqCst);
        });
        assert_eq!(
            wait_until_none(&dir, pid, 5000),
            Ok(true),
            "waited for the call"
        );
        t.join().expect("join");
        // A thread this process does not have (a forked child's copy of its parent's slots).
        P.tids[5].store(u32::MAX - 1, Ordering::SeqCst);
        assert_eq!(wait_until_none(&dir, pid, 20), Ok(false));
        P.tids[5].store(0, Ordering::SeqCst);
        // Calls without a slot always count.
        P.overflow.store(1, Ordering::SeqCst);
        assert!(wait_until_none(&dir, pid, 20).is_err());
        P.overflow.store(0, Ordering::SeqCst);
        // Not slots there: not waited for.
        P.magic.store(0, Ordering::SeqCst);
        P.tids[3].store(me, Ordering::SeqCst);
        assert_eq!(slots_of(&dir, pid), None);
        P.tids[3].store(0, Ordering::SeqCst);
        P.magic.store(MAGIC, Ordering::SeqCst);
        fs::remove_dir_all(&dir).expect("clean");
    }

    #[test]
    fn a_stopped_or_missing_thread_does_not_run() {
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() } as u32;
        assert!(runs(std::process::id() as i32, me));
        assert!(!runs(std::process::id() as i32, u32::MAX - 1));
    }
}
