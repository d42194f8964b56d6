//! How the MCP server reaches idem: the same way an agent does. An action event goes to the
//! actions topic, and the outcome that answers it is read from the outcomes topic, by the
//! action event's id (and, once it is known, by its idempotency key, for a key that waits for
//! approval and is decided later).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::action::{ACTION_TYPE, STRUCTURED_CONTENT_TYPE};
use crate::config::KafkaConfig;

/// How long the outcomes topic's partitions and offsets may take to be read at the start.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// One action to publish.
#[derive(Debug, Clone)]
pub struct Call {
    pub tool: String,
    pub args: Value,
    pub run_id: String,
    pub business_id: Option<String>,
    pub step: Option<i64>,
    /// The action event's `source`, e.g. `mcp://claude-code`.
    pub source: String,
}

/// The producer of actions and the reader of outcomes, shared by every call of a process.
pub struct Caller {
    producer: FutureProducer,
    actions_topic: String,
    waiters: Arc<Mutex<Waiters>>,
    reader: tokio::task::JoinHandle<()>,
}

/// Who waits for which outcome.
#[derive(Default)]
struct Waiters {
    by_event: HashMap<String, mpsc::UnboundedSender<Value>>,
    /// The event ids that also follow their key (to see it decided after `pending_approval`).
    by_key: HashMap<String, Vec<String>>,
}

impl Drop for Caller {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Caller {
    /// Connects to Kafka and starts reading the outcomes topic from where it ends now, so no
    /// answer to an action published afterwards can be missed.
    pub async fn connect(kafka: &KafkaConfig) -> anyhow::Result<Self> {
        crate::kafka::probe(kafka).await?;
        let consumer: StreamConsumer = crate::kafka::client_config(kafka)
            .set("group.id", format!("idem-mcp-{}", uuid::Uuid::new_v4()))
            .set("enable.auto.commit", "false")
            .set("client.id", "idem-mcp")
            .create()?;
        let topic = kafka.outcomes_topic.clone();
        // Metadata and watermarks are blocking calls of librdkafka.
        let (consumer, positions) = tokio::task::spawn_blocking(move || {
            let positions = ends(&consumer, &topic)?;
            anyhow::Ok((consumer, positions))
        })
        .await??;
        consumer.assign(&positions)?;
        // No linger unless `[kafka.client]` sets one: a tool call waits for its answer, and
        // each millisecond of linger cost about 1.2 ms of a call's p50 through the Python
        // client, whose producer is the same librdkafka (`benches/client_calls.py`).
        let producer: FutureProducer = crate::kafka::with_defaults(
            crate::kafka::client_config(kafka),
            &kafka.client,
            &Default::default(),
            &[("linger.ms", "0")],
        )
        .set("client.id", "idem-mcp")
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()?;
        let waiters = Arc::new(Mutex::new(Waiters::default()));
        let reader = tokio::spawn(read_outcomes(consumer, waiters.clone()));
        Ok(Self {
            producer,
            actions_topic: kafka.actions_topic.clone(),
            waiters,
            reader,
        })
    }

    /// Publishes `call` as an action event and returns what waits for its outcomes.
    pub async fn publish(&self, call: &Call) -> anyhow::Result<Waiting> {
        let id = uuid::Uuid::new_v4().to_string();
        let mut data = json!({"run_id": call.run_id, "tool": call.tool, "args": call.args});
        if let Some(b) = &call.business_id {
            data["business_id"] = b.clone().into();
        }
        if let Some(s) = call.step {
            data["step"] = s.into();
        }
        let event = json!({
            "specversion": "1.0", "id": id, "source": call.source, "type": ACTION_TYPE,
            "time": chrono::Utc::now().to_rfc3339(), "datacontenttype": "application/json",
            "data": data,
        });
        let payload = serde_json::to_vec(&event)?;
        // Registered before the send: the answer may come before the send returns.
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.waiters).by_event.insert(id.clone(), tx);
        let waiting = Waiting {
            id,
            key: None,
            rx,
            waiters: self.waiters.clone(),
        };
        let record = FutureRecord::to(&self.actions_topic)
            .key(&call.run_id)
            .payload(&payload)
            .headers(OwnedHeaders::new().insert(Header {
                key: "content-type",
                value: Some(STRUCTURED_CONTENT_TYPE),
            }));
        self.producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| anyhow::anyhow!("the action could not be published: {e}"))?;
        Ok(waiting)
    }
}

/// The outcomes answering one published action, as they come.
pub struct Waiting {
    /// The action event's id.
    pub id: String,
    key: Option<String>,
    rx: mpsc::UnboundedReceiver<Value>,
    waiters: Arc<Mutex<Waiters>>,
}

impl Waiting {
    /// The next outcome event for this action, or for its key once followed. `None` only when
    /// the reader of outcomes has stopped.
    pub async fn next(&mut self) -> Option<Value> {
        self.rx.recv().await
    }

    /// From now on, outcomes of `key` reach this call too, whichever delivery they answer.
    pub fn follow(&mut self, key: &str) {
        if self.key.is_some() {
            return;
        }
        self.key = Some(key.to_string());
        lock(&self.waiters)
            .by_key
            .entry(key.to_string())
            .or_default()
            .push(self.id.clone());
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut w = lock(&self.waiters);
        w.by_event.remove(&self.id);
        if let Some(key) = &self.key {
            if let Some(ids) = w.by_key.get_mut(key) {
                ids.retain(|i| i != &self.id);
                if ids.is_empty() {
                    w.by_key.remove(key);
                }
            }
        }
    }
}

fn lock(w: &Mutex<Waiters>) -> std::sync::MutexGuard<'_, Waiters> {
    // A panic while holding the lock leaves the maps whole (inserts and removes only).
    w.lock().unwrap_or_else(|e| e.into_inner())
}

/// Every partition of `topic` at its current end.
fn ends(consumer: &StreamConsumer, topic: &str) -> anyhow::Result<TopicPartitionList> {
    let metadata = consumer.fetch_metadata(Some(topic), CONNECT_TIMEOUT)?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    if partitions.is_empty() {
        anyhow::bail!("the outcomes topic {topic} does not exist (the relay creates it at start)");
    }
    let mut list = TopicPartitionList::new();
    for p in partitions {
        let (_, high) = consumer.fetch_watermarks(topic, p, CONNECT_TIMEOUT)?;
        list.add_partition_offset(topic, p, Offset::Offset(high))?;
    }
    Ok(list)
}

/// Hands each outcome event to whoever waits for its action or its key.
async fn read_outcomes(consumer: StreamConsumer, waiters: Arc<Mutex<Waiters>>) {
    loop {
        let message = match consumer.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "mcp: reading outcomes failed; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let Some(Ok(event)) = message.payload().map(serde_json::from_slice::<Value>) else {
            continue;
        };
        let data = &event["data"];
        let w = lock(&waiters);
        let mut to: Vec<&mpsc::UnboundedSender<Value>> = Vec::new();
        if let Some(tx) = data["action_event_id"]
            .as_str()
            .and_then(|id| w.by_event.get(id))
        {
            to.push(tx);
        }
        if let Some(ids) = data["idempotency_key"]
            .as_str()
            .and_then(|k| w.by_key.get(k))
        {
            for id in ids {
                if let Some(tx) = w.by_event.get(id) {
                    if !to.iter().any(|t| t.same_channel(tx)) {
                        to.push(tx);
                    }
                }
            }
        }
        for tx in to {
            let _ = tx.send(event.clone());
        }
    }
}
