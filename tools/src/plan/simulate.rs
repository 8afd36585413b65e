//! `epserve plan --simulate`: decode steps of a cluster we cannot build here
//! (DeepSeek-V3 671B or Qwen3-235B-A22B on N Graviton nodes), with skewed
//! routing and replicated hot experts, instead of the planner's uniform
//! average.
//!
//! Each MoE layer gets its own expert popularity (Zipf with exponent
//! `--zipf`, over a per-layer random order of the experts). The placement
//! is built as the coordinator's EPLB builds it from a measured load: the
//! redundant slots go to the experts with the largest load per replica,
//! then replicas are packed heaviest first onto the worker with the least
//! load that has a free slot. Every simulated step draws each token's top-k
//! distinct experts from the popularity, splits an expert's tokens evenly
//! over its replicas, and times each worker with the planner's roofline
//! (bytes of the distinct replicas it touches over its bandwidth, its
//! token-expert products over its compute): the layer waits for the slowest
//! worker. The rest of the step (coordinator, attention, network, round
//! trips) is the planner's [`estimate`].

use std::fmt::Write as _;

use anyhow::{Result, bail};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::{Assumptions, ExpertDtype, Instance, Layout, ModelShape, estimate};

/// What the simulation is asked for.
#[derive(Debug, Clone)]
pub struct SimSpec {
    /// Nodes in all: one coordinator, `attention_workers` shards, the rest
    /// expert-workers.
    pub nodes: u64,
    pub attention_workers: u64,
    /// Zipf exponent of expert popularity within a layer (0 = uniform).
    pub zipf: f64,
    /// Redundant expert slots per layer (replicas of hot experts).
    pub redundant: u64,
    /// Simulated steps per batch size.
    pub steps: usize,
    pub seed: u64,
    pub batches: Vec<u64>,
}

/// One batch size's result.
#[derive(Debug, Clone)]
pub struct SimRow {
    pub batch: u64,
    /// Mean decode step, seconds.
    pub step_s: f64,
    /// The planner's uniform-routing step for the same layout.
    pub uniform_step_s: f64,
    /// Mean over steps and layers of mean worker time / slowest worker time.
    pub balancedness: f64,
}

impl SimRow {
    pub fn tokens_per_s(&self) -> f64 {
        self.batch as f64 / self.step_s
    }
}

/// Popularity of each expert of one layer: Zipf over a random order.
fn popularity(experts: usize, zipf: f64, rng: &mut StdRng) -> Vec<f64> {
    let mut order: Vec<usize> = (0..experts).collect();
    order.shuffle(rng);
    let mut p = vec![0.0; experts];
    for (rank, &e) in order.iter().enumerate() {
        p[e] = 1.0 / ((rank + 1) as f64).powf(zipf);
    }
    let sum: f64 = p.iter().sum();
    p.iter().map(|x| x / sum).collect()
}

/// Replicas per expert and the worker of each replica: redundant slots to
/// the largest load per replica, then heaviest replica first onto the
/// least-loaded worker with a free slot.
pub fn place(load: &[f64], workers: usize, slots: usize, redundant: usize) -> Vec<Vec<usize>> {
    let e = load.len();
    let mut reps = vec![1usize; e];
    for _ in 0..redundant.min(workers * slots - e.min(workers * slots)) {
        let hot = (0..e)
            .max_by(|&a, &b| (load[a] / reps[a] as f64).total_cmp(&(load[b] / reps[b] as f64)))
            .unwrap_or(0);
        if reps[hot] >= workers {
            break;
        }
        reps[hot] += 1;
    }
    let mut items: Vec<(usize, f64)> = (0..e)
        .flat_map(|x| std::iter::repeat_n((x, load[x] / reps[x] as f64), reps[x]))
        .collect();
    items.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut w_load = vec![0.0f64; workers];
    let mut w_used = vec![0usize; workers];
    let mut out = vec![Vec::new(); e];
    for (x, l) in items {
        // A worker never holds two replicas of one expert.
        let best = (0..workers)
            .filter(|&w| w_used[w] < slots && !out[x].contains(&w))
            .min_by(|&a, &b| w_load[a].total_cmp(&w_load[b]).then(a.cmp(&b)));
        if let Some(w) = best {
            w_load[w] += l;
            w_used[w] += 1;
            out[x].push(w);
        }
    }
    out
}

/// `k` distinct experts drawn by popularity (weighted, without replacement).
fn draw(p: &[f64], k: usize, rng: &mut StdRng, out: &mut Vec<usize>) {
    out.clear();
    let mut left: f64 = 1.0;
    while out.len() < k.min(p.len()) {
        let mut r = rng.random::<f64>() * left;
        let mut pick = None;
        for (i, &w) in p.iter().enumerate() {
            if out.contains(&i) {
                continue;
            }
            pick = Some(i);
            if r < w {
                break;
            }
            r -= w;
        }
        let Some(i) = pick else { break };
        left -= p[i];
        out.push(i);
    }
}

