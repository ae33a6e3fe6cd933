//! Forced tool calls. An agent's turn is a tool call: Codex and Claude Code send their tools
//! and the model answers with one. The simulator answers with a call when the request forces
//! one (`tool_choice` "required" or a named function in chat and Responses, `{"type": "any"}`
//! or `{"type": "tool"}` in Messages), to the named tool or the first listed; otherwise it
//! answers text. The call's one argument holds the generated filler, so its length is still
//! `max_tokens`, and the engine caches the call as the next turn renders it, as real engines
//! cache the tokens of the call they generated.

use serde_json::{json, Value};

use super::ids::random_id;
use super::prompt::template_json;
use crate::sim::error::ApiError;

/// One tool call the answer makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub call_id: String,
}

/// The arguments' JSON around the generated text, which needs no escaping (filler words).
pub const ARGS_OPEN: &str = "{\"command\":\"";
pub const ARGS_CLOSE: &str = "\"}";

impl ToolCall {
    /// A call to `name` with a fresh id (`call_` in Responses, `toolu_` in Messages).
    pub fn new(name: &str, id_prefix: &str) -> Self {
        Self {
            name: name.to_owned(),
            call_id: random_id(id_prefix),
        }
    }

    /// The call's arguments when the model generated `text`.
    pub fn arguments(text: &str) -> String {
        json!({ "command": text }).to_string()
    }

    /// The call as the chat template renders it when the client sends it back: the cached
    /// reply, which the next turn's prompt continues with.
    pub fn rendered(&self, text: &str) -> String {
        let call = chat_tool_call(
            json!(self.call_id),
            json!(self.name),
            json!(Self::arguments(text)),
        );
        template_json(&Value::Array(vec![call]))
    }
}

/// One entry of a chat message's `tool_calls`, as every API's converter writes it: the same
/// call renders the same bytes whichever API sent it back.
pub fn chat_tool_call(id: Value, name: Value, arguments: Value) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// The tool a chat body's `tool_choice` forces, from its `tools`: None when the model may
/// answer text.
pub fn forced(body: &Value) -> Result<Option<String>, ApiError> {
    let tools = body.get("tools").and_then(Value::as_array);
    let first = tools
        .and_then(|t| t.first())
        .and_then(|t| t["function"]["name"].as_str());
    match body.get("tool_choice") {
        Some(Value::String(s)) if s == "required" => first
            .map(|n| Some(n.to_owned()))
            .ok_or_else(|| ApiError::bad_request("tool_choice 'required' needs 'tools'")),
        Some(Value::Object(o)) => match o.get("function").and_then(|f| f.get("name")) {
            Some(Value::String(name)) => {
                let listed = tools
                    .into_iter()
                    .flatten()
                    .any(|t| t["function"]["name"].as_str() == Some(name));
                if listed {
                    Ok(Some(name.clone()))
                } else {
                    Err(ApiError::bad_request(format!(
                        "tool_choice names '{name}', which is not in 'tools'"
                    )))
                }
            }
            _ => Err(ApiError::bad_request(
                "tool_choice must be 'none', 'auto', 'required' or name a function",
            )),
        },
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_tool_from_tool_choice() {
        let tools = json!([{"type": "function", "function": {"name": "run"}},
                           {"type": "function", "function": {"name": "read"}}]);
        let with = |choice: Value| forced(&json!({"tools": tools, "tool_choice": choice}));
        assert_eq!(with(json!("required")).unwrap().as_deref(), Some("run"));
        assert_eq!(with(json!("auto")).unwrap(), None);
        let named = json!({"type": "function", "function": {"name": "read"}});
        assert_eq!(with(named).unwrap().as_deref(), Some("read"));
        let unknown = json!({"type": "function", "function": {"name": "rm"}});
        assert!(with(unknown).is_err());
        assert!(forced(&json!({"tool_choice": "required"})).is_err());
        assert_eq!(forced(&json!({"tools": tools})).unwrap(), None);
    }

    #[test]
    fn arguments_are_the_text_between_open_and_close() {
        let text = " tok0 tok1";
        assert_eq!(
            ToolCall::arguments(text),
            format!("{ARGS_OPEN}{text}{ARGS_CLOSE}")
        );
        let call = ToolCall::new("run", "call_");
        assert!(call.call_id.starts_with("call_"));
        let rendered: Value = serde_json::from_str(&call.rendered(text)).unwrap();
        assert_eq!(
            rendered[0]["function"]["arguments"],
            ToolCall::arguments(text)
        );
        assert_eq!(rendered[0]["id"], call.call_id.as_str());
    }
}
