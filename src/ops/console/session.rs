//! Who is using the console: a session cookie signed with the token it was opened with, or the
//! token itself in an `Authorization: Bearer` header (for scripts).
//!
//! The cookie holds no secret: who (which token), the name decisions are recorded under, an
//! expiry and a nonce, signed with HMAC-SHA256 keyed by that token. Every relay that knows the
//! token accepts it (no session store to share), and changing a token ends its sessions. The
//! CSRF token of a session is the same HMAC over its nonce.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::config::Secret;
use crate::ops::admin::{constant_time_eq, Caller, Tokens};

pub const COOKIE: &str = "idem_ui";
/// How long a login lasts.
pub const LIFETIME_SECS: u64 = 8 * 3600;

/// What a session may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// The shared admin token: decisions are recorded under the name given at login.
    Admin { by: String },
    /// A named admin token: decisions are recorded under its name.
    Named(String),
    /// The read-only token: sees, cannot decide.
    Reader,
}

impl Role {
    pub fn can_decide(&self) -> bool {
        !matches!(self, Role::Reader)
    }

    /// The name decisions are recorded under; empty for the shared token without a name.
    pub fn by(&self) -> &str {
        match self {
            Role::Admin { by } => by,
            Role::Named(name) => name,
            Role::Reader => "",
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Role::Admin { by } if by.is_empty() => "admin token".into(),
            Role::Admin { by } => format!("{by} (admin token)"),
            Role::Named(name) => format!("{name} (named token)"),
            Role::Reader => "read-only token".into(),
        }
    }
}

/// A request's session.
#[derive(Debug, Clone)]
pub struct Session {
    pub role: Role,
    /// The CSRF token its forms carry; `None` for a bearer header (a browser does not add one
    /// to a forged cross-site form, so there is nothing to forge).
    pub csrf: Option<String>,
}

/// The token a session tag stands for: `a` (shared admin), `r` (read-only), `n<hex name>`.
fn token_of<'a>(tokens: &'a Tokens, tag: &str) -> Option<(&'a Secret, Role)> {
    match tag {
        "a" => tokens
            .admin
            .as_ref()
            .map(|t| (t, Role::Admin { by: String::new() })),
        "r" => tokens.read.as_ref().map(|t| (t, Role::Reader)),
        _ => {
            let name = String::from_utf8(hex::decode(tag.strip_prefix('n')?).ok()?).ok()?;
            let named = tokens.named.iter().find(|n| n.name == name)?;
            Some((&named.token, Role::Named(name)))
        }
    }
}

fn mac(token: &Secret, parts: &[&str]) -> String {
    let mut m = Hmac::<Sha256>::new_from_slice(token.expose().as_bytes())
        .expect("HMAC takes a key of any length");
    m.update(b"idem-ui");
    for p in parts {
        m.update(b"\0");
        m.update(p.as_bytes());
    }
    hex::encode(m.finalize().into_bytes())
}

fn csrf(token: &Secret, nonce: &str) -> String {
    mac(token, &["csrf", nonce])
}

/// A cookie value for whoever holds `given`, or `None` when it is no token of this relay.
/// `by` names the person behind the shared admin token.
pub fn open(tokens: &Tokens, given: &str, by: &str, now_secs: u64) -> Option<String> {
    let tag = match tokens.caller_of(given) {
        Caller::Admin => "a".to_string(),
        Caller::Named(name) => format!("n{}", hex::encode(name)),
        Caller::Reader => "r".to_string(),
        Caller::Anonymous | Caller::Wrong => return None,
    };
    let (token, _) = token_of(tokens, &tag)?;
    let by = hex::encode(by.trim());
    let expiry = (now_secs + LIFETIME_SECS).to_string();
    let nonce = hex::encode(rand::random::<[u8; 16]>());
    let signature = mac(token, &[&tag, &by, &expiry, &nonce]);
    Some(format!("{tag}.{by}.{expiry}.{nonce}.{signature}"))
}

