//! The checks [`ModelConfig::from_raw`](super::ModelConfig::from_raw) runs on
//! every architecture's [`Family`]: required fields, attention shape (key/value
//! heads, head size, MLA dimensions), expert count, top-k and MLP widths, and
//! the expert groups of a grouped router.

use std::path::Path;

use super::arch::{Family, Shared, Widths};
use super::raw::RawConfig;
use super::{MlaConfig, RouterKind};
use crate::error::{Error, Result};

/// `v`, which must be present and positive, named `name` in the error.
pub(super) fn need(path: &Path, v: Option<usize>, name: &str) -> Result<usize> {
    match v {
        Some(0) => Err(Error::config(path, format!("`{name}` must be positive"))),
        Some(x) => Ok(x),
        None => Err(Error::config(path, format!("missing field `{name}`"))),
    }
}

/// Key/value heads, head size and (DeepSeek) MLA dimensions, checked.
pub(super) struct AttentionShape {
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// `softmax_scale` is 0 until the RoPE parameters are known.
    pub mla: Option<MlaConfig>,
}

/// The attention shape of a model of `hidden_size` with `heads` query heads.
pub(super) fn attention_shape(
    raw: &RawConfig,
    fam: &Family,
    hidden_size: usize,
    num_attention_heads: usize,
    path: &Path,
) -> Result<AttentionShape> {
    // MLA has no key/value heads of its own: every head reads the latent.
    let num_key_value_heads = if fam.mla {
        num_attention_heads
    } else {
        raw.num_key_value_heads.unwrap_or(num_attention_heads)
    };
    if num_key_value_heads == 0 || !num_attention_heads.is_multiple_of(num_key_value_heads) {
        return Err(Error::config(
            path,
            format!(
                "num_attention_heads ({num_attention_heads}) is not a multiple of num_key_value_heads ({num_key_value_heads})"
            ),
        ));
    }
    let mla = if fam.mla {
        let kv_lora_rank = need(path, raw.kv_lora_rank, "kv_lora_rank")?;
        let qk_rope_head_dim = need(path, raw.qk_rope_head_dim, "qk_rope_head_dim")?;
        let qk_nope_head_dim = need(path, raw.qk_nope_head_dim, "qk_nope_head_dim")?;
        let v_head_dim = need(path, raw.v_head_dim, "v_head_dim")?;
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
            if !hidden_size.is_multiple_of(num_attention_heads) {
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
    Ok(AttentionShape {
        num_key_value_heads,
        head_dim,
        mla,
    })
}

/// Expert count, top-k and MLP widths, checked.
pub(super) struct ExpertShape {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: Option<usize>,
}

/// The expert shape the family reads from the config.
pub(super) fn expert_shape(raw: &RawConfig, fam: &Family, path: &Path) -> Result<ExpertShape> {
    let num_experts = fam
        .num_experts
        .ok_or_else(|| Error::config(path, "missing field `num_experts` / `num_local_experts`"))?;
    let (per_tok, per_tok_name) = fam.experts_per_tok;
    let num_experts_per_tok = need(path, per_tok, per_tok_name)?;
    if num_experts == 0 || num_experts_per_tok > num_experts {
        return Err(Error::config(
            path,
            format!(
                "num_experts_per_tok ({num_experts_per_tok}) must be between 1 and the expert count ({num_experts})"
            ),
        ));
    }
    let (intermediate_size, moe_intermediate_size) = match fam.widths {
        Widths::Shared => {
            let i = need(path, raw.intermediate_size, "intermediate_size")?;
            (i, i)
        }
        Widths::ExpertOnly => (
            raw.intermediate_size.unwrap_or(0),
            need(path, raw.moe_intermediate_size, "moe_intermediate_size")?,
        ),
        Widths::Separate => (
            need(path, raw.intermediate_size, "intermediate_size")?,
            need(path, raw.moe_intermediate_size, "moe_intermediate_size")?,
        ),
    };
    let shared_expert_intermediate_size = match fam.shared {
        Shared::None => None,
        Shared::Width(w) => Some(need(path, w, "shared_expert_intermediate_size")?),
        Shared::Experts(n) => (n > 0).then_some(moe_intermediate_size * n),
    };
    Ok(ExpertShape {
        num_experts,
        num_experts_per_tok,
        intermediate_size,
        moe_intermediate_size,
        shared_expert_intermediate_size,
    })
}

/// A grouped router's groups must split the experts evenly and leave room for
/// the top-k (DeepSeek); DeepSeek-V2 knows two `topk_method`s.
pub(super) fn check_router(
    raw: &RawConfig,
    router: RouterKind,
    experts: &ExpertShape,
    path: &Path,
) -> Result<()> {
    let (n_group, topk_group, v3) = match router {
        RouterKind::GroupedSoftmax {
            n_group,
            topk_group,
            ..
        } => (n_group, topk_group, false),
        RouterKind::GroupedSigmoid {
            n_group,
            topk_group,
            ..
        } => (n_group, topk_group, true),
        _ => return Ok(()),
    };
    let (num_experts, num_experts_per_tok) = (experts.num_experts, experts.num_experts_per_tok);
    let per_group = num_experts / n_group;
    if num_experts % n_group != 0 || topk_group > n_group {
        return Err(Error::config(
            path,
            format!(
                "n_group ({n_group}) must divide n_routed_experts ({num_experts}) and be at least topk_group ({topk_group})"
            ),
        ));
    }
    if v3 && per_group < 2 {
        return Err(Error::config(
            path,
            format!("deepseek_v3 needs at least 2 experts per group (n_group {n_group})"),
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
    if !v3
        && let Some(m) = raw.topk_method.as_deref()
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
    Ok(())
}
