//! Anthropic's Messages stream, continued: what its events say the client has, the request
//! that goes on from there, and the continuation's events made to read as the same message.
//!
//! The stream is `message_start`, then one content block per text, tool use or thinking
//! (`content_block_start`, `content_block_delta`s, `content_block_stop`), then `message_delta`
//! (the stop reason and output usage) and `message_stop`. A message continues as the API
//! itself continues one: the text so far as a final assistant message, which the model goes on
//! from (Anthropic's "prefill"; vLLM, SGLang and llama-server render it unclosed). Only a
//! message whose one block is text is continued: a tool use may stop mid-JSON, and thinking
//! cannot be resumed from outside.

use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::borrow::Cow;

use super::{Seen, Unfit, MAX_TEXT_BYTES};

#[derive(Deserialize)]
struct Event<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    message: Option<Head<'a>>,
    #[serde(default)]
    index: u32,
    #[serde(borrow, default)]
    content_block: Option<Block<'a>>,
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Deserialize)]
struct Head<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Block<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Cow<'a, str>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    stop_reason: Option<Cow<'a, str>>,
}

/// What a block of this type does to a continuation.
fn unfit_block(kind: &str) -> Option<Unfit> {
    match kind {
        "text" => None,
        "thinking" | "redacted_thinking" => Some(Unfit::Reasoning),
        // tool_use, server_tool_use and any block this code does not know.
        _ => Some(Unfit::ToolCall),
    }
}

/// Record one event's data as sent; an error event's message as `Err`.
pub(super) fn observe(seen: &mut Seen, json: &[u8]) -> Result<(), String> {
    let Ok(e) = serde_json::from_slice::<Event>(json) else {
        return Ok(());
    };
    if let Some(err) = e.error {
        let message = err
            .get("message")
            .and_then(Value::as_str)
            .map_or_else(|| err.to_string(), str::to_owned);
        return Err(message);
    }
    match &*e.kind {
        "message_start" => {
            if let Some(m) = e.message.filter(|_| seen.id.is_none()) {
                seen.id = m.id.map(Cow::into_owned);
                seen.model = m.model.map(Cow::into_owned);
            }
        }
        "content_block_start" => {
            let kind = e.content_block.map(|b| b.kind).unwrap_or_default();
            if let Some(u) = unfit_block(&kind) {
                seen.unfit.get_or_insert(u);
            } else if e.index != 0 {
                // A second text block: the continuation's one block cannot stand for both.
                seen.unfit.get_or_insert(Unfit::Choices);
            }
        }
        "content_block_delta" => {
            let Some(d) = e.delta else {
                return Ok(());
            };
            match d.kind.as_deref() {
                Some("text_delta") => {
                    if let Some(t) = d.text.filter(|t| !t.is_empty()) {
                        if seen.text.len() + t.len() > MAX_TEXT_BYTES {
                            seen.unfit.get_or_insert(Unfit::TooLong);
                        } else {
                            seen.text.push_str(&t);
                            seen.tokens += 1;
                        }
                    }
                }
                Some("thinking_delta" | "signature_delta") => {
                    seen.unfit.get_or_insert(Unfit::Reasoning);
                }
                _ => {
                    seen.unfit.get_or_insert(Unfit::ToolCall);
                }
            }
        }
        "content_block_stop" => seen.closing = seen.closing.max(1),
        "message_delta" if e.delta.and_then(|d| d.stop_reason).is_some() => {
            seen.finished = true;
        }
        _ => {}
    }
    Ok(())
}

/// Request options another engine cannot go on with. `thinking` is not one: a message whose
/// reasoning was streamed is already unfit, and one without has none left to do.
pub(super) fn check_fit(v: &Map<String, Value>) -> Result<(), Unfit> {
    let set = |k: &str| !matches!(v.get(k), None | Some(Value::Null));
    if set("output_format") || set("output_config") {
        return Err(Unfit::Guided);
    }
    Ok(())
}

/// The text so far as the reply's start: a final assistant message, or the client's own
/// final assistant message (a prefill) extended. `max_tokens` was reduced by the caller.
pub(super) fn continue_messages(v: &mut Map<String, Value>, text: &str) -> Result<(), Unfit> {
    // The answer is text from here on; a continuation that began thinking again would open a
    // block the client's message cannot take.
    v.remove("thinking");
    let Some(Value::Array(messages)) = v.get_mut("messages") else {
        return Err(Unfit::Body);
    };
    let last = messages
        .last_mut()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"));
    match last.and_then(|m| m.get_mut("content")) {
        Some(Value::String(s)) => s.push_str(text),
        Some(Value::Array(blocks)) => match blocks.last_mut() {
            Some(b) if b.get("type").and_then(Value::as_str) == Some("text") => {
                match b.get_mut("text") {
                    Some(Value::String(s)) => s.push_str(text),
                    _ => return Err(Unfit::Body),
                }
            }
            _ => blocks.push(json!({"type": "text", "text": text})),
        },
        Some(_) => return Err(Unfit::Body),
        None => messages.push(json!({"role": "assistant", "content": text})),
    }
    Ok(())
}

fn event(out: &mut Vec<u8>, kind: &str, data: &Value) {
    out.extend_from_slice(format!("event: {kind}\ndata: {data}\n\n").as_bytes());
}

