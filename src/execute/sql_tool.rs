use std::time::Instant;

use serde_json::{json, Value};

use crate::action::key;
use crate::config::{ExecutorKind, SqlParam, Tool};
use crate::db::{self, DATA_PATH_STATEMENT_TIMEOUT_MS};
use crate::outcome::OutcomeStatus;
use crate::outcome::Settled;

use crate::execute::claim::Claimed;

use super::*;

/// Runs a sql tool's statement inside the outcome transaction, under a savepoint so a failing
/// statement becomes a `failed` outcome instead of aborting the record.
pub(super) async fn run_sql(
    tx: &tokio_postgres::Transaction<'_>,
    tool: &Tool,
    c: &Claimed,
) -> Result<Settled, ExecError> {
    let ExecutorKind::Sql(exec) = &tool.executor else {
        unreachable!("sql tool")
    };
    let data = action_data(c);
    let values: Vec<Value> = exec
        .params
        .iter()
        .map(|p| match p {
            SqlParam::Key => Value::String(c.key.clone()),
            SqlParam::Field(f) => key::field(&data, f).to_json(),
        })
        .collect();
    // Parameters travel as text and are cast by the statement (`$2::numeric`), so any column
    // type works without idem knowing it.
    let texts: Vec<Option<String>> = values
        .iter()
        .map(|v| match v {
            Value::Null => None,
            Value::String(s) => Some(s.clone()),
            other => Some(other.to_string()),
        })
        .collect();
    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = texts
        .iter()
        .map(|t| t as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect();
    // The tool's own statement plans with the server's settings, not the data path's, and is
    // bounded by the tool's timeout (a whole number of milliseconds, not user text).
    tx.batch_execute(&format!(
        "savepoint idem_tool; set local enable_seqscan = on; set local plan_cache_mode = auto; \
         set local statement_timeout = {}",
        exec.timeout.as_millis().max(1)
    ))
    .await?;
    let started = Instant::now();
    let typed = tx
        .prepare_typed(
            &exec.statement,
            &vec![tokio_postgres::types::Type::TEXT; texts.len()],
        )
        .await;
    let outcome = match typed {
        Ok(stmt) => tx.query(&stmt, &params).await,
        Err(e) => Err(e),
    };
    let settled = match outcome {
        Ok(rows) => {
            tx.batch_execute(&format!(
                "release savepoint idem_tool; set local statement_timeout = {DATA_PATH_STATEMENT_TIMEOUT_MS}"
            ))
            .await?;
            let result = rows.first().map(row_json).unwrap_or(Value::Null);
            Settled::new(OutcomeStatus::Succeeded, Some(result), None, 1)
        }
        Err(e) => {
            tx.batch_execute(&format!(
                "rollback to savepoint idem_tool; set local statement_timeout = {DATA_PATH_STATEMENT_TIMEOUT_MS}"
            ))
            .await?;
            let state = db::sqlstate(&e).unwrap_or_default();
            Settled::new(
                OutcomeStatus::Failed,
                None,
                Some(ErrorCode::DownstreamRejected.error(format!(
                        "the statement failed with SQLSTATE {state}: {}",
                        e.as_db_error()
                            .map_or_else(|| e.to_string(), |d| d.message().to_string())
                    ))),
                1,
            )
        }
    };
    tracing::debug!(
        took_ms = started.elapsed().as_millis() as u64,
        "sql executed"
    );
    Ok(settled)
}

/// A result row as a JSON object; each column read as text (`::text` in the statement for
/// exotic types), JSON columns kept as JSON.
pub(super) fn row_json(row: &tokio_postgres::Row) -> Value {
    use tokio_postgres::types::Type;
    let mut m = serde_json::Map::new();
    pub(super) fn get<'a, T>(row: &'a tokio_postgres::Row, i: usize) -> Value
    where
        T: tokio_postgres::types::FromSql<'a> + serde::Serialize,
    {
        row.try_get::<_, Option<T>>(i)
            .ok()
            .flatten()
            .map_or(Value::Null, |v| json!(v))
    }
    for (i, col) in row.columns().iter().enumerate() {
        let v = match *col.type_() {
            Type::JSON | Type::JSONB => get::<Value>(row, i),
            Type::INT2 => get::<i16>(row, i),
            Type::INT4 => get::<i32>(row, i),
            Type::INT8 => get::<i64>(row, i),
            Type::BOOL => get::<bool>(row, i),
            Type::FLOAT8 => get::<f64>(row, i),
            _ => get::<String>(row, i),
        };
        m.insert(col.name().to_string(), v);
    }
    Value::Object(m)
}
