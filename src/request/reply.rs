//! What an engine's reply tells kvroute, whichever API it speaks: the tokens it used, and its
//! text kept (bounded) to know what the engine holds after it.

/// Prompt tokens as the engine counted them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
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
