//! Turning logits into the next token, in vLLM's order: `allowed_token_ids`
//! (everything else masked), `bad_words`, `logit_bias`, then the penalties
//! (repetition, frequency, presence), then greedy argmax, or temperature,
//! top-k, top-p, min-p and a draw from a seeded RNG. Returned logprobs are the
//! raw model's (vLLM's default `raw_logprobs`): the caller computes them from
//! the logits before any of this.
//!
//! A temperature below [`SAMPLING_EPS`] (vLLM's `_SAMPLING_EPS`) is greedy:
//! dividing logits by ~0 would give infinities and NaN probabilities.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};

/// Temperatures below this are greedy decoding (vLLM's `_SAMPLING_EPS`).
pub const SAMPLING_EPS: f32 = 1e-5;

/// Per-request sampling settings. `temperature < SAMPLING_EPS` means greedy.
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
    /// OpenAI's `logit_bias`: (token id, bias) added to the logits.
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's `allowed_token_ids`: when set, every other token is masked.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's `bad_words`, as token sequences: a sequence's last token is
    /// masked when the generated tokens end with the rest of it.
    pub bad_words: Vec<Vec<u32>>,
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
            logit_bias: Vec::new(),
            allowed_token_ids: None,
            bad_words: Vec::new(),
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
        for &(t, b) in &self.logit_bias {
            if !(-100.0..=100.0).contains(&b) {
                return bad(format!(
                    "logit_bias must be in [-100, 100], got {b} for token {t}"
                ));
            }
        }
        if self
            .allowed_token_ids
            .as_ref()
            .is_some_and(|v| v.is_empty())
        {
            return bad("allowed_token_ids must not be empty".into());
        }
        Ok(())
    }

    /// Whether this is greedy decoding (a temperature below [`SAMPLING_EPS`]).
    pub fn is_greedy(&self) -> bool {
        self.temperature < SAMPLING_EPS
    }

    /// The same settings for choice `index` of a request with `n` > 1: its
    /// own RNG stream, `seed + index` when seeded (as vLLM), so choices differ
    /// and each is reproducible (choice 0 is what `n = 1` samples).
    pub fn for_choice(&self, index: usize) -> SamplingParams {
        let mut p = self.clone();
        p.seed = self.seed.map(|s| s.wrapping_add(index as u64));
        p
    }
}

/// A sampler with its own RNG stream.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    scratch: Vec<(u32, f32)>,
    /// `allowed_token_ids` as a mask over the vocabulary (built on first use).
    allowed: Option<Vec<bool>>,
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

