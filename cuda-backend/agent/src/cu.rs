//! Thin, checked wrappers over the driver table: one function per call, each turning the status
//! code into a `Result` whose error names the call, its arguments and the driver's error name,
//! e.g. `cuMemCreate(addr 0x7f0000000000, 2097152 bytes, device 0) failed: CUDA_ERROR_OUT_OF_MEMORY`.

use std::ffi::{CStr, c_int, c_void};
use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU8, Ordering};

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmemAccess_flags, CUmemAccessDesc,
    CUmemAllocationGranularity_flags, CUmemAllocationHandleType, CUmemAllocationProp,
    CUmemAllocationProp_st__bindgen_ty_1, CUmemAllocationType, CUmemGenericAllocationHandle,
    CUmemLocation, CUmemLocationType, CUmodule, CUstream,
};

use crate::real::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_READY, CUDA_ERROR_NOT_SUPPORTED, CUDA_SUCCESS, CuRes,
    Driver,
};

/// `CUmemAllocationProp` as bytes (it holds a pointer field, so the struct itself is not
/// `Send`); the application's own properties, kept by the table and used again when a restore
/// re-creates the memory.
pub type PropBytes = [u8; std::mem::size_of::<CUmemAllocationProp>()];

/// Offset and value of `requestedHandleTypes` in a [`PropBytes`] (a plain `u32` field).
const HANDLE_TYPES_AT: usize = std::mem::offset_of!(CUmemAllocationProp, requestedHandleTypes);

/// The `requestedHandleTypes` bits of properties held as bytes.
pub fn requested_handle_types(p: &PropBytes) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&p[HANDLE_TYPES_AT..HANDLE_TYPES_AT + 4]);
    u32::from_ne_bytes(b)
}

/// Offsets in a [`PropBytes`] of the fields a keeper's memory is decided by.
const TYPE_AT: usize = std::mem::offset_of!(CUmemAllocationProp, type_);
const LOCATION_AT: usize = std::mem::offset_of!(CUmemAllocationProp, location);
const LOCATION_TYPE_AT: usize = LOCATION_AT + std::mem::offset_of!(CUmemLocation, type_);
const LOCATION_ID_AT: usize = LOCATION_AT + std::mem::offset_of!(CUmemLocation, id);
const FLAGS_AT: usize = std::mem::offset_of!(CUmemAllocationProp, allocFlags);
const RDMA_AT: usize =
    FLAGS_AT + std::mem::offset_of!(CUmemAllocationProp_st__bindgen_ty_1, gpuDirectRDMACapable);

/// `CU_MEM_ALLOCATION_TYPE_PINNED`, `CU_MEM_LOCATION_TYPE_DEVICE` as raw values.
const ALLOCATION_TYPE_PINNED: u32 = 1;
const LOCATION_TYPE_DEVICE: u32 = 1;

fn u32_at(p: &PropBytes, at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&p[at..at + 4]);
    u32::from_ne_bytes(b)
}

/// What a keeper must make at a restore for the job to get memory with the properties it had:
/// pinned memory on the device, exportable as a POSIX fd, and RDMA-capable or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeeperMemory {
    /// `allocFlags.gpuDirectRDMACapable` set (PyTorch's expandable segments ask for it where the
    /// device supports GPUDirect RDMA with VMM memory).
    pub rdma_capable: bool,
}

impl KeeperMemory {
    /// The properties a keeper creates this memory with on device `dev`.
    pub fn prop(self, dev: CUdevice) -> PropBytes {
        let mut p = device_prop(dev, true);
        p.allocFlags.gpuDirectRDMACapable = u8::from(self.rdma_capable);
        prop_bytes(&p)
    }
}

/// Why memory with some properties is not what a keeper makes (it is then copied out first,
/// never lent: a keeper restoring it would give the job other memory than it had).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotKeeperMemory {
    /// The device has no POSIX-fd handles: nothing of it can be exported.
    NoPosixFdHandles,
    /// Not `CU_MEM_ALLOCATION_TYPE_PINNED`.
    NotPinned(u32),
    /// Located elsewhere than on the device the allocation is recorded on (host, NUMA node).
    OtherLocation { location_type: u32, id: i32 },
    /// Handle types other than (or besides) POSIX fds.
    HandleTypes(u32),
    /// `gpuDirectRDMACapable` other than 0 or 1.
    RdmaValue(u8),
    /// Another field or flag byte is set: compression, usage, the reserved bytes, Windows
    /// handle metadata.
    OtherFlags,
}

impl fmt::Display for NotKeeperMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotKeeperMemory::NoPosixFdHandles => write!(f, "the device has no POSIX-fd handles"),
            NotKeeperMemory::NotPinned(t) => write!(f, "allocation type {t} (not pinned)"),
            NotKeeperMemory::OtherLocation { location_type, id } => {
                write!(f, "location type {location_type} id {id} (not this device)")
            }
            NotKeeperMemory::HandleTypes(t) => write!(f, "requested handle types {t:#x}"),
            NotKeeperMemory::RdmaValue(v) => write!(f, "gpuDirectRDMACapable {v}"),
            NotKeeperMemory::OtherFlags => write!(
                f,
                "compression, usage, reserved flag bytes or Windows metadata set"
            ),
        }
    }
}

