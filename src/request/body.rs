//! Reading a routed request's whole body before placement (placement needs the prompt), within
//! the size limit and the per-read and total deadlines.
//!
//! Pingora then forwards only its retry buffer (at most 64 KiB): buffering is switched on once
//! the rest of the body fits in it, so the buffer ends up holding exactly the tail, and the
//! proxy's `request_body_filter` swaps the full body in. A chunked body has no known length, so
//! it is buffered from the start and must fit.

use bytes::{Bytes, BytesMut};
use pingora::proxy::Session;
use std::time::{Duration, Instant};

use prometheus::IntCounter;

use crate::error::ApiError;

/// The most Pingora's retry buffer holds.
const RETRY_BUFFER_BYTES: usize = 64 * 1024;

/// Read the whole body: 413 over `max`, 408 when a read takes longer than `per_read` or the
/// whole body longer than `total`, 411 for a chunked body too large to forward. A timeout is
/// also counted on `timeouts`. `reserve` is asked for the body's memory before it is read
/// (its declared length, before `100 Continue`; a chunked body's as it arrives) and refuses
/// with the error to answer.
pub(crate) async fn read_body(
    session: &mut Session,
    max: usize,
    per_read: Duration,
    total: Duration,
    timeouts: &IntCounter,
    reserve: &mut (dyn FnMut(usize) -> Result<(), ApiError> + Send),
) -> Result<Bytes, ApiError> {
    let deadline = Instant::now() + total;
    let declared = session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok());
    if let Some(len) = declared {
        if len > max {
            return Err(ApiError::too_large(format!(
                "request body of {len} bytes exceeds the limit of {max} bytes"
            )));
        }
        reserve(len)?;
    }
    let mut reserved = declared.unwrap_or(0);
    let expects_continue = session
        .req_header()
        .headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects_continue {
        session.write_continue_response().await.map_err(|e| {
            ApiError::bad_request("client_error", format!("cannot answer Expect: {e}"))
        })?;
    }
    let mut buf = BytesMut::with_capacity(declared.unwrap_or(0).min(max));
    // Where Pingora's retry buffer starts in the body: it holds every byte read since.
    let mut buffered_from = None;
    loop {
        let remaining = declared.map(|d| d.saturating_sub(buf.len()));
        if buffered_from.is_none() && remaining.is_none_or(|r| r <= RETRY_BUFFER_BYTES) {
            session.enable_retry_buffering();
            buffered_from = Some(buf.len());
        }
        let wait = per_read.min(deadline.saturating_duration_since(Instant::now()));
        let chunk = match tokio::time::timeout(wait, session.read_request_body()).await {
            Err(_) => {
                timeouts.inc();
                return Err(ApiError::timeout(format!(
                    "request body not received in time (each read within {} ms, all of it within {} ms)",
                    per_read.as_millis(),
                    total.as_millis()
                )));
            }
            Ok(Err(e)) => {
                return Err(ApiError::bad_request(
                    "invalid_body",
                    format!("cannot read request body: {e}"),
                ))
            }
            Ok(Ok(None)) => break,
            Ok(Ok(Some(c))) => c,
        };
        if buf.len() + chunk.len() > max {
            return Err(ApiError::too_large(format!(
                "request body exceeds the limit of {max} bytes"
            )));
        }
        if buf.len() + chunk.len() > reserved {
            reserve(buf.len() + chunk.len() - reserved)?;
            reserved = buf.len() + chunk.len();
        }
        buf.extend_from_slice(&chunk);
        // A chunked body past what can be replayed is refused now, not after the rest of it
        // (or a stall) has been waited for.
        if declared.is_none() && buf.len() > RETRY_BUFFER_BYTES {
            return Err(chunked_too_large());
        }
    }
    // Whether the retry buffer holds the body's tail, known without copying it out (asking
    // Pingora for the buffer copies it): empty or overflowed, Pingora would forward nothing.
    let tail = buffered_from.map_or(0, |from| buf.len() - from);
    if !buf.is_empty() && (tail == 0 || tail > RETRY_BUFFER_BYTES) {
        return Err(chunked_too_large());
    }
    Ok(buf.freeze())
}

/// Bytes a body's parse may allocate beyond the body: every object, array and element can
/// allocate, so a body of tiny messages costs far more parsed than sent: 10^6 one-character
/// messages (29 MB, 3 x 10^6 such bytes) took kvroute 169 MiB above idle, about 47 bytes a
/// node past the body itself (`bench/scripts/edge_check.sh`). Counted on the bytes that open
/// an object or array or separate elements (in strings too: an overestimate, never an under-).
pub fn parse_cost(body: &[u8]) -> usize {
    memchr::memchr3_iter(b'{', b'[', b',', body)
        .count()
        .saturating_mul(PARSE_BYTES_PER_NODE)
}

/// What one parsed node may take: the 47 bytes measured (see `parse_cost`), rounded up.
const PARSE_BYTES_PER_NODE: usize = 64;

fn chunked_too_large() -> ApiError {
    ApiError::length_required(format!(
        "chunked request bodies over {} KiB are not supported; send Content-Length",
        RETRY_BUFFER_BYTES / 1024
    ))
}
