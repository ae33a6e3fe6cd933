//! Responses API answers, shaped as a real llama-server gives them: the response object and
//! its stream of typed events (`event: <type>` then `data: <json>`, numbered by
//! `sequence_number`, no `[DONE]`). The usage always comes in `response.completed`;
//! `input_tokens` counts every prompt token, cached ones included.
//!
//! The opening events go out with the first token, not on arrival, so the stream's first byte
//! comes at the time to first token, as for chat (and as llama-server sends them).

use std::sync::Arc;

use bytes::Bytes;
use serde_json::{json, Value};

use super::response::{unix_now, Answer, Usage};
use super::response_store::Stored;
use crate::sim::text::responses::Thread;
use crate::sim::text::tool_call::{ToolCall, ARGS_CLOSE, ARGS_OPEN};

pub fn usage_json(u: Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

fn msg_id(a: &Answer) -> &str {
    a.responses.as_ref().map_or("", |r| r.msg_id.as_str())
}

fn output_item(a: &Answer, text: &str, status: &str) -> Value {
    let done = status == "completed";
    if let Some(t) = &a.tool {
        return json!({
            "type": "function_call",
            "id": msg_id(a),
            "call_id": t.call_id,
            "name": t.name,
            "arguments": if done { ToolCall::arguments(text) } else { String::new() },
            "status": status,
        });
    }
    let content = if done {
        json!([{"type": "output_text", "annotations": [], "text": text}])
    } else {
        json!([])
    };
    json!({
        "type": "message",
        "id": msg_id(a),
        "status": status,
        "role": "assistant",
        "content": content,
    })
}

/// The response object while it runs: no output yet, no usage.
fn in_progress(a: &Answer) -> Value {
    json!({
        "id": a.id,
        "object": "response",
        "created_at": a.created,
        "status": "in_progress",
        "model": a.model,
        "output": [],
    })
}

/// The finished response object, kept in the server's store unless the request said
/// `store: false`.
pub fn completed(a: &Answer, text: &str, usage: Usage) -> Value {
    let item = output_item(a, text, "completed");
    let v = json!({
        "id": a.id,
        "object": "response",
        "created_at": a.created,
        "completed_at": unix_now(),
        "status": "completed",
        "model": a.model,
        "output": [item.clone()],
        "usage": usage_json(usage),
    });
    if let Some(r) = a.responses.as_ref().filter(|r| r.input.store) {
        let thread = Arc::new(Thread {
            prior: r.input.prior.clone(),
            input: r.input.input.clone(),
            output: vec![item],
        });
        let stored = Stored {
            response: v.clone(),
            thread,
        };
        r.store.put(a.id.clone(), stored);
    }
    v
}

/// Writes one streamed answer's events.
pub struct ResponsesEvents {
    answer: Answer,
    sequence: u64,
    /// The reply so far, for the closing events that repeat it.
    text: String,
}

impl ResponsesEvents {
    pub fn new(answer: Answer) -> Self {
        Self {
            answer,
            sequence: 0,
            text: String::new(),
        }
    }

    fn event(&mut self, kind: &str, mut body: Value, out: &mut String) {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        out.push_str(&format!("event: {kind}\ndata: {body}\n\n"));
    }

    /// The events of the text `text` (one or more tokens); the first also opens the response.
    pub fn token(&mut self, text: &str, first: bool) -> Bytes {
        let mut out = String::new();
        let (item_id, a) = (msg_id(&self.answer).to_owned(), &self.answer);
        if first {
            let (response, item) = (in_progress(a), output_item(a, "", "in_progress"));
            self.event("response.created", json!({"response": response}), &mut out);
            self.event(
                "response.in_progress",
                json!({"response": response}),
                &mut out,
            );
            let added = json!({"output_index": 0, "item": item});
            self.event("response.output_item.added", added, &mut out);
            if self.answer.tool.is_none() {
                let part = json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                                  "part": {"type": "output_text", "annotations": [], "text": ""}});
                self.event("response.content_part.added", part, &mut out);
            }
        }
        self.text.push_str(text);
        if self.answer.tool.is_some() {
            let delta = if first {
                format!("{ARGS_OPEN}{text}")
            } else {
                text.to_owned()
            };
            let delta = json!({"item_id": item_id, "output_index": 0, "delta": delta});
            self.event("response.function_call_arguments.delta", delta, &mut out);
        } else {
            let delta = json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                               "delta": text});
            self.event("response.output_text.delta", delta, &mut out);
        }
        Bytes::from(out)
    }

    /// The closing events, the last with the whole response and its usage.
    pub fn finish(&mut self, usage: Usage) -> Bytes {
        let mut out = String::new();
        let text = std::mem::take(&mut self.text);
        let item_id = msg_id(&self.answer).to_owned();
        if self.answer.tool.is_some() {
            let at = json!({"item_id": item_id, "output_index": 0});
            let mut delta = at.clone();
            delta["delta"] = json!(ARGS_CLOSE);
            self.event("response.function_call_arguments.delta", delta, &mut out);
            let mut done = at;
            done["arguments"] = json!(ToolCall::arguments(&text));
            self.event("response.function_call_arguments.done", done, &mut out);
        } else {
            let at = json!({"item_id": item_id, "output_index": 0, "content_index": 0});
            let mut done = at.clone();
            done["text"] = json!(text);
            self.event("response.output_text.done", done, &mut out);
            let mut part = at;
            part["part"] = json!({"type": "output_text", "annotations": [], "text": text});
            self.event("response.content_part.done", part, &mut out);
        }
        let item = output_item(&self.answer, &text, "completed");
        let item = json!({"output_index": 0, "item": item});
        self.event("response.output_item.done", item, &mut out);
        let response = completed(&self.answer, &text, usage);
        self.event(
            "response.completed",
            json!({"response": response}),
            &mut out,
        );
        Bytes::from(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::api::response_store::ResponseStore;
    use crate::sim::text::openai::Endpoint;
    use crate::sim::text::responses::ResponsesInput;

    fn answer(store: &Arc<ResponseStore>, keep: bool) -> Answer {
        let input = ResponsesInput {
            prior: None,
            input: vec![json!({"type": "message", "id": "msg_in", "role": "user",
                               "content": [{"type": "input_text", "text": "hi"}]})],
            store: keep,
        };
        Answer::new(Endpoint::Responses, 0, 0, "m").with_responses(Some(input), store)
    }

    const USAGE: Usage = Usage {
        prompt_tokens: 40,
        completion_tokens: 2,
        cached_tokens: 32,
    };

    #[test]
    fn completed_shape_and_store() {
        let store = Arc::new(ResponseStore::new(4));
        let a = answer(&store, true);
        let v = completed(&a, " tok0 tok1", USAGE);
        assert!(v["id"].as_str().unwrap().starts_with("resp_"));
        assert_eq!(v["object"], "response");
        assert_eq!(v["status"], "completed");
        assert!(v["completed_at"].as_u64().unwrap() >= v["created_at"].as_u64().unwrap());
        let item = &v["output"][0];
        assert_eq!(item["type"], "message");
        assert!(item["id"].as_str().unwrap().starts_with("msg_"));
        assert_eq!(
            (item["status"].as_str(), item["role"].as_str()),
            (Some("completed"), Some("assistant"))
        );
        assert_eq!(
            item["content"],
            json!([{"type": "output_text", "annotations": [], "text": " tok0 tok1"}])
        );
        assert_eq!(
            v["usage"],
            json!({"input_tokens": 40, "output_tokens": 2, "total_tokens": 42,
                   "input_tokens_details": {"cached_tokens": 32}})
        );
        let stored = store.get(v["id"].as_str().unwrap()).unwrap();
        assert_eq!(stored.response, v);
        assert_eq!(stored.thread.items().len(), 2);
        let b = answer(&store, false);
        let v = completed(&b, " tok0", USAGE);
        assert!(store.get(v["id"].as_str().unwrap()).is_none());
    }

    #[test]
    fn events_are_numbered_in_order() {
        let store = Arc::new(ResponseStore::new(4));
        let mut w = ResponsesEvents::new(answer(&store, true));
        let mut text = String::from_utf8(w.token(" tok0", true).to_vec()).unwrap();
        text.push_str(std::str::from_utf8(&w.token(" tok1", false)).unwrap());
        text.push_str(std::str::from_utf8(&w.finish(USAGE)).unwrap());
        let events: Vec<(String, Value)> = text
            .split_terminator("\n\n")
            .map(|e| {
                let (kind, data) = e.split_once('\n').unwrap();
                let kind = kind.strip_prefix("event: ").unwrap().to_owned();
                (
                    kind,
                    serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap(),
                )
            })
            .collect();
        let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, (kind, v)) in events.iter().enumerate() {
            assert_eq!(v["type"], kind.as_str());
            assert_eq!(v["sequence_number"], i as u64);
        }
        assert_eq!(events[0].1["response"]["status"], "in_progress");
        assert_eq!(events[5].1["delta"], " tok1");
        assert_eq!(
            events[5].1["item_id"],
            events[9].1["response"]["output"][0]["id"]
        );
        assert_eq!(events[6].1["text"], " tok0 tok1");
        let done = &events[9].1["response"];
        assert_eq!(done["usage"]["input_tokens_details"]["cached_tokens"], 32);
        assert_eq!(
            store.get(done["id"].as_str().unwrap()).unwrap().response,
            *done
        );
    }
}
