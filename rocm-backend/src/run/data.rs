//! Buffer-object contents to and from gpusnap's data files: the same `DataFileWriter`s,
//! chunk records, checksums and manifest entries as the CUDA split path, one writer thread per
//! data file (`writer_threads`, 0: [`Config::effective_writer_threads`]). BOs are cut into chunks of at most [`CHUNK`] bytes and handed out GPU by GPU in
//! turn, so every GPU has chunks in flight at once; at restore, one reader thread per data file
//! checks each chunk and writes it straight into its BO's mapping (`reader_threads`, likewise).

use gpusnap_host::pid::NsPid;
use std::collections::BTreeMap;
use std::os::fd::BorrowedFd;
use std::time::Instant;

use crate::bo::BoMapping;
use crossbeam_channel::bounded;
use gpusnap_config::Config;
use gpusnap_image::{
    ChunkEntry, Codec, DataFileReader, DataFileWriter, FileEntry, ImageError, Manifest,
};

/// Why buffer-object contents could not be written or read back.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error(transparent)]
    Image(#[from] ImageError),
    /// A chunk's range does not lie inside the mapping of its BO (a bug, or a damaged image
    /// that passed its checks).
    #[error("chunk at {addr:#x} ({len} bytes) lies outside its BO's mapping")]
    OutsideBo { addr: u64, len: u64 },
    /// A chunk of the image whose address no restored BO holds.
    #[error("chunk at {addr:#x} lies in no restored BO")]
    NoBo { addr: u64 },
    /// A writer or reader thread panicked (its panic is in the log).
    #[error("a {0} thread panicked")]
    Panicked(&'static str),
}

/// Largest chunk written (well under the format's 1 GiB).
pub const CHUNK: u64 = 64 << 20;

/// One BO to save: its GPU virtual address, its mapping and the index of its GPU.
pub struct BoSource<'a> {
    pub addr: u64,
    pub map: &'a BoMapping,
    pub gpu: usize,
}

/// What [`write_bos`] wrote.
#[derive(Debug, Default)]
pub struct Written {
    pub files: Vec<FileEntry>,
    pub chunks: Vec<ChunkEntry>,
    pub bytes: u64,
    pub seconds: f64,
    /// Writer threads that ran (each makes a file once it gets a chunk).
    pub writers: usize,
}

struct Work {
    bo: usize,
    offset: u64,
    len: u64,
}

/// The chunks of every BO, GPU by GPU in turn (one chunk of GPU 0, one of GPU 1, ...).
fn schedule(bos: &[BoSource<'_>]) -> Vec<Work> {
    let mut per_gpu: BTreeMap<usize, Vec<Work>> = BTreeMap::new();
    for (i, b) in bos.iter().enumerate() {
        let len = b.map.len() as u64;
        let mut off = 0;
        while off < len {
            let n = CHUNK.min(len - off);
            per_gpu.entry(b.gpu).or_default().push(Work {
                bo: i,
                offset: off,
                len: n,
            });
            off += n;
        }
    }
    let mut queues: Vec<std::vec::IntoIter<Work>> =
        per_gpu.into_values().map(Vec::into_iter).collect();
    let mut out = Vec::new();
    loop {
        let before = out.len();
        for q in &mut queues {
            out.extend(q.next());
        }
        if out.len() == before {
            return out;
        }
    }
}

/// Writes the contents of `bos` into `gpusnap-<nspid>-data-<k>.img`, with as many writer
/// threads as `cfg` says (never more than there are chunks), fsynced when `cfg.durable`.
pub fn write_bos(
    dir: BorrowedFd<'_>,
    nspid: NsPid,
    bos: &[BoSource<'_>],
    cfg: &Config,
    codec: Codec,
) -> Result<Written, DataError> {
    let t0 = Instant::now();
    let durable = cfg.durable;
    let work = schedule(bos);
    let writers = cfg.effective_writer_threads().clamp(1, work.len().max(1));
    let (tx, rx) = bounded::<Work>(writers * 2);
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..writers)
            .map(|k| {
                let rx = rx.clone();
                s.spawn(
                    move || -> Result<(Option<FileEntry>, Vec<ChunkEntry>), DataError> {
                        gpusnap_host::signals::block_all();
                        let mut w: Option<DataFileWriter> = None;
                        let mut chunks = Vec::new();
                        for item in rx {
                            let b = &bos[item.bo];
                            let addr = b.addr + item.offset;
                            let data = b.map.slice(item.offset as usize, item.len as usize).ok_or(
                                DataError::OutsideBo {
                                    addr,
                                    len: item.len,
                                },
                            )?;
                            let writer = match &mut w {
                                Some(w) => w,
                                None => {
                                    let mut nw = DataFileWriter::create(dir, nspid, k as u32)?;
                                    nw.set_sync(durable);
                                    w.insert(nw)
                                }
                            };
                            chunks.push(writer.append_chunk(addr, data, codec)?);
                        }
                        let file = w.map(|w| w.finish()).transpose()?;
                        Ok((file, chunks))
                    },
                )
            })
            .collect();
        drop(rx);
        for item in work {
            if tx.send(item).is_err() {
                break; // every writer stopped; their errors say why
            }
        }
        drop(tx);
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(Err(DataError::Panicked("writer"))))
            .collect::<Vec<_>>()
    });
    let mut out = Written {
        writers,
        ..Written::default()
    };
    for r in results {
        let (file, chunks) = r?;
        out.files.extend(file);
        out.bytes += chunks.iter().map(|c| c.len).sum::<u64>();
        out.chunks.extend(chunks);
    }
    out.seconds = t0.elapsed().as_secs_f64();
    Ok(out)
}

