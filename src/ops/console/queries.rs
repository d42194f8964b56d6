//! What the console reads from Postgres, beside `explain`. The waiting list is served by
//! `intents_parked`, a key by `intents_key`, the last hour by the BRIN indexes on `created_at`
//! and `received_at`, and leases by `intents_open`. A search by run id or business id has no
//! index of its own (each would cost every action a fifth more Postgres CPU): it walks the keys
//! newest first, for at most [`SEARCH_BUDGET`].

use deadpool_postgres::Pool;

use crate::db::DbError;

/// One key in a list.
#[derive(Debug, Clone)]
pub struct KeyRow {
    pub key: String,
    pub tool: String,
    pub run_id: String,
    pub business_id: Option<String>,
    pub status: String,
    pub recorded_at: String,
    pub age_secs: f64,
}

const KEY_COLUMNS: &str = "idempotency_key, tool, run_id, business_id, status,
    to_char(created_at at time zone 'UTC', 'YYYY-MM-DD HH24:MI:SS') as recorded_at,
    extract(epoch from now() - created_at)::float8 as age_secs";

fn key_row(row: &tokio_postgres::Row) -> KeyRow {
    KeyRow {
        key: row.get("idempotency_key"),
        tool: row.get("tool"),
        run_id: row.get("run_id"),
        business_id: row.get("business_id"),
        status: row.get("status"),
        recorded_at: row.get("recorded_at"),
        age_secs: row.get("age_secs"),
    }
}

/// Most keys a list shows.
pub const LIST_LIMIT: i64 = 500;

/// Keys waiting for a person (`pending_approval`, `unknown`), oldest first; `tool` and `run`
/// filter when not empty.
pub async fn waiting(pool: &Pool, tool: &str, run: &str) -> Result<Vec<KeyRow>, DbError> {
    let sql = format!(
        "select {KEY_COLUMNS} from intents
          where status in ('pending_approval', 'unknown') and class <> 'read_only'
            and ($1 = '' or tool = $1) and ($2 = '' or run_id = $2)
          order by created_at, id limit $3"
    );
    let client = pool.get().await?;
    let rows = client.query(&sql, &[&tool, &run, &LIST_LIMIT]).await?;
    Ok(rows.iter().map(key_row).collect())
}

/// How long a search by run id or business id may scan.
pub const SEARCH_BUDGET: &str = "5s";

/// What a search found.
#[derive(Debug, Clone)]
pub struct Found {
    pub rows: Vec<KeyRow>,
    /// The scan by run id or business id ran out of time: the statement was cancelled, so
    /// `rows` holds the exact key's match alone.
    pub cut_short: bool,
}

/// Keys whose key, run id or business id is `q`, newest first.
pub async fn search(pool: &Pool, q: &str) -> Result<Found, DbError> {
    let mut client = pool.get().await?;
    let by_key = format!(
        "select {KEY_COLUMNS} from intents
          where class <> 'read_only' and idempotency_key = $1"
    );
    let mut rows: Vec<KeyRow> = client
        .query(&by_key, &[&q])
        .await?
        .iter()
        .map(key_row)
        .collect();
    let by_run = format!(
        "select {KEY_COLUMNS} from intents
          where class <> 'read_only' and (run_id = $1 or business_id = $1)
          order by id desc limit $2"
    );
    let tx = client.transaction().await?;
    tx.batch_execute(&format!("set local statement_timeout = '{SEARCH_BUDGET}'"))
        .await?;
    let cut_short = match tx.query(&by_run, &[&q, &LIST_LIMIT]).await {
        Ok(found) => {
            rows.extend(found.iter().map(key_row).filter(|r| r.key != q));
            tx.commit().await?;
            false
        }
        // 57014: canceled by the statement timeout.
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED) => true,
        Err(e) => return Err(e.into()),
    };
    Ok(Found { rows, cut_short })
}

/// The last hour, and now.
#[derive(Debug, Clone, Default)]
pub struct Overview {
    /// (tool, status, keys recorded in the last hour).
    pub by_tool_status: Vec<(String, String, i64)>,
    /// (origin, deliveries in the last hour): `first` and each kind of repeat.
    pub by_origin: Vec<(String, i64)>,
    /// Outcome events not yet published, and the age of the oldest.
    pub outbox_pending: i64,
    pub outbox_oldest_secs: f64,
    /// (relay, keys it is running, latest lease expiry).
    pub leases: Vec<(String, i64, String)>,
}

pub async fn overview(pool: &Pool) -> Result<Overview, DbError> {
    let client = pool.get().await?;
    let by_tool_status = client
        .query(
            "select tool, status, count(*) from intents
              where created_at > now() - interval '1 hour' and class <> 'read_only'
              group by 1, 2 order by 1, 2",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let by_origin = client
        .query(
            // A recorded key's first delivery is its intent row (schema migration 13); rows of
            // origin `first` with an intent, written by earlier relays or for read-only tools,
            // are counted there.
            "select origin, count(*) from (
                select origin from deliveries
                 where received_at > now() - interval '1 hour'
                   and not (origin = 'first' and intent_id is not null)
                union all
                select 'first' from intents where created_at > now() - interval '1 hour') d
              group by 1 order by 2 desc",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let outbox = client
        .query_one(crate::publish::outbox::OUTBOX_LAG, &[])
        .await?;
    let leases = client
        .query(
            "select lease_owner, count(*),
                    to_char(max(lease_expires_at) at time zone 'UTC', 'YYYY-MM-DD HH24:MI:SS')
               from intents where status = 'running' and lease_owner is not null
              group by 1 order by 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    Ok(Overview {
        by_tool_status,
        by_origin,
        outbox_pending: outbox.get(0),
        outbox_oldest_secs: outbox.get(1),
        leases,
    })
}
