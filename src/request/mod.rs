//! OpenAI request bodies: parse once, validate, and reduce to a [`RequestProfile`] that placement
//! works from. Nothing here allocates per byte of prompt: message text is borrowed from the body
//! where JSON escaping allows, and streamed through the block hasher.

use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use xxhash_rust::xxh3::Xxh3;

use crate::error::ApiError;
use text::{Content, Decoded};

mod blocks;
pub(crate) mod body;
pub mod engine_tokens;
pub mod surface;
mod text;
mod tokens;
pub(crate) mod usage;

pub use blocks::{BlockHasher, BlockTail, DEFAULT_BLOCK_BYTES};
pub use tokens::{CountLimits, Method, TokenEstimate, TokenEstimator, TokenMetrics};

/// Which OpenAI endpoint a routed request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Option<Endpoint> {
        match path {
            "/v1/chat/completions" => Some(Endpoint::Chat),
            "/v1/completions" => Some(Endpoint::Completions),
            _ => None,
        }
    }
}

/// Where the session key came from, in order of precedence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionSource {
    Header,
    User,
    PromptCacheKey,
    Content,
}

/// How the engine's reply continues a prompt's canonical stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyMode {
    /// A chat: an assistant message after the others.
    Chat,
    /// A string prompt: the reply's text right after it.
    Continue,
    /// A list prompt: kvroute does not follow its reply.
    None,
}

/// Everything placement needs to know about one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestProfile {
    pub endpoint: Endpoint,
    pub model: String,
    pub stream: bool,
    /// The client asked for the usage chunk at the end of a stream.
    pub include_usage: bool,
    /// The body has a `stream_options` object (so kvroute must not add one).
    pub has_stream_options: bool,
    pub session_key: u64,
    pub session_source: SessionSource,
    /// A chat that carries earlier replies: its start was sent before, by this kvroute or
    /// another.
    pub has_history: bool,
    /// Full blocks of the prompt before its last assistant message: the previous turn's
    /// prompt, which whichever kvroute placed that turn sent to its backend (0 without
    /// history).
    pub history_blocks: usize,
    /// Chained hashes of the canonical prompt's full blocks.
    pub prefix_blocks: Vec<u64>,
    /// The canonical stream past those blocks, and how a reply continues it: the blocks of
    /// prompt + reply without parsing the body again.
    pub tail: Option<(BlockTail, ReplyMode)>,
    pub prompt_bytes: usize,
    pub est_prompt_tokens: u64,
    pub est_output_tokens: u64,
    /// The request's `cache_salt` (vLLM): the engine shares cached blocks only between
    /// requests with the same salt, so the blocks above are salted with it too.
    pub cache_salt: Option<String>,
}

impl RequestProfile {
    /// The blocks of this prompt followed by `reply`, which the engine holds once it has
    /// answered: what [`blocks_with_reply`] computes from the body, without parsing it again.
    pub fn reply_blocks(&self, reply: &str) -> Option<Vec<u64>> {
        let (tail, mode) = self.tail.as_ref()?;
        Some(match mode {
            ReplyMode::Chat => tail.continued(
                &self.prefix_blocks,
                &[b"assistant", &[0x1f], reply.as_bytes(), &[0x1f]],
            ),
            ReplyMode::Continue => tail.continued(&self.prefix_blocks, &[reply.as_bytes()]),
            ReplyMode::None => self.prefix_blocks.clone(),
        })
    }
}

/// Header carrying an explicit session key.
pub const SESSION_HEADER: &str = "x-session-id";

/// Output length assumed when the client sets no `max_tokens`.
const DEFAULT_OUTPUT_TOKENS: u64 = 256;

/// Completions prompts have no conversation structure; without an explicit key their affinity
/// key is the first bytes of the prompt (prompts that grow by appending keep it).
const COMPLETIONS_KEY_BYTES: usize = 1024;

/// A chat's content key covers its canonical start up to the first user message, but at most
/// this much: requests whose first message opens with the same long text (a shared document or
/// instructions) then share an owner on the ring, so every replica, and a restarted kvroute,
/// sends such a prefix where the others did without knowing it is cached there. About
/// `routing.min_prefix_saving_tokens`' default of prompt, the prefix worth following.
const CHAT_KEY_MAX_BYTES: usize = 4096;

