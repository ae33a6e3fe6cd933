//! Rewrites a Responses answer so that the response id the client sees is the stamped one
//! ([`super::response_id`]): in a whole body, and in every streamed `response.*` event that
//! carries it. The engine's id is learned from the answer itself (the body's `id`, or the
//! first event's `response.id`) unless the request named it.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;

use super::usage::{complete_prefix, contains};

/// Bodies larger than this are passed through unstamped (a response object is a few KB).
const MAX_HELD_BYTES: usize = 8 << 20;

pub struct IdStamp {
    stream: bool,
    /// Engine ids, quoted as they appear in JSON, and the stamped ones.
    ids: Vec<(Vec<u8>, Vec<u8>)>,
    /// The answer's own id is known.
    learned: bool,
    /// Stamps an engine id.
    stamp: Box<dyn Fn(&str) -> String + Send + Sync>,
    pending: BytesMut,
    /// Gave up (a body too large to hold): pass the rest through.
    passing: bool,
}

#[derive(Deserialize)]
struct Ided {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    response: Option<Box<Ided>>,
}

fn quoted(s: &str) -> Vec<u8> {
    let mut q = Vec::with_capacity(s.len() + 2);
    q.push(b'"');
    q.extend_from_slice(s.as_bytes());
    q.push(b'"');
    q
}

fn replace_all(hay: &[u8], from: &[u8], to: &[u8], out: &mut BytesMut) {
    let mut rest = hay;
    while let Some(i) = rest.windows(from.len()).position(|w| w == from) {
        out.extend_from_slice(&rest[..i]);
        out.extend_from_slice(to);
        rest = &rest[i + from.len()..];
    }
    out.extend_from_slice(rest);
}

impl IdStamp {
    /// `engine_id`: the id the request named, if any (a stored response, or the one a new
    /// response continues).
    pub fn new(
        stream: bool,
        engine_id: Option<&str>,
        stamp: impl Fn(&str) -> String + Send + Sync + 'static,
    ) -> IdStamp {
        IdStamp {
            stream,
            ids: engine_id
                .map(|id| (quoted(id), quoted(&stamp(id))))
                .into_iter()
                .collect(),
            learned: false,
            stamp: Box::new(stamp),
            pending: BytesMut::new(),
            passing: false,
        }
    }

    fn learn(&mut self, json: &[u8]) {
        if self.learned {
            return;
        }
        // Only the head of the JSON is needed, but it must parse: take the whole event/body.
        let Ok(v) = serde_json::from_slice::<Ided>(json) else {
            return;
        };
        let id = v.response.and_then(|r| r.id).or(v.id);
        if let Some(id) = id.filter(|i| !i.is_empty()) {
            self.learned = true;
            let q = quoted(&id);
            if !self.ids.iter().any(|(from, _)| *from == q) {
                let stamped = quoted(&(self.stamp)(&id));
                self.ids.push((q, stamped));
            }
        }
    }

    fn rewrite(&self, data: &[u8], out: &mut BytesMut) {
        let mut found = self.ids.iter().filter(|(from, _)| contains(data, from));
        let (Some(first), second) = (found.next(), found.next()) else {
            out.extend_from_slice(data);
            return;
        };
        match second {
            None => replace_all(data, &first.0, &first.1, out),
            Some(_) => {
                let mut now = BytesMut::from(data);
                for (from, to) in &self.ids {
                    let mut next = BytesMut::with_capacity(now.len() + 64);
                    replace_all(&now, from, to, &mut next);
                    now = next;
                }
                out.extend_from_slice(&now);
            }
        }
    }

    pub fn filter(&mut self, body: &mut Option<Bytes>, end_of_stream: bool) {
        if self.passing {
            return;
        }
        if let Some(b) = body.take() {
            self.pending.extend_from_slice(&b);
        }
        if self.pending.len() > MAX_HELD_BYTES && !self.stream {
            log::warn!("a Responses body over {MAX_HELD_BYTES} bytes passes unstamped");
            self.passing = true;
            *body = Some(self.pending.split().freeze());
            return;
        }
        let ready = if end_of_stream {
            self.pending.len()
        } else if self.stream {
            complete_prefix(&self.pending)
        } else {
            0
        };
        if ready == 0 {
            *body = (end_of_stream).then(Bytes::new);
            return;
        }
        let held = self.pending.split_to(ready);
        let mut out = BytesMut::with_capacity(held.len() + 64);
        if self.stream {
            for event in super::usage::split_events(&held) {
                if let Some(json) = super::usage::event_data(event) {
                    self.learn(json);
                }
                self.rewrite(event, &mut out);
            }
        } else {
            self.learn(&held);
            self.rewrite(&held, &mut out);
        }
        *body = Some(out.freeze());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(id: &str) -> String {
        format!("resp_kvr1X_{id}")
    }

    fn run(tap: &mut IdStamp, pieces: &[&[u8]]) -> String {
        let mut out = Vec::new();
        for (i, p) in pieces.iter().enumerate() {
            let mut body = Some(Bytes::copy_from_slice(p));
            tap.filter(&mut body, i + 1 == pieces.len());
            if let Some(b) = body {
                out.extend_from_slice(&b);
            }
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn a_body_and_every_event_carry_the_stamped_id() {
        let body = br#"{"id":"resp_7","object":"response","output":[{"id":"msg_1","type":"message"}],"previous_response_id":"resp_6"}"#;
        for cut in [1, 10, body.len() - 1] {
            let mut t = IdStamp::new(false, None, stamp);
            let out = run(&mut t, &[&body[..cut], &body[cut..]]);
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(v["id"], "resp_kvr1X_resp_7");
            assert_eq!(v["output"][0]["id"], "msg_1");
        }
        let events = concat!(
            "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_9\",\"status\":\"in_progress\"}}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"item_id\":\"msg_2\",\"delta\":\"resp_9 is\"}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_9\",\"status\":\"completed\"}}\n\n",
        )
        .as_bytes();
        for cut in [5, 60, 130, events.len() - 2] {
            let mut t = IdStamp::new(true, None, stamp);
            let out = run(&mut t, &[&events[..cut], &events[cut..]]);
            assert_eq!(out.matches("\"resp_kvr1X_resp_9\"").count(), 2, "{out}");
            // Text that only mentions the id is not an id.
            assert!(out.contains("\"delta\":\"resp_9 is\""), "{out}");
        }
        // The id a request named (a stored response, or the one a new one continues) is
        // stamped too.
        let mut t = IdStamp::new(false, Some("resp_6"), stamp);
        let out = run(&mut t, &[body]);
        assert!(
            out.contains("\"previous_response_id\":\"resp_kvr1X_resp_6\""),
            "{out}"
        );
        assert!(out.contains("\"id\":\"resp_kvr1X_resp_7\""), "{out}");
    }
}
