//! **B12**: bf16 weight panels stored losslessly in 12 bits a weight, for
//! decode, which streams every weight byte once per token and is bound by
//! the memory bandwidth.
//!
//! A bf16 weight is a sign, an 8-bit exponent and 7 mantissa bits, but the
//! weights of one panel (16 output channels × `K`) use few exponents: random
//! normal weights of one panel use 20-26 distinct ones, and the 15 most common
//! cover all but ~3 in 10 000 weights (measured on the bench model's q, down,
//! gate and LM-head panels). So each weight is stored as one byte of
//! sign | 7 mantissa bits and a 4-bit *code*: codes 0..15 index the panel's
//! table of its 15 most common exponents, code 15 is an *escape* whose exact
//! exponent sits in the panel's exception list (in stream order, with its
//! position). Decoding gives back the exact bf16 words, so the arithmetic on
//! them is that of the bf16 kernels (same products, same `k` order per
//! accumulator); only the bytes read drop to 0.75x.
//!
//! Layout: per panel, groups of [`B12_GROUP_PAIRS`] `k`-pairs (8 `k`s × 16
//! channels = 128 weights, `K` zero-padded to whole groups) of
//! [`B12_GROUP_BYTES`] = 192 bytes (three cache lines): 128 sign|mantissa
//! bytes, then 64 bytes of codes. The 128 bytes are two *halves* of 64 (pairs
//! 0-1, then 2-3 of the group); in a half, byte `16·l + j` holds word
//! `8·l + j` (`j < 8`) of the half's first pair and byte `16·l + 8 + j` word
//! `8·l + j` of its second (the bf16 panel's words, [`super::layout`]), so
//! that interleaving a half's rebuilt low and high bytes per 128-bit lane
//! (x86 `vpunpcklbw` / `vpunpckhbw`) yields the two pairs' 64-byte vectors
//! exactly as the bf16 panel stores them. Code byte `b` holds the code of
//! byte `b` of half 0 in its low nibble and of half 1 in its high nibble.
//!
//! Rebuilding a word from byte `s` (sign | mantissa) and exponent `e`:
//! high byte `(s & 0x80) | e >> 1`, low byte `(s & 0x7f) | (e & 1) << 7`;
//! the tables hold `e >> 1` and `(e & 1) << 7` per code (both 0 for the
//! escape, whose bits are or-ed in from the exception list).
//!
//! The decode kernel (`b12_tile`, up to [`B12_MR`] tokens) keeps two
//! accumulators per token, even and odd `k`, each summed in `k` order with
//! fused multiply-adds, then `s0 + s1`: the order of the AVX-512 bf16 decode
//! tile, so a model gives the same bits from B12 as from bf16 panels there.
//! [`b12_tile`] here is its scalar twin, bit for bit.

use rayon::prelude::*;

use super::layout::{NR, bf16_bits_to_f32, bf16_padded_k};
use crate::mem::ZeroBuf;

/// `k`-pairs per group.
pub const B12_GROUP_PAIRS: usize = 4;
/// `k`s per group.
pub const B12_GROUP_K: usize = 2 * B12_GROUP_PAIRS;
/// Bytes per group: 128 sign|mantissa bytes and 64 code bytes.
pub const B12_GROUP_BYTES: usize = 192;
/// The escape code: the exponent is in the panel's exception list.
pub const B12_ESCAPE: u8 = 15;
/// Most tokens per decode tile on any tier (the AVX-512 tile's; the scalar
/// twin's too).
pub const B12_MR: usize = 8;

/// `K` rounded up to whole groups.
#[inline]
pub const fn b12_padded_k(k: usize) -> usize {
    k.div_ceil(B12_GROUP_K) * B12_GROUP_K
}

/// Position of word `w` (0..32) of pair `q` (0..4) of a group in the group's
/// sign|mantissa bytes (and, as `(half, byte)`, in its code bytes).
#[inline]
pub const fn b12_byte(q: usize, w: usize) -> usize {
    (q / 2) * 64 + (w / 8) * 16 + (q % 2) * 8 + w % 8
}

