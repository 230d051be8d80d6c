//! The staging ring shared with the agent: a memfd of `slots` × `slot_size` bytes, mapped here
//! and (by the agent, over SCM_RIGHTS) in the target, where it is pinned for DMA.
//!
//! Ownership of a slot is handed back and forth by protocol messages: between the agent's
//! `ChunkReady` and our `SlotFree` (dump), or between our `ChunkLoad` and its `SlotFree`
//! (restore), only one side touches it. [`Staging::slot_mut`] relies on that.
//!
//! The job holds the memfd too (its agent maps it), with the job's rights: it could truncate it,
//! and our reads of the shared mapping would then fault (SIGBUS in root's CRIU). So the memfd is
//! sealed against any change of size (`F_SEAL_SHRINK | F_SEAL_GROW`, and `F_SEAL_SEAL` so that
//! the job cannot change the seals) before it ever leaves this process, and
//! [`Staging::check_intact`] refuses a ring whose size or seals are not what we made.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The seals every ring carries: its size never changes, nor do its seals.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A ring that is not as we made it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RingError {
    #[error("the staging ring's memfd is {found} bytes, not the {made} we made: refused")]
    Resized { made: u64, found: u64 },
    #[error("the staging ring's memfd has seals {found:#x}, not {made:#x}: refused")]
    Unsealed { made: i32, found: i32 },
    #[error("checking the staging ring's memfd: {0}")]
    Os(crate::stall::OsError),
}

/// Slot sizes are whole pages (the agent refuses anything else, `cuda-backend/agent/src/plan.rs`).
const PAGE: u64 = 4096;

/// How big a ring is: `slots` slots of `slot_size` bytes. The whole ring is populated (and, by
/// the agent, pinned) up front, so it is sized by what one transfer moves, not by the
/// configuration alone: the slot is no larger than the largest chunk, and the ring no larger than
/// all the data, rounded up to a page. Slots stay whole pages, between 1 and the configured
/// number, and no more than there are chunks (what the agent's `validate_ring` accepts, given a
/// configuration it accepts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingShape {
    pub slot_size: usize,
    pub slots: usize,
}

impl RingShape {
    /// For a dump of allocations of `moved_sizes` bytes, which the agent cuts into chunks of at
    /// most the slot size. With `configured_slot` bytes configured (a whole number of pages), the
    /// slot is that, or the largest allocation rounded up to a page if that is smaller: either way
    /// every allocation is cut exactly as `configured_slot` would cut it (an allocation no larger
    /// than the slot is one chunk), so chunks still line up with a parent image's for dedup.
    pub fn for_dump(
        configured_slot: usize,
        configured_slots: usize,
        moved_sizes: impl Iterator<Item = u64> + Clone,
    ) -> RingShape {
        let largest = moved_sizes.clone().max().unwrap_or(0);
        let slot = (configured_slot as u64).min(largest.next_multiple_of(PAGE));
        let slot = slot.max(PAGE);
        let chunks = moved_sizes.clone().map(|s| s.div_ceil(slot)).sum();
        let bytes = moved_sizes.fold(0u64, u64::saturating_add);
        Self::bounded(slot, configured_slots, chunks, bytes)
    }

    /// For a restore of chunks of `chunk_lens` bytes (as the image holds them): the slot is the
    /// largest chunk rounded up to a page, whatever the configuration says now, since every chunk
    /// must fit one slot and a larger slot is never used.
    pub fn for_restore(
        configured_slots: usize,
        chunk_lens: impl Iterator<Item = u64> + Clone,
    ) -> RingShape {
        let largest = chunk_lens.clone().max().unwrap_or(0);
        let slot = largest.next_multiple_of(PAGE).max(PAGE);
        let chunks = chunk_lens.clone().count() as u64;
        let bytes = chunk_lens.fold(0u64, u64::saturating_add);
        Self::bounded(slot, configured_slots, chunks, bytes)
    }

