//! AVX-512 micro-kernels (Skylake-SP and later, Zen 4), in three tiers that
//! [`crate::kernels::dispatch`] picks at run time:
//!
//! - `avx512` (F + BW): bf16 weights widened to f32 (one 64-byte load per pair
//!   of `k`s is all 16 channels at `k` and `k + 1`: a shift and a mask give
//!   two zmm of f32) and FMA'd with f32 activations; up to [`BF16_MR`] tokens.
//!   int8 uses the AVX2 tile. The prefill path runs [`bf16_pair_tile`]: two
//!   panels per call over activations packed into one stream, so each
//!   broadcast feeds four FMAs.
//! - `avx512-vnni` (+ VNNI): int8 through `vpdpbusd`, four u8 × s8 products
//!   per i32 lane. The activations are signed, so they go in as `x + 128`
//!   (an XOR with 0x80) and the tile subtracts `128 · Σ w` per channel, which
//!   it sums in-register with a second `vpdpbusd` against ones: exact, and the
//!   same i32 as the scalar twin. Up to [`I8_MR`] tokens.
//! - `avx512-bf16` (+ BF16 + VNNI): bf16 weights *and* bf16 activations
//!   through `vdpbf16ps`, which multiplies each lane's adjacent bf16 pair (the
//!   packed `k`, `k + 1` of one channel) by a broadcast activation pair and
//!   adds both products in f32 — no widening at all. Used for experts loaded
//!   with bf16 activations (`--expert-dtype bf16`); exact bf16 experts keep
//!   f32 activations and the widening tile.
//!
//! The functions are `unsafe`: callers must have checked the features (done
//! once in [`crate::kernels::dispatch`]) and the slice lengths.

// Explicit token/lane indices read better than iterator chains in kernels.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use crate::kernels::layout::{BF16_PAIR_KC, I8_GROUP_BYTES, KG, NR};
use crate::kernels::row_ptrs as ptrs;

use super::l2_ahead;

/// Most tokens per bf16 tile (f32 activations).
pub const BF16_MR: usize = 12;
/// Most tokens per bf16 tile with bf16 activations.
pub const BF16X_MR: usize = 12;
/// Most tokens per int8 (VNNI) tile.
pub const I8_MR: usize = 8;

/// Bytes ahead of the current weights to prefetch (the panels are one
/// sequential stream).
const PREFETCH: usize = 1024;

/// Hints the line `PREFETCH` bytes past `$p` into L1 (never faults).
macro_rules! prefetch {
    ($p:expr) => {
        _mm_prefetch::<_MM_HINT_T0>(($p as *const i8).wrapping_add(PREFETCH))
    };
}

/// `$acc += broadcast(*($p + $d bytes)) · $w` as one FMA with an embedded
/// broadcast memory operand (`$d` a constant). The compiler keeps a value
/// that feeds several FMAs in a register (`vbroadcastss`); this form is for
/// the CPUs where that broadcast costs an FP slot (see [`bf16_pair_tile`]).
macro_rules! fma_bcst {
    ($acc:expr, $w:expr, $p:expr, $d:expr) => {
        std::arch::asm!(
            "vfmadd231ps {a}, {w}, dword ptr [{p} + {d}]{{1to16}}",
            a = inout(zmm_reg) $acc,
            w = in(zmm_reg) $w,
            p = in(reg) $p,
            d = const $d,
            options(pure, readonly, nostack, preserves_flags)
        )
    };
}

/// `$acc += $w · broadcast(*($p + $d bytes))` (a bf16 pair, `$acc` and `$w`
/// `__m512` / `__m512bh`) as one `vdpbf16ps` with an embedded broadcast
/// memory operand (`$d` a constant), as [`fma_bcst!`].
macro_rules! dpbf16_bcst {
    ($acc:expr, $w:expr, $p:expr, $d:expr) => {{
        let w: __m512 = std::mem::transmute($w);
        std::arch::asm!(
            "vdpbf16ps {a}, {w}, dword ptr [{p} + {d}]{{1to16}}",
            a = inout(zmm_reg) $acc,
            w = in(zmm_reg) w,
            p = in(reg) $p,
            d = const $d,
            options(pure, readonly, nostack, preserves_flags)
        )
    }};
}

/// Runs `$body` with the const `$t` = 0, 1, ... for each `$t < $n` (at most 12).
macro_rules! unroll_t {
    ($t:ident < $n:expr, $body:block) => {
        unroll_t!(@ $t, $n, $body; 0 1 2 3 4 5 6 7 8 9 10 11)
    };
    (@ $t:ident, $n:expr, $body:block; $($i:literal)*) => {
        $( {
            #[allow(non_upper_case_globals)]
            const $t: usize = $i;
            if $t < $n $body
        } )*
    };
}

/// `*acc[0..16] += v`.
macro_rules! store_add {
    ($acc:expr, $v:expr) => {{
        let p = $acc;
        _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), $v));
    }};
}

/// bf16 tile with f32 activations, any `x.len()` in `1..=BF16_MR`.
///
/// # Safety
/// The CPU must support AVX-512 F and BW; `w.len()` is
/// `16 · bf16_padded_k(kc)`, every `x[t]` holds at least `kc` values and
/// `acc` at least `16 · x.len()`.
pub unsafe fn bf16_tile(w: &[u16], kc: usize, x: &[&[f32]], acc: &mut [f32]) {
    let p = ptrs::<f32, BF16_MR>(x);
    let (w, acc) = (w.as_ptr(), acc.as_mut_ptr());
    // SAFETY: the caller guarantees the features and the lengths above.
    unsafe {
        match x.len() {
            1 => bf16_t::<1, 2>(w, kc, &p, acc),
            2 => bf16_t::<2, 2>(w, kc, &p, acc),
            3 => bf16_t::<3, 2>(w, kc, &p, acc),
            4 => bf16_t::<4, 2>(w, kc, &p, acc),
            5 => bf16_t::<5, 2>(w, kc, &p, acc),
            6 => bf16_t::<6, 2>(w, kc, &p, acc),
            7 => bf16_t::<7, 1>(w, kc, &p, acc),
            8 => bf16_t::<8, 1>(w, kc, &p, acc),
            9 => bf16_t::<9, 1>(w, kc, &p, acc),
            10 => bf16_t::<10, 1>(w, kc, &p, acc),
            11 => bf16_t::<11, 1>(w, kc, &p, acc),
            12 => bf16_t::<12, 1>(w, kc, &p, acc),
            _ => {}
        }
    }
}

