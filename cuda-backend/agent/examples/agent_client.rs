//! A minimal stand-in for the plugin's side of the protocol, for trying the agent on a GPU
//! machine without CRIU: dump every converted allocation into memory through a memfd ring,
//! release, then restore and reload it, timing each step. It speaks through the plugin's own
//! [`AgentSession`] and ring, so it exercises the same client code as `criu dump`.
//!
//! Usage: `agent_client <pid> <mode> [slot_MiB] [slots] [streams]`, mode one of
//! `hello`, `list`, `dump` (dump + release, data to `$GPUSNAP_CLIENT_FILE`, default
//! `/dev/shm/gpusnap-client.bin`), `restore` (re-create + reload from that file), `cycle`
//! (dump, release, restore in memory), `abort` (dump, abort midway: memory must stay mapped),
//! `bench` (the agent's own pace: no copying on this side; leaves garbage in device memory),
//! `driver-ckpt` / `driver-restore` (the driver's lock + checkpoint / restore + unlock of the
//! pid, as the plugin does around the agent's work). Like the plugin, it holds the process
//! with ptrace for the modes that move data (the agent releases and loads memory only then) and
//! lets only the agent's thread run; the target must not be traced by anyone else.

use gpusnap_cuda::agent::{AgentSession, RingShape, Transfer};
use gpusnap_cuda::staging::Staging;
use gpusnap_host::pid::HostPid;
use gpusnap_host::ptrace::{RunningThread, SeizedProcess};
use gpusnap_proto::Reply;
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(120);

type Res<T> = Result<T, String>;

/// Chunks copied out: (device address, bytes).
type Saved = Vec<(u64, Vec<u8>)>;

fn connect(pid: HostPid) -> Res<AgentSession> {
    AgentSession::connect_expected(pid, WAIT).map_err(|e| e.to_string())
}

fn shape(ring: &Staging, streams: u32) -> RingShape {
    RingShape {
        slot_size: ring.slot_size() as u64,
        slots: ring.slots() as u32,
        streams,
    }
}

fn hello(s: &AgentSession) -> Res<()> {
    let h = s.hello().map_err(|e| e.to_string())?;
    println!("hello: {h:?}");
    Ok(())
}

fn list(s: &AgentSession) -> Res<()> {
    let all = s.list().map_err(|e| e.to_string())?;
    for a in &all {
        println!(
            "  #{} dev {} {:#x} {} bytes moved={}",
            a.id, a.device, a.addr, a.size, a.moved
        );
    }
    println!("  {} allocations", all.len());
    Ok(())
}

/// Dumps into memory; with `abort_after` = Some(n) aborts after n chunks.
fn dump(pid: HostPid, ring: &Staging, streams: u32, abort_after: Option<usize>) -> Res<Saved> {
    let s = connect(pid)?;
    hello(&s)?;
    list(&s)?;
    let t0 = Instant::now();
    s.begin(Transfer::Out, ring.fd().as_fd(), shape(ring, streams))
        .map_err(|e| e.to_string())?;
    println!("dump: ready after {:?}", t0.elapsed());
    let mut saved = Vec::new();
    loop {
        match s.recv(WAIT).map_err(|e| e.to_string())? {
            Reply::ChunkReady {
                slot, addr, len, ..
            } => {
                // SAFETY: the agent announced the slot and does not touch it until SlotFree.
                let data = unsafe { ring.slot(slot as usize, len as usize) };
                saved.push((addr, data.to_vec()));
                if abort_after.is_some_and(|n| saved.len() >= n) {
                    if !s.abort() {
                        return Err("the agent did not confirm the abort".into());
                    }
                    println!("dump: aborted after {} chunks", saved.len());
                    return Ok(saved);
                }
                s.slot_free(slot).map_err(|e| e.to_string())?;
            }
            Reply::ChunkZero { addr, len, .. } => saved.push((addr, vec![0u8; len as usize])),
            Reply::DumpDataDone {
                chunks,
                bytes,
                micros,
            } => {
                let secs = t0.elapsed().as_secs_f64();
                println!(
                    "dump: {chunks} chunks, {bytes} bytes, agent {micros} us, client {secs:.3} s = {:.2} GB/s",
                    bytes as f64 / secs / 1e9
                );
                break;
            }
            other => return Err(format!("dump: {other:?}")),
        }
    }
    let (allocations, bytes) = s.release().map_err(|e| e.to_string())?;
    println!("release: {allocations} allocations, {bytes} bytes");
    Ok(saved)
}

