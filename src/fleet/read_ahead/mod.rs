//! Read-ahead on plaintext engine connections: the engine's response is read off its socket as
//! it arrives, whatever the client is doing, and the request's charge on its backend is
//! released once the response is complete rather than once the client has read it.
//!
//! Pingora reads the upstream response in step with the downstream writes: a client that stops
//! reading (an HTTP/2 stream held at a zero window, a full HTTP/1.1 socket) stops the upstream
//! reads too, so kvroute never sees the engine finish and keeps counting the request against
//! the backend's load bound (`limits.backend_max_inflight`) until the client drains or is cut.
//! A handful of such clients could hold every backend "full" while the engines idle. Here each
//! plaintext engine connection is a [`VirtualSocket`](pingora::protocols::l4::virt) whose own
//! task reads ahead into a buffer, up to `limits.upstream_read_ahead_bytes` a connection and
//! `limits.read_ahead_memory_bytes` in all (past either, reads wait for the client again), and
//! follows the response's framing ([`framing`]) to say when the engine is done. The proxy uses
//! it for HTTP/2 clients (and HTTP/1.1 ones with `limits.read_ahead_http1`): it costs each
//! request a virtual connection from the connector's own pool, a task wake and a copy per read.
//!
//! A response is followed once its request is *armed*: the proxy arms it (in
//! `connected_to_upstream`) and the connection it is then written to takes it, matched by the
//! task writing it, which is the request's own. TLS engines are not read ahead: their framing
//! is encrypted at this layer.

pub mod framing;
mod socket;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

pub use socket::ReadAhead;

/// What runs once an armed response is complete.
pub type OnComplete = Box<dyn FnOnce() + Send>;

/// What a request arms: the hook for its response's end, and the link through which it can
/// cut its connection.
pub(crate) struct Armed {
    on_complete: OnComplete,
    link: Arc<Link>,
}

/// The read-ahead connection an armed request was written to, once it is: the request can cut
/// it (the engine is found hung), which its reader sees as the engine closing it.
#[derive(Default)]
pub struct Link(Mutex<std::sync::Weak<socket::Shared>>);

impl Link {
    /// Cut the connection, if the request was written to one still open: `true` if it was.
    pub fn cut(&self) -> bool {
        let shared = self.0.lock().unwrap_or_else(|p| p.into_inner()).upgrade();
        shared.is_some_and(|s| s.abort())
    }

    fn attach(&self, shared: &Arc<socket::Shared>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Arc::downgrade(shared);
    }
}

/// Armed requests not yet written, by the task that will write them.
fn pending() -> &'static Mutex<HashMap<tokio::task::Id, Armed>> {
    static PENDING: OnceLock<Mutex<HashMap<tokio::task::Id, Armed>>> = OnceLock::new();
    PENDING.get_or_init(Default::default)
}

/// Follow the response to the request this task writes next: `on_complete` runs once the
/// engine has sent all of it, and `link` is attached to its connection. Replaces what this
/// task armed before.
pub fn arm(on_complete: OnComplete, link: Arc<Link>) {
    let Some(task) = tokio::task::try_id() else {
        return;
    };
    if let Ok(mut p) = pending().lock() {
        p.insert(task, Armed { on_complete, link });
    }
}

/// Forget what this task armed and never wrote (the request ended before reaching a
/// read-ahead connection, or reached a TLS one).
pub fn disarm() {
    if let (Some(task), Ok(mut p)) = (tokio::task::try_id(), pending().lock()) {
        p.remove(&task);
    }
}

/// What this task armed, taken by the connection its request is being written to.
pub(crate) fn take_armed() -> Option<Armed> {
    let task = tokio::task::try_id()?;
    pending().lock().ok()?.remove(&task)
}

/// Response bytes read ahead and not yet taken, on every connection.
static BUFFERED: AtomicUsize = AtomicUsize::new(0);

/// Response bytes read ahead and not yet taken, on every connection.
pub fn buffered() -> usize {
    BUFFERED.load(Ordering::Relaxed)
}

/// How far connections read ahead: per connection, and in all.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub per_connection: usize,
    pub total: usize,
    pub connect_timeout: Duration,
}

/// The connector for a fleet's plaintext engines, `None` when read-ahead is off.
pub fn connector(limits: Limits) -> Option<Arc<ReadAhead>> {
    (limits.per_connection > 0).then(|| Arc::new(ReadAhead::new(limits)))
}
