//! Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) read as the
//! chat request it stands for, as vLLM, SGLang and llama-server convert it:
//! - `system` (a string or text blocks) -> a system message first;
//! - each message's blocks: `text` as text, `tool_use` as the assistant's tool calls,
//!   `tool_result` as tool messages (before the rest of that user turn), and anything else
//!   (`image`, `thinking`, `document`) as a part counted by its JSON.
//!
//! An assistant message of the reply's text renders exactly as chat's, so the next turn's
//! prompt extends this one's prompt and reply.

use serde_json::{json, Map, Value};

use super::openai::{json_object, optional_u64, parse_value, Endpoint, SimRequest};
use super::tool_call::chat_tool_call;
use crate::sim::error::ApiError;

/// Parses a Messages body. `max_tokens` is required for generation, as Anthropic's API
/// requires it, and not for counting tokens.
pub fn parse(body: &[u8], generation: bool) -> Result<SimRequest, ApiError> {
    let v = json_object(body)?;
    let max_tokens = optional_u64(&v, "max_tokens")?;
    if generation && max_tokens.is_none() {
        // Anthropic's words.
        return Err(ApiError::bad_request("max_tokens: Field required"));
    }
    let mut messages = Vec::new();
    match v.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(blocks @ Value::Array(_)) => {
            let parts = split_blocks(blocks, "system")?.parts;
            messages.push(json!({"role": "system", "content": parts}));
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                "system: must be a string or an array of text blocks",
            ))
        }
    }
    let list = match v.get("messages") {
        Some(Value::Array(list)) if !list.is_empty() => list,
        Some(Value::Array(_)) => return Err(ApiError::bad_request("messages: must not be empty")),
        None | Some(Value::Null) => return Err(ApiError::bad_request("messages: Field required")),
        Some(_) => return Err(ApiError::bad_request("messages: must be an array")),
    };
    for (i, m) in list.iter().enumerate() {
        push_message(m, i, &mut messages)?;
    }
    let mut chat = Map::new();
    // A final assistant message is the reply's start, which the model goes on from
    // (Anthropic's prefill): rendered unclosed, as chat's `continue_final_message`.
    if list
        .last()
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        == Some("assistant")
    {
        chat.insert("continue_final_message".into(), Value::Bool(true));
        chat.insert("add_generation_prompt".into(), Value::Bool(false));
    }
    chat.insert("messages".into(), Value::Array(messages));
    for field in ["model", "stream"] {
        if let Some(x) = v.get(field) {
            chat.insert(field.into(), x.clone());
        }
    }
    // Counting generates nothing; one token keeps the chat parser's bounds satisfied.
    chat.insert("max_tokens".into(), json!(max_tokens.unwrap_or(1)));
    if let Some(tools) = v.get("tools").and_then(Value::as_array) {
        let tools: Vec<Value> = tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": t.get("name"),
                    "description": t.get("description"),
                    "parameters": t.get("input_schema"),
                }})
            })
            .collect();
        chat.insert("tools".into(), Value::Array(tools));
    }
    if let Some(choice) = v.get("tool_choice") {
        chat.insert("tool_choice".into(), chat_tool_choice(choice)?);
    }
    let mut req = parse_value(Endpoint::Chat, &Value::Object(chat))?;
    req.endpoint = Endpoint::Messages;
    // The usage always ends the stream, in `message_delta`.
    req.include_usage = true;
    Ok(req)
}

/// Anthropic's `tool_choice` as chat's: `any` forces a call, `tool` a named one.
fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    Ok(match (choice["type"].as_str(), choice.get("name")) {
        (Some("any"), _) => json!("required"),
        (Some("tool"), Some(name)) => json!({"type": "function", "function": {"name": name}}),
        (Some(kind @ ("auto" | "none")), _) => json!(kind),
        _ => {
            return Err(ApiError::bad_request(
                "tool_choice: must be {\"type\": \"auto\" | \"any\" | \"none\"} or \
                 {\"type\": \"tool\", \"name\": ...}",
            ))
        }
    })
}

