//! The relay end to end, against the real local Kafka and Postgres, counting effects at a fake
//! downstream that does not dedupe.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::{action, Env};
use rdkafka::message::{Header, OwnedHeaders};
use serde_json::json;

const EMAIL: &str = r#"
[[tools]]
name = "send_email"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.to", "args.template"]
executor = { kind = "http", url = "{downstream}/v1/send_email", timeout = "1s" }
retry = { max_attempts = 3, initial_backoff = "10ms", max_backoff = "50ms" }
# No verify: these tests show what happens when nothing can look downstream.
approval = "none"
"#;

fn email(run: &str, business: &str, subject: &str) -> serde_json::Value {
    json!({"run_id": run, "tool": "send_email", "business_id": business,
           "args": {"to": "customer-1", "template": "refund_approved", "subject": subject}})
}

#[tokio::test]
async fn happy_path_executes_once_and_answers() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(EMAIL, "").await).await;
    env.producer()
        .send(&action("evt-1", email("run_1", "order_1", "Your refund")))
        .await;

    let o = outcomes.answer("evt-1", "succeeded").await;
    assert_eq!(o["type"], "dev.idem.outcome.v1");
    assert_eq!(o["subject"], "run_1:send_email:order_1");
    assert_eq!(o["data"]["duplicate"], false);
    assert_eq!(o["data"]["attempts"], 1);
    assert_eq!(o["data"]["result"]["key"], "run_1:send_email:order_1");
    assert!(
        o["data"]["note"].as_str().unwrap().starts_with("Done at"),
        "{o}"
    );
    assert_eq!(env.downstream.effects("run_1:send_email:order_1"), 1);
    let m = common::metrics(relay.admin()).await;
    assert_eq!(
        common::sample(
            &m,
            r#"idem_actions_total{status="succeeded",tool="send_email"}"#
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        common::sample(&m, r#"idem_side_effects_total{tool="send_email"}"#),
        1.0
    );
    let ready = reqwest::get(format!("http://{}/readyz", relay.admin()))
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    relay.stop().await;
}

#[tokio::test]
async fn the_same_event_twice_and_a_replay_execute_once() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(EMAIL, "").await).await;
    let p = env.producer();
    let first = action("evt-a", email("run_2", "order_2", "Your refund"));
    p.send(&first).await;
    outcomes.answer("evt-a", "succeeded").await;
    p.send(&first).await; // the producer retried: same event id, new record
    p.send(&action("evt-b", email("run_2", "order_2", "Your refund")))
        .await; // orchestrator replay

    let dup = outcomes.answer("evt-b", "succeeded").await;
    assert_eq!(dup["data"]["duplicate"], true);
    assert_eq!(
        dup["data"]["result"]["id"],
        outcomes.answers("evt-a")[0]["data"]["result"]["id"]
    );
    assert!(
        dup["data"]["note"]
            .as_str()
            .unwrap()
            .contains("not repeated. Do not retry."),
        "{dup}"
    );
    common::eventually_metrics(
        "the producer retry to be counted",
        Duration::from_secs(20),
        relay.admin(),
        |m| {
            common::sample(
                m,
                r#"idem_duplicates_total{origin="producer_retry",tool="send_email"}"#,
            ) == 1.0
                && common::sample(
                    m,
                    r#"idem_duplicates_total{origin="replay",tool="send_email"}"#,
                ) == 1.0
        },
    )
    .await;
    assert_eq!(
        outcomes.answers("evt-a").len(),
        1,
        "a producer retry is not answered again"
    );
    assert_eq!(env.downstream.total_effects(), 1);
    // The first delivery is the intent row's (schema migration 13): `explain` lists it first,
    // with its record, and no deliveries row repeats it.
    let e = common::explain(&env, "run_2:send_email:order_2").await;
    let deliveries = common::delivered(&e);
    assert_eq!(
        deliveries,
        [
            ("evt-a", "first"),
            ("evt-a", "producer_retry"),
            ("evt-b", "replay")
        ],
        "{e:#}"
    );
    assert!(e["deliveries"][0]["offset"].is_i64(), "{e:#}");
    let first_rows: i64 = env
        .pg()
        .await
        .query_one(
            "select count(*) from deliveries where origin = 'first' and intent_id is not null",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        first_rows, 0,
        "a recorded key's first delivery is not a row"
    );
    relay.stop().await;
}

/// An event id reused for an action of another key, its earlier use a key's first delivery:
/// recorded as the key it names (the README's contract on producer retries).
#[tokio::test]
async fn an_event_id_reused_for_another_key_after_a_first_delivery_is_that_keys() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(EMAIL, "").await).await;
    let p = env.producer();
    p.send(&action("evt-r", email("run_r", "order_1", "Your refund")))
        .await;
    outcomes.answer("evt-r", "succeeded").await;
    p.send(&action("evt-r", email("run_r", "order_2", "Your refund")))
        .await;
    common::eventually(
        "both keys answered under the one event id",
        Duration::from_secs(20),
        || async { outcomes.answers("evt-r").len() == 2 },
    )
    .await;
    let keys: std::collections::HashSet<String> = outcomes
        .answers("evt-r")
        .iter()
        .map(|o| o["data"]["idempotency_key"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_eq!(env.downstream.total_effects(), 2);
    relay.stop().await;
}

/// A repeat of a key whose outcome is published is answered straight to Kafka: no outbox row is
/// written or rewritten for it, its delivery says so, and `explain` lists the answer under the
/// id the consumer received.
#[tokio::test]
async fn a_repeat_of_a_published_outcome_is_answered_without_an_outbox_row() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(EMAIL, "").await).await;
    let p = env.producer();
    let key = "run_d:send_email:order_d";
    p.send(&action("evt-d1", email("run_d", "order_d", "Hi")))
        .await;
    outcomes.answer("evt-d1", "succeeded").await;
    let pg = env.pg().await;
    common::outbox_drained(&pg, "the first outcome marked published").await;

    p.send(&action("evt-d2", email("run_d", "order_d", "Hi")))
        .await;
    let dup = outcomes.answer("evt-d2", "succeeded").await;
    assert_eq!(dup["data"]["duplicate"], true);
    assert_eq!(
        dup["data"]["result"],
        outcomes.answers("evt-d1")[0]["data"]["result"]
    );
    let rows: Vec<(String, bool)> = pg
        .query(
            "select payload->'data'->>'action_event_id',
                    not exists (select 1 from outbox_pending p where p.id = o.id)
               from outbox o where kafka_key = $1 order by id",
            &[&key],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        rows,
        [("evt-d1".to_string(), true)],
        "only the first outcome"
    );
    let direct: Option<String> = pg
        .query_one(
            "select direct_status from deliveries where action_event_id = 'evt-d2'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(direct.as_deref(), Some("succeeded"));

    let e = common::explain(&env, key).await;
    let listed: Vec<(String, String, bool)> = e["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                o["event_id"].as_str().unwrap().to_string(),
                o["action_event_id"].as_str().unwrap().to_string(),
                o["direct"] == true,
            )
        })
        .collect();
    let first = outcomes.answers("evt-d1")[0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let answer = dup["id"].as_str().unwrap().to_string();
    assert_eq!(
        listed,
        [
            (first, "evt-d1".into(), false),
            (answer, "evt-d2".into(), true)
        ]
    );
    assert_eq!(env.downstream.total_effects(), 1);
    relay.stop().await;
}

#[tokio::test]
async fn seed_trace_timeout_then_reworded_retry_sends_one_email() {
    let env = Env::new().await;
    let key = "run_3:send_email:order_8812";
    env.downstream.script(
        Some(key),
        vec![idem::fake_downstream::Step::Named(
            "effect_then_timeout".into(),
        )],
    );
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(EMAIL, "").await).await;
    let p = env.producer();
    let mut step4 = email("run_3", "order_8812", "Your refund");
    step4["step"] = json!(4);
    p.send(&action("evt-step4", step4)).await;
    let unknown = outcomes.answer("evt-step4", "unknown").await;
    assert_eq!(unknown["data"]["error"]["code"], "outcome_unknown");
    assert!(
        unknown["data"]["note"]
            .as_str()
            .unwrap()
            .contains("do not retry"),
        "{unknown}"
    );

    // The model rewords the subject and sends again at step 5 with the same business id.
    let mut step5 = email("run_3", "order_8812", "Following up on your refund");
    step5["step"] = json!(5);
    p.send(&action("evt-step5", step5)).await;
    let dup = outcomes.answer("evt-step5", "unknown").await;
    assert_eq!(dup["data"]["duplicate"], true);
    assert_eq!(
        env.downstream.effects(key),
        1,
        "one email, however the model retried"
    );
    let m = common::metrics(relay.admin()).await;
    assert_eq!(
        common::sample(
            &m,
            r#"idem_duplicates_total{origin="model_retry",tool="send_email"}"#
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        common::sample(&m, r#"idem_unknown_outcomes_total{tool="send_email"}"#),
        1.0
    );
    relay.stop().await;
}

#[tokio::test]
async fn material_change_is_a_key_conflict() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(EMAIL, "").await).await;
    let p = env.producer();
    p.send(&action("evt-c1", email("run_4", "order_4", "Hi")))
        .await;
    outcomes.answer("evt-c1", "succeeded").await;
    let mut changed = email("run_4", "order_4", "Hi");
    changed["args"]["to"] = json!("someone-else");
    p.send(&action("evt-c2", changed)).await;
    let r = outcomes.answer("evt-c2", "rejected").await;
    assert_eq!(r["data"]["error"]["code"], "key_conflict");
    assert_eq!(r["data"]["error"]["fields"], json!(["args.to"]));
    assert_eq!(r["data"]["duplicate"], false);
    assert_eq!(env.downstream.total_effects(), 1);
    relay.stop().await;
}

