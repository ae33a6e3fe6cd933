//! One error type for everything kvroute tells a client: it knows its HTTP status and renders the
//! OpenAI error shape `{"error":{"message","type","code"}}`.

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;

/// A client-visible failure. `code` is a stable machine-readable string; `kind` is the OpenAI
/// `type` field.
/// Which API's shape a request's errors are answered in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dialect {
    /// `{"error":{"message","type","code"}}`, and a `data:` event ending a stream.
    #[default]
    OpenAi,
    /// OpenAI's shape, and the Responses API's `error` event ending a stream.
    Responses,
    /// Anthropic's `{"type":"error","error":{"type","message"}}` and its status codes.
    Anthropic,
}

impl Dialect {
    /// The dialect of the API served at `path` (the query string is not part of it).
    pub fn of_path(path: &str) -> Dialect {
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            Dialect::Anthropic
        } else if path == "/v1/responses" || path.starts_with("/v1/responses/") {
            Dialect::Responses
        } else {
            Dialect::OpenAi
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    /// Seconds for a `Retry-After` header (503 and 429 only).
    pub retry_after: Option<u32>,
    /// Why the router shed the request (`x-kvroute-dropped-reason`).
    pub dropped_reason: Option<&'static str>,
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
            dropped_reason: None,
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

    /// A stored response kvroute cannot route to (OpenAI's answer for an unknown id).
    pub fn response_not_found(message: impl Into<String>) -> Self {
        Self::new(404, "invalid_request_error", "response_not_found", message)
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

    /// The fleet is saturated and the router queue will not hold this request (`reason`: full,
    /// its deadline passed, or it is sheddable): 429, as for a client over its share, with
    /// `Retry-After` and the reason in `x-kvroute-dropped-reason`. 503 stays for "no backend
    /// up".
    pub fn shed(reason: &'static str, message: impl Into<String>, retry_after: u32) -> Self {
        ApiError {
            retry_after: Some(retry_after),
            dropped_reason: Some(reason),
            ..Self::new(429, "rate_limit_error", "fleet_saturated", message)
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
                dropped_reason: None,
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
    /// The status and Anthropic error `type` this error is answered with on the Messages API.
    /// kvroute's sheds and 503s (queue full, no backend up) are Anthropic's 529
    /// `overloaded_error`, which Anthropic's clients retry with backoff.
    fn anthropic(&self) -> (u16, &'static str) {
        if self.dropped_reason.is_some() {
            return (529, "overloaded_error");
        }
        match self.status {
            401 => (401, "authentication_error"),
            403 => (403, "permission_error"),
            404 => (404, "not_found_error"),
            413 => (413, "request_too_large"),
            429 => (429, "rate_limit_error"),
            503 => (529, "overloaded_error"),
            504 => (504, "timeout_error"),
            s if s >= 500 => (s, "api_error"),
            s => (s, "invalid_request_error"),
        }
    }

    /// The status this error is answered with in `dialect`.
    pub fn status_in(&self, dialect: Dialect) -> u16 {
        match dialect {
            Dialect::Anthropic => self.anthropic().0,
            Dialect::OpenAi | Dialect::Responses => self.status,
        }
    }

    /// The JSON body in `dialect`'s shape.
    pub fn body_in(&self, dialect: Dialect) -> Bytes {
        match dialect {
            Dialect::OpenAi | Dialect::Responses => self.body(),
            Dialect::Anthropic => Bytes::from(
                serde_json::json!({
                    "type": "error",
                    "error": {"type": self.anthropic().1, "message": self.message},
                })
                .to_string(),
            ),
        }
    }

    /// This error as the event that ends a stream already started, as `dialect`'s clients
    /// parse one: Anthropic's and the Responses API's are named `error` events.
    pub fn sse_event_in(&self, dialect: Dialect) -> Bytes {
        let (name, data) = match dialect {
            Dialect::OpenAi => return self.sse_event(),
            Dialect::Anthropic => ("error", self.body_in(dialect)),
            Dialect::Responses => (
                "error",
                Bytes::from(
                    serde_json::json!({
                        "type": "error",
                        "code": self.code,
                        "message": self.message,
                        "param": null,
                    })
                    .to_string(),
                ),
            ),
        };
        let mut out = format!("event: {name}\ndata: ").into_bytes();
        out.extend_from_slice(&data);
        out.extend_from_slice(b"\n\n");
        Bytes::from(out)
    }

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
        self.response_header_in(Dialect::OpenAi, body_len)
    }

    pub fn response_header_in(
        &self,
        dialect: Dialect,
        body_len: usize,
    ) -> pingora::Result<ResponseHeader> {
        let mut h = ResponseHeader::build(self.status_in(dialect), Some(5))?;
        h.insert_header("content-type", "application/json")?;
        // A browser shown an error must not sniff it into something it would run.
        h.insert_header("x-content-type-options", "nosniff")?;
        h.insert_header("content-length", body_len.to_string())?;
        if let Some(secs) = self.retry_after {
            h.insert_header("retry-after", secs.to_string())?;
        }
        if let Some(reason) = self.dropped_reason {
            h.insert_header("x-kvroute-dropped-reason", reason)?;
        }
        Ok(h)
    }

    /// Write this error as the whole response. The connection is not reused when the request
    /// body may be unread: leftover bytes would be parsed as the next request.
    pub async fn send(
        &self,
        session: &mut Session,
        keepalive: bool,
        dialect: Dialect,
    ) -> pingora::Result<()> {
        let body = self.body_in(dialect);
        let header = self.response_header_in(dialect, body.len())?;
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
    fn messages_errors_have_anthropics_shape_and_statuses() {
        let d = Dialect::of_path("/v1/messages");
        assert_eq!(d, Dialect::of_path("/v1/messages/count_tokens"));
        assert_eq!(Dialect::of_path("/v1/messagesx"), Dialect::OpenAi);
        let e = ApiError::bad_request("missing_max_tokens", "`max_tokens` is required");
        let v: serde_json::Value = serde_json::from_slice(&e.body_in(d)).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["message"], "`max_tokens` is required");
        let down = ApiError::unavailable("no_healthy_backend", "down", 2);
        assert_eq!(down.status_in(d), 529);
        let h = down.response_header_in(d, 3).unwrap();
        assert_eq!(h.status.as_u16(), 529);
        assert_eq!(h.headers.get("retry-after").unwrap(), "2");
        // A shed is 429 with its reason on the OpenAI APIs, Anthropic's 529 overloaded here.
        let shed = ApiError::shed("queue_full", "busy", 2);
        assert_eq!(shed.status_in(Dialect::OpenAi), 429);
        assert_eq!(shed.status_in(d), 529);
        let v: serde_json::Value = serde_json::from_slice(&shed.body_in(d)).unwrap();
        assert_eq!(v["error"]["type"], "overloaded_error");
        let h = shed.response_header_in(Dialect::OpenAi, 3).unwrap();
        assert_eq!(
            h.headers.get("x-kvroute-dropped-reason").unwrap(),
            "queue_full"
        );
        assert_eq!(h.headers.get("retry-after").unwrap(), "2");
        let kinds = [
            (
                ApiError::unauthorized("missing_api_key", "x"),
                401,
                "authentication_error",
            ),
            (ApiError::model_not_found("m"), 404, "not_found_error"),
            (ApiError::too_large("x"), 413, "request_too_large"),
            (ApiError::rate_limited("x", 1), 429, "rate_limit_error"),
            (ApiError::upstream("x"), 502, "api_error"),
            (ApiError::gateway_timeout("x"), 504, "timeout_error"),
        ];
        for (e, status, kind) in kinds {
            let v: serde_json::Value = serde_json::from_slice(&e.body_in(d)).unwrap();
            assert_eq!(
                (e.status_in(d), v["error"]["type"].as_str()),
                (status, Some(kind))
            );
        }
        let cut = String::from_utf8(ApiError::upstream("gone").sse_event_in(d).to_vec()).unwrap();
        assert!(cut.starts_with("event: error\ndata: {"), "{cut}");
        assert!(
            cut.ends_with("}\n\n") && cut.contains("\"api_error\""),
            "{cut}"
        );
        // The Responses API keeps OpenAI's body and statuses, and names its stream's error.
        let r = Dialect::of_path("/v1/responses");
        assert_eq!((shed.status_in(r), shed.body_in(r)), (429, shed.body()));
        let cut = String::from_utf8(ApiError::upstream("gone").sse_event_in(r).to_vec()).unwrap();
        let data: serde_json::Value =
            serde_json::from_str(cut.strip_prefix("event: error\ndata: ").unwrap().trim()).unwrap();
        assert_eq!(
            (data["type"].as_str(), data["code"].as_str()),
            (Some("error"), Some("upstream_failed"))
        );
    }

    #[test]
    fn unavailable_carries_retry_after() {
        let e = ApiError::unavailable("no_healthy_backend", "none", 2);
        let h = e.response_header(10).unwrap();
        assert_eq!(h.status.as_u16(), 503);
        assert_eq!(h.headers.get("retry-after").unwrap(), "2");
    }
}
