//! Engine-reported `usage`: what the backend actually prefilled and had cached, to score
//! placement against the prefix index's prediction.
//!
//! Streams carry `usage` only when asked (`stream_options.include_usage`), so kvroute asks for
//! it when the client did not say, and then removes that extra final chunk (the one with
//! `"choices":[]` and a `usage` object) before it reaches the client. Everything else passes
//! through untouched and unbuffered: only an SSE event split across two reads is held back
//! until its end arrives.
//!
//! For kv_aware it also collects the reply text (choice 0), so the prefix index can learn the
//! blocks of prompt + reply: the engine keeps the reply's KV, and the next turn starts with it.

use super::reply::push_capped;
use super::reply::ReplyCall;
pub use super::reply::Usage;
use super::{agent_usage, Endpoint};
use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use std::borrow::Cow;

#[derive(Deserialize)]
struct UsageJson {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct WithUsage {
    #[serde(default)]
    usage: Option<UsageJson>,
    #[serde(default)]
    choices: Option<Vec<serde::de::IgnoredAny>>,
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow, default)]
    choices: Vec<Choice<'a>>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: u32,
    #[serde(borrow, default)]
    delta: Option<Text<'a>>,
    #[serde(borrow, default)]
    message: Option<Text<'a>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Text<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
}

/// Choice 0's text in a chat chunk (`delta.content`), chat response (`message.content`) or
/// completions response or chunk (`text`).
fn append_text(json: &[u8], out: &mut String) {
    let Ok(chunk) = serde_json::from_slice::<Chunk>(json) else {
        return;
    };
    for c in chunk.choices.into_iter().filter(|c| c.index == 0) {
        let text = c
            .delta
            .and_then(|d| d.content)
            .or(c.message.and_then(|m| m.content))
            .or(c.text);
        if let Some(t) = text {
            push_capped(out, &t);
        }
    }
}

fn parse_usage(json: &[u8]) -> Option<(Usage, bool)> {
    let v: WithUsage = serde_json::from_slice(json).ok()?;
    let u = v.usage?;
    let usage = Usage {
        prompt_tokens: u.prompt_tokens,
        cached_tokens: u
            .prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0),
        completion_tokens: u.completion_tokens,
    };
    let usage_only = v.choices.is_some_and(|c| c.is_empty());
    Some((usage, usage_only))
}

/// Rewrite a streaming request body so the engine reports usage: `,"stream_options":
/// {"include_usage":true}` goes before the final `}`. Only for bodies without
/// `stream_options`, so no key is ever duplicated. `None` if the body does not end in `}`.
pub fn ask_for_usage(body: &[u8]) -> Option<Bytes> {
    let end = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
    if body[end] != b'}' {
        return None;
    }
    let empty_object = body[..end]
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .is_some_and(|i| body[i] == b'{');
    let mut out = BytesMut::with_capacity(body.len() + 48);
    out.extend_from_slice(&body[..end]);
    if !empty_object {
        out.extend_from_slice(b",");
    }
    out.extend_from_slice(b"\"stream_options\":{\"include_usage\":true}}");
    Some(out.freeze())
}

/// Watches one response body for `usage`.
pub struct UsageTap {
    /// The API the reply speaks: where its usage and text are.
    api: Endpoint,
    stream: bool,
    /// Remove the usage-only SSE event (kvroute asked for it, the client did not).
    strip: bool,
    /// An SSE event not yet complete (streams) or the whole body so far (non-streams).
    pending: BytesMut,
    pub usage: Option<Usage>,
    /// Choice 0's text so far, when collecting.
    pub reply: Option<String>,
    /// The tool calls an agent API's reply made, when collecting.
    pub calls: Vec<ReplyCall>,
    /// Rewrite the client's `usage.prompt_tokens_details.cached_tokens` to this (`Some(None)`:
    /// remove it): a disaggregated request's decode server counts the prefix it read from the
    /// prefill server as cached.
    rewrite_cached: Option<Option<u64>>,
}

/// Non-streamed bodies larger than this are not parsed for usage (they are passed through).
const MAX_BUFFERED_BODY: usize = 1 << 20;

impl UsageTap {
    /// `collect_reply`: also gather choice 0's text into `reply`.
    pub fn new(stream: bool, strip: bool, collect_reply: bool) -> UsageTap {
        UsageTap {
            api: Endpoint::Chat,
            stream,
            strip,
            pending: BytesMut::new(),
            usage: None,
            reply: collect_reply.then(String::new),
            calls: Vec::new(),
            rewrite_cached: None,
        }
    }

