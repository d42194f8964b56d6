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
fn the_kafka_client_is_built_with_tls_every_scram_mechanism_and_oidc() {
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
    // OAUTHBEARER with OIDC client credentials: librdkafka fetches the token itself, which it
    // can only when built with libcurl.
    let mut c = rdkafka::ClientConfig::new();
    c.set("bootstrap.servers", "localhost:1")
        .set("security.protocol", "SASL_SSL")
        .set("sasl.mechanism", "OAUTHBEARER")
        .set("sasl.oauthbearer.method", "oidc")
        .set("sasl.oauthbearer.client.id", "idem")
        .set("sasl.oauthbearer.client.secret", "s")
        .set(
            "sasl.oauthbearer.token.endpoint.url",
            "https://127.0.0.1:1/oauth2/token",
        );
    let made: Result<rdkafka::producer::BaseProducer, _> = c.create();
    assert!(made.is_ok(), "OAUTHBEARER oidc: {:?}", made.err());
}

/// The local server's TLS-only role (`deploy/local/services.sh`: `hostssl` for `idem_tls`,
/// `hostnossl … reject`), with these URL parameters.
fn tls_postgres_url(params: &str) -> String {
    format!(
        "postgres://idem_tls:idem-tls@localhost:{}/idem?{params}",
        pg_port()
    )
}

fn with_postgres_url(env: &Env, url: &str) -> idem::config::Config {
    let text = env.config_text(&email_tool(true), "").replacen(
        &format!("url = \"{}\"", postgres_url()),
        &format!("url = \"{url}\""),
        1,
    );
    assert!(text.contains(url), "the postgres url was replaced");
    idem::config::Config::from_toml(&text, |_| None).expect("the config is valid")
}

