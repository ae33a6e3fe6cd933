//! The canonical prompt: the byte stream every API's body reduces to (model, tools, then each
//! message's role and content, fields separated by 0x1f), cut into chained block hashes, and the
//! conversation's opening hashed into its content key on the way. Turn n+1 of a conversation
//! writes turn n's bytes first, whichever API it speaks.

use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use xxhash_rust::xxh3::Xxh3;

use super::text::Content;
use super::{bad, BlockHasher, CHAT_KEY_MAX_BYTES};
use crate::error::ApiError;

/// Writes the canonical byte stream to the block hasher and, until the affinity prefix is
/// complete, to the session hasher.
pub(super) struct Canon {
    pub(super) blocks: BlockHasher,
    session: Option<Xxh3>,
    /// Bytes the session hash has taken (at most [`CHAT_KEY_MAX_BYTES`]).
    session_bytes: usize,
    pub(super) bytes: usize,
    pub(super) token_ids: u64,
    /// The canonical text itself, kept for token counting while it fits `text_limit`.
    pub(super) text: Option<Vec<u8>>,
    text_limit: usize,
}

impl Canon {
    pub(super) fn new(block_bytes: usize, body_len: usize, text_limit: usize, seed: u64) -> Self {
        let mut blocks = BlockHasher::seeded(block_bytes, seed);
        blocks.reserve_for(body_len);
        Canon {
            blocks,
            session: Some(Xxh3::new()),
            session_bytes: 0,
            bytes: 0,
            token_ids: 0,
            text: (text_limit > 0).then(|| Vec::with_capacity(body_len.min(text_limit))),
            text_limit,
        }
    }

    pub(super) fn write(&mut self, data: &[u8]) {
        self.blocks.write(data);
        self.bytes += data.len();
        if let Some(t) = self.text.as_mut() {
            if t.len() + data.len() > self.text_limit {
                self.text = None;
            } else {
                t.extend_from_slice(data);
            }
        }
        if let Some(s) = self.session.as_mut() {
            let take = data
                .len()
                .min(CHAT_KEY_MAX_BYTES.saturating_sub(self.session_bytes));
            s.update(&data[..take]);
            self.session_bytes += take;
        }
    }

    /// Separator bytes keep `("ab","c")` and `("a","bc")` apart.
    pub(super) fn field(&mut self, data: &[u8]) {
        self.write(data);
        self.write(&[0x1f]);
    }

    pub(super) fn seal_session(&mut self) -> Option<u64> {
        self.session.take().map(|s| s.digest())
    }
}

#[derive(Deserialize)]
pub(super) struct Part<'a> {
    #[serde(borrow, default, rename = "type")]
    pub(super) kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) text: Option<Cow<'a, str>>,
}

pub(super) fn keyed(model: &str, tag: &[u8], value: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(model.as_bytes());
    h.update(&[0x1f]);
    h.update(tag);
    h.update(value);
    h.digest()
}

pub(super) fn floor_char_boundary(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    let mut i = max;
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

pub(super) fn write_content(
    canon: &mut Canon,
    content: Option<&Content>,
    idx: usize,
) -> Result<(), ApiError> {
    match content {
        None => canon.field(b""),
        Some(Content::Text(s)) => canon.field(s),
        Some(Content::Parts(parts)) => {
            for part in parts {
                let p: Part = serde_json::from_str(part.get()).map_err(|e| {
                    bad(
                        "invalid_messages",
                        format!("messages[{idx}].content part: {e}"),
                    )
                })?;
                match (p.kind.as_deref(), p.text) {
                    (Some("text") | None, Some(t)) => canon.write(t.as_bytes()),
                    // Images, audio, files: identified by the hash of their JSON.
                    _ => canon
                        .write(&xxhash_rust::xxh3::xxh3_64(part.get().as_bytes()).to_le_bytes()),
                }
            }
            canon.field(b"");
        }
    }
    Ok(())
}

/// Writes a message's content, text or content blocks, and closes its field.
pub(super) fn write_message_content<const FAST: bool>(
    canon: &mut Canon,
    content: Option<&Content>,
    what: &str,
) -> Result<(), ApiError> {
    match content {
        None => {}
        Some(Content::Text(t)) => canon.write(t),
        Some(Content::Parts(blocks)) => write_blocks::<FAST>(canon, blocks, what, 0)?,
    }
    canon.field(b"");
    Ok(())
}

/// One content block of Anthropic's Messages API or one part of the Responses API; also a
/// reply's block and stream delta, read by the usage tap.
#[derive(Deserialize)]
pub(super) struct Block<'a> {
    #[serde(borrow, default, rename = "type")]
    pub(super) kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    thinking: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    /// A streamed `tool_use`'s input, piece by piece (a reply's `input_json_delta`).
    #[serde(borrow, default)]
    pub(super) partial_json: Option<Cow<'a, str>>,
}

