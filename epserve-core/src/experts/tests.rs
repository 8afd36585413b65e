//! [`PackedExperts`] against the portable [`LocalExperts`] on random experts,
//! for every supported kernel tier: odd sizes, one token, experts with zero
//! tokens, skipped slots, enough tokens per expert for the prefill path, and
//! mixed bf16/int8 precision.
//!
//! Tolerances: bf16 packing of bf16 weights is exact and activations stay
//! f32, so only summation order differs: `|Δ| ≤ 1e-4 · (1 + |ref|)`. int8
//! (W8A8) against f32: `‖Δ‖∞ ≤ 3% of ‖ref‖∞` per slot. int8 on any tier
//! against int8 on the scalar twin: bit-identical (exact i32 sums, same
//! epilogue).

use std::sync::Arc;

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::config::Activation;
use crate::kernels::dispatch::{Kernels, Tier};
use crate::moe::mlp::GatedMlp;
use crate::moe::{ExpertExecutor, SKIP_SLOT};
use crate::tensor::{DType, Weight};
use packed::PackedDtype;

fn bf16_weight(rng: &mut StdRng, rows: usize, cols: usize, scale: f32) -> Weight {
    let v: Vec<bf16> = (0..rows * cols)
        .map(|_| bf16::from_f32(rng.random_range(-scale..scale)))
        .collect();
    Weight::from_bytes(DType::BF16, vec![rows, cols], bytemuck::cast_slice(&v))
}

struct Case {
    hidden: usize,
    inter: usize,
    experts: usize,
    top_k: usize,
}

fn mlps(rng: &mut StdRng, c: &Case) -> Vec<GatedMlp> {
    (0..c.experts)
        .map(|_| GatedMlp {
            gate: bf16_weight(rng, c.inter, c.hidden, 0.5),
            up: bf16_weight(rng, c.inter, c.hidden, 0.5),
            down: bf16_weight(rng, c.hidden, c.inter, 0.5),
            activation: Activation::Silu,
            gate_bias: None,
            up_bias: None,
            down_bias: None,
        })
        .collect()
}

fn packed(
    ms: &[GatedMlp],
    hidden: usize,
    dtype: impl Fn(usize) -> PackedDtype,
    pool: &Arc<ExpertPool>,
) -> PackedExperts {
    let experts = ms
        .iter()
        .enumerate()
        .map(|(e, m)| PackedExpert::from_mlp(m, dtype(e), false).map(Some))
        .collect::<crate::Result<Vec<_>>>()
        .expect("pack");
    PackedExperts::new(vec![None, Some(experts)], hidden, pool.clone()).expect("executor")
}

fn portable(ms: &[GatedMlp], hidden: usize) -> LocalExperts {
    let ms = ms.iter().map(|m| GatedMlp {
        gate: m.gate.clone(),
        up: m.up.clone(),
        down: m.down.clone(),
        activation: m.activation,
        gate_bias: m.gate_bias.clone(),
        up_bias: m.up_bias.clone(),
        down_bias: m.down_bias.clone(),
    });
    LocalExperts::new(
        vec![
            None,
            Some(LayerExperts {
                experts: ms.map(Some).collect(),
            }),
        ],
        hidden,
    )
}