/// `T` tokens, `S` accumulator sets (2: the `k` and `k + 1` products go to
/// separate accumulators so few tokens still give enough independent FMA
/// chains).
#[target_feature(enable = "avx512f,avx512bw,fma")]
unsafe fn bf16_t<const T: usize, const S: usize>(
    w: *const u16,
    kc: usize,
    x: &[*const f32; BF16_MR],
    acc: *mut f32,
) {
    let mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let mut a = [[_mm512_setzero_ps(); S]; T];
    // SAFETY: pair `i < kc / 2` reads words `32i..32i+32` of `w` and values
    // `2i, 2i+1 < kc` of each row; the odd tail reads only value `kc - 1`.
    unsafe {
        for i in 0..kc / 2 {
            let wp = w.add(i * 2 * NR);
            prefetch!(wp);
            l2_ahead(wp as *const u8, T, 1);
            let raw = _mm512_loadu_si512(wp as *const __m512i);
            let w0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(raw));
            let w1 = _mm512_castsi512_ps(_mm512_and_si512(raw, mask));
            for t in 0..T {
                let x0 = _mm512_set1_ps(*x[t].add(2 * i));
                let x1 = _mm512_set1_ps(*x[t].add(2 * i + 1));
                a[t][0] = _mm512_fmadd_ps(x0, w0, a[t][0]);
                a[t][S - 1] = _mm512_fmadd_ps(x1, w1, a[t][S - 1]);
            }
        }
        if kc % 2 == 1 {
            let raw = _mm512_loadu_si512(w.add((kc / 2) * 2 * NR) as *const __m512i);
            let w0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(raw));
            for t in 0..T {
                let x0 = _mm512_set1_ps(*x[t].add(kc - 1));
                a[t][0] = _mm512_fmadd_ps(x0, w0, a[t][0]);
            }
        }
        for t in 0..T {
            let mut v = a[t][0];
            if S > 1 {
                v = _mm512_add_ps(v, a[t][S - 1]);
            }
            store_add!(acc.add(t * NR), v);
        }
    }
}

/// Bytes ahead of the current weights that the two-panel tile also pulls
/// into L2: one K block of the executor's prefill path (`BF16_PAIR_KC` `k`s
/// × 16 channels × 2 bytes), so the first token tile of the next block does
/// not wait on DRAM.
const PAIR_L2_PREFETCH: usize = BF16_PAIR_KC * NR * 2;

/// The two-panel tiles' L2 hints for one `k`-pair step: both panels'
/// lines [`PAIR_L2_PREFETCH`] on, or, where this thread set a target
/// (`end != 0`, [`crate::kernels::set_pair_l2_target`]), the target's next
/// line while any is left.
#[inline(always)]
fn pair_l2_hints(pa: *const u16, pb: *const u16, h: &mut usize, end: usize) {
    // SAFETY (of the intrinsic): a prefetch never faults, at any address.
    unsafe {
        if end == 0 {
            _mm_prefetch::<_MM_HINT_T1>((pa as *const i8).wrapping_add(PAIR_L2_PREFETCH));
            _mm_prefetch::<_MM_HINT_T1>((pb as *const i8).wrapping_add(PAIR_L2_PREFETCH));
        } else if *h < end {
            _mm_prefetch::<_MM_HINT_T1>(*h as *const i8);
            *h += 64;
        }
    }
}

/// Most tokens per two-panel bf16 tile (f32 activations).
pub const BF16_PAIR_MR: usize = 12;

