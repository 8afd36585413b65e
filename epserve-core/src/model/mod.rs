//! The decoder-only MoE transformer: embeddings, decoder layers (attention +
//! dense MLP or MoE block), final norm and LM head. One forward pass takes a
//! flattened batch of several sequences (prefill chunks and decode steps
//! mixed), as continuous batching needs.

pub mod attention;
pub mod attn_shard;
pub mod kv_cache;
pub mod linear;
pub mod mla;
pub mod moe;
pub mod rope;

use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;

use crate::config::{Arch, FfnKind, ModelConfig};
use crate::error::{Error, Result};
pub use crate::experts::LoadOptions;
use crate::experts::LocalDispatcher;
use crate::kernels::{add_assign, add_rms_norm, rms_norm};
use crate::loader::names;
use crate::loader::weights::WeightStore;
use crate::moe::mlp::GatedMlp;
use crate::moe::{Dispatcher, Routing};
use crate::profile::{self, Phase};
use crate::tensor::Weight;
use linear::{DenseMlp, Linear};

use attention::{Attention, SeqSpan};
use attn_shard::{AttentionBackend, SeqChunk};
use kv_cache::{KvCacheDtype, KvDtype, KvLayerShape, KvLayout, KvPool, SeqCache};
use mla::Mla;
use moe::{MoeBlock, Router, SharedExpert};
use rope::Rope;

// One per layer: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Ffn {
    Dense(DenseMlp),
    Moe(MoeBlock),
    /// Gemma 4: a dense MLP and the experts side by side, each with its own norms.
    DenseAndMoe(Box<ParallelFfn>),
}

/// Gemma 4's feed-forward: `norm1(mlp(pre(x))) + norm2(experts(pre2(x)))`,
/// the router reading the un-normalized residual `x`.
struct ParallelFfn {
    mlp: DenseMlp,
    mlp_out_norm: Vec<f32>,
    moe: MoeBlock,
    moe_in_norm: Vec<f32>,
    moe_out_norm: Vec<f32>,
}

/// Grouped-query attention or DeepSeek's multi-head latent attention.
enum LayerAttn {
    Gqa(Attention),
    Mla(Mla),
    /// Attention on tensor-parallel shards (the model's [`AttentionBackend`]);
    /// only the `o_proj` bias lives here, added once after the shards' sum.
    Remote {
        o_bias: Option<Vec<f32>>,
    },
}

impl LayerAttn {
    fn kv_shape(&self) -> KvLayerShape {
        match self {
            LayerAttn::Gqa(a) => a.kv_shape(),
            LayerAttn::Mla(m) => m.kv_widths().into(),
            // The KV lives on the shards; this process only counts blocks.
            LayerAttn::Remote { .. } => (0, 0).into(),
        }
    }
}

struct DecoderLayer {
    input_norm: Vec<f32>,
    attn: LayerAttn,
    /// Gemma 4: RMSNorm of the attention output before the residual add.
    attn_out_norm: Option<Vec<f32>>,
    /// The norm in front of the feed-forward block.
    post_norm: Vec<f32>,
    ffn: Ffn,
    /// Gemma 4: RMSNorm of the feed-forward output before the residual add.
    ffn_out_norm: Option<Vec<f32>>,
    /// Gemma 4: the residual stream is multiplied by this after the layer.
    layer_scalar: Option<f32>,
    rope: Rope,
}

/// One sequence's share of a forward pass: its new tokens and its cache.
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut SeqCache,
    /// Whether this sequence's rows get logits. `false` for a prefill chunk
    /// that is not the prompt's last: its logits would be discarded, so the
    /// final norm and LM head skip it.
    pub logits: bool,
}

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    /// Only each sequence's last new token.
    Last,
    /// Every new token.
    All,
}

/// Router decisions of one MoE layer during a forward pass.
#[derive(Debug, Clone)]
pub struct RouterTrace {
    pub layer: usize,
    pub routing: Routing,
}

