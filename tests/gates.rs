//! Gates for what cannot be undone: approvals bound to the request, per-run limits, reattempt
//! limits, retention with tombstones, and the admin API's token.

mod common;

use std::time::Duration;

use common::{action, Env};
use idem::config::Config;
use idem::fake_downstream::Step;
use idem::gates::Decision;
use serde_json::json;

/// A refund with no verify and a downstream that ignores the key: gated by default.
const REFUND: &str = r#"
[[tools]]
name = "refund"
class = "dangerous"
key = ["run_id", "tool", "business_id", "args.order_id"]
material = ["args.order_id", "args.amount"]
executor = { kind = "http", url = "{downstream}/v1/refund", timeout = "2s" }
"#;

fn refund(run: &str, order: &str, amount: i64, memo: &str) -> serde_json::Value {
    json!({"run_id": run, "tool": "refund", "business_id": "ticket-7", "args": {"order_id": order, "amount": amount, "memo": memo}})
}

async fn pool(env: &Env) -> deadpool_postgres::Pool {
    let config = Config::from_toml(&env.config_text("", ""), |_| None).unwrap();
    idem::db::pool(&config.postgres).unwrap()
}

#[tokio::test]
async fn approval_gates_execution_and_binds_to_the_request() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(REFUND, "").await).await;
    let p = env.producer();
    let key = "r1:refund:ticket-7:o1";
    p.send(&action("e1", refund("r1", "o1", 40, "sorry"))).await;
    let parked = outcomes.answer("e1", "pending_approval").await;
    assert_eq!(
        parked["data"]["note"],
        "Waiting for approval; do not retry."
    );
    // A reworded repeat waits with it; it cannot ride on a later approval as a new request.
    p.send(&action("e2", refund("r1", "o1", 40, "so sorry")))
        .await;
    let dup = outcomes.answer("e2", "pending_approval").await;
    assert_eq!(dup["data"]["duplicate"], true);
    assert_eq!(
        env.downstream.total_effects(),
        0,
        "nothing executes before approval"
    );

    let pool = pool(&env).await;
    let explained = common::explain(&env, key).await;
    let fingerprint = explained["fingerprint"].as_str().unwrap().to_string();
    let wrong = idem::gates::decide(
        &pool,
        &env.schema,
        key,
        Decision::Approve,
        "ops",
        "ok",
        Some("not-it"),
    )
    .await;
    assert!(
        matches!(
            wrong,
            Err(idem::gates::DecideError::FingerprintMismatch { .. })
        ),
        "{wrong:?}"
    );

    // Async, so the in-process relay keeps running (and releasing its locks) meanwhile.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "approve",
            "--config",
            &write_config(&env, REFUND),
            key,
            "--by",
            "ada",
            "--reason",
            "customer called",
            "--fingerprint",
            &fingerprint,
        ])
        .output()
        .await
        .unwrap();
    common::assert_succeeded("idem approve", &out);
    let done = outcomes.answer("e1", "succeeded").await;
    assert_eq!(done["data"]["duplicate"], false);
    assert_eq!(env.downstream.effects(key), 1);
    let e = common::explain(&env, key).await;
    assert_eq!(e["approvals"][0]["decision"], "approved");
    assert_eq!(e["approvals"][0]["by"], "ada");
    assert_eq!(e["approvals"][0]["fingerprint"], fingerprint.as_str());

    // Deny: rejected, never executed.
    p.send(&action("e3", refund("r1", "o2", 900, "full refund")))
        .await;
    outcomes.answer("e3", "pending_approval").await;
    idem::gates::decide(
        &pool,
        &env.schema,
        "r1:refund:ticket-7:o2",
        Decision::Deny,
        "ada",
        "too much",
        None,
    )
    .await
    .unwrap();
    let denied = outcomes.answer("e3", "rejected").await;
    assert_eq!(denied["data"]["error"]["code"], "approval_denied");
    assert_eq!(env.downstream.effects("r1:refund:ticket-7:o2"), 0);
    relay.stop().await;
}

