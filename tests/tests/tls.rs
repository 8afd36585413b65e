//! Mutual TLS on the node links (issue 18): `epserve up --secure` makes a CA
//! and a certificate per role and runs every gRPC link over mutual TLS; the
//! cluster must serve the fixture goldens, and every TLS port (expert-worker,
//! attention-worker, admin) must refuse a plaintext client, a client without
//! a certificate and one whose certificate comes from another CA, and go on
//! serving good clients afterwards. A worker whose certificate does not name
//! the address it registered is refused by the client the coordinator uses
//! (in-process server: the handshake fails naming the certificate).
//!
//! Needs `etcd` on PATH for the cluster test; skipped without it unless
//! `EPSERVE_REQUIRE_ETCD=1`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use epserve_cluster::state::ClusterState;
use epserve_cluster::store::{EtcdSecurity, EtcdStore};
use epserve_cluster::tls::{NodeTls, NodeTlsArgs, endpoint};
use epserve_proto::pb::admin_service_client::AdminServiceClient;
use epserve_proto::pb::attention_service_client::AttentionServiceClient;
use epserve_proto::pb::expert_service_client::ExpertServiceClient;
use epserve_proto::pb::{HealthRequest, ListWorkersRequest};
use epserve_tests::up::{Up, etcd_available};
use epserve_tests::{assert_goldens, fixture_dir};
use epserve_tools::pki::Ca;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// Every call of a refused client must fail within this.
const LIMIT: Duration = Duration::from_secs(10);

/// `up`'s certificate directory, from its "certificates in DIR" line.
fn tls_dir(up: &Up) -> PathBuf {
    let log = up.log.lock().unwrap_or_else(|e| e.into_inner());
    log.lines
        .iter()
        .find_map(|(_, l)| {
            l.split_once("(certificates in ")
                .and_then(|(_, d)| d.strip_suffix(')'))
                .map(PathBuf::from)
        })
        .expect("up --secure names its certificate directory")
}

fn node_tls(dir: &Path, name: &str) -> NodeTls {
    NodeTlsArgs {
        tls_cert: Some(dir.join(format!("{name}.pem"))),
        tls_key: Some(dir.join(format!("{name}-key.pem"))),
        tls_ca: Some(dir.join("ca.pem")),
    }
    .load()
    .expect("load certificates")
    .expect("TLS on")
}

fn host_port(addr: &str) -> &str {
    addr.split_once("://").map_or(addr, |(_, r)| r)
}

/// The clients a node must refuse: plaintext, TLS without a client
/// certificate, TLS with a client certificate from another CA. Each trusts
/// the right CA for the server's certificate, so only the client side is
/// wrong.
fn strangers(addr: &str, ca_pem: &[u8]) -> Vec<(&'static str, Endpoint)> {
    let hp = host_port(addr);
    let plain = Endpoint::from_shared(format!("http://{hp}")).expect("url");
    let tls = |cfg: ClientTlsConfig| {
        Endpoint::from_shared(format!("https://{hp}"))
            .expect("url")
            .tls_config(cfg.domain_name("127.0.0.1"))
            .expect("tls")
    };
    let no_cert = tls(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem)));
    let other = Ca::new("another CA").expect("CA");
    let leaf = other.issue("stranger", &["127.0.0.1"]).expect("leaf");
    let other_ca = tls(ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .identity(Identity::from_pem(&leaf.cert_pem, &leaf.key_pem)));
    vec![
        ("plaintext", plain),
        ("no client certificate", no_cert),
        ("certificate from another CA", other_ca),
    ]
}

/// Connects (bounded) and makes one call with `call`; the error, if any.
async fn try_call<F, Fut>(ep: Endpoint, call: F) -> Result<(), String>
where
    F: FnOnce(Channel) -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::Status>>,
{
    let ep = ep
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(5));
    let attempt = async {
        let ch = ep
            .connect()
            .await
            .map_err(|e| epserve_cluster::tls::error_chain(&e))?;
        call(ch)
            .await
            .map_err(|s| epserve_cluster::tls::status_why(&s))
    };
    match tokio::time::timeout(LIMIT, attempt).await {
        Ok(r) => r,
        Err(_) => Err("timed out".into()),
    }
}

