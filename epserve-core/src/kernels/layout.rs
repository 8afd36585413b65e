//! The packed weight layouts the MoE micro-kernels stream, shared by every
//! tier (generic, x86, aarch64) so one packed copy serves whichever tier the
//! CPU picks at run time.
//!
//! A packed matrix computes `y[c] = Σ_k x[k] · W[c, k]` for output channels
//! `c`. Channels are grouped in *panels* of [`NR`] = 16; each panel is stored
//! contiguously, panel after panel, so a sweep over consecutive panels is one
//! sequential stream of memory (what the decode path wants).
//!
//! - **BF16 panel**: `K` is padded to an even count with zeros; for each
//!   *pair* of `k`s, the 16 channels' two words in channel order: word
//!   `2c + (k & 1)` of the pair's 32 (64 bytes). Seen as 32-bit words, word
//!   `c` holds channel `c` at `k` (low half) and `k + 1` (high half): a shift
//!   left by 16 widens the `k` values to f32 and a mask the `k + 1` values, one
//!   ALU op per vector of widened weights on AVX2, AVX-512 and NEON alike; and
//!   the pair is exactly the operand of the bf16 dot instructions (x86
//!   `vdpbf16ps`, Arm `bfdot`), which multiply two adjacent bf16 of each lane
//!   by a broadcast pair of activations. 16 pairs (32 `k`s) of a panel are also
//!   an AMX-BF16 `B` tile (16 rows of 64 bytes).
//! - **INT8 panel**: `K` is padded to a multiple of [`KG`] = 8 with zeros; each
//!   group of 8 `k`s is 128 bytes, each channel has an f32 scale (symmetric, per
//!   output channel), weights in `[-127, 127]`. The byte order inside a group is
//!   the one the architecture's int8 dot instructions read (see [`i8_index`];
//!   the packed form never leaves the process, so it may differ by build):
//!   - x86_64: two *`k`-quad rows* of 64 bytes (`k` 0..4, then 4..8), channel
//!     `c` at bytes `4c..4c+4` of each: one row is a zmm operand of
//!     `vpdpbusd` (16 channels × 4 bytes), two 32-byte halves feed AVX2's
//!     `vpmaddubsw`, and 16 consecutive rows (8 groups) are an AMX-INT8 `B`
//!     tile read in place.
//!   - aarch64 (and others): each channel's 8 bytes in channel order: a
//!     16-byte pair of channels is exactly an SMMLA `B` operand.
//!
//! A fused gate/up matrix puts gate rows `j..j+8` in logical channels 0..8 of
//! a panel and the matching up rows in 8..16, so one panel yields
//! `act(gate) · up` for eight output columns without a second pass.
//!
//! Also here, so that the expert driver and the AMX planning
//! (`super::amx_plan`) share them without the kernels depending on the
//! experts: the borrowed view of a packed matrix (`DataView`), the
//! activation rows a phase reads (`Src`), and the accumulator-row helpers
//! (`as_row`, `dequant`).

use half::bf16;

/// Output channels per panel.
pub const NR: usize = 16;

/// AMX tiles (x86 prefill path): token rows per tile.
pub const AMX_TILE_M: usize = 16;
/// AMX tiles: bytes per tile row (one token's `k` span; one weight
/// `k`-pair or `k`-quad row of 16 channels).
pub const AMX_ROW_BYTES: usize = 64;
/// AMX tiles: bytes of a 16 × 64 tile.
pub const AMX_TILE_BYTES: usize = AMX_TILE_M * AMX_ROW_BYTES;
/// AMX tiles: `k`s per bf16 tile (16 pairs).
pub const AMX_BF16_TILE_K: usize = 32;
/// AMX tiles: `k`s per int8 tile (16 quads).
pub const AMX_I8_TILE_K: usize = 64;
/// `k`s per int8 group.
pub const KG: usize = 8;
/// Bytes of one int8 k-group of a panel.
pub const I8_GROUP_BYTES: usize = NR * KG;

