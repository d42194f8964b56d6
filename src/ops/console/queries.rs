//! What the console reads from Postgres, beside `explain`. The waiting list is served by
//! `intents_parked`, a key by `intents_key`, the last hour by the BRIN indexes on `created_at`
//! and `received_at`, and leases by `intents_open`. A search by run id or business id has no
//! index of its own (each would cost every action a fifth more Postgres CPU): it walks the keys
//! newest first, for at most [`SEARCH_BUDGET`], and shows what it found by then.

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
pub const SEARCH_BUDGET: std::time::Duration = std::time::Duration::from_secs(5);

/// What a search found.
#[derive(Debug, Clone)]
pub struct Found {
    pub rows: Vec<KeyRow>,
    /// The scan by run id or business id ran out of time: keys older than those found were not
    /// looked at.
    pub cut_short: bool,
}

/// Keys whose key, run id or business id is `q`, newest first.
pub async fn search(pool: &Pool, q: &str) -> Result<Found, DbError> {
    search_within(pool, q, SEARCH_BUDGET).await
}

/// [`search`], whose scan by run id or business id keeps what it found within `budget`.
///
/// That scan walks the keys newest first through a cursor, fetching one match at a time (a
/// fetch of several returns only once it has them all), each fetch cancelled when the budget
/// runs out: the matches fetched before are kept. (One statement for the whole scan showed
/// nothing when cancelled, and from about ten million keys it always was, unless it found 500
/// matches first.) The cursor's plan starts from the newest key; `q` reaches it as a setting of
/// the transaction, not spliced into the SQL.
pub(crate) async fn search_within(
    pool: &Pool,
    q: &str,
    budget: std::time::Duration,
) -> Result<Found, DbError> {
    let mut client = pool.get().await?;
    let deadline = std::time::Instant::now() + budget;
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
    let tx = client.transaction().await?;
    tx.execute(
        "select set_config('idem.search', $1, true), set_config('jit', 'off', true)",
        &[&q],
    )
    .await?;
    tx.batch_execute(&format!(
        "declare by_run no scroll cursor for
         select {KEY_COLUMNS} from intents
          where class <> 'read_only'
            and (run_id = current_setting('idem.search')
                 or business_id = current_setting('idem.search'))
          order by id desc"
    ))
    .await?;
    // Each fetch goes out behind the setting of its timeout, in one round trip.
    let limit = tx
        .prepare("select set_config('statement_timeout', $1, true)")
        .await?;
    let fetch = tx.prepare("fetch 1 from by_run").await?;
    let cancelled = |e: &tokio_postgres::Error| {
        e.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED)
    };
    let mut found = 0;
    let cut_short = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            break true;
        }
        let ms = left.as_millis().max(1).to_string();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&ms];
        let (set, next) = futures::join!(tx.query(&limit, &params), tx.query(&fetch, &[]));
        match (set, next) {
            (Ok(_), Ok(next)) => {
                found += next.len() as i64;
                rows.extend(next.iter().map(key_row).filter(|r| r.key != q));
                if next.is_empty() || found >= LIST_LIMIT {
                    break false;
                }
            }
            // 57014: cancelled by the statement timeout (the setting of the next one, run under
            // the one before, may be too); the fetch behind a cancelled setting fails with it.
            (Err(e), _) | (Ok(_), Err(e)) if cancelled(&e) => break true,
            (Err(e), _) | (Ok(_), Err(e)) => return Err(e.into()),
        }
    };
    // Read only: nothing to keep.
    tx.rollback().await?;
    Ok(Found { rows, cut_short })
}

/// How long the overview's count of a span may take before it counts a shorter one instead.
pub const OVERVIEW_BUDGET: std::time::Duration = std::time::Duration::from_secs(2);

/// The spans the overview counts, longest first, in seconds: the next is counted when the one
/// before took longer than [`OVERVIEW_BUDGET`] (the count reads every key of its span, so its
/// cost follows the rate: 0.7-1 s an hour at 1,000 actions/s on the benchmark machine). The last
/// is counted whatever it takes.
pub const OVERVIEW_SPANS: [i64; 3] = [3600, 300, 60];

/// How long the overview keeps to the shorter span it fell back to before it tries the hour
/// again: at a rate whose hour takes longer than the budget to count, a view pays that budget
/// once every so often rather than every time.
pub const OVERVIEW_REMEMBER: std::time::Duration = std::time::Duration::from_secs(300);

