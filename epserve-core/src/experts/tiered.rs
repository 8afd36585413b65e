//! [`TieredExperts`]: experts held under a memory budget
//! (`--expert-memory`), for models whose experts do not all fit in RAM.
//!
//! Every expert assigned here is in one of three tiers:
//!
//! - **resident**: packed, never evicted (and `mlock`ed with
//!   [`TierOptions::mlock`]); the tier holds the experts this executor used
//!   most over a decaying window of its own calls, re-chosen every
//!   [`TierOptions::retier_calls`] calls (promotion and demotion move an
//!   already packed expert between tiers: no repacking);
//! - **cached**: packed on first use from the memory-mapped checkpoint (the
//!   page cache serves the reads) into an LRU cache that fills the rest of
//!   the budget;
//! - **cold**: only in the checkpoint.
//!
//! The packed bytes held (resident + cached, plus an expert being packed)
//! never exceed the budget: a call whose cold experts do not all fit at once
//! runs in groups, each group's experts evicted before the next is packed.
//! Outputs are the same as [`PackedExperts`] holding every expert (the same
//! packing and kernels, and each slot written by exactly one group).
//!
//! [`TieredExperts::prefetch`] takes the experts a router lookahead predicts
//! for a coming layer and packs the missing ones on a background thread, so
//! the call that needs them finds them cached; the [`TierStats`] count hits,
//! misses, evictions, bytes paged in and prefetch hits.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::experts::executor::PackedExperts;
use crate::experts::load::pack_expert;
use crate::experts::packed::{PackedExpert, Spare};
use crate::experts::pool::ExpertPool;
use crate::experts::{ExpertDtype, LoadOptions};
use crate::loader::names::ExpertNames;
use crate::loader::weights::WeightStore;
use crate::moe::{ExpertExecutor, ExpertState, Rows, SKIP_SLOT};

/// How a [`TieredExperts`] splits its budget.
#[derive(Debug, Clone)]
pub struct TierOptions {
    /// Bytes of packed experts held at most (resident + cached).
    pub budget: usize,
    /// Share of the budget for the resident tier (the rest is the LRU
    /// cache), 0..=1.
    pub resident_fraction: f64,
    /// `mlock` the resident experts (a failure, e.g. `RLIMIT_MEMLOCK`, is
    /// logged once and the experts stay resident unlocked).
    pub mlock: bool,
    /// Calls between two choices of the resident tier.
    pub retier_calls: u64,
    /// Pack experts named by [`TieredExperts::prefetch`] in the background.
    pub prefetch: bool,
    /// Precision by load (`--expert-precision-policy load`): the most used
    /// experts that together take this share of the window's expert uses
    /// run in bf16 (exact packing), every other one in int8 W8A8 (half the
    /// bytes, so more of them fit). `None`: every expert in the precision
    /// [`LoadOptions`] asks for.
    pub bf16_share: Option<f64>,
}

impl Default for TierOptions {
    fn default() -> Self {
        TierOptions {
            budget: 0,
            resident_fraction: 0.5,
            mlock: false,
            retier_calls: 256,
            prefetch: true,
            bf16_share: None,
        }
    }
}

/// Where one expert is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    Resident,
    Cached,
    Cold,
}

impl Tier {
    /// `resident`, `cached` or `cold`.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Resident => "resident",
            Tier::Cached => "cached",
            Tier::Cold => "cold",
        }
    }
}

/// Counters of a [`TieredExperts`] since it was built.
#[derive(Debug, Default)]
pub struct TierStats {
    /// Expert uses (one per expert per call) found packed.
    pub hits: AtomicU64,
    /// Expert uses that packed the expert first.
    pub misses: AtomicU64,
    /// Cached experts dropped to make room.
    pub evictions: AtomicU64,
    /// Bytes of packed experts built from the checkpoint (misses and
    /// prefetches).
    pub bytes_paged_in: AtomicU64,
    /// Experts named by prefetch hints that were not packed yet.
    pub hinted: AtomicU64,
    /// Experts the prefetcher packed (a hint is dropped when making room
    /// would evict an expert the last two steps used).
    pub prefetched: AtomicU64,
    /// Prefetched experts used before being evicted.
    pub prefetch_hits: AtomicU64,
    /// Experts moved between the resident tier and the cache.
    pub promotions: AtomicU64,
    pub demotions: AtomicU64,
    /// Extra passes of a call whose cold experts did not fit at once.
    pub split_calls: AtomicU64,
    /// Packed experts repacked in another precision (precision by load).
    pub repacked: AtomicU64,
}

/// A snapshot of [`TierStats`] plus the bytes held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierSnapshot {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub bytes_paged_in: u64,
    pub hinted: u64,
    pub prefetched: u64,
    pub prefetch_hits: u64,
    pub promotions: u64,
    pub demotions: u64,
    pub split_calls: u64,
    pub repacked: u64,
    /// Packed experts held in bf16 and in int8.
    pub bf16_experts: u64,
    pub int8_experts: u64,
    pub resident_bytes: u64,
    pub cached_bytes: u64,
    pub budget_bytes: u64,
    pub resident_experts: u64,
    pub cached_experts: u64,
    pub held_experts: u64,
}

