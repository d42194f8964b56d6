//! Exactly once, proven by killing and faking things at the worst moments. Each test counts
//! side effects at a fake downstream that does not dedupe; the target is exactly one.
//!
//! The relay runs as a child process built with the `failpoints` feature; `FAILPOINTS` makes it
//! abort (as abruptly as kill -9) at a named step boundary.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{action, email_tool, Child, Env};
use idem::fake_downstream::Step;
use serde_json::json;

fn email(run: &str, business: &str) -> serde_json::Value {
    json!({"run_id": run, "tool": "send_email", "business_id": business, "args": {"to": "customer-1", "subject": "Hello"}})
}

fn attempts_of(explained: &serde_json::Value) -> Vec<(String, String, String)> {
    explained["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["kind"].as_str().unwrap().to_string(),
                a["reason"].as_str().unwrap().to_string(),
                a["result"].as_str().unwrap_or("-").to_string(),
            )
        })
        .collect()
}

/// One call in the whole history, and the first attempt of the claim after the interruption is
/// a verification.
fn assert_one_call_then_verified_first(calls: &[(String, String, String)]) {
    assert_eq!(
        calls.iter().filter(|(kind, _, _)| kind == "call").count(),
        1,
        "{calls:?}"
    );
    let recovered = calls.iter().find(|(_, reason, _)| reason == "recovery");
    assert_eq!(
        recovered.map(|(kind, _, _)| kind.as_str()),
        Some("verify"),
        "the next claim's first attempt verifies: {calls:?}"
    );
}

#[tokio::test]
async fn crash_after_the_effect_before_its_record_is_verified_not_repeated() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = common::config_file(&env, dir.path(), &email_tool(true), "").await;
    let outcomes = env.outcomes().await;
    let mut relay = Child::spawn(
        &config,
        Some("before-outcome-commit=return"),
        dir.path().join("1.log"),
    );
    env.producer().send(&action("e1", email("r1", "b1"))).await;
    relay.exited(Duration::from_secs(60)).await;
    assert_eq!(
        env.downstream.total_effects(),
        1,
        "the effect happened before the crash"
    );

    let _relay = Child::spawn(&config, None, dir.path().join("2.log"));
    let o = outcomes.answer("e1", "succeeded").await;
    assert_eq!(
        o["data"]["result"]["id"], "eff_1",
        "the result comes from the verification"
    );
    assert_eq!(env.downstream.total_effects(), 1, "verified, not re-sent");
    let e = common::explain(&env, "r1:send_email:b1").await;
    assert_eq!(
        attempts_of(&e),
        vec![
            ("call".into(), "first".into(), "abandoned".into()),
            ("verify".into(), "recovery".into(), "done".into())
        ]
    );
}

#[tokio::test]
async fn crash_after_the_effect_without_verify_is_parked_unknown_then_resolved() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = common::config_file(&env, dir.path(), &email_tool(false), "").await;
    let outcomes = env.outcomes().await;
    let mut relay = Child::spawn(
        &config,
        Some("before-outcome-commit=return"),
        dir.path().join("1.log"),
    );
    env.producer().send(&action("e1", email("r2", "b1"))).await;
    relay.exited(Duration::from_secs(60)).await;

    let _relay = Child::spawn(&config, None, dir.path().join("2.log"));
    let o = outcomes.answer("e1", "unknown").await;
    assert!(
        o["data"]["note"].as_str().unwrap().contains("do not retry"),
        "{o}"
    );
    // A repeat while parked is answered, not executed.
    env.producer().send(&action("e2", email("r2", "b1"))).await;
    outcomes.answer("e2", "unknown").await;
    assert_eq!(env.downstream.total_effects(), 1, "never twice");

    // A person checks downstream and settles it.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "resolve",
            "--config",
            config.to_str().unwrap(),
            "r2:send_email:b1",
            "--as",
            "succeeded",
            "--by",
            "ops@oncall",
            "--reason",
            "seen in the provider's log",
        ])
        .output()
        .unwrap();
    common::assert_succeeded("idem resolve", &out);
    let done = outcomes.answer("e1", "succeeded").await;
    assert_eq!(done["data"]["result"]["resolved_by"], "ops@oncall");
    let e = common::explain(&env, "r2:send_email:b1").await;
    assert_eq!(e["resolutions"][0]["by"], "ops@oncall");
    assert_eq!(env.downstream.total_effects(), 1);
}

