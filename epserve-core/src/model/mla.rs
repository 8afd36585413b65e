//! Multi-head latent attention (DeepSeek-V2/V3). Queries come straight from
//! `q_proj` or through a low-rank `q_a_proj` → RMSNorm → `q_b_proj`; keys and
//! values share one compressed latent per position (`kv_a_proj_with_mqa` →
//! RMSNorm) plus a decoupled RoPE key shared by all heads.
//!
//! The KV cache holds only that latent and the rotated RoPE key
//! (`kv_lora_rank + qk_rope_head_dim` floats per position, nothing in the
//! value slot), never per-head keys and values. Attention runs in the
//! "absorbed" form: each head's no-RoPE query is pulled back into latent space
//! through its slice of `kv_b_proj` (`q·W_ukᵀ`), scored against the cached
//! latents, and the weighted latent is pushed out through the head's value
//! slice (`W_uv`). This is the same sum as expanding every cached position
//! into full keys and values, in a different order.

use rayon::prelude::*;

use crate::config::{MlaConfig, ModelConfig};
use crate::error::{Error, Result};
use crate::kernels::attention::{self, AttnSeq, AttnShape, KvView};
use crate::kernels::dispatch::kernels;
use crate::kernels::{linear, rms_norm};
use crate::loader::weights::WeightStore;
use crate::model::attention::{HeadShard, SeqSpan};
use crate::model::kv_cache::{KvPool, SeqCache};
use crate::model::linear::Linear;
use crate::model::rope::Rope;
use crate::tensor::Weight;

/// transformers builds `q_a_layernorm` / `kv_a_layernorm` with the class
/// default eps, not `rms_norm_eps`.
const LORA_NORM_EPS: f32 = 1e-6;

enum QProj {
    Direct(Linear),
    Lora {
        a: Linear,
        a_bias: Option<Vec<f32>>,
        norm: Vec<f32>,
        b: Linear,
    },
}

/// One MLA layer's weights.
pub struct Mla {
    q: QProj,
    kv_a: Linear,
    kv_a_bias: Option<Vec<f32>>,
    kv_norm: Vec<f32>,
    /// `[heads · (nope + v), rank]`: per head, `nope` key rows then `v` value rows.
    kv_b: Weight,
    o: Linear,
    o_bias: Option<Vec<f32>>,
    heads: usize,
    m: MlaConfig,
}

impl Mla {
    /// Loads layer `layer`'s attention from `prefix` (e.g. `model.layers.3.self_attn`).
    pub fn load(cfg: &ModelConfig, ws: &WeightStore, prefix: &str, _layer: usize) -> Result<Self> {
        Self::load_heads(cfg, ws, prefix, None)
    }

    /// Loads only `shard`'s heads (a tensor-parallel shard): the shared
    /// low-rank path (`q_a_proj` + norm, `kv_a_proj_with_mqa` + norm, the
    /// RoPE key) whole, since every head needs it and it is small; the
    /// per-head rows of `q_proj` / `q_b_proj` and `kv_b_proj` and the
    /// `o_proj` columns of its heads. Every shard caches the whole latent of
    /// each position (duplicated; `kv_lora_rank + qk_rope_head_dim` floats).
    /// The output is the shard's partial sum, without the `o_proj` bias.
    pub fn load_shard(
        cfg: &ModelConfig,
        ws: &WeightStore,
        prefix: &str,
        shard: HeadShard,
    ) -> Result<Self> {
        Self::load_heads(cfg, ws, prefix, Some(shard))
    }

