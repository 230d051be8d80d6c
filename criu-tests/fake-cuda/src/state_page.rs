//! The stand-in driver's state of a process, kept in the process's own memory.
//!
//! The real driver keeps what it needs to restore a process inside that process: its checkpoint
//! is host memory of the process, which CRIU dumps and restores like any other. That is why a
//! restore works whatever host pid the restored process gets (a container restored into a new
//! pid namespace, or imported into a fresh container while the original still runs). The
//! stand-in does the same: a process that has CUDA state maps one page, a memfd named
//! [`PAGE_NAME`] (`/memfd:fakecuda-state` in `/proc/<pid>/maps`), and the driver side (in CRIU,
//! or in `gpusnap recover`) reads and writes that page through `/proc/<pid>/mem`.
//!
//! The workload creates the page with [`create_in_this_process`], next to its `fakecuda-rt`
//! thread (the stand-in for what `cuInit` sets up). The page is `MADV_DONTFORK`: a forked child
//! has no CUDA state of its parent's, as with the real driver.
//!
//! Layout (native byte order, [`PAGE_BYTES`] bytes):
//! - 0..8: [`MAGIC`]; 8..12: [`VERSION`];
//! - 12..16: the state ([`State::raw`]);
//! - 16..20: the number of checkpointed GPUs `n` (0: none recorded; at most [`MAX_GPUS`]);
//! - 32..32 + 16 n: their UUIDs.
//!
//! A process without the page (only a `fakecuda-rt` thread) keeps its state in files named by
//! its pid (the crate docs): the unit tests' targets, and the split-path workloads of
//! `libfakecudadev.so` (`fake-cuda-device`), whose in-process lock and whose tests read and write
//! `<pid>.state` directly. Those are never restored under another host pid.

use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use crate::State;

/// The memfd's name.
pub const PAGE_NAME: &str = "fakecuda-state";
pub const PAGE_BYTES: usize = 4096;
pub const MAGIC: [u8; 8] = *b"FKCUDAST";
pub const VERSION: u32 = 1;
/// The most checkpointed GPUs the page records.
pub const MAX_GPUS: usize = 64;
const GPUS_AT: usize = 32;

/// What the page holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageState {
    pub state: State,
    /// The GPUs recorded at the last checkpoint (`None`: none recorded).
    pub gpus: Option<Vec<[u8; 16]>>,
}

impl PageState {
    /// The page's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; PAGE_BYTES];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_ne_bytes());
        b[12..16].copy_from_slice(&(self.state.raw() as u32).to_ne_bytes());
        let gpus = self.gpus.as_deref().unwrap_or(&[]);
        let n = gpus.len().min(MAX_GPUS);
        b[16..20].copy_from_slice(&(n as u32).to_ne_bytes());
        for (i, g) in gpus.iter().take(n).enumerate() {
            b[GPUS_AT + 16 * i..GPUS_AT + 16 * (i + 1)].copy_from_slice(g);
        }
        b
    }

    /// Parses a page; `Err` names what is wrong.
    pub fn decode(b: &[u8]) -> Result<PageState, String> {
        if b.len() < PAGE_BYTES {
            return Err(format!("{} bytes, not {PAGE_BYTES}", b.len()));
        }
        if b[0..8] != MAGIC {
            return Err(format!("bad magic {:02x?}", &b[0..8]));
        }
        let word = |at: usize| u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        if word(8) != VERSION {
            return Err(format!("version {}, not {VERSION}", word(8)));
        }
        let state = [
            State::Running,
            State::Locked,
            State::Checkpointed,
            State::Failed,
        ]
        .into_iter()
        .find(|s| s.raw() as u32 == word(12))
        .ok_or_else(|| format!("bad state {}", word(12)))?;
        let n = word(16) as usize;
        if n > MAX_GPUS {
            return Err(format!("{n} GPUs recorded (at most {MAX_GPUS})"));
        }
        let gpus = (n > 0).then(|| {
            (0..n)
                .map(|i| {
                    let mut g = [0u8; 16];
                    g.copy_from_slice(&b[GPUS_AT + 16 * i..GPUS_AT + 16 * (i + 1)]);
                    g
                })
                .collect()
        });
        Ok(PageState { state, gpus })
    }
}

