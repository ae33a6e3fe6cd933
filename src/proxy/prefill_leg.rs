//! The handle of an SGLang prefill leg running beside its decode leg (`bootstrap_leg`): what
//! the request's context keeps of it, and what the leg's task and the decode leg share.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::fleet::in_flight::Cutter;

/// What `cached` holds until the prefill server says.
pub(super) const UNKNOWN: u64 = u64::MAX;

/// The running prefill leg of the current attempt. Dropped (the attempt failed, was replaced,
/// or the request ended), it is aborted.
pub(super) struct PrefillLeg {
    pub(super) shared: Arc<Shared>,
    pub(super) task: tokio::task::JoinHandle<()>,
    /// The prefill server.
    pub server: usize,
}

#[derive(Default)]
pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    /// The prompt tokens the prefill server found cached (`UNKNOWN` until it says).
    pub(super) cached: AtomicU64,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) failed: bool,
    /// Cuts the decode leg's connection, once it is made.
    pub(super) decode: Option<Cutter>,
}

impl Shared {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for PrefillLeg {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PrefillLeg {
    /// The prefill leg failed: the decode leg waits for nothing.
    pub fn failed(&self) -> bool {
        self.shared.lock().failed
    }

    /// The prompt tokens the prefill server found cached, once it answered with them.
    pub fn cached(&self) -> Option<u64> {
        Some(self.shared.cached.load(Ordering::Relaxed)).filter(|&c| c != UNKNOWN)
    }

    /// The decode leg's connection is made: cut it now if the prefill leg already failed,
    /// else when it does.
    pub fn arm(&self, decode: Cutter) {
        let mut s = self.shared.lock();
        if s.failed {
            decode.cut();
        } else {
            s.decode = Some(decode);
        }
    }
}
