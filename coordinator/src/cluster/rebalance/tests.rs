//! Unit tests of the rebalance state machine over the in-memory store: every
//! state in order, roll back, refusals, a coordinator restart.

use super::*;
use epserve_cluster::store::{KvStore, LeaseGuard, MemoryStore};
use epserve_proto::pb::Dtype;

fn ws(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("w{i}")).collect()
}

/// A controller over an in-memory store with two registered workers and
/// the initial placement of 4 experts in layer 0 (w0: 0, 2; w1: 1, 3).
async fn setup(timeout_ms: u64) -> (Arc<Controller>, Vec<LeaseGuard>) {
    setup_in(Arc::new(MemoryStore::new()), 2, timeout_ms).await
}

fn worker(w: &str) -> WorkerInfo {
    WorkerInfo {
        id: w.to_string(),
        role: "expert".into(),
        addr: format!("http://127.0.0.1:1/{w}"),
        cores: vec![0],
        memory_bytes: 0,
        shard: None,
        pid: 1,
    }
}

/// A controller over `store` with `n` registered workers `w0..` and the
/// initial placement of 4 experts in layer 0 (expert e on worker e mod n).
async fn setup_in(
    store: Arc<dyn KvStore>,
    n: usize,
    timeout_ms: u64,
) -> (Arc<Controller>, Vec<LeaseGuard>) {
    let state = ClusterState::new(store, "t");
    let mut guards = Vec::new();
    for w in ws(n) {
        guards.push(state.register(&worker(&w)).await.expect("register"));
    }
    let p = Placement::initial(&[0], 4, &ws(n)).expect("placement");
    state.init_placement(&p).await.expect("init");
    let d = Arc::new(GrpcDispatcher::new(
        tokio::runtime::Handle::current(),
        Route {
            placement: Arc::new(p),
            addrs: Default::default(),
        },
        Dtype::F32,
        Duration::from_secs(1),
        16,
        false,
    ));
    let c = Controller::new(state, d, vec![0], 4, 1, Duration::from_millis(timeout_ms));
    (Arc::new(c), guards)
}

/// w0 also gets a replica of expert 1.
const TARGET: &str = r#"{"version": 0, "workers": ["w0", "w1"],
    "layers": [{"layer": 0, "experts": [[0], [0, 1], [0], [1]]}]}"#;

#[tokio::test]
async fn apply_runs_every_state_when_workers_report_ready() {
    let (c, _g) = setup(5_000).await;
    // A worker stand-in: reports ready for every active rebalance, and
    // records the states it saw.
    let mut watch = c.state.watch_rebalance().await.expect("watch");
    let st = c.state.clone();
    let seen = tokio::spawn(async move {
        let mut seen = Vec::new();
        while let Some(doc) = watch.recv().await {
            let Some(doc) = doc else { continue };
            seen.push(doc.state);
            if doc.state.active() {
                st.report_ready("w0", &doc.id).await.expect("ready");
            }
            if !doc.state.active() {
                break;
            }
        }
        seen
    });
    let plan = c.plan_explicit(TARGET).await.expect("plan");
    let out = c.apply(plan, "test").await.expect("apply");
    assert_eq!(out.state, "done", "{out:?}");
    assert_eq!((out.from_version, out.to_version), (1, 2));
    let (p, _) = c.state.placement().await.expect("get").expect("placement");
    assert_eq!(p.version, 2);
    assert_eq!(p.layers[0].experts[1], vec![0, 1]);
    let route = c.dispatcher.route().expect("route");
    assert_eq!(route.placement.version, 2, "the dispatcher switched");
    let seen = seen.await.expect("join");
    use RebalanceState::*;
    assert_eq!(seen, vec![Proposed, Loading, Ready, Switched, Done]);
    // The same plan again changes nothing.
    let again = c.plan_explicit(TARGET).await.expect("plan");
    assert_eq!(
        c.apply(again, "test").await.expect("apply").state,
        "unchanged"
    );
}