/// Routing where expert 0 never appears (zero tokens), some slots are skipped.
fn routing(rng: &mut StdRng, rows: usize, c: &Case) -> (Vec<u32>, Vec<f32>) {
    let mut ids = Vec::new();
    let mut w = Vec::new();
    for _ in 0..rows {
        let mut chosen: Vec<u32> = Vec::new();
        while chosen.len() < c.top_k {
            let e = rng.random_range(1..c.experts as u32);
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        for e in chosen {
            ids.push(if rng.random_range(0..7) == 0 {
                SKIP_SLOT
            } else {
                e
            });
            w.push(rng.random_range(0.1f32..1.0));
        }
    }
    (ids, w)
}

fn run(ex: &dyn ExpertExecutor, x: &[f32], ids: &[u32], w: &[f32], c: &Case) -> Vec<f32> {
    // Pre-fill with a marker: skipped slots must stay untouched.
    let mut out = vec![7.0f32; ids.len() * c.hidden];
    ex.execute(1, x, ids, w, c.top_k, &mut out)
        .expect("execute");
    out
}

const CASES: &[Case] = &[
    Case {
        hidden: 64,
        inter: 24,
        experts: 7,
        top_k: 2,
    },
    Case {
        hidden: 37,
        inter: 13,
        experts: 5,
        top_k: 3,
    },
    Case {
        hidden: 16,
        inter: 8,
        experts: 3,
        top_k: 1,
    },
    Case {
        hidden: 130,
        inter: 70,
        experts: 4,
        top_k: 2,
    },
];

#[test]
fn experts_packed_bf16_matches_portable_on_every_tier() {
    let pool = Arc::new(ExpertPool::new(Some(2), false).expect("pool"));
    let mut rng = StdRng::seed_from_u64(11);
    for c in CASES {
        let ms = mlps(&mut rng, c);
        let reference = portable(&ms, c.hidden);
        // 40 and 120 rows put more tokens on an expert than one tile
        // holds: the prefill path (two-panel tiles where the tier has them).
        for rows in [1usize, 2, 3, 9, 40, 120] {
            let x: Vec<f32> = (0..rows * c.hidden)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let (ids, w) = routing(&mut rng, rows, c);
            let want = run(&reference, &x, &ids, &w, c);
            // bf16 panels, then B12 (lossless: the same bound, on the B12
            // tile for up to 24 rows of an expert and on decoded panels
            // above) beside one expert left as bf16 panels.
            for (tier, b12) in Tier::available()
                .into_iter()
                .flat_map(|t| [(t, false), (t, true)])
            {
                let k = Kernels::for_tier(tier).expect("tier");
                let ex = if b12 {
                    let experts = ms
                        .iter()
                        .enumerate()
                        .map(|(e, m)| {
                            PackedExpert::from_mlp(m, PackedDtype::Bf16, true)
                                .map(|p| Some(if e == 2 { p } else { p.into_b12() }))
                        })
                        .collect::<crate::Result<Vec<_>>>()
                        .expect("pack");
                    assert!(experts[1].as_ref().is_some_and(|p| p.gate_up.is_b12()));
                    PackedExperts::new(vec![None, Some(experts)], c.hidden, pool.clone())
                        .expect("executor")
                } else {
                    packed(&ms, c.hidden, |_| PackedDtype::Bf16, &pool)
                };
                let got = run(&ex.with_kernels(k), &x, &ids, &w, c);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                        "{} (B12 {b12}) h={} rows={rows} idx {i}: {a} vs {b}",
                        tier.name(),
                        c.hidden
                    );
                }
            }
        }
    }
}

#[test]
fn experts_packed_bf16_activations_are_close_on_every_tier() {
    // bf16 activations round x and h to 8 significant bits: `‖Δ‖∞ ≤ 2% of
    // ‖ref‖∞` per slot. Tiers without a bf16 dot tile keep f32 activations.
    let pool = Arc::new(ExpertPool::new(Some(2), false).expect("pool"));
    let mut rng = StdRng::seed_from_u64(15);
    for c in CASES {
        let ms = mlps(&mut rng, c);
        let reference = portable(&ms, c.hidden);
        for rows in [1usize, 3, 40, 120] {
            let x: Vec<f32> = (0..rows * c.hidden)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let (ids, w) = routing(&mut rng, rows, c);
            let want = run(&reference, &x, &ids, &w, c);
            // bf16 panels and B12 (the B12 tile on the rounded rows).
            let tiers = Tier::available()
                .into_iter()
                .flat_map(|t| [(t, false), (t, true)]);
            for (tier, b12) in tiers {
                let k = Kernels::for_tier(tier).expect("tier");
                let experts = ms
                    .iter()
                    .map(|m| {
                        PackedExpert::from_mlp(m, PackedDtype::Bf16, false).map(|e| {
                            let e = e.with_bf16_activations(true);
                            Some(if b12 { e.into_b12() } else { e })
                        })
                    })
                    .collect::<crate::Result<Vec<_>>>()
                    .expect("pack");
                let ex = PackedExperts::new(vec![None, Some(experts)], c.hidden, pool.clone())
                    .expect("executor")
                    .with_kernels(k);
                let got = run(&ex, &x, &ids, &w, c);
                for (s, id) in ids.iter().enumerate() {
                    let (a, b) = (
                        &got[s * c.hidden..(s + 1) * c.hidden],
                        &want[s * c.hidden..(s + 1) * c.hidden],
                    );
                    if *id == SKIP_SLOT {
                        assert!(a.iter().all(|&v| v == 7.0), "skipped slot written");
                        continue;
                    }
                    let norm = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let err = a
                        .iter()
                        .zip(b)
                        .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
                    assert!(
                        err <= 0.02 * norm + 1e-6,
                        "{} (B12: {b12}) rows={rows} slot {s}: err {err} vs norm {norm}",
                        tier.name()
                    );
                }
            }
        }
    }
}

