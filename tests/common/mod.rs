//! Shared helpers for tests against the real local Kafka and Postgres: random topic, group and
//! schema names per test, a fake downstream that counts effects, and waiting with deadlines.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::config::Config;
use idem::fake_downstream::FakeDownstream;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::Message;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

pub fn brokers() -> String {
    std::env::var("IDEM_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

pub fn postgres_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://idem:idem@127.0.0.1:5432/idem".into())
}

pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// Everything one test's relay needs, isolated from other tests.
pub struct Env {
    pub schema: String,
    pub actions: String,
    pub outcomes: String,
    pub dlq: String,
    pub group: String,
    pub downstream: FakeDownstream,
    pub downstream_url: String,
    stop_downstream: CancellationToken,
}

impl Drop for Env {
    fn drop(&mut self) {
        self.stop_downstream.cancel();
    }
}

impl Env {
    pub async fn new() -> Env {
        Self::with_downstream(FakeDownstream::new(false)).await
    }

    pub async fn with_downstream(downstream: FakeDownstream) -> Env {
        let stop = CancellationToken::new();
        let addr = downstream
            .clone()
            .spawn("127.0.0.1:0".parse().unwrap(), stop.clone())
            .await
            .unwrap();
        let base = unique("t");
        Env {
            schema: base.clone(),
            actions: format!("{base}.actions"),
            outcomes: format!("{base}.outcomes"),
            dlq: format!("{base}.dlq"),
            group: format!("{base}.group"),
            downstream,
            downstream_url: format!("http://{addr}"),
            stop_downstream: stop,
        }
    }

    /// A config for this test: `tools` is TOML with `{downstream}` standing for the fake's URL.
    pub fn config_text(&self, tools: &str, relay: &str) -> String {
        format!(
            r#"
[kafka]
brokers = "{brokers}"
group_id = "{group}"
actions_topic = "{actions}"
outcomes_topic = "{outcomes}"
dlq_topic = "{dlq}"
partitions = 6

[postgres]
url = "{pg}"
schema = "{schema}"
pool_size = 8

[relay]
batch_linger = "5ms"
lease = "3s"
recovery_interval = "500ms"
outbox_poll_interval = "200ms"
shutdown_grace = "10s"
{relay}

[admin]
listen = "127.0.0.1:0"

{tools}
"#,
            brokers = brokers(),
            group = self.group,
            actions = self.actions,
            outcomes = self.outcomes,
            dlq = self.dlq,
            pg = postgres_url(),
            schema = self.schema,
            tools = tools.replace("{downstream}", &self.downstream_url),
        )
    }

    pub async fn config(&self, tools: &str, relay: &str) -> Config {
        let config = Config::from_toml(&self.config_text(tools, relay), |_| None)
            .expect("test config is valid");
        idem::db::migrate(&config.postgres).await.expect("migrate");
        config
    }

    pub async fn start(&self, config: Config) -> Relay {
        let shutdown = CancellationToken::new();
        let handle = idem::relay::start(config, shutdown.clone())
            .await
            .expect("relay starts");
        Relay {
            shutdown,
            handle: Some(handle),
        }
    }

    /// A connection whose search path is this test's schema.
    pub async fn pg(&self) -> tokio_postgres::Client {
        let mut cfg: tokio_postgres::Config = postgres_url().parse().unwrap();
        cfg.options(format!("-c search_path={}", self.schema));
        let (client, conn) = cfg
            .connect(tokio_postgres::NoTls)
            .await
            .expect("postgres connects");
        tokio::spawn(conn);
        client
    }

    pub fn producer(&self) -> Producer {
        let p: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("enable.idempotence", "true")
            .set("linger.ms", "1")
            .create()
            .unwrap();
        Producer {
            inner: p,
            topic: self.actions.clone(),
        }
    }

    /// Starts collecting every outcome event from the start of the outcomes topic.
    pub async fn outcomes(&self) -> Collector {
        Collector::start(&self.outcomes).await
    }

    pub async fn dead_letters(&self) -> Collector {
        Collector::start(&self.dlq).await
    }
}

pub struct Relay {
    shutdown: CancellationToken,
    handle: Option<idem::relay::Handle>,
}

impl Relay {
    pub fn admin(&self) -> std::net::SocketAddr {
        self.handle.as_ref().unwrap().admin_addr
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(h) = self.handle.take() {
            tokio::time::timeout(Duration::from_secs(60), h.wait())
                .await
                .expect("relay stops within 60s");
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub struct Producer {
    inner: FutureProducer,
    topic: String,
}

/// An action event in structured mode.
pub fn action(id: &str, data: Value) -> Value {
    json!({"specversion": "1.0", "id": id, "source": "test-agent", "type": "dev.idem.action.v1", "data": data})
}

impl Producer {
    pub async fn send_raw(&self, key: Option<&str>, payload: &[u8], headers: OwnedHeaders) {
        let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(&self.topic)
            .payload(payload)
            .headers(headers);
        if let Some(k) = key {
            record = record.key(k);
        }
        self.inner
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .expect("produce");
    }

    pub async fn send(&self, event: &Value) {
        let key = event["data"]["idempotency_key"]
            .as_str()
            .or(event["data"]["run_id"].as_str())
            .map(str::to_string);
        let headers = OwnedHeaders::new().insert(Header {
            key: "content-type",
            value: Some("application/cloudevents+json"),
        });
        self.send_raw(key.as_deref(), &serde_json::to_vec(event).unwrap(), headers)
            .await;
    }
}

/// Collects a topic's messages in the background.
pub struct Collector {
    pub messages: Arc<Mutex<Vec<Collected>>>,
    stop: CancellationToken,
}

#[derive(Clone, Debug)]
pub struct Collected {
    pub key: Option<String>,
    pub payload: Vec<u8>,
    pub headers: HashMap<String, String>,
}

impl Collected {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.payload).unwrap_or(Value::Null)
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Collector {
    async fn start(topic: &str) -> Collector {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("group.id", unique("collector"))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .set("topic.metadata.refresh.interval.ms", "500")
            .create()
            .unwrap();
        consumer.subscribe(&[topic]).unwrap();
        let messages = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let (m, s) = (messages.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = s.cancelled() => return,
                    r = consumer.recv() => if let Ok(msg) = r {
                        use rdkafka::message::Headers;
                        let headers = msg.headers().map(|h| h.iter().map(|h| (h.key.to_string(), String::from_utf8_lossy(h.value.unwrap_or_default()).to_string())).collect()).unwrap_or_default();
                        m.lock().unwrap().push(Collected {
                            key: msg.key().map(|k| String::from_utf8_lossy(k).to_string()),
                            payload: msg.payload().unwrap_or_default().to_vec(),
                            headers,
                        });
                    }
                }
            }
        });
        Collector { messages, stop }
    }

    pub fn all(&self) -> Vec<Collected> {
        self.messages.lock().unwrap().clone()
    }

    pub fn json(&self) -> Vec<Value> {
        self.all().iter().map(Collected::json).collect()
    }

    /// Outcome events answering `action_event_id`.
    pub fn answers(&self, action_event_id: &str) -> Vec<Value> {
        self.json()
            .into_iter()
            .filter(|v| v["data"]["action_event_id"] == action_event_id)
            .collect()
    }

    /// Waits until `done` holds for the collected messages, or fails naming `what`.
    pub async fn wait_for(
        &self,
        what: &str,
        within: Duration,
        done: impl Fn(&[Value]) -> bool,
    ) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let now = self.json();
            if done(&now) {
                return now;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "timed out after {within:?} waiting for {what}; collected {} messages: {:#?}",
                    now.len(),
                    now.iter().rev().take(5).collect::<Vec<_>>()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every one of `ids` (action event ids) has an answer, of any status.
    pub async fn answer_all(&self, ids: &[String], within: Duration) -> Vec<Value> {
        self.wait_for("every action event answered", within, |all| {
            let answered: std::collections::HashSet<&str> = all
                .iter()
                .filter_map(|o| o["data"]["action_event_id"].as_str())
                .collect();
            ids.iter().all(|id| answered.contains(id.as_str()))
        })
        .await
    }

    /// Waits for the answer to `action_event_id`, whatever its status.
    pub async fn answer_to(&self, action_event_id: &str, within: Duration) -> Value {
        self.answer_all(&[action_event_id.to_string()], within)
            .await
            .into_iter()
            .find(|o| o["data"]["action_event_id"] == action_event_id)
            .expect("answer_all waited for it")
    }

    /// Waits for an answer to `action_event_id` with `status`.
    pub async fn answer(&self, action_event_id: &str, status: &str) -> Value {
        let all = self
            .wait_for(
                &format!("a {status} answer to {action_event_id}"),
                Duration::from_secs(60),
                |v| {
                    v.iter().any(|o| {
                        o["data"]["action_event_id"] == action_event_id
                            && o["data"]["status"] == status
                    })
                },
            )
            .await;
        all.into_iter()
            .find(|o| {
                o["data"]["action_event_id"] == action_event_id && o["data"]["status"] == status
            })
            .unwrap()
    }
}

/// Polls `check` until it is true or the deadline passes.
pub async fn eventually<F, Fut>(what: &str, within: Duration, check: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !check().await {
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {within:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls the metrics the relay at `admin` serves (Prometheus text) until `check` holds of them
/// or the deadline passes.
pub async fn eventually_metrics(
    what: &str,
    within: Duration,
    admin: std::net::SocketAddr,
    check: impl Fn(&str) -> bool,
) {
    let check = &check;
    eventually(
        what,
        within,
        move || async move { check(&metrics(admin).await) },
    )
    .await
}

pub async fn metrics(addr: std::net::SocketAddr) -> String {
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of one sample line in Prometheus text, 0 when absent.
pub fn sample(metrics: &str, name_and_labels: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(name_and_labels) && l[name_and_labels.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// The relay binary as a child process, so a test can kill -9, SIGSTOP and restart it.
pub struct Child {
    pub process: std::process::Child,
    pub log: std::path::PathBuf,
}

impl Child {
    /// Starts `idem relay` with `config`; `failpoints` as in `FAILPOINTS` (e.g. `name=return`).
    pub fn spawn(
        config: &std::path::Path,
        failpoints: Option<&str>,
        log: std::path::PathBuf,
    ) -> Child {
        Self::spawn_with_env(config, failpoints, &[], log)
    }

    /// As [`Child::spawn`], with more environment variables.
    pub fn spawn_with_env(
        config: &std::path::Path,
        failpoints: Option<&str>,
        env: &[(&str, &str)],
        log: std::path::PathBuf,
    ) -> Child {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idem"));
        cmd.args(["relay", "--config", config.to_str().unwrap()])
            .env("IDEM_LOG", "info")
            .env_remove("FAILPOINTS")
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        if let Some(f) = failpoints {
            cmd.env("FAILPOINTS", f);
        }
        cmd.envs(env.iter().copied());
        Child {
            process: cmd.spawn().expect("relay binary starts"),
            log,
        }
    }

    pub fn signal(&self, sig: &str) {
        let ok = std::process::Command::new("kill")
            .args([sig, &self.process.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success(), "kill {sig} failed");
    }

    pub fn kill9(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }

    /// Waits for the process to exit by itself (a failpoint aborting it), with a deadline.
    pub async fn exited(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(status) = self.process.try_wait().unwrap() {
                return status;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "relay did not exit within {within:?}; log:\n{}",
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Writes this test's config to a file a child relay can read.
pub async fn config_file(
    env: &Env,
    dir: &std::path::Path,
    tools: &str,
    relay: &str,
) -> std::path::PathBuf {
    env.config(tools, relay).await; // migrates the schema
    let path = dir.join("idem.toml");
    std::fs::write(&path, env.config_text(tools, relay)).unwrap();
    path
}

/// Waits until every outbox row of the test's schema is published (none left in the queue;
/// `pg` is [`Env::pg`]'s connection), or fails naming `what`.
pub async fn outbox_drained(pg: &tokio_postgres::Client, what: &str) {
    eventually(what, Duration::from_secs(20), || async {
        let row = pg
            .query_one("select count(*) from outbox_pending", &[])
            .await
            .unwrap();
        row.get::<_, i64>(0) == 0
    })
    .await;
}

/// `idem explain --json` for a key, through the library.
pub async fn explain(env: &Env, key: &str) -> Value {
    let config = Config::from_toml(&env.config_text("", ""), |_| None).unwrap();
    let pool = idem::db::pool(&config.postgres).unwrap();
    idem::ops::explain(&pool, key).await.expect("explain")
}

/// The (action event id, origin) of each delivery an explanation lists, in its order.
pub fn delivered(e: &Value) -> Vec<(&str, &str)> {
    e["deliveries"]
        .as_array()
        .expect("a list of deliveries")
        .iter()
        .map(|d| {
            (
                d["action_event_id"].as_str().unwrap(),
                d["origin"].as_str().unwrap(),
            )
        })
        .collect()
}

/// What a [`FaultProxy`] does to its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Forwards both ways.
    Pass,
    /// Drops every connection, open and new (a cut network, a dead host that resets).
    Cut,
    /// Keeps connections open and forwards nothing (a network that black-holes packets).
    Stall,
}

/// A TCP fault proxy in front of a real server (Postgres here): tests point the relay at
/// `addr` and cut or stall the path while actions flow. Written in the test support because
/// toxiproxy is not a Rust dependency; its two faults that matter here are these.
pub struct FaultProxy {
    pub addr: std::net::SocketAddr,
    mode: tokio::sync::watch::Sender<ProxyMode>,
    stop: CancellationToken,
}

impl FaultProxy {
    pub async fn start(upstream: std::net::SocketAddr) -> FaultProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, _) = tokio::sync::watch::channel(ProxyMode::Pass);
        let stop = CancellationToken::new();
        let (rx, stopped) = (mode.subscribe(), stop.clone());
        tokio::spawn(async move {
            loop {
                let inbound = tokio::select! {
                    _ = stopped.cancelled() => return,
                    a = listener.accept() => match a {
                        Ok((s, _)) => s,
                        Err(_) => continue,
                    },
                };
                tokio::spawn(proxy_one(inbound, upstream, rx.clone(), stopped.clone()));
            }
        });
        FaultProxy { addr, mode, stop }
    }

    pub fn set(&self, mode: ProxyMode) {
        self.mode.send_replace(mode);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn proxy_one(
    mut inbound: tokio::net::TcpStream,
    upstream: std::net::SocketAddr,
    mut mode: tokio::sync::watch::Receiver<ProxyMode>,
    stop: CancellationToken,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // A new connection while stalled waits; while cut it is dropped.
    loop {
        let now = *mode.borrow_and_update();
        match now {
            ProxyMode::Cut => return,
            ProxyMode::Pass => break,
            ProxyMode::Stall => {
                if mode.changed().await.is_err() {
                    return;
                }
            }
        }
    }
    let Ok(mut out) = tokio::net::TcpStream::connect(upstream).await else {
        return;
    };
    let (mut a, mut b) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    loop {
        let now = *mode.borrow_and_update();
        match now {
            ProxyMode::Cut => return,
            ProxyMode::Stall => {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    c = mode.changed() => if c.is_err() { return },
                }
                continue;
            }
            ProxyMode::Pass => {}
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            c = mode.changed() => if c.is_err() { return },
            n = inbound.read(&mut a) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => if out.write_all(&a[..n]).await.is_err() { return },
            },
            n = out.read(&mut b) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => if inbound.write_all(&b[..n]).await.is_err() { return },
            },
        }
    }
}

// ------------------------------------------------------------ local services

pub fn pg_port() -> String {
    let url = postgres_url();
    url.rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next())
        .filter(|p| p.chars().all(|c| c.is_ascii_digit()))
        .unwrap_or("5432")
        .to_string()
}

/// The local cluster stopped until dropped (started again also when the test fails).
pub struct PostgresStopped {
    pub stopped_at: tokio::time::Instant,
}

impl PostgresStopped {
    fn version() -> String {
        let mut versions: Vec<u32> = std::fs::read_dir("/usr/lib/postgresql")
            .expect("Debian's PostgreSQL, installed by deploy/local/services.sh")
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        versions.sort();
        versions.last().expect("a PostgreSQL version").to_string()
    }

    fn ctl(what: &str) {
        let ok = std::process::Command::new("pg_ctlcluster")
            .args([&Self::version(), "main", what, "-m", "fast"])
            .status()
            .expect("pg_ctlcluster");
        assert!(ok.success(), "pg_ctlcluster {what}");
    }

    fn stop() -> PostgresStopped {
        Self::ctl("stop");
        PostgresStopped {
            stopped_at: tokio::time::Instant::now(),
        }
    }
}

impl Drop for PostgresStopped {
    fn drop(&mut self) {
        let ok = std::process::Command::new("pg_ctlcluster")
            .args([&Self::version(), "main", "start"])
            .status()
            .expect("pg_ctlcluster");
        assert!(ok.success(), "pg_ctlcluster start");
        // Ready when it answers.
        for _ in 0..600 {
            let up = std::process::Command::new("pg_isready")
                .args(["-h", "127.0.0.1", "-p", &pg_port(), "-q"])
                .status()
                .is_ok_and(|s| s.success());
            if up {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("postgres did not come back within 60 s");
    }
}

/// Stops the local Postgres cluster (fast shutdown) until the guard is dropped.
pub fn stop_postgres() -> PostgresStopped {
    PostgresStopped::stop()
}

impl PostgresStopped {
    /// Starts the cluster again and waits until it answers, off the runtime's threads (see
    /// [`restarted_off_runtime`]).
    pub async fn start_again(self) {
        restarted_off_runtime(self).await
    }
}

/// Drops a guard that restarts a service (and waits seconds for it) on a blocking thread. A
/// test's runtime also serves its fake downstream and often its relay: blocked, the downstream
/// would answer nothing for those seconds and then serve its queued calls in no particular
/// order, applying some after their deadline and after verifications that found them not
/// done. That is a downstream idem's verify assumes away (README, "Assumes"), and the chaos
/// soak once failed with doubled effects that way.
async fn restarted_off_runtime<G: Send + 'static>(guard: G) {
    if let Err(e) = tokio::task::spawn_blocking(move || drop(guard)).await {
        std::panic::resume_unwind(e.into_panic());
    }
}

fn kafka_pid_file() -> std::path::PathBuf {
    let state = std::env::var("IDEM_LOCAL_DIR")
        .unwrap_or_else(|_| format!("{}/.cache/idem-local", std::env::var("HOME").unwrap()));
    std::path::Path::new(&state).join("kafka/kafka.pid")
}

/// Starts the broker again (the services script is idempotent), also when the test fails.
pub struct BrokerKilled;

impl Drop for BrokerKilled {
    fn drop(&mut self) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/local/services.sh");
        let ok = std::process::Command::new("bash")
            .args([script, "up"])
            .status()
            .expect("bash runs the services script");
        assert!(ok.success(), "the broker came back");
    }
}

impl BrokerKilled {
    /// Starts the broker again and waits until it answers, off the runtime's threads (see
    /// [`restarted_off_runtime`]).
    pub async fn start_again(self) {
        restarted_off_runtime(self).await
    }
}

/// Kills the local broker with SIGKILL; it is started again when the guard is dropped.
pub fn kill_broker() -> BrokerKilled {
    let pid = std::fs::read_to_string(kafka_pid_file())
        .expect("the broker started by deploy/local/services.sh (its pid file)");
    let ok = std::process::Command::new("kill")
        .args(["-KILL", pid.trim()])
        .status()
        .unwrap();
    assert!(ok.success(), "kill -9 the broker");
    // A killed JVM holds its listening sockets until the kernel has torn it down; starting
    // the broker again before then would find the port open and wait on a dead broker
    // (CI's chaos run failed that way). Gone means no such process, or only its zombie.
    let pid = pid.trim();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let gone = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|stat| {
                stat.rsplit_once(") ")
                    .is_none_or(|(_, rest)| rest.starts_with('Z'))
            })
            .unwrap_or(true);
        if gone {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the killed broker (pid {pid}) still runs after 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    BrokerKilled
}

/// A TCP fault proxy in front of the test Postgres, and the `host:port` of the real server
/// (to be replaced by `proxy.addr` in a config's URL).
pub async fn postgres_proxy() -> (FaultProxy, String) {
    let upstream = postgres_url()
        .split('@')
        .nth(1)
        .and_then(|h| h.split('/').next())
        .unwrap()
        .to_string();
    let addr = tokio::net::lookup_host(&upstream)
        .await
        .unwrap()
        .next()
        .unwrap();
    (FaultProxy::start(addr).await, upstream)
}

/// The dangerous `send_email` tool most crash tests use: with `verify` against the fake
/// downstream, or unverifiable (and then opted out of approval on purpose).
pub fn email_tool(verify: bool) -> String {
    let verify = if verify {
        r#"verify = { url = "{downstream}/v1/effects/{key}", max_attempts = 5, backoff = "50ms" }"#
    } else {
        // Unverifiable on purpose; without the opt-out every intent would wait for approval.
        r#"approval = "none""#
    };
    format!(
        r#"
[[tools]]
name = "send_email"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.to"]
executor = {{ kind = "http", url = "{{downstream}}/v1/send_email", timeout = "1s" }}
retry = {{ max_attempts = 3, initial_backoff = "10ms", max_backoff = "50ms" }}
{verify}
"#
    )
}

/// Asserts that a command of the CLI (or a helper tool) succeeded, showing what it printed.
pub fn assert_succeeded(what: &str, out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
