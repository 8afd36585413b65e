//! The controller's watch over the expert-worker registry ([`Controller::supervise`]):
//! a background task that, every poll, reads the placement in force, the
//! registry, the drained set, the drain requests and the rebalance document,
//! and runs at most one rebalance through the state machine:
//!
//! 1. **Lost workers** (`--recover-lost-experts`, on by default): a worker
//!    that holds experts in the placement but is no longer registered (its
//!    lease expired) has its experts re-placed on the registered, undrained
//!    workers ([`Controller::plan_recover`], reason `recover <workers>`).
//!    Experts with another live replica just drop the dead one; the dead
//!    worker is never waited for (it loads nothing).
//! 2. **Drain requests** (a worker's SIGTERM): its experts move away
//!    ([`Controller::plan_drain`], reason `drain <id> (SIGTERM)`) and the
//!    request is deleted once its share is empty. A request that cannot be
//!    honoured (no capacity, the last worker) is reported and deleted; the
//!    worker gives up waiting by itself. Such a drain does not put the
//!    worker in the drained set, so it gets experts back when it returns.
//! 3. **Returning workers**: a worker that (re)registers, holds nothing and
//!    is not in the drained set (`ctl drain` keeps a worker empty until an
//!    explicit placement names it) gets a fair share of every layer moved
//!    to it ([`Controller::plan_join`], reason `return <id>`), once per
//!    return.
//!
//! Nothing is done while a rebalance is active (the admin's, automatic
//! EPLB's or this task's: one at a time), and nothing while the store cannot
//! be read: a failed read is retried at the next poll, never taken for an
//! empty registry. Once the store is readable again, workers missing from the
//! registry get one lease TTL to register again before they count as lost.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use epserve_cluster::runtime::Status;
use epserve_cluster::state::{DrainRequest, Rebalance, WORKER_TTL_SECS, WorkerInfo};
use epserve_core::eplb;
use epserve_core::placement::{LayerPlacement, Placement};

use super::{Controller, Outcome, Plan, RebalanceError, Res, drain_plan, estimate, store_err};

/// How [`Controller::supervise`] runs.
#[derive(Debug, Clone)]
pub struct SuperviseOptions {
    /// Re-place the experts of workers whose lease expired.
    pub recover_lost: bool,
    /// Time between two looks at the registry.
    pub poll: Duration,
    /// How long a (re)registered worker must stay registered before it is
    /// given experts (a worker that is on its way out does not get any).
    pub settle: Duration,
    /// After the store could not be read, how long it must be readable
    /// again before a worker missing from the registry counts as lost
    /// (workers whose lease lapsed meanwhile register again first).
    pub outage_grace: Duration,
}

impl Default for SuperviseOptions {
    fn default() -> Self {
        SuperviseOptions {
            recover_lost: true,
            poll: Duration::from_millis(250),
            settle: Duration::from_secs(1),
            outage_grace: Duration::from_secs(WORKER_TTL_SECS.max(1) as u64),
        }
    }
}

/// What one [`Supervisor::tick`] did.
#[derive(Debug, Clone)]
pub struct Action {
    /// The rebalance reason: `recover w1`, `drain w1 (SIGTERM)`, `return w1`.
    pub reason: String,
    pub outcome: Outcome,
}

/// The state [`Controller::supervise`] keeps between polls.
#[derive(Debug)]
pub struct Supervisor {
    opts: SuperviseOptions,
    /// The registry at the last successful read: id → (address, pid).
    seen: Option<BTreeMap<String, (String, u32)>>,
    /// Workers that (re)registered, and when.
    arrivals: BTreeMap<String, Instant>,
    /// The last message said per subject, to say each refusal once.
    said: BTreeMap<String, String>,
    /// When a read of the store last failed.
    unreadable_at: Option<Instant>,
}

/// What one tick reads, all or nothing.
struct Snapshot {
    placement: Placement,
    registered: Vec<WorkerInfo>,
    drained: BTreeSet<String>,
    requests: Vec<(String, DrainRequest)>,
    rebalance: Option<Rebalance>,
}

async fn read(c: &Controller) -> Res<Snapshot> {
    Ok(Snapshot {
        placement: c.current().await?.0,
        registered: c.registered().await?,
        drained: c.state.drained().await.map_err(store_err)?,
        requests: c.state.drain_requests().await.map_err(store_err)?,
        rebalance: c
            .state
            .rebalance()
            .await
            .map_err(store_err)?
            .map(|(d, _)| d),
    })
}

