//! Model configuration: `config.json` as Hugging Face writes it, normalized
//! and validated into the [`ModelConfig`] the model code reads, with its
//! types ([`Arch`], [`RouterKind`], [`LayerSpec`], [`RopeConfig`], ...).
//! [`ModelConfig::from_raw`] takes the architecture's reading of the raw
//! fields (`arch`), then checks and assembles it the same way for all:
//!
//! - [`raw`]: [`raw::RawConfig`], the file field by field (hub and
//!   transformers-5 names).
//! - `arch`: one function per architecture: its transformers class defaults.
//! - `shape`: the shared checks (attention shape, experts, router groups).
//! - `rope`, `layers`: RoPE parameters; per-layer experts, windows and heads.
//! - [`quant`]: which quantized checkpoints are accepted.
//! - here also [`parse_size`], for memory sizes on command lines.

mod arch;
mod layers;
pub mod quant;
pub mod raw;
mod rope;
mod shape;
#[cfg(test)]
mod tests;

use std::path::Path;

use crate::error::{Error, Result};
use layers::{LayerDims, layer_specs};
use quant::check_quantization;
use raw::RawConfig;
use rope::{mla_softmax_scale, parse_rope};
use shape::{attention_shape, check_router, expert_shape, need};

/// The architectures the engine implements, keyed by `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Qwen3Moe,
    Qwen2Moe,
    Mixtral,
    Olmoe,
    GptOss,
    /// Gemma 4 text model with its MoE block (`gemma4_text`, or `gemma4`
    /// with a `text_config`).
    Gemma4,
    DeepseekV2,
    DeepseekV3,
}

impl Arch {
    /// All supported `model_type` strings.
    pub const SUPPORTED: &'static [&'static str] = &[
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "olmoe",
        "gpt_oss",
        "gemma4",
        "gemma4_text",
        "deepseek_v2",
        "deepseek_v3",
    ];

    fn from_model_type(s: &str) -> Option<Self> {
        Some(match s {
            "qwen3_moe" => Arch::Qwen3Moe,
            "qwen2_moe" => Arch::Qwen2Moe,
            "mixtral" => Arch::Mixtral,
            "olmoe" => Arch::Olmoe,
            "gpt_oss" => Arch::GptOss,
            "gemma4" | "gemma4_text" => Arch::Gemma4,
            "deepseek_v2" => Arch::DeepseekV2,
            "deepseek_v3" => Arch::DeepseekV3,
            _ => return None,
        })
    }
}

/// Which RoPE frequency scheme a model uses.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain `theta^(-2i/d)` frequencies.
    Default,
    /// Positions divided by `factor` (frequencies divided by `factor`).
    Linear { factor: f64 },
    /// Llama-3 style piecewise frequency scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// YaRN: frequencies blended between interpolation and extrapolation by a
    /// linear ramp over `[low, high]` (already computed from beta_fast/slow).
    Yarn { factor: f64, low: f64, high: f64 },
    /// Gemma 4's proportional RoPE: exponents over the whole head, only the
    /// first `rope_angles` frequencies non-zero, the rest do not rotate.
    Proportional { factor: f64, rope_angles: usize },
}

/// Normalized RoPE settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// Number of leading dimensions of each head that rotate.
    pub rotary_dim: usize,
    /// Rotate adjacent pairs `(2i, 2i+1)` instead of `(i, i + rotary_dim/2)`
    /// (DeepSeek's complex / interleaved RoPE).
    pub interleaved: bool,
    /// Multiplies cos and sin (YaRN's attention factor; 1.0 otherwise).
    pub attention_scaling: f32,
}

/// How q/k are normalized before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// RMSNorm over each head's `head_dim` (Qwen3).
    PerHead,
    /// RMSNorm over the whole projection (OLMoE).
    Full,
}

/// The expert / MLP activation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    Silu,
    Gelu,
    GeluTanh,
    /// GPT-OSS's clamped SwiGLU: `gate = min(gate, limit)`,
    /// `up = clamp(up, ±limit)`, `(up + 1) · gate · σ(alpha · gate)`.
    SwigluOai {
        alpha: f32,
        limit: f32,
    },
}

impl Activation {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "silu" | "swish" => Activation::Silu,
            "gelu" => Activation::Gelu,
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Activation::GeluTanh,
            _ => return None,
        })
    }
}

/// What kind of feed-forward block a decoder layer has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnKind {
    /// A dense gated MLP of `intermediate_size`.
    Dense,
    /// A routed mixture of experts.
    Moe,
}

