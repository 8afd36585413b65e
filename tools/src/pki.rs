//! A small certificate authority for the node links' mutual TLS
//! (`epserve up --secure`, the TLS tests): a self-signed CA and leaf
//! certificates it issues, each usable as a server and as a client
//! certificate, with the SANs given (IP addresses become IP SANs, names DNS
//! SANs). ECDSA P-256 keys, generated with ring.

use std::path::Path;

use anyhow::{Context, Result};
use epserve_cluster::tls::NodeTlsArgs;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

/// A self-signed CA that issues node certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ca { .. }")
    }
}

/// A leaf certificate and its private key, PEM.
#[derive(Debug, Clone)]
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Ca {
    /// A new CA with common name `name`.
    pub fn new(name: &str) -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().context("cannot generate the CA key")?;
        let cert = params
            .self_signed(&key)
            .context("cannot sign the CA certificate")?;
        Ok(Ca {
            issuer: Issuer::new(params, key),
            cert_pem: cert.pem(),
        })
    }

    /// The CA certificate (what `--tls-ca` names).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A leaf certificate for `name` (its common name) with subject
    /// alternative names `sans` (`127.0.0.1` an IP SAN, `localhost` a DNS
    /// SAN), for TLS servers and clients both.
    pub fn issue(&self, name: &str, sans: &[&str]) -> Result<Leaf> {
        let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
        let mut params =
            CertificateParams::new(sans).with_context(|| format!("{name}: bad SAN"))?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().with_context(|| format!("{name}: cannot generate a key"))?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .with_context(|| format!("{name}: cannot sign the certificate"))?;
        Ok(Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Writes `ca.pem` into `dir` (once) and `<name>.pem` / `<name>-key.pem`
    /// (the key readable by its owner only), and returns the `--tls-*`
    /// flags naming them.
    pub fn write_leaf(&self, dir: &Path, name: &str, sans: &[&str]) -> Result<NodeTlsArgs> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let ca = dir.join("ca.pem");
        if !ca.exists() {
            write(&ca, &self.cert_pem, false)?;
        }
        let leaf = self.issue(name, sans)?;
        let cert = dir.join(format!("{name}.pem"));
        let key = dir.join(format!("{name}-key.pem"));
        write(&cert, &leaf.cert_pem, false)?;
        write(&key, &leaf.key_pem, true)?;
        Ok(NodeTlsArgs {
            tls_cert: Some(cert),
            tls_key: Some(key),
            tls_ca: Some(ca),
        })
    }
}

/// Writes `text` to `path` (readable by its owner only: 0600).
pub fn write_private(path: &Path, text: &str) -> Result<()> {
    write(path, text, true)
}

fn write(path: &Path, text: &str, private: bool) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    if private {
        o.mode(0o600);
    }
    let mut f = o
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_files_load_as_node_tls() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let ca = Ca::new("epserve test CA")?;
        let args = ca.write_leaf(dir.path(), "node", &["127.0.0.1", "localhost"])?;
        let tls = args.load()?;
        assert!(tls.is_some());
        // A key from another leaf does not go with the certificate.
        let other = ca.write_leaf(dir.path(), "other", &["localhost"])?;
        let mixed = NodeTlsArgs {
            tls_key: other.tls_key,
            ..args
        };
        let e = format!("{:#}", mixed.load().err().context("mismatch accepted")?);
        assert!(e.contains("do not go together"), "{e}");
        Ok(())
    }
}
