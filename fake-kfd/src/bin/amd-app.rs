//! The stand-in AMD GPU process: what a HIP program does through ROCr, against the stand-in
//! KFD. It opens `<dir>/kfd` and one render node per GPU it uses, binds the GPUs, allocates per
//! GPU a VRAM buffer (filled by its queue with a pattern) and a doorbell page (no contents), one
//! GTT counter buffer that its queue counts in, starts its queue, then runs the usual counter
//! workload on the CPU (`criu_tests::workload`), holding the files open.
//!
//! Usage: `amd-app --dir DIR --log FILE --seed N [--gpus K] [--bo-kib N] [--children C]`
//!
//! With `--children C` it first forks C children, each an AMD process of its own (log
//! `child<i>.log` beside FILE, seed N+i+1).

use std::fs::OpenOptions;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::process::ExitCode;

use criu_tests::workload::{BUFFER_BYTES, arg, fill_buffer, run_counter};
use gpusnap_rocm::kfd::standin::{self, StandinKfd, request};
use gpusnap_rocm::kfd::sys::{
    KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL, KFD_IOC_ALLOC_MEM_FLAGS_GTT, KFD_IOC_ALLOC_MEM_FLAGS_VRAM,
};

/// Where the buffers go in the (stand-in) GPU virtual address space.
const VA_BASE: u64 = 0x7f00_0000_0000;
const VA_STEP: u64 = 0x1_0000_0000;
pub const COUNTER_VA: u64 = 0x7e00_0000_0000;

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
    let files = match setup(&dir, ngpus, bo_kib << 10, seed) {
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
fn setup(
    dir: &std::path::Path,
    ngpus: usize,
    bo_size: u64,
    seed: u64,
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
    let alloc = |gpu_id: u32, flags: u32, va: u64, size: u64| {
        let mut p = gpu_id.to_le_bytes().to_vec();
        p.extend_from_slice(&flags.to_le_bytes());
        p.extend_from_slice(&va.to_le_bytes());
        p.extend_from_slice(&size.to_le_bytes());
        call(request::ALLOC, &p, &[kfd.as_fd()])
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
        alloc(g.gpu_id, KFD_IOC_ALLOC_MEM_FLAGS_VRAM, va, bo_size)?;
        alloc(
            g.gpu_id,
            KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL,
            va + bo_size.next_multiple_of(1 << 21),
            8192,
        )?;
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
    files.push(kfd);
    Ok(files)
}
