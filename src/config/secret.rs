//! Secrets in librdkafka properties: never in the config text, read from the environment or
//! from a file (the way Kubernetes mounts secrets), never shown by `Debug`.

use std::collections::BTreeMap;
use std::fmt;

use super::{invalid, ConfigError};

/// A value that must not reach logs: `Debug` says it is set, never what it is.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value, for the one place that hands it to a client library.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// librdkafka properties whose values are secrets.
pub const KAFKA_SECRETS: [&str; 5] = [
    "sasl.password",
    "ssl.key.password",
    "ssl.keystore.password",
    "sasl.oauthbearer.client.secret",
    "ssl.key.pem",
];

/// The environment variable that supplies a secret property: `sasl.password` →
/// `IDEM_KAFKA_SASL_PASSWORD`.
pub fn kafka_secret_env(property: &str) -> String {
    format!("IDEM_KAFKA_{}", property.replace('.', "_").to_uppercase())
}

/// `[kafka.client]` split: plain properties, and secrets.
pub(super) type ClientProperties = (BTreeMap<String, String>, BTreeMap<String, Secret>);

/// Splits `[kafka.client]` into plain properties and secrets. A secret written in the map is
/// refused; `NAME_file` reads secret NAME from a file (trailing newline dropped); the
/// environment variable of a secret wins over its file.
pub(super) fn kafka_client(
    map: BTreeMap<String, String>,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<ClientProperties, ConfigError> {
    let mut plain = BTreeMap::new();
    let mut secrets = BTreeMap::new();
    for (key, value) in map {
        if KAFKA_SECRETS.contains(&key.as_str()) {
            return Err(invalid(
                format!("kafka.client.{key}"),
                format!(
                    "is a secret and is never written in the config: set {} or `{key}_file` (a file holding it)",
                    kafka_secret_env(&key)
                ),
            ));
        }
        match key.strip_suffix("_file") {
            Some(secret) if KAFKA_SECRETS.contains(&secret) => {
                let text = std::fs::read_to_string(&value).map_err(|e| {
                    invalid(
                        format!("kafka.client.{key}"),
                        format!("cannot read {value}: {e}"),
                    )
                })?;
                let text = text.trim_end_matches(['\n', '\r']);
                if text.is_empty() {
                    return Err(invalid(
                        format!("kafka.client.{key}"),
                        format!("{value} is empty"),
                    ));
                }
                secrets.insert(secret.to_string(), Secret::new(text));
            }
            _ => {
                plain.insert(key, value);
            }
        }
    }
    for property in KAFKA_SECRETS {
        if let Some(value) = env(&kafka_secret_env(property)) {
            secrets.insert(property.to_string(), Secret::new(value));
        }
    }
    Ok((plain, secrets))
}

/// A secret in the consumer's or producer's extra properties: they are for tuning, and the
/// client section is where connection settings go.
pub(super) fn refuse_secrets(
    section: &str,
    map: &BTreeMap<String, String>,
) -> Result<(), ConfigError> {
    match map.keys().find(|k| {
        KAFKA_SECRETS.contains(&k.as_str())
            || k.strip_suffix("_file")
                .is_some_and(|s| KAFKA_SECRETS.contains(&s))
    }) {
        Some(key) => Err(invalid(
            format!("kafka.{section}.{key}"),
            format!(
                "secrets go in [kafka.client] as `NAME_file`, or in {}",
                kafka_secret_env(key.trim_end_matches("_file"))
            ),
        )),
        None => Ok(()),
    }
}
