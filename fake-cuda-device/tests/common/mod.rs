//! The shared module of the stand-in device's tests moved to `criu-tests/tests/common/` with
//! them; this shim loads it for the tests still here (`handover.rs`, `fail_closed.rs`). Remove
//! it once they have moved too.

#[path = "../../../criu-tests/tests/common/mod.rs"]
mod moved;

pub use moved::*;
