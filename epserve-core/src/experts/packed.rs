//! Experts in the kernels' packed layout (see [`crate::kernels::layout`]):
//! what stays resident after load. One [`PackedExpert`] is a fused gate/up
//! matrix, a down matrix, optional biases and the activation; each expert is
//! bf16 or int8 on its own, so a placement may mix precisions.

use bytemuck::Pod;

use crate::config::Activation;
use crate::error::{Error, Result};
use crate::kernels::b12::B12Panels;
use crate::kernels::layout::{
    DataView, NR, PAIR_BLOCK, bf16_bits_to_f32, bf16_index, bf16_padded_k, f32_to_bf16_bits,
    i8_index, i8_padded_k, pack_bf16_panel, pack_i8_panel, quantize_row_i8,
};
use crate::loader::weights::I8Matrix;
use crate::mem::ZeroBuf;
use crate::moe::mlp::GatedMlp;
use crate::tensor::{Weight, WeightSlice};
use half::bf16;

/// Prefix of the error [`ExpertDtype::Auto`](super::ExpertDtype::Auto)
/// packing returns when a weight is not exactly representable in bf16.
pub(crate) const NOT_BF16_EXACT: &str = "not bf16-exact";

/// A 64-byte aligned buffer of `len` plain values (panels start on cache
/// lines); one of at least 2 MiB is on huge pages ([`crate::mem::ZeroBuf`]).
#[derive(Clone)]
pub struct AlignedBuf<T: Pod> {
    buf: ZeroBuf<T>,
}

impl<T: Pod> AlignedBuf<T> {
    /// `len` zero values, from fresh zero pages (no writes: a large buffer
    /// is untouched until packed into).
    fn zeroed(len: usize) -> Self {
        AlignedBuf {
            buf: ZeroBuf::zeroed(len),
        }
    }

    /// A buffer of `len` values: one of `spare` with exactly that length if
    /// there is one (touched memory: no page faults, no allocator churn),
    /// else fresh zeroed memory. A reused buffer is zeroed again unless the
    /// caller overwrites every value (`overwritten`: no padding to keep zero).
    fn take_or_zeroed(len: usize, spare: &mut Vec<AlignedBuf<T>>, overwritten: bool) -> Self {
        match spare.iter().position(|b| b.buf.len() == len) {
            Some(i) => {
                let mut b = spare.swap_remove(i);
                if !overwritten {
                    b.buf.fill(T::zeroed());
                }
                b
            }
            None => Self::zeroed(len),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.buf
    }

    fn from_slice(v: &[T]) -> Self {
        AlignedBuf {
            buf: ZeroBuf::from_slice(v),
        }
    }

    /// The values.
    pub fn as_slice(&self) -> &[T] {
        &self.buf
    }
}

/// Element buffers of packed experts that left (evicted), for packing others
/// into: a tiered executor's miss reuses the memory of the expert it evicts,
/// so the process's memory stays what its budget counts (freed buffers
/// retained by the allocator's per-thread arenas would not be counted) and
/// the copy touches no fresh pages.
#[derive(Default)]
pub struct Spare {
    bf16: Vec<AlignedBuf<u16>>,
    i8: Vec<AlignedBuf<i8>>,
}

impl Spare {
    /// Takes the buffers of `p` (its biases and scales are dropped).
    pub fn add(&mut self, p: PackedExpert) {
        for m in [p.gate_up, p.down] {
            match m.data {
                PackedData::Bf16(b) => self.bf16.push(b),
                PackedData::I8 { data, .. } => self.i8.push(data),
                // Not reusable by the packings that take spare buffers.
                PackedData::B12(_) => {}
            }
        }
    }

