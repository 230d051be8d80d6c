//! Every request kind and malformed frames sent to the real agent (`libgpusnap_agent.so` in
//! `fakegpu-vmm` on the stand-in device), in every phase it can be in: idle, inside a dump before
//! `DumpDataDone`, after `DumpDataDone`, inside a restore. The agent answers as the protocol says
//! or refuses with an `Error`; it never crashes (it answers a `Hello` after every case), never
//! releases or overwrites the memory of a running workload (its ticks stay good), and, with the
//! workload held as CRIU holds it, releases and loads it back whole.

mod common;

use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use common::{MORE_TICKS, Vmm, libcuda_dir};
use gpusnap_cuda::agent::{AgentSession, RingShape, Transfer, agent_thread};
use gpusnap_cuda::staging::Staging;
use gpusnap_host::pid::HostPid;
use gpusnap_host::ptrace::{RunningThread, SeizedProcess};
use gpusnap_proto::{
    AgentRequest, CommonRequest, KeeperRequest, MAX_MESSAGE, PROTOCOL_VERSION, Reply,
};

const WAIT: Duration = Duration::from_secs(5);
const SLOT: u64 = 256 << 10;
const SLOTS: u32 = 2;

fn shape() -> RingShape {
    RingShape {
        slot_size: SLOT,
        slots: SLOTS,
        streams: 1,
    }
}

fn start() -> (Vmm, std::path::PathBuf) {
    let dir = common::profile_dir()
        .join("fake-cuda-device-tests")
        .join(format!("agent-protocol-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir work dir");
    let lib = libcuda_dir(&dir);
    let agent = common::built("gpusnap-agent", "libgpusnap_agent.so");
    let env: Vec<(&str, &Path)> = vec![
        ("LD_LIBRARY_PATH", &lib),
        ("LD_PRELOAD", &agent),
        ("GPUSNAP_AGENT_DEBUG", Path::new("1")),
    ];
    let vmm = Vmm::start(
        &dir,
        "vmm",
        1,
        &["--seed", "5", "--allocs", "3", "--mib", "1"],
        &env,
    );
    (vmm, dir)
}

/// Where the agent is when a case's request arrives.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    Idle,
    /// `Ready` and one `ChunkReady` received; that slot is held.
    Dumping,
    AfterDumpDataDone,
}

