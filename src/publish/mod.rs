//! Publish: outbox rows to the outcomes topic with the idempotent producer, woken by
//! LISTEN/NOTIFY with a polling fallback. A row leaves the queue of unpublished rows (its mark of
//! publication) only after Kafka acknowledged it, so a crash in between republishes the same
//! event ids.

use crate::publish::outbox::{OutboxRow, RoundStatements};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use futures::StreamExt;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use tokio::sync::Notify;
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

use crate::action::STRUCTURED_CONTENT_TYPE;
use crate::config::Config;
use crate::db::{self, DbError};
use crate::metrics::Metrics;

pub mod outbox;

const GROUP_MAX: i64 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("kafka did not acknowledge outcome {event_id}: {source}")]
    Kafka {
        event_id: String,
        source: rdkafka::error::KafkaError,
    },
}

crate::db::from_postgres!(PublishError);

pub struct Publisher {
    pub config: Arc<Config>,
    pub pool: Pool,
    pub producer: crate::kafka::SharedProducer,
    pub metrics: Arc<Metrics>,
    pub wake: Arc<Notify>,
}

impl Publisher {
    /// Publishes until `shutdown`, then once more until the outbox is empty or `final_grace`
    /// has passed.
    pub async fn run(
        self,
        shutdown: CancellationToken,
        drained: CancellationToken,
        final_grace: Duration,
    ) {
        let mut last_lag = Instant::now() - Duration::from_secs(10);
        // The queue's vacuum runs beside the rounds, never in their way, until `drained`.
        tokio::spawn(vacuum_queue(self.pool.clone(), drained.clone()));
        loop {
            let full = match self.publish_once().await {
                Ok(n) => n as i64 == GROUP_MAX,
                Err(e) => {
                    tracing::warn!(error = %e, "outbox publish failed; will retry");
                    false
                }
            };
            if last_lag.elapsed() >= Duration::from_secs(2) {
                self.update_lag().await;
                last_lag = Instant::now();
            }
            if full {
                continue;
            }
            tokio::select! {
                _ = drained.cancelled() => break,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(self.config.relay.outbox_poll_interval) => {}
            }
        }
        let _ = shutdown;
        // Everything the executor recorded before stopping goes out now.
        let deadline = Instant::now() + final_grace;
        while Instant::now() < deadline {
            match self.publish_once().await {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "outbox publish failed during shutdown");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        self.update_lag().await;
    }

    async fn update_lag(&self) {
        if let Ok(client) = self.pool.get().await {
            if let Ok((pending, age)) = crate::publish::outbox::outbox_lag(&**client).await {
                self.metrics.outbox(pending, age);
            }
        }
    }

    /// One batch: lock unpublished rows, send them all, wait for every acknowledgement, dequeue.
    /// Its transaction is two round trips: the `begin` goes out with the select, the `commit`
    /// with the dequeue.
    pub async fn publish_once(&self) -> Result<usize, PublishError> {
        let open = db::OpenTransaction::new(self.pool.get().await.map_err(DbError::from)?);
        let round = self.publish_round(open.client()).await;
        match open.close(round).await? {
            (_, Some(failed)) => Err(failed),
            (rows, None) => Ok(rows),
        }
    }

    /// A round in the transaction the caller opened: `Err` when it did not commit; otherwise
    /// the rows read, and what failed after the commit (outcomes Kafka did not acknowledge,
    /// which stay unpublished for the next round).
    async fn publish_round(
        &self,
        client: &deadpool_postgres::Object,
    ) -> Result<(usize, Option<PublishError>), PublishError> {
        let statements = RoundStatements::prepare(client).await?;
        // Not flushed at commit: a dequeue a crash of Postgres undoes only publishes the rows
        // again, under the same event ids, as a crash between the send and the dequeue does.
        let rows =
            db::begin_unflushed_with(client, statements.unpublished(client, GROUP_MAX)).await?;
        let fetched = rows.len();
        if fetched == 0 {
            client.batch_execute("commit").await?;
            return Ok((0, None));
        }
        // Queued rows that a relay of an earlier version published (or quarantined) already:
        // only dropped from the queue.
        let (rows, stale): (Vec<OutboxRow>, Vec<OutboxRow>) =
            rows.into_iter().partition(|r| r.live);
        let started = std::time::SystemTime::now();
        let topic = &self.config.kafka.outcomes_topic;
        let (generation, producer) = self.producer.get();
        let mut pending = Vec::with_capacity(rows.len());
        let mut refused = Vec::new();
        let mut enqueue_failed = None;
        for row in &rows {
            let payload = serde_json::to_vec(&row.payload).expect("json serializes");
            let record = FutureRecord::to(topic)
                .key(&row.key)
                .payload(&payload)
                .headers(outcome_headers(&row.payload, row.traceparent.as_deref()));
            // send_result only enqueues; the acknowledgements are awaited together below.
            match producer.send_result(record) {
                Ok(delivery) => pending.push((row.id, row.event_id.clone(), delivery)),
                // Refused for good: set aside, so the rows after it go out.
                Err((e, _)) if refused_for_good(&e) => refused.push((row, e)),
                // The local queue is full (or the producer is failing): what was enqueued is
                // awaited and marked, the rest waits for the next round.
                Err((e, _)) => {
                    enqueue_failed = Some(PublishError::Kafka {
                        event_id: row.event_id.clone(),
                        source: e,
                    });
                    break;
                }
            }
        }
        let results = futures::future::join_all(
            pending
                .into_iter()
                .map(|(id, event_id, f)| async move { (id, event_id, f.await) }),
        )
        .await;
        // What Kafka acknowledged is marked even when something else failed, so one outcome
        // that cannot go out does not send the others again and again.
        let mut acked = Vec::with_capacity(results.len());
        let mut failed = enqueue_failed;
        for (id, event_id, result) in results {
            match result {
                Ok(Ok(_)) => acked.push(id),
                Ok(Err((e, _))) if refused_for_good(&e) => {
                    if let Some(row) = rows.iter().find(|r| r.id == id) {
                        refused.push((row, e));
                    }
                }
                Ok(Err((e, _))) => {
                    failed.get_or_insert(PublishError::Kafka {
                        event_id,
                        source: e,
                    });
                }
                Err(_) => {
                    failed.get_or_insert(PublishError::Kafka {
                        event_id,
                        source: rdkafka::error::KafkaError::Canceled,
                    });
                }
            }
        }
        crate::failpoint::crash_point!("after-publish-before-mark");
        for (row, e) in &refused {
            let reason = format!("the producer refused it: {e}");
            crate::publish::outbox::quarantine(client, row.id, &reason).await?;
        }
        let dequeued: Vec<i64> = acked
            .iter()
            .copied()
            .chain(stale.iter().map(|r| r.id))
            .collect();
        db::commit_with(client, statements.dequeue(client, &dequeued)).await?;
        self.metrics.published(topic, acked.len() as u64);
        if crate::telemetry::enabled() {
            let published: Vec<&OutboxRow> =
                rows.iter().filter(|r| acked.contains(&r.id)).collect();
            self.trace_published(&published, started).await;
        }
        for (row, e) in &refused {
            self.metrics.outbox_quarantined();
            tracing::error!(event_id = %row.event_id, key = %row.key, error = %e, "outcome event refused by the producer for good; quarantined in the outbox");
        }
        if failed.is_some() {
            self.producer.heal(generation, &self.metrics);
        }
        Ok((fetched, failed))
    }

    /// Exports a `send` span for each published outcome, and the action's own span once its
    /// first outcome that is not a repeat's answer (nor a wait for approval) went out.
    async fn trace_published(&self, rows: &[&OutboxRow], started: std::time::SystemTime) {
        use crate::telemetry::{ActionTrace, Attribute, Kind, Span};
        let keys: Vec<&str> = rows.iter().map(|r| r.key.as_str()).collect();
        let intents = match self.pool.get().await {
            Ok(client) => client.query(TRACED_INTENTS, &[&keys]).await.ok(),
            Err(_) => None,
        };
        let Some(intents) = intents else {
            tracing::debug!("spans of published outcomes skipped: the database did not answer");
            return;
        };
        let now = std::time::SystemTime::now();
        let outcomes = &self.config.kafka.outcomes_topic;
        for row in rows {
            let Some(intent) = intents.iter().find(|i| i.get::<_, &str>(0) == row.key) else {
                continue;
            };
            let created: std::time::SystemTime = intent.get(1);
            let trace = ActionTrace::of(&row.key, intent.get::<_, Option<&str>>(2));
            let data = &row.payload["data"];
            let status = data["status"].as_str().unwrap_or_default().to_string();
            trace.emit_child(
                trace.child(&format!("publish/{}", row.event_id)),
                Span {
                    name: format!("send {outcomes}"),
                    kind: Kind::Producer,
                    start: started,
                    end: now,
                    attributes: vec![
                        Attribute::new("messaging.system", "kafka"),
                        Attribute::new("messaging.operation.type", "send"),
                        Attribute::new("messaging.operation.name", "send"),
                        Attribute::new("messaging.destination.name", outcomes.clone()),
                        Attribute::new("messaging.message.id", row.event_id.clone()),
                        Attribute::new("messaging.kafka.message.key", row.key.clone()),
                        Attribute::new("idem.outcome.status", status.clone()),
                    ],
                    error: None,
                },
            );
            if data["duplicate"] != true && status != "pending_approval" {
                let error = matches!(status.as_str(), "failed" | "unknown" | "rejected")
                    .then(|| format!("{status}: {}", data["error"]["code"].as_str().unwrap_or("")));
                let mut attributes = vec![
                    Attribute::new("messaging.system", "kafka"),
                    Attribute::new("messaging.operation.type", "process"),
                    Attribute::new("messaging.operation.name", "process"),
                    Attribute::new(
                        "messaging.destination.name",
                        self.config.kafka.actions_topic.clone(),
                    ),
                    Attribute::new(
                        "messaging.consumer.group.name",
                        self.config.kafka.group_id.clone(),
                    ),
                    Attribute::new("idem.outcome.status", status.clone()),
                ];
                if let Some(tool) = data["tool"].as_str() {
                    attributes.push(Attribute::new("idem.tool", tool.to_string()));
                }
                if let Some(e) = data["action_event_id"].as_str() {
                    attributes.push(Attribute::new("messaging.message.id", e.to_string()));
                }
                let consumed =
                    crate::telemetry::consumed_at(&row.key).map_or(created, |t| t.min(created));
                trace.emit_action(Span {
                    name: format!("process {}", self.config.kafka.actions_topic),
                    kind: Kind::Consumer,
                    start: consumed,
                    end: now,
                    attributes,
                    error,
                });
            }
        }
    }
}

/// An outcome event's headers: structured content (content-type says so), its trace context,
/// and its CloudEvents attributes, so a router can filter on them without parsing the body.
fn outcome_headers(payload: &serde_json::Value, traceparent: Option<&str>) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new().insert(Header {
        key: "content-type",
        value: Some(STRUCTURED_CONTENT_TYPE),
    });
    if let Some(t) = traceparent {
        headers = headers.insert(Header {
            key: "traceparent",
            value: Some(t),
        });
    }
    for (key, attribute) in [
        ("ce_id", "id"),
        ("ce_type", "type"),
        ("ce_source", "source"),
        ("ce_subject", "subject"),
        ("ce_specversion", "specversion"),
    ] {
        if let Some(value) = payload[attribute].as_str() {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
    }
    headers
}

/// Hands answers to the producer for the outcomes topic (no outbox row), in order; their
/// acknowledgements are awaited with [`DirectSends::acknowledged`].
pub fn send_direct(
    producer: &crate::kafka::SharedProducer,
    topic: &str,
    answers: Vec<crate::outcome::Outcome>,
) -> DirectSends {
    let (generation, p) = producer.get();
    let mut sends = DirectSends {
        generation,
        pending: Vec::with_capacity(answers.len()),
        failed: Vec::new(),
        healing: false,
    };
    for answer in answers {
        let payload = serde_json::to_vec(&answer.payload).expect("json serializes");
        let record = FutureRecord::to(topic)
            .key(&answer.key)
            .payload(&payload)
            .headers(outcome_headers(
                &answer.payload,
                answer.traceparent.as_deref(),
            ));
        match p.send_result(record) {
            Ok(delivery) => sends.pending.push((answer, delivery)),
            Err((e, _)) => {
                sends.healing |= !refused_for_good(&e);
                tracing::debug!(error = %e, event_id = %answer.event_id, "direct answer not enqueued; the outbox carries it");
                sends.failed.push(answer);
            }
        }
    }
    sends
}

/// Direct answers in the producer's queue, in the order they were handed to it.
pub struct DirectSends {
    generation: u64,
    pending: Vec<(crate::outcome::Outcome, rdkafka::producer::DeliveryFuture)>,
    failed: Vec<crate::outcome::Outcome>,
    healing: bool,
}

impl DirectSends {
    /// Waits for Kafka's acknowledgement of every answer; returns those not acknowledged (nor
    /// enqueued), for the outbox.
    pub async fn acknowledged(
        self,
        producer: &crate::kafka::SharedProducer,
        topic: &str,
        metrics: &Metrics,
    ) -> Vec<crate::outcome::Outcome> {
        let DirectSends {
            generation,
            pending,
            mut failed,
            mut healing,
        } = self;
        let mut acked = 0;
        for (answer, delivery) in pending {
            match delivery.await {
                Ok(Ok(_)) => acked += 1,
                Ok(Err((e, _))) => {
                    healing |= !refused_for_good(&e);
                    tracing::debug!(error = %e, event_id = %answer.event_id, "direct answer not acknowledged; the outbox carries it");
                    failed.push(answer);
                }
                Err(_) => {
                    healing = true;
                    failed.push(answer);
                }
            }
        }
        metrics.published(topic, acked);
        if healing {
            producer.heal(generation, metrics);
        }
        failed
    }
}

/// Vacuums the queue of unpublished outbox rows every two seconds until `stop`, after dropping
/// ids at its head whose outbox row is gone.
async fn vacuum_queue(pool: Pool, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
        if let Ok(client) = pool.get().await {
            match client
                .execute(crate::publish::outbox::DROP_ORPHANS, &[])
                .await
            {
                Ok(0) => {}
                Ok(n) => tracing::warn!(ids = n, "queued outbox ids without an outbox row dropped"),
                Err(e) => {
                    tracing::debug!(error = %e, "the outbox queue's orphans were not dropped")
                }
            }
            if let Err(e) = client
                .batch_execute(crate::publish::outbox::VACUUM_QUEUE)
                .await
            {
                tracing::debug!(error = %e, "the outbox queue was not vacuumed");
            }
        }
    }
}

