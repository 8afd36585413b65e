//! `epserve plan --calibration FILE`: the planner's rates measured instead of
//! assumed. FILE is `epserve bench moe --json` run on the target instance
//! type (with `--threads 0` among its thread counts, i.e. every core):
//!
//! - memory bandwidth: the streaming read bandwidth at the most threads,
//!   per thread, times the pod's vCPUs (capped at the socket's peak);
//! - the share of it a decode kernel reaches: the mean `bandwidth_pct` of
//!   the bf16 rows of at most 16 tokens at the most threads (replaces
//!   `--mem-bw-efficiency`);
//! - bf16 and int8 expert compute: the best GFLOP/s of the rows of at least
//!   64 tokens at the most threads, per thread.
//!
//! The report says which figures came from the file and which stayed
//! assumptions.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use super::{Assumptions, Instance};

#[derive(Debug, Deserialize)]
struct Machine {
    threads: usize,
    bandwidth_gbps: f64,
}

#[derive(Debug, Deserialize)]
struct Row {
    tokens: usize,
    dtype: String,
    threads: usize,
    #[serde(default)]
    bandwidth_pct: f64,
    #[serde(default)]
    gflops: f64,
}

#[derive(Debug, Deserialize)]
struct BenchMoe {
    kernel: String,
    machine: Vec<Machine>,
    rows: Vec<Row>,
}

/// Sum of every sample of each metric in a Prometheus text scrape over all
/// its label sets (`name_sum` / `name_count` of a histogram, a counter's
/// value); comment and unparsable lines are skipped.
pub(super) fn metric_sums(text: &str) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let Some((key, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        let name = key.split('{').next().unwrap_or(key).trim();
        *out.entry(name.to_string()).or_insert(0.0) += v;
    }
    out
}

/// Per-layer dispatch overhead measured by a cluster run: from the
/// coordinator's `/metrics` text, the mean `epserve_dispatch_seconds` (one
/// MoE layer's dispatch and combine, all workers) less the mean
/// `epserve_expert_worker_compute_seconds` (the workers' own compute), in
/// seconds. None when the scrape has no dispatches.
pub fn dispatch_overhead_s(metrics: &str) -> Option<f64> {
    let sums = metric_sums(metrics);
    let mean = |name: &str| {
        let get = |k: String| sums.get(&k).copied().unwrap_or(0.0);
        let (sum, count) = (get(format!("{name}_sum")), get(format!("{name}_count")));
        (count > 0.0).then(|| sum / count)
    };
    let dispatch = mean("epserve_dispatch_seconds")?;
    let compute = mean("epserve_expert_worker_compute_seconds").unwrap_or(0.0);
    Some((dispatch - compute).max(0.0))
}

/// Rates measured by `epserve bench moe` on one machine.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    pub source: String,
    pub kernel: String,
    pub threads: usize,
    /// Streaming read bandwidth with `threads` threads, GB/s.
    pub bandwidth_gbps: f64,
    /// Share of it the bf16 decode rows reached (0..1].
    pub decode_share: Option<f64>,
    /// Expert compute per thread, GFLOP/s (bf16) and GOP/s (int8).
    pub bf16_gflops_per_thread: Option<f64>,
    pub int8_gops_per_thread: Option<f64>,
}

impl Calibration {
    /// Reads `epserve bench moe --json` output.
    pub fn read(path: &Path) -> Result<Calibration> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: reading the calibration", path.display()))?;
        Self::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, source: &str) -> Result<Calibration> {
        let b: BenchMoe = serde_json::from_str(text)
            .with_context(|| format!("{source}: not the JSON of `epserve bench moe --json`"))?;
        let Some(m) = b
            .machine
            .iter()
            .filter(|m| m.bandwidth_gbps.is_finite() && m.bandwidth_gbps > 0.0)
            .max_by_key(|m| m.threads)
        else {
            bail!("{source}: no machine entry with a measured bandwidth");
        };
        let at = |dtype: &str, keep: &dyn Fn(&Row) -> bool| -> Vec<&Row> {
            b.rows
                .iter()
                .filter(|r| r.threads == m.threads && r.dtype == dtype && keep(r))
                .collect()
        };
        let decode = at("bf16", &|r| r.tokens <= 16 && r.bandwidth_pct > 0.0);
        let decode_share = (!decode.is_empty()).then(|| {
            let mean = decode.iter().map(|r| r.bandwidth_pct).sum::<f64>() / decode.len() as f64;
            (mean / 100.0).clamp(0.05, 1.0)
        });
        let best = |dtype: &str| {
            at(dtype, &|r| r.tokens >= 64 && r.gflops > 0.0)
                .iter()
                .map(|r| r.gflops / m.threads as f64)
                .fold(None, |a: Option<f64>, x| Some(a.map_or(x, |a| a.max(x))))
        };
        Ok(Calibration {
            source: source.to_string(),
            kernel: b.kernel,
            threads: m.threads.max(1),
            bandwidth_gbps: m.bandwidth_gbps,
            decode_share,
            bf16_gflops_per_thread: best("bf16"),
            int8_gops_per_thread: best("int8"),
        })
    }

    /// Puts the measured rates into the instance and the assumptions.
    pub fn apply(&self, inst: &mut Instance, a: &mut Assumptions) {
        let managed = inst.managed;
        let g = &mut inst.generation;
        let per_vcpu = self.bandwidth_gbps / self.threads as f64;
        // Bandwidth scales with the pod's vCPUs up to the socket's peak (this
        // machine, `--instance local`: what was measured is the peak).
        g.peak_gbs_per_socket = if managed {
            (per_vcpu * f64::from(g.cores_per_socket)).min(g.peak_gbs_per_socket)
        } else {
            per_vcpu * f64::from(g.cores_per_socket)
        };
        if let Some(x) = self.bf16_gflops_per_thread {
            g.gflops_bf16_per_vcpu = x;
        }
        if let Some(x) = self.int8_gops_per_thread {
            g.gops_int8_per_vcpu = x;
        }
        if let Some(s) = self.decode_share {
            a.mem_bw_efficiency = s;
        }
    }

    /// One line for the report: what was measured, what stayed assumed.
    pub fn describe(&self) -> String {
        let opt = |x: Option<f64>, unit: &str| {
            x.map_or("not in the file (assumed)".to_string(), |v| {
                format!("{v:.1} {unit}")
            })
        };
        format!(
            "calibrated  from {} (kernel {}, {} threads): measured {:.1} GB/s read bandwidth ({:.2} GB/s per vCPU), \
             decode share of it {}, bf16 experts {}, int8 experts {}; assumed: network, round trips, uniform routing",
            self.source,
            self.kernel,
            self.threads,
            self.bandwidth_gbps,
            self.bandwidth_gbps / self.threads as f64,
            self.decode_share
                .map_or("not in the file (assumed)".to_string(), |s| format!(
                    "{:.0}%",
                    s * 100.0
                )),
            opt(self.bf16_gflops_per_thread, "GFLOP/s per vCPU"),
            opt(self.int8_gops_per_thread, "GOP/s per vCPU"),
        )
    }
}