/// A key's status changes go out in order. The outcome of an approved call, which its finish
/// hands to the publishers, waits while the key's `pending_approval` outcome is queued and held
/// by another publishing round (a transaction holds it here, as a round whose send failed holds
/// it until it puts it back); once let go, `pending_approval` goes out again (same id), then
/// the call's outcome.
#[tokio::test]
async fn an_approved_calls_outcome_waits_for_the_pending_approval_before_it() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(REFUND, "").await).await;
    let key = "r1:refund:ticket-7:o1";
    env.producer()
        .send(&action("e1", refund("r1", "o1", 40, "sorry")))
        .await;
    outcomes.answer("e1", "pending_approval").await;
    // The published row queued again and held, as a round whose send failed holds it. A poll
    // round may take the row between the two (it goes out again, and is queued again here).
    let pg = env.pg().await;
    let parked = "select id from outbox where kafka_key = $1";
    let holder = env.pg().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "the published row was never held: poll rounds took it every time"
        );
        pg.execute(
            &format!("insert into outbox_pending (id) {parked} on conflict do nothing"),
            &[&key],
        )
        .await
        .unwrap();
        holder.batch_execute("begin").await.unwrap();
        let held = holder
            .execute(
                &format!("select id from outbox_pending where id in ({parked}) for update"),
                &[&key],
            )
            .await
            .unwrap();
        if held == 1 {
            break;
        }
        holder.batch_execute("rollback").await.unwrap();
    }

    idem::gates::decide(
        &pool(&env).await,
        &env.schema,
        key,
        Decision::Approve,
        "ada",
        "ok",
        None,
    )
    .await
    .unwrap();
    common::eventually_metrics(
        "the approved call's outcome held back",
        Duration::from_secs(30),
        relay.admin(),
        |m| common::sample(m, "idem_outbox_held_back_total") >= 1.0,
    )
    .await;
    assert_eq!(env.downstream.effects(key), 1);
    let statuses = || -> Vec<String> {
        outcomes
            .answers("e1")
            .iter()
            .map(|o| o["data"]["status"].as_str().unwrap_or("?").to_string())
            .collect()
    };
    let before = statuses();
    assert!(
        before.iter().all(|s| s == "pending_approval"),
        "the call's outcome went out while the one before it was held: {before:?}"
    );
    holder.batch_execute("rollback").await.unwrap();
    outcomes.answer("e1", "succeeded").await;
    // In topic order: the held row went out again, then the call's outcome, last.
    let after = statuses();
    let (last, earlier) = after.split_last().unwrap();
    assert_eq!(last, "succeeded", "{after:?}");
    assert!(
        earlier.len() >= 2 && earlier.iter().all(|s| s == "pending_approval"),
        "{after:?}"
    );
    relay.stop().await;
}

/// Keys nobody decides on are rejected at their tool's approval timeout, without running; the
/// timeout's decision is on record, and a repeat afterwards gets that answer.
#[tokio::test]
async fn keys_nobody_decides_on_are_rejected_at_the_approval_timeout() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let tools = format!("{REFUND}approval_timeout = \"2s\"\n");
    let relay = env.start(env.config(&tools, "").await).await;
    let p = env.producer();
    let ids: Vec<String> = (0..40).map(|i| format!("e{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        p.send(&action(id, refund("r3", &format!("o{i}"), 10, "x")))
            .await;
    }
    let time = |o: &serde_json::Value| {
        chrono::DateTime::parse_from_rfc3339(o["time"].as_str().expect("a time")).expect("rfc3339")
    };
    for id in &ids {
        let parked = outcomes.answer(id, "pending_approval").await;
        let rejected = outcomes.answer(id, "rejected").await;
        assert_eq!(
            rejected["data"]["error"]["code"], "approval_timeout",
            "{rejected}"
        );
        // Not before the timeout (the parked answer is written just after the key's record).
        let waited = time(&rejected) - time(&parked);
        assert!(waited >= chrono::TimeDelta::milliseconds(1500), "{waited}");
    }
    let e = common::explain(&env, "r3:refund:ticket-7:o0").await;
    assert_eq!(e["status"], "rejected", "{e}");
    assert_eq!(e["approvals"][0]["decision"], "expired", "{e}");
    assert_eq!(e["approvals"][0]["by"], "idem", "{e}");

    p.send(&action("again", refund("r3", "o0", 10, "x"))).await;
    let again = outcomes.answer("again", "rejected").await;
    assert_eq!(again["data"]["duplicate"], true, "{again}");
    assert_eq!(again["data"]["error"]["code"], "approval_timeout");
    assert_eq!(env.downstream.total_effects(), 0, "nothing ran");
    relay.stop().await;
}

fn write_config(env: &Env, tools: &str) -> String {
    let path = std::env::temp_dir().join(format!("{}.toml", env.schema));
    std::fs::write(&path, env.config_text(tools, "")).unwrap();
    path.to_str().unwrap().to_string()
}

