//! The relay's entry point: wires consume → record → execute → record outcome → publish, and
//! shuts them down in that order so nothing recorded is left unpublished.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use deadpool_postgres::Pool;
use rdkafka::consumer::Consumer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ExecutorKind, ToolClass};
use crate::consume::Consume;
use crate::db;
use crate::execute::Executor;
use crate::kafka::{self, RelayContext};
use crate::metrics::Metrics;
use crate::ops::admin::{self, AdminState};
use crate::publish::{self, Publisher};

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// Its message names Postgres already.
    #[error("{0}")]
    Db(#[from] db::DbError),
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("{0}")]
    KafkaConnect(#[from] kafka::ConnectError),
    #[error("kafka topics: {0}")]
    Topics(String),
    #[error("admin listener on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "the database schema is at version {found}, this relay needs {needed}: run `idem migrate`"
    )]
    Schema { found: i32, needed: i32 },
    #[error(
        "the database schema is at version {found}, and relays that know migrations up to {knows} \
         (this one) may not run against it: it needs a relay that knows at least {floor}"
    )]
    SchemaAhead { found: i32, knows: i32, floor: i32 },
    #[error("mcp: {0}")]
    Mcp(String),
}

/// Outbox publishing rounds in flight at once.
const PUBLISHERS: usize = 2;

/// A started relay: where its admin listener is, and its metrics.
pub struct Handle {
    pub admin_addr: std::net::SocketAddr,
    pub metrics: Arc<Metrics>,
    done: tokio::task::JoinHandle<()>,
}

impl Handle {
    /// Waits until the relay has shut down (after `shutdown` was cancelled).
    pub async fn wait(self) {
        let _ = self.done.await;
    }
}

/// Runs the relay until `shutdown` is cancelled, then drains and returns.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), RelayError> {
    start(config, shutdown).await?.wait().await;
    Ok(())
}

/// Starts the relay in the background; errors in setting up are returned, not logged.
pub async fn start(config: Config, shutdown: CancellationToken) -> Result<Handle, RelayError> {
    let config = Arc::new(config);
    let metrics = Arc::new(Metrics::new());
    let tools: Vec<&str> = config.tools.iter().map(|t| t.name.as_str()).collect();
    metrics.prime(&tools, &[&config.kafka.outcomes_topic]);
    let pool = db::data_path_pool(&config.postgres)?;
    // Pruning and the admin API (explain, approvals) plan with the server's own settings, their
    // statements bounded.
    let maintenance = db::maintenance_pool(&config.postgres)?;
    check_schema(&pool, &config).await?;
    warn_about_gates(&config);

    let kafka = connect_kafka(&config, &metrics).await?;
    let listener = TcpListener::bind(config.admin.listen)
        .await
        .map_err(|source| RelayError::Listen {
            addr: config.admin.listen,
            source,
        })?;
    let admin_addr = listener.local_addr().map_err(|source| RelayError::Listen {
        addr: config.admin.listen,
        source,
    })?;
    let router = admin::router(AdminState {
        metrics: metrics.clone(),
        pool: maintenance.clone(),
        kafka_up: kafka.up.clone(),
        tokens: Arc::new(admin::Tokens {
            admin: config.admin.token.clone(),
            named: config.admin.named_tokens.clone(),
            read: config.admin.read_token.clone(),
            loopback: admin_addr.ip().is_loopback(),
        }),
        schema: config.postgres.schema.clone(),
        catalogue: Arc::new(crate::ops::catalogue(&config)),
        approval_timeouts: Arc::new(
            config
                .tools
                .iter()
                .filter(|t| t.approval != crate::config::Approval::None)
                .map(|t| (t.name.clone(), t.approval_timeout))
                .collect(),
        ),
        overview_span: Arc::default(),
        mcp: Arc::new(
            crate::mcp::Shared::new(&config, crate::mcp::HTTP_WAIT)
                .map_err(|e| RelayError::Mcp(format!("{e:#}")))?,
        ),
    });
    let control = db::control_pool(&config.postgres)?;
    let handoff = Arc::new(publish::handoff::Handoff::new());
    let executor = Executor::new(
        config.clone(),
        pool.clone(),
        control,
        metrics.clone(),
        handoff.clone(),
    );

    let tasks = Tasks::spawn(Stages {
        config: config.clone(),
        pool,
        maintenance,
        metrics: metrics.clone(),
        executor,
        handoff,
        kafka,
        listener,
        router,
        shutdown: shutdown.clone(),
    });
    tracing::info!(
        admin = %admin_addr,
        instance = %config.relay.instance_id,
        topic = %config.kafka.actions_topic,
        group = %config.kafka.group_id,
        tools = config.tools.len(),
        "relay started"
    );
    let done = tokio::spawn(tasks.stop_in_order(shutdown, config.relay.shutdown_grace));
    Ok(Handle {
        admin_addr,
        metrics,
        done,
    })
}

