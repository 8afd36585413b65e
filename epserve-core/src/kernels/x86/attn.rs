//! Attention micro-kernels (AVX2 + FMA and AVX-512): the two inner loops of
//! [`crate::kernels::attention`] over a run of cached K/V rows, with the keys
//! and values either f32 or bf16 (widened by a 16-bit shift).
//!
//! - `scores`: `out[m·ldo + i] = scale · q_m · k_i` for `M` query vectors
//!   against `n` key rows `stride` elements apart. Up to eight queries share
//!   each key load (eight independent FMA chains); one horizontal sum per
//!   (query, key), always in the same order. On AVX-512 a run of 16 keys
//!   for eight queries reduces each pair of keys' 16 sums in one tree and
//!   transposes the eight pairs, so each query's 16 scores leave in one
//!   vector store (a decode step's whole GQA group against a KV block).
//! - `accum`: `acc[m·dv + c] += Σ_i p[m·ldp + i] · v_i[c]`: per chunk of
//!   value columns, up to eight queries' accumulators stay in registers over
//!   all `n` rows, each value load feeding eight FMAs.
//!
//! The functions are `unsafe`: callers must have checked the CPU features
//! (done once in [`crate::kernels::dispatch`]) and the slice lengths (done
//! by the safe wrappers on [`crate::kernels::dispatch::Kernels`]).

// Explicit query/lane indices read better than iterator chains in kernels.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use crate::kernels::{query_groups, row_scores};
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
    prefetch_l1(row.wrapping_add(PF_ROWS * row_bytes), bytes);
}

/// Hints the `bytes` bytes at `p` into L1, a line at a time (never faults).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn prefetch_l1(p: *const u8, bytes: usize) {
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

/// The horizontal sum of `v` in exactly [`reduce8`]'s order, so a score does
/// not depend on how many queries were computed with it (a sequence's
/// result must not depend on the rest of the batch): per 128-bit lane
/// `(e0 + e2) + (e1 + e3)`, then `(l0 + l1) + (l2 + l3)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
fn reduce1(v: __m512) -> f32 {
    let t = _mm512_add_ps(v, _mm512_permute_ps::<0b01_00_11_10>(v));
    let t = _mm512_add_ps(t, _mm512_permute_ps::<0b10_11_00_01>(t));
    let u = _mm512_add_ps(t, _mm512_shuffle_f32x4::<0b10_11_00_01>(t, t));
    _mm_cvtss_f32(_mm_add_ss(
        _mm512_castps512_ps128(u),
        _mm512_extractf32x4_ps::<2>(u),
    ))
}

/// Two vectors' per-lane pair sums: lane `l` of the result holds
/// `a0+a2, b0+b2, a1+a3, b1+b3` of `a`'s and `b`'s lane `l`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
fn pair_sums(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
}

/// Four vectors' per-lane sums: lane `l` holds the sums of `a[0..4]`'s
/// lane `l`, in order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
fn quad_sums(a: &[__m512]) -> __m512 {
    let (p01, p23) = (
        _mm512_castps_pd(pair_sums(a[0], a[1])),
        _mm512_castps_pd(pair_sums(a[2], a[3])),
    );
    _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(p01, p23)),
        _mm512_castpd_ps(_mm512_unpackhi_pd(p01, p23)),
    )
}

/// The eight horizontal sums of `a[0..8]`, in order, as one vector (a
/// transpose-and-add tree: 25 instructions for the eight reductions).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
fn reduce8(a: &[__m512; 8]) -> __m256 {
    let (x, y) = (quad_sums(&a[..4]), quad_sums(&a[4..]));
    // [x: l0+l1, l2+l3; y: l0+l1, l2+l3]
    let z = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
    );
    let (lo, hi) = (
        _mm512_castps512_ps256(z),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(z))),
    );
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(lo, hi),
        _mm256_permute2f128_ps::<0x31>(lo, hi),
    )
}

/// The sixteen horizontal sums of `a[0..16]`, in order, as one vector,
/// each in exactly [`reduce1`]'s order (four [`quad_sums`], then the
/// 128-bit lanes added as `(l0 + l1) + (l2 + l3)`: 45 instructions).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
fn reduce16(a: &[__m512; 16]) -> __m512 {
    let x = [
        quad_sums(&a[..4]),
        quad_sums(&a[4..8]),
        quad_sums(&a[8..12]),
        quad_sums(&a[12..]),
    ];
    // Per 128-bit lane: [x.l0 + x.l1, x.l2 + x.l3, y.l0 + y.l1, y.l2 + y.l3].
    let halves = |x: __m512, y: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    };
    halves(halves(x[0], x[1]), halves(x[2], x[3]))
}

/// The 8×8 transpose of 64-bit elements: `out[c]` element `r` is `r[r]`
/// element `c` (unpack, two-source permute, 128-bit shuffle: 24 instructions).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
fn transpose8x8_64(r: &[__m512d; 8]) -> [__m512d; 8] {
    let a: [__m512d; 8] = std::array::from_fn(|i| {
        let (x, y) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_pd(x, y)
        } else {
            _mm512_unpackhi_pd(x, y)
        }
    });
    // a[2k] = [r2k[0], r2k+1[0], r2k[2], r2k+1[2], ...], a[2k+1] the odd columns.
    let lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    let hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    let mut b = [_mm512_setzero_pd(); 8];
    for base in [0usize, 4] {
        // Rows base..base + 4: columns {0,4}, {2,6}, {1,5}, {3,7}.
        b[base] = _mm512_permutex2var_pd(a[base], lo, a[base + 2]);
        b[base + 1] = _mm512_permutex2var_pd(a[base], hi, a[base + 2]);
        b[base + 2] = _mm512_permutex2var_pd(a[base + 1], lo, a[base + 3]);
        b[base + 3] = _mm512_permutex2var_pd(a[base + 1], hi, a[base + 3]);
    }
    // b[j] (rows 0..4) and b[4 + j] (rows 4..8) hold columns c and c + 4,
    // c = [0, 2, 1, 3][j], as 128-bit lanes [c: r0r1, r2r3 | c+4: r0r1, r2r3].
    let mut out = [_mm512_setzero_pd(); 8];
    for (j, c) in [0usize, 2, 1, 3].into_iter().enumerate() {
        out[c] = _mm512_shuffle_f64x2::<0b01_00_01_00>(b[j], b[4 + j]);
        out[c + 4] = _mm512_shuffle_f64x2::<0b11_10_11_10>(b[j], b[4 + j]);
    }
    out
}

/// Eight key pairs' scaled scores (lanes `2g + j`: query `g`, key `j` of
/// the pair) transposed, so query `g`'s 16 scores are one store at
/// `out + g · ldo`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn store_pairs(pairs: &[__m512d; 8], out: *mut f32, ldo: usize) {
    // SAFETY: the caller guarantees 8 rows of 16 at `ldo`.
    unsafe {
        for (g, c) in transpose8x8_64(pairs).iter().enumerate() {
            _mm512_storeu_ps(out.add(g * ldo), _mm512_castpd_ps(*c));
        }
    }
}

/// Calls `f(mi, i)` for each whole run of 16 keys `i..i + 16` and each
/// group of eight queries `mi..mi + 8` (the 16-key score blocks); returns
/// the keys so covered (0 when there are fewer than eight queries).
#[inline]
fn blocks16(m: usize, n: usize, mut f: impl FnMut(usize, usize)) -> usize {
    let m8 = m / 8 * 8;
    if m8 == 0 {
        return 0;
    }
    let mut i = 0;
    while i + 16 <= n {
        for mi in (0..m8).step_by(8) {
            f(mi, i);
        }
        i += 16;
    }
    i
}

/// Eight queries (rows `dk` apart at `q`) against 16 key rows `rb` bytes
/// apart: pairs of keys as [`dots512x2`], each pair's 16 sums reduced in one
/// [`reduce16`] (query-major, key-minor lanes), scaled, and the eight pairs
/// transposed so each query's 16 scores are one vector store at `out`, rows
/// `ldo` apart. The bits equal [`dots512x2`]'s.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn scores8x16<const BF: bool>(
    q: *const f32,
    dk: usize,
    k: *const u8,
    rb: usize,
    scale: f32,
    out: *mut f32,
    ldo: usize,
) {
    let (full, rem) = (dk / 16, dk % 16);
    let mask = ((1u32 << rem) - 1) as u16;
    let sv = _mm512_set1_ps(scale);
    let mut pairs = [_mm512_setzero_pd(); 8];
    // SAFETY: `q` holds 8 rows of `dk`, `k` 16 rows `rb` bytes apart, `out`
    // 8 rows of 16 at `ldo`.
    unsafe {
        for (p, pair) in pairs.iter_mut().enumerate() {
            let k0 = k.add(2 * p * rb);
            let k1 = k0.add(rb);
            prefetch_row(k0, rb, dk * esize(BF));
            prefetch_row(k1, rb, dk * esize(BF));
            // a[2g + j]: query g against key j of the pair.
            let mut a = [_mm512_setzero_ps(); 16];
            for c in 0..full {
                let kv = [ld16::<BF>(k0, c * 16), ld16::<BF>(k1, c * 16)];
                for g in 0..8 {
                    let qv = _mm512_loadu_ps(q.add(g * dk + c * 16));
                    a[2 * g] = _mm512_fmadd_ps(qv, kv[0], a[2 * g]);
                    a[2 * g + 1] = _mm512_fmadd_ps(qv, kv[1], a[2 * g + 1]);
                }
            }
            if rem > 0 {
                let kv = [
                    ld16_tail::<BF>(k0, full * 16, rem),
                    ld16_tail::<BF>(k1, full * 16, rem),
                ];
                for g in 0..8 {
                    let qv = _mm512_maskz_loadu_ps(mask, q.add(g * dk + full * 16));
                    a[2 * g] = _mm512_fmadd_ps(qv, kv[0], a[2 * g]);
                    a[2 * g + 1] = _mm512_fmadd_ps(qv, kv[1], a[2 * g + 1]);
                }
            }
            *pair = _mm512_castps_pd(_mm512_mul_ps(reduce16(&a), sv));
        }
        store_pairs(&pairs, out, ldo);
    }
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
        let op = out.as_mut_ptr();
        let mut i = blocks16(m, n, |mi, i| {
            let (qp, kp, o) = (q.as_ptr().add(mi * dk), k.add(i * rb), op.add(mi * ldo + i));
            scores8x16::<BF>(qp, dk, kp, rb, scale, o, ldo);
        });
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
            let mi0 = if i < done { m8 } else { 0 };
            if mi0 == 0 {
                prefetch_row(kr, stride * esize(BF), dk * esize(BF));
            }
            row_scores!(dots512::<BF>, mi0, m, q, dk, kr, i, scale, out, ldo);
        }
    }
}