/// bf16 tile over **two** panels at once with f32 activations packed as
/// [`crate::kernels::layout::pack_pairs_f32`] lays them out (one sequential
/// stream), any `t` in `1..=BF16_PAIR_MR`: each activation feeds two FMAs
/// (two panels), half the loads per FMA of [`bf16_tile`]; `2·t`
/// accumulators (24 of the 32 zmm at `t = 12`).
///
/// `EMB` picks how an activation reaches its FMAs: `false` broadcasts it
/// into a register once (`vbroadcastss`), `true` gives each FMA an embedded
/// broadcast memory operand (`{1to16}`), twice the loads but no broadcast
/// instruction. The bits are the same. On AMD Zen 4 a zmm `vbroadcastss`
/// from memory takes a slot of the FP pipes the FMAs need (a micro-kernel
/// of one broadcast per two FMAs ran at 88 % of the FMA peak, the embedded
/// form at 100 %; `bench linear --tokens 128` 196-203 → 205-207 GFLOP/s,
/// EPYC 2026-12-06). Intel's broadcast is a pure load, and Skylake-SP and
/// Ice Lake have two load ports, which the embedded form would saturate:
/// see [`crate::kernels::dispatch`] for who gets which.
///
/// # Safety
/// The CPU must support AVX-512 F and BW; `w[0]` and `w[1]` are each
/// `16 · bf16_padded_k(kc)` words, `xp` holds `bf16_padded_k(kc) · t`
/// values and `acc[0]`, `acc[1]` at least `16 · t`.
pub unsafe fn bf16_pair_tile<const EMB: bool>(
    w: [&[u16]; 2],
    kc: usize,
    t: usize,
    xp: &[f32],
    acc: [&mut [f32]; 2],
) {
    let (w, xp) = ([w[0].as_ptr(), w[1].as_ptr()], xp.as_ptr());
    let [a0, a1] = acc;
    let acc = [a0.as_mut_ptr(), a1.as_mut_ptr()];
    // SAFETY: the caller guarantees the features and the lengths above.
    unsafe {
        match t {
            1 => bf16_pair_t::<1, EMB>(w, kc, xp, acc),
            2 => bf16_pair_t::<2, EMB>(w, kc, xp, acc),
            3 => bf16_pair_t::<3, EMB>(w, kc, xp, acc),
            4 => bf16_pair_t::<4, EMB>(w, kc, xp, acc),
            5 => bf16_pair_t::<5, EMB>(w, kc, xp, acc),
            6 => bf16_pair_t::<6, EMB>(w, kc, xp, acc),
            7 => bf16_pair_t::<7, EMB>(w, kc, xp, acc),
            8 => bf16_pair_t::<8, EMB>(w, kc, xp, acc),
            9 => bf16_pair_t::<9, EMB>(w, kc, xp, acc),
            10 => bf16_pair_t::<10, EMB>(w, kc, xp, acc),
            11 => bf16_pair_t::<11, EMB>(w, kc, xp, acc),
            12 => bf16_pair_t::<12, EMB>(w, kc, xp, acc),
            _ => {}
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,fma")]
unsafe fn bf16_pair_t<const T: usize, const EMB: bool>(
    w: [*const u16; 2],
    kc: usize,
    xp: *const f32,
    acc: [*mut f32; 2],
) {
    let mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let mut a = [[_mm512_setzero_ps(); 2]; T];
    // SAFETY: pair `i < kc / 2` reads words `32i..32i+32` of each panel and
    // values `2·T·i .. 2·T·(i+1)` of `xp`; the odd tail reads only the `k`
    // halves of the last pair.
    unsafe {
        let (mut h, end) = crate::kernels::pair_l2_target();
        for i in 0..kc / 2 {
            let (pa, pb) = (w[0].add(i * 2 * NR), w[1].add(i * 2 * NR));
            prefetch!(pa);
            prefetch!(pb);
            pair_l2_hints(pa, pb, &mut h, end);
            let ra = _mm512_loadu_si512(pa as *const __m512i);
            let rb = _mm512_loadu_si512(pb as *const __m512i);
            let wa0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(ra));
            let wa1 = _mm512_castsi512_ps(_mm512_and_si512(ra, mask));
            let wb0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(rb));
            let wb1 = _mm512_castsi512_ps(_mm512_and_si512(rb, mask));
            let x = xp.add(i * 2 * T);
            if EMB {
                const { assert!(T <= 12, "unroll_t! unrolls 12 tokens") };
                unroll_t!(t < T, {
                    fma_bcst!(a[t][0], wa0, x, 8 * t);
                    fma_bcst!(a[t][1], wb0, x, 8 * t);
                    fma_bcst!(a[t][0], wa1, x, 8 * t + 4);
                    fma_bcst!(a[t][1], wb1, x, 8 * t + 4);
                });
            } else {
                for t in 0..T {
                    let x0 = _mm512_set1_ps(*x.add(2 * t));
                    a[t][0] = _mm512_fmadd_ps(x0, wa0, a[t][0]);
                    a[t][1] = _mm512_fmadd_ps(x0, wb0, a[t][1]);
                    let x1 = _mm512_set1_ps(*x.add(2 * t + 1));
                    a[t][0] = _mm512_fmadd_ps(x1, wa1, a[t][0]);
                    a[t][1] = _mm512_fmadd_ps(x1, wb1, a[t][1]);
                }
            }
        }
        if end != 0 {
            crate::kernels::advance_pair_l2_target(h);
        }
        if kc % 2 == 1 {
            let off = (kc / 2) * 2 * NR;
            let ra = _mm512_loadu_si512(w[0].add(off) as *const __m512i);
            let rb = _mm512_loadu_si512(w[1].add(off) as *const __m512i);
            let wa0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(ra));
            let wb0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(rb));
            let x = xp.add((kc / 2) * 2 * T);
            for t in 0..T {
                let x0 = _mm512_set1_ps(*x.add(2 * t));
                a[t][0] = _mm512_fmadd_ps(x0, wa0, a[t][0]);
                a[t][1] = _mm512_fmadd_ps(x0, wb0, a[t][1]);
            }
        }
        for t in 0..T {
            store_add!(acc[0].add(t * NR), a[t][0]);
            store_add!(acc[1].add(t * NR), a[t][1]);
        }
    }
}

/// bf16 tile with bf16 activations (`vdpbf16ps`), any `x.len()` in
/// `1..=BF16X_MR`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and BF16; `w.len()` is a multiple of
/// 32, every `x[t]` holds at least `w.len() / 16` values and `acc` at least
/// `16 · x.len()`.
pub unsafe fn bf16x_tile(w: &[u16], x: &[&[u16]], acc: &mut [f32]) {
    let pairs = w.len() / (2 * NR);
    let p = ptrs::<u16, BF16X_MR>(x);
    let (w, acc) = (w.as_ptr(), acc.as_mut_ptr());
    // SAFETY: the caller guarantees the features and the lengths above.
    unsafe {
        match x.len() {
            1 => bf16x_t::<1, 4>(w, pairs, &p, acc),
            2 => bf16x_t::<2, 4>(w, pairs, &p, acc),
            3 => bf16x_t::<3, 2>(w, pairs, &p, acc),
            4 => bf16x_t::<4, 2>(w, pairs, &p, acc),
            5 => bf16x_t::<5, 2>(w, pairs, &p, acc),
            6 => bf16x_t::<6, 2>(w, pairs, &p, acc),
            7 => bf16x_t::<7, 1>(w, pairs, &p, acc),
            8 => bf16x_t::<8, 1>(w, pairs, &p, acc),
            9 => bf16x_t::<9, 1>(w, pairs, &p, acc),
            10 => bf16x_t::<10, 1>(w, pairs, &p, acc),
            11 => bf16x_t::<11, 1>(w, pairs, &p, acc),
            12 => bf16x_t::<12, 1>(w, pairs, &p, acc),
            _ => {}
        }
    }
}

