"""One agent's calls through the Python client (clients/python), one at a time, against a real
relay, Kafka, Postgres and fake downstream: how long a call takes from ``call()`` to its answer.

    IDEM_BIN=target/release/idem python benches/client_calls.py [--calls N] [--linger 0,2]

Run it with the Python of ``deploy/test.sh`` (``~/.cache/idem-local/venv-python``, which has the
client and pytest); the local services must be up (``bash deploy/local/services.sh up``). Each
``--linger`` value is a client of its own (its producer's ``linger.ms``), and the calls go to
them in turn, one each and again, so a change in the host's speed during the run falls on every
client alike. Prints one line per client; fails if a call is not answered as a first success or
the downstream's effects differ from the calls made.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients" / "python" / "tests"))

from stack import BROKERS, Stack  # noqa: E402

from idem_client import Idem  # noqa: E402

ARGS = {"to": "customer-1", "template": "refund_approved"}


def quantile(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(len(sorted_ms) * q))]


def main() -> None:
    parser = argparse.ArgumentParser(description="One agent's calls through the Python client.")
    parser.add_argument("--calls", type=int, default=300, help="measured calls per client")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured calls per client first")
    parser.add_argument("--linger", default="0", help="comma-separated linger.ms, a client each")
    opts = parser.parse_args()
    lingers = [int(v) for v in opts.linger.split(",")]
    if len(set(lingers)) != len(lingers):
        parser.error(f"--linger names a value twice: {opts.linger}")
    tmp = Path(tempfile.mkdtemp(prefix="client_calls_"))
    stack = Stack(tmp)
    try:
        clients = {
            ms: Idem(
                BROKERS,
                stack.actions,
                stack.outcomes,
                source="client-calls",
                kafka_config={"linger.ms": ms},
            )
            for ms in lingers
        }
        run = uuid.uuid4().hex[:12]
        took: dict[int, list[float]] = {ms: [] for ms in lingers}
        for i in range(opts.warmup + opts.calls):
            for ms, client in clients.items():
                start = time.perf_counter()
                outcome = client.call("send_email", ARGS, run_id=run, business_id=f"{ms}-{i}")
                elapsed = (time.perf_counter() - start) * 1000
                if outcome.status != "succeeded" or outcome.duplicate:
                    sys.exit(f"call {ms}-{i} answered {outcome.status}, duplicate {outcome.duplicate}")
                if i >= opts.warmup:
                    took[ms].append(elapsed)
        for client in clients.values():
            client.close()
        made = (opts.warmup + opts.calls) * len(lingers)
        effects = stack.effects()
        for ms, ts in took.items():
            ts.sort()
            print(
                f"linger.ms={ms}: {len(ts)} calls, p50 {statistics.median(ts):.2f} ms, "
                f"p90 {quantile(ts, 0.9):.2f}, p99 {quantile(ts, 0.99):.2f}"
            )
        print(f"effects == calls: {effects} == {made}")
        if effects != made:
            sys.exit("the downstream's effects differ from the calls made")
    finally:
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
