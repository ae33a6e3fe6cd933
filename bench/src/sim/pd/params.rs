//! `kv_transfer_params`: what a request asks of P/D (`parse`) and what P answers
//! (`prefill_answer`), in vLLM NixlConnector's field names.
//!
//! A request's params are read as vLLM reads them: `do_remote_decode: true` makes this server
//! the prefill side, `do_remote_prefill: true` the decode side. The decode side needs
//! `remote_block_ids`, `remote_engine_id`, `remote_host` and `remote_port`, and the id P holds
//! the blocks under (`remote_request_id`, or with an older connector the shared
//! `X-Request-Id`); without them vLLM logs "Got invalid KVTransferParams" and prefills
//! locally, and so does the simulator. A router should copy P's params to D unchanged, so
//! fields this side does not read are ignored, not refused.

use serde_json::{json, Value};

use super::Pd;
use crate::sim::text::ids::random_id;

/// What P/D asks of one request; both empty for a plain request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PdRequest {
    /// Prefill side: hold the prompt's blocks under this id once the request finishes.
    pub hold: Option<String>,
    /// Decode side: where the prompt's blocks are to be read from.
    pub pull: Option<Remote>,
}

/// The prefill server a decode request reads from, as P's answer named it.
#[derive(Debug, Clone, PartialEq)]
pub struct Remote {
    pub engine_id: String,
    pub request_id: String,
    pub host: String,
    pub port: u16,
    /// P's held blocks, in prompt order (`block_id` of each block's hash).
    pub block_ids: Vec<u64>,
}

impl Remote {
    /// Leading blocks of `hashes` (this server's prompt) that P's blocks are: KV of another
    /// prompt is of no use, so the read stops at the first block that differs.
    pub fn matching_blocks(&self, hashes: &[u64]) -> usize {
        self.block_ids
            .iter()
            .zip(hashes)
            .take_while(|&(&id, &h)| id == block_id(h))
            .count()
    }
}

/// The id P names a block by: its chained hash cut to 53 bits, so that it is an exact integer
/// in any JSON reader (vLLM's ids are small pool indices; a router only copies them).
pub fn block_id(hash: u64) -> u64 {
    hash & ((1 << 53) - 1)
}

/// Reads a request's `kv_transfer_params` (absent or null: a plain request). `request_id` is
/// its `X-Request-Id` header, which names the hold when given.
pub fn parse(params: Option<&Value>, request_id: Option<&str>) -> PdRequest {
    let Some(params) = params.filter(|p| !p.is_null()) else {
        return PdRequest::default();
    };
    let Some(p) = params.as_object() else {
        log::warn!("kv_transfer_params is not an object: ignored, served as a plain request");
        return PdRequest::default();
    };
    let flag = |name: &str| p.get(name).and_then(Value::as_bool).unwrap_or(false);
    let hold = flag("do_remote_decode").then(|| match request_id {
        Some(id) if !id.is_empty() => id.to_owned(),
        _ => random_id("cmpl-kvbench-"),
    });
    let pull = if flag("do_remote_prefill") {
        match remote(params, request_id) {
            Ok(r) => Some(r),
            Err(missing) => {
                // vLLM's words, then the simulator's reason.
                log::warn!("Got invalid KVTransferParams: will not utilize KVTransfer ({missing})");
                None
            }
        }
    } else {
        None
    };
    PdRequest { hold, pull }
}

