//! `epserve bench attention`: the flash attention kernel
//! (`kernels::attention`) on the best tier against its scalar twin (the
//! same kernel on the `generic` tier) and against the machine's streaming
//! read bandwidth (the probe of `bench linear`), for a decode step (one
//! query row against contexts of 128 / 2k / 8k positions) and a prefill
//! (512 rows, causal), with f32 and bf16 KV caches in a paged pool. Decode
//! rows cycle through copies of the cache larger than the last-level cache,
//! as a model's layers do. Default shape: Qwen3-30B-A3B (32 query heads, 4
//! KV heads, head_dim 128). Each row is the median of its passes.

use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use epserve_core::experts::pool::ExpertPool;
use epserve_core::kernels::attention::{AttnSeq, AttnShape, attention};
use epserve_core::kernels::dispatch::{Kernels, kernels};
use epserve_core::model::kv_cache::{KvDtype, KvLayerShape, KvLayout, KvPool, SeqCache};
use serde::Serialize;

use crate::bench_linear::{list, measure_bandwidth, time};
use crate::bench_moe::measure_fma_peak;

/// `epserve bench attention`.
#[derive(Debug, Clone, Args)]
pub struct BenchAttentionArgs {
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    /// KV heads (a divisor of --heads).
    #[arg(long, default_value_t = 4)]
    pub kv_heads: usize,
    /// Head dimension (keys and values).
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Decode contexts (positions cached, the new one included),
    /// comma-separated; empty for none (only the prefill row).
    #[arg(long, default_value = "128,2048,8192")]
    pub contexts: String,
    /// Prefill rows (one causal sequence; 0 skips the prefill row).
    #[arg(long, default_value_t = 512)]
    pub prefill: usize,
    /// Positions per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Bytes of KV cache each decode row cycles through, MiB (copies of the
    /// context), so that decode streams from memory rather than from the cache.
    #[arg(long, default_value_t = 256)]
    pub working_set_mib: usize,
    /// Least time per row and path, milliseconds (at least 3 passes).
    #[arg(long, default_value_t = 200)]
    pub min_ms: u64,
    /// Round the queries to bf16, as a model with bf16 activations
    /// (`--dense-dtype bf16`) does: the scores against bf16 keys then run on
    /// the native bf16 dot where the tier has one.
    #[arg(long)]
    pub bf16_queries: bool,
    /// KV cache element types measured.
    #[arg(long, value_enum, default_value_t = KvDtypes::Both)]
    pub kv_dtype: KvDtypes,
    /// Time only the fast path (keys by column): no scalar twin and no
    /// keys-by-row run, so a profiler sees the kernel alone (their columns
    /// print `-`, `null` in JSON).
    #[arg(long)]
    pub fast_only: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// The KV cache element types a run measures (`--kv-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvDtypes {
    F32,
    Bf16,
    /// f32, then bf16.
    Both,
}

impl KvDtypes {
    fn list(self) -> &'static [KvDtype] {
        match self {
            KvDtypes::F32 => &[KvDtype::F32],
            KvDtypes::Bf16 => &[KvDtype::Bf16],
            KvDtypes::Both => &[KvDtype::F32, KvDtype::Bf16],
        }
    }
}

/// One measured row.
#[derive(Debug, Clone, Serialize)]
pub struct AttentionRow {
    /// `decode` or `prefill`.
    pub kind: &'static str,
    pub kv_dtype: &'static str,
    /// Positions attended over (the longest row's).
    pub context: usize,
    /// Query rows.
    pub rows: usize,
    /// `None` with `--fast-only` (as `rows_ms`, `speedup`, `vs_rows`).
    pub twin_ms: Option<f64>,
    /// The fast path with the keys stored by row (before keys by column).
    pub rows_ms: Option<f64>,
    /// The fast path with the keys stored by column (the model's layout).
    pub fast_ms: f64,
    /// Twin time over fast time.
    pub speedup: Option<f64>,
    /// Keys-by-row time over fast time.
    pub vs_rows: Option<f64>,
    /// KV bytes read per second by the fast path (each cached row once), GB/s.
    pub kv_gbps: f64,
    /// `kv_gbps` as a percentage of the measured read bandwidth.
    pub pct_bandwidth: f64,
    /// Multiply-adds of `Q·Kᵀ` and `P·V` ×2 per second, GFLOP/s.
    pub gflops: f64,
    /// `gflops` as a percentage of the measured f32 FMA peak (what bounds
    /// attention where the cache is read faster than it is multiplied).
    pub pct_fma: f64,
}

