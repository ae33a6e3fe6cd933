//! Which API a workload's conversations speak: chat completions, or the agent APIs (OpenAI's
//! Responses, Anthropic's Messages) with the same conversation in their bodies, as Codex and
//! Claude Code send it (the system prompt as `instructions` / `system`, the turns as input
//! items / messages). `mixed` sends half the sessions through each agent API.

use serde_json::{json, Value};

use super::record::ChatRequest;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    #[default]
    Chat,
    Responses,
    Messages,
    /// Each session through Responses or Messages, by its id (half and half).
    Mixed,
}

/// The API one request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    Chat,
    Responses,
    Messages,
}

impl Api {
    /// The API of a request of `session` (request `id` when it has none).
    pub fn wire(self, session: Option<&str>, id: u64) -> Wire {
        match self {
            Api::Chat => Wire::Chat,
            Api::Responses => Wire::Responses,
            Api::Messages => Wire::Messages,
            Api::Mixed => {
                let h = session.map_or(id, |s| xxhash_rust::xxh3::xxh3_64(s.as_bytes()));
                if h % 2 == 0 {
                    Wire::Responses
                } else {
                    Wire::Messages
                }
            }
        }
    }
}

impl Wire {
    pub fn path(self) -> &'static str {
        match self {
            Wire::Chat => "/v1/chat/completions",
            Wire::Responses => "/v1/responses",
            Wire::Messages => "/v1/messages",
        }
    }

    /// The streamed request body for `req` in this API.
    pub fn body(self, req: &ChatRequest, model: &str) -> Value {
        if self == Wire::Chat {
            return json!({
                "model": model,
                "messages": req.messages,
                "max_tokens": req.max_tokens,
                "ignore_eos": true,
                "stream": true,
                "stream_options": {"include_usage": true},
            });
        }
        let (system, turns) = match req.messages.split_first() {
            Some((first, rest)) if first.role == "system" => (Some(&first.content), rest),
            _ => (None, &req.messages[..]),
        };
        match self {
            Wire::Responses => {
                let mut b = json!({
                    "model": model, "input": turns, "max_output_tokens": req.max_tokens,
                    "stream": true, "store": false,
                });
                if let Some(s) = system {
                    b["instructions"] = json!(s);
                }
                b
            }
            _ => {
                let mut b = json!({
                    "model": model, "messages": turns, "max_tokens": req.max_tokens,
                    "stream": true,
                });
                if let Some(s) = system {
                    b["system"] = json!(s);
                }
                b
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::record::Message;

    #[test]
    fn one_conversation_in_each_apis_body() {
        let req = ChatRequest {
            messages: vec![
                Message::new("system", "manual"),
                Message::new("user", "task"),
                Message::new("assistant", "read(a)"),
                Message::new("user", "output"),
            ],
            max_tokens: 8,
            session: Some("task-1".into()),
            model: None,
            step: None,
            turn: Some(1),
            oracle_hit: 0.0,
            oracle_total: 0.0,
        };
        let r = Wire::Responses.body(&req, "m");
        assert_eq!(r["instructions"], "manual");
        assert_eq!(r["input"].as_array().unwrap().len(), 3);
        assert_eq!(
            (r["max_output_tokens"].as_u64(), &r["store"]),
            (Some(8), &json!(false))
        );
        let m = Wire::Messages.body(&req, "m");
        assert_eq!(m["system"], "manual");
        assert_eq!(
            m["messages"][2],
            json!({"role": "user", "content": "output"})
        );
        assert_eq!(m["max_tokens"], 8);
        let c = Wire::Chat.body(&req, "m");
        assert_eq!(c["messages"].as_array().unwrap().len(), 4);
        // Mixed: a session keeps its API; sessions split between the two.
        let wires: Vec<Wire> = (0..40)
            .map(|i| Api::Mixed.wire(Some(&format!("task-{i}")), 0))
            .collect();
        assert_eq!(Api::Mixed.wire(Some("task-3"), 1), wires[3]);
        let responses = wires.iter().filter(|w| **w == Wire::Responses).count();
        assert!((10..=30).contains(&responses), "{responses}");
    }
}
