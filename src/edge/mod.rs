//! The client side of the proxy: the listeners (connection cap, TLS, HTTP/1.1 and HTTP/2,
//! header deadlines, rapid-reset defence), access
//! control, the router queue, the retry budget and the draining flag. Nothing here knows how a
//! request is placed.

pub(crate) mod access;
pub(crate) mod body_budget;
mod conn;
mod fair_share;
mod h1;
mod h2;
mod listener;
mod queue;
pub(crate) mod retry_budget;
mod signals;
mod state;
pub mod tls;

pub use access::{digest, Caller};
pub use listener::{Listener, Transport};
pub use queue::{Shed, Who};
pub use state::EdgeState;
