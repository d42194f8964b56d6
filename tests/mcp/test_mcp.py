"""An MCP client (the official Python SDK) calling idem's tools, over stdio and over streamable
HTTP: one effect per key at the downstream, however often and however reworded a call comes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import httpx2
import pytest
from confluent_kafka import Consumer
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import Implementation

from conftest import ADMIN_TOKEN, READ_TOKEN
from stack import BIN, BROKERS, Stack, eventually

EMAIL = {"to": "customer-1", "template": "refund_approved", "body": "Your refund is on its way."}


@contextlib.asynccontextmanager
async def stdio_session(stack: Stack, *extra: str, errlog: Path | None = None) -> AsyncIterator[ClientSession]:
    server = StdioServerParameters(
        command=str(BIN), args=["mcp", "--config", str(stack.config), *extra], env=dict(os.environ)
    )
    log = open(errlog or stack.tmp / "mcp.log", "a")
    async with stdio_client(server, errlog=log) as (read, write):
        async with ClientSession(read, write, client_info=Implementation(name="pytest-agent", version="1")) as s:
            await s.initialize()
            yield s


@contextlib.asynccontextmanager
async def http_session(stack: Stack) -> AsyncIterator[ClientSession]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=150)) as http:
        async with streamable_http_client(f"http://127.0.0.1:{stack.admin_port}/mcp", http_client=http) as (
            read,
            write,
        ):
            async with ClientSession(read, write, client_info=Implementation(name="pytest-agent", version="1")) as s:
                await s.initialize()
                yield s


SESSIONS = {"stdio": stdio_session, "http": http_session}


def actions_to(stack: Stack, to: str, count: int) -> list[dict[str, Any]]:
    """The first `count` action events on the stack's actions topic addressed to `to`."""
    consumer = Consumer(
        {"bootstrap.servers": BROKERS, "group.id": f"pytest-{uuid.uuid4()}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([stack.actions])
    found: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    try:
        while len(found) < count:
            assert time.monotonic() < deadline, f"{len(found)} of {count} actions to {to} read"
            message = consumer.poll(0.5)
            if message is None or message.error() is not None:
                continue
            event = json.loads(message.value())
            if event["data"]["args"].get("to") == to:
                found.append(event)
    finally:
        consumer.close()
    return found


def data(result: Any) -> dict[str, Any]:
    assert isinstance(result.structured_content, dict), result
    return result.structured_content


def text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if c.type == "text")


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_tools_list_describes_each_tool_with_its_hints(stack: Stack, transport: str) -> None:
    async def go() -> None:
        async with SESSIONS[transport](stack) as s:
            tools = {t.name: t for t in (await s.list_tools()).tools}
        assert set(tools) == {"send_email", "refund", "order_status"}
        email = tools["send_email"]
        assert email.description == "Send one email to a customer from a template."
        assert email.input_schema["required"] == ["to", "template"]
        assert email.input_schema["additionalProperties"] is False
        assert email.output_schema["properties"]["status"]["enum"][0] == "succeeded"
        hints = email.annotations
        assert (hints.read_only_hint, hints.destructive_hint, hints.idempotent_hint) == (False, True, True)
        status = tools["order_status"].annotations
        assert (status.read_only_hint, status.destructive_hint) == (True, False)
        # No schema configured: any object.
        assert tools["refund"].input_schema == {"type": "object"}

    asyncio.run(go())


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_repeated_or_reworded_call_is_answered_not_executed(stack: Stack, transport: str) -> None:
    to = f"customer-{uuid.uuid4().hex[:8]}"

    async def go() -> list[Any]:
        async with SESSIONS[transport](stack) as s:
            first = await s.call_tool("send_email", {**EMAIL, "to": to})
            again = await s.call_tool("send_email", {**EMAIL, "to": to})
            reworded = await s.call_tool(
                "send_email", {**EMAIL, "to": to, "body": "Good news: we refunded you."}
            )
            return [first, again, reworded]

    first, again, reworded = asyncio.run(go())
    assert not first.is_error and data(first)["status"] == "succeeded", text(first)
    assert data(first)["duplicate"] is False
    key = data(first)["idempotency_key"]
    assert key.endswith(f":send_email:{to}")
    for answer in (again, reworded):
        assert not answer.is_error, text(answer)
        assert data(answer)["status"] == "succeeded" and data(answer)["duplicate"] is True
        assert data(answer)["idempotency_key"] == key
        assert data(answer)["result"] == data(first)["result"]
        assert text(answer).startswith("succeeded (duplicate")
    assert stack.effects(key) == 1
    # Three deliveries of the key, each an action event whose source names the MCP client.
    explained = json.loads(stack.idem("explain", key, "--json"))
    assert len(explained["deliveries"]) == 3, explained
    assert {a["source"] for a in actions_to(stack, to, 3)} == {"mcp://pytest-agent"}


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_material_change_is_a_conflict_and_bad_args_are_refused(stack: Stack, transport: str) -> None:
    to = f"customer-{uuid.uuid4().hex[:8]}"

    async def go() -> list[Any]:
        async with SESSIONS[transport](stack) as s:
            first = await s.call_tool("send_email", {**EMAIL, "to": to})
            changed = await s.call_tool("send_email", {**EMAIL, "to": to, "template": "refund_denied"})
            invalid = await s.call_tool("send_email", {"to": to, "templat": "refund_denied"})
            return [first, changed, invalid]

    first, changed, invalid = asyncio.run(go())
    key = data(first)["idempotency_key"]
    assert changed.is_error and data(changed)["status"] == "rejected"
    assert data(changed)["error"]["code"] == "key_conflict"
    assert data(changed)["error"]["fields"] == ["args.template"]
    assert "key_conflict" in text(changed)
    assert invalid.is_error and data(invalid)["error"]["code"] == "schema_invalid", text(invalid)
    assert stack.effects(key) == 1


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_gated_call_returns_at_once_unless_asked_to_wait(stack: Stack, transport: str) -> None:
    order = f"order-{uuid.uuid4().hex[:8]}"
    refund = {"order_id": order, "amount": 40}
    progress: list[str] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async def go() -> list[Any]:
        async with SESSIONS[transport](stack) as s:
            pending = await s.call_tool("refund", refund)
            key = data(pending)["idempotency_key"]
            waiting = asyncio.create_task(
                s.call_tool(
                    "refund",
                    refund,
                    progress_callback=on_progress,
                    meta={"dev.idem/wait_for_approval": True},
                )
            )
            # Approve only once the waiting call has said it waits for approval.
            deadline = asyncio.get_running_loop().time() + 30
            while not any("approval" in m for m in progress):
                assert asyncio.get_running_loop().time() < deadline, progress
                assert not waiting.done(), waiting.result()
                await asyncio.sleep(0.05)
            assert stack.effects(key) == 0
            await asyncio.to_thread(stack.idem, "approve", key, "--by", "pytest", "--reason", "checked")
            return [pending, await asyncio.wait_for(waiting, 60)]

    pending, decided = asyncio.run(go())
    assert not pending.is_error and data(pending)["status"] == "pending_approval"
    assert "do not retry" in text(pending)
    assert not decided.is_error and data(decided)["status"] == "succeeded", text(decided)
    assert stack.effects(data(pending)["idempotency_key"]) == 1


def test_the_run_comes_from_meta_or_the_session_never_the_arguments(stack: Stack) -> None:
    to = f"customer-{uuid.uuid4().hex[:8]}"

    async def go() -> list[Any]:
        answers = []
        # Two sessions, one run named in _meta: the second session's call is a repeat.
        for _ in range(2):
            async with stdio_session(stack) as s:
                answers.append(await s.call_tool("send_email", {**EMAIL, "to": to}, meta={"dev.idem/run_id": "run-meta"}))
        # Two sessions without a run: two runs, so two emails.
        for _ in range(2):
            async with stdio_session(stack) as s:
                answers.append(await s.call_tool("send_email", {**EMAIL, "to": to}))
        # --run-id wins over everything.
        async with stdio_session(stack, "--run-id", "run-flag") as s:
            answers.append(await s.call_tool("send_email", {**EMAIL, "to": to}, meta={"dev.idem/run_id": "other"}))
        return answers

    named, repeat, own_1, own_2, flagged = [data(a) for a in asyncio.run(go())]
    assert named["run_id"] == repeat["run_id"] == "run-meta" and repeat["duplicate"] is True
    assert own_1["run_id"] != own_2["run_id"] and not own_1["duplicate"] and not own_2["duplicate"]
    assert flagged["run_id"] == "run-flag"
    assert stack.effects(named["idempotency_key"]) == 1


def test_a_call_waiting_while_the_relay_restarts_is_answered(own_stack: Stack) -> None:
    stack = own_stack
    errlog = stack.tmp / "mcp-restart.log"
    to = f"customer-{uuid.uuid4().hex[:8]}"

    async def go() -> Any:
        async with stdio_session(stack, errlog=errlog) as s:
            stack.stop()
            call = asyncio.create_task(s.call_tool("send_email", {**EMAIL, "to": to}))
            # The action is on the topic while no relay runs: nothing can answer it yet.
            await asyncio.to_thread(
                eventually, "the action to be published", 30, lambda: "action published" in errlog.read_text()
            )
            assert not call.done()
            await asyncio.to_thread(stack.start)
            return await asyncio.wait_for(call, 90)

    answer = asyncio.run(go())
    assert not answer.is_error and data(answer)["status"] == "succeeded", text(answer)
    assert stack.effects(data(answer)["idempotency_key"]) == 1


def test_mcp_over_http_needs_an_admin_token(stack: Stack) -> None:
    body = json.dumps(
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "curl", "version": "1"}}}
    ).encode()

    def post(token: str | None) -> int:
        headers = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        req = urllib.request.Request(f"http://127.0.0.1:{stack.admin_port}/mcp", data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert post(None) == 401
    assert post("not-the-token-0123456789") == 401
    assert post(READ_TOKEN) == 403
    assert post(ADMIN_TOKEN) == 200


def test_a_cancelled_call_stops_waiting_not_the_action(stack: Stack) -> None:
    errlog = stack.tmp / f"mcp-cancel-{uuid.uuid4().hex[:6]}.log"
    refund = {"order_id": f"order-{uuid.uuid4().hex[:8]}", "amount": 25}
    progress: list[str] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async def go() -> Any:
        async with stdio_session(stack, errlog=errlog) as s:
            waiting = asyncio.create_task(
                s.call_tool(
                    "refund", refund, progress_callback=on_progress, meta={"dev.idem/wait_for_approval": True}
                )
            )
            await asyncio.to_thread(eventually, "a progress notification", 30, lambda: progress)
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            await asyncio.to_thread(
                eventually, "the server to stop waiting", 30, lambda: "the client cancelled" in errlog.read_text()
            )
            # The action was not withdrawn: it still waits for approval, and once approved it runs.
            pending = await s.call_tool("refund", refund)
            assert data(pending)["status"] == "pending_approval", text(pending)
            key = data(pending)["idempotency_key"]
            await asyncio.to_thread(stack.idem, "approve", key, "--by", "pytest", "--reason", "checked")
            return await s.call_tool("refund", refund, meta={"dev.idem/wait_for_approval": True})

    answer = asyncio.run(go())
    assert data(answer)["status"] == "succeeded", text(answer)
    assert stack.effects(data(answer)["idempotency_key"]) == 1
