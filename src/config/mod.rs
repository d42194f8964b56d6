//! Configuration: a raw TOML shape (`deny_unknown_fields`, defaults) validated into a typed
//! [`Config`] that rejects contradictions with a message naming the field.
//!
//! The environment is a parameter of [`Config::load`], so tests pass their own.

mod raw;
mod secret;
mod typed;
mod validate;

pub use secret::{kafka_secret_env, Secret, KAFKA_SECRETS};
pub use typed::*;
pub use validate::{parse_duration, placeholders};

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
/// The shortest retention a tool may have (`tools[].retention`): keys must outlive the longest
/// pause, and a repeat reads a key settled within half of it without a share lock
/// (`settled_unlocked!` in `intent::sql`).
pub const MIN_RETENTION: std::time::Duration = std::time::Duration::from_secs(24 * 3600);
/// A file holding the Postgres URL (a mounted Secret); `IDEM_POSTGRES_URL` wins.
pub const ENV_POSTGRES_URL_FILE: &str = "IDEM_POSTGRES_URL_FILE";

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

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
    fn an_input_schema_says_which_fields_it_leaves_optional_and_what_violates_it() {
        let text = format!(
            "{MINIMAL_TOOL}input_schema = {{ type = \"object\", required = [\"to\", \"order\"], \
             properties = {{ order = {{ type = \"object\", required = [\"id\"] }} }} }}\n"
        );
        let c = Config::from_toml(&text, no_env).unwrap();
        let schema = c.tools[0].input_schema.as_ref().unwrap();
        assert!(!schema.makes_optional("args.to"));
        assert!(!schema.makes_optional("args.order.id"));
        assert!(schema.makes_optional("args.order.note"));
        assert!(schema.makes_optional("args.subject"));
        assert!(!schema.makes_optional("run_id"), "not an args field");
        let (message, fields) = schema
            .violations(&serde_json::json!({"to": "a", "order": {}}))
            .unwrap();
        assert_eq!(fields, vec!["/order".to_string()]);
        assert!(
            message.contains("args/order") && message.contains("\"id\""),
            "{message}"
        );
        assert!(schema
            .violations(&serde_json::json!({"to": "a", "order": {"id": 1}}))
            .is_none());
        let both = format!("{text}input_schema_file = \"/x.json\"\n");
        assert!(err(&both).contains("not both"));
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
    fn the_postgres_url_can_come_from_a_mounted_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("url");
        std::fs::write(&file, "postgres://u:p@db:5433/from_file\n").unwrap();
        let path = file.to_str().unwrap().to_string();
        let c = Config::from_toml(MINIMAL_TOOL, |k| {
            (k == ENV_POSTGRES_URL_FILE).then(|| path.clone())
        })
        .unwrap();
        assert_eq!(c.postgres.url, "postgres://u:p@db:5433/from_file");
        let e = Config::from_toml(MINIMAL_TOOL, |k| {
            (k == ENV_POSTGRES_URL_FILE).then(|| "/nonexistent/url".to_string())
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("IDEM_POSTGRES_URL_FILE") && e.contains("/nonexistent/url"),
            "{e}"
        );
    }

    #[test]
    fn a_kafka_secret_in_the_config_text_is_refused_with_where_it_goes() {
        let e = err("[kafka.client]\n\"sasl.password\" = \"hunter2\"\n");
        assert!(e.contains("`kafka.client.sasl.password`"), "{e}");
        assert!(e.contains("IDEM_KAFKA_SASL_PASSWORD"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        let e = err("[kafka.producer]\n\"ssl.key.password\" = \"x\"\n");
        assert!(e.contains("`kafka.producer.ssl.key.password`"), "{e}");
        let e = err("[kafka.client]\n\"enable.idempotence\" = \"false\"\n");
        assert!(e.contains("`kafka.client.enable.idempotence`"), "{e}");
        let e = err("[kafka.client]\n\"bootstrap.servers\" = \"b:1\"\n");
        assert!(e.contains("kafka.brokers"), "{e}");
    }

    #[test]
    fn librdkafkas_other_names_for_what_idem_sets_are_refused_as_the_names_are() {
        // Both names set, librdkafka would take whichever came last out of a hash map.
        let e = err("[kafka.producer]\n\"request.required.acks\" = \"1\"\n");
        assert!(e.contains("`kafka.producer.request.required.acks`"), "{e}");
        assert!(e.contains("cannot be overridden"), "{e}");
        let e = err("[kafka.client]\n\"request.required.acks\" = \"0\"\n");
        assert!(e.contains("`kafka.client.request.required.acks`"), "{e}");
        let e = err("[kafka.consumer]\n\"metadata.broker.list\" = \"b:1\"\n");
        assert!(e.contains("`kafka.consumer.metadata.broker.list`"), "{e}");
        assert!(e.contains("kafka.brokers"), "{e}");
    }

    #[test]
    fn kafka_secrets_come_from_a_file_or_the_environment_and_debug_never_shows_them() {
        let dir = std::env::temp_dir().join(format!("idem-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "from-the-file\n").unwrap();
        let text = format!(
            "[kafka.client]\n\"security.protocol\" = \"SASL_SSL\"\n\"sasl.password_file\" = \"{}\"\n",
            file.display()
        );
        let c = Config::from_toml(&text, no_env).unwrap();
        assert_eq!(c.kafka.client["security.protocol"], "SASL_SSL");
        assert_eq!(
            c.kafka.client_secrets["sasl.password"].expose(),
            "from-the-file"
        );
        assert!(!c.kafka.client.contains_key("sasl.password_file"));
        let shown = format!("{c:?}");
        assert!(!shown.contains("from-the-file"), "{shown}");

        let c = Config::from_toml(&text, |k| {
            (k == "IDEM_KAFKA_SASL_PASSWORD").then(|| "from-the-env".to_string())
        })
        .unwrap();
        assert_eq!(
            c.kafka.client_secrets["sasl.password"].expose(),
            "from-the-env"
        );

        let missing = "[kafka.client]\n\"sasl.password_file\" = \"/nonexistent/idem\"\n";
        let e = err(missing);
        assert!(
            e.contains("`kafka.client.sasl.password_file`") && e.contains("/nonexistent/idem"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn batch_linger_is_auto_by_default_or_a_fixed_duration() {
        let linger = |text: &str| Config::from_toml(text, no_env).unwrap().relay.batch_linger;
        assert_eq!(linger(""), BatchLinger::AUTO);
        assert_eq!(
            linger("[relay]\nbatch_linger = \"auto\"\n"),
            BatchLinger::AUTO
        );
        assert_eq!(
            linger("[relay]\nbatch_linger = \"0ms\"\n"),
            BatchLinger::Fixed(Duration::ZERO)
        );
        assert_eq!(
            linger("[relay]\nbatch_linger = \"5ms\"\n"),
            BatchLinger::Fixed(Duration::from_millis(5))
        );
        let e = err("[relay]\nbatch_linger = \"soon\"\n");
        assert!(e.contains("neither `auto` nor a duration"), "{e}");
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
            ("[relay]\nprune_share = 0.0\n", "relay.prune_share"),
            ("[relay]\nprune_share = 1.5\n", "relay.prune_share"),
            ("[kafka]\npartitions = 0\n", "kafka.partitions"),
            (
                "[kafka]\nreplication_factor = 0\n",
                "kafka.replication_factor",
            ),
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
            ExecutorKind::Sql(s) => assert_eq!(s.params.len(), 2),
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
        assert_eq!(
            c.admin.token.as_ref().map(Secret::expose),
            Some("0123456789abcdef")
        );
        assert!(!format!("{:?}", c.admin).contains("0123456789abcdef"));
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
        assert_eq!(t.classify(302), StatusClass::Failed);
        assert_eq!(t.classify(307), StatusClass::Failed);
        let text = MINIMAL_TOOL.replace("}", ", status = { failed = [409], retry = [500] } }");
        let c = Config::from_toml(&text, no_env).unwrap();
        let ExecutorKind::Http(h) = &c.tools[0].executor else {
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
            let ExecutorKind::Http(h) = &c.tools[0].executor else {
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
