//! One decode step as a roofline over its stages, and the search for the
//! smallest deployment that reaches a throughput target.

use anyhow::{Context, Result, bail};

use super::{ExpertDtype, GIB, Instance, KvDtype, ModelShape, WireDtype, expected_touched};

/// Decode-step batch sizes shown in the throughput table.
const TABLE_BATCHES: [u64; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];
/// Redundant expert slots aimed for, as a fraction of the experts per layer
/// (DeepSeek's EPLB serves 256 experts with 32 redundant ones: 1/8).
const REDUNDANCY_TARGET: f64 = 0.125;
/// Largest expert-worker count searched.
const MAX_EXPERT_WORKERS: u64 = 512;
/// When no layout reaches the target, the smallest one within this share of
/// the best throughput is chosen (more nodes for the last percent is waste).
const NEAR_BEST: f64 = 0.95;

/// Fixed inputs of an estimate besides the layout and batch.
#[derive(Debug, Clone)]
pub struct Assumptions {
    pub expert_dtype: ExpertDtype,
    pub kv_dtype: KvDtype,
    pub context_len: u64,
    pub rtt_s: f64,
    /// Most one TCP flow carries, bits/s: the coordinator talks to each
    /// worker over one HTTP/2 connection, and EC2 caps a single flow (5 Gbps
    /// outside a cluster placement group, 10 Gbps inside).
    pub flow_bps: f64,
    pub mem_bw_efficiency: f64,
    pub wire_dtype: WireDtype,
    pub cold: ColdTier,
}

/// A cluster smaller than the model's experts: each worker holds what fits
/// (`--expert-memory`: its hottest experts packed) and packs the rest on use
/// from the checkpoint on its disk.
#[derive(Debug, Clone)]
pub struct ColdTier {
    /// Most expert-workers the cluster may have (None: as many as the
    /// experts need, no cold tier).
    pub max_expert_workers: Option<u64>,
    /// Zipf exponent of expert popularity (0: uniform): what share of the
    /// uses the held (hottest) experts take.
    pub zipf: f64,
    /// Bytes per second a worker reads a cold expert from its disk.
    pub read_bps: f64,
    /// Bytes per second one vCPU packs (bf16 copy into panels, or int8
    /// quantization); a worker packs a step's misses on all its vCPUs.
    pub pack_bps_per_vcpu: f64,
}

impl Default for ColdTier {
    fn default() -> Self {
        ColdTier {
            max_expert_workers: None,
            zipf: 1.0,
            read_bps: 1e9,
            pack_bps_per_vcpu: 4e9,
        }
    }
}

/// Share of the expert uses that find their expert held when the hottest
/// `held` of `experts` (Zipf `s` popularity) are, and the expected number of
/// the others a batch of `batch` tokens (top-`k`) touches in one layer.
pub fn cold_tier_touch(experts: u64, held: f64, k: u64, s: f64, batch: u64) -> (f64, f64) {
    if experts == 0 || held >= experts as f64 {
        return (1.0, 0.0);
    }
    let p: Vec<f64> = (1..=experts).map(|r| 1.0 / (r as f64).powf(s)).collect();
    let sum: f64 = p.iter().sum();
    let h = held.floor().max(0.0) as usize;
    let hit = p[..h].iter().sum::<f64>() / sum;
    // As `expected_touched`: a token picks expert r among its k with
    // probability k·p_r (capped at 1).
    let cold = p[h..]
        .iter()
        .map(|x| 1.0 - (1.0 - (k as f64 * x / sum).min(1.0)).powf(batch as f64))
        .sum();
    (hit, cold)
}

/// How many worker pods of each kind (one per node).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub expert_workers: u64,
    /// 0 = attention runs in the coordinator.
    pub attention_workers: u64,
}

/// Seconds of one decode step, by stage.
#[derive(Debug, Clone, PartialEq)]
pub struct StepEstimate {
    pub batch: u64,
    /// Expected distinct experts per MoE layer.
    pub experts_touched: f64,
    /// Bytes every node streams from memory in the step, summed.
    pub bytes_streamed: f64,
    pub coordinator_s: f64,
    pub attention_s: f64,
    pub experts_s: f64,
    pub network_s: f64,
    pub latency_s: f64,
    /// Reading and packing the cold experts a step touches (0 without a
    /// cold tier).
    pub cold_s: f64,
    /// Share of expert uses that find their expert held (1 without a cold tier).
    pub hit_rate: f64,
}

