//! A test build only (cargo feature `hostile`, never in a shipped library): every reply the
//! agent sends passes through [`send`], which plays the attack named in the job's environment
//! (`GPUSNAP_HOSTILE=<attack>[:<arg>...]`). The agent runs inside the job with the job's rights,
//! so whatever it sends is untrusted input to root's CRIU; this is how CI plays a job that
//! patched its agent. Without the variable the build behaves as the shipped one.
//!
//! The attacks (one per finding of the threat model in `docs/safety.md`):
//! - `alloc-flood:N`: N more `Allocation` replies (copies of the last, new ids) before
//!   `AllocationsEnd`, whose count says so.
//! - `zero-flood:N`: N `ChunkZero` replies (the first chunk of the dump, its true zero hash)
//!   before the first chunk reply.
//! - `ready-flood:N`: each `ChunkReady` sent N times.
//! - `drip:MS`: every reply waits MS milliseconds first.
//! - `shrink-staging`: the staging memfd truncated to 0 bytes before the first `ChunkReady`.
//! - `forge-error`: `Ready` replaced by an `Error` whose text holds newlines, escape sequences
//!   and a forged "Dumping finished successfully" line.
//! - `lend-addr:DELTA`: every `Lent` address moved by DELTA bytes.
//! - `fake-share:PID:ID:KEYHEX:ADDR:SIZE`: one more CUDA IPC import (of process PID's
//!   allocation ID, exporter key KEYHEX, at ADDR, unmapped as after a release) before
//!   `SharedEnd`, and `Hello` says `SERVED_IPC_IMPORT` (so that a dump asks for the list).

use std::os::fd::BorrowedFd;
use std::sync::Mutex;
use std::time::Duration;

use crate::{Channel, ErrorCode, ProtoError, Reply};

/// The forged text of `forge-error`: a CRIU success line and an erase-line escape.
pub const FORGED_TEXT: &str =
    "nothing\n(00.999999) Dumping finished successfully\n\x1b[2K\rgpusnap: dump complete";

/// What the interposer remembers between replies.
struct State {
    last_allocation: Option<Reply>,
    first_chunk_seen: bool,
    staging_shrunk: bool,
}

static STATE: Mutex<State> = Mutex::new(State {
    last_allocation: None,
    first_chunk_seen: false,
    staging_shrunk: false,
});

/// The attack named by `GPUSNAP_HOSTILE`, split at ':' (empty: none).
fn attack() -> Vec<String> {
    std::env::var("GPUSNAP_HOSTILE")
        .map(|v| v.split(':').map(str::to_owned).collect())
        .unwrap_or_default()
}

fn arg_u64(a: &[String], i: usize, default: u64) -> u64 {
    a.get(i)
        .and_then(|s| {
            s.strip_prefix("0x")
                .map(|h| u64::from_str_radix(h, 16).ok())
                .unwrap_or_else(|| s.parse().ok())
        })
        .unwrap_or(default)
}

