//! CPU-side throughput of the image data path, without a GPU: what the plugin's writer threads
//! (hash + append), the restore-time checksum pass (`verify_image`) and its reader threads
//! (`read_chunk` into a staging-sized buffer) do with images on tmpfs.
//!
//! Usage: cargo run --release -p gpusnap-image --example datapath_bench -- \
//!            [--gib 2] [--chunk-mib 32] [--threads N] [--dir /dev/shm/gpusnap-datapath-bench]
//!            [--durable] [--reserve]
//! Prints one line per phase with GiB/s. The directory is removed at the end. `--reserve` first
//! writes the same bytes as a hand-over's drain does, with its space held first
//! (`Reservation::take`, timed on its own): handed back chunk by chunk before each write into
//! a file of its own (the drain before gpusnap wrote into the held space), then written into
//! the held pieces (`DataFileWriter::create_in`); each chunk stored as `raw_sum64` (the GPU
//! hashed it), so the lines time the file system's work only. `--durable` does
//! what the plugin does with `durable = true`: each writer fsyncs its file when it finishes
//! (inside the write times), and the image directory is fsynced after the manifest's rename
//! (timed on its own line).

use gpusnap_image::{
    CHUNK_OVERHEAD, CheckpointPath, ChunkEntry, Codec, DataFileReader, DataFileWriter,
    FORMAT_VERSION, Manifest, Reservation, hash_chunk, verify_image, write_manifest,
};
use gpusnap_proto::pid::NsPid;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Instant;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn write_files(
    dir: &OwnedFd,
    threads: usize,
    per_thread: usize,
    chunk: usize,
    fused: bool,
    durable: bool,
) -> Vec<(gpusnap_image::FileEntry, Vec<ChunkEntry>)> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let dir = dir.as_fd();
                s.spawn(move || {
                    let mut data = vec![0u8; chunk];
                    for (i, b) in data.iter_mut().enumerate() {
                        *b = (i.wrapping_mul(2654435761) >> 13) as u8 ^ t as u8;
                    }
                    let mut w = DataFileWriter::create(dir, NsPid(1), t as u32).expect("create");
                    w.set_sync(durable);
                    let mut entries = Vec::new();
                    for c in 0..per_thread {
                        data[..8].copy_from_slice(&(c as u64).to_le_bytes());
                        let addr = ((t * per_thread + c) * chunk) as u64 + (1 << 32);
                        let e = if fused {
                            w.append_raw(addr, &data).expect("append").0
                        } else {
                            let h = hash_chunk(&data);
                            w.append_chunk_hashed(addr, &data, Codec::Raw, &h)
                                .expect("append")
                        };
                        entries.push(e);
                    }
                    (w.finish().expect("finish"), entries)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("writer"))
            .collect()
    })
}

/// How a `--reserve` run's writers use the held space.
#[derive(Clone, Copy, PartialEq)]
enum Held {
    /// Handed back before each chunk, written into a named file (the drain until now).
    HandedBack,
    /// Written into (`create_in`).
    WrittenInto,
}

