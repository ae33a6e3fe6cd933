//! The canonical prompt: the bytes an engine would tokenize after applying its chat template,
//! and a deterministic stand-in tokenizer over them (about 4 bytes a token, as for English
//! text with a BPE vocabulary). Prefix caching works on these bytes, so any two requests whose
//! canonical prompts share a prefix share cached blocks, exactly as on a real engine. With
//! `--tokenizer` the bytes counted and cached are the prompt's token ids instead (see
//! `tokenizer`), 4 bytes each, so the count below is then exact.

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

use crate::sim::error::ApiError;

pub const BYTES_PER_TOKEN: usize = 4;

/// Tokens of a token stream (`tokenizer`): `ceil(bytes / 4)`, which for the stand-in is its
/// whole tokenizer.
pub fn count_tokens(canonical_len: usize) -> u64 {
    canonical_len.div_ceil(BYTES_PER_TOKEN) as u64
}

/// A ChatML-like template. The generation prompt at the end makes turn n's stream a prefix of
/// turn n+1's once the reply is appended, as real chat templates do.
pub const TURN_START: &str = "<|im_start|>";
/// Also what follows the reply in the next turn's stream, so the engine caches it with it.
pub const TURN_END: &str = "<|im_end|>\n";
pub const GENERATION_PROMPT: &str = "<|im_start|>assistant\n";

/// `v` as a chat template's `tojson` writes it (Jinja's, which Hugging Face templates use, and
/// minijinja's): keys sorted, `", "` and `": "` between items, and `<`, `>`, `&` and `'`
/// escaped, so that HTML cannot be spelled.
pub fn template_json(v: &Value) -> String {
    struct Spaced;
    impl serde_json::ser::Formatter for Spaced {
        fn begin_array_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
        ) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }
    fn sorted(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                Value::Object(
                    keys.into_iter()
                        .map(|k| (k.clone(), sorted(&m[k])))
                        .collect(),
                )
            }
            Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Spaced);
    // A Value always serializes.
    let _ = serde::Serialize::serialize(&sorted(v), &mut ser);
    String::from_utf8_lossy(&out)
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
        .replace('\'', "\\u0027")
}

/// Renders a chat body's `tools` as the turn templates open with (real templates list them in
/// the system prompt): what the model reads of them costs prefill and is cached like the rest.
pub fn render_tools(tools: Option<&Value>) -> Result<Vec<u8>, ApiError> {
    match tools {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(list)) if list.is_empty() => Ok(Vec::new()),
        Some(list @ Value::Array(_)) => {
            let list = template_json(list);
            Ok(format!("{TURN_START}tools\n{list}{TURN_END}").into_bytes())
        }
        Some(_) => Err(ApiError::bad_request("'tools' must be an array")),
    }
}

/// Renders chat `messages` through the template; an assistant's tool calls follow its text,
/// as `template_json` writes them.
pub fn render_chat(messages: &Value) -> Result<Vec<u8>, ApiError> {
    render_chat_continued(messages, false)
}

/// `render_chat`, or with `continue_final` (vLLM's `continue_final_message` without a
/// generation prompt) the last message left open: the reply continues its text.
pub fn render_chat_continued(messages: &Value, continue_final: bool) -> Result<Vec<u8>, ApiError> {
    let list = messages
        .as_array()
        .ok_or_else(|| ApiError::bad_request("'messages' must be an array"))?;
    if list.is_empty() {
        return Err(ApiError::bad_request("'messages' must not be empty"));
    }
    let mut out = String::new();
    for (i, message) in list.iter().enumerate() {
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad_request(format!("messages[{i}].role must be a string")))?;
        out.push_str(TURN_START);
        out.push_str(role);
        out.push('\n');
        render_content(message.get("content"), i, &mut out)?;
        // Tool calls are part of what the model saw; render them by value so replays match.
        // As a template's `{% if message['tool_calls'] %}`: none, null or empty renders nothing.
        let calls = message.get("tool_calls").filter(|c| match c {
            Value::Null => false,
            Value::Array(a) => !a.is_empty(),
            _ => true,
        });
        if let Some(calls) = calls {
            out.push_str(&template_json(calls));
        }
        if continue_final && i + 1 == list.len() {
            return Ok(out.into_bytes());
        }
        out.push_str(TURN_END);
    }
    out.push_str(GENERATION_PROMPT);
    Ok(out.into_bytes())
}

fn render_content(content: Option<&Value>, i: usize, out: &mut String) -> Result<(), ApiError> {
    match content {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(text)) => {
            out.push_str(text);
            Ok(())
        }
        Some(Value::Array(parts)) => {
            for part in parts {
                match part.get("text").and_then(Value::as_str) {
                    Some(text) if part.get("type").and_then(Value::as_str) == Some("text") => {
                        out.push_str(text)
                    }
                    // Images and other parts stand in by hash: same part, same bytes, and a
                    // base64 image does not bloat the canonical prompt.
                    _ if part.is_object() => out.push_str(&format!(
                        "<part:{:016x}>",
                        xxh3_64(part.to_string().as_bytes())
                    )),
                    _ => {
                        return Err(ApiError::bad_request(format!(
                            "messages[{i}].content parts must be objects"
                        )))
                    }
                }
            }
            Ok(())
        }
        Some(_) => Err(ApiError::bad_request(format!(
            "messages[{i}].content must be a string, an array of parts or null"
        ))),
    }
}