#[test]
fn experts_bf16_activation_prefill_matches_decode() {
    // Hidden 1030: three K blocks on the BFMMLA path (512, 512, 6: the last
    // not whole k-quads); width 35: an odd pair count on the down
    // projection. Where the prefill path also runs on bf16 activations
    // (BFMMLA on `neon-bf16`, AMX), all rows at once must match the rows one
    // at a time (the bf16 dot decode tile): only summation order differs,
    // and through it a rare last-bit flip of h's bf16 rounding. Every tier
    // stays within the bf16-activation bound of the portable reference.
    let c = Case {
        hidden: 1030,
        inter: 35,
        experts: 3,
        top_k: 1,
    };
    let pool = Arc::new(ExpertPool::new(Some(2), false).expect("pool"));
    let mut rng = StdRng::seed_from_u64(19);
    let ms = mlps(&mut rng, &c);
    let reference = portable(&ms, c.hidden);
    let rows = 41usize;
    let x: Vec<f32> = (0..rows * c.hidden)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let (ids, w) = routing(&mut rng, rows, &c);
    let want = run(&reference, &x, &ids, &w, &c);
    let mut compared = false;
    // Each tier as detected, and with the bf16 dot tile on prefill forced
    // on (AMD's choice; a no-op on tiers without the tile).
    let tiers = Tier::available().into_iter().flat_map(|t| {
        let k = Kernels::for_tier(t).expect("tier");
        [k.with_bf16x_prefill(false), k.with_bf16x_prefill(true)]
    });
    for k in tiers {
        let tier = k.tier();
        let experts = ms
            .iter()
            .map(|m| {
                PackedExpert::from_mlp(m, PackedDtype::Bf16, false)
                    .map(|e| Some(e.with_bf16_activations(true)))
            })
            .collect::<crate::Result<Vec<_>>>()
            .expect("pack");
        let ex = PackedExperts::new(vec![None, Some(experts)], c.hidden, pool.clone())
            .expect("executor")
            .with_kernels(k);
        let prefill = run(&ex, &x, &ids, &w, &c);
        // Every tier with a bf16 dot rounds the prefill rows too (the
        // widening FMA tiles read them rounded where no bf16 tile runs them).
        let bf16_prefill = k.bf16x_mr().is_some();
        let mut decode = vec![7.0f32; prefill.len()];
        if bf16_prefill {
            compared = true;
            let h = c.hidden;
            for r in 0..rows {
                let (ir, hr) = (r * c.top_k..(r + 1) * c.top_k, r * h..(r + 1) * h);
                let mut out = vec![7.0f32; c.top_k * h];
                ex.execute(1, &x[hr], &ids[ir.clone()], &w[ir], c.top_k, &mut out)
                    .expect("execute");
                decode[r * c.top_k * h..(r + 1) * c.top_k * h].copy_from_slice(&out);
            }
        }
        for (s, id) in ids.iter().enumerate() {
            let span = s * c.hidden..(s + 1) * c.hidden;
            let (a, b) = (&prefill[span.clone()], &want[span.clone()]);
            if *id == SKIP_SLOT {
                assert!(a.iter().all(|&v| v == 7.0), "skipped slot written");
                continue;
            }
            let norm = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let err = a
                .iter()
                .zip(b)
                .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
            assert!(
                err <= 0.02 * norm + 1e-6,
                "{} slot {s}: err {err} vs norm {norm}",
                tier.name()
            );
            if bf16_prefill {
                let d = &decode[span];
                let err = a
                    .iter()
                    .zip(d)
                    .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
                assert!(
                    err <= 5e-3 * norm + 1e-5,
                    "{} prefill vs decode slot {s}: err {err} vs norm {norm}",
                    tier.name()
                );
            }
        }
    }
    if !compared {
        eprintln!(
            "SKIPPED: no tier here runs the prefill path on bf16 activations (BFMMLA, AMX, a bf16 dot tile); \
             prefill vs decode not compared"
        );
    }
}

