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
//! The modules follow the data's way through the relay:
//!
//! | stage | module | what happens |
//! |---|---|---|
//! | consume | [`consume`] | batches of action messages; bad ones to the dead-letter topic |
//! | decode | [`event`], [`key`] | CloudEvents in, key and fingerprints derived |
//! | record intent | [`store`] | one transaction per batch; offsets stored only after it commits |
//! | execute | [`execute`], [`http`] | claim with a lease, call, retry only what certainly did not happen |
//! | record outcome | [`store`], [`answer`] | outcome + outbox rows + answers to waiting repeats, fenced by epoch |
//! | publish | [`publish`] | outbox → outcomes topic, idempotent producer, LISTEN/NOTIFY wake-ups |
//!
//! Around them: [`config`] (TOML → typed config), [`db`] (pool, migrations, SQLSTATEs),
//! [`kafka`] (client settings, topics, lag), [`metrics`], [`admin`] (`/metrics`, `/readyz`),
//! [`relay`] (wiring and shutdown), [`inspect`] (`explain` and `resolve` for people) and
//! [`fake_downstream`] (a downstream that counts effects).

pub mod action;
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
pub mod metrics;
pub mod ops;
pub mod outcome;
pub(crate) mod publish;
pub(crate) mod recovery;
pub mod relay;
pub(crate) mod retry;
