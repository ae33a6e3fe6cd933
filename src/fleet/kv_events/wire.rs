//! The engines' KV-event wire format: vLLM's `KVEventBatch` (vllm/distributed/kv_events.py),
//! which SGLang also publishes, as msgpack written by msgspec.
//!
//! Versions differ in how msgspec lays the structs out, so each level is read in either form:
//! - the batch: an array `[ts, events, data_parallel_rank?]` (`array_like=True`), or a map with
//!   those keys (vLLM releases whose `EventBatch` dropped `array_like`);
//! - an event: a tagged map `{"type": "BlockStored", field: value, ...}` (vLLM), or a tagged
//!   array `["BlockStored", field, ...]` in declaration order (SGLang);
//! - a block hash: an integer (older vLLM, SGLang) or bytes (vLLM's sha256 hashes), folded to
//!   a u64 here: the index only ever compares hashes for equality.
//!
//! A block's `extra_keys` (what vLLM hashes besides its tokens: the adapter's name, multimodal
//! inputs, the request's `cache_salt` on a prompt's first block) become one key per block
//! (`Event::Stored::keys`): the adapter is already the chain's root, a salt is the key a
//! salted request computes too, and anything else is opaque, so its blocks match no request's.
//! Fields past the ones routing uses are skipped, so a newer engine that appends fields still
//! decodes. Anything else is an error the subscriber counts and skips.

use rmpv::Value;

use crate::request::engine_tokens::{opaque_key, salt_key};

/// An engine's name for a block.
pub type EngineHash = u64;

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Blocks the engine now caches, in chain order. `token_ids` holds `block_size` tokens per
    /// block; `parent` is the block before the first (`None`: they start a prompt).
    Stored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        token_ids: Vec<u32>,
        block_size: usize,
        /// Blocks cached for a LoRA adapter (`lora_name`, else `lora_id`): their tokens mean
        /// something else than the base model's.
        lora: Option<String>,
        /// Where the blocks are: `None` or "GPU" for the engine's own KV cache.
        medium: Option<String>,
        /// Each block's extra key past the adapter (0: none), or empty when no block has one.
        keys: Vec<u64>,
        /// The KV cache group (hybrid models keep one per attention kind), and its kind
        /// (`kv_cache_spec_kind`: "full_attention", "sliding_window", ...).
        group: Option<u32>,
        kind: Option<String>,
    },
    Removed {
        hashes: Vec<EngineHash>,
        medium: Option<String>,
        group: Option<u32>,
    },
    Cleared,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<Event>,
    /// The data-parallel rank that published it (vLLM: one publisher per rank).
    pub dp_rank: Option<u32>,
}

/// Why a payload was skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct WireError(pub String);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn bad<T>(what: impl Into<String>) -> Result<T, WireError> {
    Err(WireError(what.into()))
}

/// Nesting a batch needs (batch, events, event, its lists, extra keys) with room for fields
/// a newer engine adds; anything much deeper is not a batch, and is refused before it costs.
const MAX_DEPTH: usize = 16;

/// Decode one published payload; any event that does not decode makes it an error (the
/// tests' strict reading; the follower reads with [`decode_events`]).
#[cfg(test)]
pub fn decode(payload: &[u8]) -> Result<Batch, WireError> {
    let (batch, mut undecodable) = decode_events(payload)?;
    match undecodable.is_empty() {
        true => Ok(batch),
        false => Err(undecodable.swap_remove(0)),
    }
}

/// Decode one published payload, keeping the events that decode: the batch, and why each
/// other event was not decoded. An error when the payload is not a batch at all.
pub fn decode_events(payload: &[u8]) -> Result<(Batch, Vec<WireError>), WireError> {
    let mut rd = payload;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| WireError(format!("not msgpack: {e}")))?;
    if !rd.is_empty() {
        return bad(format!("{} bytes after the batch", rd.len()));
    }
    let (ts, events, rank) = match &v {
        Value::Array(a) => (a.first(), a.get(1), a.get(2)),
        Value::Map(m) => (
            field(m, "ts"),
            field(m, "events"),
            field(m, "data_parallel_rank"),
        ),
        _ => return bad("a batch is an array or a map"),
    };
    let dp_rank = rank
        .and_then(Value::as_u64)
        .and_then(|r| u32::try_from(r).ok());
    let ts = ts.and_then(Value::as_f64).unwrap_or(0.0);
    let Some(Value::Array(list)) = events else {
        return bad("a batch has no event list");
    };
    let (mut events, mut undecodable) = (Vec::with_capacity(list.len()), Vec::new());
    for (i, e) in list.iter().enumerate() {
        match event(e) {
            Ok(e) => events.push(e),
            Err(WireError(w)) => undecodable.push(WireError(format!("event {i}: {w}"))),
        }
    }
    let batch = Batch {
        ts,
        events,
        dp_rank,
    };
    Ok((batch, undecodable))
}

