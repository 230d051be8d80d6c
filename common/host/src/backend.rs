//! [`Backend`]: one GPU vendor's side of a CRIU run, shaped by CRIU's hooks.
//!
//! The plugin holds one backend per vendor for the run (created at CRIU's `init`) and asks
//! them in turn for each hook: the first that answers other than [`Answer::NotMine`] has it.
//! Each vendor works where its state lives: the AMD backend in `DUMP_EXT_FILE`,
//! `RESTORE_EXT_FILE`, `HANDLE_DEVICE_VMA` and `UPDATE_VMA_MAP` (the KFD is a file CRIU hands
//! to plugins), the NVIDIA backend in the pause, checkpoint and resume hooks (the driver holds
//! a process's state) and for its device files. A third vendor is one more crate implementing
//! this trait; no backend knows another, and none knows the plugin.

use std::os::fd::{BorrowedFd, OwnedFd};

use crate::criu::Reopened;
use crate::pid::HostPid;

/// A backend's answer to a hook about one object (a process, a file, a mapping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Not this backend's: the next one is asked (and then CRIU's other plugins).
    NotMine,
    /// This backend's, and handled.
    Done,
    /// This backend's, and it failed: CRIU fails the operation.
    Failed,
}

impl Answer {
    /// From a run's `Some(ok)` for a process of its own, `None` for another's.
    pub fn of(outcome: Option<bool>) -> Answer {
        match outcome {
            Some(true) => Answer::Done,
            Some(false) => Answer::Failed,
            None => Answer::NotMine,
        }
    }

    /// From a hook body's return code: `-ENOTSUP` is "not mine", 0 done, anything else failed.
    pub fn of_rc(rc: i32) -> Answer {
        match rc {
            0 => Answer::Done,
            rc if rc == -libc::ENOTSUP => Answer::NotMine,
            _ => Answer::Failed,
        }
    }

    /// The hook's return value for CRIU.
    pub fn rc(self) -> i32 {
        match self {
            Answer::NotMine => -libc::ENOTSUP,
            Answer::Done => 0,
            Answer::Failed => -1,
        }
    }
}

/// One vendor's side of a CRIU run. Every hook defaults to "not mine".
pub trait Backend: Send {
    /// The vendor, for the log.
    fn name(&self) -> &'static str;

    /// `DUMP_EXT_FILE`: a file CRIU cannot dump itself (a device file).
    fn dump_ext_file(&mut self, _fd: BorrowedFd<'_>, _id: u32) -> Answer {
        Answer::NotMine
    }

    /// `RESTORE_EXT_FILE`, in a restored task whose image directory is `dir`: the file again.
    fn restore_ext_file(&mut self, _dir: BorrowedFd<'_>, _id: u32) -> Option<Reopened> {
        None
    }

    /// `HANDLE_DEVICE_VMA`: a mapping of a device file at dump.
    fn handle_device_vma(&mut self, _fd: BorrowedFd<'_>, _mode: u32, _rdev: u64) -> Answer {
        Answer::NotMine
    }

    /// `UPDATE_VMA_MAP`, in a restored task: the new offset and file of a device mapping.
    fn update_vma_map(&mut self, _path: &str, _addr: u64, _old: u64) -> Option<(u64, OwnedFd)> {
        None
    }

    /// `PAUSE_DEVICES`: the process still runs; the backend takes its GPU state in hand.
    fn pause_devices(&mut self, _pid: HostPid) -> Answer {
        Answer::NotMine
    }

    /// `CHECKPOINT_DEVICES`: the process is seized; its GPU state goes into the image.
    fn checkpoint_devices(&mut self, _pid: HostPid) -> Answer {
        Answer::NotMine
    }

    /// `RESUME_DEVICES_LATE`: a restored process's GPU state back before it runs.
    fn resume_devices_late(&mut self, _pid: HostPid) -> Answer {
        Answer::NotMine
    }

    /// `POST_FORKING` (CRIU 4.2+): every task of a restore is forked.
    fn post_forking(&mut self) {}

    /// CRIU's `exit` hook with its result (`ret` 0: CRIU's part succeeded).
    fn exit(&mut self, _ret: i32) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_map_to_criu_return_codes_and_back() {
        for a in [Answer::NotMine, Answer::Done, Answer::Failed] {
            assert_eq!(Answer::of_rc(a.rc()), a);
        }
        assert_eq!(Answer::of(None), Answer::NotMine);
        assert_eq!(Answer::of(Some(true)).rc(), 0);
        assert_eq!(Answer::of(Some(false)).rc(), -1);
    }
}
