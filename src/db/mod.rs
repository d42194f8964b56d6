//! Postgres: the connection pool, migrations, and the one place SQLSTATEs are classified.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::error::SqlState;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::config::PostgresConfig;

#[cfg(test)]
pub(crate) mod plans;
mod tls;

pub use tls::{Roots, SslMode, TlsParams};

/// Migrations, applied in order; the number is the version recorded.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "0001_core",
        include_str!("../../schemas/postgres/0001_core.sql"),
    ),
    (
        2,
        "0002_attempts",
        include_str!("../../schemas/postgres/0002_attempts.sql"),
    ),
    (
        3,
        "0003_gates",
        include_str!("../../schemas/postgres/0003_gates.sql"),
    ),
    (
        4,
        "0004_attempt_hot_updates",
        include_str!("../../schemas/postgres/0004_attempt_hot_updates.sql"),
    ),
    (
        5,
        "0005_outbox_quarantine",
        include_str!("../../schemas/postgres/0005_outbox_quarantine.sql"),
    ),
    (
        6,
        "0006_delivery_schema_id",
        include_str!("../../schemas/postgres/0006_delivery_schema_id.sql"),
    ),
    (
        7,
        "0007_growth",
        include_str!("../../schemas/postgres/0007_growth.sql"),
    ),
    (
        8,
        "0008_direct_answers",
        include_str!("../../schemas/postgres/0008_direct_answers.sql"),
    ),
    (
        9,
        "0009_outbox_pending",
        include_str!("../../schemas/postgres/0009_outbox_pending.sql"),
    ),
    (
        10,
        "0010_fewer_key_indexes",
        include_str!("../../schemas/postgres/0010_fewer_key_indexes.sql"),
    ),
    (
        11,
        "0011_published_by_the_queue",
        include_str!("../../schemas/postgres/0011_published_by_the_queue.sql"),
    ),
    (
        12,
        "0012_no_foreign_key_checks",
        include_str!("../../schemas/postgres/0012_no_foreign_key_checks.sql"),
    ),
    (
        13,
        "0013_first_delivery_on_the_intent",
        include_str!("../../schemas/postgres/0013_first_delivery_on_the_intent.sql"),
    ),
    (
        14,
        "0014_resolutions_by_intent",
        include_str!("../../schemas/postgres/0014_resolutions_by_intent.sql"),
    ),
    (
        15,
        "0015_dead_letters_by_age",
        include_str!("../../schemas/postgres/0015_dead_letters_by_age.sql"),
    ),
    (
        16,
        "0016_deliveries_event_hash",
        include_str!("../../schemas/postgres/0016_deliveries_event_hash.sql"),
    ),
];

/// The locks of [`MIGRATIONS`] that `migrate` takes before any pending migration runs (each
/// also takes its own, for a schema applied by hand): (migration, its lock statement).
const FIRST_LOCKS: &[(i32, &str)] = &[(16, "lock table deliveries in access exclusive mode")];

/// Lets `?` turn a driver error into a stage's error whose `Db` variant wraps [`DbError`]: the
/// one conversion, written once.
macro_rules! from_postgres {
    ($t:ty) => {
        impl From<tokio_postgres::Error> for $t {
            fn from(e: tokio_postgres::Error) -> Self {
                Self::Db($crate::db::DbError::Postgres(e))
            }
        }
    };
}
pub(crate) use from_postgres;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("postgres: {}", describe(.0))]
    Postgres(#[from] tokio_postgres::Error),
    #[error("postgres pool: {}", describe_pool(.0))]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("postgres pool setup: {0}")]
    Build(String),
    /// A key read a moment ago in the same transaction is gone (pruned meanwhile): the work
    /// is done again from the start.
    #[error("intent of key {0} vanished while its batch was recorded")]
    Vanished(String),
    /// The TLS handshake failed: what the URL asked of the server's certificate, and why.
    #[error("postgres tls handshake failed ({asked}): {reason}")]
    Tls { asked: String, reason: String },
}

/// A pool error; a server's refusal to connect (a pg_hba rule, a wrong password) with its
/// message and SQLSTATE.
fn describe_pool(e: &deadpool_postgres::PoolError) -> String {
    match e {
        deadpool_postgres::PoolError::Backend(e) => format!("cannot connect: {}", describe(e)),
        other => other.to_string(),
    }
}

