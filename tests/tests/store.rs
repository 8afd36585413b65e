//! The `KvStore` conformance suite (`epserve_cluster::store::conformance`)
//! against a real etcd; the in-memory backend runs the same suite in
//! `epserve-cluster`'s unit tests.

use std::time::Duration;

use epserve_cluster::store::{EtcdStore, conformance};
use epserve_tests::up::{Etcd, etcd_available};
use epserve_tools::pki::Ca;

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

/// etcd over TLS with client-certificate auth and user/password auth on
/// (what `epserve up --secure` and the chart run): the store passes the
/// conformance suite as a user limited to `/epserve/`, and every client
/// without the right certificate, CA or password is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_tls_and_auth_serves_only_trusted_clients() {
    use epserve_cluster::store::{EtcdSecurity, KvStore};
    use epserve_tests::up::EtcdTls;
    if !etcd_available() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("epserve-etcd-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("cert dir");
    let ca = Ca::new("epserve test CA").expect("CA");
    let leaf = |name: &str, sans: &[&str]| {
        let l = ca.issue(name, sans).expect("certificate");
        (l.cert_pem, l.key_pem)
    };
    let (server_cert, server_key) = leaf("etcd", &["127.0.0.1", "localhost"]);
    let (client_cert, client_key) = leaf("epserve", &[]);
    let write = |name: &str, pem: &str| {
        let p = dir.join(name);
        std::fs::write(&p, pem).expect("write pem");
        p
    };
    let tls = EtcdTls {
        ca: write("ca.pem", ca.cert_pem()),
        cert: write("etcd.pem", &server_cert),
        key: write("etcd-key.pem", &server_key),
    };
    let etcd = Etcd::start_tls(tls);
    let client = EtcdSecurity {
        ca_pem: Some(ca.cert_pem().as_bytes().to_vec()),
        identity: Some((
            client_cert.clone().into_bytes(),
            client_key.clone().into_bytes(),
        )),
        user: None,
    };
    // Bootstrap (auth still off): retried while etcd starts.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match EtcdStore::enable_auth(&etcd.addr, &client, "root-pw", "epserve", "pw", "/epserve/")
            .await
        {
            Ok(()) => break,
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("etcd not ready: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("cannot enable auth: {e}"),
        }
    }
    let good = EtcdSecurity {
        user: Some(("epserve".into(), "pw".into())),
        ..client.clone()
    };
    let store = EtcdStore::connect_secure(&etcd.addr, &good)
        .await
        .expect("the trusted client connects");
    conformance::run_all(&store, "/epserve/conformance/")
        .await
        .expect("etcd answers every call over TLS with auth");
    // The user's role covers /epserve/ only.
    let outside = store.put("/other/key", b"x".to_vec()).await;
    assert!(
        outside.is_err(),
        "a write outside /epserve/ must be refused"
    );

    let other_ca = Ca::new("another CA").expect("CA");
    let stranger = other_ca.issue("epserve", &[]).expect("certificate");
    let (stranger_cert, stranger_key) = (stranger.cert_pem, stranger.key_pem);
    let refused: Vec<(&str, EtcdSecurity)> = vec![
        ("plaintext", EtcdSecurity::default()),
        (
            "TLS without a client certificate",
            EtcdSecurity {
                identity: None,
                ..good.clone()
            },
        ),
        (
            "a client certificate from another CA",
            EtcdSecurity {
                identity: Some((stranger_cert.into_bytes(), stranger_key.into_bytes())),
                ..good.clone()
            },
        ),
        (
            "a server verified against another CA",
            EtcdSecurity {
                ca_pem: Some(other_ca.cert_pem().as_bytes().to_vec()),
                ..good.clone()
            },
        ),
        (
            "a wrong password",
            EtcdSecurity {
                user: Some(("epserve".into(), "wrong".into())),
                ..good.clone()
            },
        ),
        (
            "an unknown user",
            EtcdSecurity {
                user: Some(("mallory".into(), "pw".into())),
                ..good.clone()
            },
        ),
    ];
    for (what, sec) in refused {
        let r = tokio::time::timeout(
            Duration::from_secs(30),
            EtcdStore::connect_secure(&etcd.addr, &sec),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within 30 s"));
        match r {
            Ok(_) => panic!("{what}: connected, must be refused"),
            Err(e) => eprintln!("{what}: refused: {e}"),
        }
    }
    // The trusted client still works after the refusals.
    store
        .put("/epserve/after", b"y".to_vec())
        .await
        .expect("still serving");
    let _ = std::fs::remove_dir_all(&dir);
}