fn remote(p: &Value, header_id: Option<&str>) -> Result<Remote, String> {
    let text = |name: &str| {
        p.get(name)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    let block_ids = p
        .get("remote_block_ids")
        .and_then(Value::as_array)
        .ok_or("no remote_block_ids list")?
        .iter()
        .map(Value::as_u64)
        .collect::<Option<Vec<u64>>>()
        .ok_or("remote_block_ids must be non-negative integers")?;
    let port = p
        .get("remote_port")
        .and_then(Value::as_u64)
        .and_then(|n| u16::try_from(n).ok())
        .ok_or("no remote_port")?;
    let request_id = text("remote_request_id")
        .or_else(|| header_id.filter(|id| !id.is_empty()).map(str::to_owned))
        .ok_or("no remote_request_id and no X-Request-Id")?;
    Ok(Remote {
        engine_id: text("remote_engine_id").ok_or("no remote_engine_id")?,
        request_id,
        host: text("remote_host").ok_or("no remote_host")?,
        port,
        block_ids,
    })
}

/// The `kv_transfer_params` P adds to its answer of a held request: what D needs to read the
/// blocks (`hashes`, in prompt order) and to tell P it has.
pub fn prefill_answer(pd: &Pd, request_id: &str, hashes: &[u64]) -> Value {
    let ids: Vec<u64> = hashes.iter().copied().map(block_id).collect();
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": ids,
        "remote_engine_id": pd.engine_id,
        "remote_request_id": request_id,
        "remote_host": pd.addr.ip().to_string(),
        "remote_port": pd.addr.port(),
        "tp_size": 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a router sends P: the toy proxy's six keys.
    fn prefill_params() -> Value {
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null})
    }

    #[test]
    fn prefill_side_holds_under_the_request_id() {
        let p = prefill_params();
        let r = parse(Some(&p), Some("req-1"));
        assert_eq!(r.hold.as_deref(), Some("req-1"));
        assert!(r.pull.is_none());
        let generated = parse(Some(&p), None).hold.unwrap();
        assert!(generated.starts_with("cmpl-kvbench-"), "{generated}");
        assert_ne!(parse(Some(&p), None).hold.unwrap(), generated);
        for plain in [None, Some(Value::Null), Some(json!({})), Some(json!([1]))] {
            assert_eq!(parse(plain.as_ref(), Some("x")), PdRequest::default());
        }
    }

    #[test]
    fn decode_side_needs_what_vllm_needs() {
        let full = json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [3, 9], "remote_engine_id": "e", "remote_request_id": "r",
            "remote_host": "127.0.0.1", "remote_port": 8100, "tp_size": 1, "extra": "kept"});
        let r = parse(Some(&full), Some("header-id")).pull.unwrap();
        assert_eq!(
            r,
            Remote {
                engine_id: "e".into(),
                request_id: "r".into(),
                host: "127.0.0.1".into(),
                port: 8100,
                block_ids: vec![3, 9],
            }
        );
        // An older connector's params: the shared header names the request.
        let mut old = full.clone();
        old.as_object_mut().unwrap().remove("remote_request_id");
        let r = parse(Some(&old), Some("header-id")).pull.unwrap();
        assert_eq!(r.request_id, "header-id");
        assert!(parse(Some(&old), None).pull.is_none());
        for (field, bad) in [
            ("remote_block_ids", Value::Null),
            ("remote_block_ids", json!([1, -2])),
            ("remote_engine_id", Value::Null),
            ("remote_host", json!("")),
            ("remote_port", json!(70_000)),
            ("remote_port", json!("8100")),
        ] {
            let mut p = full.clone();
            p[field] = bad;
            assert!(parse(Some(&p), None).pull.is_none(), "{field}: {p}");
        }
    }

    #[test]
    fn matching_blocks_stop_at_the_first_difference() {
        let hashes = [u64::MAX, 5, 6, 7];
        let remote = |ids: Vec<u64>| Remote {
            engine_id: "e".into(),
            request_id: "r".into(),
            host: "127.0.0.1".into(),
            port: 1,
            block_ids: ids,
        };
        let all: Vec<u64> = hashes.iter().copied().map(block_id).collect();
        assert_eq!(block_id(u64::MAX), (1 << 53) - 1);
        assert_eq!(remote(all.clone()).matching_blocks(&hashes), 4);
        assert_eq!(remote(all[..2].to_vec()).matching_blocks(&hashes), 2);
        assert_eq!(remote(vec![all[0], 99, all[2]]).matching_blocks(&hashes), 1);
        assert_eq!(remote(all).matching_blocks(&hashes[..3]), 3);
    }
}
