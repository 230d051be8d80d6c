//! Checkpoint archives read as they are, as untrusted input: a Podman export (`podman container
//! checkpoint --export`, `.tar`, `.tar.gz` or `.tar.zst`) or a containerd/kubelet checkpoint
//! archive (`CheckpointContainer`'s `.tar`) is unpacked into a fresh private temporary directory
//! (under `$TMPDIR`, else `/tmp`), which is removed again when the [`Unpacked`] is dropped.
//!
//! Only regular files and directories are unpacked. Anything else refuses the whole archive:
//! symbolic and hard links, device files, FIFOs, absolute paths, `..`, a path met twice, more
//! than [`Limits::entries`] entries, more than [`Limits::bytes`] bytes in all (at most the free
//! space of the temporary directory's file system, less a margin), and extension headers (PAX,
//! GNU long names) larger than [`HEADER_BUDGET`] each. Files are created `0600`, directories
//! `0700`, whatever the archive says; nothing is followed, since no link is ever created. The
//! compression is told by the first bytes (gzip, zstd, else plain tar).
//!
//! Self-contained (std, `tar`, `flate2`, `zstd`, `libc`), so that the fuzz target builds it too.

use std::cell::Cell;
use std::fs::{DirBuilder, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::rc::Rc;

/// The most bytes the headers before one entry (its own, PAX records, a GNU long name) may take.
pub const HEADER_BUDGET: u64 = 1 << 20;
/// The most bytes an archive may unpack to, whatever the free space.
pub const MAX_BYTES: u64 = 1 << 40;
/// The most entries an archive may hold.
pub const MAX_ENTRIES: u64 = 200_000;
/// Free space left on the temporary directory's file system.
const SPACE_MARGIN: u64 = 512 << 20;
/// Longest entry path, and deepest.
const MAX_PATH: usize = 4096;
const MAX_DEPTH: usize = 64;

/// What an archive may unpack to.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub bytes: u64,
    pub entries: u64,
}

#[derive(Debug)]
pub enum ArchiveError {
    /// The file is not a tar archive (nor a compressed one).
    NotAnArchive(String),
    /// An entry the reader refuses; the whole archive is refused.
    Refused {
        entry: String,
        why: &'static str,
    },
    TooLarge {
        limit: u64,
    },
    TooManyEntries {
        limit: u64,
    },
    /// The archive could not be read (damaged, cut short, bad compression).
    Read(io::Error),
    /// The temporary directory could not be made or written.
    Temp(io::Error),
}

impl std::fmt::Display for ArchiveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotAnArchive(why) => write!(f, "not a tar archive ({why})"),
            Self::Refused { entry, why } => {
                write!(f, "archive refused: entry {entry:?}: {why}")
            }
            Self::TooLarge { limit } => write!(
                f,
                "archive refused: it unpacks to more than {limit} bytes (the limit: at most 1 TiB and the free space of $TMPDIR less 512 MiB)"
            ),
            Self::TooManyEntries { limit } => {
                write!(f, "archive refused: more than {limit} entries")
            }
            Self::Read(e) => write!(f, "archive unreadable: {e}"),
            Self::Temp(e) => write!(f, "cannot unpack into the temporary directory: {e}"),
        }
    }
}

impl std::error::Error for ArchiveError {}

/// An archive unpacked into a private temporary directory, removed on drop.
#[derive(Debug)]
pub struct Unpacked {
    dir: PathBuf,
}

impl Unpacked {
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Unpacked {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Unpacks the archive at `path` into a fresh directory under `$TMPDIR` (else `/tmp`).
pub fn unpack(path: &Path) -> Result<Unpacked, ArchiveError> {
    let file = std::fs::File::open(path).map_err(ArchiveError::Read)?;
    let out = Unpacked {
        dir: fresh_dir(&std::env::temp_dir()).map_err(ArchiveError::Temp)?,
    };
    let limits = Limits {
        bytes: free_space(&out.dir)
            .map_or(MAX_BYTES, |f| f.saturating_sub(SPACE_MARGIN).min(MAX_BYTES)),
        entries: MAX_ENTRIES,
    };
    unpack_into(io::BufReader::new(file), &out.dir, limits)?;
    Ok(out)
}

fn free_space(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a NUL-terminated path and `st` a zeroed statvfs the call fills in.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call's duration.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// A new `0700` directory `gpusnap-unpack-<pid>-<n>` under `parent`.
fn fresh_dir(parent: &Path) -> io::Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    for n in 0..100u32 {
        let dir = parent.join(format!(
            "gpusnap-unpack-{}-{:x}",
            std::process::id(),
            nanos.wrapping_add(n)
        ));
        match DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        "no fresh directory name",
    ))
}

/// The reader under the tar parser: counts what the headers before an entry take
/// (`header_budget`, set before each entry, `None` while an entry's data is read).
struct Guarded<R> {
    inner: R,
    header_budget: Rc<Cell<Option<u64>>>,
}

impl<R: Read> Read for Guarded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(left) = self.header_budget.get() {
            match left.checked_sub(n as u64) {
                Some(l) => self.header_budget.set(Some(l)),
                None => {
                    self.header_budget.set(Some(0));
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "an entry's headers are larger than 1 MiB",
                    ));
                }
            }
        }
        Ok(n)
    }
}

