//! `gpusnap inspect DIR [--json]`: what the gpusnap images in a CRIU image directory hold.

use std::collections::BTreeSet;
use std::os::fd::{AsFd, BorrowedFd};
use std::process::ExitCode;

use gpusnap_image::{CheckpointPath, ImageFileKind, Manifest};
use serde_json::{Value, json};

use crate::util::{self, EXIT_PROBLEM};

const SYNOPSIS: &str = "DIR [--json]";

pub fn run(args: &[String]) -> ExitCode {
    let mut dir = None;
    let mut as_json = false;
    for a in args {
        match a.as_str() {
            "--json" => as_json = true,
            s if s.starts_with('-') => {
                return util::usage_error("inspect", SYNOPSIS, &format!("unknown option {s}"));
            }
            s if dir.is_none() => dir = Some(s.to_owned()),
            s => return util::usage_error("inspect", SYNOPSIS, &format!("unexpected {s:?}")),
        }
    }
    let Some(dir) = dir else {
        return util::usage_error("inspect", SYNOPSIS, "missing DIR");
    };
    let file = match util::open_dir(&dir) {
        Ok(f) => f,
        Err(e) => return util::usage_error("inspect", SYNOPSIS, &e),
    };
    let report = match Report::gather(&dir, file.as_fd()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gpusnap inspect: {e}");
            return ExitCode::from(EXIT_PROBLEM);
        }
    };
    if as_json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report.to_json()).expect("a Value always serializes")
        );
    } else {
        print!("{}", report.to_text());
    }
    if report.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_PROBLEM)
    }
}

/// Everything `inspect` shows about one directory.
struct Report {
    dir: String,
    processes: Vec<(u32, Result<Manifest, String>)>,
    /// gpusnap files that belong to no manifest (an interrupted dump) or are temporaries.
    leftovers: Vec<String>,
    stats: Result<Option<Value>, String>,
}

impl Report {
    fn gather(dir: &str, fd: BorrowedFd<'_>) -> Result<Report, String> {
        let files = gpusnap_image::list_image_files(fd).map_err(|e| e.to_string())?;
        let with_manifest: BTreeSet<u32> = files
            .iter()
            .filter_map(|(k, _)| match k {
                ImageFileKind::Manifest { nspid } => Some(*nspid),
                _ => None,
            })
            .collect();
        let processes = with_manifest
            .iter()
            .map(|&n| {
                (
                    n,
                    gpusnap_image::read_manifest(fd, n).map_err(|e| e.to_string()),
                )
            })
            .collect();
        let leftovers = files
            .iter()
            .filter(|(k, _)| match k {
                ImageFileKind::Data { nspid, .. } => !with_manifest.contains(nspid),
                ImageFileKind::ManifestTmp { .. } | ImageFileKind::StatsTmp => true,
                ImageFileKind::Manifest { .. } | ImageFileKind::Stats => false,
            })
            .map(|(_, n)| n.clone())
            .collect();
        let stats = gpusnap_image::read_stats(fd).map_err(|e| e.to_string());
        Ok(Report {
            dir: dir.to_owned(),
            processes,
            leftovers,
            stats,
        })
    }

    fn ok(&self) -> bool {
        self.processes.iter().all(|(_, r)| r.is_ok()) && self.stats.is_ok()
    }

    fn to_json(&self) -> Value {
        let processes: Vec<Value> = self
            .processes
            .iter()
            .map(|(nspid, r)| match r {
                Ok(m) => process_json(m),
                Err(e) => json!({ "nspid": nspid, "ok": false, "error": e }),
            })
            .collect();
        let (stats, stats_error) = match &self.stats {
            Ok(v) => (v.clone().unwrap_or(Value::Null), Value::Null),
            Err(e) => (Value::Null, json!(e)),
        };
        json!({
            "dir": self.dir,
            "ok": self.ok(),
            "processes": processes,
            "leftover_files": self.leftovers,
            "stats": stats,
            "stats_error": stats_error,
        })
    }

    fn to_text(&self) -> String {
        let mut s = String::new();
        if self.processes.is_empty() {
            s.push_str(&format!("{}: no gpusnap manifests\n", self.dir));
        }
        for (nspid, r) in &self.processes {
            match r {
                Ok(m) => s.push_str(&process_text(m)),
                Err(e) => s.push_str(&format!("process {nspid}: UNREADABLE: {e}\n")),
            }
            s.push('\n');
        }
        if !self.leftovers.is_empty() {
            s.push_str("leftover files (no manifest; an interrupted dump?):\n");
            for n in &self.leftovers {
                s.push_str(&format!("  {n}\n"));
            }
        }
        match &self.stats {
            Ok(Some(v)) => s.push_str(&format!(
                "{}:\n{}\n",
                gpusnap_image::STATS_FILE_NAME,
                serde_json::to_string_pretty(v).expect("a Value always serializes")
            )),
            Ok(None) => {}
            Err(e) => s.push_str(&format!("stats: {e}\n")),
        }
        s
    }
}

/// Totals of one manifest.
struct Totals {
    moved: u64,
    stored: u64,
    driver_saved: u64,
    /// Chunks and bytes (stored) in this image's own data files.
    here_chunks: u64,
    stored_here: u64,
    /// Chunks and device bytes referenced in ancestor images, by depth (1 = `parent`).
    referenced: std::collections::BTreeMap<u32, (u64, u64)>,
}

