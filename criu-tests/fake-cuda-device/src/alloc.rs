//! `cuMemAlloc_v2`, `cuMemAllocPitch_v2`, `cuMemFree_v2`: plain device allocations (what the
//! agent leaves to the driver: small ones, or any when it is not loaded) are shared mappings of
//! a memfd of their own ([`ALLOC_MEMFD_NAME`]), page-aligned (2 MiB-aligned from 2 MiB on, as the
//! driver's are), with a table (base → length, memfd) for `cuMemFree` and CUDA IPC. CRIU dumps
//! them as memfd-backed shared memory.
//!
//! Legacy CUDA IPC, as the driver's: `cuIpcGetMemHandle` works on `cuMemAlloc` memory (an
//! interior pointer names its whole allocation) and fails with `CUDA_ERROR_INVALID_VALUE` on any
//! other memory, VMM mappings included (as driver r580 refuses them); the handle names the
//! exporter's pid, its memfd's descriptor and inode. `cuIpcOpenMemHandle_v2` in another process
//! opens that memfd through `/proc/<pid>/fd` (the inode checked), maps it shared and returns the
//! base of the allocation; opening a handle already open returns the same pointer and counts;
//! the exporting process itself cannot open its own (`CUDA_ERROR_INVALID_CONTEXT`).
//! `cuIpcCloseMemHandle` of that pointer drops one count, the last unmaps.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use crate::call::{self, CuResult, debug, invalid, put};
use crate::codes::{CUresult, INVALID_CONTEXT, INVALID_VALUE, OPERATING_SYSTEM};
use crate::ctx::{charge, need_context, refund};
use crate::vmm::{CUdeviceptr, GRANULARITY};

/// The memfd name of a plain allocation (`/proc/<pid>/maps`: `/memfd:fakecuda-alloc (deleted)`).
pub const ALLOC_MEMFD_NAME: &std::ffi::CStr = c"fakecuda-alloc";

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcMemHandle {
    pub reserved: [u8; 64],
}

/// First bytes of every IPC handle this driver makes.
const IPC_MAGIC: &[u8; 8] = b"FCUDAIPC";
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: the one flag `cuIpcOpenMemHandle` takes.
pub const IPC_LAZY_ENABLE_PEER_ACCESS: u32 = 1;

/// A live plain allocation.
#[derive(Debug)]
struct Alloc {
    len: u64,
    /// Its memfd, kept open so that another process can open it for CUDA IPC.
    memfd: i32,
}

/// Pitch alignment of `cuMemAllocPitch`.
pub const PITCH_ALIGN: u64 = 512;

const PAGE: u64 = 4096;

/// Base address → every live allocation.
static ALLOCS: Mutex<BTreeMap<u64, Alloc>> = Mutex::new(BTreeMap::new());

fn allocs() -> MutexGuard<'static, BTreeMap<u64, Alloc>> {
    ALLOCS.lock().unwrap_or_else(|e| e.into_inner())
}

/// An IPC mapping this process opened.
#[derive(Debug)]
struct Opened {
    /// (exporter pid, memfd inode): what the handle names.
    source: (u32, u64),
    len: u64,
    refs: u32,
}

/// Local base address → every IPC mapping open in this process.
static OPENED: Mutex<BTreeMap<u64, Opened>> = Mutex::new(BTreeMap::new());

fn opened() -> MutexGuard<'static, BTreeMap<u64, Opened>> {
    OPENED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Maps `len` bytes (a multiple of the page) of `fd` shared, aligned to `align`; returns the
/// base.
fn map_aligned(fd: i32, len: u64, align: u64) -> Result<u64, CUresult> {
    let total = len + align.saturating_sub(PAGE);
    // SAFETY: a new anonymous reservation, nothing fixed.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        call::debug(format_args!(
            "cuMemAlloc: mmap of {total} bytes: {}",
            std::io::Error::last_os_error()
        ));
        return Err(OPERATING_SYSTEM);
    }
    let base = p as u64;
    let start = base.next_multiple_of(align);
    for (s, l) in [
        (base, start - base),
        (start + len, base + total - (start + len)),
    ] {
        if l > 0 {
            // SAFETY: the trimmed ends of the mapping just made.
            unsafe { libc::munmap(s as *mut c_void, l as usize) };
        }
    }
    // SAFETY: start..start+len lies in the reservation just made (ours); the memfd replaces it.
    let m = unsafe {
        libc::mmap(
            start as *mut c_void,
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd,
            0,
        )
    };
    if m == libc::MAP_FAILED {
        call::debug(format_args!(
            "cuMemAlloc: mmap of the memfd ({len} bytes): {}",
            std::io::Error::last_os_error()
        ));
        // SAFETY: the reservation made above.
        unsafe { libc::munmap(start as *mut c_void, len as usize) };
        return Err(OPERATING_SYSTEM);
    }
    Ok(start)
}