    /// Fills every held buffer with a non-zero pattern (tests: what a
    /// reused buffer holds must not leak into the next packing).
    #[cfg(test)]
    pub(crate) fn scribble(&mut self) {
        for b in &mut self.bf16 {
            b.buf.fill(0x5a5a);
        }
        for b in &mut self.i8 {
            b.buf.fill(0x5a);
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bf16.iter().map(|b| b.buf.len() * 2).sum::<usize>()
            + self.i8.iter().map(|b| b.buf.len()).sum::<usize>()
    }
}

/// Element storage of a packed matrix.
#[derive(Clone)]
pub enum PackedData {
    /// bf16 bit patterns, `panels · bf16_padded_k(K) · 16`.
    Bf16(AlignedBuf<u16>),
    /// int8 values, `panels · Kp · 16`, and one scale per logical channel
    /// (`panels · 16`).
    I8 {
        data: AlignedBuf<i8>,
        scales: Vec<f32>,
    },
    /// The bf16 panels stored losslessly in 12 bits a weight
    /// ([`crate::kernels::b12`]): the same values, 0.75x the bytes a decode
    /// step streams. Its precision is bf16.
    B12(Box<B12Panels>),
}

/// A weight matrix in panel layout: `panels · 16` logical output channels
/// (padding channels are zero) over `k` inputs.
#[derive(Clone)]
pub struct PackedMatrix {
    k: usize,
    panels: usize,
    data: PackedData,
}

/// The precision of a packed matrix or expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackedDtype {
    Bf16,
    Int8,
}

impl PackedDtype {
    /// `bf16` or `int8`.
    pub fn as_str(self) -> &'static str {
        match self {
            PackedDtype::Bf16 => "bf16",
            PackedDtype::Int8 => "int8",
        }
    }
}

impl PackedMatrix {
    /// Packs `panels` panels over `k` inputs; `source(p, c, buf)` fills `buf`
    /// (length `k`) with logical channel `c` of panel `p` and returns false
    /// for a padding channel. `exact` makes bf16 packing fail instead of
    /// rounding.
    pub fn pack(
        k: usize,
        panels: usize,
        dtype: PackedDtype,
        exact: bool,
        mut source: impl FnMut(usize, usize, &mut [f32]) -> bool,
    ) -> Result<Self> {
        let mut buf = vec![0.0f32; k];
        let mut rows_b = vec![vec![0u16; k]; NR];
        let mut rows_q = vec![vec![0i8; k]; NR];
        let mut present = [false; NR];
        Ok(match dtype {
            PackedDtype::Bf16 => {
                let mut out = Vec::with_capacity(panels * k * NR);
                for p in 0..panels {
                    for c in 0..NR {
                        present[c] = source(p, c, &mut buf);
                        if present[c] {
                            for (d, &v) in rows_b[c].iter_mut().zip(&buf) {
                                *d = f32_to_bf16_bits(v);
                                if exact && bf16_bits_to_f32(*d) != v && !v.is_nan() {
                                    return Err(Error::Dispatch(format!(
                                        "{NOT_BF16_EXACT}: value {v} rounds to {}",
                                        bf16_bits_to_f32(*d)
                                    )));
                                }
                            }
                        }
                    }
                    pack_bf16_panel(k, |c| present[c].then(|| &rows_b[c][..]), &mut out);
                }
                PackedMatrix {
                    k,
                    panels,
                    data: PackedData::Bf16(AlignedBuf::from_slice(&out)),
                }
            }
            PackedDtype::Int8 => {
                let mut out = Vec::with_capacity(panels * i8_padded_k(k) * NR);
                let mut scales = vec![0.0f32; panels * NR];
                for p in 0..panels {
                    for c in 0..NR {
                        present[c] = source(p, c, &mut buf);
                        if present[c] {
                            scales[p * NR + c] = quantize_row_i8(&buf, &mut rows_q[c]);
                        }
                    }
                    pack_i8_panel(k, |c| present[c].then(|| &rows_q[c][..]), &mut out);
                }
                PackedMatrix {
                    k,
                    panels,
                    data: PackedData::I8 {
                        data: AlignedBuf::from_slice(&out),
                        scales,
                    },
                }
            }
        })
    }

