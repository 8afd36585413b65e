//! [`GatedMlp`], the gated feed-forward network `down(act(gate(x)) * up(x))`
//! that every expert, dense MLP and shared expert is: its weights, its
//! forward pass, loading it by module prefix, and
//! [`ExpertNames::load`](crate::loader::names::ExpertNames::load), which
//! assembles one expert from however the checkpoint stores it (the storage
//! itself is found in [`crate::loader::names`]).

use crate::config::{Activation, ModelConfig};
use crate::error::Result;
use crate::kernels::{gated, linear};
use crate::loader::names::{ExpertNames, bf16_weight, columns_as_rows, dequant_mxfp4};
use crate::loader::weights::WeightStore;
use crate::tensor::Weight;

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
        gated_forward(
            self.activation,
            self.intermediate(),
            rows,
            |g, u| {
                linear(x, rows, &self.gate, self.gate_bias.as_deref(), g);
                linear(x, rows, &self.up, self.up_bias.as_deref(), u);
            },
            |h| linear(h, rows, &self.down, self.down_bias.as_deref(), out),
        );
    }
}

/// `down(act(gate) * up)` for `rows` tokens of width `inter`: `gate_up`
/// fills the gate and up `[rows, inter]` projections of the input (one fused
/// call where the weights allow), `down` projects the
/// gated activations to the output. The one definition of the gated MLP, for
/// every way its projections are computed (plain here, packed in
/// `model::linear::DenseMlp`).
pub fn gated_forward(
    activation: Activation,
    inter: usize,
    rows: usize,
    gate_up: impl FnOnce(&mut [f32], &mut [f32]),
    down: impl FnOnce(&[f32]),
) {
    let mut g = vec![0.0f32; rows * inter];
    let mut u = vec![0.0f32; rows * inter];
    gate_up(&mut g, &mut u);
    for (gv, uv) in g.iter_mut().zip(&u) {
        *gv = gated(activation, *gv, *uv);
    }
    down(&g);
}

impl ExpertNames<'_> {
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
