//! Every supported tier's micro-kernels against the scalar twins, on random
//! and adversarial shapes, plus the packing layouts against a naive matmul.
//!
//! Tolerances: int8 tiles accumulate exactly in i32, so they must equal the
//! twin bit for bit. bf16 tiles (f32 or bf16 activations) sum the same exact
//! f32 products in a different order (split accumulators; `vdpbf16ps` and
//! `bfdot` add two products per step, `bfmmla` four, rounding to odd), so `|fast − twin| ≤ 1e-5 · Σ|x·w| +
//! 1e-30`. Tiers this CPU lacks are listed on stderr as SKIPPED.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::kernels::dispatch::{Kernels, Tier};
use crate::kernels::generic;
use crate::kernels::layout::*;

const KCS: &[usize] = &[1, 2, 3, 7, 8, 9, 16, 31, 33, 100, 256, 513];

fn rand_bf16(rng: &mut StdRng, n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| f32_to_bf16_bits(rng.random_range(-1.0f32..1.0)))
        .collect()
}

fn tiers() -> Vec<Kernels> {
    let t: Vec<Kernels> = Tier::available()
        .into_iter()
        .filter_map(Kernels::for_tier)
        .collect();
    eprintln!(
        "tiers under test: {:?}",
        t.iter().map(|k| k.tier().name()).collect::<Vec<_>>()
    );
    for s in Tier::unavailable() {
        eprintln!(
            "SKIPPED: kernel tier {} is not supported by this CPU; its tests did not run here",
            s.name()
        );
    }
    t
}

fn check_bf16x(k: &Kernels, w: &[u16], rows: &[Vec<u16>]) {
    let kp = w.len() / NR;
    let x: Vec<&[u16]> = rows.iter().map(|r| &r[..]).collect();
    let t = x.len();
    let init: Vec<f32> = (0..t * NR).map(|i| i as f32 * 0.25).collect();
    let mut want = init.clone();
    generic::bf16x_tile(w, &x, &mut want);
    let mut got = init.clone();
    k.bf16x_tile(w, &x, &mut got);
    for tt in 0..t {
        for c in 0..NR {
            let mag: f32 = (0..kp)
                .map(|kk| {
                    (bf16_bits_to_f32(x[tt][kk]) * bf16_bits_to_f32(w[bf16_index(kk, c)])).abs()
                })
                .sum::<f32>()
                + init[tt * NR + c].abs();
            let (a, b) = (got[tt * NR + c], want[tt * NR + c]);
            assert!(
                (a - b).abs() <= 1e-5 * mag + 1e-30,
                "{:?} bf16x kp={kp} t={t} row {tt} ch {c}: {a} vs {b}",
                k.tier()
            );
        }
    }
}

/// The BFMMLA prefill tile (or, on tiers without one, the twin behind
/// `Kernels::bf16mm_tile`) on `rows` split into token tiles of at most
/// `bf16mm_mr` rows (equal and even, as the executor splits them), each
/// packed by `pack_mm_bf16` from offset 1, against the twin. The twin itself
/// must equal the bf16 × bf16 decode twin on the unpacked rows bit for bit
/// (the same products summed in the same order).
fn check_bf16mm(k: &Kernels, w: &[u16], rows: &[Vec<u16>]) {
    let kp = w.len() / NR;
    let n = rows.len();
    let mr = k.bf16mm_mr().unwrap_or(4);
    let tn_max = n.div_ceil(n.div_ceil(mr)).next_multiple_of(2).min(mr);
    let init: Vec<f32> = (0..n * NR).map(|i| i as f32 * 0.25).collect();
    let mut got = init.clone();
    let mut twin = init.clone();
    let mut t0 = 0;
    while t0 < n {
        let tn = tn_max.min(n - t0);
        let x: Vec<&[u16]> = rows[t0..t0 + tn].iter().map(|r| &r[..]).collect();
        // Pack behind a non-empty prefix: the stream is appended.
        let mut xa = vec![0x7FC0u16; 5];
        pack_mm_bf16(&x, 1, kp, &mut xa);
        assert_eq!(xa.len(), 5 + mm_padded_k(kp) * tn.div_ceil(2) * 2);
        let span = t0 * NR..(t0 + tn) * NR;
        k.bf16mm_tile(w, tn, &xa[5..], &mut got[span.clone()]);
        generic::bf16mm_tile(w, tn, &xa[5..], &mut twin[span.clone()]);
        let shifted: Vec<&[u16]> = x.iter().map(|r| &r[1..]).collect();
        let mut dec = init[span.clone()].to_vec();
        generic::bf16x_tile(w, &shifted, &mut dec);
        assert_eq!(
            &twin[span],
            &dec[..],
            "bf16mm twin vs bf16x twin kp={kp} t={tn}"
        );
        t0 += tn;
    }
    for r in 0..n {
        for c in 0..NR {
            let mag: f32 = (0..kp)
                .map(|kk| {
                    (bf16_bits_to_f32(rows[r][1 + kk]) * bf16_bits_to_f32(w[bf16_index(kk, c)]))
                        .abs()
                })
                .sum::<f32>()
                + init[r * NR + c].abs();
            let (a, b) = (got[r * NR + c], twin[r * NR + c]);
            assert!(
                (a - b).abs() <= 1e-5 * mag + 1e-30,
                "{:?} bf16mm kp={kp} n={n} row {r} ch {c}: {a} vs {b}",
                k.tier()
            );
        }
    }
}

