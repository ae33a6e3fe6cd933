//! What one server-sent event of a completion stream means to the client, whichever API sent
//! it.

/// Token counts from the final usage chunk (`stream_options.include_usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: Option<u64>,
}

/// What one complete event meant to the client.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Generated text (chat `delta.content` or completions `text`), never empty.
    Content(String),
    Usage(Usage),
    /// A chunk carrying both text and usage (some servers put usage on the last content chunk).
    ContentAndUsage(String, Usage),
    /// `data: [DONE]`.
    Done,
    /// The agent APIs' last event: its usage, the end of the stream, and the Responses
    /// answer's id.
    Final(Usage, Option<String>),
    /// A tool call opens (agent APIs); its arguments follow as `Content`.
    ToolCall {
        id: String,
        name: String,
        /// The Responses item's id, when it has one besides the call's.
        item: Option<String>,
    },
    /// An in-stream `{"error": ...}` object or an unparsable payload.
    Error(String),
    /// Role-only deltas, comments, keep-alives: nothing to measure.
    Ignored,
}
