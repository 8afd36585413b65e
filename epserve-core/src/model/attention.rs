//! Grouped-query self-attention with the per-architecture options the
//! supported models use: q/k/v/o biases, q/k RMSNorm (per head or over the
//! whole projection), weightless v RMSNorm and values taken from the key
//! projection (Gemma 4), q/k/v clipping, rotary embeddings, causal and
//! sliding-window masks, learned per-head attention sinks (GPT-OSS), a
//! configurable softmax scale, and an incremental KV cache. Heads may be a contiguous subset of the
//! model's (a tensor-parallel shard): the output projection then yields a
//! partial sum that the caller adds across shards.

use rayon::prelude::*;

use crate::config::{ModelConfig, QkNorm};
use crate::error::{Error, Result};
use crate::kernels::attention::{self, AttnSeq, AttnShape};
use crate::kernels::dispatch::kernels;
use crate::kernels::rms_norm;
use crate::loader::weights::WeightStore;
use crate::model::kv_cache::{KvLayerShape, KvPool, SeqCache};
use crate::model::linear::Linear;
use crate::model::rope::Rope;
use crate::profile::{self, Phase};

/// A span of the flattened batch belonging to one sequence.
#[derive(Debug, Clone, Copy)]
pub struct SeqSpan {
    /// First row of this sequence in the flattened `[tokens, hidden]` batch.
    pub start: usize,
    /// Number of new tokens.
    pub len: usize,
    /// Positions already in the cache before this step.
    pub past: usize,
}

/// One attention layer's weights.
pub struct Attention {
    /// q, k and (unless the values are the raw key projection, `v_from_k`)
    /// v stacked: one pass over the input for all three.
    qkv: Linear,
    o: Linear,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    o_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    /// Weightless per-head RMSNorm of the values (a vector of ones).
    v_norm: Option<Vec<f32>>,
    /// Per-head sink logits joining each softmax (GPT-OSS).
    sinks: Option<Vec<f32>>,
    qk_norm: QkNorm,
    /// A shard of a model whose q/k norm runs over the whole projection: `q`
    /// and `k` (and their biases and norms) are whole, and after the norm
    /// only these ranges (floats per token) of q and k are kept.
    whole_qk: Option<(std::ops::Range<usize>, std::ops::Range<usize>)>,
    clip_qkv: Option<f32>,
    eps: f32,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    sliding_window: Option<usize>,
    scale: f32,
}

/// Which heads of a layer a tensor-parallel shard holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShard {
    /// This shard's index, `0..of`.
    pub index: usize,
    /// Number of shards.
    pub of: usize,
}

impl HeadShard {
    /// Query heads and KV heads of shard `index` of `of`. Query heads split
    /// evenly; each shard holds either whole KV-head groups (KV heads a
    /// multiple of the shards) or a part of one group whose KV head it then
    /// replicates (shards a multiple of the KV heads, as vLLM does); anything
    /// else is an error.
    pub fn ranges(
        self,
        num_heads: usize,
        num_kv_heads: usize,
    ) -> Result<(std::ops::Range<usize>, std::ops::Range<usize>)> {
        let HeadShard { index, of } = self;
        if of == 0 || index >= of {
            return Err(Error::InvalidInput(format!(
                "attention shard {index} of {of} does not exist"
            )));
        }
        let even = num_kv_heads > 0
            && num_heads.is_multiple_of(num_kv_heads)
            && num_heads.is_multiple_of(of)
            && (num_kv_heads.is_multiple_of(of) || of % num_kv_heads == 0);
        if !even {
            return Err(Error::InvalidInput(format!(
                "{num_kv_heads} KV heads ({num_heads} query heads) cannot be split evenly over {of} attention shards (the shard count must divide the KV heads or be a multiple of them, and divide the query heads)"
            )));
        }
        let (per, group) = (num_heads / of, num_heads / num_kv_heads);
        let q = index * per..(index + 1) * per;
        let kv = q.start / group..(q.end - 1) / group + 1;
        Ok((q, kv))
    }
}

