//! A minimal stand-in for the plugin's side of the protocol, for trying the agent on a GPU
//! machine without CRIU: dump every converted allocation into memory through a memfd ring,
//! release, then restore and reload it, timing each step.
//!
//! Usage: `agent_client <pid> <mode> [slot_MiB] [slots] [streams]`, mode one of
//! `hello`, `list`, `dump` (dump + release, data to `$GPUSNAP_CLIENT_FILE`, default
//! `/dev/shm/gpusnap-client.bin`), `restore` (re-create + reload from that file), `cycle`
//! (dump, release, restore in memory), `abort` (dump, abort midway: memory must stay mapped),
//! `bench` (the agent's own pace: no copying on this side; leaves garbage in device memory),
//! `driver-ckpt` / `driver-restore` (the driver's `cuCheckpointProcess{Lock,Checkpoint}` /
//! `{Restore,Unlock}` on the pid, as the plugin does around the agent's work).

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use gpusnap_proto::{Channel, PROTOCOL_VERSION, ProtoError, Reply, Request, connect_agent};

const WAIT: Option<Duration> = Some(Duration::from_secs(120));

type Res<T> = Result<T, String>;

fn connect(pid: i32) -> Res<Channel> {
    connect_agent(pid)
        .map(Channel::new)
        .map_err(|e| format!("connect to agent of {pid}: {e}"))
}

fn recv(ch: &Channel) -> Res<Reply> {
    ch.recv_reply(WAIT).map_err(|e| format!("recv: {e}"))
}

fn send(ch: &Channel, r: &Request, fd: Option<std::os::fd::BorrowedFd<'_>>) -> Res<()> {
    ch.send_request(r, fd)
        .map_err(|e| format!("send {r:?}: {e}"))
}

struct Ring {
    fd: OwnedFd,
    ptr: *mut u8,
    slot: usize,
    slots: u32,
}

impl Ring {
    fn new(slot: usize, slots: u32) -> Res<Ring> {
        let len = slot * slots as usize;
        // SAFETY: valid name and flags.
        let raw = unsafe { libc::memfd_create(c"gpusnap-client-ring".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err("memfd_create failed".into());
        }
        // SAFETY: fresh descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: fd is open.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as i64) } != 0 {
            return Err("ftruncate failed".into());
        }
        // SAFETY: shared mapping of the whole file.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err("mmap failed".into());
        }
        Ok(Ring {
            fd,
            ptr: ptr.cast(),
            slot,
            slots,
        })
    }

    fn slot_ptr(&self, s: u32, len: usize) -> *mut u8 {
        assert!(s < self.slots && len <= self.slot);
        self.ptr.wrapping_add(s as usize * self.slot)
    }

    fn read_slot(&self, s: u32, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        // SAFETY: inside our mapping; the agent does not write this slot while we hold it.
        unsafe { std::ptr::copy_nonoverlapping(self.slot_ptr(s, len), v.as_mut_ptr(), len) };
        v
    }

    fn write_slot(&self, s: u32, data: &[u8]) {
        // SAFETY: inside our mapping; the agent does not read this slot until ChunkLoad.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.slot_ptr(s, data.len()), data.len())
        };
    }
}

fn hello(ch: &Channel) -> Res<Reply> {
    send(
        ch,
        &Request::Hello {
            version: PROTOCOL_VERSION,
        },
        None,
    )?;
    let r = recv(ch)?;
    println!("hello: {r:?}");
    Ok(r)
}

fn list(ch: &Channel) -> Res<()> {
    send(ch, &Request::ListAllocations, None)?;
    loop {
        match recv(ch)? {
            Reply::Allocation {
                id,
                device,
                addr,
                size,
                kind,
            } => {
                println!("  #{id} dev {device} {addr:#x} {size} bytes {kind:?}")
            }
            Reply::AllocationsEnd { count } => {
                println!("  {count} allocations");
                return Ok(());
            }
            other => return Err(format!("list: {other:?}")),
        }
    }
}

fn expect_closed(ch: &Channel) -> Res<()> {
    match ch.recv_reply(WAIT) {
        Err(ProtoError::Closed) => Ok(()),
        other => Err(format!("expected the agent to close, got {other:?}")),
    }
}

