//! vLLM's KV cache events (`vllm/distributed/kv_events.py`), made from the engine's pool and
//! encoded as vLLM's `ZmqEventPublisher` sends them; `kvpublish` puts them on the wire.
//!
//! # Payload
//! One msgpack `KVEventBatch` per engine step that changed the pool, laid out as msgspec lays
//! out vLLM's structs: the batch is array-like, `[ts, events, data_parallel_rank]` (`ts` a
//! float64 of Unix seconds, the rank always 0); each event is a tagged map, its class name
//! under `"type"` and then its fields in declaration order:
//! - `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size":
//!   16, "lora_id": nil, "medium": "GPU", "lora_name": nil}`, and for the first block of a
//!   request with a `cache_salt`, `"extra_keys": [[salt], nil, ...]` (one entry per block, as
//!   vLLM salts a prompt's first block; omitted when no block has a key, as msgspec omits a
//!   default);
//! - `{"type": "BlockRemoved", "block_hashes", "medium": "GPU"}`.
//!
//! vLLM's own `AllBlocksCleared` is never sent: the simulated pool is never cleared.
//!
//! # Names, parents and token ids
//! `block_hashes` are the simulator's own chained block hashes (`kvcache::block_hashes`), the
//! names its pool keys blocks by, in chain order; `parent_block_hash` is the hash of the block
//! before the event's first block, nil when that block starts the stream. `token_ids` are the
//! 16 token ids of each block, concatenated: the token stream is 4 bytes a token
//! (`tokenizer`), and each 4-byte chunk read as a little-endian u32 is the id. With
//! `--tokenizer` (or a completions prompt of token ids) that is the real id; with the
//! stand-in tokenizer it is 4 bytes of prompt text read the same way, which is deterministic
//! and, with the parent, enough to recompute every hash:
//! `hash = xxh3_64_with_seed(ids as LE bytes, parent or the salt's seed or 0)`.
//!
//! # What is sent, in what order
//! The pool records every change to its set of named blocks as it happens (`PoolChange`), and
//! those are the events, in that order: a block gets its `BlockStored` when it first gets its
//! name (prompt blocks as their prefill step fills them, reply blocks when the request
//! finishes; never for a cached block another request reuses, nor for a duplicate that stays
//! anonymous), and its `BlockRemoved` when, unreferenced, it is evicted. So a consumer that
//! applies the batches in sequence holds exactly the pool's named blocks. Consecutive changes
//! of one kind share an event when they can: stored blocks that continue each other's chain,
//! and removals.

use rmpv::Value;

use crate::sim::engine::kvcache::BLOCK_BYTES;
use crate::sim::engine::kvpool::{KvPool, PoolChange};
use crate::sim::engine::profile::BLOCK_TOKENS;

const MEDIUM: &str = "GPU";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        /// The request's `cache_salt`, when the first block starts a salted prompt.
        salt: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
    },
}

/// One request's chain of block names (prompt, then the reply as the client sends it back)
/// and the token stream that covers them.
pub struct Chain<'a> {
    pub prompt: &'a [u64],
    pub reply: &'a [u64],
    pub tokens: &'a [u8],
    pub salt: Option<&'a str>,
}

impl Chain<'_> {
    fn hash(&self, j: usize) -> Option<u64> {
        match j.checked_sub(self.prompt.len()) {
            None => self.prompt.get(j).copied(),
            Some(k) => self.reply.get(k).copied(),
        }
    }

    /// Where `h` is at or after `*from`; moves `*from` past it.
    fn find(&self, h: u64, from: &mut usize) -> Option<usize> {
        let len = self.prompt.len() + self.reply.len();
        let j = (*from..len).find(|&j| self.hash(j) == Some(h))?;
        *from = j + 1;
        Some(j)
    }

    fn block_tokens(&self, j: usize) -> impl Iterator<Item = u32> + '_ {
        let block = self
            .tokens
            .get(j * BLOCK_BYTES..(j + 1) * BLOCK_BYTES)
            .unwrap_or_default();
        block
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
    }
}

