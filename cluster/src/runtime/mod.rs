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
use crate::store::{EtcdSecurity, EtcdStore, LeaseGuard};

/// The expert memory budget (`epserve serve`, `epserve expert-worker`):
/// with `--expert-memory`, the experts this process serves are held in
/// tiers (resident, an LRU cache packed on first use, cold in the
/// memory-mapped checkpoint) whose packed bytes never exceed it.
#[derive(Debug, Clone, Default, Args)]
pub struct ExpertMemoryArgs {
    /// Most memory for packed experts (e.g. 8GiB, 512MiB, bytes). Without
    /// it every expert served here is packed into RAM at load. With it,
    /// experts beyond it stay in the checkpoint (page cache) and are packed
    /// on first use into an LRU cache, evicting the least recently used.
    #[arg(long, value_parser = parse_size_arg, value_name = "SIZE")]
    pub expert_memory: Option<usize>,
    /// Share of --expert-memory for the resident tier: the experts this
    /// process used most (a decaying window of its calls), never evicted.
    /// The rest is the LRU cache. Default 0.5.
    #[arg(long, value_name = "0..1")]
    pub expert_resident_fraction: Option<f64>,
    /// mlock the resident tier (needs RLIMIT_MEMLOCK; a refusal is logged
    /// once and the experts stay resident unlocked).
    #[arg(long)]
    pub expert_mlock: bool,
    /// Do not pack predicted experts ahead of use (router lookahead).
    #[arg(long)]
    pub no_expert_prefetch: bool,
    /// Precision of each expert: `fixed` (--expert-dtype for all), or
    /// `load`: the most used experts run in bf16 and the rest in int8 W8A8,
    /// re-chosen as the load moves. On `serve` and an expert-worker, by a
    /// decaying window of the process's own calls (experts repacked in the
    /// background); on the coordinator, by the cluster's load window
    /// (`--eplb-window`): the int8 experts are written into the placement
    /// and applied live as a rebalance (workers repack, then switch).
    #[arg(long, default_value = "fixed", value_parser = ["fixed", "load"])]
    pub expert_precision_policy: String,
    /// With `--expert-precision-policy load`: the share of expert uses that
    /// must run in bf16 (the quality budget); the hottest experts covering it
    /// are bf16. Default 0.8.
    #[arg(long, value_name = "0..1")]
    pub expert_bf16_share: Option<f64>,
}

fn parse_size_arg(s: &str) -> std::result::Result<usize, String> {
    epserve_core::config::parse_size(s)
}

impl ExpertMemoryArgs {
    /// Whether any of these flags was given (a role that holds no experts
    /// refuses them).
    pub fn any_set(&self) -> bool {
        self.expert_memory.is_some()
            || self.expert_resident_fraction.is_some()
            || self.expert_mlock
            || self.no_expert_prefetch
            || self.expert_precision_policy != "fixed"
            || self.expert_bf16_share.is_some()
    }

    /// The coordinator's precision policy: with `--expert-precision-policy
    /// load`, the bf16 share it keeps (the hottest experts by the cluster's
    /// load window covering it stay bf16, the rest are written int8 into the
    /// placement); `None` with `fixed`. The flags that size a process's own
    /// expert memory are refused: the coordinator holds no experts.
    pub fn coordinator_bf16_share(&self) -> Result<Option<f64>> {
        if self.expert_memory.is_some()
            || self.expert_resident_fraction.is_some()
            || self.expert_mlock
            || self.no_expert_prefetch
        {
            anyhow::bail!(
                "--expert-memory, --expert-resident-fraction, --expert-mlock and \
                 --no-expert-prefetch are expert-worker flags: the coordinator holds no \
                 experts (pass them to each `epserve expert-worker`, or `epserve up \
                 --expert-memory`)"
            );
        }
        self.bf16_share()
    }

    /// With `--expert-precision-policy load`, the bf16 share (default 0.8,
    /// checked to be in 0..=1); `None` with `fixed`, where
    /// `--expert-bf16-share` is refused.
    fn bf16_share(&self) -> Result<Option<f64>> {
        let load = self.expert_precision_policy == "load";
        if !load && self.expert_bf16_share.is_some() {
            anyhow::bail!("--expert-bf16-share needs --expert-precision-policy load");
        }
        let share = self.expert_bf16_share.unwrap_or(0.8);
        if !(0.0..=1.0).contains(&share) {
            anyhow::bail!("--expert-bf16-share must be in 0..=1, got {share}");
        }
        Ok(load.then_some(share))
    }

