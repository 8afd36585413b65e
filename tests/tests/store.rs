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

/// A CA and leaf certificates for it, made at test time.
struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

impl TestCa {
    fn new(name: &str) -> TestCa {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("self-signed CA");
        TestCa {
            pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// (certificate PEM, key PEM) for `sans`, with common name `cn`.
    fn leaf(&self, cn: &str, sans: &[&str]) -> (String, String) {
        let mut params =
            rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        (cert.pem(), key.serialize_pem())
    }
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
    let ca = TestCa::new("epserve test CA");
    let (server_cert, server_key) = ca.leaf("etcd", &["127.0.0.1", "localhost"]);
    let (client_cert, client_key) = ca.leaf("epserve", &[]);
    let write = |name: &str, pem: &str| {
        let p = dir.join(name);
        std::fs::write(&p, pem).expect("write pem");
        p
    };
    let tls = EtcdTls {
        ca: write("ca.pem", &ca.pem),
        cert: write("etcd.pem", &server_cert),
        key: write("etcd-key.pem", &server_key),
    };
    let etcd = Etcd::start_tls(tls);
    let client = EtcdSecurity {
        ca_pem: Some(ca.pem.clone().into_bytes()),
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

    let other_ca = TestCa::new("another CA");
    let (stranger_cert, stranger_key) = other_ca.leaf("epserve", &[]);
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
                ca_pem: Some(other_ca.pem.clone().into_bytes()),
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
