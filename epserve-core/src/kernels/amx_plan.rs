//! The AMX prefill path's tile planning: one work item's panels (handed
//! over by the experts' `run_panels` on the `amx` tier when an expert has
//! more tokens than a SIMD tile holds) cut into panel blocks, `K` blocks,
//! panel pairs and token tiles, with the expert's rows packed once as `A`
//! tiles and the next weights prefetched, each step run on the AMX tiles
//! ([`AmxTiles`], [`AmxBlock`]: the safe wrapper in [`super::dispatch`] of
//! the x86_64 instructions in `kernels/x86/amx.rs`).
//!
//! Arch-neutral like that wrapper (it compiles on every target; only the
//! `amx` tier, x86_64 alone, ever sets [`Kernels::amx`]), and below the
//! experts: it sees the packed weights and the activation rows only as the
//! plain views of [`super::layout`] ([`DataView`], [`Src`]).

use std::cell::RefCell;
use std::ops::Range;

use crate::kernels::dispatch::{AmxBlock, AmxTiles, Kernels};
use crate::kernels::layout::{
    AMX_BF16_TILE_K, AMX_I8_TILE_K, AMX_ROW_BYTES, AMX_TILE_BYTES, AMX_TILE_M, DataView, NR, Src,
    as_row, bf16_padded_k, dequant, i8_padded_k,
};

