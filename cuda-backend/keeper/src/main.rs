//! `gpusnap-keeper --fd N [--libcuda PATH] [--gpu UUID]... [--detach]`: started by the gpusnap plugin during a
//! dump or a restore, never by hand. It holds a checkpointed job's device memory (imported from
//! descriptors the job exported, or loaded from the image) and serves the plugin beside CRIU's
//! own dump or restore.
//!
//! Modules: this file is its process (the arguments, and `--detach`, which makes it a process
//! CRIU does not own); `serve` is what it does, its request loop over
//! [`gpusnap_proto::KeeperRequest`]s, on the agent's code linked as a library (`gpusnap_agent`:
//! one driver table, the agent's, and the agent's operations).

mod serve;

use gpusnap_proto::pid::HostPid;
use gpusnap_proto::{Channel, ErrorCode, Reply};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};

const USAGE: &str = "usage: gpusnap-keeper --fd N [--libcuda PATH] [--gpu UUID]... [--detach]\n\
    (the gpusnap plugin starts it with the connection on descriptor N; it is not run by hand)";

struct Args {
    fd: i32,
    libcuda: Option<String>,
    /// GPUs (UUIDs, 32 hex digits) to make a context on at once.
    gpus: Vec<[u8; 16]>,
    detach: bool,
}

fn uuid(hex: &str) -> Option<[u8; 16]> {
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn parse(args: &[String]) -> Option<Args> {
    let mut fd = None;
    let mut libcuda = None;
    let mut detach = false;
    let mut gpus = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--fd" => fd = Some(it.next()?.parse::<i32>().ok()?),
            "--libcuda" => libcuda = Some(it.next()?.clone()),
            "--detach" => detach = true,
            "--gpu" => gpus.push(uuid(it.next()?)?),
            _ => return None,
        }
    }
    Some(Args {
        fd: fd?,
        libcuda,
        gpus,
        detach,
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(args) = parse(&args) else {
        eprintln!("{USAGE}");
        std::process::exit(2);
    };
    if args.detach {
        detach(args.fd);
    }
    std::process::exit(serve::main_with_fd(
        args.fd,
        args.libcuda.as_deref(),
        &args.gpus,
    ));
}

/// Forks once more; the process the plugin started sends the child's pid and a pidfd of it on
/// the connection and exits, and the child goes on as the keeper. CRIU takes the exit of any
/// child of its own during its work for a failure (and may then lose the job), so the keeper
/// must not be one; its new parent is whichever ancestor reaps orphans. The plugin waits on the
/// pidfd instead of `waitpid`. Returns only in the child.
fn detach(fd: i32) {
    // SAFETY: fork in a process that has started no thread yet (this runs first in main).
    let child = unsafe { libc::fork() };
    if child < 0 {
        fail(fd, &format!("fork: {}", std::io::Error::last_os_error()));
    }
    if child == 0 {
        return;
    }
    // SAFETY: pidfd_open of our own child, which only we can reap, so its pid is still its own.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, child, 0) };
    if pidfd < 0 {
        let err = std::io::Error::last_os_error();
        // SAFETY: our own child, killed and reaped before we report.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        fail(
            fd,
            &format!("pidfd_open: {err} (Linux 5.3 or newer is needed)"),
        );
    }
    // SAFETY: pidfd_open returned a new descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    let ch = connection(fd);
    let sent = ch.send_reply_with(
        &Reply::Detached {
            pid: HostPid(child),
        },
        pidfd.as_fd(),
    );
    // Our copy of the connection is not the keeper's: leaving it open or closed changes nothing.
    std::mem::forget(ch);
    // SAFETY: _exit ends this process without running anything of the child's.
    unsafe { libc::_exit(if sent.is_ok() { 0 } else { 1 }) }
}

/// The connection on `fd`, for the detaching parent's one message.
fn connection(fd: i32) -> Channel {
    // SAFETY: fcntl(F_GETFD) only checks that the number is open.
    if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        eprintln!(
            "gpusnap-keeper: descriptor {fd} is not open (started by hand? the plugin starts it)"
        );
        // SAFETY: ends the process.
        unsafe { libc::_exit(2) }
    }
    // SAFETY: the plugin passed this descriptor for us alone; the parent sends one message on
    // it and never closes it (forgotten), so the child's copy stays the only owner that acts.
    Channel::new(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Tells the plugin why the keeper could not detach, then exits.
fn fail(fd: i32, why: &str) -> ! {
    let ch = connection(fd);
    let _ = ch.send_reply(&Reply::Error {
        code: ErrorCode::BadState,
        message: format!("the keeper could not detach: {why}"),
    });
    std::mem::forget(ch);
    // SAFETY: ends the process.
    unsafe { libc::_exit(1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn arguments_parse_in_any_order_and_unknown_ones_are_refused() {
        let a = parse(&args(&[
            "--detach",
            "--fd",
            "3",
            "--libcuda",
            "/x/libcuda.so.1",
        ]))
        .unwrap();
        assert_eq!(
            (a.fd, a.libcuda.as_deref(), a.detach),
            (3, Some("/x/libcuda.so.1"), true)
        );
        let a = parse(&args(&["--fd", "4"])).unwrap();
        assert_eq!((a.fd, a.libcuda, a.detach), (4, None, false));
        let a = parse(&args(&[
            "--fd",
            "4",
            "--gpu",
            "000102030405060708090a0b0c0d0e0f",
        ]))
        .unwrap();
        assert_eq!(
            a.gpus,
            vec![[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
        );
        assert!(parse(&args(&["--fd", "4", "--gpu", "xyz"])).is_none());
        assert!(parse(&args(&["--fd"])).is_none());
        assert!(parse(&args(&["--fd", "x"])).is_none());
        assert!(parse(&args(&["--libcuda", "/l"])).is_none());
        assert!(parse(&args(&["--fd", "3", "--verbose"])).is_none());
    }
}
