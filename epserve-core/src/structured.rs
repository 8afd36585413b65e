//! Structured output: generation constrained to a JSON schema, a regular
//! expression, a list of choices or a Lark grammar, with
//! [llguidance](https://github.com/guidance-ai/llguidance) (the engine vLLM,
//! SGLang and llama.cpp use).
//!
//! - [`Constraint`] is what a request asks for (the OpenAI layer builds it
//!   from `response_format`, `structured_outputs`, `guided_*`; the tool-call
//!   layer builds it for `tool_choice: required` / a named function).
//! - [`StructuredOutput`] (one per [`Engine`](crate::engine::Engine), built on
//!   first use from the model's tokenizer) compiles a constraint into a
//!   [`CompiledConstraint`]: once per distinct grammar text (a small cache
//!   keeps the compiled grammar, its lexer state and its first mask).
//! - [`Guide`] is one sequence's matcher: [`Guide::apply`] masks the logits
//!   before sampling, [`Guide::commit`] feeds it the sampled token,
//!   [`Guide::prefetch`] starts computing the next mask on the rayon pool so
//!   it overlaps the next forward pass instead of adding to the step.
//!
//! The token trie llguidance needs is built here from our `tokenizers`
//! tokenizer (byte-level BPE or SentencePiece byte-fallback vocabularies),
//! not with `toktrie_hf_tokenizers`, which pins an older `tokenizers`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

/// What the output must conform to.
///
/// Each variant is compiled against the model's tokenizer by
/// [`StructuredOutput::compile`] (reached through
/// [`Engine::compile_constraint`](crate::engine::Engine::compile_constraint)),
/// which returns an error message naming the problem for an invalid schema,
/// regex or grammar. The generated text always matches the whole constraint
/// (it is anchored at both ends); the sequence finishes as soon as the
/// grammar cannot continue, and an end-of-sequence token is only allowed
/// where the grammar accepts.
///
/// - `JsonSchema(schema)`: a JSON value valid under `schema` (llguidance's
///   JSON Schema subset: types, `properties`, `required`,
///   `additionalProperties`, `items`, `enum`, `const`, `anyOf`/`oneOf`,
///   `$ref` to `#/...`, string `pattern`/`format`/length, numeric bounds,
///   array lengths). Unless the schema has its own `"x-guidance"` options
///   (llguidance's, e.g. `{"whitespace_flexible": true}`), the JSON is
///   compact, without whitespace between tokens ([`JSON_DEFAULTS`]), so a
///   model cannot spend its whole budget on blanks.
/// - `JsonObject`: any JSON object (`response_format: {"type": "json_object"}`).
/// - `Regex(rx)`: text matching the regular expression (Rust `regex` syntax).
/// - `Choice(options)`: exactly one of the strings.
/// - `Lark(grammar)`: a context-free grammar in llguidance's Lark dialect,
///   rule `start` first. Its extensions make tool calls easy to enforce:
///   `%json { ...schema... }` embeds a JSON schema anywhere in a rule (use
///   [`lark_json`] to write one with this module's whitespace default), and
///   `<|special|>` names a special token, e.g.
///   `start: "<tool_call>\n" %json {"type": "object"} "\n</tool_call>"`.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    JsonSchema(Value),
    JsonObject,
    Regex(String),
    Choice(Vec<String>),
    Lark(String),
}

/// llguidance's JSON options used when a schema has no `"x-guidance"` of its
/// own: compact JSON (vLLM's `disable_any_whitespace`). Flexible whitespace
/// lets a weak model emit blanks until `max_tokens` runs out.
pub const JSON_DEFAULTS: &str = r#"{"whitespace_flexible": false}"#;

/// Grammars kept compiled, most recently used last.
const CACHE_ENTRIES: usize = 64;

/// `schema` with the module's JSON options added (when it has none of its
/// own): what [`Constraint::JsonSchema`] compiles.
pub fn with_json_defaults(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Value::Object(m) = &mut s
        && !m.contains_key("x-guidance")
    {
        m.insert(
            "x-guidance".into(),
            serde_json::json!({ "whitespace_flexible": false }),
        );
    }
    s
}

/// `%json {...}` for a Lark grammar: `schema` with the module's defaults
/// (see [`Constraint::Lark`]).
pub fn lark_json(schema: &Value) -> String {
    format!("%json {}", with_json_defaults(schema))
}

