//! Every fixture model, loaded from its f32 and bf16 folders, against the
//! outputs transformers computed in float32 (tests/fixtures/*/golden.json):
//! prompt token ids, last-position logits, top-5 per position, router top-k
//! per MoE layer and position, and 32 greedy tokens.
//!
//! Tolerances: the bf16 folder holds the same (bf16-representable) weights as
//! the f32 one and the engine computes in f32 either way, so both are held to
//! the same bound: |logit − reference| ≤ 1e-4 (logits are O(1..10); measured ≤ 2e-5).
//! The goldens run with an f32 KV cache explicitly (`auto` would pick bf16
//! for the bf16 folders); `bf16_kv_cache_is_close` checks the bf16 cache.

use epserve_core::engine::{Engine, GenerateRequest};
use epserve_core::model::kv_cache::KvDtype;
use epserve_core::model::{LogitsMode, Model, SeqInput};
use epserve_core::sampling::SamplingParams;
use epserve_tests::{Golden, demo_dir, demo_golden, fixture_dir, fixture_names, golden};

const LOGIT_TOL: f32 = 1e-4;

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check_fixture(name: &str, dtype: &str) {
    check_model(
        &format!("{name}/{dtype}"),
        &fixture_dir(name).join(dtype),
        &golden(name),
        LOGIT_TOL,
    );
}

