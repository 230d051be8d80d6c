//! Disk space held for a drain: the bytes the GPU data will take, allocated in the image
//! directory's file system while the dump can still fail. A drain runs beside CRIU's own dump,
//! after CRIU has decided its part succeeded, and CRIU's end-of-dump hook cannot fail the dump;
//! so a disk that fills up then would leave a "successful" dump without its GPU data. The space
//! is taken at the checkpoint, where a full disk still fails the dump and the job stays intact.
//!
//! The space is held in pieces, one per writer thread, each an unnamed file (`O_TMPFILE`) in
//! the image directory with its blocks allocated (`fallocate`); and the pieces are what the
//! drain writes into. A writer claims a piece and writes its data file into it
//! ([`DataFileWriter::create_in`](crate::DataFileWriter::create_in)); once every writer
//! is done, each file is cut to the bytes written and sealed, and only once all of them are
//! sealed does each get its name (`linkat`,
//! [`SealedDataFile::publish`](crate::SealedDataFile::publish)). So the drain writes into the
//! pages allocated at the checkpoint, instead of handing them back and allocating them again
//! (on tmpfs each is a page zeroed twice: that halved the drain's rate), and a drain that fails
//! leaves nothing named: the kernel frees an unnamed file with its last descriptor, whatever
//! kills the process.
//!
//! Chunks go to writers as they come, so a writer may write more or less than its piece. The
//! rule that keeps the total guarded: a writer writes below its piece's *held* mark (bytes
//! allocated for it, or covered by space handed back elsewhere) without asking. Before it
//! writes past the mark, it hands back as much of the space held elsewhere, and moves its mark
//! by that much: first from the pieces no writer has claimed (the last first), then from the
//! slack of the other writers' pieces (the most first; a piece's slack is what it holds past
//! the bytes its writer has announced, which its writer never writes without asking again).
//! Handing back is a truncation, which frees the blocks past the new end. So at every moment
//! the blocks the drain has allocated, written or not, are no more than were held at the
//! checkpoint; and a piece's tail that its writer did not need is cut off when the file is
//! sealed. Only a drain that writes more than was held at all (the bytes held are an upper
//! bound on what it writes) writes past the held space, unguarded, as before the reservation;
//! that is logged once. Seal the files only once every writer is done: a sealed piece's slack
//! goes back to the file system, where the other writers can no longer take it.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::sys;

/// What a chunk costs on disk beyond its bytes, at most: its record header and the rounding of
/// its file to a page (a reservation holds it per chunk and per file).
pub const CHUNK_OVERHEAD: u64 = 4096;

/// The unit the held marks move in, rounded up: a file system allocates whole blocks.
const PAGE: u64 = 4096;

/// Bytes a piece's thread allocates in one call at most, so that a stopped reservation stops
/// soon ([`Reservation::take_until`]).
const STEP: u64 = 256 << 20;

/// Space held in the image directory's file system for data not yet written.
#[derive(Debug)]
pub struct Reservation {
    /// The pieces, shared with the writers that claimed them.
    files: Arc<Pieces>,
    /// The bytes first held (every take merged in).
    bytes: u64,
}

/// The pieces of a reservation and where they are.
#[derive(Debug)]
struct Pieces {
    /// The image directory (a descriptor of its own): where fresh pieces are made, and where
    /// sealed ones get their names.
    dir: OwnedFd,
    slots: Mutex<Vec<Slot>>,
    /// A write went past the held space (logged once).
    unguarded: AtomicBool,
}

/// One piece.
#[derive(Debug)]
struct Slot {
    /// The unnamed file; `None` once the writer that claimed it let it go.
    file: Option<Arc<File>>,
    /// The held mark: below it the piece's writer writes without asking.
    held: u64,
    /// The end of what the piece's writer has announced (it writes nothing past it).
    used: u64,
    /// A writer writes into it.
    claimed: bool,
}

impl Slot {
    /// What the piece holds past the pages its writer has announced.
    fn slack(&self) -> u64 {
        if self.file.is_none() {
            return 0;
        }
        self.held.saturating_sub(self.used.next_multiple_of(PAGE))
    }