/// A string as a Lark literal (JSON string syntax; DEL escaped, which Lark's
/// lexer does not take raw).
pub fn lark_literal(s: &str) -> String {
    serde_json::to_string(s)
        .unwrap_or_default()
        .replace('\u{7f}', "\\u007f")
}

impl Constraint {
    /// The kind, as the API names it in messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::JsonObject => "json_object",
            Constraint::Regex(_) => "regex",
            Constraint::Choice(_) => "choice",
            Constraint::Lark(_) => "grammar",
        }
    }

    /// The grammar to compile and its cache key (its full text).
    fn grammar(&self) -> Result<(String, TopLevelGrammar), String> {
        Ok(match self {
            Constraint::JsonSchema(schema) => {
                let s = with_json_defaults(schema);
                (format!("json\0{s}"), TopLevelGrammar::from_json_schema(s))
            }
            Constraint::JsonObject => {
                let s = with_json_defaults(&serde_json::json!({"type": "object"}));
                (format!("json\0{s}"), TopLevelGrammar::from_json_schema(s))
            }
            Constraint::Regex(rx) => (format!("regex\0{rx}"), TopLevelGrammar::from_regex(rx)),
            Constraint::Choice(options) => {
                if options.is_empty() {
                    return Err("the list of choices is empty".into());
                }
                let alts: Vec<String> = options.iter().map(|o| lark_literal(o)).collect();
                let g = format!("start: {}\n", alts.join(" | "));
                (format!("lark\0{g}"), TopLevelGrammar::from_lark(g))
            }
            Constraint::Lark(g) => (format!("lark\0{g}"), TopLevelGrammar::from_lark(g.clone())),
        })
    }
}

/// A compiled grammar in its initial state, shared by every request using
/// the same grammar text.
struct Template {
    matcher: Matcher,
    first_mask: SimpleVob,
}

/// A constraint compiled for the model's tokenizer: cheap to clone; each
/// sequence it guides gets its own [`Guide`] from [`start`](Self::start).
#[derive(Clone)]
pub struct CompiledConstraint {
    constraint: Arc<Constraint>,
    template: Arc<Mutex<Template>>,
}

impl std::fmt::Debug for CompiledConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CompiledConstraint")
            .field(&self.constraint)
            .finish()
    }
}

impl CompiledConstraint {
    /// What was compiled.
    pub fn constraint(&self) -> &Constraint {
        &self.constraint
    }

    /// A fresh matcher for one sequence (nothing generated yet).
    pub fn start(&self) -> Guide {
        let t = self
            .template
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        Guide {
            state: State::Ready(Box::new(t.matcher.clone()), Some(t.first_mask.clone())),
            stats: GuideStats::default(),
        }
    }
}

/// Time spent on one sequence's masks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GuideStats {
    /// Masks computed (the first one comes with the compiled grammar).
    pub masks: u64,
    /// Time computing them, wherever that ran.
    pub compute: Duration,
    /// Of it, time the caller of [`Guide::apply`] waited (the part on the
    /// step's critical path).
    pub waited: Duration,
}

type MaskResult = (Box<Matcher>, Result<SimpleVob, String>, Duration);

enum State {
    /// The matcher, and the mask for the next token if computed.
    Ready(Box<Matcher>, Option<SimpleVob>),
    /// The next mask is being computed on the rayon pool.
    Computing(mpsc::Receiver<MaskResult>),
    /// The matcher failed; every later call reports this.
    Failed(String),
}

/// One sequence's grammar state.
pub struct Guide {
    state: State,
    stats: GuideStats,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide").field("stats", &self.stats).finish()
    }
}

fn compute(mut m: Box<Matcher>) -> MaskResult {
    let t = Instant::now();
    let r = m.compute_mask().map_err(|e| e.to_string());
    (m, r, t.elapsed())
}

impl Guide {
    /// Time spent on masks so far.
    pub fn stats(&self) -> GuideStats {
        self.stats
    }

