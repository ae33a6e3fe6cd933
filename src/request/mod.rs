//! Request bodies of the APIs kvroute routes: parse once, validate, and reduce to a
//! [`RequestProfile`] that placement works from. Every API (OpenAI chat and completions,
//! OpenAI Responses, Anthropic Messages) writes the same canonical prompt ([`canon`]), so a
//! conversation is placed the same way whichever one it speaks. Nothing here allocates per byte
//! of prompt: message text is borrowed from the body where JSON escaping allows, and streamed
//! through the block hasher.

use crate::error::ApiError;
use canon::Canon;
use session::BodyKeys;

pub mod agent_chat;
#[cfg(test)]
mod agent_tests;
mod agent_usage;
mod blocks;
pub(crate) mod body;
pub mod bootstrap;
mod canon;
mod endpoint;
pub mod engine_tokens;
pub mod id_stamp;
mod messages;
pub mod nixl;
mod openai;
mod reply;
pub mod response_id;
mod responses;
pub mod resume;
mod session;
pub mod surface;
mod text;
mod tokens;
pub(crate) mod usage;

pub use blocks::{BlockHasher, BlockTail, DEFAULT_BLOCK_BYTES};
pub use endpoint::Endpoint;
pub use reply::ReplyCall;
pub use session::SessionKeys;
pub use tokens::{CountLimits, Method, TokenEstimate, TokenEstimator, TokenMetrics};

/// Where the session key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionSource {
    Header,
    User,
    PromptCacheKey,
    MetadataUserId,
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
    /// The body names an engine's prefill/decode handover (`kv_transfer_params`,
    /// `bootstrap_host`/`_port`/`_room`), which only kvroute may give it.
    pub has_handover_fields: bool,
    pub session_key: u64,
    pub session_source: SessionSource,
    /// A conversation that carries earlier replies: its start was sent before, by this kvroute
    /// or another.
    pub has_history: bool,
    /// Full blocks of the prompt before its last reply: the previous turn's prompt, which
    /// whichever kvroute placed that turn sent to its backend (0 without history).
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
    /// A Responses request's `previous_response_id`: the stored response it continues.
    pub previous_response_id: Option<String>,
}

impl RequestProfile {
    /// The blocks of this prompt followed by `reply`, which the engine holds once it has
    /// answered: what [`blocks_with_reply`] computes from the body, without parsing it again.
    pub fn reply_blocks(&self, reply: &str, calls: &[ReplyCall]) -> Option<Vec<u64>> {
        let (tail, mode) = self.tail.as_ref()?;
        Some(match mode {
            ReplyMode::Chat if !calls.is_empty() && self.endpoint != Endpoint::Chat => {
                let bytes = reply::with_calls(self.endpoint, reply, calls);
                tail.continued(&self.prefix_blocks, &[&bytes])
            }
            ReplyMode::Chat => tail.continued(
                &self.prefix_blocks,
                &[b"assistant", &[0x1f], reply.as_bytes(), &[0x1f]],
            ),
            ReplyMode::Continue => tail.continued(&self.prefix_blocks, &[reply.as_bytes()]),
            ReplyMode::None => self.prefix_blocks.clone(),
        })
    }
}

/// An HTTP/1.1 request names its host exactly once (RFC 9112 section 3.2: a server answers
/// 400 otherwise); HTTP/2 carries `:authority` instead, and HTTP/1.0 may omit it.
pub fn host_present(req: &pingora::http::RequestHeader, http2: bool) -> Result<(), ApiError> {
    if http2 || req.version != http::Version::HTTP_11 {
        return Ok(());
    }
    match req.headers.get_all(http::header::HOST).iter().count() {
        1 => Ok(()),
        0 => Err(ApiError::bad_request(
            "missing_host",
            "an HTTP/1.1 request must carry a Host header",
        )),
        _ => Err(ApiError::bad_request(
            "duplicate_host",
            "an HTTP/1.1 request must carry one Host header, not several",
        )),
    }
}

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

/// What an API's body says besides its canonical prompt, which its reducer has written.
struct Conversation<'a> {
    stream: bool,
    include_usage: bool,
    has_stream_options: bool,
    has_handover_fields: bool,
    max_output: Option<u64>,
    body_keys: BodyKeys<'a>,
    /// The hash of the conversation's opening (see [`CHAT_KEY_MAX_BYTES`]).
    content_key: u64,
    has_history: bool,
    history_blocks: usize,
    reply_mode: ReplyMode,
    previous_response_id: Option<&'a str>,
}

fn bad(code: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(code, msg)
}

