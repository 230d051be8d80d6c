//! Everything gpusnap reads from `/proc`: typed parsers over the text (pure, unit-tested) and
//! the readers that feed them (`io::Result`, with `InvalidData` for text that does not parse).
//!
//! Hooks get host pids; image names and the agent's socket use the pid a process has in its
//! own pid namespace, so most of this is translating between the two.

use crate::pid::{HostPid, HostTid, NsPid, NsTid};
use gpusnap_proto::ForeignFd;
use std::collections::BTreeSet;
use std::io;
use std::os::unix::fs::MetadataExt;

fn invalid(what: &str, path: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{path}: no {what} in it"),
    )
}

fn read(path: &str) -> io::Result<String> {
    std::fs::read_to_string(path).map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))
}

// ---- parsers of /proc text ----

/// The last id of the `NSpid:` line of a `status` text: the id as the process's own pid
/// namespace numbers it.
fn parse_ns_id(status: &str) -> Option<i32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// The value of a `Key:\tvalue` line of a `status` text, parsed.
fn status_field<T: std::str::FromStr>(status: &str, key: &str) -> Option<T> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `SigPnd:` of a `status` text: the signals queued to that thread alone (bit n-1 for signal n).
pub fn parse_sig_pending(status: &str) -> Option<u64> {
    let hex: String = status_field(status, "SigPnd")?;
    u64::from_str_radix(&hex, 16).ok()
}

/// `VmRSS:` of a `status` text, in KiB.
pub fn parse_vm_rss_kib(status: &str) -> Option<u64> {
    status_field(status, "VmRSS")
}

/// A task's state: the letter of field 3 of `stat` (`fs/proc/array.c` in the kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcState {
    /// `R`: running or runnable.
    Running,
    /// `S`: in an interruptible sleep.
    Sleeping,
    /// `D`: in an uninterruptible sleep ("disk sleep").
    DiskSleep,
    /// `T`: stopped by a signal (a group stop).
    Stopped,
    /// `t`: in a ptrace stop.
    TracingStop,
    /// `Z`: exited, not yet reaped by its parent.
    Zombie,
    /// `X` (`x` before Linux 4.14): dead.
    Dead,
    /// `P`: a parked kernel thread.
    Parked,
    /// `I`: an idle kernel thread.
    Idle,
    /// A letter not listed above (`W`, `K` of older kernels).
    Other(char),
}

impl ProcState {
    /// The state of a `stat` field: one letter, or None.
    pub fn parse(field: &str) -> Option<Self> {
        let mut chars = field.chars();
        let (Some(c), None) = (chars.next(), chars.next()) else {
            return None;
        };
        Some(match c {
            'R' => Self::Running,
            'S' => Self::Sleeping,
            'D' => Self::DiskSleep,
            'T' => Self::Stopped,
            't' => Self::TracingStop,
            'Z' => Self::Zombie,
            'X' | 'x' => Self::Dead,
            'P' => Self::Parked,
            'I' => Self::Idle,
            c => Self::Other(c),
        })
    }

    /// The kernel's letter for it (`X` for dead).
    pub fn letter(self) -> char {
        match self {
            Self::Running => 'R',
            Self::Sleeping => 'S',
            Self::DiskSleep => 'D',
            Self::Stopped => 'T',
            Self::TracingStop => 't',
            Self::Zombie => 'Z',
            Self::Dead => 'X',
            Self::Parked => 'P',
            Self::Idle => 'I',
            Self::Other(c) => c,
        }
    }

    /// Whether the task has exited (a zombie its parent has not reaped, or dead).
    pub fn exited(self) -> bool {
        matches!(self, Self::Zombie | Self::Dead)
    }
}

impl std::fmt::Display for ProcState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.letter())
    }
}

/// A `stat` line, split where its fields can be trusted: the command name (field 2) may hold
/// spaces and parentheses, so the fields after it are counted from its last `)`.
#[derive(Debug, PartialEq, Eq)]
pub struct Stat<'a> {
    /// The command name, cut by the kernel to 15 characters.
    pub comm: &'a str,
    /// Fields 3 onwards (the state letter first).
    rest: Vec<&'a str>,
}

