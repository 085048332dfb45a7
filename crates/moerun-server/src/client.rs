//! A small HTTP/1.1 client for the benchmark and the tests: JSON in, JSON or Server-Sent Events
//! out, over plain TCP (the server binds loopback; there is no TLS here). Each SSE `data:`
//! payload is handed to the caller as soon as it arrives, so timings taken in the callback are
//! the client's view of time to first token and inter-token latency.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// Why a request did not get an answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid request: {0}")]
    Request(String),
    #[error("connection failed: {0}")]
    Connect(String),
    #[error("reading the response failed: {0}")]
    Body(String),
}

/// An answer: its status and whole body.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// A client of one server.
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
    base: String,
    api_key: Option<String>,
}

impl HttpClient {
    /// A client of the server at `base` (e.g. `http://127.0.0.1:8000`), sending `api_key` as a
    /// bearer token when given.
    pub fn new(base: &str, api_key: Option<String>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        HttpClient {
            inner: Client::builder(TokioExecutor::new()).build(connector),
            base: base.trim_end_matches('/').to_string(),
            api_key,
        }
    }

    fn request(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
    ) -> Result<Request<Full<Bytes>>, ClientError> {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header(CONTENT_TYPE, "application/json");
        if let Some(key) = &self.api_key {
            builder = builder.header(AUTHORIZATION, format!("Bearer {key}"));
        }
        builder
            .body(Full::new(body))
            .map_err(|e| ClientError::Request(e.to_string()))
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> Result<Reply, ClientError> {
        self.send(self.request(Method::GET, path, Bytes::new())?)
            .await
    }

    /// `POST path` with a raw body (for tests of malformed input).
    pub async fn post_raw(&self, path: &str, body: impl Into<Bytes>) -> Result<Reply, ClientError> {
        self.send(self.request(Method::POST, path, body.into())?)
            .await
    }

    /// `POST path` with a JSON body.
    pub async fn post_json(&self, path: &str, body: &Value) -> Result<Reply, ClientError> {
        self.post_raw(path, body.to_string()).await
    }

    async fn send(&self, request: Request<Full<Bytes>>) -> Result<Reply, ClientError> {
        let response = self
            .inner
            .request(request)
            .await
            .map_err(|e| ClientError::Connect(e.to_string()))?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| ClientError::Body(e.to_string()))?
            .to_bytes()
            .to_vec();
        Ok(Reply { status, body })
    }

    /// `POST path` expecting an event stream: `on_data` gets each `data:` payload as it arrives
    /// and returns false to hang up early (a client that leaves mid-stream). A non-200 answer is
    /// returned whole instead, with nothing passed to `on_data`.
    pub async fn post_stream(
        &self,
        path: &str,
        body: &Value,
        mut on_data: impl FnMut(&str) -> bool,
    ) -> Result<Reply, ClientError> {
        let request = self.request(Method::POST, path, body.to_string().into())?;
        let response = self
            .inner
            .request(request)
            .await
            .map_err(|e| ClientError::Connect(e.to_string()))?;
        let status = response.status().as_u16();
        let mut body = response.into_body();
        let mut raw = Vec::new();
        let mut pending = String::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ClientError::Body(e.to_string()))?;
            let Ok(bytes) = frame.into_data() else {
                continue;
            };
            if status != 200 {
                raw.extend_from_slice(&bytes);
                continue;
            }
            pending.push_str(&String::from_utf8_lossy(&bytes));
            while let Some(end) = pending.find("\n\n") {
                let event: String = pending.drain(..end + 2).collect();
                for line in event.lines() {
                    if let Some(payload) = line.strip_prefix("data:") {
                        if !on_data(payload.trim_start()) {
                            // Dropping the body closes the connection: the server sees a
                            // client that went away.
                            return Ok(Reply { status, body: raw });
                        }
                    }
                }
            }
        }
        Ok(Reply { status, body: raw })
    }
}
