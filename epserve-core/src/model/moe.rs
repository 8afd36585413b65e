//! The mixture-of-experts block, split the way the cluster runs it:
//!
//! 1. [`Router`] turns hidden states into `(topk_ids, topk_weights)` of
//!    *logical* experts; it never computes an expert.
//! 2. A [`Dispatcher`] moves the routed tokens to whoever holds the experts
//!    (here [`LocalDispatcher`]; a gRPC one lives in the coordinator) and an
//!    [`ExpertExecutor`] runs them; experts never route.
//! 3. [`combine`] sums the weighted per-slot outputs in a fixed order, so the
//!    result does not depend on where the experts ran.

use std::sync::Arc;

use rayon::prelude::*;

use crate::config::{Activation, ModelConfig};
use crate::error::{Error, Result};
use crate::kernels::{gated, linear, sigmoid, softmax};
use crate::loader::weights::WeightStore;
use crate::tensor::Weight;

/// Marks a slot that the receiving executor must skip (not its expert).
pub const SKIP_SLOT: u32 = u32::MAX;

/// How router logits become top-k experts and weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterKind {
    /// softmax over all experts (f32), top-k, optionally renormalized over
    /// the k (Qwen2/3-MoE, OLMoE, Mixtral).
    SoftmaxTopK { normalize: bool },
    /// top-k of the raw logits, softmax over the k (GPT-OSS; logits carry the
    /// router bias).
    TopKSoftmax,
    /// softmax; groups ranked by their best expert; experts outside the best
    /// `topk_group` groups zeroed; top-k; weights times `scaling` (DeepSeek-V2).
    GroupedSoftmax {
        n_group: usize,
        topk_group: usize,
        scaling: f32,
    },
    /// sigmoid; choice scores add the correction bias; groups ranked by the sum
    /// of their two best choice scores; top-k in the best `topk_group` groups;
    /// weights are the sigmoid scores, optionally renormalized, times
    /// `scaling` (DeepSeek-V3).
    GroupedSigmoid {
        n_group: usize,
        topk_group: usize,
        normalize: bool,
        scaling: f32,
    },
    /// softmax, top-k, renormalized, times a per-expert scale (Gemma 4; the
    /// input is scaled first, see [`Router::with_input_scale`]).
    ScaledSoftmax,
}

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

/// The gate of an MoE layer.
pub struct Router {
    weight: Weight,
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
            weight,
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
        let mut logits = vec![0.0f32; rows * e];
        linear(x, rows, &self.weight, self.bias.as_deref(), &mut logits);
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

/// A gated feed-forward network: `down(act(gate(x)) * up(x))`, with optional
/// biases on each projection.
pub struct GatedMlp {
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
    pub activation: Activation,
    /// GPT-OSS experts, DeepSeek-V2 with `mlp_bias`.
    pub gate_bias: Option<Vec<f32>>,
    pub up_bias: Option<Vec<f32>>,
    pub down_bias: Option<Vec<f32>>,
}

impl GatedMlp {
    /// Loads `{prefix}.gate_proj/up_proj/down_proj` of width `inter`.
    pub fn load(
        ws: &WeightStore,
        prefix: &str,
        hidden: usize,
        inter: usize,
        act: Activation,
    ) -> Result<Self> {
        Self::load_with_bias(ws, prefix, hidden, inter, act, false)
    }

