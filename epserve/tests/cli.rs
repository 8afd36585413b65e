//! The `epserve` binary as a user runs it: `generate --json` on the bundled
//! fixtures, and broken model folders that must fail with one clear line.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn epserve(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_epserve"))
        .args(args)
        .output()
        .expect("run epserve");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
}

/// A failing run: exit code 1, nothing on stdout, one line on stderr that
/// contains every `needle`.
fn assert_one_line_error(r: &Run, needles: &[&str]) {
    assert_eq!(r.code, 1, "stderr: {}", r.stderr);
    assert!(r.stdout.is_empty(), "stdout: {}", r.stdout);
    let line = r.stderr.trim();
    assert_eq!(line.lines().count(), 1, "not one line: {line}");
    assert!(!line.contains("panicked"), "{line}");
    for n in needles {
        assert!(line.contains(n), "'{n}' not in: {line}");
    }
}

fn golden_case(fixture: &str, case: usize) -> serde_json::Value {
    let text =
        std::fs::read_to_string(fixtures().join(fixture).join("golden.json")).expect("golden");
    let g: serde_json::Value = serde_json::from_str(&text).expect("golden json");
    g["cases"][case].clone()
}

#[test]
fn generate_json_matches_transformers_greedy() {
    for (fixture, case) in [
        ("qwen3_moe_a", 0),
        ("mixtral", 2),
        ("olmoe", 1),
        ("qwen2_moe", 0),
    ] {
        let c = golden_case(fixture, case);
        let dir = fixtures().join(fixture).join("bf16");
        let prompt = c["prompt"].as_str().expect("prompt");
        let mut args = vec![
            "generate",
            "--model",
            dir.to_str().expect("utf8"),
            "--prompt",
            prompt,
            "--max-tokens",
            "32",
            "--json",
            "--ignore-eos",
        ];
        if c["chat"].as_bool() == Some(true) {
            args.push("--chat");
        }
        let r = epserve(&args);
        assert_eq!(r.code, 0, "{fixture}: {}", r.stderr);
        let v: serde_json::Value = serde_json::from_str(r.stdout.trim()).expect("one JSON object");
        assert_eq!(v["prompt_token_ids"], c["prompt_token_ids"], "{fixture}");
        assert_eq!(v["token_ids"], c["greedy_token_ids"], "{fixture}");
        assert!(v["text"].is_string());
    }
}

#[test]
fn sampling_is_reproducible_with_a_seed() {
    let dir = fixtures().join("qwen3_moe_a").join("f32");
    let d = dir.to_str().expect("utf8");
    let run = |seed: &str| {
        let r = epserve(&[
            "generate",
            "--model",
            d,
            "--prompt",
            "hello",
            "--max-tokens",
            "16",
            "--temperature",
            "1.0",
            "--top-p",
            "0.9",
            "--seed",
            seed,
            "--json",
            "--ignore-eos",
        ]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        r.stdout
    };
    assert_eq!(run("5"), run("5"));
}

#[test]
fn missing_model_folder() {
    let r = epserve(&["generate", "--model", "/nonexistent/model", "--prompt", "x"]);
    assert_one_line_error(&r, &["/nonexistent/model", "missing"]);
}

#[test]
fn truncated_safetensors() {
    let tmp = tempfile::tempdir().expect("tmp");
    copy_dir(&fixtures().join("qwen3_moe_a/f32"), tmp.path());
    let f = tmp.path().join("model.safetensors");
    let len = std::fs::metadata(&f).expect("meta").len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .expect("open");
    file.set_len(len / 2).expect("truncate");
    let r = epserve(&[
        "generate",
        "--model",
        tmp.path().to_str().expect("utf8"),
        "--prompt",
        "x",
    ]);
    assert_one_line_error(&r, &["model.safetensors", "corrupt"]);
}

#[test]
fn missing_tokenizer() {
    let tmp = tempfile::tempdir().expect("tmp");
    copy_dir(&fixtures().join("mixtral/bf16"), tmp.path());
    std::fs::remove_file(tmp.path().join("tokenizer.json")).expect("rm");
    let r = epserve(&[
        "generate",
        "--model",
        tmp.path().to_str().expect("utf8"),
        "--prompt",
        "x",
    ]);
    assert_one_line_error(&r, &["tokenizer.json", "missing"]);
}

#[test]
fn broken_configs() {
    let cases: &[(&str, &[&str])] = &[
        ("{ not json", &["config.json", "invalid JSON"]),
        (
            r#"{"model_type": "llama", "vocab_size": 3}"#,
            &["config.json", "unsupported model_type 'llama'"],
        ),
    ];
    for (text, needles) in cases {
        let tmp = tempfile::tempdir().expect("tmp");
        copy_dir(&fixtures().join("olmoe/f32"), tmp.path());
        std::fs::write(tmp.path().join("config.json"), text).expect("write");
        let r = epserve(&[
            "generate",
            "--model",
            tmp.path().to_str().expect("utf8"),
            "--prompt",
            "x",
        ]);
        assert_one_line_error(&r, needles);
    }
    // A config whose sizes disagree with the weights: the tensor is named.
    let tmp = tempfile::tempdir().expect("tmp");
    copy_dir(&fixtures().join("olmoe/f32"), tmp.path());
    let p = tmp.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).expect("read")).expect("json");
    cfg["intermediate_size"] = serde_json::json!(48);
    std::fs::write(&p, cfg.to_string()).expect("write");
    let r = epserve(&[
        "generate",
        "--model",
        tmp.path().to_str().expect("utf8"),
        "--prompt",
        "x",
    ]);
    assert_one_line_error(&r, &["model.safetensors", "has shape", "expected"]);
    // A missing required field.
    cfg.as_object_mut().expect("object").remove("hidden_size");
    std::fs::write(&p, cfg.to_string()).expect("write");
    let r = epserve(&[
        "generate",
        "--model",
        tmp.path().to_str().expect("utf8"),
        "--prompt",
        "x",
    ]);
    assert_one_line_error(&r, &["config.json", "hidden_size"]);
}

