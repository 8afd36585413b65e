//! `epserve bench moe`: one MoE layer with random weights at real shapes
//! (Qwen3-30B-A3B, Mixtral-8x7B, or custom), run through the packed expert
//! executor for several token counts, bf16 and int8, on one and on all cores.
//!
//! Everything is measured in the same run, as ratios: the machine's streaming
//! read bandwidth, f32 FMA peak with the widest FMA the CPU has and, where it
//! has one, the bf16 dot-product peak (`vdpbf16ps`, `bfdot`), per thread
//! count; the executor's time,
//! the weight bytes it streamed per second and their share of the bandwidth,
//! GFLOP/s and share of FMA peak, the speedup over the scalar twin kernels
//! and int8 over bf16. The targets are printed, never asserted.
//!
//! Routing rotates through a shuffled expert order so consecutive calls touch
//! different experts (a cyclic working set larger than the last-level cache
//! defeats it), with equal combine weights: the balanced-load case.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use epserve_core::config::Activation;
use epserve_core::experts::packed::PackedDtype;
use epserve_core::experts::{ExpertPool, PackedExpert, PackedExperts};
use epserve_core::kernels::dispatch::{Kernels, kernels};
use epserve_core::kernels::layout::f32_to_bf16_bits;
use epserve_core::moe::ExpertExecutor;
use epserve_core::tensor::{DType, Weight};
use serde::Serialize;

/// `epserve bench moe`.
#[derive(Debug, Clone, Args)]
pub struct BenchMoeArgs {
    /// Layer shapes: `qwen3` (hidden 2048, 128 experts, top-8, width 768),
    /// `mixtral` (4096, 8, top-2, 14336), or `name:hidden:experts:top_k:width`.
    #[arg(long, value_delimiter = ',', default_value = "qwen3,mixtral")]
    pub shapes: Vec<String>,
    /// Token counts per layer call.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256")]
    pub tokens: Vec<usize>,
    /// Expert precisions: bf16 (bf16 weights and activations, as
    /// `--expert-dtype bf16` loads), bf16-f32 (bf16 weights with f32
    /// activations: exact bf16 experts under the default `--expert-dtype
    /// auto`), int8.
    #[arg(long, value_delimiter = ',', default_value = "bf16,int8")]
    pub dtypes: Vec<String>,
    /// Thread counts; 0 means all cores.
    #[arg(long, value_delimiter = ',', default_value = "1,0")]
    pub threads: Vec<usize>,
    /// Minimum measuring time per row for the optimized kernels, in ms.
    #[arg(long, default_value_t = 500)]
    pub min_ms: u64,
    /// Calls of the scalar twin per row (0 skips it; it is slow at Mixtral shapes).
    #[arg(long, default_value_t = 1)]
    pub scalar_iters: usize,
    /// Skip the scalar twin on rows with more tokens than this.
    #[arg(long, default_value_t = 256)]
    pub scalar_max_tokens: usize,
    /// Size of the bandwidth probe buffer in MiB (make it much larger than the LLC).
    #[arg(long, default_value_t = 2048)]
    pub bw_mib: usize,
    /// Timed rounds over all rows (dtypes interleaved); each row reports its
    /// best round. Each round's value is the median of its passes.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Seed of the random weights, activations and routing.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// One layer shape.
#[derive(Debug, Clone, Serialize)]
pub struct Shape {
    pub name: String,
    pub hidden: usize,
    pub experts: usize,
    pub top_k: usize,
    pub inter: usize,
}

impl Shape {
    fn parse(s: &str) -> Result<Shape> {
        let named = |name: &str, hidden, experts, top_k, inter| Shape {
            name: name.into(),
            hidden,
            experts,
            top_k,
            inter,
        };
        Ok(match s.trim() {
            "qwen3" | "qwen3-30b-a3b" => named("qwen3-30b-a3b", 2048, 128, 8, 768),
            "mixtral" | "mixtral-8x7b" => named("mixtral-8x7b", 4096, 8, 2, 14336),
            other => {
                let p: Vec<&str> = other.split(':').collect();
                if p.len() != 5 {
                    bail!(
                        "unknown shape '{other}' (qwen3, mixtral or name:hidden:experts:top_k:width)"
                    );
                }
                let n = |i: usize| -> Result<usize> {
                    p[i].parse::<usize>()
                        .ok()
                        .filter(|&v| v > 0)
                        .with_context(|| {
                            format!("shape '{other}': '{}' is not a positive integer", p[i])
                        })
                };
                let sh = named(p[0], n(1)?, n(2)?, n(3)?, n(4)?);
                if sh.top_k > sh.experts {
                    bail!("shape '{other}': top_k exceeds the number of experts");
                }
                sh
            }
        })
    }
}

/// What the machine does, measured in this run, per thread count.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub threads: usize,
    /// Streaming read bandwidth, GB/s.
    pub bandwidth_gbps: f64,
    /// f32 FMA peak, GFLOP/s.
    pub fma_peak_gflops: f64,
    /// Which instruction the FMA peak was measured with.
    pub fma_peak_with: String,
    /// bf16 dot-product peak (two FLOPs per multiply-add), GFLOP/s, where
    /// the CPU has such an instruction.
    pub bf16_dot_peak_gflops: Option<f64>,
    pub bf16_dot_peak_with: Option<String>,
}

