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

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use crate::config::{Activation, FfnKind, ModelConfig};
use crate::error::{Error, Result};
use crate::experts::packed::{PackedData, PackedDtype, PackedExpert};
use crate::experts::pool::ExpertPool;
use crate::experts::{ExpertDtype, LoadOptions};
use crate::kernels::dispatch::{AmxBlock, AmxTiles, Kernels, MAX_MR, kernels};
use crate::kernels::layout::{
    AMX_BF16_TILE_K, AMX_I8_TILE_K, AMX_ROW_BYTES, AMX_TILE_BYTES, AMX_TILE_M, BF16_PAIR_KC,
    I8_GROUP_BYTES, KG, NR, bf16_padded_k, f32_to_bf16_bits, i8_padded_k, pack_pairs_f32,
    quantize_row_i8,
};
use crate::loader::names::ExpertNames;
use crate::loader::weights::WeightStore;
use crate::moe::{ExpertExecutor, SKIP_SLOT};

/// `k` per block on the bf16 prefill path (a 16 KiB panel chunk).
const KC_BF16: usize = 512;
/// int8 groups per block on the int8 prefill path (a 16 KiB panel chunk).
const KC_I8_GROUPS: usize = 128;
/// Work items per thread and phase (load balance vs. scheduling overhead).
const ITEMS_PER_THREAD: usize = 4;

/// The gated nonlinearity applied to one (gate, up) pair.
#[inline]
fn glu(a: Activation, gate: f32, up: f32) -> f32 {
    crate::kernels::gated(a, gate, up)
}

/// The experts of one layer held here.
struct LayerSet {
    experts: Vec<Option<PackedExpert>>,
    inter: usize,
}

