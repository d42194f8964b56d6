//! Consume and record: read action messages in batches, dead-letter bad ones, record every
//! intent in one transaction per batch, and only then store the batch's offsets.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use futures::FutureExt;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::message::{BorrowedMessage, Headers};
use rdkafka::Message;
use tokio_util::sync::CancellationToken;

use crate::action::key;
use crate::action::{self, BadAction};
use crate::config::Config;
use crate::db::DbError;
use crate::execute::Executor;
use crate::intent::Origin;
use crate::intent::{Incoming, KeyedAction, Position};
use crate::kafka::ActionConsumer;
use crate::metrics::Metrics;
use crate::outcome::ErrorCode;
use crate::retry::Backoff;

mod dead_letter;
mod linger;

/// A message's headers as (key, value) pairs; a header without a value is empty.
fn headers_of<'a>(m: &'a BorrowedMessage<'_>) -> Vec<(&'a str, &'a [u8])> {
    m.headers()
        .map(|h| {
            h.iter()
                .map(|h| (h.key, h.value.unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default()
}

/// Warnings of batches waiting for Postgres, throttled.
static RECORD_WAIT: crate::db::WaitLog = crate::db::WaitLog::new();

pub struct Consume {
    pub config: Arc<Config>,
    pub consumer: Arc<ActionConsumer>,
    pub producer: crate::kafka::SharedProducer,
    pub pool: Pool,
    pub executor: Arc<Executor>,
    pub metrics: Arc<Metrics>,
    /// Keys recorded, as far as this relay has seen: their repeats skip the intent insert.
    pub known: crate::intent::KnownKeys,
}

impl Consume {
    /// Runs until `shutdown`; the batch in hand is always finished and its offsets stored
    /// before returning, then offsets are committed synchronously.
    pub async fn run(self, shutdown: CancellationToken) {
        let consumer = self.consumer.clone();
        let policy = self.config.relay.batch_linger;
        let mut arrivals = linger::Arrivals::default();
        let mut fine = linger::FineSleep::start();
        let max = self.config.relay.batch_size;
        // The last batch's tail (its direct answers' acknowledgements, then its offsets) runs
        // while the next batch is read and recorded, and ends before that batch's tail begins,
        // so offsets only move forward. Once a tail could not let its batch's offsets advance
        // (shutdown came first), no later tail does either.
        let mut tail: Option<Tail<'_>> = None;
        let mut advancing = true;
        loop {
            let first = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                stored = drive(&mut tail) => Err(stored),
                m = consumer.recv() => Ok(m),
            };
            let first = match first {
                Ok(m) => m,
                Err(stored) => {
                    advancing &= stored;
                    tail = None;
                    continue;
                }
            };
            let mut batch = Vec::with_capacity(max);
            match first {
                Ok(m) => batch.push(m),
                Err(e) => {
                    tracing::warn!(error = %e, "kafka consume error");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            }
            // What librdkafka has fetched already joins the batch at once; waiting for more is
            // only up to the linger (by default only while actions stream in, and only while
            // they keep coming: a lone action is answered without delay, a stream's batches
            // fill and cost less per action, a burst goes as soon as it has all come in).
            let began = tokio::time::Instant::now();
            let wait = arrivals.linger(policy, max);
            let deadline = began + wait.most;
            while batch.len() < max {
                match consumer.recv().now_or_never() {
                    Some(Ok(m)) => {
                        batch.push(m);
                        continue;
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "kafka consume error");
                        break;
                    }
                    None if wait.most.is_zero() || batch.len() >= wait.until => break,
                    None => {}
                }
                let next = match wait.gap {
                    None => tokio::time::timeout_at(deadline, consumer.recv())
                        .await
                        .ok(),
                    Some(gap) => {
                        let until = deadline.min(tokio::time::Instant::now() + gap);
                        tokio::select! {
                            biased;
                            m = consumer.recv() => Some(m),
                            () = fine.until(until) => None,
                        }
                    }
                };
                match next {
                    Some(Ok(m)) => batch.push(m),
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "kafka consume error");
                        break;
                    }
                    None => break,
                }
            }
            arrivals.batch(began, batch.len());
            let previous = async {
                match tail.take() {
                    Some(t) => t.await,
                    None => true,
                }
            };
            let (next, stored) = futures::join!(self.process(&batch, &shutdown), previous);
            advancing &= stored;
            tail = next.map(|rest| self.settle(rest, advancing, &shutdown));
        }
        if let Some(t) = tail {
            t.await;
        }
        match consumer.commit_consumer_state(CommitMode::Sync) {
            Ok(()) => {}
            // Nothing stored since the last commit: nothing to do.
            Err(e)
                if e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::NoOffset) => {}
            Err(e) => {
                tracing::warn!(error = %e, "final offset commit failed; the next relay re-reads from the last commit")
            }
        }
    }

    /// Records a batch and dispatches its calls; returns what is left to do (`None` when the
    /// batch was rewound, to be read again), for [`Consume::settle`] once the previous batch's
    /// tail has ended.
    async fn process(
        &self,
        batch: &[BorrowedMessage<'_>],
        shutdown: &CancellationToken,
    ) -> Option<Unsettled> {
        let started = std::time::SystemTime::now();
        let items: Vec<Incoming> = batch.iter().map(|m| self.decode(m)).collect();

        // Dead letters go out before the offsets move, so a poison message is never lost. One
        // that cannot be written (after bounded tries, or at shutdown) rewinds its batch: nothing
        // is recorded and the batch is read again later.
        for (m, item) in batch.iter().zip(&items) {
            if let Incoming::Rejected {
                message, reason, ..
            } = item
            {
                if self
                    .dead_letter(m, reason.as_str(), message, shutdown)
                    .await
                    .is_err()
                {
                    Positions::of(batch).rewind(&self.consumer);
                    return None;
                }
            }
        }

        let channel = crate::publish::outbox::outbox_channel(&self.config.postgres.schema);
        let mut backoff = Backoff::waiting(Duration::from_millis(50));
        let mut result = loop {
            match self.record(&items, &channel).await {
                Ok(r) => {
                    self.metrics.postgres_wrote();
                    break r;
                }
                // Nothing recorded, so no offset moves: the next relay re-reads this batch.
                Err(_) if shutdown.is_cancelled() => return None,
                Err(e) if e.refuses_data() && items.len() > 1 => {
                    // One message the database refuses must not hold the others: record them
                    // one by one and dead-letter what cannot be recorded.
                    tracing::warn!(error = %e, "batch refused; recording its messages one by one");
                    match self.record_singly(batch, &items, &channel, shutdown).await {
                        Some(r) => break r,
                        None => {
                            Positions::of(batch).rewind(&self.consumer);
                            return None;
                        }
                    }
                }
                // Down, read-only, out of space, or anything else that is not this data's
                // fault: valid actions are never dead-lettered for it. The batch waits, and
                // the partition resumes where it stopped.
                Err(e) => {
                    self.metrics.postgres_unavailable("record");
                    RECORD_WAIT.retrying("record", &e);
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        _ = tokio::time::sleep(backoff.after_failure()) => {}
                    }
                }
            }
        };
        crate::failpoint::crash_point!("after-intent-commit");
        if crate::telemetry::enabled() {
            trace_recorded(&items, started, &self.config.kafka.group_id);
        }

        let direct = std::mem::take(&mut result.direct);
        count(&self.metrics, &result.origins, &result.rejections);
        // Claimed ones first into the set whose leases are renewed: their queue may be long.
        self.executor.hold(result.claimed.iter().map(|c| c.id));
        for c in result.claimed {
            self.executor.dispatch_claimed(c).await;
        }
        for (id, tool) in &result.new_intents {
            self.executor.dispatch(*id, tool).await;
        }

        // Answers sent straight to Kafka are handed to the producer now, in the order of the
        // batches; their acknowledgements (or the outbox, for what Kafka refuses) are awaited
        // by the tail, and only then may these offsets advance. The calls above wait for
        // neither.
        let sends = (!direct.is_empty()).then(|| {
            crate::failpoint::crash_point!("before-direct-answers");
            crate::publish::send_direct(&self.producer, &self.config.kafka.outcomes_topic, direct)
        });
        Some(Unsettled {
            sends,
            positions: Positions::of(batch),
            channel,
        })
    }

    /// A batch's tail: waits for its direct answers, then lets its offsets advance, unless an
    /// earlier tail could not (`advancing` false). `true` when the offsets were stored.
    fn settle<'a>(
        &'a self,
        rest: Unsettled,
        advancing: bool,
        shutdown: &'a CancellationToken,
    ) -> Tail<'a> {
        Box::pin(async move {
            if !advancing {
                return false;
            }
            if let Some(sends) = rest.sends {
                if !self.answered(sends, &rest.channel, shutdown).await {
                    rest.positions.rewind(&self.consumer);
                    return false;
                }
                crate::failpoint::crash_point!("after-direct-answers");
            }
            // The intents are durable and every answer is out: now, and only now, may these
            // offsets advance.
            rest.positions.store(&self.consumer);
            true
        })
    }

    /// Records a refused batch's messages one at a time; `None` when shutdown came first (no
    /// offset of the batch moves then; what was recorded is read again as redeliveries).
    async fn record_singly(
        &self,
        batch: &[BorrowedMessage<'_>],
        items: &[Incoming],
        channel: &str,
        shutdown: &CancellationToken,
    ) -> Option<crate::intent::BatchResult> {
        let mut all = crate::intent::BatchResult::default();
        for (m, item) in batch.iter().zip(items) {
            let mut backoff = Backoff::waiting(Duration::from_millis(50));
            let r = loop {
                match self.record(std::slice::from_ref(item), channel).await {
                    Ok(r) => break Some(r),
                    Err(_) if shutdown.is_cancelled() => return None,
                    // Only this message's own data may send it to the dead-letter topic.
                    Err(e) if e.refuses_data() => {
                        if self
                            .dead_letter(m, crate::metrics::UNRECORDABLE, &e.to_string(), shutdown)
                            .await
                            .is_err()
                        {
                            // What was recorded of this batch is read again as redeliveries.
                            return None;
                        }
                        break None;
                    }
                    Err(e) => {
                        self.metrics.postgres_unavailable("record");
                        RECORD_WAIT.retrying("record", &e);
                        tokio::time::sleep(backoff.after_failure()).await;
                    }
                }
            };
            if let Some(r) = r {
                all.new_intents.extend(r.new_intents);
                all.claimed.extend(r.claimed);
                all.origins.extend(r.origins);
                all.answers += r.answers;
                all.direct.extend(r.direct);
                all.rejections.extend(r.rejections);
            }
        }
        Some(all)
    }

    async fn record(
        &self,
        items: &[Incoming],
        channel: &str,
    ) -> Result<crate::intent::BatchResult, DbError> {
        let since = std::time::Instant::now();
        let claimant = crate::intent::Claimant {
            owner: &self.config.relay.instance_id,
            lease_secs: self.config.relay.lease.as_secs_f64(),
            since,
        };
        // record_batch opens and commits its own transaction; until it has committed, the
        // connection goes back to the pool only once rolled back.
        let open = crate::db::OpenTransaction::new(self.pool.get().await?);
        let recorded =
            crate::intent::record_batch(open.client(), items, channel, claimant, &self.known).await;
        open.close(recorded).await
    }

    /// Waits for Kafka's acknowledgement of a batch's direct answers; what Kafka does not
    /// acknowledge goes to the outbox instead (which retries, and quarantines what the producer
    /// refuses for good). `false` when shutdown came before the outbox took them: the batch's
    /// offsets must not move, and its records, read again, are answered again.
    async fn answered(
        &self,
        sends: crate::publish::DirectSends,
        channel: &str,
        shutdown: &CancellationToken,
    ) -> bool {
        let topic = &self.config.kafka.outcomes_topic;
        let failed = sends
            .acknowledged(&self.producer, topic, &self.metrics)
            .await;
        if failed.is_empty() {
            return true;
        }
        let mut backoff = Backoff::waiting(Duration::from_millis(50));
        loop {
            let attempt = async {
                let mut client = self.pool.get().await?;
                let tx = client.transaction().await?;
                crate::publish::outbox::insert_outbox(&tx, &failed, channel).await?;
                tx.commit().await?;
                Ok::<(), DbError>(())
            };
            match attempt.await {
                Ok(()) => return true,
                Err(e) => {
                    RECORD_WAIT.retrying("record", &e);
                    tokio::select! {
                        _ = shutdown.cancelled() => return false,
                        _ = tokio::time::sleep(backoff.after_failure()) => {}
                    }
                }
            }
        }
    }

    fn decode(&self, m: &BorrowedMessage<'_>) -> Incoming {
        let pos = Position {
            topic: m.topic().to_string(),
            partition: m.partition(),
            offset: m.offset(),
            schema_id: m
                .payload()
                .and_then(action::schema_registry_frame)
                .map(|(id, _)| id as i32),
        };
        let headers = headers_of(m);
        let rejected = |bad: BadAction| Incoming::Rejected {
            pos: pos.clone(),
            reason: bad.reason,
            message: bad.detail,
            partial: bad.partial.map(|p| *p),
        };
        let event = match action::decode_action(
            m.payload(),
            m.key(),
            &headers,
            self.config.relay.max_message_bytes,
        ) {
            Ok(e) => e,
            Err(bad) => return rejected(bad),
        };
        let partial = || {
            Some(action::PartialAction {
                fields: Vec::new(),
                event_id: event.id.clone(),
                run_id: event.data.run_id.clone(),
                key: event
                    .data
                    .idempotency_key
                    .clone()
                    .or_else(|| {
                        m.key()
                            .and_then(|k| std::str::from_utf8(k).ok())
                            .map(str::to_string)
                    })
                    .unwrap_or_else(|| event.data.run_id.clone()),
                tool: Some(event.data.tool.clone()),
                step: event.data.step,
            })
        };
        let Some(tool) = self.config.tool(&event.data.tool) else {
            return Incoming::Rejected {
                pos,
                reason: action::DeadLetterReason::UnknownTool,
                message: format!("tool {} is not configured", event.data.tool),
                partial: partial(),
            };
        };
        // Arguments outside the tool's schema: nothing is recorded or sent, and the answer
        // names the values at fault.
        if let Some((message, fields)) = tool
            .input_schema
            .as_ref()
            .and_then(|s| s.violations(&serde_json::Value::Object(event.data.args.clone())))
        {
            let mut partial = partial();
            if let Some(p) = partial.as_mut() {
                p.fields = fields;
            }
            return Incoming::Rejected {
                pos,
                reason: action::DeadLetterReason::SchemaInvalid,
                message,
                partial,
            };
        }
        // Arguments the tool cannot use as they are: nothing is recorded or sent.
        let unusable = crate::gates::approval_field_usable(tool, &event.data)
            .map_err(|m| (action::DeadLetterReason::SchemaInvalid, m))
            .and_then(|()| {
                crate::execute::url_args_usable(tool, &event.data)
                    .map_err(|m| (action::DeadLetterReason::InvalidArgs, m))
            });
        if let Err((reason, message)) = unusable {
            return Incoming::Rejected {
                pos,
                reason,
                message,
                partial: partial(),
            };
        }
        match key::derive_key(tool, &event.data) {
            Ok(k) => {
                let gates =
                    crate::gates::Gates::of(tool, &event.data, self.config.relay.max_per_run);
                Incoming::Action(Box::new(KeyedAction::new(pos, event, tool, k, gates)))
            }
            Err(e) => {
                let mut p = partial();
                // An unusable key cannot name the answer; answer under the run id instead.
                if let Some(p) = p.as_mut() {
                    if key::validate_key(&p.key).is_err() {
                        p.key = event.data.run_id.clone();
                    }
                    if key::validate_key(&p.key).is_err() {
                        return Incoming::Rejected {
                            pos,
                            reason: action::DeadLetterReason::InvalidKey,
                            message: e.to_string(),
                            partial: None,
                        };
                    }
                }
                Incoming::Rejected {
                    pos,
                    reason: action::DeadLetterReason::InvalidKey,
                    message: e.to_string(),
                    partial: p,
                }
            }
        }
    }
}

