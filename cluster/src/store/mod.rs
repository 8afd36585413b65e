//! The key-value store the cluster state lives in, behind a small trait
//! (GreptimeDB's `kv_backend` idea): [`EtcdStore`] for real clusters and
//! [`MemoryStore`] for single-process use and unit tests; both pass the one
//! [`conformance`] suite.

pub mod conformance;
mod etcd;
mod memory;

use async_trait::async_trait;
use tokio::sync::mpsc;

pub use etcd::{EtcdSecurity, EtcdStore};
pub use memory::MemoryStore;

/// Store failures.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("etcd at {endpoint}: {message}")]
    Etcd { endpoint: String, message: String },
    #[error("store: {0}")]
    Other(String),
}

/// Result alias.
pub type StoreResult<T> = Result<T, StoreError>;

/// Keeps a leased key alive; dropping it stops the keep-alive and revokes the lease.
pub struct LeaseGuard {
    pub(crate) task: tokio::task::JoinHandle<()>,
    pub(crate) on_drop: Option<Box<dyn FnOnce() + Send>>,
    pub(crate) lost: Option<tokio::sync::oneshot::Receiver<StoreError>>,
}

impl LeaseGuard {
    /// Resolves when the key can no longer be kept alive: the store has been
    /// unreachable longer than a limit set with
    /// [`EtcdStore::give_up_leases_after`]. Never resolves without such a
    /// limit (the default: the keep-alive retries for as long as it takes).
    pub async fn lost(&mut self) -> StoreError {
        match self.lost.as_mut() {
            Some(rx) => match rx.await {
                Ok(e) => e,
                Err(_) => std::future::pending().await,
            },
            None => std::future::pending().await,
        }
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

/// A value with the revision it was last modified at.
#[derive(Debug, Clone, PartialEq)]
pub struct Versioned {
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

/// What the cluster needs from a key-value store.
#[async_trait]
pub trait KvStore: Send + Sync {
    /// Reads one key.
    async fn get(&self, key: &str) -> StoreResult<Option<Versioned>>;
    /// Writes one key.
    async fn put(&self, key: &str, value: Vec<u8>) -> StoreResult<()>;
    /// Writes only if the key does not exist; true if written.
    async fn create(&self, key: &str, value: Vec<u8>) -> StoreResult<bool>;
    /// Writes only if the key's mod revision is still `rev`; true if written.
    async fn compare_and_swap(&self, key: &str, rev: i64, value: Vec<u8>) -> StoreResult<bool>;
    /// Deletes one key.
    async fn delete(&self, key: &str) -> StoreResult<()>;
    /// All keys under a prefix, sorted.
    async fn list(&self, prefix: &str) -> StoreResult<Vec<(String, Vec<u8>)>>;
    /// Writes a key that disappears `ttl_secs` after its owner stops renewing it.
    async fn put_leased(&self, key: &str, value: Vec<u8>, ttl_secs: i64)
    -> StoreResult<LeaseGuard>;
    /// Current value now and after every change (`None` = deleted).
    async fn watch(&self, key: &str) -> StoreResult<mpsc::Receiver<Option<Vec<u8>>>>;
}
