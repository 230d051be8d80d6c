//! `gpusnap inspect DIR [--json]`: what the gpusnap images in a CRIU image directory hold.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, BufWriter, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::process::ExitCode;

use gpusnap_host::pid::NsPid;
use gpusnap_image::{
    AllocationRecord, CheckpointPath, FileEntry, GpuRecord, ImageError, ImageFileKind, Manifest,
    Requirements,
};
use serde::Serialize;
use serde::ser::{SerializeStruct, Serializer};
use serde_json::Value;

use crate::util::{self, EXIT_NOTHING, EXIT_PROBLEM};

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
    let (dir, container, _unpacked) = match util::image_dir(&dir) {
        Ok(d) => d,
        Err(e) => return e.exit("inspect"),
    };
    let file = match util::open_dir(&dir) {
        Ok(f) => f,
        Err(e) => return e.exit("inspect"),
    };
    let report = match Report::gather(&dir, file.as_fd()) {
        Ok(r) => Report { container, ..r },
        Err(e) => {
            eprintln!("gpusnap inspect: {e}");
            return ExitCode::from(EXIT_PROBLEM);
        }
    };
    let mut out = BufWriter::new(io::stdout().lock());
    let written = if as_json {
        serde_json::to_writer_pretty(&mut out, &report.json())
            .map_err(io::Error::from)
            .and_then(|()| writeln!(out))
    } else {
        report.write_text(&mut out)
    };
    if let Err(e) = written.and_then(|()| out.flush()) {
        // `gpusnap inspect DIR | head` closes the pipe early: not worth a message.
        if e.kind() != io::ErrorKind::BrokenPipe {
            eprintln!("gpusnap inspect: writing the report to stdout: {e}");
        }
        return ExitCode::from(EXIT_PROBLEM);
    }
    if !report.ok() {
        ExitCode::from(EXIT_PROBLEM)
    } else if report.is_empty() {
        // As `verify`: a script must be able to tell "shown" from "found nothing to show".
        ExitCode::from(EXIT_NOTHING)
    } else {
        ExitCode::SUCCESS
    }
}

/// Everything `inspect` shows about one directory.
struct Report {
    dir: String,
    processes: Vec<(NsPid, Result<Manifest, ImageError>)>,
    /// gpusnap files that belong to no manifest (an interrupted dump) or are temporaries.
    leftovers: Vec<String>,
    stats: Result<Option<Value>, ImageError>,
    /// What the container's saved spec needs of the node, when the image is a container's.
    container: Option<util::ContainerNeeds>,
}

impl Report {
    fn gather(dir: &str, fd: BorrowedFd<'_>) -> Result<Report, ImageError> {
        let files = gpusnap_image::list_image_files(fd)?;
        let with_manifest: BTreeSet<NsPid> = files
            .iter()
            .filter_map(|(k, _)| match k {
                ImageFileKind::Manifest { nspid } => Some(*nspid),
                _ => None,
            })
            .collect();
        let processes = with_manifest
            .iter()
            .map(|&n| (n, gpusnap_image::read_manifest(fd, n)))
            .collect();
        let leftovers = files
            .iter()
            .filter(|(k, _)| match k {
                ImageFileKind::Data { nspid, .. } | ImageFileKind::Kfd { nspid } => {
                    !with_manifest.contains(nspid)
                }
                ImageFileKind::ManifestTmp { .. }
                | ImageFileKind::StatsTmp
                | ImageFileKind::Failed { .. }
                | ImageFileKind::Pending { .. } => true,
                ImageFileKind::Manifest { .. } | ImageFileKind::Stats => false,
            })
            .map(|(_, n)| n.clone())
            .collect();
        let stats = gpusnap_image::read_stats(fd);
        Ok(Report {
            dir: dir.to_owned(),
            processes,
            leftovers,
            stats,
            container: None,
        })
    }

    fn ok(&self) -> bool {
        self.processes.iter().all(|(_, r)| r.is_ok()) && self.stats.is_ok()
    }

    /// No gpusnap image in the directory, nor any file of an interrupted dump: nothing to
    /// inspect (exit 3, as `verify` there). A stats file alone (a dump without GPU processes)
    /// is no image either.
    fn is_empty(&self) -> bool {
        self.processes.is_empty() && self.leftovers.is_empty()
    }

