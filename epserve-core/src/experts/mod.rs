//! The expert executors, the [`ExpertExecutor`]s behind the MoE contracts of
//! [`crate::moe`]. The fast one: experts repacked once at load into the
//! layout the MoE micro-kernels stream ([`crate::kernels::layout`]), bf16 or
//! int8 W8A8 per expert, run as grouped matrix products on a pinned thread
//! pool; the portable one: plain gated MLPs straight from the mmap.
//!
//! - [`packed`]: [`PackedExpert`] (fused gate/up + down, optional biases,
//!   activation) and load-time int8 quantization.
//! - [`executor`]: [`PackedExperts`], the [`ExpertExecutor`] `Model::load`
//!   uses by default.
//! - `load`: [`PackedExperts::load_filtered`], a checkpoint's experts packed
//!   in the precision asked for.
//! - `run`: the executor's work items and the tiles they run on (the AMX
//!   tile planning sits below, in `kernels/amx_plan.rs`).
//! - [`local`]: [`LocalExperts`], the portable reference twin, and
//!   [`LocalDispatcher`], which hands routed tokens to an executor in this
//!   process.
//! - [`pool`]: the pinned worker threads.
//! - here: [`LoadOptions`] and [`load_executor`], which picks and loads one.

pub mod executor;
mod load;
pub mod local;
pub mod packed;
pub mod pool;
pub(crate) mod run;
pub mod tiered;

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::loader::weights::WeightStore;
use crate::moe::ExpertExecutor;

pub use executor::PackedExperts;
pub use local::{LayerExperts, LocalDispatcher, LocalExperts, SlotOutputs, execute_combined};
pub use packed::{PackedExpert, PackedMatrix};
pub use pool::ExpertPool;
pub use tiered::{Tier, TierOptions, TierSnapshot, TieredExperts};

/// Precision the experts are kept in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ExpertDtype {
    /// bf16 when that is exact (bf16 checkpoints, or f32/f16 weights that are
    /// bf16-representable); otherwise the portable executor in the
    /// checkpoint's own dtype.
    #[default]
    Auto,
    /// bf16 weights (rounded if the checkpoint is f32/f16) and bf16
    /// activations on tiers with a bf16 dot-product instruction
    /// (`avx512-bf16`, `neon-bf16`; f32 activations elsewhere), f32
    /// accumulation.
    Bf16,
    /// int8 per-output-channel symmetric weights, int8 per-token activations,
    /// i32 accumulation (W8A8).
    Int8,
}

impl ExpertDtype {
    /// Parses `auto`, `bf16` or `int8`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(ExpertDtype::Auto),
            "bf16" | "bfloat16" => Some(ExpertDtype::Bf16),
            "int8" | "i8" | "w8a8" => Some(ExpertDtype::Int8),
            _ => None,
        }
    }

    /// The name [`parse`](Self::parse) accepts.
    pub fn name(self) -> &'static str {
        match self {
            ExpertDtype::Auto => "auto",
            ExpertDtype::Bf16 => "bf16",
            ExpertDtype::Int8 => "int8",
        }
    }
}

impl std::str::FromStr for ExpertDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        ExpertDtype::parse(s)
            .ok_or_else(|| format!("unknown expert dtype '{s}' (auto, bf16, int8)"))
    }
}

/// Precision of the dense projections outside the experts (attention q/k/v/o
/// and MLA input/output projections, dense MLPs, shared experts, the LM
/// head; routers stay exact).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DenseDtype {
    /// bf16 panels when the weights are bf16-exact, with f32 activations
    /// (exact); the plain path otherwise.
    #[default]
    Auto,
    /// bf16 panels with activations rounded to bf16 (as `--expert-dtype
    /// bf16`): the bf16 dot tile where the CPU has one (the decode path, and
    /// prefill where [`Kernels::bf16x_prefill`](crate::kernels::dispatch::Kernels::bf16x_prefill)
    /// or AMX), f32 activations elsewhere; f32 accumulation. Weights that
    /// are not bf16-exact stay as `auto` keeps them.
    Bf16,
    /// int8 W8A8: weights requantized per output channel at load,
    /// activations per row at each call.
    Int8,
}

impl DenseDtype {
    /// The name `--dense-dtype` takes.
    pub fn name(self) -> &'static str {
        match self {
            DenseDtype::Auto => "auto",
            DenseDtype::Bf16 => "bf16",
            DenseDtype::Int8 => "int8",
        }
    }
}