/// Whether memory created with exactly `real` on device `dev` is what a keeper makes again
/// ([`KeeperMemory::prop`]): pinned, on `dev`, POSIX-fd handles only, `gpuDirectRDMACapable`
/// 0 or 1, every other byte zero. Decided from the bytes, so a value cudarc's enums do not
/// list is never read as an enum.
pub fn keeper_memory(real: &PropBytes, dev: CUdevice) -> Result<KeeperMemory, NotKeeperMemory> {
    let ty = u32_at(real, TYPE_AT);
    if ty != ALLOCATION_TYPE_PINNED {
        return Err(NotKeeperMemory::NotPinned(ty));
    }
    let (location_type, id) = (
        u32_at(real, LOCATION_TYPE_AT),
        u32_at(real, LOCATION_ID_AT) as i32,
    );
    if location_type != LOCATION_TYPE_DEVICE || id != dev {
        return Err(NotKeeperMemory::OtherLocation { location_type, id });
    }
    let types = requested_handle_types(real);
    if types != HANDLE_TYPE_POSIX_FD {
        return Err(NotKeeperMemory::HandleTypes(types));
    }
    let rdma = real[RDMA_AT];
    if rdma > 1 {
        return Err(NotKeeperMemory::RdmaValue(rdma));
    }
    let made = KeeperMemory {
        rdma_capable: rdma == 1,
    };
    // Everything else (the Windows metadata pointer, compression, usage, reserved) must be
    // zero: comparing whole bytes catches any field this check does not name.
    if made.prop(dev) != *real {
        return Err(NotKeeperMemory::OtherFlags);
    }
    Ok(made)
}

/// Whether the memory of an application's `cuMemCreate` with properties `asked` on device `dev`
/// can be lent: with no handle type asked, the agent adds the POSIX-fd type; with the POSIX-fd
/// type asked (as PyTorch's expandable segments do), the handle is exported as it is.
pub fn app_lendability(
    posix_fd_supported: bool,
    asked: &PropBytes,
    dev: CUdevice,
) -> Result<KeeperMemory, NotKeeperMemory> {
    if !posix_fd_supported {
        return Err(NotKeeperMemory::NoPosixFdHandles);
    }
    keeper_memory(&with_posix_fd(asked), dev)
}

/// `p` with the POSIX-fd handle type added to what it requests.
fn with_posix_fd(p: &PropBytes) -> PropBytes {
    let mut out = *p;
    let types = requested_handle_types(p) | HANDLE_TYPE_POSIX_FD;
    out[HANDLE_TYPES_AT..HANDLE_TYPES_AT + 4].copy_from_slice(&types.to_ne_bytes());
    out
}

/// The properties the agent creates an application's `cuMemCreate` memory with, when they
/// differ from the application's: memory a keeper can make again ([`app_lendability`]) that
/// asks for no handle type gets the POSIX-fd type added, so a dump can lend it to the keeper
/// instead of copying it off the GPU first. Memory that already asks for POSIX fds, and any
/// other properties (other handle types, compression or usage flags, a host location), is
/// created exactly as asked: `None`. The handle's properties as the application reads them are
/// its own ([`AppHandle::asked`]).
///
/// [`AppHandle::asked`]: crate::table::AppHandle::asked
pub fn lendable_prop(
    posix_fd_supported: bool,
    asked: &PropBytes,
    dev: CUdevice,
) -> Option<PropBytes> {
    if requested_handle_types(asked) != 0 {
        return None;
    }
    app_lendability(posix_fd_supported, asked, dev)
        .ok()
        .map(|_| with_posix_fd(asked))
}

/// The `gpuDirectRDMACapable` flag of properties held as bytes.
pub fn rdma_capable(p: &PropBytes) -> bool {
    p[RDMA_AT] != 0
}

/// Whether memory created with `real` is what a keeper makes at a restore
/// ([`keeper_memory`]): only such memory is lent, so a restore through the keeper gives the
/// job memory with the properties it had.
pub fn is_keeper_prop(real: &PropBytes, dev: CUdevice) -> bool {
    keeper_memory(real, dev).is_ok()
}

fn prop_bytes(p: &CUmemAllocationProp) -> PropBytes {
    // SAFETY: CUmemAllocationProp is plain data of exactly size_of::<PropBytes>() bytes with no
    // padding (4 + 4 + 8 + 8 + 8: the layout test below), read as bytes.
    unsafe { std::ptr::from_ref(p).cast::<PropBytes>().read_unaligned() }
}

/// A failed driver call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CuError {
    /// The call with its arguments, e.g. `cuMemMap(addr 0x.., 2097152 bytes)`.
    pub call: String,
    /// The raw status code.
    pub code: CuRes,
    /// The driver's name for it.
    pub name: String,
}

