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
/// The body is taken apart, not copied: an agent's history is most of it.
pub fn to_chat(endpoint: Endpoint, body: Value) -> Result<(Value, Value), String> {
    let Value::Object(body) = body else {
        return Err("the body is not a JSON object".into());
    };
    match endpoint {
        Endpoint::Responses => responses(body),
        Endpoint::Messages => messages(body),
        _ => Err("not an agent API".into()),
    }
}

/// One entry of an assistant message's `tool_calls`.
fn tool_call(id: Value, name: Value, arguments: Value) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

fn take(v: &mut Map<String, Value>, name: &str) -> Value {
    v.remove(name).unwrap_or(Value::Null)
}

fn responses(mut body: Map<String, Value>) -> Result<(Value, Value), String> {
    if !take(&mut body, "previous_response_id").is_null() {
        return Err("continues a stored response: its history is on the engine".into());
    }
    let mut out = Vec::new();
    match take(&mut body, "instructions") {
        Value::Null => {}
        s @ Value::String(_) => out.push(json!({"role": "system", "content": s})),
        _ => return Err("`instructions` is not a string".into()),
    }
    match take(&mut body, "input") {
        s @ Value::String(_) => out.push(json!({"role": "user", "content": s})),
        Value::Array(items) => {
            for item in items {
                if let Some(m) = responses_item(item)? {
                    out.push(m);
                }
            }
        }
        _ => return Err("`input` is not a string or a list of items".into()),
    }
    let tools = match take(&mut body, "tools") {
        Value::Array(list) => Value::Array(
            list.into_iter()
                .map(|t| {
                    let flat = t.get("type").and_then(Value::as_str) == Some("function")
                        && t.get("function").is_none();
                    match t {
                        Value::Object(mut f) if flat => json!({
                            "type": "function",
                            "function": {
                                "name": take(&mut f, "name"),
                                "description": take(&mut f, "description"),
                                "parameters": take(&mut f, "parameters"),
                            },
                        }),
                        t => t,
                    }
                })
                .collect(),
        ),
        _ => Value::Null,
    };
    Ok((Value::Array(out), tools))
}

fn responses_item(item: Value) -> Result<Option<Value>, String> {
    let Value::Object(mut item) = item else {
        return Ok(None);
    };
    let kind = item.get("type").and_then(Value::as_str).map(str::to_owned);
    let is_role = item.get("role").is_some_and(Value::is_string);
    Ok(match (kind.as_deref(), is_role) {
        (None | Some("message"), true) => {
            let content = text_parts(take(&mut item, "content"))?;
            Some(json!({"role": take(&mut item, "role"), "content": content}))
        }
        (Some("function_call"), _) => {
            let call = tool_call(
                take(&mut item, "call_id"),
                take(&mut item, "name"),
                take(&mut item, "arguments"),
            );
            Some(json!({"role": "assistant", "content": null, "tool_calls": [call]}))
        }
        (Some("function_call_output"), _) => {
            let content = match item.remove("output") {
                Some(parts @ Value::Array(_)) => text_parts(parts)?,
                Some(s @ Value::String(_)) => s,
                Some(other) => Value::String(other.to_string()),
                None => Value::Null,
            };
            let id = take(&mut item, "call_id");
            Some(json!({"role": "tool", "tool_call_id": id, "content": content}))
        }
        // Reasoning and items the engines do not render.
        _ => None,
    })
}

/// Content as chat's: a string as is, text parts (`input_text`, `output_text`) as text parts,
/// other parts (images, files) whole.
fn text_parts(content: Value) -> Result<Value, String> {
    match content {
        s @ Value::String(_) => Ok(s),
        Value::Array(parts) => Ok(Value::Array(
            parts
                .into_iter()
                .map(|mut p| {
                    let text = matches!(
                        p.get("type").and_then(Value::as_str),
                        Some("input_text" | "output_text" | "text")
                    ) && p.get("text").is_some_and(Value::is_string);
                    match p.as_object_mut().filter(|_| text) {
                        Some(part) => json!({"type": "text", "text": take(part, "text")}),
                        None => p,
                    }
                })
                .collect(),
        )),
        _ => Err("a message's content is not a string or a list of parts".into()),
    }
}

