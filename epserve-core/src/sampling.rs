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
    scratch: Scratch,
    /// `allowed_token_ids` as a mask over the vocabulary (built on first use).
    allowed: Option<Vec<bool>>,
}

/// Index of the largest value; the first one on ties (as `torch.argmax`).
pub fn argmax(v: &[f32]) -> u32 {
    // The largest non-NaN value over 16 lanes (a loop that vectorizes), then
    // its first position: two streaming passes instead of a serial compare
    // chain (a 152k vocabulary each step).
    first_eq(v, max_of(v)).unwrap_or(0) as u32
}

/// Folds `v` into `N` lane accumulators with `f`, then the lanes into one
/// (in order: `N` dependent steps): the shape of loop the compiler
/// vectorizes; 64 lanes are four independent registers of 16. `f` must be
/// associative and commutative up to the caller's needs (a max, a sum).
#[inline(always)]
fn lanes_fold<const N: usize>(v: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [init; N];
    let mut chunks = v.chunks_exact(N);
    for c in &mut chunks {
        for j in 0..N {
            acc[j] = f(acc[j], c[j]);
        }
    }
    let mut r = init;
    for &x in chunks.remainder().iter().chain(&acc) {
        r = f(r, x);
    }
    r
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

/// Below this many undecided candidates top-p sorts them; above, it halves
/// them by a selection.
const TOP_P_SORT: usize = 64;

/// Keeps the fewest best candidates (by `best`: higher logit first, ties to
/// the lower id) whose weights sum to at least `need`, in no set order. A
/// weighted quickselect, linear in the candidates: it never sorts them (a
/// near-flat distribution, or a high temperature, needs most of them).
fn keep_top_p(
    cand: &mut Vec<(u32, f32)>,
    need: f64,
    best_first: impl Fn(&(u32, f32), &(u32, f32)) -> std::cmp::Ordering + Copy,
) {
    let n = top_p_prefix(cand, need, best_first);
    cand.truncate(n);
}

/// [`keep_top_p`] on a slice: moves the kept candidates to its front and
/// returns how many.
fn top_p_prefix(
    cand: &mut [(u32, f32)],
    mut need: f64,
    best_first: impl Fn(&(u32, f32), &(u32, f32)) -> std::cmp::Ordering + Copy,
) -> usize {
    // `cand[..lo]` is kept, `cand[hi..]` dropped, `need` the mass still to reach.
    let (mut lo, mut hi) = (0, cand.len());
    while hi - lo > TOP_P_SORT {
        let mid = (hi - lo) / 2;
        cand[lo..hi].select_nth_unstable_by(mid, best_first);
        let mass: f64 = cand[lo..=lo + mid].iter().map(|c| c.1 as f64).sum();
        if mass >= need {
            hi = lo + mid + 1;
        } else {
            need -= mass;
            lo += mid + 1;
        }
    }
    cand[lo..hi].sort_unstable_by(best_first);
    let mut acc = 0.0f64;
    for (i, c) in cand[lo..hi].iter().enumerate() {
        acc += c.1 as f64;
        if acc >= need {
            return lo + i + 1;
        }
    }
    hi
}

/// Below `exp(-87)` a weight is 0 (about `f32::MIN_POSITIVE`, where
/// [`fast_exp`](crate::kernels::fast_exp) stops).
const EXP_FLOOR: f32 = -87.0;

/// Histogram buckets of a weight in `[0, 1]`: its bits' top part (exponent
/// and 4 mantissa bits, 16 buckets per octave), monotone in the weight.
const BUCKET_SHIFT: u32 = 19;
const BUCKETS: usize = (0x3F80_0000 >> BUCKET_SHIFT) + 1;

#[inline(always)]
fn bucket(w: f32) -> usize {
    (w.to_bits() >> BUCKET_SHIFT) as usize
}

/// Reused buffers of a [`Sampler`].
#[derive(Default)]
struct Scratch {
    /// Each token's weight `exp(l/T - max)` (0 for masked, non-finite ones,
    /// and for those a filter dropped).
    w: Vec<f32>,
    /// Per-block sums of the weights, for the draw.
    sums: Vec<f32>,
    /// Top-k's `(token, weight)` survivors.
    cand: Vec<(u32, f32)>,
    /// The tokens of the bucket a filter's boundary falls in.
    edge: Vec<(u32, f32)>,
    /// Top-p's histogram of mass, in fixed point ([`FIX`]). Two interleaved
    /// copies (even and odd tokens), so that runs of tokens in one bucket
    /// do not chain each add on the previous one's store.
    mass: Vec<u64>,
}

/// Top-p's histogram adds weights as integers of `2^-40`: exact sums in any
/// order, each weight off by under `1e-12`.
const FIX: f32 = (1u64 << 40) as f32;

/// What [`keep`] left to draw from.
#[derive(Debug, PartialEq)]
enum Kept {
    /// No finite logit.
    Nothing,
    /// Every token with its weight in `Scratch::w` (0 where dropped); their sum.
    All(f64),
    /// The top-k survivors in `Scratch::cand`; their weights' sum.
    List(f64),
}

/// The streaming passes over the vocabulary, compiled for the widest x86
/// vector extension of the selected kernel tier (`EPSERVE_KERNEL=generic`
/// runs the baseline build of the same code; NEON is aarch64's baseline).
macro_rules! widest {
    ($($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty $body:block)*) => {$(
        $(#[$doc])*
        fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                fn avx512($($arg: $ty),*) -> $ret {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) -> $ret {
                    body($($arg),*)
                }
                use crate::kernels::dispatch::Tier;
                match crate::kernels::dispatch::kernels().tier() {
                    // SAFETY: the tier is only selected where the CPU has
                    // these extensions (`Tier::supported`).
                    Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => unsafe {
                        return avx512($($arg),*);
                    },
                    Tier::Avx2 => unsafe {
                        return avx2($($arg),*);
                    },
                    _ => {}
                }
            }
            body($($arg),*)
        }
    )*};
}

