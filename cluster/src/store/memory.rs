//! [`MemoryStore`]: an in-process [`KvStore`] with etcd's semantics (revisions,
//! compare-and-swap, leases dropped with their guard, watches), for the single
//! process and for unit tests.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::sync::mpsc;

use super::{KvStore, LeaseGuard, StoreError, StoreResult, Versioned};

#[derive(Default)]
struct Mem {
    data: BTreeMap<String, Versioned>,
    rev: i64,
    watchers: Vec<(String, mpsc::Sender<Option<Vec<u8>>>)>,
}

impl Mem {
    fn set(&mut self, key: &str, value: Option<Vec<u8>>) {
        self.rev += 1;
        match &value {
            Some(v) => {
                self.data.insert(
                    key.to_string(),
                    Versioned {
                        value: v.clone(),
                        mod_revision: self.rev,
                    },
                );
            }
            None => {
                self.data.remove(key);
            }
        }
        self.watchers.retain(|(k, tx)| {
            if k == key {
                tx.try_send(value.clone()).is_ok() || !tx.is_closed()
            } else {
                !tx.is_closed()
            }
        });
    }
}

/// An in-process store with the same semantics (single process, tests).
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Mutex<Mem>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Ends every open watch (its receiver sees the channel close), as an
    /// etcd restart ends etcd's watch streams; for tests of reconnection.
    pub fn end_watches(&self) {
        if let Ok(mut m) = self.inner.lock() {
            m.watchers.clear();
        }
    }

    fn lock(&self) -> StoreResult<std::sync::MutexGuard<'_, Mem>> {
        self.inner
            .lock()
            .map_err(|_| StoreError::Other("memory store lock poisoned".into()))
    }
}

#[async_trait]
impl KvStore for MemoryStore {
    async fn get(&self, key: &str) -> StoreResult<Option<Versioned>> {
        Ok(self.lock()?.data.get(key).cloned())
    }
    async fn put(&self, key: &str, value: Vec<u8>) -> StoreResult<()> {
        self.lock()?.set(key, Some(value));
        Ok(())
    }
    async fn create(&self, key: &str, value: Vec<u8>) -> StoreResult<bool> {
        let mut m = self.lock()?;
        if m.data.contains_key(key) {
            return Ok(false);
        }
        m.set(key, Some(value));
        Ok(true)
    }
    async fn compare_and_swap(&self, key: &str, rev: i64, value: Vec<u8>) -> StoreResult<bool> {
        let mut m = self.lock()?;
        // A missing key has mod revision 0, as in etcd.
        if m.data.get(key).map_or(0, |v| v.mod_revision) != rev {
            return Ok(false);
        }
        m.set(key, Some(value));
        Ok(true)
    }
    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.lock()?.set(key, None);
        Ok(())
    }
    async fn list(&self, prefix: &str) -> StoreResult<Vec<(String, Vec<u8>)>> {
        Ok(self
            .lock()?
            .data
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.value.clone()))
            .collect())
    }
    async fn put_leased(
        &self,
        key: &str,
        value: Vec<u8>,
        _ttl_secs: i64,
    ) -> StoreResult<LeaseGuard> {
        self.lock()?.set(key, Some(value));
        let (store, key) = (self.clone(), key.to_string());
        Ok(LeaseGuard {
            task: tokio::spawn(async {}),
            on_drop: Some(Box::new(move || {
                if let Ok(mut m) = store.inner.lock() {
                    m.set(&key, None);
                }
            })),
            lost: None,
        })
    }
    async fn watch(&self, key: &str) -> StoreResult<mpsc::Receiver<Option<Vec<u8>>>> {
        let (tx, rx) = mpsc::channel(64);
        let mut m = self.lock()?;
        let _ = tx.try_send(m.data.get(key).map(|v| v.value.clone()));
        m.watchers.push((key.to_string(), tx));
        Ok(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_store_passes_the_conformance_suite() -> StoreResult<()> {
        super::super::conformance::run_all(&MemoryStore::new(), "/conformance/").await
    }

    #[tokio::test]
    async fn memory_store_semantics() -> StoreResult<()> {
        let s = MemoryStore::new();
        assert!(s.create("/a", b"1".to_vec()).await?);
        assert!(!s.create("/a", b"2".to_vec()).await?);
        let v = s
            .get("/a")
            .await?
            .ok_or_else(|| StoreError::Other("missing".into()))?;
        assert!(
            !s.compare_and_swap("/a", v.mod_revision + 7, b"x".to_vec())
                .await?
        );
        assert!(
            s.compare_and_swap("/a", v.mod_revision, b"3".to_vec())
                .await?
        );
        let mut w = s.watch("/a").await?;
        assert_eq!(w.recv().await, Some(Some(b"3".to_vec())));
        s.put("/a", b"4".to_vec()).await?;
        assert_eq!(w.recv().await, Some(Some(b"4".to_vec())));
        {
            let _g = s.put_leased("/p/x", b"l".to_vec(), 5).await?;
            assert_eq!(s.list("/p/").await?.len(), 1);
        }
        assert!(s.list("/p/").await?.is_empty());
        Ok(())
    }
}
