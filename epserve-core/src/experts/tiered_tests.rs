//! [`TieredExperts`] against [`PackedExperts`] holding every expert, on a
//! committed fixture: the same outputs, bit for bit, whatever the budget
//! (one expert, a third, everything), with and without prefetch hints; the
//! bytes held never above the budget; the counters add up.

use std::path::Path;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::moe::{ExpertExecutor, SKIP_SLOT};

fn fixture() -> (crate::config::ModelConfig, Arc<WeightStore>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_b/bf16");
    let cfg = crate::config::ModelConfig::from_dir(&dir).expect("config");
    let ws = Arc::new(WeightStore::open(&dir).expect("weights"));
    (cfg, ws)
}

fn opts() -> LoadOptions {
    LoadOptions {
        threads: Some(2),
        ..LoadOptions::default()
    }
}

/// One random call: `rows` tokens, top-k distinct experts each (some slots
/// skipped), weights in (0, 1).
fn call(
    rng: &mut StdRng,
    rows: usize,
    n: usize,
    k: usize,
    h: usize,
) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let x: Vec<f32> = (0..rows * h).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut ids = Vec::with_capacity(rows * k);
    for _ in 0..rows {
        let mut pick: Vec<u32> = (0..n as u32).collect();
        for i in 0..k {
            let j = rng.random_range(i..n);
            pick.swap(i, j);
        }
        for &e in &pick[..k] {
            ids.push(if rng.random_range(0..10) == 0 {
                SKIP_SLOT
            } else {
                e
            });
        }
    }
    let w: Vec<f32> = (0..rows * k).map(|_| rng.random_range(0.01..1.0)).collect();
    (x, ids, w)
}

/// Every expert resident, as the tiered executor packs them: bf16 panels
/// (the resident load stores them as B12 where the CPU decodes it natively;
/// the tiered executor's misses do not), so outputs compare bit for bit.
fn resident(
    cfg: &crate::config::ModelConfig,
    ws: &Arc<WeightStore>,
    o: &LoadOptions,
) -> PackedExperts {
    let loaded = PackedExperts::load_filtered(cfg, ws, o, &|_, _| true).expect("load");
    let moe = cfg.moe_layers();
    let layers = (0..moe.iter().max().map_or(0, |l| l + 1))
        .map(|l| {
            moe.contains(&l).then(|| {
                (0..cfg.num_experts)
                    .map(|e| loaded.expert(l, e).map(|p| p.clone().into_plain_bf16()))
                    .collect()
            })
        })
        .collect();
    PackedExperts::new(layers, cfg.hidden_size, loaded.pool().clone()).expect("resident")
}

fn check_budget(t: &TieredExperts) {
    let s = t.snapshot();
    // The byte counters are the bytes of the entries held, tier by tier.
    let (counted, held) = t.accounting();
    assert_eq!(counted, held, "(resident, cached) bytes counted vs held");
    assert!(
        s.resident_bytes + s.cached_bytes <= s.budget_bytes,
        "held {} + {} > budget {}",
        s.resident_bytes,
        s.cached_bytes,
        s.budget_bytes
    );
}

