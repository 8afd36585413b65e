//! Hot-expert replication and live rebalancing on the real cluster: `epserve
//! up` (etcd, 3 expert-workers, the coordinator as processes) on the olmoe
//! fixture (13 experts, top-3, 2 MoE layers) with f32 dispatch, driven by
//! `epserve ctl` as an operator would.
//!
//! Skewed traffic: prompts that repeat one token. Every position of such a
//! prompt has the same hidden state in every layer (attention over identical
//! values returns that value), so all its prefill tokens go to the same 3
//! experts per layer: a few experts get most of the load.
//!
//! Checked: a wrong admin token is refused; `ctl rebalance --dry-run`
//! predicts a gain and changes nothing; `ctl rebalance --redundant 4` runs
//! while a bounded set of concurrent requests goes through the switch, and
//! every request returns exactly the tokens it returned before the
//! rebalance; measured balancedness rises (printed); `ctl drain` leaves the
//! worker holding nothing, and after killing it requests still succeed with
//! the same tokens. Automatic rebalancing (`--eplb-interval`) kicks in under
//! skewed load. A worker that crashes while a rebalance waits for it, and is
//! restarted (same id, new address), loads both sets and the rebalance
//! completes. A worker killed with no replica of its experts elsewhere:
//! once its lease expires the coordinator re-places its experts on the
//! survivors (`recover <worker>`) within 5 s, and requests succeed again;
//! restarted with the same id it gets a share back (`return <worker>`); a
//! worker sent SIGTERM asks to be drained, is emptied and exits.
//!
//! Needs `etcd` on PATH; skipped without it unless `EPSERVE_REQUIRE_ETCD=1`.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use epserve_tests::fixture_dir;
use epserve_tests::up::{Up, etcd_available};
use serde_json::{Value, json};

const TOKEN: &str = "eplb-test-token";

fn start_up(extra: &[&str]) -> Up {
    let model = fixture_dir("olmoe").join("f32");
    let model = model.to_str().expect("utf-8 fixture path");
    let mut args = vec!["--model", model, "--expert-workers", "3", "--port", "0"];
    args.extend(["--dispatch-dtype", "f32", "--served-model-name", "tiny"]);
    args.extend(["--", "--admin-token", TOKEN, "--max-num-seqs", "8"]);
    args.extend_from_slice(extra);
    Up::start(env!("CARGO_BIN_EXE_epserve-it"), &args, true)
}

