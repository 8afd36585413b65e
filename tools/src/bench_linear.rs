//! `epserve bench linear`: the dense projections (attention q/k/v/o, LM head)
//! through `model::linear::Linear`, the packed bf16 panels on the best kernel
//! tier, against its scalar twin (`kernels::linear`, the plain path) and
//! against the machine's streaming read bandwidth, measured in the same run
//! on the same threads (rayon's pool, what the model uses). Each row cycles
//! through copies of its weight larger than the last-level cache, as a
//! model's layers do. Every row also runs the same weights stored as B12
//! (`kernels::b12`, lossless 12 bits a weight: the model's default on tiers
//! that decode it natively), alternated with the bf16 panels: decode rows
//! on the B12 tile, prefill rows on panels decoded into a scratch. Ratios only: the
//! machines are shared and noisy, so each row is the median of its passes.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use epserve_core::kernels::dispatch::kernels;
use epserve_core::kernels::linear;
use epserve_core::model::linear::Linear;
use epserve_core::tensor::Weight;
use rayon::prelude::*;
use serde::Serialize;

use crate::bench_moe::normal_bf16;

/// `epserve bench linear`.
#[derive(Debug, Clone, Args)]
pub struct BenchLinearArgs {
    /// Weight shapes `OUTxIN`, comma-separated. Default: Qwen3-30B-A3B's q
    /// (4096x2048), k/v (512x2048) and o (2048x4096) projections and an 8k-row
    /// LM head slice (8192x2048).
    #[arg(long, default_value = "4096x2048,512x2048,2048x4096,8192x2048")]
    pub shapes: String,
    /// Token counts (rows of activations), comma-separated.
    #[arg(long, default_value = "1,16,64,256")]
    pub tokens: String,
    /// Bytes of weights each row cycles through, MiB (copies of the shape),
    /// so that decode rows stream from memory rather than from the cache.
    #[arg(long, default_value_t = 256)]
    pub working_set_mib: usize,
    /// Least time per row and path, milliseconds (at least 3 passes).
    #[arg(long, default_value_t = 200)]
    pub min_ms: u64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One measured row.
#[derive(Debug, Clone, Serialize)]
pub struct LinearRow {
    pub out: usize,
    pub inp: usize,
    pub tokens: usize,
    pub plain_ms: f64,
    pub packed_ms: f64,
    /// Plain (scalar twin) time over packed time.
    pub speedup: f64,
    /// Weight bytes streamed per second by the packed path, GB/s.
    pub packed_gbps: f64,
    /// `packed_gbps` as a percentage of the measured read bandwidth.
    pub pct_bandwidth: f64,
    /// Packed multiply-adds per second ×2, GFLOP/s.
    pub packed_gflops: f64,
    /// The same weights as B12 panels (on tiers that decode them natively),
    /// ms per call.
    pub b12_ms: Option<f64>,
    /// Packed (bf16) time over B12 time.
    pub b12_speedup: Option<f64>,
}

/// A comma-separated list of positive integers (the benches' count flags).
pub(crate) fn list(s: &str, what: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|t| {
            t.trim()
                .parse::<usize>()
                .ok()
                .filter(|&v| v > 0)
                .with_context(|| format!("{what}: '{t}' is not a positive integer"))
        })
        .collect()
}

fn shapes(s: &str) -> Result<Vec<(usize, usize)>> {
    s.split(',')
        .map(|t| {
            let (a, b) = t
                .trim()
                .split_once('x')
                .with_context(|| format!("--shapes: '{t}' is not OUTxIN"))?;
            let dim = |v: &str| {
                v.parse::<usize>()
                    .ok()
                    .filter(|&d| d > 0)
                    .with_context(|| format!("--shapes: '{t}' is not OUTxIN"))
            };
            Ok((dim(a)?, dim(b)?))
        })
        .collect()
}

/// The `words` the bandwidth probes read (each its index, so none is a
/// shared zero page), allocated as the weights and the KV cache are: on huge
/// pages where the host allows them ([`epserve_core::mem`]).
pub(crate) fn probe_buffer(words: usize) -> epserve_core::mem::ZeroBuf<u64> {
    let mut buf = epserve_core::mem::ZeroBuf::<u64>::zeroed(words);
    for (i, x) in buf.iter_mut().enumerate() {
        *x = i as u64;
    }
    buf
}

/// Streaming read bandwidth of rayon's threads over 256 MiB
/// ([`probe_buffer`]), best of three, GB/s.
pub(crate) fn measure_bandwidth() -> f64 {
    let buf = probe_buffer((256usize << 20) / 8);
    let threads = rayon::current_num_threads().max(1);
    let per = buf.len().div_ceil(threads);
    let mut best = 0.0f64;
    for _ in 0..3 {
        let start = Instant::now();
        let sum: u64 = buf
            .par_chunks(per)
            .map(|c| {
                // Eight independent sums, so the adds are not one dependency chain.
                let mut acc = [0u64; 8];
                for l in c.chunks_exact(8) {
                    for (a, v) in acc.iter_mut().zip(l) {
                        *a = a.wrapping_add(*v);
                    }
                }
                acc.iter().fold(0u64, |a, b| a.wrapping_add(*b))
            })
            .reduce(|| 0, u64::wrapping_add);
        let secs = start.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        best = best.max((buf.len() * 8) as f64 / secs / 1e9);
    }
    best
}

/// Median seconds per call of `f` over at least 3 passes and `min`.
pub(crate) fn time(min: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut passes = Vec::new();
    while passes.len() < 3 || start.elapsed() < min {
        let t0 = Instant::now();
        f();
        passes.push(t0.elapsed().as_secs_f64());
    }
    passes.sort_by(f64::total_cmp);
    passes[passes.len() / 2]
}

