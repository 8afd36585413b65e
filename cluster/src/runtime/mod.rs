//! What every worker role shares at run time: the flags they have in common
//! ([`WorkerArgs`]), core lists and pinning ([`cores`]), the etcd connection,
//! binding a gRPC listener, serving while registered under a lease, shutdown
//! on SIGINT/SIGTERM ([`shutdown`], or [`Signals`] where SIGTERM drains), and
//! [`Status`], the sink for operator-facing status lines (libraries never
//! print; the binary decides where the lines go).
//!
//! A worker never exits because etcd is away: once registered it keeps
//! serving on its last placement, its lease keeper retries, and the
//! registration is written again when etcd returns.

pub mod cores;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;

use crate::state::WORKER_TTL_SECS;
use crate::store::{EtcdStore, LeaseGuard};

/// Flags shared by `epserve expert-worker` and `epserve attention-worker`
/// (flattened into each role's own arguments; `--listen` stays with the role,
/// whose default port differs).
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// Hugging Face model folder (the same files the coordinator uses).
    #[arg(long, env = "EPSERVE_MODEL")]
    pub model: PathBuf,
    /// etcd endpoints, comma-separated (`127.0.0.1:2379`).
    #[arg(long, env = "EPSERVE_ETCD")]
    pub etcd: String,
    /// Cluster name: keys live under `/epserve/<cluster>/`.
    #[arg(long, default_value = "default", env = "EPSERVE_CLUSTER")]
    pub cluster: String,
    /// Address the coordinator should dial (default: --listen, with 127.0.0.1 for 0.0.0.0).
    #[arg(long)]
    pub advertise: Option<String>,
    /// Worker id in etcd (default: `expert-<host>-<port>` or `attention-<shard>-of-<N>`).
    #[arg(long)]
    pub id: Option<String>,
    /// Cores to run the worker's compute on, e.g. `0-15` or `0,2,4-7` (default: all).
    #[arg(long)]
    pub cores: Option<String>,
    /// At start only: give up (exit 1) when etcd cannot be reached within
    /// this long. Once registered, a worker never exits because etcd is
    /// away: it keeps serving on its last placement and registers again
    /// when etcd returns.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub etcd_timeout_secs: u64,
    /// TTL of the worker's etcd lease, seconds: its registration vanishes
    /// this long after its last keep-alive (renewed every third of it), so a
    /// dead worker is noticed this fast.
    #[arg(long, default_value_t = WORKER_TTL_SECS, value_parser = clap::value_parser!(i64).range(1..))]
    pub lease_ttl_secs: i64,
    #[command(flatten)]
    pub tls: crate::tls::NodeTlsArgs,
}

impl WorkerArgs {
    /// The cores named by `--cores`, with the process pinned to them, or
    /// every core of the machine (unpinned) without the flag.
    pub fn pin_cores(&self) -> Result<Vec<usize>> {
        match &self.cores {
            Some(spec) => {
                let c = cores::parse_cores(spec)?;
                cores::pin_process(&c)?;
                Ok(c)
            }
            None => Ok((0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()),
        }
    }

    /// The address the coordinator dials: `--advertise`, else `listen` with
    /// 127.0.0.1 for an unspecified address.
    pub fn advertise(&self, listen: SocketAddr) -> String {
        match &self.advertise {
            Some(a) => a.clone(),
            None if listen.ip().is_unspecified() => format!("127.0.0.1:{}", listen.port()),
            None => listen.to_string(),
        }
    }

    /// `--id`, or `default` when the flag is absent.
    pub fn id_or(&self, default: impl FnOnce() -> String) -> String {
        self.id.clone().unwrap_or_else(default)
    }

    /// Connects to `--etcd` within `--etcd-timeout-secs` (see [`connect_etcd`]);
    /// the registration made through it is then kept for as long as the
    /// worker runs, however long etcd is away.
    pub async fn connect_etcd(&self) -> Result<EtcdStore> {
        connect_etcd(&self.etcd, self.etcd_timeout_secs).await
    }
}

/// Where a role's operator-facing status lines go ("... serving ... at
/// ADDR", "holds N experts"): `epserve up` and the tests wait for them on the
/// binary's stdout. Library crates never print; the binary builds the sink.
#[derive(Clone)]
pub struct Status(Arc<dyn Fn(&str) + Send + Sync>);

impl Status {
    /// A sink that hands each line to `f`.
    pub fn new(f: impl Fn(&str) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// A sink that drops every line (tests, embedded use).
    pub fn silent() -> Self {
        Self::new(|_| {})
    }

    /// Reports one line.
    pub fn say(&self, line: &str) {
        (self.0)(line)
    }
}

impl Default for Status {
    fn default() -> Self {
        Self::silent()
    }
}

impl std::fmt::Debug for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Status")
    }
}

/// This machine's host name (`/etc/hostname`), or `localhost`.
pub fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Binds `listen` for a gRPC server, with TCP_NODELAY on accepted
/// connections (small unary calls otherwise wait ~40 ms for Nagle).
pub async fn bind_grpc(listen: SocketAddr) -> Result<tonic::transport::server::TcpIncoming> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    Ok(tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)))
}

/// Connects to etcd at `endpoints`, retrying for at most `timeout_secs`.
/// Leases of registrations made through it are never given up: the keeper
/// retries while etcd is away and writes the key again when it returns.
/// Shared by both worker roles.
pub async fn connect_etcd(endpoints: &str, timeout_secs: u64) -> Result<EtcdStore> {
    let limit = std::time::Duration::from_secs(timeout_secs);
    Ok(EtcdStore::connect_within(endpoints, limit).await?)
}

/// Runs a worker's gRPC `server` until it stops (SIGINT/SIGTERM), or fails
/// when `lease`, the worker's registration, reports it is lost (only for a
/// store built with a give-up limit, see
/// [`EtcdStore::give_up_leases_after`]; workers connect without one).
pub async fn serve_registered<E>(
    server: impl std::future::Future<Output = Result<(), E>>,
    lease: &mut LeaseGuard,
) -> Result<()>
where
    E: std::error::Error + Send + Sync + 'static,
{
    tokio::select! {
        r = server => r.context("gRPC server failed"),
        e = lease.lost() => Err(anyhow::Error::new(e).context("lost the etcd registration")),
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Which stop signal arrived (see [`Signals`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGINT (Ctrl-C, `epserve up`'s stop): a fast stop.
    Interrupt,
    /// SIGTERM (Kubernetes, systemd): drain first where the role can.
    Terminate,
}

/// SIGINT and SIGTERM handlers installed once, so that a role can tell the
/// two apart and notice a second signal (during a drain: stop at once).
pub struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers (from inside the tokio runtime).
    pub fn new() -> Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            int: signal(SignalKind::interrupt()).context("cannot handle SIGINT")?,
            term: signal(SignalKind::terminate()).context("cannot handle SIGTERM")?,
        })
    }

    /// The next SIGINT or SIGTERM.
    pub async fn recv(&mut self) -> Stop {
        tokio::select! {
            _ = self.int.recv() => Stop::Interrupt,
            _ = self.term.recv() => Stop::Terminate,
        }
    }
}

/// A multi-threaded tokio runtime with two I/O threads, what every role
/// (workers, coordinator, single-process server) runs its servers and gRPC
/// clients on: compute runs on its own pools, the runtime only moves messages.
pub fn io_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}
