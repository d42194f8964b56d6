//! idem makes agent tool calls happen exactly once.
//!
//! Agents publish keyed action events to Kafka. idem records each intent in Postgres under an
//! idempotency key, in the same transaction as the delivery that carried it; performs the side
//! effect (an HTTP call carrying the key, or SQL inside the outcome transaction); records the
//! result with its outbox row; and publishes outcome events from the outbox. A repeat gets the
//! first result, marked duplicate; the same key with different material fields is rejected; an
//! ambiguous result of a dangerous call is recorded `unknown`, never retried blind.
//!
//! # Layout
//!
//! One room per stage, in the order an action goes through them:
//!
//! | room | what happens there |
//! |---|---|
//! | [`action`] | the contract in: decode CloudEvents, field paths, key derivation, fingerprints |
//! | `consume` | the batch loop and its offsets (stored only after the intents commit); dead letters |
//! | `intent` | record a batch in one transaction; `classify` (pure) sorts first sights from each kind of repeat |
//! | [`gates`] | approval, per-run limits, reattempts, retention and tombstones |
//! | [`execute`] | queue and permits, claim, the http call and its verification, sql tools, leases, the attempt log's rule |
//! | [`outcome`] | the contract out: finish (group-committed, fenced by epoch), answers and notes, [`outcome::ErrorCode`] |
//! | `publish` | outbox rows, the finish's hand-off in memory, LISTEN/NOTIFY wake-ups, the idempotent publisher |
//! | `recovery` | the sweep: lapsed claims and stale intents handed on as the attempt log decides |
//! | [`ops`] | what people do: `explain`, `resolve`, the admin API (CLI and HTTP call the same functions) |
//! | [`mcp`] | idem as an MCP server: the catalogue as `tools/list`, a `tools/call` published as an action and answered with its outcome |
//! | [`config`] | raw TOML shape, typed shape, validation naming the field at fault |
//! | [`relay`] | wiring, background loops and the shutdown order |
//!
//! Shared by them: [`db`] (pools, migrations, SQLSTATE classes), [`kafka`] (clients, topics,
//! readiness, lag), `retry` (the one backoff), `group_commit` (many requests, one
//! transaction), `failpoint` (crash points for the crash tests), [`metrics`], and
//! [`fake_downstream`] (a downstream that counts effects, for tests and the demo).
//!
//! # Glossary
//!
//! One word per concept, used the same way in code, logs, metrics and the README:
//!
//! - **action**: an agent's request to run one tool once, as a Kafka message.
//! - **delivery**: one Kafka record of an action; repeats are deliveries of the same key.
//! - **batch**: the messages the consumer records in one transaction (and nothing else).
//! - **intent**: the row an action's key records, unique per idempotency key.
//! - **claim**: the right to run an intent now: `pending → running` with a new lease epoch.
//! - **lease**: how long a claim holds without renewal; the **epoch** fences late writes.
//! - **attempt**: one try at the effect (`call`) or at finding out whether it happened
//!   (`verify`), in the attempt log; the log alone decides what the next claim does.
//! - **outcome**: what an intent came to (`succeeded`, `failed`, `unknown`, `pending_approval`,
//!   `rejected`) and the event that says so.
//! - **answer**: an outcome event sent for one delivery (the first, or a duplicate's).
//! - **outbox**: outcome events written with the change they announce, published from there.
//! - **group commit**: many claims or finishes in one transaction (not to be confused with a
//!   batch).
//! - **cohort**: one tool's calls started together (by one batch); a finish group waits for the
//!   cohorts of the results it holds, and for no other call.

pub mod action;
#[cfg(test)]
mod arbitrary;
pub mod config;
pub(crate) mod consume;
pub mod db;
pub mod execute;
pub(crate) mod failpoint;
pub mod fake_downstream;
pub mod gates;
pub(crate) mod group_commit;
pub(crate) mod intent;
pub mod kafka;
pub mod mcp;
pub mod metrics;
pub mod ops;
pub mod outcome;
pub(crate) mod publish;
pub(crate) mod recovery;
pub mod relay;
pub(crate) mod retry;
pub mod telemetry;
