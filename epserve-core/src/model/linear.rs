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

/// A dense weight `[n, k]`, or several weights of the same input width
/// stacked into one (fused q/k/v, gate/up: one pass over the input and one
/// fork/join instead of several), each part written to its own output: its
/// packed copy, or the weights as loaded when they cannot be packed (the
/// loaded ones are dropped once packed, so an owned copy, such as an
/// attention shard's `o_proj` columns, is not held twice).
pub struct Linear {
    shape: [usize; 2],
    /// Output rows of each part, in order (sums to `shape[0]`).
    parts: Vec<usize>,
    form: Form,
}

enum Form {
    /// The bf16 panels of all parts' rows, `n.div_ceil(16)` of
    /// `bf16_padded_k(k) · 16` words (a panel may straddle two parts).
    Packed(AlignedBuf<u16>),
    /// One weight per part.
    Plain(Vec<Weight>),
}

impl Linear {
    /// Packs `w` when its values are exactly bf16 (else keeps the plain path).
    pub fn new(w: Weight) -> Self {
        let (n, k) = (w.shape()[0], w.shape()[1]);
        Self::build(k, vec![n], vec![w])
    }

    /// Stacks `ws` (all `[n_i, k]`) into one linear whose
    /// [`forward_parts`](Self::forward_parts) writes each part's output
    /// separately; packed only when every part is exactly bf16.
    pub fn fused(ws: Vec<Weight>) -> crate::error::Result<Self> {
        let k = ws.first().map_or(0, |w| w.shape()[1]);
        if let Some(w) = ws
            .iter()
            .find(|w| w.shape().len() != 2 || w.shape()[1] != k)
        {
            return Err(crate::error::Error::InvalidInput(format!(
                "cannot fuse weights of shapes {:?} and {:?}: input widths differ",
                ws[0].shape(),
                w.shape()
            )));
        }
        let parts = ws.iter().map(|w| w.shape()[0]).collect();
        Ok(Self::build(k, parts, ws))
    }

    fn build(k: usize, parts: Vec<usize>, ws: Vec<Weight>) -> Self {
        let n: usize = parts.iter().sum();
        // Global row j → (part, row in part).
        let mut owner = Vec::with_capacity(n);
        for (pi, &np) in parts.iter().enumerate() {
            owner.extend((0..np).map(|r| (pi, r)));
        }
        let packed = PackedMatrix::pack(k, n.div_ceil(NR), PackedDtype::Bf16, true, |p, c, buf| {
            let j = p * NR + c;
            if let Some(&(pi, r)) = owner.get(j) {
                ws[pi].row_to_f32(r, buf);
            }
            j < n
        })
        .ok()
        .and_then(PackedMatrix::into_bf16);
        Linear {
            shape: [n, k],
            parts,
            form: match packed {
                Some(p) => Form::Packed(p),
                None => Form::Plain(ws),
            },
        }
    }

    /// `[n, k]` (all parts together).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Output rows of each part.
    pub fn parts(&self) -> &[usize] {
        &self.parts
    }

    /// Whether calls run on the packed panels.
    pub fn is_packed(&self) -> bool {
        matches!(self.form, Form::Packed(_))
    }

    /// Weight bytes one call reads (what bounds a decode step).
    pub fn bytes(&self) -> usize {
        match &self.form {
            Form::Packed(_) => self.shape[0] * self.shape[1] * 2,
            Form::Plain(ws) => ws.iter().map(|w| w.bytes().len()).sum(),
        }
    }

    /// Multiply-adds of a call on `rows` rows.
    pub fn macs(&self, rows: usize) -> usize {
        rows * self.shape[0] * self.shape[1]
    }

    /// `out[rows, n] = x[rows, k] · Wᵀ (+ bias)` with the best tier (a
    /// single-part linear).
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
        self.forward_parts_with(kern, x, rows, &[bias], &mut [out])
    }

    /// `outs[i][rows, n_i] = x[rows, k] · W_iᵀ (+ biases[i])` for every part
    /// at once, with the best tier.
    pub fn forward_parts(
        &self,
        x: &[f32],
        rows: usize,
        biases: &[Option<&[f32]>],
        outs: &mut [&mut [f32]],
    ) {
        self.forward_parts_with(kernels(), x, rows, biases, outs)
    }

    /// [`forward_parts`](Self::forward_parts) with the tier `kern`.
    pub fn forward_parts_with(
        &self,
        kern: &Kernels,
        x: &[f32],
        rows: usize,
        biases: &[Option<&[f32]>],
        outs: &mut [&mut [f32]],
    ) {
        assert!(
            outs.len() == self.parts.len() && biases.len() == self.parts.len(),
            "a linear of {} parts called with {} outputs and {} biases",
            self.parts.len(),
            outs.len(),
            biases.len()
        );
        let data = match &self.form {
            Form::Plain(ws) => {
                for ((w, b), out) in ws.iter().zip(biases).zip(outs.iter_mut()) {
                    linear(x, rows, w, *b, out);
                }
                return;
            }
            Form::Packed(d) => d,
        };
        let [n, k] = self.shape;
        debug_assert_eq!(x.len(), rows * k);
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
        let mut j0 = 0;
        for ((&np, bias), out) in self.parts.iter().zip(biases).zip(outs.iter_mut()) {
            debug_assert_eq!(out.len(), rows * np);
            for (t, row) in out.chunks_exact_mut(np).enumerate() {
                for (jj, o) in row.iter_mut().enumerate() {
                    let j = j0 + jj;
                    let (p, c) = (j / NR, j % NR);
                    *o = tmp[(p * rows + t) * NR + c] + bias.map_or(0.0, |b| b[jj]);
                }
            }
            j0 += np;
        }
    }
}

