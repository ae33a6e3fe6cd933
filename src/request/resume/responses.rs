//! OpenAI's Responses stream, continued: what its events say the client has, the request that
//! goes on from there, and the continuation turned into the rest of the client's stream.
//!
//! The Responses API has no way to ask for the rest of an answer, so the continuation is a chat
//! request: the body as the engine renders it (`agent_chat`, as vLLM, SGLang and llama-server
//! turn Responses into chat), the text so far as a final assistant message with
//! `continue_final_message`, streamed. Its chunks become `response.output_text.delta` events of
//! the client's message item, numbered on from the client's last `sequence_number`, and its end
//! the closing events (`output_text.done` … `response.completed`) of the response the client
//! saw created, with usage summed. Only a response whose one output is a text message is
//! continued: a function call may stop mid-JSON, and reasoning cannot be resumed from outside.

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{Seen, Unfit, MAX_TEXT_BYTES};
use crate::request::agent_chat::to_chat;
use crate::request::usage::{event_data, split_events};
use crate::request::Endpoint;

/// Where the continuation goes.
pub const CONTINUATION_PATH: &str = "/v1/chat/completions";

#[derive(Deserialize)]
struct Event {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    sequence_number: Option<u64>,
    #[serde(default)]
    response: Option<Value>,
    #[serde(default)]
    item: Option<Value>,
    #[serde(default)]
    part: Option<Value>,
    #[serde(default)]
    output_index: u32,
    #[serde(default)]
    delta: Option<String>,
    #[serde(default)]
    error: Option<Value>,
    #[serde(default)]
    message: Option<String>,
}

/// Record one event's data as sent; an error (an `error` event, `response.failed`) as `Err`.
pub(super) fn observe(seen: &mut Seen, json: &[u8]) -> Result<(), String> {
    let Ok(e) = serde_json::from_slice::<Event>(json) else {
        return Ok(());
    };
    if let Some(n) = e.sequence_number {
        seen.sequence = seen.sequence.max(n + 1);
    }
    if let Some(err) = e.error.filter(|_| e.kind != "response.failed") {
        let message = err.get("message").and_then(Value::as_str);
        return Err(message.map_or_else(|| err.to_string(), str::to_owned));
    }
    match e.kind.as_str() {
        "error" => return Err(e.message.unwrap_or_else(|| "error".into())),
        "response.failed" => {
            let r = e.response.unwrap_or_default();
            let message = r["error"]["message"]
                .as_str()
                .unwrap_or("the response failed");
            return Err(message.to_owned());
        }
        "response.created" => {
            if let Some(r) = e.response.filter(|_| seen.opening.is_none()) {
                seen.id = r["id"].as_str().map(str::to_owned);
                seen.model = r["model"].as_str().map(str::to_owned);
                seen.created = r["created_at"].as_u64();
                seen.opening = Some(r);
            }
        }
        "response.output_item.added" => {
            let item = e.item.unwrap_or_default();
            match item["type"].as_str() {
                Some("message") if e.output_index == 0 => {
                    seen.item_id = item["id"].as_str().map(str::to_owned);
                }
                Some("message") => {
                    seen.unfit.get_or_insert(Unfit::Choices);
                }
                Some("reasoning") => {
                    seen.unfit.get_or_insert(Unfit::Reasoning);
                }
                _ => {
                    seen.unfit.get_or_insert(Unfit::ToolCall);
                }
            }
        }
        "response.content_part.added"
            if e.part.unwrap_or_default()["type"].as_str() != Some("output_text") =>
        {
            seen.unfit.get_or_insert(Unfit::Guided);
        }
        "response.output_text.delta" => {
            if let Some(t) = e.delta.filter(|t| !t.is_empty()) {
                if seen.text.len() + t.len() > MAX_TEXT_BYTES {
                    seen.unfit.get_or_insert(Unfit::TooLong);
                } else {
                    seen.text.push_str(&t);
                    seen.tokens += 1;
                }
            }
        }
        "response.reasoning_text.delta" | "response.reasoning_summary_text.delta" => {
            seen.unfit.get_or_insert(Unfit::Reasoning);
        }
        "response.function_call_arguments.delta" => {
            seen.unfit.get_or_insert(Unfit::ToolCall);
        }
        "response.output_text.done" => seen.closing = seen.closing.max(1),
        "response.content_part.done" => seen.closing = seen.closing.max(2),
        "response.output_item.done" => seen.closing = seen.closing.max(3),
        "response.completed" | "response.incomplete" => seen.finished = true,
        _ => {}
    }
    Ok(())
}

