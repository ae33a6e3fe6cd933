//! What Responses and Messages replies say about themselves, under their own names: the
//! tokens they used and the text they wrote, from a whole body or from one stream event.

use serde::Deserialize;
use std::borrow::Cow;

use super::canon::{Block, Part};
use super::reply::{push_capped, ReplyCall, Usage};

#[derive(Deserialize)]
struct ResponsesUsage {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
    #[serde(default)]
    input_tokens_details: Option<InputDetails>,
}

#[derive(Deserialize)]
struct InputDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct WithResponsesUsage {
    #[serde(default)]
    usage: Option<ResponsesUsage>,
    /// A stream's `response.completed` event holds the response.
    #[serde(default)]
    response: Option<Box<WithResponsesUsage>>,
}

/// A Responses body's `usage`, or a `response.completed` event's. `input_tokens` counts
/// every prompt token, cached ones included, as chat's `prompt_tokens` does.
pub(super) fn responses_usage(json: &[u8]) -> Option<Usage> {
    let v: WithResponsesUsage = serde_json::from_slice(json).ok()?;
    let u = v.usage.or_else(|| v.response.and_then(|r| r.usage))?;
    Some(Usage {
        prompt_tokens: u.input_tokens,
        cached_tokens: u
            .input_tokens_details
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0),
        completion_tokens: u.output_tokens,
    })
}

#[derive(Deserialize)]
struct MessagesUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct WithMessagesUsage {
    #[serde(default)]
    usage: Option<MessagesUsage>,
    /// A stream's `message_start` event holds the message.
    #[serde(default)]
    message: Option<Box<WithMessagesUsage>>,
}

/// A Messages body's `usage`, or what a stream event adds to `so_far`: `message_start`
/// carries the prompt's, `message_delta` the output's. Anthropic's `input_tokens` counts only
/// the tokens not read from cache, so the prompt is all three input counts.
pub(super) fn messages_usage(json: &[u8], so_far: Option<Usage>) -> Option<Usage> {
    let v: WithMessagesUsage = serde_json::from_slice(json).ok()?;
    let u = v.usage.or_else(|| v.message.and_then(|m| m.usage))?;
    let mut usage = so_far.unwrap_or_default();
    let read = u.cache_read_input_tokens.unwrap_or(0);
    let prompt = u.input_tokens.unwrap_or(0) + read + u.cache_creation_input_tokens.unwrap_or(0);
    // A `message_delta` with only `output_tokens` leaves the prompt as `message_start` said.
    if prompt > 0 {
        usage.prompt_tokens = prompt;
        usage.cached_tokens = read;
    }
    if let Some(out) = u.output_tokens {
        usage.completion_tokens = out;
    }
    Some(usage)
}

#[derive(Deserialize)]
struct OutputItem<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Vec<Part<'a>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    arguments: Option<Cow<'a, str>>,
}

impl OutputItem<'_> {
    /// The tool call a `function_call` item is.
    fn call(&self) -> Option<ReplyCall> {
        (self.kind.as_deref() == Some("function_call")).then(|| {
            let mut call = ReplyCall {
                name: self.name.as_deref().unwrap_or("").to_owned(),
                arguments: String::new(),
            };
            push_capped(&mut call.arguments, self.arguments.as_deref().unwrap_or(""));
            call
        })
    }
}

#[derive(Deserialize)]
struct ResponsesText<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    delta: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    output: Vec<OutputItem<'a>>,
    /// A finished output item (`response.output_item.done`).
    #[serde(borrow, default)]
    item: Option<OutputItem<'a>>,
}

/// The text a Responses reply writes: its `output_text` deltas when streamed (the closing
/// `response.completed` repeats them whole and is not read), else its message items' text;
/// and its tool calls, from each finished `function_call` item or the body's.
pub(super) fn responses_text(json: &[u8], out: &mut String, calls: &mut Vec<ReplyCall>) {
    let Ok(v) = serde_json::from_slice::<ResponsesText>(json) else {
        return;
    };
    match v.kind.as_deref() {
        Some("response.output_text.delta") => push_capped(out, v.delta.as_deref().unwrap_or("")),
        Some("response.output_item.done") => {
            calls.extend(v.item.as_ref().and_then(OutputItem::call))
        }
        Some(_) => {}
        None => {
            let items = v
                .output
                .iter()
                .filter(|i| i.kind.as_deref() == Some("message"));
            for part in items.flat_map(|i| &i.content) {
                if let ("output_text", Some(t)) = (part.kind.as_deref().unwrap_or(""), &part.text) {
                    push_capped(out, t);
                }
            }
            calls.extend(v.output.iter().filter_map(OutputItem::call));
        }
    }
}

#[derive(Deserialize)]
struct MessagesText<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    delta: Option<Block<'a>>,
    #[serde(borrow, default)]
    content_block: Option<Block<'a>>,
    #[serde(borrow, default)]
    content: Vec<Block<'a>>,
}

