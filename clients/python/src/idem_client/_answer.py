"""What a framework's tool returns to the model for an outcome: the note, then the result or
the error. Shared by the adapters, so every framework's model reads the same words."""

from __future__ import annotations

import json

from typing import Any, Mapping

from ._client import Idem
from ._errors import CallTimeout
from ._outcome import Outcome


def for_model(outcome: Outcome) -> str:
    """The outcome's note first (it says whether to retry), then what came of it as JSON."""
    if outcome.status == "succeeded":
        body = json.dumps(outcome.result, default=str)
    elif outcome.error is not None:
        body = json.dumps(
            {"error": outcome.error.code, "message": outcome.error.message, "fields": outcome.error.fields}
        )
    else:
        body = json.dumps({"status": outcome.status})
    return f"{outcome.note}\n{body}"


def timed_out(tool: str, timeout: float) -> str:
    """What the model reads when no outcome came in time: retrying is safe, and how."""
    return (
        f"No answer from {tool} within {timeout}s; it may still be running. Calling it again "
        "with the same arguments returns its outcome; it is never executed twice."
    )


async def call(
    idem: Idem,
    tool: str,
    args: Mapping[str, Any],
    *,
    run_id: str,
    business_id: str | None,
    timeout: float,
) -> "Outcome | str":
    """One call for an adapter: every status returned, a timeout said in words for the model."""
    try:
        return await idem.acall(
            tool, args, run_id=run_id, business_id=business_id, timeout=timeout, raise_on_status=False
        )
    except CallTimeout:
        return timed_out(tool, timeout)
