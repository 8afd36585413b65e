//! `ExpertService`: decode the routed tokens, run them on the experts this
//! worker holds, return the weighted per-slot outputs. Malformed requests
//! (unknown layer or expert, wrong lengths, NaN/Inf, oversize, unknown dtype)
//! answer INVALID_ARGUMENT and change nothing. Readiness is the standard
//! `grpc.health.v1.Health` ([`ExpertWorker::health_service`]).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use anyhow::{Result, bail};
use epserve_cluster::runtime::Status as StatusLines;
use epserve_cluster::state::{Rebalance, desired_experts, desired_int8};
use epserve_core::config::ModelConfig;
use epserve_core::experts::{
    ExpertDtype, LoadOptions, SlotOutputs, TieredExperts, load_executor_shared,
};
use epserve_core::loader::weights::WeightStore;
use epserve_core::moe::{ExpertExecutor, QuantizedRows, Rows, SKIP_SLOT, combine};
use epserve_core::placement::Placement;
use epserve_proto::pb::expert_service_server::ExpertService;
use epserve_proto::pb::{
    DispatchRequest, DispatchResponse, Dtype, ExpertState, HealthRequest, HealthResponse,
    TierCounters,
};
use epserve_proto::wire;
use tonic::server::NamedService;
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

/// The most (token, slot) pairs one Dispatch may carry: `rows * top_k`
/// beyond this is refused as oversize (the output alone would need
/// `rows * top_k * hidden` floats).
pub const MAX_DISPATCH_SLOTS: usize = 1 << 20;

/// The gRPC name of `ExpertService` (what health checks for it name).
pub const EXPERT_SERVICE_NAME: &str = <epserve_proto::pb::expert_service_server::ExpertServiceServer<
    ExpertWorker,
> as NamedService>::NAME;

/// What the worker serves right now.
pub struct Loaded {
    pub version: u64,
    pub held: BTreeSet<(usize, usize)>,
    /// Those of `held` the placement asks in int8.
    pub int8: BTreeSet<(usize, usize)>,
    pub executor: Arc<dyn ExpertExecutor>,
}

/// Errors for placements this worker cannot serve.
pub fn check_placement(p: &Placement, cfg: &ModelConfig) -> Result<()> {
    if let Err(e) = p.validate(&cfg.moe_layers(), cfg.num_experts) {
        bail!("{e}");
    }
    Ok(())
}

/// The worker's state.
pub struct ExpertWorker {
    id: String,
    cfg: ModelConfig,
    ws: Arc<WeightStore>,
    opts: LoadOptions,
    loaded: RwLock<Option<Arc<Loaded>>>,
    /// Where "holds N experts" lines go (silent unless set).
    status: StatusLines,
    /// The `grpc.health.v1.Health` statuses ("" and `ExpertService`).
    health: HealthReporter,
    /// Serializes health updates (each writes what it read under the lock).
    health_lock: tokio::sync::Mutex<()>,
    /// Set once a drain started (SIGTERM): health says NOT_SERVING.
    draining: AtomicBool,
    /// With `--expert-memory`: the one tiered store every placement reuses
    /// (a new placement changes its assignment in place, so the budget holds
    /// across reloads).
    tiers: std::sync::Mutex<Option<Arc<TieredExperts>>>,
}

impl ExpertWorker {
    /// A worker that has loaded nothing yet.
    pub fn new(id: String, cfg: ModelConfig, ws: Arc<WeightStore>, opts: LoadOptions) -> Self {
        ExpertWorker {
            id,
            cfg,
            ws,
            opts,
            loaded: RwLock::new(None),
            status: StatusLines::silent(),
            health: HealthReporter::new(),
            health_lock: tokio::sync::Mutex::new(()),
            draining: AtomicBool::new(false),
            tiers: std::sync::Mutex::new(None),
        }
    }

    /// The `grpc.health.v1.Health` service of this worker, for "" (the
    /// server) and `epserve.v1.ExpertService`: NOT_SERVING until the experts
    /// of a placement are loaded, SERVING after (through later reloads: the
    /// old experts serve while new ones load), NOT_SERVING again once a drain
    /// started.
    pub async fn health_service(&self) -> HealthServer<HealthService> {
        self.update_health().await;
        HealthServer::new(HealthService::from_health_reporter(self.health.clone()))
    }

