//! Tensor-parallel attention: a shard holds a contiguous range of every
//! layer's heads and its own paged KV cache, keyed by sequence id, and returns
//! its partial output projection; the caller sums the shards' partials. The
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
use crate::model::kv_cache::{KvDtype, KvPool, SeqCache};
use crate::model::mla::Mla;
use crate::model::rope::Rope;

/// One sequence's chunk of a batch sent to attention shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqChunk {
    /// Stable id of the sequence (its [`SeqCache::id`] on the coordinator).
    pub id: u64,
    /// Positions cached before this chunk: the shard truncates to it if it
    /// holds more (recompute after preemption, retries) and refuses if fewer.
    pub past: usize,
    /// New tokens.
    pub len: usize,
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
    /// Forgets these sequences' KV (finished, cancelled or preempted). May be
    /// deferred until the next [`forward`](Self::forward) or [`flush`](Self::flush).
    fn release(&self, ids: &[u64]);
    /// Sends deferred releases now (the scheduler calls it when idle).
    fn flush(&self) {}
    /// Positions of KV every shard can hold, for sizing the caller's block
    /// accounting (None: unknown).
    fn capacity_positions(&self) -> Option<usize>;
}

/// One sequence's blocks on a shard and how many positions each layer holds
/// (layers can differ after a step that failed half-way).
struct ShardSeq {
    cache: SeqCache,
    lens: Vec<usize>,
}

/// One layer's heads on a shard.
enum ShardAttn {
    Gqa(Attention),
    Mla(Mla),
}

impl ShardAttn {
    fn kv_widths(&self) -> (usize, usize) {
        match self {
            ShardAttn::Gqa(a) => (a.kv_width(), a.kv_width()),
            ShardAttn::Mla(m) => m.kv_widths(),
        }
    }
}