thread_local! {
    /// AMX path: one panel block's accumulators (f32 for bf16, i32 for
    /// int8).
    static ACC_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static ACC_I32: RefCell<Vec<i32>> = const { RefCell::new(Vec::new()) };
    /// AMX path: the expert's activation rows packed as `A` tiles, and a
    /// trailing partial `B` tile zero-padded.
    static AMX_SCRATCH: RefCell<(Vec<u8>, Vec<u8>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
}

/// AMX path: bytes of packed activations (`A`) one `K` block spans, kept in
/// L2 while a block of panels passes over it.
/// (Small under test, so the fixtures' shapes cross block boundaries.)
const AMX_A_BLOCK: usize = if cfg!(test) { 4 << 10 } else { 256 << 10 };
/// AMX path: bytes of accumulators per block of panels.
const AMX_ACC_BLOCK: usize = if cfg!(test) { 4 << 10 } else { 128 << 10 };

/// A 64-byte aligned, zero-filled window of `len` bytes inside `buf`.
fn aligned_zeroed(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
    buf.clear();
    buf.resize(len + 64, 0);
    let off = buf.as_ptr().align_offset(64).min(64);
    &mut buf[off..off + len]
}

/// Why the AMX plan never sees B12 panels.
const B12_DECODED: &str = "run_panels decodes B12 panels to bf16 before the AMX tiles";

/// The experts' `run_panels` on AMX tiles (two tokens or more), for the
/// work item of `panels`.
///
/// With `split`, bf16 weights meet the **f32** activation rows: each row
/// enters `A` as its three bf16 terms (`layout::split3_bf16`, high, middle and
/// low, as rows `i`, `n + i` and `2n + i`), whose products with the weights
/// are exact, and the epilogue adds the three sums (low ones first). The
/// result is the f32 FMA tiles' up to summation order, at three times the
/// AMX work, which still leaves the weight stream the bound on a 2-vCPU
/// Xeon up to a few dozen rows.
///
/// The expert's `n` activation rows are packed once per work item into `A`
/// tiles (16-token row groups, `K` zero-padded to whole tiles). Panels are
/// taken in blocks whose accumulators fit [`AMX_ACC_BLOCK`]; within a block,
/// `K` is cut so that one `K` block of `A` fits [`AMX_A_BLOCK`] (L2) while
/// every panel pair of the block streams its weights over it once, with up
/// to 2 × 2 output tiles (32 tokens × 2 panels) in registers. Weight tiles
/// are read in place — on x86 both panel layouts are AMX `B` tiles (16 bf16
/// `k`-pairs, or 8 int8 groups of two `k`-quad rows) — and a trailing partial
/// tile is staged with zeros. Sums are exact for int8 (same i32 as every
/// other tier), f32 for bf16.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_panels_amx(
    k: &Kernels,
    data: &DataView<'_>,
    kdim: usize,
    n: usize,
    panels: Range<usize>,
    row: &dyn Fn(usize) -> usize,
    src: &Src<'_>,
    split: bool,
    mut epi: impl FnMut(usize, usize, &[f32; NR]),
) {
    let int8 = matches!(data, DataView::I8 { .. });
    debug_assert!(!(split && int8), "only f32 activations are split");
    // `A` rows: the tokens, or their three bf16 terms.
    let m = if split { 3 * n } else { n };
    let tk = if int8 { AMX_I8_TILE_K } else { AMX_BF16_TILE_K };
    let ktiles = kdim.div_ceil(tk).max(1);
    // One spare line per row: a row stride that is a multiple of 4 KiB would
    // put all 16 rows of an `A` tile in the same L1 set.
    let row_bytes = (ktiles + 1) * AMX_ROW_BYTES;
    let n_pad = m.next_multiple_of(AMX_TILE_M);
    let (p0, p1) = (panels.start, panels.end);
    AMX_SCRATCH.with_borrow_mut(|(abuf, bbuf)| {
        ACC_F32.with_borrow_mut(|accf| {
            ACC_I32.with_borrow_mut(|acci| {
                let a = aligned_zeroed(abuf, n_pad * row_bytes);
                // Row `r`'s first `kdim` bf16 values (rows start 64-byte
                // aligned: whole u16s).
                fn words(a: &mut [u8], r: usize, row_bytes: usize, kdim: usize) -> &mut [u16] {
                    bytemuck::cast_slice_mut(&mut a[r * row_bytes..][..2 * kdim])
                }
                for i in 0..n {
                    let base = row(i);
                    match data {
                        DataView::Bf16(_) if split => {
                            let s = &src.f32_rows[base * src.f32_stride..][..kdim];
                            let (hi, rest) = a[i * row_bytes..].split_at_mut(n * row_bytes);
                            let (mid, lo) = rest.split_at_mut(n * row_bytes);
                            k.split3_row(
                                s,
                                words(hi, 0, row_bytes, kdim),
                                words(mid, 0, row_bytes, kdim),
                                words(lo, 0, row_bytes, kdim),
                            );
                        }
                        DataView::Bf16(_) => {
                            let s = &src.b16_rows[base * src.b16_stride..][..kdim];
                            words(a, i, row_bytes, kdim).copy_from_slice(s);
                        }
                        DataView::I8 { .. } => {
                            let s = &src.i8_rows[base * src.i8_stride..][..kdim];
                            a[i * row_bytes..][..kdim].copy_from_slice(bytemuck::cast_slice(s));
                        }
                        DataView::B12(_) => unreachable!("{B12_DECODED}"),
                    }
                }
                // Every panel's weights as bytes: k-tile `j` of panel `p` is
                // the 1 KiB at `p · pbytes + j · 1024` in both layouts (16
                // bf16 k-pairs, or 8 int8 groups).
                let (wbytes, pbytes): (&[u8], usize) = match data {
                    DataView::Bf16(w) => (bytemuck::cast_slice(w), bf16_padded_k(kdim) * NR * 2),
                    DataView::I8 { data: w, .. } => {
                        (bytemuck::cast_slice(w), i8_padded_k(kdim) * NR)
                    }
                    DataView::B12(_) => unreachable!("{B12_DECODED}"),
                };
                let plan = AmxPlan {
                    a,
                    row_bytes,
                    n_pad,
                    wbytes,
                    pbytes,
                    full: pbytes / AMX_TILE_BYTES,
                    ktiles,
                    kt_blk: (AMX_A_BLOCK / (n_pad * AMX_ROW_BYTES)).clamp(1, ktiles),
                    nb: (AMX_ACC_BLOCK / (n_pad * NR * 4)).max(2) / 2 * 2,
                    p1,
                };
                let mut acc = match data {
                    DataView::I8 { scales, .. } => {
                        acci.resize(plan.nb * n_pad * NR, 0);
                        AmxAcc::I32(acci, scales)
                    }
                    DataView::Bf16(_) => {
                        accf.resize(plan.nb * n_pad * NR, 0.0);
                        AmxAcc::F32(accf)
                    }
                    DataView::B12(_) => unreachable!("{B12_DECODED}"),
                };
                let stage = aligned_zeroed(bbuf, 2 * AMX_TILE_BYTES);
                k.amx_scope(|t| {
                    let mut pb0 = p0;
                    while pb0 < p1 {
                        let pb1 = (pb0 + plan.nb).min(p1);
                        let mut j0 = 0;
                        while j0 < ktiles {
                            let kt = plan.kt_blk.min(ktiles - j0);
                            let mut pp = pb0;
                            while pp < pb1 {
                                let nt = (pb1 - pp).min(2);
                                let blk = PairBlock {
                                    pb0,
                                    pb1,
                                    pp,
                                    nt,
                                    j0,
                                    kt,
                                };
                                plan.pair_block(t, &mut acc, stage, &blk);
                                pp += nt;
                            }
                            j0 += kt;
                        }
                        // Epilogue for the panel block.
                        for p in pb0..pb1 {
                            let base = (p - pb0) * n_pad * NR;
                            match &acc {
                                AmxAcc::F32(accf) if split => {
                                    let at = |r: usize| &accf[base + r * NR..][..NR];
                                    for i in 0..n {
                                        let (h, m, l) = (at(i), at(n + i), at(2 * n + i));
                                        let v: [f32; NR] =
                                            std::array::from_fn(|c| h[c] + (m[c] + l[c]));
                                        epi(i, p, &v);
                                    }
                                }
                                AmxAcc::F32(accf) => {
                                    for i in 0..n {
                                        let a = &accf[base + i * NR..base + (i + 1) * NR];
                                        epi(i, p, as_row(a));
                                    }
                                }
                                AmxAcc::I32(acci, scales) => {
                                    let ws = &scales[p * NR..(p + 1) * NR];
                                    for i in 0..n {
                                        let xs = src.i8_scales[row(i)];
                                        let a = &acci[base + i * NR..base + (i + 1) * NR];
                                        epi(i, p, &dequant(a, ws, xs));
                                    }
                                }
                            }
                        }
                        pb0 = pb1;
                    }
                });
            })
        })
    })
}

