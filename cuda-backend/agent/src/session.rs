//! What a dump and a restore share: the ring parameters, the failure type with its reply, the
//! table snapshot, and the one way out of an operation ([`conclude`]): wait for our copies,
//! unpin and unmap the staging, then send the final reply, then close.

use std::fmt;
use std::os::fd::OwnedFd;
use std::time::Duration;

use gpusnap_proto::{Channel, CommonRequest, ErrorCode, ProtoError, Reply, Request};

use crate::cu::CuError;
use crate::gpu::Gpu;
use crate::log::debug;
use crate::plan::Span;
use crate::real::Driver;
use crate::staging::{Staging, StagingError};
use crate::table::{self, AGENT_LOCK_WAIT, Backing};

/// How long the agent waits for the plugin when it cannot go on without it (no free slot).
pub const PEER_WAIT: Duration = Duration::from_secs(60);

/// Staging ring parameters of `DumpBegin` / `RestoreBegin`.
#[derive(Clone, Copy, Debug)]
pub struct Ring {
    pub slot_size: u64,
    pub slots: u32,
    pub streams: u32,
}

/// Why an operation stops early.
#[derive(Debug)]
pub enum Fail {
    /// Reply `Error { code, message }`.
    Reply(ErrorCode, String),
    /// The plugin asked to abort: reply `Aborted`.
    Aborted,
    /// The connection is gone: nothing to reply.
    Closed,
}

impl Fail {
    /// Reply `BadRequest`, `why` (a message or an error) written out for the plugin's log.
    pub fn bad_request(why: impl fmt::Display) -> Self {
        Fail::Reply(ErrorCode::BadRequest, why.to_string())
    }
    /// Reply `BadState`, `why` written out as for [`Fail::bad_request`].
    pub fn bad_state(why: impl fmt::Display) -> Self {
        Fail::Reply(ErrorCode::BadState, why.to_string())
    }
    pub fn unexpected(req: &impl std::fmt::Debug, phase: &str) -> Self {
        Fail::bad_state(format!("{req:?} is not expected {phase}"))
    }
    pub fn busy() -> Self {
        Fail::Reply(ErrorCode::Busy, busy_message())
    }
}

/// Why the agent answers `Busy`.
fn busy_message() -> String {
    format!(
        "the allocation table stayed locked for {} ms (an application thread holds it)",
        AGENT_LOCK_WAIT.as_millis()
    )
}

/// The reply when the allocation table cannot be locked in time.
pub fn busy_reply() -> Reply {
    Reply::Error {
        code: ErrorCode::Busy,
        message: busy_message(),
    }
}

impl From<CuError> for Fail {
    fn from(e: CuError) -> Self {
        Fail::Reply(ErrorCode::Cuda, e.to_string())
    }
}

impl From<StagingError> for Fail {
    fn from(e: StagingError) -> Self {
        Fail::Reply(ErrorCode::Staging, e.to_string())
    }
}

impl From<ProtoError> for Fail {
    fn from(e: ProtoError) -> Self {
        match e {
            ProtoError::Closed | ProtoError::Io(_) => Fail::Closed,
            ProtoError::Timeout => Fail::Reply(
                ErrorCode::Timeout,
                format!("no message from the plugin for {} s", PEER_WAIT.as_secs()),
            ),
            ProtoError::VersionMismatch { .. } => {
                Fail::Reply(ErrorCode::VersionMismatch, e.to_string())
            }
            other => Fail::bad_request(other.to_string()),
        }
    }
}

/// The driver table, or the `Cuda` error an operation fails with.
pub fn need_driver() -> Result<&'static Driver, Fail> {
    crate::real::driver()
        .map_err(|e| Fail::Reply(ErrorCode::Cuda, format!("CUDA driver unavailable: {e}")))
}

/// `req` (a request of this server's type, the job's agent's or the keeper's) as one of the
/// requests both take, which are all an operation takes on its connection; one of this
/// server's own fails the operation as not expected `phase`.
pub fn common<R: Request>(req: R, phase: &str) -> Result<CommonRequest, Fail> {
    req.into_common()
        .map_err(|own| Fail::unexpected(&own, phase))
}

/// Messages in a data phase never carry a descriptor.
pub fn no_fd(fd: Option<OwnedFd>) -> Result<(), Fail> {
    match fd {
        None => Ok(()),
        Some(_) => Err(Fail::bad_request("unexpected file descriptor")),
    }
}

/// Converted allocations in address order, and which of them are released. Fails with `Busy`
/// when the table cannot be locked in time.
pub fn snapshot() -> Result<(Vec<Span>, Vec<bool>), Fail> {
    let t = table::try_lock_for(AGENT_LOCK_WAIT).ok_or_else(Fail::busy)?;
    Ok(spans_of(&t))
}

/// [`snapshot`] of a table the caller has locked.
pub fn spans_of(t: &table::Table) -> (Vec<Span>, Vec<bool>) {
    t.converted()
        .map(|c| {
            (
                Span {
                    id: c.id,
                    device: c.device,
                    addr: c.addr,
                    size: c.size,
                    at: c.mapped_at,
                },
                c.backing == Backing::Released,
            )
        })
        .unzip()
}

/// Distinct devices of the spans.
pub fn devices(spans: &[Span]) -> Vec<i32> {
    let mut d: Vec<i32> = spans.iter().map(|s| s.device).collect();
    d.sort_unstable();
    d.dedup();
    d
}

/// Ends an operation: waits for our copies, removes the staging, then replies (`Ok` reply,
/// `Error`, or `Aborted`). The caller closes the connection afterwards.
pub fn conclude(
    ch: &Channel,
    gpu: &mut Gpu,
    staging: Option<Staging>,
    result: Result<Reply, Fail>,
) {
    if let Some(st) = staging {
        if let Some(drv) = crate::real::driver_if_loaded() {
            gpu.quiesce(drv);
        }
        if let Err(e) = st.close() {
            debug!("{e}");
            let _ = ch.send_reply(&Reply::Error {
                code: ErrorCode::Staging,
                message: e.to_string(),
            });
            return;
        }
    }
    let reply = match result {
        Ok(r) => r,
        Err(f) => match fail_reply(f) {
            Some(r) => r,
            None => return,
        },
    };
    let _ = ch.send_reply(&reply);
}

/// The reply an operation that stopped early owes the plugin; `None` when the connection is
/// gone (nothing to reply).
pub fn fail_reply(f: Fail) -> Option<Reply> {
    match f {
        Fail::Reply(code, message) => {
            debug!("operation failed: {code:?}: {message}");
            Some(Reply::Error { code, message })
        }
        Fail::Aborted => Some(Reply::Aborted),
        Fail::Closed => {
            debug!("the plugin closed the connection mid-operation");
            None
        }
    }
}