/// Output of [`Model::forward`].
#[derive(Debug, Clone)]
pub struct ForwardOutput {
    /// `[rows, vocab]`: one row per sequence (`Last`) or per token (`All`),
    /// for the sequences that asked for logits, in batch order.
    pub logits: Vec<f32>,
    pub rows: usize,
    /// Filled when tracing was requested.
    pub router: Vec<RouterTrace>,
    /// Rows whose experts could not all be reached
    /// ([`Dispatched::faults`](crate::moe::Dispatched::faults)), in batch rows.
    pub faults: Vec<crate::moe::RowFault>,
    /// Time the calling thread spent blocked on remote experts and remote
    /// attention (the rest of the step it computed).
    pub waited: std::time::Duration,
    /// Every remote dispatch of the step (empty in process).
    pub dispatch_timings: Vec<crate::moe::DispatchTiming>,
}

/// A loaded model.
pub struct Model {
    pub config: ModelConfig,
    embed: Weight,
    layers: Vec<DecoderLayer>,
    norm: Vec<f32>,
    lm_head: Linear,
    dispatcher: Arc<dyn Dispatcher>,
    /// Set when attention runs on tensor-parallel shards.
    attention: Option<Arc<dyn AttentionBackend>>,
    /// The in-process experts' tiers, when they have a memory budget.
    expert_tiers: Option<Arc<crate::experts::TieredExperts>>,
}

