//! [`Share`]: one share of device memory between processes, as a job's agent lists it
//! ([`crate::AgentRequest::ListSharing`]: one [`crate::Reply::Shared`] each). The agent builds
//! it, the wire carries it, the plugin reads it: one type for all three.

use crate::ForeignFd;
use crate::pid::NsPid;

/// One share of a process's device memory, or of another process's memory it maps.
///
/// `import`: another process's allocation `id` (of exporter `pid`) mapped here at `addr`,
/// `mapped` false while a release has it unmapped. Else an allocation of this process's,
/// exported, that process `pid` fetched (0: nobody fetched it yet); `mapped` is whether this
/// process maps it. How it is shared, and what only a shareable handle has, is its [`kind`].
///
/// [`kind`]: Share::kind
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Share {
    /// Another process's allocation mapped here (else one of this process's, exported).
    pub import: bool,
    /// Import: the exporter. Export: a process that fetched it (0: none yet). As the processes'
    /// own pid namespace numbers them. A shareable handle's: 0 for an export, and for an import
    /// until the plugin resolves it ([`Share::unresolved`]).
    pub pid: NsPid,
    /// The exporter's allocation id (an unresolved shareable import: the importer's own import
    /// id).
    pub id: u64,
    /// Where it is mapped here (import: the base of the mapping; export: the allocation's).
    pub addr: u64,
    pub size: u64,
    /// Import: mapped now (a release unmaps it until a reimport). Export: always true for the
    /// agent's IPC; for a shareable handle, whether it is memory the agent moves (else not
    /// carried, and `id` is 0).
    pub mapped: bool,
    /// The exporter's key (`identity`: random per process, kept across its restore): an export
    /// says its own, an import its source's (zeros: an unresolved shareable import). An import is
    /// carried only with an export of the same pid, allocation *and* key.
    pub key: [u8; 16],
    /// How the memory is shared.
    pub kind: ShareKind,
}

/// How a [`Share`] is shared: through the agent's CUDA IPC, or by a shareable handle the
/// program made itself, which alone has descriptors (the job's, so [`ForeignFd`]s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShareKind {
    /// The agent's CUDA IPC: legacy IPC handles (`cuIpcGetMemHandle` /
    /// `cuIpcOpenMemHandle`) of the memory it converted, served by the agent.
    Ipc,
    /// A share the program made itself with `cuMemExportToShareableHandle` /
    /// `cuMemImportFromShareableHandle`.
    Shareable {
        /// Export: the agent's duplicate of the descriptor the program got. Import not yet
        /// resolved: the agent's duplicate of the descriptor imported; once resolved (told by
        /// [`crate::AgentRequest::ShareableSource`]) none.
        agent_fd: Option<ForeignFd>,
        /// Export: the program's descriptor, while it is still the same open file. None for an
        /// import (the plugin looks at every descriptor itself).
        app_fd: Option<ForeignFd>,
        /// Export: the descriptor a hand-over left the agent as the allocation's own (the same
        /// open file as `agent_fd` once a restore or rollback handed it out).
        own_fd: Option<ForeignFd>,
    },
}

impl Share {
    /// Made by the program itself with a shareable handle (not the agent's CUDA IPC).
    pub fn is_shareable(&self) -> bool {
        matches!(self.kind, ShareKind::Shareable { .. })
    }

    /// A shareable import the plugin has not resolved to its exporter yet.
    pub fn unresolved(&self) -> bool {
        self.is_shareable() && self.import && self.pid == NsPid(0)
    }

    /// The plugin resolved this (shareable) import: it is `exporter`'s allocation `id`, whose
    /// key is `key`; the agent's duplicate of the descriptor imported is no longer what names
    /// it (as the importer's agent lists it once told: [`crate::AgentRequest::ShareableSource`]).
    pub fn resolve(&mut self, exporter: NsPid, id: u64, key: [u8; 16]) {
        self.pid = exporter;
        self.id = id;
        self.key = key;
        if let ShareKind::Shareable { agent_fd, .. } = &mut self.kind {
            *agent_fd = None;
        }
    }
}