#[tokio::test]
async fn apply_rolls_back_when_a_worker_never_gets_ready() {
    let (c, _g) = setup(300).await;
    let plan = c.plan_explicit(TARGET).await.expect("plan");
    let out = c.apply(plan, "test").await.expect("apply");
    assert_eq!(out.state, "rolled_back");
    assert!(out.message.contains("w0"), "{}", out.message);
    let (p, _) = c.state.placement().await.expect("get").expect("placement");
    assert_eq!(p.version, 1, "the old placement stays");
    assert_eq!(c.dispatcher.route().expect("route").placement.version, 1);
    let (doc, _) = c.state.rebalance().await.expect("get").expect("doc");
    assert_eq!(doc.state, RebalanceState::RolledBack);
}

#[tokio::test]
async fn refusals_are_specific() {
    let (c, _g) = setup(300).await;
    let bad = TARGET.replace("\"w1\"]", "\"w9\"]");
    assert!(matches!(
        c.plan_explicit(&bad).await,
        Err(RebalanceError::UnknownWorker(_))
    ));
    assert!(matches!(
        c.plan_explicit(r#"{"version": 0, "workers": ["w0"], "layers": []}"#)
            .await,
        Err(RebalanceError::Invalid(_))
    ));
    assert!(matches!(
        c.plan_drain("nobody").await,
        Err(RebalanceError::UnknownWorker(_))
    ));
    c.dispatcher.record_for_test(0, &[(0, "w0", 5)]);
    assert!(matches!(
        c.plan_rebalance(10, 3).await,
        Err(RebalanceError::OverCapacity(_))
    ));
    // An active rebalance left in etcd blocks a new one.
    let plan = c.plan_explicit(TARGET).await.expect("plan");
    let doc = Rebalance {
        id: "other".into(),
        state: RebalanceState::Loading,
        reason: "test".into(),
        from: plan.from.clone(),
        target: plan.from.clone(),
        message: String::new(),
        updated_ms: 0,
    };
    c.state.put_rebalance(&doc).await.expect("put");
    match c.apply(plan, "test").await {
        Err(RebalanceError::AlreadyRunning(m)) => assert!(m.contains("other"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn drained_workers_get_nothing_until_placed_explicitly() {
    let (c, _g) = setup(300).await;
    c.mark_drained("w1").await.expect("drain");
    assert!(matches!(
        c.plan_rebalance(1, 0).await,
        Err(RebalanceError::NoLoad(_))
    ));
    c.dispatcher.record_for_test(0, &[(0, "w0", 5)]);
    let plan = c.plan_rebalance(1, 0).await.expect("plan");
    assert!(
        plan.target.assigned_to("w1").is_empty(),
        "{:?}",
        plan.target
    );
    plan.target.validate(&[0], 4).expect("valid");
    let explicit = c.plan_explicit(TARGET).await.expect("plan");
    c.undrain_placed(&explicit.target).await.expect("undrain");
    assert!(c.state.drained().await.expect("drained").is_empty());
}

#[tokio::test]
async fn a_restarted_coordinator_rolls_back_before_the_switch_and_completes_after() {
    let (c, _g) = setup(300).await;
    let plan = c.plan_explicit(TARGET).await.expect("plan");
    let mut target = plan.target.clone();
    target.version = 2;
    let mut doc = Rebalance {
        id: "r".into(),
        state: RebalanceState::Ready,
        reason: "test".into(),
        from: plan.from.clone(),
        target: target.clone(),
        message: String::new(),
        updated_ms: 0,
    };
    c.state.put_rebalance(&doc).await.expect("put");
    let msg = c.resume().await.expect("resume").expect("a message");
    assert!(msg.contains("rolled back"), "{msg}");
    let (d, _) = c.state.rebalance().await.expect("get").expect("doc");
    assert_eq!(d.state, RebalanceState::RolledBack);
    // Crashed right after the placement swap.
    let (_, rev) = c.state.placement().await.expect("get").expect("placement");
    assert!(c.state.swap_placement(rev, &target).await.expect("swap"));
    doc.state = RebalanceState::Switched;
    c.state.put_rebalance(&doc).await.expect("put");
    let msg = c.resume().await.expect("resume").expect("a message");
    assert!(msg.contains("completed"), "{msg}");
    let (d, _) = c.state.rebalance().await.expect("get").expect("doc");
    assert_eq!(d.state, RebalanceState::Done);
    assert_eq!(
        c.resume().await.expect("resume"),
        None,
        "nothing left to do"
    );
}

#[test]
fn drain_moves_sole_replicas_and_drops_shared_ones() {
    let mut p = Placement::initial(&[0, 1], 5, &ws(3)).expect("placement");
    // Expert 0 of layer 0 also on w1 and w2.
    p.layers[0].experts[0] = vec![0, 1, 2];
    let loads = vec![vec![9.0, 1.0, 1.0, 1.0, 1.0], vec![1.0; 5]];
    let t = drain_plan(&p, 1, &[0, 2], &loads).expect("drain");
    t.validate(&[0, 1], 5).expect("valid");
    assert!(t.assigned_to("w1").is_empty(), "{t:?}");
    assert_eq!(t.layers[0].experts[0], vec![0, 2]);
    // Nothing else moved.
    for w in ["w0", "w2"] {
        assert!(p.assigned_to(w).is_subset(&t.assigned_to(w)));
    }
    assert!(matches!(
        drain_plan(&p, 1, &[], &loads),
        Err(RebalanceError::OverCapacity(_))
    ));
}

#[test]
fn estimate_and_same_assignment() {
    let p = Placement::initial(&[0], 4, &ws(2)).expect("placement");
    // w0 holds 0 and 2, w1 holds 1 and 3.
    let b = estimate(&p, &[vec![3.0, 1.0, 1.0, 1.0]]);
    assert!((b[0] - 3.0 / 4.0).abs() < 1e-12, "{b:?}");
    let mut q = p.clone();
    q.version = 7;
    assert!(same_assignment(&p, &q));
    q.workers.reverse();
    assert!(!same_assignment(&p, &q));
}

// The registry watch (`recover.rs`): lost workers, drain requests, returns.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use epserve_cluster::state::DrainRequest;
use epserve_cluster::store::{StoreError, StoreResult, Versioned};

/// Worker stand-ins: each worker in `live` reports ready for every active
/// rebalance that gives it new replicas (as a worker does once loaded).
fn stand_ins(state: ClusterState, live: Arc<Mutex<BTreeSet<String>>>) {
    tokio::spawn(async move {
        let Ok(mut watch) = state.watch_rebalance().await else {
            return;
        };
        while let Some(doc) = watch.recv().await {
            let Some(doc) = doc.filter(|d| d.state.active()) else {
                continue;
            };
            let who: Vec<String> = live
                .lock()
                .map(|l| l.iter().cloned().collect())
                .unwrap_or_default();
            for w in who {
                if doc.loading_workers().contains(&w) {
                    let _ = state.report_ready(&w, &doc.id).await;
                }
            }
        }
    });
}

fn live(ids: &[&str]) -> Arc<Mutex<BTreeSet<String>>> {
    Arc::new(Mutex::new(ids.iter().map(|s| s.to_string()).collect()))
}

/// A status sink that keeps its lines.
fn capture() -> (Status, Arc<Mutex<Vec<String>>>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let l2 = lines.clone();
    let status = Status::new(move |s| {
        if let Ok(mut l) = l2.lock() {
            l.push(s.to_string());
        }
    });
    (status, lines)
}

fn said(lines: &Mutex<Vec<String>>, what: &str) -> bool {
    lines
        .lock()
        .map(|l| l.iter().any(|s| s.contains(what)))
        .unwrap_or(false)
}

fn opts(recover_lost: bool) -> SuperviseOptions {
    SuperviseOptions {
        recover_lost,
        poll: Duration::from_millis(20),
        settle: Duration::ZERO,
        outage_grace: Duration::from_millis(300),
    }
}

async fn placement(c: &Controller) -> Placement {
    c.state
        .placement()
        .await
        .expect("get")
        .expect("placement")
        .0
}

/// True if every expert of `p` has a replica on one of `live` and none on `dead`.
fn served_by(p: &Placement, live: &[&str], dead: &str) -> bool {
    p.layers.iter().all(|l| {
        l.experts.iter().all(|reps| {
            let names: Vec<&str> = reps
                .iter()
                .filter_map(|&r| p.workers.get(r as usize).map(String::as_str))
                .collect();
            names.iter().any(|w| live.contains(w)) && !names.contains(&dead)
        })
    })
}

#[tokio::test]
async fn a_lost_worker_s_experts_move_to_the_survivors_and_come_back_when_it_returns() {
    let (c, mut g) = setup_in(Arc::new(MemoryStore::new()), 3, 5_000).await;
    // w0: 0, 3; w1: 1; w2: 2. Survivors load what they get and report ready.
    let ready = live(&["w0", "w2"]);
    stand_ins(c.state.clone(), ready.clone());
    let (status, lines) = capture();
    let mut s = Supervisor::new(opts(true));
    assert!(s.tick(&c, &status).await.expect("tick").is_none());

    // w1's lease expires.
    drop(g.remove(1));
    let t = Instant::now();
    let a = s
        .tick(&c, &status)
        .await
        .expect("tick")
        .expect("a recovery");
    assert_eq!(a.reason, "recover w1");
    assert_eq!(a.outcome.state, "done", "{:?}", a.outcome);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let p = placement(&c).await;
    assert_eq!(p.version, 2);
    assert!(p.assigned_to("w1").is_empty(), "{p:?}");
    assert!(served_by(&p, &["w0", "w2"], "w1"), "{p:?}");
    assert_eq!(
        p.layers[0].experts[1],
        vec![2],
        "to the least-loaded survivor"
    );
    assert_eq!(c.dispatcher.route().expect("route").placement.version, 2);
    assert!(
        said(&lines, "recover") || said(&lines, "w1 lost"),
        "{lines:?}"
    );
    let (doc, _) = c.state.rebalance().await.expect("get").expect("doc");
    assert_eq!(doc.reason, "recover w1");
    assert!(c.state.drained().await.expect("drained").is_empty());
    // Nothing more to do.
    assert!(s.tick(&c, &status).await.expect("tick").is_none());

    // w1 restarts with the same id: it gets a share back, once.
    g.push(c.state.register(&worker("w1")).await.expect("register"));
    if let Ok(mut l) = ready.lock() {
        l.insert("w1".into());
    }
    let a = s.tick(&c, &status).await.expect("tick").expect("a return");
    assert_eq!(a.reason, "return w1");
    assert_eq!(a.outcome.state, "done", "{:?}", a.outcome);
    let p = placement(&c).await;
    assert_eq!(p.assigned_to("w1").len(), 1, "{p:?}");
    assert_eq!(p.counts().iter().max(), Some(&2), "{p:?}");
    p.validate(&[0], 4).expect("valid");
    assert!(s.tick(&c, &status).await.expect("tick").is_none());
    assert_eq!(placement(&c).await.version, 3);
}

#[tokio::test]
async fn a_rebalance_waiting_for_a_vanished_worker_rolls_back_at_once() {
    let (c, mut g) = setup(60_000).await;
    let plan = c.plan_explicit(TARGET).await.expect("plan");
    let c2 = c.clone();
    let run = tokio::spawn(async move { c2.apply(plan, "test").await });
    // Wait (bounded) until it waits for w0 to load expert 1.
    for _ in 0..200 {
        if let Ok(Some((d, _))) = c.state.rebalance().await
            && d.state == RebalanceState::Loading
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let t = Instant::now();
    drop(g.remove(0));
    let out = tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .expect("rolled back well before the 60 s timeout")
        .expect("join")
        .expect("apply");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(out.state, "rolled_back", "{out:?}");
    assert!(
        out.message.contains("w0") && out.message.contains("no longer registered"),
        "{}",
        out.message
    );
    assert_eq!(placement(&c).await.version, 1);
}

#[tokio::test]
async fn an_active_rebalance_waiting_for_a_lost_worker_gives_way_to_the_recovery() {
    let (c, mut g) = setup_in(Arc::new(MemoryStore::new()), 3, 60_000).await;
    stand_ins(c.state.clone(), live(&["w0", "w2"]));
    let (status, _lines) = capture();
    // An operator's rebalance that gives w1 a replica of expert 0; w1 dies.
    let target = r#"{"version": 0, "workers": ["w0", "w1", "w2"],
        "layers": [{"layer": 0, "experts": [[0, 1], [1], [2], [0]]}]}"#;
    let plan = c.plan_explicit(target).await.expect("plan");
    let c2 = c.clone();
    let run = tokio::spawn(async move { c2.apply(plan, "set-placement").await });
    for _ in 0..200 {
        if let Ok(Some((d, _))) = c.state.rebalance().await
            && d.state == RebalanceState::Loading
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let t = Instant::now();
    drop(g.remove(1));
    let mut s = Supervisor::new(opts(true));
    let mut action = None;
    while action.is_none() && t.elapsed() < Duration::from_secs(5) {
        match s.tick(&c, &status).await {
            Ok(a) => action = a,
            Err(RebalanceError::AlreadyRunning(_)) => {}
            Err(e) => panic!("{e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a = action.expect("a recovery within 5 s");
    assert_eq!(a.reason, "recover w1");
    assert_eq!(a.outcome.state, "done", "{:?}", a.outcome);
    let out = run.await.expect("join").expect("apply");
    assert_eq!(out.state, "rolled_back", "{out:?}");
    let p = placement(&c).await;
    assert!(served_by(&p, &["w0", "w2"], "w1"), "{p:?}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[tokio::test]
async fn a_drain_request_is_honoured_and_cleared_and_the_worker_returns() {
    let (c, mut g) = setup(5_000).await;
    stand_ins(c.state.clone(), live(&["w0", "w1"]));
    let (status, lines) = capture();
    let mut s = Supervisor::new(opts(true));
    let req = DrainRequest {
        requested_ms: 1,
        reason: "SIGTERM".into(),
    };
    c.state.request_drain("w1", &req).await.expect("request");
    let a = s.tick(&c, &status).await.expect("tick").expect("a drain");
    assert_eq!(a.reason, "drain w1 (SIGTERM)");
    assert_eq!(a.outcome.state, "done", "{:?}", a.outcome);
    let p = placement(&c).await;
    assert!(p.assigned_to("w1").is_empty(), "{p:?}");
    assert_eq!(
        desired_for(&c, "w1").await,
        BTreeSet::new(),
        "the worker may exit"
    );
    assert!(c.state.drain_requests().await.expect("requests").is_empty());
    assert!(
        !c.state.drained().await.expect("drained").contains("w1"),
        "a SIGTERM drain is not a ctl drain"
    );
    // Still registered and empty, but not a return: left alone.
    assert!(s.tick(&c, &status).await.expect("tick").is_none());
    assert_eq!(placement(&c).await.version, 2);

    // It exits (deregisters) and restarts: its share comes back.
    drop(g.remove(1));
    assert!(s.tick(&c, &status).await.expect("tick").is_none());
    g.push(c.state.register(&worker("w1")).await.expect("register"));
    let a = s.tick(&c, &status).await.expect("tick").expect("a return");
    assert_eq!(a.reason, "return w1");
    assert_eq!(placement(&c).await.assigned_to("w1").len(), 2);

    // A request from a worker that holds nothing, or is gone, is just cleared.
    c.state.request_drain("w9", &req).await.expect("request");
    assert!(s.tick(&c, &status).await.expect("tick").is_none());
    assert!(c.state.drain_requests().await.expect("requests").is_empty());

    // The last worker cannot be drained: said, and the request dropped.
    drop(g.remove(1));
    // (w1 is gone with 2 experts: recovery moves them to w0 first.)
    let a = s
        .tick(&c, &status)
        .await
        .expect("tick")
        .expect("a recovery");
    assert_eq!(a.reason, "recover w1");
    c.state.request_drain("w0", &req).await.expect("request");
    assert!(s.tick(&c, &status).await.expect("tick").is_none());
    assert!(c.state.drain_requests().await.expect("requests").is_empty());
    assert!(said(&lines, "cannot drain w0"), "{lines:?}");
    assert_eq!(placement(&c).await.assigned_to("w0").len(), 4);
}

async fn desired_for(c: &Controller, w: &str) -> BTreeSet<(usize, usize)> {
    let p = placement(c).await;
    let r = c.state.rebalance().await.expect("get").map(|(d, _)| d);
    epserve_cluster::state::desired_experts(w, Some(&p), r.as_ref())
}

#[tokio::test]
async fn a_ctl_drained_worker_stays_empty_when_it_returns() {
    let (c, mut g) = setup(5_000).await;
    stand_ins(c.state.clone(), live(&["w0"]));
    let (status, _lines) = capture();
    let mut s = Supervisor::new(opts(true));
    let plan = c.plan_drain("w1").await.expect("plan");
    assert_eq!(
        c.apply(plan, "drain w1").await.expect("apply").state,
        "done"
    );
    c.mark_drained("w1").await.expect("mark");
    assert!(s.tick(&c, &status).await.expect("tick").is_none());
    drop(g.remove(1));
    assert!(s.tick(&c, &status).await.expect("tick").is_none());
    g.push(c.state.register(&worker("w1")).await.expect("register"));
    assert!(s.tick(&c, &status).await.expect("tick").is_none());
    assert!(placement(&c).await.assigned_to("w1").is_empty());
    assert_eq!(placement(&c).await.version, 2);
}

#[tokio::test]
async fn with_recovery_off_a_lost_worker_is_only_reported() {
    let (c, mut g) = setup(5_000).await;
    let (status, lines) = capture();
    let mut s = Supervisor::new(opts(false));
    drop(g.remove(1));
    assert!(s.tick(&c, &status).await.expect("tick").is_none());
    assert!(s.tick(&c, &status).await.expect("tick").is_none());
    assert_eq!(placement(&c).await.version, 1);
    let n = lines.lock().map(|l| l.len()).unwrap_or(0);
    assert_eq!(n, 1, "said once: {lines:?}");
    assert!(said(&lines, "recover-lost-experts=false"), "{lines:?}");
}

/// A store that fails every call (`down`) or only listings (`lists_down`,
/// the registry read) on demand.
#[derive(Clone, Default)]
struct Flaky {
    inner: MemoryStore,
    down: Arc<AtomicBool>,
    lists_down: Arc<AtomicBool>,
}

impl Flaky {
    fn check(&self) -> StoreResult<()> {
        if self.down.load(Ordering::SeqCst) {
            return Err(StoreError::Other("unreachable (test)".into()));
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl KvStore for Flaky {
    async fn get(&self, key: &str) -> StoreResult<Option<Versioned>> {
        self.check()?;
        self.inner.get(key).await
    }
    async fn put(&self, key: &str, value: Vec<u8>) -> StoreResult<()> {
        self.check()?;
        self.inner.put(key, value).await
    }
    async fn create(&self, key: &str, value: Vec<u8>) -> StoreResult<bool> {
        self.check()?;
        self.inner.create(key, value).await
    }
    async fn compare_and_swap(&self, key: &str, rev: i64, value: Vec<u8>) -> StoreResult<bool> {
        self.check()?;
        self.inner.compare_and_swap(key, rev, value).await
    }
    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.check()?;
        self.inner.delete(key).await
    }
    async fn list(&self, prefix: &str) -> StoreResult<Vec<(String, Vec<u8>)>> {
        self.check()?;
        if self.lists_down.load(Ordering::SeqCst) {
            return Err(StoreError::Other("list failed (test)".into()));
        }
        self.inner.list(prefix).await
    }
    async fn put_leased(
        &self,
        key: &str,
        value: Vec<u8>,
        ttl_secs: i64,
    ) -> StoreResult<LeaseGuard> {
        self.check()?;
        self.inner.put_leased(key, value, ttl_secs).await
    }
    async fn watch(&self, key: &str) -> StoreResult<tokio::sync::mpsc::Receiver<Option<Vec<u8>>>> {
        self.check()?;
        self.inner.watch(key).await
    }
}

#[tokio::test]
async fn nothing_changes_while_the_store_cannot_be_read() {
    let store = Flaky::default();
    let (c, mut g) = setup_in(Arc::new(store.clone()), 2, 5_000).await;
    stand_ins(c.state.clone(), live(&["w0"]));
    let (status, _lines) = capture();
    let mut s = Supervisor::new(opts(true));
    assert!(s.tick(&c, &status).await.expect("tick").is_none());
    // The registry read fails: not an empty registry, nothing is lost.
    store.lists_down.store(true, Ordering::SeqCst);
    for _ in 0..3 {
        assert!(matches!(
            s.tick(&c, &status).await,
            Err(RebalanceError::Unavailable(_))
        ));
    }
    // w1 dies while nothing can be read.
    store.down.store(true, Ordering::SeqCst);
    drop(g.remove(1));
    for _ in 0..3 {
        assert!(matches!(
            s.tick(&c, &status).await,
            Err(RebalanceError::Unavailable(_))
        ));
    }
    store.down.store(false, Ordering::SeqCst);
    store.lists_down.store(false, Ordering::SeqCst);
    assert_eq!(placement(&c).await.version, 1, "no change while unreadable");
    // Readable again: a missing worker is given the grace to register again...
    let t = Instant::now();
    assert!(s.tick(&c, &status).await.expect("tick").is_none());
    assert_eq!(placement(&c).await.version, 1, "no change within the grace");
    // ...then the recovery runs.
    tokio::time::sleep(Duration::from_millis(300).saturating_sub(t.elapsed())).await;
    let a = s
        .tick(&c, &status)
        .await
        .expect("tick")
        .expect("a recovery");
    assert_eq!(a.reason, "recover w1");
    assert_eq!(a.outcome.state, "done", "{:?}", a.outcome);
}

#[test]
fn a_join_takes_a_fair_share_from_the_fullest_workers() {
    // 3 workers, 7 experts: w0: 0, 1, 2, 3; w1: 4, 5; w2: 6; w3 returns.
    let mut p = Placement::initial(&[0], 7, &ws(4)).expect("placement");
    p.layers[0].experts = vec![
        vec![0],
        vec![0],
        vec![0],
        vec![0],
        vec![1],
        vec![1],
        vec![2],
    ];
    let loads = vec![vec![1.0, 8.0, 1.0, 1.0, 1.0, 1.0, 1.0]];
    let t = join_plan(&p, "w3", &loads);
    t.validate(&[0], 7).expect("valid");
    let counts = t.counts();
    assert_eq!(counts.iter().max(), Some(&2), "{counts:?}");
    assert!(counts[3] >= 1, "{counts:?}");
    // Only moves to w3.
    for w in ["w0", "w1", "w2"] {
        assert!(t.assigned_to(w).is_subset(&p.assigned_to(w)), "{t:?}");
    }
    // A new id joins at the end of the worker list.
    let t = join_plan(&p, "w9", &loads);
    assert_eq!(t.workers.last().map(String::as_str), Some("w9"));
    assert!(!t.assigned_to("w9").is_empty());
}

#[test]
fn recover_lost_experts_is_on_by_default_and_can_be_turned_off() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        eplb: crate::cluster::EplbArgs,
    }
    let parse = |args: &[&str]| {
        Cli::try_parse_from(std::iter::once("coordinator").chain(args.iter().copied()))
            .map(|c| c.eplb.recover_lost_experts)
    };
    assert_eq!(parse(&[]).ok(), Some(true));
    assert_eq!(parse(&["--recover-lost-experts"]).ok(), Some(true));
    assert_eq!(parse(&["--recover-lost-experts=false"]).ok(), Some(false));
    assert_eq!(parse(&["--recover-lost-experts=true"]).ok(), Some(true));
    assert!(parse(&["--recover-lost-experts=maybe"]).is_err());
}

#[tokio::test]
async fn a_stale_drain_request_does_not_keep_a_returning_worker_empty() {
    let (c, mut g) = setup(5_000).await;
    stand_ins(c.state.clone(), live(&["w0", "w1"]));
    let (status, _lines) = capture();
    let mut s = Supervisor::new(opts(true));
    drop(g.remove(1));
    let a = s
        .tick(&c, &status)
        .await
        .expect("tick")
        .expect("a recovery");
    assert_eq!(a.reason, "recover w1");
    // Its request from before the crash is still there when it is back.
    let req = DrainRequest {
        requested_ms: 1,
        reason: String::new(),
    };
    c.state.request_drain("w1", &req).await.expect("request");
    g.push(c.state.register(&worker("w1")).await.expect("register"));
    let a = s.tick(&c, &status).await.expect("tick").expect("a return");
    assert_eq!(a.reason, "return w1");
    assert!(c.state.drain_requests().await.expect("requests").is_empty());
    assert_eq!(placement(&c).await.assigned_to("w1").len(), 2);
}

/// A precision change is a placement change: only the workers whose
/// replicas change precision load (and are waited for); the switch records
/// the int8 experts in the placement.
#[tokio::test]
async fn a_precision_change_goes_through_the_state_machine() {
    let (c, _g) = setup(5_000).await;
    let c = Arc::new(
        Arc::try_unwrap(c)
            .ok()
            .expect("one owner")
            .with_precision_policy(Some(0.6)),
    );
    assert_eq!(c.precision_policy(), Some(0.6));
    // No load yet: nothing to decide.
    assert!(c.plan_precision().await.expect("plan").is_none());
    // Expert 0 (w0) takes 60 % of the tokens, expert 1 (w1) 30 %, expert
    // 2 (w0) 10 %, expert 3 none: bf16 {0}, int8 {1, 2, 3}.
    c.dispatcher
        .record_for_test(0, &[(0, "w0", 60), (1, "w1", 30), (2, "w0", 10)]);
    let plan = c.plan_precision().await.expect("plan").expect("a change");
    assert_eq!(plan.target.layers[0].int8, vec![1, 2, 3]);
    assert_eq!(plan.target.layers[0].experts, plan.from.layers[0].experts);
    let doc = Rebalance {
        id: "x".into(),
        state: RebalanceState::Proposed,
        reason: "precision".into(),
        from: plan.from.clone(),
        target: plan.target.clone(),
        message: String::new(),
        updated_ms: 0,
    };
    assert_eq!(
        doc.loading_workers(),
        vec!["w0", "w1"],
        "both change precision"
    );
    // Both workers report ready: the plan is applied.
    let mut watch = c.state.watch_rebalance().await.expect("watch");
    let st = c.state.clone();
    let workers = tokio::spawn(async move {
        while let Some(doc) = watch.recv().await {
            let Some(doc) = doc else { continue };
            if !doc.state.active() {
                break;
            }
            for w in ["w0", "w1"] {
                st.report_ready(w, &doc.id).await.expect("ready");
            }
        }
    });
    let out = c.apply(plan, "precision").await.expect("apply");
    assert_eq!(out.state, "done", "{out:?}");
    workers.await.expect("join");
    let (p, _) = c.state.placement().await.expect("get").expect("placement");
    assert_eq!(
        p.int8_experts(),
        [(0, 1), (0, 2), (0, 3)].into_iter().collect()
    );
    // The window restarted with the placement: nothing to decide again.
    assert!(c.plan_precision().await.expect("plan").is_none());
    // Load that the int8 set in force still covers within the slack keeps
    // it; load that moved to an int8 expert brings expert 1 back to bf16.
    c.dispatcher
        .record_for_test(0, &[(0, "w0", 58), (1, "w1", 42)]);
    assert!(
        c.plan_precision().await.expect("plan").is_none(),
        "58 % ≥ 0.6 − slack"
    );
    c.dispatcher.record_for_test(0, &[(1, "w1", 40)]);
    let plan = c.plan_precision().await.expect("plan").expect("a change");
    assert_eq!(plan.target.layers[0].int8, vec![2, 3]);
    let doc = Rebalance {
        target: plan.target.clone(),
        from: plan.from.clone(),
        ..doc
    };
    assert_eq!(doc.loading_workers(), vec!["w1"], "only expert 1 changes");
    // An EPLB plan carries the policy's int8 experts too.
    let eplb = c.plan_rebalance(0, 0).await.expect("plan");
    assert_eq!(eplb.target.int8_experts(), plan.target.int8_experts());
}
