//! What SREs see: alert rules tested with promtool, the dashboard and rules checked against the
//! metrics the relay exports, explain after a timeout, a verify and a duplicate, and the trace
//! context carried from the action to the downstream and the outcome.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use common::{action, Env};
use idem::fake_downstream::Step;
use serde_json::json;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn alert_rules_pass_their_promtool_tests() {
    let out = std::process::Command::new("promtool")
        .args(["test", "rules", "alerts.test.yml"])
        .current_dir(root().join("deploy/prometheus"))
        .output()
        .expect("promtool runs (deploy/test.sh installs Debian's prometheus package)");
    common::assert_succeeded("promtool", &out);
}

/// `idem_*` names in a PromQL expression, histogram suffixes folded into their family.
fn metric_names(expr: &str, into: &mut BTreeSet<String>) {
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("idem_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let name = &expr[start..end];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|f| f.ends_with("_seconds") || f.ends_with("_per_action"))
            })
            .unwrap_or(name);
        into.insert(family.to_string());
        i = end;
    }
}

#[test]
fn every_metric_the_dashboard_and_rules_query_is_exported() {
    let exported: BTreeSet<String> = idem::metrics::Metrics::new()
        .names()
        .iter()
        .cloned()
        .collect();
    let mut queried = BTreeSet::new();
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/grafana/dashboards/idem.json")).unwrap(),
    )
    .unwrap();
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(variables, ["datasource", "instance", "tool"]);
    let mut panels = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            metric_names(expr, &mut queried);
            // Every panel follows the chosen data source and relays.
            assert_eq!(target["datasource"]["uid"], "${datasource}", "{expr}");
            assert!(expr.contains("instance=~\"$instance\""), "{expr}");
            panels += 1;
        }
    }
    let rules: serde_norway::Value = serde_norway::from_str(
        &std::fs::read_to_string(root().join("deploy/prometheus/alerts.yml")).unwrap(),
    )
    .unwrap();
    for group in rules["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            metric_names(rule["expr"].as_str().unwrap(), &mut queried);
        }
    }
    assert!(
        panels >= 10 && queried.len() >= 10,
        "{panels} targets, {queried:?}"
    );
    let missing: Vec<_> = queried.difference(&exported).collect();
    assert!(missing.is_empty(), "queried but not exported: {missing:?}");
}

const EMAIL: &str = r#"
[[tools]]
name = "send_email"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.to"]
executor = { kind = "http", url = "{downstream}/v1/send_email", timeout = "500ms" }
verify = { url = "{downstream}/v1/effects/{key}", backoff = "20ms" }
"#;

