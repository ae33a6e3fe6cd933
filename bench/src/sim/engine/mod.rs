//! The simulated engine, after vLLM v1: the step loop (`task`), its scheduler, the KV block
//! pool and its events, the GPU profiles that time each step, LoRA slots and the counters it
//! publishes. Nothing here speaks HTTP or OpenAI's shapes, so the engine's physics can be
//! tested in model time alone.

pub(super) mod cores;
pub(super) mod kv_events;
pub(super) mod kvcache;
mod kvpool;
pub(super) mod lora;
pub(super) mod profile;
pub(super) mod scheduler;
pub(super) mod stats;
pub(super) mod task;