#[test]
fn tiered_outputs_match_fully_resident_at_any_budget() {
    let (cfg, ws) = fixture();
    let o = opts();
    let full = resident(&cfg, &ws, &o);
    let one = full.expert(1, 0).expect("expert").weight_bytes();
    let all = full.resident_bytes();
    let (h, n, k) = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok);
    let layers = cfg.moe_layers();
    for (budget, prefetch) in [(one, false), (all / 3, false), (all / 3, true), (all, true)] {
        let tier = TierOptions {
            budget,
            retier_calls: 7,
            prefetch,
            ..TierOptions::default()
        };
        let t = TieredExperts::load(&cfg, ws.clone(), &o, &|_, _| true, tier).expect("tiered");
        check_budget(&t);
        let mut rng = StdRng::seed_from_u64(budget as u64);
        let mut uses = 0u64;
        for step in 0..40 {
            let rows = [1, 2, 5, 17][step % 4];
            for &l in &layers {
                let (x, ids, w) = call(&mut rng, rows, n, k, h);
                let mut want = vec![0.0f32; rows * k * h];
                let mut got = vec![0.0f32; rows * k * h];
                full.execute(l, &x, &ids, &w, k, &mut want).expect("full");
                if prefetch {
                    // A hint that is half right: the prefetcher packs
                    // experts while calls run.
                    let hint: Vec<u32> = ids
                        .iter()
                        .copied()
                        .filter(|&e| e != SKIP_SLOT && e % 2 == 0)
                        .collect();
                    t.prefetch_hint(l, &hint);
                }
                t.execute(l, &x, &ids, &w, k, &mut got).expect("tiered");
                assert!(
                    want.iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "budget {budget} layer {l} step {step}: outputs differ"
                );
                check_budget(&t);
                let mut seen = vec![false; n];
                for &e in ids.iter().filter(|&&e| e != SKIP_SLOT) {
                    seen[e as usize] = true;
                }
                uses += seen.iter().filter(|&&s| s).count() as u64;
            }
        }
        t.prefetch_idle();
        check_budget(&t);
        let s = t.snapshot();
        assert_eq!(
            s.hits + s.misses,
            uses,
            "budget {budget}: every use is a hit or a miss"
        );
        assert_eq!(s.held_experts, (layers.len() * n) as u64);
        if budget >= all {
            assert_eq!(s.misses, 0, "everything fits: no miss");
            assert_eq!(s.evictions, 0);
        } else {
            assert!(s.misses > 0 && s.evictions > 0, "budget {budget}: {s:?}");
        }
        if budget == one {
            // One expert at a time: calls split into passes.
            assert!(s.split_calls > 0, "{s:?}");
        }
        if budget == all / 3 {
            assert!(
                s.resident_experts > 0 && s.promotions + s.demotions > 0,
                "{s:?}"
            );
        }
        if prefetch && budget < all {
            // Hints arrive; this thrashing load leaves no expert unused for
            // two steps, so none may be evicted for a guess.
            assert!(s.hinted > 0, "{s:?}");
        }
        let tiers = t.tiers();
        assert_eq!(tiers.len(), layers.len() * n);
        let resident = tiers.values().filter(|&&t| t == Tier::Resident).count() as u64;
        assert_eq!(resident, s.resident_experts);
        // What `epserve ctl load` shows: every assigned expert once, tiers
        // as counted, bf16 throughout (the bf16 fixture, exact packing).
        let states = t.expert_states();
        assert_eq!(states.len(), layers.len() * n);
        let count = |tier: &str| states.iter().filter(|x| x.tier == tier).count() as u64;
        assert_eq!(count("resident"), s.resident_experts);
        assert_eq!(count("cached"), s.cached_experts);
        assert_eq!(
            count("cold"),
            s.held_experts - s.resident_experts - s.cached_experts
        );
        assert!(states.iter().all(|x| x.precision == "bf16"), "{states:?}");
        assert!(
            states
                .iter()
                .all(|x| tiers.get(&(x.layer, x.expert)).map(|t| t.as_str()) == Some(x.tier))
        );
    }
    let states = full.expert_states();
    assert_eq!(states.len(), layers.len() * n);
    assert!(
        states
            .iter()
            .all(|x| x.tier == "resident" && x.precision == "bf16")
    );
}

#[test]
fn tiered_refuses_a_budget_below_one_expert_and_follows_assignments() {
    let (cfg, ws) = fixture();
    let o = opts();
    let tier = TierOptions {
        budget: 100,
        ..TierOptions::default()
    };
    let err = TieredExperts::load(&cfg, ws.clone(), &o, &|_, _| true, tier)
        .err()
        .expect("a 100-byte budget holds no expert");
    assert!(err.to_string().contains("cannot hold one expert"), "{err}");
    let tier = TierOptions {
        budget: 1 << 30,
        ..TierOptions::default()
    };
    let t = TieredExperts::load(&cfg, ws, &o, &|_, e| e < 4, tier).expect("tiered");
    let h = cfg.hidden_size;
    let k = cfg.num_experts_per_tok;
    let x = vec![0.5f32; h];
    let mut ids = vec![SKIP_SLOT; k];
    ids[0] = 5;
    let mut out = vec![0.0f32; k * h];
    // Experts not assigned still serve (a call in flight across a new
    // placement), as a miss.
    t.execute(1, &x, &ids, &vec![1.0; k], k, &mut out)
        .expect("unassigned expert");
    ids[0] = cfg.num_experts as u32;
    let err = t
        .execute(1, &x, &ids, &vec![1.0; k], k, &mut out)
        .expect_err("out of range");
    assert!(err.to_string().contains("out of range"), "{err}");
    let s = t.snapshot();
    assert_eq!(s.held_experts, (cfg.moe_layers().len() * 4) as u64);
    assert_eq!(s.misses, 1);
    // A new assignment drops what is no longer assigned and warms the rest.
    t.assign(&|_, e| e >= 6).expect("assign");
    let tiers = t.tiers();
    assert!(tiers.keys().all(|&(_, e)| e >= 6), "{tiers:?}");
    assert!(
        tiers.values().all(|&t| t != Tier::Cold),
        "a big budget holds them all"
    );
    let s = t.snapshot();
    assert_eq!(s.resident_experts + s.cached_experts, s.held_experts);
}

