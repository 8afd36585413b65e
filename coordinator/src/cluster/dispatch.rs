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
//!   over them, per (layer, expert) and across steps, so they split evenly;
//!   replicas on workers that are no longer registered are skipped.
//! - Load: every dispatch is recorded in a [`LoadStats`] window.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use epserve_core::moe::{Dispatcher, Routing, SKIP_SLOT};
use epserve_core::placement::Placement;
use epserve_core::{Error, Result};
use epserve_proto::pb::expert_service_client::ExpertServiceClient;
use epserve_proto::pb::{DispatchRequest, Dtype};
use epserve_proto::wire;
use futures_util::future::join_all;
use metrics::{counter, histogram};
use tonic::transport::{Channel, Endpoint};
use tracing::Instrument;

use super::load::{LoadSnapshot, LoadStats};

/// Where experts are and how to reach their workers.
#[derive(Debug, Clone)]
pub struct Route {
    pub placement: Arc<Placement>,
    /// Worker id → gRPC address.
    pub addrs: HashMap<String, String>,
}

/// The route one forward step uses for all its MoE layers.
#[derive(Default)]
struct StepState {
    route: Option<Arc<Route>>,
    last_layer: Option<usize>,
    in_step: bool,
}

/// Dispatches expert work to expert-workers over gRPC.
pub struct GrpcDispatcher {
    rt: tokio::runtime::Handle,
    load: Mutex<LoadStats>,
    step: Mutex<StepState>,
    /// Next replica per (layer, expert).
    next_replica: Mutex<HashMap<usize, Vec<u32>>>,
    expert_metrics: bool,
    last_expert_metrics: Mutex<Option<Instant>>,
    route: RwLock<Arc<Route>>,
    /// Worker id → (address, client); a worker that comes back on a new
    /// address gets a new client.
    clients: std::sync::Mutex<HashMap<String, (String, ExpertServiceClient<Channel>)>>,
    dtype: Dtype,
    timeout: Duration,
}