    /// Hands back up to `bytes` of the slack: the file is cut to the new mark where it is
    /// longer (a mark moved past the file's end by space freed elsewhere was never allocated,
    /// and handing it back takes nothing). A failed cut hands back nothing.
    fn hand_back(&mut self, bytes: u64) -> u64 {
        let take = self.slack().min(bytes);
        if take == 0 {
            return 0;
        }
        let mark = self.held - take;
        if let Some(f) = &self.file {
            let cut = f.metadata().and_then(|m| {
                if m.len() > mark {
                    f.set_len(mark)
                } else {
                    Ok(())
                }
            });
            if cut.is_err() {
                return 0;
            }
        }
        self.held = mark;
        take
    }
}

impl Pieces {
    fn lock(&self) -> MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pieces' files, in order (those a writer let go left out).
    #[cfg(test)]
    fn iter(&self) -> std::vec::IntoIter<Arc<File>> {
        let files: Vec<Arc<File>> = self.lock().iter().filter_map(|s| s.file.clone()).collect();
        files.into_iter()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// Hands back up to `bytes` of the space held in `slots` other than `except`'s: the unclaimed
/// pieces first, the last first, then the slack of the claimed ones, the most first. Returns
/// the bytes handed back.
fn hand_back(slots: &mut [Slot], bytes: u64, except: Option<usize>) -> u64 {
    let mut got = 0;
    for (_, s) in slots
        .iter_mut()
        .enumerate()
        .rev()
        .filter(|(j, s)| Some(*j) != except && !s.claimed)
    {
        if got == bytes {
            return got;
        }
        got += s.hand_back(bytes - got);
    }
    while got < bytes {
        let Some(s) = slots
            .iter_mut()
            .enumerate()
            .filter(|(j, s)| Some(*j) != except && s.claimed && s.slack() > 0)
            .map(|(_, s)| s)
            .max_by_key(|s| s.slack())
        else {
            break;
        };
        let took = s.hand_back(bytes - got);
        if took == 0 {
            break;
        }
        got += took;
    }
    got
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
    /// [`Reservation::take_until`] was told to stop before it had all of it.
    #[error("reserving space in the image directory: stopped before it was held")]
    Stopped,
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
        Reservation::take_until(dir, bytes, threads, &AtomicBool::new(false))
    }

    /// [`take`](Self::take), on a thread of the caller's beside other work: gives up with
    /// [`ReserveError::Stopped`] (and nothing held) soon after `stop` is set.
    pub fn take_until(
        dir: BorrowedFd<'_>,
        bytes: u64,
        threads: usize,
        stop: &AtomicBool,
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
        take_pieces(dir, &lengths, stop)
    }

    /// Adds what `other` holds to this reservation (space taken in two goes: more was needed
    /// than first held). `other`'s pieces have no writer yet.
    pub fn merge(&mut self, other: Reservation) {
        let mut theirs = other.files.lock();
        self.files.lock().extend(theirs.drain(..));
        self.bytes = self.bytes.saturating_add(other.bytes);
    }

    /// Splits off `bytes` of the held space into a reservation of its own, for a drain that
    /// runs after this one's (an asynchronous `-R`'s snapshot, drained after the part drained
    /// on the pause): the two then hold what this one held, `bytes` the new one. Whole pieces
    /// no writer has claimed move, the last first, as far as they fit in `bytes`; the remainder
    /// is evened out with the one piece that would overshoot: whichever of the shortfall or
    /// the overshoot is smaller is handed back on one side and taken fresh on the other (so at
    /// most half a piece is allocated again, the hand-back first). Before any writer has
    /// claimed a piece; a failure to take the fresh part is the file system's answer, as for
    /// [`take`](Self::take).
    pub fn split_off(&mut self, bytes: u64) -> Result<Reservation, ReserveError> {
        let mut moved: Vec<Slot> = Vec::new();
        let mut got = 0u64;
        {
            let mut slots = self.files.lock();
            for s in slots.iter_mut().rev() {
                if s.claimed || s.file.is_none() || got.saturating_add(s.held) > bytes {
                    continue;
                }
                got += s.held;
                moved.push(Slot {
                    file: s.file.take(),
                    held: std::mem::take(&mut s.held),
                    used: 0,
                    claimed: false,
                });
            }
            let short = bytes - got;
            // The unclaimed piece that overshoots the least: moved whole where its overshoot
            // is less than the shortfall.
            let next = slots
                .iter_mut()
                .filter(|s| !s.claimed && s.file.is_some())
                .min_by_key(|s| s.held);
            if let Some(s) = next
                && short > 0
                && s.held.saturating_sub(short) < short
            {
                got += s.held;
                moved.push(Slot {
                    file: s.file.take(),
                    held: std::mem::take(&mut s.held),
                    used: 0,
                    claimed: false,
                });
            }
        }
        // Slots a piece moved out of stay (empty), so that the index of a claimed piece never
        // changes.
        let mut theirs = Reservation {
            files: Arc::new(Pieces {
                dir: self.files.dir.try_clone().map_err(ReserveError::Io)?,
                slots: Mutex::new(moved),
                unguarded: AtomicBool::new(false),
            }),
            bytes: got,
        };
        self.bytes = self.bytes.saturating_sub(got);
        if got > bytes {
            let over = got - bytes;
            theirs.release(over);
            theirs.bytes = bytes;
            let fresh = Reservation::take(self.files.dir.as_fd(), over, 1)?;
            self.merge(fresh);
        } else if got < bytes {
            let short = bytes - got;
            self.release(short);
            self.bytes = self.bytes.saturating_sub(short);
            let fresh = Reservation::take(self.files.dir.as_fd(), short, 1)?;
            theirs.merge(fresh);
        }
        Ok(theirs)
    }

    /// A piece for one data file ([`DataFileWriter::create_in`](crate::DataFileWriter::create_in)
    /// claims it):
    /// the unclaimed piece that holds the most, or, where every piece has its writer, a fresh
    /// unnamed file that holds nothing yet (its writes take from the others' slack, by the
    /// rule in the module's documentation).
    pub(crate) fn claim(&self) -> io::Result<HeldFile> {
        {
            let mut slots = self.files.lock();
            let free = slots
                .iter()
                .enumerate()
                .filter(|(_, s)| !s.claimed && s.file.is_some())
                .max_by_key(|(j, s)| (s.held, std::cmp::Reverse(*j)))
                .map(|(j, _)| j);
            if let Some(j) = free {
                let s = &mut slots[j];
                s.claimed = true;
                let file = s.file.clone().expect("an unclaimed piece has its file");
                return Ok(HeldFile {
                    pieces: self.files.clone(),
                    index: j,
                    file,
                });
            }
        }
        let file = Arc::new(open_piece(self.files.dir.as_fd())?);
        let mut slots = self.files.lock();
        slots.push(Slot {
            file: Some(file.clone()),
            held: 0,
            used: 0,
            claimed: true,
        });
        Ok(HeldFile {
            pieces: self.files.clone(),
            index: slots.len() - 1,
            file,
        })
    }

    /// Hands `bytes` of the held space back to the file system: from the pieces no writer has
    /// claimed, the last first, then from the claimed pieces' slack. What is not held any more
    /// is not handed back twice.
    pub fn release(&self, bytes: u64) {
        let mut slots = self.files.lock();
        hand_back(&mut slots, bytes, None);
    }

    /// The bytes still held and not yet written.
    pub fn held(&self) -> u64 {
        self.files
            .lock()
            .iter()
            .filter(|s| s.file.is_some())
            .map(|s| s.held.saturating_sub(s.used))
            .sum()
    }

    /// The bytes first held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// How many pieces hold the space (their threads allocated it in parallel).
    pub fn pieces(&self) -> usize {
        self.files.lock().len()
    }
}

/// A piece claimed for one data file: the file, and the held space its writes stay inside
/// ([`HeldFile::room`]). Dropped, it leaves the reservation, and the kernel frees the file
/// with its last descriptor unless it was named.
#[derive(Debug)]
pub(crate) struct HeldFile {
    pieces: Arc<Pieces>,
    index: usize,
    file: Arc<File>,
}

impl HeldFile {
    pub(crate) fn file(&self) -> &Arc<File> {
        &self.file
    }

