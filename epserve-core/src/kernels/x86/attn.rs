//! Attention micro-kernels (AVX2 + FMA and AVX-512): the two inner loops of
//! [`crate::kernels::attention`] over a run of cached K/V rows, with the keys
//! and values either f32 or bf16 (widened by a 16-bit shift).
//!
//! - `scores`: `out[m·ldo + i] = scale · q_m · k_i` for `M` query vectors
//!   against `n` key rows `stride` elements apart. Up to eight queries share
//!   each key load (eight independent FMA chains); one horizontal sum per
//!   (query, key).
//! - `accum`: `acc[m·dv + c] += Σ_i p[m·ldp + i] · v_i[c]`: per chunk of
//!   value columns, up to eight queries' accumulators stay in registers over
//!   all `n` rows, each value load feeding eight FMAs.
//!
//! The functions are `unsafe`: callers must have checked the CPU features
//! (done once in [`crate::kernels::dispatch`]) and the slice lengths (done
//! by the safe wrappers on [`crate::kernels::dispatch::Kernels`]).

// Explicit query/lane indices read better than iterator chains in kernels.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use std::arch::x86_64::*;

/// Element type of the cached rows: `BF` = bf16 (`u16`), else f32.
const fn esize(bf: bool) -> usize {
    if bf { 2 } else { 4 }
}

/// Rows ahead of the current one whose lines are prefetched: a head's slice
/// of a cached row is a short piece of a wide row, which the hardware
/// prefetchers follow poorly.
const PF_ROWS: usize = 4;

/// Hints the `bytes` bytes at `PF_ROWS` rows past `row` into L1 (never faults).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn prefetch_row(row: *const u8, row_bytes: usize, bytes: usize) {
    let p = row.wrapping_add(PF_ROWS * row_bytes);
    let mut off = 0;
    while off < bytes {
        // A prefetch is only a hint; it never faults (a safe intrinsic here).
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off) as *const i8);
        off += 64;
    }
}

// ---------------------------------------------------------------- AVX-512

/// 16 elements at element `i` of the row at `p`, widened to f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn ld16<const BF: bool>(p: *const u8, i: usize) -> __m512 {
    // SAFETY: the caller guarantees 16 elements at `i`.
    unsafe {
        if BF {
            let raw = _mm256_loadu_si256(p.add(2 * i) as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
        } else {
            _mm512_loadu_ps((p as *const f32).add(i))
        }
    }
}

/// `rem < 16` elements at element `i`, zero-filled to 16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn ld16_tail<const BF: bool>(p: *const u8, i: usize, rem: usize) -> __m512 {
    // SAFETY: the caller guarantees `rem` elements at `i`.
    unsafe {
        if BF {
            let mut buf = [0u16; 16];
            std::ptr::copy_nonoverlapping((p as *const u16).add(i), buf.as_mut_ptr(), rem);
            ld16::<true>(buf.as_ptr() as *const u8, 0)
        } else {
            _mm512_maskz_loadu_ps(((1u32 << rem) - 1) as u16, (p as *const f32).add(i))
        }
    }
}

/// `G` queries (rows `dk` apart at `q`) against one key row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn dots512<const G: usize, const BF: bool>(
    q: *const f32,
    dk: usize,
    k: *const u8,
    out: &mut [f32; G],
) {
    let mut a = [_mm512_setzero_ps(); G];
    let (full, rem) = (dk / 16, dk % 16);
    // SAFETY: `q` holds `G` rows of `dk`, `k` one row of `dk` elements.
    unsafe {
        for c in 0..full {
            let kv = ld16::<BF>(k, c * 16);
            for g in 0..G {
                a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(g * dk + c * 16)), kv, a[g]);
            }
        }
        if rem > 0 {
            let kv = ld16_tail::<BF>(k, full * 16, rem);
            let mask = ((1u32 << rem) - 1) as u16;
            for g in 0..G {
                let qv = _mm512_maskz_loadu_ps(mask, q.add(g * dk + full * 16));
                a[g] = _mm512_fmadd_ps(qv, kv, a[g]);
            }
        }
    }
    for g in 0..G {
        out[g] = reduce1(a[g]);
    }
}

/// The two 256-bit halves of `v` added.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
fn half_sum(v: __m512) -> __m256 {
    _mm256_add_ps(
        _mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
    )
}