/// A server error with its SQLSTATE and message (tokio-postgres alone says only "db error").
fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("{} (SQLSTATE {})", d.message(), d.code().code()),
        None => e.to_string(),
    }
}

/// What a database error says about retrying: the one place SQLSTATEs are sorted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The database cannot do it now (down, read-only, out of space, cancelled, a lock wait or
    /// a serialization conflict): the same work succeeds later. Never the message's fault.
    Unavailable,
    /// The data of one message is refused (classes 22 data exception, 23 integrity constraint,
    /// 54 program limit such as a row too large): retrying it alone fails the same way.
    Refused,
    /// Anything else (a missing table, a syntax error, an internal error): not the message's
    /// fault either, and not expected to heal by itself.
    Other,
}

/// Sorts a SQLSTATE (`None`: no code, the connection or I/O failed).
pub fn fault_of(sqlstate: Option<&str>) -> Fault {
    let Some(code) = sqlstate else {
        return Fault::Unavailable;
    };
    match (&code[..2.min(code.len())], code) {
        // Connection exceptions, insufficient resources (disk full, out of memory, too many
        // connections), operator intervention (admin shutdown, crash shutdown, cannot connect
        // now, query cancelled), system errors (I/O).
        ("08" | "53" | "57" | "58", _) => Fault::Unavailable,
        // Serialization failure, deadlock; read-only transaction; lock not available (lock
        // timeout), object in use.
        (_, "40001" | "40P01" | "25006" | "55P03" | "55006") => Fault::Unavailable,
        ("22" | "23" | "54", _) => Fault::Refused,
        _ => Fault::Other,
    }
}

impl DbError {
    /// A failed TLS handshake said with the settings it was made under (the driver says only
    /// "error performing TLS handshake"); any other error unchanged.
    pub fn with_tls_settings(self, cfg: &PostgresConfig) -> DbError {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&self);
        let mut reason = None;
        while let Some(e) = source {
            // tokio-rustls hands rustls' error on inside an io::Error.
            let tls = e.downcast_ref::<rustls::Error>().or_else(|| {
                e.downcast_ref::<std::io::Error>()
                    .and_then(|io| io.get_ref())
                    .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            });
            if let Some(tls) = tls {
                reason = Some(tls.to_string());
                break;
            }
            source = e.source();
        }
        match (reason, TlsParams::split(&cfg.url)) {
            (Some(reason), Ok((_, params))) => DbError::Tls {
                asked: params.describe(),
                reason,
            },
            _ => self,
        }
    }

    pub fn fault(&self) -> Fault {
        match self {
            DbError::Build(_) | DbError::Tls { .. } => Fault::Other,
            DbError::Vanished(_) => Fault::Unavailable,
            DbError::Postgres(e) => fault_of(e.code().map(SqlState::code)),
            DbError::Pool(deadpool_postgres::PoolError::Backend(e)) => {
                fault_of(e.code().map(SqlState::code))
            }
            // Waiting for or creating a connection failed: the server may come back.
            DbError::Pool(_) => Fault::Unavailable,
        }
    }

    /// Whether Postgres refused the statement only because an earlier one in its transaction
    /// failed (as every statement pipelined behind a failed one is).
    pub fn follows_a_failure(&self) -> bool {
        matches!(self, DbError::Postgres(e) if e.code() == Some(&SqlState::IN_FAILED_SQL_TRANSACTION))
    }

    /// Whether retrying the same work may succeed once the database is back.
    pub fn is_transient(&self) -> bool {
        self.fault() == Fault::Unavailable
    }

    /// Whether the data of the message (or result) itself is refused: only then may it be
    /// dead-lettered instead of retried.
    pub fn refuses_data(&self) -> bool {
        self.fault() == Fault::Refused
    }
}

/// A warning for work waiting on the database, written at most once per interval per site,
/// with the number of retries it stands for: a 70 s outage with 256 calls waiting is a few
/// lines, not thousands.
pub struct WaitLog {
    last: std::sync::Mutex<Option<std::time::Instant>>,
    retries: std::sync::atomic::AtomicU64,
}

impl WaitLog {
    const EVERY: std::time::Duration = std::time::Duration::from_secs(10);

