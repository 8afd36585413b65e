//! AVX2 + FMA micro-kernels (Haswell and later, Zen).
//!
//! - bf16: two 32-byte loads per pair of `k`s give all 16 channels; a shift
//!   and a mask widen each to two f32 vectors (see [`crate::kernels::layout`]);
//!   each token's two activations are broadcast and FMA'd. Up to [`BF16_MR`]
//!   tokens per tile (12 accumulators). Every tile size sums a token's
//!   products in the same order (one accumulator per 8 channels), so a
//!   token's bits do not depend on how many tokens share its tile: a
//!   retried decode of two positions gives the bits its five-row prefill
//!   gave. (One and two tokens used to split the `k` and `k + 1` products
//!   over two accumulator sets to hide FMA latency, which changed a row's
//!   bits between batch sizes; at one token the tile is bound by memory
//!   bandwidth on two cores either way: `bench step` decode phases at
//!   100-110 % of the read probe with one set, on the AMD EPYC Zen 3.)
//! - int8: `vpmaddubsw` wants an unsigned operand, so each weight byte takes
//!   the sign of its activation (`vpsignb`) and multiplies `|a|`; with both in
//!   `[-127, 127]` the i16 pair sums cannot saturate (2·127² < 2¹⁵). `vpmaddwd`
//!   with ones widens to i32. Up to [`I8_MR`] tokens per tile.
//!
//! The functions are `unsafe`: callers must have checked AVX2 and FMA (done
//! once in [`crate::kernels::dispatch`]) and the slice lengths.

// Explicit token/lane indices read better than iterator chains in kernels.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use crate::kernels::layout::{I8_GROUP_BYTES, KG, NR};

use super::l2_ahead;

/// Most tokens per bf16 tile.
pub const BF16_MR: usize = 6;
/// Most tokens per int8 tile.
pub const I8_MR: usize = 3;

/// bf16 tile, any `x.len()` in `1..=BF16_MR`.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `w.len()` is `16 · bf16_padded_k(kc)`,
/// every `x[t]` holds at least `kc` values and `acc` at least `16 · x.len()`.
pub unsafe fn bf16_tile(w: &[u16], kc: usize, x: &[&[f32]], acc: &mut [f32]) {
    let mut p = [std::ptr::null::<f32>(); BF16_MR];
    for (d, r) in p.iter_mut().zip(x) {
        *d = r.as_ptr();
    }
    let (w, acc) = (w.as_ptr(), acc.as_mut_ptr());
    // SAFETY: the caller guarantees the features and the lengths above.
    unsafe {
        match x.len() {
            1 => bf16_t::<1>(w, kc, &p, acc),
            2 => bf16_t::<2>(w, kc, &p, acc),
            3 => bf16_t::<3>(w, kc, &p, acc),
            4 => bf16_t::<4>(w, kc, &p, acc),
            5 => bf16_t::<5>(w, kc, &p, acc),
            6 => bf16_t::<6>(w, kc, &p, acc),
            _ => {}
        }
    }
}

/// Widens the 8 channels × 2 `k`s at `$w` (one k-pair's half panel) into
/// (channels at `k`, channels at `k + 1`). A macro, not a function: a helper
/// without `#[target_feature]` would keep the intrinsics out of line.
macro_rules! widen {
    ($w:expr, $mask:expr) => {{
        let raw = _mm256_loadu_si256($w as *const __m256i);
        (
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw)),
            _mm256_castsi256_ps(_mm256_and_si256(raw, $mask)),
        )
    }};
}

/// Bytes ahead of the current weights to prefetch: the stream of panels is
/// sequential, and a hint a few lines ahead keeps the core's miss queue full.
const PREFETCH: usize = 1024;

/// Hints the line `PREFETCH` bytes past `$p` into L1 (never faults).
macro_rules! prefetch {
    ($p:expr) => {
        _mm_prefetch::<_MM_HINT_T0>(($p as *const i8).wrapping_add(PREFETCH))
    };
}

