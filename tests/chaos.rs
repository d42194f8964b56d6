//! The fault soak: two relays under random crashes at every failpoint, pauses past the lease,
//! a Postgres restart and a broker kill, while thousands of actions with 30 % duplicates flow
//! to a downstream that does not dedupe and sometimes fails, answers 500 after the effect, or
//! cuts its answer. The checker then asserts, per key: at most one effect, every event
//! answered, `unknown` only where verification could not conclude (here: never, since
//! verification always answers in the end), and the key's own outcome on the topic before any
//! answer to a repeat of it.
//!
//! Bounded for CI (about 5,000 events); `IDEM_CHAOS_KEYS=20000` soaks longer. It restarts the
//! shared Postgres and broker, so it is a test binary of its own.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::{action, Child, Env};
use idem::fake_downstream::Step;
use serde_json::json;

/// Every failpoint in turn: each relay incarnation is armed with one of them, firing with a
/// small probability each time it is reached, so a relay lives for a while and then dies at
/// that step (a relay armed at every step at once would hardly get anything done).
const FAILPOINTS: [&str; 7] = [
    "before-outcome-commit=2%return",
    "after-intent-commit=5%return",
    "after-outcome-commit=2%return",
    "before-verify=10%return",
    "after-publish-before-mark=5%return",
    "verify-backoff=10%return",
    "after-direct-answers=5%return",
];

const TOOL: &str = r#"
[[tools]]
name = "send_email"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.to"]
executor = { kind = "http", url = "{downstream}/v1/send_email", timeout = "1s" }
retry = { max_attempts = 5, initial_backoff = "10ms", max_backoff = "100ms" }
verify = { url = "{downstream}/v1/effects/{key}", max_attempts = 50, backoff = "50ms" }
"#;

