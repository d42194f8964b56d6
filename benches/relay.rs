//! The relay benchmark: the same workload through idem and through the naive relay a reader of
//! the idempotency literature writes first, on the same Kafka and Postgres, in one run.
//!
//! `cargo bench --bench relay -- [--actions N] [--dup 0.1] [--latency-ms 0] [--partitions 6]
//! [--outcome-partitions P] [--payload 200] [--concurrency 256] [--rate 0] [--tick-ms 10] [--naive-actions N]
//! [--modes idem,naive,dbos,restate] [--prefill N] [--slow-share 0] [--slow-ms 200]`
//!
//! `--slow-share S` (idem only) sends a share S of the keys to a second tool, `slow`, whose
//! downstream answers after `--slow-ms`, and reports the two tools' latencies apart: what a slow
//! tool's calls under way cost the others' results.
//! `--prefill N` writes N finished keys into idem's tables before the run (growth);
//! `--prune-interval 1s` has the relay prune them (they are past retention) during the run,
//! paced to `--prune-share` (idem's `relay.prune_share`, default 0.1); the run then reports how
//! many were pruned while it lasted.
//! `IDEM_BENCH_SCHEMA=name` keeps idem's tables in that schema across runs (fill once, measure
//! several ways).
//! `IDEM_BENCH_BIN=PATH` runs that build of the relay instead of this one (an A/B of two commits).
//!
//! `dbos` runs `benches/dbos_relay.py` (DBOS Transact's Kafka integration, one workflow per message,
//! the effect in a child workflow keyed by the idempotency key) with the Python named by
//! `IDEM_BENCH_PYTHON` (one with `pip install dbos confluent-kafka requests`).
//!
//! `restate` runs `benches/restate/launch.mjs` (restate-server with a Kafka subscription to a
//! handler that forwards each action to a Virtual Object keyed by the idempotency key, which
//! keeps the first result in its state) with the Node named by `IDEM_BENCH_NODE` (default `node`),
//! after `npm ci --prefix benches/restate`.
//!
//! Without `--bench` (as `cargo test --all-targets` runs it) it is a smoke run of a few hundred
//! actions, so the benchmark keeps working. Each mode runs its relay as a child process, so its
//! CPU and peak RSS are its own (with its child processes', for a relay made of several), and
//! checks correctness as it goes: effects at the downstream == distinct keys, every action
//! answered.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{ChildStdout, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use idem::fake_downstream::FakeDownstream;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::Message;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug)]
struct Opts {
    actions: usize,
    naive_actions: usize,
    dup: f64,
    latency_ms: u64,
    partitions: i32,
    /// The outcomes topic's partitions (`--partitions` unless set).
    outcome_partitions: i32,
    payload: usize,
    concurrency: usize,
    modes: Vec<String>,
    /// Actions per second to publish at; 0 publishes flat out.
    rate: usize,
    /// A paced run publishes a tick's actions at once, every `tick_ms`: 10 sends bursts of a
    /// hundredth of a second's actions, 1 a stream closer to steady.
    tick_ms: u64,
    /// The load generator's producer `linger.ms`: by default 1 paced (an agent sends one call at
    /// a time; earlier stops' numbers were measured so), 5 flat out (the producer batches).
    send_linger_ms: u64,
    /// Finished keys written into idem's tables before the run (growth).
    prefill: usize,
    /// idem's `relay.prune_interval`: `1s` prunes the prefilled keys (30 days old, past the
    /// 7-day retention) while the run goes on. Unset: `10m` (no pruning during a run).
    prune_interval: Option<String>,
    /// idem's `relay.prune_share`.
    prune_share: f64,
    /// The share of keys sent to the tool `slow`, whose downstream answers after `slow_ms`.
    slow_share: f64,
    slow_ms: u64,
    full: bool,
}

fn parse() -> Opts {
    let args: Vec<String> = std::env::args().collect();
    let full = args.iter().any(|a| a == "--bench");
    let get = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let num =
        |name: &str, default: usize| get(name).map_or(default, |v| v.parse().expect("a number"));
    let rate = num("--rate", 0);
    Opts {
        actions: num("--actions", if full { 20_000 } else { 300 }),
        naive_actions: num("--naive-actions", if full { 2_000 } else { 60 }),
        dup: get("--dup").map_or(0.1, |v| v.parse().expect("a ratio")),
        latency_ms: num("--latency-ms", 0) as u64,
        partitions: num("--partitions", 6) as i32,
        outcome_partitions: num("--outcome-partitions", num("--partitions", 6)) as i32,
        payload: num("--payload", 200),
        concurrency: num("--concurrency", 256),
        rate,
        tick_ms: num("--tick-ms", 10).max(1) as u64,
        send_linger_ms: num("--send-linger-ms", if rate > 0 { 1 } else { 5 }) as u64,
        prefill: num("--prefill", 0),
        prune_interval: get("--prune-interval"),
        prune_share: get("--prune-share").map_or(0.1, |v| v.parse().expect("a share")),
        slow_share: get("--slow-share").map_or(0.0, |v| v.parse().expect("a share")),
        slow_ms: num("--slow-ms", 200) as u64,
        modes: get("--modes").map_or_else(
            || vec!["idem".into(), "naive".into()],
            |m| m.split(',').map(str::to_string).collect(),
        ),
        full,
    }
}

