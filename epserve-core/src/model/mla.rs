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
use crate::kernels::rms_norm;
use crate::loader::weights::WeightStore;
use crate::model::attention::{HeadShard, PAR_ROPE_ROWS, SeqSpan};
use crate::model::kv_cache::{KvPool, SeqCache};
use crate::model::linear::Linear;
use crate::model::rope::Rope;
use crate::profile::{self, Phase};
use crate::tensor::Weight;

/// transformers builds `q_a_layernorm` / `kv_a_layernorm` with the class
/// default eps, not `rms_norm_eps`.
const LORA_NORM_EPS: f32 = 1e-6;

/// How queries are made from the input.
enum QProj {
    /// `q_proj` (the first part of `Mla::input`).
    Direct,
    /// `q_a_proj` (the first part of `Mla::input`) → RMSNorm → `q_b_proj`.
    Lora {
        a_bias: Option<Vec<f32>>,
        norm: Vec<f32>,
        b: Linear,
    },
}

/// One MLA layer's weights.
pub struct Mla {
    /// The two projections of the input stacked: `q_proj` or `q_a_proj`,
    /// then `kv_a_proj_with_mqa`.
    input: Linear,
    q: QProj,
    kv_a_bias: Option<Vec<f32>>,
    kv_norm: Vec<f32>,
    /// Per head, `W_ukᵀ` (`[rank, nope]`): pulls a no-RoPE query into latent
    /// space. Prepared (transposed and packed) once at load.
    w_uk_t: Vec<Linear>,
    /// Per head, `W_uv` (`[v, rank]`): pushes a weighted latent out to values.
    w_uv: Vec<Linear>,
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
        let (q_in, q) = match m.q_lora_rank {
            None => (
                ws.get(&format!("{prefix}.q_proj.weight"), &[nh * qk, h])?
                    .rows(heads.start * qk, heads.len() * qk),
                QProj::Direct,
            ),
            Some(r) => (
                ws.get(&format!("{prefix}.q_a_proj.weight"), &[r, h])?,
                QProj::Lora {
                    a_bias: bias("q_a_proj", r)?,
                    norm: ws.get_vec(&format!("{prefix}.q_a_layernorm.weight"), r)?,
                    b: Linear::new(
                        ws.get(&format!("{prefix}.q_b_proj.weight"), &[nh * qk, r])?
                            .rows(heads.start * qk, heads.len() * qk),
                    ),
                },
            ),
        };
        let kv_a = ws.get(
            &format!("{prefix}.kv_a_proj_with_mqa.weight"),
            &[rank + m.qk_rope_head_dim, h],
        )?;
        let kv_b = ws
            .get(&format!("{prefix}.kv_b_proj.weight"), &[nh * kvb, rank])?
            .rows(heads.start * kvb, heads.len() * kvb);
        let (nope, vd) = (m.qk_nope_head_dim, m.v_head_dim);
        let mut w_uk_t = Vec::with_capacity(heads.len());
        let mut w_uv = Vec::with_capacity(heads.len());
        for hh in 0..heads.len() {
            let uk = kv_b.rows(hh * kvb, nope).to_f32_vec();
            let mut t = vec![0.0f32; rank * nope];
            for d in 0..nope {
                for r in 0..rank {
                    t[r * nope + d] = uk[d * rank + r];
                }
            }
            w_uk_t.push(Linear::new(Weight::from_f32(vec![rank, nope], &t)));
            w_uv.push(Linear::new(kv_b.rows(hh * kvb + nope, vd)));
        }
        let o = ws.get(&format!("{prefix}.o_proj.weight"), &[h, nh * m.v_head_dim])?;
        let o = match shard {
            None => o,
            Some(_) => o.columns(heads.start * m.v_head_dim, heads.len() * m.v_head_dim),
        };
        Ok(Mla {
            input: Linear::fused(vec![q_in, kv_a])?,
            q,
            kv_a_bias: bias("kv_a_proj_with_mqa", rank + m.qk_rope_head_dim)?,
            kv_norm: ws.get_vec(&format!("{prefix}.kv_a_layernorm.weight"), rank)?,
            w_uk_t,
            w_uv,
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

    /// The dense projections (input stack, `q_b_proj`, o), for
    /// requantizing; the absorbed per-head `kv_b` slices stay as loaded.
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v = vec![&mut self.input, &mut self.o];
        if let QProj::Lora { b, .. } = &mut self.q {
            v.push(b);
        }
        v
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
        // Queries (or their low-rank input), and the latent and RoPE key per
        // position, in one pass over the input.
        let w = rank + rd;
        let mut ckv = vec![0.0f32; t * w];
        let mut q_in = vec![0.0f32; t * self.input.parts()[0]];
        let kv_bias = self.kv_a_bias.as_deref();
        let proj = profile::timer(Phase::AttnProj).work(|| {
            let b = match &self.q {
                QProj::Direct => (0, 0),
                QProj::Lora { b, .. } => (b.bytes(), b.macs(t)),
            };
            (self.input.bytes() + b.0, self.input.macs(t) + b.1)
        });
        let mut q = match &self.q {
            QProj::Direct => {
                self.input
                    .forward_parts(x, t, &[None, kv_bias], &mut [&mut q_in, &mut ckv]);
                q_in
            }
            QProj::Lora { a_bias, norm, b } => {
                self.input.forward_parts(
                    x,
                    t,
                    &[a_bias.as_deref(), kv_bias],
                    &mut [&mut q_in, &mut ckv],
                );
                rms_norm(&mut q_in, norm, LORA_NORM_EPS);
                let mut q = vec![0.0f32; t * nh * qk];
                b.forward(&q_in, t, None, &mut q);
                q
            }
        };
        drop(proj);
        // The latent's norm and the rotary embeddings at each token's
        // absolute position (rows in parallel at prefill: a row's bits do
        // not depend on the others).
        let mut pos = vec![usize::MAX; t];
        for sp in spans {
            for i in 0..sp.len {
                pos[sp.start + i] = sp.past + i;
            }
        }
        let per_row = |((c, qr), &p): ((&mut [f32], &mut [f32]), &usize)| {
            if p == usize::MAX {
                return;
            }
            rms_norm(&mut c[..rank], &self.kv_norm, LORA_NORM_EPS);
            rope.at(p, |cos, sin| {
                rope.apply(&mut c[rank..], rd, cos, sin);
                for hq in qr.chunks_mut(qk) {
                    rope.apply(&mut hq[nope..], rd, cos, sin);
                }
            });
        };
        if t >= PAR_ROPE_ROWS {
            (ckv.par_chunks_mut(w).zip(q.par_chunks_mut(nh * qk)))
                .zip(pos.par_iter())
                .for_each(per_row);
        } else {
            (ckv.chunks_mut(w).zip(q.chunks_mut(nh * qk)))
                .zip(pos.iter())
                .for_each(per_row);
        }
        for (sp, cache) in spans.iter().zip(caches) {
            for i in 0..sp.len {
                let r = pool.row(cache, sp.past + i);
                let src = sp.start + i;
                pool.layer_mut(layer)
                    .write_k(r, &ckv[src * w..(src + 1) * w]);
            }
        }
        // Absorb each head's no-RoPE query into latent space: q_lat = q_nope · W_uk.
        let mut q_lat = vec![0.0f32; nh * t * rank]; // [head][token][rank]
        q_lat
            .par_chunks_mut(t * rank)
            .enumerate()
            .for_each(|(h, dst)| {
                let mut q_nope = Vec::with_capacity(t * nope);
                for tok in 0..t {
                    let at = tok * nh * qk + h * qk;
                    q_nope.extend_from_slice(&q[at..at + nope]);
                }
                self.w_uk_t[h].forward(&q_nope, t, None, dst);
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
            by_column: false,
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
                // The absorbed queries stay f32 (the latent is shared by
                // every head; not measured with bf16 queries).
                bf16_queries: false,
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
                let mut out = vec![0.0f32; t * vd];
                self.w_uv[h].forward(&o_lat[h * t * rank..(h + 1) * t * rank], t, None, &mut out);
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
        let _o = profile::timer(Phase::AttnOut).work(|| (self.o.bytes(), self.o.macs(t)));
        self.o.forward(&attn, t, self.o_bias.as_deref(), &mut out);
        out
    }
}
