//! Continuing a stream on another backend after its engine died: what the client has been sent
//! ([`Transcript`]), the request that asks another engine to go on from there
//! ([`continuation`]), and the continuation's events made to read as the same stream
//! ([`Splice`]).
//!
//! An engine continues a text faithfully when it is given the prompt and the text so far as
//! the start of its answer: chat through vLLM's and SGLang's `continue_final_message` (an
//! assistant message last, no generation prompt; llama.cpp continues a final assistant message
//! by itself), completions by appending the text to the prompt. What cannot be continued that
//! way is refused with a reason ([`Unfit`]), and the stream ends with an error event as before.
//! Anthropic's Messages streams are continued the same way, in their own events (`messages`).

mod messages;
mod responses;
mod splice;
mod transcript;

pub use splice::Splice;
pub use transcript::{Seen, Transcript};

/// Text kept to replay; a longer stream is not continued (its replay would be a prompt of its
/// own size anyway).
const MAX_TEXT_BYTES: usize = 4 << 20;

/// Whether streams of `endpoint` can be continued (every API kvroute routes can).
pub fn continues(endpoint: Endpoint) -> bool {
    Endpoint::ALL.contains(&endpoint)
}

/// Where a continuation of `endpoint` is sent, when not where the request went: a Responses
/// stream goes on as chat (`responses`).
pub fn continuation_path(endpoint: Endpoint) -> Option<&'static str> {
    (endpoint == Endpoint::Responses).then_some(responses::CONTINUATION_PATH)
}

use bytes::Bytes;
use serde_json::{Map, Value};

use super::Endpoint;

/// Why a cut stream cannot be continued elsewhere (the `outcome` label of
/// `kvroute_migrations_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unfit {
    /// The API's continuation is not implemented (none is left; kept for the metric's
    /// label set).
    Api,
    /// A Responses request continuing a stored response: its history is on the engine that
    /// stored it, not in the body.
    History,
    /// Several choices (`n`, `best_of`, a list of prompts): one text cannot stand for them.
    Choices,
    /// Log probabilities of tokens the new engine did not sample.
    Logprobs,
    /// Guided decoding (`response_format`, `guided_*`, `structured_outputs`): the grammar's
    /// state at the cut is not something the prompt can carry.
    Guided,
    /// A tool call had started: its arguments may stop mid-JSON.
    ToolCall,
    /// Reasoning text had been streamed apart from the answer: the engine cannot be told to
    /// go on inside its reasoning.
    Reasoning,
    /// Completions with `echo`: the new engine would echo the prompt again.
    Echo,
    /// A prompt of token ids: the text so far cannot be appended without the model's tokenizer.
    TokenIds,
    /// More text than kvroute keeps to replay.
    TooLong,
    /// The body could not be read back as JSON (kvroute parsed it once, so not expected).
    Body,
}

impl Unfit {
    pub fn as_str(self) -> &'static str {
        match self {
            Unfit::Api => "unfit_api",
            Unfit::History => "unfit_history",
            Unfit::Choices => "unfit_choices",
            Unfit::Logprobs => "unfit_logprobs",
            Unfit::Guided => "unfit_guided",
            Unfit::ToolCall => "unfit_tool_call",
            Unfit::Reasoning => "unfit_reasoning",
            Unfit::Echo => "unfit_echo",
            Unfit::TokenIds => "unfit_token_ids",
            Unfit::TooLong => "unfit_too_long",
            Unfit::Body => "unfit_body",
        }
    }

    pub const ALL: [Unfit; 11] = [
        Unfit::Api,
        Unfit::History,
        Unfit::Choices,
        Unfit::Logprobs,
        Unfit::Guided,
        Unfit::ToolCall,
        Unfit::Reasoning,
        Unfit::Echo,
        Unfit::TokenIds,
        Unfit::TooLong,
        Unfit::Body,
    ];
}

/// What the continuation asks for.
#[derive(Debug, PartialEq)]
pub enum Continuation {
    /// The request to send the next backend.
    Body(Bytes),
    /// The output limit is already reached: the text is whole, the stream only needs its end.
    Complete,
}

/// Output-length fields, each reduced by the tokens already sent.
const LIMITS: [&str; 2] = ["max_tokens", "max_completion_tokens"];