/// Adds a recorded batch to the metrics: (tool, origin) of each message, (tool, error code) of
/// each action a gate refused. Each series once, by how many: a batch of repeats is mostly a
/// few (tool, origin) pairs many times over.
fn count(metrics: &Metrics, origins: &[(String, Origin)], rejections: &[(String, &'static str)]) {
    let mut by_origin: BTreeMap<(&str, Origin), u64> = BTreeMap::new();
    for (tool, origin) in origins {
        *by_origin.entry((tool, *origin)).or_default() += 1;
    }
    for ((tool, origin), n) in by_origin {
        metrics.consumed(origin, n);
        if origin.is_duplicate() {
            metrics.duplicate(tool, origin, n);
        } else if origin == Origin::Conflict {
            metrics.conflict(tool, n);
            metrics.rejection(tool, ErrorCode::KeyConflict.as_str(), n);
        }
    }
    let mut by_code: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for (tool, code) in rejections {
        *by_code.entry((tool, code)).or_default() += 1;
    }
    for ((tool, code), n) in by_code {
        metrics.rejection(tool, code, n);
    }
}

/// What is left of a recorded batch: its direct answers' acknowledgements, then its offsets.
struct Unsettled {
    sends: Option<crate::publish::DirectSends>,
    positions: Positions,
    channel: String,
}

/// A batch's tail under way ([`Consume::settle`]): `true` once its offsets are stored.
type Tail<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + 'a>>;

/// Runs the tail in hand to its end; never ends without one.
async fn drive(tail: &mut Option<Tail<'_>>) -> bool {
    match tail {
        Some(t) => t.await,
        None => std::future::pending().await,
    }
}

/// Where a batch's messages lie: each partition's first and last offset in it.
struct Positions(BTreeMap<(String, i32), (i64, i64)>);

impl Positions {
    fn of(batch: &[BorrowedMessage<'_>]) -> Self {
        let mut range: BTreeMap<(String, i32), (i64, i64)> = BTreeMap::new();
        for m in batch {
            let (first, last) = range
                .entry((m.topic().to_string(), m.partition()))
                .or_insert((m.offset(), m.offset()));
            *first = (*first).min(m.offset());
            *last = (*last).max(m.offset());
        }
        Positions(range)
    }

    /// Lets the batch's offsets advance to its last message in each partition.
    fn store(&self, consumer: &ActionConsumer) {
        for ((topic, partition), (_, last)) in &self.0 {
            if let Err(e) = consumer.store_offset(topic, *partition, *last) {
                // The partition was revoked meanwhile; its next owner re-reads and dedupes.
                tracing::debug!(error = %e, topic, partition, "offset not stored");
            }
        }
    }

    /// Seeks each partition back to the batch's first message, so it is read again.
    fn rewind(&self, consumer: &ActionConsumer) {
        for ((topic, partition), (first, _)) in &self.0 {
            if let Err(e) = consumer.seek(
                topic,
                *partition,
                rdkafka::Offset::Offset(*first),
                Duration::from_secs(5),
            ) {
                // Revoked meanwhile, or the seek failed: the offset was not stored, so the
                // next owner (or this consumer after a rebalance) reads it again.
                tracing::warn!(error = %e, topic, partition, offset = first, "cannot rewind the partition");
            }
        }
    }
}

/// Exports a `record` span for each action of a batch just recorded: from the batch's start to
/// its commit, a child of the action's span.
fn trace_recorded(items: &[Incoming], started: std::time::SystemTime, group: &str) {
    use crate::telemetry::{ActionTrace, Attribute, Kind, Span};
    let now = std::time::SystemTime::now();
    for item in items {
        let Incoming::Action(a) = item else { continue };
        crate::telemetry::action_consumed(&a.key, started);
        let trace = ActionTrace::of(&a.key, a.event.traceparent.as_deref());
        trace.emit_child(
            trace.child(&format!("record/{}", a.event.id)),
            Span {
                name: "record".to_string(),
                kind: Kind::Internal,
                start: started,
                end: now,
                attributes: vec![
                    Attribute::new("messaging.system", "kafka"),
                    Attribute::new("messaging.destination.name", a.pos.topic.clone()),
                    Attribute::new("messaging.consumer.group.name", group.to_string()),
                    Attribute::new(
                        "messaging.destination.partition.id",
                        a.pos.partition.to_string(),
                    ),
                    Attribute::new("messaging.kafka.offset", a.pos.offset),
                    Attribute::new("messaging.message.id", a.event.id.clone()),
                    Attribute::new("idem.tool", a.tool.clone()),
                    Attribute::new("db.system.name", "postgresql"),
                ],
                error: None,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_counts_each_message_once_in_every_series_it_belongs_to() {
        let m = Metrics::new();
        let origins: Vec<(String, Origin)> = [
            ("send", Origin::First),
            ("send", Origin::Replay),
            ("send", Origin::Replay),
            ("send", Origin::ModelRetry),
            ("refund", Origin::Replay),
            ("send", Origin::Conflict),
            ("send", Origin::Redelivery),
            ("", Origin::DeadLetter),
        ]
        .into_iter()
        .map(|(t, o)| (t.to_string(), o))
        .collect();
        let rejections = [
            ("refund".to_string(), "run_limit_exceeded"),
            ("refund".to_string(), "run_limit_exceeded"),
        ];
        count(&m, &origins, &rejections);
        let text = m.render();
        for line in [
            "idem_messages_consumed_total{origin=\"first\"} 1",
            "idem_messages_consumed_total{origin=\"replay\"} 3",
            "idem_messages_consumed_total{origin=\"model_retry\"} 1",
            "idem_messages_consumed_total{origin=\"conflict\"} 1",
            "idem_messages_consumed_total{origin=\"redelivery\"} 1",
            "idem_messages_consumed_total{origin=\"dead_letter\"} 1",
            "idem_duplicates_total{origin=\"replay\",tool=\"send\"} 2",
            "idem_duplicates_total{origin=\"replay\",tool=\"refund\"} 1",
            "idem_duplicates_total{origin=\"model_retry\",tool=\"send\"} 1",
            "idem_duplicates_total{origin=\"redelivery\",tool=\"send\"} 1",
            "idem_conflicts_total{tool=\"send\"} 1",
            "idem_rejections_total{code=\"key_conflict\",tool=\"send\"} 1",
            "idem_rejections_total{code=\"run_limit_exceeded\",tool=\"refund\"} 2",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
        assert!(
            !text.contains("idem_duplicates_total{origin=\"first\""),
            "a first sight is no duplicate"
        );
    }
}
