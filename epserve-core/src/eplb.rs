//! Expert placement policy in the spirit of DeepSeek's EPLB: given the load of
//! every logical expert of a layer, the workers and each worker's expert
//! capacity, give the redundant slots to the experts with the highest load per
//! replica, then pack the replicas onto workers (heaviest first, onto the
//! least-loaded worker that has room and no replica of that expert yet) to
//! minimise the most loaded worker. Pure functions; the cluster applies the
//! result as a new placement version.

use crate::placement::{LayerPlacement, Placement, PlacementError};

/// The outcome for one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    pub placement: LayerPlacement,
    /// Predicted load per worker (a replicated expert's load split evenly).
    pub worker_load: Vec<f64>,
}

impl LayerPlan {
    /// Mean worker load / max worker load (1.0 = perfectly even; vLLM's EPLB metric).
    pub fn balancedness(&self) -> f64 {
        balancedness(&self.worker_load)
    }
}

/// Mean / max of per-worker loads (1.0 when all are zero).
pub fn balancedness(worker_load: &[f64]) -> f64 {
    let max = worker_load.iter().copied().fold(0.0, f64::max);
    if max <= 0.0 || worker_load.is_empty() {
        return 1.0;
    }
    worker_load.iter().sum::<f64>() / worker_load.len() as f64 / max
}

/// Per-worker load of an existing layer placement under `loads`.
pub fn worker_loads(layer: &LayerPlacement, loads: &[f64], num_workers: usize) -> Vec<f64> {
    let mut w = vec![0.0; num_workers];
    for (e, reps) in layer.experts.iter().enumerate() {
        let l = loads.get(e).copied().unwrap_or(0.0);
        for &r in reps {
            if let Some(x) = w.get_mut(r as usize) {
                *x += l / reps.len() as f64;
            }
        }
    }
    w
}

/// Plans one layer: `loads[e]` tokens per logical expert, `num_workers`
/// workers holding at most `capacity` experts of this layer each, and
/// `redundant` extra replicas to hand out.
pub fn plan_layer(
    layer: usize,
    loads: &[f64],
    num_workers: usize,
    capacity: usize,
    redundant: usize,
) -> Result<LayerPlan, PlacementError> {
    let e = loads.len();
    if num_workers == 0 {
        return Err(PlacementError("no workers".into()));
    }
    if e + redundant > num_workers * capacity {
        return Err(PlacementError(format!(
            "{e} experts + {redundant} redundant slots exceed {num_workers} workers x {capacity} slots"
        )));
    }
    // 1. Replicas: each extra one goes to the expert with the highest load per replica.
    let mut reps = vec![1usize; e];
    for _ in 0..redundant {
        let best = (0..e).filter(|&i| reps[i] < num_workers).max_by(|&a, &b| {
            (loads[a] / reps[a] as f64)
                .total_cmp(&(loads[b] / reps[b] as f64))
                .then(b.cmp(&a))
        });
        match best {
            Some(i) => reps[i] += 1,
            None => break,
        }
    }
    // 2. Pack replicas, heaviest first, onto the least-loaded eligible worker.
    let mut items: Vec<(usize, f64)> = (0..e)
        .flat_map(|i| std::iter::repeat_n((i, loads[i] / reps[i] as f64), reps[i]))
        .collect();
    items.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut worker_load = vec![0.0f64; num_workers];
    let mut used = vec![0usize; num_workers];
    let mut experts: Vec<Vec<u32>> = vec![Vec::new(); e];
    for (i, l) in items {
        let w = (0..num_workers)
            .filter(|&w| used[w] < capacity && !experts[i].contains(&(w as u32)))
            .min_by(|&a, &b| {
                worker_load[a]
                    .total_cmp(&worker_load[b])
                    .then(used[a].cmp(&used[b]))
            })
            .ok_or_else(|| {
                PlacementError(format!("no worker has room for a replica of expert {i}"))
            })?;
        worker_load[w] += l;
        used[w] += 1;
        experts[i].push(w as u32);
    }
    for r in &mut experts {
        r.sort_unstable();
    }
    Ok(LayerPlan {
        placement: LayerPlacement {
            layer,
            experts,
            int8: Vec::new(),
        },
        worker_load,
    })
}

/// Plans every MoE layer (`loads[i]` belongs to `moe_layers[i]`) into a new
/// placement version over `workers`.
pub fn plan(
    version: u64,
    workers: &[String],
    moe_layers: &[usize],
    loads: &[Vec<f64>],
    capacity: usize,
    redundant: usize,
) -> Result<(Placement, Vec<f64>), PlacementError> {
    if loads.len() != moe_layers.len() {
        return Err(PlacementError(format!(
            "loads for {} layers, the model has {} MoE layers",
            loads.len(),
            moe_layers.len()
        )));
    }
    let mut layers = Vec::new();
    let mut bal = Vec::new();
    for (&layer, l) in moe_layers.iter().zip(loads) {
        let p = plan_layer(layer, l, workers.len(), capacity, redundant)?;
        bal.push(p.balancedness());
        layers.push(p.placement);
    }
    Ok((
        Placement {
            version,
            workers: workers.to_vec(),
            layers,
        },
        bal,
    ))
}

