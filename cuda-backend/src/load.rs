//! Loading an image's device data into a process through its agent: the restore's classic
//! route, a rollback's reload, and the fallback when the keeper could not take the load.

use crate::agent::AgentSession;
use crate::context::Ctx;
use crate::datapath::{self, DataError};
use crate::staging::{RingMaker, RingShape, Staging};
use gpusnap_host::pid::HostPid;
use gpusnap_image::Manifest;
use std::os::fd::BorrowedFd;

/// The staging ring for loading `manifest`'s chunks with `staging_slots` configured (zero chunks
/// are filled on the device and take no slot).
pub fn ring_shape(staging_slots: usize, manifest: &Manifest) -> RingShape {
    let chunk_lens = manifest
        .chunks
        .iter()
        .filter(|c| c.is_stored())
        .map(|c| c.len);
    RingShape::for_restore(staging_slots, chunk_lens)
}

/// Streams `manifest`'s data into re-created memory; the agent thread already runs.
/// `fault_point` is where a test may kill CRIU once the first chunk is in ([`gpusnap_host::fault`]).
pub fn with_agent_running(
    ctx: &Ctx,
    pid: HostPid,
    dir: BorrowedFd<'_>,
    manifest: &Manifest,
    fault_point: &'static str,
    checks: datapath::ReadChecks,
    early: Option<RingMaker>,
) -> Result<datapath::LoadStats, DataError> {
    let session = AgentSession::connect_expected(pid, ctx.agent_timeout())?;
    let ring = ring_shape(ctx.cfg.staging_slots as usize, manifest);
    let staging = match early {
        Some(m) if m.shape() == ring => m.take(),
        _ => Staging::new(ring.slot_size, ring.slots),
    }
    .map_err(DataError::Ring)?;
    let hello = session.hello()?;
    log::debug!("pid {pid}: agent tid {} ready to load", hello.ns_tid);
    let stats = datapath::copy_in(
        &session,
        &staging,
        dir,
        manifest,
        ctx.cfg.effective_reader_threads(),
        ctx.limits(),
        fault_point,
        checks,
    )?;
    // The agent closes the connection after `Restored`.
    session.closed()?;
    Ok(stats)
}