/// One measured configuration.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub shape: String,
    pub tokens: usize,
    pub dtype: String,
    pub threads: usize,
    pub kernel: String,
    pub time_ms: f64,
    /// Packed weight bytes of the experts one call touches.
    pub weight_bytes: f64,
    pub weight_gbps: f64,
    pub bandwidth_pct: f64,
    pub gflops: f64,
    pub fma_peak_pct: f64,
    /// bf16 rows on a tier with a bf16 dot tile: percent of the tier's bf16
    /// peak (`Kernels::bf16_dot_probe`: the prefill tiles' instruction on
    /// `amx` and `neon-bf16`; informational, the target is against the FMA
    /// peak).
    pub bf16_dot_peak_pct: Option<f64>,
    pub scalar_time_ms: Option<f64>,
    pub speedup_vs_scalar: Option<f64>,
    /// bf16 time / int8 time at the same tokens and threads (int8 rows).
    pub int8_over_bf16: Option<f64>,
}

/// A target of the issue and how this run fared.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub shape: String,
    pub what: String,
    pub target: f64,
    pub measured: Option<f64>,
    pub met: Option<bool>,
}

#[derive(Debug, Serialize)]
struct Report {
    kernel: String,
    machine: Vec<Machine>,
    shapes: Vec<Shape>,
    rows: Vec<Row>,
    targets: Vec<Target>,
}

/// splitmix64: fast, seedable, good enough for random weights.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Normal-like bf16 weights (a sum of four uniforms, standard deviation
/// ~0.02, as a model's initializer): their exponents spread as a real
/// model's do, which the B12 storage depends on.
pub(crate) fn normal_bf16(rows: usize, cols: usize, seed: u64) -> Weight {
    let mut rng = Rng(seed);
    let mut bytes = Vec::with_capacity(2 * rows * cols);
    for _ in 0..rows * cols {
        let s = rng.unit() + rng.unit() + rng.unit() + rng.unit();
        bytes.extend_from_slice(&f32_to_bf16_bits(s * 0.017).to_le_bytes());
    }
    Weight::from_bytes(DType::BF16, vec![rows, cols], &bytes)
}

/// Random bf16 weights of magnitude 2⁻⁸..2⁻⁵, built from bits directly.
pub(crate) fn random_bf16(rows: usize, cols: usize, seed: u64) -> Weight {
    let mut rng = Rng(seed);
    let n = rows * cols;
    let mut bytes = vec![0u8; 2 * n];
    for chunk in bytes.chunks_mut(8) {
        let r = rng.next();
        for (i, b) in chunk.chunks_mut(2).enumerate() {
            let v = (r >> (16 * i)) as u16;
            let sign = v & 0x8000;
            let exp = 119 + ((v >> 7) & 3); // 2^-8 .. 2^-5
            b.copy_from_slice(&(sign | (exp << 7) | (v & 0x7F)).to_le_bytes());
        }
    }
    Weight::from_bytes(DType::BF16, vec![rows, cols], &bytes)
}

