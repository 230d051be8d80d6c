//! The staging ring the plugin hands over: a memfd of `slot_size * slots` bytes, validated,
//! mapped `MAP_SHARED`, pinned with `cuMemHostRegister`; unpinned and unmapped before the agent
//! replies to the end of an operation (CRIU would otherwise dump it as process memory). The fd
//! itself is closed as soon as it is mapped, for the same reason.

use std::ffi::c_void;
use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd};

use crate::cu::CuError;
use crate::log::debug;
use crate::real::Driver;

/// Why the staging ring could not be mapped or unmapped.
#[derive(Debug)]
pub enum StagingError {
    /// `slot_size * slots` does not fit the address space.
    Overflow,
    /// The descriptor could not be examined.
    Fstat(std::io::Error),
    /// The descriptor is not a memfd (nor a regular file): `st_mode` as found.
    NotAFile { mode: libc::mode_t },
    /// The memfd's size is not the ring's.
    Size {
        actual: libc::off_t,
        slot_size: u64,
        slots: u32,
        expected: usize,
    },
    /// The memfd could not be mapped.
    Mmap { len: usize, err: std::io::Error },
    /// The ring could not be unmapped: it is still mapped.
    Munmap(std::io::Error),
}

impl fmt::Display for StagingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Overflow => write!(f, "staging size overflows"),
            Self::Fstat(e) => write!(f, "fstat of the staging fd failed: {e}"),
            Self::NotAFile { mode } => write!(
                f,
                "the staging fd is not a memfd or regular file (mode {mode:o})"
            ),
            Self::Size {
                actual,
                slot_size,
                slots,
                expected,
            } => write!(
                f,
                "the staging memfd has {actual} bytes, expected slot_size {slot_size} x {slots} slots = {expected}"
            ),
            Self::Mmap { len, err } => {
                write!(f, "mmap of the staging memfd ({len} bytes) failed: {err}")
            }
            Self::Munmap(e) => write!(f, "munmap of the staging failed: {e}"),
        }
    }
}

impl std::error::Error for StagingError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Fstat(e) | Self::Munmap(e) | Self::Mmap { err: e, .. } => Some(e),
            Self::Overflow | Self::NotAFile { .. } | Self::Size { .. } => None,
        }
    }
}

/// A mapped (and possibly registered) staging ring.
#[derive(Debug)]
pub struct Staging {
    ptr: *mut c_void,
    len: usize,
    slot_size: u64,
    registered: bool,
}

impl Staging {
    /// Checks the memfd's type and size against the ring and maps it read-write, shared.
    pub fn map(fd: OwnedFd, slot_size: u64, slots: u32) -> Result<Staging, StagingError> {
        let want = slot_size
            .checked_mul(u64::from(slots))
            .and_then(|n| usize::try_from(n).ok())
            .ok_or(StagingError::Overflow)?;
        // SAFETY: stat is plain old data; all-zero is valid; fstat fills it.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is an open descriptor; st is writable.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(StagingError::Fstat(std::io::Error::last_os_error()));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(StagingError::NotAFile { mode: st.st_mode });
        }
        if u64::try_from(st.st_size).ok() != Some(want as u64) {
            return Err(StagingError::Size {
                actual: st.st_size,
                slot_size,
                slots,
                expected: want,
            });
        }
        // SAFETY: mapping `want` bytes of a file that has exactly that size; no fixed address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                want,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(StagingError::Mmap {
                len: want,
                err: std::io::Error::last_os_error(),
            });
        }
        drop(fd);
        Ok(Staging {
            ptr,
            len: want,
            slot_size,
            registered: false,
        })
    }

    /// Pins the whole ring (a context must be current on this thread).
    pub fn register(&mut self, drv: &Driver) -> Result<(), CuError> {
        // SAFETY: ptr..ptr+len is our live, page-aligned mapping.
        unsafe { drv.host_register(self.ptr, self.len)? };
        self.registered = true;
        Ok(())
    }

    /// Host address of slot `slot` (the caller has checked `slot < slots`).
    pub fn slot_ptr(&self, slot: u32) -> *mut c_void {
        // The offset is below len: slot < slots and len = slot_size * slots.
        self.ptr
            .wrapping_byte_add((u64::from(slot) * self.slot_size) as usize)
    }

    /// Unpins and unmaps. An unpin failure is only logged (the mapping still goes); the error
    /// returned means the ring is still mapped.
    pub fn close(mut self) -> Result<(), StagingError> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<(), StagingError> {
        if self.registered {
            self.registered = false;
            match crate::real::driver_if_loaded() {
                Some(drv) => {
                    // SAFETY: ptr is the base of our registered range.
                    let unregistered = unsafe { drv.host_unregister(self.ptr) };
                    if let Err(e) = unregistered {
                        debug!("staging: {e}");
                    }
                }
                None => debug!("staging: registered but no driver table to unregister it"),
            }
        }
        if self.ptr.is_null() {
            return Ok(());
        }
        // SAFETY: ptr..ptr+len is our mapping, no longer used by any copy (callers quiesce first).
        if unsafe { libc::munmap(self.ptr, self.len) } != 0 {
            return Err(StagingError::Munmap(std::io::Error::last_os_error()));
        }
        self.ptr = std::ptr::null_mut();
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            debug!("{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn memfd(len: i64) -> OwnedFd {
        // SAFETY: valid name and flags.
        let fd = unsafe { libc::memfd_create(c"gpusnap-staging-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: new descriptor, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: fd is open.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len) }, 0);
        fd
    }

    #[test]
    fn maps_a_matching_memfd_and_slots_are_disjoint() {
        let s = Staging::map(memfd(4 * 8192), 8192, 4).unwrap();
        assert_eq!(s.slot_ptr(1) as usize - s.slot_ptr(0) as usize, 8192);
        // SAFETY: slot 3 lies inside the live mapping.
        unsafe { std::ptr::write_bytes(s.slot_ptr(3).cast::<u8>(), 0xab, 8192) };
        s.close().unwrap();
    }

    #[test]
    fn refuses_wrong_size_and_non_files() {
        assert!(
            Staging::map(memfd(4096), 8192, 4)
                .unwrap_err()
                .to_string()
                .contains("expected")
        );
        let (a, _b) = gpusnap_proto::seqpacket_pair().unwrap();
        assert!(
            Staging::map(a, 4096, 1)
                .unwrap_err()
                .to_string()
                .contains("not a memfd")
        );
    }
}
