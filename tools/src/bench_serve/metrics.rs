//! The benchmark's numbers, as pure functions over per-request outcomes, with
//! vLLM's definitions: TTFT is the time to the first chunk with choices; ITL
//! the gaps between successive chunks with choices; TPOT per request is
//! (E2EL − TTFT) / (output tokens − 1) for requests with more than one output
//! token; throughputs are over the benchmark's wall time. Statistics are
//! numpy's: population std, linear-interpolated percentiles, 0 for no data.

use serde::Serialize;

/// What one request measured (times in seconds).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RequestOutput {
    /// The streamed text, concatenated.
    pub generated_text: String,
    /// Got a 200 and at least one chunk with choices.
    pub success: bool,
    /// From sending to the last chunk with choices (E2EL).
    pub latency: f64,
    /// `usage.completion_tokens` from the server, when it sent one.
    pub output_tokens: Option<usize>,
    /// Time to the first chunk with choices.
    pub ttft: f64,
    /// Gaps between successive chunks with choices.
    pub itl: Vec<f64>,
    /// Prompt tokens: the dataset's count, replaced by `usage.prompt_tokens`.
    pub prompt_len: usize,
    /// Why the request failed ("" when it did not).
    pub error: String,
    /// When it was sent, in seconds since the run began.
    pub start_time: f64,
    /// Time spent waiting for a --max-concurrency slot.
    pub client_queue_time: f64,
    /// Chunks with choices received.
    pub chunks: usize,
}

/// Mean, median, std and chosen percentiles of one metric, in milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    /// (percentile, value).
    pub percentiles: Vec<(f64, f64)>,
}

/// Everything the summary table and the result file report.
#[derive(Debug, Clone)]
pub struct BenchmarkMetrics {
    pub completed: usize,
    pub failed: usize,
    pub total_input: usize,
    pub total_output: usize,
    pub request_throughput: f64,
    pub request_goodput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft: Stats,
    pub tpot: Stats,
    pub itl: Stats,
    pub e2el: Stats,
    /// Most output tokens in one wall-clock second of the run.
    pub max_output_tokens_per_s: f64,
    /// Most requests in flight at once.
    pub max_concurrent_requests: usize,
}

/// Service level objectives for goodput, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Goodput {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2el_ms: Option<f64>,
}

impl Goodput {
    /// Parses `KEY:VALUE` pairs (keys ttft, tpot, e2el; values in ms, ≥ 0).
    pub fn parse(pairs: &[String]) -> Result<Self, String> {
        let mut g = Goodput::default();
        for pair in pairs {
            let (k, v) = pair.split_once(':').ok_or_else(|| {
                format!("invalid goodput objective {pair:?}: expected KEY:VALUE in milliseconds")
            })?;
            let v: f64 = v
                .trim()
                .parse()
                .map_err(|_| format!("invalid goodput value in {pair:?}: not a number"))?;
            if v.is_nan() || v < 0.0 {
                return Err(format!(
                    "invalid goodput value in {pair:?}: must be non-negative"
                ));
            }
            match k.trim() {
                "ttft" => g.ttft_ms = Some(v),
                "tpot" => g.tpot_ms = Some(v),
                "e2el" => g.e2el_ms = Some(v),
                other => {
                    return Err(format!(
                        "invalid goodput metric {other:?}: expected one of ttft, tpot, e2el"
                    ));
                }
            }
        }
        Ok(g)
    }

    /// Whether any objective is set.
    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.tpot_ms.is_some() || self.e2el_ms.is_some()
    }
}

/// Arithmetic mean; 0 for no values (numpy's `mean(values or 0)`).
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.iter().sum::<f64>() / values.len() as f64
}

/// Population standard deviation (ddof 0); 0 for no values.
pub fn std_dev(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let m = mean(values);
    (values.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / values.len() as f64).sqrt()
}

/// The p-th percentile (0..=100) with linear interpolation between closest
/// ranks, as numpy's default; 0 for no values.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    sorted[lo] + (sorted[hi] - sorted[lo]) * frac
}

/// Median (the 50th percentile).
pub fn median(values: &[f64]) -> f64 {
    percentile(values, 50.0)
}

