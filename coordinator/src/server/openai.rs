//! The OpenAI request bodies as clients send them, and their parsing into the
//! scheduler's validated [`Request`] ("parse, don't validate": nothing
//! unchecked gets past this file).

use epserve_core::engine::Engine;
use epserve_core::structured::{CompiledConstraint, Constraint};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::error::ApiError;
use super::tools::{self, Choice, ToolParse};
use crate::scheduler::Request;

/// `prompt`: text or token ids, alone or as a one-element batch.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<i64>),
    Texts(Vec<String>),
    IdBatch(Vec<Vec<i64>>),
}

/// `stop`: one string or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Sampling fields shared by both endpoints.
#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    /// OpenAI's: token id (as a string) → bias in [-100, 100].
    pub logit_bias: Option<std::collections::HashMap<String, f64>>,
    /// vLLM's: only these tokens can be sampled.
    pub allowed_token_ids: Option<Vec<i64>>,
    /// vLLM's: words whose token sequences may not be generated.
    pub bad_words: Option<Vec<String>>,
    /// vLLM's per-request prefix cache salt.
    pub cache_salt: Option<String>,
    // Structured output ([`constraint`]): OpenAI's, vLLM's and vLLM's older fields.
    pub response_format: Option<ResponseFormat>,
    pub structured_outputs: Option<StructuredOutputs>,
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
}

/// `response_format`: `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
    pub json_schema: Option<JsonSchemaFormat>,
}

/// `response_format.json_schema`. `strict` is accepted; the schema is always
/// enforced (as vLLM does).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub description: Option<String>,
    pub schema: Option<serde_json::Value>,
    pub strict: Option<bool>,
}

/// vLLM's `structured_outputs`: one of its fields.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    pub json: Option<serde_json::Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionBody {
    pub model: Option<String>,
    pub prompt: Option<PromptInput>,
    pub max_tokens: Option<i64>,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    #[serde(skip)]
    pub sampling: SamplingFields,
}

/// Message content: a string or a list of typed parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant message's tool calls (its `content` is then often null).
    pub tool_calls: Option<Vec<MessageToolCall>>,
    /// A `tool` message's answer to this call.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

/// A tool call in the chat history, as the API returned it.
#[derive(Debug, Deserialize)]
pub struct MessageToolCall {
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: MessageFunction,
}

