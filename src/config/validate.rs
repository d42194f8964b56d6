//! Raw shape → typed shape: every check, with an error that names the field at fault.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use super::raw::*;
use super::*;

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

fn batch_linger(s: &str) -> Result<BatchLinger, ConfigError> {
    if s == "auto" {
        return Ok(BatchLinger::AUTO);
    }
    parse_duration(s).map(BatchLinger::Fixed).ok_or_else(|| {
        invalid(
            "relay.batch_linger",
            format!("`{s}` is neither `auto` nor a duration (use e.g. 0ms, 2ms)"),
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
        if k.replication_factor.is_some_and(|r| r < 1) {
            return Err(invalid(
                "kafka.replication_factor",
                "must be at least 1 (leave it out for the broker's default)",
            ));
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
        // With librdkafka's other name for a property (`request.required.acks` for `acks`),
        // both would be set, and librdkafka would take whichever was set last: the order of a
        // hash map's keys.
        let consumer_only = ["enable.auto.offset.store", "group.id"];
        let producer_only = ["enable.idempotence", "acks", "request.required.acks"];
        let every = [consumer_only.as_slice(), producer_only.as_slice()].concat();
        for (name, map, reserved) in [
            ("client", &k.client, every.as_slice()),
            ("consumer", &k.consumer, consumer_only.as_slice()),
            ("producer", &k.producer, producer_only.as_slice()),
        ] {
            if let Some(key) = reserved.iter().find(|r| map.contains_key(**r)) {
                return Err(invalid(
                    format!("kafka.{name}.{key}"),
                    "is set by idem for exactly-once delivery and cannot be overridden",
                ));
            }
            let brokers = ["bootstrap.servers", "metadata.broker.list"];
            if let Some(key) = brokers.iter().find(|b| map.contains_key(**b)) {
                return Err(invalid(
                    format!("kafka.{name}.{key}"),
                    "comes from kafka.brokers (or IDEM_KAFKA_BROKERS)",
                ));
            }
        }
        secret::refuse_secrets("consumer", &k.consumer)?;
        secret::refuse_secrets("producer", &k.producer)?;
        let (client, client_secrets) = secret::kafka_client(k.client, &env)?;

        let p = raw.postgres;
        let url = match (env(ENV_POSTGRES_URL), env(ENV_POSTGRES_URL_FILE)) {
            (Some(url), _) => url,
            (None, Some(path)) => std::fs::read_to_string(&path)
                .map(|text| text.trim().to_string())
                .map_err(|e| {
                    invalid(
                        "postgres.url",
                        format!("{ENV_POSTGRES_URL_FILE} names {path}, which cannot be read: {e}"),
                    )
                })?,
            (None, None) => p.url,
        };
        let (driver_url, _) =
            crate::db::TlsParams::split(&url).map_err(|e| invalid("postgres.url", e))?;
        driver_url
            .parse::<tokio_postgres::Config>()
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
            batch_linger: batch_linger(&r.batch_linger)?,
            max_message_bytes: positive("relay.max_message_bytes", r.max_message_bytes)?,
            shutdown_grace: duration("relay.shutdown_grace", &r.shutdown_grace)?,
            lease: duration("relay.lease", &r.lease)?,
            recovery_interval: duration("relay.recovery_interval", &r.recovery_interval)?,
            outbox_poll_interval: duration("relay.outbox_poll_interval", &r.outbox_poll_interval)?,
            max_per_run: r.max_per_run,
            prune_interval: duration("relay.prune_interval", &r.prune_interval)?,
            tombstone_retention: duration("relay.tombstone_retention", &r.tombstone_retention)?,
            prune_share: r.prune_share,
        };
        if !(relay.prune_share > 0.0 && relay.prune_share <= 1.0) {
            return Err(invalid(
                "relay.prune_share",
                "must be more than 0 and at most 1 (1 prunes batch after batch without a pause)",
            ));
        }
        if relay.max_per_run == Some(0) {
            return Err(invalid("relay.max_per_run", "must be at least 1"));
        }
        if relay.lease < Duration::from_secs(1) {
            return Err(invalid("relay.lease", "must be at least 1s"));
        }

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
                replication_factor: k.replication_factor,
                create_topics: k.create_topics,
                client,
                client_secrets,
                consumer_overrides: k.consumer,
                producer_overrides: k.producer,
            },
            postgres: PostgresConfig {
                url,
                schema: p.schema,
                pool_size: positive("postgres.pool_size", p.pool_size)?,
            },
            relay,
            admin: admin_section(&raw.admin, &env)?,
            tools,
        })
    }

    pub fn tool(&self, name: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.name == name)
    }
}

