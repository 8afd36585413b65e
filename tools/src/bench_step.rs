//! `epserve bench step`: where one forward step of a real model folder spends
//! its time, per phase (attention projections, attention itself, output
//! projection, router, experts, combine, shared expert, dense MLP, LM head,
//! sampling), each against its own roofline measured in the same run: the
//! bytes it must read over the machine's streaming bandwidth, or its
//! multiply-adds over the FMA peak, whichever is longer (for the experts,
//! per expert touched, then summed: a skewed router leaves experts with one
//! or two rows that wait on memory while others wait on FMAs). A phase far from its
//! roofline is the next thing to make fast, without a profiler.
//!
//! Rows: decode steps of B sequences (one new token each, `--context`
//! positions already cached) and prefills of one T-token prompt. Timings are
//! medians of passes; ratios only (the machines are shared and noisy).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use epserve_core::config::ModelConfig;
use epserve_core::experts::pool::ExpertPool;
use epserve_core::experts::{DenseDtype, ExpertDtype, LoadOptions};
use epserve_core::kernels::b12::b12_enabled;
use epserve_core::kernels::dispatch::kernels;
use epserve_core::model::kv_cache::{KvCacheDtype, KvDtype, KvPool, SeqCache};
use epserve_core::model::{LogitsMode, Model, SeqInput};
use epserve_core::profile::{self, Phase, Profile};
use epserve_core::sampling::{Sampler, SamplingParams};
use serde::Serialize;

use crate::bench_linear::list;
use crate::bench_moe::measure_fma_peak;

/// `epserve bench step`.
#[derive(Debug, Clone, Args)]
pub struct BenchStepArgs {
    /// Model folder (Hugging Face layout).
    #[arg(long)]
    pub model: PathBuf,
    /// Decode batch sizes (sequences, one new token each), comma-separated.
    #[arg(long, default_value = "1,8,64")]
    pub decode: String,
    /// Positions already cached per decode sequence.
    #[arg(long, default_value_t = 128)]
    pub context: usize,
    /// Also time each decode row at this many cached positions, one pass
    /// at each context in turn, and print the step at --context over the
    /// step here (the median of the paired passes' ratios): what a long
    /// context costs, measured where the host's speed drifts between runs.
    #[arg(long)]
    pub vs_context: Option<usize>,
    /// Prefill lengths (one prompt per row), comma-separated; empty for none.
    #[arg(long, default_value = "512")]
    pub prefill: String,
    /// Least time per row, milliseconds (at least 3 passes).
    #[arg(long, default_value_t = 2000)]
    pub min_ms: u64,
    /// Expert precision: auto (bf16 when exact), bf16, int8 (W8A8).
    #[arg(long, default_value = "auto")]
    pub expert_dtype: ExpertDtype,
    /// Precision of the dense projections outside the experts (attention,
    /// dense MLPs, shared experts, LM head): auto (bf16 weights, exact f32
    /// activations), bf16 (activations rounded to bf16: the bf16 dot
    /// instructions where the CPU has them), or int8 (W8A8, quantized at load).
    #[arg(long, default_value = "auto")]
    pub dense_dtype: DenseDtype,
    /// KV cache element type: auto (the model's declared dtype), bf16, f32.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: KvCacheDtype,
    /// Print one JSON object instead of the tables.
    #[arg(long)]
    pub json: bool,
}

/// One phase of one row.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseRow {
    pub phase: String,
    /// Milliseconds per step.
    pub ms: f64,
    /// Share of the step, percent.
    pub pct_step: f64,
    /// The roofline's milliseconds (max of bytes / bandwidth and FLOPs / peak),
    /// when the phase declares its work.
    pub roofline_ms: Option<f64>,
    /// `roofline_ms / ms`, percent.
    pub pct_roofline: Option<f64>,
    /// What bounds it: "bw" or "fma"; for the experts "mix" when some are
    /// bound by memory and others by FMA.
    pub bound: Option<&'static str>,
}

/// One measured row.
#[derive(Debug, Clone, Serialize)]
pub struct StepRow {
    /// "decode" or "prefill".
    pub kind: &'static str,
    pub seqs: usize,
    pub tokens: usize,
    pub context: usize,
    pub step_ms: f64,
    pub tokens_per_s: f64,
    pub phases: Vec<PhaseRow>,
}

