//! The program's descriptor budget: the agent's own descriptors (kept across a hand-over, kept
//! duplicates of shareable exports and imports) are the program's, counted against its soft
//! `RLIMIT_NOFILE`. The agent never raises the limit and never takes the last descriptors: what
//! does not fit is copied first (a lend) or not carried (a share), so a job never runs out of
//! descriptors sooner than without the agent, and always keeps some for its own way back.

use crate::session::Fail;

/// Descriptors the job keeps open beyond the kept ones, so that its own work (and a reload, if
/// the rollback must reload) still finds some.
const DESCRIPTOR_MARGIN: u64 = 32;

/// Refuses a lend whose `n` kept descriptors would not fit under the job's own limit with
/// [`DESCRIPTOR_MARGIN`] to spare (the limit is the application's: it is not raised). The
/// plugin then copies the data out first, and nothing of the job changed.
pub(crate) fn lend_fits(n: usize) -> Result<(), Fail> {
    let need = n as u64 + DESCRIPTOR_MARGIN;
    match descriptors_in_use() {
        Some((open, limit)) if !fits(open, limit, n as u64) => Err(Fail::bad_state(format!(
            "descriptor limit: the process has {open} of {limit} descriptors open; lending {n} allocations needs {need} more (one kept per allocation, and a margin)"
        ))),
        _ => Ok(()),
    }
}

/// Whether the agent may keep one more descriptor of its own and still leave the program
/// [`DESCRIPTOR_MARGIN`] under its soft limit (the agent's copies must never make the program
/// run out of descriptors sooner than without it).
pub(crate) fn room_for_one_more_descriptor() -> bool {
    descriptors_in_use().is_none_or(|(open, limit)| fits(open, limit, 1))
}

/// Whether `more` descriptors and the margin fit beside `open` under `limit`.
fn fits(open: u64, limit: u64, more: u64) -> bool {
    open.saturating_add(more).saturating_add(DESCRIPTOR_MARGIN) <= limit
}

/// The process's open descriptors and its soft `RLIMIT_NOFILE`; None when unlimited or unknown.
fn descriptors_in_use() -> Option<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) into a valid rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0
        || lim.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    // At the limit even the directory cannot be opened (EMFILE): then nothing is free.
    let open = std::fs::read_dir("/proc/self/fd").map_or(lim.rlim_cur, |d| d.count() as u64);
    Some((open, lim.rlim_cur))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_is_kept_free() {
        assert!(fits(4, 37, 1));
        assert!(
            !fits(4, 36, 1),
            "the 37th descriptor would eat into the margin"
        );
        assert!(fits(100, 1024, 892));
        assert!(!fits(100, 1024, 893));
        assert!(!fits(u64::MAX - 1, u64::MAX - 1, 1), "no overflow");
    }
}
