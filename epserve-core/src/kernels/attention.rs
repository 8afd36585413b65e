//! Flash-style attention over the paged KV cache, for GQA/MQA/MHA and MLA's
//! absorbed core alike.
//!
//! Work is split into items of (sequence, KV head — or several adjacent KV
//! heads when there are enough items, so each cached row is read whole, a
//! chunk of that KV head's query heads, a tile of consecutive query rows, a
//! split of the keys at multiples of [`SPLIT_KEYS`]) and run in parallel
//! (rayon); the splits of
//! one row are merged by log-sum-exp (flash-decoding), so a single long
//! sequence still gives every thread work. An item gathers its `M = rows × heads` query vectors, then walks
//! the keys its rows may see in blocks of [`KEY_BLOCK`] positions, reading
//! K/V rows straight from the pool through the block table (runs of
//! consecutive rows inside one cache block): scores tile `S = Q·Kᵀ`
//! (`M × block`), causal / sliding-window mask, online softmax (running max
//! and sum per query vector, the accumulator rescaled when the max grows),
//! then `O += P·V`. No score vector over the whole context is materialized,
//! and every K/V row is read once per item, i.e. once per KV-head group for
//! a decode step and once per tile of rows for prefill, where the block
//! stays in cache across the tile's queries. Attention sinks (GPT-OSS) join
//! the final normalization as one more logit without a value.
//!
//! The inner loops (`scores`, `softmax`, `accum`) are the tier micro-kernels of
//! [`Kernels`] (AVX2, AVX-512, NEON, and the scalar twins in
//! [`super::generic`]); keys and values may be f32 or bf16 ([`KvRows`]).
//! [`reference`] is the plain per-row, per-head algorithm the model used
//! before (materialized scores, softmax, weighted sum): the tests compare
//! against it.

use rayon::prelude::*;

use super::dispatch::Kernels;
use super::fast_exp;
use super::layout::{bf16_bits_to_f32, f32_to_bf16_bits};
use crate::mem::Out;

/// Key positions per online-softmax step.
pub const KEY_BLOCK: usize = 64;
/// Query vectors (rows × heads) per work item of a prefill tile.
const TILE_M: usize = 32;
/// Most query heads per work item (larger groups, e.g. MLA's one latent for
/// all heads, are split so a decode step still has parallel work).
const MAX_ITEM_HEADS: usize = 16;
/// Key positions per split (split-K, "flash-decoding"): the keys a row sees
/// are cut at multiples of this and each piece is its own work item, its
/// partial result (unnormalized output, running max and sum) merged by
/// log-sum-exp afterwards, so one long sequence keeps every thread busy.
/// The cut depends only on positions (never on the batch or the thread
/// count): a row gets the same bits in any batch.
pub const SPLIT_KEYS: usize = 512;
const _: () = assert!(SPLIT_KEYS.is_multiple_of(KEY_BLOCK));

/// Cached rows of one layer's keys or values, as stored.
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    /// bf16 bits, widened to f32 by a 16-bit shift.
    Bf16(&'a [u16]),
}

impl<'a> KvRows<'a> {
    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            KvRows::F32(s) => s.len(),
            KvRows::Bf16(s) => s.len(),
        }
    }
    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether the rows are bf16.
    pub fn is_bf16(&self) -> bool {
        matches!(self, KvRows::Bf16(_))
    }
    /// The first element's address (for the tier kernels).
    pub fn as_ptr(&self) -> *const u8 {
        match self {
            KvRows::F32(s) => s.as_ptr().cast(),
            KvRows::Bf16(s) => s.as_ptr().cast(),
        }
    }
    /// The elements from `off` on.
    pub fn slice_from(&self, off: usize) -> KvRows<'a> {
        match *self {
            KvRows::F32(s) => KvRows::F32(&s[off..]),
            KvRows::Bf16(s) => KvRows::Bf16(&s[off..]),
        }
    }
    /// Element `i` as f32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            KvRows::F32(s) => s[i],
            KvRows::Bf16(s) => bf16_bits_to_f32(s[i]),
        }
    }
}

/// Where the keys (or values) of each KV head sit in a layer's storage:
/// pool row `r`, KV head `h` is `width` elements at `r·stride + h·head_stride`
/// (element `c` of row `r` at `r·stride + c`), unless `by_column`.
#[derive(Debug, Clone, Copy)]
pub struct KvView<'a> {
    pub rows: KvRows<'a>,
    pub stride: usize,
    pub head_stride: usize,
    pub width: usize,
    /// Keys only: each cache block stored column by column, so a block's
    /// positions lie across a vector's lanes and a score needs no
    /// horizontal sum. Element `c` of position `t` of block `b` (pool row
    /// `b·bs + t`, `bs` = [`AttnShape::block_size`]) is at
    /// `b·bs·stride + c·bs + t`: KV head `h`'s keys in block `b` are the
    /// `width · bs` elements from `b·bs·stride + h·head_stride·bs`.
    pub by_column: bool,
}

/// The index of element `c` of pool row `r` in storage holding rows of
/// `stride` elements by column inside blocks of `bs` positions (the layout
/// of [`KvView::by_column`]: `b·bs·stride + c·bs + t` for row `b·bs + t`).
#[inline]
pub fn column_index(r: usize, c: usize, bs: usize, stride: usize) -> usize {
    let t = r % bs;
    (r - t) * stride + c * bs + t
}

impl KvView<'_> {
    /// Element `c` of pool row `r` (`bs` positions per block).
    #[inline]
    pub fn at(&self, r: usize, c: usize, bs: usize) -> f32 {
        if self.by_column {
            self.rows.get(column_index(r, c, bs, self.stride))
        } else {
            self.rows.get(r * self.stride + c)
        }
    }
}

/// The attention's shape and options.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape<'a> {
    /// Query heads (a multiple of `kv_heads`).
    pub heads: usize,
    /// KV heads; query head `h` reads KV head `h / (heads / kv_heads)`.
    pub kv_heads: usize,
    /// Multiplies every score.
    pub scale: f32,
    /// Sliding window: position `p` sees keys `p + 1 − window ..= p`.
    pub window: Option<usize>,
    /// Per query head, one extra logit taking probability mass with no value.
    pub sinks: Option<&'a [f32]>,
    /// Positions per cache block.
    pub block_size: usize,
    /// Round the queries to bf16 before the scores (the model runs with
    /// bf16 activations, `--dense-dtype bf16`): against bf16 keys the tiers
    /// with a native bf16 dot then take half the instructions for the
    /// scores ([`Kernels::attn_scores_b16`]). Values and probabilities stay
    /// f32.
    pub bf16_queries: bool,
}

/// One sequence of the flattened batch.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    /// Its block table (cache block ids; position `j` is at pool row
    /// `blocks[j / block_size] · block_size + j % block_size`).
    pub blocks: &'a [u32],
    /// First row of its queries in the batch.
    pub start: usize,
    /// Query rows (new tokens).
    pub len: usize,
    /// Positions cached before its first query row (query row `i` is at
    /// position `past + i` and sees keys up to it; its own K/V must already
    /// be in the cache).
    pub past: usize,
}

/// One work item: `nr` query rows from `r0` of sequence `seq`, the KV heads
/// `kvh..kvh + nkv` with `nh` of each one's query heads (the whole group
/// when `nkv > 1`, so the item's query heads `h0..h0 + nkv · nh` are
/// consecutive), against the keys of split `part` (positions
/// `part · SPLIT_KEYS ..` the next multiple). The items of one
/// (seq, kvh, h0, r0) are consecutive, splits in order; `last` marks the
/// final one. Several KV heads per item read each cached row whole (all
/// heads' slices are adjacent), which the memory system streams far better
/// than one head's short slice of every row; each head's arithmetic is the
/// same either way, so the grouping never changes a bit.
#[derive(Debug, Clone, Copy)]
struct Item {
    seq: usize,
    kvh: usize,
    nkv: usize,
    h0: usize,
    nh: usize,
    r0: usize,
    nr: usize,
    part: usize,
    last: bool,
}

/// The keys row `i` of `s` sees: positions `first..=pos`.
#[inline]
fn visible(shape: &AttnShape<'_>, s: &AttnSeq<'_>, i: usize) -> (usize, usize) {
    let pos = s.past + i;
    let first = match shape.window {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    };
    (first, pos)
}

