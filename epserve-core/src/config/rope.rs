//! RoPE from `config.json`: picking the parameter set (hub `rope_scaling` or
//! transformers-5 `rope_parameters`, per layer type for Gemma 4), the
//! frequency schemes (default, linear, llama3, YaRN, proportional) as
//! transformers computes them, and DeepSeek's YaRN-scaled attention scale.

use std::path::Path;

use super::raw::{RawConfig, RawRope, RopeParams};
use super::{MlaConfig, RopeConfig, RopeScaling};
use crate::error::{Error, Result};

/// What an architecture's config class assumes when the file is silent.
#[derive(Debug, Clone, Copy)]
pub(super) struct RopeDefaults {
    /// `rope_theta` when none is given.
    pub theta: f64,
    /// Rotate adjacent pairs (DeepSeek's interleaved RoPE).
    pub interleaved: bool,
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
pub(super) fn mla_softmax_scale(raw: &RawConfig, m: &MlaConfig) -> f32 {
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

/// The normalized RoPE of a head of `head_dim` (of the layers of type
/// `layer_type`, or the model's only set).
pub(super) fn parse_rope(
    raw: &RawConfig,
    defaults: RopeDefaults,
    head_dim: usize,
    layer_type: Option<&str>,
    path: &Path,
) -> Result<RopeConfig> {
    let default_theta = defaults.theta;
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
    let interleaved = defaults.interleaved;
    Ok(RopeConfig {
        theta,
        scaling,
        rotary_dim,
        interleaved,
        attention_scaling,
    })
}