#[tokio::test]
async fn thousand_actions_thirty_percent_duplicates_six_partitions() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(EMAIL, "").await).await;
    let p = env.producer();
    let mut ids = Vec::new();
    let mut keys = HashSet::new();
    let mut sends = Vec::new();
    for i in 0..1000 {
        // 700 distinct keys; the other 300 repeat one of them (replays and rewordings).
        let k = if i < 700 { i } else { (i * 7) % 700 };
        let subject = if i % 2 == 0 {
            "Your refund"
        } else {
            "About your refund"
        };
        let id = format!("evt-{i}");
        keys.insert(format!("run_{}:send_email:order_{k}", k % 13));
        sends.push(action(
            &id,
            email(&format!("run_{}", k % 13), &format!("order_{k}"), subject),
        ));
        ids.push(id);
    }
    for chunk in sends.chunks(100) {
        futures::future::join_all(chunk.iter().map(|e| p.send(e))).await;
    }
    outcomes.answer_all(&ids, Duration::from_secs(120)).await;
    assert_eq!(env.downstream.distinct_keys(), keys.len());
    assert_eq!(
        env.downstream.total_effects(),
        keys.len() as u64,
        "repeated: {:?}",
        env.downstream.repeated_keys()
    );
    let all = outcomes.json();
    let duplicates = all
        .iter()
        .filter(|o| o["data"]["duplicate"] == true)
        .count();
    assert_eq!(duplicates, 300);
    assert!(all.iter().all(|o| o["data"]["status"] == "succeeded"));
    relay.stop().await;
}

/// Repeats recorded while their key's outcome is being written (the batch holding a share lock
/// on the key as the finish waits for it) are answered all the same: none is left waiting.
#[tokio::test]
async fn repeats_racing_their_keys_finish_are_all_answered() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let slow = EMAIL.replace("/v1/send_email", "/v1/send_email?delay_ms=15");
    let relay = env.start(env.config(&slow, "").await).await;
    let p = env.producer();
    let mut ids = Vec::new();
    let mut keys = HashSet::new();
    for round in 0..8 {
        let firsts: Vec<_> = (0..25)
            .map(|k| {
                let business = format!("order_{round}_{k}");
                keys.insert(format!("run_race:send_email:{business}"));
                let id = format!("evt-{round}-{k}-0");
                ids.push(id.clone());
                action(&id, email("run_race", &business, "Your refund"))
            })
            .collect();
        futures::future::join_all(firsts.iter().map(|e| p.send(e))).await;
        // Replays of the same keys every few milliseconds, before, during and after the call
        // and its outcome's commit.
        for wave in 1..=12 {
            let replays: Vec<_> = (0..25)
                .map(|k| {
                    let id = format!("evt-{round}-{k}-{wave}");
                    ids.push(id.clone());
                    action(
                        &id,
                        email("run_race", &format!("order_{round}_{k}"), "Your refund"),
                    )
                })
                .collect();
            futures::future::join_all(replays.iter().map(|e| p.send(e))).await;
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
    }
    outcomes.answer_all(&ids, Duration::from_secs(120)).await;
    assert_eq!(env.downstream.distinct_keys(), keys.len());
    assert_eq!(env.downstream.total_effects(), keys.len() as u64);
    let all = outcomes.json();
    let duplicates = all
        .iter()
        .filter(|o| o["data"]["duplicate"] == true)
        .count();
    assert_eq!(duplicates, ids.len() - keys.len());
    relay.stop().await;
}

#[tokio::test]
async fn bad_input_goes_to_the_dead_letter_topic_with_its_reason() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let dlq = env.dead_letters().await;
    let relay = env
        .start(
            env.config(EMAIL, "")
                .await
                .tap(|c| c.relay.max_message_bytes = 4096),
        )
        .await;
    let p = env.producer();
    let none = OwnedHeaders::new;
    p.send_raw(Some("k"), b"this is not json", none()).await;
    p.send_raw(Some("k"), br#"{"hello": "world"}"#, none())
        .await;
    p.send(&action(
        "evt-bad-schema",
        json!({"run_id": "run_5", "tool": "send_email", "idempotency_key": "k-schema"}),
    ))
    .await;
    p.send(&action(
        "evt-unknown-tool",
        json!({"run_id": "run_5", "tool": "launch_rockets", "args": {}}),
    ))
    .await;
    p.send_raw(Some("k"), &vec![b' '; 5000], none()).await;
    p.send(&action("evt-email-key", json!({"run_id": "run_5", "tool": "send_email", "args": {}, "idempotency_key": "send:ada@example.com"}))).await;
    let binary = OwnedHeaders::new()
        .insert(Header {
            key: "ce_specversion",
            value: Some("1.0"),
        })
        .insert(Header {
            key: "ce_id",
            value: Some("evt-binary-good"),
        })
        .insert(Header {
            key: "ce_source",
            value: Some("agent"),
        })
        .insert(Header {
            key: "ce_type",
            value: Some("dev.idem.action.v1"),
        });
    p.send_raw(
        Some("run_5"),
        &serde_json::to_vec(&email("run_5", "order_5", "Hi")).unwrap(),
        binary,
    )
    .await;

    outcomes.answer("evt-binary-good", "succeeded").await;
    dlq.wait_for("six dead letters", Duration::from_secs(30), |v| {
        v.len() >= 6
    })
    .await;
    // Keyed differently, they land on different partitions: compare as a set.
    let mut reasons: Vec<String> = dlq
        .all()
        .iter()
        .map(|m| m.headers["idem-dlq-reason"].clone())
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            "invalid_key",
            "not_cloudevent",
            "not_json",
            "oversize",
            "schema_invalid",
            "unknown_tool"
        ]
    );
    let all = dlq.all();
    let first = all
        .iter()
        .find(|m| m.headers["idem-dlq-reason"] == "not_json")
        .unwrap();
    assert_eq!(
        first.payload, b"this is not json",
        "the original bytes are kept"
    );
    assert_eq!(first.headers["idem-source-topic"], env.actions);
    assert!(
        first.headers.contains_key("idem-source-offset")
            && first.headers.contains_key("idem-dlq-detail")
    );
    let r = outcomes.answer("evt-unknown-tool", "rejected").await;
    assert_eq!(r["data"]["error"]["code"], "unknown_tool");
    let r = outcomes.answer("evt-bad-schema", "rejected").await;
    assert_eq!(r["data"]["error"]["code"], "schema_invalid");
    assert_eq!(r["data"]["idempotency_key"], "k-schema");
    let r = outcomes.answer("evt-email-key", "rejected").await;
    assert_eq!(r["data"]["error"]["code"], "invalid_key");
    assert_eq!(env.downstream.total_effects(), 1);
    let m = common::metrics(relay.admin()).await;
    assert_eq!(
        common::sample(&m, r#"idem_dead_letters_total{reason="not_json"}"#),
        1.0,
        "{m}"
    );
    relay.stop().await;
}

trait Tap: Sized {
    fn tap(self, f: impl FnOnce(&mut Self)) -> Self;
}

impl<T> Tap for T {
    fn tap(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self
    }
}

