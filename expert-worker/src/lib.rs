//! The expert-worker role: registers in etcd under a lease, watches the
//! placement, loads only the experts assigned to it (weights memory-mapped,
//! packed copies only of its own experts), and serves `ExpertService` on a
//! thread pool pinned to its cores.
#![deny(clippy::print_stdout)]

mod service;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Result;
use clap::Args;
use epserve_cluster::runtime::{
    Status, WorkerArgs, bind_grpc, hostname, io_runtime, serve_registered, shutdown,
};
use epserve_cluster::state::{
    ClusterState, Rebalance, RebalanceState, WorkerInfo, desired_experts,
};
use epserve_core::config::ModelConfig;
use epserve_core::experts::{ExpertDtype, LoadOptions};
use epserve_core::loader::weights::WeightStore;
use epserve_core::placement::Placement;
use epserve_proto::pb::expert_service_server::ExpertServiceServer;

pub use service::{ExpertWorker, Loaded, check_placement};

/// `epserve expert-worker`.
#[derive(Debug, Clone, Args)]
pub struct ExpertWorkerArgs {
    #[command(flatten)]
    pub worker: WorkerArgs,
    /// Address the gRPC server binds.
    #[arg(long, default_value = "0.0.0.0:50051")]
    pub listen: SocketAddr,
    /// Expert precision: auto (bf16 when exact), bf16, int8 (W8A8).
    #[arg(long, default_value = "auto")]
    pub expert_dtype: ExpertDtype,
    /// Memory offered for experts, bytes (reported in etcd for planning;
    /// rebalances that would exceed it are refused).
    #[arg(long, default_value_t = 0)]
    pub memory_bytes: u64,
    /// After a rebalance is done, keep the replicas only the old placement
    /// needed this long (ms) before dropping them, so that every coordinator
    /// has moved to the new placement.
    #[arg(long, default_value_t = 3000)]
    pub drop_grace_ms: u64,
}

/// Runs the worker until SIGINT/SIGTERM; `status` gets the operator-facing
/// lines (serving, experts held).
pub fn run(args: &ExpertWorkerArgs, status: Status) -> Result<()> {
    let w = &args.worker;
    let cores = w.pin_cores()?;
    let cfg = ModelConfig::from_dir(&w.model)?;
    let ws = Arc::new(WeightStore::open(&w.model)?);
    let id = w.id_or(|| format!("expert-{}-{}", hostname(), args.listen.port()));
    let advertise = w.advertise(args.listen);
    let opts = LoadOptions {
        expert_dtype: args.expert_dtype,
        threads: Some(cores.len()),
        pin_threads: w.cores.is_some(),
        ..Default::default()
    };
    let rt = io_runtime()?;
    rt.block_on(async move {
        let store = w.connect_etcd().await?;
        let state = ClusterState::new(Arc::new(store), &w.cluster);
        let worker =
            Arc::new(ExpertWorker::new(id.clone(), cfg, ws, opts).with_status(status.clone()));
        let incoming = bind_grpc(args.listen).await?;
        // Follow the placement and any live rebalance: load what is
        // assigned to us, and report ready for a rebalance once loaded.
        let placements = state.watch_placement().await?;
        let rebalances = state.watch_rebalance().await?;
        tokio::spawn(follow(
            worker.clone(),
            state.clone(),
            std::time::Duration::from_millis(args.drop_grace_ms),
            placements,
            rebalances,
        ));
        let info = WorkerInfo {
            id: id.clone(),
            role: "expert".into(),
            addr: format!("http://{advertise}"),
            cores: cores.clone(),
            memory_bytes: args.memory_bytes,
            shard: None,
            pid: std::process::id(),
        };
        let mut lease = state.register(&info).await?;
        status.say(&format!(
            "epserve expert-worker '{id}' serving ExpertService at {advertise} (cores {cores:?})"
        ));
        let server = tonic::transport::Server::builder()
            .add_service(
                ExpertServiceServer::from_arc(worker)
                    .max_decoding_message_size(1 << 30)
                    .max_encoding_message_size(1 << 30),
            )
            .serve_with_incoming_shutdown(incoming, shutdown());
        serve_registered(server, &mut lease).await
    })?;
    Ok(())
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
}