/// Parse and validate a routed request body.
pub fn profile(
    endpoint: Endpoint,
    body: &[u8],
    keys: SessionKeys,
    block_bytes: usize,
) -> Result<RequestProfile, ApiError> {
    build(endpoint, body, keys, block_bytes, None, 0).map(|(p, _)| p)
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
    keys: SessionKeys,
    block_bytes: usize,
    text_limit: usize,
) -> Result<(RequestProfile, PromptText), ApiError> {
    build(endpoint, body, keys, block_bytes, None, text_limit)
}

/// The block hashes of this request's prompt followed by the engine's `reply`: what the engine
/// holds once it has answered (it keeps the generated tokens' KV too), and so the prefix of the
/// conversation's next turn. For a conversation the reply is an assistant message; for a
/// string completions prompt it continues the prompt. Other prompt forms get the prompt's
/// blocks.
pub fn blocks_with_reply(
    endpoint: Endpoint,
    body: &[u8],
    reply: &str,
    block_bytes: usize,
) -> Result<Vec<u64>, ApiError> {
    build(
        endpoint,
        body,
        SessionKeys::default(),
        block_bytes,
        Some(reply),
        0,
    )
    .map(|(p, _)| p.prefix_blocks)
}

fn build(
    endpoint: Endpoint,
    body: &[u8],
    keys: SessionKeys,
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
    let prompt = Prompt {
        endpoint,
        body_len: body.len(),
        keys,
        block_bytes,
        reply,
        text_limit,
    };
    if text::fast_path_ok(body) {
        prompt.reduce::<true>(json)
    } else {
        prompt.reduce::<false>(json)
    }
}

fn invalid(e: serde_json::Error) -> ApiError {
    bad(
        "invalid_json",
        format!("request body is not valid JSON for this endpoint: {e}"),
    )
}

/// What [`build`] reduces a parsed body with.
struct Prompt<'a> {
    endpoint: Endpoint,
    body_len: usize,
    keys: SessionKeys<'a>,
    block_bytes: usize,
    reply: Option<&'a str>,
    text_limit: usize,
}

