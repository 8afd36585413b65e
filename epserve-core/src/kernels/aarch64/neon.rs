//! NEON micro-kernels, with SDOT (`dotprod`) and SMMLA (`i8mm`) variants of
//! the int8 tile.
//!
//! - bf16: 64 bytes per pair of `k`s = four 16-byte loads; a shift per load
//!   widens the `k` values of four channels to f32, a mask the `k + 1` values;
//!   each token's activation is broadcast and FMA'd. Up to [`BF16_MR`] tokens
//!   (24 accumulators of the 32 vector registers). On the prefill path the
//!   activations come packed (one stream, a token's `k`, `k + 1` in one
//!   8-byte load, FMLA by lane): [`bf16_pair_tile`].
//! - bf16 with bf16 activations (`bf16` feature): BFDOT straight on the
//!   packed pairs, no widening (tier `neon-bf16`); on the prefill path
//!   BFMMLA ([`bf16mm_tile_bfmmla`]): two k-pair rows of the panel, zipped,
//!   are its `B` operand (two channels × four `k`s) as packed, no repacking.
//! - int8 baseline: `smull` of each channel's eight weights with the eight
//!   activations, `addp` pairs into i16 (2·127² fits), `sadalp` into i32.
//! - int8 SDOT: one `sdot` per pair of channels and token.
//! - int8 SMMLA: one `smmla` per pair of channels and pair of tokens.
//!
//! SDOT, SMMLA, BFDOT and BFMMLA are issued with inline assembly (their intrinsics are not
//! stable Rust); the functions carrying them enable the matching target
//! feature, and callers check it once in [`crate::kernels::dispatch`].

// Explicit token/lane indices read better than iterator chains in kernels.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;
use std::arch::asm;

use crate::kernels::layout::{I8_GROUP_BYTES, KG, NR};
use crate::kernels::row_ptrs as ptrs;

/// Most tokens per bf16 tile.
pub const BF16_MR: usize = 6;
/// Most tokens per int8 tile (baseline and SDOT).
pub const I8_MR: usize = 2;
/// Most tokens per int8 tile with SMMLA (two pairs).
pub const I8MM_MR: usize = 4;
/// Most tokens per bf16 × bf16 BFMMLA tile (four pairs).
pub const BF16MM_MR: usize = 8;

