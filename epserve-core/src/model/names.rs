//! Where each architecture keeps its tensors. Hub checkpoints store experts one
//! by one (`experts.{e}.gate_proj` or Mixtral's `w1/w2/w3` under
//! `block_sparse_moe`); transformers 5 may store them fused as 3-D
//! `experts.gate_up_proj` / `experts.down_proj`; GPT-OSS stores them fused and
//! transposed (`[E, in, out]`, gate and up columns interleaved) with biases, or
//! as MXFP4 `*_blocks` / `*_scales`; Gemma 4 keeps router and experts beside
//! the dense MLP (`layers.{i}.router`, `layers.{i}.experts`). All are accepted,
//! and every expert comes out as the same [`GatedMlp`].

use crate::config::{ModelConfig, RouterSpec};
use crate::error::{Error, Result};
use crate::loader::weights::WeightStore;
use crate::model::moe::{GatedMlp, Router, RouterKind};
use crate::tensor::{DType, Weight};

/// Prefix of decoder layer `i` (plain causal-LM layout).
pub fn layer_prefix(i: usize) -> String {
    format!("model.layers.{i}")
}

/// Prefix of decoder layer `i` of this model (`model.language_model.layers.{i}`
/// in multimodal wrappers).
pub fn layer_prefix_for(cfg: &ModelConfig, i: usize) -> String {
    format!("{}.layers.{i}", cfg.weight_prefix)
}

/// Module prefixes the sparse block may live under.
fn moe_modules(cfg: &ModelConfig, i: usize) -> [String; 3] {
    let lp = layer_prefix_for(cfg, i);
    [
        format!("{lp}.mlp"),
        format!("{lp}.block_sparse_moe"),
        lp, // Gemma 4: router and experts directly under the layer
    ]
}

/// Finds the router weight of MoE layer `i` and the module it lives in.
fn router_weight_and_module(
    cfg: &ModelConfig,
    ws: &WeightStore,
    i: usize,
) -> Result<(Weight, String)> {
    let shape = [cfg.num_experts, cfg.hidden_size];
    for m in moe_modules(cfg, i) {
        for sub in ["gate", "router", "router.proj"] {
            let name = format!("{m}.{sub}.weight");
            if ws.contains(&name) {
                return Ok((ws.get(&name, &shape)?, format!("{m}.{sub}")));
            }
        }
    }
    Err(Error::MissingTensor {
        dir: ws.dir().to_path_buf(),
        tensor: format!("{}.mlp.gate.weight", layer_prefix_for(cfg, i)),
    })
}

/// Finds the router weight of MoE layer `i`.
pub fn router_weight(cfg: &ModelConfig, ws: &WeightStore, i: usize) -> Result<Weight> {
    router_weight_and_module(cfg, ws, i).map(|(w, _)| w)
}

/// Loads the router of MoE layer `i` with everything its kind needs (GPT-OSS
/// bias, DeepSeek-V3 score correction bias, Gemma 4 input and expert scales).
pub fn router(cfg: &ModelConfig, ws: &WeightStore, i: usize) -> Result<Router> {
    let (weight, module) = router_weight_and_module(cfg, ws, i)?;
    let (e, h) = (cfg.num_experts, cfg.hidden_size);
    let k = cfg.num_experts_per_tok;
    Ok(match cfg.router {
        RouterSpec::Softmax { normalize } => {
            Router::new(weight, RouterKind::SoftmaxTopK { normalize }, k)
        }
        RouterSpec::TopKSoftmax => Router::new(weight, RouterKind::TopKSoftmax, k).with_bias(
            ws.get_opt(&format!("{module}.bias"), &[e])?
                .map(|w| w.to_f32_vec()),
        ),
        RouterSpec::GroupedSoftmax {
            n_group,
            topk_group,
            scaling,
        } => Router::new(
            weight,
            RouterKind::GroupedSoftmax {
                n_group,
                topk_group,
                scaling,
            },
            k,
        ),
        RouterSpec::GroupedSigmoid {
            n_group,
            topk_group,
            normalize,
            scaling,
        } => Router::new(
            weight,
            RouterKind::GroupedSigmoid {
                n_group,
                topk_group,
                normalize,
                scaling,
            },
            k,
        )
        .with_score_bias(
            ws.get_opt(&format!("{module}.e_score_correction_bias"), &[e])?
                .map(|w| w.to_f32_vec()),
        ),
        RouterSpec::ScaledSoftmax => {
            // Gemma 4: `layers.{i}.router.{proj.weight, scale, per_expert_scale}`.
            let base = module.trim_end_matches(".proj").to_string();
            Router::new(weight, RouterKind::ScaledSoftmax, k)
                .with_input_scale(ws.get_vec(&format!("{base}.scale"), h)?, cfg.rms_norm_eps)
                .with_expert_scale(Some(ws.get_vec(&format!("{base}.per_expert_scale"), e)?))
        }
    })
}

