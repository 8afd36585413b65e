//! The work items of [`PackedExperts`]' `execute` and what one of them
//! runs: [`build_items`] splits each active expert's panels into [`Item`]s
//! for the pool, and [`run_panels`] runs one item's panels over the
//! expert's rows on the kernel tier's tiles, handing each panel's 16
//! channels per row to the phase's epilogue. Per expert, as many tokens as
//! one tile holds take the decode path (the whole `K` per panel), more take
//! a prefill path: `K` blocks kept in L1, the two-panel tile over a packed
//! stream ([`run_pairs_f32`]), the BFMMLA tile over packed bf16 activations
//! ([`run_bf16mm`]), or the AMX tiles (planned in `kernels/amx_plan.rs`;
//! f32 activations enter them as three exact bf16 terms).
//!
//! [`PackedExperts`]: super::PackedExperts

use std::cell::RefCell;

use crate::kernels::amx_plan::run_panels_amx;
use crate::kernels::b12::{B12_MR, B12Panels};
use crate::kernels::dispatch::{Kernels, MAX_MR};
use crate::kernels::layout::{
    BF16_MM_KC, BF16_PAIR_KC, DataView, I8_GROUP_BYTES, KG, NR, Src, as_row, bf16_bits_to_f32,
    bf16_padded_k, dequant, i8_padded_k, mm_padded_k, pack_mm_bf16, pack_pairs_b16, pack_pairs_f32,
};

/// `k` per block on the bf16 prefill path (a 16 KiB panel chunk).
const KC_BF16: usize = 512;
/// int8 groups per block on the int8 prefill path (a 16 KiB panel chunk).
const KC_I8_GROUPS: usize = 128;
/// Fewest rows that run on AMX tiles (where the CPU has them) rather than
/// the SIMD dot tiles. A 16-row `A` tile costs the same for 2 rows as for
/// 16, and `tdpbf16ps` / `tdpbssd` retire so many multiply-adds per weight
/// byte that even 2 rows stay bound by memory, while the dot tiles
/// (`vdpbf16ps`, `vpdpbusd`: one instruction per row per 64 weight bytes)
/// fall behind the stream from about 4 rows up. Measured with `epserve
/// bench moe` at the Qwen3-30B-A3B shape on a 2-vCPU AMX Xeon: bf16 at 128
/// tokens (8 per expert) 65 → 46 ms, at 160 tokens 87 → 46 ms; int8 31 →
/// 25 ms; 4-8 decode tokens 10-15 % faster. One row stays on the dot tile
/// (10 % faster there).
const AMX_MIN_ROWS: usize = 2;
/// Work items per thread and phase (load balance vs. scheduling overhead).
const ITEMS_PER_THREAD: usize = 4;

/// One work item: panels `p0..p1` of expert `e`'s matrix.
#[derive(Clone, Copy)]
pub(crate) struct Item {
    pub(crate) e: u32,
    pub(crate) p0: u32,
    pub(crate) p1: u32,
}

impl Item {
    /// The item's panels.
    fn panels(&self) -> std::ops::Range<usize> {
        self.p0 as usize..self.p1 as usize
    }
}

