//! The model's side of the mixture-of-experts block (the contracts it talks
//! through are in [`crate::moe`]):
//!
//! 1. [`Router`] turns hidden states into a [`Routing`] of *logical* experts;
//!    it never computes an expert. How is the config's [`RouterKind`];
//!    [`Router::load`] builds it from the checkpoint with whatever that kind
//!    needs.
//! 2. A [`Dispatcher`] moves the routed tokens to whoever holds the experts
//!    (in process the experts' `LocalDispatcher`; a gRPC one lives in the
//!    coordinator), which run them; experts never route.
//!    The dispatcher sums each token's weighted expert outputs in a fixed
//!    order ([`crate::moe::combine`]) and brings back one vector per token.
//! 3. [`SharedExpert`] adds the expert every token passes through, and
//!    [`MoeBlock`] is the three steps for one layer, in two phases
//!    ([`MoeBlock::submit`], then [`MoePending::finish`]) so the shared expert
//!    (and, in the model's staged layer loop, the next micro-batch's
//!    attention) runs while the experts do.

use std::sync::Arc;

use crate::config::{ModelConfig, RouterKind};
use crate::error::{Error, Result};
use crate::kernels::{linear, sigmoid, softmax};
use crate::loader::names::router_weight_and_module;
use crate::loader::weights::WeightStore;
use crate::model::linear::{DenseMlp, Linear};
use crate::moe::{DispatchTiming, Dispatcher, PendingDispatch, Routing, RowFault, top_k_indices};
use crate::profile::{self, Phase};
use crate::tensor::Weight;

/// The gate of an MoE layer.
pub struct Router {
    /// `[experts, hidden]`, on the packed path (f32 activations and
    /// accumulation, as the plain path; only the summation order differs).
    weight: Linear,
    kind: RouterKind,
    top_k: usize,
    /// Added to the logits (GPT-OSS).
    bias: Option<Vec<f32>>,
    /// Added to the scores when choosing experts, not to the weights
    /// (DeepSeek-V3 `e_score_correction_bias`).
    score_bias: Option<Vec<f32>>,
    /// Gemma 4: the input is RMS-normalized without a weight (`eps`), then
    /// multiplied by this scale and by `hidden^-0.5`.
    input_scale: Option<(Vec<f32>, f32)>,
    /// Gemma 4: multiplies each chosen expert's weight.
    expert_scale: Option<Vec<f32>>,
}

impl Router {
    /// A router from its `[experts, hidden]` weight.
    pub fn new(weight: Weight, kind: RouterKind, top_k: usize) -> Self {
        Router {
            weight: Linear::new(weight),
            kind,
            top_k,
            bias: None,
            score_bias: None,
            input_scale: None,
            expert_scale: None,
        }
    }

    /// Adds a bias to the router logits.
    pub fn with_bias(mut self, bias: Option<Vec<f32>>) -> Self {
        self.bias = bias;
        self
    }

    /// Adds a bias to the scores used for choosing experts only.
    pub fn with_score_bias(mut self, bias: Option<Vec<f32>>) -> Self {
        self.score_bias = bias;
        self
    }

    /// Normalizes and scales the router input (Gemma 4).
    pub fn with_input_scale(mut self, scale: Vec<f32>, eps: f32) -> Self {
        self.input_scale = Some((scale, eps));
        self
    }

    /// Multiplies each chosen expert's weight by its scale (Gemma 4).
    pub fn with_expert_scale(mut self, scale: Option<Vec<f32>>) -> Self {
        self.expert_scale = scale;
        self
    }

    /// Loads the router of MoE layer `i` with everything its kind needs (GPT-OSS
    /// bias, DeepSeek-V3 score correction bias, Gemma 4 input and expert scales).
    pub fn load(cfg: &ModelConfig, ws: &WeightStore, i: usize) -> Result<Router> {
        let (weight, module) = router_weight_and_module(cfg, ws, i)?;
        let (e, h) = (cfg.num_experts, cfg.hidden_size);
        let router = Router::new(weight, cfg.router, cfg.num_experts_per_tok);
        let bias = |name: &str| -> Result<Option<Vec<f32>>> {
            Ok(ws
                .get_opt(&format!("{module}.{name}"), &[e])?
                .map(|w| w.to_f32_vec()))
        };
        Ok(match cfg.router {
            RouterKind::SoftmaxTopK { .. } | RouterKind::GroupedSoftmax { .. } => router,
            RouterKind::TopKSoftmax => router.with_bias(bias("bias")?),
            RouterKind::GroupedSigmoid { .. } => {
                router.with_score_bias(bias("e_score_correction_bias")?)
            }
            RouterKind::ScaledSoftmax => {
                // Gemma 4: `layers.{i}.router.{proj.weight, scale, per_expert_scale}`.
                let base = module.trim_end_matches(".proj").to_string();
                router
                    .with_input_scale(ws.get_vec(&format!("{base}.scale"), h)?, cfg.rms_norm_eps)
                    .with_expert_scale(Some(ws.get_vec(&format!("{base}.per_expert_scale"), e)?))
            }
        })
    }

