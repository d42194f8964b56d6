"""The MCP server (`idem mcp` on stdio, `/mcp` on the admin listener) driven by the official
Python MCP SDK, against the real relay, Kafka and Postgres; effects counted at a downstream that
does not dedupe. The stack is the Python client's (``clients/python/tests/stack.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python" / "tests"))

from stack import stack_fixtures  # noqa: E402

ADMIN_TOKEN = "mcp-test-admin-token-0123456789"
READ_TOKEN = "mcp-test-read-token-0123456789"

# `to` is the key: a model that rewords the body is repeating itself, one that changes the
# template for the same recipient is changing its mind (a conflict, not a second email).
TOOLS = """
[[tools]]
name = "send_email"
class = "dangerous"
description = "Send one email to a customer from a template."
key = ["run_id", "tool", "args.to"]
material = ["args.to", "args.template"]
executor = {{ kind = "http", url = "{downstream}/v1/send_email", timeout = "1s" }}
verify = {{ url = "{downstream}/v1/effects/{{key}}", max_attempts = 10, backoff = "100ms" }}
retry = {{ max_attempts = 3, initial_backoff = "10ms", max_backoff = "50ms" }}

[tools.input_schema]
type = "object"
required = ["to", "template"]
additionalProperties = false
properties = {{ to = {{ type = "string" }}, template = {{ type = "string" }}, body = {{ type = "string" }} }}

# No verify and a downstream that does not honour the key: gated by default.
[[tools]]
name = "refund"
class = "dangerous"
description = "Refund an order."
key = ["run_id", "tool", "args.order_id"]
material = ["args.order_id", "args.amount"]
executor = {{ kind = "http", url = "{downstream}/v1/refund", timeout = "2s" }}

[[tools]]
name = "order_status"
class = "read_only"
key = ["run_id", "tool", "args.order_id"]
executor = {{ kind = "http", url = "{downstream}/v1/order_status", timeout = "2s" }}
"""


stack, own_stack = stack_fixtures(
    TOOLS, {"IDEM_ADMIN_TOKEN": ADMIN_TOKEN, "IDEM_ADMIN_READ_TOKEN": READ_TOKEN}
)