fn check_bf16(k: &Kernels, w: &[u16], kc: usize, rows: &[Vec<f32>]) {
    let x: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
    let t = x.len();
    // Start from a non-zero accumulator: tiles add into it.
    let init: Vec<f32> = (0..t * NR).map(|i| i as f32 * 0.25).collect();
    let mut want = init.clone();
    generic::bf16_tile(w, kc, &x, &mut want);
    let mut got = init.clone();
    k.bf16_tile(w, kc, &x, &mut got);
    for tt in 0..t {
        for c in 0..NR {
            let mag: f32 = (0..kc)
                .map(|kk| (x[tt][kk] * bf16_bits_to_f32(w[bf16_index(kk, c)])).abs())
                .sum::<f32>()
                + init[tt * NR + c].abs();
            let (a, b) = (got[tt * NR + c], want[tt * NR + c]);
            assert!(
                (a - b).abs() <= 1e-5 * mag + 1e-30,
                "{:?} kc={kc} t={t} row {tt} ch {c}: {a} vs {b}",
                k.tier()
            );
        }
    }
}

/// The two-panel tile (or, on tiers without one, the twin behind
/// `Kernels::bf16_pair_tile`) on rows packed by `pack_pairs_f32`, against
/// two single-panel scalar twins on the unpacked rows.
fn check_bf16_pair(k: &Kernels, w: [&[u16]; 2], kc: usize, rows: &[Vec<f32>]) {
    let x: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
    let t = x.len();
    let init: Vec<f32> = (0..t * NR).map(|i| i as f32 * 0.25).collect();
    // Pack behind a non-empty prefix: the stream is appended.
    let mut xp = vec![9.0f32; 3];
    pack_pairs_f32(&x, 1, kc, &mut xp);
    assert_eq!(xp.len(), 3 + bf16_padded_k(kc) * t);
    let shifted: Vec<&[f32]> = x.iter().map(|r| &r[1..]).collect();
    let mut got = [init.clone(), init.clone()];
    let [g0, g1] = &mut got;
    k.bf16_pair_tile(w, kc, t, &xp[3..], [&mut g0[..], &mut g1[..]]);
    for j in 0..2 {
        let mut want = init.clone();
        generic::bf16_tile(w[j], kc, &shifted, &mut want);
        for tt in 0..t {
            for c in 0..NR {
                let mag: f32 = (0..kc)
                    .map(|kk| (shifted[tt][kk] * bf16_bits_to_f32(w[j][bf16_index(kk, c)])).abs())
                    .sum::<f32>()
                    + init[tt * NR + c].abs();
                let (a, b) = (got[j][tt * NR + c], want[tt * NR + c]);
                assert!(
                    (a - b).abs() <= 1e-5 * mag + 1e-30,
                    "{:?} pair panel {j} kc={kc} t={t} row {tt} ch {c}: {a} vs {b}",
                    k.tier()
                );
            }
        }
    }
}

fn check_i8(k: &Kernels, w: &[i8], rows: &[Vec<i8>]) {
    let x: Vec<&[i8]> = rows.iter().map(|r| &r[..]).collect();
    let t = x.len();
    let init: Vec<i32> = (0..t * NR).map(|i| i as i32 - 7).collect();
    let mut want = init.clone();
    generic::i8_tile(w, &x, &mut want);
    let mut got = init;
    k.i8_tile(w, &x, &mut got);
    assert_eq!(
        got,
        want,
        "{:?} groups={} t={t}",
        k.tier(),
        w.len() / I8_GROUP_BYTES
    );
}

#[test]
fn bf16_tiles_match_twin_on_random_shapes() {
    let mut rng = StdRng::seed_from_u64(1);
    for k in tiers() {
        for &kc in KCS {
            let w = rand_bf16(&mut rng, bf16_padded_k(kc) * NR);
            for t in 1..=k.bf16_mr() {
                // Rows longer than kc: tiles must read only the first kc
                // (a NaN past the end would poison the sums).
                let rows: Vec<Vec<f32>> = (0..t)
                    .map(|_| {
                        (0..kc)
                            .map(|_| rng.random_range(-2.0f32..2.0))
                            .chain([f32::NAN; 3])
                            .collect()
                    })
                    .collect();
                check_bf16(&k, &w, kc, &rows);
            }
        }
    }
}

#[test]
fn bf16_pair_tiles_match_twin_on_random_shapes() {
    let mut rng = StdRng::seed_from_u64(5);
    // The generic twin behind tiers without a two-panel tile runs too.
    for k in tiers().into_iter().chain([Kernels::generic()]) {
        let mr = k.bf16_pair_mr().unwrap_or(3);
        for &kc in KCS {
            let w0 = rand_bf16(&mut rng, bf16_padded_k(kc) * NR);
            let w1 = rand_bf16(&mut rng, bf16_padded_k(kc) * NR);
            for t in 1..=mr {
                // One value before and NaNs after the packed range: tiles
                // must see only `kc` values from offset 1.
                let rows: Vec<Vec<f32>> = (0..t)
                    .map(|_| {
                        [f32::NAN]
                            .into_iter()
                            .chain((0..kc).map(|_| rng.random_range(-2.0f32..2.0)))
                            .chain([f32::NAN; 3])
                            .collect()
                    })
                    .collect();
                check_bf16_pair(&k, [&w0, &w1], kc, &rows);
                // The same panel twice (the executor's odd last panel).
                check_bf16_pair(&k, [&w0, &w0], kc, &rows);
            }
        }
    }
}

