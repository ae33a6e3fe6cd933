//! The bodies of vLLM's NixlConnector prefill/decode protocol, as its own proxy writes them
//! (vLLM `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`,
//! `send_request_to_service`, at 030ea52e): the prefill server gets the request for one
//! token, not streamed, asking to hold its KV for a remote decode; its answer carries the
//! `kv_transfer_params` (`NixlConnector.request_finished`: `do_remote_prefill`,
//! `remote_block_ids`, `remote_engine_id`, `remote_host`, `remote_port`, ...) that the decode
//! server's copy of the original request then names.

use bytes::Bytes;
use serde_json::{Map, Value};

/// The id both legs carry: vLLM's prefill server holds the blocks under it, and the decode
/// server's notification frees them by it (toy_proxy_server.py sends one uuid on both).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// The prefill leg's body: `body` (a chat or completions request) for one token, not
/// streamed, its KV held for a remote decode. `None` when `body` is not a JSON object.
pub fn prefill_body(body: &[u8]) -> Option<Bytes> {
    let mut v: Map<String, Value> = serde_json::from_slice(body).ok()?;
    v.insert(
        "kv_transfer_params".into(),
        serde_json::json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    v.insert("stream".into(), Value::Bool(false));
    v.insert("max_tokens".into(), Value::from(1));
    // Only where the client sent it: vLLM reads either, and the smaller wins.
    if v.contains_key("max_completion_tokens") {
        v.insert("max_completion_tokens".into(), Value::from(1));
    }
    // A one-token answer cannot honour a minimum, and a non-streamed one takes no stream
    // options.
    for k in ["stream_options", "min_tokens", "min_completion_tokens"] {
        v.remove(k);
    }
    serde_json::to_vec(&v).ok().map(Bytes::from)
}

/// What the prefill server answered: the parameters the decode leg needs, and the prompt
/// tokens it found cached (`usage.prompt_tokens_details.cached_tokens`: the client's true hit,
/// which the decode server's usage overstates by the transferred prefix).
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillAnswer {
    /// `None`: the engine held nothing for a remote decode (an abort, or its one token ended
    /// the reply): the decode server must compute the prompt itself.
    pub params: Option<Value>,
    pub cached_tokens: Option<u64>,
}

pub fn prefill_answer(body: &[u8]) -> Option<PrefillAnswer> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let params = v
        .get("kv_transfer_params")
        .filter(|p| p.is_object())
        .filter(|p| p.get("do_remote_prefill") == Some(&Value::Bool(true)))
        .cloned();
    let cached_tokens = v
        .pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64);
    Some(PrefillAnswer {
        params,
        cached_tokens,
    })
}

/// Set `params` as the body's `kv_transfer_params` (the decode leg), in `fields` (the body's
/// other per-attempt fields). A client's own `kv_transfer_params` never reaches an engine: it
/// would make a decode server read blocks from wherever it names.
pub fn set_params(fields: &mut Map<String, Value>, params: Option<&Value>) {
    match params {
        Some(p) => {
            fields.insert("kv_transfer_params".into(), p.clone());
        }
        None => {
            fields.remove("kv_transfer_params");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_prefill_leg_asks_for_one_held_token() {
        let body = json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "stream": true, "stream_options": {"include_usage": true},
            "max_tokens": 300, "max_completion_tokens": 300, "min_tokens": 10,
            "temperature": 0.2,
        });
        let out = prefill_body(body.to_string().as_bytes()).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["stream"], false);
        assert_eq!(
            (
                v["max_tokens"].as_u64(),
                v["max_completion_tokens"].as_u64()
            ),
            (Some(1), Some(1))
        );
        for gone in ["stream_options", "min_tokens"] {
            assert!(v.get(gone).is_none(), "{gone}");
        }
        assert_eq!(v["temperature"], 0.2);
        assert_eq!(v["messages"], body["messages"]);
        assert_eq!(
            v["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null})
        );
        // Not asked for, not added.
        let out = prefill_body(br#"{"model":"m","prompt":"x"}"#).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert!(v.get("max_completion_tokens").is_none());
        assert!(prefill_body(b"[1]").is_none());
    }

    #[test]
    fn the_prefill_answer_gives_the_decode_legs_params_and_the_true_hit() {
        let params = json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_host": "10.0.0.1",
            "remote_port": 5600, "tp_size": 1});
        let body = json!({"id": "x", "choices": [], "kv_transfer_params": params,
            "usage": {"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": 512}}});
        let a = prefill_answer(body.to_string().as_bytes()).unwrap();
        assert_eq!(a.params.as_ref(), Some(&params));
        assert_eq!(a.cached_tokens, Some(512));
        // An abort (or a reply its one token ended) holds nothing.
        for none in [
            json!({"choices": []}),
            json!({"kv_transfer_params": null}),
            json!({"kv_transfer_params": {"do_remote_prefill": false}}),
        ] {
            let a = prefill_answer(none.to_string().as_bytes()).unwrap();
            assert_eq!(a.params, None, "{none}");
        }
        assert!(prefill_answer(b"not json").is_none());
    }

    #[test]
    fn a_clients_own_params_are_replaced_or_removed() {
        let mut fields: Map<String, Value> =
            serde_json::from_value(json!({"kv_transfer_params": {"remote_host": "evil"}})).unwrap();
        set_params(&mut fields, None);
        assert!(!fields.contains_key("kv_transfer_params"));
        set_params(&mut fields, Some(&json!({"do_remote_prefill": true})));
        assert_eq!(fields["kv_transfer_params"]["do_remote_prefill"], true);
    }
}