impl StepEstimate {
    /// The whole step.
    pub fn step_s(&self) -> f64 {
        self.coordinator_s
            + self.attention_s
            + self.experts_s
            + self.network_s
            + self.latency_s
            + self.cold_s
    }
    /// Output tokens per second.
    pub fn tokens_per_s(&self) -> f64 {
        self.batch as f64 / self.step_s()
    }
    /// The stage taking the most time.
    pub fn bound(&self) -> &'static str {
        let stages = [
            (self.coordinator_s, "coordinator"),
            (self.attention_s, "attention"),
            (self.experts_s, "experts"),
            (self.network_s, "network"),
            (self.latency_s, "round trips"),
            (self.cold_s, "cold tier"),
        ];
        stages
            .iter()
            .fold(
                (f64::MIN, ""),
                |best, s| if s.0 > best.0 { *s } else { best },
            )
            .1
    }
}

/// One decode step of `batch` sequences on `layout`, every node an `inst`.
pub fn estimate(
    m: &ModelShape,
    inst: &Instance,
    a: &Assumptions,
    layout: Layout,
    batch: u64,
) -> StepEstimate {
    let bw = inst.peak_bandwidth() * a.mem_bw_efficiency;
    let vcpus = f64::from(inst.pod_cpus());
    let flops_bf16 = vcpus * inst.generation.gflops_bf16_per_vcpu * 1e9;
    let expert_ops = match a.expert_dtype {
        ExpertDtype::Bf16 => flops_bf16,
        ExpertDtype::Int8 => vcpus * inst.generation.gops_int8_per_vcpu * 1e9,
    };
    let b = batch as f64;
    let roof = |bytes: f64, flops: f64, bw: f64, ops: f64| (bytes / bw).max(flops / ops);

    // Attention: its weights once per step, each sequence's KV once.
    let attn_bytes = 2.0 * m.attention_params() as f64
        + b * m.kv_bytes_for_context(a.context_len, a.kv_dtype) as f64;
    let attn_flops =
        b * (2.0 * m.attention_params() as f64 + m.attention_score_flops(a.context_len) as f64);
    // Always on the coordinator: router, shared experts, dense MLPs, the output
    // head (the embedding matrix when tied), one embedding row per token.
    let head_params = m.vocab * m.hidden;
    let coord_params = m.router_params() + m.shared_params() + m.dense_params() + head_params;
    let mut coord_bytes = 2.0 * coord_params as f64 + b * 2.0 * m.hidden as f64;
    let mut coord_flops = b * 2.0 * coord_params as f64;
    let shards = layout.attention_workers;
    let attention_s = if shards == 0 {
        coord_bytes += attn_bytes;
        coord_flops += attn_flops;
        0.0
    } else {
        let s = shards as f64;
        // On one machine (`--instance local`) the shards share its bandwidth
        // and cores; on nodes each has its own.
        let share = if inst.managed { 1.0 } else { s };
        roof(
            attn_bytes / s,
            attn_flops / s,
            bw / share,
            flops_bf16 / share,
        )
    };
    let coordinator_s = roof(coord_bytes, coord_flops, bw, flops_bf16);

    // Experts: each worker streams its share of the touched experts (at least
    // one whole expert: an expert is never split), and runs its share of the
    // token-expert products.
    let w = layout.expert_workers.max(1) as f64;
    let touched = expected_touched(m.experts, m.top_k, batch);
    let expert_bytes = m.expert_bytes(a.expert_dtype) as f64;
    let per_worker_bytes = (touched / w).max(1.0) * expert_bytes;
    let per_worker_flops = b * m.top_k as f64 * 2.0 * m.expert_params() as f64 / w;
    // A loopback cluster's workers run at the same time on one machine: each
    // gets its share of the bandwidth and cores.
    let share = if inst.managed { 1.0 } else { w };
    let experts_s = m.moe_layers as f64
        * roof(
            per_worker_bytes,
            per_worker_flops,
            bw / share,
            expert_ops / share,
        );

    // Network through the coordinator's NIC (full duplex: the busier
    // direction): a token's hidden state goes once to each distinct worker
    // its k experts live on (in the wire dtype) and one combined partial sum
    // per worker comes back; with shards, the hidden state (bf16) goes to
    // every shard each layer and its slice of the output comes back.
    let distinct = w * (1.0 - (1.0 - 1.0 / w).powf(m.top_k as f64));
    let per_moe = m.moe_layers as f64 * b * distinct;
    let mut out = per_moe * a.wire_dtype.out_bytes(m.hidden);
    let mut back = per_moe * a.wire_dtype.back_bytes(m.hidden);
    if shards > 0 {
        let shard_bytes = m.layers as f64 * shards as f64 * b * 2.0 * m.hidden as f64;
        out += shard_bytes;
        back += shard_bytes / shards as f64;
    }
    // The NIC carries every flow; each worker's own flow is capped too (a
    // worker gets 1/w of the expert traffic, a shard 1/shards of its part).
    let nic_s = out.max(back) / (inst.net_gbps * 1e9 / 8.0);
    let flows = if shards > 0 { w.max(shards as f64) } else { w };
    let flow_s = out.max(back) / flows / (a.flow_bps / 8.0);
    let network_s = nic_s.max(flow_s);
    let round_trips = m.moe_layers + if shards > 0 { m.layers } else { 0 };
    let latency_s = round_trips as f64 * a.rtt_s;

    // Cold tier: a worker holds the experts that fit its pod (the hottest);
    // every other expert a step touches is read from its disk and packed
    // (its vCPUs pack a step's misses together), once per layer.
    let capacity = (inst.pod_budget_bytes() / (m.moe_layers as f64 * expert_bytes)).floor();
    let held = (capacity * w).min(m.experts as f64);
    let (hit_rate, cold_touched) = cold_tier_touch(m.experts, held, m.top_k, a.cold.zipf, batch);
    let cold_s = m.moe_layers as f64 * cold_touched / w
        * expert_bytes
        * (1.0 / a.cold.read_bps + 1.0 / (a.cold.pack_bps_per_vcpu * vcpus));

    let bytes_streamed = coord_bytes
        + if shards > 0 { attn_bytes } else { 0.0 }
        + m.moe_layers as f64 * touched * expert_bytes;
    StepEstimate {
        batch,
        experts_touched: touched,
        bytes_streamed,
        coordinator_s,
        attention_s,
        experts_s,
        network_s,
        latency_s,
        cold_s,
        hit_rate,
    }
}

