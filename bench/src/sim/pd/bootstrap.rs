//! SGLang's bootstrap protocol, as its routers drive it: mini_lb.py
//! (`python/sglang/srt/disaggregation/mini_lb.py` @ 001c2ae0901cd353c26fed2f435887c867b73eed)
//! and sgl-router (`sgl-router/src/routers/http/pd_router.rs` @
//! f4caaa05b816910def2179344b02137e971ebe5c) send the prefill server (P) and the decode server
//! (D) the same body at once, with `bootstrap_host` (P's host), `bootstrap_port` and
//! `bootstrap_room` (a random integer in [0, 2^63 - 1]) added; the client gets D's answer.
//! The server's role (`--role`, SGLang's `--disaggregation-mode`) says which side it plays.
//!
//! # What stands in for SGLang's bootstrap server and transfer engine
//! P prefills the prompt as any request (what it holds already is not computed again) and
//! holds its blocks under the room. D asks P's own HTTP port (so in kvbench fleets a prefill
//! server's `bootstrap_port` is its HTTP port) with a long poll, `GET http://{bootstrap_host}:
//! {bootstrap_port}/kvbench/bootstrap/{room}?wait_ms=N`: 200 `{"bootstrap_room", "engine_id",
//! "block_ids"}` once P holds the room, 404 when it does not within N ms (D asks again). D
//! then reads the blocks it lacks, as vLLM's decode side does (`api::pd::pull`), and tells P
//! with the NIXL stand-in's notice (the room's key as the request id), which frees P's copy.
//!
//! # Timeouts, as SGLang's
//! - P frees a room nobody fetched after `--pd-bootstrap-timeout-s` (300 s,
//!   `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`), counted as expired, and fails its leg.
//! - D waits `--pd-waiting-timeout-s` (300 s, `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`) for the
//!   room, then fails the request with SGLang's words ("Request {room} timed out after {t}s in
//!   KVPoll.WaitingForInput", `disaggregation/*/conn.py`), counted as a timed-out wait.
//! - A P leg cut or never sent: D times out. A D leg cut before P held the room: nothing told
//!   P, which frees it at its bootstrap timeout (SGLang's sender waits for a decode that never
//!   bootstraps until then). A D leg cut during its read tells P (SGLang's decode sends an
//!   abort notification), which frees the room at once and fails its own leg.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use super::transfer::loopback_addr;

/// P's endpoint D asks for a room's KV (`/kvbench/bootstrap/{room}`).
pub const BOOTSTRAP_PATH: &str = "/kvbench/bootstrap/{room}";

/// How long P holds one long poll open at most, and D asks for by default.
pub const MAX_POLL: Duration = Duration::from_secs(2);

/// SGLang's DP controller's words for a request without a room on a P or D server
/// (`data_parallel_controller.py` `follow_bootstrap_room_scheduler` @
/// 000a3db1c0c42140f14ddab7b4c6dda86de1fa4b).
pub const NO_ROOM: &str = "req.bootstrap_room should not be None. Do not send requests \
    directly to prefill or decode instances; send to the router instead.";

/// One request's bootstrap fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Bootstrap {
    pub room: u64,
    /// P's host and port, as D reaches it; None when the router sent none (P needs neither).
    pub host: Option<String>,
    pub port: Option<u16>,
}

/// The key P holds a room's blocks under, beside vLLM's request ids.
pub fn room_key(room: u64) -> String {
    format!("bootstrap-room-{room}")
}

/// Reads `bootstrap_host`, `bootstrap_port` and `bootstrap_room`; Ok(None) when there is no
/// room (absent or null). A batch's arrays (chat `n > 1`, a prompt array) are served only of
/// length 1: the simulator answers one prompt a request. Err is the 400's message.
pub fn parse(
    host: Option<&Value>,
    port: Option<&Value>,
    room: Option<&Value>,
) -> Result<Option<Bootstrap>, String> {
    let Some(room) = single("bootstrap_room", room)? else {
        return Ok(None);
    };
    let room = room
        .as_u64()
        .filter(|&r| r <= i64::MAX as u64)
        .ok_or_else(|| format!("bootstrap_room must be an integer in [0, 2^63 - 1], got {room}"))?;
    let host = match single("bootstrap_host", host)? {
        None => None,
        Some(h) => Some(
            h.as_str()
                .ok_or_else(|| format!("bootstrap_host must be a string, got {h}"))?
                .to_owned(),
        ),
    };
    let port = match single("bootstrap_port", port)? {
        None => None,
        Some(p) => Some(
            p.as_u64()
                .and_then(|n| u16::try_from(n).ok())
                .ok_or_else(|| format!("bootstrap_port must be a port number, got {p}"))?,
        ),
    };
    Ok(Some(Bootstrap { room, host, port }))
}