/// Renders a completions `prompt` (or embeddings `input`): a string, an array of strings, an
/// array of token ids or an array of arrays of token ids. A batch is served as one
/// concatenated prompt. Token ids become 4 little-endian bytes each, so the stand-in
/// tokenizer counts exactly one token per id and a 16-token block is 16 ids.
pub fn render_completion(prompt: &Value) -> Result<Vec<u8>, ApiError> {
    const SHAPE: &str =
        "'prompt' must be a string, an array of strings, or an array of (arrays of) token ids";
    match prompt {
        Value::String(s) => Ok(s.as_bytes().to_vec()),
        Value::Array(items) if items.is_empty() => {
            Err(ApiError::bad_request("'prompt' must not be empty"))
        }
        Value::Array(items) => {
            let mut out = Vec::new();
            match &items[0] {
                Value::String(_) => {
                    for item in items {
                        out.extend_from_slice(
                            item.as_str()
                                .ok_or_else(|| ApiError::bad_request(SHAPE))?
                                .as_bytes(),
                        );
                    }
                }
                Value::Number(_) => push_token_ids(items, &mut out)?,
                Value::Array(_) => {
                    for item in items {
                        let ids = item
                            .as_array()
                            .ok_or_else(|| ApiError::bad_request(SHAPE))?;
                        push_token_ids(ids, &mut out)?;
                    }
                }
                _ => return Err(ApiError::bad_request(SHAPE)),
            }
            Ok(out)
        }
        _ => Err(ApiError::bad_request(SHAPE)),
    }
}

/// Whether a completions `prompt` (or embeddings `input`) was sent as token ids, which an
/// engine takes as they are instead of tokenizing.
pub fn is_token_ids(prompt: &Value) -> bool {
    prompt
        .as_array()
        .and_then(|items| items.first())
        .is_some_and(|first| first.is_number() || first.is_array())
}

fn push_token_ids(ids: &[Value], out: &mut Vec<u8>) -> Result<(), ApiError> {
    for id in ids {
        let id = id
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| ApiError::bad_request("token ids must be integers in 0..2^32"))?;
        out.extend_from_slice(&id.to_le_bytes());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tokenizer_rounds_up() {
        assert_eq!(count_tokens(0), 0);
        assert_eq!(count_tokens(1), 1);
        assert_eq!(count_tokens(4), 1);
        assert_eq!(count_tokens(5), 2);
    }

    #[test]
    fn chat_template_is_fixed() {
        let bytes = render_chat(&json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        ]))
        .unwrap();
        let text = String::from_utf8(bytes).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(text.len(), 96);
        assert_eq!(count_tokens(text.len()), 24);
    }

    #[test]
    fn next_turn_extends_previous_stream() {
        let turn1 = json!([{"role": "user", "content": "question"}]);
        let turn2 = json!([
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": " tok0 tok1"},
            {"role": "user", "content": "more"},
        ]);
        let a = render_chat(&turn1).unwrap();
        let b = render_chat(&turn2).unwrap();
        assert!(b.starts_with(&a));
    }

    #[test]
    fn chat_rejects_bad_shapes() {
        assert!(render_chat(&json!("hi")).is_err());
        assert!(render_chat(&json!([])).is_err());
        assert!(render_chat(&json!([{"content": "no role"}])).is_err());
        assert!(render_chat(&json!([{"role": "user", "content": 5}])).is_err());
        assert!(render_chat(&json!([{"role": "user", "content": ["bare"]}])).is_err());
    }

    #[test]
    fn completion_prompt_shapes() {
        assert_eq!(render_completion(&json!("abcde")).unwrap(), b"abcde");
        assert_eq!(render_completion(&json!(["ab", "cd"])).unwrap(), b"abcd");
        let ids = render_completion(&json!([1, 2, 3])).unwrap();
        assert_eq!(count_tokens(ids.len()), 3);
        let nested = render_completion(&json!([[1, 2], [3]])).unwrap();
        assert_eq!(nested, ids);
        assert!(is_token_ids(&json!([1, 2])) && is_token_ids(&json!([[1], [2]])));
        assert!(!is_token_ids(&json!("1 2")) && !is_token_ids(&json!(["a"])));
        assert!(render_completion(&json!([])).is_err());
        assert!(render_completion(&json!([1, "a"])).is_err());
        assert!(render_completion(&json!([-1])).is_err());
        assert!(render_completion(&json!({"a": 1})).is_err());
    }
}

#[cfg(test)]
mod template_json_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn writes_json_as_a_templates_tojson_does() {
        let v = json!({"type": "function", "function": {"name": "run", "arguments": "{\"a\":1}"},
                       "list": [1, "<b>&'"]});
        assert_eq!(
            template_json(&v),
            r#"{"function": {"arguments": "{\"a\":1}", "name": "run"}, "list": [1, "\u003cb\u003e\u0026\u0027"], "type": "function"}"#
        );
    }
}
