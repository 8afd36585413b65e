//! The expert-worker role: registers in etcd under a lease, watches the
//! placement, loads only the experts assigned to it (weights memory-mapped,
//! packed copies only of its own experts), and serves `ExpertService` on a
//! thread pool pinned to its cores, with `grpc.health.v1.Health` for
//! readiness. SIGTERM drains it (see [`drain`]); SIGINT stops it at once.
#![deny(clippy::print_stdout)]

mod service;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use epserve_cluster::runtime::{
    Signals, Status, Stop, WorkerArgs, bind_grpc, hostname, io_runtime,
};
use epserve_cluster::state::{
    ClusterState, DrainRequest, Rebalance, RebalanceState, WorkerInfo, desired_experts,
};
use epserve_core::config::ModelConfig;
use epserve_core::experts::{ExpertDtype, LoadOptions};
use epserve_core::loader::weights::WeightStore;
use epserve_core::placement::Placement;
use epserve_proto::pb::expert_service_server::ExpertServiceServer;

pub use service::{EXPERT_SERVICE_NAME, ExpertWorker, Loaded, MAX_DISPATCH_SLOTS, check_placement};

/// `epserve expert-worker`.
#[derive(Debug, Clone, Args)]
pub struct ExpertWorkerArgs {
    #[command(flatten)]
    pub worker: WorkerArgs,
    /// Address the gRPC server binds; port 0 takes a free port (the bound
    /// one is advertised and printed).
    #[arg(long, default_value = "0.0.0.0:50051")]
    pub listen: SocketAddr,
    /// Expert precision: auto (bf16 when exact), bf16, int8 (W8A8).
    #[arg(long, default_value = "auto")]
    pub expert_dtype: ExpertDtype,
    /// Memory budget and tiers of the experts this worker serves.
    #[command(flatten)]
    pub expert_memory: epserve_cluster::runtime::ExpertMemoryArgs,
    /// Memory offered for experts, bytes (reported in etcd for planning;
    /// rebalances that would exceed it are refused).
    #[arg(long, default_value_t = 0)]
    pub memory_bytes: u64,
    /// After a rebalance is done, keep the replicas only the old placement
    /// needed this long (ms) before dropping them, so that every coordinator
    /// has moved to the new placement.
    /// Also the wait, at the end of a drain, for calls still in flight.
    #[arg(long, default_value_t = 3000)]
    pub drop_grace_ms: u64,
    /// On SIGTERM the worker drains: health turns NOT_SERVING, it asks the
    /// coordinator (a drain request in etcd) to move its experts to other
    /// workers, keeps serving until none is assigned to it any more, waits
    /// --drop-grace-ms for calls in flight, deregisters and exits 0. This
    /// bounds the whole drain (seconds): past it the worker exits anyway,
    /// saying why (no coordinator handled the request, or the experts could
    /// not go elsewhere). A second SIGTERM or SIGINT stops it at once;
    /// SIGINT alone is a fast stop without a drain.
    #[arg(long, default_value_t = 60)]
    pub drain_timeout_secs: u64,
}