#[test]
fn missing_shard_is_named() {
    let tmp = tempfile::tempdir().expect("tmp");
    copy_dir(&fixtures().join("qwen3_moe_b/f32"), tmp.path());
    let idx = tmp.path().join("model.safetensors.index.json");
    assert!(idx.is_file(), "qwen3_moe_b/f32 is the sharded fixture");
    let shard = std::fs::read_dir(tmp.path())
        .expect("ls")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().contains("-of-"))
        .expect("a shard");
    std::fs::remove_file(&shard).expect("rm");
    let name = shard
        .file_name()
        .and_then(|s| s.to_str())
        .expect("name")
        .to_string();
    let r = epserve(&[
        "generate",
        "--model",
        tmp.path().to_str().expect("utf8"),
        "--prompt",
        "x",
    ]);
    assert_one_line_error(&r, &[&name, "missing"]);
}

#[test]
fn stop_strings_cut_the_text() {
    let dir = fixtures().join("qwen3_moe_a").join("f32");
    let d = dir.to_str().expect("utf8");
    let full = epserve(&[
        "generate",
        "--model",
        d,
        "--prompt",
        "hello",
        "--max-tokens",
        "24",
        "--json",
        "--ignore-eos",
    ]);
    assert_eq!(full.code, 0, "{}", full.stderr);
    let v: serde_json::Value = serde_json::from_str(full.stdout.trim()).expect("json");
    let text = v["text"].as_str().expect("text").to_string();
    // Pick a stop string from the middle of the greedy text.
    let chars: Vec<char> = text.chars().collect();
    if chars.len() < 6 {
        return;
    }
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let r = epserve(&[
        "generate",
        "--model",
        d,
        "--prompt",
        "hello",
        "--max-tokens",
        "24",
        "--json",
        "--ignore-eos",
        "--stop",
        &stop,
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let s: serde_json::Value = serde_json::from_str(r.stdout.trim()).expect("json");
    let cut = s["text"].as_str().expect("text");
    assert_eq!(s["finish_reason"], "stop");
    assert!(!cut.contains(&stop), "{cut:?} contains {stop:?}");
    assert!(text.starts_with(cut), "{cut:?} is not a prefix of {text:?}");
}

#[test]
fn attention_workers_refuse_what_they_cannot_serve() {
    let qwen = fixtures().join("qwen3_moe_a/f32");
    let qwen = qwen.to_str().expect("utf8");
    // Checked before any etcd is contacted (none listens on port 1).
    let base = ["--etcd", "127.0.0.1:1", "--listen", "127.0.0.1:0"];
    let r = epserve(
        &[
            &[
                "attention-worker",
                "--model",
                qwen,
                "--shard",
                "2",
                "--of",
                "2",
            ][..],
            &base,
        ]
        .concat(),
    );
    assert_one_line_error(&r, &["--shard 2 --of 2"]);
    let r = epserve(
        &[
            &[
                "attention-worker",
                "--model",
                qwen,
                "--shard",
                "0",
                "--of",
                "3",
            ][..],
            &base,
        ]
        .concat(),
    );
    assert_one_line_error(&r, &["cannot be split evenly over 3 attention shards"]);
    // 4 query heads over 3 shards, refused by the coordinator too.
    let r = epserve(&[
        "coordinator",
        "--model",
        qwen,
        "--etcd",
        "127.0.0.1:1",
        "--attention-workers",
        "3",
    ]);
    assert_one_line_error(&r, &["--attention-workers 3", "cannot be split evenly"]);
}

#[test]
fn workers_give_up_on_an_unreachable_etcd() {
    // A loopback port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let etcd = format!("127.0.0.1:{port}");
    let model = fixtures().join("qwen3_moe_a/f32");
    let model = model.to_str().expect("utf-8 path");
    let common = [
        "--model",
        model,
        "--etcd",
        &etcd,
        "--listen",
        "127.0.0.1:0",
        "--etcd-timeout-secs",
        "2",
    ];
    for (role, extra) in [
        ("attention-worker", &["--shard", "0", "--of", "1"][..]),
        ("expert-worker", &[][..]),
    ] {
        let started = std::time::Instant::now();
        let mut args = vec![role];
        args.extend_from_slice(&common);
        args.extend_from_slice(extra);
        let r = epserve(&args);
        let took = started.elapsed();
        assert_one_line_error(
            &r,
            &[
                &format!("etcd at {etcd}"),
                "unreachable for 2 s",
                "giving up",
            ],
        );
        assert!(
            took >= std::time::Duration::from_secs(2) && took < std::time::Duration::from_secs(20),
            "{role} gave up after {took:?}"
        );
    }
}
