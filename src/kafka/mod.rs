//! Kafka clients as idem needs them: a consumer that stores offsets only when told, an
//! idempotent producer, topic creation at start, and lag from librdkafka statistics.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, FutureProducer, Producer};
use rdkafka::{ClientContext, Statistics, TopicPartitionList};

use crate::config::KafkaConfig;
use crate::metrics::Metrics;

mod topics;

pub use topics::{check_topics, ensure_topics, TopicShape};

/// Sees librdkafka's statistics and rebalances; kept short, it runs on librdkafka's threads.
pub struct RelayContext {
    pub metrics: Arc<Metrics>,
    pub actions_topic: String,
    /// The consumer group, a label of the lag it reports.
    pub group: String,
    /// Cleared when librdkafka reports every broker down; `/readyz` reads it.
    pub brokers_up: Arc<AtomicBool>,
}

/// A partition's lag from librdkafka's statistics (-1 where it knows nothing): its own
/// `consumer_lag` once the group has a position, else everything retained past what the
/// application has read; `None` while the broker's offsets are unknown too.
fn partition_lag(consumer_lag: i64, hi: i64, lo: i64, app: i64) -> Option<i64> {
    if consumer_lag >= 0 {
        Some(consumer_lag)
    } else if hi >= 0 && lo >= 0 {
        // No committed position yet: everything retained is still to be read.
        Some(hi - app.max(lo))
    } else {
        None
    }
}