/// What a case sends.
#[derive(Clone, Debug)]
enum Send {
    Req(AgentRequest, bool),
    /// Raw bytes, a frame the protocol does not allow.
    Frame(&'static str, Vec<u8>),
}

fn encoded(r: &AgentRequest) -> Vec<u8> {
    let mut buf = [0u8; MAX_MESSAGE];
    let n = r.encode(&mut buf);
    buf[..n].to_vec()
}

fn sends() -> Vec<Send> {
    let ring = |slot_size, slots| (slot_size, slots, 1);
    let mut v = vec![Send::Req(
        AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION,
        }),
        false,
    )];
    v.push(Send::Req(AgentRequest::ListAllocations, false));
    // An import this workload does not have: refused in every phase, with or without an fd.
    for with_fd in [false, true] {
        v.push(Send::Req(
            AgentRequest::ShareableSource {
                import: 9,
                exporter_pid: gpusnap_proto::pid::NsPid(1),
                id: 1,
                key: [1; 16],
            },
            with_fd,
        ));
    }
    for with_fd in [false, true] {
        let (slot_size, slots, streams) = ring(SLOT, SLOTS);
        v.push(Send::Req(
            AgentRequest::Common(CommonRequest::DumpBegin {
                slot_size,
                slots,
                streams,
            }),
            with_fd,
        ));
        v.push(Send::Req(
            AgentRequest::Common(CommonRequest::RestoreBegin {
                slot_size,
                slots,
                streams,
            }),
            with_fd,
        ));
        v.push(Send::Req(
            AgentRequest::PreCopyBegin {
                slot_size,
                slots,
                streams,
            },
            with_fd,
        ));
    }
    v.push(Send::Req(
        AgentRequest::Common(CommonRequest::SlotFree { slot: SLOTS + 7 }),
        false,
    ));
    v.push(Send::Req(
        AgentRequest::Common(CommonRequest::SlotFree { slot: 0 }),
        false,
    ));
    v.push(Send::Req(
        AgentRequest::Common(CommonRequest::Release),
        false,
    ));
    v.push(Send::Req(AgentRequest::Common(CommonRequest::Abort), false));
    v.push(Send::Req(
        AgentRequest::Common(CommonRequest::ChunkLoad {
            slot: SLOTS,
            addr: 0x1000,
            len: 16,
            device_hash: None,
        }),
        false,
    ));
    v.push(Send::Req(
        AgentRequest::Common(CommonRequest::ChunkZero {
            addr: 0x1000,
            len: 16,
            device_hash: Some(1),
        }),
        false,
    ));
    v.push(Send::Req(
        AgentRequest::Common(CommonRequest::RestoreDataDone),
        false,
    ));
    v.push(Send::Req(
        AgentRequest::Common(CommonRequest::KnownChunk {
            addr: 0x1000,
            len: 16,
            device_hash: 3,
        }),
        false,
    ));
    v.push(Send::Req(
        AgentRequest::Common(CommonRequest::Hello {
            version: PROTOCOL_VERSION + 1,
        }),
        false,
    ));
    let hello = encoded(&AgentRequest::Common(CommonRequest::Hello {
        version: PROTOCOL_VERSION,
    }));
    v.push(Send::Frame("truncated header", hello[..5].to_vec()));
    v.push(Send::Frame(
        "truncated body",
        encoded(&AgentRequest::Common(CommonRequest::ChunkLoad {
            slot: 0,
            addr: 0,
            len: 1,
            device_hash: None,
        }))[..12]
            .to_vec(),
    ));
    let mut bad_magic = hello.clone();
    bad_magic[0] ^= 0xff;
    v.push(Send::Frame("wrong magic", bad_magic));
    let mut bad_version = hello.clone();
    bad_version[4] = bad_version[4].wrapping_add(9);
    v.push(Send::Frame("wrong frame version", bad_version));
    let mut unknown_kind = hello.clone();
    unknown_kind[6] = 0x7f;
    v.push(Send::Frame("unknown kind", unknown_kind));
    // A keeper's own requests, whole and well formed: no kind the agent takes.
    for r in [
        KeeperRequest::Adopt {
            id: 1,
            device: 0,
            addr: 0x1000,
            size: 4096,
        },
        KeeperRequest::Snapshot {
            share_percent: 50,
            count: 1,
        },
        KeeperRequest::SnapshotIds { ids: vec![1] },
        KeeperRequest::SnapshotRoom {
            device: 0,
            share_percent: 50,
        },
        KeeperRequest::Expect {
            id: 1,
            gpu: [0; 16],
            addr: 0x1000,
            size: 4096,
            rdma_capable: false,
        },
    ] {
        let mut buf = [0u8; MAX_MESSAGE];
        let n = r.encode(&mut buf);
        v.push(Send::Frame("a keeper's request", buf[..n].to_vec()));
    }
    let mut oversize = hello.clone();
    oversize.resize(MAX_MESSAGE + 100, 0xaa);
    v.push(Send::Frame("oversize", oversize));
    v.push(Send::Frame("empty", Vec::new()));
    v
}

