//! Errors: `ApiError` is what an HTTP client sees (status plus OpenAI's error JSON), so every
//! handler fails in the same shape; `SimError` is a startup failure reported on the CLI.

use std::fmt;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `param`: the request field at fault, when one is.
    pub param: Option<&'static str>,
    /// OpenAI's `code`: a machine-readable reason, when the API defines one.
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    pub fn with_param(self, param: &'static str) -> Self {
        Self {
            param: Some(param),
            ..self
        }
    }

    pub fn with_code(self, code: &'static str) -> Self {
        Self {
            code: Some(code),
            ..self
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// OpenAI's `type` names the class of error; clients branch on it.
    fn error_type(&self) -> &'static str {
        match self.status {
            // OpenAI (and vLLM) call a missing stored object an invalid request too.
            StatusCode::BAD_REQUEST => "invalid_request_error",
            StatusCode::NOT_FOUND if self.code.is_some() => "invalid_request_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
            _ => "internal_server_error",
        }
    }

    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.error_type(),
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

#[derive(Debug)]
pub struct SimError(String);

impl SimError {
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SimError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_request_has_openai_shape() {
        let body = ApiError::bad_request("missing model").body();
        assert_eq!(body["error"]["message"], "missing model");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(body["error"]["code"].is_null());
    }
}
