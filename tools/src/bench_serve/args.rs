//! Flags of `epserve bench serve`, named and defaulted as `vllm bench serve`
//! names them, so a vLLM command line works here unchanged (for the flags we
//! support).

use std::path::PathBuf;

use clap::{Args, ValueEnum};

/// Which request shape to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// `POST /v1/completions` with a `prompt`.
    Openai,
    /// `POST /v1/chat/completions` with one user message.
    OpenaiChat,
}

impl Backend {
    /// The name vLLM uses (`openai`, `openai-chat`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Openai => "openai",
            Backend::OpenaiChat => "openai-chat",
        }
    }
}

/// Where prompts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DatasetName {
    /// Random token ids decoded with the tokenizer (vLLM's RandomDataset).
    Random,
    /// Conversations from a ShareGPT JSON file (--dataset-path): the first
    /// human turn as the prompt, the gpt reply's token count as max_tokens.
    Sharegpt,
    /// Shared random prefixes, each with random suffixes (vLLM's
    /// `prefix_repetition`): measures prefix caching.
    #[value(alias = "prefix_repetition", alias = "prefix-repetition")]
    Prefix,
}

impl DatasetName {
    /// The name vLLM uses.
    pub fn name(self) -> &'static str {
        match self {
            DatasetName::Random => "random",
            DatasetName::Sharegpt => "sharegpt",
            DatasetName::Prefix => "prefix_repetition",
        }
    }
}

