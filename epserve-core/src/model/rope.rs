//! Rotary position embeddings, computed as transformers does: inverse
//! frequencies in f32, `cos`/`sin` of `position · inv_freq` in f32, and the
//! "rotate half" pairing (dimension i with i + rotary_dim/2).

use crate::config::{RopeConfig, RopeScaling};

/// Precomputed inverse frequencies for one head size.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    rotary_dim: usize,
}

impl Rope {
    /// Builds the frequency table for a model's RoPE settings.
    pub fn new(cfg: &RopeConfig) -> Self {
        let d = cfg.rotary_dim;
        let base = cfg.theta as f32;
        let mut inv_freq: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
            .collect();
        match &cfg.scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } => {
                for f in &mut inv_freq {
                    *f /= *factor as f32;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = *original_max_position_embeddings as f32;
                let (factor, lf, hf) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                );
                let low_wavelen = old / lf;
                let high_wavelen = old / hf;
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - lf) / (hf - lf);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        Rope {
            inv_freq,
            rotary_dim: d,
        }
    }

    /// Writes `cos` and `sin` (each `rotary_dim / 2` long) for a position.
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f32;
        for (i, f) in self.inv_freq.iter().enumerate() {
            let a = p * f;
            cos[i] = a.cos();
            sin[i] = a.sin();
        }
    }

    /// Rotates every head in `x` (`heads × head_dim`) in place.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = self.rotary_dim / 2;
        for head in x.chunks_mut(head_dim) {
            for i in 0..half {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos[i] - b * sin[i];
                head[i + half] = b * cos[i] + a * sin[i];
            }
        }
    }

    /// Half the rotary dimension (length of the cos/sin tables).
    pub fn half(&self) -> usize {
        self.rotary_dim / 2
    }
}
