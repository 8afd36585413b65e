//! Hostile-input battery against a running OpenAI server (the qwen3_moe_a
//! fixture, in process, loopback only). Every case is listed in `CASES` /
//! `RAW_CASES` below; after each one the server must still answer a good
//! request. Connection-level cases (half-sent headers, slow-loris bodies,
//! idle connections past the cap, load shedding, bounded shutdown) follow.
//!
//! Limits used here are small so the battery runs in seconds: body 1 MiB,
//! body timeout 1 s, header timeout 1 s, idle timeout 2 s, prompt 64 KiB,
//! 16 stop strings of up to 256 bytes, 20 logprobs.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use epserve_coordinator::scheduler::{self, MicroBatches, SchedulerConfig};
use epserve_coordinator::server::{self, AppState, HttpOptions, Ready, ServerConfig};
use epserve_core::engine::Engine;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn fixture() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_a/f32")
}

fn config() -> ServerConfig {
    ServerConfig {
        max_body_bytes: 1 << 20,
        body_timeout: Duration::from_secs(1),
        max_concurrent_requests: 64,
        max_prompt_bytes: Some(64 * 1024),
        ..ServerConfig::new(vec!["tiny".into()])
    }
}

fn opts() -> HttpOptions {
    HttpOptions {
        header_timeout: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(2),
        max_connections: 64,
        shutdown_timeout: Duration::from_secs(2),
        tls: None,
    }
}

struct Running {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<()>,
}

async fn start(cfg: ServerConfig, opts: HttpOptions, with_model: bool) -> Running {
    let state = AppState::new(cfg);
    if with_model {
        let engine = Arc::new(Engine::load(&fixture()).expect("fixture engine"));
        let sched = scheduler::start(
            engine.clone(),
            SchedulerConfig {
                max_num_seqs: 8,
                max_num_batched_tokens: 256,
                max_model_len: 256,
                block_size: 16,
                num_blocks: 128,
                max_waiting: 64,
                kv_dtype: Default::default(),
                micro_batches: MicroBatches::Fixed(1),
                enable_prefix_caching: true,
                expert_load_metrics: false,
                parallel_choose_min_logits: scheduler::PARALLEL_CHOOSE_MIN_LOGITS,
            },
        )
        .expect("scheduler");
        let _ = state.ready.set(Ready {
            engine,
            scheduler: sched,
            created: 0,
        });
    }
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    std_listener.set_nonblocking(true).expect("nonblocking");
    let addr = std_listener.local_addr().expect("addr");
    let listener = tokio::net::TcpListener::from_std(std_listener).expect("listener");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let done = tokio::spawn(async move {
        let r = server::serve_until(listener, state, opts, async {
            let _ = rx.await;
        })
        .await;
        assert!(r.is_ok(), "{r:?}");
    });
    Running {
        addr,
        stop: Some(tx),
        done,
    }
}

/// Sends raw bytes on a fresh connection and reads until the server closes
/// it (or `wait` passes); returns the status (0 when none) and the body.
async fn raw(addr: SocketAddr, bytes: &[u8], wait: Duration) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    // The server may answer (413) and close before everything is written.
    let _ = s.write_all(bytes).await;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(wait, s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|t| t.get(..3))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

fn post(path: &str, body: &[u8]) -> Vec<u8> {
    let mut v = format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    v.extend_from_slice(body);
    v
}

/// The good request every case is followed by.
async fn good(addr: SocketAddr) {
    let body = json!({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0,
                      "ignore_eos": true})
    .to_string();
    let (st, text) = raw(
        addr,
        &post("/v1/completions", body.as_bytes()),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        st, 200,
        "the server stopped answering good requests: {text}"
    );
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

/// An OpenAI-shaped error body naming `param` (when given).
fn check_error(case: &str, body: &str, param: Option<&str>) {
    let v: Value = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("{case}: error body is not JSON ({e}): {body}"));
    assert!(v["error"]["message"].is_string(), "{case}: {body}");
    assert!(v["error"]["type"].is_string(), "{case}: {body}");
    if let Some(p) = param {
        assert_eq!(v["error"]["param"], p, "{case}: {body}");
    }
}

fn nested(depth: usize) -> String {
    format!(
        r#"{{"prompt": {}1{}}}"#,
        "[".repeat(depth),
        "]".repeat(depth)
    )
}

fn many_stops(n: usize) -> String {
    let stops: Vec<String> = (0..n).map(|i| format!("s{i}")).collect();
    json!({"prompt": "hi", "max_tokens": 4, "stop": stops}).to_string()
}

/// (name, path, body, expected status, `param` the error must name).
type Case = (
    &'static str,
    &'static str,
    Vec<u8>,
    u16,
    Option<&'static str>,
);

