//! One function per architecture: what its transformers config class makes of
//! the raw `config.json` fields (which name holds the expert count, the
//! class's defaults, the choices it fixes: router, norms, biases, activation,
//! which layers have experts and which slide). Nothing here fails:
//! [`ModelConfig::from_raw`](super::ModelConfig::from_raw) validates a
//! [`Family`] the same way, in the same order, for every architecture.

use super::raw::RawConfig;
use super::rope::RopeDefaults;
use super::{Activation, Arch, QkNorm, RouterKind};

/// Where the dense and the expert MLP widths come from.
#[derive(Debug, Clone, Copy)]
pub(super) enum Widths {
    /// One `intermediate_size` for both.
    Shared,
    /// `intermediate_size` and `moe_intermediate_size`, both required.
    Separate,
    /// `moe_intermediate_size` required; the dense `intermediate_size` is
    /// optional (0 when absent: no dense layer may then exist).
    ExpertOnly,
}

/// The shared expert(s) of each MoE layer.
#[derive(Debug, Clone, Copy)]
pub(super) enum Shared {
    None,
    /// One shared expert of this width (`shared_expert_intermediate_size`, required).
    Width(Option<usize>),
    /// `n` shared experts of the expert width, run as one (none when 0).
    Experts(usize),
}

/// Which decoder layers have experts: layer `i` does when
/// `i >= first_dense`, `(i + 1) % step == 0` and `i` is not in `mlp_only`.
#[derive(Debug, Clone)]
pub(super) struct MoeLayers {
    pub first_dense: usize,
    pub step: usize,
    pub mlp_only: Vec<usize>,
}

impl MoeLayers {
    /// Whether layer `i` has experts (else a dense MLP).
    pub fn has_experts(&self, i: usize) -> bool {
        i >= self.first_dense && (i + 1).is_multiple_of(self.step) && !self.mlp_only.contains(&i)
    }
}

