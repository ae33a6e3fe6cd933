//! Anthropic's Messages API (`POST /v1/messages`), reduced to the canonical prompt a chat
//! writes: `system` as a system message, then each message's role and content blocks.

use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;

use super::canon::{write_message_content, Canon};
use super::session::BodyKeys;
use super::text::Decoded;
use super::{bad, Conversation, ReplyMode};
use crate::error::ApiError;

#[derive(Deserialize)]
pub(super) struct Body<'a, const FAST: bool> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    system: Option<Decoded<'a, FAST>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a, FAST>>>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    metadata: Option<Metadata<'a>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Message<'a, const FAST: bool> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<Decoded<'a, FAST>>,
}

#[derive(Deserialize)]
struct Metadata<'a> {
    #[serde(borrow, default)]
    user_id: Option<Cow<'a, str>>,
}

impl<const FAST: bool> Body<'_, FAST> {
    pub(super) fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

pub(super) fn reduce<'a, const FAST: bool>(
    parsed: &'a Body<'a, FAST>,
    canon: &mut Canon,
    reply: Option<&str>,
) -> Result<Conversation<'a>, ApiError> {
    let messages = match &parsed.messages {
        Some(m) if !m.is_empty() => m,
        Some(_) => return Err(bad("invalid_messages", "`messages` must not be empty")),
        None => return Err(bad("missing_messages", "`messages` is required")),
    };
    // Anthropic's API requires it; an engine would refuse the request anyway, and the cost
    // model needs it.
    let max_tokens = parsed
        .max_tokens
        .ok_or_else(|| bad("missing_max_tokens", "`max_tokens` is required"))?;
    if let Some(tools) = parsed.tools {
        canon.field(tools.get().as_bytes());
    }
    if let Some(system) = &parsed.system {
        canon.field(b"system");
        write_message_content::<FAST>(canon, Some(&system.0), "system")?;
    }
    let mut key = None;
    let last_reply = messages.iter().rposition(|m| m.role == "assistant");
    let mut history_blocks = 0;
    for (i, m) in messages.iter().enumerate() {
        if Some(i) == last_reply {
            history_blocks = canon.blocks.full_blocks();
        }
        canon.field(m.role.as_bytes());
        write_message_content::<FAST>(
            canon,
            m.content.as_ref().map(|c| &c.0),
            &format!("messages[{i}].content"),
        )?;
        if key.is_none() && m.role == "user" {
            key = canon.seal_session();
        }
    }
    let content_key = key.or_else(|| canon.seal_session()).unwrap_or_default();
    if let Some(r) = reply {
        canon.field(b"assistant");
        canon.field(r.as_bytes());
    }
    Ok(Conversation {
        stream: parsed.stream.unwrap_or(false),
        include_usage: false,
        has_stream_options: false,
        has_handover_fields: false,
        max_output: Some(max_tokens),
        body_keys: BodyKeys {
            metadata_user_id: parsed.metadata.as_ref().and_then(|m| m.user_id.as_deref()),
            ..BodyKeys::default()
        },
        content_key,
        has_history: last_reply.is_some(),
        history_blocks,
        reply_mode: ReplyMode::Chat,
        previous_response_id: None,
    })
}