    /// Number of logical experts.
    pub fn num_experts(&self) -> usize {
        self.weight.shape()[0]
    }

    /// Routes a `[rows, hidden]` batch.
    pub fn route(&self, x: &[f32], rows: usize) -> Routing {
        let e = self.num_experts();
        let scaled;
        let x = match &self.input_scale {
            Some((scale, eps)) => {
                let h = scale.len();
                let root = (h as f32).powf(-0.5);
                let mut v = x.to_vec();
                for row in v.chunks_mut(h) {
                    let ms = row.iter().map(|a| a * a).sum::<f32>() / h as f32;
                    let inv = (ms + eps).powf(-0.5);
                    for (a, s) in row.iter_mut().zip(scale) {
                        *a = *a * inv * s * root;
                    }
                }
                scaled = v;
                &scaled[..]
            }
            None => x,
        };
        let _t =
            profile::timer(Phase::Router).work(|| (self.weight.bytes(), self.weight.macs(rows)));
        let mut logits = vec![0.0f32; rows * e];
        self.weight
            .forward(x, rows, self.bias.as_deref(), &mut logits);
        let k = self.top_k;
        let mut ids = Vec::with_capacity(rows * k);
        let mut weights = Vec::with_capacity(rows * k);
        let mut order: Vec<u32> = Vec::with_capacity(e);
        let mut groups: Vec<u32> = Vec::new();
        let mut choice = vec![0.0f32; e];
        for row in logits.chunks_mut(e) {
            match self.kind {
                RouterKind::SoftmaxTopK { normalize } => {
                    softmax(row);
                    top_k_indices(row, k, &mut order);
                    let sum: f32 = order.iter().map(|&i| row[i as usize]).sum();
                    for &i in &order {
                        ids.push(i);
                        let p = row[i as usize];
                        weights.push(if normalize { p / sum } else { p });
                    }
                }
                RouterKind::TopKSoftmax => {
                    top_k_indices(row, k, &mut order);
                    let mut top: Vec<f32> = order.iter().map(|&i| row[i as usize]).collect();
                    softmax(&mut top);
                    ids.extend_from_slice(&order);
                    weights.extend_from_slice(&top);
                }
                RouterKind::ScaledSoftmax => {
                    softmax(row);
                    top_k_indices(row, k, &mut order);
                    let sum: f32 = order.iter().map(|&i| row[i as usize]).sum();
                    for &i in &order {
                        ids.push(i);
                        let s = self.expert_scale.as_ref().map_or(1.0, |v| v[i as usize]);
                        weights.push(row[i as usize] / sum * s);
                    }
                }
                RouterKind::GroupedSoftmax {
                    n_group,
                    topk_group,
                    scaling,
                } => {
                    softmax(row);
                    // Group score: its best expert; experts of other groups drop to 0.
                    let per = e / n_group;
                    let gs: Vec<f32> = row
                        .chunks(per)
                        .map(|g| g.iter().copied().fold(f32::NEG_INFINITY, f32::max))
                        .collect();
                    top_k_indices(&gs, topk_group, &mut groups);
                    choice.copy_from_slice(row);
                    mask_groups(&mut choice, per, &groups, 0.0);
                    top_k_indices(&choice, k, &mut order);
                    for &i in &order {
                        ids.push(i);
                        weights.push(choice[i as usize] * scaling);
                    }
                }
                RouterKind::GroupedSigmoid {
                    n_group,
                    topk_group,
                    normalize,
                    scaling,
                } => {
                    for v in row.iter_mut() {
                        *v = sigmoid(*v);
                    }
                    for (i, c) in choice.iter_mut().enumerate() {
                        *c = row[i] + self.score_bias.as_ref().map_or(0.0, |b| b[i]);
                    }
                    // Group score: the sum of its two best choice scores.
                    let per = e / n_group;
                    let gs: Vec<f32> = choice
                        .chunks(per)
                        .map(|g| {
                            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                            for &v in g {
                                if v > a {
                                    b = a;
                                    a = v;
                                } else if v > b {
                                    b = v;
                                }
                            }
                            a + b
                        })
                        .collect();
                    top_k_indices(&gs, topk_group, &mut groups);
                    mask_groups(&mut choice, per, &groups, f32::NEG_INFINITY);
                    top_k_indices(&choice, k, &mut order);
                    let mut sum: f32 = order.iter().map(|&i| row[i as usize]).sum();
                    sum += 1e-20;
                    for &i in &order {
                        ids.push(i);
                        let w = row[i as usize];
                        weights.push(if normalize { w / sum } else { w } * scaling);
                    }
                }
            }
        }
        Routing {
            num_tokens: rows,
            top_k: k,
            topk_ids: ids,
            topk_weights: weights,
        }
    }
}