#[derive(Clone, Copy)]
struct Item {
    e: u32,
    p0: u32,
    p1: u32,
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

thread_local! {
    static ACC_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static ACC_I32: RefCell<Vec<i32>> = const { RefCell::new(Vec::new()) };
    /// Two-panel prefill path: the packed activation stream and the two
    /// panels' accumulators.
    static PAIRS_F32: RefCell<(Vec<f32>, Vec<f32>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
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

/// A shared output buffer that work items write disjoint parts of.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: `Out` is only used inside one `execute` call while the buffer it
// points to is exclusively borrowed by that call, and every work item writes
// a disjoint set of indices (distinct (row, column) pairs, see `write`).
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

impl Out {
    fn new(v: &mut [f32]) -> Self {
        Out {
            ptr: v.as_mut_ptr(),
            len: v.len(),
        }
    }

    /// Writes `v` at indices `i..i + v.len()`.
    ///
    /// # Safety
    /// No other thread may read or write those indices during the phase.
    #[inline]
    unsafe fn write_run(&self, i: usize, v: &[f32]) {
        assert!(i <= self.len && v.len() <= self.len - i);
        // SAFETY: in bounds (asserted); exclusivity is the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), self.ptr.add(i), v.len()) }
    }
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
                        experts,
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

    /// Loads and packs every expert of the model for which `keep` holds, in
    /// the precision `opts` asks for each one.
    pub fn load_filtered(
        cfg: &ModelConfig,
        ws: &WeightStore,
        opts: &LoadOptions,
        keep: &(impl Fn(usize, usize) -> bool + Sync),
    ) -> Result<Self> {
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, spec) in cfg.layers.iter().enumerate() {
            if spec.ffn != FfnKind::Moe {
                layers.push(None);
                continue;
            }
            let names = ExpertNames::resolve(cfg, ws, i)?;
            let experts: Vec<Option<PackedExpert>> = (0..cfg.num_experts)
                .into_par_iter()
                .map(|e| -> Result<Option<PackedExpert>> {
                    if !keep(i, e) {
                        return Ok(None);
                    }
                    let asked = opts.dtype_for(i, e);
                    if asked != ExpertDtype::Bf16
                        && let Some(p) = load_int8_expert(cfg, ws, &names, e)?
                    {
                        return Ok(Some(p));
                    }
                    let mlp = names.load(cfg, ws, e)?;
                    let (dt, exact) = match asked {
                        ExpertDtype::Auto => (PackedDtype::Bf16, true),
                        ExpertDtype::Bf16 => (PackedDtype::Bf16, false),
                        ExpertDtype::Int8 => (PackedDtype::Int8, false),
                    };
                    PackedExpert::from_mlp(&mlp, dt, exact)
                        .map(|p| Some(p.with_bf16_activations(asked == ExpertDtype::Bf16)))
                        .map_err(|err| match err {
                            Error::Dispatch(m) => {
                                Error::Dispatch(format!("{m} (layer {i}, expert {e})"))
                            }
                            other => other,
                        })
                })
                .collect::<Result<_>>()?;
            layers.push(Some(experts));
        }
        let pool = match opts.threads {
            Some(n) => Arc::new(ExpertPool::new(Some(n), opts.pin_threads)?),
            None => ExpertPool::shared()?,
        };
        Self::new(layers, cfg.hidden_size, pool)
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
        self.layers.get(layer)?.as_ref()?.experts.get(e)?.as_ref()
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
    fn execute(
        &self,
        layer: usize,
        x: &[f32],
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let h = self.hidden;
        if h == 0 || !x.len().is_multiple_of(h) {
            return Err(Error::Dispatch(format!(
                "activations of length {} are not rows of hidden size {h}",
                x.len()
            )));
        }
        let rows = x.len() / h;
        let slots = rows * top_k;
        if topk_ids.len() < slots || topk_weights.len() < slots || out.len() < slots * h {
            return Err(Error::Dispatch(format!(
                "layer {layer}: {rows} rows × top-{top_k} need {slots} ids/weights and {} outputs",
                slots * h
            )));
        }
        let set = self
            .layers
            .get(layer)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| Error::Dispatch(format!("layer {layer} has no experts here")))?;
        let ne = set.experts.len();
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
            match set.experts.get(e) {
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
        for e in 0..ne {
            if wsp.offsets[e + 1] > wsp.offsets[e] {
                wsp.active.push(e as u32);
                any_i8 |= set.experts[e]
                    .as_ref()
                    .is_some_and(|x| x.dtype() == PackedDtype::Int8);
                any_b16 |= set.experts[e].as_ref().is_some_and(|x| uses_bf16x(k, x));
            }
        }
        if total == 0 {
            return Ok(());
        }

        let inter = set.inter;
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
        hbuf.clear();
        hbuf.resize(total * inter, 0.0);

        self.pool.install(|| -> Result<()> {
            // 2. Per-token activation quantization (once per token, shared by
            //    all of its int8 experts).
            if any_i8 {
                xq.resize(rows * hp, 0);
                xs.resize(rows, 0.0);
                xq.par_chunks_mut(hp)
                    .zip(xs.par_iter_mut())
                    .zip(x.par_chunks(h))
                    .for_each(|((q, s), xr)| *s = quantize_row_i8(xr, q));
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
                set.experts[e].as_ref().map_or(0, |x| x.gate_up.panels())
            });
            let hout = Out::new(hbuf);
            let (xq_r, xs_r, xb_r) = (&xq[..], &xs[..], &xb[..]);
            items.par_iter().for_each(|it| {
                let e = it.e as usize;
                let Some(ex) = set.experts[e].as_ref() else {
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
                        let mut o = [0.0f32; NR / 2];
                        match ex.activation {
                            // SiLU (most models) as one vectorizable loop.
                            Activation::Silu => {
                                for c in 0..NR / 2 {
                                    o[c] = crate::kernels::silu(g[c]) * u[c];
                                }
                            }
                            a => {
                                for c in 0..m {
                                    o[c] = glu(a, g[c], u[c]);
                                }
                            }
                        }
                        // SAFETY: row `row` belongs to expert `e` alone and
                        // columns `8p..8p+8` to this item's panels alone.
                        unsafe { hout.write_run(row * inter + j0, &o[..m]) };
                    },
                );
            });

            // 4. Per-row quantization of the hidden activations of int8 experts.
            if any_i8 {
                row_i8.clear();
                row_i8.resize(total, false);
                for &e in active.iter() {
                    let e = e as usize;
                    if set.experts[e]
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
                    if set.experts[e].as_ref().is_some_and(|x| uses_bf16x(k, x)) {
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
                set.experts[e].as_ref().map_or(0, |x| x.down.panels())
            });
            let yout = Out::new(out);
            let (hb, hq_r, hs_r, hb16_r) = (&hbuf[..], &hq[..], &hs[..], &hb16[..]);
            items.par_iter().for_each(|it| {
                let e = it.e as usize;
                let Some(ex) = set.experts[e].as_ref() else {
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
                        let mut o = [0.0f32; NR];
                        for (c, d) in o.iter_mut().enumerate().take(m) {
                            let y = val[c] + down_bias.map_or(0.0, |b| b[j0 + c]);
                            *d = wgt * y;
                        }
                        // SAFETY: slot `slot` is routed to expert `e` once
                        // and columns `16p..16p+16` belong to this item alone.
                        unsafe { yout.write_run(slot * h + j0, &o[..m]) };
                    },
                );
            });
            Ok(())
        })
    }
}

/// Expert `e` straight from a checkpoint that stores it as channel-wise int8
/// (compressed-tensors W8A8, one tensor per expert and projection), or `None`
/// when its weights are floats.
fn load_int8_expert(
    cfg: &ModelConfig,
    ws: &WeightStore,
    names: &ExpertNames<'_>,
    e: usize,
) -> Result<Option<PackedExpert>> {
    let ExpertNames::PerExpert {
        prefix,
        gate,
        up,
        down,
    } = names
    else {
        return Ok(None);
    };
    let (h, inter) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let get = |proj: &str, shape: [usize; 2]| {
        ws.get_i8_channelwise(&format!("{prefix}.{e}.{proj}.weight"), &shape)
    };
    let Some(g) = get(gate, [inter, h])? else {
        return Ok(None);
    };
    let missing = |proj: &str| {
        Error::Dispatch(format!(
            "{prefix}.{e}: gate_proj is int8 but {proj} is not (mixed precision within one expert)"
        ))
    };
    let u = get(up, [inter, h])?.ok_or_else(|| missing(up))?;
    let d = get(down, [h, inter])?.ok_or_else(|| missing(down))?;
    PackedExpert::from_i8(&g, &u, &d, cfg.activation).map(Some)
}

/// Splits each active expert's `panels(e)` into runs so that every thread
/// gets about [`ITEMS_PER_THREAD`] items.
fn build_items(
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

/// Where a phase's activation rows come from.
struct Src<'a> {
    f32_rows: &'a [f32],
    f32_stride: usize,
    i8_rows: &'a [i8],
    i8_stride: usize,
    i8_scales: &'a [f32],
    /// bf16 copies (zero-padded to an even length), for bf16 × bf16 tiles.
    b16_rows: &'a [u16],
    b16_stride: usize,
}

/// Whether expert `ex` runs on the bf16 × bf16 tile of `k`.
#[inline]
fn uses_bf16x(k: &Kernels, ex: &PackedExpert) -> bool {
    ex.bf16_activations && ex.dtype() == PackedDtype::Bf16 && k.bf16x_mr().is_some()
}

/// Rounds `src` to bf16 into `dst` (round to nearest even), zero-padding the
/// rest of `dst`.
fn to_bf16_row(src: &[f32], dst: &mut [u16]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = f32_to_bf16_bits(v);
    }
    for d in dst.iter_mut().skip(src.len()) {
        *d = 0;
    }
}