fn brokers() -> String {
    std::env::var("IDEM_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// Every relay of a run connects with this URL. Without TLS by default, like the run's Kafka
/// clients: the local Postgres has `ssl = on` (for the TLS tests), and the peers' clients would
/// otherwise differ (idem's and DBOS' prefer TLS, as libpq does; the naive relay's does not).
fn postgres_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://idem:idem@127.0.0.1:5432/idem?sslmode=disable".into())
}

#[derive(Debug, Default)]
struct Report {
    mode: String,
    actions: usize,
    distinct: usize,
    seconds: f64,
    p50_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    cpu_seconds: f64,
    peak_rss_mib: f64,
    commits_per_action: f64,
    effects: u64,
}

impl Report {
    fn throughput(&self) -> f64 {
        self.actions as f64 / self.seconds
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--naive-worker") {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(naive::run(serde_json::from_str(&args[2]).unwrap()));
        return;
    }
    let opts = parse();
    assert!(
        (0.0..=1.0).contains(&opts.slow_share),
        "--slow-share is a share of the keys, from 0 to 1"
    );
    assert!(
        opts.slow_share == 0.0 || opts.modes == ["idem"],
        "--slow-share is measured for idem only (--modes idem): the peers call one downstream"
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut reports = Vec::new();
    for mode in &opts.modes {
        // The slow baselines get fewer actions, so a run ends in minutes.
        let n = if mode == "idem" {
            opts.actions
        } else {
            opts.naive_actions
        };
        let r = rt.block_on(run_mode(mode, n, &opts));
        check(&r);
        reports.push(r);
    }
    print_table(&opts, &reports);
}

fn check(r: &Report) {
    assert_eq!(
        r.effects, r.distinct as u64,
        "{}: effects at the downstream must equal distinct keys",
        r.mode
    );
}

fn print_table(opts: &Opts, reports: &[Report]) {
    println!(
        "\nworkload: {} dup ratio, {} ms downstream, {} partitions ({} for outcomes), {} B args, concurrency {}, rate {}{}, sends lingering {} ms{}",
        opts.dup,
        opts.latency_ms,
        opts.partitions,
        opts.outcome_partitions,
        opts.payload,
        opts.concurrency,
        if opts.rate == 0 { "flat out".to_string() } else { format!("{}/s", opts.rate) },
        if opts.rate == 0 { String::new() } else { format!(" in {} ms ticks", opts.tick_ms) },
        opts.send_linger_ms,
        if opts.full { "" } else { " (smoke)" }
    );
    println!("| mode | actions | actions/s | ratio to idem | p50 ms | p99 ms | p99.9 ms | relay CPU s | peak RSS MiB | PG commits/action | effects == distinct keys |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let idem = reports
        .iter()
        .find(|r| r.mode == "idem")
        .map(Report::throughput);
    for r in reports {
        let ratio = idem.map_or("-".into(), |t| format!("{:.3}", r.throughput() / t));
        println!(
            "| {} | {} | {:.0} | {} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} | {:.2} | {} == {} |",
            r.mode,
            r.actions,
            r.throughput(),
            ratio,
            r.p50_ms,
            r.p99_ms,
            r.p999_ms,
            r.cpu_seconds,
            r.peak_rss_mib,
            r.commits_per_action,
            r.effects,
            r.distinct
        );
    }
}

/// One event per action; `dup` of them repeat an earlier key (half replays, half rewordings).
/// `tag` makes the run's keys and event ids its own, so runs can share idem's tables
/// (`IDEM_BENCH_SCHEMA`). A `slow` share of the keys, spread evenly, name the tool `slow`.
fn workload(n: usize, dup: f64, payload: usize, slow: f64, tag: &str) -> Workload {
    let distinct = ((n as f64) * (1.0 - dup)).round().max(1.0) as usize;
    let pad = "x".repeat(payload);
    // Key k is slow when the running count of slow keys steps up at k.
    let is_slow = |k: usize| ((k + 1) as f64 * slow).floor() > (k as f64 * slow).floor();
    let mut slow_ids = std::collections::HashSet::new();
    let events = (0..n)
        .map(|i| {
            let k = if i < distinct { i } else { (i * 7919) % distinct };
            let subject = if i >= distinct && i % 2 == 1 { "reworded" } else { "hello" };
            let id = format!("{tag}-{i}");
            let tool = if is_slow(k) {
                slow_ids.insert(id.clone());
                "slow"
            } else {
                "send"
            };
            let event = json!({
                "specversion": "1.0", "id": id, "source": "bench", "type": "dev.idem.action.v1",
                "data": {"run_id": format!("{tag}-run-{}", k % 97), "tool": tool, "business_id": format!("b{k}"),
                         "args": {"to": format!("c{k}"), "subject": subject, "pad": pad}}
            });
            (id, event)
        })
        .collect();
    Workload {
        events,
        distinct,
        slow_ids,
    }
}

/// An answered action's times: its send → its outcome seen by the load generator's consumer,
/// its outcome's Kafka timestamp and its send, in Unix milliseconds.
struct Timed {
    latency_ms: f64,
    produced_ms: i64,
    sent_ms: i64,
}

impl Timed {
    /// When its outcome was seen, in Unix milliseconds.
    fn seen_ms(&self) -> f64 {
        self.sent_ms as f64 + self.latency_ms
    }
}

/// The `p` quantile of `v`, sorted.
fn percentile(v: &[f64], p: f64) -> f64 {
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

struct Workload {
    events: Vec<(String, Value)>,
    distinct: usize,
    /// The ids of the events naming the tool `slow`.
    slow_ids: std::collections::HashSet<String>,
}

/// The action event id an outcome answers (`data.action_event_id`), read without building the
/// whole event: the collector runs on the cores it measures.
fn answered_id(payload: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Outcome<'a> {
        #[serde(borrow)]
        data: Data<'a>,
    }
    #[derive(serde::Deserialize)]
    struct Data<'a> {
        #[serde(borrow)]
        action_event_id: Option<std::borrow::Cow<'a, str>>,
    }
    let outcome: Outcome<'_> = serde_json::from_slice(payload).ok()?;
    outcome.data.action_event_id.map(|id| id.into_owned())
}

/// Makes a run's topics, one replica each (the local broker is a single node).
async fn create_topics(names: &[&str], partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = bench_client().create().unwrap();
    let topics: Vec<NewTopic<'_>> = names
        .iter()
        .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(1)))
        .collect();
    admin
        .create_topics(&topics, &AdminOptions::new())
        .await
        .unwrap();
}

/// Deletes a run's topics once it is over; a topic that cannot be deleted is named, not fatal.
async fn delete_topics(names: &[&str]) {
    let admin: AdminClient<DefaultClientContext> = bench_client().create().unwrap();
    match admin.delete_topics(names, &AdminOptions::new()).await {
        Ok(results) => {
            for r in results {
                if let Err((topic, code)) = r {
                    eprintln!("topic {topic} left behind: {code}");
                }
            }
        }
        Err(e) => eprintln!("topics {names:?} left behind: {e}"),
    }
}

