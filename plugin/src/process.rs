//! What gpusnap knows and has done to one GPU process: a small state machine, so a rollback
//! knows exactly what to undo.

use crate::datapath::DumpData;
use gpusnap_cuda::ProcessState;
use gpusnap_image::AllocationRecord;

/// What we did to the driver-side state of the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverStage {
    /// Untouched, or back to running.
    Running,
    /// `cuCheckpointProcessLock` done (by us).
    Locked,
    /// `cuCheckpointProcessCheckpoint` done (by us).
    Checkpointed,
}

/// Where the device data goes.
#[derive(Debug)]
pub enum DataPath {
    /// The driver checkpoint copies device memory into the process; CRIU dumps it as pages.
    Transparent,
    /// The agent moves converted allocations into gpusnap's files; the driver keeps control
    /// state and whatever the agent did not take.
    Split(SplitState),
}

#[derive(Debug, Default)]
pub struct SplitState {
    /// The agent's control thread, as the process itself numbers it.
    pub agent_ns_tid: i32,
    /// What the agent said while the process still ran (for the log).
    pub allocations_at_pause: u32,
    pub converted_bytes_at_pause: u64,
    pub allocations: Vec<AllocationRecord>,
    /// Filled once the data is in image files.
    pub data: Option<DumpData>,
    /// The agent has released physical memory: the data lives only in the image files now.
    pub released: bool,
}

#[derive(Debug)]
pub struct Tracked {
    /// Host pid (what hooks get).
    pub pid: i32,
    /// Pid inside the process's own pid namespace (what image names use).
    pub nspid: i32,
    pub restore_tid: i32,
    /// Driver state found at PAUSE; a rollback returns the process to it.
    pub initial: ProcessState,
    pub driver: DriverStage,
    pub path: DataPath,
    /// The gpusnap agent answered at PAUSE (it records what the driver cannot checkpoint).
    pub agent: bool,
    /// Phase name and seconds, in order.
    pub timings: Vec<(&'static str, f64)>,
}

impl Tracked {
    pub fn is_split(&self) -> bool {
        matches!(self.path, DataPath::Split(_))
    }

    pub fn released(&self) -> bool {
        matches!(&self.path, DataPath::Split(s) if s.released)
    }

    pub fn time(&mut self, phase: &'static str, seconds: f64) {
        self.timings.push((phase, seconds));
    }

    pub fn timings_line(&self) -> String {
        self.timings
            .iter()
            .map(|(k, v)| format!("{k} {v:.3} s"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}