/// Dumps into memory; with `abort_after` = Some(n) aborts after n chunks.
fn dump(
    pid: i32,
    ring: &Ring,
    streams: u32,
    abort_after: Option<usize>,
) -> Res<Vec<(u64, Vec<u8>)>> {
    let ch = connect(pid)?;
    hello(&ch)?;
    list(&ch)?;
    let t0 = Instant::now();
    send(
        &ch,
        &Request::DumpBegin {
            slot_size: ring.slot as u64,
            slots: ring.slots,
            streams,
        },
        Some(ring.fd.as_fd()),
    )?;
    match recv(&ch)? {
        Reply::Ready => println!("dump: ready after {:?}", t0.elapsed()),
        other => return Err(format!("DumpBegin: {other:?}")),
    }
    let mut saved = Vec::new();
    loop {
        match recv(&ch)? {
            Reply::ChunkReady {
                slot,
                alloc_id: _,
                addr,
                len,
            } => {
                saved.push((addr, ring.read_slot(slot, len as usize)));
                if abort_after.is_some_and(|n| saved.len() >= n) {
                    send(&ch, &Request::Abort, None)?;
                    loop {
                        match recv(&ch)? {
                            Reply::Aborted => break,
                            Reply::ChunkReady { .. } => {}
                            other => return Err(format!("after Abort: {other:?}")),
                        }
                    }
                    expect_closed(&ch)?;
                    println!("dump: aborted after {} chunks", saved.len());
                    return Ok(saved);
                }
                send(&ch, &Request::SlotFree { slot }, None)?;
            }
            Reply::DumpDataDone {
                chunks,
                bytes,
                micros,
            } => {
                let s = t0.elapsed().as_secs_f64();
                println!(
                    "dump: {chunks} chunks, {bytes} bytes, agent {micros} us, client {s:.3} s = {:.2} GB/s",
                    bytes as f64 / s / 1e9
                );
                break;
            }
            other => return Err(format!("dump: {other:?}")),
        }
    }
    send(&ch, &Request::Release, None)?;
    match recv(&ch)? {
        Reply::Released {
            allocations,
            bytes,
            micros,
        } => {
            println!("release: {allocations} allocations, {bytes} bytes, {micros} us")
        }
        other => return Err(format!("Release: {other:?}")),
    }
    expect_closed(&ch)?;
    Ok(saved)
}

/// A slot the agent has given back (restore): queued `SlotFree`s first, else wait for one.
fn free_slot(ch: &Channel, free: &mut VecDeque<u32>) -> Res<u32> {
    while let Some(r) = ch.try_recv_reply().map_err(|e| e.to_string())? {
        match r {
            Reply::SlotFree { slot } => free.push_back(slot),
            other => return Err(format!("restore: {other:?}")),
        }
    }
    loop {
        if let Some(s) = free.pop_front() {
            return Ok(s);
        }
        match recv(ch)? {
            Reply::SlotFree { slot } => free.push_back(slot),
            other => return Err(format!("restore: {other:?}")),
        }
    }
}

fn restore(pid: i32, ring: &Ring, streams: u32, saved: &[(u64, Vec<u8>)]) -> Res<()> {
    let ch = connect(pid)?;
    match hello(&ch)? {
        Reply::Hello { released: true, .. } => {}
        other => println!("note: hello before restore says {other:?}"),
    }
    let t0 = Instant::now();
    send(
        &ch,
        &Request::RestoreBegin {
            slot_size: ring.slot as u64,
            slots: ring.slots,
            streams,
        },
        Some(ring.fd.as_fd()),
    )?;
    match recv(&ch)? {
        Reply::Ready => println!(
            "restore: ready (memory re-created) after {:?}",
            t0.elapsed()
        ),
        other => return Err(format!("RestoreBegin: {other:?}")),
    }
    let mut free: VecDeque<u32> = (0..ring.slots).collect();
    let mut bytes = 0u64;
    for (addr, data) in saved {
        let slot = free_slot(&ch, &mut free)?;
        ring.write_slot(slot, data);
        send(
            &ch,
            &Request::ChunkLoad {
                slot,
                addr: *addr,
                len: data.len() as u64,
            },
            None,
        )?;
        bytes += data.len() as u64;
    }
    send(&ch, &Request::RestoreDataDone, None)?;
    loop {
        match recv(&ch)? {
            Reply::SlotFree { .. } => {}
            Reply::Restored { bytes: b, micros } => {
                let s = t0.elapsed().as_secs_f64();
                println!(
                    "restore: {b} bytes (sent {bytes}), agent {micros} us, client {s:.3} s = {:.2} GB/s",
                    b as f64 / s / 1e9
                );
                break;
            }
            other => return Err(format!("restore end: {other:?}")),
        }
    }
    expect_closed(&ch)?;
    let ch = connect(pid)?;
    hello(&ch)?;
    Ok(())
}

