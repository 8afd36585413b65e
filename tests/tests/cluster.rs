//! The real cluster on loopback: `epserve up` starts etcd, 3 expert-workers
//! (and, in one test, 2 attention-workers) and the coordinator as processes, on
//! fixtures whose expert counts (13, 11) do not divide by 3. Greedy completions
//! must equal transformers' goldens (and the single-process engine's); etcd
//! must show the workers and the placement; and stopping `up` must leave no
//! process behind.
//!
//! Needs `etcd` on PATH; skipped without it unless `EPSERVE_REQUIRE_ETCD=1`
//! (set by `.ci/run`), which makes its absence a failure.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use epserve_cluster::state::ClusterState;
use epserve_cluster::store::{EtcdStore, KvStore};
use epserve_tests::up::{Up, etcd_available};
use epserve_tests::{complete, fixture_dir, golden};
use serde_json::{Value, json};

fn start_up(fixture: &str, workers: usize, dtype: &str) -> Up {
    start_up_with(fixture, workers, dtype, &[])
}

/// `epserve up` with extra arguments (`--attention-workers 2`, `-- COORDINATOR ARGS`).
fn start_up_with(fixture: &str, workers: usize, dtype: &str, extra: &[&str]) -> Up {
    start_up_from(fixture, "f32", workers, dtype, extra)
}

/// [`start_up_with`] on the fixture's `folder` (`f32` or `bf16`).
fn start_up_from(fixture: &str, folder: &str, workers: usize, dtype: &str, extra: &[&str]) -> Up {
    let model = fixture_dir(fixture).join(folder);
    let model = model.to_str().expect("utf-8 fixture path");
    let workers = workers.to_string();
    let mut args = vec![
        "--model",
        model,
        "--expert-workers",
        &workers,
        "--port",
        "0",
    ];
    args.extend(["--dispatch-dtype", dtype, "--served-model-name", "tiny"]);
    args.extend_from_slice(extra);
    Up::start(env!("CARGO_BIN_EXE_epserve-it"), &args, false)
}