/// Every connection idem holds as `idem_tls`, and how many of them are encrypted.
async fn tls_connections(env: &Env, query_prefix: &str) -> (i64, i64) {
    let row = env
        .pg()
        .await
        .query_one(
            "select count(*) filter (where s.ssl), count(*)
               from pg_stat_activity a join pg_stat_ssl s using (pid)
              where a.usename = 'idem_tls' and a.application_name = 'idem'
                and a.query like $1 || '%'",
            &[&query_prefix],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// `sslmode=verify-full` with the local CA: migrate, the relay's pools and its LISTEN
/// connection all go over TLS, and an action runs end to end.
#[tokio::test(flavor = "multi_thread")]
async fn the_relay_runs_over_postgres_tls_with_verify_full() {
    let env = Env::new().await;
    let ca = tls_dir().join("ca.pem");
    let url = tls_postgres_url(&format!("sslmode=verify-full&sslrootcert={}", ca.display()));
    let config = with_postgres_url(&env, &url);
    idem::db::migrate(&config.postgres)
        .await
        .expect("migrate over TLS");
    let relay = env.start(config).await;
    let outcomes = env.outcomes().await;
    let event = action(
        "tls-1",
        serde_json::json!({"tool": "send_email", "run_id": "run_pg_tls", "business_id": "o1",
                           "args": {"to": "a@example.com"}}),
    );
    env.producer().send(&event).await;
    outcomes.answer("tls-1", "succeeded").await;
    assert_eq!(env.downstream.effects("run_pg_tls:send_email:o1"), 1);
    eventually(
        "the LISTEN connection is up",
        Duration::from_secs(20),
        || async { tls_connections(&env, "listen ").await.1 >= 1 },
    )
    .await;
    let (encrypted, all) = tls_connections(&env, "").await;
    assert!(all >= 2, "the relay holds connections as idem_tls: {all}");
    assert_eq!(encrypted, all, "every connection is encrypted");
    relay.stop().await;
}

/// Each `sslmode` against the local server, through `migrate`: what connects, and what is
/// refused says why (the certificate's CA; the server's hostssl-only rule).
#[tokio::test(flavor = "multi_thread")]
async fn each_sslmode_connects_or_says_why_not() {
    let env = Env::new().await;
    let ca = tls_dir().join("ca.pem").display().to_string();
    let other_ca = tls_dir().join("other-ca.pem").display().to_string();
    let cases: &[(String, Result<(), &[&str]>)] = &[
        ("sslmode=prefer".into(), Ok(())),
        ("sslmode=require".into(), Ok(())),
        (format!("sslmode=verify-ca&sslrootcert={ca}"), Ok(())),
        (format!("sslmode=verify-full&sslrootcert={ca}"), Ok(())),
        (
            format!("sslmode=verify-full&sslrootcert={other_ca}"),
            Err(&[
                "certificate",
                "UnknownIssuer",
                "sslmode=verify-full",
                "other-ca.pem",
            ]),
        ),
        (
            format!("sslmode=require&sslrootcert={other_ca}"),
            Err(&["certificate", "UnknownIssuer"]),
        ),
        (
            "sslmode=disable".into(),
            Err(&["pg_hba.conf", "no encryption", "28000"]),
        ),
    ];
    for (params, expected) in cases {
        let config = with_postgres_url(&env, &tls_postgres_url(params));
        let got = idem::db::migrate(&config.postgres).await;
        match (expected, got) {
            (Ok(()), Ok(_)) => {}
            (Err(words), Err(e)) => {
                let said = e.to_string();
                for word in *words {
                    assert!(
                        said.contains(word),
                        "{params}: the error names {word:?}: {said}"
                    );
                }
                assert!(!said.contains("idem-tls"), "no password in errors: {said}");
            }
            (Ok(()), Err(e)) => panic!("{params}: expected to connect: {e} ({e:?})"),
            (Err(_), Ok(_)) => panic!("{params}: expected a refusal"),
        }
    }
}

/// A relay whose Postgres certificate is from another CA does not start, and says so.
#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_certificate_from_another_ca_stops_the_relay_start() {
    let env = Env::new().await;
    let url = tls_postgres_url(&format!(
        "sslmode=verify-full&sslrootcert={}",
        tls_dir().join("other-ca.pem").display()
    ));
    let config = with_postgres_url(&env, &url);
    let started = idem::relay::start(config, tokio_util::sync::CancellationToken::new()).await;
    let e = started
        .err()
        .expect("the relay refuses to start")
        .to_string();
    assert!(
        e.contains("certificate") && e.contains("sslmode=verify-full"),
        "{e}"
    );
}

/// A TLS front for the fake downstream: the local CA's server certificate for `localhost`, and a
/// client certificate signed by the local CA demanded of every caller. What it decrypts goes to
/// `upstream` as is. Returns its port.
async fn mutual_tls_front(upstream: std::net::SocketAddr) -> u16 {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(tls_dir().join("ca.pem")).unwrap() {
        roots.add(ca.unwrap()).unwrap();
    }
    let clients = rustls::server::WebPkiClientVerifier::builder_with_provider(
        std::sync::Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let chain: Vec<_> = CertificateDer::pem_file_iter(tls_dir().join("server.pem"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(tls_dir().join("server.key")).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(clients)
        .with_single_cert(chain, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A caller without the right certificate fails here, before any byte is passed.
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut plain) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    port
}

/// `executor.tls` gives one tool a private CA and a client certificate: it reaches a downstream
/// that demands both. A tool without it is refused at the handshake (the CA is not public), so
/// nothing is sent and its action fails `downstream_unreachable`, never `unknown`.
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_with_its_own_ca_and_client_certificate_reaches_a_mutual_tls_downstream() {
    let env = Env::new().await;
    let upstream: std::net::SocketAddr = env
        .downstream_url
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let port = mutual_tls_front(upstream).await;
    let tls = tls_dir();
    let tools = format!(
        r#"
[[tools]]
name = "send_email"
class = "idempotent"
key = ["run_id", "tool", "business_id"]
executor = {{ kind = "http", url = "https://localhost:{port}/v1/send_email", timeout = "2s", tls = {{ ca_file = "{ca}", cert_file = "{cert}", key_file = "{key}" }} }}

[[tools]]
name = "notify"
class = "idempotent"
key = ["run_id", "tool", "business_id"]
executor = {{ kind = "http", url = "https://localhost:{port}/v1/notify", timeout = "2s" }}
retry = {{ max_attempts = 2, initial_backoff = "10ms", max_backoff = "20ms" }}
"#,
        ca = tls.join("ca.pem").display(),
        cert = tls.join("client.pem").display(),
        key = tls.join("client.key").display(),
    );
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(&tools, "").await).await;
    let p = env.producer();
    for (id, tool) in [("mtls-1", "send_email"), ("mtls-2", "notify")] {
        p.send(&action(
            id,
            serde_json::json!({"run_id": "run_mtls", "tool": tool, "business_id": "b1", "args": {}}),
        ))
        .await;
    }
    let ok = outcomes.answer("mtls-1", "succeeded").await;
    assert_eq!(ok["data"]["result"]["tool"], "send_email", "{ok}");
    let refused = outcomes.answer("mtls-2", "failed").await;
    assert_eq!(
        refused["data"]["error"]["code"], "downstream_unreachable",
        "{refused}"
    );
    assert_eq!(env.downstream.effects("run_mtls:send_email:b1"), 1);
    assert_eq!(
        env.downstream.requests(),
        1,
        "nothing of notify went through"
    );
    relay.stop().await;
}

/// A bad `executor.tls` stops the config load, naming the field.
#[test]
fn executor_tls_files_are_checked_at_load() {
    let tls = tls_dir();
    let config = |inline: &str| {
        format!(
            r#"
[[tools]]
name = "t"
class = "idempotent"
key = ["run_id"]
executor = {{ kind = "http", url = "https://x/v1", tls = {{ {inline} }} }}
"#
        )
    };
    let err = |inline: String| {
        idem::config::Config::from_toml(&config(&inline), |_| None)
            .unwrap_err()
            .to_string()
    };
    let e = err(format!(
        "cert_file = \"{}\"",
        tls.join("client.pem").display()
    ));
    assert!(
        e.contains("tools[0].executor.tls.key_file") || e.contains("executor.tls.key_file"),
        "{e}"
    );
    let e = err("ca_file = \"/nonexistent/ca.pem\"".into());
    assert!(
        e.contains("executor.tls.ca_file") && e.contains("cannot read"),
        "{e}"
    );
    let e = err(format!(
        "ca_file = \"{}\"",
        tls.join("server.ext").display()
    ));
    assert!(e.contains("executor.tls.ca_file"), "{e}");
    assert!(err(String::new()).contains("executor.tls"));
    let fine = format!(
        "ca_file = \"{}\", cert_file = \"{}\", key_file = \"{}\"",
        tls.join("ca.pem").display(),
        tls.join("client.pem").display(),
        tls.join("client.key").display()
    );
    let c = idem::config::Config::from_toml(&config(&fine), |_| None).unwrap();
    assert!(
        !format!("{c:?}").contains("PRIVATE KEY"),
        "the key never shows in Debug"
    );
}