    /// Like [`load`](Self::load), with `.bias` tensors on every projection when `bias`.
    pub fn load_with_bias(
        ws: &WeightStore,
        prefix: &str,
        hidden: usize,
        inter: usize,
        act: Activation,
        bias: bool,
    ) -> Result<Self> {
        let b = |name: &str, n: usize| -> Result<Option<Vec<f32>>> {
            if bias {
                ws.get_vec(&format!("{prefix}.{name}.bias"), n).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(GatedMlp {
            gate: ws.get(&format!("{prefix}.gate_proj.weight"), &[inter, hidden])?,
            up: ws.get(&format!("{prefix}.up_proj.weight"), &[inter, hidden])?,
            down: ws.get(&format!("{prefix}.down_proj.weight"), &[hidden, inter])?,
            activation: act,
            gate_bias: b("gate_proj", inter)?,
            up_bias: b("up_proj", inter)?,
            down_bias: b("down_proj", hidden)?,
        })
    }

    /// Width of the hidden activation.
    pub fn intermediate(&self) -> usize {
        self.gate.shape()[0]
    }

    /// Applies the MLP to `[rows, hidden]` and writes `[rows, hidden]`.
    pub fn forward(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        let inter = self.intermediate();
        let mut g = vec![0.0f32; rows * inter];
        let mut u = vec![0.0f32; rows * inter];
        linear(x, rows, &self.gate, self.gate_bias.as_deref(), &mut g);
        linear(x, rows, &self.up, self.up_bias.as_deref(), &mut u);
        for (gv, uv) in g.iter_mut().zip(&u) {
            *gv = gated(self.activation, *gv, *uv);
        }
        linear(&g, rows, &self.down, self.down_bias.as_deref(), out);
    }
}

/// The experts one executor holds for one layer (`None` = held elsewhere).
pub struct LayerExperts {
    pub experts: Vec<Option<GatedMlp>>,
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
    ) -> Result<()>;
}

/// Moves routed tokens to the experts and brings back the per-slot outputs.
pub trait Dispatcher: Send + Sync {
    /// Returns `[rows, top_k, hidden]` weighted expert outputs.
    fn dispatch(
        &self,
        layer: usize,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
    ) -> Result<Vec<f32>>;
}

/// Experts held in this process, the plain portable executor.
pub struct LocalExperts {
    layers: Vec<Option<LayerExperts>>,
    hidden: usize,
}

impl LocalExperts {
    /// Wraps per-layer expert sets (`None` for layers without experts).
    pub fn new(layers: Vec<Option<LayerExperts>>, hidden: usize) -> Self {
        LocalExperts { layers, hidden }
    }

    /// Loads every expert of every MoE layer of the model.
    pub fn load_all(cfg: &ModelConfig, ws: &WeightStore) -> Result<Self> {
        Self::load_filtered(cfg, ws, |_, _| true)
    }

    /// Loads the experts for which `keep(layer, expert)` holds.
    pub fn load_filtered(
        cfg: &ModelConfig,
        ws: &WeightStore,
        keep: impl Fn(usize, usize) -> bool,
    ) -> Result<Self> {
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, spec) in cfg.layers.iter().enumerate() {
            if spec.ffn != crate::config::FfnKind::Moe {
                layers.push(None);
                continue;
            }
            let mut experts = Vec::with_capacity(cfg.num_experts);
            let names = crate::model::names::ExpertNames::resolve(cfg, ws, i)?;
            for e in 0..cfg.num_experts {
                experts.push(if keep(i, e) {
                    Some(names.load(cfg, ws, e)?)
                } else {
                    None
                });
            }
            layers.push(Some(LayerExperts { experts }));
        }
        Ok(LocalExperts::new(layers, cfg.hidden_size))
    }
}

impl ExpertExecutor for LocalExperts {
    fn execute(
        &self,
        layer: usize,
        x: &[f32],
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let h = self.hidden;
        let rows = x.len() / h;
        let le = self
            .layers
            .get(layer)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| Error::Dispatch(format!("layer {layer} has no experts here")))?;
        // Group slots by expert (ascending expert id, then token order).
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); le.experts.len()];
        for (slot, &id) in topk_ids.iter().enumerate().take(rows * top_k) {
            if id == SKIP_SLOT {
                continue;
            }
            let list = by_expert.get_mut(id as usize).ok_or_else(|| {
                Error::Dispatch(format!("layer {layer}: expert id {id} out of range"))
            })?;
            list.push(slot);
        }
        let results: Vec<Result<(usize, Vec<f32>)>> = by_expert
            .par_iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .map(|(e, slots)| {
                let mlp = le.experts[e].as_ref().ok_or_else(|| {
                    Error::Dispatch(format!(
                        "layer {layer}: expert {e} is not held by this executor"
                    ))
                })?;
                let n = slots.len();
                let mut xs = Vec::with_capacity(n * h);
                for &s in slots {
                    let t = s / top_k;
                    xs.extend_from_slice(&x[t * h..(t + 1) * h]);
                }
                let mut ys = vec![0.0f32; n * h];
                mlp.forward(&xs, n, &mut ys);
                Ok((e, ys))
            })
            .collect();
        for r in results {
            let (e, ys) = r?;
            for (i, &s) in by_expert[e].iter().enumerate() {
                let w = topk_weights[s];
                for (o, y) in out[s * h..(s + 1) * h]
                    .iter_mut()
                    .zip(&ys[i * h..(i + 1) * h])
                {
                    *o = w * y;
                }
            }
        }
        Ok(())
    }
}

