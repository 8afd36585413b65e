//! NEON attention micro-kernels: the aarch64 twins of
//! `kernels/x86/attn.rs` (`scores`: up to eight queries share each key load;
//! `accum`: up to eight queries' accumulators stay in registers over the
//! value rows). bf16 rows are widened with `ushll #16`.
//!
//! The functions are `unsafe`: callers must have checked NEON (done once in
//! [`crate::kernels::dispatch`]) and the slice lengths.

#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use crate::kernels::{query_groups, row_scores};
use std::arch::aarch64::*;

const fn esize(bf: bool) -> usize {
    if bf { 2 } else { 4 }
}

/// 4 elements at element `i` of the row at `p`, widened to f32.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn ld4<const BF: bool>(p: *const u8, i: usize) -> float32x4_t {
    // SAFETY: the caller guarantees 4 elements at `i`.
    unsafe {
        if BF {
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16((p as *const u16).add(i))))
        } else {
            vld1q_f32((p as *const f32).add(i))
        }
    }
}

/// `rem < 4` elements at element `i`, zero-filled to 4.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn ld4_tail<const BF: bool>(p: *const u8, i: usize, rem: usize) -> float32x4_t {
    // SAFETY: the caller guarantees `rem` elements at `i`.
    unsafe {
        if BF {
            let mut buf = [0u16; 4];
            std::ptr::copy_nonoverlapping((p as *const u16).add(i), buf.as_mut_ptr(), rem);
            ld4::<true>(buf.as_ptr() as *const u8, 0)
        } else {
            let mut buf = [0.0f32; 4];
            std::ptr::copy_nonoverlapping((p as *const f32).add(i), buf.as_mut_ptr(), rem);
            vld1q_f32(buf.as_ptr())
        }
    }
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn dots<const G: usize, const BF: bool>(
    q: *const f32,
    dk: usize,
    k: *const u8,
    out: &mut [f32; G],
) {
    let mut a = [vdupq_n_f32(0.0); G];
    let (full, rem) = (dk / 4, dk % 4);
    // SAFETY: `q` holds `G` rows of `dk`, `k` one row of `dk` elements.
    unsafe {
        for c in 0..full {
            let kv = ld4::<BF>(k, c * 4);
            for g in 0..G {
                a[g] = vfmaq_f32(a[g], vld1q_f32(q.add(g * dk + c * 4)), kv);
            }
        }
        if rem > 0 {
            let kv = ld4_tail::<BF>(k, full * 4, rem);
            for g in 0..G {
                let qv = ld4_tail::<false>(q.add(g * dk) as *const u8, full * 4, rem);
                a[g] = vfmaq_f32(a[g], qv, kv);
            }
        }
        for g in 0..G {
            out[g] = vaddvq_f32(a[g]);
        }
    }
}