#[tokio::test]
async fn a_slow_tool_does_not_delay_a_fast_one() {
    let env = Env::new().await;
    let tools = r#"
[[tools]]
name = "slow_report"
class = "idempotent"
key = ["run_id", "tool", "business_id"]
executor = { kind = "http", url = "{downstream}/v1/slow_report?delay_ms=2000", timeout = "10s" }

[[tools]]
name = "fast_lookup"
class = "idempotent"
key = ["run_id", "tool", "business_id"]
executor = { kind = "http", url = "{downstream}/v1/fast_lookup", timeout = "10s" }
"#;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(tools, "").await).await;
    let p = env.producer();
    for i in 0..5 {
        p.send(&action(&format!("slow-{i}"), json!({"run_id": "r6", "tool": "slow_report", "business_id": format!("s{i}"), "args": {}}))).await;
    }
    p.send(&action(
        "fast-1",
        json!({"run_id": "r6", "tool": "fast_lookup", "business_id": "f1", "args": {}}),
    ))
    .await;
    let all = outcomes
        .wait_for("all six answered", Duration::from_secs(60), |v| {
            v.len() >= 6
        })
        .await;
    let order: Vec<&str> = all
        .iter()
        .map(|o| o["data"]["action_event_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        order[0], "fast-1",
        "the fast tool was answered before any slow one: {order:?}"
    );
    relay.stop().await;
}

const LEDGER: &str = r#"
[[tools]]
name = "ledger_credit"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.amount"]
executor = { kind = "sql", statement = "insert into ledger (idempotency_key, amount) values ($1, $2::numeric) returning id, amount::text as amount", params = ["key", "args.amount"] }
"#;

/// The sql executor's effect commits with its outcome: aborting the relay between a statement
/// and its commit, then replaying every event after the restart, leaves one ledger row per key.
#[tokio::test]
async fn sql_executor_is_exactly_once_across_a_kill() {
    let env = Env::new().await;
    let config_text = env.config_text(LEDGER, "");
    let config = env.config(LEDGER, "").await;
    drop(config);
    let pg = env.pg().await;
    pg.batch_execute("create table ledger (id bigserial primary key, idempotency_key text not null, amount numeric not null)")
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.toml");
    std::fs::write(&path, config_text).unwrap();
    let outcomes = env.outcomes().await;
    let p = env.producer();
    let events: Vec<_> = (0..400)
        .map(|i| action(&format!("l-{i}"), json!({"run_id": "r7", "tool": "ledger_credit", "business_id": format!("b{}", i % 250), "args": {"amount": 10 + i % 250}})))
        .collect();
    // The 21st outcome transaction dies after its statement ran and before it commits: the
    // worst moment for a ledger.
    let mut child = common::Child::spawn(
        &path,
        Some("before-outcome-commit=20*off->return"),
        dir.path().join("1.log"),
    );
    for chunk in events.chunks(50) {
        futures::future::join_all(chunk.iter().map(|e| p.send(e))).await;
    }
    child.exited(Duration::from_secs(60)).await;
    // Statements that ran in transactions that never committed left nothing: every ledger row
    // has its recorded outcome and every recorded success its row.
    let written: i64 = pg
        .query_one("select count(*) from ledger", &[])
        .await
        .unwrap()
        .get(0);
    let recorded: i64 = pg
        .query_one(
            "select count(*) from intents where status = 'succeeded'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(written, recorded);
    assert!(
        written <= 20,
        "{written} rows: the 21st and later rolled back"
    );

    let child = common::Child::spawn(&path, None, dir.path().join("2.log"));
    for chunk in events.chunks(50) {
        futures::future::join_all(chunk.iter().map(|e| p.send(e))).await;
    }
    outcomes
        .wait_for("every event answered", Duration::from_secs(120), |all| {
            let answered: HashSet<&str> = all
                .iter()
                .filter_map(|o| o["data"]["action_event_id"].as_str())
                .collect();
            (0..400).all(|i| answered.contains(format!("l-{i}").as_str()))
        })
        .await;
    let rows: Vec<(String, i64)> = pg
        .query(
            "select idempotency_key, count(*) from ledger group by 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows.len(), 250);
    // The statement's returned row is the result, typed: a bigint stays a number.
    let answer = outcomes
        .answers("l-3")
        .into_iter()
        .find(|o| o["data"]["status"] == "succeeded")
        .unwrap();
    assert!(answer["data"]["result"]["id"].is_i64(), "{answer}");
    assert_eq!(answer["data"]["result"]["amount"], "13");
    let twice: Vec<_> = rows.iter().filter(|(_, n)| *n != 1).collect();
    assert!(twice.is_empty(), "keys written more than once: {twice:?}");
    let statuses: HashMap<String, i64> = pg
        .query("select status, count(*) from intents group by 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(statuses, HashMap::from([("succeeded".to_string(), 250)]));

    // SIGTERM: a graceful stop exits 0.
    let mut child = child;
    child.signal("-TERM");
    let status = child.exited(Duration::from_secs(60)).await;
    assert!(status.success(), "relay exited with {status:?} on SIGTERM");
}

/// The black-box contract: every outcome idem published in a mixed run validates against
/// `schemas/outcome-event.schema.json`, and the actions sent validate against the action schema
/// (checked with Python's `jsonschema`, which this machine kind ships).
#[tokio::test]
async fn published_events_match_the_json_schemas() {
    let env = Env::new().await;
    let tools = format!(
        "{EMAIL}\n{}",
        r#"
[[tools]]
name = "refund"
class = "dangerous"
key = ["run_id", "tool", "business_id", "args.order_id"]
material = ["args.order_id"]
executor = { kind = "http", url = "{downstream}/v1/refund" }
"#
    );
    env.downstream.script(
        Some("run_9:send_email:t"),
        vec![idem::fake_downstream::Step::Named(
            "effect_then_timeout".into(),
        )],
    );
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(&tools, "").await).await;
    let p = env.producer();
    let mut actions = vec![
        action("s-ok", email("run_9", "ok", "Hi")),
        action("s-dup", email("run_9", "ok", "Hi again")),
        action("s-timeout", email("run_9", "t", "Hi")),
        action(
            "s-refund",
            json!({"run_id": "run_9", "tool": "refund", "business_id": "b", "args": {"order_id": "o1"}}),
        ),
        action(
            "s-unknown-tool",
            json!({"run_id": "run_9", "tool": "nope", "args": {}}),
        ),
    ];
    let mut conflict = email("run_9", "ok", "Hi");
    conflict["args"]["to"] = json!("other");
    actions.push(action("s-conflict", conflict));
    actions[0]["traceparent"] = json!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    actions[0]["time"] = json!("2026-12-02T10:00:00Z");
    p.send(&actions[0]).await;
    outcomes.answer("s-ok", "succeeded").await;
    for a in &actions[1..] {
        p.send(a).await;
    }
    for (id, status) in [
        ("s-dup", "succeeded"),
        ("s-timeout", "unknown"),
        ("s-refund", "pending_approval"),
        ("s-unknown-tool", "rejected"),
        ("s-conflict", "rejected"),
    ] {
        outcomes.answer(id, status).await;
    }
    relay.stop().await;

    let dir = tempfile::tempdir().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas");
    for (name, events) in [
        ("outcome-event", outcomes.json()),
        ("action-event", actions),
    ] {
        let file = dir.path().join(format!("{name}.json"));
        std::fs::write(&file, serde_json::to_vec(&events).unwrap()).unwrap();
        let script = "import json, sys, jsonschema\n\
schema = json.load(open(sys.argv[1]))\n\
events = json.load(open(sys.argv[2]))\n\
v = jsonschema.Draft202012Validator(schema)\n\
bad = [(e.get('id'), err.message) for e in events for err in v.iter_errors(e)]\n\
print(len(events), 'events,', len(bad), 'invalid')\n\
[print(b) for b in bad]\n\
sys.exit(1 if bad or not events else 0)\n";
        let out = tokio::process::Command::new("python3")
            .args([
                "-c",
                script,
                root.join(format!("{name}.schema.json")).to_str().unwrap(),
                file.to_str().unwrap(),
            ])
            .output()
            .await
            .expect("python3 runs");
        common::assert_succeeded(name, &out);
    }
}

/// An outcome event the producer refuses for good (here larger than the producer's 1 MB
/// message limit, as a bug elsewhere could write) is quarantined with the reason, and the
/// outcome events after it are published (issue 12: one bad row held every row behind it).
#[tokio::test]
async fn an_outbox_row_the_producer_refuses_is_quarantined_and_the_rest_go_out() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let config = env.config(EMAIL, "").await;
    let pg = env.pg().await;
    let huge = json!({"data": {"blob": "x".repeat(1_500_000)}});
    insert_outbox_row(&pg, "poison", "k", &huge).await;
    let relay = env.start(config).await;
    env.producer()
        .send(&action("after", email("rq", "b1", "hello")))
        .await;
    outcomes.answer("after", "succeeded").await;
    common::eventually(
        "the refused row to be quarantined",
        Duration::from_secs(30),
        || async {
            let row = pg
                .query_one(
                    "select quarantined_at is not null, coalesce(quarantine_reason, ''), published_at is null from outbox where event_id = 'poison'",
                    &[],
                )
                .await
                .unwrap();
            row.get::<_, bool>(0)
                && row.get::<_, String>(1).contains("too large")
                && row.get::<_, bool>(2)
        },
    )
    .await;
    let m = common::metrics(relay.admin()).await;
    assert!(
        m.lines().any(|l| l == "idem_outbox_quarantined_total 1"),
        "{m}"
    );
    relay.stop().await;
}

/// Unpublished outbox rows are queued by id (schema migration 9) whoever writes them. A row
/// written before the queue existed is queued by the migration and published once; a queued
/// row that a relay of the previous version published meanwhile (it marks `published_at` and
/// knows nothing of the queue) leaves the queue without going out again.
#[tokio::test]
async fn outbox_rows_from_before_the_queue_or_published_by_an_older_relay_go_out_once() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let config = env.config(EMAIL, "").await;
    let pg = env.pg().await;
    // The schema as migration 8 left it, and a row written then.
    pg.batch_execute(
        "drop table outbox_pending;
         drop function outbox_pending_add() cascade;
         delete from idem_schema_versions where version = 9",
    )
    .await
    .unwrap();
    insert_outcome(&pg, "before", "k1").await;
    idem::db::migrate(&config.postgres).await.expect("migrate");
    // Written after, and published by an older relay before this one starts.
    insert_outcome(&pg, "older", "k2").await;
    assert_eq!(
        queued(&pg).await,
        2,
        "both rows queued, by the migration and by the trigger"
    );
    pg.execute(
        "update outbox set published_at = '2020-01-01Z' where event_id = 'o-older'",
        &[],
    )
    .await
    .unwrap();

    let relay = env.start(config).await;
    env.producer()
        .send(&action("after", email("rq", "b1", "hello")))
        .await;
    outcomes.answer("before", "succeeded").await;
    outcomes.answer("after", "succeeded").await;
    common::eventually("the queue emptied", Duration::from_secs(30), || async {
        queued(&pg).await == 0
    })
    .await;
    assert_eq!(outcomes.answers("before").len(), 1);
    let marked: String = pg
        .query_one(
            "select published_at::date::text from outbox where event_id = 'o-older'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        marked, "2020-01-01",
        "a row published by an older relay went out again"
    );
    assert!(outcomes.answers("older").is_empty());
    relay.stop().await;
}

/// A backlog that is a large share of the outbox (Kafka was down for a while) does not make
/// the publisher walk the published rows: its read starts from the queue whatever the planner
/// estimates. Read by a plan that scans the outbox by id and probes the queue for each row, as
/// a generic plan does once the queue holds about a quarter of the outbox, every round read
/// all 20,000 published rows before reaching a queued one.
#[tokio::test]
async fn a_backlog_is_read_from_the_queue_not_by_walking_the_published_rows() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let config = env.config(EMAIL, "").await;
    let pg = env.pg().await;
    // Outcomes sized like a real one's (a result of 600 bytes): with narrow rows the
    // planner's estimates keep starting from the queue.
    pg.batch_execute(
        r#"create temporary table outcome as
             select jsonb_build_object('data', jsonb_build_object(
                      'status', 'succeeded', 'result', repeat('x', 600))) as payload;
           insert into outbox (event_id, kafka_key, payload)
             select 'old-' || g, 'k' || g, payload
               from generate_series(1, 20000) g, outcome;
           update outbox set published_at = now();
           delete from outbox_pending;
           insert into outbox (event_id, kafka_key, payload)
             select 'backlog-' || g, 'b' || g, payload
               from generate_series(1, 10000) g, outcome;
           analyze outbox, outbox_pending;
           select pg_stat_force_next_flush()"#,
    )
    .await
    .unwrap();
    // This connection's own statistics were reported as it went idle (forced), so what is
    // counted from here on is the relay's.
    let (dequeued_before, read_before) = counted(&pg).await;
    let relay = env.start(config).await;
    common::eventually("the backlog published", Duration::from_secs(60), || async {
        queued(&pg).await == 0
    })
    .await;
    // Each round's read and its dequeue are one transaction, so once its statistics show every
    // dequeue (a backend reports them within seconds of going idle), they show every read too.
    common::eventually(
        "the publisher's statistics reported",
        Duration::from_secs(30),
        || async { counted(&pg).await.0 - dequeued_before >= 10_000 },
    )
    .await;
    let read = counted(&pg).await.1 - read_before;
    assert!(
        read < 40_000,
        "the publisher read {read} outbox index entries for 10,000 queued rows: it walked the published ones"
    );
    let all = outcomes
        .wait_for(
            "the backlog on the outcomes topic",
            Duration::from_secs(30),
            |all| all.len() >= 10_000,
        )
        .await;
    let keys: std::collections::HashSet<String> =
        outcomes.all().into_iter().filter_map(|c| c.key).collect();
    assert_eq!(all.len(), 10_000, "published rows went out again");
    assert!((1..=10_000).all(|g| keys.contains(&format!("b{g}"))));
    relay.stop().await;
}

