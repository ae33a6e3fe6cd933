//! Anthropic Messages answers, shaped as Anthropic's API (and llama-server) gives them: the
//! message object and its stream of typed events. Usage has Anthropic's meaning:
//! `input_tokens` are the prompt tokens not read from the cache, so the whole prompt is
//! `input_tokens + cache_read_input_tokens + cache_creation_input_tokens` (the last always 0:
//! an engine's prefix cache needs no explicit cache writes).
//!
//! The output is always `max_tokens` long (the simulator ignores end of sequence), so the
//! stop reason is `max_tokens`, or `tool_use` when the answer is a forced tool call (one
//! `tool_use` block whose input streams as `input_json_delta`). `message_start` goes out with the first token, when the
//! cached tokens are known, so the stream's first byte comes at the time to first token.

use bytes::Bytes;
use serde_json::{json, Value};

use super::response::{Answer, Usage};
use crate::sim::text::tool_call::{ARGS_CLOSE, ARGS_OPEN};

const STOP_REASON: &str = "max_tokens";

fn usage_json(u: Usage, output_tokens: u64) -> Value {
    json!({
        "input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens),
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": output_tokens,
    })
}

fn object(a: &Answer, content: Value, stop: Value, usage: Value) -> Value {
    json!({
        "id": a.id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": a.model,
        "stop_reason": stop,
        "stop_sequence": null,
        "usage": usage,
    })
}

/// Why the answer stopped: its length, or the tool call it made.
fn stop_reason(a: &Answer) -> &'static str {
    if a.tool.is_some() {
        "tool_use"
    } else {
        STOP_REASON
    }
}

/// The whole answer.
pub fn message(a: &Answer, text: &str, usage: Usage) -> Value {
    let content = match &a.tool {
        Some(t) => json!([{"type": "tool_use", "id": t.call_id, "name": t.name,
                           "input": {"command": text}}]),
        None => json!([{"type": "text", "text": text}]),
    };
    object(
        a,
        content,
        json!(stop_reason(a)),
        usage_json(usage, usage.completion_tokens),
    )
}

fn event(kind: &str, body: &Value, out: &mut String) {
    out.push_str(&format!("event: {kind}\ndata: {body}\n\n"));
}

/// The events of the text `text` (one or more tokens); the first also opens the message, with
/// the prompt's usage in `start`.
pub fn token(a: &Answer, text: &str, first: bool, start: Usage) -> Bytes {
    let mut out = String::new();
    if first {
        let message = object(a, json!([]), Value::Null, usage_json(start, 0));
        event(
            "message_start",
            &json!({"type": "message_start", "message": message}),
            &mut out,
        );
        let opened = match &a.tool {
            Some(t) => json!({"type": "tool_use", "id": t.call_id, "name": t.name, "input": {}}),
            None => json!({"type": "text", "text": ""}),
        };
        let block = json!({"type": "content_block_start", "index": 0, "content_block": opened});
        event("content_block_start", &block, &mut out);
        // Anthropic's API sends one after the block opens (and more while a long answer
        // runs); clients must skip it.
        event("ping", &json!({"type": "ping"}), &mut out);
    }
    let delta = match (&a.tool, first) {
        (Some(_), true) => json_delta(&format!("{ARGS_OPEN}{text}")),
        (Some(_), false) => json_delta(text),
        (None, _) => json!({"type": "text_delta", "text": text}),
    };
    let delta = json!({"type": "content_block_delta", "index": 0, "delta": delta});
    event("content_block_delta", &delta, &mut out);
    Bytes::from(out)
}

fn json_delta(partial: &str) -> Value {
    json!({"type": "input_json_delta", "partial_json": partial})
}

/// The closing events, with the output tokens in `message_delta`.
pub fn finish(a: &Answer, usage: Usage) -> Bytes {
    let mut out = String::new();
    if a.tool.is_some() {
        let delta = json!({"type": "content_block_delta", "index": 0,
                           "delta": json_delta(ARGS_CLOSE)});
        event("content_block_delta", &delta, &mut out);
    }
    event(
        "content_block_stop",
        &json!({"type": "content_block_stop", "index": 0}),
        &mut out,
    );
    let delta = json!({"type": "message_delta",
                       "delta": {"stop_reason": stop_reason(a), "stop_sequence": null},
                       "usage": {"output_tokens": usage.completion_tokens}});
    event("message_delta", &delta, &mut out);
    event("message_stop", &json!({"type": "message_stop"}), &mut out);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::text::openai::Endpoint;

    const USAGE: Usage = Usage {
        prompt_tokens: 40,
        completion_tokens: 2,
        cached_tokens: 32,
    };

    #[test]
    fn message_shape_and_anthropic_usage() {
        let a = Answer::new(Endpoint::Messages, 1, 2, "m");
        let v = message(&a, " tok0 tok1", USAGE);
        assert!(v["id"].as_str().unwrap().starts_with("msg_"));
        assert_eq!(
            v,
            json!({"id": a.id, "type": "message", "role": "assistant",
                   "content": [{"type": "text", "text": " tok0 tok1"}], "model": "m",
                   "stop_reason": "max_tokens", "stop_sequence": null,
                   "usage": {"input_tokens": 8, "cache_read_input_tokens": 32,
                             "cache_creation_input_tokens": 0, "output_tokens": 2}})
        );
    }

    #[test]
    fn events_in_order() {
        let a = Answer::new(Endpoint::Messages, 1, 2, "m");
        let mut text = String::from_utf8(token(&a, " tok0", true, USAGE).to_vec()).unwrap();
        text.push_str(std::str::from_utf8(&token(&a, " tok1", false, USAGE)).unwrap());
        text.push_str(std::str::from_utf8(&finish(&a, USAGE)).unwrap());
        let events: Vec<(&str, Value)> = text
            .split_terminator("\n\n")
            .map(|e| {
                let (kind, data) = e.split_once('\n').unwrap();
                let data = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                (kind.strip_prefix("event: ").unwrap(), data)
            })
            .collect();
        let kinds: Vec<&str> = events.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            kinds,
            [
                "message_start",
                "content_block_start",
                "ping",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        for (kind, v) in &events {
            assert_eq!(v["type"], *kind);
        }
        let start = &events[0].1["message"];
        assert_eq!(start["content"], json!([]));
        assert!(start["stop_reason"].is_null());
        assert_eq!(start["usage"]["input_tokens"], 8);
        assert_eq!(start["usage"]["cache_read_input_tokens"], 32);
        assert_eq!(start["usage"]["output_tokens"], 0);
        assert_eq!(
            events[4].1["delta"],
            json!({"type": "text_delta", "text": " tok1"})
        );
        assert_eq!(events[6].1["delta"]["stop_reason"], "max_tokens");
        assert_eq!(events[6].1["usage"], json!({"output_tokens": 2}));
    }
}