/// Lanes of the streaming passes (a multiple of every vector width).
const L: usize = 16;

widest! {
    /// The largest value, NaN ignored (`-inf` if none).
    fn max_of(v: &[f32]) -> f32 {
        lanes_fold::<64>(v, f32::NEG_INFINITY, |acc, x| if x > acc { x } else { acc })
    }

    /// The first position holding `m`: blocks of 16 compared at once.
    fn first_eq(v: &[f32], m: f32) -> Option<usize> {
        for (c, block) in v.chunks(L).enumerate() {
            let mut hit = false;
            for &x in block {
                hit |= x == m;
            }
            if hit {
                return block.iter().position(|&x| x == m).map(|i| c * L + i);
            }
        }
        None
    }

    /// Each block of [`DRAW_BLOCK`] weights' sum, into `sums`; returns how
    /// many blocks.
    fn block_sums(w: &[f32], sums: &mut Vec<f32>) -> usize {
        // A plain loop: an iterator adapter's fold is not inlined here, so
        // it would run without this function's vector extensions.
        sums.clear();
        for b in w.chunks(DRAW_BLOCK) {
            sums.push(lanes_fold::<16>(b, 0.0, |a, x| a + x));
        }
        sums.len()
    }

    /// The largest finite logit (`-inf` if none).
    fn max_finite(logits: &[f32]) -> f32 {
        lanes_fold::<64>(logits, f32::NEG_INFINITY, |acc, l| {
            if l > acc && l < f32::INFINITY { l } else { acc }
        })
    }

    /// `w = exp(l / t - m)` per token (0 for NaN and infinite logits, and
    /// below [`EXP_FLOOR`]); returns the weights' sum and how many are positive.
    fn weights(logits: &[f32], t: f32, m: f32, w: &mut [f32]) -> (f64, usize) {
        let weight = |l: f32| {
            let d = l / t - m;
            // NaN, +inf and -inf logits fail the tests and weigh 0.
            if l < f32::INFINITY && d >= EXP_FLOOR {
                crate::kernels::fast_exp(d)
            } else {
                0.0
            }
        };
        let mut sums = [0.0f32; L];
        let mut counts = [0u32; L];
        let mut wc = w.chunks_exact_mut(L);
        let mut lc = logits.chunks_exact(L);
        for (w, l) in (&mut wc).zip(&mut lc) {
            for j in 0..L {
                w[j] = weight(l[j]);
                sums[j] += w[j];
                counts[j] += (w[j] > 0.0) as u32;
            }
        }
        let (mut sum, mut positive) = (0.0f64, 0usize);
        for (w, &l) in wc.into_remainder().iter_mut().zip(lc.remainder()) {
            *w = weight(l);
            sum += *w as f64;
            positive += (*w > 0.0) as usize;
        }
        sum += sums.iter().map(|&x| x as f64).sum::<f64>();
        positive += counts.iter().map(|&c| c as usize).sum::<usize>();
        (sum, positive)
    }

    /// Zeroes every weight below `min_w` and every token after the cut: the
    /// tokens kept are those with `(l / t, -id) >= (cut.0, -cut.1)`, the
    /// prefix a sort by scaled logit (ties to the lower id) would keep.
    /// Returns the kept weights' sum.
    fn mask(logits: &[f32], t: f32, cut: (f32, u32), min_w: f32, w: &mut [f32]) -> f64 {
        let (sc, ic) = cut;
        let mut sums = [0.0f32; L];
        let mut wc = w.chunks_exact_mut(L);
        let mut lc = logits.chunks_exact(L);
        let mut base = 0u32;
        let keep = |w: f32, l: f32, i: u32| {
            let s = l / t;
            if w >= min_w && (s > sc || (s == sc && i <= ic)) { w } else { 0.0 }
        };
        for (w, l) in (&mut wc).zip(&mut lc) {
            for j in 0..L {
                w[j] = keep(w[j], l[j], base + j as u32);
                sums[j] += w[j];
            }
            base += L as u32;
        }
        let mut sum = 0.0f64;
        for (j, (w, &l)) in wc.into_remainder().iter_mut().zip(lc.remainder()).enumerate() {
            *w = keep(*w, l, base + j as u32);
            sum += *w as f64;
        }
        sum + sums.iter().map(|&x| x as f64).sum::<f64>()
    }
}

