//! The agent APIs' typed stream events, read as chat's: Responses' `response.output_text.delta`
//! and `response.completed` (usage, and the end), Anthropic Messages' `content_block_delta`,
//! `message_start` (the prompt's usage), `message_delta` (the output's) and `message_stop`.

use serde_json::Value;

use super::stream_event::{Event, Usage};

fn u(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or(0)
}

fn text(t: Option<&Value>) -> Event {
    match t.and_then(Value::as_str) {
        Some(t) if !t.is_empty() => Event::Content(t.to_owned()),
        _ => Event::Ignored,
    }
}

/// A tool call's opening: an item or block of type `kind`, its id in field `id`.
fn tool_call(item: &Value, kind: &str, id: &str) -> Event {
    match (
        item["type"].as_str(),
        item[id].as_str(),
        item["name"].as_str(),
    ) {
        (Some(k), Some(call), Some(name)) if k == kind => Event::ToolCall {
            id: call.to_owned(),
            name: name.to_owned(),
            item: item["id"]
                .as_str()
                .filter(|i| *i != call)
                .map(str::to_owned),
        },
        _ => Event::Ignored,
    }
}

/// The event a typed payload means, or `None` for a payload without a `type` (chat's).
/// `start` keeps a Messages stream's prompt usage until its `message_delta`.
pub(super) fn typed(v: &Value, start: &mut Option<Usage>) -> Option<Event> {
    let kind = v.get("type")?.as_str()?;
    Some(match kind {
        "response.output_text.delta" | "response.function_call_arguments.delta" => {
            text(v.get("delta"))
        }
        "response.output_item.added" => tool_call(&v["item"], "function_call", "call_id"),
        // OpenAI's API (and vLLM's) ends a response at `max_output_tokens` as incomplete; the
        // replay asks for exactly that many tokens, so it is the reply's end, not a failure.
        // Any other reason (a content filter) is one.
        "response.completed" | "response.incomplete"
            if kind == "response.completed"
                || v["response"]["incomplete_details"]["reason"] == "max_output_tokens" =>
        {
            let usage = &v["response"]["usage"];
            let id = v["response"]["id"].as_str().map(str::to_owned);
            let usage = Usage {
                prompt_tokens: u(usage, "input_tokens"),
                completion_tokens: u(usage, "output_tokens"),
                cached_tokens: usage["input_tokens_details"]["cached_tokens"].as_u64(),
            };
            Event::Final(usage, id)
        }
        "response.failed" | "response.incomplete" | "error" => {
            let msg = v["message"]
                .as_str()
                .or(v["response"]["error"]["message"].as_str())
                .unwrap_or(kind);
            Event::Error(msg.to_owned())
        }
        "content_block_start" => tool_call(&v["content_block"], "tool_use", "id"),
        "content_block_delta" => text(v["delta"].get("text").or(v["delta"].get("partial_json"))),
        "message_start" => {
            let usage = &v["message"]["usage"];
            let read = u(usage, "cache_read_input_tokens");
            *start = Some(Usage {
                prompt_tokens: u(usage, "input_tokens")
                    + read
                    + u(usage, "cache_creation_input_tokens"),
                completion_tokens: 0,
                cached_tokens: Some(read),
            });
            Event::Ignored
        }
        "message_delta" => Event::Usage(Usage {
            completion_tokens: u(&v["usage"], "output_tokens"),
            ..start.unwrap_or_default()
        }),
        "message_stop" => Event::Done,
        _ => Event::Ignored,
    })
}

#[cfg(test)]
mod tests {
    use crate::replay::sse::{Event, SseParser, Usage};

    #[test]
    fn responses_and_messages_streams_read_as_chat() {
        let responses = concat!(
            "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{}}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\" a\"}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":50,\"output_tokens\":1,\"input_tokens_details\":{\"cached_tokens\":32}}}}\n\n",
        );
        let ev = SseParser::new().push(responses.as_bytes());
        assert_eq!(
            ev,
            [
                Event::Ignored,
                Event::Content(" a".into()),
                Event::Final(
                    Usage {
                        prompt_tokens: 50,
                        completion_tokens: 1,
                        cached_tokens: Some(32)
                    },
                    None
                )
            ]
        );
        let messages = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":8,\"cache_read_input_tokens\":32,\"cache_creation_input_tokens\":0,\"output_tokens\":0}}}\n\n",
            "event: ping\ndata: {\"type\":\"ping\"}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" b\"}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":2}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"busy\"}}\n\n",
        );
        let ev = SseParser::new().push(messages.as_bytes());
        assert_eq!(
            ev,
            [
                Event::Ignored,
                Event::Ignored,
                Event::Content(" b".into()),
                Event::Usage(Usage {
                    prompt_tokens: 40,
                    completion_tokens: 2,
                    cached_tokens: Some(32)
                }),
                Event::Done,
                Event::Error("busy".into()),
            ]
        );
    }

    #[test]
    fn a_response_ended_at_its_output_limit_is_whole_and_any_other_incomplete_is_not() {
        let at_limit = "event: response.incomplete\ndata: {\"type\":\"response.incomplete\",\"response\":{\"id\":\"resp_1\",\"incomplete_details\":{\"reason\":\"max_output_tokens\"},\"usage\":{\"input_tokens\":5,\"output_tokens\":3}}}\n\n";
        let ev = SseParser::new().push(at_limit.as_bytes());
        assert!(
            matches!(&ev[0], Event::Final(u, Some(id)) if id == "resp_1" && u.completion_tokens == 3)
        );
        let filtered = "event: response.incomplete\ndata: {\"type\":\"response.incomplete\",\"response\":{\"incomplete_details\":{\"reason\":\"content_filter\"}}}\n\n";
        let ev = SseParser::new().push(filtered.as_bytes());
        assert!(matches!(&ev[0], Event::Error(_)), "{ev:?}");
    }

    #[test]
    fn tool_calls_open_and_stream_their_arguments_as_content() {
        let responses = concat!(
            "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"item\":{\"type\":\"function_call\",\"id\":\"fc_1\",\"call_id\":\"call_1\",\"name\":\"run\",\"arguments\":\"\"}}\n\n",
            "event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"delta\":\"{\\\"a\\\":1}\"}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_9\",\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n",
        );
        let ev = SseParser::new().push(responses.as_bytes());
        assert_eq!(
            ev[..2],
            [
                Event::ToolCall {
                    id: "call_1".into(),
                    name: "run".into(),
                    item: Some("fc_1".into()),
                },
                Event::Content("{\"a\":1}".into()),
            ]
        );
        assert!(matches!(&ev[2], Event::Final(_, Some(id)) if id == "resp_9"));
        let messages = concat!(
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"run\",\"input\":{}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"a\\\"\"}}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
        );
        let ev = SseParser::new().push(messages.as_bytes());
        assert_eq!(
            ev,
            [
                Event::ToolCall {
                    id: "toolu_1".into(),
                    name: "run".into(),
                    item: None,
                },
                Event::Content("{\"a\"".into()),
                Event::Ignored,
            ]
        );
    }
}
