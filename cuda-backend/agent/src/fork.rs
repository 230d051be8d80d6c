//! `pthread_atfork` handlers. The table lock is taken around `fork` so the child never inherits
//! it locked; in the child the table is cleared (the child owns none of the parent's device
//! memory) and the agent thread marked not started (it does not exist there), so a child that
//! uses CUDA gets its own agent. The list of opened IPC events ([`crate::hazards`]) is held
//! and cleared the same way (taken after the table lock, the one order used), and so is the
//! state of the shareable-handle exports and imports ([`crate::shareable`], taken last).

use std::cell::RefCell;
use std::sync::MutexGuard;

use crate::guard::guard;
use crate::hazards::ForkHold;
use crate::table::{self, Table};

thread_local! {
    /// The table guard held by the forking thread between prepare and parent/child.
    static FORK_GUARD: RefCell<Option<MutexGuard<'static, Table>>> = const { RefCell::new(None) };
    /// The opened-event list, held likewise.
    static FORK_EVENTS: RefCell<Option<ForkHold>> = const { RefCell::new(None) };
    /// The shareable-handle state, held likewise.
    static FORK_SHARE: RefCell<Option<crate::shareable::ForkHold>> = const { RefCell::new(None) };
}

extern "C" fn prepare() {
    guard((), || {
        let g = table::lock();
        FORK_GUARD.with(|c| *c.borrow_mut() = Some(g));
        let e = ForkHold::take();
        FORK_EVENTS.with(|c| *c.borrow_mut() = Some(e));
        let s = crate::shareable::ForkHold::take();
        FORK_SHARE.with(|c| *c.borrow_mut() = Some(s));
    });
}

extern "C" fn parent() {
    guard((), || {
        FORK_SHARE.with(|c| c.borrow_mut().take());
        FORK_EVENTS.with(|c| c.borrow_mut().take());
        FORK_GUARD.with(|c| c.borrow_mut().take());
    });
}

extern "C" fn child() {
    guard((), || {
        if let Some(mut g) = FORK_GUARD.with(|c| c.borrow_mut().take()) {
            g.clear();
        }
        crate::server::forget_in_child();
        crate::hazards::forget_in_child(FORK_EVENTS.with(|c| c.borrow_mut().take()));
        crate::shareable::forget_in_child(FORK_SHARE.with(|c| c.borrow_mut().take()));
    });
}

/// Registers the handlers (once, at library load).
pub fn register() {
    // SAFETY: the three handlers are valid functions for the life of the process (this library
    // is never unloaded while the process uses it: LD_PRELOAD objects stay).
    let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
    if rc != 0 {
        crate::log::debug!("pthread_atfork failed: {rc}");
    }
}