    /// Rewrite the cached tokens of the client's usage to `cached` (chat and completions;
    /// none: remove the figure, as vllm-router does when the prefill server reports none).
    /// A non-streamed body is then held whole until it ends.
    pub fn rewriting_cached(self, cached: Option<u64>) -> UsageTap {
        UsageTap {
            rewrite_cached: Some(cached),
            ..self
        }
    }

    /// The prefill server's hit came in after the reply started (SGLang's legs run at once):
    /// the figure a rewriting tap writes from now on.
    pub fn update_cached(&mut self, cached: Option<u64>) {
        if self.rewrite_cached.is_some() {
            self.rewrite_cached = Some(cached);
        }
    }

    /// The tap for a reply in `api` (chat's and completions' shape unless told).
    pub fn speaking(self, api: Endpoint) -> UsageTap {
        UsageTap { api, ..self }
    }

    /// The reply so far came from an earlier attempt (a stream continued on this backend):
    /// the text collected starts with it.
    pub fn replying_after(&mut self, text: &str) {
        if let Some(r) = self.reply.as_mut() {
            push_capped(r, text);
        }
    }

    /// Usage in a body or event, and whether the event holds nothing else.
    fn usage_of(&self, json: &[u8]) -> Option<(Usage, bool)> {
        match self.api {
            Endpoint::Chat | Endpoint::Completions => parse_usage(json),
            Endpoint::Responses => agent_usage::responses_usage(json).map(|u| (u, false)),
            Endpoint::Messages => agent_usage::messages_usage(json, self.usage).map(|u| (u, false)),
        }
    }

    fn text_of(&mut self, json: &[u8]) {
        let Some(out) = self.reply.as_mut() else {
            return;
        };
        match self.api {
            Endpoint::Chat | Endpoint::Completions => append_text(json, out),
            Endpoint::Responses => agent_usage::responses_text(json, out, &mut self.calls),
            Endpoint::Messages => agent_usage::messages_text(json, out, &mut self.calls),
        }
    }

    /// Inspect (and for streams, possibly rewrite) one body chunk on its way to the client.
    pub fn filter(&mut self, body: &mut Option<Bytes>, end_of_stream: bool) {
        if let (false, Some(cached)) = (self.stream, self.rewrite_cached) {
            self.hold_and_rewrite(body, end_of_stream, cached);
            return;
        }
        if !self.stream {
            if let Some(b) = body.as_ref() {
                if self.pending.len() + b.len() <= MAX_BUFFERED_BODY {
                    self.pending.extend_from_slice(b);
                }
            }
            if end_of_stream && !self.pending.is_empty() {
                let body = self.pending.split();
                self.usage = self.usage_of(&body).map(|(u, _)| u);
                self.text_of(&body);
            }
            return;
        }
        let Some(chunk) = body.take() else {
            if end_of_stream && !self.pending.is_empty() {
                *body = Some(self.pending.split().freeze());
            }
            return;
        };
        let collecting = self.reply.is_some();
        if self.pending.is_empty() && !self.strip && !collecting && !contains(&chunk, b"\"usage\"")
        {
            // The common case: no usage here, nothing held back.
            let held = chunk.len() - complete_prefix(&chunk);
            if held == 0 || end_of_stream {
                *body = Some(chunk);
                return;
            }
            self.pending.extend_from_slice(&chunk[chunk.len() - held..]);
            *body = Some(chunk.slice(..chunk.len() - held));
            return;
        }
        self.pending.extend_from_slice(&chunk);
        let complete = if end_of_stream {
            self.pending.len()
        } else {
            complete_prefix(&self.pending)
        };
        let events = self.pending.split_to(complete);
        let mut out = BytesMut::with_capacity(events.len());
        for event in split_events(&events) {
            if let Some(json) = event_data(event) {
                self.text_of(json);
            }
            if let Some(json) = event_data(event).filter(|j| contains(j, b"\"usage\"")) {
                if let Some((mut usage, usage_only)) = self.usage_of(json) {
                    if let Some(c) = self.rewrite_cached {
                        usage.cached_tokens = c.unwrap_or(0);
                    }
                    self.usage = Some(usage);
                    if usage_only && self.strip {
                        continue;
                    }
                    if let Some(json) = self.rewrite_cached.and_then(|c| with_cached(json, c)) {
                        out.extend_from_slice(b"data: ");
                        out.extend_from_slice(&json);
                        out.extend_from_slice(b"\n\n");
                        continue;
                    }
                }
            }
            out.extend_from_slice(event);
        }
        *body = Some(out.freeze());
    }
}

