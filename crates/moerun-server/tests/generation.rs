//! The server end to end over HTTP: greedy output equals transformers' for both endpoints, whole
//! and streamed; a request's greedy tokens do not depend on what else is batched with it, through
//! chunked prefill, prefix-cache hits and preemption; stop strings, logprobs and seeds behave.

mod common;

use common::*;
use futures_util::future::join_all;
use moerun_server::client::HttpClient;
use serde_json::{json, Value};

#[test]
fn completions_and_chat_match_transformers_greedy_whole_and_streamed() {
    let server = start(options());
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    for r in references() {
        let (path, body) = match r.kind.as_str() {
            "text" => (
                "/v1/completions",
                json!({"model": MODEL, "prompt": r.prompt}),
            ),
            _ => (
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": [{"role": "user", "content": r.prompt}]}),
            ),
        };
        // No max_tokens and no temperature: generation_config.json's greedy 24 tokens apply.
        let whole = rt.block_on(client.post_json(path, &body)).unwrap();
        assert_eq!(
            whole.status,
            200,
            "{}",
            String::from_utf8_lossy(&whole.body)
        );
        let json = whole.json();
        assert_eq!(text_of(&json), r.text, "{} whole", r.kind);
        assert_eq!(json["choices"][0]["finish_reason"], "length");
        assert_eq!(json["usage"]["prompt_tokens"], r.prompt_ids.len());
        assert_eq!(json["usage"]["completion_tokens"], r.greedy_ids.len());

        let mut body = body.clone();
        body["stream_options"] = json!({"include_usage": true});
        let (status, s) = rt.block_on(stream(&client, path, &body));
        assert_eq!(status, 200);
        assert!(s.done && s.errors.is_empty(), "{s:?}");
        assert_eq!(s.text, r.text, "{} streamed", r.kind);
        assert_eq!(s.finish_reason.as_deref(), Some("length"));
        assert_eq!(s.usage.unwrap()["completion_tokens"], r.greedy_ids.len());
    }
}

/// Distinct prompts built from the fixture's vocabulary, some sharing a long prefix.
fn prompts(n: usize) -> Vec<Vec<u32>> {
    let shared: Vec<u32> = (0..40).map(|i| 100 + (i * 7) % 300).collect();
    (0..n)
        .map(|i| {
            let len = 5 + (i * 13) % 60;
            let own = (0..len).map(|j| ((i * 31 + j * 17) % 480 + 20) as u32);
            if i % 3 == 0 {
                shared.iter().copied().chain(own).collect()
            } else {
                own.collect()
            }
        })
        .collect()
}

fn lone_results(
    client: &HttpClient,
    rt: &tokio::runtime::Runtime,
    prompts: &[Vec<u32>],
    n: usize,
) -> Vec<String> {
    prompts
        .iter()
        .map(|p| {
            let reply = rt
                .block_on(client.post_json("/v1/completions", &completion(p, n)))
                .unwrap();
            assert_eq!(reply.status, 200);
            text_of(&reply.json())
        })
        .collect()
}

/// `n` prompts' greedy completions of `tokens` tokens, each alone and then all at once, must
/// agree; returns the /metrics text after.
fn same_text_alone_and_together(server: &moerun_server::Server, n: usize, tokens: usize) -> String {
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let prompts = prompts(n);
    let alone = lone_results(&client, &rt, &prompts, tokens);
    let together = rt.block_on(join_all(prompts.iter().map(|p| {
        let client = client.clone();
        let body = completion(p, tokens);
        async move { stream(&client, "/v1/completions", &body).await }
    })));
    for (i, ((status, s), want)) in together.into_iter().zip(&alone).enumerate() {
        assert_eq!(status, 200);
        assert_eq!(&s.text, want, "request {i} differs when batched");
    }
    let metrics = rt.block_on(client.get("/metrics")).unwrap();
    String::from_utf8(metrics.body).unwrap()
}

#[test]
fn greedy_text_is_the_same_alone_and_among_sixteen_others() {
    // A small step budget forces chunked prefills to share steps with decodes.
    let server = start(moerun_server::ServerOptions {
        max_num_batched_tokens: 48,
        max_num_seqs: 32,
        ..options()
    });
    let text = same_text_alone_and_together(&server, 17, 40);
    assert!(
        metric(&text, "moerun_prefix_cache_hits_total") > 0.0,
        "shared prefixes hit"
    );
    assert_eq!(metric(&text, "moerun_kv_cache_blocks_used"), 0.0);
}

/// `--kv-dtype bf16`: the server sizes and keeps its cache in bf16, and a request's greedy text
/// still does not depend on what shares its steps (chunked prefills, prefix-cache hits).
#[test]
fn a_bf16_kv_cache_serves_the_same_text_alone_and_batched() {
    let server = start(moerun_server::ServerOptions {
        kv_dtype: moerun_core::DType::BF16,
        max_num_batched_tokens: 48,
        max_num_seqs: 8,
        ..options()
    });
    let text = same_text_alone_and_together(&server, 7, 24);
    // The cache itself is bf16: 2 bytes a value over every block the scheduler was given.
    let blocks = metric(&text, "moerun_kv_cache_blocks_total");
    let cfg = moerun_model::ModelConfig::from_json_str(
        &std::fs::read_to_string(fixture_dir().join("config.json")).unwrap(),
    )
    .unwrap();
    let want = blocks * 16.0 * cfg.kv_bytes_per_token(2) as f64;
    assert!(blocks > 0.0);
    assert_eq!(metric(&text, "moerun_kv_cache_bytes"), want);
}

