//! Mutual TLS on the node links (coordinator ↔ expert-workers and
//! attention-workers, `epserve ctl` → the admin service): the flags every
//! role shares ([`NodeTlsArgs`]), the PEM files checked at start
//! ([`NodeTls`]), and the tonic server and client configurations built from
//! them. The handshakes are tonic's own rustls (ring provider).
//!
//! - A server requires a client certificate issued by `--tls-ca`: a peer
//!   without one, or with one from another CA, is refused at the handshake.
//! - A client verifies the server certificate against `--tls-ca` *and* the
//!   host of the address it dials (a worker's address as registered in
//!   etcd): a DNS name must be among the certificate's DNS SANs, an IP
//!   address among its IP SANs. A worker registered under a name its
//!   certificate does not carry is not trusted.
//! - With TLS on, addresses are dialled as `https://` whatever scheme they
//!   were registered with (tonic would silently skip TLS on `http://`), so
//!   a plaintext peer fails the handshake.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// How long a TLS handshake may take, on either side: a peer that stalls
/// in it is dropped.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// `--tls-cert --tls-key --tls-ca`: mutual TLS on the node links, the same
/// three flags on every role (flattened into each role's arguments).
#[derive(Debug, Clone, Default, Args, PartialEq, Eq)]
pub struct NodeTlsArgs {
    /// Mutual TLS on the node links: this node's certificate chain (PEM).
    /// Servers present it; clients present it as their client certificate.
    /// Needs --tls-key and --tls-ca (all three or none).
    #[arg(long, env = "EPSERVE_TLS_CERT", value_name = "PATH")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "EPSERVE_TLS_KEY", value_name = "PATH")]
    pub tls_key: Option<PathBuf>,
    /// The CA (PEM) that issued every node's certificate: servers require
    /// client certificates from it, clients require it of servers (whose
    /// certificate must also name the host they are dialled at).
    #[arg(long, env = "EPSERVE_TLS_CA", value_name = "PATH")]
    pub tls_ca: Option<PathBuf>,
}

impl NodeTlsArgs {
    /// Whether any of the three flags is given.
    pub fn any(&self) -> bool {
        self.tls_cert.is_some() || self.tls_key.is_some() || self.tls_ca.is_some()
    }

    /// The files read and checked: `None` without the flags, an error when
    /// only some are given or a file cannot be read or parsed (naming it).
    pub fn load(&self) -> Result<Option<NodeTls>> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => NodeTls::from_files(cert, key, ca).map(Some),
            _ => {
                let missing: Vec<&str> = [
                    ("--tls-cert", self.tls_cert.is_none()),
                    ("--tls-key", self.tls_key.is_none()),
                    ("--tls-ca", self.tls_ca.is_none()),
                ]
                .into_iter()
                .filter_map(|(f, m)| m.then_some(f))
                .collect();
                bail!(
                    "node-link TLS needs --tls-cert, --tls-key and --tls-ca together (or none of them); missing {}",
                    missing.join(", ")
                )
            }
        }
    }

    /// The flags as a command line passes them on (`epserve up` to the
    /// roles it starts, the commands it prints).
    pub fn to_flags(&self) -> Vec<String> {
        let mut v = Vec::new();
        for (flag, p) in [
            ("--tls-cert", &self.tls_cert),
            ("--tls-key", &self.tls_key),
            ("--tls-ca", &self.tls_ca),
        ] {
            if let Some(p) = p {
                v.push(flag.to_string());
                v.push(p.display().to_string());
            }
        }
        v
    }
}

/// The node's identity and the cluster CA, read and checked.
#[derive(Clone)]
pub struct NodeTls {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    ca_pem: Vec<u8>,
}

impl std::fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeTls { .. }")
    }
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {what} {}", path.display()))
}

fn certs(pem: &[u8], path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("{what} {}: not PEM: {e}", path.display()))?;
    if certs.is_empty() {
        bail!("{what} {}: no CERTIFICATE in the PEM file", path.display());
    }
    Ok(certs)
}