/// One precision a row is measured in.
#[derive(Clone, Copy, Debug)]
struct BenchDtype {
    name: &'static str,
    packed: PackedDtype,
    bf16_activations: bool,
}

impl BenchDtype {
    fn parse(s: &str) -> Result<Self> {
        let (name, packed, bf16_activations) = match s {
            "bf16" => ("bf16", PackedDtype::Bf16, true),
            "bf16-f32" => ("bf16-f32", PackedDtype::Bf16, false),
            "int8" => ("int8", PackedDtype::Int8, false),
            other => bail!("unknown dtype '{other}' (bf16, bf16-f32, int8)"),
        };
        Ok(Self {
            name,
            packed,
            bf16_activations,
        })
    }
}

/// Builds the layer's experts in each asked precision (sources dropped as
/// soon as they are packed), on all cores.
fn build_experts(
    sh: &Shape,
    dtypes: &[BenchDtype],
    seed: u64,
) -> Result<Vec<Vec<Option<PackedExpert>>>> {
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut out: Vec<Vec<Option<PackedExpert>>> =
        vec![(0..sh.experts).map(|_| None).collect(); dtypes.len()];
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let e = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if e >= sh.experts {
                        break;
                    }
                    let base = seed ^ ((e as u64 + 1) << 32);
                    let gate = random_bf16(sh.inter, sh.hidden, base + 1);
                    let up = random_bf16(sh.inter, sh.hidden, base + 2);
                    let down = random_bf16(sh.hidden, sh.inter, base + 3);
                    for (di, dt) in dtypes.iter().enumerate() {
                        let r = PackedExpert::from_weights(
                            &gate,
                            &up,
                            &down,
                            sh.hidden,
                            sh.inter,
                            Activation::Silu,
                            dt.packed,
                            false,
                        )
                        .map(|p| p.with_bf16_activations(dt.bf16_activations));
                        results
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push((di, e, r));
                    }
                }
            });
        }
    });
    for (di, e, r) in results.into_inner().unwrap_or_else(|p| p.into_inner()) {
        out[di][e] = Some(r?);
    }
    Ok(out)
}

/// Streaming read bandwidth with `pool`'s threads over a buffer of `mib` MiB
/// (best of three passes), in GB/s.
fn measure_bandwidth(pool: &ExpertPool, buf: &[u64]) -> f64 {
    let t = pool.threads();
    let per = buf.len().div_ceil(t);
    let mut best = 0.0f64;
    for _ in 0..3 {
        let start = Instant::now();
        let sums = pool.broadcast(|i| {
            let chunk = &buf[(i * per).min(buf.len())..((i + 1) * per).min(buf.len())];
            let mut acc = [0u64; 8];
            let mut it = chunk.chunks_exact(8);
            for c in &mut it {
                for l in 0..8 {
                    acc[l] = acc[l].wrapping_add(c[l]);
                }
            }
            acc.iter().fold(0u64, |a, b| a.wrapping_add(*b))
        });
        let secs = start.elapsed().as_secs_f64();
        std::hint::black_box(sums);
        best = best.max((buf.len() * 8) as f64 / secs / 1e9);
    }
    best
}

/// f32 FMA peak of `pool`'s threads with the best kernel tier, in GFLOP/s.
pub(crate) fn measure_fma_peak(pool: &ExpertPool, k: &Kernels) -> f64 {
    let iters = 20_000_000;
    let mut best = 0.0f64;
    for _ in 0..3 {
        let start = Instant::now();
        let r = pool.broadcast(|_| k.fma_probe(iters));
        let secs = start.elapsed().as_secs_f64();
        let flops: f64 = r.iter().map(|(f, _)| f).sum();
        std::hint::black_box(r);
        best = best.max(flops / secs / 1e9);
    }
    best
}

/// bf16 dot-product peak of `pool`'s threads, in GFLOP/s, if the tier has one.
fn measure_bf16_dot_peak(pool: &ExpertPool, k: &Kernels) -> Option<(f64, &'static str)> {
    let iters = 10_000_000;
    let mut best = 0.0f64;
    let mut name = None;
    for _ in 0..3 {
        let start = Instant::now();
        let r = pool.broadcast(|_| k.bf16_dot_probe(iters));
        let secs = start.elapsed().as_secs_f64();
        let mut flops = 0.0;
        for (f, v, n) in r.iter().flatten() {
            flops += f;
            std::hint::black_box(v);
            name = Some(*n);
        }
        best = best.max(flops / secs / 1e9);
    }
    name.map(|n| (best, n))
}

