//! Modules and kernel launches, for the one kernel the agent launches: `gpusnap_sum64`, the
//! device hash (`gpusnap_proto::devhash`). `cuModuleLoadData` accepts PTX text that declares
//! that entry; `cuLaunchKernel` of it runs the kernel's arithmetic on the host, over "device"
//! memory read like any copy (so an invalid range fails the launch), and adds into its two
//! output words as the kernel's atomics do. Any other module or function is refused
//! (`CUDA_ERROR_NOT_FOUND`): this stand-in runs no other code.

use std::ffi::{CStr, c_char, c_uint, c_void};

use gpusnap_proto::devhash::Sum64Parts;

use crate::call::{self, CuResult, invalid};
use crate::codes::{CUresult, NOT_FOUND};
use crate::copy::copy_bytes;
use crate::sync::CUstream;

pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;

/// The entry the agent's PTX declares.
const ENTRY: &str = "gpusnap_sum64";
/// Handles: any non-null values that nothing else uses.
const MODULE: usize = 0x5355_4d36_3401;
const FUNCTION: usize = 0x5355_4d36_3402;

/// `cuModuleLoadData`: PTX text naming [`ENTRY`] as an entry point.
pub unsafe extern "C" fn module_load_data(module: *mut CUmodule, image: *const c_void) -> CUresult {
    call::run("cuModuleLoadData", || {
        if module.is_null() || image.is_null() {
            return invalid("cuModuleLoadData", format_args!("null argument"));
        }
        // SAFETY: the caller passes NUL-terminated PTX text, as the driver requires.
        let text = unsafe { CStr::from_ptr(image.cast::<c_char>()) }.to_string_lossy();
        if !text.contains(&format!(".entry {ENTRY}(")) {
            return Err(NOT_FOUND);
        }
        // SAFETY: module is a valid out pointer (checked non-null).
        unsafe { *module = MODULE as CUmodule };
        Ok(())
    })
}

/// `cuModuleGetFunction`: only [`ENTRY`] of our module.
pub unsafe extern "C" fn module_get_function(
    f: *mut CUfunction,
    module: CUmodule,
    name: *const c_char,
) -> CUresult {
    call::run("cuModuleGetFunction", || {
        if f.is_null() || name.is_null() || module as usize != MODULE {
            return invalid("cuModuleGetFunction", format_args!("bad module or pointer"));
        }
        // SAFETY: name is a NUL-terminated string (checked non-null).
        if unsafe { CStr::from_ptr(name) }.to_bytes() != ENTRY.as_bytes() {
            return Err(NOT_FOUND);
        }
        // SAFETY: f is a valid out pointer (checked non-null).
        unsafe { *f = FUNCTION as CUfunction };
        Ok(())
    })
}

/// `cuLaunchKernel` of `gpusnap_sum64(const u64 *words, u64 n, u64 *out)`, done at once.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn launch_kernel(
    f: CUfunction,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    _stream: CUstream,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    call::run("cuLaunchKernel", || {
        if f as usize != FUNCTION || params.is_null() {
            return invalid("cuLaunchKernel", format_args!("unknown function"));
        }
        // SAFETY: the caller passes one pointer per kernel parameter (three, of these types).
        let (words, n, out) = unsafe {
            (
                *(*params.add(0)).cast::<u64>(),
                *(*params.add(1)).cast::<u64>(),
                *(*params.add(2)).cast::<u64>(),
            )
        };
        sum64(words, n, out)
    })
}

fn sum64(words: u64, n: u64, out: u64) -> CuResult {
    let mut parts = Sum64Parts::default();
    let mut piece = vec![0u8; 1 << 20];
    let mut done = 0u64;
    while done < n {
        let k = (n - done).min(piece.len() as u64 / 8);
        let bytes = (k * 8) as usize;
        copy_bytes(
            "cuLaunchKernel(gpusnap_sum64)",
            piece.as_mut_ptr() as u64,
            words + done * 8,
            bytes,
        )?;
        parts.add_words(done, &piece[..bytes]);
        done += k;
    }
    let mut acc = [0u64; 2];
    let name = "cuLaunchKernel(gpusnap_sum64 out)";
    copy_bytes(name, acc.as_mut_ptr() as u64, out, 16)?;
    acc[0] = acc[0].wrapping_add(parts.sum);
    acc[1] |= parts.any;
    copy_bytes(name, out, acc.as_ptr() as u64, 16)
}