// ------------------------------------------------- AVX-512 BF16 queries

/// Words `i..i + 32` of the bf16 row at `p` (`rem` of them, zero-filled,
/// when `rem` is non-zero) as 16 bf16 pairs.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
unsafe fn ld32b(p: *const u16, i: usize, rem: usize) -> __m512bh {
    // SAFETY: the caller guarantees `rem` (32 when 0) words at `i`; masked
    // lanes are never read.
    unsafe {
        let v = if rem == 0 {
            _mm512_loadu_si512(p.add(i) as *const __m512i)
        } else {
            _mm512_maskz_loadu_epi16(((1u64 << rem) - 1) as u32, p.add(i) as *const i16)
        };
        std::mem::transmute::<__m512i, __m512bh>(v)
    }
}

/// One bf16 query (`dk` words at `q`) against one bf16 key row: `vdpbf16ps`
/// over 32-word chunks in order, then [`reduce1`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
unsafe fn dot1_b16(q: *const u16, dk: usize, k: *const u16) -> f32 {
    let (full, rem) = (dk / 32, dk % 32);
    let mut a = _mm512_setzero_ps();
    // SAFETY: `q` and `k` hold `dk` words each.
    unsafe {
        for c in 0..full {
            a = _mm512_dpbf16_ps(a, ld32b(q, c * 32, 0), ld32b(k, c * 32, 0));
        }
        if rem > 0 {
            a = _mm512_dpbf16_ps(a, ld32b(q, full * 32, rem), ld32b(k, full * 32, rem));
        }
    }
    reduce1(a)
}

/// [`scores8x16`] with bf16 queries: eight queries (rows `dk` words apart at
/// `q`) against 16 bf16 key rows `rb` bytes apart, each dot as
/// [`dot1_b16`]'s (same bits), each query's 16 scores one vector store.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
unsafe fn scores8x16_b16(
    q: *const u16,
    dk: usize,
    k: *const u8,
    rb: usize,
    scale: f32,
    out: *mut f32,
    ldo: usize,
) {
    let (full, rem) = (dk / 32, dk % 32);
    let sv = _mm512_set1_ps(scale);
    let mut pairs = [_mm512_setzero_pd(); 8];
    // SAFETY: `q` holds 8 rows of `dk` words, `k` 16 rows `rb` bytes apart,
    // `out` 8 rows of 16 at `ldo`.
    unsafe {
        for (p, pair) in pairs.iter_mut().enumerate() {
            let k0 = k.add(2 * p * rb);
            let k1 = k0.add(rb);
            prefetch_row(k0, rb, dk * 2);
            prefetch_row(k1, rb, dk * 2);
            let (k0, k1) = (k0 as *const u16, k1 as *const u16);
            // a[2g + j]: query g against key j of the pair.
            let mut a = [_mm512_setzero_ps(); 16];
            let mut chunk = |c0: usize, r: usize| {
                let kv = [ld32b(k0, c0, r), ld32b(k1, c0, r)];
                for g in 0..8 {
                    let qv = ld32b(q.add(g * dk), c0, r);
                    a[2 * g] = _mm512_dpbf16_ps(a[2 * g], qv, kv[0]);
                    a[2 * g + 1] = _mm512_dpbf16_ps(a[2 * g + 1], qv, kv[1]);
                }
            };
            for c in 0..full {
                chunk(c * 32, 0);
            }
            if rem > 0 {
                chunk(full * 32, rem);
            }
            *pair = _mm512_castps_pd(_mm512_mul_ps(reduce16(&a), sv));
        }
        store_pairs(&pairs, out, ldo);
    }
}

/// Scores of `qb.len() / dk` bf16 queries against `n` bf16 key rows
/// (`vdpbf16ps`: half the instructions of the widening f32 FMA path, and no
/// widening): 16-key runs of eight queries as [`scores8x16_b16`], the rest
/// one dot at a time, every dot with the same bits.
///
/// # Safety
/// AVX-512 F/BW/BF16 and FMA; `k` holds `(n - 1) · stride + dk` bf16
/// elements, `out` row `m` at `m · ldo` has `n`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
pub unsafe fn scores512_b16(
    qb: &[u16],
    dk: usize,
    k: *const u8,
    stride: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
    ldo: usize,
) {
    let m = qb.len() / dk;
    let rb = stride * 2;
    let m8 = m / 8 * 8;
    // SAFETY: the caller guarantees the features and the extents.
    unsafe {
        let op = out.as_mut_ptr();
        let done = blocks16(m, n, |mi, i| {
            let (qp, kp, o) = (
                qb.as_ptr().add(mi * dk),
                k.add(i * rb),
                op.add(mi * ldo + i),
            );
            scores8x16_b16(qp, dk, kp, rb, scale, o, ldo);
        });
        for i in 0..n {
            let kr = k.add(i * rb);
            prefetch_row(kr, rb, dk * 2);
            let m0 = if i < done { m8 } else { 0 };
            for mi in m0..m {
                out[mi * ldo + i] =
                    dot1_b16(qb.as_ptr().add(mi * dk), dk, kr as *const u16) * scale;
            }
        }
    }
}

/// `G` queries' accumulators for the `16·W` columns from `c0` over `n` value
/// rows (`W` = 1: `rem` of 16 when non-zero; `W` = 2 only for whole chunks).
/// Each probability is broadcast once and feeds `W` FMAs: with two, from a
/// register (an FMA with an indexed memory operand takes two slots of the
/// front end); with one, the compiler folds it into the FMA. `EMB` (with
/// two) gives each FMA an embedded broadcast operand instead, for the CPUs
/// where a `vbroadcastss` takes an FP slot (AMD Zen 4: see
/// [`super::avx512::bf16_pair_tile`]; `bench attention` at 8k on the EPYC
/// 1.02-1.08 → 0.98-1.04 ms). Each column's sum runs over the rows in
/// order, whatever `W` and `EMB`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn axpys512<const G: usize, const W: usize, const BF: bool, const EMB: bool>(
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
    hint: *const u8,
) {
    debug_assert!(rem == 0 || W == 1);
    let mask = if rem == 0 {
        0xFFFF
    } else {
        ((1u32 << rem) - 1) as u16
    };
    // SAFETY: the caller guarantees `G` accumulator rows of `dv`, `G` rows
    // of `n` probabilities `ldp` apart and `n` value rows, with the `16·W`
    // (or `rem`) columns from `c0`.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); G]; W];
        for (w, aw) in a.iter_mut().enumerate() {
            for g in 0..G {
                aw[g] = _mm512_maskz_loadu_ps(mask, acc.add(g * dv + c0 + 16 * w));
            }
        }
        for i in 0..n {
            let vr = v.add(i * stride * esize(BF));
            if prefetch {
                prefetch_row(vr, stride * esize(BF), dv * esize(BF));
            }
            // This pass's columns of the next block's row `i` (one line for
            // 32 bf16 columns): spread one or two hints a row.
            hint_share(hint, (i * stride + c0) * esize(BF), 16 * W * esize(BF));
            let mut vv = [_mm512_setzero_ps(); W];
            for (w, x) in vv.iter_mut().enumerate() {
                *x = if rem == 0 {
                    ld16::<BF>(vr, c0 + 16 * w)
                } else {
                    ld16_tail::<BF>(vr, c0, rem)
                };
            }
            for g in 0..G {
                if W == 1 || !EMB {
                    let pv = _mm512_set1_ps(*p.add(g * ldp + i));
                    for w in 0..W {
                        a[w][g] = _mm512_fmadd_ps(pv, vv[w], a[w][g]);
                    }
                } else {
                    let pg = p.add(g * ldp);
                    for w in 0..W {
                        std::arch::asm!(
                            "vfmadd231ps {a}, {v}, dword ptr [{p} + {i}*4]{{1to16}}",
                            a = inout(zmm_reg) a[w][g],
                            v = in(zmm_reg) vv[w],
                            p = in(reg) pg,
                            i = in(reg) i,
                            options(pure, readonly, nostack, preserves_flags)
                        );
                    }
                }
            }
        }
        for (w, aw) in a.iter().enumerate() {
            for g in 0..G {
                _mm512_mask_storeu_ps(acc.add(g * dv + c0 + 16 * w), mask, aw[g]);
            }
        }
    }
}

/// `acc[m·dv + c] += Σ_i p[m·ldp + i] · v_i[c]` for `acc.len() / dv` queries
/// (`EMB`: embedded broadcasts, the same bits; see [`axpys512`]).
///
/// # Safety
/// AVX-512 F/BW and FMA; `v` holds `(n - 1) · stride + dv` elements, `p`
/// row `m` at `m · ldp` has `n` values.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub unsafe fn accum512<const BF: bool, const EMB: bool>(
    p: &[f32],
    ldp: usize,
    v: *const u8,
    stride: usize,
    n: usize,
    acc: &mut [f32],
    dv: usize,
) {
    // SAFETY: as documented above.
    unsafe { accum512_hinted::<BF, EMB>(p, ldp, v, stride, n, acc, dv, std::ptr::null()) }
}

