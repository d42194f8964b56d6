"""The client: publish an action event, wait for the outcome that answers it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time
import uuid
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any, Mapping

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from ._errors import CallTimeout, Failed, OutcomeUnknown, PendingApproval, Rejected
from ._outcome import Outcome

ACTION_TYPE = "dev.idem.action.v1"
STRUCTURED = b"application/cloudevents+json"

# Outcome ids already seen (delivery is at least once) and the newest outcome per key, both
# bounded: a long-lived client must not grow without end.
_SEEN_IDS = 100_000
_KEYS_KEPT = 10_000


def _producer_config(common: Mapping[str, Any]) -> dict[str, Any]:
    """The producer's librdkafka properties: ``common`` (the brokers and the caller's
    ``kafka_config``) over the defaults, then the two the client's promises rest on."""
    return {
        # A call waits for its answer, so an action held back to share a request with others is
        # that much later: each millisecond of linger cost about 1.2 ms of a call's p50
        # (benches/client_calls.py).
        "linger.ms": 0,
        **common,
        # A retry of the send repeats the same event id; the broker drops the copy.
        "enable.idempotence": True,
        "acks": "all",
    }


class Idem:
    """A connection to idem through Kafka: one producer, and one consumer of the outcomes topic
    shared by every call.

    The consumer reads from where the outcomes topic ended when the client was made, with a
    group id of its own, so no answer to an action published afterwards can be missed. Answers
    are matched to calls by the action event's id. Thread-safe; use one per process.

    ``kafka_config`` adds librdkafka properties to both clients (``security.protocol``,
    ``sasl.*``, ``ssl.*``), as the relay's ``[kafka.client]`` does. The producer sends each
    action at once (``linger.ms`` 0, which ``kafka_config`` may change); it is always idempotent
    with ``acks=all``.
    """

    def __init__(
        self,
        brokers: str,
        actions_topic: str = "idem.actions",
        outcomes_topic: str = "idem.outcomes",
        source: str = "idem-client",
        *,
        kafka_config: Mapping[str, Any] | None = None,
        connect_timeout: float = 15.0,
    ) -> None:
        self.actions_topic = actions_topic
        self.outcomes_topic = outcomes_topic
        self.source = source
        common = {"bootstrap.servers": brokers, **(kafka_config or {})}
        self._producer = Producer(_producer_config(common))
        self._consumer = Consumer(
            {
                **common,
                "group.id": f"idem-client-{uuid.uuid4()}",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
            }
        )
        self._lock = threading.Lock()
        self._by_event: dict[str, concurrent.futures.Future[Outcome]] = {}
        self._by_key: dict[str, list[concurrent.futures.Future[Outcome]]] = {}
        self._latest: OrderedDict[str, Outcome] = OrderedDict()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._closed = threading.Event()
        try:
            self._assign_at_end(connect_timeout)
        except Exception:
            self._consumer.close()
            raise
        self._thread = threading.Thread(target=self._poll, name="idem-outcomes", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, **overrides: Any) -> "Idem":
        """From ``IDEM_KAFKA_BROKERS`` (default ``127.0.0.1:9092``), ``IDEM_ACTIONS_TOPIC``,
        ``IDEM_OUTCOMES_TOPIC`` and ``IDEM_SOURCE``; keyword arguments win."""
        args: dict[str, Any] = {
            "brokers": os.environ.get("IDEM_KAFKA_BROKERS", "127.0.0.1:9092"),
            "actions_topic": os.environ.get("IDEM_ACTIONS_TOPIC", "idem.actions"),
            "outcomes_topic": os.environ.get("IDEM_OUTCOMES_TOPIC", "idem.outcomes"),
            "source": os.environ.get("IDEM_SOURCE", "idem-client"),
        }
        args.update(overrides)
        return cls(**args)

    # ------------------------------------------------------------------ calls

    def call(
        self,
        tool: str,
        args: Mapping[str, Any],
        *,
        run_id: str,
        business_id: str | None = None,
        step: int | None = None,
        idempotency_key: str | None = None,
        timeout: float = 30.0,
        raise_on_status: bool = True,
        event_id: str | None = None,
    ) -> Outcome:
        """Publishes one action and returns the outcome that answers it.

        A ``succeeded`` outcome is returned (``duplicate`` is true when the effect had already
        happened). Otherwise, unless ``raise_on_status`` is false, :class:`Rejected`,
        :class:`Failed`, :class:`PendingApproval` or :class:`OutcomeUnknown` is raised. No
        answer within ``timeout``: :class:`CallTimeout`; calling again with the same
        ``run_id`` and ``business_id`` (and args) is answered from the record.
        """
        future, event_id = self._publish(
            tool, args, run_id, business_id, step, idempotency_key, event_id
        )
        try:
            outcome = future.result(timeout)
        except concurrent.futures.TimeoutError:
            self._forget(event_id)
            raise CallTimeout(event_id, tool, run_id, timeout) from None
        return _judged(outcome, raise_on_status)

    async def acall(
        self,
        tool: str,
        args: Mapping[str, Any],
        *,
        run_id: str,
        business_id: str | None = None,
        step: int | None = None,
        idempotency_key: str | None = None,
        timeout: float = 30.0,
        raise_on_status: bool = True,
        event_id: str | None = None,
    ) -> Outcome:
        """:meth:`call` for asyncio: the same, awaited."""
        future, event_id = self._publish(
            tool, args, run_id, business_id, step, idempotency_key, event_id
        )
        try:
            outcome = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except asyncio.TimeoutError:
            self._forget(event_id)
            raise CallTimeout(event_id, tool, run_id, timeout) from None
        return _judged(outcome, raise_on_status)

    def wait(
        self,
        key_or_outcome: "str | Outcome | PendingApproval",
        timeout: float = 60.0,
        *,
        raise_on_status: bool = True,
    ) -> Outcome:
        """Waits until a key waiting for approval is decided (or any key settles), and returns
        its outcome as :meth:`call` would (raising for anything but a success)."""
        future = self._settled(key_or_outcome)
        try:
            outcome = future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"key {_key_of(key_or_outcome)} not settled within {timeout}s") from None
        return _judged(outcome, raise_on_status)

    async def await_settled(
        self,
        key_or_outcome: "str | Outcome | PendingApproval",
        timeout: float = 60.0,
        *,
        raise_on_status: bool = True,
    ) -> Outcome:
        """:meth:`wait` for asyncio."""
        future = self._settled(key_or_outcome)
        try:
            outcome = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"key {_key_of(key_or_outcome)} not settled within {timeout}s") from None
        return _judged(outcome, raise_on_status)

    def close(self) -> None:
        """Delivers what is still queued (up to 10 s) and stops reading outcomes."""
        if self._closed.is_set():
            return
        self._producer.flush(10)
        self._closed.set()
        self._thread.join(5)
        self._consumer.close()

    def __enter__(self) -> "Idem":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> "Idem":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    # -------------------------------------------------------------- internals

    def _publish(
        self,
        tool: str,
        args: Mapping[str, Any],
        run_id: str,
        business_id: str | None,
        step: int | None,
        idempotency_key: str | None,
        event_id: str | None,
    ) -> tuple[concurrent.futures.Future[Outcome], str]:
        if self._closed.is_set():
            raise RuntimeError("this Idem client is closed")
        event_id = event_id or str(uuid.uuid4())
        data: dict[str, Any] = {"run_id": run_id, "tool": tool, "args": dict(args)}
        if business_id is not None:
            data["business_id"] = business_id
        if step is not None:
            data["step"] = step
        if idempotency_key is not None:
            data["idempotency_key"] = idempotency_key
        event = {
            "specversion": "1.0",
            "id": event_id,
            "source": self.source,
            "type": ACTION_TYPE,
            "time": datetime.now(timezone.utc).isoformat(),
            "datacontenttype": "application/json",
            "data": data,
        }
        future: concurrent.futures.Future[Outcome] = concurrent.futures.Future()
        # Registered before the send: the answer may arrive before produce() returns.
        with self._lock:
            self._by_event[event_id] = future

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None and not future.done():
                self._forget(event_id)
                future.set_exception(KafkaException(err))

        payload = json.dumps(event).encode()
        key = (idempotency_key or run_id).encode()
        while True:
            try:
                self._producer.produce(
                    self.actions_topic,
                    value=payload,
                    key=key,
                    headers=[("content-type", STRUCTURED)],
                    on_delivery=delivered,
                )
                break
            except BufferError:
                # The local queue is full: let deliveries drain, then send.
                self._producer.poll(0.05)
        self._producer.poll(0)
        return future, event_id

    def _forget(self, event_id: str) -> None:
        with self._lock:
            self._by_event.pop(event_id, None)

    def _settled(self, key_or_outcome: "str | Outcome | PendingApproval") -> concurrent.futures.Future[Outcome]:
        key = _key_of(key_or_outcome)
        future: concurrent.futures.Future[Outcome] = concurrent.futures.Future()
        with self._lock:
            latest = self._latest.get(key)
            if latest is not None and latest.final:
                future.set_result(latest)
            else:
                self._by_key.setdefault(key, []).append(future)
        return future

    def _assign_at_end(self, within: float) -> None:
        """Reads the outcomes topic from its current end, every partition."""
        deadline = time.monotonic() + within
        while True:
            topics = self._consumer.list_topics(self.outcomes_topic, timeout=max(1.0, within)).topics
            meta = topics.get(self.outcomes_topic)
            if meta is not None and meta.error is None and meta.partitions:
                break
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"topic {self.outcomes_topic} has no partitions (is the relay running? it creates the topics)"
                )
            time.sleep(0.2)
        positions = []
        for partition in sorted(meta.partitions):
            _, high = self._consumer.get_watermark_offsets(
                TopicPartition(self.outcomes_topic, partition), timeout=within
            )
            positions.append(TopicPartition(self.outcomes_topic, partition, high))
        self._consumer.assign(positions)

    def _poll(self) -> None:
        while not self._closed.is_set():
            self._producer.poll(0)
            message = self._consumer.poll(0.1)
            if message is None or message.error() is not None:
                continue
            try:
                event = json.loads(message.value())
                outcome = Outcome.from_event(event)
            except (ValueError, KeyError, TypeError):
                continue
            self._deliver(outcome)

    def _deliver(self, outcome: Outcome) -> None:
        with self._lock:
            if outcome.id in self._seen:
                return
            self._seen[outcome.id] = None
            if len(self._seen) > _SEEN_IDS:
                self._seen.popitem(last=False)
            self._latest[outcome.idempotency_key] = outcome
            self._latest.move_to_end(outcome.idempotency_key)
            if len(self._latest) > _KEYS_KEPT:
                self._latest.popitem(last=False)
            waiting = self._by_event.pop(outcome.action_event_id, None)
            settled = self._by_key.pop(outcome.idempotency_key, []) if outcome.final else []
        for future in ([waiting] if waiting else []) + settled:
            if not future.done():
                future.set_result(outcome)


def _key_of(key_or_outcome: "str | Outcome | PendingApproval") -> str:
    if isinstance(key_or_outcome, str):
        return key_or_outcome
    if isinstance(key_or_outcome, PendingApproval):
        return key_or_outcome.key
    return key_or_outcome.idempotency_key


def _judged(outcome: Outcome, raise_on_status: bool) -> Outcome:
    if not raise_on_status or outcome.status == "succeeded":
        return outcome
    raise {
        "rejected": Rejected,
        "failed": Failed,
        "pending_approval": PendingApproval,
        "unknown": OutcomeUnknown,
    }[outcome.status](outcome)
