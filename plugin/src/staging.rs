//! The staging ring shared with the agent: a memfd of `slots` × `slot_size` bytes, mapped here
//! and (by the agent, over SCM_RIGHTS) in the target, where it is pinned for DMA.
//!
//! Ownership of a slot is handed back and forth by protocol messages: between the agent's
//! `ChunkReady` and our `SlotFree` (dump), or between our `ChunkLoad` and its `SlotFree`
//! (restore), only one side touches it. [`Staging::slot_mut`] relies on that.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub struct Staging {
    fd: OwnedFd,
    base: *mut u8,
    slot_size: usize,
    slots: usize,
}

// SAFETY: the mapping is plain shared memory; concurrent access to distinct slots is what the
// protocol guarantees (see the module doc).
unsafe impl Send for Staging {}
// SAFETY: as above.
unsafe impl Sync for Staging {}

impl Staging {
    /// Creates and populates the ring. First touch of fresh memory is slow (0.3 s for 512 MiB
    /// from one thread on the H200 VM), so it is paid here, by several threads at once, rather
    /// than in the middle of the copy.
    pub fn new(slot_size: usize, slots: usize) -> io::Result<Self> {
        let len = slot_size
            .checked_mul(slots)
            .ok_or_else(|| io::Error::other("staging size overflows"))?;
        // SAFETY: memfd_create with a static NUL-terminated name.
        let raw = unsafe { libc::memfd_create(c"gpusnap-staging".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh fd that we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our own memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh shared mapping of the memfd, length as truncated.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let me = Self {
            fd,
            base: base.cast(),
            slot_size,
            slots,
        };
        me.populate();
        Ok(me)
    }

    /// Faults every page in, one thread per group of slots.
    fn populate(&self) {
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        let threads = std::thread::available_parallelism()
            .map_or(4, |n| n.get())
            .clamp(1, self.slots);
        let per = self.slots.div_ceil(threads) * self.slot_size;
        let total = self.slots * self.slot_size;
        let base = self.base as usize;
        std::thread::scope(|s| {
            for start in (0..total).step_by(per) {
                let len = per.min(total - start);
                s.spawn(move || {
                    let p = (base + start) as *mut libc::c_void;
                    // SAFETY: [p, p+len) lies inside our mapping; MADV_POPULATE_WRITE only
                    // faults pages in (Linux 5.14+).
                    if unsafe { libc::madvise(p, len, MADV_POPULATE_WRITE) } != 0 {
                        // Older kernels: touch one byte per page.
                        for off in (0..len).step_by(4096) {
                            // SAFETY: in bounds of our writable mapping; nobody else uses the
                            // ring yet.
                            unsafe { ((base + start + off) as *mut u8).write_volatile(0) };
                        }
                    }
                });
            }
        });
    }

    /// Drops the ring's contents (truncates the memfd to 0). For when the agent may still have
    /// the ring mapped (it stopped answering): CRIU then dumps an empty mapping, not the ring's
    /// pages. The agent never reads or writes ring memory with the CPU (only DMA into pages it
    /// pinned, which stay alive until it unpins them), so this cannot fault it.
    pub fn discard(&self) {
        // SAFETY: ftruncate on our own memfd.
        if unsafe { libc::ftruncate(self.fd.as_raw_fd(), 0) } != 0 {
            log::warn!(
                "cannot truncate the staging ring: {}",
                io::Error::last_os_error()
            );
        }
    }

    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    pub fn slot_size(&self) -> usize {
        self.slot_size
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The first `len` bytes of slot `i`, for reading (dump side).
    ///
    /// # Safety
    /// The caller must own slot `i` under the protocol (the agent is not writing it).
    pub unsafe fn slot(&self, i: usize, len: usize) -> &[u8] {
        assert!(i < self.slots && len <= self.slot_size);
        // SAFETY: in bounds of the mapping (asserted); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.base.add(i * self.slot_size), len) }
    }

    /// The first `len` bytes of slot `i`, for filling (restore side).
    ///
    /// # Safety
    /// The caller must own slot `i` under the protocol, and no other reference to it may exist.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_mut(&self, i: usize, len: usize) -> &mut [u8] {
        assert!(i < self.slots && len <= self.slot_size);
        // SAFETY: in bounds (asserted); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(i * self.slot_size), len) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in `new`.
        unsafe { libc::munmap(self.base.cast(), self.slot_size * self.slots) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_disjoint_and_shared_through_the_fd() {
        let s = Staging::new(4096, 4).unwrap();
        // SAFETY: single-threaded test owns every slot.
        unsafe {
            s.slot_mut(1, 4096).fill(7);
            s.slot_mut(2, 10).fill(9);
            assert!(s.slot(0, 4096).iter().all(|b| *b == 0));
            assert!(s.slot(1, 4096).iter().all(|b| *b == 7));
        }
        let mut buf = [0u8; 4];
        // SAFETY: pread into a local buffer from our memfd.
        let n = unsafe {
            libc::pread(
                s.fd().as_raw_fd(),
                buf.as_mut_ptr().cast(),
                4,
                (2 * 4096) as libc::off_t,
            )
        };
        assert_eq!(n, 4);
        assert_eq!(buf, [9; 4]);
    }
}