fn messages(mut body: Map<String, Value>) -> Result<(Value, Value), String> {
    let mut out = Vec::new();
    match take(&mut body, "system") {
        Value::Null => {}
        s @ Value::String(_) => out.push(json!({"role": "system", "content": s})),
        blocks @ Value::Array(_) => {
            let (parts, _, _) = split_blocks(blocks)?;
            out.push(json!({"role": "system", "content": parts}));
        }
        _ => return Err("`system` is not a string or a list of blocks".into()),
    }
    let Value::Array(list) = take(&mut body, "messages") else {
        return Err("no messages list".into());
    };
    for m in list {
        let Value::Object(mut m) = m else {
            return Err("a message is not an object".into());
        };
        let role = take(&mut m, "role");
        if !role.is_string() {
            return Err("a message without a role".into());
        }
        match take(&mut m, "content") {
            s @ Value::String(_) => out.push(json!({"role": role, "content": s})),
            Value::Array(blocks) => {
                let empty = blocks.is_empty();
                let (parts, calls, results) = split_blocks(Value::Array(blocks))?;
                let had_parts = !parts.is_empty();
                out.extend(results);
                if !calls.is_empty() {
                    let content = if had_parts {
                        Value::Array(parts)
                    } else {
                        Value::Null
                    };
                    out.push(json!({"role": role, "content": content, "tool_calls": calls}));
                } else if had_parts || empty {
                    out.push(json!({"role": role, "content": parts}));
                }
            }
            _ => return Err("a message's content is not a string or a list of blocks".into()),
        }
    }
    let tools = match take(&mut body, "tools") {
        Value::Array(list) => Value::Array(
            list.into_iter()
                .map(|t| {
                    let mut t = match t {
                        Value::Object(t) => t,
                        _ => Map::new(),
                    };
                    json!({"type": "function", "function": {
                        "name": take(&mut t, "name"),
                        "description": take(&mut t, "description"),
                        "parameters": take(&mut t, "input_schema"),
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

fn split_blocks(blocks: Value) -> Result<Split, String> {
    let (mut parts, mut calls, mut results) = (Vec::new(), Vec::new(), Vec::new());
    let Value::Array(blocks) = blocks else {
        return Ok((parts, calls, results));
    };
    for b in blocks {
        let kind = b.get("type").and_then(Value::as_str).map(str::to_owned);
        let Value::Object(mut f) = b else {
            return Err("a content block without a type".into());
        };
        match kind.as_deref() {
            Some("text") => {
                let text = take(&mut f, "text");
                if !text.is_string() {
                    return Err("a text block without text".into());
                }
                parts.push(json!({"type": "text", "text": text}));
            }
            Some("tool_use") => {
                let input = f
                    .remove("input")
                    .map_or_else(|| "{}".to_owned(), |i| i.to_string());
                let call = tool_call(take(&mut f, "id"), take(&mut f, "name"), json!(input));
                calls.push(call);
            }
            Some("tool_result") => {
                let content = match take(&mut f, "content") {
                    Value::Null => Value::String(String::new()),
                    s @ Value::String(_) => s,
                    inner @ Value::Array(_) => Value::Array(split_blocks(inner)?.0),
                    _ => return Err("a tool_result's content is not text or blocks".into()),
                };
                let id = take(&mut f, "tool_use_id");
                results.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            Some(_) => parts.push(Value::Object(f)),
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
        let (messages, tools) = to_chat(Endpoint::Responses, body.clone()).unwrap();
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
        assert!(to_chat(Endpoint::Responses, stored).is_err());
        let plain = json!({"model": "m", "input": "hi"});
        let (m, t) = to_chat(Endpoint::Responses, plain).unwrap();
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
        let (messages, tools) = to_chat(Endpoint::Messages, body.clone()).unwrap();
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
        assert!(to_chat(Endpoint::Messages, json!({"messages": "x"})).is_err());
        assert!(to_chat(Endpoint::Chat, body).is_err());
    }
}