/// Bytes of one expert's weights in the precision it is kept in: int8 one
/// a weight; bf16 (f32 or bf16 activations) stored as B12 where
/// [`b12_enabled`] (12 bits a weight; the panels' tables and escapes add
/// under 0.1 %); bf16 two.
fn expert_bytes(cfg: &ModelConfig, dtype: ExpertDtype) -> usize {
    let weights = 3 * cfg.hidden_size * cfg.moe_intermediate_size;
    match dtype {
        ExpertDtype::Int8 => weights,
        ExpertDtype::Auto | ExpertDtype::Bf16 if b12_enabled() => weights * 3 / 2,
        _ => weights * 2,
    }
}

/// Multiply-adds of attention itself per query row per cached position,
/// summed over layers: per query head, a key dot and a value axpy.
fn attn_macs_per_pos(cfg: &ModelConfig) -> usize {
    let nh = cfg.num_attention_heads;
    cfg.layers
        .iter()
        .map(|l| match &cfg.mla {
            Some(m) => nh * (2 * m.kv_lora_rank + m.qk_rope_head_dim),
            None => nh * 2 * l.head_dim,
        })
        .sum()
}

/// A roofline time in seconds and what bounds it ("bw", "fma" or "mix").
type Roof = (f64, &'static str);

/// What the median pass of a row did.
struct Measured {
    step: f64,
    sampling: f64,
    profile: Profile,
    /// Rows routed to each expert a step touched, over all layers (one
    /// entry per (layer, expert) with at least one row).
    expert_rows: Vec<usize>,
    /// KV bytes attention read per step.
    kv_bytes: usize,
    /// Attention multiply-adds per step.
    attn_macs: usize,
}

fn random_tokens(n: usize, vocab: usize, seed: &mut u64) -> Vec<u32> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((*seed >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Most timed passes of one row (bounds the cache a decode row grows into).
const MAX_PASSES: usize = 48;

/// One row being timed: `seqs` sequences with `past` cached positions each
/// take `new` tokens. Decode rows prefill their context once (in [`new`])
/// and then step repeatedly (the context grows by one per pass); prefill
/// rows start from an empty cache every pass.
///
/// [`new`]: RowRun::new
struct RowRun<'m> {
    model: &'m Model,
    seqs: usize,
    past: usize,
    new: usize,
    pool: KvPool,
    caches: Vec<SeqCache>,
    seed: u64,
    sampler: Sampler,
    /// KV bytes a cached position takes, as the pool stores them (value
    /// padding included).
    kv_per_pos: usize,
    macs_per_pos: usize,
    /// (step seconds, sampling seconds, profile) of each counted pass.
    passes: Vec<(f64, f64, Profile)>,
    expert_rows: Vec<usize>,
    attended: usize,
    /// Passes run, the first (warming caches and threads) not counted.
    pass: usize,
}

/// One input per sequence: `tokens[i]` appended to `caches[i]`.
fn seq_inputs<'a>(
    caches: &'a mut [SeqCache],
    tokens: &'a [Vec<u32>],
    logits: bool,
) -> Vec<SeqInput<'a>> {
    caches
        .iter_mut()
        .zip(tokens)
        .map(|(cache, t)| SeqInput {
            tokens: t,
            cache,
            logits,
        })
        .collect()
}

impl<'m> RowRun<'m> {
    fn new(model: &'m Model, kv: KvDtype, seqs: usize, past: usize, new: usize) -> Result<Self> {
        let cfg = &model.config;
        let grow = if past > 0 {
            (MAX_PASSES + 1) * new
        } else {
            new
        };
        let block = 16;
        let mut run = RowRun {
            model,
            seqs,
            past,
            new,
            pool: model.new_pool(block, seqs * (past + grow).div_ceil(block), kv),
            caches: (0..seqs).map(|_| model.new_cache()).collect(),
            seed: 0x5eed_u64 ^ (seqs * 1000 + past * 7 + new) as u64,
            sampler: Sampler::new(SamplingParams {
                temperature: 1.0,
                top_p: 0.95,
                ..Default::default()
            }),
            kv_per_pos: KvPool::layer_block_bytes(&model.kv_layer_shapes(), 1, kv),
            macs_per_pos: attn_macs_per_pos(cfg),
            passes: Vec::new(),
            expert_rows: Vec::new(),
            attended: 0,
            pass: 0,
        };
        if past > 0 {
            let vocab = cfg.vocab_size;
            let prompts: Vec<Vec<u32>> = (0..seqs)
                .map(|_| random_tokens(past, vocab, &mut run.seed))
                .collect();
            let mut inputs = seq_inputs(&mut run.caches, &prompts, false);
            model.forward(&mut inputs, &mut run.pool, LogitsMode::Last, false)?;
        }
        Ok(run)
    }