    /// The JSON report, serialized straight from the manifests as it is written: no tree of
    /// `Value`s, no output string (a 250 MB manifest used to take 5.7 GB here).
    fn json(&self) -> ReportJson<'_> {
        let (stats, stats_error) = match &self.stats {
            Ok(v) => (v.as_ref(), None),
            Err(e) => (None, Some(Message(e))),
        };
        let manifests: Vec<&Manifest> = self
            .processes
            .iter()
            .filter_map(|(_, r)| r.as_ref().ok())
            .collect();
        let needs = NodeNeeds::of(&manifests);
        ReportJson {
            dir: &self.dir,
            structure_ok: self.ok(),
            checksums: CHECKSUMS_NOT_CHECKED,
            driver_stack_identity: needs.identity,
            min_gpu_memory_bytes: needs.min_gpu_memory,
            gpu_memory_bytes: needs.per_gpu,
            container: self.container.as_ref(),
            processes: self
                .processes
                .iter()
                .map(|(nspid, r)| match r {
                    Ok(m) => ProcessJson::Read(Box::new(process_json(m))),
                    Err(e) => ProcessJson::Unreadable {
                        nspid: nspid.get(),
                        structure_ok: false,
                        error: Message(e),
                    },
                })
                .collect(),
            leftover_files: &self.leftovers,
            stats,
            stats_error,
        }
    }

    fn write_text(&self, out: &mut impl Write) -> io::Result<()> {
        if self.is_empty() {
            writeln!(out, "{}: no gpusnap images (nothing to inspect)", self.dir)?;
        } else if self.processes.is_empty() {
            writeln!(out, "{}: no gpusnap manifests", self.dir)?;
        }
        for (nspid, r) in &self.processes {
            match r {
                Ok(m) => write_process_text(out, m)?,
                Err(e) => writeln!(out, "process {nspid}: UNREADABLE: {e}")?,
            }
            writeln!(out)?;
        }
        if let Some(c) = &self.container {
            c.write_text(out)?;
        }
        if !self.leftovers.is_empty() {
            writeln!(out, "leftover files (no manifest; an interrupted dump?):")?;
            for n in &self.leftovers {
                writeln!(out, "  {n}")?;
            }
        }
        match &self.stats {
            Ok(Some(v)) => writeln!(
                out,
                "{}:\n{}",
                gpusnap_image::STATS_FILE_NAME,
                serde_json::to_string_pretty(v).expect("a Value always serializes")
            )?,
            Ok(None) => {}
            Err(e) => writeln!(out, "stats: {e}")?,
        }
        if !self.processes.is_empty() {
            writeln!(out, "{CHECKED_TEXT}")?;
        }
        Ok(())
    }
}

/// What `inspect` says about chunk checksums: it reads no chunk data.
const CHECKSUMS_NOT_CHECKED: &str = "not checked";

/// The last line of the text report: what a readable manifest above means, and what it does not.
const CHECKED_TEXT: &str = "checked: each manifest's checksum and structure, its data files' \
     sizes and headers, and its parent images; not checked: chunk data and checksums \
     (gpusnap verify reads every chunk)";

/// The JSON report. Field order is output order.
#[derive(Serialize)]
struct ReportJson<'a> {
    dir: &'a str,
    /// Every manifest (and the stats file) passed the checks `read_manifest` makes: checksum,
    /// schema, bounds and sums, data-file sizes and headers, parent images. No chunk was read.
    structure_ok: bool,
    /// Always [`CHECKSUMS_NOT_CHECKED`]: only `gpusnap verify` reads chunks.
    checksums: &'static str,
    /// The driver stack the image needs, as one string a runtime compares between nodes
    /// (KEP-6274): `nvidia=<kernel driver>;cuda=<API>;lib=<file>@<xxh3-128>`; `null` when the
    /// manifests record none (before format 7) or disagree.
    driver_stack_identity: Option<String>,
    /// The least device memory a GPU of the node must have for the restore: the largest of
    /// [`Self::gpu_memory_bytes`] (KEP-6274); `null` where no manifest records it.
    min_gpu_memory_bytes: Option<u64>,
    /// Device memory the image's processes use, summed per GPU UUID, where recorded.
    gpu_memory_bytes: BTreeMap<String, u64>,
    /// What the container's saved spec needs of the node (device nodes, driver-library mounts),
    /// when `DIR` is a container checkpoint (`spec.dump` beside `checkpoint/`).
    container: Option<&'a util::ContainerNeeds>,
    processes: Vec<ProcessJson<'a>>,
    leftover_files: &'a [String],
    stats: Option<&'a Value>,
    stats_error: Option<Message<'a>>,
}

/// An error in the JSON report: its message, as a string.
struct Message<'a>(&'a ImageError);

impl Serialize for Message<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self.0)
    }
}

#[derive(Serialize)]
#[serde(untagged)]
enum ProcessJson<'a> {
    Read(Box<ManifestJson<'a>>),
    Unreadable {
        nspid: u32,
        structure_ok: bool,
        error: Message<'a>,
    },
}