/// Where `(k, c)` sits in a bf16 panel (or a chunk of one starting at an
/// even `k`): pair `k / 2`, word `2c + (k & 1)` of its 32.
#[inline]
pub const fn bf16_index(k: usize, c: usize) -> usize {
    (k / 2) * 2 * NR + 2 * c + (k & 1)
}

/// `K` rounded up to a whole number of bf16 pairs.
#[inline]
pub const fn bf16_padded_k(k: usize) -> usize {
    k.div_ceil(2) * 2
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

/// `x` as three bf16 values, high to low, whose sum is exactly `x` (every
/// finite f32 whose low terms stay normal: each round to nearest takes the
/// next 8 of its 24 significant bits, and each residual is exact in f32).
/// Their products with a bf16 weight are exact in f32 too, so three
/// bf16 × bf16 dot products with f32 accumulation (AMX `tdpbf16ps`) compute
/// an f32 × bf16 product as the f32 FMA tiles do, up to summation order.
/// Rounds with integer arithmetic only (as the SIMD twins do), which is
/// [`f32_to_bf16_bits`] on every non-NaN value.
#[inline]
pub fn split3_bf16(x: f32) -> [u16; 3] {
    #[inline]
    fn rne(v: f32) -> u32 {
        let b = v.to_bits();
        b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16
    }
    let hi = rne(x);
    let r1 = x - f32::from_bits(hi << 16);
    let mid = rne(r1);
    let r2 = r1 - f32::from_bits(mid << 16);
    [hi as u16, mid as u16, rne(r2) as u16]
}

/// [`split3_bf16`] over a row: `x[k]`'s terms go to `hi[k]`, `mid[k]` and
/// `lo[k]` (the scalar twin of the SIMD versions behind
/// `Kernels::split3_row`).
pub fn split3_row(x: &[f32], hi: &mut [u16], mid: &mut [u16], lo: &mut [u16]) {
    for (k, &v) in x.iter().enumerate() {
        [hi[k], mid[k], lo[k]] = split3_bf16(v);
    }
}

/// Pairs per [`transpose_pairs`] block (one per channel of a panel).
pub const PAIR_BLOCK: usize = NR;

/// One block of a bf16 panel: `rows[c]` holds channel `c`'s next
/// `2 · PAIR_BLOCK` bf16 values; pair `q` of channel `c` (one 32-bit word,
/// the two values as they are in memory) goes to `dst[q · NR + c]`. The
/// scalar twin of the tiers' transposes (a panel is the transpose of its
/// channels' pair streams).
pub fn transpose_pairs(rows: &[&[u16]; NR], dst: &mut [u32]) {
    for (c, r) in rows.iter().enumerate() {
        for (q, v) in r[..2 * PAIR_BLOCK].chunks_exact(2).enumerate() {
            let (a, b) = (v[0].to_ne_bytes(), v[1].to_ne_bytes());
            dst[q * NR + c] = u32::from_ne_bytes([a[0], a[1], b[0], b[1]]);
        }
    }
}

/// Packs one bf16 panel: `row(c)` gives logical channel `c`'s `K` values
/// (already bf16 bits), or `None` for a zero (padding) channel. Appends
/// `bf16_padded_k(K) · 16` words to `dst`.
pub fn pack_bf16_panel<'a>(k: usize, row: impl Fn(usize) -> Option<&'a [u16]>, dst: &mut Vec<u16>) {
    let start = dst.len();
    dst.resize(start + bf16_padded_k(k) * NR, 0);
    let panel = &mut dst[start..];
    for c in 0..NR {
        if let Some(r) = row(c) {
            for (kk, &v) in r.iter().enumerate().take(k) {
                panel[bf16_index(kk, c)] = v;
            }
        }
    }
}

