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
//!
//! What an agent lists is the job's word (the agent runs inside it, with its rights), so a share
//! is honoured only between processes whose owners may already reach the memory: the importer
//! runs as the exporter's user (real and effective uid, `/proc/<pid>/status`), or the exporter's
//! own agent says that the importer fetched that allocation (its `ListSharing` names the pids
//! that fetched each export). A key, which the exporter's socket name once showed every user,
//! is never proof by itself. A share refused so is logged and never mapped into the importer:
//! at a dump it refuses the dump before anything is released; at a rollback, a restore or
//! `gpusnap recover` that import is not mapped again and the importer is held (or, at a
//! restore, not let run).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::agent::{self, AgentError, AgentSession};
use gpusnap_host::pid::{HostPid, NsPid};
use gpusnap_host::ptrace::{self, PtraceError};
use gpusnap_proto::{ForeignFd, Share, ShareKind};

#[derive(Debug, thiserror::Error)]
pub enum SharingError {
    #[error(
        "pid {importer} maps device memory of pid {exporter} (CUDA IPC), and pid {exporter} is not in this dump: dump a process tree that holds both"
    )]
    ExporterOutside { importer: NsPid, exporter: NsPid },
    #[error(
        "device memory of pid {exporter} is mapped by pid {importer} (CUDA IPC), and pid {importer} is not in this dump: dump a process tree that holds both"
    )]
    ImporterOutside { exporter: NsPid, importer: NsPid },
    #[error(
        "pid {pid} shares device memory through the agent's CUDA IPC but is not dumped on the split path (gpusnap carries such shares only there)"
    )]
    NotSplit { pid: NsPid },
    #[error("pid {importer}: its exporter pid {exporter} is not among the restored processes")]
    NoExporter { importer: NsPid, exporter: NsPid },
    #[error(
        "pid {importer} maps device memory that pid {exporter} exported, but pid {exporter} is another process now (the exporter exited and its pid was used again): not carried"
    )]
    ExporterReplaced { importer: NsPid, exporter: NsPid },
    #[error("pid {importer}: exporter pid {exporter} no longer exports allocation #{id}")]
    NoSuchExport {
        importer: NsPid,
        exporter: NsPid,
        id: u64,
    },
    #[error("pid {pid}: {left} CUDA IPC imports are still not mapped")]
    Incomplete { pid: NsPid, left: usize },
    #[error("pid {pid}: no agent thread found")]
    NoAgentThread { pid: HostPid },
    #[error(
        "pid {importer} imported device memory (cuMemImportFromShareableHandle) that pid {exporter} exported, and pid {exporter} is not in this dump: dump a process tree that holds both"
    )]
    ShareableExporterOutside { importer: NsPid, exporter: HostPid },
    #[error(
        "pid {importer} imported device memory (cuMemImportFromShareableHandle) that no process of this dump exported through the agent (its exporter has let go of it, or runs without the agent): not carried"
    )]
    ShareableNoExporter { importer: NsPid },
    #[error(
        "pid {exporter} exported device memory (cuMemExportToShareableHandle) that no process of this dump imported: an importer outside the dump cannot be seen, so it is not carried (dump the process tree that holds its importers; an export nobody imports any more is refused until the handle is released)"
    )]
    ShareableNoImporter { exporter: NsPid },
    #[error(
        "pid {exporter} exported device memory (cuMemExportToShareableHandle) that the agent does not move (a handle not mapped once, whole, or no longer mapped): not carried"
    )]
    ShareableNotMoved { exporter: NsPid },
    #[error(
        "pid {pid} holds fd {fd}, a descriptor of device memory pid {exporter} exported (cuMemExportToShareableHandle): gpusnap makes only the exporter's own descriptors name the memory again after a restore, so this one is not carried (close it once imported)"
    )]
    ExportFdHeld {
        pid: HostPid,
        fd: ForeignFd,
        exporter: NsPid,
    },
    #[error("comparing descriptors of pid {pid1} and pid {pid2} (kcmp): {source}")]
    Kcmp {
        pid1: HostPid,
        pid2: HostPid,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "pid {importer} lists device memory of pid {exporter} (allocation #{id}) as imported, but {}, and pid {exporter}'s agent does not say that pid {importer} fetched it: the share is refused, that memory is never mapped into pid {importer}",
        owners(*importer, importer_uids, *exporter, exporter_uids)
    )]
    ForeignShare {
        importer: NsPid,
        exporter: NsPid,
        id: u64,
        /// (real, effective) uid, `None` when unreadable.
        importer_uids: Option<(u32, u32)>,
        exporter_uids: Option<(u32, u32)>,
    },
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error(transparent)]
    Ptrace(#[from] PtraceError),
}

/// How [`SharingError::ForeignShare`] names the two owners.
fn owners(
    importer: NsPid,
    i: &Option<(u32, u32)>,
    exporter: NsPid,
    e: &Option<(u32, u32)>,
) -> String {
    let one = |pid: NsPid, u: &Option<(u32, u32)>| match u {
        Some((r, e)) if r == e => format!("pid {pid} runs as uid {r}"),
        Some((r, e)) => format!("pid {pid} runs as uid {r} (effective {e})"),
        None => format!("the owner of pid {pid} cannot be read"),
    };
    format!("{} and {}", one(importer, i), one(exporter, e))
}