/// The slots of a restore: free ones, and how many the agent has handed back.
struct Slots {
    free: VecDeque<u32>,
    returned: usize,
}

impl Slots {
    /// A free slot: queued `SlotFree`s first, else wait for one.
    fn take(&mut self, s: &AgentSession) -> Res<u32> {
        while let Some(r) = s.channel().try_recv_reply().map_err(|e| e.to_string())? {
            self.returned_one(r)?;
        }
        loop {
            if let Some(slot) = self.free.pop_front() {
                return Ok(slot);
            }
            self.returned_one(s.recv(WAIT).map_err(|e| e.to_string())?)?;
        }
    }

    fn returned_one(&mut self, r: Reply) -> Res<()> {
        match r {
            Reply::SlotFree { slot } => {
                self.free.push_back(slot);
                self.returned += 1;
                Ok(())
            }
            other => Err(format!("restore: {other:?}")),
        }
    }
}

/// Re-creates the agent's memory and loads `chunks` into it; `data` fills each slot (or, for
/// `bench`, leaves whatever the ring holds).
fn load(
    pid: HostPid,
    ring: &Staging,
    streams: u32,
    chunks: &[(u64, u64)],
    data: impl Fn(usize, &mut [u8]),
) -> Res<f64> {
    let s = connect(pid)?;
    let t0 = Instant::now();
    s.begin(Transfer::In, ring.fd().as_fd(), shape(ring, streams))
        .map_err(|e| e.to_string())?;
    println!(
        "restore: ready (memory re-created) after {:?}",
        t0.elapsed()
    );
    let mut slots = Slots {
        free: (0..ring.slots() as u32).collect(),
        returned: 0,
    };
    for (i, &(addr, len)) in chunks.iter().enumerate() {
        let slot = slots.take(&s)?;
        // SAFETY: the slot came back from the agent (SlotFree) or was never handed out.
        data(i, unsafe { ring.slot_mut(slot as usize, len as usize) });
        s.chunk_load(slot, addr, len, None)
            .map_err(|e| e.to_string())?;
    }
    // As the plugin does: every slot back before the end of the data.
    while slots.returned < chunks.len() {
        slots.returned_one(s.recv(WAIT).map_err(|e| e.to_string())?)?;
    }
    let (bytes, _) = s.finish_restore().map_err(|e| e.to_string())?;
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "restore: {bytes} bytes, client {secs:.3} s = {:.2} GB/s",
        bytes as f64 / secs / 1e9
    );
    Ok(secs)
}

fn restore(pid: HostPid, ring: &Staging, streams: u32, saved: &Saved) -> Res<()> {
    let chunks: Vec<(u64, u64)> = saved.iter().map(|(a, d)| (*a, d.len() as u64)).collect();
    load(pid, ring, streams, &chunks, |i, slot| {
        slot.copy_from_slice(&saved[i].1)
    })?;
    hello(&connect(pid)?)
}

fn data_file() -> String {
    std::env::var("GPUSNAP_CLIENT_FILE").unwrap_or_else(|_| "/dev/shm/gpusnap-client.bin".into())
}

