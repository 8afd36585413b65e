//! The plain scalar twins of the MoE micro-kernels: the same signatures as
//! the SIMD tiers, written for clarity. They are the reference every tier is
//! tested against and the fallback on CPUs without a faster tier.
//!
//! A *tile* multiplies `T` activation rows by one packed panel chunk (see
//! [`super::layout`]) and adds into `acc[t · 16 + c]`, logical channel order.

use super::layout::{
    I8_GROUP_BYTES, KG, NR, bf16_bits_to_f32, bf16_index, bf16_padded_k, i8_index, mm_index,
    pair_index,
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

/// `acc[j][r·16 + c] += Σ_k x[r][k] · Wj[k, c]` over two bf16 panel chunks
/// (`pairs · 32` words each) for `t` rows of **bf16** activations packed by
/// [`super::layout::pack_pairs_b16`] into `xp`: the twin of the two-panel
/// bf16 dot tile, the same arithmetic as [`bf16x_tile`].
pub fn bf16x_pair_tile(w: [&[u16]; 2], t: usize, xp: &[u16], acc: [&mut [f32]; 2]) {
    let kp = w[0].len() / NR;
    debug_assert!(xp.len() >= kp * t);
    for (wj, aj) in w.into_iter().zip(acc) {
        for r in 0..t {
            let a = &mut aj[r * NR..(r + 1) * NR];
            for k in 0..kp {
                let xv = bf16_bits_to_f32(xp[pair_index(k, r, t)]);
                for (c, av) in a.iter_mut().enumerate() {
                    *av += xv * bf16_bits_to_f32(wj[bf16_index(k, c)]);
                }
            }
        }
    }
}

/// `acc[r·16 + c] += Σ_k x[r][k] · W[k, c]` for a bf16 panel chunk `w`
/// (`pairs · 32` words) and `t` rows of **bf16** activations packed by
/// [`super::layout::pack_mm_bf16`] into `xa` (the chunk's `2 · pairs` `k`s,
/// zero-padded): the twin of the BFMMLA prefill tile. The same arithmetic as
/// [`bf16x_tile`]: exact bf16 products, f32 sums in `k` order.
pub fn bf16mm_tile(w: &[u16], t: usize, xa: &[u16], acc: &mut [f32]) {
    let kp = w.len() / NR;
    for r in 0..t {
        let a = &mut acc[r * NR..(r + 1) * NR];
        for k in 0..kp {
            let xv = bf16_bits_to_f32(xa[mm_index(k, r, t)]);
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

/// Attention scores (the twin of the tiers' `scores`): `out[m·ldo + i] =
/// scale · Σ_c q[m·dk + c] · k_i[c]` for the `q.len() / dk` query vectors
/// and the `n` key rows `stride` elements apart (f32 or bf16 widened), each
/// dot as [`super::dot`] sums (eight partial sums).
#[allow(clippy::too_many_arguments)]
pub fn attn_scores(
    q: &[f32],
    dk: usize,
    k: super::attention::KvRows<'_>,
    stride: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
    ldo: usize,
) {
    use super::attention::KvRows;
    let mut row = vec![0.0f32; dk];
    for i in 0..n {
        let kr: &[f32] = match k {
            KvRows::F32(s) => &s[i * stride..i * stride + dk],
            KvRows::Bf16(s) => {
                for (d, &b) in row.iter_mut().zip(&s[i * stride..i * stride + dk]) {
                    *d = bf16_bits_to_f32(b);
                }
                &row
            }
        };
        for (m, qm) in q.chunks_exact(dk).enumerate() {
            out[m * ldo + i] = super::dot(qm, kr) * scale;
        }
    }
}

/// Attention scores against one KV head's keys in a cache block stored by
/// column (the twin of the tiers' `scores_cols`): `k` at the block's column
/// 0, position 0, columns `bs` apart; `out[m·ldo + i] = scale · q_m ·
/// k_{t0+i}` for the `q.len() / dk` query vectors, each score as the tiers
/// sum it (two chains, the even and the odd elements, added at the end),
/// with separate multiplies and adds.
#[allow(clippy::too_many_arguments)]
pub fn attn_scores_cols(
    q: &[f32],
    dk: usize,
    k: super::attention::KvRows<'_>,
    bs: usize,
    t0: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
    ldo: usize,
) {
    use super::attention::KvRows;
    let mut acc = vec![0.0f32; 2 * n];
    let mut col = vec![0.0f32; n];
    for (m, qm) in q.chunks_exact(dk).enumerate() {
        acc.fill(0.0);
        for (d, &qd) in qm.iter().enumerate() {
            let at = d * bs + t0;
            match k {
                KvRows::F32(s) => col.copy_from_slice(&s[at..at + n]),
                KvRows::Bf16(s) => {
                    for (c, &b) in col.iter_mut().zip(&s[at..at + n]) {
                        *c = bf16_bits_to_f32(b);
                    }
                }
            }
            let a = &mut acc[(d % 2) * n..(d % 2 + 1) * n];
            for (a, &kv) in a.iter_mut().zip(&col) {
                *a += qd * kv;
            }
        }
        for i in 0..n {
            out[m * ldo + i] = (acc[i] + acc[n + i]) * scale;
        }
    }
}

/// One score over columns `0..dk` (`k` at the key's first column, columns
/// `bs` apart; bf16 when `BF`, else f32): two fused chains, the even and the
/// odd elements, added at the end, as each lane of the SIMD tiers'
/// `scores_cols` computes it (their scalar tails). Inlined into its caller,
/// so `mul_add` is the caller's FMA instruction.
///
/// # Safety
/// `q` holds `dk` elements and `k` the `dk` columns.
#[inline(always)]
pub(crate) unsafe fn col_score_fused<const BF: bool>(
    q: *const f32,
    dk: usize,
    k: *const u8,
    bs: usize,
) -> f32 {
    let (mut a0, mut a1) = (0.0f32, 0.0f32);
    // SAFETY: as documented above.
    unsafe {
        for d in 0..dk {
            let kv = if BF {
                f32::from_bits((*(k as *const u16).add(d * bs) as u32) << 16)
            } else {
                *(k as *const f32).add(d * bs)
            };
            if d % 2 == 0 {
                a0 = (*q.add(d)).mul_add(kv, a0);
            } else {
                a1 = (*q.add(d)).mul_add(kv, a1);
            }
        }
    }
    a0 + a1
}

/// Weighted sum of values (the twin of the tiers' `accum`):
/// `acc[m·dv + c] += Σ_{i<n} p[m·ldp + i] · v_i[c]` for the `acc.len() / dv`
/// query vectors, rows in order.
pub fn attn_accum(
    p: &[f32],
    ldp: usize,
    v: super::attention::KvRows<'_>,
    stride: usize,
    n: usize,
    acc: &mut [f32],
    dv: usize,
) {
    use super::attention::KvRows;
    for (m, a) in acc.chunks_exact_mut(dv).enumerate() {
        for i in 0..n {
            let pv = p[m * ldp + i];
            match v {
                KvRows::F32(s) => {
                    for (o, x) in a.iter_mut().zip(&s[i * stride..i * stride + dv]) {
                        *o += pv * x;
                    }
                }
                KvRows::Bf16(s) => {
                    for (o, &x) in a.iter_mut().zip(&s[i * stride..i * stride + dv]) {
                        *o += pv * bf16_bits_to_f32(x);
                    }
                }
            }
        }
    }
}

/// Below this a score difference's exponential is taken as exactly 0 (so a
/// masked score, `−∞`, contributes nothing; `e^−87` is ~1.6e−38 anyway).
pub const EXP_FLOOR: f32 = -87.0;

/// One online-softmax step over a row of block scores (the twin of the
/// tiers' `softmax`): `cmax` = the row's maximum; unless it is `−∞` (every
/// score masked: the row is zeroed, `(−∞, 0)` returned), each score `x`
/// becomes `e^(x − top)` with `top = max(prev_max, cmax)` (0 below
/// [`EXP_FLOOR`]) and their sum is returned with `cmax`.
pub fn attn_softmax(row: &mut [f32], prev_max: f32) -> (f32, f32) {
    let cmax = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if cmax == f32::NEG_INFINITY {
        row.fill(0.0);
        return (cmax, 0.0);
    }
    let top = prev_max.max(cmax);
    let mut tot = 0.0f32;
    for x in row.iter_mut() {
        let d = *x - top;
        *x = if d < EXP_FLOOR {
            0.0
        } else {
            super::fast_exp(d)
        };
        tot += *x;
    }
    (cmax, tot)
}
