//! The HTTP surface: routes, API-key check, request counting, and the two generation handlers
//! that validate a body, encode its prompt, submit it to the engine and answer whole or as SSE.
//! Every error a client can cause is answered with an [`ApiError`]; nothing here unwraps client
//! input.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use moerun_engine::scheduler::AddError;
use serde_json::json;

use crate::api::request::{self, Endpoint, ParsedRequest, Prompt};
use crate::api::response::{full_response, ResponseMeta};
use crate::engine::{EngineHandle, Event, GenerationRequest, SubmitError};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::served::ServedModel;
use crate::sse::{stream_response, StreamOptions};

/// What every handler shares.
pub struct AppState {
    pub model: Arc<ServedModel>,
    pub engine: EngineHandle,
    pub metrics: Arc<Metrics>,
    /// Clients must send `Authorization: Bearer <key>` to `/v1/*` when set.
    pub api_key: Option<String>,
    /// Longest prompt + completion a request may ask for.
    pub max_model_len: usize,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// Unix time the server started (`created` of the model list).
    pub started: u64,
}

/// The application: every route, with the API-key check and request counting around them.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(state.max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// Check the API key on `/v1/*` and count every answer by endpoint and status.
async fn guard(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let path = request.uri().path().to_string();
    let response = match &state.api_key {
        Some(key) if path.starts_with("/v1/") => match bearer(&request) {
            Some(given) if constant_time_eq(given.as_bytes(), key.as_bytes()) => {
                next.run(request).await
            }
            Some(_) => ApiError::unauthorized("incorrect API key provided").into_response(),
            None => {
                ApiError::unauthorized("missing API key: send it as 'Authorization: Bearer <key>'")
                    .into_response()
            }
        },
        _ => next.run(request).await,
    };
    let endpoint = match path.as_str() {
        "/v1/chat/completions" | "/v1/completions" | "/v1/models" | "/health" | "/metrics" => {
            path.as_str()
        }
        // Unknown paths share one label, so clients cannot grow the metric without bound.
        _ => "other",
    };
    state
        .metrics
        .count_http(endpoint, response.status().as_u16());
    response
}

fn bearer(request: &Request) -> Option<&str> {
    let value = request
        .headers()
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// Compare without an early exit, so the time taken does not reveal how much of a key matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn no_route(uri: Uri) -> ApiError {
    ApiError::no_route(uri.path())
}

async fn wrong_method(uri: Uri) -> ApiError {
    ApiError::method_not_allowed(uri.path())
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.engine.is_alive() {
        StatusCode::OK.into_response()
    } else {
        ApiError::internal("the engine has stopped").into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model.name,
            "object": "model",
            "created": state.started,
            "owned_by": "moerun",
            "root": state.model.dir.display().to_string(),
            "max_model_len": state.max_model_len,
        }],
    }))
}

async fn chat(State(state): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    generate(state, Endpoint::Chat, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, Endpoint::Completion, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Validate, encode, submit, and answer one generation request.
async fn generate(
    state: Arc<AppState>,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let body = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(state.max_body_bytes)
        } else {
            ApiError::bad_request("invalid_body", r.body_text())
        }
    })?;
    let parsed = request::parse(endpoint, &body)?;
    if parsed.model != state.model.name {
        return Err(ApiError::model_not_found(&parsed.model, &state.model.name));
    }
    let prompt_param = match parsed.prompt {
        Prompt::Chat { .. } => "messages",
        _ => "prompt",
    };
    // Templates and tokenizers are CPU work proportional to the prompt: keep them off the
    // threads that serve connections.
    let model = state.model.clone();
    let max_model_len = state.max_model_len;
    let (parsed, generation) =
        tokio::task::spawn_blocking(move || prepare(&model, parsed, max_model_len, arrival))
            .await
            .map_err(|_| ApiError::internal("prompt preparation failed"))??;
    let max_tokens_param = parsed.max_tokens.map_or("max_tokens", |(_, p)| p);
    let events = state
        .engine
        .submit(generation)
        .await
        .map_err(|e| submit_error(e, prompt_param, max_tokens_param))?;
    let meta = ResponseMeta {
        endpoint,
        id: request_id(endpoint),
        created: unix_now(),
        model: state.model.name.clone(),
        logprobs: parsed.logprobs.is_some(),
    };
    if parsed.stream {
        let options = StreamOptions {
            include_usage: parsed.include_usage,
            continuous_usage: parsed.continuous_usage,
        };
        return Ok(stream_response(meta, options, events));
    }
    collect(meta, events).await
}

/// Encode the prompt and settle every generation parameter against the model.
fn prepare(
    model: &ServedModel,
    parsed: ParsedRequest,
    max_model_len: usize,
    arrival: Instant,
) -> Result<(ParsedRequest, GenerationRequest), ApiError> {
    let prompt_tokens = model.encode_prompt(&parsed.prompt)?;
    let sampling = model.sampling_params(&parsed.sampling)?;
    let vocab = model.vocab_size();
    if let Some(bad) = parsed.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(
            "stop_token_ids",
            "invalid_value",
            format!("token id {bad} is outside the vocabulary of {vocab} ids"),
        ));
    }
    let max_new_tokens = parsed.max_tokens.map_or_else(
        || model.default_max_tokens(prompt_tokens.len(), max_model_len),
        |(n, _)| n,
    );
    let generation = GenerationRequest {
        prompt_tokens,
        max_new_tokens,
        sampling,
        stop: parsed.stop.clone(),
        stop_token_ids: parsed.stop_token_ids.clone(),
        ignore_eos: parsed.ignore_eos,
        logprobs: parsed.logprobs,
        every_token: parsed.continuous_usage,
        arrival,
    };
    Ok((parsed, generation))
}

/// The API error for a refused submission.
fn submit_error(e: SubmitError, prompt_param: &str, max_tokens_param: &str) -> ApiError {
    match e {
        SubmitError::Busy => ApiError::overloaded(e.to_string()),
        SubmitError::Stopped => ApiError::internal(e.to_string()),
        SubmitError::Rejected(add) => {
            let message = add.to_string();
            match add {
                AddError::QueueFull { .. } => ApiError::overloaded(message),
                AddError::EmptyPrompt | AddError::PromptTooLong { .. } => {
                    ApiError::invalid(prompt_param, "context_length_exceeded", message)
                }
                AddError::ZeroMaxNewTokens => {
                    ApiError::invalid(max_tokens_param, "invalid_value", message)
                }
                AddError::ContextTooLong { .. } | AddError::ExceedsKvCapacity { .. } => {
                    ApiError::invalid(max_tokens_param, "context_length_exceeded", message)
                }
                AddError::DuplicateId(_) => ApiError::internal(message),
            }
        }
    }
}

/// Wait for the whole completion and answer it in one body.
async fn collect(
    meta: ResponseMeta,
    mut events: crate::engine::EventReceiver,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    loop {
        match events.recv().await {
            Some(Event::Delta {
                text: t,
                logprobs: lp,
                ..
            }) => {
                text.push_str(&t);
                logprobs.extend(lp);
            }
            Some(Event::Finished { reason, usage }) => {
                let body = full_response(&meta, &text, &logprobs, reason, usage);
                return Ok(Json(body).into_response());
            }
            Some(Event::Failed(message)) => return Err(ApiError::internal(message)),
            None => return Err(ApiError::internal("the engine stopped")),
        }
    }
}

fn request_id(endpoint: Endpoint) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let salt: u32 = rand::random();
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completion => "cmpl",
    };
    format!("{prefix}-{salt:08x}{n:08x}")
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