struct WorkerBatch {
    worker: String,
    rows: Vec<usize>,
    ids: Vec<u32>,
    weights: Vec<f32>,
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
            rt,
            load: Mutex::new(LoadStats::new(window)),
            step: Mutex::new(StepState::default()),
            next_replica: Mutex::new(HashMap::new()),
            expert_metrics,
            last_expert_metrics: Mutex::new(None),
            route: RwLock::new(Arc::new(route)),
            clients: std::sync::Mutex::new(HashMap::new()),
            dtype,
            timeout,
        }
    }

    /// Switches to a new route (takes effect at the next step's first MoE layer).
    /// A route with an older placement version than the one in force only
    /// updates the worker addresses: placements never go backwards (a slow
    /// refresh from etcd must not undo a switch).
    pub fn set_route(&self, route: Route) {
        if let Ok(mut g) = self.route.write() {
            if route.placement.version < g.placement.version {
                *g = Arc::new(Route {
                    placement: g.placement.clone(),
                    addrs: route.addrs,
                });
            } else {
                *g = Arc::new(route);
            }
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

    /// The route for this dispatch: a new snapshot at a step's first MoE layer.
    fn step_route(&self, layer: usize) -> Result<Arc<Route>> {
        let mut s = self
            .step
            .lock()
            .map_err(|_| Error::Dispatch("step lock poisoned".into()))?;
        let new_step = s.route.is_none() || !s.in_step || s.last_layer.is_none_or(|l| layer <= l);
        if new_step {
            let route = self
                .route()
                .ok_or_else(|| Error::Dispatch("no route".into()))?;
            if let Ok(mut stats) = self.load.lock() {
                stats.begin_step(route.placement.version);
            }
            s.route = Some(route);
            s.in_step = true;
        }
        s.last_layer = Some(layer);
        s.route
            .clone()
            .ok_or_else(|| Error::Dispatch("no route".into()))
    }

    /// Marks the step finished after its last MoE layer (or a failure).
    fn end_layer(&self, layer: usize, route: &Route, failed: bool) {
        if let Ok(mut s) = self.step.lock()
            && (failed
                || route
                    .placement
                    .layers
                    .last()
                    .is_some_and(|l| l.layer == layer))
        {
            s.in_step = false;
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

    fn client(&self, worker: &str, addr: &str) -> Result<ExpertServiceClient<Channel>> {
        let mut clients = self
            .clients
            .lock()
            .map_err(|_| Error::Dispatch("client cache lock poisoned".into()))?;
        if let Some((a, c)) = clients.get(worker)
            && a == addr
        {
            return Ok(c.clone());
        }
        let ep = Endpoint::from_shared(addr.to_string())
            .map_err(|e| Error::Dispatch(format!("worker {worker}: bad address {addr}: {e}")))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5))
            .timeout(self.timeout);
        // connect_lazy spawns the connection task: it needs the runtime entered.
        let _guard = self.rt.enter();
        let c = ExpertServiceClient::new(ep.connect_lazy())
            .max_decoding_message_size(1 << 30)
            .max_encoding_message_size(1 << 30);
        clients.insert(worker.to_string(), (addr.to_string(), c.clone()));
        Ok(c)
    }

    fn plan(&self, route: &Route, layer: usize, routing: &Routing) -> Result<Vec<WorkerBatch>> {
        let lp = route.placement.layer(layer).ok_or_else(|| {
            Error::Dispatch(format!(
                "placement v{} has no layer {layer}",
                route.placement.version
            ))
        })?;
        let k = routing.top_k;
        let mut by_worker: HashMap<u32, WorkerBatch> = HashMap::new();
        let mut rr = self
            .next_replica
            .lock()
            .map_err(|_| Error::Dispatch("replica counter lock poisoned".into()))?;
        let next = rr.entry(layer).or_default();
        if next.len() < lp.experts.len() {
            next.resize(lp.experts.len(), 0);
        }
        for t in 0..routing.num_tokens {
            for s in 0..k {
                let e = routing.topk_ids[t * k + s] as usize;
                let reps = lp.experts.get(e).filter(|r| !r.is_empty()).ok_or_else(|| {
                    Error::Dispatch(format!("layer {layer}: expert {e} has no replica"))
                })?;
                // Spread a replicated expert's tokens over its replicas, round-robin.
                let w = if reps.len() == 1 {
                    reps[0]
                } else {
                    let i = next[e] as usize % reps.len();
                    next[e] = next[e].wrapping_add(1);
                    // Skip replicas on workers no longer registered (dead:
                    // their lease expired) while another replica lives.
                    let live = |w: u32| {
                        route
                            .placement
                            .workers
                            .get(w as usize)
                            .is_some_and(|id| route.addrs.contains_key(id))
                    };
                    (0..reps.len())
                        .map(|j| reps[(i + j) % reps.len()])
                        .find(|&w| live(w))
                        .unwrap_or(reps[i])
                };
                let b = by_worker.entry(w).or_insert_with(|| WorkerBatch {
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
        }
        let mut v: Vec<WorkerBatch> = by_worker.into_values().collect();
        v.sort_by(|a, b| a.worker.cmp(&b.worker));
        Ok(v)
    }
}

impl Dispatcher for GrpcDispatcher {
    #[tracing::instrument(
        level = "debug",
        name = "dispatch",
        skip_all,
        fields(layer = layer, tokens = routing.num_tokens, workers = tracing::field::Empty)
    )]
    fn dispatch(
        &self,
        layer: usize,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
    ) -> Result<Vec<f32>> {
        let route = self.step_route(layer)?;
        let res = self.dispatch_with(&route, layer, x, hidden, routing);
        self.end_layer(layer, &route, res.is_err());
        res
    }
}

impl GrpcDispatcher {
    fn dispatch_with(
        &self,
        route: &Route,
        layer: usize,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
    ) -> Result<Vec<f32>> {
        let started = Instant::now();
        let batches = self.plan(route, layer, routing)?;
        tracing::Span::current().record("workers", batches.len());
        let k = routing.top_k;
        self.record_load(layer, route, &batches);
        let version = route.placement.version;
        let mut calls = Vec::with_capacity(batches.len());
        for b in &batches {
            let addr = route
                .addrs
                .get(&b.worker)
                .ok_or_else(|| Error::Dispatch(format!("worker {} is not registered", b.worker)))?;
            let mut client = self.client(&b.worker, addr)?;
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
                output_dtype: self.dtype as i32,
            };
            let sent = req.tokens.as_ref().map(|t| t.data.len()).unwrap_or(0);
            counter!("epserve_dispatch_bytes_sent_total", "worker" => b.worker.clone())
                .increment(sent as u64);
            let (worker, addr) = (b.worker.clone(), addr.clone());
            let timeout = self.timeout;
            let span = tracing::debug_span!("dispatch_call", worker = %worker, rows = b.rows.len());
            calls.push(
                async move {
                    let mut r = tonic::Request::new(req);
                    r.set_timeout(timeout);
                    let res = client.dispatch(r).await;
                    (worker, addr, res)
                }
                .instrument(span),
            );
        }
        let results = self.rt.block_on(join_all(calls));
        let mut out = vec![0.0f32; routing.num_tokens * k * hidden];
        for (b, (worker, addr, res)) in batches.iter().zip(results) {
            let resp = res
                .map_err(|s| {
                    Error::Dispatch(format!(
                        "expert-worker {worker} ({addr}) failed: {}",
                        s.message()
                    ))
                })?
                .into_inner();
            histogram!("epserve_expert_worker_queue_seconds", "worker" => worker.clone())
                .record(resp.queue_us as f64 / 1e6);
            histogram!("epserve_expert_worker_compute_seconds", "worker" => worker.clone())
                .record(resp.compute_us as f64 / 1e6);
            let t = resp.outputs.ok_or_else(|| {
                Error::Dispatch(format!("expert-worker {worker}: empty response"))
            })?;
            counter!("epserve_dispatch_bytes_received_total", "worker" => worker.clone())
                .increment(t.data.len() as u64);
            let ys = wire::decode(&t)
                .map_err(|e| Error::Dispatch(format!("expert-worker {worker}: {e}")))?;
            let want = b.ids.iter().filter(|&&i| i != SKIP_SLOT).count();
            if ys.len() != want * hidden {
                return Err(Error::Dispatch(format!(
                    "expert-worker {worker} returned {} values for {want} slots",
                    ys.len()
                )));
            }
            let mut next = 0;
            for (ri, &tok) in b.rows.iter().enumerate() {
                for s in 0..k {
                    if b.ids[ri * k + s] != SKIP_SLOT {
                        let dst = (tok * k + s) * hidden;
                        out[dst..dst + hidden]
                            .copy_from_slice(&ys[next * hidden..(next + 1) * hidden]);
                        next += 1;
                    }
                }
            }
        }
        histogram!("epserve_dispatch_seconds", "layer" => layer.to_string())
            .record(started.elapsed().as_secs_f64());
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dispatcher(live: &[&str]) -> GrpcDispatcher {
        // Layer 0: expert 0 on w0 and w1, expert 1 on w1.
        let mut p = Placement::initial(&[0], 2, &["w0".into(), "w1".into()]).expect("placement");
        p.layers[0].experts = vec![vec![0, 1], vec![1]];
        let addrs = live
            .iter()
            .map(|w| (w.to_string(), format!("http://127.0.0.1:1/{w}")))
            .collect();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        GrpcDispatcher::new(
            rt.handle().clone(),
            Route {
                placement: Arc::new(p),
                addrs,
            },
            Dtype::F32,
            Duration::from_secs(1),
            8,
            false,
        )
    }

    fn routing(ids: &[u32]) -> Routing {
        Routing {
            num_tokens: ids.len(),
            top_k: 1,
            topk_ids: ids.to_vec(),
            topk_weights: vec![1.0; ids.len()],
        }
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
        let route = d.route().expect("route");
        let b = d.plan(&route, 0, &routing(&[0; 10])).expect("plan");
        assert_eq!(slots(&b), vec![("w0".into(), 5), ("w1".into(), 5)]);
        // One token per step (decode) still alternates.
        let mut per = HashMap::new();
        for _ in 0..6 {
            for (w, n) in slots(&d.plan(&route, 0, &routing(&[0])).expect("plan")) {
                *per.entry(w).or_insert(0) += n;
            }
        }
        assert_eq!(per.get("w0"), Some(&3));
        assert_eq!(per.get("w1"), Some(&3));
        // An unreplicated expert goes to its one worker.
        let b = d.plan(&route, 0, &routing(&[1, 1])).expect("plan");
        assert_eq!(slots(&b), vec![("w1".into(), 2)]);
    }

    #[test]
    fn a_dead_replica_is_skipped() {
        let d = dispatcher(&["w1"]);
        let route = d.route().expect("route");
        let b = d.plan(&route, 0, &routing(&[0; 6])).expect("plan");
        assert_eq!(slots(&b), vec![("w1".into(), 6)]);
    }

    #[test]
    fn a_step_keeps_one_route_and_placements_never_go_back() {
        let d = dispatcher(&["w0", "w1"]);
        let v1 = d.route().expect("route");
        assert_eq!(d.step_route(0).expect("route").placement.version, 1);
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
        // The step in flight finishes on v1 (layer 0 is its last MoE layer) ...
        d.end_layer(0, &v1, false);
        assert!(d.old_steps_finished(2));
        // ... and the next one takes v2.
        assert_eq!(d.step_route(0).expect("route").placement.version, 2);
    }
}