/// The chat request that goes on from `seen` for the Responses body `v`: output limits
/// (`max_output_tokens`) reduced by the caller's `remaining`.
pub(super) fn continuation(
    mut v: Map<String, Value>,
    text: &str,
    remaining: Option<u64>,
) -> Result<Value, Unfit> {
    let set = |v: &Map<String, Value>, k: &str| !matches!(v.get(k), None | Some(Value::Null));
    if set(&v, "previous_response_id") || set(&v, "conversation") {
        return Err(Unfit::History);
    }
    let format = v.get("text").and_then(|t| t["format"]["type"].as_str());
    if !matches!(format, None | Some("text")) {
        return Err(Unfit::Guided);
    }
    if v.get("top_logprobs")
        .and_then(Value::as_u64)
        .is_some_and(|n| n > 0)
    {
        return Err(Unfit::Logprobs);
    }
    let mut chat = Map::new();
    for k in ["model", "temperature", "top_p", "user"] {
        if let Some(x) = v.remove(k).filter(|x| !x.is_null()) {
            chat.insert(k.into(), x);
        }
    }
    let (messages, tools) =
        to_chat(Endpoint::Responses, Value::Object(v)).map_err(|_| Unfit::Body)?;
    let Value::Array(mut messages) = messages else {
        return Err(Unfit::Body);
    };
    messages.push(json!({"role": "assistant", "content": text}));
    chat.insert("messages".into(), Value::Array(messages));
    if !tools.is_null() {
        // Kept so the prompt renders as the first engine's did (and finds its cache); the
        // answer is text by now, so the model is not made to call one.
        chat.insert("tools".into(), tools);
    }
    if let Some(n) = remaining {
        chat.insert("max_tokens".into(), n.into());
    }
    chat.insert("stream".into(), true.into());
    chat.insert("stream_options".into(), json!({"include_usage": true}));
    chat.insert("continue_final_message".into(), true.into());
    chat.insert("add_generation_prompt".into(), false.into());
    Ok(Value::Object(chat))
}

fn event(out: &mut Vec<u8>, sequence: &mut u64, kind: &str, mut body: Value) {
    body["type"] = json!(kind);
    body["sequence_number"] = json!(*sequence);
    *sequence += 1;
    out.extend_from_slice(format!("event: {kind}\ndata: {body}\n\n").as_bytes());
}

/// The events that close the client's message and response after `seen.closing` of them were
/// sent: `max_output_tokens` ended it (`incomplete`) or the engine did. `usage`: every
/// attempt's prompt, and every token the client has.
fn closing(
    out: &mut Vec<u8>,
    seen: &Seen,
    sequence: &mut u64,
    text: &str,
    incomplete: bool,
    usage: (u64, u64),
) {
    let item_id = seen.item_id.clone().unwrap_or_default();
    let part = json!({"type": "output_text", "annotations": [], "text": text});
    let at = || json!({"item_id": item_id, "output_index": 0, "content_index": 0});
    if seen.closing < 1 {
        let mut b = at();
        b["text"] = json!(text);
        b["logprobs"] = json!([]);
        event(out, sequence, "response.output_text.done", b);
    }
    if seen.closing < 2 {
        let mut b = at();
        b["part"] = part.clone();
        event(out, sequence, "response.content_part.done", b);
    }
    let status = if incomplete {
        "incomplete"
    } else {
        "completed"
    };
    let item = json!({"type": "message", "id": item_id, "status": status, "role": "assistant",
                      "content": [part]});
    if seen.closing < 3 {
        let b = json!({"output_index": 0, "item": item});
        event(out, sequence, "response.output_item.done", b);
    }
    let mut response = seen.opening.clone().unwrap_or_else(
        || json!({"id": seen.id, "object": "response", "created_at": seen.created, "model": seen.model}),
    );
    response["status"] = json!(status);
    response["output"] = json!([item]);
    response["usage"] = json!({"input_tokens": usage.0, "output_tokens": usage.1,
                               "total_tokens": usage.0 + usage.1});
    if incomplete {
        response["incomplete_details"] = json!({"reason": "max_output_tokens"});
    }
    let kind = if incomplete {
        "response.incomplete"
    } else {
        "response.completed"
    };
    event(out, sequence, kind, json!({"response": response}));
}

