//! `epserve coordinator`: the OpenAI API in front of remote expert-workers
//! (placement kept in etcd) and optional attention-workers; the gRPC
//! dispatcher, expert load statistics, the rebalance controller and the admin
//! service are its submodules.

pub mod admin;
pub mod attention;
pub mod dispatch;
pub mod load;
pub mod rebalance;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use epserve_cluster::runtime::{Status, io_runtime};
use epserve_cluster::state::ClusterState;
use epserve_cluster::store::EtcdStore;
use epserve_core::config::ModelConfig;
use epserve_core::engine::Engine;
use epserve_core::loader::generation::GenerationConfig;
use epserve_core::loader::tokenizer::Tokenizer;
use epserve_core::loader::weights::WeightStore;
use epserve_core::model::Model;
use epserve_core::placement::Placement;
use epserve_proto::pb::Dtype;

use crate::serve::ServeArgs;
use dispatch::{GrpcDispatcher, Route};

/// `epserve coordinator`.
#[derive(Debug, Clone, Args)]
pub struct CoordinatorArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// etcd endpoints, comma-separated (`127.0.0.1:2379`).
    #[arg(long, env = "EPSERVE_ETCD")]
    pub etcd: String,
    #[command(flatten)]
    pub etcd_security: epserve_cluster::runtime::EtcdSecurityArgs,
    /// Cluster name: keys live under `/epserve/<cluster>/`.
    #[arg(long, default_value = "default", env = "EPSERVE_CLUSTER")]
    pub cluster: String,
    /// Expert-workers to wait for before writing the initial placement (a
    /// minimum to start, not the worker set: workers that register later get
    /// experts moved to them, and a worker that gets SIGTERM drains its
    /// experts to the others first). `--expert-workers` is the old name.
    #[arg(
        long = "min-expert-workers",
        alias = "expert-workers",
        default_value_t = 1
    )]
    pub expert_workers: usize,
    /// How long to wait for them, seconds.
    #[arg(long, default_value_t = 120)]
    pub wait_secs: u64,
    /// Activation dtype on the wire: bf16 (half the bytes), f32 (bit-exact
    /// with the single-process engine) or int8 (expert inputs as int8 with one
    /// f32 scale per token, the W8A8 kernels' own quantization; outputs come
    /// back in bf16, and attention-workers get bf16).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32", "int8"])]
    pub dispatch_dtype: String,
    /// Deadline of one dispatch call, milliseconds. A call that misses it
    /// counts as a failure of its worker: its slots are re-sent to other
    /// live replicas within the same step.
    #[arg(long, default_value_t = 30_000)]
    pub dispatch_timeout_ms: u64,
    /// What happens to a token whose expert has no live replica: `fail` its
    /// request with a retryable 503 (the other requests go on), or `reroute`
    /// (degraded mode: renormalize its top-k over the live experts; the
    /// response carries a `degraded` field and
    /// `epserve_degraded_requests_total` counts it).
    #[arg(long, value_enum, default_value_t = dispatch::OnExpertLoss::Fail)]
    pub on_expert_loss: dispatch::OnExpertLoss,
    /// How often every placed expert-worker's health is probed,
    /// milliseconds (a dead worker is skipped, a recovered one used again).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(50..))]
    pub health_probe_ms: u64,
    /// Port of the admin gRPC service (0 = off).
    #[arg(long, default_value_t = 9000)]
    pub admin_port: u16,
    /// Bearer token the admin service requires (unset: no auth, loopback use only).
    #[arg(long, env = "EPSERVE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Attention-workers (tensor-parallel attention shards 0..N-1) to wait for in
    /// etcd and run attention on; 0 runs attention in the coordinator.
    #[arg(long, default_value_t = 0)]
    pub attention_workers: usize,
    #[command(flatten)]
    pub eplb: EplbArgs,
    /// Mutual TLS on the node links: to the expert- and attention-workers
    /// (clients) and on the admin service (server).
    #[command(flatten)]
    pub tls: epserve_cluster::tls::NodeTlsArgs,
}

