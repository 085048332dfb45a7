//! Counters, gauges and latency histograms for `GET /metrics`, in the Prometheus text format
//! (version 0.0.4). Written by the engine thread (tokens, latencies, scheduler state) and by the
//! HTTP layer (requests by endpoint and status); read by the scrape. One mutex guards it all:
//! updates are a few additions per step, far below the cost of a forward pass.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use moerun_engine::scheduler::SchedulerStats;

use crate::engine::FinishReason;

/// Upper bounds (seconds) of the time-to-first-token buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
/// Upper bounds (seconds) of the inter-token latency buckets.
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5,
];
/// Upper bounds (seconds) of the whole-request latency buckets.
const E2E_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0,
];

#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), plus one for +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, seconds: f64) {
        let i = self.bounds.partition_point(|&b| b < seconds);
        self.counts[i] += 1;
        self.sum += seconds;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, n) in self.bounds.iter().zip(&self.counts) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

#[derive(Debug)]
struct Inner {
    /// HTTP requests by (endpoint, status code).
    http: BTreeMap<(String, u16), u64>,
    finished: BTreeMap<&'static str, u64>,
    aborted: u64,
    failed: u64,
    rejected_overload: u64,
    rejected_invalid: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    scheduler: Option<SchedulerStats>,
    /// Bytes the KV cache holds (set once, when the engine makes it).
    kv_cache_bytes: u64,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
}

/// The server's metrics; shared by the engine thread and the HTTP handlers.
#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            inner: Mutex::new(Inner {
                http: BTreeMap::new(),
                finished: BTreeMap::new(),
                aborted: 0,
                failed: 0,
                rejected_overload: 0,
                rejected_invalid: 0,
                prompt_tokens: 0,
                generation_tokens: 0,
                scheduler: None,
                kv_cache_bytes: 0,
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(E2E_BUCKETS),
            }),
        }
    }
}

impl Metrics {
    fn with(&self, f: impl FnOnce(&mut Inner)) {
        // A panic while holding the lock cannot leave these counters inconsistent in a way
        // that matters; keep counting rather than poison every later request.
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard);
    }

    /// One HTTP request answered.
    pub fn count_http(&self, endpoint: &str, status: u16) {
        self.with(|m| *m.http.entry((endpoint.to_string(), status)).or_default() += 1);
    }

    pub fn observe_ttft(&self, d: Duration) {
        self.with(|m| m.ttft.observe(d.as_secs_f64()));
    }

    pub fn observe_itl(&self, d: Duration) {
        self.with(|m| m.itl.observe(d.as_secs_f64()));
    }

    /// A request completed normally.
    pub fn observe_finished(&self, reason: FinishReason, e2e: Duration) {
        self.with(|m| {
            *m.finished.entry(reason.as_str()).or_default() += 1;
            m.e2e.observe(e2e.as_secs_f64());
        });
    }

    pub fn count_aborted(&self) {
        self.with(|m| m.aborted += 1);
    }

    pub fn count_failed(&self) {
        self.with(|m| m.failed += 1);
    }

    /// A request the scheduler refused: for load (503) or for itself (400).
    pub fn count_rejected(&self, overload: bool) {
        self.with(|m| {
            if overload {
                m.rejected_overload += 1
            } else {
                m.rejected_invalid += 1
            }
        });
    }

    pub fn add_prompt_tokens(&self, n: usize) {
        self.with(|m| m.prompt_tokens += n as u64);
    }

    pub fn add_generated_tokens(&self, n: usize) {
        self.with(|m| m.generation_tokens += n as u64);
    }

    /// The KV cache's size, once the engine has made it.
    pub fn set_kv_cache_bytes(&self, bytes: usize) {
        self.with(|m| m.kv_cache_bytes = bytes as u64);
    }

    pub fn set_scheduler_stats(&self, stats: &SchedulerStats) {
        self.with(|m| m.scheduler = Some(*stats));
    }

    /// The Prometheus text exposition of everything.
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.with(|m| render_into(m, &mut out));
        out
    }
}