/// Work items below which KV heads are not grouped (per thread): grouping
/// makes fewer, larger items, and short contexts need the parallelism.
const ITEMS_PER_THREAD: usize = 4;

/// The work items. `rows_hold_heads`: each cached row holds the KV heads
/// side by side (no head planes), so items of several KV heads read whole
/// rows, which the memory system streams far better than one head's short
/// slice of each; with one plane per KV head each head's rows are
/// contiguous already, and items of one head are faster (Zen 3, bf16 KV,
/// one decode row: 3-5 % at 2k-8k positions, paired passes of one
/// process): the next block's K/V lines, hinted during this block's value
/// pass, are used after it, not after the other heads' blocks have
/// evicted them from L1.
fn plan(shape: &AttnShape<'_>, seqs: &[AttnSeq<'_>], rows_hold_heads: bool) -> Vec<Item> {
    let group = shape.heads / shape.kv_heads;
    let chunks = group.div_ceil(MAX_ITEM_HEADS);
    let want = ITEMS_PER_THREAD * rayon::current_num_threads();
    // The most KV heads per item (a divisor of kv_heads) that still leaves
    // enough items; one when a group is split into chunks or the heads are
    // planes. The item count is inversely proportional to the KV heads per
    // item: one plan gives all.
    let most = if chunks == 1 && rows_hold_heads {
        shape.kv_heads
    } else {
        1
    };
    let items = plan_with(shape, seqs, most);
    let nkv = (1..=most)
        .rev()
        .find(|&d| most.is_multiple_of(d) && (d == 1 || items.len() * (most / d) >= want))
        .unwrap_or(1);
    if nkv == most {
        items
    } else {
        plan_with(shape, seqs, nkv)
    }
}

/// The items with `nkv` KV heads each (`nkv` divides `kv_heads`; `nkv > 1`
/// only when a group's query heads fit one item).
fn plan_with(shape: &AttnShape<'_>, seqs: &[AttnSeq<'_>], nkv: usize) -> Vec<Item> {
    let group = shape.heads / shape.kv_heads;
    let chunks = group.div_ceil(MAX_ITEM_HEADS);
    let hc = group.div_ceil(chunks);
    debug_assert!(nkv == 1 || hc == group);
    let qt = (TILE_M / hc).max(1);
    let mut items = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for kvh in (0..shape.kv_heads).step_by(nkv) {
            let mut h = 0;
            while h < group {
                let nh = hc.min(group - h);
                let mut r = 0;
                while r < s.len {
                    let nr = qt.min(s.len - r);
                    let lo = visible(shape, s, r).0;
                    let hi = visible(shape, s, r + nr - 1).1;
                    let (p0, p1) = (lo / SPLIT_KEYS, hi / SPLIT_KEYS);
                    for part in p0..=p1 {
                        items.push(Item {
                            seq: si,
                            kvh,
                            nkv,
                            h0: kvh * group + h,
                            nh,
                            r0: r,
                            nr,
                            part,
                            last: part == p1,
                        });
                    }
                    r += nr;
                }
                h += nh;
            }
        }
    }
    items
}

/// Attention of the batch: `q` is `[rows, heads, k.width]`, `out` is
/// `[rows, heads, v.width]` (fully overwritten); each sequence's K/V for
/// positions `0..past + len` must be in the pool. Panics on inconsistent
/// shapes (a programming error).
pub fn attention(
    kern: &Kernels,
    shape: &AttnShape<'_>,
    seqs: &[AttnSeq<'_>],
    q: &[f32],
    k: KvView<'_>,
    v: KvView<'_>,
    out: &mut [f32],
) {
    let (heads, dk, dv) = (shape.heads, k.width, v.width);
    assert!(shape.kv_heads > 0 && heads.is_multiple_of(shape.kv_heads) && shape.block_size > 0);
    assert!(dk > 0 && dv > 0 && q.len().is_multiple_of(heads * dk));
    assert_eq!(out.len() / (heads * dv), q.len() / (heads * dk));
    assert!(shape.sinks.is_none_or(|s| s.len() >= heads));
    assert!(!v.by_column, "values are read by row");
    // Side by side, a row's heads are `head_stride` apart inside its
    // `stride`; planes put them a plane apart.
    let rows_hold_heads = k.head_stride < k.stride && v.head_stride < v.stride;
    let items = plan(shape, seqs, rows_hold_heads);
    let whole = whole_groups(&items);
    run_items(kern, shape, seqs, &items, whole, q, k, v, out);
}

/// Whether the split groups (the items of one row tile) are numerous enough
/// to be the parallel unit, each run whole on one thread, its splits merged
/// there and written straight to the output (a prefill's tiles; no partial
/// result outlives its group). Otherwise every split is its own parallel
/// task and the merge waits for all of them (a decode step's few long
/// rows). Either way each split and each merge runs the same arithmetic.
fn whole_groups(items: &[Item]) -> bool {
    let groups = items.iter().filter(|it| it.last).count();
    groups >= ITEMS_PER_THREAD * rayon::current_num_threads()
}

/// The `(first, last)` item index of each split group, in order.
fn split_groups(items: &[Item]) -> Vec<(usize, usize)> {
    let mut groups = Vec::new();
    let mut i = 0;
    while i < items.len() {
        let mut e = i;
        while !items[e].last {
            e += 1;
        }
        groups.push((i, e));
        i = e + 1;
    }
    groups
}

/// A thread's reusable buffers: the heads' running states, the score block,
/// the splits' partial results and the merge's sums.
#[derive(Default)]
struct Scratch {
    st: Vec<HeadState>,
    sc: Vec<f32>,
    parts: Vec<Partial>,
    merged: Partial,
}

/// [`attention`] over the given work items, whole split groups per task
/// when `whole` (see [`whole_groups`]; the bits are the same either way).
#[allow(clippy::too_many_arguments)]
fn run_items(
    kern: &Kernels,
    shape: &AttnShape<'_>,
    seqs: &[AttnSeq<'_>],
    items: &[Item],
    whole: bool,
    q: &[f32],
    k: KvView<'_>,
    v: KvView<'_>,
    out: &mut [f32],
) {
    let (heads, dv) = (shape.heads, v.width);
    let groups = split_groups(items);
    let dst = Out::new(out);
    // Writes group `(i, e)`'s merged rows; each group writes its own rows'
    // heads of `out`, so groups write in parallel.
    let write = |(i, e): (usize, usize), parts: &[Partial], merged: &mut Partial| {
        let it = &items[i];
        let s = &seqs[it.seq];
        let w = it.nkv * it.nh;
        debug_assert_eq!(parts.len(), e - i + 1);
        merge(shape, it, dv, parts, merged, |mi, acc, norm| {
            let row = s.start + it.r0 + mi / w;
            // SAFETY: (row, head) pairs belong to this group alone, and
            // the slice is dropped before `out` is used again.
            let d = unsafe { dst.run_mut((row * heads + it.h0 + mi % w) * dv, dv) };
            for (d, a) in d.iter_mut().zip(acc) {
                *d = a * norm;
            }
        });
    };
    if whole {
        groups
            .par_iter()
            .for_each_init(Scratch::default, |scr, &(i, e)| {
                let n = e - i + 1;
                if scr.parts.len() < n {
                    scr.parts.resize_with(n, Partial::default);
                }
                let s = &seqs[items[i].seq];
                load_queries(shape, s, &items[i], q, k.width, &mut scr.st);
                for (it, part) in items[i..=e].iter().zip(&mut scr.parts) {
                    run_item(kern, shape, s, it, k, v, &mut scr.st, &mut scr.sc, part);
                }
                write((i, e), &scr.parts[..n], &mut scr.merged);
            });
        return;
    }
    let results: Vec<Partial> = items
        .par_iter()
        .map_init(Scratch::default, |scr, it| {
            let (s, mut part) = (&seqs[it.seq], Partial::default());
            load_queries(shape, s, it, q, k.width, &mut scr.st);
            run_item(
                kern,
                shape,
                s,
                it,
                k,
                v,
                &mut scr.st,
                &mut scr.sc,
                &mut part,
            );
            part
        })
        .collect();
    if groups.len() >= PAR_MERGE_GROUPS {
        groups
            .par_iter()
            .for_each_init(Partial::default, |merged, &(i, e)| {
                write((i, e), &results[i..=e], merged)
            });
    } else {
        let mut merged = Partial::default();
        for &(i, e) in &groups {
            write((i, e), &results[i..=e], &mut merged);
        }
    }
}

/// Row groups from which the merge runs in parallel (a decode step's few
/// are not worth a fork).
const PAR_MERGE_GROUPS: usize = 8;

/// One work item's unnormalized result: per query vector `mi` (row-major
/// `[rows, heads]`), `acc[mi·dv..]` = `Σ_j e^(s_j − mx[mi]) · v_j` and
/// `sum[mi]` = `Σ_j e^(s_j − mx[mi])` over the keys it saw (`mx = −∞`,
/// `sum = 0`, `acc = 0` when none).
#[derive(Default)]
struct Partial {
    acc: AccBuf,
    mx: Vec<f32>,
    sum: Vec<f32>,
}

/// One item's splits merged in split order (log-sum-exp), with the
/// attention sinks: `put(mi, acc, norm)` for each query vector `mi`
/// (row-major `[rows, heads]`), its output being `acc · norm`.
fn merge(
    shape: &AttnShape<'_>,
    it: &Item,
    dv: usize,
    parts: &[Partial],
    merged: &mut Partial,
    mut put: impl FnMut(usize, &[f32], f32),
) {
    let w = it.nkv * it.nh;
    let m = it.nr * w;
    let norm = |mi: usize, mx: f32, sum: f32| {
        let h = it.h0 + mi % w;
        match shape.sinks {
            Some(sinks) => {
                let top = mx.max(sinks[h]);
                let a = (mx - top).exp();
                a / (sum * a + (sinks[h] - top).exp())
            }
            None => 1.0 / sum,
        }
    };
    if let [one] = parts {
        for mi in 0..m {
            let n = norm(mi, one.mx[mi], one.sum[mi]);
            put(mi, &one.acc[mi * dv..(mi + 1) * dv], n);
        }
        return;
    }
    let Partial { acc, mx, sum } = merged;
    acc.refill(m * dv, 0.0);
    refill(sum, m, 0.0);
    refill(mx, m, f32::NEG_INFINITY);
    for (mi, top) in mx.iter_mut().enumerate() {
        *top = parts
            .iter()
            .map(|p| p.mx[mi])
            .fold(f32::NEG_INFINITY, f32::max);
    }
    for p in parts {
        for mi in 0..m {
            if p.mx[mi] == f32::NEG_INFINITY {
                continue;
            }
            let w = fast_exp(p.mx[mi] - mx[mi]);
            sum[mi] += p.sum[mi] * w;
            for (a, x) in acc[mi * dv..(mi + 1) * dv]
                .iter_mut()
                .zip(&p.acc[mi * dv..(mi + 1) * dv])
            {
                *a += w * x;
            }
        }
    }
    for mi in 0..m {
        put(mi, &acc[mi * dv..(mi + 1) * dv], norm(mi, mx[mi], sum[mi]));
    }
}

/// Accumulator rows whose first value sits on a 64-byte boundary: the
/// value pass loads and stores them a vector at a time, and from a
/// `Vec<f32>`'s allocation (16 bytes past a line with glibc) every other
/// 32-byte access split a cache line. In the cached micro-benchmark of the
/// AVX2 value pass (8 queries, 128 bf16 columns, 64 keys a call) the
/// aligned rows took 26.4-26.7 ns a key against 27.8-27.9; in `bench
/// attention` at 8k context (Zen 3) the value pass's samples against the
/// column scores' went 1.107 -> 1.067 (mean of 4 alternated runs, lower in
/// 3).
#[derive(Default)]
struct AccBuf {
    buf: Vec<f32>,
    off: usize,
    len: usize,
}

impl AccBuf {
    /// `n` copies of `x`, reusing the allocation.
    fn refill(&mut self, n: usize, x: f32) {
        refill(&mut self.buf, n + 15, x);
        self.off = (16 - (self.buf.as_ptr() as usize / 4) % 16) % 16;
        self.len = n;
    }
}

impl std::ops::Deref for AccBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[self.off..self.off + self.len]
    }
}

