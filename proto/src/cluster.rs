//! The cluster's state in the store, under `/epserve/<cluster>/`:
//!
//! | key | value |
//! | --- | --- |
//! | `workers/expert/<id>` | [`WorkerInfo`] JSON, under a lease (gone when the worker dies) |
//! | `workers/attention/<id>` | [`WorkerInfo`] JSON, under a lease |
//! | `placement` | the versioned [`Placement`] JSON |

use std::sync::Arc;

use epserve_core::placement::Placement;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::store::{KvStore, LeaseGuard, StoreError, StoreResult};

/// Seconds a worker's registration outlives its last keep-alive.
pub const WORKER_TTL_SECS: i64 = 10;

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

    /// Registers a worker under a lease; keep the guard alive while serving.
    pub async fn register(&self, info: &WorkerInfo) -> StoreResult<LeaseGuard> {
        let key = format!("{}{}", self.workers_prefix(&info.role), info.id);
        let value = serde_json::to_vec(info).map_err(json_err)?;
        self.store.put_leased(&key, value, WORKER_TTL_SECS).await
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
        let mut raw = self.store.watch(&self.placement_key()).await?;
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            while let Some(v) = raw.recv().await {
                let p = match v {
                    None => None,
                    Some(bytes) => match serde_json::from_slice::<Placement>(&bytes) {
                        Ok(p) => Some(p),
                        Err(e) => {
                            tracing::error!(error = %e, "ignoring a corrupt placement document");
                            continue;
                        }
                    },
                };
                if tx.send(p).await.is_err() {
                    return;
                }
            }
        });
        Ok(rx)
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
}
