//! Gates an action must pass before it may execute: approval, per-run limits, reattempts.

use std::collections::HashMap;

use serde_json::Value;

use crate::action::key;
use crate::config::{Tool, ToolClass};
use crate::db::DbError;
use crate::outcome::ErrorCode;

mod approval;
mod retention;

pub use approval::{decide, expire_approvals, DecideError, Decision};
pub use retention::prune;

/// The number an approval threshold is compared with: `None` when the field is absent, else
/// the value as a finite number (a JSON number, or a string that reads as one) or why not.
fn compared_number(v: &Value) -> Option<Result<f64, ()>> {
    let n = match v {
        Value::Null => return None,
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    Some(n.filter(|n| n.is_finite()).ok_or(()))
}

/// Refuses an action whose approval field is there but is no finite number: `"NaN"` compares
/// as smaller than any threshold and would pass the gate, `"1e999"` is no amount anyone meant.
/// The error names the field, for a `schema_invalid` answer.
pub fn approval_field_usable(tool: &Tool, data: &crate::action::ActionData) -> Result<(), String> {
    let crate::config::Approval::Above { field, .. } = &tool.approval else {
        return Ok(());
    };
    let value = key::field(data, field).to_json();
    match compared_number(&value) {
        Some(Err(())) => Err(format!(
            "{} is {value}; tool {} compares it with its approval threshold, so it must be a finite number",
            field.0, tool.name
        )),
        _ => Ok(()),
    }
}

/// Per-action gates, decided from the tool's config when the action is decoded.
#[derive(Debug, Clone, Default)]
pub struct Gates {
    /// Park it `pending_approval` instead of executing.
    pub approval: bool,
    /// Distinct intents of this tool per run.
    pub max_per_run: Option<u32>,
    /// Distinct intents per run across tools.
    pub run_cap: Option<u32>,
    /// Failed intents per (run, tool, business id) before new ones are refused.
    pub max_reattempts: Option<u32>,
}

impl Gates {
    pub fn of(tool: &Tool, data: &crate::action::ActionData, run_cap: Option<u32>) -> Self {
        let approval = match &tool.approval {
            crate::config::Approval::None => false,
            crate::config::Approval::Required => true,
            crate::config::Approval::Above { field, threshold } => {
                // Absent, or not a finite number (refused at decode, see
                // `approval_field_usable`): nothing shows it is small enough.
                compared_number(&key::field(data, field).to_json())
                    .and_then(Result::ok)
                    .is_none_or(|v| v > *threshold)
            }
        };
        Gates {
            approval,
            max_per_run: tool.max_per_run,
            run_cap,
            max_reattempts: tool.max_reattempts,
        }
    }
}

// Counted in the transaction that records the intents: two relays cannot both take the last
// slot, since the counter row is locked until commit.
const COUNT_RUN: &str = "
    insert into run_counts (run_id, tool, n)
    select * from unnest($1::text[], $2::text[], $3::int4[])
    on conflict (run_id, tool) do update set n = run_counts.n + excluded.n
    returning run_id, tool, n";

/// Whether a new key is refused before it is recorded: `stale`, it was finished and pruned
/// (a run resumed past retention); or `failed_before` intents of the same business action in
/// this run failed, as many as `max_reattempts` allows. The refusal's code and message.
pub(crate) fn refusal(
    key: &str,
    tool: &str,
    business_id: Option<&str>,
    gates: &Gates,
    stale: bool,
    failed_before: Option<i64>,
) -> Option<(ErrorCode, String)> {
    if stale {
        return Some((ErrorCode::StaleResume, format!(
            "key {key} belongs to an action finished and pruned after its retention; a resumed run cannot execute it again"
        )));
    }
    match (gates.max_reattempts, failed_before) {
        (Some(max), Some(n)) if n >= i64::from(max) => Some((ErrorCode::ReattemptsExceeded, format!(
            "{n} attempts at this {tool} for {} already failed (the limit is {max}); stop and report instead of trying again",
            business_id.unwrap_or("")
        ))),
        _ => None,
    }
}

/// One newly recorded intent, as the per-run limits see it.
pub(crate) struct Counted<'a> {
    pub id: i64,
    pub run_id: &'a str,
    pub tool: &'a str,
    pub class: ToolClass,
    pub gates: &'a Gates,
}