/// The decompressed stream of `r`, by its first bytes.
fn decompressed<'a, R: io::BufRead + 'a>(mut r: R) -> Result<Box<dyn Read + 'a>, ArchiveError> {
    let head = r.fill_buf().map_err(ArchiveError::Read)?;
    if head.starts_with(&[0x1f, 0x8b]) {
        Ok(Box::new(flate2::bufread::MultiGzDecoder::new(r)))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        let d = zstd::stream::read::Decoder::with_buffer(r).map_err(ArchiveError::Read)?;
        Ok(Box::new(d))
    } else if head.is_empty() {
        Err(ArchiveError::NotAnArchive("empty file".into()))
    } else {
        Ok(Box::new(r))
    }
}

/// The relative path of an entry, checked: no absolute path, no `..`, bounded.
fn safe_path(raw: &[u8]) -> Result<PathBuf, &'static str> {
    use std::os::unix::ffi::OsStrExt;
    if raw.len() > MAX_PATH {
        return Err("path longer than 4096 bytes");
    }
    if raw.contains(&0) {
        return Err("NUL in the path");
    }
    let p = Path::new(std::ffi::OsStr::from_bytes(raw));
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return Err("absolute path"),
            Component::ParentDir => return Err("`..` in the path"),
        }
    }
    if out.components().count() > MAX_DEPTH {
        return Err("deeper than 64 directories");
    }
    Ok(out)
}

/// Unpacks the tar stream `r` (compressed or not) into the existing empty directory `root`.
pub fn unpack_into<R: io::BufRead>(r: R, root: &Path, limits: Limits) -> Result<(), ArchiveError> {
    let budget = Rc::new(Cell::new(Some(HEADER_BUDGET)));
    let guarded = Guarded {
        inner: decompressed(r)?,
        header_budget: budget.clone(),
    };
    let mut archive = tar::Archive::new(guarded);
    let mut entries = archive.entries().map_err(ArchiveError::Read)?;
    let (mut bytes, mut count) = (0u64, 0u64);
    loop {
        budget.set(Some(HEADER_BUDGET));
        let mut entry = match entries.next() {
            None => break,
            Some(Ok(e)) => e,
            // Past the budget: a hostile header, not "no archive".
            Some(Err(e)) if count == 0 && budget.get() != Some(0) => {
                return Err(ArchiveError::NotAnArchive(e.to_string()));
            }
            Some(Err(e)) => return Err(ArchiveError::Read(e)),
        };
        budget.set(None);
        count += 1;
        if count > limits.entries {
            return Err(ArchiveError::TooManyEntries {
                limit: limits.entries,
            });
        }
        let raw = entry.path_bytes().into_owned();
        let shown = String::from_utf8_lossy(&raw).into_owned();
        let refuse = |why| ArchiveError::Refused {
            entry: shown.clone(),
            why,
        };
        let rel = safe_path(&raw).map_err(refuse)?;
        let kind = entry.header().entry_type();
        let target = root.join(&rel);
        if kind.is_dir() {
            if rel.as_os_str().is_empty() {
                continue;
            }
            match DirBuilder::new().mode(0o700).create(&target) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && target.is_dir() => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    make_parents(root, &rel).map_err(ArchiveError::Temp)?;
                    DirBuilder::new()
                        .mode(0o700)
                        .create(&target)
                        .map_err(ArchiveError::Temp)?;
                }
                Err(e) => return Err(ArchiveError::Temp(e)),
            }
            continue;
        }
        if kind.is_symlink() || kind.is_hard_link() {
            return Err(refuse("a link (links are refused)"));
        }
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            return Err(refuse("a device file or FIFO"));
        }
        if kind.is_gnu_sparse() || !(kind.is_file() || kind.is_contiguous()) {
            return Err(refuse("not a regular file or directory"));
        }
        if rel.as_os_str().is_empty() {
            return Err(refuse("a file without a name"));
        }
        let size = entry.size();
        if size > limits.bytes.saturating_sub(bytes) {
            return Err(ArchiveError::TooLarge {
                limit: limits.bytes,
            });
        }
        make_parents(root, &rel).map_err(ArchiveError::Temp)?;
        let mut f = match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&target)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(refuse("a path met twice"));
            }
            Err(e) => return Err(ArchiveError::Temp(e)),
        };
        let copied = copy(&mut (&mut entry).take(size), &mut f)?;
        if copied != size {
            return Err(ArchiveError::Read(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("entry {shown:?} cut short"),
            )));
        }
        bytes += copied;
    }
    Ok(())
}

/// `io::copy`, telling a read error (the archive's) from a write error (the directory's).
fn copy(r: &mut impl Read, w: &mut impl io::Write) -> Result<u64, ArchiveError> {
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        let got = match r.read(&mut buf) {
            Ok(0) => return Ok(n),
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ArchiveError::Read(e)),
        };
        w.write_all(&buf[..got]).map_err(ArchiveError::Temp)?;
        n += got as u64;
    }
}

/// Creates the directories above `rel` under `root` (`0700`), none of them a link (the reader
/// never creates one).
fn make_parents(root: &Path, rel: &Path) -> io::Result<()> {
    let Some(parent) = rel.parent() else {
        return Ok(());
    };
    let mut at = root.to_path_buf();
    for c in parent.components() {
        at.push(c);
        match DirBuilder::new().mode(0o700).create(&at) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                if !std::fs::symlink_metadata(&at)?.is_dir() {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!("{} is a file and a directory", at.display()),
                    ));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