    /// Makes the mask for the next token available (waiting for a
    /// prefetched one, or computing it here).
    fn ready(&mut self) -> Result<(), String> {
        let state = std::mem::replace(&mut self.state, State::Failed(String::new()));
        self.state = match state {
            State::Computing(rx) => {
                let t = Instant::now();
                let got = rx.recv();
                self.stats.waited += t.elapsed();
                match got {
                    Ok((m, Ok(mask), took)) => {
                        self.stats.masks += 1;
                        self.stats.compute += took;
                        State::Ready(m, Some(mask))
                    }
                    Ok((_, Err(e), _)) => State::Failed(e),
                    Err(_) => State::Failed("the grammar's mask computation panicked".into()),
                }
            }
            State::Ready(m, None) => {
                let (m, r, took) = compute(m);
                self.stats.masks += 1;
                self.stats.compute += took;
                self.stats.waited += took;
                match r {
                    Ok(mask) => State::Ready(m, Some(mask)),
                    Err(e) => State::Failed(e),
                }
            }
            s => s,
        };
        match &self.state {
            State::Failed(e) => Err(e.clone()),
            _ => Ok(()),
        }
    }

    /// Sets the logit of every token the grammar does not allow next to
    /// −∞. Fails if the matcher failed or allows nothing.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), String> {
        self.ready()?;
        let State::Ready(_, Some(mask)) = &self.state else {
            return Err("the grammar's mask is missing".into());
        };
        let words = mask.as_slice();
        let mut any = false;
        for (i, chunk) in logits.chunks_mut(32).enumerate() {
            let w = words.get(i).copied().unwrap_or(0);
            if w == u32::MAX {
                any |= chunk.iter().any(|l| !l.is_nan());
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if (w >> b) & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                } else if !l.is_nan() {
                    any = true;
                }
            }
        }
        if !any {
            return Err("the grammar allows no token here".into());
        }
        Ok(())
    }

    /// Whether `token` is allowed next (computes the mask if needed).
    pub fn allows(&mut self, token: u32) -> Result<bool, String> {
        self.ready()?;
        match &self.state {
            State::Ready(_, Some(mask)) => {
                Ok((token as usize) < mask.len() && mask.get(token as usize))
            }
            _ => Err("the grammar's mask is missing".into()),
        }
    }

    /// Feeds the sampled token. Returns true when the grammar is complete
    /// (nothing may follow: the sequence should finish).
    pub fn commit(&mut self, token: u32) -> Result<bool, String> {
        if matches!(self.state, State::Computing(_)) {
            self.ready()?;
        }
        let state = std::mem::replace(&mut self.state, State::Failed(String::new()));
        let (next, done) = match state {
            State::Ready(mut m, _) => match m.consume_token(token) {
                Ok(()) => {
                    let done = m.is_stopped();
                    (State::Ready(m, None), Ok(done))
                }
                Err(e) => {
                    let msg = format!("the grammar rejected token {token}: {e}");
                    (State::Failed(msg.clone()), Err(msg))
                }
            },
            State::Failed(e) => (State::Failed(e.clone()), Err(e)),
            State::Computing(_) => unreachable_state(),
        };
        self.state = next;
        done
    }

    /// Starts computing the next token's mask on the rayon pool (after
    /// [`commit`](Self::commit)), so [`apply`](Self::apply) finds it ready.
    pub fn prefetch(&mut self) {
        let state = std::mem::replace(&mut self.state, State::Failed(String::new()));
        self.state = match state {
            State::Ready(m, None) => {
                let (tx, rx) = mpsc::sync_channel(1);
                rayon::spawn(move || {
                    // A dropped receiver (the request went away) is fine.
                    let _ = tx.send(compute(m));
                });
                State::Computing(rx)
            }
            s => s,
        };
    }
}

/// `commit` resolves `Computing` first; this keeps the match total without
/// a panic path.
fn unreachable_state() -> (State, Result<bool, String>) {
    let msg = "internal error: the grammar's state was lost".to_string();
    (State::Failed(msg.clone()), Err(msg))
}

/// The model's tokenizer as llguidance sees it: the token trie and a way to
/// tokenize forced text.
struct TokenizerAdapter {
    trie: TokTrie,
    hf: tokenizers::Tokenizer,
    canonical: bool,
}

impl TokenizerAdapter {
    fn encode(&self, s: &str) -> Vec<TokenId> {
        match self.hf.encode(s, false) {
            Ok(e) => e.get_ids().to_vec(),
            Err(_) => self.trie.greedy_tokenize(s.as_bytes()),
        }
    }
}

