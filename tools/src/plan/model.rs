//! Model arithmetic from `config.json`: parameters and bytes per expert,
//! attention and everything else, active parameters per token, KV bytes per
//! token, and the experts a batch touches.

use epserve_core::config::{FfnKind, ModelConfig};
use epserve_core::model::kv_cache::{KvLayerShape, KvPool};

use super::{ExpertDtype, KvDtype};

/// The shapes of a model the arithmetic needs, from its config.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelShape {
    pub model_type: String,
    pub vocab: u64,
    pub hidden: u64,
    pub layers: u64,
    pub moe_layers: u64,
    pub experts: u64,
    pub top_k: u64,
    /// Width of one routed expert (`moe_intermediate_size`, Mixtral: `intermediate_size`).
    pub moe_width: u64,
    /// Width of the dense MLPs of non-MoE layers.
    pub dense_width: u64,
    /// Width of the shared expert(s) of each MoE layer, if any.
    pub shared_width: Option<u64>,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub tied_embeddings: bool,
    /// Sliding window of each layer (None = full attention).
    pub windows: Vec<Option<u64>>,
    /// Attention parameters of one layer.
    pub attn_params_per_layer: u64,
    /// Key and value elements cached per token per layer (MLA: the latent
    /// and RoPE key as the key, no value).
    pub kv_widths: (u64, u64),
    /// KV heads those elements hold (MLA: one latent).
    pub kv_cache_heads: u64,
}

impl ModelShape {
    /// Shapes from the validated config; `raw` (the config.json value) supplies
    /// the multi-head latent attention ranks of DeepSeek models.
    pub fn from_config(cfg: &ModelConfig, raw: &serde_json::Value) -> Self {
        let h = cfg.hidden_size as u64;
        let heads = cfg.num_attention_heads as u64;
        let kv_heads = cfg.num_key_value_heads as u64;
        let head_dim = cfg.head_dim as u64;
        let moe_layers = cfg.layers.iter().filter(|l| l.ffn == FfnKind::Moe).count() as u64;
        let text = raw.get("text_config").unwrap_or(raw);
        let field = |name: &str| text.get(name).and_then(serde_json::Value::as_u64);
        let kv_lora_rank = field("kv_lora_rank");
        let (attn_params_per_layer, kv_widths) = match kv_lora_rank {
            Some(kv_lora) => {
                // Multi-head latent attention: the cache holds the latent and the
                // shared RoPE key, one per token per layer.
                let rope = field("qk_rope_head_dim").unwrap_or(0);
                let nope = field("qk_nope_head_dim").unwrap_or(0);
                let v = field("v_head_dim").unwrap_or(head_dim);
                let q = match field("q_lora_rank").filter(|r| *r > 0) {
                    Some(r) => h * r + r * heads * (nope + rope),
                    None => h * heads * (nope + rope),
                };
                let kv = h * (kv_lora + rope) + kv_lora * heads * (nope + v);
                (q + kv + heads * v * h, (kv_lora + rope, 0))
            }
            None => (
                2 * h * heads * head_dim + 2 * h * kv_heads * head_dim,
                (kv_heads * head_dim, kv_heads * head_dim),
            ),
        };
        ModelShape {
            model_type: cfg.model_type.clone(),
            vocab: cfg.vocab_size as u64,
            hidden: h,
            layers: cfg.num_hidden_layers as u64,
            moe_layers,
            experts: cfg.num_experts as u64,
            top_k: cfg.num_experts_per_tok as u64,
            moe_width: cfg.moe_intermediate_size as u64,
            dense_width: cfg.intermediate_size as u64,
            shared_width: cfg.shared_expert_intermediate_size.map(|w| w as u64),
            heads,
            kv_heads,
            head_dim,
            tied_embeddings: cfg.tie_word_embeddings,
            windows: cfg
                .layers
                .iter()
                .map(|l| l.sliding_window.map(|w| w as u64))
                .collect(),
            attn_params_per_layer,
            kv_widths,
            kv_cache_heads: if kv_lora_rank.is_some() { 1 } else { kv_heads },
        }
    }

    /// Parameters of one routed expert: gate, up (H→I) and down (I→H).
    pub fn expert_params(&self) -> u64 {
        3 * self.hidden * self.moe_width
    }