/// `fixture`'s goldens through the server at `url` (served as "tiny"): every
/// case's greedy completion one at a time, then the first 16 tokens of all
/// of them at once (several requests share steps).
async fn serves_goldens(url: &str, fixture: &str) {
    let g = golden(fixture);
    let tok =
        epserve_core::loader::tokenizer::Tokenizer::from_dir(&fixture_dir(fixture).join("f32"))
            .expect("tokenizer");
    for case in &g.cases {
        let v = complete(
            url,
            json!({"model": "tiny", "prompt": case.prompt_token_ids, "max_tokens": case.greedy_token_ids.len(),
                   "temperature": 0, "ignore_eos": true}),
        )
        .await;
        let want = tok.decode(&case.greedy_token_ids, true).expect("decode");
        assert_eq!(
            v["choices"][0]["text"].as_str(),
            Some(want.as_str()),
            "case {}",
            case.name
        );
        assert_eq!(v["usage"]["completion_tokens"], case.greedy_token_ids.len());
    }
    // Several requests at once go through the same all-to-all path.
    let futs: Vec<_> = g
        .cases
        .iter()
        .map(|c| {
            let (url, ids) = (url.to_string(), c.prompt_token_ids.clone());
            tokio::spawn(async move {
                complete(&url, json!({"model": "tiny", "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": true})).await
            })
        })
        .collect();
    for (f, c) in futs.into_iter().zip(&g.cases) {
        let v = f.await.expect("join");
        let want = tok.decode(&c.greedy_token_ids[..16], true).expect("decode");
        assert_eq!(
            v["choices"][0]["text"].as_str(),
            Some(want.as_str()),
            "batched case {}",
            c.name
        );
    }
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_expert_workers_match_transformers_and_clean_up() {
    if !etcd_available() {
        return;
    }
    let fixture = "olmoe";
    let g = golden(fixture);
    assert_eq!(
        g.num_experts % 3,
        1,
        "the fixture's expert count must not divide by 3"
    );
    // Steps of several sequences run as two micro-batches in a ping-pong.
    let up = start_up_with(fixture, 3, "f32", &["--", "--micro-batches", "2"]);
    serves_goldens(&up.url, fixture).await;

    // Per-layer balancedness of the worker load over a sliding window is exported.
    let metrics = reqwest::get(format!("{}/metrics", up.url))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    for layer in &g.moe_layers {
        let line = metrics
            .lines()
            .find(|l| l.starts_with(&format!("epserve_eplb_balancedness{{layer=\"{layer}\"}}")))
            .unwrap_or_else(|| panic!("no balancedness for layer {layer}"));
        let v: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|x| x.parse().ok())
            .expect("value");
        assert!(v > 0.0 && v <= 1.0, "{line}");
    }

    // etcd holds the three workers and a placement that covers every expert once.
    let state = up.cluster_state().await;
    let workers = state.workers("expert").await.expect("workers");
    assert_eq!(workers.len(), 3, "{workers:?}");
    let (p, _) = state
        .placement()
        .await
        .expect("placement")
        .expect("a placement");
    p.validate(&g.moe_layers, g.num_experts)
        .expect("valid placement");
    let counts = p.counts();
    assert_eq!(
        counts.iter().sum::<usize>(),
        g.moe_layers.len() * g.num_experts
    );
    assert!(
        counts.iter().max().copied().unwrap_or(0) - counts.iter().min().copied().unwrap_or(0) <= 1,
        "{counts:?}"
    );

    // The admin service reports the same workers and placement.
    let mut admin = epserve_proto::pb::admin_service_client::AdminServiceClient::connect(format!(
        "http://{}",
        up.admin
    ))
    .await
    .expect("admin connect");
    let listed = admin
        .list_workers(epserve_proto::pb::ListWorkersRequest {})
        .await
        .expect("list workers")
        .into_inner()
        .workers;
    assert_eq!(listed.len(), 3);
    assert_eq!(
        listed.iter().map(|w| w.experts as usize).sum::<usize>(),
        g.moe_layers.len() * g.num_experts
    );
    let pl = admin
        .get_placement(epserve_proto::pb::GetPlacementRequest {})
        .await
        .expect("placement")
        .into_inner();
    assert_eq!(pl.version, p.version);

    // Stopping `up` stops every process it started.
    let pids: Vec<u32> = workers.iter().map(|w| w.pid).collect();
    drop(up);
    let deadline = Instant::now() + Duration::from_secs(15);
    while pids.iter().any(|&p| pid_alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        pids.iter().all(|&p| !pid_alive(p)),
        "orphaned workers: {pids:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_dispatch_serves_and_a_dead_worker_gives_a_clear_error() {
    if !etcd_available() {
        return;
    }
    let up = start_up("qwen3_moe_a", 2, "bf16");
    let v = complete(
        &up.url,
        json!({"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": true}),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 8);
    // Kill one worker: requests fail with an error naming it, the server stays up.
    let store = EtcdStore::connect(&up.etcd).await.expect("etcd");
    let keys = store.list("/epserve/").await.expect("list");
    let info: epserve_cluster::state::WorkerInfo = keys
        .iter()
        .find(|(k, _)| k.contains("/workers/expert/"))
        .and_then(|(_, v)| serde_json::from_slice(v).ok())
        .expect("a worker");
    // SAFETY: the worker is a grandchild of this test; SIGKILL simulates a crash.
    unsafe {
        libc::kill(info.pid as libc::pid_t, libc::SIGKILL);
    }
    std::thread::sleep(Duration::from_millis(300));
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", up.url))
        .json(&json!({"model": "tiny", "prompt": "hello", "max_tokens": 4}))
        .send()
        .await
        .expect("send");
    // The coordinator answers a retryable 503 naming the worker whose
    // experts have no live replica; never a hang or a crash of the test.
    let status = resp.status();
    if let Ok(text) = resp.text().await
        && let Ok(v) = serde_json::from_str::<Value>(&text)
        && v.get("error").is_some()
    {
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(status, reqwest::StatusCode::SERVICE_UNAVAILABLE, "{msg}");
        assert!(msg.contains(&info.id), "{msg}");
        // /health says which experts are unserved.
        let h = reqwest::get(format!("{}/health", up.url))
            .await
            .expect("health");
        assert_eq!(h.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
    }
}

/// `Cpus_allowed_list` of a process (`0-1`, `1`), from /proc.
fn cpus_allowed(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list")
        .trim()
        .to_string()
}

/// Values of the samples of `name` whose labels contain `label`, in the
/// exporter's order (which is a hash order: do not pair two such lists by
/// index, use [`gauge_by_worker`]).
fn gauge_with(metrics: &str, name: &str, label: &str) -> Vec<f64> {
    sample_lines(metrics, name, label)
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .collect()
}

/// The sample lines of `name` whose labels contain `label`.
fn sample_lines<'a>(
    metrics: &'a str,
    name: &'a str,
    label: &'a str,
) -> impl Iterator<Item = &'a str> + 'a {
    let prefix = format!("{name}{{");
    metrics
        .lines()
        .filter(move |l| l.starts_with(&prefix) && l.contains(label))
}

/// [`gauge_with`] keyed by each sample's `worker` label.
fn gauge_by_worker(metrics: &str, name: &str, label: &str) -> BTreeMap<String, f64> {
    sample_lines(metrics, name, label)
        .filter_map(|l| {
            let worker = l.split("worker=\"").nth(1)?.split('"').next()?;
            let v = l.rsplit(' ').next()?.parse::<f64>().ok()?;
            Some((worker.to_string(), v))
        })
        .collect()
}

/// Issue 21: `up --expert-memory` with a budget that holds a third of each
/// worker's experts (bf16-exact packing of the f32 fixture, f32 wire): the
/// greedy tokens are transformers' goldens all the same, the workers page
/// experts in and evict them (tier counters in the coordinator's
/// `/metrics`), the packed bytes each reports never exceed its budget, and
/// the router lookahead's prefetch hints reach them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expert_memory_budget_of_a_third_keeps_the_goldens() {
    if !etcd_available() {
        return;
    }
    let fixture = "qwen3_moe_b";
    let dir = fixture_dir(fixture).join("f32");
    // The packed size of every expert, as the workers pack them.
    let cfg = epserve_core::config::ModelConfig::from_dir(&dir).expect("config");
    let ws = epserve_core::loader::weights::WeightStore::open(&dir).expect("weights");
    let all = epserve_core::experts::PackedExperts::load_filtered(
        &cfg,
        &ws,
        &epserve_core::experts::LoadOptions {
            threads: Some(1),
            ..Default::default()
        },
        &|_, _| true,
    )
    .expect("pack")
    .resident_bytes();
    let workers = 2;
    let budget = all / workers / 3;
    let budget_arg = budget.to_string();
    let up = start_up_with(
        fixture,
        workers,
        "f32",
        &["--expert-memory", &budget_arg, "--", "--max-num-seqs", "4"],
    );
    // Concurrent requests too: calls whose cold experts do not fit run in groups.
    serves_goldens(&up.url, fixture).await;
    let metrics = reqwest::get(format!("{}/metrics", up.url))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let misses = counter_sum(&metrics, "epserve_expert_tier_misses_total");
    let evictions = counter_sum(&metrics, "epserve_expert_tier_evictions_total");
    let hits = counter_sum(&metrics, "epserve_expert_tier_hits_total");
    let paged = counter_sum(&metrics, "epserve_expert_tier_paged_in_bytes_total");
    let prefetched = counter_sum(&metrics, "epserve_expert_tier_prefetch_hinted_total");
    assert!(
        misses > 0 && evictions > 0 && hits > 0 && paged > 0,
        "misses {misses}, evictions {evictions}, hits {hits}, paged {paged}"
    );
    assert!(
        prefetched > 0,
        "the lookahead's hints were used: {prefetched}"
    );
    let budgets = gauge_with(&metrics, "epserve_expert_tier_budget_bytes", "worker=");
    assert_eq!(budgets, vec![budget as f64; workers], "{metrics}");
    // Paired by worker: the exporter lists label sets in hash order, so the
    // n-th resident sample and the n-th cached one may be two workers'.
    let resident = gauge_by_worker(&metrics, "epserve_expert_tier_bytes", "tier=\"resident\"");
    let cached = gauge_by_worker(&metrics, "epserve_expert_tier_bytes", "tier=\"cached\"");
    assert_eq!(resident.len(), workers, "{metrics}");
    assert_eq!(
        resident.keys().collect::<Vec<_>>(),
        cached.keys().collect::<Vec<_>>(),
        "{metrics}"
    );
    for (w, r) in &resident {
        let c = cached[w];
        assert!(
            r + c <= budget as f64,
            "worker {w}: resident {r} + cached {c} > budget {budget}"
        );
    }
    let cold = gauge_with(&metrics, "epserve_expert_tier_experts", "tier=\"cold\"");
    assert!(
        cold.iter().sum::<f64>() > 0.0,
        "some experts are cold: {cold:?}"
    );
    // `ctl load`'s data: every replica of the placement with its worker's
    // tier and precision, the tiers as the metrics count them.
    let mut admin = epserve_proto::pb::admin_service_client::AdminServiceClient::connect(format!(
        "http://{}",
        up.admin
    ))
    .await
    .expect("admin connect");
    let load = admin
        .get_expert_load(epserve_proto::pb::GetExpertLoadRequest {})
        .await
        .expect("expert load")
        .into_inner();
    let replicas: Vec<_> = load.layers.iter().flat_map(|l| &l.replicas).collect();
    assert_eq!(replicas.len(), cfg.moe_layers().len() * cfg.num_experts);
    let count = |tier: &str| replicas.iter().filter(|r| r.tier == tier).count() as f64;
    assert_eq!(
        count("cold") + count("cached") + count("resident"),
        replicas.len() as f64,
        "{replicas:?}"
    );
    assert!(count("cold") > 0.0, "{replicas:?}");
    assert!(
        replicas.iter().all(|r| !r.precision.is_empty()),
        "{replicas:?}"
    );
}

