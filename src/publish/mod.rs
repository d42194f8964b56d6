//! Publish: outbox rows to the outcomes topic with the idempotent producer. The rows a finish
//! commits are handed over in memory ([`handoff`]); the others (written by the consumer, the
//! gates, recovery, the CLI, another relay) are read from the queue of unpublished rows, woken
//! by LISTEN/NOTIFY with a polling fallback. A row leaves the queue (its mark of publication)
//! only after Kafka acknowledged it, so a crash in between republishes the same event ids.

use crate::publish::handoff::Handoff;
use crate::publish::outbox::{OutboxRow, RoundStatements};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use futures::StreamExt;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

use crate::action::STRUCTURED_CONTENT_TYPE;
use crate::config::Config;
use crate::db::{self, DbError};
use crate::metrics::Metrics;

pub mod handoff;
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
    /// Rows the finishes hand over, and the wake-ups to read the queue.
    pub handoff: Arc<Handoff>,
}

/// What a round came to.
#[derive(Debug, Clone, Copy, Default)]
pub struct Round {
    /// Rows it took: sent, set aside, or put back for a later round.
    pub taken: usize,
    /// Rows it left queued behind an earlier row of their key.
    pub held_back: usize,
}

/// What a round's sends came to.
struct Sent<'a> {
    /// Acknowledged by Kafka: published once out of the queue.
    acked: HashSet<i64>,
    /// Refused by the producer for good: set aside (quarantined).
    refused: Vec<(&'a OutboxRow, rdkafka::error::KafkaError)>,
    /// The first other failure; its rows stay unpublished for a later round.
    failed: Option<PublishError>,
    /// The producer's generation the sends went to, to heal it after a failure.
    generation: u64,
}

