//! The `random` dataset, built the way vLLM's RandomDataset builds it: input
//! and output lengths drawn uniformly around the asked ones, each prompt a run
//! of consecutive non-special token ids from a random offset (after an
//! optional shared random prefix), decoded to text, then re-encoded and
//! trimmed or topped up until the text encodes to the drawn length (at most
//! ten tries; what is left over is reported).

use std::path::Path;

use anyhow::{Context, Result, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What the dataset needs from a tokenizer.
pub trait PromptTokenizer {
    /// The base vocabulary size (added tokens excluded), as HF's `vocab_size`.
    fn vocab_size(&self) -> usize;
    /// Ids of special tokens, never used to build prompts.
    fn special_ids(&self) -> Vec<u32>;
    /// Tokens the tokenizer adds to one sequence (e.g. a BOS).
    fn num_special_tokens_to_add(&self) -> usize;
    /// Encodes without special tokens.
    fn encode(&self, text: &str) -> Result<Vec<u32>>;
    /// Decodes, keeping special tokens.
    fn decode(&self, ids: &[u32]) -> Result<String>;
}

/// A Hugging Face `tokenizer.json`.
pub struct HfTokenizer(tokenizers::Tokenizer);

impl HfTokenizer {
    /// Loads `DIR/tokenizer.json` (or a tokenizer.json file given directly).
    pub fn from_path(path: &Path) -> Result<Self> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        if !file.is_file() {
            bail!(
                "{}: no tokenizer.json (pass --tokenizer DIR, a Hugging Face model folder)",
                file.display()
            );
        }
        let t = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| anyhow::anyhow!("{}: cannot load tokenizer: {e}", file.display()))?;
        Ok(HfTokenizer(t))
    }

    /// Counts the tokens of generated text (no special tokens added).
    pub fn count(&self, text: &str) -> Option<usize> {
        self.0.encode(text, false).ok().map(|e| e.get_ids().len())
    }
}

impl PromptTokenizer for HfTokenizer {
    fn vocab_size(&self) -> usize {
        self.0.get_vocab_size(false)
    }

    fn special_ids(&self) -> Vec<u32> {
        self.0
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect()
    }

    fn num_special_tokens_to_add(&self) -> usize {
        use tokenizers::PostProcessor;
        self.0
            .get_post_processor()
            .map_or(0, |p| p.added_tokens(false))
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let e = self
            .0
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("cannot encode: {e}"))?;
        Ok(e.get_ids().to_vec())
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.0
            .decode(ids, false)
            .map_err(|e| anyhow::anyhow!("cannot decode: {e}"))
    }
}

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRequest {
    pub prompt: String,
    /// Tokens the prompt encodes to (without special tokens).
    pub prompt_len: usize,
    /// `max_tokens` of the request.
    pub expected_output_len: usize,
    /// `x-request-id`.
    pub request_id: String,
}

/// Parameters of the random dataset.
#[derive(Debug, Clone, Copy)]
pub struct RandomParams {
    pub num_requests: usize,
    pub input_len: usize,
    pub output_len: usize,
    pub range_ratio: f64,
    pub prefix_len: usize,
    pub seed: u64,
    /// Draw prompt tokens from only this many token ids (0 = all, as vLLM):
    /// few distinct tokens route to few experts, a skewed expert load.
    pub token_pool: usize,
}

/// The inclusive ranges input and output lengths are drawn from. The input
/// range is around `input_len` less the special tokens the tokenizer adds; the
/// output range never reaches 0.
pub fn length_ranges(
    p: &RandomParams,
    num_special: usize,
) -> Result<((usize, usize), (usize, usize))> {
    if !(0.0..1.0).contains(&p.range_ratio) {
        bail!(
            "--random-range-ratio must be in [0, 1), got {}",
            p.range_ratio
        );
    }
    let real_input = p.input_len.saturating_sub(num_special) as f64;
    let input = (
        (real_input * (1.0 - p.range_ratio)).floor() as usize,
        (real_input * (1.0 + p.range_ratio)).ceil() as usize,
    );
    if p.prefix_len + input.0 < 1 {
        bail!(
            "--random-input-len is too small: with {num_special} special tokens and --random-range-ratio {}, \
             a prompt could have {} tokens; raise --random-input-len or --random-prefix-len",
            p.range_ratio,
            p.prefix_len + input.0
        );
    }
    let out = p.output_len as f64;
    let output = (
        ((out * (1.0 - p.range_ratio)).floor() as usize).max(1),
        ((out * (1.0 + p.range_ratio)).ceil() as usize).max(1),
    );
    Ok((input, output))
}