/// bf16 tile, any `x.len()` in `1..=BF16_MR`.
///
/// # Safety
/// NEON is present on every aarch64 Linux CPU; `w.len()` is
/// `16 · bf16_padded_k(kc)`, every `x[t]` holds at least `kc` values and `acc`
/// at least `16 · x.len()`.
pub unsafe fn bf16_tile(w: &[u16], kc: usize, x: &[&[f32]], acc: &mut [f32]) {
    let p = ptrs::<f32, BF16_MR>(x);
    let (w, acc) = (w.as_ptr(), acc.as_mut_ptr());
    // SAFETY: the caller guarantees the lengths above.
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

/// FMAs `xb` times the four widened weight vectors `wv` into `a`.
macro_rules! fma4 {
    ($a:expr, $xb:expr, $wv:expr) => {
        for q in 0..4 {
            $a[q] = vfmaq_f32($a[q], $xb, $wv[q]);
        }
    };
}

#[target_feature(enable = "neon")]
unsafe fn bf16_t<const T: usize>(
    w: *const u16,
    kc: usize,
    x: &[*const f32; BF16_MR],
    acc: *mut f32,
) {
    let mask = vdupq_n_u32(0xFFFF_0000);
    let mut a = [[vdupq_n_f32(0.0); 4]; T];
    // SAFETY: pair `i` reads words `32i..32i+32` of `w` (inside its
    // `16 · bf16_padded_k(kc)`) and values `2i` and, when `2i + 1 < kc`,
    // `2i + 1` of each row.
    unsafe {
        for i in 0..kc.div_ceil(2) {
            let p = w.add(i * 2 * NR);
            // Word q of the pair: channels 4q..4q+4 at k (low) and k+1 (high).
            let r = [
                vreinterpretq_u32_u16(vld1q_u16(p)),
                vreinterpretq_u32_u16(vld1q_u16(p.add(8))),
                vreinterpretq_u32_u16(vld1q_u16(p.add(16))),
                vreinterpretq_u32_u16(vld1q_u16(p.add(24))),
            ];
            let w0 = [
                vreinterpretq_f32_u32(vshlq_n_u32::<16>(r[0])),
                vreinterpretq_f32_u32(vshlq_n_u32::<16>(r[1])),
                vreinterpretq_f32_u32(vshlq_n_u32::<16>(r[2])),
                vreinterpretq_f32_u32(vshlq_n_u32::<16>(r[3])),
            ];
            for t in 0..T {
                let xb = vld1q_dup_f32(x[t].add(2 * i));
                fma4!(a[t], xb, w0);
            }
            if 2 * i + 1 < kc {
                let w1 = [
                    vreinterpretq_f32_u32(vandq_u32(r[0], mask)),
                    vreinterpretq_f32_u32(vandq_u32(r[1], mask)),
                    vreinterpretq_f32_u32(vandq_u32(r[2], mask)),
                    vreinterpretq_f32_u32(vandq_u32(r[3], mask)),
                ];
                for t in 0..T {
                    let xb = vld1q_dup_f32(x[t].add(2 * i + 1));
                    fma4!(a[t], xb, w1);
                }
            }
        }
        for t in 0..T {
            for q in 0..4 {
                let d = acc.add(t * NR + 4 * q);
                vst1q_f32(d, vaddq_f32(vld1q_f32(d), a[t][q]));
            }
        }
    }
}

/// bf16 tile over two panels with f32 activations packed by
/// [`crate::kernels::layout::pack_pairs_f32`] (the prefill path), any `t` in
/// `1..=BF16_MR`. Each panel runs in turn over the one packed stream: a token's
/// `k`, `k + 1` pair is one 8-byte load feeding FMLA by lane, instead of two
/// broadcast loads from rows that, a power-of-two stride apart, would share
/// one set of the 4-way L1.
///
/// # Safety
/// NEON is present on every aarch64 Linux CPU; `w[0]` and `w[1]` are each
/// `16 · bf16_padded_k(kc)` words, `xp` holds `bf16_padded_k(kc) · t` values
/// and `acc[0]`, `acc[1]` at least `16 · t`.
pub unsafe fn bf16_pair_tile(
    w: [&[u16]; 2],
    kc: usize,
    t: usize,
    xp: &[f32],
    acc: [&mut [f32]; 2],
) {
    let xp = xp.as_ptr();
    for (wj, aj) in w.into_iter().zip(acc) {
        let (wj, aj) = (wj.as_ptr(), aj.as_mut_ptr());
        // SAFETY: the caller guarantees the lengths above.
        unsafe {
            match t {
                1 => bf16_packed_t::<1>(wj, kc, xp, aj),
                2 => bf16_packed_t::<2>(wj, kc, xp, aj),
                3 => bf16_packed_t::<3>(wj, kc, xp, aj),
                4 => bf16_packed_t::<4>(wj, kc, xp, aj),
                5 => bf16_packed_t::<5>(wj, kc, xp, aj),
                6 => bf16_packed_t::<6>(wj, kc, xp, aj),
                _ => {}
            }
        }
    }
}

#[target_feature(enable = "neon")]
unsafe fn bf16_packed_t<const T: usize>(w: *const u16, kc: usize, xp: *const f32, acc: *mut f32) {
    let mask = vdupq_n_u32(0xFFFF_0000);
    let mut a = [[vdupq_n_f32(0.0); 4]; T];
    // SAFETY: pair `i` reads words `32i..32i+32` of `w` (inside its
    // `16 · bf16_padded_k(kc)`) and values `2·T·i .. 2·T·(i+1)` of `xp`.
    unsafe {
        for i in 0..kc.div_ceil(2) {
            let p = w.add(i * 2 * NR);
            let x = xp.add(i * 2 * T);
            let xs: [float32x2_t; T] = std::array::from_fn(|t| vld1_f32(x.add(2 * t)));
            let both = 2 * i + 1 < kc;
            // Word q: channels 4q..4q+4 at k (low halves) and k+1 (high).
            for q in 0..4 {
                let r = vreinterpretq_u32_u16(vld1q_u16(p.add(8 * q)));
                let w0 = vreinterpretq_f32_u32(vshlq_n_u32::<16>(r));
                for t in 0..T {
                    a[t][q] = vfmaq_lane_f32::<0>(a[t][q], w0, xs[t]);
                }
                if both {
                    let w1 = vreinterpretq_f32_u32(vandq_u32(r, mask));
                    for t in 0..T {
                        a[t][q] = vfmaq_lane_f32::<1>(a[t][q], w1, xs[t]);
                    }
                }
            }
        }
        for t in 0..T {
            for q in 0..4 {
                let d = acc.add(t * NR + 4 * q);
                vst1q_f32(d, vaddq_f32(vld1q_f32(d), a[t][q]));
            }
        }
    }
}

/// bf16 tile with **bf16** activations through BFDOT, any `x.len()` in
/// `1..=BF16_MR`: per pair of `k`s, four 16-byte weight loads (four channels
/// × two `k`s each) and, per token, one `bfdot` per load against the token's
/// activation pair duplicated into every lane.
///
/// # Safety
/// The CPU must support `bf16`; `w.len()` is a multiple of 32, every `x[t]`
/// holds at least `w.len() / 16` values and `acc` at least `16 · x.len()`.
pub unsafe fn bf16x_tile_bfdot(w: &[u16], x: &[&[u16]], acc: &mut [f32]) {
    let pairs = w.len() / (2 * NR);
    let p = ptrs::<u16, BF16_MR>(x);
    let (w, acc) = (w.as_ptr(), acc.as_mut_ptr());
    // SAFETY: the caller guarantees the features and the lengths above.
    unsafe {
        match x.len() {
            1 => bf16x_t::<1>(w, pairs, &p, acc),
            2 => bf16x_t::<2>(w, pairs, &p, acc),
            3 => bf16x_t::<3>(w, pairs, &p, acc),
            4 => bf16x_t::<4>(w, pairs, &p, acc),
            5 => bf16x_t::<5>(w, pairs, &p, acc),
            6 => bf16x_t::<6>(w, pairs, &p, acc),
            _ => {}
        }
    }
}

#[target_feature(enable = "neon,bf16")]
unsafe fn bf16x_t<const T: usize>(
    w: *const u16,
    pairs: usize,
    x: &[*const u16; BF16_MR],
    acc: *mut f32,
) {
    let mut a = [[vdupq_n_f32(0.0); 4]; T];
    // SAFETY: pair `i < pairs` reads words `32i..32i+32` of `w` and values
    // `2i, 2i+1` of each row (unaligned reads); `bfdot` only touches the
    // named registers.
    unsafe {
        for i in 0..pairs {
            let p = w.add(i * 2 * NR);
            let wv = [
                vld1q_u16(p),
                vld1q_u16(p.add(8)),
                vld1q_u16(p.add(16)),
                vld1q_u16(p.add(24)),
            ];
            for t in 0..T {
                let pair = std::ptr::read_unaligned(x[t].add(2 * i) as *const u32);
                let xv = vreinterpretq_u16_u32(vdupq_n_u32(pair));
                for q in 0..4 {
                    asm!(
                        "bfdot {acc:v}.4s, {w:v}.8h, {x:v}.8h",
                        acc = inout(vreg) a[t][q],
                        w = in(vreg) wv[q],
                        x = in(vreg) xv,
                        options(pure, nomem, nostack),
                    );
                }
            }
        }
        for t in 0..T {
            for q in 0..4 {
                let d = acc.add(t * NR + 4 * q);
                vst1q_f32(d, vaddq_f32(vld1q_f32(d), a[t][q]));
            }
        }
    }
}

/// bf16 tile with **bf16** activations through BFMMLA (the prefill path),
/// any `t` in `1..=BF16MM_MR`, over activations packed by
/// [`crate::kernels::layout::pack_mm_bf16`].
///
/// BFMMLA multiplies a 2×4 bf16 `A` (two rows × four `k`s: one 16-byte load
/// of the packed stream) by a 4×2 bf16 `B` held as two channels × four `k`s
/// into a 2×2 f32 block. In the panel, pair `k/2`'s row holds channel `c`'s
/// `k`, `k + 1` in 32-bit word `c`; zipping the 32-bit words of the rows of
/// pairs `q` and `q + 1` (`zip1`: channels `c`, `c + 1`; `zip2`: `c + 2`,
/// `c + 3`) gives exactly that `B` for a k-quad. The panel runs as two halves
/// of eight channels (16 accumulators: four row pairs × four channel pairs),
/// each over the whole chunk; an odd last pair zips with zeros.
///
/// # Safety
/// The CPU must support `bf16`; `w.len()` is a multiple of 32, `xa` holds at
/// least `mm_padded_k(w.len() / 16) · 2⌈t/2⌉` values and `acc` at least
/// `16 · t`.
pub unsafe fn bf16mm_tile_bfmmla(w: &[u16], t: usize, xa: &[u16], acc: &mut [f32]) {
    let pairs = w.len() / (2 * NR);
    let (w, xa, acc) = (w.as_ptr(), xa.as_ptr(), acc.as_mut_ptr());
    // SAFETY: the caller guarantees the features and the lengths above.
    unsafe {
        match t {
            1 | 2 => bf16mm_t::<1>(w, pairs, xa, t, acc),
            3 | 4 => bf16mm_t::<2>(w, pairs, xa, t, acc),
            5 | 6 => bf16mm_t::<3>(w, pairs, xa, t, acc),
            7 | 8 => bf16mm_t::<4>(w, pairs, xa, t, acc),
            _ => {}
        }
    }
}

/// One k-quad of [`bf16mm_t`]: the four `B` operands of a channel half from
/// the pair rows `lo` (pair `q`) and `hi` (pair `q + 1`), times the `P`
/// packed `A` operands at `x`, into `a`.
macro_rules! mm_quad {
    ($a:ident, $lo:expr, $hi:expr, $x:expr) => {{
        let (lo, hi): ([uint32x4_t; 2], [uint32x4_t; 2]) = ($lo, $hi);
        let b = [
            vreinterpretq_u16_u32(vzip1q_u32(lo[0], hi[0])),
            vreinterpretq_u16_u32(vzip2q_u32(lo[0], hi[0])),
            vreinterpretq_u16_u32(vzip1q_u32(lo[1], hi[1])),
            vreinterpretq_u16_u32(vzip2q_u32(lo[1], hi[1])),
        ];
        for p in 0..P {
            let av = vld1q_u16($x.add(8 * p));
            for m in 0..4 {
                asm!(
                    "bfmmla {acc:v}.4s, {a:v}.8h, {b:v}.8h",
                    acc = inout(vreg) $a[p][m],
                    a = in(vreg) av,
                    b = in(vreg) b[m],
                    options(pure, nomem, nostack),
                );
            }
        }
    }};
}

/// `P` row pairs; `t` real rows (the missing row of an odd last pair is zero
/// in the packed stream and is not stored).
#[target_feature(enable = "neon,bf16")]
unsafe fn bf16mm_t<const P: usize>(
    w: *const u16,
    pairs: usize,
    xa: *const u16,
    t: usize,
    acc: *mut f32,
) {
    // Eight words (four channels × one k-pair) as four 32-bit lanes.
    macro_rules! ld {
        ($p:expr) => {
            vreinterpretq_u32_u16(vld1q_u16($p))
        };
    }
    // SAFETY: quad `j` reads pair rows `2j` and (when `2j + 1 < pairs`)
    // `2j + 1` of `w`, words `16h..16h + 16` of each, and the `8P` values
    // `8Pj..8P(j + 1)` of `xa` (inside `mm_padded_k(2 · pairs) · 2P`); stores
    // touch rows `< t` of `acc`. `bfmmla` only touches the named registers.
    unsafe {
        for h in 0..2 {
            let mut a = [[vdupq_n_f32(0.0); 4]; P];
            // Channels 8h..8h + 8: words 16h..16h + 16 of every pair row.
            let wh = w.add(16 * h);
            for j in 0..pairs / 2 {
                let p = wh.add(j * 4 * NR);
                let q = p.add(2 * NR);
                let x = xa.add(j * 8 * P);
                mm_quad!(a, [ld!(p), ld!(p.add(8))], [ld!(q), ld!(q.add(8))], x);
            }
            if pairs % 2 == 1 {
                let j = pairs / 2;
                let p = wh.add(j * 4 * NR);
                let zero = vdupq_n_u32(0);
                let x = xa.add(j * 8 * P);
                mm_quad!(a, [ld!(p), ld!(p.add(8))], [zero, zero], x);
            }
            // a[p][m] lanes: [r0·c, r0·c+1, r1·c, r1·c+1] for rows 2p, 2p+1
            // and channels c = 8h + 2m: 64-bit zips give each row's four
            // consecutive channels.
            for p in 0..P {
                let r0 = acc.add(2 * p * NR + 8 * h);
                for m2 in 0..2 {
                    let x0 = vreinterpretq_u64_f32(a[p][2 * m2]);
                    let x1 = vreinterpretq_u64_f32(a[p][2 * m2 + 1]);
                    let d = r0.add(4 * m2);
                    let v = vreinterpretq_f32_u64(vzip1q_u64(x0, x1));
                    vst1q_f32(d, vaddq_f32(vld1q_f32(d), v));
                    if 2 * p + 1 < t {
                        let d = d.add(NR);
                        let v = vreinterpretq_f32_u64(vzip2q_u64(x0, x1));
                        vst1q_f32(d, vaddq_f32(vld1q_f32(d), v));
                    }
                }
            }
        }
    }
}

/// Runs `iters` rounds of 24 independent BFDOTs (four lanes × two
/// multiply-adds each) and returns a value that depends on all of them; the
/// FLOPs are `iters · 24 · 4 · 4`. Used by `epserve bench moe` for the bf16
/// dot-product peak.
///
/// # Safety
/// The CPU must support `bf16`.
#[target_feature(enable = "neon,bf16")]
pub unsafe fn bfdot_probe(iters: usize, seed: f32) -> f32 {
    let one = vreinterpretq_u16_u32(vdupq_n_u32(0x3F80_3F80));
    let mut c = [vdupq_n_f32(seed); 24];
    for _ in 0..iters {
        for v in c.iter_mut() {
            // SAFETY: register-only instruction.
            unsafe {
                asm!(
                    "bfdot {acc:v}.4s, {w:v}.8h, {x:v}.8h",
                    acc = inout(vreg) *v,
                    w = in(vreg) one,
                    x = in(vreg) one,
                    options(pure, nomem, nostack),
                );
            }
        }
    }
    let mut s = vdupq_n_f32(0.0);
    for v in c {
        s = vaddq_f32(s, v);
    }
    vaddvq_f32(s)
}

/// Runs `iters` rounds of 24 independent BFMMLAs (a 2×2 block × four `k`s:
/// 16 multiply-adds each) and returns a value that depends on all of them;
/// the FLOPs are `iters · 24 · 32`. `epserve bench moe` takes it as the
/// `neon-bf16` tier's bf16 peak (what its prefill tile issues).
///
/// # Safety
/// The CPU must support `bf16`.
#[target_feature(enable = "neon,bf16")]
pub unsafe fn bfmmla_probe(iters: usize, seed: f32) -> f32 {
    let one = vreinterpretq_u16_u32(vdupq_n_u32(0x3F80_3F80));
    let mut c = [vdupq_n_f32(seed); 24];
    for _ in 0..iters {
        for v in c.iter_mut() {
            // SAFETY: register-only instruction.
            unsafe {
                asm!(
                    "bfmmla {acc:v}.4s, {a:v}.8h, {b:v}.8h",
                    acc = inout(vreg) *v,
                    a = in(vreg) one,
                    b = in(vreg) one,
                    options(pure, nomem, nostack),
                );
            }
        }
    }
    let mut s = vdupq_n_f32(0.0);
    for v in c {
        s = vaddq_f32(s, v);
    }
    vaddvq_f32(s)
}

/// Adds accumulator lanes `[c, c, c+1, c+1]` of eight channel pairs to `acc`.
///
/// # Safety
/// `acc` must hold 16 writable i32.
#[inline(always)]
unsafe fn reduce_pairs(c: &[int32x4_t; 8], acc: *mut i32) {
    let mut l = [0i32; 4];
    for (i, v) in c.iter().enumerate() {
        // SAFETY: `l` holds four i32; `acc` holds 16 (caller).
        unsafe {
            vst1q_s32(l.as_mut_ptr(), *v);
            *acc.add(2 * i) += l[0] + l[1];
            *acc.add(2 * i + 1) += l[2] + l[3];
        }
    }
}

/// int8 tile with plain NEON, any `x.len()` in `1..=I8_MR`.
///
/// # Safety
/// `w.len()` is a multiple of 128, every `x[t]` holds at least
/// `8 · w.len() / 128` values, all values in `[-127, 127]`, `acc` at least
/// `16 · x.len()`.
pub unsafe fn i8_tile(w: &[i8], x: &[&[i8]], acc: &mut [i32]) {
    let groups = w.len() / I8_GROUP_BYTES;
    let p = ptrs::<i8, I8_MR>(x);
    let (w, acc) = (w.as_ptr(), acc.as_mut_ptr());
    // SAFETY: the caller guarantees the lengths above.
    unsafe {
        match x.len() {
            1 => i8_t::<1>(w, groups, &p, acc),
            2 => i8_t::<2>(w, groups, &p, acc),
            _ => {}
        }
    }
}

#[target_feature(enable = "neon")]
unsafe fn i8_t<const T: usize>(w: *const i8, groups: usize, x: &[*const i8; I8_MR], acc: *mut i32) {
    let mut c = [[vdupq_n_s32(0); 8]; T];
    // SAFETY: `g < groups` keeps reads inside `w` and every activation row.
    unsafe {
        for g in 0..groups {
            let wp = w.add(g * I8_GROUP_BYTES);
            for t in 0..T {
                let a = vld1_s8(x[t].add(g * KG));
                for (i, ci) in c[t].iter_mut().enumerate() {
                    let wv = vld1q_s8(wp.add(16 * i));
                    let lo = vmull_s8(vget_low_s8(wv), a);
                    let hi = vmull_s8(vget_high_s8(wv), a);
                    *ci = vpadalq_s16(*ci, vpaddq_s16(lo, hi));
                }
            }
        }
        for t in 0..T {
            reduce_pairs(&c[t], acc.add(t * NR));
        }
    }
}

/// int8 tile with SDOT, any `x.len()` in `1..=I8_MR`.
///
/// # Safety
/// As [`i8_tile`], and the CPU must support `dotprod`.
pub unsafe fn i8_tile_dot(w: &[i8], x: &[&[i8]], acc: &mut [i32]) {
    let groups = w.len() / I8_GROUP_BYTES;
    let p = ptrs::<i8, I8_MR>(x);
    let (w, acc) = (w.as_ptr(), acc.as_mut_ptr());
    // SAFETY: the caller guarantees the features and lengths above.
    unsafe {
        match x.len() {
            1 => i8_dot_t::<1>(w, groups, &p, acc),
            2 => i8_dot_t::<2>(w, groups, &p, acc),
            _ => {}
        }
    }
}

#[target_feature(enable = "neon,dotprod")]
unsafe fn i8_dot_t<const T: usize>(
    w: *const i8,
    groups: usize,
    x: &[*const i8; I8_MR],
    acc: *mut i32,
) {
    let mut c = [[vdupq_n_s32(0); 8]; T];
    // SAFETY: `g < groups` keeps reads inside `w` and every activation row;
    // `sdot` only touches the named registers.
    unsafe {
        for g in 0..groups {
            let wp = w.add(g * I8_GROUP_BYTES);
            let mut wv = [vdupq_n_s8(0); 8];
            for (i, v) in wv.iter_mut().enumerate() {
                *v = vld1q_s8(wp.add(16 * i));
            }
            for t in 0..T {
                let a8 = vld1_s8(x[t].add(g * KG));
                let a = vcombine_s8(a8, a8);
                for i in 0..8 {
                    asm!(
                        "sdot {acc:v}.4s, {w:v}.16b, {a:v}.16b",
                        acc = inout(vreg) c[t][i],
                        w = in(vreg) wv[i],
                        a = in(vreg) a,
                        options(pure, nomem, nostack),
                    );
                }
            }
        }
        for t in 0..T {
            reduce_pairs(&c[t], acc.add(t * NR));
        }
    }
}

/// int8 tile with SMMLA, any `x.len()` in `1..=I8MM_MR`.
///
/// # Safety
/// As [`i8_tile`], and the CPU must support `i8mm`.
pub unsafe fn i8_tile_mmla(w: &[i8], x: &[&[i8]], acc: &mut [i32]) {
    let groups = w.len() / I8_GROUP_BYTES;
    let p = ptrs::<i8, I8MM_MR>(x);
    let (w, acc) = (w.as_ptr(), acc.as_mut_ptr());
    // SAFETY: the caller guarantees the features and lengths above.
    unsafe {
        match x.len() {
            1 | 2 => i8_mmla_t::<1>(w, groups, &p, x.len(), acc),
            3 | 4 => i8_mmla_t::<2>(w, groups, &p, x.len(), acc),
            _ => {}
        }
    }
}

/// `P` token pairs; `n` real tokens (the missing half of the last pair
/// multiplies zeros and is not stored).
#[target_feature(enable = "neon,i8mm")]
unsafe fn i8_mmla_t<const P: usize>(
    w: *const i8,
    groups: usize,
    x: &[*const i8; I8MM_MR],
    n: usize,
    acc: *mut i32,
) {
    let mut c = [[vdupq_n_s32(0); 8]; P];
    // SAFETY: `g < groups` keeps reads inside `w` and the `n` real activation
    // rows; rows at or past `n` are never read. `smmla` only touches the
    // named registers.
    unsafe {
        for g in 0..groups {
            let wp = w.add(g * I8_GROUP_BYTES);
            let mut wv = [vdupq_n_s8(0); 8];
            for (i, v) in wv.iter_mut().enumerate() {
                *v = vld1q_s8(wp.add(16 * i));
            }
            for p in 0..P {
                let t0 = vld1_s8(x[2 * p].add(g * KG));
                let t1 = if 2 * p + 1 < n {
                    vld1_s8(x[2 * p + 1].add(g * KG))
                } else {
                    vdup_n_s8(0)
                };
                let a = vcombine_s8(t0, t1);
                for i in 0..8 {
                    asm!(
                        "smmla {acc:v}.4s, {a:v}.16b, {w:v}.16b",
                        acc = inout(vreg) c[p][i],
                        a = in(vreg) a,
                        w = in(vreg) wv[i],
                        options(pure, nomem, nostack),
                    );
                }
            }
        }
        // Lanes of c[p][i]: [t0·c2i, t0·c2i+1, t1·c2i, t1·c2i+1].
        let mut l = [0i32; 4];
        for p in 0..P {
            for i in 0..8 {
                vst1q_s32(l.as_mut_ptr(), c[p][i]);
                let r0 = acc.add(2 * p * NR);
                *r0.add(2 * i) += l[0];
                *r0.add(2 * i + 1) += l[1];
                if 2 * p + 1 < n {
                    let r1 = acc.add((2 * p + 1) * NR);
                    *r1.add(2 * i) += l[2];
                    *r1.add(2 * i + 1) += l[3];
                }
            }
        }
    }
}

/// Runs `iters` rounds of 24 independent 4-wide FMAs and returns a value that
/// depends on all of them; the FLOPs are `iters · 24 · 4 · 2`. Used by
/// `epserve bench moe` to measure FMA peak.
///
/// # Safety
/// NEON is present on every aarch64 Linux CPU.
#[target_feature(enable = "neon")]
pub unsafe fn fma_probe(iters: usize, seed: f32) -> f32 {
    let m = vdupq_n_f32(0.999_999);
    let a = vdupq_n_f32(1e-7);
    let mut c = [vdupq_n_f32(seed); 24];
    for _ in 0..iters {
        for v in c.iter_mut() {
            *v = vfmaq_f32(a, *v, m);
        }
    }
    let mut s = vdupq_n_f32(0.0);
    for v in c {
        s = vaddq_f32(s, v);
    }
    vaddvq_f32(s)
}

/// [`crate::kernels::layout::transpose_pairs`] as sixteen 4 × 4
/// transposes of 32-bit words (`trn1`/`trn2` on words, then on
/// doublewords).
///
/// # Safety
/// NEON must be available; every `rows[c]` holds at least 32 values and
/// `dst` at least 256 words.
#[target_feature(enable = "neon")]
pub unsafe fn transpose_pairs(rows: &[&[u16]; NR], dst: &mut [u32]) {
    debug_assert!(rows.iter().all(|r| r.len() >= 2 * NR) && dst.len() >= NR * NR);
    // SAFETY: the caller guarantees the features and the extents.
    unsafe {
        let d = dst.as_mut_ptr();
        for c0 in (0..NR).step_by(4) {
            let src: [*const u32; 4] = std::array::from_fn(|i| rows[c0 + i].as_ptr() as *const u32);
            for q0 in (0..NR).step_by(4) {
                let r: [uint32x4_t; 4] = std::array::from_fn(|i| vld1q_u32(src[i].add(q0)));
                let (t0, t1) = (vtrn1q_u32(r[0], r[1]), vtrn2q_u32(r[0], r[1]));
                let (t2, t3) = (vtrn1q_u32(r[2], r[3]), vtrn2q_u32(r[2], r[3]));
                let (t0, t1, t2, t3) = (
                    vreinterpretq_u64_u32(t0),
                    vreinterpretq_u64_u32(t1),
                    vreinterpretq_u64_u32(t2),
                    vreinterpretq_u64_u32(t3),
                );
                let out = [
                    vtrn1q_u64(t0, t2),
                    vtrn1q_u64(t1, t3),
                    vtrn2q_u64(t0, t2),
                    vtrn2q_u64(t1, t3),
                ];
                for (j, o) in out.into_iter().enumerate() {
                    vst1q_u32(d.add((q0 + j) * NR + c0), vreinterpretq_u32_u64(o));
                }
            }
        }
    }
}

// ------------------------------------------------------------------ B12

/// Most tokens per B12 decode tile: two accumulators (even and odd `k`) per
/// four channels and token, 16 for two tokens, and the decode needs
/// registers too.
pub const B12_MR: usize = 2;

/// Bytes ahead of the current group that the B12 tile and decoder hint into
/// L1 (as the x86 ones).
const B12_PREFETCH: usize = 3072;

/// Hints the three cache lines of the group [`B12_PREFETCH`] bytes past `gp`
/// into L1 (`prfm`: a hint, it never faults).
#[inline(always)]
fn b12_prefetch(gp: *const u8) {
    for l in 0..3 {
        let a = gp.wrapping_add(B12_PREFETCH + 64 * l);
        // SAFETY: PRFM is a hint: it never faults, reads nothing and writes
        // nothing architecturally visible.
        unsafe {
            asm!("prfm pldl1keep, [{0}]", in(reg) a, options(nostack, readonly, preserves_flags));
        }
    }
}

/// Rebuilds half `half` (pairs `2·half`, `2·half + 1`) of the B12 group `g`
/// at `gp` (see [`crate::kernels::b12`]): `[l][q]` holds words
/// `8l..8l + 8` (channels `4l..4l + 4`, `k` then `k + 1`) of the half's pair
/// `q` as the bf16 panel stores them, the panel's escapes or-ed in from its
/// exception list (`ei`, `next`: the next escape's index and stream
/// position). Per 16 bytes: the codes' nibble, two `tbl` lookups of the
/// exponent bits, the sign|mantissa bits masked in, and `zip1` / `zip2`
/// of the low and high bytes (the half's two pairs).
///
/// # Safety
/// `gp` holds a whole group of `panel`; `*next` is the stream position of
/// escape `*ei` (or `usize::MAX`), at or past group `g`'s half `half`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn b12_half(
    panel: &crate::kernels::b12::B12Panel<'_>,
    gp: *const u8,
    g: usize,
    half: usize,
    th: uint8x16_t,
    tl: uint8x16_t,
    ei: &mut usize,
    next: &mut usize,
) -> [[uint16x8_t; 2]; 4] {
    // SAFETY: the caller guarantees the group's 192 bytes at `gp`.
    unsafe {
        let (m0f, m80, m7f) = (vdupq_n_u8(0x0f), vdupq_n_u8(0x80), vdupq_n_u8(0x7f));
        let mut hb = [vdupq_n_u8(0); 4];
        let mut lb = [vdupq_n_u8(0); 4];
        for l in 0..4 {
            let cz = vld1q_u8(gp.add(128 + 16 * l));
            let ch = if half == 0 {
                vandq_u8(cz, m0f)
            } else {
                vshrq_n_u8::<4>(cz)
            };
            let sm = vld1q_u8(gp.add(half * 64 + 16 * l));
            // high byte (s & 0x80) | e >> 1, low byte (s & 0x7f) | (e & 1) << 7
            hb[l] = vorrq_u8(vandq_u8(sm, m80), vqtbl1q_u8(th, ch));
            lb[l] = vorrq_u8(vandq_u8(sm, m7f), vqtbl1q_u8(tl, ch));
        }
        let end = g * 128 + half * 64 + 64;
        if *next < end {
            let (mut hh, mut ll) = ([0u8; 64], [0u8; 64]);
            for l in 0..4 {
                vst1q_u8(hh.as_mut_ptr().add(16 * l), hb[l]);
                vst1q_u8(ll.as_mut_ptr().add(16 * l), lb[l]);
            }
            crate::kernels::b12::b12_patch(panel, end, &mut hh, &mut ll, ei, next);
            for l in 0..4 {
                hb[l] = vld1q_u8(hh.as_ptr().add(16 * l));
                lb[l] = vld1q_u8(ll.as_ptr().add(16 * l));
            }
        }
        // Per 16 bytes, the low 8 belong to the first pair, the high 8 to
        // the second; interleaving low and high bytes gives little-endian
        // words.
        std::array::from_fn(|l| {
            [
                vreinterpretq_u16_u8(vzip1q_u8(lb[l], hb[l])),
                vreinterpretq_u16_u8(vzip2q_u8(lb[l], hb[l])),
            ]
        })
    }
}

