"""The Python client against the real relay, Kafka and Postgres; effects counted at a
downstream that does not dedupe. (And one test of the producer's settings alone.)"""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from stack import Stack, eventually
from idem_client import (
    CallTimeout,
    Idem,
    OutcomeUnknown,
    PendingApproval,
    Rejected,
)
from idem_client._client import _producer_config

EMAIL = {"to": "customer-1", "template": "refund_approved", "subject": "Your refund"}


def test_a_second_call_is_answered_from_the_record(stack: Stack, idem: Idem, run_id: str) -> None:
    first = idem.call("send_email", EMAIL, run_id=run_id, business_id="order_1", step=4)
    assert first.status == "succeeded" and not first.duplicate
    assert first.result["tool"] == "send_email"
    assert first.idempotency_key == f"{run_id}:send_email:order_1"
    again = idem.call("send_email", EMAIL, run_id=run_id, business_id="order_1", step=5)
    assert again.duplicate and again.status == "succeeded"
    assert again.result == first.result
    assert "not repeated" in again.note
    assert stack.effects(first.idempotency_key) == 1


def test_a_reworded_argument_that_is_not_material_is_a_duplicate(
    stack: Stack, idem: Idem, run_id: str
) -> None:
    idem.call("send_email", EMAIL, run_id=run_id, business_id="o2")
    reworded = idem.call(
        "send_email", {**EMAIL, "subject": "About your refund"}, run_id=run_id, business_id="o2"
    )
    assert reworded.duplicate
    assert stack.effects(reworded.idempotency_key) == 1


def test_a_material_change_under_the_same_key_is_rejected_naming_the_field(
    stack: Stack, idem: Idem, run_id: str
) -> None:
    idem.call("send_email", EMAIL, run_id=run_id, business_id="o3")
    with pytest.raises(Rejected) as e:
        idem.call("send_email", {**EMAIL, "to": "customer-2"}, run_id=run_id, business_id="o3")
    assert e.value.code == "key_conflict"
    assert e.value.fields == ["args.to"]
    assert not e.value.retryable
    assert stack.effects(e.value.key) == 1
    # Or every status returned, none raised.
    out = idem.call(
        "send_email", {**EMAIL, "to": "customer-2"}, run_id=run_id, business_id="o3",
        raise_on_status=False,
    )
    assert out.status == "rejected" and out.error is not None


def test_a_gated_tool_waits_for_approval_then_runs_once(
    stack: Stack, idem: Idem, run_id: str
) -> None:
    refund = {"order_id": "o-9", "amount": 120}
    with pytest.raises(PendingApproval) as pending:
        idem.call("refund", refund, run_id=run_id, business_id="ticket-1")
    assert "do not retry" in pending.value.outcome.note.lower()
    assert stack.effects(pending.value.key) == 0
    stack.idem("approve", pending.value.key, "--by", "pytest", "--reason", "checked")
    done = idem.wait(pending.value, timeout=60)
    assert done.status == "succeeded"
    # A repeat after the decision: the stored success.
    again = idem.call("refund", refund, run_id=run_id, business_id="ticket-1")
    assert again.duplicate
    assert stack.effects(pending.value.key) == 1


def test_a_timeout_downstream_is_verified_not_retried_blind(
    stack: Stack, idem: Idem, run_id: str
) -> None:
    key = f"{run_id}:send_email:o5"
    stack.script(key, ["effect_then_timeout"])
    out = idem.call("send_email", EMAIL, run_id=run_id, business_id="o5", timeout=60)
    assert out.status == "succeeded", out
    assert stack.effects(key) == 1


def test_two_hundred_concurrent_calls_each_get_their_own_answer(
    stack: Stack, idem: Idem, run_id: str
) -> None:
    def one(i: int) -> tuple[str, str]:
        out = idem.call("send_email", EMAIL, run_id=run_id, business_id=f"c{i}", timeout=120)
        return out.idempotency_key, out.action_event_id

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(one, range(200)))
    assert sorted(k for k, _ in answers) == sorted(f"{run_id}:send_email:c{i}" for i in range(200))
    assert len({e for _, e in answers}) == 200
    assert all(stack.effects(k) == 1 for k, _ in answers)


