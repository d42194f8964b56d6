//! Every metric idem exports: names, help texts and labels live here and nowhere else.
//! Labels stay bounded (tool, status, origin, reason, code, partition) — never a key or run id.
//!
//! Each relay owns a [`Metrics`] with its own registry, so several relays can run in one
//! process (the tests do) without sharing counters.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::action::DeadLetterReason;
use crate::intent::Origin;
use crate::outcome::{ErrorCode, OutcomeStatus};

/// Why the executor retries (`idem_retries_total{reason}`): an attempt's own reason, or a
/// verification that found the effect not done.
pub const RETRY_REASONS: [&str; 5] = [
    "throttled",
    "unavailable",
    "not_sent",
    "ambiguous",
    "verified_not_done",
];
/// What a verification found (`idem_verifications_total{result}`).
pub const VERIFY_RESULTS: [&str; 3] = ["done", "not_done", "inconclusive"];
/// Where database work waits for Postgres (`idem_postgres_retries_total{stage}`).
pub const POSTGRES_STAGES: [&str; 5] = ["record", "claim", "fence", "begin attempt", "end attempt"];
/// The dead-letter reason of a message Postgres refused to store even alone.
pub const UNRECORDABLE: &str = "unrecordable";
/// The parked statuses (`idem_keys_parked{status}`).
pub const PARKED: [&str; 2] = ["unknown", "pending_approval"];

pub struct Metrics {
    registry: Registry,
    names: Vec<String>,
    actions: IntCounterVec,
    side_effects: IntCounterVec,
    duplicates: IntCounterVec,
    retries: IntCounterVec,
    attempts_per_action: Histogram,
    unknown_outcomes: IntCounterVec,
    verifications: IntCounterVec,
    keys_parked: IntGaugeVec,
    conflicts: IntCounterVec,
    rejections: IntCounterVec,
    dead_letters: IntCounterVec,
    side_effect_duration: HistogramVec,
    action_latency: HistogramVec,
    pub outbox_pending: IntGauge,
    outbox_oldest_age: prometheus::Gauge,
    consumer_lag: IntGaugeVec,
    pub inflight: IntGauge,
    /// Intents recorded and not yet settled, as the last recovery sweep counted them.
    pub intents_pending: IntGauge,
    messages_consumed: IntCounterVec,
    outcomes_published: IntCounterVec,
    postgres_retries: IntCounterVec,
    outbox_quarantined: prometheus::IntCounter,
    outbox_held_back: prometheus::IntCounter,
    dead_letters_failed: prometheus::IntCounter,
    producers_rebuilt: prometheus::IntCounter,
    /// 1 while the relay's last write to Postgres went through; 0 while writes fail (down,
    /// read-only, out of space). `/readyz` reads it too.
    postgres_writable: IntGauge,
}

/// Registers collectors and remembers their names, so the dashboard and alert rules can be
/// checked against what is really exported.
struct Registrar {
    registry: Registry,
    names: Vec<String>,
}

impl Registrar {
    fn add<C: prometheus::core::Collector + Clone + 'static>(&mut self, name: &str, c: C) -> C {
        self.registry
            .register(Box::new(c.clone()))
            .expect("unique metric");
        self.names.push(name.to_string());
        c
    }

    fn counter(&mut self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.add(
            name,
            IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"),
        )
    }

    fn int_counter(&mut self, name: &str, help: &str) -> prometheus::IntCounter {
        self.add(
            name,
            prometheus::IntCounter::new(name, help).expect("valid metric"),
        )
    }

    fn gauge_vec(&mut self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.add(
            name,
            IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"),
        )
    }

    fn histogram(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
        buckets: &[f64],
    ) -> HistogramVec {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        self.add(name, HistogramVec::new(opts, labels).expect("valid metric"))
    }
}