/// `T` tokens, `S` accumulator sets used round-robin over the pairs.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn bf16x_t<const T: usize, const S: usize>(
    w: *const u16,
    pairs: usize,
    x: &[*const u16; BF16X_MR],
    acc: *mut f32,
) {
    let mut a = [[_mm512_setzero_ps(); S]; T];
    // SAFETY: pair `i < pairs` reads words `32i..32i+32` of `w` and values
    // `2i, 2i+1` of each row (as one unaligned u32).
    unsafe {
        macro_rules! step {
            ($i:expr, $s:expr) => {{
                let i = $i;
                let wp = w.add(i * 2 * NR);
                prefetch!(wp);
                l2_ahead(wp as *const u8, T, 1);
                let wv: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp as *const __m512i));
                for t in 0..T {
                    let pair = std::ptr::read_unaligned(x[t].add(2 * i) as *const i32);
                    let xv: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                    a[t][$s] = _mm512_dpbf16_ps(a[t][$s], xv, wv);
                }
            }};
        }
        let mut i = 0;
        while i + S <= pairs {
            for s in 0..S {
                step!(i + s, s);
            }
            i += S;
        }
        while i < pairs {
            step!(i, 0);
            i += 1;
        }
        for t in 0..T {
            let mut v = a[t][0];
            for s in 1..S {
                v = _mm512_add_ps(v, a[t][s]);
            }
            store_add!(acc.add(t * NR), v);
        }
    }
}

/// Most tokens per two-panel bf16 dot tile.
pub const BF16X_PAIR_MR: usize = 12;