/// [`accum512`], hinting into L2 the `dv` elements of each of `n` rows
/// `stride` apart at `hint` (the next run's value rows of this KV head, or
/// with head planes its key blocks: see `attention::run_item`; null for
/// none), spread over its passes: each pass over 32 columns
/// hints those columns of the next block's row as it reads this block's
/// row. One burst of the block's 64 hints before the call stalled the core
/// on the line-fill buffers: `bench attention` at 8k on the 2-vCPU Xeon
/// without AMX, alternated, 1.21-1.36 ms per layer with the burst,
/// 1.16-1.19 ms with no value hints at all (see BENCHMARKS.md).
///
/// # Safety
/// As [`accum512`]; `hint` is only prefetched (it never faults).
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn accum512_hinted<const BF: bool, const EMB: bool>(
    p: &[f32],
    ldp: usize,
    v: *const u8,
    stride: usize,
    n: usize,
    acc: &mut [f32],
    dv: usize,
    hint: *const u8,
) {
    let m = acc.len() / dv;
    let (pp, ap) = (p.as_ptr(), acc.as_mut_ptr());
    // SAFETY: as documented above.
    unsafe {
        // 32 columns per pass while they last, then 16 (the last masked);
        // each probability feeds its FMAs from a register (32 columns) or
        // as an embedded broadcast operand (16).
        let mut c0 = 0;
        while c0 < dv {
            let wide = dv - c0 >= 32;
            let rem = if wide || dv - c0 >= 16 { 0 } else { dv - c0 };
            query_groups(m, |g, mi| {
                let (p, a, pf) = (pp.add(mi * ldp), ap.add(mi * dv), c0 == 0 && mi == 0);
                let h = if mi == 0 { hint } else { std::ptr::null() };
                match (g, wide) {
                    (8, true) => {
                        axpys512::<8, 2, BF, EMB>(p, ldp, v, stride, n, a, dv, c0, 0, pf, h)
                    }
                    (4, true) => {
                        axpys512::<4, 2, BF, EMB>(p, ldp, v, stride, n, a, dv, c0, 0, pf, h)
                    }
                    (_, true) => {
                        axpys512::<1, 2, BF, EMB>(p, ldp, v, stride, n, a, dv, c0, 0, pf, h)
                    }
                    (8, false) => {
                        axpys512::<8, 1, BF, EMB>(p, ldp, v, stride, n, a, dv, c0, rem, pf, h)
                    }
                    (4, false) => {
                        axpys512::<4, 1, BF, EMB>(p, ldp, v, stride, n, a, dv, c0, rem, pf, h)
                    }
                    _ => axpys512::<1, 1, BF, EMB>(p, ldp, v, stride, n, a, dv, c0, rem, pf, h),
                }
            });
            c0 += if wide { 32 } else { 16 };
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
            row_scores!(dots256::<BF>, 0, m, q, dk, kr, i, scale, out, ldo);
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
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
    hint: *const u8,
) {
    // One hint a line: the pass whose 8 columns start a 64-byte line of the
    // row hints that line of the next block's row.
    let hint = if (c0 * esize(BF)).is_multiple_of(64) {
        hint
    } else {
        std::ptr::null()
    };
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
            hint_share(hint, (i * stride + c0) * esize(BF), 64);
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

/// The loop of the AVX2 assembly passes ([`axpy8`], [`axpy8b`],
/// [`axpy4x16`]): `n` steps of the template lines `$step` (the row's
/// widening loads, the hint, the broadcasts and the FMAs into `a[0..8]`,
/// then `{p}` advanced), each step advancing `{vp}` by `{sb}`. Every pass
/// names `a0..a7` (`$a`'s accumulators, in registers across the loop), `p`,
/// `vp`, `h` (the hint pointer), `n` and `sb`; `$extra` adds its own
/// operands, and `$uses` is a comment naming those of them a variant leaves
/// unused (an operand must appear in the template).
macro_rules! pass_loop {
    ($a:expr, $p:expr, $v:expr, $h:expr, $n:expr, $sb:expr, $uses:literal;
     [$($step:expr),+ $(,)?]; $($extra:tt)*) => {
        std::arch::asm!(
            ".p2align 6",
            "2:",
            $($step,)+
            "add {vp}, {sb}",
            "dec {n}",
            "jnz 2b",
            $uses,
            a0 = inout(ymm_reg) $a[0],
            a1 = inout(ymm_reg) $a[1],
            a2 = inout(ymm_reg) $a[2],
            a3 = inout(ymm_reg) $a[3],
            a4 = inout(ymm_reg) $a[4],
            a5 = inout(ymm_reg) $a[5],
            a6 = inout(ymm_reg) $a[6],
            a7 = inout(ymm_reg) $a[7],
            p = inout(reg) $p => _,
            vp = inout(reg) $v => _,
            h = inout(reg) $h => _,
            n = inout(reg) $n => _,
            sb = in(reg) $sb,
            $($extra)*
            options(nostack, readonly),
        )
    };
}

/// A pass's four variants, bf16 or f32 rows × hinted or not: `$body!`
/// takes the row loads (`$bf16` or `$f32` lines) and the hint lines (a
/// `prefetcht1` of the line at `{h}` into L2, then `{h}` advanced by the
/// register `$hstep` names; none unhinted).
macro_rules! pass_variants {
    ($body:ident, $bf:expr, $hint:expr, $hstep:literal;
     bf16: [$($lb:literal),+]; f32: [$($lf:literal),+]) => {
        pass_variants!($body, $bf, $hint, false, $hstep;
            bf16: [$($lb),+]; f32: [$($lf),+])
    };
    // The same, the hint a `prefetcht0` (into L1) when `$l1`.
    ($body:ident, $bf:expr, $hint:expr, $l1:expr, $hstep:literal;
     bf16: [$($lb:literal),+]; f32: [$($lf:literal),+]) => {
        match ($bf, $hint, $l1) {
            (true, true, false) => $body!($($lb),+ ; "prefetcht1 byte ptr [{h}]", concat!("add {h}, ", $hstep)),
            (true, true, true) => $body!($($lb),+ ; "prefetcht0 byte ptr [{h}]", concat!("add {h}, ", $hstep)),
            (true, false, _) => $body!($($lb),+ ;),
            (false, true, false) => $body!($($lf),+ ; "prefetcht1 byte ptr [{h}]", concat!("add {h}, ", $hstep)),
            (false, true, true) => $body!($($lf),+ ; "prefetcht0 byte ptr [{h}]", concat!("add {h}, ", $hstep)),
            (false, false, _) => $body!($($lf),+ ;),
        }
    };
}

/// `n` steps of `a[g] += p[g·DK] · v` for 8 accumulators, in assembly,
/// `p` advancing `PSTEP` bytes and `v` (8 elements, widened) `stride_bytes`
/// a step: the inner loop of [`cols256_8`] (8 queries, rows `DK` = `dk`
/// apart, against key columns). Each step is a load, 8 broadcasts at
/// constant offsets and 8 FMAs, with no address arithmetic between them
/// and the accumulators kept in registers (the compiler's loops chained
/// address arithmetic between the broadcasts, and with a constant row
/// distance spilled an accumulator through the stack). `HINT`: each step
/// also hints the line at `hint` into L2, `hint_step` bytes apart. The
/// same operations in the same order as the intrinsics loop: the same bits.
///
/// # Safety
/// AVX2 and FMA; `n > 0`; `p` holds 8 rows `DK` apart of `n` values
/// `PSTEP` bytes apart, `v` `n` runs of 8 elements `stride_bytes` apart.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy8<const BF: bool, const DK: usize, const PSTEP: usize, const HINT: bool>(
    p: *const f32,
    v: *const u8,
    stride_bytes: usize,
    n: usize,
    a: &mut [__m256; 8],
    hint: *const u8,
    hint_step: usize,
) {
    macro_rules! body {
        ($($load:expr),+ ; $($pf:expr),*) => {
            pass_loop!(a, p, v, hint, n, stride_bytes, "/* {h} {hs} */"; [
                $($load,)+
                $($pf,)*
                "vbroadcastss {t0}, dword ptr [{p}]",
                "vfmadd231ps {a0}, {v}, {t0}",
                "vbroadcastss {t1}, dword ptr [{p} + {o1}]",
                "vfmadd231ps {a1}, {v}, {t1}",
                "vbroadcastss {t0}, dword ptr [{p} + {o2}]",
                "vfmadd231ps {a2}, {v}, {t0}",
                "vbroadcastss {t1}, dword ptr [{p} + {o3}]",
                "vfmadd231ps {a3}, {v}, {t1}",
                "vbroadcastss {t0}, dword ptr [{p} + {o4}]",
                "vfmadd231ps {a4}, {v}, {t0}",
                "vbroadcastss {t1}, dword ptr [{p} + {o5}]",
                "vfmadd231ps {a5}, {v}, {t1}",
                "vbroadcastss {t0}, dword ptr [{p} + {o6}]",
                "vfmadd231ps {a6}, {v}, {t0}",
                "vbroadcastss {t1}, dword ptr [{p} + {o7}]",
                "vfmadd231ps {a7}, {v}, {t1}",
                "add {p}, {ps}",
            ];
                v = out(ymm_reg) _,
                t0 = out(ymm_reg) _,
                t1 = out(ymm_reg) _,
                hs = in(reg) hint_step,
                ps = const PSTEP,
                o1 = const DK * 4,
                o2 = const 2 * DK * 4,
                o3 = const 3 * DK * 4,
                o4 = const 4 * DK * 4,
                o5 = const 5 * DK * 4,
                o6 = const 6 * DK * 4,
                o7 = const 7 * DK * 4,
            )
        };
    }
    // SAFETY: the caller guarantees the features and the extents; the
    // prefetches never fault.
    unsafe {
        pass_variants!(body, BF, HINT, "{hs}";
            bf16: ["vpmovzxwd {v}, xmmword ptr [{vp}]", "vpslld {v}, {v}, 16"];
            f32: ["vmovups {v}, ymmword ptr [{vp}]"])
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
    // SAFETY: as documented above.
    unsafe { accum256_hinted::<BF>(p, ldp, v, stride, n, acc, dv, std::ptr::null()) }
}

/// [`accum256`], hinting the rows at `hint` (the next run's value rows, or
/// with head planes its key blocks: see `attention::run_item`) into
/// L2 (into L1 on Zen 3: its `prefetcht1` fills L1) from inside the passes over the first query group, one line of the
/// next block's row per line of this block's row read (as
/// [`accum512_hinted`]), not as one burst before the call.
///
/// # Safety
/// As [`accum256`]; `hint` is only prefetched (it never faults).
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn accum256_hinted<const BF: bool>(
    p: &[f32],
    ldp: usize,
    v: *const u8,
    stride: usize,
    n: usize,
    acc: &mut [f32],
    dv: usize,
    hint: *const u8,
) {
    // SAFETY: as documented above.
    unsafe { accum256_lanes::<BF, false>(p, ldp, v, stride, n, acc, dv, hint) }
}

/// Whether [`accum256_permuted`] takes `m` accumulator rows of `dv`: every
/// row in a group of 8 or 4 queries with 16-column passes.
pub fn accum256_permutes(m: usize, dv: usize) -> bool {
    m > 0 && m.is_multiple_of(4) && dv >= 16
}

/// [`accum256_hinted`] over bf16 rows into accumulators kept in the even /
/// odd lane order of its passes ([`acc_permute256`]) between calls: every
/// call widens rows by a shift and a mask and none reorders the
/// accumulators in and out (which cost about 7 % of the value pass per
/// 64-key call: cached micro-benchmark 27.4 -> 25.4-26.0 ns a key; at 8k
/// context on Zen 3 the value pass's samples against the column scores'
/// went 1.070 -> 1.004, mean of 4 alternated `bench attention` runs, lower
/// in each). Same bits per column as [`accum256_hinted`].
///
/// # Safety
/// As [`accum256_hinted`]; [`accum256_permutes`] holds for `acc.len() / dv`
/// and `dv`, and `acc` is in the permuted order.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn accum256_permuted(
    p: &[f32],
    ldp: usize,
    v: *const u8,
    stride: usize,
    n: usize,
    acc: &mut [f32],
    dv: usize,
    hint: *const u8,
) {
    debug_assert!(accum256_permutes(acc.len() / dv, dv));
    // SAFETY: as documented above.
    unsafe { accum256_lanes::<true, true>(p, ldp, v, stride, n, acc, dv, hint) }
}

/// Accumulator rows of `dv` into the lane order [`accum256_permuted`] keeps
/// (`to`), or back: each row's 16-column groups to their even columns then
/// their odd ones; the last `dv % 16` columns stay. Moves only.
///
/// # Safety
/// AVX2.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn acc_permute256(acc: &mut [f32], dv: usize, to: bool) {
    let m = acc.len() / dv;
    // SAFETY: `m` rows of `dv` values are inside `acc`.
    unsafe { even_odd16(acc.as_mut_ptr(), dv, m, dv / 16 * 16, to) }
}

/// [`accum256_hinted`], its accumulators in the permuted order throughout
/// when `PERM` (bf16 rows only).
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn accum256_lanes<const BF: bool, const PERM: bool>(
    p: &[f32],
    ldp: usize,
    v: *const u8,
    stride: usize,
    n: usize,
    acc: &mut [f32],
    dv: usize,
    hint: *const u8,
) {
    let m = acc.len() / dv;
    let (pp, ap) = (p.as_ptr(), acc.as_mut_ptr());
    // SAFETY: as documented above.
    unsafe {
        let mut mi = 0;
        // Groups of 8 queries, then one of 4 (a GQA group of 4, e.g.
        // Mixtral's 32 / 8 heads at one token) where a 16-column pass fits.
        while mi + 4 <= m {
            let g = if mi + 8 <= m {
                8
            } else if dv >= 16 {
                4
            } else {
                break;
            };
            let h = if mi == 0 { hint } else { std::ptr::null() };
            accum8_256::<BF, PERM>(
                pp.add(mi * ldp),
                ldp,
                v,
                stride,
                n,
                ap.add(mi * dv),
                dv,
                h,
                g,
            );
            mi += g;
        }
        let rest = mi;
        let mut c0 = 0;
        while c0 < dv {
            let rem = if dv - c0 >= 8 { 0 } else { dv - c0 };
            let mut mi = rest;
            while mi < m {
                let (p, a) = (pp.add(mi * ldp), ap.add(mi * dv));
                let (pf, h) = if mi == 0 {
                    (c0 == 0, hint)
                } else {
                    (false, std::ptr::null())
                };
                if mi + 4 <= m {
                    axpys256::<4, BF>(p, ldp, v, stride, n, a, dv, c0, rem, pf, h);
                    mi += 4;
                } else {
                    axpys256::<1, BF>(p, ldp, v, stride, n, a, dv, c0, rem, pf, h);
                    mi += 1;
                }
            }
            c0 += 8;
        }
    }
}

/// Keys per chunk of [`accum8_256`]: its rows touched into L1 in one burst,
/// then every pass runs them. When a chunk's value rows lay 1 KiB apart (4
/// KV heads of 128 bf16 side by side) they shared a few L1 sets and 32 keys
/// evicted each other between the passes (Zen 3, 8k context: the value
/// pass 8 % fewer samples at 16 against the scores' in the same runs); with
/// rows padded by a line (`kv_cache::value_stride`) 16 keys still beat 32
/// (value / scores samples 1.19 against 1.36); 8 keys are no better. The
/// pool now stores each head in its own plane (rows one head wide).
const PB_KEYS: usize = 16;

/// Keys from which a bf16 call of [`accum8_256`] runs the even / odd
/// passes. On Zen 3 (8 queries, 128 columns, cache-resident micro) the
/// reordering of the accumulators in and out cost more than the passes
/// saved at 4-16 keys a call; at 8k context, where adjacent cache blocks
/// make 64-key calls, the value pass's samples against the column scores'
/// went 1.125 → 1.072 (mean of 6 alternated `bench attention` runs, lower
/// in each round).
/// (Calls over permuted accumulators, [`accum256_permuted`], run them at
/// any length: nothing to reorder.)
const EO_MIN_KEYS: usize = 48;

/// [`accum256_hinted`] for `m` = 8 or 4 queries (rows `ldp` apart at `p`,
/// accumulators `dv` apart at `acc`), a chunk of keys at a time: each pass over 16 value
/// columns and 4 queries runs [`axpy4x16`] (each probability broadcast once
/// for two FMAs: 6 loads per 8 FMAs, where 8 queries × 8 columns took 9);
/// a last group of 8 columns runs [`axpy8b`] over the chunk's
/// probabilities broadcast into a buffer, whose FMAs take them as memory
/// operands (on Zen 3 a `vbroadcastss` from memory occupies a vector pipe
/// the FMAs need: with a broadcast per FMA the loop ran at two thirds of
/// the FMA rate). Same operations per column in the same key order as
/// [`axpys256`]: the same bits.
///
/// # Safety
/// As [`accum256_hinted`] for `m` queries.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn accum8_256<const BF: bool, const PERM: bool>(
    p: *const f32,
    ldp: usize,
    v: *const u8,
    stride: usize,
    n: usize,
    acc: *mut f32,
    dv: usize,
    hint: *const u8,
    m: usize,
) {
    debug_assert!(m == 4 || m == 8);
    // The broadcast buffer, for a last group of 8 columns of 8 queries
    // only; written before it is read, chunk by chunk (not zeroed: 4 KiB).
    let eight = dv % 16 >= 8 && m == 8;
    let mut pb = std::mem::MaybeUninit::<[__m256; PB_KEYS * 8]>::uninit();
    let pb = pb.as_mut_ptr() as *mut __m256;
    let sb = stride * esize(BF);
    // Calls of at least `EO_MIN_KEYS` bf16 keys put the 16-column groups'
    // accumulators in the lane order of the even / odd passes (see
    // `axpy4x16`) for the whole call, and back at its end: their passes
    // then widen each row with a shift and a mask, not two zero-extend
    // shuffles and two shifts. Shorter calls keep the natural order (the
    // reordering would cost more than it saves).
    let w16 = dv / 16 * 16;
    let eo = BF && (PERM || n >= EO_MIN_KEYS);
    // Reordered here only when the caller keeps the natural order.
    let reorder = eo && !PERM;
    // With 8 queries the second group's passes whose columns start a line
    // hint the next chunk's rows' line into L1, one a step, in place of
    // the next chunk's burst (the first chunk of a call keeps its burst):
    // the burst's prefetches waited on a full miss queue (5 % of the value
    // pass's samples). On Zen 3 at 8k context the value / scores samples
    // went 1.147 -> 1.112 (mean of 6 alternated `bench attention` runs,
    // lower in 5).
    let spread = m == 8;
    // SAFETY: the caller guarantees `m` rows of `dv` accumulators at `acc`.
    if reorder {
        unsafe { even_odd16(acc, dv, m, w16, true) };
    }
    // SAFETY: the caller guarantees the extents; prefetches never fault.
    unsafe {
        let mut i0 = 0;
        while i0 < n {
            let nn = (n - i0).min(PB_KEYS);
            // The chunk's value rows into L1 in one burst before its
            // passes: the first pass over each new line otherwise waits on
            // it key by key, its FMA chains stalled behind the load (35 % of
            // the value pass's samples on Zen 3, 8k context), while the
            // burst's misses overlap each other.
            if !spread || i0 == 0 {
                for i in 0..nn {
                    prefetch_l1(v.add((i0 + i) * sb), dv * esize(BF));
                }
            }
            if eight {
                for i in 0..nn {
                    for g in 0..8 {
                        pb.add(i * 8 + g)
                            .write(_mm256_set1_ps(*p.add(g * ldp + i0 + i)));
                    }
                }
            }
            let vi = v.add(i0 * sb);
            let hi = if hint.is_null() {
                hint
            } else {
                hint.wrapping_add(i0 * sb)
            };
            let mut c0 = 0;
            while c0 + 16 <= dv {
                let vr = vi.add(c0 * esize(BF));
                for g0 in (0..m).step_by(4) {
                    let mut a = [_mm256_setzero_ps(); 8];
                    for g in 0..4 {
                        a[2 * g] = _mm256_loadu_ps(acc.add((g0 + g) * dv + c0));
                        a[2 * g + 1] = _mm256_loadu_ps(acc.add((g0 + g) * dv + c0 + 8));
                    }
                    // One hint a line of the next block's rows, on the
                    // first query group's pass whose columns start a line.
                    let line = (c0 * esize(BF)).is_multiple_of(64);
                    let (h, l1) = if g0 == 0 && !hi.is_null() && line {
                        (hi.wrapping_add(c0 * esize(BF)), false)
                    } else if g0 == 4 && spread && line && i0 + nn < n {
                        (v.wrapping_add((i0 + nn) * sb + c0 * esize(BF)), true)
                    } else {
                        (std::ptr::null(), false)
                    };
                    let pr = p.add(g0 * ldp + i0);
                    let l = ldp * 4;
                    match (eo, h.is_null(), l1) {
                        (true, true, _) => {
                            axpy4x16::<BF, true, false, false, 4>(pr, l, vr, sb, nn, &mut a, vr)
                        }
                        (true, false, false) => {
                            axpy4x16::<BF, true, true, false, 4>(pr, l, vr, sb, nn, &mut a, h)
                        }
                        (true, false, true) => {
                            axpy4x16::<BF, true, true, true, 4>(pr, l, vr, sb, nn, &mut a, h)
                        }
                        (false, true, _) => {
                            axpy4x16::<BF, false, false, false, 4>(pr, l, vr, sb, nn, &mut a, vr)
                        }
                        (false, false, false) => {
                            axpy4x16::<BF, false, true, false, 4>(pr, l, vr, sb, nn, &mut a, h)
                        }
                        (false, false, true) => {
                            axpy4x16::<BF, false, true, true, 4>(pr, l, vr, sb, nn, &mut a, h)
                        }
                    }
                    for g in 0..4 {
                        _mm256_storeu_ps(acc.add((g0 + g) * dv + c0), a[2 * g]);
                        _mm256_storeu_ps(acc.add((g0 + g) * dv + c0 + 8), a[2 * g + 1]);
                    }
                }
                c0 += 16;
            }
            if eight {
                let mut a = [_mm256_setzero_ps(); 8];
                for g in 0..8 {
                    a[g] = _mm256_loadu_ps(acc.add(g * dv + c0));
                }
                let vr = vi.add(c0 * esize(BF));
                // One hint a line of the next block's rows: on the pass
                // whose 8 columns start a 64-byte line.
                if !hi.is_null() && (c0 * esize(BF)).is_multiple_of(64) {
                    let h = hi.wrapping_add(c0 * esize(BF));
                    axpy8b::<BF, true>(pb, vr, sb, nn, &mut a, h);
                } else {
                    axpy8b::<BF, false>(pb, vr, sb, nn, &mut a, vr);
                }
                for g in 0..8 {
                    _mm256_storeu_ps(acc.add(g * dv + c0), a[g]);
                }
                c0 += 8;
            }
            // The columns left, 8 a pass (not hinted): the last `dv % 16`
            // of 4 queries, the last `dv % 8` of 8.
            let mut c = c0;
            while c < dv {
                let r = if dv - c >= 8 { 0 } else { dv - c };
                let (pc, null) = (p.add(i0), std::ptr::null());
                if m == 4 {
                    axpys256::<4, BF>(pc, ldp, vi, stride, nn, acc, dv, c, r, false, null);
                } else {
                    axpys256::<8, BF>(pc, ldp, vi, stride, nn, acc, dv, c, r, false, null);
                }
                c += 8;
            }
            i0 += nn;
        }
        if reorder {
            even_odd16(acc, dv, m, w16, false);
        }
    }
}