/// `k` per block on the two-panel prefill path: two panel chunks of 8 KiB
/// and one packed tile of up to 12 KiB stay in L1.
pub const BF16_PAIR_KC: usize = 256;

/// Where row `r`'s value at `k` sits in a packed stream of `t` rows (see
/// [`pack_pairs_f32`]): pair `k / 2`, then the row, then `k % 2`.
#[inline]
pub const fn pair_index(k: usize, r: usize, t: usize) -> usize {
    ((k / 2) * t + r) * 2 + k % 2
}

/// Packs `kc` activations of `x.len()` rows (`kc` from `k0` of each) into
/// the two-panel tile's stream: pair `i` holds the `k = 2i, 2i + 1` values
/// of every row in turn ([`pair_index`]), zero past `kc`;
/// `bf16_padded_k(kc) · x.len()` values in all, appended to `dst`.
pub fn pack_pairs_f32(x: &[&[f32]], k0: usize, kc: usize, dst: &mut Vec<f32>) {
    pack_pairs(x, k0, kc, dst)
}

/// [`pack_pairs_f32`] for bf16 activations: each row's `k = 2i, 2i + 1`
/// values are one 32-bit word of the stream, the operand `vdpbf16ps`
/// broadcasts (the two-panel bf16 dot tile).
pub fn pack_pairs_b16(x: &[&[u16]], k0: usize, kc: usize, dst: &mut Vec<u16>) {
    pack_pairs(x, k0, kc, dst)
}

fn pack_pairs<T: Copy + Default>(x: &[&[T]], k0: usize, kc: usize, dst: &mut Vec<T>) {
    let t = x.len();
    let start = dst.len();
    dst.resize(start + bf16_padded_k(kc) * t, T::default());
    // In the stream's order (pair, then row): the writes are one sequential
    // run, the reads `t` runs of pairs (a row-by-row scatter wrote 8 bytes
    // per 8·t, each store to another line).
    let mut out = dst[start..].chunks_exact_mut(2);
    let whole = kc / 2;
    for p in 0..whole {
        let k = k0 + 2 * p;
        for (row, o) in x.iter().zip(&mut out) {
            o.copy_from_slice(&row[k..k + 2]);
        }
    }
    if kc % 2 == 1 {
        // The last `k` of an odd block, beside its zero.
        for (row, o) in x.iter().zip(&mut out) {
            o[0] = row[k0 + kc - 1];
        }
    }
    debug_assert!(out.next().is_none());
}

/// `k` per block on the BFMMLA prefill path (aarch64 `neon-bf16`, bf16
/// activations): a 16 KiB panel chunk and an 8-row packed tile of 8 KiB stay
/// in L1. A multiple of 4, so every block but the last is whole k-quads.
pub const BF16_MM_KC: usize = 512;

/// `kc` rounded up to whole k-quads: the `k`s one block of a BFMMLA stream
/// holds per row (see [`pack_mm_bf16`]).
#[inline]
pub const fn mm_padded_k(kc: usize) -> usize {
    kc.div_ceil(4) * 4
}

/// Where row `r`'s bf16 activation at `k` sits in a BFMMLA stream of `t`
/// rows (see [`pack_mm_bf16`]): k-quad `k / 4`, then the row pair `r / 2`,
/// then the row in the pair, then `k % 4`. Each 8 values are one BFMMLA `A`
/// operand: two rows × four consecutive `k`s.
#[inline]
pub const fn mm_index(k: usize, r: usize, t: usize) -> usize {
    ((k / 4) * t.div_ceil(2) + r / 2) * 8 + (r % 2) * 4 + k % 4
}