/// One BO to fill at restore: its GPU virtual address and its (writable) mapping.
pub struct BoTarget<'a> {
    pub addr: u64,
    pub map: &'a BoMapping,
}

/// Reads every chunk of `m` into the BO that holds its address, one thread per data file
/// (at most as many at a time as `cfg` says). Chunks of a checked manifest never overlap, so no
/// two threads write the same bytes. Returns the bytes written and the seconds taken.
pub fn read_bos(
    dir: BorrowedFd<'_>,
    m: &Manifest,
    targets: &[BoTarget<'_>],
    cfg: &Config,
) -> Result<(u64, f64), DataError> {
    let t0 = Instant::now();
    let files = m.file_indexes();
    let readers = cfg.effective_reader_threads().clamp(1, files.len().max(1));
    let (tx, rx) = bounded::<u32>(files.len().max(1));
    for f in &files {
        // The queue holds every file and its receiver lives: a send cannot fail.
        let _ = tx.send(*f);
    }
    drop(tx);
    let results: Vec<Result<u64, DataError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..readers)
            .map(|_| {
                let rx = rx.clone();
                s.spawn(move || -> Result<u64, DataError> {
                    gpusnap_host::signals::block_all();
                    let mut bytes = 0;
                    let mut scratch = Vec::new();
                    for f in rx {
                        let r = DataFileReader::open(dir, m, f)?;
                        for (_, c) in r.chunks() {
                            let t = targets
                                .iter()
                                .find(|t| {
                                    c.addr >= t.addr
                                        && c.addr + c.len <= t.addr + t.map.len() as u64
                                })
                                .ok_or(DataError::NoBo { addr: c.addr })?;
                            // SAFETY: chunks of a checked manifest cover disjoint addresses,
                            // and each is read by exactly one thread, so this range has no other
                            // live slice; the mapping is writable (RESTORE's dma-buf).
                            let out = unsafe {
                                t.map.slice_mut((c.addr - t.addr) as usize, c.len as usize)
                            }
                            .ok_or(DataError::OutsideBo {
                                addr: c.addr,
                                len: c.len,
                            })?;
                            r.read_chunk(c, out, &mut scratch)?;
                            bytes += c.len;
                        }
                    }
                    Ok(bytes)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(Err(DataError::Panicked("reader"))))
            .collect()
    });
    let mut bytes = 0;
    for r in results {
        bytes += r?;
    }
    Ok((bytes, t0.elapsed().as_secs_f64()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn memfd(len: u64) -> std::os::fd::OwnedFd {
        use std::os::fd::FromRawFd;
        // SAFETY: memfd_create with a static name.
        let raw = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a fresh fd nothing else owns.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our memfd.
        let r = unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&fd), len as i64) };
        assert_eq!(r, 0);
        fd
    }

    /// `writer_threads = 0` (the default) means one writer per CPU, at most 16, as documented:
    /// as many data files as there are CPUs (or chunks, if fewer), and every byte reads back
    /// with `reader_threads = 0`.
    #[test]
    fn zero_threads_means_one_per_cpu() {
        let dir = std::env::temp_dir().join(format!("gpusnap-amd-data-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let d = std::fs::File::open(&dir).unwrap();
        let cfg = Config::default();
        assert_eq!(cfg.writer_threads, 0);
        let fds: Vec<_> = (0..16).map(|_| memfd(8192)).collect();
        let maps: Vec<BoMapping> = fds
            .iter()
            .map(|f| BoMapping::map(f.as_fd(), 8192, true).unwrap())
            .collect();
        for (i, m) in maps.iter().enumerate() {
            // SAFETY: the only slice of this fresh mapping.
            unsafe { m.slice_mut(0, 8192) }.unwrap().fill(i as u8 + 1);
        }
        let bos: Vec<BoSource<'_>> = maps
            .iter()
            .enumerate()
            .map(|(i, map)| BoSource {
                addr: 0x1000_0000 + (i as u64) * 0x10_0000,
                map,
                gpu: 0,
            })
            .collect();
        let w = write_bos(d.as_fd(), NsPid(9), &bos, &cfg, Codec::Raw).unwrap();
        // As many writers as CPUs (each makes its file with its first chunk, so on a busy
        // machine one writer may take every chunk: the files are not counted).
        assert_eq!(w.writers, cfg.effective_writer_threads().min(16));
        assert!(
            (1..=w.writers).contains(&w.files.len()),
            "{} files",
            w.files.len()
        );
        assert_eq!(w.bytes, 16 * 8192);
        let mut m = gpusnap_image::Manifest::begin(NsPid(9), gpusnap_image::CheckpointPath::Kfd, 0);
        m.files = w.files;
        m.chunks = w.chunks;
        let back_fds: Vec<_> = (0..16).map(|_| memfd(8192)).collect();
        let back: Vec<BoMapping> = back_fds
            .iter()
            .map(|f| BoMapping::map(f.as_fd(), 8192, true).unwrap())
            .collect();
        let targets: Vec<BoTarget<'_>> = back
            .iter()
            .zip(&bos)
            .map(|(map, b)| BoTarget { addr: b.addr, map })
            .collect();
        let (bytes, _) = read_bos(d.as_fd(), &m, &targets, &cfg).unwrap();
        assert_eq!(bytes, 16 * 8192);
        for (i, b) in back.iter().enumerate() {
            assert!(b.slice(0, 8192).unwrap().iter().all(|&x| x == i as u8 + 1));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn chunks_alternate_between_gpus_and_cover_every_bo() {
        let mk = |len: i64| {
            use std::os::fd::FromRawFd;
            // SAFETY: memfd_create with a static name.
            let raw = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC) };
            // SAFETY: a fresh fd.
            let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
            // SAFETY: ftruncate on our memfd.
            unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&fd), len) };
            fd
        };
        use std::os::fd::AsFd;
        let a = mk((CHUNK * 2 + 4096) as i64);
        let b = mk(4096);
        let ma = BoMapping::map(a.as_fd(), CHUNK * 2 + 4096, false).unwrap();
        let mb = BoMapping::map(b.as_fd(), 4096, false).unwrap();
        let bos = [
            BoSource {
                addr: 0x1000_0000,
                map: &ma,
                gpu: 0,
            },
            BoSource {
                addr: 0x9000_0000,
                map: &mb,
                gpu: 1,
            },
        ];
        let w = schedule(&bos);
        let order: Vec<(usize, u64)> = w.iter().map(|w| (w.bo, w.offset)).collect();
        assert_eq!(order, vec![(0, 0), (1, 0), (0, CHUNK), (0, 2 * CHUNK)]);
        assert_eq!(
            w.iter().map(|w| w.len).sum::<u64>(),
            CHUNK * 2 + 4096 + 4096
        );
    }
}