/// Brings a fresh connection to `phase`; returns it with the slot it holds (if any).
fn enter(pid: HostPid, ring: &Staging, phase: Phase) -> (AgentSession, Option<u32>) {
    let a = AgentSession::connect_expected(pid, WAIT).expect("connect");
    if phase == Phase::Idle {
        return (a, None);
    }
    a.begin(Transfer::Out, ring.fd().as_fd(), shape())
        .expect("DumpBegin");
    loop {
        match a.recv(WAIT).expect("a reply in the dump") {
            Reply::ChunkReady { slot, .. } if phase == Phase::Dumping => return (a, Some(slot)),
            Reply::ChunkReady { slot, .. } => a.slot_free(slot).expect("SlotFree"),
            Reply::ChunkZero { .. } => {}
            Reply::DumpDataDone { .. } => return (a, None),
            other => panic!("in the dump: {other:?}"),
        }
    }
}

fn send(a: &AgentSession, s: &Send, ring: &Staging, held: Option<u32>) {
    let fd = a.channel().fd().as_raw_fd();
    match s {
        Send::Req(r, with_fd) => {
            // A good SlotFree frees the slot the plugin holds.
            let r = match (r, held) {
                (AgentRequest::Common(CommonRequest::SlotFree { slot: 0 }), Some(h)) => {
                    AgentRequest::Common(CommonRequest::SlotFree { slot: h })
                }
                _ => r.clone(),
            };
            let attach = with_fd.then(|| ring.fd().as_fd());
            a.channel().send_request(&r, attach).expect("send");
        }
        Send::Frame(_, bytes) => {
            // SAFETY: sends `bytes` on the connected socket.
            let n =
                unsafe { libc::send(fd, bytes.as_ptr().cast(), bytes.len(), libc::MSG_NOSIGNAL) };
            assert_eq!(n, bytes.len() as isize, "send the frame");
        }
    }
}

/// Every reply the agent sends within a short wait (until it closes or goes quiet).
fn replies(a: &AgentSession) -> (Vec<Reply>, bool) {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        match a.channel().recv_reply(Some(Duration::from_millis(300))) {
            Ok(r) => got.push(r),
            Err(gpusnap_proto::ProtoError::Timeout) => return (got, false),
            Err(gpusnap_proto::ProtoError::Interrupted) => {}
            Err(_) => return (got, true),
        }
    }
    (got, false)
}

fn is_error(r: &Reply) -> bool {
    matches!(r, Reply::Error { .. })
}

/// Whether `got` is what the protocol allows for `s` in `phase` with the workload running.
fn allowed(phase: Phase, s: &Send, got: &[Reply], closed: bool) -> Result<(), String> {
    // A zero-length record reads as the peer's close: the agent closes too.
    if matches!(s, Send::Frame("empty", _))
        && got.iter().all(|r| matches!(r, Reply::ChunkReady { .. }))
        && closed
    {
        return Ok(());
    }
    // Before a dump, a parent's chunk is taken in silence (it changes nothing by itself).
    if let (Phase::Idle, Send::Req(AgentRequest::Common(CommonRequest::KnownChunk { .. }), false)) =
        (phase, s)
    {
        return if got.is_empty() && !closed {
            Ok(())
        } else {
            Err(format!("KnownChunk before a dump: {got:?} closed {closed}"))
        };
    }
    // While data is copied out, the agent may announce the chunk in the other slot first.
    let skip = if phase == Phase::Dumping {
        got.iter()
            .take_while(|r| matches!(r, Reply::ChunkReady { .. }))
            .count()
            .min(1)
    } else {
        0
    };
    let first = got.get(skip).ok_or("no answer at all")?;
    if got.iter().any(|r| {
        matches!(
            r,
            Reply::Released { .. } | Reply::Restored { .. } | Reply::SlotFree { .. }
        )
    }) {
        return Err("released or loaded memory of a running workload".into());
    }
    let ok = match (phase, s) {
        (_, Send::Frame(..)) => is_error(first),
        (Phase::Idle, Send::Req(AgentRequest::Common(CommonRequest::Hello { version }), _)) => {
            if *version == PROTOCOL_VERSION {
                matches!(first, Reply::Hello { .. })
            } else {
                is_error(first)
            }
        }
        (Phase::Idle, Send::Req(AgentRequest::ListAllocations, _)) => {
            matches!(first, Reply::Allocation { .. })
                && matches!(got.last(), Some(Reply::AllocationsEnd { .. }))
        }
        (Phase::Idle, Send::Req(AgentRequest::Common(CommonRequest::Abort), _)) => {
            matches!(first, Reply::Aborted)
        }
        // A whole copy out is harmless, and so is a pre-copy round (it copies while the
        // workload runs, and never releases).
        (
            Phase::Idle,
            Send::Req(
                AgentRequest::Common(CommonRequest::DumpBegin { .. })
                | AgentRequest::PreCopyBegin { .. },
                true,
            ),
        ) => matches!(first, Reply::Ready),
        // Good SlotFree in a dump: the copy goes on.
        (
            Phase::Dumping,
            Send::Req(AgentRequest::Common(CommonRequest::SlotFree { slot: 0 }), false),
        ) => {
            got.iter().all(|r| {
                matches!(
                    r,
                    Reply::ChunkReady { .. } | Reply::DumpDataDone { .. } | Reply::Error { .. }
                )
            }) && !is_error(first)
        }
        (
            Phase::Dumping | Phase::AfterDumpDataDone,
            Send::Req(AgentRequest::Common(CommonRequest::Abort), _),
        ) => {
            matches!(first, Reply::Aborted)
        }
        _ => is_error(first),
    };
    if ok { Ok(()) } else { Err(format!("{got:?}")) }
}