impl UsageTap {
    /// A non-streamed body whose usage is rewritten: held until it ends, then sent rewritten
    /// (as it came when it is too large to hold or has no usage to rewrite).
    fn hold_and_rewrite(&mut self, body: &mut Option<Bytes>, end: bool, cached: Option<u64>) {
        if let Some(b) = body.take() {
            self.pending.extend_from_slice(&b);
        }
        if self.pending.len() > MAX_BUFFERED_BODY {
            self.rewrite_cached = None;
            *body = Some(self.pending.split().freeze());
            return;
        }
        if !end {
            return;
        }
        let whole = self.pending.split().freeze();
        self.usage = self.usage_of(&whole).map(|(u, _)| Usage {
            cached_tokens: cached.unwrap_or(0),
            ..u
        });
        self.text_of(&whole);
        *body = Some(with_cached(&whole, cached).map_or(whole, Bytes::from));
    }
}

/// `json` (a chat or completions body or chunk with `usage`) with its cached prompt tokens set
/// to `cached`, or removed; `None` when it has no usage object.
fn with_cached(json: &[u8], cached: Option<u64>) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(json).ok()?;
    let usage = v.get_mut("usage")?.as_object_mut()?;
    match cached {
        Some(c) => {
            let details = usage
                .entry("prompt_tokens_details")
                .or_insert_with(|| serde_json::json!({}));
            if !details.is_object() {
                *details = serde_json::json!({});
            }
            details["cached_tokens"] = serde_json::Value::from(c);
        }
        None => {
            if let Some(d) = usage
                .get_mut("prompt_tokens_details")
                .and_then(|d| d.as_object_mut())
            {
                d.remove("cached_tokens");
            }
        }
    }
    serde_json::to_vec(&v).ok()
}

pub(super) fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Length of the prefix made of whole SSE events (each ends with a blank line).
pub(super) fn complete_prefix(buf: &[u8]) -> usize {
    let mut end = 0;
    let mut i = 0;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' && buf[i + 1] == b'\n' {
            end = i + 2;
            i += 2;
        } else if i + 3 < buf.len() && &buf[i..i + 4] == b"\r\n\r\n" {
            end = i + 4;
            i += 4;
        } else {
            i += 1;
        }
    }
    end
}

/// Whole events, each with its terminating blank line.
pub(super) fn split_events(buf: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i + 1 < buf.len() {
        let sep = if buf[i] == b'\n' && buf[i + 1] == b'\n' {
            2
        } else if i + 3 < buf.len() && &buf[i..i + 4] == b"\r\n\r\n" {
            4
        } else {
            0
        };
        if sep > 0 {
            out.push(&buf[start..i + sep]);
            start = i + sep;
            i = start;
        } else {
            i += 1;
        }
    }
    if start < buf.len() {
        out.push(&buf[start..]);
    }
    out
}

