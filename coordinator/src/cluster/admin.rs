//! The coordinator's admin gRPC service (its own port): the placement, the
//! registered workers, the measured expert load, and live rebalancing
//! (EPLB plan, explicit placement, drain). Requests must carry
//! `authorization: Bearer <token>` when a token is configured
//! (`--admin-token` / `EPSERVE_ADMIN_TOKEN`).

use std::collections::HashMap;
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
        // (worker, layer, expert) -> (tier, precision), as each worker says.
        let states: HashMap<(String, u32, u32), (String, String)> = self
            .controller
            .dispatcher
            .expert_states()
            .await
            .into_iter()
            .flat_map(|(w, v)| {
                v.into_iter()
                    .map(move |x| ((w.clone(), x.layer, x.expert), (x.tier, x.precision)))
            })
            .collect();
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
                    replicas: replicas_with_states(l.layer as u32, l.replicas, &states),
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

/// A layer's replicas with tokens in the window, each with its worker's tier
/// and precision, and the replicas the workers hold that saw no token (with
/// 0 tokens: the cold ones are mostly these), sorted by expert and worker.
fn replicas_with_states(
    layer: u32,
    window: Vec<(u32, String, u64)>,
    states: &HashMap<(String, u32, u32), (String, String)>,
) -> Vec<ReplicaLoad> {
    let mut out: Vec<ReplicaLoad> = window
        .into_iter()
        .map(|(expert, worker, tokens)| {
            let (tier, precision) = states
                .get(&(worker.clone(), layer, expert))
                .cloned()
                .unwrap_or_default();
            ReplicaLoad {
                expert,
                worker,
                tokens,
                tier,
                precision,
            }
        })
        .collect();
    let seen: std::collections::HashSet<(u32, String)> =
        out.iter().map(|r| (r.expert, r.worker.clone())).collect();
    for ((w, l, e), (tier, precision)) in states {
        if *l == layer && !seen.contains(&(*e, w.clone())) {
            out.push(ReplicaLoad {
                expert: *e,
                worker: w.clone(),
                tokens: 0,
                tier: tier.clone(),
                precision: precision.clone(),
            });
        }
    }
    out.sort_by(|a, b| (a.expert, &a.worker).cmp(&(b.expert, &b.worker)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_get_their_states_and_idle_ones_are_listed() {
        let st = |t: &str, p: &str| (t.to_string(), p.to_string());
        let states = HashMap::from([
            (("a".to_string(), 1, 0), st("resident", "bf16")),
            (("a".to_string(), 1, 2), st("cold", "int8")),
            (("b".to_string(), 1, 0), st("cached", "bf16")),
            (("b".to_string(), 3, 0), st("cold", "bf16")),
        ]);
        let window = vec![(0, "a".to_string(), 5), (1, "c".to_string(), 2)];
        let r = replicas_with_states(1, window, &states);
        let got: Vec<(u32, &str, u64, &str, &str)> = r
            .iter()
            .map(|x| {
                (
                    x.expert,
                    x.worker.as_str(),
                    x.tokens,
                    x.tier.as_str(),
                    x.precision.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (0, "a", 5, "resident", "bf16"),
                (0, "b", 0, "cached", "bf16"),
                (1, "c", 2, "", ""),
                (2, "a", 0, "cold", "int8"),
            ]
        );
    }
}
