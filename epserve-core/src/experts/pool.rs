//! The expert executor's worker threads: a rayon pool whose threads are
//! pinned one per core (`core_affinity`) when asked, so each thread keeps its
//! L1/L2 and its share of the memory bandwidth.
//!
//! In a process that also runs the dense phases (`serve`, the coordinator,
//! `generate`, the benches), the experts share rayon's global pool with them
//! ([`ExpertPool::shared`], pinned once by [`init_global_pool`]): one set of
//! threads for every phase of a step, instead of two pools of one thread per
//! core taking turns on the same cores. An expert-worker with `--cores` keeps
//! a dedicated pool on exactly those cores.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};

/// A pool of (optionally pinned) worker threads.
pub struct ExpertPool {
    pool: Threads,
    threads: usize,
    pinned: bool,
}

enum Threads {
    /// A dedicated pool.
    Own(rayon::ThreadPool),
    /// rayon's global pool, shared with the dense phases.
    Global,
}

/// Whether [`init_global_pool`] pinned rayon's global threads.
static GLOBAL_PINNED: AtomicBool = AtomicBool::new(false);

/// Builds rayon's global pool with one thread per available core, pinned
/// one per core (`core_affinity`), so every phase of a step (dense
/// projections, attention, experts) runs on the same pinned threads. Call
/// once, before anything uses rayon; returns false (and changes nothing) if
/// the global pool already exists.
pub fn init_global_pool() -> bool {
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    // RAYON_NUM_THREADS as rayon reads it; else one per core this process may use.
    let n = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // EPSERVE_PIN_THREADS=0 leaves them to the OS scheduler (hosts that share
    // the cores with other busy processes).
    let pin =
        !cores.is_empty() && std::env::var("EPSERVE_PIN_THREADS").map_or(true, |v| v.trim() != "0");
    let mut b = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("epserve-{i}"));
    if pin {
        b = b.start_handler(move |i| {
            if !core_affinity::set_for_current(cores[i % cores.len()]) {
                tracing::debug!(thread = i, "could not pin a worker thread");
            }
        });
    }
    let ok = b.build_global().is_ok();
    if ok {
        GLOBAL_PINNED.store(pin, Ordering::Relaxed);
    }
    ok
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
            pool: Threads::Own(pool),
            threads: n,
            pinned,
        })
    }

    /// The process-wide pool: rayon's global pool, which the dense phases
    /// use too (pinned one per core when [`init_global_pool`] built it).
    pub fn shared() -> Result<Arc<ExpertPool>> {
        static SHARED: OnceLock<Arc<ExpertPool>> = OnceLock::new();
        Ok(SHARED
            .get_or_init(|| {
                Arc::new(ExpertPool {
                    pool: Threads::Global,
                    threads: rayon::current_num_threads().max(1),
                    pinned: GLOBAL_PINNED.load(Ordering::Relaxed),
                })
            })
            .clone())
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
        match &self.pool {
            Threads::Own(p) => p.broadcast(|ctx| f(ctx.index())),
            Threads::Global => rayon::broadcast(|ctx| f(ctx.index())),
        }
    }

    /// Runs `f` inside the pool (its parallel iterators use these threads).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Threads::Own(p) => p.install(f),
            // Parallel iterators outside any pool use the global one.
            Threads::Global => f(),
        }
    }
}