/// Runs experts in this process.
pub struct LocalDispatcher {
    executor: Arc<dyn ExpertExecutor>,
}

impl LocalDispatcher {
    /// A dispatcher that calls `executor` directly.
    pub fn new(executor: Arc<dyn ExpertExecutor>) -> Self {
        LocalDispatcher { executor }
    }
}

impl Dispatcher for LocalDispatcher {
    fn dispatch(
        &self,
        layer: usize,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
    ) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; routing.num_tokens * routing.top_k * hidden];
        self.executor.execute(
            layer,
            x,
            &routing.topk_ids,
            &routing.topk_weights,
            routing.top_k,
            &mut out,
        )?;
        Ok(out)
    }
}

/// `y[t] = Σ_k slot_out[t, k]` (weights already applied), in slot order.
pub fn combine(slot_out: &[f32], rows: usize, top_k: usize, hidden: usize, y: &mut [f32]) {
    for t in 0..rows {
        let dst = &mut y[t * hidden..(t + 1) * hidden];
        dst.fill(0.0);
        for s in 0..top_k {
            let src = &slot_out[(t * top_k + s) * hidden..(t * top_k + s + 1) * hidden];
            for (d, v) in dst.iter_mut().zip(src) {
                *d += v;
            }
        }
    }
}

/// A shared expert that every token passes through, optionally scaled by a
/// sigmoid gate (Qwen2-MoE).
pub struct SharedExpert {
    pub mlp: GatedMlp,
    pub gate: Option<Weight>,
}

impl SharedExpert {
    /// Adds `gate(x) · mlp(x)` to `y`.
    pub fn add_to(&self, x: &[f32], rows: usize, y: &mut [f32]) {
        let h = self.mlp.down.shape()[0];
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

impl MoeBlock {
    /// Routes, dispatches, combines. Returns the routing for tracing.
    pub fn forward(
        &self,
        layer: usize,
        x: &[f32],
        rows: usize,
        hidden: usize,
        dispatcher: &dyn Dispatcher,
        y: &mut [f32],
    ) -> Result<Routing> {
        self.forward_split(layer, x, x, rows, hidden, dispatcher, y)
    }

    /// Like [`forward`](Self::forward), but the router reads `router_x` while
    /// the experts (and shared expert) read `x` (Gemma 4 routes on the
    /// un-normalized residual).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_split(
        &self,
        layer: usize,
        router_x: &[f32],
        x: &[f32],
        rows: usize,
        hidden: usize,
        dispatcher: &dyn Dispatcher,
        y: &mut [f32],
    ) -> Result<Routing> {
        let routing = self.router.route(router_x, rows);
        let slots = dispatcher.dispatch(layer, x, hidden, &routing)?;
        combine(&slots, rows, routing.top_k, hidden, y);
        if let Some(sh) = &self.shared {
            sh.add_to(x, rows, y);
        }
        Ok(routing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topk_orders_and_breaks_ties_low_first() {
        let mut o = Vec::new();
        top_k_indices(&[0.1, 0.5, 0.5, 0.2, 0.9], 3, &mut o);
        assert_eq!(o, vec![4, 1, 2]);
        top_k_indices(&[0.3], 1, &mut o);
        assert_eq!(o, vec![0]);
    }

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
