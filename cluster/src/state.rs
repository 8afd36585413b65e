//! The cluster's state in the store, under `/epserve/<cluster>/`:
//!
//! | key | value |
//! | --- | --- |
//! | `workers/expert/<id>` | [`WorkerInfo`] JSON, under a lease (gone when the worker dies) |
//! | `workers/attention/<id>` | [`WorkerInfo`] JSON, under a lease |
//! | `placement` | the versioned [`Placement`] JSON |
//! | `rebalance` | the live rebalance in progress or last finished ([`Rebalance`] JSON) |
//! | `rebalance-ready/<worker>` | the rebalance id a worker has loaded its new replicas for |
//! | `drained` | JSON list of worker ids drained by `DrainWorker` (no experts planned on them) |
//! | `drain-requests/<worker>` | [`DrainRequest`] JSON: a worker asks to be drained (SIGTERM); the coordinator's controller moves its experts away and deletes the key |

use std::collections::BTreeSet;
use std::sync::Arc;

use epserve_core::placement::Placement;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::store::{KvStore, LeaseGuard, StoreError, StoreResult};

/// Seconds a worker's registration outlives its last keep-alive, by
/// default (`--lease-ttl-secs`).
pub const WORKER_TTL_SECS: i64 = 5;

/// First wait before re-establishing a watch that ended.
pub const WATCH_RETRY_MIN: std::time::Duration = std::time::Duration::from_millis(100);
/// Longest wait between attempts to re-establish a watch.
pub const WATCH_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// A worker as it registers itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub id: String,
    /// `expert` or `attention`.
    pub role: String,
    /// gRPC endpoint, e.g. `http://10.0.0.5:50051`.
    pub addr: String,
    /// Cores its compute threads are pinned to.
    pub cores: Vec<usize>,
    /// Memory it offers for experts (or KV cache), bytes.
    pub memory_bytes: u64,
    /// Attention shard `(index, of)`.
    pub shard: Option<(u32, u32)>,
    pub pid: u32,
}

/// A worker's request to be drained (written on SIGTERM).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrainRequest {
    /// Unix milliseconds when it was asked.
    pub requested_ms: u64,
    /// Why (`SIGTERM`, ...).
    #[serde(default)]
    pub reason: String,
}

/// States of a live rebalance, in order. `Proposed`, `Loading`, `Ready` and
/// `Switched` are active: workers hold the replicas of both placements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RebalanceState {
    /// The target placement is written; workers start loading.
    Proposed,
    /// Every worker of the target is registered; waiting for them to load.
    Loading,
    /// Every worker with new replicas reported them loaded.
    Ready,
    /// The placement key holds the target; steps still routed with the old
    /// placement may be in flight.
    Switched,
    /// No step uses the old placement; workers drop what it alone needed.
    Done,
    /// Abandoned before the switch; the old placement stays.
    RolledBack,
}

impl RebalanceState {
    /// True while workers must hold both placements' experts.
    pub fn active(self) -> bool {
        matches!(
            self,
            Self::Proposed | Self::Loading | Self::Ready | Self::Switched
        )
    }

    /// The name used in documents and the admin API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Proposed => "proposed",
            Self::Loading => "loading",
            Self::Ready => "ready",
            Self::Switched => "switched",
            Self::Done => "done",
            Self::RolledBack => "rolled_back",
        }
    }
}

/// One live rebalance, as stored under `rebalance`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rebalance {
    pub id: String,
    pub state: RebalanceState,
    /// Why: `rebalance`, `set-placement`, `drain <worker>`, `auto`.
    pub reason: String,
    /// The placement in force when it started.
    pub from: Placement,
    /// The placement it switches to (version = from.version + 1).
    pub target: Placement,
    /// Why it rolled back, or notes.
    #[serde(default)]
    pub message: String,
    /// Unix milliseconds of the last state change.
    #[serde(default)]
    pub updated_ms: u64,
}