#[test]
fn bf16_tiles_on_adversarial_values() {
    // Huge and tiny magnitudes, exact zeros, negative zero, cancellation.
    let vals = [0.0f32, -0.0, 1e30, -1e30, 1e-30, 3.0, -3.0, 65504.0];
    for k in tiers() {
        for &kc in &[1usize, 5, 17] {
            let w: Vec<u16> = (0..bf16_padded_k(kc) * NR)
                .map(|i| f32_to_bf16_bits(vals[i % vals.len()]))
                .collect();
            for t in 1..=k.bf16_mr() {
                let rows: Vec<Vec<f32>> = (0..t)
                    .map(|r| (0..kc).map(|i| vals[(i + r) % 3 + 5]).collect())
                    .collect();
                check_bf16(&k, &w, kc, &rows);
            }
            for t in 1..=k.bf16_pair_mr().unwrap_or(0) {
                let rows: Vec<Vec<f32>> = (0..t)
                    .map(|r| (0..=kc).map(|i| vals[(i + r) % 3 + 5]).collect())
                    .collect();
                check_bf16_pair(&k, [&w, &w[..]], kc, &rows);
            }
            if let Some(mr) = k.bf16x_mr() {
                for t in 1..=mr {
                    let rows: Vec<Vec<u16>> = (0..t)
                        .map(|r| {
                            (0..bf16_padded_k(kc))
                                .map(|i| f32_to_bf16_bits(vals[(i + r) % 4 + 4]))
                                .collect()
                        })
                        .collect();
                    check_bf16x(&k, &w, &rows);
                }
            }
            if let Some(mr) = k.bf16mm_mr() {
                for t in 1..=2 * mr + 1 {
                    let rows: Vec<Vec<u16>> = (0..t)
                        .map(|r| {
                            (0..=bf16_padded_k(kc))
                                .map(|i| f32_to_bf16_bits(vals[(i + r) % 4 + 4]))
                                .collect()
                        })
                        .collect();
                    check_bf16mm(&k, &w, &rows);
                }
            }
        }
    }
}

#[test]
fn bf16x_tiles_match_twin_on_random_shapes() {
    let mut rng = StdRng::seed_from_u64(4);
    let mut ran = false;
    for k in tiers() {
        let Some(mr) = k.bf16x_mr() else { continue };
        ran = true;
        for &kc in KCS {
            let kp = bf16_padded_k(kc);
            let w = rand_bf16(&mut rng, kp * NR);
            for t in 1..=mr {
                // Zero padding past kc, as the executor lays rows out.
                let rows: Vec<Vec<u16>> = (0..t)
                    .map(|_| {
                        let mut r = rand_bf16(&mut rng, kp + 2);
                        r[kc..].fill(0);
                        r
                    })
                    .collect();
                check_bf16x(&k, &w, &rows);
            }
        }
    }
    // The generic entry point falls back to the twin on other tiers.
    let g = Kernels::generic();
    let w = rand_bf16(&mut rng, 6 * NR);
    check_bf16x(&g, &w, &[rand_bf16(&mut rng, 6)]);
    if !ran {
        eprintln!("SKIPPED: no tier with a native bf16 dot-product tile on this CPU");
    }
}

/// The two-panel bf16 dot tile (packed activations) against its twin and
/// against the one-panel twin on the unpacked rows: the same sums, so the
/// same bound as [`check_bf16x`].
#[test]
fn bf16x_pair_tiles_match_twin_on_random_shapes() {
    let mut rng = StdRng::seed_from_u64(14);
    let mut ran = false;
    for k in tiers() {
        let mr = k.bf16x_pair_mr().unwrap_or(MAX_MR_TEST);
        ran |= k.bf16x_pair_mr().is_some();
        for &kc in KCS {
            let kp = bf16_padded_k(kc);
            let w: [Vec<u16>; 2] = [rand_bf16(&mut rng, kp * NR), rand_bf16(&mut rng, kp * NR)];
            for t in 1..=mr {
                let rows: Vec<Vec<u16>> = (0..t)
                    .map(|_| {
                        let mut r = rand_bf16(&mut rng, kp);
                        r[kc..].fill(0);
                        r
                    })
                    .collect();
                let x: Vec<&[u16]> = rows.iter().map(|r| &r[..]).collect();
                let mut xp = Vec::new();
                pack_pairs_b16(&x, 0, kp, &mut xp);
                let init: Vec<f32> = (0..t * NR).map(|i| i as f32 * 0.25).collect();
                let (mut g0, mut g1) = (init.clone(), init.clone());
                k.bf16x_pair_tile([&w[0], &w[1]], t, &xp, [&mut g0, &mut g1]);
                for (j, got) in [g0, g1].iter().enumerate() {
                    let mut want = init.clone();
                    generic::bf16x_tile(&w[j], &x, &mut want);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        let (r, c) = (i / NR, i % NR);
                        let mag: f32 = (0..kp)
                            .map(|kk| {
                                (bf16_bits_to_f32(x[r][kk])
                                    * bf16_bits_to_f32(w[j][bf16_index(kk, c)]))
                                .abs()
                            })
                            .sum::<f32>()
                            + init[i].abs();
                        assert!(
                            (a - b).abs() <= 1e-5 * mag + 1e-30,
                            "{:?} bf16x pair kc={kc} t={t} panel {j} row {r} ch {c}: {a} vs {b}",
                            k.tier()
                        );
                    }
                }
            }
        }
    }
    if !ran {
        eprintln!(
            "SKIPPED: no tier with a native two-panel bf16 dot tile on this CPU (twins only)"
        );
    }
}

/// Rows the twins are tested with on tiers without a native tile.
const MAX_MR_TEST: usize = 5;

