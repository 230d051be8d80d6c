//! `CUresult` values this library returns, and their names and descriptions
//! (`cuGetErrorName`, `cuGetErrorString`).

use std::ffi::CStr;

/// `CUresult`: a C enum, 4 bytes. Kept as a plain integer (see the agent's `real.rs`).
pub type CUresult = u32;

pub const SUCCESS: CUresult = 0;
pub const INVALID_VALUE: CUresult = 1;
pub const OUT_OF_MEMORY: CUresult = 2;
pub const NOT_INITIALIZED: CUresult = 3;
pub const INVALID_DEVICE: CUresult = 101;
pub const INVALID_CONTEXT: CUresult = 201;
pub const OPERATING_SYSTEM: CUresult = 304;
pub const INVALID_HANDLE: CUresult = 400;
pub const NOT_FOUND: CUresult = 500;
pub const NOT_SUPPORTED: CUresult = 801;
pub const UNKNOWN: CUresult = 999;

/// (code, name, description) of every code above.
const TABLE: &[(CUresult, &CStr, &CStr)] = &[
    (SUCCESS, c"CUDA_SUCCESS", c"no error"),
    (
        INVALID_VALUE,
        c"CUDA_ERROR_INVALID_VALUE",
        c"invalid argument",
    ),
    (OUT_OF_MEMORY, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (
        NOT_INITIALIZED,
        c"CUDA_ERROR_NOT_INITIALIZED",
        c"initialization error",
    ),
    (
        INVALID_DEVICE,
        c"CUDA_ERROR_INVALID_DEVICE",
        c"invalid device ordinal",
    ),
    (
        INVALID_CONTEXT,
        c"CUDA_ERROR_INVALID_CONTEXT",
        c"invalid device context",
    ),
    (
        OPERATING_SYSTEM,
        c"CUDA_ERROR_OPERATING_SYSTEM",
        c"OS call failed or operation not supported on this OS",
    ),
    (
        INVALID_HANDLE,
        c"CUDA_ERROR_INVALID_HANDLE",
        c"invalid resource handle",
    ),
    (
        NOT_FOUND,
        c"CUDA_ERROR_NOT_FOUND",
        c"named symbol not found",
    ),
    (
        NOT_SUPPORTED,
        c"CUDA_ERROR_NOT_SUPPORTED",
        c"operation not supported",
    ),
    (UNKNOWN, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

/// `(name, description)` of a code this library knows.
pub fn describe(code: CUresult) -> Option<(&'static CStr, &'static CStr)> {
    TABLE
        .iter()
        .find(|(c, _, _)| *c == code)
        .map(|&(_, n, d)| (n, d))
}

/// The name for messages (`CUDA error <n>` for a code not in the table).
pub fn name(code: CUresult) -> String {
    describe(code).map_or_else(
        || format!("CUDA error {code}"),
        |(n, _)| n.to_string_lossy().into_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_and_found() {
        for (c, n, _) in TABLE {
            assert_eq!(describe(*c).unwrap().0, *n);
            assert_eq!(TABLE.iter().filter(|(x, _, _)| x == c).count(), 1);
        }
        assert_eq!(name(2), "CUDA_ERROR_OUT_OF_MEMORY");
        assert_eq!(name(12345), "CUDA error 12345");
    }
}