#[tokio::test]
async fn lost_reply_and_fake_error_are_verified_not_resent() {
    let env = Env::new().await;
    env.downstream.script(
        Some("r3:send_email:lost"),
        vec![Step::Named("effect_then_timeout".into())],
    );
    env.downstream.script(
        Some("r3:send_email:err"),
        vec![Step::Named("effect_then_500".into())],
    );
    env.downstream.script(
        Some("r3:send_email:no"),
        vec![Step::Named("fail_500".into())],
    );
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(&email_tool(true), "").await).await;
    let p = env.producer();
    p.send(&action("lost", email("r3", "lost"))).await;
    p.send(&action("err", email("r3", "err"))).await;
    p.send(&action("no", email("r3", "no"))).await;
    for id in ["lost", "err", "no"] {
        outcomes.answer(id, "succeeded").await;
    }
    assert_eq!(env.downstream.effects("r3:send_email:lost"), 1);
    assert_eq!(env.downstream.effects("r3:send_email:err"), 1);
    // 500 with no effect: verify says not done, so it is safely sent again, once. A "not done"
    // before the call's timeout (1s) has passed concludes nothing (the downstream may still be
    // processing it): verification asks again once the deadline is past.
    assert_eq!(env.downstream.effects("r3:send_email:no"), 1);
    let e = common::explain(&env, "r3:send_email:no").await;
    assert_eq!(
        attempts_of(&e),
        vec![
            ("call".into(), "first".into(), "ambiguous".into()),
            (
                "verify".into(),
                "transport_retry".into(),
                "inconclusive".into()
            ),
            ("verify".into(), "transport_retry".into(), "not_done".into()),
            ("call".into(), "transport_retry".into(), "succeeded".into())
        ]
    );
    let m = common::metrics(relay.admin()).await;
    assert_eq!(
        common::sample(
            &m,
            r#"idem_verifications_total{result="done",tool="send_email"}"#
        ),
        2.0,
        "{m}"
    );
    relay.stop().await;
}

#[tokio::test]
async fn replaying_a_finished_run_executes_nothing() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(&email_tool(true), "").await).await;
    let p = env.producer();
    for i in 0..10 {
        p.send(&action(&format!("run-{i}"), email("r4", &format!("b{i}"))))
            .await;
    }
    outcomes
        .wait_for("the run finished", Duration::from_secs(60), |v| {
            v.len() >= 10
        })
        .await;
    // The run resumes from its first checkpoint: every event again, with new event ids.
    for i in 0..10 {
        p.send(&action(
            &format!("resume-{i}"),
            email("r4", &format!("b{i}")),
        ))
        .await;
    }
    for i in 0..10 {
        let o = outcomes.answer(&format!("resume-{i}"), "succeeded").await;
        assert_eq!(o["data"]["duplicate"], true);
    }
    assert_eq!(env.downstream.total_effects(), 10);
    relay.stop().await;
}

