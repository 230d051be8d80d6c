//! Disk space held for a drain: the bytes the GPU data will take, allocated in the image
//! directory's file system while the dump can still fail. A drain runs beside CRIU's own dump,
//! after CRIU has decided its part succeeded, and CRIU's end-of-dump hook cannot fail the dump;
//! so a disk that fills up then would leave a "successful" dump without its GPU data. The space
//! is taken at the checkpoint, where a full disk still fails the dump and the job stays intact,
//! and handed back piece by piece just before the drain writes each chunk.
//!
//! The reservation is an unnamed file (`O_TMPFILE`) in the image directory, with its blocks
//! allocated (`fallocate`): it has no name to leave behind, and the kernel frees it when the
//! process that holds it exits, whatever kills it.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Mutex;

use crate::sys;

/// What a chunk costs on disk beyond its bytes, at most: its record header and the rounding of
/// its file to a page (a reservation holds it per chunk and per file).
pub const CHUNK_OVERHEAD: u64 = 4096;

/// Space held in the image directory's file system for data not yet written.
#[derive(Debug)]
pub struct Reservation {
    /// The pieces, each an unnamed file holding `held` bytes split as [`piece_lengths`] says.
    files: Vec<File>,
    /// Bytes still held, all pieces together.
    held: Mutex<u64>,
    /// The bytes first held.
    bytes: u64,
}

/// Why no space could be held.
#[derive(Debug, thiserror::Error)]
pub enum ReserveError {
    /// The file system has not that much free space (`ENOSPC`, `EDQUOT`).
    #[error("the image directory's file system has not {bytes} bytes free for the GPU data: {err}")]
    NoSpace { bytes: u64, err: io::Error },
    /// The file system cannot hold space this way (no `O_TMPFILE` or no `fallocate`): the
    /// drain goes on without a reservation.
    #[error("the image directory's file system cannot reserve space ({0})")]
    Unsupported(io::Error),
    #[error("reserving space in the image directory: {0}")]
    Io(io::Error),
}

/// The least a piece holds: below this, one more thread costs more than it saves.
const MIN_PIECE: u64 = 256 << 20;

/// How `bytes` split into at most `pieces` pieces of whole pages, the first ones the largest.
fn piece_lengths(bytes: u64, pieces: usize) -> Vec<u64> {
    let pages = bytes.div_ceil(4096);
    let n = (pieces.max(1) as u64)
        .min(bytes.div_ceil(MIN_PIECE).max(1))
        .min(pages.max(1));
    (0..n)
        .map(|i| (pages / n + u64::from(i < pages % n)) * 4096)
        .collect()
}

impl Reservation {
    /// Holds `bytes` bytes in the file system of `dir`, allocated by up to `threads` threads at
    /// once. On tmpfs (CRIU's images in `/dev/shm`) an allocation is a zeroed page each, about
    /// 6 GiB/s for one thread: 16 GiB would add 2.7 s to the job's pause. Each piece is a file
    /// of its own, so that the kernel's per-file lock does not put the threads in a line.
    pub fn take(
        dir: BorrowedFd<'_>,
        bytes: u64,
        threads: usize,
    ) -> Result<Reservation, ReserveError> {
        if bytes > libc::off_t::MAX as u64 {
            return Err(ReserveError::NoSpace {
                bytes,
                err: io::Error::from_raw_os_error(libc::EFBIG),
            });
        }
        let lengths = if bytes == 0 {
            vec![0]
        } else {
            piece_lengths(bytes, threads)
        };
        let files = lengths
            .iter()
            .map(|_| open_piece(dir))
            .collect::<Result<Vec<File>, ReserveError>>()?;
        let results: Vec<Result<(), io::Error>> = std::thread::scope(|scope| {
            let handles: Vec<_> = files
                .iter()
                .zip(&lengths)
                .skip(1)
                .map(|(f, &len)| scope.spawn(move || allocate(f, len)))
                .collect();
            let mut results = vec![allocate(&files[0], lengths[0])];
            results.extend(handles.into_iter().map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(io::Error::other("a reserving thread panicked")))
            }));
            results
        });
        if let Some(err) = results.into_iter().find_map(Result::err) {
            // The files are dropped here, and with them what was allocated.
            return Err(match err.raw_os_error() {
                Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => {
                    ReserveError::NoSpace { bytes, err }
                }
                _ if unsupported(&err) => ReserveError::Unsupported(err),
                _ => ReserveError::Io(err),
            });
        }
        Ok(Reservation {
            files,
            held: Mutex::new(bytes),
            bytes,
        })
    }

    /// Hands `bytes` of the held space back to the file system (a writer is about to write
    /// that much); what is not held any more is not handed back twice.
    pub fn release(&self, bytes: u64) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if *held == 0 {
            return;
        }
        *held = held.saturating_sub(bytes);
        // The pieces are emptied from the last: each keeps what `held` still covers of it.
        // Shrinking a file frees the blocks past its new end; a failure only keeps space held
        // longer (until the reservation is dropped).
        let mut left = *held;
        for (f, len) in self
            .files
            .iter()
            .zip(piece_lengths(self.bytes, self.files.len()))
        {
            let keep = left.min(len);
            left -= keep;
            if keep < len {
                let _ = f.set_len(keep);
            }
        }
    }

    /// The bytes still held.
    pub fn held(&self) -> u64 {
        *self.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL | libc::ENOSYS)
    )
}