/// Packs `kc` bf16 activations of `x.len()` rows (`kc` from `k0` of each)
/// into the BFMMLA tile's stream ([`mm_index`]), zero past `kc` and in the
/// missing row of an odd last pair: `mm_padded_k(kc) · 2·⌈t/2⌉` values,
/// appended to `dst`.
pub fn pack_mm_bf16(x: &[&[u16]], k0: usize, kc: usize, dst: &mut Vec<u16>) {
    let t = x.len();
    let start = dst.len();
    dst.resize(start + mm_padded_k(kc) * t.div_ceil(2) * 2, 0);
    let d = &mut dst[start..];
    for (r, row) in x.iter().enumerate() {
        for (k, &v) in row[k0..k0 + kc].iter().enumerate() {
            d[mm_index(k, r, t)] = v;
        }
    }
}

/// Where `(k, c)` sits in an int8 panel (or a chunk of one starting at a
/// group boundary): group `k / 8`, then the architecture's order within it
/// (module docs).
#[inline]
pub const fn i8_index(k: usize, c: usize) -> usize {
    let (g, i) = (k / KG, k % KG);
    if cfg!(target_arch = "x86_64") {
        g * I8_GROUP_BYTES + (i / 4) * (4 * NR) + 4 * c + i % 4
    } else {
        g * I8_GROUP_BYTES + c * KG + i
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
                panel[i8_index(kk, c)] = v;
            }
        }
    }
}

