//! `epserve generate`: load a model folder, run one prompt, print the result.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use epserve_core::engine::{Engine, GenerateRequest};

/// `epserve generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Hugging Face model folder (config.json, *.safetensors, tokenizer.json).
    #[arg(long, env = "EPSERVE_MODEL")]
    pub model: PathBuf,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Apply the model's chat template to the prompt as one user message.
    #[arg(long)]
    pub chat: bool,
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy. Default: greedy unless the model's
    /// generation_config.json asks for sampling.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Nucleus sampling mass (1 = off).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens below min_p times the best token's probability (0 = off).
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Penalize tokens already present (1 = off).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// RNG seed for reproducible sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this string appears (repeatable); it is not included in the text.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object {"prompt_token_ids", "token_ids", "text", ...}.
    #[arg(long)]
    pub json: bool,
    /// Expert precision: auto (bf16 when exact), bf16, int8 (W8A8).
    #[arg(long, default_value = "auto")]
    pub expert_dtype: epserve_core::experts::ExpertDtype,
    /// Precision of the dense projections outside the experts (attention,
    /// dense MLPs, shared experts, LM head): auto (bf16 weights, exact f32
    /// activations), bf16 (activations rounded to bf16: the bf16 dot
    /// instructions where the CPU has them), or int8 (W8A8, quantized at load).
    #[arg(long, default_value = "auto")]
    pub dense_dtype: epserve_core::experts::DenseDtype,
    /// KV cache element type: auto (the model's declared dtype: bf16 for
    /// bfloat16 checkpoints, else f32), bf16 (half the memory per block), f32.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: epserve_core::model::kv_cache::KvCacheDtype,
}

/// Runs the command.
pub fn run(args: &GenerateArgs) -> Result<()> {
    let start = std::time::Instant::now();
    let opts = epserve_core::experts::LoadOptions {
        expert_dtype: args.expert_dtype,
        dense_dtype: args.dense_dtype,
        ..Default::default()
    };
    let mut engine = Engine::load_with(&args.model, &opts)?;
    engine.kv_dtype = engine.model.kv_dtype(args.kv_cache_dtype);
    tracing::info!(
        model = %args.model.display(),
        model_type = %engine.model.config.model_type,
        kv_cache_dtype = engine.kv_dtype.name(),
        load_ms = start.elapsed().as_millis() as u64,
        "model loaded"
    );
    let prompt_token_ids = engine.encode_prompt(&args.prompt, args.chat)?;
    let mut sampling = engine.default_sampling();
    if let Some(t) = args.temperature {
        sampling.temperature = t;
    }
    if let Some(k) = args.top_k {
        sampling.top_k = k;
    }
    if let Some(p) = args.top_p {
        sampling.top_p = p;
    }
    if let Some(p) = args.min_p {
        sampling.min_p = p;
    }
    if let Some(r) = args.repetition_penalty {
        sampling.repetition_penalty = r;
    }
    sampling.seed = args.seed;
    let req = GenerateRequest {
        prompt_token_ids,
        max_tokens: args.max_tokens,
        sampling,
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
    };
    let gen_start = std::time::Instant::now();
    let out = engine.generate(&req)?;
    let secs = gen_start.elapsed().as_secs_f64();
    tracing::info!(
        prompt_tokens = out.prompt_token_ids.len(),
        completion_tokens = out.token_ids.len(),
        seconds = secs,
        "generation finished"
    );
    let mut stdout = std::io::stdout().lock();
    if args.json {
        let v = serde_json::json!({
            "prompt_token_ids": out.prompt_token_ids,
            "token_ids": out.token_ids,
            "text": out.text,
            "finish_reason": out.finish_reason.as_str(),
        });
        writeln!(stdout, "{v}")?;
    } else {
        writeln!(stdout, "{}", out.text)?;
    }
    Ok(())
}
