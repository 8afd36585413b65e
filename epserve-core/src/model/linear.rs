//! Dense linear layers (`y = x·Wᵀ + b`) on the packed bf16 panels the expert
//! kernels read: a weight that is exactly bf16-representable (every bf16
//! checkpoint, and the bf16-rounded f32 fixtures) is repacked once at load
//! into 16-channel panels, and every call runs the best tier's bf16 tile
//! (`kernels::dispatch`, `EPSERVE_KERNEL` to force one) over token tiles and
//! K blocks, in parallel over panels. Other weights (f16, true f32) keep the
//! plain [`kernels::linear`](crate::kernels::linear), which is also this
//! path's scalar twin in the tests. [`DenseMlp`] is a dense MLP or shared
//! expert on such projections.

use rayon::prelude::*;

use crate::config::Activation;
use crate::experts::packed::{AlignedBuf, PackedDtype, PackedMatrix};
use crate::kernels::dispatch::{Kernels, kernels};
use crate::kernels::layout::{NR, bf16_padded_k};
use crate::kernels::linear;
use crate::moe::mlp::{GatedMlp, gated_forward};
use crate::tensor::Weight;

/// `k` per block: a 16 KiB chunk of a panel stays in L1 across a token tile.
const KC: usize = 512;
/// Below this many multiply-adds a call stays on the calling thread.
const PAR_THRESHOLD: usize = 1 << 16;

/// A dense weight `[n, k]`: its packed copy, or the weight as loaded when it
/// cannot be packed (the loaded one is dropped once packed, so an owned
/// copy, such as an attention shard's `o_proj` columns, is not held twice).
pub struct Linear {
    shape: [usize; 2],
    form: Form,
}

enum Form {
    /// The bf16 panels, `n.div_ceil(16)` of `bf16_padded_k(k) · 16` words.
    Packed(AlignedBuf<u16>),
    Plain(Weight),
}

impl Linear {
    /// Packs `w` when its values are exactly bf16 (else keeps the plain path).
    pub fn new(w: Weight) -> Self {
        let (n, k) = (w.shape()[0], w.shape()[1]);
        let packed = PackedMatrix::pack(k, n.div_ceil(NR), PackedDtype::Bf16, true, |p, c, buf| {
            let j = p * NR + c;
            if j < n {
                w.row_to_f32(j, buf);
            }
            j < n
        })
        .ok()
        .and_then(PackedMatrix::into_bf16);
        Linear {
            shape: [n, k],
            form: match packed {
                Some(p) => Form::Packed(p),
                None => Form::Plain(w),
            },
        }
    }

    /// `[n, k]`.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Whether calls run on the packed panels.
    pub fn is_packed(&self) -> bool {
        matches!(self.form, Form::Packed(_))
    }

    /// `out[rows, n] = x[rows, k] · Wᵀ (+ bias)` with the best tier.
    pub fn forward(&self, x: &[f32], rows: usize, bias: Option<&[f32]>, out: &mut [f32]) {
        self.forward_with(kernels(), x, rows, bias, out)
    }

    /// [`forward`](Self::forward) with the tier `kern` (tier tests).
    pub fn forward_with(
        &self,
        kern: &Kernels,
        x: &[f32],
        rows: usize,
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        let data = match &self.form {
            Form::Plain(w) => return linear(x, rows, w, bias, out),
            Form::Packed(d) => d,
        };
        let [n, k] = self.shape;
        debug_assert_eq!(x.len(), rows * k);
        debug_assert_eq!(out.len(), rows * n);
        if rows == 0 || n == 0 {
            return;
        }
        let panel_len = bf16_padded_k(k) * NR;
        let data = data.as_slice();
        let mr = kern.bf16_mr();
        // [panel][row][16]: each panel's outputs are one contiguous chunk.
        let mut tmp = vec![0.0f32; n.div_ceil(NR) * rows * NR];
        let run = |p: usize, dst: &mut [f32]| {
            let panel = &data[p * panel_len..(p + 1) * panel_len];
            for (ti, acc) in dst.chunks_mut(mr * NR).enumerate() {
                let t0 = ti * mr;
                let tn = acc.len() / NR;
                let mut k0 = 0;
                while k0 < k {
                    let kc = KC.min(k - k0);
                    let w = &panel[k0 * NR..(k0 + bf16_padded_k(kc)) * NR];
                    let mut xs: [&[f32]; crate::kernels::dispatch::MAX_MR] = [&[]; _];
                    for (r, slot) in xs.iter_mut().enumerate().take(tn) {
                        *slot = &x[(t0 + r) * k + k0..(t0 + r + 1) * k];
                    }
                    kern.bf16_tile(w, kc, &xs[..tn], acc);
                    k0 += kc;
                }
            }
        };
        if rows * n * k < PAR_THRESHOLD {
            for (p, dst) in tmp.chunks_mut(rows * NR).enumerate() {
                run(p, dst);
            }
        } else {
            tmp.par_chunks_mut(rows * NR)
                .enumerate()
                .for_each(|(p, dst)| run(p, dst));
        }
        for (t, row) in out.chunks_exact_mut(n).enumerate() {
            for (j, o) in row.iter_mut().enumerate() {
                let (p, c) = (j / NR, j % NR);
                *o = tmp[(p * rows + t) * NR + c] + bias.map_or(0.0, |b| b[j]);
            }
        }
    }
}

