//! Tensor-parallel attention: a shard holds a contiguous range of every
//! layer's heads and the paged KV cache of those heads, and returns its
//! partial output projection; the caller sums the shards' partials. The
//! caller (the coordinator's scheduler) is the single owner of the block
//! table: every chunk names the caller's blocks, and a shard stores the
//! positions of caller block `b` at rows `b * block_size ..`, so blocks the
//! caller shares between sequences (prefix caching) are shared on every
//! shard, and a shard allocates and frees nothing. It only records, per layer
//! and block, how many positions it has written, so a chunk that relies on
//! positions it never wrote (a restarted shard) is refused. The
//! [`AttentionBackend`] trait is how [`Model::forward`](super::Model::forward)
//! reaches shards that live elsewhere (attention-workers over gRPC) or, for
//! tests, in this process ([`LocalShards`]).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::loader::names;
use crate::loader::weights::WeightStore;
use crate::model::attention::{Attention, HeadShard, SeqSpan};
use crate::model::kv_cache::{KvDtype, KvLayerShape, KvLayout, KvPool, SeqCache};
use crate::model::mla::Mla;
use crate::model::rope::Rope;

/// One sequence's chunk of a batch sent to attention shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqChunk {
    /// Stable id of the sequence (its [`SeqCache::id`] on the coordinator).
    pub id: u64,
    /// Positions cached before this chunk: the chunk overwrites positions
    /// `past..past + len`; a shard that never wrote some position before
    /// `past` at this layer refuses it.
    pub past: usize,
    /// New tokens.
    pub len: usize,
    /// The caller's block table for the sequence (at least
    /// `ceil((past + len) / block_size)` blocks). Empty: the table sent
    /// last for this sequence (the caller sends it with layer 0 only).
    pub blocks: Vec<u32>,
    /// Positions per caller block (a multiple of the shard's block size).
    pub block_size: usize,
}

/// An attention call in flight ([`AttentionBackend::submit`]); `wait`
/// brings the summed partial projections.
#[must_use = "a submitted attention call must be waited for"]
pub struct PendingAttention(PendingInner);

enum PendingInner {
    Ready(Result<Vec<f32>>),
    Later(Box<dyn FnOnce() -> Result<Vec<f32>> + Send>),
}

impl PendingAttention {
    /// A call already finished.
    pub fn ready(r: Result<Vec<f32>>) -> Self {
        PendingAttention(PendingInner::Ready(r))
    }

    /// A call whose result `wait` produces (blocks the caller).
    pub fn later(wait: impl FnOnce() -> Result<Vec<f32>> + Send + 'static) -> Self {
        PendingAttention(PendingInner::Later(Box::new(wait)))
    }

    /// Blocks until the shards answered.
    pub fn wait(self) -> Result<Vec<f32>> {
        match self.0 {
            PendingInner::Ready(r) => r,
            PendingInner::Later(f) => f(),
        }
    }
}

/// Attention computed outside the model's own layers (tensor-parallel
/// shards), in two phases: [`submit`](Self::submit) starts a layer's
/// attention for some sequences and returns; the pending handle's `wait`
/// brings the result. In-process backends finish eagerly.
pub trait AttentionBackend: Send + Sync {
    /// Starts layer `layer` for the normalized input `x` (`[tokens, hidden]`,
    /// sequences in `chunks` order); the result is the sum of every shard's
    /// partial output projection, without the `o_proj` bias.
    fn submit(
        self: Arc<Self>,
        layer: usize,
        x: Arc<[f32]>,
        chunks: Vec<SeqChunk>,
    ) -> Result<PendingAttention>;
    /// Forgets these sequences' block tables (finished, cancelled or
    /// preempted; their blocks are the caller's, which frees or caches them).
    /// May be deferred until the next [`submit`](Self::submit) or
    /// [`flush`](Self::flush).
    fn release(&self, ids: &[u64]);
    /// Sends deferred releases now (the scheduler calls it when idle).
    fn flush(&self) {}
    /// Positions of KV every shard can hold, for sizing the caller's block
    /// accounting (None: unknown).
    fn capacity_positions(&self) -> Option<usize>;
}