/// The JSON of an event's `data:` line, if it has one that is not `[DONE]` (after an
/// `event:` line in the Responses and Messages streams).
pub(super) fn event_data(event: &[u8]) -> Option<&[u8]> {
    let mut line = event;
    let text = loop {
        if let Some(text) = line.strip_prefix(b"data:") {
            break text;
        }
        let next = line.iter().position(|&b| b == b'\n')?;
        line = &line[next + 1..];
    };
    let text = text.strip_prefix(b" ").unwrap_or(text);
    let end = text
        .iter()
        .position(|&b| b == b'\n' || b == b'\r')
        .unwrap_or(text.len());
    let json = &text[..end];
    (json != b"[DONE]").then_some(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONTENT: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"index\":0}]}\n\n";
    const USAGE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    fn run(tap: &mut UsageTap, pieces: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, p) in pieces.iter().enumerate() {
            let mut body = Some(Bytes::copy_from_slice(p));
            tap.filter(&mut body, i + 1 == pieces.len());
            if let Some(b) = body {
                out.extend_from_slice(&b);
            }
        }
        out
    }

    #[test]
    fn asks_for_usage_without_duplicating_keys() {
        let b = ask_for_usage(br#"{"model":"m","stream":true}  "#).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["model"], "m");
        assert_eq!(
            &ask_for_usage(b"{}").unwrap()[..],
            br#"{"stream_options":{"include_usage":true}}"#
        );
        assert!(ask_for_usage(b"[1]").is_none());
    }

    #[test]
    fn strips_the_usage_chunk_it_asked_for() {
        let mut tap = UsageTap::new(true, true, false);
        let all = format!("{CONTENT}{CONTENT}{USAGE}{DONE}");
        let out = run(&mut tap, &[all.as_bytes()]);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("{CONTENT}{CONTENT}{DONE}")
        );
        assert_eq!(
            tap.usage,
            Some(Usage {
                prompt_tokens: 100,
                cached_tokens: 64,
                completion_tokens: 2,
            })
        );
    }

    #[test]
    fn keeps_the_usage_chunk_the_client_asked_for() {
        let mut tap = UsageTap::new(true, false, false);
        let all = format!("{CONTENT}{USAGE}{DONE}");
        let out = run(&mut tap, &[all.as_bytes()]);
        assert_eq!(String::from_utf8(out).unwrap(), all);
        assert_eq!(tap.usage.unwrap().cached_tokens, 64);
    }

    #[test]
    fn events_split_across_reads_are_reassembled() {
        let all = format!("{CONTENT}{USAGE}{DONE}");
        let bytes = all.as_bytes();
        for cut in 1..bytes.len() {
            for strip in [false, true] {
                let mut tap = UsageTap::new(true, strip, false);
                let out = run(&mut tap, &[&bytes[..cut], &bytes[cut..]]);
                let want = if strip {
                    format!("{CONTENT}{DONE}")
                } else {
                    all.clone()
                };
                assert_eq!(String::from_utf8(out).unwrap(), want, "cut at {cut}");
                assert_eq!(tap.usage.unwrap().prompt_tokens, 100);
            }
        }
    }

    #[test]
    fn content_without_usage_passes_unchanged_and_unheld() {
        let mut tap = UsageTap::new(true, false, false);
        let mut body = Some(Bytes::from(CONTENT));
        tap.filter(&mut body, false);
        assert_eq!(body.unwrap(), Bytes::from(CONTENT));
        assert!(tap.usage.is_none());
    }

    #[test]
    fn reply_text_is_collected_from_streams_and_bodies() {
        let mut tap = UsageTap::new(true, true, true);
        let all = format!("{CONTENT}{CONTENT}{USAGE}{DONE}");
        let bytes = all.as_bytes();
        let out = run(&mut tap, &[&bytes[..30], &bytes[30..]]);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("{CONTENT}{CONTENT}{DONE}")
        );
        assert_eq!(tap.reply.as_deref(), Some("hihi"));
        let mut tap = UsageTap::new(false, false, true);
        let body = br#"{"choices":[{"index":0,"message":{"role":"assistant","content":"whole reply"}}],"usage":{"prompt_tokens":3}}"#;
        run(&mut tap, &[body]);
        assert_eq!(tap.reply.as_deref(), Some("whole reply"));
        let mut tap = UsageTap::new(true, false, true);
        run(
            &mut tap,
            &[
                b"data: {\"choices\":[{\"index\":0,\"text\":\"abc\"}]}\n\n",
                b"data: [DONE]\n\n",
            ],
        );
        assert_eq!(tap.reply.as_deref(), Some("abc"));
    }

    /// What an engine's response is made of, and bytes that are none of it.
    fn response() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let piece = prop_oneof![
            Just(CONTENT.as_bytes().to_vec()),
            Just(USAGE.as_bytes().to_vec()),
            Just(DONE.as_bytes().to_vec()),
            Just(b"data: {\"usage\":null}\r\n\r\n".to_vec()),
            Just(b": keep-alive\n\n".to_vec()),
            Just(b"\r\n".to_vec()),
            Just(b"\n".to_vec()),
            proptest::collection::vec(any::<u8>(), 0..12),
        ];
        proptest::collection::vec(piece, 0..12).prop_map(|v| v.concat())
    }

    /// `data` cut at `cuts` (taken modulo its length) into the reads a tap sees.
    fn reads<'a>(data: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (data.len() + 1)).collect();
        at.extend([0, data.len()]);
        at.sort_unstable();
        at.dedup();
        at.windows(2).map(|w| &data[w[0]..w[1]]).collect()
    }

    proptest::proptest! {
        /// Nothing the engine sends is lost, repeated or reordered, however its reads split
        /// it: without stripping the client gets the engine's bytes; with it, what one whole
        /// read would give. The usage and the reply text found do not depend on the split.
        #[test]
        fn any_split_of_any_response_passes_through(
            data in response(),
            cuts in proptest::collection::vec(0usize..4096, 0..8),
            streamed: bool,
            strip: bool,
            collect: bool,
        ) {
            let mut whole = UsageTap::new(streamed, strip, collect);
            let once = run(&mut whole, &[&data]);
            let mut split = UsageTap::new(streamed, strip, collect);
            let out = run(&mut split, &reads(&data, &cuts));
            if !(streamed && strip) {
                proptest::prop_assert_eq!(&out, &data);
            }
            proptest::prop_assert_eq!(&out, &once);
            proptest::prop_assert_eq!(split.usage, whole.usage);
            proptest::prop_assert_eq!(split.reply, whole.reply);
        }
    }

    #[test]
    fn agent_streams_name_their_events() {
        let messages = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3,\"cache_read_input_tokens\":61,\"output_tokens\":1}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":4}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let bytes = messages.as_bytes();
        for cut in [1, 40, 150, bytes.len() - 3] {
            let mut tap = UsageTap::new(true, false, true).speaking(Endpoint::Messages);
            let out = run(&mut tap, &[&bytes[..cut], &bytes[cut..]]);
            assert_eq!(out, bytes, "passed through unchanged");
            let want = Usage {
                prompt_tokens: 64,
                cached_tokens: 61,
                completion_tokens: 4,
            };
            assert_eq!((tap.usage, tap.reply.as_deref()), (Some(want), Some("Hi")));
        }
        let responses = concat!(
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Yes\"}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"output\":[{\"type\":\"message\",\"content\":[{\"type\":\"output_text\",\"text\":\"Yes\"}]}],\"usage\":{\"input_tokens\":50,\"input_tokens_details\":{\"cached_tokens\":32},\"output_tokens\":1}}}\n\n",
        );
        let mut tap = UsageTap::new(true, false, true).speaking(Endpoint::Responses);
        assert_eq!(run(&mut tap, &[responses.as_bytes()]), responses.as_bytes());
        assert_eq!(
            tap.usage.map(|u| (u.prompt_tokens, u.cached_tokens)),
            Some((50, 32))
        );
        assert_eq!(tap.reply.as_deref(), Some("Yes"));
    }

    #[test]
    fn non_streamed_body_usage() {
        let mut tap = UsageTap::new(false, false, false);
        let body = br#"{"choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":0}}}"#;
        let out = run(&mut tap, &[&body[..20], &body[20..]]);
        assert_eq!(out, body);
        assert_eq!(
            tap.usage,
            Some(Usage {
                prompt_tokens: 7,
                cached_tokens: 0,
                completion_tokens: 0,
            })
        );
    }

    #[test]
    fn a_split_requests_usage_says_the_prefill_servers_hit() {
        // Streamed: the usage chunk is rewritten, the other events pass as they came.
        let mut tap = UsageTap::new(true, false, false).rewriting_cached(Some(128));
        let token = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let mut body = Some(Bytes::from(format!("{token}{USAGE}data: [DONE]\n\n")));
        tap.filter(&mut body, true);
        let out = String::from_utf8(body.unwrap().to_vec()).unwrap();
        assert!(out.starts_with(token), "{out}");
        assert!(out.ends_with("data: [DONE]\n\n"), "{out}");
        let usage = out.lines().find(|l| l.contains("usage")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&usage["data: ".len()..]).unwrap();
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 128);
        assert_eq!(v["usage"]["prompt_tokens"], 100);
        assert_eq!(tap.usage.unwrap().cached_tokens, 128);

        // Not streamed: held whole, then rewritten; no figure from the prefill server removes
        // the decode server's.
        let mut tap = UsageTap::new(false, false, false).rewriting_cached(None);
        let whole = br#"{"choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":7}}}"#;
        let mut first = Some(Bytes::from_static(&whole[..20]));
        tap.filter(&mut first, false);
        assert!(first.is_none(), "held until the body ends");
        let mut rest = Some(Bytes::from_static(&whole[20..]));
        tap.filter(&mut rest, true);
        let v: serde_json::Value = serde_json::from_slice(&rest.unwrap()).unwrap();
        assert!(
            v["usage"]["prompt_tokens_details"]
                .get("cached_tokens")
                .is_none(),
            "{v}"
        );
        assert_eq!(v["choices"][0]["message"]["content"], "x");
        assert_eq!(tap.usage.unwrap().cached_tokens, 0);
        // A body without usage goes as it came.
        assert!(with_cached(b"{\"choices\":[]}", Some(3)).is_none());
        let v: serde_json::Value = serde_json::from_slice(
            &with_cached(br#"{"usage":{"prompt_tokens":5}}"#, Some(3)).unwrap(),
        )
        .unwrap();
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
    }
}
