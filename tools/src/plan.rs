//! `epserve plan`: a capacity planner. From a model's `config.json` and an EC2
//! Graviton instance type it works out the memory and bandwidth arithmetic of
//! serving the model with expert parallelism: bytes per expert, active
//! parameters per token, KV bytes per token; how many expert-workers and
//! attention-workers, experts per worker and redundant slots; and the expected
//! decode throughput by batch size, printed as a table and optionally written
//! as a values file for the Helm chart (`deploy/helm/epserve`).
//!
//! The throughput model is a roofline over one decode step with every stage
//! run one after another (no overlap of attention, experts and network):
//!
//! ```text
//! step(B) = coordinator + attention shards + expert-workers + network bytes + round trips
//! stage   = max(bytes streamed / memory bandwidth, flops / compute)
//! experts touched per MoE layer = E · (1 − (1 − k/E)^B)   (uniform routing)
//! tokens/s = B / step(B)
//! ```
//!
//! Every number the model rests on (instance memory, bandwidth, network,
//! compute per vCPU) is in the tables and constants below with its source or
//! the assumption behind it.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use epserve_core::config::ModelConfig;

pub mod calibrate;
mod hardware;
mod model;
mod output;
pub mod overlap;
pub mod simulate;
mod sizing;

pub use hardware::{GRAVITON3, GRAVITON4, Generation, Instance};
pub use model::{ModelShape, expected_touched};
pub use output::{helm_values, render_report};
pub use sizing::{
    Assumptions, ColdTier, Layout, Plan, StepEstimate, cold_tier_touch, estimate, make_plan,
};