const SECONDS_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registrar {
            registry: Registry::new(),
            names: Vec::new(),
        };
        let attempts_per_action = r.add(
            "idem_attempts_per_action",
            Histogram::with_opts(
                HistogramOpts::new(
                    "idem_attempts_per_action",
                    "Downstream calls it took to settle one key.",
                )
                .buckets(vec![1.0, 2.0, 3.0, 5.0, 8.0, 13.0]),
            )
            .expect("valid metric"),
        );
        let outbox_pending = r.add(
            "idem_outbox_pending",
            IntGauge::new(
                "idem_outbox_pending",
                "Outcome events recorded but not yet published.",
            )
            .expect("valid metric"),
        );
        let outbox_oldest_age = r.add(
            "idem_outbox_oldest_age_seconds",
            prometheus::Gauge::new(
                "idem_outbox_oldest_age_seconds",
                "Age of the oldest unpublished outcome event (0 when none).",
            )
            .expect("valid metric"),
        );
        let intents_pending = r.add(
            "idem_intents_pending",
            IntGauge::new(
                "idem_intents_pending",
                "Intents recorded and not yet settled (pending or running), counted every recovery interval: the backlog an autoscaler should follow.",
            )
            .expect("valid metric"),
        );
        let inflight = r.add(
            "idem_inflight",
            IntGauge::new("idem_inflight", "Downstream calls in flight now.")
                .expect("valid metric"),
        );
        let postgres_writable = r.add(
            "idem_postgres_writable",
            IntGauge::new(
                "idem_postgres_writable",
                "1 while writes to Postgres succeed, 0 while the relay waits for it to accept writes again.",
            )
            .expect("valid metric"),
        );
        postgres_writable.set(1);
        let build_info = r.add(
            "idem_build_info",
            IntGaugeVec::new(
                Opts::new(
                    "idem_build_info",
                    "1, labelled with the relay's version and revision.",
                ),
                &["version", "revision"],
            )
            .expect("valid metric"),
        );
        build_info
            .with_label_values(&[
                env!("CARGO_PKG_VERSION"),
                option_env!("IDEM_GIT_REVISION").unwrap_or("unknown"),
            ])
            .set(1);
        // CPU, memory, open files and start time of this process (`process_*`).
        r.registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("unique metric");
        let outbox_quarantined = r.int_counter("idem_outbox_quarantined_total", "Outcome events the producer refused for good (too large, invalid), set aside in the outbox.");
        let outbox_held_back = r.int_counter("idem_outbox_held_back_total", "Times a publishing round left an outcome event queued for a later round, because an earlier outcome of its key was still queued or held by another round.");
        let dead_letters_failed = r.int_counter("idem_dead_letters_failed_total", "Dead letters that could not be written after bounded tries; their batch is read again.");
        let producers_rebuilt = r.int_counter(
            "idem_producer_rebuilt_total",
            "Times the producer failed fatally (librdkafka) and was replaced by a new one.",
        );
        Metrics {
            producers_rebuilt,
            outbox_quarantined,
            outbox_held_back,
            dead_letters_failed,
            postgres_writable,
            postgres_retries: r.counter("idem_postgres_retries_total", "Database work retried because Postgres was unavailable, read-only or out of resources, by stage.", &["stage"]),
            actions: r.counter("idem_actions_total", "Outcomes recorded for actions, by status.", &["tool", "status"]),
            side_effects: r.counter("idem_side_effects_total", "Downstream calls that performed an effect, as far as known.", &["tool"]),
            duplicates: r.counter("idem_duplicates_total", "Repeats suppressed, by the layer that caused them.", &["tool", "origin"]),
            retries: r.counter("idem_retries_total", "Downstream calls retried by the executor, by reason.", &["tool", "reason"]),
            attempts_per_action,
            unknown_outcomes: r.counter("idem_unknown_outcomes_total", "Actions whose effect could not be known after the call.", &["tool"]),
            verifications: r.counter("idem_verifications_total", "Downstream verifications, by result.", &["tool", "result"]),
            keys_parked: r.gauge_vec("idem_keys_parked", "Keys waiting for a person: status unknown or pending_approval.", &["status"]),
            conflicts: r.counter("idem_conflicts_total", "Same key with different material fields: rejected.", &["tool"]),
            rejections: r.counter("idem_rejections_total", "Actions rejected, by error code.", &["tool", "code"]),
            dead_letters: r.counter("idem_dead_letters_total", "Action messages sent to the dead-letter topic, by reason.", &["reason"]),
            side_effect_duration: r.histogram("idem_side_effect_duration_seconds", "Duration of one downstream call.", &["tool"], &SECONDS_BUCKETS),
            action_latency: r.histogram("idem_action_latency_seconds", "From the action event's time (or its receipt) to its outcome recorded.", &["tool"], &SECONDS_BUCKETS),
            outbox_pending,
            outbox_oldest_age,
            consumer_lag: r.gauge_vec("idem_consumer_lag", "Messages of the actions topic not yet consumed, per partition (librdkafka statistics).", &["topic", "group", "partition"]),
            inflight,
            intents_pending,
            messages_consumed: r.counter("idem_messages_consumed_total", "Action messages read from Kafka, by origin.", &["origin"]),
            outcomes_published: r.counter("idem_outcomes_published_total", "Outcome events acknowledged by Kafka.", &["topic"]),
            names: r.names,
            registry: r.registry,
        }
    }

    /// Creates, at 0, every labelled series these tools and topics can produce, so each exists
    /// from the start: a `rate()` over a series that appears only at its first increment
    /// misses that increment, and an `absent()` alert fires on a relay that is merely quiet.
    pub fn prime(&self, tools: &[&str], topics: &[&str]) {
        for &tool in tools {
            for status in OutcomeStatus::ALL {
                self.actions.with_label_values(&[tool, status.as_str()]);
            }
            for origin in Origin::ALL.into_iter().filter(|o| o.is_duplicate()) {
                self.duplicates.with_label_values(&[tool, origin.as_str()]);
            }
            for reason in RETRY_REASONS {
                self.retries.with_label_values(&[tool, reason]);
            }
            for result in VERIFY_RESULTS {
                self.verifications.with_label_values(&[tool, result]);
            }
            for code in ErrorCode::ALL {
                self.rejections.with_label_values(&[tool, code.as_str()]);
            }
            self.side_effects.with_label_values(&[tool]);
            self.unknown_outcomes.with_label_values(&[tool]);
            self.conflicts.with_label_values(&[tool]);
            self.side_effect_duration.with_label_values(&[tool]);
            self.action_latency.with_label_values(&[tool]);
        }
        for reason in DeadLetterReason::ALL.map(DeadLetterReason::as_str) {
            self.dead_letters.with_label_values(&[reason]);
        }
        self.dead_letters.with_label_values(&[UNRECORDABLE]);
        for origin in Origin::ALL {
            self.messages_consumed.with_label_values(&[origin.as_str()]);
        }
        for &topic in topics {
            self.outcomes_published.with_label_values(&[topic]);
        }
        for stage in POSTGRES_STAGES {
            self.postgres_retries.with_label_values(&[stage]);
        }
        for status in PARKED {
            self.keys_parked.with_label_values(&[status]);
        }
    }

    /// Every metric family this relay exports (histograms add `_bucket`, `_sum`, `_count`).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }

    /// `n` messages consumed of this origin.
    pub fn consumed(&self, origin: Origin, n: u64) {
        self.messages_consumed
            .with_label_values(&[origin.as_str()])
            .inc_by(n);
    }

    /// `n` duplicates suppressed, from the layer `origin` names.
    pub fn duplicate(&self, tool: &str, origin: Origin, n: u64) {
        self.duplicates
            .with_label_values(&[tool, origin.as_str()])
            .inc_by(n);
    }

    pub fn outcome(&self, tool: &str, status: &str) {
        self.actions.with_label_values(&[tool, status]).inc();
    }

    pub fn side_effect(&self, tool: &str) {
        self.side_effects.with_label_values(&[tool]).inc();
    }

    pub fn retry(&self, tool: &str, reason: &str) {
        self.retries.with_label_values(&[tool, reason]).inc();
    }

    pub fn attempts(&self, n: u32) {
        self.attempts_per_action.observe(f64::from(n));
    }

    pub fn unknown_outcome(&self, tool: &str) {
        self.unknown_outcomes.with_label_values(&[tool]).inc();
    }

    pub fn verification(&self, tool: &str, result: &str) {
        self.verifications.with_label_values(&[tool, result]).inc();
    }

    pub fn parked(&self, status: &str, n: i64) {
        self.keys_parked.with_label_values(&[status]).set(n);
    }

    /// `n` keys reused with other material parameters.
    pub fn conflict(&self, tool: &str, n: u64) {
        self.conflicts.with_label_values(&[tool]).inc_by(n);
    }

    /// `n` actions refused with `code`.
    pub fn rejection(&self, tool: &str, code: &str, n: u64) {
        self.rejections.with_label_values(&[tool, code]).inc_by(n);
    }

    pub fn dead_letter(&self, reason: &str) {
        self.dead_letters.with_label_values(&[reason]).inc();
    }

    pub fn side_effect_duration(&self, tool: &str, seconds: f64) {
        self.side_effect_duration
            .with_label_values(&[tool])
            .observe(seconds);
    }

    pub fn action_latency(&self, tool: &str, seconds: f64) {
        self.action_latency
            .with_label_values(&[tool])
            .observe(seconds);
    }

    pub fn outbox(&self, pending: i64, oldest_age_seconds: f64) {
        self.outbox_pending.set(pending);
        self.outbox_oldest_age.set(oldest_age_seconds);
    }

    /// Messages of the actions topic not yet consumed, over every partition this relay reads.
    pub fn consumer_lag_total(&self) -> i64 {
        use prometheus::core::Collector;
        self.consumer_lag
            .collect()
            .iter()
            .flat_map(|family| family.get_metric())
            .map(|m| m.get_gauge().get_value() as i64)
            .filter(|lag| *lag > 0)
            .sum()
    }

    pub fn consumer_lag(&self, topic: &str, group: &str, partition: i32, lag: i64) {
        self.consumer_lag
            .with_label_values(&[topic, group, &partition.to_string()])
            .set(lag);
    }

    pub fn published(&self, topic: &str, n: u64) {
        self.outcomes_published
            .with_label_values(&[topic])
            .inc_by(n);
    }

    /// Work at `stage` waits for Postgres to accept it again.
    pub fn postgres_unavailable(&self, stage: &str) {
        self.postgres_retries.with_label_values(&[stage]).inc();
        self.postgres_writable.set(0);
    }

    /// A write went through.
    pub fn postgres_wrote(&self) {
        self.postgres_writable.set(1);
    }

    pub fn postgres_is_writable(&self) -> bool {
        self.postgres_writable.get() == 1
    }

    pub fn outbox_quarantined(&self) {
        self.outbox_quarantined.inc();
    }

    /// `n` outcome events left queued behind an earlier outcome of their key.
    pub fn outbox_held_back(&self, n: usize) {
        self.outbox_held_back.inc_by(n as u64);
    }

    pub fn dead_letter_failed(&self) {
        self.dead_letters_failed.inc();
    }

    pub fn producer_rebuilt(&self) {
        self.producers_rebuilt.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::execute::http::Attempt;

    #[test]
    fn every_retry_reason_an_attempt_gives_is_primed() {
        let attempts = [
            Attempt::Retry {
                status: 429,
                retry_after: None,
            },
            Attempt::Retry {
                status: 503,
                retry_after: None,
            },
            Attempt::NotSent("refused".into()),
            Attempt::Ambiguous {
                reason: "timed out".into(),
                status: None,
            },
        ];
        for a in attempts {
            assert!(RETRY_REASONS.contains(&a.retry_reason()), "{a:?}");
        }
    }

    #[test]
    fn priming_makes_every_series_at_zero_and_counting_still_counts() {
        let m = Metrics::new();
        m.prime(&["t"], &["outcomes"]);
        let text = m.render();
        assert!(text.contains("idem_duplicates_total{origin=\"redelivery\",tool=\"t\"} 0"));
        assert!(
            !text.contains("origin=\"first\",tool=\"t\""),
            "first sights are not duplicates"
        );
        m.duplicate("t", Origin::Replay, 1);
        assert!(m
            .render()
            .contains("idem_duplicates_total{origin=\"replay\",tool=\"t\"} 1"));
    }
}
