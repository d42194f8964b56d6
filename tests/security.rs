//! Production connections against the local broker's SASL_SSL listener (SCRAM-SHA-512, a
//! certificate signed by the local CA that `deploy/local/services.sh` makes).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

/// The SASL_SSL listener, as `deploy/local/services.sh` starts it.
fn sasl_brokers() -> String {
    std::env::var("IDEM_TEST_KAFKA_SASL_BROKERS").unwrap_or_else(|_| "localhost:9094".into())
}

/// Where the local CA and certificates are.
fn tls_dir() -> PathBuf {
    match std::env::var("IDEM_LOCAL_DIR") {
        Ok(dir) => PathBuf::from(dir).join("tls"),
        Err(_) => {
            PathBuf::from(std::env::var("HOME").expect("HOME is set")).join(".cache/idem-local/tls")
        }
    }
}

/// This test's config, through the SASL_SSL listener, the password in a file.
fn sasl_config(env: &Env, dir: &Path, password: &str, ca: &Path) -> PathBuf {
    let password_file = dir.join("kafka-password");
    std::fs::write(&password_file, format!("{password}\n")).unwrap();
    let text = env.config_text(&email_tool(true), "").replacen(
        &format!("brokers = \"{}\"", brokers()),
        &format!("brokers = \"{}\"", sasl_brokers()),
        1,
    );
    assert!(
        text.contains(&sasl_brokers()),
        "the brokers line was replaced"
    );
    let text = format!(
        r#"{text}
[kafka.client]
"security.protocol" = "SASL_SSL"
"sasl.mechanism" = "SCRAM-SHA-512"
"sasl.username" = "idem"
"sasl.password_file" = "{}"
"ssl.ca.location" = "{}"
"#,
        password_file.display(),
        ca.display()
    );
    let path = dir.join("idem.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn idem(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .env_remove("IDEM_KAFKA_SASL_PASSWORD")
        .output()
        .expect("the idem binary runs")
}

#[tokio::test(flavor = "multi_thread")]
async fn relay_migrate_and_publish_work_end_to_end_over_sasl_ssl() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = sasl_config(&env, dir.path(), "idem-secret", &tls_dir().join("ca.pem"));
    let config_arg = config.to_str().unwrap();
    assert_succeeded("idem migrate", &idem(&["migrate", "--config", config_arg]));

    // The relay creates this test's topics through the SASL_SSL listener.
    let mut relay = Child::spawn(&config, None, dir.path().join("relay.log"));
    let mut published = None;
    for _ in 0..3 {
        let out = idem(&[
            "publish",
            "--config",
            config_arg,
            "--tool",
            "send_email",
            "--run-id",
            "run_tls",
            "--business-id",
            "order_1",
            "--args",
            r#"{"to":"a@example.com"}"#,
            "--wait",
            "60",
        ]);
        if out.status.success() {
            published = Some(out);
            break;
        }
        // The relay may still be creating the topics the CLI publishes to.
        if let Some(status) = relay.process.try_wait().unwrap() {
            panic!("relay exited with {status}: {}", relay.log_text());
        }
        eprintln!("publish: {}", String::from_utf8_lossy(&out.stderr));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let out = published.unwrap_or_else(|| {
        panic!(
            "publish --wait never succeeded; relay log:\n{}",
            relay.log_text()
        )
    });
    let outcome: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("the outcome is JSON");
    assert_eq!(outcome["data"]["status"], "succeeded", "{outcome}");
    assert_eq!(env.downstream.effects("run_tls:send_email:order_1"), 1);
    relay.signal("-TERM");
    assert!(
        relay.exited(Duration::from_secs(30)).await.success(),
        "{}",
        relay.log_text()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_kafka_password_stops_the_start_naming_the_listener_and_mechanism() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = sasl_config(
        &env,
        dir.path(),
        "not-the-password",
        &tls_dir().join("ca.pem"),
    );
    env.config(&email_tool(true), "").await; // migrates this test's schema
    let mut relay = Child::spawn(&config, None, dir.path().join("relay.log"));
    let status = relay.exited(Duration::from_secs(30)).await;
    let log = relay.log_text();
    assert!(!status.success(), "{log}");
    for said in [
        sasl_brokers().as_str(),
        "SASL_SSL",
        "SCRAM-SHA-512",
        "uthentication",
    ] {
        assert!(log.contains(said), "the error names {said:?}: {log}");
    }
    assert!(
        !log.contains("not-the-password"),
        "the password is never logged: {log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_certificate_from_another_ca_stops_the_start_with_the_tls_error() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = sasl_config(
        &env,
        dir.path(),
        "idem-secret",
        &tls_dir().join("other-ca.pem"),
    );
    env.config(&email_tool(true), "").await;
    let mut relay = Child::spawn(&config, None, dir.path().join("relay.log"));
    let status = relay.exited(Duration::from_secs(30)).await;
    let log = relay.log_text();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains(&sasl_brokers()) && log.contains("SSL"),
        "{log}"
    );
    assert!(
        log.to_lowercase().contains("certificate"),
        "the error says it is the certificate: {log}"
    );
}

#[test]
fn the_kafka_client_is_built_with_tls_and_every_scram_mechanism() {
    // librdkafka refuses values its build cannot honour ("not supported in this build").
    for mechanism in ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] {
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", "localhost:1")
            .set("security.protocol", "SASL_SSL")
            .set("sasl.mechanism", mechanism)
            .set("sasl.username", "idem")
            .set("sasl.password", "s");
        if mechanism == "OAUTHBEARER" {
            c.remove("sasl.username");
            c.remove("sasl.password");
            c.set("enable.sasl.oauthbearer.unsecure.jwt", "true");
        }
        let made: Result<rdkafka::producer::BaseProducer, _> = c.create();
        assert!(made.is_ok(), "{mechanism}: {:?}", made.err());
    }
}