/// Bytes in a GiB.
pub(crate) const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// `epserve plan`.
#[derive(Debug, Clone, Args)]
pub struct PlanArgs {
    /// Hugging Face model folder (only config.json is read).
    #[arg(long, env = "EPSERVE_MODEL", required_unless_present = "node_model")]
    pub model: Option<PathBuf>,
    /// EC2 instance type of every node, e.g. c8g.16xlarge, r8g.24xlarge, c7g.16xlarge
    /// (families c7g m7g r7g c8g m8g r8g), or `local`: this machine running a
    /// loopback cluster (`epserve up`; needs --calibration).
    #[arg(long, default_value = "c8g.16xlarge")]
    pub instance: String,
    /// Aggregate decode throughput to reach, in output tokens per second.
    #[arg(long, required_unless_present_any = ["node_model", "simulate"])]
    pub target_output_tps: Option<f64>,
    /// How the expert-workers store expert weights (int8: W8A8, one f32 scale per output row).
    #[arg(long, value_enum, default_value_t = ExpertDtype::Bf16)]
    pub expert_dtype: ExpertDtype,
    /// Element type of the KV cache (the engine's paged cache stores f32 today).
    #[arg(long, value_enum, default_value_t = KvDtype::F32)]
    pub kv_dtype: KvDtype,
    /// Sequences decoded together in one step (the coordinator's --max-num-seqs).
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Average tokens in context (prompt + generated so far) of a decoding sequence.
    #[arg(long, default_value_t = 1024)]
    pub context_len: usize,
    /// One network round trip coordinator → worker → coordinator, in microseconds
    /// (same-AZ VPC with a small gRPC message; a cluster placement group gets lower).
    #[arg(long, default_value_t = 100.0)]
    pub rtt_us: f64,
    /// Most one TCP flow carries, Gbps (the coordinator reaches each worker
    /// over one HTTP/2 connection): EC2 caps a flow at 5 Gbps, 10 Gbps inside
    /// a cluster placement group.
    #[arg(long, default_value_t = 5.0)]
    pub flow_gbps: f64,
    /// Activations on the coordinator-worker wire, as the coordinator's
    /// `--dispatch-dtype`: workers return one combined vector per token
    /// (bf16, or f32 with the f32 wire).
    #[arg(long, value_enum, default_value_t = WireDtype::Bf16)]
    pub dispatch_dtype: WireDtype,
    /// Share of the peak DRAM bandwidth a streaming kernel reaches (STREAM triad
    /// reaches ~0.8 on Graviton).
    #[arg(long, default_value_t = 0.8)]
    pub mem_bw_efficiency: f64,
    /// Write a values file for the Helm chart (deploy/helm/epserve) to FILE.
    #[arg(long, value_name = "FILE")]
    pub helm_values: Option<PathBuf>,
    /// Print the node model as JSON and exit: per instance type the allocatable
    /// CPU and memory of an EKS node (deploy/README.md's kubelet settings) and
    /// what one Guaranteed pod can request next to the DaemonSets (the chart's
    /// test checks every pod against it).
    #[arg(long, conflicts_with_all = ["model", "target_output_tps", "helm_values"])]
    pub node_model: bool,
    /// Simulate decode steps of a given cluster instead of planning one:
    /// skewed routing (--zipf), replicated hot experts (--redundant), the
    /// slowest worker of each layer; prints TPOT and tokens/s by batch.
    #[arg(long, requires = "nodes", conflicts_with_all = ["target_output_tps", "helm_values"])]
    pub simulate: bool,
    /// Nodes of the simulated cluster (coordinator + attention-workers + expert-workers).
    #[arg(long)]
    pub nodes: Option<u64>,
    /// Attention-workers of the simulated cluster (0: attention in the coordinator).
    #[arg(long, default_value_t = 0)]
    pub attention_workers: u64,
    /// Zipf exponent of expert popularity in each layer (0 = uniform routing):
    /// the simulated routing, and the hit rate of a cold tier.
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Most expert-workers the cluster may have. When the experts need more
    /// memory than that, each worker holds what fits (`--expert-memory`, the
    /// hottest experts) and the plan has a cold tier: the rest are read from
    /// the worker's disk and packed on use, at a predicted cost per step.
    #[arg(long, value_name = "N")]
    pub max_expert_workers: Option<u64>,
    /// Disk read rate of a worker for cold experts, GB/s (EBS gp3 reaches up
    /// to 1; instance-store NVMe several).
    #[arg(long, default_value_t = 1.0)]
    pub cold_read_gbps: f64,
    /// Packing rate of one vCPU, GB/s of packed expert (measured 4.3 for bf16
    /// on one x86 core by `pack_timing`; int8 quantization is ~2).
    #[arg(long, default_value_t = 4.0)]
    pub pack_gbps_per_vcpu: f64,
    /// Redundant expert slots per MoE layer in the simulated placement.
    #[arg(long, default_value_t = 0)]
    pub redundant: u64,
    /// Simulated steps per batch size.
    #[arg(long, default_value_t = 20)]
    pub sim_steps: usize,
    /// Seed of the simulated routing.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Measured rates instead of the assumed ones: the JSON of `epserve bench
    /// moe --json` run on the target instance type (bandwidth, the decode
    /// kernels' share of it, bf16 / int8 expert compute per vCPU).
    #[arg(long, value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// The coordinator's /metrics text saved from a cluster run (`curl
    /// .../metrics > FILE`): the measured per-layer dispatch overhead (mean
    /// dispatch time less the workers' compute) replaces --rtt-us.
    #[arg(long, value_name = "FILE")]
    pub dispatch_metrics: Option<PathBuf>,
    /// The coordinator's /metrics of a `--micro-batches 1` cluster run (one
    /// scrape after it, or two: before and after): its measured phase times
    /// (step, coordinator busy, workers busy) and what ping-ponged
    /// micro-batches gain on the planned nodes, printed after the plan.
    #[arg(long, value_name = "FILE", num_args = 1..=2, conflicts_with_all = ["simulate", "node_model"])]
    pub phase_metrics: Vec<PathBuf>,
    /// The same scrapes of a `--micro-batches auto` (or 2) run of the same
    /// traffic: the overlap it achieved against the ideal becomes the
    /// prediction's efficiency (without it: the ideal overlap).
    #[arg(long, value_name = "FILE", num_args = 1..=2, requires = "phase_metrics")]
    pub overlap_metrics: Vec<PathBuf>,
}