struct Entry {
    ex: Arc<PackedExpert>,
    /// The precision it was packed in.
    dtype: ExpertDtype,
    resident: bool,
    last_use: u64,
    /// `State::calls` when last used (or packed).
    last_call: u64,
    /// Packed by the prefetcher and not used yet.
    prefetched: bool,
    locked: bool,
}

#[derive(Default)]
struct State {
    entries: HashMap<(usize, usize), Entry>,
    resident_bytes: usize,
    cached_bytes: usize,
    /// Bytes reserved for experts being packed.
    reserved: usize,
    tick: u64,
    /// Tokens routed to each expert, halved at every re-tiering.
    uses: HashMap<(usize, usize), f64>,
    calls: u64,
    mlock_failed: bool,
    /// The resident tier the last re-tiering chose: an expert of it that was
    /// not packed then becomes resident when it is next packed.
    want_resident: std::collections::HashSet<(usize, usize)>,
    /// Precision by load: the experts that run in bf16 (the rest int8).
    bf16: std::collections::HashSet<(usize, usize)>,
    /// Experts the placement asks in int8 (the coordinator's precision
    /// policy), whatever the options and the local policy say.
    int8: BTreeSet<(usize, usize)>,
    /// Share of recent prefetches evicted before any use (a moving
    /// average over outcomes, 0 = every guess used). Above a half, guesses
    /// cost more than they save (each is a full pack on cores the calls
    /// need, and takes a slot from a used expert): only every
    /// [`SAMPLED_HINT`]th hint is taken, to keep measuring.
    prefetch_waste: f64,
    /// Hints offered (for the sampling above).
    hints_seen: u64,
    /// `[layer][expert]`: assigned here (warmed at load, listed by
    /// [`TieredExperts::tiers`]). Any expert of the model can be served: a
    /// call in flight across a change of assignment still finds its experts.
    assigned: Vec<Vec<bool>>,
}

impl State {
    fn is_assigned(&self, l: usize, e: usize) -> bool {
        self.assigned
            .get(l)
            .and_then(|a| a.get(e))
            .copied()
            .unwrap_or(false)
    }
}

/// Under wasteful prefetching, one hint in this many is still taken.
const SAMPLED_HINT: u64 = 8;

impl State {
    /// Records whether a prefetched expert was used before it left.
    fn prefetch_outcome(&mut self, used: bool) {
        self.prefetch_waste = 0.95 * self.prefetch_waste + if used { 0.0 } else { 0.05 };
    }

    fn held_bytes(&self) -> usize {
        self.resident_bytes + self.cached_bytes + self.reserved
    }
}

struct Inner {
    core: PackedExperts,
    cfg: ModelConfig,
    ws: Arc<WeightStore>,
    opts: LoadOptions,
    tier: TierOptions,
    /// The model's MoE layers (`true` at their index).
    moe: Vec<bool>,
    /// Intermediate width of each MoE layer's experts.
    inter: Vec<usize>,
    /// Packed bytes of one expert by (layer, precision asked).
    sizes: HashMap<(usize, ExpertDtypeKey), usize>,
    resident_cap: usize,
    state: Mutex<State>,
    stats: TierStats,
    /// Serializes calls (the core's workspace is one per executor, and a
    /// call's groups must not interleave with another call's evictions).
    call: Mutex<()>,
}

/// [`ExpertDtype`] as a hash key.
type ExpertDtypeKey = u8;

fn dtype_key(d: ExpertDtype) -> ExpertDtypeKey {
    match d {
        ExpertDtype::Auto => 0,
        ExpertDtype::Bf16 => 1,
        ExpertDtype::Int8 => 2,
    }
}

/// Experts under a memory budget: resident, cached and cold tiers.
pub struct TieredExperts {
    inner: Arc<Inner>,
    prefetch_tx: Option<SyncSender<Prefetch>>,
}

