//! The OpenAI-compatible HTTP server (axum): routes, API-key check, body
//! limit, and the completion / chat handlers that hand validated requests to
//! the scheduler and stream its events back as SSE or one JSON body.

pub mod conn;
pub mod error;
pub mod openai;
mod response;
pub mod tls;
pub mod tools;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use epserve_core::engine::Engine;
use http_body_util::BodyExt;
use serde_json::json;
use tokio::sync::Semaphore;

use crate::scheduler::{SchedulerHandle, SubmitError};
use error::ApiError;
use openai::{ChatBody, CompletionBody, Limits, Parsed};

pub use conn::HttpOptions;

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub served_model_names: Vec<String>,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    pub max_logprobs: usize,
    /// The whole request body must arrive within this (slow-loris bodies get 408).
    pub body_timeout: Duration,
    /// Most /v1 requests in flight at once; beyond, 503 + Retry-After.
    pub max_concurrent_requests: usize,
    /// Longest prompt text (completion prompt, or all chat message contents
    /// and the rendered template) in bytes, checked before tokenization.
    /// `None`: 16 bytes per token of the context length.
    pub max_prompt_bytes: Option<usize>,
    /// Most stop strings per request, and the longest one in bytes.
    pub max_stop_strings: usize,
    pub max_stop_string_bytes: usize,
}

impl ServerConfig {
    /// Defaults for everything but the names.
    pub fn new(served_model_names: Vec<String>) -> Self {
        ServerConfig {
            served_model_names,
            api_key: None,
            max_body_bytes: 8 * 1024 * 1024,
            max_logprobs: 20,
            body_timeout: Duration::from_secs(30),
            max_concurrent_requests: 2048,
            max_prompt_bytes: None,
            max_stop_strings: 16,
            max_stop_string_bytes: 256,
        }
    }
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
    /// Permits for /v1 requests in flight.
    pub inflight: Arc<Semaphore>,
    pub ready: OnceLock<Ready>,
    /// Extra readiness check (the cluster's), if any.
    pub health: OnceLock<HealthCheck>,
}

