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
            describe_all();
            handle
        })
        .clone()
}

/// What a metric is (its Prometheus TYPE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every `epserve_*` metric the coordinator / single-process server records:
/// name, type, labels, HELP text. `/metrics` prints HELP and TYPE for each
/// (a metric recorded but missing here would have TYPE only: add it here).
/// README's metrics table compares them with vLLM's.
#[rustfmt::skip]
pub const METRICS: &[(&str, Kind, &[&str], &str)] = &[
    ("epserve_requests_total", Kind::Counter, &["status"], "Requests by final status: ok, error, cancelled, rejected (5xx before running), invalid (4xx)."),
    ("epserve_e2e_request_latency_seconds", Kind::Histogram, &[], "End-to-end latency of requests that finished normally, in seconds."),
    ("epserve_time_to_first_token_seconds", Kind::Histogram, &[], "Time from arrival to the first generated token, in seconds."),
    ("epserve_time_per_output_token_seconds", Kind::Histogram, &[], "Mean time per output token after the first, per request, in seconds."),
    ("epserve_prompt_tokens_total", Kind::Counter, &[], "Prompt tokens of requests that finished normally."),
    ("epserve_generation_tokens_total", Kind::Counter, &[], "Generated tokens of requests that finished normally."),
    ("epserve_num_requests_running", Kind::Gauge, &[], "Requests in the running batch."),
    ("epserve_num_requests_waiting", Kind::Gauge, &[], "Requests waiting to be admitted."),
    ("epserve_kv_cache_usage_ratio", Kind::Gauge, &[], "Fraction of KV cache blocks in use (0 to 1)."),
    ("epserve_prefix_cache_queries_total", Kind::Counter, &[], "Prompt tokens looked up in the prefix cache at admission."),
    ("epserve_prefix_cache_hits_total", Kind::Counter, &[], "Prompt tokens found in the prefix cache at admission (their prefill skipped)."),
    ("epserve_num_preemptions_total", Kind::Counter, &[], "Sequences preempted for lack of KV blocks."),
    ("epserve_batch_size_seqs", Kind::Histogram, &[], "Sequences per scheduler step."),
    ("epserve_batch_size_tokens", Kind::Histogram, &[], "Tokens (prefill chunks and decodes) per scheduler step."),
    ("epserve_step_seconds", Kind::Histogram, &[], "Duration of one scheduler step (one forward pass), in seconds."),
    ("epserve_step_micro_batches", Kind::Histogram, &[], "Micro-batches per scheduler step."),
    ("epserve_step_wait_seconds", Kind::Histogram, &[], "Time per step the scheduler thread waited for remote experts and attention, in seconds."),
    ("epserve_expert_tokens_total", Kind::Counter, &["layer", "expert"], "Tokens routed to each expert of each MoE layer."),
    ("epserve_degraded_requests_total", Kind::Counter, &[], "Requests that finished with some tokens computed without a lost expert (rerouted)."),
    ("epserve_http_connections", Kind::Gauge, &[], "Open client connections of the OpenAI port."),
    ("epserve_http_connections_refused_total", Kind::Counter, &[], "Client connections refused because every connection slot was busy."),
    ("epserve_http_shed_total", Kind::Counter, &[], "Requests answered 503 at once because --max-concurrent-requests were in flight."),
    ("epserve_http_body_timeouts_total", Kind::Counter, &[], "Requests answered 408 because the body did not arrive within --request-body-timeout-secs."),
    ("epserve_dispatch_seconds", Kind::Histogram, &["layer"], "Time to dispatch one MoE layer's tokens to the expert-workers and combine the answers, in seconds."),
    ("epserve_dispatch_bytes_sent_total", Kind::Counter, &["worker"], "Bytes of activations sent to each expert-worker."),
    ("epserve_dispatch_bytes_received_total", Kind::Counter, &["worker"], "Bytes of expert outputs received from each expert-worker."),
    ("epserve_dispatch_failovers_total", Kind::Counter, &[], "Dispatches retried on another replica after a worker failed."),
    ("epserve_expert_worker_up", Kind::Gauge, &["worker"], "1 while an expert-worker answers, 0 after it failed."),
    ("epserve_expert_worker_failures_total", Kind::Counter, &["worker"], "Failed calls to each expert-worker."),
    ("epserve_expert_worker_queue_seconds", Kind::Histogram, &["worker"], "Time a dispatch waited in an expert-worker's queue, in seconds (as the worker reports it)."),
    ("epserve_expert_worker_compute_seconds", Kind::Histogram, &["worker"], "Expert compute time of one dispatch on an expert-worker, in seconds (as the worker reports it)."),
    ("epserve_expert_loss_tokens_total", Kind::Counter, &["action"], "Token rows that hit an expert with no live replica: rerouted or failed."),
    ("epserve_attention_seconds", Kind::Histogram, &["layer"], "Time of one attention layer on the attention-workers, round trip, in seconds."),
    ("epserve_attention_bytes_sent_total", Kind::Counter, &["worker"], "Bytes sent to each attention-worker."),
    ("epserve_attention_bytes_received_total", Kind::Counter, &["worker"], "Bytes received from each attention-worker."),
    ("epserve_attention_retries_total", Kind::Counter, &[], "Attention calls retried."),
    ("epserve_attention_worker_compute_seconds", Kind::Histogram, &["worker"], "Attention compute time on an attention-worker, in seconds (as the worker reports it)."),
    ("epserve_eplb_balancedness", Kind::Gauge, &["layer"], "Expert-parallel load balance of a layer over the last window: mean over max worker load (1 = even)."),
    ("epserve_eplb_worker_tokens", Kind::Gauge, &["layer", "worker"], "Tokens a worker computed for a layer over the last window."),
    ("epserve_eplb_expert_tokens", Kind::Gauge, &["layer", "expert"], "Tokens routed to an expert over the last window."),
    ("epserve_eplb_replica_tokens", Kind::Gauge, &["layer", "expert", "worker"], "Tokens a replica of an expert computed over the last window."),
    ("epserve_expert_tier_hits_total", Kind::Counter, &["worker"], "--expert-memory: expert uses (one per expert per call) that found the expert packed (resident or cached); worker \"local\" in a single process."),
    ("epserve_expert_tier_misses_total", Kind::Counter, &["worker"], "--expert-memory: expert uses that packed the expert from the checkpoint first."),
    ("epserve_expert_tier_evictions_total", Kind::Counter, &["worker"], "--expert-memory: cached experts dropped to make room."),
    ("epserve_expert_tier_paged_in_bytes_total", Kind::Counter, &["worker"], "--expert-memory: bytes of packed experts built from the checkpoint (misses and prefetches)."),
    ("epserve_expert_tier_prefetch_hinted_total", Kind::Counter, &["worker"], "--expert-memory: experts named by router-lookahead hints that were not packed yet."),
    ("epserve_expert_tier_prefetched_total", Kind::Counter, &["worker"], "--expert-memory: experts packed ahead of use on a router-lookahead hint (a hint is dropped when making room would evict an expert the last two steps used)."),
    ("epserve_expert_tier_prefetch_hits_total", Kind::Counter, &["worker"], "--expert-memory: prefetched experts used before being evicted."),
    ("epserve_expert_tier_bytes", Kind::Gauge, &["worker", "tier"], "--expert-memory: packed bytes held per tier (resident, cached); their sum never exceeds the budget."),
    ("epserve_expert_tier_experts", Kind::Gauge, &["worker", "tier"], "--expert-memory: experts assigned per tier (resident, cached, cold)."),
    ("epserve_expert_tier_budget_bytes", Kind::Gauge, &["worker"], "--expert-memory: the budget for packed experts."),
];

