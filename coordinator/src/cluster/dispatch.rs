//! The gRPC dispatcher: for each MoE layer, groups the routed slots by the
//! worker holding their expert, sends one `Dispatch` per worker concurrently
//! (all-to-all), and scatters the returned per-slot outputs back. Connections
//! are reused; every call has a deadline.
//!
//! - Step boundary: the route (placement snapshot) is taken at the first MoE
//!   layer of each forward step and used for all its layers, so a placement
//!   switch never splits a step (a step begins when a layer id does not
//!   increase over the previous dispatch's; the scheduler runs one forward
//!   at a time).
//! - Replicas: the tokens of an expert with several replicas go round-robin
//!   over its live replicas, per (layer, expert) and across steps, so they
//!   split evenly.
//! - Failover: a call that fails or misses its deadline marks its worker dead
//!   ([`Liveness`]) and its slots are re-sent, within the same layer of the
//!   same step, to other live replicas of their experts; the dead worker is
//!   skipped from then on until a health probe finds it serving again. The
//!   clients are `tower` stacks (deadline, in-flight limit) and re-sends draw
//!   from a `tower` retry budget, so a sick cluster is not flooded.
//! - Lost experts: a slot whose expert has no live replica is not sent; its
//!   token row is reported through [`Dispatcher::take_faults`] (the scheduler
//!   fails those sequences with a retryable 503 and the rest of the batch goes
//!   on), or, with [`OnExpertLoss::Reroute`], the row's top-k is renormalized
//!   over its live experts and the row is flagged as degraded.
//! - Load: every dispatch is recorded in a [`LoadStats`] window.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use epserve_cluster::tls::NodeTls;
use epserve_core::moe::{
    DispatchTiming, Dispatched, Dispatcher, PendingDispatch, Routing, RowFault, SKIP_SLOT,
};
use epserve_core::placement::Placement;
use epserve_core::{Error, Result};
use epserve_proto::pb::expert_service_client::ExpertServiceClient;
use epserve_proto::pb::{DispatchRequest, DispatchResponse, Dtype, ExpertState, HealthRequest};
use epserve_proto::wire;
use futures_util::future::join_all;
use metrics::{counter, gauge, histogram};
use tonic::Status;
use tonic::transport::Channel;
use tower::retry::budget::{Budget, TpsBudget};
use tracing::Instrument;

use super::load::{LoadSnapshot, LoadStats};

/// Where experts are and how to reach their workers.
#[derive(Debug, Clone)]
pub struct Route {
    pub placement: Arc<Placement>,
    /// Worker id → gRPC address.
    pub addrs: HashMap<String, String>,
}

/// What happens to a token whose expert has no live replica
/// (`--on-expert-loss`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OnExpertLoss {
    /// The request fails with a retryable error (503 + Retry-After); every
    /// request whose tokens do not need the lost experts goes on.
    #[default]
    Fail,
    /// Degraded mode: the token's top-k weights are renormalized over its
    /// live experts (same total weight), and the response says so.
    Reroute,
}

/// How long a probe of a worker's health may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// In-flight calls per worker client (tower concurrency limit).
const MAX_IN_FLIGHT: usize = 64;

#[derive(Debug, Clone)]
struct WorkerHealth {
    live: bool,
    since: Instant,
    reason: String,
}

/// Which workers are believed alive, from failed calls and health probes
/// (not only from their etcd leases: etcd may be away while a worker serves,
/// and a hung worker may keep its lease). A worker never seen is live.
#[derive(Debug)]
pub struct Liveness {
    workers: Mutex<HashMap<String, WorkerHealth>>,
    /// Bumped whenever a worker is marked dead: calls in flight to it stop
    /// waiting (a hung worker would otherwise hold the step until the
    /// dispatch deadline).
    deaths: tokio::sync::watch::Sender<u64>,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            workers: Mutex::new(HashMap::new()),
            deaths: tokio::sync::watch::channel(0).0,
        }
    }
}

