//! Model configuration: `config.json` as Hugging Face writes it (field names
//! mirrored, both the hub style and the transformers-5 style accepted), and the
//! normalized, validated [`ModelConfig`] the model code reads.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

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

/// A token id or a list of them (`eos_token_id` is either in the wild).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(i64),
    Many(Vec<i64>),
}

impl OneOrMany {
    /// The ids as a list, negative ids dropped.
    pub fn to_vec(&self) -> Vec<u32> {
        let v = match self {
            OneOrMany::One(x) => vec![*x],
            OneOrMany::Many(v) => v.clone(),
        };
        v.into_iter()
            .filter_map(|x| u32::try_from(x).ok())
            .collect()
    }
}

/// RoPE parameters: hub `rope_scaling` or transformers-5 `rope_parameters`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RawRope {
    pub rope_type: Option<String>,
    #[serde(rename = "type")]
    pub type_: Option<String>,
    pub rope_theta: Option<f64>,
    pub factor: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<usize>,
    /// YaRN.
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    pub attention_factor: Option<f64>,
    pub truncate: Option<bool>,
}

/// `rope_parameters`: one set for the model, or one per layer type (Gemma 4:
/// `{"sliding_attention": {...}, "full_attention": {...}}`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RopeParams {
    PerLayerType(std::collections::BTreeMap<String, RawRope>),
    Single(Box<RawRope>),
}

/// Per-layer overrides transformers 5 writes as `per_layer_config`
/// (`{"5": {"head_dim": 512, "num_key_value_heads": 2}}`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RawLayerOverride {
    pub head_dim: Option<usize>,
    pub num_key_value_heads: Option<usize>,
}

