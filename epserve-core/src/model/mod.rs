//! The decoder-only MoE transformer: embeddings, decoder layers (attention +
//! dense MLP or MoE block), final norm and LM head. One forward pass takes a
//! flattened batch of several sequences (prefill chunks and decode steps
//! mixed), as continuous batching needs.

pub mod attention;
pub mod kv_cache;
pub mod moe;
pub mod names;
pub mod rope;

use std::path::Path;
use std::sync::Arc;

use crate::config::{FfnKind, ModelConfig};
use crate::error::{Error, Result};
pub use crate::experts::LoadOptions;
use crate::kernels::{linear, rms_norm};
use crate::loader::weights::WeightStore;
use crate::tensor::Weight;

use attention::{Attention, SeqSpan};
use kv_cache::{KvPool, SeqCache};
use moe::{
    Dispatcher, GatedMlp, LocalDispatcher, MoeBlock, Router, RouterKind, Routing, SharedExpert,
};
use rope::Rope;

enum Ffn {
    Dense(GatedMlp),
    Moe(MoeBlock),
}

struct DecoderLayer {
    input_norm: Vec<f32>,
    attn: Attention,
    post_norm: Vec<f32>,
    ffn: Ffn,
}

/// One sequence's share of a forward pass: its new tokens and its cache.
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut SeqCache,
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
    /// `[rows, vocab]`: one row per sequence (`Last`) or per token (`All`).
    pub logits: Vec<f32>,
    pub rows: usize,
    /// Filled when tracing was requested.
    pub router: Vec<RouterTrace>,
}

/// A loaded model.
pub struct Model {
    pub config: ModelConfig,
    embed: Weight,
    layers: Vec<DecoderLayer>,
    norm: Vec<f32>,
    lm_head: Weight,
    rope: Rope,
    dispatcher: Arc<dyn Dispatcher>,
}

