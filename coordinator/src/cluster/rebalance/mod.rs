//! Live rebalancing, driven by the coordinator as a small state machine whose
//! every state is written to etcd (`/epserve/<cluster>/rebalance`):
//!
//! ```text
//! proposed ─▶ loading ─▶ ready ─▶ switched ─▶ done
//!     └──────────┴─────────┴──▶ rolled_back   (timeout, a vanished worker, a lost CAS)
//! ```
//!
//! Besides the operator's requests and automatic EPLB, [`Controller::supervise`]
//! (`recover.rs`) watches the registry: it re-places the experts of workers
//! whose lease expired, honours workers' drain requests (SIGTERM) and gives
//! experts back to a worker that returns holding nothing.
//!
//! 1. `proposed`: the target placement (version + 1) and the one in force are
//!    written. While a rebalance is active every worker holds the union of
//!    its share of both (`epserve_cluster::state::desired_experts`), loading
//!    its new replicas from the model files while it keeps serving the old ones.
//! 2. `loading`: every worker with new replicas is registered; each reports
//!    ready under `rebalance-ready/<worker>` once it holds them. One that
//!    leaves the registry meanwhile (lease expired) rolls the rebalance back
//!    at the next poll.
//! 3. `ready`: all reported. The coordinator swaps the placement key (CAS on
//!    the revision it started from) and hands the dispatcher the new route,
//!    which takes it at the next step's first MoE layer (a step never mixes
//!    placements).
//! 4. `switched`: waits until no step routed with the old placement is in flight.
//! 5. `done`: workers drop the replicas only the old placement needed.
//!
//! Restarts: workers recompute what to hold from the two keys, so a worker
//! that restarts mid-way loads the union again and re-reports ready. A
//! coordinator that restarts finds an active rebalance at start-up
//! ([`Controller::resume`]): if the placement key already holds the target it
//! completes it (`done`, nothing routes with the old one any more), otherwise
//! it rolls back (the old placement never stopped being in force).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use epserve_cluster::runtime::Status;
use epserve_cluster::state::{ClusterState, Rebalance, RebalanceState, WorkerInfo};
use epserve_core::eplb;
use epserve_core::placement::{LayerPlacement, Placement};

use super::dispatch::{GrpcDispatcher, Route};

/// Why a rebalance request was refused or failed.
#[derive(Debug, Clone, PartialEq)]
pub enum RebalanceError {
    UnknownWorker(String),
    OverCapacity(String),
    AlreadyRunning(String),
    Invalid(String),
    Unavailable(String),
    NoLoad(String),
}

impl std::fmt::Display for RebalanceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::UnknownWorker(m)
            | Self::OverCapacity(m)
            | Self::AlreadyRunning(m)
            | Self::Invalid(m)
            | Self::Unavailable(m)
            | Self::NoLoad(m) => f.write_str(m),
        }
    }
}

type Res<T> = Result<T, RebalanceError>;

fn store_err(e: impl std::fmt::Display) -> RebalanceError {
    RebalanceError::Unavailable(format!("cluster state: {e}"))
}

/// What a rebalance request planned or did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub id: String,
    /// `done`, `rolled_back`, `dry_run` or `unchanged`.
    pub state: String,
    pub from_version: u64,
    pub to_version: u64,
    /// Per MoE layer, estimated from the measured window (same model for both).
    pub current: Vec<f64>,
    pub predicted: Vec<f64>,
    pub placement: Placement,
    pub message: String,
}

/// A planned placement before it is applied.
#[derive(Debug, Clone)]
pub struct Plan {
    pub from: Placement,
    pub target: Placement,
    pub current: Vec<f64>,
    pub predicted: Vec<f64>,
}

