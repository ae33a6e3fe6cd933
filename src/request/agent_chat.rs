//! The agent APIs' bodies as the chat requests engines turn them into before applying the
//! model's chat template (vLLM, SGLang and llama-server serve `/v1/responses` and
//! `/v1/messages` that way), so the exact index can tokenize them as the engine does:
//! - Responses: `instructions` as a system message; `input` a user message or items, a
//!   message item as that message (text parts as chat's text parts), a `function_call` as an
//!   assistant message with one tool call, a `function_call_output` as a tool message,
//!   `reasoning` not rendered; flat function `tools` nested as chat's.
//! - Messages: `system` as a system message; each message's `tool_result` blocks as tool
//!   messages before the rest of its turn, `tool_use` blocks as the assistant's tool calls
//!   (arguments: the input's JSON), text blocks as text parts; `tools` with `input_schema` as
//!   chat's `parameters`.
//!
//! Only the messages and tools the template sees are built; nothing here is sent anywhere.
//! A Responses request that continues a stored response has its history on the engine, not in
//! its body: it cannot be tokenized here.

use serde_json::{json, Map, Value};

use super::endpoint::Endpoint;

/// The chat `messages` and `tools` (`Value::Null` for none) an agent API's body stands for.
pub fn to_chat(endpoint: Endpoint, body: &Value) -> Result<(Value, Value), String> {
    match endpoint {
        Endpoint::Responses => responses(body),
        Endpoint::Messages => messages(body),
        _ => Err("not an agent API".into()),
    }
}

/// One entry of an assistant message's `tool_calls`.
fn tool_call(id: &Value, name: &Value, arguments: Value) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

fn field(v: &Value, name: &str) -> Value {
    v.get(name).cloned().unwrap_or(Value::Null)
}

fn responses(body: &Value) -> Result<(Value, Value), String> {
    if body
        .get("previous_response_id")
        .is_some_and(|p| !p.is_null())
    {
        return Err("continues a stored response: its history is on the engine".into());
    }
    let mut out = Vec::new();
    match body.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(_) => return Err("`instructions` is not a string".into()),
    }
    match body.get("input") {
        Some(Value::String(s)) => out.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for item in items {
                if let Some(m) = responses_item(item)? {
                    out.push(m);
                }
            }
        }
        _ => return Err("`input` is not a string or a list of items".into()),
    }
    let tools = match body.get("tools") {
        Some(Value::Array(list)) => Value::Array(
            list.iter()
                .map(|t| match t.get("type").and_then(Value::as_str) {
                    Some("function") if t.get("function").is_none() => json!({
                        "type": "function",
                        "function": {
                            "name": t.get("name"),
                            "description": t.get("description"),
                            "parameters": t.get("parameters"),
                        },
                    }),
                    _ => t.clone(),
                })
                .collect(),
        ),
        _ => Value::Null,
    };
    Ok((Value::Array(out), tools))
}

fn responses_item(item: &Value) -> Result<Option<Value>, String> {
    let kind = item.get("type").and_then(Value::as_str);
    let role = item.get("role").and_then(Value::as_str);
    Ok(match (kind, role) {
        (None | Some("message"), Some(role)) => Some(json!({
            "role": role,
            "content": text_parts(item.get("content"))?,
        })),
        (Some("function_call"), _) => Some(json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [tool_call(&field(item, "call_id"), &field(item, "name"),
                                     field(item, "arguments"))],
        })),
        (Some("function_call_output"), _) => {
            let content = match item.get("output") {
                Some(Value::String(s)) => Value::String(s.clone()),
                Some(parts @ Value::Array(_)) => text_parts(Some(parts))?,
                Some(other) => Value::String(other.to_string()),
                None => Value::Null,
            };
            Some(
                json!({"role": "tool", "tool_call_id": field(item, "call_id"), "content": content}),
            )
        }
        // Reasoning and items the engines do not render.
        _ => None,
    })
}

/// Content as chat's: a string as is, text parts (`input_text`, `output_text`) as text parts,
/// other parts (images, files) whole.
fn text_parts(content: Option<&Value>) -> Result<Value, String> {
    match content {
        Some(Value::String(s)) => Ok(Value::String(s.clone())),
        Some(Value::Array(parts)) => Ok(Value::Array(
            parts
                .iter()
                .map(
                    |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("input_text" | "output_text" | "text"), Some(Value::String(t))) => {
                            json!({"type": "text", "text": t})
                        }
                        _ => p.clone(),
                    },
                )
                .collect(),
        )),
        _ => Err("a message's content is not a string or a list of parts".into()),
    }
}

