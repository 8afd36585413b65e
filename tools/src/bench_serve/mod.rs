//! `epserve bench serve`: a twin of `vllm bench serve`. Builds random prompts
//! with the model's tokenizer, sends them as streaming requests to any
//! OpenAI-compatible server at a chosen rate and concurrency, and prints the
//! same summary table as vLLM (TTFT, TPOT, ITL, E2EL, throughputs), optionally
//! saving vLLM's result JSON.
//!
//! `args` holds the flags, `dataset` the random prompts, `traffic` the arrival
//! times, `client` the HTTP/SSE request, `metrics` the numbers and `report`
//! the table and the file.

pub mod args;
pub mod client;
pub mod dataset;
pub mod metrics;
pub mod report;
pub mod traffic;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Map, Value, json};
use tokio::sync::Semaphore;

pub use args::{Backend, BenchServeArgs, DatasetName};
use client::{Endpoint, RequestInput};
use dataset::{HfTokenizer, RandomParams, SampleRequest};
use metrics::{Goodput, RequestOutput};
use report::RunInfo;

const METRIC_NAMES: [&str; 6] = [
    "ttft",
    "tpot",
    "itl",
    "e2el",
    "client_queue_time",
    "e2el_including_client_queue",
];

/// Runs the benchmark on its own tokio runtime.
pub fn run(args: &BenchServeArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(run_async(args))
}

/// Backend and endpoint from the flags: each defaults from the other.
fn resolve_endpoint(args: &BenchServeArgs) -> Result<(Backend, String)> {
    let backend = args.backend.unwrap_or(match &args.endpoint {
        Some(e) if e.trim_end_matches('/').ends_with("chat/completions") => Backend::OpenaiChat,
        _ => Backend::Openai,
    });
    let endpoint = args.endpoint.clone().unwrap_or_else(|| match backend {
        Backend::Openai => "/v1/completions".into(),
        Backend::OpenaiChat => "/v1/chat/completions".into(),
    });
    let path = endpoint.trim_end_matches('/');
    match backend {
        Backend::OpenaiChat if !path.ends_with("chat/completions") => {
            bail!(
                "--backend openai-chat needs a chat completions endpoint (…/chat/completions), got {endpoint}"
            )
        }
        Backend::Openai if !path.ends_with("completions") || path.ends_with("chat/completions") => {
            bail!(
                "--backend openai needs a completions endpoint (…/v1/completions), got {endpoint}; use --backend openai-chat for chat"
            )
        }
        _ => Ok((backend, endpoint)),
    }
}

fn base_url(args: &BenchServeArgs) -> String {
    match &args.base_url {
        Some(u) => u.trim_end_matches('/').to_string(),
        None if args.host.contains(':') => format!("http://[{}]:{}", args.host, args.port),
        None => format!("http://{}:{}", args.host, args.port),
    }
}

/// Sampling flags and --extra-body, merged (--extra-body wins).
fn extra_body(args: &BenchServeArgs) -> Result<Map<String, Value>> {
    let mut body = Map::new();
    let floats = [
        ("top_p", args.top_p),
        ("min_p", args.min_p),
        ("temperature", args.temperature),
        ("frequency_penalty", args.frequency_penalty),
        ("presence_penalty", args.presence_penalty),
        ("repetition_penalty", args.repetition_penalty),
    ];
    for (k, v) in floats {
        if let Some(v) = v {
            body.insert(k.into(), json!(v));
        }
    }
    if let Some(k) = args.top_k {
        body.insert("top_k".into(), json!(k));
    }
    if let Some(extra) = &args.extra_body {
        let v: Value = serde_json::from_str(extra).context("--extra-body is not valid JSON")?;
        let Value::Object(obj) = v else {
            bail!("--extra-body must be a JSON object");
        };
        body.extend(obj);
    }
    Ok(body)
}

fn key_values(pairs: &[String], flag: &str) -> Result<Vec<(String, String)>> {
    pairs
        .iter()
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .ok_or_else(|| anyhow::anyhow!("invalid {flag} {p:?}: use KEY=VALUE"))
        })
        .collect()
}

/// The first model the server lists.
async fn first_model(
    client: &reqwest::Client,
    base: &str,
    headers: &reqwest::header::HeaderMap,
) -> Result<String> {
    let url = format!("{base}/v1/models");
    let resp = client
        .get(&url)
        .headers(headers.clone())
        .send()
        .await
        .with_context(|| {
            format!("cannot fetch models from {url}: is the server running and the URL right?")
        })?;
    let status = resp.status();
    if !status.is_success() {
        bail!("GET {url}: HTTP {status}");
    }
    let v: Value = resp
        .json()
        .await
        .with_context(|| format!("GET {url}: not JSON"))?;
    v.get("data")
        .and_then(Value::as_array)
        .and_then(|d| d.first())
        .and_then(|m| m.get("id"))
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| anyhow::anyhow!("no models found on the server at {base}"))
}

