//! Turning logits into the next token: repetition penalty, temperature,
//! top-k, top-p, min-p (in that order, as vLLM and transformers apply them),
//! then greedy argmax or a draw from a seeded RNG.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};

/// Per-request sampling settings. `temperature == 0` means greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1.0 disables top-p.
    pub top_p: f32,
    /// 0.0 disables min-p.
    pub min_p: f32,
    /// 1.0 disables the penalty.
    pub repetition_penalty: f32,
    /// OpenAI's penalties on generated tokens: `logit -= frequency · count + presence · [count > 0]`.
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Rejects values no sampler can honour.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidInput(m));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        Ok(())
    }

    /// Whether this is plain greedy decoding.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// A sampler with its own RNG stream.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    scratch: Vec<(u32, f32)>,
}

/// Index of the largest value; the first one on ties (as `torch.argmax`).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Applies the repetition penalty of transformers / vLLM: each token already
/// seen has its logit divided by `penalty` if positive, multiplied if negative.
pub fn apply_repetition_penalty(logits: &mut [f32], seen: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let mut mark = vec![false; logits.len()];
    for &t in seen {
        if let Some(m) = mark.get_mut(t as usize) {
            *m = true;
        }
    }
    for (l, m) in logits.iter_mut().zip(mark) {
        if m {
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }
}

/// OpenAI's frequency and presence penalties over the generated tokens.
pub fn apply_frequency_presence(
    logits: &mut [f32],
    generated: &[u32],
    frequency: f32,
    presence: f32,
) {
    if frequency == 0.0 && presence == 0.0 {
        return;
    }
    let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    for &t in generated {
        *counts.entry(t).or_default() += 1;
    }
    for (t, c) in counts {
        if let Some(l) = logits.get_mut(t as usize) {
            *l -= frequency * c as f32 + presence;
        }
    }
}

/// `log_softmax` of raw logits (for returned logprobs).
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + logits.iter().map(|l| (l - m).exp()).sum::<f32>().ln();
    logits.iter().map(|l| l - lse).collect()
}

impl Sampler {
    /// A sampler seeded from `params.seed`, or from the OS if none is given.
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Sampler {
            params,
            rng,
            scratch: Vec::new(),
        }
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token given the prompt and what was generated so far
    /// (for the penalties). `logits` is modified.
    pub fn sample(&mut self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let mut seen = Vec::with_capacity(prompt.len() + generated.len());
            seen.extend_from_slice(prompt);
            seen.extend_from_slice(generated);
            apply_repetition_penalty(logits, &seen, p.repetition_penalty);
        }
        apply_frequency_presence(logits, generated, p.frequency_penalty, p.presence_penalty);
        if p.is_greedy() {
            return argmax(logits);
        }
        // Temperature, then a sorted candidate list.
        let cand = &mut self.scratch;
        cand.clear();
        cand.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .map(|(i, l)| (i as u32, l / p.temperature)),
        );
        if cand.is_empty() {
            return argmax(logits);
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.truncate(p.top_k);
        }
        // Softmax over the survivors.
        let m = cand[0].1;
        let mut sum = 0.0f32;
        for c in cand.iter_mut() {
            c.1 = (c.1 - m).exp();
            sum += c.1;
        }
        for c in cand.iter_mut() {
            c.1 /= sum;
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0f32;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            let thresh = p.min_p * cand[0].1;
            cand.retain(|c| c.1 >= thresh);
        }
        let total: f32 = cand.iter().map(|c| c.1).sum();
        let mut r = self.rng.random::<f32>() * total;
        for c in cand.iter() {
            r -= c.1;
            if r <= 0.0 {
                return c.0;
            }
        }
        cand[cand.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        };
        f(&mut p);
        p
    }

    #[test]
    fn greedy_is_argmax_first_on_ties() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0], &[], &[]), 1);
    }

    #[test]
    fn seeded_sampling_repeats() {
        let logits = vec![0.5, 0.4, 0.3, 0.2, 0.1, 0.0];
        let draw = |seed| {
            let mut s = Sampler::new(params(|p| p.seed = Some(seed)));
            (0..32)
                .map(|_| s.sample(&mut logits.clone(), &[], &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_min_p_prune() {
        let logits = vec![1.0, 5.0, 2.0, 4.9];
        let mut s = Sampler::new(params(|p| p.top_k = 1));
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 1);
        }
        // top_p tiny keeps only the best.
        let mut s = Sampler::new(params(|p| p.top_p = 0.01));
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 1);
        }
        // min_p 0.5 keeps tokens 1 and 3 (p3/p1 = e^-0.1).
        let mut s = Sampler::new(params(|p| p.min_p = 0.5));
        for _ in 0..50 {
            let t = s.sample(&mut logits.clone(), &[], &[]);
            assert!(t == 1 || t == 3, "{t}");
        }
    }

    #[test]
    fn repetition_penalty_signs() {
        let mut l = vec![2.0, -2.0, 1.0];
        apply_repetition_penalty(&mut l, &[0, 1], 2.0);
        assert_eq!(l, vec![1.0, -4.0, 1.0]);
    }

    #[test]
    fn frequency_and_presence() {
        let mut l = vec![1.0, 1.0, 1.0];
        apply_frequency_presence(&mut l, &[0, 0, 1], 0.5, 0.25);
        assert_eq!(l, vec![-0.25, 0.25, 1.0]);
        let lp = log_softmax(&[0.0, 0.0]);
        assert!((lp[0] - 0.5f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn validation() {
        assert!(params(|p| p.top_p = 0.0).validate().is_err());
        assert!(params(|p| p.temperature = -1.0).validate().is_err());
        assert!(params(|p| p.min_p = 1.5).validate().is_err());
        assert!(params(|_| {}).validate().is_ok());
    }
}