/// The text a Messages reply writes: `text_delta`s when streamed, else its text blocks; and its
/// tool calls: a streamed `tool_use` block's name and its `input_json_delta`s, or the body's
/// `tool_use` blocks.
pub(super) fn messages_text(json: &[u8], out: &mut String, calls: &mut Vec<ReplyCall>) {
    let Ok(v) = serde_json::from_slice::<MessagesText>(json) else {
        return;
    };
    let call = |b: &Block| ReplyCall {
        name: b.name.as_deref().unwrap_or("").to_owned(),
        arguments: b.input.map_or(String::new(), |i| i.get().to_owned()),
    };
    match v.kind.as_deref() {
        Some("content_block_start") => calls.extend(
            v.content_block
                .as_ref()
                .filter(|b| b.kind.as_deref() == Some("tool_use"))
                .map(|b| ReplyCall {
                    arguments: String::new(),
                    ..call(b)
                }),
        ),
        Some("content_block_delta") => match (v.delta.as_ref(), calls.last_mut()) {
            (Some(d), Some(c)) if d.kind.as_deref() == Some("input_json_delta") => {
                push_capped(&mut c.arguments, d.partial_json.as_deref().unwrap_or(""));
            }
            (Some(d), _) if d.kind.as_deref() == Some("text_delta") => {
                push_capped(out, d.text.as_deref().unwrap_or(""));
            }
            _ => {}
        },
        Some("message") => {
            for b in &v.content {
                match (b.kind.as_deref(), &b.text) {
                    (Some("text"), Some(t)) => push_capped(out, t),
                    (Some("tool_use"), _) => calls.push(call(b)),
                    _ => {}
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_usage_from_a_body_or_its_completed_event() {
        let body = br#"{"object":"response","output":[{"type":"message","content":[{"type":"output_text","text":"Hi there"}]}],"usage":{"input_tokens":120,"input_tokens_details":{"cached_tokens":96},"output_tokens":7,"total_tokens":127}}"#;
        let want = Usage {
            prompt_tokens: 120,
            cached_tokens: 96,
            completion_tokens: 7,
        };
        assert_eq!(responses_usage(body), Some(want));
        let done = br#"{"type":"response.completed","sequence_number":9,"response":{"usage":{"input_tokens":120,"input_tokens_details":{"cached_tokens":96},"output_tokens":7}}}"#;
        assert_eq!(responses_usage(done), Some(want));
        assert_eq!(responses_usage(br#"{"type":"response.created"}"#), None);

        let (mut text, mut calls) = (String::new(), Vec::new());
        responses_text(body, &mut text, &mut calls);
        responses_text(
            br#"{"type":"response.output_text.delta","delta":" and more"}"#,
            &mut text,
            &mut calls,
        );
        responses_text(
            br#"{"type":"response.reasoning_text.delta","delta":"hidden"}"#,
            &mut text,
            &mut calls,
        );
        responses_text(done, &mut text, &mut calls);
        assert_eq!(text, "Hi there and more");
    }

    #[test]
    fn messages_usage_adds_up_cache_reads_and_stream_events() {
        // llama.cpp 0.6.0 and Anthropic: `input_tokens` is the uncached part.
        let body = br#"{"type":"message","content":[{"type":"thinking","thinking":"t"},{"type":"text","text":"Hello"}],"usage":{"input_tokens":20,"cache_read_input_tokens":80,"output_tokens":5}}"#;
        let want = Usage {
            prompt_tokens: 100,
            cached_tokens: 80,
            completion_tokens: 5,
        };
        assert_eq!(messages_usage(body, None), Some(want));
        let start = br#"{"type":"message_start","message":{"content":[],"usage":{"input_tokens":20,"cache_creation_input_tokens":0,"cache_read_input_tokens":80,"output_tokens":1}}}"#;
        let delta = br#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":5}}"#;
        let s = messages_usage(start, None);
        assert_eq!(messages_usage(delta, s), Some(want));

        let (mut text, mut calls) = (String::new(), Vec::new());
        messages_text(body, &mut text, &mut calls);
        for e in [
            &br#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#[..],
            br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" world"}}"#,
            br#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{}"}}"#,
            start,
        ] {
            messages_text(e, &mut text, &mut calls);
        }
        assert_eq!(text, "Hello world");
    }

    #[test]
    fn tool_calls_are_collected_streamed_and_whole() {
        let call = |name: &str, arguments: &str| ReplyCall {
            name: name.into(),
            arguments: arguments.into(),
        };
        let (mut text, mut calls) = (String::new(), Vec::new());
        for e in [
            &br#"{"type":"response.output_item.added","item":{"type":"function_call","name":"run","arguments":""}}"#[..],
            br#"{"type":"response.function_call_arguments.delta","delta":"{\"a\""}"#,
            br#"{"type":"response.output_item.done","item":{"type":"function_call","id":"fc_1","call_id":"c1","name":"run","arguments":"{\"a\":1}"}}"#,
            br#"{"type":"response.output_item.done","item":{"type":"message","content":[]}}"#,
        ] {
            responses_text(e, &mut text, &mut calls);
        }
        assert_eq!(
            (text.as_str(), &calls[..]),
            ("", &[call("run", r#"{"a":1}"#)][..])
        );
        let (mut text, mut calls) = (String::new(), Vec::new());
        let body = br#"{"output":[{"type":"message","content":[{"type":"output_text","text":"Let me look."}]},{"type":"function_call","name":"read","arguments":"{}"}]}"#;
        responses_text(body, &mut text, &mut calls);
        assert_eq!(
            (text.as_str(), &calls[..]),
            ("Let me look.", &[call("read", "{}")][..])
        );

        let (mut text, mut calls) = (String::new(), Vec::new());
        for e in [
            &br#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#[..],
            br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Looking."}}"#,
            br#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"t1","name":"run","input":{}}}"#,
            br#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"a\":"}}"#,
            br#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"1}"}}"#,
        ] {
            messages_text(e, &mut text, &mut calls);
        }
        assert_eq!(
            (text.as_str(), &calls[..]),
            ("Looking.", &[call("run", r#"{"a":1}"#)][..])
        );
        let (mut text, mut calls) = (String::new(), Vec::new());
        let body = br#"{"type":"message","content":[{"type":"tool_use","id":"t1","name":"run","input":{"b": 2, "a": 1}}]}"#;
        messages_text(body, &mut text, &mut calls);
        assert_eq!(calls, [call("run", r#"{"b": 2, "a": 1}"#)]);
    }
}