#[tokio::test]
async fn racing_decisions_end_with_one_decision_and_at_most_one_effect() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let config = env.config(REFUND, "").await;
    let p = env.producer();
    // No relay yet: the decisions race each other, then "the relay crashed right after the
    // approval" is the same as one starting now.
    let relay = env.start(config.clone()).await;
    for i in 0..2 {
        p.send(&action(
            &format!("e{i}"),
            refund("r2", &format!("o{i}"), 10, "x"),
        ))
        .await;
        outcomes.answer(&format!("e{i}"), "pending_approval").await;
    }
    relay.stop().await;
    let pool = pool(&env).await;
    let twice = futures::future::join_all((0..4).map(|_| {
        idem::gates::decide(
            &pool,
            &env.schema,
            "r2:refund:ticket-7:o0",
            Decision::Approve,
            "ops",
            "double click",
            None,
        )
    }))
    .await;
    assert_eq!(twice.iter().filter(|r| r.is_ok()).count(), 1, "{twice:?}");
    let (a, b) = tokio::join!(
        idem::gates::decide(
            &pool,
            &env.schema,
            "r2:refund:ticket-7:o1",
            Decision::Approve,
            "ann",
            "yes",
            None
        ),
        idem::gates::decide(
            &pool,
            &env.schema,
            "r2:refund:ticket-7:o1",
            Decision::Deny,
            "bob",
            "no",
            None
        ),
    );
    assert!(
        a.is_ok() != b.is_ok(),
        "exactly one decision wins: {a:?} {b:?}"
    );

    let relay = env.start(config).await;
    outcomes.answer("e0", "succeeded").await;
    let o1 = if a.is_ok() {
        outcomes.answer("e1", "succeeded").await
    } else {
        outcomes.answer("e1", "rejected").await
    };
    assert_eq!(env.downstream.effects("r2:refund:ticket-7:o0"), 1);
    assert_eq!(
        env.downstream.effects("r2:refund:ticket-7:o1"),
        u64::from(a.is_ok()),
        "{o1}"
    );
    let e = common::explain(&env, "r2:refund:ticket-7:o0").await;
    assert_eq!(e["approvals"].as_array().unwrap().len(), 1);
    relay.stop().await;
}

const LIMITED: &str = r#"
[[tools]]
name = "send_sms"
class = "dangerous"
key = ["run_id", "tool", "args.text"]
material = ["args.to"]
executor = { kind = "http", url = "{downstream}/v1/send_sms", timeout = "2s" }
verify = { url = "{downstream}/v1/effects/{key}" }
max_per_run = 3
max_reattempts = 2
"#;

#[tokio::test]
async fn the_run_limit_refuses_exactly_the_n_plus_first_under_concurrent_arrival() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let config = env.config(LIMITED, "").await;
    // Two relays in one group: the intents of one run arrive on different partitions at once.
    let a = env.start(config.clone()).await;
    let b = env.start(config).await;
    let p = env.producer();
    let sends = (0..10).map(|i| {
        let mut e = action(&format!("s{i}"), json!({"run_id": "r3", "tool": "send_sms", "args": {"to": "x", "text": format!("t{i}")}}));
        e["data"]["idempotency_key"] = json!(format!("r3:sms:{i}"));
        e
    });
    let events: Vec<_> = sends.collect();
    futures::future::join_all(events.iter().map(|e| p.send(e))).await;
    let all = outcomes
        .wait_for("ten answers", Duration::from_secs(60), |v| v.len() >= 10)
        .await;
    let ok = all
        .iter()
        .filter(|o| o["data"]["status"] == "succeeded")
        .count();
    let limited: Vec<_> = all
        .iter()
        .filter(|o| o["data"]["error"]["code"] == "run_limit_exceeded")
        .collect();
    assert_eq!((ok, limited.len()), (3, 7), "{all:#?}");
    assert!(limited[0]["data"]["note"]
        .as_str()
        .unwrap()
        .contains("stop and report"));
    assert_eq!(env.downstream.total_effects(), 3);
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn failed_reattempts_past_the_limit_are_refused() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(LIMITED, "").await).await;
    let p = env.producer();
    for i in 0..3 {
        let key = format!("r4:sms:{i}");
        env.downstream.script(
            Some(&key),
            vec![Step::Status {
                status: 422,
                retry_after: None,
            }],
        );
        let mut e = action(
            &format!("f{i}"),
            json!({"run_id": "r4", "tool": "send_sms", "business_id": "appointment-1", "args": {"to": "x", "text": format!("t{i}")}}),
        );
        e["data"]["idempotency_key"] = json!(key);
        p.send(&e).await;
        if i < 2 {
            outcomes.answer(&format!("f{i}"), "failed").await;
        }
    }
    let r = outcomes.answer("f2", "rejected").await;
    assert_eq!(r["data"]["error"]["code"], "reattempts_exceeded");
    assert_eq!(
        env.downstream.requests(),
        2,
        "the third never went downstream"
    );
    relay.stop().await;
}

