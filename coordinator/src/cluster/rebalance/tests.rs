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

async fn placement(c: &Controller) -> Placement {
    c.state
        .placement()
        .await
        .expect("get")
        .expect("placement")
        .0
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