/// `FAST`: message text is read on the fast path ([`text`]).
#[derive(Deserialize)]
struct Body<'a, const FAST: bool> {
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
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct Message<'a, const FAST: bool> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<Decoded<'a, FAST>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// Writes the canonical byte stream to the block hasher and, until the affinity prefix is
/// complete, to the session hasher.
struct Canon {
    blocks: BlockHasher,
    session: Option<Xxh3>,
    /// Bytes the session hash has taken (at most [`CHAT_KEY_MAX_BYTES`]).
    session_bytes: usize,
    bytes: usize,
    token_ids: u64,
    /// The canonical text itself, kept for token counting while it fits `text_limit`.
    text: Option<Vec<u8>>,
    text_limit: usize,
}

impl Canon {
    fn new(block_bytes: usize, body_len: usize, text_limit: usize, seed: u64) -> Self {
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

    fn write(&mut self, data: &[u8]) {
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
    fn field(&mut self, data: &[u8]) {
        self.write(data);
        self.write(&[0x1f]);
    }

    fn seal_session(&mut self) -> Option<u64> {
        self.session.take().map(|s| s.digest())
    }
}

fn bad(code: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(code, msg)
}

/// Parse and validate a routed request body.
///
/// `session_header` is the value of `x-session-id`, if any.
pub fn profile(
    endpoint: Endpoint,
    body: &[u8],
    session_header: Option<&[u8]>,
    block_bytes: usize,
) -> Result<RequestProfile, ApiError> {
    build(endpoint, body, session_header, block_bytes, None, 0).map(|(p, _)| p)
}

/// What of a prompt's text is available for counting its tokens.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptText {
    /// The canonical prompt (roles and contents as the engine's template sees them).
    Text(Vec<u8>),
    /// Longer than the limit asked for: estimate it by its size.
    TooLong,
    /// A prompt of token ids: `est_prompt_tokens` is already exact.
    TokenIds,
}

/// [`profile`], plus the canonical prompt text when it is at most `text_limit` bytes.
pub fn profile_with_text(
    endpoint: Endpoint,
    body: &[u8],
    session_header: Option<&[u8]>,
    block_bytes: usize,
    text_limit: usize,
) -> Result<(RequestProfile, PromptText), ApiError> {
    build(
        endpoint,
        body,
        session_header,
        block_bytes,
        None,
        text_limit,
    )
}

/// The block hashes of this request's prompt followed by the engine's `reply`: what the engine
/// holds once it has answered (it keeps the generated tokens' KV too), and so the prefix of the
/// conversation's next turn. For chat the reply is an assistant message; for a string
/// completions prompt it continues the prompt. Other prompt forms get the prompt's blocks.
pub fn blocks_with_reply(
    endpoint: Endpoint,
    body: &[u8],
    reply: &str,
    block_bytes: usize,
) -> Result<Vec<u64>, ApiError> {
    build(endpoint, body, None, block_bytes, Some(reply), 0).map(|(p, _)| p.prefix_blocks)
}

fn build(
    endpoint: Endpoint,
    body: &[u8],
    session_header: Option<&[u8]>,
    block_bytes: usize,
    reply: Option<&str>,
    text_limit: usize,
) -> Result<(RequestProfile, PromptText), ApiError> {
    if body.is_empty() {
        return Err(bad(
            "empty_body",
            "request body is empty; expected a JSON object",
        ));
    }
    // serde would also accept a struct written as a JSON array.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(bad("invalid_json", "request body must be a JSON object"));
    }
    // Validated whole, so that no string in it is validated again (`from_str`).
    let json = simdutf8::compat::from_utf8(body).map_err(|e| {
        bad(
            "invalid_json",
            format!("request body is not valid UTF-8: {e}"),
        )
    })?;
    let invalid = |e: serde_json::Error| {
        bad(
            "invalid_json",
            format!("request body is not valid JSON for this endpoint: {e}"),
        )
    };
    let prompt = Prompt {
        endpoint,
        body,
        session_header,
        block_bytes,
        reply,
        text_limit,
    };
    if text::fast_path_ok(body) {
        prompt.reduce(serde_json::from_str::<Body<true>>(json).map_err(invalid)?)
    } else {
        prompt.reduce(serde_json::from_str::<Body<false>>(json).map_err(invalid)?)
    }
}

