//! [`EtcdStore`]: the [`KvStore`] of real clusters, etcd v3 through the
//! `etcd-client` crate (reconnect with backoff, leases kept alive for as long
//! as the guard lives, re-granted when etcd returns after they expired, unless
//! a give-up limit was set; watches re-armed by the cluster state).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use tokio::sync::mpsc;

use super::{KvStore, LeaseGuard, StoreError, StoreResult, Versioned};

/// How to reach a secured etcd: TLS (its server certificate verified
/// against a CA, optionally presenting a client certificate for etcd's
/// `--client-cert-auth`) and/or user/password auth (etcd's `auth enable`;
/// the token is refreshed when it expires). The default: plaintext, no auth.
#[derive(Clone, Default)]
pub struct EtcdSecurity {
    /// PEM of the CA that signed etcd's server certificate; Some: TLS.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM client certificate and key (needs `ca_pem`).
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// User and password.
    pub user: Option<(String, String)>,
}

impl std::fmt::Debug for EtcdSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdSecurity")
            .field("tls", &self.ca_pem.is_some())
            .field("client_cert", &self.identity.is_some())
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish()
    }
}

impl EtcdSecurity {
    /// Whether the endpoints are dialled over TLS.
    pub fn tls(&self) -> bool {
        self.ca_pem.is_some()
    }

    fn options(&self) -> Result<etcd_client::ConnectOptions, String> {
        let mut opts = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(10));
        match (&self.ca_pem, &self.identity) {
            (Some(ca), id) => {
                let mut tls = etcd_client::TlsOptions::new()
                    .ca_certificate(etcd_client::Certificate::from_pem(ca));
                if let Some((cert, key)) = id {
                    tls = tls.identity(etcd_client::Identity::from_pem(cert, key));
                }
                opts = opts.with_tls(tls);
            }
            (None, Some(_)) => {
                return Err("a client certificate for etcd needs its CA (--etcd-ca)".into());
            }
            (None, None) => {}
        }
        if let Some((user, password)) = &self.user {
            opts = opts
                .with_user(user.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        Ok(opts)
    }
}

/// etcd v3 through the `etcd-client` crate.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    endpoint: String,
    /// How long leased keys keep trying to reach etcd before giving up
    /// ([`LeaseGuard::lost`]); None (the default): forever.
    unreachable_limit: Option<Duration>,
}

impl EtcdStore {
    /// [`connect`](Self::connect), retried with backoff (100 ms doubling to
    /// 2 s) for at most `limit`; then an error naming the endpoint. `limit`
    /// bounds only this connect: leased keys of the store are kept alive
    /// however long etcd is away later (see [`give_up_leases_after`](Self::give_up_leases_after)).
    pub async fn connect_within(endpoints: &str, limit: Duration) -> StoreResult<Self> {
        Self::connect_secure_within(endpoints, &EtcdSecurity::default(), limit).await
    }