/// One architecture's reading of a raw config, before validation.
pub(super) struct Family {
    /// Multi-head latent attention: every head reads the latent, so there are
    /// as many key/value heads as attention heads.
    pub mla: bool,
    /// Why this variant of the architecture is not supported, if it is not.
    pub unsupported: Option<&'static str>,
    pub num_experts: Option<usize>,
    /// Experts per token, and the field named when it is missing.
    pub experts_per_tok: (Option<usize>, &'static str),
    pub widths: Widths,
    pub norm_topk_prob: bool,
    pub shared: Shared,
    pub router: RouterKind,
    pub rms_norm_eps: f64,
    pub rope: RopeDefaults,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub qk_norm: QkNorm,
    pub clip_qkv: Option<f32>,
    /// The activation, or the name that is not one.
    pub activation: Result<Activation, String>,
    /// End-of-sequence ids when the config names none.
    pub eos_default: Option<Vec<u32>>,
    pub tie_word_embeddings: bool,
    pub expert_bias: bool,
    pub mlp_bias: bool,
    pub attn_sinks: bool,
    pub v_norm: bool,
    pub attention_scale: Option<f32>,
    pub embed_scale: Option<f32>,
    pub final_logit_softcapping: Option<f32>,
    pub moe_layers: MoeLayers,
    /// The sliding window of layer `i` of `n` (`None`: full attention).
    pub window: fn(&RawConfig, usize, usize) -> Option<usize>,
    /// Full-attention layers take the global head size and key/value heads,
    /// and each layer type its own RoPE (Gemma 4).
    pub per_type_layers: bool,
}

/// The reading of `raw` as `arch`.
pub(super) fn family(arch: Arch, raw: &RawConfig) -> Family {
    match arch {
        Arch::Qwen3Moe => qwen3_moe(raw),
        Arch::Qwen2Moe => qwen2_moe(raw),
        Arch::Mixtral => mixtral(raw),
        Arch::Olmoe => olmoe(raw),
        Arch::GptOss => gpt_oss(raw),
        Arch::Gemma4 => gemma4(raw),
        Arch::DeepseekV2 => deepseek_v2(raw),
        Arch::DeepseekV3 => deepseek_v3(raw),
    }
}

impl Family {
    /// What most classes share: a softmax top-k router renormalized when
    /// `norm_topk_prob`, SiLU, RMSNorm eps 1e-6, theta 10000, attention
    /// biases as `attention_bias` says (off), every layer with experts, no
    /// sliding window.
    fn base(raw: &RawConfig, norm_topk_prob: bool) -> Family {
        let attention_bias = raw.attention_bias.unwrap_or(false);
        Family {
            mla: false,
            unsupported: None,
            num_experts: raw.num_local_experts.or(raw.num_experts),
            experts_per_tok: (raw.num_experts_per_tok, "num_experts_per_tok"),
            widths: Widths::Shared,
            norm_topk_prob,
            shared: Shared::None,
            router: RouterKind::SoftmaxTopK {
                normalize: norm_topk_prob,
            },
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope: RopeDefaults {
                theta: 10000.0,
                interleaved: false,
            },
            qkv_bias: attention_bias,
            o_bias: attention_bias,
            qk_norm: QkNorm::None,
            clip_qkv: None,
            activation: activation(raw.hidden_act.clone().unwrap_or_else(|| "silu".into())),
            eos_default: None,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            expert_bias: false,
            mlp_bias: false,
            attn_sinks: false,
            v_norm: false,
            attention_scale: None,
            embed_scale: None,
            final_logit_softcapping: None,
            moe_layers: MoeLayers {
                first_dense: 0,
                step: 1,
                mlp_only: Vec::new(),
            },
            window: |_, _, _| None,
            per_type_layers: false,
        }
    }
}

/// The activation called `name`, or the name.
fn activation(name: String) -> Result<Activation, String> {
    Activation::parse(&name).ok_or(name)
}

/// Qwen's sparse layers: every `decoder_sparse_step`-th layer, except `mlp_only_layers`.
fn qwen_moe_layers(raw: &RawConfig) -> MoeLayers {
    MoeLayers {
        first_dense: 0,
        step: raw.decoder_sparse_step.unwrap_or(1).max(1),
        mlp_only: raw.mlp_only_layers.clone().unwrap_or_default(),
    }
}

/// DeepSeek: the first `first_k_dense_replace` layers are dense.
fn deepseek_moe_layers(raw: &RawConfig) -> MoeLayers {
    MoeLayers {
        first_dense: raw.first_k_dense_replace.unwrap_or(0),
        step: 1,
        mlp_only: Vec::new(),
    }
}

/// DeepSeek's expert groups `(n_group, topk_group)`; one group when not grouped.
fn deepseek_groups(raw: &RawConfig, grouped: bool) -> (usize, usize) {
    if grouped {
        let g = raw.n_group.unwrap_or(1).max(1);
        (g, raw.topk_group.unwrap_or(g).max(1))
    } else {
        (1, 1)
    }
}

/// `Qwen3MoeConfig`: per-head q/k norms; a window on every layer only with
/// `use_sliding_window`.
fn qwen3_moe(raw: &RawConfig) -> Family {
    Family {
        widths: Widths::ExpertOnly,
        qk_norm: QkNorm::PerHead,
        moe_layers: qwen_moe_layers(raw),
        window: |raw, _, _| {
            raw.sliding_window
                .filter(|_| raw.use_sliding_window.unwrap_or(false))
        },
        ..Family::base(raw, raw.norm_topk_prob.unwrap_or(false))
    }
}

/// `Qwen2MoeConfig`: a gated shared expert, q/k/v biases; windows on the
/// layers `layer_types` marks sliding, or else on the first
/// `max_window_layers` odd-numbered ones, only with `use_sliding_window`.
fn qwen2_moe(raw: &RawConfig) -> Family {
    Family {
        widths: Widths::ExpertOnly,
        shared: Shared::Width(raw.shared_expert_intermediate_size),
        qkv_bias: raw.qkv_bias.unwrap_or(true),
        o_bias: false,
        moe_layers: qwen_moe_layers(raw),
        window: |raw, i, _| {
            let use_sw = raw.use_sliding_window.unwrap_or(false);
            let sliding = match &raw.layer_types {
                Some(t) => t.get(i).map(|s| s == "sliding_attention").unwrap_or(false),
                None => use_sw && (i + 1) % 2 == 1 && i < raw.max_window_layers.unwrap_or(28),
            };
            raw.sliding_window.filter(|w| sliding && *w > 0 && use_sw)
        },
        ..Family::base(raw, raw.norm_topk_prob.unwrap_or(false))
    }
}

/// `MixtralConfig`: renormalized top-k, theta 1e6, eps 1e-5, no biases, a
/// window on every layer when `sliding_window` is set.
fn mixtral(raw: &RawConfig) -> Family {
    Family {
        rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-5),
        rope: RopeDefaults {
            theta: 1e6,
            interleaved: false,
        },
        qkv_bias: false,
        o_bias: false,
        eos_default: Some(vec![2]),
        window: |raw, _, _| raw.sliding_window,
        ..Family::base(raw, true)
    }
}