/// One readable manifest, borrowing from it.
#[derive(Serialize)]
struct ManifestJson<'a> {
    nspid: u32,
    structure_ok: bool,
    checksums: &'static str,
    path: &'static str,
    format_version: u32,
    gpusnap_version: &'a str,
    driver_version: i32,
    created_unix_s: u64,
    gpus: &'a [GpuRecord],
    allocations: AllocationsJson<'a>,
    total_bytes: u64,
    stored_bytes: u64,
    driver_saved_bytes: u64,
    compression_ratio: Option<f64>,
    stored_here_bytes: u64,
    chunks_here: u64,
    referenced_bytes: u64,
    referenced_chunks: u64,
    zero_bytes: u64,
    zero_chunks: u64,
    device_hashed_chunks: u64,
    chain_depth: u32,
    referenced_by_depth: Vec<DepthJson>,
    file_count: usize,
    chunk_count: usize,
    files: &'a [FileEntry],
    timings_s: &'a BTreeMap<String, f64>,
    /// What a restore needs of the node (format 7), as recorded.
    requires: Option<&'a Requirements>,
}

/// What the image as a whole needs of a node.
struct NodeNeeds {
    identity: Option<String>,
    min_gpu_memory: Option<u64>,
    per_gpu: BTreeMap<String, u64>,
}

impl NodeNeeds {
    fn of(manifests: &[&Manifest]) -> NodeNeeds {
        let ids: BTreeSet<String> = manifests
            .iter()
            .filter_map(|m| Some(m.requires.as_ref()?.driver_stack_identity(m.driver_version)))
            .filter(|s| !s.is_empty())
            .collect();
        let mut per_gpu: BTreeMap<String, u64> = BTreeMap::new();
        for m in manifests {
            let Some(r) = &m.requires else { continue };
            for (ordinal, used) in &r.gpu_mem_used {
                if let Some(g) = m.gpus.iter().find(|g| g.ordinal == *ordinal) {
                    *per_gpu.entry(g.uuid.clone()).or_default() += used;
                }
            }
        }
        NodeNeeds {
            identity: (ids.len() == 1).then(|| ids.into_iter().next()).flatten(),
            min_gpu_memory: per_gpu.values().max().copied(),
            per_gpu,
        }
    }
}

/// The allocations, serialized one at a time as they are written.
struct AllocationsJson<'a>(&'a [AllocationRecord]);

impl Serialize for AllocationsJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(AllocationJson))
    }
}

struct AllocationJson<'a>(&'a AllocationRecord);

impl Serialize for AllocationJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let a = self.0;
        let mut m = s.serialize_struct("Allocation", 6)?;
        m.serialize_field("id", &a.id)?;
        m.serialize_field("device", &a.device)?;
        m.serialize_field("addr", &a.addr)?;
        m.serialize_field("addr_hex", &format_args!("{:#x}", a.addr))?;
        m.serialize_field("size", &a.size)?;
        m.serialize_field("saved_by", if a.moved { "gpusnap" } else { "driver" })?;
        m.end()
    }
}

#[derive(Serialize)]
struct DepthJson {
    depth: u32,
    image: String,
    chunks: u64,
    bytes: u64,
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
    referenced: BTreeMap<u32, (u64, u64)>,
    /// Chunks and device bytes recorded as all zero (nothing stored).
    zero_chunks: u64,
    zero_bytes: u64,
    /// Chunks that carry a hash computed on the GPU.
    device_hashed: u64,
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
    let mut referenced = BTreeMap::new();
    for c in m.chunks.iter().filter(|c| c.is_reference()) {
        let e: &mut (u64, u64) = referenced.entry(c.parent_depth).or_default();
        e.0 += 1;
        e.1 += c.len;
    }
    let own = || {
        m.chunks
            .iter()
            .filter(|c| c.is_stored() && !c.is_reference())
    };
    let zero = || m.chunks.iter().filter(|c| !c.is_stored());
    Totals {
        zero_chunks: zero().count() as u64,
        zero_bytes: zero().map(|c| c.len).sum(),
        device_hashed: m.chunks.iter().filter(|c| c.device_hash.is_some()).count() as u64,
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
        CheckpointPath::Kfd => "kfd",
    }
}

