//! Where each architecture keeps its tensors. Hub checkpoints store experts one
//! by one (`experts.{e}.gate_proj` or Mixtral's `w1/w2/w3` under
//! `block_sparse_moe`); transformers 5 may store them fused as 3-D
//! `experts.gate_up_proj` / `experts.down_proj`. Both are accepted.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::loader::weights::WeightStore;
use crate::model::moe::GatedMlp;
use crate::tensor::Weight;

/// Prefix of decoder layer `i`.
pub fn layer_prefix(i: usize) -> String {
    format!("model.layers.{i}")
}

/// Module names the sparse block may live under.
const MOE_MODULES: &[&str] = &["mlp", "block_sparse_moe"];

/// Finds the router weight of MoE layer `i`.
pub fn router_weight(cfg: &ModelConfig, ws: &WeightStore, i: usize) -> Result<Weight> {
    let lp = layer_prefix(i);
    for m in MOE_MODULES {
        let name = format!("{lp}.{m}.gate.weight");
        if ws.contains(&name) {
            return ws.get(&name, &[cfg.num_experts, cfg.hidden_size]);
        }
    }
    Err(Error::MissingTensor {
        dir: ws.dir().to_path_buf(),
        tensor: format!("{lp}.mlp.gate.weight"),
    })
}

/// How one layer's experts are stored.
pub enum ExpertNames {
    /// `[E, 2I, H]` gate (first I rows) and up, and `[E, H, I]` down.
    Fused { gate_up: Weight, down: Weight },
    /// One tensor per expert and projection.
    PerExpert {
        prefix: String,
        gate: &'static str,
        up: &'static str,
        down: &'static str,
    },
}

impl ExpertNames {
    /// Detects the storage of layer `i`'s experts.
    pub fn resolve(cfg: &ModelConfig, ws: &WeightStore, i: usize) -> Result<Self> {
        let (e, h, inter) = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size);
        let lp = layer_prefix(i);
        for m in MOE_MODULES {
            for suffix in ["", ".weight"] {
                let gu = format!("{lp}.{m}.experts.gate_up_proj{suffix}");
                if ws.contains(&gu) {
                    let down = format!("{lp}.{m}.experts.down_proj{suffix}");
                    return Ok(ExpertNames::Fused {
                        gate_up: ws.get(&gu, &[e, 2 * inter, h])?,
                        down: ws.get(&down, &[e, h, inter])?,
                    });
                }
            }
            let prefix = format!("{lp}.{m}.experts");
            if ws.contains(&format!("{prefix}.0.gate_proj.weight")) {
                return Ok(ExpertNames::PerExpert {
                    prefix,
                    gate: "gate_proj",
                    up: "up_proj",
                    down: "down_proj",
                });
            }
            if ws.contains(&format!("{prefix}.0.w1.weight")) {
                return Ok(ExpertNames::PerExpert {
                    prefix,
                    gate: "w1",
                    up: "w3",
                    down: "w2",
                });
            }
        }
        Err(Error::MissingTensor {
            dir: ws.dir().to_path_buf(),
            tensor: format!("{lp}.mlp.experts.0.gate_proj.weight"),
        })
    }

    /// Loads expert `e` as a gated MLP (views into the mapped files).
    pub fn load(&self, cfg: &ModelConfig, ws: &WeightStore, e: usize) -> Result<GatedMlp> {
        let (h, inter) = (cfg.hidden_size, cfg.moe_intermediate_size);
        Ok(match self {
            ExpertNames::Fused { gate_up, down } => {
                let gu = gate_up.index0(e);
                GatedMlp {
                    gate: gu.rows(0, inter),
                    up: gu.rows(inter, inter),
                    down: down.index0(e),
                    activation: cfg.activation,
                }
            }
            ExpertNames::PerExpert {
                prefix,
                gate,
                up,
                down,
            } => GatedMlp {
                gate: ws.get(&format!("{prefix}.{e}.{gate}.weight"), &[inter, h])?,
                up: ws.get(&format!("{prefix}.{e}.{up}.weight"), &[inter, h])?,
                down: ws.get(&format!("{prefix}.{e}.{down}.weight"), &[h, inter])?,
                activation: cfg.activation,
            },
        })
    }
}