/// Precision by load: the experts to hold in int8 so that the hottest ones,
/// covering at least `bf16_share` of the routed tokens in `loads`
/// (`loads[i]` belongs to `moe_layers[i]`, ranked over all layers together,
/// ties by layer then expert), stay bf16. Experts that saw no token are
/// int8; with no load at all, none is (nothing is known yet).
pub fn precision_by_load(
    moe_layers: &[usize],
    loads: &[Vec<f64>],
    bf16_share: f64,
) -> std::collections::BTreeSet<(usize, usize)> {
    let mut ranked: Vec<((usize, usize), f64)> = moe_layers
        .iter()
        .zip(loads)
        .flat_map(|(&l, ld)| ld.iter().enumerate().map(move |(e, &x)| ((l, e), x)))
        .collect();
    let total: f64 = ranked.iter().map(|r| r.1).sum();
    if total <= 0.0 {
        return Default::default();
    }
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let hot = hottest_covering(&ranked, bf16_share);
    ranked[hot..].iter().map(|r| r.0).collect()
}

/// How many of the first experts of `ranked` (sorted by load, most first)
/// it takes to cover `share` of the total load: each is taken while the ones
/// before it cover less, and only experts with load count. The rule of both
/// precision policies (the coordinator's, [`precision_by_load`], and a
/// tiered store's own).
pub fn hottest_covering<K>(ranked: &[(K, f64)], share: f64) -> usize {
    let total: f64 = ranked.iter().map(|r| r.1).sum();
    let mut acc = 0.0;
    for (i, (_, x)) in ranked.iter().enumerate() {
        if acc >= share * total || *x <= 0.0 {
            return i;
        }
        acc += x;
    }
    ranked.len()
}

/// The share of the routed tokens in `loads` that experts outside `int8`
/// (the bf16 ones) took (1 with no load).
pub fn bf16_coverage(
    moe_layers: &[usize],
    loads: &[Vec<f64>],
    int8: &std::collections::BTreeSet<(usize, usize)>,
) -> f64 {
    let (mut bf, mut total) = (0.0, 0.0);
    for (&l, ld) in moe_layers.iter().zip(loads) {
        for (e, &x) in ld.iter().enumerate() {
            total += x;
            if !int8.contains(&(l, e)) {
                bf += x;
            }
        }
    }
    if total > 0.0 { bf / total } else { 1.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_by_load_keeps_the_hot_share_in_bf16() {
        let layers = [1, 3];
        let loads = vec![vec![50.0, 10.0, 0.0, 5.0], vec![20.0, 5.0, 10.0, 0.0]];
        let int8 = precision_by_load(&layers, &loads, 0.7);
        // 100 tokens: 50 (1,0) + 20 (3,0) = 70 covers the share.
        let bf16: Vec<(usize, usize)> = [(1, 0), (3, 0)].into();
        for l in layers {
            for e in 0..4 {
                assert_eq!(int8.contains(&(l, e)), !bf16.contains(&(l, e)), "({l},{e})");
            }
        }
        assert!((bf16_coverage(&layers, &loads, &int8) - 0.7).abs() < 1e-12);
        // Everything used stays bf16 at share 1; unused experts are int8.
        let all = precision_by_load(&layers, &loads, 1.0);
        assert_eq!(all, [(1, 2), (3, 3)].into_iter().collect());
        // Share 0: every expert int8; no load: none.
        assert_eq!(precision_by_load(&layers, &loads, 0.0).len(), 8);
        assert!(precision_by_load(&layers, &[vec![0.0; 4], vec![0.0; 4]], 0.5).is_empty());
    }

    #[test]
    fn skewed_load_is_balanced_by_replication() {
        // One very hot expert among 8 on 4 workers with 3 slots each.
        let loads = vec![80.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0];
        let plain = plan_layer(0, &loads, 4, 3, 0).expect("plan");
        let repl = plan_layer(0, &loads, 4, 3, 3).expect("plan");
        assert_eq!(
            repl.placement.experts[0].len(),
            4,
            "the hot expert gets every extra slot"
        );
        assert!(repl.balancedness() > plain.balancedness());
        assert!(repl.balancedness() > 0.9, "{}", repl.balancedness());
        // The prediction matches recomputing from the placement.
        let again = worker_loads(&repl.placement, &loads, 4);
        for (a, b) in again.iter().zip(&repl.worker_load) {
            assert!((a - b).abs() < 1e-9);
        }
    }

    #[test]
    fn constraints_hold() {
        let loads: Vec<f64> = (0..13).map(|i| (i * 7 % 11) as f64 + 1.0).collect();
        let p = plan_layer(2, &loads, 3, 6, 5).expect("plan");
        let full = Placement {
            version: 2,
            workers: vec!["a".into(), "b".into(), "c".into()],
            layers: vec![p.placement.clone()],
        };
        full.validate(&[2], 13)
            .expect("valid: no duplicate replica on a worker, all placed");
        assert!(full.counts().iter().all(|&c| c <= 6), "{:?}", full.counts());
        assert_eq!(full.counts().iter().sum::<usize>(), 13 + 5);
        assert!(
            plan_layer(0, &loads, 2, 6, 0).is_err(),
            "13 experts do not fit 2 x 6"
        );
    }

    #[test]
    fn uniform_load_is_already_balanced() {
        let p = plan_layer(0, &[1.0; 12], 4, 3, 0).expect("plan");
        assert!((p.balancedness() - 1.0).abs() < 1e-12);
        let (pl, bal) = plan(
            3,
            &["x".into(), "y".into()],
            &[0, 1],
            &[vec![1.0; 4], vec![3.0, 1.0, 1.0, 1.0]],
            4,
            2,
        )
        .expect("plan");
        assert_eq!(pl.version, 3);
        assert_eq!(bal.len(), 2);
        pl.validate(&[0, 1], 4).expect("valid");
    }
}