/// The session a cookie value stands for, if its signature holds and it has not expired.
pub fn read(tokens: &Tokens, value: &str, now_secs: u64) -> Option<Session> {
    let mut parts = value.split('.');
    let (tag, by, expiry, nonce, signature) = (
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
    );
    if parts.next().is_some() {
        return None;
    }
    let (token, role) = token_of(tokens, tag)?;
    let expected = mac(token, &[tag, by, expiry, nonce]);
    if !constant_time_eq(expected.as_bytes(), signature.as_bytes()) {
        return None;
    }
    if expiry.parse::<u64>().ok()? <= now_secs {
        return None;
    }
    let role = match role {
        Role::Admin { .. } => Role::Admin {
            by: String::from_utf8(hex::decode(by).ok()?).ok()?,
        },
        other => other,
    };
    Some(Session {
        role,
        csrf: Some(csrf(token, nonce)),
    })
}

/// The session of a bearer token.
pub fn bearer(tokens: &Tokens, headers: &axum::http::HeaderMap) -> Option<Session> {
    let role = match tokens.caller(headers) {
        Caller::Admin => Role::Admin { by: String::new() },
        Caller::Named(name) => Role::Named(name),
        Caller::Reader => Role::Reader,
        Caller::Anonymous | Caller::Wrong => return None,
    };
    Some(Session { role, csrf: None })
}

/// The value of cookie `name` in a request's `Cookie` headers.
pub fn cookie<'a>(headers: &'a axum::http::HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NamedToken;

    fn tokens() -> Tokens {
        Tokens {
            admin: Some(Secret::new("admin-token-0123456789")),
            named: vec![NamedToken {
                name: "alice".into(),
                token: Secret::new("alice-token-0123456789"),
            }],
            read: Some(Secret::new("read-token-0123456789")),
            loopback: true,
        }
    }

    #[test]
    fn a_session_opens_with_a_token_and_reads_back() {
        let t = tokens();
        let c = open(&t, "admin-token-0123456789", "Bob", 1000).unwrap();
        let s = read(&t, &c, 1001).unwrap();
        assert_eq!(s.role, Role::Admin { by: "Bob".into() });
        assert!(s.role.can_decide());
        let n = read(&t, &open(&t, "alice-token-0123456789", "", 0).unwrap(), 1).unwrap();
        assert_eq!(n.role, Role::Named("alice".into()));
        let r = read(&t, &open(&t, "read-token-0123456789", "", 0).unwrap(), 1).unwrap();
        assert_eq!(r.role, Role::Reader);
        assert!(!r.role.can_decide());
        assert!(open(&t, "wrong-token-0123456789", "", 0).is_none());
    }

    #[test]
    fn a_forged_expired_or_foreign_cookie_is_no_session() {
        let t = tokens();
        let c = open(&t, "read-token-0123456789", "", 1000).unwrap();
        // Promoting a reader's cookie to admin breaks the signature.
        let promoted = format!("a{}", &c[1..]);
        assert!(read(&t, &promoted, 1001).is_none());
        assert!(read(&t, &c, 1000 + LIFETIME_SECS).is_none(), "expired");
        assert!(read(&t, "a.b.c", 1001).is_none());
        // Another token, another relay's sessions: not valid here.
        let other = Tokens {
            read: Some(Secret::new("another-read-token-012345")),
            ..tokens()
        };
        assert!(read(&other, &c, 1001).is_none());
    }

    #[test]
    fn each_session_has_its_own_csrf_token() {
        let t = tokens();
        let a = read(&t, &open(&t, "admin-token-0123456789", "", 0).unwrap(), 1).unwrap();
        let b = read(&t, &open(&t, "admin-token-0123456789", "", 0).unwrap(), 1).unwrap();
        assert_ne!(a.csrf, b.csrf);
        assert_eq!(a.csrf.as_ref().map(String::len), Some(64));
    }

    #[test]
    fn cookies_are_found_among_others() {
        let mut h = axum::http::HeaderMap::new();
        h.append("cookie", "a=1; idem_ui=x.y; b=2".parse().unwrap());
        assert_eq!(cookie(&h, COOKIE), Some("x.y"));
        assert_eq!(cookie(&h, "c"), None);
    }
}