#[test]
fn bf16mm_tiles_match_twin_on_random_shapes() {
    let mut rng = StdRng::seed_from_u64(6);
    let mut ran = false;
    // The generic twin behind tiers without a BFMMLA tile runs too.
    for k in tiers().into_iter().chain([Kernels::generic()]) {
        let mr = k.bf16mm_mr().unwrap_or(4);
        ran |= k.bf16mm_mr().is_some();
        // Odd pair counts (1, 5, 17, 257) and K not a multiple of 4.
        for &kc in KCS {
            let kp = bf16_padded_k(kc);
            let w = rand_bf16(&mut rng, kp * NR);
            for t in 1..=2 * mr + 1 {
                // One value before the packed range (NaN bits) and zero
                // padding past kc, as the executor lays rows out.
                let rows: Vec<Vec<u16>> = (0..t)
                    .map(|_| {
                        let mut r = rand_bf16(&mut rng, kp + 3);
                        r[0] = 0x7FC0;
                        r[1 + kc..].fill(0);
                        r
                    })
                    .collect();
                check_bf16mm(&k, &w, &rows);
            }
        }
    }
    if !ran {
        eprintln!("SKIPPED: no tier with a native bf16 matrix-multiply (BFMMLA) tile on this CPU");
    }
}

#[test]
fn i8_tiles_match_twin_exactly() {
    let mut rng = StdRng::seed_from_u64(2);
    for k in tiers() {
        for &kc in KCS {
            let groups = i8_padded_k(kc) / KG;
            let w: Vec<i8> = (0..groups * I8_GROUP_BYTES)
                .map(|_| rng.random_range(-127i8..=127))
                .collect();
            for t in 1..=k.i8_mr() {
                let rows: Vec<Vec<i8>> = (0..t)
                    .map(|_| {
                        (0..groups * KG + 5)
                            .map(|_| rng.random_range(-127i8..=127))
                            .collect()
                    })
                    .collect();
                check_i8(&k, &w, &rows);
            }
        }
    }
}

#[test]
fn i8_tiles_do_not_saturate_at_the_extremes() {
    // All ±127: every i16 pair sum is at its largest (2·127² = 32258).
    for k in tiers() {
        for &groups in &[1usize, 3, 64] {
            for (wv, xv) in [(127i8, 127i8), (-127, 127), (-127, -127), (127, -127)] {
                let w = vec![wv; groups * I8_GROUP_BYTES];
                for t in 1..=k.i8_mr() {
                    let rows: Vec<Vec<i8>> = (0..t)
                        .map(|r| {
                            (0..groups * KG)
                                .map(|i| if (i + r) % 5 == 0 { 0 } else { xv })
                                .collect()
                        })
                        .collect();
                    check_i8(&k, &w, &rows);
                }
            }
        }
    }
}

#[test]
fn packed_layouts_compute_the_matmul() {
    // 19 channels (a padded second panel), K = 13 (padded int8 groups).
    let (n, kk) = (19usize, 13usize);
    let mut rng = StdRng::seed_from_u64(3);
    let w: Vec<f32> = (0..n * kk)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let x: Vec<f32> = (0..kk).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let wb: Vec<u16> = w.iter().map(|&v| f32_to_bf16_bits(v)).collect();
    let mut q = vec![0i8; n * kk];
    let scales: Vec<f32> = (0..n)
        .map(|c| quantize_row_i8(&w[c * kk..(c + 1) * kk], &mut q[c * kk..(c + 1) * kk]))
        .collect();
    let mut xq = vec![0i8; i8_padded_k(kk)];
    let xs = quantize_row_i8(&x, &mut xq);
    for p in 0..n.div_ceil(NR) {
        let row_b = |c: usize| {
            let ch = p * NR + c;
            (ch < n).then(|| &wb[ch * kk..(ch + 1) * kk])
        };
        let row_q = |c: usize| {
            let ch = p * NR + c;
            (ch < n).then(|| &q[ch * kk..(ch + 1) * kk])
        };
        let mut pb = Vec::new();
        pack_bf16_panel(kk, row_b, &mut pb);
        assert_eq!(pb.len(), bf16_padded_k(kk) * NR);
        let mut pq = Vec::new();
        pack_i8_panel(kk, row_q, &mut pq);
        let mut acc = vec![0.0f32; NR];
        generic::bf16_tile(&pb, kk, &[&x], &mut acc);
        let mut acci = vec![0i32; NR];
        generic::i8_tile(&pq, &[&xq], &mut acci);
        for c in 0..NR {
            let ch = p * NR + c;
            if ch >= n {
                assert_eq!(acc[c], 0.0);
                assert_eq!(acci[c], 0);
                continue;
            }
            let exact: f32 = (0..kk)
                .map(|i| x[i] * bf16_bits_to_f32(wb[ch * kk + i]))
                .sum();
            assert!((acc[c] - exact).abs() < 1e-5, "bf16 ch {ch}");
            let deq = acci[c] as f32 * scales[ch] * xs;
            let full: f32 = (0..kk).map(|i| x[i] * w[ch * kk + i]).sum();
            assert!((deq - full).abs() < 0.05, "int8 ch {ch}: {deq} vs {full}");
        }
    }
}

#[test]
fn peak_probes_run_on_every_tier() {
    for k in tiers() {
        let (flops, r) = k.fma_probe(10);
        assert!(flops > 0.0 && r.is_finite(), "{:?} fma probe", k.tier());
        if let Some((flops, r, name)) = k.bf16_dot_probe(10) {
            assert!(
                flops > 0.0 && r.is_finite() && !name.is_empty(),
                "{:?} bf16 probe",
                k.tier()
            );
        }
    }
}