/// The relay's Kafka clients, connected and subscribed.
struct KafkaClients {
    consumer: Arc<kafka::ActionConsumer>,
    producer: kafka::SharedProducer,
    /// Whether the brokers answer; `/readyz` reads it, the consumer's context keeps it current.
    up: Arc<AtomicBool>,
}

/// Creates topics (when configured), subscribes the consumer and waits for the broker's first
/// answer, so a relay that started is ready for traffic.
async fn connect_kafka(
    config: &Config,
    metrics: &Arc<Metrics>,
) -> Result<KafkaClients, RelayError> {
    kafka::probe(&config.kafka).await?;
    if config.kafka.create_topics {
        kafka::ensure_topics(&config.kafka).await?;
    }
    let produce_limit = kafka::check_topics(&config.kafka)
        .await
        .map_err(RelayError::Topics)?;
    let up = Arc::new(AtomicBool::new(false));
    let consumer = Arc::new(kafka::consumer(
        &config.kafka,
        RelayContext {
            metrics: metrics.clone(),
            actions_topic: config.kafka.actions_topic.clone(),
            group: config.kafka.group_id.clone(),
            brokers_up: up.clone(),
        },
    )?);
    consumer.subscribe(&[&config.kafka.actions_topic])?;
    consumer.fetch_metadata(
        Some(&config.kafka.actions_topic),
        std::time::Duration::from_secs(10),
    )?;
    up.store(true, Ordering::Relaxed);
    let producer =
        kafka::SharedProducer::new(&kafka::sized_to_topics(&config.kafka, produce_limit))?;
    Ok(KafkaClients {
        consumer,
        producer,
        up,
    })
}

/// What the background tasks are made from.
struct Stages {
    config: Arc<Config>,
    /// The data path's pool (consume, execute, publish).
    pool: Pool,
    /// Pruning and the admin API.
    maintenance: Pool,
    metrics: Arc<Metrics>,
    executor: Arc<Executor>,
    /// Outbox rows the executor's finishes hand to the publishers.
    handoff: Arc<publish::handoff::Handoff>,
    kafka: KafkaClients,
    listener: TcpListener,
    router: axum::Router,
    /// Cancelled by the caller: consuming stops first.
    shutdown: CancellationToken,
}

/// The relay's background tasks, each one stopped at its place in the shutdown order.
struct Tasks {
    consume: JoinHandle<()>,
    recovery: JoinHandle<()>,
    /// Stops starting queued calls and drains those in flight.
    executor: Arc<Executor>,
    /// Several rounds in flight, so a round waiting for Kafka's acknowledgement does not hold
    /// up an outcome recorded meanwhile (SKIP LOCKED keeps their rows apart).
    publishers: Vec<JoinHandle<()>>,
    /// Cancelled once calls are drained: the publishers' last round.
    publisher_drained: CancellationToken,
    /// Cancelled last: leases, pruning, LISTEN and the admin listener.
    stop_background: CancellationToken,
    leases: JoinHandle<()>,
    prune: JoinHandle<()>,
    listen: JoinHandle<()>,
    admin: JoinHandle<()>,
    /// Flushed before the relay returns, so an outcome handed to it is not dropped.
    producer: kafka::SharedProducer,
    /// Held until the end so the group's members leave only once the offsets are final.
    consumer: Arc<kafka::ActionConsumer>,
}

impl Tasks {
    fn spawn(s: Stages) -> Tasks {
        let Stages {
            config,
            pool,
            maintenance,
            metrics,
            executor,
            handoff,
            kafka,
            listener,
            router,
            shutdown,
        } = s;
        let stop_background = CancellationToken::new();
        let publisher_drained = CancellationToken::new();

        let admin = tokio::spawn(crate::ops::serve(
            listener,
            router,
            crate::ops::Limits {
                header_timeout: config.admin.header_timeout,
                request_timeout: config.admin.request_timeout,
                max_connections: config.admin.max_connections,
            },
            stop_background.clone(),
        ));
        let listen = tokio::spawn(publish::listen(
            config.clone(),
            handoff.clone(),
            stop_background.clone(),
        ));
        let publishers = (0..PUBLISHERS)
            .map(|_| {
                let publisher = Publisher {
                    config: config.clone(),
                    pool: pool.clone(),
                    producer: kafka.producer.clone(),
                    metrics: metrics.clone(),
                    handoff: handoff.clone(),
                };
                tokio::spawn(publisher.run(
                    stop_background.clone(),
                    publisher_drained.clone(),
                    config.relay.shutdown_grace,
                ))
            })
            .collect();
        let leases = tokio::spawn(executor.clone().keep_leases(stop_background.clone()));
        let recovery = tokio::spawn(crate::recovery::run(
            executor.clone(),
            config.relay.recovery_interval,
            stop_background.clone(),
        ));
        let consume = Consume {
            config: config.clone(),
            consumer: kafka.consumer.clone(),
            producer: kafka.producer.clone(),
            pool,
            executor: executor.clone(),
            metrics,
            known: crate::intent::KnownKeys::default(),
        };
        let consume = tokio::spawn(consume.run(shutdown));
        let prune = tokio::spawn(prune_loop(maintenance, config, stop_background.clone()));
        Tasks {
            consume,
            recovery,
            executor,
            publishers,
            publisher_drained,
            stop_background,
            leases,
            prune,
            listen,
            admin,
            producer: kafka.producer,
            consumer: kafka.consumer,
        }
    }

