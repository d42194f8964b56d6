//! The typed shape every other room reads: validated, with no contradictions left.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use super::*;

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
    /// Replication of the topics the relay creates; `None`: the broker's
    /// `default.replication.factor`.
    pub replication_factor: Option<i32>,
    /// Create missing topics at start (the local broker has auto creation off).
    pub create_topics: bool,
    /// librdkafka properties every client gets (consumer, producer, admin, the CLI's), before
    /// the role's own: where `security.protocol`, `sasl.*` and `ssl.*` go.
    pub client: BTreeMap<String, String>,
    /// Secret properties of every client (`sasl.password` …), from the environment or a file.
    pub client_secrets: BTreeMap<String, Secret>,
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

/// How long the consumer waits for more messages once a batch has its first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchLinger {
    /// Always this long (zero: what has been fetched is the batch).
    Fixed(Duration),
    /// Only while actions arrive at least one per `most` and the batch is still small, and
    /// then only as long as messages keep coming: up to `gap` after the last one read, `most`
    /// in all. A stream's batches fill (fewer, larger transactions), a trickle's lone action
    /// is not held, and a burst is not held past its end.
    WhileBusy { most: Duration, gap: Duration },
}

impl BatchLinger {
    /// What `auto` waits. On the benchmark machine a linger of 2 ms took the CPU per action at
    /// 1,000/s down by a fifth, and 5 ms raised p50 more than it saved. The gap: a burst the
    /// broker hands out in two or three fetches (it answers a waiting fetch as soon as the
    /// first partition of a produce request is appended) comes in within a few hundred
    /// microseconds; waiting the whole 2 ms after it had added 2 ms to p50
    /// (`benches/HISTORY.md`).
    pub const AUTO: BatchLinger = BatchLinger::WhileBusy {
        most: Duration::from_millis(2),
        gap: Duration::from_micros(500),
    };
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
    pub batch_linger: BatchLinger,
    /// Larger action messages are dead-lettered as `oversize`.
    pub max_message_bytes: usize,
    /// How long SIGTERM waits for in-flight calls before leaving them to recovery.
    pub shutdown_grace: Duration,
    /// How long a claim on an intent lasts without being extended.
    pub lease: Duration,
    pub recovery_interval: Duration,
    /// How often the publishers read the outbox's queue for rows nothing handed over or
    /// notified (another relay's, a crashed run's, a failed round's).
    pub outbox_poll_interval: Duration,
    /// Distinct intents one run may record across all tools.
    pub max_per_run: Option<u32>,
    /// How often expired keys are pruned.
    pub prune_interval: Duration,
    /// How long a pruned key's tombstone keeps a resumed run from executing it again.
    pub tombstone_retention: Duration,
    /// The share of its time a relay's pruning may keep a Postgres connection busy: after each
    /// batch it pauses until the batch's time is this share of the time gone by.
    pub prune_share: f64,
}

#[derive(Debug, Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// A connection that has not sent a whole request head within this is closed; idle
    /// keep-alive connections too.
    pub header_timeout: Duration,
    /// A request (its body read and its answer) that takes longer is answered 503.
    pub request_timeout: Duration,
    /// Connections past this are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Bearer token for every `/v1/` endpoint, reads and changes; from `IDEM_ADMIN_TOKEN` or
    /// the file named by `IDEM_ADMIN_TOKEN_FILE`, never from the config text. None: the
    /// endpoints that change state are off.
    pub token: Option<Secret>,
    /// Bearer token for the `/v1/` reads only (dashboards, the console); from
    /// `IDEM_ADMIN_READ_TOKEN` or `IDEM_ADMIN_READ_TOKEN_FILE`.
    pub read_token: Option<Secret>,
    /// Named admin tokens, one person or system each, from the file named by
    /// `IDEM_ADMIN_TOKENS_FILE` (`name:token` lines): a decision made with one is recorded
    /// under its name, whatever the body says.
    pub named_tokens: Vec<NamedToken>,
}

/// An admin token that says who holds it.
#[derive(Debug, Clone)]
pub struct NamedToken {
    pub name: String,
    pub token: Secret,
}