/// Runs `epserve ctl --admin ADDR --token TOKEN ARGS... --json`; returns
/// (success, stdout JSON or null, stderr).
fn ctl(admin: &str, token: &str, args: &[&str]) -> (bool, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_epserve-it"))
        .args(["ctl", "--admin", admin, "--token", token])
        .args(args)
        .arg("--json")
        .output()
        .expect("run epserve ctl");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let v = serde_json::from_str(stdout.trim()).unwrap_or(Value::Null);
    (
        out.status.success(),
        v,
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn ctl_ok(admin: &str, args: &[&str]) -> Value {
    let (ok, v, err) = ctl(admin, TOKEN, args);
    assert!(ok, "epserve ctl {args:?} failed: {err}");
    v
}

async fn complete(url: &str, prompt: &[u32], max_tokens: usize) -> String {
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(
            &json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": true}),
        )
        .send()
        .await
        .expect("send");
    let status = resp.status();
    let text = resp.text().await.expect("body");
    assert!(status.is_success(), "{status}: {text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["usage"]["completion_tokens"], max_tokens, "{v}");
    v["choices"][0]["text"].as_str().expect("text").to_string()
}

/// The skewed prompt set: 40 copies of one token each.
fn prompts() -> Vec<Vec<u32>> {
    [7u32, 42, 100, 211, 300, 377]
        .iter()
        .map(|&t| vec![t; 40])
        .collect()
}

const MAX_TOKENS: usize = 6;

/// Runs every prompt `rounds` times concurrently; returns texts per prompt.
async fn traffic(url: &str, rounds: usize) -> Vec<Vec<String>> {
    debug_assert!(rounds > 0);
    let mut handles = Vec::new();
    for p in prompts() {
        let url = url.to_string();
        handles.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for _ in 0..rounds {
                out.push(complete(&url, &p, MAX_TOKENS).await);
            }
            out
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.push(h.await.expect("join"));
    }
    all
}

fn balancedness(load: &Value) -> Vec<f64> {
    load["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| l["balancedness"].as_f64().expect("balancedness"))
        .collect()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalance_replicates_hot_experts_live_and_drain_empties_a_worker() {
    if !etcd_available() {
        return;
    }
    // Two micro-batches per step: the rebalance switches placements under
    // ping-ponged steps, and outputs stay the goldens.
    let up = start_up(&["--micro-batches", "2"]);

    // A wrong or missing admin token is refused.
    let (ok, _, err) = ctl(&up.admin, "wrong-token", &["workers"]);
    assert!(!ok, "a wrong token was accepted");
    assert!(err.contains("Unauthenticated"), "{err}");
    let workers = ctl_ok(&up.admin, &["workers"]);
    assert_eq!(workers.as_array().map(Vec::len), Some(3), "{workers}");

    // Reference outputs under the initial placement (f32 dispatch: the same
    // numbers as the single-process engine).
    let baseline: Vec<String> = traffic(&up.url, 1)
        .await
        .into_iter()
        .map(|mut v| v.remove(0))
        .collect();
    let before = ctl_ok(&up.admin, &["load"]);
    let bal_before = balancedness(&before);
    assert!(before["window_steps"].as_u64().unwrap_or(0) > 0, "{before}");

    // Dry run: predicted beats current, nothing changes.
    let dry = ctl_ok(&up.admin, &["rebalance", "--dry-run", "--redundant", "4"]);
    assert_eq!(dry["state"], "dry_run", "{dry}");
    let cur: Vec<f64> = serde_json::from_value(dry["current_balancedness"].clone()).expect("cur");
    let pred: Vec<f64> =
        serde_json::from_value(dry["predicted_balancedness"].clone()).expect("pred");
    assert!(mean(&pred) > mean(&cur), "dry run {cur:?} -> {pred:?}");
    let placement = ctl_ok(&up.admin, &["placement"]);
    assert_eq!(placement["version"], 1, "a dry run changed the placement");

    // The live rebalance while requests run through the switch: every
    // prompt is sent again and again (at most 200 times) until the
    // rebalance has returned, then once more.
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for p in prompts() {
        let (url, stop) = (up.url.clone(), stop.clone());
        handles.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for _ in 0..200 {
                let last = stop.load(Ordering::SeqCst);
                let t0 = Instant::now();
                let text = complete(&url, &p, MAX_TOKENS).await;
                out.push((t0, Instant::now(), text));
                if last {
                    break;
                }
            }
            out
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let admin = up.admin.clone();
    let rb_start = Instant::now();
    let rb =
        tokio::task::spawn_blocking(move || ctl_ok(&admin, &["rebalance", "--redundant", "4"]))
            .await
            .expect("join");
    let rb_end = Instant::now();
    stop.store(true, Ordering::SeqCst);
    let mut during = Vec::new();
    for h in handles {
        during.push(h.await.expect("traffic through the switch"));
    }
    let total: usize = during.iter().map(Vec::len).sum();
    let overlapping = during
        .iter()
        .flatten()
        .filter(|(s, e, _)| *s < rb_end && *e > rb_start)
        .count();
    eprintln!(
        "rebalance took {:.3} s; {total} requests, {overlapping} of them in flight during it",
        (rb_end - rb_start).as_secs_f64()
    );
    assert!(overlapping > 0, "no request ran during the rebalance");
    assert!(
        during
            .iter()
            .all(|runs| runs.last().is_some_and(|r| r.0 > rb_end)),
        "every prompt runs again after the switch"
    );
    assert_eq!(rb["state"], "done", "{rb}");
    assert_eq!(rb["to_version"], 2, "{rb}");
    for (i, runs) in during.iter().enumerate() {
        for (_, _, r) in runs {
            assert_eq!(r, &baseline[i], "prompt {i} changed during the rebalance");
        }
    }
    let placement = ctl_ok(&up.admin, &["placement"]);
    assert_eq!(placement["version"], 2);
    let replicated = placement["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .flat_map(|l| l["experts"].as_array().cloned().unwrap_or_default())
        .filter(|r| r.as_array().map(Vec::len).unwrap_or(0) > 1)
        .count();
    assert!(replicated > 0, "no expert was replicated: {placement}");
    let status = ctl_ok(&up.admin, &["status"]);
    assert_eq!(status["state"], "done", "{status}");

    // The same traffic again under the new placement: measured balancedness rises.
    let again = traffic(&up.url, 1).await;
    for (i, r) in again.iter().enumerate() {
        assert_eq!(r[0], baseline[i], "prompt {i} after the rebalance");
    }
    let after = ctl_ok(&up.admin, &["load"]);
    let bal_after = balancedness(&after);
    eprintln!(
        "balancedness per MoE layer: before {bal_before:?} (mean {:.3}), predicted {pred:?}, after {bal_after:?} (mean {:.3})",
        mean(&bal_before),
        mean(&bal_after)
    );
    assert!(
        mean(&bal_after) > mean(&bal_before),
        "balancedness did not rise: {bal_before:?} -> {bal_after:?}"
    );

    // The terminal heat map and the picture.
    let png = std::env::temp_dir().join(format!("epserve-eplb-{}.png", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_epserve-it"))
        .args([
            "ctl", "--admin", &up.admin, "--token", TOKEN, "load", "--png",
        ])
        .arg(&png)
        .output()
        .expect("ctl load");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("balancedness") && text.contains('█'),
        "{text}"
    );
    let bytes = std::fs::read(&png).expect("png written");
    assert_eq!(&bytes[..4], b"\x89PNG");
    let _ = std::fs::remove_file(&png);

    // Errors are specific.
    let (ok, _, err) = ctl(&up.admin, TOKEN, &["drain", "no-such-worker"]);
    assert!(
        !ok && err.contains("NotFound") && err.contains("no-such-worker"),
        "{err}"
    );
    let (ok, _, err) = ctl(
        &up.admin,
        TOKEN,
        &["rebalance", "--redundant", "100", "--capacity", "5"],
    );
    assert!(!ok && err.contains("ResourceExhausted"), "{err}");

    // Drain one worker: it ends up holding nothing.
    let gone = "expert-1";
    let d = ctl_ok(&up.admin, &["drain", gone]);
    assert_eq!(d["state"], "done", "{d}");
    let workers = ctl_ok(&up.admin, &["workers"]);
    let held = workers
        .as_array()
        .expect("workers")
        .iter()
        .find(|w| w["id"] == gone)
        .map(|w| w["experts"].as_u64().unwrap_or(99))
        .expect("drained worker still registered");
    assert_eq!(held, 0, "{workers}");
    let pid = workers_pid(&up, gone).await;

    // Stop it: requests still succeed, with the same tokens.
    // SAFETY: the worker is a grandchild of this test; SIGKILL simulates a crash.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after_kill = traffic(&up.url, 1).await;
    for (i, r) in after_kill.iter().enumerate() {
        assert_eq!(
            r[0], baseline[i],
            "prompt {i} after the drained worker died"
        );
    }
}

/// The pid worker `id` registered in etcd.
async fn workers_pid(up: &Up, id: &str) -> u32 {
    up.cluster_state()
        .await
        .workers("expert")
        .await
        .expect("workers")
        .into_iter()
        .find(|w| w.id == id)
        .map(|w| w.pid)
        .unwrap_or_else(|| panic!("worker {id} is not registered"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_rebalancing_kicks_in_under_skewed_load() {
    if !etcd_available() {
        return;
    }
    let up = start_up(&[
        "--eplb-interval",
        "20",
        "--eplb-redundant-experts",
        "4",
        "--eplb-min-improvement",
        "0.1",
    ]);
    let baseline: Vec<String> = traffic(&up.url, 1)
        .await
        .into_iter()
        .map(|mut v| v.remove(0))
        .collect();
    // Keep the skewed traffic going (bounded) until the coordinator has
    // rebalanced by itself; every answer stays the same.
    let mut version = 1;
    for _ in 0..40 {
        for (i, r) in traffic(&up.url, 1).await.iter().enumerate() {
            assert_eq!(r[0], baseline[i], "prompt {i}");
        }
        version = ctl_ok(&up.admin, &["placement"])["version"]
            .as_u64()
            .unwrap_or(0);
        if version > 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(version > 1, "no automatic rebalance happened");
    let status = ctl_ok(&up.admin, &["status"]);
    assert_eq!(status["reason"], "auto", "{status}");
    // Once balanced, it does not churn: the next plans gain too little.
    for (i, r) in traffic(&up.url, 2).await.iter().enumerate() {
        assert!(r.iter().all(|t| t == &baseline[i]), "prompt {i}");
    }
    eprintln!(
        "automatic rebalance: {} -> placement v{version}",
        status["message"]
    );
}

/// A process this test started itself (killed and reaped on drop).
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_restarted_mid_rebalance_loads_both_sets_and_it_completes() {
    if !etcd_available() {
        return;
    }
    let up = start_up(&[]);
    let baseline: Vec<String> = traffic(&up.url, 1)
        .await
        .into_iter()
        .map(|mut v| v.remove(0))
        .collect();
    // The cluster's key prefix.
    let cluster = up.cluster_name().await;
    // Crash expert-0 (its registration outlives it for the lease TTL).
    let pid = workers_pid(&up, "expert-0").await;
    // SAFETY: the worker is a grandchild of this test; SIGKILL simulates a crash.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
    // A placement that gives expert-0 a new replica: the rebalance waits for it.
    let mut target = ctl_ok(&up.admin, &["placement"]);
    let workers: Vec<String> = serde_json::from_value(target["workers"].clone()).expect("workers");
    let w0 = workers
        .iter()
        .position(|w| w == "expert-0")
        .expect("expert-0 placed") as u64;
    let experts = target["layers"][0]["experts"]
        .as_array_mut()
        .expect("experts");
    let e = experts
        .iter()
        .position(|r| !r.as_array().expect("reps").contains(&json!(w0)))
        .expect("an expert not on expert-0");
    experts[e].as_array_mut().expect("reps").push(json!(w0));
    let file =
        std::env::temp_dir().join(format!("epserve-eplb-target-{}.json", std::process::id()));
    std::fs::write(&file, target.to_string()).expect("write target");
    let admin = up.admin.clone();
    let f2 = file.clone();
    let rb = tokio::task::spawn_blocking(move || {
        ctl_ok(&admin, &["set-placement", f2.to_str().expect("utf-8 path")])
    });
    // Wait (bounded) until the rebalance waits for the dead worker.
    let mut state = Value::Null;
    for _ in 0..100 {
        state = ctl_ok(&up.admin, &["status"]);
        if state["state"] == "loading" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(state["state"], "loading", "{state}");
    // Restart expert-0 (same id, a new port): it reads the active rebalance,
    // loads its old and new experts, and reports ready.
    let _restarted = Proc(
        Command::new(env!("CARGO_BIN_EXE_epserve-it"))
            .arg("expert-worker")
            .arg("--model")
            .arg(fixture_dir("olmoe").join("f32"))
            .args([
                "--etcd",
                &up.etcd,
                "--cluster",
                &cluster,
                "--id",
                "expert-0",
            ])
            .args(["--listen", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .spawn()
            .expect("restart expert-0"),
    );
    let rb = rb.await.expect("join");
    let _ = std::fs::remove_file(&file);
    assert_eq!(rb["state"], "done", "{rb}");
    assert_eq!(rb["to_version"], 2, "{rb}");
    // The restarted worker serves the new placement (its new address came
    // with the switch): the same tokens as before.
    for (i, r) in traffic(&up.url, 1).await.iter().enumerate() {
        assert_eq!(r[0], baseline[i], "prompt {i} after the restart");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_without_replicas_is_replaced_by_the_survivors_after_its_lease() {
    if !etcd_available() {
        return;
    }
    let up = start_up(&[]);
    let baseline: Vec<String> = traffic(&up.url, 1)
        .await
        .into_iter()
        .map(|mut v| v.remove(0))
        .collect();
    // kill -9 expert-1: no other worker holds its experts.
    let gone = "expert-1";
    let pid = workers_pid(&up, gone).await;
    let killed = Instant::now();
    // SAFETY: the worker is a grandchild of this test; SIGKILL simulates a crash.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
    // The coordinator re-places its experts once its lease (5 s) expires;
    // wait (bounded) for the recovery rebalance to be done.
    let mut status = Value::Null;
    let mut whole = None;
    while killed.elapsed() < Duration::from_secs(30) {
        status = ctl_ok(&up.admin, &["status"]);
        if status["reason"] == format!("recover {gone}") && status["state"] == "done" {
            whole = Some(killed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let whole = whole.unwrap_or_else(|| panic!("no recovery within 30 s: {status}"));
    eprintln!(
        "kill -9 of {gone} (no replicas): every expert served again {:.2} s after the kill (lease TTL 5 s; {})",
        whole.as_secs_f64(),
        status["message"]
    );
    assert!(
        whole < Duration::from_secs(10),
        "not whole within 5 s of the lease expiring: {whole:?}"
    );
    let placement = ctl_ok(&up.admin, &["placement"]);
    let workers: Vec<String> =
        serde_json::from_value(placement["workers"].clone()).expect("workers");
    let idx = workers.iter().position(|w| w == gone).map(|i| i as u64);
    for l in placement["layers"].as_array().expect("layers") {
        for reps in l["experts"].as_array().expect("experts") {
            let reps = reps.as_array().expect("replicas");
            assert!(!reps.is_empty(), "{placement}");
            assert!(
                idx.is_none_or(|i| !reps.contains(&json!(i))),
                "an expert still on {gone}: {placement}"
            );
        }
    }
    // Requests succeed again, with the same tokens.
    for (i, r) in traffic(&up.url, 1).await.iter().enumerate() {
        assert_eq!(r[0], baseline[i], "prompt {i} after the recovery");
    }

    // It restarts with the same id (a new port): it gets a share back.
    let cluster = up.cluster_name().await;
    let _restarted = Proc(
        Command::new(env!("CARGO_BIN_EXE_epserve-it"))
            .arg("expert-worker")
            .arg("--model")
            .arg(fixture_dir("olmoe").join("f32"))
            .args(["--etcd", &up.etcd, "--cluster", &cluster, "--id", gone])
            .args(["--listen", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .spawn()
            .expect("restart the worker"),
    );
    let back = wait_status(&up, &format!("return {gone}")).await;
    assert_eq!(back["state"], "done", "{back}");
    assert!(held(&up, gone) > 0, "{gone} got nothing back");
    for (i, r) in traffic(&up.url, 1).await.iter().enumerate() {
        assert_eq!(r[0], baseline[i], "prompt {i} after the return");
    }

    // SIGTERM to a worker: it asks to be drained, the coordinator moves its
    // experts away and clears the request (not putting it in the drained
    // set), and the worker deregisters and exits.
    use epserve_cluster::state::ClusterState;
    use epserve_cluster::store::EtcdStore;
    let state = ClusterState::new(
        Arc::new(EtcdStore::connect(&up.etcd).await.expect("etcd")),
        &cluster,
    );
    let leaving = "expert-2";
    let pid = workers_pid(&up, leaving).await;
    // SAFETY: the worker is a grandchild of this test; SIGTERM asks it to drain.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
    let drained = wait_status(&up, &format!("drain {leaving} (SIGTERM)")).await;
    assert_eq!(drained["state"], "done", "{drained}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let still = state
            .workers("expert")
            .await
            .expect("workers")
            .iter()
            .any(|w| w.id == leaving);
        if !still && state.drain_requests().await.expect("requests").is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{leaving} still registered or its drain request still there 30 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(state.drained().await.expect("drained").is_empty());
    let placement = ctl_ok(&up.admin, &["placement"]);
    let workers: Vec<String> =
        serde_json::from_value(placement["workers"].clone()).expect("workers");
    let idx = workers.iter().position(|w| w == leaving).map(|i| i as u64);
    for l in placement["layers"].as_array().expect("layers") {
        for reps in l["experts"].as_array().expect("experts") {
            let reps = reps.as_array().expect("replicas");
            assert!(
                idx.is_none_or(|i| !reps.contains(&json!(i))),
                "an expert still on {leaving}: {placement}"
            );
        }
    }
    for (i, r) in traffic(&up.url, 1).await.iter().enumerate() {
        assert_eq!(r[0], baseline[i], "prompt {i} after the drain");
    }
}

/// Waits (at most 30 s) until the last rebalance has `reason` and is no
/// longer active; returns `ctl status`.
async fn wait_status(up: &Up, reason: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = ctl_ok(&up.admin, &["status"]);
        if st["reason"] == reason && (st["state"] == "done" || st["state"] == "rolled_back") {
            return st;
        }
        assert!(
            Instant::now() < deadline,
            "no finished rebalance '{reason}' within 30 s: {st}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Experts worker `id` holds in the placement (`ctl workers`).
fn held(up: &Up, id: &str) -> u64 {
    ctl_ok(&up.admin, &["workers"])
        .as_array()
        .expect("workers")
        .iter()
        .find(|w| w["id"] == id)
        .and_then(|w| w["experts"].as_u64())
        .unwrap_or(0)
}