/// Routings for `tokens` tokens that rotate through a shuffled expert order.
fn routings(sh: &Shape, tokens: usize, rng: &mut Rng) -> Vec<(Vec<u32>, Vec<f32>)> {
    let mut perm: Vec<u32> = (0..sh.experts as u32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let per_call = tokens * sh.top_k;
    let count = sh.experts.div_ceil(per_call).clamp(1, 64);
    let mut cursor = 0usize;
    (0..count)
        .map(|_| {
            let mut ids = Vec::with_capacity(per_call);
            for _ in 0..tokens {
                for j in 0..sh.top_k {
                    ids.push(perm[(cursor + j) % sh.experts]);
                }
                cursor += sh.top_k;
            }
            (ids, vec![1.0 / sh.top_k as f32; per_call])
        })
        .collect()
}

/// Seconds per call. Timed in passes over every routing (each expert
/// touched once per pass), for at least `min` and three passes; the median
/// pass counts, so a burst of load from the shared host's other tenants
/// does not skew the row the way a mean would. Exactly `fixed` calls, and
/// their mean, when given (the scalar twin).
fn time_calls(
    ex: &PackedExperts,
    x: &[f32],
    rs: &[(Vec<u32>, Vec<f32>)],
    top_k: usize,
    out: &mut [f32],
    min: Duration,
    fixed: Option<usize>,
) -> Result<f64> {
    if let Some(f) = fixed {
        let start = Instant::now();
        for n in 0..f.max(1) {
            let (ids, w) = &rs[n % rs.len()];
            ex.execute(0, x, ids, w, top_k, out)?;
        }
        return Ok(start.elapsed().as_secs_f64() / f.max(1) as f64);
    }
    // Warm up with one pass (first-touch costs of freshly built weights stay
    // out of the row).
    for (ids, w) in rs {
        ex.execute(0, x, ids, w, top_k, out)?;
    }
    let start = Instant::now();
    let mut passes = Vec::new();
    while passes.len() < 3 || start.elapsed() < min {
        let t0 = Instant::now();
        for (ids, w) in rs {
            ex.execute(0, x, ids, w, top_k, out)?;
        }
        passes.push(t0.elapsed().as_secs_f64() / rs.len().max(1) as f64);
    }
    passes.sort_by(f64::total_cmp);
    Ok(passes[passes.len() / 2])
}

fn bytes_touched(ex: &PackedExperts, rs: &[(Vec<u32>, Vec<f32>)]) -> f64 {
    let total: usize = rs
        .iter()
        .map(|(ids, _)| {
            let mut seen: Vec<u32> = ids.clone();
            seen.sort_unstable();
            seen.dedup();
            seen.iter()
                .filter_map(|&e| ex.expert(0, e as usize))
                .map(|e| e.weight_bytes())
                .sum::<usize>()
        })
        .sum();
    total as f64 / rs.len() as f64
}

/// Runs the benchmark and prints the table (or JSON).
pub fn run(args: &BenchMoeArgs) -> Result<()> {
    let shapes: Vec<Shape> = args
        .shapes
        .iter()
        .map(|s| Shape::parse(s))
        .collect::<Result<_>>()?;
    let dtypes: Vec<BenchDtype> = args
        .dtypes
        .iter()
        .map(|d| BenchDtype::parse(d.trim()))
        .collect::<Result<_>>()?;
    if args.tokens.is_empty() || args.tokens.contains(&0) {
        bail!("--tokens must list positive token counts");
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut thread_counts: Vec<usize> = args
        .threads
        .iter()
        .map(|&t| if t == 0 { cores } else { t })
        .collect();
    thread_counts.dedup();
    let k = *kernels();
    // Peaks are the machine's: measured with its best tier even when
    // EPSERVE_KERNEL forces a slower one for the rows.
    let best = Kernels::best();
    let log = |s: String| {
        if !args.json {
            eprintln!("{s}");
        }
    };

    // The machine, measured now.
    let mut pools: BTreeMap<usize, Arc<ExpertPool>> = BTreeMap::new();
    let mut machine = Vec::new();
    // Kept for the whole run: the bandwidth is measured again each round.
    let words = args.bw_mib.max(1) * (1 << 20) / 8;
    let buf = crate::bench_linear::probe_buffer(words);
    {
        log(format!(
            "measuring memory bandwidth ({} MiB buffer) and FMA peak...",
            args.bw_mib
        ));
        for &t in &thread_counts {
            let pool = Arc::new(ExpertPool::new(Some(t), true)?);
            let bw = measure_bandwidth(&pool, &buf);
            let peak = measure_fma_peak(&pool, &best);
            let dot = measure_bf16_dot_peak(&pool, &best);
            machine.push(Machine {
                threads: t,
                bandwidth_gbps: bw,
                fma_peak_gflops: peak,
                fma_peak_with: best.fma_probe_name().into(),
                bf16_dot_peak_gflops: dot.map(|d| d.0),
                bf16_dot_peak_with: dot.map(|d| d.1.to_string()),
            });
            pools.insert(t, pool);
        }
    }

    let mut rows: Vec<Row> = Vec::new();
    let mut rng = Rng(args.seed ^ 0x5EED);
    // The probe above counts as the first round's.
    let mut probed = true;
    for sh in &shapes {
        log(format!(
            "building {}: hidden {}, {} experts, top-{}, width {} ({:?})...",
            sh.name, sh.hidden, sh.experts, sh.top_k, sh.inter, dtypes
        ));
        let built = build_experts(sh, &dtypes, args.seed)?;
        let first_pool = pools.values().next().cloned().context("no thread counts")?;
        // Every dtype's executor and every row's inputs, built once.
        let mut execs = Vec::new();
        for (di, experts) in built.into_iter().enumerate() {
            let dt = dtypes[di];
            let ex = PackedExperts::new(vec![Some(experts)], sh.hidden, first_pool.clone())?;
            execs.push((dt, dt.name, ex));
        }
        let inputs: Vec<_> = args
            .tokens
            .iter()
            .map(|&tok| {
                let x: Vec<f32> = (0..tok * sh.hidden).map(|_| rng.unit()).collect();
                (tok, x, routings(sh, tok, &mut rng))
            })
            .collect();
        // Rounds over all rows, dtypes interleaved: each row keeps its best
        // round, so a burst of load on the shared host costs one round of
        // some rows instead of a whole dtype's rows (and the ratios).
        let rounds = args.rounds.max(1);
        let mut best: BTreeMap<(usize, usize, usize), f64> = BTreeMap::new();
        let mut scalars: BTreeMap<(usize, usize, usize), f64> = BTreeMap::new();
        for round in 0..rounds {
            if rounds > 1 {
                log(format!("  round {}/{rounds}", round + 1));
            }
            // The bandwidth probe, like the rows, keeps its best round.
            if !std::mem::take(&mut probed) {
                for m in machine.iter_mut() {
                    if let Some(pool) = pools.get(&m.threads) {
                        m.bandwidth_gbps = m.bandwidth_gbps.max(measure_bandwidth(pool, &buf));
                    }
                }
            }
            for (ei, (_, dname, ex)) in execs.iter_mut().enumerate() {
                for (ti, (tok, x, rs)) in inputs.iter().enumerate() {
                    let mut out = vec![0.0f32; tok * sh.top_k * sh.hidden];
                    for &t in &thread_counts {
                        let Some(pool) = pools.get(&t) else { continue };
                        ex.set_pool(pool.clone());
                        ex.set_kernels(k);
                        let min = Duration::from_millis(args.min_ms);
                        let secs = time_calls(ex, x, rs, sh.top_k, &mut out, min, None)?;
                        let slot = best.entry((ei, ti, t)).or_insert(secs);
                        *slot = slot.min(secs);
                        if round == 0 && args.scalar_iters > 0 && *tok <= args.scalar_max_tokens {
                            ex.set_kernels(Kernels::generic());
                            let fixed = Some(args.scalar_iters);
                            let s = time_calls(ex, x, rs, sh.top_k, &mut out, min, fixed)?;
                            ex.set_kernels(k);
                            scalars.insert((ei, ti, t), s);
                        }
                        log(format!(
                            "  {:>4} tok {} {}t: {:9.3} ms",
                            tok,
                            dname,
                            t,
                            secs * 1e3
                        ));
                    }
                }
            }
        }
        for (ei, (dt, dname, ex)) in execs.iter().enumerate() {
            for (ti, (tok, _, rs)) in inputs.iter().enumerate() {
                let bytes = bytes_touched(ex, rs);
                let flops = (tok * sh.top_k * 6 * sh.hidden * sh.inter) as f64;
                for &t in &thread_counts {
                    let Some(&secs) = best.get(&(ei, ti, t)) else {
                        continue;
                    };
                    let scalar = scalars.get(&(ei, ti, t)).copied();
                    let m = machine.iter().find(|m| m.threads == t);
                    let gbps = bytes / secs / 1e9;
                    let gflops = flops / secs / 1e9;
                    rows.push(Row {
                        shape: sh.name.clone(),
                        tokens: *tok,
                        dtype: (*dname).into(),
                        threads: t,
                        kernel: k.tier().name().into(),
                        time_ms: secs * 1e3,
                        weight_bytes: bytes,
                        weight_gbps: gbps,
                        // Set below, against the best probe of the whole run.
                        bandwidth_pct: 0.0,
                        gflops,
                        fma_peak_pct: m.map_or(0.0, |m| 100.0 * gflops / m.fma_peak_gflops),
                        bf16_dot_peak_pct: (dt.bf16_activations && k.bf16x_mr().is_some())
                            .then(|| m.and_then(|m| m.bf16_dot_peak_gflops))
                            .flatten()
                            .map(|p| 100.0 * gflops / p),
                        scalar_time_ms: scalar.map(|s| s * 1e3),
                        speedup_vs_scalar: scalar.map(|s| s / secs),
                        int8_over_bf16: None,
                    });
                }
            }
        }
    }
    // Percentages against the best bandwidth any round measured.
    for r in rows.iter_mut() {
        if let Some(m) = machine.iter().find(|m| m.threads == r.threads) {
            r.bandwidth_pct = 100.0 * r.weight_gbps / m.bandwidth_gbps;
        }
    }
    // int8 over bf16 at the same shape, tokens and threads.
    let bf: Vec<(String, usize, usize, f64)> = rows
        .iter()
        .filter(|r| r.dtype == "bf16")
        .map(|r| (r.shape.clone(), r.tokens, r.threads, r.time_ms))
        .collect();
    for r in rows.iter_mut().filter(|r| r.dtype == "int8") {
        r.int8_over_bf16 = bf
            .iter()
            .find(|(s, t, th, _)| *s == r.shape && *t == r.tokens && *th == r.threads)
            .map(|b| b.3 / r.time_ms);
    }
    let targets = targets(&shapes, &rows);
    if args.json {
        let rep = Report {
            kernel: k.tier().name().into(),
            machine,
            shapes,
            rows,
            targets,
        };
        println!("{}", serde_json::to_string_pretty(&rep)?);
    } else {
        print_tables(&k, &machine, &rows, &targets);
    }
    Ok(())
}

fn targets(shapes: &[Shape], rows: &[Row]) -> Vec<Target> {
    let mut out = Vec::new();
    let min = |it: &mut dyn Iterator<Item = f64>| {
        it.fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.min(v))))
    };
    for sh in shapes {
        let rs: Vec<&Row> = rows.iter().filter(|r| r.shape == sh.name).collect();
        let mut push = |what: &str, target: f64, measured: Option<f64>| {
            out.push(Target {
                shape: sh.name.clone(),
                what: what.into(),
                target,
                measured,
                met: measured.map(|m| m >= target),
            })
        };
        let decode = |r: &&&Row| r.tokens <= 16;
        let prefill = |r: &&&Row| r.tokens >= 256;
        push(
            "bf16 decode rows (<=16 tokens): min % of measured bandwidth",
            80.0,
            min(&mut rs
                .iter()
                .filter(decode)
                .filter(|r| r.dtype == "bf16")
                .map(|r| r.bandwidth_pct)),
        );
        push(
            "int8 over bf16 on decode rows (<=16 tokens): min speedup",
            1.5,
            min(&mut rs.iter().filter(decode).filter_map(|r| r.int8_over_bf16)),
        );
        push(
            "int8 over bf16 on prefill rows (256 tokens): min speedup",
            1.3,
            min(&mut rs.iter().filter(prefill).filter_map(|r| r.int8_over_bf16)),
        );
        push(
            "bf16 prefill rows (256 tokens): min % of FMA peak",
            60.0,
            min(&mut rs
                .iter()
                .filter(prefill)
                .filter(|r| r.dtype == "bf16")
                .map(|r| r.fma_peak_pct)),
        );
        push(
            "bf16 over the scalar twin, every row: min speedup",
            3.25,
            min(&mut rs
                .iter()
                .filter(|r| r.dtype == "bf16")
                .filter_map(|r| r.speedup_vs_scalar)),
        );
    }
    out
}

