//! Expert placement: which worker(s) hold each logical expert of each MoE
//! layer. A logical expert id (what the router emits) is not a placement: a
//! [`Placement`] maps it to one or more physical replicas on workers. It is one
//! versioned document (kept in etcd by the cluster), so replication and
//! rebalancing change the data, not its shape.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

/// Where the experts of one MoE layer live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerPlacement {
    pub layer: usize,
    /// `experts[e]` = indices into [`Placement::workers`] holding a replica of expert `e`.
    pub experts: Vec<Vec<u32>>,
    /// Experts whose every replica is held in int8 W8A8 (ascending); the
    /// others at each worker's `--expert-dtype`. Written by the precision
    /// policy (`--expert-precision-policy load` on the coordinator), so a
    /// precision change is a placement change, applied live like any other.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub int8: Vec<u32>,
}

/// A versioned placement of every expert of every MoE layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub version: u64,
    /// Worker ids; replicas refer to them by index.
    pub workers: Vec<String>,
    pub layers: Vec<LayerPlacement>,
}

/// A placement that does not fit the model or the workers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid placement: {0}")]
pub struct PlacementError(pub String);

impl Placement {
    /// Every expert on exactly one worker, balanced by count: expert `e` of
    /// the `i`-th MoE layer goes to worker `(i·E + e) mod W`, so per-layer and
    /// total counts differ by at most one whatever `E mod W` is.
    pub fn initial(
        moe_layers: &[usize],
        num_experts: usize,
        workers: &[String],
    ) -> Result<Self, PlacementError> {
        if workers.is_empty() {
            return Err(PlacementError("no workers to place experts on".into()));
        }
        let w = workers.len();
        let layers = moe_layers
            .iter()
            .enumerate()
            .map(|(i, &layer)| LayerPlacement {
                layer,
                experts: (0..num_experts)
                    .map(|e| vec![((i * num_experts + e) % w) as u32])
                    .collect(),
                int8: Vec::new(),
            })
            .collect();
        Ok(Placement {
            version: 1,
            workers: workers.to_vec(),
            layers,
        })
    }

    /// Checks that every expert of every MoE layer has at least one replica,
    /// replicas name existing workers, and no expert has two replicas on one worker.
    pub fn validate(&self, moe_layers: &[usize], num_experts: usize) -> Result<(), PlacementError> {
        let have: Vec<usize> = self.layers.iter().map(|l| l.layer).collect();
        if have != moe_layers {
            return Err(PlacementError(format!(
                "placement covers layers {have:?}, the model's MoE layers are {moe_layers:?}"
            )));
        }
        for l in &self.layers {
            if l.experts.len() != num_experts {
                return Err(PlacementError(format!(
                    "layer {} places {} experts, the model has {num_experts}",
                    l.layer,
                    l.experts.len()
                )));
            }
            for (e, reps) in l.experts.iter().enumerate() {
                if reps.is_empty() {
                    return Err(PlacementError(format!(
                        "layer {} expert {e} has no replica",
                        l.layer
                    )));
                }
                let uniq: BTreeSet<_> = reps.iter().collect();
                if uniq.len() != reps.len() {
                    return Err(PlacementError(format!(
                        "layer {} expert {e} has two replicas on one worker",
                        l.layer
                    )));
                }
                if let Some(bad) = reps.iter().find(|&&r| r as usize >= self.workers.len()) {
                    return Err(PlacementError(format!(
                        "layer {} expert {e} names worker index {bad}; there are {}",
                        l.layer,
                        self.workers.len()
                    )));
                }
            }
            if l.int8.windows(2).any(|w| w[0] >= w[1]) {
                return Err(PlacementError(format!(
                    "layer {}: the int8 experts must be listed once each, ascending",
                    l.layer
                )));
            }
            if let Some(bad) = l.int8.iter().find(|&&e| e as usize >= num_experts) {
                return Err(PlacementError(format!(
                    "layer {} lists int8 expert {bad}; the model has {num_experts}",
                    l.layer
                )));
            }
        }
        Ok(())
    }

    /// Whether expert `e` of `layer` is held in int8 under this placement.
    pub fn is_int8(&self, layer: usize, e: usize) -> bool {
        self.layer(layer)
            .is_some_and(|l| l.int8.binary_search(&(e as u32)).is_ok())
    }

