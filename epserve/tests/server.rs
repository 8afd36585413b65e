//! `epserve serve` end to end on loopback: the OpenAI endpoints, streaming,
//! every documented error, cancellation, preemption under a tiny KV cache,
//! overload, and batched requests producing what each produces alone.

mod common;

use common::{Server, eventually, get, golden, metric, post};
use serde_json::{Value, json};

fn greedy_completion(prompt: &Value, max_tokens: usize) -> String {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true})
    .to_string()
}

async fn completion_text(s: &Server, body: &str) -> String {
    let (status, _, text) = post(&s.url("/v1/completions"), body, None).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    v["choices"][0]["text"].as_str().expect("text").to_string()
}

/// SSE `data:` payloads of a streaming response.
async fn sse(url: &str, body: &str) -> Vec<String> {
    let resp = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp.text().await.expect("body");
    text.lines()
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_and_golden_tokens() {
    let s = Server::start("qwen3_moe_a", &["--expert-load-metrics"]);
    let (st, body) = get(&s.url("/health")).await;
    assert_eq!(st, 200, "{body}");
    let (st, body) = get(&s.url("/v1/models")).await;
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["data"][0]["id"], "tiny");

    // Greedy completion from token ids equals transformers' greedy tokens.
    let g = golden("qwen3_moe_a");
    let case = &g["cases"][0];
    let (st, _, text) = post(
        &s.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": case["prompt_token_ids"], "max_tokens": 32,
                "temperature": 0, "ignore_eos": true, "logprobs": 2})
        .to_string(),
        None,
    )
    .await;
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["usage"]["completion_tokens"], 32);
    assert_eq!(
        v["usage"]["prompt_tokens"],
        case["prompt_token_ids"]
            .as_array()
            .map(|a| a.len())
            .unwrap_or(0)
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let tok = epserve_core::loader::tokenizer::Tokenizer::from_dir(
        &common::fixtures().join("qwen3_moe_a/bf16"),
    )
    .expect("tokenizer");
    let ids: Vec<u32> = serde_json::from_value(case["greedy_token_ids"].clone()).expect("ids");
    let want = tok.decode(&ids, true).expect("decode");
    assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()));
    assert_eq!(
        v["choices"][0]["logprobs"]["top_logprobs"][0]
            .as_object()
            .map(|o| o.len()),
        Some(2)
    );

    // Streaming chat: chunks add up to the non-streaming answer; usage chunk; [DONE].
    let chat = |stream: bool| {
        json!({"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
               "max_tokens": 20, "temperature": 0, "stream": stream,
               "stream_options": {"include_usage": true}})
        .to_string()
    };
    let (st, _, text) = post(&s.url("/v1/chat/completions"), &chat(false), None).await;
    assert_eq!(st, 200, "{text}");
    let full: Value = serde_json::from_str(&text).expect("json");
    let answer = full["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    let events = sse(&s.url("/v1/chat/completions"), &chat(true)).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut streamed = String::new();
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).expect("chunk json");
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(t);
        }
        if !c["usage"].is_null() {
            usage = Some(c["usage"].clone());
        }
    }
    assert_eq!(streamed, answer);
    assert_eq!(
        usage.expect("usage chunk")["completion_tokens"],
        full["usage"]["completion_tokens"]
    );

    let (_, metrics) = get(&s.url("/metrics")).await;
    for name in [
        "epserve_requests_total",
        "epserve_time_to_first_token_seconds",
        "epserve_time_per_output_token_seconds",
        "epserve_e2e_request_latency_seconds",
        "epserve_num_requests_running",
        "epserve_num_requests_waiting",
        "epserve_kv_cache_usage_ratio",
        "epserve_batch_size_seqs",
        "epserve_prompt_tokens_total",
        "epserve_generation_tokens_total",
        "epserve_expert_tokens_total",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_openai_shaped_and_good_requests_still_work() {
    let key = "sekrit";
    let s = Server::start(
        "mixtral",
        &[
            "--api-key",
            key,
            "--max-model-len",
            "64",
            "--max-request-body-bytes",
            "4096",
        ],
    );
    let url = s.url("/v1/completions");
    let ok_body = greedy_completion(&json!("hello"), 4);
    let cases: Vec<(String, Option<&str>, u16, &str)> = vec![
        ("{ not json".into(), Some(key), 400, "malformed JSON"),
        (ok_body.clone(), None, 401, "API key"),
        (ok_body.clone(), Some("wrong"), 401, "API key"),
        (
            json!({"model": "nope", "prompt": "x"}).to_string(),
            Some(key),
            404,
            "does not exist",
        ),
        (
            json!({"model": "tiny", "prompt": "x", "max_tokens": 100}).to_string(),
            Some(key),
            400,
            "maximum context length is 64",
        ),
        (
            json!({"model": "tiny", "prompt": "x", "n": 17}).to_string(),
            Some(key),
            400,
            "n must be between 1 and 16",
        ),
        (
            json!({"model": "tiny", "prompt": "x", "n": 0}).to_string(),
            Some(key),
            400,
            "n must be",
        ),
        (
            json!({"model": "tiny", "prompt": "x", "n": 2, "best_of": 3}).to_string(),
            Some(key),
            400,
            "best_of must equal n",
        ),
        (
            json!({"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}).to_string(),
            Some(key),
            400,
            "logit_bias key '99999'",
        ),
        (
            json!({"model": "tiny", "prompt": "x", "logit_bias": {"abc": 1}}).to_string(),
            Some(key),
            400,
            "logit_bias",
        ),
        (
            json!({"model": "tiny", "prompt": "x", "logit_bias": {"1": 101}}).to_string(),
            Some(key),
            400,
            "logit_bias must be in [-100, 100]",
        ),
        (
            json!({"model": "tiny", "prompt": "x", "allowed_token_ids": []}).to_string(),
            Some(key),
            400,
            "allowed_token_ids must not be empty",
        ),
        (
            json!({"model": "tiny", "prompt": "x", "allowed_token_ids": [1, 99999]}).to_string(),
            Some(key),
            400,
            "allowed_token_ids: token id 99999",
        ),
        (
            json!({"model": "tiny", "prompt": "x", "bad_words": ["  "]}).to_string(),
            Some(key),
            400,
            "bad word 0 is empty",
        ),
        (
            json!({"model": "tiny", "prompt": "x", "temperature": "hot"}).to_string(),
            Some(key),
            400,
            "temperature",
        ),
        (
            json!({"model": "tiny", "prompt": "x", "top_p": 0}).to_string(),
            Some(key),
            400,
            "top_p",
        ),
        (
            json!({"model": "tiny", "prompt": [1, 99999]}).to_string(),
            Some(key),
            400,
            "out of range",
        ),
        (
            json!({"model": "tiny", "prompt": []}).to_string(),
            Some(key),
            400,
            "empty",
        ),
        (
            json!({"model": "tiny"}).to_string(),
            Some(key),
            400,
            "prompt",
        ),
        (
            json!({"model": "tiny", "prompt": "x".repeat(5000)}).to_string(),
            Some(key),
            413,
            "exceeds the limit",
        ),
    ];
    for (body, k, want, needle) in cases {
        let (st, _, text) = post(&url, &body, k).await;
        assert_eq!(st, want, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "'{needle}' not in {msg}");
        // Errors about the sampling parameters name them.
        for p in ["best_of", "logit_bias", "allowed_token_ids", "bad_words"] {
            if needle.starts_with(p) || needle.contains(&format!("{p} ")) {
                assert_eq!(v["error"]["param"], p, "{text}");
            }
        }
        assert!(v["error"]["type"].is_string());
        // The server keeps serving.
        let (st, _, text) = post(&url, &ok_body, Some(key)).await;
        assert_eq!(st, 200, "{text}");
    }
    let (st, _, text) = post(
        &s.url("/v1/chat/completions"),
        &json!({"model": "tiny", "messages": []}).to_string(),
        Some(key),
    )
    .await;
    assert_eq!(st, 400, "{text}");
    let (st, _) = get(&s.url("/nope")).await;
    assert_eq!(st, 404);
    // /health and /metrics need no key.
    assert_eq!(get(&s.url("/health")).await.0, 200);
    assert_eq!(get(&s.url("/metrics")).await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_equals_alone_and_preemption_under_a_tiny_cache() {
    // 40 blocks of 4 = 160 positions: two long requests at most, so four at once
    // must preempt.
    let s = Server::start(
        "qwen2_moe",
        &[
            "--max-model-len",
            "128",
            "--block-size",
            "4",
            "--kv-cache-memory",
            &tiny_kv_bytes("qwen2_moe", 4, 40),
        ],
    );
    let g = golden("qwen2_moe");
    let prompts: Vec<Value> = g["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| c["prompt_token_ids"].clone())
        .chain([json!([
            5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21
        ])])
        .collect();
    let mut alone = Vec::new();
    for p in &prompts {
        alone.push(completion_text(&s, &greedy_completion(p, 60)).await);
    }
    // The batch must overlap enough to run out of cache; on a loaded machine
    // the requests can arrive too far apart, so up to three rounds (every one
    // must equal the alone runs, and one must preempt).
    let preempt_before = metric(&s, "epserve_num_preemptions_total").await;
    let mut preempt_after = preempt_before;
    for _round in 0..3 {
        let futs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let body = greedy_completion(p, 60);
                let url = s.url("/v1/completions");
                tokio::spawn(async move {
                    let (st, _, text) = post(&url, &body, None).await;
                    assert_eq!(st, 200, "{text}");
                    let v: Value = serde_json::from_str(&text).expect("json");
                    v["choices"][0]["text"].as_str().expect("text").to_string()
                })
            })
            .collect();
        let mut together = Vec::new();
        for f in futs {
            together.push(f.await.expect("join"));
        }
        assert_eq!(
            together, alone,
            "batched (with preemption) differs from alone"
        );
        preempt_after = metric(&s, "epserve_num_preemptions_total").await;
        if preempt_after > preempt_before {
            break;
        }
    }
    assert!(
        preempt_after > preempt_before,
        "no preemption happened in three rounds"
    );
    assert!(
        eventually(5, || async {
            metric(&s, "epserve_kv_cache_usage_ratio").await == 0.0
        })
        .await
    );
}

/// KV bytes for `blocks` blocks of `block_size` for a fixture (f32 K and V).
fn tiny_kv_bytes(fixture: &str, block_size: usize, blocks: usize) -> String {
    let cfg =
        epserve_core::config::ModelConfig::from_dir(&common::fixtures().join(fixture).join("bf16"))
            .expect("config");
    let per_pos = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * 4;
    (per_pos * block_size * blocks).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_frees_blocks_and_overload_says_retry_after() {
    let s = Server::start("olmoe", &["--max-num-seqs", "1", "--max-waiting", "2"]);
    // A streaming request we abandon after the first chunk.
    let before = metric(&s, "epserve_requests_total{status=\"cancelled\"}").await;
    {
        let mut resp = reqwest::Client::new()
            .post(s.url("/v1/completions"))
            .header("content-type", "application/json")
            .body(json!({"model": "tiny", "prompt": "abandon me", "max_tokens": 400, "ignore_eos": true, "stream": true}).to_string())
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status().as_u16(), 200);
        let first = resp.chunk().await.expect("chunk");
        assert!(first.is_some());
    } // dropped: the connection closes
    assert!(
        eventually(10, || async {
            metric(&s, "epserve_requests_total{status=\"cancelled\"}").await > before
        })
        .await,
        "the abandoned request was not cancelled"
    );
    assert!(
        eventually(10, || async {
            metric(&s, "epserve_kv_cache_usage_ratio").await == 0.0
        })
        .await
    );

    // Burst: one runs, two wait, the rest are refused with 503 + Retry-After.
    let body = json!({"model": "tiny", "prompt": "busy", "max_tokens": 300, "ignore_eos": true, "temperature": 0}).to_string();
    let futs: Vec<_> = (0..8)
        .map(|_| {
            let (url, body) = (s.url("/v1/completions"), body.clone());
            tokio::spawn(async move { post(&url, &body, None).await })
        })
        .collect();
    let (mut ok, mut refused) = (0, 0);
    for f in futs {
        let (st, headers, text) = f.await.expect("join");
        match st {
            200 => ok += 1,
            503 => {
                refused += 1;
                assert!(headers.get("retry-after").is_some(), "no Retry-After");
                assert!(text.contains("overloaded"), "{text}");
            }
            other => panic!("unexpected {other}: {text}"),
        }
    }
    assert!(ok >= 1 && refused >= 1, "ok {ok}, refused {refused}");
}

/// Completion choices of a non-streaming response, and its usage.
async fn choices(s: &Server, body: Value) -> (Vec<String>, Value) {
    let (st, _, text) = post(&s.url("/v1/completions"), &body.to_string(), None).await;
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    let cs = v["choices"].as_array().expect("choices");
    for (i, c) in cs.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    let texts = cs
        .iter()
        .map(|c| c["text"].as_str().expect("text").to_string())
        .collect();
    (texts, v["usage"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_and_logit_bias_allowed_tokens_bad_words() {
    let s = Server::start("qwen3_moe_a", &[]);
    let prompt = json!([
        5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22
    ]);
    let body = |extra: Value| {
        let mut b = json!({"model": "tiny", "prompt": prompt, "max_tokens": 10,
                           "temperature": 0, "ignore_eos": true});
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        b
    };
    // Greedy: n = 2 gives two copies of the n = 1 answer; usage counts the
    // prompt once and both completions.
    let (one, _) = choices(&s, body(json!({}))).await;
    let (two, usage) = choices(&s, body(json!({"n": 2, "best_of": 2}))).await;
    assert_eq!(two, vec![one[0].clone(), one[0].clone()]);
    assert_eq!(usage["prompt_tokens"], 18);
    assert_eq!(usage["completion_tokens"], 20);
    assert_eq!(usage["total_tokens"], 38);

    // Sampled with a seed: the choices differ, the request is reproducible,
    // and choice 0 is the n = 1 request with that seed.
    let sampled = |n: usize| body(json!({"n": n, "temperature": 1.0, "seed": 1234}));
    let (a, _) = choices(&s, sampled(4)).await;
    let (b, _) = choices(&s, sampled(4)).await;
    assert_eq!(a, b);
    assert!(
        a[1..].iter().any(|x| *x != a[0]),
        "all choices equal: {a:?}"
    );
    assert_eq!(choices(&s, sampled(1)).await.0[0], a[0]);

    // Streaming chat n = 2: chunks carry their choice's index; each choice
    // reassembles to the non-streaming answer; one usage chunk, one [DONE].
    let chat = |stream: bool| {
        json!({"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
               "max_tokens": 12, "temperature": 0, "n": 2, "stream": stream,
               "stream_options": {"include_usage": true}})
        .to_string()
    };
    let (st, _, text) = post(&s.url("/v1/chat/completions"), &chat(false), None).await;
    assert_eq!(st, 200, "{text}");
    let full: Value = serde_json::from_str(&text).expect("json");
    let events = sse(&s.url("/v1/chat/completions"), &chat(true)).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1);
    let mut streamed = [String::new(), String::new()];
    let (mut roles, mut finishes, mut usages) = ([0, 0], [0, 0], Vec::new());
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).expect("chunk json");
        if !c["usage"].is_null() {
            usages.push(c["usage"].clone());
        }
        for ch in c["choices"].as_array().expect("choices") {
            let i = ch["index"].as_u64().expect("index") as usize;
            if let Some(t) = ch["delta"]["content"].as_str() {
                streamed[i].push_str(t);
            }
            if ch["delta"]["role"] == "assistant" {
                roles[i] += 1;
            }
            if ch["finish_reason"].is_string() {
                finishes[i] += 1;
            }
        }
    }
    assert_eq!((roles, finishes), ([1, 1], [1, 1]));
    for i in 0..2 {
        assert_eq!(
            Some(streamed[i].as_str()),
            full["choices"][i]["message"]["content"].as_str()
        );
    }
    assert_eq!(usages.len(), 1);
    assert_eq!(usages[0], full["usage"]);

    // logit_bias, allowed_token_ids and bad_words steer greedy decoding;
    // returned logprobs stay the raw model's.
    let tok = epserve_core::loader::tokenizer::Tokenizer::from_dir(
        &common::fixtures().join("qwen3_moe_a/bf16"),
    )
    .expect("tokenizer");
    let first_tokens = |extra: Value| {
        let b = body(extra);
        let url = s.url("/v1/completions");
        async move {
            let mut b = b;
            b["logprobs"] = json!(1);
            b["max_tokens"] = json!(3);
            let (st, _, text) = post(&url, &b.to_string(), None).await;
            assert_eq!(st, 200, "{text}");
            let v: Value = serde_json::from_str(&text).expect("json");
            v["choices"][0]["logprobs"].clone()
        }
    };
    let plain = first_tokens(json!({})).await;
    let t0 = plain["tokens"][0].as_str().expect("token").to_string();
    // Every id that prints as the first token.
    let ids: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&i| tok.decode(&[i], false).is_ok_and(|t| t == t0))
        .collect();
    assert!(!ids.is_empty(), "{t0:?}");
    let bias: serde_json::Map<String, Value> =
        ids.iter().map(|i| (i.to_string(), json!(-100))).collect();
    let biased = first_tokens(json!({"logit_bias": bias})).await;
    assert_ne!(biased["tokens"][0], t0);
    // The raw model's logprob of the chosen token: below the unbiased best.
    assert!(
        biased["token_logprobs"][0].as_f64().expect("lp")
            <= plain["token_logprobs"][0].as_f64().expect("lp")
    );
    let forced = first_tokens(json!({"logit_bias": {"42": 100}})).await;
    let t42 = tok.decode(&[42], false).expect("decode");
    assert_eq!(forced["tokens"], json!([t42, t42, t42]));
    let allowed = first_tokens(json!({"allowed_token_ids": [42, 43]})).await;
    for t in allowed["tokens"].as_array().expect("tokens") {
        let t = t.as_str().expect("token");
        assert!(
            t == t42 || t == tok.decode(&[43], false).expect("decode"),
            "{t}"
        );
    }
    // bad_words: banned as tokenized without and with a leading space (the
    // latter when it has the same length), as vLLM does.
    let word = t0.trim();
    let plain_ids = tok.encode(word, false).expect("encode");
    let spaced_ids = tok.encode(&format!(" {word}"), false).expect("encode");
    let one_token_banned = plain_ids.len() == 1
        && (ids.contains(&plain_ids[0]) || (spaced_ids.len() == 1 && ids.contains(&spaced_ids[0])));
    if one_token_banned {
        let banned = first_tokens(json!({"bad_words": [word]})).await;
        assert_ne!(banned["tokens"][0], t0);
    }
    // Tiny temperature: greedy, not NaN-driven.
    let (tiny, _) = choices(&s, body(json!({"temperature": 1e-39}))).await;
    assert_eq!(tiny, one);
}

/// Prefix caching over HTTP with vLLM's `cache_salt`: a repeated prompt hits
/// the cache and gives the same text; a salted one shares only with its own
/// salt; an empty or over-long salt is a 400 naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_salt_separates_prefix_cache_hits() {
    let s = Server::start("qwen3_moe_a", &["--block-size", "4"]);
    let prompt: Vec<u32> = (0..30).map(|i| (i * 7 + 3) % 200).collect();
    let body = |salt: Option<&str>| {
        let mut v = json!({"model": "tiny", "prompt": prompt, "max_tokens": 6,
            "temperature": 0, "ignore_eos": true});
        if let Some(salt) = salt {
            v["cache_salt"] = json!(salt);
        }
        v.to_string()
    };
    let hits = || metric(&s, "epserve_prefix_cache_hits_total");
    let first = completion_text(&s, &body(None)).await;
    let h0 = hits().await;
    assert_eq!(completion_text(&s, &body(None)).await, first);
    let h1 = hits().await;
    assert!(h1 >= h0 + 28.0, "hits {h0} -> {h1}");
    // A new salt misses, and the text is the same.
    assert_eq!(completion_text(&s, &body(Some("user-a"))).await, first);
    assert_eq!(hits().await, h1, "a salted request hit unsalted blocks");
    assert_eq!(completion_text(&s, &body(Some("user-b"))).await, first);
    assert_eq!(hits().await, h1, "two salts shared blocks");
    assert_eq!(completion_text(&s, &body(Some("user-a"))).await, first);
    assert!(hits().await >= h1 + 28.0, "the same salt shares");
    // Chat requests take it too.
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2, "cache_salt": "user-a"})
    .to_string();
    let (status, _, text) = post(&s.url("/v1/chat/completions"), &chat, None).await;
    assert_eq!(status, 200, "{text}");
    let long = "x".repeat(1025);
    for (salt, want) in [
        (json!(""), "non-empty"),
        (json!(long), "over the limit"),
        (json!(7), "cache_salt"),
    ] {
        let mut v: Value = serde_json::from_str(&body(None)).expect("json");
        v["cache_salt"] = salt;
        let (status, _, text) = post(&s.url("/v1/completions"), &v.to_string(), None).await;
        assert_eq!(status, 400, "{text}");
        let e: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(e["error"]["param"], "cache_salt", "{text}");
        assert!(text.contains(want), "{text}");
    }
}