/// Committed transactions in this database. Postgres publishes its counters about once a
/// second, so the reading waits for them to settle.
async fn pg_commits(client: &tokio_postgres::Client) -> i64 {
    tokio::time::sleep(Duration::from_millis(1500)).await;
    client
        .batch_execute("select pg_stat_clear_snapshot()")
        .await
        .unwrap();
    client
        .query_one(
            "select xact_commit from pg_stat_database where datname = current_database()",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn proc_stats(pid: u32) -> (f64, f64) {
    let cpu = stat_fields(pid).map_or(0.0, |(_, f)| cpu_seconds(&f, UTIME));
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm_kib = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    (cpu, hwm_kib / 1024.0)
}

/// Where utime is among [`stat_fields`] (field 14 of `man 5 proc`); stime follows it, and the
/// reaped children's cutime and cstime follow that.
const UTIME: usize = 11;

/// The CPU seconds of the two tick counters from `at` among [`stat_fields`].
fn cpu_seconds(fields: &[u64], at: usize) -> f64 {
    let tick = |i: usize| fields.get(i).copied().unwrap_or(0);
    (tick(at) + tick(at + 1)) as f64 / 100.0
}

/// Every process on this host: its pid, command name and [`stat_fields`].
fn processes() -> Vec<(u32, String, Vec<u64>)> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let (comm, fields) = stat_fields(pid)?;
            Some((pid, comm, fields))
        })
        .collect()
}

/// `/proc/<pid>/stat`'s fields after the command name (the state is the first, the parent
/// the second).
fn stat_fields(pid: u32) -> Option<(String, Vec<u64>)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (head, tail) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_string();
    // The state is not a number: it parses as 0, which keeps the indexes of `man 5 proc`
    // less three (utime is field 14, so index 11).
    let fields = tail
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    Some((comm, fields))
}

/// CPU seconds used so far by the other processes on this host that a run makes work:
/// Postgres (every `postgres` process, and the children its postmaster has reaped, the
/// backends that exited), the Kafka broker (a process running `kafka.Kafka`) and this
/// process (the load generator, the fake downstream and the outcome consumer). A service not
/// running on this host reads as zero.
#[derive(Clone, Copy, Default)]
struct HostCpu {
    postgres: f64,
    broker: f64,
    bench: f64,
    /// The host's CPU time stolen by its hypervisor, and all its CPU time, in ticks
    /// (`/proc/stat`).
    steal: u64,
    ticks: u64,
}

impl HostCpu {
    fn read() -> Self {
        let mut cpu = HostCpu::default();
        let stats = processes();
        let postgres: std::collections::HashSet<u32> = stats
            .iter()
            .filter(|(_, comm, _)| comm == "postgres")
            .map(|(p, _, _)| *p)
            .collect();
        let me = std::process::id();
        for (pid, comm, f) in &stats {
            if comm == "postgres" {
                cpu.postgres += cpu_seconds(f, UTIME);
                // The postmaster: a postgres process whose parent is not one.
                let parent = f.get(1).map_or(0, |p| *p as u32);
                if !postgres.contains(&parent) {
                    cpu.postgres += cpu_seconds(f, UTIME + 2);
                }
            } else if *pid == me {
                cpu.bench += cpu_seconds(f, UTIME);
            } else if comm == "java" && is_broker(*pid) {
                cpu.broker += cpu_seconds(f, UTIME);
            }
        }
        // The first line: user nice system idle iowait irq softirq steal guest guest_nice.
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let ticks: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|v| v.parse().unwrap_or(0))
            .collect();
        cpu.ticks = ticks.iter().sum();
        cpu.steal = ticks.get(7).copied().unwrap_or(0);
        cpu
    }

    /// The share of the host's CPU time its hypervisor took from it since `before`.
    fn steal_since(&self, before: &HostCpu) -> f64 {
        let ticks = self.ticks.saturating_sub(before.ticks).max(1);
        self.steal.saturating_sub(before.steal) as f64 / ticks as f64 * 100.0
    }

    /// The CPU used from `before` to now, per action in microseconds, with the relay's.
    fn per_action_line(&self, before: &HostCpu, relay_seconds: f64, actions: usize) -> String {
        let us = |s: f64| s / actions as f64 * 1e6;
        let parts = [
            ("Postgres", self.postgres - before.postgres),
            ("relay", relay_seconds),
            ("broker", self.broker - before.broker),
            ("load generator and downstream", self.bench - before.bench),
        ];
        let total: f64 = parts.iter().map(|(_, s)| s).sum();
        let named: Vec<String> = parts
            .iter()
            .map(|(name, s)| format!("{name} {:.0}", us(*s)))
            .collect();
        format!(
            "CPU µs per action: {}; together {:.0}",
            named.join(", "),
            us(total)
        )
    }
}

/// A process running the Kafka broker (`kafka.Kafka`).
fn is_broker(pid: u32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    cmdline.windows(11).any(|w| w == b"kafka.Kafka")
}

/// The broker's garbage collections so far, as the JDK's `jstat -gc` reads them (`None` for a
/// broker `jstat` cannot read: on another host, in a container, without `jstat`, or a
/// collector without young collections, as ZGC in Java 17). Its pauses stop every Kafka request meanwhile, a part
/// of the paced runs' p99 that grows with the broker's uptime (G1 shrinks its young
/// generation to meet its pause goal, and collects more often: `benches/HISTORY.md`, stop 41).
#[derive(Clone, Copy, Debug, PartialEq)]
struct BrokerGc {
    young: u64,
    young_secs: f64,
    full: u64,
    full_secs: f64,
    /// G1's pauses in its concurrent cycles (remark and cleanup).
    concurrent: u64,
    concurrent_secs: f64,
}

impl BrokerGc {
    /// `jstat` starts a JVM of its own (about half a second of CPU): read outside the window
    /// whose CPU is measured.
    async fn read() -> Option<Self> {
        let pid = processes()
            .into_iter()
            .find(|(pid, comm, _)| comm == "java" && is_broker(*pid))?
            .0;
        let out = tokio::process::Command::new("jstat")
            .args(["-gc", &pid.to_string()])
            .output()
            .await
            .ok()?;
        BrokerGc::parse(&String::from_utf8_lossy(&out.stdout))
    }

