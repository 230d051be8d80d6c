//! The agent thread's CUDA resources per device: the retained primary context, copy streams
//! (non-blocking) and one event per staging slot (timing disabled). Created on first need and
//! kept for the life of the thread: creating them again later would be fine, but a dump must
//! not create threads and these are cheap to hold.

use cudarc::driver::sys::{CUcontext, CUevent, CUfunction, CUstream};

use crate::cu::CuError;
use crate::real::{CUDA_ERROR_UNKNOWN, Driver};

/// One device's resources.
pub struct DeviceRes {
    pub ordinal: i32,
    ctx: CUcontext,
    pub streams: Vec<CUstream>,
    pub events: Vec<CUevent>,
    /// The device-hash kernel once loaded, or why it cannot be (tried once per device).
    hasher: Option<Result<CUfunction, String>>,
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
                streams: Vec::new(),
                events: Vec::new(),
                hasher: None,
            });
        }
        self.activate(drv, ordinal)?;
        let i = self.index(ordinal)?;
        let d = &mut self.devs[i];
        while d.streams.len() < streams {
            d.streams.push(drv.create_stream()?);
        }
        while d.events.len() < events {
            d.events.push(drv.create_event()?);
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
    ) -> Result<CUfunction, String> {
        self.activate(drv, ordinal).map_err(|e| e.to_string())?;
        let i = self.index(ordinal).map_err(|e| e.to_string())?;
        let d = &mut self.devs[i];
        if d.hasher.is_none() {
            let loaded = load(drv).map_err(|e| e.to_string());
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
            for &s in &d.streams {
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
                for &s in &d.streams {
                    let _ = drv.sync_stream(s);
                }
            }
        }
    }
}
