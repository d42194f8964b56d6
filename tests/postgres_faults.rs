//! Postgres refusing work while actions flow: nothing lost, nothing dead-lettered, nothing
//! executed twice, and the relay keeps running. These tests change the whole local cluster
//! (`ALTER SYSTEM`), so they live in a test binary of their own (cargo runs test binaries one
//! at a time) and run one after another.
//!
//! They need a superuser on the local cluster: as root, through the `postgres` system user,
//! the way `deploy/local/services.sh` set it up.

mod common;

use std::time::Duration;

use common::{action, Env};
use serde_json::json;

/// One test at a time in this binary: each changes the whole cluster.
static CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn pg_port() -> String {
    let url = common::postgres_url();
    url.rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next())
        .filter(|p| p.chars().all(|c| c.is_ascii_digit()))
        .unwrap_or("5432")
        .to_string()
}

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
        .args(["-p", &pg_port(), "-d", "postgres", "-c", sql])
        .current_dir("/")
        .output()
        .expect("runuser and psql are installed by deploy/local/services.sh");
    assert!(
        out.status.success(),
        "psql as superuser failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
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

fn email_tool() -> &'static str {
    r#"
[[tools]]
name = "send_email"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.to"]
executor = { kind = "http", url = "{downstream}/v1/send_email", timeout = "1s" }
verify = { url = "{downstream}/v1/effects/{key}", max_attempts = 5, backoff = "50ms" }
"#
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
    let relay = env.start(env.config(email_tool(), "").await).await;
    let p = env.producer();
    p.send(&action("warm", email("warm"))).await;
    outcomes.answer("warm", "succeeded").await;

    let read_only = ReadOnly::on();
    let ids: Vec<String> = (0..200).map(|i| format!("e{i}")).collect();
    let flow = async {
        // 200 actions over about ten seconds.
        let events: Vec<_> = ids
            .iter()
            .map(|id| action(id, email(&format!("b-{id}"))))
            .collect();
        for chunk in events.chunks(20) {
            futures::future::join_all(chunk.iter().map(|e| p.send(e))).await;
            tokio::time::sleep(Duration::from_millis(1000)).await;
        }
    };
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
    tokio::join!(flow, noticed);
    assert!(
        outcomes.answers("e0").is_empty(),
        "nothing recorded while read-only"
    );
    drop(read_only);

    let answers = outcomes.answer_all(&ids, Duration::from_secs(120)).await;
    for a in &answers {
        assert_eq!(a["data"]["status"], "succeeded", "{a}");
    }
    assert!(dead.json().is_empty(), "dead-lettered: {:?}", dead.json());
    assert_eq!(env.downstream.total_effects(), 201, "each executed once");
    assert_eq!(env.downstream.repeated_keys(), Vec::<(String, u64)>::new());
    for id in &ids {
        assert_eq!(outcomes.answers(id).len(), 1, "{id} answered once");
    }
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