    /// Whether another pass fits: at least 4, then until `min` has passed
    /// since `start` (and at most `MAX_PASSES` counted).
    fn wants_more(&self, start: Instant, min: Duration) -> bool {
        self.pass < 4 || (start.elapsed() < min && self.pass <= MAX_PASSES)
    }

    /// Runs one pass; its step time in seconds when it counts (not the first).
    fn step(&mut self) -> Result<Option<f64>> {
        let model = self.model;
        let (seqs, new, vocab) = (self.seqs, self.new, model.config.vocab_size);
        if self.past == 0 && self.pass > 0 {
            for c in &mut self.caches {
                model.release(&mut self.pool, c);
            }
            model.flush_releases();
        }
        let cached: usize = self.caches.iter().map(|c| c.len()).sum();
        let news: Vec<Vec<u32>> = (0..seqs)
            .map(|_| random_tokens(new, vocab, &mut self.seed))
            .collect();
        let mut inputs = seq_inputs(&mut self.caches, &news, true);
        let _ = profile::take();
        profile::set_enabled(true);
        let t0 = Instant::now();
        let out = model.forward(&mut inputs, &mut self.pool, LogitsMode::Last, true);
        let step = t0.elapsed().as_secs_f64();
        profile::set_enabled(false);
        let prof = profile::take();
        let mut out = out?;
        drop(inputs);
        let t1 = Instant::now();
        for row in out.logits.chunks_mut(vocab) {
            std::hint::black_box(self.sampler.sample(row, &[], &[]));
        }
        let sampling = t1.elapsed().as_secs_f64();
        let counted = self.pass > 0;
        if counted {
            self.passes.push((step, sampling, prof));
            self.expert_rows.clear();
            for t in &out.router {
                let mut ids = t.routing.topk_ids.clone();
                ids.sort_unstable();
                self.expert_rows
                    .extend(ids.chunk_by(|a, b| a == b).map(|c| c.len()));
            }
            // Each new token attends to what was cached and to the new ones
            // before it (causal).
            self.attended = cached * new + seqs * new * (new + 1) / 2;
        }
        self.pass += 1;
        Ok(counted.then_some(step))
    }

    /// The median pass by step time, with its own phases (so they add up).
    fn finish(mut self) -> Measured {
        for c in &mut self.caches {
            self.model.release(&mut self.pool, c);
        }
        self.model.flush_releases();
        let mut passes = std::mem::take(&mut self.passes);
        passes.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (step, sampling, profile) = passes.swap_remove(passes.len() / 2);
        Measured {
            step,
            sampling,
            profile,
            expert_rows: self.expert_rows,
            // Every position attended to is read once per step (per KV head group).
            kv_bytes: (self.attended / self.new.max(1)) * self.kv_per_pos,
            attn_macs: self.attended * self.macs_per_pos,
        }
    }
}

/// Times one row (see [`RowRun`]): its median pass.
fn measure_row(
    model: &Model,
    kv: KvDtype,
    seqs: usize,
    past: usize,
    new: usize,
    min: Duration,
) -> Result<Measured> {
    let mut run = RowRun::new(model, kv, seqs, past, new)?;
    let start = Instant::now();
    while run.wants_more(start, min) {
        run.step()?;
    }
    Ok(run.finish())
}

/// Decode of `seqs` sequences at `context` cached positions against `base`,
/// one pass of each in turn, so both meet the same host (whose speed drifts
/// over seconds on a shared machine): each pair's step-time ratio.
#[derive(Debug, Clone, Serialize)]
pub struct ContextRatio {
    pub seqs: usize,
    pub context: usize,
    pub base: usize,
    /// Median of the paired passes' `step(context) / step(base)`.
    pub ratio: f64,
    pub min_ratio: f64,
    pub max_ratio: f64,
    pub pairs: usize,
    /// Median step times over the same passes, ms.
    pub step_ms: f64,
    pub base_step_ms: f64,
    /// Attention (core: the step's attention less its projections) of the
    /// median pass of each, ms.
    pub attn_ms: f64,
    pub base_attn_ms: f64,
}