/// Expert load statistics and rebalancing flags of `epserve coordinator`.
#[derive(Debug, Clone, Args)]
pub struct EplbArgs {
    /// Forward steps in the expert-load window (load, balancedness, rebalance plans).
    #[arg(long, default_value_t = 1000)]
    pub eplb_window: usize,
    /// Rebalance automatically every STEPS forward steps (0 = off).
    #[arg(long, default_value_t = 0, value_name = "STEPS")]
    pub eplb_interval: u64,
    /// Automatic rebalancing applies a plan only if it raises the mean
    /// predicted balancedness by at least this much (0..1).
    #[arg(long, default_value_t = 0.05, value_name = "FRAC")]
    pub eplb_min_improvement: f64,
    /// With `--expert-precision-policy load` and automatic EPLB off: forward
    /// steps between checks of the experts' precision against the load
    /// window (default 256; with automatic EPLB on, precision is checked
    /// every `--eplb-interval` and this flag is refused).
    #[arg(long, value_name = "STEPS")]
    pub precision_interval: Option<u64>,
    /// Redundant expert replicas per MoE layer for automatic rebalancing.
    #[arg(long, default_value_t = 0)]
    pub eplb_redundant_experts: usize,
    /// How long workers may take to load new replicas before a rebalance
    /// rolls back, seconds.
    #[arg(long, default_value_t = 300)]
    pub rebalance_timeout_secs: u64,
    /// Re-place the experts of an expert-worker whose lease expired on the
    /// registered workers (a rebalance, reason `recover <worker>`);
    /// `--recover-lost-experts=false` leaves them unserved until it returns.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1,
          default_missing_value = "true", require_equals = true, value_name = "BOOL")]
    pub recover_lost_experts: bool,
}

async fn current_route(state: &ClusterState, cfg: &ModelConfig) -> Result<Option<Route>> {
    let Some((p, _)) = state.placement().await? else {
        return Ok(None);
    };
    p.validate(&cfg.moe_layers(), cfg.num_experts)
        .context("the placement in etcd does not fit this model")?;
    let addrs: HashMap<String, String> = state
        .workers("expert")
        .await?
        .into_iter()
        .map(|w| (w.id, w.addr))
        .collect();
    Ok(Some(Route {
        placement: Arc::new(p),
        addrs,
    }))
}

/// The precision policy's bf16 share (`--expert-precision-policy load`),
/// refusing the expert-memory flags (the coordinator holds no experts) and a
/// `--precision-interval` that would not be honoured.
fn precision_policy(args: &CoordinatorArgs) -> Result<Option<f64>> {
    let bf16_share = args.serve.expert_memory.coordinator_bf16_share()?;
    if args.eplb.precision_interval.is_some()
        && (bf16_share.is_none() || args.eplb.eplb_interval > 0)
    {
        bail!(
            "--precision-interval needs --expert-precision-policy load and --eplb-interval 0 \
             (with automatic EPLB on, precision is checked every --eplb-interval)"
        );
    }
    Ok(bf16_share)
}

