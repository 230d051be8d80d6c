//! Buffer-object contents to and from gpusnap's data files: the same `DataFileWriter`s,
//! chunk records, checksums and manifest entries as the CUDA split path, one writer thread per
//! data file. BOs are cut into chunks of at most [`CHUNK`] bytes and handed out GPU by GPU in
//! turn, so every GPU has chunks in flight at once; at restore, one reader thread per data file
//! checks each chunk and writes it straight into its BO's mapping.

use std::collections::BTreeMap;
use std::os::fd::BorrowedFd;
use std::time::Instant;

use crossbeam_channel::bounded;
use gpusnap_image::{ChunkEntry, Codec, DataFileReader, DataFileWriter, FileEntry, Manifest};
use gpusnap_rocm::bo::BoMapping;

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

/// Writes the contents of `bos` into `gpusnap-<nspid>-data-<k>.img` with `writers` threads.
pub fn write_bos(
    dir: BorrowedFd<'_>,
    nspid: u32,
    bos: &[BoSource<'_>],
    writers: usize,
    codec: Codec,
    durable: bool,
) -> Result<Written, String> {
    let t0 = Instant::now();
    let work = schedule(bos);
    let writers = writers.clamp(1, work.len().max(1));
    let (tx, rx) = bounded::<Work>(writers * 2);
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..writers)
            .map(|k| {
                let rx = rx.clone();
                s.spawn(
                    move || -> Result<(Option<FileEntry>, Vec<ChunkEntry>), String> {
                        crate::signals::block_all();
                        let mut w: Option<DataFileWriter> = None;
                        let mut chunks = Vec::new();
                        for item in rx {
                            let b = &bos[item.bo];
                            let data = b
                                .map
                                .slice(item.offset as usize, item.len as usize)
                                .ok_or("chunk outside its BO")?;
                            if w.is_none() {
                                let mut nw = DataFileWriter::create(dir, nspid, k as u32)
                                    .map_err(|e| e.to_string())?;
                                nw.set_sync(durable);
                                w = Some(nw);
                            }
                            let writer = w.as_mut().expect("created above");
                            chunks.push(
                                writer
                                    .append_chunk(b.addr + item.offset, data, codec)
                                    .map_err(|e| e.to_string())?,
                            );
                        }
                        let file = w
                            .map(|w| w.finish())
                            .transpose()
                            .map_err(|e| e.to_string())?;
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
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a writer thread panicked".into()))
            })
            .collect::<Vec<_>>()
    });
    let mut out = Written::default();
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
/// (at most `readers` at a time). Chunks of a checked manifest never overlap, so no two threads
/// write the same bytes. Returns the bytes written and the seconds taken.
pub fn read_bos(
    dir: BorrowedFd<'_>,
    m: &Manifest,
    targets: &[BoTarget<'_>],
    readers: usize,
) -> Result<(u64, f64), String> {
    let t0 = Instant::now();
    let files = m.file_indexes();
    let readers = readers.clamp(1, files.len().max(1));
    let (tx, rx) = bounded::<u32>(files.len().max(1));
    for f in &files {
        tx.send(*f).map_err(|e| e.to_string())?;
    }
    drop(tx);
    let results: Vec<Result<u64, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..readers)
            .map(|_| {
                let rx = rx.clone();
                s.spawn(move || -> Result<u64, String> {
                    crate::signals::block_all();
                    let mut bytes = 0;
                    let mut scratch = Vec::new();
                    for f in rx {
                        let r = DataFileReader::open(dir, m, f).map_err(|e| e.to_string())?;
                        for (_, c) in r.chunks() {
                            let t = targets
                                .iter()
                                .find(|t| {
                                    c.addr >= t.addr
                                        && c.addr + c.len <= t.addr + t.map.len() as u64
                                })
                                .ok_or_else(|| {
                                    format!("chunk at {:#x} lies in no restored BO", c.addr)
                                })?;
                            // SAFETY: chunks of a checked manifest cover disjoint addresses,
                            // and each is read by exactly one thread, so this range has no other
                            // live slice; the mapping is writable (RESTORE's dma-buf).
                            let out = unsafe {
                                t.map.slice_mut((c.addr - t.addr) as usize, c.len as usize)
                            }
                            .ok_or("chunk outside its BO")?;
                            r.read_chunk(c, out, &mut scratch)
                                .map_err(|e| e.to_string())?;
                            bytes += c.len;
                        }
                    }
                    Ok(bytes)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a reader thread panicked".into()))
            })
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