    /// True when health reports SERVING: a placement's experts are loaded and
    /// no drain started.
    pub fn ready(&self) -> bool {
        self.current().is_some() && !self.draining()
    }

    /// True once [`start_draining`](Self::start_draining) was called.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Marks the worker draining: health reports NOT_SERVING from now on
    /// (Dispatch keeps answering).
    pub async fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.update_health().await;
    }

    /// Writes [`ready`](Self::ready) into the health statuses.
    async fn update_health(&self) {
        let _g = self.health_lock.lock().await;
        let status = if self.ready() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for name in ["", EXPERT_SERVICE_NAME] {
            self.health.set_service_status(name, status).await;
        }
    }

    /// Checks a Dispatch request against the model: everything a peer could
    /// get wrong is INVALID_ARGUMENT. Returns the decoded tokens.
    fn check_dispatch(&self, r: &DispatchRequest) -> Result<wire::Decoded, Status> {
        let bad = |m: String| Err(Status::invalid_argument(m));
        let tokens = r
            .tokens
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("missing tokens"))?;
        let (rows, hidden, k) = (tokens.rows as usize, tokens.cols as usize, r.top_k as usize);
        let layer = r.layer as usize;
        let n = self.cfg.num_experts;
        if !self.cfg.moe_layers().contains(&layer) {
            return bad(format!("layer {layer} is not an MoE layer of the model"));
        }
        if hidden != self.cfg.hidden_size {
            return bad(format!(
                "tokens have {hidden} columns; the model's hidden size is {}",
                self.cfg.hidden_size
            ));
        }
        if k == 0 || k > n {
            return bad(format!("top_k {k} must be in 1..={n}"));
        }
        if rows.saturating_mul(k) > MAX_DISPATCH_SLOTS {
            return bad(format!(
                "{rows} tokens with top_k {k} exceed the limit of {MAX_DISPATCH_SLOTS} slots per call"
            ));
        }
        if r.topk_ids.len() != rows * k || r.topk_weights.len() != rows * k {
            return bad(format!(
                "{rows} tokens with top_k {k} need {} ids and weights, got {} and {}",
                rows * k,
                r.topk_ids.len(),
                r.topk_weights.len()
            ));
        }
        if let Some(id) = r
            .topk_ids
            .iter()
            .find(|&&i| i != SKIP_SLOT && i as usize >= n)
        {
            return bad(format!(
                "expert {id} does not exist (layer {layer} has {n} experts)"
            ));
        }
        if !r.prefetch_experts.is_empty() {
            let pl = r.prefetch_layer as usize;
            if !self.cfg.moe_layers().contains(&pl) {
                return bad(format!(
                    "prefetch layer {pl} is not an MoE layer of the model"
                ));
            }
            if r.prefetch_experts.len() > n {
                return bad(format!(
                    "{} prefetch experts for a layer of {n}",
                    r.prefetch_experts.len()
                ));
            }
            if let Some(id) = r.prefetch_experts.iter().find(|&&i| i as usize >= n) {
                return bad(format!(
                    "prefetch expert {id} does not exist (layer {pl} has {n} experts)"
                ));
            }
        }
        if let Some(s) = r.topk_weights.iter().position(|w| !w.is_finite()) {
            return bad(format!("weight of slot {s} is {}", r.topk_weights[s]));
        }
        match Dtype::try_from(r.output_dtype) {
            Err(_) => return bad(format!("unknown output dtype {}", r.output_dtype)),
            Ok(Dtype::Int8) => return bad("outputs are f32 or bf16, not int8".into()),
            Ok(_) => {}
        }
        // Int8 tokens keep their quantized rows: int8 experts use them as
        // they are (see `ExpertExecutor::execute_rows`).
        wire::decode_rows_finite(tokens).map_err(|e| Status::invalid_argument(e.to_string()))
    }

    /// Reports each change of the experts held to `status`.
    pub fn with_status(mut self, status: StatusLines) -> Self {
        self.status = status;
        self
    }

    /// The model's hidden size (columns of Dispatch tokens).
    pub fn hidden_size(&self) -> usize {
        self.cfg.hidden_size
    }

    /// This worker's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The `(layer, expert)` pairs loaded now.
    pub fn held(&self) -> std::collections::BTreeSet<(usize, usize)> {
        self.current().map(|l| l.held.clone()).unwrap_or_default()
    }

    /// The expert tiers, with `--expert-memory`.
    pub fn tiers(&self) -> Option<Arc<TieredExperts>> {
        self.tiers.lock().ok().and_then(|g| g.clone())
    }

    pub(crate) fn current(&self) -> Option<Arc<Loaded>> {
        self.loaded.read().ok().and_then(|g| g.clone())
    }

    /// Loads the experts this worker must hold under placement `p` and the
    /// rebalance document `r` (both placements' share while a rebalance is
    /// active, see [`desired_experts`]) if they changed, and switches to them.
    /// Requests in flight keep the executor they started with.
    #[tracing::instrument(
        level = "info",
        name = "apply_placement",
        skip_all,
        fields(worker = %self.id, version = p.version)
    )]
    pub async fn apply(
        self: &Arc<Self>,
        p: &Placement,
        r: Option<&Rebalance>,
    ) -> anyhow::Result<()> {
        check_placement(p, &self.cfg)?;
        if let Some(r) = r {
            check_placement(&r.target, &self.cfg)?;
        }
        let p = p.clone();
        let held = desired_experts(&self.id, Some(&p), r);
        let int8 = desired_int8(&self.id, Some(&p), r);
        if let Some(cur) = self.current()
            && cur.held == held
            && cur.int8 == int8
        {
            let l = Arc::new(Loaded {
                version: p.version,
                held,
                int8,
                executor: cur.executor.clone(),
            });
            if let Ok(mut g) = self.loaded.write() {
                *g = Some(l);
            }
            self.update_health().await;
            return Ok(());
        }
        let me = self.clone();
        let held2 = held.clone();
        let int82 = int8.clone();
        let started = Instant::now();
        let what = format!(
            "expert-worker '{}': loading {} experts (placement v{}) from {} of mapped weights",
            self.id,
            held.len(),
            p.version,
            epserve_core::loader::progress::human_bytes(self.ws.mapped_bytes())
        );
        let executor = tokio::task::spawn_blocking(move || {
            let progress = epserve_core::loader::progress::Reporter::start(what);
            let keep = |l: usize, e: usize| held2.contains(&(l, e));
            // The placement's int8 experts (the coordinator's precision
            // policy) over this worker's own precision flags.
            let mut opts = me.opts.clone();
            for &k in &int82 {
                opts.expert_dtype_overrides.insert(k, ExpertDtype::Int8);
            }
            let r = match me.tiers() {
                // Tiered: the same store, assigned the new experts.
                Some(t) => t
                    .assign_with_int8(&keep, &int82)
                    .map(|()| t.clone() as Arc<dyn ExpertExecutor>),
                // A tiered store keeps its options for life: it gets the
                // int8 experts as an assignment (changed by later
                // placements), not as options.
                None if me.opts.tier.is_some() => {
                    load_executor_shared(&me.cfg, &me.ws, &me.opts, keep).and_then(|(ex, t)| {
                        if let Some(t) = t {
                            t.assign_with_int8(&keep, &int82)?;
                            if let Ok(mut g) = me.tiers.lock() {
                                *g = Some(t);
                            }
                        }
                        Ok(ex)
                    })
                }
                None => load_executor_shared(&me.cfg, &me.ws, &opts, keep).map(|(ex, _)| ex),
            };
            if r.is_ok() {
                progress.finish();
            }
            r
        })
        .await??;
        tracing::info!(
            worker = %self.id,
            version = p.version,
            experts = held.len(),
            load_s = started.elapsed().as_secs_f64(),
            "experts loaded"
        );
        self.status.say(&format!(
            "epserve expert-worker '{}' holds {} experts (placement v{}{})",
            self.id,
            held.len(),
            p.version,
            match r {
                Some(r) if r.state.active() => format!(", rebalance {} {}", r.id, r.state.as_str()),
                _ => String::new(),
            }
        ));
        if let Ok(mut g) = self.loaded.write() {
            *g = Some(Arc::new(Loaded {
                version: p.version,
                held,
                int8,
                executor,
            }));
        }
        self.update_health().await;
        Ok(())
    }
}