/// Scores of `q.len() / dk` queries against `n` key rows (see
/// `kernels/x86/attn.rs`).
///
/// # Safety
/// NEON; `k` holds `(n - 1) · stride + dk` elements, `out` row `m` at
/// `m · ldo` has `n`.
#[target_feature(enable = "neon")]
pub unsafe fn scores<const BF: bool>(
    q: &[f32],
    dk: usize,
    k: *const u8,
    stride: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
    ldo: usize,
) {
    let m = q.len() / dk;
    // SAFETY: the caller guarantees the features and the extents.
    unsafe {
        for i in 0..n {
            let kr = k.add(i * stride * esize(BF));
            row_scores!(dots::<BF>, 0, m, q, dk, kr, i, scale, out, ldo);
        }
    }
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn axpys<const G: usize, const BF: bool>(
    p: *const f32,
    ldp: usize,
    v: *const u8,
    stride: usize,
    n: usize,
    acc: *mut f32,
    dv: usize,
    c0: usize,
    rem: usize,
) {
    // SAFETY: `G` accumulator rows of `dv`, `G` rows of `n` probabilities
    // `ldp` apart and `n` value rows, as the caller guarantees.
    unsafe {
        let mut a = [vdupq_n_f32(0.0); G];
        for g in 0..G {
            a[g] = if rem == 0 {
                vld1q_f32(acc.add(g * dv + c0))
            } else {
                ld4_tail::<false>(acc.add(g * dv) as *const u8, c0, rem)
            };
        }
        for i in 0..n {
            let vr = v.add(i * stride * esize(BF));
            let vv = if rem == 0 {
                ld4::<BF>(vr, c0)
            } else {
                ld4_tail::<BF>(vr, c0, rem)
            };
            for g in 0..G {
                a[g] = vfmaq_n_f32(a[g], vv, *p.add(g * ldp + i));
            }
        }
        for g in 0..G {
            if rem == 0 {
                vst1q_f32(acc.add(g * dv + c0), a[g]);
            } else {
                let mut buf = [0.0f32; 4];
                vst1q_f32(buf.as_mut_ptr(), a[g]);
                std::ptr::copy_nonoverlapping(buf.as_ptr(), acc.add(g * dv + c0), rem);
            }
        }
    }
}

/// [`axpys`] over the 8 columns `c0..c0 + 8` (two vectors): the
/// probabilities of four value rows are one vector load per query, and each
/// row's two vectors are multiplied by a lane of it (`fmla` by element), so
/// a value row costs two vector loads for `2·G` FMAs instead of `G` scalar
/// loads and one vector load for `G`. Each column's sum keeps [`axpys`]'s
/// order (the same fused multiply-adds, row by row).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn axpys8<const G: usize, const BF: bool>(
    p: *const f32,
    ldp: usize,
    v: *const u8,
    stride: usize,
    n: usize,
    acc: *mut f32,
    dv: usize,
    c0: usize,
) {
    // SAFETY: as in `axpys`, 8 columns from `c0`.
    unsafe {
        let mut a = [[vdupq_n_f32(0.0); G]; 2];
        for g in 0..G {
            a[0][g] = vld1q_f32(acc.add(g * dv + c0));
            a[1][g] = vld1q_f32(acc.add(g * dv + c0 + 4));
        }
        let row = |i: usize| v.add(i * stride * esize(BF));
        macro_rules! lane {
            ($a:ident, $pv:ident, $i:expr, $l:literal) => {{
                let vr = row($i + $l);
                let (v0, v1) = (ld4::<BF>(vr, c0), ld4::<BF>(vr, c0 + 4));
                for g in 0..G {
                    $a[0][g] = vfmaq_laneq_f32::<$l>($a[0][g], v0, $pv[g]);
                    $a[1][g] = vfmaq_laneq_f32::<$l>($a[1][g], v1, $pv[g]);
                }
            }};
        }
        let mut i = 0;
        while i + 4 <= n {
            let mut pv = [vdupq_n_f32(0.0); G];
            for g in 0..G {
                pv[g] = vld1q_f32(p.add(g * ldp + i));
            }
            lane!(a, pv, i, 0);
            lane!(a, pv, i, 1);
            lane!(a, pv, i, 2);
            lane!(a, pv, i, 3);
            i += 4;
        }
        while i < n {
            let vr = row(i);
            let (v0, v1) = (ld4::<BF>(vr, c0), ld4::<BF>(vr, c0 + 4));
            for g in 0..G {
                let x = *p.add(g * ldp + i);
                a[0][g] = vfmaq_n_f32(a[0][g], v0, x);
                a[1][g] = vfmaq_n_f32(a[1][g], v1, x);
            }
            i += 1;
        }
        for g in 0..G {
            vst1q_f32(acc.add(g * dv + c0), a[0][g]);
            vst1q_f32(acc.add(g * dv + c0 + 4), a[1][g]);
        }
    }
}

