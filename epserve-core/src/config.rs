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
}

impl Arch {
    /// All supported `model_type` strings.
    pub const SUPPORTED: &'static [&'static str] = &["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"];

    fn from_model_type(s: &str) -> Option<Self> {
        Some(match s {
            "qwen3_moe" => Arch::Qwen3Moe,
            "qwen2_moe" => Arch::Qwen2Moe,
            "mixtral" => Arch::Mixtral,
            "olmoe" => Arch::Olmoe,
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
    pub rope_parameters: Option<RawRope>,
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
}

/// Normalized RoPE settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// Number of leading dimensions of each head that rotate.
    pub rotary_dim: usize,
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    Gelu,
    GeluTanh,
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
        let arch = Arch::from_model_type(&raw.model_type).ok_or_else(|| {
            Error::UnsupportedArchitecture {
                path: path.to_path_buf(),
                model_type: raw.model_type.clone(),
                supported: Arch::SUPPORTED.join(", "),
            }
        })?;
        let need = |v: Option<usize>, name: &str| -> Result<usize> {
            match v {
                Some(0) => Err(Error::config(path, format!("`{name}` must be positive"))),
                Some(x) => Ok(x),
                None => Err(Error::config(path, format!("missing field `{name}`"))),
            }
        };
        let vocab_size = need(raw.vocab_size, "vocab_size")?;
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let num_hidden_layers = need(raw.num_hidden_layers, "num_hidden_layers")?;
        let num_attention_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        let num_key_value_heads = raw.num_key_value_heads.unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(Error::config(
                path,
                format!(
                    "num_attention_heads ({num_attention_heads}) is not a multiple of num_key_value_heads ({num_key_value_heads})"
                ),
            ));
        }
        let head_dim = match raw.head_dim {
            Some(h) => h,
            None => {
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

        let num_experts = raw.num_local_experts.or(raw.num_experts).ok_or_else(|| {
            Error::config(path, "missing field `num_experts` / `num_local_experts`")
        })?;
        let num_experts_per_tok = need(raw.num_experts_per_tok, "num_experts_per_tok")?;
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
            Arch::Mixtral | Arch::Olmoe => {
                let i = need(raw.intermediate_size, "intermediate_size")?;
                (i, i)
            }
            Arch::Qwen3Moe | Arch::Qwen2Moe => (
                raw.intermediate_size.unwrap_or(0),
                need(raw.moe_intermediate_size, "moe_intermediate_size")?,
            ),
        };
        let norm_topk_prob = match arch {
            Arch::Mixtral => true,
            _ => raw.norm_topk_prob.unwrap_or(false),
        };
        let shared_expert_intermediate_size = match arch {
            Arch::Qwen2Moe => Some(need(
                raw.shared_expert_intermediate_size,
                "shared_expert_intermediate_size",
            )?),
            _ => None,
        };

        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(match arch {
            Arch::Mixtral | Arch::Olmoe => 1e-5,
            Arch::Qwen3Moe | Arch::Qwen2Moe => 1e-6,
        }) as f32;

        let rope = parse_rope(&raw, arch, head_dim, path)?;

        let (qkv_bias, o_bias) = match arch {
            Arch::Qwen2Moe => (raw.qkv_bias.unwrap_or(true), false),
            Arch::Mixtral => (false, false),
            Arch::Qwen3Moe | Arch::Olmoe => {
                let b = raw.attention_bias.unwrap_or(false);
                (b, b)
            }
        };
        let qk_norm = match arch {
            Arch::Qwen3Moe => QkNorm::PerHead,
            Arch::Olmoe => QkNorm::Full,
            _ => QkNorm::None,
        };
        let clip_qkv = match arch {
            Arch::Olmoe => raw.clip_qkv.map(|c| c as f32),
            _ => None,
        };
        let act_name = raw.hidden_act.clone().unwrap_or_else(|| "silu".into());
        let activation = Activation::parse(&act_name)
            .ok_or_else(|| Error::config(path, format!("unsupported hidden_act '{act_name}'")))?;

        let layers = layer_specs(&raw, arch, num_hidden_layers, intermediate_size, path)?;

        let default_eos: Option<Vec<u32>> = match arch {
            Arch::Mixtral => Some(vec![2]),
            Arch::Olmoe => Some(vec![50279]),
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
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
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

fn parse_rope(raw: &RawConfig, arch: Arch, head_dim: usize, path: &Path) -> Result<RopeConfig> {
    let default_theta = match arch {
        Arch::Mixtral => 1e6,
        _ => 10000.0,
    };
    // transformers 5 writes `rope_parameters` (with the theta inside); the hub
    // writes `rope_theta` plus an optional `rope_scaling`.
    let params = raw.rope_parameters.clone().or(raw.rope_scaling.clone());
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
    let scaling = match kind.as_str() {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: p.low_freq_factor.unwrap_or(1.0),
            high_freq_factor: p.high_freq_factor.unwrap_or(4.0),
            original_max_position_embeddings: p.original_max_position_embeddings.unwrap_or(8192),
        },
        other => {
            return Err(Error::config(
                path,
                format!("unsupported rope type '{other}' (supported: default, linear, llama3)"),
            ));
        }
    };
    let rotary_dim = match p.partial_rotary_factor {
        Some(f) => ((head_dim as f64 * f) as usize) & !1,
        None => head_dim,
    };
    Ok(RopeConfig {
        theta,
        scaling,
        rotary_dim,
    })
}

fn layer_specs(
    raw: &RawConfig,
    arch: Arch,
    n: usize,
    intermediate_size: usize,
    path: &Path,
) -> Result<Vec<LayerSpec>> {
    let sparse_step = raw.decoder_sparse_step.unwrap_or(1).max(1);
    let mlp_only = raw.mlp_only_layers.clone().unwrap_or_default();
    let use_sw = raw.use_sliding_window.unwrap_or(false);
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
            Arch::Mixtral | Arch::Olmoe => FfnKind::Moe,
        };
        if ffn == FfnKind::Dense && intermediate_size == 0 {
            return Err(Error::config(
                path,
                format!("layer {i} is dense but `intermediate_size` is missing"),
            ));
        }
        let sliding_window = match arch {
            Arch::Mixtral => raw.sliding_window,
            Arch::Olmoe => None,
            Arch::Qwen3Moe => raw.sliding_window.filter(|_| use_sw),
            Arch::Qwen2Moe => {
                let sliding = match &raw.layer_types {
                    Some(t) => t.get(i).map(|s| s == "sliding_attention").unwrap_or(false),
                    None => use_sw && (i + 1) % 2 == 1 && i < raw.max_window_layers.unwrap_or(28),
                };
                raw.sliding_window.filter(|w| sliding && *w > 0 && use_sw)
            }
        };
        out.push(LayerSpec {
            ffn,
            sliding_window: sliding_window.filter(|w| *w > 0),
        });
    }
    Ok(out)
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
