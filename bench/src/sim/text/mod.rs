//! What the simulated model reads and writes: OpenAI request bodies (and the Responses and
//! Anthropic Messages bodies, converted to chat) reduced to a canonical prompt, that prompt's
//! tokens (stand-in or a real tokenizer), and the deterministic filler reply with its timing
//! and block hashes. Both answer modes and the tests share these, so a
//! replay can predict every token and cached block exactly.

pub(super) mod anthropic;
mod filler;
pub(super) mod generate;
pub(super) mod ids;
pub(super) mod openai;
pub(super) mod prompt;
pub(super) mod responses;
pub(super) mod thread;
pub(super) mod tokenizer;
pub(super) mod tool_call;
