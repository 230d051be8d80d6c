//! End-to-end tests of gpusnap with a real CRIU.
//!
//! The tests (in `tests/`) run `scripts/criu dump` and `restore` (the private CRIU 4.1.1 root
//! built by `scripts/install-criu.sh`) on small workloads (`src/bin/`) with the freshly built
//! `libgpusnap_plugin.so` in the plugin directory, and check what users would check: CRIU succeeds,
//! the restored processes carry on with their memory intact, and gpusnap's log lines and
//! image files are as documented.
//!
//! They need root. Without it (or if CRIU cannot be installed) they fail with an explanation;
//! `GPUSNAP_SKIP_CRIU_TESTS=1` skips them explicitly.
//!
//! This library is the harness: [`harness::harness`] sets up once per test binary,
//! [`harness::WorkDir`] is one test's plugin and image directories, [`harness::Workload`]
//! the processes under test. [`workload`] is shared with the workload binaries.
//! [`inventory`] reads and edits the plugin list of CRIU's `inventory.img`. [`fake_driver`]
//! runs criu with the stand-in NVIDIA driver `libfakecuda.so` and reads its logs. [`build`]
//! builds the workspace's other artifacts (cdylibs, other packages' binaries) from a test;
//! [`fixtures`] are the small fixtures every test crate shares ([`fixtures::TempDir`],
//! [`fixtures::Tmpfs`]).

pub mod build;
pub mod counter_log;
pub mod criu;
pub mod fake_driver;
pub mod fixtures;
pub mod harness;
pub mod inventory;
pub mod packages;
pub mod podman;
pub mod procs;

/// The workloads' behaviour and log format: a crate of its own (`test-workload/`), so that
/// the stand-ins' workload binaries (fake-kfd's `amd-app`) need not depend on this harness.
pub use test_workload as workload;

pub use counter_log::CounterLog;
pub use criu::CriuRun;
pub use harness::{Harness, WorkDir, Workload, harness};