/// One panel, borrowed: what a tile reads.
#[derive(Clone, Copy)]
pub struct B12Panel<'a> {
    /// `groups · 192` bytes.
    pub data: &'a [u8],
    /// Per code: `e >> 1`, then (bytes 16..32) `(e & 1) << 7`.
    pub tables: &'a [u8; 32],
    /// Stream positions (`group · 128 + b12_byte(..)`) of the escaped weights,
    /// ascending, and their exponents.
    pub exc_pos: &'a [u32],
    pub exc_exp: &'a [u8],
    /// Logical `K` (values past it are zero).
    pub k: usize,
}

impl B12Panel<'_> {
    /// Groups in the panel.
    pub fn groups(&self) -> usize {
        self.data.len() / B12_GROUP_BYTES
    }
}

/// A packed matrix of B12 panels.
#[derive(Clone)]
pub struct B12Panels {
    k: usize,
    panels: usize,
    groups: usize,
    data: ZeroBuf<u8>,
    tables: Vec<[u8; 32]>,
    exc_start: Vec<usize>,
    exc_pos: Vec<u32>,
    exc_exp: Vec<u8>,
}

/// Whether bf16 weight panels are stored as B12 at load: `EPSERVE_B12=1`
/// forces it on (on tiers without a native tile that runs the scalar twin:
/// correct, slow; for tests), `=0` off; by default on where it pays
/// ([`super::dispatch::Kernels::b12_pays`]: the AVX-512 tiers).
pub fn b12_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(
        || match std::env::var("EPSERVE_B12").ok().as_deref().map(str::trim) {
            Some("1") => true,
            Some("0") => false,
            _ => super::dispatch::kernels().b12_pays(),
        },
    )
}

/// One encoded panel: its table and its escapes (positions, exponents).
type EncodedPanel = ([u8; 32], Vec<u32>, Vec<u8>);

impl B12Panels {
    /// Encodes bf16 panels as [`super::layout::pack_bf16_panel`] packs them
    /// (`bf16_padded_k(k) · 16` words each, panel after panel), panels in
    /// parallel on rayon's threads.
    pub fn encode(bf16_panels: &[u16], k: usize) -> B12Panels {
        let pw = bf16_padded_k(k) * NR;
        let panels = bf16_panels.len().checked_div(pw).unwrap_or(0);
        let groups = b12_padded_k(k) / B12_GROUP_K;
        let pb = groups * B12_GROUP_BYTES;
        let mut data = ZeroBuf::<u8>::zeroed(panels * pb);
        // (pair, word) of each of a group's 128 bytes, in stream order.
        let mut at = [(0usize, 0usize); 128];
        for q in 0..B12_GROUP_PAIRS {
            for w in 0..2 * NR {
                at[b12_byte(q, w)] = (q, w);
            }
        }
        let encoded: Vec<EncodedPanel> = if pb == 0 {
            vec![([0; 32], Vec::new(), Vec::new()); panels]
        } else {
            data.par_chunks_mut(pb)
                .enumerate()
                .map(|(p, out)| encode_panel(&bf16_panels[p * pw..(p + 1) * pw], groups, &at, out))
                .collect()
        };
        let mut tables = Vec::with_capacity(panels);
        let (mut exc_start, mut exc_pos, mut exc_exp) = (vec![0], Vec::new(), Vec::new());
        for (tab, pos, exp) in encoded {
            tables.push(tab);
            exc_pos.extend(pos);
            exc_exp.extend(exp);
            exc_start.push(exc_pos.len());
        }
        B12Panels {
            k,
            panels,
            groups,
            data,
            tables,
            exc_start,
            exc_pos,
            exc_exp,
        }
    }

    /// Logical `K`.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Panels (16 output channels each).
    pub fn panels(&self) -> usize {
        self.panels
    }

    /// The groups of every panel (what a decode streams; mlock).
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Escaped weights in all.
    pub fn exceptions(&self) -> usize {
        self.exc_pos.len()
    }

    /// Bytes held (groups, tables, exception lists).
    pub fn bytes(&self) -> usize {
        self.data.len() + self.tables.len() * 32 + self.exc_pos.len() * 5
    }

