//! The built `libgpusnap_agent.so` preloaded into ordinary programs: it must not break them
//! (the `dlsym` interposer is in every lookup they make), must stay quiet, and with
//! `GPUSNAP_AGENT_EAGER=1` must answer on its socket without any GPU.

use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpusnap_proto::pid::HostPid;
use gpusnap_proto::{
    AgentRequest, Channel, CommonRequest, Door, ErrorCode, PROTOCOL_VERSION, ProtoError, Reply,
    connect_agent,
};

/// The cdylib cargo built next to this test binary (target/<profile>/deps or target/<profile>).
fn agent_so() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    for dir in [deps, deps.parent().unwrap()] {
        let p = dir.join("libgpusnap_agent.so");
        if p.exists() {
            return p;
        }
    }
    panic!("libgpusnap_agent.so not found near {}", exe.display());
}

fn preloaded(program: &str) -> Command {
    let mut c = Command::new(program);
    c.env("LD_PRELOAD", agent_so())
        .env_remove("GPUSNAP_AGENT_DEBUG")
        .env_remove("GPUSNAP_AGENT_EAGER")
        .env_remove("GPUSNAP_AGENT_DISABLE");
    c
}

/// Says that `test` did not run, on the real stderr (`eprintln!` is captured for a passing
/// test), in the form scripts/test.sh lists in its summary.
fn skipped(test: &str, why: &str) {
    use std::io::Write;
    let line = format!("gpusnap-agent: SKIPPED {test}: {why}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

fn have(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

#[test]
fn true_and_sh_run_unharmed_and_quiet() {
    let out = preloaded("/bin/true").output().unwrap();
    assert!(out.status.success());
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = preloaded("/bin/sh")
        .args(["-c", "exit 0"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(out.stderr.is_empty());

    let out = preloaded("/bin/sh")
        .args(["-c", "echo hello | cat; exit 3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(out.stdout, b"hello\n");
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn dlsym_heavy_program_runs_unharmed() {
    if !have("python3") {
        skipped("dlsym_heavy_program_runs_unharmed", "python3 not installed");
        return;
    }
    // ctypes resolves every attribute with dlsym (RTLD_DEFAULT-style handle from dlopen(NULL)).
    let script = "import ctypes, os\n\
                  libc = ctypes.CDLL(None)\n\
                  assert libc.getpid() == os.getpid()\n\
                  try:\n    libc.no_such_symbol_gpusnap\n    raise SystemExit(1)\n\
                  except AttributeError:\n    pass\n\
                  print('ok')";
    let out = preloaded("python3").args(["-c", script]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, b"ok\n");
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A preloaded `sleep` with the agent started at load.
struct EagerChild(Child);

impl EagerChild {
    fn start(secs: &str) -> Self {
        let child = preloaded("sleep")
            .arg(secs)
            .env("GPUSNAP_AGENT_EAGER", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        EagerChild(child)
    }

    fn pid(&self) -> i32 {
        self.0.id() as i32
    }

    fn connect(&self) -> Channel {
        let t0 = Instant::now();
        loop {
            match connect_agent(HostPid(self.pid())) {
                Ok(fd) => return Channel::new(fd),
                Err(e) if t0.elapsed() < Duration::from_secs(10) => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("agent of pid {} never listened: {e}", self.pid()),
            }
        }
    }

    fn finish(mut self) -> Vec<u8> {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let mut err = Vec::new();
        if let Some(mut s) = self.0.stderr.take() {
            let _ = s.read_to_end(&mut err);
        }
        err
    }
}

fn memfd(len: i64) -> OwnedFd {
    // SAFETY: valid name and flags.
    let fd = unsafe { libc::memfd_create(c"gpusnap-test-staging".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a new descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fd is open.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len) }, 0);
    fd
}

const WAIT: Option<Duration> = Some(Duration::from_secs(10));

#[test]
fn eager_agent_answers_without_a_gpu() {
    let child = EagerChild::start("30");
    let ch = child.connect();

    ch.send_request(
        &AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION,
        }),
        None,
    )
    .unwrap();
    let tid = match ch.recv_reply(WAIT).unwrap() {
        Reply::Hello {
            version,
            pid,
            tid,
            allocations,
            converted_bytes,
            devices,
            released,
            hazards,
            kept,
        } => {
            assert_eq!(version, PROTOCOL_VERSION);
            assert_eq!(pid.get() as i32, child.pid());
            assert_ne!(
                tid.get(),
                pid.get() as i32,
                "the agent is a thread of its own"
            );
            assert_eq!(
                (
                    allocations,
                    converted_bytes,
                    devices,
                    released,
                    hazards,
                    kept
                ),
                (0, 0, 0, false, 0, 0)
            );
            tid
        }
        other => panic!("{other:?}"),
    };
    let task = format!("/proc/{}/task/{tid}", child.pid());
    assert_eq!(
        std::fs::read_to_string(format!("{task}/comm"))
            .unwrap()
            .trim(),
        "gpusnap-agent"
    );
    // Every signal blocked but SIGKILL and SIGSTOP (unblockable) and glibc's internal 32 and 33.
    let status = std::fs::read_to_string(format!("{task}/status")).unwrap();
    let blk = status
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .unwrap()
        .trim();
    let mask = u64::from_str_radix(blk, 16).unwrap();
    let unblockable = (1u64 << (libc::SIGKILL - 1)) | (1 << (libc::SIGSTOP - 1)) | (3 << 31);
    assert_eq!(mask | unblockable, u64::MAX, "SigBlk {blk}");

    ch.send_request(&AgentRequest::ListAllocations, None)
        .unwrap();
    assert_eq!(
        ch.recv_reply(WAIT).unwrap(),
        Reply::AllocationsEnd { count: 0 }
    );

    ch.send_request(
        &AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION + 1,
        }),
        None,
    )
    .unwrap();
    assert!(matches!(
        ch.recv_reply(WAIT).unwrap(),
        Reply::Error {
            code: ErrorCode::VersionMismatch,
            ..
        }
    ));

    // Data-phase requests outside an operation are refused, the connection stays.
    for r in [
        AgentRequest::Common(CommonRequest::SlotFree { slot: 0 }),
        AgentRequest::Common(CommonRequest::Release),
        AgentRequest::Common(CommonRequest::RestoreDataDone),
    ] {
        ch.send_request(&r, None).unwrap();
        assert!(
            matches!(
                ch.recv_reply(WAIT).unwrap(),
                Reply::Error {
                    code: ErrorCode::BadState,
                    ..
                }
            ),
            "{r:?}"
        );
    }
    ch.send_request(&AgentRequest::Common(CommonRequest::Abort), None)
        .unwrap();
    assert_eq!(ch.recv_reply(WAIT).unwrap(), Reply::Aborted);

    // A descriptor where none belongs, and a DumpBegin without one: refused, and each ends its
    // connection (anything malformed does).
    let fd = memfd(4096);
    ch.send_request(&AgentRequest::ListAllocations, Some(fd.as_fd()))
        .unwrap();
    assert!(matches!(
        ch.recv_reply(WAIT).unwrap(),
        Reply::Error {
            code: ErrorCode::BadRequest,
            ..
        }
    ));
    assert!(matches!(ch.recv_reply(WAIT), Err(ProtoError::Closed)));
    let ch = child.connect();
    ch.send_request(
        &AgentRequest::Common(CommonRequest::DumpBegin {
            slot_size: 4096,
            slots: 1,
            streams: 1,
        }),
        None,
    )
    .unwrap();
    assert!(matches!(
        ch.recv_reply(WAIT).unwrap(),
        Reply::Error {
            code: ErrorCode::BadRequest,
            ..
        }
    ));
    assert!(matches!(ch.recv_reply(WAIT), Err(ProtoError::Closed)));

    // Bad ring parameters: refused before any CUDA call, then the connection is closed.
    let ch = child.connect();
    ch.send_request(
        &AgentRequest::Common(CommonRequest::DumpBegin {
            slot_size: 1000,
            slots: 1,
            streams: 1,
        }),
        Some(fd.as_fd()),
    )
    .unwrap();
    assert!(matches!(
        ch.recv_reply(WAIT).unwrap(),
        Reply::Error {
            code: ErrorCode::BadRequest,
            ..
        }
    ));
    assert!(matches!(ch.recv_reply(WAIT), Err(ProtoError::Closed)));

    // A valid DumpBegin and RestoreBegin need libcuda, which a CPU-only machine lacks.
    for begin in [
        AgentRequest::Common(CommonRequest::DumpBegin {
            slot_size: 4096,
            slots: 1,
            streams: 1,
        }),
        AgentRequest::Common(CommonRequest::RestoreBegin {
            slot_size: 4096,
            slots: 1,
            streams: 1,
        }),
    ] {
        let ch = child.connect();
        ch.send_request(&begin, Some(fd.as_fd())).unwrap();
        match ch.recv_reply(WAIT).unwrap() {
            Reply::Error {
                code: ErrorCode::Cuda,
                message,
            } => assert!(message.contains("libcuda"), "{message}"),
            // With a driver but no converted allocation there is nothing to move.
            Reply::Ready => eprintln!("libcuda present: {begin:?} accepted"),
            other => panic!("{other:?}"),
        }
        drop(ch);
    }

    // Still serving after all that.
    let ch = child.connect();
    ch.send_request(
        &AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION,
        }),
        None,
    )
    .unwrap();
    assert!(matches!(
        ch.recv_reply(WAIT).unwrap(),
        Reply::Hello { allocations: 0, .. }
    ));
    drop(ch);

    let err = child.finish();
    assert!(
        err.is_empty(),
        "the agent printed: {}",
        String::from_utf8_lossy(&err)
    );
}

/// Garbage is refused and ends its connection at once (a client that cannot speak the protocol
/// never holds the agent, which serves one connection at a time); the agent serves the next.
#[test]
fn garbage_on_the_socket_ends_the_connection_not_the_agent() {
    let child = EagerChild::start("30");
    let ch = child.connect();
    // SAFETY: sending raw bytes on a connected socket.
    let n = unsafe { libc::send(ch.fd().as_raw_fd(), b"not a message".as_ptr().cast(), 13, 0) };
    assert_eq!(n, 13);
    assert!(matches!(
        ch.recv_reply(WAIT).unwrap(),
        Reply::Error {
            code: ErrorCode::BadRequest,
            ..
        }
    ));
    assert!(matches!(ch.recv_reply(WAIT), Err(ProtoError::Closed)));
    let ch = child.connect();
    ch.send_request(&AgentRequest::ListAllocations, None)
        .unwrap();
    assert_eq!(
        ch.recv_reply(WAIT).unwrap(),
        Reply::AllocationsEnd { count: 0 }
    );
    drop(ch);
    assert!(child.finish().is_empty());
}

/// Runs `f` in a forked child as uid/gid 65534 and returns its exit code.
fn as_nobody(f: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child only switches credentials, runs `f` (which reads /proc and uses
    // sockets; glibc's malloc is fork-safe) and leaves with _exit.
    match unsafe { libc::fork() } {
        0 => {
            // SAFETY: credential calls with valid ids; _exit never returns.
            unsafe {
                let ok = libc::setgroups(0, std::ptr::null()) == 0
                    && libc::setresgid(65534, 65534, 65534) == 0
                    && libc::setresuid(65534, 65534, 65534) == 0;
                libc::_exit(if ok { f() } else { 99 })
            }
        }
        child => {
            assert!(child > 0, "fork failed");
            let mut status = 0;
            // SAFETY: waiting for our own child.
            assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
            assert!(libc::WIFEXITED(status), "child died: {status:#x}");
            libc::WEXITSTATUS(status)
        }
    }
}

/// Another user can neither open the agent's door (its `/proc/<pid>/fd` and `pidfd_getfd` need
/// ptrace rights) nor be served if it got in some other way: a connection whose socket another
/// user made (`SO_PEERCRED`) is closed unanswered. Root is served.
#[test]
fn other_users_are_refused() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skipped(
            "other_users_are_refused",
            "needs root (runs a client as nobody)",
        );
        return;
    }
    let child = EagerChild::start("30");
    drop(child.connect()); // wait until the door is open
    let pid = child.pid();
    let opened = as_nobody(|| match Door::open(HostPid(pid)) {
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => 0,
        Err(_) => 2,
        Ok(_) => 1,
    });
    assert_eq!(
        opened, 0,
        "another user opened the agent's door (1) or failed oddly (2)"
    );
    // Root opens the door and hands it over; the other user makes the connection and knocks.
    let door = Door::open(HostPid(pid)).unwrap().expect("the agent's door");
    let served = as_nobody(|| {
        let Ok(fd) = door.knock() else { return 3 };
        let ch = Channel::new(fd);
        let hello = AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION,
        });
        if ch.send_request(&hello, None).is_err() {
            return 0; // closed before we could even ask
        }
        match ch.recv_reply(WAIT) {
            Err(ProtoError::Closed) => 0,
            Ok(_) => 1,
            Err(_) => 2,
        }
    });
    assert_eq!(
        served, 0,
        "the agent served another user's connection (1) or hung (2)"
    );
    // Root is still served.
    let ch = child.connect();
    ch.send_request(
        &AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION,
        }),
        None,
    )
    .unwrap();
    assert!(matches!(ch.recv_reply(WAIT).unwrap(), Reply::Hello { .. }));
    drop(ch);
    child.finish();
}

