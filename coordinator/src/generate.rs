//! `epserve generate`: load a model folder, run one prompt, print the result.

use std::io::Write;

use anyhow::Result;
use epserve_core::engine::{Engine, GenerateRequest};

use crate::cli::GenerateArgs;

/// Runs the command.
pub fn run(args: &GenerateArgs) -> Result<()> {
    let start = std::time::Instant::now();
    let opts = epserve_core::experts::LoadOptions {
        expert_dtype: args.expert_dtype,
        ..Default::default()
    };
    let engine = Engine::load_with(&args.model, &opts)?;
    tracing::info!(
        model = %args.model.display(),
        model_type = %engine.model.config.model_type,
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