/// Runs the worker until SIGINT/SIGTERM; `status` gets the operator-facing
/// lines (serving, experts held).
pub fn run(args: &ExpertWorkerArgs, status: Status) -> Result<()> {
    let w = &args.worker;
    let tls = w.tls.load()?;
    let cores = w.pin_cores()?;
    let cfg = ModelConfig::from_dir(&w.model)?;
    let ws = Arc::new(WeightStore::open(&w.model)?);
    let opts = LoadOptions {
        expert_dtype: args.expert_dtype,
        threads: Some(cores.len()),
        pin_threads: w.cores.is_some(),
        tier: args.expert_memory.tier_options()?,
        ..Default::default()
    };
    let rt = io_runtime()?;
    rt.block_on(async move {
        // Bound first, so `--listen` port 0 advertises the port it got.
        let (incoming, bound) = bind_grpc(args.listen).await?;
        let id = w.id_or(|| format!("expert-{}-{}", hostname(), bound.port()));
        let advertise = w.advertise(bound);
        let store = w.connect_etcd().await?;
        let state = ClusterState::new(Arc::new(store), &w.cluster);
        let worker =
            Arc::new(ExpertWorker::new(id.clone(), cfg, ws, opts).with_status(status.clone()));
        let health = worker.health_service().await;
        let mut signals = Signals::new()?;
        // Follow the placement and any live rebalance: load what is
        // assigned to us, and report ready for a rebalance once loaded.
        let placements = state.watch_placement().await?;
        let rebalances = state.watch_rebalance().await?;
        let drop_grace = Duration::from_millis(args.drop_grace_ms);
        tokio::spawn(follow(
            worker.clone(),
            state.clone(),
            drop_grace,
            placements,
            rebalances,
        ));
        // What the drain waits on: its own watches, so a load in progress
        // does not delay it.
        let view = spawn_view(state.watch_placement().await?, state.watch_rebalance().await?).await;
        let info = WorkerInfo {
            id: id.clone(),
            role: "expert".into(),
            addr: format!("{}://{advertise}", epserve_cluster::tls::scheme(tls.as_ref())),
            cores: cores.clone(),
            memory_bytes: args.memory_bytes,
            shard: None,
            pid: std::process::id(),
        };
        let mut lease = state.register_ttl(&info, w.lease_ttl_secs).await?;
        status.say(&format!(
            "epserve expert-worker '{id}' serving ExpertService at {advertise}{} (cores {cores:?}{})",
            w.listening_note(bound),
            if tls.is_some() { ", mutual TLS" } else { "" }
        ));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = epserve_cluster::tls::server_builder(tls.as_ref())?
            .add_service(health)
            .add_service(
                ExpertServiceServer::from_arc(worker.clone())
                    .max_decoding_message_size(1 << 30)
                    .max_encoding_message_size(1 << 30),
            )
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stop_rx.await;
            });
        let mut server = tokio::spawn(server);
        let sig = tokio::select! {
            r = &mut server => {
                return match r {
                    Ok(r) => r.context("gRPC server failed"),
                    Err(e) => Err(anyhow::Error::new(e).context("gRPC server task failed")),
                };
            }
            e = lease.lost() => return Err(anyhow::Error::new(e).context("lost the etcd registration")),
            sig = signals.recv() => sig,
        };
        if sig == Stop::Terminate {
            let opts = DrainOptions {
                timeout: Duration::from_secs(args.drain_timeout_secs),
                grace: drop_grace,
            };
            status.say(&format!(
                "epserve expert-worker '{id}' draining (SIGTERM): its experts move to other workers (up to {} s; a second signal stops it at once)",
                args.drain_timeout_secs
            ));
            // A second signal cuts the drain short; the drain itself then
            // withdraws its request (after any write of it still in flight).
            let second = async {
                let s = signals.recv().await;
                tracing::warn!(worker = %id, signal = ?s, "second signal during the drain: stopping at once");
                status.say(&format!(
                    "epserve expert-worker '{id}' stopping at once (second signal during the drain)"
                ));
            };
            match drain(&worker, &state, view, opts, second).await {
                Drained::NothingHeld => status.say(&format!(
                    "epserve expert-worker '{id}' holds no experts; stopping"
                )),
                Drained::Moved => status.say(&format!("epserve expert-worker '{id}' drained; stopping")),
                Drained::GaveUp(why) => {
                    tracing::warn!(worker = %id, %why, "drain incomplete; stopping anyway");
                    status.say(&format!(
                        "epserve expert-worker '{id}' drain incomplete ({why}); stopping anyway"
                    ));
                }
                Drained::CutShort => {}
            }
        }
        // Stop: no more keep-alives, the registration removed now rather
        // than when the lease expires, then the server.
        drop(lease);
        bounded(Duration::from_secs(2), state.deregister("expert", &id)).await;
        let _ = stop_tx.send(());
        match tokio::time::timeout(Duration::from_secs(10), server).await {
            Ok(Ok(r)) => r.context("gRPC server failed"),
            Ok(Err(e)) => Err(anyhow::Error::new(e).context("gRPC server task failed")),
            Err(_) => {
                tracing::warn!(worker = %id, "calls still open 10 s after the stop; exiting");
                Ok(())
            }
        }
    })?;
    Ok(())
}

/// Runs a store operation for at most `limit`, logging a failure (a stop
/// must not hang on an unreachable etcd).
async fn bounded<T>(
    limit: Duration,
    op: impl std::future::Future<Output = epserve_cluster::store::StoreResult<T>>,
) {
    match tokio::time::timeout(limit, op).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "etcd update at stop failed"),
        Err(_) => tracing::warn!("etcd update at stop: no answer within {limit:?}"),
    }
}