impl Prompt<'_> {
    fn reduce<const FAST: bool>(
        self,
        json: &str,
    ) -> Result<(RequestProfile, PromptText), ApiError> {
        let reply = self.reply;
        match self.endpoint {
            Endpoint::Chat | Endpoint::Completions => {
                let parsed: openai::Body<FAST> = serde_json::from_str(json).map_err(invalid)?;
                let (model, mut canon) = self.start(parsed.model(), parsed.cache_salt())?;
                let conv = openai::reduce(self.endpoint, &parsed, &mut canon, reply)?;
                Ok(self.finish(model, parsed.cache_salt(), canon, conv))
            }
            Endpoint::Responses => {
                let parsed: responses::Body<FAST> = serde_json::from_str(json).map_err(invalid)?;
                let (model, mut canon) = self.start(parsed.model(), None)?;
                let conv = responses::reduce(&parsed, &mut canon, reply)?;
                Ok(self.finish(model, None, canon, conv))
            }
            Endpoint::Messages => {
                let parsed: messages::Body<FAST> = serde_json::from_str(json).map_err(invalid)?;
                let (model, mut canon) = self.start(parsed.model(), None)?;
                let conv = messages::reduce(&parsed, &mut canon, reply)?;
                Ok(self.finish(model, None, canon, conv))
            }
        }
    }

    /// The canonical stream, salted and opened with the model.
    fn start<'m>(
        &self,
        model: Option<&'m str>,
        cache_salt: Option<&str>,
    ) -> Result<(&'m str, Canon), ApiError> {
        let model = match model {
            Some(m) if !m.is_empty() => m,
            Some(_) => return Err(bad("invalid_model", "`model` must be a non-empty string")),
            None => return Err(bad("missing_model", "`model` is required")),
        };
        // An empty salt is the engine's to refuse; it salts nothing here.
        let seed = cache_salt
            .filter(|s| !s.is_empty())
            .map_or(0, crate::request::engine_tokens::salt_key);
        let mut canon = Canon::new(self.block_bytes, self.body_len, self.text_limit, seed);
        canon.field(model.as_bytes());
        Ok((model, canon))
    }

    fn finish(
        &self,
        model: &str,
        cache_salt: Option<&str>,
        mut canon: Canon,
        conv: Conversation,
    ) -> (RequestProfile, PromptText) {
        let (session_key, session_source) = self
            .keys
            .explicit(model, &conv.body_keys)
            .unwrap_or((conv.content_key, SessionSource::Content));
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
            endpoint: self.endpoint,
            model: model.to_owned(),
            stream: conv.stream,
            has_stream_options: conv.has_stream_options,
            has_handover_fields: conv.has_handover_fields,
            include_usage: conv.include_usage,
            session_key,
            session_source,
            has_history: conv.has_history,
            history_blocks: conv.history_blocks,
            prefix_blocks,
            tail: Some((tail, conv.reply_mode)),
            prompt_bytes,
            est_prompt_tokens,
            est_output_tokens: conv.max_output.unwrap_or(DEFAULT_OUTPUT_TOKENS),
            cache_salt: cache_salt.filter(|s| !s.is_empty()).map(str::to_owned),
            previous_response_id: conv.previous_response_id.map(str::to_owned),
        };
        (profile, text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use canon::floor_char_boundary;
    use serde_json::json;

    fn chat(body: serde_json::Value) -> Result<RequestProfile, ApiError> {
        profile(
            Endpoint::Chat,
            body.to_string().as_bytes(),
            SessionKeys::default(),
            64,
        )
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
            a.reply_blocks("the answer", &[]),
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

    fn header_keys(h: &http::HeaderMap) -> SessionKeys<'_> {
        SessionKeys::default_order(Some(h))
    }

    #[test]
    fn explicit_keys_take_precedence() {
        let mut s1 = http::HeaderMap::new();
        s1.insert("x-session-id", http::HeaderValue::from_static("s1"));
        let body = json!({"model":"m","messages":[{"role":"user","content":"a"}],"user":"alice","prompt_cache_key":"pck"});
        let bytes = body.to_string();
        let h = profile(Endpoint::Chat, bytes.as_bytes(), header_keys(&s1), 64).unwrap();
        assert_eq!(h.session_source, SessionSource::Header);
        // `prompt_cache_key` names a conversation, `user` a person who may hold several.
        let p = profile(Endpoint::Chat, bytes.as_bytes(), SessionKeys::default(), 64).unwrap();
        assert_eq!(p.session_source, SessionSource::PromptCacheKey);
        let body = json!({"model":"m","messages":[{"role":"user","content":"zzz"}],"user":"alice"});
        let u = chat(body).unwrap();
        assert_eq!(u.session_source, SessionSource::User);
        // Same header, different content: same key.
        let other = json!({"model":"m","messages":[{"role":"user","content":"other"}]}).to_string();
        let h2 = profile(Endpoint::Chat, other.as_bytes(), header_keys(&s1), 64).unwrap();
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
            let r = profile(
                Endpoint::Completions,
                body.as_bytes(),
                SessionKeys::default(),
                64,
            )
            .unwrap();
            assert_eq!(r.endpoint, Endpoint::Completions);
        }
        let ids = json!({"model":"m","prompt":[1,2,3,4,5]}).to_string();
        let r = profile(
            Endpoint::Completions,
            ids.as_bytes(),
            SessionKeys::default(),
            64,
        )
        .unwrap();
        assert_eq!(r.est_prompt_tokens, 5);
        for p in [
            json!(5),
            json!({"a":1}),
            json!([1.5]),
            json!([true]),
            json!([-1]),
        ] {
            let body = json!({"model":"m","prompt":p}).to_string();
            let e = profile(
                Endpoint::Completions,
                body.as_bytes(),
                SessionKeys::default(),
                64,
            )
            .unwrap_err();
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
            let e = profile(Endpoint::Chat, body, SessionKeys::default(), 64).unwrap_err();
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
        let next = profile(
            Endpoint::Completions,
            p2.as_bytes(),
            SessionKeys::default(),
            64,
        )
        .unwrap();
        assert_eq!(b[..b.len() - 1], next.prefix_blocks[..b.len() - 1]);
    }

    #[test]
    fn a_clients_kv_transfer_params_are_noticed() {
        let m = json!([{"role":"user","content":"a"}]);
        let with = chat(json!({"model":"m","messages":m,"kv_transfer_params":{"remote_host":"x"}}));
        assert!(with.unwrap().has_handover_fields);
        let with = chat(json!({"model":"m","messages":m,"bootstrap_room":7}));
        assert!(with.unwrap().has_handover_fields);
        let without = chat(json!({"model":"m","messages":m,"note":"kv_transfer_params"}));
        assert!(!without.unwrap().has_handover_fields);
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
            let own = profile(
                Endpoint::Completions,
                body.as_bytes(),
                SessionKeys::default(),
                16,
            )
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
            let p = profile(endpoint, body.as_bytes(), SessionKeys::default(), block).unwrap();
            let again = blocks_with_reply(endpoint, body.as_bytes(), &reply, block).unwrap();
            proptest::prop_assert_eq!(p.reply_blocks(&reply, &[]), Some(again));
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
            let fast = profile(endpoint, body.as_bytes(), SessionKeys::default(), 16);
            let strict = profile(endpoint, strict_body.as_bytes(), SessionKeys::default(), 16);
            match (fast, strict) {
                (Ok(f), Ok(s)) => proptest::prop_assert_eq!(f, s),
                (Err(f), Err(s)) => proptest::prop_assert_eq!((f.status, f.code), (s.status, s.code)),
                (f, s) => proptest::prop_assert!(false, "fast {f:?}, strict {s:?}"),
            }
        }
    }
}