/// The horizontal sum of `v` in exactly [`reduce8`]'s order, so a score does
/// not depend on how many queries were computed with it (a sequence's
/// result must not depend on the rest of the batch).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
fn reduce1(v: __m512) -> f32 {
    let h = half_sum(v);
    let t = _mm256_hadd_ps(h, h);
    let u = _mm256_hadd_ps(t, t);
    _mm_cvtss_f32(_mm_add_ss(
        _mm256_castps256_ps128(u),
        _mm256_extractf128_ps::<1>(u),
    ))
}

/// The eight horizontal sums of `a[0..8]`, in order, as one vector (a
/// transpose-and-add tree: a quarter of the shuffles of eight reductions).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
fn reduce8(a: &[__m512; 8]) -> __m256 {
    let t0 = _mm256_hadd_ps(half_sum(a[0]), half_sum(a[1]));
    let t1 = _mm256_hadd_ps(half_sum(a[2]), half_sum(a[3]));
    let t2 = _mm256_hadd_ps(half_sum(a[4]), half_sum(a[5]));
    let t3 = _mm256_hadd_ps(half_sum(a[6]), half_sum(a[7]));
    let u0 = _mm256_hadd_ps(t0, t1);
    let u1 = _mm256_hadd_ps(t2, t3);
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(u0, u1),
        _mm256_permute2f128_ps::<0x31>(u0, u1),
    )
}

/// Eight queries (rows `dk` apart at `q`) against two key rows: each query
/// chunk loaded once feeds both keys (16 accumulators).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn dots512x2<const BF: bool>(
    q: *const f32,
    dk: usize,
    k: [*const u8; 2],
    out: &mut [[f32; 8]; 2],
) {
    let mut a = [[_mm512_setzero_ps(); 8]; 2];
    let (full, rem) = (dk / 16, dk % 16);
    // SAFETY: `q` holds 8 rows of `dk`, each `k[j]` one row of `dk` elements.
    unsafe {
        for c in 0..full {
            let k0 = ld16::<BF>(k[0], c * 16);
            let k1 = ld16::<BF>(k[1], c * 16);
            for g in 0..8 {
                let qv = _mm512_loadu_ps(q.add(g * dk + c * 16));
                a[0][g] = _mm512_fmadd_ps(qv, k0, a[0][g]);
                a[1][g] = _mm512_fmadd_ps(qv, k1, a[1][g]);
            }
        }
        if rem > 0 {
            let k0 = ld16_tail::<BF>(k[0], full * 16, rem);
            let k1 = ld16_tail::<BF>(k[1], full * 16, rem);
            let mask = ((1u32 << rem) - 1) as u16;
            for g in 0..8 {
                let qv = _mm512_maskz_loadu_ps(mask, q.add(g * dk + full * 16));
                a[0][g] = _mm512_fmadd_ps(qv, k0, a[0][g]);
                a[1][g] = _mm512_fmadd_ps(qv, k1, a[1][g]);
            }
        }
        for j in 0..2 {
            _mm256_storeu_ps(out[j].as_mut_ptr(), reduce8(&a[j]));
        }
    }
}

