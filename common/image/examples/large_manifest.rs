//! Builds a valid image with a very large manifest, for measuring what the tools (`gpusnap
//! inspect`, `gpusnap verify`) cost on one:
//!
//!     cargo run --release -p gpusnap-image --example large_manifest -- DIR \
//!         [--allocations 3600000] [--moved 100000] [--nspid 7]
//!
//! DIR must not exist. The image holds `--allocations` allocations of 2 MiB, of which the first
//! `--moved` were moved by gpusnap (one 4 KiB chunk each, so the allocation is 4 KiB; all in one
//! data file) and the rest were left to the driver. It is written with the crate's writer and
//! `write_manifest`, so it passes every check a restore makes. Prints the manifest's size.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;

use gpusnap_image::{
    AllocationRecord, CheckpointPath, Codec, DataFileWriter, FORMAT_VERSION, GpuRecord, Manifest,
    manifest_file_name, write_manifest,
};

const MOVED_LEN: usize = 4096;
const DRIVER_SAVED_LEN: u64 = 2 << 20;

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} needs a number")),
        None => default,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .first()
        .filter(|a| !a.starts_with("--"))
        .expect("usage: large_manifest DIR [--allocations N] [--moved N] [--nspid N]");
    let allocations = arg(&args, "--allocations", 3_600_000);
    let moved = arg(&args, "--moved", 100_000).min(allocations);
    let nspid = gpusnap_proto::pid::NsPid(arg(&args, "--nspid", 7) as u32);

    std::fs::create_dir(path).expect("create DIR (it must not exist)");
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(path)
        .expect("open DIR");
    let fd = dir.as_fd();

    let base = 0x7f00_0000_0000u64;
    let mut chunks = Vec::new();
    let mut records = Vec::with_capacity(allocations as usize);
    let mut writer = DataFileWriter::create(fd, nspid, 0).expect("create the data file");
    let mut data = vec![0u8; MOVED_LEN];
    let mut addr = base;
    for id in 0..allocations {
        let is_moved = id < moved;
        let size = if is_moved {
            data[..8].copy_from_slice(&id.to_le_bytes());
            chunks.push(
                writer
                    .append_chunk(addr, &data, Codec::Raw)
                    .expect("append a chunk"),
            );
            MOVED_LEN as u64
        } else {
            DRIVER_SAVED_LEN
        };
        records.push(AllocationRecord {
            id: id + 1,
            device: 0,
            addr,
            size,
            moved: is_moved,
            lent: false,
            rdma_capable: false,
        });
        addr += size;
    }
    let files = if moved > 0 {
        vec![writer.finish().expect("finish the data file")]
    } else {
        drop(writer);
        gpusnap_image::remove_process_files(fd, nspid).expect("remove the empty data file");
        Vec::new()
    };
    let m = Manifest {
        format_version: FORMAT_VERSION,
        nspid,
        path: CheckpointPath::Split,
        created_unix_s: 1_700_000_000,
        gpusnap_version: gpusnap_image::BUILD.into(),
        driver_version: 13000,
        gpus: vec![GpuRecord {
            ordinal: 0,
            uuid: "0123456789abcdef0123456789abcdef".into(),
            name: "NVIDIA H200".into(),
            total_mem: 150_000_000_000,
        }],
        allocations: records,
        files,
        chunks,
        timings_s: BTreeMap::from([("data".to_string(), 1.0)]),
        requires: None,
    };
    write_manifest(fd, &m).expect("write the manifest");
    let size = std::fs::metadata(format!("{path}/{}", manifest_file_name(nspid)))
        .expect("stat the manifest")
        .len();
    println!(
        "{path}: {allocations} allocations ({moved} moved, one chunk each), manifest {size} bytes ({:.1} MB)",
        size as f64 / 1e6
    );
}