/// `*acc[0..8] += v`.
macro_rules! store_add {
    ($acc:expr, $v:expr) => {{
        let p = $acc;
        _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), $v));
    }};
}

/// `T` tokens, one accumulator per 8 channels and token: the `k` and
/// `k + 1` products go to the same one, in order, at every `T` (see the
/// module note: a row's bits do not depend on its tile).
#[target_feature(enable = "avx2,fma")]
unsafe fn bf16_t<const T: usize>(
    w: *const u16,
    kc: usize,
    x: &[*const f32; BF16_MR],
    acc: *mut f32,
) {
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let mut lo = [_mm256_setzero_ps(); T];
    let mut hi = [_mm256_setzero_ps(); T];
    // SAFETY: pair `i < kc / 2` reads words `32i..32i+32` of `w` and values
    // `2i, 2i+1 < kc` of each row; the odd tail reads only value `kc - 1`.
    unsafe {
        for i in 0..kc / 2 {
            let wp = w.add(i * 2 * NR);
            prefetch!(wp);
            l2_ahead(wp as *const u8, T, 1);
            let (l0, l1) = widen!(wp, mask);
            let (h0, h1) = widen!(wp.add(NR), mask);
            for t in 0..T {
                let x0 = _mm256_broadcast_ss(&*x[t].add(2 * i));
                let x1 = _mm256_broadcast_ss(&*x[t].add(2 * i + 1));
                lo[t] = _mm256_fmadd_ps(x0, l0, lo[t]);
                hi[t] = _mm256_fmadd_ps(x0, h0, hi[t]);
                lo[t] = _mm256_fmadd_ps(x1, l1, lo[t]);
                hi[t] = _mm256_fmadd_ps(x1, h1, hi[t]);
            }
        }
        if kc % 2 == 1 {
            let wp = w.add((kc / 2) * 2 * NR);
            let (l0, _) = widen!(wp, mask);
            let (h0, _) = widen!(wp.add(NR), mask);
            for t in 0..T {
                let x0 = _mm256_broadcast_ss(&*x[t].add(kc - 1));
                lo[t] = _mm256_fmadd_ps(x0, l0, lo[t]);
                hi[t] = _mm256_fmadd_ps(x0, h0, hi[t]);
            }
        }
        for t in 0..T {
            store_add!(acc.add(t * NR), lo[t]);
            store_add!(acc.add(t * NR + 8), hi[t]);
        }
    }
}

/// int8 tile, any `x.len()` in `1..=I8_MR`.
///
/// # Safety
/// The CPU must support AVX2; `w.len()` is a multiple of 128, every `x[t]`
/// holds at least `8 · w.len() / 128` values in `[-127, 127]`, weights are in
/// `[-127, 127]`, and `acc` holds at least `16 · x.len()`.
pub unsafe fn i8_tile(w: &[i8], x: &[&[i8]], acc: &mut [i32]) {
    let groups = w.len() / I8_GROUP_BYTES;
    let mut p = [std::ptr::null::<i8>(); I8_MR];
    for (d, r) in p.iter_mut().zip(x) {
        *d = r.as_ptr();
    }
    let (w, acc) = (w.as_ptr(), acc.as_mut_ptr());
    // SAFETY: the caller guarantees the features and the lengths above.
    unsafe {
        match x.len() {
            1 => i8_t::<1>(w, groups, &p, acc),
            2 => i8_t::<2>(w, groups, &p, acc),
            3 => i8_t::<3>(w, groups, &p, acc),
            _ => {}
        }
    }
}