/// The events that end a response whose text is whole (`at_limit`: its output limit ended
/// it); nothing when `response.completed` was sent.
pub(super) fn final_events(seen: &Seen, at_limit: bool, usage: (u64, u64)) -> Vec<u8> {
    let mut out = Vec::new();
    if !seen.finished {
        let mut sequence = seen.sequence;
        closing(&mut out, seen, &mut sequence, &seen.text, at_limit, usage);
    }
    out
}

/// A chat continuation's chunks as the rest of the client's Responses stream.
#[derive(Debug, Clone)]
pub struct Translator {
    seen: Seen,
    sequence: u64,
    text: String,
    tokens: u64,
    finish: Option<String>,
    usage: Option<(u64, u64)>,
    prompt_before: u64,
}

impl Translator {
    pub(super) fn new(seen: &Seen, prompt_before: u64) -> Translator {
        Translator {
            seen: seen.clone(),
            sequence: seen.sequence,
            text: seen.text.clone(),
            tokens: seen.tokens,
            finish: None,
            usage: None,
            prompt_before,
        }
    }

    /// Rewrite `body` (whole chat events) in place. An error event passes as it is, for the
    /// transcript to catch.
    pub(super) fn filter(&mut self, body: &mut Option<bytes::Bytes>) {
        let Some(b) = body.as_ref() else {
            return;
        };
        let mut out = Vec::new();
        for raw in split_events(b) {
            let Some(data) = event_data(raw) else {
                if is_done(raw) {
                    let usage = self.usage.unwrap_or((self.prompt_before, self.tokens));
                    let incomplete = self.finish.as_deref() == Some("length");
                    let text = std::mem::take(&mut self.text);
                    closing(
                        &mut out,
                        &self.seen,
                        &mut self.sequence,
                        &text,
                        incomplete,
                        usage,
                    );
                }
                continue;
            };
            let Ok(v) = serde_json::from_slice::<Value>(data) else {
                continue;
            };
            if v.get("error").is_some() {
                out.extend_from_slice(raw);
                continue;
            }
            if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                let n = |k: &str| u[k].as_u64().unwrap_or(0);
                self.usage = Some((
                    n("prompt_tokens") + self.prompt_before,
                    n("completion_tokens") + self.seen.tokens,
                ));
            }
            let Some(c) = v["choices"].get(0) else {
                continue;
            };
            if let Some(f) = c["finish_reason"].as_str() {
                self.finish = Some(f.to_owned());
            }
            if let Some(t) = c["delta"]["content"].as_str().filter(|t| !t.is_empty()) {
                self.text.push_str(t);
                self.tokens += 1;
                let b = json!({"item_id": self.seen.item_id, "output_index": 0,
                               "content_index": 0, "delta": t, "logprobs": []});
                event(
                    &mut out,
                    &mut self.sequence,
                    "response.output_text.delta",
                    b,
                );
            }
        }
        *body = Some(out.into());
    }
}

