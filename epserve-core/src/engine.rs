//! The single-process generate loop: a loaded model folder (weights,
//! tokenizer, generation defaults), prompt encoding (plain or through the chat
//! template), prefill, incremental decode, and stopping on end-of-sequence ids,
//! stop strings or the length limit.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::loader::generation::GenerationConfig;
use crate::loader::tokenizer::{ChatMessage, Tokenizer};
use crate::model::kv_cache::{KvCacheDtype, KvDtype};
use crate::model::{LogitsMode, Model, SeqInput};
use crate::sampling::{Sampler, SamplingParams};
use crate::structured::{CompiledConstraint, Constraint, StructuredOutput};

/// A model folder loaded for generation.
pub struct Engine {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub generation: GenerationConfig,
    pub dir: PathBuf,
    /// Element type of the KV cache [`generate`](Self::generate) allocates
    /// (default: the model's declared dtype, `--kv-cache-dtype auto`).
    pub kv_dtype: KvDtype,
    eos_ids: Vec<u32>,
    /// Structured output, set up on first use ([`Engine::structured`]).
    structured: std::sync::OnceLock<std::result::Result<StructuredOutput, String>>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` or the model's context length.
    Length,
}

impl FinishReason {
    /// OpenAI's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// One generation request, already tokenized.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_token_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
}

/// The result of [`Engine::generate`].
#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub prompt_token_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
}

/// Tracks stop strings over the growing decoded text.
#[derive(Debug, Clone)]
pub struct StopStrings {
    stops: Vec<String>,
}

impl StopStrings {
    /// Stop strings (empty ones ignored).
    pub fn new(stops: &[String]) -> Self {
        StopStrings {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
        }
    }

    /// Byte offset where the first stop string in `text` begins, if any.
    pub fn find(&self, text: &str) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|s| text.find(s.as_str()))
            .min()
    }
}

impl Engine {
    /// Loads a model folder: config, weights, tokenizer, generation defaults.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(dir, &crate::experts::LoadOptions::default())
    }

    /// Loads a model folder with the given expert options (precision, executor).
    pub fn load_with(dir: &Path, opts: &crate::experts::LoadOptions) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::MissingFile {
                path: dir.to_path_buf(),
                what: "model folder",
            });
        }
        let model = Model::load_with(dir, opts)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        let generation = GenerationConfig::from_dir(dir)?;
        Ok(Self::from_parts(model, tokenizer, generation, dir))
    }

    /// Assembles an engine from loaded parts.
    pub fn from_parts(
        model: Model,
        tokenizer: Tokenizer,
        generation: GenerationConfig,
        dir: &Path,
    ) -> Self {
        // End-of-sequence ids: generation_config, then config.json, then the
        // tokenizer's eos token.
        let mut eos_ids = generation.eos_token_ids.clone();
        if eos_ids.is_empty() {
            eos_ids = model.config.eos_token_ids.clone();
        }
        if let Some(id) = tokenizer
            .eos_token
            .as_deref()
            .and_then(|t| tokenizer.token_to_id(t))
            && !eos_ids.contains(&id)
        {
            eos_ids.push(id);
        }
        let kv_dtype = model.kv_dtype(KvCacheDtype::Auto);
        Engine {
            model,
            tokenizer,
            generation,
            dir: dir.to_path_buf(),
            kv_dtype,
            eos_ids,
            structured: std::sync::OnceLock::new(),
        }
    }

    /// The grammar compiler for this model's tokenizer (built on first use:
    /// the token trie and llguidance's tables; logged with the time taken).
    pub fn structured(&self) -> Result<&StructuredOutput> {
        let r = self.structured.get_or_init(|| {
            let t = std::time::Instant::now();
            let r = StructuredOutput::new(
                self.tokenizer.hf(),
                self.model.config.vocab_size,
                &self.eos_ids,
            );
            match &r {
                Ok(_) => tracing::info!(
                    seconds = t.elapsed().as_secs_f64(),
                    "structured output ready"
                ),
                Err(e) => tracing::warn!(error = %e, "structured output unavailable"),
            }
            r
        });
        r.as_ref().map_err(|e| {
            Error::InvalidInput(format!(
                "structured output is unavailable for this model: {e}"
            ))
        })
    }

    /// Compiles a [`Constraint`] for this model (see [`StructuredOutput::compile`]);
    /// an invalid one is [`Error::InvalidInput`] naming the problem.
    pub fn compile_constraint(&self, c: Constraint) -> Result<CompiledConstraint> {
        self.structured()?.compile(c).map_err(Error::InvalidInput)
    }

    /// End-of-sequence token ids.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Tokenizes a prompt: plain text with the tokenizer's special tokens, or
    /// (with `chat`) as one user message through the chat template.
    pub fn encode_prompt(&self, prompt: &str, chat: bool) -> Result<Vec<u32>> {
        if chat {
            let text = self.tokenizer.apply_chat_template(
                &[ChatMessage {
                    role: "user".into(),
                    content: prompt.into(),
                }],
                true,
            )?;
            self.tokenizer.encode(&text, false)
        } else {
            self.tokenizer.encode(prompt, true)
        }
    }

    /// Sampling defaults from generation_config.json (greedy unless it asks
    /// for sampling), to be overridden by the request.
    pub fn default_sampling(&self) -> SamplingParams {
        let g = &self.generation;
        let mut p = SamplingParams::default();
        if g.do_sample {
            p.temperature = g.temperature.unwrap_or(1.0);
            p.top_k = g.top_k.unwrap_or(0);
            p.top_p = g.top_p.unwrap_or(1.0);
            p.min_p = g.min_p.unwrap_or(0.0);
        }
        p.repetition_penalty = g.repetition_penalty.unwrap_or(1.0);
        p
    }

    /// Runs a request to completion.
    pub fn generate(&self, req: &GenerateRequest) -> Result<GenerateOutput> {
        self.generate_with(req, |_| {})
    }

    /// Runs a request, calling `on_token` after each generated token.
    pub fn generate_with(
        &self,
        req: &GenerateRequest,
        mut on_token: impl FnMut(u32),
    ) -> Result<GenerateOutput> {
        req.sampling.validate()?;
        let max_len = self.model.config.max_position_embeddings;
        let n_prompt = req.prompt_token_ids.len();
        if n_prompt == 0 {
            return Err(Error::InvalidInput("the prompt is empty".into()));
        }
        if n_prompt >= max_len {
            return Err(Error::InvalidInput(format!(
                "the prompt has {n_prompt} tokens; the model's context is {max_len}"
            )));
        }
        let mut sampler = Sampler::new(req.sampling.clone());
        let stops = StopStrings::new(&req.stop);
        let mut cache = self.model.new_cache();
        let total = (n_prompt + req.max_tokens).min(max_len);
        let mut pool = self.model.pool_for_tokens(total, self.kv_dtype);
        let mut generated: Vec<u32> = Vec::new();
        let mut next_input = req.prompt_token_ids.clone();
        let mut finish = FinishReason::Length;
        let mut text_cut: Option<usize> = None;
        while generated.len() < req.max_tokens && n_prompt + generated.len() < max_len {
            let out = self.model.forward(
                &mut [SeqInput {
                    tokens: &next_input,
                    cache: &mut cache,
                    logits: true,
                }],
                &mut pool,
                LogitsMode::Last,
                false,
            )?;
            let mut logits = out.logits;
            let tok = sampler.sample(&mut logits, &req.prompt_token_ids, &generated);
            generated.push(tok);
            on_token(tok);
            if !req.ignore_eos && self.eos_ids.contains(&tok) {
                finish = FinishReason::Stop;
                break;
            }
            if !stops.stops.is_empty() {
                let text = self.tokenizer.decode(&generated, true)?;
                if let Some(at) = stops.find(&text) {
                    text_cut = Some(at);
                    finish = FinishReason::Stop;
                    break;
                }
            }
            next_input = vec![tok];
        }
        let mut text = self.tokenizer.decode(&generated, true)?;
        if let Some(at) = text_cut {
            text.truncate(at);
        }
        Ok(GenerateOutput {
            prompt_token_ids: req.prompt_token_ids.clone(),
            token_ids: generated,
            text,
            finish_reason: finish,
        })
    }
}