fn keys() -> usize {
    std::env::var("IDEM_CHAOS_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3500)
}

/// A supervisor: restarts a relay that died (a failpoint fired), like an orchestrator would.
struct Fleet {
    relays: Vec<Child>,
    config: std::path::PathBuf,
    dir: std::path::PathBuf,
    restarts: usize,
}

impl Fleet {
    fn spawn(&mut self, i: usize) -> Child {
        self.restarts += 1;
        Child::spawn(
            &self.config,
            Some(FAILPOINTS[self.restarts % FAILPOINTS.len()]),
            self.dir.join(format!("relay{i}-{}.log", self.restarts)),
        )
    }

    fn restart_dead(&mut self) {
        for i in 0..self.relays.len() {
            if self.relays[i].process.try_wait().unwrap().is_some() {
                self.relays[i] = self.spawn(i);
            }
        }
    }
}

#[tokio::test]
async fn two_relays_under_every_fault_execute_each_key_at_most_once_and_answer_everything() {
    let env = Env::new().await;
    // Kept after the test, with every relay's log: `IDEM_CHAOS_LOGS` names where.
    let dir = match std::env::var("IDEM_CHAOS_LOGS") {
        Ok(path) => {
            std::fs::create_dir_all(&path).unwrap();
            tempfile::tempdir_in(path).unwrap()
        }
        Err(_) => tempfile::tempdir().unwrap(),
    };
    let config = common::config_file(&env, dir.path(), TOOL, "").await;
    let n = keys();
    let key = |i: usize| format!("chaos:send_email:b{i}");
    // The downstream misbehaves on one key in five.
    for i in 0..n {
        let step = match i % 20 {
            0 | 1 => Some("effect_then_500"),
            2 => Some("fail_500"),
            3 => Some("effect_then_drop"),
            _ => None,
        };
        if let Some(s) = step {
            env.downstream
                .script(Some(&key(i)), vec![Step::Named(s.into())]);
        }
    }
    let outcomes = env.outcomes().await;
    let mut fleet = Fleet {
        relays: Vec::new(),
        config: config.clone(),
        dir: dir.path().to_path_buf(),
        restarts: 0,
    };
    for i in 0..2 {
        let r = fleet.spawn(i);
        fleet.relays.push(r);
    }

    // Events: one per key, and 30 % more: producer retries (the same event id again) and
    // replays (a new event id for the same key).
    let mut events = Vec::new();
    for i in 0..n {
        let data = json!({"run_id": "chaos", "tool": "send_email", "business_id": format!("b{i}"),
                          "args": {"to": "customer-1", "subject": "Hello"}});
        events.push(action(&format!("e{i}"), data.clone()));
        if i % 10 < 3 {
            let id = if i % 2 == 0 {
                format!("e{i}")
            } else {
                format!("e{i}-replay")
            };
            events.push(action(&id, data));
        }
    }
    let event_ids: Vec<String> = {
        let mut seen = HashSet::new();
        events
            .iter()
            .map(|e| e["id"].as_str().unwrap().to_string())
            .filter(|id| seen.insert(id.clone()))
            .collect()
    };

    let p = env.producer();
    let send = async {
        for chunk in events.chunks(100) {
            futures::future::join_all(chunk.iter().map(|e| p.send(e))).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    // Eighty steps of at least half a second, counted rather than timed: a Postgres restart or
    // a broker kill that takes seconds on a busy host does not cut the kills after it.
    let faults = async {
        for step in 1..=80 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            fleet.restart_dead();
            // And a kill -9 from outside every 4 s, at whatever the relay was doing.
            if step % 8 == 0 {
                let victim = (step / 8) % 2;
                fleet.relays[victim].kill9();
            }
            match step {
                // A relay paused past its 3 s lease, then resumed.
                10 => fleet.relays[0].signal("-STOP"),
                20 => fleet.relays[0].signal("-CONT"),
                // Postgres restarted, and the broker killed and started again, each waited
                // for off the runtime that serves the fake downstream.
                30 => common::stop_postgres().start_again().await,
                50 => common::kill_broker().start_again().await,
                _ => {}
            }
        }
    };
    tokio::join!(send, faults);
    // Relays keep being restarted until everything is answered.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    let answered = loop {
        fleet.restart_dead();
        let all = outcomes.json();
        let answered: HashSet<String> = all
            .iter()
            .filter_map(|o| o["data"]["action_event_id"].as_str().map(String::from))
            .collect();
        if event_ids.iter().all(|id| answered.contains(id)) {
            break all;
        }
        if tokio::time::Instant::now() >= deadline && std::env::var("IDEM_CHAOS_LOGS").is_ok() {
            println!("logs kept in {}", dir.keep().display());
            panic!("unanswered after 300 s");
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "unanswered after 300 s: {:?}",
            event_ids
                .iter()
                .filter(|id| !answered.contains(*id))
                .take(20)
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };

    // The checker. With `IDEM_CHAOS_LOGS` the logs are kept whatever it finds.
    if std::env::var("IDEM_CHAOS_LOGS").is_ok() {
        println!("logs kept in {}", dir.keep().display());
    }
    let repeated = env.downstream.repeated_keys();
    assert!(repeated.is_empty(), "effects doubled: {repeated:?}");
    let mut status_of: HashMap<String, String> = HashMap::new();
    for o in &answered {
        let k = o["data"]["idempotency_key"].as_str().unwrap().to_string();
        let s = o["data"]["status"].as_str().unwrap().to_string();
        assert_ne!(s, "unknown", "verification always concludes here: {o}");
        status_of.insert(k, s);
    }
    for i in 0..n {
        let k = key(i);
        let status = status_of.get(&k).map(String::as_str);
        let effects = env.downstream.effects(&k);
        match status {
            Some("succeeded") => assert_eq!(effects, 1, "{k}"),
            other => panic!("{k}: {other:?} with {effects} effects"),
        }
    }
    // A key's outcomes keep their order: the first copy of its own outcome on the topic comes
    // before the first answer to a repeat of it (a key's outcomes share a partition, collected
    // in the order written there; copies sent again after a kill come later).
    let mut first: HashMap<&str, (Option<usize>, Option<usize>)> = HashMap::new();
    for (i, o) in answered.iter().enumerate() {
        let k = o["data"]["idempotency_key"].as_str().unwrap();
        let (own, repeat) = first.entry(k).or_default();
        let slot = if o["data"]["duplicate"] == true {
            repeat
        } else {
            own
        };
        slot.get_or_insert(i);
    }
    let overtaken: Vec<&str> = first
        .iter()
        .filter(|(_, (own, repeat))| repeat.is_some_and(|r| own.is_none_or(|o| r < o)))
        .map(|(k, _)| *k)
        .collect();
    assert!(
        overtaken.is_empty(),
        "a repeat's answer went out before the outcome it repeats: {overtaken:?}"
    );
    assert!(
        fleet.restarts >= 10,
        "the soak killed relays: {} starts",
        fleet.restarts
    );
    println!(
        "chaos: {} events, {} keys, {} relay starts",
        event_ids.len(),
        n,
        fleet.restarts
    );
}