impl std::ops::DerefMut for AccBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

/// `v` set to `n` copies of `x`, reusing its allocation.
#[inline]
fn refill(v: &mut Vec<f32>, n: usize, x: f32) {
    v.clear();
    v.resize(n, x);
}

/// Hints the cache lines of `bytes` bytes at element `off` of `rows` into
/// L2 (a hint: never faults, a no-op past the end or on other targets).
/// On Zen 3 and older AMD cores `prefetcht1` fills L1 as `prefetcht0` does
/// (a hinted line loads at L1 latency), so the lines also take L1 room
/// until used or evicted.
#[inline]
pub(crate) fn prefetch_l2(rows: KvRows<'_>, off: usize, bytes: usize) {
    if off >= rows.len() {
        return;
    }
    let p = rows.as_ptr().wrapping_add(off * esize(rows));
    let mut b = 0;
    while b < bytes {
        let a = p.wrapping_add(b);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: SSE is baseline on x86_64, and a prefetch is a hint that
        // never faults.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(a as *const i8);
        }
        #[cfg(target_arch = "aarch64")]
        // SAFETY: PRFM is a hint: it never faults, reads nothing and
        // writes nothing architecturally visible.
        unsafe {
            std::arch::asm!("prfm pldl2keep, [{0}]", in(reg) a, options(nostack, readonly, preserves_flags));
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        let _ = a;
        b += 64;
    }
}

/// Bytes per stored element.
#[inline]
fn esize(rows: KvRows<'_>) -> usize {
    if rows.is_bf16() { 2 } else { 4 }
}

/// Calls `f(j, n, row0)` for each run `j..j + n` of positions in `j0..j1`
/// that are consecutive pool rows (inside one cache block) from `row0`.
#[inline]
fn runs(s: &AttnSeq<'_>, bs: usize, j0: usize, j1: usize, mut f: impl FnMut(usize, usize, usize)) {
    let mut j = j0;
    while j < j1 {
        let b = j / bs;
        let end = ((b + 1) * bs).min(j1);
        f(j, end - j, s.blocks[b] as usize * bs + j % bs);
        j = end;
    }
}

/// One KV head's running state in a work item: its query vectors
/// (`[rows, heads]`) and the online softmax's max, sum and unnormalized
/// output per query vector.
#[derive(Default)]
struct HeadState {
    q: Vec<f32>,
    /// `q` as bf16 bits when the queries are rounded (else empty).
    qb: Vec<u16>,
    mx: Vec<f32>,
    sum: Vec<f32>,
    acc: AccBuf,
}

/// Gathers the query vectors of item `it` (of sequence `s`) into `st`, one
/// state per KV head (the same for every split of its group).
fn load_queries(
    shape: &AttnShape<'_>,
    s: &AttnSeq<'_>,
    it: &Item,
    q: &[f32],
    dk: usize,
    st: &mut Vec<HeadState>,
) {
    let heads = shape.heads;
    let group = heads / shape.kv_heads;
    if st.len() < it.nkv {
        st.resize_with(it.nkv, HeadState::default);
    }
    for (t, h) in st[..it.nkv].iter_mut().enumerate() {
        let h0 = it.h0 + t * group;
        h.q.clear();
        for ri in 0..it.nr {
            let row = s.start + it.r0 + ri;
            h.q.extend_from_slice(&q[(row * heads + h0) * dk..(row * heads + h0 + it.nh) * dk]);
        }
        h.qb.clear();
        if shape.bf16_queries {
            h.qb.extend(h.q.iter().map(|&x| f32_to_bf16_bits(x)));
            for (x, &b) in h.q.iter_mut().zip(&h.qb) {
                *x = bf16_bits_to_f32(b);
            }
        }
    }
}