/// Counts newly recorded intents against their tool's and their run's limits; returns the ids
/// over a limit, with the reason.
pub(crate) async fn count_runs(
    tx: &impl deadpool_postgres::GenericClient,
    recorded: &[Counted<'_>],
) -> Result<HashMap<i64, String>, DbError> {
    // (run, tool or "*") → (limit, this batch's intents, in order)
    let mut groups: std::collections::BTreeMap<(String, String), (u32, Vec<i64>)> =
        Default::default();
    for a in recorded {
        if a.class == ToolClass::ReadOnly {
            continue;
        }
        let run = a.run_id.to_string();
        if let Some(limit) = a.gates.max_per_run {
            groups
                .entry((run.clone(), a.tool.to_string()))
                .or_insert((limit, Vec::new()))
                .1
                .push(a.id);
        }
        if let Some(limit) = a.gates.run_cap {
            groups
                .entry((run, "*".to_string()))
                .or_insert((limit, Vec::new()))
                .1
                .push(a.id);
        }
    }
    let mut over = HashMap::new();
    if groups.is_empty() {
        return Ok(over);
    }
    // Sorted (a BTreeMap), so two relays lock the counter rows in the same order.
    let runs: Vec<&str> = groups.keys().map(|k| k.0.as_str()).collect();
    let tools: Vec<&str> = groups.keys().map(|k| k.1.as_str()).collect();
    let adds: Vec<i32> = groups.values().map(|g| g.1.len() as i32).collect();
    for row in tx
        .query(
            &tx.prepare_cached(COUNT_RUN).await?,
            &[&runs, &tools, &adds],
        )
        .await?
    {
        let key: (String, String) = (row.get(0), row.get(1));
        let total: i32 = row.get(2);
        let (limit, ids) = &groups[&key];
        let before = total - ids.len() as i32;
        for (k, id) in ids.iter().enumerate() {
            let n = before + k as i32 + 1;
            if n > *limit as i32 {
                let scope = if key.1 == "*" {
                    "actions".to_string()
                } else {
                    format!("{} actions", key.1)
                };
                over.entry(*id).or_insert_with(|| {
                    format!(
                        "run {} may record at most {limit} {scope}; this would be number {n}",
                        key.0
                    )
                });
            }
        }
    }
    Ok(over)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limited(max: u32) -> Gates {
        Gates {
            max_reattempts: Some(max),
            ..Gates::default()
        }
    }

    #[test]
    fn an_approval_field_must_be_a_finite_number_and_nan_never_slips_under_the_threshold() {
        let config = crate::config::Config::from_toml(
            r#"
[[tools]]
name = "refund"
class = "dangerous"
key = ["args.order"]
material = ["args.amount"]
approval = { field = "args.amount", above = 100 }
executor = { kind = "http", url = "http://x/v1/refund" }
verify = { url = "http://x/v1/refund/{key}" }
"#,
            |_| None,
        )
        .unwrap();
        let tool = &config.tools[0];
        let data = |amount: Value| -> crate::action::ActionData {
            serde_json::from_value(serde_json::json!({
                "run_id": "r", "tool": "refund", "args": {"order": "o", "amount": amount}
            }))
            .unwrap()
        };
        for (amount, gated) in [
            (serde_json::json!(5), false),
            (serde_json::json!("5.5"), false),
            (serde_json::json!(500), true),
            (serde_json::json!(null), true),
        ] {
            assert!(
                approval_field_usable(tool, &data(amount.clone())).is_ok(),
                "{amount}"
            );
            assert_eq!(
                Gates::of(tool, &data(amount.clone()), None).approval,
                gated,
                "{amount}"
            );
        }
        for amount in ["NaN", "1e999", "-inf", "five", ""] {
            let e = approval_field_usable(tool, &data(serde_json::json!(amount))).unwrap_err();
            assert!(
                e.contains("args.amount") && e.contains("finite number"),
                "{amount}: {e}"
            );
            assert!(
                Gates::of(tool, &data(serde_json::json!(amount)), None).approval,
                "{amount}"
            );
        }
        let e = approval_field_usable(tool, &data(serde_json::json!({"v": 1}))).unwrap_err();
        assert!(e.contains("finite number"), "{e}");
    }

    #[test]
    fn a_pruned_key_is_refused_as_a_stale_resume() {
        let (code, message) = refusal("k1", "t", None, &Gates::default(), true, None).unwrap();
        assert_eq!(code, ErrorCode::StaleResume);
        assert!(message.contains("key k1"), "{message}");
    }

    #[test]
    fn reattempts_are_refused_once_the_failures_reach_the_limit() {
        let g = limited(2);
        assert_eq!(
            refusal("k", "refund", Some("o-1"), &g, false, Some(1)),
            None
        );
        let (code, message) = refusal("k", "refund", Some("o-1"), &g, false, Some(2)).unwrap();
        assert_eq!(code, ErrorCode::ReattemptsExceeded);
        assert!(
            message.starts_with("2 attempts at this refund for o-1"),
            "{message}"
        );
        // Without a limit, or with no failures on record, nothing is refused.
        let none = Gates::default();
        assert_eq!(
            refusal("k", "refund", Some("o-1"), &none, false, Some(9)),
            None
        );
        assert_eq!(refusal("k", "refund", Some("o-1"), &g, false, None), None);
    }
}
