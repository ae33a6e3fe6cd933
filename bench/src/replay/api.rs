//! Which API a workload's conversations speak: chat completions, or the agent APIs (OpenAI's
//! Responses, Anthropic's Messages) with the same conversation in their bodies, as Codex and
//! Claude Code send it (the system prompt as `instructions` / `system`, the turns as input
//! items / messages). `mixed` sends half the sessions through each agent API.

use serde_json::{json, Value};

use super::record::{ChatRequest, Message};

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
        let agent = &req.agent;
        let (system, turns) = match req.messages.split_first() {
            Some((first, rest)) if first.role == "system" => (Some(&first.content), rest),
            _ => (None, &req.messages[..]),
        };
        match self {
            Wire::Chat => {
                let mut b = json!({
                    "model": model,
                    "messages": req.messages.iter().map(chat_message).collect::<Vec<_>>(),
                    "max_tokens": req.max_tokens,
                    "ignore_eos": true,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                });
                if agent.tools {
                    b["tools"] = tools(|t| json!({"type": "function", "function": t}));
                }
                b
            }
            Wire::Responses => {
                // A stored previous answer holds everything up to it: send what follows.
                let (input, previous) = match &agent.previous {
                    Some((id, from)) => (req.messages.get(*from..).unwrap_or(&[]), Some(id)),
                    None => (turns, None),
                };
                let items: Vec<Value> = input.iter().flat_map(responses_items).collect();
                let mut b = json!({
                    "model": model, "input": items, "max_output_tokens": req.max_tokens,
                    "stream": true, "store": agent.store,
                });
                if let Some(id) = previous {
                    b["previous_response_id"] = json!(id);
                }
                if let Some(s) = system {
                    b["instructions"] = json!(s);
                }
                if agent.tools {
                    b["tools"] = tools(|mut t| {
                        t["type"] = json!("function");
                        t
                    });
                    b["tool_choice"] = json!("required");
                }
                b
            }
            Wire::Messages => {
                let mut b = json!({
                    "model": model,
                    "messages": turns.iter().map(anthropic_message).collect::<Vec<_>>(),
                    "max_tokens": req.max_tokens,
                    "stream": true,
                });
                if let Some(s) = system {
                    b["system"] = json!(s);
                }
                if agent.tools {
                    b["tools"] = tools(|mut t| {
                        if let Some(p) = t.as_object_mut().and_then(|o| o.remove("parameters")) {
                            t["input_schema"] = p;
                        }
                        t
                    });
                    b["tool_choice"] = json!({"type": "any"});
                }
                b
            }
        }
    }
}

/// The coding agent's tools, each as `shape` writes a `{name, description, parameters}`.
fn tools(shape: impl Fn(Value) -> Value) -> Value {
    let param = |name: &str| json!({"type": "object", "properties": {name: {"type": "string"}}, "required": [name]});
    let list = [
        (
            "run",
            "Runs a shell command in the repository and returns its output.",
            "command",
        ),
        ("read", "Reads a file and returns its contents.", "path"),
        ("grep", "Searches the repository for a pattern.", "pattern"),
        ("edit", "Replaces a file's contents.", "path"),
    ];
    Value::Array(
        list.iter()
            .map(|(name, description, arg)| {
                shape(json!({"name": name, "description": description, "parameters": param(arg)}))
            })
            .collect(),
    )
}

