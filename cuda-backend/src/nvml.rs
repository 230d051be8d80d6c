//! Free device memory through NVML (`libnvidia-ml.so.1`), loaded at run time.
//!
//! Used before a restore to refuse clearly when a GPU lacks room, without creating a CUDA context
//! (hundreds of MiB of device memory) inside CRIU.
//!
//! At the restore's `init`, CRIU has not forked the restored tree yet, and forks it from its own
//! process: nothing may be left there that the forks would copy in a broken state (a thread, a
//! lock another thread holds) or that the restored tasks would inherit (a device fd). What NVML
//! starts or opens inside `nvmlInit`, and whether `nvmlShutdown` and the library's unload undo all
//! of it, is the vendor's to say and not checked here. So [`free_memory_apart`] asks NVML in a
//! child process that exits before `init` returns: NVML never loads in CRIU's process before the
//! forks (after them, at RESUME_DEVICES_LATE, [`free_memory`] asks it there as before).

use crate::GpuUuid;
use std::collections::HashMap;
use std::ffi::{CString, c_char, c_uint, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// nvml.h's `nvmlMemory_t` (v1), which `nvmlDeviceGetMemoryInfo` fills.
#[repr(C)]
#[derive(Default)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// Free bytes on the GPU with this UUID, or `None` when NVML cannot tell. (A UUID that does not
/// parse never gets here: it is refused as a [`GpuUuid`] first.)
pub fn free_memory(uuid: &GpuUuid) -> Option<u64> {
    // SAFETY: NVML is the vendor's management library, designed to be loaded anywhere.
    let lib = unsafe { libloading::Library::new("libnvidia-ml.so.1") }.ok()?;
    type InitFn = unsafe extern "C" fn() -> c_uint;
    type ByUuidFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> c_uint;
    type MemFn = unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_uint;
    // SAFETY: the symbols are resolved with the signatures of nvml.h.
    let (init, by_uuid, mem, shutdown) = unsafe {
        (
            *lib.get::<InitFn>(b"nvmlInit_v2\0").ok()?,
            *lib.get::<ByUuidFn>(b"nvmlDeviceGetHandleByUUID\0").ok()?,
            *lib.get::<MemFn>(b"nvmlDeviceGetMemoryInfo\0").ok()?,
            *lib.get::<InitFn>(b"nvmlShutdown\0").ok()?,
        )
    };
    let dashed = CString::new(uuid.to_nvml_string()).ok()?;
    // SAFETY: plain NVML calls with valid pointers; every init is paired with a shutdown.
    unsafe {
        if init() != 0 {
            return None;
        }
        let mut dev: *mut c_void = std::ptr::null_mut();
        let mut m = NvmlMemory::default();
        let ok = by_uuid(dashed.as_ptr(), &mut dev) == 0 && mem(dev, &mut m) == 0;
        shutdown();
        ok.then_some(m.free)
    }
}

/// Why [`free_memory_apart`] has no answer (the check is then left to RESUME_DEVICES_LATE).
#[derive(Debug, thiserror::Error)]
pub enum ApartError {
    #[error("this process has {0} threads, and forks only with one")]
    Threads(usize),
    #[error("pipe: {0}")]
    Pipe(std::io::Error),
    #[error("fork: {0}")]
    Fork(std::io::Error),
    #[error("reading its answer: {0}")]
    Read(std::io::Error),
    #[error("no answer within {0:?} (killed)")]
    TooSlow(Duration),
    #[error("it ended with status {0:#x}")]
    Status(i32),
    #[error("its answer does not parse: {0:?}")]
    Garbled(String),
}

/// Free bytes on each GPU of `uuids` (32 hex digits each) that NVML can tell, asked in a child
/// process of this one that exits before this returns (module doc: NVML must not load in
/// CRIU's process before it forks the restored tree). The child is killed and reaped if it has
/// not answered within `within`. Only with this process's one thread: a fork copies no other.
pub fn free_memory_apart(
    uuids: &[String],
    within: Duration,
) -> Result<HashMap<String, u64>, ApartError> {
    let threads = std::fs::read_dir("/proc/self/task").map_or(0, Iterator::count);
    if threads != 1 {
        return Err(ApartError::Threads(threads));
    }
    ask_apart(uuids, within, free_memory)
}

/// [`free_memory_apart`] with `free` as the child's question, whatever the threads.
fn ask_apart(
    uuids: &[String],
    within: Duration,
    free: fn(&GpuUuid) -> Option<u64>,
) -> Result<HashMap<String, u64>, ApartError> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 into an array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(ApartError::Pipe(std::io::Error::last_os_error()));
    }
    // SAFETY: pipe2 just made both descriptors; nothing else owns them.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: in CRIU's process there is one thread (the caller checks), so the child's copy of
    // it holds no lock another thread took and may run any code (the tests' threads: glibc's
    // allocator is safe in a forked child); it ends with `_exit`.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(ApartError::Fork(std::io::Error::last_os_error()));
    }
    if child == 0 {
        drop(rd);
        let answer = answer(uuids, free);
        let ok = write_all(&wr, answer.as_bytes());
        // SAFETY: ends the child at once, running none of the parent's exit handlers.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) }
    }
    drop(wr);
    let deadline = Instant::now() + within;
    let read = read_to_end(&rd, deadline);
    let status = match read {
        Ok(_) => wait_child(child, deadline),
        Err(_) => None,
    };
    let Some(status) = status else {
        kill_child(child);
        return Err(match read {
            Err(ApartError::Read(e)) => ApartError::Read(e),
            _ => ApartError::TooSlow(within),
        });
    };
    let text = read?;
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        return Err(ApartError::Status(status));
    }
    parse_answer(uuids, &text)
}

