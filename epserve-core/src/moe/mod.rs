//! The mixture-of-experts contracts. They sit below both the expert
//! executors (`experts`) and the model (`model`) and use neither. An MoE
//! block is split the way the cluster runs it:
//!
//! 1. A router (in the model) turns hidden states into a [`Routing`]:
//!    `(topk_ids, topk_weights)` of *logical* experts; it never computes an
//!    expert. [`top_k_indices`] is its selection step.
//! 2. A [`Dispatcher`] moves the routed tokens to whoever holds the experts and
//!    an [`ExpertExecutor`] runs them; experts never route. Slots marked
//!    [`SKIP_SLOT`] belong to another executor.
//! 3. [`combine`] sums the weighted per-slot outputs in a fixed order, so the
//!    result does not depend on where the experts ran.
//!
//! - [`mlp`]: [`mlp::GatedMlp`], the gated feed-forward every expert (and
//!   every dense MLP) is, and how one is assembled from a checkpoint's
//!   expert tensors.

pub mod mlp;

use std::sync::Arc;

use crate::error::Result;

/// Marks a slot that the receiving executor must skip (not its expert).
pub const SKIP_SLOT: u32 = u32::MAX;

/// The result of routing `num_tokens` tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Routing {
    pub num_tokens: usize,
    pub top_k: usize,
    /// `[num_tokens, top_k]` logical expert ids, best first.
    pub topk_ids: Vec<u32>,
    /// `[num_tokens, top_k]` combine weights.
    pub topk_weights: Vec<f32>,
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
pub fn top_k_indices(v: &[f32], k: usize, out: &mut Vec<u32>) {
    out.clear();
    out.extend(0..v.len() as u32);
    let cmp = |a: &u32, b: &u32| v[*b as usize].total_cmp(&v[*a as usize]).then(a.cmp(b));
    if k < out.len() {
        out.select_nth_unstable_by(k, cmp);
        out.truncate(k);
    }
    out.sort_by(cmp);
}

/// Runs experts. Given `[rows, hidden]` tokens and their `[rows, top_k]`
/// expert ids and weights, writes `weight · expert(x)` for every slot into
/// `out` (`[rows, top_k, hidden]`), leaving slots marked [`SKIP_SLOT`] untouched.
pub trait ExpertExecutor: Send + Sync {
    fn execute(
        &self,
        layer: usize,
        x: &[f32],
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let x = Rows { f32: x, int8: None };
        self.execute_rows(layer, x, topk_ids, topk_weights, top_k, out)
    }

    /// [`execute`](Self::execute) on rows that may come already quantized to
    /// int8 (the int8 wire): an executor whose int8 experts quantize their
    /// activations with [`quantize_row_i8`](crate::kernels::layout::quantize_row_i8)
    /// uses `x.int8` as it is instead of quantizing `x.f32` again; one
    /// without int8 experts reads `x.f32` only.
    fn execute_rows(
        &self,
        layer: usize,
        x: Rows<'_>,
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &mut [f32],
    ) -> Result<()>;

    /// Whether [`prefetch`](Self::prefetch) hints are used (experts held
    /// in tiers under a memory budget).
    fn wants_prefetch(&self) -> bool {
        false
    }

    /// Experts of `layer` a router lookahead predicts for a coming call
    /// (packed ahead by an executor with a cold tier). Returns at once.
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}

    /// Where each expert held here is kept and in what precision, in
    /// (layer, expert) order (what `epserve ctl load` shows); empty from an
    /// executor that does not say.
    fn expert_states(&self) -> Vec<ExpertState> {
        Vec::new()
    }
}

/// One expert's tier and precision on an executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertState {
    pub layer: usize,
    pub expert: usize,
    /// `resident` (packed, kept), `cached` (packed on use, evictable),
    /// `cold` (in the mapped checkpoint only, packed on use) or `mapped`
    /// (computed from the mapped checkpoint on every use: the portable
    /// executor).
    pub tier: &'static str,
    /// `bf16`, `int8`, `f16` or `f32`; for a cold expert, the precision it
    /// is packed in when next used.
    pub precision: &'static str,
}

/// `[rows, hidden]` activations for [`ExpertExecutor::execute_rows`].
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    /// The values (for int8 rows: their dequantization, `scale · q`).
    pub f32: &'a [f32],
    /// The same rows as int8, if they arrived so.
    pub int8: Option<QuantizedRows<'a>>,
}

/// Rows quantized as the W8A8 kernels quantize activations
/// ([`quantize_row_i8`](crate::kernels::layout::quantize_row_i8)):
/// `x[r, c] = scales[r] · q[r, c]`, `q` in `-127..=127`.
#[derive(Clone, Copy)]
pub struct QuantizedRows<'a> {
    /// `[rows, hidden]`, row-major.
    pub q: &'a [i8],
    /// One per row.
    pub scales: &'a [f32],
}

/// What one dispatch brings back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Dispatched {
    /// `[rows, hidden]`: `Σ_k weight · expert(x)` per token row.
    pub y: Vec<f32>,
    /// Rows (of this dispatch's input) whose experts could not all be
    /// reached (a remote expert with no live replica). A faulted row's output
    /// is wrong ([`RowFault::degraded`]: approximate), so the caller fails
    /// (or flags) the sequences those rows belong to while the other rows are
    /// exact. In-process dispatchers never lose a row.
    pub faults: Vec<RowFault>,
    /// How a remote dispatch went (None in process).
    pub timing: Option<DispatchTiming>,
}

/// The timing of one remote dispatch, for deciding how to split the next
/// steps into micro-batches.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DispatchTiming {
    /// Token rows dispatched.
    pub rows: usize,
    /// Distinct experts their slots used.
    pub distinct_experts: usize,
    /// The slowest worker's compute time, as it reported it.
    pub compute: std::time::Duration,
    /// From submit to the combined result (network, queueing, compute).
    pub wall: std::time::Duration,
}