/// A field's one value: itself, or the only element of a one-element array.
fn single<'a>(name: &str, v: Option<&'a Value>) -> Result<Option<&'a Value>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) if items.len() == 1 => {
            Ok(Some(&items[0]).filter(|v| !v.is_null()))
        }
        Some(Value::Array(items)) => Err(format!(
            "kvbench-sim serves one bootstrap room a request: {name} is an array of {} \
             (a batch: chat n > 1 or a prompt array); send one request per prompt",
            items.len()
        )),
        Some(v) => Ok(Some(v)),
    }
}

/// What P answers for a room it holds.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct RoomKv {
    pub engine_id: String,
    /// The held blocks, in prompt order (`block_id` of each hash).
    pub block_ids: Vec<u64>,
}

/// Where D reaches P for `b`'s room: its `bootstrap_host` and `bootstrap_port`, on loopback.
/// Err: the 400's message (a router that names no prefill server, or one elsewhere).
pub fn prefill_addr(b: &Bootstrap) -> Result<SocketAddr, String> {
    let (Some(host), Some(port)) = (b.host.as_deref(), b.port) else {
        return Err(format!(
            "bootstrap room {}: a decode server needs bootstrap_host and bootstrap_port \
             (in kvbench fleets, the prefill server's HTTP address)",
            b.room
        ));
    };
    loopback_addr(host, port).map_err(|e| format!("bootstrap_host: {e}"))
}

/// D's wait for P's KV of `room`: long polls P at `addr` until it holds the room, or None
/// once `deadline` passes. A P that cannot be reached (not up yet, crashed) is asked again
/// after a pause, never in a busy loop.
pub async fn wait_for_kv(
    client: &reqwest::Client,
    addr: SocketAddr,
    room: u64,
    deadline: Instant,
) -> Option<RoomKv> {
    let path = BOOTSTRAP_PATH.replace("{room}", &room.to_string());
    let url = format!("http://{addr}{path}");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let wait = left.min(MAX_POLL);
        let asked = Instant::now();
        let res = client
            .get(format!("{url}?wait_ms={}", wait.as_millis()))
            .timeout(wait + Duration::from_secs(2))
            .send()
            .await;
        match res {
            Ok(r) if r.status().is_success() => match r.json::<RoomKv>().await {
                Ok(kv) => return Some(kv),
                Err(e) => log::warn!("pd: bootstrap answer from {url} unreadable: {e}"),
            },
            // Not held (yet): P waited `wait` already.
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {}
            Ok(r) => log::debug!("pd: bootstrap {url}: {}", r.status()),
            Err(e) => log::debug!("pd: bootstrap {url}: {e}"),
        }
        // Whatever came back early (an error, a refused connection) waits out a pause.
        let pause = Duration::from_millis(50).saturating_sub(asked.elapsed());
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::sleep(pause.min(left)).await;
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn fields_are_read_as_sglang_routers_write_them() {
        let b = |h: Value, p: Value, r: Value| parse(Some(&h), Some(&p), Some(&r));
        let want = Bootstrap {
            room: 42,
            host: Some("127.0.0.1".into()),
            port: Some(8100),
        };
        assert_eq!(
            b(json!("127.0.0.1"), json!(8100), json!(42)),
            Ok(Some(want.clone()))
        );
        // A batch of one, as sgl-router writes it for n = 1 arrays.
        assert_eq!(
            b(json!(["127.0.0.1"]), json!([8100]), json!([42])),
            Ok(Some(want))
        );
        let max = i64::MAX as u64;
        assert_eq!(
            b(Value::Null, Value::Null, json!(max))
                .unwrap()
                .unwrap()
                .room,
            max
        );
        // No room: a plain request (refused by a P or D server, served by `both`).
        assert_eq!(parse(None, None, None), Ok(None));
        assert_eq!(b(json!("h"), json!(1), Value::Null), Ok(None));
        for bad in [
            b(json!("h"), json!(1), json!(max + 1)),
            b(json!("h"), json!(1), json!(-1)),
            b(json!("h"), json!(1), json!("42")),
            b(json!("h"), json!(70_000), json!(1)),
            b(json!(7), json!(1), json!(1)),
            b(json!(["h", "h"]), json!([1, 1]), json!([1, 2])),
        ] {
            assert!(bad.is_err(), "{bad:?}");
        }
        assert!(b(json!("h"), json!(1), json!([1, 2]))
            .unwrap_err()
            .contains("array of 2"));
    }

    #[tokio::test]
    async fn a_wait_without_a_reachable_prefill_ends_at_its_deadline() {
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let mut b = Bootstrap {
            room: 7,
            host: Some("127.0.0.1".into()),
            port: Some(1),
        };
        let addr = prefill_addr(&b).unwrap();
        let started = Instant::now();
        let kv = wait_for_kv(&client, addr, 7, started + Duration::from_millis(300)).await;
        assert!(kv.is_none());
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(2),
            "{took:?}"
        );
        b.host = Some("10.0.0.1".into());
        assert!(prefill_addr(&b).unwrap_err().contains("not loopback"));
        b.port = None;
        assert!(prefill_addr(&b).unwrap_err().contains("bootstrap_port"));
    }
}