impl NodeTls {
    /// Reads the three PEM files and checks them: certificates parse, the
    /// key is one rustls can sign with and matches the certificate, the CA
    /// certificates are usable trust anchors.
    pub fn from_files(cert: &Path, key: &Path, ca: &Path) -> Result<Self> {
        let cert_pem = read(cert, "--tls-cert")?;
        let key_pem = read(key, "--tls-key")?;
        let ca_pem = read(ca, "--tls-ca")?;
        Self::from_pem(cert_pem, key_pem, ca_pem, [cert, key, ca])
    }

    fn from_pem(
        cert_pem: Vec<u8>,
        key_pem: Vec<u8>,
        ca_pem: Vec<u8>,
        [cert, key, ca]: [&Path; 3],
    ) -> Result<Self> {
        let chain = certs(&cert_pem, cert, "--tls-cert")?;
        let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
            anyhow::anyhow!(
                "--tls-key {}: no usable PEM private key: {e}",
                key.display()
            )
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let signer = provider
            .key_provider
            .load_private_key(key_der)
            .map_err(|e| anyhow::anyhow!("--tls-key {}: {e}", key.display()))?;
        let ck = rustls::sign::CertifiedKey::new(chain, signer);
        ck.keys_match().map_err(|e| {
            anyhow::anyhow!(
                "--tls-cert {} and --tls-key {} do not go together: {e}",
                cert.display(),
                key.display()
            )
        })?;
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(&ca_pem, ca, "--tls-ca")? {
            roots
                .add(c)
                .map_err(|e| anyhow::anyhow!("--tls-ca {}: {e}", ca.display()))?;
        }
        Ok(NodeTls {
            cert_pem,
            key_pem,
            ca_pem,
        })
    }

    fn identity(&self) -> Identity {
        Identity::from_pem(&self.cert_pem, &self.key_pem)
    }

    fn ca(&self) -> Certificate {
        Certificate::from_pem(&self.ca_pem)
    }

    /// A server's configuration: this identity, client certificates from
    /// the CA required, handshakes bounded by [`HANDSHAKE_TIMEOUT`] (tonic
    /// runs them concurrently, off the accept loop).
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(self.ca())
            .client_auth_optional(false)
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// A client's configuration for a server that must present a
    /// certificate for `host` (a DNS name or an IP address) from the CA.
    pub fn client_config(&self, host: &str) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(self.ca())
            .identity(self.identity())
            .domain_name(host)
            .timeout(HANDSHAKE_TIMEOUT)
    }
}

/// Longest a node gRPC server works on one call before answering
/// DEADLINE_EXCEEDED (the coordinator's own deadlines are shorter: this only
/// bounds a call nobody waits for any more).
pub const SERVER_CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// A node gRPC server builder (workers, admin) with `tls` applied (none:
/// plaintext) and the limits every node server has: at most 256 concurrent
/// h2 streams and 64 calls in progress per connection, calls bounded by
/// [`SERVER_CALL_TIMEOUT`], HTTP/2 and TCP keep-alives so a vanished peer's
/// connection is closed, and the TLS handshake bounded.
pub fn server_builder(tls: Option<&NodeTls>) -> Result<tonic::transport::Server> {
    let b = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(256))
        .concurrency_limit_per_connection(64)
        .timeout(SERVER_CALL_TIMEOUT)
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(20)))
        .tcp_keepalive(Some(std::time::Duration::from_secs(60)));
    match tls {
        None => Ok(b),
        Some(t) => b
            .tls_config(t.server_config())
            .context("cannot configure the gRPC server's TLS"),
    }
}

/// The host part of a node address: `host:port`, `[v6]:port` or a URL
/// (`http://host:port/...`), brackets removed.
pub fn address_host(addr: &str) -> Option<&str> {
    let rest = addr.split_once("://").map_or(addr, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split_once(']').map(|(h, _)| h).filter(|h| !h.is_empty());
    }
    let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
    (!host.is_empty()).then_some(host)
}

/// The URL a node address is dialled at: `https://` with TLS, `http://`
/// without, whatever scheme (if any) it was registered with.
pub fn node_url(addr: &str, tls: bool) -> String {
    let rest = addr.split_once("://").map_or(addr, |(_, r)| r);
    format!("{}://{rest}", if tls { "https" } else { "http" })
}