#[test]
fn experts_packed_int8_is_close_and_identical_across_tiers() {
    let pool = Arc::new(ExpertPool::new(Some(2), false).expect("pool"));
    let mut rng = StdRng::seed_from_u64(12);
    for c in CASES {
        let ms = mlps(&mut rng, c);
        let reference = portable(&ms, c.hidden);
        for rows in [1usize, 4, 33] {
            let x: Vec<f32> = (0..rows * c.hidden)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let (ids, w) = routing(&mut rng, rows, c);
            let want = run(&reference, &x, &ids, &w, c);
            let twin = run(
                &packed(&ms, c.hidden, |_| PackedDtype::Int8, &pool)
                    .with_kernels(Kernels::generic()),
                &x,
                &ids,
                &w,
                c,
            );
            for (s, id) in ids.iter().enumerate() {
                let (a, b) = (
                    &twin[s * c.hidden..(s + 1) * c.hidden],
                    &want[s * c.hidden..(s + 1) * c.hidden],
                );
                if *id == SKIP_SLOT {
                    assert!(a.iter().all(|&v| v == 7.0), "skipped slot written");
                    continue;
                }
                let norm = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let err = a
                    .iter()
                    .zip(b)
                    .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
                assert!(
                    err <= 0.03 * norm + 1e-6,
                    "int8 slot {s}: err {err} vs norm {norm}"
                );
            }
            for tier in Tier::available() {
                let k = Kernels::for_tier(tier).expect("tier");
                let ex = packed(&ms, c.hidden, |_| PackedDtype::Int8, &pool).with_kernels(k);
                assert_eq!(
                    run(&ex, &x, &ids, &w, c),
                    twin,
                    "{} rows={rows}",
                    tier.name()
                );
            }
        }
    }
}

#[test]
fn experts_int8_prefill_tiles_equal_the_twin_on_every_tier() {
    // Enough tokens per expert for every tier's prefill path (AMX tiles
    // included, crossing its K and panel blocks at these sizes under test):
    // int8 sums are exact, so every tier equals the scalar twin bit for bit.
    let pool = Arc::new(ExpertPool::new(Some(2), false).expect("pool"));
    let mut rng = StdRng::seed_from_u64(17);
    for c in CASES {
        let ms = mlps(&mut rng, c);
        for rows in [60usize, 120] {
            let x: Vec<f32> = (0..rows * c.hidden)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let (ids, w) = routing(&mut rng, rows, c);
            let twin = run(
                &packed(&ms, c.hidden, |_| PackedDtype::Int8, &pool)
                    .with_kernels(Kernels::generic()),
                &x,
                &ids,
                &w,
                c,
            );
            for tier in Tier::available() {
                let k = Kernels::for_tier(tier).expect("tier");
                let ex = packed(&ms, c.hidden, |_| PackedDtype::Int8, &pool).with_kernels(k);
                assert_eq!(
                    run(&ex, &x, &ids, &w, c),
                    twin,
                    "{} h={} rows={rows}",
                    tier.name(),
                    c.hidden
                );
            }
        }
    }
}

#[test]
fn experts_mixed_precision_uses_each_experts_own_dtype() {
    let pool = Arc::new(ExpertPool::new(Some(1), false).expect("pool"));
    let mut rng = StdRng::seed_from_u64(13);
    let c = &CASES[0];
    let ms = mlps(&mut rng, c);
    let rows = 6;
    let x: Vec<f32> = (0..rows * c.hidden)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let (ids, w) = routing(&mut rng, rows, c);
    let is_i8 = |e: usize| e % 2 == 1;
    let dt = |e: usize| {
        if is_i8(e) {
            PackedDtype::Int8
        } else {
            PackedDtype::Bf16
        }
    };
    let mixed = run(&packed(&ms, c.hidden, dt, &pool), &x, &ids, &w, c);
    let all_bf = run(
        &packed(&ms, c.hidden, |_| PackedDtype::Bf16, &pool),
        &x,
        &ids,
        &w,
        c,
    );
    let all_i8 = run(
        &packed(&ms, c.hidden, |_| PackedDtype::Int8, &pool),
        &x,
        &ids,
        &w,
        c,
    );
    for (s, &id) in ids.iter().enumerate() {
        if id == SKIP_SLOT {
            continue;
        }
        let want = if is_i8(id as usize) { &all_i8 } else { &all_bf };
        assert_eq!(
            &mixed[s * c.hidden..(s + 1) * c.hidden],
            &want[s * c.hidden..(s + 1) * c.hidden]
        );
    }
}