/// Scores of `q.len() / dk` queries against `n` key rows.
///
/// # Safety
/// AVX-512 F/BW and FMA; `k` holds `(n - 1) · stride + dk` elements
/// (`2` bytes each when `BF`, else `4`), `out` row `m` at `m · ldo` has `n`.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub unsafe fn scores512<const BF: bool>(
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
    let rb = stride * esize(BF);
    // SAFETY: the caller guarantees the features and the extents.
    unsafe {
        // Pairs of keys for each group of eight queries.
        let m8 = m / 8 * 8;
        let mut i = 0;
        while m8 > 0 && i + 2 <= n {
            let kr = [k.add(i * rb), k.add((i + 1) * rb)];
            prefetch_row(kr[0], rb, dk * esize(BF));
            prefetch_row(kr[1], rb, dk * esize(BF));
            for mi in (0..m8).step_by(8) {
                let mut d = [[0.0f32; 8]; 2];
                dots512x2::<BF>(q.as_ptr().add(mi * dk), dk, kr, &mut d);
                for g in 0..8 {
                    out[(mi + g) * ldo + i] = d[0][g] * scale;
                    out[(mi + g) * ldo + i + 1] = d[1][g] * scale;
                }
            }
            i += 2;
        }
        let done = i;
        for i in 0..n {
            let kr = k.add(i * stride * esize(BF));
            let mut mi = if i < done { m8 } else { 0 };
            if mi == 0 {
                prefetch_row(kr, stride * esize(BF), dk * esize(BF));
            }
            while mi + 8 <= m {
                let mut d = [0.0f32; 8];
                dots512::<8, BF>(q.as_ptr().add(mi * dk), dk, kr, &mut d);
                for g in 0..8 {
                    out[(mi + g) * ldo + i] = d[g] * scale;
                }
                mi += 8;
            }
            while mi + 4 <= m {
                let mut d = [0.0f32; 4];
                dots512::<4, BF>(q.as_ptr().add(mi * dk), dk, kr, &mut d);
                for g in 0..4 {
                    out[(mi + g) * ldo + i] = d[g] * scale;
                }
                mi += 4;
            }
            while mi < m {
                let mut d = [0.0f32; 1];
                dots512::<1, BF>(q.as_ptr().add(mi * dk), dk, kr, &mut d);
                out[mi * ldo + i] = d[0] * scale;
                mi += 1;
            }
        }
    }
}

/// `G` queries' accumulators for columns `c0..c0 + 16` (`rem` of them when
/// non-zero) over `n` value rows.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn axpys512<const G: usize, const BF: bool>(
    p: *const f32,
    ldp: usize,
    v: *const u8,
    stride: usize,
    n: usize,
    acc: *mut f32,
    dv: usize,
    c0: usize,
    rem: usize,
    prefetch: bool,
) {
    let mask = if rem == 0 {
        0xFFFF
    } else {
        ((1u32 << rem) - 1) as u16
    };
    // SAFETY: the caller guarantees `G` accumulator rows of `dv`, `G` rows
    // of `n` probabilities `ldp` apart and `n` value rows.
    unsafe {
        let mut a = [_mm512_setzero_ps(); G];
        for g in 0..G {
            a[g] = _mm512_maskz_loadu_ps(mask, acc.add(g * dv + c0));
        }
        for i in 0..n {
            let vr = v.add(i * stride * esize(BF));
            if prefetch {
                prefetch_row(vr, stride * esize(BF), dv * esize(BF));
            }
            let vv = if rem == 0 {
                ld16::<BF>(vr, c0)
            } else {
                ld16_tail::<BF>(vr, c0, rem)
            };
            for g in 0..G {
                a[g] = _mm512_fmadd_ps(_mm512_set1_ps(*p.add(g * ldp + i)), vv, a[g]);
            }
        }
        for g in 0..G {
            _mm512_mask_storeu_ps(acc.add(g * dv + c0), mask, a[g]);
        }
    }
}

/// Eight queries' accumulators for the two full column chunks at `c0` and
/// `c0 + 16` over `n` value rows: each broadcast probability feeds two FMAs.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn axpys512x2<const BF: bool>(
    p: *const f32,
    ldp: usize,
    v: *const u8,
    stride: usize,
    n: usize,
    acc: *mut f32,
    dv: usize,
    c0: usize,
    prefetch: bool,
) {
    // SAFETY: as in `axpys512`, with columns `c0..c0 + 32` inside `dv`.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); 8]; 2];
        for g in 0..8 {
            a[0][g] = _mm512_loadu_ps(acc.add(g * dv + c0));
            a[1][g] = _mm512_loadu_ps(acc.add(g * dv + c0 + 16));
        }
        for i in 0..n {
            let vr = v.add(i * stride * esize(BF));
            if prefetch {
                prefetch_row(vr, stride * esize(BF), dv * esize(BF));
            }
            let v0 = ld16::<BF>(vr, c0);
            let v1 = ld16::<BF>(vr, c0 + 16);
            for g in 0..8 {
                let pv = _mm512_set1_ps(*p.add(g * ldp + i));
                a[0][g] = _mm512_fmadd_ps(pv, v0, a[0][g]);
                a[1][g] = _mm512_fmadd_ps(pv, v1, a[1][g]);
            }
        }
        for g in 0..8 {
            _mm512_storeu_ps(acc.add(g * dv + c0), a[0][g]);
            _mm512_storeu_ps(acc.add(g * dv + c0 + 16), a[1][g]);
        }
    }
}

