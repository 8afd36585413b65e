//! `epserve serve`: bind first (so `/health` answers 503 while loading), load
//! the model, size the KV cache, start the scheduler, serve until a signal.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use epserve_cluster::runtime::{Status, io_runtime};
use epserve_core::engine::Engine;

use crate::scheduler::{self, SchedulerConfig};
use crate::server::{self, AppState, Ready, ServerConfig};

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
    /// Name(s) clients use in `model`, as vLLM: `--served-model-name a b`
    /// (or the flag repeated); responses report the first. Default: the
    /// folder's name, and the --model string itself.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// A Jinja chat template file used instead of the tokenizer's (checked
    /// at startup: unreadable or not compiling is an error).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
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
    /// Memory budget and tiers of the experts (`--expert-memory`).
    #[command(flatten)]
    pub expert_memory: epserve_cluster::runtime::ExpertMemoryArgs,
    /// Precision of the dense projections outside the experts (attention,
    /// dense MLPs, shared experts, LM head): auto (bf16 weights, exact f32
    /// activations), bf16 (activations rounded to bf16: the bf16 dot
    /// instructions where the CPU has them), or int8 (W8A8, quantized at load).
    #[arg(long, default_value = "auto")]
    pub dense_dtype: epserve_core::experts::DenseDtype,
    /// KV cache element type: auto (the model's declared dtype: bf16 for
    /// bfloat16 checkpoints, else f32), bf16 (half the memory per block), f32. With
    /// remote attention the attention-workers' own flag decides.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: epserve_core::model::kv_cache::KvCacheDtype,
    /// Micro-batches per step: N splits each step's sequences into N groups
    /// that move through the layers in a ping-pong (one group's attention
    /// runs while another's experts run on the workers); `auto` decides per
    /// step from measured phase times, and is 1 in a single process (local
    /// experts leave nothing to overlap).
    #[arg(long, default_value = "auto")]
    pub micro_batches: crate::scheduler::MicroBatches,
    /// HTTPS for the OpenAI API: PEM certificate chain (with --api-tls-key).
    /// Reloaded when the file changes (checked every --api-tls-reload-secs, and
    /// on SIGHUP) without a restart.
    #[arg(long, requires = "api_tls_key", env = "EPSERVE_API_TLS_CERT")]
    pub api_tls_cert: Option<PathBuf>,
    /// HTTPS for the OpenAI API: PEM private key of --api-tls-cert.
    #[arg(long, requires = "api_tls_cert", env = "EPSERVE_API_TLS_KEY")]
    pub api_tls_key: Option<PathBuf>,
    /// How often the certificate files are checked for changes, in seconds.
    #[arg(long, default_value_t = 5.0)]
    pub api_tls_reload_secs: f64,
    /// A request's headers (and a TLS handshake, and a new connection's first
    /// request) must arrive within this many seconds.
    #[arg(long, default_value_t = 10.0)]
    pub http_header_timeout_secs: f64,
    /// Connections with no request in flight and no traffic for this many
    /// seconds are closed (keep-alive idle timeout).
    #[arg(long, default_value_t = 60.0)]
    pub http_idle_timeout_secs: f64,
    /// The whole request body must arrive within this many seconds (408 beyond).
    #[arg(long, default_value_t = 30.0)]
    pub request_body_timeout_secs: f64,
    /// Most open client connections. At the cap the longest-idle one is closed
    /// to make room; when all are busy new ones get 503. Default: 4096, or
    /// fewer when the open-files limit is low.
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Most /v1 requests in flight at once; beyond, 503 + Retry-After at once.
    #[arg(long, default_value_t = 2048)]
    pub max_concurrent_requests: usize,
    /// On SIGTERM/SIGINT, in-flight requests get this many seconds to finish.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_timeout_secs: f64,
    /// Longest prompt text in bytes, refused before tokenization. Default: 16
    /// bytes per token of --max-model-len (at least 64 KiB).
    #[arg(long)]
    pub max_prompt_bytes: Option<usize>,
    /// Most stop strings per request.
    #[arg(long, default_value_t = 16)]
    pub max_stop_strings: usize,
    /// Longest stop string, in bytes.
    #[arg(long, default_value_t = 256)]
    pub max_stop_string_bytes: usize,
    /// Turns automatic prefix caching off (on by default, as vLLM): full KV
    /// blocks are content-hashed and reused by later requests whose prompt
    /// starts with the same tokens (with attention-workers too).
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// Prefix caching on (the default; vLLM's flag, accepted for scripts).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Export per-expert series: epserve_expert_tokens_total and, in a cluster,
    /// the per-expert and per-replica load gauges (epserve_eplb_expert_tokens,
    /// epserve_eplb_replica_tokens): layers x experts series (6k on Qwen3), so
    /// off by default.
    #[arg(long)]
    pub expert_load_metrics: bool,
}