#[derive(Debug, Deserialize)]
pub struct MessageFunction {
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatBody {
    pub model: Option<String>,
    pub messages: Option<Vec<Message>>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub add_generation_prompt: Option<bool>,
    /// `[{"type": "function", "function": {name, description, parameters}}]`
    /// (validated in [`tools::parse_request`], kept as JSON for the template).
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    #[serde(skip)]
    pub sampling: SamplingFields,
}

/// A request body that also carries the shared sampling fields.
pub trait WithSampling: DeserializeOwned {
    fn set_sampling(&mut self, s: SamplingFields);
    /// The endpoint's tables of known top-level fields (see [`SHARED_FIELDS`]).
    const KNOWN_FIELDS: &'static [&'static [&'static str]];
    /// The endpoint, for error messages.
    const ENDPOINT: &'static str;
}

impl WithSampling for CompletionBody {
    fn set_sampling(&mut self, s: SamplingFields) {
        self.sampling = s;
    }
    const KNOWN_FIELDS: &'static [&'static [&'static str]] = &[SHARED_FIELDS, COMPLETION_FIELDS];
    const ENDPOINT: &'static str = "/v1/completions";
}

impl WithSampling for ChatBody {
    fn set_sampling(&mut self, s: SamplingFields) {
        self.sampling = s;
    }
    const KNOWN_FIELDS: &'static [&'static [&'static str]] = &[SHARED_FIELDS, CHAT_FIELDS];
    const ENDPOINT: &'static str = "/v1/chat/completions";
}

// ---------------------------------------------------------------------------
// Known request fields. A top-level field in none of an endpoint's tables is
// answered 400 naming it (`param`), never silently dropped: a client that
// asks for something (JSON output, tools, a bias) must learn that it did not
// get it. ADDING A REQUEST FIELD: implement it, then add its name to the
// table of each endpoint that honours it (SHARED_FIELDS: both endpoints),
// in your own section below, one name per line. Fields that are only
// accepted with some values (`store`, `service_tier`, `echo`, `n`, ...) are
// listed here and their values checked where they are parsed.
// ---------------------------------------------------------------------------

/// Fields both `/v1/completions` and `/v1/chat/completions` know.
pub const SHARED_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    // n from 1 to MAX_N; best_of only equal to n (400 otherwise, in `sampling`).
    "n",
    "best_of",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stream",
    // include_usage is honoured; other keys inside are 400 (check_values).
    "stream_options",
    // Accepted and ignored: an end-user id for the provider's abuse
    // monitoring; it never changes the output.
    "user",
    // Same, OpenAI's newer name for `user`.
    "safety_identifier",
    // Structured output (at most one of these per request).
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    // Prefix caching: a salt keeps this request's blocks apart.
    "cache_salt",
];

/// Fields only `/v1/completions` knows.
pub const COMPLETION_FIELDS: &[&str] = &[
    "prompt", "logprobs",
    // Both refused when set (echo: true, any suffix) in `parse_completion`.
    "echo", "suffix",
];

/// Fields only `/v1/chat/completions` knows.
pub const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "add_generation_prompt",
    // Accepted and ignored: tags OpenAI keeps with stored completions; they
    // never change the output.
    "metadata",
    // Only `false` (nothing is stored here); `true` is a 400 (check_values).
    "store",
    // Only "auto" / "default" (there is one tier here); others are a 400.
    "service_tier",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

/// Fields `POST /tokenize` knows (vLLM's TokenizeCompletionRequest and
/// TokenizeChatRequest).
pub const TOKENIZE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "return_token_strs",
    // Rendered into the chat template with `messages`, as for the chat endpoint.
    "tools",
];

/// Fields `POST /detokenize` knows.
pub const DETOKENIZE_FIELDS: &[&str] = &["model", "tokens"];

/// 400 naming the first top-level field of `v` that is in none of `tables`.
pub fn check_fields(
    v: &serde_json::Value,
    tables: &[&[&str]],
    endpoint: &str,
) -> Result<(), ApiError> {
    let Some(obj) = v.as_object() else {
        return Ok(());
    };
    let unknown: Vec<&str> = obj
        .keys()
        .map(String::as_str)
        .filter(|k| !tables.iter().any(|t| t.contains(k)))
        .collect();
    let Some(first) = unknown.first() else {
        return Ok(());
    };
    let shown: Vec<String> = unknown.iter().take(8).map(|k| format!("'{k}'")).collect();
    let mut e = ApiError::bad_param(
        first,
        format!(
            "Unrecognized request argument supplied: {} ({endpoint} does not implement {}; remove {})",
            shown.join(", "),
            if unknown.len() == 1 { "it" } else { "them" },
            if unknown.len() == 1 { "it" } else { "them" },
        ),
    );
    e.code = Some("unsupported_parameter");
    Err(e)
}

/// Value checks of the fields accepted only with some values.
fn check_values(v: &serde_json::Value) -> Result<(), ApiError> {
    use serde_json::Value;
    if let Some(o) = v.get("stream_options")
        && let Some(o) = o.as_object()
        && let Some(k) = o.keys().find(|k| k.as_str() != "include_usage")
    {
        let mut e = ApiError::bad_param(
            &format!("stream_options.{k}"),
            format!(
                "Unrecognized request argument supplied: 'stream_options.{k}' (only include_usage is implemented)"
            ),
        );
        e.code = Some("unsupported_parameter");
        return Err(e);
    }
    match v.get("store") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(_) => {
            return Err(ApiError::bad_param(
                "store",
                "store: this server does not store completions (only false is accepted)",
            ));
        }
    }
    match v.get("service_tier") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "auto" || s == "default" => {}
        Some(other) => {
            return Err(ApiError::bad_param(
                "service_tier",
                format!(
                    "service_tier {other} is not supported: this server has one tier (\"auto\" or \"default\")"
                ),
            ));
        }
    }
    Ok(())
}

/// Parses a request body: the endpoint's own fields and the sampling fields,
/// each error naming its field. (Two passes over one parsed value, because
/// `#[serde(flatten)]` would lose the field path.)
pub fn parse_body<T: WithSampling>(bytes: &[u8]) -> Result<T, ApiError> {
    let v: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("malformed JSON body: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    check_fields(&v, T::KNOWN_FIELDS, T::ENDPOINT)?;
    check_values(&v)?;
    let mut body: T = from_value(&v)?;
    body.set_sampling(from_value(&v)?);
    Ok(body)
}

fn from_value<T: DeserializeOwned>(v: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            ApiError::bad_request(format!("invalid request body: {inner}"))
        } else {
            ApiError::bad_param(&path, format!("invalid value for '{path}': {inner}"))
        }
    })
}

/// What the handler needs besides the scheduler request.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub request: Request,
    pub stream: bool,
    pub include_usage: bool,
    /// Chat with tools (tool_choice not "none"): parse `<tool_call>` blocks
    /// out of the output.
    pub tools: Option<ToolParse>,
}

/// Limits the parser enforces.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_model_len: usize,
    pub max_logprobs: usize,
    /// Longest prompt text in bytes, checked before tokenization.
    pub max_prompt_bytes: usize,
    pub max_stop_strings: usize,
    pub max_stop_string_bytes: usize,
}

