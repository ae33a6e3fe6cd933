//! The floor of `bench/scripts/overhead.sh`: a Pingora proxy that does nothing but forward to
//! one upstream over a kept-alive connection pool, with Pingora's own HTTP/1 service. What
//! kvroute costs beyond this is kvroute's; below it is the framework's.
//!
//!   cargo run --release --example bare_pingora -- CONF.yaml LISTEN UPSTREAM
//!
//! CONF.yaml holds Pingora's server keys (`threads`, `pid_file`, ...).
//!
//! With `BARE_BUFFER_BODY=1` it reads the whole request body before it picks the upstream and
//! forwards it from that buffer, as any proxy that places by the prompt must (kvroute does it in
//! `request::body::read_body`): the floor for a proxy that reads the body, with nothing else.
//!
//! With `BARE_TIMEOUTS=1` it sets the upstream timeouts kvroute sets on every peer (connect,
//! read, write, idle): Pingora then bounds each read and write to the engine with its timer,
//! which a production proxy cannot go without, so this is the floor for a proxy that has them.

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora::prelude::HttpPeer;
use pingora::proxy::{ProxyHttp, Session};
use pingora::server::configuration::Opt;
use pingora::server::Server;
use std::time::Duration;

struct Bare {
    upstream: String,
    buffer_body: bool,
    timeouts: bool,
}

#[async_trait]
impl ProxyHttp for Bare {
    /// The whole request body, when it is buffered.
    type CTX = Option<Bytes>;

    fn new_ctx(&self) -> Option<Bytes> {
        None
    }

    async fn request_filter(
        &self,
        session: &mut Session,
        ctx: &mut Option<Bytes>,
    ) -> pingora::Result<bool> {
        if self.buffer_body {
            let declared = session
                .req_header()
                .headers
                .get("content-length")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            // Once the body is read, Pingora forwards it only from a retry buffer that holds its
            // tail (at most 64 KiB): `request_body_filter` then swaps in the whole body.
            let mut buf = BytesMut::with_capacity(declared);
            let mut buffering = false;
            loop {
                if !buffering && declared.saturating_sub(buf.len()) <= 64 * 1024 {
                    session.enable_retry_buffering();
                    buffering = true;
                }
                match session.read_request_body().await? {
                    Some(chunk) => buf.extend_from_slice(&chunk),
                    None => break,
                }
            }
            *ctx = Some(buf.freeze());
        }
        Ok(false)
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Option<Bytes>,
    ) -> pingora::Result<()> {
        if let Some(full) = ctx {
            *body = Some(if end_of_stream {
                full.clone()
            } else {
                Bytes::new()
            });
        }
        Ok(())
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut Option<Bytes>,
    ) -> pingora::Result<Box<HttpPeer>> {
        let mut peer = HttpPeer::new(self.upstream.as_str(), false, String::new());
        if self.timeouts {
            // kvroute's defaults (`timeouts:` in its config), as `Router::upstream_peer` sets them.
            peer.options.connection_timeout = Some(Duration::from_millis(2_000));
            peer.options.read_timeout = Some(Duration::from_millis(300_000));
            peer.options.write_timeout = Some(Duration::from_millis(300_000));
            peer.options.idle_timeout = Some(Duration::from_secs(60));
        }
        Ok(Box::new(peer))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, conf, listen, upstream] = &args[..] else {
        eprintln!("usage: bare_pingora CONF.yaml LISTEN UPSTREAM");
        std::process::exit(2);
    };
    let opt = Opt {
        conf: Some(conf.clone()),
        ..Opt::default()
    };
    let mut server = match Server::new(Some(opt)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bare_pingora: {e}");
            std::process::exit(1);
        }
    };
    server.bootstrap();
    let mut proxy = pingora::proxy::http_proxy_service(
        &server.configuration,
        Bare {
            upstream: upstream.clone(),
            buffer_body: std::env::var("BARE_BUFFER_BODY").is_ok_and(|v| v == "1"),
            timeouts: std::env::var("BARE_TIMEOUTS").is_ok_and(|v| v == "1"),
        },
    );
    proxy.add_tcp(listen);
    server.add_service(proxy);
    server.run_forever();
}