#[test]
fn tier_names_round_trip() {
    for t in Tier::ALL {
        assert_eq!(Tier::parse(t.name()), Some(t));
    }
    assert!(Tier::Generic.supported());
    assert_eq!(Tier::parse("avx512"), Some(Tier::Avx512));
    assert_eq!(Tier::parse("avx512-bf16"), Some(Tier::Avx512Bf16));
    assert_eq!(Tier::parse("neon-bf16"), Some(Tier::NeonBf16));
    assert_eq!(Tier::parse("sve"), None);
    // The best tier is supported, and is the last supported one.
    let best = Kernels::best().tier();
    assert!(best.supported());
    assert_eq!(Tier::available().last().copied(), Some(best));
}

/// Attention's inner loops (`attn_scores`, `attn_accum`) on f32 and bf16
/// rows against the scalar twins: query counts around the 8/4/1 groups,
/// widths around every vector width (tails), strides wider than a row.
#[test]
fn attn_kernels_match_twin() {
    use crate::kernels::attention::KvRows;
    let mut rng = StdRng::seed_from_u64(11);
    let twin = Kernels::generic();
    for k in tiers() {
        for &d in &[1usize, 3, 4, 7, 8, 13, 16, 17, 31, 64, 128, 576] {
            // 40 keys: more than one chunk of the AVX2 value pass's
            // broadcast probabilities; 48 and 64: its even / odd passes
            // (`EO_MIN_KEYS`), 47 just short of them.
            for (m, n) in [1usize, 3, 4, 5, 8, 9, 13, 16]
                .into_iter()
                .map(|m| (m, 7usize))
                .chain([(4, 40), (5, 40), (8, 40), (9, 40), (12, 40)])
                .chain([(8, 47), (8, 48), (4, 64), (8, 64), (12, 64), (9, 70)])
            {
                let (stride, ld) = (d + 5, n + 4);
                let q: Vec<f32> = (0..m * d).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                let kf: Vec<f32> = (0..(n - 1) * stride + d)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect();
                let kb: Vec<u16> = kf.iter().map(|&x| f32_to_bf16_bits(x)).collect();
                let p: Vec<f32> = (0..m * ld).map(|_| rng.random_range(0.0f32..1.0)).collect();
                for rows in [KvRows::F32(&kf), KvRows::Bf16(&kb)] {
                    let mut want = vec![0.5f32; m * ld];
                    let mut got = want.clone();
                    twin.attn_scores(&q, d, rows, stride, n, 0.7, &mut want, ld);
                    k.attn_scores(&q, d, rows, stride, n, 0.7, &mut got, ld);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        // |q|, |k| ≤ 1: the dot's magnitude sum is ≤ d.
                        assert!(
                            (a - b).abs() <= 1e-5 * d as f32,
                            "{:?} scores d={d} m={m} bf16={} at {i}: {a} vs {b}",
                            k.tier(),
                            rows.is_bf16()
                        );
                    }
                    let init: Vec<f32> = (0..m * d).map(|i| i as f32 * 0.01).collect();
                    let (mut want, mut got) = (init.clone(), init.clone());
                    twin.attn_accum(&p, ld, rows, stride, n, &mut want, d);
                    k.attn_accum(&p, ld, rows, stride, n, &mut got, d);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5 * (n as f32 + init[i].abs()),
                            "{:?} accum d={d} m={m} bf16={} at {i}: {a} vs {b}",
                            k.tier(),
                            rows.is_bf16()
                        );
                    }
                    // Hinting other rows (these rows themselves, rows past
                    // the end: not hinted) changes no bit.
                    for off in [0, 1, rows.len()] {
                        let mut hinted = init.clone();
                        let h = Some((rows, off));
                        k.attn_accum_hinted(&p, ld, rows, stride, n, &mut hinted, d, h);
                        let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(b(&hinted), b(&got), "{:?} accum hinted at {off}", k.tier());
                    }
                    // Each column adds its keys in order whatever the
                    // calls: the keys in two calls (the AVX2 bf16 pass
                    // runs its even / odd passes only on long calls) give
                    // the same bits.
                    let h = n / 2;
                    let mut split = init.clone();
                    k.attn_accum(&p, ld, rows, stride, h, &mut split, d);
                    let rest = rows.slice_from(h * stride);
                    k.attn_accum(&p[h..], ld, rest, stride, n - h, &mut split, d);
                    let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(b(&split), b(&got), "{:?} accum split n={n} d={d}", k.tier());
                    // Accumulators kept permuted (the tier's lane order)
                    // across calls, put back in order at the end: the same
                    // bits, hinted or not, in one call or two.
                    if rows.is_bf16() && k.attn_acc_permutes(m, d) {
                        for (cut, off) in [(n, 0), (h, 1), (1, rows.len())] {
                            let mut perm = init.clone();
                            k.attn_acc_permute(&mut perm, d, true);
                            let hint = Some((rows, off));
                            k.attn_accum_permuted(&p, ld, rows, stride, cut, &mut perm, d, hint);
                            if cut < n {
                                let rest = rows.slice_from(cut * stride);
                                let (p2, n2) = (&p[cut..], n - cut);
                                k.attn_accum_permuted(p2, ld, rest, stride, n2, &mut perm, d, None);
                            }
                            k.attn_acc_permute(&mut perm, d, false);
                            assert_eq!(b(&perm), b(&got), "{:?} permuted n={n} d={d}", k.tier());
                        }
                    }
                }
            }
        }
    }
}

