//! gpusnap-agent: the in-process half of gpusnap, loaded into a CUDA process with
//! `LD_PRELOAD=libgpusnap_agent.so`.
//!
//! It keeps the process's large device allocations as VMM mappings (address reservation +
//! physical handle) and, on the plugin's command over a unix socket, copies them out through a
//! shared staging ring, releases the physical memory while keeping the addresses (so the
//! driver's own checkpoint holds only control state), and later re-creates memory at the same
//! addresses and copies the data back. Processes that never use CUDA are not touched: nothing
//! is loaded or started at load time except with `GPUSNAP_AGENT_EAGER=1`.
//!
//! It is a Rust library too, for the keeper (`gpusnap-keeper`, the other side of the
//! hand-over), which links it and runs the same operations on memory of its own: the modules
//! the keeper uses are public (`cu`, `real`, `gpu`, `vmm`, `table`, `session`, `dump`,
//! `restore`, `lend`, `role`), with [`forget_released`], [`install_quiet_panic_hook`],
//! [`debugging`] and [`write_line`]. So either process has one driver table, this one; the
//! keeper's own logic (its request loop, adoption, snapshot, expectation) lives in its crate,
//! none of it in the library a job preloads.
//!
//! Modules, in layers: each imports only from the layers below it and, within its layer, from
//! modules listed before it, so there is no import cycle (`grep -n 'crate::' cuda-backend/agent/src/*.rs`
//! shows every import).
//! 1. Foundation, no CUDA: `log` (debug lines with `GPUSNAP_AGENT_DEBUG=1`, and the few errors
//!    always written; `debug!` reads the setting where it is expanded), `config` (environment
//!    settings; a bad one turns the agent off), `guard` (no panic into C), `role` (application
//!    or keeper, as the keeper's `main` says: what the driver loader and the tracer check ask),
//!    `hazards`, `plan` (pure planning), `fd_budget` (the program's descriptor budget, never
//!    eaten into), `identity` (this process's random key for its shares).
//! 2. The driver: `calls` (the one list of interposed calls), `real` (glibc's `dlsym` and the
//!    table of real libcuda functions, its hooked entries expanded from `calls`), `cu` (checked
//!    one-call wrappers over that table, with readable errors).
//! 3. Owners of driver objects: `vmm` (reservation, physical handle and mapping guards, and the
//!    reserve/create/map/access composites built from them; size and pitch arithmetic), `gpu`
//!    (the agent thread's retained contexts, streams and events).
//! 4. State and logic over them: `table` (tracked allocations, the Mapped/Released state
//!    machine), `convert` (the allocation and free paths behind the hooks), `staging` (the
//!    shared ring), `devhash` (chunk hashes computed on the GPU by the agent's own kernel),
//!    `session` (what the data operations share), `held` (whether a tracer holds the process:
//!    releases and loads happen only then), `own_fds` (descriptors the agent keeps across a
//!    hand-over).
//! 5. The operations, on a connection of the job's agent's requests or the keeper's (generic
//!    over [`gpusnap_proto::Request`]): `dump`, `lend` (the hand-over in the job: export,
//!    release with descriptors kept, reclaim), `restore`; and `take`, the job's alone.
//! 6. The top: `ipc` (legacy CUDA IPC served for converted allocations, and what a dump needs
//!    of those shares; see docs/ipc.md), `shareable` (the program's own shareable handles,
//!    `cuMemExportToShareableHandle`), `server` (the agent thread, its socket and the dispatch of
//!    its [`gpusnap_proto::AgentRequest`]s), `hooks` (the exported interposers: `dlsym`,
//!    `cuGetProcAddress*`, `cuMem*`), `fork` (`pthread_atfork` handlers).

mod calls;
mod config;
mod convert;
pub mod cu;
mod devhash;

pub mod dump;
mod fd_budget;
mod fork;
pub mod gpu;
mod guard;
mod hazards;
mod held;
mod hooks;
mod identity;
mod ipc;
pub mod lend;
mod log;
mod own_fds;
mod plan;
pub mod real;
pub mod restore;
pub mod role;
mod server;
pub mod session;
mod shareable;
mod staging;
pub mod table;
mod take;
pub mod vmm;

use std::sync::Once;

pub use log::write_line;
pub use own_fds::forget_released;

/// Whether debug lines are on (`GPUSNAP_AGENT_DEBUG=1`): the keeper writes its own with
/// [`write_line`] then, as the agent's `debug!` does.
pub fn debugging() -> bool {
    config::config().debug
}

/// Runs when the library is loaded (`.init_array`): reads the settings (so a bad one is reported
/// and turns the agent off at process start, see [`config::config`]), registers the fork
/// handlers and, with `GPUSNAP_AGENT_EAGER=1`, starts the agent thread. Never panics into the
/// loader.
extern "C" fn on_load() {
    guard::guard((), || {
        fork::register();
        if config::config().eager {
            server::ensure_started();
        }
    });
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

/// Replaces the default panic message on stderr (the agent must stay quiet inside someone
/// else's process) with a debug-log line. Installed when the agent first does CUDA work, not at
/// load: a program linking this crate as a Rust library keeps its own hook.
pub fn install_quiet_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::panic::set_hook(Box::new(|info| log::debug!("panic: {info}")));
    });
}
