//! Command-line interface of the one `epserve` binary: every role and tool is a
//! subcommand.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// The whole program: parse the command line, run the subcommand, print a
/// one-line error and exit 1 on failure. (A function so that test crates can
/// build a binary with the same behaviour.)
pub fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("EPSERVE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Generate(args) => crate::generate::run(args),
        Command::Serve(args) => crate::serve::run(args),
        Command::Coordinator(args) => crate::cluster::run(args),
        Command::ExpertWorker(args) => epserve_expert_worker::run(args),
        Command::AttentionWorker(args) => epserve_attention_worker::run(args),
        Command::Up(args) => crate::cluster::up::run(args),
        Command::Bench(bench) => match &bench.command {
            BenchCommand::Serve(args) => crate::bench_serve::run(args),
            BenchCommand::Moe(args) => crate::bench_moe::run(args),
        },
        Command::Plan(args) => crate::plan::run(args),
        Command::Ctl(args) => crate::ctl::run(args),
    };
    if let Err(e) = result {
        // One line: the error and its causes joined by ": ".
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

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
    /// Single-process OpenAI-compatible server (completions, chat, models, health, metrics).
    Serve(Box<ServeArgs>),
    /// The cluster's front: OpenAI API, scheduler, attention/router/combine,
    /// experts dispatched to expert-workers over gRPC (placement in etcd).
    Coordinator(Box<crate::cluster::CoordinatorArgs>),
    /// An expert-worker: holds the experts the placement assigns it, serves them over gRPC.
    ExpertWorker(Box<epserve_expert_worker::ExpertWorkerArgs>),
    /// An attention-worker: shard I of N of every attention layer (its heads) and
    /// their KV cache, served over gRPC.
    AttentionWorker(Box<epserve_attention_worker::AttentionWorkerArgs>),
    /// A whole local cluster on loopback: etcd, expert-workers, attention-workers, coordinator.
    Up(Box<crate::cluster::up::UpArgs>),
    /// Benchmarks: `bench serve` (a twin of `vllm bench serve`).
    Bench(BenchArgs),
    /// Capacity planner: expert-workers, attention-workers, experts per worker and
    /// expected decode throughput for a model on a Graviton instance type.
    Plan(Box<crate::plan::PlanArgs>),
    /// Admin client of a running coordinator: placement, expert load (heat map),
    /// workers, live rebalance, drain.
    Ctl(Box<crate::ctl::CtlArgs>),
}

/// `epserve bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

/// Benchmark subcommands.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Serving benchmark against any OpenAI-compatible server: random prompts,
    /// request rate and concurrency, TTFT / TPOT / ITL / E2EL and throughput,
    /// reported as `vllm bench serve` reports them.
    Serve(Box<crate::bench_serve::BenchServeArgs>),
    /// One MoE layer at real shapes (Qwen3-30B-A3B, Mixtral-8x7B) through the
    /// expert kernels, against the machine's measured memory bandwidth and FMA
    /// peak and the scalar twin kernels; bf16 and int8, one and all cores.
    Moe(Box<crate::bench_moe::BenchMoeArgs>),
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
    /// Expert precision: auto (bf16 when exact), bf16, int8 (W8A8).
    #[arg(long, default_value = "auto")]
    pub expert_dtype: epserve_core::experts::ExpertDtype,
}

/// `epserve serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Hugging Face model folder.
    #[arg(long, env = "EPSERVE_MODEL")]
    pub model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0", env = "EPSERVE_HOST")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the URL is printed).
    #[arg(long, default_value_t = 8000, env = "EPSERVE_PORT")]
    pub port: u16,
    /// Name(s) clients use in `model` (repeatable). Default: the folder's name.
    #[arg(long)]
    pub served_model_name: Vec<String>,
    /// Require `Authorization: Bearer KEY` on /v1 routes.
    #[arg(long, env = "EPSERVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Longest prompt + completion, in tokens. Default: the model's max_position_embeddings.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Most sequences in one batch.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks + decodes) in one forward pass.
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// KV cache size, e.g. `2GiB`, `512MiB`, `1000000` (bytes). Overrides --kv-cache-fraction.
    #[arg(long)]
    pub kv_cache_memory: Option<String>,
    /// KV cache size as a fraction of the machine's memory.
    #[arg(long, default_value_t = 0.1)]
    pub kv_cache_fraction: f64,
    /// Positions per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Requests allowed to wait before new ones get 503 + Retry-After.
    #[arg(long, default_value_t = 1024)]
    pub max_waiting: usize,
    /// Largest accepted request body in bytes (413 beyond).
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    pub max_request_body_bytes: usize,
    /// Most `logprobs` / `top_logprobs` a request may ask for.
    #[arg(long, default_value_t = 20)]
    pub max_logprobs: usize,
    /// Expert precision: auto (bf16 when exact), bf16, int8 (W8A8).
    #[arg(long, default_value = "auto")]
    pub expert_dtype: epserve_core::experts::ExpertDtype,
}