/// bf16 dot tile over **two** panels at once with bf16 activations packed
/// by [`crate::kernels::layout::pack_pairs_b16`] (one sequential stream;
/// each row's pair of `k`s is one 32-bit word), any `t` in
/// `1..=BF16X_PAIR_MR`: each broadcast feeds two `vdpbf16ps` (one per
/// panel), `2·t` accumulators (24 of the 32 zmm at `t = 12`). The prefill
/// path of bf16 activations where the CPU runs `vdpbf16ps` faster than FMA
/// ([`crate::kernels::dispatch::Kernels::bf16x_prefill`]).
///
/// # Safety
/// The CPU must support AVX-512 F, BW and BF16; `w[0]` and `w[1]` have the
/// same length, a multiple of 32 words; `xp` holds `w[0].len() / 16 · t`
/// values and `acc[0]`, `acc[1]` at least `16 · t`.
pub unsafe fn bf16x_pair_tile<const EMB: bool>(
    w: [&[u16]; 2],
    t: usize,
    xp: &[u16],
    acc: [&mut [f32]; 2],
) {
    let pairs = w[0].len() / (2 * NR);
    let (w, xp) = ([w[0].as_ptr(), w[1].as_ptr()], xp.as_ptr() as *const i32);
    let [a0, a1] = acc;
    let acc = [a0.as_mut_ptr(), a1.as_mut_ptr()];
    // SAFETY: the caller guarantees the features and the lengths above.
    unsafe {
        match t {
            1 => bf16x_pair_t::<1, EMB>(w, pairs, xp, acc),
            2 => bf16x_pair_t::<2, EMB>(w, pairs, xp, acc),
            3 => bf16x_pair_t::<3, EMB>(w, pairs, xp, acc),
            4 => bf16x_pair_t::<4, EMB>(w, pairs, xp, acc),
            5 => bf16x_pair_t::<5, EMB>(w, pairs, xp, acc),
            6 => bf16x_pair_t::<6, EMB>(w, pairs, xp, acc),
            7 => bf16x_pair_t::<7, EMB>(w, pairs, xp, acc),
            8 => bf16x_pair_t::<8, EMB>(w, pairs, xp, acc),
            9 => bf16x_pair_t::<9, EMB>(w, pairs, xp, acc),
            10 => bf16x_pair_t::<10, EMB>(w, pairs, xp, acc),
            11 => bf16x_pair_t::<11, EMB>(w, pairs, xp, acc),
            12 => bf16x_pair_t::<12, EMB>(w, pairs, xp, acc),
            _ => {}
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn bf16x_pair_t<const T: usize, const EMB: bool>(
    w: [*const u16; 2],
    pairs: usize,
    xp: *const i32,
    acc: [*mut f32; 2],
) {
    let mut a = [[_mm512_setzero_ps(); 2]; T];
    // SAFETY: pair `i < pairs` reads words `32i..32i+32` of each panel and
    // the 32-bit words `T·i .. T·(i+1)` of `xp`.
    unsafe {
        let (mut h, end) = crate::kernels::pair_l2_target();
        for i in 0..pairs {
            let (pa, pb) = (w[0].add(i * 2 * NR), w[1].add(i * 2 * NR));
            prefetch!(pa);
            prefetch!(pb);
            pair_l2_hints(pa, pb, &mut h, end);
            let wa: __m512bh = std::mem::transmute(_mm512_loadu_si512(pa as *const __m512i));
            let wb: __m512bh = std::mem::transmute(_mm512_loadu_si512(pb as *const __m512i));
            let x = xp.add(i * T);
            if EMB {
                // The products are exact and commute: the broadcast pair as
                // the memory operand gives the same bits.
                const { assert!(T <= 12, "unroll_t! unrolls 12 tokens") };
                unroll_t!(t < T, {
                    dpbf16_bcst!(a[t][0], wa, x, 4 * t);
                    dpbf16_bcst!(a[t][1], wb, x, 4 * t);
                });
            } else {
                for t in 0..T {
                    let xv: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(x.add(t).read_unaligned()));
                    a[t][0] = _mm512_dpbf16_ps(a[t][0], xv, wa);
                    a[t][1] = _mm512_dpbf16_ps(a[t][1], xv, wb);
                }
            }
        }
        if end != 0 {
            crate::kernels::advance_pair_l2_target(h);
        }
        for t in 0..T {
            store_add!(acc[0].add(t * NR), a[t][0]);
            store_add!(acc[1].add(t * NR), a[t][1]);
        }
    }
}

/// int8 tile through VNNI, any `x.len()` in `1..=I8_MR`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `w.len()` is a multiple of
/// 128, every `x[t]` holds at least `8 · w.len() / 128` values, and `acc` at
/// least `16 · x.len()`. Any i8 values are exact (no saturation: `vpdpbusd`
/// sums four u8 × s8 products into i32).
pub unsafe fn i8_tile_vnni(w: &[i8], x: &[&[i8]], acc: &mut [i32]) {
    let groups = w.len() / I8_GROUP_BYTES;
    let p = ptrs::<i8, I8_MR>(x);
    let (w, acc) = (w.as_ptr(), acc.as_mut_ptr());
    // SAFETY: the caller guarantees the features and the lengths above.
    unsafe {
        match x.len() {
            1 => i8_vnni_t::<1>(w, groups, &p, acc),
            2 => i8_vnni_t::<2>(w, groups, &p, acc),
            3 => i8_vnni_t::<3>(w, groups, &p, acc),
            4 => i8_vnni_t::<4>(w, groups, &p, acc),
            5 => i8_vnni_t::<5>(w, groups, &p, acc),
            6 => i8_vnni_t::<6>(w, groups, &p, acc),
            7 => i8_vnni_t::<7>(w, groups, &p, acc),
            8 => i8_vnni_t::<8>(w, groups, &p, acc),
            _ => {}
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn i8_vnni_t<const T: usize>(
    w: *const i8,
    groups: usize,
    x: &[*const i8; I8_MR],
    acc: *mut i32,
) {
    const FLIP: u32 = 0x8080_8080;
    let ones = _mm512_set1_epi8(1);
    // Weight vector h of a group is k-quad h of all 16 channels (lane c =
    // channel c): the x86 int8 layout. One accumulator per quad and token.
    let mut c = [[_mm512_setzero_si512(); 2]; T];
    let mut ws = [_mm512_setzero_si512(); 2];
    // SAFETY: `g < groups` keeps reads inside `w` (groups·128 bytes) and each
    // activation row (groups·8 bytes); unaligned loads throughout.
    unsafe {
        for g in 0..groups {
            let wp = w.add(g * I8_GROUP_BYTES);
            prefetch!(wp);
            prefetch!(wp.add(64));
            l2_ahead(wp as *const u8, T, 2);
            let w0 = _mm512_loadu_si512(wp as *const __m512i);
            let w1 = _mm512_loadu_si512(wp.add(64) as *const __m512i);
            ws[0] = _mm512_dpbusd_epi32(ws[0], ones, w0);
            ws[1] = _mm512_dpbusd_epi32(ws[1], ones, w1);
            for t in 0..T {
                let xq = x[t].add(g * KG);
                // x + 128 as u8: flip each byte's sign bit before the broadcast.
                let a0 = std::ptr::read_unaligned(xq as *const u32) ^ FLIP;
                let a1 = std::ptr::read_unaligned(xq.add(4) as *const u32) ^ FLIP;
                let u0 = _mm512_set1_epi32(a0 as i32);
                let u1 = _mm512_set1_epi32(a1 as i32);
                c[t][0] = _mm512_dpbusd_epi32(c[t][0], u0, w0);
                c[t][1] = _mm512_dpbusd_epi32(c[t][1], u1, w1);
            }
        }
        // Σ (x + 128)·w − 128·Σ w per channel.
        let corr = _mm512_slli_epi32::<7>(_mm512_add_epi32(ws[0], ws[1]));
        for t in 0..T {
            let s = _mm512_sub_epi32(_mm512_add_epi32(c[t][0], c[t][1]), corr);
            let d = acc.add(t * NR) as *mut __m512i;
            _mm512_storeu_si512(d, _mm512_add_epi32(_mm512_loadu_si512(d), s));
        }
    }
}

/// [`crate::kernels::layout::split3_row`] sixteen values at a time (the
/// same integer rounding, so the same bits).
///
/// # Safety
/// AVX-512 F must be available; `hi`, `mid` and `lo` at least `x.len()`
/// long.
#[target_feature(enable = "avx512f")]
pub unsafe fn split3_row(x: &[f32], hi: &mut [u16], mid: &mut [u16], lo: &mut [u16]) {
    let n = x.len();
    debug_assert!(hi.len() >= n && mid.len() >= n && lo.len() >= n);
    let bias = _mm512_set1_epi32(0x7fff);
    let one = _mm512_set1_epi32(1);
    // Rounds each lane to bf16 (in the high half of the returned lanes'
    // bits, low half zero): the value and its bits.
    let rne = |v: __m512| {
        let b = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), one);
        let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, _mm512_add_epi32(bias, lsb)));
        (_mm512_castsi512_ps(_mm512_slli_epi32::<16>(r)), r)
    };
    let mut k = 0;
    while k + 16 <= n {
        // SAFETY: `k + 16 <= n` and every slice is at least `n` long.
        unsafe {
            let v = _mm512_loadu_ps(x.as_ptr().add(k));
            let (h, hb) = rne(v);
            let r1 = _mm512_sub_ps(v, h);
            let (m, mb) = rne(r1);
            let (_, lb) = rne(_mm512_sub_ps(r1, m));
            _mm256_storeu_si256(hi.as_mut_ptr().add(k).cast(), _mm512_cvtepi32_epi16(hb));
            _mm256_storeu_si256(mid.as_mut_ptr().add(k).cast(), _mm512_cvtepi32_epi16(mb));
            _mm256_storeu_si256(lo.as_mut_ptr().add(k).cast(), _mm512_cvtepi32_epi16(lb));
        }
        k += 16;
    }
    crate::kernels::layout::split3_row(&x[k..], &mut hi[k..], &mut mid[k..], &mut lo[k..]);
}

/// Runs `iters` rounds of 16 independent 16-wide FMAs and returns a value
/// that depends on all of them; the FLOPs are `iters · 16 · 16 · 2`.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[target_feature(enable = "avx512f")]
pub unsafe fn fma_probe(iters: usize, seed: f32) -> f32 {
    let m = _mm512_set1_ps(0.999_999);
    let a = _mm512_set1_ps(1e-7);
    let mut c = [_mm512_set1_ps(seed); 16];
    for _ in 0..iters {
        for v in c.iter_mut() {
            *v = _mm512_fmadd_ps(*v, m, a);
        }
    }
    let mut s = _mm512_setzero_ps();
    for v in c {
        s = _mm512_add_ps(s, v);
    }
    _mm512_reduce_add_ps(s)
}

/// Runs `iters` rounds of 16 independent `vdpbf16ps` (16 lanes × two
/// multiply-adds) and returns a value that depends on all of them; the FLOPs
/// are `iters · 16 · 16 · 4`.
///
/// # Safety
/// The CPU must support AVX-512 F and BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub unsafe fn dpbf16_probe(iters: usize, seed: f32) -> f32 {
    // bf16 pairs (1e-3, 1e-3) and (1, 1): the sums grow slowly, stay finite.
    let a: __m512bh = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3), _mm512_set1_ps(1e-3));
    let b: __m512bh = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0), _mm512_set1_ps(1.0));
    let mut c = [_mm512_set1_ps(seed); 16];
    for _ in 0..iters {
        for v in c.iter_mut() {
            *v = _mm512_dpbf16_ps(*v, a, b);
        }
    }
    let mut s = _mm512_setzero_ps();
    for v in c {
        s = _mm512_add_ps(s, v);
    }
    _mm512_reduce_add_ps(s)
}

