//! Helpers shared by the end-to-end tests: where the fixtures live and how
//! their transformers goldens are read.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

pub mod up;

/// `tests/fixtures/` in this checkout.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// One fixture model folder pair (`f32/`, `bf16/`) with its golden.
pub fn fixture_dir(name: &str) -> PathBuf {
    fixtures_dir().join(name)
}

/// Names of all fixtures (folders holding a `golden.json`).
pub fn fixture_names() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(fixtures_dir())
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.path().join("golden.json").is_file())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// transformers' reference outputs for one fixture.
#[derive(Debug, Deserialize)]
pub struct Golden {
    pub fixture: String,
    pub model_type: String,
    pub num_layers: usize,
    pub moe_layers: Vec<usize>,
    pub num_experts: usize,
    pub top_k: usize,
    pub vocab_size: usize,
    pub cases: Vec<GoldenCase>,
}

/// One prompt's reference outputs.
#[derive(Debug, Deserialize)]
pub struct GoldenCase {
    pub name: String,
    pub prompt: String,
    pub chat: bool,
    pub prompt_token_ids: Vec<u32>,
    pub last_logits: Vec<f32>,
    pub top5_ids: Vec<Vec<u32>>,
    pub top5_logits: Vec<Vec<f32>>,
    pub greedy_token_ids: Vec<u32>,
    pub router_topk: BTreeMap<String, Vec<Vec<u32>>>,
}

/// Reads `tests/fixtures/<name>/golden.json`.
pub fn golden(name: &str) -> Golden {
    read_golden(&fixture_dir(name).join("golden.json"))
}

/// Reads a golden file.
pub fn read_golden(path: &std::path::Path) -> Golden {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The bundled demo model (`models/demo`: trained, bf16 only, see
/// `scripts/make_demo_model.py`).
pub fn demo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/demo")
}

/// transformers' reference outputs for the demo model
/// (`tests/fixtures/demo_golden.json`, computed from the committed bf16 weights).
pub fn demo_golden() -> Golden {
    read_golden(&fixtures_dir().join("demo_golden.json"))
}

/// POSTs `body` to `{url}/v1/completions` and returns the JSON answer;
/// panics (with the body) unless the status is a success.
pub async fn complete(url: &str, body: serde_json::Value) -> serde_json::Value {
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("send");
    let status = resp.status();
    let text = resp.text().await.expect("body");
    assert!(status.is_success(), "{status}: {text}");
    serde_json::from_str(&text).expect("json")
}

/// Every golden case of `fixture` through the server at `url` (serving it
/// as `model`): the greedy completion of each prompt is transformers' text
/// (decoded with the fixture's f32 tokenizer).
pub async fn assert_goldens(url: &str, model: &str, fixture: &str) {
    let g = golden(fixture);
    let tok =
        epserve_core::loader::tokenizer::Tokenizer::from_dir(&fixture_dir(fixture).join("f32"))
            .expect("tokenizer");
    for case in &g.cases {
        let v = complete(
            url,
            serde_json::json!({"model": model, "prompt": case.prompt_token_ids,
                "max_tokens": case.greedy_token_ids.len(), "temperature": 0, "ignore_eos": true}),
        )
        .await;
        let want = tok.decode(&case.greedy_token_ids, true).expect("decode");
        assert_eq!(
            v["choices"][0]["text"].as_str(),
            Some(want.as_str()),
            "{fixture} case {}",
            case.name
        );
    }
}