#[test]
fn forked_child_inherits_no_agent() {
    if !have("python3") {
        skipped("forked_child_inherits_no_agent", "python3 not installed");
        return;
    }
    // The child prints its own pid once fork() has returned in it (its atfork handlers have
    // run by then), then only sleeps (no CUDA, so no agent of its own).
    let script = "import os, sys, time\n\
                  pid = os.fork()\n\
                  if pid == 0:\n    print(os.getpid(), flush=True)\n    time.sleep(20)\n    os._exit(0)\n\
                  time.sleep(20)";
    let mut parent = preloaded("python3")
        .args(["-c", script])
        .env("GPUSNAP_AGENT_EAGER", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut out = parent.stdout.take().unwrap();
    let mut byte = [0u8; 1];
    while out.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {
        line.push(byte[0] as char);
    }
    let forked: i32 = line.trim().parse().unwrap();
    // The parent's agent answers.
    let t0 = Instant::now();
    let ch = loop {
        match connect_agent(HostPid(parent.id() as i32)) {
            Ok(fd) => break Channel::new(fd),
            Err(_) if t0.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("{e}"),
        }
    };
    ch.send_request(
        &AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION,
        }),
        None,
    )
    .unwrap();
    assert!(matches!(ch.recv_reply(WAIT).unwrap(), Reply::Hello { .. }));
    // The child has no agent thread, no socket, and closed the inherited door.
    assert!(connect_agent(HostPid(forked)).is_err());
    let comms: Vec<String> = std::fs::read_dir(format!("/proc/{forked}/task"))
        .unwrap()
        .map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).unwrap())
        .collect();
    assert!(
        comms.iter().all(|c| c.trim() != "gpusnap-agent"),
        "{comms:?}"
    );
    let sockets = std::fs::read_dir(format!("/proc/{forked}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .filter(|l| {
            let l = l.to_string_lossy();
            l.starts_with("socket:") || l.starts_with("/memfd:gpusnap-agent-door:")
        })
        .count();
    assert_eq!(
        sockets, 0,
        "the child kept the parent's agent door or connection"
    );
    drop(ch);
    // SAFETY: killing our own test processes by pid.
    unsafe { libc::kill(forked, libc::SIGKILL) };
    let _ = parent.kill();
    let _ = parent.wait();
}