/// `up --emulate-link 1ms` with pinned roles on `qwen3_moe_a` (2
/// expert-workers, 1 attention-worker, f32 on the wire): every worker
/// registers its link emulator's address, so the coordinator's calls cross
/// the emulated link, and the greedy tokens are the goldens all the same
/// (the other tests show the same without the emulator). The coordinator
/// runs on the core `--coordinator-cores` names, each worker on its own
/// `--worker-cores` list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_links_keep_the_tokens_and_roles_are_pinned() {
    if !etcd_available() {
        return;
    }
    // The first and the last core this test may use (the same on one core).
    let mine = cpus_allowed(std::process::id());
    let ends: Vec<usize> = mine
        .split([',', '-'])
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    let (first, last) = (ends[0], ends[ends.len() - 1]);
    let (c_cores, w_cores) = (last.to_string(), format!("{first}/{last}/{first}"));
    let fixture = "qwen3_moe_a";
    let g = golden(fixture);
    let up = start_up_with(
        fixture,
        2,
        "f32",
        &[
            "--attention-workers",
            "1",
            "--emulate-link",
            "1ms",
            "--coordinator-cores",
            &c_cores,
            "--worker-cores",
            &w_cores,
        ],
    );
    let coordinator = up.pid("coordinator").expect("coordinator pid");
    assert_eq!(cpus_allowed(coordinator), c_cores);
    for (name, want) in [
        ("expert-0", first),
        ("expert-1", last),
        ("attention-0", first),
    ] {
        let pid = up.pid(name).expect("worker pid");
        assert_eq!(cpus_allowed(pid), want.to_string(), "{name}");
    }
    // Each worker advertises its emulator, which forwards to the port the
    // worker bound (`--listen` port 0) once its serving line says which.
    let links_now = || -> Vec<(String, String, String)> {
        let log = up.log.lock().unwrap_or_else(|e| e.into_inner());
        log.lines
            .iter()
            .filter_map(|(_, l)| l.strip_prefix("epserve up: link emulator for "))
            .filter_map(|rest| {
                let (name, rest) = rest.split_once(": ")?;
                let (addr, to) = rest.split_once(" -> ")?;
                Some((name.to_string(), addr.to_string(), to.to_string()))
            })
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut links = links_now();
    while links.len() < 3 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        links = links_now();
    }
    assert_eq!(links.len(), 3, "{links:?}");
    for (name, addr, to) in &links {
        assert_ne!(addr, to, "{name}");
    }
    let links: Vec<(String, String)> = links.into_iter().map(|(n, a, _)| (n, a)).collect();
    let store = EtcdStore::connect(&up.etcd).await.expect("etcd");
    let keys = store.list("/epserve/").await.expect("list");
    for (name, addr) in &links {
        let info: epserve_cluster::state::WorkerInfo = keys
            .iter()
            .filter(|(k, _)| k.contains("/workers/"))
            .filter_map(|(_, v)| serde_json::from_slice(v).ok())
            .find(|w: &epserve_cluster::state::WorkerInfo| &w.id == name)
            .unwrap_or_else(|| panic!("{name} registered"));
        assert_eq!(info.addr, format!("http://{addr}"), "{name}");
    }
    let tok =
        epserve_core::loader::tokenizer::Tokenizer::from_dir(&fixture_dir(fixture).join("f32"))
            .expect("tokenizer");
    for case in g.cases.iter().take(2) {
        let n = 12.min(case.greedy_token_ids.len());
        let v = complete(
            &up.url,
            json!({"model": "tiny", "prompt": case.prompt_token_ids, "max_tokens": n,
                   "temperature": 0, "ignore_eos": true}),
        )
        .await;
        let want = tok
            .decode(&case.greedy_token_ids[..n], true)
            .expect("decode");
        assert_eq!(
            v["choices"][0]["text"].as_str(),
            Some(want.as_str()),
            "case {}",
            case.name
        );
    }
}

/// Sum of a counter's series in a Prometheus text exposition.
fn counter_sum(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// `--dispatch-dtype int8`, with 2 attention-workers (they get bf16): served,
/// the first greedy token of every golden case as transformers gives it (the
/// agreement over whole generations is measured in `tests/experts.rs`), and
/// the byte counters show int8 rows (hidden + a 4-byte scale per token) sent
/// to the expert-workers and bf16 slots (2 x hidden) returned (the attention
/// shards' counter only checked to be whole bf16 rows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn int8_dispatch_serves() {
    if !etcd_available() {
        return;
    }
    let fixture = "qwen3_moe_a";
    let g = golden(fixture);
    let up = start_up_with(fixture, 2, "int8", &["--attention-workers", "2"]);
    let tok =
        epserve_core::loader::tokenizer::Tokenizer::from_dir(&fixture_dir(fixture).join("f32"))
            .expect("tokenizer");
    for case in &g.cases {
        let v = complete(
            &up.url,
            json!({"model": "tiny", "prompt": case.prompt_token_ids, "max_tokens": 1,
                   "temperature": 0, "ignore_eos": true}),
        )
        .await;
        let want = tok
            .decode(&case.greedy_token_ids[..1], true)
            .expect("decode");
        assert_eq!(
            v["choices"][0]["text"].as_str(),
            Some(want.as_str()),
            "case {}",
            case.name
        );
    }
    let v = complete(
        &up.url,
        json!({"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": true}),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 8);
    let metrics = reqwest::get(format!("{}/metrics", up.url))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let hidden = 64u64; // qwen3_moe_a
    let sent = counter_sum(&metrics, "epserve_dispatch_bytes_sent_total");
    let received = counter_sum(&metrics, "epserve_dispatch_bytes_received_total");
    assert!(sent > 0 && received > 0, "sent {sent}, received {received}");
    assert_eq!(sent % (hidden + 4), 0, "int8 rows + scales: {sent}");
    assert_eq!(received % (2 * hidden), 0, "bf16 slots: {received}");
    let attn = counter_sum(&metrics, "epserve_attention_bytes_sent_total");
    assert!(
        attn > 0 && attn.is_multiple_of(2 * hidden),
        "bf16 to attention: {attn}"
    );
}