/// `m` rows of accumulators `dv` apart at `acc`, their first `w16` columns
/// (a multiple of 16) 16 at a time: natural order to the even columns then
/// the odd ones (`to`), or back (`!to`). Moves only: the same bits.
///
/// # Safety
/// AVX2; `acc` holds `m` rows of `dv ≥ w16` values.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn even_odd16(acc: *mut f32, dv: usize, m: usize, w16: usize, to: bool) {
    // SAFETY: as documented above.
    unsafe {
        for g in 0..m {
            let mut c0 = 0;
            while c0 < w16 {
                let a = acc.add(g * dv + c0);
                let (x, y) = (_mm256_loadu_ps(a), _mm256_loadu_ps(a.add(8)));
                let (x, y) = if to {
                    // Lanes 0 1 2 3 of each half: x0 x2 y0 y2 | x4 x6 y4 y6,
                    // then the middle 64-bit pairs swapped.
                    let e = _mm256_shuffle_ps::<0b10_00_10_00>(x, y);
                    let o = _mm256_shuffle_ps::<0b11_01_11_01>(x, y);
                    (
                        _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(
                            e,
                        ))),
                        _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(
                            o,
                        ))),
                    )
                } else {
                    let (lo, hi) = (_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
                    (
                        _mm256_permute2f128_ps::<0x20>(lo, hi),
                        _mm256_permute2f128_ps::<0x31>(lo, hi),
                    )
                };
                _mm256_storeu_ps(a, x);
                _mm256_storeu_ps(a.add(8), y);
                c0 += 16;
            }
        }
    }
}