/// `OlmoeConfig`: q/k norms over the whole projection, optional `clip_qkv`,
/// eps 1e-5.
fn olmoe(raw: &RawConfig) -> Family {
    Family {
        rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-5),
        qk_norm: QkNorm::Full,
        clip_qkv: raw.clip_qkv.map(|c| c as f32),
        eos_default: Some(vec![50279]),
        ..Family::base(raw, raw.norm_topk_prob.unwrap_or(false))
    }
}

/// `GptOssConfig`: router with a bias, softmax over the top k; experts with
/// biases and the clamped SwiGLU; attention biases and sinks; sliding and
/// full layers alternating (window 128) unless `layer_types` says otherwise.
fn gpt_oss(raw: &RawConfig) -> Family {
    let attention_bias = raw.attention_bias.unwrap_or(true);
    Family {
        experts_per_tok: (
            raw.num_experts_per_tok.or(raw.experts_per_token),
            "num_experts_per_tok",
        ),
        router: RouterKind::TopKSoftmax,
        rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-5),
        rope: RopeDefaults {
            theta: 150000.0,
            interleaved: false,
        },
        qkv_bias: attention_bias,
        o_bias: attention_bias,
        activation: Ok(Activation::SwigluOai {
            alpha: raw.swiglu_alpha.unwrap_or(1.702) as f32,
            limit: raw.swiglu_limit.unwrap_or(7.0) as f32,
        }),
        expert_bias: true,
        attn_sinks: true,
        window: |raw, i, _| {
            // Default layer types: sliding on even layers, full on odd ones.
            let sliding = match raw.layer_types.as_ref().and_then(|t| t.get(i)) {
                Some(t) => t == "sliding_attention",
                None => i % 2 == 0,
            };
            sliding.then(|| raw.sliding_window.unwrap_or(128))
        },
        ..Family::base(raw, true)
    }
}