async fn expert_health(ch: Channel) -> Result<(), tonic::Status> {
    ExpertServiceClient::new(ch)
        .health(HealthRequest::default())
        .await
        .map(|_| ())
}

async fn attention_health(ch: Channel) -> Result<(), tonic::Status> {
    AttentionServiceClient::new(ch)
        .health(HealthRequest::default())
        .await
        .map(|_| ())
}

async fn admin_list(ch: Channel) -> Result<(), tonic::Status> {
    AdminServiceClient::new(ch)
        .list_workers(ListWorkersRequest {})
        .await
        .map(|_| ())
}

/// `epserve up --secure`: goldens over mutual TLS on every node link, then
/// strangers refused on each TLS port, which keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_cluster_serves_goldens_and_refuses_strangers() {
    if !etcd_available() {
        return;
    }
    let fixture = "qwen3_moe_b";
    let model = fixture_dir(fixture).join("f32");
    let model = model.to_str().expect("utf-8 fixture path");
    let up = Up::start(
        env!("CARGO_BIN_EXE_epserve-it"),
        &[
            "--model",
            model,
            "--expert-workers",
            "2",
            "--attention-workers",
            "1",
            "--port",
            "0",
            "--dispatch-dtype",
            "f32",
            "--served-model-name",
            "tiny",
            "--secure",
        ],
        false,
    );
    assert_goldens(&up.url, "tiny", fixture).await;

    // The workers registered https:// addresses.
    let dir = tls_dir(&up);
    let ca_pem = std::fs::read(dir.join("ca.pem")).expect("ca.pem");
    // etcd is on TLS with client certificates and auth: plaintext, a
    // certificate without the password, and a wrong password are refused;
    // the roles' credentials work.
    let read = |n: &str| std::fs::read(dir.join(n)).unwrap_or_else(|e| panic!("{n}: {e}"));
    let password = String::from_utf8(read("etcd-password")).expect("utf-8 password");
    let etcd_ok = EtcdSecurity {
        ca_pem: Some(read("ca.pem")),
        identity: Some((read("etcd-client.pem"), read("etcd-client-key.pem"))),
        user: Some(("epserve".into(), password)),
    };
    for (what, sec) in [
        ("plaintext", EtcdSecurity::default()),
        (
            "no password",
            EtcdSecurity {
                user: None,
                ..etcd_ok.clone()
            },
        ),
        (
            "a wrong password",
            EtcdSecurity {
                user: Some(("epserve".into(), "guess".into())),
                ..etcd_ok.clone()
            },
        ),
    ] {
        let r = tokio::time::timeout(
            Duration::from_secs(30),
            EtcdStore::connect_secure(&up.etcd, &sec),
        )
        .await
        .unwrap_or_else(|_| panic!("etcd, {what}: no answer"));
        if what == "no password" {
            // TLS with a good certificate connects (etcd then takes the
            // certificate's common name as the user, which has no role):
            // reading the cluster's keys is refused.
            if let Ok(s) = r {
                let st = ClusterState::new(Arc::new(s), &format!("local-{}", up.child.id()));
                assert!(
                    st.workers("expert").await.is_err(),
                    "etcd, {what}: read allowed"
                );
            }
            continue;
        }
        assert!(r.is_err(), "etcd, {what}: connected");
    }
    let store = EtcdStore::connect_secure(&up.etcd, &etcd_ok)
        .await
        .expect("etcd with the roles' credentials");
    let state = ClusterState::new(Arc::new(store), &format!("local-{}", up.child.id()));
    let experts = state.workers("expert").await.expect("expert-workers");
    let attention = state.workers("attention").await.expect("attention-workers");
    assert_eq!(
        (experts.len(), attention.len()),
        (2, 1),
        "{experts:?} {attention:?}"
    );
    for w in experts.iter().chain(&attention) {
        assert!(w.addr.starts_with("https://"), "{w:?}");
    }

    // A good client (the ctl certificate) on every port.
    let good = node_tls(&dir, "ctl");
    let ep = |addr: &str| endpoint(addr, Some(&good)).expect("endpoint");
    let expert = experts[0].addr.clone();
    let shard = attention[0].addr.clone();
    let admin = up.admin.clone();
    try_call(ep(&expert), expert_health)
        .await
        .expect("expert-worker over mTLS");
    try_call(ep(&shard), attention_health)
        .await
        .expect("attention-worker over mTLS");
    try_call(ep(&admin), admin_list)
        .await
        .expect("admin over mTLS");

    // Strangers refused, the port serving the good client afterwards.
    for (port, addr) in [
        ("expert-worker", &expert),
        ("attention-worker", &shard),
        ("admin", &admin),
    ] {
        for (who, stranger) in strangers(addr, &ca_pem) {
            let r = match port {
                "expert-worker" => try_call(stranger, expert_health).await,
                "attention-worker" => try_call(stranger, attention_health).await,
                _ => try_call(stranger, admin_list).await,
            };
            let e = r
                .err()
                .unwrap_or_else(|| panic!("{port} accepted a client with {who}"));
            eprintln!("{port} refused a client with {who}: {e}");
        }
        let r = match port {
            "expert-worker" => try_call(ep(addr), expert_health).await,
            "attention-worker" => try_call(ep(addr), attention_health).await,
            _ => try_call(ep(addr), admin_list).await,
        };
        r.unwrap_or_else(|e| panic!("{port} stopped serving after the strangers: {e}"));
    }

    // `epserve ctl` with the flags `up` printed.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_epserve-it"))
        .args(["ctl", "--admin", &admin])
        .args(good_flags(&dir, "ctl"))
        .args(["--json", "workers"])
        .output()
        .expect("run ctl");
    assert!(
        out.status.success(),
        "ctl over mTLS: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_epserve-it"))
        .args(["ctl", "--admin", &admin, "workers"])
        .output()
        .expect("run ctl");
    assert!(!out.status.success(), "plaintext ctl accepted");
    let printed = {
        let log = up.log.lock().unwrap_or_else(|e| e.into_inner());
        log.lines
            .iter()
            .any(|(_, l)| l.contains("epserve ctl --admin") && l.contains("--tls-ca"))
    };
    assert!(printed, "up prints the ctl command with its --tls-* flags");

    // The cluster still serves after all of it.
    assert_goldens(&up.url, "tiny", fixture).await;
}