impl ClientContext for RelayContext {
    fn stats(&self, stats: Statistics) {
        // Readiness follows the brokers: up while librdkafka has a connection up to at least
        // one of them (bootstrap entries included), whatever the group is doing.
        if !stats.brokers.is_empty() {
            let up = stats.brokers.values().any(|b| b.state == "UP");
            self.brokers_up.store(up, Ordering::Relaxed);
        }
        let Some(topic) = stats.topics.get(&self.actions_topic) else {
            return;
        };
        for (id, p) in &topic.partitions {
            // Only partitions assigned here; librdkafka says -1 where it has no position yet.
            if *id < 0 || !p.desired {
                continue;
            }
            if let Some(lag) = partition_lag(p.consumer_lag, p.hi_offset, p.lo_offset, p.app_offset)
            {
                self.metrics
                    .consumer_lag(&self.actions_topic, &self.group, *id, lag);
            }
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

/// What every Kafka client idem makes starts from: the brokers, then `[kafka.client]` and its
/// secrets. Each role adds its own defaults and overrides on top.
pub fn client_config(cfg: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers);
    for (k, v) in &cfg.client {
        c.set(k, v);
    }
    for (k, v) in &cfg.client_secrets {
        c.set(k, v.expose());
    }
    c
}

/// librdkafka's two names for properties idem sets by default.
const ALIASES: &[(&str, &str)] = &[
    ("linger.ms", "queue.buffering.max.ms"),
    ("compression.type", "compression.codec"),
    ("message.timeout.ms", "delivery.timeout.ms"),
];

/// Sets `defaults` where the operator has not set them, under their name or librdkafka's other
/// one, in the client section or in `section` (the consumer's or the producer's own). A default
/// set beside the operator's value under the other name would leave which one librdkafka takes
/// to the order a hash map's keys come out in.
pub(crate) fn with_defaults(
    mut c: ClientConfig,
    client: &BTreeMap<String, String>,
    section: &BTreeMap<String, String>,
    defaults: &[(&str, &str)],
) -> ClientConfig {
    for &(k, v) in defaults {
        let other = ALIASES.iter().find_map(|&(a, b)| {
            if k == a {
                Some(b)
            } else if k == b {
                Some(a)
            } else {
                None
            }
        });
        let set = std::iter::once(k)
            .chain(other)
            .any(|name| client.contains_key(name) || section.contains_key(name));
        if !set {
            c.set(k, v);
        }
    }
    c
}

pub fn consumer(cfg: &KafkaConfig, context: RelayContext) -> Result<ActionConsumer, KafkaError> {
    let mut c = with_defaults(
        client_config(cfg),
        &cfg.client,
        &cfg.consumer_overrides,
        &[
            ("client.id", "idem-relay"),
            ("auto.offset.reset", "earliest"),
            ("enable.auto.commit", "true"),
            ("auto.commit.interval.ms", "1000"),
            ("enable.partition.eof", "false"),
            ("partition.assignment.strategy", "cooperative-sticky"),
            ("session.timeout.ms", "10000"),
            ("heartbeat.interval.ms", "1000"),
            ("statistics.interval.ms", "5000"),
            ("queued.max.messages.kbytes", "16384"),
        ],
    );
    c.set("group.id", &cfg.group_id)
        // Offsets are stored by the relay only once a message's intent is durable in Postgres.
        .set("enable.auto.offset.store", "false");
    for (k, v) in &cfg.consumer_overrides {
        c.set(k, v);
    }
    c.create_with_context(context)
}

pub fn producer(cfg: &KafkaConfig) -> Result<FutureProducer, KafkaError> {
    let mut c = with_defaults(
        client_config(cfg),
        &cfg.client,
        &cfg.producer_overrides,
        &[
            ("client.id", "idem-relay"),
            // No linger: the outbox publisher hands over a whole round of rows at once, so
            // batches form without it. Paced at 1,000 actions/s, 2 ms of linger cost 3.5 ms of
            // p50 (each round waited for it before its rows could be marked); flat out it made
            // no measurable difference (`benches/HISTORY.md`).
            ("linger.ms", "0"),
            ("compression.type", "lz4"),
            ("message.timeout.ms", "30000"),
        ],
    );
    c.set("enable.idempotence", "true").set("acks", "all");
    for (k, v) in &cfg.producer_overrides {
        c.set(k, v);
    }
    c.create()
}

/// librdkafka's default `batch.size` and `message.max.bytes` (bytes).
const LIBRDKAFKA_BATCH: i64 = 1_000_000;
/// Room left in a batch for the record batch's own header and framing, which the broker counts
/// against `max.message.bytes` and librdkafka may not.
const BATCH_FRAMING: i64 = 512;

/// `cfg` with the producer's batches sized to `limit`, the smallest `max.message.bytes` of the
/// topics it produces to ([`check_topics`]). The broker refuses a record batch larger than that
/// whole, every record in it "too large" though each would fit alone, and the publisher would
/// quarantine them all. So when the topics take less than librdkafka batches by default:
/// `batch.size` is set below the limit, and `message.max.bytes` to it, so that a single record
/// too large for the topic is refused by the producer on its own. Settings the operator made
/// (in `kafka.producer` or `kafka.client`) are kept.
pub fn sized_to_topics(cfg: &KafkaConfig, limit: Option<i64>) -> KafkaConfig {
    let mut sized = cfg.clone();
    let Some(limit) = limit.filter(|l| *l < LIBRDKAFKA_BATCH) else {
        return sized;
    };
    let batch = (limit - BATCH_FRAMING).max(1);
    let client = &cfg.client;
    let overrides = &mut sized.producer_overrides;
    let mut set = |key: &str, value: i64| {
        if !overrides.contains_key(key) && !client.contains_key(key) {
            overrides.insert(key.to_string(), value.to_string());
        }
    };
    // librdkafka takes no `message.max.bytes` below 1,000.
    set("message.max.bytes", limit.max(1_000));
    set("batch.size", batch);
    tracing::info!(
        max_message_bytes = limit,
        batch_size = ?sized.producer_overrides.get("batch.size"),
        "the producer's batches are sized to the topics' max.message.bytes"
    );
    sized
}

/// The relay's producer (outcomes and dead letters), replaced by a new one when librdkafka
/// reports a fatal error: an idempotent producer that lost track of its sequence numbers can
/// never send again, and without a new one every outcome would wait forever.
#[derive(Clone)]
pub struct SharedProducer {
    /// The producer in use, and how many times it was rebuilt (so two callers that saw the
    /// same failure rebuild it once).
    current: Arc<std::sync::RwLock<(u64, FutureProducer)>>,
    config: Arc<KafkaConfig>,
}

impl SharedProducer {
    pub fn new(config: &KafkaConfig) -> Result<Self, KafkaError> {
        Ok(SharedProducer {
            current: Arc::new(std::sync::RwLock::new((0, producer(config)?))),
            config: Arc::new(config.clone()),
        })
    }

    /// The producer to send with, and its generation for [`SharedProducer::heal`].
    pub fn get(&self) -> (u64, FutureProducer) {
        self.current.read().expect("not poisoned").clone()
    }

    /// After a failed send with the producer of `generation`: when that producer has failed
    /// fatally, a new one replaces it. Returns whether it was replaced.
    pub fn heal(&self, generation: u64, metrics: &Metrics) -> bool {
        let (seen, failed) = self.get();
        if seen != generation {
            return false; // somebody else rebuilt it already
        }
        let Some((code, reason)) = failed.client().fatal_error() else {
            return false;
        };
        match producer(&self.config) {
            Ok(fresh) => {
                let mut current = self.current.write().expect("not poisoned");
                if current.0 == generation {
                    *current = (generation + 1, fresh);
                    metrics.producer_rebuilt();
                    tracing::error!(
                        ?code,
                        reason,
                        "the producer failed fatally; a new one replaces it"
                    );
                    return true;
                }
                false
            }
            Err(e) => {
                tracing::error!(error = %e, ?code, "the producer failed fatally and a new one cannot be made");
                false
            }
        }
    }
}

/// Why the brokers could not be reached at start, said with what was tried.
#[derive(Debug, thiserror::Error)]
#[error("cannot connect to Kafka at {brokers} (security.protocol {protocol}{mechanism}): {detail}")]
pub struct ConnectError {
    pub brokers: String,
    pub protocol: String,
    /// `, sasl.mechanism X` when SASL is in use.
    pub mechanism: String,
    pub detail: String,
}

/// Keeps the last error librdkafka reported while probing.
#[derive(Default)]
struct ProbeContext {
    last: std::sync::Mutex<Option<(Option<RDKafkaErrorCode>, String)>>,
}

impl ClientContext for ProbeContext {
    fn error(&self, error: KafkaError, reason: &str) {
        *self.last.lock().expect("not poisoned") =
            Some((error.rdkafka_error_code(), reason.into()));
    }

    fn log(&self, _: RDKafkaLogLevel, _: &str, _: &str) {}
}

impl rdkafka::producer::ProducerContext for ProbeContext {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: ()) {}
}

/// How long start-up waits for a broker to answer before it gives up.
const PROBE_DEADLINE: Duration = Duration::from_secs(20);

/// Asks the brokers for metadata with the client settings every client uses, so a wrong
/// password, an untrusted certificate or an unreachable listener stops the start with its
/// reason, at once where librdkafka says it will not get better (authentication, TLS).
pub async fn probe(cfg: &KafkaConfig) -> Result<(), ConnectError> {
    let cfg = cfg.clone();
    tokio::task::spawn_blocking(move || probe_blocking(&cfg))
        .await
        .expect("the probe does not panic")
}

fn probe_blocking(cfg: &KafkaConfig) -> Result<(), ConnectError> {
    let protocol = cfg
        .client
        .get("security.protocol")
        .cloned()
        .unwrap_or_else(|| "plaintext".into());
    let mechanism = cfg
        .client
        .get("sasl.mechanism")
        .or(cfg.client.get("sasl.mechanisms"))
        .filter(|_| protocol.to_ascii_lowercase().starts_with("sasl"))
        .map_or(String::new(), |m| format!(", sasl.mechanism {m}"));
    let fail = |detail: String| ConnectError {
        brokers: cfg.brokers.clone(),
        protocol: protocol.clone(),
        mechanism: mechanism.clone(),
        detail,
    };
    let client: BaseProducer<ProbeContext> = client_config(cfg)
        .create_with_context(ProbeContext::default())
        .map_err(|e| fail(e.to_string()))?;
    let deadline = std::time::Instant::now() + PROBE_DEADLINE;
    loop {
        let answer = client
            .client()
            .fetch_metadata(None, Duration::from_millis(500));
        // Serves the error callbacks.
        client.poll(Duration::ZERO);
        let Err(error) = answer else {
            return Ok(());
        };
        let last = client.context().last.lock().expect("not poisoned").clone();
        let hopeless = matches!(
            last,
            Some((
                Some(RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SSL),
                _
            ))
        );
        if hopeless || std::time::Instant::now() >= deadline {
            return Err(fail(
                last.map_or_else(|| error.to_string(), |(_, reason)| reason),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use rdkafka::config::ClientConfig;

    use super::{partition_lag, with_defaults};

    #[test]
    fn a_default_stays_out_where_the_operator_set_it_under_either_name_or_section() {
        let map = |k: &str| BTreeMap::from([(k.to_string(), "5".to_string())]);
        let none = BTreeMap::new();
        let linger = |client: &BTreeMap<String, String>, section: &BTreeMap<String, String>| {
            let c = with_defaults(ClientConfig::new(), client, section, &[("linger.ms", "0")]);
            c.get("linger.ms").map(str::to_string)
        };
        assert_eq!(linger(&none, &none).as_deref(), Some("0"));
        assert_eq!(linger(&map("linger.ms"), &none), None);
        assert_eq!(linger(&map("queue.buffering.max.ms"), &none), None);
        assert_eq!(linger(&none, &map("queue.buffering.max.ms")), None);
        assert_eq!(linger(&none, &map("linger.ms")), None);
        assert_eq!(linger(&map("batch.size"), &none).as_deref(), Some("0"));
    }

    #[test]
    fn lag_is_librdkafkas_own_once_there_is_a_position() {
        assert_eq!(partition_lag(7, 100, 0, 93), Some(7));
        assert_eq!(partition_lag(0, 100, 0, 100), Some(0));
    }

    #[test]
    fn without_a_position_everything_retained_past_what_was_read_is_lag() {
        // Nothing read yet: from the low watermark (retention may have dropped the start).
        assert_eq!(partition_lag(-1, 100, 40, -1), Some(60));
        // Read some, not yet committed.
        assert_eq!(partition_lag(-1, 100, 40, 70), Some(30));
    }

    #[test]
    fn no_lag_is_reported_while_the_broker_offsets_are_unknown() {
        assert_eq!(partition_lag(-1, -1, -1, -1), None);
        assert_eq!(partition_lag(-1, 100, -1, 5), None);
    }
}