/// Precision by load: under skewed routing the hot experts end up packed in
/// bf16 and the others in int8 (repacked in the background as the window
/// moves); the bf16 ones give the fully resident bf16 outputs bit for bit,
/// the int8 ones stay within the W8A8 bound.
#[test]
fn precision_by_load_keeps_the_hot_experts_in_bf16() {
    let (cfg, ws) = fixture();
    let o = opts();
    let full = resident(&cfg, &ws, &o);
    let (h, n, k) = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok);
    let tier = TierOptions {
        budget: usize::MAX / 4,
        retier_calls: 4,
        bf16_share: Some(0.5),
        ..TierOptions::default()
    };
    let t = TieredExperts::load(&cfg, ws.clone(), &o, &|_, _| true, tier).expect("tiered");
    let l = cfg.moe_layers()[0];
    let mut rng = StdRng::seed_from_u64(7);
    // Expert 0 in every token, 1 in most; the rest spread.
    let skewed = |rng: &mut StdRng, rows: usize| {
        let (x, mut ids, w) = call(rng, rows, n, k, h);
        for r in 0..rows {
            let row = &mut ids[r * k..(r + 1) * k];
            for want in [0u32, 1] {
                if !row.contains(&want) {
                    row[want as usize] = want;
                }
            }
        }
        (x, ids, w)
    };
    for _ in 0..40 {
        let (x, ids, w) = skewed(&mut rng, 4);
        let mut out = vec![0.0f32; 4 * k * h];
        t.execute(l, &x, &ids, &w, k, &mut out).expect("tiered");
    }
    t.prefetch_idle();
    let s = t.snapshot();
    assert!(
        s.repacked > 0 && s.bf16_experts > 0 && s.int8_experts > 0,
        "{s:?}"
    );
    assert_ne!(
        t.precision_of(l, 0),
        Some(ExpertDtype::Int8),
        "expert 0 is hot"
    );
    // One token routed to expert 0 alone (bf16: exact) and one to a cold
    // int8 expert (close).
    let cold = (2..n)
        .find(|&e| t.precision_of(l, e) == Some(ExpertDtype::Int8))
        .expect("a cold int8 expert") as u32;
    // The states say the same.
    let states = t.expert_states();
    let of = |e: usize| {
        states
            .iter()
            .find(|x| (x.layer, x.expert) == (l, e))
            .map(|x| x.precision)
    };
    assert_eq!(of(0), Some("bf16"));
    assert_eq!(of(cold as usize), Some("int8"));
    assert_eq!(
        states.iter().filter(|x| x.precision == "int8").count() as u64,
        s.int8_experts
    );
    for (e, exact) in [(0u32, true), (cold, false)] {
        let x: Vec<f32> = (0..h).map(|i| ((i % 7) as f32 - 3.0) * 0.2).collect();
        let mut ids = vec![SKIP_SLOT; k];
        ids[0] = e;
        let w = vec![1.0f32; k];
        let (mut want, mut got) = (vec![0.0f32; k * h], vec![0.0f32; k * h]);
        full.execute(l, &x, &ids, &w, k, &mut want).expect("full");
        t.execute(l, &x, &ids, &w, k, &mut got).expect("tiered");
        let max = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let diff = want
            .iter()
            .zip(&got)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        if exact {
            assert_eq!(diff, 0.0, "bf16 expert {e}");
        } else {
            assert!(
                diff <= 0.03 * max && diff > 0.0,
                "int8 expert {e}: {diff} of {max}"
            );
        }
    }
}