/// An unnamed file in `dir`: nothing to leave behind, freed by the kernel with its last
/// descriptor, whatever kills the process.
fn open_piece(dir: BorrowedFd<'_>) -> Result<File, ReserveError> {
    sys::open_at(dir, ".", libc::O_TMPFILE | libc::O_RDWR, 0o600).map_err(|e| {
        if unsupported(&e) {
            ReserveError::Unsupported(e)
        } else {
            ReserveError::Io(e)
        }
    })
}

/// Allocates `len` bytes of `file`'s blocks.
fn allocate(file: &File, len: u64) -> Result<(), io::Error> {
    if len == 0 {
        return Ok(());
    }
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: fallocate on a descriptor the caller's reservation owns; no memory is passed.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// The bytes each piece has allocated (its blocks, not its length): what it holds in the
    /// file system, whatever else the machine writes meanwhile.
    fn allocated(r: &Reservation) -> Vec<u64> {
        use std::os::unix::fs::MetadataExt;
        r.files
            .iter()
            .map(|f| f.metadata().unwrap().blocks() * 512)
            .collect()
    }

    #[test]
    fn space_is_held_and_handed_back() {
        let path = std::env::temp_dir().join(format!("gpusnap-reserve-{}", std::process::id()));
        std::fs::create_dir_all(&path).unwrap();
        let dir = File::open(&path).unwrap();
        let r = match Reservation::take(dir.as_fd(), 64 << 20, 1) {
            Ok(r) => r,
            Err(ReserveError::Unsupported(e)) => {
                eprintln!("image: SKIPPED space_is_held_and_handed_back: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert!(allocated(&r)[0] >= 64 << 20, "{:?}", allocated(&r));
        r.release(32 << 20);
        assert_eq!(r.held(), 32 << 20);
        assert!(allocated(&r)[0] <= 33 << 20, "{:?}", allocated(&r));
        drop(r);
        // Nothing named is left behind.
        assert_eq!(std::fs::read_dir(&path).unwrap().count(), 0);
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn more_than_the_disk_holds_is_no_space() {
        let dir = File::open(std::env::temp_dir()).unwrap();
        match Reservation::take(dir.as_fd(), u64::MAX / 4, 4) {
            Err(ReserveError::NoSpace { .. } | ReserveError::Unsupported(_)) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn pieces_cover_the_bytes_in_whole_pages() {
        assert_eq!(piece_lengths(1, 16), vec![4096]);
        assert_eq!(piece_lengths(MIN_PIECE, 16), vec![MIN_PIECE]);
        let p = piece_lengths(16 << 30, 16);
        assert_eq!(p.len(), 16);
        assert!(p.iter().all(|&l| l == 1 << 30));
        let odd = (3 << 30) + 4096 * 3 + 1;
        let p = piece_lengths(odd, 5);
        assert_eq!(p.len(), 5);
        assert!(p.iter().sum::<u64>() >= odd && p.iter().sum::<u64>() < odd + 4096);
        assert!(p.iter().all(|l| l % 4096 == 0));
        assert!(p.windows(2).all(|w| w[0] >= w[1] && w[0] - w[1] <= 4096));
    }

    #[test]
    fn pieces_are_held_in_parallel_and_handed_back_from_the_last() {
        let path = std::env::temp_dir().join(format!("gpusnap-reserve-p-{}", std::process::id()));
        std::fs::create_dir_all(&path).unwrap();
        let dir = File::open(&path).unwrap();
        let r = match Reservation::take(dir.as_fd(), 3 * MIN_PIECE, 8) {
            Ok(r) => r,
            Err(ReserveError::Unsupported(e)) => {
                eprintln!("image: SKIPPED pieces_are_held_in_parallel: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert_eq!(r.files.len(), 3);
        assert!(
            allocated(&r).iter().all(|&b| b >= MIN_PIECE),
            "{:?}",
            allocated(&r)
        );
        // Half of the second piece and all of the third go back.
        r.release(MIN_PIECE + MIN_PIECE / 2);
        let sizes: Vec<u64> = r
            .files
            .iter()
            .map(|f| f.metadata().unwrap().len())
            .collect();
        assert_eq!(sizes, vec![MIN_PIECE, MIN_PIECE / 2, 0]);
        let a = allocated(&r);
        assert!(
            a[0] >= MIN_PIECE && a[1] <= MIN_PIECE / 2 + (1 << 20) && a[2] == 0,
            "{a:?}"
        );
        r.release(u64::MAX);
        assert_eq!(r.held(), 0);
        assert!(allocated(&r).iter().all(|&b| b == 0));
        drop(r);
        assert_eq!(std::fs::read_dir(&path).unwrap().count(), 0);
        std::fs::remove_dir_all(&path).unwrap();
    }
}