impl Model {
    /// Loads a model folder with every expert in this process, with the
    /// default [`LoadOptions`] (packed experts, bf16 where exact).
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(dir, &LoadOptions::default())
    }

    /// Loads a model folder with every expert in this process, executed as
    /// `opts` asks (packed or portable executor, expert precision, threads).
    #[tracing::instrument(level = "info", name = "load_model", skip_all, fields(dir = %dir.display()))]
    pub fn load_with(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        let cfg = ModelConfig::from_dir(dir)?;
        let ws = Arc::new(WeightStore::open(dir)?);
        let (experts, tiers) = crate::experts::load_executor_shared(&cfg, &ws, opts, |_, _| true)?;
        let dispatcher = Arc::new(LocalDispatcher::new(experts));
        let mut model = Self::from_store(cfg, &ws, dispatcher)?;
        model.set_dense_dtype(opts.dense_dtype);
        model.expert_tiers = tiers;
        Ok(model)
    }

    /// Sets the precision of the dense projections outside the experts
    /// (attention and MLA projections, dense MLPs, shared experts, the LM
    /// head; not the routers) to `dtype`: int8 requantizes them, bf16 rounds
    /// their activations; `auto` is how they load.
    pub fn set_dense_dtype(&mut self, dtype: crate::experts::DenseDtype) {
        if dtype == crate::experts::DenseDtype::Auto {
            return;
        }
        let mut all: Vec<&mut Linear> = vec![&mut self.lm_head];
        for layer in &mut self.layers {
            match &mut layer.attn {
                LayerAttn::Gqa(a) => all.extend(a.linears_mut()),
                LayerAttn::Mla(a) => all.extend(a.linears_mut()),
                LayerAttn::Remote { .. } => {}
            }
            match &mut layer.ffn {
                Ffn::Dense(m) => all.extend(m.linears_mut()),
                Ffn::Moe(b) => {
                    if let Some(sh) = &mut b.shared {
                        all.extend(sh.mlp.linears_mut());
                    }
                }
                Ffn::DenseAndMoe(p) => {
                    all.extend(p.mlp.linears_mut());
                    if let Some(sh) = &mut p.moe.shared {
                        all.extend(sh.mlp.linears_mut());
                    }
                }
            }
        }
        all.into_par_iter().for_each(|l| l.set_dtype(dtype));
    }

    /// Loads the non-expert weights and uses `dispatcher` for the experts.
    pub fn from_store(
        cfg: ModelConfig,
        ws: &WeightStore,
        dispatcher: Arc<dyn Dispatcher>,
    ) -> Result<Self> {
        Self::from_store_with(cfg, ws, dispatcher, None)
    }

    /// Loads the non-expert weights and uses `dispatcher` for the experts;
    /// with `attention`, the attention layers run there (tensor-parallel
    /// shards) and no attention weights but the `o_proj` biases are loaded.
    #[tracing::instrument(
        level = "info",
        name = "load_layers",
        skip_all,
        fields(layers = cfg.num_hidden_layers, remote_attention = attention.is_some())
    )]
    pub fn from_store_with(
        cfg: ModelConfig,
        ws: &WeightStore,
        dispatcher: Arc<dyn Dispatcher>,
        attention: Option<Arc<dyn AttentionBackend>>,
    ) -> Result<Self> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let wp = cfg.weight_prefix.clone();
        let embed = ws.get(&format!("{wp}.embed_tokens.weight"), &[v, h])?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            ws.get("lm_head.weight", &[v, h])?
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let gemma = cfg.arch == Arch::Gemma4;
        crate::loader::progress::layers_planned(cfg.num_hidden_layers as u64);
        for i in 0..cfg.num_hidden_layers {
            let lp = names::layer_prefix_for(&cfg, i);
            let attn = if attention.is_some() {
                let prefix = format!("{lp}.self_attn");
                LayerAttn::Remote {
                    o_bias: if cfg.mla.is_some() {
                        Mla::load_o_bias(ws, &prefix, h)?
                    } else {
                        Attention::load_o_bias(&cfg, ws, &prefix)?
                    },
                }
            } else if cfg.mla.is_some() {
                LayerAttn::Mla(Mla::load(&cfg, ws, &format!("{lp}.self_attn"), i)?)
            } else {
                LayerAttn::Gqa(Attention::load(&cfg, ws, &format!("{lp}.self_attn"), i)?)
            };
            let norm = |name: &str| ws.get_vec(&format!("{lp}.{name}.weight"), h);
            let dense = || {
                GatedMlp::load_with_bias(
                    ws,
                    &format!("{lp}.mlp"),
                    h,
                    cfg.intermediate_size,
                    cfg.activation,
                    cfg.mlp_bias,
                )
                .and_then(DenseMlp::try_from)
            };
            let ffn = match cfg.layers[i].ffn {
                FfnKind::Dense => Ffn::Dense(dense()?),
                FfnKind::Moe => {
                    let router = Router::load(&cfg, ws, i)?;
                    let shared = match cfg.shared_expert_intermediate_size {
                        Some(si) => {
                            let sp = names::shared_expert_prefix(&cfg, i);
                            Some(SharedExpert {
                                mlp: GatedMlp::load_with_bias(
                                    ws,
                                    &sp,
                                    h,
                                    si,
                                    cfg.activation,
                                    cfg.mlp_bias,
                                )?
                                .try_into()?,
                                gate: ws.get_opt(&format!("{sp}_gate.weight"), &[1, h])?,
                            })
                        }
                        None => None,
                    };
                    let moe = MoeBlock { router, shared };
                    if gemma {
                        Ffn::DenseAndMoe(Box::new(ParallelFfn {
                            mlp: dense()?,
                            mlp_out_norm: norm("post_feedforward_layernorm_1")?,
                            moe,
                            moe_in_norm: norm("pre_feedforward_layernorm_2")?,
                            moe_out_norm: norm("post_feedforward_layernorm_2")?,
                        }))
                    } else {
                        Ffn::Moe(moe)
                    }
                }
            };
            layers.push(DecoderLayer {
                input_norm: norm("input_layernorm")?,
                attn,
                attn_out_norm: if gemma {
                    Some(norm("post_attention_layernorm")?)
                } else {
                    None
                },
                post_norm: if gemma {
                    norm("pre_feedforward_layernorm")?
                } else {
                    norm("post_attention_layernorm")?
                },
                ffn,
                ffn_out_norm: if gemma {
                    Some(norm("post_feedforward_layernorm")?)
                } else {
                    None
                },
                layer_scalar: match ws.get_opt(&format!("{lp}.layer_scalar"), &[1])? {
                    Some(w) if gemma => w.to_f32_vec().first().copied(),
                    _ => None,
                },
                rope: Rope::new(&cfg.layers[i].rope),
            });
            crate::loader::progress::layer_loaded();
        }
        let norm = ws.get_vec(&format!("{wp}.norm.weight"), h)?;
        Ok(Model {
            config: cfg,
            embed,
            layers,
            norm,
            lm_head: Linear::new(lm_head),
            dispatcher,
            attention,
            expert_tiers: None,
        })
    }

    /// The in-process experts' tiers (`--expert-memory`), for their counters.
    pub fn expert_tiers(&self) -> Option<&Arc<crate::experts::TieredExperts>> {
        self.expert_tiers.as_ref()
    }

    /// Whether attention runs on tensor-parallel shards.
    pub fn remote_attention(&self) -> Option<&Arc<dyn AttentionBackend>> {
        self.attention.as_ref()
    }

    /// Frees a sequence's KV blocks here and, with remote attention, on the
    /// shards (finished, cancelled or preempted sequences).
    pub fn release(&self, pool: &mut KvPool, cache: &mut SeqCache) {
        pool.release(cache);
        if let Some(a) = &self.attention {
            a.release(&[cache.id()]);
        }
    }

    /// Sends deferred releases to remote attention shards (call when idle).
    pub fn flush_releases(&self) {
        if let Some(a) = &self.attention {
            a.flush();
        }
    }

    /// An empty KV cache for one sequence (a block table into a [`KvPool`]).
    pub fn new_cache(&self) -> SeqCache {
        SeqCache::new()
    }

    /// Per layer, what is cached per position: key and value widths and
    /// the KV heads they hold.
    pub fn kv_layer_shapes(&self) -> Vec<KvLayerShape> {
        self.layers.iter().map(|l| l.attn.kv_shape()).collect()
    }

    /// A KV pool of `num_blocks` blocks of `block_size` positions, elements
    /// stored as `dtype`, in the default layout.
    pub fn new_pool(&self, block_size: usize, num_blocks: usize, dtype: KvDtype) -> KvPool {
        KvPool::for_layers(
            &self.kv_layer_shapes(),
            block_size,
            num_blocks,
            dtype,
            KvLayout::default(),
        )
    }

    /// A pool with room for `tokens` positions in blocks of 16 (tests, one-off runs).
    pub fn pool_for_tokens(&self, tokens: usize, dtype: KvDtype) -> KvPool {
        self.new_pool(16, tokens.div_ceil(16), dtype)
    }

    /// Bytes of KV cache per block of `block_size` positions stored as `dtype`.
    pub fn kv_block_bytes(&self, block_size: usize, dtype: KvDtype) -> usize {
        KvPool::layer_block_bytes(&self.kv_layer_shapes(), block_size, dtype)
    }

    /// The KV cache dtype `requested` means for this model (`auto`: its
    /// declared dtype).
    pub fn kv_dtype(&self, requested: KvCacheDtype) -> KvDtype {
        requested.resolve(self.config.declared_dtype.as_deref())
    }

    /// Runs one step for several sequences at once. Each sequence's tokens are
    /// appended after what its cache already holds.
    pub fn forward(
        &self,
        seqs: &mut [SeqInput<'_>],
        pool: &mut KvPool,
        mode: LogitsMode,
        trace_router: bool,
    ) -> Result<ForwardOutput> {
        self.forward_micro(seqs, pool, mode, trace_router, 1)
    }

    /// [`forward`](Self::forward) with the batch split into `micro_batches`
    /// groups of whole sequences (balanced by tokens; at most one group per
    /// sequence) that move through the layers in a ping-pong: micro-batch
    /// `m` runs its attention (and routing) while the experts of micro-batch
    /// `m - 1` run wherever the dispatcher sends them, and waits for its own
    /// previous layer's experts only when it needs them. With a dispatcher
    /// that computes in this process every micro-batch finishes eagerly, so
    /// splitting only adds work; with remote experts (and remote attention)
    /// the coordinator and the workers are busy at the same time. Each
    /// sequence's rows are computed exactly as in one batch: outputs do not
    /// depend on the split (up to the summation order of kernels whose
    /// blocking depends on the row count).
    #[tracing::instrument(
        level = "debug",
        name = "forward",
        skip_all,
        fields(seqs = seqs.len(), tokens = seqs.iter().map(|s| s.tokens.len()).sum::<usize>(), micro_batches)
    )]
    pub fn forward_micro(
        &self,
        seqs: &mut [SeqInput<'_>],
        pool: &mut KvPool,
        mode: LogitsMode,
        trace_router: bool,
        micro_batches: usize,
    ) -> Result<ForwardOutput> {
        let cfg = &self.config;
        let h = cfg.hidden_size;
        let mut spans = Vec::with_capacity(seqs.len());
        let mut tokens = Vec::new();
        for s in seqs.iter() {
            if s.tokens.is_empty() {
                return Err(Error::InvalidInput(
                    "a sequence in the batch has no new tokens".into(),
                ));
            }
            spans.push(SeqSpan {
                start: tokens.len(),
                len: s.tokens.len(),
                past: s.cache.len(),
            });
            tokens.extend_from_slice(s.tokens);
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(Error::InvalidInput(format!(
                "token id {bad} is outside the vocabulary (size {})",
                cfg.vocab_size
            )));
        }
        // Reserve KV blocks up front; roll back on failure so nothing leaks.
        let before: Vec<usize> = seqs.iter().map(|s| s.cache.blocks().len()).collect();
        for i in 0..seqs.len() {
            let new_len = spans[i].past + spans[i].len;
            if let Err(e) = pool.reserve(seqs[i].cache, new_len) {
                for (s, &b) in seqs.iter_mut().zip(&before).take(i) {
                    pool.shrink(s.cache, b);
                }
                return Err(e);
            }
        }
        let t = tokens.len();
        let embed_t = profile::timer(Phase::Embed);
        let mut x = vec![0.0f32; t * h];
        for (row, &tok) in tokens.iter().enumerate() {
            self.embed
                .row_to_f32(tok as usize, &mut x[row * h..(row + 1) * h]);
        }
        if let Some(s) = cfg.embed_scale {
            for v in &mut x {
                *v *= s;
            }
        }
        drop(embed_t);
        let caches: Vec<&SeqCache> = seqs.iter().map(|s| &*s.cache).collect();
        let chunks: Vec<SeqChunk> = spans
            .iter()
            .zip(&caches)
            .map(|(sp, c)| SeqChunk {
                id: c.id(),
                past: sp.past,
                len: sp.len,
                blocks: if self.attention.is_some() {
                    c.blocks().to_vec()
                } else {
                    Vec::new()
                },
                block_size: pool.block_size(),
            })
            .collect();
        let groups = split_micro_batches(&spans, micro_batches);
        let mut micro: Vec<Micro<'_>> = groups
            .iter()
            .map(|g| {
                let row0 = spans[g.start].start;
                let rows: usize = spans[g.clone()].iter().map(|sp| sp.len).sum();
                Micro {
                    row0,
                    rows,
                    spans: spans[g.clone()]
                        .iter()
                        .map(|sp| SeqSpan {
                            start: sp.start - row0,
                            ..*sp
                        })
                        .collect(),
                    caches: &caches[g.clone()],
                    chunks: &chunks[g.clone()],
                    x: x[row0 * h..(row0 + rows) * h].to_vec(),
                    pending: None,
                }
            })
            .collect();
        let mut step = StepRun {
            trace: if trace_router {
                (0..self.layers.len()).map(|_| None).collect()
            } else {
                Vec::new()
            },
            faults: Vec::new(),
            waited: std::time::Duration::ZERO,
            timings: Vec::new(),
        };
        self.dispatcher.begin_step();
        let ran = self.run_layers(&mut micro, pool, &mut step);
        self.dispatcher.end_step();
        ran?;
        for m in &micro {
            x[m.row0 * h..(m.row0 + m.rows) * h].copy_from_slice(&m.x);
        }
        drop(micro);
        drop(caches);
        let StepRun {
            trace,
            faults,
            waited,
            timings,
        } = step;
        for s in seqs.iter_mut() {
            pool.advance(s.cache, s.tokens);
        }
        // Final norm and LM head on the rows that need logits.
        let wanted = spans.iter().zip(seqs.iter()).filter(|(_, s)| s.logits);
        let rows: Vec<usize> = match mode {
            LogitsMode::All => wanted
                .flat_map(|(sp, _)| sp.start..sp.start + sp.len)
                .collect(),
            LogitsMode::Last => wanted.map(|(sp, _)| sp.start + sp.len - 1).collect(),
        };
        let _lm = profile::timer(Phase::LmHead).work(|| match rows.len() {
            0 => (0, 0),
            n => (self.lm_head.bytes(), self.lm_head.macs(n)),
        });
        let mut sel = Vec::with_capacity(rows.len() * h);
        for &r in &rows {
            sel.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        rms_norm(&mut sel, &self.norm, cfg.rms_norm_eps);
        let mut logits = vec![0.0f32; rows.len() * cfg.vocab_size];
        self.lm_head.forward(&sel, rows.len(), None, &mut logits);
        if let Some(cap) = cfg.final_logit_softcapping {
            for l in &mut logits {
                *l = (*l / cap).tanh() * cap;
            }
        }
        Ok(ForwardOutput {
            logits,
            rows: rows.len(),
            router: trace.into_iter().flatten().collect(),
            faults,
            waited,
            dispatch_timings: timings,
        })
    }

    /// The staged layer loop: for each layer, each micro-batch first
    /// finishes its previous layer (waits for its experts) and then runs this
    /// layer's attention and submits its experts, so one micro-batch's
    /// attention overlaps the others' experts.
    fn run_layers(
        &self,
        micro: &mut [Micro<'_>],
        pool: &mut KvPool,
        step: &mut StepRun,
    ) -> Result<()> {
        for (li, layer) in self.layers.iter().enumerate() {
            let _layer = tracing::debug_span!("layer", layer = li).entered();
            for m in micro.iter_mut() {
                if li > 0 {
                    self.finish_ffn(li - 1, m, step)?;
                }
                self.attention_and_submit(li, layer, m, pool, step)?;
            }
        }
        if let Some(last) = self.layers.len().checked_sub(1) {
            for m in micro.iter_mut() {
                self.finish_ffn(last, m, step)?;
            }
        }
        Ok(())
    }

    /// Router lookahead (as Pre-gated MoE): when the expert store has a
    /// cold tier, the next MoE layer's router is applied to layer `li`'s
    /// router input and the experts it picks are sent as a prefetch hint,
    /// so they are packed while this layer and the next attention run.
    fn lookahead(&self, li: usize, router_x: &[f32], rows: usize) {
        let dispatcher = self.dispatcher.as_ref();
        if !dispatcher.wants_prefetch() {
            return;
        }
        let Some((next, router)) =
            self.layers
                .iter()
                .enumerate()
                .skip(li + 1)
                .find_map(|(j, l)| match &l.ffn {
                    Ffn::Moe(b) => Some((j, &b.router)),
                    Ffn::DenseAndMoe(p) => Some((j, &p.moe.router)),
                    Ffn::Dense(_) => None,
                })
        else {
            return;
        };
        let _t = profile::timer(Phase::Router);
        let r = router.route(router_x, rows);
        let mut seen = vec![false; router.num_experts()];
        let mut ids = Vec::new();
        for &e in &r.topk_ids {
            if let Some(s) = seen.get_mut(e as usize)
                && !*s
            {
                *s = true;
                ids.push(e);
            }
        }
        dispatcher.prefetch(next, &ids);
    }

    /// Attention of layer `li` for one micro-batch, its residual add, and the
    /// feed-forward block started (a dense MLP computed, experts submitted).
    fn attention_and_submit(
        &self,
        li: usize,
        layer: &DecoderLayer,
        m: &mut Micro<'_>,
        pool: &mut KvPool,
        step: &mut StepRun,
    ) -> Result<()> {
        let cfg = &self.config;
        let (h, t) = (cfg.hidden_size, m.rows);
        let mut normed = m.x.clone();
        rms_norm(&mut normed, &layer.input_norm, cfg.rms_norm_eps);
        let attn_span = tracing::trace_span!("attention").entered();
        let attn_t = profile::timer(Phase::Attention);
        let mut a = match &layer.attn {
            LayerAttn::Gqa(att) => att.forward(&normed, &m.spans, m.caches, pool, li, &layer.rope),
            LayerAttn::Mla(att) => att.forward(&normed, &m.spans, m.caches, pool, li, &layer.rope),
            LayerAttn::Remote { o_bias } => {
                let backend = self.attention.as_ref().ok_or_else(|| {
                    Error::Dispatch("remote attention layer without a backend".into())
                })?;
                // Block tables go with layer 0; the shards keep them for
                // the step's later layers.
                let chunks = m
                    .chunks
                    .iter()
                    .map(|c| SeqChunk {
                        blocks: if li == 0 {
                            c.blocks.clone()
                        } else {
                            Vec::new()
                        },
                        ..*c
                    })
                    .collect();
                let pending = backend
                    .clone()
                    .submit(li, Arc::from(normed.as_slice()), chunks)?;
                let waited = std::time::Instant::now();
                let mut a = pending.wait()?;
                step.waited += waited.elapsed();
                if a.len() != t * h {
                    return Err(Error::Dispatch(format!(
                        "attention shards returned {} values for {t} tokens of hidden size {h}",
                        a.len()
                    )));
                }
                if let Some(b) = o_bias {
                    for row in a.chunks_exact_mut(h) {
                        for (v, bb) in row.iter_mut().zip(b) {
                            *v += bb;
                        }
                    }
                }
                a
            }
        };
        drop(attn_t);
        drop(attn_span);
        if let Some(n) = &layer.attn_out_norm {
            rms_norm(&mut a, n, cfg.rms_norm_eps);
        }
        add_rms_norm(
            &mut m.x,
            &a,
            &layer.post_norm,
            cfg.rms_norm_eps,
            &mut normed,
        );
        let _ffn = tracing::trace_span!("ffn").entered();
        let dispatcher = self.dispatcher.as_ref();
        m.pending = Some(match &layer.ffn {
            Ffn::Dense(mlp) => {
                let _t = profile::timer(Phase::DenseMlp).work(|| mlp.work(t));
                let mut out = vec![0.0f32; t * h];
                mlp.forward(&normed, t, &mut out);
                PendingFfn::Done(out)
            }
            Ffn::Moe(block) => {
                let xs: Arc<[f32]> = Arc::from(normed);
                self.lookahead(li, &xs, t);
                PendingFfn::Moe(block.submit(li, &xs, xs.clone(), t, h, dispatcher)?)
            }
            Ffn::DenseAndMoe(p) => {
                let mut mlp_out = vec![0.0f32; t * h];
                {
                    let _t = profile::timer(Phase::DenseMlp).work(|| p.mlp.work(t));
                    p.mlp.forward(&normed, t, &mut mlp_out);
                }
                rms_norm(&mut mlp_out, &p.mlp_out_norm, cfg.rms_norm_eps);
                let mut moe_in = m.x.clone();
                rms_norm(&mut moe_in, &p.moe_in_norm, cfg.rms_norm_eps);
                self.lookahead(li, &m.x, t);
                let moe = p
                    .moe
                    .submit(li, &m.x, Arc::from(moe_in), t, h, dispatcher)?;
                PendingFfn::Parallel { mlp_out, moe }
            }
        });
        Ok(())
    }

    /// Waits for one micro-batch's feed-forward block of layer `li` and adds
    /// it to the residual.
    fn finish_ffn(&self, li: usize, m: &mut Micro<'_>, step: &mut StepRun) -> Result<()> {
        let cfg = &self.config;
        let (h, t) = (cfg.hidden_size, m.rows);
        let layer = &self.layers[li];
        let Some(pending) = m.pending.take() else {
            return Ok(());
        };
        let mut moe_done = |moe: moe::MoePending, out: &mut [f32]| -> Result<()> {
            let waited = std::time::Instant::now();
            let moe::MoeDone {
                routing,
                faults,
                timing,
            } = moe.finish(out)?;
            step.waited += waited.elapsed();
            step.timings.extend(timing);
            step.faults.extend(faults.into_iter().map(|mut f| {
                f.row += m.row0;
                f
            }));
            if let Some(slot) = step.trace.get_mut(li) {
                match slot {
                    None => {
                        *slot = Some(RouterTrace {
                            layer: li,
                            routing: (*routing).clone(),
                        })
                    }
                    Some(tr) => {
                        tr.routing.num_tokens += routing.num_tokens;
                        tr.routing.topk_ids.extend_from_slice(&routing.topk_ids);
                        tr.routing
                            .topk_weights
                            .extend_from_slice(&routing.topk_weights);
                    }
                }
            }
            Ok(())
        };
        let mut ffn_out = match pending {
            PendingFfn::Done(out) => out,
            PendingFfn::Moe(moe) => {
                let mut out = vec![0.0f32; t * h];
                moe_done(moe, &mut out)?;
                out
            }
            PendingFfn::Parallel { mut mlp_out, moe } => {
                let mut moe_out = vec![0.0f32; t * h];
                moe_done(moe, &mut moe_out)?;
                rms_norm(&mut moe_out, p_moe_out_norm(layer)?, cfg.rms_norm_eps);
                for (f, v) in mlp_out.iter_mut().zip(&moe_out) {
                    *f += v;
                }
                mlp_out
            }
        };
        if let Some(n) = &layer.ffn_out_norm {
            rms_norm(&mut ffn_out, n, cfg.rms_norm_eps);
        }
        add_assign(&mut m.x, &ffn_out);
        if let Some(s) = layer.layer_scalar {
            for xv in m.x.iter_mut() {
                *xv *= s;
            }
        }
        Ok(())
    }
}

/// The norm after a parallel feed-forward's experts (Gemma 4).
fn p_moe_out_norm(layer: &DecoderLayer) -> Result<&[f32]> {
    match &layer.ffn {
        Ffn::DenseAndMoe(p) => Ok(&p.moe_out_norm),
        _ => Err(Error::Dispatch(
            "parallel feed-forward without its norms".into(),
        )),
    }
}

/// One micro-batch of a forward step: a contiguous run of its sequences.
struct Micro<'c> {
    /// First row of the step's flattened batch.
    row0: usize,
    rows: usize,
    /// The sequences' spans, rows counted from `row0`.
    spans: Vec<SeqSpan>,
    caches: &'c [&'c SeqCache],
    chunks: &'c [SeqChunk],
    /// The residual stream of these rows.
    x: Vec<f32>,
    /// The feed-forward block of the last layer run, until finished.
    pending: Option<PendingFfn>,
}