/// `expert-worker a` or `expert-workers a, b`.
fn workers_label(ids: &[String]) -> String {
    let s = if ids.len() == 1 { "" } else { "s" };
    format!("expert-worker{s} {}", ids.join(", "))
}

fn retry_later(e: &RebalanceError) -> bool {
    matches!(
        e,
        RebalanceError::AlreadyRunning(_) | RebalanceError::Unavailable(_)
    )
}

impl Supervisor {
    /// A supervisor that has seen nothing yet.
    pub fn new(opts: SuperviseOptions) -> Self {
        Supervisor {
            opts,
            seen: None,
            arrivals: BTreeMap::new(),
            said: BTreeMap::new(),
            unreadable_at: None,
        }
    }

    /// Says `msg` about `subject` unless it was the last thing said about it.
    fn say_once(&mut self, status: &Status, subject: &str, msg: String) {
        if self.said.get(subject) != Some(&msg) {
            tracing::warn!(subject, "{msg}");
            status.say(&format!("epserve coordinator: {msg}"));
            self.said.insert(subject.to_string(), msg);
        }
    }

    fn report(&mut self, status: &Status, subject: &str, what: &str, o: &Outcome, t: Instant) {
        let msg = format!(
            "{what}: rebalance {} {} in {:.2} s (v{} → v{}){}",
            o.id,
            o.state,
            t.elapsed().as_secs_f64(),
            o.from_version,
            o.to_version,
            if o.message.is_empty() {
                String::new()
            } else {
                format!(": {}", o.message)
            }
        );
        tracing::info!(subject, "{msg}");
        status.say(&format!("epserve coordinator: {msg}"));
        self.said.remove(subject);
    }

