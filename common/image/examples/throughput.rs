//! Single-thread throughput of the image crate's hot paths, to tmpfs by default:
//! `cargo run --release -p gpusnap-image --example throughput [DIR] [CHUNK_MIB] [CHUNKS]`.
//! The plugin runs one writer (or reader) like this per thread.

use gpusnap_proto::pid::NsPid;
use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::time::Instant;

use gpusnap_image::*;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let base = args.first().map_or("/dev/shm", String::as_str);
    let chunk_mib: usize = args.get(1).map_or(64, |s| s.parse().unwrap());
    let chunks: usize = args.get(2).map_or(16, |s| s.parse().unwrap());
    let path = format!("{base}/gpusnap-throughput-{}", std::process::id());
    std::fs::create_dir(&path).unwrap();
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(&path)
        .unwrap();
    let fd = dir.as_fd();
    let len = chunk_mib << 20;
    // bf16-like noise (incompressible-ish) and a compressible pattern.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let noise: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let sparse: Vec<u8> = (0..len)
        .map(|i| if i % 4096 < 64 { i as u8 } else { 0 })
        .collect();

    for (label, data, codec) in [
        ("raw ", &noise, Codec::Raw),
        ("zstd (incompressible)", &noise, Codec::Zstd),
        ("zstd (sparse)", &sparse, Codec::Zstd),
    ] {
        let _ = remove_process_files(fd, NsPid(1));
        let t = Instant::now();
        let mut w = DataFileWriter::create(fd, NsPid(1), 0).unwrap();
        let entries: Vec<_> = (0..chunks)
            .map(|i| w.append_chunk((i * len) as u64, data, codec).unwrap())
            .collect();
        let file = w.finish().unwrap();
        let wt = t.elapsed().as_secs_f64();
        let total = (chunks * len) as f64;
        let m = Manifest {
            format_version: FORMAT_VERSION,
            nspid: NsPid(1),
            path: CheckpointPath::Split,
            created_unix_s: 0,
            gpusnap_version: "bench".into(),
            driver_version: 0,
            gpus: vec![GpuRecord {
                ordinal: 0,
                uuid: "0".repeat(32),
                name: "bench".into(),
                total_mem: 0,
            }],
            allocations: vec![AllocationRecord {
                id: 0,
                device: 0,
                addr: 0,
                size: (chunks * len) as u64,
                moved: true,
                lent: false,
                rdma_capable: false,
            }],
            files: vec![file],
            chunks: entries,
            timings_s: BTreeMap::new(),
            requires: None,
        };
        write_manifest(fd, &m).unwrap();
        let m = read_manifest(fd, NsPid(1)).unwrap();
        let r = DataFileReader::open(fd, &m, 0).unwrap();
        let mut out = vec![0u8; len];
        let mut scratch = Vec::new();
        let t = Instant::now();
        for c in &m.chunks {
            r.read_chunk(c, &mut out, &mut scratch).unwrap();
        }
        let rt = t.elapsed().as_secs_f64();
        let stored: u64 = m.chunks.iter().map(|c| c.stored_len).sum();
        println!(
            "{label:<22} write {:6.2} GB/s  read+verify {:6.2} GB/s  stored/len {:.3}",
            total / wt / 1e9,
            total / rt / 1e9,
            stored as f64 / total
        );
    }
    std::fs::remove_dir_all(&path).unwrap();
}
