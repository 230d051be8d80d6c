//! Parsing of `device_map`: which GPU of the restore machine stands in for which GPU of the dump.

/// A GPU UUID written in neither accepted form. The message says what is expected first: it
/// completes `expected ...` in [`crate::ConfigError::Invalid`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("GPU UUIDs as GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx or 32 hex digits; got `{text}`")]
pub struct BadUuid {
    /// The text as written.
    pub text: String,
}

/// Why a `device_map` is refused. As [`BadUuid`], each message says what is expected first.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceMapError {
    /// An entry without `=`.
    #[error("OLD=NEW pairs separated by commas; `{entry}` has no `=`")]
    NoEquals { entry: String },
    /// An old or a new UUID in neither accepted form.
    #[error(transparent)]
    Uuid(#[from] BadUuid),
    /// The same old GPU (normalised) listed twice.
    #[error("each old GPU once; GPU {old} is mapped twice")]
    OldTwice { old: String },
    /// Two old GPUs onto the same new GPU (normalised).
    #[error("a one-to-one map; two old GPUs are mapped onto GPU {new}")]
    NewTwice { new: String },
}

/// Parses `"OLD=NEW,OLD=NEW"` into normalised pairs (32 lowercase hex digits each).
///
/// Each UUID is either `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (as `nvidia-smi -L` prints it)
/// or the same 32 hex digits without prefix and dashes. Whitespace around entries is ignored, and
/// so are empty entries (a trailing comma). The map must be one-to-one: an old UUID listed twice
/// is ambiguous, and two old GPUs onto one new GPU cannot be restored.
///
/// The error says what a `device_map` must be, and what in `text` is not: it is
/// [`crate::ConfigError::Invalid`]'s `allowed` part.
pub fn parse(text: &str) -> Result<Vec<(String, String)>, DeviceMapError> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let Some((old, new)) = entry.split_once('=') else {
            return Err(DeviceMapError::NoEquals {
                entry: entry.to_owned(),
            });
        };
        let old = normalise_uuid(old.trim())?;
        let new = normalise_uuid(new.trim())?;
        if pairs.iter().any(|(o, _)| *o == old) {
            return Err(DeviceMapError::OldTwice { old });
        }
        if pairs.iter().any(|(_, n)| *n == new) {
            return Err(DeviceMapError::NewTwice { new });
        }
        pairs.push((old, new));
    }
    Ok(pairs)
}

/// Returns the 32 lowercase hex digits of a GPU UUID written in either accepted form:
/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (the dashes exactly there) or 32 hex digits. A
/// mistyped group is refused rather than guessed at.
pub fn normalise_uuid(uuid: &str) -> Result<String, BadUuid> {
    let bad = || BadUuid {
        text: uuid.to_owned(),
    };
    let hex: String = match uuid.strip_prefix("GPU-") {
        Some(rest) => {
            let groups: Vec<&str> = rest.split('-').collect();
            let lens: Vec<usize> = groups.iter().map(|g| g.len()).collect();
            if lens != [8, 4, 4, 4, 12] {
                return Err(bad());
            }
            groups.concat()
        }
        None => uuid.to_owned(),
    };
    if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    Ok(hex.to_ascii_lowercase())
}