fn context_ratio(
    model: &Model,
    kv: KvDtype,
    seqs: usize,
    context: usize,
    base: usize,
    min: Duration,
) -> Result<ContextRatio> {
    let mut long = RowRun::new(model, kv, seqs, context, 1)?;
    let mut short = RowRun::new(model, kv, seqs, base, 1)?;
    let mut ratios = Vec::new();
    let start = Instant::now();
    // Twice the row's time: it is two rows.
    while long.wants_more(start, 2 * min) {
        // Alternate which goes first, so neither always follows the other.
        let (a, b) = if long.pass % 2 == 0 {
            let a = long.step()?;
            (a, short.step()?)
        } else {
            let b = short.step()?;
            (long.step()?, b)
        };
        if let (Some(a), Some(b)) = (a, b) {
            ratios.push(a / b);
        }
    }
    ratios.sort_by(f64::total_cmp);
    let core = |m: &Measured| {
        let p = &m.profile;
        (p.get(Phase::Attention).seconds
            - p.get(Phase::AttnProj).seconds
            - p.get(Phase::AttnOut).seconds)
            * 1e3
    };
    let (l, s) = (long.finish(), short.finish());
    Ok(ContextRatio {
        seqs,
        context,
        base,
        ratio: ratios[ratios.len() / 2],
        min_ratio: ratios[0],
        max_ratio: ratios[ratios.len() - 1],
        pairs: ratios.len(),
        step_ms: l.step * 1e3,
        base_step_ms: s.step * 1e3,
        attn_ms: core(&l),
        base_attn_ms: core(&s),
    })
}