/// The accumulators of one AMX panel block (int8: with the weights'
/// per-channel scales the epilogue applies).
enum AmxAcc<'a> {
    F32(&'a mut Vec<f32>),
    I32(&'a mut Vec<i32>, &'a [f32]),
}

/// One work item's AMX geometry: the packed `A` rows and the weights.
struct AmxPlan<'a> {
    /// The expert's rows as `A` tiles (`n_pad` rows of `row_bytes`).
    a: &'a [u8],
    row_bytes: usize,
    /// Rows rounded up to whole tiles.
    n_pad: usize,
    /// All panels' weights, `pbytes` per panel.
    wbytes: &'a [u8],
    pbytes: usize,
    /// Whole k-tiles per panel (the rest, if any, is one partial tile).
    full: usize,
    /// k-tiles per panel, partial included.
    ktiles: usize,
    /// k-tiles per K block.
    kt_blk: usize,
    /// Panels per panel block (even).
    nb: usize,
    /// End of the work item's panels.
    p1: usize,
}

/// A panel pair (`nt` = 1 or 2 panels from `pp`, inside the panel block
/// `pb0..pb1`) over the K block of `kt` k-tiles from k-tile `j0`.
struct PairBlock {
    pb0: usize,
    pb1: usize,
    pp: usize,
    nt: usize,
    j0: usize,
    kt: usize,
}

