//! [`PackedExperts`]: the fast [`ExpertExecutor`]. One `execute` call:
//!
//! 1. buckets the `(token, slot)` pairs by expert (counting sort: ascending
//!    expert, token order within an expert);
//! 2. quantizes each token's activations once (per-token int8 scale) if any
//!    routed expert is int8;
//! 3. **gate/up phase**: every (expert, run of gate/up panels) is a work item
//!    on the pinned pool; each panel yields `act(gate)·up` for eight columns
//!    of the expert's hidden activations `h` (fused: one pass over the
//!    weights);
//! 4. quantizes `h` per row for int8 experts;
//! 5. **down phase**: every (expert, run of down panels) is a work item; the
//!    epilogue multiplies by the slot's combine weight and writes straight
//!    into the slot's output row (the weighted scatter).
//!
//! Experts loaded with bf16 activations (`--expert-dtype bf16`) get their
//! inputs rounded to bf16 once per row (step 2 and 4) and run the tier's bf16
//! dot-product tile (`vdpbf16ps`, `bfdot`) on the decode path.
//!
//! Per expert, a token count no larger than the kernel's tile (`mr`) takes the
//! *decode* path (one tile, the whole `K` per panel: weights stream once,
//! bandwidth bound); more tokens take the *prefill* path (the panel is cut in
//! `K` blocks that stay in L1 while every token tile passes over them).
//! Buffers live in a reused workspace and per-thread scratch: after the first
//! call of a given size the hot path does not allocate.
//!
//! This file is the driver: [`PackedExperts`], its workspace, the phases and
//! their epilogues. The work items and the tiles they run on are in
//! `experts/run.rs` (the AMX tile planning in `kernels/amx_plan.rs`);
//! loading from a checkpoint is in `experts/load.rs`.

use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use crate::config::Activation;
use crate::error::{Error, Result};
use crate::experts::packed::{PackedDtype, PackedExpert};
use crate::experts::pool::ExpertPool;
use crate::experts::run::{Item, build_items, run_panels};
use crate::kernels::dispatch::{Kernels, kernels};
use crate::kernels::layout::{
    NR, Src, bf16_padded_k, f32_to_bf16_bits, i8_padded_k, quantize_row_i8,
};
use crate::mem::Out;
use crate::moe::{ExpertExecutor, ExpertState, Rows, SKIP_SLOT};

/// The gated nonlinearity applied to one (gate, up) pair.
#[inline]
fn glu(a: Activation, gate: f32, up: f32) -> f32 {
    crate::kernels::gated(a, gate, up)
}

/// The experts of one layer held here.
struct LayerSet {
    experts: Vec<Option<Arc<PackedExpert>>>,
    inter: usize,
}

/// Buffers reused from call to call.
#[derive(Default)]
struct Workspace {
    offsets: Vec<usize>,
    cursor: Vec<usize>,
    order: Vec<u32>,
    active: Vec<u32>,
    xq: Vec<i8>,
    xs: Vec<f32>,
    h: Vec<f32>,
    hq: Vec<i8>,
    hs: Vec<f32>,
    row_i8: Vec<bool>,
    xb: Vec<u16>,
    hb: Vec<u16>,
    row_b16: Vec<bool>,
    items: Vec<Item>,
}

/// Experts repacked for the SIMD kernels, run on a pinned pool.
pub struct PackedExperts {
    layers: Vec<Option<LayerSet>>,
    hidden: usize,
    pool: Arc<ExpertPool>,
    kernels: Kernels,
    ws: Mutex<Workspace>,
}