/// `execute_rows` with rows quantized already (the int8 wire): int8 experts
/// use them as given, so their slots equal `execute` on the f32 rows (which
/// quantizes them the same way) bit for bit; bf16 experts use the f32 rows
/// (here the dequantized ones). Quantized rows of the wrong size are refused.
#[test]
fn experts_take_prequantized_rows_as_given() {
    use crate::kernels::layout::quantize_row_i8;
    use crate::moe::{QuantizedRows, Rows};
    let pool = Arc::new(ExpertPool::new(Some(1), false).expect("pool"));
    let mut rng = StdRng::seed_from_u64(15);
    let c = &CASES[1];
    let ms = mlps(&mut rng, c);
    let rows = 5;
    let x: Vec<f32> = (0..rows * c.hidden)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let mut q = vec![0i8; x.len()];
    let scales: Vec<f32> = q
        .chunks_mut(c.hidden)
        .zip(x.chunks(c.hidden))
        .map(|(qr, xr)| quantize_row_i8(xr, qr))
        .collect();
    let deq: Vec<f32> = q
        .chunks(c.hidden)
        .zip(&scales)
        .flat_map(|(qr, &s)| qr.iter().map(move |&v| s * v as f32))
        .collect();
    let (ids, w) = routing(&mut rng, rows, c);
    let is_i8 = |e: usize| e.is_multiple_of(2);
    let ex = packed(
        &ms,
        c.hidden,
        |e| {
            if is_i8(e) {
                PackedDtype::Int8
            } else {
                PackedDtype::Bf16
            }
        },
        &pool,
    );
    let from_f32 = run(&ex, &x, &ids, &w, c);
    let from_deq = run(&ex, &deq, &ids, &w, c);
    let mut got = vec![7.0f32; ids.len() * c.hidden];
    let pre = Rows {
        f32: &deq,
        int8: Some(QuantizedRows {
            q: &q,
            scales: &scales,
        }),
    };
    ex.execute_rows(1, pre, &ids, &w, c.top_k, &mut got)
        .expect("execute_rows");
    for (s, &id) in ids.iter().enumerate() {
        let span = s * c.hidden..(s + 1) * c.hidden;
        let want = if id == SKIP_SLOT || !is_i8(id as usize) {
            &from_deq[span.clone()]
        } else {
            &from_f32[span.clone()]
        };
        assert_eq!(&got[span], want, "slot {s} (expert {id})");
    }
    let short = Rows {
        f32: &deq,
        int8: Some(QuantizedRows {
            q: &q[1..],
            scales: &scales,
        }),
    };
    assert!(
        ex.execute_rows(1, short, &ids, &w, c.top_k, &mut got)
            .is_err()
    );
    let few = Rows {
        f32: &deq,
        int8: Some(QuantizedRows {
            q: &q,
            scales: &scales[1..],
        }),
    };
    assert!(
        ex.execute_rows(1, few, &ids, &w, c.top_k, &mut got)
            .is_err()
    );
}

#[test]
fn experts_reject_bad_input_without_panicking() {
    let pool = Arc::new(ExpertPool::new(Some(1), false).expect("pool"));
    let mut rng = StdRng::seed_from_u64(14);
    let c = &CASES[2];
    let ms = mlps(&mut rng, c);
    let mut experts: Vec<Option<PackedExpert>> = ms
        .iter()
        .map(|m| PackedExpert::from_mlp(m, PackedDtype::Bf16, false).ok())
        .collect();
    experts[2] = None;
    let ex = PackedExperts::new(vec![None, Some(experts)], c.hidden, pool).expect("executor");
    let x = vec![0.5f32; c.hidden];
    let mut out = vec![0.0f32; c.hidden];
    assert!(
        ex.execute(1, &x, &[9], &[1.0], 1, &mut out).is_err(),
        "id out of range"
    );
    assert!(
        ex.execute(1, &x, &[2], &[1.0], 1, &mut out).is_err(),
        "expert not held"
    );
    assert!(
        ex.execute(0, &x, &[1], &[1.0], 1, &mut out).is_err(),
        "layer without experts"
    );
    assert!(
        ex.execute(1, &x[1..], &[1], &[1.0], 1, &mut out).is_err(),
        "ragged rows"
    );
    assert!(
        ex.execute(1, &x, &[1], &[1.0], 1, &mut out[1..]).is_err(),
        "short output"
    );
    // All slots skipped and zero rows are fine.
    ex.execute(1, &x, &[SKIP_SLOT], &[1.0], 1, &mut out)
        .expect("all skipped");
    ex.execute(1, &[], &[], &[], 1, &mut []).expect("no rows");
}