fn good_flags(dir: &Path, name: &str) -> Vec<String> {
    NodeTlsArgs {
        tls_cert: Some(dir.join(format!("{name}.pem"))),
        tls_key: Some(dir.join(format!("{name}-key.pem"))),
        tls_ca: Some(dir.join("ca.pem")),
    }
    .to_flags()
}

/// A gRPC server (grpc.health.v1) with `leaf`'s certificate, requiring
/// client certificates from `ca`; its address.
async fn health_server(dir: &Path, ca: &Ca, name: &str, sans: &[&str]) -> String {
    let args = ca.write_leaf(dir, name, sans).expect("leaf");
    let tls = args.load().expect("load").expect("TLS on");
    let (_, health) = tonic_health::server::health_reporter();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = epserve_cluster::tls::server_builder(Some(&tls))
        .expect("server TLS")
        .add_service(health)
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(server);
    format!("https://{addr}")
}

async fn check(ch: Channel) -> Result<(), tonic::Status> {
    tonic_health::pb::health_client::HealthClient::new(ch)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .map(|_| ())
}

/// The SAN check of the coordinator's client ([`endpoint`]): a worker
/// registered at 127.0.0.1 is trusted only if its certificate names
/// 127.0.0.1 (an IP SAN), one registered at `localhost` only with that
/// DNS SAN; a certificate for another name is refused at the handshake,
/// saying so. Connections stalled before their handshake block no one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_certificate_for_another_name_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let ca = Ca::new("test CA").expect("CA");
    let client = ca
        .write_leaf(dir.path(), "coordinator", &["127.0.0.1"])
        .expect("leaf")
        .load()
        .expect("load")
        .expect("TLS on");
    let right = health_server(dir.path(), &ca, "right", &["127.0.0.1", "localhost"]).await;
    let wrong = health_server(dir.path(), &ca, "wrong", &["worker-7.example", "10.9.8.7"]).await;
    try_call(endpoint(&right, Some(&client)).expect("ep"), check)
        .await
        .expect("a certificate naming 127.0.0.1 is trusted");
    let by_name = right.replace("127.0.0.1", "localhost");
    try_call(endpoint(&by_name, Some(&client)).expect("ep"), check)
        .await
        .expect("a certificate naming localhost is trusted at localhost");
    let e = try_call(endpoint(&wrong, Some(&client)).expect("ep"), check)
        .await
        .expect_err("a certificate for another name is refused");
    assert!(
        e.contains("certificate") && e.contains("name"),
        "the error says why: {e}"
    );
    eprintln!("a certificate for another name: {e}");
    // The same server is trusted by no name it lacks, even on the same
    // address registered as `localhost`.
    let wrong_by_name = wrong.replace("127.0.0.1", "localhost");
    assert!(
        try_call(endpoint(&wrong_by_name, Some(&client)).expect("ep"), check)
            .await
            .is_err()
    );
    // A peer that opens connections and never says anything holds up no
    // one: handshakes run concurrently, each bounded.
    let mut stalled = Vec::new();
    for _ in 0..20 {
        stalled.push(
            tokio::net::TcpStream::connect(right.trim_start_matches("https://"))
                .await
                .expect("tcp"),
        );
    }
    // And the right server still serves.
    try_call(endpoint(&right, Some(&client)).expect("ep"), check)
        .await
        .expect("still serving");
    drop(stalled);
}