impl PackedExperts {
    /// Wraps per-layer expert sets (`None` for layers without experts here).
    /// Every expert of a layer must share `hidden` and its intermediate width.
    pub fn new(
        layers: Vec<Option<Vec<Option<PackedExpert>>>>,
        hidden: usize,
        pool: Arc<ExpertPool>,
    ) -> Result<Self> {
        let mut sets = Vec::with_capacity(layers.len());
        for (li, l) in layers.into_iter().enumerate() {
            sets.push(match l {
                None => None,
                Some(experts) => {
                    let mut inter = None;
                    for ex in experts.iter().flatten() {
                        if ex.hidden != hidden || inter.is_some_and(|i| i != ex.inter) {
                            return Err(Error::Dispatch(format!(
                                "layer {li}: experts of different shapes cannot share an executor"
                            )));
                        }
                        inter = Some(ex.inter);
                    }
                    Some(LayerSet {
                        experts: experts.into_iter().map(|e| e.map(Arc::new)).collect(),
                        inter: inter.unwrap_or(0),
                    })
                }
            });
        }
        Ok(PackedExperts {
            layers: sets,
            hidden,
            pool,
            kernels: *kernels(),
            ws: Mutex::new(Workspace::default()),
        })
    }

    /// Uses `k` instead of the process-wide kernels (tests, benchmarks).
    pub fn with_kernels(mut self, k: Kernels) -> Self {
        self.kernels = k;
        self
    }

    /// Switches kernels in place.
    pub fn set_kernels(&mut self, k: Kernels) {
        self.kernels = k;
    }

    /// Switches the worker pool in place.
    pub fn set_pool(&mut self, pool: Arc<ExpertPool>) {
        self.pool = pool;
    }

    /// The kernels in use.
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// The worker pool.
    pub fn pool(&self) -> &Arc<ExpertPool> {
        &self.pool
    }

    /// Expert `e` of `layer`, if held here.
    pub fn expert(&self, layer: usize, e: usize) -> Option<&PackedExpert> {
        self.layers.get(layer)?.as_ref()?.experts.get(e)?.as_deref()
    }

    /// Bytes of packed weights held (what stays resident).
    pub fn resident_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .flat_map(|l| l.experts.iter().flatten())
            .map(|e| e.weight_bytes())
            .sum()
    }
}

impl ExpertExecutor for PackedExperts {
    /// Int8 experts take `rows.int8` as their quantized activations (step 2
    /// copies instead of quantizing); bf16 and f32 experts use `rows.f32`.
    fn execute_rows(
        &self,
        layer: usize,
        rows_in: Rows<'_>,
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_call(layer, rows_in, topk_ids, topk_weights, top_k, out)?;
        let set = self
            .layers
            .get(layer)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| Error::Dispatch(format!("layer {layer} has no experts here")))?;
        self.run_set(
            layer,
            &set.experts,
            set.inter,
            rows_in,
            topk_ids,
            topk_weights,
            top_k,
            out,
        )
    }

    fn expert_states(&self) -> Vec<ExpertState> {
        let mut out = Vec::new();
        for (layer, set) in self.layers.iter().enumerate() {
            let Some(set) = set else { continue };
            for (expert, ex) in set.experts.iter().enumerate() {
                if let Some(ex) = ex {
                    out.push(ExpertState {
                        layer,
                        expert,
                        tier: "resident",
                        precision: ex.dtype().as_str(),
                    });
                }
            }
        }
        out
    }
}

impl PackedExperts {
    /// Checks one call's shapes: rows of the hidden size, int8 rows matching
    /// them, ids, weights and outputs for every slot.
    pub(crate) fn check_call(
        &self,
        layer: usize,
        rows_in: Rows<'_>,
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &[f32],
    ) -> Result<()> {
        let (x, pre) = (rows_in.f32, rows_in.int8);
        let h = self.hidden;
        if h == 0 || !x.len().is_multiple_of(h) {
            return Err(Error::Dispatch(format!(
                "activations of length {} are not rows of hidden size {h}",
                x.len()
            )));
        }
        let rows = x.len() / h;
        if let Some(p) = pre
            && (p.q.len() != x.len() || p.scales.len() != rows)
        {
            return Err(Error::Dispatch(format!(
                "{rows} rows of hidden size {h} came with {} int8 values and {} scales",
                p.q.len(),
                p.scales.len()
            )));
        }
        let slots = rows * top_k;
        if topk_ids.len() < slots || topk_weights.len() < slots || out.len() < slots * h {
            return Err(Error::Dispatch(format!(
                "layer {layer}: {rows} rows × top-{top_k} need {slots} ids/weights and {} outputs",
                slots * h
            )));
        }
        Ok(())
    }