/// The real and effective uid of host pid `pid` (`/proc/<pid>/status`), `None` when unreadable
/// (gone, or another pid namespace's number).
pub fn owner(pid: HostPid) -> Option<(u32, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let uids = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    let mut it = uids.split_whitespace().map(|v| v.parse::<u32>().ok());
    Some((it.next()??, it.next()??))
}

/// Whether two processes' owners are one: both known and equal (real and effective uid).
fn same_owner(a: Option<(u32, u32)>, b: Option<(u32, u32)>) -> bool {
    a.is_some() && a == b
}

/// Whether the exporter's own listing (`exports`) says that `importer` (its namespace pid)
/// fetched the allocation the import `s` names, with the exporter's key (the agent's CUDA IPC
/// records every pid it handed an allocation to; shareable exports record none).
fn confirmed_by_exporter(exports: &[Share], s: &Share, importer: NsPid) -> bool {
    importer != NsPid(0)
        && exports.iter().any(|x| {
            !x.import && !x.is_shareable() && x.id == s.id && x.key == s.key && x.pid == importer
        })
}

/// One GPU process of a dump, as [`check`] sees it.
pub struct Member<'a> {
    /// Host pid (whose owner [`check`] reads).
    pub pid: HostPid,
    pub nspid: NsPid,
    /// Dumped on the split path (the only one that carries shares).
    pub split: bool,
    /// What its agent listed at PAUSE.
    pub shares: &'a [Share],
}

/// The dump-time rule: every importer's exporter and every exporter's importer is in the dump,
/// and on the split path, and every importer may reach its exporter's memory (the same owner,
/// or the exporter's agent names it as having fetched it). `gone(pid)`: an importer outside the
/// dump that has exited (it holds nothing any more).
pub fn check(members: &[Member<'_>], gone: impl Fn(NsPid) -> bool) -> Result<(), SharingError> {
    check_with(members, gone, owner)
}

/// [`check`] with the owners read by `owner_of(host pid)`.
fn check_with(
    members: &[Member<'_>],
    gone: impl Fn(NsPid) -> bool,
    owner_of: impl Fn(HostPid) -> Option<(u32, u32)>,
) -> Result<(), SharingError> {
    let inside: BTreeSet<NsPid> = members.iter().map(|m| m.nspid).collect();
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
            if s.import {
                exported_by(members, m.nspid, s)?;
                may_reach(members, m, s, &owner_of)?;
            }
            if !s.import && s.pid != NsPid(0) && !inside.contains(&s.pid) && !gone(s.pid) {
                return Err(SharingError::ImporterOutside {
                    exporter: m.nspid,
                    importer: s.pid,
                });
            }
        }
    }
    Ok(())
}

/// The import `s` of process `importer` is an export of its exporter (a member of the dump):
/// the same allocation of the same process, told by the exporter's key. A pid used again by
/// another process after the exporter exited has other keys; its memory must never be mapped
/// in place of what the import held.
fn exported_by(members: &[Member<'_>], importer: NsPid, s: &Share) -> Result<(), SharingError> {
    let Some(e) = members.iter().find(|e| e.nspid == s.pid) else {
        return Ok(()); // outside the dump: refused by the caller
    };
    let exports = || e.shares.iter().filter(|x| !x.import && x.id == s.id);
    if exports().any(|x| x.key == s.key) {
        return Ok(());
    }
    Err(if exports().next().is_some() {
        SharingError::ExporterReplaced {
            importer,
            exporter: s.pid,
        }
    } else {
        SharingError::NoSuchExport {
            importer,
            exporter: s.pid,
            id: s.id,
        }
    })
}

/// The importer `m` may reach the memory its import `s` names: it runs as the exporter's owner,
/// or the exporter's agent says `m` fetched it. Refused otherwise, before anything is released.
fn may_reach(
    members: &[Member<'_>],
    m: &Member<'_>,
    s: &Share,
    owner_of: &impl Fn(HostPid) -> Option<(u32, u32)>,
) -> Result<(), SharingError> {
    let Some(e) = members.iter().find(|e| e.nspid == s.pid) else {
        return Ok(()); // outside the dump: refused by the caller
    };
    let (mine, theirs) = (owner_of(m.pid), owner_of(e.pid));
    if same_owner(mine, theirs) || confirmed_by_exporter(e.shares, s, m.nspid) {
        return Ok(());
    }
    let refused = SharingError::ForeignShare {
        importer: m.nspid,
        exporter: s.pid,
        id: s.id,
        importer_uids: mine,
        exporter_uids: theirs,
    };
    log::warn!("{refused}");
    Err(refused)
}

/// Which of an exporter's current memory (`fds`, its `ShareFds`) is the import `w` of
/// `importer`: the same allocation from the same process, told by its key, and of the size the
/// import maps (the whole allocation for the agent's IPC; for a shareable handle, whose
/// importer may map a part, no more than the export). The exporter's pid may be another
/// process's now (`gpusnap recover` after the exporter died): its memory must never be mapped
/// in place of the import's.
fn export_of(
    fds: &[crate::agent::SharedMemory],
    w: &Share,
    importer: NsPid,
    exporter: NsPid,
) -> Result<usize, SharingError> {
    let same = |m: &crate::agent::SharedMemory| {
        m.id == w.id
            && if w.is_shareable() {
                w.size <= m.size
            } else {
                m.size == w.size
            }
    };
    if let Some(i) = fds.iter().position(|m| same(m) && m.key == w.key) {
        return Ok(i);
    }
    Err(if fds.iter().any(same) {
        SharingError::ExporterReplaced { importer, exporter }
    } else {
        SharingError::NoSuchExport {
            importer,
            exporter,
            id: w.id,
        }
    })
}

/// Whether fd `fd1` of `pid1` and fd `fd2` of `pid2` are one open file (`kcmp(KCMP_FILE)`:
/// what `SCM_RIGHTS`, `dup` and `pidfd_getfd` share; nothing in the descriptor itself names
/// the export). A closed number is `Ok(false)`.
pub fn same_file(
    pid1: HostPid,
    fd1: ForeignFd,
    pid2: HostPid,
    fd2: ForeignFd,
) -> Result<bool, SharingError> {
    const KCMP_FILE: libc::c_long = 0;
    // SAFETY: kcmp only compares kernel objects of the two processes; no memory is passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid1.get(),
            pid2.get(),
            KCMP_FILE,
            fd1.get(),
            fd2.get(),
        )
    };
    match rc {
        0 => Ok(true),
        1..=3 => Ok(false),
        _ => {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EBADF) {
                return Ok(false);
            }
            Err(SharingError::Kcmp {
                pid1,
                pid2,
                source: e,
            })
        }
    }
}