#[tokio::test]
async fn redelivery_after_a_crash_before_the_offset_commit_executes_once() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = common::config_file(&env, dir.path(), &email_tool(true), "").await;
    let outcomes = env.outcomes().await;
    let mut relay = Child::spawn(
        &config,
        Some("after-intent-commit=return"),
        dir.path().join("1.log"),
    );
    env.producer().send(&action("e1", email("r5", "b1"))).await;
    relay.exited(Duration::from_secs(60)).await;
    assert_eq!(
        env.downstream.total_effects(),
        0,
        "it died before executing"
    );

    // The restarted relay's admin listener on a known port, to read its counters.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("127.0.0.1:0", &format!("127.0.0.1:{port}"));
    std::fs::write(&config, text).unwrap();
    let _relay = Child::spawn(&config, None, dir.path().join("2.log"));
    outcomes.answer("e1", "succeeded").await;
    let admin: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    common::eventually_metrics(
        "the redelivery counted",
        Duration::from_secs(30),
        admin,
        |m| {
            common::sample(
                m,
                r#"idem_duplicates_total{origin="redelivery",tool="send_email"}"#,
            ) == 1.0
        },
    )
    .await;
    common::eventually(
        "the re-read record logged as a redelivery",
        Duration::from_secs(30),
        || async {
            let e = common::explain(&env, "r5:send_email:b1").await;
            let origins: Vec<String> = e["deliveries"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d["origin"].as_str().unwrap().to_string())
                .collect();
            origins == ["first", "redelivery"]
        },
    )
    .await;
    // The redelivery was recorded before anything could dispatch it, and it is never dispatched.
    assert_eq!(env.downstream.total_effects(), 1);
    assert_eq!(outcomes.answers("e1").len(), 1);
    // The intent was claimed in the batch that recorded it, so the dead relay's claim looks
    // like an interrupted call: it is verified (not done) before the one call.
    let e = common::explain(&env, "r5:send_email:b1").await;
    assert_eq!(
        attempts_of(&e),
        vec![
            ("call".into(), "first".into(), "abandoned".into()),
            ("verify".into(), "recovery".into(), "not_done".into()),
            ("call".into(), "recovery".into(), "succeeded".into()),
        ]
    );
}

/// A repeat of a settled key is answered straight to Kafka, and its offset waits for the
/// acknowledgement. A relay killed after recording the repeat but before sending its answer
/// leaves the record unacknowledged: the next relay reads it again and answers it, under the
/// same event id, and nothing runs twice.
#[tokio::test]
async fn a_crash_before_a_direct_answer_is_sent_answers_it_after_the_restart() {
    a_crash_around_a_direct_answer("before-direct-answers=return").await;
}

/// The same after Kafka acknowledged the answer, before the batch's offsets were stored (the
/// consumer records the next batch meanwhile): the record is read again and answered again,
/// under the same event id.
#[tokio::test]
async fn a_crash_after_a_direct_answer_before_its_offset_is_stored_answers_it_again() {
    a_crash_around_a_direct_answer("after-direct-answers=return").await;
}