    /// One layer's call over the experts `experts` (indexed by expert id,
    /// `None` for those not held), all of intermediate width `inter`: what
    /// [`ExpertExecutor::execute_rows`] runs on this executor's own experts,
    /// and [`TieredExperts`](crate::experts::tiered::TieredExperts) on the
    /// resident and cached ones of a call.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_set(
        &self,
        layer: usize,
        experts: &[Option<Arc<PackedExpert>>],
        inter: usize,
        rows_in: Rows<'_>,
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let (x, pre) = (rows_in.f32, rows_in.int8);
        let h = self.hidden;
        let rows = x.len() / h.max(1);
        let slots = rows * top_k;
        let ne = experts.len();
        let mut guard = self.ws.lock().unwrap_or_else(|p| p.into_inner());
        let wsp = &mut *guard;

        // 1. Counting sort of the slots by expert.
        wsp.offsets.clear();
        wsp.offsets.resize(ne + 1, 0);
        for &id in &topk_ids[..slots] {
            if id == SKIP_SLOT {
                continue;
            }
            let e = id as usize;
            match experts.get(e) {
                Some(Some(_)) => wsp.offsets[e + 1] += 1,
                Some(None) => {
                    return Err(Error::Dispatch(format!(
                        "layer {layer}: expert {e} is not held by this executor"
                    )));
                }
                None => {
                    return Err(Error::Dispatch(format!(
                        "layer {layer}: expert id {id} out of range"
                    )));
                }
            }
        }
        for e in 0..ne {
            wsp.offsets[e + 1] += wsp.offsets[e];
        }
        let total = wsp.offsets[ne];
        wsp.cursor.clear();
        wsp.cursor.extend_from_slice(&wsp.offsets[..ne]);
        wsp.order.clear();
        wsp.order.resize(total, 0);
        for (s, &id) in topk_ids[..slots].iter().enumerate() {
            if id != SKIP_SLOT {
                let c = &mut wsp.cursor[id as usize];
                wsp.order[*c] = s as u32;
                *c += 1;
            }
        }
        wsp.active.clear();
        let mut any_i8 = false;
        let mut any_b16 = false;
        let k = &self.kernels;
        for (e, ex) in experts.iter().enumerate() {
            if wsp.offsets[e + 1] > wsp.offsets[e] {
                wsp.active.push(e as u32);
                any_i8 |= ex.as_ref().is_some_and(|x| x.dtype() == PackedDtype::Int8);
                any_b16 |= ex.as_ref().is_some_and(|x| uses_bf16x(k, x));
            }
        }
        if total == 0 {
            return Ok(());
        }

        let (hp, ip) = (i8_padded_k(h), i8_padded_k(inter));
        let (hp2, ip2) = (bf16_padded_k(h), bf16_padded_k(inter));
        let threads = self.pool.threads();
        let Workspace {
            offsets,
            order,
            active,
            xq,
            xs,
            h: hbuf,
            hq,
            hs,
            row_i8,
            xb,
            hb: hb16,
            row_b16,
            items,
            ..
        } = wsp;
        // Every row of a held expert is written whole by the gate/up phase
        // (its panels cover all `inter` columns) before anything reads it,
        // and rows of experts not held here are never read: only growth is
        // zeroed (a 2048-token step's buffer is tens of MiB per layer).
        hbuf.resize(total * inter, 0.0);

