//! The HTTP side: one streaming request to an OpenAI-compatible completions or
//! chat completions endpoint, timed the way vLLM's request functions time it
//! (TTFT at the first chunk with choices, ITL between chunks with choices,
//! latency up to the last of them), plus a small Server-Sent Events parser.

use std::time::{Duration, Instant};

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{Map, Value, json};

use super::args::Backend;
use super::metrics::RequestOutput;

/// Splits a byte stream into SSE `data` payloads. An event ends at a blank
/// line; a `data:` line that follows a payload that is already complete JSON
/// (or `[DONE]`) also ends it, for servers that omit the blank line.
/// Comments (`:` lines) and other fields are skipped.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Option<String>,
}

fn complete(payload: &str) -> bool {
    let p = payload.trim();
    p == "[DONE]" || serde_json::from_str::<serde::de::IgnoredAny>(p).is_ok()
}

impl SseParser {
    /// Feeds bytes; returns the payloads of the events they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&line);
            self.line(line.trim_end_matches(['\n', '\r']), &mut out);
        }
        out
    }

    /// Ends the stream: a last line without a newline and a pending event.
    pub fn finish(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.buf.is_empty() {
            let rest = std::mem::take(&mut self.buf);
            let rest = String::from_utf8_lossy(&rest);
            self.line(rest.trim_end_matches('\r'), &mut out);
        }
        out.extend(self.data.take());
        out
    }

    fn line(&mut self, line: &str, out: &mut Vec<String>) {
        if line.is_empty() {
            out.extend(self.data.take());
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        if field != "data" {
            return;
        }
        let value = value.strip_prefix(' ').unwrap_or(value);
        match self.data.take() {
            Some(prev) if complete(&prev) => {
                out.push(prev);
                self.data = Some(value.to_string());
            }
            Some(mut prev) => {
                prev.push('\n');
                prev.push_str(value);
                self.data = Some(prev);
            }
            None => self.data = Some(value.to_string()),
        }
    }
}

/// One request of the run.
#[derive(Debug, Clone)]
pub struct RequestInput {
    pub prompt: String,
    pub prompt_len: usize,
    pub output_len: usize,
    pub request_id: Option<String>,
}

/// Where and how requests are sent; shared by all requests of a run.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub client: reqwest::Client,
    pub api_url: String,
    pub backend: Backend,
    /// The `model` field.
    pub model: String,
    pub logprobs: Option<u32>,
    pub ignore_eos: bool,
    /// Merged into every body last (sampling parameters, --extra-body).
    pub extra_body: Map<String, Value>,
    /// Sent with every request (--header, Authorization).
    pub headers: HeaderMap,
}

/// Builds the HTTP client: 6-hour total timeout as vLLM's, optional
/// acceptance of any TLS certificate; with `reuse` false no connection is kept
/// idle, so every request opens its own.
pub fn http_client(insecure: bool, reuse: bool) -> anyhow::Result<reqwest::Client> {
    let mut b = reqwest::Client::builder()
        .timeout(Duration::from_secs(6 * 60 * 60))
        .danger_accept_invalid_certs(insecure);
    if !reuse {
        b = b.pool_max_idle_per_host(0);
    }
    b.build()
        .map_err(|e| anyhow::anyhow!("cannot build the HTTP client: {e}"))
}

/// Headers from `--header KEY=VALUE` pairs and an API key.
pub fn headers(pairs: &[String], api_key: Option<&str>) -> anyhow::Result<HeaderMap> {
    let mut map = HeaderMap::new();
    if let Some(key) = api_key.filter(|k| !k.is_empty()) {
        let v = HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| anyhow::anyhow!("the API key has characters not allowed in a header"))?;
        map.insert(reqwest::header::AUTHORIZATION, v);
    }
    for pair in pairs {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("invalid --header {pair:?}: use KEY=VALUE"))?;
        let name = HeaderName::from_bytes(k.trim().as_bytes())
            .map_err(|_| anyhow::anyhow!("invalid header name in {pair:?}"))?;
        let value = HeaderValue::from_str(v.trim())
            .map_err(|_| anyhow::anyhow!("invalid header value in {pair:?}"))?;
        map.insert(name, value);
    }
    Ok(map)
}

/// One line of error text from an error and its causes.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

impl Endpoint {
    /// The JSON body for one request.
    pub fn payload(&self, input: &RequestInput) -> Value {
        let mut body = match self.backend {
            Backend::Openai => json!({
                "model": self.model,
                "prompt": input.prompt,
                "max_tokens": input.output_len,
                "stream": true,
                "stream_options": {"include_usage": true},
            }),
            Backend::OpenaiChat => json!({
                "model": self.model,
                "messages": [{"role": "user", "content": input.prompt}],
                "max_completion_tokens": input.output_len,
                "stream": true,
                "stream_options": {"include_usage": true},
            }),
        };
        if let Some(obj) = body.as_object_mut() {
            if let (Some(n), Backend::Openai) = (self.logprobs, self.backend) {
                obj.insert("logprobs".into(), json!(n));
            }
            if self.ignore_eos {
                obj.insert("ignore_eos".into(), json!(true));
            }
            for (k, v) in &self.extra_body {
                obj.insert(k.clone(), v.clone());
            }
        }
        body
    }