impl<'a> Stat<'a> {
    pub fn parse(text: &'a str) -> Option<Self> {
        let open = text.find('(')?;
        let close = text.rfind(')')?;
        Some(Self {
            comm: text.get(open + 1..close)?,
            rest: text.get(close + 1..)?.split_whitespace().collect(),
        })
    }

    /// The state (field 3).
    pub fn state(&self) -> Option<ProcState> {
        ProcState::parse(self.rest.first()?)
    }

    /// utime + stime (fields 14 and 15), in clock ticks.
    pub fn cpu_ticks(&self) -> Option<u64> {
        let field = |n: usize| self.rest.get(n - 3)?.parse::<u64>().ok();
        Some(field(14)? + field(15)?)
    }

    /// The parent's pid (field 4), in the reader's pid namespace.
    pub fn parent(&self) -> Option<HostPid> {
        self.rest.get(4 - 3)?.parse().ok().map(HostPid)
    }

    /// When the task started (field 22), in clock ticks since boot: with the pid, it names one
    /// process for good (a pid can be reused, a pid and start time cannot).
    pub fn start_time(&self) -> Option<u64> {
        self.rest.get(22 - 3)?.parse().ok()
    }

    /// Whether the task has exited (a zombie its parent has not reaped, or dead).
    pub fn exited(&self) -> bool {
        self.state().is_some_and(ProcState::exited)
    }
}

/// What `task/<tid>/syscall` says of a thread blocked in a system call: its number, first
/// argument and user-space program counter.
#[derive(Debug, PartialEq, Eq)]
pub struct BlockedSyscall {
    pub nr: u64,
    pub arg0: u64,
    pub pc: u64,
}

/// `nr a0 a1 a2 a3 a4 a5 sp pc` (hex arguments); `running` or `-1 sp pc` give None.
pub fn parse_syscall(text: &str) -> Option<BlockedSyscall> {
    let f: Vec<&str> = text.split_whitespace().collect();
    if f.len() != 9 {
        return None;
    }
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    Some(BlockedSyscall {
        nr: f[0].parse().ok()?,
        arg0: hex(f[1])?,
        pc: hex(f[8])?,
    })
}

/// The mapping (file name, or `[anon]`) of a `maps` text that holds `addr`.
pub fn mapping_of(maps: &str, addr: u64) -> Option<String> {
    maps.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (lo, hi) = f.next()?.split_once('-')?;
        let (lo, hi) = (
            u64::from_str_radix(lo, 16).ok()?,
            u64::from_str_radix(hi, 16).ok()?,
        );
        if !(lo..hi).contains(&addr) {
            return None;
        }
        let name = f.nth(4).unwrap_or("[anon]");
        Some(name.rsplit('/').next().unwrap_or(name).to_owned())
    })
}

/// The major of the character devices named `name` in a `/proc/devices` text (the block
/// devices after them are not looked at).
pub fn parse_char_major(devices: &str, name: &str) -> Option<u32> {
    devices
        .lines()
        .skip_while(|l| !l.starts_with("Character devices:"))
        .take_while(|l| !l.starts_with("Block devices:"))
        .find_map(|l| {
            let mut w = l.split_whitespace();
            let major = w.next()?.parse().ok()?;
            (w.next()? == name).then_some(major)
        })
}

/// The program name of a `cmdline` (its first argument, without directories).
pub fn parse_argv0(cmdline: &[u8]) -> String {
    let argv0 = cmdline.split(|&b| b == 0).next().unwrap_or_default();
    String::from_utf8_lossy(argv0.rsplit(|&b| b == b'/').next().unwrap_or_default()).into_owned()
}

// ---- readers ----

/// The pid of host process `pid` inside its own pid namespace.
pub fn ns_pid(pid: HostPid) -> io::Result<NsPid> {
    let path = format!("/proc/{pid}/status");
    parse_ns_id(&read(&path)?)
        .and_then(|n| u32::try_from(n).ok())
        .map(NsPid)
        .ok_or_else(|| invalid("NSpid line", &path))
}

