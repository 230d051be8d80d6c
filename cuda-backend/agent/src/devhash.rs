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
    let passes = Passes::prepare(gpu, drv, &counts(chunks));
    let out = passes.run(gpu, drv, chunks);
    passes.free(gpu, drv);
    out
}

/// Chunks per device that the kernel can hash, by device.
pub fn counts(chunks: &[Chunk]) -> Vec<(i32, usize)> {
    let mut v: Vec<(i32, usize)> = Vec::new();
    for c in chunks.iter().filter(|c| c.len.is_multiple_of(8)) {
        match v.iter_mut().find(|(d, _)| *d == c.device) {
            Some((_, n)) => *n += 1,
            None => v.push((c.device, 1)),
        }
    }
    v
}

/// One device's hash pass, made ready (kernel loaded, result buffer allocated) before any
/// chunk is known exactly, so that a pre-copy round can run the launches alone while it holds
/// the allocation table: loading a module or freeing memory may wait for the application's
/// work, which must never happen under the table.
struct Pass {
    dev: i32,
    func: CUfunction,
    stream: cudarc::driver::sys::CUstream,
    buf: CUdeviceptr,
    /// Chunks the buffer has room for.
    capacity: usize,
}

/// The passes of every device, and the devices whose pass could not be made ready (their
/// chunks go unhashed).
pub struct Passes(Vec<Pass>);

impl Passes {
    /// Ready passes for `counts` (chunks per device) on the agent's prepared devices.
    pub fn prepare(gpu: &mut Gpu, drv: &Driver, counts: &[(i32, usize)]) -> Passes {
        let mut v = Vec::new();
        for &(dev, capacity) in counts {
            let made = (|| -> Result<Pass, CuError> {
                let func = gpu.hasher(drv, dev, load)?;
                let stream = gpu.activate(drv, dev)?.streams[0];
                let buf = drv.alloc_plain(16 * capacity as u64)?;
                Ok(Pass {
                    dev,
                    func,
                    stream,
                    buf,
                    capacity,
                })
            })();
            match made {
                Ok(p) => v.push(p),
                Err(e) => debug!("device {dev}: chunks not hashed on the GPU: {e}"),
            }
        }
        Passes(v)
    }

    /// Whether every device of `counts` has a pass with room for its chunks.
    pub fn fit(&self, counts: &[(i32, usize)]) -> bool {
        counts.iter().all(|&(dev, n)| {
            self.0
                .iter()
                .find(|p| p.dev == dev)
                .is_none_or(|p| n <= p.capacity)
        })
    }

    /// Hashes `chunks` (which must [`fit`](Self::fit)): launches and waits for the agent's own
    /// stream only. One entry per chunk, as [`hash_chunks`].
    pub fn run(&self, gpu: &mut Gpu, drv: &Driver, chunks: &[Chunk]) -> Vec<Option<ChunkHash>> {
        let mut out = vec![None; chunks.len()];
        for p in &self.0 {
            let idx: Vec<usize> = (0..chunks.len())
                .filter(|&i| chunks[i].device == p.dev && chunks[i].len.is_multiple_of(8))
                .collect();
            if idx.is_empty() || idx.len() > p.capacity {
                continue;
            }
            match p.run(gpu, drv, chunks, &idx) {
                Ok(results) => {
                    for (i, r) in idx.into_iter().zip(results) {
                        out[i] = Some(r);
                    }
                }
                Err(e) => debug!("device {}: chunks not hashed on the GPU: {e}", p.dev),
            }
        }
        out
    }

    /// Frees the result buffers (this may wait for the device: never under the table).
    pub fn free(self, gpu: &mut Gpu, drv: &Driver) {
        for p in self.0 {
            if let Err(e) = gpu
                .activate(drv, p.dev)
                .map(|_| ())
                .and_then(|()| drv.free_plain(p.buf))
            {
                debug!("freeing the hash buffer: {e}");
            }
        }
    }
}

impl Pass {
    /// A zeroed result buffer of two words per chunk, one launch per chunk on the device's
    /// first stream, one copy back, waited for on that stream.
    fn run(
        &self,
        gpu: &mut Gpu,
        drv: &Driver,
        chunks: &[Chunk],
        idx: &[usize],
    ) -> Result<Vec<ChunkHash>, CuError> {
        gpu.activate(drv, self.dev)?;
        let (func, stream, buf) = (self.func, self.stream, self.buf);
        let words = 2 * idx.len();
        let bytes = (words * 8) as u64;
        drv.memset_async(buf, 0, bytes, stream)?;
        for (k, &i) in idx.iter().enumerate() {
            let c = &chunks[i];
            let mut base: CUdeviceptr = c.at;
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
            // [addr, addr+len), a mapped converted allocation (application threads stopped,
            // or, in a pre-copy round, the table held until the pass is waited for below), and
            // adds into its own two words of `buf` (room for `capacity` >= idx.len() chunks).
            unsafe { drv.launch_1d(func, blocks, THREADS, stream, &mut params)? };
        }
        let mut host = vec![0u64; words];
        // SAFETY: host has room for `bytes`; the copy is waited for right after, before host
        // is read or dropped (pageable memory: the driver stages it).
        unsafe { drv.copy_dtoh_async(host.as_mut_ptr().cast(), buf, bytes, stream)? };
        drv.sync_stream(stream)?;
        Ok(idx
            .iter()
            .enumerate()
            .map(|(k, &i)| ChunkHash {
                hash: devhash::finish(host[2 * k], chunks[i].len),
                zero: host[2 * k + 1] == 0,
            })
            .collect())
    }
}
