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

/// The ids random prompts are drawn from: the vocabulary less its special tokens.
fn prompt_token_ids(tok: &dyn PromptTokenizer) -> Result<Vec<u32>> {
    let special = tok.special_ids();
    let allowed: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|id| !special.contains(id))
        .collect();
    if allowed.is_empty() {
        bail!("the tokenizer has no non-special tokens to build prompts from");
    }
    Ok(allowed)
}

/// Samples the random dataset. Request ids are `id_prefix` + index.
pub fn sample_random(
    tok: &dyn PromptTokenizer,
    p: &RandomParams,
    id_prefix: &str,
) -> Result<Vec<SampleRequest>> {
    let num_special = tok.num_special_tokens_to_add();
    let ((in_lo, in_hi), (out_lo, out_hi)) = length_ranges(p, num_special)?;
    let allowed = prompt_token_ids(tok)?;
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
        .map(|_| rng.random_range(0..tok.vocab_size().max(1)))
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

/// Parameters of the ShareGPT dataset.
#[derive(Debug, Clone)]
pub struct ShareGptParams {
    pub num_requests: usize,
    pub seed: u64,
    /// `max_tokens` for every request instead of the reply's token count
    /// (`--sharegpt-output-len`).
    pub output_len: Option<usize>,
}

/// The first human turn of a ShareGPT conversation and the gpt reply after
/// it (None: the conversation has no such pair).
fn sharegpt_pair(conv: &serde_json::Value) -> Option<(&str, &str)> {
    let turns = conv.get("conversations")?.as_array()?;
    fn from(t: &serde_json::Value) -> Option<&str> {
        t.get("from").and_then(|f| f.as_str())
    }
    fn value(t: &serde_json::Value) -> Option<&str> {
        t.get("value").and_then(|v| v.as_str())
    }
    let h = turns.iter().position(|t| from(t) == Some("human"))?;
    let prompt = value(&turns[h])?;
    let reply = turns[h + 1..]
        .iter()
        .find(|t| from(t) == Some("gpt"))
        .and_then(value)?;
    Some((prompt, reply))
}

/// Samples vLLM's ShareGPT format (a JSON list of `{"conversations":
/// [{"from": "human" | "gpt", "value": ...}, ...]}`) as vLLM's
/// ShareGPTDataset does: conversations shuffled with the seed; each gives its
/// first human turn as the prompt and the token count of the gpt reply after
/// it as `max_tokens` (or `output_len`); pairs with a prompt or reply under 4
/// tokens, a prompt over 1024 or both over 2048 are skipped; the first
/// `num_requests` kept are used.
pub fn sample_sharegpt(
    tok: &dyn PromptTokenizer,
    text: &str,
    p: &ShareGptParams,
    id_prefix: &str,
) -> Result<Vec<SampleRequest>> {
    let data: serde_json::Value =
        serde_json::from_str(text).context("the ShareGPT file is not valid JSON")?;
    let Some(list) = data.as_array() else {
        bail!("the ShareGPT file must hold a JSON list of conversations");
    };
    let mut pairs: Vec<(&str, &str)> = list.iter().filter_map(sharegpt_pair).collect();
    if pairs.is_empty() {
        bail!("the ShareGPT file has no conversation with a human turn followed by a gpt reply");
    }
    // Fisher-Yates with the seed.
    let mut rng = StdRng::seed_from_u64(p.seed);
    for i in (1..pairs.len()).rev() {
        let j = rng.random_range(0..=i);
        pairs.swap(i, j);
    }
    let mut requests = Vec::with_capacity(p.num_requests);
    for (prompt, reply) in pairs {
        if requests.len() >= p.num_requests {
            break;
        }
        let prompt_len = tok.encode(prompt)?.len();
        let output_len = match p.output_len {
            Some(n) => n,
            None => tok.encode(reply)?.len(),
        };
        // vLLM's is_valid_sequence (min 4, prompt <= 1024, total <= 2048;
        // the output minimum is waived for a fixed output length).
        if prompt_len < 4
            || (p.output_len.is_none() && output_len < 4)
            || output_len == 0
            || prompt_len > 1024
            || prompt_len + output_len > 2048
        {
            continue;
        }
        requests.push(SampleRequest {
            prompt: prompt.to_string(),
            prompt_len,
            expected_output_len: output_len,
            request_id: format!("{id_prefix}{}", requests.len()),
        });
    }
    if requests.is_empty() {
        bail!("no ShareGPT conversation fits (prompt 4..=1024 tokens, reply >= 4, both <= 2048)");
    }
    if requests.len() < p.num_requests {
        eprintln!(
            "WARNING: the ShareGPT file gives {} usable prompts, fewer than --num-prompts {}; \
             sending those",
            requests.len(),
            p.num_requests
        );
    }
    Ok(requests)
}

/// Parameters of the shared-prefix dataset (vLLM's prefix_repetition).
#[derive(Debug, Clone, Copy)]
pub struct PrefixParams {
    pub num_requests: usize,
    pub prefix_len: usize,
    pub suffix_len: usize,
    pub num_prefixes: usize,
    pub output_len: usize,
    pub seed: u64,
}

/// Samples shared-prefix prompts as vLLM's PrefixRepetitionRandomDataset:
/// `num_prefixes` random prefixes of `prefix_len` tokens, each followed in
/// its share of the requests by a fresh random suffix of `suffix_len` tokens
/// (texts that re-encode to those lengths), the requests shuffled with the
/// seed. Prefix caching computes each prefix once.
pub fn sample_prefix_repetition(
    tok: &dyn PromptTokenizer,
    p: &PrefixParams,
    id_prefix: &str,
) -> Result<Vec<SampleRequest>> {
    if p.num_prefixes == 0 || p.suffix_len + p.prefix_len == 0 || p.output_len == 0 {
        bail!(
            "--prefix-repetition-num-prefixes, --prefix-repetition-output-len and one of the prefix or suffix lengths must be positive"
        );
    }
    let allowed = prompt_token_ids(tok)?;
    let mut rng = StdRng::seed_from_u64(p.seed);
    let random_text = |n: usize, rng: &mut StdRng| -> Result<(String, usize)> {
        if n == 0 {
            return Ok((String::new(), 0));
        }
        let ids: Vec<u32> = (0..n)
            .map(|_| allowed[rng.random_range(0..allowed.len())])
            .collect();
        let (text, ids, _) = decode_to_target_len(tok, ids, n, 10, rng)?;
        Ok((text, ids.len()))
    };
    let mut requests = Vec::with_capacity(p.num_requests);
    let prefixes = (0..p.num_prefixes)
        .map(|_| random_text(p.prefix_len, &mut rng))
        .collect::<Result<Vec<_>>>()?;
    for i in 0..p.num_requests {
        let (prefix, _) = &prefixes[i % p.num_prefixes];
        let (suffix, _) = random_text(p.suffix_len, &mut rng)?;
        let prompt = format!("{prefix}{suffix}");
        let prompt_len = tok.encode(&prompt)?.len();
        requests.push(SampleRequest {
            prompt,
            prompt_len,
            expected_output_len: p.output_len,
            request_id: String::new(),
        });
    }
    for i in (1..requests.len()).rev() {
        let j = rng.random_range(0..=i);
        requests.swap(i, j);
    }
    for (i, r) in requests.iter_mut().enumerate() {
        r.request_id = format!("{id_prefix}{i}");
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

    #[test]
    fn sharegpt_takes_the_first_human_turn_and_the_reply_length() {
        let text = serde_json::json!([
            {"id": "a", "conversations": [
                {"from": "human", "value": "bcdefg"},
                {"from": "gpt", "value": "hijklmnop"},
                {"from": "human", "value": "zzzz"},
                {"from": "gpt", "value": "yyyy"}]},
            {"id": "b", "conversations": [
                {"from": "system", "value": "sys"},
                {"from": "human", "value": "qrstu"},
                {"from": "gpt", "value": "vwxy"}]},
            // Too short a prompt, no reply, no conversations: skipped.
            {"id": "c", "conversations": [
                {"from": "human", "value": "bc"}, {"from": "gpt", "value": "defgh"}]},
            {"id": "d", "conversations": [{"from": "human", "value": "bcdefgh"}]},
            {"id": "e"}
        ])
        .to_string();
        let p = ShareGptParams {
            num_requests: 10,
            seed: 0,
            output_len: None,
        };
        let mut reqs = sample_sharegpt(&Letters, &text, &p, "r-").expect("sample");
        assert_eq!(reqs.len(), 2);
        assert_eq!(reqs[1].request_id, "r-1");
        reqs.sort_by(|x, y| x.prompt.cmp(&y.prompt));
        assert_eq!(
            (
                reqs[0].prompt.as_str(),
                reqs[0].prompt_len,
                reqs[0].expected_output_len
            ),
            ("bcdefg", 6, 9)
        );
        assert_eq!(
            (
                reqs[1].prompt.as_str(),
                reqs[1].prompt_len,
                reqs[1].expected_output_len
            ),
            ("qrstu", 5, 4)
        );
        // A fixed output length; fewer prompts than asked is not an error.
        let one = ShareGptParams {
            num_requests: 1,
            output_len: Some(3),
            ..p
        };
        let r = sample_sharegpt(&Letters, &text, &one, "").expect("sample");
        assert_eq!((r.len(), r[0].expected_output_len), (1, 3));
        assert!(sample_sharegpt(&Letters, "{}", &p, "").is_err());
        assert!(sample_sharegpt(&Letters, "[{\"id\": 1}]", &p, "").is_err());
        assert!(sample_sharegpt(&Letters, "not json", &p, "").is_err());
    }

    #[test]
    fn sharegpt_order_follows_the_seed() {
        let convs: Vec<serde_json::Value> = (0..20u8)
            .map(|i| {
                let word: String = (0..6).map(|k| char::from(b'b' + (i + k) % 24)).collect();
                serde_json::json!({"conversations": [
                    {"from": "human", "value": word}, {"from": "gpt", "value": "bcdefgh"}]})
            })
            .collect();
        let text = serde_json::Value::Array(convs).to_string();
        let p = |seed| ShareGptParams {
            num_requests: 5,
            seed,
            output_len: None,
        };
        let a = sample_sharegpt(&Letters, &text, &p(0), "").expect("sample");
        assert_eq!(
            a,
            sample_sharegpt(&Letters, &text, &p(0), "").expect("sample")
        );
        assert_ne!(
            a,
            sample_sharegpt(&Letters, &text, &p(1), "").expect("sample")
        );
    }

    #[test]
    fn prefix_repetition_shares_each_prefix() {
        let p = PrefixParams {
            num_requests: 12,
            prefix_len: 10,
            suffix_len: 4,
            num_prefixes: 3,
            output_len: 5,
            seed: 7,
        };
        let reqs = sample_prefix_repetition(&Letters, &p, "x").expect("sample");
        assert_eq!(reqs.len(), 12);
        let mut groups: std::collections::BTreeMap<&str, usize> = Default::default();
        for r in &reqs {
            assert_eq!(r.prompt_len, 14);
            assert_eq!(r.expected_output_len, 5);
            assert!(!r.prompt.contains('a'), "special id 0 used");
            *groups.entry(&r.prompt[..10]).or_default() += 1;
        }
        assert_eq!(groups.len(), 3);
        assert!(groups.values().all(|&n| n == 4), "{groups:?}");
        assert_eq!(
            reqs,
            sample_prefix_repetition(&Letters, &p, "x").expect("sample")
        );
        assert!(
            sample_prefix_repetition(
                &Letters,
                &PrefixParams {
                    num_prefixes: 0,
                    ..p
                },
                ""
            )
            .is_err()
        );
    }
}