/// Exports expert tier counters (`--expert-memory`) of `worker` (`local`
/// for the experts of a single process).
pub fn expert_tiers(worker: &str, t: &epserve_core::experts::TierSnapshot) {
    use metrics::{counter, gauge};
    let w = worker.to_string();
    counter!("epserve_expert_tier_hits_total", "worker" => w.clone()).absolute(t.hits);
    counter!("epserve_expert_tier_misses_total", "worker" => w.clone()).absolute(t.misses);
    counter!("epserve_expert_tier_evictions_total", "worker" => w.clone()).absolute(t.evictions);
    counter!("epserve_expert_tier_paged_in_bytes_total", "worker" => w.clone())
        .absolute(t.bytes_paged_in);
    counter!("epserve_expert_tier_prefetched_total", "worker" => w.clone()).absolute(t.prefetched);
    counter!("epserve_expert_tier_prefetch_hinted_total", "worker" => w.clone()).absolute(t.hinted);
    counter!("epserve_expert_tier_prefetch_hits_total", "worker" => w.clone())
        .absolute(t.prefetch_hits);
    for (tier, bytes, n) in [
        ("resident", t.resident_bytes, t.resident_experts),
        ("cached", t.cached_bytes, t.cached_experts),
    ] {
        gauge!("epserve_expert_tier_bytes", "worker" => w.clone(), "tier" => tier)
            .set(bytes as f64);
        gauge!("epserve_expert_tier_experts", "worker" => w.clone(), "tier" => tier).set(n as f64);
    }
    let cold = t
        .held_experts
        .saturating_sub(t.resident_experts + t.cached_experts);
    gauge!("epserve_expert_tier_experts", "worker" => w.clone(), "tier" => "cold").set(cold as f64);
    gauge!("epserve_expert_tier_budget_bytes", "worker" => w).set(t.budget_bytes as f64);
}

/// Gives every metric of [`METRICS`] its HELP text (and TYPE, which the
/// exporter prints once a metric has a value).
fn describe_all() {
    for &(name, kind, _, help) in METRICS {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, help),
        }
    }
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
