//! CUDA backend of gpusnap: NVIDIA's side of a CRIU run, from the driver's checkpoint API to the
//! split path's orchestration. The plugin reaches it through [`backend::CudaBackend`] (a
//! [`gpusnap_host::Backend`]); the `gpusnap` command through [`recover`] and [`precopy`].
//!
//! The driver:
//! - [`driver`]: the NVIDIA driver checkpoint API (`cuCheckpointProcess*`, r570+) and the few device
//!   queries the plugin needs, loaded from `libcuda.so.1` at run time (no helper binary, no link-time
//!   dependency on the driver).
//! - [`nvml`]: free device memory per GPU through NVML, so a restore can be refused before the GPU
//!   is touched without creating a CUDA context inside CRIU.
//! - [`uuid`]: [`GpuUuid`], a GPU's UUID in the driver's, gpusnap's and NVML's forms.
//!
//! Nothing here panics when the driver is missing: every entry point returns a typed error.
//!
//! A CRIU run:
//! - `backend`: the hooks' answers for NVIDIA processes and device files;
//! - `context`: what a run knows (configuration, driver, GPUs, image directory);
//! - `dump` / `restore`: each side's run and per-process protocol; `recover` reuses the dump's
//!   undo outside CRIU; `precopy`: a pre-copy round of a running process;
//! - `process`: a dump's per-process state machine; `route`: each allocation's route;
//! - `devfile`: NVIDIA device files that hold no CUDA state; `gpumap` / `host_gpus`: which GPU
//!   of this host stands in for which GPU of the image;
//! - `stall`: a driver call that waits on a stopped thread of its process.
//!
//! The split path (the in-process agent moves the device data):
//! - `agent`: the conversation with the agent ([`agent::AgentSession`]) and with a keeper
//!   ([`agent::KeeperSession`]), each sending only the requests its server takes;
//! - `datapath` / `staging` / `load`: device data through the shared ring into image files and
//!   back; `parent`: a pre-copy chain's parent image, checked before it is referenced; `space`:
//!   the disk space a hand-over's drain will write, held from PAUSE on;
//! - `keeper` / `handover` / `preload`: the keeper process, the hand-over of the job's memory to
//!   it at a dump, and its load at a restore;
//! - `sharing`: CUDA IPC shares between processes of one dump or restore.
//!
//! Host services (CRIU's ABI and log, `/proc`, ptrace, holds, pids, fault points, the cgroup
//! freezer) come from `gpusnap-host`; each module names them by that crate
//! (`gpusnap_host::procfs` etc.).

pub mod agent;
pub mod backend;
pub mod context;
pub mod datapath;
pub mod devfile;
pub mod driver;
pub mod dump;
pub mod gpumap;
pub mod handover;
pub mod host_gpus;
pub mod keeper;
pub mod load;
pub mod nvml;
pub mod parent;
pub mod precopy;
pub mod preload;
pub mod process;
pub mod recover;
pub mod restore;
pub mod route;
pub mod sharing;
pub mod space;
pub mod staging;
pub mod stall;
pub mod uuid;

/// An empty split-path manifest of nspid 1, for tests to fill in what they look at.
#[cfg(test)]
pub(crate) fn test_manifest() -> gpusnap_image::Manifest {
    gpusnap_image::Manifest {
        format_version: 1,
        nspid: gpusnap_host::pid::NsPid(1),
        path: gpusnap_image::CheckpointPath::Split,
        created_unix_s: 0,
        gpusnap_version: String::new(),
        driver_version: 0,
        gpus: vec![],
        allocations: vec![],
        files: vec![],
        chunks: vec![],
        timings_s: Default::default(),
        requires: None,
    }
}

pub use driver::{CheckpointApi, DriverError, ProcessState};
pub use uuid::{GpuUuid, ParseGpuUuidError};
