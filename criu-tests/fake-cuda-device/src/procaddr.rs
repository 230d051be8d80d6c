//! `cuGetProcAddress` and `cuGetProcAddress_v2`: a base name and a CUDA version to the entry
//! point of the matching ABI (`cuMemAlloc` at 3020+ is `cuMemAlloc_v2`, ...).
//!
//! What is handed out is the implementation behind the export, taken from the export table in
//! `lib.rs`, not looked up by symbol: a `dlsym` from here would go through the agent's `dlsym`
//! interposer when it is preloaded, and the exported symbol itself can be interposed by it. The
//! real driver also hands out its own functions; swapping in the agent's hooks is the agent's
//! business (its `cuGetProcAddress` interposer does that after calling this one).

use std::ffi::{CStr, c_char, c_int, c_void};

use crate::call::{self, put};
use crate::codes::{CUresult, INVALID_VALUE, NOT_FOUND};

/// `CU_GET_PROC_ADDRESS_SUCCESS`, `..._SYMBOL_NOT_FOUND`, `..._VERSION_NOT_SUFFICIENT`.
const STATUS_SUCCESS: c_int = 0;
const STATUS_NOT_FOUND: c_int = 1;
const STATUS_VERSION_NOT_SUFFICIENT: c_int = 2;

/// Exports whose name has a suffix, and the version from which `cuGetProcAddress(base)` means
/// them (the CUDA version that introduced that ABI). Others with a `_v2` export: 3020.
const VERSIONED: &[(&str, &str, c_int)] = &[
    ("cuGetProcAddress", "cuGetProcAddress_v2", 12000),
    ("cuStreamDestroy", "cuStreamDestroy_v2", 4000),
    ("cuEventDestroy", "cuEventDestroy_v2", 4000),
    (
        "cuDevicePrimaryCtxRelease",
        "cuDevicePrimaryCtxRelease_v2",
        11000,
    ),
    ("cuMemHostRegister", "cuMemHostRegister_v2", 6050),
    ("cuDeviceGetUuid", "cuDeviceGetUuid_v2", 11040),
    ("cuIpcOpenMemHandle", "cuIpcOpenMemHandle_v2", 11000),
];

/// Version from which `_v2` exports not listed in [`VERSIONED`] apply.
const DEFAULT_V2_VERSION: c_int = 3020;

/// Resolves `name` (a base name) for `version`: Ok(entry point) or Err(status).
pub fn resolve(name: &str, version: c_int) -> Result<*mut c_void, c_int> {
    let (v2, since) = VERSIONED
        .iter()
        .find(|(base, _, _)| *base == name)
        .map_or_else(
            || (format!("{name}_v2"), DEFAULT_V2_VERSION),
            |(_, v2, since)| ((*v2).to_owned(), *since),
        );
    if let Some(p) = crate::implementation(v2.as_bytes()) {
        if version >= since {
            return Ok(p);
        }
        // The older ABI of this function is not implemented here.
        return crate::implementation(name.as_bytes()).ok_or(STATUS_VERSION_NOT_SUFFICIENT);
    }
    crate::implementation(name.as_bytes()).ok_or(STATUS_NOT_FOUND)
}

fn get(
    call_name: &str,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    status: *mut c_int,
) -> CUresult {
    call::run_unlocked(call_name, || {
        if symbol.is_null() || pfn.is_null() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: a C string per the caller.
        let name = unsafe { CStr::from_ptr(symbol) }.to_string_lossy();
        let (p, st) = match resolve(&name, version) {
            Ok(p) => (p, STATUS_SUCCESS),
            Err(st) => (std::ptr::null_mut(), st),
        };
        // SAFETY: pfn checked non-null; status is null or valid per the caller.
        unsafe {
            put(pfn, p)?;
            if !status.is_null() {
                put(status, st)?;
            }
        }
        if p.is_null() {
            call::debug(format_args!("{call_name}({name}, {version}): not found"));
            return Err(NOT_FOUND);
        }
        Ok(())
    })
}

pub unsafe extern "C" fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    _flags: u64,
) -> CUresult {
    get(
        "cuGetProcAddress",
        symbol,
        pfn,
        version,
        std::ptr::null_mut(),
    )
}

pub unsafe extern "C" fn get_proc_address_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    _flags: u64,
    status: *mut c_int,
) -> CUresult {
    get("cuGetProcAddress_v2", symbol, pfn, version, status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_pick_the_abi() {
        let v2 = crate::implementation(b"cuMemAlloc_v2").unwrap();
        assert_eq!(resolve("cuMemAlloc", 13000), Ok(v2));
        assert_eq!(
            resolve("cuMemAlloc", 3000),
            Err(STATUS_VERSION_NOT_SUFFICIENT)
        );
        let gpa2 = crate::implementation(b"cuGetProcAddress_v2").unwrap();
        let gpa1 = crate::implementation(b"cuGetProcAddress").unwrap();
        assert_eq!(resolve("cuGetProcAddress", 13000), Ok(gpa2));
        assert_eq!(resolve("cuGetProcAddress", 11080), Ok(gpa1));
        assert!(resolve("cuMemMap", 13000).is_ok());
        assert_eq!(resolve("cuNoSuchThing", 13000), Err(STATUS_NOT_FOUND));
    }
}
