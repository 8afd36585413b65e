//! Where each architecture keeps its tensors: decoder layer prefixes, the
//! router weight, the shared expert, and how one layer's experts are stored.
//! Hub checkpoints store experts one by one (`experts.{e}.gate_proj` or
//! Mixtral's `w1/w2/w3` under `block_sparse_moe`); transformers 5 may store
//! them fused as 3-D `experts.gate_up_proj` / `experts.down_proj`; GPT-OSS
//! stores them fused and transposed (`[E, in, out]`, gate and up columns
//! interleaved) with biases, or as MXFP4 `*_blocks` / `*_scales`; Gemma 4
//! keeps router and experts beside the dense MLP (`layers.{i}.router`,
//! `layers.{i}.experts`). All are accepted: [`ExpertNames`] says which one a
//! layer uses, and the helpers at the end decode the transposed and MXFP4
//! storage. Assembling an expert from them ([`ExpertNames::load`]) lives with
//! `GatedMlp` in `moe::mlp` (above this module, which uses no MoE type); building
//! the router lives with the model's `Router`.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::loader::weights::WeightStore;
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
pub fn router_weight_and_module(
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
}

/// A `[cols.len(), R]` weight whose row `j` is column `cols[j]` of the 2-D
/// `[R, C]` weight `w` (a transposing gather), in `w`'s dtype.
pub(crate) fn columns_as_rows(w: &Weight, cols: impl Iterator<Item = usize>) -> Weight {
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
pub(crate) fn dequant_mxfp4(q: &Mxfp4<'_>, e: usize, out: usize, inp: usize) -> Vec<f32> {
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
pub(crate) fn bf16_weight(shape: Vec<usize>, v: &[f32]) -> Weight {
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