/// What [`build`] reduces a parsed body with.
struct Prompt<'a> {
    endpoint: Endpoint,
    body: &'a [u8],
    session_header: Option<&'a [u8]>,
    block_bytes: usize,
    reply: Option<&'a str>,
    text_limit: usize,
}

impl Prompt<'_> {
    fn reduce<const FAST: bool>(
        self,
        parsed: Body<FAST>,
    ) -> Result<(RequestProfile, PromptText), ApiError> {
        let Prompt {
            endpoint,
            body,
            session_header,
            block_bytes,
            reply,
            text_limit,
        } = self;
        let model = match parsed.model.as_deref() {
            Some(m) if !m.is_empty() => m,
            Some(_) => return Err(bad("invalid_model", "`model` must be a non-empty string")),
            None => return Err(bad("missing_model", "`model` is required")),
        };

        // An empty salt is the engine's to refuse; it salts nothing here.
        let cache_salt = parsed.cache_salt.as_deref().filter(|s| !s.is_empty());
        let seed = cache_salt.map_or(0, crate::request::engine_tokens::salt_key);
        let mut canon = Canon::new(block_bytes, body.len(), text_limit, seed);
        canon.field(model.as_bytes());
        if let Some(tools) = parsed.tools {
            canon.field(&xxhash_rust::xxh3::xxh3_64(tools.get().as_bytes()).to_le_bytes());
        }

        let mut has_history = false;
        let mut history_blocks = 0;
        let mut reply_mode = ReplyMode::Chat;
        let content_key = match endpoint {
            Endpoint::Chat => {
                let messages = match &parsed.messages {
                    Some(m) if !m.is_empty() => m,
                    Some(_) => return Err(bad("invalid_messages", "`messages` must not be empty")),
                    None => return Err(bad("missing_messages", "`messages` is required")),
                };
                let mut key = None;
                let last_reply = messages.iter().rposition(|m| m.role == "assistant");
                has_history = last_reply.is_some();
                for (i, m) in messages.iter().enumerate() {
                    if Some(i) == last_reply {
                        history_blocks = canon.blocks.full_blocks();
                    }
                    canon.field(m.role.as_bytes());
                    write_content(&mut canon, m.content.as_ref().map(|c| &c.0), i)?;
                    if let Some(calls) = m.tool_calls {
                        canon.field(
                            &xxhash_rust::xxh3::xxh3_64(calls.get().as_bytes()).to_le_bytes(),
                        );
                    }
                    if key.is_none() && m.role == "user" {
                        key = canon.seal_session();
                    }
                }
                // A conversation with no user message yet keys on all it has.
                let key = key.or_else(|| canon.seal_session());
                if let Some(r) = reply {
                    canon.field(b"assistant");
                    canon.field(r.as_bytes());
                }
                key
            }
            Endpoint::Completions => {
                let prompt = parsed
                    .prompt
                    .ok_or_else(|| bad("missing_prompt", "`prompt` is required"))?;
                reply_mode = write_prompt::<FAST>(&mut canon, prompt, reply)?;
                None
            }
        };

        let (session_key, session_source) =
            if let Some(h) = session_header.filter(|h| !h.is_empty()) {
                (keyed(model, b"h", h), SessionSource::Header)
            } else if let Some(u) = parsed.user.as_deref().filter(|u| !u.is_empty()) {
                (keyed(model, b"u", u.as_bytes()), SessionSource::User)
            } else if let Some(k) = parsed.prompt_cache_key.as_deref().filter(|k| !k.is_empty()) {
                (
                    keyed(model, b"p", k.as_bytes()),
                    SessionSource::PromptCacheKey,
                )
            } else if let Some(k) = content_key {
                (k, SessionSource::Content)
            } else {
                (completions_key(model, &parsed), SessionSource::Content)
            };

        let prompt_bytes = canon.bytes;
        let (prefix_blocks, tail) =
            std::mem::replace(&mut canon.blocks, BlockHasher::new(1)).split();
        let (est_prompt_tokens, text) = if canon.token_ids > 0 {
            (canon.token_ids, PromptText::TokenIds)
        } else {
            (
                (prompt_bytes as u64).div_ceil(4),
                canon
                    .text
                    .take()
                    .map_or(PromptText::TooLong, PromptText::Text),
            )
        };
        let profile = RequestProfile {
            endpoint,
            model: model.to_owned(),
            stream: parsed.stream.unwrap_or(false),
            has_stream_options: parsed.stream_options.is_some(),
            include_usage: parsed
                .stream_options
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            session_key,
            session_source,
            has_history,
            history_blocks,
            prefix_blocks,
            tail: Some((tail, reply_mode)),
            prompt_bytes,
            est_prompt_tokens,
            est_output_tokens: parsed
                .max_completion_tokens
                .or(parsed.max_tokens)
                .unwrap_or(DEFAULT_OUTPUT_TOKENS),
            cache_salt: cache_salt.map(str::to_owned),
        };
        Ok((profile, text))
    }
}