def test_the_asyncio_twin_answers_the_same(stack: Stack, idem: Idem, run_id: str) -> None:
    async def both() -> list:
        return await asyncio.gather(
            *(idem.acall("send_email", EMAIL, run_id=run_id, business_id=f"a{i}") for i in range(20)),
            idem.acall("send_email", EMAIL, run_id=run_id, business_id="a0"),
        )

    outs = asyncio.run(both())
    assert all(o.status == "succeeded" for o in outs)
    assert sum(o.duplicate for o in outs) == 1
    assert stack.effects(f"{run_id}:send_email:a0") == 1


def test_calls_waiting_while_the_relay_is_killed_are_all_answered_once(
    own_stack: Stack, run_id: str
) -> None:
    keys = [f"{run_id}:send_email:k{i}" for i in range(20)]
    for key in keys:
        own_stack.script(key, [{"delay_ms": 1500}])
    with own_stack.client() as idem, concurrent.futures.ThreadPoolExecutor(20) as pool:
        calls = [
            pool.submit(
                idem.call, "send_email", EMAIL, run_id=run_id, business_id=f"k{i}", timeout=150
            )
            for i in range(20)
        ]
        # Killed (-9) once calls have reached the downstream and wait there.
        eventually("calls in flight downstream", 60, lambda: own_stack.requests() > 0)
        own_stack.kill()
        own_stack.start()
        outs = [c.result(160) for c in calls]
    assert sorted(o.idempotency_key for o in outs) == sorted(keys)
    assert all(own_stack.effects(k) == 1 for k in keys)


def test_a_timed_out_call_resumes_from_the_record(own_stack: Stack, run_id: str) -> None:
    with own_stack.client() as idem:
        own_stack.stop()
        with pytest.raises(CallTimeout) as timed_out:
            idem.call("send_email", EMAIL, run_id=run_id, business_id="r1", timeout=2)
        assert timed_out.value.event_id
        own_stack.start()
        # The resume: the same run id and business id. The first action runs once; this one is
        # answered from its record.
        resumed = idem.call("send_email", EMAIL, run_id=run_id, business_id="r1", timeout=60)
        assert resumed.duplicate and resumed.status == "succeeded"
        assert own_stack.effects(resumed.idempotency_key) == 1


def test_an_unknown_outcome_is_raised_never_retried(stack: Stack, idem: Idem, run_id: str) -> None:
    # The refund tool has no verify: a timeout after the effect can only be parked. Approved
    # first, so the call reaches the downstream.
    key = f"{run_id}:refund:u1"
    stack.script(key, ["effect_then_timeout"])
    with pytest.raises(PendingApproval) as pending:
        idem.call("refund", {"order_id": "o-u", "amount": 5}, run_id=run_id, business_id="u1")
    stack.idem("approve", key, "--by", "pytest", "--reason", "checked")
    with pytest.raises(OutcomeUnknown) as unknown:
        idem.wait(pending.value, timeout=60)
    assert unknown.value.outcome.error is not None
    assert unknown.value.outcome.error.code == "outcome_unknown"
    assert stack.effects(key) == 1


def test_the_callers_kafka_config_sets_the_linger_but_not_the_delivery_guarantees() -> None:
    assert _producer_config({"bootstrap.servers": "b:9092"})["linger.ms"] == 0
    mine = _producer_config(
        {"bootstrap.servers": "b:9092", "linger.ms": 5, "acks": "1", "enable.idempotence": False}
    )
    assert mine["linger.ms"] == 5
    assert mine["acks"] == "all" and mine["enable.idempotence"] is True
    assert mine["bootstrap.servers"] == "b:9092"
