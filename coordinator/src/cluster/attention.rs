//! Remote tensor-parallel attention: the coordinator's [`AttentionBackend`]
//! over attention-workers. Per layer it sends the normalized input to every
//! shard concurrently (reused connections, TCP_NODELAY, a deadline per call),
//! and sums their partial output projections in shard order. Releases of
//! finished / cancelled / preempted sequences ride on the next step's first
//! call (so they reach a shard before it allocates for new work), or go out as
//! a `Release` call when the scheduler is idle.

use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use epserve_cluster::runtime::Status;
use epserve_cluster::state::{ClusterState, WorkerInfo};
use epserve_cluster::tls::NodeTls;
use epserve_core::config::ModelConfig;
use epserve_core::model::attention::HeadShard;
use epserve_core::model::attn_shard::{AttentionBackend, PendingAttention, SeqChunk};
use epserve_core::{Error, Result};
use epserve_proto::pb::attention_service_client::AttentionServiceClient;
use epserve_proto::pb::{self, AttentionRequest, Dtype, HealthRequest, ReleaseRequest};
use epserve_proto::wire;
use futures_util::future::join_all;
use metrics::{counter, histogram};
use tonic::transport::Channel;
use tower::retry::budget::Budget;
use tracing::Instrument;

/// One shard's connection.
#[derive(Clone)]
struct ShardConn {
    id: String,
    addr: String,
    client: AttentionServiceClient<Channel>,
}

/// Attention on remote shards.
pub struct RemoteAttention {
    rt: tokio::runtime::Handle,
    /// In shard order; replaced when a shard re-registers elsewhere
    /// ([`RemoteAttention::update_shards`]).
    shards: RwLock<Vec<ShardConn>>,
    /// What every shard must match.
    shape: Shape,
    dtype: Dtype,
    timeout: Duration,
    pending: Mutex<Vec<u64>>,
    capacity: usize,
    /// Shards whose worker is no longer registered (and none replaced it),
    /// as last seen in etcd: `/health` reports them.
    missing: Mutex<Vec<String>>,
    /// Re-sent calls draw from it; first sends deposit.
    budget: tower::retry::budget::TpsBudget,
    /// Mutual TLS on the links to the shards (`--tls-*`).
    tls: Option<NodeTls>,
}

/// Waits before re-sending a failed attention call (one per retry).
const RETRY_BACKOFF: [Duration; 2] = [Duration::from_millis(50), Duration::from_millis(250)];

/// Whether a failed call may succeed if sent again: not when the request
/// itself was refused (a bug, or a shard that lost the sequence's KV).
fn retryable(code: tonic::Code) -> bool {
    !matches!(
        code,
        tonic::Code::InvalidArgument
            | tonic::Code::FailedPrecondition
            | tonic::Code::OutOfRange
            | tonic::Code::ResourceExhausted
            | tonic::Code::Unimplemented
    )
}

/// Errors for models whose heads cannot be split evenly over `n` shards.
pub fn check_model(cfg: &ModelConfig, n: usize) -> anyhow::Result<()> {
    let nh = cfg.num_attention_heads;
    for (i, spec) in cfg.layers.iter().enumerate() {
        // MLA: every head shares the latent, so any divisor of the heads works.
        let nkv = if cfg.mla.is_some() { nh } else { spec.kv_heads };
        HeadShard { index: 0, of: n }
            .ranges(nh, nkv)
            .with_context(|| format!("--attention-workers {n}: layer {i} of {:?}", cfg.arch))?;
    }
    Ok(())
}

/// The model shape and block size a shard must serve.
#[derive(Debug, Clone, Copy)]
struct Shape {
    layers: usize,
    hidden: usize,
    block_size: usize,
}