    /// `slot` (a page multiple, at least the largest chunk, so no larger than `bytes` rounded up
    /// unless there is no data) and as many slots as are configured, there are chunks, and fit in
    /// `bytes` rounded up to a page; at least one.
    fn bounded(slot: u64, configured_slots: usize, chunks: u64, bytes: u64) -> RingShape {
        let fit = bytes.next_multiple_of(PAGE) / slot;
        let slots = (configured_slots as u64).min(chunks).min(fit).max(1);
        RingShape {
            slot_size: slot as usize,
            slots: slots as usize,
        }
    }
}

pub struct Staging {
    fd: OwnedFd,
    base: *mut u8,
    slot_size: usize,
    slots: usize,
}

/// A ring made on a thread of its own while the caller goes on (a restore makes it during the
/// driver's control restore: populating 512 MiB takes ~0.1 s). Joined by [`take`](Self::take),
/// or when dropped.
pub struct RingMaker {
    shape: RingShape,
    thread: Option<std::thread::JoinHandle<io::Result<Staging>>>,
}

impl RingMaker {
    pub fn start(shape: RingShape) -> RingMaker {
        let thread = std::thread::Builder::new()
            .name("gpusnap-ring".into())
            .spawn(move || {
                gpusnap_host::signals::block_all();
                Staging::new(shape.slot_size, shape.slots)
            })
            .ok();
        RingMaker { shape, thread }
    }

    /// The ring; made here if the thread could not be started.
    pub fn take(mut self) -> io::Result<Staging> {
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(made)) => made,
            Some(Err(_)) => Err(io::Error::other(
                "the thread making the staging ring panicked",
            )),
            None => Staging::new(self.shape.slot_size, self.shape.slots),
        }
    }

    pub fn shape(&self) -> RingShape {
        self.shape
    }
}

