//! The contents of a buffer object, through its dma-buf: mapped into the caller with `mmap`
//! (`MAP_SHARED`), read at dump and written at restore.
//!
//! On the stand-in KFD a dma-buf is a memfd, which maps the same way. On real hardware a dma-buf
//! of a GTT BO, or of a VRAM BO in the CPU-visible part of VRAM (all of it with resizable BAR),
//! maps like this too; a VRAM BO outside the visible window cannot be mapped, and the copy
//! would need the GPU's DMA engine (SDMA through the render node), which gpusnap does not do:
//! the mapping fails and the dump is refused, naming the BO. This was never run on AMD hardware.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

/// A dma-buf mapped into this process. Unmapped when dropped.
#[derive(Debug)]
pub struct BoMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; access goes through
// `as_slice` (shared) or `slice_mut` (whose caller guarantees disjointness).
unsafe impl Send for BoMapping {}
// SAFETY: as above.
unsafe impl Sync for BoMapping {}

impl BoMapping {
    /// Maps `len` bytes of the dma-buf `fd`, read-only or read-write.
    pub fn map(fd: BorrowedFd<'_>, len: u64, writable: bool) -> io::Result<BoMapping> {
        let len = usize::try_from(len)
            .ok()
            .filter(|l| *l > 0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "bad BO size"))?;
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of an fd we borrow; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(BoMapping {
            ptr: NonNull::new(p.cast()).expect("mmap never returns null on success"),
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes at `offset`, to read.
    pub fn slice(&self, offset: usize, len: usize) -> Option<&[u8]> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // SAFETY: inside the live mapping; the dump only reads it.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) })
    }

    /// `len` bytes at `offset`, to write.
    ///
    /// # Safety
    ///
    /// No other slice of the same bytes may be alive while this one is (writer threads of a
    /// restore take disjoint chunks), and the mapping must be writable.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: usize, len: usize) -> Option<&mut [u8]> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // SAFETY: inside the live mapping; the caller guarantees exclusive use of the range.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) })
    }
}

impl Drop for BoMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping this value made.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};

    #[test]
    fn memfd_round_trip() {
        // SAFETY: memfd_create with a static name.
        let raw = unsafe { libc::memfd_create(c"bo".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a fresh fd.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our memfd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 8192) }, 0);
        let w = BoMapping::map(fd.as_fd(), 8192, true).unwrap();
        // SAFETY: the only slice of these bytes.
        unsafe { w.slice_mut(4096, 4).unwrap() }.copy_from_slice(b"abcd");
        drop(w);
        let r = BoMapping::map(fd.as_fd(), 8192, false).unwrap();
        assert_eq!(r.slice(4096, 4).unwrap(), b"abcd");
        assert!(r.slice(8190, 4).is_none());
        assert!(r.slice(usize::MAX, 2).is_none());
    }

    #[test]
    fn a_pipe_is_not_mappable() {
        let mut p = [0; 2];
        // SAFETY: pipe into a local array.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        // SAFETY: fresh fds.
        let (r, _w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
        assert!(BoMapping::map(r.as_fd(), 4096, false).is_err());
    }
}