/// The placement and rebalance documents as last seen.
#[derive(Debug, Clone, Default)]
pub struct View {
    pub placement: Option<Placement>,
    pub rebalance: Option<Rebalance>,
}

impl View {
    /// What worker `id` must hold under this view ([`desired_experts`]).
    pub fn desired(&self, id: &str) -> std::collections::BTreeSet<(usize, usize)> {
        desired_experts(id, self.placement.as_ref(), self.rebalance.as_ref())
    }
}

/// Merges the placement and rebalance watches into one [`View`] that always
/// holds the latest of both. Returns once the first value of each (the
/// documents as they are now) arrived, so the view never starts empty (the
/// task ends when both watches end or every receiver is dropped).
pub async fn spawn_view(
    mut placements: tokio::sync::mpsc::Receiver<Option<Placement>>,
    mut rebalances: tokio::sync::mpsc::Receiver<Option<Rebalance>>,
) -> tokio::sync::watch::Receiver<View> {
    let first = View {
        placement: placements.recv().await.flatten(),
        rebalance: rebalances.recv().await.flatten(),
    };
    let (tx, rx) = tokio::sync::watch::channel(first);
    tokio::spawn(async move {
        let (mut p_open, mut r_open) = (true, true);
        while p_open || r_open {
            tokio::select! {
                v = placements.recv(), if p_open => match v {
                    Some(v) => { tx.send_modify(|view| view.placement = v); }
                    None => p_open = false,
                },
                v = rebalances.recv(), if r_open => match v {
                    Some(v) => { tx.send_modify(|view| view.rebalance = v); }
                    None => r_open = false,
                },
                _ = tx.closed() => return,
            }
        }
    });
    rx
}

/// Bounds of a drain.
#[derive(Debug, Clone, Copy)]
pub struct DrainOptions {
    /// The whole drain (`--drain-timeout-secs`).
    pub timeout: Duration,
    /// Wait after the last expert was moved away, for calls in flight
    /// (`--drop-grace-ms`; cut short by `timeout`).
    pub grace: Duration,
}

/// How a drain ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Drained {
    /// The worker held no experts and none is assigned to it: nothing to move.
    NothingHeld,
    /// No expert is assigned to the worker any more, and the grace passed.
    Moved,
    /// Gave up (the reason): the timeout passed, or etcd refused the request.
    GaveUp(String),
    /// Cut short by the caller's `cut` future (a second signal).
    CutShort,
}

/// Drains `worker` (SIGTERM): health turns NOT_SERVING, a drain request is
/// written for the coordinator's controller (which moves the experts to
/// other workers and deletes it), then this waits, while the worker keeps
/// serving, until `view` assigns no expert to the worker, then `opts.grace`
/// for calls in flight; all within `opts.timeout`. A worker assigned nothing
/// writes no request: it returns at once if it holds nothing, after the
/// grace if it still holds replicas a finished rebalance took away.
///
/// `cut` ends the drain early (a second signal: [`Drained::CutShort`]).
/// However the drain ends, its request is withdrawn if still there; a write
/// of the request in flight when `cut` fires is awaited (bounded) first, so
/// it cannot land after the withdrawal and leave a request for a worker that
/// is gone.
pub async fn drain(
    worker: &ExpertWorker,
    state: &ClusterState,
    view: tokio::sync::watch::Receiver<View>,
    opts: DrainOptions,
    cut: impl std::future::Future<Output = ()>,
) -> Drained {
    let id = worker.id().to_string();
    let deadline = tokio::time::Instant::now() + opts.timeout;
    tokio::pin!(cut);
    worker.start_draining().await;
    if view.borrow().desired(&id).is_empty() {
        if worker.held().is_empty() {
            return Drained::NothingHeld;
        }
        // Already moved away (replicas kept only for calls in flight).
        let until = (tokio::time::Instant::now() + opts.grace).min(deadline);
        return tokio::select! {
            _ = tokio::time::sleep_until(until) => Drained::Moved,
            _ = &mut cut => Drained::CutShort,
        };
    }
    let out = request_and_wait(&id, state, view, opts, deadline, cut).await;
    // Handled requests are deleted by the controller; withdraw ours otherwise
    // (deleting a key that is gone is a no-op).
    bounded(Duration::from_secs(3), state.clear_drain_request(&id)).await;
    out
}