    /// Makes the held space reach `end`, before anything is written up to it: past the held
    /// mark, as much space is handed back elsewhere first (the module's rule).
    pub(crate) fn room(&self, end: u64) {
        let mut slots = self.pieces.lock();
        let me = &mut slots[self.index];
        if end <= me.held {
            me.used = me.used.max(end);
            return;
        }
        let want = end.next_multiple_of(PAGE) - me.held;
        let got = hand_back(&mut slots, want, Some(self.index));
        let me = &mut slots[self.index];
        me.held += got;
        me.used = me.used.max(end);
        if got < want && !self.pieces.unguarded.swap(true, Ordering::Relaxed) {
            log::warn!(
                "the drain writes past the space held for it ({} bytes more than held): a disk that fills up now fails it",
                want - got
            );
        }
    }

    /// Done writing at `len` bytes: the piece leaves the pool (none of it is anyone's slack
    /// any more) and the file is cut to `len`, which frees the rest of what it held.
    pub(crate) fn seal(&self, len: u64) -> io::Result<()> {
        {
            let mut slots = self.pieces.lock();
            let me = &mut slots[self.index];
            me.used = me.used.max(len);
            me.held = me.used;
        }
        self.file.set_len(len)
    }

    /// Gives the file the name `name` in the reservation's directory (a stale file of that
    /// name is removed first).
    pub(crate) fn link(&self, name: &str) -> io::Result<()> {
        let dir = self.pieces.dir.as_fd();
        sys::unlink_at(dir, name, true)?;
        sys::link_unnamed(&self.file, dir, name)
    }
}

impl Drop for HeldFile {
    fn drop(&mut self) {
        let mut slots = self.pieces.lock();
        let me = &mut slots[self.index];
        me.file = None;
        me.held = 0;
    }
}

/// Holds pieces of `lengths` bytes in `dir`, each allocated by a thread of its own.
/// The bytes `dir`'s file system can still give this process (root may use the blocks kept
/// for it), if it says.
fn free_bytes(dir: BorrowedFd<'_>) -> Option<u64> {
    // SAFETY: a zeroed statvfs is a valid value to be overwritten.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatvfs on a borrowed (so open) descriptor, into a statvfs this frame owns.
    if unsafe { libc::fstatvfs(dir.as_raw_fd(), &mut st) } != 0 {
        return None;
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let blocks = if unsafe { libc::geteuid() } == 0 {
        st.f_bfree
    } else {
        st.f_bavail
    };
    Some((blocks as u64).saturating_mul(st.f_frsize as u64))
}

fn take_pieces(
    dir: BorrowedFd<'_>,
    lengths: &[u64],
    stop: &AtomicBool,
) -> Result<Reservation, ReserveError> {
    let own = dir.try_clone_to_owned().map_err(ReserveError::Io)?;
    // More than the file system has free is refused before anything is allocated: allocating
    // up to the failure would fill the disk for a moment, under every other writer on it.
    let bytes: u64 = lengths.iter().sum();
    if let Some(free) = free_bytes(dir)
        && bytes > free
    {
        return Err(ReserveError::NoSpace {
            bytes,
            err: io::Error::from_raw_os_error(libc::ENOSPC),
        });
    }
    let files = lengths
        .iter()
        .map(|_| open_piece(dir))
        .collect::<Result<Vec<File>, io::Error>>()
        .map_err(|e| {
            if unsupported(&e) {
                ReserveError::Unsupported(e)
            } else {
                ReserveError::Io(e)
            }
        })?;
    let results: Vec<Result<(), io::Error>> = std::thread::scope(|scope| {
        let handles: Vec<_> = files
            .iter()
            .zip(lengths)
            .skip(1)
            .map(|(f, &len)| scope.spawn(move || allocate(f, len, stop)))
            .collect();
        let mut results = vec![allocate(&files[0], lengths[0], stop)];
        results.extend(handles.into_iter().map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(io::Error::other("a reserving thread panicked")))
        }));
        results
    });
    if let Some(err) = results.into_iter().find_map(Result::err) {
        // The files are dropped here, and with them what was allocated.
        return Err(match err.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => ReserveError::NoSpace { bytes, err },
            _ if err.kind() == io::ErrorKind::Interrupted => ReserveError::Stopped,
            _ if unsupported(&err) => ReserveError::Unsupported(err),
            _ => ReserveError::Io(err),
        });
    }
    let slots = files
        .into_iter()
        .zip(lengths)
        .map(|(f, &held)| Slot {
            file: Some(Arc::new(f)),
            held,
            used: 0,
            claimed: false,
        })
        .collect();
    Ok(Reservation {
        files: Arc::new(Pieces {
            dir: own,
            slots: Mutex::new(slots),
            unguarded: AtomicBool::new(false),
        }),
        bytes,
    })
}

fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL | libc::ENOSYS)
    )
}

/// An unnamed file in `dir`: nothing to leave behind, freed by the kernel with its last
/// descriptor, whatever kills the process.
fn open_piece(dir: BorrowedFd<'_>) -> io::Result<File> {
    sys::open_at(dir, ".", libc::O_TMPFILE | libc::O_RDWR, 0o600)
}

/// Allocates `len` bytes of `file`'s blocks, [`STEP`] bytes a call; an error of kind
/// `Interrupted` once `stop` is set.
fn allocate(file: &File, len: u64, stop: &AtomicBool) -> Result<(), io::Error> {
    let mut at = 0u64;
    while at < len {
        if stop.load(Ordering::Relaxed) {
            return Err(io::Error::from(io::ErrorKind::Interrupted));
        }
        let step = STEP.min(len - at);
        let (Ok(offset), Ok(n)) = (libc::off_t::try_from(at), libc::off_t::try_from(step)) else {
            return Err(io::Error::from_raw_os_error(libc::EFBIG));
        };
        // SAFETY: fallocate on a descriptor the caller's reservation owns; no memory is passed.
        if unsafe { libc::fallocate(file.as_raw_fd(), 0, offset, n) } != 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        at += step;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpusnap_proto::pid::NsPid;
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

    // The pieces as the drain uses them: data files written into held space.

    use crate::{DataFileWriter, scan_data_file};

    const K: u64 = 1024;

    /// Pieces of `lengths` bytes in `dir`, or `None` (skipped) where the file system cannot.
    fn small(dir: &File, lengths: &[u64], test: &str) -> Option<Reservation> {
        match take_pieces(dir.as_fd(), lengths, &AtomicBool::new(false)) {
            Ok(r) => Some(r),
            Err(ReserveError::Unsupported(e)) => {
                eprintln!("image: SKIPPED {test}: {e}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    fn temp(tag: &str) -> (std::path::PathBuf, File) {
        let path = std::env::temp_dir().join(format!("gpusnap-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        let dir = File::open(&path).unwrap();
        (path, dir)
    }

    fn names(path: &std::path::Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(path)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    /// `n` chunks of `len` bytes, each its own pattern.
    fn write_chunks(w: &mut DataFileWriter, first: u64, n: u64, len: usize) {
        for c in first..first + n {
            let data: Vec<u8> = (0..len).map(|i| (i as u64 ^ c) as u8).collect();
            w.append_raw(0x10_0000 + c * 0x10_0000, &data).unwrap();
        }
    }

    /// The chunks of a named data file, walked and checked record by record.
    fn scanned(dir: &File, index: u32) -> (u64, usize) {
        let scan = scan_data_file(dir.as_fd(), NsPid(7), index).unwrap();
        assert!(scan.stopped.is_none(), "{:?}", scan.stopped);
        assert_eq!(scan.end, scan.size);
        (scan.size, scan.chunks.len())
    }

    #[test]
    fn a_piece_written_past_its_share_takes_from_the_unclaimed_ones_first() {
        let (path, dir) = temp("reserve-past");
        let Some(r) = small(&dir, &[64 * K, 64 * K, 64 * K], "a_piece_written_past") else {
            return;
        };
        let mut w = DataFileWriter::create_in(&r, NsPid(7), 0).unwrap();
        // 5 chunks of 20 KiB: 100 KiB and headers, more than the piece's 64 KiB.
        write_chunks(&mut w, 0, 5, 20 << 10);
        let end = w.bytes_written();
        assert!(end > 100 * K);
        // The last unclaimed piece gave what was needed; the middle one is untouched.
        let sizes: Vec<u64> = r
            .files
            .iter()
            .map(|f| f.metadata().unwrap().len())
            .collect();
        let taken = end.next_multiple_of(PAGE) - 64 * K;
        assert_eq!(sizes[1], 64 * K, "{sizes:?}");
        assert_eq!(sizes[2], 64 * K - taken, "{sizes:?}");
        // Never more allocated than was held (a page of the file system's own rounding aside).
        let total: u64 = allocated(&r).iter().sum();
        assert!(total <= 192 * K + PAGE, "{total} allocated");
        assert_eq!(r.held(), 192 * K - end);
        // No name until it is published.
        assert!(names(&path).is_empty(), "{:?}", names(&path));
        let entry = w.finish().unwrap();
        assert_eq!(entry.size, end);
        assert_eq!(names(&path), vec![entry.name.clone()]);
        assert_eq!(scanned(&dir, 0), (end, 5));
        drop(r);
        assert_eq!(names(&path), vec![entry.name]);
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn a_reservation_splits_in_two_that_hold_what_it_held() {
        let (path, dir) = temp("reserve-split");
        // (split, pieces here, pieces there)
        for (split, here, there) in [
            // One whole piece and the next whole, its overshoot (28 KiB) taken fresh here.
            (100 * K, 2, 2),
            // No whole piece fits: the next one moves, its overshoot (24 KiB) fresh here.
            (40 * K, 3, 1),
            // Less than half a piece: handed back here, taken fresh there.
            (20 * K, 3, 1),
            // Exactly two pieces.
            (128 * K, 1, 2),
        ] {
            let Some(mut r) = small(&dir, &[64 * K, 64 * K, 64 * K], "a_reservation_splits") else {
                return;
            };
            let theirs = r.split_off(split).unwrap();
            assert_eq!((theirs.bytes(), theirs.held()), (split, split), "{split}");
            assert_eq!(r.bytes() + theirs.bytes(), 192 * K, "{split}");
            assert_eq!(r.held(), 192 * K - split, "{split}");
            // Never much more allocated than was held before.
            let total: u64 = allocated(&r).iter().chain(&allocated(&theirs)).sum();
            assert!(total <= 192 * K + 2 * PAGE, "{split}: {total} allocated");
            assert_eq!(
                (r.files.iter().count(), theirs.files.iter().count()),
                (here, there),
                "{split}"
            );
            // Each side's writers write into its own pieces.
            let mut w = DataFileWriter::create_in(&theirs, NsPid(7), 1).unwrap();
            write_chunks(&mut w, 0, 1, 5000);
            w.finish().unwrap();
            assert_eq!(r.held(), 192 * K - split, "{split}");
            drop((r, theirs));
            for n in names(&path) {
                std::fs::remove_file(path.join(n)).unwrap();
            }
        }
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn a_piece_written_less_is_cut_to_its_bytes() {
        let (path, dir) = temp("reserve-less");
        let Some(r) = small(&dir, &[1024 * K], "a_piece_written_less") else {
            return;
        };
        let mut w = DataFileWriter::create_in(&r, NsPid(7), 3).unwrap();
        write_chunks(&mut w, 0, 2, 5000);
        let end = w.bytes_written();
        assert!(allocated(&r)[0] >= 1024 * K);
        let sealed = w.seal().unwrap();
        // Cut at the seal: the rest of the piece is free again, and nothing more is held.
        assert_eq!(r.held(), 0);
        assert!(
            allocated(&r)[0] <= end.next_multiple_of(PAGE) + PAGE,
            "{:?}",
            allocated(&r)
        );
        assert!(names(&path).is_empty());
        let entry = sealed.publish().unwrap();
        assert_eq!(
            (entry.name.as_str(), entry.size),
            ("gpusnap-7-data-3.img", end)
        );
        assert_eq!(scanned(&dir, 3), (end, 2));
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn a_writer_past_its_share_takes_another_writers_slack_and_leaves_its_data() {
        let (path, dir) = temp("reserve-slack");
        let Some(r) = small(&dir, &[64 * K, 64 * K], "a_writer_takes_slack") else {
            return;
        };
        let mut a = DataFileWriter::create_in(&r, NsPid(7), 0).unwrap();
        let mut b = DataFileWriter::create_in(&r, NsPid(7), 1).unwrap();
        write_chunks(&mut b, 100, 1, 8 << 10);
        let b_end = b.bytes_written();
        // `a` writes 100 KiB: no piece is unclaimed, so it takes what it needs of `b`'s slack
        // (never the pages `b` has announced).
        write_chunks(&mut a, 0, 5, 20 << 10);
        let sizes: Vec<u64> = r
            .files
            .iter()
            .map(|f| f.metadata().unwrap().len())
            .collect();
        let a_end = a.bytes_written();
        assert_eq!(
            sizes[1],
            128 * K - a_end.next_multiple_of(PAGE),
            "{sizes:?}"
        );
        assert!(sizes[1] >= b_end.next_multiple_of(PAGE));
        let total: u64 = allocated(&r).iter().sum();
        assert!(total <= 128 * K + PAGE, "{total} allocated");
        // `b` writes on, past what is held now: nothing is left to take (logged once), and it
        // writes anyway, as without a reservation.
        write_chunks(&mut b, 101, 3, 8 << 10);
        let (a, b) = (a.seal().unwrap(), b.seal().unwrap());
        let (a, b) = (a.publish().unwrap(), b.publish().unwrap());
        assert_eq!(names(&path), vec![a.name.clone(), b.name.clone()]);
        assert_eq!(scanned(&dir, 0), (a.size, 5));
        assert_eq!(scanned(&dir, 1), (b.size, 4));
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn a_writer_without_a_piece_gets_a_fresh_one_that_takes_from_the_others() {
        let (path, dir) = temp("reserve-fresh");
        let Some(r) = small(&dir, &[256 * K], "a_writer_without_a_piece") else {
            return;
        };
        let mut a = DataFileWriter::create_in(&r, NsPid(7), 0).unwrap();
        let mut b = DataFileWriter::create_in(&r, NsPid(7), 1).unwrap();
        assert_eq!(r.pieces(), 2);
        write_chunks(&mut b, 0, 3, 16 << 10);
        write_chunks(&mut a, 10, 1, 16 << 10);
        let total: u64 = allocated(&r).iter().sum();
        assert!(total <= 256 * K + PAGE, "{total} allocated");
        let a_len = r.files.iter().next().unwrap().metadata().unwrap().len();
        assert_eq!(a_len, 256 * K - (b.bytes_written().next_multiple_of(PAGE)));
        let (a, b) = (a.finish().unwrap(), b.finish().unwrap());
        assert_eq!(scanned(&dir, 0), (a.size, 1));
        assert_eq!(scanned(&dir, 1), (b.size, 3));
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn nothing_named_is_left_after_a_failed_drain() {
        let (path, dir) = temp("reserve-failed");
        let Some(r) = small(&dir, &[64 * K, 64 * K], "nothing_named_is_left") else {
            return;
        };
        let mut a = DataFileWriter::create_in(&r, NsPid(7), 0).unwrap();
        let mut b = DataFileWriter::create_in(&r, NsPid(7), 1).unwrap();
        write_chunks(&mut a, 0, 2, 8 << 10);
        write_chunks(&mut b, 2, 2, 8 << 10);
        // One writer sealed, the other not: the drain failed before any was published.
        let sealed = a.seal().unwrap();
        drop(b);
        assert_eq!(r.files.len(), 2);
        assert_eq!(
            r.files.iter().count(),
            1,
            "the dropped piece left the reservation"
        );
        drop(sealed);
        assert_eq!(r.files.iter().count(), 0);
        assert!(names(&path).is_empty(), "{:?}", names(&path));
        drop(r);
        assert!(names(&path).is_empty(), "{:?}", names(&path));
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn a_publish_replaces_a_stale_file_of_its_name() {
        let (path, dir) = temp("reserve-stale");
        let Some(r) = small(&dir, &[64 * K], "a_publish_replaces") else {
            return;
        };
        std::fs::write(path.join("gpusnap-7-data-0.img"), b"stale").unwrap();
        let mut w = DataFileWriter::create_in(&r, NsPid(7), 0).unwrap();
        write_chunks(&mut w, 0, 1, 4096);
        let e = w.finish().unwrap();
        assert_eq!(scanned(&dir, 0), (e.size, 1));
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn a_stopped_reservation_holds_nothing() {
        let (path, dir) = temp("reserve-stopped");
        match Reservation::take_until(dir.as_fd(), 64 << 20, 2, &AtomicBool::new(true)) {
            Err(ReserveError::Stopped | ReserveError::Unsupported(_)) => {}
            other => panic!("{other:?}"),
        }
        assert!(names(&path).is_empty());
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn two_takes_merge_into_one_reservation() {
        let (path, dir) = temp("reserve-merge");
        let (Some(mut r), Some(more)) = (
            small(&dir, &[64 * K], "two_takes_merge"),
            small(&dir, &[32 * K, 32 * K], "two_takes_merge"),
        ) else {
            return;
        };
        r.merge(more);
        assert_eq!((r.bytes(), r.held(), r.pieces()), (128 * K, 128 * K, 3));
        // Trimmed from the last piece.
        r.release(40 * K);
        let sizes: Vec<u64> = r
            .files
            .iter()
            .map(|f| f.metadata().unwrap().len())
            .collect();
        assert_eq!(sizes, vec![64 * K, 24 * K, 0]);
        std::fs::remove_dir_all(&path).unwrap();
    }
}