pub const ENV_ADMIN_TOKEN: &str = "IDEM_ADMIN_TOKEN";
pub const ENV_ADMIN_TOKEN_FILE: &str = "IDEM_ADMIN_TOKEN_FILE";
pub const ENV_ADMIN_READ_TOKEN: &str = "IDEM_ADMIN_READ_TOKEN";
pub const ENV_ADMIN_READ_TOKEN_FILE: &str = "IDEM_ADMIN_READ_TOKEN_FILE";
pub const ENV_ADMIN_TOKENS_FILE: &str = "IDEM_ADMIN_TOKENS_FILE";

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
    pub(super) fn parse(field: &str, name: &str) -> Result<Self, ConfigError> {
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
    pub executor: ExecutorKind,
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
    /// What the tool does, for models and people.
    pub description: Option<String>,
    /// What `args` must look like, checked before anything is recorded.
    pub input_schema: Option<InputSchema>,
}

/// A tool's JSON Schema (2020-12) of `args`, compiled once when the config is loaded.
#[derive(Clone)]
pub struct InputSchema {
    /// As written, for `idem tools`, `GET /v1/tools` and MCP's `inputSchema`.
    pub schema: serde_json::Value,
    validator: std::sync::Arc<jsonschema::Validator>,
}

impl InputSchema {
    pub fn compile(schema: serde_json::Value) -> Result<Self, String> {
        let validator = jsonschema::draft202012::new(&schema).map_err(|e| e.to_string())?;
        Ok(InputSchema {
            schema,
            validator: std::sync::Arc::new(validator),
        })
    }

    /// Why `args` does not fit: one message per violation, and the JSON pointers (`/to`)
    /// of the values at fault.
    pub fn violations(&self, args: &serde_json::Value) -> Option<(String, Vec<String>)> {
        let mut messages = Vec::new();
        let mut paths = Vec::new();
        for e in self.validator.iter_errors(args) {
            let path = e.instance_path().to_string();
            let at = if path.is_empty() {
                "args".to_string()
            } else {
                format!("args{path}")
            };
            messages.push(format!("{at}: {e}"));
            if !paths.contains(&path) {
                paths.push(path);
            }
        }
        (!messages.is_empty()).then(|| (messages.join("; "), paths))
    }

    /// Whether the schema lets `args` go without this field (`args.x.y` → `/x/y`): neither
    /// required at each level nor the schema silent on it.
    pub fn makes_optional(&self, field: &str) -> bool {
        let Some(path) = field.strip_prefix("args.") else {
            return false;
        };
        let mut node = &self.schema;
        for part in path.split('.') {
            let required = node["required"]
                .as_array()
                .is_some_and(|r| r.iter().any(|v| v == part));
            if !required {
                return true;
            }
            node = &node["properties"][part];
        }
        false
    }
}

impl std::fmt::Debug for InputSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("InputSchema").field(&self.schema).finish()
    }
}

impl Tool {
    /// The downstream dedupes on `Idempotency-Key` (declared by `honors_key = true`).
    pub fn honors_key(&self) -> bool {
        matches!(&self.executor, ExecutorKind::Http(h) if h.honors_key)
    }

    /// Its intents may be claimed in the transaction that records them. A claim whose relay
    /// dies before the call looks like an interrupted call, which costs nothing here: recovery
    /// verifies a dangerous http call (it has a verify), rolls back a sql effect, or repeats an
    /// idempotent call. Only a dangerous http tool without verify would be parked `unknown` by
    /// it, so that one is claimed just before its call instead.
    pub fn claims_at_record(&self) -> bool {
        self.class != ToolClass::Dangerous
            || self.verify.is_some()
            || matches!(self.executor, ExecutorKind::Sql(_))
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
pub enum ExecutorKind {
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
    /// A private CA and client certificate for this tool's calls and verifications; `None`:
    /// the public roots, no client certificate.
    pub tls: Option<ToolTls>,
}

/// What `executor.tls` names, read and checked at load, so a bad file stops the start.
#[derive(Clone)]
pub struct ToolTls {
    /// PEM: CAs trusted beside the public roots.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM: the client certificate chain followed by its private key.
    pub identity_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for ToolTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key never shows.
        f.debug_struct("ToolTls")
            .field("ca", &self.ca_pem.is_some())
            .field("client_certificate", &self.identity_pem.is_some())
            .finish()
    }
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
    pub(super) overrides: BTreeMap<u16, StatusClass>,
    /// A dangerous tool whose downstream does not declare `honors_key`: 503 may come from a
    /// proxy or gateway after the request was forwarded, so it is not "nothing processed".
    pub(super) unavailable_is_ambiguous: bool,
}

impl StatusTable {
    pub fn classify(&self, status: u16) -> StatusClass {
        if let Some(class) = self.overrides.get(&status) {
            return *class;
        }
        match status {
            200..=299 => StatusClass::Succeeded,
            // Redirects are not followed: the effect was not performed where it was asked for.
            300..=399 => StatusClass::Failed,
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