/// The tid of host thread `tid` of `pid` inside the process's pid namespace.
pub fn ns_tid(pid: HostPid, tid: HostTid) -> io::Result<NsTid> {
    let path = format!("/proc/{pid}/task/{tid}/status");
    parse_ns_id(&read(&path)?)
        .map(NsTid)
        .ok_or_else(|| invalid("NSpid line", &path))
}

/// The signals queued to thread `tid` of `pid` alone (not to the whole process).
pub fn pending_signals(pid: HostPid, tid: HostTid) -> io::Result<u64> {
    let path = format!("/proc/{pid}/task/{tid}/status");
    parse_sig_pending(&read(&path)?).ok_or_else(|| invalid("SigPnd line", &path))
}

/// The state and start time of `pid`.
pub fn state_and_start(pid: HostPid) -> io::Result<(ProcState, u64)> {
    let text = stat_text(pid, None)?;
    let path = format!("/proc/{pid}/stat");
    let st = Stat::parse(&text).ok_or_else(|| invalid("command name", &path))?;
    Ok((
        st.state().ok_or_else(|| invalid("state", &path))?,
        st.start_time()
            .ok_or_else(|| invalid("start time", &path))?,
    ))
}

/// The parent of `pid` (in our pid namespace).
pub fn parent_of(pid: HostPid) -> io::Result<HostPid> {
    let path = format!("/proc/{pid}/stat");
    let text = read(&path)?;
    Stat::parse(&text)
        .and_then(|st| st.parent())
        .ok_or_else(|| invalid("parent pid", &path))
}

/// The resident memory of `pid`, in KiB.
pub fn vm_rss_kib(pid: HostPid) -> io::Result<u64> {
    let path = format!("/proc/{pid}/status");
    parse_vm_rss_kib(&read(&path)?).ok_or_else(|| invalid("VmRSS line", &path))
}

/// The `stat` text of a process, or of one of its threads.
pub fn stat_text(pid: HostPid, tid: Option<HostTid>) -> io::Result<String> {
    match tid {
        Some(tid) => read(&format!("/proc/{pid}/task/{tid}/stat")),
        None => read(&format!("/proc/{pid}/stat")),
    }
}

/// A file of one thread (`comm`, `wchan`, `syscall`, ...), trimmed.
pub fn task_file(pid: HostPid, tid: HostTid, name: &str) -> io::Result<String> {
    read(&format!("/proc/{pid}/task/{tid}/{name}")).map(|s| s.trim().to_owned())
}

/// The `maps` text of `pid`.
pub fn maps(pid: HostPid) -> io::Result<String> {
    read(&format!("/proc/{pid}/maps"))
}

/// `pid`'s open descriptors and its soft `RLIMIT_NOFILE` ("Max open files" in
/// `/proc/<pid>/limits`); `None` for the limit when it is unlimited.
pub fn descriptors(pid: HostPid) -> io::Result<(u64, Option<u64>)> {
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
    let limits = read(&format!("/proc/{pid}/limits"))?;
    Ok((open, parse_nofile_soft(&limits)))
}

/// The soft limit of the "Max open files" line of a `/proc/<pid>/limits` text.
fn parse_nofile_soft(limits: &str) -> Option<u64> {
    let rest = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?;
    rest.split_whitespace().next()?.parse().ok()
}

/// The program name `pid` runs (from its command line; the stat name is cut at 15 characters).
pub fn argv0(pid: HostPid) -> io::Result<String> {
    std::fs::read(format!("/proc/{pid}/cmdline")).map(|c| parse_argv0(&c))
}

/// The major of the character devices named `name` on this host (allocated at driver load).
pub fn char_major(name: &str) -> io::Result<Option<u32>> {
    Ok(parse_char_major(&read("/proc/devices")?, name))
}

/// The descriptor numbers `pid` holds now.
pub fn fd_numbers(pid: HostPid) -> io::Result<Vec<ForeignFd>> {
    Ok(numbered_entries(&format!("/proc/{pid}/fd"))?
        .into_iter()
        .filter_map(ForeignFd::new)
        .collect())
}