/// Temperature, then top-k, top-p and min-p over the logits, in vLLM's order:
/// the weights `exp(l/T - max)` of every token (probabilities up to one
/// normalization), and which survive. Linear in the vocabulary, nearly all
/// of it in streaming passes that vectorize: the max, the weights and their
/// sum, and for top-p and min-p a mask. Top-k and top-p find the bucket of a
/// histogram of the weights' bits where their boundary falls, so only that
/// bucket's tokens are ordered. Every filter keeps a prefix of the tokens
/// sorted by scaled logit, ties to the lower id, as a full sort would.
fn keep(logits: &[f32], p: &SamplingParams, s: &mut Scratch) -> Kept {
    let t = p.temperature;
    // `fl(max / t) == max(fl(l / t))`: the rounded division is monotone.
    let max = max_finite(logits);
    if max == f32::NEG_INFINITY {
        return Kept::Nothing;
    }
    // Every weight is written below: no clearing pass.
    s.w.resize(logits.len(), 0.0);
    let (sum, positive) = weights(logits, t, max / t, &mut s.w);
    let k = p.top_k;
    if k > 0 && k < positive {
        select_top_k(logits, t, k, s);
        let mut sum: f64 = s.cand.iter().map(|c| c.1 as f64).sum();
        if p.top_p < 1.0 {
            keep_top_p(&mut s.cand, p.top_p as f64 * sum, by_logit(logits, t));
            sum = s.cand.iter().map(|c| c.1 as f64).sum();
        }
        // min-p keeps weights of at least `min_p` times the best one, which
        // is `exp(0) = 1` and survives every filter (here and in `mask`).
        if p.min_p > 0.0 {
            s.cand.retain(|c| c.1 >= p.min_p);
            sum = s.cand.iter().map(|c| c.1 as f64).sum();
        }
        return Kept::List(sum);
    }
    if p.top_p < 1.0 {
        let cut = top_p_cut(logits, t, p.top_p as f64 * sum, sum, s);
        return Kept::All(mask(logits, t, cut, p.min_p, &mut s.w));
    }
    if p.min_p > 0.0 {
        let all = (f32::NEG_INFINITY, u32::MAX);
        return Kept::All(mask(logits, t, all, p.min_p, &mut s.w));
    }
    Kept::All(sum)
}