    pub const fn new() -> Self {
        WaitLog {
            last: std::sync::Mutex::new(None),
            retries: std::sync::atomic::AtomicU64::new(0),
        }
    }

    pub fn retrying(&self, stage: &str, error: &dyn std::fmt::Display) {
        use std::sync::atomic::Ordering;
        let n = self.retries.fetch_add(1, Ordering::Relaxed) + 1;
        let mut last = self.last.lock().expect("not poisoned");
        if last.is_none_or(|t| t.elapsed() >= Self::EVERY) {
            *last = Some(std::time::Instant::now());
            self.retries.store(0, Ordering::Relaxed);
            tracing::warn!(stage, error = %error, retries = n, "postgres refuses the work; retrying with backoff");
        }
    }
}

impl Default for WaitLog {
    fn default() -> Self {
        Self::new()
    }
}

/// The SQLSTATE of an error raised by a tool's own statement, for its `failed` outcome.
pub fn sqlstate(e: &tokio_postgres::Error) -> Option<String> {
    e.code().map(|c| c.code().to_string())
}

/// A connection's settings and the TLS connector its URL asks for.
pub fn pg_config(
    cfg: &PostgresConfig,
) -> Result<(tokio_postgres::Config, MakeRustlsConnect), DbError> {
    pg_config_with(cfg, "")
}

fn pg_config_with(
    cfg: &PostgresConfig,
    extra: &str,
) -> Result<(tokio_postgres::Config, MakeRustlsConnect), DbError> {
    let (url, tls) = TlsParams::split(&cfg.url).map_err(DbError::Build)?;
    let mut pg: tokio_postgres::Config = url
        .parse()
        .map_err(|e: tokio_postgres::Error| DbError::Build(e.to_string()))?;
    pg.ssl_mode(tls.driver_mode());
    // The schema is validated as a plain identifier by the config.
    pg.options(format!("-c search_path={}{extra}", cfg.schema));
    pg.application_name("idem");
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(CONNECT_TIMEOUT);
    }
    pg.keepalives(true);
    pg.keepalives_idle(KEEPALIVE_IDLE);
    let connector = tls
        .connector()
        .map_err(|e| DbError::Build(format!("tls: {e}")))?;
    Ok((pg, connector))
}

/// Session settings of the relay's data path. Each of its statements finds its rows through an
/// index, by key or id, and is prepared once per connection. A plan chosen while a table was
/// still small (a new schema, not yet analyzed) must not scan the whole table on every later
/// execution: sequential scans are priced out, the prepared (generic) plan is kept instead of
/// being planned anew on every execution, and nothing is JIT-compiled (the price of a scan
/// priced out would otherwise pass the JIT threshold). The relay's maintenance (pruning, the
/// admin API) uses [`maintenance_pool`] and people's commands [`pool`], with the server's
/// settings.
///
/// Every statement is bounded too: no data-path statement should take seconds, and one that
/// waits on a lock or a stalled disk fails (57014, 55P03: unavailable, retried with backoff)
/// instead of holding its connection and everything waiting behind it.
const DATA_PATH_SETTINGS: &str = concat!(
    " -c enable_seqscan=off -c plan_cache_mode=force_generic_plan -c jit=off",
    " -c statement_timeout=30000 -c lock_timeout=10000"
);

/// The data path's `statement_timeout` (ms), restored after a sql tool's own statement.
pub const DATA_PATH_STATEMENT_TIMEOUT_MS: u64 = 30_000;

/// How long a caller waits for a pooled connection, and for a new one to be made.
const POOL_WAIT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// TCP keepalives find a peer that vanished without a FIN (a cut network, a dead host).
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

/// The pool of the relay's data path: consume, claim, finish, publish, leases and recovery.
pub fn data_path_pool(cfg: &PostgresConfig) -> Result<Pool, DbError> {
    pool_of(pg_config_with(cfg, DATA_PATH_SETTINGS)?, cfg.pool_size)
}

/// Lease renewal and recovery: two connections of their own, with the data path's settings.
pub fn control_pool(cfg: &PostgresConfig) -> Result<Pool, DbError> {
    pool_of(pg_config_with(cfg, DATA_PATH_SETTINGS)?, 2)
}