/// What descriptor `fd` of `pid` names (its `/proc/<pid>/fd` link).
pub fn fd_target(pid: HostPid, fd: ForeignFd) -> io::Result<std::path::PathBuf> {
    let path = format!("/proc/{pid}/fd/{fd}");
    std::fs::read_link(&path).map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))
}

/// The status of the file descriptor `fd` of `pid` names (for a device node: its `rdev`).
pub fn fd_metadata(pid: HostPid, fd: ForeignFd) -> io::Result<std::fs::Metadata> {
    let path = format!("/proc/{pid}/fd/{fd}");
    std::fs::metadata(&path).map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))
}

/// The status of the file mapped at `start..end` in `pid` (`map_files`: the mapped file itself,
/// even where its path is gone).
pub fn mapped_file_metadata(pid: HostPid, start: u64, end: u64) -> io::Result<std::fs::Metadata> {
    let path = format!("/proc/{pid}/map_files/{start:x}-{end:x}");
    std::fs::metadata(&path).map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))
}

/// The pid `/proc/locks` names as holding a `flock` on the file of device `dev` and inode
/// `ino`, if one does.
pub fn flock_holder(dev: u64, ino: u64) -> io::Result<Option<HostPid>> {
    Ok(parse_flock_holder(&read("/proc/locks")?, dev, ino))
}

/// `N: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF` lines (major and minor in hex).
pub fn parse_flock_holder(locks: &str, dev: u64, ino: u64) -> Option<HostPid> {
    let want = format!("{:02x}:{:02x}:{ino}", libc::major(dev), libc::minor(dev));
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // A blocked waiter's line starts `N: ->`.
        let f = f.get(1..)?;
        (f.first() == Some(&"FLOCK") && f.get(4).is_some_and(|id| id.eq_ignore_ascii_case(&want)))
            .then(|| f.get(3)?.parse().ok().map(HostPid))
            .flatten()
    })
}

/// The owner uid of `pid`.
pub fn uid_of(pid: HostPid) -> io::Result<u32> {
    Ok(std::fs::metadata(format!("/proc/{pid}"))?.uid())
}

/// Every process (thread-group leader) `/proc` lists now.
pub fn processes() -> io::Result<Vec<HostPid>> {
    Ok(numbered_entries("/proc")?
        .into_iter()
        .map(HostPid)
        .collect())
}

/// The thread ids of `pid`, as `/proc/<pid>/task` lists them now.
pub fn thread_ids(pid: HostPid) -> io::Result<Vec<HostTid>> {
    Ok(numbered_entries(&format!("/proc/{pid}/task"))?
        .into_iter()
        .map(HostTid)
        .collect())
}

fn numbered_entries(dir: &str) -> io::Result<Vec<i32>> {
    Ok(std::fs::read_dir(dir)
        .map_err(|e| io::Error::new(e.kind(), format!("{dir}: {e}")))?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect())
}

/// The host tid of the thread of `pid` whose tid in the process's own namespace is `ns_tid`.
pub fn host_tid(pid: HostPid, ns_tid: NsTid) -> io::Result<Option<HostTid>> {
    Ok(thread_ids(pid)?
        .into_iter()
        .find(|&tid| self::ns_tid(pid, tid).ok() == Some(ns_tid)))
}

/// The host tid of the thread of `pid` that named itself `comm`.
pub fn thread_named(pid: HostPid, comm: &str) -> io::Result<Option<HostTid>> {
    Ok(thread_ids(pid)?
        .into_iter()
        .find(|&tid| task_file(pid, tid, "comm").is_ok_and(|c| c == comm)))
}

/// The child processes started by thread `tid` of `pid`.
pub fn children(pid: HostPid, tid: HostTid) -> io::Result<BTreeSet<HostPid>> {
    Ok(read(&format!("/proc/{pid}/task/{tid}/children"))?
        .split_whitespace()
        .filter_map(|s| s.parse().ok().map(HostPid))
        .collect())
}