    /// Packs rows that are bf16 already, bit for bit, straight into the
    /// aligned buffer (no f32 round trip, no intermediate copy): `row(p, c)`
    /// gives logical channel `c` of panel `p` (`k` values) or `None` for
    /// padding. What a tiered executor's miss costs, so it is a blocked
    /// transpose: 16 pairs of every channel at a time, written in order.
    pub fn pack_bf16_bits<'a>(
        k: usize,
        panels: usize,
        row: impl Fn(usize, usize) -> Option<&'a [bf16]>,
        spare: &mut Spare,
    ) -> Self {
        let kp = bf16_padded_k(k);
        // Every value is written when no channel is padding and K is even.
        let full = kp == k && (0..panels).all(|p| (0..NR).all(|c| row(p, c).is_some()));
        let mut buf = AlignedBuf::<u16>::take_or_zeroed(panels * kp * NR, &mut spare.bf16, full);
        let dst = buf.as_mut_slice();
        const QB: usize = 16;
        let kern = crate::kernels::dispatch::kernels();
        for p in 0..panels {
            let panel = &mut dst[p * kp * NR..(p + 1) * kp * NR];
            let rows: [Option<&[bf16]>; NR] = std::array::from_fn(|c| row(p, c));
            let pairs = k / 2;
            // A pair of one channel is one 32-bit word: the panel is the
            // transpose of the channels' pair streams.
            let words: &mut [u32] = bytemuck::cast_slice_mut(&mut panel[..pairs * 2 * NR]);
            let mut q0 = 0;
            // Whole blocks of every channel transposed in registers.
            if rows.iter().all(Option::is_some) {
                // All present: `unwrap_or_default` never takes its default.
                let all: [&[bf16]; NR] = std::array::from_fn(|c| rows[c].unwrap_or_default());
                while q0 + PAIR_BLOCK <= pairs {
                    let block: [&[u16]; NR] = std::array::from_fn(|c| {
                        bytemuck::cast_slice(&all[c][2 * q0..2 * (q0 + PAIR_BLOCK)])
                    });
                    kern.transpose_pairs(&block, &mut words[q0 * NR..(q0 + PAIR_BLOCK) * NR]);
                    q0 += PAIR_BLOCK;
                }
            }
            while q0 < pairs {
                let qn = QB.min(pairs - q0);
                for (c, r) in rows.iter().enumerate() {
                    let Some(r) = r else { continue };
                    let src: &[u8] = bytemuck::cast_slice(&r[2 * q0..2 * (q0 + qn)]);
                    for (q, v) in src.chunks_exact(4).enumerate() {
                        words[(q0 + q) * NR + c] = u32::from_ne_bytes([v[0], v[1], v[2], v[3]]);
                    }
                }
                q0 += qn;
            }
            if k % 2 == 1 {
                for (c, r) in rows.iter().enumerate() {
                    if let Some(r) = r {
                        panel[bf16_index(k - 1, c)] = r[k - 1].to_bits();
                    }
                }
            }
        }
        PackedMatrix {
            k,
            panels,
            data: PackedData::Bf16(buf),
        }
    }

    /// Quantizes bf16 rows to int8 W8A8 straight into the aligned buffer
    /// (the same values and scales as [`pack`](Self::pack) on the widened
    /// rows: widening bf16 is exact), for a tiered executor's int8 misses.
    pub fn pack_i8_from_bf16<'a>(
        k: usize,
        panels: usize,
        row: impl Fn(usize, usize) -> Option<&'a [bf16]>,
        spare: &mut Spare,
    ) -> Self {
        let kp = i8_padded_k(k);
        let full = kp == k && (0..panels).all(|p| (0..NR).all(|c| row(p, c).is_some()));
        let mut buf = AlignedBuf::<i8>::take_or_zeroed(panels * kp * NR, &mut spare.i8, full);
        let mut scales = vec![0.0f32; panels * NR];
        let (mut f, mut q) = (vec![0.0f32; k], vec![0i8; k]);
        let kern = crate::kernels::dispatch::kernels();
        let dst = buf.as_mut_slice();
        for p in 0..panels {
            let panel = &mut dst[p * kp * NR..(p + 1) * kp * NR];
            for c in 0..NR {
                let Some(r) = row(p, c) else { continue };
                scales[p * NR + c] =
                    kern.quantize_bf16_row_i8(bytemuck::cast_slice(r), &mut f, &mut q);
                // Both layouts keep runs of 4 k values of one channel together.
                let runs = q.chunks_exact(4);
                let tail = runs.remainder();
                for (j, v) in runs.enumerate() {
                    let at = i8_index(4 * j, c);
                    let v: [i8; 4] = [v[0], v[1], v[2], v[3]];
                    panel[at..at + 4].copy_from_slice(&v);
                }
                for (t, &v) in tail.iter().enumerate() {
                    panel[i8_index(k - tail.len() + t, c)] = v;
                }
            }
        }
        PackedMatrix {
            k,
            panels,
            data: PackedData::I8 { data: buf, scales },
        }
    }

    /// Packs already-quantized int8 rows without touching their values:
    /// `source(p, c)` gives logical channel `c` of panel `p` as (`k` int8
    /// values in `[-127, 127]`, scale), or `None` for padding. How checkpoints
    /// that ship int8 weights (compressed-tensors W8A8) load with no float
    /// round trip.
    pub fn pack_i8<'a>(
        k: usize,
        panels: usize,
        source: impl Fn(usize, usize) -> Option<(&'a [i8], f32)>,
    ) -> Self {
        let mut out = Vec::with_capacity(panels * i8_padded_k(k) * NR);
        let mut scales = vec![0.0f32; panels * NR];
        for p in 0..panels {
            for (c, s) in scales[p * NR..(p + 1) * NR].iter_mut().enumerate() {
                *s = source(p, c).map_or(0.0, |r| r.1);
            }
            pack_i8_panel(k, |c| source(p, c).map(|r| r.0), &mut out);
        }
        PackedMatrix {
            k,
            panels,
            data: PackedData::I8 {
                data: AlignedBuf::from_slice(&out),
                scales,
            },
        }
    }

    /// Inputs per channel.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Number of 16-channel panels.
    pub fn panels(&self) -> usize {
        self.panels
    }

    /// The element storage.
    pub fn data(&self) -> &PackedData {
        &self.data
    }

    /// The bf16 panels, if this matrix holds bf16 (B12 decoded back).
    pub fn into_bf16(self) -> Option<AlignedBuf<u16>> {
        match self.into_plain_bf16().data {
            PackedData::Bf16(b) => Some(b),
            _ => None,
        }
    }

    /// The same matrix with bf16 panels stored as B12 (lossless; other
    /// forms unchanged).
    pub fn into_b12(self) -> Self {
        let PackedMatrix { k, panels, data } = self;
        let data = match data {
            PackedData::Bf16(b) => PackedData::B12(Box::new(B12Panels::encode(b.as_slice(), k))),
            d => d,
        };
        PackedMatrix { k, panels, data }
    }

    /// The same matrix with B12 panels decoded back to bf16 panels (other
    /// forms unchanged).
    pub fn into_plain_bf16(self) -> Self {
        let PackedMatrix { k, panels, data } = self;
        let data = match data {
            PackedData::B12(b) => PackedData::Bf16(AlignedBuf {
                buf: b.to_bf16_panels(crate::kernels::dispatch::kernels()),
            }),
            d => d,
        };
        PackedMatrix { k, panels, data }
    }

    /// Whether the elements are stored as B12.
    pub fn is_b12(&self) -> bool {
        matches!(self.data, PackedData::B12(_))
    }

    /// Logical channel `c` of panel `p` as f32 into `buf` (`k` values): exact
    /// for bf16 and B12; zeros for int8 (not requantized: callers check the
    /// dtype).
    pub fn channel_f32(&self, p: usize, c: usize, buf: &mut [f32]) {
        let k = self.k;
        match &self.data {
            PackedData::Bf16(d) => {
                let panel = &d.as_slice()[p * bf16_padded_k(k) * NR..];
                for (kk, v) in buf.iter_mut().enumerate().take(k) {
                    *v = bf16_bits_to_f32(panel[bf16_index(kk, c)]);
                }
            }
            PackedData::B12(b) => {
                let mut panel = vec![0u16; bf16_padded_k(k) * NR];
                b.decode_panel(p, &mut panel);
                for (kk, v) in buf.iter_mut().enumerate().take(k) {
                    *v = bf16_bits_to_f32(panel[bf16_index(kk, c)]);
                }
            }
            PackedData::I8 { .. } => buf.fill(0.0),
        }
    }

    /// The elements as the kernels' borrowed view.
    pub(crate) fn data_view(&self) -> DataView<'_> {
        match self.data() {
            PackedData::Bf16(d) => DataView::Bf16(d.as_slice()),
            PackedData::I8 { data, scales } => DataView::I8 {
                data: data.as_slice(),
                scales,
            },
            PackedData::B12(b) => DataView::B12(b.as_ref()),
        }
    }

    /// The precision (B12 holds bf16 values).
    pub fn dtype(&self) -> PackedDtype {
        match self.data {
            PackedData::Bf16(_) | PackedData::B12(_) => PackedDtype::Bf16,
            PackedData::I8 { .. } => PackedDtype::Int8,
        }
    }

    /// Address and length in bytes of the element buffer (mlock).
    pub fn element_buffer(&self) -> (*const u8, usize) {
        match &self.data {
            PackedData::Bf16(d) => (d.as_slice().as_ptr().cast(), d.as_slice().len() * 2),
            PackedData::I8 { data, .. } => (data.as_slice().as_ptr().cast(), data.as_slice().len()),
            PackedData::B12(b) => {
                let d = b.data();
                (d.as_ptr(), d.len())
            }
        }
    }

    /// Bytes a full pass over the matrix streams (elements and scales).
    pub fn bytes(&self) -> usize {
        match &self.data {
            PackedData::Bf16(d) => d.as_slice().len() * 2,
            PackedData::I8 { data, scales } => data.as_slice().len() + scales.len() * 4,
            PackedData::B12(b) => b.bytes(),
        }
    }
}

