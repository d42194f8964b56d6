//! The foundation: migrations, the real broker, the binary's config errors, the compose file.

mod common;

use std::path::Path;
use std::time::Duration;

use idem::config::Config;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::Message;

fn postgres_config(schema: &str) -> idem::config::PostgresConfig {
    let text = format!(
        "[postgres]\nurl = \"{}\"\nschema = \"{schema}\"\n",
        common::postgres_url()
    );
    Config::from_toml(&text, |_| None).unwrap().postgres
}

#[tokio::test]
async fn migrations_apply_once_even_twice_and_concurrently() {
    let schema = common::unique("m");
    let cfg = postgres_config(&schema);
    let runs = futures::future::join_all((0..4).map(|_| idem::db::migrate(&cfg))).await;
    let applied: Vec<Vec<i32>> = runs.into_iter().map(|r| r.expect("migrate")).collect();
    let non_empty: Vec<_> = applied.iter().filter(|a| !a.is_empty()).collect();
    assert_eq!(
        non_empty.len(),
        1,
        "exactly one concurrent run applies: {applied:?}"
    );
    let all: Vec<i32> = (1..=idem::db::latest_version()).collect();
    assert_eq!(non_empty[0], &all, "every migration, in order");
    assert!(
        idem::db::migrate(&cfg).await.unwrap().is_empty(),
        "a second run applies nothing"
    );

    let env_schema = schema.clone();
    let mut pg: tokio_postgres::Config = common::postgres_url().parse().unwrap();
    pg.options(format!("-c search_path={env_schema}"));
    let (client, conn) = pg.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let versions: i64 = client
        .query_one("select count(*) from idem_schema_versions", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(versions, i64::from(idem::db::latest_version()));
    // The unique key is what makes a second insert of the same key impossible.
    client
        .execute("insert into intents (idempotency_key, tool, class, run_id, args, material, fingerprint, args_hash, action_event_id, source_topic, source_partition, source_offset) values ('k', 't', 'dangerous', 'r', '{}', '{}', 'f', 'h', 'e', 'x', 0, 0)", &[])
        .await
        .unwrap();
    let dup = client
        .execute("insert into intents (idempotency_key, tool, class, run_id, args, material, fingerprint, args_hash, action_event_id, source_topic, source_partition, source_offset) values ('k', 't', 'dangerous', 'r', '{}', '{}', 'f', 'h', 'e2', 'x', 0, 1)", &[])
        .await
        .unwrap_err();
    assert_eq!(
        dup.code(),
        Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
    );
}

#[tokio::test]
async fn produce_and_consume_on_the_real_broker() {
    let topic = common::unique("roundtrip");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", common::brokers())
        .create()
        .unwrap();
    let created = admin
        .create_topics(
            &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
    assert!(created[0].is_ok(), "{created:?}");
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", common::brokers())
        .set("enable.idempotence", "true")
        .create()
        .unwrap();
    producer
        .send(
            FutureRecord::to(&topic).key("k").payload("hello"),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", common::brokers())
        .set("group.id", common::unique("g"))
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[&topic]).unwrap();
    let m = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
        .await
        .expect("a message within 30s")
        .unwrap();
    assert_eq!(m.payload(), Some(&b"hello"[..]));
    assert_eq!(m.key(), Some(&b"k"[..]));
}

#[test]
fn an_invalid_config_fails_at_start_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[relay]\nconcurrency = 0\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["relay", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("`relay.concurrency`") && stderr.contains("at least 1"),
        "{stderr}"
    );
}

#[tokio::test]
async fn the_relay_refuses_an_unmigrated_schema() {
    let env = common::Env::new().await;
    let config = Config::from_toml(&env.config_text("", ""), |_| None).unwrap();
    let err = match idem::relay::start(config, tokio_util::sync::CancellationToken::new()).await {
        Ok(_) => panic!("started without a schema"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("idem migrate"), "{err}");
}

/// A schema whose migrations older relays cannot work beside names the oldest relay it allows
/// (`idem_relay_floor`): a relay that knows fewer migrations refuses to start, saying which it
/// needs. One at the floor starts beside the newer schema (a rolling upgrade).
#[tokio::test]
async fn a_relay_older_than_the_schemas_floor_refuses_to_start() {
    let env = common::Env::new().await;
    let config = env.config("", "").await; // migrates the schema
    let pg = env.pg().await;
    let knows = idem::db::latest_version();
    let newer = knows + 1;
    pg.execute(
        "insert into idem_schema_versions (version, name) values ($1, 'from a newer relay')",
        &[&newer],
    )
    .await
    .unwrap();
    pg.execute("update idem_relay_floor set migration = $1", &[&newer])
        .await
        .unwrap();
    let err = match idem::relay::start(config.clone(), tokio_util::sync::CancellationToken::new())
        .await
    {
        Ok(_) => panic!("started against a schema that needs a newer relay"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(&format!("version {newer}"))
            && err.contains(&format!("migrations up to {knows}"))
            && err.contains(&format!("at least {newer}")),
        "{err}"
    );

    pg.execute("update idem_relay_floor set migration = $1", &[&knows])
        .await
        .unwrap();
    let relay = env.start(config).await;
    relay.stop().await;
}

/// No Docker engine runs here, so the compose file is checked for what can be checked: its
/// services exist, and everything it builds from or mounts is in the repo.
#[test]
fn compose_file_names_files_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("docker-compose.yml")).unwrap();
    let doc: serde_norway::Value = serde_norway::from_str(&text).unwrap();
    let services = doc["services"].as_mapping().expect("services");
    for name in ["kafka", "postgres", "relay", "prometheus", "grafana"] {
        assert!(services.contains_key(name), "service {name} missing");
    }
    let mut checked = 0;
    for (name, svc) in services {
        if let Some(build) = svc.get("build") {
            let context = build
                .get("context")
                .and_then(|c| c.as_str())
                .or(build.as_str())
                .unwrap();
            let dockerfile = build
                .get("dockerfile")
                .and_then(|d| d.as_str())
                .unwrap_or("Dockerfile");
            assert!(
                root.join(context).join(dockerfile).is_file(),
                "{name:?}: {dockerfile} missing"
            );
            checked += 1;
        }
        for volume in svc
            .get("volumes")
            .and_then(|v| v.as_sequence())
            .into_iter()
            .flatten()
        {
            let spec = volume.as_str().unwrap();
            let host = spec.split(':').next().unwrap();
            if host.starts_with("./") {
                assert!(
                    root.join(host).exists(),
                    "{name:?} mounts {host}, which is not in the repo"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 5, "only {checked} paths checked");
    // The config the compose relay mounts must be one the relay accepts.
    let compose_config = root.join("deploy/compose/idem.toml");
    Config::load(&compose_config, |_| None).expect("compose config is valid");
}