/// Decodes `tokens`, re-encodes the text and trims or tops up (with random
/// ids below the vocabulary size) until it encodes to `target` tokens, at most
/// `max_retry` times. Returns the prompt, the ids it encodes to, and how many
/// tokens it is off by at the end (positive: more than asked).
pub fn decode_to_target_len(
    tok: &dyn PromptTokenizer,
    mut tokens: Vec<u32>,
    target: usize,
    max_retry: usize,
    rng: &mut StdRng,
) -> Result<(String, Vec<u32>, i64)> {
    let vocab = tok.vocab_size().max(1) as u32;
    let mut tries_left = max_retry;
    loop {
        let prompt = tok.decode(&tokens)?;
        tokens = tok.encode(&prompt)?;
        if tries_left == 0 {
            let mismatch = tokens.len() as i64 - target as i64;
            return Ok((prompt, tokens, mismatch));
        }
        if tokens.len() == target {
            return Ok((prompt, tokens, 0));
        }
        if tokens.len() < target {
            let missing = target - tokens.len();
            tokens.extend((0..missing).map(|_| rng.random_range(0..vocab)));
        } else {
            tokens.truncate(target);
        }
        tries_left -= 1;
    }
}

/// Samples the random dataset. Request ids are `id_prefix` + index.
pub fn sample_random(
    tok: &dyn PromptTokenizer,
    p: &RandomParams,
    id_prefix: &str,
) -> Result<Vec<SampleRequest>> {
    let num_special = tok.num_special_tokens_to_add();
    let ((in_lo, in_hi), (out_lo, out_hi)) = length_ranges(p, num_special)?;
    let vocab = tok.vocab_size();
    let special = tok.special_ids();
    let allowed: Vec<u32> = (0..vocab as u32)
        .filter(|id| !special.contains(id))
        .collect();
    if allowed.is_empty() {
        bail!("the tokenizer has no non-special tokens to build prompts from");
    }
    tracing::info!(
        "sampling input_len from [{in_lo}, {in_hi}] and output_len from [{out_lo}, {out_hi}]"
    );
    let mut rng = StdRng::seed_from_u64(p.seed);
    let prefix: Vec<u32> = (0..p.prefix_len)
        .map(|_| allowed[rng.random_range(0..allowed.len())])
        .collect();
    let input_lens: Vec<usize> = (0..p.num_requests)
        .map(|_| rng.random_range(in_lo..=in_hi))
        .collect();
    let output_lens: Vec<usize> = (0..p.num_requests)
        .map(|_| rng.random_range(out_lo..=out_hi))
        .collect();
    let offsets: Vec<usize> = (0..p.num_requests)
        .map(|_| rng.random_range(0..vocab.max(1)))
        .collect();
    // Drawn after everything else so that without a pool the prompts are vLLM's.
    let allowed: Vec<u32> = if p.token_pool > 0 {
        (0..p.token_pool)
            .map(|_| allowed[rng.random_range(0..allowed.len())])
            .collect()
    } else {
        allowed
    };

    let mut requests = Vec::with_capacity(p.num_requests);
    let mut mismatch_total = 0i64;
    for i in 0..p.num_requests {
        let mut tokens = prefix.clone();
        tokens.extend((0..input_lens[i]).map(|j| allowed[(offsets[i] + i + j) % allowed.len()]));
        let target = p.prefix_len + input_lens[i];
        let (prompt, ids, mismatch) = decode_to_target_len(tok, tokens, target, 10, &mut rng)
            .with_context(|| format!("building random prompt {i}"))?;
        mismatch_total += mismatch;
        requests.push(SampleRequest {
            prompt,
            prompt_len: ids.len(),
            expected_output_len: output_lens[i],
            request_id: format!("{id_prefix}{i}"),
        });
    }
    if mismatch_total != 0 {
        let sign = if mismatch_total > 0 { "more" } else { "fewer" };
        eprintln!(
            "WARNING: across all generated prompts there were {} {sign} tokens than expected after \
             decoding and re-encoding; this is expected of the sampling procedure",
            mismatch_total.abs()
        );
    }
    Ok(requests)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One character per token: id i is the letter 'a' + i; id 0 is special.
    struct Letters;

    impl PromptTokenizer for Letters {
        fn vocab_size(&self) -> usize {
            26
        }
        fn special_ids(&self) -> Vec<u32> {
            vec![0]
        }
        fn num_special_tokens_to_add(&self) -> usize {
            1
        }
        fn encode(&self, text: &str) -> Result<Vec<u32>> {
            Ok(text.bytes().map(|b| u32::from(b - b'a')).collect())
        }
        fn decode(&self, ids: &[u32]) -> Result<String> {
            Ok(ids.iter().map(|&i| char::from(b'a' + i as u8)).collect())
        }
    }

    fn params(n: usize, input: usize, output: usize, ratio: f64) -> RandomParams {
        RandomParams {
            num_requests: n,
            input_len: input,
            output_len: output,
            range_ratio: ratio,
            prefix_len: 0,
            seed: 0,
            token_pool: 0,
        }
    }

    #[test]
    fn ranges_follow_vllm() {
        // 100 − 1 special token = 99; ±10 %: floor(89.1), ceil(108.9). Output
        // 50 · 1.1 is 55.000000000000007 in floats, so ceil gives 56, as in Python.
        let r = length_ranges(&params(1, 100, 50, 0.1), 1).expect("ranges");
        assert_eq!(r, ((89, 109), (45, 56)));
        // Output never 0.
        assert_eq!(
            length_ranges(&params(1, 20, 1, 0.9), 0).expect("ranges").1,
            (1, 2)
        );
        assert!(length_ranges(&params(1, 10, 1, 1.0), 0).is_err());
        // Only the special token fits: no room for a prompt.
        assert!(length_ranges(&params(1, 1, 1, 0.0), 1).is_err());
    }

    #[test]
    fn fixed_lengths_without_range() {
        let reqs = sample_random(&Letters, &params(5, 9, 7, 0.0), "bench-").expect("sample");
        assert_eq!(reqs.len(), 5);
        for (i, r) in reqs.iter().enumerate() {
            // 9 asked, less the one special token the tokenizer adds.
            assert_eq!(r.prompt_len, 8);
            assert_eq!(r.prompt.len(), 8);
            assert!(!r.prompt.contains('a'), "special id 0 used: {}", r.prompt);
            assert_eq!(r.expected_output_len, 7);
            assert_eq!(r.request_id, format!("bench-{i}"));
        }
        // Consecutive allowed ids from an offset.
        let b = reqs[0].prompt.as_bytes();
        assert!(
            b.windows(2)
                .all(|w| w[1] == w[0] + 1 || (w[0] == b'z' && w[1] == b'b'))
        );
    }

    #[test]
    fn lengths_stay_in_range_and_seed_reproduces() {
        let p = RandomParams {
            prefix_len: 3,
            ..params(50, 21, 40, 0.5)
        };
        let a = sample_random(&Letters, &p, "").expect("sample");
        for r in &a {
            assert!(
                (3 + 10..=3 + 30).contains(&r.prompt_len),
                "{}",
                r.prompt_len
            );
            assert!((20..=60).contains(&r.expected_output_len));
        }
        let prefix = &a[0].prompt[..3];
        assert!(a.iter().all(|r| r.prompt.starts_with(prefix)));
        assert_eq!(a, sample_random(&Letters, &p, "").expect("sample"));
        let other = sample_random(&Letters, &RandomParams { seed: 1, ..p }, "").expect("sample");
        assert_ne!(a, other);
    }

    #[test]
    fn a_token_pool_limits_the_prompt_tokens() {
        let p = RandomParams {
            token_pool: 2,
            ..params(20, 30, 4, 0.0)
        };
        let reqs = sample_random(&Letters, &p, "").expect("sample");
        let distinct: std::collections::BTreeSet<char> =
            reqs.iter().flat_map(|r| r.prompt.chars()).collect();
        assert!(distinct.len() <= 2, "{distinct:?}");
    }

    #[test]
    fn real_tokenizer_round_trips_to_the_asked_length() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_a/bf16");
        let tok = HfTokenizer::from_path(&dir).expect("fixture tokenizer");
        let reqs = sample_random(&tok, &params(8, 64, 16, 0.0), "").expect("sample");
        let special = tok.num_special_tokens_to_add();
        for r in &reqs {
            assert_eq!(tok.encode(&r.prompt).expect("encode").len(), r.prompt_len);
            // Within a few tokens of the target after the re-encode steps.
            assert!(r.prompt_len.abs_diff(64 - special) <= 4, "{}", r.prompt_len);
        }
        assert!(HfTokenizer::from_path(Path::new("/nonexistent")).is_err());
    }
}
