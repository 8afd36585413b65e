//! Expert load over a sliding window of forward steps: tokens routed to each
//! logical expert and to each physical replica (an expert on one worker), per
//! MoE layer, and from those the per-worker load and the balancedness (mean
//! worker load / max worker load, vLLM EPLB's metric). The window is cleared
//! when the placement version changes, so it always describes the placement
//! in force. Memory is O(window × routed slots) (sparse per-step entries),
//! not O(window × experts).

use std::collections::{BTreeMap, HashMap, VecDeque};

use epserve_core::placement::Placement;

/// Tokens one step routed to `expert` on worker `worker` (an interned index).
#[derive(Debug, Clone, Copy)]
struct Entry {
    expert: u32,
    worker: u32,
    tokens: u32,
}

#[derive(Default)]
struct LayerWindow {
    /// Per step in the window: its number ([`LoadStats::steps_total`] when
    /// it ran) and its entries.
    ring: VecDeque<(u64, Vec<Entry>)>,
    expert: Vec<u64>,
    replica: HashMap<(u32, u32), u64>,
}

impl LayerWindow {
    /// Adds step `step`'s `entries`: to that step's slot when the layer
    /// already has one (a step split into micro-batches dispatches each
    /// layer once per micro-batch), else to a new slot, the oldest leaving
    /// a full window.
    fn push(&mut self, step: u64, entries: Vec<Entry>, capacity: usize) {
        let same_step = self.ring.back().is_some_and(|(s, _)| *s == step);
        if !same_step
            && self.ring.len() >= capacity
            && let Some((_, old)) = self.ring.pop_front()
        {
            for e in old {
                if let Some(x) = self.expert.get_mut(e.expert as usize) {
                    *x = x.saturating_sub(e.tokens as u64);
                }
                if let Some(x) = self.replica.get_mut(&(e.expert, e.worker)) {
                    *x = x.saturating_sub(e.tokens as u64);
                    if *x == 0 {
                        self.replica.remove(&(e.expert, e.worker));
                    }
                }
            }
        }
        for e in &entries {
            if self.expert.len() <= e.expert as usize {
                self.expert.resize(e.expert as usize + 1, 0);
            }
            self.expert[e.expert as usize] += e.tokens as u64;
            *self.replica.entry((e.expert, e.worker)).or_default() += e.tokens as u64;
        }
        match self.ring.back_mut() {
            Some((_, slot)) if same_step => slot.extend(entries),
            _ => self.ring.push_back((step, entries)),
        }
    }
}

/// The load window of every MoE layer.
pub struct LoadStats {
    capacity: usize,
    version: u64,
    names: Vec<String>,
    index: HashMap<String, u32>,
    layers: BTreeMap<usize, LayerWindow>,
    steps_total: u64,
}

/// One layer's load, as the admin API reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerLoad {
    pub layer: usize,
    pub expert_tokens: Vec<u64>,
    /// `(expert, worker, tokens)`, sorted.
    pub replicas: Vec<(u32, String, u64)>,
    /// Tokens per worker, in [`LoadSnapshot::workers`] order.
    pub worker_tokens: Vec<u64>,
    pub balancedness: f64,
}

/// The whole window at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadSnapshot {
    pub placement_version: u64,
    pub window_steps: usize,
    pub window_capacity: usize,
    pub workers: Vec<String>,
    pub layers: Vec<LayerLoad>,
}

impl LoadSnapshot {
    /// Logical expert loads per MoE layer, in `moe_layers` order (zeros
    /// for layers without data), as the placement policy takes them.
    pub fn expert_loads(&self, moe_layers: &[usize], num_experts: usize) -> Vec<Vec<f64>> {
        moe_layers
            .iter()
            .map(|&l| {
                let mut v = vec![0.0; num_experts];
                if let Some(x) = self.layers.iter().find(|x| x.layer == l) {
                    for (e, &t) in x.expert_tokens.iter().enumerate().take(num_experts) {
                        v[e] = t as f64;
                    }
                }
                v
            })
            .collect()
    }

    /// Measured balancedness per MoE layer in `moe_layers` order (1 without data).
    pub fn balancedness(&self, moe_layers: &[usize]) -> Vec<f64> {
        moe_layers
            .iter()
            .map(|&l| {
                self.layers
                    .iter()
                    .find(|x| x.layer == l)
                    .map_or(1.0, |x| x.balancedness)
            })
            .collect()
    }
}

impl LoadStats {
    /// A window of `capacity` steps (at least 1).
    pub fn new(capacity: usize) -> Self {
        LoadStats {
            capacity: capacity.max(1),
            version: 0,
            names: Vec::new(),
            index: HashMap::new(),
            layers: BTreeMap::new(),
            steps_total: 0,
        }
    }

    /// Forward steps seen since start (the clock of automatic rebalancing).
    pub fn steps_total(&self) -> u64 {
        self.steps_total
    }

    /// Steps in the window now.
    pub fn window_steps(&self) -> usize {
        self.layers
            .values()
            .map(|l| l.ring.len())
            .max()
            .unwrap_or(0)
    }

    /// A new forward step begins under placement `version`; a new version
    /// empties the window.
    pub fn begin_step(&mut self, version: u64) {
        if version != self.version {
            self.layers.clear();
            self.version = version;
        }
        self.steps_total += 1;
    }