/// Every role takes the same three flags and stops at once, naming what is
/// wrong, when only some are given or a file is not PEM.
#[test]
fn every_role_checks_its_tls_flags_before_starting() {
    let dir = tempfile::tempdir().expect("tmp");
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not PEM\n").expect("write");
    let junk = junk.to_str().expect("utf-8");
    let model = fixture_dir("qwen3_moe_a").join("f32");
    let model = model.to_str().expect("utf-8");
    let roles: [&[&str]; 4] = [
        &["expert-worker", "--model", model, "--etcd", "127.0.0.1:1"],
        &[
            "attention-worker",
            "--model",
            model,
            "--etcd",
            "127.0.0.1:1",
            "--shard",
            "0",
            "--of",
            "1",
        ],
        &["coordinator", "--model", model, "--etcd", "127.0.0.1:1"],
        &["ctl", "--admin", "127.0.0.1:1"],
    ];
    for role in roles {
        for (flags, want) in [
            (
                vec!["--tls-cert", junk],
                "missing --tls-key, --tls-ca".to_string(),
            ),
            (
                vec!["--tls-cert", junk, "--tls-key", junk, "--tls-ca", junk],
                format!("--tls-cert {junk}: no CERTIFICATE"),
            ),
        ] {
            let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_epserve-it"));
            cmd.args(role).args(&flags);
            if role[0] == "ctl" {
                cmd.arg("placement");
            }
            let out = cmd.output().expect("run");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{role:?} {flags:?} started");
            assert!(err.contains(&want), "{role:?} {flags:?}: {err}");
        }
    }
}