fn data_file() -> String {
    std::env::var("GPUSNAP_CLIENT_FILE").unwrap_or_else(|_| "/dev/shm/gpusnap-client.bin".into())
}

fn save(saved: &[(u64, Vec<u8>)]) -> Res<()> {
    let t0 = Instant::now();
    let mut f =
        std::io::BufWriter::new(std::fs::File::create(data_file()).map_err(|e| e.to_string())?);
    for (addr, data) in saved {
        f.write_all(&addr.to_le_bytes())
            .map_err(|e| e.to_string())?;
        f.write_all(&(data.len() as u64).to_le_bytes())
            .map_err(|e| e.to_string())?;
        f.write_all(data).map_err(|e| e.to_string())?;
    }
    f.flush().map_err(|e| e.to_string())?;
    println!(
        "saved {} chunks to {} in {:?}",
        saved.len(),
        data_file(),
        t0.elapsed()
    );
    Ok(())
}

fn load() -> Res<Vec<(u64, Vec<u8>)>> {
    let file = std::fs::File::open(data_file()).map_err(|e| e.to_string())?;
    let mut f = std::io::BufReader::new(file);
    let mut out = Vec::new();
    let mut h = [0u8; 16];
    loop {
        match f.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(out),
            Err(e) => return Err(e.to_string()),
        }
        let addr = u64::from_le_bytes(h[..8].try_into().unwrap());
        let len = u64::from_le_bytes(h[8..].try_into().unwrap()) as usize;
        let mut d = vec![0u8; len];
        f.read_exact(&mut d)
            .map_err(|e| format!("truncated data file: {e}"))?;
        out.push((addr, d));
    }
}

/// The agent's own pace: a dump whose slots are freed at once (no copy on this side), then a
/// restore of the same chunks from whatever the ring holds (the data is garbage afterwards:
/// the application must rewrite it).
fn bench(pid: i32, ring: &Ring, streams: u32) -> Res<()> {
    let ch = connect(pid)?;
    send(
        &ch,
        &Request::DumpBegin {
            slot_size: ring.slot as u64,
            slots: ring.slots,
            streams,
        },
        Some(ring.fd.as_fd()),
    )?;
    let t0 = Instant::now();
    match recv(&ch)? {
        Reply::Ready => {}
        other => return Err(format!("DumpBegin: {other:?}")),
    }
    let t1 = Instant::now();
    let mut chunks = Vec::new();
    let total = loop {
        match recv(&ch)? {
            Reply::ChunkReady {
                slot, addr, len, ..
            } => {
                send(&ch, &Request::SlotFree { slot }, None)?;
                chunks.push((addr, len));
            }
            Reply::DumpDataDone { bytes, .. } => break bytes,
            other => return Err(format!("bench dump: {other:?}")),
        }
    };
    let s = t1.elapsed().as_secs_f64();
    println!(
        "bench dump: setup {:?}, {total} bytes in {s:.3} s = {:.1} GB/s",
        t1 - t0,
        total as f64 / s / 1e9
    );
    send(&ch, &Request::Release, None)?;
    let r = recv(&ch)?;
    println!("bench release: {r:?}");
    expect_closed(&ch)?;

    let ch = connect(pid)?;
    send(
        &ch,
        &Request::RestoreBegin {
            slot_size: ring.slot as u64,
            slots: ring.slots,
            streams,
        },
        Some(ring.fd.as_fd()),
    )?;
    let t0 = Instant::now();
    match recv(&ch)? {
        Reply::Ready => {}
        other => return Err(format!("RestoreBegin: {other:?}")),
    }
    let t1 = Instant::now();
    let mut free: VecDeque<u32> = (0..ring.slots).collect();
    for (addr, len) in chunks {
        let slot = free_slot(&ch, &mut free)?;
        send(&ch, &Request::ChunkLoad { slot, addr, len }, None)?;
    }
    send(&ch, &Request::RestoreDataDone, None)?;
    loop {
        match recv(&ch)? {
            Reply::SlotFree { .. } => {}
            Reply::Restored { bytes, .. } => {
                let s = t1.elapsed().as_secs_f64();
                println!(
                    "bench restore: setup (re-create + pin) {:?}, {bytes} bytes in {s:.3} s = {:.1} GB/s",
                    t1 - t0,
                    bytes as f64 / s / 1e9
                );
                break;
            }
            other => return Err(format!("bench restore end: {other:?}")),
        }
    }
    expect_closed(&ch)
}