/// One layer's heads on a shard.
enum ShardAttn {
    Gqa(Attention),
    Mla(Mla),
}

impl ShardAttn {
    fn kv_shape(&self) -> KvLayerShape {
        match self {
            ShardAttn::Gqa(a) => a.kv_shape(),
            ShardAttn::Mla(m) => m.kv_widths().into(),
        }
    }
}

/// A shard of every attention layer plus the KV cache of its heads.
pub struct AttentionShard {
    shard: HeadShard,
    hidden: usize,
    layers: Vec<(ShardAttn, Rope)>,
    pool: KvPool,
    /// The last block table the caller sent per sequence, and its block size.
    tables: HashMap<u64, Vec<u32>>,
    table_bs: HashMap<u64, usize>,
    /// Per layer, per block of this pool: positions written (from its start).
    fills: Vec<Vec<u32>>,
}

/// What a shard holds, for health reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardStats {
    pub block_size: usize,
    pub blocks_total: usize,
    pub blocks_free: usize,
    pub sequences: usize,
}

impl AttentionShard {
    /// Requantizes this shard's dense projections (q/k/v or MLA's input
    /// stack, `q_b_proj`, its columns of `o_proj`) to `dtype`, as
    /// [`Model::set_dense_dtype`](crate::model::Model::set_dense_dtype) does
    /// in one process (int8: W8A8, per-channel scales over this shard's
    /// slice; bf16: bf16 activations). `auto` is how they load.
    pub fn set_dense_dtype(&mut self, dtype: crate::experts::DenseDtype) {
        if dtype == crate::experts::DenseDtype::Auto {
            return;
        }
        let mut all: Vec<&mut crate::model::linear::Linear> = Vec::new();
        for (a, _) in &mut self.layers {
            match a {
                ShardAttn::Gqa(g) => all.extend(g.linears_mut()),
                ShardAttn::Mla(m) => all.extend(m.linears_mut()),
            }
        }
        use rayon::prelude::*;
        all.into_par_iter().for_each(|l| l.set_dtype(dtype));
    }