/// `n` steps of `a[2g + h] += p[g] · v[8h..8h + 8]` for 4 queries and 16
/// value columns, in assembly: each query's probability `vbroadcastss`-ed
/// from its row (`lb` bytes apart at `p`) once for its two FMAs, `p`
/// advancing `PSTEP` bytes a step (one key; two dimensions in the column
/// scores, [`cols256_4x16`]); `v` 16 elements (widened) `stride_bytes`
/// apart. `EO` (bf16 only): the row is widened from one 32-byte load, as
/// the column scores' (`cols256_4x16`), `a[2g]` taking the even columns (a
/// shift) and `a[2g + 1]` the odd ones (a mask), lane `i` columns `2i` and
/// `2i + 1`, instead of two zero-extend shuffles and two shifts, which
/// share Zen 3's FMA pipes (a step of 8 FMAs from L1 in isolation: 1.37 →
/// 1.16 ns). Broadcasting them into a buffer per 16-key chunk first (8
/// broadcasts and 8 stores a key, each then loaded by a plain vector load)
/// cost more than it saved: on Zen 3 at 8k context the value pass's
/// samples against the column scores' went 1.18 → 1.12 without it (mean of
/// 4 alternated runs each, `bench attention`). `HINT`: each step hints the
/// line at `hint` into L2 (into L1 with `L1`), `stride_bytes` apart.
///
/// # Safety
/// AVX2 and FMA; `n > 0`; `p` holds 4 rows `lb` bytes apart of `n` values,
/// `v` `n` runs of 16 elements `stride_bytes` apart.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy4x16<
    const BF: bool,
    const EO: bool,
    const HINT: bool,
    const L1: bool,
    const PSTEP: usize,
>(
    p: *const f32,
    lb: usize,
    v: *const u8,
    stride_bytes: usize,
    n: usize,
    a: &mut [__m256; 8],
    hint: *const u8,
) {
    let l3 = 3 * lb;
    let hi = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
    macro_rules! body {
        ($($load:expr),+ ; $($pf:expr),*) => {
            pass_loop!(a, p, v, hint, n, stride_bytes, "/* {h} {hi} */"; [
                $($load,)+
                $($pf,)*
                "vbroadcastss {t0}, dword ptr [{p}]",
                "vfmadd231ps {a0}, {v0}, {t0}",
                "vfmadd231ps {a1}, {v1}, {t0}",
                "vbroadcastss {t1}, dword ptr [{p} + {l1}]",
                "vfmadd231ps {a2}, {v0}, {t1}",
                "vfmadd231ps {a3}, {v1}, {t1}",
                "vbroadcastss {t0}, dword ptr [{p} + {l1} * 2]",
                "vfmadd231ps {a4}, {v0}, {t0}",
                "vfmadd231ps {a5}, {v1}, {t0}",
                "vbroadcastss {t1}, dword ptr [{p} + {l3}]",
                "vfmadd231ps {a6}, {v0}, {t1}",
                "vfmadd231ps {a7}, {v1}, {t1}",
                "add {p}, {ps}",
            ];
                v0 = out(ymm_reg) _,
                v1 = out(ymm_reg) _,
                t0 = out(ymm_reg) _,
                t1 = out(ymm_reg) _,
                l1 = in(reg) lb,
                l3 = in(reg) l3,
                hi = in(ymm_reg) hi,
                ps = const PSTEP,
            )
        };
    }
    // SAFETY: the caller guarantees the features and the extents; the
    // prefetches never fault.
    unsafe {
        if EO {
            pass_variants!(body, BF, HINT, L1, "{sb}";
                bf16: [
                    "vmovdqu {v0}, ymmword ptr [{vp}]", "vpand {v1}, {v0}, {hi}",
                    "vpslld {v0}, {v0}, 16"
                ];
                f32: ["vmovups {v0}, ymmword ptr [{vp}]", "vmovups {v1}, ymmword ptr [{vp} + 32]"])
        } else {
            pass_variants!(body, BF, HINT, L1, "{sb}";
                bf16: [
                    "vpmovzxwd {v0}, xmmword ptr [{vp}]", "vpmovzxwd {v1}, xmmword ptr [{vp} + 16]",
                    "vpslld {v0}, {v0}, 16", "vpslld {v1}, {v1}, 16"
                ];
                f32: ["vmovups {v0}, ymmword ptr [{vp}]", "vmovups {v1}, ymmword ptr [{vp} + 32]"])
        }
    }
}

/// `n` steps of `a[g] += pb[g] · v` for 8 accumulators, in assembly: `pb`
/// (8 broadcast vectors a step, 256 bytes) as the FMAs' memory operands,
/// `v` 8 elements (widened) `stride_bytes` apart. `HINT`: each step also
/// hints the line at `hint` into L2, `stride_bytes` apart.
///
/// # Safety
/// AVX2 and FMA; `n > 0`; `pb` holds `8 · n` vectors, `v` `n` runs of 8
/// elements `stride_bytes` apart.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy8b<const BF: bool, const HINT: bool>(
    pb: *const __m256,
    v: *const u8,
    stride_bytes: usize,
    n: usize,
    a: &mut [__m256; 8],
    hint: *const u8,
) {
    macro_rules! body {
        ($($load:expr),+ ; $($pf:expr),*) => {
            pass_loop!(a, pb, v, hint, n, stride_bytes, "/* {h} */"; [
                $($load,)+
                $($pf,)*
                "vfmadd231ps {a0}, {v}, ymmword ptr [{p}]",
                "vfmadd231ps {a1}, {v}, ymmword ptr [{p} + 32]",
                "vfmadd231ps {a2}, {v}, ymmword ptr [{p} + 64]",
                "vfmadd231ps {a3}, {v}, ymmword ptr [{p} + 96]",
                "vfmadd231ps {a4}, {v}, ymmword ptr [{p} + 128]",
                "vfmadd231ps {a5}, {v}, ymmword ptr [{p} + 160]",
                "vfmadd231ps {a6}, {v}, ymmword ptr [{p} + 192]",
                "vfmadd231ps {a7}, {v}, ymmword ptr [{p} + 224]",
                "add {p}, 256",
            ];
                v = out(ymm_reg) _,
            )
        };
    }
    // SAFETY: the caller guarantees the features and the extents; the
    // prefetches never fault.
    unsafe {
        pass_variants!(body, BF, HINT, "{sb}";
            bf16: ["vpmovzxwd {v}, xmmword ptr [{vp}]", "vpslld {v}, {v}, 16"];
            f32: ["vmovups {v}, ymmword ptr [{vp}]"])
    }
}