/// Calls the named `CUresult f(int pid, void *args)` driver functions in order, args NULL.
fn driver(pid: i32, calls: &[&str]) -> Res<()> {
    // SAFETY: plain dlopen/dlsym of libcuda in this (non-preloaded) client process.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
    if h.is_null() {
        return Err("libcuda.so.1 not found".into());
    }
    let sym = |name: &str| -> Res<*mut libc::c_void> {
        let c = std::ffi::CString::new(name).unwrap();
        // SAFETY: h is a live handle, c a C string.
        let p = unsafe { libc::dlsym(h, c.as_ptr()) };
        if p.is_null() {
            Err(format!("{name} not in libcuda"))
        } else {
            Ok(p)
        }
    };
    // SAFETY: cuInit(unsigned) -> CUresult.
    let init: extern "C" fn(u32) -> u32 = unsafe { std::mem::transmute(sym("cuInit")?) };
    let rc = init(0);
    if rc != 0 {
        return Err(format!("cuInit: {rc}"));
    }
    for name in calls {
        // SAFETY: the cuCheckpointProcess* functions are CUresult f(int pid, T *args).
        let f: extern "C" fn(i32, *mut libc::c_void) -> u32 =
            unsafe { std::mem::transmute(sym(name)?) };
        let t0 = Instant::now();
        let rc = f(pid, std::ptr::null_mut());
        println!("{name}({pid}) = {rc} in {:?}", t0.elapsed());
        if rc != 0 {
            if *name == "cuCheckpointProcessCheckpoint" {
                // Do not leave the process locked behind a failed checkpoint.
                // SAFETY: as above.
                let unlock: extern "C" fn(i32, *mut libc::c_void) -> u32 =
                    unsafe { std::mem::transmute(sym("cuCheckpointProcessUnlock")?) };
                println!(
                    "cuCheckpointProcessUnlock({pid}) = {}",
                    unlock(pid, std::ptr::null_mut())
                );
            }
            return Err(format!("{name} failed with CUresult {rc}"));
        }
    }
    Ok(())
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let pid: i32 = args
        .get(1)
        .and_then(|a| a.parse().ok())
        .ok_or("usage: agent_client <pid> <mode> ...")?;
    let mode = args.get(2).map(String::as_str).unwrap_or("hello");
    let slot_mib: usize = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(64);
    let slots: u32 = args.get(4).and_then(|a| a.parse().ok()).unwrap_or(16);
    let streams: u32 = args.get(5).and_then(|a| a.parse().ok()).unwrap_or(4);
    let ring = Ring::new(slot_mib << 20, slots)?;
    match mode {
        "hello" => hello(&connect(pid)?).map(|_| ()),
        "list" => list(&connect(pid)?),
        "cycle" => {
            let saved = dump(pid, &ring, streams, None)?;
            restore(pid, &ring, streams, &saved)
        }
        "dump" => save(&dump(pid, &ring, streams, None)?),
        "restore" => restore(pid, &ring, streams, &load()?),
        "driver-ckpt" => driver(
            pid,
            &["cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint"],
        ),
        "driver-restore" => driver(
            pid,
            &["cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"],
        ),
        "abort" => dump(pid, &ring, streams, Some(3)).map(|_| ()),
        "bench" => bench(pid, &ring, streams),
        other => Err(format!("unknown mode {other}")),
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("agent_client: {e}");
        std::process::exit(1);
    }
    println!("agent_client: OK");
}
