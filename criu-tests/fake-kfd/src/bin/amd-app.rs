//! The stand-in AMD GPU process: what a HIP program does through ROCr, against the stand-in
//! KFD. It opens `<dir>/kfd` and one render node per GPU it uses, binds the GPUs, allocates per
//! GPU a VRAM buffer (filled by its queue with a pattern) and a doorbell page (no contents), one
//! GTT counter buffer that its queue counts in, starts its queue, then runs the usual counter
//! workload on the CPU (`test_workload`), holding the files open.
//!
//! Usage: `amd-app --dir DIR --log FILE --seed N [--gpus K] [--bo-kib N] [--children C]`
//!
//! With `--children C` it first forks C children, each an AMD process of its own (log
//! `child<i>.log` beside FILE, seed N+i+1).
//!
//! Like a ROCm process, it maps its buffer objects into its address space at their GPU virtual
//! addresses: each VRAM buffer through its GPU's render node and each doorbell page through
//! the `kfd` node, at the mmap offsets the KFD gave them (the stand-in KFD writes a tag naming
//! the BO there). `--map-foreign PATH` also maps the first page of PATH (another device,
//! which gpusnap must not take).

use std::fs::OpenOptions;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::process::ExitCode;

use gpusnap_rocm::kfd::standin::{self, StandinKfd, request};
use gpusnap_rocm::kfd::sys::{
    KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL, KFD_IOC_ALLOC_MEM_FLAGS_GTT, KFD_IOC_ALLOC_MEM_FLAGS_VRAM,
};
use test_workload::{BUFFER_BYTES, arg, fill_buffer, run_counter};

/// Where the buffers go in the (stand-in) GPU virtual address space.
const VA_BASE: u64 = 0x7f00_0000_0000;
const VA_STEP: u64 = 0x1_0000_0000;
pub const COUNTER_VA: u64 = 0x7e00_0000_0000;
/// Where `--map-foreign` maps its page.
pub const FOREIGN_VA: u64 = 0x7d00_0000_0000;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(log), Some(seed)) = (
        arg(&args, "--dir"),
        arg(&args, "--log"),
        arg(&args, "--seed").and_then(|s| s.parse::<u64>().ok()),
    ) else {
        eprintln!("usage: amd-app --dir DIR --log FILE --seed N [--gpus K] [--bo-kib N]");
        return ExitCode::from(2);
    };
    let ngpus: usize = arg(&args, "--gpus")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let bo_kib: u64 = arg(&args, "--bo-kib")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    let children: u32 = arg(&args, "--children")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let dir = PathBuf::from(dir);
    let mut log = PathBuf::from(log);
    let mut seed = seed;
    for i in 0..children {
        // SAFETY: fork in a single-threaded program; the child only runs this program's code.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            eprintln!("amd-app: fork: {}", std::io::Error::last_os_error());
            return ExitCode::FAILURE;
        }
        if pid == 0 {
            // A child: its own KFD process, log and seed.
            log = log.with_file_name(format!("child{i}.log"));
            seed += u64::from(i) + 1;
            break;
        }
    }
    let foreign = arg(&args, "--map-foreign");
    let files = match setup(&dir, ngpus, bo_kib << 10, seed, foreign.as_deref()) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("amd-app: {e}");
            return ExitCode::FAILURE;
        }
    };
    let buf = fill_buffer(seed, BUFFER_BYTES);
    let r = run_counter(&log, seed, &buf);
    drop(files);
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("amd-app: {e}");
            ExitCode::FAILURE
        }
    }
}

fn open_rw(p: &std::path::Path) -> Result<OwnedFd, String> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .map(OwnedFd::from)
        .map_err(|e| format!("open {}: {e}", p.display()))
}

/// Opens and binds everything; returns the files to hold open.
/// `mmap(addr, len, RW, MAP_SHARED | MAP_FIXED_NOREPLACE, fd, offset)`, kept for the life of
/// the process.
fn map_at(fd: &OwnedFd, addr: u64, len: u64, offset: u64) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    // SAFETY: a new shared mapping at an address nothing else uses (MAP_FIXED_NOREPLACE fails
    // rather than replace a mapping); it is never unmapped, so nothing dangles.
    let p = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED_NOREPLACE,
            fd.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED || p as u64 != addr {
        return Err(format!(
            "mmap {len:#x} bytes at {addr:#x} (offset {offset:#x}): {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

fn setup(
    dir: &std::path::Path,
    ngpus: usize,
    bo_size: u64,
    seed: u64,
    foreign: Option<&str>,
) -> Result<Vec<OwnedFd>, String> {
    let k = StandinKfd::new(dir);
    let gpus = gpusnap_rocm::topology::read_gpus(&dir.join(standin::TOPOLOGY))
        .map_err(|e| e.to_string())?;
    if gpus.len() < ngpus {
        return Err(format!(
            "{ngpus} GPUs wanted, the topology has {}",
            gpus.len()
        ));
    }
    let kfd = open_rw(&dir.join(standin::KFD_NODE))?;
    let call = |kind, payload: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]| {
        k.call(kind, 0, payload, fds)
            .map_err(|e| format!("stand-in KFD request {kind}: {e}"))
    };
    call(request::OPEN, &[], &[kfd.as_fd()])?;
    let mut files = vec![];
    let alloc = |gpu_id: u32, flags: u32, va: u64, size: u64| -> Result<u64, String> {
        let mut p = gpu_id.to_le_bytes().to_vec();
        p.extend_from_slice(&flags.to_le_bytes());
        p.extend_from_slice(&va.to_le_bytes());
        p.extend_from_slice(&size.to_le_bytes());
        let (reply, _) = call(request::ALLOC, &p, &[kfd.as_fd()])?;
        reply
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8")))
            .ok_or_else(|| "ALLOC: short reply".to_owned())
    };
    for (i, g) in gpus.iter().take(ngpus).enumerate() {
        let minor = g.drm_render_minor.ok_or("a GPU without render node")?;
        let render = open_rw(&dir.join(standin::render_node_name(minor)))?;
        call(
            request::ACQUIRE_VM,
            &g.gpu_id.to_le_bytes(),
            &[kfd.as_fd(), render.as_fd()],
        )?;
        let va = VA_BASE + i as u64 * VA_STEP;
        let off = alloc(g.gpu_id, KFD_IOC_ALLOC_MEM_FLAGS_VRAM, va, bo_size)?;
        map_at(&render, va, bo_size.next_multiple_of(4096), off)?;
        let db_va = va + bo_size.next_multiple_of(1 << 21);
        let db = alloc(g.gpu_id, KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL, db_va, 8192)?;
        map_at(&kfd, db_va, 8192, db)?;
        files.push(render);
    }
    alloc(
        gpus[0].gpu_id,
        KFD_IOC_ALLOC_MEM_FLAGS_GTT,
        COUNTER_VA,
        4096,
    )?;
    let mut p = COUNTER_VA.to_le_bytes().to_vec();
    p.extend_from_slice(&seed.to_le_bytes());
    call(request::START, &p, &[kfd.as_fd()])?;
    if let Some(path) = foreign {
        let f = open_rw(std::path::Path::new(path))?;
        map_at(&f, FOREIGN_VA, 4096, 0)?;
    }
    files.push(kfd);
    Ok(files)
}