    /// [`connect_within`](Self::connect_within) with TLS and/or auth.
    /// Refusals that retrying cannot fix (a bad certificate, wrong
    /// credentials) still retry until `limit`, since etcd may be starting;
    /// the last error names them.
    pub async fn connect_secure_within(
        endpoints: &str,
        security: &EtcdSecurity,
        limit: Duration,
    ) -> StoreResult<Self> {
        let deadline = tokio::time::Instant::now() + limit;
        let mut backoff = Duration::from_millis(100);
        let mut attempt = 1u32;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let last =
                match tokio::time::timeout(left, Self::connect_secure(endpoints, security)).await {
                    Ok(Ok(s)) => return Ok(s),
                    Ok(Err(StoreError::Etcd { message, .. })) => message,
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "no answer".to_string(),
                };
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Err(StoreError::Etcd {
                    endpoint: endpoints.to_string(),
                    message: format!(
                        "unreachable for {} s, giving up (last error: {last})",
                        limit.as_secs_f64()
                    ),
                });
            }
            // info: the outcome (connected, or one error line) is what a user sees.
            tracing::info!(etcd = %endpoints, attempt, error = %last, retry_in = ?backoff.min(left),
                "etcd unreachable; retrying");
            tokio::time::sleep(backoff.min(left)).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
            attempt += 1;
        }
    }

    /// Leased keys put after this give up once etcd has been unreachable for
    /// `limit` ([`LeaseGuard::lost`] resolves); None: never (the default).
    pub fn give_up_leases_after(mut self, limit: Option<Duration>) -> Self {
        self.unreachable_limit = limit;
        self
    }

    /// Connects (with a timeout) to `endpoints` (comma-separated `host:port` or URLs).
    pub async fn connect(endpoints: &str) -> StoreResult<Self> {
        Self::connect_secure(endpoints, &EtcdSecurity::default()).await
    }

    /// [`connect`](Self::connect) with TLS and/or auth: endpoints without a
    /// scheme are dialled with `https://` when `security` has a CA.
    pub async fn connect_secure(endpoints: &str, security: &EtcdSecurity) -> StoreResult<Self> {
        let eps: Vec<String> = endpoints
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        let err = |m: String| StoreError::Etcd {
            endpoint: endpoints.to_string(),
            message: m,
        };
        if eps.is_empty() {
            return Err(err("no endpoint given".into()));
        }
        let opts = security.options().map_err(err)?;
        let client = Client::connect(eps, Some(opts))
            .await
            .map_err(|e| err(short_error(&e)))?;
        let s = EtcdStore {
            client,
            endpoint: endpoints.to_string(),
            unreachable_limit: None,
        };
        // Fail fast if nothing answers.
        s.get("/epserve/.ping").await?;
        Ok(s)
    }

    /// Turns on etcd's auth for a fresh etcd (as an operator's `etcdctl
    /// user add root; role add; auth enable` would): a `root` user with
    /// `root_password`, and `user` / `password` with one role of its own
    /// that may read and write only the keys under `prefix`. `security`
    /// carries the TLS used to reach it (its user is ignored: auth is off
    /// until this returns). Idempotent only on a fresh etcd: an existing
    /// user or enabled auth is an error.
    pub async fn enable_auth(
        endpoints: &str,
        security: &EtcdSecurity,
        root_password: &str,
        user: &str,
        password: &str,
        prefix: &str,
    ) -> StoreResult<()> {
        let plain = EtcdSecurity {
            user: None,
            ..security.clone()
        };
        let mut c = Self::connect_secure(endpoints, &plain).await?.client;
        let err = |what: &str, e: etcd_client::Error| StoreError::Etcd {
            endpoint: endpoints.to_string(),
            message: format!("{what}: {}", short_error(&e)),
        };
        c.user_add("root", root_password, None)
            .await
            .map_err(|e| err("add user root", e))?;
        c.user_grant_role("root", "root")
            .await
            .map_err(|e| err("grant root", e))?;
        c.user_add(user, password, None)
            .await
            .map_err(|e| err("add user", e))?;
        c.role_add(user).await.map_err(|e| err("add role", e))?;
        c.role_grant_permission(
            user,
            etcd_client::Permission::read_write(prefix).with_prefix(),
        )
        .await
        .map_err(|e| err("grant the role", e))?;
        c.user_grant_role(user, user)
            .await
            .map_err(|e| err("grant the user its role", e))?;
        c.auth_enable().await.map_err(|e| err("enable auth", e))?;
        Ok(())
    }

    fn err(&self, e: etcd_client::Error) -> StoreError {
        StoreError::Etcd {
            endpoint: self.endpoint.clone(),
            message: short_error(&e),
        }
    }
}

/// An etcd-client error in a few words: a gRPC status's message and its
/// innermost cause (`tcp connect error: Connection refused (os error 111)`)
/// rather than the nested debug form.
fn short_error(e: &etcd_client::Error) -> String {
    match e {
        etcd_client::Error::GRpcStatus(status) => {
            let mut root: Option<&dyn std::error::Error> = std::error::Error::source(status);
            while let Some(next) = root.and_then(|r| r.source()) {
                root = Some(next);
            }
            match root {
                Some(r) => format!("{}: {r}", status.message()),
                None => status.message().to_string(),
            }
        }
        other => {
            // Transport errors (TLS handshakes above all) say little at the
            // top ("transport error"): name the innermost cause too.
            let mut root: Option<&dyn std::error::Error> = std::error::Error::source(other);
            while let Some(next) = root.and_then(|r| r.source()) {
                root = Some(next);
            }
            match root {
                Some(r) => format!("{other}: {r}"),
                None => other.to_string(),
            }
        }
    }
}