        self.pool.install(|| -> Result<()> {
            // 2. Per-token activation quantization (once per token, shared by
            //    all of its int8 experts).
            if any_i8 {
                xq.resize(rows * hp, 0);
                xs.resize(rows, 0.0);
                match pre {
                    // Quantized already (the int8 wire), by the same function.
                    Some(p) => {
                        xq.par_chunks_mut(hp)
                            .zip(p.q.par_chunks(h))
                            .for_each(|(d, qr)| {
                                d[..h].copy_from_slice(qr);
                                d[h..].fill(0);
                            });
                        xs.copy_from_slice(p.scales);
                    }
                    None => xq
                        .par_chunks_mut(hp)
                        .zip(xs.par_iter_mut())
                        .zip(x.par_chunks(h))
                        .for_each(|((q, s), xr)| *s = quantize_row_i8(xr, q)),
                }
            }
            // ... and bf16 rounding for experts with bf16 activations.
            if any_b16 {
                xb.resize(rows * hp2, 0);
                xb.par_chunks_mut(hp2)
                    .zip(x.par_chunks(h))
                    .for_each(|(d, xr)| to_bf16_row(xr, d));
            }
            let (offsets, order) = (&offsets[..], &order[..]);

            // 3. Gate/up phase.
            build_items(items, active, threads, |e| {
                experts[e].as_ref().map_or(0, |x| x.gate_up.panels())
            });
            let hout = Out::new(hbuf);
            let (xq_r, xs_r, xb_r) = (&xq[..], &xs[..], &xb[..]);
            items.par_iter().for_each(|it| {
                let e = it.e as usize;
                let Some(ex) = experts[e].as_ref() else {
                    return;
                };
                let (s0, s1) = (offsets[e], offsets[e + 1]);
                let tok = |i: usize| order[s0 + i] as usize / top_k;
                let (gate_bias, up_bias) = (ex.gate_bias.as_deref(), ex.up_bias.as_deref());
                let src = Src {
                    f32_rows: x,
                    f32_stride: h,
                    i8_rows: xq_r,
                    i8_stride: hp,
                    i8_scales: xs_r,
                    b16_rows: xb_r,
                    b16_stride: hp2,
                    f32_packed: &[],
                    b16_packed: &[],
                };
                run_panels(
                    k,
                    uses_bf16x(k, ex),
                    &ex.gate_up.data_view(),
                    ex.gate_up.k(),
                    s1 - s0,
                    it,
                    &tok,
                    &src,
                    |i, p, val| {
                        let row = s0 + i;
                        let j0 = p * (NR / 2);
                        let m = (NR / 2).min(inter.saturating_sub(j0));
                        let (mut g, mut u) = ([0.0f32; NR / 2], [0.0f32; NR / 2]);
                        g.copy_from_slice(&val[..NR / 2]);
                        u.copy_from_slice(&val[NR / 2..]);
                        if let Some(b) = gate_bias {
                            g.iter_mut().zip(&b[j0..j0 + m]).for_each(|(v, b)| *v += b);
                        }
                        if let Some(b) = up_bias {
                            u.iter_mut().zip(&b[j0..j0 + m]).for_each(|(v, b)| *v += b);
                        }
                        // SAFETY: row `row` belongs to expert `e` alone and
                        // columns `8p..8p+8` to this item's panels alone.
                        let dst = unsafe { hout.run_mut(row * inter + j0, m) };
                        match (ex.activation, <&mut [f32; NR / 2]>::try_from(&mut *dst)) {
                            // SiLU (most models) on a whole panel as one
                            // vectorizable loop.
                            (Activation::Silu, Ok(d)) => {
                                for c in 0..NR / 2 {
                                    d[c] = crate::kernels::silu(g[c]) * u[c];
                                }
                            }
                            (a, _) => {
                                for (c, d) in dst.iter_mut().enumerate() {
                                    *d = glu(a, g[c], u[c]);
                                }
                            }
                        }
                    },
                );
            });

            // 4. Per-row quantization of the hidden activations of int8 experts.
            if any_i8 {
                row_i8.clear();
                row_i8.resize(total, false);
                for &e in active.iter() {
                    let e = e as usize;
                    if experts[e]
                        .as_ref()
                        .is_some_and(|x| x.dtype() == PackedDtype::Int8)
                    {
                        row_i8[offsets[e]..offsets[e + 1]].fill(true);
                    }
                }
                hq.resize(total * ip, 0);
                hs.resize(total, 0.0);
                hq.par_chunks_mut(ip)
                    .zip(hs.par_iter_mut())
                    .zip(hbuf.par_chunks(inter.max(1)))
                    .zip(row_i8.par_iter())
                    .for_each(|(((q, s), hr), &is_i8)| {
                        if is_i8 {
                            *s = quantize_row_i8(hr, q);
                        }
                    });
            }
            // ... and bf16 rounding of those of experts with bf16 activations.
            if any_b16 {
                row_b16.clear();
                row_b16.resize(total, false);
                for &e in active.iter() {
                    let e = e as usize;
                    if experts[e].as_ref().is_some_and(|x| uses_bf16x(k, x)) {
                        row_b16[offsets[e]..offsets[e + 1]].fill(true);
                    }
                }
                hb16.resize(total * ip2, 0);
                hb16.par_chunks_mut(ip2.max(1))
                    .zip(hbuf.par_chunks(inter.max(1)))
                    .zip(row_b16.par_iter())
                    .for_each(|((d, hr), &on)| {
                        if on {
                            to_bf16_row(hr, d);
                        }
                    });
            }

            // 5. Down phase with the weighted scatter.
            build_items(items, active, threads, |e| {
                experts[e].as_ref().map_or(0, |x| x.down.panels())
            });
            let yout = Out::new(out);
            let (hb, hq_r, hs_r, hb16_r) = (&hbuf[..], &hq[..], &hs[..], &hb16[..]);
            items.par_iter().for_each(|it| {
                let e = it.e as usize;
                let Some(ex) = experts[e].as_ref() else {
                    return;
                };
                let (s0, s1) = (offsets[e], offsets[e + 1]);
                let row = |i: usize| s0 + i;
                let down_bias = ex.down_bias.as_deref();
                let src = Src {
                    f32_rows: hb,
                    f32_stride: inter,
                    i8_rows: hq_r,
                    i8_stride: ip,
                    i8_scales: hs_r,
                    b16_rows: hb16_r,
                    b16_stride: ip2,
                    f32_packed: &[],
                    b16_packed: &[],
                };
                run_panels(
                    k,
                    uses_bf16x(k, ex),
                    &ex.down.data_view(),
                    ex.down.k(),
                    s1 - s0,
                    it,
                    &row,
                    &src,
                    |i, p, val| {
                        let slot = order[s0 + i] as usize;
                        let wgt = topk_weights[slot];
                        let j0 = p * NR;
                        let m = NR.min(h.saturating_sub(j0));
                        // SAFETY: slot `slot` is routed to expert `e` once
                        // and columns `16p..16p+16` belong to this item alone.
                        let dst = unsafe { yout.run_mut(slot * h + j0, m) };
                        match (down_bias, <&mut [f32; NR]>::try_from(&mut *dst)) {
                            (None, Ok(d)) => {
                                for (d, v) in d.iter_mut().zip(val) {
                                    *d = wgt * v;
                                }
                            }
                            _ => {
                                for (c, d) in dst.iter_mut().enumerate() {
                                    *d = wgt * (val[c] + down_bias.map_or(0.0, |b| b[j0 + c]));
                                }
                            }
                        }
                    },
                );
            });
            Ok(())
        })
    }
}

/// Whether expert `ex` runs on the bf16 × bf16 tile of `k`.
#[inline]
fn uses_bf16x(k: &Kernels, ex: &PackedExpert) -> bool {
    ex.bf16_activations && ex.dtype() == PackedDtype::Bf16 && k.bf16x_mr().is_some()
}

/// Rounds `src` to bf16 into `dst` (round to nearest even), zero-padding the
/// rest of `dst`.
pub(crate) fn to_bf16_row(src: &[f32], dst: &mut [u16]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = f32_to_bf16_bits(v);
    }
    for d in dst.iter_mut().skip(src.len()) {
        *d = 0;
    }
}