/// Prefix of the shared expert(s) of MoE layer `i`, if the architecture has them.
pub fn shared_expert_prefix(cfg: &ModelConfig, i: usize) -> String {
    let lp = layer_prefix_for(cfg, i);
    match cfg.arch {
        crate::config::Arch::DeepseekV2 | crate::config::Arch::DeepseekV3 => {
            format!("{lp}.mlp.shared_experts")
        }
        _ => format!("{lp}.mlp.shared_expert"),
    }
}

/// MXFP4 tensors of one projection: `[E, out, in/32, 16]` nibbles and
/// `[E, out, in/32]` biased exponents.
pub struct Mxfp4<'a> {
    pub blocks: &'a [u8],
    pub scales: &'a [u8],
}

/// How one layer's experts are stored.
pub enum ExpertNames<'a> {
    /// `[E, 2I, H]` gate (first I rows) and up, and `[E, H, I]` down.
    Fused { gate_up: Weight, down: Weight },
    /// GPT-OSS: `[E, H, 2I]` with gate in even and up in odd columns,
    /// `[E, I, H]` down, and `[E, 2I]` / `[E, H]` biases.
    Transposed {
        gate_up: Weight,
        down: Weight,
        gate_up_bias: Option<Weight>,
        down_bias: Option<Weight>,
    },
    /// GPT-OSS as published: MXFP4 `[E, 2I, H]` (gate even rows, up odd
    /// rows) and `[E, H, I]`, dequantized to bf16 at load.
    Mxfp4 {
        gate_up: Mxfp4<'a>,
        down: Mxfp4<'a>,
        gate_up_bias: Option<Weight>,
        down_bias: Option<Weight>,
    },
    /// One tensor per expert and projection.
    PerExpert {
        prefix: String,
        gate: &'static str,
        up: &'static str,
        down: &'static str,
    },
}

