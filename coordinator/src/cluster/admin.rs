//! The coordinator's admin gRPC service (its own port): the placement, the
//! registered workers, the measured expert load, and live rebalancing
//! (EPLB plan, explicit placement, drain). Requests must carry
//! `authorization: Bearer <token>` when a token is configured
//! (`--admin-token` / `EPSERVE_ADMIN_TOKEN`).

use std::sync::Arc;

use epserve_cluster::state::ClusterState;
use epserve_proto::pb::admin_service_server::AdminService;
use epserve_proto::pb::{
    DrainWorkerRequest, GetExpertLoadRequest, GetExpertLoadResponse, GetPlacementRequest,
    GetPlacementResponse, GetRebalanceRequest, GetRebalanceResponse, LayerLoad, ListWorkersRequest,
    ListWorkersResponse, RebalanceRequest, RebalanceResponse, ReplicaLoad, SetPlacementRequest,
    WorkerStatus,
};
use tonic::{Request, Response, Status};

use super::rebalance::{Controller, Outcome, Plan, RebalanceError};

/// The admin service over the cluster state.
pub struct Admin {
    pub state: ClusterState,
    pub controller: Arc<Controller>,
}

fn status(e: RebalanceError) -> Status {
    match e {
        RebalanceError::UnknownWorker(m) => Status::not_found(m),
        RebalanceError::OverCapacity(m) => Status::resource_exhausted(m),
        RebalanceError::AlreadyRunning(m) => Status::aborted(m),
        RebalanceError::Invalid(m) => Status::invalid_argument(m),
        RebalanceError::Unavailable(m) => Status::unavailable(m),
        RebalanceError::NoLoad(m) => Status::failed_precondition(m),
    }
}

fn response(o: Outcome) -> Result<Response<RebalanceResponse>, Status> {
    Ok(Response::new(RebalanceResponse {
        id: o.id,
        state: o.state,
        from_version: o.from_version,
        to_version: o.to_version,
        current_balancedness: o.current,
        predicted_balancedness: o.predicted,
        placement_json: serde_json::to_string(&o.placement)
            .map_err(|e| Status::internal(e.to_string()))?,
        message: o.message,
    }))
}

fn dry_run(plan: Plan) -> Outcome {
    Outcome {
        id: String::new(),
        state: "dry_run".into(),
        from_version: plan.from.version,
        to_version: plan.from.version + 1,
        current: plan.current,
        predicted: plan.predicted,
        placement: plan.target,
        message: String::new(),
    }
}

impl Admin {
    async fn run(&self, plan: Plan, dry: bool, reason: &str) -> Result<Outcome, Status> {
        if dry {
            return Ok(dry_run(plan));
        }
        self.controller.apply(plan, reason).await.map_err(status)
    }
}

fn unavailable(e: impl std::fmt::Display) -> Status {
    Status::unavailable(format!("cluster state: {e}"))
}

