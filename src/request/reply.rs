//! What an engine's reply tells kvroute, whichever API it speaks: the tokens it used, and its
//! text kept (bounded) to know what the engine holds after it.

/// Prompt tokens as the engine counted them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

/// A tool call an agent API's reply made: what its next turn sends back (a Responses
/// `function_call` item, a Messages `tool_use` block).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplyCall {
    pub name: String,
    /// The arguments' JSON text as the engine wrote it.
    pub arguments: String,
}

/// A JSON object's text as kvroute writes it into the canonical stream: compact, keys sorted,
/// so that a client writing the same value another way (Python's spaces, another key order)
/// sends the same bytes. Text that does not parse is written as it is.
pub(super) fn canonical_json(raw: &str) -> std::borrow::Cow<'_, str> {
    match serde_json::from_str::<serde_json::Value>(raw) {
        Ok(v) => std::borrow::Cow::Owned(v.to_string()),
        Err(_) => std::borrow::Cow::Borrowed(raw),
    }
}

/// The canonical bytes of a reply with tool calls as its next turn writes them back: in
/// Responses, a message item (the text, if any) and then one `function_call` item per call; in
/// Messages, one assistant message of the text and a `tool_use` block per call. The same bytes
/// the API's reduce writes for those items (see `responses::write_item` and
/// `canon::write_blocks`).
pub(super) fn with_calls(endpoint: super::Endpoint, text: &str, calls: &[ReplyCall]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len() + 64);
    let field = |out: &mut Vec<u8>, b: &[u8]| {
        out.extend_from_slice(b);
        out.push(0x1f);
    };
    if endpoint == super::Endpoint::Messages {
        field(&mut out, b"assistant");
        out.extend_from_slice(text.as_bytes());
        for c in calls {
            out.push(0x1e);
            field(&mut out, b"tool_use");
            field(&mut out, c.name.as_bytes());
            field(&mut out, canonical_json(&c.arguments).as_bytes());
        }
        field(&mut out, b"");
        return out;
    }
    if !text.is_empty() {
        field(&mut out, b"assistant");
        field(&mut out, text.as_bytes());
    }
    for c in calls {
        out.push(0x1e);
        field(&mut out, b"function_call");
        field(&mut out, c.name.as_bytes());
        field(&mut out, c.arguments.as_bytes());
        field(&mut out, b"");
    }
    out
}

/// Reply text kept for the index; a longer reply is kept truncated (still a true prefix).
const MAX_REPLY_BYTES: usize = 256 * 1024;

/// Appends `t` to a reply, up to [`MAX_REPLY_BYTES`].
pub(super) fn push_capped(out: &mut String, t: &str) {
    let room = MAX_REPLY_BYTES.saturating_sub(out.len());
    let mut take = t.len().min(room);
    while !t.is_char_boundary(take) {
        take -= 1;
    }
    out.push_str(&t[..take]);
}