type KeepAlive = (etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream);

/// One keep-alive of lease `id` over `stream` (opened first if None): true
/// if the lease is alive, false if etcd no longer knows it.
async fn renew(
    c: &mut Client,
    stream: &mut Option<KeepAlive>,
    id: i64,
) -> Result<bool, etcd_client::Error> {
    let (keeper, responses) = match stream {
        Some(s) => s,
        // Opening the stream renews once (etcd-client sends the first
        // keep-alive and checks its TTL); a lease etcd no longer knows (it
        // expired while etcd was away or paused) is an error there.
        None => match c.lease_keep_alive(id).await {
            Ok(s) => {
                *stream = Some(s);
                return Ok(true);
            }
            Err(etcd_client::Error::LeaseKeepAliveError(m)) if m == "lease not found" => {
                return Ok(false);
            }
            Err(e) => return Err(e),
        },
    };
    keeper.keep_alive().await?;
    match responses.message().await? {
        Some(r) => Ok(r.ttl() > 0),
        None => Err(etcd_client::Error::LeaseKeepAliveError(
            "keep-alive stream closed".into(),
        )),
    }
}

/// Renews the lease of `key` every third of its TTL. A failed renewal
/// reopens the keep-alive stream on the next round; a lease that expired
/// meanwhile (etcd was away longer than the TTL) is granted again and `key`
/// written again, so the registration comes back with etcd. With a `limit`,
/// after that long without a successful renewal, reports the loss on `lost`
/// and stops; without one (the default) it retries for as long as it runs.
#[allow(clippy::too_many_arguments)]
async fn keep_leased(
    client: Client,
    endpoint: String,
    key: String,
    value: Vec<u8>,
    ttl_secs: i64,
    lease: Arc<std::sync::atomic::AtomicI64>,
    limit: Option<Duration>,
    lost: tokio::sync::oneshot::Sender<StoreError>,
) {
    use std::sync::atomic::Ordering;
    let period = Duration::from_millis((ttl_secs.max(1) as u64 * 1000) / 3);
    let mut last_ok = tokio::time::Instant::now();
    let mut failures = 0u64;
    let mut stream: Option<KeepAlive> = None;
    loop {
        tokio::time::sleep(period).await;
        let round = async {
            let mut c = client.clone();
            let alive = renew(&mut c, &mut stream, lease.load(Ordering::Relaxed)).await?;
            if !alive {
                // The lease expired while etcd was away: register again.
                stream = None;
                let granted = c.lease_grant(ttl_secs, None).await?;
                c.put(
                    key.as_str(),
                    value.clone(),
                    Some(PutOptions::new().with_lease(granted.id())),
                )
                .await?;
                lease.store(granted.id(), Ordering::Relaxed);
                tracing::warn!(key = %key, "lease had expired; key written again under a new lease");
            }
            Ok::<(), etcd_client::Error>(())
        };
        // A blackholed etcd must not stall a round forever.
        let result = match tokio::time::timeout(period.max(Duration::from_secs(1)) * 3, round).await
        {
            Ok(r) => r.map_err(|e| short_error(&e)),
            Err(_) => Err("no answer".to_string()),
        };
        match result {
            Ok(()) => {
                if failures > 0 {
                    tracing::warn!(key = %key, failures, down_s = last_ok.elapsed().as_secs_f64(),
                        "lease keep-alive works again");
                }
                failures = 0;
                last_ok = tokio::time::Instant::now();
            }
            Err(e) => {
                stream = None;
                failures += 1;
                // etcd may stay away for hours: the first failures, then one
                // line a minute or so.
                if failures <= 3
                    || failures.is_multiple_of((60_000 / period.as_millis().max(1) as u64).max(1))
                {
                    tracing::warn!(key = %key, error = %e, failures,
                        down_s = last_ok.elapsed().as_secs_f64(), "lease keep-alive failed; retrying");
                } else {
                    tracing::debug!(key = %key, error = %e, failures, "lease keep-alive failed; retrying");
                }
                if let Some(limit) = limit
                    && last_ok.elapsed() >= limit
                {
                    let _ = lost.send(StoreError::Etcd {
                        endpoint,
                        message: format!(
                            "unreachable for {} s, giving up (last error: {e})",
                            limit.as_secs_f64()
                        ),
                    });
                    return;
                }
            }
        }
    }
}