fn print_tables(k: &Kernels, machine: &[Machine], rows: &[Row], targets: &[Target]) {
    println!("kernel tier: {}", k.tier().name());
    for m in machine {
        println!(
            "machine, {} thread(s): read bandwidth {:.1} GB/s, FMA peak {:.1} GFLOP/s ({}){}",
            m.threads,
            m.bandwidth_gbps,
            m.fma_peak_gflops,
            m.fma_peak_with,
            match (&m.bf16_dot_peak_gflops, &m.bf16_dot_peak_with) {
                (Some(p), Some(w)) => format!(", bf16 dot peak {p:.1} GFLOP/s ({w})"),
                _ => String::new(),
            }
        );
    }
    println!();
    println!(
        "| shape | tokens | dtype | threads | time ms | weight GB/s | % bw | GFLOP/s | % FMA peak | % bf16 dot peak | x scalar | int8/bf16 |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {:.3} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {} |",
            r.shape,
            r.tokens,
            r.dtype,
            r.threads,
            r.time_ms,
            r.weight_gbps,
            r.bandwidth_pct,
            r.gflops,
            r.fma_peak_pct,
            r.bf16_dot_peak_pct
                .map_or("-".to_string(), |v| format!("{v:.1}")),
            opt(r.speedup_vs_scalar),
            opt(r.int8_over_bf16)
        );
    }
    println!();
    println!("targets (printed, not asserted):");
    for t in targets {
        println!(
            "  {:<14} {:<62} target >= {:<5} measured {:>8}  {}",
            t.shape,
            t.what,
            t.target,
            opt(t.measured),
            match t.met {
                Some(true) => "met",
                Some(false) => "NOT MET",
                None => "not measured",
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse() {
        let q = Shape::parse("qwen3").expect("qwen3");
        assert_eq!((q.hidden, q.experts, q.top_k, q.inter), (2048, 128, 8, 768));
        let c = Shape::parse("tiny:64:4:2:32").expect("custom");
        assert_eq!((c.hidden, c.experts, c.top_k, c.inter), (64, 4, 2, 32));
        assert!(Shape::parse("tiny:64:4:5:32").is_err());
        assert!(Shape::parse("tiny:64:x:2:32").is_err());
        assert!(Shape::parse("nope").is_err());
    }

    #[test]
    fn routings_pick_distinct_experts_per_token() {
        let sh = Shape::parse("t:8:5:3:8").expect("shape");
        let mut rng = Rng(1);
        for (ids, w) in routings(&sh, 4, &mut rng) {
            assert_eq!(ids.len(), 12);
            assert_eq!(w.len(), 12);
            for t in ids.chunks(3) {
                let mut s = t.to_vec();
                s.sort_unstable();
                s.dedup();
                assert_eq!(s.len(), 3);
            }
        }
    }

    #[test]
    fn tiny_bench_runs() {
        let args = BenchMoeArgs {
            shapes: vec!["tiny:64:4:2:40".into()],
            tokens: vec![1, 7],
            dtypes: vec!["bf16".into(), "int8".into()],
            threads: vec![1],
            min_ms: 1,
            scalar_iters: 1,
            scalar_max_tokens: 256,
            bw_mib: 1,
            rounds: 2,
            json: true,
            seed: 3,
        };
        run(&args).expect("bench");
    }
}