/// A pool with the server's settings, for people's commands (the CLI), which a person can
/// interrupt.
pub fn pool(cfg: &PostgresConfig) -> Result<Pool, DbError> {
    pool_of(pg_config(cfg)?, cfg.pool_size)
}

/// Session settings of the relay's maintenance pool (pruning, the admin API and console): the
/// server's planner settings, every statement bounded as the data path's are. A statement that
/// waits on a lock (a key a finish or a long transaction holds) fails instead of holding its
/// connection; an admin request that timed out and was dropped returns its connection to the
/// pool with its statement still running, and the next request given that connection would
/// wait behind it.
const MAINTENANCE_SETTINGS: &str = " -c statement_timeout=30000 -c lock_timeout=10000";

/// Pruning and the admin API: the server's settings, statements bounded
/// ([`MAINTENANCE_SETTINGS`]).
pub fn maintenance_pool(cfg: &PostgresConfig) -> Result<Pool, DbError> {
    pool_of(pg_config_with(cfg, MAINTENANCE_SETTINGS)?, cfg.pool_size)
}

fn pool_of(
    (pg, tls): (tokio_postgres::Config, MakeRustlsConnect),
    size: usize,
) -> Result<Pool, DbError> {
    let manager = Manager::from_config(
        pg,
        tls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .wait_timeout(Some(POOL_WAIT))
        .create_timeout(Some(CONNECT_TIMEOUT))
        .recycle_timeout(Some(CONNECT_TIMEOUT))
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .map_err(|e| DbError::Build(e.to_string()))
}

/// A pooled connection in a transaction opened by hand: its `begin` goes out with the first
/// statements ([`begin_with`]) and its `commit` with the last ([`commit_with`]), two round trips
/// fewer than a transaction object's. Until [`OpenTransaction::ended`], the connection goes back
/// to the pool only once rolled back ([`OpenTransaction::roll_back`]); dropped half way (a
/// cancelled future, an early return), it is closed, never reused with the transaction open.
pub struct OpenTransaction(Option<deadpool_postgres::Object>);

impl OpenTransaction {
    pub fn new(connection: deadpool_postgres::Object) -> Self {
        OpenTransaction(Some(connection))
    }

    pub fn client(&self) -> &deadpool_postgres::Object {
        self.0.as_ref().expect("held until ended or rolled back")
    }

    /// The transaction ended (its `commit` was answered): the connection may be reused.
    pub fn ended(mut self) {
        self.0.take();
    }

    /// Ends the work done on the connection: on `Ok` the transaction ended ([`Self::ended`]),
    /// on `Err` it is rolled back ([`Self::roll_back`]).
    pub async fn close<T, E>(self, result: Result<T, E>) -> Result<T, E> {
        match result {
            Ok(_) => self.ended(),
            Err(_) => self.roll_back().await,
        }
        result
    }

    /// Rolls back whatever is still open, and returns the connection to the pool if that
    /// worked (it is closed otherwise).
    pub async fn roll_back(mut self) {
        if let Some(connection) = self.0.as_ref() {
            if connection.batch_execute("rollback").await.is_ok() {
                self.0.take();
            }
        }
    }
}

impl Drop for OpenTransaction {
    fn drop(&mut self) {
        if let Some(connection) = self.0.take() {
            drop(deadpool_postgres::Object::take(connection));
        }
    }
}

/// Sends `begin`, then `first`, in one round trip (`first`'s requests always follow the
/// `begin`; with its statements prepared beforehand they go out together).
pub async fn begin_with<T>(
    client: &impl deadpool_postgres::GenericClient,
    first: impl std::future::Future<Output = Result<T, DbError>>,
) -> Result<T, DbError> {
    begin_as_with(client, "begin", first).await
}

/// [`begin_with`] for a transaction whose commit returns before its WAL is flushed to disk
/// (`synchronous_commit = off` for it alone): only for writes that a crash of Postgres may undo
/// without harm, because whatever they record is done again, to the same effect, when they are
/// missing. Its commit still comes after every commit it saw.
pub async fn begin_unflushed_with<T>(
    client: &impl deadpool_postgres::GenericClient,
    first: impl std::future::Future<Output = Result<T, DbError>>,
) -> Result<T, DbError> {
    begin_as_with(client, "begin; set local synchronous_commit = off", first).await
}

async fn begin_as_with<T>(
    client: &impl deadpool_postgres::GenericClient,
    begin: &str,
    first: impl std::future::Future<Output = Result<T, DbError>>,
) -> Result<T, DbError> {
    let begin = async { client.batch_execute(begin).await.map_err(DbError::from) };
    let ((), t) = futures::try_join!(begin, first)?;
    Ok(t)
}

/// Sends `last`, then `commit`, in one round trip. A statement of `last` that fails aborts the
/// transaction, so the `commit` rolls it back and the statement's error is returned. `last`
/// must send its requests when first polled, its statements prepared beforehand
/// (`prepare_cached` on this connection): a statement still to be parsed would run after the
/// `commit`, outside the transaction.
pub async fn commit_with<T>(
    client: &impl deadpool_postgres::GenericClient,
    last: impl std::future::Future<Output = Result<T, DbError>>,
) -> Result<T, DbError> {
    let commit = async { client.batch_execute("commit").await.map_err(DbError::from) };
    let (t, ()) = futures::try_join!(last, commit)?;
    Ok(t)
}

/// JSON already serialized, as a `jsonb` (or `json`) parameter: sent in Postgres' binary format
/// for `jsonb` (a version byte, then the text) as `serde_json::Value` is, without building one.
/// Postgres parses it as it would the same JSON from a `Value`. Sent as `text` and cast to
/// `jsonb` in the statement instead, the outbox insert took 25–26 µs per action against 17–19
/// (`pg_stat_statements`, flat out; `benches/HISTORY.md`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct JsonbText<'a>(pub &'a str);

impl tokio_postgres::types::ToSql for JsonbText<'_> {
    fn to_sql(
        &self,
        ty: &tokio_postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        if *ty == tokio_postgres::types::Type::JSONB {
            // The binary format's version.
            out.extend_from_slice(&[1]);
        }
        out.extend_from_slice(self.0.as_bytes());
        Ok(tokio_postgres::types::IsNull::No)
    }

    fn accepts(ty: &tokio_postgres::types::Type) -> bool {
        matches!(
            *ty,
            tokio_postgres::types::Type::JSON | tokio_postgres::types::Type::JSONB
        )
    }

    tokio_postgres::types::to_sql_checked!();
}