fn secs(name: &str, v: f64) -> Result<std::time::Duration> {
    if !(v.is_finite() && v > 0.0 && v <= 1e7) {
        bail!("--{name} must be a positive number of seconds, got {v}");
    }
    Ok(std::time::Duration::from_secs_f64(v))
}

impl ServeArgs {
    /// The connection-layer settings from the flags.
    pub fn http_options(&self) -> Result<server::HttpOptions> {
        let tls = match (&self.api_tls_cert, &self.api_tls_key) {
            (Some(cert), Some(key)) => Some(server::tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                reload_interval: secs("api-tls-reload-secs", self.api_tls_reload_secs)?,
            }),
            (None, None) => None,
            _ => bail!("--api-tls-cert and --api-tls-key go together"),
        };
        Ok(server::HttpOptions {
            header_timeout: secs("http-header-timeout-secs", self.http_header_timeout_secs)?,
            idle_timeout: secs("http-idle-timeout-secs", self.http_idle_timeout_secs)?,
            max_connections: match self.max_connections {
                Some(0) => bail!("--max-connections must be positive"),
                Some(n) => n,
                None => server::conn::default_max_connections(),
            },
            shutdown_timeout: secs("shutdown-timeout-secs", self.shutdown_timeout_secs)?,
            tls,
        })
    }
}

/// Parses `2GiB`, `512MiB`, `1.5G`, `1000000`.
pub fn parse_size(s: &str) -> Result<usize> {
    epserve_core::config::parse_size(s).map_err(anyhow::Error::msg)
}

/// Total memory of the machine from /proc/meminfo (None elsewhere).
fn total_memory() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The scheduler limits implied by the flags and the model.
pub fn scheduler_config(args: &ServeArgs, engine: &Engine) -> Result<SchedulerConfig> {
    let model_max = engine.model.config.max_position_embeddings;
    let max_model_len = args.max_model_len.unwrap_or(model_max);
    if max_model_len == 0 {
        bail!("--max-model-len must be positive");
    }
    if max_model_len > model_max {
        bail!(
            "--max-model-len {max_model_len} exceeds the model's max_position_embeddings ({model_max})"
        );
    }
    if args.block_size == 0 || args.max_num_seqs == 0 || args.max_num_batched_tokens == 0 {
        bail!("--block-size, --max-num-seqs and --max-num-batched-tokens must be positive");
    }
    let kv_bytes = match &args.kv_cache_memory {
        Some(s) => parse_size(s)?,
        None => {
            if !(args.kv_cache_fraction > 0.0 && args.kv_cache_fraction < 1.0) {
                bail!("--kv-cache-fraction must be in (0, 1)");
            }
            (total_memory().unwrap_or(8 << 30) as f64 * args.kv_cache_fraction) as usize
        }
    };
    let kv_dtype = engine.model.kv_dtype(args.kv_cache_dtype);
    let num_blocks = match engine.model.remote_attention() {
        // The KV lives on the attention shards: count blocks up to what the
        // smallest shard holds, so a step the scheduler admits fits there too.
        Some(a) => {
            let cap = a
                .capacity_positions()
                .context("the attention shards did not report their KV cache capacity")?;
            cap / args.block_size
        }
        None => {
            kv_bytes
                / engine
                    .model
                    .kv_block_bytes(args.block_size, kv_dtype)
                    .max(1)
        }
    };
    let capacity = num_blocks * args.block_size;
    if capacity < max_model_len {
        bail!(
            "the KV cache ({num_blocks} blocks of {} tokens) holds {capacity} tokens, fewer than --max-model-len {max_model_len}; raise --kv-cache-memory (of the attention-workers, when attention is remote) or lower --max-model-len",
            args.block_size
        );
    }
    Ok(SchedulerConfig {
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len,
        block_size: args.block_size,
        num_blocks,
        max_waiting: args.max_waiting,
        kv_dtype,
        micro_batches: args.micro_batches,
        enable_prefix_caching: !args.no_enable_prefix_caching,
        expert_load_metrics: args.expert_load_metrics,
        parallel_choose_min_logits: scheduler::PARALLEL_CHOOSE_MIN_LOGITS,
    })
}

fn default_name(model: &Path) -> String {
    model
        .file_name()
        .and_then(|n| n.to_str())
        .map(str::to_string)
        .unwrap_or_else(|| model.display().to_string())
}

/// The names clients may use in `model` (the first is reported): the
/// `--served-model-name` values, else the folder's name and the `--model`
/// string as given (vLLM serves the latter), without repeats.
pub fn served_names(args: &ServeArgs) -> Result<Vec<String>> {
    let mut names: Vec<String> = Vec::new();
    let candidates = if args.served_model_name.is_empty() {
        vec![
            default_name(&args.model),
            args.model.to_string_lossy().into_owned(),
        ]
    } else {
        args.served_model_name.clone()
    };
    for n in candidates {
        if n.trim().is_empty() {
            bail!("--served-model-name: a name must not be empty");
        }
        if !names.contains(&n) {
            names.push(n);
        }
    }
    Ok(names)
}