    fn intern(&mut self, worker: &str) -> u32 {
        if let Some(&i) = self.index.get(worker) {
            return i;
        }
        let i = self.names.len() as u32;
        self.names.push(worker.to_string());
        self.index.insert(worker.to_string(), i);
        i
    }

    /// Records one layer's dispatch: `(expert, worker, tokens)` triples.
    pub fn record(&mut self, layer: usize, counts: &[(u32, &str, u32)]) {
        let entries: Vec<Entry> = counts
            .iter()
            .map(|&(expert, w, tokens)| Entry {
                expert,
                worker: self.intern(w),
                tokens,
            })
            .collect();
        let (cap, step) = (self.capacity, self.steps_total);
        self.layers
            .entry(layer)
            .or_default()
            .push(step, entries, cap);
    }

    /// The window of one layer, with worker loads over `placement`'s workers;
    /// balancedness counts only workers that hold some expert (a drained
    /// worker is not idle capacity).
    pub fn layer(&self, layer: usize, placement: &Placement) -> LayerLoad {
        let counts = placement.counts();
        let mut worker_tokens = vec![0u64; placement.workers.len()];
        let mut replicas = Vec::new();
        let mut expert_tokens = Vec::new();
        if let Some(w) = self.layers.get(&layer) {
            expert_tokens = w.expert.clone();
            for (&(e, wi), &t) in &w.replica {
                let name = self.names.get(wi as usize).cloned().unwrap_or_default();
                if let Some(pos) = placement.workers.iter().position(|x| *x == name) {
                    worker_tokens[pos] += t;
                }
                replicas.push((e, name, t));
            }
        }
        replicas.sort();
        let active: Vec<f64> = worker_tokens
            .iter()
            .zip(&counts)
            .filter(|(_, c)| **c > 0)
            .map(|(&t, _)| t as f64)
            .collect();
        LayerLoad {
            layer,
            expert_tokens,
            replicas,
            worker_tokens,
            balancedness: epserve_core::eplb::balancedness(&active),
        }
    }

    /// Every MoE layer of `placement`.
    pub fn snapshot(&self, placement: &Placement) -> LoadSnapshot {
        LoadSnapshot {
            placement_version: placement.version,
            window_steps: self.window_steps(),
            window_capacity: self.capacity,
            workers: placement.workers.clone(),
            layers: placement
                .layers
                .iter()
                .map(|l| {
                    let mut x = self.layer(l.layer, placement);
                    x.expert_tokens
                        .resize(l.experts.len().max(x.expert_tokens.len()), 0);
                    x
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement() -> Placement {
        // Expert 0 on both workers, 1 on a, 2 on b.
        let mut p = Placement::initial(&[3], 3, &["a".into(), "b".into()]).expect("placement");
        p.layers[0].experts = vec![vec![0, 1], vec![0], vec![1]];
        p
    }

    #[test]
    fn window_slides_and_sums() {
        let p = placement();
        let mut s = LoadStats::new(2);
        s.begin_step(1);
        s.record(3, &[(0, "a", 4), (0, "b", 4), (1, "a", 2)]);
        let l = s.layer(3, &p);
        assert_eq!(l.expert_tokens, vec![8, 2]);
        assert_eq!(l.worker_tokens, vec![6, 4]);
        assert!((l.balancedness - 5.0 / 6.0).abs() < 1e-12);
        s.begin_step(1);
        s.record(3, &[(2, "b", 2)]);
        s.begin_step(1);
        s.record(3, &[(2, "b", 6)]);
        // The first step fell out of the window.
        let l = s.layer(3, &p);
        assert_eq!(l.expert_tokens, vec![0, 0, 8]);
        assert_eq!(l.worker_tokens, vec![0, 8]);
        assert_eq!(l.replicas, vec![(2, "b".to_string(), 8)]);
        assert!((l.balancedness - 0.5).abs() < 1e-12);
        assert_eq!(s.window_steps(), 2);
        assert_eq!(s.steps_total(), 3);
        let snap = s.snapshot(&p);
        assert_eq!(snap.expert_loads(&[3], 3), vec![vec![0.0, 0.0, 8.0]]);
        // A new placement version starts a new window.
        s.begin_step(2);
        assert_eq!(s.window_steps(), 0);
        assert_eq!(s.layer(3, &p).balancedness, 1.0);
    }

    #[test]
    fn micro_batches_of_one_step_fill_one_slot() {
        let p = placement();
        let mut s = LoadStats::new(2);
        for step in 0..3u32 {
            s.begin_step(1);
            // Two micro-batches dispatch layer 3 in each step.
            s.record(3, &[(0, "a", 1 + step)]);
            s.record(3, &[(1, "a", 10)]);
        }
        // Two whole steps in the window (not the last two micro-batches).
        assert_eq!(s.window_steps(), 2);
        let l = s.layer(3, &p);
        assert_eq!(l.expert_tokens, vec![2 + 3, 20]);
    }

    #[test]
    fn drained_workers_do_not_count() {
        let mut p = placement();
        p.workers.push("drained".into());
        let mut s = LoadStats::new(8);
        s.begin_step(1);
        s.record(3, &[(1, "a", 5), (2, "b", 5)]);
        let l = s.layer(3, &p);
        assert_eq!(l.worker_tokens, vec![5, 5, 0]);
        assert!((l.balancedness - 1.0).abs() < 1e-12);
    }
}