/// One work item (one split of its rows' keys), its queries already in
/// `st` ([`load_queries`]): its partial result to `out`; `sc` is reused
/// scratch.
#[allow(clippy::too_many_arguments)]
fn run_item(
    kern: &Kernels,
    shape: &AttnShape<'_>,
    s: &AttnSeq<'_>,
    it: &Item,
    k: KvView<'_>,
    v: KvView<'_>,
    st: &mut [HeadState],
    sc: &mut Vec<f32>,
    out: &mut Partial,
) {
    let (dk, dv, bs) = (k.width, v.width, shape.block_size);
    let (nh, nr, nkv) = (it.nh, it.nr, it.nkv);
    let m = nr * nh;
    let st = &mut st[..nkv];
    for h in st.iter_mut() {
        debug_assert_eq!(h.q.len(), m * dk);
        refill(&mut h.mx, m, f32::NEG_INFINITY);
        refill(&mut h.sum, m, 0.0);
        h.acc.refill(m * dv, 0.0);
    }
    let pos = |ri: usize| s.past + it.r0 + ri;
    let first = |ri: usize| visible(shape, s, it.r0 + ri).0;
    // This split's keys that any row sees, and those every row sees.
    let (k0, k1) = (it.part * SPLIT_KEYS, (it.part + 1) * SPLIT_KEYS);
    let (lo, hi) = (first(0).max(k0), (pos(nr - 1) + 1).min(k1));
    let (all_lo, all_hi) = (first(nr - 1), pos(0) + 1);
    // Hints run past this split's end into the next split's first block:
    // the next item on this thread is most often that split of the same
    // rows (items are ordered by split), which would otherwise start on
    // keys no one hinted.
    let hint_hi = pos(nr - 1) + 1;
    // Every score read below was written first in its block.
    if sc.len() < m * KEY_BLOCK {
        sc.resize(m * KEY_BLOCK, 0.0);
    }
    // Each head's keys and values one contiguous stream of the same width
    // (a plane per KV head, unpadded): each stream is hinted half a block
    // ahead, a block's value rows from inside its own scores calls and the
    // next block's keys from inside this block's value pass, not each a
    // whole block ahead (the next block's keys from the scores, its values
    // from the value pass). On Zen 3 a `prefetcht1` fills L1 as `prefetcht0`
    // does (only Zen 4 stops at L2), so a hinted line waits in L1 until
    // used: the value pass's samples against the column scores' went 1.147
    // -> 1.107 (mean of 4 alternated `bench attention` runs at 8k context,
    // lower in each; 1.149 -> 1.088 in 7 of an env-switched prototype), the
    // scores' against the softmax's unchanged.
    let half_ahead =
        k.by_column && k.stride == k.width && v.stride == v.width && k.width == v.width;
    // Where the tier's value pass keeps its accumulators in its own lane
    // order between calls (AVX2 over bf16 rows), they stay in it for the
    // whole item, put back in order once at its end: the zeros they start
    // from are the same in any order, and the rescaling below scales whole
    // rows.
    let permuted = v.rows.is_bf16() && kern.attn_acc_permutes(m, dv);
    // Key blocks at multiples of KEY_BLOCK (not at `lo`): a row then sees
    // the same blocks, and gets the same bits, in any tile or batch.
    let mut j0 = lo - lo % KEY_BLOCK;
    while j0 < hi {
        let j1 = (j0 + KEY_BLOCK).min(hi);
        let n = j1 - j0;
        // The next block's pool rows, found through the block table (the
        // hardware prefetchers cannot follow a head's short slice of each
        // row across cache blocks). A head's K (V) lines of them are hinted
        // into L2 a run at a time, interleaved with this block's scores
        // (values) of that head: one burst of hundreds of prefetches fills
        // the line-fill queues and stalls the core until memory answers.
        let mut next = [usize::MAX; KEY_BLOCK];
        runs(s, bs, j1, (j1 + KEY_BLOCK).min(hint_hi), |j, len, row0| {
            for (t, r) in (row0..row0 + len).enumerate() {
                next[j - j1 + t] = r;
            }
        });
        let hint = |view: &KvView<'_>, off: usize, a: usize, b: usize| {
            for &r in &next[a..b] {
                if r != usize::MAX {
                    prefetch_l2(
                        view.rows,
                        r * view.stride + off,
                        view.width * esize(view.rows),
                    );
                }
            }
        };
        // Keys by column: a run's KV head is `width` columns of the block,
        // `bs` elements apart; the next run's columns are hinted whole.
        let hint_cols = |off: usize, a: usize, b: usize| {
            let mut i = a;
            while i < b {
                let r = next[i];
                if r == usize::MAX {
                    break;
                }
                let (t0, len) = (r % bs, (bs - r % bs).min(b - i));
                let base = column_index(r - t0, off, bs, k.stride);
                if len == bs {
                    prefetch_l2(k.rows, base, k.width * bs * esize(k.rows));
                } else {
                    for c in 0..k.width {
                        prefetch_l2(k.rows, base + c * bs + t0, len * esize(k.rows));
                    }
                }
                i += len;
            }
        };
        let masked = j0 < all_lo || j1 > all_hi;
        debug_assert!(j1 > lo);
        let nst = st.len();
        for (t, h) in st.iter_mut().enumerate() {
            let kvh = it.kvh + t;
            let (koff, voff) = (kvh * k.head_stride, kvh * v.head_stride);
            runs(s, bs, j0, j1, |j, len, row0| {
                let out = &mut sc[j - j0..];
                if k.by_column {
                    // The block of the next scores call: this head's next
                    // run, or after its last the next head's first (pulled
                    // into L1 from inside the kernel where the tier does).
                    let follow = if j + len < j1 {
                        let p = j + len;
                        Some((s.blocks[p / bs] as usize * bs, koff))
                    } else if t + 1 < nst {
                        let koff1 = (kvh + 1) * k.head_stride;
                        Some((s.blocks[j0 / bs] as usize * bs, koff1))
                    } else {
                        None
                    };
                    let follow =
                        follow.map(|(r, off)| (k.rows, column_index(r, off, bs, k.stride)));
                    // A whole cache block next: its columns are hinted from
                    // inside the scores kernel (spread, not one burst).
                    let (i, r) = (j - j0, next[j - j0]);
                    let whole = r != usize::MAX && r % bs == 0 && len == bs;
                    if !whole {
                        hint_cols(koff, i, i + len);
                    }
                    let next_cols = if half_ahead {
                        // This run's value rows (`dk · bs` elements).
                        (len == bs && row0 % bs == 0).then(|| (v.rows, row0 * v.stride + voff))
                    } else {
                        whole.then(|| (k.rows, column_index(r, koff, bs, k.stride)))
                    };
                    let t0 = row0 % bs;
                    let cols = k
                        .rows
                        .slice_from(column_index(row0 - t0, koff, bs, k.stride));
                    if shape.bf16_queries {
                        kern.attn_scores_cols_b16(
                            &h.q,
                            &h.qb,
                            dk,
                            cols,
                            bs,
                            t0,
                            len,
                            shape.scale,
                            out,
                            KEY_BLOCK,
                            next_cols,
                        );
                    } else {
                        kern.attn_scores_cols_hinted(
                            &h.q,
                            dk,
                            cols,
                            bs,
                            t0,
                            len,
                            shape.scale,
                            out,
                            KEY_BLOCK,
                            next_cols,
                            follow,
                        );
                    }
                    return;
                }
                hint(&k, koff, j - j0, j - j0 + len);
                let rows = k.rows.slice_from(row0 * k.stride + koff);
                if shape.bf16_queries {
                    kern.attn_scores_b16(
                        &h.q,
                        &h.qb,
                        dk,
                        rows,
                        k.stride,
                        len,
                        shape.scale,
                        out,
                        KEY_BLOCK,
                    );
                } else {
                    kern.attn_scores(&h.q, dk, rows, k.stride, len, shape.scale, out, KEY_BLOCK);
                }
            });
            for mi in 0..m {
                let srow = &mut sc[mi * KEY_BLOCK..mi * KEY_BLOCK + n];
                let (f, p) = (first(mi / nh), pos(mi / nh));
                if masked {
                    for (jj, x) in srow.iter_mut().enumerate() {
                        if j0 + jj < f || j0 + jj > p {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
                // Masked scores (−∞) become exactly 0; the sum's order
                // depends only on the key's index, so a row's bits do not
                // depend on the other rows of its tile.
                let (cmax, tot) = kern.attn_softmax(srow, h.mx[mi]);
                if cmax == f32::NEG_INFINITY {
                    continue;
                }
                if cmax > h.mx[mi] {
                    if h.mx[mi] != f32::NEG_INFINITY {
                        let alpha = fast_exp(h.mx[mi] - cmax);
                        h.sum[mi] *= alpha;
                        for a in &mut h.acc[mi * dv..(mi + 1) * dv] {
                            *a *= alpha;
                        }
                    }
                    h.mx[mi] = cmax;
                }
                h.sum[mi] += tot;
            }
            // Cache blocks adjacent in the pool (a sequence's blocks most
            // often are) are one strided run of value rows: one call for
            // them, so the kernel's per-pass costs (accumulator loads and
            // stores, the loop's start) spread over up to KEY_BLOCK keys,
            // not one block's 16. The sums are the same: every column adds
            // the keys in order, whatever the calls.
            let mut pending: Option<(usize, usize, usize, bool)> = None;
            let flush = |run: (usize, usize, usize, bool), acc: &mut [f32]| {
                let (i, len, row0, whole) = run;
                if !whole {
                    hint(&v, voff, i, i + len);
                }
                let rows = v.rows.slice_from(row0 * v.stride + voff);
                let hint = whole.then(|| {
                    if half_ahead {
                        // The next run's key blocks: `len` keys of `dk =
                        // dv` elements, contiguous as its rows.
                        (k.rows, column_index(next[i], koff, bs, k.stride))
                    } else {
                        (v.rows, next[i] * v.stride + voff)
                    }
                });
                if permuted {
                    kern.attn_accum_permuted(
                        &sc[i..],
                        KEY_BLOCK,
                        rows,
                        v.stride,
                        len,
                        acc,
                        dv,
                        hint,
                    );
                } else {
                    kern.attn_accum_hinted(&sc[i..], KEY_BLOCK, rows, v.stride, len, acc, dv, hint);
                }
            };
            runs(s, bs, j0, j1, |j, len, row0| {
                // A whole cache block next: its value rows are hinted from
                // inside the value pass (spread, not one burst).
                let (i, r) = (j - j0, next[j - j0]);
                let whole = r != usize::MAX && r % bs == 0 && len == bs;
                if let Some((pi, plen, prow, pwhole)) = pending {
                    let joins =
                        prow + plen == row0 && pwhole == whole && (!whole || next[pi] + plen == r);
                    if joins {
                        pending = Some((pi, plen + len, prow, pwhole));
                        return;
                    }
                    flush((pi, plen, prow, pwhole), &mut h.acc);
                }
                pending = Some((i, len, row0, whole));
            });
            if let Some(run) = pending {
                flush(run, &mut h.acc);
            }
        }
        j0 = j1;
    }
    if permuted {
        for h in st.iter_mut() {
            kern.attn_acc_permute(&mut h.acc, dv, false);
        }
    }
    if let [one] = st {
        std::mem::swap(&mut one.acc, &mut out.acc);
        std::mem::swap(&mut one.mx, &mut out.mx);
        std::mem::swap(&mut one.sum, &mut out.sum);
        return;
    }
    // Interleave the heads' states into the item's `[rows, heads]` order.
    let w = nkv * nh;
    out.acc.refill(nr * w * dv, 0.0);
    refill(&mut out.mx, nr * w, 0.0);
    refill(&mut out.sum, nr * w, 0.0);
    for (t, h) in st.iter().enumerate() {
        for ri in 0..nr {
            for hh in 0..nh {
                let (src, dst) = (ri * nh + hh, ri * w + t * nh + hh);
                out.mx[dst] = h.mx[src];
                out.sum[dst] = h.sum[src];
                out.acc[dst * dv..(dst + 1) * dv].copy_from_slice(&h.acc[src * dv..(src + 1) * dv]);
            }
        }
    }
}

/// Softmax over `scores` plus one extra logit `sink` that takes probability
/// mass but has no value (GPT-OSS attention sinks).
pub fn softmax_with_sink(scores: &mut [f32], sink: f32) {
    let m = scores.iter().copied().fold(sink, f32::max);
    let mut sum = (sink - m).exp();
    for v in scores.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in scores.iter_mut() {
        *v /= sum;
    }
}

/// The plain algorithm (what the model ran before the flash kernel): per
/// query row and head, every visible key's score, softmax (with the sink),
/// then the weighted sum of values. Same contract as [`attention`]; slow,
/// the reference in tests and the baseline of `epserve bench attention`.
pub fn reference(
    shape: &AttnShape<'_>,
    seqs: &[AttnSeq<'_>],
    q: &[f32],
    k: KvView<'_>,
    v: KvView<'_>,
    out: &mut [f32],
) {
    let (heads, dk, dv, bs) = (shape.heads, k.width, v.width, shape.block_size);
    let group = heads / shape.kv_heads;
    let (mut kr, mut scores) = (vec![0.0f32; dk], Vec::new());
    for s in seqs {
        for i in 0..s.len {
            let row = s.start + i;
            let pos = s.past + i;
            let first = match shape.window {
                Some(w) => (pos + 1).saturating_sub(w),
                None => 0,
            };
            for h in 0..heads {
                let kvh = h / group;
                let qh = &q[(row * heads + h) * dk..(row * heads + h + 1) * dk];
                scores.clear();
                for j in first..=pos {
                    let r = s.blocks[j / bs] as usize * bs + j % bs;
                    for (c, x) in kr.iter_mut().enumerate() {
                        *x = k.at(r, kvh * k.head_stride + c, bs);
                    }
                    scores.push(super::dot(qh, &kr) * shape.scale);
                }
                match shape.sinks {
                    None => super::softmax(&mut scores),
                    Some(sinks) => softmax_with_sink(&mut scores, sinks[h]),
                }
                let o = &mut out[(row * heads + h) * dv..(row * heads + h + 1) * dv];
                o.fill(0.0);
                for (jj, p) in scores.iter().enumerate() {
                    let j = first + jj;
                    let r = s.blocks[j / bs] as usize * bs + j % bs;
                    let base = r * v.stride + kvh * v.head_stride;
                    for (c, x) in o.iter_mut().enumerate() {
                        *x += p * v.rows.get(base + c);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::kernels::dispatch::Tier;
    use crate::kernels::layout::f32_to_bf16_bits;

    /// A score's bits do not depend on how many keys or queries share its
    /// kernel call (the tiers block 16 keys × 8 queries, pairs of keys, or
    /// one key at a time): one call over every key equals one call per key,
    /// and a query alone equals the same query inside a group.
    #[test]
    fn scores_do_not_depend_on_the_call_shape() {
        let mut rng = StdRng::seed_from_u64(11);
        for (dk, m) in [(128usize, 8usize), (128, 19), (40, 16), (13, 9), (64, 1)] {
            let (n, stride) = (37usize, dk + 5);
            let q: Vec<f32> = (0..m * dk)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let kf: Vec<f32> = (0..n * stride)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let kb: Vec<u16> = kf.iter().map(|&x| f32_to_bf16_bits(x)).collect();
            for rows in [KvRows::F32(&kf), KvRows::Bf16(&kb)] {
                for tier in Tier::available() {
                    let Some(kern) = Kernels::for_tier(tier) else {
                        continue;
                    };
                    let ldo = n + 3;
                    let mut whole = vec![0.0f32; m * ldo];
                    kern.attn_scores(&q, dk, rows, stride, n, 0.7, &mut whole, ldo);
                    let mut by_key = vec![0.0f32; m * ldo];
                    for i in 0..n {
                        kern.attn_scores(
                            &q,
                            dk,
                            rows.slice_from(i * stride),
                            stride,
                            1,
                            0.7,
                            &mut by_key[i..],
                            ldo,
                        );
                    }
                    let mut alone = vec![0.0f32; ldo];
                    let last = m - 1;
                    kern.attn_scores(&q[last * dk..], dk, rows, stride, n, 0.7, &mut alone, ldo);
                    for mi in 0..m {
                        for i in 0..n {
                            let (a, b) = (whole[mi * ldo + i], by_key[mi * ldo + i]);
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{} dk={dk} m={m} bf16={} query {mi} key {i}",
                                tier.name(),
                                rows.is_bf16()
                            );
                        }
                    }
                    let got = &whole[last * ldo..last * ldo + n];
                    assert_eq!(
                        got,
                        &alone[..n],
                        "{} dk={dk} m={m}: query alone",
                        tier.name()
                    );
                    // bf16 queries: blocks, single keys and a query alone
                    // agree bit for bit, and match the f32 scores of the
                    // rounded queries closely.
                    let qb: Vec<u16> = q.iter().map(|&x| f32_to_bf16_bits(x)).collect();
                    let qr: Vec<f32> = qb.iter().map(|&b| bf16_bits_to_f32(b)).collect();
                    let mut bw = vec![0.0f32; m * ldo];
                    kern.attn_scores_b16(&qr, &qb, dk, rows, stride, n, 0.7, &mut bw, ldo);
                    let mut bk = vec![0.0f32; m * ldo];
                    for i in 0..n {
                        let r = rows.slice_from(i * stride);
                        kern.attn_scores_b16(&qr, &qb, dk, r, stride, 1, 0.7, &mut bk[i..], ldo);
                    }
                    let mut ba = vec![0.0f32; ldo];
                    let (ql, qbl) = (&qr[last * dk..], &qb[last * dk..]);
                    kern.attn_scores_b16(ql, qbl, dk, rows, stride, n, 0.7, &mut ba, ldo);
                    let mut fr = vec![0.0f32; m * ldo];
                    kern.attn_scores(&qr, dk, rows, stride, n, 0.7, &mut fr, ldo);
                    for mi in 0..m {
                        for i in 0..n {
                            let x = bw[mi * ldo + i];
                            assert_eq!(
                                x.to_bits(),
                                bk[mi * ldo + i].to_bits(),
                                "{} b16",
                                tier.name()
                            );
                            assert!(
                                (x - fr[mi * ldo + i]).abs() < 1e-4,
                                "{} b16 vs f32",
                                tier.name()
                            );
                        }
                    }
                    assert_eq!(
                        &bw[last * ldo..last * ldo + n],
                        &ba[..n],
                        "{} b16 alone",
                        tier.name()
                    );
                }
            }
        }
    }

    /// Rows of `stride` elements (whole blocks of `bs`) stored by column
    /// inside each block, as [`KvView::by_column`] reads them.
    fn by_column<T: Copy + Default>(rows: &[T], stride: usize, bs: usize) -> Vec<T> {
        let mut out = vec![T::default(); rows.len()];
        for (r, row) in rows.chunks_exact(stride).enumerate() {
            for (c, &x) in row.iter().enumerate() {
                out[column_index(r, c, bs, stride)] = x;
            }
        }
        out
    }

    /// Scores against keys stored by column: one call over a block's run of
    /// positions equals one call per position and a query alone equals the
    /// same query in a group, bit for bit; every SIMD tier gives the same
    /// bits (two FMA chains per score); they match the row-layout scores
    /// (and the scalar twin, unfused) closely; bf16 queries likewise.
    #[test]
    fn scores_by_column_do_not_depend_on_the_call_shape() {
        let mut rng = StdRng::seed_from_u64(12);
        for (dk, m, bs, t0, n) in [
            (128usize, 8usize, 16usize, 0usize, 16usize),
            (128, 19, 16, 3, 13),
            (40, 16, 32, 5, 27),
            (13, 9, 5, 1, 4),
            (64, 1, 64, 0, 64),
            (7, 4, 24, 2, 21),
            (128, 6, 32, 0, 32),
            (9, 11, 48, 16, 32),
            // Blocks of 16 with odd key widths (AVX2's assembly column
            // pairs: a last even dimension alone; none odd at width 1).
            (13, 5, 16, 0, 16),
            (1, 4, 16, 0, 16),
        ] {
            let stride = dk + 3;
            let q: Vec<f32> = (0..m * dk)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let qb: Vec<u16> = q.iter().map(|&x| f32_to_bf16_bits(x)).collect();
            let qr: Vec<f32> = qb.iter().map(|&b| bf16_bits_to_f32(b)).collect();
            let kf: Vec<f32> = (0..bs * stride)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let kb: Vec<u16> = kf.iter().map(|&x| f32_to_bf16_bits(x)).collect();
            let (cf, cb) = (by_column(&kf, stride, bs), by_column(&kb, stride, bs));
            let ldo = n + 3;
            let mut simd_bits: [Option<Vec<u32>>; 2] = [None, None];
            for (slot, (rows, cols)) in [
                (KvRows::F32(&kf), KvRows::F32(&cf)),
                (KvRows::Bf16(&kb), KvRows::Bf16(&cb)),
            ]
            .into_iter()
            .enumerate()
            {
                for tier in Tier::available() {
                    let Some(kern) = Kernels::for_tier(tier) else {
                        continue;
                    };
                    let what = format!(
                        "{} dk={dk} m={m} bs={bs} t0={t0} n={n} bf16={slot}",
                        tier.name()
                    );
                    let mut whole = vec![0.0f32; m * ldo];
                    kern.attn_scores_cols(&q, dk, cols, bs, t0, n, 0.7, &mut whole, ldo);
                    let mut by_key = vec![0.0f32; m * ldo];
                    for i in 0..n {
                        let o = &mut by_key[i..];
                        kern.attn_scores_cols(&q, dk, cols, bs, t0 + i, 1, 0.7, o, ldo);
                    }
                    let last = m - 1;
                    let mut alone = vec![0.0f32; ldo];
                    kern.attn_scores_cols(
                        &q[last * dk..],
                        dk,
                        cols,
                        bs,
                        t0,
                        n,
                        0.7,
                        &mut alone,
                        ldo,
                    );
                    // With hints (the block itself, and one past the end:
                    // not hinted), the same bits.
                    for off in [0, cols.len()] {
                        let mut hinted = vec![0.0f32; m * ldo];
                        let h = Some((cols, off));
                        kern.attn_scores_cols_hinted(
                            &q,
                            dk,
                            cols,
                            bs,
                            t0,
                            n,
                            0.7,
                            &mut hinted,
                            ldo,
                            h,
                            h,
                        );
                        let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(b(&hinted), b(&whole), "{what}: hinted at {off}");
                    }
                    let mut want = vec![0.0f32; m * ldo];
                    let rk = rows.slice_from(t0 * stride);
                    kern.attn_scores(&q, dk, rk, stride, n, 0.7, &mut want, ldo);
                    for mi in 0..m {
                        for i in 0..n {
                            let x = whole[mi * ldo + i];
                            assert_eq!(
                                x.to_bits(),
                                by_key[mi * ldo + i].to_bits(),
                                "{what} query {mi} key {i}"
                            );
                            assert!(
                                (x - want[mi * ldo + i]).abs() < 1e-4,
                                "{what}: by column vs by row"
                            );
                        }
                    }
                    assert_eq!(
                        &whole[last * ldo..last * ldo + n],
                        &alone[..n],
                        "{what}: query alone"
                    );
                    let bits: Vec<u32> = (0..m)
                        .flat_map(|mi| whole[mi * ldo..mi * ldo + n].iter().map(|x| x.to_bits()))
                        .collect();
                    if tier != Tier::Generic {
                        match &simd_bits[slot] {
                            None => simd_bits[slot] = Some(bits),
                            Some(b) => assert_eq!(b, &bits, "{what}: SIMD tiers differ"),
                        }
                    }
                    // bf16 queries.
                    let mut bw = vec![0.0f32; m * ldo];
                    kern.attn_scores_cols_b16(
                        &qr, &qb, dk, cols, bs, t0, n, 0.7, &mut bw, ldo, None,
                    );
                    let mut bk = vec![0.0f32; m * ldo];
                    for i in 0..n {
                        let o = &mut bk[i..];
                        kern.attn_scores_cols_b16(
                            &qr,
                            &qb,
                            dk,
                            cols,
                            bs,
                            t0 + i,
                            1,
                            0.7,
                            o,
                            ldo,
                            None,
                        );
                    }
                    for off in [0, cols.len()] {
                        let mut bh = vec![0.0f32; m * ldo];
                        let h = Some((cols, off));
                        kern.attn_scores_cols_b16(
                            &qr, &qb, dk, cols, bs, t0, n, 0.7, &mut bh, ldo, h,
                        );
                        let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(b(&bh), b(&bw), "{what} b16: hinted at {off}");
                    }
                    let mut ba = vec![0.0f32; ldo];
                    let (ql, qbl) = (&qr[last * dk..], &qb[last * dk..]);
                    kern.attn_scores_cols_b16(
                        ql, qbl, dk, cols, bs, t0, n, 0.7, &mut ba, ldo, None,
                    );
                    let mut fr = vec![0.0f32; m * ldo];
                    kern.attn_scores_cols(&qr, dk, cols, bs, t0, n, 0.7, &mut fr, ldo);
                    for mi in 0..m {
                        for i in 0..n {
                            let x = bw[mi * ldo + i];
                            assert_eq!(x.to_bits(), bk[mi * ldo + i].to_bits(), "{what} b16");
                            assert!((x - fr[mi * ldo + i]).abs() < 1e-4, "{what} b16 vs f32");
                        }
                    }
                    assert_eq!(
                        &bw[last * ldo..last * ldo + n],
                        &ba[..n],
                        "{what} b16 alone"
                    );
                }
            }
        }
    }

    #[test]
    fn sink_takes_mass() {
        let mut s = vec![0.0, 0.0];
        softmax_with_sink(&mut s, 0.0);
        assert!((s[0] - 1.0 / 3.0).abs() < 1e-7 && (s[1] - 1.0 / 3.0).abs() < 1e-7);
    }

    /// A random layer storage and batch; checks every tier's flash kernel
    /// against [`reference`] on the same (f32 or bf16) cache.
    #[allow(clippy::too_many_arguments)]
    fn case(
        rng: &mut StdRng,
        heads: usize,
        kv_heads: usize,
        dk: usize,
        dv: usize,
        mla: bool,
        window: Option<usize>,
        sinks: bool,
        bs: usize,
        seqs: &[(usize, usize)],
        bf16: bool,
    ) {
        let total_blocks: usize = seqs.iter().map(|&(p, l)| (p + l).div_ceil(bs)).sum();
        let mut ids: Vec<u32> = (0..total_blocks as u32 + 3).collect();
        ids.shuffle(rng);
        let rows = (total_blocks + 3) * bs;
        // MLA: one row holds the latent (values = its first dv) + RoPE key.
        let kstride = if mla { dk } else { kv_heads * dk + 3 };
        let vstride = if mla { dk } else { kv_heads * dv + 1 };
        let kf: Vec<f32> = (0..rows * kstride)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let vf: Vec<f32> = (0..rows * vstride)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let (kb, vb): (Vec<u16>, Vec<u16>) = (
            kf.iter().map(|&x| f32_to_bf16_bits(x)).collect(),
            vf.iter().map(|&x| f32_to_bf16_bits(x)).collect(),
        );
        let (krows, vrows) = if bf16 {
            (KvRows::Bf16(&kb[..]), KvRows::Bf16(&vb[..]))
        } else {
            (KvRows::F32(&kf[..]), KvRows::F32(&vf[..]))
        };
        let k = KvView {
            rows: krows,
            stride: kstride,
            head_stride: if mla { 0 } else { dk },
            width: dk,
            by_column: false,
        };
        let v = if mla {
            KvView {
                rows: krows,
                stride: kstride,
                head_stride: 0,
                width: dv,
                by_column: false,
            }
        } else {
            KvView {
                rows: vrows,
                stride: vstride,
                head_stride: dv,
                width: dv,
                by_column: false,
            }
        };
        let mut tables = Vec::new();
        let mut next = 0;
        for &(p, l) in seqs {
            let nb = (p + l).div_ceil(bs);
            tables.push(ids[next..next + nb].to_vec());
            next += nb;
        }
        let mut batch = Vec::new();
        let mut start = 0;
        for (i, &(p, l)) in seqs.iter().enumerate() {
            batch.push(AttnSeq {
                blocks: &tables[i],
                start,
                len: l,
                past: p,
            });
            start += l;
        }
        let t = start;
        let q: Vec<f32> = (0..t * heads * dk)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let sink_v: Vec<f32> = (0..heads).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let mut shape = AttnShape {
            heads,
            kv_heads,
            scale: (dk as f32).powf(-0.5) * 2.0,
            window,
            sinks: sinks.then_some(&sink_v[..]),
            block_size: bs,
            bf16_queries: false,
        };
        // Keys stored by column (as the pool stores a GQA layer's), read
        // by the flash kernel and the reference alike.
        let (kfc, kbc) = (by_column(&kf, kstride, bs), by_column(&kb, kstride, bs));
        let kc = KvView {
            rows: if bf16 {
                KvRows::Bf16(&kbc[..])
            } else {
                KvRows::F32(&kfc[..])
            },
            by_column: true,
            ..k
        };
        let mut want = vec![0.0f32; t * heads * dv];
        reference(&shape, &batch, &q, k, v, &mut want);
        if !mla {
            let mut again = vec![0.0f32; t * heads * dv];
            reference(&shape, &batch, &q, kc, v, &mut again);
            assert_eq!(want, again, "the reference reads keys by column");
        }
        // bf16 queries: the reference on the rounded queries.
        let qr: Vec<f32> = q
            .iter()
            .map(|&x| bf16_bits_to_f32(f32_to_bf16_bits(x)))
            .collect();
        let mut want_r = vec![0.0f32; t * heads * dv];
        reference(&shape, &batch, &qr, k, v, &mut want_r);
        for (tier, bq) in Tier::available()
            .into_iter()
            .flat_map(|t| [(t, false), (t, true)])
        {
            let Some(kern) = Kernels::for_tier(tier) else {
                continue;
            };
            shape.bf16_queries = bq;
            let want = if bq { &want_r } else { &want };
            for kview in [k, kc].into_iter().take(if mla { 1 } else { 2 }) {
                let mut got = vec![f32::NAN; t * heads * dv];
                attention(&kern, &shape, &batch, &q, kview, v, &mut got);
                let worst = got
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    worst <= 2e-5,
                    "{} heads={heads}/{kv_heads} dk={dk} dv={dv} mla={mla} window={window:?} sinks={sinks} bs={bs} seqs={seqs:?} bf16={bf16} bf16 queries={bq} keys by column={}: max diff {worst}",
                    tier.name(),
                    kview.by_column
                );
            }
        }
    }

    /// A row's output does not depend on the tile or batch it ran in: the
    /// last rows of a prefill equal the same rows run as their own chunk,
    /// bit for bit (attention-workers retry a step and must agree).
    #[test]
    fn rows_are_bit_identical_in_any_tile() {
        // Short, and crossing key splits (SPLIT_KEYS) inside the tile; runs
        // of 4 keys, and of 16 (the AVX-512 16-key score blocks).
        for (past, len, bs) in [
            (150usize, 21usize, 4usize),
            (SPLIT_KEYS * 2 - 20, 40, 4),
            (150, 21, 16),
        ] {
            bit_identical_case(past, len, bs);
        }
    }

    fn bit_identical_case(past: usize, len: usize, bs: usize) {
        let mut rng = StdRng::seed_from_u64(3);
        let (heads, kv_heads, d) = (16usize, 2usize, 40usize);
        let total = past + len;
        let w = kv_heads * d;
        let blocks: Vec<u32> = (0..total.div_ceil(bs) as u32).rev().collect();
        let kv: Vec<f32> = (0..total.div_ceil(bs) * bs * w)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let view = KvView {
            rows: KvRows::F32(&kv),
            stride: w,
            head_stride: d,
            width: d,
            by_column: false,
        };
        let q: Vec<f32> = (0..len * heads * d)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let sinks: Vec<f32> = (0..heads).map(|h| h as f32 * 0.1).collect();
        let kvb: Vec<u16> = kv.iter().map(|&x| f32_to_bf16_bits(x)).collect();
        let bview = KvView {
            rows: KvRows::Bf16(&kvb),
            ..view
        };
        let (kvc, kvbc) = (by_column(&kv, w, bs), by_column(&kvb, w, bs));
        for (window, bf16, cols) in [
            (None, false, false),
            (Some(37), false, false),
            (None, true, false),
            (Some(37), true, false),
            (None, false, true),
            (Some(37), true, true),
        ] {
            let view = if bf16 { bview } else { view };
            let kview = match (cols, bf16) {
                (false, _) => view,
                (true, false) => KvView {
                    rows: KvRows::F32(&kvc),
                    by_column: true,
                    ..view
                },
                (true, true) => KvView {
                    rows: KvRows::Bf16(&kvbc),
                    by_column: true,
                    ..view
                },
            };
            let shape = AttnShape {
                heads,
                kv_heads,
                scale: 0.3,
                window,
                sinks: Some(&sinks),
                block_size: bs,
                bf16_queries: bf16,
            };
            for tier in Tier::available() {
                let Some(kern) = Kernels::for_tier(tier) else {
                    continue;
                };
                let whole = AttnSeq {
                    blocks: &blocks,
                    start: 0,
                    len,
                    past,
                };
                let mut a = vec![0.0f32; len * heads * d];
                attention(&kern, &shape, &[whole], &q, kview, view, &mut a);
                let tail = 3;
                let part = AttnSeq {
                    blocks: &blocks,
                    start: 0,
                    len: tail,
                    past: past + len - tail,
                };
                let mut b = vec![0.0f32; tail * heads * d];
                attention(
                    &kern,
                    &shape,
                    &[part],
                    &q[(len - tail) * heads * d..],
                    kview,
                    view,
                    &mut b,
                );
                assert_eq!(
                    &a[(len - tail) * heads * d..],
                    &b[..],
                    "{} window {window:?} bf16 {bf16} keys by column {cols}",
                    tier.name()
                );
            }
        }
    }

    /// The plan groups the most KV heads per item that still leaves
    /// [`ITEMS_PER_THREAD`] items per thread (or none when even one KV head
    /// per item does not).
    #[test]
    fn the_plan_groups_as_many_kv_heads_as_the_threads_allow() {
        let want = ITEMS_PER_THREAD * rayon::current_num_threads();
        let blocks: Vec<u32> = (0..1024).collect();
        let shape = AttnShape {
            heads: 32,
            kv_heads: 8,
            scale: 1.0,
            window: None,
            sinks: None,
            block_size: 16,
            bf16_queries: false,
        };
        for past in [10, 2000, 8000, 16000] {
            let seqs = [AttnSeq {
                blocks: &blocks,
                start: 0,
                len: 1,
                past,
            }];
            // Head planes: one KV head per item, whatever the length.
            assert!(plan(&shape, &seqs, false).iter().all(|it| it.nkv == 1));
            let items = plan(&shape, &seqs, true);
            let nkv = items[0].nkv;
            assert!(items.iter().all(|it| it.nkv == nkv));
            assert!(
                nkv == 1 || items.len() >= want,
                "{past}: {nkv} {}",
                items.len()
            );
            if nkv < 8 {
                let more = plan_with(&shape, &seqs, nkv * 2);
                assert!(more.len() < want, "{past}: {nkv} could be {}", nkv * 2);
            }
        }
    }

    /// Grouping KV heads into one work item (as decode does when there are
    /// enough items) changes no bit of any row, on every tier, f32 and bf16
    /// caches, prefill tiles and decode rows, windows and sinks.
    #[test]
    fn kv_head_grouping_changes_no_bit() {
        let mut rng = StdRng::seed_from_u64(11);
        let (heads, kv_heads, d, bs) = (16usize, 4usize, 48usize, 8usize);
        let w = kv_heads * d;
        let lens = [(0usize, 19usize), (SPLIT_KEYS + 30, 1), (77, 1)];
        let mut starts = Vec::new();
        let mut tables = Vec::new();
        let mut next_block = 0u32;
        let mut row = 0;
        for &(past, len) in &lens {
            let nb = (past + len).div_ceil(bs) as u32;
            let mut t: Vec<u32> = (next_block..next_block + nb).collect();
            t.shuffle(&mut rng);
            next_block += nb;
            tables.push(t);
            starts.push(row);
            row += len;
        }
        let kv: Vec<f32> = (0..next_block as usize * bs * w)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let kvb: Vec<u16> = kv.iter().map(|&x| f32_to_bf16_bits(x)).collect();
        // bf16 values, so the runs with bf16 queries match the reference too.
        let q: Vec<f32> = (0..row * heads * d)
            .map(|_| bf16_bits_to_f32(f32_to_bf16_bits(rng.random_range(-1.0f32..1.0))))
            .collect();
        let seqs: Vec<AttnSeq<'_>> = lens
            .iter()
            .enumerate()
            .map(|(i, &(past, len))| AttnSeq {
                blocks: &tables[i],
                start: starts[i],
                len,
                past,
            })
            .collect();
        let sinks: Vec<f32> = (0..heads).map(|h| h as f32 * 0.05).collect();
        for rows in [KvRows::F32(&kv), KvRows::Bf16(&kvb)] {
            let view = KvView {
                rows,
                stride: w,
                head_stride: d,
                width: d,
                by_column: false,
            };
            for (window, sinks) in [(None, None), (Some(45), Some(&sinks[..]))] {
                let shape = AttnShape {
                    heads,
                    kv_heads,
                    scale: 0.2,
                    window,
                    sinks,
                    block_size: bs,
                    bf16_queries: window.is_some(),
                };
                for tier in Tier::available() {
                    let Some(kern) = Kernels::for_tier(tier) else {
                        continue;
                    };
                    let mut outs = Vec::new();
                    for nkv in [1, 2, 4] {
                        let items = plan_with(&shape, &seqs, nkv);
                        assert!(items.iter().all(|it| it.nkv == nkv));
                        for whole in [false, true] {
                            let mut o = vec![0.0f32; row * heads * d];
                            run_items(&kern, &shape, &seqs, &items, whole, &q, view, view, &mut o);
                            outs.push(o);
                        }
                    }
                    // Whole groups per task or one split per task, one KV
                    // head per item or several: the same bits.
                    for (i, o) in outs.iter().enumerate().skip(1) {
                        assert_eq!(
                            &outs[0],
                            o,
                            "{} nkv {}, whole {}",
                            tier.name(),
                            [1, 2, 4][i / 2],
                            i % 2 == 1
                        );
                    }
                    let mut want = vec![0.0f32; row * heads * d];
                    reference(&shape, &seqs, &q, view, view, &mut want);
                    let err = want
                        .iter()
                        .zip(&outs[5])
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0f32, f32::max);
                    assert!(err < 1e-4, "{} vs reference: {err}", tier.name());
                }
            }
        }
    }

    #[test]
    fn flash_matches_reference_on_every_tier() {
        let mut rng = StdRng::seed_from_u64(7);
        for bf16 in [false, true] {
            // GQA groups, prefill + decode mixes, blocks splitting sequences.
            let mix: &[(usize, usize)] = &[(0, 37), (70, 1), (5, 9), (129, 1)];
            case(&mut rng, 8, 2, 32, 32, false, None, false, 16, mix, bf16);
            case(&mut rng, 8, 2, 32, 32, false, None, false, 3, mix, bf16);
            case(
                &mut rng,
                32,
                4,
                128,
                128,
                false,
                None,
                false,
                16,
                &[(0, 100), (300, 1)],
                bf16,
            );
            case(&mut rng, 4, 4, 20, 20, false, None, false, 1, mix, bf16);
            case(&mut rng, 6, 1, 13, 13, false, Some(8), false, 5, mix, bf16);
            // Long contexts: split-K pieces merged (decode past a split,
            // prefill tiles crossing one, a window spanning one).
            let long: &[(usize, usize)] = &[(SPLIT_KEYS * 2 + 37, 1), (SPLIT_KEYS - 5, 30), (0, 1)];
            case(&mut rng, 8, 2, 32, 32, false, None, false, 16, long, bf16);
            case(
                &mut rng,
                8,
                2,
                16,
                16,
                false,
                Some(100),
                true,
                7,
                long,
                bf16,
            );
            // Sliding window + sinks (GPT-OSS).
            case(&mut rng, 8, 2, 64, 64, false, Some(16), true, 16, mix, bf16);
            case(&mut rng, 8, 2, 24, 24, false, None, true, 7, mix, bf16);
            case(&mut rng, 4, 2, 16, 16, false, Some(1), true, 4, mix, bf16);
            // MLA: one latent for all heads, key = latent + RoPE key, value
            // = the latent (dk != dv); groups beyond one item's heads.
            case(&mut rng, 4, 1, 40, 32, true, None, false, 16, mix, bf16);
            case(&mut rng, 20, 1, 72, 64, true, None, false, 3, mix, bf16);
            case(
                &mut rng,
                2,
                1,
                9,
                7,
                true,
                None,
                false,
                2,
                &[(0, 70), (3, 1)],
                bf16,
            );
        }
    }
}