/// Most `stop_token_ids` per request.
pub const MAX_STOP_TOKEN_IDS: usize = 256;

/// Most completions per request (`n`).
pub const MAX_N: usize = 16;

/// Most `bad_words` per request, and the longest one in bytes.
pub const MAX_BAD_WORDS: usize = 256;
pub const MAX_BAD_WORD_BYTES: usize = 1024;
/// Longest `cache_salt`, in bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 1024;

/// `cache_salt`: a non-empty string of at most [`MAX_CACHE_SALT_BYTES`].
fn cache_salt(f: &SamplingFields) -> Result<Option<String>, ApiError> {
    match &f.cache_salt {
        None => Ok(None),
        Some(s) if s.is_empty() => Err(ApiError::bad_param(
            "cache_salt",
            "cache_salt must be a non-empty string",
        )),
        Some(s) if s.len() > MAX_CACHE_SALT_BYTES => Err(ApiError::bad_param(
            "cache_salt",
            format!(
                "cache_salt is {} bytes, over the limit of {MAX_CACHE_SALT_BYTES}",
                s.len()
            ),
        )),
        Some(s) => Ok(Some(s.clone())),
    }
}

impl Limits {
    /// Refuses prompt text over the byte cap before any tokenizer runs.
    fn check_prompt_bytes(&self, param: &str, n: usize) -> Result<(), ApiError> {
        if n > self.max_prompt_bytes {
            return Err(ApiError::bad_param(
                param,
                format!(
                    "the prompt is {n} bytes, over the limit of {} bytes",
                    self.max_prompt_bytes
                ),
            ));
        }
        Ok(())
    }
}

/// `n` (1 to [`MAX_N`]) and `best_of`, which, as in vLLM V1, may only equal `n`.
fn choices(f: &SamplingFields) -> Result<usize, ApiError> {
    let n = match f.n {
        None => 1,
        Some(n) if n < 1 || n > MAX_N as i64 => {
            return Err(ApiError::bad_param(
                "n",
                format!("n must be between 1 and {MAX_N}, got {n}"),
            ));
        }
        Some(n) => n as usize,
    };
    if let Some(b) = f.best_of
        && b != n as i64
    {
        return Err(ApiError::bad_param(
            "best_of",
            format!(
                "best_of must equal n ({n}), got {b}: choosing the best of more samples is not supported (as in vLLM V1)"
            ),
        ));
    }
    Ok(n)
}

/// `logit_bias` keys as token ids below `vocab`.
fn logit_bias(f: &SamplingFields, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(m) = &f.logit_bias else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(m.len());
    for (k, &b) in m {
        let t = k
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|&t| (t as usize) < vocab)
            .ok_or_else(|| {
                ApiError::bad_param(
                    "logit_bias",
                    format!("logit_bias key '{k}' is not a token id in the vocabulary of {vocab}"),
                )
            })?;
        if !(-100.0..=100.0).contains(&b) {
            return Err(ApiError::bad_param(
                "logit_bias",
                format!("logit_bias must be in [-100, 100], got {b} for token {t}"),
            ));
        }
        out.push((t, b as f32));
    }
    // Reproducible order (the map's is not).
    out.sort_by_key(|&(t, _)| t);
    Ok(out)
}

fn allowed_token_ids(f: &SamplingFields, vocab: usize) -> Result<Option<Vec<u32>>, ApiError> {
    let Some(v) = &f.allowed_token_ids else {
        return Ok(None);
    };
    if v.is_empty() {
        return Err(ApiError::bad_param(
            "allowed_token_ids",
            "allowed_token_ids must not be empty",
        ));
    }
    v.iter()
        .map(|&t| {
            u32::try_from(t)
                .ok()
                .filter(|&t| (t as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "allowed_token_ids",
                        format!(
                            "allowed_token_ids: token id {t} is out of range for a vocabulary of {vocab}"
                        ),
                    )
                })
        })
        .collect::<Result<Vec<u32>, _>>()
        .map(Some)
}

