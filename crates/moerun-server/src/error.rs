//! Errors as the OpenAI API reports them: an HTTP status and a body
//! `{"error": {"message", "type", "param", "code"}}`. Every failure a client can cause becomes
//! one of these values, never a panic; `param` names the request field at fault when there is
//! one, so a client can tell which of its inputs to fix.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// One API error: what the client sees.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's error `type`: `invalid_request_error`, `authentication_error`, `server_error`...
    pub kind: &'static str,
    /// The request field at fault, if any.
    pub param: Option<String>,
    /// A machine-readable code (`invalid_type`, `model_not_found`, ...), if any.
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// A 400 about the field `param`.
    pub fn invalid(param: &str, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            code: Some(code),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// A 400 that is about the request as a whole (malformed JSON, for instance).
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code: Some(code),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// A 400 for a field whose value has the wrong JSON type.
    pub fn wrong_type(param: &str, expected: &str) -> Self {
        Self::invalid(
            param,
            "invalid_type",
            format!("'{param}' must be {expected}"),
        )
    }

    /// A 400 for a parameter this server does not implement (or not with this value).
    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(param, "unsupported_parameter", message)
    }

    /// 401: the API key is missing or wrong.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
        }
    }

    /// 404 for a model this server does not serve.
    pub fn model_not_found(model: &str, served: &str) -> Self {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model '{model}' does not exist; this server serves '{served}'"),
            )
        }
    }

    /// 404 for a path with no route.
    pub fn no_route(path: &str) -> Self {
        ApiError {
            code: Some("not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("no endpoint at {path}"),
            )
        }
    }

    /// 405 for a known path asked with the wrong method.
    pub fn method_not_allowed(path: &str) -> Self {
        ApiError {
            code: Some("method_not_allowed"),
            ..Self::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                format!("{path} does not accept this HTTP method"),
            )
        }
    }

    /// 413: the body exceeds the configured limit.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body exceeds the limit of {limit} bytes"),
            )
        }
    }

    /// 503: the server is at capacity; retry later.
    pub fn overloaded(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("server_overloaded"),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
        }
    }

    /// 500: a failure of the server itself, not of the request.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("internal_error"),
            ..Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
        }
    }

    /// The `{"error": {...}}` body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            // Overload is transient: tell well-behaved clients when to come back.
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