impl<'a> ExpertNames<'a> {
    /// Detects the storage of layer `i`'s experts.
    pub fn resolve(cfg: &ModelConfig, ws: &'a WeightStore, i: usize) -> Result<Self> {
        let (e, h, inter) = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size);
        for m in moe_modules(cfg, i) {
            let ex = format!("{m}.experts");
            let bias = |name: &str, n: usize| ws.get_opt(&format!("{ex}.{name}"), &[e, n]);
            if ws.contains(&format!("{ex}.gate_up_proj_blocks")) {
                if h % 32 != 0 || inter % 32 != 0 {
                    return Err(Error::config(
                        ws.dir().join("config.json"),
                        format!(
                            "MXFP4 experts need hidden_size ({h}) and intermediate_size ({inter}) divisible by 32"
                        ),
                    ));
                }
                let q = |name: &str, out: usize, inp: usize| -> Result<Mxfp4<'a>> {
                    Ok(Mxfp4 {
                        blocks: ws
                            .get_u8(&format!("{ex}.{name}_blocks"), &[e, out, inp / 32, 16])?,
                        scales: ws.get_u8(&format!("{ex}.{name}_scales"), &[e, out, inp / 32])?,
                    })
                };
                return Ok(ExpertNames::Mxfp4 {
                    gate_up: q("gate_up_proj", 2 * inter, h)?,
                    down: q("down_proj", h, inter)?,
                    gate_up_bias: bias("gate_up_proj_bias", 2 * inter)?,
                    down_bias: bias("down_proj_bias", h)?,
                });
            }
            for suffix in ["", ".weight"] {
                let gu = format!("{ex}.gate_up_proj{suffix}");
                if ws.contains(&gu) {
                    let down = format!("{ex}.down_proj{suffix}");
                    if cfg.expert_bias {
                        return Ok(ExpertNames::Transposed {
                            gate_up: ws.get(&gu, &[e, h, 2 * inter])?,
                            down: ws.get(&down, &[e, inter, h])?,
                            gate_up_bias: bias("gate_up_proj_bias", 2 * inter)?,
                            down_bias: bias("down_proj_bias", h)?,
                        });
                    }
                    return Ok(ExpertNames::Fused {
                        gate_up: ws.get(&gu, &[e, 2 * inter, h])?,
                        down: ws.get(&down, &[e, h, inter])?,
                    });
                }
            }
            if ws.contains(&format!("{ex}.0.gate_proj.weight")) {
                return Ok(ExpertNames::PerExpert {
                    prefix: ex,
                    gate: "gate_proj",
                    up: "up_proj",
                    down: "down_proj",
                });
            }
            if ws.contains(&format!("{ex}.0.w1.weight")) {
                return Ok(ExpertNames::PerExpert {
                    prefix: ex,
                    gate: "w1",
                    up: "w3",
                    down: "w2",
                });
            }
        }
        Err(Error::MissingTensor {
            dir: ws.dir().to_path_buf(),
            tensor: format!(
                "{}.mlp.experts.0.gate_proj.weight",
                layer_prefix_for(cfg, i)
            ),
        })
    }

    /// Loads expert `e` as a gated MLP (views into the mapped files where the
    /// layout allows, owned copies for GPT-OSS's transposed / MXFP4 storage).
    pub fn load(&self, cfg: &ModelConfig, ws: &WeightStore, e: usize) -> Result<GatedMlp> {
        let (h, inter) = (cfg.hidden_size, cfg.moe_intermediate_size);
        let act = cfg.activation;
        // Interleaved gate/up biases: gate at even, up at odd positions.
        let split_bias = |b: &Option<Weight>| -> (Option<Vec<f32>>, Option<Vec<f32>>) {
            match b {
                Some(w) => {
                    let v = w.index0(e).to_f32_vec();
                    (
                        Some(v.iter().step_by(2).copied().collect()),
                        Some(v.iter().skip(1).step_by(2).copied().collect()),
                    )
                }
                None => (None, None),
            }
        };
        let row_bias = |b: &Option<Weight>| b.as_ref().map(|w| w.index0(e).to_f32_vec());
        Ok(match self {
            ExpertNames::Fused { gate_up, down } => {
                let gu = gate_up.index0(e);
                GatedMlp {
                    gate: gu.rows(0, inter),
                    up: gu.rows(inter, inter),
                    down: down.index0(e),
                    activation: act,
                    gate_bias: None,
                    up_bias: None,
                    down_bias: None,
                }
            }
            ExpertNames::Transposed {
                gate_up,
                down,
                gate_up_bias,
                down_bias,
            } => {
                let gu = gate_up.index0(e); // [H, 2I]
                let (gate_bias, up_bias) = split_bias(gate_up_bias);
                GatedMlp {
                    gate: columns_as_rows(&gu, (0..inter).map(|j| 2 * j)),
                    up: columns_as_rows(&gu, (0..inter).map(|j| 2 * j + 1)),
                    down: columns_as_rows(&down.index0(e), 0..h),
                    activation: act,
                    gate_bias,
                    up_bias,
                    down_bias: row_bias(down_bias),
                }
            }
            ExpertNames::Mxfp4 {
                gate_up,
                down,
                gate_up_bias,
                down_bias,
            } => {
                let gu = dequant_mxfp4(gate_up, e, 2 * inter, h); // [2I, H] rows
                let pick = |parity: usize| -> Weight {
                    let mut rows = Vec::with_capacity(inter * h);
                    for j in 0..inter {
                        let r = 2 * j + parity;
                        rows.extend_from_slice(&gu[r * h..(r + 1) * h]);
                    }
                    bf16_weight(vec![inter, h], &rows)
                };
                let (gate_bias, up_bias) = split_bias(gate_up_bias);
                GatedMlp {
                    gate: pick(0),
                    up: pick(1),
                    down: bf16_weight(vec![h, inter], &dequant_mxfp4(down, e, h, inter)),
                    activation: act,
                    gate_bias,
                    up_bias,
                    down_bias: row_bias(down_bias),
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
                activation: act,
                gate_bias: None,
                up_bias: None,
                down_bias: None,
            },
        })
    }
}