/// Order of the candidates: higher scaled logit `l / t` first (as a sort of
/// them would compare), ties to the lower id.
fn by_logit(
    logits: &[f32],
    t: f32,
) -> impl Fn(&(u32, f32), &(u32, f32)) -> std::cmp::Ordering + Copy + '_ {
    move |a, b| {
        (logits[b.0 as usize] / t)
            .total_cmp(&(logits[a.0 as usize] / t))
            .then(a.0.cmp(&b.0))
    }
}

/// `Scratch::cand` = the `k` best tokens (0 < k < the tokens of positive
/// weight). One pass with a rising bar: tokens at or above the k-th best
/// weight seen so far are collected, and each time the buffer fills a
/// selection keeps its `k` best and raises the bar to theirs. Each block of
/// 16 weights is first tested against the bar at once; after the first
/// blocks few pass, so the pass costs about a compare per token.
fn select_top_k(logits: &[f32], t: f32, k: usize, s: &mut Scratch) {
    const BLOCK: usize = 16;
    let cap = (4 * k).max(256);
    let order = by_logit(logits, t);
    let cand = &mut s.cand;
    cand.clear();
    // Anything positive passes until the buffer first fills.
    let mut bar = f32::MIN_POSITIVE / 2.0;
    for (c, block) in s.w.chunks(BLOCK).enumerate() {
        let mut hit = false;
        for &w in block {
            hit |= w >= bar;
        }
        if !hit {
            continue;
        }
        for (j, &w) in block.iter().enumerate() {
            if w >= bar && w > 0.0 {
                cand.push(((c * BLOCK + j) as u32, w));
            }
        }
        if cand.len() >= cap {
            cand.select_nth_unstable_by(k - 1, order);
            cand.truncate(k);
            // The k-th best's weight: anything lighter has a lower logit.
            bar = cand.iter().map(|c| c.1).fold(f32::INFINITY, f32::min);
        }
    }
    if cand.len() > k {
        cand.select_nth_unstable_by(k - 1, order);
        cand.truncate(k);
    }
}

