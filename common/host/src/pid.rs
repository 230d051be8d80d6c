//! The two kinds of process id the plugin handles, as types that cannot be mixed up:
//! [`HostPid`] (CRIU's pid namespace: `/proc`, `kill`, ptrace) and [`NsPid`] (the process's own
//! namespace: the image, the keeper, the agent's shares). The one way from a host pid to its
//! namespace pid is [`crate::procfs::ns_pid`]. Threads likewise: [`HostTid`] (ptrace, `tgkill`,
//! `/proc/<pid>/task`) and [`NsTid`] (the agent's own word for its thread), between which
//! [`crate::procfs::ns_tid`] and [`crate::procfs::host_tid`] go.
//!
//! Defined in `gpusnap_proto::pid`, so that the protocol's messages (and the agent, which may
//! import only the protocol crate) can carry them; re-exported here for the host services and
//! the backends.

pub use gpusnap_proto::pid::{HostPid, HostTid, NsPid, NsTid};