/// Runs the coordinator (blocking); `status` gets the operator-facing lines
/// (placement, attention-workers, admin address, serving).
pub fn run(args: &CoordinatorArgs, status: Status) -> Result<()> {
    let bf16_share = precision_policy(args)?;
    if !(0.0..=1.0).contains(&args.eplb.eplb_min_improvement) {
        bail!(
            "--eplb-min-improvement must be within [0, 1], got {}",
            args.eplb.eplb_min_improvement
        );
    }
    let tls = args.tls.load()?;
    let rt = io_runtime()?;
    let model_dir = args.serve.model.clone();
    let cfg = ModelConfig::from_dir(&model_dir)?;
    if args.attention_workers > 0 {
        attention::check_model(&cfg, args.attention_workers)?;
    }
    let dtype = match args.dispatch_dtype.as_str() {
        "f32" => Dtype::F32,
        "int8" => Dtype::Int8,
        _ => Dtype::Bf16,
    };
    // int8 is for the experts' inputs (which int8 experts quantize anyway):
    // attention-workers get the hidden state in bf16 then.
    let attention_dtype = if dtype == Dtype::Int8 {
        Dtype::Bf16
    } else {
        dtype
    };
    let (dispatcher, state, remote_attention, restart) = rt.block_on(async {
        // etcd may be slow or restarting: retry within --wait-secs.
        let wait = Duration::from_secs(args.wait_secs);
        let security = args.etcd_security.resolve()?;
        let store = EtcdStore::connect_secure_within(&args.etcd, &security, wait).await?;
        let state = ClusterState::new(Arc::new(store), &args.cluster);
        let deadline = Instant::now() + wait;
        // A placement in etcd (a restarted coordinator): serve it at once,
        // whatever workers are up. Else wait for the expert-workers.
        let restart = loop {
            match state.placement().await {
                Ok(p) => break p.is_some(),
                Err(e) if Instant::now() < deadline => {
                    tracing::warn!(error = %e, "cannot read the placement yet; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let workers = loop {
            let w = match state.workers("expert").await {
                Ok(w) => w,
                Err(e) if Instant::now() < deadline => {
                    tracing::warn!(error = %e, "cannot list the expert-workers yet; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            if restart || w.len() >= args.expert_workers {
                break w;
            }
            if Instant::now() > deadline {
                bail!(
                    "only {} of {} expert-workers registered in etcd under {} after {} s",
                    w.len(),
                    args.expert_workers,
                    state.prefix(),
                    args.wait_secs
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let ids: Vec<String> = workers.iter().map(|w| w.id.clone()).collect();
        let initial = Placement::initial(&cfg.moe_layers(), cfg.num_experts, &ids)?;
        let p = state.init_placement(&initial).await?;
        status.say(&format!(
            "epserve coordinator: placement v{} over {} expert-workers ({:?} experts each)",
            p.version,
            p.workers.len(),
            p.counts()
        ));
        let route = current_route(&state, &cfg)
            .await?
            .context("the placement vanished from etcd")?;
        // Wait until every placed worker reports its experts loaded.
        let dispatcher = Arc::new(
            GrpcDispatcher::new(
                tokio::runtime::Handle::current(),
                route,
                dtype,
                Duration::from_millis(args.dispatch_timeout_ms),
                args.eplb.eplb_window,
                args.serve.expert_load_metrics,
            )
            .with_on_expert_loss(args.on_expert_loss)
            .with_tls(tls.clone()),
        );
        let remote_attention = if args.attention_workers > 0 {
            let shards =
                wait_attention_workers(&state, args.attention_workers, args.wait_secs).await?;
            let a = attention::RemoteAttention::connect(
                &shards,
                &cfg,
                args.serve.block_size,
                attention_dtype,
                Duration::from_millis(args.dispatch_timeout_ms),
                Duration::from_secs(args.wait_secs),
                tls.clone(),
            )
            .await?;
            status.say(&format!(
                "epserve coordinator: attention on {} attention-workers ({})",
                shards.len(),
                shards
                    .iter()
                    .map(|w| w.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            let a = Arc::new(a);
            a.follow(state.clone(), status.clone());
            Some(a)
        } else {
            None
        };
        Ok::<_, anyhow::Error>((dispatcher, state, remote_attention, restart))
    })?;
    let controller = Arc::new(
        rebalance::Controller::new(
            state.clone(),
            dispatcher.clone(),
            cfg.moe_layers(),
            cfg.num_experts,
            3 * cfg.hidden_size as u64 * cfg.moe_intermediate_size as u64 * 2,
            Duration::from_secs(args.eplb.rebalance_timeout_secs),
        )
        .with_precision_policy(bf16_share),
    );
    if let Some(msg) = rt.block_on(controller.resume())? {
        status.say(&format!("epserve coordinator: {msg}"));
    }
    wait_ready(
        &rt,
        &dispatcher,
        Duration::from_secs(args.wait_secs),
        restart,
    )?;
    rt.spawn(
        dispatcher
            .clone()
            .probe_forever(Duration::from_millis(args.health_probe_ms)),
    );
    if args.eplb.eplb_interval > 0 || bf16_share.is_some() {
        rt.spawn(controller.clone().auto(
            rebalance::AutoOptions {
                eplb: args.eplb.eplb_interval > 0,
                interval: if args.eplb.eplb_interval > 0 {
                    args.eplb.eplb_interval
                } else {
                    args.eplb
                        .precision_interval
                        .unwrap_or(rebalance::PRECISION_INTERVAL_STEPS)
                        .max(1)
                },
                redundant: args.eplb.eplb_redundant_experts,
                min_improvement: args.eplb.eplb_min_improvement,
            },
            status.clone(),
        ));
    }
    // Lost workers, drain requests (SIGTERM) and returning workers.
    rt.spawn(controller.clone().supervise(
        rebalance::SuperviseOptions {
            recover_lost: args.eplb.recover_lost_experts,
            ..Default::default()
        },
        status.clone(),
    ));
    if args.admin_port != 0 {
        let addr = std::net::SocketAddr::new(
            args.serve
                .host
                .parse()
                .context("--host is not an IP address")?,
            args.admin_port,
        );
        let token = args.admin_token.clone().filter(|t| !t.is_empty());
        if token.is_none() {
            tracing::warn!(
                "admin service without a token: set EPSERVE_ADMIN_TOKEN outside loopback"
            );
        }
        let svc = epserve_proto::pb::admin_service_server::AdminServiceServer::with_interceptor(
            admin::Admin {
                state: state.clone(),
                controller: controller.clone(),
            },
            admin::check_token(token),
        );
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(addr))
            .with_context(|| format!("cannot listen on {addr} (--admin-port)"))?;
        status.say(&format!(
            "epserve coordinator: admin gRPC at {}",
            listener.local_addr()?
        ));
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let mut builder = epserve_cluster::tls::server_builder(tls.as_ref())?;
        if tls.is_some() {
            tracing::info!("admin service requires client certificates from --tls-ca");
        }
        rt.spawn(async move {
            if let Err(e) = builder.add_service(svc).serve_with_incoming(incoming).await {
                tracing::error!(error = %e, "admin service failed");
            }
        });
    }
    // Follow placement and worker changes.
    let (d2, st2, cfg2) = (dispatcher.clone(), state.clone(), cfg.clone());
    rt.spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            match current_route(&st2, &cfg2).await {
                Ok(Some(r)) => d2.set_route(r),
                Ok(None) => tracing::warn!("no placement in etcd"),
                Err(e) => tracing::warn!(error = %e, "cannot refresh the route"),
            }
        }
    });
    let serve_args = args.serve.clone();
    serve_with_dispatcher(&rt, &serve_args, status, cfg, dispatcher, remote_attention)
}

/// `/health`'s cluster check: 503 while an expert has no live replica or
/// an attention shard has no registered worker, naming them.
fn cluster_health(
    dispatcher: Arc<GrpcDispatcher>,
    attention: Option<Arc<attention::RemoteAttention>>,
) -> crate::server::HealthCheck {
    Arc::new(move || {
        let unserved = dispatcher.unserved();
        let shards = attention
            .as_ref()
            .map(|a| a.missing_shards())
            .unwrap_or_default();
        if unserved.is_empty() && shards.is_empty() {
            return Ok(());
        }
        const SHOWN: usize = 16;
        let experts: Vec<serde_json::Value> = unserved
            .iter()
            .take(SHOWN)
            .map(|(l, e, why)| serde_json::json!({"layer": l, "expert": e, "replicas": why}))
            .collect();
        Err(serde_json::json!({
            "experts_without_live_replica": unserved.len(),
            "experts": experts,
            "attention_shards_missing": shards,
        }))
    })
}

/// Waits until shards 0..n-1 of n are registered in etcd, each exactly once.
async fn wait_attention_workers(
    state: &ClusterState,
    n: usize,
    wait_secs: u64,
) -> Result<Vec<epserve_cluster::state::WorkerInfo>> {
    let deadline = Instant::now() + Duration::from_secs(wait_secs);
    loop {
        let w = state.workers("attention").await?;
        if let Some(ordered) = attention::order_shards(&w, n)? {
            return Ok(ordered);
        }
        if Instant::now() > deadline {
            bail!(
                "only {} of {n} attention-workers registered in etcd under {} after {wait_secs} s",
                w.len(),
                state.prefix()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn serve_with_dispatcher(
    rt: &tokio::runtime::Runtime,
    args: &ServeArgs,
    status: Status,
    cfg: ModelConfig,
    dispatcher: Arc<GrpcDispatcher>,
    attention: Option<Arc<attention::RemoteAttention>>,
) -> Result<()> {
    let dir = args.model.clone();
    let dense_dtype = args.dense_dtype;
    let health = cluster_health(dispatcher.clone(), attention.clone());
    crate::serve::serve_with_health(rt, args, status, Some(health), move || {
        let ws = WeightStore::open(&dir)?;
        let attention =
            attention.map(|a| a as Arc<dyn epserve_core::model::attn_shard::AttentionBackend>);
        let mut model = Model::from_store_with(cfg, &ws, dispatcher, attention)?;
        model.set_dense_dtype(dense_dtype);
        let tokenizer = Tokenizer::from_dir(&dir)?;
        let generation = GenerationConfig::from_dir(&dir)?;
        Ok(Engine::from_parts(model, tokenizer, generation, &dir))
    })
}

/// Probes the placed workers until every one is ready. A restarted
/// coordinator (`restart`: the placement was already in etcd) probes once
/// and serves: a worker that died meanwhile must not keep it from serving
/// (tokens routed to its experts fail with 503, and `/health` says which,
/// until the controller re-places them; the prober marks the others live as
/// they answer).
fn wait_ready(
    rt: &tokio::runtime::Runtime,
    d: &GrpcDispatcher,
    limit: Duration,
    restart: bool,
) -> Result<()> {
    rt.block_on(async {
        let deadline = Instant::now() + limit;
        loop {
            d.probe_once().await;
            let route = d.route().context("no route")?;
            let not_ready: Vec<String> = route
                .placement
                .workers
                .iter()
                .filter(|w| !route.addrs.contains_key(*w) || !d.liveness().is_live(w))
                .cloned()
                .collect();
            if not_ready.is_empty() || restart {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "expert-workers {} did not load placement v{} in time",
                    not_ready.join(", "),
                    route.placement.version
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

#[cfg(test)]
mod precision_flag_tests {
    use super::{CoordinatorArgs, precision_policy};
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        a: CoordinatorArgs,
    }

    fn policy(extra: &[&str]) -> anyhow::Result<Option<f64>> {
        let args = ["t", "--model", "m", "--etcd", "127.0.0.1:1"]
            .iter()
            .chain(extra)
            .copied();
        precision_policy(&Cmd::try_parse_from(args).expect("parse").a)
    }

    #[test]
    fn precision_interval_is_refused_where_it_would_be_ignored() {
        assert_eq!(policy(&[]).expect("fixed"), None);
        let load = ["--expert-precision-policy", "load"];
        assert_eq!(policy(&load).expect("load"), Some(0.8));
        let with = [&load[..], &["--precision-interval", "64"]].concat();
        assert_eq!(policy(&with).expect("load + interval"), Some(0.8));
        assert!(
            policy(&["--precision-interval", "64"]).is_err(),
            "no policy"
        );
        let eplb = [&with[..], &["--eplb-interval", "100"]].concat();
        assert!(policy(&eplb).is_err(), "EPLB sets the cadence");
        assert!(policy(&["--expert-memory", "1GiB"]).is_err());
    }
}