impl Shape {
    /// Checks a worker's Health against shard `i` of `n` and this shape;
    /// returns the positions of KV it holds.
    fn check(
        &self,
        h: &pb::AttentionHealthResponse,
        w: &WorkerInfo,
        i: usize,
        n: usize,
    ) -> anyhow::Result<usize> {
        if h.shard as usize != i || h.of as usize != n {
            bail!(
                "attention-worker {} ({}) says it is shard {} of {}, but etcd lists it as shard {i} of {n}",
                w.id,
                w.addr,
                h.shard,
                h.of
            );
        }
        if h.num_layers as usize != self.layers || h.hidden_size as usize != self.hidden {
            bail!(
                "attention-worker {} ({}) loaded a model with {} layers of hidden size {}; the coordinator's has {} of {} (same --model on every process?)",
                w.id,
                w.addr,
                h.num_layers,
                h.hidden_size,
                self.layers,
                self.hidden
            );
        }
        let wb = h.kv_block_size as usize;
        if wb == 0 || !self.block_size.is_multiple_of(wb) {
            bail!(
                "attention-worker {} uses KV blocks of {wb} positions; the coordinator's --block-size {} must be a multiple of it",
                w.id,
                self.block_size
            );
        }
        Ok(h.kv_blocks_total as usize * wb)
    }
}

/// A lazily connecting client for one attention-worker.
/// With `tls`, the worker's certificate must name the host of its
/// registered address.
fn shard_client(
    w: &WorkerInfo,
    timeout: Duration,
    tls: Option<&NodeTls>,
) -> anyhow::Result<AttentionServiceClient<Channel>> {
    let ep = epserve_cluster::tls::endpoint(&w.addr, tls)
        .with_context(|| format!("attention-worker {}", w.id))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5))
        .timeout(timeout);
    Ok(AttentionServiceClient::new(ep.connect_lazy())
        .max_decoding_message_size(1 << 30)
        .max_encoding_message_size(1 << 30))
}

/// Checks that `workers` are shards 0..n-1 of n, each exactly once, and
/// returns them in shard order. `Ok(None)`: some are still missing.
pub fn order_shards(workers: &[WorkerInfo], n: usize) -> anyhow::Result<Option<Vec<WorkerInfo>>> {
    let mut slots: Vec<Option<WorkerInfo>> = vec![None; n];
    for w in workers {
        let Some((i, of)) = w.shard else {
            bail!("attention-worker {} registered without a shard index", w.id);
        };
        if of as usize != n {
            bail!(
                "attention-worker {} is shard {i} of {of}, but the coordinator expects {n} shards (--attention-workers {n})",
                w.id
            );
        }
        let slot = slots.get_mut(i as usize).with_context(|| {
            format!(
                "attention-worker {} has shard index {i}, outside 0..{n}",
                w.id
            )
        })?;
        if let Some(other) = slot {
            bail!(
                "attention shard {i} of {n} is registered twice: by {} ({}) and {} ({})",
                other.id,
                other.addr,
                w.id,
                w.addr
            );
        }
        *slot = Some(w.clone());
    }
    Ok(slots.into_iter().collect())
}

