//! Postgres over TLS, as libpq's URL parameters ask for it: `sslmode` (disable, prefer,
//! require, verify-ca, verify-full), `sslrootcert` (a PEM file of CAs, or `system` for the
//! Mozilla roots), `sslcert` and `sslkey` (a client certificate). tokio-postgres knows only
//! the first three modes and none of the files, so [`TlsParams::split`] takes them out of the
//! URL and [`TlsParams::connector`] builds the rustls connector that honours them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::SslMode as DriverSslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

/// libpq's `sslmode`: what a connection demands of TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Never TLS.
    Disable,
    /// TLS when the server offers it, its certificate unchecked (libpq's default).
    Prefer,
    /// TLS or no connection; the certificate is checked against `sslrootcert` only when one is
    /// named (as libpq does), otherwise unchecked.
    Require,
    /// TLS, the certificate signed by a trusted CA; the host name is not compared.
    VerifyCa,
    /// TLS, the certificate signed by a trusted CA and naming the host connected to.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<Self, String> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            // libpq's "allow" tries without TLS first; nobody should want that in production.
            other => {
                return Err(format!(
                "sslmode `{other}` is not one of disable, prefer, require, verify-ca, verify-full"
            ))
            }
        })
    }

    fn name(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// Where the trusted CAs come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Roots {
    /// Mozilla's root programme (`sslrootcert=system`, or no `sslrootcert` with a verify mode).
    Public,
    /// The CAs in this PEM file.
    File(PathBuf),
}

/// The TLS parameters of one Postgres URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsParams {
    pub mode: SslMode,
    /// `None`: no `sslrootcert` in the URL.
    pub roots: Option<Roots>,
    /// `sslcert` and `sslkey`, both or neither.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

/// The URL parameters this module takes over from tokio-postgres.
const TAKEN: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

impl TlsParams {
    /// Splits a Postgres URL (`postgres://…?k=v&…` or libpq's `k=v k=v` form) into the URL
    /// tokio-postgres parses and the TLS parameters. The error names the parameter at fault.
    pub fn split(url: &str) -> Result<(String, TlsParams), String> {
        let (rest, taken) = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            split_uri(url)
        } else {
            split_key_values(url)?
        };
        let get = |name: &str| {
            taken
                .iter()
                .rev()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        let mode = get("sslmode").map_or(Ok(SslMode::Prefer), SslMode::parse)?;
        let roots = get("sslrootcert").map(|v| match v {
            "system" => Roots::Public,
            path => Roots::File(PathBuf::from(path)),
        });
        let client_cert = match (get("sslcert"), get("sslkey")) {
            (Some(cert), Some(key)) => Some((PathBuf::from(cert), PathBuf::from(key))),
            (None, None) => None,
            (Some(_), None) => return Err("sslcert is given without sslkey".into()),
            (None, Some(_)) => return Err("sslkey is given without sslcert".into()),
        };
        if mode == SslMode::Disable && (roots.is_some() || client_cert.is_some()) {
            return Err("sslmode=disable contradicts sslrootcert / sslcert (they need TLS)".into());
        }
        Ok((
            rest,
            TlsParams {
                mode,
                roots,
                client_cert,
            },
        ))
    }

    /// What tokio-postgres itself must do: try TLS, demand it, or never.
    pub fn driver_mode(&self) -> DriverSslMode {
        match self.mode {
            SslMode::Disable => DriverSslMode::Disable,
            SslMode::Prefer => DriverSslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => DriverSslMode::Require,
        }
    }

    /// The rustls connector for these parameters; files are read here, so a missing or
    /// unreadable one is reported when the pool is built, naming the parameter.
    pub fn connector(&self) -> Result<MakeRustlsConnect, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("tls: {e}"))?;
        let verify = match (self.mode, &self.roots) {
            (SslMode::VerifyFull, _) => Verify::Full,
            (SslMode::VerifyCa, _) | (SslMode::Require, Some(_)) => Verify::CaOnly,
            _ => Verify::Nothing,
        };
        let roots = || -> Result<Arc<RootCertStore>, String> {
            match self.roots.as_ref().unwrap_or(&Roots::Public) {
                Roots::Public => Ok(Arc::new(RootCertStore {
                    roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
                })),
                Roots::File(path) => load_roots(path).map(Arc::new),
            }
        };
        let builder = match verify {
            Verify::Full => builder.with_root_certificates(roots()?),
            Verify::CaOnly => {
                let inner = WebPkiServerVerifier::builder_with_provider(roots()?, provider)
                    .build()
                    .map_err(|e| format!("sslrootcert: {e}"))?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(CaOnly(inner)))
            }
            Verify::Nothing => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Unchecked(provider))),
        };
        let config = match &self.client_cert {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = CertificateDer::pem_file_iter(cert)
                    .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| format!("sslcert {}: {e}", cert.display()))?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("sslkey {}: {e}", key.display()))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| format!("sslcert / sslkey: {e}"))?
            }
        };
        Ok(MakeRustlsConnect::new(config))
    }

    /// For error messages: what was asked of the server's certificate.
    pub fn describe(&self) -> String {
        match &self.roots {
            Some(Roots::File(path)) => {
                format!(
                    "sslmode={}, sslrootcert={}",
                    self.mode.name(),
                    path.display()
                )
            }
            Some(Roots::Public) => format!("sslmode={}, sslrootcert=system", self.mode.name()),
            None => format!("sslmode={}", self.mode.name()),
        }
    }
}

