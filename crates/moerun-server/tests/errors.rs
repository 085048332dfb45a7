//! Requests a server must refuse, each with its status and an OpenAI-style error body naming the
//! parameter at fault; clients that leave mid-stream; overload. After each, the server keeps
//! serving.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures_util::future::join_all;
use moerun_server::client::HttpClient;
use serde_json::{json, Value};

/// Assert an OpenAI error body with these status and param.
fn assert_error(status: u16, body: &[u8], want_status: u16, want_param: Option<&str>, case: &str) {
    let text = String::from_utf8_lossy(body);
    assert_eq!(status, want_status, "{case}: {text}");
    let json: Value =
        serde_json::from_slice(body).unwrap_or_else(|_| panic!("{case}: not JSON: {text}"));
    let error = &json["error"];
    for field in ["message", "type", "param", "code"] {
        assert!(error.get(field).is_some(), "{case}: no {field} in {text}");
    }
    assert!(
        !error["message"].as_str().unwrap_or("").is_empty(),
        "{case}"
    );
    assert_eq!(error["param"].as_str(), want_param, "{case}: {text}");
}

#[test]
fn bad_requests_get_the_right_status_and_name_the_parameter() {
    let server = start(moerun_server::ServerOptions {
        max_model_len: Some(64),
        ..options()
    });
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let long_prompt: Vec<u32> = (0..80).map(|i| i % 400).collect();
    let chat = "/v1/chat/completions";
    let comp = "/v1/completions";
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, &str, String, u16, Option<&str>)> = vec![
        ("malformed JSON", comp, "{\"model\": ".into(), 400, None),
        ("not an object", comp, "[1, 2]".into(), 400, None),
        ("missing prompt", comp, json!({"model": MODEL}).to_string(), 400, Some("prompt")),
        ("missing messages", chat, json!({"model": MODEL}).to_string(), 400, Some("messages")),
        ("missing model", chat, json!({"messages": msgs}).to_string(), 400, Some("model")),
        ("unknown model", chat, json!({"model": "gpt-9", "messages": msgs}).to_string(), 404, Some("model")),
        ("wrong type", comp, json!({"model": MODEL, "prompt": "a", "temperature": "hot"}).to_string(), 400, Some("temperature")),
        ("prompt type", comp, json!({"model": MODEL, "prompt": {"a": 1}}).to_string(), 400, Some("prompt")),
        ("messages type", chat, json!({"model": MODEL, "messages": "hi"}).to_string(), 400, Some("messages")),
        ("message role", chat, json!({"model": MODEL, "messages": [{"content": "x"}]}).to_string(), 400, Some("messages[0].role")),
        ("max_tokens 0", comp, json!({"model": MODEL, "prompt": "a", "max_tokens": 0}).to_string(), 400, Some("max_tokens")),
        ("max_tokens < 0", chat, json!({"model": MODEL, "messages": msgs, "max_completion_tokens": -5}).to_string(), 400, Some("max_completion_tokens")),
        ("prompt too long", comp, json!({"model": MODEL, "prompt": long_prompt}).to_string(), 400, Some("prompt")),
        ("context exceeded", comp, json!({"model": MODEL, "prompt": "a", "max_tokens": 500}).to_string(), 400, Some("max_tokens")),
        ("n > 1", chat, json!({"model": MODEL, "messages": msgs, "n": 2}).to_string(), 400, Some("n")),
        ("unknown parameter", comp, json!({"model": MODEL, "prompt": "a", "frobnicate": true}).to_string(), 400, Some("frobnicate")),
        ("several prompts", comp, json!({"model": MODEL, "prompt": ["a", "b"]}).to_string(), 400, Some("prompt")),
        ("token out of vocabulary", comp, json!({"model": MODEL, "prompt": [1, 99999]}).to_string(), 400, Some("prompt")),
        ("top_p out of range", comp, json!({"model": MODEL, "prompt": "a", "top_p": 1.5}).to_string(), 400, Some("top_p")),
        ("top_logprobs without logprobs", chat, json!({"model": MODEL, "messages": msgs, "top_logprobs": 2}).to_string(), 400, Some("top_logprobs")),
        ("tools", chat, json!({"model": MODEL, "messages": msgs, "tools": [{"type": "function"}]}).to_string(), 400, Some("tools")),
        ("echo", comp, json!({"model": MODEL, "prompt": "a", "echo": true}).to_string(), 400, Some("echo")),
        ("stream_options without stream", comp, json!({"model": MODEL, "prompt": "a", "stream_options": {"include_usage": true}}).to_string(), 400, Some("stream_options")),
        ("empty stop string", comp, json!({"model": MODEL, "prompt": "a", "stop": [""]}).to_string(), 400, Some("stop")),
        ("image part", chat, json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).to_string(), 400, Some("messages[0].content[0].type")),
    ];
    for (case, path, body, status, param) in cases {
        let reply = rt.block_on(client.post_raw(path, body)).unwrap();
        assert_error(reply.status, &reply.body, status, param, case);
    }
    let reply = rt.block_on(client.get("/v1/nowhere")).unwrap();
    assert_error(reply.status, &reply.body, 404, None, "unknown path");
    // Still serving.
    let ok = rt
        .block_on(client.post_json(comp, &completion(&[5, 6, 7], 4)))
        .unwrap();
    assert_eq!(ok.status, 200);
}