impl RemoteAttention {
    /// Connects to `workers` (shards 0..n-1 in order), waits until each
    /// answers Health, checks it serves this model's shape and a block size
    /// dividing `block_size`, and frees whatever they held from an earlier
    /// coordinator.
    pub async fn connect(
        workers: &[WorkerInfo],
        cfg: &ModelConfig,
        block_size: usize,
        dtype: Dtype,
        timeout: Duration,
        wait: Duration,
        tls: Option<NodeTls>,
    ) -> anyhow::Result<Self> {
        let deadline = Instant::now() + wait;
        let mut shards = Vec::with_capacity(workers.len());
        let mut capacity = usize::MAX;
        for (i, w) in workers.iter().enumerate() {
            let mut client = shard_client(w, timeout, tls.as_ref())?;
            let h = loop {
                match client.health(HealthRequest::default()).await {
                    Ok(r) => break r.into_inner(),
                    Err(e) if Instant::now() > deadline => {
                        bail!(
                            "attention-worker {} ({}) did not answer in time: {}",
                            w.id,
                            w.addr,
                            epserve_cluster::tls::status_why(&e)
                        )
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            };
            let shape = Shape {
                layers: cfg.num_hidden_layers,
                hidden: cfg.hidden_size,
                block_size,
            };
            let cap = shape.check(&h, w, i, workers.len())?;
            capacity = capacity.min(cap);
            client
                .release(ReleaseRequest {
                    seq_ids: Vec::new(),
                    all: true,
                })
                .await
                .with_context(|| format!("attention-worker {}: Release", w.id))?;
            shards.push(ShardConn {
                id: w.id.clone(),
                addr: w.addr.clone(),
                client,
            });
        }
        if shards.is_empty() {
            bail!("no attention-workers to connect to");
        }
        Ok(RemoteAttention {
            rt: tokio::runtime::Handle::current(),
            shape: Shape {
                layers: cfg.num_hidden_layers,
                hidden: cfg.hidden_size,
                block_size,
            },
            shards: RwLock::new(shards),
            dtype,
            timeout,
            pending: Mutex::new(Vec::new()),
            capacity,
            missing: Mutex::new(Vec::new()),
            budget: tower::retry::budget::TpsBudget::new(Duration::from_secs(10), 10, 0.2),
            tls,
        })
    }

    /// The current connections, in shard order.
    fn shard_list(&self) -> Result<Vec<ShardConn>> {
        self.shards
            .read()
            .map(|g| g.clone())
            .map_err(|_| Error::Attention("attention shard list lock poisoned".into()))
    }

    /// Follows re-registrations: a shard whose current worker is no longer
    /// registered in etcd (its lease ended, or it re-registered under the
    /// same id with a new address) is reconnected to the worker now
    /// registered for that shard index. Later requests go there; sequences
    /// whose KV lived on the old one fail with the shard's "holds only N
    /// positions" error. Returns what changed, for the log.
    pub fn update_shards(&self, workers: &[WorkerInfo]) -> Vec<String> {
        let mut changed = Vec::new();
        let Ok(mut shards) = self.shards.write() else {
            return changed;
        };
        let n = shards.len();
        for (i, cur) in shards.iter_mut().enumerate() {
            let mut cands: Vec<&WorkerInfo> = workers
                .iter()
                .filter(|w| w.shard == Some((i as u32, n as u32)))
                .collect();
            if cands.iter().any(|w| w.id == cur.id && w.addr == cur.addr) {
                continue;
            }
            cands.sort_by(|a, b| a.id.cmp(&b.id));
            let Some(w) = cands.first() else {
                continue;
            };
            match shard_client(w, self.timeout, self.tls.as_ref()) {
                Ok(client) => {
                    changed.push(format!(
                        "attention shard {i} of {n}: {} ({}) -> {} ({})",
                        cur.id, cur.addr, w.id, w.addr
                    ));
                    *cur = ShardConn {
                        id: w.id.clone(),
                        addr: w.addr.clone(),
                        client,
                    };
                }
                Err(e) => {
                    tracing::warn!(worker = %w.id, error = %e, "cannot use re-registered attention-worker")
                }
            }
        }
        changed
    }

    /// Records which shards have no registered worker now.
    fn note_missing(&self, registered: &[WorkerInfo]) {
        let Ok(shards) = self.shard_list() else {
            return;
        };
        let n = shards.len();
        let missing: Vec<String> = shards
            .iter()
            .enumerate()
            .filter(|(_, s)| !registered.iter().any(|w| w.id == s.id))
            .map(|(i, s)| format!("attention shard {i} of {n} ({}) is not registered", s.id))
            .collect();
        if let Ok(mut m) = self.missing.lock() {
            *m = missing;
        }
    }

    /// Shards with no registered worker, as last seen in etcd (empty while
    /// etcd is unreachable: the last good view stands).
    pub fn missing_shards(&self) -> Vec<String> {
        self.missing.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// Polls etcd every second for re-registered shards (see
    /// [`update_shards`](Self::update_shards)) while the coordinator runs;
    /// each change is also a `status` line.
    pub fn follow(self: &Arc<Self>, state: ClusterState, status: Status) {
        let me = Arc::downgrade(self);
        self.rt.spawn(async move {
            let mut warned = std::collections::HashSet::new();
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let Some(me) = me.upgrade() else {
                    return;
                };
                match state.workers("attention").await {
                    Ok(ws) => {
                        let ws = me.vet(ws, &mut warned).await;
                        for c in me.update_shards(&ws) {
                            tracing::warn!("{c}");
                            status.say(&format!("epserve coordinator: {c}"));
                        }
                        me.note_missing(&ws);
                    }
                    Err(e) => tracing::debug!(error = %e, "listing attention-workers failed"),
                }
            }
        });
    }

    /// Keeps the registrations in use and those of new workers that answer
    /// Health as the right shard of this model with enough KV (freeing
    /// whatever they hold); a mismatch is left out with one warning, one that
    /// does not answer yet is asked again next time.
    async fn vet(
        &self,
        workers: Vec<WorkerInfo>,
        warned: &mut std::collections::HashSet<(String, String)>,
    ) -> Vec<WorkerInfo> {
        let current: Vec<(String, String)> = self
            .shard_list()
            .map(|l| l.into_iter().map(|s| (s.id, s.addr)).collect())
            .unwrap_or_default();
        let n = current.len();
        let mut ok = Vec::with_capacity(workers.len());
        for w in workers {
            let key = (w.id.clone(), w.addr.clone());
            if current.contains(&key) {
                ok.push(w);
                continue;
            }
            let Some((i, of)) = w.shard else { continue };
            if of as usize != n || i as usize >= n || warned.contains(&key) {
                continue;
            }
            let Ok(mut client) = shard_client(&w, self.timeout, self.tls.as_ref()) else {
                continue;
            };
            let mut r = tonic::Request::new(HealthRequest::default());
            r.set_timeout(Duration::from_secs(2));
            // Not answering yet: try again next time.
            let Ok(h) = client.health(r).await.map(|r| r.into_inner()) else {
                continue;
            };
            let checked = async {
                let cap = self.shape.check(&h, &w, i as usize, n)?;
                if cap < self.capacity {
                    bail!(
                        "attention-worker {} holds KV for {cap} positions; the coordinator was sized for {}",
                        w.id,
                        self.capacity
                    );
                }
                client
                    .release(ReleaseRequest {
                        seq_ids: Vec::new(),
                        all: true,
                    })
                    .await
                    .map_err(|e| anyhow::anyhow!("Release: {}", e.message()))?;
                Ok::<(), anyhow::Error>(())
            }
            .await;
            match checked {
                Ok(()) => ok.push(w),
                Err(e) => {
                    tracing::warn!(worker = %w.id, addr = %w.addr, error = %e, "not using this attention-worker");
                    warned.insert(key);
                }
            }
        }
        ok
    }

    fn take_pending(&self) -> Vec<u64> {
        self.pending
            .lock()
            .map(|mut p| std::mem::take(&mut *p))
            .unwrap_or_default()
    }

    fn put_back(&self, ids: Vec<u64>) {
        if let Ok(mut p) = self.pending.lock() {
            p.extend(ids);
        }
    }
}

impl RemoteAttention {
    #[tracing::instrument(
        level = "debug",
        name = "remote_attention",
        skip_all,
        fields(layer = layer, seqs = chunks.len())
    )]
    async fn call(&self, layer: usize, x: &[f32], chunks: &[SeqChunk]) -> Result<Vec<f32>> {
        let started = Instant::now();
        let rows: usize = chunks.iter().map(|c| c.len).sum();
        let hidden = x.len().checked_div(rows).unwrap_or(0);
        let release = self.take_pending();
        // Encoded once: every shard's request shares its buffer (`Bytes`).
        let tensor = wire::encode(x, rows, hidden, self.dtype);
        let seqs: Vec<pb::SeqChunk> = chunks
            .iter()
            .map(|c| pb::SeqChunk {
                seq_id: c.id,
                past: c.past as u32,
                len: c.len as u32,
                // The shard keeps the table for the step's later layers.
                blocks: if layer == 0 {
                    c.blocks.clone()
                } else {
                    Vec::new()
                },
            })
            .collect();
        let shards = self.shard_list()?;
        let request = |s: &ShardConn| {
            let req = AttentionRequest {
                layer: layer as u32,
                seqs: seqs.clone(),
                hidden: Some(tensor.clone()),
                release_first: release.clone(),
                output_dtype: self.dtype as i32,
                kv_block_size: chunks.first().map_or(0, |c| c.block_size) as u32,
            };
            counter!("epserve_attention_bytes_sent_total", "worker" => s.id.clone())
                .increment(tensor.data.len() as u64);
            let mut client = s.client.clone();
            let timeout = self.timeout;
            let span = tracing::debug_span!("attention_call", worker = %s.id);
            async move {
                let mut r = tonic::Request::new(req);
                r.set_timeout(timeout);
                client.forward(r).await
            }
            .instrument(span)
        };
        let mut results = join_all(shards.iter().map(request)).await;
        for _ in &shards {
            self.budget.deposit();
        }
        // A call that failed in transit is sent again to the same shard (no
        // replica holds its KV): the shard writes positions past..past+len,
        // truncating first, so a repeated call is harmless. Twice at most,
        // and only within the retry budget.
        for backoff in RETRY_BACKOFF {
            let again: Vec<usize> = results
                .iter()
                .enumerate()
                .filter(|(_, r)| r.as_ref().is_err_and(|st| retryable(st.code())))
                .map(|(i, _)| i)
                .collect();
            if again.is_empty() || !self.budget.withdraw() {
                break;
            }
            counter!("epserve_attention_retries_total").increment(again.len() as u64);
            tracing::warn!(layer, shards = ?again, "attention call failed; sending it again");
            tokio::time::sleep(backoff).await;
            let redo = join_all(again.iter().map(|&i| request(&shards[i]))).await;
            for (i, r) in again.into_iter().zip(redo) {
                results[i] = r;
            }
        }
        let mut sum: Vec<f32> = Vec::new();
        let mut failed = None;
        for (s, res) in shards.iter().zip(results) {
            let part = res
                .map_err(|st| {
                    Error::Attention(format!(
                        "attention-worker {} ({}) failed at layer {layer}: {}",
                        s.id,
                        s.addr,
                        st.message()
                    ))
                })
                .and_then(|r| {
                    let r = r.into_inner();
                    histogram!("epserve_attention_worker_compute_seconds", "worker" => s.id.clone())
                        .record(r.compute_us as f64 / 1e6);
                    let t = r.partial.ok_or_else(|| {
                        Error::Attention(format!("attention-worker {}: empty response", s.id))
                    })?;
                    counter!("epserve_attention_bytes_received_total", "worker" => s.id.clone())
                        .increment(t.data.len() as u64);
                    let v = wire::decode(&t)
                        .map_err(|e| Error::Attention(format!("attention-worker {}: {e}", s.id)))?;
                    if v.len() != x.len() {
                        return Err(Error::Attention(format!(
                            "attention-worker {} returned {} values for {} inputs",
                            s.id,
                            v.len(),
                            x.len()
                        )));
                    }
                    Ok(v)
                });
            match part {
                Err(e) => {
                    failed.get_or_insert(e);
                }
                Ok(v) if sum.is_empty() => sum = v,
                Ok(v) => {
                    for (a, b) in sum.iter_mut().zip(&v) {
                        *a += b;
                    }
                }
            }
        }
        histogram!("epserve_attention_seconds", "layer" => layer.to_string())
            .record(started.elapsed().as_secs_f64());
        if let Some(e) = failed {
            // Releases are idempotent: send them again with the next call.
            self.put_back(release);
            return Err(e);
        }
        Ok(sum)
    }
}

