//! Parsing of OpenAI request bodies into what the simulator needs to serve them. The
//! Responses and Anthropic Messages bodies (`responses`, `anthropic`) are first converted to
//! the chat request they stand for, then parsed here as chat, so every API shares one prompt.

use serde_json::Value;

use super::filler::trailing_reply;
use super::prompt::{is_token_ids, render_chat_continued, render_completion, render_tools};
use super::tool_call;
use crate::sim::error::ApiError;

pub const DEFAULT_MAX_TOKENS: u64 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    Embeddings,
    /// OpenAI's Responses API, served as the chat request it converts to.
    Responses,
    /// Anthropic's Messages API, likewise.
    Messages,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
        }
    }

    /// Whether the prompt went through the chat template, so the reply comes back as an
    /// assistant turn in the next one.
    pub fn is_chat(self) -> bool {
        matches!(
            self,
            Endpoint::Chat | Endpoint::Responses | Endpoint::Messages
        )
    }
}

#[derive(Debug, Clone)]
pub struct SimRequest {
    pub endpoint: Endpoint,
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
    /// Output length: always exactly this many tokens (as with `ignore_eos`).
    pub max_tokens: u64,
    /// Canonical prompt bytes (see `prompt`).
    pub prompt: Vec<u8>,
    /// The prompt was sent as token ids: `prompt` is already a token stream.
    pub token_ids: bool,
    /// vLLM's `cache_salt`: only requests with the same salt share cached blocks.
    pub cache_salt: Option<String>,
    /// A Responses request: the conversation's input items, to store with its answer.
    pub responses: Option<super::thread::ResponsesInput>,
    /// The tool the reply must call (`tool_choice`), if the request forces one.
    pub tool_call: Option<String>,
    /// The reply's first token: a request continuing a reply's start (see `trailing_reply`)
    /// is answered from where that start ends.
    pub first_token: u64,
    /// Chat's `continue_final_message`: the last message is a reply's start to go on with.
    pub continues: bool,
}

pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<SimRequest, ApiError> {
    parse_value(endpoint, &json_object(body)?)
}

/// The body as a JSON object, or the 400 every API answers for anything else.
pub fn json_object(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request("request body must be a JSON object"));
    }
    Ok(v)
}

/// Parses a body already read as a JSON object. `Responses` and `Messages` bodies must have
/// been converted to chat first; they parse as `Chat`.
pub fn parse_value(endpoint: Endpoint, v: &Value) -> Result<SimRequest, ApiError> {
    let model = match v.get("model") {
        Some(Value::String(m)) => m.clone(),
        Some(_) => return Err(ApiError::bad_request("'model' must be a string")),
        None => return Err(ApiError::bad_request("missing required field 'model'")),
    };
    let mut continues = false;
    let (prompt, token_ids, first_token) = match endpoint {
        Endpoint::Chat | Endpoint::Responses | Endpoint::Messages => {
            // vLLM's rule and words.
            let continue_final = optional_bool(v, "continue_final_message")?;
            continues = continue_final;
            if continue_final && v.get("add_generation_prompt") == Some(&Value::Bool(true)) {
                return Err(ApiError::bad_request(
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                ));
            }
            let messages = required(v, "messages")?;
            let mut prompt = render_tools(v.get("tools"))?;
            prompt.extend(render_chat_continued(messages, continue_final)?);
            let last = messages.as_array().and_then(|m| m.last());
            let first = match last.and_then(|m| m.get("content")).and_then(Value::as_str) {
                Some(text) if continue_final => trailing_reply(text),
                _ => 0,
            };
            (prompt, false, first)
        }
        Endpoint::Completions | Endpoint::Embeddings => {
            let field = if endpoint == Endpoint::Completions {
                "prompt"
            } else {
                "input"
            };
            let p = required(v, field)?;
            let first = match p {
                Value::String(text) if endpoint == Endpoint::Completions => trailing_reply(text),
                _ => 0,
            };
            (render_completion(p)?, is_token_ids(p), first)
        }
    };
    let stream = optional_bool(v, "stream")?;
    let include_usage = match v.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(opts @ Value::Object(_)) => optional_bool(opts, "include_usage")?,
        Some(_) => return Err(ApiError::bad_request("'stream_options' must be an object")),
    };
    // The newer name wins when a client sends both, as in OpenAI's API.
    let max_tokens = match optional_u64(v, "max_completion_tokens")? {
        Some(n) => n,
        None => optional_u64(v, "max_tokens")?.unwrap_or(DEFAULT_MAX_TOKENS),
    };
    if max_tokens == 0 {
        return Err(ApiError::bad_request("max_tokens must be at least 1"));
    }
    // vLLM's own check and message.
    let cache_salt = match v.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "Parameter 'cache_salt' must be a non-empty string if provided.",
            ))
        }
    };
    let tool_call = match endpoint {
        Endpoint::Completions | Endpoint::Embeddings => None,
        _ => tool_call::forced(v)?,
    };
    Ok(SimRequest {
        endpoint,
        model,
        stream,
        include_usage,
        max_tokens,
        prompt,
        token_ids,
        cache_salt,
        responses: None,
        tool_call,
        first_token,
        continues,
    })
}

pub(super) fn required<'a>(v: &'a Value, field: &str) -> Result<&'a Value, ApiError> {
    match v.get(field) {
        None | Some(Value::Null) => Err(ApiError::bad_request(format!(
            "missing required field '{field}'"
        ))),
        Some(x) => Ok(x),
    }
}

pub(super) fn optional_bool(v: &Value, field: &str) -> Result<bool, ApiError> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_request(format!(
            "'{field}' must be a boolean"
        ))),
    }
}

pub(super) fn optional_u64(v: &Value, field: &str) -> Result<Option<u64>, ApiError> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_u64().map(Some).ok_or_else(|| {
            ApiError::bad_request(format!("'{field}' must be a non-negative integer"))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<SimRequest, ApiError> {
        parse(Endpoint::Chat, body.as_bytes())
    }

    #[test]
    fn parses_a_streaming_chat_request() {
        let r = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,
                "stream_options":{"include_usage":true},"max_tokens":7,"ignore_eos":true}"#,
        )
        .unwrap();
        assert_eq!(r.model, "m");
        assert!(r.stream && r.include_usage);
        assert_eq!(r.max_tokens, 7);
    }

    #[test]
    fn defaults_and_max_completion_tokens() {
        let r = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        assert_eq!(r.max_tokens, DEFAULT_MAX_TOKENS);
        assert!(!r.stream);
        let r = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":3,"max_completion_tokens":9}"#,
        )
        .unwrap();
        assert_eq!(r.max_tokens, 9);
    }

    #[test]
    fn completions_need_a_prompt() {
        let r = parse(Endpoint::Completions, br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.prompt.len(), 12);
        let e = parse(Endpoint::Completions, br#"{"model":"m"}"#).unwrap_err();
        assert!(e.message.contains("prompt"));
    }

    #[test]
    fn errors_are_400s() {
        for body in [
            "not json",
            "[1]",
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":5,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"m"}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":"yes"}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":1}"#,
        ] {
            let e = chat(body).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{body}");
        }
    }
}
