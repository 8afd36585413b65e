//! HTTPS on the OpenAI server with certificates made at test time (rcgen):
//! HTTP/1.1 and h2 over ALPN, the certificate reloaded after its files are
//! rewritten (the client sees the new serial and name), a broken rewrite
//! keeps the old certificate, and plaintext to the TLS port fails cleanly
//! while the server keeps serving. No model is loaded: `/health` answers
//! 503 "loading", which is enough to prove the HTTP layer works.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use epserve_coordinator::server::tls::TlsFiles;
use epserve_coordinator::server::{self, AppState, HttpOptions, ServerConfig};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SerialNumber};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

struct Ca {
    pem: String,
    der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

fn ca() -> Ca {
    let key = KeyPair::generate().expect("key");
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = p.self_signed(&key).expect("ca");
    Ca {
        pem: cert.pem(),
        der: cert.der().clone(),
        issuer: Issuer::new(p, key),
    }
}

/// A leaf for `names` with `serial`, written to `dir`/server.{crt,key};
/// returns its DER.
fn write_leaf(ca: &Ca, dir: &Path, names: &[&str], serial: u64) -> CertificateDer<'static> {
    let key = KeyPair::generate().expect("key");
    let mut p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .expect("params");
    p.serial_number = Some(SerialNumber::from(serial));
    let cert = p.signed_by(&key, &ca.issuer).expect("leaf");
    // Key first, then the certificate: the watcher sees a matching pair last.
    std::fs::write(dir.join("server.key"), key.serialize_pem()).expect("write key");
    std::fs::write(dir.join("server.crt"), cert.pem()).expect("write cert");
    cert.der().clone()
}

fn start(dir: &Path) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    std_listener.set_nonblocking(true).expect("nonblocking");
    let addr = std_listener.local_addr().expect("addr");
    let listener = tokio::net::TcpListener::from_std(std_listener).expect("listener");
    let state = AppState::new(ServerConfig::new(vec!["tiny".into()]));
    let opts = HttpOptions {
        tls: Some(TlsFiles {
            cert: dir.join("server.crt"),
            key: dir.join("server.key"),
            reload_interval: Duration::from_millis(100),
        }),
        ..HttpOptions::default()
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let r = server::serve_until(listener, state, opts, async {
            let _ = rx.await;
        })
        .await;
        assert!(r.is_ok(), "{r:?}");
    });
    (addr, tx)
}

fn client(ca: &Ca, addr: SocketAddr, http1_only: bool) -> reqwest::Client {
    let mut b = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(ca.pem.as_bytes()).expect("ca pem"))
        .resolve("localhost", addr)
        .timeout(Duration::from_secs(10));
    if http1_only {
        b = b.http1_only();
    }
    b.build().expect("client")
}

/// The certificate the server presents in a fresh handshake.
async fn presented(ca: &Ca, addr: SocketAddr) -> CertificateDer<'static> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der.clone()).expect("root");
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("localhost").expect("name"), tcp)
        .await
        .expect("handshake");
    tls.get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first().cloned())
        .expect("peer certificate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_h1_h2_reload_and_plaintext() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = ca();
    let first = write_leaf(&ca, dir.path(), &["localhost"], 1);
    let (addr, stop) = start(dir.path());
    let url = format!("https://localhost:{}/health", addr.port());

    // HTTP/1.1 and h2 (ALPN), both answered by the router.
    let r = client(&ca, addr, true).get(&url).send().await.expect("h1");
    assert_eq!(r.version(), reqwest::Version::HTTP_11);
    assert_eq!(r.status().as_u16(), 503);
    assert!(r.text().await.expect("body").contains("loading"));
    let r = client(&ca, addr, false).get(&url).send().await.expect("h2");
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(presented(&ca, addr).await, first);

    // Plaintext HTTP to the TLS port: no HTTP answer, the connection ends.
    let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tcp.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .expect("write");
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the server must close a plaintext connection");
    assert!(!buf.starts_with(b"HTTP/"), "no HTTP answer over plaintext");
    let r = client(&ca, addr, true)
        .get(&url)
        .send()
        .await
        .expect("after plaintext");
    assert_eq!(r.status().as_u16(), 503);

    // Rewrite the files: a new serial and name are picked up without a restart.
    let second = write_leaf(&ca, dir.path(), &["localhost", "api.example.test"], 2);
    let t0 = Instant::now();
    loop {
        if presented(&ca, addr).await == second {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the rewritten certificate was not picked up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = client(&ca, addr, false)
        .get(&url)
        .send()
        .await
        .expect("after reload");
    assert_eq!(r.status().as_u16(), 503);

    // A broken rewrite is refused: the previous certificate stays in use.
    std::fs::write(dir.path().join("server.crt"), "not a certificate").expect("write");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(presented(&ca, addr).await, second);
    let r = client(&ca, addr, true)
        .get(&url)
        .send()
        .await
        .expect("after broken");
    assert_eq!(r.status().as_u16(), 503);
    let _ = stop.send(());
}

#[test]
fn mismatched_key_is_refused_at_load() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = ca();
    write_leaf(&ca, dir.path(), &["localhost"], 1);
    let other = KeyPair::generate().expect("key");
    std::fs::write(dir.path().join("server.key"), other.serialize_pem()).expect("write");
    let e = server::tls::load_certified_key(
        &dir.path().join("server.crt"),
        &dir.path().join("server.key"),
    )
    .expect_err("must fail");
    assert!(e.contains("does not match"), "{e}");
    let e = server::tls::load_certified_key(&dir.path().join("nope.crt"), &dir.path().join("x"))
        .expect_err("must fail");
    assert!(e.contains("nope.crt"), "{e}");
}