/// Attention's online-softmax step against the scalar twin: lengths around
/// every vector width, masked (`−∞`) scores (exactly 0 after), all-masked
/// rows, a previous maximum above and below the row's; and on each tier a
/// row padded with masked scores keeps its sum bit for bit.
#[test]
fn attn_softmax_matches_twin() {
    let mut rng = StdRng::seed_from_u64(12);
    let twin = Kernels::generic();
    for k in tiers() {
        for n in 1usize..=70 {
            for (prev, masked) in [
                (f32::NEG_INFINITY, 0.0),
                (3.0, 0.2),
                (-2.0, 0.5),
                (0.0, 1.0),
            ] {
                let row: Vec<f32> = (0..n)
                    .map(|_| {
                        if rng.random_range(0.0f32..1.0) < masked {
                            f32::NEG_INFINITY
                        } else {
                            rng.random_range(-30.0f32..4.0)
                        }
                    })
                    .collect();
                let (mut want, mut got) = (row.clone(), row.clone());
                let (wm, ws) = twin.attn_softmax(&mut want, prev);
                let (gm, gs) = k.attn_softmax(&mut got, prev);
                let tag = format!("{:?} n={n} prev={prev} masked={masked}", k.tier());
                assert_eq!(wm, gm, "{tag} max");
                assert!(
                    (ws - gs).abs() <= 1e-6 * ws.max(1.0) * n as f32,
                    "{tag} sum {gs} vs {ws}"
                );
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= 2e-7 * b.max(1e-30) + 1e-37,
                        "{tag} at {i}: {a} vs {b}"
                    );
                    if row[i] == f32::NEG_INFINITY {
                        assert_eq!(*a, 0.0, "{tag} masked at {i}");
                    }
                }
                let mut padded = row.clone();
                padded.resize(n + 13, f32::NEG_INFINITY);
                let (pm, ps) = k.attn_softmax(&mut padded, prev);
                assert_eq!(
                    (pm.to_bits(), ps.to_bits()),
                    (gm.to_bits(), gs.to_bits()),
                    "{tag} padded"
                );
                assert_eq!(&padded[..n], &got[..], "{tag} padded values");
            }
        }
    }
}

#[test]
fn split3_rows_equal_the_twin_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(31);
    for k in tiers() {
        for len in [0usize, 1, 15, 16, 17, 33, 100, 1031] {
            // Values over many binades, both signs, zeros among them.
            let x: Vec<f32> = (0..len)
                .map(|i| {
                    if i % 13 == 5 {
                        0.0
                    } else {
                        rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-40..40))
                    }
                })
                .collect();
            let mut want = [vec![0u16; len], vec![0u16; len], vec![0u16; len]];
            let [h, m, l] = &mut want;
            split3_row(&x, h, m, l);
            let mut got = [vec![7u16; len], vec![7u16; len], vec![7u16; len]];
            let [h, m, l] = &mut got;
            k.split3_row(&x, h, m, l);
            assert_eq!(got, want, "{} len {len}", k.tier().name());
        }
    }
}

#[test]
fn pair_transposes_equal_the_twin() {
    let mut rng = StdRng::seed_from_u64(37);
    let rows: Vec<Vec<u16>> = (0..NR)
        .map(|_| (0..2 * PAIR_BLOCK + 3).map(|_| rng.random()).collect())
        .collect();
    let block: [&[u16]; NR] = std::array::from_fn(|c| &rows[c][..]);
    let mut want = vec![0u32; PAIR_BLOCK * NR + 5];
    transpose_pairs(&block, &mut want);
    // The twin itself: pair q of channel c, its two values as in memory.
    for (c, r) in rows.iter().enumerate() {
        for q in 0..PAIR_BLOCK {
            let w = want[q * NR + c];
            assert_eq!(bytemuck::cast::<u32, [u16; 2]>(w), [r[2 * q], r[2 * q + 1]]);
        }
    }
    for k in tiers() {
        let mut got = vec![7u32; PAIR_BLOCK * NR + 5];
        k.transpose_pairs(&block, &mut got);
        assert_eq!(
            &got[..PAIR_BLOCK * NR],
            &want[..PAIR_BLOCK * NR],
            "{}",
            k.tier().name()
        );
        assert!(
            got[PAIR_BLOCK * NR..].iter().all(|&w| w == 7),
            "{} wrote past the block",
            k.tier().name()
        );
    }
}

#[test]
fn bf16_row_quantization_equals_the_twin() {
    let mut rng = StdRng::seed_from_u64(41);
    let specials = [0u16, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0x0001, 0x3f00, 0xbf00];
    for k in tiers() {
        for len in [1usize, 7, 16, 33, 768, 2048, 2051] {
            for case in 0..4 {
                let row: Vec<u16> = (0..len)
                    .map(|i| match case {
                        // All zero: scale 0.
                        0 => 0,
                        // One non-finite value among ordinary ones.
                        1 if i == len / 2 => specials[2 + i % 3],
                        // Halves and their neighbours after scaling.
                        2 => f32_to_bf16_bits((i % 255) as f32 - 127.0),
                        _ if i % 17 == 3 => specials[i % specials.len()],
                        _ => f32_to_bf16_bits(
                            rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-20..20)),
                        ),
                    })
                    .collect();
                let (mut fw, mut qw) = (vec![0.0f32; len], vec![0i8; len + 3]);
                let want = quantize_bf16_row_i8(&row, &mut fw, &mut qw);
                let (mut fg, mut qg) = (vec![9.0f32; len], vec![9i8; len + 3]);
                let got = k.quantize_bf16_row_i8(&row, &mut fg, &mut qg);
                let tag = format!("{} len {len} case {case}", k.tier().name());
                assert_eq!(got.to_bits(), want.to_bits(), "{tag} scale");
                assert_eq!(qg, qw, "{tag} values");
            }
        }
    }
}

