//! Dense linear layers (`y = x·Wᵀ + b`) on the packed panels and the very
//! panel runner the experts use ([`run_panels`]): a weight that is exactly
//! bf16-representable (every bf16 checkpoint, and the bf16-rounded f32
//! fixtures) is repacked once at load into 16-channel bf16 panels; with
//! `--dense-dtype int8` it is requantized to int8 W8A8 panels
//! ([`Linear::to_int8`]). Every call runs the best tier
//! (`kernels::dispatch`, `EPSERVE_KERNEL` to force one): decode streams each
//! panel once over the whole K; prefill takes blocks of [`MB`] rows against
//! runs of panels (the two-panel tile, or AMX tiles where the CPU has them),
//! in parallel over (row block, panel run). Other weights (f16, true f32)
//! keep the plain [`kernels::linear`](crate::kernels::linear), which is also
//! this path's scalar twin in the tests. [`DenseMlp`] is a dense MLP or
//! shared expert on such projections.

use rayon::prelude::*;

use crate::config::Activation;
use crate::experts::executor::to_bf16_row;
use crate::experts::packed::{PackedDtype, PackedMatrix};
use crate::experts::run::{
    Item, pack_pairs_b16_stream, pack_pairs_f32_stream, run_panels, takes_pairs_b16,
    takes_pairs_f32,
};
use crate::kernels::b12::b12_enabled;
use crate::kernels::dispatch::{Kernels, kernels};
use crate::kernels::layout::{NR, Src, bf16_padded_k, i8_padded_k, quantize_row_i8};
use crate::kernels::linear;
use crate::mem::Out;
use crate::moe::mlp::{GatedMlp, gated_forward};
use crate::tensor::Weight;

/// Rows per block on the prefill path: a block's activations (f32, K up to
/// a few thousand) stay in L2 while runs of panels stream past them.
pub const MB: usize = 64;
/// Below this many multiply-adds a call stays on the calling thread.
const PAR_THRESHOLD: usize = 1 << 16;
/// Work items per thread (load balance vs. scheduling overhead).
const ITEMS_PER_THREAD: usize = 4;

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
    /// bf16 panels take bf16-rounded activations (`--dense-dtype bf16`).
    bf16_activations: bool,
}