impl Rebalance {
    /// Workers that hold a replica under `target` they do not hold under `from`:
    /// the ones that must load and report ready.
    pub fn loading_workers(&self) -> Vec<String> {
        self.target
            .workers
            .iter()
            .filter(|w| {
                let (to, from) = (self.target.assigned_to(w), self.from.assigned_to(w));
                // New replicas, or replicas held here in another precision.
                !to.is_subset(&from)
                    || to
                        .iter()
                        .any(|&(l, e)| self.target.is_int8(l, e) != self.from.is_int8(l, e))
            })
            .cloned()
            .collect()
    }
}

/// The `(layer, expert)` pairs worker `id` must hold, given the placement in
/// force and the rebalance document: the union of both placements' share
/// while a rebalance is active (new replicas load before the switch, old ones
/// are dropped only after it is done), the placement's share otherwise.
pub fn desired_experts(
    id: &str,
    placement: Option<&Placement>,
    rebalance: Option<&Rebalance>,
) -> BTreeSet<(usize, usize)> {
    let mut out = placement.map(|p| p.assigned_to(id)).unwrap_or_default();
    if let Some(r) = rebalance
        && r.state.active()
    {
        out.extend(r.from.assigned_to(id));
        out.extend(r.target.assigned_to(id));
    }
    out
}

/// The experts of [`desired_experts`] worker `id` holds in int8: as the
/// target placement says while a rebalance is active (for the replicas it
/// keeps or adds; the old placement's for those it drops), as the placement
/// in force says otherwise.
pub fn desired_int8(
    id: &str,
    placement: Option<&Placement>,
    rebalance: Option<&Rebalance>,
) -> BTreeSet<(usize, usize)> {
    let held = desired_experts(id, placement, rebalance);
    match rebalance {
        Some(r) if r.state.active() => {
            let kept = r.target.assigned_to(id);
            held.into_iter()
                .filter(|&(l, e)| {
                    if kept.contains(&(l, e)) {
                        r.target.is_int8(l, e)
                    } else {
                        r.from.is_int8(l, e)
                    }
                })
                .collect()
        }
        _ => held
            .into_iter()
            .filter(|&(l, e)| placement.is_some_and(|p| p.is_int8(l, e)))
            .collect(),
    }
}

/// Access to one cluster's keys.
#[derive(Clone)]
pub struct ClusterState {
    store: Arc<dyn KvStore>,
    prefix: String,
}

fn json_err(e: serde_json::Error) -> StoreError {
    StoreError::Other(format!("corrupt cluster document: {e}"))
}

impl ClusterState {
    /// State of cluster `name` in `store`.
    pub fn new(store: Arc<dyn KvStore>, name: &str) -> Self {
        ClusterState {
            store,
            prefix: format!("/epserve/{name}"),
        }
    }

    /// The key prefix (`/epserve/<cluster>`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The placement key.
    pub fn placement_key(&self) -> String {
        format!("{}/placement", self.prefix)
    }

    fn workers_prefix(&self, role: &str) -> String {
        format!("{}/workers/{role}/", self.prefix)
    }

    /// Registers a worker under a lease of [`WORKER_TTL_SECS`]; keep the
    /// guard alive while serving.
    pub async fn register(&self, info: &WorkerInfo) -> StoreResult<LeaseGuard> {
        self.register_ttl(info, WORKER_TTL_SECS).await
    }

    /// Registers a worker under a lease of `ttl_secs` (the registration
    /// vanishes that long after the worker's last keep-alive).
    pub async fn register_ttl(&self, info: &WorkerInfo, ttl_secs: i64) -> StoreResult<LeaseGuard> {
        let key = format!("{}{}", self.workers_prefix(&info.role), info.id);
        let value = serde_json::to_vec(info).map_err(json_err)?;
        self.store.put_leased(&key, value, ttl_secs.max(1)).await
    }

    /// Removes worker `id`'s registration now (a worker stopping in order;
    /// drop its lease guard first so the keeper does not write it again).
    pub async fn deregister(&self, role: &str, id: &str) -> StoreResult<()> {
        self.store
            .delete(&format!("{}{id}", self.workers_prefix(role)))
            .await
    }