/// [`drain`]'s part after the early returns: writes the request and waits
/// for the experts to move and then the grace; `cut` ends it early.
async fn request_and_wait(
    id: &str,
    state: &ClusterState,
    mut view: tokio::sync::watch::Receiver<View>,
    opts: DrainOptions,
    deadline: tokio::time::Instant,
    mut cut: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Drained {
    let requested_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let req = DrainRequest {
        requested_ms,
        reason: "SIGTERM".into(),
    };
    // Write the request, retrying while etcd is away (within the deadline).
    let mut last_err = None;
    loop {
        let put = state.request_drain(id, &req);
        tokio::pin!(put);
        tokio::select! {
            r = tokio::time::timeout_at(deadline, &mut put) => match r {
                Ok(Ok(())) => break,
                Ok(Err(e)) => last_err = Some(e.to_string()),
                Err(_) => {}
            },
            _ = &mut cut => {
                // Let a write already sent finish before the withdrawal.
                let _ = tokio::time::timeout(Duration::from_secs(1), &mut put).await;
                return Drained::CutShort;
            }
        }
        if tokio::time::Instant::now() + Duration::from_millis(500) >= deadline {
            return Drained::GaveUp(format!(
                "cannot write the drain request within {:?}: {}",
                opts.timeout,
                last_err.unwrap_or_else(|| "no answer from etcd".into())
            ));
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = &mut cut => return Drained::CutShort,
        }
    }
    tracing::info!(worker = %id, "drain requested; waiting for the experts to move");
    let moved = loop {
        let left = view.borrow_and_update().desired(id).len();
        if left == 0 {
            break Ok(());
        }
        tokio::select! {
            r = tokio::time::timeout_at(deadline, view.changed()) => match r {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    break Err(format!(
                        "placement watch ended with {left} experts still assigned"
                    ));
                }
                Err(_) => {
                    break Err(format!(
                        "{left} experts still assigned after {:?} (is a coordinator running, and can the other workers take them?)",
                        opts.timeout
                    ));
                }
            },
            _ = &mut cut => return Drained::CutShort,
        }
    };
    match moved {
        Ok(()) => {
            tracing::info!(worker = %id, grace = ?opts.grace, "experts moved; waiting for calls in flight");
            let until = (tokio::time::Instant::now() + opts.grace).min(deadline);
            tokio::select! {
                _ = tokio::time::sleep_until(until) => Drained::Moved,
                _ = &mut cut => Drained::CutShort,
            }
        }
        Err(why) => Drained::GaveUp(why),
    }
}

