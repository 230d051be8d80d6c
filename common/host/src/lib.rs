//! gpusnap-host: what every vendor backend of gpusnap uses, below the backends and the plugin.
//!
//! Nothing here knows a GPU vendor. The backends (`gpusnap-cuda`, `gpusnap-rocm`) build their
//! orchestration on it, and the plugin dispatches CRIU's hooks to them through [`Backend`].
//!
//! Modules:
//! - `criu`: CRIU's plugin ABI and exports, resolved at run time;
//! - `logger`: `log` into CRIU's own log, with the `gpusnap:` prefix;
//! - `backend`: [`Backend`], one vendor's answers to CRIU's hooks;
//! - `procfs`: everything read from `/proc`; `pid`: host and namespace pids and tids as types
//!   (`gpusnap_proto`'s, re-exported);
//! - `ptrace`: running one seized thread while CRIU holds the others;
//! - `hold`: keeping a process from running on absent device memory should CRIU die;
//! - `reap`: killing a process that must not run, and reaping its traced threads;
//! - `signals`: every thread gpusnap starts blocks CRIU's signals;
//! - `fault`: the test fault points (CRIU killed at a named moment);
//! - `joblock`: one dump, `recover` or pre-copy at a time per job;
//! - `freezer`: whether a process's cgroup is frozen (a container engine's pause), and the
//!   refusal of a dump that CRIU starts on a frozen process before it thaws it;
//! - `codec`: how data chunks are stored (`compress`).

pub mod backend;
pub mod codec;
pub mod criu;
pub mod fault;
pub mod freezer;
pub mod hold;
pub mod joblock;
pub mod logger;
pub mod pid;
pub mod procfs;
pub mod ptrace;
pub mod reap;
pub mod signals;

pub use backend::{Answer, Backend};

/// A transition the current phase does not allow: a bug in the caller, never a state to act on.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{from} cannot become {to}")]
pub struct ImpossibleMove {
    pub from: &'static str,
    pub to: &'static str,
}