/// One run's probes and rows.
pub struct Measured {
    /// Streaming read bandwidth, GB/s.
    pub bandwidth_gbps: f64,
    /// f32 FMA peak of rayon's threads (attention's) on the best tier, GFLOP/s.
    pub fma_peak_gflops: f64,
    pub rows: Vec<AttentionRow>,
}

/// A pool holding `copies` sequences of `len` positions of random K/V.
fn filled_pool(
    args: &BenchAttentionArgs,
    len: usize,
    copies: usize,
    dtype: KvDtype,
    key_columns: bool,
) -> Result<(KvPool, Vec<SeqCache>)> {
    let w = args.kv_heads * args.head_dim;
    let bs = args.block_size;
    let nb = copies * len.div_ceil(bs);
    let layout = KvLayout {
        key_columns,
        ..KvLayout::default()
    };
    let shape = KvLayerShape::heads(args.kv_heads, args.head_dim);
    let mut pool = KvPool::for_layers(&[shape], bs, nb, dtype, layout);
    let mut seqs = Vec::with_capacity(copies);
    let mut row = vec![0.0f32; w];
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..copies {
        let mut s = SeqCache::new();
        pool.reserve(&mut s, len)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        for pos in 0..len {
            let r = pool.row(&s, pos);
            for kv in 0..2 {
                for x in row.iter_mut() {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    *x = ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
                }
                let lp = pool.layer_mut(0);
                if kv == 0 {
                    lp.write_k(r, &row);
                } else {
                    lp.write_v(r, &row);
                }
            }
        }
        seqs.push(s);
    }
    Ok((pool, seqs))
}

/// One `nq`-row query of each sequence at context `ctx`.
fn batches(seqs: &[SeqCache], ctx: usize, nq: usize) -> Vec<AttnSeq<'_>> {
    seqs.iter()
        .map(|s| AttnSeq {
            blocks: s.blocks(),
            start: 0,
            len: nq,
            past: ctx - nq,
        })
        .collect()
}