/// A new memfd of `len` bytes for a plain allocation.
fn new_memfd(len: u64) -> Result<i32, CUresult> {
    // SAFETY: a valid name and flags.
    let fd = unsafe { libc::memfd_create(ALLOC_MEMFD_NAME.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        debug(format_args!(
            "cuMemAlloc: memfd_create: {}",
            std::io::Error::last_os_error()
        ));
        return Err(OPERATING_SYSTEM);
    }
    // SAFETY: fd is the memfd just created.
    if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
        debug(format_args!(
            "cuMemAlloc: ftruncate: {}",
            std::io::Error::last_os_error()
        ));
        // SAFETY: our own descriptor, used by nobody else yet.
        unsafe { libc::close(fd) };
        return Err(OPERATING_SYSTEM);
    }
    Ok(fd)
}

/// Alignment of an allocation of `len` bytes, as the driver's.
fn alignment(len: u64) -> u64 {
    if len >= GRANULARITY {
        GRANULARITY
    } else {
        PAGE
    }
}

fn alloc(call: &str, size: u64) -> Result<CUdeviceptr, CUresult> {
    need_context()?;
    if size == 0 {
        invalid(call, format_args!("size 0"))?;
    }
    let len = size
        .checked_next_multiple_of(PAGE)
        .ok_or(crate::codes::OUT_OF_MEMORY)?;
    charge(len)?;
    let mapped = new_memfd(len).and_then(|fd| match map_aligned(fd, len, alignment(size)) {
        Ok(p) => Ok((p, fd)),
        Err(e) => {
            // SAFETY: the memfd just made, not mapped.
            unsafe { libc::close(fd) };
            Err(e)
        }
    });
    match mapped {
        Ok((p, memfd)) => {
            allocs().insert(p, Alloc { len, memfd });
            Ok(p)
        }
        Err(e) => {
            refund(len);
            Err(e)
        }
    }
}

pub unsafe extern "C" fn mem_alloc(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    call::run("cuMemAlloc_v2", || {
        if dptr.is_null() {
            return invalid("cuMemAlloc_v2", format_args!("null dptr"));
        }
        let p = alloc("cuMemAlloc_v2", size as u64)?;
        // SAFETY: the caller's out pointer, checked for null above.
        unsafe { put(dptr, p) }
    })
}

/// Managed memory, played by a plain allocation.
pub unsafe extern "C" fn mem_alloc_managed(
    dptr: *mut CUdeviceptr,
    size: usize,
    _flags: u32,
) -> CUresult {
    call::run("cuMemAllocManaged", || {
        if dptr.is_null() {
            return invalid("cuMemAllocManaged", format_args!("null dptr"));
        }
        let p = alloc("cuMemAllocManaged", size as u64)?;
        // SAFETY: the caller's out pointer, checked for null above.
        unsafe { put(dptr, p) }
    })
}

/// The inode of an open descriptor (0 when it cannot be read).
fn inode_of(fd: i32) -> u64 {
    // SAFETY: stat is plain data; fstat fills it or fails.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on any integer is safe; it fails for a closed descriptor.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return 0;
    }
    st.st_ino
}

/// What an IPC handle of this driver names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct IpcName {
    pid: u32,
    memfd: i32,
    inode: u64,
    len: u64,
}