/// Sets the experts of groups not in `keep` to `fill`.
fn mask_groups(v: &mut [f32], per_group: usize, keep: &[u32], fill: f32) {
    for (g, chunk) in v.chunks_mut(per_group).enumerate() {
        if !keep.contains(&(g as u32)) {
            chunk.fill(fill);
        }
    }
}

/// A shared expert that every token passes through, optionally scaled by a
/// sigmoid gate (Qwen2-MoE).
pub struct SharedExpert {
    pub mlp: DenseMlp,
    pub gate: Option<Weight>,
}

impl SharedExpert {
    /// Adds `gate(x) · mlp(x)` to `y`.
    pub fn add_to(&self, x: &[f32], rows: usize, y: &mut [f32]) {
        let h = self.mlp.hidden();
        let mut s = vec![0.0f32; rows * h];
        self.mlp.forward(x, rows, &mut s);
        let mut g = vec![1.0f32; rows];
        if let Some(gw) = &self.gate {
            linear(x, rows, gw, None, &mut g);
            for v in &mut g {
                *v = sigmoid(*v);
            }
        }
        for t in 0..rows {
            for (d, v) in y[t * h..(t + 1) * h].iter_mut().zip(&s[t * h..(t + 1) * h]) {
                *d += g[t] * v;
            }
        }
    }
}

/// One MoE layer's coordinator-side half: router and shared expert.
pub struct MoeBlock {
    pub router: Router,
    pub shared: Option<SharedExpert>,
}

/// An MoE layer whose experts are in flight ([`MoeBlock::submit`]).
pub struct MoePending {
    pending: PendingDispatch,
    routing: Arc<Routing>,
    /// The shared expert's output, computed while the experts ran.
    shared: Option<Vec<f32>>,
}

impl MoePending {
    /// Waits for the experts and writes `experts(x) + shared(x)` to `y`
    /// (`[rows, hidden]`); returns the routing (for tracing), the rows whose
    /// experts could not all be reached and how a remote dispatch went.
    pub fn finish(self, y: &mut [f32]) -> Result<MoeDone> {
        let done = {
            let _t = profile::timer(Phase::Experts);
            self.pending.wait()?
        };
        if done.y.len() != y.len() {
            return Err(Error::Dispatch(format!(
                "experts returned {} values for {} expected",
                done.y.len(),
                y.len()
            )));
        }
        y.copy_from_slice(&done.y);
        if let Some(s) = &self.shared {
            for (d, v) in y.iter_mut().zip(s) {
                *d += v;
            }
        }
        Ok(MoeDone {
            routing: self.routing,
            faults: done.faults,
            timing: done.timing,
        })
    }
}

/// What a finished MoE layer reports besides its output.
pub struct MoeDone {
    pub routing: Arc<Routing>,
    pub faults: Vec<RowFault>,
    pub timing: Option<DispatchTiming>,
}

impl MoeBlock {
    /// Routes `router_x` and submits `x` to the experts, then computes the
    /// shared expert while they run; [`MoePending::finish`] brings the sum.
    /// The router reads `router_x` while the experts (and shared expert)
    /// read `x` (Gemma 4 routes on the un-normalized residual; other models
    /// pass the same rows twice).
    pub fn submit(
        &self,
        layer: usize,
        router_x: &[f32],
        x: Arc<[f32]>,
        rows: usize,
        hidden: usize,
        dispatcher: &dyn Dispatcher,
    ) -> Result<MoePending> {
        let routing = Arc::new(self.router.route(router_x, rows));
        let pending = dispatcher.submit(layer, x.clone(), hidden, routing.clone())?;
        let shared = self.shared.as_ref().map(|sh| {
            let _t = profile::timer(Phase::Shared).work(|| sh.mlp.work(rows));
            let mut s = vec![0.0f32; rows * hidden];
            sh.add_to(&x, rows, &mut s);
            s
        });
        Ok(MoePending {
            pending,
            routing,
            shared,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_normalizes_when_asked() {
        let w = Weight::from_f32(vec![3, 2], &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        let r = Router::new(w.clone(), RouterKind::SoftmaxTopK { normalize: true }, 2);
        let out = r.route(&[1.0, 2.0], 1);
        assert_eq!(out.topk_ids, vec![2, 1]);
        assert!((out.topk_weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let r = Router::new(w, RouterKind::SoftmaxTopK { normalize: false }, 2);
        let out = r.route(&[1.0, 2.0], 1);
        assert!(out.topk_weights.iter().sum::<f32>() < 0.99);
    }
}
