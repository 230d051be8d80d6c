//! Streams, events and host registration. Every copy is complete when its call returns, so
//! streams and events only need to be handles: distinct non-null values from a counter.
//! Synchronising returns at once and queries say "done".
//!
//! Interprocess events: an event created with `CU_EVENT_INTERPROCESS` (a bit of its handle
//! value says so) gets a handle from `cuIpcGetEventHandle` (magic, pid, event), and
//! `cuIpcOpenEventHandle` of such a handle returns a new event of the calling process. Nothing
//! is shared (every event is always complete). Unlike memory handles, a handle is opened in the
//! process that made it too: whether the real driver allows that is not modelled, and it lets
//! one process exercise the agent's tracking of opened events.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::call::{self, invalid, put};
use crate::codes::CUresult;
use crate::ctx::need_context;

pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;

/// Stream and event handles: a tag in the high bits, a counter in the low.
const STREAM_TAG: u64 = 0x5f00_0000_0000;
const EVENT_TAG: u64 = 0x5e00_0000_0000;
static NEXT: AtomicU64 = AtomicU64::new(1);

fn new_handle(tag: u64) -> *mut c_void {
    (tag | (NEXT.fetch_add(1, Ordering::Relaxed) << 4)) as *mut c_void
}

/// `CU_EVENT_DISABLE_TIMING` and `CU_EVENT_INTERPROCESS` (which needs the first).
const EVENT_DISABLE_TIMING: u32 = 0x2;
const EVENT_INTERPROCESS: u32 = 0x4;
/// The handle-value bit of an event created with [`EVENT_INTERPROCESS`].
const INTERPROCESS_BIT: u64 = 0x1;

/// `CUipcEventHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcEventHandle {
    pub reserved: [u8; 64],
}

/// First bytes of every IPC event handle this driver makes.
const IPC_EVENT_MAGIC: &[u8; 8] = b"FCUDAEVT";

fn is_event(e: CUevent) -> bool {
    e as u64 & !0xff_ffff_ffff == EVENT_TAG
}

/// A stream argument: null (the legacy default stream), a per-thread default (1 or 2), or ours.
fn is_stream(s: CUstream) -> bool {
    matches!(s as u64, 0..=2) || s as u64 & !0xff_ffff_ffff == STREAM_TAG
}

pub unsafe extern "C" fn stream_create(stream: *mut CUstream, _flags: u32) -> CUresult {
    call::run("cuStreamCreate", || {
        need_context()?;
        // SAFETY: the caller's out pointer, checked for null by put.
        unsafe { put(stream, new_handle(STREAM_TAG)) }
    })
}

pub unsafe extern "C" fn stream_destroy(stream: CUstream) -> CUresult {
    call::run("cuStreamDestroy_v2", || {
        need_context()?;
        if stream.is_null() || !is_stream(stream) {
            return invalid("cuStreamDestroy_v2", format_args!("stream {stream:p}"));
        }
        Ok(())
    })
}

pub unsafe extern "C" fn stream_synchronize(stream: CUstream) -> CUresult {
    call::run("cuStreamSynchronize", || {
        need_context()?;
        if !is_stream(stream) {
            return invalid("cuStreamSynchronize", format_args!("stream {stream:p}"));
        }
        Ok(())
    })
}

pub unsafe extern "C" fn stream_query(stream: CUstream) -> CUresult {
    call::run("cuStreamQuery", || {
        need_context()?;
        if !is_stream(stream) {
            return invalid("cuStreamQuery", format_args!("stream {stream:p}"));
        }
        Ok(())
    })
}

pub unsafe extern "C" fn event_create(event: *mut CUevent, flags: u32) -> CUresult {
    call::run("cuEventCreate", || {
        need_context()?;
        let mut e = new_handle(EVENT_TAG) as u64;
        if flags & EVENT_INTERPROCESS != 0 {
            if flags & EVENT_DISABLE_TIMING == 0 {
                return invalid(
                    "cuEventCreate",
                    format_args!("CU_EVENT_INTERPROCESS without CU_EVENT_DISABLE_TIMING"),
                );
            }
            e |= INTERPROCESS_BIT;
        }
        // SAFETY: the caller's out pointer, checked for null by put.
        unsafe { put(event, e as CUevent) }
    })
}

/// `cuIpcGetEventHandle`: only for an event created with `CU_EVENT_INTERPROCESS`.
pub unsafe extern "C" fn ipc_get_event_handle(
    handle: *mut IpcEventHandle,
    event: CUevent,
) -> CUresult {
    const CALL: &str = "cuIpcGetEventHandle";
    call::run(CALL, || {
        need_context()?;
        if handle.is_null() || !is_event(event) || event as u64 & INTERPROCESS_BIT == 0 {
            return invalid(
                CALL,
                format_args!("handle {handle:p} event {event:p} (an interprocess event?)"),
            );
        }
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(IPC_EVENT_MAGIC);
        b[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        b[16..24].copy_from_slice(&(event as u64).to_le_bytes());
        // SAFETY: the caller's out pointer, checked for null above.
        unsafe { put(handle, IpcEventHandle { reserved: b }) }
    })
}

/// `cuIpcOpenEventHandle`: a new event of this process (see the module doc).
pub unsafe extern "C" fn ipc_open_event_handle(
    event: *mut CUevent,
    handle: IpcEventHandle,
) -> CUresult {
    const CALL: &str = "cuIpcOpenEventHandle";
    call::run(CALL, || {
        need_context()?;
        if &handle.reserved[..8] != IPC_EVENT_MAGIC {
            return invalid(CALL, format_args!("not an IPC event handle of this driver"));
        }
        // SAFETY: the caller's out pointer, checked for null by put.
        unsafe { put(event, new_handle(EVENT_TAG)) }
    })
}

/// The body of the calls that take one event and have nothing to do.
fn event_call(call: &str, event: CUevent) -> CUresult {
    call::run(call, || {
        need_context()?;
        if !is_event(event) {
            return invalid(call, format_args!("event {event:p}"));
        }
        Ok(())
    })
}

pub unsafe extern "C" fn event_destroy(event: CUevent) -> CUresult {
    event_call("cuEventDestroy_v2", event)
}

pub unsafe extern "C" fn event_synchronize(event: CUevent) -> CUresult {
    event_call("cuEventSynchronize", event)
}

pub unsafe extern "C" fn event_query(event: CUevent) -> CUresult {
    event_call("cuEventQuery", event)
}

pub unsafe extern "C" fn event_record(event: CUevent, stream: CUstream) -> CUresult {
    call::run("cuEventRecord", || {
        need_context()?;
        if !is_event(event) || !is_stream(stream) {
            return invalid(
                "cuEventRecord",
                format_args!("event {event:p} stream {stream:p}"),
            );
        }
        Ok(())
    })
}

pub unsafe extern "C" fn host_register(ptr: *mut c_void, size: usize, _flags: u32) -> CUresult {
    call::run("cuMemHostRegister_v2", || {
        need_context()?;
        if ptr.is_null() || size == 0 {
            return invalid("cuMemHostRegister_v2", format_args!("{ptr:p} + {size}"));
        }
        Ok(())
    })
}

pub unsafe extern "C" fn host_unregister(ptr: *mut c_void) -> CUresult {
    call::run("cuMemHostUnregister", || {
        need_context()?;
        if ptr.is_null() {
            return invalid("cuMemHostUnregister", format_args!("null pointer"));
        }
        Ok(())
    })
}