/// Top-p's cut for [`mask`]: the worst of the fewest best tokens whose
/// weights sum to at least `need`. A histogram of the weights' mass finds
/// the bucket where the running sum crosses `need`; only that bucket's
/// tokens are ordered (by [`keep_top_p`]). Weights below
/// `(sum - need) / n` cannot reach the nucleus (all of them together weigh
/// at most `sum - need`) and stay out of the histogram.
fn top_p_cut(logits: &[f32], t: f32, need: f64, sum: f64, s: &mut Scratch) -> (f32, u32) {
    // Both copies of each bucket, then 16 slots that take the weights
    // under the floor (in turn, so they chain no more than the rest).
    const SINK: usize = 2 * BUCKETS;
    s.mass.clear();
    s.mass.resize(SINK + 16, 0);
    let floor = ((sum - need) / s.w.len() as f64) as f32;
    // The slices held in registers through the loop (through `s`, each
    // store could have moved the vector's buffer, reloaded per token).
    let (ws, hist) = (&s.w[..], &mut s.mass[..]);
    for (i, &w) in ws.iter().enumerate() {
        // A select by mask, not a branch: whether a weight is under the
        // floor is a coin toss on a flat distribution.
        let keep = 0usize.wrapping_sub((w >= floor) as usize);
        let slot = ((2 * bucket(w) + (i & 1)) & keep) | ((SINK + (i & 15)) & !keep);
        // SAFETY: weights are finite and in [0, 1], so `w · 2^40` fits.
        hist[slot] += unsafe { (w * FIX).to_int_unchecked::<i64>() } as u64;
    }
    let need_fix = need * FIX as f64;
    let mass = |b: usize| (s.mass[2 * b] + s.mass[2 * b + 1]) as f64;
    let (mut b, mut above) = (BUCKETS - 1, 0.0f64);
    while above + mass(b) < need_fix && b > 0 {
        above += mass(b);
        b -= 1;
    }
    let above = above / FIX as f64;
    // The bucket's tokens, written without a branch (whether a token is in
    // it is a coin toss on a flat distribution): each is stored at the end
    // and the end moves on only for a member.
    if s.edge.len() <= s.w.len() {
        s.edge.resize(s.w.len() + 1, (0, 0.0));
    }
    let (ws, edge) = (&s.w[..], &mut s.edge[..]);
    let mut n = 0;
    // Blocks of 16 are first tested at once: on peaked logits most hold no
    // token of the bucket.
    for (c, block) in ws.chunks(16).enumerate() {
        let mut hit = false;
        for &w in block {
            hit |= bucket(w) == b;
        }
        if !hit {
            continue;
        }
        for (j, &w) in block.iter().enumerate() {
            edge[n] = ((c * 16 + j) as u32, w);
            n += (bucket(w) == b && w > 0.0) as usize;
        }
    }
    let order = by_logit(logits, t);
    let edge = &mut s.edge[..n];
    let kept = top_p_prefix(edge, need - above, order);
    // The worst kept; with none (the mass ran out in rounding) every
    // positive weight stays.
    match edge[..kept].iter().copied().max_by(order) {
        Some((i, _)) => (logits[i as usize] / t, i),
        None => (f32::NEG_INFINITY, u32::MAX),
    }
}

/// The token a draw `r` in `[0, total)` picks: the first whose weight takes
/// the running sum past `r`. A weight of 0 is never picked; where rounding
/// leaves `r` past the end, the last positive one is.
fn draw(ids: impl Iterator<Item = (u32, f32)>, mut r: f64) -> Option<u32> {
    let mut last = None;
    for (i, w) in ids {
        if w <= 0.0 {
            continue;
        }
        if r < w as f64 {
            return Some(i);
        }
        r -= w as f64;
        last = Some(i);
    }
    last
}

/// Weights per block of [`draw_blocks`].
const DRAW_BLOCK: usize = 1024;