    fn load_heads(
        cfg: &ModelConfig,
        ws: &WeightStore,
        prefix: &str,
        shard: Option<HeadShard>,
    ) -> Result<Self> {
        let m = cfg.mla.clone().ok_or_else(|| {
            Error::config(
                ws.dir().join("config.json"),
                "MLA layer without MLA settings",
            )
        })?;
        let (h, nh) = (cfg.hidden_size, cfg.num_attention_heads);
        // Every head shares the latent: heads split like GQA with one KV
        // head per query head.
        let heads = match shard {
            None => 0..nh,
            Some(s) => s.ranges(nh, nh)?.0,
        };
        let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
        let kvb = m.qk_nope_head_dim + m.v_head_dim;
        let rank = m.kv_lora_rank;
        // `attention_bias` adds biases to q_a, kv_a and o only (transformers).
        let bias = |name: &str, n: usize| -> Result<Option<Vec<f32>>> {
            let full = format!("{prefix}.{name}.bias");
            if ws.contains(&full) {
                ws.get_vec(&full, n).map(Some)
            } else {
                Ok(None)
            }
        };
        let q = match m.q_lora_rank {
            None => QProj::Direct(Linear::new(
                ws.get(&format!("{prefix}.q_proj.weight"), &[nh * qk, h])?
                    .rows(heads.start * qk, heads.len() * qk),
            )),
            Some(r) => QProj::Lora {
                a: Linear::new(ws.get(&format!("{prefix}.q_a_proj.weight"), &[r, h])?),
                a_bias: bias("q_a_proj", r)?,
                norm: ws.get_vec(&format!("{prefix}.q_a_layernorm.weight"), r)?,
                b: Linear::new(
                    ws.get(&format!("{prefix}.q_b_proj.weight"), &[nh * qk, r])?
                        .rows(heads.start * qk, heads.len() * qk),
                ),
            },
        };
        let o = ws.get(&format!("{prefix}.o_proj.weight"), &[h, nh * m.v_head_dim])?;
        let o = match shard {
            None => o,
            Some(_) => o.columns(heads.start * m.v_head_dim, heads.len() * m.v_head_dim),
        };
        Ok(Mla {
            q,
            kv_a: Linear::new(ws.get(
                &format!("{prefix}.kv_a_proj_with_mqa.weight"),
                &[rank + m.qk_rope_head_dim, h],
            )?),
            kv_a_bias: bias("kv_a_proj_with_mqa", rank + m.qk_rope_head_dim)?,
            kv_norm: ws.get_vec(&format!("{prefix}.kv_a_layernorm.weight"), rank)?,
            kv_b: ws
                .get(&format!("{prefix}.kv_b_proj.weight"), &[nh * kvb, rank])?
                .rows(heads.start * kvb, heads.len() * kvb),
            o: Linear::new(o),
            o_bias: if shard.is_none() {
                bias("o_proj", h)?
            } else {
                None
            },
            heads: heads.len(),
            m,
        })
    }