impl TokenizerEnv for TokenizerAdapter {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie
            .tokenize_with_greedy_fallback(s, |text| self.encode(text))
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}

/// How a vocabulary spells bytes.
#[derive(Debug, Default)]
struct DecoderKind {
    byte_level: bool,
    byte_fallback: bool,
    /// The character SentencePiece uses for a space (`▁`).
    space: Option<char>,
}

fn inspect_decoder(v: &Value, k: &mut DecoderKind) {
    match v.get("type").and_then(Value::as_str) {
        Some("ByteLevel") => k.byte_level = true,
        Some("ByteFallback") => k.byte_fallback = true,
        Some("Replace") if v.get("content").and_then(Value::as_str) == Some(" ") => {
            let pat = v.pointer("/pattern/String").and_then(Value::as_str);
            if let Some(p) = pat {
                let mut cs = p.chars();
                if let (Some(c), None) = (cs.next(), cs.next()) {
                    k.space = Some(c);
                }
            }
        }
        Some("Metaspace") => {
            if let Some(c) = v
                .get("replacement")
                .and_then(Value::as_str)
                .and_then(|s| s.chars().next())
            {
                k.space = Some(c);
            }
        }
        _ => {}
    }
    if let Some(list) = v.get("decoders").and_then(Value::as_array) {
        for d in list {
            inspect_decoder(d, k);
        }
    }
}

/// GPT-2's byte-level alphabet: printable Latin-1 bytes stand for
/// themselves, the other bytes for the code points from U+0100 on, in order.
fn byte_level_alphabet() -> HashMap<char, u8> {
    let mut map = HashMap::with_capacity(256);
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let printable = matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
        let c = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next);
            next += 1;
            match c {
                Some(c) => c,
                None => continue,
            }
        };
        map.insert(c, b);
    }
    map
}

/// The bytes each token id stands for (`vocab` entries; special tokens
/// marked with [`TokTrie::SPECIAL_TOKEN_MARKER`], ids the tokenizer does not
/// define as placeholder special tokens).
fn token_bytes(hf: &tokenizers::Tokenizer, vocab: usize) -> Result<Vec<Vec<u8>>, String> {
    let mut kind = DecoderKind::default();
    if let Some(d) = hf.get_decoder() {
        let v = serde_json::to_value(d).map_err(|e| format!("cannot inspect the decoder: {e}"))?;
        inspect_decoder(&v, &mut kind);
    }
    if !kind.byte_level && !kind.byte_fallback {
        return Err(
            "the tokenizer is neither byte-level BPE nor byte-fallback: its tokens cannot be mapped to bytes"
                .into(),
        );
    }
    let special = |name: &str| {
        let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        b.extend_from_slice(name.as_bytes());
        b
    };
    let added = hf.get_added_tokens_decoder();
    let alphabet = byte_level_alphabet();
    let space = kind.space.unwrap_or('\u{2581}');
    let mut out = Vec::with_capacity(vocab);
    for id in 0..vocab as u32 {
        let bytes = if let Some(a) = added.get(&id) {
            if a.special {
                special(&a.content)
            } else {
                a.content.as_bytes().to_vec()
            }
        } else if let Some(tok) = hf.id_to_token(id) {
            if kind.byte_level {
                let mapped: Option<Vec<u8>> =
                    tok.chars().map(|c| alphabet.get(&c).copied()).collect();
                // A token outside the byte alphabet can never be produced.
                mapped.unwrap_or_default()
            } else if let Some(b) = tok
                .strip_prefix("<0x")
                .and_then(|h| h.strip_suffix('>'))
                .filter(|h| h.len() == 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                vec![b]
            } else {
                tok.replace(space, " ").into_bytes()
            }
        } else {
            special(&format!("<[{id}]>"))
        };
        out.push(bytes);
    }
    Ok(out)
}

/// Compiles constraints for one model's tokenizer.
pub struct StructuredOutput {
    factory: ParserFactory,
    cache: Mutex<Cache>,
    /// The end-of-sequence tokens (allowed where a grammar accepts).
    eos: Vec<u32>,
}