/// Measures every row.
pub fn measure(args: &BenchStepArgs) -> Result<(f64, f64, Vec<StepRow>, Vec<ContextRatio>)> {
    // An empty list turns a kind of row off.
    let some = |s: &str, what| {
        if s.trim().is_empty() {
            Ok(Vec::new())
        } else {
            list(s, what)
        }
    };
    let decode = some(&args.decode, "--decode")?;
    let prefill = some(&args.prefill, "--prefill")?;
    if decode.is_empty() && prefill.is_empty() {
        bail!("nothing to measure: --decode and --prefill are both empty");
    }
    let opts = LoadOptions {
        expert_dtype: args.expert_dtype,
        dense_dtype: args.dense_dtype,
        ..Default::default()
    };
    let model = Model::load_with(&args.model, &opts)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let cfg = &model.config;
    for (flag, c) in [
        ("--context", Some(args.context)),
        ("--vs-context", args.vs_context),
    ] {
        if let Some(c) = c
            && c + 1 > cfg.max_position_embeddings
        {
            bail!(
                "{flag} {c} exceeds the model's {} positions",
                cfg.max_position_embeddings
            );
        }
    }
    if args.vs_context.is_some() && decode.is_empty() {
        bail!("--vs-context compares decode rows, and --decode is empty");
    }
    let kv = model.kv_dtype(args.kv_cache_dtype);
    let bw = crate::bench_linear::measure_bandwidth();
    // The experts' shared pool is rayon's global pool: the threads every phase runs on.
    let peak = measure_fma_peak(&*ExpertPool::shared()?, kernels());
    let min = Duration::from_millis(args.min_ms);
    let e_bytes = expert_bytes(cfg, args.expert_dtype);
    let e_macs = 3 * cfg.hidden_size * cfg.moe_intermediate_size;
    let mut rows = Vec::new();
    let runs = decode
        .iter()
        .map(|&b| ("decode", b, args.context, 1))
        .chain(prefill.iter().map(|&t| ("prefill", 1, 0, t)));
    for (kind, seqs, past, new) in runs {
        let m = measure_row(&model, kv, seqs, past, new, min)?;
        let roof = |bytes: usize, macs: usize| -> (f64, &'static str) {
            let (b, f) = (bytes as f64 / bw / 1e9, 2.0 * macs as f64 / peak / 1e9);
            if b >= f { (b, "bw") } else { (f, "fma") }
        };
        let p = &m.profile;
        let secs = |ph: Phase| p.get(ph).seconds;
        let declared = |ph: Phase| {
            let t = p.get(ph);
            (t.bytes as usize, t.macs as usize)
        };
        let attn_core = secs(Phase::Attention) - secs(Phase::AttnProj) - secs(Phase::AttnOut);
        let mut phases: Vec<(String, f64, Option<Roof>)> = Vec::new();
        let with_work = |ph: Phase| {
            let (b, mc) = declared(ph);
            (b > 0 || mc > 0).then(|| roof(b, mc))
        };
        phases.push(("embed".into(), secs(Phase::Embed), None));
        phases.push((
            Phase::AttnProj.name().into(),
            secs(Phase::AttnProj),
            with_work(Phase::AttnProj),
        ));
        phases.push((
            "attention (core)".into(),
            attn_core,
            Some(roof(m.kv_bytes, m.attn_macs)),
        ));
        phases.push((
            Phase::AttnOut.name().into(),
            secs(Phase::AttnOut),
            with_work(Phase::AttnOut),
        ));
        phases.push((
            Phase::Router.name().into(),
            secs(Phase::Router),
            with_work(Phase::Router),
        ));
        phases.push((
            Phase::Experts.name().into(),
            secs(Phase::Experts),
            (!m.expert_rows.is_empty()).then(|| {
                // Per expert: its weights streamed once, or its rows' FMAs,
                // whichever takes longer (an expert with two rows waits on
                // memory however idle the FMA units are), summed.
                let (mut t, mut n_bw) = (0.0, 0);
                for &r in &m.expert_rows {
                    let (secs, bound) = roof(e_bytes, r * e_macs);
                    t += secs;
                    n_bw += usize::from(bound == "bw");
                }
                let bound = match n_bw {
                    0 => "fma",
                    n if n == m.expert_rows.len() => "bw",
                    _ => "mix",
                };
                (t, bound)
            }),
        ));
        for ph in [
            Phase::Combine,
            Phase::Shared,
            Phase::DenseMlp,
            Phase::LmHead,
        ] {
            phases.push((ph.name().into(), secs(ph), with_work(ph)));
        }
        let listed: f64 = phases.iter().map(|(_, s, _)| s).sum();
        phases.push((
            "other (norms, rope, ...)".into(),
            (m.step - listed).max(0.0),
            None,
        ));
        phases.push(("sampling (after step)".into(), m.sampling, None));
        let step = m.step;
        rows.push(StepRow {
            kind,
            seqs,
            tokens: seqs * new,
            context: past,
            step_ms: step * 1e3,
            tokens_per_s: (seqs * new) as f64 / step,
            phases: phases
                .into_iter()
                .filter(|(name, s, r)| *s > 0.0 || r.is_some() || name.starts_with("other"))
                .map(|(phase, s, r)| PhaseRow {
                    phase,
                    ms: s * 1e3,
                    pct_step: 100.0 * s / step,
                    roofline_ms: r.map(|(t, _)| t * 1e3),
                    pct_roofline: r.map(|(t, _)| if s > 0.0 { 100.0 * t / s } else { 0.0 }),
                    bound: r.map(|(_, b)| b),
                })
                .collect(),
        });
    }
    let mut ratios = Vec::new();
    if let Some(base) = args.vs_context {
        for &b in &decode {
            ratios.push(context_ratio(&model, kv, b, args.context, base, min)?);
        }
    }
    Ok((bw, peak, rows, ratios))
}