impl Liveness {
    /// Resolves once `worker` is marked dead (at once if it is).
    pub async fn died(&self, worker: &str) {
        let mut rx = self.deaths.subscribe();
        loop {
            if !self.is_live(worker) {
                return;
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// True unless `worker` was marked dead and not seen serving since.
    pub fn is_live(&self, worker: &str) -> bool {
        self.workers
            .lock()
            .map(|m| m.get(worker).is_none_or(|h| h.live))
            .unwrap_or(true)
    }

    /// Marks `worker` dead (a failed call or probe); true if it was live.
    pub fn mark_dead(&self, worker: &str, reason: &str) -> bool {
        let Ok(mut m) = self.workers.lock() else {
            return false;
        };
        let was_live = m.get(worker).is_none_or(|h| h.live);
        if was_live {
            tracing::warn!(
                worker,
                reason,
                "expert-worker marked dead; its replicas are skipped"
            );
            counter!("epserve_expert_worker_failures_total", "worker" => worker.to_string())
                .increment(1);
            m.insert(
                worker.to_string(),
                WorkerHealth {
                    live: false,
                    since: Instant::now(),
                    reason: reason.to_string(),
                },
            );
            self.deaths.send_modify(|n| *n += 1);
        }
        gauge!("epserve_expert_worker_up", "worker" => worker.to_string()).set(0.0);
        was_live
    }

    /// Marks `worker` live (a probe found it serving); true if it was dead.
    pub fn mark_live(&self, worker: &str) -> bool {
        let Ok(mut m) = self.workers.lock() else {
            return false;
        };
        let was_dead = m.get(worker).is_some_and(|h| !h.live);
        if was_dead {
            tracing::info!(worker, "expert-worker serving again");
        }
        if was_dead || !m.contains_key(worker) {
            m.insert(
                worker.to_string(),
                WorkerHealth {
                    live: true,
                    since: Instant::now(),
                    reason: String::new(),
                },
            );
        }
        gauge!("epserve_expert_worker_up", "worker" => worker.to_string()).set(1.0);
        was_dead
    }

    /// Dead workers: id, why, and for how long.
    pub fn dead(&self) -> Vec<(String, String, Duration)> {
        let mut v: Vec<_> = self
            .workers
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(_, h)| !h.live)
                    .map(|(w, h)| (w.clone(), h.reason.clone(), h.since.elapsed()))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
}

/// The route one forward step uses for all its MoE layers.
#[derive(Default)]
struct StepState {
    route: Option<Arc<Route>>,
    in_step: bool,
}

type RpcService = tower::limit::ConcurrencyLimit<tower::timeout::Timeout<Channel>>;

/// One worker's clients over one connection: `rpc` for Dispatch (deadline,
/// in-flight limit), `probe` for health checks (not queued behind work).
#[derive(Clone)]
struct Conn {
    addr: String,
    rpc: ExpertServiceClient<RpcService>,
    probe: ExpertServiceClient<Channel>,
}

/// Dispatches expert work to expert-workers over gRPC, in two phases: a
/// submit plans the calls and spawns them on the runtime (the scheduler
/// thread goes on with other work), the pending handle waits for the
/// combined outputs. Everything it keeps is in [`DispatchCore`], shared with
/// the tasks in flight.
pub struct GrpcDispatcher {
    core: Arc<DispatchCore>,
}

impl std::ops::Deref for GrpcDispatcher {
    type Target = DispatchCore;

    fn deref(&self) -> &DispatchCore {
        &self.core
    }
}

/// The state of a [`GrpcDispatcher`].
pub struct DispatchCore {
    rt: tokio::runtime::Handle,
    load: Mutex<LoadStats>,
    step: Mutex<StepState>,
    /// Next replica per (layer, expert).
    next_replica: Mutex<HashMap<usize, Vec<u32>>>,
    expert_metrics: bool,
    last_expert_metrics: Mutex<Option<Instant>>,
    route: RwLock<Arc<Route>>,
    /// Worker id → its connection; a worker that comes back on a new address
    /// gets a new one.
    clients: Mutex<HashMap<String, Conn>>,
    liveness: Arc<Liveness>,
    /// Re-sends after a failed call draw from it; first sends deposit.
    budget: TpsBudget,
    on_loss: OnExpertLoss,
    dtype: Dtype,
    timeout: Duration,
    /// Mutual TLS on the links to the workers (`--tls-*`): a worker must
    /// present a certificate from the CA naming its registered host.
    tls: Option<NodeTls>,
    /// Set once a worker answered with tier counters (it has a cold tier):
    /// the forward pass then sends router-lookahead prefetch hints.
    tiered_workers: std::sync::atomic::AtomicBool,
    /// The latest hint (`Dispatcher::prefetch`), sent with the next layer's
    /// requests to the workers that hold its experts.
    hint: Mutex<Option<(usize, Vec<u32>)>>,
}

#[derive(Debug)]
struct WorkerBatch {
    /// Index of the worker in the placement.
    index: u32,
    worker: String,
    rows: Vec<usize>,
    ids: Vec<u32>,
    weights: Vec<f32>,
}

impl WorkerBatch {
    /// The (token, slot) pairs this batch carries.
    fn slots(&self, k: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.rows.iter().enumerate().flat_map(move |(ri, &t)| {
            (0..k)
                .filter(move |&s| self.ids[ri * k + s] != SKIP_SLOT)
                .map(move |s| (t, s))
        })
    }
}

/// A slot no live replica could take.
struct LostSlot {
    token: usize,
    slot: usize,
    why: String,
}

impl GrpcDispatcher {
    /// A dispatcher on `rt` with the given route, wire dtype and per-call
    /// deadline; load is kept over `window` steps, and per-expert load gauges
    /// are exported when `expert_metrics` is set.
    pub fn new(
        rt: tokio::runtime::Handle,
        route: Route,
        dtype: Dtype,
        timeout: Duration,
        window: usize,
        expert_metrics: bool,
    ) -> Self {
        GrpcDispatcher {
            core: Arc::new(DispatchCore::new(
                rt,
                route,
                dtype,
                timeout,
                window,
                expert_metrics,
            )),
        }
    }

    /// What to do with tokens whose expert has no live replica.
    pub fn with_on_expert_loss(mut self, policy: OnExpertLoss) -> Self {
        if let Some(c) = Arc::get_mut(&mut self.core) {
            c.on_loss = policy;
        }
        self
    }

    /// Mutual TLS on the links to the workers.
    pub fn with_tls(mut self, tls: Option<NodeTls>) -> Self {
        if let Some(c) = Arc::get_mut(&mut self.core) {
            c.tls = tls;
        }
        self
    }

    /// Probes every placed worker each `period`, forever (spawn it).
    pub fn probe_forever(&self, period: Duration) -> impl Future<Output = ()> + Send + 'static {
        let core = self.core.clone();
        async move {
            loop {
                tokio::time::sleep(period).await;
                core.probe_once().await;
            }
        }
    }
}

impl DispatchCore {
    fn new(
        rt: tokio::runtime::Handle,
        route: Route,
        dtype: Dtype,
        timeout: Duration,
        window: usize,
        expert_metrics: bool,
    ) -> Self {
        DispatchCore {
            rt,
            load: Mutex::new(LoadStats::new(window)),
            step: Mutex::new(StepState::default()),
            next_replica: Mutex::new(HashMap::new()),
            expert_metrics,
            last_expert_metrics: Mutex::new(None),
            route: RwLock::new(Arc::new(route)),
            clients: Mutex::new(HashMap::new()),
            liveness: Arc::new(Liveness::default()),
            // Re-sends: up to 20 % of the calls of the last 10 s, and at
            // least 10 per second.
            budget: TpsBudget::new(Duration::from_secs(10), 10, 0.2),
            on_loss: OnExpertLoss::Fail,
            dtype,
            timeout,
            tls: None,
            tiered_workers: std::sync::atomic::AtomicBool::new(false),
            hint: Mutex::new(None),
        }
    }

    /// Which workers are believed alive.
    pub fn liveness(&self) -> &Arc<Liveness> {
        &self.liveness
    }

    /// Switches to a new route (takes effect at the next step's first MoE layer).
    /// A route with an older placement version than the one in force only
    /// updates the worker addresses: placements never go backwards (a slow
    /// refresh from etcd must not undo a switch). A placed worker missing
    /// from the new addresses (its registration lapsed, e.g. while etcd was
    /// away) keeps its last known address: whether it is alive is for calls
    /// and health probes to tell.
    pub fn set_route(&self, route: Route) {
        if let Ok(mut g) = self.route.write() {
            let placement = if route.placement.version < g.placement.version {
                g.placement.clone()
            } else {
                route.placement
            };
            let mut addrs = route.addrs;
            for w in &placement.workers {
                if !addrs.contains_key(w)
                    && let Some(a) = g.addrs.get(w)
                {
                    addrs.insert(w.clone(), a.clone());
                }
            }
            *g = Arc::new(Route { placement, addrs });
        }
    }

    /// The route in force.
    pub fn route(&self) -> Option<Arc<Route>> {
        self.route.read().ok().map(|g| g.clone())
    }

    /// True once no forward step routed with a placement older than
    /// `version` is in flight.
    pub fn old_steps_finished(&self, version: u64) -> bool {
        match self.step.lock() {
            Ok(s) => {
                !s.in_step
                    || s.route
                        .as_ref()
                        .is_some_and(|r| r.placement.version >= version)
            }
            Err(_) => false,
        }
    }

    /// The load window under the placement in force.
    pub fn load_snapshot(&self) -> Option<LoadSnapshot> {
        let route = self.route()?;
        let stats = self.load.lock().ok()?;
        Some(stats.snapshot(&route.placement))
    }

    /// Forward steps dispatched since start.
    pub fn steps_total(&self) -> u64 {
        self.load.lock().map(|s| s.steps_total()).unwrap_or(0)
    }

    /// Records one step's load of `layer` (tests of the planners).
    #[cfg(test)]
    pub fn record_for_test(&self, layer: usize, counts: &[(u32, &str, u32)]) {
        if let (Some(route), Ok(mut s)) = (self.route(), self.load.lock()) {
            s.begin_step(route.placement.version);
            s.record(layer, counts);
        }
    }

    /// Per placed worker (by index): can it take work? It has an address and
    /// is not marked dead. Read once per dispatch, not per slot.
    fn live_mask(&self, route: &Route) -> Vec<bool> {
        route
            .placement
            .workers
            .iter()
            .map(|id| route.addrs.contains_key(id) && self.liveness.is_live(id))
            .collect()
    }

    /// `(layer, expert)` pairs of the route in force with no live replica,
    /// each with the reason its replicas are down (empty when all are served).
    pub fn unserved(&self) -> Vec<(usize, usize, String)> {
        let Some(route) = self.route() else {
            return Vec::new();
        };
        let dead: HashMap<String, String> = self
            .liveness
            .dead()
            .into_iter()
            .map(|(w, why, _)| (w, why))
            .collect();
        let live = self.live_mask(&route);
        let mut out = Vec::new();
        for lp in &route.placement.layers {
            for (e, reps) in lp.experts.iter().enumerate() {
                if !reps.iter().any(|&w| live.get(w as usize) == Some(&true)) {
                    let why = reps
                        .iter()
                        .filter_map(|&w| route.placement.workers.get(w as usize))
                        .map(|w| match dead.get(w) {
                            Some(r) => format!("{w}: {r}"),
                            None => format!("{w}: not registered"),
                        })
                        .collect::<Vec<_>>()
                        .join("; ");
                    out.push((lp.layer, e, why));
                }
            }
        }
        out
    }

    /// Opens a forward step: takes the route it uses for all its dispatches.
    fn open_step(&self) -> Result<Arc<Route>> {
        let mut s = self
            .step
            .lock()
            .map_err(|_| Error::Dispatch("step lock poisoned".into()))?;
        let route = self
            .route()
            .ok_or_else(|| Error::Dispatch("no route".into()))?;
        if let Ok(mut stats) = self.load.lock() {
            stats.begin_step(route.placement.version);
        }
        s.route = Some(route.clone());
        s.in_step = true;
        Ok(route)
    }

    /// Closes the step [`open_step`](Self::open_step) opened.
    fn close_step(&self) {
        if let Ok(mut s) = self.step.lock() {
            s.in_step = false;
        }
    }

    /// The route for a dispatch: the open step's, or (a dispatch outside any
    /// step) the one in force, as a step of its own.
    fn step_route(&self) -> Result<Arc<Route>> {
        let open = {
            let s = self
                .step
                .lock()
                .map_err(|_| Error::Dispatch("step lock poisoned".into()))?;
            s.route.clone().filter(|_| s.in_step)
        };
        match open {
            Some(r) => Ok(r),
            None => {
                let route = self
                    .route()
                    .ok_or_else(|| Error::Dispatch("no route".into()))?;
                if let Ok(mut stats) = self.load.lock() {
                    stats.begin_step(route.placement.version);
                }
                Ok(route)
            }
        }
    }

    fn record_load(&self, layer: usize, route: &Route, batches: &[WorkerBatch]) {
        let mut triples: Vec<(u32, &str, u32)> = Vec::new();
        for b in batches {
            let mut per: HashMap<u32, u32> = HashMap::new();
            for &e in b.ids.iter().filter(|&&i| i != SKIP_SLOT) {
                *per.entry(e).or_default() += 1;
            }
            let mut per: Vec<_> = per.into_iter().collect();
            per.sort_unstable();
            triples.extend(per.into_iter().map(|(e, n)| (e, b.worker.as_str(), n)));
        }
        let Ok(mut stats) = self.load.lock() else {
            return;
        };
        stats.record(layer, &triples);
        let l = stats.layer(layer, &route.placement);
        metrics::gauge!("epserve_eplb_balancedness", "layer" => layer.to_string())
            .set(l.balancedness);
        for (w, t) in route.placement.workers.iter().zip(&l.worker_tokens) {
            metrics::gauge!("epserve_eplb_worker_tokens", "layer" => layer.to_string(), "worker" => w.clone())
                .set(*t as f64);
        }
        if !self.expert_metrics {
            return;
        }
        // Per-expert series: layers x experts gauges, refreshed at most once a second.
        let due = match self.last_expert_metrics.lock() {
            Ok(mut last) => {
                let due = last.is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
                if due
                    && route
                        .placement
                        .layers
                        .last()
                        .is_some_and(|x| x.layer == layer)
                {
                    *last = Some(Instant::now());
                }
                due
            }
            Err(_) => false,
        };
        if due {
            for (e, t) in l.expert_tokens.iter().enumerate() {
                metrics::gauge!("epserve_eplb_expert_tokens", "layer" => layer.to_string(), "expert" => e.to_string())
                    .set(*t as f64);
            }
            for (e, w, t) in &l.replicas {
                metrics::gauge!("epserve_eplb_replica_tokens", "layer" => layer.to_string(), "expert" => e.to_string(), "worker" => w.clone())
                    .set(*t as f64);
            }
        }
    }

    fn conn(&self, worker: &str, addr: &str) -> Result<Conn> {
        let mut clients = self
            .clients
            .lock()
            .map_err(|_| Error::Dispatch("client cache lock poisoned".into()))?;
        if let Some(c) = clients.get(worker)
            && c.addr == addr
        {
            return Ok(c.clone());
        }
        let ep = epserve_cluster::tls::endpoint(addr, self.tls.as_ref())
            .map_err(|e| Error::Dispatch(format!("worker {worker}: {e:#}")))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(2));
        // connect_lazy spawns the connection task: it needs the runtime entered.
        let _guard = self.rt.enter();
        let channel = ep.connect_lazy();
        let svc = tower::ServiceBuilder::new()
            .concurrency_limit(MAX_IN_FLIGHT)
            .timeout(self.timeout)
            .service(channel.clone());
        let c = Conn {
            addr: addr.to_string(),
            rpc: ExpertServiceClient::new(svc)
                .max_decoding_message_size(1 << 30)
                .max_encoding_message_size(1 << 30),
            probe: ExpertServiceClient::new(channel),
        };
        clients.insert(worker.to_string(), c.clone());
        Ok(c)
    }

    /// Groups the `(token, slot)` pairs `todo` (in token order) by the live
    /// replica that takes each, skipping workers in `excluded`; slots whose
    /// expert has no live replica go to `lost`.
    fn plan(
        &self,
        route: &Route,
        layer: usize,
        routing: &Routing,
        todo: &[(usize, usize)],
        excluded: &HashSet<u32>,
        lost: &mut Vec<LostSlot>,
    ) -> Result<Vec<WorkerBatch>> {
        let lp = route.placement.layer(layer).ok_or_else(|| {
            Error::Dispatch(format!(
                "placement v{} has no layer {layer}",
                route.placement.version
            ))
        })?;
        let k = routing.top_k;
        let live = self.live_mask(route);
        let mut by_worker: BTreeMap<u32, WorkerBatch> = BTreeMap::new();
        let mut rr = self
            .next_replica
            .lock()
            .map_err(|_| Error::Dispatch("replica counter lock poisoned".into()))?;
        let next = rr.entry(layer).or_default();
        if next.len() < lp.experts.len() {
            next.resize(lp.experts.len(), 0);
        }
        for &(t, s) in todo {
            let e = routing.topk_ids[t * k + s] as usize;
            let reps = lp.experts.get(e).filter(|r| !r.is_empty()).ok_or_else(|| {
                Error::Dispatch(format!("layer {layer}: expert {e} has no replica"))
            })?;
            // Spread a replicated expert's tokens over its live replicas,
            // round-robin.
            let i = next[e] as usize % reps.len();
            if reps.len() > 1 {
                next[e] = next[e].wrapping_add(1);
            }
            let Some(w) = (0..reps.len())
                .map(|j| reps[(i + j) % reps.len()])
                .find(|w| !excluded.contains(w) && live.get(*w as usize) == Some(&true))
            else {
                let names: Vec<&str> = reps
                    .iter()
                    .filter_map(|&w| route.placement.workers.get(w as usize))
                    .map(String::as_str)
                    .collect();
                lost.push(LostSlot {
                    token: t,
                    slot: s,
                    why: format!(
                        "layer {layer}: expert {e} has no live replica (on {})",
                        names.join(", ")
                    ),
                });
                continue;
            };
            let b = by_worker.entry(w).or_insert_with(|| WorkerBatch {
                index: w,
                worker: route
                    .placement
                    .workers
                    .get(w as usize)
                    .cloned()
                    .unwrap_or_default(),
                rows: Vec::new(),
                ids: Vec::new(),
                weights: Vec::new(),
            });
            if b.rows.last() != Some(&t) {
                b.rows.push(t);
                b.ids.extend(std::iter::repeat_n(SKIP_SLOT, k));
                b.weights.extend(std::iter::repeat_n(0.0, k));
            }
            let base = (b.rows.len() - 1) * k;
            b.ids[base + s] = e as u32;
            b.weights[base + s] = routing.topk_weights[t * k + s];
        }
        let mut v: Vec<WorkerBatch> = by_worker.into_values().collect();
        v.sort_by(|a, b| a.worker.cmp(&b.worker));
        Ok(v)
    }

    /// Probes the health of every placed worker once: one that answers
    /// ready is live, one that does not answer (or is not ready) is dead.
    pub async fn probe_once(&self) {
        let Some(route) = self.route() else {
            return;
        };
        let mut probes = Vec::new();
        for w in &route.placement.workers {
            let Some(addr) = route.addrs.get(w) else {
                continue;
            };
            let Ok(conn) = self.conn(w, addr) else {
                continue;
            };
            let w = w.clone();
            probes.push(async move {
                let mut c = conn.probe;
                let mut r = tonic::Request::new(HealthRequest::default());
                r.set_timeout(PROBE_TIMEOUT);
                let res = tokio::time::timeout(PROBE_TIMEOUT, c.health(r)).await;
                let ok = match res {
                    Ok(Ok(h)) if h.get_ref().ready => Ok(()),
                    Ok(Ok(_)) => Err("not ready (loading its experts)".to_string()),
                    Ok(Err(s)) => Err(format!(
                        "health check failed: {}",
                        epserve_cluster::tls::status_why(&s)
                    )),
                    Err(_) => Err("health check timed out".to_string()),
                };
                (w, ok)
            });
        }
        for (w, ok) in join_all(probes).await {
            match ok {
                Ok(()) => {
                    self.liveness.mark_live(&w);
                }
                Err(why) => {
                    self.liveness.mark_dead(&w, &why);
                }
            }
        }
    }

    /// Every placed worker's expert tiers and precisions, by worker id
    /// (`epserve ctl load`); a worker that does not answer within the
    /// probe timeout is left out.
    pub async fn expert_states(&self) -> HashMap<String, Vec<ExpertState>> {
        let Some(route) = self.route() else {
            return HashMap::new();
        };
        let mut asks = Vec::new();
        for w in &route.placement.workers {
            let Some(addr) = route.addrs.get(w) else {
                continue;
            };
            let Ok(conn) = self.conn(w, addr) else {
                continue;
            };
            let w = w.clone();
            asks.push(async move {
                let mut c = conn.probe;
                let mut r = tonic::Request::new(HealthRequest {
                    expert_states: true,
                });
                r.set_timeout(PROBE_TIMEOUT);
                let res = tokio::time::timeout(PROBE_TIMEOUT, c.health(r)).await;
                (w, res.ok().and_then(|r| r.ok()))
            });
        }
        join_all(asks)
            .await
            .into_iter()
            .filter_map(|(w, r)| Some((w, r?.into_inner().expert_states)))
            .collect()
    }

    /// Sends one round of batches; one result per batch.
    async fn send(
        &self,
        route: &Route,
        layer: usize,
        x: &[f32],
        hidden: usize,
        k: usize,
        batches: &[WorkerBatch],
    ) -> Vec<std::result::Result<DispatchResponse, (tonic::Code, String)>> {
        let version = route.placement.version;
        let hint = self.hint.lock().ok().and_then(|mut g| g.take());
        let mut calls = Vec::with_capacity(batches.len());
        for b in batches {
            let conn = match route.addrs.get(&b.worker) {
                Some(addr) => self.conn(&b.worker, addr),
                None => Err(Error::Dispatch(format!(
                    "worker {} is not registered",
                    b.worker
                ))),
            };
            let mut xs = Vec::with_capacity(b.rows.len() * hidden);
            for &t in &b.rows {
                xs.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
            }
            let req = DispatchRequest {
                layer: layer as u32,
                top_k: k as u32,
                tokens: Some(wire::encode(&xs, b.rows.len(), hidden, self.dtype)),
                topk_ids: b.ids.clone(),
                topk_weights: b.weights.clone(),
                placement_version: version,
                output_dtype: wire::output_dtype(self.dtype) as i32,
                combine: true,
                prefetch_layer: hint.as_ref().map_or(0, |h| h.0 as u32),
                prefetch_experts: hint
                    .as_ref()
                    .and_then(|(hl, ids)| {
                        let lp = route.placement.layer(*hl)?;
                        Some(
                            ids.iter()
                                .copied()
                                .filter(|&e| {
                                    lp.experts
                                        .get(e as usize)
                                        .is_some_and(|r| r.contains(&b.index))
                                })
                                .collect(),
                        )
                    })
                    .unwrap_or_default(),
            };
            let sent = req.tokens.as_ref().map(wire::payload_bytes).unwrap_or(0);
            counter!("epserve_dispatch_bytes_sent_total", "worker" => b.worker.clone())
                .increment(sent as u64);
            let timeout = self.timeout;
            let span =
                tracing::debug_span!("dispatch_call", worker = %b.worker, rows = b.rows.len());
            let liveness = self.liveness.clone();
            let worker = b.worker.clone();
            calls.push(
                async move {
                    let mut client = match conn {
                        Ok(c) => c.rpc,
                        Err(e) => return Err(Status::unavailable(e.to_string())),
                    };
                    let mut r = tonic::Request::new(req);
                    r.set_timeout(timeout);
                    // A worker the health probe finds dead meanwhile (hung,
                    // unreachable) is not waited for until the deadline.
                    tokio::select! {
                        res = client.dispatch(r) => res.map(|r| r.into_inner()),
                        _ = liveness.died(&worker) => Err(Status::unavailable(
                            "abandoned: its health check failed while the call was in flight",
                        )),
                    }
                }
                .instrument(span),
            );
        }
        let results = join_all(calls).await;
        if results
            .iter()
            .any(|r| r.as_ref().is_ok_and(|r| r.tiers.is_some()))
        {
            self.tiered_workers
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        results
            .into_iter()
            .zip(batches)
            .map(|(res, b)| {
                res.map_err(|s| {
                    let addr = route.addrs.get(&b.worker).map_or("?", String::as_str);
                    let msg = format!(
                        "expert-worker {} ({addr}) failed: {} ({:?})",
                        b.worker,
                        s.message(),
                        s.code()
                    );
                    (s.code(), msg)
                })
            })
            .collect()
    }

    /// One worker's answer as a partial sum per row of its batch
    /// (`[rows, hidden]`): as sent when it combined them, or summed here in
    /// slot order from per-slot outputs (a worker from before the combine).
    fn partial(
        b: &WorkerBatch,
        resp: DispatchResponse,
        k: usize,
        hidden: usize,
    ) -> std::result::Result<(Vec<f32>, Duration), String> {
        let worker = &b.worker;
        histogram!("epserve_expert_worker_queue_seconds", "worker" => worker.clone())
            .record(resp.queue_us as f64 / 1e6);
        histogram!("epserve_expert_worker_compute_seconds", "worker" => worker.clone())
            .record(resp.compute_us as f64 / 1e6);
        let compute = Duration::from_micros(resp.compute_us);
        if let Some(t) = &resp.tiers {
            record_tiers(worker, t);
        }
        let t = resp
            .outputs
            .ok_or_else(|| format!("expert-worker {worker}: empty response"))?;
        counter!("epserve_dispatch_bytes_received_total", "worker" => worker.clone())
            .increment(t.data.len() as u64);
        let ys = wire::decode(&t).map_err(|e| format!("expert-worker {worker}: {e}"))?;
        let rows = b.rows.len();
        if ys.len() == rows * hidden {
            return Ok((ys, compute));
        }
        let want = b.ids.iter().filter(|&&i| i != SKIP_SLOT).count();
        if ys.len() != want * hidden {
            return Err(format!(
                "expert-worker {worker} returned {} values for {rows} rows ({want} slots) of hidden size {hidden}",
                ys.len()
            ));
        }
        let mut part = vec![0.0f32; rows * hidden];
        let row_of: HashMap<usize, usize> =
            b.rows.iter().enumerate().map(|(i, &t)| (t, i)).collect();
        for (next, (tok, _)) in b.slots(k).enumerate() {
            let ri = row_of[&tok];
            for (d, v) in part[ri * hidden..(ri + 1) * hidden]
                .iter_mut()
                .zip(&ys[next * hidden..(next + 1) * hidden])
            {
                *d += v;
            }
        }
        Ok((part, compute))
    }

    /// Handles slots no live replica took: one fault per row and, when
    /// rerouting, the row's combined output (`out`, `[rows, hidden]`) scaled
    /// to the full top-k weight.
    fn settle_lost(
        &self,
        routing: &Routing,
        hidden: usize,
        lost: Vec<LostSlot>,
        out: &mut [f32],
    ) -> Vec<RowFault> {
        let k = routing.top_k;
        let mut by_row: BTreeMap<usize, Vec<LostSlot>> = BTreeMap::new();
        for l in lost {
            by_row.entry(l.token).or_default().push(l);
        }
        let mut faults = Vec::with_capacity(by_row.len());
        for (t, slots) in by_row {
            let why = slots
                .iter()
                .map(|l| l.why.as_str())
                .collect::<Vec<_>>()
                .join("; ");
            let w = &routing.topk_weights[t * k..(t + 1) * k];
            let total: f32 = w.iter().sum();
            let live: f32 = (0..k)
                .filter(|s| !slots.iter().any(|l| l.slot == *s))
                .map(|s| w[s])
                .sum();
            let reroute = self.on_loss == OnExpertLoss::Reroute && live > 0.0;
            if reroute {
                // The lost slots added nothing: scale the live ones up to
                // the row's whole weight.
                let scale = total / live;
                out[t * hidden..(t + 1) * hidden]
                    .iter_mut()
                    .for_each(|v| *v *= scale);
            }
            counter!("epserve_expert_loss_tokens_total",
                "action" => if reroute { "rerouted" } else { "failed" })
            .increment(1);
            faults.push(RowFault {
                row: t,
                message: why,
                degraded: reroute,
            });
        }
        faults
    }
}

/// Exports a worker's expert tier counters (`--expert-memory`).
fn record_tiers(worker: &str, t: &epserve_proto::pb::TierCounters) {
    crate::metrics::expert_tiers(
        worker,
        &epserve_core::experts::TierSnapshot {
            hits: t.hits,
            misses: t.misses,
            evictions: t.evictions,
            bytes_paged_in: t.bytes_paged_in,
            prefetched: t.prefetched,
            hinted: t.prefetch_hinted,
            prefetch_hits: t.prefetch_hits,
            resident_bytes: t.resident_bytes,
            cached_bytes: t.cached_bytes,
            budget_bytes: t.budget_bytes,
            resident_experts: t.resident_experts as u64,
            cached_experts: t.cached_experts as u64,
            held_experts: t.held_experts as u64,
            ..Default::default()
        },
    );
}

impl Dispatcher for GrpcDispatcher {
    #[tracing::instrument(
        level = "debug",
        name = "dispatch",
        skip_all,
        fields(layer = layer, tokens = routing.num_tokens)
    )]
    fn submit(
        &self,
        layer: usize,
        x: Arc<[f32]>,
        hidden: usize,
        routing: Arc<Routing>,
    ) -> Result<PendingDispatch> {
        let submitted = Instant::now();
        let route = self.step_route()?;
        let core = self.core.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.rt.spawn(
            async move {
                let mut r = core
                    .dispatch_with(&route, layer, &x, hidden, &routing)
                    .await;
                if let Ok(d) = r.as_mut()
                    && let Some(t) = d.timing.as_mut()
                {
                    t.wall = submitted.elapsed();
                }
                // The step may have failed and dropped its handle.
                let _ = tx.send(r);
            }
            .instrument(tracing::Span::current()),
        );
        Ok(PendingDispatch::later(move || {
            rx.blocking_recv().unwrap_or_else(|_| {
                Err(Error::Dispatch(format!(
                    "layer {layer}: the dispatch task ended without an answer"
                )))
            })
        }))
    }