/// One Anthropic message as chat messages: its tool results first, then the turn itself.
fn push_message(m: &Value, i: usize, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let role = m
        .get("role")
        .and_then(Value::as_str)
        .filter(|r| matches!(*r, "user" | "assistant"))
        .ok_or_else(|| {
            ApiError::bad_request(format!("messages.{i}.role: must be 'user' or 'assistant'"))
        })?;
    match m.get("content") {
        Some(Value::String(s)) => out.push(json!({"role": role, "content": s})),
        Some(blocks @ Value::Array(_)) => {
            let Blocks {
                parts,
                tool_calls: calls,
                results,
            } = split_blocks(blocks, &format!("messages.{i}"))?;
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
        _ => {
            return Err(ApiError::bad_request(format!(
                "messages.{i}.content: must be a string or an array of content blocks"
            )))
        }
    }
    Ok(())
}

/// One message's content blocks, as chat has them.
#[derive(Default)]
struct Blocks {
    parts: Vec<Value>,
    tool_calls: Vec<Value>,
    /// Tool messages.
    results: Vec<Value>,
}

fn split_blocks(blocks: &Value, at: &str) -> Result<Blocks, ApiError> {
    let Blocks {
        mut parts,
        tool_calls: mut calls,
        mut results,
    } = Blocks::default();
    for (j, b) in blocks.as_array().into_iter().flatten().enumerate() {
        let bad = |what: &str| ApiError::bad_request(format!("{at}.content.{j}: {what}"));
        match (b.get("type").and_then(Value::as_str), b) {
            (Some("text"), _) => {
                let text = b.get("text").and_then(Value::as_str);
                let text = text.ok_or_else(|| bad("a text block needs a string 'text'"))?;
                parts.push(json!({"type": "text", "text": text}));
            }
            (Some("tool_use"), _) => {
                let id = b.get("id").and_then(Value::as_str);
                let name = b.get("name").and_then(Value::as_str);
                let (Some(id), Some(name)) = (id, name) else {
                    return Err(bad("a tool_use block needs a string 'id' and 'name'"));
                };
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(chat_tool_call(
                    json!(id),
                    json!(name),
                    json!(input.to_string()),
                ));
            }
            (Some("tool_result"), _) => {
                let id = b.get("tool_use_id").and_then(Value::as_str);
                let id = id.ok_or_else(|| bad("a tool_result block needs a 'tool_use_id'"))?;
                let content = match b.get("content") {
                    None | Some(Value::Null) => Value::String(String::new()),
                    Some(Value::String(s)) => Value::String(s.clone()),
                    Some(inner @ Value::Array(_)) => {
                        Value::Array(split_blocks(inner, &format!("{at}.content.{j}"))?.parts)
                    }
                    Some(_) => return Err(bad("tool_result content must be a string or blocks")),
                };
                results.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            (Some(_), Value::Object(_)) => parts.push(b.clone()),
            _ => return Err(bad("a content block must be an object with a 'type'")),
        }
    }
    Ok(Blocks {
        parts,
        tool_calls: calls,
        results,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::text::filler::completion_text;
    use crate::sim::text::openai;
    use crate::sim::text::prompt::TURN_END;
    use axum::http::StatusCode;

    fn messages(body: Value) -> Result<SimRequest, ApiError> {
        parse(body.to_string().as_bytes(), true)
    }

    fn chat(messages: Value) -> Vec<u8> {
        let body = json!({"model": "m", "messages": messages});
        openai::parse(Endpoint::Chat, body.to_string().as_bytes())
            .unwrap()
            .prompt
    }

    #[test]
    fn system_and_text_render_as_chat() {
        let r = messages(json!({"model": "m", "max_tokens": 5, "stream": true,
            "metadata": {"user_id": "u1"},
            "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
            "messages": [{"role": "user", "content": "hi"}]}))
        .unwrap();
        let c = chat(json!([{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hi"}]));
        assert_eq!(r.prompt, c);
        assert_eq!(
            (r.endpoint, r.max_tokens, r.stream),
            (Endpoint::Messages, 5, true)
        );
        assert!(r.include_usage && r.responses.is_none());
    }

    #[test]
    fn tool_use_and_results_render_as_chat_tool_calls() {
        let r = messages(json!({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "weather?"},
                {"type": "image", "source": {"type": "base64", "data": "AAAA"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "get", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "thanks"}]},
        ]}))
        .unwrap();
        let c = chat(json!([
            {"role": "user", "content": [{"type": "text", "text": "weather?"},
                {"type": "image", "source": {"type": "base64", "data": "AAAA"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Let me look."}],
             "tool_calls": [{"id": "t1", "type": "function",
                "function": {"name": "get", "arguments": "{\"city\":\"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
            {"role": "user", "content": [{"type": "text", "text": "thanks"}]},
        ]));
        assert_eq!(r.prompt, c);
    }

    #[test]
    fn next_turn_extends_prompt_and_reply() {
        let q = json!({"role": "user", "content": "question"});
        let turn1 = messages(json!({"model": "m", "max_tokens": 9, "system": "s",
                                    "messages": [q]}))
        .unwrap();
        let reply = completion_text(9);
        let turn2 = messages(
            json!({"model": "m", "max_tokens": 9, "system": "s", "messages": [
            q, {"role": "assistant", "content": [{"type": "text", "text": reply}]},
            {"role": "user", "content": "more"}]}),
        )
        .unwrap();
        let mut expected = turn1.prompt;
        expected.extend_from_slice(reply.as_bytes());
        expected.extend_from_slice(TURN_END.as_bytes());
        assert!(turn2.prompt.starts_with(&expected));
    }

    #[test]
    fn max_tokens_is_required_for_generation_only() {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        let e = messages(body.clone()).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("max_tokens"));
        assert!(parse(body.to_string().as_bytes(), false).is_ok());
    }

    #[test]
    fn bad_bodies_are_400s() {
        for body in [
            json!({"model": "m", "max_tokens": 1}),
            json!({"model": "m", "max_tokens": 1, "messages": []}),
            json!({"model": "m", "max_tokens": 1, "messages": [{"role": "bot", "content": "x"}]}),
            json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": 1}]}),
            json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [1]}]}),
            json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user",
                   "content": [{"type": "tool_result"}]}]}),
            json!({"model": "m", "max_tokens": 1, "system": 3,
                   "messages": [{"role": "user", "content": "x"}]}),
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}),
        ] {
            let e = messages(body.clone()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
        }
    }
}