#[test]
fn b12_tiles_and_decoders_equal_the_twins_bit_for_bit() {
    use crate::kernels::b12::{
        B12_MR, B12Panels, b12_decode, b12_padded_k, b12_tile, tests::normal_rows,
    };
    let mut rng = StdRng::seed_from_u64(1212);
    for k in tiers() {
        for &kc in KCS {
            // Normal-like weights (few escapes), and rows of random exponents
            // (most escape) in the same matrix.
            let mut rows = normal_rows(&mut rng, 2 * NR, kc);
            rows[NR + 3] = (0..kc).map(|_| rng.random::<u16>() & 0xbfff).collect();
            let mut packed = Vec::new();
            for p in 0..2 {
                pack_bf16_panel(kc, |c| Some(&rows[p * NR + c][..]), &mut packed);
            }
            let b = B12Panels::encode(&packed, kc);
            // Decoding: the whole groups, the bf16 panel, and a length
            // ending inside a pair.
            let pw = bf16_padded_k(kc) * NR;
            for len in [b12_padded_k(kc) * NR, pw, pw.saturating_sub(7)] {
                for p in 0..2 {
                    let mut want = vec![0x5a5au16; len];
                    b12_decode(&b.panel(p), &mut want);
                    let mut got = vec![0xa5a5u16; len];
                    k.b12_decode(&b.panel(p), &mut got);
                    assert_eq!(got, want, "{:?} kc={kc} len {len} panel {p}", k.tier());
                    let n = len.min(pw);
                    assert_eq!(&got[..n], &packed[p * pw..p * pw + n], "kc={kc} exact");
                }
            }
            assert!(k.b12_mr() <= B12_MR);
            for t in 1..=k.b12_mr() {
                let xs: Vec<Vec<f32>> = (0..t)
                    .map(|_| (0..kc).map(|_| rng.random_range(-2.0f32..2.0)).collect())
                    .collect();
                let x: Vec<&[f32]> = xs.iter().map(|r| &r[..]).collect();
                for p in 0..2 {
                    let init: Vec<f32> = (0..t * NR).map(|i| i as f32 * 0.25).collect();
                    let mut want = init.clone();
                    b12_tile(&b.panel(p), &x, &mut want);
                    let mut got = init.clone();
                    k.b12_tile(&b.panel(p), &x, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{:?} kc={kc} t={t} panel {p}",
                        k.tier()
                    );
                }
            }
        }
    }
}

/// The B12 tile with bf16 activations (`Kernels::b12x_tile`: native where
/// the tier has `vdpbf16ps`, the twin elsewhere) against its twin, within
/// the bf16 dot tiles' bound ([`check_bf16x`]'s): the same exact products,
/// summed in another order; and the twin against the bf16 panel's twin bit
/// for bit (B12 is lossless).
#[test]
fn b12x_tiles_match_the_twin_on_random_shapes() {
    use crate::kernels::b12::{B12_MR, B12Panels, b12x_tile, tests::normal_rows};
    let mut rng = StdRng::seed_from_u64(1213);
    for k in tiers() {
        for &kc in KCS {
            let mut rows = normal_rows(&mut rng, NR, kc);
            // A row of random exponents: most of its weights escape.
            rows[5] = (0..kc).map(|_| rng.random::<u16>() & 0xbfff).collect();
            let mut packed = Vec::new();
            pack_bf16_panel(kc, |c| Some(&rows[c][..]), &mut packed);
            let b = B12Panels::encode(&packed, kc);
            let kp = bf16_padded_k(kc);
            for t in 1..=B12_MR {
                // Zero padding past kc, as the callers lay rows out (and a
                // longer row: only `kp` values are read).
                let xs: Vec<Vec<u16>> = (0..t)
                    .map(|_| {
                        let mut r = rand_bf16(&mut rng, kp + 3);
                        r[kc..].fill(0);
                        r
                    })
                    .collect();
                let x: Vec<&[u16]> = xs.iter().map(|r| &r[..]).collect();
                let init: Vec<f32> = (0..t * NR).map(|i| i as f32 * 0.25).collect();
                let mut twin = init.clone();
                b12x_tile(&b.panel(0), &x, &mut twin);
                let mut plain = init.clone();
                generic::bf16x_tile(&packed, &x, &mut plain);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&twin), bits(&plain), "twin kc={kc} t={t}");
                let mut got = init.clone();
                k.b12x_tile(&b.panel(0), &x, &mut got);
                for tt in 0..t {
                    for c in 0..NR {
                        let mag: f32 = (0..kp)
                            .map(|kk| {
                                (bf16_bits_to_f32(x[tt][kk])
                                    * bf16_bits_to_f32(packed[bf16_index(kk, c)]))
                                .abs()
                            })
                            .sum::<f32>()
                            + init[tt * NR + c].abs();
                        let (a, w) = (got[tt * NR + c], twin[tt * NR + c]);
                        assert!(
                            (a - w).abs() <= 1e-5 * mag + 1e-30,
                            "{:?} (native: {}) b12x kc={kc} t={t} row {tt} ch {c}: {a} vs {w}",
                            k.tier(),
                            k.b12x_native()
                        );
                    }
                }
            }
        }
    }
}

