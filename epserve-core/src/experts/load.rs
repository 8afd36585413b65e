//! Loading [`PackedExperts`] from a checkpoint: every expert of the layers
//! with experts, packed in the precision the options ask for, in parallel;
//! experts a compressed-tensors checkpoint already stores as channel-wise
//! int8 are taken as they are.

use std::sync::Arc;

use rayon::prelude::*;

use crate::config::{FfnKind, ModelConfig};
use crate::error::{Error, Result};
use crate::experts::executor::PackedExperts;
use crate::experts::packed::{PackedDtype, PackedExpert, Spare};
use crate::experts::pool::ExpertPool;
use crate::experts::{ExpertDtype, LoadOptions};
use crate::loader::names::ExpertNames;
use crate::loader::weights::WeightStore;

impl PackedExperts {
    /// Loads and packs every expert of the model for which `keep` holds, in
    /// the precision `opts` asks for each one.
    pub fn load_filtered(
        cfg: &ModelConfig,
        ws: &WeightStore,
        opts: &LoadOptions,
        keep: &(impl Fn(usize, usize) -> bool + Sync),
    ) -> Result<Self> {
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let planned = cfg
            .layers
            .iter()
            .enumerate()
            .filter(|(_, s)| s.ffn == FfnKind::Moe)
            .map(|(i, _)| (0..cfg.num_experts).filter(|&e| keep(i, e)).count() as u64)
            .sum();
        crate::loader::progress::experts_planned(planned);
        for (i, spec) in cfg.layers.iter().enumerate() {
            if spec.ffn != FfnKind::Moe {
                layers.push(None);
                continue;
            }
            let names = ExpertNames::resolve(cfg, ws, i)?;
            let experts: Vec<Option<PackedExpert>> = (0..cfg.num_experts)
                .into_par_iter()
                .map(|e| -> Result<Option<PackedExpert>> {
                    if !keep(i, e) {
                        return Ok(None);
                    }
                    let _done = PackedOne;
                    let spare = &mut Spare::default();
                    pack_expert(cfg, ws, &names, opts.dtype_for(i, e), i, e, spare)
                        .map(|p| Some(p.stored_for_decode()))
                })
                .collect::<Result<_>>()?;
            layers.push(Some(experts));
        }
        let pool = match opts.threads {
            Some(n) => Arc::new(ExpertPool::new(Some(n), opts.pin_threads)?),
            None => ExpertPool::shared()?,
        };
        Self::new(layers, cfg.hidden_size, pool)
    }
}

/// Packs expert `e` of layer `i` (whose names are `names`) in the precision
/// `asked`: what the resident load does for each expert, and what the tiered
/// executor does for a cold one on first use (into the buffers of the
/// experts it evicted for it: `spare`).
pub(crate) fn pack_expert(
    cfg: &ModelConfig,
    ws: &WeightStore,
    names: &ExpertNames<'_>,
    asked: ExpertDtype,
    i: usize,
    e: usize,
    spare: &mut Spare,
) -> Result<PackedExpert> {
    if asked != ExpertDtype::Bf16
        && let Some(p) = load_int8_expert(cfg, ws, names, e)?
    {
        return Ok(p);
    }
    let mlp = names.load(cfg, ws, e)?;
    let (dt, exact) = match asked {
        ExpertDtype::Auto => (PackedDtype::Bf16, true),
        ExpertDtype::Bf16 => (PackedDtype::Bf16, false),
        ExpertDtype::Int8 => (PackedDtype::Int8, false),
    };
    PackedExpert::from_mlp_reusing(&mlp, dt, exact, spare)
        .map(|p| p.with_bf16_activations(asked == ExpertDtype::Bf16))
        .map_err(|err| match err {
            Error::Dispatch(m) => Error::Dispatch(format!("{m} (layer {i}, expert {e})")),
            other => other,
        })
}

/// Counts one expert as packed when dropped (also on an error: the load
/// stops then, and the count only feeds the progress display).
struct PackedOne;

impl Drop for PackedOne {
    fn drop(&mut self) {
        crate::loader::progress::expert_packed();
    }
}

/// Expert `e` straight from a checkpoint that stores it as channel-wise int8
/// (compressed-tensors W8A8, one tensor per expert and projection), or `None`
/// when its weights are floats.
fn load_int8_expert(
    cfg: &ModelConfig,
    ws: &WeightStore,
    names: &ExpertNames<'_>,
    e: usize,
) -> Result<Option<PackedExpert>> {
    let ExpertNames::PerExpert {
        prefix,
        gate,
        up,
        down,
    } = names
    else {
        return Ok(None);
    };
    let (h, inter) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let get = |proj: &str, shape: [usize; 2]| {
        ws.get_i8_channelwise(&format!("{prefix}.{e}.{proj}.weight"), &shape)
    };
    let Some(g) = get(gate, [inter, h])? else {
        return Ok(None);
    };
    let missing = |proj: &str| {
        Error::Dispatch(format!(
            "{prefix}.{e}: gate_proj is int8 but {proj} is not (mixed precision within one expert)"
        ))
    };
    let u = get(up, [inter, h])?.ok_or_else(|| missing(up))?;
    let d = get(down, [h, inter])?.ok_or_else(|| missing(down))?;
    PackedExpert::from_i8(&g, &u, &d, cfg.activation).map(Some)
}