    fn begin_step(&self) {
        if let Err(e) = self.open_step() {
            tracing::warn!(error = %e, "cannot open a dispatch step");
        }
    }

    fn end_step(&self) {
        self.close_step();
    }

    fn wants_prefetch(&self) -> bool {
        self.tiered_workers
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        if let Ok(mut g) = self.hint.lock() {
            *g = Some((layer, experts.to_vec()));
        }
    }
}

impl DispatchCore {
    /// Plans, sends, re-sends what failed, and sums every worker's partial
    /// per row in a fixed order (rounds, then workers by id), so the result
    /// does not depend on which call answered first.
    async fn dispatch_with(
        &self,
        route: &Route,
        layer: usize,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
    ) -> Result<Dispatched> {
        let started = Instant::now();
        let k = routing.top_k;
        let rows = routing.num_tokens;
        let mut todo: Vec<(usize, usize)> = (0..rows)
            .flat_map(|t| (0..k).map(move |s| (t, s)))
            .collect();
        let mut excluded: HashSet<u32> = HashSet::new();
        let mut lost: Vec<LostSlot> = Vec::new();
        let mut partials: Vec<(Vec<usize>, Vec<f32>)> = Vec::new();
        let mut timing = DispatchTiming {
            rows,
            distinct_experts: {
                let mut ids: Vec<u32> = routing.topk_ids.clone();
                ids.sort_unstable();
                ids.dedup();
                ids.len()
            },
            ..DispatchTiming::default()
        };
        let mut round = 0;
        loop {
            let batches = self.plan(route, layer, routing, &todo, &excluded, &mut lost)?;
            if round == 0 {
                tracing::Span::current().record("workers", batches.len());
                self.record_load(layer, route, &batches);
                for _ in &batches {
                    self.budget.deposit();
                }
            }
            if batches.is_empty() {
                break;
            }
            let results = self.send(route, layer, x, hidden, k, &batches).await;
            todo.clear();
            let mut failed = Vec::new();
            for (b, res) in batches.iter().zip(results) {
                let res = res.and_then(|resp| {
                    Self::partial(b, resp, k, hidden).map_err(|m| (tonic::Code::Internal, m))
                });
                match res {
                    Ok((part, compute)) => {
                        if round == 0 {
                            timing.compute = timing.compute.max(compute);
                        }
                        partials.push((b.rows.clone(), part));
                    }
                    // Our request was malformed: a bug, not a failure of the
                    // worker; re-sending would fail the same way.
                    Err((tonic::Code::InvalidArgument, msg)) => return Err(Error::Dispatch(msg)),
                    Err((code, msg)) => {
                        // A worker that does not hold an expert is alive (a
                        // placement change in flight): only this layer skips it.
                        if code != tonic::Code::FailedPrecondition {
                            self.liveness.mark_dead(&b.worker, &msg);
                        }
                        excluded.insert(b.index);
                        todo.extend(b.slots(k));
                        failed.push(msg);
                    }
                }
            }
            if todo.is_empty() {
                break;
            }
            todo.sort_unstable();
            round += 1;
            if !self.budget.withdraw() {
                tracing::warn!(layer, "retry budget exhausted; not re-sending");
                for &(t, s) in &todo {
                    lost.push(LostSlot {
                        token: t,
                        slot: s,
                        why: format!(
                            "layer {layer}: no re-send (retry budget exhausted) after: {}",
                            failed.join("; ")
                        ),
                    });
                }
                break;
            }
            counter!("epserve_dispatch_failovers_total").increment(1);
            tracing::warn!(layer, round, slots = todo.len(), errors = %failed.join("; "),
                "re-sending slots to other replicas");
        }
        let mut y = vec![0.0f32; rows * hidden];
        for (brows, part) in &partials {
            for (ri, &t) in brows.iter().enumerate() {
                for (d, v) in y[t * hidden..(t + 1) * hidden]
                    .iter_mut()
                    .zip(&part[ri * hidden..(ri + 1) * hidden])
                {
                    *d += v;
                }
            }
        }
        let faults = if lost.is_empty() {
            Vec::new()
        } else {
            self.settle_lost(routing, hidden, lost, &mut y)
        };
        histogram!("epserve_dispatch_seconds", "layer" => layer.to_string())
            .record(started.elapsed().as_secs_f64());
        Ok(Dispatched {
            y,
            faults,
            timing: Some(timing),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use epserve_proto::pb::HealthResponse;
    use epserve_proto::pb::expert_service_server::{ExpertService, ExpertServiceServer};

    fn dispatcher_on(
        rt: &tokio::runtime::Runtime,
        addrs: HashMap<String, String>,
    ) -> GrpcDispatcher {
        // Layer 0: expert 0 on w0 and w1, expert 1 on w1.
        let mut p = Placement::initial(&[0], 2, &["w0".into(), "w1".into()]).expect("placement");
        p.layers[0].experts = vec![vec![0, 1], vec![1]];
        GrpcDispatcher::new(
            rt.handle().clone(),
            Route {
                placement: Arc::new(p),
                addrs,
            },
            Dtype::F32,
            Duration::from_secs(2),
            8,
            false,
        )
    }

    fn dispatcher(live: &[&str]) -> GrpcDispatcher {
        let addrs = live
            .iter()
            .map(|w| (w.to_string(), format!("http://127.0.0.1:1/{w}")))
            .collect();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        dispatcher_on(&rt, addrs)
    }

    fn routing(ids: &[u32]) -> Routing {
        Routing {
            num_tokens: ids.len(),
            top_k: 1,
            topk_ids: ids.to_vec(),
            topk_weights: vec![1.0; ids.len()],
        }
    }

    fn plan_all(d: &GrpcDispatcher, r: &Routing) -> (Vec<WorkerBatch>, Vec<LostSlot>) {
        let route = d.route().expect("route");
        let todo: Vec<_> = (0..r.num_tokens)
            .flat_map(|t| (0..r.top_k).map(move |s| (t, s)))
            .collect();
        let mut lost = Vec::new();
        let b = d
            .plan(&route, 0, r, &todo, &HashSet::new(), &mut lost)
            .expect("plan");
        (b, lost)
    }

    fn slots(batches: &[WorkerBatch]) -> Vec<(String, usize)> {
        batches
            .iter()
            .map(|b| {
                (
                    b.worker.clone(),
                    b.ids.iter().filter(|&&i| i != SKIP_SLOT).count(),
                )
            })
            .collect()
    }

    #[test]
    fn replicas_split_tokens_evenly_within_and_across_steps() {
        let d = dispatcher(&["w0", "w1"]);
        let (b, _) = plan_all(&d, &routing(&[0; 10]));
        assert_eq!(slots(&b), vec![("w0".into(), 5), ("w1".into(), 5)]);
        // One token per step (decode) still alternates.
        let mut per = HashMap::new();
        for _ in 0..6 {
            for (w, n) in slots(&plan_all(&d, &routing(&[0])).0) {
                *per.entry(w).or_insert(0) += n;
            }
        }
        assert_eq!(per.get("w0"), Some(&3));
        assert_eq!(per.get("w1"), Some(&3));
        // An unreplicated expert goes to its one worker.
        let (b, _) = plan_all(&d, &routing(&[1, 1]));
        assert_eq!(slots(&b), vec![("w1".into(), 2)]);
    }

    #[test]
    fn unregistered_and_dead_replicas_are_skipped_and_unserved_experts_are_lost() {
        let d = dispatcher(&["w1"]);
        let (b, lost) = plan_all(&d, &routing(&[0; 6]));
        assert_eq!(slots(&b), vec![("w1".into(), 6)]);
        assert!(lost.is_empty());
        assert!(d.unserved().is_empty());

        let d = dispatcher(&["w0", "w1"]);
        d.liveness().mark_dead("w1", "test");
        let (b, lost) = plan_all(&d, &routing(&[0, 1, 0]));
        assert_eq!(slots(&b), vec![("w0".into(), 2)]);
        assert_eq!(lost.len(), 1);
        assert_eq!((lost[0].token, lost[0].slot), (1, 0));
        assert!(
            lost[0].why.contains("expert 1 has no live replica"),
            "{}",
            lost[0].why
        );
        let un = d.unserved();
        assert_eq!(un.len(), 1);
        assert_eq!((un[0].0, un[0].1), (0, 1));
        assert!(un[0].2.contains("w1: test"), "{:?}", un);
        // A probe that finds it serving brings it back.
        assert!(d.liveness().mark_live("w1"));
        assert!(d.unserved().is_empty());
    }

    #[test]
    fn a_lapsed_registration_keeps_the_last_known_address() {
        let d = dispatcher(&["w0", "w1"]);
        let r = d.route().expect("route");
        let mut addrs = r.addrs.clone();
        addrs.remove("w1");
        d.set_route(Route {
            placement: r.placement.clone(),
            addrs,
        });
        assert!(d.route().expect("route").addrs.contains_key("w1"));
    }

    #[test]
    fn a_step_keeps_one_route_and_placements_never_go_back() {
        let d = dispatcher(&["w0", "w1"]);
        let v1 = d.route().expect("route");
        d.begin_step();
        assert_eq!(d.step_route().expect("route").placement.version, 1);
        let mut p2 = (*v1.placement).clone();
        p2.version = 2;
        d.set_route(Route {
            placement: Arc::new(p2),
            addrs: v1.addrs.clone(),
        });
        assert!(!d.old_steps_finished(2), "the step on v1 is in flight");
        // A slow refresh with the old version only updates addresses.
        d.set_route((*v1).clone());
        assert_eq!(d.route().expect("route").placement.version, 2);
        // Every dispatch of the step in flight uses v1 ...
        assert_eq!(d.step_route().expect("route").placement.version, 1);
        d.end_step();
        assert!(d.old_steps_finished(2));
        // ... and the next step takes v2.
        d.begin_step();
        assert_eq!(d.step_route().expect("route").placement.version, 2);
        d.end_step();
    }

    /// A worker that returns, for each slot, `weight × (expert + 1)` in every
    /// element; or, `hang`ing, never answers a Dispatch.
    struct Fake {
        hang: bool,
    }

    /// Whether fake workers honour `combine` (an up-to-date worker) or
    /// answer per slot (one from before the field), alternately per call.
    static FAKE_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    #[tonic::async_trait]
    impl ExpertService for Fake {
        async fn dispatch(
            &self,
            req: tonic::Request<DispatchRequest>,
        ) -> std::result::Result<tonic::Response<DispatchResponse>, Status> {
            if self.hang {
                std::future::pending::<()>().await;
            }
            let r = req.into_inner();
            let hidden = r.tokens.as_ref().map_or(0, |t| t.cols as usize);
            let mut ys = Vec::new();
            for (&id, &w) in r.topk_ids.iter().zip(&r.topk_weights) {
                if id != SKIP_SLOT {
                    ys.extend(std::iter::repeat_n(w * (id as f32 + 1.0), hidden));
                }
            }
            let old = FAKE_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 2 == 1;
            if r.combine && !old {
                // Sum each row's slots.
                let k = r.top_k as usize;
                let rows = r.topk_ids.len() / k.max(1);
                let mut y = vec![0.0f32; rows * hidden];
                for t in 0..rows {
                    for s in 0..k {
                        let (id, w) = (r.topk_ids[t * k + s], r.topk_weights[t * k + s]);
                        if id != SKIP_SLOT {
                            for v in &mut y[t * hidden..(t + 1) * hidden] {
                                *v += w * (id as f32 + 1.0);
                            }
                        }
                    }
                }
                ys = y;
            }
            let n = ys.len() / hidden.max(1);
            Ok(tonic::Response::new(DispatchResponse {
                outputs: Some(wire::encode(&ys, n, hidden, Dtype::F32)),
                queue_us: 0,
                compute_us: 0,
                tiers: None,
            }))
        }

        async fn health(
            &self,
            _req: tonic::Request<HealthRequest>,
        ) -> std::result::Result<tonic::Response<HealthResponse>, Status> {
            Ok(tonic::Response::new(HealthResponse {
                worker_id: "fake".into(),
                ready: true,
                placement_version: 1,
                experts_loaded: 2,
                expert_states: Vec::new(),
            }))
        }
    }

    /// A runtime with a fake worker listening; its address.
    fn fake_worker() -> (tokio::runtime::Runtime, String) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let addr = serve_fake(&rt, false);
        (rt, addr)
    }

    /// Serves a fake worker on `rt`; its address.
    fn serve_fake(rt: &tokio::runtime::Runtime, hang: bool) -> String {
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let addr = format!("http://{}", listener.local_addr().expect("addr"));
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        rt.spawn(
            tonic::transport::Server::builder()
                .add_service(ExpertServiceServer::new(Fake { hang }))
                .serve_with_incoming(incoming),
        );
        addr
    }

    /// Serves a fake worker over mutual TLS with a certificate from `ca`
    /// naming `sans`; its address as registered (`https://127.0.0.1:PORT`).
    fn serve_fake_tls(
        rt: &tokio::runtime::Runtime,
        ca: &epserve_tools::pki::Ca,
        dir: &std::path::Path,
        name: &str,
        sans: &[&str],
    ) -> String {
        let tls = ca
            .write_leaf(dir, name, sans)
            .expect("leaf")
            .load()
            .expect("load")
            .expect("TLS on");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let addr = format!("https://{}", listener.local_addr().expect("addr"));
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        rt.spawn(
            epserve_cluster::tls::server_builder(Some(&tls))
                .expect("server TLS")
                .add_service(ExpertServiceServer::new(Fake { hang: false }))
                .serve_with_incoming(incoming),
        );
        addr
    }

    /// Mutual TLS: a worker whose certificate does not name the address it
    /// registered is marked dead with the handshake's reason and gets no
    /// rows; the one whose certificate names 127.0.0.1 takes them.
    #[test]
    fn a_worker_whose_certificate_names_another_host_is_unreachable() {
        let (rt, _) = fake_worker();
        let dir = tempfile::tempdir().expect("tmp");
        let ca = epserve_tools::pki::Ca::new("test CA").expect("CA");
        let wrong = serve_fake_tls(&rt, &ca, dir.path(), "w0", &["worker-0.example"]);
        let right = serve_fake_tls(&rt, &ca, dir.path(), "w1", &["127.0.0.1"]);
        let client = ca
            .write_leaf(dir.path(), "coordinator", &["127.0.0.1"])
            .expect("leaf")
            .load()
            .expect("load");
        let addrs = [("w0".to_string(), wrong), ("w1".to_string(), right)]
            .into_iter()
            .collect();
        let d = dispatcher_on(&rt, addrs).with_tls(client);
        rt.block_on(d.probe_once());
        assert!(d.liveness().is_live("w1"), "{:?}", d.liveness().dead());
        let dead = d.liveness().dead();
        assert_eq!(dead.len(), 1, "{dead:?}");
        assert_eq!(dead[0].0, "w0");
        assert!(
            dead[0].1.contains("certificate"),
            "the reason names the certificate: {}",
            dead[0].1
        );
        eprintln!("w0 marked dead: {}", dead[0].1);
        // Expert 0 (on w0 and w1) is served by w1 alone.
        let r = Routing {
            num_tokens: 1,
            top_k: 1,
            topk_ids: vec![0],
            topk_weights: vec![0.5],
        };
        let out = d.dispatch(0, &[0.0; 3], 3, &r).expect("dispatch");
        assert_eq!(out.y, vec![0.5, 0.5, 0.5]);
        assert!(out.faults.is_empty());
        drop(rt);
    }

    /// A port nothing listens on (bound, then released).
    fn dead_addr() -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}", l.local_addr().expect("addr"))
    }

