//! The raw TOML shape: `deny_unknown_fields`, defaults, nothing checked yet.

use std::collections::BTreeMap;

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) kafka: RawKafka,
    #[serde(default)]
    pub(super) postgres: RawPostgres,
    #[serde(default)]
    pub(super) relay: RawRelay,
    #[serde(default)]
    pub(super) admin: RawAdmin,
    #[serde(default)]
    pub(super) tools: Vec<RawTool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawKafka {
    pub(super) brokers: String,
    pub(super) group_id: String,
    pub(super) actions_topic: String,
    pub(super) outcomes_topic: String,
    pub(super) dlq_topic: String,
    pub(super) partitions: i32,
    pub(super) replication_factor: Option<i32>,
    pub(super) create_topics: bool,
    /// librdkafka properties for every Kafka client idem makes (security, timeouts).
    pub(super) client: BTreeMap<String, String>,
    /// Extra librdkafka properties for the consumer and the producer.
    pub(super) consumer: BTreeMap<String, String>,
    pub(super) producer: BTreeMap<String, String>,
}

impl Default for RawKafka {
    fn default() -> Self {
        Self {
            brokers: "127.0.0.1:9092".into(),
            group_id: "idem".into(),
            actions_topic: "idem.actions".into(),
            outcomes_topic: "idem.outcomes".into(),
            dlq_topic: "idem.actions.dlq".into(),
            partitions: 6,
            replication_factor: None,
            create_topics: true,
            client: BTreeMap::new(),
            consumer: BTreeMap::new(),
            producer: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawPostgres {
    pub(super) url: String,
    pub(super) schema: String,
    pub(super) pool_size: usize,
}

impl Default for RawPostgres {
    fn default() -> Self {
        Self {
            url: "postgres://idem:idem@127.0.0.1:5432/idem".into(),
            schema: "public".into(),
            pool_size: 16,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawRelay {
    pub(super) instance_id: Option<String>,
    pub(super) concurrency: usize,
    pub(super) batch_size: usize,
    pub(super) batch_linger: String,
    pub(super) max_message_bytes: usize,
    pub(super) shutdown_grace: String,
    pub(super) lease: String,
    pub(super) recovery_interval: String,
    pub(super) outbox_poll_interval: String,
    pub(super) max_per_run: Option<u32>,
    pub(super) prune_interval: String,
    pub(super) tombstone_retention: String,
    pub(super) prune_share: f64,
}

impl Default for RawRelay {
    fn default() -> Self {
        Self {
            instance_id: None,
            concurrency: 256,
            batch_size: 500,
            batch_linger: "auto".into(),
            max_message_bytes: 1024 * 1024,
            shutdown_grace: "30s".into(),
            lease: "30s".into(),
            recovery_interval: "2s".into(),
            outbox_poll_interval: "500ms".into(),
            max_per_run: None,
            prune_interval: "10m".into(),
            tombstone_retention: "90d".into(),
            prune_share: 0.1,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawAdmin {
    pub(super) listen: String,
    pub(super) header_timeout: String,
    pub(super) request_timeout: String,
    pub(super) max_connections: usize,
}

impl Default for RawAdmin {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9464".into(),
            header_timeout: "10s".into(),
            request_timeout: "30s".into(),
            max_connections: 256,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTool {
    pub(super) name: String,
    pub(super) class: String,
    #[serde(default)]
    pub(super) key: Vec<String>,
    #[serde(default)]
    pub(super) material: Vec<String>,
    pub(super) executor: RawExecutor,
    #[serde(default)]
    pub(super) retry: Option<RawRetry>,
    #[serde(default)]
    pub(super) concurrency: Option<usize>,
    #[serde(default)]
    pub(super) verify: Option<RawVerify>,
    #[serde(default)]
    pub(super) approval: Option<RawApproval>,
    #[serde(default)]
    pub(super) approval_timeout: Option<String>,
    #[serde(default)]
    pub(super) max_per_run: Option<u32>,
    #[serde(default)]
    pub(super) max_reattempts: Option<u32>,
    #[serde(default)]
    pub(super) retention: Option<String>,
    #[serde(default)]
    pub(super) description: Option<String>,
    /// JSON Schema 2020-12 of `args`, inline.
    #[serde(default)]
    pub(super) input_schema: Option<toml::Value>,
    /// The same, from a JSON file.
    #[serde(default)]
    pub(super) input_schema_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawApproval {
    Word(String),
    Above { field: String, above: f64 },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawVerify {
    #[serde(default)]
    pub(super) method: Option<String>,
    pub(super) url: String,
    #[serde(default)]
    pub(super) timeout: Option<String>,
    #[serde(default)]
    pub(super) max_attempts: Option<u32>,
    #[serde(default)]
    pub(super) backoff: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawExecutor {
    pub(super) kind: String,
    // http
    #[serde(default)]
    pub(super) method: Option<String>,
    #[serde(default)]
    pub(super) url: Option<String>,
    #[serde(default)]
    pub(super) timeout: Option<String>,
    #[serde(default)]
    pub(super) headers: BTreeMap<String, String>,
    #[serde(default)]
    pub(super) status: Option<RawStatusTable>,
    #[serde(default)]
    pub(super) honors_key: bool,
    #[serde(default)]
    pub(super) tls: Option<RawToolTls>,
    // sql
    #[serde(default)]
    pub(super) statement: Option<String>,
    #[serde(default)]
    pub(super) params: Vec<String>,
}

/// `executor.tls`: a private CA and a client certificate for one tool's downstream.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawToolTls {
    #[serde(default)]
    pub(super) ca_file: Option<String>,
    #[serde(default)]
    pub(super) cert_file: Option<String>,
    #[serde(default)]
    pub(super) key_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStatusTable {
    #[serde(default)]
    pub(super) succeeded: Vec<u16>,
    #[serde(default)]
    pub(super) failed: Vec<u16>,
    #[serde(default)]
    pub(super) retry: Vec<u16>,
    #[serde(default)]
    pub(super) unknown: Vec<u16>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawRetry {
    pub(super) max_attempts: u32,
    pub(super) initial_backoff: String,
    pub(super) max_backoff: String,
}

impl Default for RawRetry {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            initial_backoff: "100ms".into(),
            max_backoff: "10s".into(),
        }
    }
}