/// Per-layer settings derived from the config.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSpec {
    pub ffn: FfnKind,
    /// Keys older than this many positions are masked (`q - k < window` visible).
    pub sliding_window: Option<usize>,
    /// Attention head size of this layer (Gemma 4: larger on full layers).
    pub head_dim: usize,
    /// Key/value heads of this layer.
    pub kv_heads: usize,
    /// RoPE of this layer (Gemma 4: one per layer type).
    pub rope: RopeConfig,
    /// Values are the raw key projection (Gemma 4 `attention_k_eq_v` on full layers).
    pub v_from_k: bool,
}

/// How router logits become top-k experts and weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterKind {
    /// softmax over all experts (f32), top-k, optionally renormalized over
    /// the k (Qwen2/3-MoE, OLMoE, Mixtral).
    SoftmaxTopK { normalize: bool },
    /// top-k of the raw logits, softmax over the k (GPT-OSS; logits carry the
    /// router bias).
    TopKSoftmax,
    /// softmax; groups ranked by their best expert; experts outside the best
    /// `topk_group` groups zeroed; top-k; weights times `scaling` (DeepSeek-V2).
    GroupedSoftmax {
        n_group: usize,
        topk_group: usize,
        scaling: f32,
    },
    /// sigmoid; choice scores add the correction bias
    /// (`e_score_correction_bias`); groups ranked by the sum of their two best
    /// choice scores; top-k in the best `topk_group` groups; weights are the
    /// sigmoid scores, optionally renormalized, times `scaling` (DeepSeek-V3).
    GroupedSigmoid {
        n_group: usize,
        topk_group: usize,
        normalize: bool,
        scaling: f32,
    },
    /// Gemma 4: the router input RMS-normalized (no weight) times a learned
    /// scale and `hidden^-0.5`; softmax, top-k, renormalized, times a
    /// per-expert scale.
    ScaledSoftmax,
}

/// Multi-head latent attention (DeepSeek-V2/V3).
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    /// `None`: queries straight from `q_proj`; else through `q_a_proj` → norm → `q_b_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// `qk_head_dim^-0.5`, times YaRN's `mscale²` when `mscale_all_dim` is set.
    pub softmax_scale: f32,
}

/// The validated model configuration the engine uses.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    pub shared_expert_intermediate_size: Option<usize>,
    pub rms_norm_eps: f32,
    pub rope: RopeConfig,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub qk_norm: QkNorm,
    pub clip_qkv: Option<f32>,
    pub activation: Activation,
    pub layers: Vec<LayerSpec>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The dtype the checkpoint declares (`torch_dtype` or `dtype`), if any.
    pub declared_dtype: Option<String>,
    /// Prefix of the language model's tensors: `model`, or
    /// `model.language_model` in multimodal wrappers.
    pub weight_prefix: String,
    /// How the router turns logits into experts and weights.
    pub router: RouterKind,
    /// Experts carry gate/up/down biases (GPT-OSS).
    pub expert_bias: bool,
    /// Dense MLPs and shared experts carry biases (DeepSeek-V2 `mlp_bias`).
    pub mlp_bias: bool,
    /// Learned per-head attention sinks (GPT-OSS).
    pub attn_sinks: bool,
    /// Values are RMS-normalized per head without a weight (Gemma 4).
    pub v_norm: bool,
    /// Attention softmax scale; `None` is `head_dim^-0.5`.
    pub attention_scale: Option<f32>,
    /// Multi-head latent attention instead of GQA (DeepSeek).
    pub mla: Option<MlaConfig>,
    /// Embeddings are multiplied by this (Gemma: `sqrt(hidden_size)`).
    pub embed_scale: Option<f32>,
    /// `cap · tanh(logits / cap)` on the final logits (Gemma).
    pub final_logit_softcapping: Option<f32>,
}

