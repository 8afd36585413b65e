//! The packed weight layouts the MoE micro-kernels stream, shared by every
//! tier (generic, x86, aarch64) so one packed copy serves whichever tier the
//! CPU picks at run time.
//!
//! A packed matrix computes `y[c] = Σ_k x[k] · W[c, k]` for output channels
//! `c`. Channels are grouped in *panels* of [`NR`] = 16; each panel is stored
//! contiguously, panel after panel, so a sweep over consecutive panels is one
//! sequential stream of memory (what the decode path wants).
//!
//! - **BF16 panel**: for each `k` in `0..K`, 16 bf16 words (32 bytes) holding
//!   logical channels in the order `[c0, c8, c1, c9, …, c7, c15]`. Seen as
//!   eight 32-bit words, shifting each left by 16 gives channels 0..8 as f32
//!   and masking the low half away gives channels 8..16: one ALU op per eight
//!   widened weights, on AVX2 and NEON alike.
//! - **INT8 panel**: `K` is padded to a multiple of [`KG`] = 8 with zeros; for
//!   each group of 8 `k`s, the 16 channels' 8 bytes in channel order (128
//!   bytes). One 16-byte row pair is exactly an SMMLA `B` operand and an SDOT
//!   operand; 32 bytes are four channels for AVX2's `vpmaddubsw`. Each channel
//!   has an f32 scale (symmetric, per output channel), weights in `[-127, 127]`.
//!
//! A fused gate/up matrix puts gate rows `j..j+8` in logical channels 0..8 of
//! a panel and the matching up rows in 8..16, so one panel yields
//! `act(gate) · up` for eight output columns without a second pass.

use half::bf16;

/// Output channels per panel.
pub const NR: usize = 16;
/// `k`s per int8 group.
pub const KG: usize = 8;
/// Bytes of one int8 k-group of a panel.
pub const I8_GROUP_BYTES: usize = NR * KG;

/// Where logical channel `c` (0..16) of a bf16 panel sits among the 16 words.
#[inline]
pub const fn bf16_pos(c: usize) -> usize {
    if c < 8 { 2 * c } else { 2 * (c - 8) + 1 }
}

/// `K` rounded up to a whole number of int8 groups.
#[inline]
pub const fn i8_padded_k(k: usize) -> usize {
    k.div_ceil(KG) * KG
}

/// Widens a bf16 bit pattern to f32 (exact).
#[inline]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Rounds an f32 to bf16 bits (round to nearest even, as `half` does).
#[inline]
pub fn f32_to_bf16_bits(v: f32) -> u16 {
    bf16::from_f32(v).to_bits()
}

/// Packs one bf16 panel: `row(c)` gives logical channel `c`'s `K` values
/// (already bf16 bits), or `None` for a zero (padding) channel. Appends
/// `K · 16` words to `dst`.
pub fn pack_bf16_panel<'a>(k: usize, row: impl Fn(usize) -> Option<&'a [u16]>, dst: &mut Vec<u16>) {
    let start = dst.len();
    dst.resize(start + k * NR, 0);
    let panel = &mut dst[start..];
    for c in 0..NR {
        if let Some(r) = row(c) {
            let pos = bf16_pos(c);
            for (kk, &v) in r.iter().enumerate().take(k) {
                panel[kk * NR + pos] = v;
            }
        }
    }
}

/// Packs one int8 panel: `row(c)` gives logical channel `c`'s quantized `K`
/// values or `None` for padding. Appends `i8_padded_k(K) · 16` bytes to `dst`.
pub fn pack_i8_panel<'a>(k: usize, row: impl Fn(usize) -> Option<&'a [i8]>, dst: &mut Vec<i8>) {
    let kp = i8_padded_k(k);
    let start = dst.len();
    dst.resize(start + kp * NR, 0);
    let panel = &mut dst[start..];
    for c in 0..NR {
        if let Some(r) = row(c) {
            for (kk, &v) in r.iter().enumerate().take(k) {
                let (g, i) = (kk / KG, kk % KG);
                panel[g * I8_GROUP_BYTES + c * KG + i] = v;
            }
        }
    }
}

/// Symmetric int8 quantization of one row: returns the scale `s` with
/// `row ≈ s · q`, `q` in `[-127, 127]`. An all-zero (or non-finite) row gets
/// scale 0 and zeros. `q` may be longer than `row` (padding is zeroed).
pub fn quantize_row_i8(row: &[f32], q: &mut [i8]) -> f32 {
    let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if !(amax > 0.0 && amax.is_finite()) {
        q.fill(0);
        return 0.0;
    }
    let inv = 127.0 / amax;
    for (d, &v) in q.iter_mut().zip(row) {
        *d = (v * inv).round().clamp(-127.0, 127.0) as i8;
    }
    for d in q.iter_mut().skip(row.len()) {
        *d = 0;
    }
    amax / 127.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_positions_interleave_halves() {
        let pos: Vec<usize> = (0..NR).map(bf16_pos).collect();
        assert_eq!(pos[..4], [0, 2, 4, 6]);
        assert_eq!(pos[8..12], [1, 3, 5, 7]);
        let mut seen = pos.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..NR).collect::<Vec<_>>());
    }

    #[test]
    fn quantize_bounds_and_scale() {
        let row = [0.5f32, -1.0, 0.25, 0.0, 1e-9];
        let mut q = [0i8; 8];
        let s = quantize_row_i8(&row, &mut q);
        assert_eq!(q[1], -127);
        assert_eq!(q[0], 64);
        assert_eq!(&q[5..], &[0, 0, 0]);
        assert!((s - 1.0 / 127.0).abs() < 1e-9);
        assert_eq!(quantize_row_i8(&[0.0; 3], &mut q), 0.0);
        assert!(q.iter().all(|&v| v == 0));
    }
}