/// `bad_words` as token sequences, as vLLM tokenizes them: each word (leading
/// spaces stripped) without and with a leading space, the latter kept when it
/// is a different sequence of the same length (a word at the start of the
/// text and one after a space).
fn bad_words(engine: &Engine, f: &SamplingFields, vocab: usize) -> Result<Vec<Vec<u32>>, ApiError> {
    let Some(words) = &f.bad_words else {
        return Ok(Vec::new());
    };
    if words.len() > MAX_BAD_WORDS {
        return Err(ApiError::bad_param(
            "bad_words",
            format!(
                "at most {MAX_BAD_WORDS} bad words may be given, got {}",
                words.len()
            ),
        ));
    }
    let mut out: Vec<Vec<u32>> = Vec::new();
    for (i, w) in words.iter().enumerate() {
        if w.len() > MAX_BAD_WORD_BYTES {
            return Err(ApiError::bad_param(
                "bad_words",
                format!(
                    "bad word {i} is {} bytes, over the limit of {MAX_BAD_WORD_BYTES} bytes",
                    w.len()
                ),
            ));
        }
        let word = w.trim_start();
        if word.is_empty() {
            return Err(ApiError::bad_param(
                "bad_words",
                format!("bad word {i} is empty"),
            ));
        }
        let encode = |s: &str| {
            engine
                .tokenizer
                .encode(s, false)
                .map_err(|e| ApiError::internal(e.to_string()))
        };
        let plain = encode(word)?;
        let spaced = encode(&format!(" {word}"))?;
        for ids in [&plain, &spaced] {
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::bad_param(
                    "bad_words",
                    format!(
                        "bad word {i} has token id {bad}, out of range for a vocabulary of {vocab}"
                    ),
                ));
            }
        }
        if plain.is_empty() {
            continue;
        }
        let keep_spaced = spaced.len() == plain.len() && spaced.first() != plain.first();
        out.push(plain);
        if keep_spaced {
            out.push(spaced);
        }
    }
    Ok(out)
}

fn sampling(
    engine: &Engine,
    f: &SamplingFields,
) -> Result<epserve_core::sampling::SamplingParams, ApiError> {
    // vLLM's defaults: the model's generation_config, else OpenAI's (temperature 1).
    let g = &engine.generation;
    let mut p = epserve_core::sampling::SamplingParams {
        temperature: g.temperature.unwrap_or(1.0),
        top_p: g.top_p.unwrap_or(1.0),
        top_k: g.top_k.unwrap_or(0),
        min_p: g.min_p.unwrap_or(0.0),
        repetition_penalty: g.repetition_penalty.unwrap_or(1.0),
        ..Default::default()
    };
    if let Some(t) = f.temperature {
        p.temperature = t;
    }
    if let Some(v) = f.top_p {
        p.top_p = v;
    }
    if let Some(k) = f.top_k {
        if k < -1 {
            return Err(ApiError::bad_param(
                "top_k",
                format!("top_k must be -1 (off) or >= 0, got {k}"),
            ));
        }
        p.top_k = k.max(0) as usize;
    }
    if let Some(v) = f.min_p {
        p.min_p = v;
    }
    if let Some(v) = f.repetition_penalty {
        p.repetition_penalty = v;
    }
    if let Some(v) = f.frequency_penalty {
        p.frequency_penalty = v;
    }
    if let Some(v) = f.presence_penalty {
        p.presence_penalty = v;
    }
    p.seed = f.seed.map(|s| s as u64);
    let vocab = engine.model.config.vocab_size;
    p.logit_bias = logit_bias(f, vocab)?;
    p.allowed_token_ids = allowed_token_ids(f, vocab)?;
    p.bad_words = bad_words(engine, f, vocab)?;
    p.validate().map_err(|e| {
        let msg = e.to_string().replace("invalid input: ", "");
        // The message starts with the field's name ("top_p must be ...").
        let param = msg.split_whitespace().next().unwrap_or("").to_string();
        ApiError::bad_param(&param, msg)
    })?;
    Ok(p)
}

/// A JSON schema given as an object, a boolean or a string holding one.
fn schema_value(param: &str, v: &serde_json::Value) -> Result<serde_json::Value, ApiError> {
    let v = match v {
        serde_json::Value::String(s) => serde_json::from_str(s)
            .map_err(|e| ApiError::bad_param(param, format!("'{param}' is not valid JSON: {e}")))?,
        v => v.clone(),
    };
    if !(v.is_object() || v.is_boolean()) {
        return Err(ApiError::bad_param(
            param,
            format!("'{param}' must be a JSON schema (an object)"),
        ));
    }
    Ok(v)
}

