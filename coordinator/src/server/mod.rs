//! The OpenAI-compatible HTTP server (axum): routes, API-key check, body
//! limit, and the completion / chat handlers that hand validated requests to
//! the scheduler and stream its events back as SSE or one JSON body.

pub mod error;
pub mod openai;
mod response;

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use epserve_core::engine::Engine;
use serde_json::json;

use crate::scheduler::{SchedulerHandle, SubmitError};
use error::ApiError;
use openai::{ChatBody, CompletionBody, Limits, Parsed};

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub served_model_names: Vec<String>,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    pub max_logprobs: usize,
}

/// What exists once the model is loaded.
pub struct Ready {
    pub engine: Arc<Engine>,
    pub scheduler: SchedulerHandle,
    pub created: u64,
}

/// A check `/health` runs once the model is loaded: `Err(details)` answers
/// 503 with the details (e.g. experts with no live replica).
pub type HealthCheck = Arc<dyn Fn() -> Result<(), serde_json::Value> + Send + Sync>;

/// Shared handler state.
pub struct AppState {
    pub config: ServerConfig,
    pub ready: OnceLock<Ready>,
    /// Extra readiness check (the cluster's), if any.
    pub health: OnceLock<HealthCheck>,
}

impl AppState {
    /// State of a server whose model is still loading.
    pub fn new(config: ServerConfig) -> Arc<Self> {
        Arc::new(AppState {
            config,
            ready: OnceLock::new(),
            health: OnceLock::new(),
        })
    }

    fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready
            .get()
            .ok_or_else(|| ApiError::unavailable("the model is still loading", 5))
    }

    fn check_model(&self, model: Option<&str>) -> Result<String, ApiError> {
        let names = &self.config.served_model_names;
        match model {
            None => Ok(names[0].clone()),
            Some(m) if names.iter().any(|n| n == m) => Ok(m.to_string()),
            Some(m) => Err(ApiError::unknown_model(m, names)),
        }
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The router with all routes and layers.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.config.max_body_bytes;
    let v1 = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|req: HttpRequest| async move { ApiError::not_found(req.uri().path()) })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn auth(State(state): State<Arc<AppState>>, req: HttpRequest, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let ok = given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()));
        if !ok {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.ready.get() {
        Some(_) => match state.health.get().map(|h| h()) {
            Some(Err(details)) => (
                StatusCode::SERVICE_UNAVAILABLE,
                axum::Json(json!({"status": "degraded", "details": details})),
            )
                .into_response(),
            _ => (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response(),
        },
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "loading"})),
        )
            .into_response(),
    }
}

async fn metrics() -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::metrics::render(),
    )
        .into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let max_len = ready.scheduler.config().max_model_len;
    let data: Vec<_> = state
        .config
        .served_model_names
        .iter()
        .map(|n| {
            json!({"id": n, "object": "model", "created": ready.created, "owned_by": "epserve",
                   "root": ready.engine.dir.display().to_string(), "max_model_len": max_len})
        })
        .collect();
    Ok(axum::Json(json!({"object": "list", "data": data})).into_response())
}

fn body_bytes(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(state.config.max_body_bytes)
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"))
        }
    })
}

fn limits(ready: &Ready, state: &AppState) -> Limits {
    Limits {
        max_model_len: ready.scheduler.config().max_model_len,
        max_logprobs: state.config.max_logprobs,
    }
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(&state, body)?;
    let ready = state.ready()?;
    let b: CompletionBody = openai::parse_body(&bytes)?;
    let model = state.check_model(b.model.as_deref())?;
    let parsed = openai::parse_completion(&ready.engine, limits(ready, &state), &b)?;
    run(ready, parsed, model, response::Kind::Completion).await
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(&state, body)?;
    let ready = state.ready()?;
    let b: ChatBody = openai::parse_body(&bytes)?;
    let model = state.check_model(b.model.as_deref())?;
    let parsed = openai::parse_chat(&ready.engine, limits(ready, &state), &b)?;
    run(ready, parsed, model, response::Kind::Chat).await
}

async fn run(
    ready: &Ready,
    parsed: Parsed,
    model: String,
    kind: response::Kind,
) -> Result<Response, ApiError> {
    let n_prompt = parsed.request.prompt_token_ids.len();
    let rx = ready
        .scheduler
        .submit(parsed.request)
        .map_err(|e| match e {
            SubmitError::Overloaded { waiting } => ApiError::unavailable(
                format!("the server is overloaded ({waiting} requests waiting); retry later"),
                1,
            ),
            SubmitError::TooLarge(m) => ApiError::bad_request(m),
            SubmitError::Closed => ApiError::unavailable("the scheduler has stopped", 5),
        })?;
    let ctx = response::Ctx {
        engine: ready.engine.clone(),
        model,
        kind,
        n_prompt,
        created: unix_now(),
        id: response::new_id(kind),
    };
    if parsed.stream {
        Ok(response::stream(ctx, rx, parsed.include_usage))
    } else {
        response::collect(ctx, rx).await
    }
}

/// Binds `addr` and serves until SIGINT/SIGTERM, then drains in-flight requests.
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<AppState>) -> std::io::Result<()> {
    let app = router(state);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown_signal())
    .await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down: draining in-flight requests");
}
