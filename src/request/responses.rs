//! OpenAI's Responses API (`POST /v1/responses`), reduced to the canonical prompt a chat
//! writes: `instructions` as a system message, then each input item. A message item is a
//! chat message; the model's own items (function calls, reasoning) and tool outputs are
//! written by kind, so an agent's next turn, which sends them back, extends this one.

use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;

use super::canon::{write_message_content, write_value, Canon};
use super::session::BodyKeys;
use super::text::{self, Decoded};
use super::{bad, Conversation, ReplyMode};
use crate::error::ApiError;

#[derive(Deserialize)]
pub(super) struct Body<'a, const FAST: bool> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    instructions: Option<Decoded<'a, FAST>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    previous_response_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
}

/// One input item. Which fields mean something depends on its `type`.
#[derive(Deserialize)]
struct Item<'a, const FAST: bool> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Decoded<'a, FAST>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    arguments: Option<Cow<'a, str>>,
    /// A custom tool call's input (free text).
    #[serde(borrow, default)]
    input: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    output: Option<&'a RawValue>,
    #[serde(borrow, default)]
    summary: Option<&'a RawValue>,
    #[serde(borrow, default)]
    encrypted_content: Option<Cow<'a, str>>,
}

impl<const FAST: bool> Body<'_, FAST> {
    pub(super) fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

impl<const FAST: bool> Item<'_, FAST> {
    fn is_message(&self) -> bool {
        self.role.is_some() && self.kind.as_deref().is_none_or(|k| k == "message")
    }

    /// Written by the model (and sent back by the client in later turns): what a turn's
    /// reply is made of.
    fn is_model_output(&self) -> bool {
        if self.is_message() {
            return self.role.as_deref() == Some("assistant");
        }
        self.kind
            .as_deref()
            .is_some_and(|k| k == "reasoning" || k.ends_with("_call"))
    }
}

fn write_item<const FAST: bool>(
    canon: &mut Canon,
    item: &Item<FAST>,
    i: usize,
) -> Result<(), ApiError> {
    let what = || format!("input[{i}]");
    if item.is_message() {
        canon.field(item.role.as_deref().unwrap_or("").as_bytes());
        return write_message_content::<FAST>(canon, item.content.as_ref().map(|c| &c.0), &what());
    }
    let kind = item.kind.as_deref().ok_or_else(|| {
        bad(
            "invalid_input",
            format!("{}: an item needs a `type` or a `role`", what()),
        )
    })?;
    canon.write(&[0x1e]);
    canon.field(kind.as_bytes());
    for f in [&item.name, &item.arguments, &item.input]
        .into_iter()
        .flatten()
    {
        canon.field(f.as_bytes());
    }
    if let Some(o) = item.output {
        write_value::<FAST>(canon, o, &what(), 0)?;
    }
    if let Some(s) = item.summary {
        write_value::<FAST>(canon, s, &what(), 0)?;
    }
    if let Some(e) = &item.encrypted_content {
        canon.write(&xxhash_rust::xxh3::xxh3_64(e.as_bytes()).to_le_bytes());
    }
    canon.field(b"");
    Ok(())
}

pub(super) fn reduce<'a, const FAST: bool>(
    parsed: &'a Body<'a, FAST>,
    canon: &mut Canon,
    reply: Option<&str>,
) -> Result<Conversation<'a>, ApiError> {
    let input = parsed
        .input
        .ok_or_else(|| bad("missing_input", "`input` is required"))?;
    if let Some(tools) = parsed.tools {
        canon.field(tools.get().as_bytes());
    }
    if let Some(instructions) = &parsed.instructions {
        canon.field(b"system");
        write_message_content::<FAST>(canon, Some(&instructions.0), "instructions")?;
    }
    let mut key = None;
    let mut history_blocks = 0;
    let mut has_history = parsed.previous_response_id.is_some();
    let invalid = || {
        bad(
            "invalid_input",
            "`input` must be a string or a list of input items",
        )
    };
    match input.get().as_bytes().first() {
        Some(b'"') => {
            let t = text::string::<FAST>(input.get()).ok_or_else(invalid)?;
            canon.field(b"user");
            canon.field(&t);
            key = canon.seal_session();
        }
        Some(b'[') => {
            let items: Vec<Item<FAST>> = serde_json::from_str(input.get())
                .map_err(|e| bad("invalid_input", format!("`input`: {e}")))?;
            if items.is_empty() {
                return Err(bad("invalid_input", "`input` must not be empty"));
            }
            // The previous turn's prompt ends where its reply starts: the last run of the
            // model's own items.
            let reply_start = items.iter().rposition(Item::is_model_output).map(|last| {
                let mut start = last;
                while start > 0 && items[start - 1].is_model_output() {
                    start -= 1;
                }
                start
            });
            has_history |= reply_start.is_some();
            for (i, item) in items.iter().enumerate() {
                if Some(i) == reply_start {
                    history_blocks = canon.blocks.full_blocks();
                }
                write_item(canon, item, i)?;
                if key.is_none() && item.is_message() && item.role.as_deref() == Some("user") {
                    key = canon.seal_session();
                }
            }
        }
        _ => return Err(invalid()),
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
        max_output: parsed.max_output_tokens,
        body_keys: BodyKeys {
            user: parsed.user.as_deref(),
            prompt_cache_key: parsed.prompt_cache_key.as_deref(),
            metadata_user_id: None,
        },
        content_key,
        has_history,
        history_blocks,
        reply_mode: ReplyMode::Chat,
        previous_response_id: parsed.previous_response_id.as_deref(),
    })
}