/// Storage of expert weights on the expert-workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExpertDtype {
    Bf16,
    Int8,
}

impl ExpertDtype {
    pub(crate) fn name(self) -> &'static str {
        match self {
            ExpertDtype::Bf16 => "bf16",
            ExpertDtype::Int8 => "int8",
        }
    }
}

/// Activation element type on the coordinator-worker wire
/// (`coordinator --dispatch-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WireDtype {
    Bf16,
    F32,
    Int8,
}

impl WireDtype {
    /// Bytes of one token's hidden state sent to a worker: int8 carries
    /// one f32 scale per token.
    pub(crate) fn out_bytes(self, hidden: u64) -> f64 {
        match self {
            WireDtype::Bf16 => 2.0 * hidden as f64,
            WireDtype::F32 => 4.0 * hidden as f64,
            WireDtype::Int8 => hidden as f64 + 4.0,
        }
    }
    /// Bytes of one token's combined partial sum coming back from a worker
    /// (int8 inputs come back as bf16).
    pub(crate) fn back_bytes(self, hidden: u64) -> f64 {
        match self {
            WireDtype::F32 => 4.0 * hidden as f64,
            WireDtype::Bf16 | WireDtype::Int8 => 2.0 * hidden as f64,
        }
    }
    pub(crate) fn name(self) -> &'static str {
        match self {
            WireDtype::Bf16 => "bf16",
            WireDtype::F32 => "f32",
            WireDtype::Int8 => "int8",
        }
    }
}

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvDtype {
    F32,
    Bf16,
}

impl KvDtype {
    pub(crate) fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
        }
    }
    /// The engine's element type of the same name.
    pub(crate) fn engine(self) -> epserve_core::model::kv_cache::KvDtype {
        match self {
            KvDtype::F32 => epserve_core::model::kv_cache::KvDtype::F32,
            KvDtype::Bf16 => epserve_core::model::kv_cache::KvDtype::Bf16,
        }
    }
}