/// [`crate::kernels::layout::transpose_pairs`] as a 16 × 16 transpose of
/// 32-bit words in registers (two unpack stages within 128-bit lanes, two
/// lane shuffles).
///
/// # Safety
/// AVX-512 F must be available; every `rows[c]` holds at least 32 values
/// and `dst` at least 256 words.
#[target_feature(enable = "avx512f")]
pub unsafe fn transpose_pairs(rows: &[&[u16]; NR], dst: &mut [u32]) {
    const _: () = assert!(NR == 16);
    debug_assert!(rows.iter().all(|r| r.len() >= 32) && dst.len() >= 256);
    // SAFETY: the caller guarantees the features and the extents.
    unsafe {
        let r: [__m512i; 16] =
            std::array::from_fn(|c| _mm512_loadu_si512(rows[c].as_ptr() as *const _));
        // Per 128-bit lane L, for each four channels 4i..4i+4: u[4i + j]
        // holds word 4L + j of those channels.
        let mut u = [_mm512_setzero_si512(); 16];
        for i in 0..4 {
            let (a, b, c, d) = (r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3]);
            let (ab_lo, ab_hi) = (_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
            let (cd_lo, cd_hi) = (_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
            u[4 * i] = _mm512_unpacklo_epi64(ab_lo, cd_lo);
            u[4 * i + 1] = _mm512_unpackhi_epi64(ab_lo, cd_lo);
            u[4 * i + 2] = _mm512_unpacklo_epi64(ab_hi, cd_hi);
            u[4 * i + 3] = _mm512_unpackhi_epi64(ab_hi, cd_hi);
        }
        // Word 4L + j of all sixteen channels: lane L of u[j], u[4 + j],
        // u[8 + j], u[12 + j].
        let out = dst.as_mut_ptr() as *mut __m512i;
        for j in 0..4 {
            let v0 = _mm512_shuffle_i32x4::<0x88>(u[j], u[4 + j]);
            let v1 = _mm512_shuffle_i32x4::<0xDD>(u[j], u[4 + j]);
            let w0 = _mm512_shuffle_i32x4::<0x88>(u[8 + j], u[12 + j]);
            let w1 = _mm512_shuffle_i32x4::<0xDD>(u[8 + j], u[12 + j]);
            _mm512_storeu_si512(out.add(j), _mm512_shuffle_i32x4::<0x88>(v0, w0));
            _mm512_storeu_si512(out.add(4 + j), _mm512_shuffle_i32x4::<0x88>(v1, w1));
            _mm512_storeu_si512(out.add(8 + j), _mm512_shuffle_i32x4::<0xDD>(v0, w0));
            _mm512_storeu_si512(out.add(12 + j), _mm512_shuffle_i32x4::<0xDD>(v1, w1));
        }
    }
}

/// [`crate::kernels::layout::quantize_bf16_row_i8`] compiled for AVX-512
/// (the same code, vectorized 16 lanes wide: the same bits).
///
/// # Safety
/// AVX-512 F/BW must be available.
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn quantize_bf16_row_i8(row: &[u16], f: &mut [f32], q: &mut [i8]) -> f32 {
    crate::kernels::layout::quantize_bf16_row_i8(row, f, q)
}

/// Bytes ahead of the current group that the B12 decode tile hints into L1.
/// The tile decodes before it multiplies, so each byte takes longer than in
/// the bf16 tile and the hints run further ahead (a standalone two-thread
/// stream over 256 MiB: 1 KiB ahead ran 1.12-1.20x the bf16 tile's speed,
/// 3 KiB ahead 1.25-1.5x). It also hints [`super::L2_AHEAD`] into L2 for
/// one token, where the bf16 tile does not on AMD: on the 2-vCPU AMD EPYC
/// (Zen 4) `epserve bench linear --tokens 1` on one thread ran the q and o
/// shapes in 0.47-0.52 ms against 0.65-0.72 ms without, and a decode step
/// of the bench model 9.4-10.0 ms against 11.2 ms (`bench step`,
/// alternated, 2026-12-06).
const B12_PREFETCH: usize = 3072;

/// The B12 decode tile (see [`crate::kernels::b12`]): `acc[t·16 + c] +=
/// Σ_k x[t][k] · W[c, k]` over a whole panel for `x.len()` in
/// `1..=B12_MR` tokens, bit for bit as the twin `b12::b12_tile`.
///
/// # Safety
/// The CPU must support AVX-512 F and BW; every `x[t]` holds at least
/// `panel.k` values and `acc` at least `16 · x.len()`.
pub unsafe fn b12_tile(panel: &crate::kernels::b12::B12Panel<'_>, x: &[&[f32]], acc: &mut [f32]) {
    // SAFETY: the caller guarantees the features and the lengths above.
    unsafe {
        match x.len() {
            1 => b12_t::<1>(panel, x, acc),
            2 => b12_t::<2>(panel, x, acc),
            3 => b12_t::<3>(panel, x, acc),
            4 => b12_t::<4>(panel, x, acc),
            5 => b12_t::<5>(panel, x, acc),
            6 => b12_t::<6>(panel, x, acc),
            7 => b12_t::<7>(panel, x, acc),
            8 => b12_t::<8>(panel, x, acc),
            _ => {}
        }
    }
}

/// Rebuilds half `$half` (pairs `2·half`, `2·half + 1`) of the B12 group `$g`
/// at `$gp` (see [`crate::kernels::b12`]): `[q]` holds the half's pair `q`
/// as the bf16 panel stores it (32 words), the panel's escapes or-ed in from
/// its exception list (`$ei`, `$next`: the next escape's index and stream
/// position). A macro, as `store_add!`, so the intrinsics stay inline in the
/// `#[target_feature]` callers (the tile and the decoder).
macro_rules! b12_half {
    ($panel:expr, $gp:expr, $g:expr, $half:expr, $th:expr, $tl:expr, $ei:ident, $next:ident) => {{
        let m0f = _mm512_set1_epi8(0x0f);
        let m80 = _mm512_set1_epi8(0x80u8 as i8);
        let cz = _mm512_loadu_si512($gp.add(128) as *const __m512i);
        let ch = if $half == 0 {
            _mm512_and_si512(cz, m0f)
        } else {
            _mm512_and_si512(_mm512_srli_epi16::<4>(cz), m0f)
        };
        let sm = _mm512_loadu_si512($gp.add($half * 64) as *const __m512i);
        // high byte (s & 0x80) | e >> 1, low byte (s & 0x7f) | (e & 1) << 7
        let mut hb = _mm512_ternarylogic_epi32::<0xF8>(_mm512_shuffle_epi8($th, ch), sm, m80);
        let mut lb = _mm512_ternarylogic_epi32::<0xF4>(_mm512_shuffle_epi8($tl, ch), sm, m80);
        let end = $g * 128 + $half * 64 + 64;
        if $next < end {
            let (mut hh, mut ll) = ([0u8; 64], [0u8; 64]);
            _mm512_storeu_si512(hh.as_mut_ptr() as *mut __m512i, hb);
            _mm512_storeu_si512(ll.as_mut_ptr() as *mut __m512i, lb);
            crate::kernels::b12::b12_patch(&$panel, end, &mut hh, &mut ll, &mut $ei, &mut $next);
            hb = _mm512_loadu_si512(hh.as_ptr() as *const __m512i);
            lb = _mm512_loadu_si512(ll.as_ptr() as *const __m512i);
        }
        // Per 128-bit lane, the low 8 bytes belong to the first pair, the
        // high 8 to the second.
        [_mm512_unpacklo_epi8(lb, hb), _mm512_unpackhi_epi8(lb, hb)]
    }};
}

/// A B12 panel's words back as the bf16 panel (`dst`: as many words as it
/// holds, at most `b12_padded_k(k) · 16`), as the twin `b12::b12_decode`:
/// the tile's decode, stored instead of multiplied (prefill decodes each
/// panel once into a scratch the bf16 tiles read).
///
/// # Safety
/// The CPU must support AVX-512 F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn b12_decode(panel: &crate::kernels::b12::B12Panel<'_>, dst: &mut [u16]) {
    use crate::kernels::b12::{B12_GROUP_BYTES, B12_GROUP_PAIRS};
    // Whole pairs `dst` holds (a pair is 32 words); a partial one is written
    // from a copy.
    let pairs = dst.len() / (2 * NR);
    // SAFETY: `tables` is 32 bytes; `data` holds `groups` groups; every
    // store is to a whole pair inside `dst`.
    unsafe {
        let th = _mm512_broadcast_i32x4(_mm_loadu_si128(panel.tables.as_ptr() as *const __m128i));
        let tl = _mm512_broadcast_i32x4(_mm_loadu_si128(
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
            // The panels stream from memory: hinted as the tile hints them.
            for l in 0..3 {
                _mm_prefetch::<_MM_HINT_T0>((gp as *const i8).wrapping_add(B12_PREFETCH + 64 * l));
            }
            l2_ahead(gp, 2, 3);
            for half in 0..2 {
                let raws = b12_half!(panel, gp, g, half, th, tl, ei, next);
                for (q, raw) in raws.into_iter().enumerate() {
                    let pair = g * B12_GROUP_PAIRS + half * 2 + q;
                    if pair < pairs {
                        _mm512_storeu_si512(out.add(pair * 2 * NR) as *mut __m512i, raw);
                    } else if pair * 2 * NR < dst.len() {
                        let mut w = [0u16; 2 * NR];
                        _mm512_storeu_si512(w.as_mut_ptr() as *mut __m512i, raw);
                        let n = dst.len() - pair * 2 * NR;
                        std::ptr::copy_nonoverlapping(w.as_ptr(), out.add(pair * 2 * NR), n);
                    }
                }
            }
        }
    }
}

/// The B12 decode tile with **bf16** activations: `acc[t·16 + c] +=
/// Σ_k x[t][k] · W[c, k]` over a whole panel for `x.len()` in
/// `1..=B12_MR` rows of bf16 values (at least `bf16_padded_k(panel.k)`
/// each, zero past `k`), the panel decoded in registers (as [`b12_tile`])
/// and multiplied with `vdpbf16ps`: the bf16 dot tile's arithmetic at
/// B12's 0.75x bytes (twin `b12::b12x_tile`, within the dot tiles' bound).
///
/// # Safety
/// The CPU must support AVX-512 F, BW and BF16; the lengths as above and
/// `acc` at least `16 · x.len()`.
pub unsafe fn b12x_tile(panel: &crate::kernels::b12::B12Panel<'_>, x: &[&[u16]], acc: &mut [f32]) {
    // SAFETY: the caller guarantees the features and the lengths above.
    unsafe {
        match x.len() {
            1 => b12x_t::<1>(panel, x, acc),
            2 => b12x_t::<2>(panel, x, acc),
            3 => b12x_t::<3>(panel, x, acc),
            4 => b12x_t::<4>(panel, x, acc),
            5 => b12x_t::<5>(panel, x, acc),
            6 => b12x_t::<6>(panel, x, acc),
            7 => b12x_t::<7>(panel, x, acc),
            8 => b12x_t::<8>(panel, x, acc),
            _ => {}
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn b12x_t<const T: usize>(
    panel: &crate::kernels::b12::B12Panel<'_>,
    x: &[&[u16]],
    acc: &mut [f32],
) {
    use crate::kernels::b12::{B12_GROUP_BYTES, B12_GROUP_PAIRS};
    // Pairs each row holds (`k` padded to pairs); groups past `full` read a
    // zero-padded copy of the rows' last pairs.
    let pairs = crate::kernels::layout::bf16_padded_k(panel.k) / 2;
    let groups = panel.groups();
    let full = pairs / B12_GROUP_PAIRS;
    // SAFETY: `tables` is 32 bytes; `data` holds `groups` groups; the
    // caller guarantees `2 · pairs` values per row of `x` and `16 · T` of
    // `acc`.
    unsafe {
        let th = _mm512_broadcast_i32x4(_mm_loadu_si128(panel.tables.as_ptr() as *const __m128i));
        let tl = _mm512_broadcast_i32x4(_mm_loadu_si128(
            panel.tables.as_ptr().add(16) as *const __m128i
        ));
        let mut a = [[_mm512_setzero_ps(); 2]; T];
        let mut ei = 0usize;
        let mut next = panel.exc_pos.first().map_or(usize::MAX, |&p| p as usize);
        let tail: [[u32; B12_GROUP_PAIRS]; T] = std::array::from_fn(|t| {
            let mut v = [0u32; B12_GROUP_PAIRS];
            for (q, d) in v.iter_mut().enumerate() {
                let i = full * B12_GROUP_PAIRS + q;
                if i < pairs {
                    *d = u32::from(x[t][2 * i]) | u32::from(x[t][2 * i + 1]) << 16;
                }
            }
            v
        });
        let d = panel.data.as_ptr();
        for g in 0..groups {
            let gp = d.add(g * B12_GROUP_BYTES);
            for l in 0..3 {
                _mm_prefetch::<_MM_HINT_T0>((gp as *const i8).wrapping_add(B12_PREFETCH + 64 * l));
            }
            l2_ahead(gp, T.max(super::L2_AHEAD_MIN_T), 3);
            let xg: [*const u32; T] = std::array::from_fn(|t| {
                if g < full {
                    (x[t].as_ptr() as *const u32).wrapping_add(g * B12_GROUP_PAIRS)
                } else {
                    tail[t].as_ptr()
                }
            });
            for half in 0..2 {
                let raws = b12_half!(panel, gp, g, half, th, tl, ei, next);
                for (q, raw) in raws.into_iter().enumerate() {
                    let wv: __m512bh = std::mem::transmute(raw);
                    for t in 0..T {
                        let pair = std::ptr::read_unaligned(xg[t].add(half * 2 + q));
                        let xv: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair as i32));
                        a[t][q] = _mm512_dpbf16_ps(a[t][q], xv, wv);
                    }
                }
            }
        }
        let accp = acc.as_mut_ptr();
        for t in 0..T {
            store_add!(accp.add(t * NR), _mm512_add_ps(a[t][0], a[t][1]));
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,fma")]
unsafe fn b12_t<const T: usize>(
    panel: &crate::kernels::b12::B12Panel<'_>,
    x: &[&[f32]],
    acc: &mut [f32],
) {
    use crate::kernels::b12::{B12_GROUP_BYTES, B12_GROUP_K};
    let k = panel.k;
    let groups = panel.groups();
    let full = k / B12_GROUP_K;
    let mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    // SAFETY: `tables` is 32 bytes; `data` holds `groups` groups; the
    // caller guarantees `k` values per row of `x` and `16 · T` of `acc`.
    unsafe {
        let th = _mm512_broadcast_i32x4(_mm_loadu_si128(panel.tables.as_ptr() as *const __m128i));
        let tl = _mm512_broadcast_i32x4(_mm_loadu_si128(
            panel.tables.as_ptr().add(16) as *const __m128i
        ));
        let mut a = [[_mm512_setzero_ps(); 2]; T];
        let mut ei = 0usize;
        let mut next = panel.exc_pos.first().map_or(usize::MAX, |&p| p as usize);
        let tail = crate::kernels::b12::b12_tail::<T>(x, k);
        let d = panel.data.as_ptr();
        for g in 0..groups {
            let gp = d.add(g * B12_GROUP_BYTES);
            for l in 0..3 {
                _mm_prefetch::<_MM_HINT_T0>((gp as *const i8).wrapping_add(B12_PREFETCH + 64 * l));
            }
            // L2 hints for one token too, on every vendor (see `B12_PREFETCH`).
            l2_ahead(gp, T.max(super::L2_AHEAD_MIN_T), 3);
            let xg: [*const f32; T] = std::array::from_fn(|t| {
                if g < full {
                    x[t].as_ptr().add(g * B12_GROUP_K)
                } else {
                    tail[t].as_ptr()
                }
            });
            for half in 0..2 {
                let raws = b12_half!(panel, gp, g, half, th, tl, ei, next);
                for (q, raw) in raws.into_iter().enumerate() {
                    let w0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(raw));
                    let w1 = _mm512_castsi512_ps(_mm512_and_si512(raw, mask));
                    // This pair's first k in the group: 4·half + 2q.
                    let kk = half * 4 + q * 2;
                    for t in 0..T {
                        let x0 = _mm512_set1_ps(*xg[t].add(kk));
                        let x1 = _mm512_set1_ps(*xg[t].add(kk + 1));
                        a[t][0] = _mm512_fmadd_ps(x0, w0, a[t][0]);
                        a[t][1] = _mm512_fmadd_ps(x1, w1, a[t][1]);
                    }
                }
            }
        }
        let accp = acc.as_mut_ptr();
        for t in 0..T {
            store_add!(accp.add(t * NR), _mm512_add_ps(a[t][0], a[t][1]));
        }
    }
}