fn field<'a>(map: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    map.iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// An event's fields by name, from either layout.
struct Fields<'a> {
    tag: &'a str,
    map: Option<&'a [(Value, Value)]>,
    /// The tagged array's values after the tag.
    list: &'a [Value],
}

impl<'a> Fields<'a> {
    /// `pos`: the field's place in the struct's declaration (the array layout).
    fn get(&self, name: &str, pos: usize) -> Option<&'a Value> {
        match self.map {
            Some(m) => field(m, name),
            None => self.list.get(pos),
        }
        .filter(|v| !v.is_nil())
    }
}

fn event(v: &Value) -> Result<Event, WireError> {
    let f = match v {
        Value::Map(m) => Fields {
            tag: field(m, "type").and_then(Value::as_str).unwrap_or(""),
            map: Some(m),
            list: &[],
        },
        Value::Array(a) => Fields {
            tag: a.first().and_then(Value::as_str).unwrap_or(""),
            map: None,
            list: a.get(1..).unwrap_or(&[]),
        },
        _ => return bad("an event is a map or an array"),
    };
    match f.tag {
        "BlockStored" => {
            let hashes = hashes(f.get("block_hashes", 0))?;
            let parent = f.get("parent_block_hash", 1).map(hash).transpose()?;
            let Some(Value::Array(ids)) = f.get("token_ids", 2) else {
                return bad("BlockStored without token_ids");
            };
            let token_ids = ids
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .map_or_else(|| bad("a token id is not a u32"), Ok)?;
            let block_size = f
                .get("block_size", 3)
                .and_then(Value::as_u64)
                .filter(|&b| (1..=1 << 16).contains(&b))
                .map_or_else(|| bad("BlockStored without a block_size"), Ok)?
                as usize;
            if token_ids.len() != hashes.len() * block_size {
                return bad(format!(
                    "{} token ids for {} blocks of {block_size}",
                    token_ids.len(),
                    hashes.len()
                ));
            }
            let (name, id) = (f.get("lora_name", 6), f.get("lora_id", 4));
            let lora = match (name, id) {
                (Some(name), _) => name.as_str().map(str::to_owned),
                (None, Some(id)) => id.as_i64().map(|i| format!("lora-id-{i}")),
                _ => None,
            };
            let keys = match f.get("extra_keys", 7) {
                None => Vec::new(),
                Some(Value::Array(per_block)) if per_block.len() == hashes.len() => per_block
                    .iter()
                    .enumerate()
                    .map(|(i, k)| block_key(k, name.or(id), i == 0 && parent.is_none()))
                    .collect(),
                Some(_) => return bad("extra_keys is not one entry per block"),
            };
            Ok(Event::Stored {
                hashes,
                parent,
                token_ids,
                block_size,
                lora,
                medium: text(f.get("medium", 5)),
                keys,
                group: index(f.get("group_idx", 8)),
                kind: text(f.get("kv_cache_spec_kind", 9)),
            })
        }
        "BlockRemoved" => Ok(Event::Removed {
            hashes: hashes(f.get("block_hashes", 0))?,
            medium: text(f.get("medium", 1)),
            group: index(f.get("group_idx", 2)),
        }),
        "AllBlocksCleared" => Ok(Event::Cleared),
        "" => bad("an event without a type tag"),
        other => bad(format!("unknown event type {other:?}")),
    }
}

fn text(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
}

fn index(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64)
        .and_then(|i| u32::try_from(i).ok())
}

/// One block's extra keys as one key (0: none). vLLM writes a tuple: the adapter's name (or
/// older, its id) first when there is one, then multimodal identifiers, then the request's
/// `cache_salt` on a prompt's first block (`first`), then prompt-embedding hashes.
fn block_key(v: &Value, lora: Option<&Value>, first: bool) -> u64 {
    let items: &[Value] = match v {
        Value::Nil => return 0,
        Value::Array(a) => a,
        other => std::slice::from_ref(other),
    };
    let rest = match (items.split_first(), lora) {
        (Some((head, rest)), Some(l)) if head == l => rest,
        _ => items,
    };
    match rest {
        [] => 0,
        [Value::String(salt)] if first && salt.as_str().is_some() => {
            salt.as_str().map_or(0, salt_key)
        }
        _ => {
            let mut bytes = Vec::new();
            for k in rest {
                // Writing to a Vec cannot fail; a key that somehow did not encode still
                // leaves the block opaque, which is what matters.
                let _ = rmpv::encode::write_value(&mut bytes, k);
            }
            opaque_key(&bytes)
        }
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<EngineHash>, WireError> {
    match v {
        Some(Value::Array(a)) => a.iter().map(hash).collect(),
        _ => bad("no block_hashes list"),
    }
}

fn hash(v: &Value) -> Result<EngineHash, WireError> {
    match v {
        // Signed or unsigned 64-bit: the bits name the block either way.
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|s| s as u64))
            .map_or_else(|| bad("a block hash out of range"), Ok),
        Value::Binary(b) => Ok(xxhash_rust::xxh3::xxh3_64(b)),
        _ => bad("a block hash is an integer or bytes"),
    }
}