// ---------------------------------------------------------------- softmax

// `crate::kernels::fast_exp`'s constants, lane-wise.
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
const ROUND: f32 = 12_582_912.0;
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
use crate::kernels::generic::EXP_FLOOR;
/// `ROUND`'s bits less the exponent bias: `t = d·log2e + ROUND` holds
/// `ROUND`'s bits plus the integer `n`, so `t`'s bits minus this are `n + 127`.
const ROUND_BITS_LESS_BIAS: i32 = ROUND.to_bits() as i32 - 127;

/// `fast_exp` on 16 lanes for `d ≤ 0`, 0 where `d < EXP_FLOOR` (`−∞`
/// included): [`exp256`]'s instructions (no clamp, the exponent from the
/// rounding sum's bits) on 16 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
fn exp512(d: __m512) -> __m512 {
    let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(d, _mm512_set1_ps(EXP_FLOOR));
    let round = _mm512_set1_ps(ROUND);
    let t = _mm512_fmadd_ps(d, _mm512_set1_ps(LOG2E), round);
    let n = _mm512_sub_ps(t, round);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), d);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(POLY[0]);
    for c in &POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let e = _mm512_slli_epi32::<23>(_mm512_sub_epi32(
        _mm512_castps_si512(t),
        _mm512_set1_epi32(ROUND_BITS_LESS_BIAS),
    ));
    _mm512_maskz_mul_ps(!under, p, _mm512_castsi512_ps(e))
}

/// One online-softmax step over a row of scores (see
/// [`crate::kernels::generic::attn_softmax`]); the sum is taken per lane
/// (element `i` in lane `i % 16`), so trailing zeros never change it.
///
/// # Safety
/// AVX-512 F/BW and FMA.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub unsafe fn softmax512(row: &mut [f32], prev_max: f32) -> (f32, f32) {
    let n = row.len();
    let (full, rem) = (n / 16 * 16, n % 16);
    let tmask = ((1u32 << rem) - 1) as u16;
    let p = row.as_mut_ptr();
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    // SAFETY: every access is inside `row` (masked for the tail).
    unsafe {
        let mut m = ninf;
        for i in (0..full).step_by(16) {
            m = _mm512_max_ps(m, _mm512_loadu_ps(p.add(i)));
        }
        if rem > 0 {
            m = _mm512_max_ps(m, _mm512_mask_loadu_ps(ninf, tmask, p.add(full)));
        }
        let cmax = _mm512_reduce_max_ps(m);
        if cmax == f32::NEG_INFINITY {
            row.fill(0.0);
            return (cmax, 0.0);
        }
        let top = _mm512_set1_ps(prev_max.max(cmax));
        let mut s = _mm512_setzero_ps();
        for i in (0..full).step_by(16) {
            let e = exp512(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), top));
            _mm512_storeu_ps(p.add(i), e);
            s = _mm512_add_ps(s, e);
        }
        if rem > 0 {
            let e = exp512(_mm512_sub_ps(
                _mm512_maskz_loadu_ps(tmask, p.add(full)),
                top,
            ));
            _mm512_mask_storeu_ps(p.add(full), tmask, e);
            s = _mm512_mask_add_ps(s, tmask, s, e);
        }
        (cmax, _mm512_reduce_add_ps(s))
    }
}

/// `fast_exp` on 8 lanes for `d ≤ 0` (a score minus a maximum at least as
/// large), 0 where `d < EXP_FLOOR` (`−∞` included).
///
/// Four instructions fewer than a literal translation of `fast_exp`, with
/// the same bits as that translation (checked over every `f32` in
/// `[−200, 0]` and `−∞` when this replaced it): on `[EXP_FLOOR, 0]` its
/// clamp to `[−87, 88]` does nothing, and below it every lane is zeroed
/// whatever it computed (a `−∞` lane's NaN included), so there is no clamp;
/// the exponent `n` is taken from the rounding sum's bits (as `fast_exp`
/// does), not by a conversion and an add.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp256(d: __m256) -> __m256 {
    let under = _mm256_cmp_ps::<_CMP_LT_OQ>(d, _mm256_set1_ps(EXP_FLOOR));
    let round = _mm256_set1_ps(ROUND);
    let t = _mm256_fmadd_ps(d, _mm256_set1_ps(LOG2E), round);
    let n = _mm256_sub_ps(t, round);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), d);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(POLY[0]);
    for c in &POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
    }
    // `n + 127` in the exponent field.
    let e = _mm256_slli_epi32::<23>(_mm256_sub_epi32(
        _mm256_castps_si256(t),
        _mm256_set1_epi32(ROUND_BITS_LESS_BIAS),
    ));
    _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)))
}

/// AVX2 twin of [`softmax512`] (element `i` in lane `i % 8`).
///
/// # Safety
/// AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn softmax256(row: &mut [f32], prev_max: f32) -> (f32, f32) {
    let n = row.len();
    let (full, rem) = (n / 8 * 8, n % 8);
    let p = row.as_mut_ptr();
    // The tail's lanes (`rem` of them), the others −∞. Masked loads and
    // stores, not a copy through a buffer (a `memcpy` call and a
    // `vzeroupper` per row, most rows having no tail).
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let tmask = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem as i32), lanes);
    // SAFETY: every access is inside `row` (masked lanes are not touched).
    unsafe {
        let tail = if rem > 0 {
            let t = _mm256_maskload_ps(p.add(full), tmask);
            _mm256_blendv_ps(ninf, t, _mm256_castsi256_ps(tmask))
        } else {
            ninf
        };
        let mut m = tail;
        for i in (0..full).step_by(8) {
            m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(i)));
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let cmax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps::<0b01>(h, h)));
        if cmax == f32::NEG_INFINITY {
            row.fill(0.0);
            return (cmax, 0.0);
        }
        let top = _mm256_set1_ps(prev_max.max(cmax));
        let mut s = _mm256_setzero_ps();
        for i in (0..full).step_by(8) {
            let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), top));
            _mm256_storeu_ps(p.add(i), e);
            s = _mm256_add_ps(s, e);
        }
        if rem > 0 {
            // The −∞ padding becomes exactly 0.
            let e = exp256(_mm256_sub_ps(tail, top));
            _mm256_maskstore_ps(p.add(full), tmask, e);
            s = _mm256_add_ps(s, e);
        }
        (cmax, hsum256(s))
    }
}

// ------------------------------------------- keys by column (all x86 tiers)
//
// A cache block's keys stored column by column (`k[c·bs + t]`, see
// `crate::kernels::attention::KvView::by_column`) put consecutive positions
// in a vector's lanes: one query element broadcast against a column of keys
// is one FMA for 16 (8) scores, with no horizontal sums at all. Each score
// is two chains over the key's elements, the even and the odd ones (FMA
// order), added at the end and scaled: the same bits for any query group,
// lane or call shape, on every tier (the scalar tails use `mul_add`).

/// Calls `f(g, mi, i0, mask)` for each run of up to 16 positions `i0..`
/// (`mask` of them) and each group of `g` ∈ {8, 4, 1} queries from `mi`
/// (the AVX-512 column kernels' blocking).
#[inline]
fn col_groups16(m: usize, n: usize, mut f: impl FnMut(usize, usize, usize, u16)) {
    let mut i0 = 0;
    while i0 < n {
        let mask = ((1u32 << (n - i0).min(16)) - 1) as u16;
        let mut mi = 0;
        for g in [8, 4, 1] {
            while mi + g <= m {
                f(g, mi, i0, mask);
                mi += g;
            }
        }
        i0 += 16;
    }
}

/// 16 positions (`mask` of them) of a column at `p` (element `i`), widened.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn ldm16<const BF: bool>(p: *const u8, i: usize, mask: u16) -> __m512 {
    // SAFETY: the caller guarantees the `mask`ed elements at `i`; masked-off
    // lanes are never read.
    unsafe {
        if BF && mask == 0xFFFF {
            // A whole run of 16: a 32-byte load. (The masked form below is a
            // 64-byte access, which crosses a cache line at every other
            // column of a 16-position block.)
            ld16::<true>(p, i)
        } else if BF {
            let raw = _mm512_maskz_loadu_epi16(mask as u32, (p as *const i16).add(i));
            let w = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
        } else {
            _mm512_maskz_loadu_ps(mask, (p as *const f32).add(i))
        }
    }
}

/// Hints the `bytes` bytes from byte `off` of `hint` into L2, unless `hint`
/// is null: one loop step's share of the next block the column kernels
/// hint (see [`scores_cols512_hinted`]). Prefetches never fault.
#[inline(always)]
fn hint_share(hint: *const u8, off: usize, bytes: usize) {
    if hint.is_null() {
        return;
    }
    let at = hint.wrapping_add(off);
    let mut b = 0;
    while b < bytes {
        // SAFETY: a prefetch is only a hint; it never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(b) as *const i8) };
        b += 64;
    }
}

/// `G` queries (rows `dk` apart at `q`) against the (`mask`ed) 16 positions
/// at `k` of a block's columns (`bs` apart): scaled scores to `out`, rows
/// `ldo` apart.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn cols512<const G: usize, const BF: bool>(
    q: *const f32,
    dk: usize,
    k: *const u8,
    bs: usize,
    mask: u16,
    scale: f32,
    out: *mut f32,
    ldo: usize,
    hint: *const u8,
    hint_step: usize,
) {
    let mut a = [[_mm512_setzero_ps(); G]; 2];
    // SAFETY: `q` holds `G` rows of `dk`, `k` `dk` columns with the masked
    // positions, `out` `G` rows with them. Prefetches never fault.
    unsafe {
        let mut d = 0;
        while d < dk {
            hint_share(hint, d / 2 * hint_step, hint_step);
            for (j, aj) in a.iter_mut().enumerate().take(dk - d) {
                let kv = ldm16::<BF>(k, (d + j) * bs, mask);
                for g in 0..G {
                    let qv = _mm512_set1_ps(*q.add(g * dk + d + j));
                    aj[g] = _mm512_fmadd_ps(qv, kv, aj[g]);
                }
            }
            d += 2;
        }
        let sv = _mm512_set1_ps(scale);
        for g in 0..G {
            let s = _mm512_mul_ps(_mm512_add_ps(a[0][g], a[1][g]), sv);
            _mm512_mask_storeu_ps(out.add(g * ldo), mask, s);
        }
    }
}

