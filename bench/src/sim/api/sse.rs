//! Server-sent events for streamed answers: one `data: {chunk}\n\n` event per token, an
//! optional usage chunk, then `data: [DONE]\n\n`, as vLLM and OpenAI send them. The Responses
//! and Messages APIs send typed events instead (`responses_answer`, `messages_answer`);
//! `StreamWriter` gives both answer modes one interface to all three.

use axum::body::Body;
use axum::http::{header, HeaderValue};
use axum::response::Response;
use bytes::Bytes;
use serde_json::{json, Value};

use super::messages_answer;
use super::response::{Answer, Timings, Usage};
use super::responses_answer::ResponsesEvents;
use crate::sim::text::openai::Endpoint;

pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// The events of one streamed answer, in its API's shape.
pub enum StreamWriter {
    Chunks(ChunkWriter),
    Responses(ResponsesEvents),
    Messages(Answer),
}

impl StreamWriter {
    pub fn new(answer: Answer) -> Self {
        match answer.endpoint {
            Endpoint::Responses => Self::Responses(ResponsesEvents::new(answer)),
            Endpoint::Messages => Self::Messages(answer),
            _ => Self::Chunks(ChunkWriter::new(answer)),
        }
    }

    /// The event(s) for `text`, one or more tokens. `start` is the prompt's usage as known at
    /// the first token, which Anthropic's `message_start` reports.
    pub fn token(&mut self, text: &str, first: bool, last: bool, start: Usage) -> Bytes {
        match self {
            Self::Chunks(w) => w.token(text, first, last),
            Self::Responses(w) => w.token(text, first),
            Self::Messages(a) => messages_answer::token(a, text, first, start),
        }
    }

    /// What ends the stream with its usage: chat's usage chunk (asked for by
    /// `include_usage`, which the other APIs always set), or the closing events.
    pub fn usage(&mut self, usage: Usage, timings: Option<Timings>) -> Bytes {
        match self {
            Self::Chunks(w) => w.usage(usage, timings),
            Self::Responses(w) => w.finish(usage),
            Self::Messages(a) => messages_answer::finish(a, usage),
        }
    }

    /// The last event: OpenAI's `[DONE]`, which the typed-event APIs do not send.
    pub fn done(&self) -> Option<Bytes> {
        matches!(self, Self::Chunks(_)).then(|| Bytes::from_static(DONE))
    }
}

/// Marks where a token goes in the pre-rendered middle chunk.
const SLOT: &str = "@@kvbench-token@@";

/// Renders the chunks of one stream. Middle chunks differ only in their text, so they are
/// cut from a template rendered once per stream: hundreds of streams at a 5 ms pace make
/// tens of thousands of chunks a second on two cores.
pub struct ChunkWriter {
    answer: Answer,
    head: String,
    tail: String,
}

impl ChunkWriter {
    pub fn new(answer: Answer) -> Self {
        let template = chunk_json(&answer, SLOT, false, false).to_string();
        let (head, tail) = match template.split_once(SLOT) {
            Some((h, t)) => (format!("data: {h}"), format!("{t}\n\n")),
            None => (String::new(), String::new()),
        };
        Self { answer, head, tail }
    }

    /// The event for one token. `text` must need no JSON escaping (filler words do not).
    pub fn token(&self, text: &str, first: bool, last: bool) -> Bytes {
        if first || last || self.head.is_empty() {
            return event(&chunk_json(&self.answer, text, first, last));
        }
        let mut out = String::with_capacity(self.head.len() + text.len() + self.tail.len());
        out.push_str(&self.head);
        out.push_str(text);
        out.push_str(&self.tail);
        Bytes::from(out)
    }

    /// The final usage chunk (`stream_options.include_usage`): no choices, only usage, and
    /// llama.cpp's `timings` when given.
    pub fn usage(&self, usage: Usage, timings: Option<Timings>) -> Bytes {
        let a = &self.answer;
        let mut chunk = json!({
            "id": a.id,
            "object": chunk_object(a.endpoint),
            "created": a.created,
            "model": a.model,
            "choices": [],
            "usage": usage.to_json(),
        });
        if let Some(t) = timings {
            chunk["timings"] = t.to_json();
        }
        event(&chunk)
    }
}

pub fn sse_response<S>(events: S) -> Response
where
    S: futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
{
    let mut res = Response::new(Body::from_stream(events));
    let headers = res.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    res
}

fn event(chunk: &Value) -> Bytes {
    Bytes::from(format!("data: {chunk}\n\n"))
}

fn chunk_object(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Chat => "chat.completion.chunk",
        _ => "text_completion",
    }
}

fn chunk_json(a: &Answer, text: &str, first: bool, last: bool) -> Value {
    let finish = if last { json!("length") } else { Value::Null };
    let choice = match a.endpoint {
        Endpoint::Chat => {
            let delta = if first {
                json!({"role": "assistant", "content": text})
            } else {
                json!({"content": text})
            };
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        }
        _ => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
    };
    json!({
        "id": a.id,
        "object": chunk_object(a.endpoint),
        "created": a.created,
        "model": a.model,
        "choices": [choice],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_event(b: &Bytes) -> Value {
        let s = std::str::from_utf8(b).unwrap();
        let payload = s
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        assert!(!payload.contains('\n'));
        serde_json::from_str(payload).unwrap()
    }

    #[test]
    fn chat_chunks_parse_back() {
        let w = ChunkWriter::new(Answer::new(Endpoint::Chat, 0, 3, "m"));
        let first = parse_event(&w.token(" tok0", true, false));
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first["choices"][0]["delta"]["content"], " tok0");
        assert!(first["choices"][0]["finish_reason"].is_null());

        let mid = parse_event(&w.token(" tok1", false, false));
        assert_eq!(mid["choices"][0]["delta"]["content"], " tok1");
        assert!(mid["choices"][0]["delta"].get("role").is_none());
        assert_eq!(mid["id"], first["id"]);
        assert_eq!(mid["model"], "m");

        let last = parse_event(&w.token(" tok2", false, true));
        assert_eq!(last["choices"][0]["finish_reason"], "length");

        let usage = parse_event(&w.usage(
            Usage {
                prompt_tokens: 10,
                completion_tokens: 3,
                cached_tokens: 0,
            },
            None,
        ));
        assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
        assert_eq!(usage["usage"]["total_tokens"], 13);
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        assert!(usage.get("timings").is_none());
    }

    #[test]
    fn completion_chunks_parse_back() {
        let w = ChunkWriter::new(Answer::new(Endpoint::Completions, 1, 1, "m"));
        let mid = parse_event(&w.token(" tok5", false, false));
        assert_eq!(mid["object"], "text_completion");
        assert_eq!(mid["choices"][0]["text"], " tok5");
        let only = parse_event(&w.token(" tok0", true, true));
        assert_eq!(only["choices"][0]["finish_reason"], "length");
        assert_eq!(DONE, b"data: [DONE]\n\n");
    }

    #[test]
    fn template_path_is_used_and_matches_slow_path() {
        let a = Answer::new(Endpoint::Chat, 0, 9, "m");
        let w = ChunkWriter::new(a.clone());
        assert!(!w.head.is_empty());
        assert_eq!(
            w.token(" tok3", false, false),
            event(&chunk_json(&a, " tok3", false, false))
        );
    }
}