    /// Loads shard `shard` of every attention layer of `cfg` from `ws`, with
    /// a KV cache of at most `kv_bytes` in blocks of `block_size` positions,
    /// elements stored as `kv_dtype`.
    /// Refuses head counts that cannot be split evenly over the shards.
    #[tracing::instrument(
        level = "info",
        name = "load_attention_shard",
        skip_all,
        fields(shard = shard.index, of = shard.of, layers = cfg.num_hidden_layers)
    )]
    pub fn load(
        cfg: &ModelConfig,
        ws: &WeightStore,
        shard: HeadShard,
        kv_bytes: usize,
        block_size: usize,
        kv_dtype: KvDtype,
    ) -> Result<Self> {
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let lp = names::layer_prefix_for(cfg, i);
            let prefix = format!("{lp}.self_attn");
            let att = if cfg.mla.is_some() {
                ShardAttn::Mla(Mla::load_shard(cfg, ws, &prefix, shard)?)
            } else {
                ShardAttn::Gqa(Attention::load_shard(cfg, ws, &prefix, i, shard)?)
            };
            layers.push((att, Rope::new(&cfg.layers[i].rope)));
        }
        let shapes: Vec<KvLayerShape> = layers.iter().map(|(a, _)| a.kv_shape()).collect();
        let block_size = block_size.max(1);
        let num_blocks = kv_bytes / KvPool::layer_block_bytes(&shapes, block_size, kv_dtype).max(1);
        if num_blocks == 0 {
            return Err(Error::InvalidInput(format!(
                "a KV cache of {kv_bytes} bytes holds not even one block of {block_size} positions ({} bytes on this shard with {} elements)",
                KvPool::layer_block_bytes(&shapes, block_size, kv_dtype),
                kv_dtype.name()
            )));
        }
        Ok(AttentionShard {
            shard,
            hidden: cfg.hidden_size,
            layers,
            pool: KvPool::for_layers(
                &shapes,
                block_size,
                num_blocks,
                kv_dtype,
                KvLayout::default(),
            ),
            tables: HashMap::new(),
            table_bs: HashMap::new(),
            fills: vec![vec![0; num_blocks]; cfg.num_hidden_layers],
        })
    }

    /// Loads shard `shard` from a model folder.
    pub fn load_dir(
        dir: &Path,
        shard: HeadShard,
        kv_bytes: usize,
        block_size: usize,
        kv_dtype: KvDtype,
    ) -> Result<Self> {
        let cfg = ModelConfig::from_dir(dir)?;
        let ws = WeightStore::open(dir)?;
        Self::load(&cfg, &ws, shard, kv_bytes, block_size, kv_dtype)
    }

    /// Which shard this is.
    pub fn shard(&self) -> HeadShard {
        self.shard
    }

    /// Layers held.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The model's hidden size (columns of the input and the partial output).
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// KV cache occupancy: blocks named by the block tables of the
    /// sequences this shard knows are in use, the rest count as free.
    pub fn stats(&self) -> ShardStats {
        let bs = self.pool.block_size();
        let mut used = HashSet::new();
        for (id, t) in &self.tables {
            let k = self.table_bs.get(id).map_or(1, |&c| (c / bs).max(1)) as u32;
            for &b in t {
                used.extend((0..k).map(|j| b.saturating_mul(k).saturating_add(j)));
            }
        }
        ShardStats {
            block_size: bs,
            blocks_total: self.pool.num_blocks(),
            blocks_free: self.pool.num_blocks().saturating_sub(used.len()),
            sequences: self.tables.len(),
        }
    }

    /// The caller's `table` (blocks of `caller_bs` positions) as blocks of
    /// this pool, covering `positions`; errors name what is inconsistent.
    fn expand(
        &self,
        id: u64,
        table: &[u32],
        caller_bs: usize,
        positions: usize,
    ) -> Result<Vec<u32>> {
        let bs = self.pool.block_size();
        if caller_bs == 0 || !caller_bs.is_multiple_of(bs) {
            return Err(Error::InvalidInput(format!(
                "the caller's KV blocks of {caller_bs} positions are not a multiple of this shard's {bs}"
            )));
        }
        let k = caller_bs / bs;
        let need = positions.div_ceil(caller_bs);
        if table.len() < need {
            return Err(Error::InvalidInput(format!(
                "sequence {id}: {} blocks of {caller_bs} positions cannot hold {positions} positions",
                table.len()
            )));
        }
        let cap = self.pool.num_blocks() / k;
        let mut out = Vec::with_capacity(need * k);
        for &b in &table[..need] {
            if b as usize >= cap {
                return Err(Error::InvalidInput(format!(
                    "sequence {id}: block {b} is beyond this shard's KV cache of {cap} blocks of {caller_bs} positions (raise --kv-cache-memory)"
                )));
            }
            out.extend((0..k as u32).map(|j| b * k as u32 + j));
        }
        Ok(out)
    }

    /// Positions written at `layer` from the start of `blocks` (this pool's
    /// blocks), counting on while each block is full.
    fn written(&self, layer: usize, blocks: &[u32]) -> usize {
        let bs = self.pool.block_size();
        let mut n = 0;
        for &b in blocks {
            let f = self.fills[layer][b as usize] as usize;
            n += f.min(bs);
            if f < bs {
                break;
            }
        }
        n
    }

    /// Positions of one sequence held at `layer` by its last block table
    /// (None: no table for it).
    pub fn held(&self, id: u64, layer: usize) -> Option<usize> {
        let t = self.tables.get(&id)?;
        let cbs = *self.table_bs.get(&id)?;
        if layer >= self.fills.len() {
            return None;
        }
        let blocks = self.expand(id, t, cbs, t.len() * cbs).ok()?;
        Some(self.written(layer, &blocks))
    }

    /// Forgets sequences' block tables; unknown ids are ignored. (Their
    /// blocks belong to the caller, which frees them.)
    pub fn release(&mut self, ids: &[u64]) {
        for id in ids {
            self.tables.remove(id);
            self.table_bs.remove(id);
        }
    }

    /// Forgets everything (a coordinator (re)started): tables, and which
    /// positions were written, so nothing written before is relied on.
    pub fn release_all(&mut self) {
        self.tables.clear();
        self.table_bs.clear();
        for f in &mut self.fills {
            f.fill(0);
        }
    }

    /// Runs this shard's heads of layer `layer` for `x` (`[tokens, hidden]`)
    /// and returns its partial output projection `[tokens, hidden]`. Each
    /// chunk's keys/values are written at positions `past..past + len` of
    /// its block table; a chunk relying on a position before `past` that
    /// this shard has not written at this layer is an error, and so is a
    /// table that is too short or names blocks beyond this shard's cache.
    /// On an error nothing is written.
    pub fn forward(&mut self, layer: usize, x: &[f32], chunks: &[SeqChunk]) -> Result<Vec<f32>> {
        let nl = self.layers.len();
        if layer >= nl {
            return Err(Error::InvalidInput(format!(
                "layer {layer} does not exist (the model has {nl})"
            )));
        }
        let tokens: usize = chunks.iter().map(|c| c.len).sum();
        if x.len() != tokens * self.hidden {
            return Err(Error::InvalidInput(format!(
                "hidden input has {} values; {} tokens of hidden size {} need {}",
                x.len(),
                tokens,
                self.hidden,
                tokens * self.hidden
            )));
        }
        let mut seen = HashSet::with_capacity(chunks.len());
        let mut caches = Vec::with_capacity(chunks.len());
        for c in chunks {
            if c.len == 0 {
                return Err(Error::InvalidInput(format!(
                    "sequence {} has no new tokens",
                    c.id
                )));
            }
            if !seen.insert(c.id) {
                return Err(Error::InvalidInput(format!(
                    "sequence {} appears twice in one batch",
                    c.id
                )));
            }
            let (table, cbs) = if c.blocks.is_empty() {
                match (self.tables.get(&c.id), self.table_bs.get(&c.id)) {
                    (Some(t), Some(&b)) if b == c.block_size => (t.as_slice(), b),
                    _ => {
                        return Err(Error::InvalidInput(format!(
                            "sequence {} at layer {layer}: no block table was sent for it (this shard may have restarted or missed a step)",
                            c.id
                        )));
                    }
                }
            } else {
                (c.blocks.as_slice(), c.block_size)
            };
            let blocks = self.expand(c.id, table, cbs, c.past + c.len)?;
            let held = self.written(layer, &blocks);
            if c.past > held {
                return Err(Error::InvalidInput(format!(
                    "sequence {} at layer {layer}: asked to append at position {} but this shard holds only {held} positions (it may have restarted or missed a step)",
                    c.id, c.past
                )));
            }
            caches.push(SeqCache::with_blocks(blocks, c.past));
        }
        for c in chunks.iter().filter(|c| !c.blocks.is_empty()) {
            self.tables.insert(c.id, c.blocks.clone());
            self.table_bs.insert(c.id, c.block_size);
        }
        let mut spans = Vec::with_capacity(chunks.len());
        let mut start = 0;
        for c in chunks {
            spans.push(SeqSpan {
                start,
                len: c.len,
                past: c.past,
            });
            start += c.len;
        }
        let refs: Vec<&SeqCache> = caches.iter().collect();
        let (att, rope) = &self.layers[layer];
        let out = match att {
            ShardAttn::Gqa(a) => a.forward(x, &spans, &refs, &mut self.pool, layer, rope),
            ShardAttn::Mla(m) => m.forward(x, &spans, &refs, &mut self.pool, layer, rope),
        };
        // What is written now: positions past..past + len (a block's count
        // is set, not raised, so a rewound sequence forgets what followed).
        let bs = self.pool.block_size();
        for (c, cache) in chunks.iter().zip(&caches) {
            let end = c.past + c.len;
            for i in c.past / bs..end.div_ceil(bs) {
                let b = cache.blocks()[i] as usize;
                self.fills[layer][b] = (end - i * bs).min(bs) as u32;
            }
        }
        Ok(out)
    }
}