#[target_feature(enable = "avx2")]
unsafe fn i8_t<const T: usize>(w: *const i8, groups: usize, x: &[*const i8; I8_MR], acc: *mut i32) {
    let ones = _mm256_set1_epi16(1);
    // Accumulator v: channels 8(v%2)..+8, k-quad v/2 of each group; lane i is
    // channel 8(v%2) + i (the x86 int8 layout: two 64-byte k-quad rows).
    let mut c = [[_mm256_setzero_si256(); 4]; T];
    // SAFETY: `g < groups` keeps reads inside `w` (groups·128 bytes) and each
    // activation row (groups·8 bytes); unaligned loads are used throughout.
    unsafe {
        for g in 0..groups {
            let wp = w.add(g * I8_GROUP_BYTES) as *const __m256i;
            prefetch!(wp);
            prefetch!(wp.add(2));
            l2_ahead(wp as *const u8, T, 2);
            let wv = [
                _mm256_loadu_si256(wp),
                _mm256_loadu_si256(wp.add(1)),
                _mm256_loadu_si256(wp.add(2)),
                _mm256_loadu_si256(wp.add(3)),
            ];
            for t in 0..T {
                let xq = x[t].add(g * KG);
                let q = [
                    _mm256_set1_epi32(std::ptr::read_unaligned(xq as *const i32)),
                    _mm256_set1_epi32(std::ptr::read_unaligned(xq.add(4) as *const i32)),
                ];
                let aa = [_mm256_sign_epi8(q[0], q[0]), _mm256_sign_epi8(q[1], q[1])];
                for v in 0..4 {
                    // |x| · (w · sign x) = x · w, in u8 × s8 pairs summed to i16
                    // (|sum| ≤ 2 · 127², no saturation), then to i32.
                    let sw = _mm256_sign_epi8(wv[v], q[v / 2]);
                    let p16 = _mm256_maddubs_epi16(aa[v / 2], sw);
                    c[t][v] = _mm256_add_epi32(c[t][v], _mm256_madd_epi16(p16, ones));
                }
            }
        }
        for t in 0..T {
            let lo = _mm256_add_epi32(c[t][0], c[t][2]);
            let hi = _mm256_add_epi32(c[t][1], c[t][3]);
            let d = acc.add(t * NR) as *mut __m256i;
            _mm256_storeu_si256(d, _mm256_add_epi32(_mm256_loadu_si256(d), lo));
            let d = d.add(1);
            _mm256_storeu_si256(d, _mm256_add_epi32(_mm256_loadu_si256(d), hi));
        }
    }
}

/// Runs `iters` rounds of 12 independent 8-wide FMAs (the most this core can
/// retire) and returns a value that depends on all of them; the FLOPs are
/// `iters · 12 · 8 · 2`. Used by `epserve bench moe` to measure FMA peak.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn fma_probe(iters: usize, seed: f32) -> f32 {
    let m = _mm256_set1_ps(0.999_999);
    let a = _mm256_set1_ps(1e-7);
    let mut c = [_mm256_set1_ps(seed); 12];
    for _ in 0..iters {
        for v in c.iter_mut() {
            *v = _mm256_fmadd_ps(*v, m, a);
        }
    }
    let mut s = _mm256_setzero_ps();
    for v in c {
        s = _mm256_add_ps(s, v);
    }
    let mut l = [0.0f32; 8];
    // SAFETY: `l` holds eight f32.
    unsafe { _mm256_storeu_ps(l.as_mut_ptr(), s) };
    l.iter().sum()
}

