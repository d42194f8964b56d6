//! Configuration: a raw TOML shape (`deny_unknown_fields`, defaults) validated into a typed
//! [`Config`] that rejects contradictions with a message naming the field.
//!
//! The environment is a parameter of [`Config::load`], so tests pass their own.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

/// A configuration that cannot be used, with the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config is not valid TOML for idem: {0}")]
    Parse(String),
    #[error("config field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Environment variables that override the file.
pub const ENV_KAFKA_BROKERS: &str = "IDEM_KAFKA_BROKERS";
pub const ENV_POSTGRES_URL: &str = "IDEM_POSTGRES_URL";

// ------------------------------------------------------------------ raw shape

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    kafka: RawKafka,
    #[serde(default)]
    postgres: RawPostgres,
    #[serde(default)]
    relay: RawRelay,
    #[serde(default)]
    admin: RawAdmin,
    #[serde(default)]
    tools: Vec<RawTool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawKafka {
    brokers: String,
    group_id: String,
    actions_topic: String,
    outcomes_topic: String,
    dlq_topic: String,
    partitions: i32,
    create_topics: bool,
    /// Extra librdkafka properties for the consumer and the producer.
    consumer: BTreeMap<String, String>,
    producer: BTreeMap<String, String>,
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
            create_topics: true,
            consumer: BTreeMap::new(),
            producer: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawPostgres {
    url: String,
    schema: String,
    pool_size: usize,
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
struct RawRelay {
    instance_id: Option<String>,
    concurrency: usize,
    batch_size: usize,
    batch_linger: String,
    max_message_bytes: usize,
    shutdown_grace: String,
    lease: String,
    recovery_interval: String,
    outbox_poll_interval: String,
    max_per_run: Option<u32>,
    prune_interval: String,
    tombstone_retention: String,
}

impl Default for RawRelay {
    fn default() -> Self {
        Self {
            instance_id: None,
            concurrency: 256,
            batch_size: 500,
            batch_linger: "0ms".into(),
            max_message_bytes: 1024 * 1024,
            shutdown_grace: "30s".into(),
            lease: "30s".into(),
            recovery_interval: "2s".into(),
            outbox_poll_interval: "500ms".into(),
            max_per_run: None,
            prune_interval: "10m".into(),
            tombstone_retention: "90d".into(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawAdmin {
    listen: String,
}

impl Default for RawAdmin {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9464".into(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTool {
    name: String,
    class: String,
    #[serde(default)]
    key: Vec<String>,
    #[serde(default)]
    material: Vec<String>,
    executor: RawExecutor,
    #[serde(default)]
    retry: Option<RawRetry>,
    #[serde(default)]
    concurrency: Option<usize>,
    #[serde(default)]
    verify: Option<RawVerify>,
    #[serde(default)]
    approval: Option<RawApproval>,
    #[serde(default)]
    approval_timeout: Option<String>,
    #[serde(default)]
    max_per_run: Option<u32>,
    #[serde(default)]
    max_reattempts: Option<u32>,
    #[serde(default)]
    retention: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawApproval {
    Word(String),
    Above { field: String, above: f64 },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVerify {
    #[serde(default)]
    method: Option<String>,
    url: String,
    #[serde(default)]
    timeout: Option<String>,
    #[serde(default)]
    max_attempts: Option<u32>,
    #[serde(default)]
    backoff: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawExecutor {
    kind: String,
    // http
    #[serde(default)]
    method: Option<String>,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    timeout: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    status: Option<RawStatusTable>,
    #[serde(default)]
    honors_key: bool,
    // sql
    #[serde(default)]
    statement: Option<String>,
    #[serde(default)]
    params: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStatusTable {
    #[serde(default)]
    succeeded: Vec<u16>,
    #[serde(default)]
    failed: Vec<u16>,
    #[serde(default)]
    retry: Vec<u16>,
    #[serde(default)]
    unknown: Vec<u16>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawRetry {
    max_attempts: u32,
    initial_backoff: String,
    max_backoff: String,
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

// ---------------------------------------------------------------- typed shape

/// The validated configuration of one relay.
#[derive(Debug, Clone)]
pub struct Config {
    pub kafka: KafkaConfig,
    pub postgres: PostgresConfig,
    pub relay: RelayConfig,
    pub admin: AdminConfig,
    pub tools: Vec<Tool>,
}

#[derive(Debug, Clone)]
pub struct KafkaConfig {
    /// Bootstrap servers, comma separated.
    pub brokers: String,
    /// Consumer group: relays sharing it split the action partitions between them.
    pub group_id: String,
    pub actions_topic: String,
    pub outcomes_topic: String,
    pub dlq_topic: String,
    /// Partition count used when the relay creates a missing topic.
    pub partitions: i32,
    /// Create missing topics at start (the local broker has auto creation off).
    pub create_topics: bool,
    pub consumer_overrides: BTreeMap<String, String>,
    pub producer_overrides: BTreeMap<String, String>,
}

#[derive(Debug, Clone)]
pub struct PostgresConfig {
    pub url: String,
    /// Schema holding idem's tables; tests use a fresh one each.
    pub schema: String,
    pub pool_size: usize,
}

#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Names this relay in leases and logs.
    pub instance_id: String,
    /// Downstream calls in flight at once, across all tools.
    pub concurrency: usize,
    /// Action messages recorded per intent transaction, at most.
    pub batch_size: usize,
    /// How long the consumer waits to fill a batch once it has one message.
    pub batch_linger: Duration,
    /// Larger action messages are dead-lettered as `oversize`.
    pub max_message_bytes: usize,
    /// How long SIGTERM waits for in-flight calls before leaving them to recovery.
    pub shutdown_grace: Duration,
    /// How long a claim on an intent lasts without being extended.
    pub lease: Duration,
    pub recovery_interval: Duration,
    /// Fallback when no LISTEN/NOTIFY wake-up arrives.
    pub outbox_poll_interval: Duration,
    /// Distinct intents one run may record across all tools.
    pub max_per_run: Option<u32>,
    /// How often expired keys are pruned.
    pub prune_interval: Duration,
    /// How long a pruned key's tombstone keeps a resumed run from executing it again.
    pub tombstone_retention: Duration,
}

#[derive(Debug, Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// Bearer token for the endpoints that change state; from `IDEM_ADMIN_TOKEN` or the file
    /// named by `IDEM_ADMIN_TOKEN_FILE`, never from the config text. None: those endpoints are off.
    pub token: Option<String>,
}

pub const ENV_ADMIN_TOKEN: &str = "IDEM_ADMIN_TOKEN";
pub const ENV_ADMIN_TOKEN_FILE: &str = "IDEM_ADMIN_TOKEN_FILE";

/// When an intent of a tool waits for a person before it executes.
#[derive(Debug, Clone, PartialEq)]
pub enum Approval {
    None,
    Required,
    /// Required when a numeric material field is above a threshold.
    Above {
        field: FieldPath,
        threshold: f64,
    },
}

/// How a tool's side effect may be repeated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolClass {
    /// Executed on every delivery; nothing deduplicated.
    ReadOnly,
    /// Naturally repeatable: recorded, and may be retried blindly.
    Idempotent,
    /// Send, create, charge, append: the full protocol; never retried blind.
    Dangerous,
}

impl ToolClass {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolClass::ReadOnly => "read_only",
            ToolClass::Idempotent => "idempotent",
            ToolClass::Dangerous => "dangerous",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "read_only" => Some(ToolClass::ReadOnly),
            "idempotent" => Some(ToolClass::Idempotent),
            "dangerous" => Some(ToolClass::Dangerous),
            _ => None,
        }
    }
}

/// A field of an action event a key or a fingerprint is made of: `run_id`, `tool`, `step`,
/// `business_id`, or `args.<path>` (dotted, into the args object).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct FieldPath(pub String);

impl FieldPath {
    fn parse(field: &str, name: &str) -> Result<Self, ConfigError> {
        let ok = match name {
            "run_id" | "tool" | "step" | "business_id" => true,
            _ => name
                .strip_prefix("args.")
                .is_some_and(|rest| !rest.is_empty() && rest.split('.').all(|p| !p.is_empty())),
        };
        if ok {
            Ok(FieldPath(name.to_string()))
        } else {
            Err(invalid(
                field,
                format!(
                    "`{name}` is not a field of an action: use run_id, tool, step, business_id or args.<name>"
                ),
            ))
        }
    }
}

#[derive(Debug, Clone)]
pub struct Tool {
    pub name: String,
    pub class: ToolClass,
    /// Fields joined into the idempotency key when the event carries none.
    pub key: Vec<FieldPath>,
    /// Fields whose change under the same key is a conflict.
    pub material: Vec<FieldPath>,
    pub executor: Executor,
    pub retry: RetryPolicy,
    /// Calls of this tool in flight at once (defaults to the relay's concurrency).
    pub concurrency: usize,
    /// How to look downstream whether an ambiguous call took effect.
    pub verify: Option<Verify>,
    pub approval: Approval,
    /// The config said `approval = "none"` in so many words.
    pub approval_opted_out: bool,
    /// A pending approval older than this is rejected (`approval_timeout`).
    pub approval_timeout: Duration,
    /// Distinct intents of this tool one run may record.
    pub max_per_run: Option<u32>,
    /// Failed intents per (run, tool, business id) before new ones are rejected.
    pub max_reattempts: Option<u32>,
    /// How long a finished key is kept (while its run is not waiting on anything).
    pub retention: Duration,
}

impl Tool {
    /// The downstream dedupes on `Idempotency-Key` (declared by `honors_key = true`).
    pub fn honors_key(&self) -> bool {
        matches!(&self.executor, Executor::Http(h) if h.honors_key)
    }

    /// Its intents may be claimed in the transaction that records them. A claim whose relay
    /// dies before the call looks like an interrupted call, which costs nothing here: recovery
    /// verifies a dangerous http call (it has a verify), rolls back a sql effect, or repeats an
    /// idempotent call. Only a dangerous http tool without verify would be parked `unknown` by
    /// it, so that one is claimed just before its call instead.
    pub fn claims_at_record(&self) -> bool {
        self.class != ToolClass::Dangerous
            || self.verify.is_some()
            || matches!(self.executor, Executor::Sql(_))
    }

    /// A key built only from run, tool, business id and step names no particular effect.
    pub fn key_too_coarse(&self) -> bool {
        self.class == ToolClass::Dangerous && self.key.iter().all(|f| !f.0.starts_with("args."))
    }
}

/// `GET {url}` with the key: 200 → the effect happened (the body is its result), 404 → it did
/// not, anything else → inconclusive, asked again with backoff up to `max_attempts` times.
#[derive(Debug, Clone)]
pub struct Verify {
    pub method: reqwest::Method,
    pub url: String,
    pub timeout: Duration,
    pub max_attempts: u32,
    pub backoff: Duration,
}

#[derive(Debug, Clone)]
pub enum Executor {
    Http(HttpExecutor),
    Sql(SqlExecutor),
}

#[derive(Debug, Clone)]
pub struct HttpExecutor {
    pub method: reqwest::Method,
    /// May hold `{key}` and `{args.x}` placeholders, URL-encoded when filled.
    pub url: String,
    pub timeout: Duration,
    pub headers: BTreeMap<String, String>,
    pub status: StatusTable,
    /// The downstream dedupes on `Idempotency-Key`, so a repeat cannot double the effect.
    pub honors_key: bool,
}

/// What an HTTP status means for the effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusClass {
    Succeeded,
    /// The downstream refused: the effect certainly did not happen; final.
    Failed,
    /// Nothing was processed: retry after backoff.
    Retry,
    /// The effect may or may not have happened.
    Unknown,
}

/// The documented default table, with per-tool overrides.
#[derive(Debug, Clone, Default)]
pub struct StatusTable {
    overrides: BTreeMap<u16, StatusClass>,
    /// A dangerous tool whose downstream does not declare `honors_key`: 503 may come from a
    /// proxy or gateway after the request was forwarded, so it is not "nothing processed".
    unavailable_is_ambiguous: bool,
}

impl StatusTable {
    pub fn classify(&self, status: u16) -> StatusClass {
        if let Some(class) = self.overrides.get(&status) {
            return *class;
        }
        match status {
            200..=299 => StatusClass::Succeeded,
            503 if self.unavailable_is_ambiguous => StatusClass::Unknown,
            408 | 409 | 425 | 429 | 503 => StatusClass::Retry,
            400..=499 => StatusClass::Failed,
            _ => StatusClass::Unknown,
        }
    }
}

#[derive(Debug, Clone)]
pub struct SqlExecutor {
    /// Runs in the outcome transaction; `$1..$n` are `params` in order.
    pub statement: String,
    /// `key` or a field path, one per placeholder.
    pub params: Vec<SqlParam>,
    /// The statement is cancelled past this (`failed`, SQLSTATE 57014).
    pub timeout: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SqlParam {
    Key,
    Field(FieldPath),
}

#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
        }
    }
}

/// Parses `250ms`, `5s`, `2m`, `1h`, `7d`.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit())?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let ms = match unit {
        "ms" => n,
        "s" => n.checked_mul(1_000)?,
        "m" => n.checked_mul(60_000)?,
        "h" => n.checked_mul(3_600_000)?,
        "d" => n.checked_mul(86_400_000)?,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

fn duration(field: &str, s: &str) -> Result<Duration, ConfigError> {
    parse_duration(s).ok_or_else(|| {
        invalid(
            field,
            format!("`{s}` is not a duration (use e.g. 250ms, 5s, 2m, 1h)"),
        )
    })
}

fn positive(field: &str, n: usize) -> Result<usize, ConfigError> {
    if n == 0 {
        Err(invalid(field, "must be at least 1"))
    } else {
        Ok(n)
    }
}

fn topic(field: &str, name: &str) -> Result<String, ConfigError> {
    let valid = !name.is_empty()
        && name.len() <= 249
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if valid {
        Ok(name.to_string())
    } else {
        Err(invalid(
            field,
            format!("`{name}` is not a Kafka topic name (1-249 of [a-zA-Z0-9._-])"),
        ))
    }
}

impl Config {
    /// Reads and validates a config file; `env` supplies the overriding variables.
    pub fn load(path: &Path, env: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text, env)
    }

    pub fn from_toml(
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        Self::validate(raw, env)
    }

    fn validate(raw: RawConfig, env: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let k = raw.kafka;
        let brokers = env(ENV_KAFKA_BROKERS).unwrap_or(k.brokers);
        if brokers.trim().is_empty() {
            return Err(invalid("kafka.brokers", "must name at least one broker"));
        }
        if k.group_id.trim().is_empty() {
            return Err(invalid("kafka.group_id", "must not be empty"));
        }
        if k.partitions < 1 {
            return Err(invalid("kafka.partitions", "must be at least 1"));
        }
        let actions_topic = topic("kafka.actions_topic", &k.actions_topic)?;
        let outcomes_topic = topic("kafka.outcomes_topic", &k.outcomes_topic)?;
        let dlq_topic = topic("kafka.dlq_topic", &k.dlq_topic)?;
        if actions_topic == outcomes_topic || actions_topic == dlq_topic {
            return Err(invalid(
                "kafka.actions_topic",
                "must differ from outcomes_topic and dlq_topic, or idem would consume its own output",
            ));
        }
        if outcomes_topic == dlq_topic {
            return Err(invalid(
                "kafka.dlq_topic",
                "must differ from outcomes_topic",
            ));
        }
        for (name, reserved) in [
            (
                "consumer",
                ["enable.auto.offset.store", "group.id"].as_slice(),
            ),
            ("producer", ["enable.idempotence", "acks"].as_slice()),
        ] {
            let map = if name == "consumer" {
                &k.consumer
            } else {
                &k.producer
            };
            if let Some(key) = reserved.iter().find(|r| map.contains_key(**r)) {
                return Err(invalid(
                    format!("kafka.{name}.{key}"),
                    "is set by idem for exactly-once delivery and cannot be overridden",
                ));
            }
        }

        let p = raw.postgres;
        let url = env(ENV_POSTGRES_URL).unwrap_or(p.url);
        url.parse::<tokio_postgres::Config>()
            .map_err(|e| invalid("postgres.url", format!("not a Postgres URL: {e}")))?;
        let schema_ok = !p.schema.is_empty()
            && p.schema.len() <= 63
            && p.schema
                .starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && p.schema
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !schema_ok {
            return Err(invalid(
                "postgres.schema",
                "must be a lowercase identifier ([a-z_][a-z0-9_]*, at most 63 bytes)",
            ));
        }

        let r = raw.relay;
        let relay = RelayConfig {
            instance_id: r.instance_id.unwrap_or_else(default_instance_id),
            concurrency: positive("relay.concurrency", r.concurrency)?,
            batch_size: positive("relay.batch_size", r.batch_size)?,
            batch_linger: duration("relay.batch_linger", &r.batch_linger)?,
            max_message_bytes: positive("relay.max_message_bytes", r.max_message_bytes)?,
            shutdown_grace: duration("relay.shutdown_grace", &r.shutdown_grace)?,
            lease: duration("relay.lease", &r.lease)?,
            recovery_interval: duration("relay.recovery_interval", &r.recovery_interval)?,
            outbox_poll_interval: duration("relay.outbox_poll_interval", &r.outbox_poll_interval)?,
            max_per_run: r.max_per_run,
            prune_interval: duration("relay.prune_interval", &r.prune_interval)?,
            tombstone_retention: duration("relay.tombstone_retention", &r.tombstone_retention)?,
        };
        if relay.max_per_run == Some(0) {
            return Err(invalid("relay.max_per_run", "must be at least 1"));
        }
        if relay.lease < Duration::from_secs(1) {
            return Err(invalid("relay.lease", "must be at least 1s"));
        }

        let listen = raw.admin.listen.parse().map_err(|_| {
            invalid(
                "admin.listen",
                format!("`{}` is not a socket address (host:port)", raw.admin.listen),
            )
        })?;

        let mut names = BTreeSet::new();
        let mut tools = Vec::with_capacity(raw.tools.len());
        for (i, t) in raw.tools.into_iter().enumerate() {
            let tool = validate_tool(i, t, relay.concurrency)?;
            if !names.insert(tool.name.clone()) {
                return Err(invalid(
                    format!("tools[{i}].name"),
                    format!("tool `{}` is defined twice", tool.name),
                ));
            }
            tools.push(tool);
        }

        Ok(Config {
            kafka: KafkaConfig {
                brokers,
                group_id: k.group_id,
                actions_topic,
                outcomes_topic,
                dlq_topic,
                partitions: k.partitions,
                create_topics: k.create_topics,
                consumer_overrides: k.consumer,
                producer_overrides: k.producer,
            },
            postgres: PostgresConfig {
                url,
                schema: p.schema,
                pool_size: positive("postgres.pool_size", p.pool_size)?,
            },
            relay,
            admin: AdminConfig {
                listen,
                token: admin_token(&env)?,
            },
            tools,
        })
    }

    pub fn tool(&self, name: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.name == name)
    }
}

fn admin_token(env: &impl Fn(&str) -> Option<String>) -> Result<Option<String>, ConfigError> {
    let token = match (env(ENV_ADMIN_TOKEN), env(ENV_ADMIN_TOKEN_FILE)) {
        (Some(t), _) => t,
        (None, Some(path)) => std::fs::read_to_string(&path)
            .map_err(|e| invalid(ENV_ADMIN_TOKEN_FILE, format!("cannot read {path}: {e}")))?
            .trim()
            .to_string(),
        (None, None) => return Ok(None),
    };
    if token.len() < 16 {
        return Err(invalid(ENV_ADMIN_TOKEN, "must be at least 16 characters"));
    }
    Ok(Some(token))
}

fn default_instance_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "relay".into());
    format!(
        "{host}-{}-{}",
        std::process::id(),
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

fn validate_tool(i: usize, t: RawTool, relay_concurrency: usize) -> Result<Tool, ConfigError> {
    let at = |f: &str| format!("tools[{i}].{f}");
    let name_ok = !t.name.is_empty()
        && t.name.len() <= 64
        && t.name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if !name_ok {
        return Err(invalid(
            at("name"),
            format!("`{}` must be 1-64 of [a-zA-Z0-9_.-]", t.name),
        ));
    }
    let class = ToolClass::parse(&t.class).ok_or_else(|| {
        invalid(
            at("class"),
            format!(
                "`{}` is not a class: use read_only, idempotent or dangerous",
                t.class
            ),
        )
    })?;
    let key = t
        .key
        .iter()
        .map(|f| FieldPath::parse(&at("key"), f))
        .collect::<Result<Vec<_>, _>>()?;
    if key.is_empty() && class != ToolClass::ReadOnly {
        return Err(invalid(
            at("key"),
            "must name at least one field (e.g. [\"run_id\", \"tool\", \"business_id\"]) so a repeat maps to the same key",
        ));
    }
    let material = t
        .material
        .iter()
        .map(|f| FieldPath::parse(&at("material"), f))
        .collect::<Result<Vec<_>, _>>()?;

    let e = t.executor;
    let executor = match e.kind.as_str() {
        "http" => {
            if e.statement.is_some() || !e.params.is_empty() {
                return Err(invalid(
                    at("executor.statement"),
                    "belongs to kind = \"sql\", not \"http\"",
                ));
            }
            let url = e
                .url
                .ok_or_else(|| invalid(at("executor.url"), "is required for kind = \"http\""))?;
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(invalid(
                    at("executor.url"),
                    format!("`{url}` must start with http:// or https://"),
                ));
            }
            for placeholder in placeholders(&url) {
                if placeholder != "key" {
                    FieldPath::parse(&at("executor.url"), &placeholder)?;
                }
            }
            let method_text = e
                .method
                .unwrap_or_else(|| "POST".into())
                .to_ascii_uppercase();
            let method = reqwest::Method::from_bytes(method_text.as_bytes()).map_err(|_| {
                invalid(
                    at("executor.method"),
                    format!("`{method_text}` is not an HTTP method"),
                )
            })?;
            let timeout = duration(
                &at("executor.timeout"),
                e.timeout.as_deref().unwrap_or("30s"),
            )?;
            if timeout.is_zero() {
                return Err(invalid(at("executor.timeout"), "must be more than 0"));
            }
            for (name, value) in &e.headers {
                if reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_err()
                    || reqwest::header::HeaderValue::from_str(value).is_err()
                {
                    return Err(invalid(
                        at("executor.headers"),
                        format!("`{name}` is not a valid header"),
                    ));
                }
                if name.eq_ignore_ascii_case("idempotency-key") {
                    return Err(invalid(
                        at("executor.headers"),
                        "Idempotency-Key is set by idem from the action's key",
                    ));
                }
            }
            let mut status = StatusTable {
                unavailable_is_ambiguous: class == ToolClass::Dangerous && !e.honors_key,
                ..StatusTable::default()
            };
            if let Some(table) = e.status {
                for (codes, class) in [
                    (table.succeeded, StatusClass::Succeeded),
                    (table.failed, StatusClass::Failed),
                    (table.retry, StatusClass::Retry),
                    (table.unknown, StatusClass::Unknown),
                ] {
                    for code in codes {
                        if !(100..=599).contains(&code) {
                            return Err(invalid(
                                at("executor.status"),
                                format!("{code} is not an HTTP status"),
                            ));
                        }
                        if status.overrides.insert(code, class).is_some() {
                            return Err(invalid(
                                at("executor.status"),
                                format!("status {code} is listed twice"),
                            ));
                        }
                    }
                }
            }
            Executor::Http(HttpExecutor {
                method,
                url,
                timeout,
                headers: e.headers,
                status,
                honors_key: e.honors_key,
            })
        }
        "sql" => {
            if e.url.is_some() || e.method.is_some() {
                return Err(invalid(
                    at("executor.url"),
                    "belongs to kind = \"http\", not \"sql\"",
                ));
            }
            let statement = e
                .statement
                .filter(|s| !s.trim().is_empty())
                .ok_or_else(|| {
                    invalid(at("executor.statement"), "is required for kind = \"sql\"")
                })?;
            let params = e
                .params
                .iter()
                .map(|p| {
                    if p == "key" {
                        Ok(SqlParam::Key)
                    } else {
                        FieldPath::parse(&at("executor.params"), p).map(SqlParam::Field)
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            let highest = highest_placeholder(&statement);
            if highest != params.len() {
                return Err(invalid(
                    at("executor.params"),
                    format!(
                        "names {} parameters but the statement uses ${highest} as its highest placeholder",
                        params.len()
                    ),
                ));
            }
            if class == ToolClass::ReadOnly {
                return Err(invalid(
                    at("class"),
                    "a sql executor writes in the outcome transaction: use idempotent or dangerous",
                ));
            }
            // Enforced with `SET LOCAL statement_timeout`, so one slow statement cannot hold a
            // connection of the relay's pool for longer.
            let timeout = duration(
                &at("executor.timeout"),
                e.timeout.as_deref().unwrap_or("10s"),
            )?;
            Executor::Sql(SqlExecutor {
                statement,
                params,
                timeout,
            })
        }
        other => {
            return Err(invalid(
                at("executor.kind"),
                format!("`{other}` is not an executor: use http or sql"),
            ))
        }
    };

    let retry = match t.retry {
        None => RetryPolicy::default(),
        Some(r) => {
            let policy = RetryPolicy {
                max_attempts: r.max_attempts,
                initial_backoff: duration(&at("retry.initial_backoff"), &r.initial_backoff)?,
                max_backoff: duration(&at("retry.max_backoff"), &r.max_backoff)?,
            };
            if policy.max_attempts == 0 || policy.max_attempts > 100 {
                return Err(invalid(
                    at("retry.max_attempts"),
                    "must be between 1 and 100",
                ));
            }
            if policy.max_backoff < policy.initial_backoff {
                return Err(invalid(
                    at("retry.max_backoff"),
                    "must not be shorter than initial_backoff",
                ));
            }
            policy
        }
    };
    let concurrency = positive(
        &at("concurrency"),
        t.concurrency.unwrap_or(relay_concurrency),
    )?;
    let verify = match t.verify {
        None => None,
        Some(v) => {
            if !matches!(executor, Executor::Http(_)) {
                return Err(invalid(
                    at("verify"),
                    "only http tools are verified: a sql effect commits with its record",
                ));
            }
            if !(v.url.starts_with("http://") || v.url.starts_with("https://")) {
                return Err(invalid(
                    at("verify.url"),
                    format!("`{}` must start with http:// or https://", v.url),
                ));
            }
            for placeholder in placeholders(&v.url) {
                if placeholder != "key" {
                    FieldPath::parse(&at("verify.url"), &placeholder)?;
                }
            }
            let method_text = v
                .method
                .unwrap_or_else(|| "GET".into())
                .to_ascii_uppercase();
            let method = reqwest::Method::from_bytes(method_text.as_bytes()).map_err(|_| {
                invalid(
                    at("verify.method"),
                    format!("`{method_text}` is not an HTTP method"),
                )
            })?;
            let max_attempts = v.max_attempts.unwrap_or(5);
            if max_attempts == 0 || max_attempts > 100 {
                return Err(invalid(
                    at("verify.max_attempts"),
                    "must be between 1 and 100",
                ));
            }
            Some(Verify {
                method,
                url: v.url,
                timeout: duration(&at("verify.timeout"), v.timeout.as_deref().unwrap_or("5s"))?,
                max_attempts,
                backoff: duration(
                    &at("verify.backoff"),
                    v.backoff.as_deref().unwrap_or("200ms"),
                )?,
            })
        }
    };

    let (approval, approval_opted_out) = match t.approval {
        None => {
            let unverifiable = class == ToolClass::Dangerous
                && verify.is_none()
                && matches!(&executor, Executor::Http(h) if !h.honors_key);
            // Nothing can tell whether a repeat doubled the effect: a person gates it.
            (if unverifiable { Approval::Required } else { Approval::None }, false)
        }
        Some(RawApproval::Word(w)) => match w.as_str() {
            "required" => (Approval::Required, false),
            "none" => (Approval::None, true),
            other => {
                return Err(invalid(
                    at("approval"),
                    format!("`{other}` is not an approval: use \"required\", \"none\" or {{ field = \"args.amount\", above = 100 }}"),
                ))
            }
        },
        Some(RawApproval::Above { field, above }) => {
            let field = FieldPath::parse(&at("approval.field"), &field)?;
            if !material.contains(&field) {
                return Err(invalid(
                    at("approval.field"),
                    format!("`{}` must be one of the tool's material fields, or a reworded request could change it", field.0),
                ));
            }
            (Approval::Above { field, threshold: above }, false)
        }
    };
    let approval_timeout = duration(
        &at("approval_timeout"),
        t.approval_timeout.as_deref().unwrap_or("24h"),
    )?;
    let retention = duration(&at("retention"), t.retention.as_deref().unwrap_or("7d"))?;
    if retention < Duration::from_secs(24 * 3600) {
        return Err(invalid(
            at("retention"),
            "must be at least 24h: keys must outlive the longest pause",
        ));
    }
    if retention < approval_timeout {
        return Err(invalid(
            at("retention"),
            format!("is shorter than approval_timeout ({}s): an approved key could be pruned while it waits", approval_timeout.as_secs()),
        ));
    }
    if t.max_per_run == Some(0) {
        return Err(invalid(at("max_per_run"), "must be at least 1"));
    }
    if t.max_reattempts == Some(0) {
        return Err(invalid(at("max_reattempts"), "must be at least 1"));
    }
    Ok(Tool {
        name: t.name,
        class,
        key,
        material,
        executor,
        retry,
        concurrency,
        verify,
        approval,
        approval_opted_out,
        approval_timeout,
        max_per_run: t.max_per_run,
        max_reattempts: t.max_reattempts,
        retention,
    })
}

/// The `{...}` names in a URL template.
pub fn placeholders(template: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        let Some(len) = rest[start..].find('}') else {
            break;
        };
        out.push(rest[start + 1..start + len].to_string());
        rest = &rest[start + len + 1..];
    }
    out
}

fn highest_placeholder(statement: &str) -> usize {
    let bytes = statement.as_bytes();
    let mut highest = 0;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'$' {
            let digits: String = statement[i + 1..]
                .chars()
                .take_while(|c| c.is_ascii_digit())
                .collect();
            if let Ok(n) = digits.parse::<usize>() {
                highest = highest.max(n);
            }
            i += 1 + digits.len();
        } else {
            i += 1;
        }
    }
    highest
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    const MINIMAL_TOOL: &str = r#"
[[tools]]
name = "send_email"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.to"]
executor = { kind = "http", url = "http://127.0.0.1:8787/v1/send_email" }
"#;

    fn err(text: &str) -> String {
        Config::from_toml(text, no_env).unwrap_err().to_string()
    }

    #[test]
    fn defaults_fill_an_empty_file() {
        let c = Config::from_toml("", no_env).unwrap();
        assert_eq!(c.kafka.actions_topic, "idem.actions");
        assert_eq!(c.relay.concurrency, 256);
        assert_eq!(c.admin.listen.port(), 9464);
        assert!(c.tools.is_empty());
    }

    #[test]
    fn env_overrides_brokers_and_url() {
        let c = Config::from_toml(MINIMAL_TOOL, |k| match k {
            ENV_KAFKA_BROKERS => Some("broker:1234".into()),
            ENV_POSTGRES_URL => Some("postgres://u:p@db:5433/x".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(c.kafka.brokers, "broker:1234");
        assert_eq!(c.postgres.url, "postgres://u:p@db:5433/x");
    }

    #[test]
    fn unknown_field_is_named() {
        let e = err("[relay]\nconcurency = 3\n");
        assert!(e.contains("concurency"), "{e}");
    }

    #[test]
    fn bad_values_name_their_field() {
        let cases = [
            ("[relay]\nconcurrency = 0\n", "relay.concurrency"),
            ("[relay]\nbatch_linger = \"soon\"\n", "relay.batch_linger"),
            ("[kafka]\npartitions = 0\n", "kafka.partitions"),
            (
                "[kafka]\nactions_topic = \"bad topic\"\n",
                "kafka.actions_topic",
            ),
            (
                "[kafka]\noutcomes_topic = \"idem.actions\"\n",
                "kafka.actions_topic",
            ),
            (
                "[kafka.consumer]\n\"enable.auto.offset.store\" = \"true\"\n",
                "kafka.consumer.enable.auto.offset.store",
            ),
            ("[postgres]\nurl = \"mysql://x\"\n", "postgres.url"),
            (
                "[postgres]\nschema = \"Robert'); drop\"\n",
                "postgres.schema",
            ),
            ("[admin]\nlisten = \"nowhere\"\n", "admin.listen"),
        ];
        for (text, field) in cases {
            let e = err(text);
            assert!(e.contains(&format!("`{field}`")), "{text:?} gave {e}");
        }
    }

    #[test]
    fn tool_errors_name_the_tool_field() {
        let cases = [
            (MINIMAL_TOOL.replace("dangerous", "risky"), "tools[0].class"),
            (
                MINIMAL_TOOL.replace("\"business_id\"]", "\"subject\"]"),
                "tools[0].key",
            ),
            (
                MINIMAL_TOOL.replace("key = [\"run_id\", \"tool\", \"business_id\"]", "key = []"),
                "tools[0].key",
            ),
            (
                MINIMAL_TOOL.replace("\"args.to\"", "\"args.\""),
                "tools[0].material",
            ),
            (
                MINIMAL_TOOL.replace("http://127", "ftp://127"),
                "tools[0].executor.url",
            ),
            (
                MINIMAL_TOOL.replace("kind = \"http\"", "kind = \"grpc\""),
                "tools[0].executor.kind",
            ),
            (format!("{MINIMAL_TOOL}{MINIMAL_TOOL}"), "tools[1].name"),
            (
                MINIMAL_TOOL.replace("}", ", timeout = \"forever\" }"),
                "tools[0].executor.timeout",
            ),
            (
                format!("{MINIMAL_TOOL}retry = {{ max_attempts = 0 }}\n"),
                "tools[0].retry.max_attempts",
            ),
            (
                format!("{MINIMAL_TOOL}verify = {{ url = \"ftp://x\" }}\n"),
                "tools[0].verify.url",
            ),
        ];
        for (text, field) in cases {
            let e = err(&text);
            assert!(e.contains(&format!("`{field}`")), "{text:?} gave {e}");
        }
    }

    #[test]
    fn sql_params_must_match_placeholders() {
        let text = r#"
[[tools]]
name = "ledger"
class = "dangerous"
key = ["run_id", "business_id"]
executor = { kind = "sql", statement = "insert into t values ($1, $2) returning 1", params = ["key"] }
"#;
        let e = err(text);
        assert!(e.contains("tools[0].executor.params"), "{e}");
        let ok = text.replace("params = [\"key\"]", "params = [\"key\", \"args.amount\"]");
        let c = Config::from_toml(&ok, no_env).unwrap();
        match &c.tools[0].executor {
            Executor::Sql(s) => assert_eq!(s.params.len(), 2),
            other => panic!("expected sql, got {other:?}"),
        }
    }

    #[test]
    fn unverifiable_dangerous_tools_are_gated_unless_opted_out() {
        let c = Config::from_toml(MINIMAL_TOOL, no_env).unwrap();
        assert_eq!(c.tools[0].approval, Approval::Required);
        assert!(!c.tools[0].approval_opted_out);
        let opted = format!("{MINIMAL_TOOL}approval = \"none\"\n");
        let c = Config::from_toml(&opted, no_env).unwrap();
        assert_eq!(c.tools[0].approval, Approval::None);
        assert!(c.tools[0].approval_opted_out);
        let verified =
            format!("{MINIMAL_TOOL}verify = {{ url = \"http://127.0.0.1:1/{{key}}\" }}\n");
        assert_eq!(
            Config::from_toml(&verified, no_env).unwrap().tools[0].approval,
            Approval::None
        );
        let honoring = MINIMAL_TOOL.replace("}", ", honors_key = true }");
        assert_eq!(
            Config::from_toml(&honoring, no_env).unwrap().tools[0].approval,
            Approval::None
        );
        assert!(Config::from_toml(MINIMAL_TOOL, no_env).unwrap().tools[0].key_too_coarse());
    }

    #[test]
    fn gate_settings_are_checked() {
        let cases = [
            (
                format!("{MINIMAL_TOOL}retention = \"12h\"\n"),
                "tools[0].retention",
            ),
            (
                format!("{MINIMAL_TOOL}retention = \"2d\"\napproval_timeout = \"3d\"\n"),
                "tools[0].retention",
            ),
            (
                format!("{MINIMAL_TOOL}approval = {{ field = \"args.amount\", above = 100 }}\n"),
                "tools[0].approval.field",
            ),
            (
                format!("{MINIMAL_TOOL}approval = \"maybe\"\n"),
                "tools[0].approval",
            ),
            (
                format!("{MINIMAL_TOOL}max_per_run = 0\n"),
                "tools[0].max_per_run",
            ),
        ];
        for (text, field) in cases {
            let e = err(&text);
            assert!(e.contains(&format!("`{field}`")), "{text:?} gave {e}");
        }
        let above = format!("{MINIMAL_TOOL}approval = {{ field = \"args.to\", above = 100 }}\n");
        assert!(matches!(
            Config::from_toml(&above, no_env).unwrap().tools[0].approval,
            Approval::Above { .. }
        ));
    }

    #[test]
    fn admin_token_comes_from_the_environment_only() {
        let c = Config::from_toml("", |k| {
            (k == ENV_ADMIN_TOKEN).then(|| "0123456789abcdef".to_string())
        })
        .unwrap();
        assert_eq!(c.admin.token.as_deref(), Some("0123456789abcdef"));
        let short = Config::from_toml("", |k| (k == ENV_ADMIN_TOKEN).then(|| "short".to_string()));
        assert!(short.unwrap_err().to_string().contains(ENV_ADMIN_TOKEN));
        assert!(
            err("[admin]\ntoken = \"x\"\n").contains("token"),
            "not accepted from the config text"
        );
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("5s"), Some(Duration::from_secs(5)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("7d"), Some(Duration::from_secs(7 * 86400)));
        assert_eq!(parse_duration("5"), None);
        assert_eq!(parse_duration("s"), None);
        assert_eq!(parse_duration("1.5s"), None);
    }

    #[test]
    fn status_table_defaults_and_overrides() {
        let t = StatusTable::default();
        assert_eq!(t.classify(201), StatusClass::Succeeded);
        assert_eq!(t.classify(400), StatusClass::Failed);
        assert_eq!(t.classify(404), StatusClass::Failed);
        assert_eq!(t.classify(409), StatusClass::Retry);
        assert_eq!(t.classify(429), StatusClass::Retry);
        assert_eq!(t.classify(503), StatusClass::Retry);
        assert_eq!(t.classify(500), StatusClass::Unknown);
        assert_eq!(t.classify(302), StatusClass::Unknown);
        let text = MINIMAL_TOOL.replace("}", ", status = { failed = [409], retry = [500] } }");
        let c = Config::from_toml(&text, no_env).unwrap();
        let Executor::Http(h) = &c.tools[0].executor else {
            panic!("http")
        };
        assert_eq!(h.status.classify(409), StatusClass::Failed);
        assert_eq!(h.status.classify(500), StatusClass::Retry);
    }

    /// 503 often comes from a proxy that forwarded the request: for a dangerous tool it is
    /// "may have happened" unless the downstream dedupes on the key; 429 and 425 stay "nothing
    /// processed" (the client was refused before any work).
    #[test]
    fn unavailable_is_ambiguous_for_a_dangerous_tool_unless_it_honours_the_key() {
        let status_of = |text: &str, code: u16| {
            let c = Config::from_toml(text, no_env).unwrap();
            let Executor::Http(h) = &c.tools[0].executor else {
                panic!("http")
            };
            h.status.classify(code)
        };
        let dangerous = MINIMAL_TOOL.replace("}", ", honors_key = false }");
        assert_eq!(status_of(&dangerous, 503), StatusClass::Unknown);
        assert_eq!(status_of(&dangerous, 429), StatusClass::Retry);
        assert_eq!(status_of(&dangerous, 425), StatusClass::Retry);
        let keyed = MINIMAL_TOOL.replace("}", ", honors_key = true }");
        assert_eq!(status_of(&keyed, 503), StatusClass::Retry);
        let idempotent = MINIMAL_TOOL.replace("\"dangerous\"", "\"idempotent\"");
        assert_eq!(status_of(&idempotent, 503), StatusClass::Retry);
        // An explicit table entry still wins.
        let listed = MINIMAL_TOOL.replace("}", ", status = { retry = [503] } }");
        assert_eq!(status_of(&listed, 503), StatusClass::Retry);
    }

    #[test]
    fn example_config_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/idem.example.toml");
        let c = Config::load(&path, no_env).unwrap();
        assert!(!c.tools.is_empty());
    }
}