impl TieredExperts {
    /// The experts of `cfg` for which `keep(layer, expert)` holds, under
    /// `tier.budget` bytes of packed weights: sizes are learned by packing
    /// one expert per layer and precision, then the budget is filled in
    /// round-robin order over the layers (resident tier first, then the
    /// cache) so that a fresh executor starts warm.
    pub fn load(
        cfg: &ModelConfig,
        ws: Arc<WeightStore>,
        opts: &LoadOptions,
        keep: &(impl Fn(usize, usize) -> bool + Sync),
        tier: TierOptions,
    ) -> Result<Self> {
        if let Some(s) = tier.bf16_share
            && !(0.0..=1.0).contains(&s)
        {
            return Err(Error::Dispatch(format!(
                "the bf16 share of expert uses must be in 0..=1, got {s}"
            )));
        }
        if !(0.0..=1.0).contains(&tier.resident_fraction) {
            return Err(Error::Dispatch(format!(
                "the resident share of the expert memory must be in 0..=1, got {}",
                tier.resident_fraction
            )));
        }
        let n = cfg.num_experts;
        let mut moe = vec![false; cfg.num_hidden_layers];
        for l in cfg.moe_layers() {
            moe[l] = true;
        }
        let assigned = assignment(cfg, keep);
        let pool = match opts.threads {
            Some(t) => Arc::new(ExpertPool::new(Some(t), opts.pin_threads)?),
            None => ExpertPool::shared()?,
        };
        let core = PackedExperts::new(
            (0..cfg.num_hidden_layers).map(|_| None).collect(),
            cfg.hidden_size,
            pool,
        )?;
        // One expert per (layer, precision) gives every size.
        let mut sizes = HashMap::new();
        let mut inter = vec![0; cfg.num_hidden_layers];
        let mut probes: Vec<((usize, usize), ExpertDtype, PackedExpert)> = Vec::new();
        for l in cfg.moe_layers() {
            for e in 0..n {
                // int8 always: a placement may ask any expert in int8.
                let asked: Vec<ExpertDtype> = match tier.bf16_share {
                    None => vec![ExpertDtype::Int8, opts.dtype_for(l, e)],
                    Some(_) => vec![ExpertDtype::Int8, hot_dtype(opts)],
                };
                for dt in asked {
                    let key = (l, dtype_key(dt));
                    if sizes.contains_key(&key) {
                        continue;
                    }
                    let names = ExpertNames::resolve(cfg, &ws, l)?;
                    let p = pack_expert(cfg, &ws, &names, dt, l, e, &mut Spare::default())?;
                    sizes.insert(key, p.weight_bytes());
                    inter[l] = p.inter;
                    // The cold precision first: the warm fill starts int8.
                    if probes.iter().all(|(k, _, _)| *k != (l, e)) {
                        probes.push(((l, e), dt, p));
                    }
                }
            }
        }
        let largest = sizes.values().copied().max().unwrap_or(0);
        if tier.budget < largest {
            return Err(Error::Dispatch(format!(
                "--expert-memory {} cannot hold one expert ({} packed)",
                crate::loader::progress::human_bytes(tier.budget as u64),
                crate::loader::progress::human_bytes(largest as u64)
            )));
        }
        let resident_cap = (tier.budget as f64 * tier.resident_fraction) as usize;
        let inner = Arc::new(Inner {
            core,
            cfg: cfg.clone(),
            ws,
            opts: opts.clone(),
            tier: tier.clone(),
            moe,
            inter,
            sizes,
            resident_cap,
            state: Mutex::new(State {
                assigned,
                ..State::default()
            }),
            stats: TierStats::default(),
            call: Mutex::new(()),
        });
        inner.warm(probes)?;
        let prefetch_tx = if tier.prefetch || tier.bf16_share.is_some() {
            let (tx, rx) = sync_channel::<Prefetch>(64);
            let weak = Arc::downgrade(&inner);
            std::thread::Builder::new()
                .name("epserve-prefetch".into())
                .spawn(move || prefetch_loop(weak, rx))
                .map_err(|e| Error::Dispatch(format!("cannot start the prefetch thread: {e}")))?;
            Some(tx)
        } else {
            None
        };
        Ok(TieredExperts { inner, prefetch_tx })
    }

    /// The counters and bytes held now.
    pub fn snapshot(&self) -> TierSnapshot {
        self.inner.snapshot()
    }

    /// Changes the experts assigned here (a new placement): packed experts
    /// no longer assigned are dropped (a call in flight keeps its own
    /// reference), and newly assigned ones are packed while the budget has
    /// room. Experts that stay assigned keep their tier.
    pub fn assign(&self, keep: &(impl Fn(usize, usize) -> bool + Sync)) -> Result<()> {
        let int8 = self.inner.lock().int8.clone();
        self.assign_with_int8(keep, &int8)
    }

    /// [`Self::assign`], with the experts the placement asks in int8: packed
    /// experts in another precision than they now need are dropped (and
    /// packed again in theirs when used or warmed).
    pub fn assign_with_int8(
        &self,
        keep: &(impl Fn(usize, usize) -> bool + Sync),
        int8: &BTreeSet<(usize, usize)>,
    ) -> Result<()> {
        let assigned = assignment(&self.inner.cfg, keep);
        {
            let mut st = self.inner.lock();
            st.int8 = int8.clone();
            let gone: Vec<(usize, usize)> = st
                .entries
                .iter()
                .filter(|&(&(l, e), en)| {
                    !assigned[l].get(e).copied().unwrap_or(false)
                        || en.dtype != self.inner.want_dtype(&st, l, e)
                })
                .map(|(k, _)| *k)
                .collect();
            for k in gone {
                self.inner.take(&mut st, k);
            }
            st.uses
                .retain(|&(l, e), _| assigned[l].get(e).copied().unwrap_or(false));
            st.assigned = assigned;
        }
        self.inner.warm(Vec::new())
    }

    /// `((resident, cached) bytes as counted, the same summed over the
    /// entries held)`: equal unless the accounting leaks.
    #[cfg(test)]
    pub(crate) fn accounting(&self) -> ((usize, usize), (usize, usize)) {
        let st = self.inner.lock();
        let held = |resident: bool| -> usize {
            st.entries
                .values()
                .filter(|en| en.resident == resident)
                .map(|en| en.ex.weight_bytes())
                .sum()
        };
        (
            (st.resident_bytes, st.cached_bytes),
            (held(true), held(false)),
        )
    }

