//! The Kafka broker killed -9 and started again while actions flow: nothing lost, nothing
//! executed twice, every action answered, and the relay keeps running. The broker is shared by
//! every test, so this lives in a test binary of its own (cargo runs test binaries one at a
//! time). It needs the broker that `deploy/local/services.sh` started (its pid file).

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{action, Env};
use serde_json::json;

/// The status of `/readyz`, and whether it names Kafka as unreachable.
async fn readyz(addr: std::net::SocketAddr) -> (u16, bool) {
    let r = reqwest::get(format!("http://{addr}/readyz")).await.unwrap();
    let status = r.status().as_u16();
    (
        status,
        r.text().await.unwrap().contains("kafka: unreachable"),
    )
}

#[tokio::test]
async fn the_broker_killed_and_restarted_while_actions_flow_loses_and_repeats_nothing() {
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let dead = env.dead_letters().await;
    let relay = env
        .start(env.config(&common::email_tool(true), "").await)
        .await;
    let p = env.producer();
    let ids: Vec<String> = (0..300).map(|i| format!("k{i}")).collect();
    let events: Vec<_> = ids
        .iter()
        .map(|id| {
            action(
                id,
                json!({"run_id": "bk", "tool": "send_email", "business_id": id,
                       "args": {"to": "customer-1", "subject": "Hello"}}),
            )
        })
        .collect();
    // A third before the kill, a third while the broker is down (the producer holds them),
    // a third after it is back.
    for e in &events[..100] {
        p.send(e).await;
    }
    let restart = common::kill_broker();
    let held = async {
        futures::future::join_all(events[100..200].iter().map(|e| p.send(e))).await;
    };
    let back = async {
        // Readiness follows the brokers, not only the group's assignment.
        common::eventually(
            "/readyz to say kafka is down",
            Duration::from_secs(30),
            || async { readyz(relay.admin()).await == (503, true) },
        )
        .await;
        restart.start_again().await;
    };
    tokio::join!(held, back);
    for e in &events[200..] {
        p.send(e).await;
    }
    outcomes.answer_all(&ids, Duration::from_secs(180)).await;
    for id in &ids {
        let distinct: HashSet<String> = outcomes
            .answers(id)
            .iter()
            .map(|o| o["id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            distinct.len(),
            1,
            "{id}: one outcome (republished with its id)"
        );
        assert_eq!(outcomes.answers(id)[0]["data"]["status"], "succeeded");
    }
    assert!(dead.json().is_empty(), "dead-lettered: {:?}", dead.json());
    assert_eq!(env.downstream.total_effects(), 300);
    assert_eq!(env.downstream.repeated_keys(), Vec::<(String, u64)>::new());
    common::eventually(
        "/readyz to say ready again",
        Duration::from_secs(30),
        || async { readyz(relay.admin()).await.0 == 200 },
    )
    .await;
    let m = common::metrics(relay.admin()).await;
    assert!(
        common::sample(
            &m,
            r#"idem_actions_total{status="succeeded",tool="send_email"}"#
        ) >= 300.0,
        "{m}"
    );
    relay.stop().await;
}
