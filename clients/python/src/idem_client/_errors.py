"""What :meth:`Idem.call` raises for an outcome that is not a success, named for what happened."""

from __future__ import annotations

from ._outcome import Outcome


class IdemError(Exception):
    """Base of every outcome the client raises for."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.note or outcome.status)
        self.outcome = outcome

    @property
    def key(self) -> str:
        return self.outcome.idempotency_key


class _WithError(IdemError):
    @property
    def code(self) -> str:
        return self.outcome.error.code if self.outcome.error else ""

    @property
    def message(self) -> str:
        return self.outcome.error.message if self.outcome.error else ""

    @property
    def retryable(self) -> bool:
        return bool(self.outcome.error and self.outcome.error.retryable)

    @property
    def fields(self) -> list[str]:
        return list(self.outcome.error.fields) if self.outcome.error else []

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.code else super().__str__()


class Rejected(_WithError):
    """Not accepted; nothing was executed (``key_conflict``, ``schema_invalid``, a gate …)."""


class Failed(_WithError):
    """Not done: the downstream refused, or stayed unavailable (``retryable`` says whether a new
    request may succeed later)."""


class PendingApproval(IdemError):
    """Waiting for a person (``idem approve``). Do not retry: :meth:`Idem.wait` waits for the
    decision."""


class OutcomeUnknown(IdemError):
    """It may or may not have happened, and nothing downstream could tell. The client never
    retries it: a person resolves it (``idem resolve``)."""


class CallTimeout(TimeoutError):
    """No outcome within the call's timeout. The action may still run: calling again with the
    same run id and business id (and args) is answered from the record, never executed twice."""

    def __init__(self, event_id: str, tool: str, run_id: str, timeout: float) -> None:
        super().__init__(
            f"no outcome for action {event_id} ({tool}, run {run_id}) within {timeout}s; "
            "call again with the same run id and business id to resume"
        )
        self.event_id = event_id
        self.tool = tool
        self.run_id = run_id
