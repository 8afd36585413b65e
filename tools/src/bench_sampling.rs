//! `epserve bench sampling`: the sampler (`epserve_core::sampling`) per
//! sequence at real vocabulary sizes, against one streaming pass over the
//! logits (the least any sampler does: look at every logit once), and a
//! batch of sequences one after the other against the same batch in
//! parallel on the compute threads, as the scheduler chooses them between
//! steps. Logits are synthetic: "peaked" (normal, sd 2, with a few tokens
//! far above, as a trained model's) and "flat" (uniform in ±0.5, as the
//! random-weight bench model's). Each row is the median of its passes.

use std::time::Duration;

use anyhow::Result;
use clap::Args;
use epserve_core::sampling::{Sampler, SamplingParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use serde::Serialize;

use crate::bench_linear::{list, time};

/// `epserve bench sampling`.
#[derive(Debug, Clone, Args)]
pub struct BenchSamplingArgs {
    /// Vocabulary sizes, comma-separated (151936: Qwen2/3's; 8192: the bench model's).
    #[arg(long, default_value = "8192,151936")]
    pub vocab: String,
    /// Sequences sampled per step, for the serial / parallel rows.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Least time per row, milliseconds (at least 3 passes).
    #[arg(long, default_value_t = 300)]
    pub min_ms: u64,
    /// Print one JSON object instead of the tables.
    #[arg(long)]
    pub json: bool,
}

/// One measured row.
#[derive(Debug, Clone, Serialize)]
pub struct SamplingRow {
    pub vocab: usize,
    /// `peaked` or `flat`.
    pub logits: &'static str,
    pub config: &'static str,
    /// One sequence, milliseconds.
    pub ms: f64,
    /// One streaming pass over the logits (a sum), milliseconds.
    pub pass_ms: f64,
    /// `ms / pass_ms`.
    pub passes: f64,
    /// `--batch` sequences one after the other, milliseconds.
    pub serial_ms: f64,
    /// The same in parallel (rayon's pool), milliseconds.
    pub parallel_ms: f64,
}

fn configs() -> Vec<(&'static str, SamplingParams)> {
    let p = |temperature, top_k, top_p, min_p| SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: Some(1),
        ..Default::default()
    };
    vec![
        ("greedy", p(0.0, 0, 1.0, 0.0)),
        ("temperature 1", p(1.0, 0, 1.0, 0.0)),
        ("top-k 20, top-p 0.95, T 0.6", p(0.6, 20, 0.95, 0.0)),
        ("top-p 0.95", p(1.0, 0, 0.95, 0.0)),
        ("min-p 0.05", p(1.0, 0, 1.0, 0.05)),
    ]
}

/// One token chosen as the scheduler's `Seq::choose` does: the row copied
/// to `work` only when a logit processor changes it, else picked in place.
fn choose(s: &mut Sampler, work: &mut [f32], row: &[f32]) -> u32 {
    if s.adjusts() {
        work.copy_from_slice(row);
        s.sample(work, &[], &[])
    } else {
        s.pick(row)
    }
}

fn logits(vocab: usize, peaked: bool, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    if !peaked {
        return (0..vocab).map(|_| rng.random_range(-0.5..0.5)).collect();
    }
    // Normal, sd 2; then a handful of tokens 7-14 above.
    let normal = rand_distr::Normal::new(0.0f32, 2.0).expect("a valid sd");
    let mut l: Vec<f32> = (0..vocab).map(|_| rng.sample(normal)).collect();
    for i in 0..8 {
        let t = rng.random_range(0..vocab);
        l[t] = 14.0 - i as f32;
    }
    l
}

/// Measures every vocabulary, distribution and configuration.
pub fn measure(args: &BenchSamplingArgs) -> Result<Vec<SamplingRow>> {
    let min = Duration::from_millis(args.min_ms);
    let batch = args.batch.max(1);
    let mut rows = Vec::new();
    for vocab in list(&args.vocab, "--vocab")? {
        for (peaked, name) in [(true, "peaked"), (false, "flat")] {
            let base: Vec<Vec<f32>> = (0..batch)
                .map(|i| logits(vocab, peaked, i as u64))
                .collect();
            let pass_ms = time(min, || {
                // Sixteen lanes, so that the adds are not one dependency chain.
                let mut acc = [0.0f32; 16];
                for c in base[0].chunks_exact(16) {
                    for (a, x) in acc.iter_mut().zip(c) {
                        *a += x;
                    }
                }
                std::hint::black_box(acc);
            }) * 1e3;
            for (config, params) in configs() {
                let mut samplers: Vec<Sampler> =
                    (0..batch).map(|_| Sampler::new(params.clone())).collect();
                let mut work = base.clone();
                let ms = time(min, || {
                    std::hint::black_box(choose(&mut samplers[0], &mut work[0], &base[0]));
                }) * 1e3;
                let serial_ms = time(min, || {
                    for ((s, w), b) in samplers.iter_mut().zip(&mut work).zip(&base) {
                        std::hint::black_box(choose(s, w, b));
                    }
                }) * 1e3;
                let parallel_ms = time(min, || {
                    (samplers.par_iter_mut().zip(work.par_iter_mut()).zip(&base)).for_each(
                        |((s, w), b)| {
                            std::hint::black_box(choose(s, w, b));
                        },
                    );
                }) * 1e3;
                rows.push(SamplingRow {
                    vocab,
                    logits: name,
                    config,
                    ms,
                    pass_ms,
                    passes: ms / pass_ms,
                    serial_ms,
                    parallel_ms,
                });
            }
        }
    }
    Ok(rows)
}

/// Runs the benchmark and prints its tables (or JSON).
pub fn run(args: &BenchSamplingArgs) -> Result<()> {
    let rows = measure(args)?;
    if args.json {
        let tier = epserve_core::kernels::dispatch::kernels().tier().name();
        let out = serde_json::json!({
            "tier": tier,
            "threads": rayon::current_num_threads(),
            "batch": args.batch,
            "rows": rows,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "sampling per sequence (tier {}, {} threads); one pass = a streaming (vectorized) sum over the logits; \
         batch of {} sequences serial and in parallel (the scheduler's choose step)",
        epserve_core::kernels::dispatch::kernels().tier().name(),
        rayon::current_num_threads(),
        args.batch
    );
    let mut last = None;
    for r in &rows {
        if last != Some((r.vocab, r.logits)) {
            last = Some((r.vocab, r.logits));
            println!(
                "\nvocab {}, {} logits: one pass {:.4} ms",
                r.vocab, r.logits, r.pass_ms
            );
            println!(
                "  {:<28} {:>9} {:>8} {:>11} {:>11} {:>7}",
                "config", "ms/seq", "passes", "serial ms", "parallel", "x"
            );
        }
        println!(
            "  {:<28} {:>9.4} {:>8.1} {:>11.3} {:>11.3} {:>7.2}",
            r.config,
            r.ms,
            r.passes,
            r.serial_ms,
            r.parallel_ms,
            r.serial_ms / r.parallel_ms
        );
    }
    Ok(())
}