    /// The encoded bytes of panels `p0..p1` (contiguous), what a decode of
    /// them streams (the exception lists aside): for L2 hints.
    pub fn panels_bytes(&self, p0: usize, p1: usize) -> &[u8] {
        let n = self.groups * B12_GROUP_BYTES;
        &self.data[p0 * n..p1 * n]
    }

    /// Panel `p`.
    pub fn panel(&self, p: usize) -> B12Panel<'_> {
        let n = self.groups * B12_GROUP_BYTES;
        let (e0, e1) = (self.exc_start[p], self.exc_start[p + 1]);
        B12Panel {
            data: &self.data[p * n..(p + 1) * n],
            tables: &self.tables[p],
            exc_pos: &self.exc_pos[e0..e1],
            exc_exp: &self.exc_exp[e0..e1],
            k: self.k,
        }
    }

    /// Panel `p` back as bf16 panel words (`bf16_padded_k(k) · 16`, exactly
    /// what was encoded) with the scalar twin.
    pub fn decode_panel(&self, p: usize, dst: &mut [u16]) {
        b12_decode(&self.panel(p), &mut dst[..bf16_padded_k(self.k) * NR]);
    }

    /// All panels back as bf16 panels (`panels · bf16_padded_k(k) · 16`
    /// words), with the tier's decoder.
    pub fn to_bf16_panels(&self, kern: &super::dispatch::Kernels) -> ZeroBuf<u16> {
        let pw = bf16_padded_k(self.k) * NR;
        let mut out = ZeroBuf::<u16>::zeroed(self.panels * pw);
        if pw > 0 {
            out.par_chunks_mut(pw)
                .enumerate()
                .for_each(|(p, d)| kern.b12_decode(&self.panel(p), d));
        }
        out
    }
}

/// Encodes one panel's words `src` (`groups` groups; words past its end
/// are padding zeros) into `out` (`groups · 192` zero bytes); `at` maps a
/// group's stream byte to its (pair, word).
fn encode_panel(
    src: &[u16],
    groups: usize,
    at: &[(usize, usize); 128],
    out: &mut [u8],
) -> EncodedPanel {
    let word = |i: usize| src.get(i).copied().unwrap_or(0);
    let mut hist = [0usize; 256];
    for &v in src {
        hist[usize::from(exponent(v))] += 1;
    }
    // Padding pairs past the source are zeros (exponent 0).
    hist[0] += groups * B12_GROUP_PAIRS * 2 * NR - src.len().min(groups * B12_GROUP_PAIRS * 2 * NR);
    // The 15 most common exponents (ties: the smaller exponent).
    let mut order: Vec<usize> = (0..256).collect();
    order.sort_by_key(|&e| (std::cmp::Reverse(hist[e]), e));
    let mut code_of = [B12_ESCAPE; 256];
    let mut tab = [0u8; 32];
    for (c, &e) in order.iter().take(usize::from(B12_ESCAPE)).enumerate() {
        if hist[e] == 0 {
            break;
        }
        code_of[e] = c as u8;
        tab[c] = (e >> 1) as u8;
        tab[16 + c] = ((e & 1) << 7) as u8;
    }
    let (mut pos, mut exp) = (Vec::new(), Vec::new());
    for g in 0..groups {
        let gd = &mut out[g * B12_GROUP_BYTES..(g + 1) * B12_GROUP_BYTES];
        for (b, &(q, w)) in at.iter().enumerate() {
            let v = word((g * B12_GROUP_PAIRS + q) * 2 * NR + w);
            let e = exponent(v);
            gd[b] = ((v >> 8) as u8 & 0x80) | (v as u8 & 0x7f);
            let c = code_of[usize::from(e)];
            gd[128 + b % 64] |= c << (4 * (b / 64));
            if c == B12_ESCAPE {
                pos.push((g * 128 + b) as u32);
                exp.push(e);
            }
        }
    }
    (tab, pos, exp)
}

/// The exponent field of a bf16 bit pattern.
#[inline]
fn exponent(v: u16) -> u8 {
    ((v >> 7) & 0xff) as u8
}