#[test]
fn experts_auto_dtype_refuses_to_round() {
    let w = Weight::from_f32(vec![1, 2], &[0.1, 0.5]);
    let down = Weight::from_f32(vec![2, 1], &[0.5, 0.25]);
    let r = PackedExpert::from_weights(
        &w,
        &w,
        &down,
        2,
        1,
        Activation::Silu,
        PackedDtype::Bf16,
        true,
    );
    assert!(matches!(r, Err(crate::Error::Dispatch(m)) if m.starts_with(packed::NOT_BF16_EXACT)));
    let ok = Weight::from_f32(vec![1, 2], &[0.25, 0.5]);
    assert!(
        PackedExpert::from_weights(
            &ok,
            &ok,
            &down,
            2,
            1,
            Activation::Silu,
            PackedDtype::Bf16,
            true
        )
        .is_ok()
    );
    assert_eq!(ExpertDtype::parse("INT8"), Some(ExpertDtype::Int8));
    assert_eq!(ExpertDtype::parse("fp8"), None);
}

#[test]
fn compressed_tensors_int8_experts_load_without_a_float_round_trip() {
    // The committed fixture `qwen3_moe_b/w8a8` (layer 1 is the first MoE layer).
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_b/w8a8");
    let cfg = crate::config::ModelConfig::from_dir(&dir).expect("config");
    let ws = WeightStore::open(&dir).expect("weights");
    let opts = LoadOptions {
        threads: Some(1),
        ..LoadOptions::default()
    };
    let ex = PackedExperts::load_filtered(&cfg, &ws, &opts, &|_, _| true).expect("load");
    let (h, inter) = (cfg.hidden_size, cfg.moe_intermediate_size);
    for e in 0..cfg.num_experts {
        let p = ex.expert(1, e).expect("expert");
        assert_eq!(p.dtype(), PackedDtype::Int8, "expert {e}");
        let q = ws
            .get_i8_channelwise(
                &format!("model.layers.1.mlp.experts.{e}.down_proj.weight"),
                &[h, inter],
            )
            .expect("read")
            .expect("int8");
        let packed::PackedData::I8 { data, scales } = p.down.data() else {
            panic!("down is not int8");
        };
        // Scales exactly as stored; every int8 value in its panel slot.
        assert_eq!(&scales[..h], &q.scales[..]);
        let kp = crate::kernels::layout::i8_padded_k(inter);
        let d = data.as_slice();
        for c in 0..h {
            let (pn, cc) = (c / 16, c % 16);
            for k in 0..inter {
                let at = pn * kp * 16 + crate::kernels::layout::i8_index(k, cc);
                assert_eq!(d[at], q.row(c)[k], "expert {e} ch {c} k {k}");
            }
        }
    }
    // Asked for bf16, the same checkpoint is dequantized and packed bf16.
    let opts = LoadOptions {
        threads: Some(1),
        expert_dtype: ExpertDtype::Bf16,
        ..LoadOptions::default()
    };
    let ex = PackedExperts::load_filtered(&cfg, &ws, &opts, &|_, _| true).expect("load bf16");
    assert_eq!(ex.expert(1, 0).map(|p| p.dtype()), Some(PackedDtype::Bf16));
}