impl ModelConfig {
    /// Reads and validates `config.json` in `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if !path.is_file() {
            return Err(Error::MissingFile {
                path,
                what: "model configuration",
            });
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        Self::from_json_str(&text, &path)
    }

    /// Parses config JSON text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| Error::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Self::from_raw(raw, path)
    }

    /// Normalizes a raw config, filling transformers' per-class defaults.
    pub fn from_raw(mut raw: RawConfig, path: &Path) -> Result<Self> {
        if let Some(q) = &raw.quantization_config {
            check_quantization(q).map_err(|m| Error::config(path, m))?;
        }
        let arch = Arch::from_model_type(&raw.model_type).ok_or_else(|| {
            Error::UnsupportedArchitecture {
                path: path.to_path_buf(),
                model_type: raw.model_type.clone(),
                supported: Arch::SUPPORTED.join(", "),
            }
        })?;
        if let Some(text) = raw.text_config.take() {
            return Self::from_wrapper(raw, text, arch, path);
        }
        check_sizes(&raw, path)?;
        let fam = arch::family(arch, &raw);
        let vocab_size = need(path, raw.vocab_size, "vocab_size")?;
        let hidden_size = need(path, raw.hidden_size, "hidden_size")?;
        let num_hidden_layers = need(path, raw.num_hidden_layers, "num_hidden_layers")?;
        let num_attention_heads = need(path, raw.num_attention_heads, "num_attention_heads")?;
        let attn = attention_shape(&raw, &fam, hidden_size, num_attention_heads, path)?;
        if let Some(why) = fam.unsupported {
            return Err(Error::config(path, why));
        }
        let experts = expert_shape(&raw, &fam, path)?;
        check_router(&raw, fam.router, &experts, path)?;
        let rope = parse_rope(&raw, fam.rope, attn.head_dim, None, path)?;
        let mla = attn.mla.map(|mut m| {
            m.softmax_scale = mla_softmax_scale(&raw, &m);
            m
        });
        let activation = fam
            .activation
            .clone()
            .map_err(|name| Error::config(path, format!("unsupported hidden_act '{name}'")))?;
        let dims = LayerDims {
            head_dim: attn.head_dim,
            kv_heads: attn.num_key_value_heads,
            intermediate_size: experts.intermediate_size,
        };
        let layers = layer_specs(&raw, &fam, num_hidden_layers, &dims, &rope, path)?;
        let eos_token_ids = raw
            .eos_token_id
            .as_ref()
            .map(|e| e.to_vec())
            .or(fam.eos_default)
            .unwrap_or_default();
        let bos_token_id = raw
            .bos_token_id
            .as_ref()
            .and_then(|b| b.to_vec().first().copied());
        Ok(ModelConfig {
            arch,
            model_type: raw.model_type.clone(),
            vocab_size,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: attn.num_key_value_heads,
            head_dim: attn.head_dim,
            intermediate_size: experts.intermediate_size,
            moe_intermediate_size: experts.moe_intermediate_size,
            num_experts: experts.num_experts,
            num_experts_per_tok: experts.num_experts_per_tok,
            norm_topk_prob: fam.norm_topk_prob,
            shared_expert_intermediate_size: experts.shared_expert_intermediate_size,
            rms_norm_eps: fam.rms_norm_eps as f32,
            rope,
            tie_word_embeddings: fam.tie_word_embeddings,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            qkv_bias: fam.qkv_bias,
            o_bias: fam.o_bias,
            qk_norm: fam.qk_norm,
            clip_qkv: fam.clip_qkv,
            activation,
            layers,
            bos_token_id,
            eos_token_ids,
            declared_dtype: raw.dtype.clone().or(raw.torch_dtype.clone()),
            weight_prefix: "model".into(),
            router: fam.router,
            expert_bias: fam.expert_bias,
            mlp_bias: fam.mlp_bias,
            attn_sinks: fam.attn_sinks,
            v_norm: fam.v_norm,
            attention_scale: fam.attention_scale,
            mla,
            embed_scale: fam.embed_scale,
            final_logit_softcapping: fam.final_logit_softcapping,
        })
    }

    /// Multimodal wrapper: the language model's config is `text_config` (the
    /// wrapper's token ids, tying and dtype fill its gaps) and its tensors
    /// live under `model.language_model`.
    fn from_wrapper(
        raw: RawConfig,
        text: serde_json::Value,
        arch: Arch,
        path: &Path,
    ) -> Result<Self> {
        let mut text: RawConfig = serde_json::from_value(text).map_err(|e| Error::Json {
            path: path.to_path_buf(),
            message: format!("text_config: {e}"),
        })?;
        if Arch::from_model_type(&text.model_type) != Some(arch) {
            return Err(Error::config(
                path,
                format!(
                    "text_config.model_type '{}' does not match model_type '{}'",
                    text.model_type, raw.model_type
                ),
            ));
        }
        text.text_config = None;
        text.eos_token_id = text.eos_token_id.or(raw.eos_token_id);
        text.bos_token_id = text.bos_token_id.or(raw.bos_token_id);
        text.tie_word_embeddings = text.tie_word_embeddings.or(raw.tie_word_embeddings);
        text.dtype = text.dtype.or(raw.dtype).or(raw.torch_dtype);
        let mut cfg = Self::from_raw(text, path)?;
        cfg.model_type = raw.model_type.clone();
        cfg.weight_prefix = "model.language_model".into();
        Ok(cfg)
    }

    /// Indices of the decoder layers whose FFN is a mixture of experts.
    pub fn moe_layers(&self) -> Vec<usize> {
        self.layers
            .iter()
            .enumerate()
            .filter(|(_, l)| l.ffn == FfnKind::Moe)
            .map(|(i, _)| i)
            .collect()
    }
}