#[tonic::async_trait]
impl ExpertService for ExpertWorker {
    #[tracing::instrument(
        level = "debug",
        name = "expert_dispatch",
        skip_all,
        fields(
            worker = %self.id,
            layer = req.get_ref().layer,
            rows = req.get_ref().tokens.as_ref().map_or(0, |t| t.rows),
            top_k = req.get_ref().top_k,
        )
    )]
    async fn dispatch(
        &self,
        req: Request<DispatchRequest>,
    ) -> Result<Response<DispatchResponse>, Status> {
        let arrived = Instant::now();
        let r = req.into_inner();
        let x = self.check_dispatch(&r)?;
        let loaded = self.current().ok_or_else(|| {
            Status::unavailable(format!("worker {} has no placement yet", self.id))
        })?;
        let (rows, hidden, k) = (
            r.tokens.as_ref().map_or(0, |t| t.rows as usize),
            self.cfg.hidden_size,
            r.top_k as usize,
        );
        let layer = r.layer as usize;
        for &id in r.topk_ids.iter().filter(|&&i| i != SKIP_SLOT) {
            if !loaded.held.contains(&(layer, id as usize)) {
                return Err(Status::failed_precondition(format!(
                    "worker {} does not hold expert {id} of layer {layer} (placement v{}, request v{})",
                    self.id, loaded.version, r.placement_version
                )));
            }
        }
        let out_dtype = Dtype::try_from(r.output_dtype).unwrap_or(Dtype::F32);
        let parent = tracing::Span::current();
        let tiers = self.tiers();
        let res = tokio::task::spawn_blocking(move || {
            let _span = tracing::debug_span!(parent: &parent, "execute").entered();
            let queued = arrived.elapsed();
            let t0 = Instant::now();
            // Reused per blocking thread; only skipped slots are zeroed
            // (`check_dispatch` made `topk_ids` rows x top_k long).
            let mut out = SlotOutputs::new(&r.topk_ids, hidden);
            let rows_in = Rows {
                f32: &x.values,
                int8: x.int8.as_ref().map(|q| QuantizedRows {
                    q: &q.q,
                    scales: &q.scales,
                }),
            };
            if !r.prefetch_experts.is_empty() {
                loaded
                    .executor
                    .prefetch(r.prefetch_layer as usize, &r.prefetch_experts);
            }
            loaded
                .executor
                .execute_rows(layer, rows_in, &r.topk_ids, &r.topk_weights, k, &mut out)
                .map_err(|e| Status::internal(e.to_string()))?;
            let outputs = if r.combine {
                // One vector per token: its slots summed in slot order
                // (skipped slots are zeros and add nothing).
                let mut y = vec![0.0f32; rows * hidden];
                combine(&out, rows, k, hidden, &mut y);
                wire::encode(&y, rows, hidden, out_dtype)
            } else {
                // Keep only this worker's slots, in slot order.
                let mut slots = Vec::new();
                for (s, &id) in r.topk_ids.iter().enumerate() {
                    if id != SKIP_SLOT {
                        slots.extend_from_slice(&out[s * hidden..(s + 1) * hidden]);
                    }
                }
                let n = slots.len() / hidden.max(1);
                wire::encode(&slots, n, hidden, out_dtype)
            };
            Ok::<_, Status>(DispatchResponse {
                outputs: Some(outputs),
                queue_us: queued.as_micros() as u64,
                compute_us: t0.elapsed().as_micros() as u64,
                tiers: tiers.map(|t| tier_counters(&t.snapshot())),
            })
        })
        .await
        .map_err(|e| Status::internal(format!("expert task failed: {e}")))??;
        Ok(Response::new(res))
    }

    #[tracing::instrument(level = "trace", name = "expert_health", skip_all, fields(worker = %self.id))]
    async fn health(
        &self,
        req: Request<HealthRequest>,
    ) -> Result<Response<HealthResponse>, Status> {
        let cur = self.current();
        let expert_states = match &cur {
            Some(c) if req.get_ref().expert_states => expert_states(c),
            _ => Vec::new(),
        };
        Ok(Response::new(HealthResponse {
            worker_id: self.id.clone(),
            ready: cur.is_some(),
            placement_version: cur.as_ref().map(|c| c.version).unwrap_or(0),
            experts_loaded: cur.as_ref().map(|c| c.held.len() as u32).unwrap_or(0),
            expert_states,
        }))
    }
}

