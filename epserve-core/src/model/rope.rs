//! Rotary position embeddings, computed as transformers does: inverse
//! frequencies in f32 (default, linear, llama3, YaRN, Gemma 4's proportional),
//! `cos`/`sin` of `position · inv_freq` in f32 times the attention scaling
//! (YaRN), and either the "rotate half" pairing (dimension i with
//! i + rotary_dim/2) or DeepSeek's interleaved pairs (2i, 2i+1).

use crate::config::{RopeConfig, RopeScaling};

/// Precomputed inverse frequencies for one head size.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    rotary_dim: usize,
    interleaved: bool,
    attention_scaling: f32,
}

impl Rope {
    /// Builds the frequency table for a model's RoPE settings.
    pub fn new(cfg: &RopeConfig) -> Self {
        let d = cfg.rotary_dim;
        let base = cfg.theta as f32;
        let default_freqs = |n: usize, denom: usize| -> Vec<f32> {
            (0..n)
                .map(|i| 1.0 / base.powf((2 * i) as f32 / denom as f32))
                .collect()
        };
        let mut inv_freq = default_freqs(d / 2, d);
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
            RopeScaling::Yarn { factor, low, high } => {
                let factor = *factor as f32;
                let (low, mut high) = (*low, *high);
                if low == high {
                    high += 0.001; // transformers: prevent a singular ramp
                }
                let (lo, span) = (low as f32, (high - low) as f32);
                for (i, f) in inv_freq.iter_mut().enumerate() {
                    let pos_freq = base.powf((2 * i) as f32 / d as f32);
                    let extrapolation = 1.0 / pos_freq;
                    let interpolation = 1.0 / (factor * pos_freq);
                    let ramp = ((i as f32 - lo) / span).clamp(0.0, 1.0);
                    let extrapolation_factor = 1.0 - ramp;
                    *f = interpolation * (1.0 - extrapolation_factor)
                        + extrapolation * extrapolation_factor;
                }
            }
            RopeScaling::Proportional {
                factor,
                rope_angles,
            } => {
                let mut v = default_freqs(*rope_angles, d);
                v.resize(d / 2, 0.0);
                for f in &mut v {
                    *f /= *factor as f32;
                }
                inv_freq = v;
            }
        }
        Rope {
            inv_freq,
            rotary_dim: d,
            interleaved: cfg.interleaved,
            attention_scaling: cfg.attention_scaling,
        }
    }

    /// Writes `cos` and `sin` (each `rotary_dim / 2` long) for a position.
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f32;
        for (i, f) in self.inv_freq.iter().enumerate() {
            let a = p * f;
            cos[i] = a.cos() * self.attention_scaling;
            sin[i] = a.sin() * self.attention_scaling;
        }
    }

    /// Rotates every head in `x` (`heads × head_dim`) in place; the rotary
    /// dimensions are the first `rotary_dim` of each head.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = self.rotary_dim / 2;
        for head in x.chunks_mut(head_dim) {
            if self.interleaved {
                for i in 0..half {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * cos[i] - b * sin[i];
                    head[2 * i + 1] = b * cos[i] + a * sin[i];
                }
            } else {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = b * cos[i] + a * sin[i];
                }
            }
        }
    }

    /// Half the rotary dimension (length of the cos/sin tables).
    pub fn half(&self) -> usize {
        self.rotary_dim / 2
    }

    /// `f(cos, sin)` with the tables of position `pos`, on the stack up to
    /// [`ROPE_STACK`] half-dimensions (no allocation per row when rows are
    /// rotated in parallel).
    pub fn at<R>(&self, pos: usize, f: impl FnOnce(&[f32], &[f32]) -> R) -> R {
        let half = self.half();
        let (mut cos, mut sin) = ([0.0f32; ROPE_STACK], [0.0f32; ROPE_STACK]);
        let (mut cv, mut sv) = (Vec::new(), Vec::new());
        let (cos, sin) = if half <= ROPE_STACK {
            (&mut cos[..half], &mut sin[..half])
        } else {
            cv.resize(half, 0.0);
            sv.resize(half, 0.0);
            (&mut cv[..], &mut sv[..])
        };
        self.cos_sin(pos, cos, sin);
        f(cos, sin)
    }
}

/// Rotary half-dimensions whose cos/sin tables [`Rope::at`] keeps on the stack.
const ROPE_STACK: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(scaling: RopeScaling, rotary_dim: usize) -> RopeConfig {
        RopeConfig {
            theta: 10000.0,
            scaling,
            rotary_dim,
            interleaved: false,
            attention_scaling: 1.0,
        }
    }

    #[test]
    fn proportional_pads_with_zero_frequencies() {
        let r = Rope::new(&cfg(
            RopeScaling::Proportional {
                factor: 1.0,
                rope_angles: 2,
            },
            8,
        ));
        assert_eq!(r.inv_freq.len(), 4);
        assert_eq!(r.inv_freq[0], 1.0);
        assert!(r.inv_freq[1] > 0.0 && r.inv_freq[2] == 0.0 && r.inv_freq[3] == 0.0);
    }

    #[test]
    fn yarn_blends_between_interpolation_and_extrapolation() {
        let r = Rope::new(&cfg(
            RopeScaling::Yarn {
                factor: 4.0,
                low: 1.0,
                high: 2.0,
            },
            8,
        ));
        let d = Rope::new(&cfg(RopeScaling::Default, 8));
        assert_eq!(r.inv_freq[0], d.inv_freq[0]); // extrapolated
        assert!((r.inv_freq[3] - d.inv_freq[3] / 4.0).abs() < 1e-9); // interpolated
    }
}
