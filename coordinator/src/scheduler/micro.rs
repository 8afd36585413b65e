//! `--micro-batches N|auto`: into how many micro-batches a step's sequences
//! are split, so that (in a cluster) one micro-batch's attention runs on the
//! coordinator while another's experts run on the workers
//! ([`Model::forward_micro`](epserve_core::model::Model::forward_micro)).
//!
//! Splitting is not free on CPUs: two micro-batches of 8 decode tokens touch
//! more distinct experts than one batch of 16, so the workers read more
//! bytes, and each micro-batch pays the fixed cost of a round trip. `auto`
//! predicts both ways per step from what the steps so far measured:
//!
//! - the coordinator's busy time per MoE layer, `A(t) = a0 + a1·t` for `t`
//!   tokens (least squares over recent steps: the step's time minus the time
//!   it waited for remote work);
//! - a dispatch's worker compute time, `c = g + α·D + β·t` for `t` rows
//!   touching `D` distinct experts (least squares over recent dispatches, as
//!   the workers report it), plus the network and queueing overhead of a
//!   call (the rest of its wall time);
//! - the distinct experts `n` tokens touch, `D(n) = ρ·E·(1 − (1 − k/E)^n)`
//!   (uniform routing over `E` experts with top-`k`, scaled by `ρ`, the
//!   measured ratio of distinct experts to that prediction, < 1 for skewed
//!   routing).
//!
//! One batch costs `A(t) + E(t)` per layer; two micro-batches of `t/2`
//! overlap in a ping-pong costing `2·max(A(t/2), E(t/2))`. `auto` splits
//! when that is at least [`GAIN`] cheaper, and never in a single process
//! (local experts finish eagerly: nothing to overlap).

use std::collections::VecDeque;
use std::str::FromStr;
use std::time::Duration;

use epserve_core::moe::DispatchTiming;

/// `--micro-batches`: a fixed count, or decided per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MicroBatches {
    Fixed(usize),
    #[default]
    Auto,
}

impl FromStr for MicroBatches {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(MicroBatches::Auto);
        }
        match s.parse::<usize>() {
            Ok(n) if (1..=MAX_MICRO_BATCHES).contains(&n) => Ok(MicroBatches::Fixed(n)),
            _ => Err(format!(
                "expected `auto` or a number of micro-batches in 1..={MAX_MICRO_BATCHES}, got `{s}`"
            )),
        }
    }
}

impl std::fmt::Display for MicroBatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MicroBatches::Fixed(n) => write!(f, "{n}"),
            MicroBatches::Auto => f.write_str("auto"),
        }
    }
}

/// Most micro-batches a step may be split into.
pub const MAX_MICRO_BATCHES: usize = 16;
/// `auto` splits when the predicted step is at least this much cheaper.
pub const GAIN: f64 = 0.93;
/// Samples kept for the fits.
const WINDOW: usize = 256;
/// Steps and dispatches seen before `auto` trusts its fits (the ridge keeps
/// early fits tame; a burst of long prompts arrives in the first steps).
const WARMUP: usize = 8;

/// Decides each step's micro-batch count and learns from the steps run.
#[derive(Debug)]
pub struct MicroPolicy {
    mode: MicroBatches,
    /// Layers with experts (a step waits once per layer and micro-batch).
    moe_layers: usize,
    experts: usize,
    top_k: usize,
    /// (tokens, coordinator busy seconds per MoE layer).
    busy: VecDeque<(f64, f64)>,
    /// (distinct experts, rows, worker compute seconds).
    compute: VecDeque<(f64, f64, f64)>,
    /// Wall minus compute of a call, seconds (EWMA, single-batch steps).
    overhead: Option<f64>,
    /// Measured distinct experts over the uniform prediction (EWMA).
    rho: f64,
    /// Whether any dispatch was remote (auto splits only then).
    remote: bool,
}

