//! Free device memory through NVML (`libnvidia-ml.so.1`), loaded at run time.
//!
//! Used before a restore to refuse clearly when a GPU lacks room, without creating a CUDA context
//! (hundreds of MiB of device memory) inside CRIU.

use std::ffi::{CString, c_char, c_uint, c_void};

#[repr(C)]
#[derive(Default)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// Free bytes on the GPU with this UUID (32 hex digits), or `None` when NVML cannot tell.
pub fn free_memory(uuid_hex: &str) -> Option<u64> {
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
    let dashed = nvml_uuid(uuid_hex)?;
    let dashed = CString::new(dashed).ok()?;
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

/// NVML wants `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
fn nvml_uuid(hex: &str) -> Option<String> {
    if hex.len() != 32 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    Some(format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn uuid_is_dashed_for_nvml() {
        assert_eq!(
            super::nvml_uuid("0123abcd456789ef0123456789abcdef").unwrap(),
            "GPU-0123abcd-4567-89ef-0123-456789abcdef"
        );
        assert!(super::nvml_uuid("xyz").is_none());
    }
}