/// The child's answer: one line per UUID, `<uuid> <free bytes>`, or `<uuid> -` when NVML cannot
/// tell.
fn answer(uuids: &[String], free: impl Fn(&GpuUuid) -> Option<u64>) -> String {
    uuids
        .iter()
        .map(|u| {
            let f = u.parse::<GpuUuid>().ok().and_then(|g| free(&g));
            format!(
                "{u} {}\n",
                f.map_or_else(|| "-".to_owned(), |b| b.to_string())
            )
        })
        .collect()
}

/// [`answer`]'s lines back, each for the UUID asked in its place.
fn parse_answer(uuids: &[String], text: &str) -> Result<HashMap<String, u64>, ApartError> {
    let lines: Vec<&str> = text.lines().collect();
    if lines.len() != uuids.len() {
        return Err(ApartError::Garbled(text.to_owned()));
    }
    let mut out = HashMap::new();
    for (u, line) in uuids.iter().zip(lines) {
        let value = line
            .strip_prefix(u.as_str())
            .and_then(|r| r.strip_prefix(' '))
            .ok_or_else(|| ApartError::Garbled(text.to_owned()))?;
        if value != "-" {
            let bytes = value
                .parse()
                .map_err(|_| ApartError::Garbled(text.to_owned()))?;
            out.insert(u.clone(), bytes);
        }
    }
    Ok(out)
}

fn write_all(fd: &OwnedFd, mut b: &[u8]) -> bool {
    while !b.is_empty() {
        // SAFETY: write(2) from a live slice to an open descriptor.
        let n = unsafe { libc::write(fd.as_raw_fd(), b.as_ptr().cast(), b.len()) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if n <= 0 {
            return false;
        }
        b = &b[n as usize..];
    }
    true
}

/// Everything until end of file, or `TooSlow` at `deadline` (with a zero duration: the caller
/// names the limit).
fn read_to_end(fd: &OwnedFd, deadline: Instant) -> Result<String, ApartError> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd that lives across the call.
        let r = unsafe { libc::poll(&mut p, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(ApartError::Read(e));
        }
        if r == 0 {
            return Err(ApartError::TooSlow(Duration::ZERO));
        }
        // SAFETY: read(2) into a live buffer of its length.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(ApartError::Read(e));
        }
        if n == 0 {
            return String::from_utf8(out).map_err(|e| ApartError::Garbled(e.to_string()));
        }
        out.extend_from_slice(&buf[..n as usize]);
    }
}