/// `acc[m·dv + c] += Σ_i p[m·ldp + i] · v_i[c]` for `acc.len() / dv` queries.
///
/// # Safety
/// NEON; `v` holds `(n - 1) · stride + dv` elements, `p` row `m` at
/// `m · ldp` has `n` values.
#[target_feature(enable = "neon")]
pub unsafe fn accum<const BF: bool>(
    p: &[f32],
    ldp: usize,
    v: *const u8,
    stride: usize,
    n: usize,
    acc: &mut [f32],
    dv: usize,
) {
    let m = acc.len() / dv;
    let (pp, ap) = (p.as_ptr(), acc.as_mut_ptr());
    // SAFETY: as documented above.
    unsafe {
        // 8 columns per pass while they last, then 4 (the last partial).
        let mut c0 = 0;
        while c0 < dv {
            let wide = dv - c0 >= 8;
            let rem = if wide || dv - c0 >= 4 { 0 } else { dv - c0 };
            query_groups(m, |g, mi| {
                let (p, a) = (pp.add(mi * ldp), ap.add(mi * dv));
                match (g, wide) {
                    (8, true) => axpys8::<8, BF>(p, ldp, v, stride, n, a, dv, c0),
                    (4, true) => axpys8::<4, BF>(p, ldp, v, stride, n, a, dv, c0),
                    (_, true) => axpys8::<1, BF>(p, ldp, v, stride, n, a, dv, c0),
                    (8, false) => axpys::<8, BF>(p, ldp, v, stride, n, a, dv, c0, rem),
                    (4, false) => axpys::<4, BF>(p, ldp, v, stride, n, a, dv, c0, rem),
                    _ => axpys::<1, BF>(p, ldp, v, stride, n, a, dv, c0, rem),
                }
            });
            c0 += if wide { 8 } else { 4 };
        }
    }
}

// ---------------------------------------------------------------- softmax

use crate::kernels::generic::EXP_FLOOR;

/// `crate::kernels::fast_exp` on 4 lanes, 0 where `d < EXP_FLOOR`.
#[inline]
#[target_feature(enable = "neon")]
fn exp4(d: float32x4_t) -> float32x4_t {
    const POLY: [f32; 8] = [
        1.0 / 5040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ];
    let under = vcltq_f32(d, vdupq_n_f32(EXP_FLOOR));
    let x = vminq_f32(vmaxq_f32(d, vdupq_n_f32(-87.0)), vdupq_n_f32(88.0));
    let n = vrndnq_f32(vmulq_n_f32(x, std::f32::consts::LOG2_E));
    let r = vfmsq_f32(x, n, vdupq_n_f32(0.693_145_75));
    let r = vfmsq_f32(r, n, vdupq_n_f32(1.428_606_8e-6));
    let mut p = vdupq_n_f32(POLY[0]);
    for c in &POLY[1..] {
        p = vfmaq_f32(vdupq_n_f32(*c), p, r);
    }
    let e = vshlq_n_s32::<23>(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)));
    let v = vmulq_f32(p, vreinterpretq_f32_s32(e));
    vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(v), under))
}

/// One online-softmax step over a row of scores (see
/// [`crate::kernels::generic::attn_softmax`]; element `i` summed in lane
/// `i % 4`, so trailing zeros never change the sum).
///
/// # Safety
/// NEON.
#[target_feature(enable = "neon")]
pub unsafe fn softmax(row: &mut [f32], prev_max: f32) -> (f32, f32) {
    let n = row.len();
    let (full, rem) = (n / 4 * 4, n % 4);
    let p = row.as_mut_ptr();
    let mut tail = [f32::NEG_INFINITY; 4];
    tail[..rem].copy_from_slice(&row[full..]);
    // SAFETY: every access is inside `row` or `tail`.
    unsafe {
        let mut m = vld1q_f32(tail.as_ptr());
        for i in (0..full).step_by(4) {
            m = vmaxq_f32(m, vld1q_f32(p.add(i)));
        }
        let cmax = vmaxvq_f32(m);
        if cmax == f32::NEG_INFINITY {
            row.fill(0.0);
            return (cmax, 0.0);
        }
        let top = vdupq_n_f32(prev_max.max(cmax));
        let mut s = vdupq_n_f32(0.0);
        for i in (0..full).step_by(4) {
            let e = exp4(vsubq_f32(vld1q_f32(p.add(i)), top));
            vst1q_f32(p.add(i), e);
            s = vaddq_f32(s, e);
        }
        if rem > 0 {
            let e = exp4(vsubq_f32(vld1q_f32(tail.as_ptr()), top));
            vst1q_f32(tail.as_mut_ptr(), e);
            row[full..].copy_from_slice(&tail[..rem]);
            s = vaddq_f32(s, e);
        }
        (cmax, vaddvq_f32(s))
    }
}