impl fmt::Display for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.call, self.name)
    }
}

impl std::error::Error for CuError {}

/// `CU_STREAM_NON_BLOCKING`.
const STREAM_NON_BLOCKING: u32 = 1;
/// `CU_EVENT_DISABLE_TIMING`.
const EVENT_DISABLE_TIMING: u32 = 2;
/// `CU_MEMHOSTREGISTER_PORTABLE`.
const HOST_REGISTER_PORTABLE: u32 = 1;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, as the raw value the export/import calls take.
const HANDLE_TYPE_POSIX_FD: u32 = 1;
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
const ATTRIBUTE_POSIX_FD_SUPPORTED: c_int = 103;

/// Per device ordinal: whether its memory can be created with POSIX-fd handles
/// (0 = not asked yet, 1 = no, 2 = yes). An attribute query that fails counts as "no", and is
/// remembered too, so every allocation of a device is made the same way.
static POSIX_FD_HANDLES: [AtomicU8; 64] = [const { AtomicU8::new(0) }; 64];

impl Driver {
    fn check(&self, code: CuRes, call: impl FnOnce() -> String) -> Result<(), CuError> {
        if code == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(CuError {
                call: call(),
                code,
                name: self.error_name(code),
            })
        }
    }

    pub fn cu_init(&self) -> Result<(), CuError> {
        // SAFETY: cuInit takes flags only (0).
        self.check(unsafe { (self.init)(0) }, || "cuInit(0)".into())
    }

    /// The device of the calling thread's current context.
    pub fn current_device(&self) -> Result<CUdevice, CuError> {
        let mut dev: CUdevice = 0;
        // SAFETY: dev is a valid out pointer.
        self.check(unsafe { (self.ctx_get_device)(&mut dev) }, || {
            "cuCtxGetDevice".into()
        })?;
        Ok(dev)
    }

    /// Synchronizes the calling thread's current context.
    pub fn synchronize_current(&self) -> Result<(), CuError> {
        // SAFETY: no arguments.
        self.check(unsafe { (self.ctx_synchronize)() }, || {
            "cuCtxSynchronize".into()
        })
    }

    pub fn device(&self, ordinal: i32) -> Result<CUdevice, CuError> {
        let mut dev: CUdevice = 0;
        // SAFETY: dev is a valid out pointer.
        self.check(unsafe { (self.device_get)(&mut dev, ordinal) }, || {
            format!("cuDeviceGet({ordinal})")
        })?;
        Ok(dev)
    }

    /// The ordinal of the GPU with UUID `uuid` among those this process sees, if any.
    pub fn ordinal_of(&self, uuid: &[u8; 16]) -> Result<Option<i32>, CuError> {
        let mut n: c_int = 0;
        // SAFETY: n is a valid out pointer.
        self.check(unsafe { (self.device_get_count)(&mut n) }, || {
            "cuDeviceGetCount".into()
        })?;
        for ordinal in 0..n {
            let dev = self.device(ordinal)?;
            let mut u = [0u8; 16];
            // SAFETY: u is a valid 16-byte out buffer (a CUuuid).
            self.check(unsafe { (self.device_get_uuid)(&mut u, dev) }, || {
                format!("cuDeviceGetUuid_v2(device {dev})")
            })?;
            if &u == uuid {
                return Ok(Some(ordinal));
            }
        }
        Ok(None)
    }

    pub fn retain_primary_context(&self, dev: CUdevice) -> Result<CUcontext, CuError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: ctx is a valid out pointer; dev came from cuDeviceGet.
        self.check(unsafe { (self.primary_ctx_retain)(&mut ctx, dev) }, || {
            format!("cuDevicePrimaryCtxRetain(device {dev})")
        })?;
        Ok(ctx)
    }

    pub(crate) fn set_current(&self, ctx: CUcontext) -> Result<(), CuError> {
        // SAFETY: ctx is a context handle from cuDevicePrimaryCtxRetain.
        self.check(unsafe { (self.ctx_set_current)(ctx) }, || {
            "cuCtxSetCurrent".into()
        })
    }

    /// Whether the agent's own allocations on `dev` are made exportable as POSIX fds
    /// (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`, asked once per device).
    pub fn posix_fd_handles(&self, dev: CUdevice) -> bool {
        let slot = usize::try_from(dev)
            .ok()
            .and_then(|i| POSIX_FD_HANDLES.get(i));
        match slot.map(|s| s.load(Ordering::Relaxed)) {
            Some(1) => return false,
            Some(2) => return true,
            _ => {}
        }
        let mut v: c_int = 0;
        // SAFETY: v is a valid out pointer; the attribute is a plain integer query.
        let rc = unsafe { (self.device_get_attribute)(&mut v, ATTRIBUTE_POSIX_FD_SUPPORTED, dev) };
        let yes = rc == CUDA_SUCCESS && v != 0;
        if rc != CUDA_SUCCESS {
            crate::log::debug!(
                "cuDeviceGetAttribute(POSIX fd handles, device {dev}) failed: {}; \
                 allocations there are not exportable",
                self.error_name(rc)
            );
        }
        if let Some(s) = slot {
            s.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
        }
        yes
    }

    /// Minimum VMM granularity of pinned device memory on `dev`.
    pub fn granularity(&self, dev: CUdevice) -> Result<u64, CuError> {
        let prop = device_prop(dev, self.posix_fd_handles(dev));
        let mut g: usize = 0;
        // SAFETY: g is a valid out pointer, prop a valid property struct.
        let rc = unsafe {
            (self.mem_get_allocation_granularity)(
                &mut g,
                &prop,
                CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        self.check(rc, || {
            format!("cuMemGetAllocationGranularity(device {dev})")
        })?;
        Ok(g as u64)
    }

    pub fn reserve(&self, size: u64) -> Result<CUdeviceptr, CuError> {
        let mut addr: CUdeviceptr = 0;
        // SAFETY: addr is a valid out pointer; alignment 0 (default), no fixed address, no flags.
        let rc = unsafe { (self.mem_address_reserve)(&mut addr, size as usize, 0, 0, 0) };
        self.check(rc, || format!("cuMemAddressReserve({size} bytes)"))?;
        Ok(addr)
    }

    pub fn free_reservation(&self, addr: CUdeviceptr, size: u64) -> Result<(), CuError> {
        // SAFETY: (addr, size) is a reservation made by cuMemAddressReserve with nothing mapped.
        self.check(
            unsafe { (self.mem_address_free)(addr, size as usize) },
            || format!("cuMemAddressFree(addr {addr:#x}, {size} bytes)"),
        )
    }

    /// `cuMemCreate` of `size` bytes on `dev`: pinned device memory (exportable as a POSIX fd
    /// where the device supports it, [`Driver::posix_fd_handles`]), or the properties `app` an
    /// application created its handle with (kept as bytes by the table); `addr` is only for the
    /// error message.
    pub fn create(
        &self,
        addr: CUdeviceptr,
        size: u64,
        dev: CUdevice,
        app: Option<&PropBytes>,
    ) -> Result<CUmemGenericAllocationHandle, CuError> {
        let prop = match app {
            // SAFETY: the bytes are a CUmemAllocationProp the driver accepted in the
            // application's cuMemCreate (copied by the hook); plain data, read unaligned.
            Some(b) => unsafe { b.as_ptr().cast::<CUmemAllocationProp>().read_unaligned() },
            None => device_prop(dev, self.posix_fd_handles(dev)),
        };
        let mut h: CUmemGenericAllocationHandle = 0;
        // SAFETY: h is a valid out pointer, prop a valid property struct, no flags.
        let rc = unsafe { (self.mem_create)(&mut h, size as usize, &prop, 0) };
        self.check(rc, || {
            format!("cuMemCreate(addr {addr:#x}, {size} bytes, device {dev})")
        })?;
        Ok(h)
    }

    pub fn map(
        &self,
        addr: CUdeviceptr,
        size: u64,
        h: CUmemGenericAllocationHandle,
    ) -> Result<(), CuError> {
        // SAFETY: addr..addr+size lies in a reservation of ours; h is a live handle of that size.
        let rc = unsafe { (self.mem_map)(addr, size as usize, 0, h, 0) };
        self.check(rc, || format!("cuMemMap(addr {addr:#x}, {size} bytes)"))
    }

    /// `cuMemMap` of `size` bytes of `h` from `offset` at `addr` (an application's mapping of
    /// an imported handle, made again at the same place).
    pub fn map_at(
        &self,
        addr: CUdeviceptr,
        size: u64,
        offset: u64,
        h: CUmemGenericAllocationHandle,
    ) -> Result<(), CuError> {
        // SAFETY: addr..addr+size lies in a reservation the application made and kept; h is a
        // live handle at least offset+size bytes long (it was mapped so before).
        let rc = unsafe { (self.mem_map)(addr, size as usize, offset as usize, h, 0) };
        self.check(rc, || {
            format!("cuMemMap(addr {addr:#x}, {size} bytes, offset {offset})")
        })
    }

    pub fn set_access_rw(
        &self,
        addr: CUdeviceptr,
        size: u64,
        dev: CUdevice,
    ) -> Result<(), CuError> {
        let desc = CUmemAccessDesc {
            location: device_location(dev),
            flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: (addr, size) is mapped; desc is one valid access descriptor.
        let rc = unsafe { (self.mem_set_access)(addr, size as usize, &desc, 1) };
        self.check(rc, || {
            format!("cuMemSetAccess(addr {addr:#x}, {size} bytes, device {dev})")
        })
    }

    pub fn unmap(&self, addr: CUdeviceptr, size: u64) -> Result<(), CuError> {
        // SAFETY: (addr, size) is a mapping made by cuMemMap.
        self.check(unsafe { (self.mem_unmap)(addr, size as usize) }, || {
            format!("cuMemUnmap(addr {addr:#x}, {size} bytes)")
        })
    }

    pub fn release(
        &self,
        addr: CUdeviceptr,
        h: CUmemGenericAllocationHandle,
    ) -> Result<(), CuError> {
        // SAFETY: h is a live handle from cuMemCreate; `addr` only names it in the message.
        self.check(unsafe { (self.mem_release)(h) }, || {
            format!("cuMemRelease(handle of addr {addr:#x})")
        })
    }

    /// A POSIX fd for the physical memory of `h` (`cuMemExportToShareableHandle`, the real
    /// driver's, never the agent's hook). `h` must have been created exportable.
    pub fn export_fd(&self, h: CUmemGenericAllocationHandle) -> Result<OwnedFd, CuError> {
        let call = || format!("cuMemExportToShareableHandle(handle {h:#x}, POSIX fd)");
        let export = self
            .mem_export_to_shareable_handle
            .ok_or_else(|| self.missing(CUDA_ERROR_NOT_SUPPORTED, call()))?;
        let mut fd: c_int = -1;
        // SAFETY: for POSIX fds the out parameter is an int; h is a live handle; no flags.
        let rc = unsafe {
            export(
                std::ptr::from_mut(&mut fd).cast(),
                h,
                HANDLE_TYPE_POSIX_FD,
                0,
            )
        };
        self.check(rc, call)?;
        if fd < 0 {
            return Err(self.missing(CUDA_ERROR_INVALID_VALUE, format!("{} (fd {fd})", call())));
        }
        // SAFETY: the driver just opened fd for us; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// A handle to the physical memory behind an exported POSIX fd
    /// (`cuMemImportFromShareableHandle`, the real driver's). The fd stays the caller's.
    pub fn import_fd(&self, fd: BorrowedFd<'_>) -> Result<CUmemGenericAllocationHandle, CuError> {
        let call = || {
            format!(
                "cuMemImportFromShareableHandle(fd {}, POSIX fd)",
                fd.as_raw_fd()
            )
        };
        let import = self
            .mem_import_from_shareable_handle
            .ok_or_else(|| self.missing(CUDA_ERROR_NOT_SUPPORTED, call()))?;
        let mut h: CUmemGenericAllocationHandle = 0;
        // The POSIX fd is passed as the pointer's value, as cuda.h documents.
        let os_handle = fd.as_raw_fd() as usize as *mut c_void;
        // SAFETY: h is a valid out pointer; the fd is open for the duration of the call.
        let rc = unsafe { import(&mut h, os_handle, HANDLE_TYPE_POSIX_FD) };
        self.check(rc, call)?;
        Ok(h)
    }

    /// `cuMemGetAllocationPropertiesFromHandle` of a driver handle, as bytes; None where the
    /// driver lacks the call.
    pub fn props_of_handle(
        &self,
        h: CUmemGenericAllocationHandle,
    ) -> Result<Option<PropBytes>, CuError> {
        let Some(get) = self.mem_get_allocation_properties_from_handle else {
            return Ok(None);
        };
        // Never read as the struct: the driver may write enum values cudarc does not list.
        let mut out = std::mem::MaybeUninit::<CUmemAllocationProp>::zeroed();
        // SAFETY: out is an aligned, writable CUmemAllocationProp; h is a live handle of ours.
        let rc = unsafe { get(out.as_mut_ptr(), h) };
        self.check(rc, || {
            format!("cuMemGetAllocationPropertiesFromHandle(handle {h:#x})")
        })?;
        // SAFETY: the zeroed (then written) struct read as its plain bytes, no padding.
        Ok(Some(unsafe { out.as_ptr().cast::<PropBytes>().read() }))
    }

    /// An error for a call that could not be made (the driver lacks it) or returned nonsense.
    fn missing(&self, code: CuRes, call: String) -> CuError {
        CuError {
            call,
            code,
            name: self.error_name(code),
        }
    }

    /// `cuMemAddressReserve` of exactly `addr..addr+size` (a keeper maps a job's memory where
    /// the job has it). The driver takes `addr` as a hint: any other address is given back and
    /// refused.
    pub fn reserve_at(&self, addr: CUdeviceptr, size: u64) -> Result<(), CuError> {
        let mut got: CUdeviceptr = 0;
        // SAFETY: got is a valid out pointer; default alignment, `addr` as the wished address.
        let rc = unsafe { (self.mem_address_reserve)(&mut got, size as usize, 0, addr, 0) };
        self.check(rc, || {
            format!("cuMemAddressReserve({size} bytes at {addr:#x})")
        })?;
        if got == addr {
            return Ok(());
        }
        let _ = self.free_reservation(got, size);
        Err(CuError {
            call: format!("cuMemAddressReserve({size} bytes at {addr:#x})"),
            code: crate::real::CUDA_ERROR_INVALID_VALUE,
            name: format!("the driver offered {got:#x} instead"),
        })
    }

    pub fn create_stream(&self) -> Result<CUstream, CuError> {
        let mut s: CUstream = std::ptr::null_mut();
        // SAFETY: s is a valid out pointer; flags are valid.
        let rc = unsafe { (self.stream_create)(&mut s, STREAM_NON_BLOCKING) };
        self.check(rc, || "cuStreamCreate(CU_STREAM_NON_BLOCKING)".into())?;
        Ok(s)
    }

    pub(crate) fn sync_stream(&self, s: CUstream) -> Result<(), CuError> {
        // SAFETY: s is a live stream handle.
        self.check(unsafe { (self.stream_synchronize)(s) }, || {
            "cuStreamSynchronize".into()
        })
    }

    pub fn create_event(&self) -> Result<CUevent, CuError> {
        let mut e: CUevent = std::ptr::null_mut();
        // SAFETY: e is a valid out pointer; flags are valid.
        let rc = unsafe { (self.event_create)(&mut e, EVENT_DISABLE_TIMING) };
        self.check(rc, || "cuEventCreate(CU_EVENT_DISABLE_TIMING)".into())?;
        Ok(e)
    }

    pub(crate) fn record(&self, e: CUevent, s: CUstream) -> Result<(), CuError> {
        // SAFETY: e and s are live handles of the current context.
        self.check(unsafe { (self.event_record)(e, s) }, || {
            "cuEventRecord".into()
        })
    }

    pub(crate) fn wait_event(&self, e: CUevent) -> Result<(), CuError> {
        // SAFETY: e is a live event handle.
        self.check(unsafe { (self.event_synchronize)(e) }, || {
            "cuEventSynchronize".into()
        })
    }

    /// Ok(true) when the work before the event is done, Ok(false) while it runs.
    pub(crate) fn event_done(&self, e: CUevent) -> Result<bool, CuError> {
        // SAFETY: e is a live event handle.
        let rc = unsafe { (self.event_query)(e) };
        if rc == CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        self.check(rc, || "cuEventQuery".into())?;
        Ok(true)
    }

    /// Pins `len` bytes at `ptr` for all contexts (`CU_MEMHOSTREGISTER_PORTABLE`).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be a live mapping of this process, page-aligned.
    pub unsafe fn host_register(&self, ptr: *mut c_void, len: usize) -> Result<(), CuError> {
        // SAFETY: the caller guarantees the range is a live mapping.
        self.check(
            unsafe { (self.mem_host_register)(ptr, len, HOST_REGISTER_PORTABLE) },
            || format!("cuMemHostRegister({ptr:p}, {len} bytes, PORTABLE)"),
        )
    }

    /// # Safety
    /// `ptr` must be the base of a range registered with [`Driver::host_register`].
    pub unsafe fn host_unregister(&self, ptr: *mut c_void) -> Result<(), CuError> {
        // SAFETY: the caller guarantees ptr was registered.
        self.check(unsafe { (self.mem_host_unregister)(ptr) }, || {
            format!("cuMemHostUnregister({ptr:p})")
        })
    }

    /// # Safety
    /// `dst..dst+len` must stay valid, registered host memory until the copy completes.
    pub unsafe fn copy_dtoh_async(
        &self,
        dst: *mut c_void,
        src: CUdeviceptr,
        len: u64,
        s: CUstream,
    ) -> Result<(), CuError> {
        // SAFETY: the caller guarantees dst; src is a mapped device range of ours.
        self.check(
            unsafe { (self.memcpy_dtoh_async)(dst, src, len as usize, s) },
            || format!("cuMemcpyDtoHAsync(addr {src:#x}, {len} bytes)"),
        )
    }

    /// # Safety
    /// `src..src+len` must stay valid, registered host memory until the copy completes.
    pub unsafe fn copy_htod_async(
        &self,
        dst: CUdeviceptr,
        src: *const c_void,
        len: u64,
        s: CUstream,
    ) -> Result<(), CuError> {
        // SAFETY: the caller guarantees src; dst is a mapped device range of ours.
        self.check(
            unsafe { (self.memcpy_htod_async)(dst, src, len as usize, s) },
            || format!("cuMemcpyHtoDAsync(addr {dst:#x}, {len} bytes)"),
        )
    }
}

impl Driver {
    /// `len` bytes from device address `src` to device address `dst`, in the current context;
    /// complete when it returns (the keeper's snapshot of an asynchronous `-R`).
    pub fn copy_dtod(&self, dst: CUdeviceptr, src: CUdeviceptr, len: u64) -> Result<(), CuError> {
        // SAFETY: both ranges are device memory of ours, mapped with read-write access (the
        // keeper's adoption and its fresh snapshot memory); no host pointer is involved.
        self.check(
            unsafe { (self.memcpy_dtod)(dst, src, len as usize) },
            || format!("cuMemcpyDtoD({src:#x} -> {dst:#x}, {len} bytes)"),
        )
    }

    /// `(free, total)` device memory of the current context's GPU, in bytes.
    pub fn mem_info(&self) -> Result<(u64, u64), CuError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: two valid out pointers.
        let rc = unsafe { (self.mem_get_info)(&mut free, &mut total) };
        self.check(rc, || "cuMemGetInfo".to_owned())?;
        Ok((free as u64, total as u64))
    }

    /// `len` bytes of `value` at `dst`, on stream `s`.
    pub(crate) fn memset_async(
        &self,
        dst: CUdeviceptr,
        value: u8,
        len: u64,
        s: CUstream,
    ) -> Result<(), CuError> {
        // SAFETY: dst..dst+len is device memory of ours (the callers' ranges are checked or
        // their own allocation); s is a live stream.
        self.check(
            unsafe { (self.memset_d8_async)(dst, value, len as usize, s) },
            || format!("cuMemsetD8Async(addr {dst:#x}, {value}, {len} bytes)"),
        )
    }

    /// Device memory of `len` bytes from the real `cuMemAlloc` (not converted: the agent's own).
    pub fn alloc_plain(&self, len: u64) -> Result<CUdeviceptr, CuError> {
        let mut p: CUdeviceptr = 0;
        // SAFETY: p is a valid out pointer.
        self.check(unsafe { (self.mem_alloc)(&mut p, len as usize) }, || {
            format!("cuMemAlloc({len} bytes)")
        })?;
        Ok(p)
    }

    pub fn free_plain(&self, p: CUdeviceptr) -> Result<(), CuError> {
        // SAFETY: p came from alloc_plain and is freed once.
        self.check(unsafe { (self.mem_free)(p) }, || {
            format!("cuMemFree({p:#x})")
        })
    }

    /// Loads a module from a NUL-terminated PTX text and returns its function `name`.
    pub fn load_function(&self, ptx: &CStr, name: &CStr) -> Result<CUfunction, CuError> {
        let mut m: CUmodule = std::ptr::null_mut();
        self.check(
            // SAFETY: ptx is NUL-terminated text that lives for the call; m is an out pointer.
            unsafe { (self.module_load_data)(&mut m, ptx.as_ptr().cast()) },
            || "cuModuleLoadData(the agent's PTX)".into(),
        )?;
        let mut f: CUfunction = std::ptr::null_mut();
        self.check(
            // SAFETY: m is the module just loaded; name is NUL-terminated; f is an out pointer.
            unsafe { (self.module_get_function)(&mut f, m, name.as_ptr()) },
            || format!("cuModuleGetFunction({name:?})"),
        )?;
        Ok(f)
    }

    /// Launches `f` on a 1-D grid with no shared memory.
    ///
    /// # Safety
    /// `params` must hold one pointer per kernel parameter, each to a value of that parameter's
    /// type, valid for the call; the kernel must touch only memory valid for it.
    pub unsafe fn launch_1d(
        &self,
        f: CUfunction,
        blocks: u32,
        threads: u32,
        s: CUstream,
        params: &mut [*mut c_void],
    ) -> Result<(), CuError> {
        // SAFETY: the caller guarantees the parameters; no extra options are passed.
        let rc = unsafe {
            (self.launch_kernel)(
                f,
                blocks,
                1,
                1,
                threads,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.check(rc, || {
            format!("cuLaunchKernel({blocks} blocks of {threads} threads)")
        })
    }
}

fn device_location(dev: CUdevice) -> CUmemLocation {
    CUmemLocation {
        type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev,
    }
}

/// Pinned device memory on `dev`, default flags; with a POSIX-fd shareable handle when
/// `exportable` (so that its physical memory can be handed to another process).
fn device_prop(dev: CUdevice, exportable: bool) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: if exportable {
            CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        },
        location: device_location(dev),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

#[cfg(test)]
mod prop_tests {
    use super::*;

    fn with_requested_handle_types(p: &PropBytes, types: u32) -> PropBytes {
        let mut out = *p;
        out[HANDLE_TYPES_AT..HANDLE_TYPES_AT + 4].copy_from_slice(&types.to_ne_bytes());
        out
    }

    #[test]
    fn prop_bytes_layout() {
        assert_eq!(std::mem::size_of::<PropBytes>(), 32);
        assert_eq!(HANDLE_TYPES_AT, 4);
        let p = prop_bytes(&device_prop(2, true));
        assert_eq!(requested_handle_types(&p), HANDLE_TYPE_POSIX_FD);
        assert_eq!(
            requested_handle_types(&with_requested_handle_types(&p, 0)),
            0
        );
    }

    #[test]
    fn prop_field_offsets() {
        assert_eq!(
            (TYPE_AT, LOCATION_TYPE_AT, LOCATION_ID_AT, FLAGS_AT, RDMA_AT),
            (0, 8, 12, 24, 25)
        );
    }

    /// Plain pinned memory on device 1 with `types` requested and `rdma` as the RDMA byte.
    fn asked(types: u32, rdma: u8) -> PropBytes {
        let mut p = device_prop(1, false);
        p.allocFlags.gpuDirectRDMACapable = rdma;
        with_requested_handle_types(&prop_bytes(&p), types)
    }

    const PLAIN: KeeperMemory = KeeperMemory {
        rdma_capable: false,
    };
    const RDMA: KeeperMemory = KeeperMemory { rdma_capable: true };

    #[test]
    fn plain_memory_gets_a_posix_fd_type_and_is_lent() {
        let plain = asked(0, 0);
        assert_eq!(app_lendability(true, &plain, 1), Ok(PLAIN));
        let made = lendable_prop(true, &plain, 1).expect("plain memory gets a POSIX fd type");
        assert_eq!(made, asked(HANDLE_TYPE_POSIX_FD, 0));
        assert_eq!(keeper_memory(&made, 1), Ok(PLAIN));
        assert_eq!(made, PLAIN.prop(1));
        // created as asked, but not what a keeper makes
        assert!(!is_keeper_prop(&plain, 1));
    }

    #[test]
    fn posix_fd_asked_is_lent_as_it_is() {
        let posix = asked(HANDLE_TYPE_POSIX_FD, 0);
        assert_eq!(app_lendability(true, &posix, 1), Ok(PLAIN));
        assert_eq!(lendable_prop(true, &posix, 1), None);
        assert!(is_keeper_prop(&posix, 1));
    }

    #[test]
    fn rdma_capable_memory_is_lent_and_made_again_with_the_flag() {
        let rdma = asked(0, 1);
        assert_eq!(app_lendability(true, &rdma, 1), Ok(RDMA));
        let made = lendable_prop(true, &rdma, 1).expect("RDMA memory gets a POSIX fd type");
        assert_eq!(made, asked(HANDLE_TYPE_POSIX_FD, 1));
        assert_eq!(keeper_memory(&made, 1), Ok(RDMA));
        assert_eq!(RDMA.prop(1), made);
    }

    #[test]
    fn rdma_capable_posix_fd_memory_is_lent_as_it_is() {
        // What PyTorch's expandable segments ask for on an H200.
        let torch = asked(HANDLE_TYPE_POSIX_FD, 1);
        assert_eq!(app_lendability(true, &torch, 1), Ok(RDMA));
        assert_eq!(lendable_prop(true, &torch, 1), None);
        assert_eq!(keeper_memory(&torch, 1), Ok(RDMA));
        assert_eq!(RDMA.prop(1), torch);
    }

    #[test]
    fn memory_a_keeper_cannot_make_is_not_lent() {
        let set = |at: usize, v: u8| {
            let mut p = asked(0, 1);
            p[at] = v;
            p
        };
        // compression (allocFlags' first byte), usage, reserved
        for (at, v) in [
            (FLAGS_AT, 1),
            (FLAGS_AT + 2, 1),
            (FLAGS_AT + 3, 0x80),
            (31, 1),
        ] {
            let p = set(at, v);
            assert_eq!(
                app_lendability(true, &p, 1),
                Err(NotKeeperMemory::OtherFlags),
                "byte {at}"
            );
            assert_eq!(lendable_prop(true, &p, 1), None);
            assert!(!is_keeper_prop(&with_posix_fd(&p), 1));
        }
        // Windows handle metadata (a pointer)
        assert_eq!(
            app_lendability(true, &set(16, 1), 1),
            Err(NotKeeperMemory::OtherFlags)
        );
        assert_eq!(
            app_lendability(true, &set(RDMA_AT, 2), 1),
            Err(NotKeeperMemory::RdmaValue(2))
        );
        // another device's location, a host location, not pinned
        assert_eq!(
            app_lendability(true, &asked(0, 0), 0),
            Err(NotKeeperMemory::OtherLocation {
                location_type: 1,
                id: 1
            })
        );
        assert_eq!(
            app_lendability(true, &set(LOCATION_TYPE_AT, 2), 1),
            Err(NotKeeperMemory::OtherLocation {
                location_type: 2,
                id: 1
            })
        );
        assert_eq!(
            app_lendability(true, &set(TYPE_AT, 0), 1),
            Err(NotKeeperMemory::NotPinned(0))
        );
        // other handle types, alone or beside POSIX fds
        for types in [2, 8, HANDLE_TYPE_POSIX_FD | 8] {
            let p = asked(types, 0);
            assert_eq!(
                app_lendability(true, &p, 1),
                Err(NotKeeperMemory::HandleTypes(types | HANDLE_TYPE_POSIX_FD))
            );
            assert_eq!(lendable_prop(true, &p, 1), None);
            assert!(!is_keeper_prop(&p, 1));
        }
        // no POSIX fds on the device
        assert_eq!(
            app_lendability(false, &asked(0, 0), 1),
            Err(NotKeeperMemory::NoPosixFdHandles)
        );
        assert_eq!(lendable_prop(false, &asked(0, 0), 1), None);
    }
}