/// Creates this process's page (state `running`, no GPUs recorded), once; later calls do
/// nothing. For the workload: call it where the real driver would set up its state (`cuInit`).
pub fn create_in_this_process() -> io::Result<()> {
    static CREATED: Mutex<bool> = Mutex::new(false);
    let mut created = CREATED.lock().unwrap_or_else(|e| e.into_inner());
    if *created {
        return Ok(());
    }
    // SAFETY: memfd_create reads a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"fakecuda-state".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::other(format!(
            "memfd_create({PAGE_NAME}): {}",
            io::Error::last_os_error()
        )));
    }
    let page = PageState {
        state: State::Running,
        gpus: None,
    }
    .encode();
    let result = (|| {
        // SAFETY: `fd` is the memfd just created; ftruncate only sizes it.
        if unsafe { libc::ftruncate(fd, PAGE_BYTES as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new shared mapping of the memfd at an address the kernel picks; nothing
        // else refers to that range. It stays mapped for the life of the process (never
        // unmapped), as the driver's state would.
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
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `addr` is the PAGE_BYTES mapping just made, writable, and `page` has exactly
        // PAGE_BYTES bytes. MADV_DONTFORK only changes what fork copies.
        unsafe {
            std::ptr::copy_nonoverlapping(page.as_ptr(), addr.cast::<u8>(), PAGE_BYTES);
            libc::madvise(addr, PAGE_BYTES, libc::MADV_DONTFORK);
        }
        Ok(())
    })();
    // SAFETY: `fd` is ours; the mapping keeps the memfd alive without it.
    unsafe { libc::close(fd) };
    result.map_err(|e| io::Error::other(format!("setting up the {PAGE_NAME} page: {e}")))?;
    *created = true;
    Ok(())
}

/// The address of `pid`'s page, from `/proc/<pid>/maps`; `None` if it has none.
pub fn find(pid: i32) -> Result<Option<u64>, String> {
    let path = format!("/proc/{pid}/maps");
    let maps = fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    Ok(find_in_maps(&maps))
}

/// The start of the mapping of `/memfd:fakecuda-state` in the text of a `maps` file.
pub fn find_in_maps(maps: &str) -> Option<u64> {
    let wanted = format!("/memfd:{PAGE_NAME}");
    maps.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let range = f.next()?;
        let path = f.nth(4)?;
        if path != wanted {
            return None;
        }
        u64::from_str_radix(range.split('-').next()?, 16).ok()
    })
}

/// Reads `pid`'s page at `addr`.
pub fn read(pid: i32, addr: u64) -> Result<PageState, String> {
    let path = format!("/proc/{pid}/mem");
    let f = fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    let mut b = vec![0u8; PAGE_BYTES];
    f.read_exact_at(&mut b, addr)
        .map_err(|e| format!("{path} at {addr:#x}: {e}"))?;
    PageState::decode(&b).map_err(|e| format!("the {PAGE_NAME} page of pid {pid}: {e}"))
}

/// Writes `st` into `pid`'s page at `addr`.
pub fn write(pid: i32, addr: u64, st: &PageState) -> Result<(), String> {
    let path = format!("/proc/{pid}/mem");
    let f = OpenOptions::new()
        .write(true)
        .open(&path)
        .map_err(|e| format!("{path}: {e}"))?;
    f.write_all_at(&st.encode(), addr)
        .map_err(|e| format!("{path} at {addr:#x}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_round_trip_and_bad_ones_are_named() {
        let st = PageState {
            state: State::Checkpointed,
            gpus: Some(vec![[7u8; 16], [9u8; 16]]),
        };
        assert_eq!(PageState::decode(&st.encode()).unwrap(), st);
        let none = PageState {
            state: State::Running,
            gpus: None,
        };
        assert_eq!(PageState::decode(&none.encode()).unwrap(), none);
        let mut bad = st.encode();
        bad[0] = b'X';
        assert!(PageState::decode(&bad).unwrap_err().contains("magic"));
        let mut bad = st.encode();
        bad[12] = 9;
        assert!(PageState::decode(&bad).unwrap_err().contains("state"));
        assert!(PageState::decode(&[0u8; 8]).is_err());
    }

    #[test]
    fn the_page_is_found_in_maps() {
        let maps = "\
55d0c0000000-55d0c0001000 r--p 00000000 fe:01 123 /usr/bin/x
7f1234560000-7f1234561000 rw-s 00000000 00:01 4567 /memfd:fakecuda-state (deleted)
7f1234570000-7f1234571000 rw-s 00000000 00:01 4568 /memfd:other (deleted)
";
        assert_eq!(find_in_maps(maps), Some(0x7f12_3456_0000));
        assert_eq!(
            find_in_maps("7f00-7f01 rw-s 0 00:01 1 /memfd:fakecuda-statex\n"),
            None
        );
    }

    #[test]
    fn this_process_gets_a_page_it_can_read_through_proc() {
        create_in_this_process().unwrap();
        create_in_this_process().unwrap();
        let me = std::process::id() as i32;
        let addr = find(me)
            .unwrap()
            .expect("no page after create_in_this_process");
        assert_eq!(read(me, addr).unwrap().state, State::Running);
        let st = PageState {
            state: State::Locked,
            gpus: Some(vec![[1u8; 16]]),
        };
        write(me, addr, &st).unwrap();
        assert_eq!(read(me, addr).unwrap(), st);
    }
}
