//! `epserve plan --phase-metrics FILE [--overlap-metrics FILE]`: the measured
//! phase times of a cluster run fed to the planner, to predict what
//! `--micro-batches` (the coordinator's ping-pong of two micro-batches, issue
//! 17) gains on separate nodes.
//!
//! A synchronous step (`--micro-batches 1`) is the coordinator's own work A
//! (attention, routing, dense layers, the head: the step less its waits for
//! remote work) followed by the workers' E (expert compute) and the wire.
//! With two micro-batches ping-ponged through the layers, one micro-batch's
//! attention runs while the other's experts do, so the step approaches
//! `2 · max(A½, R½)`: each half's coordinator work A½ against its remote
//! part R½ (experts, wire and round trips). For prefill the halves are half
//! the work; for decode each half touches more than half of the experts a
//! whole batch touches, which is why `auto` keeps decode steps whole when
//! splitting loses.
//!
//! The measured run gives the phase split on the machine it ran on, and with
//! a second run (`--micro-batches auto`) how much of the ideal overlap the
//! implementation achieved (`efficiency`: achieved speedup over the ideal
//! `S / max(A, E)`). The prediction for the planned nodes applies that
//! efficiency to the planner's own stage times on the target instance type.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use super::calibrate::metric_sums;
use super::{Assumptions, Instance, Layout, ModelShape, estimate};

/// Phase times per scheduler step of one run, from the coordinator's
/// `/metrics`.
#[derive(Debug, Clone, PartialEq)]
pub struct Phases {
    pub source: String,
    pub steps: f64,
    /// Tokens (prefill chunks and decodes) per step.
    pub tokens_per_step: f64,
    /// The step, S (`epserve_step_seconds`).
    pub step_s: f64,
    /// The coordinator busy, A: the step less its waits for remote work
    /// (`epserve_step_wait_seconds`).
    pub busy_s: f64,
    /// The workers busy, E (`epserve_expert_worker_compute_seconds` per step:
    /// with several workers their compute in parallel is summed, so E is the
    /// total worker time, an upper bound of the critical path).
    pub worker_s: f64,
}

impl Phases {
    /// From one scrape taken after the run, or two (before and after: only
    /// the run's own steps count).
    pub fn parse(texts: &[(String, String)]) -> Result<Phases> {
        let (source, after) = match texts {
            [(p, a)] => (p.clone(), metric_sums(a)),
            [(p0, b), (p1, a)] => {
                let before = metric_sums(b);
                let mut after = metric_sums(a);
                for (k, v) in after.iter_mut() {
                    *v -= before.get(k).copied().unwrap_or(0.0);
                }
                (format!("{p1} less {p0}"), after)
            }
            _ => bail!("give one scrape (after the run) or two (before and after)"),
        };
        let get = |k: &str| after.get(k).copied().unwrap_or(0.0);
        let steps = get("epserve_step_seconds_count");
        if steps < 1.0 {
            bail!(
                "{source}: no scheduler steps (epserve_step_seconds_count): scrape a coordinator's /metrics after it served requests"
            );
        }
        let step_s = get("epserve_step_seconds_sum") / steps;
        let wait_s = get("epserve_step_wait_seconds_sum") / steps;
        let worker_s = get("epserve_expert_worker_compute_seconds_sum") / steps;
        let tokens_per_step = get("epserve_batch_size_tokens_sum") / steps;
        if !(step_s > 0.0 && step_s.is_finite()) {
            bail!("{source}: the steps took no time");
        }
        Ok(Phases {
            source,
            steps,
            tokens_per_step,
            step_s,
            busy_s: (step_s - wait_s).max(0.0),
            worker_s,
        })
    }

    /// Reads the files of `--phase-metrics` / `--overlap-metrics`.
    pub fn read(paths: &[PathBuf]) -> Result<Phases> {
        let texts = paths
            .iter()
            .map(|p| {
                std::fs::read_to_string(p)
                    .with_context(|| format!("{}: reading the metrics", p.display()))
                    .map(|t| (p.display().to_string(), t))
            })
            .collect::<Result<Vec<_>>>()?;
        Self::parse(&texts)
    }

    /// The ideal ping-pong step: the busier side.
    pub fn ideal_s(&self) -> f64 {
        self.busy_s.max(self.worker_s)
    }

    /// What the step spends on neither side's compute (wire, waits).
    pub fn rest_s(&self) -> f64 {
        (self.step_s - self.busy_s - self.worker_s).max(0.0)
    }

    /// Tokens per second of step time.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens_per_step / self.step_s
    }
}

/// The measured sync run and, optionally, the measured overlapped one.
#[derive(Debug, Clone)]
pub struct Overlap {
    pub sync: Phases,
    pub overlapped: Option<Phases>,
}

/// Predicted step of one batch on the planned nodes.
#[derive(Debug, Clone, PartialEq)]
pub struct OverlapRow {
    pub batch: u64,
    /// The whole batch's coordinator work (coordinator + attention stages).
    pub busy_s: f64,
    /// The whole batch's remote part (experts, cold tier, network, round trips).
    pub remote_s: f64,
    pub sync_s: f64,
    /// Two micro-batches ping-ponged, at the measured efficiency.
    pub split_s: f64,
}