impl Totals {
    fn referenced_chunks(&self) -> u64 {
        self.referenced.values().map(|v| v.0).sum()
    }
    fn referenced_bytes(&self) -> u64 {
        self.referenced.values().map(|v| v.1).sum()
    }
}

fn totals(m: &Manifest) -> Totals {
    let mut referenced = std::collections::BTreeMap::new();
    for c in m.chunks.iter().filter(|c| c.is_reference()) {
        let e: &mut (u64, u64) = referenced.entry(c.parent_depth).or_default();
        e.0 += 1;
        e.1 += c.len;
    }
    let own = || m.chunks.iter().filter(|c| !c.is_reference());
    Totals {
        here_chunks: own().count() as u64,
        stored_here: own().map(|c| c.stored_len).sum(),
        referenced,
        moved: m.chunks.iter().map(|c| c.len).sum(),
        stored: m.chunks.iter().map(|c| c.stored_len).sum(),
        driver_saved: m
            .allocations
            .iter()
            .filter(|a| !a.moved)
            .map(|a| a.size)
            .sum(),
    }
}

fn path_name(p: &CheckpointPath) -> &'static str {
    match p {
        CheckpointPath::Split => "split",
        CheckpointPath::Transparent => "transparent",
    }
}

fn process_json(m: &Manifest) -> Value {
    let t = totals(m);
    json!({
        "nspid": m.nspid,
        "ok": true,
        "path": path_name(&m.path),
        "format_version": m.format_version,
        "gpusnap_version": m.gpusnap_version,
        "driver_version": m.driver_version,
        "created_unix_s": m.created_unix_s,
        "gpus": m.gpus,
        "allocations": m.allocations.iter().map(|a| json!({
            "id": a.id,
            "device": a.device,
            "addr": a.addr,
            "addr_hex": format!("{:#x}", a.addr),
            "size": a.size,
            "saved_by": if a.moved { "gpusnap" } else { "driver" },
        })).collect::<Vec<_>>(),
        "total_bytes": t.moved,
        "stored_bytes": t.stored,
        "driver_saved_bytes": t.driver_saved,
        "compression_ratio": util::ratio(t.moved, t.stored),
        "stored_here_bytes": t.stored_here,
        "chunks_here": t.here_chunks,
        "referenced_bytes": t.referenced_bytes(),
        "referenced_chunks": t.referenced_chunks(),
        "chain_depth": t.referenced.keys().max().copied().unwrap_or(0),
        "referenced_by_depth": t.referenced.iter().map(|(d, (n, b))| json!({
            "depth": d,
            "image": vec![gpusnap_image::PARENT_LINK; *d as usize].join("/"),
            "chunks": n,
            "bytes": b,
        })).collect::<Vec<_>>(),
        "file_count": m.files.len(),
        "chunk_count": m.chunks.len(),
        "files": m.files,
        "timings_s": m.timings_s,
    })
}

fn process_text(m: &Manifest) -> String {
    let t = totals(m);
    let mut s = format!(
        "process {} ({} path), gpusnap {}, driver {}, created {} (unix)\n",
        m.nspid,
        path_name(&m.path),
        m.gpusnap_version,
        m.driver_version,
        m.created_unix_s
    );
    for g in &m.gpus {
        s.push_str(&format!(
            "  GPU {}: {} ({}), uuid {}\n",
            g.ordinal,
            g.name,
            util::bytes(g.total_mem),
            g.uuid
        ));
    }
    let moved = m.allocations.iter().filter(|a| a.moved).count();
    s.push_str(&format!(
        "  allocations: {} ({} moved by gpusnap, {} saved by the driver)\n",
        m.allocations.len(),
        moved,
        m.allocations.len() - moved
    ));
    for a in &m.allocations {
        s.push_str(&format!(
            "    {:#016x}  {:>10}  GPU {}  {}\n",
            a.addr,
            util::bytes(a.size),
            a.device,
            if a.moved { "moved" } else { "driver-saved" }
        ));
    }
    let ratio = util::ratio(t.moved, t.stored).map_or("-".to_owned(), |r| format!("{r:.2}x"));
    s.push_str(&format!(
        "  data: {} in {} chunks, {} files; stored {} (compression {ratio}); driver-saved {}\n",
        util::bytes(t.moved),
        m.chunks.len(),
        m.files.len(),
        util::bytes(t.stored),
        util::bytes(t.driver_saved),
    ));
    if !t.referenced.is_empty() {
        let parts: Vec<String> = t
            .referenced
            .iter()
            .map(|(d, (n, b))| {
                format!(
                    "{} in {n} chunks from {}",
                    util::bytes(*b),
                    vec![gpusnap_image::PARENT_LINK; *d as usize].join("/")
                )
            })
            .collect();
        s.push_str(&format!(
            "  incremental: stored here {} in {} chunks; referenced unchanged {} in {} chunks ({})\n",
            util::bytes(t.stored_here),
            t.here_chunks,
            util::bytes(t.referenced_bytes()),
            t.referenced_chunks(),
            parts.join(", ")
        ));
    }
    if !m.timings_s.is_empty() {
        let phases: Vec<String> = m
            .timings_s
            .iter()
            .map(|(k, v)| format!("{k} {v:.3} s"))
            .collect();
        s.push_str(&format!("  timings: {}\n", phases.join(", ")));
    }
    s
}