/// Largest value each size field of `config.json` may have: far above any
/// real model, low enough that nothing sized from them (layer lists, rope
/// tables, KV blocks, routing tables) can ask for terabytes before the
/// weights are checked against the file.
pub const SIZE_CAPS: &[(&str, usize)] = &[
    ("vocab_size", 1 << 24),
    ("hidden_size", 1 << 17),
    ("intermediate_size", 1 << 20),
    ("moe_intermediate_size", 1 << 20),
    ("shared_expert_intermediate_size", 1 << 20),
    ("num_hidden_layers", 1 << 12),
    ("num_attention_heads", 1 << 12),
    ("num_key_value_heads", 1 << 12),
    ("head_dim", 1 << 13),
    ("max_position_embeddings", 1 << 24),
    ("sliding_window", 1 << 24),
    ("num_experts", 1 << 16),
    ("num_local_experts", 1 << 16),
    ("n_routed_experts", 1 << 16),
    ("n_shared_experts", 1 << 10),
    ("num_experts_per_tok", 1 << 10),
    ("experts_per_token", 1 << 10),
    ("top_k_experts", 1 << 10),
    ("kv_lora_rank", 1 << 16),
    ("q_lora_rank", 1 << 16),
    ("qk_rope_head_dim", 1 << 13),
    ("qk_nope_head_dim", 1 << 13),
    ("v_head_dim", 1 << 13),
    ("n_group", 1 << 16),
    ("topk_group", 1 << 16),
    ("global_head_dim", 1 << 13),
    ("num_global_key_value_heads", 1 << 12),
];

/// Refuses absurd sizes with a clear error before anything is allocated
/// from them; also the product that sizes the embedding table.
fn check_sizes(raw: &RawConfig, path: &Path) -> Result<()> {
    let get = |name: &str| -> Option<usize> {
        match name {
            "vocab_size" => raw.vocab_size,
            "hidden_size" => raw.hidden_size,
            "intermediate_size" => raw.intermediate_size,
            "moe_intermediate_size" => raw.moe_intermediate_size,
            "shared_expert_intermediate_size" => raw.shared_expert_intermediate_size,
            "num_hidden_layers" => raw.num_hidden_layers,
            "num_attention_heads" => raw.num_attention_heads,
            "num_key_value_heads" => raw.num_key_value_heads,
            "head_dim" => raw.head_dim,
            "max_position_embeddings" => raw.max_position_embeddings,
            "sliding_window" => raw.sliding_window,
            "num_experts" => raw.num_experts,
            "num_local_experts" => raw.num_local_experts,
            "n_routed_experts" => raw.n_routed_experts,
            "n_shared_experts" => raw.n_shared_experts,
            "num_experts_per_tok" => raw.num_experts_per_tok,
            "experts_per_token" => raw.experts_per_token,
            "top_k_experts" => raw.top_k_experts,
            "kv_lora_rank" => raw.kv_lora_rank,
            "q_lora_rank" => raw.q_lora_rank,
            "qk_rope_head_dim" => raw.qk_rope_head_dim,
            "qk_nope_head_dim" => raw.qk_nope_head_dim,
            "v_head_dim" => raw.v_head_dim,
            "n_group" => raw.n_group,
            "topk_group" => raw.topk_group,
            "global_head_dim" => raw.global_head_dim,
            "num_global_key_value_heads" => raw.num_global_key_value_heads,
            _ => None,
        }
    };
    for &(name, max) in SIZE_CAPS {
        if let Some(v) = get(name)
            && v > max
        {
            return Err(Error::config(
                path,
                format!("`{name}` is {v}, beyond the sane limit of {max}"),
            ));
        }
    }
    let vocab = raw.vocab_size.unwrap_or(0);
    let hidden = raw.hidden_size.unwrap_or(0);
    if vocab.checked_mul(hidden).is_none_or(|n| n > 1 << 36) {
        return Err(Error::config(
            path,
            format!(
                "vocab_size {vocab} × hidden_size {hidden} is beyond the sane limit of 2^36 elements"
            ),
        ));
    }
    Ok(())
}

/// Parses `2GiB`, `512MiB`, `1.5G`, `1000000`.
pub fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid size '{s}': expected a number with an optional unit"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(format!(
                "invalid size '{s}': unknown unit '{other}' (use B, KiB, MiB, GiB, KB, MB, GB)"
            ));
        }
    };
    Ok((n * mult) as usize)
}