    /// Bytes of one routed expert: bf16 2 per weight; int8 1 per weight plus one
    /// f32 scale per output row (2·I rows of gate/up, H rows of down).
    pub fn expert_bytes(&self, dtype: ExpertDtype) -> u64 {
        match dtype {
            ExpertDtype::Bf16 => 2 * self.expert_params(),
            ExpertDtype::Int8 => self.expert_params() + 4 * (2 * self.moe_width + self.hidden),
        }
    }

    /// Every routed expert of every MoE layer.
    pub fn all_expert_params(&self) -> u64 {
        self.moe_layers * self.experts * self.expert_params()
    }

    /// Attention parameters of all layers.
    pub fn attention_params(&self) -> u64 {
        self.layers * self.attn_params_per_layer
    }

    /// Router (gate) parameters of all MoE layers.
    pub fn router_params(&self) -> u64 {
        self.moe_layers * self.experts * self.hidden
    }

    /// Shared-expert parameters of all MoE layers (Qwen2-MoE adds a 1-wide gate).
    pub fn shared_params(&self) -> u64 {
        match self.shared_width {
            Some(w) => {
                let gate = if self.model_type == "qwen2_moe" {
                    self.hidden
                } else {
                    0
                };
                self.moe_layers * (3 * self.hidden * w + gate)
            }
            None => 0,
        }
    }

    /// Dense MLP parameters of the non-MoE layers.
    pub fn dense_params(&self) -> u64 {
        (self.layers - self.moe_layers) * 3 * self.hidden * self.dense_width
    }

    /// Input embedding parameters.
    pub fn embedding_params(&self) -> u64 {
        self.vocab * self.hidden
    }

    /// Output head parameters (0 when tied to the embedding).
    pub fn lm_head_params(&self) -> u64 {
        if self.tied_embeddings {
            0
        } else {
            self.vocab * self.hidden
        }
    }

    /// Parameters outside the routed experts (norms left out: < 0.01%).
    pub fn non_expert_params(&self) -> u64 {
        self.attention_params()
            + self.router_params()
            + self.shared_params()
            + self.dense_params()
            + self.embedding_params()
            + self.lm_head_params()
    }

    /// All parameters.
    pub fn total_params(&self) -> u64 {
        self.non_expert_params() + self.all_expert_params()
    }

    /// Parameters one token uses: everything but the unchosen experts (the
    /// embedding counted whole, as model cards do).
    pub fn active_params(&self) -> u64 {
        self.non_expert_params() + self.moe_layers * self.top_k * self.expert_params()
    }

    /// KV-cache bytes of one token in one layer, as the engine's pool lays
    /// them out (each KV head in its plane, value rows a multiple of 1 KiB
    /// padded by a cache line: see `epserve_core::model::kv_cache`).
    pub fn kv_bytes_per_layer_token(&self, kv: KvDtype) -> u64 {
        let (k, v) = self.kv_widths;
        let shape = KvLayerShape {
            k_width: k as usize,
            v_width: v as usize,
            heads: self.kv_cache_heads as usize,
        };
        KvPool::layer_block_bytes(&[shape], 1, kv.engine()) as u64
    }

    /// KV-cache bytes of one token over all layers (full attention).
    pub fn kv_bytes_per_token(&self, kv: KvDtype) -> u64 {
        self.layers * self.kv_bytes_per_layer_token(kv)
    }

    /// KV-cache bytes one sequence of `ctx` tokens holds (sliding-window layers
    /// keep only their window).
    pub fn kv_bytes_for_context(&self, ctx: u64, kv: KvDtype) -> u64 {
        self.windows
            .iter()
            .map(|w| w.map_or(ctx, |w| w.min(ctx)) * self.kv_bytes_per_layer_token(kv))
            .sum()
    }

    /// Attention flops of one decode token at context `ctx` beyond the
    /// projections: q·kᵀ and p·v, 2 flops per multiply-add each.
    pub fn attention_score_flops(&self, ctx: u64) -> u64 {
        self.windows
            .iter()
            .map(|w| 4 * w.map_or(ctx, |w| w.min(ctx)) * self.heads * self.head_dim)
            .sum()
    }
}

/// Expected distinct experts `B` tokens touch in one layer when each picks `k`
/// of `E` uniformly: every expert is missed by a token with probability 1 − k/E.
pub fn expected_touched(experts: u64, k: u64, batch: u64) -> f64 {
    if experts == 0 {
        return 0.0;
    }
    let e = experts as f64;
    let miss = 1.0 - (k.min(experts) as f64) / e;
    e * (1.0 - miss.powf(batch as f64))
}
