//! D's notice to P, the stand-in for the notification a NIXL READ carries: `POST
//! http://remote_host:remote_port/kvbench/nixl/notify` with `{"request_id", "engine_id",
//! "blocks", "aborted"}` (the blocks read; 0 and `aborted` for an aborted request). P frees
//! the request's held blocks and answers 200, or 404 when it holds nothing under that id
//! (expired, restarted, never held, or another engine). SGLang's protocol sends the same
//! notice, the room's key as the id: it ends the transfer P's leg waits on.
//!
//! The simulator only ever talks to loopback: a `remote_host` elsewhere is unreachable.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use serde_json::json;

use super::Remote;

pub const NOTIFY_PATH: &str = "/kvbench/nixl/notify";

/// Tells P that `remote`'s blocks were read (`blocks` of them). Ok when P held the request
/// and has freed it; Err says why not.
pub async fn notify(
    client: &reqwest::Client,
    remote: &Remote,
    blocks: usize,
    aborted: bool,
) -> Result<(), String> {
    let url = format!(
        "http://{}{NOTIFY_PATH}",
        loopback_addr(&remote.host, remote.port)?
    );
    let body = json!({
        "request_id": remote.request_id,
        "engine_id": remote.engine_id,
        "blocks": blocks,
        "aborted": aborted,
    });
    let res = client
        .post(&url)
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    if res.status().is_success() {
        Ok(())
    } else {
        Err(format!(
            "{url}: {} for request {:?}",
            res.status(),
            remote.request_id
        ))
    }
}

/// The address of P at `host:port`: an IP address (or `localhost`) on loopback, the only
/// host the simulator talks to.
pub fn loopback_addr(host: &str, port: u16) -> Result<SocketAddr, String> {
    let ip = match host {
        "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        host => host
            .parse::<IpAddr>()
            .map_err(|_| format!("host {host:?} is not an IP address"))?,
    };
    if !ip.is_loopback() {
        return Err(format!(
            "host {ip} is not loopback: the simulator reaches no other host"
        ));
    }
    Ok(SocketAddr::new(ip, port))
}

/// Notifies P, with no blocks, if dropped before the read's own notice went out: a decode
/// request that ends before its read does (its client gone, a fault, an error) still lets P
/// free the blocks at once, as vLLM sends an empty notification for an aborted request.
pub struct NotifyGuard {
    client: reqwest::Client,
    remote: Remote,
    armed: bool,
}

impl NotifyGuard {
    pub fn new(client: reqwest::Client, remote: Remote) -> Self {
        Self {
            client,
            remote,
            armed: true,
        }
    }

    pub fn remote(&self) -> &Remote {
        &self.remote
    }

    /// Sends the read's notice (`blocks` read). The guard stays armed until it is answered:
    /// cut short, P gets the empty notice instead (a second notice is answered 404, harmless).
    pub async fn notify_read(&mut self, blocks: usize) -> Result<(), String> {
        let outcome = notify(&self.client, &self.remote, blocks, false).await;
        self.armed = false;
        outcome
    }
}

impl Drop for NotifyGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (client, remote) = (self.client.clone(), self.remote.clone());
        runtime.spawn(async move {
            match notify(&client, &remote, 0, true).await {
                Ok(()) => log::debug!(
                    "pd: decode request {:?} ended before its read: P told",
                    remote.request_id
                ),
                Err(e) => log::info!("pd: abort notice not taken: {e}"),
            }
        });
    }
}