/// The campaign's finding (a): twenty idle knocks (connections that never send a request) by
/// anyone with ptrace rights over the job, then the plugin's. The agent lets each idle one give
/// way to the next knock, so the plugin's `Hello` is answered at once (it waited up to 2-5 s
/// per idle knock, past CRIU's timeout), and the idle connections are closed, not kept.
#[test]
fn idle_knocks_do_not_hold_up_the_next_client() {
    let child = EagerChild::start("30");
    drop(child.connect()); // the agent listens
    let idle: Vec<Channel> = (0..20)
        .map(|_| Channel::new(connect_agent(HostPid(child.pid())).unwrap()))
        .collect();
    let t0 = Instant::now();
    let ch = child.connect();
    ch.send_request(
        &AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION,
        }),
        None,
    )
    .unwrap();
    let answer = ch.recv_reply(Some(Duration::from_secs(3)));
    let took = t0.elapsed();
    assert!(
        matches!(answer, Ok(Reply::Hello { .. })),
        "no Hello after 20 idle knocks: {answer:?} in {took:?}"
    );
    assert!(took < Duration::from_secs(1), "answered after {took:?}");
    for (i, c) in idle.iter().enumerate() {
        assert!(
            matches!(
                c.recv_reply(Some(Duration::from_secs(2))),
                Err(ProtoError::Closed)
            ),
            "idle connection {i} was not closed"
        );
    }
    drop(ch);
    child.finish();
}