/// A namespace of a process, as (device, inode): equal for processes in the same namespace.
pub fn namespace(pid: HostPid, kind: &str) -> io::Result<(u64, u64)> {
    let path = format!("/proc/{pid}/ns/{kind}");
    let m =
        std::fs::metadata(&path).map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))?;
    Ok((m.dev(), m.ino()))
}

/// Reads 4 bytes of `pid`'s memory (a tracer may read `/proc/<pid>/mem`).
pub fn read_u32(pid: HostPid, addr: u64) -> io::Result<u32> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(format!("/proc/{pid}/mem"))?;
    let mut b = [0u8; 4];
    f.read_exact_at(&mut b, addr)?;
    Ok(u32::from_ne_bytes(b))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_soft_descriptor_limit_is_read() {
        let text = "Limit                     Soft Limit           Hard Limit           Units     \nMax cpu time              unlimited            unlimited            seconds   \nMax open files            1024                 524288               files     \n";
        assert_eq!(super::parse_nofile_soft(text), Some(1024));
        let unlimited = text.replace("1024 ", "unlimited");
        assert_eq!(super::parse_nofile_soft(&unlimited), None);
    }

    use super::*;

    #[test]
    fn status_lines_are_parsed() {
        let s =
            "Name:\tpython3\nTgid:\t77\nNSpid:\t4242\t7\nVmPeak:\t  100 kB\nVmRSS:\t  123456 kB\n";
        assert_eq!(parse_ns_id(s), Some(7));
        assert_eq!(parse_vm_rss_kib(s), Some(123456));
        assert_eq!(parse_vm_rss_kib("Name:\tx\n"), None);
        assert_eq!(parse_ns_id("Name:\tx\nNSpid:\n"), None);
        // A key is matched whole: `VmRSSx` is not `VmRSS`.
        assert_eq!(parse_vm_rss_kib("VmRSSx:\t5 kB\n"), None);
    }

    #[test]
    fn stat_skips_a_command_name_with_spaces_and_parens() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
        let s = "42 (a b) c)) S 1 42 42 0 -1 4194560 10 0 0 0 700 55 0 0 20 0";
        let st = Stat::parse(s).unwrap();
        assert_eq!(st.comm, "a b) c)");
        assert_eq!(st.state(), Some(ProcState::Sleeping));
        assert_eq!(st.cpu_ticks(), Some(755));
        assert_eq!(st.parent().map(HostPid::get), Some(1));
        assert_eq!(st.start_time(), None, "the line ends before field 22");
        let full = "7 (x) S 1 7 7 0 -1 0 0 0 0 0 1 2 0 0 20 0 1 0 4242 0 0";
        assert_eq!(Stat::parse(full).unwrap().start_time(), Some(4242));
        assert!(!st.exited());
        assert_eq!(Stat::parse("42 (x) S 1").unwrap().cpu_ticks(), None);
        assert!(Stat::parse("42 (x) Z 1").unwrap().exited());
        assert_eq!(Stat::parse("garbage"), None);
    }

    #[test]
    fn every_state_letter_is_parsed_once_and_written_back() {
        for (letter, state) in [
            ("R", ProcState::Running),
            ("S", ProcState::Sleeping),
            ("D", ProcState::DiskSleep),
            ("T", ProcState::Stopped),
            ("t", ProcState::TracingStop),
            ("Z", ProcState::Zombie),
            ("X", ProcState::Dead),
            ("P", ProcState::Parked),
            ("I", ProcState::Idle),
            ("W", ProcState::Other('W')),
        ] {
            assert_eq!(ProcState::parse(letter), Some(state), "{letter}");
            assert_eq!(state.to_string(), letter);
        }
        assert_eq!(ProcState::parse("x"), Some(ProcState::Dead), "before 4.14");
        assert!(ProcState::Dead.exited() && ProcState::Zombie.exited());
        assert!(!ProcState::Stopped.exited() && !ProcState::TracingStop.exited());
        assert_eq!(ProcState::parse(""), None);
        assert_eq!(ProcState::parse("SS"), None);
        assert_eq!(
            Stat::parse("42 (x) t 1").unwrap().state(),
            Some(ProcState::TracingStop)
        );
    }

    #[test]
    fn a_blocked_thread_is_located() {
        let w = parse_syscall("202 0x7f00000010a0 0x80 0x2 0x0 0x0 0x0 0x7ffd0 0x7f0000401234")
            .unwrap();
        assert_eq!(
            w,
            BlockedSyscall {
                nr: 202,
                arg0: 0x7f00000010a0,
                pc: 0x7f0000401234
            }
        );
        assert_eq!(parse_syscall("running"), None);
        assert_eq!(parse_syscall("-1 0x7ffd0 0x401000"), None);
        let maps = "7f0000000000-7f0000002000 rw-p 00000000 00:00 0 \n\
                    7f0000400000-7f0000500000 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libcuda.so.1\n";
        assert_eq!(
            mapping_of(maps, 0x7f0000401234).as_deref(),
            Some("libcuda.so.1")
        );
        assert_eq!(mapping_of(maps, 0x7f00000010a0).as_deref(), Some("[anon]"));
        assert_eq!(mapping_of(maps, 0x1000), None);
    }

    #[test]
    fn char_majors_come_from_the_character_section() {
        let text =
            "Character devices:\n  1 mem\n226 drm\n510 kfd\n\nBlock devices:\n  8 sd\n 9 kfd\n";
        assert_eq!(parse_char_major(text, "kfd"), Some(510));
        assert_eq!(parse_char_major(text, "drm"), Some(226));
        assert_eq!(parse_char_major(text, "sd"), None, "a block device");
        assert_eq!(
            parse_char_major("Character devices:\n  1 mem\n", "kfd"),
            None
        );
    }

    #[test]
    fn flock_holders_are_found_by_device_and_inode() {
        let locks = "1: POSIX  ADVISORY  WRITE 11 08:01:99 0 EOF\n\
                     2: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF\n\
                     2: -> FLOCK  ADVISORY  WRITE 77 08:01:1234 0 EOF\n";
        let dev = libc::makedev(8, 1);
        assert_eq!(
            parse_flock_holder(locks, dev, 1234).map(HostPid::get),
            Some(4242)
        );
        assert_eq!(parse_flock_holder(locks, dev, 99), None, "a POSIX lock");
        assert_eq!(parse_flock_holder(locks, libc::makedev(8, 2), 1234), None);
    }

    #[test]
    fn own_descriptors_resolve() {
        let me = HostPid(std::process::id() as i32);
        let f = std::fs::File::open("/proc/self/status").unwrap();
        let n = ForeignFd::new(std::os::fd::AsRawFd::as_raw_fd(&f)).unwrap();
        assert!(fd_numbers(me).unwrap().contains(&n));
        assert!(fd_target(me, n).unwrap().ends_with("status"));
        assert!(fd_metadata(me, n).unwrap().is_file());
        // -1 names no descriptor: no ForeignFd at all now.
        assert!(ForeignFd::new(-1).is_none_or(|fd| fd_target(me, fd).is_err()));
    }

    #[test]
    fn argv0_drops_directories() {
        assert_eq!(
            parse_argv0(b"/usr/bin/nvidia-cuda-mps-control\0-d\0"),
            "nvidia-cuda-mps-control"
        );
        assert_eq!(parse_argv0(b""), "");
    }

    #[test]
    fn own_process_resolves() {
        let me = std::process::id() as i32;
        // The tests run in the pid namespace they were started in.
        assert_eq!(ns_pid(HostPid(me)).unwrap(), NsPid(std::process::id()));
        let (host, tid) = (HostPid(me), HostTid(me));
        assert_eq!(host_tid(host, NsTid(me)).unwrap(), Some(tid));
        assert_eq!(host_tid(host, NsTid(-5)).unwrap(), None);
        assert!(thread_ids(host).unwrap().contains(&tid));
        assert!(vm_rss_kib(host).unwrap() > 0);
        assert!(processes().unwrap().contains(&host));
        let e = ns_pid(HostPid(-1)).unwrap_err();
        assert!(e.to_string().contains("/proc/-1/status"), "{e}");
    }
}