/// Guided-decoding fields of vLLM's and SGLang's OpenAI servers (`guided_*` are vLLM's older
/// names, `structured_outputs` its newer one; `regex`, `ebnf`, `json_schema` SGLang's).
const GUIDED: [&str; 9] = [
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",
    "ebnf",
    "json_schema",
    "grammar",
];

/// The request that continues `body` (as last sent) after what `seen` says the client has.
pub fn continuation(endpoint: Endpoint, body: &[u8], seen: &Seen) -> Result<Continuation, Unfit> {
    if let Some(u) = seen.unfit {
        return Err(u);
    }
    if !continues(endpoint) {
        return Err(Unfit::Api);
    }
    let Ok(Value::Object(mut v)) = serde_json::from_slice::<Value>(body) else {
        return Err(Unfit::Body);
    };
    if endpoint == Endpoint::Responses {
        let remaining = match v.get("max_output_tokens").and_then(Value::as_u64) {
            Some(n) if n <= seen.tokens => return Ok(Continuation::Complete),
            Some(n) => Some(n - seen.tokens),
            None => None,
        };
        let chat = responses::continuation(v, &seen.text, remaining)?;
        return serde_json::to_vec(&chat)
            .map(|b| Continuation::Body(b.into()))
            .map_err(|_| Unfit::Body);
    }
    match endpoint {
        Endpoint::Messages => messages::check_fit(&v)?,
        _ => check_fit(&v)?,
    }
    for field in LIMITS {
        if let Some(n) = v.get(field).and_then(Value::as_u64) {
            if n <= seen.tokens {
                return Ok(Continuation::Complete);
            }
            v.insert(field.into(), (n - seen.tokens).into());
        }
    }
    if let Some(n) = v.get("min_tokens").and_then(Value::as_u64) {
        v.insert("min_tokens".into(), n.saturating_sub(seen.tokens).into());
    }
    match endpoint {
        Endpoint::Chat => continue_chat(&mut v, &seen.text)?,
        Endpoint::Messages => messages::continue_messages(&mut v, &seen.text)?,
        _ => continue_prompt(&mut v, &seen.text)?,
    }
    serde_json::to_vec(&v)
        .map(|b| Continuation::Body(b.into()))
        .map_err(|_| Unfit::Body)
}