/// A `[cols.len(), R]` weight whose row `j` is column `cols[j]` of the 2-D
/// `[R, C]` weight `w` (a transposing gather), in `w`'s dtype.
fn columns_as_rows(w: &Weight, cols: impl Iterator<Item = usize>) -> Weight {
    let (r, c) = (w.shape()[0], w.shape()[1]);
    let es = w.dtype().size();
    let src = w.bytes();
    let cols: Vec<usize> = cols.collect();
    let mut out = Vec::with_capacity(cols.len() * r * es);
    for &col in &cols {
        for row in 0..r {
            let at = (row * c + col) * es;
            out.extend_from_slice(&src[at..at + es]);
        }
    }
    Weight::from_bytes(w.dtype(), vec![cols.len(), r], &out)
}

/// The FP4 (e2m1) code points.
const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Expert `e` of an MXFP4 projection as `[out, in]` f32: each byte holds two
/// FP4 values (low nibble first), each group of 32 shares the exponent
/// `scale - 127` (transformers `convert_moe_packed_tensors`).
fn dequant_mxfp4(q: &Mxfp4<'_>, e: usize, out: usize, inp: usize) -> Vec<f32> {
    let groups = inp / 32;
    let blocks = &q.blocks[e * out * groups * 16..(e + 1) * out * groups * 16];
    let scales = &q.scales[e * out * groups..(e + 1) * out * groups];
    let mut v = Vec::with_capacity(out * inp);
    for (g, &s) in scales.iter().enumerate() {
        let mul = 2f32.powi(s as i32 - 127);
        for &b in &blocks[g * 16..(g + 1) * 16] {
            v.push(FP4_VALUES[(b & 0x0f) as usize] * mul);
            v.push(FP4_VALUES[(b >> 4) as usize] * mul);
        }
    }
    v
}

/// An owned bf16 weight from f32 values (exact for dequantized MXFP4).
fn bf16_weight(shape: Vec<usize>, v: &[f32]) -> Weight {
    let b: Vec<half::bf16> = v.iter().map(|x| half::bf16::from_f32(*x)).collect();
    Weight::from_bytes(DType::BF16, shape, bytemuck::cast_slice(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_become_rows() {
        let w = Weight::from_f32(vec![2, 4], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        let g = columns_as_rows(&w, [0usize, 2].into_iter());
        assert_eq!(g.shape(), &[2, 2]);
        assert_eq!(g.to_f32_vec(), vec![0.0, 4.0, 2.0, 6.0]);
    }

    #[test]
    fn mxfp4_nibbles_low_first_with_shared_exponent() {
        let mut blocks = vec![0u8; 16];
        blocks[0] = 0x2f; // low nibble 0xf = -6, high nibble 2 = 1.0
        let scales = [128u8]; // 2^1
        let q = Mxfp4 {
            blocks: &blocks,
            scales: &scales,
        };
        let v = dequant_mxfp4(&q, 0, 1, 32);
        assert_eq!(v.len(), 32);
        assert_eq!((v[0], v[1], v[2]), (-12.0, 2.0, 0.0));
    }
}
