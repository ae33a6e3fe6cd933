//! OpenAI's Responses API (`POST /v1/responses`) read as the chat request it stands for, as
//! vLLM, SGLang and llama-server render it through the chat template:
//! - `instructions` -> a system message first;
//! - `input`: a string (one user message) or items: messages (`role` and `content`, with or
//!   without `"type":"message"`), `function_call` (an assistant turn carrying one tool call),
//!   `function_call_output` (a tool message); `reasoning` items are kept but not rendered (chat
//!   templates drop earlier turns' reasoning);
//! - `previous_response_id`: the stored conversation (its input items, then its output items)
//!   goes before this request's input.
//!
//! A stored answer's output item renders exactly as chat's assistant message of the same
//! reply, so the next turn's prompt extends this one's prompt and reply, and hits the prefix
//! cache as a chat conversation does.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use super::ids::random_id;
use super::openai::{json_object, optional_bool, optional_u64, parse_value, Endpoint, SimRequest};
pub use super::thread::{ResponsesInput, Thread};
use super::tool_call::chat_tool_call;
use crate::sim::error::ApiError;

/// Parses a Responses body into the chat request it stands for. `previous` finds a stored
/// response's conversation by id.
pub fn parse(
    body: &[u8],
    previous: impl FnOnce(&str) -> Option<Arc<Thread>>,
) -> Result<SimRequest, ApiError> {
    let v = json_object(body)?;
    let previous_response_id = match v.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => Some(id.clone()),
        Some(_) => {
            return Err(
                ApiError::bad_request("'previous_response_id' must be a string")
                    .with_param("previous_response_id"),
            )
        }
    };
    let prior = match &previous_response_id {
        None => None,
        Some(id) => {
            Some(previous(id).ok_or_else(|| not_found(id).with_param("previous_response_id"))?)
        }
    };
    let input = normalise_input(v.get("input"), prior.is_some())?;
    let mut messages = Vec::new();
    match v.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(ApiError::bad_request("'instructions' must be a string")),
    }
    let inherited = prior.as_deref().map_or_else(Vec::new, Thread::items);
    for item in inherited.into_iter().chain(&input) {
        if let Some(m) = chat_message(item)? {
            messages.push(m);
        }
    }
    if messages.is_empty() {
        return Err(ApiError::bad_request("'input' must not be empty").with_param("input"));
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    for field in ["model", "stream", "cache_salt"] {
        if let Some(x) = v.get(field) {
            chat.insert(field.into(), x.clone());
        }
    }
    if let Some(n) = optional_u64(&v, "max_output_tokens")? {
        chat.insert("max_tokens".into(), json!(n));
    }
    if let Some(tools) = v.get("tools").filter(|t| !t.is_null()) {
        chat.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = v.get("tool_choice") {
        // Responses names a function flat (`{"type": "function", "name"}`), chat nested.
        let choice = match choice.get("name") {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => choice.clone(),
        };
        chat.insert("tool_choice".into(), choice);
    }
    let store = match v.get("store") {
        None | Some(Value::Null) => true,
        Some(_) => optional_bool(&v, "store")?,
    };
    let mut req = parse_value(Endpoint::Chat, &Value::Object(chat))?;
    req.endpoint = Endpoint::Responses;
    // The usage always ends the stream, in `response.completed`.
    req.include_usage = true;
    req.responses = Some(ResponsesInput {
        prior,
        input,
        store,
    });
    Ok(req)
}

/// OpenAI's (and vLLM's) answer for an id no stored response has.
pub fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("Response with id '{id}' not found."))
        .with_code("response_not_found")
}

/// `input` as a list of items, each with a `type` and an `id` (as `input_items` lists them).
fn normalise_input(input: Option<&Value>, continued: bool) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        None | Some(Value::Null) if continued => return Ok(Vec::new()),
        None | Some(Value::Null) => {
            return Err(ApiError::bad_request("missing required field 'input'").with_param("input"))
        }
        Some(Value::String(text)) => vec![json!({"role": "user", "content": text})],
        Some(Value::Array(items)) => items.clone(),
        Some(_) => {
            return Err(
                ApiError::bad_request("'input' must be a string or an array of items")
                    .with_param("input"),
            )
        }
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| normalise_item(item, i))
        .collect()
}

