//! The expert executor's worker threads: a rayon pool whose threads are
//! pinned one per core (`core_affinity`) when asked, so each thread keeps its
//! L1/L2 and its share of the memory bandwidth.

use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};

/// A pool of (optionally pinned) worker threads.
pub struct ExpertPool {
    pool: rayon::ThreadPool,
    threads: usize,
    pinned: bool,
}

impl std::fmt::Debug for ExpertPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertPool")
            .field("threads", &self.threads)
            .field("pinned", &self.pinned)
            .finish()
    }
}

impl ExpertPool {
    /// `threads` workers (default: one per available core); with `pin`,
    /// worker `i` is pinned to the `i`-th core this process may use.
    pub fn new(threads: Option<usize>, pin: bool) -> Result<Self> {
        let cores = core_affinity::get_core_ids().unwrap_or_default();
        let n = threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .max(1);
        let pinned = pin && !cores.is_empty();
        let mut b = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("epserve-expert-{i}"));
        if pinned {
            b = b.start_handler(move |i| {
                if !core_affinity::set_for_current(cores[i % cores.len()]) {
                    tracing::debug!(thread = i, "could not pin expert thread");
                }
            });
        }
        let pool = b
            .build()
            .map_err(|e| Error::Dispatch(format!("cannot start expert threads: {e}")))?;
        Ok(ExpertPool {
            pool,
            threads: n,
            pinned,
        })
    }

    /// The process-wide pool: one pinned thread per available core.
    pub fn shared() -> Result<Arc<ExpertPool>> {
        static SHARED: OnceLock<Arc<ExpertPool>> = OnceLock::new();
        if let Some(p) = SHARED.get() {
            return Ok(p.clone());
        }
        let p = Arc::new(ExpertPool::new(None, true)?);
        Ok(SHARED.get_or_init(|| p).clone())
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Whether the workers are pinned to cores.
    pub fn pinned(&self) -> bool {
        self.pinned
    }

    /// Runs `f(thread_index)` once on every worker thread at the same time
    /// and returns the results in thread order (bandwidth and FMA probes).
    pub fn broadcast<R: Send>(&self, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
        self.pool.broadcast(|ctx| f(ctx.index()))
    }

    /// Runs `f` inside the pool (its parallel iterators use these threads).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}