    #[test]
    fn a_failed_call_is_re_sent_to_a_live_replica_within_the_layer() {
        let (rt, live) = fake_worker();
        let addrs = [("w0".to_string(), dead_addr()), ("w1".to_string(), live)]
            .into_iter()
            .collect();
        let d = dispatcher_on(&rt, addrs);
        let hidden = 3;
        // Two tokens on expert 0 (replicas w0 dead, w1 live): round-robin
        // sends one to w0, which fails; it is re-sent to w1.
        let r = Routing {
            num_tokens: 2,
            top_k: 1,
            topk_ids: vec![0, 0],
            topk_weights: vec![0.5, 0.25],
        };
        let out = d.dispatch(0, &[0.0; 6], hidden, &r).expect("dispatch");
        assert_eq!(out.y, vec![0.5, 0.5, 0.5, 0.25, 0.25, 0.25]);
        assert!(out.faults.is_empty());
        assert!(!d.liveness().is_live("w0"), "the dead replica is marked");
        // From then on it is skipped without a failed call.
        let out = d.dispatch(0, &[0.0; 6], hidden, &r).expect("dispatch");
        assert_eq!(out.y, vec![0.5, 0.5, 0.5, 0.25, 0.25, 0.25]);
        // The health probe agrees: w0 dead, w1 live.
        rt.block_on(d.probe_once());
        assert!(!d.liveness().is_live("w0"));
        assert!(d.liveness().is_live("w1"));
        drop(rt);
    }