fn process_json(m: &Manifest) -> ManifestJson<'_> {
    let t = totals(m);
    ManifestJson {
        nspid: m.nspid.get(),
        structure_ok: true,
        checksums: CHECKSUMS_NOT_CHECKED,
        path: path_name(&m.path),
        format_version: m.format_version,
        gpusnap_version: &m.gpusnap_version,
        driver_version: m.driver_version,
        created_unix_s: m.created_unix_s,
        gpus: &m.gpus,
        allocations: AllocationsJson(&m.allocations),
        total_bytes: t.moved,
        stored_bytes: t.stored,
        driver_saved_bytes: t.driver_saved,
        compression_ratio: util::ratio(t.moved, t.stored),
        stored_here_bytes: t.stored_here,
        chunks_here: t.here_chunks,
        referenced_bytes: t.referenced_bytes(),
        referenced_chunks: t.referenced_chunks(),
        zero_bytes: t.zero_bytes,
        zero_chunks: t.zero_chunks,
        device_hashed_chunks: t.device_hashed,
        chain_depth: t.referenced.keys().max().copied().unwrap_or(0),
        referenced_by_depth: t
            .referenced
            .iter()
            .map(|(&depth, &(chunks, bytes))| DepthJson {
                depth,
                image: parent_path(depth),
                chunks,
                bytes,
            })
            .collect(),
        file_count: m.files.len(),
        chunk_count: m.chunks.len(),
        files: &m.files,
        timings_s: &m.timings_s,
        requires: m.requires.as_ref(),
    }
}

/// `parent/parent/...`, `depth` times: where an ancestor image is, from this one.
fn parent_path(depth: u32) -> String {
    vec![gpusnap_image::PARENT_LINK; depth as usize].join("/")
}

fn write_process_text(out: &mut impl Write, m: &Manifest) -> io::Result<()> {
    let t = totals(m);
    // A kfd-path manifest records the KFD ioctl version as major * 1000 + minor.
    let driver = match m.path {
        CheckpointPath::Kfd => format!(
            "AMD KFD ioctl {}.{}",
            m.driver_version / 1000,
            m.driver_version % 1000
        ),
        _ => format!("driver {}", m.driver_version),
    };
    writeln!(
        out,
        "process {} ({} path), gpusnap {}, {driver}, created {} (unix)",
        m.nspid,
        path_name(&m.path),
        m.gpusnap_version,
        m.created_unix_s
    )?;
    for g in &m.gpus {
        writeln!(
            out,
            "  GPU {}: {} ({}), uuid {}",
            g.ordinal,
            g.name,
            util::bytes(g.total_mem),
            g.uuid
        )?;
    }
    let moved = m.allocations.iter().filter(|a| a.moved).count();
    writeln!(
        out,
        "  allocations: {} ({} moved by gpusnap, {} saved by the driver)",
        m.allocations.len(),
        moved,
        m.allocations.len() - moved
    )?;
    for a in &m.allocations {
        writeln!(
            out,
            "    {:#016x}  {:>10}  GPU {}  {}",
            a.addr,
            util::bytes(a.size),
            a.device,
            if a.moved { "moved" } else { "driver-saved" }
        )?;
    }
    let ratio = util::ratio(t.moved, t.stored).map_or("-".to_owned(), |r| format!("{r:.2}x"));
    writeln!(
        out,
        "  data: {} in {} chunks, {} files; stored {} (compression {ratio}); driver-saved {}",
        util::bytes(t.moved),
        m.chunks.len(),
        m.files.len(),
        util::bytes(t.stored),
        util::bytes(t.driver_saved),
    )?;
    writeln!(
        out,
        "  device: {} of {} chunks hashed on the GPU; {} all zero ({}, recorded, not stored)",
        t.device_hashed,
        m.chunks.len(),
        t.zero_chunks,
        util::bytes(t.zero_bytes),
    )?;
    if !t.referenced.is_empty() {
        let parts: Vec<String> = t
            .referenced
            .iter()
            .map(|(d, (n, b))| {
                format!("{} in {n} chunks from {}", util::bytes(*b), parent_path(*d))
            })
            .collect();
        writeln!(
            out,
            "  incremental: stored here {} in {} chunks; referenced unchanged {} in {} chunks ({})",
            util::bytes(t.stored_here),
            t.here_chunks,
            util::bytes(t.referenced_bytes()),
            t.referenced_chunks(),
            parts.join(", ")
        )?;
    }
    if let Some(r) = &m.requires {
        let id = r.driver_stack_identity(m.driver_version);
        writeln!(
            out,
            "  needs: driver stack {}",
            if id.is_empty() { "(not recorded)" } else { &id }
        )?;
        for (o, b) in &r.gpu_mem_used {
            writeln!(
                out,
                "  needs: {} of device memory on GPU {o}",
                util::bytes(*b)
            )?;
        }
    }
    if !m.timings_s.is_empty() {
        let phases: Vec<String> = m
            .timings_s
            .iter()
            .map(|(k, v)| format!("{k} {v:.3} s"))
            .collect();
        writeln!(out, "  timings: {}", phases.join(", "))?;
    }
    Ok(())
}