impl Attention {
    /// Loads layer `layer`'s attention from `prefix` (e.g. `model.layers.3.self_attn`).
    pub fn load(cfg: &ModelConfig, ws: &WeightStore, prefix: &str, layer: usize) -> Result<Self> {
        Self::load_heads(cfg, ws, prefix, layer, None)
    }

    /// Loads only `shard`'s heads of layer `layer`: the q/k/v rows of its
    /// query and KV heads, the `o_proj` columns of its query heads, its slices of
    /// biases and sinks (per-head q/k norm weights are shared). The output
    /// projection then gives this shard's partial sum, without the `o_proj`
    /// bias (the caller adds it once after summing the shards). A q/k norm over
    /// the whole projection (OLMoE) needs every head's values for its
    /// statistic: such a shard keeps the whole `q_proj` / `k_proj`, projects
    /// every head, normalizes exactly as the unsplit layer does and keeps its
    /// heads' slice (one round trip per layer; the q/k projections are not
    /// split, v and o are).
    pub fn load_shard(
        cfg: &ModelConfig,
        ws: &WeightStore,
        prefix: &str,
        layer: usize,
        shard: HeadShard,
    ) -> Result<Self> {
        Self::load_heads(cfg, ws, prefix, layer, Some(shard))
    }

    fn load_heads(
        cfg: &ModelConfig,
        ws: &WeightStore,
        prefix: &str,
        layer: usize,
        shard: Option<HeadShard>,
    ) -> Result<Self> {
        let spec = &cfg.layers[layer];
        let (h, hd, nh, nkv) = (
            cfg.hidden_size,
            spec.head_dim,
            cfg.num_attention_heads,
            spec.kv_heads,
        );
        let (qr, kvr) = match shard {
            None => (0..nh, 0..nkv),
            Some(s) => s.ranges(nh, nkv)?,
        };
        let (snh, snkv) = (qr.len(), kvr.len());
        let whole_qk = (shard.is_some() && cfg.qk_norm == QkNorm::Full)
            .then(|| (qr.start * hd..qr.end * hd, kvr.start * hd..kvr.end * hd));
        // Rows of q and k projected (all of them when the norm needs them).
        let (pqr, pkvr) = if whole_qk.is_some() {
            (0..nh, 0..nkv)
        } else {
            (qr.clone(), kvr.clone())
        };
        let bias = |name: &str,
                    n: usize,
                    range: &std::ops::Range<usize>,
                    on: bool|
         -> Result<Option<Vec<f32>>> {
            if on {
                let b = ws.get_vec(&format!("{prefix}.{name}.bias"), n)?;
                Ok(Some(b[range.start * hd..range.end * hd].to_vec()))
            } else {
                Ok(None)
            }
        };
        let (q_norm, k_norm) = match cfg.qk_norm {
            QkNorm::None => (None, None),
            QkNorm::PerHead => (
                Some(ws.get_vec(&format!("{prefix}.q_norm.weight"), hd)?),
                Some(ws.get_vec(&format!("{prefix}.k_norm.weight"), hd)?),
            ),
            QkNorm::Full => (
                Some(ws.get_vec(&format!("{prefix}.q_norm.weight"), nh * hd)?),
                Some(ws.get_vec(&format!("{prefix}.k_norm.weight"), nkv * hd)?),
            ),
        };
        let mut qkv = vec![
            ws.get(&format!("{prefix}.q_proj.weight"), &[nh * hd, h])?
                .rows(pqr.start * hd, pqr.len() * hd),
            ws.get(&format!("{prefix}.k_proj.weight"), &[nkv * hd, h])?
                .rows(pkvr.start * hd, pkvr.len() * hd),
        ];
        if !spec.v_from_k {
            qkv.push(
                ws.get(&format!("{prefix}.v_proj.weight"), &[nkv * hd, h])?
                    .rows(kvr.start * hd, snkv * hd),
            );
        }
        let o = ws.get(&format!("{prefix}.o_proj.weight"), &[h, nh * hd])?;
        let o = if shard.is_some() {
            o.columns(qr.start * hd, snh * hd)
        } else {
            o
        };
        Ok(Attention {
            qkv: Linear::fused(qkv)?,
            o: Linear::new(o),
            q_bias: bias("q_proj", nh * hd, &pqr, cfg.qkv_bias)?,
            k_bias: bias("k_proj", nkv * hd, &pkvr, cfg.qkv_bias)?,
            v_bias: bias("v_proj", nkv * hd, &kvr, cfg.qkv_bias && !spec.v_from_k)?,
            o_bias: if cfg.o_bias && shard.is_none() {
                Some(ws.get_vec(&format!("{prefix}.o_proj.bias"), h)?)
            } else {
                None
            },
            q_norm,
            k_norm,
            v_norm: cfg.v_norm.then(|| vec![1.0; hd]),
            sinks: if cfg.attn_sinks {
                Some(ws.get_vec(&format!("{prefix}.sinks"), nh)?[qr.clone()].to_vec())
            } else {
                None
            },
            qk_norm: cfg.qk_norm,
            whole_qk,
            clip_qkv: cfg.clip_qkv,
            eps: cfg.rms_norm_eps,
            heads: snh,
            kv_heads: snkv,
            head_dim: hd,
            sliding_window: spec.sliding_window,
            scale: cfg.attention_scale.unwrap_or((hd as f32).powf(-0.5)),
        })
    }

