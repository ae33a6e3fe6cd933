//! A continuation's events, rewritten to read as the stream the client already has: the first
//! stream's `id`, `created` and `model`, no second opening (chat's role-only first chunk), and
//! `usage` that counts both engines' work (the replayed text is the continuation's prompt, and
//! the tokens sent before the cut are output). Messages events keep their own shape
//! (`messages::rewrite`).

use bytes::{BufMut, Bytes, BytesMut};
use serde_json::Value;

use super::{messages, responses, Seen};
use crate::request::reply::Usage;
use crate::request::usage::{event_data, split_events};
use crate::request::Endpoint;

/// Rewrites the events of one continuation.
#[derive(Debug, Clone)]
pub struct Splice {
    mode: Mode,
    id: Option<String>,
    created: Option<u64>,
    model: Option<String>,
    /// Usage before the cut: the first attempt's prompt, and the tokens the client has.
    prompt_before: u64,
    completion_before: u64,
}

/// The continuation's events: OpenAI's chunks, Messages' events, or chat chunks that become a
/// Responses stream's.
#[derive(Debug, Clone)]
enum Mode {
    Chunks,
    Messages,
    Responses(Box<responses::Translator>),
}

impl Splice {
    /// `prompt_before`: the prompt tokens of the attempts before this one.
    pub fn new(endpoint: Endpoint, seen: &Seen, prompt_before: u64) -> Splice {
        let mode = match endpoint {
            Endpoint::Messages => Mode::Messages,
            Endpoint::Responses => {
                Mode::Responses(Box::new(responses::Translator::new(seen, prompt_before)))
            }
            _ => Mode::Chunks,
        };
        Splice {
            mode,
            id: seen.id.clone(),
            created: seen.created,
            model: seen.model.clone(),
            prompt_before,
            completion_before: seen.tokens,
        }
    }

    /// The continuation engine's `usage` with the attempts' before it added, as the client is
    /// told it.
    pub fn summed(&self, u: Usage) -> Usage {
        Usage {
            prompt_tokens: u.prompt_tokens + self.prompt_before,
            cached_tokens: u.cached_tokens,
            completion_tokens: u.completion_tokens + self.completion_before,
        }
    }

    /// The continuation speaks chat whatever the client's API (Responses goes on as chat).
    pub fn speaks_chat(&self) -> bool {
        matches!(self.mode, Mode::Responses(_))
    }

    /// Rewrite `body` (whole events) in place.
    pub fn filter(&mut self, body: &mut Option<Bytes>) {
        if let Mode::Responses(t) = &mut self.mode {
            t.filter(body);
            return;
        }
        let messages = matches!(self.mode, Mode::Messages);
        let Some(b) = body.as_ref() else {
            return;
        };
        let mut out = BytesMut::with_capacity(b.len() + 64);
        for event in split_events(b) {
            let Some(json) = event_data(event) else {
                out.extend_from_slice(event);
                continue;
            };
            let Ok(Value::Object(mut v)) = serde_json::from_slice::<Value>(json) else {
                out.extend_from_slice(event);
                continue;
            };
            if v.contains_key("error") {
                out.extend_from_slice(event);
                continue;
            }
            let keep = match messages {
                true => messages::rewrite(&mut v, self.prompt_before, self.completion_before),
                false => self.rewrite(&mut v),
            };
            if !keep {
                continue;
            }
            if let Some(kind) = v.get("type").and_then(Value::as_str).filter(|_| messages) {
                out.put_slice(format!("event: {kind}\n").as_bytes());
            }
            out.put_slice(b"data: ");
            if serde_json::to_writer((&mut out).writer(), &v).is_err() {
                continue;
            }
            out.put_slice(b"\n\n");
        }
        *body = Some(out.freeze());
    }

    /// Rewrite one event; `false`: drop it (it only opens a stream the client has open).
    fn rewrite(&self, v: &mut serde_json::Map<String, Value>) -> bool {
        for (key, value) in [
            ("id", self.id.clone().map(Value::from)),
            ("created", self.created.map(Value::from)),
            ("model", self.model.clone().map(Value::from)),
        ] {
            if let (Some(slot), Some(value)) = (v.get_mut(key), value) {
                *slot = value;
            }
        }
        let mut says_something = false;
        if let Some(Value::Array(choices)) = v.get_mut("choices") {
            for c in choices.iter_mut() {
                if let Some(Value::Object(d)) = c.get_mut("delta") {
                    d.remove("role");
                    d.retain(|_, x| !x.is_null() && x.as_str() != Some(""));
                    says_something |= !d.is_empty();
                }
                says_something |= c.get("text").is_some_and(|t| t.as_str() != Some(""))
                    || c.get("finish_reason").is_some_and(|f| !f.is_null());
            }
        }
        if let Some(Value::Object(u)) = v.get_mut("usage") {
            says_something = true;
            let add = |u: &mut serde_json::Map<String, Value>, k: &str, n: u64| {
                let was = u.get(k).and_then(Value::as_u64).unwrap_or(0);
                u.insert(k.into(), (was + n).into());
            };
            add(u, "prompt_tokens", self.prompt_before);
            add(u, "completion_tokens", self.completion_before);
            if u.contains_key("total_tokens") {
                add(
                    u,
                    "total_tokens",
                    self.prompt_before + self.completion_before,
                );
            }
        }
        says_something
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splice() -> Splice {
        let seen = Seen {
            id: Some("chatcmpl-1".into()),
            created: Some(100),
            model: Some("m".into()),
            text: " a b".into(),
            tokens: 2,
            ..Seen::default()
        };
        Splice::new(Endpoint::Chat, &seen, 50)
    }

    fn run(s: &mut Splice, text: &str) -> Vec<Value> {
        let mut body = Some(Bytes::copy_from_slice(text.as_bytes()));
        s.filter(&mut body);
        let out = String::from_utf8(body.unwrap().to_vec()).unwrap();
        out.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let data = e.strip_prefix("data: ").unwrap();
                serde_json::from_str(data).unwrap_or(Value::String(data.into()))
            })
            .collect()
    }

    #[test]
    fn continuation_events_take_the_first_streams_identity() {
        let events = run(
            &mut splice(),
            concat!(
                "data: {\"id\":\"chatcmpl-2\",\"created\":200,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
                "data: {\"id\":\"chatcmpl-2\",\"created\":200,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" c\"},\"finish_reason\":null}]}\n\n",
                "data: {\"id\":\"chatcmpl-2\",\"created\":200,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
                "data: {\"id\":\"chatcmpl-2\",\"created\":200,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":60,\"completion_tokens\":3,\"total_tokens\":63}}\n\n",
                "data: [DONE]\n\n",
            ),
        );
        assert_eq!(events.len(), 4, "{events:?}");
        for e in &events[..3] {
            assert_eq!(e["id"], "chatcmpl-1");
            assert_eq!(e["created"], 100);
        }
        assert_eq!(events[0]["choices"][0]["delta"]["content"], " c");
        assert_eq!(events[1]["choices"][0]["finish_reason"], "stop");
        let u = &events[2]["usage"];
        assert_eq!(
            (
                u["prompt_tokens"].as_u64(),
                u["completion_tokens"].as_u64(),
                u["total_tokens"].as_u64()
            ),
            (Some(110), Some(5), Some(115))
        );
        assert_eq!(events[3], Value::String("[DONE]".into()));
    }

    #[test]
    fn error_events_pass_for_the_transcript_to_catch() {
        let events = run(&mut splice(), "data: {\"error\":{\"message\":\"x\"}}\n\n");
        assert_eq!(events[0]["error"]["message"], "x");
    }
}
