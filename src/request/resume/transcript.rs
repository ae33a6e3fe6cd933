//! What the client of a stream has been sent: the stream's identity, choice 0's text and how
//! many tokens it took, and anything that makes it impossible to continue elsewhere. Fed the
//! events as they leave for the client (whole events: the usage tap holds back a split one).

use bytes::Bytes;
use serde::de::IgnoredAny;
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::VecDeque;

use super::{messages, responses, Unfit, MAX_TEXT_BYTES};
use crate::request::usage::{event_data, split_events};
use crate::request::Endpoint;

/// What the client has of the stream.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Seen {
    /// The first event's `id`, `created` and `model`: every spliced event carries them.
    pub id: Option<String>,
    pub created: Option<u64>,
    pub model: Option<String>,
    /// Choice 0's text.
    pub text: String,
    /// Events that carried text: one token each, as vLLM, SGLang and llama.cpp stream.
    pub tokens: u64,
    /// A `finish_reason` (Messages: a `message_delta`) was sent: the text is whole.
    pub finished: bool,
    /// How far the stream's closing events went, so that what ends it sends the rest:
    /// Messages 1 once its text block closed; Responses 1, 2, 3 once `output_text.done`,
    /// `content_part.done`, `output_item.done` were sent. Past 0 the engine had ended its text.
    pub closing: u8,
    /// Responses: the response object `response.created` announced, the message item's id,
    /// and the next `sequence_number`.
    pub opening: Option<serde_json::Value>,
    pub item_id: Option<String>,
    pub sequence: u64,
    pub unfit: Option<Unfit>,
}

#[derive(Deserialize)]
struct Event<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(default)]
    created: Option<u64>,
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    choices: Vec<Choice<'a>>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: u32,
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    finish_reason: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<IgnoredAny>,
    #[serde(default)]
    function_call: Option<IgnoredAny>,
    #[serde(borrow, default)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    reasoning: Option<Cow<'a, str>>,
}

/// The record of one stream (chat, completions or Messages).
#[derive(Debug, Default)]
pub struct Transcript {
    /// The stream's events: OpenAI's chunks (`None`), or Messages' or Responses' own.
    events: Option<Endpoint>,
    seen: Seen,
    /// Body bytes recorded as sent, and the record after each recent chunk: the proxy filters
    /// a few chunks before it writes them, and a failure in between loses those, so the record
    /// is brought back to what was written ([`Transcript::settle`]).
    forwarded: u64,
    checkpoints: VecDeque<Checkpoint>,
}

#[derive(Debug, Clone, Copy)]
struct Checkpoint {
    forwarded: u64,
    text_len: usize,
    tokens: u64,
    finished: bool,
    closing: u8,
    sequence: u64,
}

/// Chunks remembered for `settle`: more than the proxy ever holds filtered and unwritten
/// (Pingora's batch is its task channel's 4, plus the one being filtered).
const CHECKPOINTS: usize = 16;

impl Transcript {
    /// The record of a stream of `endpoint` (one that [`super::continues`]).
    pub fn new(endpoint: Endpoint) -> Transcript {
        let mut t = Transcript {
            events: matches!(endpoint, Endpoint::Messages | Endpoint::Responses)
                .then_some(endpoint),
            ..Transcript::default()
        };
        t.checkpoint();
        t
    }

    pub fn seen(&self) -> &Seen {
        &self.seen
    }

    fn checkpoint(&mut self) {
        if self.checkpoints.len() == CHECKPOINTS {
            self.checkpoints.pop_front();
        }
        self.checkpoints.push_back(Checkpoint {
            forwarded: self.forwarded,
            text_len: self.seen.text.len(),
            tokens: self.seen.tokens,
            finished: self.seen.finished,
            closing: self.seen.closing,
            sequence: self.seen.sequence,
        });
    }

    /// Only `written` body bytes reached the client: forget what was recorded past them.
    pub fn settle(&mut self, written: u64) {
        if written >= self.forwarded {
            return;
        }
        while self
            .checkpoints
            .back()
            .is_some_and(|c| c.forwarded > written)
        {
            self.checkpoints.pop_back();
        }
        match self.checkpoints.back().copied() {
            Some(c) => {
                self.forwarded = c.forwarded;
                self.seen.text.truncate(c.text_len);
                self.seen.tokens = c.tokens;
                self.seen.finished = c.finished;
                self.seen.closing = c.closing;
                self.seen.sequence = c.sequence;
            }
            // Further back than kept: what the client has is not known.
            None => {
                self.seen.unfit.get_or_insert(Unfit::Body);
            }
        }
    }

    /// Record `body` (whole events) as sent. An engine's error event (`{"error": …}`: vLLM,
    /// SGLang and llama.cpp report a failure mid-stream so) is not for the client: the body is
    /// taken, nothing of it is recorded, and its message returned, so the stream can be
    /// continued elsewhere from what the client had before it.
    pub fn observe(&mut self, body: &mut Option<Bytes>) -> Result<(), String> {
        let Some(b) = body.as_ref() else {
            return Ok(());
        };
        let before = (self.seen.text.len(), self.seen.tokens, self.seen.finished);
        let (unfit, closing, sequence) = (self.seen.unfit, self.seen.closing, self.seen.sequence);
        for event in split_events(b) {
            let Some(json) = event_data(event) else {
                continue;
            };
            let observed = match self.events {
                Some(Endpoint::Messages) => messages::observe(&mut self.seen, json),
                Some(_) => responses::observe(&mut self.seen, json),
                None => self.event(json),
            };
            if let Err(message) = observed {
                (self.seen.text, self.seen.tokens, self.seen.finished) =
                    (self.seen.text[..before.0].to_string(), before.1, before.2);
                (self.seen.unfit, self.seen.closing, self.seen.sequence) =
                    (unfit, closing, sequence);
                *body = None;
                return Err(message);
            }
        }
        if !b.is_empty() {
            self.forwarded += b.len() as u64;
            self.checkpoint();
        }
        Ok(())
    }