/// The shorter span the overview last fell back to (an index into [`OVERVIEW_SPANS`]), and
/// when: the next views start there, until [`OVERVIEW_REMEMBER`] has passed.
#[derive(Debug, Default)]
pub struct SpanMemory(std::sync::Mutex<Option<(usize, std::time::Instant)>>);

impl SpanMemory {
    /// The first span worth trying at `now`.
    fn first(&self, now: std::time::Instant) -> usize {
        match *self.0.lock().expect("not poisoned") {
            Some((i, at)) if now.saturating_duration_since(at) < OVERVIEW_REMEMBER => i,
            _ => 0,
        }
    }

    /// Span `counted` was counted at `now`, the view having started at span `first`. The time
    /// kept is when the hour was last too slow, so the hour is tried again once
    /// [`OVERVIEW_REMEMBER`] has passed since, however the views after it went.
    fn counted(&self, first: usize, counted: usize, now: std::time::Instant) {
        let mut memory = self.0.lock().expect("not poisoned");
        *memory = match *memory {
            _ if counted == 0 => None,
            // The view started at a span remembered, not at the hour; a view beside it may
            // have moved the memory on meanwhile (to a shorter span, or, counting the hour,
            // cleared it), which stands.
            Some((i, too_slow)) if first > 0 => Some((i.max(counted), too_slow)),
            None if first > 0 => None,
            // The hour was too slow just now.
            _ => Some((counted, now)),
        };
    }
}

/// The last hour (or the span counted instead), and now.
#[derive(Debug, Clone)]
pub struct Overview {
    pub counts: Counts,
    /// Outcome events not yet published, and the age of the oldest.
    pub outbox_pending: i64,
    pub outbox_oldest_secs: f64,
    /// (relay, keys it is running, latest lease expiry).
    pub leases: Vec<(String, i64, String)>,
}

/// The outbox lag (unpublished outcomes, the oldest one's age in seconds), read as the
/// publisher reads it: through the queue's index. The queue's table is never truncated, and
/// with the server's settings the count read every page the largest backlog had left (5–14 ms
/// at each page view after one of 200,000, measured by a review).
async fn outbox_lag(tx: &deadpool_postgres::Transaction<'_>) -> Result<(i64, f64), DbError> {
    tx.batch_execute("set local enable_seqscan = off").await?;
    let row = tx
        .query_one(crate::publish::outbox::OUTBOX_LAG, &[])
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// Keys by tool and status, and deliveries by origin, of one span.
#[derive(Debug, Clone)]
pub struct Counts {
    /// The span counted, in seconds: an hour, or less when counting the hour took too long.
    pub span_secs: i64,
    /// (tool, status, keys recorded in the span).
    pub by_tool_status: Vec<(String, String, i64)>,
    /// (origin, deliveries in the span): `first` and each kind of repeat.
    pub by_origin: Vec<(String, i64)>,
}

/// The counts of the longest of [`OVERVIEW_SPANS`], from the `first`, each of whose
/// statements ends within `budget`, in the caller's transaction (a span given up is rolled
/// back to a savepoint, so the transaction and its snapshot go on); with the index of the span
/// counted.
async fn last_hour_within(
    tx: &deadpool_postgres::Transaction<'_>,
    budget: std::time::Duration,
    first: usize,
) -> Result<(usize, Counts), DbError> {
    let last = OVERVIEW_SPANS.len() - 1;
    for (i, &span) in OVERVIEW_SPANS.iter().enumerate().take(last).skip(first) {
        tx.batch_execute("savepoint span").await?;
        let deadline = std::time::Instant::now() + budget;
        let counted = counts(tx, span, Some((deadline, budget))).await;
        // The counts only read: rolling back to the savepoint undoes their timeouts alone (or,
        // when one cancelled a count, the failure too).
        tx.batch_execute("rollback to savepoint span; release savepoint span")
            .await?;
        match counted {
            Ok(counts) => return Ok((i, counts)),
            Err(DbError::Postgres(e))
                if e.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED) => {}
            Err(e) => return Err(e),
        }
    }
    Ok((last, counts(tx, OVERVIEW_SPANS[last], None).await?))
}