fn admin_section(
    raw: &RawAdmin,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<AdminConfig, ConfigError> {
    let listen = raw.listen.parse().map_err(|_| {
        invalid(
            "admin.listen",
            format!("`{}` is not a socket address (host:port)", raw.listen),
        )
    })?;
    let header_timeout = duration("admin.header_timeout", &raw.header_timeout)?;
    let request_timeout = duration("admin.request_timeout", &raw.request_timeout)?;
    if header_timeout.is_zero() || request_timeout.is_zero() {
        return Err(invalid(
            "admin.header_timeout",
            "admin.header_timeout and admin.request_timeout must be more than 0",
        ));
    }
    if raw.max_connections == 0 {
        return Err(invalid("admin.max_connections", "must be at least 1"));
    }
    let token = admin_token(env, ENV_ADMIN_TOKEN, ENV_ADMIN_TOKEN_FILE)?;
    let read_token = admin_token(env, ENV_ADMIN_READ_TOKEN, ENV_ADMIN_READ_TOKEN_FILE)?;
    if token.is_some() && token == read_token {
        return Err(invalid(
            ENV_ADMIN_READ_TOKEN,
            "must differ from the admin token, or a dashboard could change state",
        ));
    }
    let named_tokens = match env(ENV_ADMIN_TOKENS_FILE) {
        Some(path) => named_tokens(&path)?,
        None => Vec::new(),
    };
    for n in &named_tokens {
        if Some(&n.token) == read_token.as_ref() || Some(&n.token) == token.as_ref() {
            return Err(invalid(
                ENV_ADMIN_TOKENS_FILE,
                format!(
                    "the token of `{}` is also the admin or read token; each must be its own",
                    n.name
                ),
            ));
        }
    }
    Ok(AdminConfig {
        listen,
        header_timeout,
        request_timeout,
        max_connections: raw.max_connections,
        token,
        read_token,
        named_tokens,
    })
}

/// `name:token` lines; blank lines and `#` comments are skipped. An error names the line, never
/// the token.
fn named_tokens(path: &str) -> Result<Vec<NamedToken>, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| invalid(ENV_ADMIN_TOKENS_FILE, format!("cannot read {path}: {e}")))?;
    parse_named_tokens(&text).map_err(|e| invalid(ENV_ADMIN_TOKENS_FILE, format!("{path}: {e}")))
}

fn parse_named_tokens(text: &str) -> Result<Vec<NamedToken>, String> {
    let mut tokens: Vec<NamedToken> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = i + 1;
        let Some((name, token)) = line.split_once(':') else {
            return Err(format!("line {at} is not `name:token`"));
        };
        let (name, token) = (name.trim(), token.trim());
        let name_ok = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '@'));
        if !name_ok {
            return Err(format!(
                "line {at}: the name must be 1-64 of [a-zA-Z0-9_.@-]"
            ));
        }
        if token.len() < 16 {
            return Err(format!(
                "line {at}: the token of `{name}` must be at least 16 characters"
            ));
        }
        if let Some(other) = tokens.iter().find(|t| t.name == name) {
            return Err(format!("line {at}: `{}` is named twice", other.name));
        }
        if let Some(other) = tokens.iter().find(|t| t.token.expose() == token) {
            return Err(format!(
                "line {at}: `{name}` has the same token as `{}`",
                other.name
            ));
        }
        tokens.push(NamedToken {
            name: name.to_string(),
            token: Secret::new(token.to_string()),
        });
    }
    Ok(tokens)
}