impl Model {
    /// Loads a model folder with every expert in this process, with the
    /// default [`LoadOptions`] (packed experts, bf16 where exact).
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(dir, &LoadOptions::default())
    }

    /// Loads a model folder with every expert in this process, executed as
    /// `opts` asks (packed or portable executor, expert precision, threads).
    pub fn load_with(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        let cfg = ModelConfig::from_dir(dir)?;
        let ws = WeightStore::open(dir)?;
        let experts = crate::experts::load_executor(&cfg, &ws, opts)?;
        let dispatcher = Arc::new(LocalDispatcher::new(experts));
        Self::from_store(cfg, &ws, dispatcher)
    }

    /// Loads the non-expert weights and uses `dispatcher` for the experts.
    pub fn from_store(
        cfg: ModelConfig,
        ws: &WeightStore,
        dispatcher: Arc<dyn Dispatcher>,
    ) -> Result<Self> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let embed = ws.get("model.embed_tokens.weight", &[v, h])?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            ws.get("lm_head.weight", &[v, h])?
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let lp = names::layer_prefix(i);
            let attn = Attention::load(&cfg, ws, &format!("{lp}.self_attn"), i)?;
            let ffn = match cfg.layers[i].ffn {
                FfnKind::Dense => Ffn::Dense(GatedMlp::load(
                    ws,
                    &format!("{lp}.mlp"),
                    h,
                    cfg.intermediate_size,
                    cfg.activation,
                )?),
                FfnKind::Moe => {
                    let router = Router::new(
                        names::router_weight(&cfg, ws, i)?,
                        RouterKind::SoftmaxTopK {
                            normalize: cfg.norm_topk_prob,
                        },
                        cfg.num_experts_per_tok,
                    );
                    let shared = match cfg.shared_expert_intermediate_size {
                        Some(si) => Some(SharedExpert {
                            mlp: GatedMlp::load(
                                ws,
                                &format!("{lp}.mlp.shared_expert"),
                                h,
                                si,
                                cfg.activation,
                            )?,
                            gate: ws
                                .get_opt(&format!("{lp}.mlp.shared_expert_gate.weight"), &[1, h])?,
                        }),
                        None => None,
                    };
                    Ffn::Moe(MoeBlock { router, shared })
                }
            };
            layers.push(DecoderLayer {
                input_norm: ws.get_vec(&format!("{lp}.input_layernorm.weight"), h)?,
                attn,
                post_norm: ws.get_vec(&format!("{lp}.post_attention_layernorm.weight"), h)?,
                ffn,
            });
        }
        let norm = ws.get_vec("model.norm.weight", h)?;
        let rope = Rope::new(&cfg.rope);
        Ok(Model {
            config: cfg,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            dispatcher,
        })
    }

    /// An empty KV cache for one sequence (a block table into a [`KvPool`]).
    pub fn new_cache(&self) -> SeqCache {
        SeqCache::new()
    }

    /// Per layer, floats per cached position for keys and for values.
    pub fn kv_layer_widths(&self) -> Vec<(usize, usize)> {
        self.layers
            .iter()
            .map(|l| (l.attn.kv_width(), l.attn.kv_width()))
            .collect()
    }

    /// A KV pool of `num_blocks` blocks of `block_size` positions.
    pub fn new_pool(&self, block_size: usize, num_blocks: usize) -> KvPool {
        KvPool::new(&self.kv_layer_widths(), block_size, num_blocks)
    }

    /// A pool with room for `tokens` positions in blocks of 16 (tests, one-off runs).
    pub fn pool_for_tokens(&self, tokens: usize) -> KvPool {
        self.new_pool(16, tokens.div_ceil(16))
    }

    /// Bytes of KV cache per block of `block_size` positions.
    pub fn kv_block_bytes(&self, block_size: usize) -> usize {
        KvPool::block_bytes(&self.kv_layer_widths(), block_size)
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
        let mut x = vec![0.0f32; t * h];
        for (row, &tok) in tokens.iter().enumerate() {
            self.embed
                .row_to_f32(tok as usize, &mut x[row * h..(row + 1) * h]);
        }
        let caches: Vec<&SeqCache> = seqs.iter().map(|s| &*s.cache).collect();
        let mut trace = Vec::new();
        let mut normed = vec![0.0f32; t * h];
        let mut ffn_out = vec![0.0f32; t * h];
        for (li, layer) in self.layers.iter().enumerate() {
            normed.copy_from_slice(&x);
            rms_norm(&mut normed, &layer.input_norm, cfg.rms_norm_eps);
            let a = layer
                .attn
                .forward(&normed, &spans, &caches, pool, li, &self.rope);
            for (xv, av) in x.iter_mut().zip(&a) {
                *xv += av;
            }
            normed.copy_from_slice(&x);
            rms_norm(&mut normed, &layer.post_norm, cfg.rms_norm_eps);
            match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(&normed, t, &mut ffn_out),
                Ffn::Moe(block) => {
                    let routing =
                        block.forward(li, &normed, t, h, self.dispatcher.as_ref(), &mut ffn_out)?;
                    if trace_router {
                        trace.push(RouterTrace { layer: li, routing });
                    }
                }
            }
            for (xv, fv) in x.iter_mut().zip(&ffn_out) {
                *xv += fv;
            }
        }
        drop(caches);
        for (s, sp) in seqs.iter_mut().zip(&spans) {
            s.cache.advance(sp.len);
        }
        // Final norm and LM head on the rows that need logits.
        let rows: Vec<usize> = match mode {
            LogitsMode::All => (0..t).collect(),
            LogitsMode::Last => spans.iter().map(|s| s.start + s.len - 1).collect(),
        };
        let mut sel = Vec::with_capacity(rows.len() * h);
        for &r in &rows {
            sel.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        rms_norm(&mut sel, &self.norm, cfg.rms_norm_eps);
        let mut logits = vec![0.0f32; rows.len() * cfg.vocab_size];
        linear(&sel, rows.len(), &self.lm_head, None, &mut logits);
        Ok(ForwardOutput {
            logits,
            rows: rows.len(),
            router: trace,
        })
    }
}