    /// One look at the cluster; runs at most one rebalance (and waits for
    /// it). `Err` when it should look again later: the store could not be
    /// read (nothing was done) or a rebalance was started meanwhile.
    pub async fn tick(&mut self, c: &Controller, status: &Status) -> Res<Option<Action>> {
        let Snapshot {
            placement,
            registered,
            drained,
            requests,
            rebalance,
        } = match read(c).await {
            Ok(s) => s,
            Err(e) => {
                self.unreadable_at = Some(Instant::now());
                return Err(e);
            }
        };
        let active = rebalance.is_some_and(|d| d.state.active());

        // Who (re)registered since the last look.
        let now: BTreeMap<String, (String, u32)> = registered
            .iter()
            .map(|w| (w.id.clone(), (w.addr.clone(), w.pid)))
            .collect();
        for (id, v) in &now {
            if self.seen.as_ref().and_then(|s| s.get(id)) != Some(v) {
                self.arrivals.insert(id.clone(), Instant::now());
            }
        }
        self.arrivals.retain(|id, _| now.contains_key(id));
        self.seen = Some(now);
        if active {
            return Ok(None);
        }
        let live: BTreeSet<&str> = registered.iter().map(|w| w.id.as_str()).collect();
        let counts = placement.counts();

        // 1. Workers that hold experts but are gone.
        let lost: Vec<String> = placement
            .workers
            .iter()
            .zip(&counts)
            .filter(|(w, n)| **n > 0 && !live.contains(w.as_str()))
            .map(|(w, _)| w.clone())
            .collect();
        let regrouping = self
            .unreadable_at
            .is_some_and(|t| t.elapsed() < self.opts.outage_grace);
        if !lost.is_empty() && regrouping {
            tracing::debug!(
                ?lost,
                "workers missing right after the store was unreachable; waiting for them to register again"
            );
        } else if !lost.is_empty() {
            let label = workers_label(&lost);
            let ids = lost.join(", ");
            if !self.opts.recover_lost {
                self.say_once(
                    status,
                    "recover",
                    format!(
                        "{label} gone (lease expired) holding experts; not re-placing them (--recover-lost-experts=false)"
                    ),
                );
            } else {
                let reason = format!("recover {ids}");
                let t = Instant::now();
                let res = match c.plan_recover(&lost).await {
                    Ok(plan) => c.apply(plan, &reason).await,
                    Err(e) => Err(e),
                };
                match res {
                    Ok(o) => {
                        self.report(
                            status,
                            "recover",
                            &format!("{label} lost (lease expired), its experts re-placed"),
                            &o,
                            t,
                        );
                        return Ok(Some(Action { reason, outcome: o }));
                    }
                    Err(e) if retry_later(&e) => return Err(e),
                    Err(e) => self.say_once(
                        status,
                        "recover",
                        format!("{label} gone (lease expired) holding experts; cannot re-place them: {e}"),
                    ),
                }
            }
        }

        // 2. Drain requests (SIGTERM).
        for (id, req) in &requests {
            let why = if req.reason.is_empty() {
                "requested"
            } else {
                req.reason.as_str()
            };
            let holds = placement
                .workers
                .iter()
                .zip(&counts)
                .any(|(w, n)| w == id && *n > 0);
            let done_msg = if !live.contains(id.as_str()) {
                Some(format!(
                    "drain request of {id} dropped: it is no longer registered"
                ))
            } else if !holds {
                // (Left a returning worker: a request from its previous
                // life must not keep it empty; one on its way out holds
                // nothing and deregisters within the settle time.)
                Some(format!(
                    "drain request of {id} ({why}) cleared: it holds no experts"
                ))
            } else {
                None
            };
            if let Some(msg) = done_msg {
                c.state.clear_drain_request(id).await.map_err(store_err)?;
                tracing::info!(worker = %id, "{msg}");
                status.say(&format!("epserve coordinator: {msg}"));
                continue;
            }
            // A draining worker is not a returning one.
            self.arrivals.remove(id);
            let reason = format!("drain {id} ({why})");
            let t = Instant::now();
            let res = match c.plan_drain(id).await {
                Ok(plan) => c.apply(plan, &reason).await,
                Err(e) => Err(e),
            };
            match res {
                Ok(o) => {
                    let what = format!("drain of {id} asked by the worker ({why})");
                    self.report(status, id, &what, &o, t);
                    if o.state == "done" || o.state == "unchanged" {
                        c.state.clear_drain_request(id).await.map_err(store_err)?;
                    }
                    return Ok(Some(Action { reason, outcome: o }));
                }
                Err(e) if retry_later(&e) => return Err(e),
                Err(e) => {
                    self.say_once(
                        status,
                        id,
                        format!("cannot drain {id} as it asked ({why}): {e}; request dropped, the worker stops waiting by itself"),
                    );
                    c.state.clear_drain_request(id).await.map_err(store_err)?;
                }
            }
        }

        // 3. Workers that came back holding nothing.
        let due: Vec<String> = self
            .arrivals
            .iter()
            .filter(|(_, t)| t.elapsed() >= self.opts.settle)
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            if drained.contains(&id) || !placement.assigned_to(&id).is_empty() {
                self.arrivals.remove(&id);
                continue;
            }
            let reason = format!("return {id}");
            let t = Instant::now();
            let res = match c.plan_join(&id).await {
                Ok(plan) => c.apply(plan, &reason).await,
                Err(e) => Err(e),
            };
            match res {
                Ok(o) => {
                    self.arrivals.remove(&id);
                    self.report(
                        status,
                        &id,
                        &format!(
                            "expert-worker {id} registered holding nothing, experts moved to it"
                        ),
                        &o,
                        t,
                    );
                    return Ok(Some(Action { reason, outcome: o }));
                }
                Err(e) if retry_later(&e) => return Err(e),
                Err(e) => {
                    self.arrivals.remove(&id);
                    self.say_once(
                        status,
                        &id,
                        format!("expert-worker {id} registered holding nothing; cannot give it experts: {e}"),
                    );
                }
            }
        }
        Ok(None)
    }
}

/// Moves replicas of `layer` to worker `to` (which holds none of them yet
/// in this layer) from the workers holding the most, until no worker holds
/// more than one replica more than `to`; each move takes the donor's expert
/// that best evens the two workers' measured load.
fn join_layer(layer: &mut LayerPlacement, loads: &[f64], workers: usize, to: usize) {
    let ld = |e: usize| loads.get(e).copied().unwrap_or(0.0);
    loop {
        let mut cnt = vec![0usize; workers];
        for reps in &layer.experts {
            for &r in reps {
                if let Some(c) = cnt.get_mut(r as usize) {
                    *c += 1;
                }
            }
        }
        let wl = eplb::worker_loads(layer, loads, workers);
        let Some(donor) = (0..workers)
            .filter(|&w| w != to)
            .max_by(|&a, &b| cnt[a].cmp(&cnt[b]).then(wl[a].total_cmp(&wl[b])))
        else {
            return;
        };
        if cnt[donor] <= cnt[to] + 1 {
            return;
        }
        let best = layer
            .experts
            .iter()
            .enumerate()
            .filter(|(_, reps)| reps.contains(&(donor as u32)) && !reps.contains(&(to as u32)))
            .map(|(e, reps)| {
                // The replica's share of the expert's load moves with it.
                let x = ld(e) / reps.len().max(1) as f64;
                (e, ((wl[donor] - x) - (wl[to] + x)).abs())
            })
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
            .map(|(e, _)| e);
        let Some(e) = best else { return };
        let reps = &mut layer.experts[e];
        reps.retain(|&r| r as usize != donor);
        reps.push(to as u32);
        reps.sort_unstable();
    }
}

