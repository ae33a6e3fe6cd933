//! Which API a routed request speaks: its path, its metrics label, where its usage is.

/// Which API a routed request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    /// OpenAI's Responses API (`/v1/responses`).
    Responses,
    /// Anthropic's Messages API (`/v1/messages`).
    Messages,
}

impl Endpoint {
    pub const ALL: [Endpoint; 4] = [
        Endpoint::Chat,
        Endpoint::Completions,
        Endpoint::Responses,
        Endpoint::Messages,
    ];

    pub fn from_path(path: &str) -> Option<Endpoint> {
        Endpoint::ALL.into_iter().find(|e| e.path() == path)
    }

    /// The path the API is served at.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
        }
    }

    /// The `api` label of metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
            Endpoint::Responses => "responses",
            Endpoint::Messages => "messages",
        }
    }

    /// Whether a stream carries `usage` only when `stream_options.include_usage` asks for it.
    /// Responses and Messages streams always end with it.
    pub fn usage_on_request(self) -> bool {
        matches!(self, Endpoint::Chat | Endpoint::Completions)
    }
}
