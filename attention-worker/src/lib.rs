//! The attention-worker role: holds a tensor-parallel shard (a contiguous
//! range of heads) of every attention layer and the KV cache of those heads,
//! registers in etcd under a lease as shard I of N, and serves
//! `AttentionService` to the coordinator, which sums the shards' partial
//! output projections. The shard itself is `epserve_core::model::attn_shard`.
#![deny(clippy::print_stdout)]

mod service;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use epserve_cluster::runtime::{
    Status, WorkerArgs, bind_grpc, io_runtime, serve_registered, shutdown,
};
use epserve_cluster::state::{ClusterState, WorkerInfo};
use epserve_core::config::ModelConfig;
use epserve_core::loader::weights::WeightStore;
use epserve_core::model::attention::HeadShard;
use epserve_core::model::attn_shard::AttentionShard;
use epserve_proto::pb::attention_service_server::AttentionServiceServer;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

pub use service::{AttentionWorker, MAX_FORWARD_ROWS, MAX_POSITIONS};

/// The `grpc.health.v1.Health` statuses of a worker whose shard is loaded:
/// SERVING for "" and for `epserve.v1.AttentionService` (the shard loads
/// before the server starts, so the worker never answers NOT_SERVING).
pub async fn serving_health() -> HealthReporter {
    let health = HealthReporter::new();
    health
        .set_serving::<AttentionServiceServer<AttentionWorker>>()
        .await;
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    health
}

/// The heads a shard `index` of `of` owns, or an error when the heads cannot
/// be split (see [`HeadShard::ranges`]).
pub fn shard_heads(
    num_heads: usize,
    num_kv_heads: usize,
    index: usize,
    of: usize,
) -> Result<std::ops::Range<usize>, String> {
    HeadShard { index, of }
        .ranges(num_heads, num_kv_heads)
        .map(|(q, _)| q)
        .map_err(|e| e.to_string())
}

/// `epserve attention-worker`.
#[derive(Debug, Clone, Args)]
pub struct AttentionWorkerArgs {
    #[command(flatten)]
    pub worker: WorkerArgs,
    /// This worker's shard index, 0..N-1.
    #[arg(long, env = "EPSERVE_SHARD")]
    pub shard: usize,
    /// Number of shards N (the coordinator's --attention-workers).
    #[arg(long)]
    pub of: usize,
    /// Address the gRPC server binds; port 0 takes a free port (the bound
    /// one is advertised and printed).
    #[arg(long, default_value = "0.0.0.0:50061")]
    pub listen: SocketAddr,
    /// KV cache of this shard's heads, e.g. `2GiB`, `512MiB`, bytes.
    #[arg(long, default_value = "1GiB")]
    pub kv_cache_memory: String,
    /// Positions per KV block (the coordinator's --block-size must be a multiple).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV cache element type: auto (the model's declared dtype: bf16 for
    /// bfloat16 checkpoints, else f32), bf16 (half the memory per block), f32.
    /// This worker's own setting (the coordinator's flag does not reach it).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: epserve_core::model::kv_cache::KvCacheDtype,
    /// Precision of this shard's attention projections: auto (exact f32
    /// activations), bf16 (bf16 activations), or int8 (W8A8, quantized at
    /// load), as the coordinator's `--dense-dtype` (`epserve up` passes the
    /// coordinator's flag on).
    #[arg(long, default_value = "auto")]
    pub dense_dtype: epserve_core::experts::DenseDtype,
}

