//! Non-streaming answer bodies, in OpenAI's shapes, and llama.cpp's `timings`. The Responses
//! and Messages APIs' bodies are in their own files, and `answer_body` picks one.

use std::sync::Arc;

use serde_json::{json, Value};

use super::response_store::ResponseStore;
use crate::sim::text::ids::random_id;
use crate::sim::text::openai::Endpoint;
use crate::sim::text::responses::ResponsesInput;
use crate::sim::text::tool_call::ToolCall;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

impl Usage {
    pub fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// What llama.cpp adds beside `usage` (in a non-streamed answer and in the stream's usage
/// chunk): the prompt tokens the cache gave and those computed, the output tokens, and how
/// long each took (model milliseconds; the decode time runs from the first token to the last).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timings {
    pub cache_n: u64,
    pub prompt_n: u64,
    pub prompt_ms: f64,
    pub predicted_n: u64,
    pub predicted_ms: f64,
}

impl Timings {
    /// As llama.cpp writes them, with its derived rates (0, not a division by 0, when a count
    /// or a time is 0).
    pub fn to_json(self) -> Value {
        let per_token = |ms: f64, n: u64| if n > 0 { ms / n as f64 } else { 0.0 };
        let per_second = |ms: f64, n: u64| if ms > 0.0 { 1e3 / ms * n as f64 } else { 0.0 };
        json!({
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": per_token(self.prompt_ms, self.prompt_n),
            "prompt_per_second": per_second(self.prompt_ms, self.prompt_n),
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": per_token(self.predicted_ms, self.predicted_n),
            "predicted_per_second": per_second(self.predicted_ms, self.predicted_n),
        })
    }
}

/// Identifies one answer: its id, creation time and the model name it reports.
#[derive(Debug, Clone)]
pub struct Answer {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// A Responses answer's output item and the conversation it stores.
    pub responses: Option<ResponsesAnswer>,
    /// The tool call the answer is, when the request forced one (agent APIs only: a chat
    /// answer is always text).
    pub tool: Option<ToolCall>,
}

#[derive(Debug, Clone)]
pub struct ResponsesAnswer {
    /// The id of the output message item.
    pub msg_id: String,
    pub input: ResponsesInput,
    pub store: Arc<ResponseStore>,
}

impl Answer {
    pub fn new(endpoint: Endpoint, server: usize, seq: u64, model: &str) -> Self {
        let id = match endpoint {
            Endpoint::Chat => format!("chatcmpl-kvbench-{server}-{seq}"),
            Endpoint::Completions => format!("cmpl-kvbench-{server}-{seq}"),
            Endpoint::Embeddings => format!("embd-kvbench-{server}-{seq}"),
            // Their clients send these ids back (`previous_response_id`, maybe through a
            // router to another server), so they are random, as real engines make them.
            Endpoint::Responses => random_id("resp_"),
            Endpoint::Messages => random_id("msg_"),
        };
        Self {
            endpoint,
            id,
            created: unix_now(),
            model: model.to_owned(),
            responses: None,
            tool: None,
        }
    }

    /// An answer that calls tool `name`, when the request forced one and its API can say so.
    pub fn with_tool(mut self, name: Option<&str>) -> Self {
        let prefix = match self.endpoint {
            Endpoint::Responses => "call_",
            Endpoint::Messages => "toolu_",
            _ => return self,
        };
        self.tool = name.map(|n| ToolCall::new(n, prefix));
        if let (Some(r), Some(_)) = (self.responses.as_mut(), &self.tool) {
            r.msg_id = random_id("fc_");
        }
        self
    }

    /// What the next turn sends back of a reply whose text is `text`, when that is not the
    /// text itself: a tool call as the template renders it.
    pub fn rendered_reply(&self, text: &str) -> Option<String> {
        self.tool.as_ref().map(|t| t.rendered(text))
    }

    /// A Responses answer for `input`, stored in `store` once complete if it asks to be.
    pub fn with_responses(
        mut self,
        input: Option<ResponsesInput>,
        store: &Arc<ResponseStore>,
    ) -> Self {
        self.responses = input.map(|input| ResponsesAnswer {
            msg_id: random_id("msg_"),
            input,
            store: store.clone(),
        });
        self
    }

    /// The whole answer; llama.cpp's `timings` beside `usage` when given.
    pub fn completion(&self, text: &str, usage: Usage, timings: Option<Timings>) -> Value {
        let (object, choice) = match self.endpoint {
            Endpoint::Chat => (
                "chat.completion",
                json!({
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": null,
                    "finish_reason": "length",
                }),
            ),
            _ => (
                "text_completion",
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}),
            ),
        };
        let mut v = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage.to_json(),
        });
        if let Some(t) = timings {
            v["timings"] = t.to_json();
        }
        v
    }

    /// A small fixed vector: embeddings exist so the proxy's passthrough can be tested.
    pub fn embeddings(&self, prompt_tokens: u64) -> Value {
        json!({
            "object": "list",
            "data": [{
                "object": "embedding",
                "index": 0,
                "embedding": [0.125, -0.25, 0.5, -0.0625, 0.75, -0.375, 0.1875, 0.0],
            }],
            "model": self.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        })
    }
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_completion_shape() {
        let a = Answer::new(Endpoint::Chat, 2, 7, "m");
        let usage = Usage {
            prompt_tokens: 40,
            completion_tokens: 3,
            cached_tokens: 32,
        };
        let v = a.completion(" tok0 tok1 tok2", usage, None);
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["id"], "chatcmpl-kvbench-2-7");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["total_tokens"], 43);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
        assert!(v.get("timings").is_none());
        let timings = Timings {
            cache_n: 32,
            prompt_n: 8,
            prompt_ms: 40.0,
            predicted_n: 3,
            predicted_ms: 30.0,
        };
        let v = a.completion(" tok0 tok1 tok2", usage, Some(timings));
        let t = &v["timings"];
        assert_eq!(
            (t["cache_n"].as_u64(), t["prompt_n"].as_u64()),
            (Some(32), Some(8))
        );
        assert_eq!(t["prompt_per_token_ms"], 5.0);
        assert_eq!(t["prompt_per_second"], 200.0);
        assert_eq!(t["predicted_per_token_ms"], 10.0);
        assert_eq!(t["predicted_per_second"], 100.0);
        let nothing = Timings {
            prompt_n: 0,
            prompt_ms: 0.0,
            ..timings
        };
        assert_eq!(nothing.to_json()["prompt_per_second"], 0.0);
        assert_eq!(nothing.to_json()["prompt_per_token_ms"], 0.0);
    }

    #[test]
    fn text_completion_shape() {
        let a = Answer::new(Endpoint::Completions, 0, 1, "m");
        let usage = Usage {
            prompt_tokens: 1,
            completion_tokens: 1,
            cached_tokens: 0,
        };
        let v = a.completion(" tok0", usage, None);
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], " tok0");
    }
}