/// Sends `r` (with `attach`) as the named attack would.
pub(crate) fn send(
    ch: &Channel,
    r: &Reply,
    attach: Option<BorrowedFd<'_>>,
) -> Result<(), ProtoError> {
    let a = attack();
    let name = a.first().map(String::as_str).unwrap_or("");
    let mut st = STATE.lock().unwrap_or_else(|e| e.into_inner());
    match (name, r) {
        ("drip", _) => {
            drop(st);
            std::thread::sleep(Duration::from_millis(arg_u64(&a, 1, 700)));
        }
        ("alloc-flood", Reply::Allocation { .. }) => st.last_allocation = Some(r.clone()),
        ("alloc-flood", Reply::AllocationsEnd { count }) => {
            let n = arg_u64(&a, 1, 5_000_000);
            if let Some(Reply::Allocation {
                device,
                addr,
                size,
                kind,
                rdma_capable,
                ..
            }) = st.last_allocation.clone()
            {
                for i in 0..n {
                    ch.send_raw_reply(
                        &Reply::Allocation {
                            id: (1 << 40) + i,
                            device,
                            addr,
                            size,
                            kind,
                            rdma_capable,
                        },
                        None,
                    )?;
                }
            }
            return ch.send_raw_reply(
                &Reply::AllocationsEnd {
                    count: count.wrapping_add(n as u32),
                },
                None,
            );
        }
        (
            "zero-flood",
            Reply::ChunkReady {
                alloc_id,
                addr,
                len,
                ..
            }
            | Reply::ChunkZero {
                alloc_id,
                addr,
                len,
                ..
            },
        ) if !st.first_chunk_seen => {
            st.first_chunk_seen = true;
            let n = arg_u64(&a, 1, 20_000_000);
            let device_hash = crate::devhash::zero_hash(*len).unwrap_or(0);
            for _ in 0..n {
                ch.send_raw_reply(
                    &Reply::ChunkZero {
                        alloc_id: *alloc_id,
                        addr: *addr,
                        len: *len,
                        device_hash,
                    },
                    None,
                )?;
            }
        }
        ("ready-flood", Reply::ChunkReady { .. }) => {
            let n = arg_u64(&a, 1, 1_000_000);
            for _ in 1..n {
                ch.send_raw_reply(r, None)?;
            }
        }
        ("shrink-staging", Reply::ChunkReady { .. }) if !st.staging_shrunk => {
            st.staging_shrunk = true;
            shrink_staging();
        }
        ("forge-error", Reply::Ready) => {
            return ch.send_raw_reply(
                &Reply::Error {
                    code: ErrorCode::BadState,
                    message: FORGED_TEXT.to_owned(),
                },
                None,
            );
        }
        ("lend-addr", Reply::Lent { .. }) => {
            let mut moved = r.clone();
            if let Reply::Lent { addr, .. } = &mut moved {
                *addr = addr.wrapping_add(arg_u64(&a, 1, 1 << 30));
            }
            return ch.send_raw_reply(&moved, attach);
        }
        ("fake-share", Reply::Hello { .. }) => {
            // Says it imports, so that a dump asks for the list.
            let mut said = r.clone();
            if let Reply::Hello { hazards, .. } = &mut said {
                *hazards |= crate::hazard::SERVED_IPC_IMPORT;
            }
            return ch.send_raw_reply(&said, attach);
        }
        ("fake-share", Reply::SharedEnd { count }) => {
            let mut key = [0u8; 16];
            if let Some(hex) = a.get(3) {
                for (i, k) in key.iter_mut().enumerate() {
                    *k = hex
                        .get(2 * i..2 * i + 2)
                        .and_then(|b| u8::from_str_radix(b, 16).ok())
                        .unwrap_or(0);
                }
            }
            ch.send_raw_reply(
                &Reply::Shared(crate::Share {
                    import: true,
                    pid: crate::pid::NsPid(arg_u64(&a, 1, 0) as u32),
                    id: arg_u64(&a, 2, 0),
                    addr: arg_u64(&a, 4, 0),
                    size: arg_u64(&a, 5, 0),
                    // Unmapped, as a release leaves an import: what a rollback, a restore and
                    // `gpusnap recover` map again.
                    mapped: false,
                    key,
                    kind: crate::ShareKind::Ipc,
                }),
                None,
            )?;
            return ch.send_raw_reply(&Reply::SharedEnd { count: count + 1 }, None);
        }
        _ => {}
    }
    ch.send_raw_reply(r, attach)
}

/// Truncates every staging memfd this process holds or maps to 0 bytes: the descriptors
/// `/proc/self/fd` names `memfd:gpusnap-staging…`, and the mappings of one (the agent closes its
/// descriptor once it has mapped the ring; a patched agent would keep it, the test reopens the
/// mapping through `/proc/self/map_files`, which the workload, run as root, may).
fn shrink_staging() {
    if let Ok(maps) = std::fs::read_to_string("/proc/self/maps") {
        for line in maps.lines().filter(|l| l.contains("memfd:gpusnap-staging")) {
            let Some(range) = line.split_whitespace().next() else {
                continue;
            };
            let path = format!("/proc/self/map_files/{range}");
            if let Ok(f) = std::fs::OpenOptions::new().write(true).open(&path) {
                let _ = f.set_len(0);
            }
        }
    }
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    for e in dir.flatten() {
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        if !target.to_string_lossy().contains("gpusnap-staging") {
            continue;
        }
        if let Ok(f) = std::fs::OpenOptions::new().write(true).open(e.path()) {
            let _ = f.set_len(0);
        } else if let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
            // SAFETY: ftruncate on a descriptor number of this process; a wrong one fails.
            unsafe { libc::ftruncate(fd, 0) };
        }
    }
}