/// [`crate::kernels::layout::transpose_pairs`] on AVX2: the 16 × 16 block
/// of 32-bit words (16 channels' next 16 pairs) as four 8 × 8 transposes
/// (unpack 32, unpack 64, 128-bit lane permutes).
///
/// # Safety
/// AVX2 must be available; every `rows[c]` holds at least 32 values and
/// `dst` at least 256 words.
#[target_feature(enable = "avx2")]
pub unsafe fn transpose_pairs(rows: &[&[u16]; NR], dst: &mut [u32]) {
    const _: () = assert!(NR == 16);
    debug_assert!(rows.iter().all(|r| r.len() >= 32) && dst.len() >= 256);
    // SAFETY: the caller guarantees the features and the extents.
    unsafe {
        for cg in 0..2 {
            for wg in 0..2 {
                // Words 8·wg.. of channels 8·cg..: r[i] is channel 8·cg + i.
                let r: [__m256i; 8] = std::array::from_fn(|i| {
                    _mm256_loadu_si256(rows[8 * cg + i].as_ptr().add(16 * wg) as *const __m256i)
                });
                // t[4i + j]: per 128-bit lane L, word 4L + j of channels
                // 4i..4i + 4 (as the AVX-512 tier's first stage).
                let mut t = [_mm256_setzero_si256(); 8];
                for i in 0..2 {
                    let (a, b, c, d) = (r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3]);
                    let (ab_lo, ab_hi) = (_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
                    let (cd_lo, cd_hi) = (_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
                    t[4 * i] = _mm256_unpacklo_epi64(ab_lo, cd_lo);
                    t[4 * i + 1] = _mm256_unpackhi_epi64(ab_lo, cd_lo);
                    t[4 * i + 2] = _mm256_unpacklo_epi64(ab_hi, cd_hi);
                    t[4 * i + 3] = _mm256_unpackhi_epi64(ab_hi, cd_hi);
                }
                // Word 4L + j of the eight channels: lane L of t[j] (channels
                // 0..4) and of t[4 + j] (4..8).
                for j in 0..4 {
                    let lo = _mm256_permute2x128_si256::<0x20>(t[j], t[4 + j]);
                    let hi = _mm256_permute2x128_si256::<0x31>(t[j], t[4 + j]);
                    let (q0, q1) = (8 * wg + j, 8 * wg + 4 + j);
                    _mm256_storeu_si256(dst.as_mut_ptr().add(q0 * NR + 8 * cg) as *mut __m256i, lo);
                    _mm256_storeu_si256(dst.as_mut_ptr().add(q1 * NR + 8 * cg) as *mut __m256i, hi);
                }
            }
        }
    }
}

/// [`crate::kernels::layout::quantize_bf16_row_i8`] compiled for AVX2 (the
/// same code, vectorized 8 lanes wide: the same IEEE operations, the same
/// bits).
///
/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_bf16_row_i8(row: &[u16], f: &mut [f32], q: &mut [i8]) -> f32 {
    crate::kernels::layout::quantize_bf16_row_i8(row, f, q)
}

/// Most tokens per B12 decode tile: four accumulators a token (two chains
/// for each half of the channels), and the decode needs registers too.
pub const B12_MR: usize = 2;

/// Bytes ahead of the current group that the B12 tile and decoder hint into
/// L1 (as the AVX-512 ones).
const B12_PREFETCH: usize = 3072;

/// Rebuilds half `$half` (pairs `2·half`, `2·half + 1`) of the B12 group `$g`
/// at `$gp` (see [`crate::kernels::b12`]): `[j][q]` holds channels
/// `8j..8j + 8` of the half's pair `q` as the bf16 panel stores them (two
/// words a channel), the panel's escapes or-ed in from its exception list
/// (`$ei`, `$next`: the next escape's index and stream position). A macro,
/// not a function, as [`widen!`].
macro_rules! b12_half {
    ($panel:expr, $gp:expr, $g:expr, $half:expr, $th:expr, $tl:expr, $ei:ident, $next:ident) => {{
        let m0f = _mm256_set1_epi8(0x0f);
        let m80 = _mm256_set1_epi8(0x80u8 as i8);
        let m7f = _mm256_set1_epi8(0x7f);
        let mut hb = [_mm256_setzero_si256(); 2];
        let mut lb = [_mm256_setzero_si256(); 2];
        for j in 0..2 {
            let cz = _mm256_loadu_si256($gp.add(128 + 32 * j) as *const __m256i);
            let ch = if $half == 0 {
                _mm256_and_si256(cz, m0f)
            } else {
                _mm256_and_si256(_mm256_srli_epi16::<4>(cz), m0f)
            };
            let sm = _mm256_loadu_si256($gp.add($half * 64 + 32 * j) as *const __m256i);
            // high byte (s & 0x80) | e >> 1, low byte (s & 0x7f) | (e & 1) << 7
            hb[j] = _mm256_or_si256(_mm256_and_si256(sm, m80), _mm256_shuffle_epi8($th, ch));
            lb[j] = _mm256_or_si256(_mm256_and_si256(sm, m7f), _mm256_shuffle_epi8($tl, ch));
        }
        let end = $g * 128 + $half * 64 + 64;
        if $next < end {
            let (mut hh, mut ll) = ([0u8; 64], [0u8; 64]);
            for j in 0..2 {
                _mm256_storeu_si256(hh.as_mut_ptr().add(32 * j) as *mut __m256i, hb[j]);
                _mm256_storeu_si256(ll.as_mut_ptr().add(32 * j) as *mut __m256i, lb[j]);
            }
            crate::kernels::b12::b12_patch(&$panel, end, &mut hh, &mut ll, &mut $ei, &mut $next);
            for j in 0..2 {
                hb[j] = _mm256_loadu_si256(hh.as_ptr().add(32 * j) as *const __m256i);
                lb[j] = _mm256_loadu_si256(ll.as_ptr().add(32 * j) as *const __m256i);
            }
        }
        // 32 bytes of a half are words 16j..16j + 16 of both its pairs: per
        // 128-bit lane, the low 8 bytes the first pair's, the high 8 the
        // second's.
        [
            [
                _mm256_unpacklo_epi8(lb[0], hb[0]),
                _mm256_unpackhi_epi8(lb[0], hb[0]),
            ],
            [
                _mm256_unpacklo_epi8(lb[1], hb[1]),
                _mm256_unpackhi_epi8(lb[1], hb[1]),
            ],
        ]
    }};
}

/// The B12 decode tile: `acc[t·16 + c] += Σ_k x[t][k] · W[c, k]` over a
/// whole panel for `x.len()` in `1..=B12_MR` tokens, bit for bit as the twin
/// `b12::b12_tile` (even and odd `k` in two FMA chains per channel).
///
/// # Safety
/// The CPU must support AVX2 and FMA; every `x[t]` holds at least `panel.k`
/// values and `acc` at least `16 · x.len()`.
pub unsafe fn b12_tile(panel: &crate::kernels::b12::B12Panel<'_>, x: &[&[f32]], acc: &mut [f32]) {
    // SAFETY: the caller guarantees the features and the lengths above.
    unsafe {
        match x.len() {
            1 => b12_t::<1>(panel, x, acc),
            2 => b12_t::<2>(panel, x, acc),
            _ => {}
        }
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn b12_t<const T: usize>(
    panel: &crate::kernels::b12::B12Panel<'_>,
    x: &[&[f32]],
    acc: &mut [f32],
) {
    use crate::kernels::b12::{B12_GROUP_BYTES, B12_GROUP_K};
    let k = panel.k;
    let groups = panel.groups();
    let full = k / B12_GROUP_K;
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    // SAFETY: `tables` is 32 bytes; `data` holds `groups` groups; the
    // caller guarantees `k` values per row of `x` and `16 · T` of `acc`.
    unsafe {
        let th =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(panel.tables.as_ptr() as *const __m128i));
        let tl = _mm256_broadcastsi128_si256(_mm_loadu_si128(
            panel.tables.as_ptr().add(16) as *const __m128i
        ));
        // [token][channels 0-7 | 8-15][even k | odd k]
        let mut a = [[[_mm256_setzero_ps(); 2]; 2]; T];
        let mut ei = 0usize;
        let mut next = panel.exc_pos.first().map_or(usize::MAX, |&p| p as usize);
        let tail = crate::kernels::b12::b12_tail::<T>(x, k);
        let d = panel.data.as_ptr();
        for g in 0..groups {
            let gp = d.add(g * B12_GROUP_BYTES);
            for l in 0..3 {
                _mm_prefetch::<_MM_HINT_T0>((gp as *const i8).wrapping_add(B12_PREFETCH + 64 * l));
            }
            l2_ahead(gp, T, 3);
            let xg: [*const f32; T] = std::array::from_fn(|t| {
                if g < full {
                    x[t].as_ptr().add(g * B12_GROUP_K)
                } else {
                    tail[t].as_ptr()
                }
            });
            for half in 0..2 {
                let raws = b12_half!(panel, gp, g, half, th, tl, ei, next);
                for q in 0..2 {
                    // This pair's first k in the group: 4·half + 2q.
                    let kk = half * 4 + q * 2;
                    for j in 0..2 {
                        let raw = raws[j][q];
                        let w0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                        let w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
                        for t in 0..T {
                            let x0 = _mm256_broadcast_ss(&*xg[t].add(kk));
                            let x1 = _mm256_broadcast_ss(&*xg[t].add(kk + 1));
                            a[t][j][0] = _mm256_fmadd_ps(x0, w0, a[t][j][0]);
                            a[t][j][1] = _mm256_fmadd_ps(x1, w1, a[t][j][1]);
                        }
                    }
                }
            }
        }
        let accp = acc.as_mut_ptr();
        for t in 0..T {
            for j in 0..2 {
                store_add!(
                    accp.add(t * NR + 8 * j),
                    _mm256_add_ps(a[t][j][0], a[t][j][1])
                );
            }
        }
    }
}

/// A B12 panel's words back as the bf16 panel (`dst`: as many words as it
/// holds, at most `b12_padded_k(k) · 16`), as the twin `b12::b12_decode`.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn b12_decode(panel: &crate::kernels::b12::B12Panel<'_>, dst: &mut [u16]) {
    use crate::kernels::b12::{B12_GROUP_BYTES, B12_GROUP_PAIRS};
    // SAFETY: `tables` is 32 bytes; `data` holds `groups` groups; every
    // store is to 16 whole words inside `dst`, a partial run is copied.
    unsafe {
        let th =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(panel.tables.as_ptr() as *const __m128i));
        let tl = _mm256_broadcastsi128_si256(_mm_loadu_si128(
            panel.tables.as_ptr().add(16) as *const __m128i
        ));
        let mut ei = 0usize;
        let mut next = panel.exc_pos.first().map_or(usize::MAX, |&p| p as usize);
        let d = panel.data.as_ptr();
        let out = dst.as_mut_ptr();
        for g in 0..panel.groups() {
            if g * B12_GROUP_PAIRS * 2 * NR >= dst.len() {
                break;
            }
            let gp = d.add(g * B12_GROUP_BYTES);
            for l in 0..3 {
                _mm_prefetch::<_MM_HINT_T0>((gp as *const i8).wrapping_add(B12_PREFETCH + 64 * l));
            }
            l2_ahead(gp, 2, 3);
            for half in 0..2 {
                let raws = b12_half!(panel, gp, g, half, th, tl, ei, next);
                for q in 0..2 {
                    let pair = g * B12_GROUP_PAIRS + half * 2 + q;
                    for j in 0..2 {
                        let at = pair * 2 * NR + 8 * 2 * j;
                        if at + 16 <= dst.len() {
                            _mm256_storeu_si256(out.add(at) as *mut __m256i, raws[j][q]);
                        } else if at < dst.len() {
                            let mut w = [0u16; 16];
                            _mm256_storeu_si256(w.as_mut_ptr() as *mut __m256i, raws[j][q]);
                            std::ptr::copy_nonoverlapping(w.as_ptr(), out.add(at), dst.len() - at);
                        }
                    }
                }
            }
        }
    }
}