/// The structured-output constraint a request asks for, compiled for the
/// model (`None`: free text). At most one may be given; an invalid schema,
/// regex or grammar is a 400 naming its field.
fn constraint(engine: &Engine, f: &SamplingFields) -> Result<Option<CompiledConstraint>, ApiError> {
    let mut found: Vec<(String, Constraint)> = Vec::new();
    if let Some(rf) = &f.response_format {
        match rf.kind.as_str() {
            "text" => {}
            "json_object" => found.push(("response_format".into(), Constraint::JsonObject)),
            "json_schema" => {
                let param = "response_format.json_schema.schema";
                let schema = rf
                    .json_schema
                    .as_ref()
                    .and_then(|j| j.schema.as_ref())
                    .ok_or_else(|| {
                        ApiError::bad_param(
                            param,
                            "response_format of type 'json_schema' needs json_schema.schema",
                        )
                    })?;
                found.push((
                    param.into(),
                    Constraint::JsonSchema(schema_value(param, schema)?),
                ));
            }
            other => {
                return Err(ApiError::bad_param(
                    "response_format.type",
                    format!(
                        "response_format type '{other}' is not supported (text, json_object or json_schema)"
                    ),
                ));
            }
        }
    }
    if let Some(so) = &f.structured_outputs {
        if let Some(j) = &so.json {
            let param = "structured_outputs.json";
            found.push((
                param.into(),
                Constraint::JsonSchema(schema_value(param, j)?),
            ));
        }
        if let Some(r) = &so.regex {
            found.push((
                "structured_outputs.regex".into(),
                Constraint::Regex(r.clone()),
            ));
        }
        if let Some(c) = &so.choice {
            found.push((
                "structured_outputs.choice".into(),
                Constraint::Choice(c.clone()),
            ));
        }
        if let Some(g) = &so.grammar {
            found.push((
                "structured_outputs.grammar".into(),
                Constraint::Lark(g.clone()),
            ));
        }
        if so.json_object == Some(true) {
            found.push((
                "structured_outputs.json_object".into(),
                Constraint::JsonObject,
            ));
        }
    }
    if let Some(j) = &f.guided_json {
        found.push((
            "guided_json".into(),
            Constraint::JsonSchema(schema_value("guided_json", j)?),
        ));
    }
    if let Some(r) = &f.guided_regex {
        found.push(("guided_regex".into(), Constraint::Regex(r.clone())));
    }
    if let Some(c) = &f.guided_choice {
        found.push(("guided_choice".into(), Constraint::Choice(c.clone())));
    }
    if let Some(g) = &f.guided_grammar {
        found.push(("guided_grammar".into(), Constraint::Lark(g.clone())));
    }
    let mut found = found.into_iter();
    let Some((param, c)) = found.next() else {
        return Ok(None);
    };
    if let Some((second, _)) = found.next() {
        return Err(ApiError::bad_param(
            &second,
            format!(
                "only one structured output constraint may be given: got '{param}' and '{second}'"
            ),
        ));
    }
    engine.compile_constraint(c).map(Some).map_err(|e| {
        let msg = match e {
            epserve_core::Error::InvalidInput(m) => m,
            e => e.to_string(),
        };
        ApiError::bad_param(&param, format!("'{param}': {msg}"))
    })
}

fn stops(limits: &Limits, f: &SamplingFields) -> Result<Vec<String>, ApiError> {
    let v = match &f.stop {
        None => vec![],
        Some(StopInput::One(s)) => vec![s.clone()],
        Some(StopInput::Many(v)) => {
            if v.len() > limits.max_stop_strings {
                return Err(ApiError::bad_param(
                    "stop",
                    format!(
                        "at most {} stop strings may be given, got {}",
                        limits.max_stop_strings,
                        v.len()
                    ),
                ));
            }
            v.clone()
        }
    };
    for (i, s) in v.iter().enumerate() {
        if s.len() > limits.max_stop_string_bytes {
            return Err(ApiError::bad_param(
                "stop",
                format!(
                    "stop string {i} is {} bytes, over the limit of {} bytes",
                    s.len(),
                    limits.max_stop_string_bytes
                ),
            ));
        }
    }
    // An empty stop string would match everywhere.
    Ok(v.into_iter().filter(|s| !s.is_empty()).collect())
}

fn stop_token_ids(f: &SamplingFields, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let v = f.stop_token_ids.clone().unwrap_or_default();
    if v.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::bad_param(
            "stop_token_ids",
            format!(
                "at most {MAX_STOP_TOKEN_IDS} stop token ids may be given, got {}",
                v.len()
            ),
        ));
    }
    if let Some(bad) = v.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_param(
            "stop_token_ids",
            format!("token id {bad} is out of range for a vocabulary of {vocab}"),
        ));
    }
    Ok(v)
}