// ------------------------------------------------------- keys by column

/// `G` queries (rows `dk` apart at `q`) against 8 positions at `k` of a
/// block's columns (`bs` apart): scaled scores to `out`, rows `ldo` apart.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn cols<const G: usize, const BF: bool>(
    q: *const f32,
    dk: usize,
    k: *const u8,
    bs: usize,
    scale: f32,
    out: *mut f32,
    ldo: usize,
) {
    let mut a = [[[vdupq_n_f32(0.0); 2]; G]; 2];
    // SAFETY: `q` holds `G` rows of `dk`, `k` `dk` columns with 8 positions,
    // `out` `G` rows of 8.
    unsafe {
        let mut d = 0;
        while d < dk {
            for (j, aj) in a.iter_mut().enumerate().take(dk - d) {
                let c = (d + j) * bs;
                let kv = [ld4::<BF>(k, c), ld4::<BF>(k, c + 4)];
                for g in 0..G {
                    let qv = *q.add(g * dk + d + j);
                    for h in 0..2 {
                        aj[g][h] = vfmaq_n_f32(aj[g][h], kv[h], qv);
                    }
                }
            }
            d += 2;
        }
        for g in 0..G {
            for h in 0..2 {
                let s = vmulq_n_f32(vaddq_f32(a[0][g][h], a[1][g][h]), scale);
                vst1q_f32(out.add(g * ldo + 4 * h), s);
            }
        }
    }
}

/// Scores of `q.len() / dk` queries against positions `t0..t0 + n` of one
/// KV head's keys in a cache block stored by column (`k` at its column 0,
/// position 0; columns `bs` apart): runs of 8 positions for groups of
/// eight, four, then one query; the last positions one score at a time.
///
/// # Safety
/// NEON; `k` holds `(dk - 1) · bs + t0 + n` elements (`2` bytes each when
/// `BF`, else `4`), `out` row `m` at `m · ldo` has `n`.
#[target_feature(enable = "neon")]
pub unsafe fn scores_cols<const BF: bool>(
    q: &[f32],
    dk: usize,
    k: *const u8,
    bs: usize,
    t0: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
    ldo: usize,
) {
    let m = q.len() / dk;
    let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
    // SAFETY: the caller guarantees NEON and the extents.
    unsafe {
        let mut i0 = 0;
        while i0 + 8 <= n {
            let kc = k.add((t0 + i0) * esize(BF));
            let mut mi = 0;
            while mi + 8 <= m {
                let o = op.add(mi * ldo + i0);
                cols::<8, BF>(qp.add(mi * dk), dk, kc, bs, scale, o, ldo);
                mi += 8;
            }
            while mi + 4 <= m {
                let o = op.add(mi * ldo + i0);
                cols::<4, BF>(qp.add(mi * dk), dk, kc, bs, scale, o, ldo);
                mi += 4;
            }
            while mi < m {
                let o = op.add(mi * ldo + i0);
                cols::<1, BF>(qp.add(mi * dk), dk, kc, bs, scale, o, ldo);
                mi += 1;
            }
            i0 += 8;
        }
        for i in i0..n {
            let kc = k.add((t0 + i) * esize(BF));
            for mi in 0..m {
                *op.add(mi * ldo + i) =
                    crate::kernels::generic::col_score_fused::<BF>(qp.add(mi * dk), dk, kc, bs)
                        * scale;
            }
        }
    }
}