    /// `jstat -gc`'s two lines: the columns' names, then their values.
    fn parse(text: &str) -> Option<Self> {
        let mut lines = text.lines();
        let (names, values) = (lines.next()?, lines.next()?);
        let columns: HashMap<&str, &str> = names
            .split_whitespace()
            .zip(values.split_whitespace())
            .collect();
        let number = |name: &str| columns.get(name)?.parse::<f64>().ok();
        Some(BrokerGc {
            young: number("YGC")? as u64,
            young_secs: number("YGCT")?,
            full: number("FGC")? as u64,
            full_secs: number("FGCT")?,
            concurrent: number("CGC").unwrap_or(0.0) as u64,
            concurrent_secs: number("CGCT").unwrap_or(0.0),
        })
    }

    /// The collections from `before` to `self`.
    fn since_line(&self, before: &BrokerGc) -> String {
        let young = self.young.saturating_sub(before.young);
        let young_ms = (self.young_secs - before.young_secs) * 1000.0;
        format!(
            "the broker's collector during the run: {young} young pauses, {young_ms:.0} ms in all{}{}",
            if young > 0 {
                format!(" ({:.0} ms each on average)", young_ms / young as f64)
            } else {
                String::new()
            },
            [
                ("full", self.full, before.full, self.full_secs - before.full_secs),
                (
                    "pauses in concurrent cycles",
                    self.concurrent,
                    before.concurrent,
                    self.concurrent_secs - before.concurrent_secs
                ),
            ]
            .iter()
            .filter(|(_, after, before, _)| after > before)
            .map(|(kind, after, before, secs)| format!(
                "; {} {kind}, {:.0} ms",
                after - before,
                secs * 1000.0
            ))
            .collect::<String>()
        )
    }
}

/// How long this host takes, in milliseconds, for a fixed piece of work like the relay's: an
/// outcome-sized JSON event parsed and written again 10,000 times on one core, the fastest of
/// three rounds (so a neighbour's burst on the other core counts less). This machine's speed
/// changes by the hour (a factor of two between runs of the same build), so a run is compared
/// only with runs whose host check was alike.
async fn host_check() -> f64 {
    tokio::task::spawn_blocking(|| {
        let event = json!({
            "specversion": "1.0", "type": "dev.idem.outcome.v1", "source": "idem",
            "id": "0f8fad5b-d9cb-469f-a165-70867728950e", "subject": "run-7:send:b42",
            "time": "2026-12-06T15:10:00.123Z", "datacontenttype": "application/json",
            "data": {"idempotency_key": "run-7:send:b42", "run_id": "run-7", "step": 3,
                     "tool": "send", "action_event_id": "bench-42", "status": "succeeded",
                     "result": {"id": "msg_42", "status": "sent", "to": "c42", "pad": "x".repeat(200)},
                     "duplicate": false, "attempts": 1, "note": "Done at 15:10:00 UTC (msg_42)."}
        });
        let text = serde_json::to_vec(&event).unwrap();
        let round = || {
            let started = Instant::now();
            let mut written = 0;
            for _ in 0..10_000 {
                let v: Value = serde_json::from_slice(std::hint::black_box(&text)).unwrap();
                written += serde_json::to_vec(&v).unwrap().len();
            }
            std::hint::black_box(written);
            started.elapsed().as_secs_f64() * 1000.0
        };
        (0..3).map(|_| round()).fold(f64::INFINITY, f64::min)
    })
    .await
    .unwrap()
}

/// `[relay]` settings from `IDEM_BENCH_RELAY` (`name=value,name=value`) written into idem's
/// config, to measure a setting (`batch_linger=2ms`); a value that is not a number is quoted.
fn relay_extra() -> String {
    env_pairs("IDEM_BENCH_RELAY")
        .into_iter()
        .map(|(k, v)| {
            if v.parse::<f64>().is_ok() {
                format!("{k} = {v}\n")
            } else {
                format!("{k} = \"{v}\"\n")
            }
        })
        .collect()
}

/// `name=value,name=value` from the environment variable `var`, trimmed; none when unset.
fn env_pairs(var: &str) -> Vec<(String, String)> {
    std::env::var(var)
        .unwrap_or_default()
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

/// librdkafka properties from `IDEM_BENCH_KAFKA` (`name=value,name=value`), set on the
/// benchmark's own clients and in idem's `kafka.client`, to measure a client setting.
fn kafka_extra() -> Vec<(String, String)> {
    env_pairs("IDEM_BENCH_KAFKA")
}

/// A client config for the benchmark's own clients.
fn bench_client() -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers());
    for (k, v) in kafka_extra() {
        c.set(k, v);
    }
    c
}

/// Where an action's time goes inside idem, from its own tables (p50 / p99 over this run's
/// first deliveries): send → the recording transaction begins (Kafka in, the consumer's poll);
/// → the finish begins (the record's commit, the dispatch, the call, the wait for the finish's
/// group), with the call itself (Postgres' `percentile_cont`, over the actions whose first
/// attempt is recorded); then, for each key's first action, the finish's beginning → the outcome
/// produced (its Kafka timestamp) → seen by the load generator's consumer (from `timed`;
/// nearest-rank percentiles over the keys whose outcome was seen).
/// `since`: the run's start; the run's intents are found by their creation time (a BRIN range
/// scan), not by scanning every intent (a prefilled schema holds millions).
async fn stages(
    pg: &tokio_postgres::Client,
    schema: &str,
    tag: &str,
    since: SystemTime,
    timed: &HashMap<&str, Timed>,
) {
    let query = format!(
        "with s as (
           select extract(epoch from i.created_at - i.event_time) * 1000 as to_record,
                  extract(epoch from i.finished_at - i.created_at) * 1000 as to_finish,
                  a.latency_ms as call
             from {schema}.intents i
             join {schema}.attempts a on a.intent_id = i.id and a.seq = 1
            where i.created_at >= $2 and i.run_id like $1 and i.event_time is not null)
         select percentile_cont(array[0.5, 0.99]) within group (order by to_record),
                percentile_cont(array[0.5, 0.99]) within group (order by to_finish),
                percentile_cont(array[0.5, 0.99]) within group (order by call)
           from s"
    );
    let row = match pg.query_one(&query, &[&format!("{tag}-%"), &since]).await {
        Ok(row) => row,
        Err(e) => return eprintln!("idem: stages not read: {e}"),
    };
    let p = |i: usize| -> String {
        let v: Option<Vec<f64>> = row.get(i);
        v.map_or("-".into(), |v| format!("{:.1} / {:.1}", v[0], v[1]))
    };
    // The rest, for each key's first action: the finish's beginning (its transaction's `now()`)
    // → the outcome produced (its Kafka timestamp, whole milliseconds: the finish's commit and
    // the publisher's round) → seen by the load generator's consumer.
    let finished = pg
        .query(
            &format!(
                "select action_event_id, extract(epoch from finished_at)::float8 * 1000
                   from {schema}.intents
                  where created_at >= $2 and run_id like $1 and finished_at is not null"
            ),
            &[&format!("{tag}-%"), &since],
        )
        .await;
    let rest = match finished {
        Ok(rows) => {
            let (mut to_produced, mut to_seen): (Vec<f64>, Vec<f64>) = rows
                .iter()
                .filter_map(|r| {
                    let t = timed.get(r.get::<_, &str>(0))?;
                    let finished: f64 = r.get(1);
                    let produced = t.produced_ms as f64;
                    Some((produced - finished, t.seen_ms() - produced))
                })
                .unzip();
            to_produced.sort_by(f64::total_cmp);
            to_seen.sort_by(f64::total_cmp);
            if to_produced.is_empty() {
                String::new()
            } else {
                format!(
                    "; → outcome produced {:.0} / {:.0}; → seen {:.0} / {:.0}",
                    percentile(&to_produced, 0.5),
                    percentile(&to_produced, 0.99),
                    percentile(&to_seen, 0.5),
                    percentile(&to_seen, 0.99)
                )
            }
        }
        Err(e) => format!("; the rest not read: {e}"),
    };
    eprintln!(
        "idem: stages p50 / p99 ms: send → record begins {}; → finish begins {} (the call {}){rest}",
        p(0),
        p(1),
        p(2)
    );
}