/// The events that end a stream whose text is whole but whose end was lost: a last chunk with
/// `finish_reason: "length"` when the output limit was what ended it (`with_finish`), the
/// usage chunk when the client asked for one (`usage`: prompt and completion tokens), then
/// `[DONE]`. Messages and Responses streams end in their own events, always with usage.
pub fn final_events(
    endpoint: Endpoint,
    seen: &Seen,
    with_finish: bool,
    usage: Option<(u64, u64)>,
) -> Bytes {
    match endpoint {
        Endpoint::Messages => {
            let usage = usage.unwrap_or((0, seen.tokens));
            return messages::final_events(seen, with_finish, usage).into();
        }
        Endpoint::Responses => {
            let usage = usage.unwrap_or((0, seen.tokens));
            return responses::final_events(seen, with_finish, usage).into();
        }
        _ => {}
    }
    let mut out = Vec::new();
    let object = match endpoint {
        Endpoint::Completions => "text_completion",
        _ => "chat.completion.chunk",
    };
    if with_finish && !seen.finished {
        let choice = match endpoint {
            Endpoint::Completions => {
                serde_json::json!({"index": 0, "text": "", "finish_reason": "length"})
            }
            _ => serde_json::json!({"index": 0, "delta": {}, "finish_reason": "length"}),
        };
        let event = serde_json::json!({
            "id": seen.id, "object": object, "created": seen.created, "model": seen.model,
            "choices": [choice],
        });
        out.extend_from_slice(format!("data: {event}\n\n").as_bytes());
    }
    if let Some((prompt, completion)) = usage {
        let event = serde_json::json!({
            "id": seen.id, "object": object, "created": seen.created, "model": seen.model,
            "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion},
        });
        out.extend_from_slice(format!("data: {event}\n\n").as_bytes());
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
    out.into()
}

/// Request options whose output another engine cannot go on with.
fn check_fit(v: &Map<String, Value>) -> Result<(), Unfit> {
    let set = |k: &str| {
        !matches!(
            v.get(k),
            None | Some(Value::Null) | Some(Value::Bool(false))
        )
    };
    let more_than_one = |k: &str| v.get(k).and_then(Value::as_u64).is_some_and(|n| n > 1);
    if more_than_one("n") || more_than_one("best_of") {
        return Err(Unfit::Choices);
    }
    if set("logprobs") || set("top_logprobs") {
        return Err(Unfit::Logprobs);
    }
    let plain_format = match v.get("response_format") {
        None | Some(Value::Null) => true,
        Some(f) => f.get("type").and_then(Value::as_str) == Some("text"),
    };
    if !plain_format || GUIDED.iter().any(|k| set(k)) {
        return Err(Unfit::Guided);
    }
    if set("echo") {
        return Err(Unfit::Echo);
    }
    Ok(())
}

/// The text so far as the answer's start: an assistant message last, continued rather than
/// closed. A client's own final assistant message (a prefill it asked to continue) is extended.
fn continue_chat(v: &mut Map<String, Value>, text: &str) -> Result<(), Unfit> {
    let continuing = v.get("continue_final_message") == Some(&Value::Bool(true));
    let Some(Value::Array(messages)) = v.get_mut("messages") else {
        return Err(Unfit::Body);
    };
    let last = messages.last_mut().filter(|_| continuing);
    match last {
        Some(m) if m.get("role").and_then(Value::as_str) == Some("assistant") => {
            match m.get_mut("content") {
                Some(Value::String(s)) => s.push_str(text),
                _ => return Err(Unfit::Body),
            }
        }
        _ => messages.push(serde_json::json!({"role": "assistant", "content": text})),
    }
    v.insert("continue_final_message".into(), true.into());
    v.insert("add_generation_prompt".into(), false.into());
    Ok(())
}

/// The text so far appended to the prompt.
fn continue_prompt(v: &mut Map<String, Value>, text: &str) -> Result<(), Unfit> {
    match v.get_mut("prompt") {
        Some(Value::String(p)) => p.push_str(text),
        Some(Value::Array(list)) if list.len() == 1 => match &mut list[0] {
            Value::String(p) => p.push_str(text),
            _ => return Err(Unfit::TokenIds),
        },
        Some(Value::Array(list)) if list.iter().all(Value::is_number) => {
            return Err(Unfit::TokenIds)
        }
        Some(Value::Array(_)) => return Err(Unfit::Choices),
        _ => return Err(Unfit::Body),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(text: &str, tokens: u64) -> Seen {
        Seen {
            text: text.into(),
            tokens,
            ..Seen::default()
        }
    }

    fn body_of(c: Continuation) -> Value {
        match c {
            Continuation::Body(b) => serde_json::from_slice(&b).unwrap(),
            Continuation::Complete => panic!("expected a body"),
        }
    }

    #[test]
    fn chat_goes_on_from_an_assistant_message() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":10,"min_tokens":4}"#;
        let v = body_of(continuation(Endpoint::Chat, body, &seen(" tok0 tok1", 2)).unwrap());
        assert_eq!(v["messages"][1]["role"], "assistant");
        assert_eq!(v["messages"][1]["content"], " tok0 tok1");
        assert_eq!(v["continue_final_message"], true);
        assert_eq!(v["add_generation_prompt"], false);
        assert_eq!(v["max_tokens"], 8);
        assert_eq!(v["min_tokens"], 2);
        assert_eq!(v["stream"], true);
    }

    #[test]
    fn a_clients_own_prefill_is_extended() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Sure:"}],"continue_final_message":true,"add_generation_prompt":false}"#;
        let v = body_of(continuation(Endpoint::Chat, body, &seen(" one", 1)).unwrap());
        assert_eq!(v["messages"].as_array().unwrap().len(), 2);
        assert_eq!(v["messages"][1]["content"], "Sure: one");
    }

    #[test]
    fn completions_append_to_the_prompt() {
        let body = br#"{"model":"m","prompt":"Once","max_tokens":5}"#;
        let v = body_of(continuation(Endpoint::Completions, body, &seen(" upon", 1)).unwrap());
        assert_eq!(v["prompt"], "Once upon");
        assert_eq!(v["max_tokens"], 4);
        let body = br#"{"model":"m","prompt":["Once"]}"#;
        let v = body_of(continuation(Endpoint::Completions, body, &seen(" upon", 1)).unwrap());
        assert_eq!(v["prompt"][0], "Once upon");
    }

    #[test]
    fn messages_go_on_from_a_final_assistant_message() {
        let body = br#"{"model":"m","max_tokens":10,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
        let v = body_of(continuation(Endpoint::Messages, body, &seen(" tok0", 1)).unwrap());
        assert_eq!(v["messages"][1]["role"], "assistant");
        assert_eq!(v["messages"][1]["content"], " tok0");
        assert_eq!(v["max_tokens"], 9);
        // Anthropic's API continues a final assistant message by itself.
        assert!(v.get("continue_final_message").is_none());
    }

    #[test]
    fn a_reached_limit_needs_no_continuation() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":3}"#;
        assert_eq!(
            continuation(Endpoint::Chat, body, &seen(" a b c", 3)),
            Ok(Continuation::Complete)
        );
    }

    #[test]
    fn a_whole_text_ends_with_its_finish_and_done() {
        let mut s = seen(" a b", 2);
        s.id = Some("c1".into());
        let end = final_events(Endpoint::Chat, &s, true, None);
        let text = std::str::from_utf8(&end).unwrap();
        let (first, done) = text.split_once("\n\n").unwrap();
        let v: Value = serde_json::from_str(first.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(v["id"], "c1");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(done, "data: [DONE]\n\n");
        s.finished = true;
        assert_eq!(
            &final_events(Endpoint::Chat, &s, true, None)[..],
            b"data: [DONE]\n\n"
        );
        let end = final_events(Endpoint::Chat, &s, true, Some((10, 2)));
        let text = std::str::from_utf8(&end).unwrap();
        let (first, done) = text.split_once("\n\n").unwrap();
        let v: Value = serde_json::from_str(first.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 2);
        assert_eq!(v["usage"]["total_tokens"], 12);
        assert_eq!(done, "data: [DONE]\n\n");
    }

    #[test]
    fn what_cannot_be_continued_says_why() {
        let chat = |extra: &str| {
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#)
        };
        for (extra, why) in [
            (r#","n":2"#, Unfit::Choices),
            (r#","logprobs":true"#, Unfit::Logprobs),
            (r#","top_logprobs":3"#, Unfit::Logprobs),
            (
                r#","response_format":{"type":"json_object"}"#,
                Unfit::Guided,
            ),
            (r#","guided_regex":"a+""#, Unfit::Guided),
            (r#","structured_outputs":{"json":{}}"#, Unfit::Guided),
        ] {
            let body = chat(extra);
            assert_eq!(
                continuation(Endpoint::Chat, body.as_bytes(), &seen("x", 1)),
                Err(why),
                "{extra}"
            );
        }
        let fine = chat(r#","n":1,"logprobs":false,"response_format":{"type":"text"}"#);
        assert!(continuation(Endpoint::Chat, fine.as_bytes(), &seen("x", 1)).is_ok());
        for (body, why) in [
            (r#"{"model":"m","prompt":[1,2,3]}"#, Unfit::TokenIds),
            (r#"{"model":"m","prompt":["a","b"]}"#, Unfit::Choices),
            (r#"{"model":"m","prompt":"a","echo":true}"#, Unfit::Echo),
            (r#"{"model":"m","prompt":"a","best_of":3}"#, Unfit::Choices),
        ] {
            assert_eq!(
                continuation(Endpoint::Completions, body.as_bytes(), &seen("x", 1)),
                Err(why),
                "{body}"
            );
        }
        let body = br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"output_format":{"type":"json_schema"}}"#;
        assert_eq!(
            continuation(Endpoint::Messages, body, &seen("x", 1)),
            Err(Unfit::Guided)
        );
        let mut tool = seen("x", 1);
        tool.unfit = Some(Unfit::ToolCall);
        let body = chat("");
        assert_eq!(
            continuation(Endpoint::Chat, body.as_bytes(), &tool),
            Err(Unfit::ToolCall)
        );
    }
}
