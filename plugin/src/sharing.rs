//! Device memory shared between processes of one dump through the agent's CUDA IPC (the agent
//! serves legacy IPC handles of the memory it converted; `docs/ipc.md`).
//!
//! The memory is saved once, by its exporter. An importer's release unmaps its imports (the
//! agent does it with its own release, keeping the reservations), so the driver's checkpoint of
//! the importer holds none of another process's memory. Once the exporter's memory is back (a
//! rollback's reclaim or reload, a restore's load or hand-over), the exporter's agent hands a
//! descriptor of each shared allocation's current memory ([`AgentSession::share_fds`]) and the
//! importer's agent maps it at its old address ([`AgentSession::reimport`]), before any of the
//! importer's threads runs. Here: [`check`], the dump-time rule that every side of every share
//! is in the dump, and [`reimport`].

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::agent::{self, AgentError, AgentSession, Share};
use crate::ptrace::{self, PtraceError};

#[derive(Debug, thiserror::Error)]
pub enum SharingError {
    #[error(
        "pid {importer} maps device memory of pid {exporter} (CUDA IPC), and pid {exporter} is not in this dump: dump a process tree that holds both"
    )]
    ExporterOutside { importer: u32, exporter: u32 },
    #[error(
        "device memory of pid {exporter} is mapped by pid {importer} (CUDA IPC), and pid {importer} is not in this dump: dump a process tree that holds both"
    )]
    ImporterOutside { exporter: u32, importer: u32 },
    #[error(
        "pid {pid} shares device memory through the agent's CUDA IPC but is not dumped on the split path (gpusnap carries such shares only there)"
    )]
    NotSplit { pid: u32 },
    #[error("pid {importer}: its exporter pid {exporter} is not among the restored processes")]
    NoExporter { importer: u32, exporter: u32 },
    #[error("pid {importer}: exporter pid {exporter} no longer exports allocation #{id}")]
    NoSuchExport {
        importer: u32,
        exporter: u32,
        id: u64,
    },
    #[error("pid {pid}: {left} CUDA IPC imports are still not mapped")]
    Incomplete { pid: u32, left: usize },
    #[error("pid {pid}: no agent thread found")]
    NoAgentThread { pid: i32 },
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error(transparent)]
    Ptrace(#[from] PtraceError),
}

/// One GPU process of a dump, as [`check`] sees it.
pub struct Member<'a> {
    pub nspid: u32,
    /// Dumped on the split path (the only one that carries shares).
    pub split: bool,
    /// What its agent listed at PAUSE.
    pub shares: &'a [Share],
}

/// The dump-time rule: every importer's exporter and every exporter's importer is in the dump,
/// and on the split path. `gone(pid)`: an importer outside the dump that has exited (it holds
/// nothing any more).
pub fn check(members: &[Member<'_>], gone: impl Fn(u32) -> bool) -> Result<(), SharingError> {
    let inside: BTreeSet<u32> = members.iter().map(|m| m.nspid).collect();
    for m in members.iter().filter(|m| !m.shares.is_empty()) {
        if !m.split {
            return Err(SharingError::NotSplit { pid: m.nspid });
        }
        for s in m.shares {
            if s.import && !inside.contains(&s.pid) {
                return Err(SharingError::ExporterOutside {
                    importer: m.nspid,
                    exporter: s.pid,
                });
            }
            if !s.import && s.pid != 0 && !inside.contains(&s.pid) && !gone(s.pid) {
                return Err(SharingError::ImporterOutside {
                    exporter: m.nspid,
                    importer: s.pid,
                });
            }
        }
    }
    Ok(())
}

/// A process of a rollback or a restore that may take part in a reimport.
#[derive(Clone, Copy, Debug)]
pub struct Process {
    /// Host pid.
    pub pid: i32,
    /// Its pid in its own namespace (what the shares name).
    pub nspid: u32,
}

/// The exporters as running processes (`gpusnap recover`, outside CRIU): their memory is their
/// own, and their agents answer the read-only `ShareFds` while they run. Pids as the importer's
/// namespace numbers them, which must be ours (`same_ns`).
pub fn from_running(
    same_ns: bool,
    timeout: Duration,
) -> impl Fn(u32) -> Result<Vec<crate::agent::SharedMemory>, SharingError> {
    move |exporter| {
        if !same_ns {
            return Err(SharingError::NoExporter {
                importer: 0,
                exporter,
            });
        }
        let pid = exporter as i32;
        let s = AgentSession::connect(pid, timeout)?.ok_or(SharingError::NoAgentThread { pid })?;
        Ok(s.share_fds()?)
    }
}

/// How many CUDA IPC imports of `pid` a release unmapped and nothing mapped again (`gpusnap
/// recover`: such a process must not run).
pub fn unmapped_imports(pid: i32, timeout: Duration) -> Result<usize, SharingError> {
    if agent::agent_thread(pid).is_none() {
        return Ok(0);
    }
    let shares = with_agent(pid, timeout, |s| Ok(s.list_sharing()?))?;
    Ok(shares.iter().filter(|s| s.import && !s.mapped).count())
}

/// Lets only `pid`'s agent thread run for `f` (the caller, CRIU's main thread, traces it).
fn with_agent<R>(
    pid: i32,
    timeout: Duration,
    f: impl FnOnce(&AgentSession) -> Result<R, SharingError>,
) -> Result<R, SharingError> {
    let tid = agent::agent_thread(pid).ok_or(SharingError::NoAgentThread { pid })?;
    let running = ptrace::resume(tid, "agent thread")?;
    let result = AgentSession::connect_expected(pid, timeout)
        .map_err(SharingError::from)
        .and_then(|s| f(&s));
    running
        .stop()
        .map_err(PtraceError::on(tid, "stopping the agent thread"))?;
    result
}

/// Where an importer's exporters' current memory comes from: `fetch(exporter nspid)`.
pub type Fetch<'a> = dyn Fn(u32) -> Result<Vec<crate::agent::SharedMemory>, SharingError> + 'a;

/// The exporters among `processes` (all traced by the caller, CRIU's main thread): each one's
/// agent thread is let run alone for its `ShareFds`.
pub fn from_traced(
    processes: &[Process],
    timeout: Duration,
) -> impl Fn(u32) -> Result<Vec<crate::agent::SharedMemory>, SharingError> + '_ {
    move |exporter| {
        let p = processes
            .iter()
            .find(|p| p.nspid == exporter)
            .ok_or(SharingError::NoExporter {
                importer: 0,
                exporter,
            })?;
        with_agent(p.pid, timeout, |s| Ok(s.share_fds()?))
    }
}

