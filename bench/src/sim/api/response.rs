//! Non-streaming answer bodies, in OpenAI's shapes.

use serde_json::{json, Value};

use crate::sim::text::openai::Endpoint;

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

/// Identifies one answer: its id, creation time and the model name it reports.
#[derive(Debug, Clone)]
pub struct Answer {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Answer {
    pub fn new(endpoint: Endpoint, server: usize, seq: u64, model: &str) -> Self {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
            Endpoint::Embeddings => "embd",
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Self {
            endpoint,
            id: format!("{prefix}-kvbench-{server}-{seq}"),
            created,
            model: model.to_owned(),
        }
    }

    pub fn completion(&self, text: &str, usage: Usage) -> Value {
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
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage.to_json(),
        })
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
        let v = a.completion(" tok0 tok1 tok2", usage);
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["id"], "chatcmpl-kvbench-2-7");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["total_tokens"], 43);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    }

    #[test]
    fn text_completion_shape() {
        let a = Answer::new(Endpoint::Completions, 0, 1, "m");
        let usage = Usage {
            prompt_tokens: 1,
            completion_tokens: 1,
            cached_tokens: 0,
        };
        let v = a.completion(" tok0", usage);
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], " tok0");
    }
}