    fn drain_requests_prefix(&self) -> String {
        format!("{}/drain-requests/", self.prefix)
    }

    /// Worker `id` asks to be drained (its experts moved to others).
    pub async fn request_drain(&self, id: &str, req: &DrainRequest) -> StoreResult<()> {
        let value = serde_json::to_vec(req).map_err(json_err)?;
        self.store
            .put(&format!("{}{id}", self.drain_requests_prefix()), value)
            .await
    }

    /// Pending drain requests, by worker id (sorted).
    pub async fn drain_requests(&self) -> StoreResult<Vec<(String, DrainRequest)>> {
        let prefix = self.drain_requests_prefix();
        let mut out = Vec::new();
        for (k, v) in self.store.list(&prefix).await? {
            if let Some(id) = k.strip_prefix(&prefix) {
                out.push((
                    id.to_string(),
                    serde_json::from_slice(&v).map_err(json_err)?,
                ));
            }
        }
        Ok(out)
    }

    /// Removes worker `id`'s drain request (handled, or withdrawn).
    pub async fn clear_drain_request(&self, id: &str) -> StoreResult<()> {
        self.store
            .delete(&format!("{}{id}", self.drain_requests_prefix()))
            .await
    }

    /// Registered workers of a role, sorted by id.
    pub async fn workers(&self, role: &str) -> StoreResult<Vec<WorkerInfo>> {
        let mut out = Vec::new();
        for (_, v) in self.store.list(&self.workers_prefix(role)).await? {
            out.push(serde_json::from_slice::<WorkerInfo>(&v).map_err(json_err)?);
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// The current placement and its store revision.
    pub async fn placement(&self) -> StoreResult<Option<(Placement, i64)>> {
        match self.store.get(&self.placement_key()).await? {
            None => Ok(None),
            Some(v) => Ok(Some((
                serde_json::from_slice(&v.value).map_err(json_err)?,
                v.mod_revision,
            ))),
        }
    }

    /// Writes `p` if no placement exists; returns the one in force either way.
    pub async fn init_placement(&self, p: &Placement) -> StoreResult<Placement> {
        let value = serde_json::to_vec(p).map_err(json_err)?;
        self.store.create(&self.placement_key(), value).await?;
        self.placement()
            .await?
            .map(|(p, _)| p)
            .ok_or_else(|| StoreError::Other("placement vanished right after being written".into()))
    }

    /// Replaces the placement if it is still at revision `rev`.
    pub async fn swap_placement(&self, rev: i64, p: &Placement) -> StoreResult<bool> {
        let value = serde_json::to_vec(p).map_err(json_err)?;
        self.store
            .compare_and_swap(&self.placement_key(), rev, value)
            .await
    }

    /// The placement now and after every change.
    pub async fn watch_placement(&self) -> StoreResult<mpsc::Receiver<Option<Placement>>> {
        self.watch_json(&self.placement_key()).await
    }

    /// `key` decoded as JSON now and after every change. If the store's watch
    /// ends (etcd restarted, a network blip), it is re-established with
    /// exponential backoff ([`WATCH_RETRY_MIN`] .. [`WATCH_RETRY_MAX`]); a new
    /// watch starts with the key's current value, so a change made while no
    /// watch was open is not missed. The receiver ends only when dropped.
    async fn watch_json<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        key: &str,
    ) -> StoreResult<mpsc::Receiver<Option<T>>> {
        let mut raw = self.store.watch(key).await?;
        let (tx, rx) = mpsc::channel(8);
        let key = key.to_string();
        let store = self.store.clone();
        tokio::spawn(async move {
            // The last value passed on, to skip the re-read after a reconnect
            // when nothing changed meanwhile.
            let mut last: Option<Option<Vec<u8>>> = None;
            let mut reconnected = false;
            let mut backoff = WATCH_RETRY_MIN;
            loop {
                let opened = tokio::time::Instant::now();
                while let Some(v) = raw.recv().await {
                    if std::mem::take(&mut reconnected) && last.as_ref() == Some(&v) {
                        continue;
                    }
                    last = Some(v.clone());
                    let p = match v {
                        None => None,
                        Some(bytes) => match serde_json::from_slice::<T>(&bytes) {
                            Ok(p) => Some(p),
                            Err(e) => {
                                tracing::error!(key = %key, error = %e, "ignoring a corrupt document");
                                continue;
                            }
                        },
                    };
                    if tx.send(p).await.is_err() {
                        return;
                    }
                }
                // A watch that lived a while starts the backoff afresh; one
                // that keeps ending at once waits longer each time.
                if opened.elapsed() >= WATCH_RETRY_MAX {
                    backoff = WATCH_RETRY_MIN;
                }
                tracing::warn!(key = %key, retry_in = ?backoff, "watch ended; re-establishing it");
                let mut attempt = 1u32;
                raw = loop {
                    tokio::select! {
                        _ = tx.closed() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    let w = store.watch(&key).await;
                    backoff = (backoff * 2).min(WATCH_RETRY_MAX);
                    match w {
                        Ok(w) => break w,
                        Err(e) => {
                            tracing::warn!(key = %key, attempt, error = %e, retry_in = ?backoff,
                                "cannot re-establish the watch");
                            attempt += 1;
                        }
                    }
                };
                tracing::warn!(key = %key, attempt, "watch re-established; current value re-read");
                reconnected = true;
            }
        });
        Ok(rx)
    }

    /// The rebalance key.
    pub fn rebalance_key(&self) -> String {
        format!("{}/rebalance", self.prefix)
    }

    fn ready_prefix(&self) -> String {
        format!("{}/rebalance-ready/", self.prefix)
    }

    /// The rebalance document and its store revision.
    pub async fn rebalance(&self) -> StoreResult<Option<(Rebalance, i64)>> {
        match self.store.get(&self.rebalance_key()).await? {
            None => Ok(None),
            Some(v) => Ok(Some((
                serde_json::from_slice(&v.value).map_err(json_err)?,
                v.mod_revision,
            ))),
        }
    }

    /// Starts a rebalance: writes `r` unless an active one exists. Returns
    /// the active one's id if there is one (nothing written then).
    pub async fn start_rebalance(&self, r: &Rebalance) -> StoreResult<Result<(), String>> {
        let value = serde_json::to_vec(r).map_err(json_err)?;
        let key = self.rebalance_key();
        // Ready marks of earlier rebalances must not count for this one.
        for (k, _) in self.store.list(&self.ready_prefix()).await? {
            self.store.delete(&k).await?;
        }
        match self.rebalance().await? {
            None => {
                if self.store.create(&key, value).await? {
                    Ok(Ok(()))
                } else {
                    Ok(Err("(just started by another writer)".into()))
                }
            }
            Some((cur, _)) if cur.state.active() => Ok(Err(cur.id)),
            Some((cur, rev)) => {
                if self.store.compare_and_swap(&key, rev, value).await? {
                    Ok(Ok(()))
                } else {
                    Ok(Err(format!(
                        "(replacing {} raced with another writer)",
                        cur.id
                    )))
                }
            }
        }
    }

    /// Records a state change of the rebalance in progress.
    pub async fn put_rebalance(&self, r: &Rebalance) -> StoreResult<()> {
        let value = serde_json::to_vec(r).map_err(json_err)?;
        self.store.put(&self.rebalance_key(), value).await
    }

    /// The rebalance document now and after every change.
    pub async fn watch_rebalance(&self) -> StoreResult<mpsc::Receiver<Option<Rebalance>>> {
        self.watch_json(&self.rebalance_key()).await
    }

    /// A worker reports that it holds the new replicas of rebalance `id`.
    pub async fn report_ready(&self, worker: &str, id: &str) -> StoreResult<()> {
        let key = format!("{}{worker}", self.ready_prefix());
        self.store.put(&key, id.as_bytes().to_vec()).await
    }

    /// Workers that reported ready for rebalance `id`.
    pub async fn ready_workers(&self, id: &str) -> StoreResult<BTreeSet<String>> {
        let prefix = self.ready_prefix();
        Ok(self
            .store
            .list(&prefix)
            .await?
            .into_iter()
            .filter(|(_, v)| v.as_slice() == id.as_bytes())
            .filter_map(|(k, _)| k.strip_prefix(&prefix).map(str::to_string))
            .collect())
    }

    fn drained_key(&self) -> String {
        format!("{}/drained", self.prefix)
    }

    /// Workers drained by `DrainWorker`: planned placements leave them empty.
    pub async fn drained(&self) -> StoreResult<BTreeSet<String>> {
        match self.store.get(&self.drained_key()).await? {
            None => Ok(BTreeSet::new()),
            Some(v) => serde_json::from_slice(&v.value).map_err(json_err),
        }
    }

    /// Replaces the drained set.
    pub async fn set_drained(&self, drained: &BTreeSet<String>) -> StoreResult<()> {
        let value = serde_json::to_vec(drained).map_err(json_err)?;
        self.store.put(&self.drained_key(), value).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[tokio::test]
    async fn registration_and_placement() -> StoreResult<()> {
        let st = ClusterState::new(Arc::new(MemoryStore::new()), "t");
        let info = WorkerInfo {
            id: "w1".into(),
            role: "expert".into(),
            addr: "http://127.0.0.1:1".into(),
            cores: vec![0, 1],
            memory_bytes: 1 << 30,
            shard: None,
            pid: 1,
        };
        let guard = st.register(&info).await?;
        assert_eq!(st.workers("expert").await?, vec![info]);
        let p = Placement::initial(&[0], 5, &["w1".into()])
            .map_err(|e| StoreError::Other(e.to_string()))?;
        let mut w = st.watch_placement().await?;
        assert_eq!(w.recv().await, Some(None));
        assert_eq!(st.init_placement(&p).await?, p);
        let mut other = p.clone();
        other.version = 9;
        // A second writer does not overwrite.
        assert_eq!(st.init_placement(&other).await?, p);
        assert_eq!(w.recv().await, Some(Some(p.clone())));
        drop(guard);
        assert!(st.workers("expert").await?.is_empty());
        Ok(())
    }

    /// The next value of a watch, or None after 10 s.
    async fn next<T>(w: &mut mpsc::Receiver<T>) -> Option<Option<T>> {
        tokio::time::timeout(std::time::Duration::from_secs(10), w.recv())
            .await
            .ok()
    }

    #[tokio::test]
    async fn an_ended_watch_is_re_established_and_misses_no_change() -> StoreResult<()> {
        let mem = MemoryStore::new();
        let st = ClusterState::new(Arc::new(mem.clone()), "t");
        let other = |e: epserve_core::placement::PlacementError| StoreError::Other(e.to_string());
        let ws: Vec<String> = vec!["a".into(), "b".into()];
        let mut p1 = Placement::initial(&[0], 4, &ws[..1]).map_err(other)?;
        p1.version = 1;
        let mut p2 = Placement::initial(&[0], 4, &ws).map_err(other)?;
        p2.version = 2;
        let mut p3 = p2.clone();
        p3.version = 3;
        let mut w = st.watch_placement().await?;
        let mut r = st.watch_rebalance().await?;
        assert_eq!(w.recv().await, Some(None));
        assert_eq!(r.recv().await, Some(None));
        st.init_placement(&p1).await?;
        assert_eq!(w.recv().await, Some(Some(p1.clone())));

        // The store ends every watch (etcd restarted); a change lands before
        // the watch is back and is read when it is.
        mem.end_watches();
        let rev = st.placement().await?.map(|(_, rev)| rev).unwrap_or(0);
        assert!(st.swap_placement(rev, &p2).await?);
        assert_eq!(next(&mut w).await, Some(Some(Some(p2.clone()))));
        // ...and later changes keep arriving.
        let rev = st.placement().await?.map(|(_, rev)| rev).unwrap_or(0);
        assert!(st.swap_placement(rev, &p3).await?);
        assert_eq!(next(&mut w).await, Some(Some(Some(p3.clone()))));

        // Ended again with nothing changed: the re-read is not passed on
        // twice; the next change is.
        mem.end_watches();
        tokio::time::sleep(WATCH_RETRY_MIN * 4).await;
        let rb = Rebalance {
            id: "r1".into(),
            state: RebalanceState::Proposed,
            reason: "test".into(),
            from: p3.clone(),
            target: p2.clone(),
            message: String::new(),
            updated_ms: 0,
        };
        assert_eq!(st.start_rebalance(&rb).await?, Ok(()));
        assert_eq!(next(&mut r).await, Some(Some(Some(rb))));
        let mut p4 = p3.clone();
        p4.version = 4;
        let rev = st.placement().await?.map(|(_, rev)| rev).unwrap_or(0);
        assert!(st.swap_placement(rev, &p4).await?);
        assert_eq!(next(&mut w).await, Some(Some(Some(p4))));
        Ok(())
    }

    #[tokio::test]
    async fn rebalance_document_and_desired_sets() -> StoreResult<()> {
        let st = ClusterState::new(Arc::new(MemoryStore::new()), "t");
        let ws: Vec<String> = vec!["a".into(), "b".into()];
        let from =
            Placement::initial(&[0], 4, &ws).map_err(|e| StoreError::Other(e.to_string()))?;
        // a: 0, 2; b: 1, 3. Target: a also gets a replica of 1, b loses 3 to a.
        let mut target = from.clone();
        target.version = 2;
        target.layers[0].experts = vec![vec![0], vec![0, 1], vec![0], vec![0]];
        let mut r = Rebalance {
            id: "r1".into(),
            state: RebalanceState::Proposed,
            reason: "test".into(),
            from: from.clone(),
            target: target.clone(),
            message: String::new(),
            updated_ms: 0,
        };
        assert_eq!(r.loading_workers(), vec!["a".to_string()]);
        let both: BTreeSet<_> = [(0, 1), (0, 3)].into_iter().collect();
        assert_eq!(desired_experts("b", Some(&from), Some(&r)), both);
        assert_eq!(
            desired_experts("b", Some(&target), Some(&r)),
            both,
            "after the switch the old replicas stay until done"
        );
        let mut w = st.watch_rebalance().await?;
        assert_eq!(w.recv().await, Some(None));
        assert_eq!(st.start_rebalance(&r).await?, Ok(()));
        assert_eq!(w.recv().await, Some(Some(r.clone())));
        let mut other = r.clone();
        other.id = "r2".into();
        assert_eq!(st.start_rebalance(&other).await?, Err("r1".to_string()));
        st.report_ready("a", "r1").await?;
        st.report_ready("b", "r0").await?;
        assert_eq!(
            st.ready_workers("r1").await?,
            ["a".to_string()].into_iter().collect()
        );
        r.state = RebalanceState::Done;
        st.put_rebalance(&r).await?;
        assert_eq!(
            desired_experts("b", Some(&target), Some(&r)),
            [(0, 1)].into_iter().collect()
        );
        assert_eq!(st.start_rebalance(&other).await?, Ok(()));
        assert!(
            st.ready_workers("r1").await?.is_empty(),
            "stale marks are cleared"
        );
        let d: BTreeSet<String> = ["b".to_string()].into_iter().collect();
        st.set_drained(&d).await?;
        assert_eq!(st.drained().await?, d);
        let req = DrainRequest {
            requested_ms: 7,
            reason: "SIGTERM".into(),
        };
        st.request_drain("b", &req).await?;
        assert_eq!(st.drain_requests().await?, vec![("b".to_string(), req)]);
        st.clear_drain_request("b").await?;
        assert!(st.drain_requests().await?.is_empty());
        Ok(())
    }
}
