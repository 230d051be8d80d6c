//! The driver state in the process's own memory, for workloads that run under a pid that is not
//! their host pid (containers).
//!
//! By default this side reads the checkpoint lock from `$FAKECUDA_DIR/<getpid()>.state`
//! ([`crate::lock`]). In a container `getpid()` is the pid in the container's namespace while
//! the checkpoint side (`fake-cuda`, inside CRIU on the host) names files by host pid, so the
//! two would never meet. With `FAKECUDADEV_STATE_PAGE=1` in the workload's environment, `cuInit`
//! maps the page `fake-cuda` keeps a process's state in when it finds one
//! (`fakecuda::state_page`: a memfd named `fakecuda-state`, the same layout), and the lock is
//! read from that page instead: the checkpoint side finds it by host pid through `/proc`, and
//! CRIU dumps and restores it with the process whatever pid the restore gives it.
//!
//! Layout (shared with `fake-cuda`, native byte order): bytes 0..8 the magic `FKCUDAST`, 8..12
//! the version (1), 12..16 the state (0 running, 1 locked, 2 checkpointed, 3 failed), 16..20
//! the number of GPUs recorded (0 here), the rest zero. The Podman test's split case runs it
//! against `fake-cuda` end to end.
//!
//! The page is `MADV_DONTFORK`, as in `fake-cuda`'s workloads: a forked child has no page until
//! its own `cuInit`, and its inherited address is forgotten at the fork.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The variable that turns the page on: `1` on, `0` or unset off; anything else is an error.
pub const ENV: &str = "FAKECUDADEV_STATE_PAGE";
pub const PAGE_BYTES: usize = 4096;
pub const MAGIC: [u8; 8] = *b"FKCUDAST";
pub const VERSION: u32 = 1;
const STATE_AT: usize = 12;

/// The page's address in this process (0: none).
static PAGE: AtomicUsize = AtomicUsize::new(0);

/// Whether `FAKECUDADEV_STATE_PAGE` asks for the page; `Err` names a malformed value.
pub fn wanted() -> Result<bool, String> {
    match std::env::var(ENV) {
        Err(std::env::VarError::NotPresent) => Ok(false),
        Ok(v) if v == "0" => Ok(false),
        Ok(v) if v == "1" => Ok(true),
        Ok(v) => Err(format!("{ENV}={v:?}: must be 1 or 0")),
        Err(std::env::VarError::NotUnicode(v)) => Err(format!("{ENV}={v:?}: must be 1 or 0")),
    }
}

/// The bytes of a fresh page: state `running`, no GPUs recorded.
pub fn fresh_page() -> Vec<u8> {
    let mut b = vec![0u8; PAGE_BYTES];
    b[0..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_ne_bytes());
    b
}

extern "C" fn forget_in_child() {
    PAGE.store(0, Ordering::Release);
}

/// Maps this process's page, once (later calls do nothing).
pub fn create() -> Result<(), String> {
    static CREATING: Mutex<()> = Mutex::new(());
    let _guard = CREATING.lock().unwrap_or_else(|e| e.into_inner());
    if PAGE.load(Ordering::Acquire) != 0 {
        return Ok(());
    }
    // SAFETY: memfd_create reads a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"fakecuda-state".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(format!(
            "memfd_create(fakecuda-state): {}",
            std::io::Error::last_os_error()
        ));
    }
    let result = (|| {
        // SAFETY: `fd` is the memfd just created; ftruncate only sizes it.
        if unsafe { libc::ftruncate(fd, PAGE_BYTES as libc::off_t) } != 0 {
            return Err(format!("ftruncate: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: a new shared mapping of the memfd at an address the kernel picks; nothing
        // else refers to that range. It is never unmapped (the driver's state lives as long
        // as the process).
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        let page = fresh_page();
        // SAFETY: `addr` is the PAGE_BYTES mapping just made, writable; `page` has PAGE_BYTES
        // bytes. MADV_DONTFORK only changes what fork copies. The fork handler only stores to
        // an atomic and stays valid while this library is loaded.
        unsafe {
            std::ptr::copy_nonoverlapping(page.as_ptr(), addr.cast::<u8>(), PAGE_BYTES);
            libc::madvise(addr, PAGE_BYTES, libc::MADV_DONTFORK);
            libc::pthread_atfork(None, None, Some(forget_in_child));
        }
        PAGE.store(addr as usize, Ordering::Release);
        Ok(())
    })();
    // SAFETY: `fd` is ours; the mapping keeps the memfd alive without it.
    unsafe { libc::close(fd) };
    result.map_err(|e| format!("setting up the fakecuda-state page: {e}"))
}

/// The state word of this process's page (`None`: no page).
pub fn state() -> Option<u32> {
    let addr = PAGE.load(Ordering::Acquire);
    if addr == 0 {
        return None;
    }
    // SAFETY: `addr` is this process's page, mapped by `create` and never unmapped (a forked
    // child forgets it); the word is 4-aligned. The checkpoint side writes it from another
    // process through /proc/<pid>/mem, hence the volatile read.
    Some(unsafe { std::ptr::read_volatile((addr + STATE_AT) as *const u32) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    /// The page's address in `/proc/self/maps`, as the checkpoint side finds it.
    fn in_maps() -> Option<u64> {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(5) == Some(&"/memfd:fakecuda-state"))
                .then(|| u64::from_str_radix(f[0].split('-').next().unwrap(), 16).unwrap())
        })
    }

    #[test]
    fn the_page_is_found_and_a_state_written_through_proc_is_read() {
        assert!(state().is_none() || PAGE.load(Ordering::Acquire) != 0);
        create().unwrap();
        create().unwrap();
        let addr = in_maps().expect("no fakecuda-state page in /proc/self/maps");
        assert_eq!(addr as usize, PAGE.load(Ordering::Acquire));
        let mem = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/proc/self/mem")
            .unwrap();
        let mut b = vec![0u8; PAGE_BYTES];
        mem.read_exact_at(&mut b, addr).unwrap();
        assert_eq!(b, fresh_page());
        assert_eq!(&b[0..8], b"FKCUDAST");
        assert_eq!(state(), Some(0));
        // As fake-cuda writes a checkpointed process's state, then a running one's.
        mem.write_all_at(&2u32.to_ne_bytes(), addr + STATE_AT as u64)
            .unwrap();
        assert_eq!(state(), Some(2));
        mem.write_all_at(&0u32.to_ne_bytes(), addr + STATE_AT as u64)
            .unwrap();
        assert_eq!(state(), Some(0));
    }
}