/// A queued id whose outbox row is gone (deleted by hand, or pruned before any relay that knows
/// the queue met it) leaves the queue and holds nothing up: the publisher reads the queue's
/// oldest ids first, and 1,500 such ids at its head would otherwise fill every round.
#[tokio::test]
async fn queued_ids_without_an_outbox_row_leave_the_queue_and_hold_nothing_up() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let config = env.config(EMAIL, "").await;
    let pg = env.pg().await;
    pg.batch_execute("insert into outbox_pending (id) select -g from generate_series(1, 1500) g")
        .await
        .unwrap();
    insert_outcome(&pg, "after", "k1").await;
    let relay = env.start(config).await;
    outcomes.answer("after", "succeeded").await;
    common::eventually("the queue emptied", Duration::from_secs(30), || async {
        queued(&pg).await == 0
    })
    .await;
    relay.stop().await;
}

/// A key's outcomes go out in the order they were written. A publishing round skips the queued
/// rows another round holds (another relay's, or this relay's other publisher's, from taking a
/// row until its commit; a send that failed puts its row back there); it must then hold back
/// the later rows of the same keys too, or a repeat's answer, written behind the outcome it
/// repeats, goes out before it. Here a transaction holds k1's first outcome as such a round
/// would: the relay's round publishes k2's and leaves k1's second queued, and once the first is
/// let go both go out, first then second.
#[tokio::test]
async fn a_keys_later_outcome_waits_while_another_round_holds_its_earlier_one() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let config = env.config(EMAIL, "").await;
    let pg = env.pg().await;
    insert_outcome(&pg, "first", "k1").await;
    insert_outcome(&pg, "other", "k2").await;
    insert_outcome(&pg, "second", "k1").await;
    let holder = env.pg().await;
    holder
        .batch_execute(
            "begin;
             select p.id from outbox_pending p join outbox o on o.id = p.id
              where o.event_id = 'o-first'
                for update of p",
        )
        .await
        .unwrap();
    let relay = env.start(config).await;
    outcomes.answer("other", "succeeded").await;
    // The round that published k2's outcome read k1's second as well (the queue's head): it
    // leaves the queue with k2's in that round's commit if it was sent.
    common::eventually(
        "k2's outcome out of the queue",
        Duration::from_secs(30),
        || async { !is_queued(&pg, "o-other").await },
    )
    .await;
    assert!(
        is_queued(&pg, "o-second").await && outcomes.answers("second").is_empty(),
        "k1's second outcome went out while its first was held: {:?}",
        outcomes.answers("second")
    );
    let m = common::metrics(relay.admin()).await;
    assert!(common::sample(&m, "idem_outbox_held_back_total") >= 1.0);
    holder.batch_execute("rollback").await.unwrap();
    outcomes.answer("second", "succeeded").await;
    let k1: Vec<String> = outcomes
        .all()
        .iter()
        .filter(|c| c.key.as_deref() == Some("k1"))
        .map(|c| c.json()["data"]["action_event_id"].to_string())
        .collect();
    assert_eq!(
        k1,
        [r#""first""#, r#""second""#],
        "k1's outcomes in topic order"
    );
    relay.stop().await;
}

/// Whether the outbox row of `event_id` waits in the queue.
async fn is_queued(pg: &tokio_postgres::Client, event_id: &str) -> bool {
    pg.query_one(
        "select exists (select 1 from outbox_pending p join outbox o on o.id = p.id
                         where o.event_id = $1)",
        &[&event_id],
    )
    .await
    .unwrap()
    .get(0)
}

