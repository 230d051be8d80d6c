//! [`ForeignFd`]: a descriptor number of another process, as a type that is no descriptor here.

use std::fmt;

/// A descriptor number in another process's table: the job's (its program's or its agent's),
/// as its agent reports it or `/proc/<pid>/fd` lists it. It means something only in that
/// process: it names a descriptor there (to `kcmp`, `pidfd_getfd`, `/proc/<pid>/fd/<n>`), and
/// is never one of this process's own (those are `OwnedFd`/`RawFd`). Never negative: "none" is
/// `Option::None` (-1 on the wire).
///
/// Shown as the bare number (`Display` and `Debug`), as it was before it was a type.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ForeignFd(i32);

impl ForeignFd {
    /// Descriptor number `n` of another process; `None` for a negative number, which names no
    /// descriptor.
    pub const fn new(n: i32) -> Option<ForeignFd> {
        if n >= 0 { Some(ForeignFd(n)) } else { None }
    }

    /// The number, for the system call that names the descriptor in its process (and for the
    /// wire).
    pub const fn get(self) -> i32 {
        self.0
    }
}

impl fmt::Debug for ForeignFd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for ForeignFd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_foreign_fd_is_its_number_and_never_negative() {
        let fd = ForeignFd::new(7).unwrap();
        assert_eq!(fd.get(), 7);
        assert_eq!(format!("{fd} {:?}", Some(fd)), "7 Some(7)");
        assert_eq!(ForeignFd::new(0).map(ForeignFd::get), Some(0));
        assert_eq!(ForeignFd::new(-1), None);
        assert_eq!(ForeignFd::new(i32::MIN), None);
    }
}