/// Holds the space of `threads * per_thread` chunks as the plugin does, then writes them
/// (`raw_sum64`, no host hashing) the `how` way; returns the seconds of each part.
fn write_held(
    dir: &OwnedFd,
    threads: usize,
    per_thread: usize,
    chunk: usize,
    how: Held,
) -> (f64, f64) {
    let bytes = (threads * per_thread) as u64 * (chunk as u64 + CHUNK_OVERHEAD)
        + threads as u64 * CHUNK_OVERHEAD;
    let t0 = Instant::now();
    let reserved = Reservation::take(dir.as_fd(), bytes, threads).expect("reserve");
    let take_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (dir, reserved) = (dir.as_fd(), &reserved);
            s.spawn(move || {
                let mut data = vec![0u8; chunk];
                for (i, b) in data.iter_mut().enumerate() {
                    *b = (i.wrapping_mul(2654435761) >> 13) as u8 ^ t as u8;
                }
                let mut w = match how {
                    Held::HandedBack => DataFileWriter::create(dir, NsPid(1), t as u32),
                    Held::WrittenInto => DataFileWriter::create_in(reserved, NsPid(1), t as u32),
                }
                .expect("create");
                for c in 0..per_thread {
                    if how == Held::HandedBack {
                        reserved.release(chunk as u64 + CHUNK_OVERHEAD);
                    }
                    let addr = ((t * per_thread + c) * chunk) as u64 + (1 << 32);
                    w.append_raw_sum64(addr, &data, c as u64).expect("append");
                }
                w.finish().expect("finish");
            });
        }
    });
    let write_s = t0.elapsed().as_secs_f64();
    drop(reserved);
    for t in 0..threads {
        let _ = gpusnap_image::remove_data_file(
            dir.as_fd(),
            &gpusnap_image::data_file_name(NsPid(1), t as u32),
        );
    }
    (take_s, write_s)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let gib: f64 = arg(&args, "--gib").map_or(2.0, |v| v.parse().expect("--gib"));
    let chunk =
        arg(&args, "--chunk-mib").map_or(32, |v| v.parse::<usize>().expect("--chunk-mib")) << 20;
    let threads = arg(&args, "--threads").map_or_else(
        || std::thread::available_parallelism().map_or(2, |n| n.get()),
        |v| v.parse().expect("--threads"),
    );
    let dir_path = arg(&args, "--dir").unwrap_or_else(|| "/dev/shm/gpusnap-datapath-bench".into());
    let durable = args.iter().any(|a| a == "--durable");
    let _ = std::fs::remove_dir_all(&dir_path);
    std::fs::create_dir_all(&dir_path).expect("mkdir");
    let dir: OwnedFd = std::fs::File::open(&dir_path).expect("open dir").into();
    let total_chunks = ((gib * (1u64 << 30) as f64) as usize / chunk).max(threads);
    let per_thread = total_chunks.div_ceil(threads);
    let bytes = (per_thread * threads * chunk) as f64;
    let gibs = |secs: f64| bytes / (1u64 << 30) as f64 / secs;
    println!(
        "datapath_bench: {} chunks of {} MiB ({:.2} GiB), {threads} threads, {dir_path}{}",
        per_thread * threads,
        chunk >> 20,
        bytes / (1u64 << 30) as f64,
        if durable { ", durable" } else { "" }
    );

    if args.iter().any(|a| a == "--reserve") {
        for (how, words) in [
            (Held::HandedBack, "held, handed back before each chunk"),
            (Held::WrittenInto, "written into the held space"),
        ] {
            let (take_s, write_s) = write_held(&dir, threads, per_thread, chunk, how);
            println!(
                "reserve {take_s:7.3} s  {:6.2} GiB/s  (Reservation::take, {threads} pieces)",
                gibs(take_s)
            );
            println!(
                "write   {write_s:7.3} s  {:6.2} GiB/s  ({words}; raw_sum64)",
                gibs(write_s)
            );
        }
    }

    // Write: one file per thread, like the plugin's writers; first hashing each chunk and then
    // appending it (an incremental dump), then hashing each piece as it is written (a full dump;
    // these files are the ones read back below).
    let mut results = Vec::new();
    for fused in [false, true] {
        for t in 0..threads {
            let _ = std::fs::remove_file(format!("{dir_path}/gpusnap-1-data-{t}.img"));
        }
        let t0 = Instant::now();
        results = write_files(&dir, threads, per_thread, chunk, fused, durable);
        let secs = t0.elapsed().as_secs_f64();
        let how = if fused {
            "append_raw: hashed while written"
        } else {
            "hash_chunk, then append"
        };
        println!("write   {secs:7.3} s  {:6.2} GiB/s  ({how})", gibs(secs));
    }

    let mut files = Vec::new();
    let mut chunks = Vec::new();
    for (f, mut c) in results {
        files.push(f);
        chunks.append(&mut c);
    }
    chunks.sort_by_key(|c| c.addr);
    let m = Manifest {
        format_version: FORMAT_VERSION,
        nspid: NsPid(1),
        path: CheckpointPath::Split,
        created_unix_s: 0,
        gpusnap_version: "bench".into(),
        driver_version: 0,
        gpus: vec![gpusnap_image::GpuRecord {
            ordinal: 0,
            uuid: "0123456789abcdef0123456789abcdef".into(),
            name: "bench".into(),
            total_mem: 1 << 40,
        }],
        allocations: vec![gpusnap_image::AllocationRecord {
            id: 1,
            device: 0,
            addr: 1 << 32,
            size: bytes as u64,
            moved: true,
            lent: false,
            rdma_capable: false,
        }],
        files,
        chunks,
        timings_s: Default::default(),
        requires: None,
    };
    let t0 = Instant::now();
    write_manifest(dir.as_fd(), &m).expect("manifest");
    if durable {
        gpusnap_image::sync_dir(dir.as_fd()).expect("fsync of the image directory");
    }
    println!(
        "commit  {:7.3} s  (write_manifest{})",
        t0.elapsed().as_secs_f64(),
        if durable { " + sync_dir" } else { "" }
    );

    let r = verify_image(dir.as_fd(), &m, threads).expect("verify");
    println!(
        "verify  {:7.3} s  {:6.2} GiB/s  (verify_image)",
        r.seconds,
        gibs(r.seconds)
    );

    // Load: each thread reads its file's chunks into one staging-sized buffer.
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads as u32 {
            let (dir, m) = (dir.as_fd(), &m);
            s.spawn(move || {
                let reader = DataFileReader::open(dir, m, t).expect("open");
                let mut out = vec![0u8; chunk];
                let mut scratch = Vec::new();
                for c in m.chunks.iter().filter(|c| c.file == t) {
                    reader.read_chunk(c, &mut out, &mut scratch).expect("read");
                }
            });
        }
    });
    let load_s = t0.elapsed().as_secs_f64();
    println!(
        "load    {load_s:7.3} s  {:6.2} GiB/s  (read_chunk into a {} MiB buffer)",
        gibs(load_s),
        chunk >> 20
    );
    let _ = std::fs::remove_dir_all(&dir_path);
}