fn save(saved: &Saved) -> Res<()> {
    let t0 = Instant::now();
    let file = std::fs::File::create(data_file()).map_err(|e| e.to_string())?;
    let mut f = std::io::BufWriter::new(file);
    for (addr, data) in saved {
        f.write_all(&addr.to_le_bytes())
            .and_then(|_| f.write_all(&(data.len() as u64).to_le_bytes()))
            .and_then(|_| f.write_all(data))
            .map_err(|e| e.to_string())?;
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

fn load_file() -> Res<Saved> {
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
        let (addr, len) = h.split_at(8);
        let addr = u64::from_le_bytes(addr.try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
        let mut d = vec![0u8; len];
        f.read_exact(&mut d)
            .map_err(|e| format!("truncated data file: {e}"))?;
        out.push((addr, d));
    }
}

/// The agent's own pace: a dump whose slots are freed at once (no copy on this side), then a
/// restore of the same chunks from whatever the ring holds (the data is garbage afterwards:
/// the application must rewrite it).
fn bench(pid: HostPid, ring: &Staging, streams: u32) -> Res<()> {
    let s = connect(pid)?;
    let t0 = Instant::now();
    s.begin(Transfer::Out, ring.fd().as_fd(), shape(ring, streams))
        .map_err(|e| e.to_string())?;
    let t1 = Instant::now();
    let mut chunks = Vec::new();
    let total = loop {
        match s.recv(WAIT).map_err(|e| e.to_string())? {
            Reply::ChunkReady {
                slot, addr, len, ..
            } => {
                s.slot_free(slot).map_err(|e| e.to_string())?;
                chunks.push((addr, len));
            }
            Reply::ChunkZero { .. } => {}
            Reply::DumpDataDone { bytes, .. } => break bytes,
            other => return Err(format!("bench dump: {other:?}")),
        }
    };
    let secs = t1.elapsed().as_secs_f64();
    println!(
        "bench dump: setup {:?}, {total} bytes in {secs:.3} s = {:.1} GB/s",
        t1 - t0,
        total as f64 / secs / 1e9
    );
    let released = s.release().map_err(|e| e.to_string())?;
    println!("bench release: {released:?}");
    load(pid, ring, streams, &chunks, |_, _| {}).map(|_| ())
}

/// The driver's checkpoint calls on `pid`, in order, as the plugin makes them.
fn driver(pid: HostPid, checkpoint: bool) -> Res<()> {
    let api = gpusnap_cuda::driver::api().map_err(|e| e.to_string())?;
    api.init().map_err(|e| e.to_string())?;
    let timed = |name: &str, r: Result<(), gpusnap_cuda::DriverError>, t0: Instant| {
        println!("{name}({pid}): {r:?} in {:?}", t0.elapsed());
        r.map_err(|e| format!("{name}: {e}"))
    };
    if checkpoint {
        let t0 = Instant::now();
        timed("lock", api.lock(pid, 10_000), t0)?;
        let t0 = Instant::now();
        if let Err(e) = timed("checkpoint", api.checkpoint(pid), t0) {
            // Do not leave the process locked behind a failed checkpoint.
            println!("unlock({pid}): {:?}", api.unlock(pid));
            return Err(e);
        }
    } else {
        let t0 = Instant::now();
        timed("restore", api.restore(pid, &[]), t0)?;
        let t0 = Instant::now();
        timed("unlock", api.unlock(pid), t0)?;
    }
    Ok(())
}

/// Seizes every thread of `pid` and lets the agent's run. Dropping the pair stops the agent's
/// thread first (a tuple drops its fields in order), then detaches every thread: a detach
/// needs the thread stopped.
fn hold(pid: HostPid) -> Res<(RunningThread, SeizedProcess)> {
    let tid =
        gpusnap_cuda::agent::agent_thread(pid).ok_or("no gpusnap-agent thread in the target")?;
    let seized = SeizedProcess::seize(pid).map_err(|e| format!("seize {pid}: {e}"))?;
    let agent = RunningThread::resume(tid).map_err(|e| format!("resume the agent thread: {e}"))?;
    Ok((agent, seized))
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let pid = args
        .get(1)
        .and_then(|a| a.parse().ok())
        .map(HostPid)
        .ok_or("usage: agent_client <pid> <mode> ...")?;
    let mode = args.get(2).map(String::as_str).unwrap_or("hello");
    let slot_mib: usize = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(64);
    let slots: usize = args.get(4).and_then(|a| a.parse().ok()).unwrap_or(16);
    let streams: u32 = args.get(5).and_then(|a| a.parse().ok()).unwrap_or(4);
    let ring = Staging::new(slot_mib << 20, slots).map_err(|e| format!("staging ring: {e}"))?;
    // Held as by CRIU: every thread stopped but the agent's.
    let _held = match mode {
        "cycle" | "dump" | "restore" | "abort" | "bench" => Some(hold(pid)?),
        _ => None,
    };
    match mode {
        "hello" => hello(&connect(pid)?),
        "list" => list(&connect(pid)?),
        "cycle" => {
            let saved = dump(pid, &ring, streams, None)?;
            restore(pid, &ring, streams, &saved)
        }
        "dump" => save(&dump(pid, &ring, streams, None)?),
        "restore" => restore(pid, &ring, streams, &load_file()?),
        "driver-ckpt" => driver(pid, true),
        "driver-restore" => driver(pid, false),
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
