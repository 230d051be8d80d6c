//! The two kinds of process id the plugin handles, as types that cannot be mixed up.
//!
//! CRIU's hooks, `/proc`, `kill` and ptrace speak of a process by its [`HostPid`]: its pid in
//! CRIU's pid namespace, which changes from dump to restore. The image speaks of it by its
//! [`NsPid`]: its pid inside its own (the job's) pid namespace, which CRIU restores unchanged;
//! the manifest, the file names and the keeper know it by that, and so does the agent: the
//! shares it lists ([`crate::Share`]) name processes by their namespace pids. The one way from a
//! host pid to its namespace pid is `gpusnap_host::procfs::ns_pid`.
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

impl HostPid {
    pub fn get(self) -> i32 {
        self.0
    }
}

impl NsPid {
    /// The number, as the image crate's functions and records take it.
    pub fn get(self) -> u32 {
        self.0
    }
}

// Debug is the bare number too, so that `{:?}` of an `Option` reads as it did with integers.
impl fmt::Debug for HostPid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Debug for NsPid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for HostPid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for NsPid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

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
    }
}
