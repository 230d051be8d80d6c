//! `cuGetErrorName` and `cuGetErrorString`: static strings.

use std::ffi::c_char;

use crate::call::{self, put};
use crate::codes::{self, CUresult, INVALID_VALUE};

fn lookup(code: CUresult, out: *mut *const c_char, pick_name: bool) -> CUresult {
    call::run_unlocked("cuGetErrorName", || match codes::describe(code) {
        Some((name, text)) => {
            let s = if pick_name { name } else { text };
            // SAFETY: the caller's out pointer, checked for null by put; the string is static.
            unsafe { put(out, s.as_ptr()) }
        }
        None => {
            if !out.is_null() {
                // SAFETY: the caller's non-null out pointer.
                unsafe { out.write_unaligned(std::ptr::null()) };
            }
            Err(INVALID_VALUE)
        }
    })
}

pub unsafe extern "C" fn get_error_name(code: CUresult, out: *mut *const c_char) -> CUresult {
    lookup(code, out, true)
}

pub unsafe extern "C" fn get_error_string(code: CUresult, out: *mut *const c_char) -> CUresult {
    lookup(code, out, false)
}
