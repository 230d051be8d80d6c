//! The kinds of process and thread id the plugin handles, as types that cannot be mixed up.
//!
//! CRIU's hooks, `/proc`, `kill` and ptrace speak of a process by its [`HostPid`]: its pid in
//! CRIU's pid namespace, which changes from dump to restore. The image speaks of it by its
//! [`NsPid`]: its pid inside its own (the job's) pid namespace, which CRIU restores unchanged;
//! the manifest, the file names and the keeper know it by that, and so does the agent: the
//! shares it lists ([`crate::Share`]) name processes by their namespace pids. The one way from a
//! host pid to its namespace pid is `gpusnap_host::procfs::ns_pid`.
//!
//! Threads have the same two names: a [`HostTid`] (`/proc/<pid>/task/<tid>`, ptrace, `tgkill`,
//! `waitpid`) and an [`NsTid`] (what the agent reports of its own thread). The way between them
//! is `gpusnap_host::procfs::{ns_tid, host_tid}`. A process's pid is also its main thread's tid:
//! `HostTid::from(HostPid)`.
//!
//! Defined here, in the protocol crate that the agent and the host services both use;
//! `gpusnap_host::pid` re-exports them.

use std::fmt;

/// A pid in CRIU's pid namespace (the host's, or the container engine's).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostPid(pub i32);

/// A pid inside the process's own pid namespace: what the image records (`Manifest::nspid`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NsPid(pub u32);

/// A thread id in CRIU's pid namespace: `/proc/<pid>/task/<tid>`, ptrace, `tgkill`, `waitpid`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostTid(pub i32);

/// A thread id inside the process's own pid namespace (the agent's thread, as it reports it).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NsTid(pub i32);

impl HostPid {
    pub fn get(self) -> i32 {
        self.0
    }
}

impl HostTid {
    /// The number, for the system call (ptrace, `tgkill`, `waitpid`) or the `/proc` path.
    pub fn get(self) -> i32 {
        self.0
    }
}

impl NsTid {
    pub fn get(self) -> i32 {
        self.0
    }
}

/// A process's pid is the tid of its main thread (the thread-group leader).
impl From<HostPid> for HostTid {
    fn from(pid: HostPid) -> HostTid {
        HostTid(pid.0)
    }
}

impl NsPid {
    /// The number, for a file name, a record or the wire (where it is stored bare).
    pub fn get(self) -> u32 {
        self.0
    }
}

// Debug is the bare number too, so that `{:?}` of an `Option` reads as it did with integers.
macro_rules! shown_as_the_number {
    ($($t:ty),*) => {$(
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    )*};
}

shown_as_the_number!(HostPid, NsPid, HostTid, NsTid);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_show_as_their_number() {
        assert_eq!(
            format!("{} {:?}", HostPid(42), Some(NsPid(7))),
            "42 Some(7)"
        );
        assert_eq!(format!("{:?} {}", HostPid(-1), NsPid(1)), "-1 1");
        assert_eq!(format!("{} {:?}", HostTid(9), Some(NsTid(3))), "9 Some(3)");
        assert_eq!(HostTid::from(HostPid(42)), HostTid(42));
    }
}
