//! The gRPC dispatcher: for each MoE layer, groups the routed slots by the
//! worker holding their expert (replicas chosen per token, balanced), sends one
//! `Dispatch` per worker concurrently (all-to-all), and scatters the returned
//! per-slot outputs back. Connections are reused; every call has a deadline.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use epserve_core::model::moe::{Dispatcher, Routing, SKIP_SLOT};
use epserve_core::placement::Placement;
use epserve_core::{Error, Result};
use epserve_proto::pb::expert_service_client::ExpertServiceClient;
use epserve_proto::pb::{DispatchRequest, Dtype};
use epserve_proto::wire;
use futures_util::future::join_all;
use metrics::{counter, histogram};
use tonic::transport::{Channel, Endpoint};

/// Where experts are and how to reach their workers.
#[derive(Debug, Clone)]
pub struct Route {
    pub placement: Arc<Placement>,
    /// Worker id → gRPC address.
    pub addrs: HashMap<String, String>,
}

/// Steps of per-worker load kept for the balancedness gauge.
const LOAD_WINDOW: usize = 64;

/// Slots sent to each worker per layer over the last [`LOAD_WINDOW`] dispatches.
#[derive(Default)]
struct LoadWindow {
    /// layer → ring of per-worker slot counts (worker id → slots).
    steps: HashMap<usize, std::collections::VecDeque<HashMap<String, usize>>>,
}

impl LoadWindow {
    /// Records one dispatch and returns the layer's balancedness over the
    /// window: mean worker load / max worker load, over every placed worker.
    fn record(&mut self, layer: usize, counts: HashMap<String, usize>, workers: &[String]) -> f64 {
        let ring = self.steps.entry(layer).or_default();
        if ring.len() == LOAD_WINDOW {
            ring.pop_front();
        }
        ring.push_back(counts);
        let loads: Vec<f64> = workers
            .iter()
            .map(|w| {
                ring.iter()
                    .map(|c| c.get(w).copied().unwrap_or(0))
                    .sum::<usize>() as f64
            })
            .collect();
        epserve_core::eplb::balancedness(&loads)
    }
}

/// Dispatches expert work to expert-workers over gRPC.
pub struct GrpcDispatcher {
    rt: tokio::runtime::Handle,
    load: std::sync::Mutex<LoadWindow>,
    route: RwLock<Arc<Route>>,
    clients: std::sync::Mutex<HashMap<String, ExpertServiceClient<Channel>>>,
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
    /// A dispatcher on `rt` with the given route, wire dtype and per-call deadline.
    pub fn new(rt: tokio::runtime::Handle, route: Route, dtype: Dtype, timeout: Duration) -> Self {
        GrpcDispatcher {
            rt,
            load: std::sync::Mutex::new(LoadWindow::default()),
            route: RwLock::new(Arc::new(route)),
            clients: std::sync::Mutex::new(HashMap::new()),
            dtype,
            timeout,
        }
    }

    /// Switches to a new route (takes effect at the next layer's dispatch).
    pub fn set_route(&self, route: Route) {
        if let Ok(mut g) = self.route.write() {
            *g = Arc::new(route);
        }
    }

    /// The route in force.
    pub fn route(&self) -> Option<Arc<Route>> {
        self.route.read().ok().map(|g| g.clone())
    }

    fn client(&self, worker: &str, addr: &str) -> Result<ExpertServiceClient<Channel>> {
        let mut clients = self
            .clients
            .lock()
            .map_err(|_| Error::Dispatch("client cache lock poisoned".into()))?;
        if let Some(c) = clients.get(worker) {
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
        clients.insert(worker.to_string(), c.clone());
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
        for t in 0..routing.num_tokens {
            for s in 0..k {
                let e = routing.topk_ids[t * k + s] as usize;
                let reps = lp.experts.get(e).filter(|r| !r.is_empty()).ok_or_else(|| {
                    Error::Dispatch(format!("layer {layer}: expert {e} has no replica"))
                })?;
                // Spread a replicated expert's tokens over its replicas.
                let w = reps[t % reps.len()];
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
    fn dispatch(
        &self,
        layer: usize,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
    ) -> Result<Vec<f32>> {
        let started = Instant::now();
        let route = self
            .route()
            .ok_or_else(|| Error::Dispatch("no route".into()))?;
        let batches = self.plan(&route, layer, routing)?;
        let k = routing.top_k;
        let counts: HashMap<String, usize> = batches
            .iter()
            .map(|b| {
                (
                    b.worker.clone(),
                    b.ids.iter().filter(|&&i| i != SKIP_SLOT).count(),
                )
            })
            .collect();
        if let Ok(mut w) = self.load.lock() {
            let bal = w.record(layer, counts, &route.placement.workers);
            metrics::gauge!("epserve_eplb_balancedness", "layer" => layer.to_string()).set(bal);
        }
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
            calls.push(async move {
                let mut r = tonic::Request::new(req);
                r.set_timeout(timeout);
                let res = client.dispatch(r).await;
                (worker, addr, res)
            });
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
