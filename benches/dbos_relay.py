"""The DBOS Transact peer for benches/relay.rs: the same workload, done the DBOS way.

Each action message becomes a DBOS workflow (DBOS's Kafka integration enqueues one per message,
exactly once per topic-partition-offset). The effect runs in a child workflow whose id is the
action's key, so DBOS runs it once and hands later callers the stored result; the outcome is
produced to the outcomes topic.

Run by the benchmark as `python benches/dbos_relay.py SPEC_JSON`, with a Python that has
`pip install dbos confluent-kafka requests` (IDEM_BENCH_PYTHON names it).
"""

import json
import sys
import uuid

import requests
from confluent_kafka import Producer
from dbos import DBOS, DBOSConfig, KafkaMessage, SetWorkflowID

spec = json.loads(sys.argv[1])
config: DBOSConfig = {
    "name": spec["group"].replace(".", "-"),
    "system_database_url": spec["pg_url"],
    "kafka_queue_polling_interval_sec": 0.01,
    "sys_db_pool_size": 64,
}
DBOS(config=config)
producer = Producer({"bootstrap.servers": spec["brokers"], "enable.idempotence": True, "linger.ms": 2})
session = requests.Session()


@DBOS.step()
def call(key: str, args: dict) -> dict:
    r = session.post(spec["url"], json=args, headers={"Idempotency-Key": key}, timeout=10)
    return r.json()


@DBOS.workflow()
def effect(key: str, args: dict) -> dict:
    return call(key, args)


@DBOS.step()
def publish(key: str, outcome: dict) -> None:
    producer.produce(spec["outcomes"], key=key, value=json.dumps(outcome))
    producer.flush()


@DBOS.kafka_consumer(
    {"bootstrap.servers": spec["brokers"], "group.id": spec["group"], "auto.offset.reset": "earliest"},
    [spec["actions"]],
)
@DBOS.workflow()
def handle(msg: KafkaMessage) -> None:
    event = json.loads(msg.value)
    d = event["data"]
    key = f'{d["run_id"]}:{d["tool"]}:{d.get("business_id", "")}'
    # The key is the workflow id: a repeat gets the first run's result, nothing runs twice.
    with SetWorkflowID(f'{spec["group"]}:{key}'):
        result = DBOS.start_workflow(effect, key, d["args"]).get_result()
    outcome = {
        "specversion": "1.0", "type": "dev.idem.outcome.v1", "source": "dbos", "id": str(uuid.uuid4()),
        "subject": key,
        "data": {"idempotency_key": key, "action_event_id": event["id"], "status": "succeeded", "result": result},
    }
    publish(key, outcome)


if __name__ == "__main__":
    DBOS.launch()
    import threading
    threading.Event().wait()
