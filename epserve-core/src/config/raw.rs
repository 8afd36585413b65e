//! `config.json` field by field, as Hugging Face writes it: [`RawConfig`]
//! mirrors the file (both the hub names and the transformers-5 names), with
//! the nested RoPE parameters and per-layer overrides. Nothing is defaulted or
//! checked here; [`ModelConfig::from_raw`](super::ModelConfig::from_raw) does that.

use serde::Deserialize;

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
    /// (checked by [`check_quantization`](super::quant::check_quantization))
    /// or `mxfp4` (GPT-OSS experts).
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