/// Scores of `q.len() / dk` queries against positions `t0..t0 + n` of one
/// KV head's keys in a cache block stored by column (`k` at its column 0,
/// position 0; columns `bs` apart): `out[m·ldo + i] = scale · q_m · k_{t0+i}`.
///
/// # Safety
/// AVX-512 F/BW and FMA; `k` holds `(dk - 1) · bs + t0 + n` elements (`2`
/// bytes each when `BF`, else `4`), `out` row `m` at `m · ldo` has `n`.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub unsafe fn scores_cols512<const BF: bool>(
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
    // SAFETY: as documented above.
    unsafe {
        scores_cols512_hinted::<BF>(
            q,
            dk,
            k,
            bs,
            t0,
            n,
            scale,
            out,
            ldo,
            std::ptr::null(),
            std::ptr::null(),
        )
    }
}

/// [`scores_cols512`], hinting the `dk · bs` elements at `hint` (another
/// cache block's columns of this KV head, the next one the caller reads;
/// null for none) into L2 spread over its first call's column loop, a
/// line or two per column pair. One burst of the block's 64 hints before
/// the call filled the line-fill buffers and stalled the core until memory
/// answered: `bench attention` at 8k on the EPYC (Zen 4) 1.00-1.04 → 0.82-0.92
/// ms per layer. `_next` (the caller's next call's block, which the AVX2
/// twin pulls into L1) is not used here: not measured on an AVX-512 CPU.
///
/// # Safety
/// As [`scores_cols512`]; `hint` is only prefetched (it never faults).
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn scores_cols512_hinted<const BF: bool>(
    q: &[f32],
    dk: usize,
    k: *const u8,
    bs: usize,
    t0: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
    ldo: usize,
    hint: *const u8,
    _next: *const u8,
) {
    let m = q.len() / dk;
    let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
    let kc = |i0: usize| k.wrapping_add((t0 + i0) * esize(BF));
    // Bytes hinted per column pair: the block's bytes over the pairs.
    let step = (dk * bs * esize(BF))
        .div_ceil(dk.div_ceil(2))
        .next_multiple_of(64);
    // SAFETY: the caller guarantees the features and the extents.
    col_groups16(m, n, |g, mi, i0, mask| unsafe {
        let (qg, o) = (qp.add(mi * dk), op.add(mi * ldo + i0));
        let h = if mi == 0 && i0 == 0 {
            hint
        } else {
            std::ptr::null()
        };
        match g {
            8 => cols512::<8, BF>(qg, dk, kc(i0), bs, mask, scale, o, ldo, h, step),
            4 => cols512::<4, BF>(qg, dk, kc(i0), bs, mask, scale, o, ldo, h, step),
            _ => cols512::<1, BF>(qg, dk, kc(i0), bs, mask, scale, o, ldo, h, step),
        }
    });
}

/// bf16 query pair `p` of the query at `q` (`dk` words), the missing odd
/// element of an odd `dk` zero, as one 32-bit lane.
#[inline]
unsafe fn qpair(q: *const u16, dk: usize, p: usize) -> i32 {
    // SAFETY: the caller guarantees `dk` words at `q` and `2p < dk`.
    unsafe {
        let lo = *q.add(2 * p) as u32;
        let hi = if 2 * p + 1 < dk {
            *q.add(2 * p + 1) as u32
        } else {
            0
        };
        (lo | (hi << 16)) as i32
    }
}

/// The `mask`ed words of 16 at `p` in the low half (the high half
/// undefined): a whole run is one 32-byte load (the masked form is a 64-byte
/// access, which crosses a cache line at every other column of a block).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn ldw16(p: *const u16, mask: u16) -> __m512i {
    // SAFETY: the caller guarantees the masked words at `p`; masked-off
    // words are never read.
    unsafe {
        if mask == 0xFFFF {
            _mm512_castsi256_si512(_mm256_loadu_si256(p as *const __m256i))
        } else {
            _mm512_maskz_loadu_epi16(mask as u32, p as *const i16)
        }
    }
}

/// [`cols512`] with bf16 queries (rows `dk` words apart at `q`) against bf16
/// columns: each pair of columns interleaved into 16 key pairs (one
/// permute) feeds `vdpbf16ps` with the query's pair broadcast; the chains
/// are the even and odd pairs.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
unsafe fn cols512_b16<const G: usize>(
    q: *const u16,
    dk: usize,
    k: *const u16,
    bs: usize,
    mask: u16,
    scale: f32,
    out: *mut f32,
    ldo: usize,
    hint: *const u8,
    hint_step: usize,
) {
    // Word 2j of the result is position j of the first column, word 2j + 1
    // position j of the second (index 32 + j).
    let idx = _mm512_set_epi16(
        47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
        35, 3, 34, 2, 33, 1, 32, 0,
    );
    let mut a = [[_mm512_setzero_ps(); G]; 2];
    // SAFETY: as in `cols512`, bf16 words.
    unsafe {
        let np = dk.div_ceil(2);
        let mut p0 = 0;
        while p0 < np {
            // Column pairs `2·p0 ..`: this loop step's share of the hint.
            hint_share(hint, p0 / 2 * hint_step, hint_step);
            for (j, aj) in a.iter_mut().enumerate().take(np - p0) {
                let p = p0 + j;
                let c0 = ldw16(k.add(2 * p * bs), mask);
                let c1 = if 2 * p + 1 < dk {
                    ldw16(k.add((2 * p + 1) * bs), mask)
                } else {
                    _mm512_setzero_si512()
                };
                let kp: __m512bh = std::mem::transmute(_mm512_permutex2var_epi16(c0, idx, c1));
                for g in 0..G {
                    let qv: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(qpair(q.add(g * dk), dk, p)));
                    aj[g] = _mm512_dpbf16_ps(aj[g], kp, qv);
                }
            }
            p0 += 2;
        }
        let sv = _mm512_set1_ps(scale);
        for g in 0..G {
            let s = _mm512_mul_ps(_mm512_add_ps(a[0][g], a[1][g]), sv);
            _mm512_mask_storeu_ps(out.add(g * ldo), mask, s);
        }
    }
}

/// [`scores_cols512`] with bf16 queries (`qb`, bf16 bits) against bf16
/// columns, on `vdpbf16ps`; `hint` (null for none) as in
/// [`scores_cols512_hinted`].
///
/// # Safety
/// AVX-512 F/BW/BF16 and FMA; extents as [`scores_cols512`] with `BF`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn scores_cols512_b16(
    qb: &[u16],
    dk: usize,
    k: *const u8,
    bs: usize,
    t0: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
    ldo: usize,
    hint: *const u8,
) {
    let m = qb.len() / dk;
    let (qp, op) = (qb.as_ptr(), out.as_mut_ptr());
    let kc = |i0: usize| (k as *const u16).wrapping_add(t0 + i0);
    // Bytes hinted per two column pairs (one loop step), as `scores_cols512_hinted`.
    let step = (dk * bs * 2).div_ceil(dk.div_ceil(4)).next_multiple_of(64);
    // SAFETY: the caller guarantees the features and the extents.
    col_groups16(m, n, |g, mi, i0, mask| unsafe {
        let (qg, o) = (qp.add(mi * dk), op.add(mi * ldo + i0));
        let h = if mi == 0 && i0 == 0 {
            hint
        } else {
            std::ptr::null()
        };
        match g {
            8 => cols512_b16::<8>(qg, dk, kc(i0), bs, mask, scale, o, ldo, h, step),
            4 => cols512_b16::<4>(qg, dk, kc(i0), bs, mask, scale, o, ldo, h, step),
            _ => cols512_b16::<1>(qg, dk, kc(i0), bs, mask, scale, o, ldo, h, step),
        }
    });
}

/// 8 positions of a column at `p` (element `i`), widened.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn ldc8<const BF: bool>(p: *const u8, i: usize) -> __m256 {
    // SAFETY: the caller guarantees 8 elements at `i`.
    unsafe {
        if BF {
            let raw = _mm_loadu_si128((p as *const u16).add(i) as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
        } else {
            _mm256_loadu_ps((p as *const f32).add(i))
        }
    }
}

/// [`cols512`] on AVX2: `G` queries against 8 whole positions.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn cols256<const G: usize, const BF: bool>(
    q: *const f32,
    dk: usize,
    k: *const u8,
    bs: usize,
    scale: f32,
    out: *mut f32,
    ldo: usize,
    hint: *const u8,
    hint_step: usize,
) {
    let mut a = [[_mm256_setzero_ps(); G]; 2];
    // SAFETY: as in `cols512`, 8 positions. Prefetches never fault.
    unsafe {
        let mut d = 0;
        while d < dk {
            hint_share(hint, d / 2 * hint_step, hint_step);
            for (j, aj) in a.iter_mut().enumerate().take(dk - d) {
                let kv = ldc8::<BF>(k, (d + j) * bs);
                for g in 0..G {
                    let qv = _mm256_set1_ps(*q.add(g * dk + d + j));
                    aj[g] = _mm256_fmadd_ps(qv, kv, aj[g]);
                }
            }
            d += 2;
        }
        let sv = _mm256_set1_ps(scale);
        for g in 0..G {
            let s = _mm256_mul_ps(_mm256_add_ps(a[0][g], a[1][g]), sv);
            _mm256_storeu_ps(out.add(g * ldo), s);
        }
    }
}

