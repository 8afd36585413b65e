//! The summary table, laid out line for line as `vllm bench serve` prints it,
//! and the result file with the keys vLLM writes.

use std::fmt::Write as _;

use serde_json::{Map, Value, json};

use super::args::Backend;
use super::metrics::{BenchmarkMetrics, RequestOutput, Stats, percentile_word, stats_ms};

/// The run's settings that the table and the result file show.
#[derive(Debug, Clone)]
pub struct RunInfo {
    pub backend: Backend,
    pub label: Option<String>,
    pub model_id: String,
    pub tokenizer_id: String,
    pub num_prompts: usize,
    pub request_rate: f64,
    pub burstiness: f64,
    pub max_concurrency: Option<usize>,
    pub metadata: Vec<(String, String)>,
    pub duration: f64,
    /// Metrics to report (ttft, tpot, itl, e2el, client_queue_time,
    /// e2el_including_client_queue).
    pub percentile_metrics: Vec<String>,
    pub percentiles: Vec<f64>,
    pub goodput_set: bool,
    /// `YYYYMMDD-HHMMSS` (UTC).
    pub date: String,
}

/// A float as Python's `str()` writes it: `inf`, `4.0`, `0.25`.
pub fn py_float(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "inf".into() } else { "-inf".into() }
    } else if v.fract() == 0.0 && v.abs() < 1e16 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

/// One metric section: title, label, statistics, and the key stem in the file.
struct Section {
    key: &'static str,
    name: &'static str,
    header: &'static str,
    stats: Stats,
}

/// The metric sections selected for this run, in vLLM's order.
fn sections(m: &BenchmarkMetrics, info: &RunInfo, outputs: &[RequestOutput]) -> Vec<Section> {
    let mut all = vec![
        Section {
            key: "ttft",
            name: "TTFT",
            header: "Time to First Token",
            stats: m.ttft.clone(),
        },
        Section {
            key: "tpot",
            name: "TPOT",
            header: "Time per Output Token (excl. 1st token)",
            stats: m.tpot.clone(),
        },
        Section {
            key: "itl",
            name: "ITL",
            header: "Inter-token Latency",
            stats: m.itl.clone(),
        },
        Section {
            key: "e2el",
            name: "E2EL",
            header: "End-to-end Latency",
            stats: m.e2el.clone(),
        },
    ];
    if info.max_concurrency.is_some() {
        let ok = || outputs.iter().filter(|o| o.success);
        let queue: Vec<f64> = ok().map(|o| o.client_queue_time).collect();
        all.push(Section {
            key: "client_queue_time",
            name: "Client Queue Time",
            header: "Client-side Queueing",
            stats: stats_ms(&queue, &info.percentiles),
        });
        if info.request_rate.is_finite() {
            let incl: Vec<f64> = ok().map(|o| o.latency + o.client_queue_time).collect();
            all.push(Section {
                key: "e2el_including_client_queue",
                name: "E2EL incl. Client Queue",
                header: "Queue-inclusive End-to-end Latency",
                stats: stats_ms(&incl, &info.percentiles),
            });
        }
    }
    all.retain(|s| info.percentile_metrics.iter().any(|k| k == s.key));
    all
}

/// One `label value` row: 40 and 10 columns, as vLLM's `{:<40} {:<10}`.
fn row(s: &mut String, label: &str, value: String) {
    let _ = writeln!(s, "{label:<40} {value:<10}");
}

fn f2(v: f64) -> String {
    format!("{v:.2}")
}

/// The summary table.
pub fn summary(m: &BenchmarkMetrics, info: &RunInfo, outputs: &[RequestOutput]) -> String {
    let mut s = format!("{:=^50}\n", " Serving Benchmark Result ");
    row(&mut s, "Successful requests:", m.completed.to_string());
    row(&mut s, "Failed requests:", m.failed.to_string());
    if let Some(c) = info.max_concurrency {
        row(&mut s, "Maximum request concurrency:", c.to_string());
    }
    if info.request_rate.is_finite() {
        row(
            &mut s,
            "Request rate configured (RPS):",
            f2(info.request_rate),
        );
    }
    row(&mut s, "Benchmark duration (s):", f2(info.duration));
    row(&mut s, "Total input tokens:", m.total_input.to_string());
    row(
        &mut s,
        "Total generated tokens:",
        m.total_output.to_string(),
    );
    row(
        &mut s,
        "Request throughput (req/s):",
        f2(m.request_throughput),
    );
    if info.goodput_set {
        row(&mut s, "Request goodput (req/s):", f2(m.request_goodput));
    }
    row(
        &mut s,
        "Output token throughput (tok/s):",
        f2(m.output_throughput),
    );
    row(
        &mut s,
        "Peak output token throughput (tok/s):",
        f2(m.max_output_tokens_per_s),
    );
    row(
        &mut s,
        "Peak concurrent requests:",
        f2(m.max_concurrent_requests as f64),
    );
    row(
        &mut s,
        "Total token throughput (tok/s):",
        f2(m.total_token_throughput),
    );
    for sec in sections(m, info, outputs) {
        let _ = writeln!(s, "{:-^50}", sec.header);
        row(
            &mut s,
            &format!("Mean {} (ms):", sec.name),
            f2(sec.stats.mean),
        );
        row(
            &mut s,
            &format!("Median {} (ms):", sec.name),
            f2(sec.stats.median),
        );
        for (p, v) in &sec.stats.percentiles {
            row(
                &mut s,
                &format!("P{} {} (ms):", percentile_word(*p), sec.name),
                f2(*v),
            );
        }
    }
    let _ = writeln!(s, "{}", "=".repeat(50));
    s
}