impl AttentionBackend for RemoteAttention {
    /// Spawns the layer's calls on the runtime; `wait` blocks the caller
    /// (the scheduler thread) until every shard answered.
    fn submit(
        self: Arc<Self>,
        layer: usize,
        x: Arc<[f32]>,
        chunks: Vec<SeqChunk>,
    ) -> Result<PendingAttention> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let rt = self.rt.clone();
        rt.spawn(async move {
            let r = self.call(layer, &x, &chunks).await;
            // The step may have failed and dropped its handle.
            let _ = tx.send(r);
        });
        Ok(PendingAttention::later(move || {
            rx.blocking_recv().unwrap_or_else(|_| {
                Err(Error::Attention(format!(
                    "layer {layer}: the attention task ended without an answer"
                )))
            })
        }))
    }

    fn release(&self, ids: &[u64]) {
        self.put_back(ids.to_vec());
    }

    fn flush(&self) {
        let ids = self.take_pending();
        if ids.is_empty() {
            return;
        }
        let Ok(shards) = self.shard_list() else {
            self.put_back(ids);
            return;
        };
        let calls = shards.iter().map(|s| {
            let mut client = s.client.clone();
            let mut r = tonic::Request::new(ReleaseRequest {
                seq_ids: ids.clone(),
                all: false,
            });
            r.set_timeout(self.timeout);
            async move { (s, client.release(r).await) }
        });
        let mut retry = false;
        for (s, res) in self.rt.block_on(join_all(calls)) {
            if let Err(e) = res {
                tracing::warn!(worker = %s.id, error = %e.message(), "attention Release failed; retried with the next step");
                retry = true;
            }
        }
        if retry {
            self.put_back(ids);
        }
    }

    fn capacity_positions(&self) -> Option<usize> {
        Some(self.capacity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: &str, shard: Option<(u32, u32)>) -> WorkerInfo {
        WorkerInfo {
            id: id.into(),
            role: "attention".into(),
            addr: format!("http://{id}:1"),
            cores: vec![],
            memory_bytes: 0,
            shard,
            pid: 1,
        }
    }

    #[test]
    fn shards_are_ordered_and_checked() {
        let got = order_shards(&[w("b", Some((1, 2))), w("a", Some((0, 2)))], 2)
            .ok()
            .flatten()
            .map(|v| v.into_iter().map(|x| x.id).collect::<Vec<_>>());
        assert_eq!(got, Some(vec!["a".to_string(), "b".to_string()]));
        // One missing: keep waiting.
        assert!(matches!(order_shards(&[w("a", Some((0, 2)))], 2), Ok(None)));
        let err = |ws: &[WorkerInfo]| order_shards(ws, 2).err().map(|e| e.to_string());
        assert!(
            err(&[w("a", Some((0, 2))), w("c", Some((0, 2)))])
                .is_some_and(|m| m.contains("registered twice"))
        );
        assert!(err(&[w("a", Some((0, 3)))]).is_some_and(|m| m.contains("expects 2 shards")));
        assert!(err(&[w("a", Some((2, 2)))]).is_some_and(|m| m.contains("outside 0..2")));
        assert!(err(&[w("a", None)]).is_some_and(|m| m.contains("without a shard")));
    }

    #[test]
    fn follows_shards_that_register_again() -> anyhow::Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let _g = rt.enter();
        let conn = |x: &WorkerInfo| -> anyhow::Result<ShardConn> {
            Ok(ShardConn {
                id: x.id.clone(),
                addr: x.addr.clone(),
                client: shard_client(x, Duration::from_secs(1), None)?,
            })
        };
        let (a, b) = (w("a", Some((0, 2))), w("b", Some((1, 2))));
        let ra = RemoteAttention {
            rt: rt.handle().clone(),
            shape: Shape {
                layers: 1,
                hidden: 1,
                block_size: 1,
            },
            shards: RwLock::new(vec![conn(&a)?, conn(&b)?]),
            dtype: Dtype::F32,
            timeout: Duration::from_secs(1),
            pending: Mutex::new(Vec::new()),
            capacity: 1,
            missing: Mutex::new(Vec::new()),
            budget: tower::retry::budget::TpsBudget::new(Duration::from_secs(10), 10, 0.2),
            tls: None,
        };
        let addrs = |ra: &RemoteAttention| -> Vec<String> {
            ra.shard_list()
                .map(|l| l.into_iter().map(|s| s.addr).collect())
                .unwrap_or_default()
        };
        // Nothing changed, or shard 1 not registered at the moment: keep it.
        assert!(ra.update_shards(&[a.clone(), b.clone()]).is_empty());
        assert!(ra.update_shards(std::slice::from_ref(&a)).is_empty());
        // The old registration of shard 1 still there beside a new one: keep
        // the old until its lease ends.
        let mut b2 = w("b2", Some((1, 2)));
        assert!(
            ra.update_shards(&[a.clone(), b.clone(), b2.clone()])
                .is_empty()
        );
        let changed = ra.update_shards(&[a.clone(), b2.clone()]);
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert_eq!(addrs(&ra), vec![a.addr.clone(), b2.addr.clone()]);
        // Same id, new address; a shard of another count is ignored.
        b2.addr = "http://b2:2".into();
        let stray = w("c", Some((0, 3)));
        assert_eq!(ra.update_shards(&[a.clone(), b2.clone(), stray]).len(), 1);
        assert_eq!(addrs(&ra), vec![a.addr.clone(), "http://b2:2".to_string()]);
        Ok(())
    }

    #[test]
    fn refuses_models_that_cannot_be_split() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let check = |name: &str, n: usize| {
            ModelConfig::from_dir(&dir.join(name).join("f32"))
                .map_err(anyhow::Error::from)
                .and_then(|c| check_model(&c, n))
        };
        assert!(check("qwen3_moe_a", 2).is_ok());
        assert!(check("olmoe", 2).is_ok());
        assert!(check("deepseek_v3", 4).is_ok());
        assert!(
            check("qwen3_moe_a", 3)
                .is_err_and(|e| format!("{e:#}").contains("cannot be split evenly"))
        );
        assert!(check("deepseek_v3", 3).is_err());
    }
}
