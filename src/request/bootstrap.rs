//! The fields of SGLang's bootstrap prefill/decode protocol, as its routers write them (sgl-router
//! `routers/http/pd_router.rs` and `bootstrap_injector.rs`, mini_lb.py
//! `_generate_bootstrap_room`): both legs get the client's body unchanged but for
//! `bootstrap_host` (the prefill server's host), `bootstrap_port` (its bootstrap server) and
//! `bootstrap_room`, a random id in `[0, 2^63 - 1]` the decode server fetches the KV under. A
//! batch (chat `n` > 1, a completions `prompt` list) gets one of each per item, rooms distinct.

use serde_json::{Map, Value};

/// Where a split request's KV waits: the prefill server's bootstrap server and the room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    pub host: String,
    pub port: u16,
    pub room: u64,
}

impl Bootstrap {
    /// A fresh room from `seed` (unique per request and process): 63 bits, as SGLang's
    /// routers draw them, so that an int64 on the engine's side holds it.
    pub fn room(seed: &[u8]) -> u64 {
        xxhash_rust::xxh3::xxh3_64(seed) & (i64::MAX as u64)
    }
}

/// The items the engine serves the body as: chat's `n`, a completions prompt list's length.
fn batch(fields: &Map<String, Value>) -> Option<usize> {
    if let Some(list) = fields.get("prompt").and_then(Value::as_array) {
        // A list of token ids is one prompt; a list of strings or of id lists is a batch.
        let is_batch = list.first().is_some_and(|v| v.is_string() || v.is_array());
        return is_batch.then_some(list.len());
    }
    fields
        .get("n")
        .and_then(Value::as_u64)
        .filter(|&n| n > 1)
        .map(|n| n as usize)
}

/// Set the bootstrap fields of `b` in the body's `fields`, or remove a client's own (`None`):
/// they would make a decode server fetch KV from wherever the client names.
pub fn set(fields: &mut Map<String, Value>, b: Option<&Bootstrap>) {
    let Some(b) = b else {
        for k in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
            fields.remove(k);
        }
        return;
    };
    let (host, port, room) = match batch(fields) {
        Some(n) => (
            Value::from(vec![b.host.clone(); n]),
            Value::from(vec![b.port; n]),
            Value::from(
                (0..n as u64)
                    .map(|i| Bootstrap::room(&(b.room ^ i.rotate_left(32)).to_le_bytes()))
                    .collect::<Vec<_>>(),
            ),
        ),
        None => (
            Value::from(b.host.clone()),
            Value::from(b.port),
            Value::from(b.room),
        ),
    };
    fields.insert("bootstrap_host".into(), host);
    fields.insert("bootstrap_port".into(), port);
    fields.insert("bootstrap_room".into(), room);
}

/// The prompt tokens a prefill server found cached, from its answer: a JSON body's
/// `usage.prompt_tokens_details.cached_tokens`, or a stream's last usage chunk (both legs get
/// the client's body, so a streamed request's prefill leg streams too).
pub fn answer_cached(body: &[u8]) -> Option<u64> {
    const AT: &str = "/usage/prompt_tokens_details/cached_tokens";
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        return v.pointer(AT).and_then(Value::as_u64);
    }
    let text = std::str::from_utf8(body).ok()?;
    text.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .find_map(|v| v.pointer(AT).and_then(Value::as_u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: Value) -> Map<String, Value> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn one_request_gets_one_room_and_a_batch_one_per_item() {
        let b = Bootstrap {
            host: "127.0.0.1".into(),
            port: 8998,
            room: Bootstrap::room(b"7"),
        };
        assert!(b.room <= i64::MAX as u64);
        let mut one = fields(json!({"model": "m", "messages": [], "n": 1}));
        set(&mut one, Some(&b));
        assert_eq!(
            (
                &one["bootstrap_host"],
                &one["bootstrap_port"],
                &one["bootstrap_room"]
            ),
            (&json!("127.0.0.1"), &json!(8998), &json!(b.room))
        );
        let mut chat = fields(json!({"model": "m", "messages": [], "n": 3}));
        set(&mut chat, Some(&b));
        assert_eq!(
            chat["bootstrap_host"],
            json!(["127.0.0.1", "127.0.0.1", "127.0.0.1"])
        );
        assert_eq!(chat["bootstrap_port"], json!([8998, 8998, 8998]));
        let rooms: std::collections::HashSet<u64> = chat["bootstrap_room"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_u64().unwrap())
            .collect();
        assert_eq!(rooms.len(), 3);
        assert!(rooms.iter().all(|&r| r <= i64::MAX as u64));
        let mut prompts = fields(json!({"model": "m", "prompt": ["a", "b"]}));
        set(&mut prompts, Some(&b));
        assert_eq!(prompts["bootstrap_room"].as_array().unwrap().len(), 2);
        // Token ids are one prompt.
        let mut ids = fields(json!({"model": "m", "prompt": [1, 2, 3]}));
        set(&mut ids, Some(&b));
        assert_eq!(ids["bootstrap_room"], json!(b.room));
    }

    #[test]
    fn the_prefill_servers_hit_is_read_from_json_or_a_stream() {
        let json =
            br#"{"usage":{"prompt_tokens":90,"prompt_tokens_details":{"cached_tokens":64}}}"#;
        assert_eq!(answer_cached(json), Some(64));
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
                   data: {\"choices\":[],\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n\
                   data: [DONE]\n\n";
        assert_eq!(answer_cached(sse.as_bytes()), Some(32));
        assert_eq!(answer_cached(br#"{"usage":{"prompt_tokens":3}}"#), None);
        assert_eq!(answer_cached(b"\xff"), None);
    }

    #[test]
    fn a_clients_own_fields_never_pass() {
        let mut f = fields(json!({"bootstrap_host": "10.9.9.9", "bootstrap_port": 1,
            "bootstrap_room": 5, "model": "m"}));
        set(&mut f, None);
        assert_eq!(f.keys().collect::<Vec<_>>(), vec!["model"]);
    }
}