    #[test]
    fn an_expert_without_a_live_replica_faults_its_rows_or_reroutes_them() {
        let (rt, live) = fake_worker();
        // Expert 1 only on w1, which is dead; expert 0 on w0 (live) and w1.
        let addrs: HashMap<String, String> =
            [("w0".to_string(), live), ("w1".to_string(), dead_addr())]
                .into_iter()
                .collect();
        let hidden = 2;
        // Token 0: experts 0 and 1 (weights 0.75 / 0.25); token 1: expert 0 twice.
        let r = Routing {
            num_tokens: 2,
            top_k: 2,
            topk_ids: vec![0, 1, 0, 0],
            topk_weights: vec![0.75, 0.25, 0.5, 0.5],
        };
        let d = dispatcher_on(&rt, addrs.clone());
        let out = d.dispatch(0, &[0.0; 4], hidden, &r).expect("dispatch");
        let f = &out.faults;
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].row, 0);
        assert!(!f[0].degraded);
        // Token 1 is exact (possibly after a failover from w1 to w0): its
        // two slots of expert 0, 0.5 × 1 each, summed.
        assert_eq!(&out.y[2..], &[1.0, 1.0]);

        let d = dispatcher_on(&rt, addrs).with_on_expert_loss(OnExpertLoss::Reroute);
        d.liveness().mark_dead("w1", "test");
        let out = d.dispatch(0, &[0.0; 4], hidden, &r).expect("dispatch");
        let f = &out.faults;
        assert_eq!(f.len(), 1);
        assert!(f[0].degraded);
        // Expert 0's slot carries the row's whole weight (0.75 + 0.25).
        assert_eq!(&out.y[..2], &[1.0, 1.0]);
        drop(rt);
    }

    #[test]
    fn a_call_to_a_worker_found_dead_meanwhile_is_abandoned_and_re_sent() {
        let (rt, live) = fake_worker();
        let hung = serve_fake(&rt, true);
        let mut p = Placement::initial(&[0], 2, &["w0".into(), "w1".into()]).expect("placement");
        p.layers[0].experts = vec![vec![0, 1], vec![1]];
        let addrs = [("w0".to_string(), hung), ("w1".to_string(), live)]
            .into_iter()
            .collect();
        // A deadline far beyond the test: only the liveness signal ends the call.
        let d = Arc::new(GrpcDispatcher::new(
            rt.handle().clone(),
            Route {
                placement: Arc::new(p),
                addrs,
            },
            Dtype::F32,
            Duration::from_secs(600),
            8,
            false,
        ));
        let r = Routing {
            num_tokens: 2,
            top_k: 1,
            topk_ids: vec![0, 0],
            topk_weights: vec![0.5, 0.25],
        };
        // The health probe's verdict, 300 ms into the call.
        let d2 = d.clone();
        let marker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            d2.liveness().mark_dead("w0", "health check timed out");
        });
        let t0 = Instant::now();
        let out = d.dispatch(0, &[0.0; 6], 3, &r).expect("dispatch");
        assert_eq!(out.y, vec![0.5, 0.5, 0.5, 0.25, 0.25, 0.25]);
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        assert!(out.faults.is_empty());
        marker.join().expect("marker");
        drop(rt);
    }
}