/// A dense MLP or shared expert (`down(act(gate(x)) * up(x))`) on packed
/// projections: the model's own copy of a [`GatedMlp`], which stays the
/// plain form the portable expert twin (`LocalExperts`) runs.
pub struct DenseMlp {
    /// gate and up stacked: one pass over the input.
    gate_up: Linear,
    down: Linear,
    activation: Activation,
    gate_bias: Option<Vec<f32>>,
    up_bias: Option<Vec<f32>>,
    down_bias: Option<Vec<f32>>,
}

impl TryFrom<GatedMlp> for DenseMlp {
    type Error = crate::error::Error;
    fn try_from(m: GatedMlp) -> crate::error::Result<Self> {
        Ok(DenseMlp {
            gate_up: Linear::fused(vec![m.gate, m.up])?,
            down: Linear::new(m.down),
            activation: m.activation,
            gate_bias: m.gate_bias,
            up_bias: m.up_bias,
            down_bias: m.down_bias,
        })
    }
}

impl DenseMlp {
    /// Output width (the model's hidden size).
    pub fn hidden(&self) -> usize {
        self.down.shape()[0]
    }

    /// Weight bytes and multiply-adds of a call on `rows` rows.
    pub fn work(&self, rows: usize) -> (usize, usize) {
        (
            self.gate_up.bytes() + self.down.bytes(),
            self.gate_up.macs(rows) + self.down.macs(rows),
        )
    }

    /// Applies the MLP to `[rows, hidden]` and writes `[rows, hidden]`, as
    /// [`GatedMlp::forward`] does.
    pub fn forward(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        gated_forward(
            self.activation,
            self.gate_up.parts()[0],
            rows,
            |g, u| {
                self.gate_up.forward_parts(
                    x,
                    rows,
                    &[self.gate_bias.as_deref(), self.up_bias.as_deref()],
                    &mut [g, u],
                )
            },
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

    /// Stacked parts (q/k/v-like widths that straddle panels) give each
    /// part what its own plain linear gives, with its own bias, on every
    /// tier; a part that is not bf16 keeps the whole stack plain.
    #[test]
    fn fused_parts_match_each_part_alone() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let k = 70;
        let widths = [40usize, 9, 23];
        let ws: Vec<Weight> = widths
            .iter()
            .map(|&n| bf16_weight(n, k, &mut rng))
            .collect();
        let biases: Vec<Vec<f32>> = widths
            .iter()
            .map(|&n| (0..n).map(|_| rng.random_range(-1.0..1.0)).collect())
            .collect();
        let fused = Linear::fused(ws.clone()).expect("same input width");
        assert!(fused.is_packed());
        assert_eq!(fused.parts(), &widths);
        for rows in [1usize, 6, 17] {
            let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let want: Vec<Vec<f32>> = ws
                .iter()
                .zip(&biases)
                .map(|(w, b)| {
                    let mut o = vec![0.0f32; rows * w.shape()[0]];
                    linear(&x, rows, w, Some(b), &mut o);
                    o
                })
                .collect();
            for tier in Tier::available() {
                let Some(kern) = Kernels::for_tier(tier) else {
                    continue;
                };
                let mut got: Vec<Vec<f32>> =
                    widths.iter().map(|&n| vec![f32::NAN; rows * n]).collect();
                let [a, b, c] = &mut got[..] else {
                    unreachable!("three parts")
                };
                let bs: Vec<Option<&[f32]>> = biases.iter().map(|b| Some(&b[..])).collect();
                fused.forward_parts_with(&kern, &x, rows, &bs, &mut [a, b, c]);
                for (p, (g, w)) in got.iter().zip(&want).enumerate() {
                    for (i, (a, b)) in g.iter().zip(w).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                            "tier {} rows {rows} part {p} out {i}: {a} vs {b}",
                            tier.name()
                        );
                    }
                }
            }
        }
        let plain = Weight::from_f32(vec![2, k], &vec![0.1f32; 2 * k]);
        let mixed = Linear::fused(vec![ws[0].clone(), plain.clone()]).expect("fuse");
        assert!(!mixed.is_packed());
        let x = vec![1.0f32; k];
        let (mut a, mut b) = (vec![0.0f32; widths[0]], vec![0.0f32; 2]);
        mixed.forward_parts(&x, 1, &[None, None], &mut [&mut a, &mut b]);
        let mut want = vec![0.0f32; 2];
        linear(&x, 1, &plain, None, &mut want);
        assert_eq!(b, want);
        assert!(Linear::fused(vec![ws[0].clone(), bf16_weight(3, k + 1, &mut rng)]).is_err());
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