enum Form {
    /// bf16 or int8 panels of all parts' rows, `n.div_ceil(16)` panels (a
    /// panel may straddle two parts).
    Packed(PackedMatrix),
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
        .map(|p| if b12_enabled() { p.into_b12() } else { p });
        Linear {
            shape: [n, k],
            parts,
            bf16_activations: false,
            form: match packed {
                Some(p) => Form::Packed(p),
                None => Form::Plain(ws),
            },
        }
    }

    /// Row `j` of the stacked weight as f32 (exact for bf16 panels).
    fn row_f32(&self, j: usize, buf: &mut [f32]) {
        let k = self.shape[1];
        match &self.form {
            Form::Plain(ws) => {
                let mut r = j;
                for w in ws {
                    if r < w.shape()[0] {
                        return w.row_to_f32(r, buf);
                    }
                    r -= w.shape()[0];
                }
            }
            // Already int8: zeros (callers check the dtype).
            Form::Packed(pm) => pm.channel_f32(j / NR, j % NR, &mut buf[..k]),
        }
    }

    /// Applies `--dense-dtype`: int8 requantizes, bf16 rounds the
    /// activations of bf16 panels, auto leaves it as loaded.
    pub fn set_dtype(&mut self, dtype: crate::experts::DenseDtype) {
        match dtype {
            crate::experts::DenseDtype::Auto => {}
            crate::experts::DenseDtype::Bf16 => self.to_bf16_activations(),
            crate::experts::DenseDtype::Int8 => self.to_int8(),
        }
    }

    /// bf16 panels take their activations rounded to bf16 from now on (the
    /// bf16 dot tile where the tier has one); a no-op on other forms.
    pub fn to_bf16_activations(&mut self) {
        self.bf16_activations = self.dtype() == Some(PackedDtype::Bf16);
    }

    /// Stores bf16 panels as B12 (`on`) or back as plain bf16 panels: the
    /// same values either way (lossless), 0.75x the bytes a decode call
    /// streams as B12 (with f32 or bf16 activations). A no-op on other forms.
    pub fn set_b12(&mut self, on: bool) {
        let form = std::mem::replace(&mut self.form, Form::Plain(Vec::new()));
        self.form = match form {
            Form::Packed(p) if on => Form::Packed(p.into_b12()),
            Form::Packed(p) => Form::Packed(p.into_plain_bf16()),
            f => f,
        };
    }

    /// Whether the panels are stored as B12.
    pub fn is_b12(&self) -> bool {
        matches!(&self.form, Form::Packed(p) if p.is_b12())
    }

    /// Whether calls round the activations to bf16.
    pub fn bf16_activations(&self) -> bool {
        self.bf16_activations
    }

    /// Requantizes the weights to int8 panels (per-output-channel symmetric
    /// scales; activations are quantized per row at each call: W8A8).
    pub fn to_int8(&mut self) {
        if self.dtype() == Some(PackedDtype::Int8) {
            return;
        }
        // Rows are read one at a time: from bf16 panels, not by decoding a
        // B12 panel per row.
        self.set_b12(false);
        let [n, k] = self.shape;
        let mut tmp = vec![0.0f32; k];
        let packed =
            PackedMatrix::pack(k, n.div_ceil(NR), PackedDtype::Int8, false, |p, c, buf| {
                let j = p * NR + c;
                if j < n {
                    self.row_f32(j, &mut tmp);
                    buf.copy_from_slice(&tmp);
                }
                j < n
            });
        if let Ok(p) = packed {
            self.form = Form::Packed(p);
            self.bf16_activations = false;
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

    /// The packed precision, `None` on the plain path.
    pub fn dtype(&self) -> Option<PackedDtype> {
        match &self.form {
            Form::Packed(p) => Some(p.dtype()),
            Form::Plain(_) => None,
        }
    }

    /// Weight bytes one call reads (what bounds a decode step).
    pub fn bytes(&self) -> usize {
        match &self.form {
            Form::Packed(p) => p.bytes(),
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
        let pm = match &self.form {
            Form::Plain(ws) => {
                for ((w, b), out) in ws.iter().zip(biases).zip(outs.iter_mut()) {
                    linear(x, rows, w, *b, out);
                }
                return;
            }
            Form::Packed(pm) => pm,
        };
        let [n, k] = self.shape;
        debug_assert_eq!(x.len(), rows * k);
        if rows == 0 || n == 0 {
            return;
        }
        let parallel = rows * n * k >= PAR_THRESHOLD;
        // W8A8: each row's activations quantized once per call.
        let (mut xq, mut xs) = (Vec::new(), Vec::new());
        if pm.dtype() == PackedDtype::Int8 {
            let kp = i8_padded_k(k);
            xq.resize(rows * kp, 0i8);
            xs.resize(rows, 0.0f32);
            let quant = |((q, s), xr): ((&mut [i8], &mut f32), &[f32])| *s = quantize_row_i8(xr, q);
            if parallel {
                xq.par_chunks_mut(kp)
                    .zip(xs.par_iter_mut())
                    .zip(x.par_chunks(k))
                    .for_each(quant);
            } else {
                xq.chunks_mut(kp)
                    .zip(xs.iter_mut())
                    .zip(x.chunks(k))
                    .for_each(quant);
            }
        }
        // bf16 activations: each row rounded once per call, zero-padded to
        // an even length (the dot tile takes pairs).
        let bf16x =
            self.bf16_activations && pm.dtype() == PackedDtype::Bf16 && kern.bf16x_mr().is_some();
        let kp2 = bf16_padded_k(k);
        let mut xb = Vec::new();
        if bf16x {
            xb.resize(rows * kp2, 0u16);
            if parallel {
                xb.par_chunks_mut(kp2)
                    .zip(x.par_chunks(k))
                    .for_each(|(d, xr)| to_bf16_row(xr, d));
            } else {
                xb.chunks_mut(kp2)
                    .zip(x.chunks(k))
                    .for_each(|(d, xr)| to_bf16_row(xr, d));
            }
        }
        let src = Src {
            f32_rows: x,
            f32_stride: k,
            i8_rows: &xq,
            i8_stride: i8_padded_k(k),
            i8_scales: &xs,
            b16_rows: &xb,
            b16_stride: kp2,
            f32_packed: &[],
            b16_packed: &[],
        };
        let view = pm.data_view();
        let panels = pm.panels();
        // Decode (one tile of rows) takes every row at once; prefill blocks
        // of MB rows.
        let mb = if rows <= kern.bf16_mr().max(kern.i8_mr()) {
            rows
        } else {
            MB
        };
        let blocks = rows.div_ceil(mb);
        let threads = if parallel {
            rayon::current_num_threads().max(1)
        } else {
            1
        };
        let runs_per_block = (threads * ITEMS_PER_THREAD)
            .div_ceil(blocks)
            .clamp(1, panels);
        let run = panels.div_ceil(runs_per_block);
        // Items of (row block, run of panels): each writes its rows' columns
        // of its panels straight into the outputs (disjoint between items).
        let mut work: Vec<(usize, usize, usize, usize)> = Vec::new();
        for b in 0..blocks {
            let rb = mb.min(rows - b * mb);
            for p0 in (0..panels).step_by(run) {
                work.push((b * mb, rb, p0, (p0 + run).min(panels)));
            }
        }
        // Where each part starts among the stacked output columns.
        let starts: Vec<usize> = self
            .parts
            .iter()
            .scan(0, |acc, &np| {
                let s = *acc;
                *acc += np;
                Some(s)
            })
            .collect();
        let total = self.shape[0];
        let dsts: Vec<Out> = outs
            .iter_mut()
            .zip(&self.parts)
            .map(|(o, &np)| {
                assert_eq!(o.len(), rows * np, "output part of the wrong length");
                Out::new(o)
            })
            .collect();
        // Row blocks that run on the two-panel f32 tile are packed once here,
        // not once by each of their items (the router's 8 panels made that
        // packing cost as much as its multiply-adds).
        let mut packed: Vec<Vec<f32>> = Vec::new();
        let mut packed_b16: Vec<Vec<u16>> = Vec::new();
        if bf16x && runs_per_block > 1 {
            let need = |b: usize| takes_pairs_b16(kern, &view, mb.min(rows - b * mb));
            packed_b16.resize_with(blocks, Vec::new);
            let pack = |(b, xp): (usize, &mut Vec<u16>)| {
                if need(b) {
                    let rb = mb.min(rows - b * mb);
                    pack_pairs_b16_stream(kern, k, rb, &|i| b * mb + i, &src, xp);
                }
            };
            if parallel {
                packed_b16.par_iter_mut().enumerate().for_each(pack);
            } else {
                packed_b16.iter_mut().enumerate().for_each(pack);
            }
        }
        if !bf16x && runs_per_block > 1 {
            let need = |b: usize| takes_pairs_f32(kern, &view, mb.min(rows - b * mb));
            packed.resize_with(blocks, Vec::new);
            let pack = |(b, xp): (usize, &mut Vec<f32>)| {
                if need(b) {
                    let rb = mb.min(rows - b * mb);
                    pack_pairs_f32_stream(kern, k, rb, &|i| b * mb + i, &src, xp);
                }
            };
            if parallel {
                packed.par_iter_mut().enumerate().for_each(pack);
            } else {
                packed.iter_mut().enumerate().for_each(pack);
            }
        }
        let (parts, dsts, starts) = (&self.parts[..], &dsts[..], &starts[..]);
        // Row `row`'s stacked columns `j..j + val.len()` (inside one part
        // `q`), plus that part's bias.
        let put = |row: usize, q: usize, j: usize, val: &[f32]| {
            let (np, c) = (parts[q], j - starts[q]);
            // SAFETY: (row, column) pairs belong to one item alone.
            let dst = unsafe { dsts[q].run_mut(row * np + c, val.len()) };
            match (biases[q], <&mut [f32; NR]>::try_from(&mut *dst)) {
                // A whole panel: a fixed-size copy (no `memcpy` call).
                (None, Ok(d)) => d.copy_from_slice(&val[..NR]),
                (None, Err(_)) => dst.copy_from_slice(val),
                (Some(b), _) => {
                    for ((d, v), b) in dst.iter_mut().zip(val).zip(&b[c..]) {
                        *d = v + b;
                    }
                }
            }
        };
        let go = |(r0, rb, p0, p1): (usize, usize, usize, usize)| {
            let it = Item {
                e: 0,
                p0: p0 as u32,
                p1: p1 as u32,
            };
            let src = Src {
                f32_packed: packed.get(r0 / mb).map_or(&[][..], |p| &p[..]),
                b16_packed: packed_b16.get(r0 / mb).map_or(&[][..], |p| &p[..]),
                ..src
            };
            run_panels(
                kern,
                bf16x,
                &view,
                k,
                rb,
                &it,
                &|i| r0 + i,
                &src,
                |i, p, val| {
                    let row = r0 + i;
                    let (j0, j1) = (p * NR, (p * NR + NR).min(total));
                    // The part holding column j0 (parts are few).
                    let mut q = starts.partition_point(|&s| s <= j0) - 1;
                    if j1 <= starts[q] + parts[q] {
                        put(row, q, j0, &val[..j1 - j0]);
                        return;
                    }
                    // A panel straddling parts (widths not multiples of 16).
                    let mut j = j0;
                    while j < j1 {
                        while j >= starts[q] + parts[q] {
                            q += 1;
                        }
                        let e = (starts[q] + parts[q]).min(j1);
                        put(row, q, j, &val[j - j0..e - j0]);
                        j = e;
                    }
                },
            );
        };
        if parallel {
            work.into_par_iter().for_each(go);
        } else {
            work.into_iter().for_each(go);
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

    /// The projections (gate/up stack, down), for requantizing.
    pub fn linears_mut(&mut self) -> [&mut Linear; 2] {
        [&mut self.gate_up, &mut self.down]
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
            // Below, at and above each tier's tile height, and more than one
            // row block (MB) with a partial last block.
            for rows in [1usize, 5, 13, 40, MB + 6, 2 * MB + 3] {
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

    /// `--dense-dtype bf16`: on tiers with a bf16 dot tile the activations
    /// are rounded to bf16 (the twin: the plain linear on rounded rows), on
    /// the decode and on the prefill path, with the dot tile on prefill
    /// forced on and off (off: the FMA tiles on the rounded rows); tiers
    /// without the tile keep f32 activations.
    #[test]
    fn bf16_activations_match_the_twin_on_rounded_rows() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for &(n, k) in &[(37, 1031), (100, 64), (3, 7)] {
            let w = bf16_weight(n, k, &mut rng);
            let mut lin = Linear::fused(vec![w.clone()]).expect("one part");
            lin.set_dtype(crate::experts::DenseDtype::Bf16);
            assert!(lin.bf16_activations());
            // bf16 panels and B12 (the B12 dot tile where it is fast, else
            // the B12 tile on the rounded rows up to `b12_direct_rows`; the
            // decoded panels past it).
            for (b12, rows) in [false, true]
                .into_iter()
                .flat_map(|b| [1usize, 5, 13, 24, 25, MB + 6].map(|r| (b, r)))
            {
                lin.set_b12(b12);
                assert_eq!(lin.is_b12(), b12);
                assert!(lin.bf16_activations());
                let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let xr: Vec<f32> = x
                    .iter()
                    .map(|&v| crate::kernels::layout::bf16_bits_to_f32(f32_to_bf16_bits(v)))
                    .collect();
                let (mut want_f32, mut want_b16) = (vec![0.0f32; rows * n], vec![0.0f32; rows * n]);
                linear(&x, rows, &w, None, &mut want_f32);
                linear(&xr, rows, &w, None, &mut want_b16);
                for tier in Tier::available() {
                    for prefill_dot in [false, true] {
                        let Some(kern) = Kernels::for_tier(tier) else {
                            continue;
                        };
                        let kern = kern.with_bf16x_prefill(prefill_dot);
                        // Rounded on every tier with a bf16 dot, on the
                        // decode and the prefill path alike (where no bf16
                        // tile runs a block, the FMA tiles read it rounded).
                        let rounded = |_: usize| kern.bf16x_mr().is_some();
                        let mut got = vec![f32::NAN; rows * n];
                        lin.forward_with(&kern, &x, rows, None, &mut got);
                        for (i, a) in got.iter().enumerate() {
                            let rounded = rounded(i / n);
                            let b = if rounded { &want_b16[i] } else { &want_f32[i] };
                            assert!(
                                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                                "tier {} (dot on prefill: {prefill_dot}, B12: {b12}) n {n} k {k} rows {rows} out {i}: {a} vs {b} (rounded twin: {rounded})",
                                tier.name()
                            );
                        }
                    }
                }
            }
        }
        // int8 afterwards drops the flag; auto leaves a linear as loaded.
        let mut lin = Linear::new(bf16_weight(16, 32, &mut rng));
        lin.set_dtype(crate::experts::DenseDtype::Auto);
        assert!(!lin.bf16_activations());
        lin.set_dtype(crate::experts::DenseDtype::Bf16);
        lin.set_dtype(crate::experts::DenseDtype::Int8);
        assert!(!lin.bf16_activations() && lin.dtype() == Some(PackedDtype::Int8));
    }

    /// B12 storage on every tier: prefill rows (decoded panels on the bf16
    /// paths) give the bf16 panels' results bit for bit; decode rows (the
    /// B12 tile) give the scalar twin's bits and the plain linear's values,
    /// and up to 6 rows on tiers with a native B12 tile the bf16 panels'
    /// bits too (the same summation order); requantizing to int8 from B12
    /// gives what it gives from bf16; bf16 activations take the panels back
    /// to bf16.
    #[test]
    fn b12_linear_equals_the_bf16_panels_and_the_twin_on_every_tier() {
        use crate::experts::run::b12_direct_rows;
        let mut rng = rand::rngs::StdRng::seed_from_u64(1212);
        let twin = Kernels::generic();
        for &(n, k) in &[(37, 1031), (100, 64), (3, 7), (70, 2050)] {
            let w = bf16_weight(n, k, &mut rng);
            let bias: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut plain_panels = Linear::new(w.clone());
            plain_panels.set_b12(false);
            let mut b12 = Linear::new(w.clone());
            b12.set_b12(true);
            assert!(b12.is_b12() && !plain_panels.is_b12());
            assert!(b12.bytes() < plain_panels.bytes());
            // Row blocks (of MB rows) either all decode or all prefill (the
            // last block's 30 rows are past every tier's `b12_direct_rows`).
            for rows in [1usize, 3, 4, 5, 8, 12, 13, 24, 25, 40, MB + 30] {
                let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut want = vec![0.0f32; rows * n];
                linear(&x, rows, &w, Some(&bias), &mut want);
                let mut from_twin = vec![f32::NAN; rows * n];
                b12.forward_with(&twin, &x, rows, Some(&bias), &mut from_twin);
                for tier in Tier::available() {
                    let Some(kern) = Kernels::for_tier(tier) else {
                        continue;
                    };
                    let tag = format!("tier {} n {n} k {k} rows {rows}", tier.name());
                    let mut got = vec![f32::NAN; rows * n];
                    b12.forward_with(&kern, &x, rows, Some(&bias), &mut got);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    let mut bf = vec![f32::NAN; rows * n];
                    plain_panels.forward_with(&kern, &x, rows, Some(&bias), &mut bf);
                    // Rows the tier's bf16 decode tile sums in two chains
                    // (AVX2's and NEON's sum `k` and `k + 1` in one, at
                    // every tile size, so that a row's bits do not depend
                    // on its batch).
                    let two_chains = match tier {
                        Tier::Avx2 => 0,
                        Tier::Neon | Tier::NeonDot | Tier::NeonI8mm | Tier::NeonBf16 => 0,
                        _ => 6,
                    };
                    let direct = b12_direct_rows(&kern);
                    if rows > direct || kern.b12_native() && rows <= two_chains {
                        assert_eq!(bits(&got), bits(&bf), "{tag}: as the bf16 panels");
                    }
                    if rows <= direct {
                        assert_eq!(bits(&got), bits(&from_twin), "{tag}: decode");
                    }
                    for (a, b) in got.iter().zip(&want) {
                        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{tag}: {a} vs {b}");
                    }
                }
            }
            let (mut q1, mut q2) = (Linear::new(w.clone()), Linear::new(w.clone()));
            q1.set_b12(true);
            q2.set_b12(false);
            q1.to_int8();
            q2.to_int8();
            let x: Vec<f32> = (0..3 * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let (mut y1, mut y2) = (vec![0.0f32; 3 * n], vec![1.0f32; 3 * n]);
            q1.forward(&x, 3, None, &mut y1);
            q2.forward(&x, 3, None, &mut y2);
            assert_eq!(y1, y2, "int8 from B12 and from bf16");
            b12.to_bf16_activations();
            assert!(b12.is_b12() && b12.bf16_activations());
        }
    }

    /// f32 activations on AMX tiles (each row as three bf16 terms) are as
    /// exact as the f32 FMA tiles: against an f64 reference, no worse than
    /// four times the FMA tier's largest error, where rounding the
    /// activations to bf16 alone would be hundreds of times worse.
    #[test]
    fn amx_f32_activations_are_as_exact_as_the_fma_tiles() {
        let (Some(amx), Some(fma)) = (
            Kernels::for_tier(Tier::Amx),
            Kernels::for_tier(Tier::Avx512Bf16),
        ) else {
            eprintln!("SKIPPED: no AMX on this CPU");
            return;
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        for &(n, k, rows) in &[(48, 2048, 7), (37, 1031, 2), (100, 4100, MB + 5)] {
            let w = bf16_weight(n, k, &mut rng);
            let wf: Vec<f32> = w.to_f32_vec();
            let lin = Linear::new(w);
            let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut exact = vec![0.0f64; rows * n];
            for r in 0..rows {
                for c in 0..n {
                    exact[r * n + c] = (0..k)
                        .map(|j| x[r * k + j] as f64 * wf[c * k + j] as f64)
                        .sum();
                }
            }
            let err = |kern: &Kernels| {
                let mut got = vec![f32::NAN; rows * n];
                lin.forward_with(kern, &x, rows, None, &mut got);
                got.iter()
                    .zip(&exact)
                    .map(|(&a, &b)| (a as f64 - b).abs())
                    .fold(0.0f64, f64::max)
            };
            let (e_amx, e_fma) = (err(&amx), err(&fma));
            eprintln!("n {n} k {k} rows {rows}: AMX error {e_amx:e}, FMA error {e_fma:e}");
            assert!(
                e_fma > 0.0 && e_amx <= 4.0 * e_fma,
                "{e_amx:e} vs {e_fma:e}"
            );
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
        // The middle part has no bias: panels straddling parts are written
        // with and without one. 70 rows: two row blocks of `MB`.
        let bs: Vec<Option<&[f32]>> = biases
            .iter()
            .enumerate()
            .map(|(i, b)| (i != 1).then_some(&b[..]))
            .collect();
        for rows in [1usize, 6, 17, 70] {
            let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let want: Vec<Vec<f32>> = ws
                .iter()
                .zip(&bs)
                .map(|(w, b)| {
                    let mut o = vec![0.0f32; rows * w.shape()[0]];
                    linear(&x, rows, w, *b, &mut o);
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

    /// int8 W8A8: every tier gives the same bits (integer accumulation, one
    /// dequantization expression), close to the bf16 result.
    #[test]
    fn int8_linear_is_identical_on_every_tier_and_close_to_bf16() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (n, k) = (53, 300);
        let w = bf16_weight(n, k, &mut rng);
        let mut lin = Linear::fused(vec![w.clone()]).expect("one part");
        lin.to_int8();
        assert_eq!(lin.dtype(), Some(PackedDtype::Int8));
        assert!(lin.bytes() < n * k * 2, "int8 reads fewer bytes than bf16");
        for rows in [1usize, 4, MB + 9] {
            let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut want = vec![0.0f32; rows * n];
            linear(&x, rows, &w, None, &mut want);
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let mut first: Option<Vec<f32>> = None;
            for tier in Tier::available() {
                let Some(kern) = Kernels::for_tier(tier) else {
                    continue;
                };
                let mut got = vec![f32::NAN; rows * n];
                lin.forward_with(&kern, &x, rows, None, &mut got);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= 0.02 * scale,
                        "tier {} rows {rows} out {i}: int8 {a} vs bf16 {b}",
                        tier.name()
                    );
                }
                match &first {
                    None => first = Some(got),
                    Some(f) => assert_eq!(f, &got, "tier {} differs", tier.name()),
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
