//! The client side of the proxy: the listener (connection cap, header deadline), access
//! control, the router queue, the retry budget and the draining flag. Nothing here knows how a
//! request is placed.

pub(crate) mod access;
mod headers;
mod listener;
mod queue;
pub(crate) mod retry_budget;
mod state;

pub use access::{digest, Caller};
pub use listener::Listener;
pub use state::EdgeState;