/// Coordinator + 3 expert-workers + 2 attention-workers (tensor-parallel
/// attention, f32 on the wire) on `qwen3_moe_b` (11 experts). The
/// shards' KV caches hold 160 positions, less than the three prompts together
/// need, so concurrent requests are preempted and recomputed (their remote KV
/// released and truncated) and must still give the same tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attention_workers_match_transformers_and_the_single_process_engine() {
    if !etcd_available() {
        return;
    }
    let fixture = "qwen3_moe_b";
    let g = golden(fixture);
    assert_ne!(g.num_experts % 3, 0);
    let dir = fixture_dir(fixture).join("f32");
    let engine = epserve_core::engine::Engine::load(&dir).expect("engine");
    let up = start_up_with(
        fixture,
        3,
        "f32",
        &[
            "--attention-workers",
            "2",
            "--attention-kv-cache-memory",
            "160KiB",
            "--",
            "--max-model-len",
            "128",
            "--micro-batches",
            "2",
        ],
    );
    let mut want = Vec::new();
    for case in &g.cases {
        let single = engine
            .generate(&epserve_core::engine::GenerateRequest {
                prompt_token_ids: case.prompt_token_ids.clone(),
                max_tokens: case.greedy_token_ids.len(),
                sampling: epserve_core::sampling::SamplingParams::default(),
                stop: vec![],
                ignore_eos: true,
            })
            .expect("single process");
        assert_eq!(
            single.token_ids, case.greedy_token_ids,
            "case {}",
            case.name
        );
        let golden_text = engine
            .tokenizer
            .decode(&case.greedy_token_ids, true)
            .expect("decode");
        assert_eq!(single.text, golden_text);
        want.push(golden_text);
    }
    let body = |ids: &[u32], n: usize| json!({"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": true});
    for (case, want) in g.cases.iter().zip(&want) {
        let v = complete(
            &up.url,
            body(&case.prompt_token_ids, case.greedy_token_ids.len()),
        )
        .await;
        assert_eq!(
            v["choices"][0]["text"].as_str(),
            Some(want.as_str()),
            "case {}",
            case.name
        );
    }
    // Twice every case at once: 6 sequences on 10 KV blocks per shard.
    let futs: Vec<_> = g
        .cases
        .iter()
        .chain(&g.cases)
        .map(|c| {
            let (url, b) = (
                up.url.clone(),
                body(&c.prompt_token_ids, c.greedy_token_ids.len()),
            );
            tokio::spawn(async move { complete(&url, b).await })
        })
        .collect();
    for (f, w) in futs.into_iter().zip(want.iter().chain(&want)) {
        let v = f.await.expect("join");
        assert_eq!(
            v["choices"][0]["text"].as_str(),
            Some(w.as_str()),
            "concurrent"
        );
    }
    let metrics = reqwest::get(format!("{}/metrics", up.url))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let value = |prefix: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next().and_then(|x| x.parse::<f64>().ok()))
            .sum()
    };
    assert!(
        value("epserve_num_preemptions_total") > 0.0,
        "the small shard caches should have forced a preemption"
    );
    // Prefix caching is on with attention-workers: the repeated prompts hit.
    assert!(
        value("epserve_prefix_cache_hits_total") > 0.0,
        "the repeated prompts should have hit the prefix cache"
    );
    for w in ["attention-0", "attention-1"] {
        assert!(
            value(&format!(
                "epserve_attention_bytes_sent_total{{worker=\"{w}\"}}"
            )) > 0.0
        );
        assert!(
            value(&format!(
                "epserve_attention_bytes_received_total{{worker=\"{w}\"}}"
            )) > 0.0
        );
    }
    for layer in 0..g.num_layers {
        assert!(
            value(&format!(
                "epserve_attention_seconds_count{{layer=\"{layer}\"}}"
            )) > 0.0
        );
    }

    // etcd lists both shards (and the expert-workers).
    let state = up.cluster_state().await;
    let shards = state.workers("attention").await.expect("attention workers");
    assert_eq!(
        shards.iter().map(|w| w.shard).collect::<Vec<_>>(),
        vec![Some((0, 2)), Some((1, 2))],
        "{shards:?}"
    );
    let experts = state.workers("expert").await.expect("expert workers");
    assert_eq!(experts.len(), 3);

    // The shards hold no sequence once everything finished (releases reached them).
    for w in &shards {
        let mut c = epserve_proto::pb::attention_service_client::AttentionServiceClient::connect(
            w.addr.clone(),
        )
        .await
        .expect("connect shard");
        let h = c
            .health(epserve_proto::pb::HealthRequest::default())
            .await
            .expect("health")
            .into_inner();
        assert_eq!(h.sequences, 0, "{} still holds sequences", w.id);
        assert_eq!(h.kv_blocks_free, h.kv_blocks_total);
    }

    // Stopping `up` stops every process it started.
    let pids: Vec<u32> = shards.iter().chain(&experts).map(|w| w.pid).collect();
    drop(up);
    let deadline = Instant::now() + Duration::from_secs(15);
    while pids.iter().any(|&p| pid_alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        pids.iter().all(|&p| !pid_alive(p)),
        "orphaned workers: {pids:?}"
    );
}

/// The architectures whose attention needs more than slicing GQA heads, on 2
/// attention-workers with the coordinator's `--block-size 8` passed on by
/// `up`: OLMoE (q/k norm over the whole projection; 13 experts over 3
/// expert-workers) and DeepSeek-V3 (multi-head latent attention). Greedy text
/// equals the transformers goldens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attention_workers_serve_olmoe_and_latent_attention() {
    if !etcd_available() {
        return;
    }
    for fixture in ["olmoe", "deepseek_v3"] {
        let g = golden(fixture);
        let dir = fixture_dir(fixture).join("f32");
        let tok = epserve_core::engine::Engine::load(&dir).expect("engine");
        let up = start_up_with(
            fixture,
            3,
            "f32",
            &["--attention-workers", "2", "--", "--block-size", "8"],
        );
        for case in &g.cases {
            let want = tok
                .tokenizer
                .decode(&case.greedy_token_ids, true)
                .expect("decode");
            let v = complete(
                &up.url,
                json!({"model": "tiny", "prompt": case.prompt_token_ids, "max_tokens": case.greedy_token_ids.len(), "temperature": 0, "ignore_eos": true}),
            )
            .await;
            assert_eq!(
                v["choices"][0]["text"].as_str(),
                Some(want.as_str()),
                "{fixture} case {}",
                case.name
            );
        }
        drop(up);
    }
}