impl AmxPlan<'_> {
    fn panel(&self, p: usize) -> &[u8] {
        &self.wbytes[p * self.pbytes..(p + 1) * self.pbytes]
    }

    /// The weights read after `blk` (the next pair of its panel block and K
    /// block, else the first pair of the next K block, else of the next
    /// panel block), to prefetch while `blk` computes.
    fn next_weights(&self, blk: &PairBlock) -> [&[u8]; 2] {
        let PairBlock {
            pb0,
            pb1,
            pp,
            nt,
            j0,
            kt,
        } = *blk;
        let next = if pp + nt < pb1 {
            Some((pp + nt, pb1, j0, kt))
        } else if j0 + kt < self.ktiles {
            Some((pb0, pb1, j0 + kt, self.kt_blk.min(self.ktiles - j0 - kt)))
        } else if pb1 < self.p1 {
            Some((pb1, (pb1 + self.nb).min(self.p1), 0, self.kt_blk))
        } else {
            None
        };
        let Some((np, nend, nj, nk)) = next else {
            return [&[], &[]];
        };
        let at = |q: usize| -> &[u8] {
            if np + q >= nend {
                return &[];
            }
            let lo = (nj * AMX_TILE_BYTES).min(self.pbytes);
            &self.panel(np + q)[lo..((nj + nk) * AMX_TILE_BYTES).min(self.pbytes)]
        };
        [at(0), at(1)]
    }

    /// `blk`'s products: whole k-tiles read in place, a trailing partial one
    /// staged with zeros in `stage` (two tiles).
    fn pair_block(&self, t: &AmxTiles, acc: &mut AmxAcc<'_>, stage: &mut [u8], blk: &PairBlock) {
        let PairBlock { pp, nt, j0, kt, .. } = *blk;
        let c_base = (pp - blk.pb0) * self.n_pad * NR;
        let main = (j0 + kt).min(self.full).saturating_sub(j0);
        if main > 0 {
            let b = [
                &self.panel(pp)[j0 * AMX_TILE_BYTES..],
                &self.panel(pp + nt - 1)[j0 * AMX_TILE_BYTES..],
            ];
            let pf = self.next_weights(blk);
            self.token_tiles(t, acc, j0, b, nt, main, c_base, j0 > 0, pf);
        }
        if j0 + kt > self.full {
            for q in 0..nt {
                let d = &mut stage[q * AMX_TILE_BYTES..(q + 1) * AMX_TILE_BYTES];
                d.fill(0);
                let tail = &self.panel(pp + q)[self.full * AMX_TILE_BYTES..];
                d[..tail.len()].copy_from_slice(tail);
            }
            let b = [
                &stage[..AMX_TILE_BYTES],
                &stage[(nt - 1) * AMX_TILE_BYTES..nt * AMX_TILE_BYTES],
            ];
            let none: [&[u8]; 2] = [&[], &[]];
            self.token_tiles(
                t,
                acc,
                self.full,
                b,
                nt,
                1,
                c_base,
                j0 > 0 || main > 0,
                none,
            );
        }
    }

    /// Every token tile (pairs of 16 rows) over `kt` k-tiles from k-tile `j`
    /// against the panel pair `b` (`nt` panels), into the accumulators from
    /// `c_base`; the first call also prefetches `pf`.
    #[allow(clippy::too_many_arguments)]
    fn token_tiles(
        &self,
        t: &AmxTiles,
        acc: &mut AmxAcc<'_>,
        j: usize,
        b: [&[u8]; 2],
        nt: usize,
        kt: usize,
        c_base: usize,
        accumulate: bool,
        pf: [&[u8]; 2],
    ) {
        let mut m0 = 0;
        while m0 < self.n_pad {
            let mt = ((self.n_pad - m0) / AMX_TILE_M).min(2);
            let blk = AmxBlock {
                a: &self.a[m0 * self.row_bytes + j * AMX_ROW_BYTES..],
                a_stride: self.row_bytes,
                mt,
                b,
                b_step: AMX_TILE_BYTES,
                nt,
                kt,
                c_off: c_base + m0 * NR,
                c_pstride: self.n_pad * NR,
                accumulate,
                prefetch: if m0 == 0 { pf } else { [&[], &[]] },
            };
            match acc {
                AmxAcc::I32(c, _) => t.i8(&blk, c),
                AmxAcc::F32(c) => t.bf16(&blk, c),
            }
            m0 += mt * AMX_TILE_M;
        }
    }
}