/// One expert, packed: `down(act(gate·x + bg) · (up·x + bu)) + bd`.
#[derive(Clone)]
pub struct PackedExpert {
    pub hidden: usize,
    pub inter: usize,
    /// `ceil(inter / 8)` panels over `hidden`: gate rows `8p..8p+8` in logical
    /// channels 0..8 of panel `p`, the matching up rows in 8..16.
    pub gate_up: PackedMatrix,
    /// `ceil(hidden / 16)` panels over `inter`.
    pub down: PackedMatrix,
    pub gate_bias: Option<Vec<f32>>,
    pub up_bias: Option<Vec<f32>>,
    pub down_bias: Option<Vec<f32>>,
    pub activation: Activation,
    /// bf16 experts only: round the activations to bf16 too and use the
    /// tier's bf16 dot-product tile where it has one (`vdpbf16ps`, `bfdot`;
    /// the "bf16 weights and activations, f32 accumulation"). Off,
    /// activations stay f32 (exact bf16 experts: only summation order differs
    /// from the reference).
    pub bf16_activations: bool,
}

impl PackedExpert {
    /// Packs a gated MLP (weights read from its mmap windows, widened to f32
    /// row by row). With `exact`, bf16 packing fails on any weight that bf16
    /// cannot hold exactly.
    pub fn from_mlp(mlp: &GatedMlp, dtype: PackedDtype, exact: bool) -> Result<Self> {
        Self::from_mlp_reusing(mlp, dtype, exact, &mut Spare::default())
    }