impl Drop for RingMaker {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging")
            .field("slot_size", &self.slot_size)
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

// SAFETY: the mapping is plain shared memory; concurrent access to distinct slots is what the
// protocol guarantees (see the module doc).
unsafe impl Send for Staging {}
// SAFETY: as above.
unsafe impl Sync for Staging {}

impl Staging {
    /// Creates and populates the ring (size it with [`RingShape`]). First touch of fresh memory
    /// is slow (0.3 s for 512 MiB from one thread on the H200 VM), so it is paid here, by several
    /// threads at once, rather than in the middle of the copy.
    pub fn new(slot_size: usize, slots: usize) -> io::Result<Self> {
        let len = slot_size
            .checked_mul(slots)
            .ok_or_else(|| io::Error::other("staging size overflows"))?;
        let len_off = libc::off_t::try_from(len)
            .map_err(|_| io::Error::other("staging size overflows off_t"))?;
        // SAFETY: memfd_create with a static NUL-terminated name.
        let raw = unsafe {
            libc::memfd_create(
                c"gpusnap-staging".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh fd that we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our own memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len_off) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // Sealed before anyone else can hold it: the job's agent gets it later, and can then
        // neither shrink it under our mapping (a read of a page past the end is a SIGBUS) nor
        // grow it, nor undo the seals.
        // SAFETY: fcntl(F_ADD_SEALS) on our own memfd, created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
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
                    // CRIU's signals are for its main thread (a ring made at PAUSE is made there).
                    gpusnap_host::signals::block_all();
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

    /// Drops the ring's contents (punches out every page of the memfd; its size is sealed).
    /// For when the agent may still have the ring mapped (it stopped answering): CRIU then
    /// dumps an empty mapping, not the ring's pages. Pages the agent pinned for DMA stay alive
    /// until it unpins them, and a CPU access to the hole reads zeros, so this cannot fault it.
    pub fn discard(&self) {
        let len = self.len() as libc::off_t;
        // SAFETY: fallocate on our own memfd, within its size; frees the pages, keeps the size.
        let rc = unsafe {
            libc::fallocate(
                self.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                len,
            )
        };
        if rc != 0 {
            log::warn!(
                "cannot drop the staging ring's pages: {}",
                io::Error::last_os_error()
            );
        }
    }

    /// Bytes of the ring, as made.
    fn len(&self) -> usize {
        self.slot_size * self.slots
    }

    /// The memfd still has the size and the seals we gave it. The seals make a change
    /// impossible; this makes the promise checked where the ring is handed to the job and
    /// read back.
    pub fn check_intact(&self) -> Result<(), RingError> {
        let os = |e: io::Error| RingError::Os(crate::stall::OsError::from(e));
        // SAFETY: fcntl(F_GET_SEALS) on our own memfd.
        let seals = unsafe { libc::fcntl(self.fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(os(io::Error::last_os_error()));
        }
        if seals & SEALS != SEALS {
            return Err(RingError::Unsealed {
                made: SEALS,
                found: seals,
            });
        }
        let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
        // SAFETY: fstat on our own fd into a zeroed stat buffer.
        if unsafe { libc::fstat(self.fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
            return Err(os(io::Error::last_os_error()));
        }
        // SAFETY: fstat succeeded and filled the struct (which was zeroed before anyway).
        let found = unsafe { st.assume_init() }.st_size as u64;
        let made = self.len() as u64;
        if found != made {
            return Err(RingError::Resized { made, found });
        }
        Ok(())
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
        unsafe { libc::munmap(self.base.cast(), self.len()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn ring_bytes(r: RingShape) -> u64 {
        (r.slot_size * r.slots) as u64
    }

    #[test]
    fn a_ring_is_bounded_by_the_data_it_moves() {
        // The case: staging_slot_mib = 1024 and 16 MiB of data used to populate 2 GiB
        // and more; now one 16 MiB slot, both ways.
        let dump = RingShape::for_dump(1 << 30, 16, [16 * MIB].into_iter());
        assert_eq!(
            dump,
            RingShape {
                slot_size: 16 << 20,
                slots: 1
            }
        );
        let restore = RingShape::for_restore(16, [16 * MIB].into_iter());
        assert_eq!(restore, dump);

        // Small allocations: the slot is the largest one rounded up to a page, and the ring
        // holds no more than all of them, rounded up to a page.
        let sizes = [100u64, 5000, 3 * 4096];
        let r = RingShape::for_dump(32 << 20, 16, sizes.into_iter());
        assert_eq!(
            r,
            RingShape {
                slot_size: 3 * 4096,
                slots: 1
            }
        );
        assert!(ring_bytes(r) <= sizes.iter().sum::<u64>().next_multiple_of(4096));

        // Large data: the configured shape, as before.
        let r = RingShape::for_dump(32 << 20, 16, [8 << 30].into_iter());
        assert_eq!(
            r,
            RingShape {
                slot_size: 32 << 20,
                slots: 16
            }
        );
        // Fewer chunks than slots: one slot per chunk.
        let r = RingShape::for_dump(32 << 20, 16, [64 * MIB, 32 * MIB].into_iter());
        assert_eq!(
            r,
            RingShape {
                slot_size: 32 << 20,
                slots: 3
            }
        );
        // Many chunks, little data: as many slots as the data fills.
        let r = RingShape::for_dump(64 << 20, 8, [100 * MIB, 4096, 4096].into_iter());
        assert_eq!(
            r,
            RingShape {
                slot_size: 64 << 20,
                slots: 1
            }
        );

        // Restore: the slot fits the largest chunk whatever is configured now.
        let r = RingShape::for_restore(4, [MIB, 3 * MIB + 1, 2 * MIB, 2 * MIB].into_iter());
        assert_eq!(
            r,
            RingShape {
                slot_size: (3 * MIB + 4096) as usize,
                slots: 2
            }
        );

        // Nothing to move: the smallest ring the agent accepts.
        let none = RingShape {
            slot_size: 4096,
            slots: 1,
        };
        assert_eq!(RingShape::for_dump(1 << 30, 16, std::iter::empty()), none);
        assert_eq!(RingShape::for_restore(16, std::iter::empty()), none);
    }

    /// Over many shapes: what the agent accepts (page-multiple slot of at most 1 GiB, 1..=256
    /// slots), every chunk fits a slot, the ring is no larger than the data rounded up to a page,
    /// and a dump cuts allocations exactly as the configured slot would.
    #[test]
    fn ring_shapes_stay_within_the_agent_rules_and_the_data() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..2000 {
            let configured_slot = (1 + next(1024)) as usize * MIB as usize;
            let configured_slots = 2 + next(255) as usize;
            let n = next(20) as usize;
            let scale = [4096, MIB, 256 * MIB, 4 << 30][next(4) as usize];
            let sizes: Vec<u64> = (0..n).map(|_| 1 + next(scale)).collect();
            let r = RingShape::for_dump(configured_slot, configured_slots, sizes.iter().copied());
            let data: u64 = sizes.iter().sum();
            assert!(r.slot_size.is_multiple_of(4096) && r.slot_size > 0 && r.slot_size <= 1 << 30);
            assert!(r.slots >= 1 && r.slots <= configured_slots);
            assert!(r.slot_size <= configured_slot);
            if n > 0 {
                assert!(
                    ring_bytes(r) <= data.next_multiple_of(4096),
                    "{sizes:?} {r:?}"
                );
            }
            let cut = |slot: u64| sizes.iter().map(|s| s.div_ceil(slot)).collect::<Vec<_>>();
            assert_eq!(cut(r.slot_size as u64), cut(configured_slot as u64));

            // Restore of what that dump wrote: chunks of at most the dump's slot.
            let chunks: Vec<u64> = sizes
                .iter()
                .flat_map(|&s| {
                    let slot = r.slot_size as u64;
                    (0..s.div_ceil(slot)).map(move |k| slot.min(s - k * slot))
                })
                .collect();
            let back = RingShape::for_restore(configured_slots, chunks.iter().copied());
            assert!(back.slot_size.is_multiple_of(4096) && back.slot_size <= 1 << 30);
            assert!(back.slots >= 1 && back.slots <= configured_slots.min(chunks.len().max(1)));
            assert!(chunks.iter().all(|&c| c <= back.slot_size as u64));
            if n > 0 {
                assert!(ring_bytes(back) <= data.next_multiple_of(4096));
            }
        }
    }

    /// Issue 32, item 3: the job (holding the memfd, or reopening it through /proc) cannot
    /// change the ring's size under our mapping; `discard` drops the pages but keeps the size.
    #[test]
    fn the_ring_cannot_be_resized_by_its_other_holder() {
        let s = Staging::new(4096, 2).unwrap();
        s.check_intact().unwrap();
        let reopened = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{}", s.fd().as_raw_fd()))
            .unwrap();
        for len in [0, 4096, 3 * 4096] {
            let e = reopened.set_len(len).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{len}: {e}");
            // SAFETY: ftruncate on our own fd; expected to fail.
            let rc = unsafe { libc::ftruncate(s.fd().as_raw_fd(), len as libc::off_t) };
            assert_ne!(rc, 0);
        }
        // SAFETY: fcntl on our own fd; the seals are sealed.
        let rc = unsafe { libc::fcntl(s.fd().as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
        assert_ne!(rc, 0);
        s.check_intact().unwrap();
        // SAFETY: single-threaded test owns every slot.
        unsafe { s.slot_mut(1, 4096).fill(5) };
        s.discard();
        s.check_intact().unwrap();
        // SAFETY: as above; the hole reads as zeros, no fault.
        assert!(unsafe { s.slot(1, 4096) }.iter().all(|b| *b == 0));
    }

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
