//! The OpenAI-compatible HTTP face of one simulated server (with OpenAI's Responses and
//! Anthropic's Messages APIs beside chat): its router and endpoints, admission (where the
//! fault knobs strike), answer bodies as JSON or SSE, `/metrics` text, the request log, and
//! P/D disaggregation's glue (`pd`). Every request enters here and is handed to the engine
//! or, in fixed-timing mode, answered on this side's own clock, so the engine never sees a
//! connection.

mod admin;
mod admission;
mod answer_body;
mod engine_answer;
pub(super) mod inference;
mod messages;
mod messages_answer;
mod metrics;
mod pd;
mod pd_bootstrap;
mod reqlog;
mod response;
mod response_store;
mod responses;
mod responses_answer;
pub(super) mod server;
mod sse;
mod state;