/// Runs the single-process server (blocking); `status` gets the
/// operator-facing "serving" line.
pub fn run(args: &ServeArgs, status: Status) -> Result<()> {
    let rt = io_runtime()?;
    let model = args.model.clone();
    let opts = epserve_core::experts::LoadOptions {
        expert_dtype: args.expert_dtype,
        dense_dtype: args.dense_dtype,
        tier: args.expert_memory.tier_options()?,
        ..Default::default()
    };
    serve_with(&rt, args, status, move || {
        Ok(Engine::load_with(&model, &opts)?)
    })
}

/// Binds, then loads the engine with `load` (so `/health` answers meanwhile),
/// starts the scheduler and serves until a signal.
pub fn serve_with<F>(
    rt: &tokio::runtime::Runtime,
    args: &ServeArgs,
    status: Status,
    load: F,
) -> Result<()>
where
    F: FnOnce() -> Result<Engine> + Send + 'static,
{
    serve_with_health(rt, args, status, None, load)
}

/// [`serve_with`], with `health` run by `/health` once the model is loaded
/// (the cluster's check: every expert has a live replica).
pub fn serve_with_health<F>(
    rt: &tokio::runtime::Runtime,
    args: &ServeArgs,
    status: Status,
    health: Option<server::HealthCheck>,
    load: F,
) -> Result<()>
where
    F: FnOnce() -> Result<Engine> + Send + 'static,
{
    crate::metrics::init();
    if !args.model.is_dir() {
        bail!(
            "{}: missing from the model folder (model folder)",
            args.model.display()
        );
    }
    let names = served_names(args)?;
    // Refuse a chat template that cannot be read or does not compile now,
    // not after minutes of loading.
    let chat_template = match &args.chat_template {
        Some(p) => Some(
            epserve_core::loader::tokenizer::ChatTemplate::from_file(p)
                .with_context(|| format!("--chat-template {}", p.display()))?,
        ),
        None => None,
    };
    let http = args.http_options()?;
    if let Some(t) = &http.tls {
        // Refuse to start with certificates that do not load.
        server::tls::load_certified_key(&t.cert, &t.key).map_err(anyhow::Error::msg)?;
    }
    if args.max_concurrent_requests == 0 {
        bail!("--max-concurrent-requests must be positive");
    }
    let state = AppState::new(ServerConfig {
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_body_bytes: args.max_request_body_bytes,
        max_logprobs: args.max_logprobs,
        body_timeout: secs("request-body-timeout-secs", args.request_body_timeout_secs)?,
        max_concurrent_requests: args.max_concurrent_requests,
        max_prompt_bytes: args.max_prompt_bytes,
        max_stop_strings: args.max_stop_strings,
        max_stop_string_bytes: args.max_stop_string_bytes,
        ..ServerConfig::new(names.clone())
    });
    let scheme = if http.tls.is_some() { "https" } else { "http" };
    if let Some(h) = health {
        let _ = state.health.set(h);
    }
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        let shown = if addr.ip().is_unspecified() {
            format!("{scheme}://127.0.0.1:{}", addr.port())
        } else {
            format!("{scheme}://{addr}")
        };
        // Load in the background so /health can say "loading" meanwhile.
        let loader_state = state.clone();
        let args2 = args.clone();
        let loading = tokio::task::spawn_blocking(move || -> Result<()> {
            let started = std::time::Instant::now();
            let progress = epserve_core::loader::progress::Reporter::start(format!(
                "loading model {}",
                args2.model.display()
            ));
            let mut engine = load()?;
            progress.finish();
            if let Some(t) = chat_template {
                tracing::info!(file = %t.path().display(), "chat template from --chat-template");
                engine.tokenizer.set_chat_template(t);
            }
            let engine = Arc::new(engine);
            let cfg = scheduler_config(&args2, &engine)?;
            tracing::info!(
                blocks = cfg.num_blocks,
                block_size = cfg.block_size,
                kv_cache_dtype = cfg.kv_dtype.name(),
                max_model_len = cfg.max_model_len,
                load_s = started.elapsed().as_secs_f64(),
                "model loaded"
            );
            let sched =
                scheduler::start(engine.clone(), cfg).context("cannot start the scheduler")?;
            let _ = loader_state.ready.set(Ready {
                engine,
                scheduler: sched,
                created: server::unix_now(),
            });
            Ok(())
        });
        let serving = tokio::spawn(server::serve(listener, state.clone(), http));
        match loading.await {
            Ok(Ok(())) => {
                status.say(&format!(
                    "epserve serving '{}' at {shown}/v1 (OpenAI API; /health, /metrics)",
                    names[0]
                ));
            }
            Ok(Err(e)) => return Err(e),
            Err(e) => bail!("model loading panicked: {e}"),
        }
        match serving.await {
            Ok(r) => r.context("server error"),
            Err(e) => bail!("server task failed: {e}"),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{ServeArgs, parse_size};
    use clap::{CommandFactory, Parser};

    #[derive(Debug, Parser)]
    struct Serve {
        #[command(flatten)]
        a: ServeArgs,
    }

    #[derive(Debug, Parser)]
    struct Coordinator {
        #[command(flatten)]
        a: crate::cluster::CoordinatorArgs,
    }

    #[test]
    fn http_flags_parse_and_do_not_clash() {
        Serve::command().debug_assert();
        Coordinator::command().debug_assert();
        let s = Serve::try_parse_from([
            "serve",
            "--model",
            "m",
            "--api-tls-cert",
            "c.pem",
            "--api-tls-key",
            "k.pem",
            "--http-header-timeout-secs",
            "5",
            "--http-idle-timeout-secs",
            "30",
            "--request-body-timeout-secs",
            "7",
            "--max-connections",
            "100",
            "--max-concurrent-requests",
            "9",
            "--shutdown-timeout-secs",
            "3",
            "--max-prompt-bytes",
            "1000",
            "--max-stop-strings",
            "4",
            "--max-stop-string-bytes",
            "8",
        ]);
        let s = s.map_err(|e| e.to_string());
        assert!(s.is_ok(), "{s:?}");
        let Ok(s) = s else { return };
        let o = s.a.http_options().map_err(|e| e.to_string());
        assert!(o.is_ok(), "{o:?}");
        let Ok(o) = o else { return };
        assert_eq!(o.max_connections, 100);
        assert_eq!(o.header_timeout.as_secs(), 5);
        assert!(o.tls.is_some());
        // A certificate without its key is refused by clap.
        assert!(
            Serve::try_parse_from(["serve", "--model", "m", "--api-tls-cert", "c.pem"]).is_err()
        );
        let bad = Serve::try_parse_from(["serve", "--model", "m", "--http-idle-timeout-secs", "0"]);
        assert!(bad.is_ok_and(|b| b.a.http_options().is_err()));
    }

    #[test]
    fn served_names_take_vllms_form_and_default_to_the_folder_and_the_model_string() {
        let names = |args: &[&str]| {
            Serve::try_parse_from([&["serve"], args].concat())
                .map_err(|e| e.to_string())
                .and_then(|s| super::served_names(&s.a).map_err(|e| e.to_string()))
        };
        assert_eq!(
            names(&["--model", "/models/Qwen3-30B-A3B"]),
            Ok(vec![
                "Qwen3-30B-A3B".to_string(),
                "/models/Qwen3-30B-A3B".to_string()
            ])
        );
        // A bare folder name is both: listed once.
        assert_eq!(names(&["--model", "tiny"]), Ok(vec!["tiny".to_string()]));
        let ab = Ok(vec!["a".to_string(), "b".to_string()]);
        assert_eq!(
            names(&["--served-model-name", "a", "b", "--model", "m"]),
            ab
        );
        assert_eq!(
            names(&[
                "--model",
                "m",
                "--served-model-name",
                "a",
                "--served-model-name",
                "b"
            ]),
            ab
        );
        assert!(names(&["--model", "m", "--served-model-name", " "]).is_err());
        let t = Serve::try_parse_from(["serve", "--model", "m", "--chat-template", "t.jinja"]);
        assert!(t.is_ok_and(|t| t.a.chat_template.is_some()));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("2GiB").ok(), Some(2 << 30));
        assert_eq!(parse_size("512MiB").ok(), Some(512 << 20));
        assert_eq!(parse_size("1000").ok(), Some(1000));
        assert_eq!(parse_size("1.5G").ok(), Some(1_500_000_000));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3 parsecs").is_err());
    }

    #[test]
    fn prefix_caching_is_on_unless_turned_off_and_the_last_flag_wins() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            serve: super::ServeArgs,
        }
        let off = |args: &[&str]| {
            Cli::try_parse_from([&["serve", "--model", "m"], args].concat())
                .map(|c| c.serve.no_enable_prefix_caching)
                .ok()
        };
        assert_eq!(off(&[]), Some(false));
        assert_eq!(off(&["--no-enable-prefix-caching"]), Some(true));
        assert_eq!(off(&["--enable-prefix-caching"]), Some(false));
        assert_eq!(
            off(&["--no-enable-prefix-caching", "--enable-prefix-caching"]),
            Some(false)
        );
        assert_eq!(
            off(&["--enable-prefix-caching", "--no-enable-prefix-caching"]),
            Some(true)
        );
    }
}
