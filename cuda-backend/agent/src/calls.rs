//! The one list of the driver calls the agent interposes, below both its users: [`crate::real`]
//! expands the driver table's hooked entries from it, [`crate::hooks`] the [`Hooked`] map (which
//! symbol and proc name is which hook). It names only driver types, so neither user imports the
//! other.
//!
//! [`Hooked`]: crate::hooks::Hooked

use std::ffi::c_int;

/// `cuGetProcAddress` returns the `_v2` ABI of the allocation calls from this version on.
pub(crate) const V2_ALLOC_ABI: c_int = 3020;
/// `cuGetProcAddress("cuIpcOpenMemHandle")` returns the `_v2` export from this version on.
pub(crate) const V2_IPC_OPEN_ABI: c_int = 11000;
/// `cuGetProcAddress("cuEventDestroy")` returns the `_v2` export from this version on.
pub(crate) const V2_EVENT_DESTROY_ABI: c_int = 4000;
/// `cuGetProcAddress("cuGetProcAddress")` returns the `_v2` ABI from this version on.
pub(crate) const V2_PROC_ADDRESS_ABI: c_int = 12000;

/// Every interposed driver call, written once. [`Hooked`] (which symbol and proc name maps to
/// which hook, and its two addresses) and the hooked entries of [`crate::real::Driver`] are both
/// expanded from it: `hooked_calls!(then! { tokens })` calls `then! { tokens hooked { table } }`.
///
/// One line per call:
/// `Variant = export(C argument types) required|optional as driver_field, proc "name" [versions];`
/// - `export`: the hook's `extern "C"` function in [`crate::hooks`], named as the libcuda symbol it interposes; that
///   name is also what `dlsym` is asked for and what the real function is looked up by;
/// - the argument types: the C signature (all return a raw status), checked against `export`'s;
/// - `required`: the agent cannot work without it; `optional`: a driver may lack it;
/// - `proc "name"`: what `cuGetProcAddress` is asked for, and for which `cudaVersion` it returns
///   this ABI: `since V` (V and later), `before V`, or every version when none is written.
macro_rules! hooked_calls {
    ($then:ident ! { $($before:tt)* }) => {
        $then! {
            $($before)*
            hooked {
                // Converted: large allocations become VMM mappings (see `convert`).
                MemAlloc = cuMemAlloc_v2(*mut CUdeviceptr, usize)
                    required as mem_alloc, proc "cuMemAlloc" since V2_ALLOC_ABI;
                MemFree = cuMemFree_v2(CUdeviceptr)
                    required as mem_free, proc "cuMemFree" since V2_ALLOC_ABI;
                MemAllocPitch = cuMemAllocPitch_v2(
                    *mut CUdeviceptr, *mut usize, usize, usize, c_uint)
                    required as mem_alloc_pitch, proc "cuMemAllocPitch" since V2_ALLOC_ABI;
                // The application's own VMM: handle values translated (see `table`).
                MemCreate = cuMemCreate(
                    *mut CUmemGenericAllocationHandle, usize, *const CUmemAllocationProp, u64)
                    required as mem_create, proc "cuMemCreate";
                MemMap = cuMemMap(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64)
                    required as mem_map, proc "cuMemMap";
                MemUnmap = cuMemUnmap(CUdeviceptr, usize)
                    required as mem_unmap, proc "cuMemUnmap";
                MemRelease = cuMemRelease(CUmemGenericAllocationHandle)
                    required as mem_release, proc "cuMemRelease";
                // Recorded where the access is not what a re-creation gives (see `hooks`).
                MemSetAccess = cuMemSetAccess(CUdeviceptr, usize, *const CUmemAccessDesc, usize)
                    required as mem_set_access, proc "cuMemSetAccess";
                MemRetainAllocationHandle = cuMemRetainAllocationHandle(
                    *mut CUmemGenericAllocationHandle, *mut c_void)
                    optional as mem_retain_allocation_handle, proc "cuMemRetainAllocationHandle";
                MemGetAllocationPropertiesFromHandle = cuMemGetAllocationPropertiesFromHandle(
                    *mut CUmemAllocationProp, CUmemGenericAllocationHandle)
                    optional as mem_get_allocation_properties_from_handle,
                    proc "cuMemGetAllocationPropertiesFromHandle";
                MulticastBindMem = cuMulticastBindMem(
                    CUmemGenericAllocationHandle, usize, CUmemGenericAllocationHandle, usize, usize,
                    u64)
                    optional as multicast_bind_mem, proc "cuMulticastBindMem";
                // How the runtime finds every other entry point: where our pointers are handed out.
                GetProcAddress = cuGetProcAddress(
                    *const c_char, *mut *mut c_void, c_int, cuuint64_t)
                    optional as get_proc_address,
                    proc "cuGetProcAddress" before V2_PROC_ADDRESS_ABI;
                GetProcAddressV2 = cuGetProcAddress_v2(
                    *const c_char, *mut *mut c_void, c_int, cuuint64_t,
                    *mut CUdriverProcAddressQueryResult)
                    optional as get_proc_address_v2,
                    proc "cuGetProcAddress" since V2_PROC_ADDRESS_ABI;
                // Recorded (see `hazards`); CUDA IPC of converted memory is served by `ipc`.
                MemAllocManaged = cuMemAllocManaged(*mut CUdeviceptr, usize, c_uint)
                    optional as mem_alloc_managed, proc "cuMemAllocManaged";
                IpcGetMemHandle = cuIpcGetMemHandle(*mut CUipcMemHandle, CUdeviceptr)
                    optional as ipc_get_mem_handle, proc "cuIpcGetMemHandle";
                IpcOpenMemHandle = cuIpcOpenMemHandle_v2(*mut CUdeviceptr, CUipcMemHandle, c_uint)
                    optional as ipc_open_mem_handle,
                    proc "cuIpcOpenMemHandle" since V2_IPC_OPEN_ABI;
                IpcCloseMemHandle = cuIpcCloseMemHandle(CUdeviceptr)
                    optional as ipc_close_mem_handle, proc "cuIpcCloseMemHandle";
                CtxEnablePeerAccess = cuCtxEnablePeerAccess(CUcontext, c_uint)
                    optional as ctx_enable_peer_access, proc "cuCtxEnablePeerAccess";
                MemExportToShareableHandle = cuMemExportToShareableHandle(
                    *mut c_void, CUmemGenericAllocationHandle, c_uint, u64)
                    optional as mem_export_to_shareable_handle,
                    proc "cuMemExportToShareableHandle";
                MemImportFromShareableHandle = cuMemImportFromShareableHandle(
                    *mut CUmemGenericAllocationHandle, *mut c_void, c_uint)
                    optional as mem_import_from_shareable_handle,
                    proc "cuMemImportFromShareableHandle";
                // Interprocess events opened here, tracked until destroyed (see `hazards`). The
                // agent's own events are destroyed through the same (real) table entry.
                IpcOpenEventHandle = cuIpcOpenEventHandle(*mut CUevent, CUipcEventHandle)
                    optional as ipc_open_event_handle, proc "cuIpcOpenEventHandle";
                EventDestroy = cuEventDestroy_v2(CUevent)
                    required as event_destroy, proc "cuEventDestroy" since V2_EVENT_DESTROY_ABI;
                EventDestroyV1 = cuEventDestroy(CUevent)
                    optional as event_destroy_v1,
                    proc "cuEventDestroy" before V2_EVENT_DESTROY_ABI;
            }
        }
    };
}
pub(crate) use hooked_calls;