    /// [`from_mlp`](Self::from_mlp) into `spare`'s buffers where their
    /// sizes fit.
    pub fn from_mlp_reusing(
        mlp: &GatedMlp,
        dtype: PackedDtype,
        exact: bool,
        spare: &mut Spare,
    ) -> Result<Self> {
        let inter = mlp.gate.shape()[0];
        let hidden = mlp.gate.shape()[1];
        let mut p = Self::from_weights_reusing(
            &mlp.gate,
            &mlp.up,
            &mlp.down,
            hidden,
            inter,
            mlp.activation,
            dtype,
            exact,
            spare,
        )?;
        p.gate_bias = mlp.gate_bias.clone();
        p.up_bias = mlp.up_bias.clone();
        p.down_bias = mlp.down_bias.clone();
        Ok(p)
    }

    /// Packs `[inter, hidden]` gate and up and `[hidden, inter]` down weights.
    #[allow(clippy::too_many_arguments)]
    pub fn from_weights(
        gate: &Weight,
        up: &Weight,
        down: &Weight,
        hidden: usize,
        inter: usize,
        activation: Activation,
        dtype: PackedDtype,
        exact: bool,
    ) -> Result<Self> {
        Self::from_weights_reusing(
            gate,
            up,
            down,
            hidden,
            inter,
            activation,
            dtype,
            exact,
            &mut Spare::default(),
        )
    }

