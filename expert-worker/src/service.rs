//! `ExpertService`: decode the routed tokens, run them on the experts this
//! worker holds, return the weighted per-slot outputs.

use std::collections::BTreeSet;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use anyhow::{Result, bail};
use epserve_cluster::runtime::Status as StatusLines;
use epserve_cluster::state::{Rebalance, desired_experts};
use epserve_core::config::ModelConfig;
use epserve_core::experts::{LoadOptions, load_executor_filtered};
use epserve_core::loader::weights::WeightStore;
use epserve_core::moe::{ExpertExecutor, SKIP_SLOT};
use epserve_core::placement::Placement;
use epserve_proto::pb::expert_service_server::ExpertService;
use epserve_proto::pb::{DispatchRequest, DispatchResponse, Dtype, HealthRequest, HealthResponse};
use epserve_proto::wire;
use tonic::{Request, Response, Status};

/// What the worker serves right now.
pub struct Loaded {
    pub version: u64,
    pub held: BTreeSet<(usize, usize)>,
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
        }
    }

    /// Reports each change of the experts held to `status`.
    pub fn with_status(mut self, status: StatusLines) -> Self {
        self.status = status;
        self
    }

    /// This worker's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The `(layer, expert)` pairs loaded now.
    pub fn held(&self) -> std::collections::BTreeSet<(usize, usize)> {
        self.current().map(|l| l.held.clone()).unwrap_or_default()
    }

    fn current(&self) -> Option<Arc<Loaded>> {
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
        if let Some(cur) = self.current()
            && cur.held == held
        {
            let l = Arc::new(Loaded {
                version: p.version,
                held,
                executor: cur.executor.clone(),
            });
            if let Ok(mut g) = self.loaded.write() {
                *g = Some(l);
            }
            return Ok(());
        }
        let me = self.clone();
        let held2 = held.clone();
        let started = Instant::now();
        let executor = tokio::task::spawn_blocking(move || {
            load_executor_filtered(&me.cfg, &me.ws, &me.opts, |l, e| held2.contains(&(l, e)))
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
                executor,
            }));
        }
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
        let loaded = self.current().ok_or_else(|| {
            Status::unavailable(format!("worker {} has no placement yet", self.id))
        })?;
        let tokens = r
            .tokens
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("missing tokens"))?;
        let x = wire::decode(tokens).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let (rows, hidden, k) = (tokens.rows as usize, tokens.cols as usize, r.top_k as usize);
        if hidden != self.cfg.hidden_size {
            return Err(Status::invalid_argument(format!(
                "tokens have {hidden} columns; the model's hidden size is {}",
                self.cfg.hidden_size
            )));
        }
        if k == 0 || r.topk_ids.len() != rows * k || r.topk_weights.len() != rows * k {
            return Err(Status::invalid_argument(format!(
                "{rows} tokens with top_k {k} need {} ids and weights, got {} and {}",
                rows * k,
                r.topk_ids.len(),
                r.topk_weights.len()
            )));
        }
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
        let res = tokio::task::spawn_blocking(move || {
            let _span = tracing::debug_span!(parent: &parent, "execute").entered();
            let queued = arrived.elapsed();
            let t0 = Instant::now();
            let mut out = vec![0.0f32; rows * k * hidden];
            loaded
                .executor
                .execute(layer, &x, &r.topk_ids, &r.topk_weights, k, &mut out)
                .map_err(|e| Status::internal(e.to_string()))?;
            // Keep only this worker's slots, in slot order.
            let mut slots = Vec::new();
            for (s, &id) in r.topk_ids.iter().enumerate() {
                if id != SKIP_SLOT {
                    slots.extend_from_slice(&out[s * hidden..(s + 1) * hidden]);
                }
            }
            let n = slots.len() / hidden.max(1);
            Ok::<_, Status>(DispatchResponse {
                outputs: Some(wire::encode(&slots, n, hidden, out_dtype)),
                queue_us: queued.as_micros() as u64,
                compute_us: t0.elapsed().as_micros() as u64,
            })
        })
        .await
        .map_err(|e| Status::internal(format!("expert task failed: {e}")))??;
        Ok(Response::new(res))
    }

    #[tracing::instrument(level = "trace", name = "expert_health", skip_all, fields(worker = %self.id))]
    async fn health(
        &self,
        _req: Request<HealthRequest>,
    ) -> Result<Response<HealthResponse>, Status> {
        let cur = self.current();
        Ok(Response::new(HealthResponse {
            worker_id: self.id.clone(),
            ready: cur.is_some(),
            placement_version: cur.as_ref().map(|c| c.version).unwrap_or(0),
            experts_loaded: cur.as_ref().map(|c| c.held.len() as u32).unwrap_or(0),
        }))
    }
}