fn assert_alive_and_whole(vmm: &Vmm, pid: HostPid, state: &str) {
    let a = AgentSession::connect_expected(pid, WAIT)
        .unwrap_or_else(|e| panic!("{state}: connect after the case: {e}\n{}", vmm.describe()));
    let h = a
        .hello()
        .unwrap_or_else(|e| panic!("{state}: no Hello after the case: {e}\n{}", vmm.describe()));
    assert!(!h.released, "{state}: the agent says released: {h:?}");
}

fn hold(pid: HostPid) -> (SeizedProcess, RunningThread) {
    let tid = agent_thread(pid).expect("a gpusnap-agent thread");
    let seized = SeizedProcess::seize(pid).expect("seize");
    let agent = RunningThread::resume(tid).expect("resume the agent thread");
    (seized, agent)
}

/// Every request kind and malformed frame in every phase, with the workload running; then the
/// workload held, and a release, refused loads and a whole load back.
#[test]
fn the_agent_answers_or_refuses_every_request_in_every_phase() {
    let started = Instant::now();
    let (vmm, _dir) = start();
    let pid = HostPid(vmm.pid());
    let ring = Staging::new(SLOT as usize, SLOTS as usize).expect("ring");
    let mut failures = Vec::new();
    let mut cases = 0;
    for phase in [Phase::Idle, Phase::Dumping, Phase::AfterDumpDataDone] {
        for s in sends() {
            let state = format!("{phase:?}: {s:?}");
            let state = &state[..state.len().min(160)];
            let (a, held) = enter(pid, &ring, phase);
            send(&a, &s, &ring, held);
            let (got, closed) = replies(&a);
            if let Err(e) = allowed(phase, &s, &got, closed) {
                failures.push(format!("{state}: {e}"));
            }
            // End whatever operation is still open.
            let _ = a.abort();
            drop(a);
            assert_alive_and_whole(&vmm, pid, state);
            cases += 1;
        }
    }
    // The workload ran through it all, its memory never released nor overwritten.
    let last = vmm.last_ticks();
    let logs = vmm.wait_for_tick(last[0] + MORE_TICKS);
    logs[0]
        .check()
        .unwrap_or_else(|e| panic!("the workload noticed: {e}\n{}", vmm.describe()));
    assert!(
        failures.is_empty(),
        "{} of {cases} cases went wrong:\n{}",
        failures.len(),
        failures.join("\n")
    );

    // Held as by CRIU: a dump that keeps every chunk, a release, then a restore phase.
    let held = hold(pid);
    let a = AgentSession::connect_expected(pid, WAIT).expect("connect");
    a.begin(Transfer::Out, ring.fd().as_fd(), shape())
        .expect("DumpBegin");
    // (addr, bytes, device hash); zero chunks in `zeros` as (addr, len, device hash).
    let mut saved: Vec<(u64, Vec<u8>, Option<u64>)> = Vec::new();
    let mut zeros: Vec<(u64, u64, u64)> = Vec::new();
    loop {
        match a.recv(WAIT).expect("a reply in the dump") {
            Reply::ChunkReady {
                slot,
                addr,
                len,
                device_hash,
                ..
            } => {
                // SAFETY: the slot is ours until SlotFree.
                let bytes = unsafe { ring.slot(slot as usize, len as usize) }.to_vec();
                assert_eq!(
                    device_hash,
                    gpusnap_proto::devhash::device_hash(&bytes),
                    "the device hash of the chunk at {addr:#x} is not the hash of its bytes"
                );
                saved.push((addr, bytes, device_hash));
                a.slot_free(slot).expect("SlotFree");
            }
            Reply::ChunkZero {
                addr,
                len,
                device_hash,
                ..
            } => {
                assert_eq!(Some(device_hash), gpusnap_proto::devhash::zero_hash(len));
                zeros.push((addr, len, device_hash));
            }
            Reply::DumpDataDone { .. } => break,
            other => panic!("in the held dump: {other:?}"),
        }
    }
    assert!(
        !saved.is_empty() && !zeros.is_empty(),
        "the workload has written and unwritten memory: {} chunks, {} zero",
        saved.len(),
        zeros.len()
    );
    let (count, bytes) = a.release().expect("Release of a held workload");
    assert!(
        count > 0 && bytes > 0,
        "released {count} allocations, {bytes} bytes"
    );
    let (addr0, _, _) = saved[0];
    let bad_loads = [
        ("a slot out of range", SLOTS, addr0, 16),
        ("a length of 0", 0, addr0, 0),
        ("a length over the slot", 0, addr0, SLOT + 1),
        ("an address in no allocation", 0, 0x1000, 16),
        ("a range past its allocation", 0, addr0 + (1 << 40), 16),
    ];
    for (what, slot, addr, len) in bad_loads {
        let a = AgentSession::connect_expected(pid, WAIT).expect("connect");
        a.begin(Transfer::In, ring.fd().as_fd(), shape())
            .expect("RestoreBegin of a held, released workload");
        a.chunk_load(slot, addr, len, None).expect("send ChunkLoad");
        let (got, _) = replies(&a);
        assert!(
            got.first().is_some_and(is_error),
            "ChunkLoad with {what}: {got:?}"
        );
        let h = AgentSession::connect_expected(pid, WAIT)
            .expect("connect")
            .hello()
            .expect("Hello after a refused load");
        assert!(
            h.released,
            "after a refused load the memory is still to be loaded"
        );
    }
    // A zero fill outside every allocation is refused too.
    let a = AgentSession::connect_expected(pid, WAIT).expect("connect");
    a.begin(Transfer::In, ring.fd().as_fd(), shape())
        .expect("RestoreBegin");
    a.chunk_zero(0x1000, 16, None).expect("send ChunkZero");
    let (got, _) = replies(&a);
    assert!(
        got.first().is_some_and(is_error),
        "ChunkZero outside: {got:?}"
    );
    // Data that does not match its device hash: the load ends in an Error naming the chunk,
    // and the memory still counts as released.
    let a = AgentSession::connect_expected(pid, WAIT).expect("connect");
    a.begin(Transfer::In, ring.fd().as_fd(), shape())
        .expect("RestoreBegin");
    let (first, data, hash) = &saved[0];
    // SAFETY: slot 0 is ours: nothing was loaded on this connection yet.
    unsafe { ring.slot_mut(0, data.len()) }.copy_from_slice(data);
    let wrong = hash.map(|h| h ^ 1);
    a.chunk_load(0, *first, data.len() as u64, wrong)
        .expect("ChunkLoad");
    a.channel()
        .send_request(&AgentRequest::Common(CommonRequest::RestoreDataDone), None)
        .expect("RestoreDataDone");
    let (got, _) = replies(&a);
    assert!(
        got.iter().any(
            |r| matches!(r, Reply::Error { message, .. } if message.contains(&format!("{first:#x}")))
        ),
        "a load whose device hash differs: {got:?}"
    );
    let h = AgentSession::connect_expected(pid, WAIT)
        .expect("connect")
        .hello()
        .expect("Hello after a mismatch");
    assert!(
        h.released,
        "after a mismatch the memory is still to be loaded"
    );
    // Inside a restore, a request of another phase ends it with an Error.
    for r in [
        AgentRequest::Common(CommonRequest::Release),
        AgentRequest::ListAllocations,
    ] {
        let a = AgentSession::connect_expected(pid, WAIT).expect("connect");
        a.begin(Transfer::In, ring.fd().as_fd(), shape())
            .expect("RestoreBegin");
        a.channel().send_request(&r, None).expect("send");
        let (got, _) = replies(&a);
        assert!(
            got.first().is_some_and(is_error),
            "{r:?} in a restore: {got:?}"
        );
    }
    // The whole load back.
    let a = AgentSession::connect_expected(pid, WAIT).expect("connect");
    a.begin(Transfer::In, ring.fd().as_fd(), shape())
        .expect("RestoreBegin");
    let mut free: Vec<u32> = (0..SLOTS).collect();
    for (addr, len, hash) in &zeros {
        a.chunk_zero(*addr, *len, Some(*hash)).expect("ChunkZero");
    }
    for (addr, bytes, hash) in &saved {
        while free.is_empty() {
            match a.recv(WAIT).expect("SlotFree") {
                Reply::SlotFree { slot } => free.push(slot),
                other => panic!("in the load: {other:?}"),
            }
        }
        let slot = free.pop().unwrap();
        // SAFETY: the slot is ours (free) until ChunkLoad.
        unsafe { ring.slot_mut(slot as usize, bytes.len()) }.copy_from_slice(bytes);
        a.chunk_load(slot, *addr, bytes.len() as u64, *hash)
            .expect("ChunkLoad");
    }
    a.channel()
        .send_request(&AgentRequest::Common(CommonRequest::RestoreDataDone), None)
        .expect("RestoreDataDone");
    loop {
        match a.recv(WAIT).expect("Restored") {
            Reply::SlotFree { .. } => {}
            Reply::Restored {
                bytes: b, verified, ..
            } => {
                let zero_bytes: u64 = zeros.iter().map(|z| z.1).sum();
                assert_eq!(b + zero_bytes, bytes, "loaded back what was released");
                assert_eq!(
                    verified as usize,
                    saved.len() + zeros.len(),
                    "every chunk checked on the device"
                );
                break;
            }
            other => panic!("after RestoreDataDone: {other:?}"),
        }
    }
    drop(a);
    // The agent's thread stopped again first, then every thread let go (as CRIU ends).
    let (seized, agent_thread_running) = held;
    drop(agent_thread_running);
    drop(seized);
    assert_alive_and_whole(&vmm, pid, "after the whole load");
    let last = vmm.last_ticks();
    let logs = vmm.wait_for_tick(last[0] + MORE_TICKS);
    logs[0].check().unwrap_or_else(|e| {
        panic!(
            "the workload noticed after the load: {e}\n{}",
            vmm.describe()
        )
    });
    eprintln!(
        "{cases} cases in 3 phases, {} refused loads, in {:?}",
        5,
        started.elapsed()
    );
}