#[tokio::test]
async fn a_pruned_key_resumed_is_stale_and_parked_keys_are_never_pruned() {
    let env = Env::new().await;
    let tools = format!(
        "{REFUND}\n{}",
        LIMITED.replace("max_per_run = 3\nmax_reattempts = 2\n", "")
    );
    let outcomes = env.outcomes().await;
    let config = env.config(&tools, "").await;
    let relay = env.start(config.clone()).await;
    let p = env.producer();
    let sms = |id: &str, run: &str, text: &str| {
        action(
            id,
            json!({"run_id": run, "tool": "send_sms", "args": {"to": "x", "text": text}}),
        )
    };
    p.send(&sms("done", "r5", "hello")).await;
    outcomes.answer("done", "succeeded").await;
    // Same run as a key waiting for approval: the run is paused, its finished keys stay.
    p.send(&sms("paused-done", "r6", "hi")).await;
    outcomes.answer("paused-done", "succeeded").await;
    // A replay of each, so that both keys have a deliveries row (a first delivery is its
    // intent's, schema migration 13).
    for (id, run, text) in [("done-again", "r5", "hello"), ("paused-again", "r6", "hi")] {
        p.send(&sms(id, run, text)).await;
        outcomes.answer(id, "succeeded").await;
    }
    p.send(&action("paused", refund("r6", "o9", 5, "x"))).await;
    outcomes.answer("paused", "pending_approval").await;

    let pg = env.pg().await;
    // Aged past retention; the parked key stays younger than its approval timeout, so it keeps
    // its run paused.
    pg.execute("update intents set finished_at = now() - interval '8 days', created_at = now() - interval '8 days' where status <> 'pending_approval'", &[]).await.unwrap();
    common::outbox_drained(&pg, "the outcomes published").await;
    let pool = pool(&env).await;
    let pruned = idem::gates::prune(&pool, &config, &Default::default())
        .await
        .unwrap();
    assert_eq!(
        pruned, 1,
        "only the finished key of a run that waits on nothing"
    );
    let outcomes_left: i64 = pg
        .query_one(
            "select count(*) from outbox where kafka_key = 'r5:send_sms:hello'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        outcomes_left, 0,
        "the pruned key's published outcome stayed"
    );
    let left: Vec<String> = pg
        .query("select idempotency_key from intents order by 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, ["r6:refund:ticket-7:o9", "r6:send_sms:hi"]);
    // The pruned key's deliveries and attempts went with it (a trigger since migration 12, no
    // longer the foreign keys); the other keys' stayed.
    for (table, kept_rows) in [("deliveries", 1), ("attempts", 1)] {
        let (orphans, pruned_keys, kept): (i64, i64, i64) = {
            let row = pg
                .query_one(
                    &format!(
                        "select count(*) filter (where not exists
                                    (select 1 from intents i where i.id = t.intent_id)),
                                count(*) filter (where idempotency_key = 'r5:send_sms:hello'),
                                count(*) filter (where idempotency_key like 'r6:%')
                           from {table} t where intent_id is not null"
                    ),
                    &[],
                )
                .await
                .unwrap();
            (row.get(0), row.get(1), row.get(2))
        };
        assert_eq!((orphans, pruned_keys), (0, 0), "{table} of the pruned key");
        assert_eq!(kept, kept_rows, "{table} of the kept keys");
    }

    // The run resumes from a checkpoint after the key was pruned: it must not run as new.
    // Sent twice (a client retry with a new event id) while no relay runs, so both land in one
    // batch: the second, a repeat of a key refused a moment earlier in the same batch, was
    // once left unanswered (issue 12).
    relay.stop().await;
    p.send(&sms("resumed", "r5", "hello")).await;
    p.send(&sms("resumed-again", "r5", "hello")).await;
    let relay = env.start(config.clone()).await;
    for id in ["resumed", "resumed-again"] {
        let stale = outcomes.answer(id, "rejected").await;
        assert_eq!(stale["data"]["error"]["code"], "stale_resume", "{id}");
    }
    assert_eq!(env.downstream.effects("r5:send_sms:hello"), 1);
    relay.stop().await;
}

/// A run resumed at the moment its key is pruned: the pruning transaction has deleted the
/// intent and written the tombstone but not committed when the repeat is recorded. The batch's
/// tombstone read cannot see the tombstone yet, and its insert of the key waits for the
/// deleting transaction; once that commits, the key is free, and without a second look the
/// repeat was recorded as new and run again. It is refused as pruned, and runs once.
///
/// Recorded both ways: speculating (no gate reads the database before the insert), and the long
/// way, which a tool with `max_reattempts` and an action with a business id take.
#[tokio::test]
async fn a_key_resumed_while_it_is_being_pruned_is_refused_and_runs_once() {
    let plain = LIMITED.replace("max_per_run = 3\nmax_reattempts = 2\n", "");
    resumed_while_pruned(
        &plain,
        json!({"run_id": "r8", "tool": "send_sms", "args": {"to": "x", "text": "bye"}}),
    )
    .await;
}

