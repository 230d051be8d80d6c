//! The agent thread's CUDA resources per device: the retained primary context, copy streams
//! (non-blocking) and one event per staging slot (timing disabled). Created on first need and
//! kept for the life of the thread: creating them again later would be fine, but a dump must
//! not create threads and these are cheap to hold.
//!
//! Each object has an owner ([`Owned`]) that gives it back to the driver when dropped (events
//! and streams destroyed, then the context's retain released), so whatever holds a
//! [`DeviceRes`] or a [`Gpu`] releases exactly what it made, on every path.

use std::ops::Index;

use cudarc::driver::sys::{CUcontext, CUdevice, CUevent, CUfunction, CUstream};

use crate::cu::CuError;
use crate::log::debug;
use crate::real::{CUDA_ERROR_UNKNOWN, CUDA_SUCCESS, CuRes, Driver};

/// One driver object of the agent's own, given back with `give_back` (the driver's destroy or
/// release call for it, taken from the table that made it) when dropped.
pub struct Owned<T: Copy> {
    raw: T,
    give_back: unsafe extern "C" fn(T) -> CuRes,
    what: &'static str,
}

impl<T: Copy> Owned<T> {
    /// Takes ownership of `raw`, just made by the driver; `give_back` must be the call that
    /// destroys or releases it (`what` names that call for the debug log).
    fn new(raw: T, give_back: unsafe extern "C" fn(T) -> CuRes, what: &'static str) -> Self {
        Owned {
            raw,
            give_back,
            what,
        }
    }
}

impl<T: Copy> Drop for Owned<T> {
    fn drop(&mut self) {
        // SAFETY: raw was made by the driver for this owner alone (see `new`), is not used after
        // this, and is given back once, with the call that matches how it was made.
        let rc = unsafe { (self.give_back)(self.raw) };
        if rc != CUDA_SUCCESS {
            debug!("{} failed: CUDA error {rc}", self.what);
        }
    }
}

/// Owned driver objects of one kind; indexing gives the raw handle, for the driver calls.
pub struct OwnedList<T: Copy>(Vec<Owned<T>>);

impl<T: Copy> OwnedList<T> {
    fn new() -> Self {
        OwnedList(Vec::new())
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// The raw handles, in creation order.
    pub fn iter(&self) -> impl Iterator<Item = T> + '_ {
        self.0.iter().map(|o| o.raw)
    }
}

impl<T: Copy> Index<usize> for OwnedList<T> {
    type Output = T;

    fn index(&self, i: usize) -> &T {
        &self.0[i].raw
    }
}

/// One device's resources. Fields drop in order: the events and streams are destroyed before
/// the context's retain is released.
pub struct DeviceRes {
    pub ordinal: i32,
    ctx: CUcontext,
    pub streams: OwnedList<CUstream>,
    pub events: OwnedList<CUevent>,
    /// The device-hash kernel once loaded, or why it cannot be (tried once per device).
    hasher: Option<Result<CUfunction, CuError>>,
    /// The retain of `ctx` (by device), released last.
    _retained: Owned<CUdevice>,
}

/// All devices the agent thread has worked with.
#[derive(Default)]
pub struct Gpu {
    devs: Vec<DeviceRes>,
    current: Option<i32>,
}

impl Gpu {
    pub fn new() -> Self {
        Gpu::default()
    }

    /// Retains `ordinal`'s primary context (once), makes it current, and makes sure it has at
    /// least `streams` streams and `events` events.
    pub fn prepare(
        &mut self,
        drv: &Driver,
        ordinal: i32,
        streams: usize,
        events: usize,
    ) -> Result<(), CuError> {
        if !self.devs.iter().any(|d| d.ordinal == ordinal) {
            drv.cu_init()?;
            let dev = drv.device(ordinal)?;
            let ctx = drv.retain_primary_context(dev)?;
            self.devs.push(DeviceRes {
                ordinal,
                ctx,
                streams: OwnedList::new(),
                events: OwnedList::new(),
                hasher: None,
                _retained: Owned::new(dev, drv.primary_ctx_release, "cuDevicePrimaryCtxRelease_v2"),
            });
        }
        self.activate(drv, ordinal)?;
        let i = self.index(ordinal)?;
        let d = &mut self.devs[i];
        while d.streams.len() < streams {
            let s = drv.create_stream()?;
            d.streams
                .0
                .push(Owned::new(s, drv.stream_destroy, "cuStreamDestroy_v2"));
        }
        while d.events.len() < events {
            let e = drv.create_event()?;
            d.events
                .0
                .push(Owned::new(e, drv.event_destroy, "cuEventDestroy_v2"));
        }
        Ok(())
    }

    fn index(&self, ordinal: i32) -> Result<usize, CuError> {
        self.devs
            .iter()
            .position(|d| d.ordinal == ordinal)
            .ok_or_else(|| CuError {
                call: format!("using device {ordinal}"),
                code: CUDA_ERROR_UNKNOWN,
                name: "device not prepared by the agent".into(),
            })
    }

    /// Makes `ordinal`'s context current on this thread; returns its resources.
    pub fn activate(&mut self, drv: &Driver, ordinal: i32) -> Result<&DeviceRes, CuError> {
        let i = self.index(ordinal)?;
        if self.current != Some(ordinal) {
            drv.set_current(self.devs[i].ctx)?;
            self.current = Some(ordinal);
        }
        Ok(&self.devs[i])
    }

    /// The device-hash kernel on `ordinal` (prepared), loaded with `load` on first use; the
    /// reason it cannot be, remembered, otherwise.
    pub fn hasher(
        &mut self,
        drv: &Driver,
        ordinal: i32,
        load: impl FnOnce(&Driver) -> Result<CUfunction, CuError>,
    ) -> Result<CUfunction, CuError> {
        self.activate(drv, ordinal)?;
        let i = self.index(ordinal)?;
        let d = &mut self.devs[i];
        if d.hasher.is_none() {
            let loaded = load(drv);
            if let Err(e) = &loaded {
                crate::log::debug!("device {ordinal}: no device hashes: {e}");
            }
            d.hasher = Some(loaded);
        }
        d.hasher.clone().expect("set above")
    }

    /// Waits for all work the agent issued on any device; the first error is returned.
    pub fn sync_all(&mut self, drv: &Driver) -> Result<(), CuError> {
        let ordinals: Vec<i32> = self.devs.iter().map(|d| d.ordinal).collect();
        for o in ordinals {
            let d = self.activate(drv, o)?;
            for s in d.streams.iter() {
                drv.sync_stream(s)?;
            }
        }
        Ok(())
    }

    /// Waits for every copy the agent issued on any device (errors ignored: this runs on the
    /// way out of a failed operation, before the staging is unmapped).
    pub fn quiesce(&mut self, drv: &Driver) {
        let ordinals: Vec<i32> = self.devs.iter().map(|d| d.ordinal).collect();
        for o in ordinals {
            if let Ok(d) = self.activate(drv, o) {
                for s in d.streams.iter() {
                    let _ = drv.sync_stream(s);
                }
            }
        }
    }
}