/// What `auto` predicted for one step (seconds per MoE layer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    pub one: f64,
    pub two: f64,
    /// Coordinator busy time of the whole batch and worker phase (compute
    /// and overhead) of the whole batch and of half of it.
    pub a: f64,
    pub e: f64,
    pub e_half: f64,
}

impl MicroPolicy {
    pub fn new(mode: MicroBatches, moe_layers: usize, experts: usize, top_k: usize) -> Self {
        MicroPolicy {
            mode,
            moe_layers: moe_layers.max(1),
            experts: experts.max(1),
            top_k: top_k.max(1),
            busy: VecDeque::new(),
            compute: VecDeque::new(),
            overhead: None,
            rho: 1.0,
            remote: false,
        }
    }

    /// The mode in force.
    pub fn mode(&self) -> MicroBatches {
        self.mode
    }

    /// Micro-batches for a step of `seqs` sequences and `tokens` tokens.
    pub fn choose(&self, seqs: usize, tokens: usize) -> usize {
        match self.mode {
            MicroBatches::Fixed(n) => n.min(seqs.max(1)),
            MicroBatches::Auto => {
                let p = self.predict(seqs, tokens);
                let n = match p {
                    Some(p) if p.two < GAIN * p.one => 2,
                    _ => 1,
                };
                tracing::debug!(seqs, tokens, prediction = ?p, micro_batches = n, "micro-batches");
                n
            }
        }
    }

    /// The prediction behind `auto` (None until it has enough samples, in a
    /// single process, or for a single sequence).
    pub fn predict(&self, seqs: usize, tokens: usize) -> Option<Prediction> {
        if !self.remote || seqs < 2 || self.busy.len() < WARMUP || self.compute.len() < WARMUP {
            return None;
        }
        let t = tokens as f64;
        let [a0, a1] = fit2(&self.busy)?;
        let [g, alpha, beta] = fit3(&self.compute)?;
        let overhead = self.overhead.unwrap_or(0.0);
        let a = |n: f64| (a0 + a1 * n).max(0.0);
        let e = |n: f64| (g + alpha * self.distinct(n) + beta * n).max(0.0) + overhead;
        let (a_all, e_all, e_half) = (a(t), e(t), e(t / 2.0));
        Some(Prediction {
            one: a_all + e_all,
            two: 2.0 * a(t / 2.0).max(e_half),
            a: a_all,
            e: e_all,
            e_half,
        })
    }

    /// Distinct experts `n` tokens are predicted to touch.
    fn distinct(&self, n: f64) -> f64 {
        let e = self.experts as f64;
        let k = (self.top_k as f64).min(e);
        (self.rho * e * (1.0 - (1.0 - k / e).powf(n))).min(e)
    }

    /// Learns from a step: its tokens, how many micro-batches it ran, its
    /// wall time, the time it waited for remote work, and its dispatches.
    pub fn observe(
        &mut self,
        tokens: usize,
        micro_batches: usize,
        step: Duration,
        waited: Duration,
        timings: &[DispatchTiming],
    ) {
        if timings.is_empty() {
            return;
        }
        self.remote = true;
        let busy = step.saturating_sub(waited).as_secs_f64() / self.moe_layers as f64;
        push(&mut self.busy, (tokens as f64, busy));
        for d in timings {
            let c = d.compute.as_secs_f64();
            push(
                &mut self.compute,
                (d.distinct_experts as f64, d.rows as f64, c),
            );
            let uniform = {
                let e = self.experts as f64;
                let k = (self.top_k as f64).min(e);
                e * (1.0 - (1.0 - k / e).powf(d.rows as f64))
            };
            if uniform > 0.0 && d.rows > 0 {
                let r = (d.distinct_experts as f64 / uniform).clamp(0.05, 1.0);
                self.rho = 0.95 * self.rho + 0.05 * r;
            }
            // Queueing behind the other micro-batch's call is not the link's
            // cost: learn it from single-batch steps only.
            if micro_batches == 1 {
                let o = d.wall.saturating_sub(d.compute).as_secs_f64();
                self.overhead = Some(match self.overhead {
                    None => o,
                    Some(x) => 0.9 * x + 0.1 * o,
                });
            }
        }
    }
}