/// One GPU process of a dump with its shares, as [`resolve_shareable`] sees it.
pub struct Sharer<'a> {
    /// Host pid (what `kcmp` takes).
    pub pid: HostPid,
    pub nspid: NsPid,
    pub shares: &'a mut Vec<Share>,
}

/// A shareable import resolved at a dump: tell `importer` (host pid) that its import `import`
/// is `exporter`'s (namespace pid) allocation `id` ([`AgentSession::shareable_source`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub importer: HostPid,
    pub import: u64,
    pub exporter: NsPid,
    pub id: u64,
    /// The exporter's key, which the importer records with its source.
    pub key: [u8; 16],
}

/// The shareable exports and imports of a dump (`docs/ipc.md`, "Shareable handles"), before
/// anything is released: each unresolved import is found among the exporters' descriptors
/// (`kcmp`) and rewritten as an import of (exporter, allocation), so that [`check`] and
/// [`reimport`] treat it as any other share; every export must be memory the agent moves and
/// be imported by some process of the dump; and no process of the dump (`others`: the ones
/// without CUDA) may hold a descriptor of an export but the exporter itself, whose agent makes
/// its descriptors name the memory again. `outside(fd holder search)`: the pid of a process
/// outside the dump holding the same open file as `(pid, fd)`, to name it.
pub fn resolve_shareable(
    members: &mut [Sharer<'_>],
    others: &[HostPid],
    outside: impl Fn(HostPid, ForeignFd) -> Option<HostPid>,
) -> Result<Vec<Resolved>, SharingError> {
    /// A shareable export of the dump.
    struct Export {
        /// The exporter's host pid and namespace pid.
        pid: HostPid,
        nspid: NsPid,
        /// The allocation.
        id: u64,
        /// The exporter's agent's duplicate of the program's descriptor.
        agent_fd: Option<ForeignFd>,
        /// The exporter's key.
        key: [u8; 16],
    }
    let mut exports: Vec<Export> = Vec::new();
    for m in members.iter() {
        for s in m.shares.iter().filter(|s| !s.import) {
            let ShareKind::Shareable { agent_fd, .. } = s.kind else {
                continue;
            };
            if !s.mapped {
                return Err(SharingError::ShareableNotMoved { exporter: m.nspid });
            }
            exports.push(Export {
                pid: m.pid,
                nspid: m.nspid,
                id: s.id,
                agent_fd,
                key: s.key,
            });
        }
    }
    // The agents' own descriptors (the importers' until they are told), and the exporters'
    // programs' (made to name the memory again).
    let own: BTreeSet<(HostPid, ForeignFd)> = members
        .iter()
        .flat_map(|m| {
            m.shares.iter().flat_map(move |s| {
                match s.kind {
                    ShareKind::Shareable {
                        agent_fd,
                        app_fd,
                        own_fd,
                    } => [agent_fd, app_fd, own_fd],
                    ShareKind::Ipc => [None; 3],
                }
                .into_iter()
                .flatten()
                .map(move |fd| (m.pid, fd))
            })
        })
        .collect();
    let mut resolved = Vec::new();
    for m in members.iter_mut() {
        let (pid, nspid) = (m.pid, m.nspid);
        for s in m.shares.iter_mut().filter(|s| s.unresolved()) {
            let import = s.id;
            let fd = match s.kind {
                ShareKind::Shareable { agent_fd, .. } => agent_fd,
                ShareKind::Ipc => None,
            };
            let mut found = None;
            if let Some(fd) = fd {
                for e in &exports {
                    if let Some(efd) = e.agent_fd
                        && same_file(pid, fd, e.pid, efd)?
                    {
                        found = Some((e.nspid, e.id, e.key));
                        break;
                    }
                }
            }
            let Some((exporter, id, key)) = found else {
                return Err(match fd.and_then(|fd| outside(pid, fd)) {
                    Some(exporter) => SharingError::ShareableExporterOutside {
                        importer: nspid,
                        exporter,
                    },
                    None => SharingError::ShareableNoExporter { importer: nspid },
                });
            };
            s.resolve(exporter, id, key);
            resolved.push(Resolved {
                importer: pid,
                import,
                exporter,
                id,
                key,
            });
        }
    }
    // Every export is imported in the dump (an importer outside it cannot be seen).
    for e in &exports {
        let imported = members.iter().any(|m| {
            m.shares
                .iter()
                .any(|s| s.is_shareable() && s.import && s.pid == e.nspid && s.id == e.id)
        });
        if !imported {
            return Err(SharingError::ShareableNoImporter { exporter: e.nspid });
        }
    }
    // Descriptors of an export held by anyone but the exporter's program and the agents.
    if !exports.is_empty() {
        let pids = members.iter().map(|m| m.pid).chain(others.iter().copied());
        for pid in pids {
            let fds = gpusnap_host::procfs::fd_numbers(pid).unwrap_or_default();
            for fd in fds {
                if own.contains(&(pid, fd)) || !maybe_exported(pid, fd) {
                    continue;
                }
                for e in &exports {
                    if let Some(efd) = e.agent_fd
                        && same_file(pid, fd, e.pid, efd)?
                    {
                        return Err(SharingError::ExportFdHeld {
                            pid,
                            fd,
                            exporter: e.nspid,
                        });
                    }
                }
            }
        }
    }
    Ok(resolved)
}

/// Whether `pid`'s fd `fd` may be exported device memory: an NVIDIA control device (the
/// driver's export) or a memfd (the stand-in's). Others are not compared.
fn maybe_exported(pid: HostPid, fd: ForeignFd) -> bool {
    gpusnap_host::procfs::fd_target(pid, fd).is_ok_and(|p| {
        let p = p.to_string_lossy();
        p.starts_with("/memfd:") || p == "/dev/nvidiactl"
    })
}

/// A process outside `inside` (host pids) that holds the same open file as `pid`'s `fd`: the
/// exporter of an import whose exporter is not in the dump (a scan of `/proc`, only on that
/// refusal). Its pid as `/proc` numbers it.
pub fn holder_outside(inside: &[HostPid], pid: HostPid, fd: ForeignFd) -> Option<HostPid> {
    let dir = std::fs::read_dir("/proc").ok()?;
    for e in dir.flatten() {
        let Some(other) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let other = HostPid(other);
        if other == pid || inside.contains(&other) {
            continue;
        }
        let fds = gpusnap_host::procfs::fd_numbers(other).unwrap_or_default();
        for ofd in fds {
            if maybe_exported(other, ofd) && same_file(pid, fd, other, ofd).unwrap_or(false) {
                return Some(other);
            }
        }
    }
    None
}

/// Tells each importer whose imports [`resolve_shareable`] resolved what they are (its agent
/// thread let run alone; the caller traces the processes).
pub fn announce(resolved: &[Resolved], timeout: Duration) -> Result<(), SharingError> {
    let mut by_pid: BTreeMap<HostPid, Vec<&Resolved>> = BTreeMap::new();
    for r in resolved {
        by_pid.entry(r.importer).or_default().push(r);
    }
    for (pid, rs) in by_pid {
        with_agent(pid, timeout, |s| {
            for r in &rs {
                s.shareable_source(r.import, r.exporter, r.id, r.key)?;
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// Makes the descriptors `p`'s program holds of its own shareable exports, and its agent's
/// duplicates, name its current memory again (its agent's `ShareFds`, which re-exports and
/// `dup3`s while a tracer holds the threads), once its memory is back and before its threads
/// run: a rollback, a restore, `gpusnap recover`. `fault_point`: the test point just before.
pub fn repoint(
    p: Process,
    timeout: Duration,
    fault_point: Option<&'static str>,
) -> Result<(), SharingError> {
    if agent::agent_thread(p.pid).is_none() {
        return Ok(());
    }
    with_agent(p.pid, timeout, |s| {
        let exports = s
            .list_sharing()?
            .iter()
            .any(|x| x.is_shareable() && !x.import);
        if exports {
            if let Some(point) = fault_point {
                gpusnap_host::fault::kill_criu_at(point);
            }
            let n = s.share_fds()?.len();
            log::info!(
                "pid {} (nspid {}): its descriptors of {n} shareable exports name their current memory",
                p.pid,
                p.nspid
            );
        }
        Ok(())
    })
}

/// A process of a rollback or a restore that may take part in a reimport.
#[derive(Clone, Copy, Debug)]
pub struct Process {
    /// Host pid.
    pub pid: HostPid,
    /// Its pid in its own namespace (what the shares name).
    pub nspid: NsPid,
}

/// The exporters as running processes (`gpusnap recover`, outside CRIU): their memory is their
/// own, and their agents answer the read-only `ListSharing` and `ShareFds` while they run. Pids
/// as the importer's namespace numbers them, which must be ours (`same_ns`).
pub fn from_running(same_ns: bool, timeout: Duration) -> Running {
    Running { same_ns, timeout }
}

/// [`from_running`]'s exporters.
pub struct Running {
    same_ns: bool,
    timeout: Duration,
}

impl Exporters for Running {
    fn host_pid(&self, exporter: NsPid) -> Result<HostPid, SharingError> {
        if !self.same_ns {
            return Err(SharingError::NoExporter {
                importer: NsPid(0),
                exporter,
            });
        }
        // The importer's namespace is ours (`same_ns`): its numbers are host pids.
        Ok(HostPid(exporter.get() as i32))
    }

    fn shares(&self, exporter: NsPid) -> Result<Vec<Share>, SharingError> {
        let pid = self.host_pid(exporter)?;
        let s =
            AgentSession::connect(pid, self.timeout)?.ok_or(SharingError::NoAgentThread { pid })?;
        Ok(s.list_sharing()?)
    }

    fn memory(&self, exporter: NsPid) -> Result<Vec<crate::agent::SharedMemory>, SharingError> {
        let pid = self.host_pid(exporter)?;
        let s =
            AgentSession::connect(pid, self.timeout)?.ok_or(SharingError::NoAgentThread { pid })?;
        Ok(s.share_fds()?)
    }
}

/// How many CUDA IPC imports of `pid` a release unmapped and nothing mapped again (`gpusnap
/// recover`: such a process must not run).
pub fn unmapped_imports(pid: HostPid, timeout: Duration) -> Result<usize, SharingError> {
    if agent::agent_thread(pid).is_none() {
        return Ok(0);
    }
    let shares = with_agent(pid, timeout, |s| Ok(s.list_sharing()?))?;
    Ok(shares.iter().filter(|s| s.import && !s.mapped).count())
}

/// Lets only `pid`'s agent thread run for `f` (the caller, CRIU's main thread, traces it).
fn with_agent<R>(
    pid: HostPid,
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

/// Where an importer's exporters are found at a reimport, by the namespace pid its imports
/// name: [`from_traced`] (a rollback, a restore) or [`from_running`] (`gpusnap recover`).
pub trait Exporters {
    /// The exporter's host pid (whose owner is compared with the importer's).
    fn host_pid(&self, exporter: NsPid) -> Result<HostPid, SharingError>;
    /// What the exporter's agent lists (`ListSharing`): which pids fetched its exports.
    fn shares(&self, exporter: NsPid) -> Result<Vec<Share>, SharingError>;
    /// The current memory of its exports (`ShareFds`).
    fn memory(&self, exporter: NsPid) -> Result<Vec<crate::agent::SharedMemory>, SharingError>;
}

/// What [`reimport`] takes its exporters from.
pub type Fetch<'a> = dyn Exporters + 'a;

/// The exporters among `processes` (all traced by the caller, CRIU's main thread): each one's
/// agent thread is let run alone for its `ListSharing` and `ShareFds`.
pub fn from_traced(processes: &[Process], timeout: Duration) -> Traced<'_> {
    Traced { processes, timeout }
}

/// [`from_traced`]'s exporters.
pub struct Traced<'a> {
    processes: &'a [Process],
    timeout: Duration,
}

impl Exporters for Traced<'_> {
    fn host_pid(&self, exporter: NsPid) -> Result<HostPid, SharingError> {
        self.processes
            .iter()
            .find(|p| p.nspid == exporter)
            .map(|p| p.pid)
            .ok_or(SharingError::NoExporter {
                importer: NsPid(0),
                exporter,
            })
    }

    fn shares(&self, exporter: NsPid) -> Result<Vec<Share>, SharingError> {
        with_agent(self.host_pid(exporter)?, self.timeout, |s| {
            Ok(s.list_sharing()?)
        })
    }

    fn memory(&self, exporter: NsPid) -> Result<Vec<crate::agent::SharedMemory>, SharingError> {
        with_agent(self.host_pid(exporter)?, self.timeout, |s| {
            Ok(s.share_fds()?)
        })
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
        gpusnap_host::fault::kill_criu_at(point);
    }
    let mut by_exporter: BTreeMap<NsPid, Vec<&Share>> = BTreeMap::new();
    for s in &unmapped {
        let wanted = by_exporter.entry(s.pid).or_default();
        // Several imports of one allocation (shareable handles imported twice) take one fd.
        if !wanted.iter().any(|w| w.id == s.id) {
            wanted.push(s);
        }
    }
    let in_place = |e: SharingError| match e {
        SharingError::NoExporter { exporter, .. } => SharingError::NoExporter {
            importer: me,
            exporter,
        },
        other => other,
    };
    let mine = owner(importer.pid);
    let mut memory = Vec::new();
    let mut refused = Vec::new();
    for (&exporter, wanted) in &by_exporter {
        // Never on the importer's word alone: its owner must be the exporter's, or the
        // exporter's agent must say it fetched that allocation.
        let theirs = owner(fetch.host_pid(exporter).map_err(in_place)?);
        let listed = if same_owner(mine, theirs) {
            None
        } else {
            Some(fetch.shares(exporter).map_err(in_place)?)
        };
        let mut allowed = Vec::new();
        for w in wanted {
            if listed
                .as_ref()
                .is_none_or(|l| confirmed_by_exporter(l, w, me))
            {
                allowed.push(*w);
                continue;
            }
            let e = SharingError::ForeignShare {
                importer: me,
                exporter,
                id: w.id,
                importer_uids: mine,
                exporter_uids: theirs,
            };
            log::warn!("pid {}: {e}", importer.pid);
            refused.push(e);
        }
        if allowed.is_empty() {
            continue;
        }
        let mut fds = fetch.memory(exporter).map_err(in_place)?;
        for w in allowed {
            let i = export_of(&fds, w, me, exporter)?;
            memory.push((exporter, fds.swap_remove(i)));
        }
    }
    let mapped = with_agent(importer.pid, timeout, |s| {
        for (exporter, mem) in &memory {
            s.reimport(*exporter, mem)?;
        }
        if !refused.is_empty() {
            // The refused imports stay unmapped: the caller holds the importer.
            return Ok(memory.len());
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
    if let Some(first) = refused.into_iter().next() {
        return Err(first);
    }
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
            pid: NsPid(pid),
            id,
            addr: 0x7000_0000_0000 + id * (2 << 20),
            size: 2 << 20,
            mapped: true,
            key: KEY,
            kind: ShareKind::Ipc,
        }
    }

    /// A shareable handle's share with no descriptors.
    const SHAREABLE: ShareKind = ShareKind::Shareable {
        agent_fd: None,
        app_fd: None,
        own_fd: None,
    };

    /// The exporter's key in these tests.
    const KEY: [u8; 16] = [0x4b; 16];

    #[test]
    fn a_tree_that_holds_both_sides_passes() {
        let exp = [share(false, 11, 1)];
        let imp = [share(true, 10, 1)];
        let members = [
            Member {
                pid: HostPid(std::process::id() as i32),
                nspid: NsPid(10),
                split: true,
                shares: &exp,
            },
            Member {
                pid: HostPid(std::process::id() as i32),
                nspid: NsPid(11),
                split: true,
                shares: &imp,
            },
        ];
        check(&members, |_| false).unwrap();
    }

    /// The exporter's pid is in the dump, but as another process (the exporter exited and its
    /// pid was used again): an export of the same allocation id with another key is not the
    /// import's memory, and none at all is named too. Either refuses before anything is
    /// released.
    #[test]
    fn an_import_whose_exporter_is_another_process_now_is_refused() {
        let imp = [share(true, 10, 1)];
        let tree = |exp| {
            [
                Member {
                    pid: HostPid(std::process::id() as i32),
                    nspid: NsPid(10),
                    split: true,
                    shares: exp,
                },
                Member {
                    pid: HostPid(std::process::id() as i32),
                    nspid: NsPid(11),
                    split: true,
                    shares: &imp,
                },
            ]
        };
        let mut replaced = share(false, 11, 1);
        replaced.key = [0x77; 16];
        let replaced = [replaced];
        let e = check(&tree(&replaced), |_| false).unwrap_err();
        assert!(
            matches!(
                e,
                SharingError::ExporterReplaced {
                    importer: NsPid(11),
                    exporter: NsPid(10)
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("its pid was used again"), "{e}");
        // No export of that allocation at all.
        assert!(matches!(
            check(&tree(&[share(false, 11, 2)]), |_| false),
            Err(SharingError::NoSuchExport {
                importer: NsPid(11),
                exporter: NsPid(10),
                id: 1
            })
        ));
    }

    /// At a reimport (`gpusnap recover` of a held importer) the exporter's memory is taken only
    /// from the exporter the import recorded: another process with its pid is refused.
    #[test]
    fn a_reimport_takes_only_the_recorded_exporter_s_memory() {
        let mem = |key| crate::agent::SharedMemory {
            id: 1,
            addr: 0x7000_0000_0000 + (2 << 20),
            size: 2 << 20,
            key,
            fd: memfd(),
        };
        let w = share(true, 10, 1);
        assert_eq!(
            export_of(&[mem([1; 16]), mem(KEY)], &w, NsPid(11), NsPid(10)).unwrap(),
            1
        );
        assert!(matches!(
            export_of(&[mem([1; 16])], &w, NsPid(11), NsPid(10)),
            Err(SharingError::ExporterReplaced {
                importer: NsPid(11),
                exporter: NsPid(10)
            })
        ));
        assert!(matches!(
            export_of(&[], &w, NsPid(11), NsPid(10)),
            Err(SharingError::NoSuchExport { id: 1, .. })
        ));
    }

    #[test]
    fn an_exporter_outside_the_dump_is_named() {
        let imp = [share(true, 10, 1)];
        let members = [Member {
            pid: HostPid(std::process::id() as i32),
            nspid: NsPid(11),
            split: true,
            shares: &imp,
        }];
        let e = check(&members, |_| false).unwrap_err();
        assert!(matches!(
            e,
            SharingError::ExporterOutside {
                importer: NsPid(11),
                exporter: NsPid(10)
            }
        ));
        assert!(e.to_string().contains("pid 10 is not in this dump"), "{e}");
    }

    #[test]
    fn an_importer_outside_the_dump_is_named_unless_it_is_gone() {
        let exp = [share(false, 12, 1), share(false, 0, 2)];
        let members = [Member {
            pid: HostPid(std::process::id() as i32),
            nspid: NsPid(10),
            split: true,
            shares: &exp,
        }];
        assert!(matches!(
            check(&members, |_| false),
            Err(SharingError::ImporterOutside {
                exporter: NsPid(10),
                importer: NsPid(12)
            })
        ));
        check(&members, |pid| pid == NsPid(12)).unwrap();
    }

    /// A victim (nspid 10, uid 1001) and a job (nspid 11, uid 65534): `exp` is what the victim
    /// lists, `imp` what the job lists.
    fn victim_and_job<'a>(exp: &'a [Share], imp: &'a [Share]) -> [Member<'a>; 2] {
        [
            Member {
                pid: HostPid(1001),
                nspid: NsPid(10),
                split: true,
                shares: exp,
            },
            Member {
                pid: HostPid(65534),
                nspid: NsPid(11),
                split: true,
                shares: imp,
            },
        ]
    }

    /// An import of another user's memory is refused at the dump, naming both owners, unless
    /// the exporter's own agent says that importer fetched it; a key alone is no proof.
    #[test]
    fn an_import_of_another_users_memory_is_refused_unless_the_exporter_confirms_it() {
        // Owners by host pid: here the pid is the uid.
        let owner_of = |pid: HostPid| Some((pid.get() as u32, pid.get() as u32));
        // The job lists the victim's allocation #1 with its right key; the victim's export was
        // fetched by nspid 12 only (gone by now, as far as the rule cares).
        let exp = [share(false, 12, 1)];
        let imp = [share(true, 10, 1)];
        let e = check_with(
            &victim_and_job(&exp, &imp),
            |pid| pid == NsPid(12),
            owner_of,
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                SharingError::ForeignShare {
                    importer: NsPid(11),
                    exporter: NsPid(10),
                    id: 1,
                    importer_uids: Some((65534, 65534)),
                    exporter_uids: Some((1001, 1001)),
                }
            ),
            "{e}"
        );
        let text = e.to_string();
        assert!(
            text.contains("pid 11 runs as uid 65534") && text.contains("pid 10 runs as uid 1001"),
            "{text}"
        );
        // The same owner: carried. An owner that cannot be read is not the same owner.
        check_with(
            &victim_and_job(&exp, &imp),
            |pid| pid == NsPid(12),
            |_| Some((7, 7)),
        )
        .unwrap();
        assert!(
            check_with(
                &victim_and_job(&exp, &imp),
                |pid| pid == NsPid(12),
                |_| None
            )
            .is_err()
        );
        // The exporter's agent names the importer as having fetched it: carried.
        let fetched = [share(false, 11, 1)];
        check_with(&victim_and_job(&fetched, &imp), |_| false, owner_of).unwrap();
        // ... but not another allocation, nor with another key.
        let other = [share(false, 11, 2), share(false, 12, 1)];
        assert!(check_with(&victim_and_job(&other, &imp), |_| true, owner_of).is_err());
        let mut rekeyed = share(false, 11, 1);
        rekeyed.key = [1; 16];
        assert!(!confirmed_by_exporter(&[rekeyed], &imp[0], NsPid(11)));
        // A shareable export names nobody that fetched it: only the same owner carries it.
        let mut sh = share(false, 11, 1);
        sh.kind = SHAREABLE;
        assert!(!confirmed_by_exporter(&[sh], &imp[0], NsPid(11)));
    }

    /// The size check holds for every kind of share: the agent's IPC maps the whole allocation,
    /// a shareable import no more than the export.
    #[test]
    fn a_reimport_checks_the_size_of_every_kind() {
        let mem = |size| crate::agent::SharedMemory {
            id: 1,
            addr: 0x7000_0000_0000,
            size,
            key: KEY,
            fd: memfd(),
        };
        let ipc = share(true, 10, 1);
        assert!(export_of(&[mem(4 << 20)], &ipc, NsPid(11), NsPid(10)).is_err());
        assert_eq!(
            export_of(&[mem(2 << 20)], &ipc, NsPid(11), NsPid(10)).unwrap(),
            0
        );
        let mut part = share(true, 10, 1);
        part.kind = SHAREABLE;
        assert_eq!(
            export_of(&[mem(4 << 20)], &part, NsPid(11), NsPid(10)).unwrap(),
            0
        );
        part.size = 8 << 20;
        assert!(export_of(&[mem(4 << 20)], &part, NsPid(11), NsPid(10)).is_err());
    }

    /// This process's owner, as `/proc` says it.
    #[test]
    fn the_owner_of_a_process_is_read() {
        // SAFETY: getuid and geteuid have no preconditions.
        let me = unsafe { (libc::getuid(), libc::geteuid()) };
        assert_eq!(owner(HostPid(std::process::id() as i32)), Some(me));
        assert_eq!(owner(HostPid(-1)), None);
    }

    fn memfd() -> std::os::fd::OwnedFd {
        use std::os::fd::FromRawFd;
        // SAFETY: a plain memfd_create with a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"sharing-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor nothing else owns.
        unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }
    }

    fn shareable(import: bool, id: u64, agent_fd: i32, app_fd: i32, mapped: bool) -> Share {
        Share {
            import,
            pid: NsPid(0),
            id,
            addr: 0x7000_0000_0000,
            size: 2 << 20,
            mapped,
            // An export says its exporter's key; an unresolved import knows none yet.
            key: if import { [0; 16] } else { KEY },
            kind: ShareKind::Shareable {
                agent_fd: ForeignFd::new(agent_fd),
                app_fd: ForeignFd::new(app_fd),
                own_fd: None,
            },
        }
    }

    /// A shareable share's `agent_fd` as the wire says it (-1: none).
    fn agent_fd(s: &Share) -> i32 {
        match s.kind {
            ShareKind::Shareable { agent_fd, .. } => agent_fd.map_or(-1, ForeignFd::get),
            ShareKind::Ipc => panic!("not a shareable handle's: {s:?}"),
        }
    }

    /// Both "processes" are this one (kcmp of a process with itself compares its own fds).
    fn resolve(exp: &mut Vec<Share>, imp: &mut Vec<Share>) -> Result<Vec<Resolved>, SharingError> {
        let me = HostPid(std::process::id() as i32);
        let mut members = [
            Sharer {
                pid: me,
                nspid: NsPid(10),
                shares: exp,
            },
            Sharer {
                pid: me,
                nspid: NsPid(11),
                shares: imp,
            },
        ];
        resolve_shareable(&mut members, &[], |_, _| Some(HostPid(4242)))
    }

    #[test]
    fn a_shareable_import_is_found_by_its_open_file() {
        use std::os::fd::AsRawFd;
        let app = memfd();
        let agent = app.try_clone().unwrap();
        let ident = app.try_clone().unwrap();
        let other = memfd();
        let mut exp = vec![shareable(
            false,
            7,
            agent.as_raw_fd(),
            app.as_raw_fd(),
            true,
        )];
        let mut imp = vec![shareable(true, 1, ident.as_raw_fd(), -1, true)];
        let r = resolve(&mut exp, &mut imp).unwrap();
        assert_eq!(
            r,
            [Resolved {
                importer: HostPid(std::process::id() as i32),
                import: 1,
                exporter: NsPid(10),
                id: 7,
                key: KEY,
            }]
        );
        assert_eq!(
            (imp[0].pid.get(), imp[0].id, agent_fd(&imp[0])),
            (10, 7, -1)
        );
        assert_eq!(imp[0].key, KEY, "the import records its exporter's key");
        // Then the usual rule sees an import of a process inside the dump.
        let members = [
            Member {
                pid: HostPid(std::process::id() as i32),
                nspid: NsPid(10),
                split: true,
                shares: &exp,
            },
            Member {
                pid: HostPid(std::process::id() as i32),
                nspid: NsPid(11),
                split: true,
                shares: &imp,
            },
        ];
        check(&members, |_| false).unwrap();

        // An import of another file: its exporter is named when found outside the dump.
        let mut exp = vec![shareable(
            false,
            7,
            agent.as_raw_fd(),
            app.as_raw_fd(),
            true,
        )];
        let mut imp = vec![shareable(true, 1, other.as_raw_fd(), -1, true)];
        let e = resolve(&mut exp, &mut imp).unwrap_err();
        assert!(
            matches!(
                e,
                SharingError::ShareableExporterOutside {
                    importer: NsPid(11),
                    exporter: HostPid(4242)
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("pid 4242 is not in this dump"),
            "{e}"
        );
    }

    #[test]
    fn shareable_exports_nobody_imports_or_that_are_not_moved_are_refused() {
        use std::os::fd::AsRawFd;
        let app = memfd();
        let agent = app.try_clone().unwrap();
        let mut exp = vec![shareable(
            false,
            7,
            agent.as_raw_fd(),
            app.as_raw_fd(),
            true,
        )];
        let mut imp = Vec::new();
        assert!(matches!(
            resolve(&mut exp, &mut imp),
            Err(SharingError::ShareableNoImporter {
                exporter: NsPid(10)
            })
        ));
        let mut exp = vec![shareable(false, 0, agent.as_raw_fd(), -1, false)];
        assert!(matches!(
            resolve(&mut exp, &mut imp),
            Err(SharingError::ShareableNotMoved {
                exporter: NsPid(10)
            })
        ));
    }

    #[test]
    fn a_descriptor_of_an_export_held_elsewhere_is_refused() {
        use std::os::fd::AsRawFd;
        let app = memfd();
        let agent = app.try_clone().unwrap();
        let ident = app.try_clone().unwrap();
        let stray = app.try_clone().unwrap();
        let mut exp = vec![shareable(
            false,
            7,
            agent.as_raw_fd(),
            app.as_raw_fd(),
            true,
        )];
        let mut imp = vec![shareable(true, 1, ident.as_raw_fd(), -1, true)];
        let e = resolve(&mut exp, &mut imp).unwrap_err();
        match e {
            SharingError::ExportFdHeld { fd, exporter, .. } => {
                assert_eq!((fd.get(), exporter.get()), (stray.as_raw_fd(), 10));
            }
            other => panic!("{other}"),
        }
        drop(stray);
        let mut exp = vec![shareable(
            false,
            7,
            agent.as_raw_fd(),
            app.as_raw_fd(),
            true,
        )];
        let mut imp = vec![shareable(true, 1, ident.as_raw_fd(), -1, true)];
        resolve(&mut exp, &mut imp).unwrap();
    }

    #[test]
    fn shares_on_the_transparent_path_are_refused() {
        let exp = [share(false, 0, 1)];
        let members = [Member {
            pid: HostPid(std::process::id() as i32),
            nspid: NsPid(10),
            split: false,
            shares: &exp,
        }];
        assert!(matches!(
            check(&members, |_| true),
            Err(SharingError::NotSplit { pid: NsPid(10) })
        ));
        // A process that shares nothing may take either path.
        let none: [Share; 0] = [];
        let members = [Member {
            pid: HostPid(std::process::id() as i32),
            nspid: NsPid(10),
            split: false,
            shares: &none,
        }];
        check(&members, |_| true).unwrap();
    }
}