/// A dense MLP or shared expert (`down(act(gate(x)) * up(x))`) on packed
/// projections: the model's own copy of a [`GatedMlp`], which stays the
/// plain form the portable expert twin (`LocalExperts`) runs.
pub struct DenseMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    activation: Activation,
    gate_bias: Option<Vec<f32>>,
    up_bias: Option<Vec<f32>>,
    down_bias: Option<Vec<f32>>,
}

impl From<GatedMlp> for DenseMlp {
    fn from(m: GatedMlp) -> Self {
        DenseMlp {
            gate: Linear::new(m.gate),
            up: Linear::new(m.up),
            down: Linear::new(m.down),
            activation: m.activation,
            gate_bias: m.gate_bias,
            up_bias: m.up_bias,
            down_bias: m.down_bias,
        }
    }
}

impl DenseMlp {
    /// Output width (the model's hidden size).
    pub fn hidden(&self) -> usize {
        self.down.shape()[0]
    }

    /// Applies the MLP to `[rows, hidden]` and writes `[rows, hidden]`, as
    /// [`GatedMlp::forward`] does.
    pub fn forward(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        gated_forward(
            self.activation,
            self.gate.shape()[0],
            rows,
            |g| self.gate.forward(x, rows, self.gate_bias.as_deref(), g),
            |u| self.up.forward(x, rows, self.up_bias.as_deref(), u),
            |h| self.down.forward(h, rows, self.down_bias.as_deref(), out),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::dispatch::Tier;
    use crate::kernels::layout::f32_to_bf16_bits;
    use crate::tensor::DType;
    use rand::{Rng, SeedableRng};

    fn bf16_weight(n: usize, k: usize, rng: &mut impl Rng) -> Weight {
        let bits: Vec<u16> = (0..n * k)
            .map(|_| f32_to_bf16_bits(rng.random_range(-1.0f32..1.0)))
            .collect();
        Weight::from_bytes(DType::BF16, vec![n, k], bytemuck::cast_slice(&bits))
    }

    /// Every tier of this CPU against the plain `linear` (the scalar twin):
    /// shapes with a partial last panel, an odd K across several K blocks,
    /// token counts below, at and above each tier's tile height, with a bias.
    #[test]
    fn packed_linear_matches_the_plain_twin_on_every_tier() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for &(n, k) in &[(16, 32), (37, 1031), (100, 64), (3, 7)] {
            let w = bf16_weight(n, k, &mut rng);
            let bias: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let lin = Linear::new(w.clone());
            assert!(lin.is_packed(), "a bf16 weight is packed");
            for rows in [1usize, 5, 13, 40] {
                let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut want = vec![0.0f32; rows * n];
                linear(&x, rows, &w, Some(&bias), &mut want);
                for tier in Tier::available() {
                    let Some(kern) = Kernels::for_tier(tier) else {
                        continue;
                    };
                    let mut got = vec![f32::NAN; rows * n];
                    lin.forward_with(&kern, &x, rows, Some(&bias), &mut got);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                            "tier {} n {n} k {k} rows {rows} out {i}: {a} vs {b}",
                            tier.name()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn weights_that_are_not_bf16_keep_the_plain_path() {
        let v = [0.1f32, 0.2, 0.3, 0.4];
        let w = Weight::from_f32(vec![2, 2], &v);
        let lin = Linear::new(w.clone());
        assert!(!lin.is_packed());
        let x = [1.0f32, 2.0];
        let (mut a, mut b) = ([0.0f32; 2], [0.0f32; 2]);
        lin.forward(&x, 1, None, &mut a);
        linear(&x, 1, &w, None, &mut b);
        assert_eq!(a, b);
    }
}
