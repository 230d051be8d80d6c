//! CUDA backend of gpusnap.
//!
//! - [`driver`]: the NVIDIA driver checkpoint API (`cuCheckpointProcess*`, r570+) and the few device
//!   queries the plugin needs, loaded from `libcuda.so.1` at run time (no helper binary, no link-time
//!   dependency on the driver).
//! - [`nvml`]: free device memory per GPU through NVML, so a restore can be refused before the GPU
//!   is touched without creating a CUDA context inside CRIU.
//! - [`uuid`]: [`GpuUuid`], a GPU's UUID in the driver's, gpusnap's and NVML's forms.
//!
//! Nothing here panics when the driver is missing: every entry point returns a typed error.

pub mod driver;
pub mod nvml;
pub mod uuid;

pub use driver::{CheckpointApi, DriverError, ProcessState};
pub use uuid::{GpuUuid, ParseGpuUuidError};