/// The scheme a role registers its address with.
pub fn scheme(tls: Option<&NodeTls>) -> &'static str {
    if tls.is_some() { "https" } else { "http" }
}

/// An endpoint for node address `addr` (registered in etcd, or given on the
/// command line): with TLS, `https://` and a server certificate required
/// to name the address's host.
pub fn endpoint(addr: &str, tls: Option<&NodeTls>) -> Result<Endpoint> {
    let url = node_url(addr, tls.is_some());
    let ep = Endpoint::from_shared(url.clone()).with_context(|| format!("bad address {addr}"))?;
    match tls {
        None => Ok(ep),
        Some(t) => {
            let host = address_host(addr).with_context(|| format!("no host in address {addr}"))?;
            ep.tls_config(t.client_config(host))
                .with_context(|| format!("cannot configure TLS for {url}"))
        }
    }
}

/// Why a call failed, one line: the status message and, for a transport
/// failure, its sources (a refused certificate says why only there).
pub fn status_why(s: &tonic::Status) -> String {
    use std::error::Error;
    match s.source() {
        Some(src) => {
            let chain = error_chain(src);
            if chain.contains(s.message()) {
                chain
            } else {
                format!("{}: {chain}", s.message())
            }
        }
        None => s.message().to_string(),
    }
}

/// An error with its sources, one line (`transport error: ...: invalid peer
/// certificate: ...`): what a failed handshake says is in the sources.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        let m = x.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        src = x.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        tls: NodeTlsArgs,
    }

    fn parse(args: &[&str]) -> NodeTlsArgs {
        let mut v = vec!["x"];
        v.extend_from_slice(args);
        match Cli::try_parse_from(v) {
            Ok(c) => c.tls,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn none_is_plaintext_and_some_is_an_error_naming_the_missing() {
        assert!(matches!(parse(&[]).load(), Ok(None)));
        let e = match parse(&["--tls-cert", "c.pem"]).load() {
            Err(e) => e.to_string(),
            Ok(_) => panic!("one of three accepted"),
        };
        assert!(e.contains("missing --tls-key, --tls-ca"), "{e}");
        let e = match parse(&["--tls-cert", "c", "--tls-key", "k"]).load() {
            Err(e) => e.to_string(),
            Ok(_) => panic!("two of three accepted"),
        };
        assert!(
            e.contains("missing --tls-ca") && !e.contains("--tls-key,"),
            "{e}"
        );
        assert_eq!(
            parse(&["--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"]).to_flags(),
            ["--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"]
        );
    }

    #[test]
    fn unreadable_or_unparsable_files_are_named() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("epserve-tls-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate\n")?;
        let missing = dir.join("missing.pem");
        let args = NodeTlsArgs {
            tls_cert: Some(junk.clone()),
            tls_key: Some(junk.clone()),
            tls_ca: Some(missing.clone()),
        };
        let e = format!("{:#}", args.load().err().context("junk accepted")?);
        assert!(e.contains("--tls-ca") && e.contains("missing.pem"), "{e}");
        std::fs::write(&missing, "")?;
        let e = format!("{:#}", args.load().err().context("junk accepted")?);
        assert!(
            e.contains("--tls-cert") && e.contains("junk.pem") && e.contains("no CERTIFICATE"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn hosts_and_urls_of_node_addresses() {
        assert_eq!(address_host("127.0.0.1:50051"), Some("127.0.0.1"));
        assert_eq!(
            address_host("http://worker-0.epserve:50051"),
            Some("worker-0.epserve")
        );
        assert_eq!(address_host("https://[::1]:9000/x"), Some("::1"));
        assert_eq!(address_host("localhost"), Some("localhost"));
        assert_eq!(address_host("http://:1"), None);
        assert_eq!(node_url("http://10.0.0.5:1", true), "https://10.0.0.5:1");
        assert_eq!(node_url("10.0.0.5:1", true), "https://10.0.0.5:1");
        assert_eq!(node_url("https://h:1/p", false), "http://h:1/p");
    }
}
