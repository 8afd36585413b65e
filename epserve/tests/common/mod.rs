//! Shared by the server tests: start `epserve serve` on a free loopback port
//! with a bundled fixture, talk to it, stop it.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `tests/fixtures` of this checkout.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// A running server, killed on drop.
pub struct Server {
    child: Child,
    pub base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `epserve serve --model <fixture>/bf16 --host 127.0.0.1 --port 0 <extra>`
    /// and waits (up to 60 s) for the line with its URL.
    pub fn start(fixture: &str, extra: &[&str]) -> Server {
        let model = fixtures().join(fixture).join("bf16");
        let mut child = Command::new(env!("CARGO_BIN_EXE_epserve"))
            .arg("serve")
            .arg("--model")
            .arg(&model)
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--served-model-name",
                "tiny",
            ])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn epserve serve");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            let mut line = String::new();
            while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                if let Some(i) = line.find("http://") {
                    let url = line[i..]
                        .split_whitespace()
                        .next()
                        .unwrap_or("")
                        .to_string();
                    let _ = tx.send(url.trim_end_matches("/v1").to_string());
                }
                line.clear();
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("server printed its URL");
        Server { child, base }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }
}

/// A JSON POST; returns status, headers and body text.
pub async fn post(
    url: &str,
    body: &str,
    key: Option<&str>,
) -> (u16, reqwest::header::HeaderMap, String) {
    let client = reqwest::Client::new();
    let mut req = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.expect("send");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("body");
    (status, headers, text)
}

/// A GET returning status and body.
pub async fn get(url: &str) -> (u16, String) {
    let resp = reqwest::get(url).await.expect("get");
    let status = resp.status().as_u16();
    (status, resp.text().await.expect("body"))
}

/// The value of a Prometheus series (sum over lines that start with `prefix`).
pub async fn metric(server: &Server, prefix: &str) -> f64 {
    let (_, text) = get(&server.url("/metrics")).await;
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Polls `cond` every 50 ms for up to `secs`.
pub async fn eventually<F, Fut>(secs: u64, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The golden of a fixture.
pub fn golden(fixture: &str) -> serde_json::Value {
    let text =
        std::fs::read_to_string(fixtures().join(fixture).join("golden.json")).expect("golden");
    serde_json::from_str(&text).expect("golden json")
}

/// The qwen3 fixture (bf16) with `tests/fixtures/tool_template`'s
/// Hermes-style tool-calling chat template, in a temporary folder laid out as
/// [`Server::start`] expects: pass the folder's path as the fixture.
pub fn tool_model() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let dst = dir.path().join("bf16");
    std::fs::create_dir(&dst).expect("mkdir");
    let src = fixtures().join("qwen3_moe_a/bf16");
    for e in std::fs::read_dir(&src).expect("fixture") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), dst.join(e.file_name())).expect("copy");
    }
    std::fs::copy(
        fixtures().join("tool_template/chat_template.jinja"),
        dst.join("chat_template.jinja"),
    )
    .expect("template");
    dir
}