impl IpcName {
    fn encode(&self) -> IpcMemHandle {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(IPC_MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.memfd.to_le_bytes());
        b[16..24].copy_from_slice(&self.inode.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        IpcMemHandle { reserved: b }
    }

    fn decode(h: &IpcMemHandle) -> Option<Self> {
        let b = &h.reserved;
        if &b[..8] != IPC_MAGIC || b[32..].iter().any(|&x| x != 0) {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        Some(IpcName {
            pid: u32_at(8),
            memfd: u32_at(12) as i32,
            inode: u64_at(16),
            len: u64_at(24),
        })
    }
}

/// `cuIpcGetMemHandle`: `ptr` anywhere in a `cuMemAlloc` allocation names all of it.
pub unsafe extern "C" fn ipc_get_mem_handle(
    handle: *mut IpcMemHandle,
    ptr: CUdeviceptr,
) -> CUresult {
    const CALL: &str = "cuIpcGetMemHandle";
    call::run(CALL, || {
        need_context()?;
        if handle.is_null() {
            return invalid(CALL, format_args!("null handle"));
        }
        let name = {
            let a = allocs();
            let Some((_, found)) = a
                .range(..=ptr)
                .next_back()
                .filter(|(base, al)| ptr - **base < al.len)
            else {
                return invalid(
                    CALL,
                    format_args!(
                        "{ptr:#x} is not in memory of cuMemAlloc (VMM memory cannot be shared this way)"
                    ),
                );
            };
            IpcName {
                pid: std::process::id(),
                memfd: found.memfd,
                inode: inode_of(found.memfd),
                len: found.len,
            }
        };
        // SAFETY: the caller's out pointer, checked for null above.
        unsafe { put(handle, name.encode()) }
    })
}

/// `cuIpcOpenMemHandle_v2`.
pub unsafe extern "C" fn ipc_open_mem_handle(
    dptr: *mut CUdeviceptr,
    handle: IpcMemHandle,
    flags: u32,
) -> CUresult {
    const CALL: &str = "cuIpcOpenMemHandle_v2";
    call::run(CALL, || {
        need_context()?;
        if dptr.is_null() || flags & !IPC_LAZY_ENABLE_PEER_ACCESS != 0 {
            return invalid(CALL, format_args!("dptr {dptr:p} flags {flags:#x}"));
        }
        let Some(name) = IpcName::decode(&handle) else {
            return invalid(CALL, format_args!("not an IPC handle of this driver"));
        };
        if name.pid == std::process::id() {
            debug(format_args!("{CALL}: the handle was made by this process"));
            return Err(INVALID_CONTEXT);
        }
        let source = (name.pid, name.inode);
        {
            let mut o = opened();
            if let Some((base, m)) = o.iter_mut().find(|(_, m)| m.source == source) {
                m.refs += 1;
                let base = *base;
                drop(o);
                // SAFETY: the caller's out pointer, checked for null above.
                return unsafe { put(dptr, base) };
            }
        }
        let path = format!("/proc/{}/fd/{}", name.pid, name.memfd);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| {
                debug(format_args!("{CALL}: {path}: {e}"));
                INVALID_VALUE
            })?;
        use std::os::fd::AsRawFd;
        let fd = file.as_raw_fd();
        let ours = std::fs::read_link(format!("/proc/self/fd/{fd}"))
            .is_ok_and(|p| p.to_string_lossy().starts_with("/memfd:fakecuda-alloc"));
        if !ours || inode_of(fd) != name.inode || name.len == 0 || name.len % PAGE != 0 {
            return invalid(
                CALL,
                format_args!("{path} is not the allocation the handle names (freed?)"),
            );
        }
        let base = map_aligned(fd, name.len, alignment(name.len))?;
        drop(file);
        let mut o = opened();
        o.insert(
            base,
            Opened {
                source,
                len: name.len,
                refs: 1,
            },
        );
        drop(o);
        // SAFETY: the caller's out pointer, checked for null above.
        unsafe { put(dptr, base) }
    })
}

/// `cuIpcCloseMemHandle`: `ptr` must be what `cuIpcOpenMemHandle` returned.
pub unsafe extern "C" fn ipc_close_mem_handle(ptr: CUdeviceptr) -> CUresult {
    const CALL: &str = "cuIpcCloseMemHandle";
    call::run(CALL, || {
        need_context()?;
        let unmap = {
            let mut o = opened();
            let Some(m) = o.get_mut(&ptr) else {
                return invalid(
                    CALL,
                    format_args!("{ptr:#x} was not opened by cuIpcOpenMemHandle"),
                );
            };
            m.refs -= 1;
            if m.refs > 0 {
                None
            } else {
                o.remove(&ptr).map(|m| m.len)
            }
        };
        if let Some(len) = unmap {
            // SAFETY: the mapping cuIpcOpenMemHandle made at this base, with its length; removed
            // from the table above, so nothing else unmaps it.
            unsafe { libc::munmap(ptr as *mut c_void, len as usize) };
        }
        Ok(())
    })
}

pub unsafe extern "C" fn mem_alloc_pitch(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: u32,
) -> CUresult {
    const CALL: &str = "cuMemAllocPitch_v2";
    call::run(CALL, || {
        if dptr.is_null() || pitch.is_null() || !matches!(element_size, 4 | 8 | 16) {
            return invalid(CALL, format_args!("element size {element_size}"));
        }
        let p = (width as u64)
            .checked_next_multiple_of(PITCH_ALIGN)
            .filter(|&p| p > 0)
            .ok_or(crate::codes::INVALID_VALUE)?;
        let total = p
            .checked_mul(height as u64)
            .ok_or(crate::codes::INVALID_VALUE)?;
        let base = alloc(CALL, total)?;
        // SAFETY: the caller's out pointers, checked for null above.
        unsafe {
            put(dptr, base)?;
            put(pitch, p as usize)
        }
    })
}

fn free(ptr: CUdeviceptr) -> CuResult {
    need_context()?;
    if ptr == 0 {
        return Ok(());
    }
    let Some(Alloc { len, memfd }) = allocs().remove(&ptr) else {
        return invalid(
            "cuMemFree_v2",
            format_args!("{ptr:#x} is not the base of an allocation of cuMemAlloc"),
        );
    };
    // SAFETY: the mapping made by alloc() for this base, with its length, and its memfd;
    // removed from the table above, so nothing else frees them. Another process's IPC mapping
    // of the memfd stays valid (the driver calls using it after this undefined).
    unsafe {
        libc::munmap(ptr as *mut c_void, len as usize);
        libc::close(memfd);
    }
    refund(len);
    Ok(())
}

pub unsafe extern "C" fn mem_free(ptr: CUdeviceptr) -> CUresult {
    call::run("cuMemFree_v2", || free(ptr))
}
