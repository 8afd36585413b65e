//! Prometheus metrics, all prefixed `epserve_`: requests by final status,
//! TTFT / TPOT / end-to-end latency histograms, running and waiting requests,
//! KV cache usage, batch sizes, token counters and per-layer expert load.

use std::sync::OnceLock;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
];
const SIZE_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];

/// Installs the process-wide recorder once and returns its handle.
pub fn init() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let mut b = PrometheusBuilder::new();
            for (name, buckets) in [
                ("epserve_time_to_first_token_seconds", LATENCY_BUCKETS),
                ("epserve_time_per_output_token_seconds", LATENCY_BUCKETS),
                ("epserve_e2e_request_latency_seconds", LATENCY_BUCKETS),
                ("epserve_step_seconds", LATENCY_BUCKETS),
                ("epserve_step_wait_seconds", LATENCY_BUCKETS),
                ("epserve_step_micro_batches", SIZE_BUCKETS),
                ("epserve_batch_size_seqs", SIZE_BUCKETS),
                ("epserve_batch_size_tokens", SIZE_BUCKETS),
            ] {
                b = match b.set_buckets_for_metric(Matcher::Full(name.into()), buckets) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::warn!(error = %e, "metric buckets");
                        PrometheusBuilder::new()
                    }
                };
            }
            let recorder = b.build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed");
            }
            handle
        })
        .clone()
}

/// Prometheus text exposition of everything recorded.
pub fn render() -> String {
    init().render()
}

/// A request reached a final state (`ok`, `error`, `cancelled`, `rejected`, `invalid`).
pub fn request_finished(status: &'static str) {
    counter!("epserve_requests_total", "status" => status).increment(1);
}

/// A request finished normally.
pub fn request_done(e2e: f64, ttft: f64, prompt_tokens: usize, gen_tokens: usize) {
    request_finished("ok");
    histogram!("epserve_e2e_request_latency_seconds").record(e2e);
    if gen_tokens > 1 {
        histogram!("epserve_time_per_output_token_seconds")
            .record((e2e - ttft) / (gen_tokens - 1) as f64);
    }
    counter!("epserve_prompt_tokens_total").increment(prompt_tokens as u64);
    counter!("epserve_generation_tokens_total").increment(gen_tokens as u64);
}

/// Time to first token of one request.
pub fn ttft(secs: f64) {
    histogram!("epserve_time_to_first_token_seconds").record(secs);
}

/// Running and waiting request counts.
pub fn set_queue(running: usize, waiting: usize) {
    gauge!("epserve_num_requests_running").set(running as f64);
    gauge!("epserve_num_requests_waiting").set(waiting as f64);
}

/// Fraction of KV blocks in use.
pub fn set_kv_usage(frac: f64) {
    gauge!("epserve_kv_cache_usage_ratio").set(frac);
}

/// One scheduler step.
pub fn step(seqs: usize, tokens: usize, secs: f64) {
    histogram!("epserve_batch_size_seqs").record(seqs as f64);
    histogram!("epserve_batch_size_tokens").record(tokens as f64);
    histogram!("epserve_step_seconds").record(secs);
}

/// How a step ran: its micro-batches and the time the scheduler thread
/// waited for remote experts and attention.
pub fn micro_step(micro_batches: usize, waited_secs: f64) {
    histogram!("epserve_step_micro_batches").record(micro_batches as f64);
    histogram!("epserve_step_wait_seconds").record(waited_secs);
}

/// A sequence was admitted with prefix caching on: `queried` tokens looked
/// up, `hits` of them found cached (vLLM's `prefix_cache_queries` /
/// `prefix_cache_hits`, in tokens).
pub fn prefix_cache(queried: u64, hits: u64) {
    static DESCRIBED: std::sync::Once = std::sync::Once::new();
    DESCRIBED.call_once(|| {
        metrics::describe_counter!(
            "epserve_prefix_cache_queries_total",
            metrics::Unit::Count,
            "Prompt tokens looked up in the prefix cache at admission."
        );
        metrics::describe_counter!(
            "epserve_prefix_cache_hits_total",
            metrics::Unit::Count,
            "Prompt tokens found in the prefix cache at admission (their prefill skipped)."
        );
    });
    counter!("epserve_prefix_cache_queries_total").increment(queried);
    counter!("epserve_prefix_cache_hits_total").increment(hits);
}

/// A sequence was preempted for lack of KV blocks.
pub fn preempted() {
    counter!("epserve_num_preemptions_total").increment(1);
}

/// Tokens routed to each expert of `layer` in one step.
pub fn expert_load(layer: usize, topk_ids: &[u32], num_experts: usize) {
    let mut counts = vec![0u64; num_experts];
    for &e in topk_ids {
        if let Some(c) = counts.get_mut(e as usize) {
            *c += 1;
        }
    }
    for (e, c) in counts.into_iter().enumerate() {
        if c > 0 {
            counter!("epserve_expert_tokens_total", "layer" => layer.to_string(), "expert" => e.to_string())
                .increment(c);
        }
    }
}