/// The result file's object: vLLM's keys. Per-request lists (input_lens,
/// output_lens, start_times, ttfts, itls, generated_texts, errors) only when
/// `detailed`, as vLLM's --save-detailed.
pub fn result_json(
    m: &BenchmarkMetrics,
    info: &RunInfo,
    outputs: &[RequestOutput],
    output_lens: &[usize],
    detailed: bool,
) -> Value {
    let mut r = Map::new();
    r.insert("date".into(), json!(info.date));
    r.insert("endpoint_type".into(), json!(info.backend.name()));
    r.insert("backend".into(), json!(info.backend.name()));
    r.insert("label".into(), json!(info.label));
    r.insert("model_id".into(), json!(info.model_id));
    r.insert("tokenizer_id".into(), json!(info.tokenizer_id));
    r.insert("num_prompts".into(), json!(info.num_prompts));
    for (k, v) in &info.metadata {
        r.insert(k.clone(), json!(v));
    }
    r.insert(
        "request_rate".into(),
        if info.request_rate.is_finite() {
            json!(info.request_rate)
        } else {
            json!("inf")
        },
    );
    r.insert(
        "burstiness".into(),
        if info.burstiness.is_finite() {
            json!(info.burstiness)
        } else {
            json!("inf")
        },
    );
    r.insert("max_concurrency".into(), json!(info.max_concurrency));
    r.insert("duration".into(), json!(info.duration));
    r.insert("completed".into(), json!(m.completed));
    r.insert("failed".into(), json!(m.failed));
    r.insert("total_input_tokens".into(), json!(m.total_input));
    r.insert("total_output_tokens".into(), json!(m.total_output));
    r.insert("request_throughput".into(), json!(m.request_throughput));
    r.insert(
        "request_goodput".into(),
        if info.goodput_set {
            json!(m.request_goodput)
        } else {
            Value::Null
        },
    );
    r.insert("output_throughput".into(), json!(m.output_throughput));
    r.insert(
        "total_token_throughput".into(),
        json!(m.total_token_throughput),
    );
    if detailed {
        r.insert(
            "input_lens".into(),
            json!(outputs.iter().map(|o| o.prompt_len).collect::<Vec<_>>()),
        );
        r.insert("output_lens".into(), json!(output_lens));
        r.insert(
            "ttfts".into(),
            json!(outputs.iter().map(|o| o.ttft).collect::<Vec<_>>()),
        );
        r.insert(
            "itls".into(),
            json!(outputs.iter().map(|o| &o.itl).collect::<Vec<_>>()),
        );
        r.insert(
            "start_times".into(),
            json!(outputs.iter().map(|o| o.start_time).collect::<Vec<_>>()),
        );
        r.insert(
            "generated_texts".into(),
            json!(
                outputs
                    .iter()
                    .map(|o| &o.generated_text)
                    .collect::<Vec<_>>()
            ),
        );
        r.insert(
            "errors".into(),
            json!(outputs.iter().map(|o| &o.error).collect::<Vec<_>>()),
        );
    }
    r.insert(
        "latencies".into(),
        json!(outputs.iter().map(|o| o.latency).collect::<Vec<_>>()),
    );
    r.insert(
        "queue_times".into(),
        json!(
            outputs
                .iter()
                .map(|o| o.client_queue_time)
                .collect::<Vec<_>>()
        ),
    );
    r.insert(
        "max_output_tokens_per_s".into(),
        json!(m.max_output_tokens_per_s),
    );
    r.insert(
        "max_concurrent_requests".into(),
        json!(m.max_concurrent_requests),
    );
    r.insert("rtfx".into(), json!(0.0));
    for sec in sections(m, info, outputs) {
        r.insert(format!("mean_{}_ms", sec.key), json!(sec.stats.mean));
        r.insert(format!("median_{}_ms", sec.key), json!(sec.stats.median));
        r.insert(format!("std_{}_ms", sec.key), json!(sec.stats.std));
        for (p, v) in &sec.stats.percentiles {
            r.insert(format!("p{}_{}_ms", percentile_word(*p), sec.key), json!(v));
        }
    }
    Value::Object(r)
}