    /// The tier of every expert assigned here.
    pub fn tiers(&self) -> BTreeMap<(usize, usize), Tier> {
        let st = self.inner.lock();
        let mut out = BTreeMap::new();
        for (l, hl) in st.assigned.iter().enumerate() {
            for (e, _) in hl.iter().enumerate().filter(|(_, h)| **h) {
                let t = match st.entries.get(&(l, e)) {
                    Some(en) if en.resident => Tier::Resident,
                    Some(_) => Tier::Cached,
                    None => Tier::Cold,
                };
                out.insert((l, e), t);
            }
        }
        out
    }

    /// The precision expert `e` of `layer` is packed in, if packed.
    pub fn precision_of(&self, layer: usize, e: usize) -> Option<ExpertDtype> {
        self.inner
            .lock()
            .entries
            .get(&(layer, e))
            .map(|en| en.dtype)
    }

    /// The budget in bytes.
    pub fn budget(&self) -> usize {
        self.inner.tier.budget
    }

    /// Asks for `experts` of `layer` to be packed ahead of their use (a
    /// router lookahead's prediction). Returns at once; a full queue drops
    /// the hint. Experts not assigned here, or already packed, are ignored.
    pub fn prefetch_hint(&self, layer: usize, experts: &[u32]) {
        let Some(tx) = self
            .prefetch_tx
            .as_ref()
            .filter(|_| self.inner.tier.prefetch)
        else {
            return;
        };
        let want: Vec<u32> = {
            let mut st = self.inner.lock();
            st.hints_seen += 1;
            if st.prefetch_waste > 0.5 && !st.hints_seen.is_multiple_of(SAMPLED_HINT) {
                return;
            }
            experts
                .iter()
                .copied()
                .filter(|&e| {
                    st.is_assigned(layer, e as usize)
                        && !st.entries.contains_key(&(layer, e as usize))
                })
                .collect()
        };
        if want.is_empty() {
            return;
        }
        self.inner
            .stats
            .hinted
            .fetch_add(want.len() as u64, Ordering::Relaxed);
        // A full queue drops the hint (a guess is not worth waiting for).
        let _ = tx.try_send(Prefetch::Hint(layer, want));
    }

    /// Waits until every prefetch asked before has been handled (tests and
    /// benchmarks).
    pub fn prefetch_idle(&self) {
        if let Some(tx) = &self.prefetch_tx {
            let (done_tx, done_rx) = sync_channel(1);
            if tx.send(Prefetch::Flush(done_tx)).is_ok() {
                let _ = done_rx.recv();
            }
        }
    }
}

/// The precision of a hot expert under precision by load: the asked one,
/// or exact bf16 when int8 was asked for every expert.
fn hot_dtype(opts: &LoadOptions) -> ExpertDtype {
    match opts.expert_dtype {
        ExpertDtype::Int8 => ExpertDtype::Auto,
        d => d,
    }
}

/// `[layer][expert]` for which `keep` holds, on the MoE layers.
fn assignment(cfg: &ModelConfig, keep: &(impl Fn(usize, usize) -> bool + Sync)) -> Vec<Vec<bool>> {
    let mut a = vec![Vec::new(); cfg.num_hidden_layers];
    for l in cfg.moe_layers() {
        a[l] = (0..cfg.num_experts).map(|e| keep(l, e)).collect();
    }
    a
}

/// What the prefetch thread is asked.
enum Prefetch {
    /// Pack these experts of this layer.
    Hint(usize, Vec<u32>),
    /// Repack these experts in the precision they should have now.
    Repack(Vec<(usize, usize)>),
    /// Answer once everything before is done.
    Flush(SyncSender<()>),
}

