//! Per-layer settings: which decoder layers have experts, each layer's
//! sliding window, and Gemma 4's per-type layers (full-attention layers with
//! their own head size, key/value heads and RoPE).

use std::path::Path;

use super::arch::Family;
use super::raw::RawConfig;
use super::rope::{RopeDefaults, parse_rope};
use super::{FfnKind, LayerSpec, RopeConfig};
use crate::error::{Error, Result};

/// Global attention sizes, overridden per layer where the config says so.
pub(super) struct LayerDims {
    pub head_dim: usize,
    pub kv_heads: usize,
    pub intermediate_size: usize,
}

/// The [`LayerSpec`] of each of the `n` decoder layers.
pub(super) fn layer_specs(
    raw: &RawConfig,
    fam: &Family,
    n: usize,
    dims: &LayerDims,
    rope: &RopeConfig,
    path: &Path,
) -> Result<Vec<LayerSpec>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let ffn = if fam.moe_layers.has_experts(i) {
            FfnKind::Moe
        } else {
            FfnKind::Dense
        };
        if ffn == FfnKind::Dense && dims.intermediate_size == 0 {
            return Err(Error::config(
                path,
                format!("layer {i} has a dense MLP but `intermediate_size` is missing"),
            ));
        }
        let mut spec = LayerSpec {
            ffn,
            sliding_window: (fam.window)(raw, i, n),
            head_dim: dims.head_dim,
            kv_heads: dims.kv_heads,
            rope: rope.clone(),
            v_from_k: false,
        };
        if fam.per_type_layers {
            per_type_layer(raw, i, &mut spec, fam.rope, path)?;
        }
        spec.sliding_window = spec.sliding_window.filter(|w| *w > 0);
        out.push(spec);
    }
    Ok(out)
}

/// Gemma 4: a full-attention layer (no window) takes the global head size and
/// key/value heads, per-layer overrides apply, and every layer gets the RoPE
/// of its type.
fn per_type_layer(
    raw: &RawConfig,
    i: usize,
    spec: &mut LayerSpec,
    rope: RopeDefaults,
    path: &Path,
) -> Result<()> {
    let full = spec.sliding_window.is_none();
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
    spec.rope = parse_rope(raw, rope, spec.head_dim, Some(lt), path)?;
    Ok(())
}