/// Statistics of values given in seconds, reported in milliseconds.
pub fn stats_ms(values_s: &[f64], percentiles: &[f64]) -> Stats {
    Stats {
        mean: mean(values_s) * 1000.0,
        median: median(values_s) * 1000.0,
        std: std_dev(values_s) * 1000.0,
        percentiles: percentiles
            .iter()
            .map(|&p| (p, percentile(values_s, p) * 1000.0))
            .collect(),
    }
}

/// TPOT of one request: time per output token after the first, or None when
/// it produced at most one token.
pub fn tpot(latency: f64, ttft: f64, output_len: usize) -> Option<f64> {
    (output_len > 1).then(|| (latency - ttft) / (output_len - 1) as f64)
}

/// Output tokens of each request: the server's usage count when it sent a
/// non-zero one, else `count` of the generated text (vLLM re-tokenizes it),
/// else the number of chunks; 0 for failed requests.
pub fn actual_output_lens(
    outputs: &[RequestOutput],
    count: impl Fn(&str) -> Option<usize>,
) -> Vec<usize> {
    outputs
        .iter()
        .map(|o| {
            if !o.success {
                return 0;
            }
            match o.output_tokens {
                Some(n) if n > 0 => n,
                _ => count(&o.generated_text).unwrap_or(o.chunks),
            }
        })
        .collect()
}

/// The most output tokens in one second-wide bucket of the run, with token
/// times rebuilt from start time, TTFT and ITLs.
pub fn peak_output_tokens_per_s(outputs: &[RequestOutput]) -> f64 {
    let ok: Vec<&RequestOutput> = outputs.iter().filter(|o| o.success).collect();
    if ok.is_empty() {
        return 0.0;
    }
    let min_start = ok
        .iter()
        .map(|o| o.start_time)
        .fold(f64::INFINITY, f64::min);
    let max_end = ok
        .iter()
        .map(|o| o.start_time + o.latency)
        .fold(f64::NEG_INFINITY, f64::max);
    let buckets = (max_end - min_start).ceil().max(0.0) as usize + 1;
    let mut per_second = vec![0u64; buckets];
    for o in ok {
        let mut t = o.start_time + o.ttft;
        let mut add = |t: f64| {
            let b = (t - min_start).floor();
            if b >= 0.0 && (b as usize) < buckets {
                per_second[b as usize] += 1;
            }
        };
        add(t);
        for gap in &o.itl {
            t += gap;
            add(t);
        }
    }
    per_second.into_iter().max().unwrap_or(0) as f64
}

/// The most successful requests in flight at once, over half-open intervals
/// [start, start + latency) (a request ending as another starts does not
/// overlap it).
pub fn peak_concurrency(outputs: &[RequestOutput]) -> usize {
    let mut events: Vec<(f64, i32)> = Vec::new();
    for o in outputs.iter().filter(|o| o.success) {
        events.push((o.start_time, 1));
        events.push((o.start_time + o.latency, -1));
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut peak) = (0i64, 0i64);
    for (_, d) in events {
        now += i64::from(d);
        peak = peak.max(now);
    }
    peak as usize
}

/// All metrics of a run that took `duration_s` seconds. `output_lens` comes
/// from [`actual_output_lens`].
pub fn calculate_metrics(
    outputs: &[RequestOutput],
    output_lens: &[usize],
    duration_s: f64,
    percentiles: &[f64],
    goodput: &Goodput,
) -> BenchmarkMetrics {
    let mut total_input = 0;
    let mut completed = 0;
    let mut good = 0;
    let (mut ttfts, mut tpots, mut itls, mut e2els) = (vec![], vec![], vec![], vec![]);
    for (o, &out_len) in outputs.iter().zip(output_lens) {
        if !o.success {
            continue;
        }
        completed += 1;
        total_input += o.prompt_len;
        let t = tpot(o.latency, o.ttft, out_len);
        if let Some(t) = t {
            tpots.push(t);
        }
        itls.extend_from_slice(&o.itl);
        ttfts.push(o.ttft);
        e2els.push(o.latency);
        if goodput.is_set() {
            // A request with at most one output token has TPOT 0 here.
            let within = |slo_ms: Option<f64>, v: f64| slo_ms.is_none_or(|s| s / 1000.0 >= v);
            if within(goodput.ttft_ms, o.ttft)
                && within(goodput.tpot_ms, t.unwrap_or(0.0))
                && within(goodput.e2el_ms, o.latency)
            {
                good += 1;
            }
        }
    }
    let total_output: usize = output_lens.iter().sum();
    let per_s = |x: f64| {
        if duration_s > 0.0 {
            x / duration_s
        } else {
            0.0
        }
    };
    BenchmarkMetrics {
        completed,
        failed: outputs.iter().filter(|o| !o.success).count(),
        total_input,
        total_output,
        request_throughput: per_s(completed as f64),
        request_goodput: per_s(good as f64),
        output_throughput: per_s(total_output as f64),
        total_token_throughput: per_s((total_input + total_output) as f64),
        ttft: stats_ms(&ttfts, percentiles),
        tpot: stats_ms(&tpots, percentiles),
        itl: stats_ms(&itls, percentiles),
        e2el: stats_ms(&e2els, percentiles),
        max_output_tokens_per_s: peak_output_tokens_per_s(outputs),
        max_concurrent_requests: peak_concurrency(outputs),
    }
}