async fn a_crash_around_a_direct_answer(failpoint: &str) {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = common::config_file(&env, dir.path(), &email_tool(true), "").await;
    let outcomes = env.outcomes().await;
    let mut relay = Child::spawn(&config, Some(failpoint), dir.path().join("1.log"));
    let p = env.producer();
    p.send(&action("direct-1", email("r9", "b1"))).await;
    outcomes.answer("direct-1", "succeeded").await;
    // The repeat is answered directly only once the first outcome is marked published.
    let pg = env.pg().await;
    common::outbox_drained(&pg, "the first outcome marked published").await;
    p.send(&action("direct-2", email("r9", "b1"))).await;
    relay.exited(Duration::from_secs(60)).await;
    let recorded: Option<String> = pg
        .query_one(
            "select direct_status from deliveries where action_event_id = 'direct-2'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        recorded.as_deref(),
        Some("succeeded"),
        "the repeat was recorded before the crash"
    );

    let _relay = Child::spawn(&config, None, dir.path().join("2.log"));
    let dup = outcomes.answer("direct-2", "succeeded").await;
    assert_eq!(dup["data"]["duplicate"], true);
    common::eventually(
        "the re-read record logged as a redelivery",
        Duration::from_secs(30),
        || async {
            let e = common::explain(&env, "r9:send_email:b1").await;
            // (The first action's record may be read again too, if its offset was stored but
            // not yet committed when the relay died.)
            let origins: Vec<String> = e["deliveries"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["action_event_id"] == "direct-2")
                .map(|d| d["origin"].as_str().unwrap().to_string())
                .collect();
            origins == ["replay", "redelivery"]
        },
    )
    .await;
    assert_eq!(env.downstream.total_effects(), 1);
    assert_eq!(outcomes.answers("direct-1").len(), 1);
    let ids: HashSet<String> = outcomes
        .answers("direct-2")
        .iter()
        .map(|o| o["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids.len(), 1, "every answer to the repeat carries one id");
}

/// Intents are claimed in the transaction that records them. A relay stopped while some wait
/// for a free slot gives those claims back (their calls certainly did not start), so the next
/// relay calls each once, with no verification and no wait for a lease to lapse.
#[tokio::test]
async fn a_stop_gives_back_claims_whose_calls_had_not_started() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let tools = email_tool(true)
        .replace("/v1/send_email\"", "/v1/send_email?delay_ms=2000\"")
        .replace("timeout = \"1s\"", "timeout = \"10s\"")
        + "concurrency = 1\n";
    let config = common::config_file(&env, dir.path(), &tools, "").await;
    let outcomes = env.outcomes().await;
    let mut relay = Child::spawn(&config, None, dir.path().join("1.log"));
    for b in ["b1", "b2", "b3"] {
        env.producer()
            .send(&action(&format!("e-{b}"), email("r9", b)))
            .await;
    }
    let pg = env.pg().await;
    common::eventually(
        "all three recorded and one call started",
        Duration::from_secs(30),
        || async {
            let n: i64 = pg
                .query_one("select count(*) from intents", &[])
                .await
                .unwrap()
                .get(0);
            n == 3 && env.downstream.requests() >= 1
        },
    )
    .await;
    relay.signal("-TERM");
    assert!(relay.exited(Duration::from_secs(30)).await.success());
    // The call in flight at the signal (if the next had started) runs to its end.
    let ran = env.downstream.total_effects();

    let _relay = Child::spawn(&config, None, dir.path().join("2.log"));
    for b in ["b1", "b2", "b3"] {
        outcomes.answer(&format!("e-{b}"), "succeeded").await;
    }
    assert_eq!(env.downstream.total_effects(), 3);
    let mut given_back = 0;
    for b in ["b1", "b2", "b3"] {
        let calls = attempts_of(&common::explain(&env, &format!("r9:send_email:{b}")).await);
        let done = (
            "call".to_string(),
            "first".to_string(),
            "succeeded".to_string(),
        );
        if calls.len() == 2 {
            given_back += 1;
            assert_eq!(
                calls,
                vec![
                    ("call".into(), "first".into(), "not_sent".into()),
                    done.clone()
                ]
            );
        } else {
            assert_eq!(calls, vec![done]);
        }
    }
    assert!(given_back >= 1, "a queued claim was given back");
    assert_eq!(ran + given_back, 3, "every other claim was given back");
}

#[tokio::test]
async fn one_intent_published_eighteen_times_runs_once() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(&email_tool(true), "").await).await;
    let p = env.producer();
    let mut ids = Vec::new();
    // 3 client retries × 3 orchestrator retries × 2 model rewordings.
    for model in 0..2 {
        for orchestrator in 0..3 {
            let id = format!("m{model}-o{orchestrator}");
            let mut data = email("r6", "refund-1");
            data["args"]["subject"] = json!(if model == 0 {
                "Your refund"
            } else {
                "About your refund"
            });
            for _client in 0..3 {
                p.send(&action(&id, data.clone())).await;
            }
            ids.push(id);
        }
    }
    for id in &ids {
        outcomes.answer(id, "succeeded").await;
    }
    assert_eq!(env.downstream.total_effects(), 1);
    let all = outcomes.json();
    assert_eq!(all.len(), 6, "one answer per distinct event id: {all:#?}");
    assert_eq!(
        all.iter()
            .filter(|o| o["data"]["duplicate"] == true)
            .count(),
        5
    );
    common::eventually_metrics(
        "17 repeats counted by origin",
        Duration::from_secs(20),
        relay.admin(),
        |m| {
            let by = |o: &str| {
                common::sample(
                    m,
                    &format!(r#"idem_duplicates_total{{origin="{o}",tool="send_email"}}"#),
                )
            };
            by("producer_retry") == 12.0 && by("replay") + by("model_retry") == 5.0
        },
    )
    .await;
    relay.stop().await;
}