/// The prefilled keys (`--prefill`) still in idem's tables.
async fn count_old_keys(pg: &tokio_postgres::Client, schema: &str) -> i64 {
    pg.query_one(
        &format!("select count(*) from {schema}.intents where idempotency_key like 'old-%'"),
        &[],
    )
    .await
    .expect("count the prefilled keys")
    .get(0)
}

/// Writes `n` finished keys (each with its attempt and published outcome, a tenth with a
/// replay's delivery as well, sized like the workload's) into `schema`, as months of traffic
/// would have left them, then prints each table's size with its indexes, per million keys.
async fn prefill(pg: &tokio_postgres::Client, schema: &str, n: usize, payload: usize) {
    let started = Instant::now();
    let n = n as i64;
    let fill = format!(
        "set search_path = {schema};
         insert into intents (idempotency_key, tool, class, run_id, step, business_id, args, material,
                              fingerprint, args_hash, action_event_id, source_topic, source_partition,
                              source_offset, status, result, attempts, status_seq, lease_epoch,
                              created_at, updated_at, finished_at)
         select 'old-' || (g / 10) || ':send:b' || g, 'send', 'dangerous', 'old-' || (g / 10), 1, 'b' || g,
                jsonb_build_object('to', 'customer-' || g, 'body', repeat('x', {payload})),
                jsonb_build_object('args.to', 'customer-' || g), md5('f' || g), md5('a' || g),
                'old-evt-' || g, 'old.actions', g % 6, g, 'succeeded',
                jsonb_build_object('id', 'eff_' || g, 'tool', 'send', 'key', 'old-' || (g / 10) || ':send:b' || g),
                1, 1, 1, t, t + interval '4 ms', t + interval '4 ms'
           from generate_series(1, {n}) g,
                lateral (select now() - interval '30 days' + g * interval '200 ms' as t) tt;
         insert into deliveries (intent_id, idempotency_key, action_event_id, source_topic,
                                 source_partition, source_offset, origin, received_at, answered)
         select id, idempotency_key, 'old-replay-' || id, source_topic, source_partition,
                source_offset + 1, 'replay', created_at, true
           from intents where idempotency_key like 'old-%' and id % 10 = 0;
         insert into attempts (intent_id, idempotency_key, seq, kind, reason, owner, lease_epoch,
                               started_at, ended_at, classification, http_status, latency_ms)
         select id, idempotency_key, 1, 'call', 'first', 'old-relay', 1, created_at,
                created_at + interval '3 ms', 'succeeded', 200, 3.0
           from intents where idempotency_key like 'old-%';
         insert into outbox (event_id, kafka_key, payload, created_at, published_at)
         select md5('o' || id), idempotency_key,
                jsonb_build_object('specversion', '1.0', 'type', 'dev.idem.outcome.v1', 'source', 'idem',
                                   'id', md5('o' || id), 'subject', idempotency_key, 'time', finished_at,
                                   'datacontenttype', 'application/json',
                                   'data', jsonb_build_object('idempotency_key', idempotency_key,
                                       'run_id', run_id, 'step', step, 'tool', tool,
                                       'action_event_id', action_event_id, 'status', status,
                                       'result', result, 'error', null, 'duplicate', false,
                                       'attempts', 1, 'note', 'Done once.')),
                finished_at, finished_at + interval '2 ms'
           from intents where idempotency_key like 'old-%';
         analyze;"
    );
    pg.batch_execute(&fill).await.expect("prefill");
    eprintln!(
        "prefilled {n} finished keys in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    for table in ["intents", "deliveries", "attempts", "outbox"] {
        let row = pg
            .query_one(
                &format!(
                    "select pg_table_size('{schema}.{table}'), pg_indexes_size('{schema}.{table}')"
                ),
                &[],
            )
            .await
            .unwrap();
        let (heap, indexes): (i64, i64) = (row.get(0), row.get(1));
        let per_million = |b: i64| b as f64 / 1048576.0 / (n as f64 / 1e6);
        eprintln!(
            "{table}: {:.0} MiB table + {:.0} MiB indexes per million keys",
            per_million(heap),
            per_million(indexes)
        );
    }
}

/// `pid` and its descendants, read from /proc once: a relay that starts its own processes (the
/// restate peer's server and service) is measured whole.
fn process_tree(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = processes()
        .into_iter()
        .filter_map(|(p, _, f)| Some((p, *f.get(1)? as u32)))
        .collect();
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    tree
}

