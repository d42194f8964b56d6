"""The runnable examples (examples/python), run against this test's relay: each prints the
seed trace and exactly one email sent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stack import BROKERS, REPO, Stack

EXAMPLES = REPO / "examples" / "python"


@pytest.mark.parametrize(
    "example", ["openai_agents_seed_trace.py", "langgraph_seed_trace.py", "pydantic_ai_seed_trace.py"]
)
def test_each_example_sends_one_email(stack: Stack, example: str) -> None:
    env = {
        **os.environ,
        "IDEM_KAFKA_BROKERS": BROKERS,
        "IDEM_ACTIONS_TOPIC": stack.actions,
        "IDEM_OUTCOMES_TOPIC": stack.outcomes,
        "IDEM_EXAMPLE_DOWNSTREAM": stack.downstream,
    }
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / example)], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "emails sent: 1", out.stdout
    assert any(line.startswith("step 5:") and "not repeated" in line for line in lines), out.stdout