/// The B12 decode tile: `acc[t·16 + c] += Σ_k x[t][k] · W[c, k]` over a
/// whole panel for `x.len()` in `1..=B12_MR` tokens, bit for bit as the twin
/// `b12::b12_tile` (even and odd `k` in two FMA chains per channel).
///
/// # Safety
/// NEON is present on every aarch64 Linux CPU; every `x[t]` holds at least
/// `panel.k` values and `acc` at least `16 · x.len()`.
pub unsafe fn b12_tile(panel: &crate::kernels::b12::B12Panel<'_>, x: &[&[f32]], acc: &mut [f32]) {
    // SAFETY: the caller guarantees the lengths above.
    unsafe {
        match x.len() {
            1 => b12_t::<1>(panel, x, acc),
            2 => b12_t::<2>(panel, x, acc),
            _ => {}
        }
    }
}

#[target_feature(enable = "neon")]
unsafe fn b12_t<const T: usize>(
    panel: &crate::kernels::b12::B12Panel<'_>,
    x: &[&[f32]],
    acc: &mut [f32],
) {
    use crate::kernels::b12::{B12_GROUP_BYTES, B12_GROUP_K};
    let k = panel.k;
    let full = k / B12_GROUP_K;
    let mask = vdupq_n_u32(0xFFFF_0000);
    // SAFETY: `tables` is 32 bytes; `data` holds `groups` groups; the
    // caller guarantees `k` values per row of `x` and `16 · T` of `acc`.
    unsafe {
        let th = vld1q_u8(panel.tables.as_ptr());
        let tl = vld1q_u8(panel.tables.as_ptr().add(16));
        // [token][channels 4l..4l + 4][even k | odd k]
        let mut a = [[[vdupq_n_f32(0.0); 2]; 4]; T];
        let mut ei = 0usize;
        let mut next = panel.exc_pos.first().map_or(usize::MAX, |&p| p as usize);
        let tail = crate::kernels::b12::b12_tail::<T>(x, k);
        let d = panel.data.as_ptr();
        for g in 0..panel.groups() {
            let gp = d.add(g * B12_GROUP_BYTES);
            b12_prefetch(gp);
            let xg: [*const f32; T] = std::array::from_fn(|t| {
                if g < full {
                    x[t].as_ptr().add(g * B12_GROUP_K)
                } else {
                    tail[t].as_ptr()
                }
            });
            for half in 0..2 {
                let raws = b12_half(panel, gp, g, half, th, tl, &mut ei, &mut next);
                for q in 0..2 {
                    // This pair's first k in the group: 4·half + 2q.
                    let kk = half * 4 + q * 2;
                    let xb: [[float32x4_t; 2]; T] = std::array::from_fn(|t| {
                        [
                            vld1q_dup_f32(xg[t].add(kk)),
                            vld1q_dup_f32(xg[t].add(kk + 1)),
                        ]
                    });
                    for l in 0..4 {
                        let raw = vreinterpretq_u32_u16(raws[l][q]);
                        let w0 = vreinterpretq_f32_u32(vshlq_n_u32::<16>(raw));
                        let w1 = vreinterpretq_f32_u32(vandq_u32(raw, mask));
                        for t in 0..T {
                            a[t][l][0] = vfmaq_f32(a[t][l][0], xb[t][0], w0);
                            a[t][l][1] = vfmaq_f32(a[t][l][1], xb[t][1], w1);
                        }
                    }
                }
            }
        }
        let accp = acc.as_mut_ptr();
        for t in 0..T {
            for l in 0..4 {
                let dst = accp.add(t * NR + 4 * l);
                vst1q_f32(
                    dst,
                    vaddq_f32(vld1q_f32(dst), vaddq_f32(a[t][l][0], a[t][l][1])),
                );
            }
        }
    }
}

