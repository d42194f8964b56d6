"""A real idem stack for tests: the relay binary, the fake downstream that counts effects, and
the local Kafka and Postgres (``deploy/local/services.sh up`` starts them). The client's tests,
the MCP tests (``tests/mcp``) and the client's benchmark (``benches/client_calls.py``) use it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from idem_client import Idem

REPO = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("IDEM_BIN", REPO / "target" / "debug" / "idem"))
BROKERS = os.environ.get("IDEM_TEST_KAFKA_BROKERS", "127.0.0.1:9092")
POSTGRES = os.environ.get("IDEM_TEST_POSTGRES_URL", "postgres://idem:idem@127.0.0.1:5432/idem")

TOOLS = """
[[tools]]
name = "send_email"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.to", "args.template"]
executor = {{ kind = "http", url = "{downstream}/v1/send_email", timeout = "1s" }}
verify = {{ url = "{downstream}/v1/effects/{{key}}", max_attempts = 10, backoff = "100ms" }}
retry = {{ max_attempts = 3, initial_backoff = "10ms", max_backoff = "50ms" }}

# No verify and a downstream that does not honour the key: gated by default.
[[tools]]
name = "refund"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.order_id", "args.amount"]
executor = {{ kind = "http", url = "{downstream}/v1/refund", timeout = "2s" }}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(what: str, within: float, check: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + within
    while True:
        try:
            value = check()
            if value:
                return value
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        time.sleep(0.05)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


class Stack:
    """One test's relay (stoppable, killable, restartable) and downstream, with topics, group
    and schema of its own."""

    def __init__(self, tmp: Path, tools: str = TOOLS, env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.env = {**os.environ, **(env or {})}
        base = f"t_{uuid.uuid4().hex[:12]}"
        self.actions, self.outcomes = f"{base}.actions", f"{base}.outcomes"
        self.downstream_port = free_port()
        self.downstream = f"http://127.0.0.1:{self.downstream_port}"
        self.admin_port = free_port()
        self._fake = subprocess.Popen(
            [BIN, "fake-downstream", "--listen", f"127.0.0.1:{self.downstream_port}"],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / "downstream.log", "wb"),
        )
        eventually("the fake downstream", 20, lambda: get_json(f"{self.downstream}/_counts"))
        self.config = tmp / "idem.toml"
        self.config.write_text(
            f"""
[kafka]
brokers = "{BROKERS}"
group_id = "{base}.group"
actions_topic = "{self.actions}"
outcomes_topic = "{self.outcomes}"
dlq_topic = "{base}.dlq"
partitions = 6

[postgres]
url = "{POSTGRES}"
schema = "{base}"

[relay]
lease = "3s"
recovery_interval = "500ms"
outbox_poll_interval = "200ms"
shutdown_grace = "10s"

[admin]
listen = "127.0.0.1:{self.admin_port}"
"""
            + tools.format(downstream=self.downstream)
        )
        self.idem("migrate")
        self.relay: subprocess.Popen[bytes] | None = None
        self.start()

    def idem(self, *args: str) -> str:
        out = subprocess.run(
            [BIN, *args[:1], "--config", str(self.config), *args[1:]],
            capture_output=True,
            timeout=60,
        )
        assert out.returncode == 0, f"idem {' '.join(args)}: {out.stderr.decode()}"
        return out.stdout.decode()

    def start(self) -> None:
        log = open(self.tmp / "relay.log", "ab")
        self.relay = subprocess.Popen(
            [BIN, "relay", "--config", str(self.config)], stdout=log, stderr=log, env=self.env
        )

        def ready() -> bool:
            assert self.relay is not None and self.relay.poll() is None, (self.tmp / "relay.log").read_text()
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/readyz", timeout=2) as r:
                return r.status == 200

        eventually("the relay to be ready", 60, ready)

    def kill(self) -> None:
        assert self.relay is not None
        self.relay.send_signal(signal.SIGKILL)
        self.relay.wait(30)
        self.relay = None

    def stop(self) -> None:
        if self.relay is not None:
            self.relay.send_signal(signal.SIGTERM)
            assert self.relay.wait(60) == 0, (self.tmp / "relay.log").read_text()
            self.relay = None

    def effects(self, key: str | None = None) -> int:
        counts = get_json(f"{self.downstream}/_counts")
        return counts["total"] if key is None else counts["by_key"].get(key, 0)

    def requests(self) -> int:
        """Requests the downstream has received, effects or not."""
        return get_json(f"{self.downstream}/_counts")["requests"]

    def script(self, key: str, steps: list[Any]) -> None:
        body = json.dumps({"key": key, "steps": steps}).encode()
        req = urllib.request.Request(
            f"{self.downstream}/_script", data=body, headers={"content-type": "application/json"}
        )
        urllib.request.urlopen(req, timeout=5).close()

    def client(self) -> Idem:
        return Idem(BROKERS, self.actions, self.outcomes, source="pytest")

    def close(self) -> None:
        if self.relay is not None:
            self.relay.kill()
            self.relay.wait(30)
        self._fake.kill()
        self._fake.wait(30)


def stack_fixtures(tools: str = TOOLS, env: dict[str, str] | None = None) -> tuple[Any, Any]:
    """The ``stack`` (one per module) and ``own_stack`` (one per test, for a test that stops,
    kills or restarts its relay) fixtures over ``tools``; a conftest binds them to those names."""

    @pytest.fixture(scope="module")
    def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
        s = Stack(tmp_path_factory.mktemp("stack"), tools, env)
        yield s
        s.close()

    @pytest.fixture
    def own_stack(tmp_path: Path) -> Iterator[Stack]:
        s = Stack(tmp_path, tools, env)
        yield s
        s.close()

    return stack, own_stack
