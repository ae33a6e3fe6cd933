//! Incremental parsing of an OpenAI-style server-sent-event stream.
//!
//! Network reads cut events anywhere (even inside a UTF-8 character), so bytes are buffered
//! until a blank line closes an event.

use serde_json::Value;

pub use super::stream_event::{Event, Usage};

#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    /// A Messages stream's prompt usage, from its `message_start`.
    start: Option<Usage>,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds one network read; returns the events it completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<Event> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let raw: Vec<u8> = self.buf.drain(..end + sep).take(end).collect();
            events.push(parse_event(&String::from_utf8_lossy(&raw), &mut self.start));
        }
        events
    }

    /// Bytes left over when the stream ended: a truncated final event.
    pub fn pending(&self) -> usize {
        self.buf.iter().filter(|b| !b.is_ascii_whitespace()).count()
    }
}

/// Position and length of the first blank-line separator (`\n\n` or `\r\n\r\n`).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

fn parse_event(raw: &str, start: &mut Option<Usage>) -> Event {
    // Multi-line `data:` fields join with newlines (SSE spec); other fields are irrelevant here.
    let data: Vec<&str> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect();
    if data.is_empty() {
        return Event::Ignored;
    }
    let payload = data.join("\n");
    let payload = payload.trim();
    if payload == "[DONE]" {
        return Event::Done;
    }
    let v: Value = match serde_json::from_str(payload) {
        Ok(v) => v,
        Err(e) => return Event::Error(format!("bad SSE payload ({e}): {}", clip(payload))),
    };
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        let msg = err
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_owned);
        return Event::Error(msg.unwrap_or_else(|| err.to_string()));
    }
    if let Some(e) = super::agent_sse::typed(&v, start) {
        return e;
    }
    let text = content_of(&v);
    let usage = usage_of(&v);
    match (text, usage) {
        (Some(t), Some(u)) => Event::ContentAndUsage(t, u),
        (Some(t), None) => Event::Content(t),
        (None, Some(u)) => Event::Usage(u),
        (None, None) => Event::Ignored,
    }
}

fn content_of(v: &Value) -> Option<String> {
    let choice = v.get("choices")?.get(0)?;
    let text = choice
        .get("delta")
        .and_then(|d| d.get("content"))
        .or_else(|| choice.get("text"))
        .and_then(Value::as_str)?;
    (!text.is_empty()).then(|| text.to_owned())
}

fn usage_of(v: &Value) -> Option<Usage> {
    let u = v.get("usage").filter(|u| u.is_object())?;
    Some(Usage {
        prompt_tokens: u.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0),
        completion_tokens: u
            .get("completion_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        cached_tokens: u
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64),
    })
}

pub fn clip(s: &str) -> String {
    const MAX: usize = 300;
    if s.len() <= MAX {
        return s.to_owned();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: &str =
        r#"data: {"choices":[{"index":0,"delta":{"content":" tok1"},"finish_reason":null}]}"#;
    const USAGE: &str = r#"data: {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":4}}}"#;

    #[test]
    fn content_usage_and_done() {
        let mut p = SseParser::new();
        let stream = format!("{CHUNK}\n\n{USAGE}\n\ndata: [DONE]\n\n");
        let ev = p.push(stream.as_bytes());
        assert_eq!(
            ev,
            vec![
                Event::Content(" tok1".into()),
                Event::Usage(Usage {
                    prompt_tokens: 10,
                    completion_tokens: 3,
                    cached_tokens: Some(4)
                }),
                Event::Done,
            ]
        );
        assert_eq!(p.pending(), 0);
    }

    #[test]
    fn events_split_across_reads_at_every_byte() {
        let stream = format!("{CHUNK}\n\n{CHUNK}\r\n\r\ndata: [DONE]\n\n");
        for cut in 0..stream.len() {
            let mut p = SseParser::new();
            let mut ev = p.push(&stream.as_bytes()[..cut]);
            ev.extend(p.push(&stream.as_bytes()[cut..]));
            assert_eq!(ev.len(), 3, "cut at {cut}");
            assert_eq!(ev[2], Event::Done);
        }
    }

    #[test]
    fn role_only_and_empty_content_are_ignored() {
        let mut p = SseParser::new();
        let ev = p.push(
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n: keep-alive\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"\"}}]}\n\n",
        );
        assert_eq!(ev, vec![Event::Ignored, Event::Ignored, Event::Ignored]);
    }

    #[test]
    fn completions_text_and_errors() {
        let mut p = SseParser::new();
        let ev = p.push(
            b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\ndata: {\"error\":{\"message\":\"boom\"}}\n\ndata: nope\n\n",
        );
        assert_eq!(ev[0], Event::Content("hi".into()));
        assert_eq!(ev[1], Event::Error("boom".into()));
        assert!(matches!(ev[2], Event::Error(_)));
    }

    #[test]
    fn truncated_tail_is_pending() {
        let mut p = SseParser::new();
        assert!(p.push(CHUNK.as_bytes()).is_empty());
        assert!(p.pending() > 0);
    }
}