/// Runs the worker until SIGINT/SIGTERM (both stop it at once: a shard
/// cannot move elsewhere); `status` gets the operator-facing "serving" line.
/// Serves `grpc.health.v1.Health` (SERVING: the shard is loaded before the
/// server starts).
pub fn run(args: &AttentionWorkerArgs, status: Status) -> Result<()> {
    if args.of == 0 || args.shard >= args.of {
        bail!(
            "--shard {} --of {}: the shard index must be in 0..{}",
            args.shard,
            args.of,
            args.of
        );
    }
    if args.block_size == 0 {
        bail!("--block-size must be positive");
    }
    let w = &args.worker;
    let tls = w.tls.load()?;
    let cores = w.pin_cores()?;
    if w.cores.is_some() {
        // Attention's kernels run on rayon's global pool: one thread per core.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(cores.len())
            .build_global();
    }
    let kv_bytes = epserve_core::config::parse_size(&args.kv_cache_memory)
        .map_err(anyhow::Error::msg)
        .context("--kv-cache-memory")?;
    let cfg = ModelConfig::from_dir(&w.model)?;
    let progress = epserve_core::loader::progress::Reporter::start(format!(
        "attention-worker shard {} of {}: loading {}",
        args.shard,
        args.of,
        w.model.display()
    ));
    let ws = WeightStore::open(&w.model)?;
    let shard = HeadShard {
        index: args.shard,
        of: args.of,
    };
    let kv_dtype = args.kv_cache_dtype.resolve(cfg.declared_dtype.as_deref());
    let mut loaded = AttentionShard::load(&cfg, &ws, shard, kv_bytes, args.block_size, kv_dtype)?;
    loaded.set_dense_dtype(args.dense_dtype);
    drop(ws);
    progress.finish();
    let id = w.id_or(|| format!("attention-{}-of-{}", args.shard, args.of));
    let stats = loaded.stats();
    let rt = io_runtime()?;
    rt.block_on(async move {
        // Bound first, so `--listen` port 0 advertises the port it got.
        let (incoming, bound) = bind_grpc(args.listen).await?;
        let advertise = w.advertise(bound);
        let store = w.connect_etcd().await?;
        let state = ClusterState::new(Arc::new(store), &w.cluster);
        let worker = Arc::new(AttentionWorker::new(id.clone(), loaded));
        let info = WorkerInfo {
            id: id.clone(),
            role: "attention".into(),
            addr: format!("{}://{advertise}", epserve_cluster::tls::scheme(tls.as_ref())),
            cores: cores.clone(),
            memory_bytes: kv_bytes as u64,
            shard: Some((args.shard as u32, args.of as u32)),
            pid: std::process::id(),
        };
        let mut lease = state.register_ttl(&info, w.lease_ttl_secs).await?;
        status.say(&format!(
            "epserve attention-worker '{id}' serving AttentionService at {advertise}{}: shard {} of {} ({} {} KV blocks of {} positions, cores {cores:?})",
            w.listening_note(bound),
            args.shard, args.of, stats.blocks_total, kv_dtype.name(), stats.block_size
        ));
        let health = HealthServer::new(HealthService::from_health_reporter(serving_health().await));
        let server = epserve_cluster::tls::server_builder(tls.as_ref())?
            .add_service(health)
            .add_service(
                AttentionServiceServer::from_arc(worker)
                    .max_decoding_message_size(1 << 30)
                    .max_encoding_message_size(1 << 30),
            )
            .serve_with_incoming_shutdown(incoming, shutdown());
        serve_registered(server, &mut lease).await
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn health_serves_the_attention_service() -> Result<()> {
        use tonic::server::NamedService;
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_check_response::ServingStatus;
        use tonic_health::pb::health_server::Health;
        let svc = HealthService::from_health_reporter(serving_health().await);
        for service in [
            "",
            <AttentionServiceServer<AttentionWorker> as NamedService>::NAME,
        ] {
            let r = svc
                .check(tonic::Request::new(HealthCheckRequest {
                    service: service.into(),
                }))
                .await?;
            assert_eq!(
                r.into_inner().status,
                ServingStatus::Serving as i32,
                "{service}"
            );
        }
        assert_eq!(
            <AttentionServiceServer<AttentionWorker> as NamedService>::NAME,
            "epserve.v1.AttentionService"
        );
        Ok(())
    }

    #[test]
    fn splits_whole_kv_groups_or_replicates() {
        assert_eq!(shard_heads(8, 4, 1, 2), Ok(4..8));
        // 2 KV heads over 4 shards: each KV head replicated on two shards.
        assert_eq!(shard_heads(8, 2, 3, 4), Ok(6..8));
        assert!(shard_heads(8, 4, 0, 3).is_err());
        assert!(shard_heads(8, 2, 2, 2).is_err());
    }
}
