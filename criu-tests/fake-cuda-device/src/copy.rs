//! Copies: every direction is a plain byte copy within the process, done at once (the `Async`
//! variants are complete when they return, so streams and events have nothing to wait for).
//!
//! A copy goes through `process_vm_readv` on the process itself: an address that is not
//! readable or writable (device memory the agent has released, a `PROT_NONE` reservation, a
//! bad pointer) makes the call fail with `CUDA_ERROR_INVALID_VALUE`, as the driver's copy of
//! an invalid device pointer does, instead of killing the process with SIGSEGV. Where the
//! system call is not allowed (seccomp), plain `memmove` is used.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::call::{self, CuResult, invalid};
use crate::codes::CUresult;
use crate::ctx::need_context;
use crate::sync::CUstream;
use crate::vmm::CUdeviceptr;

static NO_VM_READV: AtomicBool = AtomicBool::new(false);

/// Copies `len` bytes from `src` to `dst` (addresses in this process).
pub fn copy_bytes(call: &str, dst: u64, src: u64, len: usize) -> CuResult {
    need_context()?;
    if len == 0 {
        return Ok(());
    }
    if dst == 0 || src == 0 {
        return invalid(call, format_args!("dst {dst:#x} src {src:#x}"));
    }
    if NO_VM_READV.load(Ordering::Relaxed) {
        // SAFETY: fallback only (no process_vm_readv): the caller vouches for both ranges, as
        // with the real driver.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
        return Ok(());
    }
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    let mut done = 0usize;
    while done < len {
        let local = libc::iovec {
            iov_base: (dst as usize + done) as *mut c_void,
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (src as usize + done) as *mut c_void,
            iov_len: len - done,
        };
        // SAFETY: the kernel checks both ranges and fails with EFAULT instead of touching an
        // invalid address; the iovecs are valid locals.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n > 0 {
            done += n as usize;
            continue;
        }
        let err = std::io::Error::last_os_error();
        if n < 0 && matches!(err.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) && done == 0 {
            NO_VM_READV.store(true, Ordering::Relaxed);
            return copy_bytes(call, dst, src, len);
        }
        return invalid(
            call,
            format_args!(
                "copying {len} bytes {src:#x} -> {dst:#x} failed after {done} bytes: {err}"
            ),
        );
    }
    Ok(())
}

pub unsafe extern "C" fn htod(dst: CUdeviceptr, src: *const c_void, len: usize) -> CUresult {
    call::run("cuMemcpyHtoD_v2", || {
        copy_bytes("cuMemcpyHtoD_v2", dst, src as u64, len)
    })
}

pub unsafe extern "C" fn dtoh(dst: *mut c_void, src: CUdeviceptr, len: usize) -> CUresult {
    call::run("cuMemcpyDtoH_v2", || {
        copy_bytes("cuMemcpyDtoH_v2", dst as u64, src, len)
    })
}

pub unsafe extern "C" fn dtod(dst: CUdeviceptr, src: CUdeviceptr, len: usize) -> CUresult {
    call::run("cuMemcpyDtoD_v2", || {
        copy_bytes("cuMemcpyDtoD_v2", dst, src, len)
    })
}

pub unsafe extern "C" fn memcpy(dst: CUdeviceptr, src: CUdeviceptr, len: usize) -> CUresult {
    call::run("cuMemcpy", || copy_bytes("cuMemcpy", dst, src, len))
}

pub unsafe extern "C" fn htod_async(
    dst: CUdeviceptr,
    src: *const c_void,
    len: usize,
    _stream: CUstream,
) -> CUresult {
    call::run("cuMemcpyHtoDAsync_v2", || {
        copy_bytes("cuMemcpyHtoDAsync_v2", dst, src as u64, len)
    })
}

pub unsafe extern "C" fn dtoh_async(
    dst: *mut c_void,
    src: CUdeviceptr,
    len: usize,
    _stream: CUstream,
) -> CUresult {
    call::run("cuMemcpyDtoHAsync_v2", || {
        copy_bytes("cuMemcpyDtoHAsync_v2", dst as u64, src, len)
    })
}

pub unsafe extern "C" fn memcpy_async(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    len: usize,
    _stream: CUstream,
) -> CUresult {
    call::run("cuMemcpyAsync", || {
        copy_bytes("cuMemcpyAsync", dst, src, len)
    })
}

/// `cuMemsetD8Async`: as [`memset_d8`], done at once.
pub unsafe extern "C" fn memset_d8_async(
    dst: CUdeviceptr,
    value: u8,
    len: usize,
    _stream: CUstream,
) -> CUresult {
    call::run("cuMemsetD8Async", || fill(dst, value, len))
}

/// `cuMemsetD8_v2`: `len` bytes of `value` at `dst`.
pub unsafe extern "C" fn memset_d8(dst: CUdeviceptr, value: u8, len: usize) -> CUresult {
    call::run("cuMemsetD8_v2", || fill(dst, value, len))
}

fn fill(dst: CUdeviceptr, value: u8, len: usize) -> CuResult {
    let buf = [value; 64 << 10];
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(buf.len());
        copy_bytes("cuMemsetD8", dst + done as u64, buf.as_ptr() as u64, n)?;
        done += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codes::INVALID_VALUE;

    fn with_context() {
        // SAFETY: plain calls with valid arguments.
        unsafe {
            assert_eq!(crate::rt::init(0), 0);
            assert_eq!(crate::ctx::ctx_set_current(crate::ctx::primary(0)), 0);
        }
    }

    #[test]
    fn copies_and_refuses_bad_addresses() {
        with_context();
        let src = vec![7u8; 10000];
        let mut dst = vec![0u8; 10000];
        copy_bytes("t", dst.as_mut_ptr() as u64, src.as_ptr() as u64, 10000).unwrap();
        assert_eq!(src, dst);
        // SAFETY: a new PROT_NONE mapping, unmapped below.
        let none = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(none, libc::MAP_FAILED);
        assert_eq!(
            copy_bytes("t", dst.as_mut_ptr() as u64, none as u64, 4096),
            Err(INVALID_VALUE)
        );
        assert_eq!(
            copy_bytes("t", none as u64, src.as_ptr() as u64, 4096),
            Err(INVALID_VALUE)
        );
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(none, 8192) };
    }
}