/// The events that end a message whose text is whole: the text block's stop unless sent, a
/// `message_delta` unless sent (`max_tokens` when the limit ended it, else `end_turn`: the
/// block was closed, so the engine had ended its text), with usage (`input_tokens`: every
/// attempt's prompt; `output_tokens`: what the client has), and `message_stop`.
pub(super) fn final_events(seen: &Seen, at_limit: bool, usage: (u64, u64)) -> Vec<u8> {
    let mut out = Vec::new();
    if !seen.finished {
        if seen.closing == 0 {
            event(
                &mut out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": 0}),
            );
        }
        let reason = if at_limit { "max_tokens" } else { "end_turn" };
        event(
            &mut out,
            "message_delta",
            &json!({"type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": null},
                    "usage": {"input_tokens": usage.0, "output_tokens": usage.1}}),
        );
    }
    event(&mut out, "message_stop", &json!({"type": "message_stop"}));
    out
}

/// Rewrite one continuation event; `false`: drop it (it opens what the client has open).
/// Usage adds the attempts' before it: `prompt_before` to the prompt, `completion_before` to
/// the output.
pub(super) fn rewrite(
    v: &mut Map<String, Value>,
    prompt_before: u64,
    completion_before: u64,
) -> bool {
    match v.get("type").and_then(Value::as_str) {
        Some("message_start" | "content_block_start") => false,
        Some("message_delta") => {
            if let Some(Value::Object(u)) = v.get_mut("usage") {
                for (k, n) in [
                    ("input_tokens", prompt_before),
                    ("output_tokens", completion_before),
                ] {
                    if let Some(was) = u.get(k).and_then(Value::as_u64) {
                        u.insert(k.into(), (was + n).into());
                    }
                }
            }
            true
        }
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen_of(events: &[&str]) -> Seen {
        let mut s = Seen::default();
        for e in events {
            observe(&mut s, e.as_bytes()).unwrap();
        }
        s
    }

    const START: &str = r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"m","content":[],"usage":{"input_tokens":9,"output_tokens":1}}}"#;
    const TEXT: &str =
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#;

    fn delta(t: &str) -> String {
        format!(
            r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":"{t}"}}}}"#
        )
    }

    #[test]
    fn a_text_message_is_recorded() {
        let (a, b) = (delta(" a"), delta(" b"));
        let s = seen_of(&[START, TEXT, &a, &b]);
        assert_eq!(s.id.as_deref(), Some("msg_1"));
        assert_eq!(s.model.as_deref(), Some("m"));
        assert_eq!((s.text.as_str(), s.tokens), (" a b", 2));
        assert!(!s.finished && s.closing == 0 && s.unfit.is_none());
        let s = seen_of(&[
            START,
            TEXT,
            &a,
            r#"{"type":"content_block_stop","index":0}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":2}}"#,
        ]);
        assert!(s.closing == 1 && s.finished);
    }

    #[test]
    fn tool_use_thinking_and_errors() {
        let tool = r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"t","name":"f","input":{}}}"#;
        assert_eq!(seen_of(&[START, tool]).unfit, Some(Unfit::ToolCall));
        let think = r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}"#;
        assert_eq!(seen_of(&[START, think]).unfit, Some(Unfit::Reasoning));
        let mut s = Seen::default();
        let err = observe(
            &mut s,
            br#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#,
        );
        assert_eq!(err, Err("busy".to_string()));
    }

    #[test]
    fn the_text_so_far_becomes_the_final_assistant_message() {
        let mut v: Map<String, Value> = serde_json::from_str(
            r#"{"model":"m","max_tokens":9,"thinking":{"type":"enabled","budget_tokens":100},
               "messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        continue_messages(&mut v, " a b").unwrap();
        assert_eq!(
            v["messages"][1],
            json!({"role": "assistant", "content": " a b"})
        );
        assert!(!v.contains_key("thinking"));
        // A client's own prefill, as a string or blocks, is extended.
        let mut v: Map<String, Value> = serde_json::from_str(
            r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"text","text":"Sure:"}]}]}"#,
        )
        .unwrap();
        continue_messages(&mut v, " a").unwrap();
        assert_eq!(v["messages"][1]["content"][0]["text"], "Sure: a");
        assert_eq!(v["messages"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn continuation_events_lose_their_opening_and_add_usage() {
        let mut start: Map<String, Value> = serde_json::from_str(START).unwrap();
        assert!(!rewrite(&mut start, 10, 2));
        let mut block: Map<String, Value> = serde_json::from_str(TEXT).unwrap();
        assert!(!rewrite(&mut block, 10, 2));
        let mut d: Map<String, Value> = serde_json::from_str(
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":30,"output_tokens":3}}"#,
        )
        .unwrap();
        assert!(rewrite(&mut d, 10, 2));
        assert_eq!(d["usage"], json!({"input_tokens": 40, "output_tokens": 5}));
    }

    #[test]
    fn a_whole_text_gets_its_end() {
        let a = delta(" a");
        let s = seen_of(&[START, TEXT, &a]);
        let end = String::from_utf8(final_events(&s, true, (12, 1))).unwrap();
        let kinds: Vec<&str> = end
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .collect();
        assert_eq!(
            kinds,
            ["content_block_stop", "message_delta", "message_stop"]
        );
        assert!(end.contains(r#""stop_reason":"max_tokens""#), "{end}");
        assert!(end.contains(r#""output_tokens":1"#), "{end}");
        let mut done = s.clone();
        done.finished = true;
        let end = String::from_utf8(final_events(&done, false, (12, 1))).unwrap();
        assert_eq!(
            end,
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
        );
    }
}