#[tokio::test]
async fn crash_after_the_outcome_commit_or_before_marking_publishes_the_same_id() {
    for failpoint in ["after-outcome-commit", "after-publish-before-mark"] {
        let env = Env::new().await;
        let dir = tempfile::tempdir().unwrap();
        let config = common::config_file(&env, dir.path(), &email_tool(true), "").await;
        let outcomes = env.outcomes().await;
        let mut relay = Child::spawn(
            &config,
            Some(&format!("{failpoint}=return")),
            dir.path().join("1.log"),
        );
        env.producer().send(&action("e1", email("r7", "b1"))).await;
        relay.exited(Duration::from_secs(60)).await;
        let _relay = Child::spawn(&config, None, dir.path().join("2.log"));
        outcomes.answer("e1", "succeeded").await;
        let ids: HashSet<String> = outcomes
            .answers("e1")
            .iter()
            .map(|o| o["id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            ids.len(),
            1,
            "{failpoint}: a republished outcome keeps its id"
        );
        assert_eq!(env.downstream.total_effects(), 1, "{failpoint}");
    }
}

#[tokio::test]
async fn two_relays_one_killed_repeatedly_lose_nothing_and_repeat_nothing() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = common::config_file(&env, dir.path(), &email_tool(true), "").await;
    let outcomes = env.outcomes().await;
    let _steady = Child::spawn(&config, None, dir.path().join("steady.log"));
    let mut flaky = Child::spawn(&config, None, dir.path().join("flaky.log"));
    let p = env.producer();
    let events: Vec<_> = (0..2000)
        .map(|i| {
            action(
                &format!("e{i}"),
                email(&format!("r{}", i % 17), &format!("b{i}")),
            )
        })
        .collect();
    let send = async {
        for chunk in events.chunks(100) {
            futures::future::join_all(chunk.iter().map(|e| p.send(e))).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let chaos = async {
        for round in 0..4 {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            flaky.kill9();
            flaky = Child::spawn(&config, None, dir.path().join(format!("flaky{round}.log")));
        }
    };
    tokio::join!(send, chaos);
    let answers = outcomes
        .wait_for("every action answered", Duration::from_secs(180), |all| {
            let answered: HashSet<&str> = all
                .iter()
                .filter_map(|o| o["data"]["action_event_id"].as_str())
                .collect();
            (0..2000).all(|i| answered.contains(format!("e{i}").as_str()))
        })
        .await;
    // What the answers said (status and error code, counted), for a failure's message: whether
    // actions with no effect were answered as failures or as successes.
    let mut said = std::collections::BTreeMap::<String, usize>::new();
    for a in &answers {
        let status = a["data"]["status"].as_str().unwrap_or("?");
        let error = a["data"]["error"]["code"].as_str().unwrap_or("");
        *said.entry(format!("{status} {error}")).or_default() += 1;
    }
    assert_eq!(
        env.downstream.total_effects(),
        2000,
        "repeated: {:?}; the answers: {said:?}",
        env.downstream.repeated_keys()
    );
    let pg = env.pg().await;
    let open: i64 = pg
        .query_one(
            "select count(*) from intents where status not in ('succeeded')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(open, 0, "every key terminal and succeeded");
}

#[tokio::test]
async fn a_relay_paused_past_its_lease_cannot_record_over_the_new_owner() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let tools = email_tool(true).replace("timeout = \"1s\"", "timeout = \"30s\"");
    let config = common::config_file(&env, dir.path(), &tools, "").await;
    // The call takes 3s: long enough to pause its relay in the middle of it.
    env.downstream.script(
        Some("r8:send_email:b1"),
        vec![Step::Delay { delay_ms: 3000 }],
    );
    let outcomes = env.outcomes().await;
    let paused = Child::spawn(&config, None, dir.path().join("paused.log"));
    env.producer().send(&action("e1", email("r8", "b1"))).await;
    common::eventually(
        "the call to reach the downstream",
        Duration::from_secs(30),
        || async { env.downstream.requests() == 1 },
    )
    .await;
    paused.signal("-STOP");
    // Another relay takes over the expired lease, verifies the effect and records it.
    let _other = Child::spawn(&config, None, dir.path().join("other.log"));
    outcomes.answer("e1", "succeeded").await;
    paused.signal("-CONT");
    common::eventually(
        "the paused relay to notice it lost the lease",
        Duration::from_secs(30),
        || async { paused.log_text().contains("lease lost") },
    )
    .await;
    let statuses: Vec<_> = outcomes
        .answers("e1")
        .iter()
        .map(|o| o["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        statuses.len(),
        1,
        "one status change recorded, the late write refused: {statuses:?}"
    );
    assert_eq!(env.downstream.total_effects(), 1);
    let e = common::explain(&env, "r8:send_email:b1").await;
    assert!(
        attempts_of(&e)
            .iter()
            .any(|(k, _, r)| k == "verify" && r == "done"),
        "{e:#}"
    );
}

/// A claim made at record may wait in the relay's queue. Sent within its lease's margin it needs
/// no re-check (`sends_unfenced`); a relay paused with a claim queued past its lease must re-check
/// it and find it taken, not send it a second time after the relay that took it over did.
#[tokio::test]
async fn a_queued_claim_paused_past_its_lease_is_not_sent_again() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    // One call at a time, so one key's claim queues behind the other's call; a 1 s timeout
    // under the 3 s lease, so a queued claim may be sent unfenced for its first 0.5 s.
    let tools = email_tool(true) + "concurrency = 1\n";
    let config = common::config_file(&env, dir.path(), &tools, "").await;
    let keys = ["r10:send_email:b1", "r10:send_email:b2"];
    for key in keys {
        env.downstream
            .script(Some(key), vec![Step::Delay { delay_ms: 800 }]);
    }
    let outcomes = env.outcomes().await;
    let paused = Child::spawn(&config, None, dir.path().join("paused.log"));
    let pg = env.pg().await;
    let p = env.producer();
    p.send(&action("e-b1", email("r10", "b1"))).await;
    p.send(&action("e-b2", email("r10", "b2"))).await;
    common::eventually(
        "both recorded claimed, one call at the downstream and the other queued",
        Duration::from_secs(30),
        || async {
            let claimed: i64 = pg
                .query_one("select count(*) from intents where status = 'running'", &[])
                .await
                .unwrap()
                .get(0);
            claimed == 2 && env.downstream.requests() == 1
        },
    )
    .await;
    paused.signal("-STOP");
    // Another relay takes both keys over once the lease lapses: it verifies the one called and
    // calls the queued one.
    let other = Child::spawn(&config, None, dir.path().join("other.log"));
    outcomes.answer("e-b1", "succeeded").await;
    outcomes.answer("e-b2", "succeeded").await;
    for key in keys {
        assert_eq!(env.downstream.effects(key), 1, "{key}");
    }
    paused.signal("-CONT");
    // The late result is refused at its finish, and the queued claim at its re-check.
    common::eventually(
        "the paused relay to find both claims lost",
        Duration::from_secs(30),
        || async { paused.log_text().matches("lease lost").count() >= 2 },
    )
    .await;
    drop(other);
    for key in keys {
        assert_eq!(
            env.downstream.effects(key),
            1,
            "{key}: a claim was sent again after it was taken over"
        );
    }
}

/// Issue 12: a relay killed while it verified an ambiguous call sent the effect again. The call
/// ended `ambiguous` and a verification was opened; recovery found no open *call*, released the
/// key without verify, and the next claim called again. Now the attempt log decides: the next
/// claim's first attempt is a verification, and the effect happens once. Killed right before
/// the verification's request, and inside the backoff after an inconclusive one.
#[tokio::test]
async fn a_relay_killed_while_verifying_never_sends_the_effect_again() {
    for failpoint in ["before-verify", "verify-backoff"] {
        let env = Env::new().await;
        let dir = tempfile::tempdir().unwrap();
        let config = common::config_file(&env, dir.path(), &email_tool(true), "").await;
        let key = "r10:send_email:b1";
        // The effect happens and the downstream answers 500; verification is unavailable for
        // a while (inconclusive), then answers.
        env.downstream
            .script(Some(key), vec![Step::Named("effect_then_500".into())]);
        env.downstream.script_verify(
            key,
            vec![
                Step::Status {
                    status: 503,
                    retry_after: None,
                },
                Step::Status {
                    status: 503,
                    retry_after: None,
                },
            ],
        );
        let outcomes = env.outcomes().await;
        let mut relay = Child::spawn(
            &config,
            Some(&format!("{failpoint}=return")),
            dir.path().join("1.log"),
        );
        env.producer().send(&action("e1", email("r10", "b1"))).await;
        relay.exited(Duration::from_secs(60)).await;
        assert_eq!(
            env.downstream.effects(key),
            1,
            "{failpoint}: the call's effect"
        );

        let _relay = Child::spawn(&config, None, dir.path().join("2.log"));
        let o = outcomes.answer("e1", "succeeded").await;
        assert_eq!(o["data"]["result"]["id"], "eff_1", "{failpoint}: {o}");
        assert_eq!(
            env.downstream.effects(key),
            1,
            "{failpoint}: never sent again"
        );
        let calls = attempts_of(&common::explain(&env, key).await);
        assert_one_call_then_verified_first(&calls);
        assert_eq!(
            calls[0],
            ("call".into(), "first".into(), "ambiguous".into()),
            "{failpoint}"
        );
        assert_eq!(
            calls.last().unwrap(),
            &("verify".into(), "recovery".into(), "done".into()),
            "{failpoint}"
        );
    }
}

/// SIGTERM whose grace ends while a call is being verified: the relay leaves it to recovery,
/// and the next relay verifies before anything else. Same promise as a kill.
#[tokio::test]
async fn a_stop_whose_grace_ends_during_verification_never_sends_the_effect_again() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let tools = email_tool(true).replace(
        "max_attempts = 5, backoff = \"50ms\"",
        "max_attempts = 100, backoff = \"100ms\"",
    );
    let config = common::config_file(&env, dir.path(), &tools, "").await;
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("shutdown_grace = \"10s\"", "shutdown_grace = \"300ms\"");
    std::fs::write(&config, text).unwrap();
    let key = "r11:send_email:b1";
    env.downstream
        .script(Some(key), vec![Step::Named("effect_then_500".into())]);
    // Inconclusive for longer than the grace.
    env.downstream.script_verify(
        key,
        (0..15)
            .map(|_| Step::Status {
                status: 503,
                retry_after: None,
            })
            .collect(),
    );
    let outcomes = env.outcomes().await;
    let mut relay = Child::spawn(&config, None, dir.path().join("1.log"));
    env.producer().send(&action("e1", email("r11", "b1"))).await;
    common::eventually(
        "verification to have begun",
        Duration::from_secs(30),
        || async { env.downstream.verifications() >= 2 },
    )
    .await;
    relay.signal("-TERM");
    assert!(relay.exited(Duration::from_secs(30)).await.success());
    assert!(
        outcomes.answers("e1").is_empty(),
        "nothing concluded before the stop"
    );
    assert_eq!(env.downstream.effects(key), 1);

    let _relay = Child::spawn(&config, None, dir.path().join("2.log"));
    outcomes.answer("e1", "succeeded").await;
    assert_eq!(env.downstream.effects(key), 1, "never sent again");
    let calls = attempts_of(&common::explain(&env, key).await);
    assert_one_call_then_verified_first(&calls);
}

/// A person's `resolve --as retry` is written into the attempt log as a concluded "not done",
/// so the attempt log's rule allows exactly one new call (without it, recovery would read the
/// ambiguous call and park the key again).
#[tokio::test]
async fn a_key_resolved_as_retry_is_called_again_once() {
    let env = Env::new().await;
    let key = "r12:send_email:b1";
    env.downstream
        .script(Some(key), vec![Step::Named("fail_500".into())]);
    let outcomes = env.outcomes().await;
    let config = env.config(&email_tool(false), "").await;
    let relay = env.start(config.clone()).await;
    env.producer().send(&action("e1", email("r12", "b1"))).await;
    outcomes.answer("e1", "unknown").await;
    assert_eq!(env.downstream.effects(key), 0);

    let pool = idem::db::pool(&config.postgres).unwrap();
    idem::ops::resolve(
        &pool,
        &config.postgres.schema,
        key,
        idem::ops::Resolution::Retry,
        "ops@oncall",
        "the provider's log has no such email",
        None,
    )
    .await
    .unwrap();
    outcomes.answer("e1", "succeeded").await;
    assert_eq!(env.downstream.effects(key), 1);
    let calls = attempts_of(&common::explain(&env, key).await);
    assert_eq!(
        calls,
        vec![
            ("call".into(), "first".into(), "ambiguous".into()),
            ("verify".into(), "manual".into(), "not_done".into()),
            ("call".into(), "manual".into(), "succeeded".into()),
        ]
    );
    relay.stop().await;
}

/// Two relays; the first reaches Postgres through a proxy that stalls while its call, slower
/// than the lease, is in flight, so it cannot renew the lease. The second takes the key over:
/// its verification finds nothing while the first call may still be in flight (before the
/// call's timeout), so it waits for the deadline instead of calling, and then finds the
/// effect. The first relay's late outcome is refused by the epoch.
#[tokio::test]
async fn a_relay_that_cannot_renew_its_lease_during_a_slow_call_is_not_doubled() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let tools = email_tool(true).replace("timeout = \"1s\"", "timeout = \"8s\"");
    let direct = common::config_file(&env, dir.path(), &tools, "").await;
    let (proxy, upstream) = common::postgres_proxy().await;
    let proxied = dir.path().join("proxied.toml");
    std::fs::write(
        &proxied,
        std::fs::read_to_string(&direct)
            .unwrap()
            .replace(&upstream, &proxy.addr.to_string()),
    )
    .unwrap();
    let key = "r13:send_email:b1";
    // Slower than the 3 s lease, well within the 8 s timeout.
    env.downstream
        .script(Some(key), vec![Step::Delay { delay_ms: 4000 }]);
    let outcomes = env.outcomes().await;
    let first = Child::spawn(&proxied, None, dir.path().join("first.log"));
    env.producer().send(&action("e1", email("r13", "b1"))).await;
    common::eventually(
        "the call to reach the downstream",
        Duration::from_secs(30),
        || async { env.downstream.requests() >= 1 },
    )
    .await;
    proxy.set(common::ProxyMode::Stall);
    let _second = Child::spawn(&direct, None, dir.path().join("second.log"));
    let o = outcomes.answer("e1", "succeeded").await;
    assert_eq!(o["data"]["result"]["id"], "eff_1", "{o}");
    proxy.set(common::ProxyMode::Pass);
    assert_eq!(env.downstream.effects(key), 1, "never sent twice");
    let calls = attempts_of(&common::explain(&env, key).await);
    assert_one_call_then_verified_first(&calls);
    assert!(
        calls.contains(&("verify".into(), "recovery".into(), "inconclusive".into())),
        "a 'not done' before the call's deadline concluded nothing: {calls:?}"
    );
    assert_eq!(calls.last().unwrap().2, "done", "{calls:?}");
    drop(first);
}