enum Verify {
    Full,
    CaOnly,
    Nothing,
}

fn load_roots(path: &Path) -> Result<RootCertStore, String> {
    let mut store = RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
    let (added, _) = store.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!(
            "sslrootcert {}: no CA certificate in the file",
            path.display()
        ));
    }
    Ok(store)
}

/// verify-ca: the chain must lead to a trusted CA; the name in it is not compared.
#[derive(Debug)]
struct CaOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for CaOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// prefer / require without `sslrootcert`: encrypted, the certificate taken as presented (what
/// libpq does in these modes). The handshake's signatures are still checked.
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

type Taken = Vec<(String, String)>;

/// `postgres://…?a=1&sslmode=x`: the query's TLS parameters taken out, the rest kept as written.
fn split_uri(url: &str) -> (String, Taken) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_string(), Vec::new());
    };
    let mut kept = Vec::new();
    let mut taken = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if TAKEN.contains(&k) {
            taken.push((k.to_string(), percent_decode(v)));
        } else {
            kept.push(pair);
        }
    }
    let rest = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (rest, taken)
}

/// libpq's `host=… sslmode=…` form: values may be single-quoted, with `\` escapes.
fn split_key_values(url: &str) -> Result<(String, Taken), String> {
    let mut kept = Vec::new();
    let mut taken = Vec::new();
    let mut chars = url.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(format!("`{key}` has no value (key=value)"));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut raw = String::new();
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            raw.push('\'');
            loop {
                match chars.next() {
                    None => return Err(format!("the value of `{key}` has no closing quote")),
                    Some('\'') => break,
                    Some('\\') => {
                        let escaped = chars.next().unwrap_or('\\');
                        raw.push('\\');
                        raw.push(escaped);
                        value.push(escaped);
                    }
                    Some(c) => {
                        raw.push(c);
                        value.push(c);
                    }
                }
            }
            raw.push('\'');
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                raw.push(c);
                value.push(c);
            }
        }
        if TAKEN.contains(&key.as_str()) {
            taken.push((key, value));
        } else {
            kept.push(format!("{key}={raw}"));
        }
    }
    Ok((kept.join(" "), taken))
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied(),
            bytes.get(i + 2).copied(),
        ) {
            (b'%', Some(h), Some(l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(url: &str) -> (String, TlsParams) {
        TlsParams::split(url).unwrap()
    }

    #[test]
    fn a_url_without_tls_parameters_is_kept_and_prefers_tls_like_libpq() {
        let (rest, tls) = split("postgres://idem:idem@127.0.0.1:5432/idem");
        assert_eq!(rest, "postgres://idem:idem@127.0.0.1:5432/idem");
        assert_eq!(tls.mode, SslMode::Prefer);
        assert_eq!(tls.driver_mode(), DriverSslMode::Prefer);
        assert_eq!(tls.roots, None);
    }

    #[test]
    fn the_tls_parameters_leave_the_uri_and_the_others_stay() {
        let (rest, tls) = split(
            "postgres://u:p@db:5432/idem?connect_timeout=3&sslmode=verify-full\
             &sslrootcert=%2Fetc%2Fca.pem&application_name=x&sslcert=/c.pem&sslkey=/k.pem",
        );
        assert_eq!(
            rest,
            "postgres://u:p@db:5432/idem?connect_timeout=3&application_name=x"
        );
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.driver_mode(), DriverSslMode::Require);
        assert_eq!(tls.roots, Some(Roots::File("/etc/ca.pem".into())));
        assert_eq!(
            tls.client_cert,
            Some((PathBuf::from("/c.pem"), PathBuf::from("/k.pem")))
        );
        assert!(rest.parse::<tokio_postgres::Config>().is_ok());
    }

    #[test]
    fn the_key_value_form_is_split_too_quotes_included() {
        let (rest, tls) = split(
            "host=db user=idem password='a \\' b' sslmode=verify-ca sslrootcert='/a b/ca.pem'",
        );
        assert_eq!(tls.mode, SslMode::VerifyCa);
        assert_eq!(tls.roots, Some(Roots::File("/a b/ca.pem".into())));
        assert_eq!(rest, "host=db user=idem password='a \\' b'");
        assert!(rest.parse::<tokio_postgres::Config>().is_ok());
    }

    #[test]
    fn system_roots_are_mozillas() {
        let (_, tls) = split("postgres://db/x?sslmode=verify-full&sslrootcert=system");
        assert_eq!(tls.roots, Some(Roots::Public));
        assert!(tls.connector().is_ok());
    }

    #[test]
    fn contradictions_and_unknown_modes_are_refused_by_name() {
        let err = |url: &str| TlsParams::split(url).unwrap_err();
        assert!(err("postgres://db/x?sslmode=allow").contains("sslmode `allow`"));
        assert!(err("postgres://db/x?sslcert=/c.pem").contains("sslcert is given without sslkey"));
        assert!(err("postgres://db/x?sslmode=disable&sslrootcert=/ca.pem").contains("disable"));
    }

    #[test]
    fn a_missing_root_file_is_named_when_the_connector_is_built() {
        let (_, tls) = split("postgres://db/x?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem");
        let e = tls.connector().err().expect("refused");
        assert!(e.starts_with("sslrootcert /nonexistent/ca.pem"), "{e}");
    }
}
