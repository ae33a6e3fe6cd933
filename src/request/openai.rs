//! OpenAI's chat completions and completions bodies, reduced to the canonical prompt.

use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;

use super::canon::{floor_char_boundary, keyed, write_content, Canon};
use super::session::BodyKeys;
use super::text::{self, Decoded};
use super::{bad, Conversation, Endpoint, ReplyMode, COMPLETIONS_KEY_BYTES};
use crate::error::ApiError;

/// `FAST`: message text is read on the fast path ([`text`]).
#[derive(Deserialize)]
pub(super) struct Body<'a, const FAST: bool> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a, FAST>>>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
    /// Read only for whether they are there: a client's own never reach an engine.
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a RawValue>,
    #[serde(borrow, default)]
    bootstrap_host: Option<&'a RawValue>,
    #[serde(borrow, default)]
    bootstrap_port: Option<&'a RawValue>,
    #[serde(borrow, default)]
    bootstrap_room: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
pub(super) struct Message<'a, const FAST: bool> {
    #[serde(borrow)]
    pub role: Cow<'a, str>,
    #[serde(borrow, default)]
    pub content: Option<Decoded<'a, FAST>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

impl<'a, const FAST: bool> Body<'a, FAST> {
    pub(super) fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    pub(super) fn cache_salt(&self) -> Option<&str> {
        self.cache_salt.as_deref()
    }
}

/// Writes a chat's or a completions prompt's canonical stream after the model (and `reply`
/// after it, when given), and says what else the body holds.
pub(super) fn reduce<'a, const FAST: bool>(
    endpoint: Endpoint,
    parsed: &'a Body<'a, FAST>,
    canon: &mut Canon,
    reply: Option<&str>,
) -> Result<Conversation<'a>, ApiError> {
    let model = parsed.model.as_deref().unwrap_or_default();
    if let Some(tools) = parsed.tools {
        canon.field(&xxhash_rust::xxh3::xxh3_64(tools.get().as_bytes()).to_le_bytes());
    }
    let mut conv = Conversation {
        stream: parsed.stream.unwrap_or(false),
        has_stream_options: parsed.stream_options.is_some(),
        has_handover_fields: parsed.kv_transfer_params.is_some()
            || parsed.bootstrap_host.is_some()
            || parsed.bootstrap_port.is_some()
            || parsed.bootstrap_room.is_some(),
        include_usage: parsed
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        max_output: parsed.max_completion_tokens.or(parsed.max_tokens),
        body_keys: BodyKeys {
            user: parsed.user.as_deref(),
            prompt_cache_key: parsed.prompt_cache_key.as_deref(),
            metadata_user_id: None,
        },
        content_key: 0,
        has_history: false,
        history_blocks: 0,
        reply_mode: ReplyMode::Chat,
        previous_response_id: None,
    };
    match endpoint {
        Endpoint::Completions => {
            let prompt = parsed
                .prompt
                .ok_or_else(|| bad("missing_prompt", "`prompt` is required"))?;
            conv.reply_mode = write_prompt::<FAST>(canon, prompt, reply)?;
            conv.content_key = completions_key(model, prompt);
        }
        _ => {
            let messages = match &parsed.messages {
                Some(m) if !m.is_empty() => m,
                Some(_) => return Err(bad("invalid_messages", "`messages` must not be empty")),
                None => return Err(bad("missing_messages", "`messages` is required")),
            };
            let mut key = None;
            let last_reply = messages.iter().rposition(|m| m.role == "assistant");
            conv.has_history = last_reply.is_some();
            for (i, m) in messages.iter().enumerate() {
                if Some(i) == last_reply {
                    conv.history_blocks = canon.blocks.full_blocks();
                }
                canon.field(m.role.as_bytes());
                write_content(canon, m.content.as_ref().map(|c| &c.0), i)?;
                if let Some(calls) = m.tool_calls {
                    canon.field(&xxhash_rust::xxh3::xxh3_64(calls.get().as_bytes()).to_le_bytes());
                }
                if key.is_none() && m.role == "user" {
                    key = canon.seal_session();
                }
            }
            // A conversation with no user message yet keys on all it has.
            conv.content_key = key.or_else(|| canon.seal_session()).unwrap_or_default();
            if let Some(r) = reply {
                canon.field(b"assistant");
                canon.field(r.as_bytes());
            }
        }
    }
    Ok(conv)
}

fn completions_key(model: &str, prompt: &RawValue) -> u64 {
    let prompt = prompt.get();
    let end = floor_char_boundary(prompt, COMPLETIONS_KEY_BYTES);
    keyed(model, b"c", &prompt.as_bytes()[..end])
}

fn write_prompt<const FAST: bool>(
    canon: &mut Canon,
    prompt: &RawValue,
    reply: Option<&str>,
) -> Result<ReplyMode, ApiError> {
    let text = prompt.get();
    let invalid = || {
        bad(
            "invalid_prompt",
            "`prompt` must be a string, a list of strings, a list of token ids, or a list of token-id lists",
        )
    };
    match text.as_bytes().first() {
        Some(b'"') => {
            let s = text::string::<FAST>(text).ok_or_else(invalid)?;
            match reply {
                // The next prompt is this one continued, so nothing (no field separator) may
                // follow the text: the prompt's stream must be a prefix of prompt + reply.
                // Found by fuzzing (fuzz/): a separator completing a block broke the prefix.
                Some(r) => {
                    canon.write(&s);
                    canon.write(r.as_bytes());
                }
                None => canon.write(&s),
            }
            Ok(ReplyMode::Continue)
        }
        Some(b'[') => {
            let items: Vec<&RawValue> = serde_json::from_str(text).map_err(|_| invalid())?;
            for item in items {
                let t = item.get();
                match t.as_bytes().first() {
                    Some(b'"') => {
                        let s = text::string::<FAST>(t).ok_or_else(invalid)?;
                        canon.field(&s);
                    }
                    Some(b'[') => {
                        let ids: Vec<u32> = serde_json::from_str(t).map_err(|_| invalid())?;
                        write_ids(canon, &ids);
                        canon.field(b"");
                    }
                    _ => {
                        let id: u32 = serde_json::from_str(t).map_err(|_| invalid())?;
                        write_ids(canon, &[id]);
                    }
                }
            }
            Ok(ReplyMode::None)
        }
        _ => Err(invalid()),
    }
}

fn write_ids(canon: &mut Canon, ids: &[u32]) {
    for id in ids {
        canon.write(&id.to_le_bytes());
    }
    canon.token_ids += ids.len() as u64;
}