fn messages(body: &Value) -> Result<(Value, Value), String> {
    let mut out = Vec::new();
    match body.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(blocks @ Value::Array(_)) => {
            let (parts, _, _) = split_blocks(blocks)?;
            out.push(json!({"role": "system", "content": parts}));
        }
        Some(_) => return Err("`system` is not a string or a list of blocks".into()),
    }
    let list = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("no messages list")?;
    for m in list {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or("a message without a role")?;
        match m.get("content") {
            Some(Value::String(s)) => out.push(json!({"role": role, "content": s})),
            Some(blocks @ Value::Array(_)) => {
                let (parts, calls, results) = split_blocks(blocks)?;
                let had_parts = !parts.is_empty();
                out.extend(results);
                if !calls.is_empty() {
                    let content = if had_parts {
                        Value::Array(parts)
                    } else {
                        Value::Null
                    };
                    out.push(json!({"role": role, "content": content, "tool_calls": calls}));
                } else if had_parts || blocks.as_array().is_some_and(Vec::is_empty) {
                    out.push(json!({"role": role, "content": parts}));
                }
            }
            _ => return Err("a message's content is not a string or a list of blocks".into()),
        }
    }
    let tools = match body.get("tools") {
        Some(Value::Array(list)) => Value::Array(
            list.iter()
                .map(|t| {
                    json!({"type": "function", "function": {
                        "name": t.get("name"),
                        "description": t.get("description"),
                        "parameters": t.get("input_schema"),
                    }})
                })
                .collect(),
        ),
        _ => Value::Null,
    };
    Ok((Value::Array(out), tools))
}

/// One message's blocks as chat has them: text parts, tool calls, and tool messages (its tool
/// results).
type Split = (Vec<Value>, Vec<Value>, Vec<Value>);

fn split_blocks(blocks: &Value) -> Result<Split, String> {
    let (mut parts, mut calls, mut results) = (Vec::new(), Vec::new(), Vec::new());
    for b in blocks.as_array().into_iter().flatten() {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => {
                let text = b
                    .get("text")
                    .and_then(Value::as_str)
                    .ok_or("a text block without text")?;
                parts.push(json!({"type": "text", "text": text}));
            }
            Some("tool_use") => {
                let input = b
                    .get("input")
                    .cloned()
                    .unwrap_or_else(|| Value::Object(Map::new()));
                calls.push(tool_call(
                    &field(b, "id"),
                    &field(b, "name"),
                    json!(input.to_string()),
                ));
            }
            Some("tool_result") => {
                let content = match b.get("content") {
                    None | Some(Value::Null) => Value::String(String::new()),
                    Some(Value::String(s)) => Value::String(s.clone()),
                    Some(inner @ Value::Array(_)) => Value::Array(split_blocks(inner)?.0),
                    Some(_) => return Err("a tool_result's content is not text or blocks".into()),
                };
                results.push(
                    json!({"role": "tool", "tool_call_id": field(b, "tool_use_id"),
                                    "content": content}),
                );
            }
            Some(_) => parts.push(b.clone()),
            None => return Err("a content block without a type".into()),
        }
    }
    Ok((parts, calls, results))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_items_become_the_chat_engines_render() {
        let body = json!({"model": "m", "instructions": "sys", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "fix it"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "run",
             "arguments": "{\"command\":\"ls\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.rs"},
        ], "tools": [{"type": "function", "name": "run", "parameters": {"type": "object"}}]});
        let (messages, tools) = to_chat(Endpoint::Responses, &body).unwrap();
        assert_eq!(
            messages,
            json!([
                {"role": "system", "content": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "fix it"}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                 "type": "function", "function": {"name": "run",
                                                  "arguments": "{\"command\":\"ls\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a.rs"},
            ])
        );
        assert_eq!(tools[0]["function"]["name"], "run");
        assert!(tools[0]["function"]["description"].is_null());
        let stored = json!({"model": "m", "previous_response_id": "resp_1", "input": "more"});
        assert!(to_chat(Endpoint::Responses, &stored).is_err());
        let plain = json!({"model": "m", "input": "hi"});
        let (m, t) = to_chat(Endpoint::Responses, &plain).unwrap();
        assert_eq!(
            (m, t),
            (json!([{"role": "user", "content": "hi"}]), Value::Null)
        );
    }

    #[test]
    fn anthropic_blocks_become_the_chat_engines_render() {
        let body = json!({"model": "m", "max_tokens": 8,
            "system": [{"type": "text", "text": "sys"}],
            "messages": [
                {"role": "user", "content": "fix it"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "t1", "name": "run", "input": {"command": "ls"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "a.rs"},
                    {"type": "text", "text": "go on"}]},
            ],
            "tools": [{"name": "run", "description": "Runs", "input_schema": {"type": "object"}}]});
        let (messages, tools) = to_chat(Endpoint::Messages, &body).unwrap();
        assert_eq!(
            messages,
            json!([
                {"role": "system", "content": [{"type": "text", "text": "sys"}]},
                {"role": "user", "content": "fix it"},
                {"role": "assistant", "content": [{"type": "text", "text": "Looking."}],
                 "tool_calls": [{"id": "t1", "type": "function",
                                 "function": {"name": "run", "arguments": "{\"command\":\"ls\"}"}}]},
                {"role": "tool", "tool_call_id": "t1", "content": "a.rs"},
                {"role": "user", "content": [{"type": "text", "text": "go on"}]},
            ])
        );
        assert_eq!(
            tools,
            json!([{"type": "function", "function": {"name": "run", "description": "Runs",
                                                     "parameters": {"type": "object"}}}])
        );
        assert!(to_chat(Endpoint::Messages, &json!({"messages": "x"})).is_err());
        assert!(to_chat(Endpoint::Chat, &body).is_err());
    }
}
