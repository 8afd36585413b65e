//! The official `openai` Python client against `epserve serve`. Skipped (with
//! a message) where Python has no `openai` package, unless
//! `EPSERVE_REQUIRE_OPENAI=1` (set by `.ci/run`), which makes it a failure.

mod common;

use std::process::Command;

#[test]
fn openai_python_client() {
    let has_openai = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !has_openai {
        assert!(
            std::env::var("EPSERVE_REQUIRE_OPENAI").as_deref() != Ok("1"),
            "EPSERVE_REQUIRE_OPENAI=1 but `python3 -c 'import openai'` fails"
        );
        eprintln!("skipping: python3 has no `openai` package (pip install openai)");
        return;
    }
    // The fixture with a tool-capable chat template (the script checks tools).
    let model = common::tool_model();
    let s = common::Server::start(model.path().to_str().expect("utf-8 path"), &[]);
    let script = common::fixtures().join("../openai_client_test.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(&s.base)
        .arg("tiny")
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