/// vLLM's default result file name:
/// `{label}-{rate}qps[-concurrency{N}]-{model basename}-{date}.json`.
pub fn default_filename(info: &RunInfo) -> String {
    let label = info
        .label
        .clone()
        .unwrap_or_else(|| info.backend.name().to_string());
    let model = info
        .model_id
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or("model");
    let conc = info
        .max_concurrency
        .map(|c| format!("-concurrency{c}"))
        .unwrap_or_default();
    format!(
        "{label}-{}qps{conc}-{model}-{}.json",
        py_float(info.request_rate),
        info.date
    )
}

/// `YYYYMMDD-HHMMSS` in UTC for seconds since the Unix epoch.
pub fn date_string(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_serve::metrics::{Goodput, calculate_metrics};

    fn info() -> RunInfo {
        RunInfo {
            backend: Backend::Openai,
            label: None,
            model_id: "/models/Qwen3-30B-A3B".into(),
            tokenizer_id: "/models/Qwen3-30B-A3B".into(),
            num_prompts: 2,
            request_rate: f64::INFINITY,
            burstiness: 1.0,
            max_concurrency: Some(4),
            metadata: vec![("tp".into(), "1".into())],
            duration: 2.0,
            percentile_metrics: vec!["ttft".into(), "tpot".into(), "itl".into()],
            percentiles: vec![99.0],
            goodput_set: false,
            date: "20250101-000000".into(),
        }
    }

    fn outputs() -> Vec<RequestOutput> {
        vec![
            RequestOutput {
                success: true,
                ttft: 0.2,
                itl: vec![0.1],
                latency: 0.3,
                output_tokens: Some(2),
                prompt_len: 5,
                ..Default::default()
            },
            RequestOutput {
                error: "HTTP 500".into(),
                ..Default::default()
            },
        ]
    }

    #[test]
    fn table_layout_matches_vllm() {
        let o = outputs();
        let m = calculate_metrics(&o, &[2, 0], 2.0, &[99.0], &Goodput::default());
        let t = summary(&m, &info(), &o);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "============ Serving Benchmark Result ============"
        );
        assert_eq!(
            lines[1],
            format!("{:<40} {:<10}", "Successful requests:", 1)
        );
        assert_eq!(lines[1].len(), 51);
        assert!(lines[3].starts_with("Maximum request concurrency:"));
        assert!(t.contains("Benchmark duration (s):                  2.00      \n"));
        assert!(t.contains("Peak concurrent requests:                1.00"));
        assert!(t.contains("---------------Time to First Token----------------\n"));
        assert!(t.contains("Mean TTFT (ms):                          200.00"));
        assert!(t.contains("-----Time per Output Token (excl. 1st token)------\n"));
        assert!(t.contains("P99 ITL (ms):                            100.00"));
        assert!(!t.contains("E2EL"));
        assert!(!t.contains("Request rate configured"));
        assert_eq!(*lines.last().unwrap_or(&""), "=".repeat(50));
    }

    #[test]
    fn result_file_keys() {
        let o = outputs();
        let m = calculate_metrics(&o, &[2, 0], 2.0, &[99.0], &Goodput::default());
        let r = result_json(&m, &info(), &o, &[2, 0], true);
        for k in [
            "date",
            "backend",
            "model_id",
            "num_prompts",
            "request_rate",
            "burstiness",
            "max_concurrency",
            "duration",
            "completed",
            "failed",
            "total_input_tokens",
            "total_output_tokens",
            "request_throughput",
            "output_throughput",
            "total_token_throughput",
            "mean_ttft_ms",
            "median_ttft_ms",
            "std_ttft_ms",
            "p99_ttft_ms",
            "mean_tpot_ms",
            "p99_itl_ms",
            "itls",
            "ttfts",
            "input_lens",
            "output_lens",
            "errors",
            "latencies",
            "tp",
        ] {
            assert!(r.get(k).is_some(), "missing {k}");
        }
        assert_eq!(r["request_rate"], "inf");
        assert_eq!(r["completed"], 1);
        assert_eq!(r["errors"][1], "HTTP 500");
        assert!(r.get("mean_e2el_ms").is_none());
        let brief = result_json(&m, &info(), &o, &[2, 0], false);
        assert!(brief.get("itls").is_none() && brief.get("latencies").is_some());
    }

    #[test]
    fn names_and_dates() {
        assert_eq!(py_float(f64::INFINITY), "inf");
        assert_eq!(py_float(4.0), "4.0");
        assert_eq!(py_float(0.25), "0.25");
        assert_eq!(
            default_filename(&info()),
            "openai-infqps-concurrency4-Qwen3-30B-A3B-20250101-000000.json"
        );
        assert_eq!(date_string(0), "19700101-000000");
        // 2024-02-29 12:34:56 UTC.
        assert_eq!(date_string(1_709_210_096), "20240229-123456");
    }
}