/// Runs the simulation.
pub fn simulate(
    m: &ModelShape,
    inst: &Instance,
    a: &Assumptions,
    spec: &SimSpec,
) -> Result<Vec<SimRow>> {
    if spec.nodes < spec.attention_workers + 2 {
        bail!(
            "--nodes {} leaves no expert-worker besides the coordinator and {} attention-workers",
            spec.nodes,
            spec.attention_workers
        );
    }
    let workers = (spec.nodes - 1 - spec.attention_workers) as usize;
    let experts = m.experts as usize;
    let expert_bytes = m.expert_bytes(a.expert_dtype) as f64;
    let per_slot = m.moe_layers as f64 * expert_bytes;
    let capacity = (inst.pod_budget_bytes() / per_slot).floor() as usize;
    let needed = experts.div_ceil(workers);
    if capacity < needed {
        bail!(
            "{} experts of {:.1} GiB per slot (all layers) need {needed} slots per worker on {workers} expert-workers; a {} pod holds {capacity}: more nodes or --expert-dtype int8",
            experts,
            per_slot / super::GIB,
            inst.name
        );
    }
    let slots = capacity.min(needed + (spec.redundant as usize).div_ceil(workers));
    // A loopback cluster (`--instance local`) runs its workers on one
    // machine: each gets its share of the bandwidth and cores.
    let share = if inst.managed { 1.0 } else { workers as f64 };
    let bw = inst.peak_bandwidth() * a.mem_bw_efficiency / share;
    let vcpus = f64::from(inst.pod_cpus()) / share;
    let ops = match a.expert_dtype {
        ExpertDtype::Bf16 => vcpus * inst.generation.gflops_bf16_per_vcpu * 1e9,
        ExpertDtype::Int8 => vcpus * inst.generation.gops_int8_per_vcpu * 1e9,
    };
    let flops_per_token_expert = 2.0 * m.expert_params() as f64;
    let layout = Layout {
        expert_workers: workers as u64,
        attention_workers: spec.attention_workers,
    };
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let layers = m.moe_layers as usize;
    // Per layer: popularity, and the placement EPLB would build from it.
    let pops: Vec<Vec<f64>> = (0..layers)
        .map(|_| popularity(experts, spec.zipf, &mut rng))
        .collect();
    let places: Vec<Vec<Vec<usize>>> = pops
        .iter()
        .map(|p| place(p, workers, slots, spec.redundant as usize))
        .collect();
    let mut rows = Vec::new();
    let mut picked = Vec::new();
    for &batch in &spec.batches {
        let uniform = estimate(m, inst, a, layout, batch);
        let mut experts_total = 0.0;
        let mut balance_sum = 0.0;
        for _ in 0..spec.steps.max(1) {
            for (p, reps) in pops.iter().zip(&places) {
                let mut tokens = vec![0u64; experts];
                for _ in 0..batch {
                    draw(p, m.top_k as usize, &mut rng, &mut picked);
                    for &e in &picked {
                        tokens[e] += 1;
                    }
                }
                let mut w_bytes = vec![0.0f64; workers];
                let mut w_tokens = vec![0.0f64; workers];
                for (e, &t) in tokens.iter().enumerate() {
                    if t == 0 || reps[e].is_empty() {
                        continue;
                    }
                    let r = reps[e].len() as u64;
                    for (j, &w) in reps[e].iter().enumerate() {
                        // Round-robin split of the expert's tokens.
                        let share = t / r + u64::from((j as u64) < t % r);
                        if share > 0 {
                            w_bytes[w] += expert_bytes;
                            w_tokens[w] += share as f64;
                        }
                    }
                }
                let times: Vec<f64> = w_bytes
                    .iter()
                    .zip(&w_tokens)
                    .map(|(b, t)| (b / bw).max(t * flops_per_token_expert / ops))
                    .collect();
                let slowest = times.iter().copied().fold(0.0, f64::max);
                let mean = times.iter().sum::<f64>() / workers as f64;
                experts_total += slowest;
                balance_sum += if slowest > 0.0 { mean / slowest } else { 1.0 };
            }
        }
        let steps = spec.steps.max(1) as f64;
        let experts_s = experts_total / steps;
        rows.push(SimRow {
            batch,
            step_s: uniform.step_s() - uniform.experts_s + experts_s,
            uniform_step_s: uniform.step_s(),
            balancedness: balance_sum / (steps * layers.max(1) as f64),
        });
    }
    Ok(rows)
}

/// The simulation's report.
pub fn render(m: &ModelShape, inst: &Instance, spec: &SimSpec, rows: &[SimRow]) -> String {
    let mut s = String::new();
    let workers = spec.nodes - 1 - spec.attention_workers;
    let _ = writeln!(
        s,
        "simulated   {} ({} MoE layers, {} experts, top-{}) on {} {} nodes: 1 coordinator, {} attention-worker(s), {} expert-workers",
        m.model_type,
        m.moe_layers,
        m.experts,
        m.top_k,
        spec.nodes,
        inst.name,
        spec.attention_workers,
        workers
    );
    let _ = writeln!(
        s,
        "routing     Zipf exponent {} per layer (0 = uniform), {} redundant slots per layer placed by load, {} steps per batch, seed {}",
        spec.zipf, spec.redundant, spec.steps, spec.seed
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:>6} {:>12} {:>12} {:>14} {:>14} {:>13}",
        "batch", "TPOT ms", "tok/s", "uniform tok/s", "vs uniform", "balancedness"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:>6} {:>12.2} {:>12.1} {:>14.1} {:>13.2}x {:>13.2}",
            r.batch,
            r.step_s * 1e3,
            r.tokens_per_s(),
            r.batch as f64 / r.uniform_step_s,
            r.step_s / r.uniform_step_s,
            r.balancedness
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "TPOT is the decode step (every sequence gets one token per step); rates per vCPU and bandwidth are the planner's (assumed unless calibrated), the expert stage waits for the slowest worker of each layer."
    );
    s
}