/// `config.json` field by field, as Hugging Face names them. Fields missing from
/// the file take the defaults of the transformers config class of the model type.
#[derive(Debug, Clone, Deserialize)]
pub struct RawConfig {
    pub model_type: String,
    #[serde(default)]
    pub architectures: Option<Vec<String>>,
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub hidden_act: Option<String>,
    pub max_position_embeddings: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub tie_word_embeddings: Option<bool>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<RawRope>,
    pub rope_parameters: Option<RopeParams>,
    pub attention_bias: Option<bool>,
    pub qkv_bias: Option<bool>,
    pub clip_qkv: Option<f64>,
    pub sliding_window: Option<usize>,
    pub use_sliding_window: Option<bool>,
    pub max_window_layers: Option<usize>,
    pub layer_types: Option<Vec<String>>,
    pub decoder_sparse_step: Option<usize>,
    pub mlp_only_layers: Option<Vec<usize>>,
    pub moe_intermediate_size: Option<usize>,
    pub shared_expert_intermediate_size: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    /// Qwen's name for the expert count (hub checkpoints).
    pub num_experts: Option<usize>,
    /// Mixtral's name, and what transformers 5 writes for all.
    pub num_local_experts: Option<usize>,
    pub norm_topk_prob: Option<bool>,
    pub bos_token_id: Option<OneOrMany>,
    pub eos_token_id: Option<OneOrMany>,
    pub pad_token_id: Option<OneOrMany>,
    pub torch_dtype: Option<String>,
    pub dtype: Option<String>,
    // GPT-OSS
    pub swiglu_limit: Option<f64>,
    pub swiglu_alpha: Option<f64>,
    /// GPT-OSS hub alias of `num_experts_per_tok`.
    pub experts_per_token: Option<usize>,
    // Gemma 4
    pub hidden_activation: Option<String>,
    pub final_logit_softcapping: Option<f64>,
    pub global_head_dim: Option<usize>,
    pub num_global_key_value_heads: Option<usize>,
    pub attention_k_eq_v: Option<bool>,
    pub enable_moe_block: Option<bool>,
    pub top_k_experts: Option<usize>,
    pub hidden_size_per_layer_input: Option<usize>,
    pub num_kv_shared_layers: Option<usize>,
    pub use_double_wide_mlp: Option<bool>,
    pub use_bidirectional_attention: Option<String>,
    pub per_layer_config: Option<std::collections::BTreeMap<String, RawLayerOverride>>,
    /// Multimodal wrappers (`gemma4`): the language model's config.
    pub text_config: Option<serde_json::Value>,
    /// Quantized checkpoints: `{"quant_method": "compressed-tensors", ...}`
    /// (checked by [`check_quantization`]) or `mxfp4` (GPT-OSS experts).
    pub quantization_config: Option<serde_json::Value>,
    // DeepSeek-V2/V3
    pub kv_lora_rank: Option<usize>,
    pub q_lora_rank: Option<usize>,
    pub qk_rope_head_dim: Option<usize>,
    pub qk_nope_head_dim: Option<usize>,
    pub v_head_dim: Option<usize>,
    pub n_group: Option<usize>,
    pub topk_group: Option<usize>,
    pub topk_method: Option<String>,
    pub routed_scaling_factor: Option<f64>,
    pub n_routed_experts: Option<usize>,
    pub n_shared_experts: Option<usize>,
    pub first_k_dense_replace: Option<usize>,
    pub moe_layer_freq: Option<usize>,
    pub rope_interleave: Option<bool>,
    pub mlp_bias: Option<bool>,
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
    pub fn from_raw(raw: RawConfig, path: &Path) -> Result<Self> {
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
        // Multimodal wrapper: the language model's config is `text_config` and
        // its tensors live under `model.language_model`.
        if let Some(tc) = raw.text_config.clone() {
            let mut text: RawConfig = serde_json::from_value(tc).map_err(|e| Error::Json {
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
            return Ok(cfg);
        }
        let need = |v: Option<usize>, name: &str| -> Result<usize> {
            match v {
                Some(0) => Err(Error::config(path, format!("`{name}` must be positive"))),
                Some(x) => Ok(x),
                None => Err(Error::config(path, format!("missing field `{name}`"))),
            }
        };
        let is_deepseek = matches!(arch, Arch::DeepseekV2 | Arch::DeepseekV3);
        let vocab_size = need(raw.vocab_size, "vocab_size")?;
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let num_hidden_layers = need(raw.num_hidden_layers, "num_hidden_layers")?;
        let num_attention_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        // MLA has no key/value heads of its own: every head reads the latent.
        let num_key_value_heads = if is_deepseek {
            num_attention_heads
        } else {
            raw.num_key_value_heads.unwrap_or(num_attention_heads)
        };
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(Error::config(
                path,
                format!(
                    "num_attention_heads ({num_attention_heads}) is not a multiple of num_key_value_heads ({num_key_value_heads})"
                ),
            ));
        }
        let mla = if is_deepseek {
            let kv_lora_rank = need(raw.kv_lora_rank, "kv_lora_rank")?;
            let qk_rope_head_dim = need(raw.qk_rope_head_dim, "qk_rope_head_dim")?;
            let qk_nope_head_dim = need(raw.qk_nope_head_dim, "qk_nope_head_dim")?;
            let v_head_dim = need(raw.v_head_dim, "v_head_dim")?;
            if qk_rope_head_dim % 2 != 0 {
                return Err(Error::config(
                    path,
                    format!("qk_rope_head_dim ({qk_rope_head_dim}) must be even"),
                ));
            }
            Some(MlaConfig {
                q_lora_rank: raw.q_lora_rank.filter(|r| *r > 0),
                kv_lora_rank,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
                softmax_scale: 0.0, // set once the RoPE parameters are known
            })
        } else {
            None
        };
        let head_dim = match (&mla, raw.head_dim) {
            // transformers sets head_dim = qk_rope_head_dim for MLA (the RoPE size).
            (Some(m), _) => m.qk_rope_head_dim,
            (None, Some(h)) => h,
            (None, None) => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(Error::config(
                        path,
                        format!(
                            "hidden_size ({hidden_size}) is not divisible by num_attention_heads ({num_attention_heads}) and no head_dim is given"
                        ),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(Error::config(
                path,
                format!("head_dim ({head_dim}) must be even and positive"),
            ));
        }

        if arch == Arch::Gemma4 {
            if raw.enable_moe_block != Some(true) {
                return Err(Error::config(
                    path,
                    "gemma4: only the MoE variant (`enable_moe_block: true`) is supported",
                ));
            }
            if raw.hidden_size_per_layer_input.unwrap_or(0) > 0 {
                return Err(Error::config(
                    path,
                    "gemma4: per-layer input embeddings (`hidden_size_per_layer_input` > 0) are not supported",
                ));
            }
            if raw.num_kv_shared_layers.unwrap_or(0) > 0 {
                return Err(Error::config(
                    path,
                    "gemma4: KV sharing across layers (`num_kv_shared_layers` > 0) is not supported",
                ));
            }
            if raw.use_bidirectional_attention.as_deref() == Some("all") {
                return Err(Error::config(
                    path,
                    "gemma4: bidirectional attention (`use_bidirectional_attention: all`) is not supported",
                ));
            }
        }

        let num_experts = match arch {
            Arch::DeepseekV2 | Arch::DeepseekV3 => raw.n_routed_experts.or(raw.num_local_experts),
            _ => raw.num_local_experts.or(raw.num_experts),
        }
        .ok_or_else(|| Error::config(path, "missing field `num_experts` / `num_local_experts`"))?;
        let num_experts_per_tok = match arch {
            Arch::Gemma4 => need(
                raw.top_k_experts.or(raw.num_experts_per_tok),
                "top_k_experts",
            )?,
            Arch::GptOss => need(
                raw.num_experts_per_tok.or(raw.experts_per_token),
                "num_experts_per_tok",
            )?,
            _ => need(raw.num_experts_per_tok, "num_experts_per_tok")?,
        };
        if num_experts == 0 || num_experts_per_tok > num_experts {
            return Err(Error::config(
                path,
                format!(
                    "num_experts_per_tok ({num_experts_per_tok}) must be between 1 and the expert count ({num_experts})"
                ),
            ));
        }

        // Expert width and dense width per architecture.
        let (intermediate_size, moe_intermediate_size) = match arch {
            Arch::Mixtral | Arch::Olmoe | Arch::GptOss => {
                let i = need(raw.intermediate_size, "intermediate_size")?;
                (i, i)
            }
            Arch::Qwen3Moe | Arch::Qwen2Moe => (
                raw.intermediate_size.unwrap_or(0),
                need(raw.moe_intermediate_size, "moe_intermediate_size")?,
            ),
            Arch::Gemma4 | Arch::DeepseekV2 | Arch::DeepseekV3 => (
                need(raw.intermediate_size, "intermediate_size")?,
                need(raw.moe_intermediate_size, "moe_intermediate_size")?,
            ),
        };
        let norm_topk_prob = match arch {
            Arch::Mixtral | Arch::Gemma4 | Arch::GptOss => true,
            Arch::DeepseekV3 => raw.norm_topk_prob.unwrap_or(true),
            Arch::DeepseekV2 => false,
            _ => raw.norm_topk_prob.unwrap_or(false),
        };
        let shared_expert_intermediate_size = match arch {
            Arch::Qwen2Moe => Some(need(
                raw.shared_expert_intermediate_size,
                "shared_expert_intermediate_size",
            )?),
            Arch::DeepseekV2 | Arch::DeepseekV3 => {
                let n =
                    raw.n_shared_experts
                        .unwrap_or(if arch == Arch::DeepseekV2 { 2 } else { 1 });
                (n > 0).then_some(moe_intermediate_size * n)
            }
            _ => None,
        };

        let router = match arch {
            Arch::GptOss => RouterKind::TopKSoftmax,
            Arch::Gemma4 => RouterKind::ScaledSoftmax,
            Arch::DeepseekV2 | Arch::DeepseekV3 => {
                let scaling = raw
                    .routed_scaling_factor
                    .unwrap_or(if arch == Arch::DeepseekV2 { 1.0 } else { 2.5 })
                    as f32;
                let grouped = arch == Arch::DeepseekV3
                    || raw.topk_method.as_deref() == Some("group_limited_greedy");
                let (n_group, topk_group) = if grouped {
                    let g = raw.n_group.unwrap_or(1).max(1);
                    (g, raw.topk_group.unwrap_or(g).max(1))
                } else {
                    (1, 1)
                };
                let per_group = num_experts / n_group;
                if num_experts % n_group != 0 || topk_group > n_group {
                    return Err(Error::config(
                        path,
                        format!(
                            "n_group ({n_group}) must divide n_routed_experts ({num_experts}) and be at least topk_group ({topk_group})"
                        ),
                    ));
                }
                if arch == Arch::DeepseekV3 && per_group < 2 {
                    return Err(Error::config(
                        path,
                        format!(
                            "deepseek_v3 needs at least 2 experts per group (n_group {n_group})"
                        ),
                    ));
                }
                if num_experts_per_tok > topk_group * per_group {
                    return Err(Error::config(
                        path,
                        format!(
                            "num_experts_per_tok ({num_experts_per_tok}) exceeds the experts of the topk_group ({topk_group}) best groups"
                        ),
                    ));
                }
                if arch == Arch::DeepseekV2 {
                    if let Some(m) = raw.topk_method.as_deref()
                        && m != "greedy"
                        && m != "group_limited_greedy"
                    {
                        return Err(Error::config(
                            path,
                            format!(
                                "deepseek_v2: unsupported topk_method '{m}' (supported: greedy, group_limited_greedy)"
                            ),
                        ));
                    }
                    RouterKind::GroupedSoftmax {
                        n_group,
                        topk_group,
                        scaling,
                    }
                } else {
                    RouterKind::GroupedSigmoid {
                        n_group,
                        topk_group,
                        normalize: norm_topk_prob,
                        scaling,
                    }
                }
            }
            _ => RouterKind::SoftmaxTopK {
                normalize: norm_topk_prob,
            },
        };

        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(match arch {
            Arch::Mixtral | Arch::Olmoe | Arch::GptOss => 1e-5,
            _ => 1e-6,
        }) as f32;

        let rope = parse_rope(&raw, arch, head_dim, None, path)?;
        let mla = match mla {
            Some(mut m) => {
                m.softmax_scale = mla_softmax_scale(&raw, &m);
                Some(m)
            }
            None => None,
        };

        let (qkv_bias, o_bias) = match arch {
            Arch::Qwen2Moe => (raw.qkv_bias.unwrap_or(true), false),
            Arch::Mixtral | Arch::DeepseekV2 | Arch::DeepseekV3 => (false, false),
            Arch::GptOss => {
                let b = raw.attention_bias.unwrap_or(true);
                (b, b)
            }
            Arch::Qwen3Moe | Arch::Olmoe | Arch::Gemma4 => {
                let b = raw.attention_bias.unwrap_or(false);
                (b, b)
            }
        };
        let qk_norm = match arch {
            Arch::Qwen3Moe | Arch::Gemma4 => QkNorm::PerHead,
            Arch::Olmoe => QkNorm::Full,
            _ => QkNorm::None,
        };
        let clip_qkv = match arch {
            Arch::Olmoe => raw.clip_qkv.map(|c| c as f32),
            _ => None,
        };
        let activation = match arch {
            Arch::GptOss => Activation::SwigluOai {
                alpha: raw.swiglu_alpha.unwrap_or(1.702) as f32,
                limit: raw.swiglu_limit.unwrap_or(7.0) as f32,
            },
            _ => {
                let act_name = match arch {
                    Arch::Gemma4 => raw
                        .hidden_activation
                        .clone()
                        .or(raw.hidden_act.clone())
                        .unwrap_or_else(|| "gelu_pytorch_tanh".into()),
                    _ => raw.hidden_act.clone().unwrap_or_else(|| "silu".into()),
                };
                Activation::parse(&act_name).ok_or_else(|| {
                    Error::config(path, format!("unsupported hidden_act '{act_name}'"))
                })?
            }
        };

        let dims = LayerDims {
            head_dim,
            kv_heads: num_key_value_heads,
            intermediate_size,
        };
        let layers = layer_specs(&raw, arch, num_hidden_layers, &dims, &rope, path)?;

        let default_eos: Option<Vec<u32>> = match arch {
            Arch::Mixtral => Some(vec![2]),
            Arch::Olmoe => Some(vec![50279]),
            Arch::Gemma4 | Arch::DeepseekV3 => Some(vec![1]),
            Arch::DeepseekV2 => Some(vec![2]),
            _ => None,
        };
        let eos_token_ids = raw
            .eos_token_id
            .as_ref()
            .map(|e| e.to_vec())
            .or(default_eos)
            .unwrap_or_default();
        let bos_token_id = raw
            .bos_token_id
            .as_ref()
            .and_then(|b| b.to_vec().first().copied());
        let tie_default = arch == Arch::Gemma4;

        Ok(ModelConfig {
            arch,
            model_type: raw.model_type.clone(),
            vocab_size,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            intermediate_size,
            moe_intermediate_size,
            num_experts,
            num_experts_per_tok,
            norm_topk_prob,
            shared_expert_intermediate_size,
            rms_norm_eps,
            rope,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(tie_default),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            qkv_bias,
            o_bias,
            qk_norm,
            clip_qkv,
            activation,
            layers,
            bos_token_id,
            eos_token_ids,
            declared_dtype: raw.dtype.clone().or(raw.torch_dtype.clone()),
            weight_prefix: "model".into(),
            router,
            expert_bias: arch == Arch::GptOss,
            mlp_bias: arch == Arch::DeepseekV2 && raw.mlp_bias.unwrap_or(false),
            attn_sinks: arch == Arch::GptOss,
            v_norm: arch == Arch::Gemma4,
            attention_scale: (arch == Arch::Gemma4).then_some(1.0),
            mla,
            embed_scale: (arch == Arch::Gemma4).then(|| (hidden_size as f32).sqrt()),
            final_logit_softcapping: match arch {
                Arch::Gemma4 => raw.final_logit_softcapping.map(|c| c as f32),
                _ => None,
            },
        })
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

/// Global attention sizes, overridden per layer where the config says so.
struct LayerDims {
    head_dim: usize,
    kv_heads: usize,
    intermediate_size: usize,
}

/// The RoPE parameter set for `layer_type` (or the model's only one).
fn rope_params(raw: &RawConfig, layer_type: Option<&str>, path: &Path) -> Result<Option<RawRope>> {
    match (&raw.rope_parameters, layer_type) {
        (Some(RopeParams::PerLayerType(m)), Some(t)) => {
            m.get(t).cloned().map(Some).ok_or_else(|| {
                Error::config(
                    path,
                    format!("rope_parameters has no entry for layer type '{t}'"),
                )
            })
        }
        (Some(RopeParams::PerLayerType(m)), None) => Ok(m
            .get("full_attention")
            .or_else(|| m.values().next())
            .cloned()),
        (Some(RopeParams::Single(p)), _) => Ok(Some((**p).clone())),
        (None, _) => Ok(raw.rope_scaling.clone()),
    }
}

fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// DeepSeek's attention scale: `qk_head_dim^-0.5`, times `mscale²` under YaRN
/// with `mscale_all_dim` (transformers' `yarn_apply_mscale`).
fn mla_softmax_scale(raw: &RawConfig, m: &MlaConfig) -> f32 {
    let mut scale = ((m.qk_nope_head_dim + m.qk_rope_head_dim) as f64).powf(-0.5);
    if let Ok(Some(p)) = rope_params(raw, None, Path::new("")) {
        let kind = p.rope_type.or(p.type_).unwrap_or_else(|| "default".into());
        if kind != "default"
            && let (Some(all), Some(factor)) = (p.mscale_all_dim, p.factor)
            && all != 0.0
        {
            let ms = yarn_get_mscale(factor, all);
            scale = scale * ms * ms;
        }
    }
    scale as f32
}

fn parse_rope(
    raw: &RawConfig,
    arch: Arch,
    head_dim: usize,
    layer_type: Option<&str>,
    path: &Path,
) -> Result<RopeConfig> {
    let default_theta = match arch {
        Arch::Mixtral => 1e6,
        Arch::GptOss => 150000.0,
        _ => 10000.0,
    };
    // transformers 5 writes `rope_parameters` (with the theta inside); the hub
    // writes `rope_theta` plus an optional `rope_scaling`.
    let params = rope_params(raw, layer_type, path)?;
    let theta = params
        .as_ref()
        .and_then(|p| p.rope_theta)
        .or(raw.rope_theta)
        .unwrap_or(default_theta);
    if !(theta.is_finite() && theta > 0.0) {
        return Err(Error::config(
            path,
            format!("rope_theta {theta} is not positive"),
        ));
    }
    let kind = params
        .as_ref()
        .and_then(|p| p.rope_type.clone().or(p.type_.clone()))
        .unwrap_or_else(|| "default".into());
    let p = params.unwrap_or_default();
    let factor = || -> Result<f64> {
        p.factor.filter(|f| *f > 0.0).ok_or_else(|| {
            Error::config(
                path,
                format!("rope type '{kind}' needs a positive `factor`"),
            )
        })
    };
    let partial = p.partial_rotary_factor.unwrap_or(1.0);
    let mut rotary_dim = ((head_dim as f64 * partial) as usize) & !1;
    let mut attention_scaling = 1.0f32;
    let scaling = match kind.as_str() {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: p.low_freq_factor.unwrap_or(1.0),
            high_freq_factor: p.high_freq_factor.unwrap_or(4.0),
            original_max_position_embeddings: p.original_max_position_embeddings.unwrap_or(8192),
        },
        "yarn" => {
            // transformers `_compute_yarn_parameters`, in f64 where it uses Python floats.
            let orig = p.original_max_position_embeddings.ok_or_else(|| {
                Error::config(
                    path,
                    "rope type 'yarn' needs `original_max_position_embeddings`",
                )
            })?;
            let factor = match p.factor {
                Some(f) if f > 0.0 => f,
                _ => raw.max_position_embeddings.unwrap_or(orig) as f64 / orig as f64,
            };
            let af = match p.attention_factor {
                Some(a) => a,
                None => match (p.mscale, p.mscale_all_dim) {
                    (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                        yarn_get_mscale(factor, m) / yarn_get_mscale(factor, a)
                    }
                    _ => yarn_get_mscale(factor, 1.0),
                },
            };
            attention_scaling = af as f32;
            let beta_fast = p.beta_fast.filter(|b| *b != 0.0).unwrap_or(32.0);
            let beta_slow = p.beta_slow.filter(|b| *b != 0.0).unwrap_or(1.0);
            let dim = rotary_dim as f64;
            let corr = |rot: f64| {
                dim * (orig as f64 / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
            if p.truncate.unwrap_or(true) {
                low = low.floor();
                high = high.ceil();
            }
            RopeScaling::Yarn {
                factor,
                low: low.max(0.0),
                high: high.min(dim - 1.0),
            }
        }
        "proportional" => {
            // Frequencies over the whole head; only `rope_angles` of them rotate.
            let rope_angles = (partial * head_dim as f64 / 2.0).floor() as usize;
            rotary_dim = head_dim;
            RopeScaling::Proportional {
                factor: p.factor.unwrap_or(1.0),
                rope_angles: rope_angles.min(head_dim / 2),
            }
        }
        other => {
            return Err(Error::config(
                path,
                format!(
                    "unsupported rope type '{other}' (supported: default, linear, llama3, yarn, proportional)"
                ),
            ));
        }
    };
    let interleaved = match arch {
        Arch::DeepseekV2 => true,
        Arch::DeepseekV3 => raw.rope_interleave.unwrap_or(true),
        _ => false,
    };
    Ok(RopeConfig {
        theta,
        scaling,
        rotary_dim,
        interleaved,
        attention_scaling,
    })
}

fn layer_specs(
    raw: &RawConfig,
    arch: Arch,
    n: usize,
    dims: &LayerDims,
    rope: &RopeConfig,
    path: &Path,
) -> Result<Vec<LayerSpec>> {
    let sparse_step = raw.decoder_sparse_step.unwrap_or(1).max(1);
    let mlp_only = raw.mlp_only_layers.clone().unwrap_or_default();
    let use_sw = raw.use_sliding_window.unwrap_or(false);
    let layer_type =
        |i: usize| -> Option<String> { raw.layer_types.as_ref().and_then(|t| t.get(i).cloned()) };
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let ffn = match arch {
            Arch::Qwen3Moe | Arch::Qwen2Moe => {
                if !mlp_only.contains(&i) && (i + 1) % sparse_step == 0 {
                    FfnKind::Moe
                } else {
                    FfnKind::Dense
                }
            }
            Arch::DeepseekV2 | Arch::DeepseekV3 => {
                if i >= raw.first_k_dense_replace.unwrap_or(0) {
                    FfnKind::Moe
                } else {
                    FfnKind::Dense
                }
            }
            // Gemma 4 layers have a dense MLP beside the experts.
            Arch::Mixtral | Arch::Olmoe | Arch::GptOss | Arch::Gemma4 => FfnKind::Moe,
        };
        if (ffn == FfnKind::Dense || arch == Arch::Gemma4) && dims.intermediate_size == 0 {
            return Err(Error::config(
                path,
                format!("layer {i} has a dense MLP but `intermediate_size` is missing"),
            ));
        }
        let mut spec = LayerSpec {
            ffn,
            sliding_window: None,
            head_dim: dims.head_dim,
            kv_heads: dims.kv_heads,
            rope: rope.clone(),
            v_from_k: false,
        };
        spec.sliding_window = match arch {
            Arch::Mixtral => raw.sliding_window,
            Arch::Olmoe | Arch::DeepseekV2 | Arch::DeepseekV3 => None,
            Arch::Qwen3Moe => raw.sliding_window.filter(|_| use_sw),
            Arch::Qwen2Moe => {
                let sliding = match &raw.layer_types {
                    Some(t) => t.get(i).map(|s| s == "sliding_attention").unwrap_or(false),
                    None => use_sw && (i + 1) % 2 == 1 && i < raw.max_window_layers.unwrap_or(28),
                };
                raw.sliding_window.filter(|w| sliding && *w > 0 && use_sw)
            }
            Arch::GptOss => {
                // Default layer types: sliding on even layers, full on odd ones.
                let sliding = match layer_type(i) {
                    Some(t) => t == "sliding_attention",
                    None => i % 2 == 0,
                };
                if sliding {
                    Some(raw.sliding_window.unwrap_or(128))
                } else {
                    None
                }
            }
            Arch::Gemma4 => {
                // Default: five sliding layers then one full; the last is always full.
                let t = layer_type(i).unwrap_or_else(|| {
                    if (i + 1) % 6 == 0 {
                        "full_attention"
                    } else {
                        "sliding_attention"
                    }
                    .into()
                });
                let full = t == "full_attention" || i + 1 == n;
                let lt = if full {
                    "full_attention"
                } else {
                    "sliding_attention"
                };
                if full {
                    // Hub configs: global_head_dim / num_global_key_value_heads;
                    // transformers 5 writes them as per_layer_config overrides.
                    let k_eq_v = raw.attention_k_eq_v.unwrap_or(false);
                    spec.head_dim = raw.global_head_dim.unwrap_or(512);
                    if k_eq_v && let Some(kv) = raw.num_global_key_value_heads {
                        spec.kv_heads = kv;
                    }
                    spec.v_from_k = k_eq_v;
                }
                if let Some(o) = raw
                    .per_layer_config
                    .as_ref()
                    .and_then(|m| m.get(&i.to_string()))
                {
                    if let Some(hd) = o.head_dim {
                        spec.head_dim = hd;
                    }
                    if let Some(kv) = o.num_key_value_heads {
                        spec.kv_heads = kv;
                    }
                }
                if spec.head_dim == 0
                    || !spec.head_dim.is_multiple_of(2)
                    || spec.kv_heads == 0
                    || !raw
                        .num_attention_heads
                        .unwrap_or(0)
                        .is_multiple_of(spec.kv_heads)
                {
                    return Err(Error::config(
                        path,
                        format!(
                            "layer {i}: head_dim {} / key-value heads {} do not fit {} attention heads",
                            spec.head_dim,
                            spec.kv_heads,
                            raw.num_attention_heads.unwrap_or(0)
                        ),
                    ));
                }
                spec.rope = parse_rope(raw, arch, spec.head_dim, Some(lt), path)?;
                if full {
                    None
                } else {
                    Some(raw.sliding_window.unwrap_or(512))
                }
            }
        };
        spec.sliding_window = spec.sliding_window.filter(|w| *w > 0);
        out.push(spec);
    }
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(s, Path::new("config.json"))
    }

    #[test]
    fn hub_and_v5_styles_agree() -> Result<()> {
        let hub = parse(
            r#"{"model_type":"qwen3_moe","vocab_size":100,"hidden_size":64,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"moe_intermediate_size":32,
            "intermediate_size":48,"num_experts":7,"num_experts_per_tok":2,"rope_theta":5000.0,
            "torch_dtype":"bfloat16","norm_topk_prob":true}"#,
        )?;
        let v5 = parse(
            r#"{"model_type":"qwen3_moe","vocab_size":100,"hidden_size":64,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"moe_intermediate_size":32,
            "intermediate_size":48,"num_local_experts":7,"num_experts_per_tok":2,
            "rope_parameters":{"rope_theta":5000.0,"rope_type":"default"},"dtype":"bfloat16","norm_topk_prob":true}"#,
        )?;
        assert_eq!(hub.num_experts, v5.num_experts);
        assert_eq!(hub.rope, v5.rope);
        assert_eq!(hub.declared_dtype, v5.declared_dtype);
        Ok(())
    }

    #[test]
    fn unknown_architecture_is_named() {
        let err = parse(r#"{"model_type":"llama","vocab_size":10}"#)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("unsupported model_type 'llama'"), "{err}");
    }

    #[test]
    fn missing_field_is_named() {
        let err = parse(r#"{"model_type":"mixtral","vocab_size":10}"#)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("hidden_size"), "{err}");
    }

    #[test]
    fn gemma4_wrapper_and_hub_layer_dims() -> Result<()> {
        let text = r#"{"model_type":"gemma4_text","vocab_size":100,"hidden_size":32,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,"global_head_dim":16,
            "num_global_key_value_heads":1,"attention_k_eq_v":true,"intermediate_size":32,
            "enable_moe_block":true,"num_experts":4,"top_k_experts":2,"moe_intermediate_size":8,
            "hidden_size_per_layer_input":0,"sliding_window":4,
            "layer_types":["sliding_attention","full_attention"],
            "rope_parameters":{"sliding_attention":{"rope_type":"default","rope_theta":10000.0},
              "full_attention":{"rope_type":"proportional","partial_rotary_factor":0.25,"rope_theta":1000000.0}}}"#;
        let c = parse(&format!(
            r#"{{"model_type":"gemma4","text_config":{text}}}"#
        ))?;
        assert_eq!(c.weight_prefix, "model.language_model");
        assert_eq!(c.num_experts_per_tok, 2);
        let (s, f) = (&c.layers[0], &c.layers[1]);
        assert_eq!(
            (s.head_dim, s.kv_heads, s.v_from_k, s.sliding_window),
            (8, 2, false, Some(4))
        );
        assert_eq!(
            (f.head_dim, f.kv_heads, f.v_from_k, f.sliding_window),
            (16, 1, true, None)
        );
        assert_eq!(
            f.rope.scaling,
            RopeScaling::Proportional {
                factor: 1.0,
                rope_angles: 2
            }
        );
        assert_eq!(c.embed_scale, Some((32f32).sqrt()));
        Ok(())
    }

    #[test]
    fn deepseek_hub_yarn_scales_the_softmax() -> Result<()> {
        let c = parse(
            r#"{"model_type":"deepseek_v3","vocab_size":100,"hidden_size":32,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":4,"intermediate_size":32,"moe_intermediate_size":8,
            "n_routed_experts":8,"num_experts_per_tok":2,"n_group":4,"topk_group":2,"kv_lora_rank":16,
            "q_lora_rank":16,"qk_rope_head_dim":8,"qk_nope_head_dim":8,"v_head_dim":8,"first_k_dense_replace":1,
            "rope_theta":10000.0,"rope_scaling":{"type":"yarn","factor":40,"mscale":1.0,"mscale_all_dim":1.0,
            "beta_fast":32,"beta_slow":1,"original_max_position_embeddings":4096}}"#,
        )?;
        let m = c.mla.clone().expect("mla");
        let ms = 0.1 * (40f64).ln() + 1.0;
        assert!((m.softmax_scale as f64 - (16f64).powf(-0.5) * ms * ms).abs() < 1e-6);
        assert_eq!(c.rope.attention_scaling, 1.0);
        assert!(c.rope.interleaved);
        assert_eq!(c.moe_layers(), vec![1]);
        assert!(matches!(
            c.router,
            RouterKind::GroupedSigmoid {
                n_group: 4,
                topk_group: 2,
                normalize: true,
                ..
            }
        ));
        Ok(())
    }

    #[test]
    fn sparse_step_and_mlp_only_layers() -> Result<()> {
        let c = parse(
            r#"{"model_type":"qwen3_moe","vocab_size":100,"hidden_size":64,"num_hidden_layers":4,
            "num_attention_heads":4,"moe_intermediate_size":32,"intermediate_size":48,
            "num_experts":7,"num_experts_per_tok":2,"decoder_sparse_step":2,"mlp_only_layers":[3]}"#,
        )?;
        assert_eq!(c.moe_layers(), vec![1]);
        Ok(())
    }
}

/// Checks a `quantization_config`: `compressed-tensors` is accepted only in
/// the scheme epserve loads (what llm-compressor writes for W8A8 INT8, e.g.
/// RedHatAI's Qwen3-30B-A3B-quantized.w8a8): format `int-quantized`, weights
/// 8-bit symmetric int per output channel, input activations absent or 8-bit
/// int dynamic per token. Int8 weights become the int8 packed experts as they
/// are; other int8 layers (attention, dense MLPs) are dequantized at load.
/// Other quantization methods are left to the loaders that know them (GPT-OSS
/// `mxfp4`); the message says what is not supported.
pub fn check_quantization(q: &serde_json::Value) -> std::result::Result<(), String> {
    use serde_json::Value;
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
    if method != "compressed-tensors" {
        return Ok(());
    }
    let format = q.get("format").and_then(Value::as_str).unwrap_or("");
    if format != "int-quantized" {
        return Err(format!(
            "quantization_config: compressed-tensors format '{format}' is not supported \
             (only 'int-quantized': int8 W8A8)"
        ));
    }
    let groups = q
        .get("config_groups")
        .and_then(Value::as_object)
        .filter(|g| !g.is_empty())
        .ok_or("quantization_config: compressed-tensors without config_groups")?;
    for (name, g) in groups {
        let field = |a: &Value, k: &str| a.get(k).cloned().unwrap_or(Value::Null);
        let w = g.get("weights").filter(|w| !w.is_null()).ok_or_else(|| {
            format!("quantization_config.config_groups.{name}: no `weights` scheme")
        })?;
        let ok_w = field(w, "type") == "int"
            && field(w, "num_bits") == 8
            && field(w, "symmetric") == true
            && field(w, "strategy") == "channel"
            && field(w, "group_size").is_null();
        if !ok_w {
            return Err(format!(
                "quantization_config.config_groups.{name}.weights: only 8-bit symmetric int \
                 per-channel weights are supported, got {w}"
            ));
        }
        if let Some(a) = g.get("input_activations").filter(|a| !a.is_null()) {
            let ok_a = field(a, "type") == "int"
                && field(a, "num_bits") == 8
                && field(a, "dynamic") == true
                && field(a, "strategy") == "token";
            if !ok_a {
                return Err(format!(
                    "quantization_config.config_groups.{name}.input_activations: only dynamic \
                     per-token 8-bit int activations are supported, got {a}"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod quantization_tests {
    use super::check_quantization;

    #[test]
    fn compressed_tensors_w8a8_is_accepted_and_others_refused() {
        let mut q = serde_json::json!({
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "config_groups": {"group_0": {
                "weights": {"type": "int", "num_bits": 8, "symmetric": true,
                            "strategy": "channel", "group_size": null},
                "input_activations": {"type": "int", "num_bits": 8, "symmetric": true,
                                      "dynamic": true, "strategy": "token"}
            }}
        });
        assert_eq!(check_quantization(&q), Ok(()));
        q["config_groups"]["group_0"]["weights"]["num_bits"] = 4.into();
        assert!(check_quantization(&q).is_err_and(|m| m.contains("8-bit")));
        q["config_groups"]["group_0"]["weights"]["num_bits"] = 8.into();
        q["config_groups"]["group_0"]["input_activations"]["dynamic"] = false.into();
        assert!(check_quantization(&q).is_err_and(|m| m.contains("dynamic")));
        q["format"] = "float-quantized".into();
        assert!(check_quantization(&q).is_err_and(|m| m.contains("float-quantized")));
        assert_eq!(
            check_quantization(&serde_json::json!({"quant_method": "mxfp4"})),
            Ok(())
        );
    }
}