/// `Gemma4TextConfig` (MoE variant only): a scaled router, a dense MLP beside
/// the experts, GELU-tanh, per-head q/k norms and an unweighted v norm,
/// attention scale 1, embeddings times `sqrt(hidden_size)`, tied embeddings;
/// five sliding layers (window 512) then one full, the last always full.
fn gemma4(raw: &RawConfig) -> Family {
    let act = raw.hidden_activation.clone().or(raw.hidden_act.clone());
    Family {
        unsupported: gemma4_unsupported(raw),
        experts_per_tok: (
            raw.top_k_experts.or(raw.num_experts_per_tok),
            "top_k_experts",
        ),
        widths: Widths::Separate,
        router: RouterKind::ScaledSoftmax,
        qk_norm: QkNorm::PerHead,
        activation: activation(act.unwrap_or_else(|| "gelu_pytorch_tanh".into())),
        eos_default: Some(vec![1]),
        tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(true),
        v_norm: true,
        attention_scale: Some(1.0),
        embed_scale: raw.hidden_size.map(|h| (h as f32).sqrt()),
        final_logit_softcapping: raw.final_logit_softcapping.map(|c| c as f32),
        window: |raw, i, n| {
            let t = raw.layer_types.as_ref().and_then(|t| t.get(i).cloned());
            let t = t.unwrap_or_else(|| {
                if (i + 1) % 6 == 0 {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
                .into()
            });
            let full = t == "full_attention" || i + 1 == n;
            (!full).then(|| raw.sliding_window.unwrap_or(512))
        },
        per_type_layers: true,
        ..Family::base(raw, true)
    }
}

/// The Gemma 4 variants epserve does not implement, first one found.
fn gemma4_unsupported(raw: &RawConfig) -> Option<&'static str> {
    if raw.enable_moe_block != Some(true) {
        Some("gemma4: only the MoE variant (`enable_moe_block: true`) is supported")
    } else if raw.hidden_size_per_layer_input.unwrap_or(0) > 0 {
        Some(
            "gemma4: per-layer input embeddings (`hidden_size_per_layer_input` > 0) are not supported",
        )
    } else if raw.num_kv_shared_layers.unwrap_or(0) > 0 {
        Some("gemma4: KV sharing across layers (`num_kv_shared_layers` > 0) is not supported")
    } else if raw.use_bidirectional_attention.as_deref() == Some("all") {
        Some(
            "gemma4: bidirectional attention (`use_bidirectional_attention: all`) is not supported",
        )
    } else {
        None
    }
}

/// `DeepseekV2Config`: MLA, interleaved RoPE, two shared experts, softmax
/// routing limited to the best `topk_group` groups with
/// `group_limited_greedy` (else one group), optional MLP biases, the first
/// `first_k_dense_replace` layers dense.
fn deepseek_v2(raw: &RawConfig) -> Family {
    let grouped = raw.topk_method.as_deref() == Some("group_limited_greedy");
    let (n_group, topk_group) = deepseek_groups(raw, grouped);
    Family {
        mla: true,
        num_experts: raw.n_routed_experts.or(raw.num_local_experts),
        widths: Widths::Separate,
        shared: Shared::Experts(raw.n_shared_experts.unwrap_or(2)),
        router: RouterKind::GroupedSoftmax {
            n_group,
            topk_group,
            scaling: raw.routed_scaling_factor.unwrap_or(1.0) as f32,
        },
        rope: RopeDefaults {
            theta: 10000.0,
            interleaved: true,
        },
        qkv_bias: false,
        o_bias: false,
        eos_default: Some(vec![2]),
        mlp_bias: raw.mlp_bias.unwrap_or(false),
        moe_layers: deepseek_moe_layers(raw),
        ..Family::base(raw, false)
    }
}

/// `DeepseekV3Config`: MLA, RoPE interleaved unless `rope_interleave` is
/// false, one shared expert, sigmoid routing over groups with the score
/// correction bias, weights renormalized and scaled by 2.5 by default, the
/// first `first_k_dense_replace` layers dense.
fn deepseek_v3(raw: &RawConfig) -> Family {
    let norm_topk_prob = raw.norm_topk_prob.unwrap_or(true);
    let (n_group, topk_group) = deepseek_groups(raw, true);
    Family {
        mla: true,
        num_experts: raw.n_routed_experts.or(raw.num_local_experts),
        widths: Widths::Separate,
        shared: Shared::Experts(raw.n_shared_experts.unwrap_or(1)),
        router: RouterKind::GroupedSigmoid {
            n_group,
            topk_group,
            normalize: norm_topk_prob,
            scaling: raw.routed_scaling_factor.unwrap_or(2.5) as f32,
        },
        rope: RopeDefaults {
            theta: 10000.0,
            interleaved: raw.rope_interleave.unwrap_or(true),
        },
        qkv_bias: false,
        o_bias: false,
        eos_default: Some(vec![1]),
        moe_layers: deepseek_moe_layers(raw),
        ..Family::base(raw, norm_topk_prob)
    }
}