fn keyed(model: &str, tag: &[u8], value: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(model.as_bytes());
    h.update(&[0x1f]);
    h.update(tag);
    h.update(value);
    h.digest()
}

fn completions_key<const FAST: bool>(model: &str, parsed: &Body<FAST>) -> u64 {
    let prompt = parsed.prompt.map(|p| p.get()).unwrap_or("");
    let end = floor_char_boundary(prompt, COMPLETIONS_KEY_BYTES);
    keyed(model, b"c", &prompt.as_bytes()[..end])
}

fn floor_char_boundary(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    let mut i = max;
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn write_content(canon: &mut Canon, content: Option<&Content>, idx: usize) -> Result<(), ApiError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: serde_json::Value) -> Result<RequestProfile, ApiError> {
        profile(Endpoint::Chat, body.to_string().as_bytes(), None, 64)
    }

    fn conv(turns: usize) -> serde_json::Value {
        let mut messages =
            vec![json!({"role":"system","content":"You are a helpful assistant. ".repeat(20)})];
        for t in 0..turns {
            messages.push(json!({"role":"user","content":format!("question number {t} about topic {}", "x".repeat(100))}));
            messages.push(
                json!({"role":"assistant","content":format!("answer {t} {}", "y".repeat(200))}),
            );
        }
        messages.push(json!({"role":"user","content":"and then?"}));
        json!({"model":"m","messages":messages,"stream":true})
    }

    #[test]
    fn turns_share_session_key_and_prefix_blocks() {
        let t1 = chat(conv(1)).unwrap();
        let t3 = chat(conv(3)).unwrap();
        assert_eq!(t1.session_key, t3.session_key);
        assert_eq!(t1.session_source, SessionSource::Content);
        let n = t1.prefix_blocks.len() - 1; // the last block of t1 ends in its final question
        assert!(n > 5);
        assert_eq!(t1.prefix_blocks[..n], t3.prefix_blocks[..n]);
        assert!(t3.stream);
    }

    #[test]
    fn history_blocks_are_the_previous_turns_prompt() {
        let t3 = chat(conv(3)).unwrap();
        // Turn 3's previous prompt: its messages without the last reply and the new question.
        let mut prev = conv(3);
        let messages = prev["messages"].as_array_mut().unwrap();
        messages.truncate(messages.len() - 2);
        let t2 = chat(prev).unwrap();
        assert!(t3.history_blocks > 5);
        assert_eq!(t3.history_blocks, t2.prefix_blocks.len());
        let first = chat(conv(0)).unwrap();
        assert_eq!((first.has_history, first.history_blocks), (false, 0));
    }

    #[test]
    fn a_cache_salt_salts_every_block_and_the_reply() {
        let salted = |salt: Option<&str>| {
            let mut body = conv(2);
            if let Some(s) = salt {
                body["cache_salt"] = s.into();
            }
            chat(body).unwrap()
        };
        let (plain, a, a2, b) = (
            salted(None),
            salted(Some("a")),
            salted(Some("a")),
            salted(Some("b")),
        );
        assert_eq!(a.prefix_blocks, a2.prefix_blocks);
        assert_eq!(a.cache_salt.as_deref(), Some("a"));
        for other in [&plain, &b] {
            assert!(a
                .prefix_blocks
                .iter()
                .all(|h| !other.prefix_blocks.contains(h)));
        }
        // The conversation, salt and routing key aside, is the same one.
        assert_eq!(a.session_key, plain.session_key);
        assert_eq!(a.est_prompt_tokens, plain.est_prompt_tokens);
        // The reply continues the salted chain, as a re-parse of the body with it does.
        let body = serde_json::to_vec(&{
            let mut c = conv(2);
            c["cache_salt"] = "a".into();
            c
        })
        .unwrap();
        assert_eq!(
            a.reply_blocks("the answer"),
            blocks_with_reply(Endpoint::Chat, &body, "the answer", 64).ok()
        );
        // An empty salt salts nothing (the engine refuses it).
        assert_eq!(salted(Some("")).prefix_blocks, plain.prefix_blocks);
    }

    #[test]
    fn shared_system_prompt_different_first_question_spreads() {
        let a = chat(json!({"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"a"}]})).unwrap();
        let b = chat(json!({"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"b"}]})).unwrap();
        assert_ne!(a.session_key, b.session_key);
    }

    #[test]
    fn a_long_shared_start_is_one_key_however_the_message_ends() {
        let doc = "shared instructions and document text. ".repeat(200); // ~8 KB
        let ask = |start: &str, q: &str| {
            chat(json!({"model":"m","messages":[{"role":"user","content":format!("{start}{q}")}]}))
                .unwrap()
        };
        // The first 4 KB decide: one owner for every request that opens with the document...
        assert_eq!(ask(&doc, "a?").session_key, ask(&doc, "b?").session_key);
        // ...and the rest still spread.
        let short = "short preamble. ";
        assert_ne!(ask(short, "a?").session_key, ask(short, "b?").session_key);
        let other = "other instructions, other document. ".repeat(200);
        assert_ne!(ask(&doc, "a?").session_key, ask(&other, "a?").session_key);
        // A conversation that starts with the document keeps its key at every turn.
        let turn2 = chat(json!({"model":"m","messages":[
            {"role":"user","content":format!("{doc}a?")},
            {"role":"assistant","content":"an answer"},
            {"role":"user","content":"more?"}]}))
        .unwrap();
        assert_eq!(turn2.session_key, ask(&doc, "a?").session_key);
    }

    #[test]
    fn model_is_mixed_into_key() {
        let a = chat(json!({"model":"m1","messages":[{"role":"user","content":"a"}]})).unwrap();
        let b = chat(json!({"model":"m2","messages":[{"role":"user","content":"a"}]})).unwrap();
        assert_ne!(a.session_key, b.session_key);
    }

    #[test]
    fn explicit_keys_take_precedence() {
        let body = json!({"model":"m","messages":[{"role":"user","content":"a"}],"user":"alice","prompt_cache_key":"pck"});
        let bytes = body.to_string();
        let h = profile(Endpoint::Chat, bytes.as_bytes(), Some(b"s1"), 64).unwrap();
        assert_eq!(h.session_source, SessionSource::Header);
        let u = profile(Endpoint::Chat, bytes.as_bytes(), None, 64).unwrap();
        assert_eq!(u.session_source, SessionSource::User);
        let body = json!({"model":"m","messages":[{"role":"user","content":"zzz"}],"prompt_cache_key":"pck"});
        let p = chat(body).unwrap();
        assert_eq!(p.session_source, SessionSource::PromptCacheKey);
        // Same header, different content: same key.
        let other = json!({"model":"m","messages":[{"role":"user","content":"other"}]}).to_string();
        let h2 = profile(Endpoint::Chat, other.as_bytes(), Some(b"s1"), 64).unwrap();
        assert_eq!(h.session_key, h2.session_key);
    }

    #[test]
    fn content_parts_equal_plain_text() {
        let a = chat(json!({"model":"m","messages":[{"role":"user","content":"hello world"}]}))
            .unwrap();
        let b = chat(json!({"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello "},{"type":"text","text":"world"}]}]})).unwrap();
        assert_eq!(a.session_key, b.session_key);
        let c = chat(json!({"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:x"}}]}]})).unwrap();
        assert_ne!(a.session_key, c.session_key);
    }

    #[test]
    fn completions_prompt_forms() {
        for p in [
            json!("a prompt"),
            json!(["a", "b"]),
            json!([1, 2, 3]),
            json!([[1, 2], [3]]),
        ] {
            let body = json!({"model":"m","prompt":p}).to_string();
            let r = profile(Endpoint::Completions, body.as_bytes(), None, 64).unwrap();
            assert_eq!(r.endpoint, Endpoint::Completions);
        }
        let ids = json!({"model":"m","prompt":[1,2,3,4,5]}).to_string();
        let r = profile(Endpoint::Completions, ids.as_bytes(), None, 64).unwrap();
        assert_eq!(r.est_prompt_tokens, 5);
        for p in [
            json!(5),
            json!({"a":1}),
            json!([1.5]),
            json!([true]),
            json!([-1]),
        ] {
            let body = json!({"model":"m","prompt":p}).to_string();
            let e = profile(Endpoint::Completions, body.as_bytes(), None, 64).unwrap_err();
            assert_eq!((e.status, e.code), (400, "invalid_prompt"), "{p}");
        }
    }

    #[test]
    fn malformed_inputs_are_400_with_codes() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "empty_body"),
            (b"{", "invalid_json"),
            (b"[]", "invalid_json"),
            (b"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]}", "missing_model"),
            (b"{\"model\":\"\",\"messages\":[]}", "invalid_model"),
            (b"{\"model\":5,\"messages\":[]}", "invalid_json"),
            (b"{\"model\":\"m\"}", "missing_messages"),
            (b"{\"model\":\"m\",\"messages\":[]}", "invalid_messages"),
            (b"{\"model\":\"m\",\"messages\":[{\"content\":\"a\"}]}", "invalid_json"),
            (b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":7}]}", "invalid_json"),
            (b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[7]}]}", "invalid_messages"),
            (b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"max_tokens\":-3}", "invalid_json"),
            (b"\xff\xfe", "invalid_json"),
        ];
        for (body, code) in cases {
            let e = profile(Endpoint::Chat, body, None, 64).unwrap_err();
            assert_eq!(
                (e.status, e.code),
                (400, *code),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn reply_blocks_prefix_the_next_turn() {
        let turn1 = conv(1);
        let reply = "a reply long enough to span a few blocks of the canonical stream ".repeat(8);
        let body1 = turn1.to_string();
        let with_reply = blocks_with_reply(Endpoint::Chat, body1.as_bytes(), &reply, 64).unwrap();
        let mut messages = turn1["messages"].as_array().unwrap().clone();
        messages.push(json!({"role":"assistant","content":reply}));
        messages.push(json!({"role":"user","content":"next question"}));
        let turn2 = chat(json!({"model":"m","messages":messages})).unwrap();
        let n = with_reply.len() - 1;
        assert!(n > chat(turn1).unwrap().prefix_blocks.len());
        assert_eq!(with_reply[..n], turn2.prefix_blocks[..n]);

        let p1 = json!({"model":"m","prompt":"Once upon a time ".repeat(20)}).to_string();
        let cont = " there was a router".repeat(10);
        let b = blocks_with_reply(Endpoint::Completions, p1.as_bytes(), &cont, 64).unwrap();
        let p2 =
            json!({"model":"m","prompt":format!("{}{cont} and", "Once upon a time ".repeat(20))})
                .to_string();
        let next = profile(Endpoint::Completions, p2.as_bytes(), None, 64).unwrap();
        assert_eq!(b[..b.len() - 1], next.prefix_blocks[..b.len() - 1]);
    }

    #[test]
    fn output_and_usage_fields() {
        let r = chat(json!({"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":7,"stream":true,"stream_options":{"include_usage":true}})).unwrap();
        assert_eq!(r.est_output_tokens, 7);
        assert!(r.include_usage);
        let r = chat(json!({"model":"m","messages":[{"role":"user","content":"a"}],"max_completion_tokens":9})).unwrap();
        assert_eq!(r.est_output_tokens, 9);
        assert!(!r.include_usage && !r.stream);
    }

    #[test]
    fn a_completions_prompt_is_a_block_prefix_of_its_continuation() {
        // Every prompt length around the block edges (the fuzzer's find: a trailing separator
        // completing a block made the prompt's last block differ from its continuation's).
        for n in 0..80 {
            let body = serde_json::json!({"model": "m", "prompt": "p".repeat(n)}).to_string();
            let own = profile(Endpoint::Completions, body.as_bytes(), None, 16)
                .unwrap()
                .prefix_blocks;
            let next =
                blocks_with_reply(Endpoint::Completions, body.as_bytes(), "reply", 16).unwrap();
            assert_eq!(&next[..own.len()], &own[..], "prompt of {n} bytes");
        }
    }

    /// A generated request: `kind` 0 a chat alternating user and assistant `texts`, 1 a string
    /// completions prompt of them all, 2 a list prompt of them.
    fn generated(kind: u8, texts: &[String]) -> (Endpoint, String) {
        let body = match kind {
            0 => {
                let msgs: Vec<_> = texts
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": t})
                    })
                    .collect();
                json!({"model":"m","messages":msgs})
            }
            1 => json!({"model":"m","prompt":texts.concat()}),
            _ => json!({"model":"m","prompt":texts}),
        };
        let endpoint = if kind == 0 {
            Endpoint::Chat
        } else {
            Endpoint::Completions
        };
        (endpoint, body.to_string())
    }

    proptest::proptest! {
        /// Continuing the profile's own stream gives the blocks a second parse of the body with
        /// the reply gives, for chats, string and list prompts of any length.
        #[test]
        fn reply_blocks_equal_a_second_parse(
            texts in proptest::collection::vec("[a-z \\n\u{e9}\u{1F600}]{0,90}", 1..5),
            reply in "[a-z \u{e9}]{0,300}",
            block in proptest::sample::select(vec![16usize, 64, 256]),
            kind in 0u8..3,
        ) {
            let (endpoint, body) = generated(kind, &texts);
            let p = profile(endpoint, body.as_bytes(), None, block).unwrap();
            let again = blocks_with_reply(endpoint, body.as_bytes(), &reply, block).unwrap();
            proptest::prop_assert_eq!(p.reply_blocks(&reply), Some(again));
        }

        /// A body read on the fast path ([`text`]) profiles as the same body read strictly
        /// (a trailing newline, JSON whitespace, keeps it off the fast path): escapes, control
        /// characters, non-ASCII text written raw or as `\u` escapes, valid or not.
        #[test]
        fn fast_and_strict_paths_agree(
            texts in proptest::collection::vec("[a-z \"\\\n\t\u{1}\u{7f}\u{e9}\u{1F600}]{0,60}", 1..5),
            ascii_escaped in proptest::bool::ANY,
            damage in proptest::option::of((0usize..400, proptest::sample::select(vec![
                "\\ud800", "\\udc00x", "\\x", "\"", "\u{1}", "\u{ff}", "{", "]",
            ]))),
            kind in 0u8..3,
        ) {
            let (endpoint, body) = generated(kind, &texts);
            let mut body = if ascii_escaped {
                body.chars().map(|c| if c.is_ascii() { c.to_string() } else {
                    c.encode_utf16(&mut [0; 2]).iter().map(|u| format!("\\u{u:04x}")).collect()
                }).collect()
            } else {
                body
            };
            if let Some((at, bad)) = damage {
                let at = floor_char_boundary(&body, at);
                body.insert_str(at, bad);
            }
            let strict_body = format!("{body}\n");
            if damage.is_none_or(|(_, bad)| bad != "\u{1}") {
                proptest::prop_assert!(text::fast_path_ok(body.as_bytes()), "not on the fast path");
            }
            let fast = profile(endpoint, body.as_bytes(), None, 16);
            let strict = profile(endpoint, strict_body.as_bytes(), None, 16);
            match (fast, strict) {
                (Ok(f), Ok(s)) => proptest::prop_assert_eq!(f, s),
                (Err(f), Err(s)) => proptest::prop_assert_eq!((f.status, f.code), (s.status, s.code)),
                (f, s) => proptest::prop_assert!(false, "fast {f:?}, strict {s:?}"),
            }
        }
    }
}