/// Tier and precision of each expert the current placement has here (the
/// executor may hold more: a tiered store serves any expert on demand).
fn expert_states(c: &Loaded) -> Vec<ExpertState> {
    c.executor
        .expert_states()
        .into_iter()
        .filter(|x| c.held.contains(&(x.layer, x.expert)))
        .map(|x| ExpertState {
            layer: x.layer as u32,
            expert: x.expert as u32,
            tier: x.tier.into(),
            precision: x.precision.into(),
        })
        .collect()
}

/// The wire form of a tier snapshot.
pub fn tier_counters(s: &epserve_core::experts::TierSnapshot) -> TierCounters {
    TierCounters {
        hits: s.hits,
        misses: s.misses,
        evictions: s.evictions,
        bytes_paged_in: s.bytes_paged_in,
        prefetched: s.prefetched,
        prefetch_hinted: s.hinted,
        prefetch_hits: s.prefetch_hits,
        resident_bytes: s.resident_bytes,
        cached_bytes: s.cached_bytes,
        budget_bytes: s.budget_bytes,
        resident_experts: s.resident_experts as u32,
        cached_experts: s.cached_experts as u32,
        held_experts: s.held_experts as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn worker(ids: &[&str]) -> Result<(Arc<ExpertWorker>, Placement)> {
        worker_with(ids, LoadOptions::default())
    }

    fn worker_with(ids: &[&str], opts: LoadOptions) -> Result<(Arc<ExpertWorker>, Placement)> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_a/f32");
        let cfg = ModelConfig::from_dir(&dir)?;
        let ws = Arc::new(WeightStore::open(&dir)?);
        let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        let p = Placement::initial(&cfg.moe_layers(), cfg.num_experts, &ids)
            .map_err(|e| anyhow::anyhow!(e))?;
        Ok((
            Arc::new(ExpertWorker::new(ids[0].clone(), cfg, ws, opts)),
            p,
        ))
    }

    /// A valid request: 2 tokens of layer 0, top-2 on experts `ids`.
    fn request(w: &ExpertWorker, ids: [u32; 4]) -> DispatchRequest {
        let h = w.cfg.hidden_size;
        let x: Vec<f32> = (0..2 * h).map(|i| ((i % 11) as f32 - 5.0) * 0.1).collect();
        DispatchRequest {
            layer: w.cfg.moe_layers()[0] as u32,
            top_k: 2,
            tokens: Some(wire::encode(&x, 2, h, Dtype::F32)),
            topk_ids: ids.to_vec(),
            topk_weights: vec![0.5; 4],
            placement_version: 1,
            output_dtype: Dtype::F32 as i32,
            combine: false,
            ..Default::default()
        }
    }

    /// Edits a payload (`Bytes` are immutable: copy, edit, replace).
    fn patch(b: &mut epserve_proto::Bytes, f: impl FnOnce(&mut Vec<u8>)) {
        let mut v = b.to_vec();
        f(&mut v);
        *b = v.into();
    }

    /// An edit that re-encodes the request's tokens as int8, then applies `f`.
    fn int8_edit(
        f: impl Fn(&mut epserve_proto::pb::Tensor) + 'static,
    ) -> Box<dyn Fn(&mut DispatchRequest)> {
        Box::new(move |r| {
            if let Some(t) = r.tokens.as_mut()
                && let Ok(x) = wire::decode(t)
            {
                *t = wire::encode(&x, t.rows as usize, t.cols as usize, Dtype::Int8);
                f(t);
            }
        })
    }

    async fn call(w: &Arc<ExpertWorker>, r: DispatchRequest) -> Result<DispatchResponse, Status> {
        w.dispatch(Request::new(r)).await.map(|r| r.into_inner())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_dispatches_are_invalid_arguments_and_the_worker_keeps_serving() -> Result<()> {
        let (w, p) = worker(&["w", "other"])?;
        let layer = w.cfg.moe_layers()[0];
        let n = w.cfg.num_experts as u32;
        w.apply(&p, None).await?;
        let held: Vec<u32> = (0..n)
            .filter(|&e| w.held().contains(&(layer, e as usize)))
            .collect();
        let not_held = (0..n)
            .find(|e| !held.contains(e))
            .ok_or_else(|| anyhow::anyhow!("'other' holds nothing"))?;
        let (a, b) = (held[0], held[held.len() - 1]);
        let good = request(&w, [a, SKIP_SLOT, b, a]);
        let ok = call(&w, good.clone()).await?;
        assert_eq!(ok.outputs.as_ref().map(|t| t.rows), Some(3));
        // Worker-side combine: one vector per token, the sum of its slots
        // in slot order (token 0: slot 0 only; token 1: slots 2 and 3).
        let per_slot = ok
            .outputs
            .as_ref()
            .map(wire::decode)
            .transpose()?
            .unwrap_or_default();
        let mut combined_req = good.clone();
        combined_req.combine = true;
        let combined = call(&w, combined_req).await?;
        assert_eq!(combined.outputs.as_ref().map(|t| t.rows), Some(2));
        let y = combined
            .outputs
            .as_ref()
            .map(wire::decode)
            .transpose()?
            .unwrap_or_default();
        let hh = w.cfg.hidden_size;
        assert_eq!(&y[..hh], &per_slot[..hh]);
        let want: Vec<f32> = (0..hh)
            .map(|i| 0.0 + per_slot[hh + i] + per_slot[2 * hh + i])
            .collect();
        assert_eq!(&y[hh..], &want[..]);

        type Edit = Box<dyn Fn(&mut DispatchRequest)>;
        let h = w.cfg.hidden_size;
        let dense = (0..w.cfg.num_hidden_layers)
            .find(|l| !w.cfg.moe_layers().contains(l))
            .ok_or_else(|| anyhow::anyhow!("the fixture has no dense layer"))?;
        let cases: Vec<(&str, Edit)> = vec![
            ("missing tokens", Box::new(|r| r.tokens = None)),
            (
                "not an MoE layer",
                Box::new(move |r| r.layer = dense as u32),
            ),
            ("not an MoE layer", Box::new(|r| r.layer = 99)),
            ("does not exist", Box::new(move |r| r.topk_ids[1] = n)),
            (
                "does not exist",
                Box::new(|r| r.topk_ids[0] = SKIP_SLOT - 1),
            ),
            (
                "non-finite",
                Box::new(|r| {
                    if let Some(t) = r.tokens.as_mut() {
                        patch(&mut t.data, |d| {
                            d[4..8].copy_from_slice(&f32::NAN.to_le_bytes())
                        });
                    }
                }),
            ),
            (
                "non-finite",
                Box::new(|r| {
                    if let Some(t) = r.tokens.as_mut() {
                        patch(&mut t.data, |d| {
                            d[0..4].copy_from_slice(&f32::INFINITY.to_le_bytes())
                        });
                    }
                }),
            ),
            (
                "weight of slot 2",
                Box::new(|r| r.topk_weights[2] = f32::NAN),
            ),
            (
                "weight of slot 3",
                Box::new(|r| r.topk_weights[3] = f32::NEG_INFINITY),
            ),
            (
                "bytes, expected",
                Box::new(|r| {
                    if let Some(t) = r.tokens.as_mut() {
                        t.data.truncate(t.data.len() - 1);
                    }
                }),
            ),
            // rows say 3 (with ids and weights to match) but the data holds 2
            (
                "bytes, expected",
                Box::new(|r| {
                    if let Some(t) = r.tokens.as_mut() {
                        t.rows = 3;
                    }
                    r.topk_ids.extend([0, 0]);
                    r.topk_weights.extend([0.5, 0.5]);
                }),
            ),
            (
                "columns",
                Box::new(move |r| {
                    if let Some(t) = r.tokens.as_mut() {
                        t.cols = h as u32 - 1;
                    }
                }),
            ),
            (
                "need 4 ids",
                Box::new(|r| {
                    r.topk_ids.pop();
                }),
            ),
            (
                "need 4 ids",
                Box::new(|r| {
                    r.topk_weights.push(1.0);
                }),
            ),
            ("top_k 0", Box::new(|r| r.top_k = 0)),
            ("top_k 99", Box::new(|r| r.top_k = 99)),
            (
                "exceed the limit",
                Box::new(|r| {
                    if let Some(t) = r.tokens.as_mut() {
                        t.rows = 1 << 20;
                    }
                }),
            ),
            (
                "unsupported tensor dtype",
                Box::new(|r| {
                    if let Some(t) = r.tokens.as_mut() {
                        t.dtype = 99;
                    }
                }),
            ),
            // f32 bytes labelled int8: the lengths do not match.
            (
                "expected",
                Box::new(|r| {
                    if let Some(t) = r.tokens.as_mut() {
                        t.dtype = Dtype::Int8 as i32;
                    }
                }),
            ),
            ("unknown output dtype", Box::new(|r| r.output_dtype = 42)),
            (
                "not int8",
                Box::new(|r| r.output_dtype = Dtype::Int8 as i32),
            ),
            // Malformed int8 tokens.
            (
                "expected",
                int8_edit(|t| patch(&mut t.data, |d| d.truncate(d.len() - 1))),
            ),
            (
                "bytes of scales",
                int8_edit(|t| patch(&mut t.scales, |s| s.truncate(4))),
            ),
            (
                "bytes of scales",
                int8_edit(|t| t.scales = Default::default()),
            ),
            (
                "scale NaN",
                int8_edit(|t| {
                    patch(&mut t.scales, |s| {
                        s[4..8].copy_from_slice(&f32::NAN.to_le_bytes())
                    })
                }),
            ),
            (
                "scale inf",
                int8_edit(|t| {
                    patch(&mut t.scales, |s| {
                        s[0..4].copy_from_slice(&f32::INFINITY.to_le_bytes())
                    })
                }),
            ),
            (
                "scale -0.25",
                int8_edit(|t| {
                    patch(&mut t.scales, |s| {
                        s[0..4].copy_from_slice(&(-0.25f32).to_le_bytes())
                    })
                }),
            ),
            ("-128", int8_edit(|t| patch(&mut t.data, |d| d[5] = 0x80))),
            (
                "non-finite",
                int8_edit(|t| {
                    patch(&mut t.scales, |s| {
                        s[0..4].copy_from_slice(&f32::MAX.to_le_bytes())
                    })
                }),
            ),
        ];
        for (want, edit) in &cases {
            let mut r = good.clone();
            edit(&mut r);
            match call(&w, r).await {
                Err(s) => {
                    assert_eq!(s.code(), tonic::Code::InvalidArgument, "{want}: {s:?}");
                    assert!(
                        s.message().contains(want),
                        "'{want}' not in: {}",
                        s.message()
                    );
                }
                Ok(_) => panic!("{want}: accepted"),
            }
            let again = call(&w, good.clone()).await?;
            assert_eq!(again.outputs, ok.outputs, "after '{want}'");
        }

        // A real expert this worker does not hold is a placement mismatch,
        // not a malformed request.
        let s = call(&w, request(&w, [a, not_held, b, a]))
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("an expert held elsewhere was served"))?;
        assert_eq!(s.code(), tonic::Code::FailedPrecondition, "{s:?}");
        assert_eq!(call(&w, good).await?.outputs, ok.outputs);
        Ok(())
    }

    /// Int8 tokens (the `--dispatch-dtype int8` wire) are served. Int8 W8A8
    /// experts take the rows as sent, quantized by the same function they
    /// would have applied to f32 rows: the outputs equal the f32 wire's
    /// exactly. Float experts get the dequantized rows: close.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn int8_tokens_are_served_and_int8_experts_take_them_as_sent() -> Result<()> {
        use epserve_core::experts::ExpertDtype;
        for dtype in [ExpertDtype::Int8, ExpertDtype::Auto] {
            let opts = LoadOptions {
                expert_dtype: dtype,
                ..LoadOptions::default()
            };
            let (w, p) = worker_with(&["w"], opts)?;
            w.apply(&p, None).await?;
            let f = request(&w, [0, 1, 2, 3]);
            let mut q = f.clone();
            int8_edit(|_| {})(&mut q);
            assert_eq!(q.tokens.as_ref().map(|t| t.dtype), Some(Dtype::Int8 as i32));
            let decode = |r: DispatchResponse| -> Result<Vec<f32>> {
                let t = r.outputs.ok_or_else(|| anyhow::anyhow!("no outputs"))?;
                Ok(wire::decode(&t)?)
            };
            let yf = decode(call(&w, f).await?)?;
            let yq = decode(call(&w, q).await?)?;
            assert_eq!(yf.len(), yq.len());
            if dtype == ExpertDtype::Int8 {
                assert_eq!(yf, yq, "int8 experts: int8 wire vs f32 wire");
            } else {
                let big = yf.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = yf
                    .iter()
                    .zip(&yq)
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    d > 0.0 && d <= 0.05 * big,
                    "float experts: max |Δ| {d} of {big}"
                );
            }
        }
        Ok(())
    }
}