#[tonic::async_trait]
impl AdminService for Admin {
    #[tracing::instrument(level = "debug", name = "admin_get_placement", skip_all)]
    async fn get_placement(
        &self,
        _r: Request<GetPlacementRequest>,
    ) -> Result<Response<GetPlacementResponse>, Status> {
        let (p, _) = self
            .state
            .placement()
            .await
            .map_err(unavailable)?
            .ok_or_else(|| Status::not_found("no placement has been written yet"))?;
        let json = serde_json::to_string(&p).map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(GetPlacementResponse {
            version: p.version,
            placement_json: json,
        }))
    }

    #[tracing::instrument(level = "debug", name = "admin_list_workers", skip_all)]
    async fn list_workers(
        &self,
        _r: Request<ListWorkersRequest>,
    ) -> Result<Response<ListWorkersResponse>, Status> {
        let placement = self
            .state
            .placement()
            .await
            .map_err(unavailable)?
            .map(|(p, _)| p);
        let mut out = Vec::new();
        for role in ["expert", "attention"] {
            for w in self.state.workers(role).await.map_err(unavailable)? {
                let experts = placement
                    .as_ref()
                    .map(|p| p.assigned_to(&w.id).len())
                    .unwrap_or(0);
                out.push(WorkerStatus {
                    id: w.id,
                    role: w.role,
                    addr: w.addr,
                    cores: w.cores.iter().map(|&c| c as u32).collect(),
                    memory_bytes: w.memory_bytes,
                    experts: experts as u32,
                });
            }
        }
        Ok(Response::new(ListWorkersResponse { workers: out }))
    }

    #[tracing::instrument(level = "debug", name = "admin_get_expert_load", skip_all)]
    async fn get_expert_load(
        &self,
        _r: Request<GetExpertLoadRequest>,
    ) -> Result<Response<GetExpertLoadResponse>, Status> {
        let s = self
            .controller
            .dispatcher
            .load_snapshot()
            .ok_or_else(|| Status::unavailable("no route yet"))?;
        Ok(Response::new(GetExpertLoadResponse {
            placement_version: s.placement_version,
            window_steps: s.window_steps as u64,
            window_capacity: s.window_capacity as u64,
            workers: s.workers,
            layers: s
                .layers
                .into_iter()
                .map(|l| LayerLoad {
                    layer: l.layer as u32,
                    expert_tokens: l.expert_tokens,
                    replicas: l
                        .replicas
                        .into_iter()
                        .map(|(expert, worker, tokens)| ReplicaLoad {
                            expert,
                            worker,
                            tokens,
                        })
                        .collect(),
                    worker_tokens: l.worker_tokens,
                    balancedness: l.balancedness,
                })
                .collect(),
        }))
    }

    #[tracing::instrument(level = "debug", name = "admin_rebalance", skip_all)]
    async fn rebalance(
        &self,
        r: Request<RebalanceRequest>,
    ) -> Result<Response<RebalanceResponse>, Status> {
        let r = r.into_inner();
        if !(0.0..=1.0).contains(&r.min_improvement) {
            return Err(Status::invalid_argument(format!(
                "min_improvement must be within [0, 1], got {}",
                r.min_improvement
            )));
        }
        let plan = self
            .controller
            .plan_rebalance(r.redundant as usize, r.capacity as usize)
            .await
            .map_err(status)?;
        if !r.dry_run && plan.improvement() < r.min_improvement {
            let mut o = dry_run(plan);
            o.state = "unchanged".into();
            o.message = format!(
                "predicted improvement {:.3} is below min_improvement {:.3}",
                mean_gain(&o),
                r.min_improvement
            );
            return response(o);
        }
        response(self.run(plan, r.dry_run, "rebalance").await?)
    }

    #[tracing::instrument(level = "debug", name = "admin_set_placement", skip_all)]
    async fn set_placement(
        &self,
        r: Request<SetPlacementRequest>,
    ) -> Result<Response<RebalanceResponse>, Status> {
        let r = r.into_inner();
        let plan = self
            .controller
            .plan_explicit(&r.placement_json)
            .await
            .map_err(status)?;
        let o = self.run(plan, r.dry_run, "set-placement").await?;
        if o.state == "done" {
            self.controller
                .undrain_placed(&o.placement)
                .await
                .map_err(status)?;
        }
        response(o)
    }

    #[tracing::instrument(level = "debug", name = "admin_drain_worker", skip_all)]
    async fn drain_worker(
        &self,
        r: Request<DrainWorkerRequest>,
    ) -> Result<Response<RebalanceResponse>, Status> {
        let r = r.into_inner();
        if r.worker.is_empty() {
            return Err(Status::invalid_argument("worker: empty id"));
        }
        let plan = self
            .controller
            .plan_drain(&r.worker)
            .await
            .map_err(status)?;
        let o = self
            .run(plan, r.dry_run, &format!("drain {}", r.worker))
            .await?;
        if !r.dry_run && (o.state == "done" || o.state == "unchanged") {
            self.controller
                .mark_drained(&r.worker)
                .await
                .map_err(status)?;
        }
        response(o)
    }

    #[tracing::instrument(level = "debug", name = "admin_get_rebalance", skip_all)]
    async fn get_rebalance(
        &self,
        _r: Request<GetRebalanceRequest>,
    ) -> Result<Response<GetRebalanceResponse>, Status> {
        let doc = self.state.rebalance().await.map_err(unavailable)?;
        let json = match doc {
            None => String::new(),
            Some((d, _)) => {
                serde_json::to_string(&d).map_err(|e| Status::internal(e.to_string()))?
            }
        };
        Ok(Response::new(GetRebalanceResponse {
            rebalance_json: json,
        }))
    }
}

fn mean_gain(o: &Outcome) -> f64 {
    let m = |v: &[f64]| {
        if v.is_empty() {
            1.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    m(&o.predicted) - m(&o.current)
}

/// Checks the bearer token of an admin request.
pub fn check_token(
    token: Option<String>,
) -> impl Fn(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |req: Request<()>| {
        let Some(want) = &token else { return Ok(req) };
        let got = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        match got {
            Some(g)
                if g.len() == want.len()
                    && g.bytes()
                        .zip(want.bytes())
                        .fold(0u8, |a, (x, y)| a | (x ^ y))
                        == 0 =>
            {
                Ok(req)
            }
            _ => Err(Status::unauthenticated("missing or wrong admin token")),
        }
    }
}