/// The outbox lag gauges count what waits in the queue and age it by the oldest row still to
/// publish: two rows another transaction holds (so the publisher skips them) show as 2 pending,
/// the older a minute old; once let go they go out and the gauges fall to 0.
#[tokio::test]
async fn the_outbox_lag_gauges_show_what_waits_and_for_how_long() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let config = env.config(EMAIL, "").await;
    let pg = env.pg().await;
    for (event, age) in [("old", "60 s"), ("newer", "30 s")] {
        insert_outcome(&pg, event, event).await;
        pg.execute(
            "update outbox set created_at = now() - $2::text::interval where event_id = $1",
            &[&format!("o-{event}"), &age],
        )
        .await
        .unwrap();
    }
    let holder = env.pg().await;
    holder
        .batch_execute("begin; select id from outbox_pending for update")
        .await
        .unwrap();
    let relay = env.start(config).await;
    let gauges = || async {
        let m = common::metrics(relay.admin()).await;
        (
            common::sample(&m, "idem_outbox_pending"),
            common::sample(&m, "idem_outbox_oldest_age_seconds"),
        )
    };
    common::eventually(
        "2 pending, a minute old",
        Duration::from_secs(30),
        || async {
            let (pending, age) = gauges().await;
            pending == 2.0 && (60.0..120.0).contains(&age)
        },
    )
    .await;
    holder.batch_execute("rollback").await.unwrap();
    outcomes.answer("old", "succeeded").await;
    outcomes.answer("newer", "succeeded").await;
    common::eventually("nothing pending", Duration::from_secs(30), || async {
        gauges().await == (0.0, 0.0)
    })
    .await;
    relay.stop().await;
}

/// Publishing an outcome writes nothing to its outbox row: the queue's delete is the mark. The
/// row is wide (the outcome, ~700 bytes with its indexes' entries) and an update of it was not
/// HOT, so a mark rewrote it and added an entry to each of its indexes.
#[tokio::test]
async fn publishing_leaves_the_outbox_row_as_written() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let config = env.config(EMAIL, "").await;
    let pg = env.pg().await;
    for n in 0..50 {
        insert_outcome(&pg, &format!("w{n}"), &format!("k{n}")).await;
    }
    let versions = || async {
        pg.query(
            "select event_id, xmin::text, ctid::text from outbox order by id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect::<Vec<(String, String, String)>>()
    };
    let written = versions().await;
    let relay = env.start(config).await;
    outcomes
        .wait_for("the 50 outcomes", Duration::from_secs(30), |all| {
            all.len() >= 50
        })
        .await;
    common::eventually("the queue emptied", Duration::from_secs(30), || async {
        queued(&pg).await == 0
    })
    .await;
    let now = versions().await;
    let rewritten: Vec<&String> = written
        .iter()
        .zip(&now)
        .filter(|(w, n)| w != n)
        .map(|(w, _)| &w.0)
        .collect();
    assert_eq!(now.len(), written.len());
    assert!(rewritten.is_empty(), "outbox rows rewritten: {rewritten:?}");
    relay.stop().await;
}

/// The outcomes a finish commits are handed to the publisher in memory: the finish sends no
/// NOTIFY, and the publisher does not wait for a poll. With the queue's poll an hour apart and
/// a listener on the outbox's channel, twenty actions are answered and no notification comes;
/// then a conflict, which the consumer writes to the outbox, still wakes the publisher by one.
#[tokio::test]
async fn a_finishs_outcomes_go_out_without_a_notify_or_a_poll() {
    use futures::StreamExt;
    use std::sync::{Arc, Mutex};
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let mut config = env.config(EMAIL, "").await;
    config.relay.outbox_poll_interval = Duration::from_secs(3600);
    let pg_config: tokio_postgres::Config = common::postgres_url().parse().unwrap();
    let (listener, mut connection) = pg_config.connect(tokio_postgres::NoTls).await.unwrap();
    let notified = Arc::new(Mutex::new(0usize));
    let counter = notified.clone();
    tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            if let tokio_postgres::AsyncMessage::Notification(_) = m {
                *counter.lock().unwrap() += 1;
            }
        }
    });
    listener
        .batch_execute(&format!("listen idem_outbox_{}", env.schema))
        .await
        .unwrap();
    let relay = env.start(config).await;
    let p = env.producer();
    let ids: Vec<String> = (0..20).map(|n| format!("evt-h{n}")).collect();
    for (n, id) in ids.iter().enumerate() {
        p.send(&action(id, email("run_h", &format!("order_{n}"), "Hi")))
            .await;
    }
    let answered = outcomes.answer_all(&ids, Duration::from_secs(30)).await;
    assert!(answered.iter().all(|o| o["data"]["status"] == "succeeded"));
    // A notification sent before this statement is delivered ahead of its answer.
    listener.batch_execute("select 1").await.unwrap();
    assert_eq!(*notified.lock().unwrap(), 0, "the finishes sent a NOTIFY");
    common::outbox_drained(&env.pg().await, "the handed rows dequeued").await;

    let mut changed = email("run_h", "order_0", "Hi");
    changed["args"]["to"] = json!("someone-else");
    p.send(&action("evt-h-conflict", changed)).await;
    let conflict = outcomes.answer("evt-h-conflict", "rejected").await;
    assert_eq!(conflict["data"]["error"]["code"], "key_conflict");
    listener.batch_execute("select 1").await.unwrap();
    assert_eq!(
        *notified.lock().unwrap(),
        1,
        "the conflict's outbox row notified"
    );
    assert_eq!(env.downstream.total_effects(), 20);
    relay.stop().await;
}

/// An outcome read back from the queue (a conflict's answer: the consumer writes it to the
/// outbox, and a round that reads the queue sends it) goes out as compact as one handed over,
/// with its CloudEvents attributes in its headers, though Postgres stores it as `jsonb` and
/// writes it back with a space after every `:` and `,`.
#[tokio::test]
async fn an_outcome_read_back_from_the_queue_goes_out_compact_with_its_headers() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(EMAIL, "").await).await;
    let p = env.producer();
    p.send(&action(
        "evt-q1",
        email("run_q", "order_q", "Hi, there: twice"),
    ))
    .await;
    outcomes.answer("evt-q1", "succeeded").await;
    let mut changed = email("run_q", "order_q", "Hi, there: twice");
    changed["args"]["to"] = json!("someone-else");
    p.send(&action("evt-q2", changed)).await;
    outcomes.answer("evt-q2", "rejected").await;
    let conflict = answering(&outcomes, "evt-q2");
    let body = conflict.json();
    assert_eq!(body["data"]["error"]["code"], "key_conflict", "{body}");
    let sent = String::from_utf8(conflict.payload.clone()).unwrap();
    assert_eq!(
        sent.len(),
        serde_json::to_string(&body).unwrap().len(),
        "no space between tokens: {sent}"
    );
    headers_repeat_the_attributes(&conflict);
    relay.stop().await;
}

/// The outcome collected that answers `action_event_id`.
fn answering(outcomes: &common::Collector, action_event_id: &str) -> common::Collected {
    outcomes
        .all()
        .into_iter()
        .find(|c| c.json()["data"]["action_event_id"] == action_event_id)
        .unwrap_or_else(|| panic!("no outcome answers {action_event_id}"))
}

/// An outcome's `ce_*` headers are its CloudEvents attributes, each present.
fn headers_repeat_the_attributes(outcome: &common::Collected) {
    let body = outcome.json();
    for (header, attribute) in [
        ("ce_id", "id"),
        ("ce_type", "type"),
        ("ce_source", "source"),
        ("ce_subject", "subject"),
        ("ce_specversion", "specversion"),
    ] {
        assert!(body[attribute].is_string(), "{attribute}: {body}");
        assert_eq!(
            outcome.headers.get(header).map(String::as_str),
            body[attribute].as_str(),
            "{header}"
        );
    }
}