/// Reads the model's config and the instance, plans, prints, writes values.
pub fn run(args: &PlanArgs) -> Result<()> {
    if args.node_model {
        println!(
            "{}",
            serde_json::to_string_pretty(&hardware::node_model_json())?
        );
        return Ok(());
    }
    let Some(model) = &args.model else {
        bail!("--model is required (or --node-model)");
    };
    let cfg = ModelConfig::from_dir(model)?;
    let raw = read_raw(model)?;
    let shape = ModelShape::from_config(&cfg, &raw);
    let mut inst = Instance::lookup(&args.instance)?;
    if !inst.managed && args.calibration.is_none() {
        bail!(
            "--instance local needs --calibration (epserve bench moe --json on this machine): its bandwidth and compute are not in the tables"
        );
    }
    if !(args.mem_bw_efficiency > 0.0 && args.mem_bw_efficiency <= 1.0) {
        bail!(
            "--mem-bw-efficiency must be in (0, 1] (got {})",
            args.mem_bw_efficiency
        );
    }
    if !(args.rtt_us >= 0.0 && args.rtt_us.is_finite()) {
        bail!("--rtt-us must be zero or positive (got {})", args.rtt_us);
    }
    if !(args.flow_gbps > 0.0 && args.flow_gbps.is_finite()) {
        bail!("--flow-gbps must be positive (got {})", args.flow_gbps);
    }
    if args.context_len == 0 {
        bail!("--context-len must be at least 1");
    }
    let mut a = Assumptions {
        expert_dtype: args.expert_dtype,
        kv_dtype: args.kv_dtype,
        context_len: args.context_len as u64,
        rtt_s: args.rtt_us * 1e-6,
        flow_bps: args.flow_gbps * 1e9,
        mem_bw_efficiency: args.mem_bw_efficiency,
        wire_dtype: args.dispatch_dtype,
        cold: ColdTier {
            max_expert_workers: args.max_expert_workers,
            zipf: args.zipf,
            read_bps: args.cold_read_gbps * 1e9,
            pack_bps_per_vcpu: args.pack_gbps_per_vcpu * 1e9,
        },
    };
    for (v, flag) in [
        (args.cold_read_gbps, "--cold-read-gbps"),
        (args.pack_gbps_per_vcpu, "--pack-gbps-per-vcpu"),
    ] {
        if !(v > 0.0 && v.is_finite()) {
            bail!("{flag} must be positive (got {v})");
        }
    }
    if !(args.zipf >= 0.0 && args.zipf.is_finite()) {
        bail!("--zipf must be zero or positive (got {})", args.zipf);
    }
    if let Some(path) = &args.calibration {
        let c = calibrate::Calibration::read(path)?;
        c.apply(&mut inst, &mut a);
        println!("{}", c.describe());
    }
    if let Some(path) = &args.dispatch_metrics {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: reading the metrics", path.display()))?;
        let Some(s) = calibrate::dispatch_overhead_s(&text) else {
            bail!(
                "{}: no epserve_dispatch_seconds in it (scrape a coordinator that served requests)",
                path.display()
            );
        };
        a.rtt_s = s;
        println!(
            "calibrated  per-layer dispatch overhead {:.0} us (measured in {}; replaces --rtt-us)",
            s * 1e6,
            path.display()
        );
    }
    let overlap = if args.phase_metrics.is_empty() {
        None
    } else {
        let sync = overlap::Phases::read(&args.phase_metrics)?;
        let overlapped = if args.overlap_metrics.is_empty() {
            None
        } else {
            Some(overlap::Phases::read(&args.overlap_metrics)?)
        };
        Some(overlap::Overlap { sync, overlapped })
    };
    let batch = args.batch as u64;
    if args.simulate {
        if !(args.zipf >= 0.0 && args.zipf.is_finite()) {
            bail!("--zipf must be zero or positive (got {})", args.zipf);
        }
        let spec = simulate::SimSpec {
            nodes: args.nodes.unwrap_or(0),
            attention_workers: args.attention_workers,
            zipf: args.zipf,
            redundant: args.redundant,
            steps: args.sim_steps,
            seed: args.seed,
            batches: vec![1, 8, 32, batch.max(1)],
        };
        let rows = simulate::simulate(&shape, &inst, &a, &spec)?;
        print!("{}", simulate::render(&shape, &inst, &spec, &rows));
        return Ok(());
    }
    let Some(target_output_tps) = args.target_output_tps else {
        bail!("--target-output-tps is required (or --simulate / --node-model)");
    };
    let plan = make_plan(&shape, &inst, &a, target_output_tps, batch)?;
    print!(
        "{}",
        render_report(&shape, &inst, &a, &plan, target_output_tps, batch)
    );
    if let Some(o) = &overlap {
        // The plan's batches and the measured run's tokens per step (a
        // prefill-heavy run's chunks counted as that many sequences).
        let mut batches: Vec<u64> = plan.table.iter().map(|e| e.batch).collect();
        let measured = o.sync.tokens_per_step.round().max(1.0) as u64;
        if !batches.contains(&measured) {
            batches.push(measured);
            batches.sort_unstable();
        }
        let rows: Vec<_> = batches
            .into_iter()
            .map(|b| o.predict(&shape, &inst, &a, plan.layout, b))
            .collect();
        println!();
        print!("{}", o.render(&rows, &inst));
    }
    if let Some(path) = &args.helm_values {
        let text = helm_values(&shape, &inst, &a, &plan, args);
        std::fs::write(path, text)
            .with_context(|| format!("{}: writing values", path.display()))?;
        println!("wrote Helm values to {}", path.display());
    }
    Ok(())
}

fn read_raw(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("{}: reading", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: parsing", path.display()))
}

#[cfg(test)]
mod tests;