impl Publisher {
    /// Publishes until `shutdown`, then once more until the outbox is empty or `final_grace`
    /// has passed. Handed rows go out as they come; the queue is read at start, when asked
    /// (a NOTIFY, a handed round that failed or left rows queued behind an earlier row of their
    /// key, a round that committed while rows waited behind its own), after a full round, and
    /// every `outbox_poll_interval` whatever else happens, for the rows nothing handed (another
    /// relay's, a crashed run's).
    pub async fn run(
        self,
        shutdown: CancellationToken,
        drained: CancellationToken,
        final_grace: Duration,
    ) {
        let mut last_lag = Instant::now() - Duration::from_secs(10);
        // The queue's vacuum runs beside the rounds, never in their way, until `drained`.
        tokio::spawn(vacuum_queue(self.pool.clone(), drained.clone()));
        let interval = self.config.relay.outbox_poll_interval;
        let mut poll = true;
        let mut last_poll = Instant::now();
        loop {
            let handed = self.handoff.take(GROUP_MAX as usize);
            if !handed.is_empty() {
                match self.publish_handed(handed).await {
                    // Rows left queued behind an earlier outcome of their key go with a poll.
                    Ok(round) => poll |= round.held_back > 0,
                    Err(e) => {
                        tracing::warn!(error = %e, "handed outcomes not published; the queue keeps them for the next round");
                        poll = true;
                    }
                }
            }
            if poll || last_poll.elapsed() >= interval {
                last_poll = Instant::now();
                poll = match self.publish_once().await {
                    // A full round: read on. A round that only found rows behind a held one
                    // would only find them again.
                    Ok(round) => {
                        round.taken > 0 && (round.taken + round.held_back) as i64 == GROUP_MAX
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "outbox publish failed; will retry");
                        false
                    }
                };
            }
            if last_lag.elapsed() >= Duration::from_secs(2) {
                self.update_lag().await;
                last_lag = Instant::now();
            }
            if poll || !self.handoff.is_empty() {
                continue;
            }
            tokio::select! {
                _ = drained.cancelled() => break,
                _ = self.handoff.handed() => {}
                _ = self.handoff.poll_asked() => poll = true,
                _ = tokio::time::sleep_until((last_poll + interval).into()) => {}
            }
        }
        let _ = shutdown;
        // Everything the executor recorded before stopping goes out now, handed or not.
        let deadline = Instant::now() + final_grace;
        while Instant::now() < deadline {
            match self.publish_once().await {
                Ok(round) if round.taken == 0 => break,
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

    /// One batch read from the queue: lock unpublished rows, send them all (but those behind a
    /// row of their key another round holds), wait for every acknowledgement, dequeue. Its
    /// transaction is two round trips: the `begin` goes out with the select, the `commit` with
    /// the dequeue.
    pub async fn publish_once(&self) -> Result<Round, PublishError> {
        let open = db::OpenTransaction::new(self.pool.get().await.map_err(DbError::from)?);
        let round = self.publish_round(open.client()).await;
        let (round, failed) = open.close(round).await?;
        self.committed(round);
        failed.map_or(Ok(round), Err)
    }

    /// One batch of handed rows: taken out of the queue under lock (rows another round holds
    /// or published are skipped), sent, and the rows Kafka did not acknowledge put back. Two
    /// round trips, as a round read from the queue: the `begin` with the dequeue, the `commit`
    /// with the requeue (three when a row follows an earlier status change of its key, below).
    /// A crash before the commit leaves every row queued.
    pub async fn publish_handed(&self, rows: Vec<OutboxRow>) -> Result<Round, PublishError> {
        let open = db::OpenTransaction::new(self.pool.get().await.map_err(DbError::from)?);
        let round = self.handed_round(open.client(), rows).await;
        let (round, failed) = open.close(round).await?;
        self.committed(round);
        failed.map_or(Ok(round), Err)
    }

    /// A round in the transaction the caller opened: `Err` when it did not commit; otherwise
    /// what it took and left, and what failed after the commit (outcomes Kafka did not
    /// acknowledge, which stay unpublished for the next round).
    async fn publish_round(
        &self,
        client: &deadpool_postgres::Object,
    ) -> Result<(Round, Option<PublishError>), PublishError> {
        let statements = RoundStatements::prepare(client).await?;
        // Not flushed at commit: a dequeue a crash of Postgres undoes only publishes the rows
        // again, under the same event ids, as a crash between the send and the dequeue does.
        let (rows, held_back) =
            db::begin_unflushed_with(client, statements.unpublished(client, GROUP_MAX)).await?;
        self.note_held_back(held_back);
        let round = Round {
            taken: rows.len(),
            held_back,
        };
        if rows.is_empty() {
            client.batch_execute("commit").await?;
            return Ok((round, None));
        }
        // Queued rows that a relay of an earlier version published (or quarantined) already:
        // only dropped from the queue.
        let (rows, stale): (Vec<OutboxRow>, Vec<OutboxRow>) =
            rows.into_iter().partition(|r| r.live);
        let started = std::time::SystemTime::now();
        let sent = self.send(&rows).await;
        crate::failpoint::crash_point!("after-publish-before-mark");
        self.quarantine(client, &sent).await?;
        let dequeued: Vec<i64> = sent
            .acked
            .iter()
            .copied()
            .chain(stale.iter().map(|r| r.id))
            .collect();
        db::commit_with(client, statements.dequeue(client, &dequeued)).await?;
        Ok((round, self.after_commit(&rows, sent, started).await))
    }

    /// After a round committed: one that took rows (a row another round left behind may have
    /// waited for them) asks for a poll if a round left rows behind meanwhile. One that took
    /// nothing does not, or a round finding rows behind a row another relay holds would wake
    /// itself again and again.
    fn committed(&self, round: Round) {
        if round.taken > 0 {
            self.handoff.round_committed();
        }
    }

    /// Counts rows a round left queued behind an earlier row of their key, and has the next
    /// round to commit ask for a poll.
    fn note_held_back(&self, n: usize) {
        if n > 0 {
            self.metrics.outbox_held_back(n);
            self.handoff.held_back();
        }
    }

    /// [`Self::publish_round`] for handed rows.
    ///
    /// A key's outcomes go out in the order written. A handed status change that follows an
    /// earlier one of its key ([`OutboxRow::follows`]: after an approval, a verification) is
    /// left queued, with the round's other rows of that key, while an earlier row of the key
    /// is queued (one more round trip, only for such rows). Rows taken after a row of their key
    /// that this round could not take (another round holds it, or published it) are put back.
    async fn handed_round(
        &self,
        client: &deadpool_postgres::Object,
        mut handed: Vec<OutboxRow>,
    ) -> Result<(Round, Option<PublishError>), PublishError> {
        // In the order written, whatever order the finishes handed them in.
        handed.sort_unstable_by_key(|r| r.id);
        let statements = RoundStatements::prepare(client).await?;
        let waiting = statements.keys_behind(client, &handed).await?;
        let (offered, left): (Vec<OutboxRow>, Vec<OutboxRow>) =
            handed.into_iter().partition(|r| !waiting.contains(&r.key));
        let ids: Vec<i64> = offered.iter().map(|r| r.id).collect();
        // Not flushed at commit, as a round read from the queue (`publish_round`).
        let mine =
            db::begin_unflushed_with(client, statements.dequeue_handed(client, &ids)).await?;
        // In id order: a row taken after a row of its key that was not is put back.
        let (mut rows, mut put_back) = (Vec::with_capacity(offered.len()), Vec::new());
        let mut skipped: HashSet<String> = HashSet::new();
        for r in offered {
            if !mine.contains(&r.id) {
                skipped.insert(r.key);
            } else if skipped.contains(&r.key) {
                put_back.push(r.id);
            } else {
                rows.push(r);
            }
        }
        let round = Round {
            taken: rows.len() + put_back.len(),
            held_back: left.len() + put_back.len(),
        };
        self.note_held_back(round.held_back);
        if rows.is_empty() {
            db::commit_with(client, statements.requeue(client, &put_back)).await?;
            return Ok((round, None));
        }
        let started = std::time::SystemTime::now();
        let sent = self.send(&rows).await;
        crate::failpoint::crash_point!("after-publish-before-mark");
        self.quarantine(client, &sent).await?;
        let refused: HashSet<i64> = sent.refused.iter().map(|(r, _)| r.id).collect();
        let unsent: Vec<i64> = rows
            .iter()
            .map(|r| r.id)
            .filter(|id| !sent.acked.contains(id) && !refused.contains(id))
            .chain(put_back)
            .collect();
        db::commit_with(client, statements.requeue(client, &unsent)).await?;
        Ok((round, self.after_commit(&rows, sent, started).await))
    }

    /// Sends the rows and waits for every acknowledgement.
    async fn send<'a>(&self, rows: &'a [OutboxRow]) -> Sent<'a> {
        let topic = &self.config.kafka.outcomes_topic;
        let (generation, producer) = self.producer.get();
        let mut pending = Vec::with_capacity(rows.len());
        let mut refused = Vec::new();
        let mut failed = None;
        for row in rows {
            let record = FutureRecord::to(topic)
                .key(&row.key)
                .payload(&row.payload)
                .headers(outcome_headers(
                    &row.payload,
                    row.traceparent.as_deref(),
                    row.written_here.then_some((&row.event_id, &row.key)),
                ));
            // send_result only enqueues; the acknowledgements are awaited together below.
            match producer.send_result(record) {
                Ok(delivery) => pending.push((row, delivery)),
                // Refused for good: set aside, so the rows after it go out.
                Err((e, _)) if refused_for_good(&e) => refused.push((row, e)),
                // The local queue is full (or the producer is failing): what was enqueued is
                // awaited and marked, the rest waits for the next round.
                Err((e, _)) => {
                    failed = Some(PublishError::Kafka {
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
                .map(|(row, f)| async move { (row, f.await) }),
        )
        .await;
        // What Kafka acknowledged is marked even when something else failed, so one outcome
        // that cannot go out does not send the others again and again.
        let mut acked = HashSet::with_capacity(results.len());
        for (row, result) in results {
            match result {
                Ok(Ok(_)) => {
                    acked.insert(row.id);
                }
                Ok(Err((e, _))) if refused_for_good(&e) => refused.push((row, e)),
                Ok(Err((e, _))) => {
                    failed.get_or_insert(PublishError::Kafka {
                        event_id: row.event_id.clone(),
                        source: e,
                    });
                }
                Err(_) => {
                    failed.get_or_insert(PublishError::Kafka {
                        event_id: row.event_id.clone(),
                        source: rdkafka::error::KafkaError::Canceled,
                    });
                }
            }
        }
        Sent {
            acked,
            refused,
            failed,
            generation,
        }
    }

    /// Sets aside the rows the producer refused for good, in the round's transaction.
    async fn quarantine(
        &self,
        client: &deadpool_postgres::Object,
        sent: &Sent<'_>,
    ) -> Result<(), PublishError> {
        for (row, e) in &sent.refused {
            let reason = format!("the producer refused it: {e}");
            crate::publish::outbox::quarantine(client, row.id, &reason).await?;
        }
        Ok(())
    }

    /// After a round committed: its metrics, spans and logs, and the producer healed if a send
    /// failed. Returns that failure.
    async fn after_commit(
        &self,
        rows: &[OutboxRow],
        sent: Sent<'_>,
        started: std::time::SystemTime,
    ) -> Option<PublishError> {
        let topic = &self.config.kafka.outcomes_topic;
        self.metrics.published(topic, sent.acked.len() as u64);
        if crate::telemetry::enabled() {
            let published: Vec<&OutboxRow> =
                rows.iter().filter(|r| sent.acked.contains(&r.id)).collect();
            self.trace_published(&published, started).await;
        }
        for (row, e) in &sent.refused {
            self.metrics.outbox_quarantined();
            tracing::error!(event_id = %row.event_id, key = %row.key, error = %e, "outcome event refused by the producer for good; quarantined in the outbox");
        }
        if sent.failed.is_some() {
            self.producer.heal(sent.generation, &self.metrics);
        }
        sent.failed
    }

    /// Exports a `send` span for each published outcome, and the action's own span once its
    /// first outcome that is not a repeat's answer (nor a wait for approval) went out.
    async fn trace_published(&self, rows: &[&OutboxRow], started: std::time::SystemTime) {
        use crate::telemetry::{ActionTrace, Attribute, Kind, Span};
        let keys: Vec<&str> = rows.iter().map(|r| r.key.as_str()).collect();
        let events: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| serde_json::from_str(&r.payload).unwrap_or_default())
            .collect();
        // The action event each outcome answers.
        let answers: Vec<Option<&str>> = events
            .iter()
            .map(|e| e["data"]["action_event_id"].as_str())
            .collect();
        let answered: Vec<&str> = answers.iter().flatten().copied().collect();
        let intents = match self.pool.get().await {
            Ok(client) => client.query(TRACED_INTENTS, &[&keys, &answered]).await.ok(),
            Err(_) => None,
        };
        let Some(intents) = intents else {
            tracing::debug!("spans of published outcomes skipped: the database did not answer");
            return;
        };
        let now = std::time::SystemTime::now();
        let outcomes = &self.config.kafka.outcomes_topic;
        for ((row, event), answers) in rows.iter().zip(&events).zip(answers) {
            // A key's intent, or a read-only call's: the one this outcome answers.
            let Some(intent) = intents.iter().find(|i| {
                i.get::<_, &str>(0) == row.key
                    && i.get::<_, Option<&str>>(3)
                        .is_none_or(|call| Some(call) == answers)
            }) else {
                continue;
            };
            let created: std::time::SystemTime = intent.get(1);
            let trace = ActionTrace::of(&row.key, intent.get::<_, Option<&str>>(2));
            let data = &event["data"];
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

/// The CloudEvents attributes an outcome's headers repeat, read from its JSON without the rest
/// of it (`data` is skipped, not built).
#[derive(serde::Deserialize, Default)]
struct Attributes<'a> {
    #[serde(borrow)]
    id: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, rename = "type")]
    kind: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    source: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    subject: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    specversion: Option<std::borrow::Cow<'a, str>>,
}

/// An outcome event's headers: structured content (content-type says so), its trace context,
/// and its CloudEvents attributes, so a router can filter on them without parsing the body.
///
/// `written`: the id and subject of an outcome this process wrote ([`Outcome::new`]), whose
/// other attributes are idem's own, so nothing needs reading back. Otherwise (a row read from
/// the queue) the attributes are read from `payload`: reading them skips `data` but still has
/// to scan it, which cost 8 % of the relay's CPU at 95 % duplicates.
///
/// [`Outcome::new`]: crate::outcome::Outcome::new
fn outcome_headers(
    payload: &str,
    traceparent: Option<&str>,
    written: Option<(&str, &str)>,
) -> OwnedHeaders {
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
    // A row that is not an object of string attributes (written by hand) goes out without them.
    let attributes: Attributes = match written {
        Some((id, subject)) => Attributes {
            id: Some(id.into()),
            kind: Some(crate::outcome::OUTCOME_TYPE.into()),
            source: Some(crate::outcome::OUTCOME_SOURCE.into()),
            subject: Some(subject.into()),
            specversion: Some(crate::outcome::OUTCOME_SPECVERSION.into()),
        },
        None => serde_json::from_str(payload).unwrap_or_default(),
    };
    for (key, attribute) in [
        ("ce_id", &attributes.id),
        ("ce_type", &attributes.kind),
        ("ce_source", &attributes.source),
        ("ce_subject", &attributes.subject),
        ("ce_specversion", &attributes.specversion),
    ] {
        if let Some(value) = attribute.as_deref() {
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
        let record = FutureRecord::to(topic)
            .key(&answer.key)
            .payload(&answer.payload)
            .headers(outcome_headers(
                &answer.payload,
                answer.traceparent.as_deref(),
                Some((&answer.event_id, &answer.key)),
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

/// The creation time and incoming `traceparent` of each key ($1), for its spans: found by the
/// key's unique index, or for a read-only tool (one intent per call, outside that index) by the
/// call's first delivery, named by the action event the outcome answers ($2), which the row
/// carries (`call`). Both by index: the read by key alone scanned every intent, every
/// publishing round.
const TRACED_INTENTS: &str = "
    select idempotency_key, created_at, traceparent, null::text as call
      from intents
     where idempotency_key = any($1) and class <> 'read_only'
    union all
    select i.idempotency_key, i.created_at, i.traceparent, d.action_event_id
      from deliveries d join intents i on i.id = d.intent_id
     where d.action_event_id = any($2) and i.class = 'read_only'";

/// Listens on the outbox channel and wakes the publisher on every notification; reconnects
/// when the connection drops (the publisher polls meanwhile).
pub async fn listen(config: Arc<Config>, wake: Arc<Handoff>, shutdown: CancellationToken) {
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
                        Some(Ok(AsyncMessage::Notification(_))) => wake.wake_poll(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::answer::{self, KeyState};
    use crate::outcome::OutcomeStatus;
    use rdkafka::message::Headers;

    fn pairs(headers: &OwnedHeaders) -> Vec<(String, Vec<u8>)> {
        headers
            .iter()
            .map(|h| (h.key.to_string(), h.value.unwrap_or_default().to_vec()))
            .collect()
    }

    #[test]
    fn an_outcome_written_here_gets_the_headers_its_json_gives() {
        let state = KeyState {
            key: "r1:send_email:b\"1\"".into(),
            run_id: "r1".into(),
            step: Some(2),
            tool: "send_email".into(),
            status: OutcomeStatus::Succeeded,
            result: Some(serde_json::json!({"id": "m-1", "text": "a \"quoted\" é\n"})),
            error: None,
            attempts: 1,
            first_event_id: "e1".into(),
            at: chrono::Utc::now(),
        };
        let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let outcomes = [
            answer::status_change(&state, 1, None),
            answer::duplicate(&state, "e2", Some(traceparent.into())),
            answer::conflict(&state, "e3", Some(3), vec!["args.to".into()], None),
        ];
        for o in &outcomes {
            let tp = o.traceparent.as_deref();
            let read = pairs(&outcome_headers(&o.payload, tp, None));
            let written = pairs(&outcome_headers(
                &o.payload,
                tp,
                Some((&o.event_id, &o.key)),
            ));
            assert_eq!(written, read, "{}", o.payload);
            // content-type, the trace context when there is one, and five attributes.
            assert_eq!(read.len(), 6 + usize::from(tp.is_some()), "{read:?}");
        }
    }

    // With telemetry on, every publishing round reads the intents of the outcomes it sent. The
    // read must find them by index: a read-only tool's intents are outside the unique key index
    // (one intent per call), and the read by key alone scanned the whole table every round.
    #[tokio::test]
    async fn the_read_of_published_outcomes_intents_looks_each_up_by_index() {
        use crate::db::plans::{rows_read, Fresh};
        let db = Fresh::new().await;
        // One plan made on the empty schema (as a relay's first round may make it), one made
        // after the fill and its statistics.
        let read = |name: &str| {
            format!(
                "execute {name}('{{k1,k2,k3,k4,k5,q7,q9}}', '{{e1,e2,e3,e4,e5,eq14,eq15,eq18}}')"
            )
        };
        db.pg
            .batch_execute(&format!("prepare early as {TRACED_INTENTS}"))
            .await
            .expect("prepare");
        assert!(db.rows(&read("early")).await.is_empty());
        // Twenty thousand intents of a dangerous tool; two thousand calls of a read-only one,
        // two per key, each with its first delivery.
        db.intents(20_000, "'succeeded'", "false").await;
        db.pg
            .batch_execute(
                "with calls as (
                     insert into intents (idempotency_key, tool, class, run_id, args, material,
                                          fingerprint, args_hash, action_event_id, source_topic,
                                          source_partition, source_offset, status, traceparent)
                     select 'q' || (g / 2), 'lookup', 'read_only', 'r', '{}', '{}', 'f', 'h',
                            'eq' || g, 'actions', 1, g, 'succeeded', 'tp-q' || g
                       from generate_series(2, 2001) g
                     returning id, idempotency_key, action_event_id, source_offset)
                 insert into deliveries (intent_id, idempotency_key, action_event_id,
                                         source_topic, source_partition, source_offset, origin,
                                         answered)
                 select id, idempotency_key, action_event_id, 'actions', 1, source_offset,
                        'first', true
                   from calls;
                 analyze intents, deliveries;",
            )
            .await
            .expect("fill");
        db.pg
            .batch_execute(&format!("prepare t as {TRACED_INTENTS}"))
            .await
            .expect("prepare");
        // Five outcomes of the dangerous tool's keys, and of the read-only tool's two calls of
        // key q7 and first of q9: each call its own intent.
        let rows = db.rows(&read("t")).await;
        let mut found: Vec<(&str, &str)> = rows
            .iter()
            .map(|r| (r[0].1.as_str(), r[2].1.as_str()))
            .collect();
        found.sort();
        let expected = [
            ("k1", "tp-k1"),
            ("k2", "tp-k2"),
            ("k3", "tp-k3"),
            ("k4", "tp-k4"),
            ("k5", "tp-k5"),
            ("q7", "tp-q14"),
            ("q7", "tp-q15"),
            ("q9", "tp-q18"),
        ];
        assert_eq!(found, expected);
        for name in ["t", "early"] {
            let plan = db.explain(&read(name)).await;
            let n = rows_read(&plan, "intents");
            assert!(n <= 8.0, "8 outcomes' intents read {n} intents: {plan:#}");
            // The read-only calls' deliveries by event id (a hash index since migration 16).
            let n = rows_read(&plan, "deliveries");
            assert!(
                n <= 3.0,
                "3 calls' deliveries read {n} deliveries: {plan:#}"
            );
        }
        db.drop().await;
    }
}