/// A dispatch in flight: [`wait`](Self::wait) brings its result. Local
/// dispatchers finish eagerly and hand back a ready one; remote ones compute
/// elsewhere while the caller does other work (the next micro-batch's
/// attention, a shared expert).
#[must_use = "a submitted dispatch must be waited for"]
pub struct PendingDispatch(PendingInner);

enum PendingInner {
    Ready(Result<Dispatched>),
    Later(Box<dyn FnOnce() -> Result<Dispatched> + Send>),
}

impl PendingDispatch {
    /// A dispatch already finished.
    pub fn ready(r: Result<Dispatched>) -> Self {
        PendingDispatch(PendingInner::Ready(r))
    }

    /// A dispatch whose result `wait` produces (blocks the caller).
    pub fn later(wait: impl FnOnce() -> Result<Dispatched> + Send + 'static) -> Self {
        PendingDispatch(PendingInner::Later(Box::new(wait)))
    }

    /// Blocks until the experts' outputs are back.
    pub fn wait(self) -> Result<Dispatched> {
        match self.0 {
            PendingInner::Ready(r) => r,
            PendingInner::Later(f) => f(),
        }
    }
}

/// Moves routed tokens to the experts and brings back each token's combined
/// output, in two phases: [`submit`](Self::submit) starts the work and
/// returns at once where the experts are remote; the pending handle's `wait`
/// brings the result.
pub trait Dispatcher: Send + Sync {
    /// Starts the experts of `layer` on `x` (`[rows, hidden]`) as `routing`
    /// says.
    fn submit(
        &self,
        layer: usize,
        x: Arc<[f32]>,
        hidden: usize,
        routing: Arc<Routing>,
    ) -> Result<PendingDispatch>;

    /// Submits and waits.
    fn dispatch(
        &self,
        layer: usize,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
    ) -> Result<Dispatched> {
        self.submit(layer, Arc::from(x), hidden, Arc::new(routing.clone()))?
            .wait()
    }

    /// Whether the forward pass should send [`prefetch`](Self::prefetch)
    /// hints (some expert store behind this dispatcher has a cold tier).
    fn wants_prefetch(&self) -> bool {
        false
    }

    /// The experts of `layer` that a router lookahead (the router of `layer`
    /// applied to an earlier layer's input) predicts. Called before the
    /// submit of the earlier layer; a remote dispatcher sends it with that
    /// request.
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}

    /// A forward step starts: every dispatch until [`end_step`](Self::end_step)
    /// belongs to it (a remote dispatcher routes the whole step with one
    /// placement snapshot, whatever the order of its layers and micro-batches).
    fn begin_step(&self) {}

    /// The forward step that [`begin_step`](Self::begin_step) opened is over
    /// (finished or failed).
    fn end_step(&self) {}
}

/// A token row of a forward pass whose experts were not all computed.
#[derive(Debug, Clone, PartialEq)]
pub struct RowFault {
    /// Row in the flattened batch.
    pub row: usize,
    /// What happened, for the error message (names the layer and experts).
    pub message: String,
    /// True when the row was still computed, with its top-k renormalized over
    /// the live experts (`--on-expert-loss reroute`); false when it is lost.
    pub degraded: bool,
}

/// `y[t] = Σ_k slot_out[t, k]` (weights already applied), in slot order.
pub fn combine(slot_out: &[f32], rows: usize, top_k: usize, hidden: usize, y: &mut [f32]) {
    use rayon::prelude::*;
    if hidden == 0 {
        return;
    }
    let token = |(t, dst): (usize, &mut [f32])| {
        dst.fill(0.0);
        for s in 0..top_k {
            let src = &slot_out[(t * top_k + s) * hidden..(t * top_k + s + 1) * hidden];
            for (d, v) in dst.iter_mut().zip(src) {
                *d += v;
            }
        }
    };
    let y = &mut y[..rows * hidden];
    // Tokens in parallel when there is much to read (a prefill step's
    // per-slot outputs are hundreds of MiB); each token's sum keeps slot order.
    if rows > 1 && rows * top_k * hidden >= 1 << 18 {
        y.par_chunks_mut(hidden).enumerate().for_each(token);
    } else {
        y.chunks_mut(hidden).enumerate().for_each(token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tokens combined in parallel (many tokens) give the bits of each token
    /// combined alone, summed in slot order.
    #[test]
    fn combine_tokens_do_not_depend_on_the_batch() {
        let (rows, k, h) = (300, 4, 257);
        let slots: Vec<f32> = (0..rows * k * h)
            .map(|i| ((i * 40503) % 977) as f32 * 1e-3 - 0.3)
            .collect();
        let mut y = vec![f32::NAN; rows * h];
        combine(&slots, rows, k, h, &mut y);
        for t in 0..rows {
            let mut one = vec![f32::NAN; h];
            combine(&slots[t * k * h..(t + 1) * k * h], 1, k, h, &mut one);
            assert_eq!(&y[t * h..(t + 1) * h], &one[..], "token {t}");
            let want: f32 = (0..k)
                .map(|s| slots[(t * k + s) * h])
                .fold(0.0, |a, v| a + v);
            assert_eq!(one[0], want);
        }
    }

    #[test]
    fn topk_orders_and_breaks_ties_low_first() {
        let mut o = Vec::new();
        top_k_indices(&[0.1, 0.5, 0.5, 0.2, 0.9], 3, &mut o);
        assert_eq!(o, vec![4, 1, 2]);
        top_k_indices(&[0.3], 1, &mut o);
        assert_eq!(o, vec![0]);
    }
}