/// `from` with worker `to` given a fair share of every layer (see [`join_layer`]).
pub fn join_plan(from: &Placement, to: &str, loads: &[Vec<f64>]) -> Placement {
    let mut target = from.clone();
    let idx = match target.workers.iter().position(|w| w == to) {
        Some(i) => i,
        None => {
            target.workers.push(to.to_string());
            target.workers.len() - 1
        }
    };
    let n = target.workers.len();
    for (i, l) in target.layers.iter_mut().enumerate() {
        let empty = Vec::new();
        join_layer(l, loads.get(i).unwrap_or(&empty), n, idx);
    }
    target
}

impl Controller {
    /// Plans re-placing the experts of `lost` workers (gone from the
    /// registry) on the registered, undrained workers; replicas a lost
    /// worker shared are just dropped.
    pub async fn plan_recover(&self, lost: &[String]) -> Res<Plan> {
        let (from, _) = self.current().await?;
        let registered = self.registered().await?;
        let drained = self.state.drained().await.map_err(store_err)?;
        let mut target = from.clone();
        // Registered workers the placement never named can take experts too.
        for w in &registered {
            if !drained.contains(&w.id) && !target.workers.contains(&w.id) {
                target.workers.push(w.id.clone());
            }
        }
        let remaining: Vec<usize> = target
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| {
                !lost.contains(w) && !drained.contains(*w) && registered.iter().any(|r| &r.id == *w)
            })
            .map(|(i, _)| i)
            .collect();
        let loads = self.loads();
        for w in lost {
            if let Some(gone) = target.workers.iter().position(|x| x == w) {
                target = drain_plan(&target, gone, &remaining, &loads)?;
            }
        }
        self.check_memory(&target, &registered)?;
        Ok(Plan {
            current: estimate(&from, &loads),
            predicted: estimate(&target, &loads),
            from,
            target,
        })
    }

    /// Plans giving registered worker `worker`, which holds nothing, a fair
    /// share of every layer (by count, then by measured load).
    pub async fn plan_join(&self, worker: &str) -> Res<Plan> {
        let (from, _) = self.current().await?;
        let registered = self.registered().await?;
        if !registered.iter().any(|w| w.id == worker) {
            return Err(RebalanceError::UnknownWorker(format!(
                "worker {worker} is not registered"
            )));
        }
        if self
            .state
            .drained()
            .await
            .map_err(store_err)?
            .contains(worker)
        {
            return Err(RebalanceError::Invalid(format!(
                "worker {worker} is drained: only an explicit placement gives it experts"
            )));
        }
        let loads = self.loads();
        let target = join_plan(&from, worker, &loads);
        self.check_memory(&target, &registered)?;
        Ok(Plan {
            current: estimate(&from, &loads),
            predicted: estimate(&target, &loads),
            from,
            target,
        })
    }

    /// The registry watch (see the module docs): polls until the process
    /// ends; each rebalance it runs or cannot run is a `status` line.
    pub async fn supervise(self: std::sync::Arc<Self>, opts: SuperviseOptions, status: Status) {
        let poll = opts.poll;
        let mut s = Supervisor::new(opts);
        let mut failing = false;
        loop {
            match s.tick(&self, &status).await {
                Ok(_) => {
                    if std::mem::take(&mut failing) {
                        tracing::info!("registry watch: the cluster state is readable again");
                    }
                }
                Err(e @ RebalanceError::AlreadyRunning(_)) => {
                    tracing::debug!(error = %e, "registry watch: a rebalance is running; later");
                }
                Err(e) => {
                    if !std::mem::replace(&mut failing, true) {
                        tracing::warn!(error = %e, "registry watch: cannot act now (no placement change until the cluster state is readable); retrying");
                    }
                }
            }
            tokio::time::sleep(poll).await;
        }
    }
}