impl AppState {
    /// State of a server whose model is still loading.
    pub fn new(config: ServerConfig) -> Arc<Self> {
        Arc::new(AppState {
            inflight: Arc::new(Semaphore::new(config.max_concurrent_requests.max(1))),
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

    /// The name responses report for a request's `model`: the first served
    /// name whichever one the request used (as vLLM), or 404 for a name not
    /// served.
    fn check_model(&self, model: Option<&str>) -> Result<String, ApiError> {
        let names = &self.config.served_model_names;
        let first = names.first().cloned().unwrap_or_default();
        match model {
            None => Ok(first),
            Some(m) if names.iter().any(|n| n == m) => Ok(first),
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
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        // Run in reverse: check the key, read the body (bounded in size and
        // time), then take a concurrency permit. A body still arriving holds
        // a connection but no permit, so slow clients cannot starve the
        // permits; memory for bodies is bounded by connections × body limit.
        .route_layer(middleware::from_fn_with_state(state.clone(), shed_load))
        .route_layer(middleware::from_fn_with_state(state.clone(), read_body))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|req: HttpRequest| async move { ApiError::not_found(req.uri().path()) })
        .method_not_allowed_fallback(|req: HttpRequest| async move {
            ApiError::method_not_allowed(req.method(), req.uri().path())
        })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Global concurrency limit with load shedding: a /v1 request that finds
/// every permit taken is answered 503 + Retry-After at once instead of
/// queueing. The permit is held until the response body is finished.
async fn shed_load(State(state): State<Arc<AppState>>, req: HttpRequest, next: Next) -> Response {
    let Ok(permit) = state.inflight.clone().try_acquire_owned() else {
        metrics::counter!("epserve_http_shed_total").increment(1);
        return ApiError::unavailable(
            format!(
                "the server is handling its limit of {} concurrent requests; retry later",
                state.config.max_concurrent_requests
            ),
            1,
        )
        .into_response();
    };
    let resp = next.run(req).await;
    resp.map(|b| conn::Guarded::wrap(b, permit))
}

/// Reads a request body under the size limit and a total deadline before the
/// handler sees it: a `Content-Length` over the limit is refused (413) before
/// a byte is read, a body that grows past it is refused as soon as it does,
/// and a body that has not fully arrived within `body_timeout` gets 408.
async fn read_body(State(state): State<Arc<AppState>>, req: HttpRequest, next: Next) -> Response {
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    let limit = state.config.max_body_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().parse::<u64>());
    match declared {
        Some(Ok(n)) if n > limit as u64 => return ApiError::too_large(limit).into_response(),
        Some(Err(_)) => return ApiError::bad_request("invalid Content-Length").into_response(),
        _ => {}
    }
    let (parts, body) = req.into_parts();
    let limited = http_body_util::Limited::new(body, limit);
    let bytes = match tokio::time::timeout(state.config.body_timeout, limited.collect()).await {
        Err(_) => {
            metrics::counter!("epserve_http_body_timeouts_total").increment(1);
            return ApiError::request_timeout(state.config.body_timeout).into_response();
        }
        Ok(Err(e)) => {
            if e.is::<http_body_util::LengthLimitError>() {
                return ApiError::too_large(limit).into_response();
            }
            return ApiError::bad_request(format!("cannot read the request body: {e}"))
                .into_response();
        }
        Ok(Ok(c)) => c.to_bytes(),
    };
    next.run(HttpRequest::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
    .await
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

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    // The single process's own expert tiers, read at scrape time.
    if let Ok(ready) = state.ready()
        && let Some(t) = ready.engine.model.expert_tiers()
    {
        crate::metrics::expert_tiers("local", &t.snapshot());
    }
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
    let max_model_len = ready.scheduler.config().max_model_len;
    Limits {
        max_model_len,
        max_logprobs: state.config.max_logprobs,
        max_prompt_bytes: state
            .config
            .max_prompt_bytes
            .unwrap_or_else(|| max_model_len.saturating_mul(16).max(64 * 1024)),
        max_stop_strings: state.config.max_stop_strings,
        max_stop_string_bytes: state.config.max_stop_string_bytes,
    }
}

/// Runs `f` (JSON parsing, chat template, tokenization: CPU work that grows
/// with the body) on the blocking pool, off the async runtime's threads.
async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("request parsing failed: {e}")))?
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(&state, body)?;
    let ready = state.ready()?;
    let (engine, lim, st) = (ready.engine.clone(), limits(ready, &state), state.clone());
    let (parsed, model) = off_runtime(move || {
        let b: CompletionBody = openai::parse_body(&bytes)?;
        let model = st.check_model(b.model.as_deref())?;
        Ok((openai::parse_completion(&engine, lim, &b)?, model))
    })
    .await?;
    run(ready, parsed, model, response::Kind::Completion).await
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(&state, body)?;
    let ready = state.ready()?;
    let (engine, lim, st) = (ready.engine.clone(), limits(ready, &state), state.clone());
    let (parsed, model) = off_runtime(move || {
        let b: ChatBody = openai::parse_body(&bytes)?;
        let model = st.check_model(b.model.as_deref())?;
        Ok((openai::parse_chat(&engine, lim, &b)?, model))
    })
    .await?;
    run(ready, parsed, model, response::Kind::Chat).await
}

/// `POST /tokenize` (vLLM's shape): `{count, max_model_len, tokens, token_strs}`.
async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(&state, body)?;
    let ready = state.ready()?;
    let (engine, lim, st) = (ready.engine.clone(), limits(ready, &state), state.clone());
    let t = off_runtime(move || {
        let t = openai::tokenize(&engine, lim, &bytes)?;
        st.check_model(t.model.as_deref())?;
        Ok(t)
    })
    .await?;
    Ok(axum::Json(json!({
        "count": t.tokens.len(),
        "max_model_len": lim.max_model_len,
        "tokens": t.tokens,
        "token_strs": t.token_strs,
    }))
    .into_response())
}

/// `POST /detokenize` (vLLM's shape): `{tokens}` → `{prompt}`.
async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(&state, body)?;
    let ready = state.ready()?;
    let (engine, lim, st) = (ready.engine.clone(), limits(ready, &state), state.clone());
    let text = off_runtime(move || {
        let (model, text) = openai::detokenize(&engine, lim, &bytes)?;
        st.check_model(model.as_deref())?;
        Ok(text)
    })
    .await?;
    Ok(axum::Json(json!({ "prompt": text })).into_response())
}

async fn run(
    ready: &Ready,
    parsed: Parsed,
    model: String,
    kind: response::Kind,
) -> Result<Response, ApiError> {
    let n_prompt = parsed.request.prompt_token_ids.len();
    let n = parsed.request.n;
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
        n,
        created: unix_now(),
        id: response::new_id(kind),
        tools: parsed.tools,
    };
    if parsed.stream {
        Ok(response::stream(ctx, rx, parsed.include_usage))
    } else {
        response::collect(ctx, rx).await
    }
}

/// Serves on `listener` until SIGINT/SIGTERM, then drains in-flight requests
/// (for at most `opts.shutdown_timeout`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    opts: HttpOptions,
) -> std::io::Result<()> {
    serve_until(listener, state, opts, shutdown_signal()).await
}

/// [`serve`], stopping when `shutdown` resolves instead of on a signal.
pub async fn serve_until<F>(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    opts: HttpOptions,
    shutdown: F,
) -> std::io::Result<()>
where
    F: std::future::Future<Output = ()> + Send,
{
    conn::serve_connections(listener, router(state), opts, shutdown).await
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
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
