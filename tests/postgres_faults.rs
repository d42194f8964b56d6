//! Postgres refusing work while actions flow: nothing lost, nothing dead-lettered, nothing
//! executed twice, and the relay keeps running. These tests change the whole local cluster
//! (`ALTER SYSTEM`), so they live in a test binary of their own (cargo runs test binaries one
//! at a time) and run one after another.
//!
//! They need a superuser on the local cluster: as root, through the `postgres` system user,
//! the way `deploy/local/services.sh` set it up.

mod common;

use std::time::Duration;

use common::{action, Env, ProxyMode};
use serde_json::json;

/// One test at a time in this binary: each changes the whole cluster.
static CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs SQL as the cluster's superuser.
fn superuser(sql: &str) {
    let out = std::process::Command::new("runuser")
        .args([
            "-u",
            "postgres",
            "--",
            "psql",
            "-qAt",
            "-v",
            "ON_ERROR_STOP=1",
        ])
        .args(["-p", &common::pg_port(), "-d", "postgres", "-c", sql])
        .current_dir("/")
        .output()
        .expect("runuser and psql are installed by deploy/local/services.sh");
    common::assert_succeeded("psql as superuser", &out);
}

/// Makes every transaction of the cluster read-only until dropped (also when the test fails,
/// so no later test inherits a read-only database).
struct ReadOnly;

impl ReadOnly {
    fn on() -> ReadOnly {
        superuser("alter system set default_transaction_read_only = on");
        superuser("select pg_reload_conf()");
        ReadOnly
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        superuser("alter system reset default_transaction_read_only");
        superuser("select pg_reload_conf()");
    }
}

fn email_tool() -> String {
    common::email_tool(true)
}

fn email(business: &str) -> serde_json::Value {
    json!({"run_id": "ro", "tool": "send_email", "business_id": business,
           "args": {"to": "customer-1", "subject": "Hello"}})
}