/// The AVX-512 tiles that broadcast an activation to several FMAs exist in
/// two forms, a register broadcast and embedded broadcast operands, picked
/// by the CPU's vendor (`embedded_broadcasts` in `dispatch`). Both must give
/// the same bits, whichever this machine's vendor runs: the two-panel bf16
/// tiles (f32 and bf16 activations) and attention's value pass, f32 and
/// bf16 rows.
#[cfg(target_arch = "x86_64")]
#[test]
fn embedded_broadcast_forms_equal_register_forms_bit_for_bit() {
    use crate::kernels::x86::{attn, avx512};
    if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
        eprintln!("SKIPPED: no AVX-512 on this CPU; the embedded-broadcast forms did not run here");
        return;
    }
    let mut rng = StdRng::seed_from_u64(23);
    for &kc in KCS {
        let w0 = rand_bf16(&mut rng, bf16_padded_k(kc) * NR);
        let w1 = rand_bf16(&mut rng, bf16_padded_k(kc) * NR);
        for t in 1..=avx512::BF16_PAIR_MR {
            let rows: Vec<Vec<f32>> = (0..t)
                .map(|_| (0..kc).map(|_| rng.random_range(-2.0f32..2.0)).collect())
                .collect();
            let x: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
            let mut xp = Vec::new();
            pack_pairs_f32(&x, 0, kc, &mut xp);
            let init: Vec<f32> = (0..t * NR).map(|i| i as f32 * 0.25).collect();
            let (mut r0, mut r1, mut e0, mut e1) = (init.clone(), init.clone(), init.clone(), init);
            // SAFETY: AVX-512 F/BW were detected above; the panels hold
            // `16 · bf16_padded_k(kc)` words, `xp` `bf16_padded_k(kc) · t`
            // values and each accumulator `16 · t`.
            unsafe {
                avx512::bf16_pair_tile::<false>([&w0, &w1], kc, t, &xp, [&mut r0, &mut r1]);
                avx512::bf16_pair_tile::<true>([&w0, &w1], kc, t, &xp, [&mut e0, &mut e1]);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&r0), bits(&e0), "pair tile panel 0 kc={kc} t={t}");
            assert_eq!(bits(&r1), bits(&e1), "pair tile panel 1 kc={kc} t={t}");
        }
    }
    if is_x86_feature_detected!("avx512bf16") {
        for &kc in KCS {
            let kp = bf16_padded_k(kc);
            let w: [Vec<u16>; 2] = [rand_bf16(&mut rng, kp * NR), rand_bf16(&mut rng, kp * NR)];
            for t in 1..=avx512::BF16X_PAIR_MR {
                let rows: Vec<Vec<u16>> = (0..t)
                    .map(|_| {
                        let mut r = rand_bf16(&mut rng, kp);
                        r[kc..].fill(0);
                        r
                    })
                    .collect();
                let x: Vec<&[u16]> = rows.iter().map(|r| &r[..]).collect();
                let mut xp = Vec::new();
                pack_pairs_b16(&x, 0, kp, &mut xp);
                let init: Vec<f32> = (0..t * NR).map(|i| i as f32 * 0.25).collect();
                let (mut r0, mut r1, mut e0, mut e1) =
                    (init.clone(), init.clone(), init.clone(), init);
                // SAFETY: AVX-512 F/BW/BF16 were detected; the panels hold
                // `16 · kp` words, `xp` `kp · t` and each accumulator `16 · t`.
                unsafe {
                    avx512::bf16x_pair_tile::<false>([&w[0], &w[1]], t, &xp, [&mut r0, &mut r1]);
                    avx512::bf16x_pair_tile::<true>([&w[0], &w[1]], t, &xp, [&mut e0, &mut e1]);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&r0), bits(&e0), "bf16x pair panel 0 kc={kc} t={t}");
                assert_eq!(bits(&r1), bits(&e1), "bf16x pair panel 1 kc={kc} t={t}");
            }
        }
    } else {
        eprintln!("SKIPPED: no AVX-512 BF16 here; the bf16x pair tile's two forms did not run");
    }
    for &d in &[16usize, 31, 32, 48, 64, 128, 576] {
        for &m in &[1usize, 3, 4, 8, 9, 16] {
            let (n, stride, ld) = (19usize, d + 5, 23usize);
            let vf: Vec<f32> = (0..(n - 1) * stride + d)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let vb: Vec<u16> = vf.iter().map(|&x| f32_to_bf16_bits(x)).collect();
            let p: Vec<f32> = (0..m * ld).map(|_| rng.random_range(0.0f32..1.0)).collect();
            let init: Vec<f32> = (0..m * d).map(|i| i as f32 * 0.01).collect();
            let (mut rf, mut ef, mut rb, mut eb) = (init.clone(), init.clone(), init.clone(), init);
            // SAFETY: AVX-512 F/BW were detected above; `v` holds
            // `(n - 1) · stride + d` elements and `p` row `i` at `i · ld`
            // holds `n` values.
            unsafe {
                let (fp, bp) = (vf.as_ptr().cast(), vb.as_ptr().cast());
                attn::accum512::<false, false>(&p, ld, fp, stride, n, &mut rf, d);
                attn::accum512::<false, true>(&p, ld, fp, stride, n, &mut ef, d);
                attn::accum512::<true, false>(&p, ld, bp, stride, n, &mut rb, d);
                attn::accum512::<true, true>(&p, ld, bp, stride, n, &mut eb, d);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&rf), bits(&ef), "accum f32 d={d} m={m}");
            assert_eq!(bits(&rb), bits(&eb), "accum bf16 d={d} m={m}");
        }
    }
}