    /// [`from_weights`](Self::from_weights) into `spare`'s buffers where
    /// their sizes fit (bf16 checkpoints; other sources allocate).
    #[allow(clippy::too_many_arguments)]
    pub fn from_weights_reusing(
        gate: &Weight,
        up: &Weight,
        down: &Weight,
        hidden: usize,
        inter: usize,
        activation: Activation,
        dtype: PackedDtype,
        exact: bool,
        spare: &mut Spare,
    ) -> Result<Self> {
        let half = NR / 2;
        if let (WeightSlice::BF16(g), WeightSlice::BF16(u), WeightSlice::BF16(d)) =
            (gate.slice(), up.slice(), down.slice())
        {
            // bf16 in the checkpoint: bf16 bits go into the panels as they
            // are (exact by construction), int8 is quantized from them with
            // no f32 copy of the matrix.
            let gu_row = |p: usize, c: usize| {
                let (w, j) = if c < half {
                    (g, p * half + c)
                } else {
                    (u, p * half + c - half)
                };
                (j < inter).then(|| &w[j * hidden..(j + 1) * hidden])
            };
            let d_row = |p: usize, c: usize| {
                let j = p * NR + c;
                (j < hidden).then(|| &d[j * inter..(j + 1) * inter])
            };
            let (gu_panels, d_panels) = (inter.div_ceil(half), hidden.div_ceil(NR));
            let (gate_up, down_m) = match dtype {
                PackedDtype::Bf16 => (
                    PackedMatrix::pack_bf16_bits(hidden, gu_panels, gu_row, spare),
                    PackedMatrix::pack_bf16_bits(inter, d_panels, d_row, spare),
                ),
                PackedDtype::Int8 => (
                    PackedMatrix::pack_i8_from_bf16(hidden, gu_panels, gu_row, spare),
                    PackedMatrix::pack_i8_from_bf16(inter, d_panels, d_row, spare),
                ),
            };
            return Ok(PackedExpert {
                hidden,
                inter,
                gate_up,
                down: down_m,
                gate_bias: None,
                up_bias: None,
                down_bias: None,
                activation,
                bf16_activations: false,
            });
        }
        let gate_up =
            PackedMatrix::pack(hidden, inter.div_ceil(half), dtype, exact, |p, c, buf| {
                let (w, j) = if c < half {
                    (gate, p * half + c)
                } else {
                    (up, p * half + c - half)
                };
                if j >= inter {
                    return false;
                }
                w.row_to_f32(j, buf);
                true
            })?;
        let down_m = PackedMatrix::pack(inter, hidden.div_ceil(NR), dtype, exact, |p, c, buf| {
            let j = p * NR + c;
            if j >= hidden {
                return false;
            }
            down.row_to_f32(j, buf);
            true
        })?;
        Ok(PackedExpert {
            hidden,
            inter,
            gate_up,
            down: down_m,
            gate_bias: None,
            up_bias: None,
            down_bias: None,
            activation,
            bf16_activations: false,
        })
    }