#[allow(clippy::too_many_arguments)]
fn finish(
    engine: &Engine,
    limits: Limits,
    prompt_token_ids: Vec<u32>,
    max_tokens: Option<i64>,
    max_tokens_name: &str,
    logprobs: Option<usize>,
    logprobs_name: &str,
    f: &SamplingFields,
) -> Result<Parsed, ApiError> {
    let n_prompt = prompt_token_ids.len();
    if n_prompt == 0 {
        return Err(ApiError::bad_param("prompt", "the prompt is empty"));
    }
    let vocab = engine.model.config.vocab_size;
    if let Some(bad) = prompt_token_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_param(
            "prompt",
            format!("token id {bad} is out of range for a vocabulary of {vocab}"),
        ));
    }
    let max_len = limits.max_model_len;
    let max_tokens = match max_tokens {
        Some(m) if m < 1 => {
            return Err(ApiError::bad_param(
                max_tokens_name,
                format!("{max_tokens_name} must be at least 1, got {m}"),
            ));
        }
        Some(m) => m as usize,
        None => max_len.saturating_sub(n_prompt),
    };
    if n_prompt.saturating_add(max_tokens) > max_len {
        return Err(ApiError::bad_param(
            max_tokens_name,
            format!(
                "This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({n_prompt} in the prompt, {max_tokens} in the completion). Please reduce the length of the prompt or {max_tokens_name}.",
                n_prompt.saturating_add(max_tokens)
            ),
        ));
    }
    if let Some(n) = logprobs
        && n > limits.max_logprobs
    {
        return Err(ApiError::bad_param(
            logprobs_name,
            format!(
                "at most {} {logprobs_name} may be requested, got {n}",
                limits.max_logprobs
            ),
        ));
    }
    Ok(Parsed {
        request: Request {
            prompt_token_ids,
            max_tokens,
            sampling: sampling(engine, f)?,
            stop: stops(&limits, f)?,
            stop_token_ids: stop_token_ids(f, vocab)?,
            ignore_eos: f.ignore_eos.unwrap_or(false),
            logprobs,
            n: choices(f)?,
            cache_salt: cache_salt(f)?,
            constraint: constraint(engine, f)?,
        },
        stream: f.stream.unwrap_or(false),
        include_usage: f
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        tools: None,
    })
}

fn ids(limits: Limits, v: &[i64]) -> Result<Vec<u32>, ApiError> {
    if v.len() > limits.max_model_len {
        return Err(ApiError::bad_param(
            "prompt",
            format!(
                "the prompt has {} tokens, more than the context length of {}",
                v.len(),
                limits.max_model_len
            ),
        ));
    }
    v.iter()
        .map(|&x| {
            u32::try_from(x)
                .map_err(|_| ApiError::bad_param("prompt", format!("token id {x} is out of range")))
        })
        .collect()
}

/// Validates a completion request.
pub fn parse_completion(
    engine: &Engine,
    limits: Limits,
    b: &CompletionBody,
) -> Result<Parsed, ApiError> {
    if b.echo == Some(true) {
        return Err(ApiError::bad_param("echo", "echo is not supported"));
    }
    if b.suffix.is_some() {
        return Err(ApiError::bad_param("suffix", "suffix is not supported"));
    }
    let tok_err = |e: epserve_core::Error| ApiError::internal(e.to_string());
    let encode = |s: &str| {
        limits.check_prompt_bytes("prompt", s.len())?;
        engine.tokenizer.encode(s, true).map_err(tok_err)
    };
    let prompt_ids = match &b.prompt {
        None => return Err(ApiError::bad_param("prompt", "missing field 'prompt'")),
        Some(PromptInput::Text(s)) => encode(s)?,
        Some(PromptInput::Ids(v)) => ids(limits, v)?,
        Some(PromptInput::Texts(v)) if v.len() == 1 => encode(&v[0])?,
        Some(PromptInput::IdBatch(v)) if v.len() == 1 => ids(limits, &v[0])?,
        Some(_) => {
            return Err(ApiError::bad_param(
                "prompt",
                "batched prompts are not supported: send one prompt per request",
            ));
        }
    };
    let logprobs = match b.logprobs {
        Some(n) if n < 0 => return Err(ApiError::bad_param("logprobs", "logprobs must be >= 0")),
        Some(n) => Some(n as usize),
        None => None,
    };
    // OpenAI's and vLLM's default for completions.
    finish(
        engine,
        limits,
        prompt_ids,
        Some(b.max_tokens.unwrap_or(16)),
        "max_tokens",
        logprobs,
        "logprobs",
        &b.sampling,
    )
}

/// Validates a chat request (renders the chat template).
pub fn parse_chat(engine: &Engine, limits: Limits, b: &ChatBody) -> Result<Parsed, ApiError> {
    let (text, tool_req) = render_chat_tools(engine, limits, b)?;
    chat_from_text(engine, limits, b, text, tool_req)
}

/// Checks the messages of a chat request and renders them through the chat
/// template (the prompt text, under the prompt byte cap). Also `/tokenize`'s.
pub fn render_chat(engine: &Engine, limits: Limits, b: &ChatBody) -> Result<String, ApiError> {
    render_chat_tools(engine, limits, b).map(|(text, _)| text)
}

