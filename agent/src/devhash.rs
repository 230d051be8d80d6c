//! Chunk hashes computed on the GPU: gpusnap-sum64 (`gpusnap_proto::devhash`) by the agent's
//! own kernel, `devhash/sum64.ptx` (built from `gpu/devhash/sum64.cu` with nvcc, committed so
//! that building gpusnap needs no CUDA toolkit), loaded on each device on first use.
//!
//! Reading device memory at HBM speed costs milliseconds where copying it to the host costs
//! seconds, so the dump learns from these hashes which chunks are all zero (never copied) and
//! records a hash the restore checks on the device after loading. Everything here is an
//! optimisation or an extra check: where the kernel cannot be loaded (an older driver that
//! cannot compile this PTX, say) the chunk gets no hash, and data moves as before.

use std::ffi::{CStr, c_void};

use cudarc::driver::sys::{CUdeviceptr, CUfunction};
use gpusnap_proto::devhash;

use crate::cu::CuError;
use crate::gpu::Gpu;
use crate::log::debug;
use crate::plan::Chunk;
use crate::real::Driver;

/// The kernel, NUL-terminated as `cuModuleLoadData` wants PTX text.
const PTX: &str = concat!(include_str!("devhash/sum64.ptx"), "\0");
const KERNEL: &CStr = c"gpusnap_sum64";
const THREADS: u32 = 256;
/// Enough blocks to fill a large GPU (132 SMs × 8); each thread strides over the rest.
const MAX_BLOCKS: u32 = 1056;

/// One chunk's result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHash {
    /// The recorded hash ([`devhash::finish`] of the kernel's sum).
    pub hash: u64,
    /// Every word of the chunk was zero.
    pub zero: bool,
}

/// Loads the kernel on the current device (the caller activated it).
pub fn load(drv: &Driver) -> Result<CUfunction, CuError> {
    let ptx = CStr::from_bytes_with_nul(PTX.as_bytes()).expect("one NUL, at the end");
    drv.load_function(ptx, KERNEL)
}

/// Hashes `chunks` on their devices. One entry per chunk, `None` where it was not hashed: the
/// kernel is unavailable on its device (said once in the debug log), its length is not a
/// multiple of 8, or a driver call of the pass failed (logged; the data itself is untouched,
/// the kernel only reads it).
pub fn hash_chunks(gpu: &mut Gpu, drv: &Driver, chunks: &[Chunk]) -> Vec<Option<ChunkHash>> {
    let mut out = vec![None; chunks.len()];
    let mut devices: Vec<i32> = chunks.iter().map(|c| c.device).collect();
    devices.sort_unstable();
    devices.dedup();
    for dev in devices {
        let idx: Vec<usize> = (0..chunks.len())
            .filter(|&i| chunks[i].device == dev && chunks[i].len.is_multiple_of(8))
            .collect();
        if idx.is_empty() {
            continue;
        }
        match hash_on(gpu, drv, dev, chunks, &idx) {
            Ok(results) => {
                for (i, r) in idx.into_iter().zip(results) {
                    out[i] = Some(r);
                }
            }
            Err(e) => debug!("device {dev}: chunks not hashed on the GPU: {e}"),
        }
    }
    out
}

/// One device's pass: a zeroed result buffer of two words per chunk, one launch per chunk on
/// the device's first stream, one copy back, the buffer freed.
fn hash_on(
    gpu: &mut Gpu,
    drv: &Driver,
    dev: i32,
    chunks: &[Chunk],
    idx: &[usize],
) -> Result<Vec<ChunkHash>, String> {
    let func = gpu.hasher(drv, dev)?;
    let stream = gpu.activate(drv, dev).map_err(|e| e.to_string())?.streams[0];
    let words = 2 * idx.len();
    let bytes = (words * 8) as u64;
    let buf = drv.alloc_plain(bytes).map_err(|e| e.to_string())?;
    let result = (|| -> Result<Vec<u64>, CuError> {
        drv.memset_async(buf, 0, bytes, stream)?;
        for (k, &i) in idx.iter().enumerate() {
            let c = &chunks[i];
            let mut base: CUdeviceptr = c.addr;
            let mut n: u64 = c.len / 8;
            let mut slot: CUdeviceptr = buf + 16 * k as u64;
            let blocks = n.div_ceil(THREADS as u64).clamp(1, MAX_BLOCKS as u64) as u32;
            let mut params: [*mut c_void; 3] = [
                (&raw mut base).cast(),
                (&raw mut n).cast(),
                (&raw mut slot).cast(),
            ];
            // SAFETY: the three parameters are the kernel's (const u64*, u64, u64*), each a
            // live local for the call (the driver copies them at launch); the kernel reads
            // [addr, addr+len), a mapped converted allocation (application threads stopped),
            // and adds into its own two words of `buf`.
            unsafe { drv.launch_1d(func, blocks, THREADS, stream, &mut params)? };
        }
        let mut host = vec![0u64; words];
        // SAFETY: host has room for `bytes`; the copy is waited for right after, before host
        // is read or dropped (pageable memory: the driver stages it).
        unsafe { drv.copy_dtoh_async(host.as_mut_ptr().cast(), buf, bytes, stream)? };
        drv.sync_stream(stream)?;
        Ok(host)
    })();
    if let Err(e) = drv.free_plain(buf) {
        debug!("freeing the hash buffer: {e}");
    }
    let host = result.map_err(|e| e.to_string())?;
    Ok(idx
        .iter()
        .enumerate()
        .map(|(k, &i)| ChunkHash {
            hash: devhash::finish(host[2 * k], chunks[i].len),
            zero: host[2 * k + 1] == 0,
        })
        .collect())
}