/// Measures every shape at every token count.
pub fn measure(args: &BenchLinearArgs) -> Result<(f64, Vec<LinearRow>)> {
    let shapes = shapes(&args.shapes)?;
    let tokens = list(&args.tokens, "--tokens")?;
    let min = Duration::from_millis(args.min_ms);
    let bw = measure_bandwidth();
    let mut rows = Vec::new();
    for (i, &(out, inp)) in shapes.iter().enumerate() {
        // Enough copies that one round over them streams from memory, as a
        // model's layers do, not from the last-level cache.
        let copies = (args.working_set_mib << 20).div_ceil(out * inp * 2).max(1);
        let ws: Vec<Weight> = (0..copies)
            .map(|c| normal_bf16(out, inp, 17 + (i * 1000 + c) as u64))
            .collect();
        let kern = kernels();
        let lins: Vec<Linear> = ws
            .iter()
            .cloned()
            .map(|w| {
                let mut l = Linear::new(w);
                l.set_b12(false);
                l
            })
            .collect();
        if !lins.iter().all(|l| l.is_packed() && !l.is_b12()) {
            bail!("{out}x{inp}: a random bf16 weight was not packed");
        }
        // The same weights as B12 where the tier decodes it natively.
        let b12s: Vec<Linear> = if kern.b12_native() {
            ws.iter()
                .cloned()
                .map(|w| {
                    let mut l = Linear::new(w);
                    l.set_b12(true);
                    l
                })
                .collect()
        } else {
            Vec::new()
        };
        for &t in &tokens {
            let x: Vec<f32> = (0..t * inp)
                .map(|j| ((j % 97) as f32 - 48.0) / 97.0)
                .collect();
            let mut y = vec![0.0f32; t * out];
            let per = |secs: f64| secs / copies as f64;
            let plain = per(time(min, || {
                for w in &ws {
                    linear(&x, t, w, None, &mut y);
                }
            }));
            let mut y2 = y.clone();
            let mut run_packed = || {
                per(time(min, || {
                    for l in &lins {
                        l.forward(&x, t, None, &mut y);
                    }
                }))
            };
            let mut packed = run_packed();
            let mut b12_ms = None;
            if !b12s.is_empty() {
                // Alternated with the bf16 path, best of two each.
                let mut run_b12 = || {
                    per(time(min, || {
                        for b in &b12s {
                            b.forward(&x, t, None, &mut y2);
                        }
                    }))
                };
                let first = run_b12();
                packed = packed.min(run_packed());
                b12_ms = Some(first.min(run_b12()));
            }
            let gbps = (out * inp * 2) as f64 / packed / 1e9;
            rows.push(LinearRow {
                out,
                inp,
                tokens: t,
                plain_ms: plain * 1e3,
                packed_ms: packed * 1e3,
                speedup: plain / packed,
                packed_gbps: gbps,
                pct_bandwidth: 100.0 * gbps / bw,
                packed_gflops: 2.0 * (t * out * inp) as f64 / packed / 1e9,
                b12_ms: b12_ms.map(|b| b * 1e3),
                b12_speedup: b12_ms.map(|b| packed / b),
            });
        }
    }
    Ok((bw, rows))
}

/// Runs the command.
pub fn run(args: &BenchLinearArgs) -> Result<()> {
    let (bw, rows) = measure(args)?;
    let tier = kernels().tier().name();
    let threads = rayon::current_num_threads();
    if args.json {
        let v = serde_json::json!({
            "tier": tier, "threads": threads, "bandwidth_gbps": bw, "rows": rows,
        });
        println!("{v}");
        return Ok(());
    }
    println!(
        "dense linear, bf16 weights, f32 activations: tier {tier}, {threads} threads, \
         measured read bandwidth {bw:.1} GB/s"
    );
    println!(
        "{:>11} {:>6} {:>10} {:>10} {:>8} {:>8} {:>6} {:>8} {:>8} {:>8}",
        "shape",
        "tokens",
        "twin ms",
        "packed ms",
        "speedup",
        "GB/s",
        "% bw",
        "GFLOP/s",
        "b12 ms",
        "vs bf16"
    );
    for r in &rows {
        let (b12_ms, b12_x) = match (r.b12_ms, r.b12_speedup) {
            (Some(m), Some(x)) => (format!("{m:.3}"), format!("{x:.2}x")),
            _ => ("-".into(), "-".into()),
        };
        println!(
            "{:>11} {:>6} {:>10.3} {:>10.3} {:>7.2}x {:>8.1} {:>6.0} {:>8.1} {:>8} {:>8}",
            format!("{}x{}", r.out, r.inp),
            r.tokens,
            r.plain_ms,
            r.packed_ms,
            r.speedup,
            r.packed_gbps,
            r.pct_bandwidth,
            r.packed_gflops,
            b12_ms,
            b12_x
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_bench_runs_and_bad_flags_are_named() -> Result<()> {
        let args = BenchLinearArgs {
            shapes: "40x33".into(),
            tokens: "1,3".into(),
            working_set_mib: 0,
            min_ms: 1,
            json: false,
        };
        let (bw, rows) = measure(&args)?;
        assert!(bw > 0.0);
        assert_eq!(rows.len(), 2);
        assert!(rows.iter().all(|r| r.packed_ms > 0.0 && r.speedup > 0.0));
        // Both token counts are decode rows: B12 runs where the tier has it.
        let b12 = kernels().b12_native();
        assert!(
            rows.iter()
                .all(|r| r.b12_ms.is_some() == b12 && r.b12_speedup.is_some() == b12)
        );
        let bad = BenchLinearArgs {
            shapes: "40by33".into(),
            ..args
        };
        let e = measure(&bad)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("--shapes"), "{e}");
        Ok(())
    }
}