async fn readyz(addr: std::net::SocketAddr) -> (u16, String) {
    let r = reqwest::get(format!("http://{addr}/readyz")).await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// Issue 12: with Postgres read-only for 10 s, all 200 valid actions of one run were
/// dead-lettered `unrecordable` (SQLSTATE 25006 was not taken for "unavailable"), never
/// executed, never answered, and their offsets committed.
#[tokio::test]
async fn postgres_read_only_for_ten_seconds_loses_nothing_and_repeats_nothing() {
    let _one = CLUSTER.lock().await;
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let dead = env.dead_letters().await;
    let relay = env.start(env.config(&email_tool(), "").await).await;
    let p = env.producer();
    p.send(&action("warm", email("warm"))).await;
    outcomes.answer("warm", "succeeded").await;

    let read_only = ReadOnly::on();
    let flow = send_200_over_ten_seconds(&p, "e");
    let noticed = common::eventually(
        "the relay to report that Postgres refuses writes",
        Duration::from_secs(30),
        || async {
            let (status, body) = readyz(relay.admin()).await;
            let m = common::metrics(relay.admin()).await;
            status == 503
                && body.contains("postgres: refusing writes")
                && m.lines().any(|l| l == "idem_postgres_writable 0")
        },
    );
    let (ids, ()) = tokio::join!(flow, noticed);
    assert!(
        outcomes.answers("e0").is_empty(),
        "nothing recorded while read-only"
    );
    drop(read_only);
    assert_each_answered_and_executed_once(
        &env,
        &outcomes,
        &dead,
        &ids,
        1,
        Duration::from_secs(120),
    )
    .await;
    common::eventually("ready again", Duration::from_secs(30), || async {
        readyz(relay.admin()).await.0 == 200
    })
    .await;
    let m = common::metrics(relay.admin()).await;
    assert!(
        common::sample(&m, r#"idem_postgres_retries_total{stage="record"}"#) >= 1.0,
        "{m}"
    );
    relay.stop().await;
}

/// 200 actions (`{prefix}0` …) over about ten seconds.
async fn send_200_over_ten_seconds(p: &common::Producer, prefix: &str) -> Vec<String> {
    let ids: Vec<String> = (0..200).map(|i| format!("{prefix}{i}")).collect();
    let events: Vec<_> = ids
        .iter()
        .map(|id| action(id, email(&format!("b-{id}"))))
        .collect();
    for chunk in events.chunks(20) {
        futures::future::join_all(chunk.iter().map(|e| p.send(e))).await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
    }
    ids
}

/// Every one of `ids` answered `succeeded` exactly once, nothing dead-lettered, one effect per
/// key (plus `before` effects of earlier actions).
async fn assert_each_answered_and_executed_once(
    env: &Env,
    outcomes: &common::Collector,
    dead: &common::Collector,
    ids: &[String],
    before: u64,
    within: Duration,
) {
    outcomes.answer_all(ids, within).await;
    for id in ids {
        let answers = outcomes.answers(id);
        assert_eq!(answers.len(), 1, "{id} answered once: {answers:?}");
        assert_eq!(
            answers[0]["data"]["status"], "succeeded",
            "{:?}",
            answers[0]
        );
    }
    assert!(dead.json().is_empty(), "dead-lettered: {:?}", dead.json());
    assert_eq!(
        env.downstream.total_effects(),
        before + ids.len() as u64,
        "each executed once"
    );
    assert_eq!(env.downstream.repeated_keys(), Vec::<(String, u64)>::new());
}

/// The relay reaches Postgres through a TCP proxy that drops every connection, open and new,
/// for ten seconds while actions flow.
#[tokio::test]
async fn connections_to_postgres_cut_for_ten_seconds_lose_nothing_and_repeat_nothing() {
    let _one = CLUSTER.lock().await;
    let env = Env::new().await;
    env.config(&email_tool(), "").await; // migrates, directly
    let (proxy, upstream) = common::postgres_proxy().await;
    let text = env
        .config_text(&email_tool(), "")
        .replace(&upstream, &proxy.addr.to_string());
    let config = idem::config::Config::from_toml(&text, |_| None).unwrap();
    let outcomes = env.outcomes().await;
    let dead = env.dead_letters().await;
    let relay = env.start(config).await;
    let p = env.producer();
    p.send(&action("warm", email("warm"))).await;
    outcomes.answer("warm", "succeeded").await;

    proxy.set(ProxyMode::Cut);
    let flow = send_200_over_ten_seconds(&p, "c");
    let noticed = common::eventually_metrics(
        "the relay to report that it cannot write",
        Duration::from_secs(30),
        relay.admin(),
        |m| m.lines().any(|l| l == "idem_postgres_writable 0"),
    );
    let (ids, ()) = tokio::join!(flow, noticed);
    assert!(
        outcomes.answers("c0").is_empty(),
        "nothing recorded while cut"
    );
    proxy.set(ProxyMode::Pass);
    assert_each_answered_and_executed_once(
        &env,
        &outcomes,
        &dead,
        &ids,
        1,
        Duration::from_secs(120),
    )
    .await;
    relay.stop().await;
}

/// Postgres itself stopped (fast shutdown: open connections are told `admin_shutdown`, new
/// ones refused) for 70 s while actions flow, then started again.
#[tokio::test]
async fn postgres_stopped_for_seventy_seconds_loses_nothing_and_repeats_nothing() {
    let _one = CLUSTER.lock().await;
    let env = Env::new().await;
    let outcomes = env.outcomes().await;
    let dead = env.dead_letters().await;
    let relay = env.start(env.config(&email_tool(), "").await).await;
    let p = env.producer();
    p.send(&action("warm", email("warm"))).await;
    outcomes.answer("warm", "succeeded").await;

    let cluster = common::stop_postgres();
    let ids = send_200_over_ten_seconds(&p, "s").await;
    common::eventually_metrics(
        "the relay to report that it cannot write",
        Duration::from_secs(30),
        relay.admin(),
        |m| m.lines().any(|l| l == "idem_postgres_writable 0"),
    )
    .await;
    let (status, body) = readyz(relay.admin()).await;
    assert_eq!(status, 503, "{body}");
    tokio::time::sleep_until(cluster.stopped_at + Duration::from_secs(70)).await;
    assert!(
        outcomes.answers("s0").is_empty(),
        "nothing recorded while stopped"
    );
    cluster.start_again().await;
    assert_each_answered_and_executed_once(
        &env,
        &outcomes,
        &dead,
        &ids,
        1,
        Duration::from_secs(120),
    )
    .await;
    relay.stop().await;
}
