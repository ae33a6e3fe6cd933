//! The OpenAI-compatible HTTP face of one simulated server: its router and endpoints,
//! admission (where the fault knobs strike), answer bodies as JSON or SSE, `/metrics` text and
//! the request log. Every request enters here and is handed to the engine or, in fixed-timing
//! mode, answered on this side's own clock, so the engine never sees a connection.

mod admin;
mod admission;
mod engine_answer;
pub(super) mod inference;
mod metrics;
mod reqlog;
mod response;
pub(super) mod server;
mod sse;
mod state;
