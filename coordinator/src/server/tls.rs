//! HTTPS for the OpenAI server: rustls (ring provider) with HTTP/2 and
//! HTTP/1.1 offered over ALPN, and a certificate that is reloaded from its PEM
//! files when they change (checked every few seconds and on SIGHUP) without a
//! restart. A new pair that does not load (unparsable, key not matching the
//! certificate) is logged and the previous one stays in use.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;

/// Where the certificate chain and its key live, and how often to look for
/// changes.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// PEM certificate chain (leaf first).
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// How often the files' modification times are checked.
    pub reload_interval: Duration,
}

/// Loads a certificate chain and key from PEM files and checks that they
/// belong together.
pub fn load_certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| format!("{}: cannot read the certificate: {e}", cert.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: malformed PEM certificate: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate in the file", cert.display()));
    }
    let der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("{}: cannot read the private key: {e}", key.display()))?;
    let signer = rustls::crypto::ring::sign::any_supported_type(&der)
        .map_err(|e| format!("{}: unsupported private key: {e}", key.display()))?;
    let ck = CertifiedKey::new(chain, signer);
    ck.keys_match().map_err(|e| {
        format!(
            "{} and {}: the key does not match the certificate: {e}",
            cert.display(),
            key.display()
        )
    })?;
    Ok(ck)
}

/// The certificate resolver: one current certificate, swapped on reload.
#[derive(Debug)]
pub struct ReloadingCert {
    current: RwLock<Arc<CertifiedKey>>,
}

impl ReloadingCert {
    fn get(&self) -> Arc<CertifiedKey> {
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    fn set(&self, ck: Arc<CertifiedKey>) {
        match self.current.write() {
            Ok(mut g) => *g = ck,
            Err(p) => *p.into_inner() = ck,
        }
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.get())
    }
}

/// The TLS acceptor plus the resolver the reload task updates.
pub struct Tls {
    pub acceptor: TlsAcceptor,
    resolver: Arc<ReloadingCert>,
    files: TlsFiles,
}

/// Modification time and length of a file, to notice rewrites.
type Stamp = Option<(SystemTime, u64)>;

fn stamp(p: &Path) -> Stamp {
    let m = std::fs::metadata(p).ok()?;
    Some((m.modified().ok()?, m.len()))
}

impl Tls {
    /// Loads the files (an error here stops the server from starting) and
    /// builds a rustls server config offering h2 and http/1.1.
    pub fn new(files: TlsFiles) -> Result<Tls, String> {
        let ck = load_certified_key(&files.cert, &files.key)?;
        let resolver = Arc::new(ReloadingCert {
            current: RwLock::new(Arc::new(ck)),
        });
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_no_client_auth()
        .with_cert_resolver(resolver.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Tls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            resolver,
            files,
        })
    }

    /// Watches the files until `stop` fires: reloads when their modification
    /// time or length changes, or on SIGHUP.
    pub async fn watch(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        let f = &self.files;
        let mut seen = (stamp(&f.cert), stamp(&f.key));
        #[cfg(unix)]
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let mut tick = tokio::time::interval(f.reload_interval.max(Duration::from_millis(50)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            #[cfg(unix)]
            let hup_fut = async {
                match hup.as_mut() {
                    Some(h) => {
                        h.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            #[cfg(not(unix))]
            let hup_fut = std::future::pending::<()>();
            let forced = tokio::select! {
                _ = tick.tick() => false,
                _ = hup_fut => true,
                _ = stop.changed() => return,
            };
            let now = (stamp(&f.cert), stamp(&f.key));
            if !forced && now == seen {
                continue;
            }
            seen = now;
            match load_certified_key(&f.cert, &f.key) {
                Ok(ck) => {
                    self.resolver.set(Arc::new(ck));
                    tracing::info!(cert = %f.cert.display(), "TLS certificate reloaded");
                }
                Err(e) => {
                    tracing::warn!("TLS certificate not reloaded, keeping the previous one: {e}")
                }
            }
        }
    }
}