/// Two relays on one schema, one reading the queue every few milliseconds: the rows the other
/// hands to its publisher are there for both, and each outcome still goes out once.
#[tokio::test]
async fn a_handed_row_and_another_relays_poll_publish_it_once() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let handing = env.config(EMAIL, "").await;
    let mut polling = env.config(EMAIL, "").await;
    polling.relay.outbox_poll_interval = Duration::from_millis(1);
    polling.relay.instance_id = "poller".into();
    let a = env.start(handing).await;
    let b = env.start(polling).await;
    let p = env.producer();
    let ids: Vec<String> = (0..300).map(|n| format!("evt-r{n}")).collect();
    for (n, id) in ids.iter().enumerate() {
        p.send(&action(id, email("run_r", &format!("order_{n}"), "Hi")))
            .await;
    }
    outcomes.answer_all(&ids, Duration::from_secs(60)).await;
    common::outbox_drained(&env.pg().await, "every outcome out").await;
    let mut sent: HashMap<String, usize> = HashMap::new();
    for o in outcomes.json() {
        *sent
            .entry(o["id"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    let twice: Vec<_> = sent.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "outcomes published more than once: {twice:?}"
    );
    assert_eq!(sent.len(), 300);
    assert_eq!(env.downstream.total_effects(), 300);
    a.stop().await;
    b.stop().await;
}

/// An outcomes topic that takes smaller record batches than the producer makes
/// (`max.message.bytes` 2,000 bytes, against librdkafka's 1,000,000): the broker refuses a whole
/// batch that is too large, every outcome in it with "message size too large", though each
/// would fit alone. The relay sizes its batches to the topic, so every outcome goes out and none
/// is quarantined for a batch it was merely part of; one row too large for the topic on its own
/// is quarantined alone.
#[tokio::test]
async fn an_outcomes_topic_with_a_small_batch_limit_gets_every_outcome() {
    let env = Env::new().await;
    make_topics(&env, 6, ("max.message.bytes", "2000")).await;
    let outcomes = env.outcomes().await;
    let config = env.config(EMAIL, "").await;
    let pg = env.pg().await;
    let big = json!({"id": "o-big", "data": {"blob": "x".repeat(3_000)}});
    insert_outbox_row(&pg, "o-big", "k-big", &big).await;
    let relay = env.start(config).await;
    let p = env.producer();
    let ids: Vec<String> = (0..200).map(|n| format!("evt-b{n}")).collect();
    for (n, id) in ids.iter().enumerate() {
        p.send(&action(id, email("run_b", &format!("order_{n}"), "Hi")))
            .await;
    }
    // (the big row quarantined, others quarantined)
    let quarantined = || async {
        let row = pg
            .query_one(
                "select count(*) filter (where event_id = 'o-big'
                                           and quarantine_reason like '%too large%'),
                        count(*) filter (where event_id <> 'o-big')
                   from outbox where quarantined_at is not null",
                &[],
            )
            .await
            .unwrap();
        (row.get::<_, i64>(0), row.get::<_, i64>(1))
    };
    let answered = || {
        let all: HashSet<String> = outcomes
            .json()
            .iter()
            .filter_map(|o| o["data"]["action_event_id"].as_str().map(str::to_string))
            .collect();
        ids.iter().filter(|id| all.contains(*id)).count()
    };
    common::eventually(
        "every action answered and the big row quarantined, or another outcome quarantined",
        Duration::from_secs(60),
        || async {
            let (big, others) = quarantined().await;
            (answered() == ids.len() && big == 1) || others > 0
        },
    )
    .await;
    assert_eq!(
        quarantined().await,
        (1, 0),
        "(the big row, other outcomes) quarantined"
    );
    assert_eq!(answered(), ids.len());
    assert_eq!(env.downstream.total_effects(), 200);
    relay.stop().await;
}

/// A finish's outcome the producer refuses on the path that hands rows over in memory (the poll
/// an hour apart, so nothing else can send it): the outcome is quarantined, its id leaves the
/// queue for good rather than being put back and refused again, and the outcomes handed over
/// with it go out. The outcomes topic takes 1,200 bytes, so the relay's producer does too; an
/// action whose key, run and event id are long makes an outcome above that.
#[tokio::test]
async fn a_handed_outcome_the_producer_refuses_is_quarantined_and_the_rest_go_out() {
    let env = Env::new().await;
    make_topics(&env, 6, ("max.message.bytes", "1200")).await;
    let outcomes = env.outcomes().await;
    let mut config = env.config(EMAIL, "").await;
    config.relay.outbox_poll_interval = Duration::from_secs(3600);
    let pg = env.pg().await;
    let relay = env.start(config).await;
    let p = env.producer();
    let ids: Vec<String> = (0..20).map(|n| format!("evt-q{n}")).collect();
    let long_id = format!("evt-q-long-{}", "e".repeat(240));
    let long_run = format!("run_q_{}", "r".repeat(110));
    for (n, id) in ids.iter().enumerate() {
        p.send(&action(id, email("run_q", &format!("order_{n}"), "Hi")))
            .await;
        if n == 10 {
            let long = email(&long_run, &format!("order_{}", "b".repeat(110)), "Hi");
            p.send(&action(&long_id, long)).await;
        }
    }
    let answered = outcomes.answer_all(&ids, Duration::from_secs(30)).await;
    assert!(answered.iter().all(|o| o["data"]["status"] == "succeeded"));
    let quarantined = || async {
        pg.query(
            "select payload::text, quarantine_reason from outbox where quarantined_at is not null",
            &[],
        )
        .await
        .unwrap()
    };
    common::eventually(
        "the long outcome quarantined",
        Duration::from_secs(30),
        || async { !quarantined().await.is_empty() },
    )
    .await;
    let rows = quarantined().await;
    assert_eq!(rows.len(), 1, "only the long outcome is quarantined");
    let (payload, reason): (String, String) = (rows[0].get(0), rows[0].get(1));
    assert!(
        payload.contains(&long_id) && payload.len() > 1200,
        "{payload}"
    );
    assert!(reason.contains("too large"), "{reason}");
    common::outbox_drained(&pg, "the refused row not put back").await;
    let refused: serde_json::Value = serde_json::from_str(&payload).unwrap();
    assert!(
        !outcomes.json().iter().any(|o| o["id"] == refused["id"]),
        "the refused outcome reached the topic"
    );
    let m = common::metrics(relay.admin()).await;
    assert!(
        m.lines().any(|l| l == "idem_outbox_quarantined_total 1"),
        "{m}"
    );
    assert_eq!(env.downstream.total_effects(), 21);
    relay.stop().await;
}

/// Makes the test's topics by hand, one replica each: actions with `action_partitions`, outcomes
/// with 6 and one topic setting, dead letters with 1.
async fn make_topics(env: &Env, action_partitions: i32, outcomes_setting: (&str, &str)) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", common::brokers())
        .create()
        .unwrap();
    let one = || TopicReplication::Fixed(1);
    let (name, value) = outcomes_setting;
    let topics = [
        NewTopic::new(&env.actions, action_partitions, one()),
        NewTopic::new(&env.outcomes, 6, one()).set(name, value),
        NewTopic::new(&env.dlq, 1, one()),
    ];
    for r in admin
        .create_topics(&topics, &AdminOptions::new())
        .await
        .unwrap()
    {
        r.unwrap();
    }
}

/// Writes the outbox row of a `succeeded` outcome answering `event`, its id `o-{event}`.
async fn insert_outcome(pg: &tokio_postgres::Client, event: &str, key: &str) {
    let id = format!("o-{event}");
    let outcome = json!({"id": id, "data": {"action_event_id": event, "status": "succeeded"}});
    insert_outbox_row(pg, &id, key, &outcome).await;
}

/// Writes an outbox row as a relay would (or a bug elsewhere could).
async fn insert_outbox_row(
    pg: &tokio_postgres::Client,
    event_id: &str,
    key: &str,
    payload: &serde_json::Value,
) {
    pg.execute(
        "insert into outbox (event_id, kafka_key, payload) values ($1, $2, $3)",
        &[&event_id, &key, payload],
    )
    .await
    .unwrap();
}