fn push<T>(v: &mut VecDeque<T>, x: T) {
    if v.len() == WINDOW {
        v.pop_front();
    }
    v.push_back(x);
}

/// Least squares `y = p0 + p1·x` with a small ridge on the slope.
fn fit2(s: &VecDeque<(f64, f64)>) -> Option<[f64; 2]> {
    let rows: Vec<([f64; 2], f64)> = s.iter().map(|&(x, y)| ([1.0, x], y)).collect();
    solve(&rows)
}

/// Least squares `y = p0 + p1·x1 + p2·x2` with a small ridge on the slopes.
fn fit3(s: &VecDeque<(f64, f64, f64)>) -> Option<[f64; 3]> {
    let rows: Vec<([f64; 3], f64)> = s.iter().map(|&(a, b, y)| ([1.0, a, b], y)).collect();
    solve(&rows)
}

#[allow(clippy::needless_range_loop)] // index arithmetic over a small matrix
/// Ridge-regularized normal equations, solved by Gaussian elimination with
/// partial pivoting. The columns are scaled to unit mean square first, so the
/// ridge is relative; a degenerate column (every sample alike) then gets a
/// slope near zero instead of an arbitrary one.
fn solve<const N: usize>(rows: &[([f64; N], f64)]) -> Option<[f64; N]> {
    if rows.is_empty() {
        return None;
    }
    let mut scale = [1.0f64; N];
    for (j, sc) in scale.iter_mut().enumerate() {
        let ms = rows.iter().map(|(x, _)| x[j] * x[j]).sum::<f64>() / rows.len() as f64;
        if ms > 0.0 {
            *sc = ms.sqrt();
        }
    }
    let mut m = [[0.0f64; N]; N];
    let mut v = [0.0f64; N];
    for (x, y) in rows {
        for i in 0..N {
            let xi = x[i] / scale[i];
            v[i] += xi * y;
            for j in 0..N {
                m[i][j] += xi * x[j] / scale[j];
            }
        }
    }
    // Ridge on the slopes (not the intercept, column 0).
    let lambda = 1e-3 * rows.len() as f64;
    for (i, row) in m.iter_mut().enumerate().skip(1) {
        row[i] += lambda;
    }
    // Gaussian elimination.
    for c in 0..N {
        let p = (c..N).max_by(|&a, &b| m[a][c].abs().total_cmp(&m[b][c].abs()))?;
        if m[p][c].abs() < 1e-12 {
            return None;
        }
        m.swap(c, p);
        v.swap(c, p);
        for r in 0..N {
            if r != c {
                let f = m[r][c] / m[c][c];
                for k in c..N {
                    m[r][k] -= f * m[c][k];
                }
                v[r] -= f * v[c];
            }
        }
    }
    let mut out = [0.0f64; N];
    for i in 0..N {
        out[i] = v[i] / m[i][i] / scale[i];
        if !out[i].is_finite() {
            return None;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: f64) -> Duration {
        Duration::from_secs_f64(x / 1e3)
    }

    #[test]
    fn parses_auto_and_counts() {
        assert_eq!("auto".parse(), Ok(MicroBatches::Auto));
        assert_eq!("2".parse(), Ok(MicroBatches::Fixed(2)));
        assert!("0".parse::<MicroBatches>().is_err());
        assert!("x".parse::<MicroBatches>().is_err());
        assert_eq!(MicroBatches::Fixed(3).to_string(), "3");
    }

    #[test]
    fn fits_recover_linear_models() {
        let s: VecDeque<(f64, f64)> = (1..50).map(|t| (t as f64, 2.0 + 0.5 * t as f64)).collect();
        let [a, b] = fit2(&s).expect("fit");
        // The small ridge on the slope biases the fit a little.
        assert!((a - 2.0).abs() < 0.1 && (b - 0.5).abs() < 0.01, "{a} {b}");
        let s: VecDeque<(f64, f64, f64)> = (1..60)
            .map(|i| {
                let (d, t) = ((i % 7 + 3) as f64, (i * 3 % 40 + 1) as f64);
                (d, t, 1.0 + 0.25 * d + 0.1 * t)
            })
            .collect();
        let [g, al, be] = fit3(&s).expect("fit");
        assert!(
            (g - 1.0).abs() < 0.2 && (al - 0.25).abs() < 0.03 && (be - 0.1).abs() < 0.01,
            "{g} {al} {be}"
        );
    }

    /// Feeds `n` single-batch steps of `tokens` tokens on a simulated cluster:
    /// coordinator busy `a0 + a1·t` per layer, workers computing `g + α·D +
    /// β·t` with uniform routing over 128 experts, top-8.
    fn simulate(p: &mut MicroPolicy, tokens: &[usize], a: (f64, f64), c: (f64, f64, f64)) {
        for &t in tokens {
            let d = 128.0 * (1.0 - (1.0 - 8.0 / 128.0f64).powf(t as f64));
            let comp = c.0 + c.1 * d + c.2 * t as f64;
            let busy = a.0 + a.1 * t as f64;
            let timing = DispatchTiming {
                rows: t,
                distinct_experts: d.round() as usize,
                compute: ms(comp),
                wall: ms(comp + 0.1),
            };
            p.observe(
                t,
                1,
                ms((busy + comp + 0.1) * 4.0),
                ms((comp + 0.1) * 4.0),
                &[timing; 4],
            );
        }
    }

    #[test]
    fn auto_overlaps_balanced_prefill_and_stays_single_in_process() {
        // Prefill-heavy: coordinator and workers both compute-bound and
        // comparable: splitting hides about half.
        let mut p = MicroPolicy::new(MicroBatches::Auto, 4, 128, 8);
        assert_eq!(p.choose(16, 512), 1, "no samples yet");
        let ts: Vec<usize> = (0..40).map(|i| 64 + (i * 37) % 900).collect();
        simulate(&mut p, &ts, (0.2, 0.02), (0.1, 0.01, 0.03));
        let pr = p.predict(16, 512).expect("prediction");
        assert!(pr.two < pr.one, "{pr:?}");
        assert_eq!(p.choose(16, 512), 2, "{pr:?}");
        assert_eq!(p.choose(1, 512), 1, "one sequence cannot be split");
        // In a process: no remote dispatches, never split.
        let mut local = MicroPolicy::new(MicroBatches::Auto, 4, 128, 8);
        local.observe(512, 1, ms(10.0), ms(0.0), &[]);
        assert_eq!(local.choose(16, 512), 1);
        // Fixed counts are honoured up to one per sequence.
        let fixed = MicroPolicy::new(MicroBatches::Fixed(4), 4, 128, 8);
        assert_eq!(fixed.choose(3, 30), 3);
    }

    #[test]
    fn auto_keeps_bandwidth_bound_decode_whole_when_the_coordinator_is_cheap() {
        // Decode: workers read weights per distinct expert (α large, β
        // tiny); the coordinator is nearly idle: splitting only adds reads.
        let mut p = MicroPolicy::new(MicroBatches::Auto, 4, 128, 8);
        let ts: Vec<usize> = (0..40).map(|i| 4 + i % 28).collect();
        simulate(&mut p, &ts, (0.05, 0.001), (0.05, 0.05, 0.0005));
        let pr = p.predict(16, 16).expect("prediction");
        assert!(pr.two >= GAIN * pr.one, "{pr:?}");
        assert_eq!(p.choose(16, 16), 1);
    }
}