    /// The `o_proj` bias of an MLA layer (added once after summing shards).
    pub fn load_o_bias(ws: &WeightStore, prefix: &str, hidden: usize) -> Result<Option<Vec<f32>>> {
        let full = format!("{prefix}.o_proj.bias");
        if ws.contains(&full) {
            ws.get_vec(&full, hidden).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Floats per cached position: (latent + RoPE key, nothing for values).
    pub fn kv_widths(&self) -> (usize, usize) {
        (self.m.kv_lora_rank + self.m.qk_rope_head_dim, 0)
    }

    /// Runs attention for a flattened batch `x` (`[tokens, hidden]`), appending
    /// each new position's latent and RoPE key to its sequence's cache.
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
        let t = x.len() / hidden;
        let nh = self.heads;
        let (nope, rd, vd, rank) = (
            self.m.qk_nope_head_dim,
            self.m.qk_rope_head_dim,
            self.m.v_head_dim,
            self.m.kv_lora_rank,
        );
        let qk = nope + rd;
        // Queries.
        let mut q = vec![0.0f32; t * nh * qk];
        match &self.q {
            QProj::Direct(w) => w.forward(x, t, None, &mut q),
            QProj::Lora { a, a_bias, norm, b } => {
                let r = a.shape()[0];
                let mut qa = vec![0.0f32; t * r];
                a.forward(x, t, a_bias.as_deref(), &mut qa);
                rms_norm(&mut qa, norm, LORA_NORM_EPS);
                b.forward(&qa, t, None, &mut q);
            }
        }
        // Latent and RoPE key per position.
        let w = rank + rd;
        let mut ckv = vec![0.0f32; t * w];
        self.kv_a.forward(x, t, self.kv_a_bias.as_deref(), &mut ckv);
        let half = rope.half();
        let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
        for sp in spans {
            for i in 0..sp.len {
                let row = sp.start + i;
                let c = &mut ckv[row * w..(row + 1) * w];
                rms_norm(&mut c[..rank], &self.kv_norm, LORA_NORM_EPS);
                rope.cos_sin(sp.past + i, &mut cos, &mut sin);
                rope.apply(&mut c[rank..], rd, &cos, &sin);
                for hq in q[row * nh * qk..(row + 1) * nh * qk].chunks_mut(qk) {
                    rope.apply(&mut hq[nope..], rd, &cos, &sin);
                }
            }
        }
        for (sp, cache) in spans.iter().zip(caches) {
            for i in 0..sp.len {
                let r = pool.row(cache, sp.past + i);
                let src = sp.start + i;
                pool.layer_mut(layer)
                    .k
                    .write(r * w, &ckv[src * w..(src + 1) * w]);
            }
        }
        // Absorb each head's no-RoPE query into latent space: q_lat = q_nope · W_uk.
        let mut q_lat = vec![0.0f32; nh * t * rank]; // [head][token][rank]
        q_lat
            .par_chunks_mut(t * rank)
            .enumerate()
            .for_each(|(h, dst)| {
                let mut wrow = vec![0.0f32; rank];
                for d in 0..nope {
                    self.kv_b.row_to_f32(h * (nope + vd) + d, &mut wrow);
                    for tok in 0..t {
                        let a = q[tok * nh * qk + h * qk + d];
                        for (o, wv) in dst[tok * rank..(tok + 1) * rank].iter_mut().zip(&wrow) {
                            *o += a * wv;
                        }
                    }
                }
            });
        // Scores against the cached latents and RoPE keys; weighted latents:
        // the flash kernel as MQA with one shared latent row, key = latent +
        // RoPE key (`rank + rd`), value = the latent (its first `rank`).
        let mut qf = vec![0.0f32; t * nh * w]; // [token][head][rank + rd]
        for tok in 0..t {
            for h in 0..nh {
                let d = &mut qf[(tok * nh + h) * w..(tok * nh + h + 1) * w];
                d[..rank].copy_from_slice(&q_lat[(h * t + tok) * rank..(h * t + tok + 1) * rank]);
                d[rank..].copy_from_slice(
                    &q[tok * nh * qk + h * qk + nope..tok * nh * qk + (h + 1) * qk],
                );
            }
        }
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
        let view = |width| KvView {
            rows: kv.k.rows(),
            stride: w,
            head_stride: 0,
            width,
        };
        let mut o_tok = vec![0.0f32; t * nh * rank]; // [token][head][rank]
        attention::attention(
            kernels(),
            &AttnShape {
                heads: nh,
                kv_heads: 1,
                scale: self.m.softmax_scale,
                window: None,
                sinks: None,
                block_size: pool.block_size(),
            },
            &seqs,
            &qf,
            view(w),
            view(rank),
            &mut o_tok,
        );
        let mut o_lat = vec![0.0f32; nh * t * rank]; // [head][token][rank]
        for tok in 0..t {
            for h in 0..nh {
                o_lat[(h * t + tok) * rank..(h * t + tok + 1) * rank]
                    .copy_from_slice(&o_tok[(tok * nh + h) * rank..(tok * nh + h + 1) * rank]);
            }
        }
        // Values: each head's weighted latent through its W_uv rows.
        let mut attn = vec![0.0f32; t * nh * vd];
        let per_head: Vec<Vec<f32>> = (0..nh)
            .into_par_iter()
            .map(|h| {
                let wv = self.kv_b.rows(h * (nope + vd) + nope, vd);
                let mut out = vec![0.0f32; t * vd];
                linear(
                    &o_lat[h * t * rank..(h + 1) * t * rank],
                    t,
                    &wv,
                    None,
                    &mut out,
                );
                out
            })
            .collect();
        for (h, out) in per_head.iter().enumerate() {
            for tok in 0..t {
                attn[tok * nh * vd + h * vd..tok * nh * vd + (h + 1) * vd]
                    .copy_from_slice(&out[tok * vd..(tok + 1) * vd]);
            }
        }
        let mut out = vec![0.0f32; t * hidden];
        self.o.forward(&attn, t, self.o_bias.as_deref(), &mut out);
        out
    }
}
