//! `libfakecudadev.so`: a stand-in CUDA driver for the *workload* side of the CI tests, where
//! host memory plays device memory, so that the gpusnap agent's split path (convert allocations
//! to VMM mappings, copy them out, release, re-create, copy back) runs for real without a GPU.
//!
//! A workload loads it as `libcuda.so.1` (a symlink in a directory on `LD_LIBRARY_PATH`), with
//! the agent preloaded; CRIU's side uses the checkpoint-API stand-in `fake-cuda`
//! (`libfakecuda.so`, via `GPUSNAP_LIBCUDA`). The two meet in two places: the restore thread,
//! named `fakecuda-rt`, that `cuInit` starts ([`rt`]), and the state files under
//! `$FAKECUDA_DIR`, which this side reads to block calls while the process is locked ([`lock`]),
//! or, with `FAKECUDADEV_STATE_PAGE=1` (containers: a pid that is not the host's), the state page
//! in the process's own memory ([`state_page`]).
//!
//! How device memory is played ([`vmm`], [`alloc`], [`copy`]):
//! - `cuMemAddressReserve`: a `PROT_NONE` anonymous mapping, 2 MiB-aligned, at the wished
//!   address where it is free (never, with `FAKECUDA_ADDRESS_TAKEN=1`: the address counts as
//!   taken, as a process's own mappings may hold it); `cuMemAddressFree`: `munmap`.
//! - `cuMemCreate`: a memfd of the size (the handle carries the fd); `cuMemRelease`: close it.
//!   Shareable handles are POSIX fds of that memfd (`cuMemExportToShareableHandle`,
//!   `cuMemImportFromShareableHandle`); `cuDeviceGetAttribute` says they are supported (not with
//!   `FAKECUDA_NO_POSIX_FD=1`).
//! - `cuMemMap`: the memfd mapped shared over the reservation (`MAP_FIXED`), after checking in
//!   `/proc/self/maps` that the range is an unmapped reservation; `cuMemUnmap`: the reservation
//!   put back. So released memory has no pages, and CRIU dumps mapped memory as shared memory.
//! - `cuMemAlloc_v2`: a shared mapping of a memfd of its own (what the agent leaves to the
//!   driver), which legacy CUDA IPC (`cuIpcGetMemHandle`, `cuIpcOpenMemHandle_v2`,
//!   `cuIpcCloseMemHandle`) hands to other processes; VMM memory it refuses, as the driver does.
//! - Copies are synchronous, through `process_vm_readv` on the process itself, so an invalid
//!   address fails the call instead of crashing; streams and events are plain handles (and
//!   interprocess events' IPC handles name them, see [`sync`]).
//! - Kernels: only the agent's device hash, run on the host ([`kernel`]).
//!
//! Tests can inject faults into the workload's driver calls (`fail` or `hang` a named call)
//! through a file under `$FAKECUDA_DIR` ([`inject`]).
//!
//! Every entry point catches panics and checks its pointers ([`call`]); failures are reported on
//! stderr with `FAKECUDADEV_DEBUG=1`. The entry points are the CUDA 13 C signatures; each
//! exported symbol calls an implementation that is not exported, which is also what
//! `cuGetProcAddress` hands out ([`procaddr`]): calls inside this library and the pointers it
//! returns never go through symbols the preloaded agent interposes.

#![allow(non_snake_case)]

mod alloc;
mod call;
mod calls;
mod codes;
mod copy;
mod ctx;
mod errors;
mod inject;
mod kernel;
mod lock;
mod maps;
mod procaddr;
mod rt;
mod state_page;
mod sync;
mod vmm;

use std::ffi::{c_char, c_int, c_void};

use codes::CUresult;
use ctx::{CUcontext, CUdevice};
use sync::{CUevent, CUstream};
use vmm::{AccessDesc, AllocationProp, CUdeviceptr, Handle};

