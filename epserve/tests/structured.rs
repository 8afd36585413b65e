//! Structured output end to end: `response_format` json_schema / json_object,
//! vLLM's `structured_outputs` and `guided_*` fields on both endpoints,
//! streaming with logprobs, stop strings and max_tokens under a grammar, and
//! every invalid constraint answered 400 naming its field.

mod common;

use common::{Server, post};
use serde_json::{Value, json};

async fn ok(s: &Server, path: &str, body: Value) -> Value {
    let (status, _, text) = post(&s.url(path), &body.to_string(), None).await;
    assert_eq!(status, 200, "{body}: {text}");
    serde_json::from_str(&text).expect("json")
}

async fn bad(s: &Server, path: &str, body: Value) -> (String, String) {
    let (status, _, text) = post(&s.url(path), &body.to_string(), None).await;
    assert_eq!(status, 400, "{body}: {text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    let e = &v["error"];
    (
        e["param"].as_str().unwrap_or("").to_string(),
        e["message"].as_str().unwrap_or("").to_string(),
    )
}

fn chat(extra: Value) -> Value {
    let mut b = json!({"model": "tiny", "messages": [{"role": "user", "content": "Answer."}],
                       "max_tokens": 400, "temperature": 1.0});
    for (k, v) in extra.as_object().expect("object") {
        b[k] = v.clone();
    }
    b
}

fn completion(extra: Value) -> Value {
    let mut b = json!({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 300,
                       "temperature": 1.0});
    for (k, v) in extra.as_object().expect("object") {
        b[k] = v.clone();
    }
    b
}

fn is_code(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 6
        && b[..3].iter().all(u8::is_ascii_digit)
        && b[3] == b'-'
        && b[4..].iter().all(u8::is_ascii_uppercase)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_conforms_and_invalid_constraints_are_400() {
    let s = Server::start("qwen3_moe_a", &[]);
    let schema = json!({
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6},
                       "n": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["city", "n"], "additionalProperties": false,
    });

    // json_schema on chat, sampled and greedy.
    for (i, t) in [1.0, 1.0, 0.0].iter().enumerate() {
        let v = ok(
            &s,
            "/v1/chat/completions",
            chat(json!({
            "seed": i, "temperature": t,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "c", "schema": schema, "strict": true}}})),
        )
        .await;
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "stop", "{v}");
        let out: Value = serde_json::from_str(c["message"]["content"].as_str().expect("content"))
            .unwrap_or_else(|e| panic!("{v}: {e}"));
        assert!(
            out["city"].as_str().expect("city").chars().count() <= 6,
            "{out}"
        );
        assert!((-5..=5).contains(&out["n"].as_i64().expect("n")), "{out}");
        assert_eq!(out.as_object().expect("object").len(), 2);
    }
    // guided_json (a string holding the schema) and structured_outputs.json on completions.
    for extra in [
        json!({"guided_json": schema.to_string()}),
        json!({"structured_outputs": {"json": schema}}),
    ] {
        let v = ok(&s, "/v1/completions", completion(extra)).await;
        let text = v["choices"][0]["text"].as_str().expect("text");
        let out: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{v}: {e}"));
        assert!(out["n"].is_i64(), "{out}");
    }
    // json_object: the output starts as an object (a random model may not close it).
    let v = ok(
        &s,
        "/v1/chat/completions",
        chat(json!({"response_format": {"type": "json_object"}, "max_tokens": 8})),
    )
    .await;
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    assert!(text.trim_start().starts_with('{'), "{v}");

    // Regex, choice and Lark, through both spellings.
    for extra in [
        json!({"guided_regex": "[0-9]{3}-[A-Z]{2}"}),
        json!({"structured_outputs": {"regex": "[0-9]{3}-[A-Z]{2}"}}),
    ] {
        let v = ok(&s, "/v1/completions", completion(extra)).await;
        let text = v["choices"][0]["text"].as_str().expect("text");
        assert!(is_code(text), "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
    for extra in [
        json!({"guided_choice": ["alpha", "beta", "gamma delta"]}),
        json!({"structured_outputs": {"choice": ["alpha", "beta", "gamma delta"]}}),
    ] {
        let v = ok(&s, "/v1/chat/completions", chat(extra)).await;
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .expect("content");
        assert!(["alpha", "beta", "gamma delta"].contains(&text), "{v}");
    }
    let lark = r#"start: "call(" NUM ("," NUM)? ")"
NUM: /[0-9]{1,3}/"#;
    for extra in [
        json!({"guided_grammar": lark}),
        json!({"structured_outputs": {"grammar": lark}}),
    ] {
        let v = ok(&s, "/v1/completions", completion(extra)).await;
        let text = v["choices"][0]["text"].as_str().expect("text");
        let inner = text.strip_prefix("call(").and_then(|t| t.strip_suffix(')'));
        let inner = inner.unwrap_or_else(|| panic!("{v}"));
        assert!(
            inner
                .split(',')
                .all(|n| !n.is_empty() && n.len() <= 3 && n.bytes().all(|b| b.is_ascii_digit())),
            "{v}"
        );
    }

    // Streaming with logprobs: the deltas reassemble to a conforming text.
    let body = completion(json!({"guided_regex": "[0-9]{3}-[A-Z]{2}", "stream": true,
                                 "logprobs": 2}));
    let resp = reqwest::Client::new()
        .post(s.url("/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("send");
    let sse = resp.text().await.expect("body");
    let mut text = String::new();
    let mut logprobs = 0;
    for l in sse.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if l == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(l).expect("chunk");
        if let Some(c) = v["choices"].get(0) {
            text.push_str(c["text"].as_str().unwrap_or(""));
            logprobs += c["logprobs"]["tokens"].as_array().map_or(0, Vec::len);
        }
    }
    assert!(is_code(&text), "{sse}");
    assert!(logprobs > 0, "{sse}");

    // max_tokens cuts a grammar short (finish_reason length); stop strings still apply.
    let v = ok(
        &s,
        "/v1/completions",
        completion(json!({"guided_regex": "[0-9]{3}-[A-Z]{2}", "max_tokens": 2})),
    )
    .await;
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    let v = ok(
        &s,
        "/v1/completions",
        completion(json!({"guided_choice": ["abc-def"], "stop": ["-"]})),
    )
    .await;
    assert_eq!(v["choices"][0]["text"], "abc", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");

    // Invalid constraints: 400 naming the field and the problem.
    let cases = [
        (
            json!({"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "x", "schema": {"type": "nope"}}}}),
            "response_format.json_schema.schema",
            "Invalid type",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format.json_schema.schema",
            "needs json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format.type",
            "not supported",
        ),
        (
            json!({"guided_regex": "(unclosed"}),
            "guided_regex",
            "invalid regex",
        ),
        (
            json!({"guided_grammar": "start: nothing_here"}),
            "guided_grammar",
            "unknown name",
        ),
        (
            json!({"guided_json": "{not json"}),
            "guided_json",
            "not valid JSON",
        ),
        (
            json!({"guided_json": [1, 2]}),
            "guided_json",
            "must be a JSON schema",
        ),
        (json!({"guided_choice": []}), "guided_choice", "empty"),
        (
            json!({"structured_outputs": {"json": {"type": "integer", "minimum": 3, "maximum": 1}}}),
            "structured_outputs.json",
            "Unsatisfiable",
        ),
        (
            json!({"guided_regex": "a", "guided_choice": ["a"]}),
            "guided_choice",
            "only one",
        ),
        (
            json!({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}),
            "structured_outputs.regex",
            "only one",
        ),
    ];
    for (extra, param, msg) in cases {
        for (path, body) in [
            ("/v1/chat/completions", chat(extra.clone())),
            ("/v1/completions", completion(extra.clone())),
        ] {
            let (p, m) = bad(&s, path, body).await;
            assert_eq!(p, param, "{path} {extra}: {m}");
            assert!(m.contains(msg), "{path} {extra}: {m}");
        }
    }
    let (p, m) = bad(
        &s,
        "/v1/completions",
        completion(json!({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}})),
    )
    .await;
    assert!(
        p.starts_with("structured_outputs") && m.contains("whitespace_pattern"),
        "{p}: {m}"
    );
    // response_format text is no constraint.
    ok(
        &s,
        "/v1/completions",
        completion(json!({"response_format": {"type": "text"}, "guided_regex": "a+"})),
    )
    .await;
}
