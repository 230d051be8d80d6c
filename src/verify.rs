//! `gpusnap verify DIR [--threads N]`: reads every chunk of every gpusnap image and checks it.

use std::collections::BTreeSet;
use std::os::fd::AsFd;
use std::process::ExitCode;

use gpusnap_host::pid::NsPid;
use gpusnap_image::{ImageError, ImageFileKind};

use crate::util::{self, EXIT_NOTHING, EXIT_PROBLEM};

const SYNOPSIS: &str = "DIR [--threads N]";

pub fn run(args: &[String]) -> ExitCode {
    let mut dir = None;
    let mut threads = std::thread::available_parallelism().map_or(4, |n| n.get().min(16));
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--threads" | "-j" => match it.next().and_then(|v| v.parse::<usize>().ok()) {
                Some(n) if n > 0 => threads = n,
                _ => return util::usage_error("verify", SYNOPSIS, "--threads needs a number > 0"),
            },
            s if s.starts_with('-') => {
                return util::usage_error("verify", SYNOPSIS, &format!("unknown option {s}"));
            }
            s if dir.is_none() => dir = Some(s.to_owned()),
            s => return util::usage_error("verify", SYNOPSIS, &format!("unexpected {s:?}")),
        }
    }
    let Some(dir) = dir else {
        return util::usage_error("verify", SYNOPSIS, "missing DIR");
    };
    let (dir, _container, _unpacked) = match util::image_dir(&dir) {
        Ok(d) => d,
        Err(e) => return e.exit("verify"),
    };
    let file = match util::open_dir(&dir) {
        Ok(f) => f,
        Err(e) => return e.exit("verify"),
    };
    let fd = file.as_fd();

    let files = match gpusnap_image::list_image_files(fd) {
        Ok(f) => f,
        Err(e) => {
            println!("FAIL  {dir}: {e}");
            return ExitCode::from(EXIT_PROBLEM);
        }
    };
    let manifests: BTreeSet<NsPid> = files
        .iter()
        .filter_map(|(k, _)| match k {
            ImageFileKind::Manifest { nspid } => Some(*nspid),
            _ => None,
        })
        .collect();
    let unfinished = match gpusnap_image::unfinished_dumps(fd) {
        Ok(u) => u,
        Err(e) => {
            println!("FAIL  {dir}: {e}");
            return ExitCode::from(EXIT_PROBLEM);
        }
    };

    let mut bad = 0;
    for &nspid in &manifests {
        let result = gpusnap_image::read_manifest(fd, nspid)
            .and_then(|m| gpusnap_image::verify_image(fd, &m, threads));
        match result {
            Ok(r) => {
                let rate = if r.seconds > 0.0 {
                    format!(
                        ", {}/s",
                        util::bytes((r.stored_bytes as f64 / r.seconds) as u64)
                    )
                } else {
                    String::new()
                };
                let refs = if r.referenced_chunks > 0 {
                    format!(
                        "; {} in {} chunks referenced from parent images (up to {} links up), {} stored here",
                        util::bytes(r.referenced_bytes),
                        r.referenced_chunks,
                        r.chain_depth,
                        util::bytes(r.bytes - r.referenced_bytes - r.zero_bytes)
                    )
                } else {
                    String::new()
                };
                let refs = if r.zero_chunks > 0 {
                    format!(
                        "{refs}; {} in {} zero chunks (recorded, not stored)",
                        util::bytes(r.zero_bytes),
                        r.zero_chunks
                    )
                } else {
                    refs
                };
                println!(
                    "ok    process {nspid}: {} chunks, {} (stored {}) verified in {:.2} s{rate}{refs}",
                    r.chunks,
                    util::bytes(r.bytes),
                    util::bytes(r.stored_bytes),
                    r.seconds
                );
            }
            Err(e) => {
                bad += 1;
                println!("FAIL  process {nspid}: {e}");
            }
        }
    }
    for (nspid, file) in unfinished.iter().cloned() {
        bad += 1;
        let manifest = gpusnap_image::manifest_file_name(nspid);
        let e = if let Some(ImageFileKind::Pending { .. }) = gpusnap_image::parse_file_name(&file) {
            ImageError::PendingDump { file, nspid }
        } else {
            ImageError::UnfinishedDump {
                file,
                nspid,
                manifest,
            }
        };
        println!("FAIL  process {nspid}: {e}");
    }
    if manifests.is_empty() && unfinished.is_empty() {
        // A script must be able to tell "verified" from "found nothing to verify".
        println!("{dir}: no gpusnap images (nothing to verify)");
        return ExitCode::from(EXIT_NOTHING);
    }
    if bad > 0 {
        ExitCode::from(EXIT_PROBLEM)
    } else {
        ExitCode::SUCCESS
    }
}