    /// The tier options, or `None` without `--expert-memory` and without
    /// `--expert-precision-policy load`. A flag that only means something
    /// with one of them is refused without it.
    pub fn tier_options(&self) -> Result<Option<epserve_core::experts::TierOptions>> {
        let bf16_share = self.bf16_share()?;
        let load = bf16_share.is_some();
        // Precision by load without a budget: every expert stays packed.
        let Some(budget) = self.expert_memory.or(load.then_some(usize::MAX / 4)) else {
            if self.any_set() {
                anyhow::bail!(
                    "--expert-resident-fraction, --expert-mlock and --no-expert-prefetch need \
                     --expert-memory (or --expert-precision-policy load)"
                );
            }
            return Ok(None);
        };
        let f = self.expert_resident_fraction.unwrap_or(0.5);
        if !(0.0..=1.0).contains(&f) {
            anyhow::bail!("--expert-resident-fraction must be in 0..=1, got {f}");
        }
        Ok(Some(epserve_core::experts::TierOptions {
            budget,
            resident_fraction: f,
            mlock: self.expert_mlock,
            prefetch: !self.no_expert_prefetch,
            bf16_share,
            ..Default::default()
        }))
    }
}

/// How every role reaches a secured etcd (flattened next to each role's
/// `--etcd`): TLS with `--etcd-ca` (and a client certificate for etcd's
/// `--client-cert-auth`), user/password auth with `--etcd-user`. The
/// password is read from `--etcd-password-file` or `EPSERVE_ETCD_PASSWORD`,
/// never from the command line.
#[derive(Debug, Clone, Default, Args)]
pub struct EtcdSecurityArgs {
    /// CA certificate (PEM) that signed etcd's server certificate: etcd is
    /// dialled over TLS (`https://`) and its certificate verified.
    #[arg(long, env = "EPSERVE_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) presented to etcd (its `--client-cert-auth`);
    /// with --etcd-key and --etcd-ca.
    #[arg(long, env = "EPSERVE_ETCD_CERT")]
    pub etcd_cert: Option<PathBuf>,
    /// Private key (PEM) of --etcd-cert.
    #[arg(long, env = "EPSERVE_ETCD_KEY")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user (etcd with auth enabled); the password comes from
    /// --etcd-password-file or the EPSERVE_ETCD_PASSWORD environment variable.
    #[arg(long, env = "EPSERVE_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (one line; a trailing newline
    /// is ignored).
    #[arg(long, env = "EPSERVE_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
}

/// Environment variable with the etcd password (when no file is given).
pub const ETCD_PASSWORD_ENV: &str = "EPSERVE_ETCD_PASSWORD";

impl EtcdSecurityArgs {
    /// The files read and checked: certificates and keys must be PEM, a
    /// certificate needs its key (and the CA), a user needs a password and a
    /// password a user. Errors name the flag and the file.
    pub fn resolve(&self) -> Result<EtcdSecurity> {
        let read = |flag: &str, p: &PathBuf, tag: &str| -> Result<Vec<u8>> {
            let b = std::fs::read(p)
                .with_context(|| format!("--{flag}: cannot read {}", p.display()))?;
            if !String::from_utf8_lossy(&b).contains(tag) {
                anyhow::bail!(
                    "--{flag}: {} is not a PEM file (no `{tag}` block)",
                    p.display()
                );
            }
            Ok(b)
        };
        let ca_pem = match &self.etcd_ca {
            Some(p) => Some(read("etcd-ca", p, "-----BEGIN CERTIFICATE-----")?),
            None => None,
        };
        let identity = match (&self.etcd_cert, &self.etcd_key) {
            (Some(c), Some(k)) => {
                anyhow::ensure!(
                    ca_pem.is_some(),
                    "--etcd-cert needs --etcd-ca (the CA of etcd's server certificate)"
                );
                Some((
                    read("etcd-cert", c, "-----BEGIN CERTIFICATE-----")?,
                    read("etcd-key", k, "PRIVATE KEY-----")?,
                ))
            }
            (None, None) => None,
            (Some(_), None) => anyhow::bail!("--etcd-cert needs --etcd-key"),
            (None, Some(_)) => anyhow::bail!("--etcd-key needs --etcd-cert"),
        };
        let password = match &self.etcd_password_file {
            Some(p) => {
                let s = std::fs::read_to_string(p).with_context(|| {
                    format!("--etcd-password-file: cannot read {}", p.display())
                })?;
                Some(s.trim_end_matches(['\r', '\n']).to_string())
            }
            None => std::env::var(ETCD_PASSWORD_ENV).ok(),
        };
        let user = match (&self.etcd_user, password) {
            (Some(u), Some(p)) => Some((u.clone(), p)),
            (Some(u), None) => anyhow::bail!(
                "--etcd-user {u} needs a password: --etcd-password-file or {ETCD_PASSWORD_ENV}"
            ),
            (None, Some(_)) if self.etcd_password_file.is_some() => {
                anyhow::bail!("--etcd-password-file needs --etcd-user")
            }
            (None, _) => None,
        };
        Ok(EtcdSecurity {
            ca_pem,
            identity,
            user,
        })
    }