/// A feed-forward block started but not added to the residual yet.
enum PendingFfn {
    /// Computed in this thread (a dense MLP).
    Done(Vec<f32>),
    Moe(moe::MoePending),
    /// Gemma 4: the dense MLP's normalized output and the experts in flight.
    Parallel {
        mlp_out: Vec<f32>,
        moe: moe::MoePending,
    },
}

/// What a forward step collects across its micro-batches.
struct StepRun {
    /// Per layer (when tracing), the routing of every micro-batch so far.
    trace: Vec<Option<RouterTrace>>,
    faults: Vec<crate::moe::RowFault>,
    /// Time this thread spent blocked on remote work.
    waited: std::time::Duration,
    timings: Vec<crate::moe::DispatchTiming>,
}

/// Splits sequences (their spans, in batch order) into at most `n`
/// contiguous groups of whole sequences with about the same number of
/// tokens each; every group holds at least one sequence.
pub fn split_micro_batches(spans: &[SeqSpan], n: usize) -> Vec<std::ops::Range<usize>> {
    if spans.is_empty() {
        return Vec::new();
    }
    let n = n.clamp(1, spans.len());
    let total: usize = spans.iter().map(|s| s.len).sum();
    let mut out = Vec::with_capacity(n);
    let mut start = 0;
    let mut acc = 0;
    for (i, sp) in spans.iter().enumerate() {
        acc += sp.len;
        let groups_left = n - out.len();
        let seqs_left = spans.len() - i - 1;
        let target = total * (out.len() + 1) / n;
        // Close the group at its share of the tokens, or when every later
        // sequence is needed to give each remaining group one.
        if groups_left > 1 && (acc >= target || seqs_left < groups_left) && seqs_left > 0 {
            out.push(start..i + 1);
            start = i + 1;
        }
    }
    if start < spans.len() || out.is_empty() {
        out.push(start..spans.len());
    }
    out
}

#[cfg(test)]
mod micro_tests;