/// Declares the exported entry points, each a thin call of its implementation, and
/// [`implementation`], the name → implementation table behind `cuGetProcAddress`.
macro_rules! exports {
    ($( $export:ident => $imp:path [ $($arg:ident : $ty:ty),* ]; )*) => {
        $(
            /// The CUDA driver entry point of this name (see the crate docs).
            ///
            /// # Safety
            /// As the driver function: pointer arguments valid as cuda.h documents them.
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn $export($($arg: $ty),*) -> CUresult {
                // SAFETY: the caller's arguments are passed on unchanged, under the same
                // contract.
                unsafe { $imp($($arg),*) }
            }
        )*

        /// The implementation behind an exported name, as a plain pointer.
        pub(crate) fn implementation(name: &[u8]) -> Option<*mut c_void> {
            $(
                if name == stringify!($export).as_bytes() {
                    let f: unsafe extern "C" fn($($ty),*) -> CUresult = $imp;
                    return Some(f as *mut c_void);
                }
            )*
            None
        }
    };
}

exports! {
    cuInit => rt::init [flags: u32];
    cuDriverGetVersion => ctx::driver_get_version [version: *mut c_int];
    cuGetErrorName => errors::get_error_name [code: CUresult, name: *mut *const c_char];
    cuGetErrorString => errors::get_error_string [code: CUresult, text: *mut *const c_char];
    cuGetProcAddress => procaddr::get_proc_address
        [symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64];
    cuGetProcAddress_v2 => procaddr::get_proc_address_v2
        [symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64,
         status: *mut c_int];

    cuDeviceGetCount => ctx::device_get_count [count: *mut c_int];
    cuDeviceGet => ctx::device_get [dev: *mut CUdevice, ordinal: c_int];
    cuDeviceGetName => ctx::device_get_name [name: *mut c_char, len: c_int, dev: CUdevice];
    cuDeviceTotalMem_v2 => ctx::device_total_mem [bytes: *mut usize, dev: CUdevice];
    cuDeviceGetAttribute => ctx::device_get_attribute
        [value: *mut c_int, attribute: c_int, dev: CUdevice];
    cuDeviceGetUuid => ctx::device_get_uuid [uuid: *mut [u8; 16], dev: CUdevice];
    cuDeviceGetUuid_v2 => ctx::device_get_uuid [uuid: *mut [u8; 16], dev: CUdevice];
    cuDevicePrimaryCtxRetain => ctx::primary_ctx_retain [ctx: *mut CUcontext, dev: CUdevice];
    cuDevicePrimaryCtxRelease_v2 => ctx::primary_ctx_release [dev: CUdevice];
    cuCtxSetCurrent => ctx::ctx_set_current [ctx: CUcontext];
    cuCtxGetCurrent => ctx::ctx_get_current [ctx: *mut CUcontext];
    cuCtxGetDevice => ctx::ctx_get_device [dev: *mut CUdevice];
    cuCtxSynchronize => ctx::ctx_synchronize [];
    cuMemGetInfo_v2 => ctx::mem_get_info [free: *mut usize, total: *mut usize];

    cuMemGetAllocationGranularity => vmm::get_granularity
        [granularity: *mut usize, prop: *const AllocationProp, option: u32];
    cuMemAddressReserve => vmm::address_reserve
        [ptr: *mut CUdeviceptr, size: usize, alignment: usize, addr: CUdeviceptr, flags: u64];
    cuMemAddressFree => vmm::address_free [ptr: CUdeviceptr, size: usize];
    cuMemCreate => vmm::create
        [handle: *mut Handle, size: usize, prop: *const AllocationProp, flags: u64];
    cuMemRelease => vmm::release [handle: Handle];
    cuMemGetAllocationPropertiesFromHandle => vmm::get_allocation_properties_from_handle
        [prop: *mut AllocationProp, handle: Handle];
    cuMemMap => vmm::map
        [ptr: CUdeviceptr, size: usize, offset: usize, handle: Handle, flags: u64];
    cuMemUnmap => vmm::unmap [ptr: CUdeviceptr, size: usize];
    cuMemSetAccess => vmm::set_access
        [ptr: CUdeviceptr, size: usize, desc: *const AccessDesc, count: usize];
    cuMemExportToShareableHandle => vmm::export_to_shareable_handle
        [out: *mut c_void, handle: Handle, handle_type: u32, flags: u64];
    cuMemImportFromShareableHandle => vmm::import_from_shareable_handle
        [handle: *mut Handle, os_handle: *mut c_void, handle_type: u32];

    cuMemAlloc_v2 => alloc::mem_alloc [dptr: *mut CUdeviceptr, size: usize];
    cuMemAllocPitch_v2 => alloc::mem_alloc_pitch
        [dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize,
         element_size: u32];
    cuMemFree_v2 => alloc::mem_free [ptr: CUdeviceptr];
    // State the real driver cannot checkpoint; here plain stand-ins, so the agent's recording
    // hooks can be exercised.
    cuMemAllocManaged => alloc::mem_alloc_managed [dptr: *mut CUdeviceptr, size: usize, flags: u32];
    cuIpcGetMemHandle => alloc::ipc_get_mem_handle
        [handle: *mut alloc::IpcMemHandle, ptr: CUdeviceptr];
    cuIpcOpenMemHandle_v2 => alloc::ipc_open_mem_handle
        [dptr: *mut CUdeviceptr, handle: alloc::IpcMemHandle, flags: u32];
    cuIpcCloseMemHandle => alloc::ipc_close_mem_handle [ptr: CUdeviceptr];
    cuCtxEnablePeerAccess => ctx::enable_peer_access [peer: CUcontext, flags: u32];

    cuMemcpyHtoD_v2 => copy::htod [dst: CUdeviceptr, src: *const c_void, len: usize];
    cuMemcpyDtoH_v2 => copy::dtoh [dst: *mut c_void, src: CUdeviceptr, len: usize];
    cuMemcpyDtoD_v2 => copy::dtod [dst: CUdeviceptr, src: CUdeviceptr, len: usize];
    cuMemcpy => copy::memcpy [dst: CUdeviceptr, src: CUdeviceptr, len: usize];
    cuMemcpyHtoDAsync_v2 => copy::htod_async
        [dst: CUdeviceptr, src: *const c_void, len: usize, stream: CUstream];
    cuMemcpyDtoHAsync_v2 => copy::dtoh_async
        [dst: *mut c_void, src: CUdeviceptr, len: usize, stream: CUstream];
    cuMemcpyAsync => copy::memcpy_async
        [dst: CUdeviceptr, src: CUdeviceptr, len: usize, stream: CUstream];
    cuMemsetD8_v2 => copy::memset_d8 [dst: CUdeviceptr, value: u8, len: usize];
    cuMemsetD8Async => copy::memset_d8_async
        [dst: CUdeviceptr, value: u8, len: usize, stream: CUstream];

    // The agent's device hash kernel (and no other code).
    cuModuleLoadData => kernel::module_load_data [module: *mut kernel::CUmodule, image: *const c_void];
    cuModuleGetFunction => kernel::module_get_function
        [f: *mut kernel::CUfunction, module: kernel::CUmodule, name: *const c_char];
    cuLaunchKernel => kernel::launch_kernel
        [f: kernel::CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32,
         shared: u32, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void];

    cuStreamCreate => sync::stream_create [stream: *mut CUstream, flags: u32];
    cuStreamDestroy_v2 => sync::stream_destroy [stream: CUstream];
    cuStreamSynchronize => sync::stream_synchronize [stream: CUstream];
    cuStreamQuery => sync::stream_query [stream: CUstream];
    cuEventCreate => sync::event_create [event: *mut CUevent, flags: u32];
    cuIpcGetEventHandle => sync::ipc_get_event_handle
        [handle: *mut sync::IpcEventHandle, event: CUevent];
    cuIpcOpenEventHandle => sync::ipc_open_event_handle
        [event: *mut CUevent, handle: sync::IpcEventHandle];
    cuEventDestroy_v2 => sync::event_destroy [event: CUevent];
    cuEventRecord => sync::event_record [event: CUevent, stream: CUstream];
    cuEventSynchronize => sync::event_synchronize [event: CUevent];
    cuEventQuery => sync::event_query [event: CUevent];
    cuMemHostRegister_v2 => sync::host_register [ptr: *mut c_void, size: usize, flags: u32];
    cuMemHostUnregister => sync::host_unregister [ptr: *mut c_void];
}