/// [`render_chat`], also returning the request's validated tools.
fn render_chat_tools(
    engine: &Engine,
    limits: Limits,
    b: &ChatBody,
) -> Result<(String, Option<tools::ToolRequest>), ApiError> {
    let msgs = b
        .messages
        .as_ref()
        .ok_or_else(|| ApiError::bad_param("messages", "missing field 'messages'"))?;
    if msgs.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "messages must not be empty",
        ));
    }
    let tool_req = tools::parse_request(
        b.tools.as_ref(),
        b.tool_choice.as_ref(),
        b.parallel_tool_calls,
    )?;
    // The messages as the template sees them (vLLM's form: content null ->
    // "", tool-call arguments parsed from their JSON text).
    let mut chat: Vec<serde_json::Value> = Vec::with_capacity(msgs.len());
    let mut has_tool_calls = false;
    let mut total = 0usize;
    for (i, m) in msgs.iter().enumerate() {
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(s)) => s.clone(),
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(ApiError::bad_param(
                            &format!("messages[{i}].content"),
                            format!("content parts of type '{}' are not supported", p.kind),
                        ));
                    }
                    s.push_str(p.text.as_deref().unwrap_or(""));
                }
                s
            }
        };
        total = total
            .saturating_add(content.len())
            .saturating_add(m.role.len());
        let mut msg = serde_json::Map::new();
        msg.insert("role".into(), m.role.clone().into());
        msg.insert("content".into(), content.into());
        if let Some(name) = &m.name {
            msg.insert("name".into(), name.clone().into());
        }
        if let Some(calls) = &m.tool_calls {
            if m.role != "assistant" {
                return Err(ApiError::bad_param(
                    &format!("messages[{i}].tool_calls"),
                    "only assistant messages may have tool_calls",
                ));
            }
            let mut list = Vec::with_capacity(calls.len());
            for (j, c) in calls.iter().enumerate() {
                let p = format!("messages[{i}].tool_calls[{j}]");
                if c.kind.as_deref().is_some_and(|k| k != "function") {
                    return Err(ApiError::bad_param(
                        &format!("{p}.type"),
                        format!("{p}.type must be \"function\""),
                    ));
                }
                let args: serde_json::Value =
                    serde_json::from_str(&c.function.arguments).map_err(|e| {
                        ApiError::bad_param(
                            &format!("{p}.function.arguments"),
                            format!("{p}.function.arguments is not valid JSON: {e}"),
                        )
                    })?;
                total = total
                    .saturating_add(c.function.arguments.len())
                    .saturating_add(c.function.name.len());
                let mut call = serde_json::Map::new();
                if let Some(id) = &c.id {
                    call.insert("id".into(), id.clone().into());
                }
                call.insert("type".into(), "function".into());
                call.insert(
                    "function".into(),
                    serde_json::json!({"name": c.function.name, "arguments": args}),
                );
                list.push(serde_json::Value::Object(call));
            }
            has_tool_calls |= !list.is_empty();
            msg.insert("tool_calls".into(), list.into());
        }
        if let Some(id) = &m.tool_call_id {
            msg.insert("tool_call_id".into(), id.clone().into());
        }
        limits.check_prompt_bytes("messages", total)?;
        chat.push(serde_json::Value::Object(msg));
    }
    let add_gen = b.add_generation_prompt.unwrap_or(true);
    let template_tools = tool_req.as_ref().map(|t| t.template_tools.as_slice());
    let render = |msgs: &[serde_json::Value], tools: Option<&[serde_json::Value]>| {
        engine
            .tokenizer
            .render_chat(msgs, tools, add_gen)
            .map_err(|e| ApiError::bad_param("messages", e.to_string()))
    };
    let text = render(&chat, template_tools)?;
    // A template that renders the same prompt without the tools (or without
    // the history's tool calls) does not support them: refuse rather than
    // silently drop them (vLLM renders them and hopes).
    if let Some(t) = &tool_req
        && t.choice != Choice::None
        && render(&chat, None).ok().as_deref() == Some(text.as_str())
    {
        return Err(ApiError::bad_param(
            "tools",
            "the model's chat template does not support tools (it renders the same prompt with and without them); use a chat template with tool support, or tool_choice \"none\"",
        ));
    }
    if has_tool_calls {
        let stripped: Vec<serde_json::Value> = chat
            .iter()
            .map(|m| {
                let mut m = m.clone();
                if let Some(o) = m.as_object_mut() {
                    o.remove("tool_calls");
                }
                m
            })
            .collect();
        if render(&stripped, template_tools).ok().as_deref() == Some(text.as_str()) {
            return Err(ApiError::bad_param(
                "messages",
                "the model's chat template does not render the tool_calls of assistant messages; use a chat template with tool support",
            ));
        }
    }
    limits.check_prompt_bytes("messages", text.len())?;
    Ok((text, tool_req))
}

