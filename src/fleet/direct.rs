//! kvroute's own requests to a backend beside the one it proxies: the legs of a disaggregated
//! request (`proxy::pd`), sent whole, reaching the engine the way proxied requests do (its
//! TLS, its own key).

use bytes::Bytes;
use pingora::http::RequestHeader;
use pingora::prelude::HttpPeer;
use pingora::protocols::http::v1::client::HttpSession;
use std::time::Duration;

use super::roster::Fleet;
use super::upstream::{probe_session, release_probe_session};

/// A backend's whole answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

/// How one of these requests ended badly, for a log line.
fn e(e: Box<pingora::Error>) -> String {
    e.to_string()
}

impl Fleet {
    /// A session to backend `i` with `POST path` (a JSON `body` and `headers`) written whole,
    /// within `timeout` for connecting and writing.
    async fn post(
        &self,
        i: usize,
        path: &str,
        headers: &[(&str, &str)],
        body: &Bytes,
        timeout: Duration,
    ) -> Result<(HttpSession, HttpPeer), String> {
        let b = self
            .backends
            .get(i)
            .ok_or_else(|| format!("no backend {i}"))?;
        let mut peer = b.peer();
        peer.options.connection_timeout = Some(timeout);
        peer.options.read_timeout = Some(timeout);
        peer.options.write_timeout = Some(timeout);
        let host = if peer.sni.is_empty() {
            peer._address.to_string()
        } else {
            peer.sni.clone()
        };
        let mut session = probe_session(&peer).await.map_err(e)?;
        let mut req = RequestHeader::build("POST", path.as_bytes(), None).map_err(e)?;
        req.insert_header("Host", host).map_err(e)?;
        req.insert_header(http::header::CONTENT_TYPE, "application/json")
            .map_err(e)?;
        req.insert_header(http::header::CONTENT_LENGTH, body.len().to_string())
            .map_err(e)?;
        if let Some(a) = b.engine_auth.as_deref() {
            req.insert_header(http::header::AUTHORIZATION, a)
                .map_err(e)?;
        }
        for (k, v) in headers {
            req.insert_header(k.to_string(), *v).map_err(e)?;
        }
        session
            .write_request_header(Box::new(req))
            .await
            .map_err(e)?;
        session.write_body(body).await.map_err(e)?;
        session.finish_body().await.map_err(e)?;
        Ok((session, peer))
    }

    /// `POST path` with a JSON `body` and `headers` to backend `i`, then hang up after at most
    /// `wait`: the engine gets the whole request and then finds its client gone, as when a
    /// client leaves (a decode leg whose client left before it was sent: the decode server's
    /// abort tells the prefill server to free what it holds for it).
    pub async fn send_and_cut(
        &self,
        i: usize,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
        wait: Duration,
    ) -> Result<(), String> {
        let (mut session, _) = self
            .post(i, path, headers, &body, Duration::from_secs(5))
            .await?;
        let _ = tokio::time::timeout(wait, session.read_response()).await;
        // Dropped, not released: the connection closes under the request.
        drop(session);
        Ok(())
    }

    /// `POST path` with a JSON `body` and `headers` to backend `i`; its answer, bounded by
    /// `timeout` and `max_bytes`.
    pub async fn post_json(
        &self,
        i: usize,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
        timeout: Duration,
        max_bytes: usize,
    ) -> Result<Answer, String> {
        let work = async {
            let (mut session, peer) = self.post(i, path, headers, &body, timeout).await?;
            session.read_response().await.map_err(e)?;
            let status = session.resp_header().map_or(0, |h| h.status.as_u16());
            let mut out = Vec::new();
            while let Some(chunk) = session.read_body_bytes().await.map_err(e)? {
                if out.len() + chunk.len() > max_bytes {
                    return Err(format!("answer over {max_bytes} bytes"));
                }
                out.extend_from_slice(&chunk);
            }
            release_probe_session(session, &peer, Duration::from_secs(30)).await;
            Ok(Answer {
                status,
                body: Bytes::from(out),
            })
        };
        tokio::time::timeout(timeout, work)
            .await
            .map_err(|_| format!("no answer within {} ms", timeout.as_millis()))?
    }
}