/// A bearer token from the variable `var`, or the file named by `file_var`.
fn admin_token(
    env: &impl Fn(&str) -> Option<String>,
    var: &str,
    file_var: &str,
) -> Result<Option<Secret>, ConfigError> {
    let token = match (env(var), env(file_var)) {
        (Some(t), _) => t,
        (None, Some(path)) => std::fs::read_to_string(&path)
            .map_err(|e| invalid(file_var, format!("cannot read {path}: {e}")))?
            .trim()
            .to_string(),
        (None, None) => return Ok(None),
    };
    if token.len() < 16 {
        return Err(invalid(var, "must be at least 16 characters"));
    }
    Ok(Some(Secret::new(token)))
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

    let executor = match t.executor.kind.as_str() {
        "http" => http_executor(&at, t.executor, class)?,
        "sql" => sql_executor(&at, t.executor, class)?,
        other => {
            return Err(invalid(
                at("executor.kind"),
                format!("`{other}` is not an executor: use http or sql"),
            ))
        }
    };

    let retry = match t.retry {
        None => RetryPolicy::default(),
        Some(r) => retry_policy(&at, r)?,
    };
    let concurrency = positive(
        &at("concurrency"),
        t.concurrency.unwrap_or(relay_concurrency),
    )?;
    let verify = match t.verify {
        None => None,
        Some(v) => Some(verify_section(&at, v, &executor)?),
    };

    let (approval, approval_opted_out) = approval_section(
        &at,
        t.approval,
        class,
        verify.as_ref(),
        &executor,
        &material,
    )?;
    let approval_timeout = duration(
        &at("approval_timeout"),
        t.approval_timeout.as_deref().unwrap_or("24h"),
    )?;
    let retention = duration(&at("retention"), t.retention.as_deref().unwrap_or("7d"))?;
    if retention < super::MIN_RETENTION {
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
    let input_schema = match (t.input_schema, t.input_schema_file) {
        (None, None) => None,
        (Some(_), Some(_)) => {
            return Err(invalid(
                at("input_schema"),
                "give input_schema or input_schema_file, not both",
            ))
        }
        (Some(inline), None) => {
            let schema = serde_json::to_value(inline)
                .map_err(|e| invalid(at("input_schema"), e.to_string()))?;
            Some(InputSchema::compile(schema).map_err(|e| {
                invalid(at("input_schema"), format!("not a valid JSON Schema: {e}"))
            })?)
        }
        (None, Some(path)) => {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                invalid(at("input_schema_file"), format!("cannot read {path}: {e}"))
            })?;
            let schema: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                invalid(at("input_schema_file"), format!("{path} is not JSON: {e}"))
            })?;
            Some(InputSchema::compile(schema).map_err(|e| {
                invalid(
                    at("input_schema_file"),
                    format!("{path} is not a valid JSON Schema: {e}"),
                )
            })?)
        }
    };
    Ok(Tool {
        description: t.description,
        input_schema,
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

/// A tool's `executor` of kind `http`.
fn http_executor(
    at: &impl Fn(&str) -> String,
    e: RawExecutor,
    class: ToolClass,
) -> Result<ExecutorKind, ConfigError> {
    if e.statement.is_some() || !e.params.is_empty() {
        return Err(invalid(
            at("executor.statement"),
            "belongs to kind = \"sql\", not \"http\"",
        ));
    }
    let url = e
        .url
        .ok_or_else(|| invalid(at("executor.url"), "is required for kind = \"http\""))?;
    url_template(&at("executor.url"), &url)?;
    let method = http_method(&at("executor.method"), e.method, "POST")?;
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
    let tls = e
        .tls
        .map(|t| tool_tls(&at("executor.tls"), t))
        .transpose()?;
    Ok(ExecutorKind::Http(HttpExecutor {
        method,
        url,
        timeout,
        headers: e.headers,
        status,
        honors_key: e.honors_key,
        tls,
    }))
}

/// `executor.tls`: the files read now and parsed as the http client will, so a wrong path or a
/// file that is not PEM is a config error naming the field.
fn tool_tls(field: &str, t: RawToolTls) -> Result<ToolTls, ConfigError> {
    let read = |name: &str, path: &str| {
        std::fs::read(path).map_err(|e| {
            invalid(
                format!("{field}.{name}"),
                format!("cannot read {path}: {e}"),
            )
        })
    };
    let ca_pem = match &t.ca_file {
        None => None,
        Some(path) => {
            let pem = read("ca_file", path)?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| invalid(format!("{field}.ca_file"), format!("{path}: {e}")))?;
            if certs.is_empty() {
                return Err(invalid(
                    format!("{field}.ca_file"),
                    format!("{path} holds no PEM certificate"),
                ));
            }
            Some(pem)
        }
    };
    let identity_pem = match (&t.cert_file, &t.key_file) {
        (None, None) => None,
        (Some(cert), Some(key)) => {
            let mut pem = read("cert_file", cert)?;
            pem.push(b'\n');
            pem.extend(read("key_file", key)?);
            reqwest::Identity::from_pem(&pem).map_err(|e| {
                invalid(
                    format!("{field}.cert_file"),
                    format!("{cert} with {key}: {e}"),
                )
            })?;
            Some(pem)
        }
        (Some(_), None) => {
            return Err(invalid(
                format!("{field}.key_file"),
                "is required with cert_file",
            ))
        }
        (None, Some(_)) => {
            return Err(invalid(
                format!("{field}.cert_file"),
                "is required with key_file",
            ))
        }
    };
    if ca_pem.is_none() && identity_pem.is_none() {
        return Err(invalid(
            field,
            "names no ca_file and no cert_file / key_file",
        ));
    }
    Ok(ToolTls {
        ca_pem,
        identity_pem,
    })
}

/// A tool's `executor` of kind `sql`.
fn sql_executor(
    at: &impl Fn(&str) -> String,
    e: RawExecutor,
    class: ToolClass,
) -> Result<ExecutorKind, ConfigError> {
    if e.url.is_some() || e.method.is_some() {
        return Err(invalid(
            at("executor.url"),
            "belongs to kind = \"http\", not \"sql\"",
        ));
    }
    let statement = e
        .statement
        .filter(|s| !s.trim().is_empty())
        .ok_or_else(|| invalid(at("executor.statement"), "is required for kind = \"sql\""))?;
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
    Ok(ExecutorKind::Sql(SqlExecutor {
        statement,
        params,
        timeout,
    }))
}

/// A tool's `retry` section.
fn retry_policy(at: &impl Fn(&str) -> String, r: RawRetry) -> Result<RetryPolicy, ConfigError> {
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
    Ok(policy)
}

/// A tool's `verify` section: only http tools are verified.
fn verify_section(
    at: &impl Fn(&str) -> String,
    v: RawVerify,
    executor: &ExecutorKind,
) -> Result<Verify, ConfigError> {
    if !matches!(executor, ExecutorKind::Http(_)) {
        return Err(invalid(
            at("verify"),
            "only http tools are verified: a sql effect commits with its record",
        ));
    }
    url_template(&at("verify.url"), &v.url)?;
    let method = http_method(&at("verify.method"), v.method, "GET")?;
    let max_attempts = v.max_attempts.unwrap_or(5);
    if max_attempts == 0 || max_attempts > 100 {
        return Err(invalid(
            at("verify.max_attempts"),
            "must be between 1 and 100",
        ));
    }
    Ok(Verify {
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

/// A tool's `approval`: (the gate, whether it was opted out of explicitly). A dangerous tool
/// that nothing can verify is gated unless it says `approval = "none"`.
fn approval_section(
    at: &impl Fn(&str) -> String,
    raw: Option<RawApproval>,
    class: ToolClass,
    verify: Option<&Verify>,
    executor: &ExecutorKind,
    material: &[FieldPath],
) -> Result<(Approval, bool), ConfigError> {
    Ok(match raw {
        None => {
            let unverifiable = class == ToolClass::Dangerous
                && verify.is_none()
                && matches!(&executor, ExecutorKind::Http(h) if !h.honors_key);
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
    })
}

/// An http(s) URL whose `{placeholders}` are `key` or field paths.
fn url_template(field: &str, url: &str) -> Result<(), ConfigError> {
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(invalid(
            field,
            format!("`{url}` must start with http:// or https://"),
        ));
    }
    // A filled scheme, host or port would let an action's arguments choose where the effect
    // goes; only the path and query are the arguments' to fill.
    let after_scheme = &url[url.find("://").map_or(0, |i| i + 3)..];
    let authority = after_scheme
        .find(['/', '?', '#'])
        .map_or(after_scheme, |end| &after_scheme[..end]);
    if authority.contains('{') {
        return Err(invalid(
            field,
            format!("`{url}`: placeholders may stand only in the path and query, not in the host or port"),
        ));
    }
    for placeholder in placeholders(url) {
        if placeholder != "key" {
            FieldPath::parse(field, &placeholder)?;
        }
    }
    Ok(())
}

/// An HTTP method, `default` when not given.
fn http_method(
    field: &str,
    given: Option<String>,
    default: &str,
) -> Result<reqwest::Method, ConfigError> {
    let text = given.unwrap_or_else(|| default.into()).to_ascii_uppercase();
    reqwest::Method::from_bytes(text.as_bytes())
        .map_err(|_| invalid(field, format!("`{text}` is not an HTTP method")))
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

    fn at(f: &str) -> String {
        format!("tools[0].{f}")
    }

    fn reason(e: ConfigError) -> String {
        e.to_string()
    }

    #[test]
    fn named_tokens_say_who_holds_them_and_errors_never_show_a_token() {
        let ok = parse_named_tokens(
            "# approvers\nalice@example.com: 0123456789abcdef-alice\n\n  ops-bot:0123456789abcdef-bot  \n",
        )
        .unwrap();
        let names: Vec<_> = ok.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["alice@example.com", "ops-bot"]);
        assert_eq!(ok[1].token.expose(), "0123456789abcdef-bot");

        for (text, expected) in [
            ("alice 0123456789abcdef", "line 1 is not `name:token`"),
            ("al ice:0123456789abcdef", "line 1: the name must be"),
            (
                "alice:short-secret",
                "line 1: the token of `alice` must be at least 16",
            ),
            (
                "alice:0123456789abcdef\nalice:0123456789abcdeX",
                "line 2: `alice` is named twice",
            ),
            (
                "alice:0123456789abcdef\nbob:0123456789abcdef",
                "line 2: `bob` has the same token as `alice`",
            ),
        ] {
            let e = parse_named_tokens(text).unwrap_err();
            assert!(e.starts_with(expected), "{text:?}: {e}");
            assert!(
                !e.contains("0123456789") && !e.contains("short-secret"),
                "{e}"
            );
        }
    }

    #[test]
    fn url_templates_need_a_scheme_and_known_placeholders() {
        assert!(url_template("f", "https://x/{key}/{args.id}").is_ok());
        for url in [
            "https://{args.host}/v1",
            "https://api.example.com:{args.port}/v1",
            "https://{key}.example.com",
            "http://user:{args.p}@x/",
        ] {
            let e = reason(url_template("f", url).unwrap_err());
            assert!(e.contains("only in the path and query"), "{url}: {e}");
        }
        assert!(url_template("f", "https://x:8443/v1/{args.id}?q={key}#top").is_ok());
        let e = reason(url_template("f", "ftp://x").unwrap_err());
        assert!(
            e.contains("`f`") && e.contains("http:// or https://"),
            "{e}"
        );
        assert!(url_template("f", "http://x/{nope}").is_err());
    }

    #[test]
    fn http_methods_default_and_are_checked() {
        assert_eq!(http_method("f", None, "GET").unwrap(), reqwest::Method::GET);
        assert_eq!(
            http_method("f", Some("put".into()), "GET").unwrap(),
            reqwest::Method::PUT
        );
        let e = reason(http_method("f", Some("NO PE".into()), "GET").unwrap_err());
        assert!(e.contains("is not an HTTP method"), "{e}");
    }

    #[test]
    fn a_retry_section_is_bounded() {
        let raw = |n: u32, initial: &str, max: &str| RawRetry {
            max_attempts: n,
            initial_backoff: initial.into(),
            max_backoff: max.into(),
        };
        let p = retry_policy(&at, raw(3, "100ms", "2s")).unwrap();
        assert_eq!((p.max_attempts, p.max_backoff), (3, Duration::from_secs(2)));
        let e = reason(retry_policy(&at, raw(0, "100ms", "2s")).unwrap_err());
        assert!(e.contains("tools[0].retry.max_attempts"), "{e}");
        let e = reason(retry_policy(&at, raw(3, "2s", "1s")).unwrap_err());
        assert!(e.contains("tools[0].retry.max_backoff"), "{e}");
    }

    #[test]
    fn only_http_tools_are_verified() {
        let sql = ExecutorKind::Sql(SqlExecutor {
            statement: "select 1".into(),
            params: vec![],
            timeout: Duration::from_secs(1),
        });
        let v = RawVerify {
            method: None,
            url: "http://x/{key}".into(),
            timeout: None,
            max_attempts: None,
            backoff: None,
        };
        let e = reason(verify_section(&at, v, &sql).unwrap_err());
        assert!(
            e.contains("tools[0].verify") && e.contains("only http tools"),
            "{e}"
        );
    }
}
