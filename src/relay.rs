//! The relay's entry point: wires consume → record → execute → record outcome → publish, and
//! shuts them down in that order so nothing recorded is left unpublished.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rdkafka::consumer::Consumer;
use tokio::net::TcpListener;
use tokio::sync::Notify;
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
    #[error("postgres: {0}")]
    Db(#[from] db::DbError),
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("admin listener on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "the database schema is at version {found}, this relay needs {needed}: run `idem migrate`"
    )]
    Schema { found: i32, needed: i32 },
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
    let pool = db::data_path_pool(&config.postgres)?;
    // Pruning and the admin API (explain, approvals) plan with the server's own settings.
    let maintenance = db::pool(&config.postgres)?;
    check_schema(&pool).await?;
    warn_about_gates(&config);

    if config.kafka.create_topics {
        kafka::ensure_topics(&config.kafka).await?;
    }
    let kafka_up = Arc::new(AtomicBool::new(false));
    let consumer = Arc::new(kafka::consumer(
        &config.kafka,
        RelayContext {
            metrics: metrics.clone(),
            actions_topic: config.kafka.actions_topic.clone(),
            brokers_up: kafka_up.clone(),
        },
    )?);
    consumer.subscribe(&[&config.kafka.actions_topic])?;
    // Topics exist (or were checked) and the broker answered: ready for traffic.
    consumer.fetch_metadata(
        Some(&config.kafka.actions_topic),
        std::time::Duration::from_secs(10),
    )?;
    kafka_up.store(true, Ordering::Relaxed);
    let producer = kafka::SharedProducer::new(&config.kafka)?;

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
        kafka_up,
        token: config.admin.token.clone().map(Arc::new),
        schema: config.postgres.schema.clone(),
    });

    let control = db::control_pool(&config.postgres)?;
    let executor = Executor::new(config.clone(), pool.clone(), control, metrics.clone());
    let wake = Arc::new(Notify::new());
    let stop_background = CancellationToken::new();
    let publisher_drained = CancellationToken::new();

    let consume = Consume {
        config: config.clone(),
        consumer: consumer.clone(),
        producer: producer.clone(),
        pool: pool.clone(),
        executor: executor.clone(),
        metrics: metrics.clone(),
    };
    let admin_stop = stop_background.clone();
    let admin_task = tokio::spawn(async move {
        use axum::serve::ListenerExt;
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let _ = axum::serve(listener, router)
            .with_graceful_shutdown(async move { admin_stop.cancelled().await })
            .await;
    });
    let listen_task = tokio::spawn(publish::listen(
        config.clone(),
        wake.clone(),
        stop_background.clone(),
    ));
    // Several rounds in flight (SKIP LOCKED keeps their rows apart), so an outcome recorded
    // during one round's wait for Kafka's acknowledgement does not wait for that round.
    let publish_tasks: Vec<_> = (0..PUBLISHERS)
        .map(|_| {
            let publisher = Publisher {
                config: config.clone(),
                pool: pool.clone(),
                producer: producer.clone(),
                metrics: metrics.clone(),
                wake: wake.clone(),
            };
            tokio::spawn(publisher.run(
                stop_background.clone(),
                publisher_drained.clone(),
                config.relay.shutdown_grace,
            ))
        })
        .collect();
    let lease_task = tokio::spawn(executor.clone().keep_leases(stop_background.clone()));
    let recovery_task = tokio::spawn(crate::recovery::run(
        executor.clone(),
        config.relay.recovery_interval,
        stop_background.clone(),
    ));
    let consume_task = tokio::spawn(consume.run(shutdown.clone()));
    let prune_task = tokio::spawn(prune_loop(
        maintenance,
        config.clone(),
        stop_background.clone(),
    ));

    tracing::info!(
        admin = %admin_addr,
        instance = %config.relay.instance_id,
        topic = %config.kafka.actions_topic,
        group = %config.kafka.group_id,
        tools = config.tools.len(),
        "relay started"
    );

    let grace = config.relay.shutdown_grace;
    let done = tokio::spawn(async move {
        shutdown.cancelled().await;
        tracing::info!("shutting down: consuming stopped, draining in-flight calls");
        // Nothing queued starts any more, even while the consumer finishes its batch.
        executor.stop_starting();
        let _ = consume_task.await;
        recovery_task.abort();
        executor.drain(grace).await;
        // Leases are kept until the calls are drained, then publishing gets its last round.
        publisher_drained.cancel();
        for task in publish_tasks {
            let _ = task.await;
        }
        stop_background.cancel();
        let _ = lease_task.await;
        let _ = prune_task.await;
        let _ = listen_task.await;
        let _ = rdkafka::producer::Producer::flush(
            &producer.get().1,
            std::time::Duration::from_secs(10),
        );
        drop(consumer);
        let _ = admin_task.await;
        tracing::info!("relay stopped");
    });
    Ok(Handle {
        admin_addr,
        metrics,
        done,
    })
}

/// Start-up warnings for configs that leave a dangerous effect unprotected.
fn warn_about_gates(config: &Config) {
    for tool in &config.tools {
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

/// Prunes expired keys every `prune_interval`, in every relay (rows are locked SKIP LOCKED).
async fn prune_loop(
    pool: deadpool_postgres::Pool,
    config: Arc<Config>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(config.relay.prune_interval) => {}
        }
        match crate::gates::prune(&pool, &config).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(pruned = n, "expired keys pruned; tombstones kept"),
            Err(e) => tracing::warn!(error = %e, "prune failed"),
        }
    }
}

async fn check_schema(pool: &deadpool_postgres::Pool) -> Result<(), RelayError> {
    let client = pool.get().await.map_err(db::DbError::from)?;
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
    Ok(())
}