/// The activations the decode tiles read for a panel's last group when `k`
/// does not fill it: `x[t][8·(k / 8)..k]`, zero past `k` (the rows end at
/// `k`; the weights there are zero too). The SIMD tiles' helper (x86 and
/// aarch64).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) fn b12_tail<const T: usize>(x: &[&[f32]], k: usize) -> [[f32; B12_GROUP_K]; T] {
    let k0 = k / B12_GROUP_K * B12_GROUP_K;
    std::array::from_fn(|t| {
        let mut v = [0.0f32; B12_GROUP_K];
        v[..k - k0].copy_from_slice(&x[t][k0..k]);
        v
    })
}

/// Ors the escapes of the 64-byte half that ends at stream position `end`
/// into its rebuilt high and low bytes `hh`, `ll`: the SIMD decoders' rare
/// path (about 3 weights in 10 000 escape). `*ei` and `*next` are the next
/// escape's index and stream position; they move past the half.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline]
pub(crate) fn b12_patch(
    panel: &B12Panel<'_>,
    end: usize,
    hh: &mut [u8; 64],
    ll: &mut [u8; 64],
    ei: &mut usize,
    next: &mut usize,
) {
    while *next < end {
        let b = *next + 64 - end;
        let e = panel.exc_exp[*ei];
        hh[b] |= e >> 1;
        ll[b] |= (e & 1) << 7;
        *ei += 1;
        *next = panel.exc_pos.get(*ei).map_or(usize::MAX, |&p| p as usize);
    }
}

/// Scalar twin of the decode tile: `acc[t·16 + c] += Σ_k x[t][k] · W[c, k]`
/// over the whole panel, `x.len() ≤ B12_MR` rows of at least `panel.k`
/// values, in the kernel's order: two fused-multiply-add accumulators per
/// token and channel, even and odd `k`, then `s0 + s1` (the order of the
/// AVX-512 bf16 decode tile for up to 6 tokens, so that B12 and bf16 panels
/// give the same bits there; the padding past `k` adds exact zeros).
pub fn b12_tile(panel: &B12Panel<'_>, x: &[&[f32]], acc: &mut [f32]) {
    let mut w = vec![0u16; b12_padded_k(panel.k) * NR];
    b12_decode(panel, &mut w);
    for (t, xr) in x.iter().enumerate() {
        for c in 0..NR {
            let mut s = [0.0f32; 2];
            for k in 0..b12_padded_k(panel.k) {
                let xv = if k < panel.k { xr[k] } else { 0.0 };
                let wv = bf16_bits_to_f32(w[(k / 2) * 2 * NR + 2 * c + (k & 1)]);
                s[k % 2] = xv.mul_add(wv, s[k % 2]);
            }
            acc[t * NR + c] += s[0] + s[1];
        }
    }
}

/// Scalar twin of the B12 tile with **bf16** activations (`x.len() ≤
/// B12_MR` rows of at least `bf16_padded_k(panel.k)` bf16 values, zero past
/// `k`): the panel decoded, then the bf16 dot tiles' twin
/// ([`super::generic::bf16x_tile`]: exact products, f32 sums in `k` order;
/// the SIMD tile sums in its own order, within the dot tiles' bound).
pub fn b12x_tile(panel: &B12Panel<'_>, x: &[&[u16]], acc: &mut [f32]) {
    let mut w = vec![0u16; bf16_padded_k(panel.k) * NR];
    b12_decode(panel, &mut w);
    super::generic::bf16x_tile(&w, x, acc);
}