/// Parses "99" or "25,50,99.9" into percentiles within 0..=100.
pub fn parse_percentiles(s: &str) -> Result<Vec<f64>, String> {
    s.split(',')
        .map(|p| {
            let v: f64 = p
                .trim()
                .parse()
                .map_err(|_| format!("invalid percentile {p:?} in {s:?}"))?;
            if !(0.0..=100.0).contains(&v) {
                return Err(format!("percentile {v} is outside 0..100"));
            }
            Ok(v)
        })
        .collect()
}

/// How vLLM names a percentile in labels and keys: "99", "99.9".
pub fn percentile_word(p: f64) -> String {
    if p.fract() == 0.0 {
        format!("{}", p as i64)
    } else {
        format!("{p}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    fn ok(
        start: f64,
        ttft: f64,
        itl: &[f64],
        usage: Option<usize>,
        prompt: usize,
    ) -> RequestOutput {
        RequestOutput {
            success: true,
            start_time: start,
            ttft,
            latency: ttft + itl.iter().sum::<f64>(),
            itl: itl.to_vec(),
            output_tokens: usage,
            prompt_len: prompt,
            chunks: itl.len() + 1,
            ..Default::default()
        }
    }

    #[test]
    fn numpy_statistics() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert!(close(mean(&v), 2.5));
        assert!(close(median(&v), 2.5));
        // Population std of 1..4: sqrt(1.25).
        assert!(close(std_dev(&v), 1.25f64.sqrt()));
        // rank = 0.99 * 3 = 2.97 → 3 + 0.97 * (4 − 3).
        assert!(close(percentile(&v, 99.0), 3.97));
        assert!(close(percentile(&v, 0.0), 1.0));
        assert!(close(percentile(&v, 100.0), 4.0));
        // numpy.percentile([10, 20, 30], 25) = 15.
        assert!(close(percentile(&[30.0, 10.0, 20.0], 25.0), 15.0));
        assert!(close(median(&[5.0, 1.0, 3.0]), 3.0));
        // No data: numpy's mean(0) etc.
        assert_eq!(
            stats_ms(&[], &[99.0]),
            Stats {
                mean: 0.0,
                median: 0.0,
                std: 0.0,
                percentiles: vec![(99.0, 0.0)]
            }
        );
    }

    #[test]
    fn tpot_excludes_the_first_token() {
        // 10 tokens: first at 0.5 s, done at 1.4 s → 0.9 s / 9 = 0.1 s.
        assert!(close(tpot(1.4, 0.5, 10).unwrap_or(f64::NAN), 0.1));
        assert_eq!(tpot(1.4, 0.5, 1), None);
        assert_eq!(tpot(1.4, 0.5, 0), None);
    }

    #[test]
    fn run_metrics_by_hand() {
        // Request a: ttft 0.2, then chunks 0.1, 0.1, 0.1 apart; usage 4 tokens.
        // Request b: ttft 0.4, then 0.2, 0.2; usage absent, text counts 3.
        // Request c: failed.
        let mut b = ok(0.1, 0.4, &[0.2, 0.2], None, 7);
        b.generated_text = "x y z".into();
        let outputs = vec![
            ok(0.0, 0.2, &[0.1, 0.1, 0.1], Some(4), 5),
            b,
            RequestOutput {
                error: "HTTP 500".into(),
                prompt_len: 9,
                ..Default::default()
            },
        ];
        let lens = actual_output_lens(&outputs, |t| Some(t.split(' ').count()));
        assert_eq!(lens, vec![4, 3, 0]);
        let m = calculate_metrics(&outputs, &lens, 2.0, &[50.0, 99.0], &Goodput::default());
        assert_eq!(
            (m.completed, m.failed, m.total_input, m.total_output),
            (2, 1, 12, 7)
        );
        assert!(close(m.request_throughput, 1.0));
        assert!(close(m.output_throughput, 3.5));
        assert!(close(m.total_token_throughput, 9.5));
        // TTFT: 200, 400 ms.
        assert!(close(m.ttft.mean, 300.0));
        assert!(close(m.ttft.median, 300.0));
        assert!(close(m.ttft.std, 100.0));
        assert!(close(m.ttft.percentiles[1].1, 398.0));
        // TPOT: a (0.5 − 0.2) / 3 = 0.1 s; b (0.8 − 0.4) / 2 = 0.2 s.
        assert!(close(m.tpot.mean, 150.0));
        assert!(close(m.tpot.percentiles[1].1, 199.0));
        // ITL: 100, 100, 100, 200, 200 ms.
        assert!(close(m.itl.mean, 140.0));
        assert!(close(m.itl.median, 100.0));
        // E2EL: 500, 800 ms.
        assert!(close(m.e2el.mean, 650.0));
        // a runs [0, 0.5), b [0.1, 0.9): both in flight at 0.1.
        assert_eq!(m.max_concurrent_requests, 2);
        // Token times: a 0.2 0.3 0.4 0.5, b 0.5 0.7 0.9 → all in second 0.
        assert!(close(m.max_output_tokens_per_s, 7.0));
        assert!(close(m.request_goodput, 0.0));
    }

    #[test]
    fn goodput_counts_requests_within_every_objective() {
        let outputs = vec![
            ok(0.0, 0.2, &[0.1, 0.1], Some(3), 1),
            ok(0.0, 0.6, &[0.1], Some(2), 1),
        ];
        let lens = actual_output_lens(&outputs, |_| None);
        let g = Goodput::parse(&["ttft:300".into(), "tpot:150".into()]).unwrap_or_default();
        assert_eq!(
            g,
            Goodput {
                ttft_ms: Some(300.0),
                tpot_ms: Some(150.0),
                e2el_ms: None
            }
        );
        let m = calculate_metrics(&outputs, &lens, 1.0, &[99.0], &g);
        assert!(close(m.request_goodput, 1.0));
        assert!(Goodput::parse(&["itl:5".into()]).is_err());
        assert!(Goodput::parse(&["ttft=5".into()]).is_err());
        assert!(Goodput::parse(&["ttft:-1".into()]).is_err());
    }

    #[test]
    fn output_len_falls_back_to_chunks() {
        let mut o = ok(0.0, 0.1, &[0.1, 0.1], Some(0), 1);
        o.generated_text = "abc".into();
        assert_eq!(actual_output_lens(&[o.clone()], |_| None), vec![3]);
        assert_eq!(actual_output_lens(&[o], |_| Some(5)), vec![5]);
    }

    #[test]
    fn peaks() {
        // Back-to-back requests do not overlap.
        let a = ok(0.0, 0.5, &[0.5], Some(2), 1);
        let b = ok(1.0, 0.5, &[0.5], Some(2), 1);
        assert_eq!(peak_concurrency(&[a.clone(), b.clone()]), 1);
        // Tokens at 0.5, 1.0 (a) and 1.5, 2.0 (b): second 1 holds 1.0 and 1.5.
        assert!(close(peak_output_tokens_per_s(&[a, b]), 2.0));
        assert_eq!(peak_concurrency(&[]), 0);
        assert!(close(peak_output_tokens_per_s(&[]), 0.0));
    }

    #[test]
    fn percentile_flags() {
        assert_eq!(parse_percentiles("25, 50,99.9"), Ok(vec![25.0, 50.0, 99.9]));
        assert!(parse_percentiles("101").is_err());
        assert!(parse_percentiles("p99").is_err());
        assert_eq!(percentile_word(99.0), "99");
        assert_eq!(percentile_word(99.9), "99.9");
    }
}