/// Measures every decode context and the prefill, f32 and bf16 KV.
pub fn measure(args: &BenchAttentionArgs) -> Result<Measured> {
    let (heads, kvh, hd) = (args.heads, args.kv_heads, args.head_dim);
    if kvh == 0 || hd == 0 || heads == 0 || !heads.is_multiple_of(kvh) {
        bail!(
            "--heads {heads} must be a positive multiple of --kv-heads {kvh}; --head-dim must be positive"
        );
    }
    if args.block_size == 0 {
        bail!("--block-size must be positive");
    }
    let contexts = if args.contexts.trim().is_empty() {
        Vec::new()
    } else {
        list(&args.contexts, "--contexts")?
    };
    if contexts.is_empty() && args.prefill == 0 {
        bail!("nothing to measure: --contexts is empty and --prefill is 0");
    }
    let min = Duration::from_millis(args.min_ms);
    let bw = measure_bandwidth();
    let (fast, twin) = (kernels(), Kernels::generic());
    // The shared pool is rayon's global pool: attention's threads.
    let peak = measure_fma_peak(&*ExpertPool::shared()?, fast);
    let w = kvh * hd;
    let shape = AttnShape {
        heads,
        kv_heads: kvh,
        scale: (hd as f32).powf(-0.5),
        window: None,
        sinks: None,
        block_size: args.block_size,
        bf16_queries: args.bf16_queries,
    };
    let mut cases: Vec<(&'static str, usize, usize)> =
        contexts.iter().map(|&c| ("decode", c, 1)).collect();
    if args.prefill > 0 {
        cases.push(("prefill", args.prefill, args.prefill));
    }
    let mut rows = Vec::new();
    for &(kind, ctx, nq) in &cases {
        for &dtype in args.kv_dtype.list() {
            let kv_bytes = ctx * w * 2 * dtype.bytes();
            let copies = if kind == "decode" {
                (args.working_set_mib << 20).div_ceil(kv_bytes).max(1)
            } else {
                1
            };
            // Keys by column (what the model stores) and, to compare, by row.
            let (pool, seqs) = filled_pool(args, ctx, copies, dtype, true)?;
            let (rpool, rseqs) = if args.fast_only {
                (None, Vec::new())
            } else {
                let (p, s) = filled_pool(args, ctx, copies, dtype, false)?;
                (Some(p), s)
            };
            let (k, v) = pool.layer(0).views(hd);
            let q: Vec<f32> = (0..nq * heads * hd)
                .map(|i| ((i % 89) as f32 - 44.0) / 89.0)
                .collect();
            let mut out = vec![0.0f32; nq * heads * hd];
            let (cb, rb) = (batches(&seqs, ctx, nq), batches(&rseqs, ctx, nq));
            let mut run = |kern: &Kernels, bs: &[AttnSeq<'_>], k, v| {
                time(min, || {
                    for b in bs {
                        attention(kern, &shape, std::slice::from_ref(b), &q, k, v, &mut out);
                    }
                }) / copies as f64
            };
            let t_twin = (!args.fast_only).then(|| run(&twin, &cb, k, v));
            let t_rows = rpool.as_ref().map(|p| {
                let (rk, rv) = p.layer(0).views(hd);
                run(fast, &rb, rk, rv)
            });
            let t_fast = run(fast, &cb, k, v);
            // Score and value multiply-adds: each query row sees `past + i + 1` keys.
            let pairs: usize = (0..nq).map(|i| ctx - nq + i + 1).sum();
            let flops = 2.0 * (heads * pairs * 2 * hd) as f64;
            let gbps = kv_bytes as f64 / t_fast / 1e9;
            rows.push(AttentionRow {
                kind,
                kv_dtype: dtype.name(),
                context: ctx,
                rows: nq,
                twin_ms: t_twin.map(|t| t * 1e3),
                rows_ms: t_rows.map(|t| t * 1e3),
                fast_ms: t_fast * 1e3,
                speedup: t_twin.map(|t| t / t_fast),
                vs_rows: t_rows.map(|t| t / t_fast),
                kv_gbps: gbps,
                pct_bandwidth: 100.0 * gbps / bw,
                gflops: flops / t_fast / 1e9,
                pct_fma: 100.0 * flops / t_fast / 1e9 / peak,
            });
        }
    }
    Ok(Measured {
        bandwidth_gbps: bw,
        fma_peak_gflops: peak,
        rows,
    })
}

/// Runs the command.
pub fn run(args: &BenchAttentionArgs) -> Result<()> {
    let Measured {
        bandwidth_gbps: bw,
        fma_peak_gflops: peak,
        rows,
    } = measure(args)?;
    let tier = kernels().tier().name();
    let threads = rayon::current_num_threads();
    if args.json {
        let v = serde_json::json!({
            "tier": tier, "threads": threads, "bandwidth_gbps": bw, "fma_peak_gflops": peak,
            "bf16_queries": args.bf16_queries, "rows": rows,
        });
        println!("{v}");
        return Ok(());
    }
    println!(
        "flash attention, {} query heads / {} KV heads, head_dim {}, blocks of {}, {} queries: \
         tier {tier}, {threads} threads, measured read bandwidth {bw:.1} GB/s, \
         f32 FMA peak {peak:.0} GFLOP/s",
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.block_size,
        if args.bf16_queries { "bf16" } else { "f32" }
    );
    println!(
        "{:>8} {:>5} {:>7} {:>5} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>5} {:>8} {:>6}",
        "kind",
        "KV",
        "context",
        "rows",
        "twin ms",
        "K-rows ms",
        "fast ms",
        "speedup",
        "vs rows",
        "GB/s",
        "% bw",
        "GFLOP/s",
        "% FMA"
    );
    let ms = |t: Option<f64>| t.map_or("-".into(), |t| format!("{t:.3}"));
    let ratio = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.2}x"));
    for r in &rows {
        println!(
            "{:>8} {:>5} {:>7} {:>5} {:>9} {:>9} {:>9.3} {:>8} {:>8} {:>7.1} {:>5.0} {:>8.1} {:>6.0}",
            r.kind,
            r.kv_dtype,
            r.context,
            r.rows,
            ms(r.twin_ms),
            ms(r.rows_ms),
            r.fast_ms,
            ratio(r.speedup),
            ratio(r.vs_rows),
            r.kv_gbps,
            r.pct_bandwidth,
            r.gflops,
            r.pct_fma
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error's message, or "" when `r` is not an error.
    fn err_text<T, E: std::fmt::Display>(r: std::result::Result<T, E>) -> String {
        r.err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn tiny_bench_runs_and_bad_flags_are_named() -> Result<()> {
        let args = BenchAttentionArgs {
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            contexts: "5,33".into(),
            prefill: 7,
            block_size: 4,
            working_set_mib: 0,
            min_ms: 1,
            bf16_queries: false,
            kv_dtype: KvDtypes::Both,
            fast_only: false,
            json: false,
        };
        let Measured {
            bandwidth_gbps: bw,
            fma_peak_gflops: peak,
            rows,
        } = measure(&args)?;
        assert!(bw > 0.0 && peak > 0.0);
        assert_eq!(rows.len(), 6);
        assert!(rows.iter().all(|r| r.fast_ms > 0.0
            && r.pct_fma > 0.0
            && r.speedup.is_some_and(|x| x > 0.0)
            && r.vs_rows.is_some_and(|x| x > 0.0)));
        // The prefill row alone, bf16, fast path only.
        let only = BenchAttentionArgs {
            contexts: String::new(),
            kv_dtype: KvDtypes::Bf16,
            fast_only: true,
            ..args.clone()
        };
        let rows = measure(&only)?.rows;
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert!(r.kind == "prefill" && r.kv_dtype == "bf16" && r.fast_ms > 0.0);
        assert!(r.twin_ms.is_none() && r.rows_ms.is_none() && r.speedup.is_none());
        let none = BenchAttentionArgs {
            prefill: 0,
            ..only.clone()
        };
        let e = err_text(measure(&none));
        assert!(e.contains("nothing to measure"), "{e}");
        // The flags as a user types them: an unknown dtype is refused by name.
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: BenchAttentionArgs,
        }
        use clap::Parser;
        let cli = Cli::try_parse_from([
            "bench",
            "--kv-dtype",
            "bf16",
            "--contexts",
            "",
            "--fast-only",
        ])?;
        assert_eq!(cli.args.kv_dtype, KvDtypes::Bf16);
        assert!(cli.args.fast_only && cli.args.contexts.is_empty());
        assert_eq!(
            Cli::try_parse_from(["bench"])?.args.kv_dtype,
            KvDtypes::Both
        );
        let e = err_text(Cli::try_parse_from(["bench", "--kv-dtype", "f16"]));
        assert!(e.contains("--kv-dtype") && e.contains("f16"), "{e}");
        let bq = BenchAttentionArgs {
            bf16_queries: true,
            ..args.clone()
        };
        assert_eq!(measure(&bq)?.rows.len(), 6);
        let bad = BenchAttentionArgs {
            contexts: "5,x".into(),
            ..args.clone()
        };
        let e = err_text(measure(&bad));
        assert!(e.contains("--contexts"), "{e}");
        let bad = BenchAttentionArgs {
            kv_heads: 3,
            ..args
        };
        assert!(measure(&bad).is_err());
        Ok(())
    }
}