/// vLLM's alignment step: when the server has vLLM's `/tokenize` and counts
/// the first prompt differently from the local tokenizer, cut every prompt to
/// its token count with the server's `/tokenize` and `/detokenize`. Servers
/// without `/tokenize` keep the prompts as they are.
async fn align_prompts(
    endpoint: &Endpoint,
    base: &str,
    requests: Vec<SampleRequest>,
) -> Vec<SampleRequest> {
    let Some(first) = requests.first() else {
        return requests;
    };
    let tokenize = |prompt: String| {
        let (client, headers, model) = (
            endpoint.client.clone(),
            endpoint.headers.clone(),
            endpoint.model.clone(),
        );
        let url = format!("{base}/tokenize");
        async move {
            let body = json!({"model": model, "prompt": prompt, "add_special_tokens": false});
            let resp = client
                .post(url)
                .headers(headers)
                .json(&body)
                .send()
                .await
                .ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let v: Value = resp.json().await.ok()?;
            let ids: Vec<u64> = v
                .get("tokens")?
                .as_array()?
                .iter()
                .filter_map(Value::as_u64)
                .collect();
            Some(ids)
        }
    };
    // A server whose /tokenize reads another field (llama.cpp's takes
    // `content`) answers no tokens for a non-empty prompt: unavailable too.
    let Some(first_ids) = tokenize(first.prompt.clone())
        .await
        .filter(|ids| !ids.is_empty() || first.prompt.is_empty())
    else {
        println!("WARNING: /tokenize unavailable, skipping alignment.");
        return requests;
    };
    if first_ids.len() == first.prompt_len {
        return requests;
    }
    println!(
        "WARNING: tokenizer mismatch (server={}, expected={}), re-aligning prompts.",
        first_ids.len(),
        first.prompt_len
    );
    let sem = Arc::new(Semaphore::new(64));
    let mut tasks = Vec::with_capacity(requests.len());
    for req in requests {
        let (sem, tok) = (sem.clone(), tokenize(req.prompt.clone()));
        let (client, headers, model) = (
            endpoint.client.clone(),
            endpoint.headers.clone(),
            endpoint.model.clone(),
        );
        let url = format!("{base}/detokenize");
        let orig = req.clone();
        tasks.push((
            orig,
            tokio::spawn(async move {
                let _permit = sem.acquire_owned().await.ok();
                let ids = tok.await?;
                if ids.len() <= req.prompt_len {
                    return Some(req);
                }
                let body = json!({"model": model, "tokens": &ids[..req.prompt_len]});
                let resp = client
                    .post(url)
                    .headers(headers)
                    .json(&body)
                    .send()
                    .await
                    .ok()?;
                let v: Value = resp.json().await.ok()?;
                let prompt = v.get("prompt")?.as_str()?.to_string();
                Some(SampleRequest { prompt, ..req })
            }),
        ));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for (orig, t) in tasks {
        // Keep the local prompt when the server could not redo it.
        out.push(t.await.ok().flatten().unwrap_or(orig));
    }
    out
}

/// Sends a test request until it succeeds or `timeout` passes.
async fn wait_until_ready(
    endpoint: &Endpoint,
    test: &RequestInput,
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let out = endpoint.send(test, Instant::now()).await;
        if out.success {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "Initial test run failed - Please make sure benchmark arguments are correctly specified. Error: {}",
                out.error
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn progress_bar(n: usize, hidden: bool) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(n as u64);
    if let Ok(style) = ProgressStyle::with_template(
        "{percent:>3}%|{wide_bar}| {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}]",
    ) {
        pb.set_style(style);
    }
    pb
}

/// Sends every request at its arrival time, at most `max_concurrency` at a
/// time; returns the outputs in request order and the run's wall time.
async fn drive(
    endpoint: Arc<Endpoint>,
    inputs: Vec<RequestInput>,
    offsets: &[f64],
    max_concurrency: Option<usize>,
    pb: &ProgressBar,
) -> (Vec<RequestOutput>, f64) {
    let sem = max_concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let origin = Instant::now();
    let mut tasks = Vec::with_capacity(inputs.len());
    for (input, &at) in inputs.into_iter().zip(offsets) {
        if at > 0.0 {
            tokio::time::sleep_until((origin + Duration::from_secs_f64(at)).into()).await;
        }
        let arrival = origin.elapsed().as_secs_f64();
        let (endpoint, sem, pb) = (endpoint.clone(), sem.clone(), pb.clone());
        let prompt_len = input.prompt_len;
        tasks.push((
            prompt_len,
            tokio::spawn(async move {
                let _permit = match sem {
                    Some(s) => s.acquire_owned().await.ok(),
                    None => None,
                };
                let mut out = endpoint.send(&input, origin).await;
                out.client_queue_time = (out.start_time - arrival).max(0.0);
                pb.inc(1);
                out
            }),
        ));
    }
    let mut outputs = Vec::with_capacity(tasks.len());
    for (prompt_len, t) in tasks {
        outputs.push(t.await.unwrap_or_else(|e| RequestOutput {
            prompt_len,
            error: format!("request task failed: {e}"),
            ..Default::default()
        }));
    }
    (outputs, origin.elapsed().as_secs_f64())
}

/// Where the result goes, if anywhere.
fn result_path(args: &BenchServeArgs, info: &RunInfo) -> Option<PathBuf> {
    let named = args.save_result.as_deref().filter(|s| !s.is_empty());
    if args.save_result.is_none() && !args.append_result {
        return None;
    }
    let name = named
        .map(str::to_string)
        .or_else(|| args.result_filename.clone())
        .unwrap_or_else(|| report::default_filename(info));
    Some(match &args.result_dir {
        Some(dir) => dir.join(name),
        None => PathBuf::from(name),
    })
}

fn save(path: &Path, value: &Value, append: bool) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let text = serde_json::to_string(value)?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    let nonempty = append && f.metadata().map(|m| m.len() > 0).unwrap_or(false);
    if nonempty {
        f.write_all(b"\n")?;
    }
    f.write_all(text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

async fn run_async(args: &BenchServeArgs) -> Result<()> {
    if args.max_concurrency == Some(0) {
        bail!("--max-concurrency must be greater than 0");
    }
    if args.num_prompts == 0 {
        bail!("--num-prompts must be greater than 0");
    }
    let (backend, endpoint_path) = resolve_endpoint(args)?;
    let base = base_url(args);
    if !(base.starts_with("http://") || base.starts_with("https://")) {
        bail!("--base-url must start with http:// or https://, got {base}");
    }
    let percentiles =
        metrics::parse_percentiles(&args.metric_percentiles).map_err(anyhow::Error::msg)?;
    let percentile_metrics: Vec<String> = args
        .percentile_metrics
        .split(',')
        .map(|m| m.trim().to_string())
        .collect();
    if let Some(bad) = percentile_metrics
        .iter()
        .find(|m| !METRIC_NAMES.contains(&m.as_str()))
    {
        bail!(
            "unknown metric {bad:?} in --percentile-metrics: expected some of {}",
            METRIC_NAMES.join(",")
        );
    }
    let goodput = Goodput::parse(&args.goodput).map_err(anyhow::Error::msg)?;
    let metadata = key_values(&args.metadata, "--metadata")?;
    let headers = client::headers(&args.header, args.api_key.as_deref())?;
    let http = client::http_client(args.insecure, !args.no_connection_reuse)?;

    let model_id = match &args.model {
        Some(m) => m.clone(),
        None => {
            println!("Model not specified, fetching first model from server...");
            let m = first_model(&http, &base, &headers).await?;
            println!("First model name: {m}, first model id: {m}");
            m
        }
    };
    let model_name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| model_id.clone());
    let tokenizer_dir = match (&args.tokenizer, Path::new(&model_id)) {
        (Some(t), _) => t.clone(),
        (None, m) if m.join("tokenizer.json").is_file() => m.to_path_buf(),
        _ => bail!(
            "the dataset needs the model's tokenizer: pass --tokenizer DIR (a Hugging Face folder with tokenizer.json)"
        ),
    };
    let tokenizer = HfTokenizer::from_path(&tokenizer_dir)?;

    let id_prefix = args
        .request_id_prefix
        .clone()
        .unwrap_or_else(|| format!("bench-{:08x}-", rand::random::<u32>()));
    let requests = match args.dataset_name {
        DatasetName::Random => {
            let params = RandomParams {
                num_requests: args.num_prompts,
                input_len: args.input_len.unwrap_or(args.random_input_len),
                output_len: args.output_len.unwrap_or(args.random_output_len),
                range_ratio: args.random_range_ratio,
                prefix_len: args.random_prefix_len,
                seed: args.seed,
                token_pool: args.random_token_pool,
            };
            dataset::sample_random(&tokenizer, &params, &id_prefix)?
        }
        DatasetName::Sharegpt => {
            let Some(path) = &args.dataset_path else {
                bail!(
                    "--dataset-name sharegpt needs --dataset-path FILE (vLLM's ShareGPT JSON; scripts/make_sharegpt_sample.py writes a small one)"
                );
            };
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading --dataset-path {}", path.display()))?;
            let params = dataset::ShareGptParams {
                num_requests: args.num_prompts,
                seed: args.seed,
                output_len: args.sharegpt_output_len,
            };
            dataset::sample_sharegpt(&tokenizer, &text, &params, &id_prefix)
                .with_context(|| format!("--dataset-path {}", path.display()))?
        }
        DatasetName::Prefix => {
            let params = dataset::PrefixParams {
                num_requests: args.num_prompts,
                prefix_len: args.prefix_repetition_prefix_len,
                suffix_len: args.prefix_repetition_suffix_len,
                num_prefixes: args.prefix_repetition_num_prefixes,
                output_len: args.output_len.unwrap_or(args.prefix_repetition_output_len),
                seed: args.seed,
            };
            dataset::sample_prefix_repetition(&tokenizer, &params, &id_prefix)?
        }
    };
    if requests.is_empty() {
        bail!("the dataset gave no requests (--num-prompts 0?)");
    }

    let mut extra = extra_body(args)?;
    if !extra.contains_key("temperature") {
        println!(
            "WARNING: the benchmark does not set a temperature; the server's default applies. \
             For greedy decoding, pass --temperature=0."
        );
    }
    extra.retain(|_, v| !v.is_null());
    let endpoint = Arc::new(Endpoint {
        client: http,
        api_url: format!("{base}{endpoint_path}"),
        backend,
        model: model_name,
        logprobs: args.logprobs,
        // Synthetic prompts run every request to its length, as vLLM's
        // do; ShareGPT replies may end early unless --ignore-eos.
        ignore_eos: args.ignore_eos || args.dataset_name != DatasetName::Sharegpt,
        extra_body: extra,
        headers,
    });
    // ShareGPT prompts are real text, sent as they are (as vLLM does).
    let requests = if args.dataset_name == DatasetName::Sharegpt {
        requests
    } else {
        align_prompts(&endpoint, &base, requests).await
    };
    let inputs: Vec<RequestInput> = requests
        .into_iter()
        .map(|r| RequestInput {
            prompt: r.prompt,
            prompt_len: r.prompt_len,
            output_len: r.expected_output_len,
            request_id: (!r.request_id.is_empty()).then_some(r.request_id),
        })
        .collect();
    let offsets =
        traffic::arrival_offsets(inputs.len(), args.request_rate, args.burstiness, args.seed)?;

    println!("Starting initial single prompt test run...");
    let test = RequestInput {
        request_id: None,
        ..inputs[0].clone()
    };
    if args.ready_check_timeout_sec > 0 {
        wait_until_ready(
            &endpoint,
            &test,
            Duration::from_secs(args.ready_check_timeout_sec),
        )
        .await?;
        println!("Initial test run completed.");
    } else {
        println!("Skipping endpoint ready check.");
    }
    if args.num_warmups > 0 {
        println!("Warming up with {} requests...", args.num_warmups);
        let pb = progress_bar(args.num_warmups, args.disable_tqdm);
        let warm = vec![test.clone(); args.num_warmups];
        let zeros = vec![0.0; warm.len()];
        drive(endpoint.clone(), warm, &zeros, args.max_concurrency, &pb).await;
        pb.finish_and_clear();
        println!("Warmup run completed.");
    }

    println!("Starting main benchmark run...");
    println!(
        "Traffic request rate: {}",
        report::py_float(args.request_rate)
    );
    let distribution = if args.burstiness == 1.0 {
        "Poisson process"
    } else {
        "Gamma distribution"
    };
    println!(
        "Burstiness factor: {} ({distribution})",
        report::py_float(args.burstiness)
    );
    match args.max_concurrency {
        Some(c) => println!("Maximum request concurrency: {c}"),
        None => println!("Maximum request concurrency: None"),
    }
    let _ = std::io::stdout().flush();
    let pb = progress_bar(inputs.len(), args.disable_tqdm);
    let (outputs, duration) = drive(
        endpoint.clone(),
        inputs,
        &offsets,
        args.max_concurrency,
        &pb,
    )
    .await;
    pb.finish();
    if !pb.is_hidden() {
        // Leave the finished bar on its own line, as tqdm does.
        eprintln!();
    }

    let output_lens = metrics::actual_output_lens(&outputs, |t| tokenizer.count(t));
    let m = metrics::calculate_metrics(&outputs, &output_lens, duration, &percentiles, &goodput);
    let failed: Vec<&RequestOutput> = outputs.iter().filter(|o| !o.success).collect();
    if !failed.is_empty() {
        println!("Failed requests during benchmark run detected (capping to 10):");
        for (i, o) in failed.iter().take(10).enumerate() {
            println!("Error {i}: {}", o.error);
        }
    }
    if m.completed == 0 {
        eprintln!("WARNING: all requests failed; check the benchmark's flags and the server");
    }
    let info = RunInfo {
        backend,
        label: args.label.clone(),
        model_id,
        tokenizer_id: tokenizer_dir.display().to_string(),
        num_prompts: args.num_prompts,
        request_rate: args.request_rate,
        burstiness: args.burstiness,
        max_concurrency: args.max_concurrency,
        metadata,
        duration,
        percentile_metrics,
        percentiles,
        goodput_set: goodput.is_set(),
        date: report::date_string(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        ),
    };
    print!("{}", report::summary(&m, &info, &outputs));
    let _ = std::io::stdout().flush();
    if let Some(path) = result_path(args, &info) {
        let value = report::result_json(&m, &info, &outputs, &output_lens, args.save_detailed);
        save(&path, &value, args.append_result)?;
        eprintln!("Saved the result to {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrap {
        #[command(flatten)]
        args: BenchServeArgs,
    }

    fn parse(extra: &[&str]) -> BenchServeArgs {
        let mut argv = vec!["bench"];
        argv.extend_from_slice(extra);
        Wrap::try_parse_from(argv).expect("flags parse").args
    }

    #[test]
    fn endpoint_and_backend_default_from_each_other() {
        let a = parse(&[]);
        assert_eq!(
            resolve_endpoint(&a).expect("ok"),
            (Backend::Openai, "/v1/completions".into())
        );
        let a = parse(&["--backend", "openai-chat"]);
        assert_eq!(
            resolve_endpoint(&a).expect("ok"),
            (Backend::OpenaiChat, "/v1/chat/completions".into())
        );
        let a = parse(&["--endpoint", "/v1/chat/completions"]);
        assert_eq!(resolve_endpoint(&a).expect("ok").0, Backend::OpenaiChat);
        assert!(
            resolve_endpoint(&parse(&[
                "--backend",
                "openai",
                "--endpoint",
                "/v1/chat/completions"
            ]))
            .is_err()
        );
        assert!(
            resolve_endpoint(&parse(&[
                "--backend",
                "openai-chat",
                "--endpoint",
                "/v1/completions"
            ]))
            .is_err()
        );
        assert_eq!(
            base_url(&parse(&["--base-url", "https://h:1/"])),
            "https://h:1"
        );
        assert_eq!(base_url(&parse(&["--port", "9"])), "http://127.0.0.1:9");
    }

    #[test]
    fn save_result_takes_an_optional_file() {
        let info = RunInfo {
            backend: Backend::Openai,
            label: Some("x".into()),
            model_id: "m".into(),
            tokenizer_id: "m".into(),
            num_prompts: 1,
            request_rate: 2.0,
            burstiness: 1.0,
            max_concurrency: None,
            metadata: vec![],
            duration: 1.0,
            percentile_metrics: vec![],
            percentiles: vec![],
            goodput_set: false,
            date: "d".into(),
        };
        assert_eq!(result_path(&parse(&[]), &info), None);
        assert_eq!(
            result_path(&parse(&["--save-result", "r.json"]), &info),
            Some("r.json".into())
        );
        assert_eq!(
            result_path(&parse(&["--save-result"]), &info),
            Some("x-2.0qps-m-d.json".into())
        );
        let a = parse(&[
            "--save-result",
            "--result-filename",
            "f.json",
            "--result-dir",
            "out",
        ]);
        assert_eq!(result_path(&a, &info), Some(PathBuf::from("out/f.json")));
    }

    #[test]
    fn sampling_flags_and_extra_body() {
        let a = parse(&[
            "--temperature",
            "0",
            "--top-k",
            "5",
            "--extra-body",
            r#"{"top_k": 7, "seed": 1}"#,
        ]);
        let b = extra_body(&a).expect("body");
        assert_eq!(b["temperature"], 0.0);
        assert_eq!(b["top_k"], 7);
        assert_eq!(b["seed"], 1);
        assert!(extra_body(&parse(&["--extra-body", "[1]"])).is_err());
    }
}