fn prefetch_loop(inner: Weak<Inner>, rx: Receiver<Prefetch>) {
    while let Ok(msg) = rx.recv() {
        match msg {
            Prefetch::Hint(layer, experts) => {
                let Some(inner) = inner.upgrade() else {
                    return;
                };
                for e in experts {
                    if let Err(err) = inner.prefetch_one(layer, e as usize) {
                        tracing::warn!(layer, expert = e, error = %err, "prefetch failed");
                    }
                }
            }
            Prefetch::Repack(list) => {
                let Some(inner) = inner.upgrade() else {
                    return;
                };
                for (layer, e) in list {
                    if let Err(err) = inner.repack_one(layer, e) {
                        tracing::warn!(layer, expert = e, error = %err, "repack failed");
                    }
                }
            }
            Prefetch::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The precision expert `e` of `layer` is packed in now.
    fn want_dtype(&self, st: &State, layer: usize, e: usize) -> ExpertDtype {
        if st.int8.contains(&(layer, e)) {
            return ExpertDtype::Int8;
        }
        match self.tier.bf16_share {
            None => self.opts.dtype_for(layer, e),
            Some(_) if st.bf16.contains(&(layer, e)) => hot_dtype(&self.opts),
            Some(_) => ExpertDtype::Int8,
        }
    }

    fn size_of(&self, layer: usize, dtype: ExpertDtype) -> usize {
        self.sizes
            .get(&(layer, dtype_key(dtype)))
            .copied()
            .unwrap_or(0)
    }

    /// Packs expert `e` of `layer`, into `spare`'s buffers (those of the
    /// experts evicted to make room for it) where their sizes fit; the rest
    /// of `spare` is freed.
    fn pack(
        &self,
        layer: usize,
        e: usize,
        dtype: ExpertDtype,
        mut spare: Spare,
    ) -> Result<PackedExpert> {
        let names = ExpertNames::resolve(&self.cfg, &self.ws, layer)?;
        let p = pack_expert(&self.cfg, &self.ws, &names, dtype, layer, e, &mut spare)?;
        self.stats
            .bytes_paged_in
            .fetch_add(p.weight_bytes() as u64, Ordering::Relaxed);
        Ok(p)
    }

    /// Fills the budget with assigned experts not packed yet: `probes`
    /// (packed already) first, then round-robin over the layers; the resident
    /// tier fills before the cache. Packs outside the lock (calls go on).
    fn warm(&self, probes: Vec<((usize, usize), ExpertDtype, PackedExpert)>) -> Result<()> {
        {
            let mut st = self.lock();
            for (key, dt, p) in probes {
                let size = p.weight_bytes();
                if !st.is_assigned(key.0, key.1)
                    || dt != self.want_dtype(&st, key.0, key.1)
                    || st.held_bytes() + size > self.tier.budget
                {
                    continue;
                }
                let resident = st.resident_bytes + size <= self.resident_cap;
                self.insert(&mut st, key, Arc::new(p), dt, resident, false);
            }
        }
        let n = self.cfg.num_experts;
        let order: Vec<(usize, usize)> = (0..n)
            .flat_map(|e| (0..self.moe.len()).map(move |l| (l, e)))
            .filter(|&(l, _)| self.moe[l])
            .collect();
        for (l, e) in order {
            let (size, dt);
            {
                let mut st = self.lock();
                if !st.is_assigned(l, e) || st.entries.contains_key(&(l, e)) {
                    continue;
                }
                dt = self.want_dtype(&st, l, e);
                size = self.size_of(l, dt);
                if st.held_bytes() + size > self.tier.budget {
                    // Full: only smaller experts (another precision) could
                    // still fit.
                    continue;
                }
                st.reserved += size;
            }
            let packed = self.pack(l, e, dt, Spare::default());
            let mut st = self.lock();
            st.reserved -= size;
            let p = packed?;
            if !st.entries.contains_key(&(l, e)) {
                let resident = st.resident_bytes + size <= self.resident_cap;
                self.insert(&mut st, (l, e), Arc::new(p), dt, resident, false);
            }
        }
        Ok(())
    }

    fn insert(
        &self,
        st: &mut State,
        key: (usize, usize),
        ex: Arc<PackedExpert>,
        dtype: ExpertDtype,
        resident: bool,
        prefetched: bool,
    ) {
        // A call's miss and the prefetcher may pack the same expert at
        // once (each checks before packing, outside the lock): the later
        // one replaces the earlier, whose bytes leave the accounting with it.
        self.take(st, key);
        let size = ex.weight_bytes();
        if resident {
            st.resident_bytes += size;
        } else {
            st.cached_bytes += size;
        }
        st.tick += 1;
        let mut en = Entry {
            ex,
            dtype,
            resident,
            last_use: st.tick,
            last_call: st.calls,
            prefetched,
            locked: false,
        };
        if resident && self.tier.mlock {
            self.set_locked(st, &mut en, true);
        }
        st.entries.insert(key, en);
    }

    /// Removes the entry of `key`, its bytes from its tier's count and its
    /// pages' lock.
    fn take(&self, st: &mut State, key: (usize, usize)) -> Option<Entry> {
        let mut en = st.entries.remove(&key)?;
        let s = en.ex.weight_bytes();
        if en.resident {
            st.resident_bytes -= s;
        } else {
            st.cached_bytes -= s;
        }
        self.set_locked(st, &mut en, false);
        Some(en)
    }

    fn set_locked(&self, st: &mut State, en: &mut Entry, on: bool) {
        if en.locked == on || (on && st.mlock_failed) {
            return;
        }
        let ok = en.ex.for_each_buffer(|ptr, len| {
            // SAFETY: the buffer is alive (held by `en.ex`) and `len` bytes
            // long; mlock/munlock only change its paging.
            let r = unsafe {
                if on {
                    libc::mlock(ptr.cast(), len)
                } else {
                    libc::munlock(ptr.cast(), len)
                }
            };
            r == 0
        });
        if on && !ok {
            st.mlock_failed = true;
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "cannot mlock resident experts (raise RLIMIT_MEMLOCK, e.g. ulimit -l); they stay resident unlocked"
            );
        }
        en.locked = on && ok;
    }

    /// Drops the cached entry that no call holds with the fewest routed
    /// tokens in the window (least recently used among equals). Frequency
    /// first: when the working set is larger than the budget, plain LRU
    /// evicts a hot expert for every cold one that passes through, while
    /// this keeps the hot ones and churns one slot. Its buffers go to
    /// `spare`. Returns false when there is nothing to drop.
    fn evict_one(&self, st: &mut State, unused_since: u64, spare: &mut Spare) -> bool {
        let victim = st
            .entries
            .iter()
            .filter(|(_, en)| {
                !en.resident && Arc::strong_count(&en.ex) == 1 && en.last_call <= unused_since
            })
            .min_by(|(ka, a), (kb, b)| {
                let (ua, ub) = (
                    st.uses.get(ka).copied().unwrap_or(0.0),
                    st.uses.get(kb).copied().unwrap_or(0.0),
                );
                ua.total_cmp(&ub).then(a.last_use.cmp(&b.last_use))
            })
            .map(|(k, _)| *k);
        let Some(k) = victim else {
            return false;
        };
        if let Some(en) = self.take(st, k) {
            self.stats.evictions.fetch_add(1, Ordering::Relaxed);
            if en.prefetched {
                st.prefetch_outcome(false);
            }
            // No call holds it (checked above, under the lock calls take
            // their references under).
            if let Ok(p) = Arc::try_unwrap(en.ex) {
                spare.add(p);
            }
        }
        true
    }

    /// Makes room for `size` more bytes by evicting (the evicted buffers go
    /// to `spare`, for the expert the room is for); false if it cannot.
    fn make_room(&self, st: &mut State, size: usize, spare: &mut Spare) -> bool {
        self.make_room_from(st, size, u64::MAX, spare)
    }

    /// [`make_room`](Self::make_room) evicting only experts not used since
    /// call `unused_since`.
    fn make_room_from(
        &self,
        st: &mut State,
        size: usize,
        unused_since: u64,
        spare: &mut Spare,
    ) -> bool {
        while st.held_bytes() + size > self.tier.budget {
            if !self.evict_one(st, unused_since, spare) {
                return false;
            }
        }
        true
    }

    fn prefetch_one(&self, layer: usize, e: usize) -> Result<()> {
        let (size, dt);
        let mut spare = Spare::default();
        {
            let mut st = self.lock();
            dt = self.want_dtype(&st, layer, e);
            size = self.size_of(layer, dt);
            // A guess never evicts what the last two steps used.
            let steps = 2 * self.moe.iter().filter(|&&m| m).count() as u64;
            let unused_since = st.calls.saturating_sub(steps);
            if st.entries.contains_key(&(layer, e))
                || !self.make_room_from(&mut st, size, unused_since, &mut spare)
            {
                return Ok(());
            }
            st.reserved += size;
        }
        let packed = self.pack(layer, e, dt, spare);
        let mut st = self.lock();
        st.reserved -= size;
        let p = packed?;
        if !st.entries.contains_key(&(layer, e)) {
            self.insert(&mut st, (layer, e), Arc::new(p), dt, false, true);
            self.stats.prefetched.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Precision by load: packs expert `e` of `layer` again in the precision
    /// it should have now, and swaps it in between two calls.
    fn repack_one(&self, layer: usize, e: usize) -> Result<()> {
        let (size, dt);
        let mut spare = Spare::default();
        {
            let mut st = self.lock();
            dt = self.want_dtype(&st, layer, e);
            size = self.size_of(layer, dt);
            match st.entries.get(&(layer, e)) {
                Some(en) if en.dtype != dt => {}
                _ => return Ok(()),
            }
            if !self.make_room(&mut st, size, &mut spare) {
                return Ok(());
            }
            st.reserved += size;
        }
        let packed = self.pack(layer, e, dt, spare);
        // Swap between calls: no call holds the old packing then, so its
        // bytes go as they leave the accounting.
        let _between_calls = self.call.lock().unwrap_or_else(|p| p.into_inner());
        let mut st = self.lock();
        st.reserved -= size;
        let p = packed?;
        let stale = st.entries.get(&(layer, e)).is_some_and(|en| en.dtype != dt);
        if stale && let Some(old) = self.take(&mut st, (layer, e)) {
            let resident = old.resident && st.resident_bytes + size <= self.resident_cap;
            self.insert(&mut st, (layer, e), Arc::new(p), dt, resident, false);
            self.stats.repacked.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Re-chooses the resident tier from the decayed use counts: the most
    /// used experts that fit `resident_cap` and are packed now become
    /// resident, the others cached.
    fn retier(&self, st: &mut State) -> Vec<(usize, usize)> {
        let mut ranked: Vec<((usize, usize), f64)> =
            st.uses.iter().map(|(k, v)| (*k, *v)).collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        // Precision by load: the most used experts covering the share run
        // in bf16.
        if let Some(share) = self.tier.bf16_share {
            let hot = crate::eplb::hottest_covering(&ranked, share);
            st.bf16 = ranked[..hot].iter().map(|r| r.0).collect();
        }
        let mut want = std::collections::HashSet::new();
        let mut bytes = 0;
        // Only experts used in the window count; a never-used one is not hot.
        for (k, _) in &ranked {
            let s = self.size_of(k.0, self.want_dtype(st, k.0, k.1));
            if bytes + s <= self.resident_cap {
                bytes += s;
                want.insert(*k);
            }
        }
        let keys: Vec<(usize, usize)> = st.entries.keys().copied().collect();
        // Demote first so promotions find room.
        for k in &keys {
            let Some(mut en) = st.entries.remove(k) else {
                continue;
            };
            if en.resident && !want.contains(k) {
                en.resident = false;
                let s = en.ex.weight_bytes();
                st.resident_bytes -= s;
                st.cached_bytes += s;
                self.set_locked(st, &mut en, false);
                self.stats.demotions.fetch_add(1, Ordering::Relaxed);
            }
            st.entries.insert(*k, en);
        }
        for k in &keys {
            let Some(mut en) = st.entries.remove(k) else {
                continue;
            };
            let s = en.ex.weight_bytes();
            if !en.resident && want.contains(k) && st.resident_bytes + s <= self.resident_cap {
                en.resident = true;
                st.resident_bytes += s;
                st.cached_bytes -= s;
                if self.tier.mlock {
                    self.set_locked(st, &mut en, true);
                }
                self.stats.promotions.fetch_add(1, Ordering::Relaxed);
            }
            st.entries.insert(*k, en);
        }
        st.want_resident = want;
        for v in st.uses.values_mut() {
            *v *= 0.5;
        }
        st.uses.retain(|_, v| *v > 1e-3);
        // Packed experts in the wrong precision now: repack them.
        let mut repack: Vec<(usize, usize)> = st
            .entries
            .iter()
            .filter(|(k, en)| en.dtype != self.want_dtype(st, k.0, k.1))
            .map(|(k, _)| *k)
            .collect();
        repack.sort_unstable();
        repack
    }

    fn snapshot(&self) -> TierSnapshot {
        let st = self.lock();
        let s = &self.stats;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let resident_experts = st.entries.values().filter(|e| e.resident).count() as u64;
        TierSnapshot {
            hits: ld(&s.hits),
            misses: ld(&s.misses),
            evictions: ld(&s.evictions),
            bytes_paged_in: ld(&s.bytes_paged_in),
            hinted: ld(&s.hinted),
            prefetched: ld(&s.prefetched),
            prefetch_hits: ld(&s.prefetch_hits),
            promotions: ld(&s.promotions),
            demotions: ld(&s.demotions),
            split_calls: ld(&s.split_calls),
            repacked: ld(&s.repacked),
            bf16_experts: st
                .entries
                .values()
                .filter(|e| e.dtype != ExpertDtype::Int8)
                .count() as u64,
            int8_experts: st
                .entries
                .values()
                .filter(|e| e.dtype == ExpertDtype::Int8)
                .count() as u64,
            resident_bytes: st.resident_bytes as u64,
            cached_bytes: st.cached_bytes as u64,
            budget_bytes: self.tier.budget as u64,
            resident_experts,
            cached_experts: st.entries.len() as u64 - resident_experts,
            held_experts: st
                .assigned
                .iter()
                .map(|a| a.iter().filter(|&&b| b).count() as u64)
                .sum(),
        }
    }

    /// Runs the slots of `topk_ids` whose expert is in `view` (the others
    /// skipped) and, when `with_resident` is false, not resident.
    #[allow(clippy::too_many_arguments)]
    fn run_group(
        &self,
        layer: usize,
        view: &[Option<Arc<PackedExpert>>],
        ids_buf: &mut Vec<u32>,
        rows: Rows<'_>,
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &mut [f32],
    ) -> Result<()> {
        ids_buf.clear();
        ids_buf.extend(topk_ids.iter().map(|&id| {
            if id != SKIP_SLOT && view.get(id as usize).is_some_and(|v| v.is_some()) {
                id
            } else {
                SKIP_SLOT
            }
        }));
        if ids_buf.iter().all(|&i| i == SKIP_SLOT) {
            return Ok(());
        }
        self.core.run_set(
            layer,
            view,
            self.inter[layer],
            rows,
            ids_buf,
            topk_weights,
            top_k,
            out,
        )
    }
}

impl ExpertExecutor for TieredExperts {
    fn wants_prefetch(&self) -> bool {
        self.inner.tier.prefetch && self.prefetch_tx.is_some()
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        self.prefetch_hint(layer, experts)
    }

    fn expert_states(&self) -> Vec<ExpertState> {
        let inner = &*self.inner;
        let st = inner.lock();
        let mut out = Vec::new();
        for (layer, hl) in st.assigned.iter().enumerate() {
            for (expert, _) in hl.iter().enumerate().filter(|(_, h)| **h) {
                let (tier, precision) = match st.entries.get(&(layer, expert)) {
                    Some(en) => (
                        if en.resident {
                            Tier::Resident
                        } else {
                            Tier::Cached
                        },
                        en.ex.dtype().as_str(),
                    ),
                    None => (
                        Tier::Cold,
                        match inner.want_dtype(&st, layer, expert) {
                            ExpertDtype::Int8 => "int8",
                            ExpertDtype::Auto | ExpertDtype::Bf16 => "bf16",
                        },
                    ),
                };
                out.push(ExpertState {
                    layer,
                    expert,
                    tier: tier.as_str(),
                    precision,
                });
            }
        }
        out
    }

    fn execute_rows(
        &self,
        layer: usize,
        rows: Rows<'_>,
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let inner = &*self.inner;
        inner
            .core
            .check_call(layer, rows, topk_ids, topk_weights, top_k, out)?;
        if !inner.moe.get(layer).copied().unwrap_or(false) {
            return Err(Error::Dispatch(format!(
                "layer {layer} has no experts here"
            )));
        }
        let ne = inner.cfg.num_experts;
        let slots = rows.f32.len() / inner.cfg.hidden_size * top_k;
        let ids = &topk_ids[..slots];
        // Tokens routed to each expert in this call.
        let mut active = vec![0u32; ne];
        for &id in ids.iter().filter(|&&i| i != SKIP_SLOT) {
            if id as usize >= ne {
                return Err(Error::Dispatch(format!(
                    "layer {layer}: expert id {id} out of range"
                )));
            }
            active[id as usize] += 1;
        }
        let _call = inner.call.lock().unwrap_or_else(|p| p.into_inner());
        let mut view: Vec<Option<Arc<PackedExpert>>> = vec![None; ne];
        let mut misses = Vec::new();
        let misses: Vec<(usize, ExpertDtype)> = {
            let mut st = inner.lock();
            st.tick += 1;
            let tick = st.tick;
            let calls = st.calls;
            let mut used_prefetch = 0;
            for e in (0..ne).filter(|&e| active[e] > 0) {
                *st.uses.entry((layer, e)).or_insert(0.0) += active[e] as f64;
                match st.entries.get_mut(&(layer, e)) {
                    Some(en) => {
                        en.last_use = tick;
                        en.last_call = calls;
                        if en.prefetched {
                            en.prefetched = false;
                            used_prefetch += 1;
                            inner.stats.prefetch_hits.fetch_add(1, Ordering::Relaxed);
                        }
                        view[e] = Some(en.ex.clone());
                        inner.stats.hits.fetch_add(1, Ordering::Relaxed);
                    }
                    None => misses.push(e),
                }
            }
            for _ in 0..used_prefetch {
                st.prefetch_outcome(true);
            }
            st.calls += 1;
            if inner.tier.retier_calls > 0 && st.calls.is_multiple_of(inner.tier.retier_calls) {
                let repack = inner.retier(&mut st);
                if !repack.is_empty()
                    && let Some(tx) = &self.prefetch_tx
                {
                    let _ = tx.try_send(Prefetch::Repack(repack));
                }
            }
            // Precisions as the re-tiering above left them.
            misses
                .into_iter()
                .map(|e| (e, inner.want_dtype(&st, layer, e)))
                .collect()
        };
        let mut ids_buf = Vec::with_capacity(slots);
        let mut pending: std::collections::VecDeque<(usize, ExpertDtype)> = misses.into();
        while !pending.is_empty() {
            // Reserve room for as many misses as fit now ...
            let mut batch = Vec::new();
            {
                let mut st = inner.lock();
                while let Some(&(e, dt)) = pending.front() {
                    let size = inner.size_of(layer, dt);
                    let mut spare = Spare::default();
                    if !inner.make_room(&mut st, size, &mut spare) {
                        break;
                    }
                    st.reserved += size;
                    batch.push((e, dt, size, spare));
                    pending.pop_front();
                }
            }
            if batch.is_empty() {
                if view.iter().all(|v| v.is_none()) {
                    // Only the prefetcher's reservation is in the way: it
                    // finishes without waiting on anything.
                    std::thread::sleep(std::time::Duration::from_micros(200));
                    continue;
                }
                // Everything evictable is in this call's group: run it, then
                // let its cached experts go.
                inner.stats.split_calls.fetch_add(1, Ordering::Relaxed);
                inner.run_group(
                    layer,
                    &view,
                    &mut ids_buf,
                    rows,
                    ids,
                    topk_weights,
                    top_k,
                    out,
                )?;
                for v in view.iter_mut() {
                    *v = None;
                }
                continue;
            }
            // ... and pack them on the pool's threads (idle meanwhile).
            let (keys, spares): (Vec<_>, Vec<_>) = batch
                .into_iter()
                .map(|(e, dt, size, spare)| ((e, dt, size), spare))
                .unzip();
            let packed: Vec<Result<PackedExpert>> = inner.core.pool().install(|| {
                use rayon::prelude::*;
                keys.par_iter()
                    .zip(spares)
                    .map(|(&(e, dt, _), spare)| inner.pack(layer, e, dt, spare))
                    .collect()
            });
            let mut st = inner.lock();
            let mut first_err = None;
            for ((e, dt, size), p) in keys.into_iter().zip(packed) {
                st.reserved -= size;
                match p {
                    Ok(p) => {
                        let p = Arc::new(p);
                        inner.stats.misses.fetch_add(1, Ordering::Relaxed);
                        view[e] = Some(p.clone());
                        let resident = st.want_resident.contains(&(layer, e))
                            && st.resident_bytes + size <= inner.resident_cap;
                        inner.insert(&mut st, (layer, e), p, dt, resident, false);
                    }
                    Err(err) => first_err = first_err.or(Some(err)),
                }
            }
            if let Some(err) = first_err {
                return Err(err);
            }
        }
        inner.run_group(
            layer,
            &view,
            &mut ids_buf,
            rows,
            ids,
            topk_weights,
            top_k,
            out,
        )
    }
}