/// Applies the migrations not yet recorded. Safe to run twice and from two relays at once:
/// everything happens in one transaction under an advisory lock named for the schema.
pub async fn migrate(cfg: &PostgresConfig) -> Result<Vec<i32>, DbError> {
    migrate_once(cfg)
        .await
        .map_err(|e| e.with_tls_settings(cfg))
}

async fn migrate_once(cfg: &PostgresConfig) -> Result<Vec<i32>, DbError> {
    let pool = pool(cfg)?;
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    tx.execute(
        "select pg_advisory_xact_lock(hashtext('idem.migrate.' || $1::text))",
        &[&cfg.schema],
    )
    .await?;
    tx.batch_execute(&format!(
        "create schema if not exists {schema};
         create table if not exists {schema}.idem_schema_versions (
             version    integer primary key,
             name       text not null,
             applied_at timestamptz not null default now()
         );",
        schema = cfg.schema
    ))
    .await?;
    let applied: Vec<i32> = tx
        .query("select version from idem_schema_versions", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    // Locks a pending migration needs, taken before any pending migration runs: taken later,
    // after an earlier one's weaker lock on the same table, the upgrade would wait for a relay's
    // batch that read the table and waits to write it behind that weaker lock (a deadlock).
    // A new schema has no tables yet, and no relay.
    if !applied.is_empty() {
        for (version, lock) in FIRST_LOCKS {
            if !applied.contains(version) {
                tx.batch_execute(lock).await?;
            }
        }
    }
    let mut newly = Vec::new();
    for (version, name, sql) in MIGRATIONS {
        if applied.contains(version) {
            continue;
        }
        tx.batch_execute(sql).await?;
        tx.execute(
            "insert into idem_schema_versions (version, name) values ($1, $2)",
            &[version, name],
        )
        .await?;
        newly.push(*version);
    }
    tx.commit().await?;
    Ok(newly)
}

/// The newest migration this binary knows.
pub fn latest_version() -> i32 {
    MIGRATIONS.last().map_or(0, |m| m.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    // A relay's batch reads the deliveries (its seen events), then writes them. From migration
    // 14, migrations 15 and 16 run in one transaction: 15 builds an index (its lock lets reads
    // through but not writes), and 16 needs the table to itself. A batch that had read the
    // deliveries and waited to write them behind 15's build, while 16 waited for the batch's
    // read to end, would deadlock with it (one of the two aborted). `idem migrate` beside such
    // a batch must apply both, and the batch must write.
    #[tokio::test]
    async fn migrating_from_14_beside_a_batch_that_read_the_deliveries_does_not_deadlock() {
        let db = plans::Fresh::new().await;
        db.pg
            .batch_execute(
                "drop index deliveries_dead_letters;
                 drop index deliveries_event;
                 create index deliveries_event on deliveries (action_event_id);
                 delete from idem_schema_versions where version in (15, 16);",
            )
            .await
            .expect("back to migration 14");
        let batch = data_path_pool(&db.cfg)
            .expect("pool")
            .get()
            .await
            .expect("connection");
        batch
            .batch_execute("begin; select count(*) from deliveries")
            .await
            .expect("the batch's read");
        let migration = tokio::spawn({
            let cfg = db.cfg.clone();
            async move { migrate(&cfg).await }
        });
        let waiting = "select count(*) from pg_locks l
                         join pg_class c on c.oid = l.relation
                         join pg_namespace n on n.oid = c.relnamespace
                        where n.nspname = $1 and c.relname = 'deliveries' and not l.granted";
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let row = db
                .pg
                .query_one(waiting, &[&db.schema])
                .await
                .expect("locks");
            if row.get::<_, i64>(0) > 0 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the migration never waited for the batch's read to end"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        let wrote = batch
            .batch_execute(
                "insert into deliveries (intent_id, idempotency_key, action_event_id,
                                         source_topic, source_partition, source_offset, origin,
                                         answered)
                 values (null, 'k1', 'e1', 'actions', 0, 1, 'replay', true);
                 commit",
            )
            .await;
        let applied = migration.await.expect("the migration's task");
        assert!(wrote.is_ok(), "the batch's write: {wrote:?}");
        assert_eq!(applied.expect("migrate"), vec![15, 16]);
        let method = db
            .rows(
                "select a.amname from pg_class c join pg_am a on a.oid = c.relam
                  where c.relname = 'deliveries_event' and c.relnamespace = current_schema()::regnamespace",
            )
            .await;
        assert_eq!(method[0][0].1, "hash");
        db.drop().await;
    }

    // The relay's maintenance connections plan as the server does (not as the data path) and
    // bound every statement, its lock waits too.
    #[tokio::test]
    async fn the_maintenance_pool_plans_as_the_server_and_bounds_its_statements() {
        let db = plans::Fresh::new().await;
        let client = maintenance_pool(&db.cfg)
            .expect("pool")
            .get()
            .await
            .expect("connection");
        let row = client
            .query_one(
                "select current_setting('statement_timeout'), current_setting('lock_timeout'),
                        current_setting('enable_seqscan'), current_setting('plan_cache_mode')",
                &[],
            )
            .await
            .expect("settings");
        let settings: [String; 4] = std::array::from_fn(|i| row.get(i));
        assert_eq!(settings, ["30s", "10s", "on", "auto"]);
        db.drop().await;
    }

    #[test]
    fn sqlstates_are_sorted_into_unavailable_refused_and_other() {
        for code in [
            None,
            Some("08006"), // connection failure
            Some("08001"),
            Some("25006"), // read-only transaction
            Some("40001"), // serialization failure
            Some("40P01"), // deadlock
            Some("53100"), // disk full
            Some("53300"), // too many connections
            Some("57014"), // query cancelled (statement_timeout)
            Some("57P01"), // admin shutdown
            Some("57P03"), // cannot connect now
            Some("58030"), // I/O error
            Some("55P03"), // lock not available (lock_timeout)
        ] {
            assert_eq!(fault_of(code), Fault::Unavailable, "{code:?}");
        }
        for code in ["22001", "22P02", "23505", "23514", "54000"] {
            assert_eq!(fault_of(Some(code)), Fault::Refused, "{code}");
        }
        for code in ["42P01", "42601", "XX000", "0A000"] {
            assert_eq!(fault_of(Some(code)), Fault::Other, "{code}");
        }
    }
}