/// `epserve bench serve`: a twin of `vllm bench serve` for any
/// OpenAI-compatible server.
#[derive(Debug, Args)]
pub struct BenchServeArgs {
    /// Request shape: `openai` (completions) or `openai-chat`. Default: from
    /// --endpoint, else `openai`.
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// Server base URL, e.g. http://127.0.0.1:8000 (http or https). Default:
    /// http://HOST:PORT.
    #[arg(long)]
    pub base_url: Option<String>,
    /// Server host when --base-url is not given.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Server port when --base-url is not given.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// API path. Default: /v1/completions (openai) or /v1/chat/completions
    /// (openai-chat).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Model id sent in requests. Default: the first model of GET /v1/models.
    /// A local folder here also serves as the tokenizer.
    #[arg(long)]
    pub model: Option<String>,
    /// Model name sent in requests when it differs from --model.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Hugging Face folder with tokenizer.json (default: --model when it is a
    /// folder). Used to build prompts and to count output tokens when the
    /// server sends no usage.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Dataset to sample prompts from.
    #[arg(long, value_enum, default_value_t = DatasetName::Random)]
    pub dataset_name: DatasetName,
    /// Number of prompts to send.
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// The dataset file (sharegpt: vLLM's ShareGPT JSON, e.g.
    /// ShareGPT_V3_unfiltered_cleaned_split.json, or the sample made by
    /// scripts/make_sharegpt_sample.py).
    #[arg(long, value_name = "FILE")]
    pub dataset_path: Option<PathBuf>,
    /// sharegpt: max_tokens of every request instead of the reply's length.
    #[arg(long)]
    pub sharegpt_output_len: Option<usize>,
    /// prefix: tokens of each shared prefix.
    #[arg(long, alias = "prefix-len", default_value_t = 256)]
    pub prefix_repetition_prefix_len: usize,
    /// prefix: tokens of the random suffix after the prefix.
    #[arg(long, alias = "suffix-len", default_value_t = 256)]
    pub prefix_repetition_suffix_len: usize,
    /// prefix: how many different prefixes the requests share.
    #[arg(long, alias = "num-prefixes", default_value_t = 10)]
    pub prefix_repetition_num_prefixes: usize,
    /// prefix: output tokens per request (--output-len wins over it).
    #[arg(long, default_value_t = 128)]
    pub prefix_repetition_output_len: usize,
    /// Input tokens per request (random dataset), special tokens included.
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    /// Output tokens per request (`max_tokens`).
    #[arg(long, default_value_t = 128)]
    pub random_output_len: usize,
    /// Lengths are drawn uniformly from [len·(1−r), len·(1+r)]; 0 ≤ r < 1.
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// A fixed random prefix of this many tokens before every prompt.
    #[arg(long, default_value_t = 0)]
    pub random_prefix_len: usize,
    /// epserve extension: draw prompt tokens from only N token ids (chosen by
    /// the seed) for a skewed expert load; 0 = the whole vocabulary (vLLM's).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub random_token_pool: usize,
    /// Same as --random-input-len (wins over it).
    #[arg(long)]
    pub input_len: Option<usize>,
    /// Same as --random-output-len (wins over it).
    #[arg(long)]
    pub output_len: Option<usize>,
    /// Seed of the dataset and of the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Requests per second: `inf` sends all at once, a number draws arrivals
    /// from a Poisson process (gamma with --burstiness).
    #[arg(long, default_value = "inf", value_parser = parse_rate)]
    pub request_rate: f64,
    /// Gamma shape of inter-arrival times: 1 = Poisson, < 1 burstier, > 1
    /// more uniform. Only with a finite --request-rate.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// At most this many requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Send `ignore_eos: true`. The random and prefix datasets always do (as
    /// vLLM's random dataset does); sharegpt only with this flag.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Comma-separated metrics to report: ttft, tpot, itl, e2el,
    /// client_queue_time, e2el_including_client_queue.
    #[arg(long, default_value = "ttft,tpot,itl")]
    pub percentile_metrics: String,
    /// Comma-separated percentiles to report, e.g. "25,50,99".
    #[arg(long, default_value = "99")]
    pub metric_percentiles: String,
    /// Service level objectives as KEY:VALUE in ms (ttft, tpot, e2el); reports
    /// the request goodput.
    #[arg(long, num_args = 1..)]
    pub goodput: Vec<String>,
    /// Do not draw the progress bar.
    #[arg(long)]
    pub disable_tqdm: bool,
    /// Requests sent (and not measured) before the run.
    #[arg(long, default_value_t = 0)]
    pub num_warmups: usize,
    /// Retry one test request up to this many seconds before the run (0 skips
    /// the check).
    #[arg(long, default_value_t = 0)]
    pub ready_check_timeout_sec: u64,
    /// Save the result as JSON: to FILE when given, else to --result-filename
    /// or `{label}-{rate}qps[-concurrencyN]-{model}-{date}.json`.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "")]
    pub save_result: Option<String>,
    /// Also save per-request data (input_lens, output_lens, ttfts, itls,
    /// start_times, generated_texts, errors).
    #[arg(long)]
    pub save_detailed: bool,
    /// Append the result as one more JSON line to the file.
    #[arg(long)]
    pub append_result: bool,
    /// Folder for the result file.
    #[arg(long)]
    pub result_dir: Option<PathBuf>,
    /// Name of the result file.
    #[arg(long)]
    pub result_filename: Option<String>,
    /// Label of the result (default: the backend).
    #[arg(long)]
    pub label: Option<String>,
    /// KEY=VALUE pairs stored in the result file.
    #[arg(long, num_args = 1..)]
    pub metadata: Vec<String>,
    /// Extra HTTP headers as KEY=VALUE.
    #[arg(long, num_args = 1..)]
    pub header: Vec<String>,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Accept any TLS certificate (self-signed servers).
    #[arg(long)]
    pub insecure: bool,
    /// epserve extension: open a new connection for every request instead of
    /// reusing idle ones. For servers that announce keep-alive but close the
    /// connection after a streamed response (llama.cpp's llama-server), where a
    /// reused connection fails the next request.
    #[arg(long)]
    pub no_connection_reuse: bool,
    /// JSON object merged into every request body.
    #[arg(long)]
    pub extra_body: Option<String>,
    /// `logprobs` sent with completions requests.
    #[arg(long)]
    pub logprobs: Option<u32>,
    /// Prefix of the `x-request-id` header (default: bench-XXXXXXXX-).
    #[arg(long)]
    pub request_id_prefix: Option<String>,
    /// Sampling: temperature (default: the server's).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Sampling: top_p.
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Sampling: top_k.
    #[arg(long)]
    pub top_k: Option<i64>,
    /// Sampling: min_p.
    #[arg(long)]
    pub min_p: Option<f64>,
    /// Sampling: frequency_penalty.
    #[arg(long)]
    pub frequency_penalty: Option<f64>,
    /// Sampling: presence_penalty.
    #[arg(long)]
    pub presence_penalty: Option<f64>,
    /// Sampling: repetition_penalty.
    #[arg(long)]
    pub repetition_penalty: Option<f64>,
}

/// `inf` or a positive number of requests per second.
fn parse_rate(s: &str) -> Result<f64, String> {
    let v: f64 = match s.trim().to_ascii_lowercase().as_str() {
        "inf" | "infinity" => f64::INFINITY,
        t => t
            .parse()
            .map_err(|_| format!("expected a number or inf, got {s:?}"))?,
    };
    if v.is_nan() || v <= 0.0 {
        return Err(format!("must be positive, got {s}"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates() {
        assert_eq!(parse_rate("inf"), Ok(f64::INFINITY));
        assert_eq!(parse_rate("2.5"), Ok(2.5));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("fast").is_err());
    }
}