/// The events of one engine step, built as the pool changes.
#[derive(Debug, Default)]
pub struct EventLog {
    events: Vec<KvEvent>,
}

impl EventLog {
    /// Turns the pool's changes since the last call into events. Blocks named in them belong
    /// to `chain`, at or after its block `from`, in chain order (the scheduler names one
    /// request's blocks at a time, front to back); evictions need no chain.
    pub fn absorb(&mut self, pool: &mut KvPool, chain: Option<(&Chain<'_>, usize)>) {
        let mut at = chain.map_or(0, |(_, from)| from);
        for change in pool.take_changes() {
            match change {
                PoolChange::Evicted(h) => self.removed(h),
                PoolChange::Named(h) => {
                    match chain.and_then(|(c, _)| Some((c, c.find(h, &mut at)?))) {
                        Some((c, j)) => {
                            let parent = j.checked_sub(1).and_then(|p| c.hash(p));
                            let salt = c.salt.filter(|_| j == 0);
                            self.stored(h, parent, salt, c.block_tokens(j));
                        }
                        None => {
                            // A bug, not an input: still announce the name, so that the set
                            // a consumer holds stays the pool's.
                            log::error!("kv events: block {h:016x} named outside its chain");
                            self.stored(h, None, None, std::iter::empty());
                        }
                    }
                }
            }
        }
    }

    pub fn take(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Block `h`, which continues the previous event when `parent` is that event's last.
    fn stored(
        &mut self,
        h: u64,
        parent: Option<u64>,
        salt: Option<&str>,
        tokens: impl Iterator<Item = u32>,
    ) {
        if let Some(KvEvent::BlockStored {
            block_hashes,
            token_ids,
            ..
        }) = self.events.last_mut()
        {
            if parent.is_some() && block_hashes.last().copied() == parent {
                block_hashes.push(h);
                token_ids.extend(tokens);
                return;
            }
        }
        self.events.push(KvEvent::BlockStored {
            block_hashes: vec![h],
            parent_block_hash: parent,
            token_ids: tokens.collect(),
            salt: salt.map(str::to_owned),
        });
    }

    fn removed(&mut self, h: u64) {
        if let Some(KvEvent::BlockRemoved { block_hashes }) = self.events.last_mut() {
            block_hashes.push(h);
        } else {
            self.events.push(KvEvent::BlockRemoved {
                block_hashes: vec![h],
            });
        }
    }
}

/// The msgpack payload of one batch (see the module comment).
pub fn encode_batch(ts: f64, events: &[KvEvent]) -> Result<Vec<u8>, String> {
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(event_value).collect()),
        Value::from(0u8),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).map_err(|e| format!("msgpack: {e}"))?;
    Ok(out)
}

fn event_value(e: &KvEvent) -> Value {
    let hashes = |h: &[u64]| Value::Array(h.iter().map(|&h| Value::from(h)).collect());
    let field = |k: &str, v: Value| (Value::from(k), v);
    match e {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            salt,
        } => Value::Map(
            [
                field("type", Value::from("BlockStored")),
                field("block_hashes", hashes(block_hashes)),
                field(
                    "parent_block_hash",
                    parent_block_hash.map_or(Value::Nil, Value::from),
                ),
                field(
                    "token_ids",
                    Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                ),
                field("block_size", Value::from(BLOCK_TOKENS)),
                field("lora_id", Value::Nil),
                field("medium", Value::from(MEDIUM)),
                field("lora_name", Value::Nil),
            ]
            .into_iter()
            .chain(salt.as_ref().map(|s| {
                let first = Value::Array(vec![Value::from(s.as_str())]);
                let rest = (1..block_hashes.len()).map(|_| Value::Nil);
                field(
                    "extra_keys",
                    Value::Array(std::iter::once(first).chain(rest).collect()),
                )
            }))
            .collect(),
        ),
        KvEvent::BlockRemoved { block_hashes } => Value::Map(vec![
            field("type", Value::from("BlockRemoved")),
            field("block_hashes", hashes(block_hashes)),
            field("medium", Value::from(MEDIUM)),
        ]),
    }
}