    /// Waits for `shutdown`, then stops the stages in pipeline order so nothing recorded is
    /// left unpublished.
    async fn stop_in_order(self, shutdown: CancellationToken, grace: std::time::Duration) {
        shutdown.cancelled().await;
        tracing::info!("shutting down: consuming stopped, draining in-flight calls");
        // Nothing queued starts any more, even while the consumer finishes its batch.
        self.executor.stop_starting();
        let _ = self.consume.await;
        self.recovery.abort();
        self.executor.drain(grace).await;
        // Leases are kept until the calls are drained, then publishing gets its last round.
        self.publisher_drained.cancel();
        for task in self.publishers {
            let _ = task.await;
        }
        self.stop_background.cancel();
        let _ = self.leases.await;
        let _ = self.prune.await;
        let _ = self.listen.await;
        let _ = rdkafka::producer::Producer::flush(
            &self.producer.get().1,
            std::time::Duration::from_secs(10),
        );
        drop(self.consumer);
        let _ = self.admin.await;
        tracing::info!("relay stopped");
    }
}

/// Start-up warnings for configs that leave a dangerous effect unprotected.
fn warn_about_gates(config: &Config) {
    for tool in &config.tools {
        // A key or material field the schema lets go missing: such actions share a key part
        // of null, and a change of that field goes unseen.
        if let Some(schema) = &tool.input_schema {
            for field in tool.key.iter().chain(&tool.material) {
                if schema.makes_optional(&field.0) {
                    tracing::warn!(
                        tool = %tool.name,
                        field = %field.0,
                        "input_schema makes a key or material field optional: mark it required"
                    );
                }
            }
        }
        if tool.class != ToolClass::Dangerous {
            continue;
        }
        let unverifiable = tool.verify.is_none()
            && !tool.honors_key()
            && matches!(tool.executor, ExecutorKind::Http(_));
        if unverifiable && tool.approval_opted_out {
            tracing::warn!(
                tool = %tool.name,
                "approval = \"none\" on a dangerous tool with no verify and a downstream that does not honour the key: an ambiguous call is parked unknown and nothing can tell whether it happened"
            );
        } else if unverifiable && tool.approval == crate::config::Approval::Required {
            tracing::info!(tool = %tool.name, "dangerous tool with no verify: every intent waits for approval (set verify, honors_key or approval = \"none\")");
        }
        if tool.key_too_coarse() {
            let example: Vec<&str> = tool.key.iter().map(|f| f.0.as_str()).collect();
            tracing::warn!(
                tool = %tool.name,
                key = ?example,
                "key names no field of the intended effect (such as args.template): run:send_email:order_8812 would answer a legitimate \"refund paid\" email with the \"refund approved\" one already sent"
            );
        }
    }
}

/// Prunes expired keys every `prune_interval`, in every relay (rows are locked SKIP LOCKED),
/// paced to `prune_share` of the time.
async fn prune_loop(pool: Pool, config: Arc<Config>, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(config.relay.prune_interval) => {}
        }
        match crate::gates::prune(&pool, &config, &shutdown).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(pruned = n, "expired keys pruned; tombstones kept"),
            Err(e) => tracing::warn!(error = %e, "prune failed"),
        }
    }
}

async fn check_schema(pool: &Pool, config: &Config) -> Result<(), RelayError> {
    let client = pool
        .get()
        .await
        .map_err(|e| db::DbError::from(e).with_tls_settings(&config.postgres))?;
    let found: i32 = match client
        .query_one(
            "select coalesce(max(version), 0) from idem_schema_versions",
            &[],
        )
        .await
    {
        Ok(row) => row.get(0),
        Err(_) => 0,
    };
    let needed = db::latest_version();
    if found < needed {
        return Err(RelayError::Schema { found, needed });
    }
    if found > needed {
        // Migrations from a newer relay (a rolling upgrade under way): allowed down to the
        // schema's floor.
        let floor: i32 = client
            .query_one(
                "select coalesce(max(migration), 0) from idem_relay_floor",
                &[],
            )
            .await
            .map_err(db::DbError::from)?
            .get(0);
        if floor > needed {
            return Err(RelayError::SchemaAhead {
                found,
                knows: needed,
                floor,
            });
        }
        tracing::warn!(
            schema = found,
            relay = needed,
            "the database schema is newer than this relay, which may run beside the newer ones (a rolling upgrade)"
        );
    }
    Ok(())
}