impl OverlapRow {
    /// What `--micro-batches auto` picks: the split only where it wins.
    pub fn auto_s(&self) -> f64 {
        self.split_s.min(self.sync_s)
    }
}

impl Overlap {
    /// Ideal speedup of the sync run: S / max(A, E).
    pub fn ideal_speedup(&self) -> f64 {
        self.sync.step_s / self.sync.ideal_s().max(f64::MIN_POSITIVE)
    }

    /// Achieved speedup of the overlapped run: its tokens per second of
    /// step time over the sync run's.
    pub fn achieved_speedup(&self) -> Option<f64> {
        let o = self.overlapped.as_ref()?;
        let s = self.sync.tokens_per_s();
        (s > 0.0 && o.tokens_per_s() > 0.0).then(|| o.tokens_per_s() / s)
    }

    /// Share of the ideal overlap achieved (1 without a measured overlapped
    /// run: the prediction is then the ideal).
    pub fn efficiency(&self) -> f64 {
        match self.achieved_speedup() {
            Some(a) => (a / self.ideal_speedup()).clamp(0.05, 1.0),
            None => 1.0,
        }
    }

    /// The sync step and the split step of `batch` sequences on `layout`.
    pub fn predict(
        &self,
        m: &ModelShape,
        inst: &Instance,
        a: &Assumptions,
        layout: Layout,
        batch: u64,
    ) -> OverlapRow {
        let whole = estimate(m, inst, a, layout, batch);
        let busy = |e: &super::StepEstimate| e.coordinator_s + e.attention_s;
        let remote = |e: &super::StepEstimate| e.experts_s + e.cold_s + e.network_s + e.latency_s;
        let sync_s = whole.step_s();
        let split_s = if batch < 2 {
            sync_s
        } else {
            // Two halves (the larger one bounds); each half runs its own
            // round trips, so they count twice.
            let half = estimate(m, inst, a, layout, batch.div_ceil(2));
            2.0 * busy(&half).max(remote(&half)) / self.efficiency()
        };
        OverlapRow {
            batch,
            busy_s: busy(&whole),
            remote_s: remote(&whole),
            sync_s,
            split_s,
        }
    }

    /// The report's overlap section.
    pub fn render(&self, rows: &[OverlapRow], inst: &Instance) -> String {
        let mut s = String::new();
        let p = &self.sync;
        let _ = writeln!(
            s,
            "overlap     measured in {} ({:.0} steps of {:.0} tokens, --micro-batches 1): step S {:.1} ms = coordinator busy A {:.1} + workers busy E {:.1} + the rest {:.1}; ideal ping-pong max(A, E) {:.1} ms, {:.2}x",
            p.source,
            p.steps,
            p.tokens_per_step,
            p.step_s * 1e3,
            p.busy_s * 1e3,
            p.worker_s * 1e3,
            p.rest_s() * 1e3,
            p.ideal_s() * 1e3,
            self.ideal_speedup()
        );
        match (&self.overlapped, self.achieved_speedup()) {
            (Some(o), Some(a)) => {
                let _ = writeln!(
                    s,
                    "            ping-pong measured in {} ({:.0} steps of {:.0} tokens): {:.2}x the sync run's tokens per second of step time, {:.0} % of the ideal: the efficiency below",
                    o.source,
                    o.steps,
                    o.tokens_per_step,
                    a,
                    100.0 * self.efficiency()
                );
            }
            _ => {
                let _ = writeln!(
                    s,
                    "            no overlapped run given (--overlap-metrics): the prediction below is the ideal overlap"
                );
            }
        }
        let _ = writeln!(
            s,
            "ping-pong on {} nodes (the planner's stages; two micro-batches at {:.0} % efficiency; auto keeps one where splitting loses)",
            inst.name,
            100.0 * self.efficiency()
        );
        let _ = writeln!(
            s,
            "{:>6} {:>10} {:>10} {:>9} {:>9} {:>9} {:>10} {:>10}",
            "batch",
            "coord ms",
            "remote ms",
            "sync ms",
            "split ms",
            "auto ms",
            "auto tok/s",
            "vs sync"
        );
        let measured = self.sync.tokens_per_step.round() as u64;
        for r in rows {
            let _ = writeln!(
                s,
                "{:>6} {:>10.2} {:>10.2} {:>9.2} {:>9.2} {:>9.2} {:>10.0} {:>9.2}x{}",
                r.batch,
                r.busy_s * 1e3,
                r.remote_s * 1e3,
                r.sync_s * 1e3,
                r.split_s * 1e3,
                r.auto_s() * 1e3,
                r.batch as f64 / r.auto_s(),
                r.sync_s / r.auto_s(),
                if r.batch == measured {
                    "  <- the measured run's tokens per step"
                } else {
                    ""
                }
            );
        }
        s
    }
}