/// vLLM's `allowed_token_ids`: every token whose `allowed` entry is false (or
/// missing) gets `-inf`.
pub fn apply_allowed(logits: &mut [f32], allowed: &[bool]) {
    for (i, l) in logits.iter_mut().enumerate() {
        if !allowed.get(i).copied().unwrap_or(false) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// vLLM's `bad_words`: for each banned token sequence whose all-but-last
/// tokens are what was generated last (nothing, for a one-token word), its
/// last token gets `-inf`. Only generated tokens count, as in vLLM.
pub fn apply_bad_words(logits: &mut [f32], bad_words: &[Vec<u32>], generated: &[u32]) {
    for w in bad_words {
        let Some((&last, prefix)) = w.split_last() else {
            continue;
        };
        if generated.ends_with(prefix)
            && let Some(l) = logits.get_mut(last as usize)
        {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// OpenAI's `logit_bias`: each bias is added to its token's logit.
pub fn apply_logit_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(t, b) in bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
}

/// `log_softmax` of raw logits (for returned logprobs).
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + logits.iter().map(|l| (l - m).exp()).sum::<f32>().ln();
    logits.iter().map(|l| l - lse).collect()
}

/// Higher logit (or probability) first; ties to the lower token id.
fn best_first(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Below this many undecided candidates top-p sorts them; above, it halves
/// them by a selection.
const TOP_P_SORT: usize = 64;

/// Keeps the fewest best candidates (by [`best_first`], so ties go to the
/// lower id) whose probabilities sum to at least `top_p`, in no set order.
/// A weighted quickselect, linear in the candidates: it never sorts the
/// vocabulary (a random model's near-flat distribution, or a high
/// temperature, needs most of it to reach `top_p`).
fn keep_top_p(cand: &mut Vec<(u32, f32)>, top_p: f32) {
    // `cand[..lo]` is kept, `cand[hi..]` dropped, `need` the mass still to reach.
    let (mut lo, mut hi, mut need) = (0, cand.len(), top_p);
    while hi - lo > TOP_P_SORT {
        let mid = (hi - lo) / 2;
        cand[lo..hi].select_nth_unstable_by(mid, best_first);
        let mass: f32 = cand[lo..=lo + mid].iter().map(|c| c.1).sum();
        if mass >= need {
            hi = lo + mid + 1;
        } else {
            need -= mass;
            lo += mid + 1;
        }
    }
    cand[lo..hi].sort_unstable_by(best_first);
    let mut acc = 0.0f32;
    for i in lo..hi {
        acc += cand[i].1;
        if acc >= need {
            cand.truncate(i + 1);
            return;
        }
    }
    cand.truncate(hi);
}

/// Top-k, softmax, top-p and min-p on non-empty `(token, logit /
/// temperature)` candidates: leaves the survivors with their probabilities
/// (in no set order).
fn keep_candidates(cand: &mut Vec<(u32, f32)>, p: &SamplingParams) {
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.select_nth_unstable_by(p.top_k - 1, best_first);
        cand.truncate(p.top_k);
    }
    // Softmax over the survivors.
    let m = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for c in cand.iter_mut() {
        c.1 = (c.1 - m).exp();
        sum += c.1;
    }
    for c in cand.iter_mut() {
        c.1 /= sum;
    }
    if p.top_p < 1.0 {
        keep_top_p(cand, p.top_p);
    }
    if p.min_p > 0.0 {
        let best = cand.iter().map(|c| c.1).fold(0.0f32, f32::max);
        let thresh = p.min_p * best;
        cand.retain(|c| c.1 >= thresh);
    }
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
            allowed: None,
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
        // vLLM's order: allowed tokens, bad words, logit bias, penalties.
        if let Some(ids) = &p.allowed_token_ids {
            let mask = self.allowed.get_or_insert_with(|| {
                let mut m = vec![false; logits.len()];
                for &t in ids {
                    if let Some(x) = m.get_mut(t as usize) {
                        *x = true;
                    }
                }
                m
            });
            apply_allowed(logits, mask);
        }
        apply_bad_words(logits, &p.bad_words, generated);
        apply_logit_bias(logits, &p.logit_bias);
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
        // Temperature, then the candidates top-k, top-p and min-p keep, with
        // their probabilities, found by selection (linear in the vocabulary;
        // a full sort per token was n log n).
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
        keep_candidates(cand, p);
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

    /// The kept candidates and probabilities, against a reference that sorts
    /// every candidate first: top-k, top-p (reached inside the sorted prefix
    /// and past it) and min-p, on a vocabulary larger than the prefix.
    #[test]
    fn selection_keeps_what_a_full_sort_keeps() {
        use rand::Rng;
        let reference = |logits: &[f32], p: &SamplingParams| {
            let mut c: Vec<(u32, f32)> = logits
                .iter()
                .enumerate()
                .map(|(i, l)| (i as u32, l / p.temperature))
                .collect();
            c.sort_by(best_first);
            if p.top_k > 0 && p.top_k < c.len() {
                c.truncate(p.top_k);
            }
            let m = c[0].1;
            let sum: f32 = c.iter().map(|x| (x.1 - m).exp()).sum();
            for x in c.iter_mut() {
                x.1 = (x.1 - m).exp() / sum;
            }
            if p.top_p < 1.0 {
                let mut acc = 0.0;
                let keep = c
                    .iter()
                    .position(|x| {
                        acc += x.1;
                        acc >= p.top_p
                    })
                    .map_or(c.len(), |i| i + 1);
                c.truncate(keep);
            }
            if p.min_p > 0.0 {
                let t = p.min_p * c[0].1;
                c.retain(|x| x.1 >= t);
            }
            c
        };
        let mut rng = StdRng::seed_from_u64(5);
        let mut cases = vec![
            (5000, 8.0, 0, 1.0, 0.0),
            (5000, 8.0, 0, 0.5, 0.0),
            (5000, 0.5, 0, 0.95, 0.0),
            (5000, 0.01, 0, 0.999, 0.0),
            (5000, 3.0, 50, 0.9, 0.0),
            (5000, 3.0, 3000, 0.99, 0.0),
            (5000, 2.0, 0, 1.0, 0.05),
            (5000, 2.0, 40, 0.8, 0.1),
        ];
        // Many top-p on smaller vocabularies, so that the boundary often
        // falls on a selection's pivot.
        for _ in 0..400 {
            let top_p = rng.random_range(0.05f32..0.999);
            cases.push((rng.random_range(65..600), 1.0, 0, top_p, 0.0));
        }
        for (vocab, spread, top_k, top_p, min_p) in cases {
            let mut logits: Vec<f32> = (0..vocab)
                .map(|_| rng.random_range(-spread..spread))
                .collect();
            // Ties, to check they go to the lower id.
            logits[17] = logits[vocab - 3];
            let p = params(|p| {
                p.temperature = 0.7;
                p.top_k = top_k;
                p.top_p = top_p;
                p.min_p = min_p;
            });
            let mut got: Vec<(u32, f32)> = logits
                .iter()
                .enumerate()
                .map(|(i, l)| (i as u32, l / p.temperature))
                .collect();
            keep_candidates(&mut got, &p);
            got.sort_by_key(|x| x.0);
            let mut want = reference(&logits, &p);
            want.sort_by_key(|x| x.0);
            let ids = |v: &[(u32, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
            assert_eq!(
                ids(&got),
                ids(&want),
                "vocab {vocab} spread {spread} top_k {top_k} top_p {top_p} min_p {min_p}"
            );
            for (g, w) in got.iter().zip(&want) {
                assert!((g.1 - w.1).abs() <= 1e-6 * (1.0 + w.1), "{g:?} vs {w:?}");
            }
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
    fn a_tiny_positive_temperature_is_greedy() {
        let logits = vec![0.5, 2.0, 1.999, -1.0];
        for t in [1e-39f32, f32::MIN_POSITIVE, 1e-7, 9.9e-6] {
            let p = params(|p| p.temperature = t);
            assert!(p.validate().is_ok());
            assert!(p.is_greedy(), "{t}");
            let mut s = Sampler::new(p);
            for _ in 0..20 {
                assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 1, "{t}");
            }
        }
        // Just above the threshold it samples, from finite probabilities.
        let p = params(|p| p.temperature = 2e-5);
        assert!(!p.is_greedy());
        let mut s = Sampler::new(p);
        assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 1);
    }

    #[test]
    fn allowed_token_ids_mask_everything_else() {
        let mut l = vec![1.0, 2.0, 3.0, 4.0];
        let mut mask = vec![false; 4];
        mask[0] = true;
        mask[2] = true;
        apply_allowed(&mut l, &mask);
        assert_eq!(l, vec![1.0, f32::NEG_INFINITY, 3.0, f32::NEG_INFINITY]);
        // A mask shorter than the logits masks the rest too.
        let mut l = vec![1.0, 2.0];
        apply_allowed(&mut l, &[true]);
        assert_eq!(l, vec![1.0, f32::NEG_INFINITY]);

        let logits = vec![5.0, 0.0, 1.0, 4.0, 0.5];
        let mut s = Sampler::new(SamplingParams {
            allowed_token_ids: Some(vec![2, 4]),
            ..Default::default()
        });
        assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 2);
        let mut s = Sampler::new(params(|p| p.allowed_token_ids = Some(vec![1, 4])));
        for _ in 0..50 {
            let t = s.sample(&mut logits.clone(), &[], &[]);
            assert!(t == 1 || t == 4, "{t}");
        }
    }

    #[test]
    fn bad_words_mask_the_last_token_after_their_prefix() {
        let words = vec![vec![3], vec![1, 2], vec![7, 8, 9]];
        let base = vec![0.0f32; 10];
        let banned = |generated: &[u32]| {
            let mut l = base.clone();
            apply_bad_words(&mut l, &words, generated);
            (0..10u32)
                .filter(|&i| l[i as usize] == f32::NEG_INFINITY)
                .collect::<Vec<_>>()
        };
        // One-token words always; longer ones only after their prefix.
        assert_eq!(banned(&[]), vec![3]);
        assert_eq!(banned(&[5, 1]), vec![2, 3]);
        assert_eq!(banned(&[1, 5]), vec![3]);
        assert_eq!(banned(&[7, 8]), vec![3, 9]);
        assert_eq!(banned(&[8]), vec![3]);
        // Out-of-vocabulary ids and empty words are ignored, not a panic.
        let mut l = vec![0.0; 2];
        apply_bad_words(&mut l, &[vec![], vec![5]], &[]);
        assert_eq!(l, vec![0.0; 2]);
        // Greedy skips the banned token for the next best.
        let mut s = Sampler::new(SamplingParams {
            bad_words: vec![vec![1, 2]],
            ..Default::default()
        });
        let logits = vec![0.0, 0.0, 3.0, 2.0];
        assert_eq!(
            s.sample(&mut logits.clone(), &[1], &[]),
            2,
            "prompt tokens do not count"
        );
        assert_eq!(s.sample(&mut logits.clone(), &[], &[1]), 3);
    }

    #[test]
    fn logit_bias_adds_before_the_penalties() {
        let mut l = vec![1.0, 2.0, 3.0];
        apply_logit_bias(&mut l, &[(0, 10.0), (2, -100.0), (99, 1.0)]);
        assert_eq!(l, vec![11.0, 2.0, -97.0]);
        // Greedy: a -100 bias removes the best token, +100 forces one.
        let logits = vec![1.0, 5.0, 2.0];
        let mut s = Sampler::new(SamplingParams {
            logit_bias: vec![(1, -100.0)],
            ..Default::default()
        });
        assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 2);
        let mut s = Sampler::new(params(|p| p.logit_bias = vec![(0, 100.0)]));
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 0);
        }
        // Bias, then the repetition penalty: (1 + 1) / 2 = 1, not 1 / 2 + 1.
        let mut s = Sampler::new(SamplingParams {
            logit_bias: vec![(0, 1.0)],
            repetition_penalty: 2.0,
            ..Default::default()
        });
        let mut l = vec![1.0, 1.2];
        assert_eq!(s.sample(&mut l, &[0], &[]), 1);
        assert_eq!(l[0], 1.0);
        // Masks and bias together: a masked token stays masked.
        let mut s = Sampler::new(SamplingParams {
            allowed_token_ids: Some(vec![2]),
            logit_bias: vec![(1, 100.0)],
            ..Default::default()
        });
        assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 2);
    }

    #[test]
    fn choices_get_their_own_seeds() {
        let p = params(|p| p.seed = Some(41));
        assert_eq!(p.for_choice(0), p);
        assert_eq!(p.for_choice(3).seed, Some(44));
        assert_eq!(params(|p| p.seed = None).for_choice(2).seed, None);
        assert_eq!(
            params(|p| p.seed = Some(u64::MAX)).for_choice(1).seed,
            Some(0)
        );
    }

    #[test]
    fn validation() {
        assert!(
            params(|p| p.logit_bias = vec![(1, 100.5)])
                .validate()
                .is_err()
        );
        assert!(
            params(|p| p.logit_bias = vec![(1, f32::NAN)])
                .validate()
                .is_err()
        );
        assert!(
            params(|p| p.logit_bias = vec![(1, -100.0)])
                .validate()
                .is_ok()
        );
        assert!(
            params(|p| p.allowed_token_ids = Some(vec![]))
                .validate()
                .is_err()
        );
        assert!(params(|p| p.top_p = 0.0).validate().is_err());
        assert!(params(|p| p.temperature = -1.0).validate().is_err());
        assert!(params(|p| p.min_p = 1.5).validate().is_err());
        assert!(params(|_| {}).validate().is_ok());
    }
}