/// The child's wait status once it has exited, or `None` at `deadline`.
fn wait_child(child: libc::pid_t, deadline: Instant) -> Option<i32> {
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid status pointer; WNOHANG never blocks.
        let r = unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) };
        if r == child {
            return Some(status);
        }
        if r < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return Some(-1);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Kills our child and reaps it, waiting a bounded time (a child stuck in the driver dies only
/// when it leaves it; CRIU would then see an exit it does not expect, logged here).
fn kill_child(child: libc::pid_t) {
    // SAFETY: kill(2) of our own child, not reaped yet (so its pid is still its own).
    unsafe { libc::kill(child, libc::SIGKILL) };
    if wait_child(child, Instant::now() + Duration::from_secs(5)).is_none() {
        log::warn!(
            "the NVML query process {child} did not end within 5 s of SIGKILL (stuck in the driver?); CRIU may see it exit later"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::NvmlMemory;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn memory_info_layout_matches_nvml_h() {
        // { unsigned long long total; unsigned long long free; unsigned long long used; }
        assert_eq!(size_of::<NvmlMemory>(), 24);
        assert_eq!(align_of::<NvmlMemory>(), 8);
        assert_eq!(offset_of!(NvmlMemory, total), 0);
        assert_eq!(offset_of!(NvmlMemory, free), 8);
        assert_eq!(offset_of!(NvmlMemory, used), 16);
    }

    #[test]
    fn the_childs_answer_parses_back_uuid_by_uuid() {
        let uuids = vec![
            "0123abcd456789ef0123456789abcdef".to_owned(),
            "ffffffffffffffffffffffffffffffff".to_owned(),
            "not-a-uuid".to_owned(),
        ];
        let a = super::answer(&uuids, |g| {
            (g.to_string().starts_with("0123")).then_some(5 << 30)
        });
        assert_eq!(
            a,
            "0123abcd456789ef0123456789abcdef 5368709120\nffffffffffffffffffffffffffffffff -\nnot-a-uuid -\n"
        );
        let free = super::parse_answer(&uuids, &a).unwrap();
        assert_eq!(free.len(), 1);
        assert_eq!(free["0123abcd456789ef0123456789abcdef"], 5 << 30);
        assert!(super::parse_answer(&uuids, "").is_err());
        assert!(super::parse_answer(&uuids[..1], "ffffffffffffffffffffffffffffffff 1\n").is_err());
        assert!(super::parse_answer(&uuids[..1], "0123abcd456789ef0123456789abcdef x\n").is_err());
    }

    fn five_gib(_: &crate::GpuUuid) -> Option<u64> {
        Some(5 << 30)
    }

    fn stuck(_: &crate::GpuUuid) -> Option<u64> {
        std::thread::sleep(std::time::Duration::from_secs(30));
        None
    }

    fn dies(_: &crate::GpuUuid) -> Option<u64> {
        // SAFETY: ends the child.
        unsafe { libc::_exit(3) }
    }

    /// The question runs in a child, which answers, or is killed when it does not in time, or
    /// whose failure is told; in a process of several threads (the tests'), the plugin's entry
    /// refuses to fork at all.
    #[test]
    fn the_question_apart_answers_or_is_given_up() {
        use std::time::{Duration, Instant};
        let uuids = vec!["0123abcd456789ef0123456789abcdef".to_owned()];
        let free = super::ask_apart(&uuids, Duration::from_secs(20), five_gib).unwrap();
        assert_eq!(free[&uuids[0]], 5 << 30);
        let t0 = Instant::now();
        let e = super::ask_apart(&uuids, Duration::from_millis(300), stuck).unwrap_err();
        assert!(matches!(e, super::ApartError::TooSlow(_)), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        let e = super::ask_apart(&uuids, Duration::from_secs(20), dies).unwrap_err();
        assert!(matches!(e, super::ApartError::Status(_)), "{e}");
        let e = super::free_memory_apart(&uuids, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, super::ApartError::Threads(n) if n > 1), "{e}");
    }

    #[test]
    fn uuid_is_dashed_for_nvml() {
        let uuid: crate::GpuUuid = "0123abcd456789ef0123456789abcdef".parse().unwrap();
        assert_eq!(
            uuid.to_nvml_string(),
            "GPU-0123abcd-4567-89ef-0123-456789abcdef"
        );
        assert!("xyz".parse::<crate::GpuUuid>().is_err());
    }
}