/// How deep a block may nest blocks (a tool result holds text and images, nothing deeper).
const MAX_BLOCK_DEPTH: usize = 2;

/// Writes content `blocks`: text as text, bare, so that the reply sent back as the next
/// turn's assistant message continues the stream as a chat's does; tool calls and tool
/// results by their text too, since they are most of an agent's prompt and of its cost;
/// anything else (images, documents, signed or redacted thinking) by the hash of its JSON.
/// Fields a client moves from turn to turn (Anthropic's `cache_control`) are not written, so
/// they do not break the prefix.
pub(super) fn write_blocks<const FAST: bool>(
    canon: &mut Canon,
    blocks: &[&RawValue],
    what: &str,
    depth: usize,
) -> Result<(), ApiError> {
    for (i, raw) in blocks.iter().enumerate() {
        let b: Block = serde_json::from_str(raw.get())
            .map_err(|e| bad("invalid_content", format!("{what}[{i}]: {e}")))?;
        let kind = b.kind.as_deref().unwrap_or("text");
        if let ("text" | "input_text" | "output_text" | "summary_text", Some(t)) = (kind, &b.text) {
            canon.write(t.as_bytes());
            continue;
        }
        // Marks where a structured block starts, so that no text could spell one.
        canon.write(&[0x1e]);
        canon.field(kind.as_bytes());
        match kind {
            "thinking" => canon.field(b.thinking.as_deref().unwrap_or("").as_bytes()),
            "tool_use" | "server_tool_use" => {
                canon.field(b.name.as_deref().unwrap_or("").as_bytes());
                let input = b.input.map_or("", |v| v.get());
                canon.field(super::reply::canonical_json(input).as_bytes());
            }
            "tool_result" if depth < MAX_BLOCK_DEPTH => {
                if let Some(c) = b.content {
                    write_value::<FAST>(canon, c, what, depth + 1)?;
                }
                canon.field(b"");
            }
            _ => canon.field(&xxhash_rust::xxh3::xxh3_64(raw.get().as_bytes()).to_le_bytes()),
        }
    }
    Ok(())
}

/// Writes a value that is either a string (its text) or a list of blocks.
pub(super) fn write_value<const FAST: bool>(
    canon: &mut Canon,
    value: &RawValue,
    what: &str,
    depth: usize,
) -> Result<(), ApiError> {
    let raw = value.get();
    match raw.as_bytes().first() {
        Some(b'"') => {
            let t = super::text::string::<FAST>(raw).ok_or_else(|| {
                bad(
                    "invalid_content",
                    format!("{what}: not a valid JSON string"),
                )
            })?;
            canon.write(&t);
            Ok(())
        }
        Some(b'[') => {
            let blocks: Vec<&RawValue> = serde_json::from_str(raw)
                .map_err(|e| bad("invalid_content", format!("{what}: {e}")))?;
            write_blocks::<FAST>(canon, &blocks, what, depth)
        }
        Some(b'n') => Ok(()),
        _ => Err(bad(
            "invalid_content",
            format!("{what} must be a string or a list of content blocks"),
        )),
    }
}