/// One model folder against its golden; `tol` bounds |logit − reference|.
fn check_model(name: &str, dir: &std::path::Path, g: &Golden, tol: f32) {
    let engine = Engine::load(dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    check_engine(name, engine, g, tol);
}

/// Issue 21: every fixture (bf16 folder) with `--expert-memory` a third of
/// its packed experts, the bf16-exact policy: the experts run from the
/// resident tier, the LRU cache packed on first use and, when a call's
/// experts do not fit at once, in groups; the goldens hold to the same bound,
/// the budget is never exceeded, and experts were paged in and evicted.
#[test]
fn all_fixtures_match_transformers_with_a_third_of_the_experts_in_memory() {
    for name in fixture_names() {
        let dir = fixture_dir(&name).join("bf16");
        let cfg = epserve_core::config::ModelConfig::from_dir(&dir).expect("config");
        let ws = epserve_core::loader::weights::WeightStore::open(&dir).expect("weights");
        let all = epserve_core::experts::PackedExperts::load_filtered(
            &cfg,
            &ws,
            &epserve_core::experts::LoadOptions::default(),
            &|_, _| true,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .resident_bytes();
        let opts = epserve_core::experts::LoadOptions {
            tier: Some(epserve_core::experts::TierOptions {
                budget: all / 3,
                ..Default::default()
            }),
            ..Default::default()
        };
        let engine = Engine::load_with(&dir, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        let tiers = engine.model.expert_tiers().cloned().expect("tiered");
        check_engine(
            &format!("{name}/bf16 in a third"),
            engine,
            &golden(&name),
            LOGIT_TOL,
        );
        tiers.prefetch_idle();
        let s = tiers.snapshot();
        assert!(
            s.resident_bytes + s.cached_bytes <= s.budget_bytes,
            "{name}: {s:?}"
        );
        assert!(s.misses > 0 && s.evictions > 0, "{name}: {s:?}");
        assert!(s.hinted > 0, "{name}: the lookahead's hints arrive: {s:?}");
    }
}

/// [`check_model`] on a loaded engine.
fn check_engine(name: &str, mut engine: Engine, g: &Golden, tol: f32) {
    engine.kv_dtype = KvDtype::F32;
    assert_eq!(
        engine.model.config.moe_layers(),
        g.moe_layers,
        "{name}: MoE layers"
    );
    assert_eq!(engine.model.config.num_hidden_layers, g.num_layers);
    assert_eq!(engine.model.config.num_experts, g.num_experts);
    assert_eq!(engine.model.config.num_experts_per_tok, g.top_k);
    assert_eq!(engine.model.config.vocab_size, g.vocab_size);
    for case in &g.cases {
        let ctx = format!("{name}/{}", case.name);
        let ids = engine
            .encode_prompt(&case.prompt, case.chat)
            .unwrap_or_else(|e| panic!("{ctx}: {e}"));
        assert_eq!(ids, case.prompt_token_ids, "{ctx}: prompt token ids");

        // Whole prompt in one batched prefill, logits at every position.
        let mut cache = engine.model.new_cache();
        let mut pool = engine.model.pool_for_tokens(ids.len(), KvDtype::F32);
        let out = engine
            .model
            .forward(
                &mut [SeqInput {
                    tokens: &ids,
                    cache: &mut cache,
                    logits: true,
                }],
                &mut pool,
                LogitsMode::All,
                true,
            )
            .unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let v = g.vocab_size;
        let n = ids.len();
        let last = &out.logits[(n - 1) * v..n * v];
        let d = max_abs_diff(last, &case.last_logits);
        eprintln!(
            "{ctx}: {} prompt tokens, last-logit max diff {d:.2e}",
            ids.len()
        );
        assert!(d <= tol, "{ctx}: last logits differ by {d}");
        for pos in 0..n {
            let row = &out.logits[pos * v..(pos + 1) * v];
            for (id, want) in case.top5_ids[pos].iter().zip(&case.top5_logits[pos]) {
                let got = row[*id as usize];
                assert!(
                    (got - want).abs() <= tol,
                    "{ctx}: pos {pos} token {id}: {got} vs {want}"
                );
            }
            let top1 = epserve_core::sampling::argmax(row);
            assert_eq!(top1, case.top5_ids[pos][0], "{ctx}: pos {pos} argmax");
        }
        for trace in &out.router {
            let want = case
                .router_topk
                .get(&trace.layer.to_string())
                .unwrap_or_else(|| panic!("{ctx}: no golden for layer {}", trace.layer));
            let k = trace.routing.top_k;
            assert_eq!(want.len(), n, "{ctx}: golden router positions");
            for (pos, want_pos) in want.iter().enumerate() {
                let mut got: Vec<u32> = trace.routing.topk_ids[pos * k..(pos + 1) * k].to_vec();
                got.sort_unstable();
                assert_eq!(
                    &got, want_pos,
                    "{ctx}: layer {} pos {pos} experts",
                    trace.layer
                );
            }
        }
        assert_eq!(out.router.len(), g.moe_layers.len());

        // Greedy continuation through the KV cache.
        let generated = engine
            .generate(&GenerateRequest {
                prompt_token_ids: ids.clone(),
                max_tokens: case.greedy_token_ids.len(),
                sampling: SamplingParams::default(),
                stop: vec![],
                ignore_eos: true,
            })
            .unwrap_or_else(|e| panic!("{ctx}: {e}"));
        assert_eq!(
            generated.token_ids, case.greedy_token_ids,
            "{ctx}: greedy tokens"
        );
    }
}

#[test]
fn fixtures_exist() {
    let names = fixture_names();
    for want in [
        "qwen3_moe_a",
        "qwen3_moe_b",
        "mixtral",
        "qwen2_moe",
        "olmoe",
        "gpt_oss",
        "gemma4",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v3_g1",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "fixture {want} missing: {names:?}"
        );
    }
}

/// The bundled demo model (trained weights, bf16 folder computed in f32)
/// against transformers run on the same committed weights in float32.
#[test]
fn demo_model_matches_transformers() {
    let g = demo_golden();
    assert!(
        g.num_experts >= 8 && g.top_k >= 2,
        "demo: 8+ experts, top-2+"
    );
    // Measured: last-logit max diff ≤ 8.2e-6 (2026-12-02).
    check_model("demo", &demo_dir(), &g, LOGIT_TOL);
}

#[test]
fn all_fixtures_f32_match_transformers() {
    for name in fixture_names() {
        check_fixture(&name, "f32");
    }
}

#[test]
fn all_fixtures_bf16_match_transformers() {
    for name in fixture_names() {
        check_fixture(&name, "bf16");
    }
}

/// Fixtures that also ship their experts quantized as published (GPT-OSS's
/// MXFP4 `*_blocks` / `*_scales`, dequantized at load) give the same outputs:
/// the quantized values are exactly the f32 folder's weights.
#[test]
fn mxfp4_folders_match_transformers() {
    let mut seen = 0;
    for name in fixture_names() {
        if fixture_dir(&name).join("mxfp4").is_dir() {
            check_fixture(&name, "mxfp4");
            seen += 1;
        }
    }
    assert!(seen > 0, "no fixture has an mxfp4/ folder");
}

/// Prefill in one pass, prefill in chunks, and token-by-token decode give the
/// same logits; two sequences batched together give what each gives alone.
#[test]
fn chunked_and_batched_prefill_agree() {
    for name in fixture_names() {
        let g = golden(&name);
        let engine = Engine::load(&fixture_dir(&name).join("f32")).expect("load");
        let m = &engine.model;
        let v = g.vocab_size;
        let a = &g.cases[0].prompt_token_ids;
        let b = &g.cases[g.cases.len() - 1].prompt_token_ids;
        let last_alone = |ids: &[u32], chunk: usize| -> Vec<f32> {
            let mut cache = m.new_cache();
            // Blocks of 4 so chunks straddle block boundaries.
            let mut pool = m.new_pool(4, ids.len().div_ceil(4), KvDtype::F32);
            let mut out = Vec::new();
            let pieces = ids.len().div_ceil(chunk);
            for (i, piece) in ids.chunks(chunk).enumerate() {
                // Only the last chunk asks for logits, as the scheduler does.
                let last = i + 1 == pieces;
                let o = m
                    .forward(
                        &mut [SeqInput {
                            tokens: piece,
                            cache: &mut cache,
                            logits: last,
                        }],
                        &mut pool,
                        LogitsMode::Last,
                        false,
                    )
                    .expect("forward");
                assert_eq!(o.rows, usize::from(last), "{name}: rows of chunk {i}");
                out = o.logits;
            }
            out
        };
        let ref_a = last_alone(a, a.len());
        let ref_b = last_alone(b, b.len());
        for chunk in [1, 3, 7] {
            let d = max_abs_diff(&last_alone(b, chunk), &ref_b);
            assert!(d <= 1e-4, "{name}: chunk {chunk} differs by {d}");
        }
        let (mut ca, mut cb) = (m.new_cache(), m.new_cache());
        // A small, shared pool: the two sequences' blocks interleave.
        let mut pool = m.new_pool(2, (a.len() + b.len()).div_ceil(2) + 2, KvDtype::F32);
        let out = m
            .forward(
                &mut [
                    SeqInput {
                        tokens: a,
                        cache: &mut ca,
                        logits: true,
                    },
                    SeqInput {
                        tokens: b,
                        cache: &mut cb,
                        logits: true,
                    },
                ],
                &mut pool,
                LogitsMode::Last,
                false,
            )
            .expect("forward");
        assert!(
            max_abs_diff(&out.logits[..v], &ref_a) <= 1e-4,
            "{name}: batched a"
        );
        assert!(
            max_abs_diff(&out.logits[v..], &ref_b) <= 1e-4,
            "{name}: batched b"
        );
    }
}

/// Logits `[n, vocab]` at every position of `ids`: a prefill of all but the
/// last 4 tokens, then 4 decode steps (so attention reads cached K/V); and
/// every MoE layer's expert choices.
fn prefill_then_decode(m: &Model, ids: &[u32], dtype: KvDtype) -> (Vec<f32>, Vec<u32>) {
    let mut cache = m.new_cache();
    let mut pool = m.new_pool(4, ids.len().div_ceil(4), dtype);
    let split = ids.len().saturating_sub(4).max(1);
    let (mut logits, mut experts) = (Vec::new(), Vec::new());
    for piece in std::iter::once(&ids[..split]).chain(ids[split..].chunks(1)) {
        let out = m
            .forward(
                &mut [SeqInput {
                    tokens: piece,
                    cache: &mut cache,
                    logits: true,
                }],
                &mut pool,
                LogitsMode::All,
                true,
            )
            .expect("forward");
        logits.extend(out.logits);
        for t in out.router {
            experts.extend(t.routing.topk_ids);
        }
    }
    (logits, experts)
}

/// A bf16 KV cache (keys and values rounded to bf16 on write) stays close
/// to the f32 cache on every fixture, and gives the same 32 greedy tokens
/// as transformers on qwen3_moe_a, mixtral, olmoe and deepseek_v3.
/// Measured (2026-12-01, every fixture's cases, every position, prefill then
/// decode): max |logit(bf16 KV) − logit(f32 KV)| = 0.157 (qwen3_moe_b/long;
/// 0.015..0.11 elsewhere) on the 29 of 33 cases routed alike; in 4 a near-tie
/// expert choice flips, and deepseek_v3/plain's logits then move by up to 2.93.
#[test]
fn bf16_kv_cache_is_close() {
    let (mut worst, mut flips, mut cases) = (0.0f32, 0, 0);
    for name in fixture_names() {
        let g = golden(&name);
        cases += g.cases.len();
        let mut engine = Engine::load(&fixture_dir(&name).join("bf16")).expect("load");
        assert_eq!(
            engine.kv_dtype,
            KvDtype::Bf16,
            "{name}: auto picks bf16 for a bf16 folder"
        );
        for case in &g.cases {
            let ids = &case.prompt_token_ids;
            let (f, fe) = prefill_then_decode(&engine.model, ids, KvDtype::F32);
            let (b, be) = prefill_then_decode(&engine.model, ids, KvDtype::Bf16);
            let d = max_abs_diff(&f, &b);
            let flipped = fe != be;
            eprintln!(
                "{name}/{}: bf16 vs f32 KV max logit diff {d:.3e}{}",
                case.name,
                if flipped {
                    " (an expert choice flipped)"
                } else {
                    ""
                }
            );
            if flipped {
                // Top-k routing is discontinuous: a near-tie between two
                // experts may go the other way, and that position's logits
                // then move by O(1). Only the routed-alike cases are bounded.
                flips += 1;
                continue;
            }
            worst = worst.max(d);
            assert!(
                d <= BF16_KV_TOL,
                "{name}/{}: bf16 KV differs by {d}",
                case.name
            );
        }
        if ["qwen3_moe_a", "mixtral", "olmoe", "deepseek_v3"].contains(&name.as_str()) {
            engine.kv_dtype = KvDtype::Bf16;
            for case in &g.cases {
                let out = engine
                    .generate(&GenerateRequest {
                        prompt_token_ids: case.prompt_token_ids.clone(),
                        max_tokens: case.greedy_token_ids.len(),
                        sampling: SamplingParams::default(),
                        stop: vec![],
                        ignore_eos: true,
                    })
                    .expect("generate");
                assert_eq!(
                    out.token_ids, case.greedy_token_ids,
                    "{name}/{}: greedy tokens with a bf16 KV cache",
                    case.name
                );
            }
        }
    }
    eprintln!(
        "bf16 vs f32 KV cache: worst max logit diff {worst:.3e}; {flips} of {cases} cases with a flipped expert choice"
    );
    assert!(
        flips * 4 <= cases,
        "{flips} of {cases} cases route differently"
    );
}

/// Bound of [`bf16_kv_cache_is_close`].
const BF16_KV_TOL: f32 = 0.25;