/// `acc[m·dv + c] += Σ_i p[m·ldp + i] · v_i[c]` for `acc.len() / dv` queries.
///
/// # Safety
/// AVX-512 F/BW and FMA; `v` holds `(n - 1) · stride + dv` elements, `p`
/// row `m` at `m · ldp` has `n` values.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub unsafe fn accum512<const BF: bool>(
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
        // Groups of eight queries over pairs of full column chunks.
        let (m8, c32) = (m / 8 * 8, dv / 32 * 32);
        for mi in (0..m8).step_by(8) {
            for c0 in (0..c32).step_by(32) {
                axpys512x2::<BF>(
                    pp.add(mi * ldp),
                    ldp,
                    v,
                    stride,
                    n,
                    ap.add(mi * dv),
                    dv,
                    c0,
                    c0 == 0 && mi == 0,
                );
            }
        }
        let mut c0 = 0;
        while c0 < dv {
            let rem = if dv - c0 >= 16 { 0 } else { dv - c0 };
            let mut mi = if c0 < c32 { m8 } else { 0 };
            while mi + 8 <= m {
                axpys512::<8, BF>(
                    pp.add(mi * ldp),
                    ldp,
                    v,
                    stride,
                    n,
                    ap.add(mi * dv),
                    dv,
                    c0,
                    rem,
                    c0 == 0 && mi == 0,
                );
                mi += 8;
            }
            while mi + 4 <= m {
                axpys512::<4, BF>(
                    pp.add(mi * ldp),
                    ldp,
                    v,
                    stride,
                    n,
                    ap.add(mi * dv),
                    dv,
                    c0,
                    rem,
                    c0 == 0 && mi == 0,
                );
                mi += 4;
            }
            while mi < m {
                axpys512::<1, BF>(
                    pp.add(mi * ldp),
                    ldp,
                    v,
                    stride,
                    n,
                    ap.add(mi * dv),
                    dv,
                    c0,
                    rem,
                    c0 == 0 && mi == 0,
                );
                mi += 1;
            }
            c0 += 16;
        }
    }
}

// ---------------------------------------------------------------- AVX2

/// 8 elements at element `i` of the row at `p`, widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn ld8<const BF: bool>(p: *const u8, i: usize) -> __m256 {
    // SAFETY: the caller guarantees 8 elements at `i`.
    unsafe {
        if BF {
            let raw = _mm_loadu_si128(p.add(2 * i) as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
        } else {
            _mm256_loadu_ps((p as *const f32).add(i))
        }
    }
}

/// `rem < 8` elements at element `i`, zero-filled to 8.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn ld8_tail<const BF: bool>(p: *const u8, i: usize, rem: usize) -> __m256 {
    // SAFETY: the caller guarantees `rem` elements at `i`.
    unsafe {
        if BF {
            let mut buf = [0u16; 8];
            std::ptr::copy_nonoverlapping((p as *const u16).add(i), buf.as_mut_ptr(), rem);
            ld8::<true>(buf.as_ptr() as *const u8, 0)
        } else {
            let mut buf = [0.0f32; 8];
            std::ptr::copy_nonoverlapping((p as *const f32).add(i), buf.as_mut_ptr(), rem);
            _mm256_loadu_ps(buf.as_ptr())
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots256<const G: usize, const BF: bool>(
    q: *const f32,
    dk: usize,
    k: *const u8,
    out: &mut [f32; G],
) {
    let mut a = [_mm256_setzero_ps(); G];
    let (full, rem) = (dk / 8, dk % 8);
    // SAFETY: `q` holds `G` rows of `dk`, `k` one row of `dk` elements.
    unsafe {
        for c in 0..full {
            let kv = ld8::<BF>(k, c * 8);
            for g in 0..G {
                a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(g * dk + c * 8)), kv, a[g]);
            }
        }
        if rem > 0 {
            let kv = ld8_tail::<BF>(k, full * 8, rem);
            for g in 0..G {
                let qv = ld8_tail::<false>(q.add(g * dk) as *const u8, full * 8, rem);
                a[g] = _mm256_fmadd_ps(qv, kv, a[g]);
            }
        }
    }
    for g in 0..G {
        out[g] = hsum256(a[g]);
    }
}

