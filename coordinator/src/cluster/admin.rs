//! The coordinator's admin gRPC service (its own port): read the placement
//! and the registered workers. Requests must carry
//! `authorization: Bearer <token>` when a token is configured
//! (`--admin-token` / `EPSERVE_ADMIN_TOKEN`).

use epserve_proto::cluster::ClusterState;
use epserve_proto::pb::admin_service_server::AdminService;
use epserve_proto::pb::{
    GetPlacementRequest, GetPlacementResponse, ListWorkersRequest, ListWorkersResponse,
    WorkerStatus,
};
use tonic::{Request, Response, Status};

/// The admin service over the cluster state.
pub struct Admin {
    pub state: ClusterState,
}

fn unavailable(e: impl std::fmt::Display) -> Status {
    Status::unavailable(format!("cluster state: {e}"))
}

#[tonic::async_trait]
impl AdminService for Admin {
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