#[tokio::test]
async fn a_key_resumed_while_it_is_being_pruned_is_refused_the_long_way_too() {
    let gated = LIMITED.replace("max_per_run = 3\n", "");
    resumed_while_pruned(
        &gated,
        json!({"run_id": "r8", "tool": "send_sms", "business_id": "b1",
               "args": {"to": "x", "text": "bye"}}),
    )
    .await;
}

async fn resumed_while_pruned(tools: &str, data: serde_json::Value) {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let config = env.config(tools, "").await;
    let relay = env.start(config).await;
    let p = env.producer();
    let sms = |id: &str| action(id, data.clone());
    let key = "r8:send_sms:bye";
    p.send(&sms("first")).await;
    outcomes.answer("first", "succeeded").await;
    let pg = env.pg().await;
    common::outbox_drained(&pg, "the outcome published").await;
    // Finished past its retention (7 days), as a key being pruned is: a repeat reads a key
    // settled within the last 12 hours without a lock, since no prune can reach it.
    pg.execute(
        "update intents set finished_at = now() - interval '8 days' where idempotency_key = $1",
        &[&key],
    )
    .await
    .unwrap();

    // Pruning under way: what its statement does, in a transaction held open.
    let mut pruner = env.pg().await;
    let pruning = pruner.transaction().await.unwrap();
    let gone = pruning
        .execute(
            "with gone as (delete from intents where idempotency_key = $1
                           returning idempotency_key, fingerprint, tool, status, finished_at)
             insert into tombstones (key_hash, fingerprint_hash, tool, status, finished_at,
                                     expires_at)
             select encode(sha256(convert_to(idempotency_key, 'UTF8')), 'hex'), fingerprint,
                    tool, status, finished_at, now() + interval '90 days'
               from gone",
            &[&key],
        )
        .await
        .unwrap();
    assert_eq!(gone, 1);
    let pruner_pid: i32 = pruning
        .query_one("select pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    p.send(&sms("resumed")).await;
    common::eventually(
        "the repeat's record waiting for the pruning transaction",
        Duration::from_secs(30),
        || async {
            pg.query_one(
                "select count(*) from pg_stat_activity where $1 = any(pg_blocking_pids(pid))",
                &[&pruner_pid],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
                > 0
        },
    )
    .await;
    pruning.commit().await.unwrap();

    let resumed = outcomes.answer_to("resumed", Duration::from_secs(30)).await;
    assert_eq!(resumed["data"]["status"], "rejected", "{resumed}");
    assert_eq!(
        resumed["data"]["error"]["code"], "stale_resume",
        "{resumed}"
    );
    assert_eq!(env.downstream.effects(key), 1);
    relay.stop().await;
}

/// A relay remembers the keys it recorded, and reads a repeat of one as stored without offering
/// it to the intent insert first. The key is pruned while the relay runs and still remembers it:
/// the repeat finds nothing stored. It must not stall the batch (an error retried for ever) nor
/// be answered from memory: it is recorded again the usual way, which finds the tombstone.
#[tokio::test]
async fn a_key_pruned_while_the_relay_remembers_it_is_refused_when_resumed() {
    let env = Env::new().await;
    let tools = LIMITED.replace("max_per_run = 3\nmax_reattempts = 2\n", "");
    let outcomes = env.outcomes().await;
    let config = env.config(&tools, "").await;
    let relay = env.start(config.clone()).await;
    let p = env.producer();
    let sms = |id: &str| {
        action(
            id,
            json!({"run_id": "r9", "tool": "send_sms", "args": {"to": "x", "text": "later"}}),
        )
    };
    let key = "r9:send_sms:later";
    p.send(&sms("first")).await;
    outcomes.answer("first", "succeeded").await;
    // A repeat while the key is stored: the relay has seen it recorded, twice now.
    p.send(&sms("again")).await;
    let again = outcomes.answer_to("again", Duration::from_secs(30)).await;
    assert_eq!(again["data"]["duplicate"], true, "{again}");

    let pg = env.pg().await;
    pg.execute(
        "update intents set finished_at = now() - interval '8 days' where idempotency_key = $1",
        &[&key],
    )
    .await
    .unwrap();
    common::outbox_drained(&pg, "the outcomes published").await;
    let pruned = idem::gates::prune(&pool(&env).await, &config, &Default::default())
        .await
        .unwrap();
    assert_eq!(pruned, 1);

    p.send(&sms("resumed")).await;
    let resumed = outcomes.answer_to("resumed", Duration::from_secs(30)).await;
    assert_eq!(resumed["data"]["status"], "rejected", "{resumed}");
    assert_eq!(
        resumed["data"]["error"]["code"], "stale_resume",
        "{resumed}"
    );
    // The relay goes on: a new key after it is recorded and done.
    p.send(&action(
        "next",
        json!({"run_id": "r9", "tool": "send_sms", "args": {"to": "x", "text": "next"}}),
    ))
    .await;
    outcomes.answer("next", "succeeded").await;
    assert_eq!(env.downstream.effects(key), 1);
    relay.stop().await;
}

#[tokio::test]
async fn admin_actions_need_the_token() {
    let env = Env::new().await;
    let token = "s3cret-token-for-tests";
    let text = env.config_text(REFUND, "");
    let with_token = Config::from_toml(&text, |k| {
        (k == idem::config::ENV_ADMIN_TOKEN).then(|| token.to_string())
    })
    .unwrap();
    idem::db::migrate(&with_token.postgres).await.unwrap();
    let outcomes = env.outcomes().await;
    let relay = env.start(with_token).await;
    env.producer()
        .send(&action("e1", refund("r7", "o1", 5, "x")))
        .await;
    outcomes.answer("e1", "pending_approval").await;
    let key = "r7:refund:ticket-7:o1";
    let url = format!("http://{}/v1/actions/{key}/approve", relay.admin());
    let http = reqwest::Client::new();
    let body = json!({"by": "ada", "reason": "ok"});
    let none = http.post(&url).json(&body).send().await.unwrap();
    assert_eq!(none.status(), 401);
    let wrong = http
        .post(&url)
        .bearer_auth("s3cret-token-for-tesTS")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let huge = http
        .post(&url)
        .bearer_auth(token)
        .body(vec![b'x'; 100_000])
        .send()
        .await
        .unwrap();
    assert_eq!(huge.status(), 413, "bodies are bounded");
    let e = common::explain(&env, key).await;
    assert_eq!(e["status"], "pending_approval", "nothing changed");
    assert_eq!(e["approvals"], json!([]));
    let right = http
        .post(&url)
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(right.status(), 200);
    outcomes.answer("e1", "succeeded").await;
    assert_eq!(env.downstream.total_effects(), 1);
    // Reading stays open.
    assert_eq!(
        http.get(format!("http://{}/metrics", relay.admin()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    relay.stop().await;

    // No token configured: the endpoints are off, not open.
    let relay = env.start(env.config(REFUND, "").await).await;
    let off = http
        .post(format!("http://{}/v1/actions/{key}/deny", relay.admin()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(off.status(), 403);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn every_v1_route_answers_by_its_token() {
    let env = Env::new().await;
    let (admin, read) = ("admin-token-for-tests", "read-token-for-tests");
    let text = env.config_text(REFUND, "");
    let config = Config::from_toml(&text, |k| match k {
        idem::config::ENV_ADMIN_TOKEN => Some(admin.to_string()),
        idem::config::ENV_ADMIN_READ_TOKEN => Some(read.to_string()),
        _ => None,
    })
    .unwrap();
    idem::db::migrate(&config.postgres).await.unwrap();
    let outcomes = env.outcomes().await;
    let relay = env.start(config).await;
    env.producer()
        .send(&action("e1", refund("r8", "o1", 5, "x")))
        .await;
    outcomes.answer("e1", "pending_approval").await;
    let key = "r8:refund:ticket-7:o1";
    let base = format!("http://{}/v1/actions", relay.admin());
    let http = reqwest::Client::new();
    let body = json!({"by": "ada", "reason": "ok", "as": "failed"});
    // A write authorized reaches its handler: on an unknown key that is a 404, so the table
    // changes nothing.
    let routes = [
        ("GET", format!("{base}/{key}"), [401, 401, 200, 200]),
        (
            "GET",
            format!("http://{}/v1/tools", relay.admin()),
            [401, 401, 200, 200],
        ),
        ("POST", format!("{base}/nope/approve"), [401, 401, 403, 404]),
        ("POST", format!("{base}/nope/deny"), [401, 401, 403, 404]),
        ("POST", format!("{base}/nope/resolve"), [401, 401, 403, 404]),
    ];
    for (method, url, expected) in routes {
        for (token, want) in [None, Some("wrong-token-for-tests"), Some(read), Some(admin)]
            .into_iter()
            .zip(expected)
        {
            let mut request = match method {
                "GET" => http.get(&url),
                _ => http.post(&url).json(&body),
            };
            if let Some(t) = token {
                request = request.bearer_auth(t);
            }
            let response = request.send().await.unwrap();
            assert_eq!(
                response.status().as_u16(),
                want,
                "{method} {url} with {token:?}"
            );
        }
    }
    let e = common::explain(&env, key).await;
    assert_eq!(e["status"], "pending_approval", "the table changed nothing");
    relay.stop().await;

    // No token at all: reads are served on a loopback listener only.
    let relay = env.start(env.config(REFUND, "").await).await;
    let open = http
        .get(format!("http://{}/v1/actions/{key}", relay.admin()))
        .send()
        .await
        .unwrap();
    assert_eq!(open.status(), 200, "loopback listener without tokens");
    relay.stop().await;
    let text = env
        .config_text(REFUND, "")
        .replace("listen = \"127.0.0.1:0\"", "listen = \"0.0.0.0:0\"");
    let config = Config::from_toml(&text, |_| None).unwrap();
    let relay = env.start(config).await;
    let port = relay.admin().port();
    let closed = http
        .get(format!("http://127.0.0.1:{port}/v1/actions/{key}"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        closed.status(),
        403,
        "a listener on every address without tokens"
    );
    let text = closed.text().await.unwrap();
    assert!(text.contains("IDEM_ADMIN_READ_TOKEN"), "{text}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_named_token_decides_under_its_name() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens");
    std::fs::write(
        &file,
        "# who may approve\nalice:alice-token-for-tests\nbob:bob-token-for-tests\n",
    )
    .unwrap();
    let path = file.to_string_lossy().to_string();
    let text = env.config_text(REFUND, "");
    let config = Config::from_toml(&text, |k| {
        (k == idem::config::ENV_ADMIN_TOKENS_FILE).then(|| path.clone())
    })
    .unwrap();
    idem::db::migrate(&config.postgres).await.unwrap();
    let outcomes = env.outcomes().await;
    let relay = env.start(config).await;
    env.producer()
        .send(&action("e1", refund("r9", "o1", 5, "x")))
        .await;
    outcomes.answer("e1", "pending_approval").await;
    let key = "r9:refund:ticket-7:o1";
    let url = format!("http://{}/v1/actions/{key}/approve", relay.admin());
    let http = reqwest::Client::new();
    let posing = http
        .post(&url)
        .bearer_auth("bob-token-for-tests")
        .json(&json!({"by": "alice", "reason": "ok"}))
        .send()
        .await
        .unwrap();
    assert_eq!(posing.status(), 403, "bob's token cannot decide as alice");
    assert_eq!(common::explain(&env, key).await["approvals"], json!([]));
    let right = http
        .post(&url)
        .bearer_auth("alice-token-for-tests")
        .json(&json!({"reason": "refund is due"}))
        .send()
        .await
        .unwrap();
    assert_eq!(right.status(), 200, "{}", right.text().await.unwrap());
    outcomes.answer("e1", "succeeded").await;
    let e = common::explain(&env, key).await;
    assert_eq!(e["approvals"][0]["by"], "alice", "{e}");
    assert_eq!(env.downstream.total_effects(), 1);
    relay.stop().await;
}

/// Slow or idle clients cannot hold the admin listener: a connection that sends no whole
/// request head (idle keep-alive ones too) is closed after `admin.header_timeout`, and
/// connections past `admin.max_connections` are closed unanswered; a client that behaves is
/// still served once the others are gone.
#[tokio::test(flavor = "multi_thread")]
async fn the_admin_listener_bounds_its_clients() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    let env = Env::new().await;
    let text = env.config_text(REFUND, "").replace(
        "listen = \"127.0.0.1:0\"",
        "listen = \"127.0.0.1:0\"\nheader_timeout = \"1s\"\nmax_connections = 2",
    );
    let config = Config::from_toml(&text, |_| None).unwrap();
    assert_eq!(config.admin.max_connections, 2, "the test's config took");
    idem::db::migrate(&config.postgres).await.unwrap();
    let relay = env.start(config).await;
    let addr = relay.admin();
    const REQUEST: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    // Reads until the server closes; what it sent before closing.
    async fn until_closed(tcp: &mut TcpStream, within: Duration) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = [0u8; 512];
        let read_all = async {
            loop {
                match tcp.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
        };
        tokio::time::timeout(within, read_all)
            .await
            .expect("the server closes the connection");
        got
    }
    // A served request on a kept-alive connection: it holds one of the two places.
    async fn served(addr: std::net::SocketAddr) -> TcpStream {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        tcp.write_all(REQUEST).await.unwrap();
        let mut buf = [0u8; 512];
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(
            buf[..n].starts_with(b"HTTP/1.1 200"),
            "served: {:?}",
            String::from_utf8_lossy(&buf[..n])
        );
        tcp
    }
    let mut first = served(addr).await;
    let mut second = served(addr).await;
    let idle_since = std::time::Instant::now();
    // Both places taken: a whole request on a third connection is closed unanswered.
    let mut third = TcpStream::connect(addr).await.unwrap();
    let _ = third.write_all(REQUEST).await;
    let answer = until_closed(&mut third, Duration::from_secs(5)).await;
    assert!(
        answer.is_empty(),
        "past max_connections: closed unanswered, got {:?}",
        String::from_utf8_lossy(&answer)
    );
    // The idle ones are closed by the header timeout, not at once.
    until_closed(&mut first, Duration::from_secs(10)).await;
    until_closed(&mut second, Duration::from_secs(10)).await;
    assert!(
        idle_since.elapsed() >= Duration::from_millis(900),
        "idle closed by the header timeout: {:?}",
        idle_since.elapsed()
    );
    // Half a request head is closed by the header timeout too.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    let slow_since = std::time::Instant::now();
    slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    until_closed(&mut slow, Duration::from_secs(10)).await;
    assert!(
        slow_since.elapsed() >= Duration::from_millis(900),
        "half a head: {:?}",
        slow_since.elapsed()
    );
    // Their places are back: a client that behaves is served.
    let metrics = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap();
    assert_eq!(metrics.status(), 200);
    relay.stop().await;
}

/// An approval threshold compares a number: `"NaN"` (which compares smaller than anything and
/// would slip under it) and `"1e999"` are `schema_invalid`, nothing executed or recorded; an
/// amount written `50.0` under a key recorded with `50` is the same request (a duplicate, not
/// a conflict).
#[tokio::test(flavor = "multi_thread")]
async fn an_approval_amount_must_be_a_finite_number_and_equal_amounts_are_one() {
    let env = Env::new().await;
    let tool = REFUND.replace(
        "executor =",
        "approval = { field = \"args.amount\", above = 100 }\nverify = { url = \"{downstream}/v1/effects/{key}\" }\nexecutor =",
    );
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(&tool, "").await).await;
    let p = env.producer();
    let with_amount = |order: &str, amount: serde_json::Value| {
        json!({"run_id": "run_nan", "tool": "refund", "business_id": "ticket-7",
               "args": {"order_id": order, "amount": amount}})
    };
    p.send(&action("nan-1", with_amount("o-nan", json!("NaN"))))
        .await;
    p.send(&action("nan-2", with_amount("o-inf", json!("1e999"))))
        .await;
    p.send(&action("nan-3", with_amount("o-ok", json!(50))))
        .await;
    for id in ["nan-1", "nan-2"] {
        let o = outcomes.answer(id, "rejected").await;
        assert_eq!(o["data"]["error"]["code"], "schema_invalid", "{o}");
        assert!(
            o["data"]["error"]["message"]
                .as_str()
                .unwrap()
                .contains("finite number"),
            "{o}"
        );
    }
    outcomes.answer("nan-3", "succeeded").await;
    p.send(&action("nan-4", with_amount("o-ok", json!(50.0))))
        .await;
    let again = outcomes.answer("nan-4", "succeeded").await;
    assert_eq!(again["data"]["duplicate"], true, "{again}");
    assert_eq!(env.downstream.total_effects(), 1);
    relay.stop().await;
}

/// A backlog larger than one batch is worked off batch after batch (paced), each pruned key
/// leaving a tombstone; a stop ends the work between two batches, losing nothing.
#[tokio::test]
async fn a_prune_backlog_goes_in_paced_batches_and_stops_between_them() {
    let env = Env::new().await;
    let config = env.config(LIMITED, "").await;
    let pg = env.pg().await;
    pg.batch_execute(
        "insert into intents (idempotency_key, tool, class, run_id, args, material, fingerprint,
                              args_hash, action_event_id, source_topic, source_partition,
                              source_offset, status, status_seq, created_at, updated_at,
                              finished_at)
         select 'old-' || g || ':send_sms:hi', 'send_sms', 'dangerous', 'old-' || g, '{}', '{}',
                md5('f' || g), md5('a' || g), 'old-evt-' || g, 'old.actions', 0, g,
                'succeeded', 1, now() - interval '9 days', now() - interval '9 days',
                now() - interval '9 days'
           from generate_series(1, 600) g",
    )
    .await
    .unwrap();
    let pool = pool(&env).await;
    let count = |table: &'static str| {
        let pg = &pg;
        async move {
            pg.query_one(&format!("select count(*) from {table}"), &[])
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    // Stopped: the batch under way finishes, the next one never starts.
    let stopped = tokio_util::sync::CancellationToken::new();
    stopped.cancel();
    let first = idem::gates::prune(&pool, &config, &stopped).await.unwrap();
    assert_eq!(first, 250, "one batch");
    assert_eq!(count("intents").await, 350);
    // The rest, over two more batches with a pause after each full one.
    let rest = idem::gates::prune(&pool, &config, &Default::default())
        .await
        .unwrap();
    assert_eq!(rest, 350);
    assert_eq!(count("intents").await, 0);
    assert_eq!(count("tombstones").await, 600, "one tombstone per key");
}
