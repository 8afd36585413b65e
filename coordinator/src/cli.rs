//! Command-line interface of the one `epserve` binary: every role and tool is a
//! subcommand.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// epserve: expert-parallel MoE inference on CPU clusters.
#[derive(Debug, Parser)]
#[command(name = "epserve", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run one prompt through the single-process engine and print the completion.
    Generate(GenerateArgs),
}

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
}