    /// The `(layer, expert)` pairs held in int8 (on every worker).
    pub fn int8_experts(&self) -> BTreeSet<(usize, usize)> {
        self.layers
            .iter()
            .flat_map(|l| l.int8.iter().map(move |&e| (l.layer, e as usize)))
            .collect()
    }

    /// The same replicas with the int8 experts `int8` (`(layer, expert)`
    /// pairs; pairs outside the MoE layers are ignored).
    pub fn with_int8(&self, int8: &BTreeSet<(usize, usize)>) -> Placement {
        let mut p = self.clone();
        for l in &mut p.layers {
            l.int8 = int8
                .range((l.layer, 0)..(l.layer + 1, 0))
                .map(|&(_, e)| e as u32)
                .collect();
        }
        p
    }

    /// The placement of one layer, if it is an MoE layer.
    pub fn layer(&self, layer: usize) -> Option<&LayerPlacement> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// The `(layer, expert)` pairs a worker holds.
    pub fn assigned_to(&self, worker: &str) -> BTreeSet<(usize, usize)> {
        let Some(idx) = self.workers.iter().position(|w| w == worker) else {
            return BTreeSet::new();
        };
        let mut out = BTreeSet::new();
        for l in &self.layers {
            for (e, reps) in l.experts.iter().enumerate() {
                if reps.contains(&(idx as u32)) {
                    out.insert((l.layer, e));
                }
            }
        }
        out
    }

    /// Experts held per worker (all layers), in worker order.
    pub fn counts(&self) -> Vec<usize> {
        let mut c = vec![0usize; self.workers.len()];
        for l in &self.layers {
            for reps in &l.experts {
                for &r in reps {
                    if let Some(x) = c.get_mut(r as usize) {
                        *x += 1;
                    }
                }
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workers(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("w{i}")).collect()
    }

    #[test]
    fn initial_is_balanced_for_awkward_counts() {
        for (layers, e, w) in [
            (vec![0, 2], 7, 3),
            (vec![0, 1, 2, 3], 13, 4),
            (vec![1], 5, 2),
            (vec![0], 2, 3),
        ] {
            let p = Placement::initial(&layers, e, &workers(w)).expect("placement");
            p.validate(&layers, e).expect("valid");
            let c = p.counts();
            let (min, max) = (
                c.iter().min().copied().unwrap_or(0),
                c.iter().max().copied().unwrap_or(0),
            );
            assert!(max - min <= 1, "{c:?}");
            assert_eq!(c.iter().sum::<usize>(), layers.len() * e);
            for l in &p.layers {
                let mut per = vec![0usize; w];
                for r in &l.experts {
                    per[r[0] as usize] += 1;
                }
                let (mn, mx) = (
                    per.iter().min().copied().unwrap_or(0),
                    per.iter().max().copied().unwrap_or(0),
                );
                assert!(mx - mn <= 1, "layer {} {per:?}", l.layer);
            }
        }
    }

    #[test]
    fn validation_catches_mistakes() {
        let mut p = Placement::initial(&[0], 3, &workers(2)).expect("placement");
        assert!(p.validate(&[0, 1], 3).is_err());
        p.layers[0].experts[1] = vec![];
        assert!(p.validate(&[0], 3).is_err());
        p.layers[0].experts[1] = vec![0, 0];
        assert!(p.validate(&[0], 3).is_err());
        p.layers[0].experts[1] = vec![5];
        assert!(p.validate(&[0], 3).is_err());
        p.layers[0].experts[1] = vec![0, 1];
        assert!(p.validate(&[0], 3).is_ok());
        p.layers[0].int8 = vec![2, 0];
        assert!(p.validate(&[0], 3).is_err(), "unsorted int8 list");
        p.layers[0].int8 = vec![3];
        assert!(p.validate(&[0], 3).is_err(), "int8 expert out of range");
        let p = p.with_int8(&[(0, 0), (0, 2), (5, 1)].into_iter().collect());
        assert!(p.validate(&[0], 3).is_ok());
        assert!(p.is_int8(0, 2) && !p.is_int8(0, 1));
        assert_eq!(p.int8_experts().len(), 2);
        // The field is omitted when empty, so older documents still parse.
        let json = serde_json::to_string(&p.with_int8(&BTreeSet::new())).expect("json");
        assert!(!json.contains("int8"), "{json}");
        let back: Placement = serde_json::from_str(&json).expect("parse");
        assert!(back.int8_experts().is_empty());
        assert_eq!(p.assigned_to("w0").len(), 3);
        assert_eq!(p.assigned_to("w1").len(), 1);
    }
}