/// Whether an event is about the engine's own (GPU) KV cache, the one a request reuses:
/// blocks offloaded to CPU or disk are reloaded at a cost the index does not model.
pub fn on_gpu(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("gpu"))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).expect("writing to a Vec cannot fail");
        out
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    fn ints(xs: &[u64]) -> Value {
        Value::Array(xs.iter().map(|&x| Value::from(x)).collect())
    }

    /// vLLM's layout: array batch, tagged-map events.
    pub(crate) fn vllm_batch(events: Vec<Value>) -> Vec<u8> {
        encode(&Value::Array(vec![
            Value::F64(1.5),
            Value::Array(events),
            Value::from(0),
        ]))
    }

    pub(crate) fn stored_map(hashes: &[u64], parent: Option<u64>, tokens: &[u64]) -> Value {
        Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), ints(hashes)),
            (
                s("parent_block_hash"),
                parent.map_or(Value::Nil, Value::from),
            ),
            (s("token_ids"), ints(tokens)),
            (
                s("block_size"),
                Value::from(tokens.len() / hashes.len().max(1)),
            ),
            (s("lora_id"), Value::Nil),
            (s("medium"), s("GPU")),
            (s("lora_name"), Value::Nil),
        ])
    }

    pub(crate) fn removed_map(hashes: &[u64]) -> Value {
        Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), ints(hashes)),
            (s("medium"), s("GPU")),
        ])
    }

    #[test]
    fn vllm_tagged_maps() {
        let tokens: Vec<u64> = (0..32).collect();
        let b = decode(&vllm_batch(vec![
            stored_map(&[7, 8], Some(6), &tokens),
            removed_map(&[7]),
            Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
        ]))
        .expect("decodes");
        assert_eq!(b.ts, 1.5);
        assert_eq!(
            b.events,
            vec![
                Event::Stored {
                    hashes: vec![7, 8],
                    parent: Some(6),
                    token_ids: (0..32).collect(),
                    block_size: 16,
                    lora: None,
                    medium: Some("GPU".into()),
                    keys: vec![],
                    group: None,
                    kind: None,
                },
                Event::Removed {
                    hashes: vec![7],
                    medium: Some("GPU".into()),
                    group: None,
                },
                Event::Cleared,
            ]
        );
    }

    #[test]
    fn sglang_tagged_arrays_map_batches_and_byte_hashes() {
        let stored = Value::Array(vec![
            s("BlockStored"),
            ints(&[1]),
            Value::Nil,
            ints(&[5; 4]),
            Value::from(4),
            Value::from(3),
            Value::Nil,
        ]);
        let removed = Value::Array(vec![
            s("BlockRemoved"),
            Value::Array(vec![Value::Binary(vec![9; 32])]),
        ]);
        let batch = Value::Map(vec![
            (s("ts"), Value::F64(2.0)),
            (s("events"), Value::Array(vec![stored, removed])),
        ]);
        let b = decode(&encode(&batch)).expect("decodes");
        assert_eq!(
            b.events[0],
            Event::Stored {
                hashes: vec![1],
                parent: None,
                token_ids: vec![5; 4],
                block_size: 4,
                lora: Some("lora-id-3".into()),
                medium: None,
                keys: vec![],
                group: None,
                kind: None,
            }
        );
        assert_eq!(
            b.events[1],
            Event::Removed {
                hashes: vec![xxhash_rust::xxh3::xxh3_64(&[9; 32])],
                medium: None,
                group: None,
            }
        );
        // A negative (signed) hash keeps its bits.
        let neg = vllm_batch(vec![removed_map(&[]), {
            Value::Map(vec![
                (s("type"), s("BlockRemoved")),
                (s("block_hashes"), Value::Array(vec![Value::from(-2i64)])),
            ])
        }]);
        let b = decode(&neg).expect("decodes");
        assert_eq!(
            b.events[1],
            Event::Removed {
                hashes: vec![(-2i64) as u64],
                medium: None,
                group: None,
            }
        );
    }

    /// vLLM's newest `BlockStored`: extra keys per block, a KV cache group and its kind.
    #[test]
    fn extra_keys_become_one_key_per_block() {
        let tokens: Vec<u64> = (0..48).collect();
        let with = |extra: Value, lora: Value, parent: Option<u64>| {
            let mut m = stored_map(&[1, 2, 3], parent, &tokens);
            if let Value::Map(f) = &mut m {
                f[7].1 = lora;
                f.push((s("extra_keys"), extra));
                f.push((s("group_idx"), Value::from(1)));
                f.push((s("kv_cache_spec_kind"), s("sliding_window")));
            }
            let b = decode(&vllm_batch(vec![m])).expect("decodes");
            assert_eq!(b.dp_rank, Some(0));
            match &b.events[0] {
                Event::Stored {
                    keys, group, kind, ..
                } => {
                    assert_eq!((*group, kind.as_deref()), (Some(1), Some("sliding_window")));
                    keys.clone()
                }
                other => panic!("not a store: {other:?}"),
            }
        };
        let tuple = |xs: Vec<Value>| Value::Array(xs);
        // A salted prompt: its first block carries the salt, under the adapter's name.
        let salted = tuple(vec![
            tuple(vec![s("ad"), s("tenant-a")]),
            tuple(vec![s("ad")]),
            Value::Nil,
        ]);
        assert_eq!(
            with(salted, s("ad"), None),
            vec![salt_key("tenant-a"), 0, 0]
        );
        // The same string past a prompt's first block is no salt: a multimodal hash.
        let later = tuple(vec![Value::Nil, tuple(vec![s("tenant-a")]), Value::Nil]);
        let keys = with(later, Value::Nil, Some(9));
        assert_eq!(keys[0], 0);
        assert!(keys[1] != 0 && keys[1] != salt_key("tenant-a"));
        // An image's (identifier, offset) at a prompt's start is opaque, salt or not.
        let image = tuple(vec![
            tuple(vec![tuple(vec![s("img"), Value::from(3)])]),
            Value::Nil,
            Value::Nil,
        ]);
        let keys = with(image, Value::Nil, None);
        assert!(keys[0] != 0 && keys[1..] == [0, 0]);
        // No keys at all: none to fold in.
        assert_eq!(with(Value::Nil, Value::Nil, None), Vec::<u64>::new());
        // A list that is not one entry per block is refused.
        let short = {
            let mut m = stored_map(&[1, 2, 3], None, &tokens);
            if let Value::Map(f) = &mut m {
                f.push((s("extra_keys"), tuple(vec![Value::Nil])));
            }
            vllm_batch(vec![m])
        };
        assert!(decode(&short).is_err());
    }

    #[test]
    fn malformed_payloads_are_errors_not_panics() {
        let tokens: Vec<u64> = (0..15).collect();
        let cases: Vec<Vec<u8>> = vec![
            vec![],
            vec![0xc1],
            b"not msgpack at all".to_vec(),
            encode(&Value::from(3)),
            encode(&Value::Array(vec![Value::F64(1.0)])),
            vllm_batch(vec![Value::from(1)]),
            vllm_batch(vec![Value::Map(vec![(s("type"), s("Nope"))])]),
            vllm_batch(vec![Value::Map(vec![])]),
            // 15 token ids for one block of 15 is fine; claiming 16 is not.
            vllm_batch(vec![{
                let mut m = stored_map(&[1], None, &tokens);
                if let Value::Map(f) = &mut m {
                    f[4].1 = Value::from(16);
                }
                m
            }]),
            vllm_batch(vec![stored_map(&[1], None, &[u64::MAX; 1])]),
            {
                let mut p = vllm_batch(vec![]);
                p.push(0);
                p
            },
            // Nested deeper than any batch.
            encode(&(0..40).fold(Value::Nil, |v, _| Value::Array(vec![v]))),
        ];
        for (i, p) in cases.iter().enumerate() {
            assert!(decode(p).is_err(), "case {i} decoded");
        }
        let ok = vllm_batch(vec![stored_map(&[1], None, &tokens)]);
        assert!(decode(&ok).is_ok());
    }

    #[test]
    fn a_bad_event_leaves_the_others() {
        let tokens: Vec<u64> = (0..16).collect();
        let p = vllm_batch(vec![
            stored_map(&[1], None, &tokens),
            Value::Map(vec![(s("type"), s("BlockMangled"))]),
            stored_map(&[2], Some(1), &tokens),
        ]);
        let (batch, bad) = decode_events(&p).expect("a batch");
        assert_eq!(batch.events.len(), 2);
        assert_eq!(bad.len(), 1);
        assert!(
            bad[0].0.starts_with("event 1: unknown event type"),
            "{:?}",
            bad[0]
        );
        assert!(decode(&p).is_err());
        assert!(decode_events(b"not msgpack").is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = decode(&bytes);
        }
    }
}
