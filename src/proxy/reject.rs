//! Requests kvroute answers itself with an error, before any backend: the answer, then a
//! moment to read what the client still sends so it gets the answer rather than a reset.

use pingora::proxy::Session;
use pingora::Result;

use super::ctx::Ctx;
use crate::error::ApiError;

/// Answer `err` now and end the request (for use in `request_filter`).
pub(super) async fn reject(
    session: &mut Session,
    ctx: &mut Ctx,
    err: ApiError,
    body_unread: bool,
) -> Result<bool> {
    log::debug!("rejecting request: {err}");
    err.send(session, !body_unread, ctx.dialect).await?;
    // Lingering close: a socket closed with unread bytes sends a reset, and a client still
    // writing its body may lose the answer already in its receive buffer. Read and discard
    // what it sends, for a moment. Not for a client too slow to send in time, nor for one that
    // waits for `100 Continue` before it sends anything and was refused first: neither will
    // send what the linger would wait for.
    let awaits_continue = session.body_bytes_read() == 0
        && session
            .req_header()
            .headers
            .get(http::header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if body_unread && err.status != 408 && !awaits_continue {
        ctx.answered = Some(std::time::Instant::now());
        let _ = tokio::time::timeout(LINGER, session.drain_request_body()).await;
    }
    ctx.error = Some(err);
    Ok(true)
}

/// How long a refused request's unread body is read and discarded before the connection closes.
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);
