//! A whole (not streamed) answer in the shape of the API it answers.

use serde_json::Value;

use super::response::{Answer, Timings, Usage};
use super::{messages_answer, responses_answer};
use crate::sim::text::openai::Endpoint;

/// The whole answer (a Responses answer is stored as it is made); llama.cpp's `timings`
/// beside a completion's `usage` when given.
pub fn whole(a: &Answer, text: &str, usage: Usage, timings: Option<Timings>) -> Value {
    match a.endpoint {
        Endpoint::Responses => responses_answer::completed(a, text, usage),
        Endpoint::Messages => messages_answer::message(a, text, usage),
        _ => a.completion(text, usage, timings),
    }
}
