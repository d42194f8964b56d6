//! The `idem` binary: parses the command line, sets up logging, calls the library.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand, ValueEnum};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::Message;
use tokio_util::sync::CancellationToken;

use idem::config::Config;

#[derive(Parser)]
#[command(
    name = "idem",
    version,
    about = "Exactly-once execution of agent tool calls over Kafka and Postgres"
)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum ResolveAs {
    Succeeded,
    Failed,
    Retry,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the relay in the foreground until SIGTERM or SIGINT.
    Relay {
        #[arg(long)]
        config: PathBuf,
    },
    /// Apply the Postgres schema (safe to run twice, and from two hosts at once).
    Migrate {
        #[arg(long)]
        config: PathBuf,
    },
    /// Publish one action event to the actions topic, and optionally wait for its outcome.
    Publish {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        tool: String,
        #[arg(long)]
        run_id: String,
        /// The action's args, a JSON object.
        #[arg(long, default_value = "{}")]
        args: String,
        #[arg(long)]
        business_id: Option<String>,
        #[arg(long)]
        step: Option<i64>,
        /// The orchestrator's own idempotency key (otherwise the tool's key template decides).
        #[arg(long)]
        key: Option<String>,
        /// The CloudEvents id; a fresh one when not given.
        #[arg(long)]
        event_id: Option<String>,
        /// Wait up to this many seconds for the outcome answering this event and print it.
        #[arg(long)]
        wait: Option<u64>,
    },
    /// Everything about one key: deliveries (and why each came), attempts, decisions, outcomes.
    Explain {
        #[arg(long)]
        config: PathBuf,
        key: String,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Settle a key parked `unknown`, after checking downstream what really happened.
    Resolve {
        #[arg(long)]
        config: PathBuf,
        key: String,
        #[arg(long = "as", value_enum)]
        resolution: ResolveAs,
        /// Who decided (recorded).
        #[arg(long, env = "USER")]
        by: String,
        /// Why (recorded).
        #[arg(long)]
        reason: String,
    },
    /// Approve a key waiting for approval: it executes once, with the request recorded.
    Approve {
        #[arg(long)]
        config: PathBuf,
        key: String,
        #[arg(long, env = "USER")]
        by: String,
        #[arg(long, default_value = "approved")]
        reason: String,
        /// The material fingerprint you looked at (`idem explain`): refused if it changed.
        #[arg(long)]
        fingerprint: Option<String>,
    },
    /// Deny a key waiting for approval: it is rejected and never executed.
    Deny {
        #[arg(long)]
        config: PathBuf,
        key: String,
        #[arg(long, env = "USER")]
        by: String,
        #[arg(long)]
        reason: String,
    },
    /// Delete finished keys past their retention now (the relay also does it periodically).
    Prune {
        #[arg(long)]
        config: PathBuf,
    },
    /// Run the fake downstream that counts side effects (the example tools point at it).
    FakeDownstream {
        #[arg(long, default_value = "127.0.0.1:8787")]
        listen: std::net::SocketAddr,
        /// Replay the first result for a repeated Idempotency-Key instead of a new effect.
        #[arg(long)]
        honor_key: bool,
    },
}

fn load(path: &std::path::Path) -> anyhow::Result<Config> {
    Ok(Config::load(path, |k| std::env::var(k).ok())?)
}

/// `approve` and `deny`: the same function the admin API calls.
async fn decide(
    config: &std::path::Path,
    key: &str,
    decision: idem::gates::Decision,
    by: &str,
    reason: &str,
    fingerprint: Option<&str>,
) -> anyhow::Result<()> {
    let config = load(config)?;
    let pool = idem::db::pool(&config.postgres)?;
    let schema = &config.postgres.schema;
    idem::gates::decide(&pool, schema, key, decision, by, reason, fingerprint).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Crash tests name failpoints in FAILPOINTS; compiled in only with the `failpoints` feature.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let filter = tracing_subscriber::EnvFilter::try_from_env("IDEM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    match cli.command {
        Command::Relay { config } => {
            let config = load(&config)?;
            let shutdown = CancellationToken::new();
            let signal = shutdown.clone();
            tokio::spawn(async move {
                wait_for_signal().await;
                signal.cancel();
            });
            idem::relay::run(config, shutdown).await?;
        }
        Command::Migrate { config } => {
            let config = load(&config)?;
            let applied = idem::db::migrate(&config.postgres).await?;
            if applied.is_empty() {
                println!("schema {} is up to date", config.postgres.schema);
            } else {
                println!(
                    "schema {}: applied migrations {applied:?}",
                    config.postgres.schema
                );
            }
        }
        Command::Publish {
            config,
            tool,
            run_id,
            args,
            business_id,
            step,
            key,
            event_id,
            wait,
        } => {
            let config = load(&config)?;
            let args: serde_json::Value =
                serde_json::from_str(&args).context("--args is not JSON")?;
            if !args.is_object() {
                bail!("--args must be a JSON object");
            }
            let id = event_id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
            let mut data = serde_json::json!({"run_id": run_id, "tool": tool, "args": args});
            if let Some(b) = business_id {
                data["business_id"] = b.into();
            }
            if let Some(s) = step {
                data["step"] = s.into();
            }
            if let Some(k) = &key {
                data["idempotency_key"] = k.clone().into();
            }
            let event = serde_json::json!({
                "specversion": "1.0", "id": id, "source": "idem-cli", "type": idem::action::ACTION_TYPE,
                "time": chrono::Utc::now().to_rfc3339(), "datacontenttype": "application/json", "data": data,
            });
            let payload = serde_json::to_vec(&event)?;
            let kafka_key = key.unwrap_or(run_id);
            // Subscribe before publishing, from the end, so the outcome cannot be missed.
            let outcomes = match wait {
                Some(_) => Some(outcome_consumer(&config).await?),
                None => None,
            };
            let producer: FutureProducer = ClientConfig::new()
                .set("bootstrap.servers", &config.kafka.brokers)
                .set("enable.idempotence", "true")
                .create()?;
            producer
                .send(
                    FutureRecord::to(&config.kafka.actions_topic)
                        .key(&kafka_key)
                        .payload(&payload)
                        .headers(rdkafka::message::OwnedHeaders::new().insert(
                            rdkafka::message::Header {
                                key: "content-type",
                                value: Some(idem::action::STRUCTURED_CONTENT_TYPE),
                            },
                        )),
                    Duration::from_secs(30),
                )
                .await
                .map_err(|(e, _)| e)?;
            eprintln!("published action {id}");
            if let (Some(secs), Some(consumer)) = (wait, outcomes) {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
                loop {
                    let m = tokio::time::timeout_at(deadline, consumer.recv())
                        .await
                        .with_context(|| format!("no outcome for action {id} within {secs}s"))??;
                    let Some(p) = m.payload() else { continue };
                    let Ok(v) = serde_json::from_slice::<serde_json::Value>(p) else {
                        continue;
                    };
                    if v["data"]["action_event_id"] == id.as_str() {
                        println!("{}", serde_json::to_string_pretty(&v)?);
                        break;
                    }
                }
            }
        }
        Command::Explain { config, key, json } => {
            let config = load(&config)?;
            let pool = idem::db::pool(&config.postgres)?;
            let e = idem::ops::explain(&pool, &key).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&e)?);
            } else {
                print!("{}", idem::ops::render(&e));
            }
        }
        Command::Resolve {
            config,
            key,
            resolution,
            by,
            reason,
        } => {
            let config = load(&config)?;
            let pool = idem::db::pool(&config.postgres)?;
            let how = match resolution {
                ResolveAs::Succeeded => idem::ops::Resolution::Succeeded,
                ResolveAs::Failed => idem::ops::Resolution::Failed,
                ResolveAs::Retry => idem::ops::Resolution::Retry,
            };
            idem::ops::resolve(&pool, &config.postgres.schema, &key, how, &by, &reason).await?;
            println!("{key}: resolved as {} by {by}", how.as_str());
        }
        Command::Approve {
            config,
            key,
            by,
            reason,
            fingerprint,
        } => {
            let d = idem::gates::Decision::Approve;
            decide(&config, &key, d, &by, &reason, fingerprint.as_deref()).await?;
            println!("{key}: approved by {by}");
        }
        Command::Deny {
            config,
            key,
            by,
            reason,
        } => {
            let d = idem::gates::Decision::Deny;
            decide(&config, &key, d, &by, &reason, None).await?;
            println!("{key}: denied by {by}");
        }
        Command::Prune { config } => {
            let config = load(&config)?;
            let pool = idem::db::pool(&config.postgres)?;
            let n = idem::gates::prune(&pool, &config).await?;
            println!("pruned {n} expired keys (tombstones kept)");
        }
        Command::FakeDownstream { listen, honor_key } => {
            let shutdown = CancellationToken::new();
            let signal = shutdown.clone();
            tokio::spawn(async move {
                wait_for_signal().await;
                signal.cancel();
            });
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot listen on {listen}"))?;
            tracing::info!(%listen, honor_key, "fake downstream serving");
            idem::fake_downstream::FakeDownstream::new(honor_key)
                .serve(listener, shutdown)
                .await?;
        }
    }
    Ok(())
}

async fn outcome_consumer(config: &Config) -> anyhow::Result<StreamConsumer> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &config.kafka.brokers)
        .set("group.id", format!("idem-cli-{}", uuid::Uuid::new_v4()))
        .set("auto.offset.reset", "latest")
        .set("enable.auto.commit", "false")
        .create()?;
    consumer.subscribe(&[&config.kafka.outcomes_topic])?;
    // Wait for the assignment, so "latest" is resolved before the action goes out.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while consumer.assignment()?.count() == 0 {
        if std::time::Instant::now() > deadline {
            bail!(
                "no partitions of {} assigned within 15s",
                config.kafka.outcomes_topic
            );
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), consumer.recv()).await;
    }
    Ok(consumer)
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