fn chat_from_text(
    engine: &Engine,
    limits: Limits,
    b: &ChatBody,
    text: String,
    tool_req: Option<tools::ToolRequest>,
) -> Result<Parsed, ApiError> {
    let prompt_ids = engine
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let logprobs = if b.logprobs == Some(true) {
        match b.top_logprobs {
            Some(n) if n < 0 => {
                return Err(ApiError::bad_param(
                    "top_logprobs",
                    "top_logprobs must be >= 0",
                ));
            }
            Some(n) => Some(n as usize),
            None => Some(0),
        }
    } else {
        None
    };
    let (max, name) = match (b.max_completion_tokens, b.max_tokens) {
        (Some(m), _) => (Some(m), "max_completion_tokens"),
        (None, m) => (m, "max_tokens"),
    };
    let mut parsed = finish(
        engine,
        limits,
        prompt_ids,
        max,
        name,
        logprobs,
        "top_logprobs",
        &b.sampling,
    )?;
    if let Some(t) = &tool_req {
        parsed.tools = t.parse_mode();
        if let Some(g) = tools::grammar(t) {
            // A forced call: the output must be the tool-call block(s).
            if parsed.request.constraint.is_some() {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    "tool_choice \"required\" or a named function cannot be combined with response_format / structured outputs",
                ));
            }
            parsed.request.constraint = Some(
                engine
                    .compile_constraint(Constraint::Lark(g))
                    .map_err(|e| ApiError::bad_param("tools", e.to_string()))?,
            );
        }
    }
    Ok(parsed)
}

/// `POST /tokenize` (vLLM's TokenizeCompletionRequest / TokenizeChatRequest).
#[derive(Debug, Deserialize)]
pub struct TokenizeBody {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub add_special_tokens: Option<bool>,
    pub return_token_strs: Option<bool>,
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeBody {
    pub model: Option<String>,
    pub tokens: Option<Vec<i64>>,
}

/// A JSON object body (400 otherwise) whose top-level fields are all in `tables`.
pub fn parse_object(
    bytes: &[u8],
    tables: &[&[&str]],
    endpoint: &str,
) -> Result<serde_json::Value, ApiError> {
    let v: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("malformed JSON body: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    check_fields(&v, tables, endpoint)?;
    Ok(v)
}

/// What `/tokenize` answers.
#[derive(Debug, Clone)]
pub struct Tokenized {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

/// Tokenizes a `/tokenize` body: `prompt` (special tokens added unless
/// `add_special_tokens: false`, as vLLM) or `messages` rendered through the
/// chat template (`add_generation_prompt` default true, special tokens not
/// added by default, as vLLM), under the prompt byte cap.
pub fn tokenize(engine: &Engine, limits: Limits, bytes: &[u8]) -> Result<Tokenized, ApiError> {
    let v = parse_object(bytes, &[TOKENIZE_FIELDS], "/tokenize")?;
    let b: TokenizeBody = from_value(&v)?;
    let tok_err = |e: epserve_core::Error| ApiError::internal(e.to_string());
    let tokens = match (&b.prompt, v.get("messages")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_param(
                "messages",
                "give either 'prompt' or 'messages', not both",
            ));
        }
        (Some(p), None) => {
            limits.check_prompt_bytes("prompt", p.len())?;
            engine
                .tokenizer
                .encode(p, b.add_special_tokens.unwrap_or(true))
                .map_err(tok_err)?
        }
        (None, Some(_)) => {
            let chat: ChatBody = from_value(&v)?;
            let text = render_chat(engine, limits, &chat)?;
            engine
                .tokenizer
                .encode(&text, b.add_special_tokens.unwrap_or(false))
                .map_err(tok_err)?
        }
        (None, None) => {
            return Err(ApiError::bad_param(
                "prompt",
                "missing field 'prompt' (or 'messages')",
            ));
        }
    };
    let token_strs = (b.return_token_strs == Some(true)).then(|| {
        tokens
            .iter()
            .map(|&t| engine.tokenizer.id_to_token(t).unwrap_or_default())
            .collect()
    });
    Ok(Tokenized {
        model: b.model,
        tokens,
        token_strs,
    })
}

/// Decodes a `/detokenize` body's `tokens` (special tokens kept, as vLLM).
/// Returns the body's `model` and the text.
pub fn detokenize(
    engine: &Engine,
    limits: Limits,
    bytes: &[u8],
) -> Result<(Option<String>, String), ApiError> {
    let v = parse_object(bytes, &[DETOKENIZE_FIELDS], "/detokenize")?;
    let b: DetokenizeBody = from_value(&v)?;
    let raw = b
        .tokens
        .ok_or_else(|| ApiError::bad_param("tokens", "missing field 'tokens'"))?;
    if raw.len() > limits.max_model_len {
        return Err(ApiError::bad_param(
            "tokens",
            format!(
                "{} tokens, more than the context length of {}",
                raw.len(),
                limits.max_model_len
            ),
        ));
    }
    let vocab = engine.model.config.vocab_size;
    let ids = raw
        .iter()
        .map(|&t| {
            u32::try_from(t)
                .ok()
                .filter(|&u| (u as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "tokens",
                        format!("token id {t} is out of range for a vocabulary of {vocab}"),
                    )
                })
        })
        .collect::<Result<Vec<u32>, ApiError>>()?;
    let text = engine
        .tokenizer
        .decode(&ids, false)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok((b.model, text))
}