/// Applies every placement / rebalance change (a burst of changes loads once).
/// The watches re-establish themselves when the store's watch ends (see
/// `ClusterState::watch_placement`) and re-read the current documents, so
/// this only returns when they are dropped.
async fn follow(
    worker: Arc<ExpertWorker>,
    state: ClusterState,
    drop_grace: std::time::Duration,
    mut placements: tokio::sync::mpsc::Receiver<Option<Placement>>,
    mut rebalances: tokio::sync::mpsc::Receiver<Option<Rebalance>>,
) {
    let (mut p, mut r): (Option<Placement>, Option<Rebalance>) = (None, None);
    // When this worker first saw each rebalance done (drops wait `drop_grace`).
    let mut done_seen: Option<(String, tokio::time::Instant)> = None;
    loop {
        tokio::select! {
            v = placements.recv() => match v { Some(v) => p = v, None => break },
            v = rebalances.recv() => match v { Some(v) => r = v, None => break },
        }
        loop {
            while let Ok(v) = placements.try_recv() {
                p = v;
            }
            while let Ok(v) = rebalances.try_recv() {
                r = v;
            }
            // Keep the old replicas a little after a rebalance is done: other
            // coordinators pick the new placement up from etcd within a second
            // and may still finish a step routed with the old one.
            let Some(rb) = r.as_ref().filter(|rb| rb.state == RebalanceState::Done) else {
                break;
            };
            let desired = desired_experts(worker.id(), p.as_ref(), r.as_ref());
            if worker.held().is_subset(&desired) {
                break; // nothing to drop
            }
            let since = match &done_seen {
                Some((id, t)) if *id == rb.id => *t,
                _ => {
                    let t = tokio::time::Instant::now();
                    done_seen = Some((rb.id.clone(), t));
                    t
                }
            };
            let until = since + drop_grace;
            if tokio::time::Instant::now() >= until {
                break;
            }
            tokio::time::sleep_until(until).await;
        }
        let Some(pl) = &p else { continue };
        match worker.apply(pl, r.as_ref()).await {
            Ok(()) => {
                if let Some(rb) = &r
                    && rb.state.active()
                    && let Err(e) = state.report_ready(worker.id(), &rb.id).await
                {
                    tracing::error!(error = %e, rebalance = %rb.id, "cannot report ready");
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot load the assigned experts"),
        }
    }
    // Only when the watch tasks are gone (the runtime is shutting down).
    tracing::debug!("stopped following the placement");
}

#[cfg(test)]
mod tests {
    use super::*;
    use epserve_cluster::store::MemoryStore;
    use std::path::Path;
    use std::time::Duration;

    /// Waits up to 20 s for `cond`.
    async fn eventually(what: &str, cond: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !cond() {
            assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    use tonic_health::pb::health_check_response::ServingStatus as WireStatus;

    fn fixture_worker(id: &str) -> Result<(Arc<ExpertWorker>, Vec<usize>, usize)> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_a/f32");
        let cfg = ModelConfig::from_dir(&dir)?;
        let ws = Arc::new(WeightStore::open(&dir)?);
        let (layers, n) = (cfg.moe_layers(), cfg.num_experts);
        let w = ExpertWorker::new(id.into(), cfg, ws, LoadOptions::default());
        Ok((Arc::new(w), layers, n))
    }

    fn placement_of(layers: &[usize], n: usize, ids: &[&str], version: u64) -> Result<Placement> {
        let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        let mut p = Placement::initial(layers, n, &ids).map_err(|e| anyhow::anyhow!(e))?;
        p.version = version;
        Ok(p)
    }

    /// Starts the worker's gRPC server (health + ExpertService) on a free
    /// local port; returns a health client.
    async fn serve(
        worker: &Arc<ExpertWorker>,
    ) -> Result<tonic_health::pb::health_client::HealthClient<tonic::transport::Channel>> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let server = tonic::transport::Server::builder()
            .add_service(worker.health_service().await)
            .add_service(ExpertServiceServer::from_arc(worker.clone()))
            .serve_with_incoming(incoming);
        tokio::spawn(server);
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .connect()
            .await?;
        Ok(tonic_health::pb::health_client::HealthClient::new(channel))
    }

    /// The status `grpc.health.v1.Health/Check` gives for "" and for
    /// ExpertService (they must agree; read again while a change is being
    /// written between the two calls).
    async fn health(
        client: &mut tonic_health::pb::health_client::HealthClient<tonic::transport::Channel>,
    ) -> Result<WireStatus> {
        use tonic_health::pb::HealthCheckRequest;
        let mut got = Vec::new();
        for _ in 0..50 {
            got.clear();
            for service in ["", EXPERT_SERVICE_NAME] {
                let r = client
                    .check(HealthCheckRequest {
                        service: service.into(),
                    })
                    .await?;
                got.push(r.into_inner().status);
            }
            if got[0] == got[1] {
                return WireStatus::try_from(got[0]).map_err(|e| anyhow::anyhow!("{e:?}"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        anyhow::bail!("'' and {EXPERT_SERVICE_NAME} disagree: {got:?}")
    }

    async fn health_becomes(
        client: &mut tonic_health::pb::health_client::HealthClient<tonic::transport::Channel>,
        want: WireStatus,
    ) -> Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let got = health(client).await?;
            if got == want {
                return Ok(());
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "health stayed {got:?}, want {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn health_serves_once_loaded_and_a_drain_waits_for_the_experts_to_move() -> Result<()> {
        use WireStatus::{NotServing, Serving};
        let (worker, layers, n) = fixture_worker("a")?;
        let mut hc = serve(&worker).await?;
        assert_eq!(health(&mut hc).await?, NotServing, "nothing loaded yet");

        let state = ClusterState::new(Arc::new(MemoryStore::new()), "t");
        state
            .init_placement(&placement_of(&layers, n, &["a", "b"], 1)?)
            .await?;
        let follower = tokio::spawn(follow(
            worker.clone(),
            state.clone(),
            Duration::ZERO,
            state.watch_placement().await?,
            state.watch_rebalance().await?,
        ));
        eventually("a holds its share", || !worker.held().is_empty()).await;
        health_becomes(&mut hc, Serving).await?;

        let view = spawn_view(
            state.watch_placement().await?,
            state.watch_rebalance().await?,
        )
        .await;
        let opts = DrainOptions {
            timeout: Duration::from_secs(20),
            grace: Duration::from_millis(100),
        };
        let (w2, s2) = (worker.clone(), state.clone());
        let drained =
            tokio::spawn(async move { drain(&w2, &s2, view, opts, std::future::pending()).await });
        health_becomes(&mut hc, NotServing).await?;

        // The controller's part: it sees the request and moves a's experts.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let req = loop {
            if let Some((_, r)) = state
                .drain_requests()
                .await?
                .into_iter()
                .find(|(w, _)| w == "a")
            {
                break r;
            }
            assert!(tokio::time::Instant::now() < deadline, "no drain request");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(req.reason, "SIGTERM");
        // Still serving while the drain waits.
        let (l, e) = worker
            .held()
            .into_iter()
            .next()
            .ok_or_else(|| anyhow::anyhow!("empty"))?;
        let x = vec![0.25f32; worker_hidden(&worker)];
        let r = epserve_proto::pb::DispatchRequest {
            layer: l as u32,
            top_k: 1,
            tokens: Some(epserve_proto::wire::encode(
                &x,
                1,
                x.len(),
                epserve_proto::pb::Dtype::F32,
            )),
            topk_ids: vec![e as u32],
            topk_weights: vec![1.0],
            placement_version: 1,
            output_dtype: epserve_proto::pb::Dtype::F32 as i32,
            combine: false,
            ..Default::default()
        };
        use epserve_proto::pb::expert_service_server::ExpertService;
        worker.dispatch(tonic::Request::new(r)).await?;
        assert!(
            !drained.is_finished(),
            "the drain ended before the experts moved"
        );

        let rev = state.placement().await?.map(|(_, r)| r).unwrap_or(0);
        assert!(
            state
                .swap_placement(rev, &placement_of(&layers, n, &["b"], 2)?)
                .await?
        );
        state.clear_drain_request("a").await?;
        assert_eq!(drained.await?, Drained::Moved);
        assert!(state.drain_requests().await?.is_empty());
        assert_eq!(
            health(&mut hc).await?,
            NotServing,
            "a drained worker never serves again"
        );
        follower.abort();
        Ok(())
    }

    fn worker_hidden(w: &ExpertWorker) -> usize {
        w.hidden_size()
    }

    /// Worker "a" of the fixture, placed every expert on `mem` (cluster
    /// "t"), following the placement, once it holds them all; the follower
    /// task is returned for the test to abort.
    async fn holding_everything(
        mem: &MemoryStore,
    ) -> Result<(Arc<ExpertWorker>, ClusterState, tokio::task::JoinHandle<()>)> {
        let (worker, layers, n) = fixture_worker("a")?;
        let state = ClusterState::new(Arc::new(mem.clone()), "t");
        state
            .init_placement(&placement_of(&layers, n, &["a"], 1)?)
            .await?;
        let follower = tokio::spawn(follow(
            worker.clone(),
            state.clone(),
            Duration::ZERO,
            state.watch_placement().await?,
            state.watch_rebalance().await?,
        ));
        eventually("a holds everything", || {
            worker.held().len() == layers.len() * n
        })
        .await;
        Ok((worker, state, follower))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_drain_nobody_handles_gives_up_after_its_timeout_and_withdraws_the_request()
    -> Result<()> {
        let mem = MemoryStore::new();
        let (worker, state, follower) = holding_everything(&mem).await?;
        let view = spawn_view(
            state.watch_placement().await?,
            state.watch_rebalance().await?,
        )
        .await;
        let started = tokio::time::Instant::now();
        let opts = DrainOptions {
            timeout: Duration::from_millis(600),
            grace: Duration::from_secs(5),
        };
        match drain(&worker, &state, view, opts, std::future::pending()).await {
            Drained::GaveUp(why) => assert!(why.contains("still assigned"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        assert!(
            state.drain_requests().await?.is_empty(),
            "request left behind"
        );
        assert!(worker.draining() && !worker.ready());
        follower.abort();
        Ok(())
    }

    /// A store whose puts land 300 ms after they are sent, even when the
    /// caller stops waiting (as a put already on the wire to etcd does).
    struct SlowPuts(MemoryStore);

    #[async_trait::async_trait]
    impl epserve_cluster::store::KvStore for SlowPuts {
        async fn get(
            &self,
            key: &str,
        ) -> epserve_cluster::store::StoreResult<Option<epserve_cluster::store::Versioned>>
        {
            self.0.get(key).await
        }
        async fn put(&self, key: &str, value: Vec<u8>) -> epserve_cluster::store::StoreResult<()> {
            let (inner, key) = (self.0.clone(), key.to_string());
            let landed = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                inner.put(&key, value).await
            });
            match landed.await {
                Ok(r) => r,
                Err(e) => panic!("put task: {e}"),
            }
        }
        async fn create(
            &self,
            key: &str,
            value: Vec<u8>,
        ) -> epserve_cluster::store::StoreResult<bool> {
            self.0.create(key, value).await
        }
        async fn compare_and_swap(
            &self,
            key: &str,
            rev: i64,
            value: Vec<u8>,
        ) -> epserve_cluster::store::StoreResult<bool> {
            self.0.compare_and_swap(key, rev, value).await
        }
        async fn delete(&self, key: &str) -> epserve_cluster::store::StoreResult<()> {
            self.0.delete(key).await
        }
        async fn list(
            &self,
            prefix: &str,
        ) -> epserve_cluster::store::StoreResult<Vec<(String, Vec<u8>)>> {
            self.0.list(prefix).await
        }
        async fn put_leased(
            &self,
            key: &str,
            value: Vec<u8>,
            ttl_secs: i64,
        ) -> epserve_cluster::store::StoreResult<epserve_cluster::store::LeaseGuard> {
            self.0.put_leased(key, value, ttl_secs).await
        }
        async fn watch(
            &self,
            key: &str,
        ) -> epserve_cluster::store::StoreResult<tokio::sync::mpsc::Receiver<Option<Vec<u8>>>>
        {
            self.0.watch(key).await
        }
    }

    /// A second signal while the drain request is still being written (the
    /// CI flake: the put landed after the withdrawal and left a request for
    /// a worker that was gone) and while the drain waits: either way the
    /// drain ends at once, cut short, and leaves no request behind.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_drain_cut_short_leaves_no_request_even_with_its_write_in_flight() -> Result<()> {
        let mem = MemoryStore::new();
        let (worker, state, follower) = holding_everything(&mem).await?;
        let opts = DrainOptions {
            timeout: Duration::from_secs(20),
            grace: Duration::from_secs(20),
        };
        // Cut 50 ms in: the put (300 ms) is in flight.
        let slow = ClusterState::new(Arc::new(SlowPuts(mem.clone())), "t");
        let view = spawn_view(
            state.watch_placement().await?,
            state.watch_rebalance().await?,
        )
        .await;
        let cut = tokio::time::sleep(Duration::from_millis(50));
        let started = tokio::time::Instant::now();
        let r = drain(&worker, &slow, view, opts, cut).await;
        assert_eq!(r, Drained::CutShort);
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        // Past the moment the put would have landed.
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            state.drain_requests().await?.is_empty(),
            "a request was left behind"
        );
        // Cut while waiting for the experts to move (the request written).
        let view = spawn_view(
            state.watch_placement().await?,
            state.watch_rebalance().await?,
        )
        .await;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (w2, s2) = (worker.clone(), state.clone());
        let drained = tokio::spawn(async move {
            drain(&w2, &s2, view, opts, async {
                let _ = rx.await;
            })
            .await
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while state.drain_requests().await?.is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "no drain request");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = tx.send(());
        let r = tokio::time::timeout(Duration::from_secs(3), drained).await??;
        assert_eq!(r, Drained::CutShort);
        assert!(state.drain_requests().await?.is_empty());
        follower.abort();
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_without_experts_stops_at_once() -> Result<()> {
        let (worker, layers, n) = fixture_worker("a")?;
        let state = ClusterState::new(Arc::new(MemoryStore::new()), "t");
        state
            .init_placement(&placement_of(&layers, n, &["b"], 1)?)
            .await?;
        let mut view = spawn_view(
            state.watch_placement().await?,
            state.watch_rebalance().await?,
        )
        .await;
        view.wait_for(|v| v.placement.is_some()).await?;
        let opts = DrainOptions {
            timeout: Duration::from_secs(20),
            grace: Duration::from_secs(20),
        };
        let r = tokio::time::timeout(
            Duration::from_secs(2),
            drain(&worker, &state, view, opts, std::future::pending()),
        )
        .await?;
        assert_eq!(r, Drained::NothingHeld);
        assert!(state.drain_requests().await?.is_empty());
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn follows_the_placement_after_the_store_ends_its_watches() -> Result<()> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_a/f32");
        let cfg = ModelConfig::from_dir(&dir)?;
        let ws = Arc::new(WeightStore::open(&dir)?);
        let (layers, n) = (cfg.moe_layers(), cfg.num_experts);
        let all = layers.len() * n;
        let worker = Arc::new(ExpertWorker::new(
            "a".into(),
            cfg,
            ws,
            LoadOptions::default(),
        ));
        let mem = MemoryStore::new();
        let state = ClusterState::new(Arc::new(mem.clone()), "t");
        let ids: Vec<String> = vec!["a".into(), "b".into()];
        let placement = |workers: &[String], version| -> Result<Placement> {
            let mut p = Placement::initial(&layers, n, workers).map_err(|e| anyhow::anyhow!(e))?;
            p.version = version;
            Ok(p)
        };
        state.init_placement(&placement(&ids[..1], 1)?).await?;
        let task = tokio::spawn(follow(
            worker.clone(),
            state.clone(),
            Duration::ZERO,
            state.watch_placement().await?,
            state.watch_rebalance().await?,
        ));
        eventually("every expert loaded", || worker.held().len() == all).await;

        // etcd restarts: every watch ends. The next placement (half the
        // experts move to b) is still followed.
        mem.end_watches();
        let p2 = placement(&ids, 2)?;
        let want = desired_experts("a", Some(&p2), None);
        assert!(!want.is_empty() && want.len() < all);
        let rev = state.placement().await?.map(|(_, r)| r).unwrap_or(0);
        assert!(state.swap_placement(rev, &p2).await?);
        eventually("a holds only its share of v2", || worker.held() == want).await;

        // ...and a change after the watch is back, too.
        let rev = state.placement().await?.map(|(_, r)| r).unwrap_or(0);
        assert!(state.swap_placement(rev, &placement(&ids[..1], 3)?).await?);
        eventually("a holds everything again", || worker.held().len() == all).await;
        task.abort();
        Ok(())
    }

    /// The placement's int8 experts (the coordinator's precision policy) are
    /// loaded in int8, the rest at the worker's own precision, with the
    /// packed executor and with a tiered store; a placement without them
    /// brings them back to bf16.
    #[tokio::test]
    async fn loads_the_int8_experts_the_placement_names() -> Result<()> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_a/bf16");
        for tier in [
            None,
            Some(epserve_core::experts::TierOptions {
                budget: 1 << 30,
                ..Default::default()
            }),
        ] {
            let cfg = ModelConfig::from_dir(&dir)?;
            let ws = Arc::new(WeightStore::open(&dir)?);
            let (layers, n) = (cfg.moe_layers(), cfg.num_experts);
            let opts = LoadOptions {
                tier: tier.clone(),
                ..Default::default()
            };
            let worker = Arc::new(ExpertWorker::new("a".into(), cfg, ws, opts));
            let mut p = Placement::initial(&layers, n, &["a".to_string()])
                .map_err(|e| anyhow::anyhow!(e))?;
            let int8: std::collections::BTreeSet<(usize, usize)> = [
                (layers[0], 0),
                (layers[0], 2),
                (layers[layers.len() - 1], 1),
            ]
            .into();
            p = p.with_int8(&int8);
            worker.apply(&p, None).await?;
            let precisions = |w: &ExpertWorker| -> Vec<((usize, usize), String)> {
                w.current()
                    .map(|c| {
                        c.executor
                            .expert_states()
                            .into_iter()
                            .filter(|x| x.tier != "cold")
                            .map(|x| ((x.layer, x.expert), x.precision.to_string()))
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let got = precisions(&worker);
            assert_eq!(got.len(), layers.len() * n, "{tier:?}: every expert packed");
            for (k, prec) in &got {
                let want = if int8.contains(k) { "int8" } else { "bf16" };
                assert_eq!(prec, want, "{tier:?} {k:?}");
            }
            p.version += 1;
            let p = p.with_int8(&Default::default());
            worker.apply(&p, None).await?;
            assert!(
                precisions(&worker).iter().all(|(_, x)| x == "bf16"),
                "{tier:?}: {:?}",
                precisions(&worker)
            );
        }
        Ok(())
    }
}
