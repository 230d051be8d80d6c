//! Free device memory through NVML (`libnvidia-ml.so.1`), loaded at run time.
//!
//! Used before a restore to refuse clearly when a GPU lacks room, without creating a CUDA context
//! (hundreds of MiB of device memory) inside CRIU.

use crate::GpuUuid;
use std::ffi::{CString, c_char, c_uint, c_void};

/// nvml.h's `nvmlMemory_t` (v1), which `nvmlDeviceGetMemoryInfo` fills.
#[repr(C)]
#[derive(Default)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// Free bytes on the GPU with this UUID, or `None` when NVML cannot tell. (A UUID that does not
/// parse never gets here: it is refused as a [`GpuUuid`] first.)
pub fn free_memory(uuid: &GpuUuid) -> Option<u64> {
    // SAFETY: NVML is the vendor's management library, designed to be loaded anywhere.
    let lib = unsafe { libloading::Library::new("libnvidia-ml.so.1") }.ok()?;
    type InitFn = unsafe extern "C" fn() -> c_uint;
    type ByUuidFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> c_uint;
    type MemFn = unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_uint;
    // SAFETY: the symbols are resolved with the signatures of nvml.h.
    let (init, by_uuid, mem, shutdown) = unsafe {
        (
            *lib.get::<InitFn>(b"nvmlInit_v2\0").ok()?,
            *lib.get::<ByUuidFn>(b"nvmlDeviceGetHandleByUUID\0").ok()?,
            *lib.get::<MemFn>(b"nvmlDeviceGetMemoryInfo\0").ok()?,
            *lib.get::<InitFn>(b"nvmlShutdown\0").ok()?,
        )
    };
    let dashed = CString::new(uuid.to_nvml_string()).ok()?;
    // SAFETY: plain NVML calls with valid pointers; every init is paired with a shutdown.
    unsafe {
        if init() != 0 {
            return None;
        }
        let mut dev: *mut c_void = std::ptr::null_mut();
        let mut m = NvmlMemory::default();
        let ok = by_uuid(dashed.as_ptr(), &mut dev) == 0 && mem(dev, &mut m) == 0;
        shutdown();
        ok.then_some(m.free)
    }
}

#[cfg(test)]
mod tests {
    use super::NvmlMemory;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn memory_info_layout_matches_nvml_h() {
        // { unsigned long long total; unsigned long long free; unsigned long long used; }
        assert_eq!(size_of::<NvmlMemory>(), 24);
        assert_eq!(align_of::<NvmlMemory>(), 8);
        assert_eq!(offset_of!(NvmlMemory, total), 0);
        assert_eq!(offset_of!(NvmlMemory, free), 8);
        assert_eq!(offset_of!(NvmlMemory, used), 16);
    }

    #[test]
    fn uuid_is_dashed_for_nvml() {
        let uuid: crate::GpuUuid = "0123abcd456789ef0123456789abcdef".parse().unwrap();
        assert_eq!(
            uuid.to_nvml_string(),
            "GPU-0123abcd-4567-89ef-0123-456789abcdef"
        );
        assert!("xyz".parse::<crate::GpuUuid>().is_err());
    }
}
