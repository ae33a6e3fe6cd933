//! One error type for everything kvroute tells a client: it knows its HTTP status and renders the
//! OpenAI error shape `{"error":{"message","type","code"}}`.

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;

/// A client-visible failure. `code` is a stable machine-readable string; `kind` is the OpenAI
/// `type` field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    /// Seconds for a `Retry-After` header (503 and 429 only).
    pub retry_after: Option<u32>,
}

impl ApiError {
    fn new(
        status: u16,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            kind,
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", code, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(404, "invalid_request_error", "not_found", message)
    }

    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(405, "invalid_request_error", "method_not_allowed", message)
    }

    pub fn length_required(message: impl Into<String>) -> Self {
        Self::new(411, "invalid_request_error", "length_required", message)
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(413, "invalid_request_error", "request_too_large", message)
    }

    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(408, "invalid_request_error", "request_timeout", message)
    }

    pub fn upstream(message: impl Into<String>) -> Self {
        Self::new(502, "upstream_error", "upstream_failed", message)
    }

    pub fn unauthorized(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(401, "authentication_error", code, message)
    }

    pub fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(403, "permission_error", code, message)
    }

    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            404,
            "invalid_request_error",
            "model_not_found",
            format!("the model `{model}` does not exist"),
        )
    }

    pub fn rate_limited(message: impl Into<String>, retry_after: u32) -> Self {
        ApiError {
            retry_after: Some(retry_after),
            ..Self::new(429, "rate_limit_error", "rate_limit_exceeded", message)
        }
    }

    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        Self::new(504, "upstream_error", "upstream_timeout", message)
    }

    pub fn unavailable(code: &'static str, message: impl Into<String>, retry_after: u32) -> Self {
        ApiError {
            retry_after: Some(retry_after),
            ..Self::new(503, "service_unavailable", code, message)
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "internal_error", "internal_error", message)
    }

    /// What to tell the client about a request Pingora failed to proxy; `None` when the client
    /// itself went away and nobody is left to answer.
    pub fn for_proxy_error(e: &pingora::Error, backend: &str) -> Option<ApiError> {
        use pingora::{ErrorSource, ErrorType};
        let upstream = *e.esource() == ErrorSource::Upstream;
        match e.etype() {
            ErrorType::HTTPStatus(code) => Some(ApiError {
                status: *code,
                kind: "invalid_request_error",
                code: "http_error",
                message: e.to_string(),
                retry_after: None,
            }),
            ErrorType::ReadTimedout | ErrorType::WriteTimedout if upstream => {
                Some(ApiError::gateway_timeout(format!(
                    "upstream {backend} sent nothing in time (timeouts.first_byte_floor_ms for streams, else timeouts.upstream_read_ms)"
                )))
            }
            _ => match e.esource() {
                ErrorSource::Upstream => Some(ApiError::upstream(format!(
                    "upstream {backend} failed before responding: {}",
                    e.etype().as_str()
                ))),
                ErrorSource::Downstream => match e.etype() {
                    ErrorType::WriteError | ErrorType::ReadError | ErrorType::ConnectionClosed => {
                        None
                    }
                    _ => Some(ApiError::bad_request("client_error", e.to_string())),
                },
                ErrorSource::Internal | ErrorSource::Unset => {
                    Some(ApiError::internal("internal error"))
                }
            },
        }
    }

    /// The OpenAI-shaped JSON body.
    pub fn body(&self) -> Bytes {
        let v = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "code": self.code,
            }
        });
        Bytes::from(v.to_string())
    }

    /// This error as a server-sent event, to end a stream that already started.
    pub fn sse_event(&self) -> Bytes {
        let mut out = b"data: ".to_vec();
        out.extend_from_slice(&self.body());
        out.extend_from_slice(b"\n\n");
        Bytes::from(out)
    }

    pub fn response_header(&self, body_len: usize) -> pingora::Result<ResponseHeader> {
        let mut h = ResponseHeader::build(self.status, Some(4))?;
        h.insert_header("content-type", "application/json")?;
        h.insert_header("content-length", body_len.to_string())?;
        if let Some(secs) = self.retry_after {
            h.insert_header("retry-after", secs.to_string())?;
        }
        Ok(h)
    }

    /// Write this error as the whole response. The connection is not reused when the request
    /// body may be unread: leftover bytes would be parsed as the next request.
    pub async fn send(&self, session: &mut Session, keepalive: bool) -> pingora::Result<()> {
        let body = self.body();
        let header = self.response_header(body.len())?;
        if !keepalive {
            session.set_keepalive(None);
        }
        session
            .write_response_header(Box::new(header), false)
            .await?;
        session.write_response_body(Some(body), true).await?;
        Ok(())
    }

    /// Carry this error through Pingora's error path; `fail_to_proxy` renders it.
    pub fn into_pingora(self) -> Box<pingora::Error> {
        pingora::Error::explain(pingora::ErrorType::HTTPStatus(self.status), self.message)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status, self.code, self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_openai_shape() {
        let e = ApiError::bad_request("missing_model", "`model` is required");
        let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(v["error"]["message"], "`model` is required");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "missing_model");
    }

    #[test]
    fn proxy_errors_map_to_the_status_contract() {
        use pingora::{Error, ErrorType};
        let timeout = Error::new_up(ErrorType::ReadTimedout);
        assert_eq!(
            ApiError::for_proxy_error(&timeout, "b").unwrap().status,
            504
        );
        let mut reset = Error::new_up(ErrorType::ConnectionClosed);
        assert_eq!(ApiError::for_proxy_error(&reset, "b").unwrap().status, 502);
        reset.as_down();
        assert_eq!(ApiError::for_proxy_error(&reset, "b"), None, "client gone");
        let shed = ApiError::unavailable("fleet_saturated", "busy", 1).into_pingora();
        assert_eq!(ApiError::for_proxy_error(&shed, "b").unwrap().status, 503);
    }

    #[test]
    fn unavailable_carries_retry_after() {
        let e = ApiError::unavailable("no_healthy_backend", "none", 2);
        let h = e.response_header(10).unwrap();
        assert_eq!(h.status.as_u16(), 503);
        assert_eq!(h.headers.get("retry-after").unwrap(), "2");
    }
}