#[derive(Default)]
struct Cache {
    map: HashMap<String, Arc<Mutex<Template>>>,
    order: VecDeque<String>,
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

impl StructuredOutput {
    /// Builds the token trie for `hf` padded to `vocab` ids (the model's
    /// logits width), with `eos` as the end-of-sequence tokens.
    pub fn new(hf: &tokenizers::Tokenizer, vocab: usize, eos: &[u32]) -> Result<Self, String> {
        let eos: Vec<u32> = eos
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        let Some(&first_eos) = eos.first() else {
            return Err("the model has no end-of-sequence token".into());
        };
        let bytes = token_bytes(hf, vocab)?;
        let info = TokRxInfo::new(vocab as u32, first_eos);
        let trie = std::panic::catch_unwind(|| TokTrie::from(&info, &bytes).with_eos_tokens(&eos))
            .map_err(|p| format!("cannot build the token trie: {}", panic_message(p)))?;
        let mut env = TokenizerAdapter {
            trie,
            hf: hf.clone(),
            canonical: false,
        };
        // Forcing text by tokenizing it is only right when the tokenizer
        // does not add anything (a prefix space) to what it is given.
        env.canonical = ["a", "\"", " a", "{\"k\": [1, 2]}", "\n"]
            .iter()
            .all(|s| env.trie.decode(&env.encode(s)) == s.as_bytes());
        let env: TokEnv = Arc::new(env);
        let mut factory = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ParserFactory::new_simple(&env)
        }))
        .map_err(|p| format!("cannot set up the grammar engine: {}", panic_message(p)))?
        .map_err(|e| format!("cannot set up the grammar engine: {e}"))?;
        factory.quiet();
        factory.limits_mut().verbose_errors = false;
        Ok(StructuredOutput {
            factory,
            cache: Mutex::new(Cache::default()),
            eos,
        })
    }

    /// The end-of-sequence tokens the grammars allow where they accept.
    pub fn eos_tokens(&self) -> &[u32] {
        &self.eos
    }

    /// Compiles `c` (or takes it from the cache). The error names the
    /// problem (an invalid schema, regex or grammar).
    pub fn compile(&self, c: Constraint) -> Result<CompiledConstraint, String> {
        let (key, grammar) = c.grammar()?;
        let hit = {
            let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            let hit = cache.map.get(&key).cloned();
            if hit.is_some() {
                cache.order.retain(|k| k != &key);
                cache.order.push_back(key.clone());
            }
            hit
        };
        if let Some(template) = hit {
            return Ok(CompiledConstraint {
                constraint: Arc::new(c),
                template,
            });
        }
        let what = c.kind();
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let parser = self
                .factory
                .create_parser(grammar)
                .map_err(|e| e.to_string())?;
            let mut matcher = Matcher::new(Ok(parser));
            let first_mask = matcher.compute_mask().map_err(|e| e.to_string())?;
            Ok::<_, String>(Template {
                matcher,
                first_mask,
            })
        }));
        let template = match built {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => return Err(format!("invalid {what}: {}", first_line(&e))),
            Err(p) => {
                return Err(format!(
                    "invalid {what}: the compiler failed: {}",
                    panic_message(p)
                ));
            }
        };
        let template = Arc::new(Mutex::new(template));
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if !cache.map.contains_key(&key) {
            if cache.order.len() >= CACHE_ENTRIES
                && let Some(old) = cache.order.pop_front()
            {
                cache.map.remove(&old);
            }
            cache.order.push_back(key.clone());
            cache.map.insert(key, template.clone());
        }
        Ok(CompiledConstraint {
            constraint: Arc::new(c),
            template,
        })
    }
}