fn chat_message(m: &Message) -> Value {
    match (&m.call, m.role.as_str()) {
        (Some(c), "assistant") => json!({
            "role": "assistant",
            "content": (!m.content.is_empty()).then_some(&m.content),
            "tool_calls": [{"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments}}],
        }),
        (Some(c), "tool") => json!({"role": "tool", "tool_call_id": c.id, "content": m.content}),
        _ => json!({"role": m.role, "content": m.content}),
    }
}

/// A message as Responses input items: a tool call is a `function_call` item, its result a
/// `function_call_output`.
fn responses_items(m: &Message) -> Vec<Value> {
    match (&m.call, m.role.as_str()) {
        (Some(c), "assistant") => {
            let mut items = Vec::new();
            if !m.content.is_empty() {
                items.push(json!({"role": "assistant", "content": m.content}));
            }
            let mut call = json!({"type": "function_call", "call_id": c.id, "name": c.name,
                                  "arguments": c.arguments});
            if let Some(item) = &c.item_id {
                call["id"] = json!(item);
            }
            items.push(call);
            items
        }
        (Some(c), "tool") => {
            vec![json!({"type": "function_call_output", "call_id": c.id, "output": m.content})]
        }
        _ => vec![json!({"role": m.role, "content": m.content})],
    }
}

/// A message as Anthropic's: a tool call is a `tool_use` block of the assistant's turn, its
/// result a `tool_result` block of the user's.
fn anthropic_message(m: &Message) -> Value {
    match (&m.call, m.role.as_str()) {
        (Some(c), "assistant") => {
            let mut blocks = Vec::new();
            if !m.content.is_empty() {
                blocks.push(json!({"type": "text", "text": m.content}));
            }
            // The streamed arguments are JSON; a cut stream's are not, and go as a string.
            let input = serde_json::from_str::<Value>(&c.arguments)
                .unwrap_or_else(|_| json!({"arguments": c.arguments}));
            blocks.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input}));
            json!({"role": "assistant", "content": blocks})
        }
        (Some(c), "tool") => json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": c.id, "content": m.content}]}),
        _ => json!({"role": m.role, "content": m.content}),
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
            agent: Default::default(),
            tenancy: Default::default(),
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

    #[test]
    fn tool_calls_and_results_in_each_apis_spelling() {
        use crate::replay::record::{AgentTurn, ToolCall};
        let call = ToolCall {
            id: "call_1".into(),
            name: "run".into(),
            arguments: r#"{"command":"ls"}"#.into(),
            item_id: Some("fc_1".into()),
        };
        let req = ChatRequest {
            messages: vec![
                Message::new("system", "manual"),
                Message::new("user", "task"),
                Message {
                    call: Some(call.clone()),
                    ..Message::new("assistant", "")
                },
                Message {
                    call: Some(call),
                    ..Message::new("tool", "a.rs b.rs")
                },
            ],
            max_tokens: 8,
            session: Some("task-1".into()),
            model: None,
            step: None,
            turn: Some(1),
            oracle_hit: 0.0,
            oracle_total: 0.0,
            agent: AgentTurn {
                tools: true,
                ..AgentTurn::default()
            },
            tenancy: Default::default(),
        };
        let r = Wire::Responses.body(&req, "m");
        assert_eq!(
            r["input"][1],
            json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "run",
                   "arguments": "{\"command\":\"ls\"}"})
        );
        assert_eq!(
            r["input"][2],
            json!({"type": "function_call_output", "call_id": "call_1", "output": "a.rs b.rs"})
        );
        assert_eq!(
            (&r["tool_choice"], &r["tools"][0]["type"]),
            (&json!("required"), &json!("function"))
        );
        assert_eq!(r["tools"][0]["parameters"]["required"], json!(["command"]));
        let m = Wire::Messages.body(&req, "m");
        assert_eq!(
            m["messages"][1],
            json!({"role": "assistant", "content": [{"type": "tool_use", "id": "call_1",
                   "name": "run", "input": {"command": "ls"}}]})
        );
        assert_eq!(
            m["messages"][2],
            json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                   "content": "a.rs b.rs"}]})
        );
        assert_eq!(m["tool_choice"], json!({"type": "any"}));
        assert!(
            m["tools"][3]["input_schema"].is_object() && m["tools"][3].get("parameters").is_none()
        );
        let c = Wire::Chat.body(&req, "m");
        assert_eq!(c["messages"][2]["tool_calls"][0]["function"]["name"], "run");
        assert_eq!(
            c["messages"][3],
            json!({"role": "tool", "tool_call_id": "call_1",
                                            "content": "a.rs b.rs"})
        );
        assert!(c.get("tool_choice").is_none());
        // Stored: the previous answer's id and only what follows it.
        let mut stored = req.clone();
        stored.agent.store = true;
        stored.agent.previous = Some(("resp_9".into(), 3));
        let r = Wire::Responses.body(&stored, "m");
        assert_eq!(
            (&r["previous_response_id"], &r["store"]),
            (&json!("resp_9"), &json!(true))
        );
        assert_eq!(r["input"].as_array().unwrap().len(), 1);
        assert_eq!(r["input"][0]["type"], "function_call_output");
        assert_eq!(r["instructions"], "manual");
    }
}