#[test]
fn running_out_of_kv_blocks_preempts_and_every_request_still_completes_exactly() {
    // 12 blocks of 16 tokens: two of these requests fit at once, eight arrive together.
    let server = start(moerun_server::ServerOptions {
        kv_cache_bytes: Some(12 * 16 * 1152),
        ..options()
    });
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let prompts: Vec<Vec<u32>> = prompts(8)
        .into_iter()
        .map(|p| p[..p.len().min(30)].to_vec())
        .collect();
    let alone = lone_results(&client, &rt, &prompts, 60);
    let together = rt.block_on(join_all(prompts.iter().map(|p| {
        let client = client.clone();
        let body = json!({"model": MODEL, "prompt": p, "max_tokens": 60, "temperature": 0, "ignore_eos": true});
        async move { client.post_json("/v1/completions", &body).await.unwrap() }
    })));
    for (i, (reply, want)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        assert_eq!(
            &text_of(&reply.json()),
            want,
            "request {i} differs after preemption"
        );
    }
    let metrics = String::from_utf8(rt.block_on(client.get("/metrics")).unwrap().body).unwrap();
    assert!(
        metric(&metrics, "moerun_num_preemptions_total") > 0.0,
        "{metrics}"
    );
}

#[test]
fn a_stop_string_ends_the_text_before_it_with_finish_reason_stop() {
    let server = start(options());
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let r = &references()[0];
    // " wide\u{fffd}stkindho..." : stop at "kind".
    let cut = r.text.find("kind").unwrap();
    let body = json!({"model": MODEL, "prompt": r.prompt, "stop": ["kind", "never-there"]});
    let json = rt
        .block_on(client.post_json("/v1/completions", &body))
        .unwrap()
        .json();
    assert_eq!(text_of(&json), &r.text[..cut]);
    assert_eq!(json["choices"][0]["finish_reason"], "stop");
    let (_, s) = rt.block_on(stream(&client, "/v1/completions", &body));
    assert_eq!(s.text, &r.text[..cut]);
    assert_eq!(s.finish_reason.as_deref(), Some("stop"));
}

#[test]
fn a_stop_token_id_ends_generation_without_its_text() {
    let server = start(options());
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let r = &references()[0];
    // The 5th greedy token as a stop token: four tokens come out.
    let body = json!({"model": MODEL, "prompt": r.prompt_ids, "stop_token_ids": [r.greedy_ids[4]]});
    let json = rt
        .block_on(client.post_json("/v1/completions", &body))
        .unwrap()
        .json();
    assert_eq!(json["choices"][0]["finish_reason"], "stop");
    assert_eq!(json["usage"]["completion_tokens"], 4);
}

#[test]
fn logprobs_come_in_each_endpoints_shape_and_greedy_picks_the_top_one() {
    let server = start(options());
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 5, "logprobs": true, "top_logprobs": 3});
    let json = rt
        .block_on(client.post_json("/v1/chat/completions", &chat))
        .unwrap()
        .json();
    let content = json["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), 5);
    for entry in &content {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(
            entry["logprob"], top[0]["logprob"],
            "greedy takes the most likely"
        );
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
    }
    let completion = json!({"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "logprobs": 2});
    let json = rt
        .block_on(client.post_json("/v1/completions", &completion))
        .unwrap()
        .json();
    let lp = &json["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 4);
    assert_eq!(lp["text_offset"][0], 0);
    assert!(lp["top_logprobs"][0].as_object().unwrap().len() <= 2);
}

#[test]
fn a_seeded_sampled_request_repeats_alone_and_in_a_batch() {
    let server = start(options());
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let body = |seed: u64| {
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 30,
               "temperature": 1.0, "top_p": 0.9, "seed": seed, "ignore_eos": true})
    };
    let first = text_of(
        &rt.block_on(client.post_json("/v1/completions", &body(7)))
            .unwrap()
            .json(),
    );
    let again = rt.block_on(join_all((0..6).map(|i| {
        let client = client.clone();
        let b = body(if i == 0 { 7 } else { 100 + i });
        async move {
            client
                .post_json("/v1/completions", &b)
                .await
                .unwrap()
                .json()
        }
    })));
    assert_eq!(
        text_of(&again[0]),
        first,
        "same seed, same text, whatever the batch"
    );
}

#[test]
fn models_health_and_metrics_answer() {
    let server = start(options());
    let rt = runtime();
    let client = HttpClient::new(&server.url(), None);
    let models = rt.block_on(client.get("/v1/models")).unwrap().json();
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(rt.block_on(client.get("/health")).unwrap().status, 200);
    let r = rt
        .block_on(client.post_json("/v1/completions", &completion(&[1, 2, 3], 3)))
        .unwrap();
    assert_eq!(r.status, 200);
    let text = String::from_utf8(rt.block_on(client.get("/metrics")).unwrap().body).unwrap();
    for name in [
        "moerun_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"}",
        "moerun_prompt_tokens_total",
        "moerun_generation_tokens_total",
        "moerun_num_requests_running",
        "moerun_num_requests_waiting",
        "moerun_kv_cache_blocks_used",
        "moerun_time_to_first_token_seconds_count",
        "moerun_inter_token_latency_seconds_count",
    ] {
        metric(&text, name);
    }
    assert_eq!(metric(&text, "moerun_generation_tokens_total"), 3.0);
    assert_eq!(
        metric(&text, "moerun_inter_token_latency_seconds_count"),
        2.0
    );
    let _: Value = Value::Null;
}