/// Rows deleted from the queue, and entries read from the outbox's primary key, by every
/// backend that has reported its statistics.
async fn counted(pg: &tokio_postgres::Client) -> (i64, i64) {
    let row = pg
        .query_one(
            "select (select n_tup_del from pg_stat_user_tables
                      where relid = 'outbox_pending'::regclass),
                    (select idx_tup_read from pg_stat_user_indexes
                      where indexrelid = 'outbox_pkey'::regclass)",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// Outbox rows queued for the publisher.
async fn queued(pg: &tokio_postgres::Client) -> i64 {
    pg.query_one("select count(*) from outbox_pending", &[])
        .await
        .unwrap()
        .get(0)
}

const SLOW_SQL: &str = r#"
[[tools]]
name = "slow_sql"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
executor = { kind = "sql", statement = "select pg_sleep(3), $1::text as key", params = ["key"], timeout = "10s" }

[[tools]]
name = "too_slow_sql"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
executor = { kind = "sql", statement = "select pg_sleep(30), $1::text as key", params = ["key"], timeout = "500ms" }
"#;

/// Slow sql statements can never take every connection of the data path: with a pool of 4
/// and 8 slow statements wanted at once, an http action sent meanwhile is recorded, called and
/// answered while they still run. A statement past its tool's timeout is cancelled and the
/// action `failed` with SQLSTATE 57014.
#[tokio::test]
async fn sql_tools_never_take_the_whole_pool_and_are_bounded_by_their_timeout() {
    let env = Env::new().await;
    let tools = format!("{EMAIL}\n{SLOW_SQL}");
    let text = env
        .config_text(&tools, "")
        .replace("pool_size = 8", "pool_size = 4");
    env.config(&tools, "").await; // migrates
    let config = idem::config::Config::from_toml(&text, |_| None).unwrap();
    let outcomes = env.outcomes().await;
    let relay = env.start(config).await;
    let p = env.producer();
    let slow: Vec<String> = (0..8).map(|i| format!("slow-{i}")).collect();
    for id in &slow {
        p.send(&action(
            id,
            json!({"run_id": "sq", "tool": "slow_sql", "business_id": id, "args": {}}),
        ))
        .await;
    }
    let pg = env.pg().await;
    let sleeping = || async {
        pg.query_one(
            "select count(*) from pg_stat_activity where state = 'active' and query like 'select pg_sleep(3)%'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
    };
    common::eventually(
        "the slow statements to run",
        Duration::from_secs(30),
        || async { sleeping().await >= 1 },
    )
    .await;
    p.send(&action("fast", email("sq", "fast", "hello"))).await;
    outcomes.answer("fast", "succeeded").await;
    assert!(
        sleeping().await >= 1,
        "answered while slow statements were still running"
    );
    assert!(
        sleeping().await <= 2,
        "at most pool_size - 2 statements at once"
    );
    outcomes.answer_all(&slow, Duration::from_secs(60)).await;

    p.send(&action(
        "too-slow",
        json!({"run_id": "sq", "tool": "too_slow_sql", "business_id": "x", "args": {}}),
    ))
    .await;
    let o = outcomes.answer("too-slow", "failed").await;
    assert!(
        o["data"]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("57014"),
        "{o}"
    );
    relay.stop().await;
}

/// A dead letter that cannot be written (here its topic does not exist yet) is tried a bounded
/// number of times; then its batch is rewound, nothing of it recorded, and read again: the
/// offset never passes a message that is neither recorded nor dead-lettered. Once the topic
/// exists, the bad message is dead-lettered and the valid one after it executed once.
#[tokio::test]
async fn a_dead_letter_that_cannot_be_written_rewinds_its_batch_and_loses_nothing() {
    let env = Env::new().await;
    let text = env.config_text(EMAIL, "").replace(
        "partitions = 6",
        "partitions = 6\ncreate_topics = false\nproducer = { \"message.timeout.ms\" = \"1500\", \"topic.metadata.propagation.max.ms\" = \"300\" }",
    );
    env.config(EMAIL, "").await; // migrates
    let config = idem::config::Config::from_toml(&text, |_| None).unwrap();
    let mut without_dlq = config.kafka.clone();
    without_dlq.dlq_topic = format!("{}.unused", env.dlq);
    idem::kafka::ensure_topics(&without_dlq).await.unwrap();
    let outcomes = env.outcomes().await;
    let relay = env.start(config.clone()).await;
    let p = env.producer();
    // The bad message under the valid one's Kafka key (its run id), so both are in one
    // partition, the bad one first: the valid one cannot be recorded until the bad one is
    // dead-lettered. (Under another key, in another partition, it could be read in a batch of
    // its own, recorded and executed while the bad one's partition waits, as it should.)
    p.send_raw(Some("dl"), b"not json at all", OwnedHeaders::new())
        .await;
    p.send(&action("valid", email("dl", "b1", "hello"))).await;
    common::eventually_metrics(
        "a dead letter given up on",
        Duration::from_secs(120),
        relay.admin(),
        |m| common::sample(m, "idem_dead_letters_failed_total") >= 1.0,
    )
    .await;
    assert!(
        outcomes.answers("valid").is_empty(),
        "nothing of the batch recorded"
    );
    assert_eq!(env.downstream.total_effects(), 0);

    idem::kafka::ensure_topics(&config.kafka).await.unwrap();
    let dead = env.dead_letters().await;
    outcomes.answer("valid", "succeeded").await;
    dead.wait_for(
        "the bad message dead-lettered",
        Duration::from_secs(60),
        |all| !all.is_empty(),
    )
    .await;
    assert_eq!(dead.all()[0].payload, b"not json at all".to_vec());
    assert_eq!(env.downstream.total_effects(), 1);
    relay.stop().await;
}

/// A downstream that answers 307 to another host: the redirect is not followed (a re-sent POST
/// could perform the effect somewhere nobody asked for), the action is `failed` with the
/// status, and the other host sees no request.
#[tokio::test]
async fn a_redirect_is_not_followed_and_fails_the_action() {
    let env = Env::new().await;
    let elsewhere = idem::fake_downstream::FakeDownstream::new(false);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let other = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(elsewhere.clone().serve(listener, stop.clone()));
    let key = "run_r:send_email:order_r";
    env.downstream.script(
        Some(key),
        vec![idem::fake_downstream::Step::Redirect {
            status: 307,
            location: format!("http://{other}/v1/send_email"),
        }],
    );
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(EMAIL, "").await).await;
    env.producer()
        .send(&action("evt-r", email("run_r", "order_r", "Your refund")))
        .await;
    let o = outcomes.answer("evt-r", "failed").await;
    assert_eq!(o["data"]["error"]["code"], "downstream_rejected", "{o}");
    assert_eq!(o["data"]["error"]["retryable"], false);
    assert!(
        o["data"]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("307"),
        "{o}"
    );
    assert_eq!(o["data"]["attempts"], 1, "a redirect is not retried");
    assert_eq!(env.downstream.requests(), 1);
    assert_eq!(env.downstream.effects(key), 0);
    assert_eq!(elsewhere.requests(), 0, "the redirect was followed");
    relay.stop().await;
    stop.cancel();
}

/// A downstream that performs the effect and then streams a 50 MiB answer: the relay reads
/// no more than its result cap, drops the connection, and records the success with the
/// answer's size instead of its body (the relay's memory is not the downstream's to fill).
#[tokio::test]
async fn an_endless_answer_is_cut_at_the_cap_and_the_success_kept() {
    let env = Env::new().await;
    let key = "run_s:send_email:order_s";
    env.downstream.script(
        Some(key),
        vec![idem::fake_downstream::Step::Named(
            "effect_then_stream".into(),
        )],
    );
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(EMAIL, "").await).await;
    env.producer()
        .send(&action("evt-s", email("run_s", "order_s", "Your refund")))
        .await;
    let o = outcomes.answer("evt-s", "succeeded").await;
    let result = &o["data"]["result"];
    assert_eq!(result["truncated"], true, "{o}");
    assert!(result["bytes"].as_u64().unwrap() > 256 * 1024, "{o}");
    assert_eq!(env.downstream.effects(key), 1);
    let streamed = env.downstream.streamed_bytes();
    assert!(
        streamed < 16 << 20,
        "the relay stopped reading near the cap, not after {streamed} bytes"
    );
    relay.stop().await;
}

/// An argument that fills a URL path with `..` (or `.`, or nothing) would point the call at
/// another resource: the action is rejected `invalid_args` before anything is recorded or
/// sent, and the next one with a usable argument runs.
#[tokio::test]
async fn a_path_argument_of_dot_dot_is_rejected_before_the_call() {
    const BY_ORDER: &str = r#"
[[tools]]
name = "send_email"
class = "dangerous"
key = ["run_id", "tool", "args.order"]
executor = { kind = "http", url = "{downstream}/v1/{args.order}", timeout = "1s" }
approval = "none"
"#;
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let dead = env.dead_letters().await;
    let relay = env.start(env.config(BY_ORDER, "").await).await;
    let p = env.producer();
    p.send(&action(
        "evt-dots",
        json!({"run_id": "run_d", "tool": "send_email", "args": {"order": ".."}}),
    ))
    .await;
    // The fake downstream's route is /v1/{tool}: "send_email" as the order reaches it.
    p.send(&action(
        "evt-fine",
        json!({"run_id": "run_d", "tool": "send_email", "args": {"order": "send_email"}}),
    ))
    .await;
    let o = outcomes.answer("evt-dots", "rejected").await;
    assert_eq!(o["data"]["error"]["code"], "invalid_args", "{o}");
    assert!(
        o["data"]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("args.order"),
        "{o}"
    );
    outcomes.answer("evt-fine", "succeeded").await;
    dead.wait_for("the dead letter", Duration::from_secs(30), |all| {
        !all.is_empty()
    })
    .await;
    assert_eq!(
        dead.all()[0]
            .headers
            .get("idem-dlq-reason")
            .map(String::as_str),
        Some("invalid_args")
    );
    assert_eq!(env.downstream.requests(), 1, "only the usable one was sent");
    relay.stop().await;
}