/// CPU seconds and peak RSS summed over processes; the RSS sum is of each one's own peak, so
/// for several processes it is an upper bound.
fn tree_stats(pids: &[u32]) -> (f64, f64) {
    pids.iter()
        .map(|p| proc_stats(*p))
        .fold((0.0, 0.0), |(c, r), (pc, pr)| (c + pc, r + pr))
}

/// A relay's process, stopped when dropped (a run that panics) unless it has been stopped or
/// has exited already.
struct KilledOnDrop(std::process::Child);

impl KilledOnDrop {
    /// Asks the process to stop (a launcher such as Restate's stops its own children on TERM)
    /// and waits for it; with a `grace`, kills it if it is still there after that long.
    fn stop(&mut self, grace: Option<Duration>) {
        if !matches!(self.0.try_wait(), Ok(None)) {
            return;
        }
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let Some(grace) = grace else {
            let _ = self.0.wait();
            return;
        };
        let deadline = Instant::now() + grace;
        while matches!(self.0.try_wait(), Ok(None)) {
            if Instant::now() > deadline {
                let _ = self.0.kill();
                let _ = self.0.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        self.stop(Some(Duration::from_secs(5)));
    }
}

/// Forwards a child's stdout to stderr; the receiver resolves when a line contains `ready`, and
/// fails if the child closes its stdout first.
fn ready_line(out: ChildStdout, ready: &'static str) -> tokio::sync::oneshot::Receiver<()> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if line.contains(ready) {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(());
                }
            }
        }
    });
    rx
}