fn render_into(m: &Inner, out: &mut String) {
    let mut counter = |name: &str, help: &str, samples: &[(String, u64)]| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (labels, v) in samples {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    let http: Vec<(String, u64)> = m
        .http
        .iter()
        .map(|((endpoint, status), v)| {
            (
                format!("{{endpoint=\"{endpoint}\",status=\"{status}\"}}"),
                *v,
            )
        })
        .collect();
    counter(
        "moerun_http_requests_total",
        "HTTP requests answered, by endpoint and status.",
        &http,
    );
    let mut finished: Vec<(String, u64)> = ["stop", "length"]
        .iter()
        .map(|r| {
            (
                format!("{{finish_reason=\"{r}\"}}"),
                m.finished.get(r).copied().unwrap_or(0),
            )
        })
        .collect();
    finished.push(("{finish_reason=\"abort\"}".into(), m.aborted));
    finished.push(("{finish_reason=\"error\"}".into(), m.failed));
    counter(
        "moerun_requests_finished_total",
        "Generation requests that ended, by reason.",
        &finished,
    );
    counter(
        "moerun_requests_rejected_total",
        "Generation requests refused at admission, by cause.",
        &[
            ("{reason=\"overload\"}".into(), m.rejected_overload),
            ("{reason=\"invalid\"}".into(), m.rejected_invalid),
        ],
    );
    counter(
        "moerun_prompt_tokens_total",
        "Prompt tokens of admitted requests.",
        &[(String::new(), m.prompt_tokens)],
    );
    counter(
        "moerun_generation_tokens_total",
        "Tokens generated.",
        &[(String::new(), m.generation_tokens)],
    );
    let s = m.scheduler.unwrap_or(SchedulerStats {
        num_running: 0,
        num_waiting: 0,
        kv_blocks_used: 0,
        kv_blocks_total: 0,
        kv_window_blocks_used: 0,
        kv_window_blocks_total: 0,
        prefix_cache: Default::default(),
        num_preemptions: 0,
    });
    counter(
        "moerun_num_preemptions_total",
        "Sequences preempted (recomputed later) for KV space.",
        &[(String::new(), s.num_preemptions)],
    );
    counter(
        "moerun_prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
        &[(String::new(), s.prefix_cache.queried_tokens)],
    );
    counter(
        "moerun_prefix_cache_hits_total",
        "Prompt tokens whose KV came from the prefix cache.",
        &[(String::new(), s.prefix_cache.hit_tokens)],
    );
    let mut gauge = |name: &str, help: &str, v: f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    };
    gauge(
        "moerun_num_requests_running",
        "Sequences holding KV blocks.",
        s.num_running as f64,
    );
    gauge(
        "moerun_num_requests_waiting",
        "Requests queued for admission (preempted ones included).",
        s.num_waiting as f64,
    );
    gauge(
        "moerun_kv_cache_blocks_used",
        "KV blocks referenced by running sequences.",
        s.kv_blocks_used as f64,
    );
    gauge(
        "moerun_kv_cache_blocks_total",
        "KV blocks in the cache.",
        s.kv_blocks_total as f64,
    );
    gauge(
        "moerun_kv_cache_bytes",
        "Bytes the KV cache holds (its blocks at --kv-dtype, host or device).",
        m.kv_cache_bytes as f64,
    );
    gauge(
        "moerun_kv_cache_usage_ratio",
        "Fraction of KV blocks in use.",
        s.kv_usage(),
    );
    gauge(
        "moerun_kv_cache_window_blocks_used",
        "KV blocks of the sliding-window layers referenced by running sequences (0 without a window group).",
        s.kv_window_blocks_used as f64,
    );
    gauge(
        "moerun_kv_cache_window_blocks_total",
        "KV blocks of the sliding-window layers' own pool (0 without a window group).",
        s.kv_window_blocks_total as f64,
    );
    m.ttft.render(
        out,
        "moerun_time_to_first_token_seconds",
        "Time from request arrival to its first token.",
    );
    m.itl.render(
        out,
        "moerun_inter_token_latency_seconds",
        "Time between two tokens of one request.",
    );
    m.e2e.render(
        out,
        "moerun_e2e_request_latency_seconds",
        "Time from arrival to the end of a request.",
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_count_every_observation() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for x in [0.05, 0.1, 0.5, 3.0] {
            h.observe(x);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "test");
        assert!(out.contains("x_bucket{le=\"0.1\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"1\"} 3\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_count 4\n"), "{out}");
    }

    #[test]
    fn every_metric_has_help_and_type_lines() {
        let m = Metrics::default();
        m.count_http("/v1/completions", 200);
        let text = m.render();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or("");
            let family = name
                .trim_end_matches("_bucket")
                .trim_end_matches("_sum")
                .trim_end_matches("_count");
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "no TYPE for {name}"
            );
        }
        assert!(text
            .contains("moerun_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1"));
    }
}
