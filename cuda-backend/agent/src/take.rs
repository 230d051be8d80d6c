//! A restore by hand-over, in the restored job (its threads held): the keeper loaded the image
//! into fresh exportable memory beside CRIU's restore and checked it on the GPU; the plugin
//! passes each allocation's exported descriptor here (`Take`), and the job maps it at its
//! recorded address. No data moves in the job. The descriptor stays the allocation's own (the
//! driver will not export an imported handle again), for the next dump's lend.
//!
//! Until `TakeEnd` finds every released allocation mapped, the memory counts as released
//! (`Hello` says so), whatever is mapped: a hand-over cut short never passes for whole.

use std::os::fd::{AsFd, OwnedFd};
use std::time::Instant;

use gpusnap_proto::{AgentRequest, Channel, CommonRequest, Reply};

use crate::gpu::Gpu;
use crate::log::debug;
use crate::session::{self, Fail, PEER_WAIT, need_driver};
use crate::table::{self, AGENT_LOCK_WAIT};

/// One `Take`: the allocation's id, address and size, and its exported memory.
pub struct Take {
    pub id: u64,
    pub addr: u64,
    pub size: u64,
    /// The keeper made the memory RDMA-capable.
    pub rdma_capable: bool,
    pub fd: OwnedFd,
}

impl Take {
    /// The message `(request, descriptor)` as a `Take` with its descriptor; any other message
    /// is given back unchanged. The one place that reads a `Take` off the wire.
    pub fn from_message(
        msg: (AgentRequest, Option<OwnedFd>),
    ) -> Result<Take, (AgentRequest, Option<OwnedFd>)> {
        match msg {
            (
                AgentRequest::Take {
                    id,
                    addr,
                    size,
                    rdma_capable,
                },
                Some(fd),
            ) => Ok(Take {
                id,
                addr,
                size,
                rdma_capable,
                fd,
            }),
            other => Err(other),
        }
    }
}

/// `Take` .. `TakeEnd` on this connection, starting with `first`; the connection is closed
/// afterwards.
pub fn run(ch: &Channel, gpu: &mut Gpu, first: Take) {
    let result = take_all(ch, gpu, first);
    session::conclude(ch, gpu, None, result);
}

fn take_all(ch: &Channel, gpu: &mut Gpu, first: Take) -> Result<Reply, Fail> {
    let t0 = Instant::now();
    let drv = need_driver()?;
    crate::held::by_a_tracer().map_err(Fail::bad_state)?;
    // What CRIU opened at the numbers of the descriptors the dumped process kept are
    // placeholders: closed before anything is mapped.
    crate::lend::forget();
    let (spans, released) = session::snapshot()?;
    if !released.iter().any(|&r| r) {
        return Err(Fail::bad_state(
            "nothing is released: there is no memory to hand over",
        ));
    }
    table::try_lock_for(AGENT_LOCK_WAIT)
        .ok_or_else(Fail::busy)?
        .reload_begins();
    let mut taken = vec![false; spans.len()];
    let (mut count, mut bytes) = (0u32, 0u64);
    let mut next = Some(first);
    loop {
        let t = match next.take() {
            Some(t) => t,
            None => match Take::from_message(ch.recv_request(Some(PEER_WAIT))?) {
                Ok(t) => t,
                Err((AgentRequest::TakeEnd, None)) => break,
                Err((AgentRequest::Common(CommonRequest::Abort), _)) => return Err(Fail::Aborted),
                Err((other, _)) => {
                    return Err(Fail::unexpected(
                        &other,
                        "while memory is handed over (Take with its descriptor, or TakeEnd)",
                    ));
                }
            },
        };
        let Some(i) = spans
            .iter()
            .position(|s| s.id == t.id && s.addr == t.addr && s.size == t.size)
        else {
            return Err(Fail::bad_request(format!(
                "Take of #{} at {:#x} ({} bytes) matches no allocation of this process",
                t.id, t.addr, t.size
            )));
        };
        if !released[i] || taken[i] {
            return Err(Fail::bad_request(format!(
                "#{} at {:#x} is mapped already: refusing to map it twice",
                t.id, t.addr
            )));
        }
        let handle = crate::lend::map_from_descriptor(
            drv,
            gpu,
            spans[i].device,
            t.addr,
            t.size,
            t.fd.as_fd(),
            |h| same_memory_kind(drv, (t.addr, t.rdma_capable), h),
        )?;
        crate::own_fds::keep_own(t.id, t.addr, handle, t.fd);
        taken[i] = true;
        count += 1;
        bytes += t.size;
        ch.send_reply(&Reply::Taken { id: t.id })?;
    }
    if let Some(i) = (0..spans.len()).find(|&i| released[i] && !taken[i]) {
        return Err(Fail::bad_request(format!(
            "#{} at {:#x} was not handed over: the memory is not whole",
            spans[i].id, spans[i].addr
        )));
    }
    table::try_lock_for(AGENT_LOCK_WAIT)
        .ok_or_else(Fail::busy)?
        .reload_complete();
    let micros = t0.elapsed().as_micros() as u64;
    debug!("hand-over: mapped {count} allocations ({bytes} bytes) in {micros} us");
    Ok(Reply::TakenAll {
        allocations: count,
        bytes,
        micros,
    })
}

/// The memory the keeper made for the allocation at `addr` must be RDMA-capable exactly where
/// the job's was (its own `cuMemCreate` properties, kept by the table; the agent's own
/// conversions are not): the program would otherwise run on memory other than it asked for.
/// What the keeper says it made (`made_rdma`, checked against the driver in the keeper when it
/// created the memory) decides; how the driver describes the imported handle here is only
/// logged where it differs, since what it reports for an import was never seen on a GPU.
fn same_memory_kind(
    drv: &crate::real::Driver,
    (addr, made_rdma): (u64, bool),
    imported: cudarc::driver::sys::CUmemGenericAllocationHandle,
) -> Result<(), Fail> {
    let had = table::try_lock_for(AGENT_LOCK_WAIT)
        .ok_or_else(Fail::busy)?
        .app_prop(addr)
        .is_some_and(|p| crate::cu::rdma_capable(&p));
    if made_rdma != had {
        return Err(Fail::bad_state(format!(
            "the memory handed over for {addr:#x} was made with gpuDirectRDMACapable {}, the job's had {}: refusing it",
            u8::from(made_rdma),
            u8::from(had)
        )));
    }
    if let Ok(Some(got)) = drv.props_of_handle(imported)
        && crate::cu::rdma_capable(&got) != had
    {
        debug!(
            "hand-over: the driver describes the memory imported at {addr:#x} with gpuDirectRDMACapable {} (the keeper made it {}); taken",
            u8::from(crate::cu::rdma_capable(&got)),
            u8::from(had)
        );
    }
    Ok(())
}