/// One accumulator row of a panel (16 channels).
#[inline]
fn as_row(a: &[f32]) -> &[f32; NR] {
    a.try_into().expect("accumulator rows are 16 wide")
}

/// One int8 accumulator row dequantized: `acc · weight scale · row scale`
/// (the same expression on every tier, so results stay bit-identical).
#[inline]
fn dequant(a: &[i32], ws: &[f32], xs: f32) -> [f32; NR] {
    let mut v = [0.0f32; NR];
    for ((d, &q), &w) in v.iter_mut().zip(a).zip(ws) {
        *d = q as f32 * w * xs;
    }
    v
}

/// A borrowed view of a packed matrix's elements.
pub(crate) enum DataView<'a> {
    Bf16(&'a [u16]),
    I8 { data: &'a [i8], scales: &'a [f32] },
}

impl crate::experts::packed::PackedMatrix {
    pub(crate) fn data_view(&self) -> DataView<'_> {
        match self.data() {
            PackedData::Bf16(d) => DataView::Bf16(d.as_slice()),
            PackedData::I8 { data, scales } => DataView::I8 {
                data: data.as_slice(),
                scales,
            },
        }
    }
}

/// Runs panels `it.p0..it.p1` of one matrix over the expert's `n` rows
/// (`row(i)` is row `i`'s index in `src`) and hands each panel's results to
/// `epi(i, panel, val)` where `val[c]` is row `i`'s dequantized channel `c`.
#[allow(clippy::too_many_arguments)]
fn run_panels(
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
    match *data {
        // Prefill on AMX tiles: bf16 activations with bf16 weights, and int8.
        DataView::Bf16(_) if bf16x && k.amx() && n > k.bf16x_mr().unwrap_or(0) => {
            run_panels_amx(k, data, kdim, n, it, row, src, epi)
        }
        DataView::I8 { .. } if k.amx() && n > k.i8_mr() => {
            run_panels_amx(k, data, kdim, n, it, row, src, epi)
        }
        // bf16 activations: the dot-product tile on the decode path only. On
        // the prefill path the widening f32 FMA tile runs instead (with the f32
        // activations, which are only more exact): measured on Sapphire-Rapids
        // class x86, `vdpbf16ps` retires at half the FLOP rate of zmm FMA, so
        // it only pays where weights stream (decode).
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
        // Prefill on tiers with a two-panel tile.
        DataView::Bf16(w) if n > k.bf16_mr() && k.bf16_pair_mr().is_some() => {
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

/// The prefill path of bf16 experts with f32 activations on tiers with a
/// two-panel tile: the expert's rows are packed once per work item into
/// the tile's stream (token tiles of equal size, each K block contiguous),
/// then every panel pair runs over K blocks of [`BF16_PAIR_KC`] (two panel
/// chunks and one packed tile stay in L1).
#[allow(clippy::too_many_arguments)]
fn run_pairs_f32(
    k: &Kernels,
    w: &[u16],
    kdim: usize,
    n: usize,
    it: &Item,
    row: &dyn Fn(usize) -> usize,
    src: &Src<'_>,
    mut epi: impl FnMut(usize, usize, &[f32; NR]),
) {
    // Tiers without a two-panel tile run its twin (up to `MAX_MR` rows).
    let mr = k.bf16_pair_mr().unwrap_or(MAX_MR);
    // Token tiles of equal size (16 tokens: 8 + 8, not 12 + 4).
    let tn_max = n.div_ceil(n.div_ceil(mr));
    let kp = bf16_padded_k(kdim);
    let panel_len = kp * NR;
    PAIRS_F32.with_borrow_mut(|(xp, acc)| {
        // The tile at token `t0` (`tn` rows) holds `tn · kp` values from
        // `t0 · kp`; its K block at `k0` starts `k0 · tn` values in.
        xp.clear();
        let mut t0 = 0;
        while t0 < n {
            let tn = tn_max.min(n - t0);
            let mut rows: [&[f32]; MAX_MR] = [&[]; MAX_MR];
            for (i, r) in rows.iter_mut().enumerate().take(tn) {
                let base = row(t0 + i) * src.f32_stride;
                *r = &src.f32_rows[base..base + kdim];
            }
            let mut k0 = 0;
            while k0 < kdim {
                let kc = BF16_PAIR_KC.min(kdim - k0);
                pack_pairs_f32(&rows[..tn], k0, kc, xp);
                k0 += kc;
            }
            t0 += tn;
        }
        acc.resize(2 * n * NR, 0.0);
        let (p0, p1) = (it.p0 as usize, it.p1 as usize);
        let mut p = p0;
        while p < p1 {
            // An odd last panel runs as a pair with itself (one result kept).
            let q = if p + 1 < p1 { p + 1 } else { p };
            acc.fill(0.0);
            let (acc0, acc1) = acc.split_at_mut(n * NR);
            let mut k0 = 0;
            while k0 < kdim {
                let kc = BF16_PAIR_KC.min(kdim - k0);
                let len = bf16_padded_k(kc) * NR;
                let chunk = |j: usize| &w[j * panel_len + k0 * NR..][..len];
                let mut t0 = 0;
                while t0 < n {
                    let tn = tn_max.min(n - t0);
                    let span = t0 * NR..(t0 + tn) * NR;
                    k.bf16_pair_tile(
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
    })
}

/// A 64-byte aligned, zero-filled window of `len` bytes inside `buf`.
fn aligned_zeroed(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
    buf.clear();
    buf.resize(len + 64, 0);
    let off = buf.as_ptr().align_offset(64).min(64);
    &mut buf[off..off + len]
}

/// [`run_panels`] on AMX tiles (prefill: more tokens than a SIMD tile holds).
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
fn run_panels_amx(
    k: &Kernels,
    data: &DataView<'_>,
    kdim: usize,
    n: usize,
    it: &Item,
    row: &dyn Fn(usize) -> usize,
    src: &Src<'_>,
    mut epi: impl FnMut(usize, usize, &[f32; NR]),
) {
    let int8 = matches!(data, DataView::I8 { .. });
    let tk = if int8 { AMX_I8_TILE_K } else { AMX_BF16_TILE_K };
    let ktiles = kdim.div_ceil(tk).max(1);
    // One spare line per row: a row stride that is a multiple of 4 KiB would
    // put all 16 rows of an `A` tile in the same L1 set.
    let row_bytes = (ktiles + 1) * AMX_ROW_BYTES;
    let n_pad = n.next_multiple_of(AMX_TILE_M);
    let (p0, p1) = (it.p0 as usize, it.p1 as usize);
    AMX_SCRATCH.with_borrow_mut(|(abuf, bbuf)| {
        ACC_F32.with_borrow_mut(|accf| {
            ACC_I32.with_borrow_mut(|acci| {
                let a = aligned_zeroed(abuf, n_pad * row_bytes);
                for i in 0..n {
                    let dst = &mut a[i * row_bytes..(i + 1) * row_bytes];
                    let base = row(i);
                    match data {
                        DataView::Bf16(_) => {
                            let s = &src.b16_rows[base * src.b16_stride..][..kdim];
                            dst[..2 * kdim].copy_from_slice(bytemuck::cast_slice(s));
                        }
                        DataView::I8 { .. } => {
                            let s = &src.i8_rows[base * src.i8_stride..][..kdim];
                            dst[..kdim].copy_from_slice(bytemuck::cast_slice(s));
                        }
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