/// Topics the relay creates get the broker's default replication unless
/// `kafka.replication_factor` says otherwise; a factor the cluster cannot meet (2 on the single
/// local broker) is refused by the broker, and the relay says so instead of creating a topic
/// that could lose actions.
#[tokio::test]
async fn topics_get_the_brokers_replication_unless_the_config_names_one() {
    let env = Env::new().await;
    let text = env.config_text(EMAIL, "");
    let config = idem::config::Config::from_toml(&text, |_| None).unwrap();
    assert_eq!(config.kafka.replication_factor, None);
    let mut fresh = config.kafka.clone();
    fresh.actions_topic = format!("{}.rf-default", env.actions);
    fresh.outcomes_topic = format!("{}.rf-default", env.outcomes);
    fresh.dlq_topic = format!("{}.rf-default", env.dlq);
    idem::kafka::ensure_topics(&fresh)
        .await
        .expect("broker-default replication creates the topics");

    let text = text.replace("partitions = 6", "partitions = 6\nreplication_factor = 2");
    let config = idem::config::Config::from_toml(&text, |_| None).unwrap();
    assert_eq!(config.kafka.replication_factor, Some(2));
    let mut two = config.kafka.clone();
    two.actions_topic = format!("{}.rf-two", env.actions);
    two.outcomes_topic = format!("{}.rf-two", env.outcomes);
    two.dlq_topic = format!("{}.rf-two", env.dlq);
    let e = idem::kafka::ensure_topics(&two)
        .await
        .expect_err("one broker cannot hold two replicas");
    assert!(
        format!("{e}").to_lowercase().contains("replication"),
        "the error names the replication factor: {e}"
    );
}

/// At start the relay asks the brokers about its topics: one missing (with `create_topics`
/// off) or whose `min.insync.replicas` refuses every `acks=all` write stops the start, naming
/// the topic and the reason; a partition count other than configured is only a warning.
#[tokio::test]
async fn topics_the_relay_cannot_work_with_stop_the_start() {
    let env = Env::new().await;
    let text = env
        .config_text(EMAIL, "")
        .replace("partitions = 6", "partitions = 6\ncreate_topics = false");
    let config = idem::config::Config::from_toml(&text, |_| None).unwrap();
    assert!(!config.kafka.create_topics, "the test's config took");
    idem::db::migrate(&config.postgres).await.unwrap();
    let start = |config| async move {
        idem::relay::start(config, tokio_util::sync::CancellationToken::new())
            .await
            .err()
            .map(|e| e.to_string())
    };
    let e = start(config.clone())
        .await
        .expect("missing topics stop the start");
    assert!(
        e.contains(&env.actions) && e.contains("does not exist"),
        "{e}"
    );

    // The topics made by hand: actions with 3 partitions (a warning), outcomes with
    // min.insync.replicas = 2 on the one local broker (nothing could be acknowledged).
    make_topics(&env, 3, ("min.insync.replicas", "2")).await;
    let e = start(config.clone())
        .await
        .expect("min.insync.replicas 2 of 1 stops the start");
    assert!(
        e.contains(&env.outcomes) && e.contains("min.insync.replicas is 2 with 1 replica"),
        "{e}"
    );
    assert!(
        !e.contains(&env.actions),
        "partitions are only a warning: {e}"
    );
}

/// A key the producer supplies belongs to its tool: the same key sent to another tool is a
/// `key_conflict` naming `tool`, never a duplicate answered with the first tool's result.
#[tokio::test]
async fn a_producer_key_used_by_another_tool_is_a_conflict() {
    let tools = format!(
        "{EMAIL}{}",
        EMAIL
            .replace("name = \"send_email\"", "name = \"send_sms\"")
            .replace("/v1/send_email", "/v1/send_sms")
    );
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(&tools, "").await).await;
    let p = env.producer();
    let with_key = |tool: &str| {
        json!({"run_id": "run_k", "tool": tool, "idempotency_key": "orch-42",
               "args": {"to": "customer-1", "template": "refund_approved"}})
    };
    p.send(&action("k-email", with_key("send_email"))).await;
    outcomes.answer("k-email", "succeeded").await;
    p.send(&action("k-sms", with_key("send_sms"))).await;
    let o = outcomes.answer("k-sms", "rejected").await;
    assert_eq!(o["data"]["error"]["code"], "key_conflict", "{o}");
    assert_eq!(o["data"]["error"]["fields"], json!(["tool"]), "{o}");
    assert_eq!(env.downstream.total_effects(), 1);
    relay.stop().await;
}

/// A tool with an `input_schema`: arguments outside it are rejected `schema_invalid` before
/// anything is recorded or sent, the answer naming the values at fault (JSON pointers); the
/// next valid call executes. `GET /v1/tools` shows the tool with its schema and MCP hints.
#[tokio::test]
async fn arguments_outside_the_tools_schema_are_rejected_before_anything_runs() {
    let tool = EMAIL.replace(
        "approval = \"none\"",
        r#"approval = "none"
description = "Send one email to a customer."
input_schema = { type = "object", required = ["to", "template"], additionalProperties = false, properties = { to = { type = "string" }, template = { type = "string" }, subject = { type = "string" } } }"#,
    );
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(&tool, "").await).await;
    let p = env.producer();
    let send = |id: &str, business: &str, args: serde_json::Value| {
        action(
            id,
            json!({"run_id": "run_schema", "tool": "send_email", "business_id": business, "args": args}),
        )
    };
    let cases = [
        ("missing", json!({"to": "a"}), "/"),
        ("wrong-type", json!({"to": 5, "template": "t"}), "/to"),
        ("extra", json!({"to": "a", "template": "t", "cc": "b"}), "/"),
    ];
    for (id, args, _) in &cases {
        p.send(&send(id, id, args.clone())).await;
    }
    for (id, _, path) in &cases {
        let o = outcomes.answer(id, "rejected").await;
        assert_eq!(o["data"]["error"]["code"], "schema_invalid", "{o}");
        let fields = o["data"]["error"]["fields"].as_array().unwrap();
        let want = if *path == "/" { "" } else { path };
        assert!(fields.iter().any(|f| f == want), "{id}: {o}");
    }
    p.send(&send("valid", "ok", json!({"to": "a", "template": "t"})))
        .await;
    outcomes.answer("valid", "succeeded").await;
    assert_eq!(env.downstream.total_effects(), 1, "only the valid call ran");
    let pg = env.pg().await;
    let intents: i64 = pg
        .query_one("select count(*) from intents", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(intents, 1, "nothing recorded for the invalid calls");

    let tools: serde_json::Value = reqwest::get(format!("http://{}/v1/tools", relay.admin()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(tools[0]["name"], "send_email");
    assert_eq!(tools[0]["description"], "Send one email to a customer.");
    assert_eq!(
        tools[0]["input_schema"]["required"],
        json!(["to", "template"])
    );
    assert_eq!(tools[0]["annotations"]["destructiveHint"], true);
    relay.stop().await;
}

/// A schema that is not a JSON Schema stops the config load, naming the tool's field.
#[test]
fn an_invalid_input_schema_is_a_config_error() {
    let text = EMAIL
        .replace(
            "approval = \"none\"",
            "approval = \"none\"\ninput_schema = { type = \"no-such-type\" }",
        )
        .replace("{downstream}", "http://127.0.0.1:1");
    let e = idem::config::Config::from_toml(&text, |_| None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tools[0].input_schema") && e.contains("not a valid JSON Schema"),
        "{e}"
    );
}

/// The Kafka side of the contract as the ecosystem writes it: an action framed by Confluent's
/// JSON Schema serializer (zero byte, schema id) is executed like a plain one and its schema id
/// kept with the delivery; a structured event that also carries `ce_*` headers is read from its
/// body; outcome events carry `ce_id`, `ce_type`, `ce_source` and `ce_subject` headers.
#[tokio::test]
async fn framed_and_header_carrying_actions_are_read_and_outcomes_carry_ce_headers() {
    use rdkafka::message::{Header, OwnedHeaders};
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(EMAIL, "").await).await;
    let p = env.producer();
    let framed_event = action("evt-framed", email("run_sr", "order_sr", "hi"));
    let mut framed = vec![0u8, 0, 0, 0, 7];
    framed.extend_from_slice(&serde_json::to_vec(&framed_event).unwrap());
    p.send_raw(Some("run_sr"), &framed, OwnedHeaders::new())
        .await;
    let structured = action("evt-structured", email("run_sr", "order_st", "hi"));
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "content-type",
            value: Some("application/cloudevents+json"),
        })
        .insert(Header {
            key: "ce_specversion",
            value: Some("1.0"),
        })
        .insert(Header {
            key: "ce_id",
            value: Some("not-the-id"),
        });
    p.send_raw(
        Some("run_sr"),
        &serde_json::to_vec(&structured).unwrap(),
        headers,
    )
    .await;
    outcomes.answer("evt-framed", "succeeded").await;
    outcomes.answer("evt-structured", "succeeded").await;
    assert_eq!(env.downstream.total_effects(), 2);

    let e = common::explain(&env, "run_sr:send_email:order_sr").await;
    assert_eq!(e["deliveries"][0]["schema_id"], 7, "{e:#}");
    let answer = answering(&outcomes, "evt-framed");
    headers_repeat_the_attributes(&answer);
    assert_eq!(
        answer.headers.get("content-type").map(String::as_str),
        Some("application/cloudevents+json")
    );
    relay.stop().await;
}