/// Maps every import of `importer` that a release unmapped again, from the current memory of
/// its exporters (`fetch`). Returns how many were mapped. The importer's agent thread runs
/// alone for it (the caller traces the importer). `fault_point`: the test point just before.
pub fn reimport(
    importer: Process,
    fetch: &Fetch<'_>,
    timeout: Duration,
    fault_point: Option<&'static str>,
) -> Result<usize, SharingError> {
    let me = importer.nspid;
    if agent::agent_thread(importer.pid).is_none() {
        // No agent thread, no share of the agent's: it starts its thread at the first open.
        return Ok(0);
    }
    let unmapped: Vec<Share> = with_agent(importer.pid, timeout, |s| Ok(s.list_sharing()?))?
        .into_iter()
        .filter(|s| s.import && !s.mapped)
        .collect();
    if unmapped.is_empty() {
        return Ok(0);
    }
    if let Some(point) = fault_point {
        crate::fault::kill_criu_at(point);
    }
    let mut by_exporter: BTreeMap<u32, Vec<&Share>> = BTreeMap::new();
    for s in &unmapped {
        by_exporter.entry(s.pid).or_default().push(s);
    }
    let mut memory = Vec::new();
    for (&exporter, wanted) in &by_exporter {
        let mut fds = fetch(exporter).map_err(|e| match e {
            SharingError::NoExporter { exporter, .. } => SharingError::NoExporter {
                importer: me,
                exporter,
            },
            other => other,
        })?;
        for w in wanted {
            let i = fds
                .iter()
                .position(|m| m.id == w.id && m.size == w.size)
                .ok_or(SharingError::NoSuchExport {
                    importer: me,
                    exporter,
                    id: w.id,
                })?;
            memory.push((exporter, fds.swap_remove(i)));
        }
    }
    let mapped = with_agent(importer.pid, timeout, |s| {
        for (exporter, mem) in &memory {
            s.reimport(*exporter, mem)?;
        }
        let left = s
            .list_sharing()?
            .iter()
            .filter(|s| s.import && !s.mapped)
            .count();
        if left > 0 {
            return Err(SharingError::Incomplete { pid: me, left });
        }
        Ok(memory.len())
    })?;
    log::info!(
        "pid {} (nspid {me}): {mapped} CUDA IPC imports mapped again from their exporters' memory",
        importer.pid
    );
    Ok(mapped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(import: bool, pid: u32, id: u64) -> Share {
        Share {
            import,
            pid,
            id,
            addr: 0x7000_0000_0000 + id * (2 << 20),
            size: 2 << 20,
            mapped: true,
        }
    }

    #[test]
    fn a_tree_that_holds_both_sides_passes() {
        let exp = [share(false, 11, 1)];
        let imp = [share(true, 10, 1)];
        let members = [
            Member {
                nspid: 10,
                split: true,
                shares: &exp,
            },
            Member {
                nspid: 11,
                split: true,
                shares: &imp,
            },
        ];
        check(&members, |_| false).unwrap();
    }

    #[test]
    fn an_exporter_outside_the_dump_is_named() {
        let imp = [share(true, 10, 1)];
        let members = [Member {
            nspid: 11,
            split: true,
            shares: &imp,
        }];
        let e = check(&members, |_| false).unwrap_err();
        assert!(matches!(
            e,
            SharingError::ExporterOutside {
                importer: 11,
                exporter: 10
            }
        ));
        assert!(e.to_string().contains("pid 10 is not in this dump"), "{e}");
    }

    #[test]
    fn an_importer_outside_the_dump_is_named_unless_it_is_gone() {
        let exp = [share(false, 12, 1), share(false, 0, 2)];
        let members = [Member {
            nspid: 10,
            split: true,
            shares: &exp,
        }];
        assert!(matches!(
            check(&members, |_| false),
            Err(SharingError::ImporterOutside {
                exporter: 10,
                importer: 12
            })
        ));
        check(&members, |pid| pid == 12).unwrap();
    }

    #[test]
    fn shares_on_the_transparent_path_are_refused() {
        let exp = [share(false, 0, 1)];
        let members = [Member {
            nspid: 10,
            split: false,
            shares: &exp,
        }];
        assert!(matches!(
            check(&members, |_| true),
            Err(SharingError::NotSplit { pid: 10 })
        ));
        // A process that shares nothing may take either path.
        let none: [Share; 0] = [];
        let members = [Member {
            nspid: 10,
            split: false,
            shares: &none,
        }];
        check(&members, |_| true).unwrap();
    }
}
