//! The plain scalar twins of the MoE micro-kernels: the same signatures as
//! the SIMD tiers, written for clarity. They are the reference every tier is
//! tested against and the fallback on CPUs without a faster tier.
//!
//! A *tile* multiplies `T` activation rows by one packed panel chunk (see
//! [`super::layout`]) and adds into `acc[t · 16 + c]`, logical channel order.

use super::layout::{
    I8_GROUP_BYTES, KG, NR, bf16_bits_to_f32, bf16_index, bf16_padded_k, i8_index, pair_index,
};

/// `acc[t·16 + c] += Σ_{k<kc} x[t][k] · W[k, c]` for a bf16 panel chunk `w`
/// (`bf16_padded_k(kc) · 16` words), f32 activations, f32 accumulation in
/// `k` order.
pub fn bf16_tile(w: &[u16], kc: usize, x: &[&[f32]], acc: &mut [f32]) {
    for (t, xr) in x.iter().enumerate() {
        let a = &mut acc[t * NR..(t + 1) * NR];
        for (k, &xv) in xr.iter().enumerate().take(kc) {
            for (c, av) in a.iter_mut().enumerate() {
                *av += xv * bf16_bits_to_f32(w[bf16_index(k, c)]);
            }
        }
    }
}

/// [`bf16_tile`] over two panel chunks (`acc[j]` for `w[j]`) with the `t`
/// activation rows packed by [`super::layout::pack_pairs_f32`]: the twin of
/// the two-panel prefill tiles. Sums in `k` order, as [`bf16_tile`].
pub fn bf16_pair_tile(w: [&[u16]; 2], kc: usize, t: usize, xp: &[f32], acc: [&mut [f32]; 2]) {
    debug_assert!(xp.len() >= bf16_padded_k(kc) * t);
    for (wj, aj) in w.into_iter().zip(acc) {
        for r in 0..t {
            let a = &mut aj[r * NR..(r + 1) * NR];
            for k in 0..kc {
                let xv = xp[pair_index(k, r, t)];
                for (c, av) in a.iter_mut().enumerate() {
                    *av += xv * bf16_bits_to_f32(wj[bf16_index(k, c)]);
                }
            }
        }
    }
}

/// `acc[t·16 + c] += Σ_k x[t][k] · W[k, c]` for a bf16 panel chunk `w`
/// (`pairs · 32` words) and **bf16** activations (`2 · pairs` values per row,
/// zero-padded): the twin of the bf16 dot-product tiles (`vdpbf16ps`,
/// `bfdot`). Products of two bf16 are exact in f32; sums are f32 in `k` order.
pub fn bf16x_tile(w: &[u16], x: &[&[u16]], acc: &mut [f32]) {
    let kp = w.len() / NR;
    for (t, xr) in x.iter().enumerate() {
        let a = &mut acc[t * NR..(t + 1) * NR];
        for (k, &xv) in xr.iter().enumerate().take(kp) {
            let xv = bf16_bits_to_f32(xv);
            for (c, av) in a.iter_mut().enumerate() {
                *av += xv * bf16_bits_to_f32(w[bf16_index(k, c)]);
            }
        }
    }
}

/// `acc[t·16 + c] += Σ_k x[t][k] · W[k, c]` for an int8 panel chunk `w`
/// (`groups · 128` bytes), int8 activations (`groups · 8` values per row),
/// exact i32 accumulation.
pub fn i8_tile(w: &[i8], x: &[&[i8]], acc: &mut [i32]) {
    let groups = w.len() / I8_GROUP_BYTES;
    for (t, xr) in x.iter().enumerate() {
        let a = &mut acc[t * NR..(t + 1) * NR];
        for g in 0..groups {
            let wg = &w[g * I8_GROUP_BYTES..(g + 1) * I8_GROUP_BYTES];
            let xg = &xr[g * KG..(g + 1) * KG];
            for (c, av) in a.iter_mut().enumerate() {
                *av += xg
                    .iter()
                    .enumerate()
                    .map(|(i, &q)| wg[i8_index(i, c)] as i32 * q as i32)
                    .sum::<i32>();
            }
        }
    }
}