/// A shard of every attention layer plus the KV cache of its heads.
pub struct AttentionShard {
    shard: HeadShard,
    hidden: usize,
    layers: Vec<(ShardAttn, Rope)>,
    pool: KvPool,
    seqs: HashMap<u64, ShardSeq>,
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
    /// slice). bf16 is how they load, so only int8 changes them.
    pub fn set_dense_dtype(&mut self, dtype: crate::experts::DenseDtype) {
        if dtype != crate::experts::DenseDtype::Int8 {
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
        all.into_par_iter().for_each(|l| l.to_int8());
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
        let widths: Vec<(usize, usize)> = layers.iter().map(|(a, _)| a.kv_widths()).collect();
        let block_size = block_size.max(1);
        let num_blocks = kv_bytes / KvPool::block_bytes(&widths, block_size, kv_dtype).max(1);
        if num_blocks == 0 {
            return Err(Error::InvalidInput(format!(
                "a KV cache of {kv_bytes} bytes holds not even one block of {block_size} positions ({} bytes on this shard with {} elements)",
                KvPool::block_bytes(&widths, block_size, kv_dtype),
                kv_dtype.name()
            )));
        }
        Ok(AttentionShard {
            shard,
            hidden: cfg.hidden_size,
            layers,
            pool: KvPool::new(&widths, block_size, num_blocks, kv_dtype),
            seqs: HashMap::new(),
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

    /// KV cache occupancy.
    pub fn stats(&self) -> ShardStats {
        ShardStats {
            block_size: self.pool.block_size(),
            blocks_total: self.pool.num_blocks(),
            blocks_free: self.pool.free_blocks(),
            sequences: self.seqs.len(),
        }
    }

    /// Positions of one sequence held at `layer` (None: unknown sequence).
    pub fn held(&self, id: u64, layer: usize) -> Option<usize> {
        self.seqs.get(&id).and_then(|s| s.lens.get(layer).copied())
    }

    /// Frees sequences' blocks; unknown ids are ignored.
    pub fn release(&mut self, ids: &[u64]) {
        for id in ids {
            if let Some(mut s) = self.seqs.remove(id) {
                self.pool.release(&mut s.cache);
            }
        }
    }

    /// Frees every sequence (a coordinator (re)started).
    pub fn release_all(&mut self) {
        for (_, mut s) in self.seqs.drain() {
            self.pool.release(&mut s.cache);
        }
    }

    /// Runs this shard's heads of layer `layer` for `x` (`[tokens, hidden]`)
    /// and returns its partial output projection `[tokens, hidden]`. Each
    /// chunk's keys/values are written at positions `past..past + len`; a
    /// sequence holding more than `past` positions at this layer is truncated
    /// first, one holding fewer is an error.
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
            let held = self.held(c.id, layer).unwrap_or(0);
            if c.past > held {
                return Err(Error::InvalidInput(format!(
                    "sequence {} at layer {layer}: asked to append at position {} but this shard holds only {held} positions (it may have restarted or missed a step)",
                    c.id, c.past
                )));
            }
        }
        // Truncate and reserve; on a full cache nothing of this step is written.
        for c in chunks {
            let s = self.seqs.entry(c.id).or_insert_with(|| ShardSeq {
                cache: SeqCache::new(),
                lens: vec![0; nl],
            });
            s.lens[layer] = c.past;
            let keep = s
                .lens
                .iter()
                .copied()
                .max()
                .unwrap_or(0)
                .max(c.past + c.len);
            let blocks = self.pool.blocks_for(keep);
            self.pool.shrink(&mut s.cache, blocks);
            if let Err(e) = self.pool.reserve(&mut s.cache, c.past + c.len) {
                let fresh = s.lens.iter().all(|&l| l == 0);
                if fresh {
                    let mut s = self.seqs.remove(&c.id);
                    if let Some(s) = s.as_mut() {
                        self.pool.release(&mut s.cache);
                    }
                }
                return Err(Error::InvalidInput(format!(
                    "attention shard {} of {}: {e} (raise --kv-cache-memory)",
                    self.shard.index, self.shard.of
                )));
            }
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
        let caches: Vec<SeqCache> = chunks
            .iter()
            .map(|c| {
                self.seqs
                    .get(&c.id)
                    .map(|s| s.cache.clone())
                    .unwrap_or_default()
            })
            .collect();
        let refs: Vec<&SeqCache> = caches.iter().collect();
        let (att, rope) = &self.layers[layer];
        let out = match att {
            ShardAttn::Gqa(a) => a.forward(x, &spans, &refs, &mut self.pool, layer, rope),
            ShardAttn::Mla(m) => m.forward(x, &spans, &refs, &mut self.pool, layer, rope),
        };
        for c in chunks {
            if let Some(s) = self.seqs.get_mut(&c.id) {
                s.lens[layer] = c.past + c.len;
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

    #[test]
    fn truncates_refuses_gaps_and_frees() -> Result<()> {
        let dir = fixture("qwen3_moe_a");
        let cfg = ModelConfig::from_dir(&dir)?;
        let ws = WeightStore::open(&dir)?;
        let h = cfg.hidden_size;
        let mut sh = AttentionShard::load(
            &cfg,
            &ws,
            HeadShard { index: 1, of: 2 },
            1 << 20,
            4,
            KvDtype::F32,
        )?;
        let x: Vec<f32> = (0..5 * h).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let free0 = sh.stats().blocks_free;
        let fresh = sh.forward(
            0,
            &x,
            &[SeqChunk {
                id: 2,
                past: 0,
                len: 5,
            }],
        )?;
        // Sequence 1 computes 5 positions, then is rewound to 3 (a retry).
        sh.forward(
            0,
            &x,
            &[SeqChunk {
                id: 1,
                past: 0,
                len: 5,
            }],
        )?;
        let again = sh.forward(
            0,
            &x[3 * h..],
            &[SeqChunk {
                id: 1,
                past: 3,
                len: 2,
            }],
        )?;
        assert_eq!(&again[..], &fresh[3 * h..]);
        assert_eq!(sh.held(1, 0), Some(5));
        // A gap is refused with the positions named.
        let e = sh.forward(
            0,
            &x[..h],
            &[SeqChunk {
                id: 1,
                past: 9,
                len: 1,
            }],
        );
        assert!(e.is_err_and(|e| e.to_string().contains("holds only 5")));
        // Layer 1 has nothing yet for sequence 1.
        let e = sh.forward(
            1,
            &x[..h],
            &[SeqChunk {
                id: 1,
                past: 1,
                len: 1,
            }],
        );
        assert!(e.is_err());
        sh.release(&[1, 2]);
        assert_eq!(sh.stats().blocks_free, free0);
        assert_eq!(sh.stats().sequences, 0);
        Ok(())
    }

    #[test]
    fn full_cache_is_a_clear_error() -> Result<()> {
        let dir = fixture("qwen3_moe_a");
        let cfg = ModelConfig::from_dir(&dir)?;
        let ws = WeightStore::open(&dir)?;
        let h = cfg.hidden_size;
        let probe = AttentionShard::load(
            &cfg,
            &ws,
            HeadShard { index: 0, of: 2 },
            1 << 20,
            4,
            KvDtype::F32,
        )?;
        let widths: Vec<(usize, usize)> = probe.layers.iter().map(|(a, _)| a.kv_widths()).collect();
        // Room for exactly two blocks of 4 positions.
        let bytes = 2 * KvPool::block_bytes(&widths, 4, KvDtype::F32);
        let mut sh = AttentionShard::load(
            &cfg,
            &ws,
            HeadShard { index: 0, of: 2 },
            bytes,
            4,
            KvDtype::F32,
        )?;
        let x = vec![0.1f32; 9 * h];
        sh.forward(
            0,
            &x[..8 * h],
            &[SeqChunk {
                id: 1,
                past: 0,
                len: 8,
            }],
        )?;
        let e = sh.forward(
            0,
            &x[..h],
            &[SeqChunk {
                id: 2,
                past: 0,
                len: 1,
            }],
        );
        assert!(e.is_err_and(|e| e.to_string().contains("KV cache full")));
        assert_eq!(sh.stats().sequences, 1);
        sh.release_all();
        sh.forward(
            0,
            &x[..h],
            &[SeqChunk {
                id: 2,
                past: 0,
                len: 1,
            }],
        )?;
        Ok(())
    }
}
