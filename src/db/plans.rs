//! For tests of what a statement reads: a fresh schema on the test Postgres, reached with the
//! data path's session settings (a test of another pool's statement sets that pool's), and what
//! `explain (analyze, format json)` says each scan read. A prepared statement keeps the generic
//! plan of its first execution until something (a vacuum or an analyze of a table it reads)
//! makes the connection plan it again, and one planned at each call follows the statistics of
//! the moment; so these tests make the plan on small tables, or leave the statistics behind,
//! grow the tables, and count the rows read. A test that fails leaves its schema, which the
//! test command drops on its next run (as it drops every test's).

use deadpool_postgres::Object;
use serde_json::Value;
use tokio_postgres::SimpleQueryMessage;

use crate::config::PostgresConfig;

/// A migrated schema of its own and a data-path connection to it; dropped by [`Fresh::drop`].
pub(crate) struct Fresh {
    pub schema: String,
    /// Where the schema is, for a pool of another kind.
    pub cfg: PostgresConfig,
    pub pg: Object,
}

impl Fresh {
    pub async fn new() -> Fresh {
        let cfg = PostgresConfig {
            url: std::env::var("IDEM_TEST_POSTGRES_URL")
                .unwrap_or_else(|_| "postgres://idem:idem@127.0.0.1:5432/idem".into()),
            schema: format!("t_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
            pool_size: 1,
        };
        super::migrate(&cfg).await.expect("migrate");
        let pool = super::data_path_pool(&cfg).expect("pool");
        let pg = pool.get().await.expect("connection");
        Fresh {
            schema: cfg.schema.clone(),
            cfg,
            pg,
        }
    }

    /// Intents `1..=n` of a dangerous tool, in id order: key `k{g}`, action event `e{g}` at
    /// offset `g`, `traceparent` `tp-k{g}`, with the status the SQL expression `status` gives
    /// for `g`; those for which `leased` is true hold a live lease (epoch 1) of `relay-1`. The
    /// fill is not bounded by the data path's `statement_timeout`: two million rows took longer
    /// than its 30 s on a busy host.
    pub async fn intents(&self, n: i64, status: &str, leased: &str) {
        let fill = format!(
            "insert into intents (idempotency_key, tool, class, run_id, args, material,
                                  fingerprint, args_hash, action_event_id, source_topic,
                                  source_partition, source_offset, traceparent, status,
                                  lease_owner, lease_expires_at, lease_epoch)
             select 'k' || g, 'send_email', 'dangerous', 'r', '{{}}', '{{}}', 'f', 'h', 'e' || g,
                    'actions', 0, g, 'tp-k' || g, {status},
                    case when {leased} then 'relay-1' end,
                    case when {leased} then now() + interval '1 minute' end,
                    case when {leased} then 1 else 0 end
               from generate_series(1, {n}) g"
        );
        self.pg
            .batch_execute(&format!(
                "begin; set local statement_timeout = 0; {fill}; commit"
            ))
            .await
            .expect("intents");
    }

    /// The rows of `sql` (simple protocol), each as (column, text) pairs.
    pub async fn rows(&self, sql: &str) -> Vec<Vec<(String, String)>> {
        let messages = self.pg.simple_query(sql).await.expect(sql);
        let row = |r: &tokio_postgres::SimpleQueryRow| {
            let name = |i: usize| r.columns()[i].name().to_string();
            let text = |i: usize| r.get(i).unwrap_or("").to_string();
            (0..r.len()).map(|i| (name(i), text(i))).collect()
        };
        messages
            .iter()
            .filter_map(|m| match m {
                SimpleQueryMessage::Row(r) => Some(row(r)),
                _ => None,
            })
            .collect()
    }

    /// The plan `execute` ran with, from `explain (analyze, format json)` in a transaction
    /// rolled back, so a statement that writes leaves nothing.
    pub async fn explain(&self, execute: &str) -> Value {
        let rows = self
            .rows(&format!(
                "begin; explain (analyze, format json) {execute}; rollback"
            ))
            .await;
        let plan: Value = serde_json::from_str(&rows[0][0].1).expect("explain's json");
        plan[0]["Plan"].clone()
    }

    pub async fn drop(self) {
        let _ = self
            .pg
            .batch_execute(&format!("drop schema {} cascade", self.schema))
            .await;
    }
}

/// Rows read from `table` by every scan of it in a plan from [`Fresh::explain`]: those each scan
/// returned and those its filters dropped (the rows a write returns are not counted again).
pub(crate) fn rows_read(node: &Value, table: &str) -> f64 {
    let own = if node["Relation Name"] == table && node["Node Type"] != "ModifyTable" {
        let counts = [
            "Actual Rows",
            "Rows Removed by Filter",
            "Rows Removed by Index Recheck",
        ];
        let rows: f64 = counts.iter().filter_map(|c| node[*c].as_f64()).sum();
        rows * node["Actual Loops"].as_f64().unwrap_or(0.0)
    } else {
        0.0
    };
    let below = node["Plans"].as_array().into_iter().flatten();
    own + below.map(|n| rows_read(n, table)).sum::<f64>()
}