/// Scalar twin of the tiers' panel decoders: `panel`'s bf16 panel words
/// (the pairs of its groups in order, `b12_padded_k(k) · 16` words) into
/// `dst`, as many as it holds (`bf16_padded_k(k) · 16` gives back exactly the
/// bf16 panel).
pub fn b12_decode(panel: &B12Panel<'_>, dst: &mut [u16]) {
    let mut exc = panel.exc_pos.iter().zip(panel.exc_exp).peekable();
    for g in 0..panel.groups() {
        let gd = &panel.data[g * B12_GROUP_BYTES..(g + 1) * B12_GROUP_BYTES];
        for b in 0..128 {
            let code = usize::from((gd[128 + b % 64] >> (4 * (b / 64))) & 0x0f);
            let (mut hi, mut lo) = (panel.tables[code], panel.tables[16 + code]);
            if code == usize::from(B12_ESCAPE)
                && let Some((_, &e)) = exc.next_if(|(pos, _)| **pos as usize == g * 128 + b)
            {
                hi = e >> 1;
                lo = (e & 1) << 7;
            }
            let s = gd[b];
            let (q, w) = ((b / 64) * 2 + (b % 16) / 8, (b % 64) / 16 * 8 + b % 8);
            if let Some(d) = dst.get_mut((g * B12_GROUP_PAIRS + q) * 2 * NR + w) {
                *d = u16::from_le_bytes([(s & 0x7f) | lo, (s & 0x80) | hi]);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::layout::{f32_to_bf16_bits, pack_bf16_panel};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// `n` rows of `k` bf16 weights, normal-like (sum of uniforms), std ~0.02.
    pub(crate) fn normal_rows(rng: &mut StdRng, n: usize, k: usize) -> Vec<Vec<u16>> {
        (0..n)
            .map(|_| {
                (0..k)
                    .map(|_| {
                        let s: f32 = (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum();
                        f32_to_bf16_bits(s * 0.017)
                    })
                    .collect()
            })
            .collect()
    }

    pub(crate) fn pack(rows: &[Vec<u16>], k: usize) -> Vec<u16> {
        let mut out = Vec::new();
        for p in 0..rows.len().div_ceil(NR) {
            pack_bf16_panel(k, |c| rows.get(p * NR + c).map(|r| &r[..]), &mut out);
        }
        out
    }

    fn round_trips(packed: &[u16], k: usize) -> B12Panels {
        let b = B12Panels::encode(packed, k);
        let pw = bf16_padded_k(k) * NR;
        assert_eq!(b.panels(), packed.len() / pw);
        let mut back = vec![0u16; pw];
        for p in 0..b.panels() {
            b.decode_panel(p, &mut back);
            assert_eq!(&back[..], &packed[p * pw..(p + 1) * pw], "k={k} panel {p}");
        }
        b
    }

    #[test]
    fn panels_round_trip_exactly() {
        let mut rng = StdRng::seed_from_u64(12);
        for &k in &[1usize, 2, 7, 8, 9, 31, 33, 100, 256, 513] {
            let rows = normal_rows(&mut rng, 40, k);
            let b = round_trips(&pack(&rows, k), k);
            assert_eq!(
                b.data.len(),
                b.panels() * b12_padded_k(k) / 8 * B12_GROUP_BYTES
            );
        }
    }

    #[test]
    fn every_exponent_and_special_value_round_trips() {
        // One panel holding every bf16 exponent (zero, subnormals, ±inf,
        // NaNs), so most weights escape, and one of only zeros.
        let k = 520;
        let mut rng = StdRng::seed_from_u64(3);
        let rows: Vec<Vec<u16>> = (0..NR)
            .map(|c| {
                (0..k)
                    .map(|i| {
                        let e = ((c * k + i) * 37 % 256) as u16;
                        (rng.random::<u16>() & 0x807f) | (e << 7)
                    })
                    .collect()
            })
            .collect();
        let b = round_trips(&pack(&rows, k), k);
        assert!(b.exceptions() > NR * k / 2, "{} escapes", b.exceptions());
        let zeros = vec![vec![0u16; 9]; 3];
        let b = round_trips(&pack(&zeros, 9), 9);
        assert_eq!(b.exceptions(), 0);
    }

    #[test]
    fn normal_weights_take_twelve_bits_and_rarely_escape() {
        let mut rng = StdRng::seed_from_u64(5);
        let (n, k) = (64, 2048);
        let packed = pack(&normal_rows(&mut rng, n, k), k);
        let b = B12Panels::encode(&packed, k);
        let ratio = b.bytes() as f64 / (packed.len() * 2) as f64;
        assert!(ratio < 0.76, "{ratio}");
        assert!(
            (b.exceptions() as f64) < 1e-3 * (n * k) as f64,
            "{}",
            b.exceptions()
        );
    }
}