fn normalise_item(item: Value, i: usize) -> Result<Value, ApiError> {
    let Value::Object(mut item) = item else {
        return Err(bad_item(i, "must be an object"));
    };
    let kind = match item.get("type") {
        None | Some(Value::Null) if item.contains_key("role") => "message".to_owned(),
        Some(Value::String(t)) => t.clone(),
        _ => return Err(bad_item(i, "needs a 'type' or a 'role'")),
    };
    let prefix = match kind.as_str() {
        "message" => {
            let role = item.get("role").and_then(Value::as_str);
            let Some(role) = role.map(str::to_owned) else {
                return Err(bad_item(i, "is a message without a string 'role'"));
            };
            // As the API lists them: text content as one text part.
            if let Some(Value::String(text)) = item.get("content") {
                let part = if role == "assistant" {
                    "output_text"
                } else {
                    "input_text"
                };
                let content = json!([{"type": part, "text": text}]);
                item.insert("content".into(), content);
            }
            if !matches!(item.get("content"), Some(Value::Array(_))) {
                return Err(bad_item(i, "has no 'content' string or array of parts"));
            }
            "msg_"
        }
        "function_call" => {
            for field in ["call_id", "name", "arguments"] {
                if !item.get(field).is_some_and(Value::is_string) {
                    return Err(bad_item(i, &format!("needs a string '{field}'")));
                }
            }
            "fc_"
        }
        "function_call_output" => {
            if !item.get("call_id").is_some_and(Value::is_string) || !item.contains_key("output") {
                return Err(bad_item(i, "needs a string 'call_id' and an 'output'"));
            }
            "fco_"
        }
        "reasoning" => "rs_",
        other => return Err(bad_item(i, &format!("has unsupported type '{other}'"))),
    };
    item.insert("type".into(), Value::String(kind));
    if !item.get("id").is_some_and(Value::is_string) {
        item.insert("id".into(), Value::String(random_id(prefix)));
    }
    Ok(Value::Object(item))
}

fn bad_item(i: usize, what: &str) -> ApiError {
    ApiError::bad_request(format!("input[{i}] {what}")).with_param("input")
}

/// The chat message a normalised item renders as; None for reasoning, which is not rendered.
fn chat_message(item: &Value) -> Result<Option<Value>, ApiError> {
    let field = |name: &str| item.get(name).cloned().unwrap_or(Value::Null);
    Ok(match item.get("type").and_then(Value::as_str) {
        Some("message") => Some(json!({
            "role": field("role"),
            "content": chat_parts(item.get("content"))?,
        })),
        Some("function_call") => Some(json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [chat_tool_call(field("call_id"), field("name"), field("arguments"))],
        })),
        Some("function_call_output") => {
            let content = match item.get("output") {
                Some(Value::String(s)) => Value::String(s.clone()),
                Some(parts @ Value::Array(_)) => chat_parts(Some(parts))?,
                Some(other) => Value::String(other.to_string()),
                None => Value::Null,
            };
            Some(json!({"role": "tool", "tool_call_id": field("call_id"), "content": content}))
        }
        _ => None,
    })
}

/// Content parts as chat's: text parts (`input_text`, `output_text`) by their text, so a reply
/// renders as it did in chat; others (images, files) stay whole and count by their JSON.
fn chat_parts(content: Option<&Value>) -> Result<Value, ApiError> {
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
        _ => Err(ApiError::bad_request(
            "message content must be a string or an array of parts",
        )),
    }
}