    /// The `o_proj` bias of layer `layer` (added once, after summing the
    /// shards' partial outputs), if the architecture has one.
    pub fn load_o_bias(
        cfg: &ModelConfig,
        ws: &WeightStore,
        prefix: &str,
    ) -> Result<Option<Vec<f32>>> {
        if cfg.o_bias {
            ws.get_vec(&format!("{prefix}.o_proj.bias"), cfg.hidden_size)
                .map(Some)
        } else {
            Ok(None)
        }
    }

    /// The dense projections (q/k/v stack, o), for requantizing.
    pub fn linears_mut(&mut self) -> [&mut Linear; 2] {
        [&mut self.qkv, &mut self.o]
    }

    /// Floats per cached position (keys or values).
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// What this layer caches per position (its KV heads side by side).
    pub fn kv_shape(&self) -> KvLayerShape {
        KvLayerShape::heads(self.kv_heads, self.head_dim)
    }

    /// Runs attention for a flattened batch `x` (`[tokens, hidden]`), appending
    /// the new keys/values to each sequence's cache at `layer`.
    pub fn forward(
        &self,
        x: &[f32],
        spans: &[SeqSpan],
        caches: &[&SeqCache],
        pool: &mut KvPool,
        layer: usize,
        rope: &Rope,
    ) -> Vec<f32> {
        let hidden = self.o.shape()[0];
        let t = x.len() / self.qkv.shape()[1];
        let (nh, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let parts = self.qkv.parts();
        let mut q = vec![0.0f32; t * parts[0]];
        let mut k = vec![0.0f32; t * parts[1]];
        let mut v = vec![0.0f32; t * nkv * hd];
        let (qb, kb) = (self.q_bias.as_deref(), self.k_bias.as_deref());
        let proj = profile::timer(Phase::AttnProj).work(|| (self.qkv.bytes(), self.qkv.macs(t)));
        if parts.len() == 3 {
            let vb = self.v_bias.as_deref();
            self.qkv
                .forward_parts(x, t, &[qb, kb, vb], &mut [&mut q, &mut k, &mut v]);
        } else {
            self.qkv
                .forward_parts(x, t, &[qb, kb], &mut [&mut q, &mut k]);
            match &self.whole_qk {
                Some((_, kk)) => v = keep_columns(&k, t, kk),
                None => v.copy_from_slice(&k),
            }
        }
        drop(proj);
        if let Some(vn) = &self.v_norm {
            rms_norm(&mut v, vn, self.eps);
        }
        match self.qk_norm {
            QkNorm::None => {}
            QkNorm::PerHead | QkNorm::Full => {
                if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
                    rms_norm(&mut q, qn, self.eps);
                    rms_norm(&mut k, kn, self.eps);
                }
            }
        }
        if let Some((qk, kk)) = &self.whole_qk {
            q = keep_columns(&q, t, qk);
            k = keep_columns(&k, t, kk);
        }
        if let Some(c) = self.clip_qkv {
            for val in q.iter_mut().chain(k.iter_mut()).chain(v.iter_mut()) {
                *val = val.clamp(-c, c);
            }
        }
        // Rotary embeddings at each token's absolute position (rows in
        // parallel at prefill: a row's bits do not depend on the others).
        let mut pos = vec![usize::MAX; t];
        for sp in spans {
            for i in 0..sp.len {
                pos[sp.start + i] = sp.past + i;
            }
        }
        let rotate = |((qr, kr), &p): ((&mut [f32], &mut [f32]), &usize)| {
            if p == usize::MAX {
                return;
            }
            rope.at(p, |cos, sin| {
                rope.apply(qr, hd, cos, sin);
                rope.apply(kr, hd, cos, sin);
            });
        };
        let (qw, kw) = (nh * hd, nkv * hd);
        if t >= PAR_ROPE_ROWS {
            q.par_chunks_mut(qw)
                .zip(k.par_chunks_mut(kw))
                .zip(pos.par_iter())
                .for_each(rotate);
        } else {
            q.chunks_mut(qw)
                .zip(k.chunks_mut(kw))
                .zip(pos.iter())
                .for_each(rotate);
        }
        // Write the new keys/values into each sequence's blocks (reserved by the caller).
        let w = nkv * hd;
        for (sp, cache) in spans.iter().zip(caches) {
            for i in 0..sp.len {
                let r = pool.row(cache, sp.past + i);
                let src = sp.start + i;
                let lp = pool.layer_mut(layer);
                lp.write_k(r, &k[src * w..(src + 1) * w]);
                lp.write_v(r, &v[src * w..(src + 1) * w]);
            }
        }
        // Flash attention over the paged cache, all heads of a KV group together.
        let pool: &KvPool = pool;
        let kv = pool.layer(layer);
        let seqs: Vec<AttnSeq<'_>> = spans
            .iter()
            .zip(caches)
            .map(|(sp, c)| AttnSeq {
                blocks: c.blocks(),
                start: sp.start,
                len: sp.len,
                past: sp.past,
            })
            .collect();
        let (kv_k, kv_v) = kv.views(hd);
        let mut attn = vec![0.0f32; t * nh * hd];
        attention::attention(
            kernels(),
            &AttnShape {
                heads: nh,
                kv_heads: nkv,
                scale: self.scale,
                window: self.sliding_window,
                sinks: self.sinks.as_deref(),
                block_size: pool.block_size(),
                // bf16 activations (`--dense-dtype bf16`) round the queries
                // too, as llama.cpp rounds them to its K cache's type.
                bf16_queries: self.qkv.bf16_activations(),
            },
            &seqs,
            &q,
            kv_k,
            kv_v,
            &mut attn,
        );
        let mut out = vec![0.0f32; t * hidden];
        let _o = profile::timer(Phase::AttnOut).work(|| (self.o.bytes(), self.o.macs(t)));
        self.o.forward(&attn, t, self.o_bias.as_deref(), &mut out);
        out
    }
}

/// Rows from which RoPE runs in parallel (a decode step's few rows are not
/// worth a fork).
pub(super) const PAR_ROPE_ROWS: usize = 16;

/// Columns `keep` of a row-major `[rows, _]` matrix.
fn keep_columns(m: &[f32], rows: usize, keep: &std::ops::Range<usize>) -> Vec<f32> {
    let w = m.len() / rows.max(1);
    let mut out = Vec::with_capacity(rows * keep.len());
    for r in 0..rows {
        out.extend_from_slice(&m[r * w + keep.start..r * w + keep.end]);
    }
    out
}