#[test]
fn int8_tensors_without_channel_scales_are_refused_clearly() {
    let dir = std::env::temp_dir().join(format!("epserve-i8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let q: Vec<u8> = vec![1, 2, 255, 4, 5, 6];
    let s = [0.5f32, 0.25, 1.0];
    let mut tensors = std::collections::HashMap::new();
    let sbytes: Vec<u8> = s.iter().flat_map(|v| v.to_le_bytes()).collect();
    tensors.insert(
        "a.weight".to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::I8, vec![2, 3], &q).expect("view"),
    );
    tensors.insert(
        "b.weight".to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::I8, vec![3, 2], &q).expect("view"),
    );
    tensors.insert(
        "b.weight_scale".to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![3, 1], &sbytes)
            .expect("view"),
    );
    safetensors::serialize_to_file(&tensors, None, &dir.join("model.safetensors")).expect("write");
    let ws = WeightStore::open(&dir).expect("open");
    let err = ws
        .get("a.weight", &[2, 3])
        .expect_err("no scale")
        .to_string();
    assert!(
        err.contains("a.weight") && err.contains("weight_scale"),
        "{err}"
    );
    let b = ws
        .get("b.weight", &[3, 2])
        .expect("dequantized")
        .to_f32_vec();
    assert_eq!(b, vec![0.5, 1.0, -0.25, 1.0, 5.0, 6.0]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bf16_checkpoint_packs_bit_for_bit_as_the_f32_route() {
    // The direct bf16 → panel copy (what a tiered executor's miss runs)
    // against the general route (rows widened to f32, rounded back), at odd
    // sizes: odd K, a partial last panel, fewer pairs than one block.
    let mut rng = StdRng::seed_from_u64(21);
    for (hidden, inter) in [(64, 48), (37, 13), (5, 3), (130, 40)] {
        let g = bf16_weight(&mut rng, inter, hidden, 1.0);
        let u = bf16_weight(&mut rng, inter, hidden, 1.0);
        let d = bf16_weight(&mut rng, hidden, inter, 1.0);
        let fast = PackedExpert::from_weights(
            &g,
            &u,
            &d,
            hidden,
            inter,
            Activation::Silu,
            PackedDtype::Bf16,
            true,
        )
        .expect("fast");
        let widen = |w: &Weight| Weight::from_f32(w.shape().to_vec(), &w.to_f32_vec());
        let slow = PackedExpert::from_weights(
            &widen(&g),
            &widen(&u),
            &widen(&d),
            hidden,
            inter,
            Activation::Silu,
            PackedDtype::Bf16,
            true,
        )
        .expect("slow");
        let pack_i8 = |g: &Weight, u: &Weight, d: &Weight| {
            PackedExpert::from_weights(
                g,
                u,
                d,
                hidden,
                inter,
                Activation::Silu,
                PackedDtype::Int8,
                false,
            )
            .expect("int8")
        };
        let fast_q = pack_i8(&g, &u, &d);
        let slow_q = pack_i8(&widen(&g), &widen(&u), &widen(&d));
        for (a, b) in [
            (&fast.gate_up, &slow.gate_up),
            (&fast.down, &slow.down),
            (&fast_q.gate_up, &slow_q.gate_up),
            (&fast_q.down, &slow_q.down),
        ] {
            assert_eq!((a.k(), a.panels()), (b.k(), b.panels()));
            match (a.data(), b.data()) {
                (packed::PackedData::Bf16(x), packed::PackedData::Bf16(y)) => {
                    assert_eq!(x.as_slice(), y.as_slice(), "{hidden}x{inter}")
                }
                (
                    packed::PackedData::I8 { data, scales },
                    packed::PackedData::I8 {
                        data: d2,
                        scales: s2,
                    },
                ) => {
                    assert_eq!(data.as_slice(), d2.as_slice(), "{hidden}x{inter}");
                    assert_eq!(scales, s2, "{hidden}x{inter}");
                }
                _ => panic!("precisions differ"),
            }
        }
    }
}

#[test]
fn packing_into_a_dirty_spare_buffer_equals_packing_fresh() {
    // A tiered miss packs into the buffers of the expert it evicted: those
    // hold the old expert's values, so whatever the new one does not write
    // (padding) must come out zero. Shapes with and without padding.
    let mut rng = StdRng::seed_from_u64(5);
    for (hidden, inter) in [(64, 48), (37, 13), (130, 40)] {
        for dtype in [PackedDtype::Bf16, PackedDtype::Int8] {
            let mk = |rng: &mut StdRng| {
                let g = bf16_weight(rng, inter, hidden, 1.0);
                let u = bf16_weight(rng, inter, hidden, 1.0);
                let d = bf16_weight(rng, hidden, inter, 1.0);
                (g, u, d)
            };
            let pack = |w: &(Weight, Weight, Weight), spare: &mut packed::Spare| {
                PackedExpert::from_weights_reusing(
                    &w.0,
                    &w.1,
                    &w.2,
                    hidden,
                    inter,
                    Activation::Silu,
                    dtype,
                    false,
                    spare,
                )
                .expect("pack")
            };
            // The old expert's buffers, filled with a non-zero pattern.
            let (a, b) = (mk(&mut rng), mk(&mut rng));
            let mut spare = packed::Spare::default();
            spare.add(pack(&a, &mut packed::Spare::default()));
            spare.scribble();
            let reused = pack(&b, &mut spare);
            assert_eq!(spare.bytes(), 0, "both buffers reused");
            let fresh = pack(&b, &mut packed::Spare::default());
            for (x, y) in [
                (&reused.gate_up, &fresh.gate_up),
                (&reused.down, &fresh.down),
            ] {
                let same = match (x.data(), y.data()) {
                    (packed::PackedData::Bf16(p), packed::PackedData::Bf16(q)) => {
                        p.as_slice() == q.as_slice()
                    }
                    (
                        packed::PackedData::I8 { data: p, scales: s },
                        packed::PackedData::I8 { data: q, scales: t },
                    ) => p.as_slice() == q.as_slice() && s == t,
                    _ => false,
                };
                assert!(same, "{hidden}x{inter} {dtype:?}");
            }
        }
    }
}

/// How long one miss's packing takes on a real-sized checkpoint:
/// `EPSERVE_PACK_MODEL=DIR cargo test --release -p epserve-core pack_timing
/// -- --ignored --nocapture` (not a pass/fail check: it prints to stderr).
#[test]
#[ignore]
fn pack_timing() {
    let Ok(dir) = std::env::var("EPSERVE_PACK_MODEL") else {
        return;
    };
    let dir = std::path::Path::new(&dir);
    let cfg = crate::config::ModelConfig::from_dir(dir).expect("config");
    let ws = WeightStore::open(dir).expect("weights");
    let layer = (0..cfg.num_hidden_layers)
        .find(|&i| cfg.layers[i].ffn == crate::config::FfnKind::Moe)
        .expect("a MoE layer");
    let names = crate::loader::names::ExpertNames::resolve(&cfg, &ws, layer).expect("names");
    let n = cfg.num_experts.min(32);
    for dtype in [ExpertDtype::Auto, ExpertDtype::Int8] {
        let t = std::time::Instant::now();
        let mut bytes = 0;
        for e in 0..n {
            let p = load::pack_expert(&cfg, &ws, &names, dtype, layer, e, &mut Default::default())
                .expect("pack");
            bytes += p.weight_bytes();
        }
        let s = t.elapsed().as_secs_f64();
        eprintln!(
            "{dtype:?}: {:.2} ms per expert, {:.2} GB/s packed",
            s * 1e3 / n as f64,
            bytes as f64 / s / 1e9
        );
        // The same experts again: their checkpoint pages are mapped now.
        let t = std::time::Instant::now();
        for e in 0..n {
            load::pack_expert(&cfg, &ws, &names, dtype, layer, e, &mut Default::default())
                .expect("pack");
        }
        eprintln!(
            "{dtype:?} again: {:.2} ms per expert",
            t.elapsed().as_secs_f64() * 1e3 / n as f64
        );
    }
}

/// [`execute_combined`] reuses its per-slot buffer across calls on a thread
/// without zeroing it: a call with skipped slots after one that filled every
/// slot must still combine exactly what fresh zeroed memory gives.
#[test]
fn combined_outputs_do_not_leak_between_calls() {
    let mut rng = StdRng::seed_from_u64(41);
    let c = Case {
        hidden: 24,
        inter: 16,
        experts: 6,
        top_k: 2,
    };
    let ms = mlps(&mut rng, &c);
    let ex = portable(&ms, c.hidden);
    let fresh = |x: &[f32], ids: &[u32], w: &[f32], rows: usize| {
        let mut out = vec![0.0f32; ids.len() * c.hidden];
        ex.execute(1, x, ids, w, c.top_k, &mut out)
            .expect("execute");
        let mut y = vec![0.0f32; rows * c.hidden];
        crate::moe::combine(&out, rows, c.top_k, c.hidden, &mut y);
        y
    };
    // Largest first (every slot written), then fewer rows with skipped
    // slots, then more rows again (the buffer grows), all skipped.
    for (rows, skip_every) in [(9, 0), (5, 2), (7, 3), (11, 1)] {
        let x: Vec<f32> = (0..rows * c.hidden)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut ids = Vec::new();
        let mut w = Vec::new();
        for s in 0..rows * c.top_k {
            ids.push(if skip_every > 0 && s % skip_every == 0 {
                SKIP_SLOT
            } else {
                1 + (s % (c.experts - 1)) as u32
            });
            w.push(rng.random_range(0.1f32..1.0));
        }
        let routing = crate::moe::Routing {
            num_tokens: rows,
            top_k: c.top_k,
            topk_ids: ids.clone(),
            topk_weights: w.clone(),
        };
        let got = execute_combined(&ex, 1, &x, c.hidden, &routing).expect("combined");
        assert_eq!(
            got,
            fresh(&x, &ids, &w, rows),
            "rows {rows}, skip every {skip_every}"
        );
    }
}