/// The planner's answer.
#[derive(Debug, Clone)]
pub struct Plan {
    pub layout: Layout,
    /// Expert slots per worker per MoE layer.
    pub slots_per_worker: u64,
    /// Slots per layer beyond one per expert, for replicas of hot experts.
    pub redundant_per_layer: u64,
    /// Expert weight bytes each worker holds.
    pub worker_expert_bytes: f64,
    /// Most expert slots per layer that fit in one worker.
    pub slot_capacity: u64,
    /// Share of each layer's experts the workers hold packed (below 1: a
    /// cold tier, the rest packed on use from disk).
    pub held_fraction: f64,
    /// Bytes the coordinator holds (weights + its KV share).
    pub coordinator_bytes: f64,
    /// Bytes each attention shard holds.
    pub shard_bytes: f64,
    /// KV bytes for `batch` sequences of `context_len` tokens.
    pub kv_pool_bytes: f64,
    /// The estimate at the operating batch.
    pub at_batch: StepEstimate,
    /// Throughput by batch size.
    pub table: Vec<StepEstimate>,
    /// Whether one deployment reaches the target at the operating batch.
    pub reachable: bool,
    /// Deployments (each a coordinator with its workers) to reach the target.
    pub deployments: u64,
}

/// Bytes the coordinator and each shard hold for a given shard count.
fn resident_bytes(m: &ModelShape, kv_pool: f64, shards: u64) -> (f64, f64) {
    let attn = 2.0 * m.attention_params() as f64;
    let rest = 2.0
        * (m.router_params()
            + m.shared_params()
            + m.dense_params()
            + m.embedding_params()
            + m.lm_head_params()) as f64;
    if shards == 0 {
        (rest + attn + kv_pool, 0.0)
    } else {
        let s = shards as f64;
        (rest, (attn + kv_pool) / s)
    }
}