/// Reads a payload back, checking every detail of the layout (field order, constants).
#[cfg(test)]
pub fn decode_batch(payload: &[u8]) -> Result<(f64, Vec<KvEvent>), String> {
    let value = rmpv::decode::read_value(&mut &payload[..]).map_err(|e| e.to_string())?;
    let Value::Array(items) = value else {
        return Err(format!("batch is not an array: {value}"));
    };
    let [Value::F64(ts), Value::Array(events), rank] = items.as_slice() else {
        return Err(format!("batch is not [f64, events, rank]: {items:?}"));
    };
    if rank.as_u64() != Some(0) {
        return Err(format!("data_parallel_rank {rank}"));
    }
    let events = events.iter().map(decode_event).collect::<Result<_, _>>()?;
    Ok((*ts, events))
}

#[cfg(test)]
fn decode_event(v: &Value) -> Result<KvEvent, String> {
    let Value::Map(fields) = v else {
        return Err(format!("event is not a map: {v}"));
    };
    let keys: Vec<&str> = fields.iter().filter_map(|(k, _)| k.as_str()).collect();
    let get = |k: &str| {
        fields
            .iter()
            .find(|(key, _)| key.as_str() == Some(k))
            .map(|f| &f.1)
    };
    let u64s = |k: &str| -> Result<Vec<u64>, String> {
        get(k)
            .and_then(Value::as_array)
            .ok_or(format!("{k} is not an array"))?
            .iter()
            .map(|h| h.as_u64().ok_or(format!("{k}: {h} is not a u64")))
            .collect()
    };
    if get("medium").and_then(Value::as_str) != Some(MEDIUM) {
        return Err(format!("medium is not {MEDIUM}: {v}"));
    }
    match get("type").and_then(Value::as_str) {
        Some("BlockStored") => {
            let want = [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
            ];
            let constants = get("block_size").and_then(Value::as_u64) == Some(BLOCK_TOKENS)
                && get("lora_id").is_some_and(Value::is_nil)
                && get("lora_name").is_some_and(Value::is_nil);
            // extra_keys only when a block has one: the salt, on the first block alone.
            let salt = match get("extra_keys") {
                None => None,
                Some(Value::Array(per_block)) => match per_block.split_first() {
                    Some((Value::Array(first), rest))
                        if first.len() == 1 && rest.iter().all(Value::is_nil) =>
                    {
                        first[0].as_str().map(str::to_owned)
                    }
                    _ => return Err(format!("extra_keys other than a salt: {v}")),
                },
                Some(other) => return Err(format!("extra_keys {other}")),
            };
            let n = if salt.is_some() { 9 } else { 8 };
            if keys != want[..n] || !constants {
                return Err(format!("not vLLM's BlockStored: {v}"));
            }
            let parent = get("parent_block_hash").ok_or("no parent_block_hash")?;
            let token_ids = u64s("token_ids")?;
            Ok(KvEvent::BlockStored {
                block_hashes: u64s("block_hashes")?,
                parent_block_hash: if parent.is_nil() {
                    None
                } else {
                    Some(parent.as_u64().ok_or(format!("parent {parent}"))?)
                },
                token_ids: token_ids
                    .into_iter()
                    .map(|t| u32::try_from(t).map_err(|e| e.to_string()))
                    .collect::<Result<_, _>>()?,
                salt,
            })
        }
        Some("BlockRemoved") if keys == ["type", "block_hashes", "medium"] => {
            Ok(KvEvent::BlockRemoved {
                block_hashes: u64s("block_hashes")?,
            })
        }
        _ => Err(format!("unknown event {v}")),
    }
}

#[cfg(test)]
#[path = "kvevents_tests.rs"]
mod tests;
