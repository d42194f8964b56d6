//! `idem publish`: one action event to the actions topic, and optionally its outcome.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::Message;

use idem::config::Config;

#[derive(Args)]
pub struct Publish {
    /// The relay's config file: brokers and topics are read from it.
    #[arg(long)]
    pub config: PathBuf,
    /// A tool named in the config.
    #[arg(long)]
    pub tool: String,
    /// The agent run this action belongs to (also the Kafka key unless `--key` is given).
    #[arg(long)]
    pub run_id: String,
    /// The action's args, a JSON object.
    #[arg(long, default_value = "{}")]
    pub args: String,
    /// What the action is about, for keys and reattempt limits (an order id, a ticket).
    #[arg(long)]
    pub business_id: Option<String>,
    /// The step of the run that asks for it.
    #[arg(long)]
    pub step: Option<i64>,
    /// The orchestrator's own idempotency key (otherwise the tool's key template decides).
    #[arg(long)]
    pub key: Option<String>,
    /// The CloudEvents id; a fresh one when not given.
    #[arg(long)]
    pub event_id: Option<String>,
    /// Wait up to this many seconds for the outcome answering this event and print it.
    #[arg(long)]
    pub wait: Option<u64>,
}

/// Publishes the action, and prints its outcome when `--wait` asks for it.
pub async fn publish(p: Publish) -> anyhow::Result<()> {
    let config = super::load(&p.config)?;
    let Publish {
        tool,
        run_id,
        args,
        business_id,
        step,
        key,
        event_id,
        wait,
        ..
    } = p;
    let args: serde_json::Value = serde_json::from_str(&args).context("--args is not JSON")?;
    if !args.is_object() {
        bail!("--args must be a JSON object");
    }
    let id = event_id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let mut data = serde_json::json!({"run_id": run_id, "tool": tool, "args": args});
    if let Some(b) = business_id {
        data["business_id"] = b.into();
    }
    if let Some(s) = step {
        data["step"] = s.into();
    }
    if let Some(k) = &key {
        data["idempotency_key"] = k.clone().into();
    }
    let event = serde_json::json!({
        "specversion": "1.0", "id": id, "source": "idem-cli", "type": idem::action::ACTION_TYPE,
        "time": chrono::Utc::now().to_rfc3339(), "datacontenttype": "application/json", "data": data,
    });
    let payload = serde_json::to_vec(&event)?;
    let kafka_key = key.unwrap_or(run_id);
    // A wrong password or an untrusted certificate is said now, not as a timeout later.
    idem::kafka::probe(&config.kafka).await?;
    // Subscribe before publishing, from the end, so the outcome cannot be missed.
    let outcomes = match wait {
        Some(_) => Some(outcome_consumer(&config).await?),
        None => None,
    };
    let producer: FutureProducer = idem::kafka::client_config(&config.kafka)
        .set("enable.idempotence", "true")
        .create()?;
    producer
        .send(
            FutureRecord::to(&config.kafka.actions_topic)
                .key(&kafka_key)
                .payload(&payload)
                .headers(
                    rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                        key: "content-type",
                        value: Some(idem::action::STRUCTURED_CONTENT_TYPE),
                    }),
                ),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)?;
    eprintln!("published action {id}");
    if let (Some(secs), Some(consumer)) = (wait, outcomes) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        loop {
            let m = tokio::time::timeout_at(deadline, consumer.recv())
                .await
                .with_context(|| format!("no outcome for action {id} within {secs}s"))??;
            let Some(p) = m.payload() else { continue };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(p) else {
                continue;
            };
            if v["data"]["action_event_id"] == id.as_str() {
                println!("{}", serde_json::to_string_pretty(&v)?);
                break;
            }
        }
    }
    Ok(())
}

async fn outcome_consumer(config: &Config) -> anyhow::Result<StreamConsumer> {
    let consumer: StreamConsumer = idem::kafka::client_config(&config.kafka)
        .set("group.id", format!("idem-cli-{}", uuid::Uuid::new_v4()))
        .set("auto.offset.reset", "latest")
        .set("enable.auto.commit", "false")
        .create()?;
    consumer.subscribe(&[&config.kafka.outcomes_topic])?;
    // Wait for the assignment, so "latest" is resolved before the action goes out.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while consumer.assignment()?.count() == 0 {
        if std::time::Instant::now() > deadline {
            bail!(
                "no partitions of {} assigned within 15s",
                config.kafka.outcomes_topic
            );
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), consumer.recv()).await;
    }
    Ok(consumer)
}