/// Prefix caching through 2 attention-workers (their KV caches follow the
/// coordinator's block ids): requests sharing a prefix reuse its blocks on
/// every shard, outputs equal the single-process engine's (no cache) and
/// repeat exactly, the hit metric counts the shared blocks, and a different
/// `cache_salt` shares nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_caching_through_attention_workers() {
    if !etcd_available() {
        return;
    }
    let fixture = "qwen3_moe_b";
    let g = golden(fixture);
    let dir = fixture_dir(fixture).join("f32");
    let engine = epserve_core::engine::Engine::load(&dir).expect("engine");
    let up = start_up_with(
        fixture,
        2,
        "f32",
        &["--attention-workers", "2", "--", "--block-size", "8"],
    );
    // A 37-token prefix (4 full blocks of 8) and two different endings.
    let prefix = g
        .cases
        .iter()
        .max_by_key(|c| c.prompt_token_ids.len())
        .expect("cases")
        .prompt_token_ids
        .clone();
    let a = [prefix.clone(), vec![11, 12, 13]].concat();
    let b = [prefix.clone(), vec![21, 22]].concat();
    let want = |p: &[u32]| {
        engine
            .generate(&epserve_core::engine::GenerateRequest {
                prompt_token_ids: p.to_vec(),
                max_tokens: 12,
                sampling: epserve_core::sampling::SamplingParams::default(),
                stop: vec![],
                ignore_eos: true,
            })
            .expect("single process")
            .text
    };
    let hits = || async {
        let m = reqwest::get(format!("{}/metrics", up.url))
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text");
        counter_sum(&m, "epserve_prefix_cache_hits_total")
    };
    let run = |p: &[u32], salt: Option<&str>| {
        let mut body = json!({"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        let url = up.url.clone();
        async move {
            complete(&url, body).await["choices"][0]["text"]
                .as_str()
                .expect("text")
                .to_string()
        }
    };
    let (want_a, want_b) = (want(&a), want(&b));
    assert_eq!(run(&a, None).await, want_a);
    let h0 = hits().await;
    // b shares a's 4 full prefix blocks (32 tokens) on both shards.
    assert_eq!(run(&b, None).await, want_b);
    let h1 = hits().await;
    assert!(h1 >= h0 + 32, "hits {h0} -> {h1}");
    // a again: its prefix and its own blocks are cached; same text.
    assert_eq!(run(&a, None).await, want_a);
    assert!(hits().await >= h1 + 32);
    // Another salt shares nothing, and gives the same text.
    let h2 = hits().await;
    assert_eq!(run(&a, Some("tenant-1")).await, want_a);
    assert_eq!(hits().await, h2, "a salted request hit unsalted blocks");
    assert_eq!(run(&b, Some("tenant-1")).await, want_b);
    assert!(hits().await >= h2 + 32, "the same salt shares");
    // Concurrent requests sharing the prefix: still exact.
    let futs: Vec<_> = (0..4)
        .map(|i| {
            let p = if i % 2 == 0 { a.clone() } else { b.clone() };
            let url = up.url.clone();
            tokio::spawn(async move {
                complete(&url, json!({"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": true})).await
            })
        })
        .collect();
    for (i, f) in futs.into_iter().enumerate() {
        let v = f.await.expect("join");
        let w = if i % 2 == 0 { &want_a } else { &want_b };
        assert_eq!(v["choices"][0]["text"].as_str(), Some(w.as_str()));
    }
    drop(up);
}

/// An attention-worker that restarts on another port (same id, a new
/// registration in etcd) is picked up by the running coordinator: the next
/// request goes to the new address and gives the golden text. (Same KV
/// budget as `up` gave it: a smaller one is refused.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_attention_worker_is_followed() {
    if !etcd_available() {
        return;
    }
    let fixture = "qwen3_moe_b";
    let g = golden(fixture);
    let dir = fixture_dir(fixture).join("f32");
    let tok = epserve_core::engine::Engine::load(&dir).expect("engine");
    let case = &g.cases[0];
    let want = tok
        .tokenizer
        .decode(&case.greedy_token_ids, true)
        .expect("decode");
    let body = json!({"model": "tiny", "prompt": case.prompt_token_ids, "max_tokens": case.greedy_token_ids.len(), "temperature": 0, "ignore_eos": true});
    let up = start_up_with(fixture, 2, "f32", &["--attention-workers", "2"]);
    let v = complete(&up.url, body.clone()).await;
    assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()));

    let cluster = up.cluster_name().await;
    let state = up.cluster_state().await;
    let old = state
        .workers("attention")
        .await
        .expect("attention workers")
        .into_iter()
        .find(|w| w.shard == Some((1, 2)))
        .expect("shard 1");
    // SAFETY: signalling a worker process this test's `up` started.
    unsafe {
        libc::kill(old.pid as libc::pid_t, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while pid_alive(old.pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    /// Stops the restarted worker however the test ends.
    struct Kill(Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _again = Kill(
        Command::new(env!("CARGO_BIN_EXE_epserve-it"))
            .args(["attention-worker", "--model"])
            .arg(&dir)
            .args(["--etcd", &up.etcd, "--cluster", &cluster, "--id", &old.id])
            .args(["--shard", "1", "--of", "2", "--kv-cache-memory", "1GiB"])
            .args(["--listen", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .spawn()
            .expect("restart the attention-worker"),
    );
    // The coordinator polls etcd every second: retry until it follows.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = Value::Null;
    while Instant::now() < deadline {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/completions", up.url))
            .json(&body)
            .send()
            .await
            .expect("send");
        last = serde_json::from_str(&r.text().await.expect("body")).unwrap_or(Value::Null);
        if last["choices"][0]["text"].as_str() == Some(want.as_str()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        last["choices"][0]["text"].as_str(),
        Some(want.as_str()),
        "{last}"
    );
    drop(up);
}

/// Whether `sig` is set in the hex signal mask `field` (`SigBlk`, `SigIgn`) of
/// /proc/PID/status; None when the process is gone.
fn proc_sig_bit(pid: u32, field: &str, sig: libc::c_int) -> Option<bool> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .trim();
    let mask = u64::from_str_radix(hex, 16).ok()?;
    Some(mask & (1u64 << (sig - 1)) != 0)
}

/// Starts `up` (1 expert-worker) with SIGINT ignored, as a non-interactive
/// shell starts a background job, sends it `sig`, and checks the orderly
/// stop: `up` exits 0 within 30 s, none of its children (etcd, worker,
/// coordinator) survives, and the temporary etcd data dir is gone.
fn up_stops_on(sig: libc::c_int) {
    let model = fixture_dir("qwen3_moe_a").join("f32");
    let model = model.to_str().expect("utf-8 fixture path");
    let args = ["--model", model, "--expert-workers", "1", "--port", "0"];
    let mut up = Up::start_with(env!("CARGO_BIN_EXE_epserve-it"), &args, false, |c| {
        // SAFETY: signal(2) in the forked child before exec; async-signal-safe.
        unsafe {
            c.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_IGN);
                Ok(())
            });
        }
    });
    let pid = up.child.id();
    let dir = up
        .etcd_data_dir
        .clone()
        .expect("up reports its etcd data dir");
    assert!(dir.is_dir(), "{} missing while running", dir.display());
    let kids = up.children();
    assert_eq!(kids.len(), 3, "etcd, expert-worker, coordinator: {kids:?}");
    for &k in &kids {
        for s in [libc::SIGINT, libc::SIGTERM] {
            assert_eq!(
                proc_sig_bit(k, "SigBlk", s),
                Some(false),
                "child {k} inherited signal {s} blocked"
            );
            assert_eq!(
                proc_sig_bit(k, "SigIgn", s),
                Some(false),
                "child {k} inherited signal {s} ignored"
            );
        }
    }

    // SAFETY: signalling our own child.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        match up.child.try_wait().expect("wait for up") {
            Some(s) => break s,
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            None => {
                let _ = up.child.kill();
                let _ = up.child.wait();
                panic!("`epserve up` still running 30 s after signal {sig}");
            }
        }
    };
    assert_eq!(
        status.code(),
        Some(0),
        "signal {sig}: `up` did not take its orderly stop ({status})"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while kids.iter().any(|&k| pid_alive(k)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let alive: Vec<u32> = kids.iter().copied().filter(|&k| pid_alive(k)).collect();
    assert!(
        alive.is_empty(),
        "signal {sig}: children survived: {alive:?}"
    );
    assert!(
        !dir.exists(),
        "signal {sig}: etcd data dir {} left behind",
        dir.display()
    );
}

#[test]
fn sigint_and_sigterm_stop_up_cleanly_even_with_sigint_ignored() {
    if !etcd_available() {
        return;
    }
    up_stops_on(libc::SIGINT);
    up_stops_on(libc::SIGTERM);
}

/// A worker process with its stdout lines on a channel and stderr piped.
struct Worker {
    role: &'static str,
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Worker {
    fn start(role: &'static str, etcd: &str, cluster: &str, extra: &[&str]) -> Worker {
        let model = fixture_dir("qwen3_moe_a").join("f32");
        let mut child = Command::new(env!("CARGO_BIN_EXE_epserve-it"))
            .arg(role)
            .arg("--model")
            .arg(&model)
            .args([
                "--etcd",
                etcd,
                "--cluster",
                cluster,
                "--listen",
                "127.0.0.1:0",
            ])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn worker");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
                let _ = tx.send(line);
            }
        });
        let mut w = Worker { role, child, lines };
        let serving = w.wait_line("serving", Duration::from_secs(60));
        // `--listen 127.0.0.1:0`: the port bound is the one advertised.
        let port = serving
            .split_once("at 127.0.0.1:")
            .and_then(|(_, r)| {
                r.split(|c: char| !c.is_ascii_digit())
                    .next()
                    .and_then(|p| p.parse::<u16>().ok())
            })
            .unwrap_or(0);
        assert_ne!(port, 0, "{role} advertised no bound port: {serving}");
        w
    }

    fn wait_line(&mut self, what: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(what) => return line,
                Ok(_) => {}
                Err(_) => panic!("no '{what}' from the {} within {limit:?}", self.role),
            }
        }
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, sig);
        }
    }

    /// Waits (bounded) for the exit; returns the status and stderr.
    fn wait_exit(&mut self, limit: Duration) -> (std::process::ExitStatus, String) {
        let deadline = Instant::now() + limit;
        let status = loop {
            match self.child.try_wait().expect("wait") {
                Some(s) => break s,
                None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
                None => panic!("{} still running after {limit:?}", self.role),
            }
        };
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        (status, err)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls (up to `limit`) until `role`'s registered ids in `cluster` are `want`.
async fn registered_becomes(etcd: &str, cluster: &str, role: &str, want: &[&str], limit: Duration) {
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    while Instant::now() < deadline {
        if let Ok(store) = EtcdStore::connect(etcd).await {
            let state = ClusterState::new(Arc::new(store), cluster);
            if let Ok(ws) = state.workers(role).await {
                got = ws.into_iter().map(|w| w.id).collect::<Vec<_>>();
                if got == want {
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{role} workers in etcd: {got:?}, want {want:?}");
}

/// Workers never exit because etcd is away: with etcd gone far longer than
/// `--etcd-timeout-secs` (now only the limit of the first connect) and than
/// their lease TTL, both roles keep running, and when etcd returns (restarted,
/// or resumed after a pause past the TTL) they are registered again. Then SIGTERM stops an expert-worker that holds no
/// experts at once (exit 0), removing its registration right away, and
/// SIGINT stops the attention-worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_outlive_etcd_and_register_again_when_it_returns() {
    if !etcd_available() {
        return;
    }
    let mut etcd = epserve_tests::up::Etcd::start();
    let limits = ["--etcd-timeout-secs", "2", "--lease-ttl-secs", "2"];
    let mut att = Worker::start(
        "attention-worker",
        &etcd.addr,
        "gone",
        &[&limits[..], &["--shard", "0", "--of", "1", "--id", "att"]].concat(),
    );
    let mut exp = Worker::start(
        "expert-worker",
        &etcd.addr,
        "gone",
        &[&limits[..], &["--id", "exp"]].concat(),
    );
    registered_becomes(
        &etcd.addr,
        "gone",
        "expert",
        &["exp"],
        Duration::from_secs(10),
    )
    .await;

    etcd.kill();
    // 3x the old give-up limit, and past the lease TTL.
    tokio::time::sleep(Duration::from_secs(7)).await;
    for w in [&mut att, &mut exp] {
        assert!(
            w.child.try_wait().expect("wait").is_none(),
            "{} exited while etcd was away",
            w.role
        );
    }
    etcd.restart_after(Duration::ZERO);
    registered_becomes(
        &etcd.addr,
        "gone",
        "expert",
        &["exp"],
        Duration::from_secs(20),
    )
    .await;
    registered_becomes(
        &etcd.addr,
        "gone",
        "attention",
        &["att"],
        Duration::from_secs(20),
    )
    .await;

    // etcd paused (SIGSTOP) past the lease TTL: when it resumes its leases
    // have expired; the workers' keepers register them again.
    let pid = etcd.child.id() as libc::pid_t;
    // SAFETY: signalling our own child (etcd).
    unsafe {
        libc::kill(pid, libc::SIGSTOP);
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    // SAFETY: as above.
    unsafe {
        libc::kill(pid, libc::SIGCONT);
    }
    for w in [&mut att, &mut exp] {
        assert!(
            w.child.try_wait().expect("wait").is_none(),
            "{} exited while etcd was paused",
            w.role
        );
    }
    registered_becomes(
        &etcd.addr,
        "gone",
        "expert",
        &["exp"],
        Duration::from_secs(20),
    )
    .await;
    registered_becomes(
        &etcd.addr,
        "gone",
        "attention",
        &["att"],
        Duration::from_secs(20),
    )
    .await;

    exp.signal(libc::SIGTERM);
    let (status, err) = exp.wait_exit(Duration::from_secs(15));
    assert_eq!(
        status.code(),
        Some(0),
        "expert-worker on SIGTERM: {status}; stderr: {err}"
    );
    // Deregistered at once (the lease alone would take 2 s).
    registered_becomes(
        &etcd.addr,
        "gone",
        "expert",
        &[],
        Duration::from_millis(500),
    )
    .await;
    att.signal(libc::SIGINT);
    let (status, err) = att.wait_exit(Duration::from_secs(15));
    assert_eq!(
        status.code(),
        Some(0),
        "attention-worker on SIGINT: {status}; stderr: {err}"
    );
}

/// SIGTERM drains an expert-worker that holds experts: it asks for a drain
/// (a drain request in etcd), keeps running while its experts are still
/// assigned to it, and exits 0 once the placement (here moved by the test,
/// as the coordinator's controller would) no longer gives it any, without
/// its registration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_an_expert_worker_before_it_exits() {
    if !etcd_available() {
        return;
    }
    let etcd = epserve_tests::up::Etcd::start();
    let extra = ["--drop-grace-ms", "200", "--drain-timeout-secs", "60"];
    let mut a = Worker::start(
        "expert-worker",
        &etcd.addr,
        "drain",
        &[&extra[..], &["--id", "a"]].concat(),
    );
    let mut b = Worker::start(
        "expert-worker",
        &etcd.addr,
        "drain",
        &[&extra[..], &["--id", "b"]].concat(),
    );
    let store = EtcdStore::connect(&etcd.addr).await.expect("etcd");
    let state = ClusterState::new(Arc::new(store), "drain");
    let g = golden("qwen3_moe_a");
    let placement = |ids: &[&str], version| {
        let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        let mut p = epserve_core::placement::Placement::initial(&g.moe_layers, g.num_experts, &ids)
            .expect("placement");
        p.version = version;
        p
    };
    state
        .init_placement(&placement(&["a", "b"], 1))
        .await
        .expect("placement");
    a.wait_line("holds", Duration::from_secs(30));
    b.wait_line("holds", Duration::from_secs(30));

    a.signal(libc::SIGTERM);
    a.wait_line("draining", Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let reqs = state.drain_requests().await.expect("drain requests");
        if let Some((_, r)) = reqs.iter().find(|(id, _)| id == "a") {
            assert_eq!(r.reason, "SIGTERM");
            break;
        }
        assert!(Instant::now() < deadline, "no drain request from a");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        a.child.try_wait().expect("wait").is_none(),
        "a exited before its experts moved"
    );

    // The controller's part: every expert to b, then the request deleted.
    let rev = state
        .placement()
        .await
        .expect("placement")
        .map(|(_, r)| r)
        .unwrap_or(0);
    assert!(
        state
            .swap_placement(rev, &placement(&["b"], 2))
            .await
            .expect("swap")
    );
    state.clear_drain_request("a").await.expect("clear");
    a.wait_line("drained; stopping", Duration::from_secs(15));
    let (status, err) = a.wait_exit(Duration::from_secs(15));
    assert_eq!(
        status.code(),
        Some(0),
        "a on SIGTERM: {status}; stderr: {err}"
    );
    registered_becomes(
        &etcd.addr,
        "drain",
        "expert",
        &["b"],
        Duration::from_millis(500),
    )
    .await;
    assert!(
        state
            .drain_requests()
            .await
            .expect("drain requests")
            .is_empty()
    );
}

/// A drain nobody handles (no coordinator) ends at `--drain-timeout-secs`
/// with the reason on stdout, and a second signal during a drain stops the
/// worker at once; either way it exits 0, withdraws its drain request and
/// deregisters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhandled_drain_times_out_and_a_second_signal_cuts_it_short() {
    if !etcd_available() {
        return;
    }
    let etcd = epserve_tests::up::Etcd::start();
    let mut a = Worker::start(
        "expert-worker",
        &etcd.addr,
        "unhandled",
        &["--id", "a", "--drain-timeout-secs", "2"],
    );
    let mut b = Worker::start("expert-worker", &etcd.addr, "unhandled", &["--id", "b"]);
    let store = EtcdStore::connect(&etcd.addr).await.expect("etcd");
    let state = ClusterState::new(Arc::new(store), "unhandled");
    let g = golden("qwen3_moe_a");
    let ids: Vec<String> = vec!["a".into(), "b".into()];
    let p = epserve_core::placement::Placement::initial(&g.moe_layers, g.num_experts, &ids)
        .expect("placement");
    state.init_placement(&p).await.expect("placement");
    a.wait_line("holds", Duration::from_secs(30));
    b.wait_line("holds", Duration::from_secs(30));

    let t0 = Instant::now();
    a.signal(libc::SIGTERM);
    a.wait_line("drain incomplete", Duration::from_secs(10));
    let (status, err) = a.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "a: {status}; stderr: {err}");
    assert!(
        t0.elapsed() >= Duration::from_secs(2),
        "a stopped before its drain timeout"
    );

    b.signal(libc::SIGTERM);
    b.wait_line("draining", Duration::from_secs(10));
    let t0 = Instant::now();
    b.signal(libc::SIGINT);
    b.wait_line("stopping at once", Duration::from_secs(5));
    let (status, err) = b.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "b: {status}; stderr: {err}");
    assert!(
        t0.elapsed() < Duration::from_secs(8),
        "b took {:?}",
        t0.elapsed()
    );

    registered_becomes(
        &etcd.addr,
        "unhandled",
        "expert",
        &[],
        Duration::from_millis(500),
    )
    .await;
    let left = state.drain_requests().await.expect("drain requests");
    assert!(left.is_empty(), "drain requests left behind: {left:?}");
}

/// An etcd restart under a registered expert-worker, down long enough for a
/// lease renewal (every third of the 5 s lease TTL) to fail: its registration
/// survives (the keep-alive stream is reopened; without it the lease would
/// expire 5 s after the restart) and it follows a placement written after the restart
/// (its placement watch is re-established).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expert_worker_survives_an_etcd_restart() {
    if !etcd_available() {
        return;
    }
    let mut etcd = epserve_tests::up::Etcd::start();
    let model = fixture_dir("qwen3_moe_a").join("f32");
    let mut c = Command::new(env!("CARGO_BIN_EXE_epserve-it"))
        .arg("expert-worker")
        .arg("--model")
        .arg(&model)
        .args(["--etcd", &etcd.addr, "--cluster", "restart", "--id", "w"])
        .args(["--listen", "127.0.0.1:0", "--etcd-timeout-secs", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn expert-worker");
    struct Kill(Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let out = c.stdout.take().expect("stdout");
    let worker = Kill(c);
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
            let _ = tx.send(line);
        }
    });
    let wait_line = |what: &str, limit: Duration| {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.contains(what) => return,
                Ok(_) => {}
                Err(_) => panic!("no '{what}' from the worker within {limit:?}"),
            }
        }
    };
    wait_line("serving", Duration::from_secs(60));

    etcd.restart_after(Duration::from_secs(4));
    // Well past the lease TTL (5 s), counted from the restart.
    tokio::time::sleep(Duration::from_secs(13)).await;
    let store = EtcdStore::connect(&etcd.addr).await.expect("etcd");
    let state = ClusterState::new(Arc::new(store), "restart");
    let workers = state.workers("expert").await.expect("workers");
    assert_eq!(
        workers.iter().map(|w| w.id.as_str()).collect::<Vec<_>>(),
        ["w"],
        "the worker's registration did not survive the etcd restart"
    );

    let g = golden("qwen3_moe_a");
    let p =
        epserve_core::placement::Placement::initial(&g.moe_layers, g.num_experts, &["w".into()])
            .expect("placement");
    state.init_placement(&p).await.expect("write placement");
    wait_line(
        &format!(
            "holds {} experts (placement v{}",
            g.moe_layers.len() * g.num_experts,
            p.version
        ),
        Duration::from_secs(30),
    );
    drop(worker);
}