/// Runs the command.
pub fn run(args: &BenchStepArgs) -> Result<()> {
    let (bw, peak, rows, ratios) = measure(args)?;
    let tier = kernels().tier().name();
    let dot_prefill = kernels().bf16x_prefill();
    let threads = rayon::current_num_threads();
    if args.json {
        let v = serde_json::json!({
            "model": args.model, "tier": tier, "threads": threads,
            "bf16_dot_prefill": dot_prefill,
            "expert_dtype": args.expert_dtype.name(), "dense_dtype": args.dense_dtype.name(),
            "bandwidth_gbps": bw, "fma_peak_gflops": peak, "rows": rows,
            "context_ratios": ratios,
        });
        println!("{v}");
        return Ok(());
    }
    println!(
        "one forward step of {}: tier {tier}{}, {threads} threads, read bandwidth {bw:.1} GB/s, \
         f32 FMA peak {peak:.0} GFLOP/s; --expert-dtype {} --dense-dtype {}",
        args.model.display(),
        if dot_prefill {
            " (bf16 activations: dot tile on prefill)"
        } else {
            ""
        },
        args.expert_dtype.name(),
        args.dense_dtype.name()
    );
    for r in &rows {
        println!();
        println!(
            "{} {} seq x {} new token(s), {} cached: {:.2} ms per step, {:.1} tok/s",
            r.kind,
            r.seqs,
            r.tokens / r.seqs.max(1),
            r.context,
            r.step_ms,
            r.tokens_per_s
        );
        println!(
            "  {:<26} {:>9} {:>7} {:>12} {:>11}",
            "phase", "ms", "% step", "roofline ms", "% roofline"
        );
        for p in &r.phases {
            let (roof, pct) = match (p.roofline_ms, p.pct_roofline, p.bound) {
                (Some(t), Some(pc), Some(b)) => (format!("{t:.3} {b:>3}"), format!("{pc:.0}")),
                _ => ("-".into(), "-".into()),
            };
            println!(
                "  {:<26} {:>9.3} {:>7.1} {:>12} {:>11}",
                p.phase, p.ms, p.pct_step, roof, pct
            );
        }
    }
    for r in &ratios {
        println!();
        println!(
            "decode {} seq, {} cached against {}, one pass of each in turn: step {:.2}x \
             (median of {} pairs, {:.2}-{:.2}x); median steps {:.2} / {:.2} ms, \
             attention (core) {:.3} / {:.3} ms",
            r.seqs,
            r.context,
            r.base,
            r.ratio,
            r.pairs,
            r.min_ratio,
            r.max_ratio,
            r.step_ms,
            r.base_step_ms,
            r.attn_ms,
            r.base_attn_ms
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_a/bf16")
    }

    #[test]
    fn tiny_bench_runs_and_names_every_phase() -> Result<()> {
        let args = BenchStepArgs {
            model: fixture(),
            decode: "2".into(),
            context: 5,
            vs_context: None,
            prefill: "7".into(),
            min_ms: 0,
            expert_dtype: ExpertDtype::Auto,
            dense_dtype: DenseDtype::Int8,
            kv_cache_dtype: KvCacheDtype::Bf16,
            json: false,
        };
        let (_, _, rows, ratios) = measure(&args)?;
        assert!(ratios.is_empty());
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (rows[0].kind, rows[0].seqs, rows[0].tokens),
            ("decode", 2, 2)
        );
        assert_eq!((rows[1].kind, rows[1].tokens), ("prefill", 7));
        for r in &rows {
            let names: Vec<&str> = r.phases.iter().map(|p| p.phase.as_str()).collect();
            for want in [
                "attn q/k/v proj",
                "attention (core)",
                "router",
                "experts",
                "lm head",
            ] {
                assert!(names.contains(&want), "{want} missing from {names:?}");
            }
            let sum: f64 = r
                .phases
                .iter()
                .filter(|p| !p.phase.starts_with("sampling"))
                .map(|p| p.ms)
                .sum();
            assert!(
                sum <= r.step_ms * 1.0001 + 1e-6,
                "phases {sum} exceed the step {}",
                r.step_ms
            );
        }
        // Two contexts one pass at a time: every counted pass paired.
        let vs = BenchStepArgs {
            decode: "1".into(),
            context: 9,
            vs_context: Some(3),
            prefill: String::new(),
            ..args.clone()
        };
        let (_, _, rows, ratios) = measure(&vs)?;
        assert_eq!(rows.len(), 1);
        let [r] = &ratios[..] else {
            panic!("one decode row, one ratio: {ratios:?}");
        };
        assert_eq!((r.seqs, r.context, r.base), (1, 9, 3));
        assert!(r.pairs >= 3 && r.min_ratio > 0.0, "{r:?}");
        assert!(r.min_ratio <= r.ratio && r.ratio <= r.max_ratio, "{r:?}");
        assert!(
            r.step_ms > 0.0 && r.base_step_ms > 0.0 && r.attn_ms > 0.0,
            "{r:?}"
        );
        let far = BenchStepArgs {
            vs_context: Some(usize::MAX / 2),
            ..vs.clone()
        };
        let e = measure(&far).expect_err("past the model's positions");
        assert!(format!("{e:#}").contains("--vs-context"), "{e:#}");
        let none = BenchStepArgs {
            decode: String::new(),
            prefill: "7".into(),
            ..vs
        };
        let e = measure(&none).expect_err("no decode rows");
        assert!(format!("{e:#}").contains("--vs-context"), "{e:#}");
        let bad = BenchStepArgs {
            decode: "0".into(),
            ..args
        };
        let e = measure(&bad).expect_err("zero batch");
        assert!(format!("{e:#}").contains("--decode"), "{e:#}");
        Ok(())
    }
}