/// The creation time and incoming `traceparent` of each key, for its spans.
const TRACED_INTENTS: &str = "
    select distinct on (idempotency_key) idempotency_key, created_at, traceparent
      from intents where idempotency_key = any($1)
     order by idempotency_key, id";

/// Listens on the outbox channel and wakes the publisher on every notification; reconnects
/// when the connection drops (the publisher polls meanwhile).
pub async fn listen(config: Arc<Config>, wake: Arc<Notify>, shutdown: CancellationToken) {
    let channel = crate::publish::outbox::outbox_channel(&config.postgres.schema);
    loop {
        let attempt = async {
            let (pg, tls) = db::pg_config(&config.postgres)?;
            let (client, mut connection) = pg.connect(tls).await.map_err(DbError::from)?;
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            let statement = format!("listen {channel}");
            let listen = client.batch_execute(&statement);
            tokio::pin!(listen);
            // The connection must be polled for the LISTEN to complete.
            loop {
                tokio::select! {
                    r = &mut listen => { r.map_err(DbError::from)?; break; }
                    m = messages.next() => if m.is_none() { return Ok::<(), DbError>(()); },
                }
            }
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    m = messages.next() => match m {
                        Some(Ok(AsyncMessage::Notification(_))) => wake.notify_one(),
                        Some(Ok(_)) => {}
                        Some(Err(e)) => return Err(DbError::from(e)),
                        None => return Ok(()),
                    }
                }
            }
        };
        if let Err(e) = attempt.await {
            tracing::warn!(error = %e, "outbox listener lost; polling until it reconnects");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// Producer errors that no retry can heal, for one record: it is larger than the producer or
/// the broker accepts, or the broker finds it invalid.
fn refused_for_good(e: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as Code;
    matches!(
        e.rdkafka_error_code(),
        Some(
            Code::MessageSizeTooLarge
                | Code::InvalidMessageSize
                | Code::InvalidMessage
                | Code::InvalidRecord
                | Code::MessageBatchTooLarge
        )
    )
}