#[tokio::test]
async fn explain_shows_a_timeout_a_verify_and_a_duplicate() {
    let env = Env::new().await;
    let key = "r1:send_email:b1";
    env.downstream
        .script(Some(key), vec![Step::Named("effect_then_timeout".into())]);
    let outcomes = env.outcomes().await;
    let relay = env.start(env.config(EMAIL, "").await).await;
    let p = env.producer();
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut first = action(
        "e1",
        json!({"run_id": "r1", "tool": "send_email", "business_id": "b1", "args": {"to": "c"}}),
    );
    first["traceparent"] = json!(traceparent);
    p.send(&first).await;
    outcomes.answer("e1", "succeeded").await;
    p.send(&action("e2", json!({"run_id": "r1", "tool": "send_email", "business_id": "b1", "args": {"to": "c", "subject": "again"}}))).await;
    outcomes.answer("e2", "succeeded").await;
    // A repeat so malformed it never reaches the key's intent (no args) is still the key's.
    p.send(&action(
        "e3",
        json!({"run_id": "r1", "tool": "send_email", "idempotency_key": key}),
    ))
    .await;
    outcomes.answer("e3", "rejected").await;

    common::outbox_drained(&env.pg().await, "the outcomes published").await;
    let e = common::explain(&env, key).await;
    let deliveries = common::delivered(&e);
    assert_eq!(
        deliveries,
        [
            ("e1", "first"),
            ("e2", "model_retry"),
            ("e3", "dead_letter")
        ]
    );
    // What was asked, as the first delivery asked it: every argument, and the material ones.
    assert_eq!(e["args"], json!({"to": "c"}), "{e:#}");
    assert_eq!(e["material"], json!({"args.to": "c"}), "{e:#}");
    let calls: Vec<(&str, &str, &str)> = e["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["kind"].as_str().unwrap(),
                a["reason"].as_str().unwrap(),
                a["result"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        calls,
        [
            ("call", "first", "ambiguous"),
            ("verify", "transport_retry", "done")
        ]
    );
    assert!(
        e["calls"][0]["error"]
            .as_str()
            .unwrap()
            .contains("timed out"),
        "{e:#}"
    );
    let statuses: Vec<(&str, bool)> = e["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                o["status"].as_str().unwrap(),
                o["duplicate"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        statuses,
        [
            ("succeeded", false),
            ("succeeded", true),
            ("rejected", false)
        ]
    );
    assert!(
        e["outcomes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|o| o["published"] == true || o["direct"] == true),
        "every outcome out of the queue is shown published: {e:#}"
    );
    let text = idem::ops::render(&e);
    assert!(
        text.contains("model_retry")
            && text.contains("verify")
            && text.contains("(duplicate)")
            && text.contains(r#"material {"args.to":"c"}"#),
        "{text}"
    );

    // The same answer over HTTP.
    let http: serde_json::Value =
        reqwest::get(format!("http://{}/v1/actions/{key}", relay.admin()))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    let kinds = |v: &serde_json::Value| -> Vec<(String, String)> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|a| (a["kind"].to_string(), a["result"].to_string()))
            .collect()
    };
    assert_eq!(kinds(&http["calls"]), kinds(&e["calls"]));
    assert_eq!(http["deliveries"], e["deliveries"]);
    let missing = reqwest::get(format!("http://{}/v1/actions/nope", relay.admin()))
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);

    // The trace context went downstream and onto the outcome.
    assert_eq!(
        env.downstream.traceparent(key).as_deref(),
        Some(traceparent)
    );
    let published = outcomes.all();
    let first_outcome = published
        .iter()
        .find(|m| m.json()["data"]["action_event_id"] == "e1")
        .unwrap();
    assert_eq!(
        first_outcome.headers.get("traceparent").map(String::as_str),
        Some(traceparent)
    );
    assert_eq!(
        first_outcome
            .headers
            .get("content-type")
            .map(String::as_str),
        Some("application/cloudevents+json")
    );

    let m = common::metrics(relay.admin()).await;
    assert_eq!(
        common::sample(
            &m,
            r#"idem_verifications_total{result="done",tool="send_email"}"#
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        common::sample(
            &m,
            r#"idem_duplicates_total{origin="model_retry",tool="send_email"}"#
        ),
        1.0
    );
    assert_eq!(
        common::sample(&m, r#"idem_side_effects_total{tool="send_email"}"#),
        1.0
    );
    // Consumer lag comes from librdkafka's statistics, emitted every five seconds.
    common::eventually_metrics(
        "consumer lag per partition",
        std::time::Duration::from_secs(30),
        relay.admin(),
        |m| {
            (0..6).all(|p| {
                m.contains(&format!(
                    "idem_consumer_lag{{group=\"{}\",partition=\"{p}\",topic=\"{}\"}} 0",
                    env.group, env.actions
                ))
            })
        },
    )
    .await;
    relay.stop().await;
}

/// Right after start, before any action: every labelled counter family has a series at 0 for
/// each configured tool and every known label value, so `rate()` panels and `absent()` alerts
/// work on a quiet relay; build info and the process collector are there too.
#[tokio::test]
async fn every_series_exists_at_zero_right_after_start() {
    let env = Env::new().await;
    let tools = format!(
        "{EMAIL}{}",
        EMAIL.replace("name = \"send_email\"", "name = \"refund\"")
    );
    let relay = env.start(env.config(&tools, "").await).await;
    let text = common::metrics(relay.admin()).await;
    for tool in ["send_email", "refund"] {
        for series in [
            format!("idem_duplicates_total{{origin=\"model_retry\",tool=\"{tool}\"}} 0"),
            format!("idem_duplicates_total{{origin=\"replay\",tool=\"{tool}\"}} 0"),
            format!("idem_unknown_outcomes_total{{tool=\"{tool}\"}} 0"),
            format!("idem_retries_total{{reason=\"ambiguous\",tool=\"{tool}\"}} 0"),
            format!("idem_actions_total{{status=\"succeeded\",tool=\"{tool}\"}} 0"),
            format!("idem_rejections_total{{code=\"key_conflict\",tool=\"{tool}\"}} 0"),
            format!("idem_verifications_total{{result=\"done\",tool=\"{tool}\"}} 0"),
            format!("idem_side_effects_total{{tool=\"{tool}\"}} 0"),
            format!("idem_side_effect_duration_seconds_count{{tool=\"{tool}\"}} 0"),
        ] {
            assert!(text.contains(&series), "missing {series}");
        }
    }
    for series in [
        "idem_dead_letters_total{reason=\"not_json\"} 0",
        "idem_dead_letters_total{reason=\"unrecordable\"} 0",
        "idem_messages_consumed_total{origin=\"first\"} 0",
        "idem_keys_parked{status=\"pending_approval\"} 0",
        "idem_postgres_retries_total{stage=\"claim\"} 0",
        "idem_intents_pending 0",
    ] {
        assert!(text.contains(series), "missing {series}");
    }
    assert!(
        text.contains(&format!(
            "idem_outcomes_published_total{{topic=\"{}\"}} 0",
            env.outcomes
        )),
        "missing the outcomes topic's series"
    );
    assert!(text.contains("idem_build_info{revision="), "build info");
    assert!(
        text.contains("process_resident_memory_bytes"),
        "process collector"
    );
    relay.stop().await;
}

/// Regression: the action span was entered (not instrumented) across awaits, so under load one
/// action's log lines carried other actions' spans (`action{key=…0}:action{key=…12}`). With 200
/// actions in flight at once and JSON logs, every "outcome recorded" line sits in exactly one
/// action span, its own.
#[tokio::test(flavor = "multi_thread")]
async fn every_log_line_in_an_action_span_names_one_key() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let slow = EMAIL.replace("/v1/send_email\"", "/v1/send_email?delay_ms=30\"");
    let config = common::config_file(&env, dir.path(), &slow, "").await;
    let log_path = dir.path().join("relay.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut relay = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "--log-format",
            "json",
            "relay",
            "--config",
            config.to_str().unwrap(),
        ])
        .env("IDEM_LOG", "info")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let outcomes = env.outcomes().await;
    let p = env.producer();
    let ids: Vec<String> = (0..200).map(|i| format!("span-{i}")).collect();
    // Published again until the relay, still starting, has created the topic and answers.
    let events: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            action(
                id,
                json!({"run_id": "run_spans", "tool": "send_email", "business_id": format!("order-{i}"),
                       "args": {"to": "a"}}),
            )
        })
        .collect();
    common::eventually(
        "the relay answers",
        std::time::Duration::from_secs(60),
        || async {
            p.send(&events[0]).await;
            !outcomes.answers(&ids[0]).is_empty()
        },
    )
    .await;
    futures::future::join_all(events.iter().map(|e| p.send(e))).await;
    outcomes
        .answer_all(&ids, std::time::Duration::from_secs(120))
        .await;
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status();
    relay.wait().unwrap();
    let mut recorded = BTreeSet::new();
    for line in std::fs::read_to_string(&log_path).unwrap().lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let actions: Vec<&serde_json::Value> = v["spans"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["name"] == "action")
            .collect();
        let shown = &line[..line.len().min(600)];
        assert!(actions.len() <= 1, "a line in two action spans: {shown}");
        if v["fields"]["message"] == "outcome recorded" {
            assert_eq!(
                actions.len(),
                1,
                "an outcome recorded outside its span: {line}"
            );
            assert_eq!(v["span"]["key"], actions[0]["key"], "{line}");
            recorded.insert(actions[0]["key"].as_str().unwrap().to_string());
        }
    }
    assert_eq!(
        recorded.len(),
        200,
        "one outcome line per key, each in its own span"
    );
}

