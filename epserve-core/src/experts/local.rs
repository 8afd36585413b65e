//! The portable reference executor: [`LocalExperts`] runs each expert as a
//! plain [`GatedMlp`] (weights stay in the mmap, f32 compute through
//! [`crate::kernels`]), grouped by expert on rayon; [`LocalDispatcher`] hands
//! routed tokens straight to an executor in this process. The fast
//! [`PackedExperts`](crate::experts::PackedExperts) is checked against
//! [`LocalExperts`].

use std::sync::Arc;

use rayon::prelude::*;

use crate::config::{FfnKind, ModelConfig};
use crate::error::{Error, Result};
use crate::loader::names::ExpertNames;
use crate::loader::weights::WeightStore;
use crate::moe::mlp::GatedMlp;
use crate::moe::{
    Dispatched, Dispatcher, ExpertExecutor, ExpertState, PendingDispatch, Routing, Rows, SKIP_SLOT,
    combine,
};
use crate::profile::{self, Phase};
use crate::tensor::DType;

/// The experts one executor holds for one layer (`None` = held elsewhere).
pub struct LayerExperts {
    pub experts: Vec<Option<GatedMlp>>,
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
            if spec.ffn != FfnKind::Moe {
                layers.push(None);
                continue;
            }
            let mut experts = Vec::with_capacity(cfg.num_experts);
            let names = ExpertNames::resolve(cfg, ws, i)?;
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
    fn expert_states(&self) -> Vec<ExpertState> {
        let mut out = Vec::new();
        for (layer, le) in self.layers.iter().enumerate() {
            let Some(le) = le else { continue };
            for (expert, mlp) in le.experts.iter().enumerate() {
                if let Some(mlp) = mlp {
                    out.push(ExpertState {
                        layer,
                        expert,
                        tier: "mapped",
                        precision: match mlp.gate.dtype() {
                            DType::F32 => "f32",
                            DType::BF16 => "bf16",
                            DType::F16 => "f16",
                        },
                    });
                }
            }
        }
        out
    }

    /// Computes from the mapped weights in f32: `x.int8` is not read.
    fn execute_rows(
        &self,
        layer: usize,
        x: Rows<'_>,
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let x = x.f32;
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

/// Most bytes of per-slot outputs a thread keeps for its next
/// [`SlotOutputs`]. Below 32 MiB the allocator reuses freed memory by
/// itself ([`crate::mem::tune_malloc`]); above, every call would map a fresh
/// buffer and fault it in a zeroed page at a time (a 2048-token prefill step
/// of a top-8, hidden-2048 model needs 128 MiB: about 6 % of its experts'
/// time went to those faults).
const KEPT_SLOT_BYTES: usize = 512 << 20;

thread_local! {
    /// The buffer of this thread's last [`SlotOutputs`], reused by its next.
    static SLOTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The `[rows, top_k, hidden]` per-slot output buffer an
/// [`ExpertExecutor::execute`] writes, reused per thread: only the slots of
/// `topk_ids` marked [`SKIP_SLOT`] are zeroed (an executor overwrites every
/// other slot, so the rest may hold an earlier call's values; zeroing them
/// all would cost about as much as the faults it saves). Dropping it hands
/// the buffer back to its thread (up to 512 MiB).
pub struct SlotOutputs(Vec<f32>);

impl SlotOutputs {
    /// A buffer of `topk_ids.len() * hidden` floats for these slots.
    pub fn new(topk_ids: &[u32], hidden: usize) -> Self {
        let len = topk_ids.len() * hidden;
        let mut out = SLOTS
            .try_with(|s| s.try_borrow_mut().map(|mut s| std::mem::take(&mut *s)))
            .ok()
            .and_then(|r| r.ok())
            .unwrap_or_default();
        // Keeps what is there; only growth is zeroed.
        out.resize(len, 0.0);
        for (slot, _) in topk_ids
            .iter()
            .enumerate()
            .filter(|(_, id)| **id == SKIP_SLOT)
        {
            out[slot * hidden..(slot + 1) * hidden].fill(0.0);
        }
        SlotOutputs(out)
    }
}

impl std::ops::Deref for SlotOutputs {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl std::ops::DerefMut for SlotOutputs {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}

impl Drop for SlotOutputs {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        if v.capacity() * std::mem::size_of::<f32>() <= KEPT_SLOT_BYTES {
            // A thread being torn down, or a second buffer alive on it,
            // simply frees this one.
            let _ = SLOTS.try_with(|s| {
                if let Ok(mut s) = s.try_borrow_mut()
                    && s.capacity() < v.capacity()
                {
                    *s = v;
                }
            });
        }
    }
}

/// Runs `routing`'s experts of `layer` on `x` in this process: per-slot
/// outputs, then [`combine`] in slot order (one vector per token).
pub fn execute_combined(
    executor: &dyn ExpertExecutor,
    layer: usize,
    x: &[f32],
    hidden: usize,
    routing: &Routing,
) -> Result<Vec<f32>> {
    let rows = routing.num_tokens;
    let mut out = SlotOutputs::new(&routing.topk_ids, hidden);
    {
        let _t = profile::timer(Phase::Experts);
        executor.execute(
            layer,
            x,
            &routing.topk_ids,
            &routing.topk_weights,
            routing.top_k,
            &mut out,
        )?;
    }
    let _t = profile::timer(Phase::Combine);
    let mut y = vec![0.0f32; rows * hidden];
    combine(&out, rows, routing.top_k, hidden, &mut y);
    Ok(y)
}

impl Dispatcher for LocalDispatcher {
    /// Runs the experts now (the handle is ready): per-slot outputs, then
    /// [`combine`] in slot order.
    #[tracing::instrument(
        level = "debug",
        name = "dispatch",
        skip_all,
        fields(layer = layer, tokens = routing.num_tokens)
    )]
    fn submit(
        &self,
        layer: usize,
        x: Arc<[f32]>,
        hidden: usize,
        routing: Arc<Routing>,
    ) -> Result<PendingDispatch> {
        let y = execute_combined(self.executor.as_ref(), layer, &x, hidden, &routing)?;
        Ok(PendingDispatch::ready(Ok(Dispatched {
            y,
            faults: Vec::new(),
            timing: None,
        })))
    }

    fn wants_prefetch(&self) -> bool {
        self.executor.wants_prefetch()
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        self.executor.prefetch(layer, experts)
    }
}
