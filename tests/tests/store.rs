//! The `KvStore` conformance suite (`epserve_cluster::store::conformance`)
//! against a real etcd; the in-memory backend runs the same suite in
//! `epserve-cluster`'s unit tests.

use std::time::Duration;

use epserve_cluster::store::{EtcdStore, conformance};
use epserve_tests::up::{Etcd, etcd_available};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_store_passes_the_conformance_suite() {
    if !etcd_available() {
        return;
    }
    let etcd = Etcd::start();
    let store = EtcdStore::connect_within(&etcd.addr, Duration::from_secs(20))
        .await
        .expect("connect to the test etcd");
    conformance::run_all(&store, "/conformance/")
        .await
        .expect("etcd answers every call");
}
