//! API errors in OpenAI's JSON shape (`{"error": {"message", "type", "param",
//! "code"}}`) with the right HTTP status; every failure is mapped here, once.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error response.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub retry_after: Option<u32>,
    /// The request was already counted in `epserve_requests_total` (by the
    /// scheduler), so the response must not count it again.
    pub counted: bool,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
            counted: false,
        }
    }
    /// Marks an error the scheduler has already counted.
    pub fn counted(mut self) -> Self {
        self.counted = true;
        self
    }
    /// 400: the request is malformed or asks for something impossible.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    /// 400 naming the offending parameter.
    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::bad_request(message);
        e.param = Some(param.to_string());
        e
    }
    /// 401: missing or wrong API key.
    pub fn unauthorized() -> Self {
        let mut e = Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'",
        );
        e.code = Some("invalid_api_key");
        e
    }
    /// 404: no such model.
    pub fn unknown_model(name: &str, served: &[String]) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "The model '{name}' does not exist; this server serves: {}",
                served.join(", ")
            ),
        );
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }
    /// 404 for unknown routes.
    pub fn not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("no route for {path}"),
        )
    }
    /// 405 for a known route with another method.
    pub fn method_not_allowed(method: &axum::http::Method, path: &str) -> Self {
        let mut e = Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("method {method} is not allowed for {path}"),
        );
        e.code = Some("method_not_allowed");
        e
    }
    /// 408: the request body did not arrive in time.
    pub fn request_timeout(limit: std::time::Duration) -> Self {
        let mut e = Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the request body did not arrive within {} s",
                limit.as_secs_f64()
            ),
        );
        e.code = Some("request_timeout");
        e
    }
    /// 413: body over the limit.
    pub fn too_large(limit: usize) -> Self {
        let mut e = Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body exceeds the limit of {limit} bytes"),
        );
        e.code = Some("request_too_large");
        e
    }
    /// 503 with Retry-After: overloaded or not ready yet.
    pub fn unavailable(message: impl Into<String>, retry_after: u32) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_overloaded",
            message,
        );
        e.retry_after = Some(retry_after);
        e
    }
    /// 503 with Retry-After: part of the cluster (an expert with no live
    /// replica, a worker) is unavailable; retrying shortly may succeed.
    pub fn cluster_unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            message,
        );
        e.code = Some("cluster_unavailable");
        e.retry_after = Some(1);
        e
    }
    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if !self.counted {
            crate::metrics::request_finished(if self.status.is_server_error() {
                "rejected"
            } else {
                "invalid"
            });
        }
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after
            && let Ok(v) = HeaderValue::from_str(&s.to_string())
        {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
        r
    }
}