/// Every shard in this process: partials summed in shard order. The reference
/// for the remote backend, and what the unit tests split models with.
pub struct LocalShards {
    shards: Vec<Mutex<AttentionShard>>,
}

impl LocalShards {
    /// Shards `0..of` of the model in `dir`, each with `kv_bytes` of f32 KV cache.
    pub fn load(dir: &Path, of: usize, kv_bytes: usize, block_size: usize) -> Result<Self> {
        let cfg = ModelConfig::from_dir(dir)?;
        let ws = WeightStore::open(dir)?;
        let shards = (0..of)
            .map(|index| {
                AttentionShard::load(
                    &cfg,
                    &ws,
                    HeadShard { index, of },
                    kv_bytes,
                    block_size,
                    KvDtype::F32,
                )
                .map(Mutex::new)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(LocalShards { shards })
    }

    /// Requantizes every shard's projections (see
    /// [`AttentionShard::set_dense_dtype`]).
    pub fn set_dense_dtype(&mut self, dtype: crate::experts::DenseDtype) {
        for s in &mut self.shards {
            if let Ok(s) = s.get_mut() {
                s.set_dense_dtype(dtype);
            }
        }
    }
}

impl AttentionBackend for LocalShards {
    fn submit(
        self: Arc<Self>,
        layer: usize,
        x: Arc<[f32]>,
        chunks: Vec<SeqChunk>,
    ) -> Result<PendingAttention> {
        Ok(PendingAttention::ready(self.sum_shards(layer, &x, &chunks)))
    }

    fn release(&self, ids: &[u64]) {
        for s in &self.shards {
            if let Ok(mut g) = s.lock() {
                g.release(ids);
            }
        }
    }

    fn capacity_positions(&self) -> Option<usize> {
        self.shards
            .iter()
            .filter_map(|s| {
                s.lock().ok().map(|g| {
                    let st = g.stats();
                    st.blocks_total * st.block_size
                })
            })
            .min()
    }
}

impl LocalShards {
    /// Runs every shard in turn and sums their partials in shard order.
    fn sum_shards(&self, layer: usize, x: &[f32], chunks: &[SeqChunk]) -> Result<Vec<f32>> {
        let mut sum: Option<Vec<f32>> = None;
        for s in &self.shards {
            let part = s
                .lock()
                .map_err(|_| Error::Dispatch("attention shard lock poisoned".into()))?
                .forward(layer, x, chunks)?;
            match sum.as_mut() {
                None => sum = Some(part),
                Some(acc) => {
                    for (a, p) in acc.iter_mut().zip(&part) {
                        *a += p;
                    }
                }
            }
        }
        sum.ok_or_else(|| Error::Dispatch("no attention shards".into()))
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use super::*;
    use crate::experts::{LoadOptions, LocalDispatcher, load_executor};
    use crate::model::{LogitsMode, Model, SeqInput};

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(name)
            .join("f32")
    }

    /// The model with attention split over `of` in-process shards.
    fn split_model(dir: &Path, of: usize) -> Result<Model> {
        let cfg = ModelConfig::from_dir(dir)?;
        let ws = WeightStore::open(dir)?;
        let experts = load_executor(&cfg, &ws, &LoadOptions::default())?;
        let shards = LocalShards::load(dir, of, 1 << 22, 4)?;
        Model::from_store_with(
            cfg,
            &ws,
            Arc::new(LocalDispatcher::new(experts)),
            Some(Arc::new(shards)),
        )
    }

    /// Two sequences: a chunked prefill (7 + 5 tokens) beside a shorter one,
    /// then three decode steps; every position's logits.
    fn run(model: &Model) -> Result<Vec<Vec<f32>>> {
        let vocab = model.config.vocab_size as u32;
        let toks: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % vocab).collect();
        let mut pool = model.pool_for_tokens(256, KvDtype::F32);
        let (mut a, mut b) = (model.new_cache(), model.new_cache());
        let mut out = Vec::new();
        let steps: [(&[u32], &[u32]); 5] = [
            (&toks[0..7], &toks[20..23]),
            (&toks[7..12], &toks[23..24]),
            (&toks[12..13], &toks[24..25]),
            (&toks[13..14], &toks[25..26]),
            (&toks[14..15], &toks[26..27]),
        ];
        for (ta, tb) in steps {
            let mut seqs = [
                SeqInput {
                    tokens: ta,
                    cache: &mut a,
                    logits: true,
                },
                SeqInput {
                    tokens: tb,
                    cache: &mut b,
                    logits: true,
                },
            ];
            out.push(
                model
                    .forward(&mut seqs, &mut pool, LogitsMode::All, false)?
                    .logits,
            );
        }
        Ok(out)
    }

    #[test]
    fn int8_shards_stay_close_to_the_unsplit_int8_model() -> Result<()> {
        use crate::experts::DenseDtype;
        for name in ["qwen3_moe_a", "deepseek_v3"] {
            let dir = fixture(name);
            let cfg = ModelConfig::from_dir(&dir)?;
            let ws = WeightStore::open(&dir)?;
            let experts = load_executor(&cfg, &ws, &LoadOptions::default())?;
            let mut shards = LocalShards::load(&dir, 2, 1 << 22, 4)?;
            shards.set_dense_dtype(DenseDtype::Int8);
            let split = Model::from_store_with(
                cfg.clone(),
                &ws,
                Arc::new(LocalDispatcher::new(experts)),
                Some(Arc::new(shards)),
            )?;
            let mut whole = Model::load(&dir)?;
            whole.set_dense_dtype(DenseDtype::Int8);
            let (a, b) = (run(&split)?, run(&whole)?);
            let exact = run(&Model::load(&dir)?)?;
            for ((x, y), z) in a.iter().zip(&b).zip(&exact) {
                let scale = z.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
                let d = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
                // Only o_proj's per-channel scales and the activations'
                // per-row scales differ (over a shard's slice of K, not all of it).
                assert!(
                    d <= 0.05 * scale,
                    "{name}: int8 shards differ by {d} (max logit {scale})"
                );
                let q = x.iter().zip(z).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
                assert!(q > 0.0, "{name}: int8 shards changed nothing");
            }
        }
        Ok(())
    }

    #[test]
    fn two_shards_give_the_unsplit_logits() -> Result<()> {
        // (fixture, shards): 4 shards of 2 KV heads replicate each KV head
        // twice; Gemma 4's full layers have one KV head, replicated on both.
        for (name, of) in [
            ("qwen3_moe_a", 2),
            ("qwen3_moe_a", 4),
            ("qwen3_moe_b", 2),
            ("qwen2_moe", 2),
            ("mixtral", 2),
            ("gpt_oss", 2),
            ("gpt_oss", 4),
            ("gemma4", 2),
            ("deepseek_v2", 2),
            ("deepseek_v2", 4),
            ("deepseek_v3", 2),
            ("deepseek_v3", 4),
            ("deepseek_v3_g1", 2),
            ("deepseek_v3_g1", 4),
            ("olmoe", 2),
            ("olmoe", 4),
        ] {
            let dir = fixture(name);
            let whole = run(&Model::load(&dir)?)?;
            let split = run(&split_model(&dir, of)?)?;
            let mut max = 0.0f32;
            for (w, s) in whole.iter().zip(&split) {
                assert_eq!(w.len(), s.len());
                for (x, y) in w.iter().zip(s) {
                    max = max.max((x - y).abs());
                }
            }
            let scale = whole.iter().flatten().fold(0.0f32, |m, v| m.max(v.abs()));
            eprintln!("{name} over {of}: max logit difference {max:e} (largest logit {scale})");
            assert!(
                max <= 1e-5 * scale.max(1.0),
                "{name}: max logit difference {max} (largest logit {scale})"
            );
        }
        Ok(())
    }

    #[test]
    fn refuses_what_cannot_be_split() {
        // 4 query heads over 3 shards.
        let e = LocalShards::load(&fixture("qwen3_moe_a"), 3, 1 << 20, 4)
            .err()
            .map(|e| e.to_string());
        assert!(
            e.as_deref().is_some_and(|m| m.contains("split evenly")),
            "{e:?}"
        );
    }

    /// A chunk of sequence `id` in the caller's blocks of 8 positions.
    fn chunk(id: u64, past: usize, len: usize, blocks: &[u32]) -> SeqChunk {
        SeqChunk {
            id,
            past,
            len,
            blocks: blocks.to_vec(),
            block_size: 8,
        }
    }

    #[test]
    fn follows_the_callers_blocks_shares_them_and_refuses_gaps() -> Result<()> {
        let dir = fixture("qwen3_moe_a");
        let cfg = ModelConfig::from_dir(&dir)?;
        let ws = WeightStore::open(&dir)?;
        let h = cfg.hidden_size;
        // Blocks of 4 here, the caller's of 8: caller block b is ours 2b, 2b+1.
        let mut sh = AttentionShard::load(
            &cfg,
            &ws,
            HeadShard { index: 1, of: 2 },
            1 << 20,
            4,
            KvDtype::F32,
        )?;
        let cap = sh.stats().blocks_total / 2;
        let x: Vec<f32> = (0..10 * h).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let fresh = sh.forward(0, &x[..5 * h], &[chunk(2, 0, 5, &[3])])?;
        // Sequence 1 computes 5 positions, then is rewound to 3 (a retry),
        // with the table it sent before.
        sh.forward(0, &x[..5 * h], &[chunk(1, 0, 5, &[5])])?;
        let again = sh.forward(0, &x[3 * h..5 * h], &[chunk(1, 3, 2, &[])])?;
        assert_eq!(&again[..], &fresh[3 * h..]);
        assert_eq!(sh.held(1, 0), Some(5));
        // A gap is refused with the positions named.
        let e = sh.forward(0, &x[..h], &[chunk(1, 9, 1, &[5, 6])]);
        assert!(e.is_err_and(|e| e.to_string().contains("holds only 5")));
        // Layer 1 has nothing yet for sequence 1.
        let e = sh.forward(1, &x[..h], &[chunk(1, 1, 1, &[])]);
        assert!(e.is_err_and(|e| e.to_string().contains("holds only 0")));
        // A full block written by one sequence serves another that names it
        // (the caller's prefix cache): its next positions come out the same.
        let whole = sh.forward(0, &x, &[chunk(7, 0, 10, &[10, 11])])?;
        let shared = sh.forward(0, &x[8 * h..], &[chunk(8, 8, 2, &[10, 12])])?;
        // (Up to the projections' summation order, which depends on the
        // number of rows: 2 here, 10 there.)
        let d = shared
            .iter()
            .zip(&whole[8 * h..])
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d <= 1e-5, "shared-block output differs by {d}");
        // Writing into a block nobody wrote is refused past its start.
        let e = sh.forward(0, &x[..h], &[chunk(8, 9, 1, &[10, 13])]);
        assert!(e.is_err_and(|e| e.to_string().contains("holds only 8")));
        // Tables that are short, out of range or in blocks of another size.
        let e = sh.forward(0, &x[..h], &[chunk(9, 8, 1, &[1])]);
        assert!(e.is_err_and(|e| e.to_string().contains("cannot hold")));
        let e = sh.forward(0, &x[..h], &[chunk(9, 0, 1, &[cap as u32])]);
        assert!(e.is_err_and(|e| e.to_string().contains("beyond")));
        let mut odd = chunk(9, 0, 1, &[1]);
        odd.block_size = 6;
        let e = sh.forward(0, &x[..h], &[odd]);
        assert!(e.is_err_and(|e| e.to_string().contains("multiple")));
        // No table yet for a sequence that sends none.
        let e = sh.forward(0, &x[..h], &[chunk(99, 0, 1, &[])]);
        assert!(e.is_err_and(|e| e.to_string().contains("no block table")));
        assert_eq!(sh.stats().sequences, 4);
        sh.release(&[1, 2]);
        assert_eq!(sh.stats().sequences, 2);
        assert_eq!(sh.held(1, 0), None);
        // After release_all nothing written before is relied on.
        sh.release_all();
        assert_eq!(sh.stats().blocks_free, sh.stats().blocks_total);
        let e = sh.forward(0, &x[8 * h..9 * h], &[chunk(8, 8, 1, &[10, 12])]);
        assert!(e.is_err_and(|e| e.to_string().contains("holds only 0")));
        Ok(())
    }
}