/// An OTLP/HTTP receiver: decodes each `POST /v1/traces` (protobuf) and keeps its spans.
struct OtlpReceiver {
    addr: std::net::SocketAddr,
    spans: std::sync::Arc<std::sync::Mutex<Vec<opentelemetry_proto::tonic::trace::v1::Span>>>,
    stop: tokio_util::sync::CancellationToken,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl OtlpReceiver {
    async fn start() -> OtlpReceiver {
        use opentelemetry_proto::tonic::collector::trace::v1::{
            ExportTraceServiceRequest, ExportTraceServiceResponse,
        };
        use prost::Message;
        let spans = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = spans.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let kept = kept.clone();
                async move {
                    let request = ExportTraceServiceRequest::decode(body)
                        .expect("the relay sends OTLP protobuf");
                    for resource in request.resource_spans {
                        let service = resource
                            .resource
                            .iter()
                            .flat_map(|r| &r.attributes)
                            .any(|a| a.key == "service.name");
                        assert!(service, "every export names its service");
                        for scope in resource.scope_spans {
                            kept.lock().unwrap().extend(scope.spans);
                        }
                    }
                    (
                        [("content-type", "application/x-protobuf")],
                        ExportTraceServiceResponse::default().encode_to_vec(),
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move { s.cancelled().await })
                .await
                .unwrap();
        });
        OtlpReceiver { addr, spans, stop }
    }

    fn spans(&self) -> Vec<opentelemetry_proto::tonic::trace::v1::Span> {
        self.spans.lock().unwrap().clone()
    }
}