/// A B12 panel's words back as the bf16 panel (`dst`: as many words as it
/// holds, at most `b12_padded_k(k) · 16`), as the twin `b12::b12_decode`.
///
/// # Safety
/// NEON is present on every aarch64 Linux CPU.
#[target_feature(enable = "neon")]
pub unsafe fn b12_decode(panel: &crate::kernels::b12::B12Panel<'_>, dst: &mut [u16]) {
    use crate::kernels::b12::{B12_GROUP_BYTES, B12_GROUP_PAIRS};
    // SAFETY: `tables` is 32 bytes; `data` holds `groups` groups; every
    // store is to 8 whole words inside `dst`, a partial run is copied.
    unsafe {
        let th = vld1q_u8(panel.tables.as_ptr());
        let tl = vld1q_u8(panel.tables.as_ptr().add(16));
        let mut ei = 0usize;
        let mut next = panel.exc_pos.first().map_or(usize::MAX, |&p| p as usize);
        let d = panel.data.as_ptr();
        let out = dst.as_mut_ptr();
        for g in 0..panel.groups() {
            if g * B12_GROUP_PAIRS * 2 * NR >= dst.len() {
                break;
            }
            let gp = d.add(g * B12_GROUP_BYTES);
            b12_prefetch(gp);
            for half in 0..2 {
                let raws = b12_half(panel, gp, g, half, th, tl, &mut ei, &mut next);
                for q in 0..2 {
                    let pair = g * B12_GROUP_PAIRS + half * 2 + q;
                    for l in 0..4 {
                        let at = pair * 2 * NR + 8 * l;
                        if at + 8 <= dst.len() {
                            vst1q_u16(out.add(at), raws[l][q]);
                        } else if at < dst.len() {
                            let mut w = [0u16; 8];
                            vst1q_u16(w.as_mut_ptr(), raws[l][q]);
                            std::ptr::copy_nonoverlapping(w.as_ptr(), out.add(at), dst.len() - at);
                        }
                    }
                }
            }
        }
    }
}