/// Sizes a deployment: the fewest expert-workers (and the best attention
/// layout for them) that reach `target_tps` at `batch`, within memory.
pub fn make_plan(
    m: &ModelShape,
    inst: &Instance,
    a: &Assumptions,
    target_tps: f64,
    batch: u64,
) -> Result<Plan> {
    if m.experts == 0 || m.moe_layers == 0 {
        bail!("the model has no MoE layers: nothing to spread over expert-workers");
    }
    if !(target_tps > 0.0 && target_tps.is_finite()) {
        bail!("--target-output-tps must be a positive number (got {target_tps})");
    }
    if batch == 0 {
        bail!("--batch must be at least 1");
    }
    let budget = inst.pod_budget_bytes();
    let expert_bytes = m.expert_bytes(a.expert_dtype) as f64;
    let per_slot = m.moe_layers as f64 * expert_bytes;
    let capacity = (budget / per_slot).floor() as u64;
    if capacity == 0 {
        bail!(
            "one expert of every layer ({:.1} GiB) does not fit in a {} pod ({} GiB): pick a larger instance or --expert-dtype int8",
            per_slot / GIB,
            inst.name,
            inst.pod_memory_gib()
        );
    }
    let min_workers = m.experts.div_ceil(capacity);
    // A cluster capped below what the experts need gets a cold tier.
    let max_workers = match a.cold.max_expert_workers {
        Some(0) => bail!("--max-expert-workers must be at least 1"),
        Some(n) => n,
        None => MAX_EXPERT_WORKERS.max(min_workers),
    };
    let kv_pool = batch as f64 * m.kv_bytes_for_context(a.context_len, a.kv_dtype) as f64;
    // Attention in the coordinator, or split over shards that divide the KV heads.
    let mut shard_options = vec![0u64];
    shard_options.extend((1..=m.kv_heads).filter(|d| m.kv_heads.is_multiple_of(*d)));

    // Every layout that fits in memory, with its estimate at the operating batch.
    let mut layouts = Vec::new();
    for workers in min_workers.min(max_workers)..=max_workers {
        for &shards in &shard_options {
            let (coord, shard) = resident_bytes(m, kv_pool, shards);
            if coord > budget || shard > budget {
                continue;
            }
            let layout = Layout {
                expert_workers: workers,
                attention_workers: shards,
            };
            layouts.push((layout, estimate(m, inst, a, layout, batch)));
        }
    }
    if layouts.is_empty() {
        bail!(
            "the coordinator's weights and KV cache for --batch {batch} at --context-len {} do not fit in a {} pod ({} GiB), even with attention-workers: lower --batch or --context-len, or pick a larger instance",
            a.context_len,
            inst.name,
            inst.pod_memory_gib()
        );
    }
    // The fewest nodes that reach the target (ties: the faster); when none
    // does, the fewest nodes within NEAR_BEST of the best throughput.
    let nodes = |l: &Layout| l.expert_workers + l.attention_workers;
    let pick = |threshold: f64| {
        layouts
            .iter()
            .filter(|(_, e)| e.tokens_per_s() >= threshold)
            .min_by(|(la, ea), (lb, eb)| {
                nodes(la)
                    .cmp(&nodes(lb))
                    .then(eb.tokens_per_s().total_cmp(&ea.tokens_per_s()))
            })
            .cloned()
    };
    let (layout, at_batch, reachable) = match pick(target_tps) {
        Some((l, e)) => (l, e, true),
        None => {
            let best = layouts
                .iter()
                .map(|(_, e)| e.tokens_per_s())
                .fold(0.0, f64::max);
            let (l, e) = pick(NEAR_BEST * best).context("no layout evaluated")?;
            (l, e, false)
        }
    };

    let workers = layout.expert_workers;
    let slots_per_worker = if workers == 1 {
        m.experts
    } else if workers < min_workers {
        // Cold tier: every expert assigned once; more than fits.
        m.experts.div_ceil(workers)
    } else {
        let wanted = (m.experts as f64 * (1.0 + REDUNDANCY_TARGET)).ceil() as u64;
        wanted
            .div_ceil(workers)
            .min(capacity)
            .max(m.experts.div_ceil(workers))
    };
    let redundant_per_layer = (slots_per_worker * workers).saturating_sub(m.experts);
    let (coordinator_bytes, shard_bytes) = resident_bytes(m, kv_pool, layout.attention_workers);
    let mut batches = TABLE_BATCHES.to_vec();
    if !batches.contains(&batch) {
        batches.push(batch);
        batches.sort_unstable();
    }
    let table = batches
        .into_iter()
        .map(|b| estimate(m, inst, a, layout, b))
        .collect();
    let deployments = (target_tps / at_batch.tokens_per_s()).ceil().max(1.0) as u64;
    Ok(Plan {
        layout,
        slots_per_worker,
        redundant_per_layer,
        worker_expert_bytes: slots_per_worker.min(capacity) as f64 * per_slot,
        slot_capacity: capacity,
        held_fraction: ((capacity * workers) as f64 / m.experts as f64).min(1.0),
        coordinator_bytes,
        shard_bytes,
        kv_pool_bytes: kv_pool,
        at_batch,
        table,
        reachable,
        deployments,
    })
}