#[tokio::test]
async fn each_action_is_one_trace_over_otlp_and_the_downstream_sees_its_attempt() {
    let receiver = OtlpReceiver::start().await;
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = common::config_file(&env, dir.path(), &common::email_tool(true), "").await;
    let endpoint = format!("http://{}", receiver.addr);
    let _relay = common::Child::spawn_with_env(
        &config,
        None,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ("OTEL_SERVICE_NAME", "idem-under-test"),
        ],
        dir.path().join("relay.log"),
    );
    let outcomes = env.outcomes().await;
    let producer = env.producer();
    // Five actions, each from its own incoming trace.
    let mut sent = Vec::new();
    for i in 0..5 {
        let trace = format!("{:032x}", (0x4bf92f3577b34da6_u128 << 64) | (i as u128 + 1));
        let parent = format!("{:016x}", 0x00f067aa0ba90200_u64 + i as u64);
        let mut event = action(
            &format!("evt-{i}"),
            json!({"run_id": "r1", "tool": "send_email", "business_id": format!("b{i}"),
                   "args": {"to": format!("c{i}")}}),
        );
        event["traceparent"] = json!(format!("00-{trace}-{parent}-01"));
        producer.send(&event).await;
        sent.push((
            format!("r1:send_email:b{i}"),
            trace,
            parent,
            format!("evt-{i}"),
        ));
    }
    for (_, _, _, id) in &sent {
        outcomes.answer(id, "succeeded").await;
    }
    let hex = |b: &[u8]| hex::encode(b);
    common::eventually(
        "every action's spans at the receiver",
        Duration::from_secs(30),
        || async {
            let spans = receiver.spans();
            sent.iter().all(|(_, trace, _, _)| {
                let names: BTreeSet<&str> = spans
                    .iter()
                    .filter(|s| hex(&s.trace_id) == *trace)
                    .map(|s| s.name.as_str())
                    .collect();
                names.contains(format!("process {}", env.actions).as_str())
                    && names.contains("record")
                    && names.contains("call send_email")
                    && names.contains(format!("send {}", env.outcomes).as_str())
            })
        },
    )
    .await;
    let spans = receiver.spans();
    // One trace per action: the incoming one, with one action span in it.
    let traces: BTreeSet<String> = spans.iter().map(|s| hex(&s.trace_id)).collect();
    assert_eq!(traces, sent.iter().map(|(_, t, _, _)| t.clone()).collect());
    for (key, trace, parent, id) in &sent {
        let of_trace: Vec<_> = spans
            .iter()
            .filter(|s| hex(&s.trace_id) == *trace)
            .collect();
        let process: Vec<_> = of_trace
            .iter()
            .filter(|s| s.name == format!("process {}", env.actions))
            .collect();
        assert_eq!(process.len(), 1, "one action span in {trace}");
        let process = process[0];
        assert_eq!(
            hex(&process.parent_span_id),
            *parent,
            "its parent is the incoming span"
        );
        assert_eq!(process.kind, 5, "a consumer span");
        assert!(process.end_time_unix_nano >= process.start_time_unix_nano);
        for child in of_trace.iter().filter(|s| s.span_id != process.span_id) {
            assert_eq!(
                child.parent_span_id, process.span_id,
                "{} is a child of the action",
                child.name
            );
            assert!(
                child.start_time_unix_nano >= process.start_time_unix_nano,
                "{}",
                child.name
            );
            assert!(
                child.end_time_unix_nano <= process.end_time_unix_nano,
                "{}",
                child.name
            );
        }
        // The downstream saw the call span's context, not the incoming one.
        let call = of_trace
            .iter()
            .find(|s| s.name == "call send_email")
            .unwrap();
        assert_eq!(call.kind, 3, "a client span");
        assert_eq!(
            env.downstream.traceparent(key),
            Some(format!("00-{trace}-{}-01", hex(&call.span_id)))
        );
        // The outcome carries the publish span's context, header and attribute.
        let send = of_trace
            .iter()
            .find(|s| s.name == format!("send {}", env.outcomes))
            .unwrap();
        assert_eq!(send.kind, 4, "a producer span");
        let expected = format!("00-{trace}-{}-01", hex(&send.span_id));
        let outcome = outcomes
            .all()
            .into_iter()
            .find(|o| o.json()["data"]["action_event_id"] == id.as_str())
            .unwrap();
        assert_eq!(outcome.headers.get("traceparent"), Some(&expected));
        assert_eq!(outcome.json()["traceparent"], expected.as_str());
        let attrs: BTreeSet<&str> = process.attributes.iter().map(|a| a.key.as_str()).collect();
        for a in [
            "messaging.system",
            "messaging.destination.name",
            "messaging.operation.type",
            "idem.key",
        ] {
            assert!(attrs.contains(a), "{a} on the action span");
        }
    }
}
