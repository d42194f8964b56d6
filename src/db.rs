//! Postgres: the connection pool, migrations, and the one place SQLSTATEs are classified.

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::error::SqlState;
use tokio_postgres::NoTls;

use crate::config::PostgresConfig;

/// Migrations, applied in order; the number is the version recorded.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "0001_core",
        include_str!("../schemas/postgres/0001_core.sql"),
    ),
    (
        2,
        "0002_attempts",
        include_str!("../schemas/postgres/0002_attempts.sql"),
    ),
    (
        3,
        "0003_gates",
        include_str!("../schemas/postgres/0003_gates.sql"),
    ),
    (
        4,
        "0004_attempt_hot_updates",
        include_str!("../schemas/postgres/0004_attempt_hot_updates.sql"),
    ),
];

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("postgres pool: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("postgres pool setup: {0}")]
    Build(String),
}

impl DbError {
    /// Whether retrying the same transaction may succeed: lost connections, serialization
    /// failures and deadlocks are transient; a constraint or syntax error is not.
    pub fn is_transient(&self) -> bool {
        match self {
            DbError::Pool(_) => true,
            DbError::Build(_) => false,
            DbError::Postgres(e) => match e.code() {
                None => true, // connection closed, I/O: the server may come back
                Some(code) => {
                    *code == SqlState::T_R_SERIALIZATION_FAILURE
                        || *code == SqlState::T_R_DEADLOCK_DETECTED
                        || *code == SqlState::ADMIN_SHUTDOWN
                        || *code == SqlState::CRASH_SHUTDOWN
                        || *code == SqlState::CANNOT_CONNECT_NOW
                        || *code == SqlState::TOO_MANY_CONNECTIONS
                        || code.code().starts_with("08")
                }
            },
        }
    }
}

/// The SQLSTATE of an error raised by a tool's own statement, for its `failed` outcome.
pub fn sqlstate(e: &tokio_postgres::Error) -> Option<String> {
    e.code().map(|c| c.code().to_string())
}

pub fn pg_config(cfg: &PostgresConfig) -> Result<tokio_postgres::Config, DbError> {
    pg_config_with(cfg, "")
}

fn pg_config_with(cfg: &PostgresConfig, extra: &str) -> Result<tokio_postgres::Config, DbError> {
    let mut pg: tokio_postgres::Config = cfg
        .url
        .parse()
        .map_err(|e: tokio_postgres::Error| DbError::Build(e.to_string()))?;
    // The schema is validated as a plain identifier by the config.
    pg.options(format!("-c search_path={}{extra}", cfg.schema));
    pg.application_name("idem");
    Ok(pg)
}

/// Session settings of the relay's data path. Each of its statements finds its rows through an
/// index, by key or id, and is prepared once per connection. A plan chosen while a table was
/// still small (a new schema, not yet analyzed) must not scan the whole table on every later
/// execution: sequential scans are priced out, the prepared (generic) plan is kept instead of
/// being planned anew on every execution, and nothing is JIT-compiled (the price of a scan
/// priced out would otherwise pass the JIT threshold). Maintenance and people's commands
/// (prune, explain, approvals) use [`pool`], with the server's settings.
const DATA_PATH_SETTINGS: &str =
    " -c enable_seqscan=off -c plan_cache_mode=force_generic_plan -c jit=off";

/// The pool of the relay's data path: consume, claim, finish, publish, leases and recovery.
pub fn data_path_pool(cfg: &PostgresConfig) -> Result<Pool, DbError> {
    pool_of(pg_config_with(cfg, DATA_PATH_SETTINGS)?, cfg.pool_size)
}

pub fn pool(cfg: &PostgresConfig) -> Result<Pool, DbError> {
    pool_of(pg_config(cfg)?, cfg.pool_size)
}

fn pool_of(pg: tokio_postgres::Config, size: usize) -> Result<Pool, DbError> {
    let manager = Manager::from_config(
        pg,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .map_err(|e| DbError::Build(e.to_string()))
}

/// Applies the migrations not yet recorded. Safe to run twice and from two relays at once:
/// everything happens in one transaction under an advisory lock named for the schema.
pub async fn migrate(cfg: &PostgresConfig) -> Result<Vec<i32>, DbError> {
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