    fn event(&mut self, json: &[u8]) -> Result<(), String> {
        let Ok(e) = serde_json::from_slice::<Event>(json) else {
            return Ok(());
        };
        if let Some(err) = e.error {
            let message = err
                .get("message")
                .and_then(|m| m.as_str())
                .map_or_else(|| err.to_string(), str::to_owned);
            return Err(message);
        }
        let seen = &mut self.seen;
        if seen.id.is_none() {
            seen.id = e.id.map(Cow::into_owned);
            seen.created = e.created;
            seen.model = e.model.map(Cow::into_owned);
        }
        for c in e.choices {
            if c.index != 0 {
                seen.unfit.get_or_insert(Unfit::Choices);
                continue;
            }
            if c.finish_reason.is_some() {
                seen.finished = true;
            }
            let text = match c.delta {
                Some(d) => {
                    if d.tool_calls.is_some() || d.function_call.is_some() {
                        seen.unfit.get_or_insert(Unfit::ToolCall);
                    }
                    let reasoning = d.reasoning_content.or(d.reasoning);
                    if reasoning.is_some_and(|r| !r.is_empty()) {
                        seen.unfit.get_or_insert(Unfit::Reasoning);
                    }
                    d.content
                }
                None => c.text,
            };
            if let Some(t) = text.filter(|t| !t.is_empty()) {
                if seen.text.len() + t.len() > MAX_TEXT_BYTES {
                    seen.unfit.get_or_insert(Unfit::TooLong);
                    continue;
                }
                seen.text.push_str(&t);
                seen.tokens += 1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(t: &mut Transcript, s: &str) -> Result<Option<Bytes>, String> {
        let mut body = Some(Bytes::copy_from_slice(s.as_bytes()));
        t.observe(&mut body)?;
        Ok(body)
    }

    const ROLE: &str = "data: {\"id\":\"c1\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";

    fn token(t: &str) -> String {
        format!("data: {{\"id\":\"c1\",\"created\":7,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{t}\"}}}}]}}\n\n")
    }

    #[test]
    fn records_identity_text_and_tokens() {
        let mut t = Transcript::new(Endpoint::Chat);
        feed(&mut t, ROLE).unwrap();
        feed(&mut t, &(token(" a") + &token(" b"))).unwrap();
        let s = t.seen();
        assert_eq!(s.id.as_deref(), Some("c1"));
        assert_eq!(s.created, Some(7));
        assert_eq!(s.model.as_deref(), Some("m"));
        assert_eq!((s.text.as_str(), s.tokens, s.finished), (" a b", 2, false));
        feed(&mut t, "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n").unwrap();
        assert!(t.seen().finished);
        assert_eq!(t.seen().unfit, None);
    }

    #[test]
    fn completions_text_counts_too() {
        let mut t = Transcript::new(Endpoint::Chat);
        feed(
            &mut t,
            "data: {\"id\":\"cmpl-1\",\"choices\":[{\"index\":0,\"text\":\" x\"}]}\n\n",
        )
        .unwrap();
        assert_eq!((t.seen().text.as_str(), t.seen().tokens), (" x", 1));
    }

    #[test]
    fn an_engine_error_event_is_taken_and_nothing_of_its_chunk_recorded() {
        let mut t = Transcript::new(Endpoint::Chat);
        feed(&mut t, &token(" a")).unwrap();
        let err = feed(
            &mut t,
            &(token(" b") + "data: {\"error\":{\"message\":\"engine dead\",\"code\":500}}\n\n"),
        )
        .unwrap_err();
        assert_eq!(err, "engine dead");
        assert_eq!((t.seen().text.as_str(), t.seen().tokens), (" a", 1));
    }

    #[test]
    fn settles_back_to_what_was_written() {
        let mut t = Transcript::new(Endpoint::Chat);
        let (a, b) = (token(" a"), token(" b"));
        feed(&mut t, &a).unwrap();
        feed(&mut t, &b).unwrap();
        t.settle((a.len() + b.len()) as u64);
        assert_eq!((t.seen().text.as_str(), t.seen().tokens), (" a b", 2));
        // The second chunk was filtered but never written.
        t.settle(a.len() as u64);
        assert_eq!((t.seen().text.as_str(), t.seen().tokens), (" a", 1));
        feed(&mut t, &b).unwrap();
        assert_eq!((t.seen().text.as_str(), t.seen().tokens), (" a b", 2));
        t.settle(0);
        assert_eq!((t.seen().text.as_str(), t.seen().tokens), ("", 0));
    }

    #[test]
    fn tool_calls_reasoning_and_second_choices_are_unfit() {
        for (event, why) in [
            (
                "{\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}",
                Unfit::ToolCall,
            ),
            (
                "{\"choices\":[{\"index\":0,\"delta\":{\"reasoning_content\":\"hmm\"}}]}",
                Unfit::Reasoning,
            ),
            (
                "{\"choices\":[{\"index\":1,\"delta\":{\"content\":\"x\"}}]}",
                Unfit::Choices,
            ),
        ] {
            let mut t = Transcript::new(Endpoint::Chat);
            feed(&mut t, &format!("data: {event}\n\n")).unwrap();
            assert_eq!(t.seen().unfit, Some(why), "{event}");
        }
        let mut t = Transcript::new(Endpoint::Chat);
        feed(&mut t, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\",\"tool_calls\":null,\"reasoning_content\":null}}]}\n\n").unwrap();
        assert_eq!(t.seen().unfit, None);
    }
}