    /// The same flags as arguments, to pass on to a child process (the
    /// password stays in its file or the environment).
    pub fn to_args(&self) -> Vec<std::ffi::OsString> {
        let mut out = Vec::new();
        let mut push = |flag: &str, v: Option<std::ffi::OsString>| {
            if let Some(v) = v {
                out.push(flag.into());
                out.push(v);
            }
        };
        push("--etcd-ca", self.etcd_ca.clone().map(Into::into));
        push("--etcd-cert", self.etcd_cert.clone().map(Into::into));
        push("--etcd-key", self.etcd_key.clone().map(Into::into));
        push("--etcd-user", self.etcd_user.clone().map(Into::into));
        push(
            "--etcd-password-file",
            self.etcd_password_file.clone().map(Into::into),
        );
        out
    }
}

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
    #[command(flatten)]
    pub etcd_security: EtcdSecurityArgs,
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

    /// What a worker's serving line adds after the advertised address when
    /// it listens elsewhere (behind a proxy or NAT): ` (listening on ADDR)`,
    /// which `epserve up` reads to point its link emulator at the port a
    /// `--listen` port 0 got.
    pub fn listening_note(&self, listen: SocketAddr) -> String {
        if self.advertise(listen) == listen.to_string() {
            String::new()
        } else {
            format!(" (listening on {listen})")
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
        connect_etcd(
            &self.etcd,
            &self.etcd_security.resolve()?,
            self.etcd_timeout_secs,
        )
        .await
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

/// Binds `listen` for a gRPC server (and says the address bound: port 0
/// takes a free one), with TCP_NODELAY on accepted
/// connections (small unary calls otherwise wait ~40 ms for Nagle).
pub async fn bind_grpc(
    listen: SocketAddr,
) -> Result<(tonic::transport::server::TcpIncoming, SocketAddr)> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let bound = listener
        .local_addr()
        .with_context(|| format!("the address bound for {listen}"))?;
    Ok((
        tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
        bound,
    ))
}

/// Connects to etcd at `endpoints`, retrying for at most `timeout_secs`.
/// Leases of registrations made through it are never given up: the keeper
/// retries while etcd is away and writes the key again when it returns.
/// Shared by both worker roles.
pub async fn connect_etcd(
    endpoints: &str,
    security: &EtcdSecurity,
    timeout_secs: u64,
) -> Result<EtcdStore> {
    let limit = std::time::Duration::from_secs(timeout_secs);
    Ok(EtcdStore::connect_secure_within(endpoints, security, limit).await?)
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

#[cfg(test)]
mod tests {
    use super::*;

    const CERT: &str = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
    const KEY: &str = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";

    fn files() -> (tempdir::Dir, PathBuf, PathBuf, PathBuf) {
        let d = tempdir::Dir::new("etcd-sec");
        let w = |n: &str, s: &str| {
            let p = d.0.join(n);
            std::fs::write(&p, s).expect("write");
            p
        };
        let (c, k, pw) = (w("c.pem", CERT), w("k.pem", KEY), w("pw", "secret\n"));
        (d, c, k, pw)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new(tag: &str) -> Dir {
                let p = std::env::temp_dir().join(format!(
                    "epserve-{tag}-{}-{:?}",
                    std::process::id(),
                    std::thread::current().id()
                ));
                std::fs::create_dir_all(&p).expect("tmp dir");
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn etcd_security_flags_are_checked_and_read() {
        let (_d, cert, key, pw) = files();
        let none = EtcdSecurityArgs::default().resolve().expect("plain");
        assert!(!none.tls() && none.identity.is_none() && none.user.is_none());

        let full = EtcdSecurityArgs {
            etcd_ca: Some(cert.clone()),
            etcd_cert: Some(cert.clone()),
            etcd_key: Some(key.clone()),
            etcd_user: Some("epserve".into()),
            etcd_password_file: Some(pw.clone()),
        };
        let sec = full.resolve().expect("all flags");
        assert!(sec.tls() && sec.identity.is_some());
        assert_eq!(sec.user, Some(("epserve".into(), "secret".into())));
        // The password never reaches Debug output or a child's arguments.
        assert!(!format!("{sec:?}").contains("secret"));
        let args: Vec<String> = full
            .to_args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(args.len(), 10);
        assert!(!args.iter().any(|a| a.contains("secret")));

        let bad = |a: EtcdSecurityArgs, want: &str| {
            let e = format!("{:#}", a.resolve().expect_err(want));
            assert!(e.contains(want), "{e:?} should say {want:?}");
        };
        bad(
            EtcdSecurityArgs {
                etcd_cert: Some(cert.clone()),
                etcd_ca: Some(cert.clone()),
                ..Default::default()
            },
            "--etcd-cert needs --etcd-key",
        );
        bad(
            EtcdSecurityArgs {
                etcd_cert: Some(cert.clone()),
                etcd_key: Some(key.clone()),
                ..Default::default()
            },
            "--etcd-cert needs --etcd-ca",
        );
        bad(
            EtcdSecurityArgs {
                etcd_ca: Some(key.clone()),
                ..Default::default()
            },
            "is not a PEM file",
        );
        bad(
            EtcdSecurityArgs {
                etcd_ca: Some(PathBuf::from("/nonexistent/ca.pem")),
                ..Default::default()
            },
            "--etcd-ca: cannot read /nonexistent/ca.pem",
        );
        bad(
            EtcdSecurityArgs {
                etcd_password_file: Some(pw),
                ..Default::default()
            },
            "--etcd-password-file needs --etcd-user",
        );
    }
}

#[cfg(test)]
mod expert_memory_tests {
    use super::ExpertMemoryArgs;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        a: ExpertMemoryArgs,
    }

    fn parse(args: &[&str]) -> ExpertMemoryArgs {
        Cmd::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .expect("parse")
            .a
    }

    #[test]
    fn the_coordinator_takes_only_the_precision_policy() {
        assert_eq!(parse(&[]).coordinator_bf16_share().expect("none"), None);
        assert_eq!(
            parse(&["--expert-precision-policy", "load"])
                .coordinator_bf16_share()
                .expect("load"),
            Some(0.8)
        );
        assert_eq!(
            parse(&[
                "--expert-precision-policy",
                "load",
                "--expert-bf16-share",
                "0.5"
            ])
            .coordinator_bf16_share()
            .expect("load"),
            Some(0.5)
        );
        for bad in [
            &["--expert-memory", "1GiB"][..],
            &["--expert-mlock"],
            &["--no-expert-prefetch"],
            &["--expert-resident-fraction", "0.3"],
            &["--expert-bf16-share", "0.9"],
            &[
                "--expert-precision-policy",
                "load",
                "--expert-bf16-share",
                "1.5",
            ],
        ] {
            assert!(parse(bad).coordinator_bf16_share().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn tier_flags_without_a_budget_or_policy_are_refused() {
        assert!(parse(&[]).tier_options().expect("none").is_none());
        assert!(!parse(&[]).any_set());
        for orphan in [
            &["--expert-mlock"][..],
            &["--no-expert-prefetch"],
            &["--expert-resident-fraction", "0.3"],
            &["--expert-bf16-share", "0.9"],
            &["--expert-memory", "1GiB", "--expert-bf16-share", "0.9"],
        ] {
            let a = parse(orphan);
            assert!(a.any_set(), "{orphan:?}");
            assert!(a.tier_options().is_err(), "{orphan:?} is refused");
        }
        let t = parse(&[
            "--expert-memory",
            "1GiB",
            "--expert-resident-fraction",
            "0.25",
            "--expert-mlock",
        ])
        .tier_options()
        .expect("ok")
        .expect("tiers");
        assert_eq!(
            (t.budget, t.resident_fraction, t.mlock, t.prefetch),
            (1 << 30, 0.25, true, true)
        );
        assert_eq!(t.bf16_share, None);
        let t = parse(&[
            "--expert-precision-policy",
            "load",
            "--expert-bf16-share",
            "0.6",
        ])
        .tier_options()
        .expect("ok")
        .expect("tiers");
        assert_eq!((t.resident_fraction, t.bf16_share), (0.5, Some(0.6)));
        assert!(
            parse(&["--expert-memory", "1GiB", "--expert-resident-fraction", "2"])
                .tier_options()
                .is_err()
        );
    }
}