/// The largest `|v|` of `row` (NaN ignored, as `f32::max` does), in eight
/// independent lanes so the compiler vectorizes it (max is exact: any order
/// gives the same result).
#[inline(always)]
pub fn abs_max(row: &[f32]) -> f32 {
    let mut m = [0.0f32; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for ch in chunks {
        for (l, v) in m.iter_mut().zip(ch) {
            *l = l.max(v.abs());
        }
    }
    tail.iter()
        .chain(&m)
        .fold(0.0f32, |acc, v| acc.max(v.abs()))
}

/// `x.round().clamp(-127.0, 127.0) as i8` (half away from zero; NaN gives 0)
/// without `roundf`, which the baseline x86-64 target has no instruction for
/// (a libm call per value, most of an int8 expert's packing time), and
/// without a float-to-int conversion: adding 2^23 rounds `|x|` to the
/// nearest integer (ties to even) in the low mantissa bits; a tie that went
/// down (its difference is exactly a half) goes up. Vectorizes.
#[inline(always)]
pub fn round_to_i8(x: f32) -> i8 {
    const MAGIC: f32 = 8_388_608.0; // 2^23
    let a = x.abs();
    // NaN fails both tests and becomes 0.
    let a = if a > 127.0 {
        127.0
    } else if a >= 0.0 {
        a
    } else {
        0.0
    };
    let m = a + MAGIC;
    let r = (m.to_bits() - MAGIC.to_bits()) as i32;
    let r = r + ((a - (m - MAGIC)) == 0.5) as i32;
    (if x < 0.0 { -r } else { r }) as i8
}

/// [`quantize_row_i8`] of a bf16 row (`f` receives it widened): the scalar
/// twin of the tiers' versions, which are this same code compiled for their
/// instruction sets (the operations are exact IEEE ones, so every tier gets
/// the same bits).
#[inline(always)]
pub fn quantize_bf16_row_i8(row: &[u16], f: &mut [f32], q: &mut [i8]) -> f32 {
    let f = &mut f[..row.len()];
    for (o, &v) in f.iter_mut().zip(row) {
        *o = bf16_bits_to_f32(v);
    }
    quantize_row_i8(f, q)
}

/// Symmetric int8 quantization of one row: returns the scale `s` with
/// `row ≈ s · q`, `q` in `[-127, 127]`. An all-zero (or non-finite) row gets
/// scale 0 and zeros. `q` may be longer than `row` (padding is zeroed).
#[inline(always)]
pub fn quantize_row_i8(row: &[f32], q: &mut [i8]) -> f32 {
    let amax = abs_max(row);
    if !(amax > 0.0 && amax.is_finite()) {
        q.fill(0);
        return 0.0;
    }
    let inv = 127.0 / amax;
    for (d, &v) in q.iter_mut().zip(row) {
        *d = round_to_i8(v * inv);
    }
    for d in q.iter_mut().skip(row.len()) {
        *d = 0;
    }
    amax / 127.0
}

/// A borrowed view of a packed matrix's elements.
pub(crate) enum DataView<'a> {
    Bf16(&'a [u16]),
    I8 { data: &'a [i8], scales: &'a [f32] },
    B12(&'a super::b12::B12Panels),
}

/// Where a phase's activation rows come from.
pub(crate) struct Src<'a> {
    pub(crate) f32_rows: &'a [f32],
    pub(crate) f32_stride: usize,
    pub(crate) i8_rows: &'a [i8],
    pub(crate) i8_stride: usize,
    pub(crate) i8_scales: &'a [f32],
    /// bf16 copies (zero-padded to an even length), for bf16 × bf16 tiles.
    pub(crate) b16_rows: &'a [u16],
    pub(crate) b16_stride: usize,
    /// The call's rows already packed for the two-panel f32 tile
    /// (`experts::run::pack_pairs_f32_stream`), or empty: each item packs
    /// its own.
    pub(crate) f32_packed: &'a [f32],
    /// The call's bf16 copies already packed for the two-panel bf16 dot
    /// tile (`experts::run::pack_pairs_b16_stream`), or empty.
    pub(crate) b16_packed: &'a [u16],
}

/// One accumulator row of a panel (16 channels).
#[inline]
pub(crate) fn as_row(a: &[f32]) -> &[f32; NR] {
    a.try_into().expect("accumulator rows are 16 wide")
}

/// One int8 accumulator row dequantized: `acc · weight scale · row scale`
/// (the same expression on every tier, so results stay bit-identical).
#[inline]
pub(crate) fn dequant(a: &[i32], ws: &[f32], xs: f32) -> [f32; NR] {
    let mut v = [0.0f32; NR];
    for ((d, &q), &w) in v.iter_mut().zip(a).zip(ws) {
        *d = q as f32 * w * xs;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_packing_puts_each_value_at_its_pair_index() {
        for t in [1, 3, 12] {
            for (k0, kc) in [(0, 8), (1, 7), (3, 1), (2, 256)] {
                let x: Vec<Vec<f32>> = (0..t)
                    .map(|r| (0..k0 + kc + 3).map(|k| (r * 1000 + k) as f32).collect())
                    .collect();
                let rows: Vec<&[f32]> = x.iter().map(|r| &r[..]).collect();
                // Appends after what is there.
                let mut got = vec![-1.0f32; 5];
                pack_pairs_f32(&rows, k0, kc, &mut got);
                let mut want = vec![0.0f32; bf16_padded_k(kc) * t];
                for (r, row) in x.iter().enumerate() {
                    for k in 0..kc {
                        want[pair_index(k, r, t)] = row[k0 + k];
                    }
                }
                assert_eq!(&got[..5], &[-1.0; 5]);
                assert_eq!(&got[5..], &want[..], "t {t} k0 {k0} kc {kc}");
            }
        }
    }

    #[test]
    fn split3_bf16_sums_exactly() {
        // An LCG over bit patterns: every sign, exponents from 2^-100 to
        // 2^100, every mantissa.
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..200_000u32 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (s >> 32) as u32;
            let exp = 27 + (r >> 23) % 200;
            let x = f32::from_bits((r & 0x807f_ffff) | (exp << 23));
            let [h, m, l] = split3_bf16(x);
            let (h, m, l) = (
                bf16_bits_to_f32(h),
                bf16_bits_to_f32(m),
                bf16_bits_to_f32(l),
            );
            assert_eq!(h + (m + l), x, "{i}: {x:e} = {h:e} + {m:e} + {l:e}");
            assert!(
                m.abs() <= h.abs() && l.abs() <= m.abs(),
                "{x:e}: terms not descending"
            );
        }
        for x in [0.0f32, -0.0, 1.0, -1.0, f32::MIN_POSITIVE * 4096.0, 3.0e38] {
            let [h, m, l] = split3_bf16(x);
            let sum = bf16_bits_to_f32(h) + (bf16_bits_to_f32(m) + bf16_bits_to_f32(l));
            assert_eq!(sum, x, "{x:e}");
        }
        // The high term is the ordinary rounding (`half`'s) wherever it is
        // finite.
        for x in [
            1.0f32 + f32::EPSILON * 64.0,
            3.389e38,
            -2.5e-30,
            f32::INFINITY,
        ] {
            assert_eq!(split3_bf16(x)[0], f32_to_bf16_bits(x), "{x:e}");
        }
    }

    #[test]
    fn bf16_pairs_cover_the_panel_once() {
        assert_eq!(bf16_index(0, 0), 0);
        assert_eq!(bf16_index(1, 0), 1);
        assert_eq!(bf16_index(0, 1), 2);
        assert_eq!(bf16_index(2, 0), 32);
        let mut seen: Vec<usize> = (0..6)
            .flat_map(|k| (0..NR).map(move |c| bf16_index(k, c)))
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..6 * NR).collect::<Vec<_>>());
        assert_eq!(bf16_padded_k(5), 6);
        assert_eq!(bf16_padded_k(6), 6);
    }

    #[test]
    fn mm_stream_covers_the_padded_tile_once() {
        for t in 1..=5usize {
            let rp = t.div_ceil(2) * 2;
            let mut seen: Vec<usize> = (0..8)
                .flat_map(|k| (0..rp).map(move |r| mm_index(k, r, t)))
                .collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..8 * rp).collect::<Vec<_>>());
        }
        // One operand: rows 0 and 1 at k 4..8.
        assert_eq!(mm_index(4, 0, 2), 8);
        assert_eq!(mm_index(5, 1, 2), 13);
        // Odd rows and a partial quad are zero-padded.
        let rows = [
            vec![1u16, 2, 3, 4, 5, 6],
            vec![7u16, 8, 9, 10, 11, 12],
            vec![13u16; 6],
        ];
        let x: Vec<&[u16]> = rows.iter().map(|r| &r[..]).collect();
        let mut d = vec![99u16];
        pack_mm_bf16(&x, 1, 5, &mut d);
        assert_eq!(d.len(), 1 + mm_padded_k(5) * 4);
        assert_eq!(&d[1..9], &[2, 3, 4, 5, 8, 9, 10, 11]);
        assert_eq!(&d[9..17], &[13, 13, 13, 13, 0, 0, 0, 0]);
        assert_eq!(&d[17..25], &[6, 0, 0, 0, 12, 0, 0, 0]);
    }

    #[test]
    fn i8_groups_cover_the_panel_once() {
        let mut seen: Vec<usize> = (0..24)
            .flat_map(|k| (0..NR).map(move |c| i8_index(k, c)))
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..24 * NR).collect::<Vec<_>>());
        // Every group is the same 128 bytes, shifted.
        assert_eq!(i8_index(9, 3), I8_GROUP_BYTES + i8_index(1, 3));
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
        // The rounding against the libm route it replaces, on halves,
        // neighbours of halves, the clamp and non-finite values.
        let mut xs = vec![
            0.0f32, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, 126.5, -126.5, 127.4, 127.6,
        ];
        xs.extend([
            -200.0,
            1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
        ]);
        for i in 0..=127 * 64 {
            let h = i as f32 / 64.0;
            for x in [
                h,
                -h,
                h + 0.5,
                f32::from_bits((h + 0.5).to_bits() - 1),
                f32::from_bits((h + 0.5).to_bits() + 1),
            ] {
                xs.extend([x, -x]);
            }
        }
        for x in xs {
            assert_eq!(round_to_i8(x), x.round().clamp(-127.0, 127.0) as i8, "{x}");
        }
        assert!(q.iter().all(|&v| v == 0));
    }
}