#[async_trait]
impl KvStore for EtcdStore {
    async fn get(&self, key: &str) -> StoreResult<Option<Versioned>> {
        let mut c = self.client.clone();
        let r = c.get(key, None).await.map_err(|e| self.err(e))?;
        Ok(r.kvs().first().map(|kv| Versioned {
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
        }))
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> StoreResult<()> {
        let mut c = self.client.clone();
        c.put(key, value, None).await.map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn create(&self, key: &str, value: Vec<u8>) -> StoreResult<bool> {
        let mut c = self.client.clone();
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, value, None)]);
        let r = c.txn(txn).await.map_err(|e| self.err(e))?;
        Ok(r.succeeded())
    }

    async fn compare_and_swap(&self, key: &str, rev: i64, value: Vec<u8>) -> StoreResult<bool> {
        let mut c = self.client.clone();
        let txn = Txn::new()
            .when([Compare::mod_revision(key, CompareOp::Equal, rev)])
            .and_then([TxnOp::put(key, value, None)]);
        let r = c.txn(txn).await.map_err(|e| self.err(e))?;
        Ok(r.succeeded())
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        let mut c = self.client.clone();
        c.delete(key, None).await.map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn list(&self, prefix: &str) -> StoreResult<Vec<(String, Vec<u8>)>> {
        let mut c = self.client.clone();
        let r = c
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.err(e))?;
        let mut out: Vec<(String, Vec<u8>)> = r
            .kvs()
            .iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    kv.value().to_vec(),
                )
            })
            .collect();
        out.sort();
        Ok(out)
    }

    async fn put_leased(
        &self,
        key: &str,
        value: Vec<u8>,
        ttl_secs: i64,
    ) -> StoreResult<LeaseGuard> {
        let mut c = self.client.clone();
        let lease = c
            .lease_grant(ttl_secs, None)
            .await
            .map_err(|e| self.err(e))?;
        let id = lease.id();
        c.put(key, value.clone(), Some(PutOptions::new().with_lease(id)))
            .await
            .map_err(|e| self.err(e))?;
        let lease = Arc::new(std::sync::atomic::AtomicI64::new(id));
        let (lost_tx, lost_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(keep_leased(
            self.client.clone(),
            self.endpoint.clone(),
            key.to_string(),
            value,
            ttl_secs,
            lease.clone(),
            self.unreachable_limit,
            lost_tx,
        ));
        let revoke_client = self.client.clone();
        let on_drop = Box::new(move || {
            let mut c = revoke_client;
            let id = lease.load(std::sync::atomic::Ordering::Relaxed);
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move {
                    let _ = c.lease_revoke(id).await;
                });
            }
        });
        Ok(LeaseGuard {
            task,
            on_drop: Some(on_drop),
            lost: Some(lost_rx),
        })
    }

    async fn watch(&self, key: &str) -> StoreResult<mpsc::Receiver<Option<Vec<u8>>>> {
        let (tx, rx) = mpsc::channel(16);
        let mut c = self.client.clone();
        let mut stream = c.watch(key, None).await.map_err(|e| self.err(e))?;
        let current = self.get(key).await?.map(|v| v.value);
        let _ = tx.send(current).await;
        tokio::spawn(async move {
            loop {
                match stream.message().await {
                    Ok(Some(resp)) => {
                        for ev in resp.events() {
                            let v = match ev.event_type() {
                                etcd_client::EventType::Put => {
                                    ev.kv().map(|kv| kv.value().to_vec())
                                }
                                etcd_client::EventType::Delete => None,
                            };
                            if tx.send(v).await.is_err() {
                                return;
                            }
                        }
                    }
                    Ok(None) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "etcd watch ended");
                        return;
                    }
                }
            }
        });
        Ok(rx)
    }
}