fn cases() -> Vec<Case> {
    let c = "/v1/completions";
    let ch = "/v1/chat/completions";
    let j = |s: &str| s.as_bytes().to_vec();
    let big_prompt = json!({"prompt": "a ".repeat(40_000), "max_tokens": 1}).to_string();
    let big_chat =
        json!({"messages": [{"role": "user", "content": "b".repeat(70_000)}]}).to_string();
    let many_msgs: Vec<Value> = (0..20_000)
        .map(|_| json!({"role": "user", "content": "xyz"}))
        .collect();
    let long_stop = json!({"prompt": "hi", "stop": ["x".repeat(10_000)]}).to_string();
    let stop_ids: Vec<u32> = (0..1000).collect();
    vec![
        ("empty body", c, j(""), 400, None),
        ("null body", c, j("null"), 400, None),
        ("array body", c, j("[]"), 400, None),
        ("string body", c, j("\"prompt\""), 400, None),
        ("truncated JSON", c, j(r#"{"prompt": "hi""#), 400, None),
        (
            "trailing garbage",
            c,
            j(r#"{"prompt": "hi"} xx"#),
            400,
            None,
        ),
        (
            "prompt is a number",
            c,
            j(r#"{"prompt": 5}"#),
            400,
            Some("prompt"),
        ),
        (
            "prompt is an object",
            c,
            j(r#"{"prompt": {"a": 1}}"#),
            400,
            Some("prompt"),
        ),
        (
            "prompt missing",
            c,
            j(r#"{"max_tokens": 3}"#),
            400,
            Some("prompt"),
        ),
        (
            "prompt empty string",
            c,
            j(r#"{"prompt": ""}"#),
            400,
            Some("prompt"),
        ),
        (
            "prompt empty ids",
            c,
            j(r#"{"prompt": []}"#),
            400,
            Some("prompt"),
        ),
        (
            "prompt id out of vocab",
            c,
            j(r#"{"prompt": [999999999]}"#),
            400,
            Some("prompt"),
        ),
        (
            "prompt id negative",
            c,
            j(r#"{"prompt": [-1]}"#),
            400,
            Some("prompt"),
        ),
        (
            "prompt id 1e20",
            c,
            j(r#"{"prompt": [1e20]}"#),
            400,
            Some("prompt"),
        ),
        (
            "prompt batch of two",
            c,
            j(r#"{"prompt": ["a", "b"]}"#),
            400,
            Some("prompt"),
        ),
        (
            "prompt over the byte cap",
            c,
            j(&big_prompt),
            400,
            Some("prompt"),
        ),
        (
            "prompt ids over the context",
            c,
            j(&json!({"prompt": vec![1; 5000]}).to_string()),
            400,
            Some("prompt"),
        ),
        (
            "max_tokens negative",
            c,
            j(r#"{"prompt": "hi", "max_tokens": -1}"#),
            400,
            Some("max_tokens"),
        ),
        (
            "max_tokens zero",
            c,
            j(r#"{"prompt": "hi", "max_tokens": 0}"#),
            400,
            Some("max_tokens"),
        ),
        (
            "max_tokens 1e30",
            c,
            j(r#"{"prompt": "hi", "max_tokens": 1e30}"#),
            400,
            Some("max_tokens"),
        ),
        (
            "max_tokens i64::MAX",
            c,
            j(r#"{"prompt": "hi", "max_tokens": 9223372036854775807}"#),
            400,
            Some("max_tokens"),
        ),
        (
            "max_tokens u64 overflow",
            c,
            j(r#"{"prompt": "hi", "max_tokens": 99999999999999999999999}"#),
            400,
            Some("max_tokens"),
        ),
        (
            "max_tokens a string",
            c,
            j(r#"{"prompt": "hi", "max_tokens": "ten"}"#),
            400,
            Some("max_tokens"),
        ),
        (
            "temperature negative",
            c,
            j(r#"{"prompt": "hi", "temperature": -1}"#),
            400,
            Some("temperature"),
        ),
        (
            "temperature 1e300 (inf as f32)",
            c,
            j(r#"{"prompt": "hi", "temperature": 1e300}"#),
            400,
            Some("temperature"),
        ),
        (
            "temperature a string",
            c,
            j(r#"{"prompt": "hi", "temperature": "hot"}"#),
            400,
            Some("temperature"),
        ),
        (
            "top_p zero",
            c,
            j(r#"{"prompt": "hi", "top_p": 0}"#),
            400,
            Some("top_p"),
        ),
        (
            "top_p two",
            c,
            j(r#"{"prompt": "hi", "top_p": 2}"#),
            400,
            Some("top_p"),
        ),
        (
            "min_p negative",
            c,
            j(r#"{"prompt": "hi", "min_p": -0.5}"#),
            400,
            Some("min_p"),
        ),
        (
            "top_k -5",
            c,
            j(r#"{"prompt": "hi", "top_k": -5}"#),
            400,
            Some("top_k"),
        ),
        (
            "top_k 1e20",
            c,
            j(r#"{"prompt": "hi", "top_k": 1e20}"#),
            400,
            Some("top_k"),
        ),
        (
            "repetition_penalty zero",
            c,
            j(r#"{"prompt": "hi", "repetition_penalty": 0}"#),
            400,
            Some("repetition_penalty"),
        ),
        (
            "frequency_penalty 3",
            c,
            j(r#"{"prompt": "hi", "frequency_penalty": 3}"#),
            400,
            Some("frequency_penalty"),
        ),
        (
            "presence_penalty -1e10",
            c,
            j(r#"{"prompt": "hi", "presence_penalty": -1e10}"#),
            400,
            Some("presence_penalty"),
        ),
        (
            "n = 17",
            c,
            j(r#"{"prompt": "hi", "n": 17}"#),
            400,
            Some("n"),
        ),
        (
            "best_of != n",
            c,
            j(r#"{"prompt": "hi", "n": 2, "best_of": 3}"#),
            400,
            Some("best_of"),
        ),
        (
            "logit_bias out of vocabulary",
            c,
            j(r#"{"prompt": "hi", "logit_bias": {"4294967296": 1}}"#),
            400,
            Some("logit_bias"),
        ),
        (
            "logit_bias 1e300",
            c,
            j(r#"{"prompt": "hi", "logit_bias": {"1": 1e300}}"#),
            400,
            Some("logit_bias"),
        ),
        (
            "allowed_token_ids negative",
            c,
            j(r#"{"prompt": "hi", "allowed_token_ids": [-1]}"#),
            400,
            Some("allowed_token_ids"),
        ),
        (
            "bad_words huge",
            c,
            j(&format!(
                r#"{{"prompt": "hi", "bad_words": ["{}"]}}"#,
                "x".repeat(5000)
            )),
            400,
            Some("bad_words"),
        ),
        (
            "n negative",
            c,
            j(r#"{"prompt": "hi", "n": -1}"#),
            400,
            Some("n"),
        ),
        (
            "best_of 5",
            c,
            j(r#"{"prompt": "hi", "best_of": 5}"#),
            400,
            Some("best_of"),
        ),
        (
            "logprobs 200000",
            c,
            j(r#"{"prompt": "hi", "logprobs": 200000}"#),
            400,
            Some("logprobs"),
        ),
        (
            "logprobs negative",
            c,
            j(r#"{"prompt": "hi", "logprobs": -1}"#),
            400,
            Some("logprobs"),
        ),
        (
            "8000 stop strings",
            c,
            j(&many_stops(8000)),
            400,
            Some("stop"),
        ),
        ("10 KB stop string", c, j(&long_stop), 400, Some("stop")),
        (
            "stop is a number",
            c,
            j(r#"{"prompt": "hi", "stop": 7}"#),
            400,
            Some("stop"),
        ),
        (
            "1000 stop_token_ids",
            c,
            j(&json!({"prompt": "hi", "stop_token_ids": stop_ids}).to_string()),
            400,
            Some("stop_token_ids"),
        ),
        (
            "stop_token_id out of vocab",
            c,
            j(r#"{"prompt": "hi", "stop_token_ids": [4294967295]}"#),
            400,
            Some("stop_token_ids"),
        ),
        (
            "stop_token_id negative",
            c,
            j(r#"{"prompt": "hi", "stop_token_ids": [-3]}"#),
            400,
            Some("stop_token_ids[0]"),
        ),
        (
            "seed 1e30",
            c,
            j(r#"{"prompt": "hi", "seed": 1e30}"#),
            400,
            Some("seed"),
        ),
        (
            "stream a string",
            c,
            j(r#"{"prompt": "hi", "stream": "yes"}"#),
            400,
            Some("stream"),
        ),
        (
            "echo",
            c,
            j(r#"{"prompt": "hi", "echo": true}"#),
            400,
            Some("echo"),
        ),
        (
            "suffix",
            c,
            j(r#"{"prompt": "hi", "suffix": "x"}"#),
            400,
            Some("suffix"),
        ),
        (
            "unknown model",
            c,
            j(r#"{"model": "nope", "prompt": "hi"}"#),
            404,
            Some("model"),
        ),
        ("deep nesting 100000", c, j(&nested(100_000)), 400, None),
        ("nesting 200 in a field", c, j(&nested(200)), 400, None),
        (
            "invalid UTF-8 in a string",
            c,
            b"{\"prompt\": \"\xff\xfe\xc3\x28\"}".to_vec(),
            400,
            None,
        ),
        (
            "invalid UTF-8 outside strings",
            c,
            b"\xef\xbb\xbf\xff{\"prompt\": \"hi\"}".to_vec(),
            400,
            None,
        ),
        (
            "lone surrogate escape",
            c,
            j(r#"{"prompt": "\ud800"}"#),
            400,
            None,
        ),
        (
            "NaN literal",
            c,
            j(r#"{"prompt": "hi", "temperature": NaN}"#),
            400,
            None,
        ),
        (
            "Infinity literal",
            c,
            j(r#"{"prompt": "hi", "top_p": Infinity}"#),
            400,
            None,
        ),
        (
            "chat messages missing",
            ch,
            j(r#"{"model": "tiny"}"#),
            400,
            Some("messages"),
        ),
        (
            "chat messages empty",
            ch,
            j(r#"{"messages": []}"#),
            400,
            Some("messages"),
        ),
        (
            "chat messages not a list",
            ch,
            j(r#"{"messages": "hi"}"#),
            400,
            Some("messages"),
        ),
        (
            "chat role a number",
            ch,
            j(r#"{"messages": [{"role": 5, "content": "hi"}]}"#),
            400,
            Some("messages[0].role"),
        ),
        (
            "chat image part",
            ch,
            j(r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#),
            400,
            Some("messages[0].content"),
        ),
        (
            "chat top_logprobs 200000",
            ch,
            j(
                r#"{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 200000}"#,
            ),
            400,
            Some("top_logprobs"),
        ),
        (
            "chat top_logprobs negative",
            ch,
            j(
                r#"{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": -2}"#,
            ),
            400,
            Some("top_logprobs"),
        ),
        (
            "chat max_completion_tokens negative",
            ch,
            j(r#"{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5}"#),
            400,
            Some("max_completion_tokens"),
        ),
        (
            "chat content over the byte cap",
            ch,
            j(&big_chat),
            400,
            Some("messages"),
        ),
        (
            "chat 20000 messages",
            ch,
            j(&json!({"messages": many_msgs}).to_string()),
            400,
            Some("messages"),
        ),
        // Fields nobody implements are a 400 naming them, never dropped.
        (
            "unknown field",
            c,
            j(r#"{"prompt": "hi", "frobnicate": 1}"#),
            400,
            Some("frobnicate"),
        ),
        (
            "chat unknown field",
            ch,
            j(r#"{"messages": [{"role": "user", "content": "hi"}], "web_search_options": {}}"#),
            400,
            Some("web_search_options"),
        ),
        (
            "chat field of the other endpoint",
            ch,
            j(r#"{"messages": [{"role": "user", "content": "hi"}], "suffix": "x"}"#),
            400,
            Some("suffix"),
        ),
        (
            "stream_options key not implemented",
            c,
            j(
                r#"{"prompt": "hi", "stream": true, "stream_options": {"continuous_usage_stats": true}}"#,
            ),
            400,
            Some("stream_options.continuous_usage_stats"),
        ),
        (
            "chat store true",
            ch,
            j(r#"{"messages": [{"role": "user", "content": "hi"}], "store": true}"#),
            400,
            Some("store"),
        ),
        (
            "chat service_tier priority",
            ch,
            j(r#"{"messages": [{"role": "user", "content": "hi"}], "service_tier": "priority"}"#),
            400,
            Some("service_tier"),
        ),
        (
            "tokenize nothing",
            "/tokenize",
            j("{}"),
            400,
            Some("prompt"),
        ),
        (
            "tokenize prompt a number",
            "/tokenize",
            j(r#"{"prompt": 5}"#),
            400,
            Some("prompt"),
        ),
        (
            "tokenize prompt and messages",
            "/tokenize",
            j(r#"{"prompt": "a", "messages": [{"role": "user", "content": "hi"}]}"#),
            400,
            Some("messages"),
        ),
        (
            "tokenize unknown field",
            "/tokenize",
            j(r#"{"prompt": "a", "continue_final_message": true}"#),
            400,
            Some("continue_final_message"),
        ),
        (
            "tokenize over the byte cap",
            "/tokenize",
            j(&json!({"prompt": "a ".repeat(40_000)}).to_string()),
            400,
            Some("prompt"),
        ),
        (
            "tokenize chat over the byte cap",
            "/tokenize",
            j(&big_chat),
            400,
            Some("messages"),
        ),
        (
            "tokenize unknown model",
            "/tokenize",
            j(r#"{"model": "nope", "prompt": "a"}"#),
            404,
            Some("model"),
        ),
        ("tokenize array body", "/tokenize", j("[]"), 400, None),
        (
            "detokenize tokens missing",
            "/detokenize",
            j("{}"),
            400,
            Some("tokens"),
        ),
        (
            "detokenize negative id",
            "/detokenize",
            j(r#"{"tokens": [-1]}"#),
            400,
            Some("tokens"),
        ),
        (
            "detokenize id out of vocab",
            "/detokenize",
            j(r#"{"tokens": [999999999]}"#),
            400,
            Some("tokens"),
        ),
        (
            "detokenize tokens a string",
            "/detokenize",
            j(r#"{"tokens": "12"}"#),
            400,
            Some("tokens"),
        ),
        (
            "detokenize over the context",
            "/detokenize",
            j(&json!({"tokens": vec![1; 5000]}).to_string()),
            400,
            Some("tokens"),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_battery() {
    let mut s = start(config(), opts(), true).await;
    let addr = s.addr;
    good(addr).await;
    let cases = cases();
    let mut n = 0;
    for (name, path, body, want, param) in &cases {
        let (st, text) = raw(addr, &post(path, body), Duration::from_secs(30)).await;
        assert_eq!(st, *want, "{name}: {text}");
        check_error(name, &text, *param);
        good(addr).await;
        n += 1;
    }

    // Raw HTTP cases: (name, bytes, wait, accepted statuses; 0 = closed
    // without an answer). The body of any answer is OpenAI-shaped JSON
    // unless hyper itself answered (400/431 with no body).
    let big = 20 * 1024 * 1024;
    let raw_cases: Vec<(&str, Vec<u8>, Duration, &[u16])> = vec![
        ("GET on a POST route (405)", b"GET /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(), Duration::from_secs(5), &[405]),
        ("DELETE /v1/models (405)", b"DELETE /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(), Duration::from_secs(5), &[405]),
        ("unknown route (404)", b"GET /v2/nothing HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(), Duration::from_secs(5), &[404]),
        ("20 MB Content-Length, no body sent (early 413)", format!("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {big}\r\n\r\n").into_bytes(), Duration::from_secs(5), &[413]),
        ("chunked body over the limit (413)", {
            let mut v = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n".to_vec();
            for _ in 0..20 { v.extend_from_slice(format!("10000\r\n{}\r\n", "a".repeat(0x10000)).as_bytes()); }
            v.extend_from_slice(b"0\r\n\r\n");
            v
        }, Duration::from_secs(5), &[413]),
        ("Content-Length not a number", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n".to_vec(), Duration::from_secs(5), &[400, 0]),
        ("two Content-Lengths", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 7\r\n\r\nhello".to_vec(), Duration::from_secs(5), &[400, 0]),
        ("binary garbage", (0u8..=255).cycle().take(4096).collect(), Duration::from_secs(5), &[400, 0]),
        ("100 KB header", format!("GET /health HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n", "a".repeat(100_000)).into_bytes(), Duration::from_secs(5), &[431, 400, 0]),
        ("10000 headers", {
            let mut v = b"GET /health HTTP/1.1\r\nhost: x\r\n".to_vec();
            for i in 0..10_000 { v.extend_from_slice(format!("x-{i}: y\r\n").as_bytes()); }
            v.extend_from_slice(b"\r\n");
            v
        }, Duration::from_secs(5), &[431, 400, 0]),
        ("half-sent headers (closed after the header timeout)", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-le".to_vec(), Duration::from_secs(10), &[408, 0]),
        ("slow-loris body (408 after the body timeout)", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"prompt\":".to_vec(), Duration::from_secs(10), &[408]),
        ("h2 preface then silence", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec(), Duration::from_secs(10), &[0]),
        ("connect and say nothing", Vec::new(), Duration::from_secs(10), &[0]),
    ];
    for (name, bytes, wait, accepted) in &raw_cases {
        let t0 = Instant::now();
        let (st, body) = raw(addr, bytes, *wait).await;
        assert!(
            accepted.contains(&st),
            "{name}: status {st} not in {accepted:?}: {body}"
        );
        assert!(
            t0.elapsed() < *wait,
            "{name}: the server did not close the connection within {wait:?}"
        );
        if st >= 404 && st != 431 && !body.is_empty() {
            check_error(name, &body, None);
        }
        good(addr).await;
        n += 1;
    }
    eprintln!("hostile battery: {n} cases, the server answered a good request after each");
    assert!(n >= 50);

    // Bounded shutdown: a half-sent request does not hold it open.
    let mut stuck = TcpStream::connect(addr).await.expect("connect");
    stuck
        .write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
        .await
        .expect("write");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    let _ = s.stop.take().map(|tx| tx.send(()));
    tokio::time::timeout(Duration::from_secs(10), &mut s.done)
        .await
        .expect("shutdown finished within its bound")
        .expect("server task");
    eprintln!("shutdown with a half-sent request took {:?}", t0.elapsed());
}

/// More idle connections than the cap: a good request still gets through
/// (the longest-idle connections are closed to make room), and so does a
/// request on an old connection that is busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_past_the_cap() {
    let o = HttpOptions {
        max_connections: 500,
        idle_timeout: Duration::from_secs(60),
        header_timeout: Duration::from_secs(60),
        ..opts()
    };
    server::conn::raise_nofile_limit();
    let s = start(config(), o, true).await;
    let mut idle = Vec::new();
    for _ in 0..1100 {
        match TcpStream::connect(s.addr).await {
            Ok(c) => idle.push(c),
            Err(e) => panic!("connect failed after {} connections: {e}", idle.len()),
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t0 = Instant::now();
    good(s.addr).await;
    eprintln!(
        "good request with 1100 idle connections opened: {:?}",
        t0.elapsed()
    );
    drop(idle);
}

/// The global concurrency limit sheds load with 503 + Retry-After in
/// OpenAI's shape instead of queueing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_shedding() {
    let cfg = ServerConfig {
        max_concurrent_requests: 1,
        ..config()
    };
    let s = start(cfg, opts(), true).await;
    let addr = s.addr;
    let body = json!({"prompt": [1, 2], "max_tokens": 200, "ignore_eos": true}).to_string();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = TcpStream::connect(addr).await.expect("connect");
            c.write_all(&post("/v1/completions", body.as_bytes()))
                .await
                .expect("write");
            let mut buf = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(60), c.read_to_end(&mut buf)).await;
            String::from_utf8_lossy(&buf).to_string()
        }));
    }
    let (mut ok, mut shed) = (0, 0);
    for t in tasks {
        let text = t.await.expect("join");
        if text.starts_with("HTTP/1.1 200") {
            ok += 1;
        } else {
            assert!(text.starts_with("HTTP/1.1 503"), "{text}");
            assert!(
                text.to_ascii_lowercase().contains("retry-after: 1"),
                "{text}"
            );
            check_error("shed", text.split("\r\n\r\n").nth(1).unwrap_or(""), None);
            shed += 1;
        }
    }
    eprintln!("load shedding with a limit of 1: {ok} answered, {shed} shed");
    assert!(ok >= 1 && shed >= 1, "{ok} answered, {shed} shed");
    // /health is outside the limit.
    let (st, _) = raw(
        addr,
        b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(st, 200);
    good(addr).await;
}

mod parser_props {
    //! Property test of the request parser and validation through the
    //! router itself (no sockets): random bodies made of the endpoints'
    //! fields with random JSON values get 200 or an OpenAI-shaped 4xx.

    use super::*;
    use axum::body::Body;
    use http_body_util::BodyExt;
    use proptest::prelude::*;
    use std::sync::OnceLock;
    use tower::ServiceExt;

    fn runtime() -> &'static tokio::runtime::Runtime {
        static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
        RT.get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime")
        })
    }

    fn app() -> axum::Router {
        static STATE: OnceLock<Arc<AppState>> = OnceLock::new();
        let state = STATE.get_or_init(|| {
            let state = AppState::new(config());
            let engine = Arc::new(Engine::load(&fixture()).expect("fixture engine"));
            let sched = {
                let _entered = runtime().enter();
                scheduler::start(
                    engine.clone(),
                    SchedulerConfig {
                        max_num_seqs: 8,
                        max_num_batched_tokens: 256,
                        max_model_len: 256,
                        block_size: 16,
                        num_blocks: 128,
                        max_waiting: 64,
                        kv_dtype: Default::default(),
                        micro_batches: MicroBatches::Fixed(1),
                        enable_prefix_caching: true,
                        expert_load_metrics: false,
                        parallel_choose_min_logits: scheduler::PARALLEL_CHOOSE_MIN_LOGITS,
                    },
                )
                .expect("scheduler")
            };
            let _ = state.ready.set(Ready {
                engine,
                scheduler: sched,
                created: 0,
            });
            state
        });
        server::router(state.clone())
    }

    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (-3i64..40).prop_map(Value::from),
            any::<f64>()
                .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
            "\\PC{0,12}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z_]{1,8}", inner, 0..3)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    const FIELDS: &[&str] = &[
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "n",
        "best_of",
        "logprobs",
        "top_logprobs",
        "stream",
        "stream_options",
        "echo",
        "suffix",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "user",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
    ];

    fn body() -> impl Strategy<Value = Value> {
        proptest::collection::vec((proptest::sample::select(FIELDS), value()), 0..6).prop_map(
            |kv| {
                let mut m = serde_json::Map::new();
                // Mostly valid prompts, so that later checks are reached too.
                m.insert("prompt".into(), json!([1, 2, 3]));
                m.insert(
                    "messages".into(),
                    json!([{"role": "user", "content": "hi"}]),
                );
                m.insert("max_tokens".into(), json!(2));
                for (k, v) in kv {
                    m.insert(k.to_string(), v);
                }
                Value::Object(m)
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn random_bodies_get_200_or_a_shaped_error(b in body(), chat in any::<bool>()) {
            let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
            let app = app();
            let (status, text) = runtime().block_on(async {
                let req = axum::http::Request::post(path)
                    .header("content-type", "application/json")
                    .body(Body::from(b.to_string()))
                    .expect("request");
                let resp = tokio::time::timeout(Duration::from_secs(60), app.oneshot(req))
                    .await
                    .expect("answered in time")
                    .expect("infallible");
                let status = resp.status().as_u16();
                let bytes = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
                (status, String::from_utf8_lossy(&bytes).to_string())
            });
            prop_assert!(matches!(status, 200 | 400 | 404), "{status}: {text} for {b}");
            if status != 200 {
                let v: Value = serde_json::from_str(&text).map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
                prop_assert!(v["error"]["message"].is_string(), "{text}");
            }
        }

        #[test]
        fn random_bytes_get_a_shaped_error(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let app = app();
            let (status, text) = runtime().block_on(async {
                let req = axum::http::Request::post("/v1/completions")
                    .body(Body::from(bytes.clone()))
                    .expect("request");
                let resp = app.oneshot(req).await.expect("infallible");
                let status = resp.status().as_u16();
                let bytes = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
                (status, String::from_utf8_lossy(&bytes).to_string())
            });
            prop_assert!(matches!(status, 200 | 400 | 404), "{status}: {text}");
        }
    }
}

fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

/// Time of one good 32-token request (greedy, eos ignored).
async fn timed_good(addr: SocketAddr) -> Duration {
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 32, "temperature": 0, "ignore_eos": true})
        .to_string();
    let t0 = Instant::now();
    let (st, text) = raw(
        addr,
        &post("/v1/completions", body.as_bytes()),
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(st, 200, "{text}");
    t0.elapsed()
}

/// The issue's numbers, with the new caps off ("before": everything the old
/// server accepted is accepted) and on ("after"). Run with
/// `cargo test -p epserve-coordinator --test hostile measure -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn measure() {
    for (label, capped) in [("caps off", false), ("caps on", true)] {
        let cfg = if capped {
            ServerConfig {
                max_body_bytes: 8 << 20,
                body_timeout: Duration::from_secs(30),
                max_prompt_bytes: None,
                ..config()
            }
        } else {
            ServerConfig {
                max_body_bytes: 8 << 20,
                body_timeout: Duration::from_secs(30),
                max_prompt_bytes: Some(usize::MAX),
                max_stop_strings: usize::MAX,
                max_stop_string_bytes: usize::MAX,
                ..config()
            }
        };
        let s = start(
            cfg,
            HttpOptions {
                header_timeout: Duration::from_secs(30),
                ..opts()
            },
            true,
        )
        .await;
        let addr = s.addr;
        let alone = timed_good(addr).await;

        // 20 MB body announced by Content-Length: time to the answer.
        let t0 = Instant::now();
        let mut c = TcpStream::connect(addr).await.expect("connect");
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
            20 << 20
        );
        c.write_all(head.as_bytes()).await.expect("head");
        let chunk = vec![b' '; 1 << 16];
        let mut sent = 0usize;
        let mut buf = [0u8; 512];
        let (mut rd, mut wr) = c.split();
        let answer = loop {
            tokio::select! {
                r = rd.read(&mut buf) => break String::from_utf8_lossy(&buf[..r.unwrap_or(0)]).to_string(),
                w = wr.write_all(&chunk), if sent < (20 << 20) => {
                    if w.is_err() { break String::new(); }
                    sent += chunk.len();
                }
            }
        };
        eprintln!(
            "{label}: 20 MB body: answered '{}' after {:?}, {} KiB sent by then",
            answer.lines().next().unwrap_or("(closed)"),
            t0.elapsed(),
            sent >> 10
        );
        drop(c);

        // 7.9 MB prompt: its own latency, RSS growth, and a good request meanwhile.
        let rss0 = rss_mb();
        let big = json!({"prompt": "hello world ".repeat(660_000), "max_tokens": 1}).to_string();
        let t0 = Instant::now();
        let big_req = tokio::spawn(async move {
            raw(
                addr,
                &post("/v1/completions", big.as_bytes()),
                Duration::from_secs(300),
            )
            .await
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let during = timed_good(addr).await;
        let (st, text) = big_req.await.expect("join");
        eprintln!(
            "{label}: 7.9 MB prompt: {st} after {:?} ({}), RSS +{:.0} MB; a good request meanwhile {:?} (alone {:?})",
            t0.elapsed(),
            text.chars().take(90).collect::<String>(),
            rss_mb() - rss0,
            during,
            alone
        );

        // 8000 stop strings on a running sequence, and another sequence's time.
        let stops: Vec<String> = (0..8000).map(|i| format!("zq{i}x")).collect();
        let body = json!({"prompt": [4, 5, 6], "max_tokens": 200, "temperature": 0, "ignore_eos": true, "stop": stops}).to_string();
        let t0 = Instant::now();
        let hog = tokio::spawn(async move {
            raw(
                addr,
                &post("/v1/completions", body.as_bytes()),
                Duration::from_secs(600),
            )
            .await
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let during = timed_good(addr).await;
        let (st, _) = hog.await.expect("join");
        eprintln!(
            "{label}: 8000 stop strings: {st} after {:?}; a 32-token request meanwhile {:?} (alone {:?})",
            t0.elapsed(),
            during,
            alone
        );
    }
}

/// Responses bigger than the 64 KiB connection buffer go out whole, over
/// HTTP/1.1 and as SSE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_responses() {
    let s = start(config(), opts(), true).await;
    for stream in [false, true] {
        let body = json!({"prompt": [1, 2, 3], "max_tokens": 200, "temperature": 0,
                          "ignore_eos": true, "logprobs": 20, "stream": stream})
        .to_string();
        let (st, text) = raw(
            s.addr,
            &post("/v1/completions", body.as_bytes()),
            Duration::from_secs(60),
        )
        .await;
        assert_eq!(st, 200, "{text}");
        assert!(text.len() > 64 * 1024, "only {} bytes", text.len());
        if !stream {
            let v: Value = serde_json::from_str(&text).expect("whole JSON body");
            assert_eq!(v["usage"]["completion_tokens"], 200);
        } else {
            assert!(text.contains("data: [DONE]"));
        }
    }
}

/// 200 half-sent request heads and 200 half-sent bodies: a good request gets
/// through meanwhile, and the server closes all of them within its timeouts
/// (1 s here) instead of keeping them open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_requests_are_closed() {
    let s = start(
        config(),
        HttpOptions {
            max_connections: 1000,
            ..opts()
        },
        true,
    )
    .await;
    let mut conns = Vec::new();
    for i in 0..400 {
        let mut c = TcpStream::connect(s.addr).await.expect("connect");
        let part: &[u8] = if i % 2 == 0 {
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-le"
        } else {
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"pro"
        };
        c.write_all(part).await.expect("write");
        conns.push(c);
    }
    let t0 = Instant::now();
    good(s.addr).await;
    let mut closed = 0;
    for mut c in conns {
        let mut buf = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut buf)).await;
        if r.is_ok() {
            closed += 1;
        }
    }
    eprintln!(
        "400 half-sent requests: {closed} closed by the server after {:?}",
        t0.elapsed()
    );
    assert_eq!(closed, 400);
}

async fn post_json(addr: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let (st, text) = raw(
        addr,
        &post(path, body.to_string().as_bytes()),
        Duration::from_secs(30),
    )
    .await;
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
    (st, v)
}

/// `/tokenize` and `/detokenize` answer vLLM's shapes, every served name is
/// listed and accepted (responses report the first), and every `epserve_*`
/// family on `/metrics` has HELP and TYPE lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_names_and_metrics_help() {
    // The recorder first, so the requests below are recorded.
    epserve_coordinator::metrics::init();
    let cfg = ServerConfig {
        served_model_names: vec!["tiny".into(), "/models/tiny".into()],
        ..config()
    };
    let s = start(cfg, opts(), true).await;
    let addr = s.addr;
    good(addr).await;

    let (st, t) = post_json(addr, "/tokenize", json!({"prompt": "Hello world"})).await;
    assert_eq!(st, 200, "{t}");
    let tokens = t["tokens"].as_array().expect("tokens").clone();
    assert!(!tokens.is_empty());
    assert_eq!(t["count"], tokens.len());
    assert_eq!(t["max_model_len"], 256);
    assert!(t["token_strs"].is_null());
    let (st, d) = post_json(
        addr,
        "/detokenize",
        json!({"model": "/models/tiny", "tokens": tokens}),
    )
    .await;
    assert_eq!(st, 200, "{d}");
    assert!(
        d["prompt"]
            .as_str()
            .is_some_and(|p| p.ends_with("Hello world")),
        "{d}"
    );
    let (st, t2) = post_json(
        addr,
        "/tokenize",
        json!({"prompt": "Hello world", "add_special_tokens": false, "return_token_strs": true}),
    )
    .await;
    assert_eq!(st, 200, "{t2}");
    assert_eq!(
        t2["token_strs"].as_array().map(Vec::len),
        t2["tokens"].as_array().map(Vec::len)
    );
    // Chat: the template rendered with the generation prompt, as the chat
    // endpoint renders it (same count as its usage.prompt_tokens).
    let msgs = json!([{"role": "user", "content": "Hi there"}]);
    let (st, tc) = post_json(addr, "/tokenize", json!({"messages": msgs})).await;
    assert_eq!(st, 200, "{tc}");
    let (st, chat) = post_json(
        addr,
        "/v1/chat/completions",
        json!({"model": "/models/tiny", "messages": msgs, "max_tokens": 1}),
    )
    .await;
    assert_eq!(st, 200, "{chat}");
    assert_eq!(chat["usage"]["prompt_tokens"], tc["count"]);
    assert_eq!(chat["model"], "tiny", "responses report the first name");

    let (st, models) = raw(
        addr,
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(st, 200);
    let models: Value = serde_json::from_str(&models).expect("json");
    let ids: Vec<&str> = models["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["tiny", "/models/tiny"]);

    let (st, text) = raw(
        addr,
        b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(st, 200);
    let mut families = std::collections::BTreeSet::new();
    for line in text.lines().filter(|l| l.starts_with("epserve_")) {
        let name = line.split(['{', ' ']).next().unwrap_or("");
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|f| text.contains(&format!("# TYPE {f} ")))
            .unwrap_or(name);
        families.insert(family.to_string());
    }
    assert!(families.len() >= 8, "{families:?}");
    for f in &families {
        assert!(
            text.contains(&format!("# HELP {f} ")),
            "{f} has no HELP line"
        );
        assert!(
            text.contains(&format!("# TYPE {f} ")),
            "{f} has no TYPE line"
        );
        assert!(
            epserve_coordinator::metrics::METRICS
                .iter()
                .any(|m| m.0 == f.as_str()),
            "{f} is missing from metrics::METRICS (README's table)"
        );
    }
    // Label names as the table lists them (plus the exporter's le / quantile).
    for line in text.lines().filter(|l| l.starts_with("epserve_")) {
        let Some((name, rest)) = line.split_once('{') else {
            continue;
        };
        let table = epserve_coordinator::metrics::METRICS;
        let Some(m) = table.iter().find(|m| name == m.0).or_else(|| {
            table.iter().find(|m| {
                ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|s| name.strip_suffix(s) == Some(m.0))
            })
        }) else {
            continue;
        };
        let labels = rest.split('}').next().unwrap_or("");
        for l in labels
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|kv| kv.0)
        {
            assert!(
                m.2.contains(&l) || l == "le" || l == "quantile",
                "{line}: label '{l}' not in the table's {:?}",
                m.2
            );
        }
    }
}