    /// Packs an expert whose weights are already channel-wise int8 (`[inter,
    /// hidden]` gate and up, `[hidden, inter]` down): the int8 values and
    /// scales go into the panels as they are.
    pub fn from_i8(
        gate: &I8Matrix,
        up: &I8Matrix,
        down: &I8Matrix,
        activation: Activation,
    ) -> Result<Self> {
        let (inter, hidden) = (gate.rows, gate.cols);
        if (up.rows, up.cols) != (inter, hidden) || (down.rows, down.cols) != (hidden, inter) {
            return Err(Error::Dispatch(format!(
                "int8 expert shapes disagree: gate {inter}x{hidden}, up {}x{}, down {}x{}",
                up.rows, up.cols, down.rows, down.cols
            )));
        }
        let half = NR / 2;
        let gate_up = PackedMatrix::pack_i8(hidden, inter.div_ceil(half), |p, c| {
            let (m, j) = if c < half {
                (gate, p * half + c)
            } else {
                (up, p * half + c - half)
            };
            (j < inter).then(|| (m.row(j), m.scales[j]))
        });
        let down_m = PackedMatrix::pack_i8(inter, hidden.div_ceil(NR), |p, c| {
            let j = p * NR + c;
            (j < hidden).then(|| (down.row(j), down.scales[j]))
        });
        Ok(PackedExpert {
            hidden,
            inter,
            gate_up,
            down: down_m,
            gate_bias: None,
            up_bias: None,
            down_bias: None,
            activation,
            bf16_activations: false,
        })
    }

    /// The expert with its bf16 matrices stored as B12 where
    /// [`b12_enabled`](crate::kernels::b12::b12_enabled), else unchanged:
    /// the same values, 0.75x the bytes a decode step streams (with f32 or
    /// bf16 activations).
    pub fn stored_for_decode(self) -> Self {
        if !crate::kernels::b12::b12_enabled() {
            return self;
        }
        self.into_b12()
    }

    /// The expert with B12 matrices decoded back to bf16 panels.
    pub fn into_plain_bf16(self) -> Self {
        PackedExpert {
            gate_up: self.gate_up.into_plain_bf16(),
            down: self.down.into_plain_bf16(),
            ..self
        }
    }

    /// The expert with its bf16 matrices stored as B12 (lossless; int8 ones
    /// unchanged).
    pub fn into_b12(self) -> Self {
        PackedExpert {
            gate_up: self.gate_up.into_b12(),
            down: self.down.into_b12(),
            ..self
        }
    }

    /// Sets [`bf16_activations`](Self::bf16_activations).
    pub fn with_bf16_activations(mut self, on: bool) -> Self {
        self.bf16_activations = on;
        self
    }

    /// The expert's precision.
    pub fn dtype(&self) -> PackedDtype {
        self.gate_up.dtype()
    }

    /// Bytes one token's pass streams (all three projections).
    pub fn weight_bytes(&self) -> usize {
        self.gate_up.bytes() + self.down.bytes()
    }

    /// Calls `f(address, bytes)` for each weight buffer (mlock), stopping at
    /// the first `false`; returns whether all gave `true`.
    pub fn for_each_buffer(&self, mut f: impl FnMut(*const u8, usize) -> bool) -> bool {
        [&self.gate_up, &self.down].into_iter().all(|m| {
            let (ptr, len) = m.element_buffer();
            len == 0 || f(ptr, len)
        })
    }
}