#[test]
fn an_oversized_body_is_refused_with_413() {
    let server = start(moerun_server::ServerOptions {
        max_body_bytes: 1000,
        ..options()
    });
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let body = json!({"model": MODEL, "prompt": "x".repeat(5000)});
    let reply = rt
        .block_on(client.post_json("/v1/completions", &body))
        .unwrap();
    assert_error(reply.status, &reply.body, 413, None, "oversized");
    let ok = rt
        .block_on(client.post_json("/v1/completions", &completion(&[5], 2)))
        .unwrap();
    assert_eq!(ok.status, 200);
}

#[test]
fn with_an_api_key_v1_requires_it_and_health_does_not() {
    let server = start(moerun_server::ServerOptions {
        api_key: Some("sekret".into()),
        ..options()
    });
    let rt = runtime();
    let body = completion(&[5, 6], 2);
    for (key, status) in [
        (None, 401),
        (Some("wrong".to_string()), 401),
        (Some("sekret".into()), 200),
    ] {
        let client = HttpClient::new(&server.url(), key.clone());
        let reply = rt
            .block_on(client.post_json("/v1/completions", &body))
            .unwrap();
        if status == 401 {
            assert_error(
                reply.status,
                &reply.body,
                401,
                None,
                &format!("key {key:?}"),
            );
        } else {
            assert_eq!(reply.status, 200);
        }
        let models = rt.block_on(client.get("/v1/models")).unwrap();
        assert_eq!(models.status, status);
    }
    let anonymous = HttpClient::new(&server.url(), None);
    assert_eq!(rt.block_on(anonymous.get("/health")).unwrap().status, 200);
}

fn metrics_text(rt: &tokio::runtime::Runtime, client: &HttpClient) -> String {
    String::from_utf8(rt.block_on(client.get("/metrics")).unwrap().body).unwrap()
}

#[test]
fn a_client_leaving_mid_stream_is_aborted_and_its_blocks_freed_at_once() {
    let server = start(options());
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let body = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 4000,
                      "ignore_eos": true, "stream": true,
                      "stream_options": {"continuous_usage_stats": true}});
    let mut chunks = 0;
    let reply = rt
        .block_on(client.post_stream("/v1/completions", &body, |_| {
            chunks += 1;
            chunks < 5
        }))
        .unwrap();
    assert_eq!(reply.status, 200);
    // The abort lands within a step or two; a 4000-token generation would take far longer.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics_text(&rt, &client);
        let aborted = metric(
            &text,
            "moerun_requests_finished_total{finish_reason=\"abort\"}",
        );
        if aborted == 1.0 {
            assert_eq!(metric(&text, "moerun_kv_cache_blocks_used"), 0.0);
            assert_eq!(metric(&text, "moerun_num_requests_running"), 0.0);
            assert!(metric(&text, "moerun_generation_tokens_total") < 4000.0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the abandoned request was not aborted:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let ok = rt
        .block_on(client.post_json("/v1/completions", &completion(&[5, 6], 3)))
        .unwrap();
    assert_eq!(ok.status, 200);
}

#[test]
fn a_client_leaving_before_a_whole_response_is_aborted_too() {
    use std::io::Write;
    let server = start(options());
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let addr = server.url().trim_start_matches("http://").to_string();
    let body = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 4000,
                      "ignore_eos": true})
    .to_string();
    {
        // A raw client that sends a non-streaming request and hangs up without reading.
        let mut socket = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            socket,
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics_text(&rt, &client);
        if metric(
            &text,
            "moerun_requests_finished_total{finish_reason=\"abort\"}",
        ) == 1.0
        {
            assert_eq!(metric(&text, "moerun_kv_cache_blocks_used"), 0.0);
            assert!(metric(&text, "moerun_generation_tokens_total") < 4000.0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the abandoned request was not aborted:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn past_the_waiting_queue_requests_get_503_and_the_rest_complete() {
    let server = start(moerun_server::ServerOptions {
        max_num_seqs: 1,
        max_num_batched_tokens: 16,
        max_waiting: 2,
        ..options()
    });
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let replies = rt.block_on(join_all((0..12).map(|i| {
        let client = client.clone();
        let body = json!({"model": MODEL, "prompt": [1 + i, 2, 3], "max_tokens": 1000,
                          "ignore_eos": true, "temperature": 0});
        async move { client.post_json("/v1/completions", &body).await.unwrap() }
    })));
    let busy = replies.iter().filter(|r| r.status == 503).count();
    let ok = replies.iter().filter(|r| r.status == 200).count();
    assert!(busy > 0, "some requests must be turned away");
    assert_eq!(busy + ok, 12, "only 200 or 503");
    for r in replies.iter().filter(|r| r.status == 503) {
        assert_error(r.status, &r.body, 503, None, "overload");
    }
    for r in replies.iter().filter(|r| r.status == 200) {
        assert_eq!(r.json()["usage"]["completion_tokens"], 1000);
    }
}