impl Plan {
    /// Mean predicted minus mean current balancedness.
    pub fn improvement(&self) -> f64 {
        mean(&self.predicted) - mean(&self.current)
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 1.0;
    }
    v.iter().sum::<f64>() / v.len() as f64
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Estimated balancedness of each layer of `p` under `loads` (a replicated
/// expert's load split evenly), over the workers that hold something.
pub fn estimate(p: &Placement, loads: &[Vec<f64>]) -> Vec<f64> {
    let counts = p.counts();
    p.layers
        .iter()
        .zip(loads)
        .map(|(l, ld)| {
            let w = eplb::worker_loads(l, ld, p.workers.len());
            let active: Vec<f64> = w
                .into_iter()
                .zip(&counts)
                .filter(|(_, c)| **c > 0)
                .map(|(x, _)| x)
                .collect();
            eplb::balancedness(&active)
        })
        .collect()
}

/// Moves every replica off worker `gone`: replicas it shared are just
/// removed; experts it alone held go to the least-loaded worker of
/// `remaining` (indices into `from.workers`) in their layer.
pub fn drain_plan(
    from: &Placement,
    gone: usize,
    remaining: &[usize],
    loads: &[Vec<f64>],
) -> Res<Placement> {
    if remaining.is_empty() {
        return Err(RebalanceError::OverCapacity(
            "no other registered worker to move the experts to".into(),
        ));
    }
    let mut target = from.clone();
    for (l, ld) in target.layers.iter_mut().zip(loads) {
        let mut wl = eplb::worker_loads(l, ld, from.workers.len());
        let mut used = vec![0usize; from.workers.len()];
        for reps in &l.experts {
            for &r in reps {
                if let Some(u) = used.get_mut(r as usize) {
                    *u += 1;
                }
            }
        }
        let mut order: Vec<usize> = (0..l.experts.len()).collect();
        order.sort_by(|&a, &b| {
            let (la, lb) = (
                ld.get(a).copied().unwrap_or(0.0),
                ld.get(b).copied().unwrap_or(0.0),
            );
            lb.total_cmp(&la).then(a.cmp(&b))
        });
        for e in order {
            let reps = &mut l.experts[e];
            if !reps.contains(&(gone as u32)) {
                continue;
            }
            reps.retain(|&r| r as usize != gone);
            if reps.is_empty() {
                let w = remaining
                    .iter()
                    .copied()
                    .min_by(|&a, &b| wl[a].total_cmp(&wl[b]).then(used[a].cmp(&used[b])))
                    .ok_or_else(|| RebalanceError::OverCapacity("no worker left".into()))?;
                reps.push(w as u32);
                wl[w] += ld.get(e).copied().unwrap_or(0.0);
                used[w] += 1;
            }
            reps.sort_unstable();
        }
    }
    Ok(target)
}

/// Runs rebalances for one coordinator.
pub struct Controller {
    pub state: ClusterState,
    pub dispatcher: Arc<GrpcDispatcher>,
    pub moe_layers: Vec<usize>,
    pub num_experts: usize,
    /// Bytes of one expert's weights (bf16), for memory capacity checks.
    pub expert_bytes: u64,
    /// How long workers may take to load, and steps to drain.
    pub timeout: Duration,
    running: tokio::sync::Mutex<()>,
    /// `--expert-precision-policy load` on the coordinator: the bf16 share
    /// of routed tokens to keep (the rest of the experts int8).
    precision: Option<f64>,
}

/// Forward steps between automatic precision checks when automatic EPLB is
/// off (`--eplb-interval 0`) and the precision policy is on.
pub const PRECISION_INTERVAL_STEPS: u64 = 256;
/// The precision policy re-plans only when the bf16 experts in force cover
/// less than the share minus this (or hold far more experts in bf16 than
/// needed): load noise around the boundary does not repack experts.
pub const PRECISION_SLACK: f64 = 0.05;

/// What the automatic loop does.
#[derive(Debug, Clone, Copy)]
pub struct AutoOptions {
    /// Rebalance by EPLB (`--eplb-interval` > 0).
    pub eplb: bool,
    /// Forward steps between checks.
    pub interval: u64,
    /// Redundant replicas per layer for EPLB.
    pub redundant: usize,
    /// Least gain in mean balancedness for EPLB to apply a plan.
    pub min_improvement: f64,
}

impl Controller {
    /// A controller over `state` driving `dispatcher`.
    pub fn new(
        state: ClusterState,
        dispatcher: Arc<GrpcDispatcher>,
        moe_layers: Vec<usize>,
        num_experts: usize,
        expert_bytes: u64,
        timeout: Duration,
    ) -> Self {
        Controller {
            state,
            dispatcher,
            moe_layers,
            num_experts,
            expert_bytes,
            timeout,
            running: tokio::sync::Mutex::new(()),
            precision: None,
        }
    }

    /// With `Some(share)`, plans also choose each expert's precision from
    /// the load window ([`eplb::precision_by_load`]), and [`Self::auto`]
    /// applies a precision change as its own rebalance when the load moved.
    pub fn with_precision_policy(mut self, bf16_share: Option<f64>) -> Self {
        self.precision = bf16_share;
        self
    }

    /// The precision policy's bf16 share, if it is on.
    pub fn precision_policy(&self) -> Option<f64> {
        self.precision
    }

    /// A plan that only changes experts' precision (same replicas), when
    /// the precision policy is on, there is load, and the int8 set in force
    /// misses the share by more than [`PRECISION_SLACK`] or keeps more than
    /// a quarter more experts in bf16 than the share needs.
    pub async fn plan_precision(&self) -> Res<Option<Plan>> {
        let Some(share) = self.precision else {
            return Ok(None);
        };
        let (from, _) = self.current().await?;
        let loads = self.loads();
        if loads.iter().flatten().all(|&x| x == 0.0) {
            return Ok(None);
        }
        let want = eplb::precision_by_load(&self.moe_layers, &loads, share);
        let have = from.int8_experts();
        if want == have {
            return Ok(None);
        }
        let all = self.moe_layers.len() * self.num_experts;
        let covered = eplb::bf16_coverage(&self.moe_layers, &loads, &have);
        let (bf_have, bf_want) = (
            all.saturating_sub(have.len()) as f64,
            all.saturating_sub(want.len()) as f64,
        );
        if covered >= share - PRECISION_SLACK && bf_have <= 1.25 * bf_want + 1.0 {
            return Ok(None);
        }
        let est = estimate(&from, &loads);
        Ok(Some(Plan {
            target: from.with_int8(&want),
            from,
            current: est.clone(),
            predicted: est,
        }))
    }

    async fn current(&self) -> Res<(Placement, i64)> {
        self.state
            .placement()
            .await
            .map_err(store_err)?
            .ok_or_else(|| RebalanceError::Unavailable("no placement has been written yet".into()))
    }

    async fn registered(&self) -> Res<Vec<WorkerInfo>> {
        self.state.workers("expert").await.map_err(store_err)
    }

    fn loads(&self) -> Vec<Vec<f64>> {
        self.dispatcher
            .load_snapshot()
            .map(|s| s.expert_loads(&self.moe_layers, self.num_experts))
            .unwrap_or_else(|| vec![vec![0.0; self.num_experts]; self.moe_layers.len()])
    }

    /// Checks workers' offered memory (when they report it) against what
    /// `p` asks them to hold.
    fn check_memory(&self, p: &Placement, registered: &[WorkerInfo]) -> Res<()> {
        for (w, &n) in p.workers.iter().zip(&p.counts()) {
            if let Some(info) = registered.iter().find(|i| &i.id == w)
                && info.memory_bytes > 0
                && n as u64 * self.expert_bytes > info.memory_bytes
            {
                return Err(RebalanceError::OverCapacity(format!(
                    "worker {w} would hold {n} experts ({} bytes); it offers {} bytes",
                    n as u64 * self.expert_bytes,
                    info.memory_bytes
                )));
            }
        }
        Ok(())
    }

    /// Plans a placement with the EPLB policy from the measured load over
    /// the registered, non-drained workers: `redundant` extra replicas per
    /// layer, at most `capacity` experts of a layer per worker (0 = as few as fit).
    pub async fn plan_rebalance(&self, redundant: usize, capacity: usize) -> Res<Plan> {
        let (from, _) = self.current().await?;
        let drained = self.state.drained().await.map_err(store_err)?;
        let registered = self.registered().await?;
        let workers: Vec<String> = registered
            .iter()
            .map(|w| w.id.clone())
            .filter(|w| !drained.contains(w))
            .collect();
        if workers.is_empty() {
            return Err(RebalanceError::Unavailable(
                "no registered, undrained expert-worker to place experts on".into(),
            ));
        }
        let n = workers.len();
        let cap = if capacity == 0 {
            (self.num_experts + redundant).div_ceil(n)
        } else {
            capacity
        };
        let loads = self.loads();
        if loads.iter().flatten().all(|&x| x == 0.0) {
            return Err(RebalanceError::NoLoad(
                "no expert load measured under the current placement yet (the window restarts at every placement change): send traffic first".into(),
            ));
        }
        let (mut target, predicted) =
            eplb::plan(0, &workers, &self.moe_layers, &loads, cap, redundant).map_err(|e| {
                RebalanceError::OverCapacity(format!(
                    "{} (redundant {redundant}, capacity {cap} per layer)",
                    e.0
                ))
            })?;
        self.check_memory(&target, &registered)?;
        // The precision policy chooses the int8 experts too; without it
        // every expert runs at the workers' own precision.
        if let Some(share) = self.precision {
            target = target.with_int8(&eplb::precision_by_load(&self.moe_layers, &loads, share));
        }
        let current = estimate(&from, &loads);
        Ok(Plan {
            from,
            target,
            current,
            predicted,
        })
    }

    /// Plans draining `worker`.
    pub async fn plan_drain(&self, worker: &str) -> Res<Plan> {
        let (from, _) = self.current().await?;
        let registered = self.registered().await?;
        let Some(gone) = from.workers.iter().position(|w| w == worker) else {
            return Err(RebalanceError::UnknownWorker(
                if registered.iter().any(|w| w.id == worker) {
                    format!("worker {worker} is registered but holds no experts")
                } else {
                    format!(
                        "unknown worker {worker}: the placement has {:?}",
                        from.workers
                    )
                },
            ));
        };
        let drained = self.state.drained().await.map_err(store_err)?;
        let remaining: Vec<usize> = from
            .workers
            .iter()
            .enumerate()
            .filter(|(i, w)| {
                *i != gone && !drained.contains(*w) && registered.iter().any(|r| &r.id == *w)
            })
            .map(|(i, _)| i)
            .collect();
        let loads = self.loads();
        let target = drain_plan(&from, gone, &remaining, &loads)?;
        self.check_memory(&target, &registered)?;
        Ok(Plan {
            current: estimate(&from, &loads),
            predicted: estimate(&target, &loads),
            from,
            target,
        })
    }

    /// Plans an explicit placement (validated against the model and the workers).
    pub async fn plan_explicit(&self, json: &str) -> Res<Plan> {
        let mut target: Placement = serde_json::from_str(json)
            .map_err(|e| RebalanceError::Invalid(format!("placement JSON: {e}")))?;
        target
            .validate(&self.moe_layers, self.num_experts)
            .map_err(|e| RebalanceError::Invalid(e.to_string()))?;
        let (from, _) = self.current().await?;
        let registered = self.registered().await?;
        for (w, &n) in target.workers.iter().zip(&target.counts()) {
            if n > 0 && !registered.iter().any(|r| &r.id == w) {
                return Err(RebalanceError::UnknownWorker(format!(
                    "unknown worker {w}: not registered in etcd"
                )));
            }
        }
        self.check_memory(&target, &registered)?;
        target.version = 0;
        let loads = self.loads();
        Ok(Plan {
            current: estimate(&from, &loads),
            predicted: estimate(&target, &loads),
            from,
            target,
        })
    }

    /// Applies a plan live; returns when it is done or rolled back.
    pub async fn apply(&self, plan: Plan, reason: &str) -> Res<Outcome> {
        let _guard = self
            .running
            .try_lock()
            .map_err(|_| RebalanceError::AlreadyRunning("a rebalance is already running".into()))?;
        let (from, rev) = self.current().await?;
        if from.version != plan.from.version {
            return Err(RebalanceError::AlreadyRunning(format!(
                "the placement changed (v{} → v{}) since this plan was made; plan again",
                plan.from.version, from.version
            )));
        }
        let mut target = plan.target.clone();
        target.version = from.version + 1;
        target
            .validate(&self.moe_layers, self.num_experts)
            .map_err(|e| RebalanceError::Invalid(e.to_string()))?;
        let mut out = Outcome {
            id: String::new(),
            state: "unchanged".into(),
            from_version: from.version,
            to_version: from.version,
            current: plan.current.clone(),
            predicted: plan.predicted.clone(),
            placement: from.clone(),
            message: String::new(),
        };
        if same_assignment(&from, &target) {
            out.message = "the planned placement equals the current one".into();
            return Ok(out);
        }
        let mut doc = Rebalance {
            id: format!("rb-{}-v{}", now_ms(), target.version),
            state: RebalanceState::Proposed,
            reason: reason.to_string(),
            from: from.clone(),
            target: target.clone(),
            message: String::new(),
            updated_ms: now_ms(),
        };
        if let Err(active) = self.state.start_rebalance(&doc).await.map_err(store_err)? {
            return Err(RebalanceError::AlreadyRunning(format!(
                "rebalance {active} is already running"
            )));
        }
        tracing::info!(id = %doc.id, reason, from = from.version, to = target.version, "rebalance proposed");
        out.id = doc.id.clone();
        out.to_version = target.version;
        out.placement = target.clone();
        match self.drive(&mut doc, rev).await {
            Ok(()) => {
                out.state = "done".into();
            }
            Err(msg) => {
                tracing::warn!(id = %doc.id, message = %msg, "rebalance rolled back");
                doc.state = RebalanceState::RolledBack;
                doc.message = msg.clone();
                self.put(&mut doc).await?;
                out.state = "rolled_back".into();
                out.message = msg;
                out.to_version = from.version;
                out.placement = from;
            }
        }
        Ok(out)
    }

    async fn put(&self, doc: &mut Rebalance) -> Res<()> {
        doc.updated_ms = now_ms();
        self.state.put_rebalance(doc).await.map_err(store_err)
    }

    /// proposed → loading → ready → switched → done; `Err` = roll back (before the switch).
    async fn drive(&self, doc: &mut Rebalance, rev: i64) -> Result<(), String> {
        let started = Instant::now();
        let need = doc.loading_workers();
        let registered = self.registered().await.map_err(|e| e.to_string())?;
        if let Some(w) = need
            .iter()
            .find(|w| !registered.iter().any(|r| &r.id == *w))
        {
            return Err(format!("worker {w} is not registered"));
        }
        doc.state = RebalanceState::Loading;
        self.put(doc).await.map_err(|e| e.to_string())?;
        loop {
            let ready = self
                .state
                .ready_workers(&doc.id)
                .await
                .map_err(|e| e.to_string())?;
            let missing: Vec<&String> = need.iter().filter(|w| !ready.contains(*w)).collect();
            if missing.is_empty() {
                break;
            }
            // A worker we wait for whose lease expired will not report:
            // roll back now rather than at the timeout. A failed read
            // proves nothing; the next poll looks again.
            match self.registered().await {
                Ok(reg) => {
                    if let Some(w) = missing.iter().find(|w| !reg.iter().any(|r| &r.id == **w)) {
                        return Err(format!(
                            "worker {w} is no longer registered (its lease expired) while loading its new replicas"
                        ));
                    }
                }
                Err(e) => tracing::debug!(error = %e, "cannot read the registry; looking again"),
            }
            if started.elapsed() > self.timeout {
                return Err(format!(
                    "workers {missing:?} did not load their new replicas within {} s",
                    self.timeout.as_secs()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        doc.state = RebalanceState::Ready;
        self.put(doc).await.map_err(|e| e.to_string())?;
        // The switch: the placement key first (workers keep both shares
        // until done), then the dispatcher, which takes it at a step boundary.
        let swapped = self
            .state
            .swap_placement(rev, &doc.target)
            .await
            .map_err(|e| e.to_string())?;
        if !swapped {
            return Err("the placement was changed by someone else during the rebalance".into());
        }
        let addrs = self
            .registered()
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|w| (w.id, w.addr))
            .collect();
        self.dispatcher.set_route(Route {
            placement: Arc::new(doc.target.clone()),
            addrs,
        });
        // The workers that just reported ready serve the new placement (a
        // restarted or returning one at a new address, too): the dispatcher's
        // liveness learns it now, not at its next periodic probe.
        self.dispatcher.probe_once().await;
        doc.state = RebalanceState::Switched;
        if let Err(e) = self.put(doc).await {
            // Past the switch there is no going back: a restarted coordinator completes it.
            tracing::error!(error = %e, "cannot record the switch; the placement is switched");
        }
        let t = Instant::now();
        while !self.dispatcher.old_steps_finished(doc.target.version) {
            if t.elapsed() > self.timeout {
                tracing::warn!("a step on the old placement never finished; completing anyway");
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        doc.state = RebalanceState::Done;
        doc.message = format!("took {:.2} s", started.elapsed().as_secs_f64());
        if let Err(e) = self.put(doc).await {
            tracing::error!(error = %e, "cannot record that the rebalance is done");
        }
        tracing::info!(id = %doc.id, version = doc.target.version, "rebalance done");
        Ok(())
    }

    /// At start-up: finishes or rolls back a rebalance a previous
    /// coordinator left active (see the module docs).
    pub async fn resume(&self) -> anyhow::Result<Option<String>> {
        let Some((mut doc, _)) = self.state.rebalance().await? else {
            return Ok(None);
        };
        if !doc.state.active() {
            return Ok(None);
        }
        let placed = self.state.placement().await?.map(|(p, _)| p.version);
        let was = doc.state;
        if placed == Some(doc.target.version) {
            doc.state = RebalanceState::Done;
            doc.message = format!(
                "completed by a restarted coordinator (found in state {})",
                was.as_str()
            );
        } else {
            doc.state = RebalanceState::RolledBack;
            doc.message = format!(
                "rolled back by a restarted coordinator (found in state {}, before the switch)",
                was.as_str()
            );
        }
        doc.updated_ms = now_ms();
        self.state.put_rebalance(&doc).await?;
        Ok(Some(format!("rebalance {}: {}", doc.id, doc.message)))
    }

    /// Takes the workers `p` gives experts to out of the drained set (an
    /// explicit placement is the way back for a drained worker).
    pub async fn undrain_placed(&self, p: &Placement) -> Res<()> {
        let mut d: BTreeSet<String> = self.state.drained().await.map_err(store_err)?;
        let before = d.len();
        for (w, &n) in p.workers.iter().zip(&p.counts()) {
            if n > 0 {
                d.remove(w);
            }
        }
        if d.len() != before {
            self.state.set_drained(&d).await.map_err(store_err)?;
        }
        Ok(())
    }

    /// Marks `worker` drained after its drain went through.
    pub async fn mark_drained(&self, worker: &str) -> Res<()> {
        let mut d: BTreeSet<String> = self.state.drained().await.map_err(store_err)?;
        d.insert(worker.to_string());
        self.state.set_drained(&d).await.map_err(store_err)
    }

    /// Automatic rebalancing: every `o.interval` forward steps, with EPLB
    /// on, plans with `o.redundant` extra replicas per layer and applies the
    /// plan if it improves the mean balancedness by at least
    /// `o.min_improvement`; otherwise, with the precision policy on, applies
    /// a precision change when [`Self::plan_precision`] finds one. Each
    /// rebalance applied is a `status` line.
    pub async fn auto(self: Arc<Self>, o: AutoOptions, status: Status) {
        let mut last = self.dispatcher.steps_total();
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let now = self.dispatcher.steps_total();
            if now.saturating_sub(last) < o.interval {
                continue;
            }
            last = now;
            let mut chosen = None;
            if o.eplb {
                match self.plan_rebalance(o.redundant, 0).await {
                    Ok(plan) if plan.improvement() >= o.min_improvement => {
                        chosen = Some((plan, "auto"));
                    }
                    Ok(plan) => {
                        tracing::debug!(
                            gain = plan.improvement(),
                            "automatic rebalance: not worth it"
                        )
                    }
                    Err(e) => tracing::warn!(error = %e, "automatic rebalance: cannot plan"),
                }
            }
            if chosen.is_none() {
                match self.plan_precision().await {
                    Ok(Some(plan)) => chosen = Some((plan, "precision")),
                    Ok(None) => {}
                    Err(e) => tracing::warn!(error = %e, "precision policy: cannot plan"),
                }
            }
            let Some((plan, reason)) = chosen else {
                continue;
            };
            let int8 = plan.target.int8_experts().len();
            match self.apply(plan, reason).await {
                Ok(o) => {
                    status.say(&format!(
                        "epserve coordinator: automatic rebalance {} {} (v{} → v{}, {reason}, predicted balancedness {:?}, {int8} experts int8)",
                        o.id, o.state, o.from_version, o.to_version, o.predicted
                    ));
                    last = self.dispatcher.steps_total();
                }
                Err(e) => tracing::warn!(error = %e, "automatic rebalance failed"),
            }
        }
    }
}

fn same_assignment(a: &Placement, b: &Placement) -> bool {
    let key = |p: &Placement| -> Vec<(usize, Vec<u32>, Vec<Vec<String>>)> {
        p.layers
            .iter()
            .map(|l: &LayerPlacement| {
                (
                    l.layer,
                    l.int8.clone(),
                    l.experts
                        .iter()
                        .map(|reps| {
                            let mut v: Vec<String> = reps
                                .iter()
                                .filter_map(|&r| p.workers.get(r as usize).cloned())
                                .collect();
                            v.sort();
                            v
                        })
                        .collect(),
                )
            })
            .collect()
    };
    key(a) == key(b)
}

mod recover;
pub use recover::{Action, SuperviseOptions, Supervisor, join_plan};

#[cfg(test)]
mod tests;