/// [`cols256`] for 8 queries with the same bits: 16 accumulators do not
/// fit AVX2's 16 registers, so the even columns' sums go through `out` and
/// the odd columns' are added in a second pass (`even + odd`, as `cols256`
/// adds its two sets). Each key column is widened once for the 8 queries,
/// not once per group of 4.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn cols256_8<const BF: bool>(
    q: *const f32,
    dk: usize,
    k: *const u8,
    bs: usize,
    scale: f32,
    out: *mut f32,
    ldo: usize,
    hint: *const u8,
    hint_step: usize,
) {
    const G: usize = 8;
    // SAFETY: as in `cols256`; `out` holds `G` rows of 8 at `ldo`.
    unsafe {
        for j in 0..2 {
            let mut a = [_mm256_setzero_ps(); G];
            if dk == 128 {
                // Column pairs: `q` 2 floats, the keys 2 columns a step.
                let (kj, sb) = (k.add(j * bs * esize(BF)), 2 * bs * esize(BF));
                if j == 0 && !hint.is_null() {
                    axpy8::<BF, 128, 8, true>(q, kj, sb, 64, &mut a, hint, hint_step);
                } else {
                    axpy8::<BF, 128, 8, false>(q.add(j), kj, sb, 64, &mut a, kj, sb);
                }
            } else {
                let mut d = j;
                while d < dk {
                    if j == 0 {
                        hint_share(hint, d / 2 * hint_step, hint_step);
                    }
                    let kv = ldc8::<BF>(k, d * bs);
                    for g in 0..G {
                        let qv = _mm256_set1_ps(*q.add(g * dk + d));
                        a[g] = _mm256_fmadd_ps(qv, kv, a[g]);
                    }
                    d += 2;
                }
            }
            if j == 0 {
                for g in 0..G {
                    _mm256_storeu_ps(out.add(g * ldo), a[g]);
                }
            } else {
                let sv = _mm256_set1_ps(scale);
                for g in 0..G {
                    let o = out.add(g * ldo);
                    let s = _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(o), a[g]), sv);
                    _mm256_storeu_ps(o, s);
                }
            }
        }
    }
}

/// [`cols256`] for 4 queries against 16 whole positions, with the same
/// bits: each broadcast query element feeds two FMAs (8 accumulators), so
/// Zen 3's vector pipes run 4 broadcasts per 8 FMAs, not one per FMA. bf16
/// columns are widened from one 32-byte load, the even positions by a
/// shift and the odd ones by a mask (no zero-extend shuffles); their sums
/// are put back in position order once, at the end. As in [`cols256_8`],
/// the even dimensions' sums go through `out` and the odd ones' are added
/// in a second pass (`even + odd`, then the scale).
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn cols256_4x16<const BF: bool>(
    q: *const f32,
    dk: usize,
    k: *const u8,
    bs: usize,
    scale: f32,
    out: *mut f32,
    ldo: usize,
    hint: *const u8,
    hint_step: usize,
    l1: *const u8,
) {
    const G: usize = 4;
    // SAFETY: the caller guarantees 16 positions of `dk` columns `bs`
    // elements apart at `k`, `G` query rows of `dk` at `q` and `G` rows of
    // 16 at `out`; prefetches never fault.
    unsafe {
        let hi = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
        for j in 0..2 {
            let mut a = [[_mm256_setzero_ps(); 2]; G];
            let mut d = j;
            if BF && bs == 16 {
                // The same steps in assembly (`axpy4x16`, two dimensions
                // a step: a column pair is 64 bytes, one hinted line): a
                // loop on a 64-byte boundary, widening with the mask the
                // compiler turned into a blend.
                let steps = (dk - j).div_ceil(2);
                let mut a8 = [_mm256_setzero_ps(); 8];
                if steps > 0 {
                    let (qj, kj, l) = (q.add(j), k.add(j * bs * 2), dk * 4);
                    if j == 0 && !hint.is_null() {
                        debug_assert_eq!(hint_step, 64);
                        axpy4x16::<true, true, true, false, 8>(
                            qj,
                            l,
                            kj,
                            4 * bs,
                            steps,
                            &mut a8,
                            hint,
                        );
                    } else if j == 1 && !l1.is_null() {
                        axpy4x16::<true, true, true, true, 8>(
                            qj,
                            l,
                            kj,
                            4 * bs,
                            steps,
                            &mut a8,
                            l1,
                        );
                    } else {
                        axpy4x16::<true, true, false, false, 8>(
                            qj,
                            l,
                            kj,
                            4 * bs,
                            steps,
                            &mut a8,
                            kj,
                        );
                    }
                }
                for (g, ag) in a.iter_mut().enumerate() {
                    *ag = [a8[2 * g], a8[2 * g + 1]];
                }
                d = dk;
            }
            while d < dk {
                if j == 0 {
                    hint_share(hint, d / 2 * hint_step, hint_step);
                }
                let (k0, k1) = if BF {
                    // Lane i: positions 2i (low half) and 2i + 1 (high).
                    let raw = _mm256_loadu_si256(k.add(d * bs * 2) as *const __m256i);
                    (
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw)),
                        _mm256_castsi256_ps(_mm256_and_si256(raw, hi)),
                    )
                } else {
                    let c = (k as *const f32).add(d * bs);
                    (_mm256_loadu_ps(c), _mm256_loadu_ps(c.add(8)))
                };
                for (g, ag) in a.iter_mut().enumerate() {
                    let qv = _mm256_set1_ps(*q.add(g * dk + d));
                    ag[0] = _mm256_fmadd_ps(qv, k0, ag[0]);
                    ag[1] = _mm256_fmadd_ps(qv, k1, ag[1]);
                }
                d += 2;
            }
            if j == 0 {
                // The even dimensions' sums, in the lane order above.
                for (g, ag) in a.iter().enumerate() {
                    _mm256_storeu_ps(out.add(g * ldo), ag[0]);
                    _mm256_storeu_ps(out.add(g * ldo + 8), ag[1]);
                }
                continue;
            }
            let sv = _mm256_set1_ps(scale);
            for (g, ag) in a.iter().enumerate() {
                let o = out.add(g * ldo);
                let s0 = _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(o), ag[0]), sv);
                let s1 = _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(o.add(8)), ag[1]), sv);
                let (s0, s1) = if BF {
                    // Even / odd positions back to 0..8, 8..16.
                    let (lo, hi) = (_mm256_unpacklo_ps(s0, s1), _mm256_unpackhi_ps(s0, s1));
                    (
                        _mm256_permute2f128_ps::<0x20>(lo, hi),
                        _mm256_permute2f128_ps::<0x31>(lo, hi),
                    )
                } else {
                    (s0, s1)
                };
                _mm256_storeu_ps(o, s0);
                _mm256_storeu_ps(o.add(8), s1);
            }
        }
    }
}

/// [`scores_cols512`] on AVX2 + FMA: runs of 16 positions for groups of
/// four queries (the rest one at a time), then runs of 8 positions for
/// groups of eight, four, then one query, the last positions one score at
/// a time.
///
/// # Safety
/// AVX2 and FMA; extents as [`scores_cols512`].
#[target_feature(enable = "avx2,fma")]
pub unsafe fn scores_cols256<const BF: bool>(
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
    // SAFETY: as documented above.
    unsafe {
        scores_cols256_hinted::<BF>(
            q,
            dk,
            k,
            bs,
            t0,
            n,
            scale,
            out,
            ldo,
            std::ptr::null(),
            std::ptr::null(),
        )
    }
}

/// [`scores_cols256`], hinting the `dk · bs` elements at `hint` (the next
/// cache block's columns of this KV head, or with head planes this run's
/// value rows: see `attention::run_item`; null for none) into L2 spread
/// over its first group's column loop, as [`scores_cols512_hinted`], and
/// those at `next` (the block of the caller's next call, null for none)
/// into L1, one line a step of the first group's second pass, on bf16
/// blocks of 16 with 8+ queries. The first touch of a block's lines had
/// held 15 % of the column scores' samples; on Zen 3 at 8k context the
/// value / scores samples went 1.039-1.091 → 1.131-1.171 (3 alternated
/// `bench attention` runs; a prototype hinting the adjacent pool block,
/// 6 runs: 1.053-1.091 → 1.096-1.152), higher in each: the value pass is
/// unchanged, so the scores took about 5 % less.
///
/// # Safety
/// As [`scores_cols256`]; `hint` and `next` are only prefetched (they never
/// fault).
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn scores_cols256_hinted<const BF: bool>(
    q: &[f32],
    dk: usize,
    k: *const u8,
    bs: usize,
    t0: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
    ldo: usize,
    hint: *const u8,
    next: *const u8,
) {
    let m = q.len() / dk;
    let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
    // Bytes hinted per column pair: the block's bytes over the pairs.
    let step = (dk * bs * esize(BF))
        .div_ceil(dk.div_ceil(2))
        .next_multiple_of(64);
    // SAFETY: the caller guarantees the features and the extents.
    unsafe {
        let mut i0 = 0;
        let mut h = hint;
        while i0 + 16 <= n && m >= 4 {
            let kc = k.add((t0 + i0) * esize(BF));
            let mut mi = 0;
            // The next run's columns into L1 from the first group's pass
            // over the odd dimensions (a 16-key block, 8+ queries: the
            // second group's passes read this block again, so they wait
            // for nothing).
            let mut l1 = if m >= 8 { next } else { std::ptr::null() };
            while mi + 4 <= m {
                let o = op.add(mi * ldo + i0);
                cols256_4x16::<BF>(qp.add(mi * dk), dk, kc, bs, scale, o, ldo, h, step, l1);
                h = std::ptr::null();
                l1 = std::ptr::null();
                mi += 4;
            }
            while mi < m {
                for i in [i0, i0 + 8] {
                    let (kc, o) = (k.add((t0 + i) * esize(BF)), op.add(mi * ldo + i));
                    cols256::<1, BF>(qp.add(mi * dk), dk, kc, bs, scale, o, ldo, h, step);
                    h = std::ptr::null();
                }
                mi += 1;
            }
            i0 += 16;
        }
        while i0 + 8 <= n {
            let kc = k.add((t0 + i0) * esize(BF));
            let mut mi = 0;
            while mi + 8 <= m {
                let o = op.add(mi * ldo + i0);
                cols256_8::<BF>(qp.add(mi * dk), dk, kc, bs, scale, o, ldo, h, step);
                h = std::ptr::null();
                mi += 8;
            }
            while mi + 4 <= m {
                let o = op.add(mi * ldo + i0);
                cols256::<4, BF>(qp.add(mi * dk), dk, kc, bs, scale, o, ldo, h, step);
                h = std::ptr::null();
                mi += 4;
            }
            while mi < m {
                let o = op.add(mi * ldo + i0);
                cols256::<1, BF>(qp.add(mi * dk), dk, kc, bs, scale, o, ldo, h, step);
                h = std::ptr::null();
                mi += 1;
            }
            i0 += 8;
        }
        if !h.is_null() {
            hint_share(h, 0, dk * bs * esize(BF));
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
