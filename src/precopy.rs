//! `gpusnap precopy PID --images DIR [--parent PATH] [--json]`: one pre-copy round of a running
//! split-path process (`gpusnap_cuda::precopy`). The process keeps running; DIR then holds its device
//! data as of the round, and a `criu dump` into a directory whose `parent` link leads to DIR
//! copies only the chunks that changed since.

use std::path::Path;
use std::process::ExitCode;

use crate::util::{self, EXIT_ENVIRONMENT, EXIT_PROBLEM};
use gpusnap_host::pid::HostPid;

const SYNOPSIS: &str = "PID --images DIR [--parent PATH] [--json]";

pub fn run(args: &[String]) -> ExitCode {
    let mut pid = None;
    let mut images = None;
    let mut parent = None;
    let mut as_json = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--images" | "--parent" => {
                let Some(v) = it.next() else {
                    return util::usage_error("precopy", SYNOPSIS, &format!("{a} needs a path"));
                };
                if a == "--images" {
                    images = Some(v.clone());
                } else {
                    parent = Some(v.clone());
                }
            }
            "--json" => as_json = true,
            s if s.starts_with('-') => {
                return util::usage_error("precopy", SYNOPSIS, &format!("unknown option {s}"));
            }
            s if pid.is_none() => match s.parse::<i32>() {
                Ok(p) if p > 0 => pid = Some(HostPid(p)),
                _ => return util::usage_error("precopy", SYNOPSIS, &format!("bad pid {s:?}")),
            },
            s => return util::usage_error("precopy", SYNOPSIS, &format!("unexpected {s:?}")),
        }
    }
    let (Some(pid), Some(images)) = (pid, images) else {
        return util::usage_error("precopy", SYNOPSIS, "PID and --images DIR are needed");
    };
    if !Path::new(&format!("/proc/{pid}")).exists() {
        eprintln!("gpusnap precopy: no process {pid}");
        return ExitCode::from(EXIT_PROBLEM);
    }
    match gpusnap_cuda::precopy::precopy(pid, Path::new(&images), parent.as_deref().map(Path::new))
    {
        Ok(r) => {
            let d = &r.data;
            if as_json {
                let v = serde_json::json!({
                    "pid": r.pid.get(),
                    "nspid": r.nspid.get(),
                    "seconds": r.seconds,
                    "data_seconds": d.seconds,
                    "device_bytes": d.bytes,
                    "chunks": d.chunks.len(),
                    "bytes_written": d.stored_bytes,
                    "bytes_referenced": d.referenced_bytes,
                    "chunks_referenced": d.referenced_chunks,
                    "bytes_zero": d.zero_bytes,
                    "chunks_zero": d.zero_chunks,
                    "allocations_saved": r.allocations_saved,
                    "allocations_left": r.allocations_left,
                    "incremental": r.incremental,
                    "parent_unused": r.parent_unused,
                });
                println!("{v}");
            } else {
                println!(
                    "pid {}: pre-copy round into {images} in {:.3} s (it kept running): {} of device data in {} chunks, {} written, {} unchanged since the parent, {} all zero; {} allocations saved, {} left to the final dump",
                    r.pid,
                    r.seconds,
                    util::bytes(d.bytes),
                    d.chunks.len(),
                    util::bytes(d.stored_bytes),
                    util::bytes(d.referenced_bytes),
                    util::bytes(d.zero_bytes),
                    r.allocations_saved,
                    r.allocations_left,
                );
                if let Some(why) = &r.parent_unused {
                    println!("parent image not used: {why}");
                }
                println!(
                    "next: make the final image directory's `parent` link lead to {images} (as `criu dump --prev-images-dir` does), then `criu dump` into it"
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpusnap precopy: {e}");
            use gpusnap_cuda::precopy::PreCopyError;
            ExitCode::from(match e {
                PreCopyError::Driver(_) | PreCopyError::Config(_) => EXIT_ENVIRONMENT,
                _ => EXIT_PROBLEM,
            })
        }
    }
}