/// `--expert-precision-policy load` on the coordinator: from the cluster's
/// load window it writes the cold experts as int8 into the placement and
/// applies that live through the rebalance state machine; the workers
/// repack them and the admin RPC (`ctl load`) shows each replica's
/// precision. Requests keep being answered across the switch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precision_policy_applies_int8_through_a_rebalance() {
    if !etcd_available() {
        return;
    }
    let fixture = "qwen3_moe_b";
    let up = start_up_from(
        fixture,
        "bf16",
        2,
        "f32",
        &[
            "--",
            "--expert-precision-policy",
            "load",
            "--expert-bf16-share",
            "0.5",
            "--precision-interval",
            "8",
        ],
    );
    let g = golden(fixture);
    let mut admin = epserve_proto::pb::admin_service_client::AdminServiceClient::connect(format!(
        "http://{}",
        up.admin
    ))
    .await
    .expect("admin connect");
    let start = Instant::now();
    let mut rounds = 0;
    let replicas = loop {
        // Bounded: a request per case per round, for at most 120 s.
        for case in &g.cases {
            let v = complete(
                &up.url,
                json!({"model": "tiny", "prompt": case.prompt_token_ids, "max_tokens": 8,
                       "temperature": 0, "ignore_eos": true}),
            )
            .await;
            assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
        }
        rounds += 1;
        let replicas = replicas_by_layer(&mut admin).await;
        if replicas.iter().any(|(_, r)| r.precision == "int8") {
            break replicas;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no int8 expert after {rounds} rounds: {replicas:?}"
        );
    };
    assert!(!replicas.is_empty());
    let state = up.cluster_state().await;
    // Workers repack while the rebalance loads (before the switch): wait
    // for the switch, then read the replicas again.
    let p = loop {
        let (p, _) = state.placement().await.expect("get").expect("placement");
        let done = state
            .rebalance()
            .await
            .expect("get")
            .is_some_and(|(r, _)| !r.state.active());
        if p.version > 1 && done {
            break p;
        }
        assert!(
            start.elapsed() < Duration::from_secs(150),
            "the precision rebalance never switched: {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let replicas = replicas_by_layer(&mut admin).await;
    let count = |x: &str| replicas.iter().filter(|(_, r)| r.precision == x).count();
    let (int8, bf16) = (count("int8"), count("bf16"));
    assert!(
        int8 > 0 && bf16 > 0,
        "int8 {int8}, bf16 {bf16}: {replicas:?}"
    );
    assert_eq!(int8 + bf16, replicas.len(), "{replicas:?}");
    // The placement in etcd names the same int8 experts.
    let listed = p.int8_experts();
    for (layer, r) in &replicas {
        assert_eq!(
            listed.contains(&(*layer as usize, r.expert as usize)),
            r.precision == "int8",
            "{r:?} vs {listed:?}"
        );
    }
    // Still serving after the switch.
    let v = complete(
        &up.url,
        json!({"model": "tiny", "prompt": g.cases[0].prompt_token_ids, "max_tokens": 16,
               "temperature": 0, "ignore_eos": true}),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 16, "{v}");
}

/// Every replica the admin RPC lists (`ctl load`'s data), with its layer.
async fn replicas_by_layer(
    admin: &mut epserve_proto::pb::admin_service_client::AdminServiceClient<
        tonic::transport::Channel,
    >,
) -> Vec<(u32, epserve_proto::pb::ReplicaLoad)> {
    admin
        .get_expert_load(epserve_proto::pb::GetExpertLoadRequest {})
        .await
        .expect("expert load")
        .into_inner()
        .layers
        .into_iter()
        .flat_map(|l| l.replicas.into_iter().map(move |r| (l.layer, r)))
        .collect()
}