/// Chat's `data: [DONE]`, the end the Responses stream's closing events stand in for.
fn is_done(raw: &[u8]) -> bool {
    raw.split(|&b| b == b'\n').any(|line| {
        let line = line.trim_ascii();
        line.strip_prefix(b"data:").map(<[u8]>::trim_ascii) == Some(b"[DONE]")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen_of(events: &[Value]) -> Seen {
        let mut s = Seen::default();
        for e in events {
            observe(&mut s, e.to_string().as_bytes()).unwrap();
        }
        s
    }

    fn opening() -> Vec<Value> {
        vec![
            json!({"type": "response.created", "sequence_number": 0,
                   "response": {"id": "resp_1", "object": "response", "created_at": 5,
                                "status": "in_progress", "model": "m", "output": []}}),
            json!({"type": "response.output_item.added", "sequence_number": 1, "output_index": 0,
                   "item": {"type": "message", "id": "msg_1", "status": "in_progress",
                            "role": "assistant", "content": []}}),
            json!({"type": "response.content_part.added", "sequence_number": 2,
                   "item_id": "msg_1", "output_index": 0, "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": []}}),
            json!({"type": "response.output_text.delta", "sequence_number": 3,
                   "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": " a"}),
        ]
    }

    fn events_of(bytes: &[u8]) -> Vec<Value> {
        split_events(bytes)
            .into_iter()
            .filter_map(event_data)
            .map(|d| serde_json::from_slice(d).unwrap())
            .collect()
    }

    #[test]
    fn a_text_response_is_recorded() {
        let s = seen_of(&opening());
        assert_eq!(
            (s.id.as_deref(), s.item_id.as_deref()),
            (Some("resp_1"), Some("msg_1"))
        );
        assert_eq!((s.text.as_str(), s.tokens, s.sequence), (" a", 1, 4));
        assert!(s.unfit.is_none() && !s.finished);
        let mut call = opening();
        call[1]["item"]["type"] = json!("function_call");
        assert_eq!(seen_of(&call).unfit, Some(Unfit::ToolCall));
        let mut s = Seen::default();
        let failed = json!({"type": "response.failed", "response": {"error": {"message": "oom"}}});
        assert_eq!(
            observe(&mut s, failed.to_string().as_bytes()),
            Err("oom".into())
        );
    }

    #[test]
    fn the_continuation_is_a_chat_request_going_on_from_the_text() {
        let v: Map<String, Value> = serde_json::from_value(json!({
            "model": "m", "instructions": "be brief", "input": "hi", "max_output_tokens": 9,
            "stream": true, "temperature": 0.5, "reasoning": {"effort": "low"}}))
        .unwrap();
        let chat = continuation(v, " a", Some(8)).unwrap();
        assert_eq!(chat["messages"][0]["role"], "system");
        assert_eq!(
            chat["messages"][1],
            json!({"role": "user", "content": "hi"})
        );
        assert_eq!(
            chat["messages"][2],
            json!({"role": "assistant", "content": " a"})
        );
        assert_eq!(
            (chat["max_tokens"].as_u64(), chat["temperature"].as_f64()),
            (Some(8), Some(0.5))
        );
        assert_eq!(chat["continue_final_message"], true);
        assert_eq!(chat["stream_options"]["include_usage"], true);
        let stored: Map<String, Value> = serde_json::from_value(
            json!({"model": "m", "input": "hi", "previous_response_id": "resp_0"}),
        )
        .unwrap();
        assert_eq!(continuation(stored, "", None), Err(Unfit::History));
        let json_out: Map<String, Value> = serde_json::from_value(
            json!({"model": "m", "input": "hi", "text": {"format": {"type": "json_schema"}}}),
        )
        .unwrap();
        assert_eq!(continuation(json_out, "", None), Err(Unfit::Guided));
    }

    #[test]
    fn chat_chunks_become_the_rest_of_the_response() {
        let s = seen_of(&opening());
        let mut t = Translator::new(&s, 40);
        let mut body = Some(bytes::Bytes::from(concat!(
            "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" b\"}}]}\n\n",
            "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":50,\"completion_tokens\":1}}\n\n",
            "data: [DONE]\n\n",
        )));
        t.filter(&mut body);
        let events = events_of(body.as_ref().unwrap());
        let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(
            kinds,
            [
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        let numbers: Vec<u64> = events
            .iter()
            .filter_map(|e| e["sequence_number"].as_u64())
            .collect();
        assert_eq!(numbers, [4, 5, 6, 7, 8]);
        assert_eq!(events[0]["item_id"], "msg_1");
        assert_eq!(events[1]["text"], " a b");
        let r = &events[4]["response"];
        assert_eq!(
            (r["id"].as_str(), r["status"].as_str()),
            (Some("resp_1"), Some("completed"))
        );
        assert_eq!(r["output"][0]["content"][0]["text"], " a b");
        assert_eq!(
            r["usage"],
            json!({"input_tokens": 90, "output_tokens": 2, "total_tokens": 92})
        );
    }

    #[test]
    fn a_whole_text_is_closed_from_where_its_closing_stopped() {
        let mut events = opening();
        events.push(json!({"type": "response.output_text.done", "sequence_number": 4,
                           "item_id": "msg_1", "output_index": 0, "content_index": 0, "text": " a"}));
        let s = seen_of(&events);
        let out = events_of(&final_events(&s, true, (10, 1)));
        let kinds: Vec<&str> = out.iter().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(
            kinds,
            [
                "response.content_part.done",
                "response.output_item.done",
                "response.incomplete"
            ]
        );
        assert_eq!(
            out[2]["response"]["incomplete_details"]["reason"],
            "max_output_tokens"
        );
        let mut done = s.clone();
        done.finished = true;
        assert!(final_events(&done, false, (10, 1)).is_empty());
    }
}