    /// Sends one request and times its stream. `origin` is the run's start;
    /// `start_time` is measured from it. Never fails: errors are recorded in
    /// the output.
    pub async fn send(&self, input: &RequestInput, origin: Instant) -> RequestOutput {
        let mut out = RequestOutput {
            prompt_len: input.prompt_len,
            ..Default::default()
        };
        let mut req = self
            .client
            .post(&self.api_url)
            .headers(self.headers.clone())
            .json(&self.payload(input));
        if let Some(id) = &input.request_id {
            req = req.header("x-request-id", id);
        }
        let st = Instant::now();
        out.start_time = st.duration_since(origin).as_secs_f64();
        let mut resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                out.error = error_chain(&e);
                return out;
            }
        };
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            let body: String = body.trim().chars().take(500).collect();
            out.error = format!("HTTP {status}: {body}");
            return out;
        }
        let mut parser = SseParser::default();
        let mut first: Option<Instant> = None;
        let mut last = st;
        let mut done = false;
        let mut done_by_marker = false;
        while !done {
            let events = match resp.chunk().await {
                Ok(Some(bytes)) => parser.feed(&bytes),
                Ok(None) => {
                    done = true;
                    parser.finish()
                }
                Err(e) => {
                    out.error = format!(
                        "stream broken after {} chunks: {}",
                        out.chunks,
                        error_chain(&e)
                    );
                    return out;
                }
            };
            let now = Instant::now();
            for data in events {
                let data = data.trim();
                if data == "[DONE]" {
                    done = true;
                    done_by_marker = true;
                    break;
                }
                let v: Value = match serde_json::from_str(data) {
                    Ok(v) => v,
                    Err(e) => {
                        out.error = format!(
                            "invalid JSON in the stream ({e}): {}",
                            data.chars().take(200).collect::<String>()
                        );
                        return out;
                    }
                };
                if let Some(usage) = v.get("usage").filter(|u| u.is_object()) {
                    if let Some(n) = usage.get("completion_tokens").and_then(Value::as_u64) {
                        out.output_tokens = Some(n as usize);
                    }
                    if let Some(n) = usage.get("prompt_tokens").and_then(Value::as_u64) {
                        out.prompt_len = n as usize;
                    }
                }
                let choice = v
                    .get("choices")
                    .and_then(Value::as_array)
                    .and_then(|c| c.first());
                if let Some(choice) = choice {
                    let text = match self.backend {
                        Backend::Openai => choice.get("text"),
                        Backend::OpenaiChat => choice.get("delta").and_then(|d| d.get("content")),
                    };
                    match first {
                        None => {
                            first = Some(now);
                            out.ttft = now.duration_since(st).as_secs_f64();
                        }
                        Some(_) => out.itl.push(now.duration_since(last).as_secs_f64()),
                    }
                    last = now;
                    out.chunks += 1;
                    if let Some(t) = text.and_then(Value::as_str) {
                        out.generated_text.push_str(t);
                    }
                } else if let Some(err) = v.get("error") {
                    let msg = err
                        .get("message")
                        .and_then(Value::as_str)
                        .map_or_else(|| err.to_string(), str::to_string);
                    out.error = format!("error in the stream: {msg}");
                    return out;
                }
            }
        }
        if done_by_marker {
            // Read what follows [DONE] so the connection can be reused, but do
            // not wait on a server that keeps the stream open.
            while let Ok(Ok(Some(_))) =
                tokio::time::timeout(Duration::from_secs(1), resp.chunk()).await
            {}
        }
        if first.is_none() {
            out.error = "Never received a valid chunk to calculate TTFT. This response will be marked as failed!".into();
            return out;
        }
        out.latency = last.duration_since(st).as_secs_f64();
        out.success = true;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_reads() {
        let mut p = SseParser::default();
        assert!(p.feed(b"data: {\"a\"").is_empty());
        assert!(p.feed(b": 1}\n").is_empty());
        assert_eq!(p.feed(b"\ndata: [DONE]\n\n"), vec!["{\"a\": 1}", "[DONE]"]);
        assert!(p.finish().is_empty());
    }

    #[test]
    fn sse_crlf_comments_fields_and_multiline() {
        let mut p = SseParser::default();
        let ev = p.feed(b": ping\r\nevent: message\r\nid: 3\r\ndata:{\"x\":\r\ndata: 2}\r\n\r\n");
        assert_eq!(ev, vec!["{\"x\":\n2}"]);
        // No blank lines between events, and a last line without a newline.
        let ev = p.feed(b"data: {\"a\":1}\ndata: {\"b\":2}\ndata: [DONE]");
        assert_eq!(ev, vec!["{\"a\":1}"]);
        assert_eq!(p.finish(), vec!["{\"b\":2}", "[DONE]"]);
    }

    #[test]
    fn payload_shapes() {
        let mut e = Endpoint {
            client: reqwest::Client::new(),
            api_url: "http://x/v1/completions".into(),
            backend: Backend::Openai,
            model: "m".into(),
            logprobs: None,
            ignore_eos: true,
            extra_body: Map::new(),
            headers: HeaderMap::new(),
        };
        e.extra_body.insert("temperature".into(), json!(0.0));
        let input = RequestInput {
            prompt: "hi".into(),
            prompt_len: 1,
            output_len: 8,
            request_id: None,
        };
        let p = e.payload(&input);
        assert_eq!(p["prompt"], "hi");
        assert_eq!(p["max_tokens"], 8);
        assert_eq!(p["stream"], true);
        assert_eq!(p["stream_options"]["include_usage"], true);
        assert_eq!(p["ignore_eos"], true);
        assert_eq!(p["temperature"], 0.0);
        e.backend = Backend::OpenaiChat;
        e.ignore_eos = false;
        let p = e.payload(&input);
        assert_eq!(p["messages"][0]["content"], "hi");
        assert_eq!(p["max_completion_tokens"], 8);
        assert!(p.get("ignore_eos").is_none());
    }

    #[test]
    fn header_flags() {
        let h = headers(&["x-a=1".into()], Some("k")).expect("headers");
        assert_eq!(h["authorization"], "Bearer k");
        assert_eq!(h["x-a"], "1");
        assert!(headers(&["nope".into()], None).is_err());
    }
}