/// [`draw`] over every token's weight: blocks of 1024 are summed (a loop
/// that vectorizes) and skipped whole until the one holding `r`, instead of
/// a serial running sum over the whole vocabulary.
fn draw_blocks(w: &[f32], sums: &mut Vec<f32>, mut r: f64) -> Option<u32> {
    const B: usize = DRAW_BLOCK;
    block_sums(w, sums);
    let ids = |b: usize| {
        let block = &w[b * B..w.len().min((b + 1) * B)];
        (block.iter().enumerate()).map(move |(i, &w)| ((b * B + i) as u32, w))
    };
    let mut last = None;
    for (b, &sum) in sums.iter().enumerate() {
        let sum = sum as f64;
        if sum <= 0.0 {
            continue;
        }
        if r < sum {
            return draw(ids(b), r);
        }
        r -= sum;
        last = Some(b);
    }
    draw(ids(last?), f64::INFINITY)
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
            scratch: Scratch::default(),
            allowed: None,
        }
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token given the prompt and what was generated so far
    /// (for the penalties). `logits` is modified: [`Sampler::adjust`], then
    /// [`Sampler::pick`].
    pub fn sample(&mut self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) -> u32 {
        self.adjust(logits, prompt, generated);
        self.pick(logits)
    }

    /// Whether [`Sampler::adjust`] may change logits (allowed tokens, bad
    /// words, a logit bias or a penalty is set). Without any, a caller can
    /// [`Sampler::pick`] from the step's logits as they are, with no copy.
    pub fn adjusts(&self) -> bool {
        let p = &self.params;
        p.allowed_token_ids.is_some()
            || !p.bad_words.is_empty()
            || !p.logit_bias.is_empty()
            || p.repetition_penalty != 1.0
            || p.frequency_penalty != 0.0
            || p.presence_penalty != 0.0
    }

    /// The logit processors, in vLLM's order: allowed tokens, bad words,
    /// logit bias, penalties (given the prompt and what was generated so
    /// far). Changes nothing unless [`Sampler::adjusts`].
    pub fn adjust(&mut self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) {
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
    }

    /// Draws the next token from (adjusted) logits: greedy, or temperature
    /// with top-k, top-p and min-p.
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.is_greedy() {
            return argmax(logits);
        }
        let s = &mut self.scratch;
        let kept = keep(logits, p, s);
        let u = self.rng.random::<f64>();
        let tok = match kept {
            Kept::Nothing => None,
            Kept::All(total) => draw_blocks(&s.w, &mut s.sums, u * total),
            Kept::List(total) => draw(s.cand.iter().copied(), u * total),
        };
        tok.unwrap_or_else(|| argmax(logits))
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

    /// `adjusts` is true for each logit processor (each changes these
    /// logits), and without any `adjust` changes nothing, so `pick` on the
    /// step's logits draws what `sample` on a copy draws.
    #[test]
    fn pick_on_unadjusted_logits_draws_what_sample_draws() {
        let logits: Vec<f32> = (0..300).map(|i| ((i * 37) % 101) as f32 / 17.0).collect();
        let (prompt, generated) = ([5u32, 9], [7u32, 8]);
        let processors: [fn(&mut SamplingParams); 7] = [
            |p| p.allowed_token_ids = Some(vec![3, 4]),
            |p| p.bad_words = vec![vec![8, 2]],
            |p| p.logit_bias = vec![(2, 1.5)],
            |p| p.repetition_penalty = 1.3,
            |p| p.frequency_penalty = 0.5,
            |p| p.presence_penalty = -0.5,
            |p| p.bad_words = vec![vec![7, 8, 2]],
        ];
        for f in processors {
            let s = Sampler::new(params(f));
            assert!(s.adjusts(), "{:?}", s.params());
            let mut l = logits.clone();
            Sampler::new(params(f)).adjust(&mut l, &prompt, &generated);
            assert_ne!(l, logits, "{:?}", s.params());
        }
        let plain: [fn(&mut SamplingParams); 5] = [
            |p| p.temperature = 0.0,
            |_| {},
            |p| p.top_k = 20,
            |p| p.top_p = 0.7,
            |p| (p.min_p, p.temperature) = (0.05, 0.6),
        ];
        for f in plain {
            let mut a = Sampler::new(params(f));
            assert!(!a.adjusts(), "{:?}", a.params());
            let mut l = logits.clone();
            a.adjust(&mut l, &prompt, &generated);
            assert!(
                l.iter()
                    .zip(&logits)
                    .all(|(x, y)| x.to_bits() == y.to_bits())
            );
            let mut b = Sampler::new(params(f));
            for _ in 0..40 {
                let want = a.sample(&mut logits.clone(), &prompt, &generated);
                assert_eq!(b.pick(&logits), want, "{:?}", b.params());
            }
        }
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
        fn best_first(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
            b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
        }
        let reference = |logits: &[f32], p: &SamplingParams| {
            let mut c: Vec<(u32, f32)> = logits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .map(|(i, l)| (i as u32, l / p.temperature))
                .collect();
            c.sort_by(best_first);
            if p.top_k > 0 && p.top_k < c.len() {
                c.truncate(p.top_k);
            }
            // Sums in f64: over a 152k vocabulary an f32 running sum drifts
            // by more than one token's share at the top-p boundary.
            let m = c[0].1;
            let sum: f64 = c.iter().map(|x| ((x.1 - m) as f64).exp()).sum();
            for x in c.iter_mut() {
                x.1 = (((x.1 - m) as f64).exp() / sum) as f32;
            }
            if p.top_p < 1.0 {
                let mut acc = 0.0f64;
                let keep = c
                    .iter()
                    .position(|x| {
                        acc += x.1 as f64;
                        acc >= p.top_p as f64
                    })
                    .map_or(c.len(), |i| i + 1);
                c.truncate(keep);
            }
            if p.min_p > 0.0 {
                let t = p.min_p * c[0].1;
                c.retain(|x| x.1 >= t);
            }
            // The draw's distribution: the survivors renormalized.
            let kept: f32 = c.iter().map(|x| x.1).sum();
            for x in c.iter_mut() {
                x.1 /= kept;
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
            // A real model's vocabulary: peaked, flat (the top-p boundary
            // bucket holds most tokens), top-k inside one bucket.
            (151_936, 12.0, 0, 0.9, 0.0),
            (151_936, 0.01, 0, 0.95, 0.0),
            (151_936, 0.001, 1000, 1.0, 0.0),
            (151_936, 6.0, 0, 1.0, 0.02),
            (151_936, 6.0, 64, 0.9, 0.05),
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
            // Ties, to check they go to the lower id; masked tokens.
            logits[17] = logits[vocab - 3];
            logits[5] = f32::NEG_INFINITY;
            logits[vocab - 1] = f32::NAN;
            let p = params(|p| {
                p.temperature = 0.7;
                p.top_k = top_k;
                p.top_p = top_p;
                p.min_p = min_p;
            });
            let mut s = Scratch::default();
            let norm = |w: f32, sum: f64| (w as f64 / sum) as f32;
            let mut got: Vec<(u32, f32)> = match keep(&logits, &p, &mut s) {
                Kept::All(sum) => (s.w.iter().enumerate())
                    .filter(|(_, w)| **w > 0.0)
                    .map(|(i, &w)| (i as u32, norm(w, sum)))
                    .collect(),
                Kept::List(sum) => s.cand.iter().map(|&(i, w)| (i, norm(w, sum))).collect(),
                Kept::Nothing => panic!("finite logits"),
            };
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
    fn a_draw_picks_the_token_whose_span_holds_it() {
        // Blocks of 64: zeros around, one block skipped whole.
        let mut w = vec![0.0f32; 200];
        w[1] = 0.5;
        w[100] = 1.0;
        w[130] = 0.25;
        for (r, want) in [(0.0, 1), (0.49, 1), (0.5, 100), (1.49, 100), (1.5, 130)] {
            assert_eq!(draw_blocks(&w, &mut Vec::new(), r), Some(want), "{r}");
            let list = w.iter().enumerate().map(|(i, &w)| (i as u32, w));
            assert_eq!(draw(list, r), Some(want), "{r}");
        }
        // Past the end (rounding): the last positive weight, never a zero.
        assert_eq!(draw_blocks(&w, &mut Vec::new(), 1.75), Some(130));
        assert_eq!(draw_blocks(&[0.0; 70], &mut Vec::new(), 0.0), None);
        // Nothing finite to draw from: argmax's first index.
        let mut s = Sampler::new(params(|_| {}));
        let mut l = vec![f32::NEG_INFINITY, f32::NAN, f32::INFINITY];
        assert_eq!(s.sample(&mut l, &[], &[]), 2);
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