/// The `statement_timeout` that leaves a statement what is left of `budget` until `deadline`,
/// but never less than `budget` or 100 ms, whichever is shorter: the timeout outlives the
/// statement it cuts short (until the rollback to the savepoint), so that rollback too must fit
/// in it. (Zero would be no timeout at all.)
fn timeout_until(deadline: std::time::Instant, budget: std::time::Duration) -> String {
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    let floor = budget.min(std::time::Duration::from_millis(100));
    left.max(floor).as_millis().max(1).to_string()
}

/// (keys recorded in the last `span` seconds by tool and status, deliveries in them by
/// origin), reading the span's keys once (3.6 million an hour at 1,000 actions/s): each key is
/// counted by its status and, as its intent row is its first delivery (schema migration 13),
/// as a `first`.
async fn counts(
    client: &impl deadpool_postgres::GenericClient,
    span: i64,
    within: Option<(std::time::Instant, std::time::Duration)>,
) -> Result<Counts, DbError> {
    let secs = span as f64;
    // Each statement gets what is left of the span's budget (a setting of the transaction,
    // undone with the caller's savepoint).
    let limit = || async {
        if let Some((deadline, budget)) = within {
            let ms = timeout_until(deadline, budget);
            client
                .execute("select set_config('statement_timeout', $1, true)", &[&ms])
                .await?;
        }
        Ok::<_, DbError>(())
    };
    limit().await?;
    let keys = client
        .query(
            "select tool, status, class = 'read_only', count(*) from intents
              where created_at > now() - make_interval(secs => $1)
              group by 1, 2, 3 order by 1, 2",
            &[&secs],
        )
        .await?;
    let by_tool_status = keys
        .iter()
        .filter(|r| !r.get::<_, bool>(2))
        .map(|r| (r.get(0), r.get(1), r.get(3)))
        .collect();
    let firsts: i64 = keys.iter().map(|r| r.get::<_, i64>(3)).sum();
    // Rows of origin `first` with an intent, written by earlier relays or for read-only tools,
    // are counted with the keys.
    limit().await?;
    let mut by_origin: Vec<(String, i64)> = client
        .query(
            "select origin, count(*) from deliveries
              where received_at > now() - make_interval(secs => $1)
                and not (origin = 'first' and intent_id is not null)
              group by 1",
            &[&secs],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    match by_origin.iter_mut().find(|(origin, _)| origin == "first") {
        Some((_, n)) => *n += firsts,
        None if firsts > 0 => by_origin.push(("first".into(), firsts)),
        None => {}
    }
    by_origin.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(Counts {
        span_secs: span,
        by_tool_status,
        by_origin,
    })
}

/// The overview's page, its span chosen with `memory` (see [`SpanMemory`]).
pub async fn overview(pool: &Pool, memory: &SpanMemory) -> Result<Overview, DbError> {
    let mut client = pool.get().await?;
    // One snapshot for the whole page; the outbox lag last, as it changes a setting.
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    let first = memory.first(std::time::Instant::now());
    let (counted, counts) = last_hour_within(&tx, OVERVIEW_BUDGET, first).await?;
    memory.counted(first, counted, std::time::Instant::now());
    let leases = tx
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
    let (outbox_pending, outbox_oldest_secs) = outbox_lag(&tx).await?;
    tx.commit().await?;
    Ok(Overview {
        counts,
        outbox_pending,
        outbox_oldest_secs,
        leases,
    })
}

#[cfg(test)]
mod tests {
    use super::search_within;
    use crate::db::plans::Fresh;
    use std::time::Duration;

    // A run's newest keys are what a person looks for; at two million keys the scan by run id
    // runs out long before it reaches the oldest (these narrow rows take about 0.27 µs a key to
    // walk here: 540 ms, against a budget of 150), and what it found by then is shown.
    #[tokio::test]
    async fn a_search_that_runs_out_shows_the_newest_matches_it_found() {
        let db = Fresh::new().await;
        // Two million keys of run `r`, the twenty newest of run `run-a`.
        db.intents(2_000_000, "'succeeded'", "false").await;
        db.pg
            .batch_execute(
                "update intents set run_id = 'run-a' where id > 1999980;
                 analyze intents;",
            )
            .await
            .expect("fill");
        let pool = crate::db::pool(&db.cfg).expect("pool");

        let found = search_within(&pool, "run-a", Duration::from_millis(150))
            .await
            .expect("search");
        let keys: Vec<&str> = found.rows.iter().map(|r| r.key.as_str()).collect();
        let newest: Vec<String> = (1_999_981..=2_000_000)
            .rev()
            .map(|g| format!("k{g}"))
            .collect();
        assert_eq!(keys, newest);
        assert!(found.cut_short, "the scan past the twenty ran out of time");

        // With time enough the scan ends, and says it did.
        let found = search_within(&pool, "run-a", Duration::from_secs(60))
            .await
            .expect("search");
        assert_eq!(found.rows.len(), 20);
        assert!(!found.cut_short);
        db.drop().await;
    }

    // The queue's table is never truncated, so after a backlog it keeps every page it grew to;
    // each page view of the overview must count the queue through its index, not read them all.
    #[tokio::test]
    async fn the_overview_counts_the_outbox_queue_by_its_index() {
        let mut db = Fresh::new().await;
        // A backlog of 200,000 outcomes published but for 300; the general pool's settings.
        for step in [
            "insert into outbox_pending (id) select g from generate_series(1, 200000) g",
            "delete from outbox_pending where id > 300",
            "vacuum (truncate false, analyze) outbox_pending",
            "set enable_seqscan = on; set plan_cache_mode = auto",
        ] {
            db.pg.batch_execute(step).await.expect(step);
        }

        let tx = db.pg.transaction().await.expect("begin");
        let (pending, _) = super::outbox_lag(&tx).await.expect("lag");
        let scans = tx
            .query_one(
                "select seq_scan from pg_stat_xact_user_tables
                  where relname = 'outbox_pending' and schemaname = current_schema()",
                &[],
            )
            .await
            .expect("stats");
        assert_eq!(pending, 300);
        assert_eq!(
            scans.get::<_, i64>(0),
            0,
            "the queue's pages were read through"
        );
        tx.rollback().await.expect("rollback");
        db.drop().await;
    }

    /// The transaction's `statement_timeout`, read in it (so it is usable).
    async fn statement_timeout(tx: &deadpool_postgres::Transaction<'_>) -> String {
        tx.query_one("show statement_timeout", &[])
            .await
            .expect("the transaction is usable")
            .get(0)
    }

    // At 1,000 actions/s the last hour holds 3.6 million keys (1.4 s to count them twice, with
    // the benchmark's keys): the overview reads them once for both of its tables.
    #[tokio::test]
    async fn the_overview_reads_the_last_hours_keys_once() {
        let mut db = Fresh::new().await;
        // 1,000 keys this hour, a tenth of them of a read-only tool; one repeat. The general
        // pool's settings.
        db.intents(1000, "'succeeded'", "false").await;
        db.pg
            .batch_execute(
                "update intents set class = 'read_only', tool = 'lookup' where id % 10 = 0;
                 insert into deliveries (intent_id, idempotency_key, action_event_id,
                                         source_topic, source_partition, source_offset, origin)
                 values (1, 'k1', 'again', 'actions', 0, 1001, 'model_retry');
                 analyze intents;
                 set enable_seqscan = on; set plan_cache_mode = auto;",
            )
            .await
            .expect("fill");

        let tx = db.pg.transaction().await.expect("begin");
        // Counted from before the read: a backend's counts of earlier transactions may not be
        // flushed yet, and show here too.
        let scans = || async {
            tx.query_one(
                "select seq_scan + coalesce(idx_scan, 0) from pg_stat_xact_user_tables
                  where relname = 'intents' and schemaname = current_schema()",
                &[],
            )
            .await
            .expect("stats")
            .get::<_, i64>(0)
        };
        let usual = statement_timeout(&tx).await;
        let before = scans().await;
        let (_, counts) = super::last_hour_within(&tx, super::OVERVIEW_BUDGET, 0)
            .await
            .expect("counts");
        let read = scans().await - before;
        assert_eq!(read, 1, "the hour's keys were read again");
        assert_eq!(counts.span_secs, 3600, "the whole hour");
        assert_eq!(
            statement_timeout(&tx).await,
            usual,
            "the count's timeout outlived it"
        );
        let one = |tool: &str, status: &str, n| (tool.to_string(), status.to_string(), n);
        assert_eq!(
            counts.by_tool_status,
            vec![one("send_email", "succeeded", 900)]
        );
        let origins = [("first".to_string(), 1000), ("model_retry".to_string(), 1)];
        assert_eq!(counts.by_origin, origins);
        tx.rollback().await.expect("rollback");
        db.drop().await;
    }

    // The hour's count reads every key of the hour, so its cost follows the rate (ten seconds
    // at 10,000 actions/s). Past the budget the page counts a shorter span, and says so.
    #[tokio::test]
    async fn an_hour_too_long_to_count_within_the_budget_shows_a_shorter_span() {
        let mut db = Fresh::new().await;
        // 300,000 keys between five minutes and an hour old (counting them takes 40 ms and more
        // here), and ten of the last minute.
        db.intents(300_000, "'succeeded'", "false").await;
        db.pg
            .batch_execute(
                "update intents set created_at = now() - case when id <= 10
                     then interval '30 seconds'
                     else make_interval(secs => 301 + id % 3000) end;
                 analyze intents;
                 set enable_seqscan = on; set plan_cache_mode = auto;",
            )
            .await
            .expect("fill");

        let tx = db.pg.transaction().await.expect("begin");
        let usual = statement_timeout(&tx).await;
        let budget = std::time::Duration::from_millis(10);
        let (_, counts) = super::last_hour_within(&tx, budget, 0)
            .await
            .expect("a shorter span, not an error");
        assert!(
            counts.span_secs < 3600,
            "the hour was counted within {budget:?}"
        );
        let keys = vec![("send_email".to_string(), "succeeded".to_string(), 10)];
        assert_eq!(counts.by_tool_status, keys, "the span's keys");
        assert_eq!(counts.by_origin, vec![("first".to_string(), 10)]);
        // The transaction goes on, with its usual timeout, for the rest of the page.
        assert_eq!(statement_timeout(&tx).await, usual);
        // A view that starts at the span remembered (five minutes) does not count the hour,
        // which the whole budget would have allowed.
        let (i, counts) = super::last_hour_within(&tx, super::OVERVIEW_BUDGET, 1)
            .await
            .expect("counts");
        assert_eq!((i, counts.span_secs), (1, 300));
        assert_eq!(counts.by_tool_status, keys, "the five minutes' keys alone");
        tx.rollback().await.expect("rollback");
        db.drop().await;
    }

    #[test]
    fn a_shorter_span_is_remembered_until_the_hour_is_due_again() {
        use super::{SpanMemory, OVERVIEW_REMEMBER};
        let minute = Duration::from_secs(60);
        let t0 = std::time::Instant::now();
        let memory = SpanMemory::default();
        assert_eq!(memory.first(t0), 0, "nothing remembered: the hour first");
        // The hour was too slow; five minutes fit.
        memory.counted(0, 1, t0);
        assert_eq!(memory.first(t0 + minute), 1);
        // Views that start there and fit do not put off the hour's next try.
        memory.counted(1, 1, t0 + minute);
        assert_eq!(memory.first(t0 + OVERVIEW_REMEMBER - minute), 1);
        let due = t0 + OVERVIEW_REMEMBER;
        assert_eq!(memory.first(due), 0, "the hour is tried again");
        // Too slow again: remembered from this try. Then five minutes too slow as well: the
        // last minute, until the hour is due again.
        memory.counted(0, 1, due);
        assert_eq!(memory.first(due + OVERVIEW_REMEMBER - minute), 1);
        memory.counted(1, 2, due + minute);
        assert_eq!(memory.first(due + OVERVIEW_REMEMBER - minute), 2);
        assert_eq!(memory.first(due + OVERVIEW_REMEMBER), 0);
        // A view that began before the memory was cleared, or moved on, by another does not
        // bring an older span back.
        memory.counted(0, 0, due);
        memory.counted(1, 1, due + minute);
        assert_eq!(memory.first(due + minute), 0);
        memory.counted(0, 2, due);
        memory.counted(1, 1, due + minute);
        assert_eq!(memory.first(due + minute), 2);
        // The hour fit: forgotten.
        memory.counted(0, 0, due + 2 * OVERVIEW_REMEMBER);
        assert_eq!(memory.first(due + 2 * OVERVIEW_REMEMBER), 0);
    }
}