async fn run_mode(mode: &str, n: usize, opts: &Opts) -> Report {
    let run_began = SystemTime::now();
    let base = format!(
        "bench_{}_{}",
        mode,
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let (actions, outcomes, dlq) = (
        format!("{base}.actions"),
        format!("{base}.outcomes"),
        format!("{base}.dlq"),
    );
    create_topics(&[&actions, &dlq], opts.partitions).await;
    create_topics(&[&outcomes], opts.outcome_partitions).await;
    let stop = CancellationToken::new();
    let downstream = FakeDownstream::new(false);
    let addr = downstream
        .clone()
        .spawn("127.0.0.1:0".parse().unwrap(), stop.clone())
        .await
        .unwrap();
    let delay = if opts.latency_ms > 0 {
        format!("?delay_ms={}", opts.latency_ms)
    } else {
        String::new()
    };
    let url = format!("http://{addr}/v1/send{delay}");

    // IDEM_BENCH_SCHEMA keeps idem's tables across runs (a prefilled schema measured several
    // ways); by default each run has its own.
    let pg_schema = std::env::var("IDEM_BENCH_SCHEMA").unwrap_or_else(|_| base.clone());
    let (pg, conn) = tokio_postgres::connect(&postgres_url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let dir = tempfile::tempdir().unwrap();
    let mut old_keys = None;
    // A tool of the workload's, its calls to `url`.
    let tool = |name: &str, url: &str| {
        format!(
            r#"[[tools]]
name = "{name}"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.to"]
executor = {{ kind = "http", url = "{url}", timeout = "10s" }}
verify = {{ url = "http://{addr}/v1/effects/{{key}}" }}
"#
        )
    };
    let child = match mode {
        "idem" => {
            let config = format!(
                r#"
[kafka]
brokers = "{brokers}"
group_id = "{base}"
actions_topic = "{actions}"
outcomes_topic = "{outcomes}"
dlq_topic = "{dlq}"
partitions = {partitions}
[kafka.client]
{kafka_extra}
[postgres]
url = "{pg}"
schema = "{schema}"
pool_size = 16
[relay]
concurrency = {concurrency}
prune_interval = "{prune}"
prune_share = {prune_share}
{relay_extra}
[admin]
listen = "127.0.0.1:0"
{send}{slow}"#,
                send = tool("send", &url),
                slow = tool(
                    "slow",
                    &format!("http://{addr}/v1/send?delay_ms={}", opts.slow_ms)
                ),
                brokers = brokers(),
                partitions = opts.partitions,
                pg = postgres_url(),
                concurrency = opts.concurrency,
                prune = opts.prune_interval.as_deref().unwrap_or("10m"),
                prune_share = opts.prune_share,
                kafka_extra = kafka_extra()
                    .iter()
                    .map(|(k, v)| format!("\"{k}\" = \"{v}\"\n"))
                    .collect::<String>(),
                schema = pg_schema,
                relay_extra = relay_extra(),
            );
            let path = dir.path().join("idem.toml");
            std::fs::write(&path, config).unwrap();
            let config = idem::config::Config::load(&path, |_| None).unwrap();
            idem::db::migrate(&config.postgres).await.unwrap();
            if opts.prefill > 0 {
                prefill(&pg, &pg_schema, opts.prefill, opts.payload).await;
            }
            // Counted (a scan of every intent) only when pruning runs.
            if opts.prune_interval.is_some() {
                old_keys = Some(count_old_keys(&pg, &pg_schema).await);
            }
            // IDEM_BENCH_BIN runs another build of the relay (an A/B of two commits).
            let bin = std::env::var("IDEM_BENCH_BIN")
                .unwrap_or_else(|_| env!("CARGO_BIN_EXE_idem").to_string());
            std::process::Command::new(bin)
                .args(["relay", "--config", path.to_str().unwrap()])
                .env("IDEM_LOG", "warn")
                .spawn()
                .unwrap()
        }
        "naive" => {
            let spec = json!({"brokers": brokers(), "group": base, "actions": actions, "outcomes": outcomes,
                              "pg": postgres_url(), "schema": base, "url": url});
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--naive-worker", &spec.to_string()])
                .spawn()
                .unwrap()
        }
        "dbos" => {
            let python = std::env::var("IDEM_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
            let spec = json!({"brokers": brokers(), "group": base, "actions": actions, "outcomes": outcomes,
                              "pg_url": postgres_url(), "url": url});
            let script =
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/dbos_relay.py");
            std::process::Command::new(python)
                .args([script.to_str().unwrap(), &spec.to_string()])
                .spawn()
                .expect("a python with dbos, confluent-kafka and requests (IDEM_BENCH_PYTHON)")
        }
        "restate" => {
            let node = std::env::var("IDEM_BENCH_NODE").unwrap_or_else(|_| "node".into());
            let spec = json!({"brokers": brokers(), "group": base, "actions": actions, "outcomes": outcomes,
                              "url": url});
            let script =
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/restate/launch.mjs");
            let mut child = std::process::Command::new(node)
                .args([script.to_str().unwrap(), &spec.to_string()])
                .stdout(Stdio::piped())
                .spawn()
                .expect("a node (IDEM_BENCH_NODE), after `npm ci --prefix benches/restate`");
            // It says so once its subscription's consumer group has its partitions.
            let ready = ready_line(child.stdout.take().unwrap(), "restate peer ready");
            match tokio::time::timeout(Duration::from_secs(120), ready).await {
                Ok(Ok(())) => child,
                late_or_dead => {
                    let _ = child.kill();
                    panic!("restate peer not ready: {late_or_dead:?}")
                }
            }
        }
        other => panic!("unknown mode {other}: use idem, naive, dbos or restate"),
    };
    // Killed if the run fails before it stops the relay, so a failed run leaves no relay behind.
    let mut child = KilledOnDrop(child);
    let pids = process_tree(child.0.id());

    // Collect outcomes from the start of the topic.
    // Action event id → when the collector saw its first outcome, and that outcome's Kafka
    // timestamp (when the relay handed it to its producer).
    let answered: Arc<Mutex<HashMap<String, (Instant, i64)>>> = Arc::default();
    let consumer: BaseConsumer = bench_client()
        .set("group.id", format!("{base}.collector"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[&outcomes]).unwrap();
    // A thread of its own, as a consumer of outcomes would be a process of its own: a task on
    // the runtime that also sends the actions and serves the fake downstream waited behind them
    // for a worker before it could stamp what it had received.
    let collector = {
        let answered = answered.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.is_cancelled() {
                let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) else {
                    continue;
                };
                let seen = Instant::now();
                if let Some(id) = m.payload().and_then(answered_id) {
                    let produced = m.timestamp().to_millis().unwrap_or(0);
                    answered
                        .lock()
                        .unwrap()
                        .entry(id)
                        .or_insert((seen, produced));
                }
            }
        })
    };

    let Workload {
        events,
        distinct,
        slow_ids,
    } = workload(n, opts.dup, opts.payload, opts.slow_share, &base);
    let producer: FutureProducer = bench_client()
        .set("linger.ms", opts.send_linger_ms.to_string())
        .set("enable.idempotence", "true")
        .create()
        .unwrap();
    // Let the relay join its group before the clock starts; the host is checked meanwhile.
    let joined = tokio::time::sleep(Duration::from_secs(3));
    let check_before = host_check().await;
    joined.await;
    let gc_before = BrokerGc::read().await;
    let commits_before = pg_commits(&pg).await;
    let (cpu_before, _) = tree_stats(&pids);
    let host_before = HostCpu::read();
    let started = Instant::now();
    let mut published: HashMap<String, (Instant, i64)> = HashMap::with_capacity(n);
    // Flat out, or in ticks of a tick's share of the rate (at least one action a tick).
    let chunk_size = if opts.rate == 0 {
        1000
    } else {
        (opts.rate * opts.tick_ms as usize / 1000).max(1)
    };
    let mut tick = tokio::time::interval(Duration::from_millis(opts.tick_ms));
    for chunk in events.chunks(chunk_size) {
        if opts.rate > 0 {
            tick.tick().await;
        }
        let sends: Vec<_> = chunk
            .iter()
            .map(|(id, e)| {
                published.insert(id.clone(), (Instant::now(), unix_ms()));
                // The CloudEvents time of the send, so idem's tables date each stage from it.
                let mut e = e.clone();
                e["time"] =
                    json!(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true));
                let payload = serde_json::to_vec(&e).unwrap();
                let key = e["data"]["run_id"].as_str().unwrap().to_string();
                let producer = producer.clone();
                let topic = actions.clone();
                async move {
                    producer
                        .send(
                            FutureRecord::to(&topic).key(&key).payload(&payload),
                            Duration::from_secs(30),
                        )
                        .await
                        .map_err(|(e, _)| e)
                        .unwrap();
                }
            })
            .collect();
        if opts.rate > 0 {
            // Keep the pace: acknowledgements are awaited in the background.
            tokio::spawn(futures::future::join_all(sends));
        } else {
            futures::future::join_all(sends).await;
        }
    }
    eprintln!(
        "{mode}: {n} actions published in {:.2}s",
        started.elapsed().as_secs_f64()
    );
    let deadline = Instant::now() + Duration::from_secs(if opts.full { 900 } else { 120 });
    let mut peak_rss: f64 = 0.0;
    loop {
        peak_rss = peak_rss.max(tree_stats(&pids).1);
        // The topic is this run's, so it answers only this run's ids: the count says when
        // every id may be in, and only then are they looked up (once, under one lock). The
        // load generator shares the cores it measures; a scan of every answer every 20 ms had
        // cost it about as much CPU as parsing the answers.
        let done = {
            let a = answered.lock().unwrap();
            if a.len() >= n && events.iter().all(|(id, _)| a.contains_key(id)) {
                break;
            }
            a.len()
        };
        assert!(
            Instant::now() < deadline,
            "{mode}: only {done} of {n} actions answered in time"
        );
        // A relay that exited (refused to start, crashed) answers nothing more: say so now
        // rather than at the deadline, fifteen minutes later for a long run.
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!("{mode}: the relay exited ({status}) with {done} of {n} actions answered");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let finished = answered
        .lock()
        .unwrap()
        .values()
        .map(|(t, _)| *t)
        .max()
        .unwrap();
    let seconds = finished.duration_since(started).as_secs_f64();
    let (cpu_after, hwm) = tree_stats(&pids);
    let host_cpu = HostCpu::read();
    let check_after = host_check().await;
    let gc_after = BrokerGc::read().await;
    let commits = pg_commits(&pg).await - commits_before;
    // End to end (send → outcome seen), and its first part: send → outcome produced by the
    // relay (the outcome's Kafka timestamp, millisecond resolution).
    let timed: HashMap<&str, Timed> = {
        let a = answered.lock().unwrap();
        published
            .iter()
            .map(|(id, (t, sent_ms))| {
                let (seen, produced_ms) = a[id];
                let latency_ms = seen.duration_since(*t).as_secs_f64() * 1000.0;
                let timed = Timed {
                    latency_ms,
                    produced_ms,
                    sent_ms: *sent_ms,
                };
                (id.as_str(), timed)
            })
            .collect()
    };
    let (mut latencies, mut to_produced): (Vec<f64>, Vec<f64>) = timed
        .values()
        .map(|t| (t.latency_ms, (t.produced_ms - t.sent_ms) as f64))
        .unzip();
    if !slow_ids.is_empty() {
        let (mut slow, mut fast): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
        for (id, t) in &timed {
            if slow_ids.contains(*id) {
                slow.push(t.latency_ms);
            } else {
                fast.push(t.latency_ms);
            }
        }
        for (tool, v) in [("send", &mut fast), ("slow", &mut slow)] {
            if v.is_empty() {
                continue;
            }
            v.sort_by(f64::total_cmp);
            eprintln!(
                "{mode}: tool {tool} alone ({} actions): send → outcome seen p50 {:.1} ms, p99 {:.1} ms",
                v.len(),
                percentile(v, 0.5),
                percentile(v, 0.99)
            );
        }
    }
    latencies.sort_by(f64::total_cmp);
    to_produced.sort_by(f64::total_cmp);
    let pct = |p: f64| percentile(&latencies, p);
    eprintln!(
        "{mode}: send → outcome produced p50 {:.0} ms, p99 {:.0} ms; send → outcome seen p50 {:.1} ms, p99 {:.1} ms",
        percentile(&to_produced, 0.5),
        percentile(&to_produced, 0.99),
        pct(0.5),
        pct(0.99)
    );
    eprintln!(
        "{mode}: {}",
        host_cpu.per_action_line(&host_before, cpu_after - cpu_before, n)
    );
    eprintln!(
        "{mode}: host check {check_before:.0} ms before the run, {check_after:.0} ms after (lower is faster); steal {:.1} % of the host's CPU time during the run",
        host_cpu.steal_since(&host_before)
    );
    if let (Some(before), Some(after)) = (gc_before, gc_after) {
        eprintln!("{mode}: {}", after.since_line(&before));
    }
    // Paced only: flat out, each stage is mostly the backlog's queue.
    if mode == "idem" && opts.rate > 0 {
        stages(&pg, &pg_schema, &base, run_began, &timed).await;
    }
    if let Some(before) = old_keys {
        let after = count_old_keys(&pg, &pg_schema).await;
        if before > 0 {
            eprintln!(
                "{mode}: {} of {before} prefilled keys pruned during the run ({after} left)",
                before - after
            );
        }
    }
    child.stop(None);
    stop.cancel();
    let _ = tokio::task::spawn_blocking(move || collector.join()).await;
    // A run's own schema goes with it; one named by IDEM_BENCH_SCHEMA stays for the next run.
    if std::env::var("IDEM_BENCH_SCHEMA").is_err() {
        if let Err(e) = pg
            .batch_execute(&format!("drop schema if exists {base} cascade"))
            .await
        {
            eprintln!("{mode}: schema {base} left behind: {e}");
        }
    }
    // Its topics too: a broker holding the partitions of hundreds of earlier runs starts
    // slowly and spends more CPU on each run after.
    delete_topics(&[&actions, &outcomes, &dlq]).await;
    Report {
        mode: mode.to_string(),
        actions: n,
        distinct,
        seconds,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        p999_ms: pct(0.999),
        cpu_seconds: cpu_after - cpu_before,
        peak_rss_mib: peak_rss.max(hwm),
        commits_per_action: commits as f64 / n as f64,
        effects: downstream.total_effects(),
    }
}

/// The naive relay, honestly implemented: per message, one transaction to check the key and
/// insert "started", the call, one transaction to mark it done, the outcome produced and
/// awaited, the offset committed — one message at a time.
mod naive {
    use super::*;

    pub async fn run(spec: Value) {
        let s = |k: &str| spec[k].as_str().unwrap().to_string();
        let (client, conn) = tokio_postgres::connect(&s("pg"), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        let schema = s("schema");
        client
            .batch_execute(&format!(
                "create schema if not exists {schema};
                 set search_path = {schema};
                 create table if not exists naive_keys (key text primary key, status text not null, result jsonb)"
            ))
            .await
            .unwrap();
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", s("brokers"))
            .set("group.id", s("group"))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        consumer.subscribe(&[&s("actions")]).unwrap();
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", s("brokers"))
            .set("enable.idempotence", "true")
            .create()
            .unwrap();
        let http = reqwest::Client::new();
        let (url, outcomes) = (s("url"), s("outcomes"));
        loop {
            let m = consumer.recv().await.unwrap();
            let event: Value =
                serde_json::from_slice(m.payload().unwrap_or_default()).unwrap_or(Value::Null);
            let d = &event["data"];
            let key = format!(
                "{}:{}:{}",
                d["run_id"].as_str().unwrap_or(""),
                d["tool"].as_str().unwrap_or(""),
                d["business_id"].as_str().unwrap_or("")
            );
            let inserted = client
                .execute("insert into naive_keys (key, status) values ($1, 'started') on conflict do nothing", &[&key])
                .await
                .unwrap();
            let (result, duplicate) = if inserted == 1 {
                let body: Value = http
                    .post(&url)
                    .header("Idempotency-Key", &key)
                    .json(&d["args"])
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap_or(Value::Null);
                client
                    .execute(
                        "update naive_keys set status = 'done', result = $2 where key = $1",
                        &[&key, &body],
                    )
                    .await
                    .unwrap();
                (body, false)
            } else {
                let row = client
                    .query_one("select result from naive_keys where key = $1", &[&key])
                    .await
                    .unwrap();
                (row.get::<_, Option<Value>>(0).unwrap_or(Value::Null), true)
            };
            let outcome = json!({"specversion": "1.0", "type": "dev.idem.outcome.v1", "source": "naive",
                "id": uuid::Uuid::new_v4().to_string(), "subject": key,
                "data": {"idempotency_key": key, "action_event_id": event["id"], "status": "succeeded",
                         "result": result, "duplicate": duplicate}});
            let payload = serde_json::to_vec(&outcome).unwrap();
            producer
                .send(
                    FutureRecord::to(&outcomes).key(&key).payload(&payload),
                    Duration::from_secs(30),
                )
                .await
                .map_err(|(e, _)| e)
                .unwrap();
            consumer.commit_message(&m, CommitMode::Sync).unwrap();
        }
    }
}