/// llguidance's message on one line, at most 500 bytes.
fn first_line(s: &str) -> String {
    let mut line = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.len() > 500 {
        let mut cut = 500;
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        line.truncate(cut);
        line.push('…');
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::tokenizer::Tokenizer;
    use serde_json::json;

    fn fixture() -> (Tokenizer, StructuredOutput) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/qwen3_moe_a/f32");
        let tok = Tokenizer::from_dir(&dir).expect("tokenizer");
        let cfg = crate::config::ModelConfig::from_dir(&dir).expect("config");
        let eos = tok
            .eos_token
            .as_deref()
            .and_then(|t| tok.token_to_id(t))
            .expect("eos");
        let so = StructuredOutput::new(tok.hf(), cfg.vocab_size, &[eos]).expect("structured");
        (tok, so)
    }

    /// Generates under `c` from pseudo-random logits (seeded): the text and
    /// whether it ended with an end-of-sequence token or by the grammar
    /// completing (false: `max` tokens were not enough).
    fn generate(
        tok: &Tokenizer,
        so: &StructuredOutput,
        c: Constraint,
        seed: u64,
        max: usize,
    ) -> (String, bool) {
        let compiled = so.compile(c).expect("compile");
        let mut g = compiled.start();
        let vocab = so.factory.tok_env().tok_trie().vocab_size();
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut out = Vec::new();
        for step in 0..max {
            let mut logits: Vec<f32> = (0..vocab)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 40) as f32 / (1u64 << 24) as f32 * 8.0
                })
                .collect();
            g.apply(&mut logits).expect("mask");
            let t = crate::sampling::argmax(&logits);
            assert!(logits[t as usize].is_finite());
            if so.eos_tokens().contains(&t) {
                return (tok.decode(&out, true).expect("decode"), true);
            }
            out.push(t);
            let done = g.commit(t).expect("commit");
            if done {
                return (tok.decode(&out, true).expect("decode"), true);
            }
            if step % 2 == 0 {
                g.prefetch();
            }
        }
        (tok.decode(&out, true).expect("decode"), false)
    }

    #[test]
    fn token_bytes_match_the_tokenizer() {
        let (tok, so) = fixture();
        let trie = so.factory.tok_env().tok_trie();
        for id in 0..tok.vocab_size() as u32 {
            if trie.is_special_token(id) {
                continue;
            }
            let text = tok.decode(&[id], false).expect("decode");
            if !text.contains('\u{fffd}') {
                assert_eq!(trie.token(id), text.as_bytes(), "token {id}");
            }
        }
        // The model's padding ids are placeholders, never allowed.
        assert!(trie.is_special_token(383));
        assert_eq!(trie.vocab_size(), 384);
    }

    #[test]
    fn json_schema_output_parses_and_validates() {
        let (tok, so) = fixture();
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "kind": {"enum": ["a", "b"]},
            },
            "required": ["name", "age", "kind"],
            "additionalProperties": false,
        });
        for seed in 0..8 {
            let (text, done) =
                generate(&tok, &so, Constraint::JsonSchema(schema.clone()), seed, 200);
            assert!(done, "seed {seed}: unfinished {text:?}");
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            let o = v.as_object().expect("object");
            assert_eq!(o.len(), 3, "{text}");
            assert!(o["name"].as_str().expect("name").chars().count() <= 6);
            assert!((0..=120).contains(&o["age"].as_i64().expect("age")));
            assert!(["a", "b"].contains(&o["kind"].as_str().expect("kind")));
        }
        // Any JSON object.
        let (text, done) = generate(&tok, &so, Constraint::JsonObject, 3, 400);
        if done {
            assert!(
                serde_json::from_str::<Value>(&text)
                    .expect("json")
                    .is_object()
            );
        } else {
            assert!(text.starts_with('{'), "{text}");
        }
    }

    #[test]
    fn regex_choice_and_lark() {
        let (tok, so) = fixture();
        for seed in 0..5 {
            let (text, done) = generate(
                &tok,
                &so,
                Constraint::Regex(r"[0-9]{3}-[a-z]{2,4}".into()),
                seed,
                40,
            );
            assert!(done, "{text:?}");
            let b = text.as_bytes();
            assert!(
                b.len() >= 6
                    && b.len() <= 8
                    && b[..3].iter().all(u8::is_ascii_digit)
                    && b[3] == b'-',
                "{text}"
            );
            assert!(b[4..].iter().all(u8::is_ascii_lowercase), "{text}");

            let choices = vec!["yes".to_string(), "no \"quoted\"\n".into(), "maybe".into()];
            let (text, done) = generate(&tok, &so, Constraint::Choice(choices.clone()), seed, 40);
            assert!(done && choices.contains(&text), "{text:?}");

            let lark = format!(
                "start: \"<tool_call>\" {} \"</tool_call>\"",
                lark_json(&json!({
                    "type": "object",
                    "properties": {"name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"], "additionalProperties": false}},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                }))
            );
            let (text, done) = generate(&tok, &so, Constraint::Lark(lark), seed, 200);
            assert!(done, "{text:?}");
            let inner = text
                .strip_prefix("<tool_call>")
                .and_then(|t| t.strip_suffix("</tool_call>"))
                .unwrap_or_else(|| panic!("{text:?}"));
            let v: Value = serde_json::from_str(inner).expect("json");
            assert_eq!(v["name"], "get_weather");
            assert!(v["arguments"]["city"].is_string());
        }
    }

    #[test]
    fn end_of_sequence_only_where_the_grammar_accepts() {
        let (_, so) = fixture();
        let eos = so.eos_tokens()[0];
        // "a+" accepts after one "a" and may go on: EOS allowed then, not before.
        let c = so.compile(Constraint::Regex("a+".into())).expect("compile");
        let mut g = c.start();
        assert!(!g.allows(eos).expect("mask"));
        let a = so.factory.tok_env().tok_trie().token_id(b"a").expect("a");
        assert!(!g.commit(a).expect("commit"), "a+ can continue");
        assert!(g.allows(eos).expect("mask"));
        // A fixed string completes: the grammar stops by itself.
        let c = so
            .compile(Constraint::Choice(vec!["a".into()]))
            .expect("compile");
        let mut g = c.start();
        assert!(g.commit(a).expect("commit"));
        // A token the mask forbids fails the matcher.
        let c = so.compile(Constraint::Regex("b".into())).expect("compile");
        let mut g = c.start();
        assert!(!g.allows(a).expect("mask"));
        assert!(g.commit(a).is_err());
        assert!(
            g.apply(&mut [0.0; 384]).is_err(),
            "a failed matcher stays failed"
        );
    }

    #[test]
    fn invalid_constraints_name_the_problem_and_grammars_are_cached() {
        let (_, so) = fixture();
        let err = |c| {
            let e = so.compile(c).expect_err("invalid");
            eprintln!("{e}");
            e
        };
        let e = err(Constraint::Regex("(unclosed".into()));
        assert!(e.starts_with("invalid regex"), "{e}");
        let e = err(Constraint::JsonSchema(json!({"type": "no-such-type"})));
        assert!(e.starts_with("invalid json_schema"), "{e}");
        let e = err(Constraint::JsonSchema(
            json!({"type": "integer", "minimum": 5, "maximum": 1}),
        ));
        assert!(e.starts_with("invalid json_schema"), "{e}");
        let e = err(Constraint::Lark("start: undefined_rule".into()));
        assert!(e.starts_with("invalid grammar"), "{e}");
        let e = err(Constraint::Choice(vec![]));
        assert!(e.contains("empty"), "{e}");
        assert!(!e.contains('\n'));

        let schema = json!({"type": "string"});
        let a = so
            .compile(Constraint::JsonSchema(schema.clone()))
            .expect("compile");
        let b = so.compile(Constraint::JsonSchema(schema)).expect("compile");
        assert!(Arc::ptr_eq(&a.template, &b.template));
    }

    /// Mask cost per token on the fixture's vocabulary (printed; run with
    /// `--ignored --nocapture`, release build for real figures).
    #[test]
    #[ignore]
    fn mask_cost_per_token() {
        let (tok, so) = fixture();
        let schema = json!({
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 4}},
            "required": ["name", "n", "tags"], "additionalProperties": false,
        });
        let mut masks = 0u64;
        let mut total = Duration::ZERO;
        for seed in 0..50 {
            let compiled = so
                .compile(Constraint::JsonSchema(schema.clone()))
                .expect("compile");
            let mut g = compiled.start();
            let _ = &tok;
            let vocab = 384;
            let mut x = seed as u64 + 1;
            for _ in 0..150 {
                let mut logits: Vec<f32> = (0..vocab)
                    .map(|_| {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                        (x >> 40) as f32 / (1u64 << 24) as f32
                    })
                    .collect();
                g.apply(&mut logits).expect("mask");
                let t = crate::sampling::argmax(&logits);
                if so.eos_tokens().contains(&t) || g.commit(t).expect("commit") {
                    break;
                }
            }
            masks += g.stats().masks;
            total += g.stats().compute;
        }
        eprintln!(
            "mask: {masks} masks, {:.1} µs per token",
            total.as_secs_f64() * 1e6 / masks.max(1) as f64
        );
    }
}
