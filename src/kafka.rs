//! Kafka clients as idem needs them: a consumer that stores offsets only when told, an
//! idempotent producer, topic creation at start, and lag from librdkafka statistics.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::FutureProducer;
use rdkafka::{ClientContext, Statistics, TopicPartitionList};

use crate::config::KafkaConfig;
use crate::metrics::Metrics;

/// Sees librdkafka's statistics and rebalances; kept short, it runs on librdkafka's threads.
pub struct RelayContext {
    pub metrics: Arc<Metrics>,
    pub actions_topic: String,
    /// Cleared when librdkafka reports every broker down; `/readyz` reads it.
    pub brokers_up: Arc<AtomicBool>,
}

impl ClientContext for RelayContext {
    fn stats(&self, stats: Statistics) {
        let Some(topic) = stats.topics.get(&self.actions_topic) else {
            return;
        };
        for (id, p) in &topic.partitions {
            // Only partitions assigned here; librdkafka says -1 where it has no position yet.
            if *id < 0 || !p.desired {
                continue;
            }
            let lag = if p.consumer_lag >= 0 {
                p.consumer_lag
            } else if p.hi_offset >= 0 && p.lo_offset >= 0 {
                // No committed position yet: everything retained is still to be read.
                p.hi_offset - p.app_offset.max(p.lo_offset)
            } else {
                continue;
            };
            self.metrics.consumer_lag(*id, lag);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(
            error.rdkafka_error_code(),
            Some(RDKafkaErrorCode::AllBrokersDown)
        ) {
            self.brokers_up.store(false, Ordering::Relaxed);
        }
        tracing::warn!(%error, reason, "kafka client error");
    }

    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                tracing::error!(facility = fac, "{log_message}")
            }
            RDKafkaLogLevel::Warning => tracing::warn!(facility = fac, "{log_message}"),
            _ => tracing::debug!(facility = fac, "{log_message}"),
        }
    }
}

impl ConsumerContext for RelayContext {
    fn pre_rebalance(&self, _: &rdkafka::consumer::BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            tracing::info!(partitions = tpl.count(), "partitions revoked");
        }
    }

    fn post_rebalance(&self, _: &rdkafka::consumer::BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            self.brokers_up.store(true, Ordering::Relaxed);
            tracing::info!(partitions = tpl.count(), "partitions assigned");
        }
    }

    fn commit_callback(
        &self,
        result: rdkafka::error::KafkaResult<()>,
        _offsets: &TopicPartitionList,
    ) {
        if let Err(error) = result {
            if !matches!(error.rdkafka_error_code(), Some(RDKafkaErrorCode::NoOffset)) {
                tracing::warn!(%error, "offset commit failed; the next commit carries the same offsets");
            }
        }
    }
}

pub type ActionConsumer = StreamConsumer<RelayContext>;

pub fn consumer(cfg: &KafkaConfig, context: RelayContext) -> Result<ActionConsumer, KafkaError> {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers)
        .set("group.id", &cfg.group_id)
        .set("client.id", "idem-relay")
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true")
        .set("auto.commit.interval.ms", "1000")
        // Offsets are stored by the relay only once a message's intent is durable in Postgres.
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("session.timeout.ms", "10000")
        .set("heartbeat.interval.ms", "1000")
        .set("statistics.interval.ms", "5000")
        .set("queued.max.messages.kbytes", "16384");
    for (k, v) in &cfg.consumer_overrides {
        c.set(k, v);
    }
    c.create_with_context(context)
}

pub fn producer(cfg: &KafkaConfig) -> Result<FutureProducer, KafkaError> {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers)
        .set("client.id", "idem-relay")
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "2")
        .set("compression.type", "lz4")
        .set("message.timeout.ms", "30000");
    for (k, v) in &cfg.producer_overrides {
        c.set(k, v);
    }
    c.create()
}

/// Creates the actions, outcomes and dead-letter topics when they are missing.
pub async fn ensure_topics(cfg: &KafkaConfig) -> Result<(), KafkaError> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &cfg.brokers)
        .create()?;
    let topics = [
        NewTopic::new(
            &cfg.actions_topic,
            cfg.partitions,
            TopicReplication::Fixed(1),
        ),
        NewTopic::new(
            &cfg.outcomes_topic,
            cfg.partitions,
            TopicReplication::Fixed(1),
        ),
        NewTopic::new(&cfg.dlq_topic, 1, TopicReplication::Fixed(1)),
    ];
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for result in admin.create_topics(&topics, &opts).await? {
        match result {
            Ok(_) => {}
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(KafkaError::AdminOp(code)).inspect_err(|_| {
                    tracing::error!(topic, ?code, "cannot create topic");
                })
            }
        }
    }
    Ok(())
}