thread_local! {
    static ACC_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static ACC_I32: RefCell<Vec<i32>> = const { RefCell::new(Vec::new()) };
    /// Two-panel prefill path: the packed activation stream and the two
    /// panels' accumulators.
    static PAIRS_F32: RefCell<(Vec<f32>, Vec<f32>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
    /// Two-panel bf16 dot prefill path: the packed bf16 activation stream
    /// and both panels' accumulators.
    static PAIRS_B16: RefCell<(Vec<u16>, Vec<f32>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
    /// BFMMLA prefill path: the packed bf16 activation stream and the
    /// accumulators.
    static MM_BF16: RefCell<(Vec<u16>, Vec<f32>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
    /// bf16 activations on a widening FMA path: the rows rounded to bf16,
    /// widened back to f32 (see [`run_panels`]).
    static ROUNDED_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// B12 prefill path: a run of decoded bf16 panels and the rows' packed
    /// two-panel streams (f32 and bf16 activations).
    static B12_SCRATCH: RefCell<(Vec<u16>, Vec<f32>, Vec<u16>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Splits each active expert's `panels(e)` into runs so that every thread
/// gets about [`ITEMS_PER_THREAD`] items.
pub(super) fn build_items(
    items: &mut Vec<Item>,
    active: &[u32],
    threads: usize,
    panels: impl Fn(usize) -> usize,
) {
    items.clear();
    let total: usize = active.iter().map(|&e| panels(e as usize)).sum();
    let chunk = total.div_ceil(threads.max(1) * ITEMS_PER_THREAD).max(1);
    for &e in active {
        let n = panels(e as usize);
        let mut p = 0;
        while p < n {
            let p1 = (p + chunk).min(n);
            items.push(Item {
                e,
                p0: p as u32,
                p1: p1 as u32,
            });
            p = p1;
        }
    }
}

/// Runs panels `it.p0..it.p1` of one matrix over the expert's `n` rows
/// (`row(i)` is row `i`'s index in `src`) and hands each panel's results to
/// `epi(i, panel, val)` where `val[c]` is row `i`'s dequantized channel `c`.
///
/// B12 panels ([`crate::kernels::b12`]): up to [`b12_direct_rows`] rows
/// (decode) run the B12 tile, which decodes the weights in registers (bf16
/// activations: on the rows rounded to bf16); more rows (prefill) decode
/// runs of the item's panels into a scratch of bf16 panels (kept in L2) that
/// the bf16 paths below then run as they run any bf16 panels (the bf16 dot
/// tiles with bf16 activations).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_panels(
    k: &Kernels,
    bf16x: bool,
    data: &DataView<'_>,
    kdim: usize,
    n: usize,
    it: &Item,
    row: &dyn Fn(usize) -> usize,
    src: &Src<'_>,
    epi: impl FnMut(usize, usize, &[f32; NR]),
) {
    match *data {
        DataView::B12(b) => run_b12(k, bf16x, b, kdim, n, it, row, src, epi),
        _ => run_plain(k, bf16x, data, kdim, n, it, row, src, epi),
    }
}

/// Most rows of f32 activations that run on the B12 tile, in balanced
/// token chunks of up to the tier's `b12_mr` (the chunks after the first
/// find the panel in L1/L2); more are prefill, on the decoded panels. 24 on
/// AVX-512 (8-row tiles): on the 2-vCPU AMD EPYC `bench linear` ran 16 and
/// 24 rows at 1.06-1.12x of the bf16 panels this way, 0.81-0.86x through
/// the scratch (2026-12-06).
pub(crate) fn b12_direct_rows(k: &Kernels) -> usize {
    3 * k.b12_mr()
}

/// Most rows of bf16 activations that run on the B12 dot tile (where it is
/// fast, [`b12x_dot`]), in balanced chunks of up to `B12_MR`;
/// more decode runs of panels into the scratch for the bf16 dot tiles. On
/// the 2-vCPU AMD EPYC (Zen 4) `bench step --expert-dtype bf16 --dense-dtype
/// bf16` ran 128-token prefill the same at 8, 12, 16 and 24 (244-256 ms) and
/// 1-8-sequence decode 1.15-1.27x faster than on bf16 panels (2026-12-06).
pub(crate) const fn b12x_direct_rows() -> usize {
    2 * B12_MR
}

/// Whether `n` rows run on B12 panels in place (the B12 tiles, which decode
/// in registers), not on panels decoded into a scratch: up to
/// [`b12_direct_rows`] rows, with bf16 activations on the B12 dot tile up to
/// [`b12x_direct_rows`].
pub(crate) fn b12_direct(k: &Kernels, bf16x: bool, n: usize) -> bool {
    if bf16x && b12x_dot(k) {
        n <= b12x_direct_rows()
    } else {
        n <= b12_direct_rows(k)
    }
}

/// Whether bf16 activations on B12 panels take the B12 dot tile (up to
/// [`b12x_direct_rows`] rows): where the tier has one and its bf16 dot
/// out-runs the FMA tiles ([`Kernels::bf16x_prefill`], AMD Zen 4). Elsewhere
/// the rows are rounded to bf16 for the B12 FMA tile: on the 2-vCPU Xeon
/// without AMX (`bench step --expert-dtype bf16 --dense-dtype bf16`,
/// 2026-12-06) prefill of 128 tokens ran 348-353 ms that way against
/// 415-493 ms on the dot tile, 8-sequence decode steps 63.6-64.9 ms against
/// 65.3-77.0 ms, 1-sequence decode the same.
fn b12x_dot(k: &Kernels) -> bool {
    k.b12x_native() && k.bf16x_prefill()
}

/// Bytes of decoded bf16 panels per run of the B12 prefill path (the run
/// stays in L2 while the bf16 tiles read it).
const B12_SCRATCH_BYTES: usize = 256 << 10;

/// [`run_panels`] on B12 panels.
#[allow(clippy::too_many_arguments)]
fn run_b12(
    k: &Kernels,
    bf16x: bool,
    b: &B12Panels,
    kdim: usize,
    n: usize,
    it: &Item,
    row: &dyn Fn(usize) -> usize,
    src: &Src<'_>,
    mut epi: impl FnMut(usize, usize, &[f32; NR]),
) {
    // bf16 activations on the decode path: the B12 dot tile where the tier
    // has a fast one (the panel decoded in registers into `vdpbf16ps`), else the
    // B12 tile on the rows rounded to bf16 and widened back (every product
    // exact in f32, as the dot tile's): decode streams B12's 0.75x bytes
    // under bf16 activations too.
    if bf16x && b12x_dot(k) && b12_direct(k, bf16x, n) {
        let kp = bf16_padded_k(kdim);
        return ACC_F32.with_borrow_mut(|acc| {
            acc.resize(n * NR, 0.0);
            let chunk = n.div_ceil(n.div_ceil(B12_MR));
            for p in it.panels() {
                acc.fill(0.0);
                let panel = b.panel(p);
                let mut t0 = 0;
                while t0 < n {
                    let tn = chunk.min(n - t0);
                    let mut rows: [&[u16]; B12_MR] = [&[]; B12_MR];
                    for (i, r) in rows.iter_mut().enumerate().take(tn) {
                        let base = row(t0 + i) * src.b16_stride;
                        *r = &src.b16_rows[base..base + kp];
                    }
                    k.b12x_tile(&panel, &rows[..tn], &mut acc[t0 * NR..(t0 + tn) * NR]);
                    t0 += tn;
                }
                for i in 0..n {
                    epi(i, p, as_row(&acc[i * NR..(i + 1) * NR]));
                }
            }
        });
    }
    if bf16x && b12_direct(k, bf16x, n) {
        return with_rounded_rows(kdim, n, row, src, |rounded| {
            run_b12(k, false, b, kdim, n, it, &|i| i, rounded, epi)
        });
    }
    if b12_direct(k, bf16x, n) {
        return ACC_F32.with_borrow_mut(|acc| {
            acc.resize(n * NR, 0.0);
            for p in it.panels() {
                acc.fill(0.0);
                let panel = b.panel(p);
                let chunk = n.div_ceil(n.div_ceil(k.b12_mr()));
                let mut t0 = 0;
                while t0 < n {
                    let tn = chunk.min(n - t0);
                    let mut rows: [&[f32]; B12_MR] = [&[]; B12_MR];
                    for (i, r) in rows.iter_mut().enumerate().take(tn) {
                        let base = row(t0 + i) * src.f32_stride;
                        *r = &src.f32_rows[base..base + kdim];
                    }
                    k.b12_tile(&panel, &rows[..tn], &mut acc[t0 * NR..(t0 + tn) * NR]);
                    t0 += tn;
                }
                for i in 0..n {
                    epi(i, p, as_row(&acc[i * NR..(i + 1) * NR]));
                }
            }
        });
    }
    // bf16 activations that the decoded panels' tiles would read rounded
    // (`run_plain`): rounded once here, not once per run of panels (on the
    // 2-vCPU Xeon without AMX, prefill of 512 tokens with bf16 activations
    // spent half its time re-rounding and re-packing rows per run).
    if bf16x && rounds_bf16_rows(k, n) {
        return with_rounded_rows(kdim, n, row, src, |rounded| {
            run_b12(k, false, b, kdim, n, it, &|i| i, rounded, epi)
        });
    }
    let pw = bf16_padded_k(kdim) * NR;
    // Runs of whole panel pairs (the two-panel tiles take panels in pairs).
    let run = (B12_SCRATCH_BYTES / (2 * pw).max(1)).max(2) & !1;
    B12_SCRATCH.with_borrow_mut(|(w, xp, xb)| {
        // The rows packed once for all runs where they take a two-panel
        // tile and the caller did not pack them.
        let mut src = Src { ..*src };
        if !bf16x && src.f32_packed.is_empty() && takes_pairs_f32(k, &DataView::Bf16(&[]), n) {
            pack_pairs_f32_stream(k, kdim, n, row, &src, xp);
            src.f32_packed = xp;
        }
        if bf16x && src.b16_packed.is_empty() && takes_pairs_b16(k, &DataView::Bf16(&[]), n) {
            pack_pairs_b16_stream(k, kdim, n, row, &src, xb);
            src.b16_packed = xb;
        }
        w.resize(run.min(it.panels().len()) * pw, 0);
        let mut p0 = it.p0 as usize;
        while p0 < it.p1 as usize {
            let p1 = (p0 + run).min(it.p1 as usize);
            for (i, p) in (p0..p1).enumerate() {
                k.b12_decode(&b.panel(p), &mut w[i * pw..(i + 1) * pw]);
            }
            let sub = Item {
                e: it.e,
                p0: 0,
                p1: (p1 - p0) as u32,
            };
            let view = DataView::Bf16(&w[..(p1 - p0) * pw]);
            // The two-panel tiles hint the next run's encoded panels into L2
            // while they compute this one (their own hints would be wasted on
            // the decoded run, already in L2).
            let p2 = (p1 + run).min(it.p1 as usize);
            if p2 > p1 {
                crate::kernels::set_pair_l2_target(Some(b.panels_bytes(p1, p2)));
            }
            run_plain(k, bf16x, &view, kdim, n, &sub, row, &src, |i, p, v| {
                epi(i, p0 + p, v)
            });
            crate::kernels::set_pair_l2_target(None);
            p0 = p1;
        }
    })
}

/// Runs `f` on a copy of `src` whose f32 rows are rows `row(0..n)`'s bf16
/// copies widened back (row `i` at `i · kdim`): bf16 activations on a path
/// that reads f32 rows, with the values the bf16 tiles would read.
fn with_rounded_rows<R>(
    kdim: usize,
    n: usize,
    row: &dyn Fn(usize) -> usize,
    src: &Src<'_>,
    f: impl FnOnce(&Src<'_>) -> R,
) -> R {
    ROUNDED_F32.with_borrow_mut(|buf| {
        buf.clear();
        buf.reserve(n * kdim);
        for i in 0..n {
            let base = row(i) * src.b16_stride;
            let r = &src.b16_rows[base..base + kdim];
            buf.extend(r.iter().map(|&b| bf16_bits_to_f32(b)));
        }
        let rounded = Src {
            f32_rows: buf,
            f32_stride: kdim,
            f32_packed: &[],
            b16_packed: &[],
            ..*src
        };
        f(&rounded)
    })
}

/// Whether `n` rows of bf16 activations on bf16 panels run on the widening
/// FMA tiles, on the rows rounded to bf16 and widened back: more rows than a
/// dot tile takes, and no bf16 prefill tile (AMX, BFMMLA, the dot prefill
/// tile) for them.
fn rounds_bf16_rows(k: &Kernels, n: usize) -> bool {
    n > k.bf16x_mr().unwrap_or(usize::MAX)
        && !(k.amx() && n >= AMX_MIN_ROWS)
        && k.bf16mm_mr().is_none()
        && !k.bf16x_prefill()
}

/// [`run_panels`] on bf16 and int8 panels.
#[allow(clippy::too_many_arguments)]
fn run_plain(
    k: &Kernels,
    bf16x: bool,
    data: &DataView<'_>,
    kdim: usize,
    n: usize,
    it: &Item,
    row: &dyn Fn(usize) -> usize,
    src: &Src<'_>,
    mut epi: impl FnMut(usize, usize, &[f32; NR]),
) {
    // bf16 activations on more rows than a dot tile takes, where no bf16
    // prefill tile runs them (AMX, BFMMLA, the dot prefill tile): the
    // widening FMA tiles read the rows rounded to bf16, so every row of a
    // call, in any batch, sees the same activations (before, such blocks
    // read the f32 rows while the rows of small blocks were rounded).
    if bf16x && matches!(data, DataView::Bf16(_)) && rounds_bf16_rows(k, n) {
        return with_rounded_rows(kdim, n, row, src, |rounded| {
            run_plain(k, false, data, kdim, n, it, &|i| i, rounded, epi)
        });
    }
    match *data {
        DataView::B12(_) => unreachable!("run_panels decodes B12 panels first"),
        // Two rows or more on AMX tiles: bf16 activations with bf16 weights,
        // and int8.
        DataView::Bf16(_) if bf16x && k.amx() && n >= AMX_MIN_ROWS => {
            run_panels_amx(k, data, kdim, n, it.panels(), row, src, false, epi)
        }
        DataView::I8 { .. } if k.amx() && n >= AMX_MIN_ROWS => {
            run_panels_amx(k, data, kdim, n, it.panels(), row, src, false, epi)
        }
        // f32 activations on AMX tiles, each row as three bf16 terms: on a
        // 2-vCPU AMX Xeon (`epserve bench step`, the bench model) prefill of
        // 128 tokens went 332 → 286 ms, of 512 tokens 1002 → 772 ms, 8-token
        // decode steps unchanged.
        DataView::Bf16(_) if !bf16x && k.amx() && n >= AMX_MIN_ROWS => {
            run_panels_amx(k, data, kdim, n, it.panels(), row, src, true, epi)
        }
        // bf16 activations: the dot-product tile on the decode path. On the
        // prefill path the two-panel dot tile where the CPU runs it faster
        // than the FMA tile (`Kernels::bf16x_prefill`: AMD Zen 4+, below);
        // elsewhere the widening f32 FMA tile on the rounded rows (above):
        // measured on Sapphire-Rapids class x86,
        // `vdpbf16ps` retires at half the FLOP rate of zmm FMA, so it only
        // pays where weights stream (decode).
        DataView::Bf16(w) if bf16x && n <= k.bf16x_mr().unwrap_or(0) => {
            ACC_F32.with_borrow_mut(|acc| {
                acc.resize(n * NR, 0.0);
                let kp = bf16_padded_k(kdim);
                let step = kp.max(2);
                let mr = n.max(1);
                let panel_len = kp * NR;
                for p in it.p0 as usize..it.p1 as usize {
                    acc.fill(0.0);
                    let panel = &w[p * panel_len..(p + 1) * panel_len];
                    let mut k0 = 0;
                    while k0 < kp {
                        let kc = step.min(kp - k0);
                        let wc = &panel[k0 * NR..(k0 + kc) * NR];
                        let mut t0 = 0;
                        while t0 < n {
                            let tn = mr.min(n - t0);
                            let mut rows: [&[u16]; MAX_MR] = [&[]; MAX_MR];
                            for (i, r) in rows.iter_mut().enumerate().take(tn) {
                                let base = row(t0 + i) * src.b16_stride + k0;
                                *r = &src.b16_rows[base..base + kc];
                            }
                            k.bf16x_tile(wc, &rows[..tn], &mut acc[t0 * NR..(t0 + tn) * NR]);
                            t0 += tn;
                        }
                        k0 += kc;
                    }
                    for i in 0..n {
                        let a = &acc[i * NR..(i + 1) * NR];
                        epi(i, p, as_row(a));
                    }
                }
            })
        }
        // Prefill with bf16 activations on tiers with a BFMMLA tile (aarch64
        // `neon-bf16`): twice BFDOT's multiply-adds per instruction.
        DataView::Bf16(w) if bf16x && n > k.bf16x_mr().unwrap_or(0) && k.bf16mm_mr().is_some() => {
            run_bf16mm(k, w, kdim, n, it, row, src, epi)
        }
        // Prefill with bf16 activations on the two-panel bf16 dot tile, where
        // it out-runs the FMA tile (AMD Zen 4+; see BENCHMARKS.md, `bench moe`).
        DataView::Bf16(w) if bf16x && n > k.bf16x_mr().unwrap_or(0) && k.bf16x_prefill() => {
            run_pairs_b16(k, w, kdim, n, it, row, src, epi)
        }
        // Prefill on tiers with a two-panel tile.
        DataView::Bf16(w) if takes_pairs_f32(k, data, n) => {
            run_pairs_f32(k, w, kdim, n, it, row, src, epi)
        }
        DataView::Bf16(w) => ACC_F32.with_borrow_mut(|acc| {
            acc.resize(n * NR, 0.0);
            let mr = k.bf16_mr();
            // Decode: one tile and the whole K; prefill: K blocks kept in L1.
            let step = if n <= mr { kdim.max(1) } else { KC_BF16 };
            let panel_len = bf16_padded_k(kdim) * NR;
            for p in it.p0 as usize..it.p1 as usize {
                acc.fill(0.0);
                let panel = &w[p * panel_len..(p + 1) * panel_len];
                let mut k0 = 0;
                while k0 < kdim {
                    let kc = step.min(kdim - k0);
                    let wc = &panel[k0 * NR..(k0 + bf16_padded_k(kc)) * NR];
                    let mut t0 = 0;
                    while t0 < n {
                        let tn = mr.min(n - t0);
                        let mut rows: [&[f32]; MAX_MR] = [&[]; MAX_MR];
                        for (i, r) in rows.iter_mut().enumerate().take(tn) {
                            let base = row(t0 + i) * src.f32_stride + k0;
                            *r = &src.f32_rows[base..base + kc];
                        }
                        k.bf16_tile(wc, kc, &rows[..tn], &mut acc[t0 * NR..(t0 + tn) * NR]);
                        t0 += tn;
                    }
                    k0 += kc;
                }
                for i in 0..n {
                    let a = &acc[i * NR..(i + 1) * NR];
                    epi(i, p, as_row(a));
                }
            }
        }),
        DataView::I8 { data: w, scales } => ACC_I32.with_borrow_mut(|acc| {
            acc.resize(n * NR, 0);
            let mr = k.i8_mr();
            let groups = i8_padded_k(kdim) / KG;
            let step = if n <= mr { groups.max(1) } else { KC_I8_GROUPS };
            let panel_len = groups * I8_GROUP_BYTES;
            for p in it.p0 as usize..it.p1 as usize {
                acc.fill(0);
                let panel = &w[p * panel_len..(p + 1) * panel_len];
                let mut g0 = 0;
                while g0 < groups {
                    let gc = step.min(groups - g0);
                    let wc = &panel[g0 * I8_GROUP_BYTES..(g0 + gc) * I8_GROUP_BYTES];
                    let mut t0 = 0;
                    while t0 < n {
                        let tn = mr.min(n - t0);
                        let mut rows: [&[i8]; MAX_MR] = [&[]; MAX_MR];
                        for (i, r) in rows.iter_mut().enumerate().take(tn) {
                            let base = row(t0 + i) * src.i8_stride + g0 * KG;
                            *r = &src.i8_rows[base..base + gc * KG];
                        }
                        k.i8_tile(wc, &rows[..tn], &mut acc[t0 * NR..(t0 + tn) * NR]);
                        t0 += tn;
                    }
                    g0 += gc;
                }
                let ws = &scales[p * NR..(p + 1) * NR];
                for i in 0..n {
                    let xs = src.i8_scales[row(i)];
                    let a = &acc[i * NR..(i + 1) * NR];
                    epi(i, p, &dequant(a, ws, xs));
                }
            }
        }),
    }
}

/// The prefill path of bf16 experts with bf16 activations on tiers with a
/// BFMMLA tile: the expert's rows are packed once per work item into the
/// tile's stream (token tiles of equal, even size: BFMMLA takes rows in
/// pairs; each K block contiguous, k-quads zero-padded), then every panel
/// runs over K blocks of [`BF16_MM_KC`] (the panel chunk and one packed
/// tile stay in L1) and token tiles.
#[allow(clippy::too_many_arguments)]
fn run_bf16mm(
    k: &Kernels,
    w: &[u16],
    kdim: usize,
    n: usize,
    it: &Item,
    row: &dyn Fn(usize) -> usize,
    src: &Src<'_>,
    mut epi: impl FnMut(usize, usize, &[f32; NR]),
) {
    let mr = k.bf16mm_mr().unwrap_or(MAX_MR);
    // Token tiles of equal, even size (10 tokens: 6 + 4, not 8 + 2).
    let tn_max = n.div_ceil(n.div_ceil(mr)).next_multiple_of(2).min(mr);
    let kp = bf16_padded_k(kdim);
    // Every tile but the last has `tn_max` (even) rows: the tile at `t0`
    // starts `t0 · kq` values in, its K block at `k0` (whole quads before
    // it) `k0 · 2⌈tn/2⌉` values further.
    let kq = mm_padded_k(kp);
    let panel_len = kp * NR;
    MM_BF16.with_borrow_mut(|(xa, acc)| {
        xa.clear();
        let mut t0 = 0;
        while t0 < n {
            let tn = tn_max.min(n - t0);
            let mut rows: [&[u16]; MAX_MR] = [&[]; MAX_MR];
            for (i, r) in rows.iter_mut().enumerate().take(tn) {
                let base = row(t0 + i) * src.b16_stride;
                *r = &src.b16_rows[base..base + kp];
            }
            let mut k0 = 0;
            while k0 < kp {
                let kc = BF16_MM_KC.min(kp - k0);
                pack_mm_bf16(&rows[..tn], k0, kc, xa);
                k0 += kc;
            }
            t0 += tn;
        }
        acc.resize(n * NR, 0.0);
        for p in it.panels() {
            acc.fill(0.0);
            let panel = &w[p * panel_len..(p + 1) * panel_len];
            let mut k0 = 0;
            while k0 < kp {
                let kc = BF16_MM_KC.min(kp - k0);
                let wc = &panel[k0 * NR..(k0 + kc) * NR];
                let mut t0 = 0;
                while t0 < n {
                    let tn = tn_max.min(n - t0);
                    let off = t0 * kq + k0 * tn.div_ceil(2) * 2;
                    k.bf16mm_tile(wc, tn, &xa[off..], &mut acc[t0 * NR..(t0 + tn) * NR]);
                    t0 += tn;
                }
                k0 += kc;
            }
            for i in 0..n {
                epi(i, p, as_row(&acc[i * NR..(i + 1) * NR]));
            }
        }
    })
}

/// The prefill path of bf16 experts with f32 activations on tiers with a
/// two-panel tile: the expert's rows are packed once per work item into
/// the tile's stream (token tiles of equal size, each K block contiguous),
/// then every panel pair runs over K blocks of [`BF16_PAIR_KC`] (two panel
/// chunks and one packed tile stay in L1).
/// The prefill path on a two-panel tile (f32 activations, or bf16 ones on
/// the bf16 dot tile): each expert row's activations packed once per work
/// item into one stream of token tiles (K blocks of [`BF16_PAIR_KC`],
/// [`pack_pairs_f32`] / [`pack_pairs_b16`]), then every pair of panels runs
/// over K blocks and token tiles.
#[allow(clippy::too_many_arguments)]
fn run_pairs_f32(
    k: &Kernels,
    w: &[u16],
    kdim: usize,
    n: usize,
    it: &Item,
    row: &dyn Fn(usize) -> usize,
    src: &Src<'_>,
    epi: impl FnMut(usize, usize, &[f32; NR]),
) {
    // Tiers without a two-panel tile run its twin (up to `MAX_MR` rows).
    let mr = k.bf16_pair_mr().unwrap_or(MAX_MR);
    PAIRS_F32.with_borrow_mut(|(xp, acc)| {
        let tile = |w: [&[u16]; 2], kc: usize, tn: usize, x: &[f32], a: [&mut [f32]; 2]| {
            k.bf16_pair_tile(w, kc, tn, x, a)
        };
        // The caller's stream when it packed the rows once for all its items.
        let stream: &[f32] = if src.f32_packed.is_empty() {
            pack_pairs_f32_stream(k, kdim, n, row, src, xp);
            xp
        } else {
            debug_assert_eq!(src.f32_packed.len(), n * bf16_padded_k(kdim));
            src.f32_packed
        };
        run_pairs(w, kdim, n, mr, it, stream, tile, acc, epi)
    })
}

/// Whether [`run_panels`] runs `n` rows of `data` with f32 activations
/// (`bf16x` false) on the two-panel tile, reading the stream that
/// [`pack_pairs_f32_stream`] packs.
pub(crate) fn takes_pairs_f32(k: &Kernels, data: &DataView<'_>, n: usize) -> bool {
    (matches!(data, DataView::Bf16(_))
        || matches!(data, DataView::B12(_)) && !b12_direct(k, false, n))
        && !(k.amx() && n >= AMX_MIN_ROWS)
        && n > k.bf16_mr()
        && k.bf16_pair_mr().is_some()
}

/// Packs rows `row(0..n)` of `src`'s f32 rows (`kdim` values each) into the
/// stream the two-panel tile reads, for a caller that runs several items
/// over the same rows (`Src::f32_packed`): each item then skips its own
/// packing of all the rows.
pub(crate) fn pack_pairs_f32_stream(
    k: &Kernels,
    kdim: usize,
    n: usize,
    row: &dyn Fn(usize) -> usize,
    src: &Src<'_>,
    xp: &mut Vec<f32>,
) {
    // Tiers without a two-panel tile run its twin (up to `MAX_MR` rows).
    let mr = k.bf16_pair_mr().unwrap_or(MAX_MR);
    let rows = |i: usize| {
        let base = i * src.f32_stride;
        &src.f32_rows[base..base + kdim]
    };
    pack_stream(kdim, n, mr, row, rows, pack_pairs_f32, xp);
}

/// [`run_pairs_f32`] over the rows' bf16 copies on the two-panel bf16 dot
/// tile (each pair of `k`s one 32-bit word of the stream; the copies are
/// zero-padded to whole pairs, so every K block is whole pairs).
#[allow(clippy::too_many_arguments)]
fn run_pairs_b16(
    k: &Kernels,
    w: &[u16],
    kdim: usize,
    n: usize,
    it: &Item,
    row: &dyn Fn(usize) -> usize,
    src: &Src<'_>,
    epi: impl FnMut(usize, usize, &[f32; NR]),
) {
    let mr = k.bf16x_pair_mr().unwrap_or(MAX_MR);
    let kp = bf16_padded_k(kdim);
    let rows = |i: usize| {
        let base = i * src.b16_stride;
        &src.b16_rows[base..base + kp]
    };
    PAIRS_B16.with_borrow_mut(|(xp, acc)| {
        let tile = |w: [&[u16]; 2], _kc: usize, tn: usize, x: &[u16], a: [&mut [f32]; 2]| {
            k.bf16x_pair_tile(w, tn, x, a)
        };
        // The caller's stream when it packed the rows once for all its items.
        let stream: &[u16] = if src.b16_packed.is_empty() {
            pack_stream(kp, n, mr, row, rows, pack_pairs_b16, xp);
            xp
        } else {
            debug_assert_eq!(src.b16_packed.len(), n * kp);
            src.b16_packed
        };
        run_pairs(w, kp, n, mr, it, stream, tile, acc, epi)
    })
}

/// Whether [`run_panels`] runs `n` rows of bf16 panels with bf16
/// activations on the two-panel bf16 dot tile, reading the stream that
/// [`pack_pairs_b16_stream`] packs (the order of `run_plain`'s cases).
pub(crate) fn takes_pairs_b16(k: &Kernels, data: &DataView<'_>, n: usize) -> bool {
    (matches!(data, DataView::Bf16(_))
        || matches!(data, DataView::B12(_)) && !b12_direct(k, true, n))
        && n > k.bf16x_mr().unwrap_or(usize::MAX)
        && !(k.amx() && n >= AMX_MIN_ROWS)
        && k.bf16mm_mr().is_none()
        && k.bf16x_prefill()
}

/// Packs rows `row(0..n)` of `src`'s bf16 copies into the stream the
/// two-panel bf16 dot tile reads, for a caller that runs several items over
/// the same rows (`Src::b16_packed`).
pub(crate) fn pack_pairs_b16_stream(
    k: &Kernels,
    kdim: usize,
    n: usize,
    row: &dyn Fn(usize) -> usize,
    src: &Src<'_>,
    xp: &mut Vec<u16>,
) {
    let mr = k.bf16x_pair_mr().unwrap_or(MAX_MR);
    let kp = bf16_padded_k(kdim);
    let rows = |i: usize| {
        let base = i * src.b16_stride;
        &src.b16_rows[base..base + kp]
    };
    pack_stream(kp, n, mr, row, rows, pack_pairs_b16, xp);
}

/// Rows per token tile of the two-panel paths: tiles of equal size (16
/// tokens: 8 + 8, not 12 + 4).
fn pair_tile_rows(n: usize, mr: usize) -> usize {
    n.div_ceil(n.div_ceil(mr))
}

/// Packs the two-panel paths' activation stream into `xp`: `kext` is how
/// many `k`s each row holds (the real `K` for f32 rows, `K` padded to pairs
/// for bf16 copies), `rows(i)` source row `i`, and `pack` appends a K block
/// of a token tile. The tile at token `t0` (`tn` rows) holds `tn · kp`
/// values from `t0 · kp`; its K block at `k0` starts `k0 · tn` values in.
fn pack_stream<'a, T: Copy + 'a>(
    kext: usize,
    n: usize,
    mr: usize,
    row: &dyn Fn(usize) -> usize,
    rows: impl Fn(usize) -> &'a [T],
    pack: fn(&[&[T]], usize, usize, &mut Vec<T>),
    xp: &mut Vec<T>,
) {
    let tn_max = pair_tile_rows(n, mr);
    xp.clear();
    let mut t0 = 0;
    while t0 < n {
        let tn = tn_max.min(n - t0);
        let mut tile_rows: [&[T]; MAX_MR] = [&[]; MAX_MR];
        for (i, r) in tile_rows.iter_mut().enumerate().take(tn) {
            *r = rows(row(t0 + i));
        }
        let mut k0 = 0;
        while k0 < kext {
            let kc = BF16_PAIR_KC.min(kext - k0);
            pack(&tile_rows[..tn], k0, kc, xp);
            k0 += kc;
        }
        t0 += tn;
    }
}

/// The loop both two-panel paths share, over the stream `xp` that
/// [`pack_stream`] packed: `tile(panels, kc, tn, stream, accs)` runs one
/// tile.
#[allow(clippy::too_many_arguments)]
fn run_pairs<T: Copy>(
    w: &[u16],
    kext: usize,
    n: usize,
    mr: usize,
    it: &Item,
    xp: &[T],
    tile: impl Fn([&[u16]; 2], usize, usize, &[T], [&mut [f32]; 2]),
    acc: &mut Vec<f32>,
    mut epi: impl FnMut(usize, usize, &[f32; NR]),
) {
    let tn_max = pair_tile_rows(n, mr);
    let kp = bf16_padded_k(kext);
    let panel_len = kp * NR;
    acc.resize(2 * n * NR, 0.0);
    let (p0, p1) = (it.p0 as usize, it.p1 as usize);
    let mut p = p0;
    while p < p1 {
        // An odd last panel runs as a pair with itself (one result kept).
        let q = if p + 1 < p1 { p + 1 } else { p };
        acc.fill(0.0);
        let (acc0, acc1) = acc.split_at_mut(n * NR);
        let mut k0 = 0;
        while k0 < kext {
            let kc = BF16_PAIR_KC.min(kext - k0);
            let len = bf16_padded_k(kc) * NR;
            let chunk = |j: usize| &w[j * panel_len + k0 * NR..][..len];
            let mut t0 = 0;
            while t0 < n {
                let tn = tn_max.min(n - t0);
                let span = t0 * NR..(t0 + tn) * NR;
                tile(
                    [chunk(p), chunk(q)],
                    kc,
                    tn,
                    &xp[t0 * kp + k0 * tn..],
                    [&mut acc0[span.clone()], &mut acc1[span]],
                );
                t0 += tn;
            }
            k0 += kc;
        }
        for i in 0..n {
            epi(i, p, as_row(&acc0[i * NR..(i + 1) * NR]));
        }
        if q != p {
            for i in 0..n {
                epi(i, q, as_row(&acc1[i * NR..(i + 1) * NR]));
            }
        }
        p = q + 1;
    }
}