/// AVX2 twin of [`scores512`].
///
/// # Safety
/// AVX2 and FMA; extents as [`scores512`].
#[target_feature(enable = "avx2,fma")]
pub unsafe fn scores256<const BF: bool>(
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
            prefetch_row(kr, stride * esize(BF), dk * esize(BF));
            let mut mi = 0;
            while mi + 8 <= m {
                let mut d = [0.0f32; 8];
                dots256::<8, BF>(q.as_ptr().add(mi * dk), dk, kr, &mut d);
                for g in 0..8 {
                    out[(mi + g) * ldo + i] = d[g] * scale;
                }
                mi += 8;
            }
            while mi + 4 <= m {
                let mut d = [0.0f32; 4];
                dots256::<4, BF>(q.as_ptr().add(mi * dk), dk, kr, &mut d);
                for g in 0..4 {
                    out[(mi + g) * ldo + i] = d[g] * scale;
                }
                mi += 4;
            }
            while mi < m {
                let mut d = [0.0f32; 1];
                dots256::<1, BF>(q.as_ptr().add(mi * dk), dk, kr, &mut d);
                out[mi * ldo + i] = d[0] * scale;
                mi += 1;
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpys256<const G: usize, const BF: bool>(
    p: *const f32,
    ldp: usize,
    v: *const u8,
    stride: usize,
    n: usize,
    acc: *mut f32,
    dv: usize,
    c0: usize,
    rem: usize,
    prefetch: bool,
) {
    // SAFETY: as in `axpys512`.
    unsafe {
        let mut a = [_mm256_setzero_ps(); G];
        for g in 0..G {
            a[g] = if rem == 0 {
                _mm256_loadu_ps(acc.add(g * dv + c0))
            } else {
                ld8_tail::<false>(acc.add(g * dv) as *const u8, c0, rem)
            };
        }
        for i in 0..n {
            let vr = v.add(i * stride * esize(BF));
            if prefetch {
                prefetch_row(vr, stride * esize(BF), dv * esize(BF));
            }
            let vv = if rem == 0 {
                ld8::<BF>(vr, c0)
            } else {
                ld8_tail::<BF>(vr, c0, rem)
            };
            for g in 0..G {
                a[g] = _mm256_fmadd_ps(_mm256_set1_ps(*p.add(g * ldp + i)), vv, a[g]);
            }
        }
        for g in 0..G {
            if rem == 0 {
                _mm256_storeu_ps(acc.add(g * dv + c0), a[g]);
            } else {
                let mut buf = [0.0f32; 8];
                _mm256_storeu_ps(buf.as_mut_ptr(), a[g]);
                std::ptr::copy_nonoverlapping(buf.as_ptr(), acc.add(g * dv + c0), rem);
            }
        }
    }
}

/// AVX2 twin of [`accum512`].
///
/// # Safety
/// AVX2 and FMA; extents as [`accum512`].
#[target_feature(enable = "avx2,fma")]
pub unsafe fn accum256<const BF: bool>(
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
        let mut c0 = 0;
        while c0 < dv {
            let rem = if dv - c0 >= 8 { 0 } else { dv - c0 };
            let mut mi = 0;
            while mi + 8 <= m {
                axpys256::<8, BF>(
                    pp.add(mi * ldp),
                    ldp,
                    v,
                    stride,
                    n,
                    ap.add(mi * dv),
                    dv,
                    c0,
                    rem,
                    c0 == 0 && mi == 0,
                );
                mi += 8;
            }
            while mi + 4 <= m {
                axpys256::<4, BF>(
                    pp.add(mi * ldp),
                    ldp,
                    v,
                    stride,
                    n,
                    ap.add(mi * dv),
                    dv,
                    c0,
                    rem,
                    c0 == 0 && mi == 0,
                );
                mi += 4;
            }
            while mi < m {
                axpys256::<1, BF>(
                    pp.add(mi * ldp),
                    ldp,
                    v,
                    stride,
                    n,
                    ap.add(mi * dv),
                    dv,
                    c0,
                    rem,
                    c0 == 0 && mi == 0,
                );
                mi += 1;
            }
            c0 += 8;
        }
    }
}