/// Responses' flat function tools as chat's nested ones; other tools (built-in) pass as
/// they are.
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let list = tools
        .as_array()
        .ok_or_else(|| ApiError::bad_request("'tools' must be an array").with_param("tools"))?;
    Ok(Value::Array(
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
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::text::filler::completion_text;
    use crate::sim::text::openai;
    use crate::sim::text::prompt::TURN_END;

    fn none(_: &str) -> Option<Arc<Thread>> {
        None
    }

    fn responses(body: Value) -> Result<SimRequest, ApiError> {
        parse(body.to_string().as_bytes(), none)
    }

    fn chat(body: Value) -> SimRequest {
        openai::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap()
    }

    fn output_item(reply: &str) -> Value {
        json!({"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "annotations": [], "text": reply}]})
    }

    #[test]
    fn a_string_input_is_a_user_message_after_the_instructions() {
        let r = responses(
            json!({"model": "m", "instructions": "be brief", "input": "hi",
                                 "max_output_tokens": 7, "stream": true}),
        )
        .unwrap();
        let c = chat(json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}));
        assert_eq!(r.prompt, c.prompt);
        assert_eq!(
            (r.endpoint, r.max_tokens, r.stream),
            (Endpoint::Responses, 7, true)
        );
        assert!(r.include_usage);
        let input = r.responses.unwrap();
        assert!(input.store && input.prior.is_none());
        assert_eq!(input.input[0]["type"], "message");
        assert_eq!(input.input[0]["content"][0]["type"], "input_text");
        assert!(input.input[0]["id"].as_str().unwrap().starts_with("msg_"));
    }

    #[test]
    fn items_render_as_the_chat_they_stand_for() {
        let r = responses(json!({"model": "m", "store": false, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"},
                                         {"type": "input_image", "image_url": "data:x"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "message", "role": "assistant", "content": "It is sunny."},
        ], "tools": [{"type": "function", "name": "get", "parameters": {}}]}))
        .unwrap();
        let c = chat(json!({"model": "m", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "weather?"},
                                         {"type": "input_image", "image_url": "data:x"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ], "tools": [{"type": "function",
                      "function": {"name": "get", "description": null, "parameters": {}}}]}));
        assert_eq!(r.prompt, c.prompt);
        let input = r.responses.unwrap();
        assert!(!input.store);
        assert_eq!(input.input.len(), 5);
        assert_eq!(input.input[1]["id"], "rs_1");
        assert!(input.input[2]["id"].as_str().unwrap().starts_with("fc_"));
    }

    #[test]
    fn previous_response_goes_first_and_the_next_turn_extends_prompt_and_reply() {
        let turn1 =
            responses(json!({"model": "m", "instructions": "sys", "input": "question"})).unwrap();
        let reply = completion_text(9);
        let thread = Arc::new(Thread {
            prior: None,
            input: turn1.responses.clone().unwrap().input,
            output: vec![output_item(&reply)],
        });
        let body = json!({"model": "m", "instructions": "sys", "previous_response_id": "resp_1",
                          "input": [{"role": "user", "content": "more"}]});
        let turn2 = parse(body.to_string().as_bytes(), |id| {
            (id == "resp_1").then(|| thread.clone())
        })
        .unwrap();
        let mut expected = turn1.prompt.clone();
        expected.extend_from_slice(reply.as_bytes());
        expected.extend_from_slice(TURN_END.as_bytes());
        assert!(turn2.prompt.starts_with(&expected));
        // Sending the whole history instead of the id renders the same prompt.
        let stateless = responses(json!({"model": "m", "instructions": "sys", "input": [
            {"role": "user", "content": "question"}, output_item(&reply),
            {"role": "user", "content": "more"}]}))
        .unwrap();
        assert_eq!(stateless.prompt, turn2.prompt);
        let input = turn2.responses.unwrap();
        assert!(input.prior.is_some());
        let next = Thread {
            prior: input.prior,
            input: input.input,
            output: vec![],
        };
        let listed = next.input_items();
        assert_eq!(listed.len(), 3);
        assert_eq!(listed[1]["role"], "assistant");
    }

    #[test]
    fn an_unknown_previous_response_is_a_404() {
        let e = responses(json!({"model": "m", "input": "x", "previous_response_id": "resp_x"}))
            .unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::NOT_FOUND);
        let body = e.body();
        assert_eq!(
            body["error"]["message"],
            "Response with id 'resp_x' not found."
        );
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "previous_response_id");
        assert_eq!(body["error"]["code"], "response_not_found");
    }

    #[test]
    fn bad_bodies_are_400s() {
        for body in [
            json!({"model": "m"}),
            json!({"model": "m", "input": 5}),
            json!({"model": "m", "input": []}),
            json!({"model": "m", "input": ["x"]}),
            json!({"model": "m", "input": [{"type": "function_call", "name": "f"}]}),
            json!({"model": "m", "input": [{"type": "web_search_call"}]}),
            json!({"model": "m", "input": [{"role": "user", "content": 3}]}),
            json!({"model": "m", "input": "x", "instructions": 1}),
            json!({"model": "m", "input": "x", "store": "yes"}),
            json!({"model": "m", "input": "x", "max_output_tokens": 0}),
            json!({"input": "x"}),
        ] {
            let e = responses(body.clone()).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{body}");
        }
    }
}
