//! Tool calling through `epserve serve`: `tools` / `tool_choice` validation,
//! rendering through a tool-capable chat template (prompt token counts equal
//! transformers' rendering), the 400 for a template without tool support,
//! and response / stream shapes.

mod common;

use common::{Server, fixtures, post, tool_model};
use serde_json::{Value, json};

fn golden_case(name: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join("tool_template/render_golden.json"))
        .expect("tool golden");
    let g: Value = serde_json::from_str(&text).expect("json");
    g["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["name"] == name)
        .cloned()
        .expect("case")
}

async fn chat(s: &Server, body: &Value) -> (u16, Value) {
    let (st, _, text) = post(&s.url("/v1/chat/completions"), &body.to_string(), None).await;
    let v = serde_json::from_str(&text).unwrap_or_else(|_| json!({"raw": text}));
    (st, v)
}

async fn sse(s: &Server, body: &Value) -> Vec<Value> {
    let (st, _, text) = post(&s.url("/v1/chat/completions"), &body.to_string(), None).await;
    assert_eq!(st, 200, "{text}");
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str(l).expect("chunk json"))
        .collect()
}

fn assert_400(st: u16, v: &Value, param: &str) {
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], param, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_render_validate_and_answer() {
    let model = tool_model();
    let s = Server::start(model.path().to_str().expect("utf-8 path"), &[]);

    // The prompts are transformers' renderings, token for token (counts).
    for name in ["small", "small_round_trip"] {
        let case = golden_case(name);
        let body = json!({"model": "tiny", "messages": case["request_messages"],
                          "tools": case["tools"], "max_tokens": 4, "temperature": 0});
        let (st, v) = chat(&s, &body).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["prompt_tokens"], case["prompt_tokens"], "{name}");
        let msg = &v["choices"][0]["message"];
        assert_eq!(msg["role"], "assistant");
        // The random-weight model does not call tools by itself: plain content.
        assert!(msg.get("tool_calls").is_none(), "{v}");
        assert!(
            msg["content"].is_string() || msg["content"].is_null(),
            "{v}"
        );
    }

    // Streaming with tools reassembles into the non-streamed answer.
    let case = golden_case("small");
    let body = json!({"model": "tiny", "messages": case["request_messages"], "tools": case["tools"],
                      "tool_choice": "auto", "parallel_tool_calls": false,
                      "max_tokens": 24, "temperature": 0});
    let (st, whole) = chat(&s, &body).await;
    assert_eq!(st, 200, "{whole}");
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let chunks = sse(&s, &sbody).await;
    let mut content = String::new();
    let mut finish = None;
    for c in &chunks {
        let ch = &c["choices"][0];
        if let Some(t) = ch["delta"]["content"].as_str() {
            content.push_str(t);
        }
        assert!(ch["delta"].get("tool_calls").is_none(), "{c}");
        if let Some(f) = ch["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    let msg = &whole["choices"][0]["message"];
    assert_eq!(content, msg["content"].as_str().unwrap_or(""));
    assert_eq!(
        finish.as_deref(),
        whole["choices"][0]["finish_reason"].as_str()
    );

    // tool_choice "none": tools rendered, output not parsed.
    let mut b = body.clone();
    b["tool_choice"] = json!("none");
    let (st, v) = chat(&s, &b).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], case["prompt_tokens"]);

    // Invalid requests: 400 naming the field.
    let user = json!([{"role": "user", "content": "hi"}]);
    let bad = [
        (
            json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a"}},
                          {"type": "function", "function": {"name": "a"}}]}),
            "tools[1].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"tools": case["tools"], "tool_choice": {"type": "function", "function": {"name": "mul"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": case["tools"], "tool_choice": "maybe"}),
            "tool_choice",
        ),
        (json!({"tools": "add"}), "tools"),
        (json!({"parallel_tool_calls": "yes"}), "parallel_tool_calls"),
    ];
    for (extra, param) in bad {
        let mut b = json!({"model": "tiny", "messages": user, "max_tokens": 2});
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        let (st, v) = chat(&s, &b).await;
        assert_400(st, &v, param);
    }
    // History: arguments must be JSON; only assistants carry tool_calls.
    let call =
        json!([{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{a:1"}}]);
    let b = json!({"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": null, "tool_calls": call}]});
    let (st, v) = chat(&s, &b).await;
    assert_400(st, &v, "messages[1].tool_calls[0].function.arguments");
    let b = json!({"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "x", "tool_calls": []}]});
    let (st, v) = chat(&s, &b).await;
    assert_400(st, &v, "messages[0].tool_calls");
}

/// A chat template that ignores tools: a request that wants tools called is
/// refused, never silently answered without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_without_tool_support_is_a_400() {
    let s = Server::start("qwen3_moe_a", &[]);
    let case = golden_case("small");
    let body = json!({"model": "tiny", "messages": case["request_messages"],
                      "tools": case["tools"], "max_tokens": 2});
    let (st, v) = chat(&s, &body).await;
    assert_400(st, &v, "tools");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("does not support tools")),
        "{v}"
    );
    // tool_choice "none": the tools are not needed, the request runs.
    let mut b = body.clone();
    b["tool_choice"] = json!("none");
    let (st, v) = chat(&s, &b).await;
    assert_eq!(st, 200, "{v}");
    // A history with tool calls the template would drop.
    let case = golden_case("small_round_trip");
    let body = json!({"model": "tiny", "messages": case["request_messages"], "max_tokens": 2});
    let (st, v) = chat(&s, &body).await;
    assert_400(st, &v, "messages");
}