impl std::str::FromStr for DenseDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DenseDtype::Auto),
            "bf16" | "bfloat16" => Ok(DenseDtype::Bf16),
            "int8" | "i8" | "w8a8" => Ok(DenseDtype::Int8),
            _ => Err(format!("unknown dense dtype '{s}' (auto, bf16, int8)")),
        }
    }
}

/// Which executor runs the experts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ExecutorKind {
    /// [`PackedExperts`]: repacked weights, SIMD kernels, pinned pool.
    #[default]
    Packed,
    /// [`LocalExperts`]: the portable reference (weights stay in the mmap).
    Portable,
}

/// How a model's experts are loaded and run.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    pub executor: ExecutorKind,
    /// Default precision of every expert.
    pub expert_dtype: ExpertDtype,
    /// Precision of the dense projections outside the experts.
    pub dense_dtype: DenseDtype,
    /// Per-expert precision `(layer, expert) → dtype` (e.g. cold experts int8,
    /// hot ones bf16), overriding `expert_dtype`.
    pub expert_dtype_overrides: BTreeMap<(usize, usize), ExpertDtype>,
    /// Worker threads for the experts; `None` shares one process-wide pool
    /// with one thread per available core.
    pub threads: Option<usize>,
    /// Pin worker threads to cores (only for a dedicated pool: `threads` set).
    pub pin_threads: bool,
    /// Hold the experts under a memory budget ([`TieredExperts`]): resident,
    /// cached and cold tiers. `None` packs every expert into RAM.
    pub tier: Option<TierOptions>,
}

impl LoadOptions {
    /// The precision asked for expert `e` of `layer`.
    pub fn dtype_for(&self, layer: usize, e: usize) -> ExpertDtype {
        self.expert_dtype_overrides
            .get(&(layer, e))
            .copied()
            .unwrap_or(self.expert_dtype)
    }
}

/// Loads every expert of the model into the executor `opts` asks for.
pub fn load_executor(
    cfg: &ModelConfig,
    ws: &WeightStore,
    opts: &LoadOptions,
) -> Result<Arc<dyn ExpertExecutor>> {
    load_executor_filtered(cfg, ws, opts, |_, _| true)
}

/// What [`load_executor_shared`] loads: the executor, and the same one as a
/// [`TieredExperts`] when it has tiers.
pub type LoadedExperts = (Arc<dyn ExpertExecutor>, Option<Arc<TieredExperts>>);

/// [`load_executor_filtered`] for callers that share the weights: with
/// [`LoadOptions::tier`] the experts go into a [`TieredExperts`] (which
/// packs cold experts from `ws` later, so it keeps a handle), otherwise as
/// [`load_executor_filtered`] loads them. Also returns the tiered executor,
/// for its counters.
pub fn load_executor_shared(
    cfg: &ModelConfig,
    ws: &Arc<WeightStore>,
    opts: &LoadOptions,
    keep: impl Fn(usize, usize) -> bool + Sync,
) -> Result<LoadedExperts> {
    match &opts.tier {
        Some(t) if opts.executor == ExecutorKind::Packed => {
            let tiered = Arc::new(TieredExperts::load(
                cfg,
                ws.clone(),
                opts,
                &keep,
                t.clone(),
            )?);
            Ok((tiered.clone(), Some(tiered)))
        }
        Some(_) => Err(Error::Dispatch(
            "--expert-memory needs the packed executor (the portable one reads the mmap as it is)"
                .into(),
        )),
        None => Ok((load_executor_filtered(cfg, ws, opts, keep)?, None)),
    }
}

/// Loads the experts for which `keep(layer, expert)` holds.
#[tracing::instrument(level = "info", name = "load_experts", skip_all, fields(executor = ?opts.executor, dtype = ?opts.expert_dtype))]
pub fn load_executor_filtered(
    cfg: &ModelConfig,
    ws: &WeightStore,
    opts: &LoadOptions,
    keep: impl Fn(usize, usize) -> bool + Sync,
) -> Result<Arc<dyn ExpertExecutor>> {
    if opts.executor == ExecutorKind::Portable {
        return Ok(Arc::new(LocalExperts::load_filtered(cfg, ws, keep)?));
    }
    match PackedExperts::load_filtered(cfg, ws, opts, &keep) {
        Ok(p) => Ok(Arc::new(p)),
        Err(Error::Dispatch(msg)) if msg.starts_with(packed::NOT_BF16_EXACT) => {
            tracing::info!(
                reason = %msg,
                "experts are not bf16-representable: using the portable executor (ask for \
                 --expert-dtype bf16 or int8 to repack them)"
            );
            Ok(Arc::new(LocalExperts::load_filtered(cfg, ws, keep)?))
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod tiered_tests;
